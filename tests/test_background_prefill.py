"""A decode worker's local prefills on a thread of their own (--local-prefill-nice,
decode_service/background_prefill.py): the running streams keep stepping while a prompt is
prefilled beside them, every stream still gets transformers' greedy tokens, a sequence dropped
while its piece runs is released only after that piece, and the thread runs at the nice value
asked for; on real processes (tiny model) a disaggregated pair serves with it."""
import dataclasses
import os
import threading
import time

import httpx
import pytest

import hf_reference
from decode_service import main
from decode_service.background_prefill import StepPacer, check_nice, parse_nice
from hf_reference import greedy
from nxdi_common.serving.thread_priority import (DEFAULT_WAKEUP_SLICE_US, autogroup_nice,
                                                 thread_slice_us)
from nxdi_common.serving.types import DecodeJob, SamplingOptions, StopOptions

BLOCK = 16
GREEDY = SamplingOptions(temperature=0.0)


def build(model, *extra: str):
    args = main.parse_args(["--model", str(model), "--dtype", "float32", "--backend", "eager",
                            "--threads", "1", "--max-model-len", "512", "--kv-blocks", "128",
                            "--block-size", str(BLOCK), "--max-batch-size", "4",
                            "--prefill-chunk-tokens", "32", "--local-prefill-nice", "7", *extra])
    engine = main.build(args)[1]
    engine._background.start()  # the engine loop itself is driven turn by turn here
    return engine


def admit(engine, rid: str, prompt, max_tokens: int, sink: list):
    job = DecodeJob(rid, tuple(prompt), GREEDY, StopOptions(max_tokens, ignore_eos=True))
    seq = engine.admit(job, max_tokens, sink.append)
    engine.submit_local_prefill(seq)
    return seq


def turn_until(engine, done, seconds: float = 120) -> None:
    end = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < end, "the engine did not get there in time"
        engine._iterate()


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    return hf_reference.load(tiny_chat_model)


def hold_pieces(engine):
    """Make the prompt pieces wait for the returned gate; returns (gate, entered, restore)."""
    gate, entered = threading.Event(), threading.Event()
    real = engine.piece_output

    def held(seq, start, end):
        entered.set()
        assert gate.wait(30), "the piece was never let go"
        return real(seq, start, end)

    engine.piece_output = held
    return gate, entered, lambda: setattr(engine, "piece_output", real)


def test_streams_step_while_a_prompt_is_prefilled_beside_them(tiny_chat_model, reference):
    """While a piece of a 200-token prompt is running (held here), the engine loop keeps
    stepping the running stream, a token a turn (inline, the loop itself would be in the
    piece); then the prompt's 32-token pieces finish beside it, and both streams are
    transformers' greedy tokens."""
    engine = build(tiny_chat_model)
    try:
        first, second = [], []
        short = admit(engine, "short", [1, 504, 3458, 282, 4649, 314], 60, first)
        turn_until(engine, lambda: len(first) >= 2)
        gate, entered, restore = hold_pieces(engine)
        prompt = list(range(300, 500))
        long = admit(engine, "long", prompt, 20, second)
        engine._iterate()  # hands the prompt to the thread
        assert entered.wait(30)
        before = len(first)
        for _ in range(10):
            engine._iterate()
        assert len(first) == before + 10 and long.prefilled == 0
        restore()
        gate.set()
        turn_until(engine, lambda: short.finished and long.finished)
        assert [o.token_id for o in first] == greedy(reference, short.job.prompt_ids, 60)
        assert [o.token_id for o in second] == greedy(reference, prompt, 20)
        assert engine.blocks.num_used_blocks == 0
        engine.blocks.check_integrity()
        assert engine.local_rate.tokens_per_s > 0
    finally:
        engine.stop()


def hold_beside_a_stream(engine, first: list, second: list):
    """A 40-token stream ("short", tokens to ``first``) running with a step measured, then a
    200-token prompt sent with hold_steps_for_prefill ("long", to ``second``) whose first piece
    has entered the thread and waits at the gate; returns (short, long, prompt, gate, restore)."""
    short = admit(engine, "short", [1, 504, 3458, 282, 4649, 314], 40, first)
    turn_until(engine, lambda: len(first) >= 3 and engine.step_s is not None)
    gate, entered, restore = hold_pieces(engine)
    prompt = list(range(300, 500))
    job = DecodeJob("long", tuple(prompt), GREEDY, StopOptions(20, ignore_eos=True),
                    hold_steps_for_prefill=True)
    long = engine.admit(job, 20, second.append)
    engine.submit_local_prefill(long)
    engine._iterate()  # hands the prompt to the thread
    assert entered.wait(30)
    return short, long, prompt, gate, restore


