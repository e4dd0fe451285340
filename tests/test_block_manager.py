"""Block allocator with prefix caching: exact block ids, sharing, revival, eviction, integrity."""

import random
import subprocess
import sys

import pytest

from nxdi_common.block_manager import Allocation, BlockManager, OutOfBlocks


def tokens(start, count):
    """``count`` consecutive token ids from ``start``."""
    return list(range(start, start + count))


@pytest.fixture
def bm():
    manager = BlockManager(num_blocks=8, block_size=4)
    yield manager
    manager.check_integrity()


def snapshot(manager, request_ids):
    return (manager.num_free_blocks, {r: manager.block_table(r) for r in request_ids},
            {r: manager.num_tokens(r) for r in request_ids})


# ---- basics --------------------------------------------------------------------------------

def test_sizes_and_blocks_needed(bm):
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks, bm.num_used_blocks) == (8, 4, 8, 0)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_bad_construction():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(8, 0)


def test_allocate_fresh_blocks_in_order(bm):
    assert bm.allocate("a", tokens(0, 10)) == Allocation([0, 1, 2], 0)
    assert bm.allocate("b", tokens(100, 1)) == Allocation([3], 0)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (4, 4)
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.num_tokens("a") == 10 and bm.num_computed_tokens("a") == 0
    assert "a" in bm and "z" not in bm


def test_reserve_tokens_allocates_up_front(bm):
    assert bm.allocate("a", tokens(0, 5), reserve_tokens=6).block_table == [0, 1, 2]
    for t in range(6):  # fits the reservation: no new block
        bm.append_token("a", 50 + t)
    bm.append_token("a", 98)  # token 12 fills the last reserved slot
    assert bm.block_table("a") == [0, 1, 2] and bm.num_free_blocks == 5
    bm.append_token("a", 99)  # token 13 goes past the reservation
    assert bm.block_table("a") == [0, 1, 2, 3]


def test_bad_requests(bm):
    bm.allocate("a", [1])
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate("a", [1])
    with pytest.raises(ValueError, match="at least one prompt token"):
        bm.allocate("b", [])
    with pytest.raises(ValueError, match="reserve_tokens"):
        bm.allocate("b", [1], reserve_tokens=-1)
    with pytest.raises(KeyError, match="unknown request 'nope'"):
        bm.free("nope")
    with pytest.raises(KeyError, match="unknown request 'nope'"):
        bm.append_token("nope", 1)
    bm.free("a")
    with pytest.raises(KeyError, match="already freed"):
        bm.free("a")


def test_slot_mapping(bm):
    bm.allocate("a", tokens(0, 9))
    bm.mark_computed("a", 9)
    bm.allocate("b", tokens(0, 8) + [77, 78])  # shares blocks 0 and 1
    assert bm.block_table("b") == [0, 1, 3]
    assert bm.slot_mapping("b", 0, 10) == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13]
    assert bm.slot_mapping("b", 8, 10) == [12, 13]
    assert bm.slot_mapping("b", 3, 3) == []
    with pytest.raises(ValueError, match=r"positions \[8, 11\) out of range"):
        bm.slot_mapping("b", 8, 11)


# ---- prefix sharing ------------------------------------------------------------------------

def test_no_sharing_before_kv_is_written(bm):
    bm.allocate("a", tokens(0, 10))
    assert bm.allocate("b", tokens(0, 10)) == Allocation([3, 4, 5], 0)


def test_sharing_after_mark_computed(bm):
    bm.allocate("a", tokens(0, 10))
    bm.mark_computed("a", 10)  # seals blocks 0 and 1 (block 2 holds only 2 tokens)
    assert bm.allocate("c", tokens(0, 10)) == Allocation([0, 1, 3], 8)
    assert bm.num_computed_tokens("c") == 8
    assert bm.num_used_blocks == 4
    bm.free("a")
    assert bm.num_free_blocks == 5  # blocks 0 and 1 are still held by "c"
    assert bm.block_table("c") == [0, 1, 3]


def test_partial_prefix_match(bm):
    bm.allocate("a", tokens(0, 12))
    bm.mark_computed("a", 12)
    prompt = tokens(0, 6) + [99, 99, 99]  # diverges inside block 1
    assert bm.allocate("b", prompt) == Allocation([0, 3, 4], 4)


