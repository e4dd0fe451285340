"""Protobuf <-> internal types for the Prefill service: the one module of prefill_service that
imports the generated ``serving_pb2`` modules or builds and reads their messages (it builds on
the shared ``nxdi_common.serving.convert`` and ``kv_transfer`` conversions)."""
from __future__ import annotations

import grpc

from nxdi_common import kv_transfer
from nxdi_common.kv_transfer import KVChunkData, ModelFingerprint
from nxdi_common.serving.convert import (logprobs_to_proto, prompt_logprobs_to_proto,
                                         sampling_from_proto)
from nxdi_common.serving.errors import FailedPrecondition
from nxdi_common.serving.types import PrefillJob, check_cache_salt
from prefill_service.scheduler import FirstTokenResult, LoadReport
from protos.nxdi.serving.v1 import serving_pb2, serving_pb2_grpc

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


def _event_to_wire(event: serving_pb2.PrefillEvent | bytes) -> bytes:
    """Prefill's response serializer: kv_chunk events come already encoded (chunk_event)."""
    return event if isinstance(event, bytes) else event.SerializeToString()


def add_servicer(servicer: serving_pb2_grpc.PrefillServicer, server) -> None:
    """What the generated ``add_PrefillServicer_to_server`` does, except that Prefill's events
    may be pre-encoded bytes (kv_transfer.chunk_event_bytes: the KV payload copied once)."""
    handlers = {
        "Prefill": grpc.unary_stream_rpc_method_handler(
            servicer.Prefill, request_deserializer=serving_pb2.PrefillRequest.FromString,
            response_serializer=_event_to_wire),
        "GetLoad": grpc.unary_unary_rpc_method_handler(
            servicer.GetLoad, request_deserializer=serving_pb2.GetLoadRequest.FromString,
            response_serializer=serving_pb2.WorkerLoad.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                          handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def fingerprint_from_request(msg: serving_pb2.PrefillRequest) -> ModelFingerprint | None:
    """The caller's model fingerprint; None when absent. FailedPrecondition when it is there but
    incomplete or names an unknown dtype (it cannot equal ours)."""
    if not msg.HasField("fingerprint"):
        return None
    try:
        return kv_transfer.fingerprint_from_proto(msg.fingerprint)
    except ValueError as exc:  # KVChunkError is a ValueError too
        raise FailedPrecondition(f"fingerprint: {exc}") from None


def job_from_proto(msg: serving_pb2.PrefillRequest) -> PrefillJob:
    """The PrefillJob a request asks for (sampling validated here; the rest by the server)."""
    return PrefillJob(
        request_id=msg.request_id, prompt_ids=tuple(msg.prompt_token_ids),
        sampling=sampling_from_proto(msg.sampling), kv_token_start=msg.kv_token_start,
        head_start=msg.head_start, head_end=msg.head_end, max_chunk_bytes=msg.max_chunk_bytes,
        accept_kv_socket=msg.accept_kv_socket,
        banned_first=tuple(msg.banned_first_token_ids), priority=msg.priority,
        cache_salt=check_cache_salt(msg.cache_salt))


def first_token_event(first: FirstTokenResult) -> serving_pb2.PrefillEvent:
    """The stream's first event."""
    msg = serving_pb2.FirstToken(token_id=first.token_id, compute_ns=first.compute_ns)
    if first.logprob is not None:
        msg.logprob = first.logprob
    msg.top_logprobs.extend(logprobs_to_proto(first.top_logprobs))
    if first.prompt_logprobs:
        msg.prompt_logprobs.extend(prompt_logprobs_to_proto(first.prompt_logprobs))
    return serving_pb2.PrefillEvent(first_token=msg)


def chunk_event(chunk: KVChunkData) -> bytes:
    """One kv_chunk event, serialized (its payload copied once; see add_servicer)."""
    return kv_transfer.chunk_event_bytes(chunk)


def kv_socket_event(port: int, token: bytes) -> serving_pb2.PrefillEvent:
    """The event that hands the KV chunks to a direct connection (nxdi_common.serving.kv_socket)."""
    return serving_pb2.PrefillEvent(kv_socket=serving_pb2.KVSocket(port=port, token=token))


def done_event(num_chunks: int, payload_bytes: int, transfer_ns: int) -> serving_pb2.PrefillEvent:
    """The stream's last event."""
    return serving_pb2.PrefillEvent(done=serving_pb2.PrefillDone(
        num_chunks=num_chunks, payload_bytes=payload_bytes, transfer_ns=transfer_ns))


def load_to_proto(report: LoadReport, prefix_cache: serving_pb2.PrefixCacheReport | None = None
                  ) -> serving_pb2.WorkerLoad:
    """The WorkerLoad message of a prefill worker (its KV block fields are its prefix cache's,
    0 without one; ``prefix_cache``: its journal's report, when asked for)."""
    return serving_pb2.WorkerLoad(prefix_cache=prefix_cache,
        role=serving_pb2.WORKER_ROLE_PREFILL, address=report.address,
        fingerprint=kv_transfer.fingerprint_to_proto(report.fingerprint),
        queued_prompt_tokens=report.queued_prompt_tokens,
        queued_requests=report.queued_requests, running_sequences=report.running_sequences,
        max_running_sequences=report.max_running_sequences,
        open_transfers=report.open_transfers, reported_at_unix_ns=report.reported_at_unix_ns,
        running_prompt_tokens=report.running_prompt_tokens,
        prefill_tokens_per_s=report.prefill_tokens_per_s, kv_blocks_used=report.kv_blocks_used,
        kv_blocks_free=report.kv_blocks_free, kv_block_size=report.kv_block_size)
