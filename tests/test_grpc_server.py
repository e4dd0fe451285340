"""GrpcServer and StatusInterceptor against a real grpc.aio server on loopback: every exception
mapping (code and details), health, reflection, message-size bound, graceful stop, signals."""
import asyncio
import logging
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from nxdi_common.kv_transfer import KVChunkError
from nxdi_common.serving import errors
from nxdi_common.serving.grpc_server import (GrpcServer, check_health, install_shutdown,
                                             print_ready, server_options)
from protos.nxdi.serving.v1 import serving_pb2, serving_pb2_grpc

FAULTS = "nxdi.test.Faults"
DECODE = "nxdi.serving.v1.Decode"


def _raise(kind: str):
    """Raise the exception named by ``kind``."""
    table = {
        "invalid": errors.InvalidRequest("top_p", "must be in (0, 1], got 2.0"),
        "notfound": errors.ModelNotFound("model", "'gpt-9' is not served here"),
        "overloaded": errors.Overloaded("no free KV blocks: need 4, have 1"),
        "unavailable": errors.Unavailable("every prefill candidate failed"),
        "precondition": errors.FailedPrecondition("fingerprint mismatch: num_layers 2 != 3"),
        "serving": errors.ServingError("plain serving error"),
        "kvchunk": KVChunkError("token_end", "past the reservation"),
        "value": ValueError("max_tokens must be >= 1"),
        "boom": RuntimeError("kaboom"),
        "key": KeyError("missing"),
    }
    raise table[kind]


EXPECTED = {
    "invalid": (grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1], got 2.0"),
    "notfound": (grpc.StatusCode.INVALID_ARGUMENT, "model: 'gpt-9' is not served here"),
    "overloaded": (grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks: need 4, have 1"),
    "unavailable": (grpc.StatusCode.UNAVAILABLE, "every prefill candidate failed"),
    "precondition": (grpc.StatusCode.FAILED_PRECONDITION,
                     "fingerprint mismatch: num_layers 2 != 3"),
    "serving": (grpc.StatusCode.INTERNAL, "plain serving error"),
    "kvchunk": (grpc.StatusCode.FAILED_PRECONDITION,
                "KV chunk field 'token_end': past the reservation"),
    "value": (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1"),
    "boom": (grpc.StatusCode.INTERNAL, "internal error: RuntimeError: kaboom"),
    "key": (grpc.StatusCode.INTERNAL, "internal error: KeyError: 'missing'"),
}


class Faults:
    """Raw-bytes test service: the request names what to do."""

    def __init__(self):
        self.cancelled = asyncio.Event()

    async def unary(self, request: bytes, context) -> bytes:
        kind = request.decode()
        if kind == "abort":
            await context.abort(grpc.StatusCode.NOT_FOUND, "aborted by the handler")
        if kind.startswith("echo"):
            return request
        if kind.startswith("big"):
            return b"x" * 4096
        _raise(kind)

    async def stream(self, request: bytes, context):
        kind = request.decode()
        yield b"first"
        yield b"second"
        if kind == "abort":
            await context.abort(grpc.StatusCode.NOT_FOUND, "aborted by the handler")
        if kind == "slow":
            await asyncio.sleep(0.3)
            yield b"third"
            return
        if kind == "hang":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        _raise(kind)

    def add_to(self, _servicer, server) -> None:
        handlers = {"Unary": grpc.unary_unary_rpc_method_handler(self.unary),
                    "Stream": grpc.unary_stream_rpc_method_handler(self.stream)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(FAULTS, handlers),))


class Decode(serving_pb2_grpc.DecodeServicer):
    """The real Decode service; Generate raises what request_id names after one event."""

    async def Generate(self, request, context):
        yield serving_pb2.TokenEvent(request_id=request.request_id, token_id=7)
        _raise(request.request_id)

    async def GetLoad(self, request, context):
        return serving_pb2.WorkerLoad(role=serving_pb2.WORKER_ROLE_DECODE, running_sequences=3)


def _servers(faults: Faults):
    return [(faults.add_to, None, FAULTS),
            (serving_pb2_grpc.add_DecodeServicer_to_server, Decode(), DECODE)]


async def _start(faults: Faults, max_message_bytes: int = 1 << 20) -> tuple[GrpcServer, str]:
    server = GrpcServer(_servers(faults), max_message_bytes)
    port = await server.start("127.0.0.1", 0)
    assert port == server.port and port > 0
    return server, f"127.0.0.1:{port}"


def _unary(channel):
    return channel.unary_unary(f"/{FAULTS}/Unary")


def _stream(channel):
    return channel.unary_stream(f"/{FAULTS}/Stream")


async def _collect(call) -> list:
    return [item async for item in call]


def test_unary_and_stream_status_mapping(caplog):
    async def scenario():
        server, address = await _start(Faults())
        unary_results, stream_results = {}, {}
        async with grpc.aio.insecure_channel(address) as ch:
            for kind in EXPECTED:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _unary(ch)(kind.encode())
                unary_results[kind] = (err.value.code(), err.value.details())
                call = _stream(ch)(kind.encode())
                received = []
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for item in call:
                        received.append(item)
                assert received == [b"first", b"second"]
                stream_results[kind] = (err.value.code(), err.value.details())
        await server.stop(0)
        return unary_results, stream_results

    with caplog.at_level(logging.INFO, logger="nxdi_common.serving.grpc_server"):
        unary_results, stream_results = asyncio.run(scenario())
    assert unary_results == EXPECTED
    assert stream_results == EXPECTED
    internal = [r for r in caplog.records if r.levelno == logging.ERROR]
    # the three INTERNAL kinds, unary and stream, each logged with its traceback
    assert len(internal) == 6
    assert all(r.exc_info is not None for r in internal)


def test_context_abort_passes_through():
    async def scenario():
        server, address = await _start(Faults())
        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as unary_err:
                await _unary(ch)(b"abort")
            with pytest.raises(grpc.aio.AioRpcError) as stream_err:
                await _collect(_stream(ch)(b"abort"))
            assert await _unary(ch)(b"echo hi") == b"echo hi"
        await server.stop(0)
        return unary_err.value, stream_err.value

    unary_err, stream_err = asyncio.run(scenario())
    for err in (unary_err, stream_err):
        assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "aborted by the handler")


