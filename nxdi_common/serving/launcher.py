"""Local launcher (``nxdi-serve``): the router, N prefill and M decode workers as local processes.

Workers start first, in parallel; each prints one ``NXDI_READY {json}`` line once it serves and
must then pass a grpc.health.v1 check. The router starts last with the workers' addresses. Every
child runs in its own session (its own process group) and, when started from the main thread,
gets SIGTERM if the launcher dies; stopping sends SIGTERM to each group, waits, then SIGKILLs.
Python API: ``with Cluster(LaunchSpec(...)) as cluster: httpx.post(cluster.http_url + ...)``."""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nxdi_common.bucketing import parse_buckets
from nxdi_common.serving.launcher_process import (
    ROLES, ChildProcess, LaunchError, check_deadline, connectable, health_ok, parse_cpu_list,
    parse_cpus, parse_process_name, parse_ready_line, process_name, split_address)

__all__ = ["LaunchSpec", "Cluster", "ChildProcess", "LaunchError", "default_command", "main",
           "build_parser", "spec_from_args", "parse_cpus", "parse_cpu_list", "parse_ready_line",
           "split_address", "connectable", "health_ok", "MODULES", "SERVICE_FLAGS", "MODEL_FLAGS"]
MODULES = {"prefill": "prefill_service", "decode": "decode_service", "router": "router"}
DTYPES = ("float32", "bfloat16")
BACKENDS = ("compiled", "eager")
POLICIES = ("cache-aware", "least-loaded", "round-robin", "prefix-affinity")
# The options of each service's command line, as this launcher and deploy/ use them (tests check
# the manifests against this); MODEL_FLAGS (worker.add_model_args) are common to all three.
MODEL_FLAGS = ("--model", "--dtype", "--max-model-len", "--backend", "--compiled-root", "--threads",
               "--quantize", "--context-buckets", "--attention-kernel", "--kv-cache-dtype")
SERVICE_FLAGS = {
    "prefill": ("--host", "--port", "--metrics-port", "--max-batch-size", "--ctx-batch-size",
                "--kv-socket-port"),
    "decode": ("--host", "--port", "--metrics-port", "--max-batch-size", "--kv-blocks",
               "--block-size", "--local-prefill-max-tokens", "--prefill-chunk-tokens",
               "--tpot-target-ms", "--itl-target-ms", "--ttft-target-ms", "--piece-sizes"),
    "router": ("--host", "--http-port", "--grpc-port", "--prefill", "--decode", "--prefill-dns",
               "--decode-dns", "--policy"),
}

CommandFn = Callable[[str, int, "LaunchSpec", dict], list]


# ---------------------------------------------------------------------------------------------
# What to launch
# ---------------------------------------------------------------------------------------------

