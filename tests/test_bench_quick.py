"""``nxdi-bench compare --quick`` end to end against the real local stack (router, prefill and
decode processes on a tiny model): both of our configurations measured, outputs exactly as long
as requested, results/table/plots written, and a peer that cannot start reported, not dropped."""
import argparse
import json

import pytest

from nxdi_bench import cli, peers


@pytest.fixture(scope="module")
def quick_run(tiny_chat_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("goodput")
    mp = pytest.MonkeyPatch()

    def unavailable(peer, **kwargs):
        raise peers.PeerUnavailable(peer, "no wheel can be built on this test machine", None)

    mp.setattr(peers, "start_peer", unavailable)
    try:
        rc = cli.main(["compare", "--quick", "--model", str(tiny_chat_model), "--backend", "eager",
                       "--dtype", "float32", "--max-model-len", "256", "--decode-max-batch-size",
                       "8", "--kv-blocks", "256",
                       "--configs", "disaggregated,aggregated,llama.cpp", "--out-dir", str(out)])
    finally:
        mp.undo()
    return rc, out


def test_quick_compare_measures_both_of_our_configurations(quick_run):
    rc, out = quick_run
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["workload"] == "mixed"
    for name in ("disaggregated", "aggregated"):
        res = results["configs"][name]
        assert res["status"] == "ok", res
        assert res["unloaded"]["completed"] == res["unloaded"]["num_requests"] >= 1
        points = res["sweep"]["points"]
        assert 1 <= len(points) <= 2
        for p in points:
            s = p["summary"]
            assert s["failed"] == 0 and s["completed"] == s["num_requests"] >= 6
            assert 0.0 <= s["slo_attainment"] <= 1.0
            assert 0 < s["ttft_s"]["p50"] <= s["e2e_s"]["p50"]
            assert s["itl_s"]["count"] > 0
        assert res["sweep"]["goodput"] in [0.0] + [p["rate"] for p in points if p["passed"]]
        assert res["cdf"]["ttft_s"] and res["cdf"]["itl_s"]


def test_each_of_our_configurations_leaves_its_processes_output(quick_run):
    """logs/<configuration>.log: every process's lines, the router's request lines among them,
    which say where each prompt was prefilled: the prefill worker (disaggregated) or the decode
    worker itself (aggregated)."""
    _, out = quick_run
    results = json.loads((out / "results.json").read_text())
    for name in ("disaggregated", "aggregated"):
        text = (out / "logs" / f"{name}.log").read_text()
        served = [line for line in text.splitlines() if line.startswith("[router")
                  and " ok decode=" in line]
        res = results["configs"][name]
        assert len(served) >= res["unloaded"]["completed"] + sum(
            p["summary"]["completed"] for p in res["sweep"]["points"]), name
        places = {line.split("prefill=", 1)[1].split()[0] for line in served}
        if name == "aggregated":
            assert places == {"local"}
        else:
            assert "local" not in places and all(":" in p for p in places), places
        assert any(line.startswith("[decode") for line in text.splitlines())


def test_outputs_are_exactly_as_long_as_requested(quick_run):
    _, out = quick_run
    records = json.loads((out / "records.json").read_text())
    assert set(records) == {"disaggregated", "aggregated"}
    for name, recs in records.items():
        for r in recs:
            assert r["error"] is None
            assert r["output_tokens"] == r["expected_output_tokens"], name
            # one event per token; a last token with no text of its own may only finish
            assert r["expected_output_tokens"] - 1 <= len(r["token_times"]) <= r["output_tokens"]
            assert r["token_times"] == sorted(r["token_times"])


def test_a_peer_that_cannot_run_is_reported_with_its_error(quick_run):
    _, out = quick_run
    res = json.loads((out / "results.json").read_text())["configs"]["llama.cpp"]
    assert res["status"] == "unavailable"
    assert "no wheel can be built" in res["error"]
    table = (out / "table.md").read_text()
    assert "| llama.cpp | not run:" in table and "no wheel can be built" in table


def test_table_and_plots_are_written(quick_run):
    _, out = quick_run
    table = (out / "table.md").read_text()
    assert "| disaggregated |" in table and "| aggregated |" in table and "TTFT <=" in table
    for name in ("latency_cdfs.png", "goodput.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.fixture(scope="module")
def tiny_server(tiny_chat_model):
    from nxdi_common.serving.launcher import Cluster, LaunchSpec
    spec = LaunchSpec(model=str(tiny_chat_model), dtype="float32", backend="eager",
                      max_model_len=256, prefill_workers=0, decode_workers=1, threads=1)
    with Cluster(spec) as cluster:
        yield cluster.http_url


@pytest.mark.parametrize("mode", [["--rate", "4"], ["--concurrency", "2"]])
def test_load_command_runs_open_and_closed_loop(tiny_server, tiny_chat_model, tmp_path, mode):
    out = tmp_path / "load.json"
    rc = cli.main(["load", "--url", tiny_server, "--tokenizer", str(tiny_chat_model), *mode,
                   "--num-requests", "6", "--max-model-len", "256", "--length-scale", "0.125",
                   "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 6 and result["summary"]["failed"] == 0
    assert [r["output_tokens"] for r in result["records"]] == \
        [r["expected_output_tokens"] for r in result["records"]]
    if mode[0] == "--rate":
        assert result["summary"]["rate"] == 4.0
        dues = [r["due_s"] for r in result["records"]]
        assert dues[0] == 0.0 and dues == sorted(dues) and dues[-1] > 0
    else:
        assert result["summary"]["concurrency"] == 2


def test_conditional_disaggregation_flags_reach_only_the_disaggregated_router():
    from nxdi_bench.configs import ServeSettings, our_launch_spec
    args = cli.build_parser().parse_args(["compare", "--local-prefill-max-tokens", "256",
                                          "--local-prefill-queue-tokens", "1024"])
    assert (args.local_prefill_max_tokens, args.local_prefill_queue_tokens) == (256, 1024)
    serve = ServeSettings(local_prefill_max_tokens=256, local_prefill_queue_tokens=1024)
    assert our_launch_spec("disaggregated", serve).router_args == [
        "--local-prefill-max-tokens", "256", "--local-prefill-queue-tokens", "1024"]
    assert our_launch_spec("aggregated", serve).router_args == []
    assert our_launch_spec("disaggregated", ServeSettings()).router_args == []
    always = ServeSettings(local_prefill_always_tokens=256, prefill_chunk_tokens=128)
    assert our_launch_spec("disaggregated", always).router_args == [
        "--local-prefill-always-tokens", "256"]
    for name in ("disaggregated", "aggregated"):
        assert our_launch_spec(name, always).decode_args[-2:] == ["--prefill-chunk-tokens", "128"]
    held = cli._compare_settings(cli.build_parser().parse_args(
        ["compare", "--local-prefill-hold-ttft", "3.5"])).serve
    assert our_launch_spec("disaggregated", held).router_args == [
        "--local-prefill-hold-ttft-seconds", "3.5"]
    assert our_launch_spec("aggregated", held).router_args == []


def test_prefill_order_flags_reach_only_the_disaggregated_prefill_worker():
    from nxdi_bench.configs import ServeSettings, our_launch_spec
    from prefill_service.scheduler import ORDERS
    args = cli.build_parser().parse_args(["compare", "--prefill-order", "shortest",
                                          "--prefill-max-overtaken", "2"])
    assert (args.prefill_order, args.prefill_max_overtaken) == ("shortest", 2.0)
    compare = next(a for a in cli.build_parser()._subparsers._group_actions
                   if "compare" in a.choices).choices["compare"]
    offered = next(a.choices for a in compare._actions if a.dest == "prefill_order")
    assert tuple(offered) == ORDERS  # the bench offers exactly the worker's orders
    serve = ServeSettings(prefill_order="shortest", prefill_max_overtaken_s=2.0)
    assert our_launch_spec("disaggregated", serve).prefill_args == [
        "--order", "shortest", "--max-overtaken-seconds", "2"]
    deadline = cli._compare_settings(cli.build_parser().parse_args(
        ["compare", "--prefill-order", "deadline", "--prefill-max-overtaken", "8",
         "--prefill-ttft-target", "3.25"])).serve
    assert our_launch_spec("disaggregated", deadline).prefill_args == [
        "--order", "deadline", "--max-overtaken-seconds", "8", "--ttft-target-seconds", "3.25"]
    niced = cli._compare_settings(cli.build_parser().parse_args(
        ["compare", "--prefill-nice", "10"])).serve
    assert our_launch_spec("disaggregated", niced).prefill_args == ["--nice", "10"]
    assert our_launch_spec("aggregated", niced).prefill_args == []
    for bad in ("20", "-1", "low"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["compare", "--prefill-nice", bad])
    assert our_launch_spec("aggregated", serve).prefill_args == []
    assert our_launch_spec("disaggregated", ServeSettings()).prefill_args == []
    nice = cli._compare_settings(cli.build_parser().parse_args(
        ["compare", "--decode-local-prefill-nice", "5"])).serve
    spec = our_launch_spec("disaggregated", nice)
    assert spec.decode_args[-2:] == ["--local-prefill-nice", "5"]
    assert "--local-prefill-nice" not in our_launch_spec("disaggregated",
                                                         ServeSettings()).decode_args
    idle = cli._compare_settings(cli.build_parser().parse_args(
        ["compare", "--decode-local-prefill-nice", "idle"])).serve
    assert our_launch_spec("disaggregated", idle).decode_args[-2:] == [
        "--local-prefill-nice", "idle"]
    for bad in ("20", "-1", "low"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["compare", "--decode-local-prefill-nice", bad])
    held = cli._compare_settings(cli.build_parser().parse_args(
        ["compare", "--decode-hold-first-token"])).serve
    for name in ("disaggregated", "aggregated"):
        assert our_launch_spec(name, held).decode_args[-1] == "--hold-first-token"
        assert "--hold-first-token" not in our_launch_spec(name, ServeSettings()).decode_args


def test_aggregated_inline_local_prefill_drops_only_the_idle_thread_and_its_pacing():
    """--aggregated-local-prefill inline (the default): the aggregated (and replicated) workers
    prefill in pieces between their steps (no --local-prefill-nice, --itl-target-ms,
    --ttft-target-ms, --pace-stretch), keeping every other decode option; the disaggregated
    decode worker keeps them all; 'same' gives every configuration the same options; other
    values are refused."""
    from nxdi_bench.configs import ServeSettings, our_launch_spec
    flags = ["compare", "--decode-local-prefill-nice", "idle", "--decode-itl-target", "0.018",
             "--decode-ttft-target", "3.5", "--decode-pace-stretch", "1.2",
             "--decode-tpot-target", "0.1", "--decode-hold-first-token", "--kv-blocks", "2048",
             "--cpus", "0,1"]
    paced = ["--itl-target-ms", "18", "--ttft-target-ms", "3500", "--local-prefill-nice", "idle",
             "--pace-stretch", "1.2"]
    same = cli._compare_settings(cli.build_parser().parse_args(
        flags + ["--aggregated-local-prefill", "same"])).serve
    inline = cli._compare_settings(cli.build_parser().parse_args(flags)).serve
    assert inline.aggregated_local_prefill == "inline" == ServeSettings().aggregated_local_prefill
    full = our_launch_spec("disaggregated", same).decode_args
    assert all(f in full for f in paced)
    assert our_launch_spec("aggregated", same).decode_args == full
    assert our_launch_spec("disaggregated", inline).decode_args == full
    for name in ("aggregated", "replicated"):  # no prefill worker: they prefill every prompt
        assert our_launch_spec(name, inline).decode_args == [
            "--max-batch-size", "16", "--kv-blocks", "2048", "--tpot-target-ms", "100",
            "--hold-first-token"]
        assert our_launch_spec(name, same).decode_args == full
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["compare", "--aggregated-local-prefill", "idle"])
    with pytest.raises(ValueError, match="aggregated_local_prefill must be one of same, inline"):
        our_launch_spec("aggregated", ServeSettings(aggregated_local_prefill="x"))


def test_replicated_runs_one_decode_worker_per_cpu_and_is_not_in_the_default_set():
    from nxdi_bench.configs import CONFIGS, DEFAULT_CONFIGS, ServeSettings, our_launch_spec
    spec = our_launch_spec("replicated", ServeSettings(cpus=[2, 5], decode_tpot_target_s=0.1))
    assert (spec.prefill_workers, spec.decode_workers, spec.threads) == (0, 2, 1)
    assert spec.cpus == {"decode0": [2], "decode1": [5]}
    assert spec.router_args == [] and "--tpot-target-ms" in spec.decode_args
    with pytest.raises(ValueError, match=r"replicated needs at least 2 CPUs .* got \[0\]"):
        our_launch_spec("replicated", ServeSettings(cpus=[0]))
    assert "replicated" in CONFIGS and "replicated" not in DEFAULT_CONFIGS
    settings = cli._compare_settings(cli.build_parser().parse_args(["compare"]))
    assert settings.configs == ["disaggregated", "aggregated", "vllm-cpu", "llama.cpp"]


def test_router_and_client_cpus_and_step_lines_reach_their_processes():
    """--router-cpus pins our router (every configuration of ours; default: not pinned) and
    --router-nice gives it --nice, --router-wake-ms its --wake-ms,
    --client-cpus every thread of the load generator's process while it drives a
    configuration, those started before too (each one's affinity before comes back after), --decode-log-steps gives our decode workers --log-steps; CPU
    lists this process may not use are refused by name."""
    import os
    import threading

    from nxdi_bench.compare import pinned
    from nxdi_bench.configs import OURS, ServeSettings, our_launch_spec
    cpu = min(os.sched_getaffinity(0))
    settings = cli._compare_settings(cli.build_parser().parse_args(
        ["compare", "--router-cpus", str(cpu), "--client-cpus", str(cpu), "--cpus", "0,1",
         "--decode-log-steps", "--router-nice", "7", "--router-wake-ms", "1.5"]))
    assert settings.serve.router_cpus == [cpu] and settings.client_cpus == [cpu]
    for name in OURS:
        spec = our_launch_spec(name, settings.serve)
        assert spec.cpus["router"] == [cpu]
        assert spec.decode_args[-1] == "--log-steps"
        assert spec.router_args[:4] == ["--nice", "7", "--wake-ms", "1.5"]
        plain = our_launch_spec(name, ServeSettings(cpus=[0, 1]))
        assert "router" not in plain.cpus and "--log-steps" not in plain.decode_args
        assert "--nice" not in plain.router_args and "--wake-ms" not in plain.router_args
    assert our_launch_spec("disaggregated", settings.serve).cpus == {
        "prefill0": [0], "decode0": [1], "router": [cpu]}
    before = os.sched_getaffinity(0)
    started, done = threading.Event(), threading.Event()
    drain = threading.Thread(target=lambda: (started.set(), done.wait(30)))  # as a log drain
    drain.start()
    started.wait(30)
    try:
        with pinned([cpu]):
            assert os.sched_getaffinity(0) == {cpu}
            assert os.sched_getaffinity(drain.native_id) == {cpu}  # started before: moved too
        assert os.sched_getaffinity(0) == before
        assert os.sched_getaffinity(drain.native_id) == before
    finally:
        done.set()
        drain.join()
    with pinned(None):
        assert os.sched_getaffinity(0) == before
    for flag in ("--router-cpus", "--client-cpus"):
        for bad in ("x", "", "2-y", str(max(before) + 1000)):
            with pytest.raises(SystemExit):
                cli.build_parser().parse_args(["compare", flag, bad])
    for bad in ("20", "-1", "x"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["compare", "--router-nice", bad])
    for bad in ("0.05", "-1", "x", "nan", "2000"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["compare", "--router-wake-ms", bad])
    with pytest.raises(argparse.ArgumentTypeError, match=r"CPUs \[\d+\] are not available"):
        cli._cpu_list(str(max(before) + 1000))


def test_client_slice_reaches_every_thread_of_the_load_generator_and_is_given_back():
    """--client-slice-us gives every thread of the load generator's process (those started
    before too, such as the services' log drains) that scheduler slice while it drives a
    configuration, and the kernel's default back after; 0 (the default) leaves them alone;
    values out of range are refused."""
    import threading

    from nxdi_bench.compare import sliced
    from nxdi_common.serving.thread_priority import thread_slice_us
    settings = cli._compare_settings(cli.build_parser().parse_args(
        ["compare", "--client-slice-us", "150"]))
    assert settings.client_slice_us == 150
    assert cli._compare_settings(cli.build_parser().parse_args(["compare"])).client_slice_us == 0
    for bad in ("50", "-1", "x", "200000"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["compare", "--client-slice-us", bad])
    default = thread_slice_us()
    if default is None:
        notes = []
        with sliced(150, notes.append):  # no custom slices: said, nothing raised
            pass
        assert notes and "not available" in notes[0]
        pytest.skip("a kernel with EEVDF custom slices (Linux 6.12+) needed for the rest")
    started, done = threading.Event(), threading.Event()
    drain = threading.Thread(target=lambda: (started.set(), done.wait(30)))  # as a log drain
    drain.start()
    started.wait(30)
    try:
        with sliced(0, pytest.fail):
            assert thread_slice_us() == default == thread_slice_us(drain.native_id)
        with sliced(150, pytest.fail):
            assert thread_slice_us() == 150 == thread_slice_us(drain.native_id)
        assert thread_slice_us() == default == thread_slice_us(drain.native_id)
    finally:
        done.set()
        drain.join()


@pytest.mark.parametrize("flags, expected", [
    ([], "Served on CPUs 0-1 (disaggregated: the prefill worker on the first, the decode worker "
         "on the last); our router not pinned; the load generator not pinned"),
    (["--router-cpus", "0", "--client-cpus", "0"],
     "our router on CPU 0; the load generator on CPU 0 (alike for every configuration)")])
def test_the_table_says_where_the_run_put_the_router_and_the_load_generator(flags, expected):
    """The headline table states the placement it was measured with (session 74: the client's
    pin alone moved vLLM CPU's goodput 2.7x), from the run's own settings."""
    import os

    from nxdi_bench.compare import _meta
    from nxdi_bench.report import markdown_table
    cpu = min(os.sched_getaffinity(0))
    flags = [f if f != "0" else str(cpu) for f in flags]
    expected = expected.replace("CPU 0", f"CPU {cpu}")
    settings = cli._compare_settings(cli.build_parser().parse_args(
        ["compare", "--cpus", "0,1", *flags]))
    meta = json.loads(json.dumps(_meta(settings)))  # as results.json holds it
    head = markdown_table({"meta": meta, "configs": {}}).splitlines()
    assert expected in head[1]