def test_protobuf_service_mapping_and_success():
    async def scenario():
        server, address = await _start(Faults())
        async with grpc.aio.insecure_channel(address) as ch:
            stub = serving_pb2_grpc.DecodeStub(ch)
            load = await stub.GetLoad(serving_pb2.GetLoadRequest())
            events = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                request = serving_pb2.DecodeRequest(request_id="overloaded")
                async for event in stub.Generate(request):
                    events.append(event)
        await server.stop(0)
        return load, events, err.value

    load, events, err = asyncio.run(scenario())
    assert load.running_sequences == 3 and load.role == serving_pb2.WORKER_ROLE_DECODE
    assert [(e.request_id, e.token_id) for e in events] == [("overloaded", 7)]
    assert (err.code(), err.details()) == EXPECTED["overloaded"]


def test_client_cancel_reaches_handler_as_cancelled_error(caplog):
    async def scenario():
        faults = Faults()
        server, address = await _start(faults)
        async with grpc.aio.insecure_channel(address) as ch:
            call = _stream(ch)(b"hang")
            assert await call.read() == b"first"
            assert await call.read() == b"second"
            call.cancel()
            await asyncio.wait_for(faults.cancelled.wait(), 5)
        await server.stop(0)
        return call

    with caplog.at_level(logging.INFO, logger="nxdi_common.serving.grpc_server"):
        call = asyncio.run(scenario())
    assert call.cancelled()
    assert [r for r in caplog.records if r.name == "nxdi_common.serving.grpc_server"] == []


def test_health_serving_then_not_serving():
    async def scenario():
        server, address = await _start(Faults())
        statuses = []
        async with grpc.aio.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            async def status(name):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

            statuses.append([await status(n) for n in ("", FAULTS, DECODE)])
            assert await check_health(address, 5) is True
            await server.set_serving(False)
            statuses.append([await status(n) for n in ("", FAULTS, DECODE)])
            assert await check_health(address, 5) is False
            await server.set_serving(True)
            statuses.append([await status(n) for n in ("", FAULTS, DECODE)])
        await server.stop(0)
        after = await server.health.Check(health_pb2.HealthCheckRequest(service=""), None)
        reachable = await check_health(address, 2)
        return statuses, after.status, reachable

    statuses, after, reachable = asyncio.run(scenario())
    assert statuses == [["SERVING"] * 3, ["NOT_SERVING"] * 3, ["SERVING"] * 3]
    assert after == health_pb2.HealthCheckResponse.NOT_SERVING
    assert reachable is False