@dataclass
class LaunchSpec:
    """A local cluster. ``cpus`` maps "prefill0", "decode1", "router" to CPU ids; a worker with
    CPUs and no ``threads`` runs one torch thread per CPU. ``env`` is added to every child's."""

    model: str | None = None
    dtype: str = "bfloat16"
    backend: str = "compiled"
    max_model_len: int = 2048
    compiled_root: str | None = None
    quantize: str | None = None  # "int8" (worker.QUANTIZE) or None
    context_buckets: tuple[int, ...] | None = None  # workers' CTE buckets (None: worker default)
    attention_kernel: str = "auto"  # decode workers' TKG attention: auto | paged | sdpa
    kv_cache_dtype: str = "auto"  # every worker's KV cache: auto (the dtype) | fp8
    prefill_workers: int = 1
    decode_workers: int = 1
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    threads: int | None = None
    cpus: dict[str, list[int]] = field(default_factory=dict)
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    startup_timeout_seconds: float = 600.0
    stop_timeout_seconds: float = 30.0
    env: dict[str, str] = field(default_factory=dict)
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self):
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("backend", self.backend, BACKENDS)
        if self.quantize is not None:
            _check_choice("quantize", self.quantize, ("int8",))
        _check_int("max_model_len", self.max_model_len, 2)
        _check_int("prefill_workers", self.prefill_workers, 0)
        _check_int("decode_workers", self.decode_workers, 1)
        _check_int("http_port", self.http_port, 0, 65535)
        _check_int("grpc_port", self.grpc_port, 0, 65535)
        if self.threads is not None:
            _check_int("threads", self.threads, 1)
        if self.startup_timeout_seconds <= 0 or self.stop_timeout_seconds < 0:
            raise ValueError("startup_timeout_seconds must be > 0 and stop_timeout_seconds >= 0")
        for name, cpu_ids in self.cpus.items():
            self._check_cpus(name, cpu_ids)

    def _check_cpus(self, name: str, cpu_ids: list[int]) -> None:
        role, index = parse_process_name(name)
        count = {"prefill": self.prefill_workers, "decode": self.decode_workers, "router": 1}
        if index >= count[role]:
            raise ValueError(f"cpus: {name!r} names no process ({count[role]} {role} started)")
        if not cpu_ids or any(not isinstance(c, int) or c < 0 for c in cpu_ids):
            raise ValueError(f"cpus: {name!r} needs a non-empty list of CPU ids >= 0, "
                             f"got {cpu_ids!r}")

    def threads_for(self, name: str) -> int | None:
        """Torch threads for one process: ``threads``, else one per CPU it is pinned to."""
        if self.threads is not None:
            return self.threads
        return len(self.cpus[name]) if name in self.cpus else None


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low \
            or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def model_args(spec: LaunchSpec, threads: int | None) -> list[str]:
    """The model options every service takes (nxdi_common.serving.worker.add_model_args)."""
    args = ["--dtype", spec.dtype, "--max-model-len", str(spec.max_model_len),
            "--backend", spec.backend]
    if spec.model:
        args += ["--model", str(spec.model)]
    if spec.compiled_root:
        args += ["--compiled-root", str(spec.compiled_root)]
    if spec.quantize:
        args += ["--quantize", spec.quantize]
    if spec.context_buckets:
        args += ["--context-buckets", ",".join(map(str, spec.context_buckets))]
    if spec.attention_kernel != "auto":
        args += ["--attention-kernel", spec.attention_kernel]
    if spec.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", spec.kv_cache_dtype]
    if threads is not None:
        args += ["--threads", str(threads)]
    return args


def default_command(role: str, index: int, spec: LaunchSpec, peers: dict) -> list[str]:
    """The command line of one service; ``peers`` (router only) holds the workers' addresses."""
    base = [spec.python, "-m", MODULES[role], "--host", spec.host]
    model = model_args(spec, spec.threads_for(process_name(role, index)))
    if role == "prefill":
        return base + ["--port", "0", "--metrics-port", "0"] + model + spec.prefill_args
    if role == "decode":
        return base + ["--port", "0", "--metrics-port", "0"] + model + spec.decode_args
    addresses = [a for p in peers.get("prefill", []) for a in ("--prefill", p)]
    addresses += [a for d in peers.get("decode", []) for a in ("--decode", d)]
    return (base + ["--http-port", str(spec.http_port), "--grpc-port", str(spec.grpc_port)]
            + model + addresses + spec.router_args)


# ---------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------