def test_last_prompt_token_is_never_cached(bm):
    bm.allocate("a", tokens(0, 8))
    bm.mark_computed("a", 8)
    # All 8 tokens are cached, but the last one must be recomputed: only block 0 is shared.
    assert bm.allocate("b", tokens(0, 8)) == Allocation([0, 2], 4)
    # One more token makes both full blocks shareable.
    assert bm.allocate("c", tokens(0, 9)) == Allocation([0, 1, 3], 8)


def test_duplicate_sealed_block_stays_private(bm):
    bm.allocate("a", tokens(0, 8))
    bm.mark_computed("a", 8)
    bm.allocate("b", tokens(0, 8))  # [0, 2]; block 2 recomputes tokens 4..7
    bm.mark_computed("b", 8)  # block 2 equals block 1: not indexed a second time
    bm.free("a")
    bm.free("b")
    bm.check_integrity()
    # Block 2 went back uncached (reused first); blocks 1 and 0 are cached at the tail.
    assert bm.allocate("c", tokens(500, 1)).block_table == [2]
    assert bm.allocate("d", tokens(0, 9)) == Allocation([0, 1, 3], 8)


def test_hash_chains_the_parent(bm):
    bm.allocate("a", [9, 9, 9, 9] + tokens(0, 4) + [7])
    bm.mark_computed("a", 9)
    # Same block content at another position, or after another parent, is not a match.
    assert bm.allocate("b", tokens(0, 4) + [7]).num_cached_tokens == 0
    assert bm.allocate("c", [8, 8, 8, 8] + tokens(0, 4) + [7]).num_cached_tokens == 0
    bm.free("b")
    bm.free("c")
    assert bm.allocate("d", [9, 9, 9, 9] + tokens(0, 4) + [1]).num_cached_tokens == 8


def test_a_cache_salt_shares_blocks_only_with_its_own_salt(bm):
    """vLLM's cache_salt roots the hash chain: the same prompt under another salt (or none)
    matches nothing, under the same salt it shares; the journal and the router's block_hashes
    name the same salted hashes."""
    from nxdi_common.cache_journal import MASK64
    from router.prefix_index import block_hashes
    prompt = tokens(0, 9)
    bm.allocate("a", prompt, salt="tenant-1")
    bm.mark_computed("a", 9)
    assert bm.cached_prefix_tokens(prompt) == 0
    assert bm.cached_prefix_tokens(prompt, "tenant-2") == 0
    assert bm.cached_prefix_tokens(prompt, "tenant-1") == 8
    # 21 tokens: 6 blocks, 5 free; under its salt 2 of them are shared
    assert bm.can_allocate(prompt, 12, salt="tenant-1")
    assert not bm.can_allocate(prompt, 12, salt="tenant-2") and not bm.can_allocate(prompt, 12)
    assert bm.allocate("b", prompt).num_cached_tokens == 0
    assert bm.allocate("c", prompt, salt="tenant-1").num_cached_tokens == 8
    report = bm.journal.since(0, 0)
    assert set(report.stored) == {h & MASK64 for h in block_hashes(prompt, 4, "tenant-1")}
    assert not set(report.stored) & {h & MASK64 for h in block_hashes(prompt, 4)}
    bm.mark_computed("b", 9)  # the unsalted copy seals under its own hashes
    assert bm.cached_prefix_tokens(prompt) == 8


def test_cached_prefix_tokens_reads_what_allocate_would_share(bm):
    bm.allocate("a", tokens(0, 9))
    assert bm.cached_prefix_tokens(tokens(0, 9)) == 0  # nothing computed yet
    bm.mark_computed("a", 9)
    free_before = bm.num_free_blocks
    prompts = (tokens(0, 9), tokens(0, 8), tokens(0, 5), tokens(0, 4) + [1] * 5, [3] + tokens(1, 8))
    # whole blocks of 4, short of the last token; chained from the first
    assert [bm.cached_prefix_tokens(p) for p in prompts] == [8, 4, 4, 4, 0]
    assert bm.num_free_blocks == free_before  # it only reads
    assert bm.allocate("b", tokens(0, 9)).num_cached_tokens == 8


def test_prefix_caching_disabled():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    bm.allocate("a", tokens(0, 10))
    bm.mark_computed("a", 10)
    assert bm.allocate("b", tokens(0, 10)) == Allocation([3, 4, 5], 0)
    bm.check_integrity()


# ---- decoding ------------------------------------------------------------------------------

