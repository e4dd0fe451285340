"""The local launcher: argument and ready-line parsing, command lines, and real child processes
(a small stand-in service built on GrpcServer: ready line, health, graceful SIGTERM) for startup,
failure with the child's output tail, CPU pinning, fault injection and leaving no process behind."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from nxdi_common.serving.launcher import (MODEL_FLAGS, SERVICE_FLAGS, Cluster, LaunchError,
                                          LaunchSpec, build_parser, connectable, default_command,
                                          health_ok, main, parse_cpus, parse_ready_line,
                                          spec_from_args)

REPO = Path(__file__).resolve().parents[1]

FAKE_SERVICE = textwrap.dedent("""
    import asyncio, json, os, subprocess, sys
    from nxdi_common.serving.grpc_server import GrpcServer, install_shutdown, print_ready
    from nxdi_common.serving.metrics import ServingMetrics

    async def main():
        role = sys.argv[1]
        print("args " + json.dumps(sys.argv[2:]), flush=True)
        print("cpus " + json.dumps(sorted(os.sched_getaffinity(0))), flush=True)
        print("omp " + os.environ.get("OMP_NUM_THREADS", "-"), flush=True)
        print("stderr works", file=sys.stderr, flush=True)
        if os.environ.get("FAKE_GRANDCHILD"):
            child = subprocess.Popen(["sleep", "120"])
            print(f"grandchild {child.pid}", flush=True)
        server = GrpcServer([], 1 << 20)
        port = await server.start("127.0.0.1", 0)
        metrics = ServingMetrics(role)
        mport = metrics.start_http_server("127.0.0.1", 0)
        install_shutdown(asyncio.get_running_loop(), lambda: server.stop(1))
        extra = {"http": f"127.0.0.1:{mport}"} if role == "router" else {}
        print_ready(role, grpc=f"127.0.0.1:{port}", metrics=f"127.0.0.1:{mport}", **extra)
        await server.wait_for_termination()
        print("stopped gracefully", flush=True)

    asyncio.run(main())
