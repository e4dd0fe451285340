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


def piece_now(engine) -> bool:
    return engine._piece_now(engine._plan_piece())


def local_piece(engine) -> bool:
    return engine._local_piece(engine._plan_piece())


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
        assert not piece_now(engine)
        assert deferred(engine) == before + 1
        engine.scheduler.next_batch()  # now running, no longer waiting
        assert not piece_now(engine)
        engine.piece_s_per_token = 0.7 / CHUNK
        assert piece_now(engine)
        assert deferred(engine) == before + 2
        engine.piece_s_per_token = None  # nothing measured yet: the piece runs
        assert piece_now(engine)
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
        assert not piece_now(engine)
        engine._decode_calls()  # measures the step
        assert piece_now(engine)
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
    assert piece_now(plain)


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
        assert piece_now(engine) and local_piece(engine)  # the step rode in the piece
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


def test_the_benchmark_passes_batch_buckets_to_our_decode_workers():
    from nxdi_bench import cli
    from nxdi_bench.configs import ServeSettings, our_launch_spec
    args = cli.build_parser().parse_args(["compare", "--decode-max-batch-size", "32",
                                          "--decode-batch-buckets", "1,2,4,8,16,32"])
    assert cli._compare_settings(args).serve.decode_batch_buckets == (1, 2, 4, 8, 16, 32)
    serve = ServeSettings(decode_max_batch_size=32, decode_batch_buckets=(1, 2, 4, 8, 16, 32))
    for name in ("disaggregated", "aggregated"):
        decode_args = our_launch_spec(name, serve).decode_args
        assert decode_args[decode_args.index("--batch-buckets") + 1] == "1,2,4,8,16,32"
        assert "--batch-buckets" not in our_launch_spec(name, ServeSettings()).decode_args


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
        assert local_piece(engine) is False  # no running batch: a call of its own
        first = engine.load()
        assert first["local_prompt_tokens"] == 50 - CHUNK
        assert 0 < CHUNK / first["prefill_tokens_per_s"] <= time.perf_counter() - t0
        time.sleep(0.3)  # a piece held back (as the TPOT target does): the rate falls
        local_piece(engine)
        second = engine.load()
        assert second["local_prompt_tokens"] == 50 - 2 * CHUNK
        engine._update_gauges()
        assert engine.metrics.value("nxdi_queued_prompt_tokens") == 50 - 2 * CHUNK
        assert engine.metrics.value("nxdi_prefill_tokens_per_second") == pytest.approx(
            second["prefill_tokens_per_s"])
        assert second["prefill_tokens_per_s"] < first["prefill_tokens_per_s"]
        assert CHUNK / second["prefill_tokens_per_s"] > 0.25 * 0.3  # the average's weight
        while engine._local:
            local_piece(engine)
        assert engine.load()["local_prompt_tokens"] == 0 and prompt in engine.scheduler.ready
        msg = worker_load("d:1", kv_transfer.ModelFingerprint("m", 1, 1, 8, "float32", "none",
                                                              "x"), second, 4, 16, 0)
        assert (msg.queued_prompt_tokens, msg.prefill_tokens_per_s) == (
            50 - 2 * CHUNK, pytest.approx(second["prefill_tokens_per_s"]))
    finally:
        forget(engine, prompt, dropped)


# ---- the ITL target: pieces sized for the running batch's step -------------------------------

@pytest.fixture(scope="module")
def itl_engine(tiny_chat_model):
    return build(tiny_chat_model, "--itl-target-ms", "50", "--piece-sizes", "4,8,16")