def test_a_prompt_sent_to_hold_the_steps_has_the_core_until_it_is_prefilled(tiny_chat_model,
                                                                           reference):
    """DecodeRequest.hold_steps_for_prefill: while that prompt waits or runs on the thread no
    decode step starts (the running stream gets no token), for at most HOLD_MAX_S after its
    arrival; then the stream goes on, and both streams are transformers' greedy tokens. The
    worker reports its thread's whole-core rate (what the router weighs such a prompt by); a
    worker without the thread reports 0 and does not hold."""
    from decode_service.engine import HOLD_MAX_S, HOLD_POLL_S
    engine = build(tiny_chat_model)
    try:
        first, second = [], []
        short, long, prompt, gate, restore = hold_beside_a_stream(engine, first, second)
        before = len(first)
        for _ in range(5):
            engine._iterate()
        assert len(first) == before and engine._pace_s() == HOLD_POLL_S  # held
        # a sequence ready to join meanwhile (its prompt prefilled elsewhere) with its first
        # token held for the join (--hold-first-token) sends that token now, not after the hold
        joining = []
        ready = engine.admit(DecodeJob("ready", (1, 2, 3), GREEDY, StopOptions(4)), 4,
                             joining.append)
        ready.held = "first token"
        engine.scheduler.ready.append(ready)
        assert engine._pace_s() == HOLD_POLL_S and joining == ["first token"]
        engine.scheduler.ready.remove(ready)
        engine.drop(ready)
        long.arrival_ns -= int(HOLD_MAX_S * 1e9)  # past the bound: the stream goes on
        for _ in range(5):
            engine._iterate()
        assert len(first) == before + 5
        long.arrival_ns += int(HOLD_MAX_S * 1e9)
        restore()
        gate.set()
        turn_until(engine, lambda: long.prefilled == len(prompt))
        assert len(first) <= before + 6  # held again while its pieces ran (one step may end)
        turn_until(engine, lambda: short.finished and long.finished)
        assert [o.token_id for o in first] == greedy(reference, short.job.prompt_ids, 40)
        assert [o.token_id for o in second] == greedy(reference, prompt, 20)
        assert engine._pace_s() == 0.0
        assert engine.load()["hold_budget_s"] is None  # no TPOT target: nothing limits a hold
        whole = engine.load()["whole_core_prefill_tokens_per_s"]
        assert whole == pytest.approx(engine._background.core_rate.tokens_per_s) and whole > 0
    finally:
        engine.stop()
    inline = main.build(main.parse_args(["--model", str(tiny_chat_model), "--dtype", "float32",
                                         "--backend", "eager", "--threads", "1",
                                         "--max-model-len", "512", "--kv-blocks", "64"]))[1]
    assert inline.load()["whole_core_prefill_tokens_per_s"] == 0.0
    assert inline._pace_s() == 0.0


