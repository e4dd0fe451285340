"""Protobuf <-> router types, and the stubs the router calls workers with.

The only router module that imports ``serving_pb2`` / ``serving_pb2_grpc`` (the shared
``nxdi_common.serving.convert`` handles the messages every service has in common)."""
from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nxdi_common.serving import convert as common
from nxdi_common.serving.errors import InvalidRequest
from nxdi_common.serving.types import SamplingOptions, StopOptions, TokenOutput
from protos.nxdi.serving.v1 import serving_pb2 as pb
from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc
from router.frontend import ChatTurn, RoutedRequest
from router.policies import DECODE, PREFILL, WorkerLoad

ROUTER_SERVICE = pb.DESCRIPTOR.services_by_name["Router"].full_name
add_router_servicer = pb_grpc.add_RouterServicer_to_server
RouterServicerBase = pb_grpc.RouterServicer
ROLE_FROM_PROTO = {pb.WORKER_ROLE_PREFILL: PREFILL, pb.WORKER_ROLE_DECODE: DECODE}

# --- Router.Generate in ----------------------------------------------------------------------


def generate_input(req: pb.GenerateRequest) -> tuple[str, object]:
    """Which input the request carries: ("prompt", text), ("prompt_token_ids", [ids]) or
    ("chat", [ChatTurn]); the first element is also the field name errors use."""
    kind = req.WhichOneof("input")
    if kind == "prompt":
        return kind, req.prompt
    if kind == "prompt_token_ids":
        return kind, list(req.prompt_token_ids.ids)
    if kind == "chat":
        return kind, [ChatTurn(m.role, m.content) for m in req.chat.messages]
    raise InvalidRequest("input", "set one of prompt, prompt_token_ids or chat")


def generate_options(req: pb.GenerateRequest) -> tuple[SamplingOptions, StopOptions]:
    """Sampling and stop options (unset messages mean every default); validated."""
    return common.sampling_from_proto(req.sampling), common.stop_from_proto(req.stop)


def token_event(out: TokenOutput) -> pb.TokenEvent:
    return common.token_to_proto(out)


def list_models(name: str, created: int, max_model_len: int,
                fingerprint: object = None) -> pb.ListModelsResponse:
    """The one-model ListModels answer; fingerprint is a worker's (opaque WorkerLoad field)."""
    info = pb.ModelInfo(id=name, owned_by="nxdi", created_unix_seconds=created,
                        max_model_len=max_model_len)
    if fingerprint is not None:
        info.fingerprint.CopyFrom(fingerprint)
    return pb.ListModelsResponse(models=[info])


# --- calling decode workers ------------------------------------------------------------------


def decode_request(req: RoutedRequest, prefill_candidates: list[str]) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=req.request_id, prompt_token_ids=req.prompt_ids,
                            sampling=common.sampling_to_proto(req.sampling),
                            stop=common.stop_to_proto(req.stop),
                            prefill_candidates=prefill_candidates, local_prefill_fallback=False)


def start_generate(channel: grpc.aio.Channel, req: RoutedRequest, prefill_candidates: list[str],
                   timeout: float | None):
    """Start Decode.Generate; returns the call (async-iterate it for TokenEvents, cancel() it)."""
    stub = pb_grpc.DecodeStub(channel)
    return stub.Generate(decode_request(req, prefill_candidates), timeout=timeout)


def token_output(event: pb.TokenEvent) -> TokenOutput:
    return common.token_from_proto(event)


# --- polling workers -------------------------------------------------------------------------


def load_from_proto(msg: pb.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        queued_prompt_tokens=msg.queued_prompt_tokens, queued_requests=msg.queued_requests,
        running_sequences=msg.running_sequences,
        max_running_sequences=msg.max_running_sequences, kv_blocks_used=msg.kv_blocks_used,
        kv_blocks_free=msg.kv_blocks_free, kv_block_size=msg.kv_block_size,
        open_transfers=msg.open_transfers, reported_at_unix_ns=msg.reported_at_unix_ns,
        running_prompt_tokens=msg.running_prompt_tokens, role=ROLE_FROM_PROTO.get(msg.role, ""),
        fingerprint=msg.fingerprint if msg.HasField("fingerprint") else None,
        prefill_tokens_per_s=msg.prefill_tokens_per_s, received_ns=time.monotonic_ns())


async def fetch_load(channel: grpc.aio.Channel, role: str, timeout: float) -> WorkerLoad:
    """Call GetLoad on the role's service; raises grpc.aio.AioRpcError on failure."""
    stub = pb_grpc.DecodeStub(channel) if role == DECODE else pb_grpc.PrefillStub(channel)
    return load_from_proto(await stub.GetLoad(pb.GetLoadRequest(), timeout=timeout))


async def fetch_serving(channel: grpc.aio.Channel, timeout: float) -> bool:
    """grpc.health.v1 Check(""): True when SERVING; a server without the health service counts
    as serving (its GetLoad answer decides). Raises AioRpcError when unreachable."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
            return True
        raise
    return reply.status == health_pb2.HealthCheckResponse.SERVING
