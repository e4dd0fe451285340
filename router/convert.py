"""Protobuf <-> router types, and the stubs the router calls workers with.

The only router module that imports ``serving_pb2`` / ``serving_pb2_grpc`` (the shared
``nxdi_common.serving.convert`` handles the messages every service has in common)."""
from __future__ import annotations

import json
import re
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nxdi_common.serving import convert as common
from nxdi_common.serving.errors import InvalidRequest
from nxdi_common.serving.types import SamplingOptions, StopOptions, TokenOutput
from protos.nxdi.serving.v1 import serving_pb2 as pb
from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc
from router.frontend import ChatOptions, ChatTurn, RoutedRequest
from router.tools import ToolCall, ToolRequest, new_call_id, parse_tools
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
        return kind, [ChatTurn.checked(m.role, m.content,
                                       [_call_dict(c) for c in m.tool_calls] or None,
                                       m.tool_call_id, f"chat.messages[{i}]")
                      for i, m in enumerate(req.chat.messages)]
    raise InvalidRequest("input", "set one of prompt, prompt_token_ids or chat")


def _call_dict(call: pb.ToolCall) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json}}


def generate_tools(req: pb.GenerateRequest) -> ToolRequest | None:
    """The request's tools and tool_choice as the HTTP API's (router/tools.py), checked with
    the same rules and messages; None without tools."""
    tools = []
    for i, tool in enumerate(req.tools):
        function = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters_json:
            try:
                function["parameters"] = json.loads(tool.parameters_json)
            except ValueError as exc:
                raise InvalidRequest(f"tools[{i}].parameters_json", f"is not JSON: {exc}") \
                    from None
        if tool.strict:
            function["strict"] = True
        tools.append({"type": "function", "function": function})
    choice = None
    if req.HasField("tool_choice"):
        kind = req.tool_choice.WhichOneof("choice")
        if kind == "mode":
            choice = req.tool_choice.mode
        elif kind == "function":
            choice = {"type": "function", "function": {"name": req.tool_choice.function}}
    parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else None
    try:
        return parse_tools(tools or None, choice, parallel)
    except InvalidRequest as exc:  # the HTTP API's field names -> this message's
        field = re.sub(r"^(tools\[\d+\])\.function\.parameters", r"\1.parameters_json",
                       exc.field)
        field = re.sub(r"^(tools\[\d+\])\.function\.", r"\1.", field)
        field = field.replace("tool_choice.function.name", "tool_choice.function")
        raise InvalidRequest(field, str(exc).split(": ", 1)[1]) from None


def chat_options(req: pb.GenerateRequest) -> ChatOptions:
    """The chat rendering fields (add_generation_prompt, continue_final_message,
    chat_template_kwargs_json), checked."""
    kwargs = None
    if req.chat_template_kwargs_json:
        try:
            kwargs = json.loads(req.chat_template_kwargs_json)
        except ValueError as exc:
            raise InvalidRequest("chat_template_kwargs_json", f"is not valid JSON: {exc}") \
                from None
    return ChatOptions.checked(
        req.add_generation_prompt if req.HasField("add_generation_prompt") else None,
        req.continue_final_message, kwargs, "chat_template_kwargs_json")


def generate_options(req: pb.GenerateRequest) -> tuple[SamplingOptions, StopOptions]:
    """Sampling and stop options (unset messages mean every default); validated."""
    return common.sampling_from_proto(req.sampling), common.stop_from_proto(req.stop)


def token_event(out: TokenOutput, calls: list[ToolCall] = ()) -> pb.TokenEvent:
    """A Router.Generate event; ``calls``: the tool calls parsed out of the answer (last
    event)."""
    event = common.token_to_proto(out)
    for call in calls:
        event.tool_calls.add(id=call.id or new_call_id(), name=call.name,
                             arguments_json=call.arguments)
    return event


def list_models(name: str, created: int, max_model_len: int,
                fingerprint: object = None) -> pb.ListModelsResponse:
    """The one-model ListModels answer; fingerprint is a worker's (opaque WorkerLoad field)."""
    info = pb.ModelInfo(id=name, owned_by="nxdi", created_unix_seconds=created,
                        max_model_len=max_model_len)
    if fingerprint is not None:
        info.fingerprint.CopyFrom(fingerprint)
    return pb.ListModelsResponse(models=[info])


# --- calling decode workers ------------------------------------------------------------------


def decode_request(req: RoutedRequest, prefill_candidates: list[str],
                   hold_steps: bool = False) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=req.request_id, prompt_token_ids=req.prompt_ids,
                            sampling=common.sampling_to_proto(req.sampling),
                            stop=common.stop_to_proto(req.stop),
                            prefill_candidates=prefill_candidates, local_prefill_fallback=False,
                            priority=req.priority, cache_salt=req.cache_salt,
                            hold_steps_for_prefill=hold_steps)


def start_generate(channel: grpc.aio.Channel, req: RoutedRequest, prefill_candidates: list[str],
                   timeout: float | None, hold_steps: bool = False):
    """Start Decode.Generate; returns the call (async-iterate it for TokenEvents, cancel() it).
    hold_steps: the decode worker prefills it with its steps held (LocalChoice.hold_steps)."""
    stub = pb_grpc.DecodeStub(channel)
    return stub.Generate(decode_request(req, prefill_candidates, hold_steps), timeout=timeout)


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
        prefill_tokens_per_s=msg.prefill_tokens_per_s, received_ns=time.monotonic_ns(),
        whole_core_prefill_tokens_per_s=msg.whole_core_prefill_tokens_per_s,
        hold_budget_s=msg.hold_budget_s if msg.HasField("hold_budget_s") else None,
        prefix_cache=(common.cache_report_from_proto(msg.prefix_cache)
                      if msg.HasField("prefix_cache") else None))


async def fetch_load(channel: grpc.aio.Channel, role: str, timeout: float,
                     cache_cursor: tuple[int, int] | None = None) -> WorkerLoad:
    """Call GetLoad on the role's service, asking for the prefix cache's changes since
    ``cache_cursor`` ((instance, seq); None: not asked); raises grpc.aio.AioRpcError on failure."""
    stub = pb_grpc.DecodeStub(channel) if role == DECODE else pb_grpc.PrefillStub(channel)
    request = pb.GetLoadRequest()
    if cache_cursor is not None:
        request.cache_cursor.instance, request.cache_cursor.seq = cache_cursor
    return load_from_proto(await stub.GetLoad(request, timeout=timeout))


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