def test_append_token_seals_generated_blocks(bm):
    bm.allocate("a", [1, 2, 3], reserve_tokens=5)  # [0, 1]
    bm.append_token("a", 4)  # KV of tokens 1..3 written; block 0 full but token 4 pending
    assert bm.allocate("b", [1, 2, 3, 4, 5]).num_cached_tokens == 0
    bm.append_token("a", 5)  # token 4's KV is now written: block 0 sealed
    assert bm.num_computed_tokens("a") == 4
    assert bm.allocate("c", [1, 2, 3, 4, 5]) == Allocation([0, 4], 4)


def test_mark_computed_bounds(bm):
    bm.allocate("a", tokens(0, 5))
    with pytest.raises(ValueError, match="has 5 tokens, cannot mark 6"):
        bm.mark_computed("a", 6)
    bm.mark_computed("a", 3)
    bm.mark_computed("a", 2)  # never goes backwards
    assert bm.num_computed_tokens("a") == 3


def test_append_out_of_blocks_leaves_state_unchanged(bm):
    bm.allocate("a", tokens(0, 4))
    bm.allocate("b", tokens(10, 28))  # takes the other 7 blocks
    before = snapshot(bm, ["a", "b"])
    assert not bm.can_append("a")
    with pytest.raises(OutOfBlocks):
        bm.append_token("a", 5)
    bm.check_integrity()
    assert snapshot(bm, ["a", "b"]) == before
    bm.free("b")
    assert bm.can_append("a")
    bm.append_token("a", 5)
    assert bm.block_table("a") == [0, 1]


def test_grow_takes_blocks_for_a_token_count_or_nothing(bm):
    bm.allocate("a", tokens(0, 5))  # 2 blocks
    assert bm.grow("a", 8) == []  # the table holds 8 slots already
    assert bm.grow("a", 9) == [2] and bm.grow("a", 17) == [3, 4]
    assert bm.block_table("a") == [0, 1, 2, 3, 4] and bm.num_tokens("a") == 5  # no token recorded
    bm.allocate("b", tokens(10, 8))  # 2 of the 3 left: one stays free
    before = snapshot(bm, ["a", "b"])
    with pytest.raises(OutOfBlocks, match="needs 2 more blocks, 1 are free"):
        bm.grow("a", 25)
    bm.check_integrity()
    assert snapshot(bm, ["a", "b"]) == before
    with pytest.raises(KeyError, match="unknown request"):
        bm.grow("z", 4)
    bm.free("a")
    assert bm.num_free_blocks == 6


def test_can_allocate_with_blocks_to_spare(bm):
    bm.allocate("a", tokens(0, 16))  # 4 of 8 blocks
    assert bm.can_allocate(tokens(100, 8), spare_blocks=2)  # 2 taken, 2 left
    assert not bm.can_allocate(tokens(100, 8), spare_blocks=3)
    assert not bm.can_allocate(tokens(100, 8), reserve_tokens=1, spare_blocks=2)


# ---- admission -----------------------------------------------------------------------------

def test_out_of_blocks_leaves_state_unchanged(bm):
    bm.allocate("a", tokens(0, 20))  # 5 blocks
    before = snapshot(bm, ["a"])
    assert not bm.can_allocate(tokens(100, 13))
    with pytest.raises(OutOfBlocks, match="needs 4 free blocks, 3 are free"):
        bm.allocate("b", tokens(100, 13))
    bm.check_integrity()
    assert snapshot(bm, ["a"]) == before
    assert "b" not in bm
    assert bm.can_allocate(tokens(100, 12))
    with pytest.raises(OutOfBlocks):
        bm.allocate("b", tokens(100, 4), reserve_tokens=9)


def test_can_allocate_counts_shared_blocks(bm):
    bm.allocate("a", tokens(0, 17))  # 5 blocks, 3 free left
    bm.mark_computed("a", 17)  # seals blocks 0..3
    # 5 blocks needed, 4 shared with "a": one new block suffices.
    assert bm.can_allocate(tokens(0, 17))
    assert not bm.can_allocate(tokens(1000, 17))
    assert bm.allocate("b", tokens(0, 17)) == Allocation([0, 1, 2, 3, 5], 16)
    assert bm.num_free_blocks == 2


