"""KV chunks on the wire: exact round trips, chunk bounds, and refusal of every corruption."""

import dataclasses
import struct

import numpy as np
import pytest
import torch

from nxdi_common.kv_transfer import (
    DTYPES,
    MESSAGE_HEADROOM_BYTES,
    ChunkWrite,
    KVChunkError,
    KVCoverage,
    ModelFingerprint,
    Reservation,
    chunk_crc32c,
    chunk_event_bytes,
    chunk_from_event_bytes,
    chunk_from_proto,
    chunk_to_proto,
    decode_chunk,
    encode_chunks,
    fingerprint_from_proto,
    fingerprint_mismatch,
    fingerprint_to_proto,
    max_message_bytes,
    plan_chunks,
)
from protos.nxdi.serving.v1 import serving_pb2

LAYERS, TOKENS, HEADS, HEAD_DIM = 3, 5, 2, 4
SHAPE = (LAYERS, TOKENS, HEADS, HEAD_DIM)


def _kv(dtype: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V of SHAPE in ``dtype`` (fp8 values stay inside its finite range)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(SHAPE, generator=gen) * 4 for _ in range(2))
    return k.to(DTYPES[dtype]), v.to(DTYPES[dtype])


def _reservation(dtype: str = "bfloat16", **overrides) -> Reservation:
    fields = dict(request_id="req-1", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                  num_tokens=TOKENS, dtype=dtype)
    return Reservation(**{**fields, **overrides})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _one_chunk(dtype: str = "bfloat16", **kwargs):
    """A single chunk holding all of K and V."""
    k, v = _kv(dtype)
    (chunk,) = encode_chunks("req-1", k, v, max_chunk_bytes=1 << 20, **kwargs)
    return chunk


def _wire(chunk):
    """``chunk`` after a protobuf serialize / parse round trip."""
    data = chunk_to_proto(chunk).SerializeToString()
    return chunk_from_proto(serving_pb2.KVChunk.FromString(data))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_round_trip_is_bit_exact(dtype):
    k, v = _kv(dtype)
    k_scale, v_scale = (0.25, 0.5) if dtype == "float8_e4m3fn" else (1.0, 1.0)
    out_k, out_v = torch.zeros_like(k), torch.zeros_like(v)
    row_bytes = 2 * HEADS * HEAD_DIM * k.element_size()
    chunks = list(encode_chunks("req-1", k, v, max_chunk_bytes=2 * row_bytes,
                                k_scale=k_scale, v_scale=v_scale))
    assert len(chunks) == LAYERS * 3  # 5 tokens in pieces of 2, 2, 1 per layer
    for chunk in chunks:
        write = decode_chunk(_wire(chunk), _reservation(dtype))
        assert (write.k_scale, write.v_scale) == (k_scale, v_scale)
        out_k[write.layers, write.tokens, write.heads] = write.k
        out_v[write.layers, write.tokens, write.heads] = write.v
    assert torch.equal(_bits(out_k), _bits(k)) and torch.equal(_bits(out_v), _bits(v))


def test_wire_layout_is_layer_token_head_dim_little_endian():
    k = torch.arange(LAYERS * TOKENS * HEADS * HEAD_DIM, dtype=torch.float32).reshape(SHAPE)
    chunks = list(encode_chunks("req-1", k, -k, token_start=10, layer_start=1, head_start=3,
                                max_chunk_bytes=2 * TOKENS * HEADS * HEAD_DIM * 4))
    first = chunks[0]
    assert (first.layer_start, first.layer_end) == (1, 2)
    assert (first.token_start, first.token_end) == (10, 15)
    assert (first.head_start, first.head_end) == (3, 5)
    n = TOKENS * HEADS * HEAD_DIM
    assert struct.unpack(f"<{n}f", first.k) == tuple(float(i) for i in range(n))
    assert struct.unpack(f"<{n}f", first.v) == tuple(-float(i) for i in range(n))


def test_decoded_tensors_are_zero_copy_views_of_the_payload():
    chunk = _one_chunk()
    write = decode_chunk(chunk, _reservation())
    raw_k, raw_v = (w.reshape(-1).view(torch.uint8).numpy() for w in (write.k, write.v))
    assert raw_k.tobytes() == chunk.k and raw_v.tobytes() == chunk.v
    assert np.shares_memory(raw_k, np.frombuffer(chunk.k, dtype=np.uint8))  # no copy made


def test_protobuf_round_trip_keeps_every_field():
    chunk = _one_chunk("float8_e4m3fn", k_scale=0.1, v_scale=3.0)
    assert _wire(chunk) == chunk
    assert chunk_to_proto(chunk).dtype == serving_pb2.DTYPE_FLOAT8_E4M3FN


