"""The router process: the OpenAI HTTP gateway (uvicorn) and the gRPC Router service in one
asyncio loop, sharing one worker registry, dispatcher and metrics.

Programmatic use (inside a running loop)::

    frontend = ModelFrontend.from_options(ModelOptions(model=DIR, max_model_len=512))
    router = await RunningRouter.start(frontend, RouterSettings(decode=("127.0.0.1:50051",)))
    ... router.http_address, router.grpc_address ...
    await router.stop()
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass, field

import uvicorn

from nxdi_common.serving.grpc_server import (GrpcServer, freeze_startup_heap, install_shutdown,
                                              print_ready)
from nxdi_common.serving.metrics import ServingMetrics
from nxdi_common.serving.worker import (add_model_args, add_wakeup_slice_arg, apply_nice,
                                        apply_wakeup_slice, model_options_from_args,
                                        process_nice, wake_interval_ms)
from router import convert
from router.admission import AdmissionQueue
from router.auth import ApiKeys, GrpcAuth, HttpAuth, keys_from
from router.dispatch import Dispatcher
from router.frontend import ModelFrontend
from router.grpc_service import RouterServicer
from router.openai_api import create_app
from router.policies import (DECODE, POLICIES, PREFILL, CacheAware, LocalPrefillRule,
                             make_policy)
from router.registry import Registry, join_host_port
from router.tools import CALL_FORMATS

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 8 << 20  # requests and token events are small; 8 MiB bounds a long prompt


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class RouterSettings:
    """Where the router listens, which workers it routes to, and how."""

    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    prefill_dns: tuple[str, ...] = ()
    decode_dns: tuple[str, ...] = ()
    policy: str = "cache-aware"
    refresh_seconds: float = 1.0
    request_timeout_seconds: float = 600.0
    shutdown_grace_seconds: float = 10.0
    local_prefill_max_tokens: int = 0
    local_prefill_queue_tokens: int = 0
    local_prefill_always_tokens: int = 0
    queue_timeout_seconds: float = 60.0  # router/admission.py; 0: shed at once
    max_queued_requests: int = 1024
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # router/auth.py; () = open
    cache_overlap_weight: float = 1.0  # policies.CacheAware
    cache_reports: bool = True  # ask workers for their prefix caches' changes (prefix_index)
    scheduling_policy: str = "fcfs"  # "priority": requests' priority orders every wait
    local_prefill_hold_ttft_seconds: float = 0.0  # LocalPrefillRule.hold_ttft_s; 0: off

    def __post_init__(self):
        _ = self.make_policy()  # ValueError naming the policy or its weight when bad
        for name in ("refresh_seconds", "request_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shutdown_grace_seconds < 0:
            raise ValueError(f"shutdown_grace_seconds must be >= 0, "
                             f"got {self.shutdown_grace_seconds}")
        _ = self.local_prefill  # ValueError naming the field when a local_prefill_* is bad
        _ = self.admission  # likewise for the queue's settings
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                             f", got {self.scheduling_policy!r}")

    def make_policy(self):
        """A fresh instance of the configured routing policy."""
        options = {"overlap_weight": self.cache_overlap_weight} \
            if self.policy == CacheAware.name else {}
        return make_policy(self.policy, **options)

    @property
    def admission(self) -> AdmissionQueue:
        try:
            return AdmissionQueue(self.queue_timeout_seconds, self.max_queued_requests)
        except ValueError as exc:
            raise ValueError(f"queue_timeout_seconds / max_queued_requests: {exc}") from None

    @property
    def local_prefill(self) -> LocalPrefillRule:
        return LocalPrefillRule(self.local_prefill_max_tokens, self.local_prefill_queue_tokens,
                                self.local_prefill_always_tokens,
                                self.local_prefill_hold_ttft_seconds)

    @property
    def poll_timeout_seconds(self) -> float:
        """GetLoad / health timeout per worker: short, so one dead worker never stalls a round."""
        return max(0.2, min(1.0, self.refresh_seconds))


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (the process installs one graceful stop)."""

    def capture_signals(self):
        return contextlib.nullcontext()