def test_a_hold_lasts_only_while_the_running_streams_can_meet_their_tpot_target(
        tiny_chat_model, reference):
    """With a TPOT target (--tpot-target-ms) a prompt sent with hold_steps_for_prefill holds the
    steps only while every running stream would still end within HOLD_TPOT_SHARE of it
    (hold_budget_s, in the load report too), then the stream steps beside the prefill; a stream
    that would miss the target anyway does not stop a hold. Both streams still get
    transformers' greedy tokens."""
    from decode_service.engine import HOLD_POLL_S, HOLD_TPOT_SHARE
    engine = build(tiny_chat_model, "--tpot-target-ms", "100")
    try:
        first, second = [], []
        short, long, prompt, gate, restore = hold_beside_a_stream(engine, first, second)

        def budget_to(seconds):  # date the stream's first token so that this much is left
            allowed = HOLD_TPOT_SHARE * 0.1 * (40 - 1)
            projected = allowed - seconds
            elapsed = projected - (40 - len(short.generated)) * engine.step_s
            short.first_token_ns = time.monotonic_ns() - int(elapsed * 1e9)

        budget_to(1.0)
        assert engine.load()["hold_budget_s"] == pytest.approx(1.0, abs=0.05)
        before = len(first)
        for _ in range(5):
            engine._iterate()
        assert len(first) == before and engine._pace_s() == HOLD_POLL_S  # held
        budget_to(0.02)  # less than a poll left: held that long
        assert engine._pace_s() == pytest.approx(0.02, abs=0.01)
        held_s = engine.metrics.value("nxdi_held_step_seconds_total")
        assert held_s >= 5 * HOLD_POLL_S  # the five turns held above, at least
        budget_to(-0.1)  # spent: the stream steps while the prompt is still being prefilled
        assert engine.load()["hold_budget_s"] < 0 and engine._pace_s() == 0.0
        for _ in range(3):
            engine._iterate()
        assert len(first) == before + 3 and long.prefilled < len(prompt)
        assert engine.metrics.value("nxdi_hold_budget_steps_total") == 3
        assert engine.metrics.value("nxdi_held_step_seconds_total") == held_s
        budget_to(-0.5)  # past the target itself: nothing saves it, the hold goes on
        assert engine.load()["hold_budget_s"] is None and engine._pace_s() == HOLD_POLL_S
        restore()
        gate.set()
        turn_until(engine, lambda: short.finished and long.finished)
        assert [o.token_id for o in first] == greedy(reference, short.job.prompt_ids, 40)
        assert [o.token_id for o in second] == greedy(reference, prompt, 20)
    finally:
        engine.stop()


def test_an_itl_target_paces_the_steps_while_a_local_prefill_runs(tiny_chat_model):
    """--itl-target-ms with the thread: while a prompt's piece runs the steps are paced to end
    ~40 ms apart (the time between is the prefill's); with no local prefill, no pause."""
    engine = build(tiny_chat_model, "--itl-target-ms", "40")
    try:
        times = []

        class Timed(list):  # a token sink noting when each token came
            def append(self, out):
                times.append(time.perf_counter())
                super().append(out)

        short = admit(engine, "short", [1, 504, 3458, 282, 4649, 314], 40, Timed())
        turn_until(engine, lambda: len(times) >= 2)
        assert engine._pace_s() == 0.0
        gate, entered, restore = hold_pieces(engine)
        admit(engine, "long", list(range(300, 400)), 4, [])
        engine._iterate()
        assert entered.wait(30)
        before = len(times)
        turn_until(engine, lambda: len(times) >= before + 5)
        gaps = [b - a for a, b in zip(times[before:], times[before + 1:])]
        assert min(gaps) >= 0.035, gaps
        restore()
        gate.set()
        turn_until(engine, lambda: short.finished and len(engine._background) == 0)
        assert engine._pace_s() == 0.0
    finally:
        engine.stop()


def test_the_pacer_keeps_the_gaps_between_step_ends_within_the_target():
    """A step starts the target less the longest recent step after the last one ended, so a
    step as long as the longest recent one ends exactly a target after the previous end."""
    pacer = StepPacer(0.050, window=3)
    assert pacer.pause_s(now=5.0) == 0.0  # no step yet
    ended = 0.0
    for began, length in ((0.0, 0.010), (0.5, 0.020), (1.0, 0.012)):
        ended = began + length
        pacer.done(began, ended)
    assert pacer.pause_s(now=ended) == pytest.approx(0.050 - 0.020)
    assert pacer.pause_s(now=ended + 0.040) == pytest.approx(-0.010)  # late: start now
    for began in (2.0, 3.0, 4.0):  # the 20 ms step leaves the window
        pacer.done(began, began + 0.011)
    assert pacer.pause_s(now=4.011) == pytest.approx(0.050 - 0.011)
    pacer.done(5.0, 5.060)  # a step longer than the target: no pause at all
    assert pacer.pause_s(now=5.060) < 0