""")


@pytest.fixture
def fake_service(tmp_path):
    script = tmp_path / "fake_service.py"
    script.write_text(FAKE_SERVICE)
    return script


def _fake_commands(script, overrides=None):
    """command_fn: the stand-in service for every role; ``overrides`` maps a process name to a
    replacement command line."""
    overrides = overrides or {}

    def command(role, index, spec, peers):
        name = "router" if role == "router" else f"{role}{index}"
        if name in overrides:
            return overrides[name]
        peer_args = [a for r in ("prefill", "decode") for p in peers.get(r, [])
                     for a in (f"--{r}", p)]
        return [sys.executable, str(script), role, *peer_args]

    return command


def _spec(**kwargs):
    defaults = dict(startup_timeout_seconds=60, stop_timeout_seconds=10,
                    env={"PYTHONPATH": str(REPO)})
    return LaunchSpec(**{**defaults, **kwargs})


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _tail_value(child, key: str) -> str:
    lines = [line for line in child.tail.lines() if line.startswith(key + " ")]
    assert len(lines) == 1, child.tail.text()
    return lines[0][len(key) + 1:]


# ---------------------------------------------------------------------------------------------
# Parsing and command lines
# ---------------------------------------------------------------------------------------------

def test_parse_ready_line():
    line = 'NXDI_READY {"role": "router", "grpc": "0.0.0.0:50051", "http": "127.0.0.1:8000"}\n'
    assert parse_ready_line(line) == {"role": "router", "grpc": "0.0.0.0:50051",
                                      "http": "127.0.0.1:8000"}
    assert parse_ready_line("INFO loading model\n") is None
    assert parse_ready_line('NXDI_READY {"role": "decode", "grpc": "[::1]:7"}') == {
        "role": "decode", "grpc": "[::1]:7"}
    for bad, match in [("NXDI_READY {not json", "not JSON"),
                       ('NXDI_READY {"grpc": "h:1"}', "role"),
                       ('NXDI_READY {"role": "decode"}', "grpc"),
                       ('NXDI_READY {"role": "decode", "grpc": "h:0"}', "grpc"),
                       ('NXDI_READY {"role": "decode", "grpc": "h:1", "metrics": "h"}',
                        "metrics")]:
        with pytest.raises(ValueError, match=match):
            parse_ready_line(bad)
    assert connectable("0.0.0.0:5") == "127.0.0.1:5"
    assert connectable("[::]:5") == "[::1]:5"
    assert connectable("10.0.0.2:5") == "10.0.0.2:5"


def test_parse_cpus():
    assert parse_cpus(["prefill0=0", "decode1=1-3,5", "router=4"]) == {
        "prefill0": [0], "decode1": [1, 2, 3, 5], "router": [4]}
    assert parse_cpus(["router0=2"]) == {"router": [2]}
    for bad, match in [(["prefill0"], "NAME=CPUS"), (["gpu0=1"], "process name"),
                       (["prefill=1"], "process name"), (["decode0=a"], "CPU list"),
                       (["decode0=3-1"], "empty"), (["decode0=1", "decode0=2"], "twice")]:
        with pytest.raises(ValueError, match=match):
            parse_cpus(bad)


def test_cli_arguments_to_spec():
    args = build_parser().parse_args([
        "--prefill-workers", "2", "--decode-workers", "3", "--http-port", "8001",
        "--grpc-port", "50052", "--cpus", "prefill0=0", "--cpus", "decode2=1", "--threads", "1",
        "--model", "/m", "--dtype", "float32", "--backend", "eager", "--max-model-len", "512",
        "--policy", "round-robin", "--decode-args", "--kv-blocks 64 --block-size 16",
        "--check", "Hi"])
    spec = spec_from_args(args)
    assert (spec.prefill_workers, spec.decode_workers, spec.http_port, spec.grpc_port) == \
        (2, 3, 8001, 50052)
    assert spec.cpus == {"prefill0": [0], "decode2": [1]}
    assert (spec.model, spec.dtype, spec.backend, spec.max_model_len, spec.threads) == \
        ("/m", "float32", "eager", 512, 1)
    assert spec.decode_args == ["--kv-blocks", "64", "--block-size", "16"]
    assert spec.router_args == ["--policy", "round-robin"]
    assert args.check == "Hi"
    defaults = build_parser().parse_args([])
    assert (defaults.http_port, defaults.grpc_port, defaults.check) == (8000, 50051, None)


def test_cli_rejects_bad_options(capsys):
    for argv, match in [(["--cpus", "decode1=0"], "decode1"),
                        (["--decode-workers", "0"], "decode_workers"),
                        (["--http-port", "70000"], "http_port")]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert match in capsys.readouterr().err


def test_spec_validation_names_the_field():
    for kwargs, match in [(dict(dtype="float16"), "dtype"), (dict(backend="neuron"), "backend"),
                          (dict(prefill_workers=-1), "prefill_workers"),
                          (dict(threads=0), "threads"), (dict(max_model_len=1), "max_model_len"),
                          (dict(cpus={"prefill0": []}), "prefill0"),
                          (dict(cpus={"prefill1": [0]}), "prefill1")]:
        with pytest.raises(ValueError, match=match):
            LaunchSpec(**kwargs)


def test_default_commands():
    spec = LaunchSpec(model="/m", backend="eager", prefill_workers=1, decode_workers=2,
                      cpus={"decode1": [0, 1]}, decode_args=["--kv-blocks", "64"],
                      router_args=["--policy", "round-robin"], python="py")
    assert default_command("prefill", 0, spec, {}) == [
        "py", "-m", "prefill_service", "--host", "127.0.0.1", "--port", "0", "--metrics-port",
        "0", "--dtype", "bfloat16", "--max-model-len", "2048", "--backend", "eager",
        "--model", "/m"]
    assert default_command("decode", 1, spec, {})[-4:] == ["--threads", "2", "--kv-blocks", "64"]
    router = default_command("router", 0, spec, {"prefill": ["a:1"], "decode": ["b:2", "c:3"]})
    assert router[:9] == ["py", "-m", "router", "--host", "127.0.0.1", "--http-port", "0",
                          "--grpc-port", "0"]
    assert router[-8:] == ["--prefill", "a:1", "--decode", "b:2", "--decode", "c:3",
                           "--policy", "round-robin"]


def test_default_commands_use_known_flags():
    spec = LaunchSpec(model="/m", compiled_root="/c", threads=2)
    peers = {"prefill": ["a:1"], "decode": ["b:2"]}
    for role in ("prefill", "decode", "router"):
        argv = default_command(role, 0, spec, peers)
        flags = {a for a in argv if a.startswith("--")}
        assert flags <= set(SERVICE_FLAGS[role]) | set(MODEL_FLAGS), role


# ---------------------------------------------------------------------------------------------
# Real child processes
# ---------------------------------------------------------------------------------------------

def test_cluster_starts_serves_and_stops_gracefully(fake_service):
    cpu = min(os.sched_getaffinity(0))
    cluster = Cluster(_spec(prefill_workers=2, decode_workers=1, cpus={"decode0": [cpu]}),
                      command_fn=_fake_commands(fake_service))
    with cluster:
        workers = cluster.workers
        assert [(w.role, w.index) for w in workers] == [("prefill", 0), ("prefill", 1),
                                                        ("decode", 0)]
        for child in [*workers, cluster.router]:
            assert health_ok(child.grpc, 5) is True
            assert _tail_value(child, "stderr") == "works"
        router_args = json.loads(_tail_value(cluster.router, "args"))
        assert router_args == ["--prefill", workers[0].grpc, "--prefill", workers[1].grpc,
                               "--decode", workers[2].grpc]
        assert json.loads(_tail_value(workers[2], "cpus")) == [cpu]
        assert _tail_value(workers[2], "omp") == "1"
        assert _tail_value(workers[0], "omp") == "-"
        assert cluster.grpc_address == cluster.router.grpc
        assert cluster.http_url == f"http://{cluster.router.ready['http']}"
        metrics = httpx.get(f"{cluster.http_url}/metrics", timeout=10)
        assert 'nxdi_running_sequences{role="router"} 0.0' in metrics.text
        pids = [c.pid for c in [*workers, cluster.router]]
    assert [c.process.returncode for c in [*workers, cluster.router]] == [0, 0, 0, 0]
    assert all("stopped gracefully" in c.tail.lines() for c in [*workers, cluster.router])
    assert not any(_alive(pid) for pid in pids)


def test_child_failing_at_startup_raises_with_tail_and_leaves_nothing(fake_service):
    crash = [sys.executable, "-c", "import sys; print('loading model'); "
             "print('boom: no checkpoint at /nope', file=sys.stderr); sys.exit(3)"]
    spec = _spec(prefill_workers=1, decode_workers=1,
                 env={"PYTHONPATH": str(REPO), "FAKE_GRANDCHILD": "1"})
    cluster = Cluster(spec, command_fn=_fake_commands(fake_service, {"decode0": crash}))
    with pytest.raises(LaunchError) as err:
        cluster.start()
    message = str(err.value)
    decode = cluster.worker("decode", 0)
    assert f"decode0 (pid {decode.pid}) exited with code 3 before it was serving" in message
    assert "loading model" in message and "boom: no checkpoint at /nope" in message
    prefill = cluster.worker("prefill", 0)
    assert prefill.process.returncode is not None
    grandchildren = [int(line.split()[1]) for line in prefill.tail.lines()
                     if line.startswith("grandchild ")]
    assert not any(_alive(pid) for pid in [prefill.pid, decode.pid, *grandchildren])
    assert cluster.router is None


def test_router_failure_stops_started_workers(fake_service):
    crash = [sys.executable, "-c", "raise SystemExit('router: bad --policy')"]
    cluster = Cluster(_spec(), command_fn=_fake_commands(fake_service, {"router": crash}))
    with pytest.raises(LaunchError, match="router: bad --policy"):
        cluster.start()
    assert all(w.process.returncode == 0 for w in cluster.workers)


def test_ready_timeout_and_malformed_ready_line(fake_service):
    silent = [sys.executable, "-c", "import time; print('compiling', flush=True); time.sleep(60)"]
    cluster = Cluster(_spec(prefill_workers=0, startup_timeout_seconds=1.5),
                      command_fn=_fake_commands(fake_service, {"decode0": silent}))
    started = time.monotonic()
    with pytest.raises(LaunchError, match="decode0 did not print its ready line in time"
                                          "(.|\n)*compiling"):
        cluster.start()
    assert time.monotonic() - started < 10
    assert cluster.worker("decode", 0).process.returncode == -signal.SIGTERM
    bad = [sys.executable, "-c", "print('NXDI_READY {\"role\": \"decode\"}')"]
    cluster = Cluster(_spec(prefill_workers=0),
                      command_fn=_fake_commands(fake_service, {"decode0": bad}))
    with pytest.raises(LaunchError, match="decode0: ready line 'grpc' must be"):
        cluster.start()


def test_missing_executable_and_unavailable_cpu(fake_service):
    cluster = Cluster(_spec(prefill_workers=0),
                      command_fn=_fake_commands(fake_service, {"decode0": ["/nonexistent/x"]}))
    with pytest.raises(LaunchError, match="decode0: cannot start"):
        cluster.start()
    missing_cpu = max(os.sched_getaffinity(0)) + 1000
    cluster = Cluster(_spec(prefill_workers=0, cpus={"decode0": [missing_cpu]}),
                      command_fn=_fake_commands(fake_service))
    with pytest.raises(LaunchError, match=f"CPUs \\[{missing_cpu}\\] are not available"):
        cluster.start()


def test_kill_worker_and_unexpected_exit(fake_service):
    with Cluster(_spec(prefill_workers=1, decode_workers=2),
                 command_fn=_fake_commands(fake_service)) as cluster:
        cluster.kill_worker("decode", 1)
        killed = cluster.worker("decode", 1)
        assert killed.process.returncode == -signal.SIGKILL
        assert health_ok(killed.grpc, 1) is False
        assert cluster.unexpected_exits() == []
        prefill = cluster.worker("prefill", 0)
        os.kill(prefill.pid, signal.SIGKILL)
        prefill.process.wait(10)
        assert cluster.unexpected_exits() == [prefill]
        assert health_ok(cluster.worker("decode", 0).grpc, 5) is True
    assert cluster.unexpected_exits() == []
    assert cluster.worker("decode", 0).process.returncode == 0
    with pytest.raises(ValueError, match="no decode worker with index 5"):
        cluster.kill_worker("decode", 5)


def test_children_die_with_a_killed_launcher(fake_service, tmp_path):
    """Even a SIGKILLed launcher leaves no orphans: children get SIGTERM when it dies."""
    runner = tmp_path / "runner.py"
    runner.write_text(textwrap.dedent(f"""
        import sys, time
        from nxdi_common.serving.launcher import Cluster, LaunchSpec
        command = lambda role, index, spec, peers: [sys.executable, {str(fake_service)!r}, role]
        cluster = Cluster(LaunchSpec(startup_timeout_seconds=60), command_fn=command).start()
        print(" ".join(str(c.pid) for c in [*cluster.workers, cluster.router]), flush=True)
        time.sleep(120)
    """))
    launcher = subprocess.Popen([sys.executable, str(runner)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_launcher_and_scaffolding_do_not_import_torch():
    code = ("import sys, nxdi_common.serving.launcher, nxdi_common.serving.grpc_server, "
            "nxdi_common.serving.metrics; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    assert out.stdout.strip() == "False"