class Cluster:
    """Starts and stops a LaunchSpec's processes. ``command_fn(role, index, spec, peers)`` builds
    each command line (default: the real services). ``echo``: a text stream that receives every
    child's output lines prefixed with its name (None: kept only in each child's tail)."""

    def __init__(self, spec: LaunchSpec, command_fn: CommandFn = default_command, echo=None):
        self.spec = spec
        self._command_fn = command_fn
        self._echo = echo
        self._children: list[ChildProcess] = []
        self.router: ChildProcess | None = None
        self._stopping = False

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def workers(self) -> list[ChildProcess]:
        """The prefill then decode workers (the router is ``.router``)."""
        return [c for c in self._children if c.role != "router"]

    @property
    def http_url(self) -> str:
        """The router's HTTP base URL, e.g. "http://127.0.0.1:8000" (OpenAI API under /v1)."""
        return f"http://{connectable(self._started_router().ready['http'])}"

    @property
    def grpc_address(self) -> str:
        """The router's gRPC address, "host:port"."""
        return connectable(self._started_router().grpc)

    def _started_router(self) -> ChildProcess:
        if self.router is None or self.router.ready is None:
            raise RuntimeError("the cluster is not started")
        return self.router

    def start(self) -> Cluster:
        """Start every process and wait until all serve; on any failure stop them all and raise
        LaunchError (with the failing child's output tail)."""
        if self._children:
            raise RuntimeError("a Cluster starts once")
        deadline = time.monotonic() + self.spec.startup_timeout_seconds
        try:
            workers = [self._spawn("prefill", i, {}) for i in range(self.spec.prefill_workers)]
            workers += [self._spawn("decode", i, {}) for i in range(self.spec.decode_workers)]
            self._wait_serving(workers, deadline)
            peers = {role: [connectable(w.grpc) for w in workers if w.role == role]
                     for role in ("prefill", "decode")}
            self.router = self._spawn("router", 0, peers)
            self._wait_serving([self.router], deadline)
            if "http" not in self.router.ready:
                raise LaunchError("router: its ready line has no \"http\" address")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, role: str, index: int, peers: dict) -> ChildProcess:
        name = process_name(role, index)
        argv = [str(a) for a in self._command_fn(role, index, self.spec, peers)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env}
        threads = self.spec.threads_for(name)
        if threads is not None:
            env.setdefault("OMP_NUM_THREADS", str(threads))
        child = ChildProcess(role, index, argv, env, self.spec.cpus.get(name), self._echo)
        self._children.append(child)
        return child

    def _wait_serving(self, children: list[ChildProcess], deadline: float) -> None:
        """Wait for every child's ready line, then for each to pass a health check."""
        pending = list(children)
        while pending:
            for child in list(pending):
                if child.check_ready():
                    pending.remove(child)
            check_deadline(deadline, pending, "print its ready line")
            if pending:
                time.sleep(0.05)
        for child in children:
            while not health_ok(connectable(child.grpc), 2.0):
                child.check_alive()
                check_deadline(deadline, [child], "pass a gRPC health check")
                time.sleep(0.2)

    def worker(self, role: str, index: int) -> ChildProcess:
        for child in self._children:
            if (child.role, child.index) == (role, index):
                return child
        raise ValueError(f"no {role} worker with index {index}")

    def kill_worker(self, role: str, index: int) -> None:
        """SIGKILL one process (fault tests); it does not count as an unexpected exit."""
        self.worker(role, index).kill()

    def unexpected_exits(self) -> list[ChildProcess]:
        """Processes that exited on their own (not by stop() or kill_worker())."""
        if self._stopping:
            return []
        return [c for c in self._children if c.exited() and not c.expected_exit]

    def stop(self) -> None:
        """SIGTERM every process group, wait up to stop_timeout_seconds, SIGKILL what is left."""
        self._stopping = True
        for child in self._children:
            child.terminate()
        deadline = time.monotonic() + self.spec.stop_timeout_seconds
        for child in self._children:
            child.wait_or_kill(deadline)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nxdi-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="address every service binds")
    p.add_argument("--http-port", type=int, default=8000, help="router HTTP (OpenAI API) port")
    p.add_argument("--grpc-port", type=int, default=50051, help="router gRPC port")
    p.add_argument("--cpus", action="append", default=[], metavar="NAME=CPUS",
                   help="pin a process to CPUs, e.g. prefill0=0 decode0=1-2 router=3")
    p.add_argument("--threads", type=int, help="torch threads per process (default: one per "
                                               "pinned CPU, else torch's choice)")
    g = p.add_argument_group("model")
    g.add_argument("--model", help="HF checkpoint directory (default: the bundled SmolLM2)")
    g.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--backend", choices=BACKENDS, default="compiled")
    g.add_argument("--compiled-root", help="folder for compiled models (default: in the cache)")
    g.add_argument("--quantize", choices=("int8",), help="workers' weights as int8 per channel")
    g.add_argument("--context-buckets", type=parse_buckets, metavar="N,N,...",
                   help="workers' prompt-length buckets, ending at --max-model-len (default: "
                        "the workers' own, denser on prefill workers)")
    g.add_argument("--attention-kernel", choices=("auto", "paged", "sdpa"), default="auto",
                   help="decode attention: paged C++ kernel, gather + torch SDPA, or auto")
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="every worker's KV cache (and the KV sent between them): the model's "
                        "dtype, or float8_e4m3fn (half the bytes of bf16, slightly less "
                        "accurate, slower decode steps on CPU)")
    g = p.add_argument_group("services")
    g.add_argument("--policy", choices=POLICIES, help="router's routing policy (default cache-aware)")
    for role in ROLES:
        g.add_argument(f"--{role}-args", default="", metavar="ARGS",
                       help=f"extra {role} options, one quoted string")
    g.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS")
    p.add_argument("--check", metavar="PROMPT", help="send one chat completion, print the "
                                                     "answer, then stop")
    p.add_argument("--max-tokens", type=int, default=64, help="for --check")
    p.add_argument("--verbose", action="store_true", help="echo every process's output")
    return p