def test_can_allocate_counts_revived_blocks():
    bm = BlockManager(4, 4)
    bm.allocate("a", tokens(0, 9))  # [0, 1, 2]
    bm.mark_computed("a", 9)
    bm.free("a")
    bm.allocate("x", [500])  # takes block 2 (uncached, reused first)
    # Revived blocks come from the free pool too: 2 revived + 1 new > 3 free is false,
    # 2 revived + 2 new > 3 free is true.
    assert bm.can_allocate(tokens(0, 9))
    assert not bm.can_allocate(tokens(0, 9), reserve_tokens=4)
    assert bm.allocate("b", tokens(0, 9)) == Allocation([0, 1, 3], 8)
    bm.check_integrity()


# ---- free, revival, eviction ---------------------------------------------------------------

def test_revival_after_free(bm):
    bm.allocate("a", tokens(0, 9))  # [0, 1, 2]
    bm.mark_computed("a", 9)
    bm.free("a")
    assert (bm.num_free_blocks, bm.num_used_blocks) == (8, 0)
    # Block 2 (uncached) is reused first; blocks 0 and 1 are revived.
    assert bm.allocate("b", tokens(0, 9)) == Allocation([0, 1, 2], 8)


def test_eviction_is_lru_and_tail_first(bm):
    bm.allocate("a", tokens(0, 9))  # [0, 1, 2]
    bm.allocate("b", tokens(100, 9))  # [3, 4, 5]
    bm.mark_computed("a", 9)
    bm.mark_computed("b", 9)
    bm.free("a")  # cached tail order: 1, 0
    bm.free("b")  # then 4, 3
    # Free pool: uncached 5, 2, 6, 7 first, then cached 1, 0, 4, 3.
    assert bm.allocate("x", tokens(900, 16)).block_table == [5, 2, 6, 7]
    assert bm.allocate("y", [900]).block_table == [1]  # least recently freed: a's tail
    # b's blocks are revived; the one new block evicts a's head block 0.
    assert bm.allocate("b2", tokens(100, 9)) == Allocation([3, 4, 0], 8)
    assert bm.num_free_blocks == 0
    for rid in ("x", "y", "b2"):
        bm.free(rid)
    assert bm.allocate("a2", tokens(0, 9)).num_cached_tokens == 0


def test_shared_block_survives_one_owner_freeing(bm):
    bm.allocate("a", tokens(0, 9))
    bm.mark_computed("a", 9)
    bm.allocate("b", tokens(0, 9))
    bm.free("a")
    assert bm.allocate("x", tokens(900, 16)).block_table == [2, 4, 5, 6]
    assert bm.block_table("b") == [0, 1, 3]
    assert bm.allocate("c", tokens(0, 5)) == Allocation([0, 7], 4)


# ---- integrity checks catch corruption -----------------------------------------------------

def test_check_integrity_detects_bad_ref_count(bm):
    bm.allocate("a", tokens(0, 5))
    bm._blocks[0].ref_count += 1
    with pytest.raises(RuntimeError, match="block 0 ref_count 2 but 1 table references"):
        bm.check_integrity()
    bm._blocks[0].ref_count -= 1


def test_check_integrity_detects_used_block_in_free_pool(bm):
    bm.allocate("a", tokens(0, 5))
    bm._free[0] = None
    with pytest.raises(RuntimeError, match="block 0 with ref_count 1 is free"):
        bm.check_integrity()
    del bm._free[0]


def test_check_integrity_detects_bad_hash_index(bm):
    bm.allocate("a", tokens(0, 5))
    bm.mark_computed("a", 5)
    bm._hash_to_block[12345] = 1
    with pytest.raises(RuntimeError, match="hash index points at block 1"):
        bm.check_integrity()
    del bm._hash_to_block[12345]


# ---- no torch ------------------------------------------------------------------------------