def test_pieces_beside_a_running_batch_are_sized_to_the_itl_target(itl_engine):
    """The largest piece length whose cost (measured seconds per token) fits in the target
    beside the measured step; the smallest when none fits or nothing is measured; a full chunk
    with nothing running."""
    engine = itl_engine
    assert engine.sizes == [4, 8, 16] and sorted(engine.model.mixed_models) == [4, 8, 16]
    prompt = engine.admit(DecodeJob("sized", tuple(range(100, 200))), 4, lambda event: None)
    engine._local.append(prompt)
    try:
        engine.step_s = engine.piece_s_per_token = None
        assert engine._piece_size() == CHUNK  # nothing running: nothing to stall
        run = running_sequence(engine, "run", tokens=1, max_tokens=50, first_token_ago_s=0.0)
        assert engine._piece_size() == 4  # nothing measured yet
        engine.step_s = 0.02
        engine.piece_s_per_token = 0.002  # 4 -> 8 ms, 8 -> 16 ms, 16 -> 32 ms beside 20 ms
        assert engine._piece_size() == 8
        engine.piece_s_per_token = 0.001
        assert engine._piece_size() == 16
        assert engine._plan_piece() == (prompt, 0, 16)
        engine.step_s = 0.1  # nothing fits: the smallest, so the prompt still advances
        assert engine._piece_size() == 4
        assert engine._plan_piece() == (prompt, 0, 4)
        prompt.prefilled = 98  # the last 2 tokens pad to 4, and cost as 4
        assert engine._plan_piece() == (prompt, 98, 100)
        assert engine._piece_cost(2) == pytest.approx(4 * 0.001)
    finally:
        forget(engine, run, prompt)


def test_the_seconds_per_token_weigh_pieces_by_their_tokens(itl_engine):
    """A ratio of decayed sums: short pieces' noise (a step less the average step, negative at
    times) averages out instead of each sample being clipped; a long piece outweighs them."""
    from decode_service.engine import PIECE_COST_DECAY
    engine = itl_engine
    engine.piece_s_per_token, engine._piece_sums = None, (0.0, 0.0)
    engine._measured_piece(0.016, 16)
    assert engine.piece_s_per_token == pytest.approx(0.001)
    engine._measured_piece(-0.004, 4)  # noise: the step ran faster than the average
    expected = (PIECE_COST_DECAY * 0.016 - 0.004) / (PIECE_COST_DECAY * 16 + 4)
    assert engine.piece_s_per_token == pytest.approx(expected)
    engine._measured_piece(-1.0, 4)  # never below zero
    assert engine.piece_s_per_token == 0.0
    engine._piece_sums = (0.0, 0.0)


def test_a_sized_piece_runs_beside_the_batch_and_its_cost_is_measured(itl_engine):
    """Real calls of the tiny model: with a step measured and no piece cost yet, the piece is
    the smallest (4 tokens, from position 0: a mixed call, the step rides in it); what it
    added to the step is measured, and the prompt advances by 4."""
    engine = itl_engine
    engine.step_s = engine.piece_s_per_token = None
    engine._piece_sums = (0.0, 0.0)
    run = running_sequence(engine, "measured", tokens=1, max_tokens=50, first_token_ago_s=0.0)
    prompt = engine.admit(DecodeJob("piece", tuple(range(300, 340))), 4, lambda event: None)
    try:
        engine._decode_calls()
        engine._local.append(prompt)
        piece = engine._plan_piece()
        assert piece == (prompt, 0, 4)
        assert engine._piece_now(piece) and engine._local_piece(piece)
        assert prompt.prefilled == 4 and len(run.generated) == 3
        assert engine.piece_s_per_token is not None
        assert engine.metrics.value("nxdi_mixed_steps_total") >= 1
    finally:
        forget(engine, run, prompt)


def test_log_steps_writes_mixed_steps_with_their_piece(tiny_chat_model, caplog):
    """--log-steps logs a mixed call (a prompt piece with the running batch's step) as a step
    too, with the piece's prompt tokens; a plain decode step has piece=0. Before, mixed steps
    had no line, and an aggregated worker's tokens from them looked like long pauses."""
    engine = build(tiny_chat_model, "--itl-target-ms", "50", "--piece-sizes", "4,8,16",
                   "--log-steps")
    run = running_sequence(engine, "run", tokens=1, max_tokens=50, first_token_ago_s=0.0)
    prompt = engine.admit(DecodeJob("piece", tuple(range(300, 340))), 4, lambda event: None)
    try:
        with caplog.at_level("INFO", logger="decode_service.steps"):
            engine._decode_calls()
            engine._local.append(prompt)
            piece = engine._plan_piece()
            assert piece == (prompt, 0, 4) and engine._local_piece(piece)
        lines = [r.getMessage() for r in caplog.records if r.name == "decode_service.steps"]
        assert len(lines) == 2 and len(run.generated) == 3
        assert lines[0].endswith(" rows=1 calls=1 paused=0.000000 local=0 piece=0")
        assert lines[1].endswith(" rows=1 calls=1 paused=0.000000 local=1 piece=4")  # 36 to go
    finally:
        forget(engine, run, prompt)
        engine.stop()


