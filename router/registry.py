"""The router's view of its workers: addresses (static, and resolved from DNS names such as a
Kubernetes headless Service), one grpc.aio channel per address, and load reports polled in the
background (each also brings the router's view of the worker's prefix cache up to date,
router.prefix_index.ReportedCache). A worker that fails to answer is marked unhealthy (routing
skips it) until it answers again."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc

from router import convert
from router.policies import DECODE, PREFILL, ROLES, WorkerLoad, WorkerState, tokens_ahead_at
from router.prefix_index import ReportedCache

log = logging.getLogger(__name__)
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),  # a restarted worker is seen again within
    ("grpc.min_reconnect_backoff_ms", 200),  # a refresh or two, not grpc's 120 s backoff cap
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


def split_host_port(address: str, what: str = "address") -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port); ValueError naming ``what`` otherwise."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be host:port with a port in 1..65535, got {address!r}")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(name: str) -> list[str]:
    """All addresses "ip:port" a "host:port" name resolves to (sorted, no duplicates)."""
    host, port = split_host_port(name, "DNS name")
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(info[4][0], info[4][1]) for info in infos})


class Registry:
    """Workers per role, their channels and their latest load.

    ``static`` and ``dns`` map a role (PREFILL / DECODE) to addresses / "host:port" names;
    ``resolver`` turns a name into addresses (default: :func:`resolve`, i.e. getaddrinfo).
    Call :meth:`refresh` once (startup), then :meth:`start` for the background loop, and
    :meth:`close` at shutdown."""

    def __init__(self, static: dict[str, Iterable[str]] | None = None,
                 dns: dict[str, Iterable[str]] | None = None, poll_timeout_seconds: float = 1.0,
                 resolver: Callable[[str], Awaitable[list[str]]] = resolve,
                 cache_reports: bool = True):
        self._static = {r: sorted(set((static or {}).get(r, ()))) for r in ROLES}
        self._dns = {r: sorted(set((dns or {}).get(r, ()))) for r in ROLES}
        for role in ROLES:
            for a in self._static[role]:
                split_host_port(a, f"--{role} address")
            for a in self._dns[role]:
                split_host_port(a, f"--{role}-dns name")
        self.poll_timeout_seconds = poll_timeout_seconds
        self.cache_reports = cache_reports  # ask each poll for the prefix cache's changes
        self._resolver = resolver
        self._resolved: dict[str, list[str]] = {}  # last good resolution per DNS name
        self._workers: dict[str, dict[str, WorkerState]] = {
            r: {a: WorkerState(a, r) for a in self._static[r]} for r in ROLES}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._task: asyncio.Task | None = None
        self.refreshes = 0  # completed refresh rounds

    # --- reading -------------------------------------------------------------------------

    def workers(self, role: str) -> list[WorkerState]:
        """Every known worker of ``role`` (healthy or not), sorted by address."""
        return sorted(self._workers[role].values(), key=lambda w: w.address)

    def healthy(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers(role) if w.healthy]

    def channel(self, address: str) -> grpc.aio.Channel:
        """The one channel to ``address`` (created on first use)."""
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel

    def channel_addresses(self) -> list[str]:
        """Addresses with an open channel, sorted."""
        return sorted(self._channels)

    # --- addresses -----------------------------------------------------------------------

    async def addresses(self, role: str) -> list[str]:
        """Static addresses plus every DNS name's current resolution (the last good one when a
        lookup fails, so a DNS hiccup does not drop every worker)."""
        found = set(self._static[role])
        for name in self._dns[role]:
            try:
                self._resolved[name] = await self._resolver(name)
            except OSError as exc:
                log.warning("cannot resolve %s (%s); keeping %s", name, exc,
                            self._resolved.get(name, []))
            found.update(self._resolved.get(name, []))
        return sorted(found)

    async def _sync_addresses(self) -> None:
        """Add workers for new addresses, drop (and close channels of) vanished ones."""
        for role in ROLES:
            current = set(await self.addresses(role))
            table = self._workers[role]
            for address in current - table.keys():
                table[address] = WorkerState(address, role)
            for address in set(table) - current:
                del table[address]
        live = {a for role in ROLES for a in self._workers[role]}
        for address in set(self._channels) - live:
            await self._channels.pop(address).close()

    # --- polling -------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Re-resolve addresses, then poll every worker's load and health once (concurrently)."""
        await self._sync_addresses()
        states = [w for role in ROLES for w in self._workers[role].values()]
        await asyncio.gather(*(self._poll(w) for w in states))
        self.refreshes += 1

    async def _poll(self, w: WorkerState) -> None:
        channel, timeout = self.channel(w.address), self.poll_timeout_seconds
        cursor = None
        if self.cache_reports:
            cursor = w.cache.cursor if w.cache is not None else (0, 0)
        asked_ns = time.monotonic_ns()
        try:
            load, serving = await asyncio.gather(
                convert.fetch_load(channel, w.role, timeout, cursor),
                convert.fetch_serving(channel, timeout))
        except grpc.aio.AioRpcError as exc:
            self._set(w, False, None, f"{exc.code().name}: {exc.details()}")
            return
        load = self._apply_cache_report(w, load, asked_ns)
        if load.role and load.role != w.role:
            self._set(w, False, load, f"it reports role {load.role!r}, configured as {w.role!r}")
        elif not serving:
            self._set(w, False, load, "health check says NOT_SERVING")
        else:
            self._set(w, True, load, "")

    def _apply_cache_report(self, w: WorkerState, load: WorkerLoad, asked_ns: int) -> WorkerLoad:
        """Bring w.cache up to the report's prefix_cache (asked for at ``asked_ns``); a worker
        asked that sends none keeps no view (it runs an older version: the policy falls back to
        what it sent there). Returns the load without the report."""
        report = load.prefix_cache
        if report is None:
            if self.cache_reports:
                w.cache = None
            return load
        if w.cache is None:
            w.cache = ReportedCache()
        w.cache.apply(report, asked_ns)
        return dataclasses.replace(load, prefix_cache=None)

    @staticmethod
    def _set(w: WorkerState, healthy: bool, load: WorkerLoad | None, reason: str) -> None:
        if w.healthy != healthy:
            log.info("%s worker %s is now %s%s", w.role, w.address,
                     "healthy" if healthy else "unhealthy", f": {reason}" if reason else "")
        w.healthy, w.load, w.reason = healthy, load if load is not None else w.load, reason

    def start(self, refresh_seconds: float) -> None:
        """Refresh every ``refresh_seconds`` in a background task until close()."""
        if refresh_seconds <= 0:
            raise ValueError(f"refresh_seconds must be > 0, got {refresh_seconds}")
        self._task = asyncio.get_running_loop().create_task(self._run(refresh_seconds))

    async def _run(self, refresh_seconds: float) -> None:
        while True:
            await asyncio.sleep(refresh_seconds)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the loop must survive one bad round
                log.exception("worker refresh failed")

    async def close(self) -> None:
        """Stop the background loop and close every channel."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # --- feedback from dispatch ----------------------------------------------------------

    def mark_unhealthy(self, role: str, address: str, reason: str) -> None:
        """Exclude a worker from routing until its next successful poll."""
        w = self._workers[role].get(address)
        if w is not None:
            self._set(w, False, None, reason)

    def note_dispatch(self, decode: str, prefill: str | None, prompt_len: int) -> None:
        """Optimistic load update for a request just sent (until the next poll replaces it):
        the decode worker runs one more sequence holding the prompt's blocks, and the prompt is
        queued at the first prefill candidate, or at the decode worker itself when no candidate
        was sent (it prefills locally); so a burst spreads before the next poll."""
        now = time.monotonic_ns()
        d = self._workers[DECODE].get(decode)
        if d is not None and d.load is not None:
            blocks = math.ceil((prompt_len + 1) / max(d.load.kv_block_size, 1))
            d.load = dataclasses.replace(
                _queued(d.load, 0 if prefill else prompt_len, now),
                running_sequences=d.load.running_sequences + 1,
                kv_blocks_free=max(d.load.kv_blocks_free - blocks, 0),
                kv_blocks_used=d.load.kv_blocks_used + blocks)
        p = self._workers[PREFILL].get(prefill) if prefill else None
        if p is not None and p.load is not None:
            p.load = dataclasses.replace(_queued(p.load, prompt_len, now),
                                         queued_requests=p.load.queued_requests + 1)

    def note_refused(self, decode: str) -> None:
        """A decode worker answered RESOURCE_EXHAUSTED: treat it as full until the next poll."""
        d = self._workers[DECODE].get(decode)
        if d is not None and d.load is not None:
            d.load = dataclasses.replace(d.load, kv_blocks_free=0)


def _queued(load: WorkerLoad, prompt_len: int, now_ns: int) -> WorkerLoad:
    """The load with ``prompt_len`` more prompt tokens queued, its tokens ahead first counted
    down to ``now_ns`` (policies.tokens_ahead_at) and the snapshot re-timed to it: the new
    tokens were not being worked on since the poll."""
    ahead = tokens_ahead_at(load, now_ns)
    done = load.queued_prompt_tokens + load.running_prompt_tokens - ahead  # the running first
    running = max(load.running_prompt_tokens - done, 0)
    return dataclasses.replace(load, queued_prompt_tokens=round(ahead - running) + prompt_len,
                               running_prompt_tokens=round(running), received_ns=now_ns)