def test_a_ttft_target_stretches_the_paced_gap_as_far_as_the_local_prompts_need(
        tiny_chat_model):
    """With --ttft-target-ms as well, the paced gap G is the ITL target (20 ms) while the
    prefill's share of the core, 1 - step / G, at its whole-core rate finishes every local
    prompt within the target of its arrival; else step / (1 - need / rate), at most 1.5x the
    ITL target; prompts past the target, or needing more than the longest gap gives, do not
    stretch it; the pause before a step keeps the stretched gap."""
    engine = build(tiny_chat_model, "--itl-target-ms", "20", "--ttft-target-ms", "4000")
    try:
        bg, now = engine._background, time.monotonic_ns()  # (the deadlines drift by ms)
        engine.step_s = 0.010
        bg.core_rate.add(100, 1.0)  # 100 tokens/s on the whole core: 50/s at a 20 ms gap
        order = []
        bg.queued = lambda: order  # the local prompts, in the order they run

        def waiting(rid: str, tokens: int, left_s: float):
            first = 1000 + 300 * "abcdef".index(rid)
            seq = engine.admit(DecodeJob(rid, tuple(range(first, first + tokens))), 4,
                               lambda event: None)
            seq.arrival_ns = now - int((4.0 - left_s) * 1e9)
            return seq

        assert engine._paced_gap_s() == 0.020  # nothing waits
        order.append(waiting("a", 40, 1.0))  # 40/s: the 20 ms gap's 50/s will do
        assert engine._paced_gap_s() == 0.020
        order.append(waiting("b", 20, 1.0))  # 60/s: 10 ms / (1 - 0.6)
        assert engine._paced_gap_s() == pytest.approx(0.025, rel=0.02)
        engine.config = dataclasses.replace(engine.config, pace_stretch=1.0)
        assert engine._paced_gap_s() == 0.020  # no stretch: b's need does not move the gap
        engine.config = dataclasses.replace(engine.config, pace_stretch=1.5)
        order.append(waiting("c", 10, 1.0))  # 70/s: more than 30 ms gaps give (66.7/s)
        assert engine._paced_gap_s() == pytest.approx(0.025, rel=0.02)  # c does not stretch it
        order.append(waiting("d", 130, 2.0))  # a-d: 200 in 2 s, 100/s: hopeless as well
        assert engine._paced_gap_s() == pytest.approx(0.025, rel=0.02)  # b's need still holds
        del order[1:3]  # a and d: 170 in 2 s, hopeless; nothing else needs more
        assert engine._paced_gap_s() == 0.020
        order[0].arrival_ns = now - int(5e9)  # a is past the target: late, the longest gap
        assert engine._paced_gap_s() == pytest.approx(0.030)
        for stretch, longest in ((1.0, 0.020), (1.25, 0.025)):  # --pace-stretch bounds it
            engine.config = dataclasses.replace(engine.config, pace_stretch=stretch)
            assert engine._paced_gap_s() == pytest.approx(longest)
        engine.config = dataclasses.replace(engine.config, pace_stretch=1.5)
        engine.step_s = 0.025  # steps longer than the ITL target: the longest is 1.5 steps
        assert engine._paced_gap_s() == pytest.approx(0.0375)
        order[:] = [waiting("f", 20, 1.0)]  # on time, 20/s: the gap of a step leaves nothing
        assert engine._paced_gap_s() == pytest.approx(0.025 / 0.8, rel=0.02)  # 25 ms / (1 - 0.2)
        engine.step_s = 0.010
        order[:] = [waiting("e", 64, 1.0)]  # 64/s: 10 ms / (1 - 0.64)
        stretched = 0.010 / 0.36
        assert engine._paced_gap_s() == pytest.approx(stretched, rel=0.02)
        gate, entered, restore = hold_pieces(engine)
        bg.submit(order[0])  # a local prefill under way: the steps are paced
        assert entered.wait(30)
        ended = time.perf_counter()
        engine._pacer.done(ended - 0.010, ended)
        assert engine._pace_s() == pytest.approx(stretched - 0.010, abs=0.002)
        engine.config = dataclasses.replace(engine.config, ttft_target_s=None)  # ITL alone
        assert engine._paced_gap_s() == 0.020
        restore()
        gate.set()
    finally:
        engine.stop()