def test_unknown_dtype_is_refused():
    msg = chunk_to_proto(_one_chunk())
    msg.dtype = 99  # e.g. from a newer peer
    with pytest.raises(KVChunkError) as err:
        chunk_from_proto(msg)
    assert err.value.field == "dtype"
    msg.dtype = serving_pb2.DTYPE_UNSPECIFIED
    for chunk in (chunk_from_proto(msg), dataclasses.replace(_one_chunk(), dtype="int8")):
        with pytest.raises(KVChunkError, match="unknown dtype") as err:
            decode_chunk(chunk, _reservation())
        assert err.value.field == "dtype"


# --------------------------------------------------------------------------- chunking


def test_plan_groups_whole_layers_when_they_fit():
    assert list(plan_chunks(3, 5, 8, 40)) == [(0, 1, 0, 5), (1, 2, 0, 5), (2, 3, 0, 5)]
    assert list(plan_chunks(3, 5, 8, 80)) == [(0, 2, 0, 5), (2, 3, 0, 5)]
    assert list(plan_chunks(3, 5, 8, 1000)) == [(0, 3, 0, 5)]


def test_plan_cuts_tokens_when_a_layer_does_not_fit():
    assert list(plan_chunks(2, 5, 8, 24)) == [
        (0, 1, 0, 3), (0, 1, 3, 5), (1, 2, 0, 3), (1, 2, 3, 5)]


def test_plan_refuses_a_bound_below_one_token():
    with pytest.raises(ValueError, match="raise it to at least 8"):
        list(plan_chunks(2, 5, 8, 7))


@pytest.mark.parametrize("max_chunk_bytes", [64, 100, 128, 320, 500, 640, 1000, 1 << 20])
def test_chunks_respect_the_bound_and_cover_every_cell_once(max_chunk_bytes):
    k, v = _kv("float32")  # one (layer, token) of K+V is 64 bytes
    counts = torch.zeros(LAYERS, TOKENS, dtype=torch.int64)
    for chunk in encode_chunks("req-1", k, v, max_chunk_bytes=max_chunk_bytes):
        assert len(chunk.k) + len(chunk.v) <= max_chunk_bytes
        assert (chunk.head_start, chunk.head_end) == (0, HEADS)
        counts[chunk.layer_start:chunk.layer_end, chunk.token_start:chunk.token_end] += 1
    assert torch.equal(counts, torch.ones(LAYERS, TOKENS, dtype=torch.int64))


def test_encode_checks_arguments_eagerly():
    k, v = _kv("float32")
    with pytest.raises(ValueError, match="one shape and dtype"):
        encode_chunks("req-1", k, v[:, :2])
    with pytest.raises(ValueError, match="not supported"):
        encode_chunks("req-1", k.to(torch.int8), v.to(torch.int8))
    with pytest.raises(KVChunkError, match="k_scale"):
        encode_chunks("req-1", k, v, k_scale=2.0)
    with pytest.raises(KVChunkError, match="request_id"):
        encode_chunks("", k, v)


# --------------------------------------------------------------------------- corruption


def _flip_first_byte(data: bytes) -> bytes:
    return bytes([data[0] ^ 0x01]) + data[1:]