def test_graceful_stop_finishes_in_flight_stream():
    async def scenario():
        server, address = await _start(Faults())
        async with grpc.aio.insecure_channel(address) as ch:
            call = _stream(ch)(b"slow")
            assert await call.read() == b"first"
            stop = asyncio.create_task(server.stop(5))
            rest = [await call.read(), await call.read(), await call.read()]
            await stop
            return rest, await call.code()

    rest, code = asyncio.run(scenario())
    assert rest == [b"second", b"third", grpc.aio.EOF]
    assert code == grpc.StatusCode.OK


def test_reflection_lists_every_service():
    async def scenario():
        server, address = await _start(Faults())
        async with grpc.aio.insecure_channel(address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            replies = await _collect(stub.ServerReflectionInfo(iter([request])))
        await server.stop(0)
        return sorted(s.name for s in replies[0].list_services_response.service)

    assert asyncio.run(scenario()) == sorted([
        FAULTS, DECODE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"])


def test_max_message_size_enforced_both_ways():
    async def scenario():
        server, address = await _start(Faults(), max_message_bytes=1024)
        async with grpc.aio.insecure_channel(address) as ch:
            ok = await _unary(ch)(b"echo" + b"y" * 900)
            with pytest.raises(grpc.aio.AioRpcError) as too_big_request:
                await _unary(ch)(b"echo" + b"y" * 2000)
            with pytest.raises(grpc.aio.AioRpcError) as too_big_reply:
                await _unary(ch)(b"big")
        await server.stop(0)
        return ok, too_big_request.value.code(), too_big_reply.value.code()

    ok, request_code, reply_code = asyncio.run(scenario())
    assert ok == b"echo" + b"y" * 900
    assert request_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reply_code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_server_options_and_validation():
    options = dict(server_options(4096))
    assert options["grpc.max_send_message_length"] == 4096
    assert options["grpc.max_receive_message_length"] == 4096
    assert options["grpc.so_reuseport"] == 0
    assert options["grpc.keepalive_time_ms"] == 30_000
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_message_bytes"):
            server_options(bad)

    async def bad_port():
        server = GrpcServer([], 1024)
        with pytest.raises(ValueError, match="port"):
            await server.start("127.0.0.1", 70000)

    asyncio.run(bad_port())


def test_port_taken_is_refused_and_ipv6_loopback():
    async def scenario():
        first, address = await _start(Faults())
        second = GrpcServer([], 1024)
        with pytest.raises(OSError, match=f"127.0.0.1:{first.port}"):
            await second.start("127.0.0.1", first.port)
        await first.stop(0)
        v6 = GrpcServer([], 1024)
        try:
            port = await v6.start("[::1]", 0)
        except OSError:
            pytest.skip("no IPv6 loopback on this machine")
        healthy = await check_health(f"[::1]:{port}", 5)
        await v6.stop(0)
        return healthy

    assert asyncio.run(scenario()) is True


def test_check_health_on_closed_port_is_false():
    async def scenario():
        server = GrpcServer([], 1024)
        port = await server.start("127.0.0.1", 0)
        await server.stop(0)
        return await check_health(f"127.0.0.1:{port}", 2)

    assert asyncio.run(scenario()) is False


def test_print_ready_line(capsys):
    print_ready("decode", grpc="127.0.0.1:5005", metrics="127.0.0.1:9090")
    assert capsys.readouterr().out == (
        'NXDI_READY {"role": "decode", "grpc": "127.0.0.1:5005", "metrics": "127.0.0.1:9090"}\n')
    with pytest.raises(ValueError, match="role"):
        print_ready("")


def test_install_shutdown_runs_stop_once():
    calls = []

    async def scenario():
        async def stop():
            calls.append("stop")
            await asyncio.sleep(0.05)

        done = install_shutdown(asyncio.get_running_loop(), stop)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(done.wait(), 5)
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert calls == ["stop"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_freeze_startup_heap_takes_every_live_object_out_of_the_collectors_passes():
    """What is alive when a service has loaded is frozen (gc.freeze): no longer among the objects
    a collection walks; what is allocated afterwards still is."""
    import gc

    from nxdi_common.serving.grpc_server import freeze_startup_heap
    loaded = [[i] for i in range(2000)]
    try:
        frozen = freeze_startup_heap("test")
        assert frozen == gc.get_freeze_count() >= len(loaded)
        later = [[i] for i in range(10)]
        walked = {id(o) for o in gc.get_objects()}
        assert not any(id(x) in walked for x in loaded)
        assert all(id(x) in walked for x in later)
    finally:
        gc.unfreeze()
