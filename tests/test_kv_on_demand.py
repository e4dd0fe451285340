"""A decode worker's KV blocks on demand (decode_service/engine.py module doc): admission takes
the prompt's blocks and one token's, steps take one more block as a sequence needs it, the newest
running sequence is preempted (KV to host memory) when none is free and comes back into new
blocks with the same tokens transformers gives; --reserve-max-tokens keeps the old rule. The
engine is built as the worker builds it (tiny model, eager) and driven here turn by turn."""
import pytest

import hf_reference
from decode_service import main
from hf_reference import greedy
from nxdi_common.serving.errors import Overloaded
from nxdi_common.serving.types import DecodeJob, SamplingOptions, StopOptions

BLOCK = 16
GREEDY = SamplingOptions(temperature=0.0)


def build(model: str, blocks: int, *extra: str):
    args = main.parse_args(["--model", str(model), "--dtype", "float32", "--backend", "eager",
                            "--threads", "1", "--max-model-len", "256", "--kv-blocks", str(blocks),
                            "--block-size", str(BLOCK), "--max-batch-size", "4", *extra])
    return main.build(args)[1]  # the engine, its thread not started: turns are driven here


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    return hf_reference.load(tiny_chat_model)


def admit(engine, rid: str, prompt, max_tokens: int, sink: list | None = None):
    job = DecodeJob(rid, tuple(prompt), GREEDY, StopOptions(max_tokens, ignore_eos=True))
    seq = engine.admit(job, max_tokens, (sink if sink is not None else []).append)
    engine.submit_local_prefill(seq)
    return seq


def run_until_done(engine, seqs, turns: int = 2000) -> None:
    for _ in range(turns):
        if all(s.finished for s in seqs):
            return
        engine._iterate()
    raise AssertionError("the sequences did not finish")


def preemptions(engine) -> float:
    return engine.metrics.value("nxdi_preemptions_total")


def test_admission_takes_the_prompt_and_one_token_and_steps_take_the_rest(tiny_chat_model):
    engine = build(tiny_chat_model, 32)
    seq = admit(engine, "a", range(100, 130), 60)  # 30 + 1 tokens: 2 blocks, not ceil(90/16)
    assert engine.blocks.num_used_blocks == 2
    used = set()
    while not seq.finished:
        engine._iterate()
        used.add(engine.blocks.num_used_blocks)
        # every written position has its slot; the next token's comes before its step
        assert len(seq.block_table) * BLOCK >= seq.next_position()
    assert used == {0, 2, 3, 4, 5, 6}  # a block at a time to ceil((30 + 60) / 16), then freed
    assert engine.blocks.num_used_blocks == 0
    engine.blocks.check_integrity()


def test_reserve_max_tokens_keeps_the_old_rule(tiny_chat_model, reference):
    engine = build(tiny_chat_model, 32, "--reserve-max-tokens")
    out = []
    seq = admit(engine, "a", range(100, 130), 60, out)
    assert engine.blocks.num_used_blocks == -(-(30 + 60) // BLOCK)
    run_until_done(engine, [seq])
    assert [o.token_id for o in out] == greedy(reference, list(range(100, 130)), 60)
    for i in range(5):  # 5 x 6 blocks fit in 32, a sixth does not (distinct prompts: no sharing)
        admit(engine, f"r{i}", range(1000 + 50 * i, 1030 + 50 * i), 60)
    with pytest.raises(Overloaded, match="need 6, 2 free of 32"):
        admit(engine, "r5", range(2000, 2030), 60)


def test_a_sequence_without_a_free_block_preempts_the_newest_and_all_match_transformers(
        tiny_chat_model, reference):
    """12 blocks; three sequences that need 7, 9 and 8 blocks by their last token: they cannot
    all hold their KV at once, so the newest ones are preempted and resumed, each more than once
    perhaps; every stream still gets transformers' greedy tokens, in order, and the pool ends
    empty and consistent."""
    engine = build(tiny_chat_model, 12)
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(200, 240)), [7] * 20]
    outs = [[], [], []]
    before = preemptions(engine)
    seqs = [admit(engine, f"s{i}", p, 100, outs[i]) for i, p in enumerate(prompts)]
    run_until_done(engine, seqs)
    assert preemptions(engine) > before
    for prompt, out in zip(prompts, outs):
        assert [o.index for o in out] == list(range(100))
        assert [o.token_id for o in out] == greedy(reference, prompt, 100)
    assert engine.blocks.num_used_blocks == 0 and not engine._swapped
    engine.blocks.check_integrity()


