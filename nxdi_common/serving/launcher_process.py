"""One launched service process for the local launcher: spawn (own session, CPU pinning, death
signal), output draining into a bounded tail, the ``NXDI_READY`` line, health, and stopping."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nxdi_common.serving.grpc_server import PARENT_PID_ENV, READY_PREFIX

ROLES = ("prefill", "decode", "router")
TAIL_LINES = 200


class LaunchError(RuntimeError):
    """A process failed to start, exited, or did not become ready in time."""


def process_name(role: str, index: int) -> str:
    """"prefill0", "decode1", ...; the router is just "router"."""
    return "router" if role == "router" else f"{role}{index}"


def parse_process_name(name: str) -> tuple[str, int]:
    """"prefill0" -> ("prefill", 0); "router" (or "router0") -> ("router", 0)."""
    for role in ROLES:
        rest = name[len(role):] if name.startswith(role) else None
        if rest == "" and role == "router":
            return role, 0
        if rest and rest.isdigit():
            return role, int(rest)
    raise ValueError(f"cpus: {name!r} is not a process name (prefill<N>, decode<N> or router)")


def parse_cpu_list(text: str) -> list[int]:
    """"0,2-3" -> [0, 2, 3]."""
    cpus: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"--cpus: bad CPU list {text!r} (use e.g. 0,2-3)")
        cpus += range(int(low), int(high or low) + 1)
    if not cpus:
        raise ValueError(f"--cpus: empty CPU range in {text!r}")
    return cpus


def parse_cpus(values: list[str]) -> dict[str, list[int]]:
    """["prefill0=0", "decode0=1-2", "router=3"] -> {"prefill0": [0], "decode0": [1, 2], ...}."""
    cpus: dict[str, list[int]] = {}
    for value in values:
        name, sep, cpu_text = value.partition("=")
        if not sep:
            raise ValueError(f"--cpus: expected NAME=CPUS (e.g. prefill0=0,1), got {value!r}")
        role, index = parse_process_name(name.strip())
        key = process_name(role, index)
        if key in cpus:
            raise ValueError(f"--cpus: {key} given twice")
        cpus[key] = parse_cpu_list(cpu_text)
    return cpus


def check_deadline(deadline: float, pending: list, what: str) -> None:
    """LaunchError naming ``pending`` (with their output tails) once ``deadline`` passed."""
    if pending and time.monotonic() > deadline:
        names = ", ".join(c.name for c in pending)
        tails = "\n".join(c.describe_tail() for c in pending)
        raise LaunchError(f"{names} did not {what} in time\n{tails}")


def parse_ready_line(line: str) -> dict | None:
    """The JSON of a ``NXDI_READY {...}`` line (None for any other line). A malformed ready line
    raises ValueError: it needs a "role" and a "grpc" address "host:port"."""
    if not line.startswith(READY_PREFIX):
        return None
    try:
        info = json.loads(line[len(READY_PREFIX):])
    except json.JSONDecodeError as exc:
        raise ValueError(f"ready line is not JSON: {line.strip()!r}") from exc
    if not isinstance(info, dict) or not isinstance(info.get("role"), str):
        raise ValueError(f"ready line needs a \"role\": {line.strip()!r}")
    for key in ("grpc", "metrics", "http"):
        if key in info or key == "grpc":
            split_address(info.get(key), f"ready line {key!r}")
    return info


def split_address(address, what: str = "address") -> tuple[str, int]:
    """"127.0.0.1:50051" -> ("127.0.0.1", 50051); "[::1]:80" -> ("[::1]", 80)."""
    host, sep, port = str(address).rpartition(":")
    if not isinstance(address, str) or not sep or not host or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be \"host:port\", got {address!r}")
    return host, int(port)


def connectable(address: str) -> str:
    """A wildcard bind address (0.0.0.0, [::]) as an address a local client can dial."""
    host, port = split_address(address)
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
    return f"{host}:{port}"


def health_ok(address: str, timeout: float) -> bool:
    """A blocking grpc.health.v1 Check(""): True when the server answers SERVING."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class OutputTail:
    """The last ``max_lines`` lines a process wrote (stdout and stderr interleaved)."""

    def __init__(self, max_lines: int = TAIL_LINES):
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._lock = threading.Lock()

    def add(self, line: str) -> None:
        with self._lock:
            self._lines.append(line.rstrip("\n"))

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def text(self) -> str:
        return "\n".join(self.lines())