CORRUPTIONS = {
    "flip a K payload byte": (lambda c: dataclasses.replace(c, k=_flip_first_byte(c.k)), "crc32c"),
    "flip a V payload byte": (lambda c: dataclasses.replace(c, v=_flip_first_byte(c.v)), "crc32c"),
    "short K": (lambda c: dataclasses.replace(c, k=c.k[:-2]), "k"),
    "long V": (lambda c: dataclasses.replace(c, v=bytes(c.v) + b"\0\0"), "v"),
    "bad crc": (lambda c: dataclasses.replace(c, crc32c=c.crc32c ^ 1), "crc32c"),
    "other request": (lambda c: dataclasses.replace(c, request_id="req-2"), "request_id"),
    "empty token range": (lambda c: dataclasses.replace(c, token_end=c.token_start), "token_end"),
    "layers past the end": (lambda c: dataclasses.replace(c, layer_end=LAYERS + 1), "layer_end"),
    "heads past the end": (lambda c: dataclasses.replace(c, head_end=HEADS + 1), "head_end"),
    "scale on bf16": (lambda c: dataclasses.replace(c, v_scale=2.0), "v_scale"),
    # Consistent ranges and lengths, but the header no longer matches what was checksummed.
    "shifted header": (lambda c: dataclasses.replace(c, token_start=1, token_end=2,
                                                     layer_start=0, layer_end=LAYERS), "crc32c"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupted_chunk_is_refused_naming_the_field(name):
    corrupt, field = CORRUPTIONS[name]
    k, v = _kv("bfloat16")
    chunk = next(encode_chunks("req-1", k[:, :1], v[:, :1], max_chunk_bytes=1 << 20))
    with pytest.raises(KVChunkError) as err:
        decode_chunk(_wire(corrupt(chunk)), _reservation())
    assert err.value.field == field and repr(field) in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("reservation, field", [
    (_reservation(num_tokens=TOKENS - 1), "token_end"),
    (_reservation(token_start=1), "token_start"),
    (_reservation(num_layers=LAYERS - 1), "layer_end"),
    (_reservation(num_kv_heads=HEADS - 1), "head_end"),
    (_reservation(dtype="float16"), "dtype"),
    (_reservation(head_dim=HEAD_DIM * 2), "k"),
])
def test_chunk_outside_the_reservation_is_refused(reservation, field):
    with pytest.raises(KVChunkError) as err:
        decode_chunk(_one_chunk(), reservation)
    assert err.value.field == field


def test_fp8_needs_a_positive_finite_scale():
    chunk = _one_chunk("float8_e4m3fn", k_scale=0.5)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        bad_chunk = dataclasses.replace(chunk, k_scale=bad)
        bad_chunk = dataclasses.replace(bad_chunk, crc32c=chunk_crc32c(bad_chunk))
        with pytest.raises(KVChunkError) as err:
            decode_chunk(bad_chunk, _reservation("float8_e4m3fn"))
        assert err.value.field == "k_scale"


# --------------------------------------------------------------------------- coverage


def test_coverage_tracks_completion_and_refuses_overlap():
    k, v = _kv("float16")
    res = _reservation("float16", token_start=2)
    coverage = KVCoverage(res)
    assert coverage.missing() == LAYERS * (TOKENS - 2) * HEADS
    chunks = list(encode_chunks("req-1", k[:, 2:], v[:, 2:], token_start=2, max_chunk_bytes=96))
    for chunk in chunks:
        assert not coverage.complete
        coverage.add(decode_chunk(chunk, res))
    assert coverage.complete and coverage.missing() == 0
    with pytest.raises(KVChunkError) as err:
        coverage.add(decode_chunk(chunks[0], res))
    assert err.value.field == "ranges"


def test_chunk_write_unpacks_as_slices_and_tensors():
    layers, tokens, heads, k, v, k_scale, v_scale = decode_chunk(_one_chunk(), _reservation())
    assert (layers, tokens, heads) == (slice(0, LAYERS), slice(0, TOKENS), slice(0, HEADS))
    assert k.shape == v.shape == SHAPE and k.dtype == torch.bfloat16
    assert ChunkWrite._fields[-2:] == ("k_scale", "v_scale") and k_scale == v_scale == 1.0


# --------------------------------------------------------------------------- sizes, fingerprint


def test_max_message_bytes_adds_headroom():
    assert max_message_bytes(4 << 20) == (4 << 20) + MESSAGE_HEADROOM_BYTES
    with_prompt = max_message_bytes(1 << 20, max_prompt_tokens=1 << 20)
    assert with_prompt == (5 << 20) + MESSAGE_HEADROOM_BYTES  # 5 bytes per packed token id
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        max_message_bytes(0)


FP = ModelFingerprint("smollm2-135m", num_layers=30, num_kv_heads=3, head_dim=64,
                      dtype="bfloat16", kv_quantization="none", weights_hash="abc123")


def test_equal_fingerprints_have_no_mismatch():
    assert fingerprint_mismatch(FP, dataclasses.replace(FP)) is None


def test_fingerprint_mismatch_names_every_differing_field():
    other = dataclasses.replace(FP, num_kv_heads=4, kv_quantization="fp8_e4m3fn")
    assert fingerprint_mismatch(FP, other) == (
        "model fingerprint mismatch: num_kv_heads: local=3 remote=4; "
        "kv_quantization: local='none' remote='fp8_e4m3fn'")


def test_fingerprint_protobuf_round_trip_and_kv_dtype():
    fp8 = dataclasses.replace(FP, kv_quantization="fp8_e4m3fn")
    for fp in (FP, fp8):
        msg = serving_pb2.ModelFingerprint.FromString(fingerprint_to_proto(fp).SerializeToString())
        assert fingerprint_from_proto(msg) == fp
    assert (FP.kv_dtype, fp8.kv_dtype) == ("bfloat16", "float8_e4m3fn")
    assert Reservation.for_model(fp8, "r", num_tokens=9).dtype == "float8_e4m3fn"


def test_incomplete_fingerprint_is_refused():
    with pytest.raises(ValueError, match="dtype"):
        fingerprint_from_proto(serving_pb2.ModelFingerprint(num_layers=1, num_kv_heads=1,
                                                            head_dim=1))
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(FP, num_kv_heads=0)


# --------------------------------------------------------------------------- zero-copy framing


def _event(chunk) -> serving_pb2.PrefillEvent:
    event = serving_pb2.PrefillEvent()
    chunk_to_proto(chunk, out=event.kv_chunk)
    return event


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_chunk_event_bytes_is_the_protobuf_event(dtype):
    k, v = _kv(dtype)
    scales = dict(k_scale=0.25, v_scale=0.5) if dtype == "float8_e4m3fn" else {}
    for chunk in encode_chunks("req-ü", k, v, token_start=7, max_chunk_bytes=256, **scales):
        data = chunk_event_bytes(chunk)
        assert serving_pb2.PrefillEvent.FromString(data) == _event(chunk)
        assert chunk_from_event_bytes(data) == chunk


def test_sent_chunks_are_views_of_the_kv_tensors():
    k, v = _kv("bfloat16")
    for chunk in encode_chunks("req-1", k, v, max_chunk_bytes=1 << 20):
        assert np.shares_memory(np.frombuffer(chunk.k, dtype=np.uint8), k.view(torch.uint8).numpy())
        assert np.shares_memory(np.frombuffer(chunk.v, dtype=np.uint8), v.view(torch.uint8).numpy())
    strided = k.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    (chunk,) = encode_chunks("req-1", strided, v, max_chunk_bytes=1 << 20)
    assert bytes(chunk.k) == k.contiguous().view(torch.uint8).numpy().tobytes()


def test_received_payload_is_a_view_of_the_message():
    data = _event(_one_chunk()).SerializeToString()  # as protobuf itself writes it
    chunk = chunk_from_event_bytes(data)
    assert chunk == _one_chunk()
    write = decode_chunk(chunk, _reservation())
    raw = np.frombuffer(data, dtype=np.uint8)
    assert np.shares_memory(write.k.view(torch.uint8).numpy(), raw)
    assert np.shares_memory(write.v.view(torch.uint8).numpy(), raw)


def test_event_parse_follows_protobuf_semantics():
    chunk = _one_chunk()
    body = chunk_to_proto(chunk).SerializeToString()
    # Fields in another order, an unknown field (number 99, varint), k sent twice (last wins).
    reordered = (chunk_to_proto(dataclasses.replace(chunk, k=b"", v=b"")).SerializeToString()
                 + bytes([0x98, 0x06, 0x05])  # field 99, varint 5
                 + serving_pb2.KVChunk(k=b"stale").SerializeToString()
                 + serving_pb2.KVChunk(v=bytes(chunk.v)).SerializeToString()
                 + serving_pb2.KVChunk(k=bytes(chunk.k)).SerializeToString())
    for payload in (body, reordered):
        data = bytes([0x12]) + _varint_bytes(len(payload)) + payload  # field 2 (kv_chunk)
        assert chunk_from_event_bytes(data) == chunk
        assert chunk_from_proto(serving_pb2.PrefillEvent.FromString(data).kv_chunk) == chunk


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def test_other_events_are_left_to_protobuf():
    first = serving_pb2.PrefillEvent(first_token=serving_pb2.FirstToken(token_id=5))
    done = serving_pb2.PrefillEvent(done=serving_pb2.PrefillDone(num_chunks=3))
    assert chunk_from_event_bytes(first.SerializeToString()) is None
    assert chunk_from_event_bytes(done.SerializeToString()) is None
    assert chunk_from_event_bytes(b"") is None
    # A kv_chunk followed by done: protobuf's oneof keeps the last, so protobuf must decide.
    both = chunk_event_bytes(_one_chunk()) + done.SerializeToString()
    assert chunk_from_event_bytes(both) is None
    assert serving_pb2.PrefillEvent.FromString(both).WhichOneof("event") == "done"


@pytest.mark.parametrize("cut", [1, 2, 10, -1])
def test_malformed_event_is_refused(cut):
    data = chunk_event_bytes(_one_chunk())
    with pytest.raises(KVChunkError, match="malformed protobuf") as err:
        chunk_from_event_bytes(data[:cut] if cut > 0 else data[:-1])
    assert err.value.field == "kv_chunk"
    with pytest.raises(KVChunkError, match="wire type"):
        chunk_from_event_bytes(bytes([0x13]))  # field 2, wire type 3 (a group)