def test_a_preempted_sequence_holds_no_blocks_and_admission_waits_for_it(tiny_chat_model):
    engine = build(tiny_chat_model, 12)
    old, new = admit(engine, "old", range(100, 140), 50), admit(engine, "new", [9] * 30, 50)
    while len(engine.scheduler.running) < 2:
        engine._iterate()
    engine._preempt(new)
    assert new.swapped_kv is not None and new.block_table == [] and "new" not in engine.blocks
    assert engine._swapped == [new] and new not in engine.scheduler.running.values()
    with pytest.raises(Overloaded, match="1 preempted sequences wait"):
        admit(engine, "late", [5, 6], 4)
    engine.drop(new)  # a preempted stream cancelled: nothing to free twice
    engine._iterate()
    assert not engine._swapped and new.swapped_kv is None and "new" not in engine._live
    engine.blocks.check_integrity()
    run_until_done(engine, [old])
    assert engine.blocks.num_used_blocks == 0
    engine.blocks.check_integrity()


def test_admission_keeps_a_block_spare_for_each_live_sequence(tiny_chat_model):
    engine = build(tiny_chat_model, 6)
    first = admit(engine, "a", range(100, 140), 10)  # 41 tokens: 3 blocks
    with pytest.raises(Overloaded, match=r"need 3 \+ 1 kept for running sequences, 3 free"):
        admit(engine, "b", range(200, 240), 10)
    second = admit(engine, "c", range(200, 230), 10)  # 31 tokens: 2 blocks + 1 spare fit in 3
    run_until_done(engine, [first, second])
    assert engine.blocks.num_used_blocks == 0


def test_a_request_larger_than_the_whole_pool_is_refused(tiny_chat_model):
    engine = build(tiny_chat_model, 6)  # 96 tokens
    with pytest.raises(Overloaded, match="need 7 KV blocks, more than this worker's 6"):
        admit(engine, "big", range(100, 140), 60)
    assert engine.blocks.num_used_blocks == 0 and not engine._live


@pytest.mark.parametrize("extra", [(), ("--kv-cache-dtype", "fp8"),
                                   ("--dtype", "bfloat16", "--backend", "compiled")])
def test_preemption_changes_no_token(tiny_chat_model, extra):
    """The same sequences in a pool too small for them (preempted, resumed) and in one that
    holds them all: the same tokens, whatever the cache's dtype or backend."""
    prompts = [list(range(300, 340)), [11] * 25, list(range(500, 530))]

    def tokens(blocks):
        engine = build(tiny_chat_model, blocks, *extra)
        outs = [[], [], []]
        seqs = [admit(engine, f"s{i}", p, 90, outs[i]) for i, p in enumerate(prompts)]
        run_until_done(engine, seqs)
        return [[o.token_id for o in out] for out in outs], preemptions(engine)

    small, preempted = tokens(12)
    big, none = tokens(64)
    assert preempted > 0 and none == 0
    assert small == big


def test_an_id_reused_as_soon_as_its_last_token_is_out_is_admitted(tiny_chat_model):
    """A client that sends a new request under the id of one whose last token it just got (the
    engine thread has emitted it, not yet released it) is admitted: the finished sequence's
    blocks are freed then, once, and its late release leaves the new one alone."""
    engine = build(tiny_chat_model, 16)
    old = admit(engine, "x", range(100, 140), 8)
    old.finish_reason = "length"  # as add_token leaves it just before the engine releases it
    new = admit(engine, "x", range(200, 240), 8)
    assert engine._live["x"] is new and engine.blocks.num_used_blocks == 3
    engine.release(old)  # the engine thread's release, late: nothing of the new one freed
    assert engine._live["x"] is new and engine.blocks.num_used_blocks == 3
    engine.blocks.check_integrity()
    running = admit(engine, "y", range(300, 340), 8)
    with pytest.raises(Overloaded, match="already running"):
        admit(engine, "y", range(400, 440), 8)
    run_until_done(engine, [new, running])
    assert engine.blocks.num_used_blocks == 0