def _child_env(env: dict) -> dict:
    """The child's environment: with NXDI_PARENT_PID when spawned from the main thread on Linux,
    so the service asks for SIGTERM when this launcher dies (grpc_server.die_with_launcher). The
    child does that itself: running code between fork and exec (preexec_fn) in a process with
    gRPC threads ran gRPC's fork handlers and now and then aborted the child."""
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        return {**env, PARENT_PID_ENV: str(os.getpid())}
    return env


def _check_cpus(name: str, cpus: list[int] | None) -> None:
    if cpus and hasattr(os, "sched_getaffinity"):
        missing = sorted(set(cpus) - os.sched_getaffinity(0))
        if missing:
            raise LaunchError(f"{name}: CPUs {missing} are not available to this process "
                              f"(available: {sorted(os.sched_getaffinity(0))})")


class ChildProcess:
    """A launched service: ``role``, ``index``, ``process`` (Popen), ``pid``, ``tail``, and from
    its ready line ``ready`` (dict), ``grpc`` and ``metrics`` ("host:port")."""

    def __init__(self, role: str, index: int, argv: list[str], env: dict, cpus, echo=None):
        self.role, self.index, self.argv, self.cpus = role, index, argv, cpus
        self.name = process_name(role, index)
        self.tail = OutputTail()
        self.ready: dict | None = None
        self.expected_exit = False
        self._ready_line: str | None = None
        self._echo = echo
        _check_cpus(self.name, cpus)
        try:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=_child_env(env), text=True, errors="replace", bufsize=1,
                start_new_session=True)
        except (OSError, subprocess.SubprocessError) as exc:
            raise LaunchError(f"{self.name}: cannot start {argv!r}: {exc}") from exc
        if cpus:
            # Pinned from here, right after exec and long before the interpreter starts any
            # thread (they inherit the main thread's CPU set).
            try:
                os.sched_setaffinity(self.process.pid, cpus)
            except OSError as exc:
                self.process.kill()
                raise LaunchError(f"{self.name}: cannot pin to CPUs {cpus}: {exc}") from exc
        self._threads = [threading.Thread(target=self._drain, args=(stream,), daemon=True,
                                          name=f"{self.name}-{label}")
                         for stream, label in ((self.process.stdout, "stdout"),
                                               (self.process.stderr, "stderr"))]
        for thread in self._threads:
            thread.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def grpc(self) -> str | None:
        return self.ready["grpc"] if self.ready else None

    @property
    def metrics(self) -> str | None:
        return self.ready.get("metrics") if self.ready else None

    def _drain(self, stream) -> None:
        """Keep reading one pipe until EOF, so the child never blocks on a full pipe."""
        for line in stream:
            self.tail.add(line)
            if self._ready_line is None and line.startswith(READY_PREFIX):
                self._ready_line = line
            if self._echo is not None:
                self._echo.write(f"[{self.name}] {line}")
                self._echo.flush()
        stream.close()

    def check_ready(self) -> bool:
        """True once the ready line arrived; LaunchError if it is malformed or the process died
        without it."""
        if self.ready is not None:
            return True
        if self._ready_line is not None:
            try:
                self.ready = parse_ready_line(self._ready_line)
            except ValueError as exc:
                raise LaunchError(f"{self.name}: {exc}\n{self.describe_tail()}") from exc
            return True
        self.check_alive()
        return False

    def check_alive(self) -> None:
        """LaunchError (with the output tail) if the process has exited."""
        if self.process.poll() is not None:
            self._join_readers(1.0)
            raise LaunchError(f"{self.name} (pid {self.pid}) exited with code "
                              f"{self.process.returncode} before it was serving\n"
                              f"{self.describe_tail()}")

    def exited(self) -> bool:
        return self.process.poll() is not None

    def describe_tail(self) -> str:
        text = self.tail.text() or "(no output)"
        return f"--- last output of {self.name} (pid {self.pid}) ---\n{text}"

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)  # start_new_session: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL the process group now and reap it."""
        self.expected_exit = True
        self._signal_group(signal.SIGKILL)
        self.process.wait()

    def terminate(self) -> None:
        """SIGTERM the process group (a graceful stop), unless it is already gone."""
        self.expected_exit = True
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)

    def wait_or_kill(self, deadline: float) -> None:
        """Wait until ``deadline`` (time.monotonic) for the process, then SIGKILL its group;
        any process left in its group is killed too."""
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.process.wait()
        self._signal_group(signal.SIGKILL)
        self._join_readers(2.0)

    def _join_readers(self, timeout: float) -> None:
        for thread in self._threads:
            thread.join(timeout)
