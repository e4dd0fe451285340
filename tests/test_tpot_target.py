"""The decode engine's TPOT target (--tpot-target-ms): a local prefill piece waits while it
would push a running sequence over the target that it would meet otherwise, with the engine's
own step and piece measurements; the flag reaches the engine and is validated; the benchmark
passes it to our decode workers. The rule itself (scheduler.piece_costs_a_tpot) is tested in
test_detokenize.py with the scheduler's other pure functions."""
import time

import pytest

from decode_service import main
from decode_service.engine import EngineConfig
from nxdi_common import kv_transfer
from nxdi_common.serving.types import DecodeJob

CHUNK = 16


def build(model: str, *extra: str):
    args = main.parse_args(["--model", str(model), "--dtype", "float32", "--backend", "eager",
                            "--threads", "1", "--max-model-len", "256", "--kv-blocks", "32",
                            "--block-size", "16", "--max-batch-size", "4",
                            "--prefill-chunk-tokens", str(CHUNK), *extra])
    return main.build(args)[1]  # the engine, its thread not started: steps are driven here


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    return build(tiny_chat_model, "--tpot-target-ms", "100")


def running_sequence(engine, rid: str, tokens: int, max_tokens: int, first_token_ago_s: float):
    seq = engine.admit(DecodeJob(rid, (5, 6, 7)), max_tokens, lambda event: None)
    for _ in range(tokens):
        seq.add_token(9)
    seq.first_token_ns = time.monotonic_ns() - int(first_token_ago_s * 1e9)
    engine.scheduler.add_ready(seq)
    return seq


def forget(engine, *seqs) -> None:
    """Take the sequences out of the batch, the local queue and the block pool."""
    for seq in seqs:
        engine.scheduler.remove(seq)
        engine.release(seq)
    engine._local.clear()


def deferred(engine) -> float:
    return engine.metrics.value("nxdi_deferred_pieces_total")


def test_a_piece_waits_while_it_would_push_a_running_sequence_over_the_target(engine):
    """10 of 20 tokens in 0.9 s at 20 ms a step: 58 ms per token without a piece. A 16-token
    piece measured at 0.9 s would make it 105 ms (over the 100 ms target: the step runs without
    the piece, counted); at 0.7 s 95 ms (the piece runs). Sequences waiting to join the batch
    count as running ones."""
    run = running_sequence(engine, "run", tokens=10, max_tokens=20, first_token_ago_s=0.9)
    prompt = engine.admit(DecodeJob("prompt", tuple(range(100, 200))), 4, lambda event: None)
    engine._local.append(prompt)
    engine.step_s, engine.step_measured_ns = 0.02, time.monotonic_ns()
    try:
        before = deferred(engine)
        engine.piece_s_per_token = 0.9 / CHUNK
        assert not engine._piece_now()
        assert deferred(engine) == before + 1
        engine.scheduler.next_batch()  # now running, no longer waiting
        assert not engine._piece_now()
        engine.piece_s_per_token = 0.7 / CHUNK
        assert engine._piece_now()
        assert deferred(engine) == before + 2
        engine.piece_s_per_token = None  # nothing measured yet: the piece runs
        assert engine._piece_now()
    finally:
        forget(engine, run, prompt)


def test_a_step_time_older_than_a_second_is_measured_again_first(engine):
    """While pieces run back to back the batch can grow past what the last decode-only step
    measured: after STEP_REMEASURE_S a step runs without the piece (not counted as deferred),
    and the next one may take it."""
    from decode_service.engine import STEP_REMEASURE_S
    run = running_sequence(engine, "stale", tokens=1, max_tokens=50, first_token_ago_s=0.0)
    engine._local.append(engine.admit(DecodeJob("later", tuple(range(400, 440))), 4,
                                      lambda event: None))
    prompt = engine._local[0]
    engine.step_s, engine.piece_s_per_token = 0.001, 0.0
    engine.step_measured_ns = time.monotonic_ns() - int((STEP_REMEASURE_S + 0.5) * 1e9)
    try:
        before = deferred(engine)
        assert not engine._piece_now()
        engine._decode_calls()  # measures the step
        assert engine._piece_now()
        assert deferred(engine) == before
    finally:
        forget(engine, run, prompt)


def test_without_a_target_every_step_takes_a_piece(tiny_chat_model):
    plain = build(tiny_chat_model)
    assert plain.config.tpot_target_s is None
    running_sequence(plain, "run", tokens=10, max_tokens=20, first_token_ago_s=0.9)
    plain._local.append(plain.admit(DecodeJob("prompt", tuple(range(100, 200))), 4,
                                    lambda event: None))
    plain.step_s, plain.piece_s_per_token = 0.02, 10.0
    assert plain._piece_now()