def _bind(host: str, port: int) -> socket.socket:
    """A bound TCP socket for the HTTP server (so port 0 gives one known port)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the HTTP server to {join_host_port(host, port)}: {exc}") \
            from exc
    return sock


class RunningRouter:
    """A started router; ``http_address`` / ``grpc_address`` are "host:port"."""

    def __init__(self, registry: Registry, grpc_server: GrpcServer, http: _EmbeddedUvicorn,
                 http_task: asyncio.Task, settings: RouterSettings, http_port: int):
        self.registry, self.grpc_server, self.http = registry, grpc_server, http
        self._http_task, self.settings = http_task, settings
        self.http_address = join_host_port(settings.host, http_port)
        self.grpc_address = join_host_port(settings.host, grpc_server.port)
        self._stopped = False

    @classmethod
    async def start(cls, frontend: ModelFrontend, settings: RouterSettings,
                    metrics: ServingMetrics | None = None) -> RunningRouter:
        """Poll the workers once, then start the gRPC and HTTP servers."""
        frontend.priority_scheduling = settings.scheduling_policy == "priority"
        registry = Registry({PREFILL: settings.prefill, DECODE: settings.decode},
                            {PREFILL: settings.prefill_dns, DECODE: settings.decode_dns},
                            settings.poll_timeout_seconds, cache_reports=settings.cache_reports)
        await registry.refresh()
        registry.start(settings.refresh_seconds)
        dispatcher = Dispatcher(registry, settings.make_policy(),
                                metrics or ServingMetrics("router"),
                                settings.request_timeout_seconds, settings.local_prefill,
                                settings.admission)
        keys = ApiKeys(settings.api_keys)
        grpc_server = GrpcServer([(convert.add_router_servicer,
                                   RouterServicer(frontend, dispatcher), convert.ROUTER_SERVICE)],
                                 MAX_MESSAGE_BYTES,
                                 [GrpcAuth(keys, convert.ROUTER_SERVICE)] if keys.enabled else [])
        app = create_app(frontend, dispatcher)
        if keys.enabled:
            app.add_middleware(HttpAuth, keys=keys)
            log.info("API keys: %d accepted; required on HTTP (but /health, /metrics) and the "
                     "Router service", len(settings.api_keys))
        try:
            await grpc_server.start(settings.host, settings.grpc_port)
            http, task, port = await _start_http(app, settings)
        except BaseException:
            await grpc_server.stop(0)
            await registry.close()
            raise
        return cls(registry, grpc_server, http, task, settings, port)

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish for up to the grace period, then cancel
        what is left and close the worker channels. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.settings.shutdown_grace_seconds if grace_seconds is None else grace_seconds
        self.http.config.timeout_graceful_shutdown = grace
        self.http.should_exit = True
        await asyncio.gather(self.grpc_server.stop(grace), self._http_task,
                             return_exceptions=True)
        await self.registry.close()

    async def wait_http_stopped(self) -> None:
        """Return when the HTTP server has stopped (by stop() or on its own)."""
        await asyncio.shield(self._http_task)


async def _start_http(app, settings: RouterSettings):
    """Start uvicorn on a socket bound here; returns (server, serve task, bound port)."""
    sock = _bind(settings.host, settings.http_port)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                            timeout_graceful_shutdown=settings.shutdown_grace_seconds)
    server = _EmbeddedUvicorn(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            raise RuntimeError(f"the HTTP server failed to start: {task.exception()!r}")
        await asyncio.sleep(0.01)
    return server, task, port


# --- command line --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address both servers listen on")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (0: any)")
    p.add_argument("--grpc-port", type=int, default=50050, help="gRPC Router port (0: any)")
    add_model_args(p)
    p.add_argument("--model-name", help="model id clients use (default: the model dir name)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on HTTP (but /health, /metrics) "
                        "and the gRPC Router service (repeatable; also the NXDI_API_KEY "
                        "environment variable, comma-separated, which keeps keys out of the "
                        "process list)")
    p.add_argument("--tool-call-parser", choices=("auto",) + CALL_FORMATS, default="auto",
                   help="how the model writes tool calls: auto (default) takes the chat "
                        "template's (llama3_json for Llama 3.1-3.3's JSON calls, else hermes: "
                        "<tool_call> tags, also what the router's own tool prompt teaches)")
    add_process_args(p.add_argument_group("process"))
    g = p.add_argument_group("workers")
    g.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                   help="a prefill worker (repeatable)")
    g.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                   help="a decode worker (repeatable)")
    g.add_argument("--prefill-dns", action="append", default=[], metavar="HOST:PORT",
                   help="a DNS name whose every address is a prefill worker (repeatable)")
    g.add_argument("--decode-dns", action="append", default=[], metavar="HOST:PORT",
                   help="a DNS name whose every address is a decode worker (repeatable)")
    add_policy_args(g)
    g.add_argument("--refresh-seconds", type=float, default=1.0,
                   help="how often worker load is polled and DNS names re-resolved")
    g.add_argument("--request-timeout-seconds", type=float, default=600.0,
                   help="deadline of a request without a gRPC deadline of its own")
    g.add_argument("--shutdown-grace-seconds", type=float, default=10.0,
                   help="how long in-flight requests may finish after SIGTERM")
    g.add_argument("--queue-timeout-seconds", type=float,
                   default=RouterSettings.queue_timeout_seconds,
                   help="a request every decode worker refuses for room waits up to this long, "
                        "first come first served, before HTTP 429 / RESOURCE_EXHAUSTED (0: at "
                        "once)")
    g.add_argument("--max-queued-requests", type=int, default=RouterSettings.max_queued_requests,
                   help="requests that may wait for room at once; the next is refused at once")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                   default=RouterSettings.scheduling_policy,
                   help="fcfs (default): first come first served, a request's priority must be "
                        "0; priority: requests carry vLLM's priority (lower first), which orders "
                        "the admission queue and the workers' queues, batch slots and "
                        "preemptions")
    add_local_prefill_args(p.add_argument_group("conditional disaggregation"))
    return p


def add_process_args(g) -> None:
    """How the router process runs beside others: its nice value, its loop's wake-ups, its
    request log."""
    g.add_argument("--nice", type=process_nice, default=None, metavar="N",
                   help="OS nice value (0-19) of the router, every thread of it (and its "
                        "autogroup when it leads its session): e.g. below a "
                        "decode worker whose core it shares (default: unchanged)")
    add_wakeup_slice_arg(g)
    g.add_argument("--wake-ms", type=wake_interval_ms, default=0.0, metavar="MS",
                   help="wake the router's event loop every MS milliseconds (0, the default: "
                        "never). Where the router shares a core with a CPU-bound worker, a "
                        "router thread woken for a token may wait for the kernel's next tick "
                        "(4 ms at HZ=250) before it runs; a timer this often lets the scheduler "
                        "switch to it sooner, for 1000/MS more wake-ups a second (on the Zen 4 "
                        "VM, 1 ms: tokens over 2 ms late while a prompt waited 25-28%% -> 12%%). "
                        "Where that worker can run below the router (its --nice, which reaches "
                        "its autogroup) that does better (-> 5.5%%) without the wake-ups")
    g.add_argument("--no-request-log", action="store_true",
                   help="no line per finished request on the router.requests logger (id, "
                        "outcome, worker, token counts, finish reason, TTFT, latency; never text)")


def add_policy_args(g) -> None:
    g.add_argument("--policy", choices=sorted(POLICIES), default=RouterSettings.policy,
                   help="how workers are ranked for a request (router/policies.py): "
                        "cache-aware (default) counts the prompt blocks each worker is believed "
                        "to hold as work saved, against its load")
    g.add_argument("--cache-overlap-weight", type=float,
                   default=RouterSettings.cache_overlap_weight,
                   help="cache-aware: how much a decode worker's cached prompt block counts "
                        "beside a block its running sequences hold (0: only the room it saves)")
    g.add_argument("--cache-reports", action=argparse.BooleanOptionalAction,
                   default=RouterSettings.cache_reports,
                   help="cache-aware: learn what each worker's prefix cache holds from its load "
                        "reports (stored and evicted blocks; default); --no-cache-reports: "
                        "only from what this router sent it (an approximation)")


def add_local_prefill_args(g) -> None:
    g.add_argument("--local-prefill-max-tokens", type=int, default=0, metavar="N",
                   help="prompts of at most N tokens are prefilled by their decode worker when "
                        "every prefill worker is busy (see --local-prefill-queue-tokens) and the "
                        "decode worker would not finish the prompt later than the soonest of them "
                        "(tokens ahead at each one's reported prefill rate); "
                        "0 (default): always a prefill worker when one is up")
    g.add_argument("--local-prefill-queue-tokens", type=int, default=0, metavar="Q",
                   help="a prefill worker counts as busy with at least Q prompt tokens queued "
                        "or being prefilled (0: always busy, i.e. short prompts always local)")
    g.add_argument("--local-prefill-always-tokens", type=int, default=0, metavar="A",
                   help="prompts of at most A tokens are always prefilled by their decode "
                        "worker, busy or not (longer ones as the two options above say)")
    g.add_argument("--local-prefill-hold-ttft-seconds", type=float, default=0.0, metavar="S",
                   help="a prompt every prefill worker would finish later than S seconds goes "
                        "to its decode worker, prefilled there with the decode steps held (the "
                        "whole core: one long gap in each running stream), when that worker "
                        "reports a local prefill thread whose rate finishes it within S and "
                        "sooner; 0 (default): off")


async def wake_every(seconds: float, counter: list[int] | None = None) -> None:
    """Wake the running loop every ``seconds`` until cancelled (--wake-ms); ``counter[0]``
    counts the wake-ups (tests)."""
    while True:
        await asyncio.sleep(seconds)
        if counter is not None:
            counter[0] += 1


def settings_from_args(args) -> RouterSettings:
    return RouterSettings(args.host, args.http_port, args.grpc_port, tuple(args.prefill),
                          tuple(args.decode), tuple(args.prefill_dns), tuple(args.decode_dns),
                          args.policy, args.refresh_seconds, args.request_timeout_seconds,
                          args.shutdown_grace_seconds, args.local_prefill_max_tokens,
                          args.local_prefill_queue_tokens, args.local_prefill_always_tokens,
                          args.queue_timeout_seconds, args.max_queued_requests,
                          keys_from(args.api_key), args.cache_overlap_weight,
                          args.cache_reports, args.scheduling_policy,
                          local_prefill_hold_ttft_seconds=args.local_prefill_hold_ttft_seconds)


async def serve(args) -> None:
    """Load the tokenizer, start, print NXDI_READY, run until SIGTERM / SIGINT."""
    settings = settings_from_args(args)
    opts = model_options_from_args(args)
    frontend = await asyncio.to_thread(ModelFrontend.from_options, opts, args.model_name)
    if args.tool_call_parser != "auto":
        frontend.tool_call_format = args.tool_call_parser
    router = await RunningRouter.start(frontend, settings)
    stopped = install_shutdown(asyncio.get_running_loop(), router.stop)
    freeze_startup_heap("router")
    print_ready("router", grpc=router.grpc_address, http=router.http_address)
    waiters = [asyncio.ensure_future(stopped.wait()),
               asyncio.ensure_future(router.wait_http_stopped())]
    waker = asyncio.ensure_future(wake_every(args.wake_ms / 1000)) if args.wake_ms else None
    _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if waker is not None:
        waker.cancel()
    await router.stop()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    apply_nice(args.nice)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s router %(name)s: %(message)s")
    apply_wakeup_slice(args.wakeup_slice_us)
    if args.no_request_log:
        logging.getLogger("router.requests").setLevel(logging.WARNING)
    try:
        asyncio.run(serve(args))
    except (ValueError, OSError) as exc:
        raise SystemExit(f"router: {exc}") from None