def test_pieces_grow_where_waiting_local_prompts_would_miss_the_ttft_target(tiny_chat_model):
    """With --ttft-target-ms the ITL-sized piece (4 here: 40 + 8 ms fits 50, 8 tokens do not)
    grows to the smallest length whose rate (tokens per step with it) finishes every waiting
    prompt, in the order they run, within the target of its arrival; the largest when none
    would; prompts already past the target only add their tokens. The local rate it reports is
    then at least what whole chunks would give: a router should not take the ITL-sized rate
    for all the engine can do before a deadline."""
    engine = build(tiny_chat_model, "--itl-target-ms", "50", "--piece-sizes", "4,8,16",
                   "--ttft-target-ms", "4000")
    run = running_sequence(engine, "run", tokens=1, max_tokens=50, first_token_ago_s=0.0)
    engine.step_s, engine.piece_s_per_token = 0.04, 0.002  # rates: 4 -> 83, 8 -> 143, 16 -> 222
    now = time.monotonic_ns()

    def waiting(rid: str, tokens: int, waited_s: float):
        seq = engine.admit(DecodeJob(rid, tuple(range(1000, 1000 + tokens))), 4,
                           lambda event: None)
        seq.arrival_ns = now - int(waited_s * 1e9)
        engine._local.append(seq)
        return seq

    first = waiting("first", 100, 4.0 - 1.5)  # 100 tokens in 1.5 s: 67 tokens/s
    assert engine._piece_size() == 4
    first.arrival_ns = now - int(3.2e9)  # 100 in 0.8 s: 125/s
    assert engine._piece_size() == 8
    first.arrival_ns = now - int(3.5e9)  # 100 in 0.5 s: 200/s
    assert engine._piece_size() == 16
    first.arrival_ns = now - int(3.8e9)  # 500/s: more than any piece gives
    assert engine._piece_size() == 16
    first.arrival_ns = now - int(5e9)  # missed already: its tokens only
    second = waiting("second", 100, 2.0)  # 200 tokens before its deadline in 2 s: 100/s
    assert engine._piece_size() == 8
    # the rate it reports: at least whole chunks' beside the step, 16 / (40 + 32 ms) = 222/s
    assert engine.load()["prefill_tokens_per_s"] == pytest.approx(16 / 0.072)
    engine.local_rate.add(500, 1.0)  # gone faster lately: that
    assert engine.load()["prefill_tokens_per_s"] == pytest.approx(500)
    engine.local_rate.s_per_token = None
    forget(engine, run, first, second)
    engine.config = EngineConfig(itl_target_s=0.05)  # no TTFT target: the ITL size alone
    assert engine.load()["prefill_tokens_per_s"] == 0.0  # and the measured rate alone
    engine._local.append(first)
    running_sequence(engine, "run2", tokens=1, max_tokens=50, first_token_ago_s=0.0)
    first.arrival_ns = now - int(3.9e9)
    assert engine._piece_size() == 4


def test_decode_steps_pad_to_dense_batch_buckets_and_bad_ones_are_refused(tiny_chat_model):
    model = build(tiny_chat_model, "--max-batch-size", "20").model
    tkg, mixed = model.token_generation_model, model.mixed_model
    assert tkg.batch_buckets == [1, 2, 4, 8, 10, 12, 14, 16, 20]
    assert tkg.select_bucket(9, 40) == (10, 256)  # powers of two would run 9 rows as 16
    assert mixed.batch_buckets == [1, 2, 4, 8, 16, 20]  # one graph per rows, piece and length
    given = build(tiny_chat_model, "--max-batch-size", "12", "--batch-buckets", "3,12").model
    assert given.token_generation_model.batch_buckets == [3, 12]
    assert given.token_generation_model.select_bucket(4, 40) == (12, 256)
    for extra, message in (
            (["--batch-buckets", "1,2"], r"--batch-buckets must end at --max-batch-size "
                                         r"\(4\), got \[1, 2\]"),
            (["--batch-buckets", "2,1,4"], "--batch-buckets must be strictly increasing"),
            (["--batch-buckets", "0,4"], "--batch-buckets must hold positive sizes"),
            (["--batch-buckets", "2,6"], "--batch-buckets has bucket 6 larger than "
                                         "--max-batch-size 4")):
        with pytest.raises(SystemExit, match=message):
            build(tiny_chat_model, *extra)