def test_a_worker_reports_a_local_rate_before_its_first_local_prefill(tiny_chat_model):
    """Before any local prefill has been measured the load report's rate is the model's warm-up
    rate for a chunk (NeuronBaseForCausalLM.warmup_prefill_rate) times the share of the core
    local prefill would get: with paced steps, once a step is known, what the paced gap leaves
    (1 - step / ITL target, at least 5%); else all of it with no stream running, and beside
    running streams a chunk a step on the compute thread; unknown (0) without a warm-up, a
    step, or paced steps beside the thread. A measured rate below the share wins."""
    engine = build(tiny_chat_model, "--itl-target-ms", "20")
    inline = main.build(main.parse_args([
        "--model", str(tiny_chat_model), "--dtype", "float32", "--backend", "eager",
        "--threads", "1", "--max-model-len", "512", "--kv-blocks", "128", "--block-size",
        str(BLOCK), "--max-batch-size", "4", "--prefill-chunk-tokens", "32"]))[1]
    unpaced = build(tiny_chat_model)
    try:
        rate = lambda e: e.load()["prefill_tokens_per_s"]  # noqa: E731
        assert rate(engine) == 0.0  # the eager backend warms nothing up: nothing known
        for e in (engine, inline, unpaced):
            cte = e.model.context_encoding_model
            e.model.warmup_seconds[(cte.tag, (1, 32))] = 0.1  # a 32-token chunk in 0.1 s
        assert engine.model.warmup_prefill_rate(32) == pytest.approx(320)
        assert engine.model.warmup_prefill_rate(20) == pytest.approx(200)  # in the 32 bucket
        assert engine.model.warmup_prefill_rate(100) is None  # its bucket not measured
        assert rate(engine) == pytest.approx(320)  # no stream running: the whole core
        for e in (engine, inline, unpaced):
            e.scheduler.running["streaming"] = None  # a running stream (only counted here)
            assert rate(e) == 0.0  # no step measured yet: the share is not known
            e.step_s = 0.015
        assert rate(engine) == pytest.approx(320 * 0.25)  # paced: 5 ms of every 20
        assert rate(inline) == pytest.approx(32 / (0.015 + 0.1))  # a chunk a step
        assert rate(unpaced) == 0.0  # SCHED_IDLE beside unpaced steps: not known
        engine.step_s = 0.025  # steps past the target: slow, not unknown
        assert rate(engine) == pytest.approx(320 * 0.05)
        engine.step_s = 0.015
        engine.local_rate.add(50, 1.0)  # a local prefill went at 50 tokens/s: it wins
        assert rate(engine) == pytest.approx(50)
    finally:
        for e in (engine, inline, unpaced):
            e.scheduler.running.pop("streaming", None)
            e.stop()


def test_with_paced_steps_the_reported_rate_is_at_most_the_paced_gaps_share(tiny_chat_model):
    """With paced steps the reported local rate is at most what the gap at the ITL target
    leaves beside the step (1 - step / target of the local prefill thread's whole-core rate),
    streams running or not: a rate measured with the core to itself, or with the gap
    stretched for a deadline, would have the router send a long prompt here that the streams
    joining meanwhile pay for (its view is up to a poll old). Before a step is measured, the
    token-generation warm-up call stands in for it; a slower measured rate wins."""
    engine = build(tiny_chat_model, "--itl-target-ms", "20")
    try:
        rate = lambda: engine.load()["prefill_tokens_per_s"]  # noqa: E731
        engine.local_rate.add(300, 1.0)  # measured alone: 300 tokens/s
        engine._background.core_rate.add(400, 1.0)  # 400 tokens/s of the thread's CPU time
        assert rate() == pytest.approx(300)  # no step known yet (eager: no warm-up either)
        tkg = engine.model.token_generation_model
        engine.model.warmup_seconds[(tkg.tag, min(tkg.bucket_keys()))] = 0.010
        assert engine.model.warmup_step_seconds() == pytest.approx(0.010)
        assert not engine._live and not engine.scheduler.num_running  # nothing here
        assert rate() == pytest.approx(400 * 0.5)  # the warm-up step: 10 ms of every 20
        engine.step_s = 0.015  # measured: 5 ms of every 20
        assert rate() == pytest.approx(400 * 0.25)
        engine.step_s = 0.030  # steps past the target: slow, not unknown
        assert rate() == pytest.approx(400 * 0.05)
        engine.step_s = 0.015
        engine.local_rate.add(10, 1.0)  # measured slower than the share since: measured
        assert rate() == pytest.approx(engine.local_rate.tokens_per_s) and rate() < 100
    finally:
        engine.stop()

    unpaced = build(tiny_chat_model)  # SCHED_IDLE beside unpaced steps: the measured rate
    try:
        unpaced.local_rate.add(300, 1.0)
        unpaced.step_s = 0.015
        assert unpaced.load()["prefill_tokens_per_s"] == pytest.approx(300)
    finally:
        unpaced.stop()


