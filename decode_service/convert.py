"""Protobuf <-> internal types for the decode worker (the only decode_service module that touches
protobuf messages)."""
from __future__ import annotations

import time

from google.protobuf.message import DecodeError

from protos.nxdi.serving.v1 import serving_pb2 as pb
from protos.nxdi.serving.v1 import serving_pb2_grpc as pb_grpc
from nxdi_common import kv_transfer
from nxdi_common.serving import types as t
from nxdi_common.serving.convert import (logprobs_from_proto, prompt_logprobs_from_proto,
                                         sampling_from_proto, sampling_to_proto,
                                         stop_from_proto, token_to_proto)
from nxdi_common.serving.errors import FailedPrecondition, InvalidRequest

add_servicer = pb_grpc.add_DecodeServicer_to_server
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Decode"].full_name
DecodeServicerBase = pb_grpc.DecodeServicer
PREFILL_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Prefill'].full_name}/Prefill"
token_event = token_to_proto


def job_from_proto(req: pb.DecodeRequest) -> t.DecodeJob:
    """Validated DecodeJob; the prompt itself is checked against the model by the caller."""
    if not req.request_id:
        raise InvalidRequest("request_id", "must not be empty")
    return t.DecodeJob(req.request_id, tuple(req.prompt_token_ids),
                       sampling_from_proto(req.sampling), stop_from_proto(req.stop),
                       tuple(req.prefill_candidates), req.local_prefill_fallback,
                       req.priority, t.check_cache_salt(req.cache_salt),
                       req.hold_steps_for_prefill)


def prefill_request(job: t.DecodeJob, fingerprint: kv_transfer.ModelFingerprint,
                    kv_token_start: int, max_chunk_bytes: int,
                    accept_kv_socket: bool = False, banned_first=()) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id=job.request_id, prompt_token_ids=job.prompt_ids,
        sampling=sampling_to_proto(job.sampling),
        fingerprint=kv_transfer.fingerprint_to_proto(fingerprint), kv_token_start=kv_token_start,
        max_chunk_bytes=max_chunk_bytes, accept_kv_socket=accept_kv_socket,
        banned_first_token_ids=banned_first, priority=job.priority,
        cache_salt=job.cache_salt)


def prefill_call(channel):
    """Prefill.Prefill on ``channel`` with its events left as bytes for prefill_event (so a
    kv_chunk's payload is never copied out of the message)."""
    return channel.unary_stream(PREFILL_METHOD,
                                request_serializer=pb.PrefillRequest.SerializeToString,
                                response_deserializer=None, _registered_method=True)


def prefill_event(data: bytes):
    """The serialized PrefillEvent ``data`` as ("first_token", (token_id, logprob,
    top_logprobs, prompt_logprobs)) | ("kv_chunk", KVChunkData, its K and V views of ``data``) | ("kv_socket",
    (port, token)) | ("done", None) | (None, None) when no event is set. FailedPrecondition
    when it is not a PrefillEvent."""
    chunk = kv_transfer.chunk_from_event_bytes(data)
    if chunk is not None:
        return "kv_chunk", chunk
    try:
        event = pb.PrefillEvent.FromString(data)
    except DecodeError as exc:
        raise FailedPrecondition(f"prefill stream: malformed PrefillEvent ({exc})") from None
    kind = event.WhichOneof("event")
    if kind == "first_token":
        ft = event.first_token
        logprob = ft.logprob if ft.HasField("logprob") else None
        return kind, (ft.token_id, logprob, logprobs_from_proto(ft.top_logprobs),
                      prompt_logprobs_from_proto(ft.prompt_logprobs))
    if kind == "kv_chunk":
        return kind, kv_transfer.chunk_from_proto(event.kv_chunk)
    if kind == "kv_socket":
        return kind, (event.kv_socket.port, event.kv_socket.token)
    return kind, None


def worker_load(address: str, fingerprint, load: dict, max_running: int, block_size: int,
                open_transfers: int, prefix_cache: pb.PrefixCacheReport | None = None
                ) -> pb.WorkerLoad:
    return pb.WorkerLoad(prefix_cache=prefix_cache,
        role=pb.WORKER_ROLE_DECODE, address=address,
        fingerprint=kv_transfer.fingerprint_to_proto(fingerprint),
        queued_requests=load["queued"], running_sequences=load["running"],
        max_running_sequences=max_running, kv_blocks_used=load["kv_blocks_used"],
        kv_blocks_free=load["kv_blocks_free"], kv_block_size=block_size,
        open_transfers=open_transfers, reported_at_unix_ns=time.time_ns(),
        queued_prompt_tokens=load["local_prompt_tokens"],
        prefill_tokens_per_s=load["prefill_tokens_per_s"],
        whole_core_prefill_tokens_per_s=load["whole_core_prefill_tokens_per_s"],
        hold_budget_s=load["hold_budget_s"])