def test_piece_sizes_default_with_the_itl_target_and_bad_ones_are_refused(tiny_chat_model):
    assert main.default_piece_sizes(256) == (16, 32, 64, 128, 256)
    assert main.default_piece_sizes(100) == (16, 32, 64, 100)
    assert main.default_piece_sizes(16) == (16,)
    args = main.parse_args(["--model", "m", "--prefill-chunk-tokens", "256",
                            "--itl-target-ms", "30"])
    assert main._piece_sizes(args) == (16, 32, 64, 128, 256)
    # no target: one short size and the chunk; no chunking: none
    assert main._piece_sizes(main.parse_args(["--model", "m"])) == (64, 256)
    assert main._piece_sizes(main.parse_args(["--model", "m", "--prefill-chunk-tokens", "64"])) \
        is None
    assert main._piece_sizes(main.parse_args(["--model", "m", "--prefill-chunk-tokens", "0"])) \
        is None
    for extra, message in (
            (["--itl-target-ms", "0"], "--itl-target-ms must be > 0 milliseconds, got 0.0"),
            (["--piece-sizes", "4,8"], r"--piece-sizes must end at --prefill-chunk-tokens "
                                       r"\(16\), got \[4, 8\]"),
            (["--piece-sizes", "8,4,16"], "--piece-sizes must be strictly increasing"),
            (["--piece-sizes", "4,32"], "--piece-sizes has bucket 32 larger than "
                                        "--prefill-chunk-tokens 16")):
        with pytest.raises(SystemExit, match=message):
            build(tiny_chat_model, *extra)
    with pytest.raises(SystemExit, match="--piece-sizes needs local prefill in pieces"):
        main.build(main.parse_args(["--model", str(tiny_chat_model), "--max-model-len", "256",
                                    "--prefill-chunk-tokens", "0", "--piece-sizes", "4"]))
    with pytest.raises(ValueError, match="itl_target_s must be > 0 seconds, got 0"):
        EngineConfig(itl_target_s=0)
    with pytest.raises(SystemExit, match="--ttft-target-ms must be > 0 milliseconds"):
        build(tiny_chat_model, "--ttft-target-ms", "-5")
    with pytest.raises(SystemExit, match="--pace-stretch must be from 1 to 10 .* got 0.5"):
        build(tiny_chat_model, "--pace-stretch", "0.5")
    with pytest.raises(SystemExit, match="--kv-receive-nice must be an integer from 0 to 19, "
                                         "got 25"):
        build(tiny_chat_model, "--kv-receive-nice", "25")
    with pytest.raises(ValueError, match="pace_stretch must be a number from 1 to 10"):
        EngineConfig(pace_stretch=0.9)


def test_the_benchmark_passes_the_itl_target_to_our_decode_workers():
    from nxdi_bench import cli
    from nxdi_bench.configs import ServeSettings, our_launch_spec
    args = cli.build_parser().parse_args(["compare", "--decode-itl-target", "0.03",
                                          "--decode-ttft-target", "4"])
    assert (args.decode_itl_target, args.decode_ttft_target) == (0.03, 4)
    serve = ServeSettings(decode_itl_target_s=0.03, decode_ttft_target_s=4)
    same = ServeSettings(decode_itl_target_s=0.03, decode_ttft_target_s=4,
                         aggregated_local_prefill="same")
    # the aggregated worker takes them only with --aggregated-local-prefill same (its default,
    # inline, prefills in --prefill-chunk-tokens pieces: test_bench_quick)
    for name, settings in (("disaggregated", serve), ("aggregated", same)):
        assert our_launch_spec(name, settings).decode_args[-4:] == [
            "--itl-target-ms", "30", "--ttft-target-ms", "4000"]
        assert "--itl-target-ms" not in our_launch_spec(name, ServeSettings()).decode_args
    assert "--itl-target-ms" not in our_launch_spec("aggregated", serve).decode_args
    args = cli.build_parser().parse_args(["compare", "--decode-pace-stretch", "1.2"])
    assert args.decode_pace_stretch == 1.2
    assert our_launch_spec("disaggregated", ServeSettings(decode_pace_stretch=1.2)).decode_args[
        -2:] == ["--pace-stretch", "1.2"]
    assert "--pace-stretch" not in our_launch_spec("disaggregated", ServeSettings()).decode_args