def test_module_does_not_import_torch():
    code = ("import sys, nxdi_common.block_manager; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- randomized stress ---------------------------------------------------------------------

class KVShadow:
    """Writes each computed token into a fake KV cache and checks what requests read back."""

    def __init__(self, manager):
        self.manager = manager
        self.slots = {}

    def write(self, rid, live, start):
        """Record the KV of the request's tokens [start, computed)."""
        end = self.manager.num_computed_tokens(rid)
        all_tables = [self.manager.block_table(r) for r in live]
        for pos, slot in zip(range(start, end), self.manager.slot_mapping(rid, start, end)):
            block = slot // self.manager.block_size
            assert sum(t.count(block) for t in all_tables) == 1, "wrote into a shared block"
            self.slots[slot] = live[rid][pos]

    def check(self, live):
        """Every computed token of every live request reads back its own token id."""
        for rid, toks in live.items():
            n = self.manager.num_computed_tokens(rid)
            assert [self.slots.get(s) for s in self.manager.slot_mapping(rid, 0, n)] == toks[:n]


def random_prompt(rng, bases):
    """A prefix of one of ``bases`` (so prompts share prefixes) plus a random tail."""
    base = rng.choice(bases)
    return base[:rng.randint(0, len(base))] + [rng.randint(0, 9) for _ in range(rng.randint(1, 6))]


def stress_allocate(rng, bm, live, bases, rid):
    """Allocate a random prompt if it fits, else check OutOfBlocks changed nothing."""
    prompt, reserve = random_prompt(rng, bases), rng.randint(0, 6)
    if not bm.can_allocate(prompt, reserve):
        free_before = bm.num_free_blocks
        with pytest.raises(OutOfBlocks):
            bm.allocate(rid, prompt, reserve)
        assert bm.num_free_blocks == free_before and rid not in bm
        return 0
    hits = bm.allocate(rid, prompt, reserve).num_cached_tokens
    assert hits < len(prompt) and hits % bm.block_size == 0
    assert bm.num_computed_tokens(rid) == hits
    live[rid] = list(prompt)
    return hits


def stress_mark(rng, bm, shadow, live, rid):
    """Mark a random number of tokens computed and write their KV."""
    start, end = bm.num_computed_tokens(rid), rng.randint(0, len(live[rid]))
    bm.mark_computed(rid, end)
    assert bm.num_computed_tokens(rid) == max(start, end)
    shadow.write(rid, live, start)


def stress_append(rng, bm, shadow, live, rid):
    """Append a token if a slot or free block is there, else check OutOfBlocks."""
    start, token = bm.num_computed_tokens(rid), rng.randint(0, 9)
    if not bm.can_append(rid):
        with pytest.raises(OutOfBlocks):
            bm.append_token(rid, token)
        return
    bm.append_token(rid, token)
    assert bm.num_computed_tokens(rid) == max(start, len(live[rid]))  # not the new token
    live[rid].append(token)
    shadow.write(rid, live, start)


def stress_step(rng, bm, shadow, live, bases, step):
    """One random operation; ``live`` maps request id -> its token ids so far."""
    op = rng.choice(["alloc", "alloc", "mark", "append", "append", "free"])
    if op == "alloc" or not live:
        return stress_allocate(rng, bm, live, bases, f"r{step}")
    rid = rng.choice(sorted(live))
    if op == "mark":
        stress_mark(rng, bm, shadow, live, rid)
    elif op == "append":
        stress_append(rng, bm, shadow, live, rid)
    else:
        bm.free(rid)
        del live[rid]
    return 0


def test_randomized_stress():
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=16, block_size=4)
    shadow, live, cached = KVShadow(bm), {}, 0
    bases = [[rng.randint(0, 9) for _ in range(14)] for _ in range(3)]
    for step in range(3000):
        cached += stress_step(rng, bm, shadow, live, bases, step)
        bm.check_integrity()
        shadow.check(live)
        assert bm.num_used_blocks == len({b for r in live for b in bm.block_table(r)})
    assert cached > 0  # sharing actually happened
    for rid in list(live):
        bm.free(rid)
    bm.check_integrity()
    assert bm.num_free_blocks == 16


def test_record_written_seals_grown_blocks_for_the_next_prompt(bm):
    """Tokens generated into blocks taken by grow (the decode worker's way) and recorded with
    record_written are shared by a later prompt that repeats them; too many for the table is a
    ValueError that records nothing."""
    prompt = tokens(100, 6)
    bm.allocate("a", prompt)
    bm.mark_computed("a", 6)
    bm.grow("a", 11)  # 3 blocks
    with pytest.raises(ValueError, match="do not fit"):
        bm.record_written("a", tokens(200, 7))
    assert bm.num_tokens("a") == 6
    bm.record_written("a", tokens(200, 5))  # 11 tokens written: blocks 0 and 1 sealed
    table = bm.block_table("a")
    bm.free("a")
    again = bm.allocate("b", prompt + tokens(200, 5) + [7, 8])
    assert again.num_cached_tokens == 8 and again.block_table[:2] == table[:2]