def test_the_engine_measures_steps_and_pieces(engine):
    """Real calls of the tiny model: a decode-only step sets step_s; a piece while a sequence
    runs sets the seconds a piece adds per prompt token."""
    engine.step_s = engine.piece_s_per_token = None
    run = running_sequence(engine, "measured", tokens=1, max_tokens=50, first_token_ago_s=0.0)
    prompt = engine.admit(DecodeJob("piece", tuple(range(300, 340))), 4, lambda event: None)
    try:
        engine._decode_calls()
        assert engine.step_s is not None and engine.step_s > 0
        engine._local.append(prompt)
        assert engine._piece_now() and engine._local_piece()  # the step rode in the piece
        assert engine.piece_s_per_token is not None and engine.piece_s_per_token >= 0
        assert prompt.prefilled == CHUNK and len(run.generated) == 3
    finally:
        forget(engine, run, prompt)


def test_bad_targets_are_refused(tiny_chat_model):
    with pytest.raises(SystemExit, match="--tpot-target-ms must be > 0 milliseconds, got 0.0"):
        build(tiny_chat_model, "--tpot-target-ms", "0")
    with pytest.raises(ValueError, match="tpot_target_s must be > 0 seconds, got -1"):
        EngineConfig(tpot_target_s=-1)


def test_the_benchmark_passes_the_target_to_our_decode_workers():
    from nxdi_bench import cli
    from nxdi_bench.configs import ServeSettings, our_launch_spec
    args = cli.build_parser().parse_args(["compare", "--decode-tpot-target", "0.1"])
    assert args.decode_tpot_target == 0.1
    serve = ServeSettings(decode_tpot_target_s=0.1)
    for name in ("disaggregated", "aggregated"):
        assert our_launch_spec(name, serve).decode_args[-2:] == ["--tpot-target-ms", "100"]
        assert "--tpot-target-ms" not in our_launch_spec(name, ServeSettings()).decode_args


def test_load_reports_the_local_prefill_tokens_left_and_the_rate_they_go_at(engine):
    """What a router weighs a local prefill by (router.policies.LocalPrefillRule): the prompt
    tokens the local prefills have still to compute, counted from submission, and the prompt
    tokens per second of wall time they have gone at, time between pieces included."""
    from decode_service.convert import worker_load

    prompt = engine.admit(DecodeJob("eta", tuple(range(100, 150))), 4, lambda event: None)
    dropped = engine.admit(DecodeJob("gone", tuple(range(100, 130))), 4, lambda event: None)
    try:
        t0 = time.perf_counter()
        engine.submit_local_prefill(prompt)
        engine.submit_local_prefill(dropped)
        assert engine.load()["local_prompt_tokens"] == 50 + 30
        engine.drop(dropped)
        engine._apply_commands(block=False)
        assert engine.load()["local_prompt_tokens"] == 50
        assert engine.load()["prefill_tokens_per_s"] == 0.0  # nothing measured yet
        assert engine._local_piece() is False  # no running batch: a call of its own
        first = engine.load()
        assert first["local_prompt_tokens"] == 50 - CHUNK
        assert 0 < CHUNK / first["prefill_tokens_per_s"] <= time.perf_counter() - t0
        time.sleep(0.3)  # a piece held back (as the TPOT target does): the rate falls
        engine._local_piece()
        second = engine.load()
        assert second["local_prompt_tokens"] == 50 - 2 * CHUNK
        engine._update_gauges()
        assert engine.metrics.value("nxdi_queued_prompt_tokens") == 50 - 2 * CHUNK
        assert engine.metrics.value("nxdi_prefill_tokens_per_second") == pytest.approx(
            second["prefill_tokens_per_s"])
        assert second["prefill_tokens_per_s"] < first["prefill_tokens_per_s"]
        assert CHUNK / second["prefill_tokens_per_s"] > 0.25 * 0.3  # the average's weight
        while engine._local:
            engine._local_piece()
        assert engine.load()["local_prompt_tokens"] == 0 and prompt in engine.scheduler.ready
        msg = worker_load("d:1", kv_transfer.ModelFingerprint("m", 1, 1, 8, "float32", "none",
                                                              "x"), second, 4, 16, 0)
        assert (msg.queued_prompt_tokens, msg.prefill_tokens_per_s) == (
            50 - 2 * CHUNK, pytest.approx(second["prefill_tokens_per_s"]))
    finally:
        forget(engine, prompt, dropped)
