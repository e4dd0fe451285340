"""Block allocator for a paged (block-layout) KV cache, with prefix caching. Imports no torch.

NxD Inference does not manage the block KV cache itself: the caller hands it block tables and
slot mappings with every request. This class is that caller-side manager.

Model
-----
* The cache holds ``num_blocks`` blocks of ``block_size`` token slots. A request owns a *block
  table* (its block ids in token order); token position ``p`` lives in slot
  ``block_table[p // block_size] * block_size + p % block_size``.
* A block is *sealed* once it is full and the KV of all its tokens has been written. Only then
  is it hashed and entered in the hash index, so other requests can share it. The hash chains
  the parent block's hash, so equal hashes mean equal whole prefixes, not just equal blocks.
  A block that is merely full is never shared: its KV may still be pending.
* "Written" is learnt two ways: ``mark_computed(rid, n)`` (e.g. after a prefill forward, or
  after KV arrived from a prefill worker), and ``append_token`` — a sampled token comes from a
  forward pass over every earlier position, so all tokens before it have KV.
* Freed blocks return to the free pool. Sealed ones keep their hash and can be revived by a
  later request with the same prefix until allocation reuses (evicts) them. Allocation takes
  unhashed blocks first, then hashed ones least-recently-freed first; a request's blocks are
  freed tail-first so a prefix's deep blocks are evicted before its shared head.
* A prompt's last token is always recomputed (the model needs its logits), so at most
  ``len(prompt) - 1`` tokens are reported cached and only blocks wholly before the last prompt
  token are matched.
* ``journal`` (nxdi_common.cache_journal) numbers every hash entering the index (sealed) and
  leaving it (evicted), for routers that follow what the cache holds (load reports).
* ``allocate(..., reserve_tokens=n)`` reserves blocks for ``n`` future tokens up front;
  ``append_token`` grows the table only past the reservation, and ``grow`` to a token count
  without recording tokens (the decode worker's on-demand growth: a block for the next token's
  KV just before the step that writes it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from nxdi_common.cache_journal import MASK64, CacheJournal


class OutOfBlocks(RuntimeError):
    """Not enough free KV-cache blocks; the manager's state is unchanged."""


@dataclass
class Allocation:
    """Result of ``allocate``: the request's block table and how many prompt tokens hit cache."""

    block_table: list[int]
    num_cached_tokens: int


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set only while the hash index points at this block
    token_ids: tuple[int, ...] = ()  # the sealed tokens, to rule out hash collisions


@dataclass
class _Request:
    block_table: list[int]
    token_ids: list[int]
    num_computed: int  # leading tokens whose KV is written
    num_sealed: int = 0  # leading blocks whose chained hash is known
    last_hash: int | None = None  # chained hash of block num_sealed - 1


def salt_root(salt: str = "") -> int | None:
    """The chain's root for a request's cache salt (vLLM's cache_salt): None without one, else
    a 128-bit hash of it that the first block's hash chains on, so that only requests with the
    same salt share cached blocks (a tenant cannot learn from timing what another's prompts
    held)."""
    if not salt:
        return None
    return int.from_bytes(hashlib.blake2b(b"salt:" + salt.encode(), digest_size=16).digest(),
                          "little")