def test_a_sequence_dropped_mid_piece_is_released_after_the_piece(tiny_chat_model):
    engine = build(tiny_chat_model)
    try:
        bg = engine._background
        gate, entered, restore = hold_pieces(engine)
        seq = admit(engine, "gone", list(range(300, 400)), 10, [])
        engine._iterate()  # the "local" command: handed to the thread
        assert entered.wait(30)
        engine.drop(seq)
        engine._iterate()  # the drop arrives while the piece runs: nothing released yet
        assert "gone" in engine.blocks and engine._live.get("gone") is seq
        restore()
        gate.set()
        turn_until(engine, lambda: "gone" not in engine.blocks)
        assert len(bg) == 0 and not seq.generated
        assert engine.blocks.num_used_blocks == 0
        engine.blocks.check_integrity()
    finally:
        engine.stop()


def test_the_thread_runs_at_the_nice_value_and_bad_values_are_refused(tiny_chat_model):
    engine = build(tiny_chat_model)
    try:
        tid = engine._background._thread.native_id
        deadline = time.monotonic() + 10
        while os.getpriority(os.PRIO_PROCESS, tid) != 7:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 7
    finally:
        engine.stop()
    for bad in (-1, 20, True, 2.0):
        with pytest.raises(ValueError, match="local_prefill_nice must be an integer in"):
            check_nice(bad)
    with pytest.raises(SystemExit, match="--local-prefill-nice"):
        build(tiny_chat_model, "--local-prefill-nice", "25")
    for bad in ("high", "5.5", ""):
        with pytest.raises(SystemExit, match=r"--local-prefill-nice: .*\[0, 19\] or 'idle'"):
            build(tiny_chat_model, "--local-prefill-nice", bad)
    assert parse_nice("idle") == "idle" and parse_nice("3") == 3 and parse_nice(None) is None


def test_idle_puts_the_thread_under_sched_idle_and_it_still_prefills(tiny_chat_model,
                                                                     reference):
    """--local-prefill-nice idle: the thread runs under SCHED_IDLE (the compute thread does
    not), and a prompt given to it is prefilled and decoded to transformers' tokens."""
    engine = build(tiny_chat_model, "--local-prefill-nice", "idle")
    try:
        tid = engine._background._thread.native_id
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(tid) != os.SCHED_IDLE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE
        prompt, out = list(range(7, 7 + 70)), []
        seq = admit(engine, "idle", prompt, 6, out)
        turn_until(engine, lambda: seq.finished)
        assert [o.token_id for o in out] == greedy(reference, prompt, 6)
        assert engine.blocks.num_used_blocks == 0
    finally:
        engine.stop()


def test_log_steps_writes_a_line_for_every_decode_step(tiny_chat_model, caplog):
    """--log-steps: one INFO line on decode_service.steps for every decode step, with its
    wall-clock end, seconds, rows and calls, the paced pause before it and the local prompts
    waiting; none without the flag."""
    import re
    line = re.compile(r"step end=(\d+\.\d{6}) seconds=(\d+\.\d{6}) rows=(\d+) calls=(\d+) "
                      r"paused=(\d+\.\d{6}) local=(\d+) piece=0$")
    for flags in ((), ("--log-steps",)):
        engine = build(tiny_chat_model, "--itl-target-ms", "20", *flags)
        caplog.clear()
        try:
            with caplog.at_level("INFO", logger="decode_service.steps"):
                began = time.time()
                first = admit(engine, "a", list(range(7, 47)), 4, [])
                turn_until(engine, lambda: len(first.generated) == 2)
                second = admit(engine, "b", list(range(50, 90)), 3, [])
                turn_until(engine, lambda: first.finished and second.finished)
            lines = [r.getMessage() for r in caplog.records if r.name == "decode_service.steps"]
            if not flags:
                assert lines == []
                continue
            fields = [line.fullmatch(text).groups() for text in lines]
            assert all(began <= float(end) <= time.time() for end, *_ in fields)
            assert all(float(seconds) > 0 and int(calls) == 1 for _, seconds, _, calls, _, _ in fields)
            # a's 3 tokens after its first and b's 2, in 3 to 5 steps (as much as b overlapped a)
            assert sum(int(rows) for _, _, rows, *_ in fields) == 5
            assert 3 <= len(lines) <= 5
            engine._paused_s = 0.004  # paced pauses since the last step: shown, then reset
            with caplog.at_level("INFO", logger="decode_service.steps"):
                engine._log_step(0.012, 2, 1)
            assert caplog.records[-1].getMessage().endswith(
                "seconds=0.012000 rows=2 calls=1 paused=0.004000 local=0 piece=0")
            assert engine._paused_s == 0.0
        finally:
            engine.stop()