def spec_from_args(args: argparse.Namespace) -> LaunchSpec:
    """A LaunchSpec from parsed nxdi-serve arguments (ValueError naming the bad option)."""
    router_args = shlex.split(args.router_args)
    if args.policy:
        router_args += ["--policy", args.policy]
    return LaunchSpec(
        model=args.model, dtype=args.dtype, backend=args.backend,
        max_model_len=args.max_model_len, compiled_root=args.compiled_root,
        quantize=args.quantize, context_buckets=args.context_buckets,
        attention_kernel=args.attention_kernel, kv_cache_dtype=args.kv_cache_dtype,
        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
        host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        threads=args.threads, cpus=parse_cpus(args.cpus),
        prefill_args=shlex.split(args.prefill_args), decode_args=shlex.split(args.decode_args),
        router_args=router_args, startup_timeout_seconds=args.startup_timeout)


def endpoints_text(cluster: Cluster) -> str:
    """What nxdi-serve prints once everything serves."""
    lines = ["nxdi-serve: ready",
             f"  OpenAI API   {cluster.http_url}/v1",
             f"  gRPC router  {cluster.grpc_address}"]
    for child in [*cluster.workers, cluster.router]:
        cpus = f"  cpus {','.join(map(str, child.cpus))}" if child.cpus else ""
        lines.append(f"  {child.name:<12} grpc {child.grpc}  metrics "
                     f"{child.ready.get('metrics', '-')}  pid {child.pid}{cpus}")
    return "\n".join(lines)


def chat_check(http_url: str, prompt: str, max_tokens: int, timeout: float = 600.0) -> str:
    """Send one chat completion to the router's OpenAI API; returns the answer text. With
    NXDI_API_KEY set (which the router started here reads too), its first key is sent."""
    import httpx
    key = os.environ.get("NXDI_API_KEY", "").split(",")[0].strip()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(base_url=http_url, timeout=timeout, headers=headers) as client:
            model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": prompt}]}
            reply = client.post("/v1/chat/completions", json=body)
            if reply.status_code != 200:
                raise LaunchError(f"chat completion: HTTP {reply.status_code}: {reply.text}")
            return reply.json()["choices"][0]["message"]["content"]
    except httpx.HTTPError as exc:
        raise LaunchError(f"chat completion: {type(exc).__name__}: {exc}") from exc


def _watch(cluster: Cluster) -> int:
    """Block until a signal (KeyboardInterrupt) or until a process exits on its own (returns 1)."""
    while True:
        time.sleep(0.5)
        dead = cluster.unexpected_exits()
        if dead:
            for child in dead:
                print(f"nxdi-serve: {child.name} exited unexpectedly (code "
                      f"{child.process.returncode})\n{child.describe_tail()}", file=sys.stderr)
            return 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _stop_uninterrupted(cluster: Cluster) -> None:
    """Stop the cluster with SIGINT/SIGTERM ignored, so a second Ctrl-C cannot orphan children."""
    handlers = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.stop()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    previous = signal.signal(signal.SIGTERM, _interrupt)
    cluster = Cluster(spec, echo=sys.stderr if args.verbose else None)
    try:
        cluster.start()
        print(endpoints_text(cluster), flush=True)
        if args.check is not None:
            print(chat_check(cluster.http_url, args.check, args.max_tokens), flush=True)
            return 0
        return _watch(cluster)
    except LaunchError as exc:
        print(f"nxdi-serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nxdi-serve: stopping", file=sys.stderr)
        return 0
    finally:
        _stop_uninterrupted(cluster)
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