def chain_hash(parent: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    """128-bit hash of a full block's tokens, chained on its parent block's hash."""
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(b"root" if parent is None else parent.to_bytes(16, "little"))
    hasher.update(array("q", token_ids).tobytes())
    return int.from_bytes(hasher.digest(), "little")


class BlockManager:
    """Allocates KV-cache blocks to requests, sharing sealed prefix blocks by chained hash."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got "
                             f"{num_blocks} and {block_size}")
        self._block_size = block_size
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._requests: dict[str, _Request] = {}
        self.enable_prefix_caching = enable_prefix_caching
        # every hash entering or leaving _hash_to_block, for routers (load reports)
        self.journal = CacheJournal(max_events=max(4 * num_blocks, 1024))

    # ---- sizes ------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks holding ``num_tokens`` tokens."""
        return -(-num_tokens // self._block_size)

    # ---- admission --------------------------------------------------------------------------

    def can_allocate(self, token_ids: list[int], reserve_tokens: int = 0,
                     spare_blocks: int = 0, salt: str = "") -> bool:
        """Whether ``allocate(_, token_ids, reserve_tokens, salt)`` would succeed now and leave
        at least ``spare_blocks`` free."""
        required = self._free_blocks_required(token_ids, reserve_tokens, salt)[1]
        return required + spare_blocks <= self.num_free_blocks

    def allocate(self, request_id: str, token_ids: list[int],
                 reserve_tokens: int = 0, salt: str = "") -> Allocation:
        """Give a new request blocks for its prompt plus ``reserve_tokens`` future tokens.

        Leading sealed blocks with a matching chained hash (rooted at the request's cache
        ``salt``, salt_root) are shared (or revived from the free pool). Raises OutOfBlocks,
        leaving the state unchanged, if the blocks are not there.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks; free it first")
        matched, required = self._free_blocks_required(token_ids, reserve_tokens, salt)
        if required > self.num_free_blocks:
            raise OutOfBlocks(f"request {request_id!r} needs {required} free blocks, "
                              f"{self.num_free_blocks} are free")
        for block_id in matched:  # revive before popping, so a match is never evicted
            self._acquire(block_id)
        num_new = self.blocks_needed(len(token_ids) + reserve_tokens) - len(matched)
        table = matched + [self._pop_free() for _ in range(num_new)]
        cached = len(matched) * self._block_size
        last_hash = self._blocks[matched[-1]].hash if matched else salt_root(salt)
        self._requests[request_id] = _Request(table, list(token_ids), cached,
                                              len(matched), last_hash)
        return Allocation(list(table), cached)

    def _free_blocks_required(self, token_ids: list[int], reserve_tokens: int,
                              salt: str = "") -> tuple[list[int], int]:
        """(matched prefix block ids, free-pool blocks the allocation would take)."""
        if not token_ids:
            raise ValueError("a request needs at least one prompt token")
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        matched = self._match_prefix(token_ids, salt)
        total = self.blocks_needed(len(token_ids) + reserve_tokens)
        revived = sum(1 for b in matched if self._blocks[b].ref_count == 0)
        return matched, total - len(matched) + revived

    def cached_prefix_tokens(self, token_ids: list[int], salt: str = "") -> int:
        """Leading tokens of ``token_ids`` whose KV the cache holds now (whole sealed blocks,
        short of the last token: what ``allocate`` would share). Reads only; from a thread
        other than the one allocating it is an estimate (the blocks may be evicted first)."""
        return len(self._match_prefix(token_ids, salt)) * self._block_size

    def _match_prefix(self, token_ids: list[int], salt: str = "") -> list[int]:
        """Ids of the leading sealed blocks matching the prompt (its chain rooted at ``salt``),
        short of its last token."""
        if not self.enable_prefix_caching:
            return []
        matched, parent, size = [], salt_root(salt), self._block_size
        for start in range(0, len(token_ids) - size, size):
            chunk = tuple(token_ids[start:start + size])
            parent = chain_hash(parent, chunk)
            block_id = self._hash_to_block.get(parent)
            if block_id is None or self._blocks[block_id].token_ids != chunk:
                break
            matched.append(block_id)
        return matched

    # ---- decoding ---------------------------------------------------------------------------

    def can_append(self, request_id: str) -> bool:
        """Whether ``append_token`` would succeed now."""
        req = self._get(request_id)
        return self._has_room(req) or self.num_free_blocks > 0

    def append_token(self, request_id: str, token_id: int) -> None:
        """Record a generated token, growing the table past the reservation if needed.

        All tokens before it now count as computed, which may seal (and share) a block.
        Raises OutOfBlocks, with nothing recorded, if a block is needed and none is free.
        """
        req = self._get(request_id)
        if not self._has_room(req):
            if not self._free:
                raise OutOfBlocks(f"request {request_id!r} needs one more block, none is free")
            req.block_table.append(self._pop_free())
        req.num_computed = max(req.num_computed, len(req.token_ids))
        req.token_ids.append(token_id)
        self._seal_ready(req)

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Make the request's table hold ``num_tokens`` token slots, taking free blocks; returns
        the ids taken, in table order (none when it holds them already). Raises OutOfBlocks,
        taking nothing, if the free pool is short."""
        req = self._get(request_id)
        more = self.blocks_needed(num_tokens) - len(req.block_table)
        if more <= 0:
            return []
        if more > len(self._free):
            raise OutOfBlocks(f"request {request_id!r} needs {more} more blocks, "
                              f"{len(self._free)} are free")
        taken = [self._pop_free() for _ in range(more)]
        req.block_table.extend(taken)
        return taken

    def record_written(self, request_id: str, token_ids) -> None:
        """Record tokens whose KV is already written in slots the table holds (``grow`` took
        them): the tokens a sequence generated and fed back. Full blocks are sealed, so a later
        request that repeats the whole text (the next turn of a chat) shares them. Raises
        ValueError, recording nothing, when the table cannot hold them."""
        req = self._get(request_id)
        total = len(req.token_ids) + len(token_ids)
        if total > len(req.block_table) * self._block_size:
            raise ValueError(f"request {request_id!r}: {total} tokens do not fit its "
                             f"{len(req.block_table)} blocks")
        req.token_ids.extend(token_ids)
        req.num_computed = max(req.num_computed, total)
        self._seal_ready(req)

    def mark_computed(self, request_id: str, num_tokens: int) -> None:
        """Declare the KV of the first ``num_tokens`` tokens written; seals full blocks."""
        req = self._get(request_id)
        if not 0 <= num_tokens <= len(req.token_ids):
            raise ValueError(f"request {request_id!r} has {len(req.token_ids)} tokens, "
                             f"cannot mark {num_tokens} computed")
        req.num_computed = max(req.num_computed, num_tokens)
        self._seal_ready(req)

    def _has_room(self, req: _Request) -> bool:
        return len(req.token_ids) < len(req.block_table) * self._block_size

    def _seal_ready(self, req: _Request) -> None:
        """Hash every block that is full and computed; index it unless an equal one exists."""
        if not self.enable_prefix_caching:
            return
        size = self._block_size
        while (req.num_sealed + 1) * size <= req.num_computed:
            start = req.num_sealed * size
            chunk = tuple(req.token_ids[start:start + size])
            req.last_hash = chain_hash(req.last_hash, chunk)
            block = self._blocks[req.block_table[req.num_sealed]]
            if req.last_hash not in self._hash_to_block:  # else keep this copy private
                block.hash, block.token_ids = req.last_hash, chunk
                self._hash_to_block[req.last_hash] = block.block_id
                self.journal.stored(req.last_hash)
            req.num_sealed += 1

    # ---- release ----------------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Release a request's blocks; unreferenced sealed blocks stay revivable until reused."""
        if request_id not in self._requests:
            raise KeyError(f"unknown request {request_id!r}: not allocated or already freed")
        req = self._requests.pop(request_id)
        for block_id in reversed(req.block_table):  # tail first: evicted before the head
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(block_id, last=False)

    def _acquire(self, block_id: int) -> None:
        """Add a reference to a matched block, reviving it from the free pool if needed."""
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        """Take the next free block, evicting its cached hash if it has one."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.hash is not None:
            del self._hash_to_block[block.hash]
            self.journal.removed(block.hash)
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    # ---- queries ----------------------------------------------------------------------------

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}: not allocated or already freed") \
                from None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (reserved blocks included)."""
        return list(self._get(request_id).block_table)

    def num_tokens(self, request_id: str) -> int:
        """Prompt plus generated tokens recorded for the request."""
        return len(self._get(request_id).token_ids)

    def num_computed_tokens(self, request_id: str) -> int:
        """Leading tokens of the request whose KV is written (or shared from cache)."""
        return self._get(request_id).num_computed

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Cache slots of token positions ``[start, end)``: block_id * block_size + offset."""
        req = self._get(request_id)
        if not 0 <= start <= end <= len(req.token_ids):
            raise ValueError(f"positions [{start}, {end}) out of range for request "
                             f"{request_id!r} with {len(req.token_ids)} tokens")
        size = self._block_size
        return [req.block_table[p // size] * size + p % size for p in range(start, end)]

    # ---- integrity --------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError describing every inconsistency found in the internal state."""
        problems = self._check_blocks() + self._check_index() + self._check_requests()
        if problems:
            raise RuntimeError("block manager inconsistent: " + "; ".join(problems))

    def _check_blocks(self) -> list[str]:
        """Ref counts match table references; each block is either free or used."""
        refs = [0] * self.num_blocks
        for req in self._requests.values():
            for block_id in req.block_table:
                refs[block_id] += 1
        problems = []
        for block, expected in zip(self._blocks, refs):
            if block.ref_count != expected:
                problems.append(f"block {block.block_id} ref_count {block.ref_count} but "
                                f"{expected} table references")
            if (block.ref_count == 0) != (block.block_id in self._free):
                problems.append(f"block {block.block_id} with ref_count {block.ref_count} "
                                f"is {'' if block.block_id in self._free else 'not '}free")
        if len(self._free) + sum(1 for r in refs if r) != self.num_blocks:
            problems.append(f"{len(self._free)} free + used blocks != {self.num_blocks}")
        return problems

    def _check_index(self) -> list[str]:
        """Hash index and block hashes agree both ways; hashed blocks are full."""
        problems = [f"hash index points at block {b} which carries another hash"
                    for h, b in self._hash_to_block.items() if self._blocks[b].hash != h]
        for block in self._blocks:
            if block.hash is None:
                continue
            if self._hash_to_block.get(block.hash) != block.block_id:
                problems.append(f"block {block.block_id} carries a hash not indexed to it")
            if len(block.token_ids) != self._block_size:
                problems.append(f"hashed block {block.block_id} holds "
                                f"{len(block.token_ids)} tokens")
        if set(self.journal.since(0, 0).stored) != {h & MASK64 for h in self._hash_to_block}:
            problems.append("the cache journal's blocks differ from the hash index")
        return problems

    def _check_requests(self) -> list[str]:
        """Each table is duplicate-free, holds its tokens, and sealing never passes computing."""
        problems = []
        for rid, req in self._requests.items():
            if len(set(req.block_table)) != len(req.block_table):
                problems.append(f"request {rid!r} lists a block twice")
            if len(req.token_ids) > len(req.block_table) * self._block_size:
                problems.append(f"request {rid!r} has more tokens than table slots")
            if not req.num_sealed * self._block_size <= req.num_computed <= len(req.token_ids):
                problems.append(f"request {rid!r} sealed {req.num_sealed} blocks, computed "
                                f"{req.num_computed} of {len(req.token_ids)} tokens")
        return problems
