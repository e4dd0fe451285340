"""gRPC server scaffolding shared by the router, prefill and decode services.

- :class:`StatusInterceptor` is the one place exceptions become gRPC status codes, so handlers stay
  plain: they raise :class:`~nxdi_common.serving.errors.ServingError` subclasses, ``ValueError`` or
  ``KVChunkError`` and never call ``context.abort`` themselves (they may, and that passes through).
- :class:`GrpcServer` builds a ``grpc.aio`` server with the interceptor, the standard health
  service (``grpc.health.v1``) and server reflection, and handles start / graceful stop.
- :func:`print_ready` prints the ``NXDI_READY {json}`` line the launcher waits for.
- :func:`install_shutdown` turns SIGTERM / SIGINT into one graceful stop.
- :func:`check_health` asks a server's health service whether it is serving.
"""
from __future__ import annotations

import asyncio
import gc
import inspect
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nxdi_common.serving.errors import ServingError

log = logging.getLogger(__name__)

READY_PREFIX = "NXDI_READY "
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),  # ping an idle connection every 30 s
    ("grpc.keepalive_timeout_ms", 10_000),  # and drop it when the ping is not answered in 10 s
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # accept peer pings every 10 s
    ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a peer for pinging
]

AddServicerFn = Callable[[object, grpc.aio.Server], None]
ServicerSpec = tuple[AddServicerFn, object, str]  # (add_XServicer_to_server, servicer, full name)


# ---------------------------------------------------------------------------------------------
# Exceptions -> status codes
# ---------------------------------------------------------------------------------------------

def _kv_chunk_error_type() -> type | None:
    """KVChunkError, when kv_transfer is loaded (it imports torch, so it is never imported here:
    a process that has not loaded it cannot have raised it)."""
    module = sys.modules.get("nxdi_common.kv_transfer")
    return getattr(module, "KVChunkError", None)


def status_for_exception(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and details an exception is reported with (see StatusInterceptor)."""
    if isinstance(exc, ServingError):
        return exc.code, str(exc)
    chunk_error = _kv_chunk_error_type()
    if chunk_error is not None and isinstance(exc, chunk_error):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    """Log the exception as its status deserves, then abort the RPC (raises AbortError)."""
    code, details = status_for_exception(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed: %s", method, details, exc_info=exc)
    else:
        log.info("%s -> %s: %s", method, code.name, details)
    await context.abort(code, details)


def _wrap_call(behavior: Callable, method: str) -> Callable:
    """Wrap a handler that returns (or awaits) its result."""

    async def wrapper(request, context):
        try:
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status code, never swallowed
            await _abort(context, exc, method)

    return wrapper


def _wrap_stream(behavior: Callable, method: str) -> Callable:
    """Wrap a response-streaming handler (an async generator, or a coroutine that uses
    context.write)."""
    if not inspect.isasyncgenfunction(behavior):
        return _wrap_call(behavior, method)

    async def wrapper(request, context):
        try:
            async for response in behavior(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status code, never swallowed
            await _abort(context, exc, method)

    return wrapper


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by any handler to a gRPC status:

    ServingError subclasses -> their ``code``; KVChunkError -> FAILED_PRECONDITION; other
    ValueError -> INVALID_ARGUMENT; anything else -> INTERNAL ("internal error: Type: message",
    logged with its traceback). ``asyncio.CancelledError`` and aborts already made with
    ``context.abort`` pass through untouched."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_call(handler.unary_unary, method),
                                                       **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method), **kwargs)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_call(handler.stream_unary, method), **kwargs)
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream, method), **kwargs)


# ---------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------

def _check_message_bytes(max_message_bytes: int) -> None:
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) \
            or max_message_bytes < 1:
        raise ValueError(f"max_message_bytes must be a positive integer, got {max_message_bytes!r}")


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """grpc server options: message size bound both ways, keepalive, and no SO_REUSEPORT (so a
    second server on a taken port fails instead of silently sharing it)."""
    _check_message_bytes(max_message_bytes)
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0), *KEEPALIVE_OPTIONS]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The matching client channel options (message size bound both ways, keepalive)."""
    _check_message_bytes(max_message_bytes)
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1)]