def thread_nices(pid: int) -> dict[int, int]:
    """Each thread of process ``pid``: its nice value (/proc/PID/task/TID/stat, field 19)."""
    nices = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            nices[int(task)] = int(f.read().rsplit(")", 1)[1].split()[16])
    return nices


def thread_slices(pid: int) -> dict[int, int | None]:
    """Each thread of process ``pid``: its scheduler slice in microseconds."""
    return {int(task): thread_slice_us(int(task)) for task in os.listdir(f"/proc/{pid}/task")}


def test_a_disaggregated_pair_serves_short_prompts_locally_beside_the_streams(
        spawn_module, tiny_chat_model, reference):
    """The router keeps short prompts on the decode worker (--local-prefill-always-tokens);
    with the thread those prefills run beside the streams of the others, and every answer is
    transformers' greedy continuation."""
    import asyncio

    from transformers import AutoTokenizer
    common = ("--model", tiny_chat_model, "--dtype", "float32", "--backend", "eager",
              "--threads", "1", "--max-model-len", 512)
    decode = spawn_module("decode_service", *common, "--kv-blocks", 256,
                          "--prefill-chunk-tokens", 32, "--local-prefill-nice", 5)
    prefill = spawn_module("prefill_service", *common, "--nice", 3,  # below the router
                           "--wakeup-slice-us", 0)
    router = spawn_module("router", "--model", tiny_chat_model, "--max-model-len", 512,
                          "--model-name", "tiny", "--http-port", 0, "--grpc-port", 0,
                          "--decode", decode.grpc, "--prefill", prefill.grpc,
                          "--local-prefill-always-tokens", 256, "--nice", 2, "--wake-ms", 1,
                          "--wakeup-slice-us", 200)
    http = router.info["http"]
    # --wake-ms 1: the router's loop thread wakes every ms though no request comes
    switches = loop_thread_switches(router.proc.pid)
    time.sleep(0.5)
    assert loop_thread_switches(router.proc.pid) - switches >= 150
    threads = thread_nices(prefill.proc.pid)  # --nice: every thread the worker started
    assert len(threads) > 2 and set(threads.values()) == {3}, threads
    assert set(thread_nices(router.proc.pid).values()) == {2}  # the router's too
    assert set(thread_nices(decode.proc.pid).values()) >= {0, 5}  # no --nice: unchanged
    if os.path.exists("/proc/self/autogroup"):  # each in a session of its own: its group too
        groups = [autogroup_nice(s.proc.pid) for s in (prefill, router, decode)]
        assert groups == [3, 2, 0], groups
    prompts = [list(range(100 + 97 * i, 100 + 97 * i + 40 + 20 * i)) for i in range(4)]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"http://{http}/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}) for p in prompts))

    before = local_prefills(decode)
    replies = asyncio.run(all_at_once())
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert local_prefills(decode) == before + len(prompts)
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    for prompt, reply in zip(prompts, replies):
        assert reply.json()["choices"][0]["text"] == tokenizer.decode(
            greedy(reference, prompt, 16), skip_special_tokens=True)
    default = thread_slice_us()  # this process's: the kernel's default slice
    if default is not None and default != DEFAULT_WAKEUP_SLICE_US:  # Linux 6.12+: custom slices
        # --wakeup-slice-us: every thread of the router; none of the prefill worker's (0); the
        # decode worker's event loop (its main thread) at the default 100 us, its compute and
        # local prefill threads at the kernel's default
        assert set(thread_slices(router.proc.pid).values()) == {200}
        assert set(thread_slices(prefill.proc.pid).values()) == {default}
        slices = thread_slices(decode.proc.pid)
        assert slices[decode.proc.pid] == DEFAULT_WAKEUP_SLICE_US
        assert list(slices.values()).count(default) >= 2, slices


def loop_thread_switches(pid: int) -> int:
    """The voluntary context switches of a process's main thread (its asyncio loop's)."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f
                    if line.startswith("voluntary_ctxt_switches:"))


def local_prefills(service) -> float:
    text = httpx.get(f"http://{service.info['metrics']}/metrics", timeout=10).text
    line = next((x for x in text.splitlines()
                 if x.startswith('nxdi_local_prefills_total{role="decode"} ')), None)
    return 0.0 if line is None else float(line.split()[-1])