class GrpcServer:
    """A grpc.aio server with the StatusInterceptor, health and reflection.

    ``servicers`` is a list of ``(add_XServicer_to_server, servicer, full_service_name)``, e.g.
    ``(serving_pb2_grpc.add_DecodeServicer_to_server, servicer, "nxdi.serving.v1.Decode")``.
    Create and use it inside the running event loop."""

    def __init__(self, servicers: Sequence[ServicerSpec], max_message_bytes: int,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = ()):
        """``interceptors`` run before the StatusInterceptor (e.g. the router's API keys)."""
        self.service_names = [name for _, _, name in servicers]
        for name in self.service_names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"servicers: every service needs a full name, got {name!r}")
        self.server = grpc.aio.server(interceptors=[*interceptors, StatusInterceptor()],
                                      options=server_options(max_message_bytes))
        for add_fn, servicer, _ in servicers:
            add_fn(servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, HEALTH_SERVICE, reflection.SERVICE_NAME], self.server)
        self.port: int | None = None

    async def start(self, host: str, port: int, serving: bool = True) -> int:
        """Bind ``host:port`` (port 0: a free port) and start; returns the bound port. Health
        says SERVING right away unless ``serving`` is False (then call set_serving later)."""
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {port!r}")
        address = f"{host}:{port}"
        try:
            bound = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot bind gRPC server to {address}: {exc}") from exc
        if not bound:
            raise OSError(f"cannot bind gRPC server to {address}")
        self.port = bound
        await self.server.start()
        await self.set_serving(serving)
        return bound

    async def set_serving(self, serving: bool) -> None:
        """Set the health status of the server ("") and of every registered service."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_seconds: float | None) -> None:
        """Report NOT_SERVING (for good), refuse new RPCs, let in-flight ones finish for up to
        ``grace_seconds`` (None: wait for all), then cancel what is left."""
        await self.set_serving(False)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_seconds)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


# ---------------------------------------------------------------------------------------------
# Process plumbing
# ---------------------------------------------------------------------------------------------

def freeze_startup_heap(role: str) -> int:
    """Collect once, then take every object alive now (the model and its modules, the libraries,
    the compiled graphs: ~357 000 objects in a decode worker serving SmolLM2) out of the cyclic
    garbage collector's reach (gc.freeze), as a service does once it is loaded and before it
    serves. They live as long as the process, yet every full collection walked all of them:
    155 ms on one core of the Zen 4 VM, with the GIL held, so a decode worker's steps (and every
    stream's next token) stopped for that long whenever a generation-2 collection came due
    (BENCHMARKS.md, issue 4, session 61); after the freeze a full collection walks only what
    serving allocated. Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logging.getLogger(__name__).info("%s: %d startup objects frozen out of the garbage "
                                     "collector's passes", role, frozen)
    return frozen


def print_ready(role: str, **addresses: str) -> None:
    """Print the one ``NXDI_READY {"role": ..., "grpc": "host:port", ...}`` line, flushed."""
    if not role:
        raise ValueError("role must be a non-empty string")
    print(READY_PREFIX + json.dumps({"role": role, **addresses}), flush=True)


PARENT_PID_ENV = "NXDI_PARENT_PID"  # set by the launcher (nxdi_common.serving.launcher_process)
PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """When started by the launcher (NXDI_PARENT_PID set, Linux): ask the kernel for SIGTERM when
    the launcher dies, and SIGTERM ourselves now if it already has (we were orphaned while
    loading the model)."""
    expected = os.environ.get(PARENT_PID_ENV)
    if not expected or not sys.platform.startswith("linux"):
        return
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(expected):
        os.kill(os.getpid(), signal.SIGTERM)


def install_shutdown(loop: asyncio.AbstractEventLoop,
                     stop_coro_fn: Callable[[], Awaitable[None]]) -> asyncio.Event:
    """On the first SIGTERM or SIGINT, run ``stop_coro_fn()`` once in ``loop`` (later signals are
    logged and ignored: the stop is already under way). Returns an event set once it finished.
    Then die_with_launcher(): the handlers are in place before a launcher's death can signal."""
    done = asyncio.Event()
    tasks: list[asyncio.Task] = []

    async def run_stop():
        try:
            await stop_coro_fn()
        finally:
            done.set()

    def on_signal(signum: int) -> None:
        if tasks:
            log.warning("signal %d: already stopping", signum)
            return
        log.info("signal %d: stopping gracefully", signum)
        tasks.append(loop.create_task(run_stop()))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    die_with_launcher()
    return done


async def check_health(address: str, timeout: float) -> bool:
    """True when the server at ``address`` answers grpc.health.v1 Check("") with SERVING."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
