"""KV cache on the wire: chunk encode, decode and validation, and the model fingerprint.

This is the only module that knows the KV wire layout, and the one place that converts the
``KVChunk`` and ``ModelFingerprint`` protobuf messages (the prefill and decode services' convert
modules call :func:`chunk_to_proto` / :func:`chunk_from_proto` and the fingerprint pair).

Wire layout of one chunk
------------------------
A chunk covers layers ``[layer_start, layer_end)`` x prompt positions ``[token_start, token_end)``
x KV heads ``[head_start, head_end)``. Its ``k`` bytes are the C-contiguous array
``K[layer_start:layer_end, token_start:token_end, head_start:head_end, :]``, shape
``[layers, tokens, heads, head_dim]``, elements of ``dtype`` in little-endian byte order; ``v`` is
the same slice of V. So ``len(k) == len(v) == layers * tokens * heads * head_dim * itemsize``.
``head_dim`` is not sent per chunk: it comes from the model fingerprint both sides agreed on.

For ``float8_e4m3fn`` chunks, ``k_scale`` / ``v_scale`` are dequantization scales
(real value = stored value * scale); for every other dtype they are exactly 1.0.

The CRC32C (Castagnoli) covers ``header || k || v`` where ``header`` is
``struct.pack("<6I2f", layer_start, layer_end, token_start, token_end, head_start, head_end,
k_scale, v_scale)`` followed by the request id and the dtype name (e.g. ``b"bfloat16"``), each
as a little-endian uint16 byte length and its UTF-8 bytes.

Nothing here pickles: payloads are raw tensor bytes, headers are fixed-layout structs.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import crc32c
import numpy as np
import torch

from protos.nxdi.serving.v1 import serving_pb2

# K + V payload per chunk. 1 MiB measured fastest with both workers pinned to one core each
# (bench/bench_kv_transfer.py: 0.89 GB/s vs 0.77 at 4 MiB and 0.53 at 16 MiB).
DEFAULT_MAX_CHUNK_BYTES = 1 << 20
MESSAGE_HEADROOM_BYTES = 64 << 10  # chunk header and protobuf framing, far above what they need
PROMPT_TOKEN_WIRE_BYTES = 5  # a packed uint32 varint is at most 5 bytes
MAX_REQUEST_ID_BYTES = 256

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
SCALED_DTYPES = frozenset({"float8_e4m3fn"})
KV_QUANTIZATIONS: dict[str, str | None] = {"none": None, "fp8_e4m3fn": "float8_e4m3fn"}

_HEADER = struct.Struct("<6I2f")


class KVChunkError(ValueError):
    """A KV chunk failed validation; ``field`` names the offending chunk field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"KV chunk field {field!r}: {message}")
        self.field = field


def _check_choice(what: str, value: str, choices: dict) -> None:
    """ValueError unless ``value`` is a key of ``choices``."""
    if value not in choices:
        raise ValueError(f"{what} {value!r} is not one of {sorted(choices)}")


# --------------------------------------------------------------------------- model fingerprint


@dataclass(frozen=True)
class ModelFingerprint:
    """What must agree between two workers before KV moves between them."""

    model_name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # model compute dtype, a key of DTYPES
    kv_quantization: str = "none"  # a key of KV_QUANTIZATIONS
    weights_hash: str = ""

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"ModelFingerprint.{name} must be positive, got {value}")
        _check_choice("ModelFingerprint.dtype", self.dtype, DTYPES)
        _check_choice("ModelFingerprint.kv_quantization", self.kv_quantization, KV_QUANTIZATIONS)

    @property
    def kv_dtype(self) -> str:
        """The dtype KV is stored and sent in."""
        return KV_QUANTIZATIONS[self.kv_quantization] or self.dtype


def fingerprint_mismatch(local: ModelFingerprint, remote: ModelFingerprint) -> str | None:
    """Describe every field where ``local`` and ``remote`` differ, or return None if they agree."""
    diffs = [
        f"{f.name}: local={getattr(local, f.name)!r} remote={getattr(remote, f.name)!r}"
        for f in dataclasses.fields(ModelFingerprint)
        if getattr(local, f.name) != getattr(remote, f.name)
    ]
    return "model fingerprint mismatch: " + "; ".join(diffs) if diffs else None


# --------------------------------------------------------------------------- chunks, reservations


@dataclass(frozen=True)
class KVChunkData:
    """One chunk as it travels (internal twin of the protobuf ``KVChunk``); see the module doc."""

    request_id: str
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    head_start: int
    head_end: int
    dtype: str  # a key of DTYPES
    k_scale: float
    v_scale: float
    k: bytes | memoryview  # bytes-like, len() in bytes (memoryviews are byte-formatted)
    v: bytes | memoryview
    crc32c: int


@dataclass(frozen=True)
class Reservation:
    """Where a receiver may write: the KV it reserved for one request.

    Valid chunk ranges: layers in [0, num_layers), tokens in [token_start, num_tokens), heads in
    [0, num_kv_heads). ``token_start`` > 0 protects a prefix the receiver already holds.
    """

    request_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    dtype: str  # the expected wire dtype
    token_start: int = 0

    def __post_init__(self):
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.num_tokens) <= 0:
            raise ValueError(f"Reservation sizes must be positive: {self}")
        if not 0 <= self.token_start < self.num_tokens:
            raise ValueError(f"Reservation.token_start {self.token_start} must be in "
                             f"[0, num_tokens={self.num_tokens})")
        _check_choice("Reservation.dtype", self.dtype, DTYPES)

    @classmethod
    def for_model(cls, fingerprint: ModelFingerprint, request_id: str, num_tokens: int,
                  token_start: int = 0) -> Reservation:
        """The reservation for ``num_tokens`` prompt positions of ``fingerprint``'s model."""
        return cls(request_id, fingerprint.num_layers, fingerprint.num_kv_heads,
                   fingerprint.head_dim, num_tokens, fingerprint.kv_dtype, token_start)


class ChunkWrite(NamedTuple):
    """A validated chunk, ready to write: ``cache_k[layers, tokens, heads] = k`` (same for v)."""

    layers: slice
    tokens: slice
    heads: slice
    k: torch.Tensor  # [layers, tokens, heads, head_dim]
    v: torch.Tensor  # [layers, tokens, heads, head_dim]
    k_scale: float
    v_scale: float


# --------------------------------------------------------------------------- bytes and checksums


def _require_little_endian() -> None:
    """The wire is little-endian; raw tensor bytes are only that on little-endian hosts."""
    if sys.byteorder != "little":
        raise NotImplementedError("KV transfer needs a little-endian host")


def _f32(x: float) -> float:
    """Round ``x`` to the nearest float32 (the precision of the scale fields on the wire)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of ``t`` in C order: a read-only view of its storage when ``t`` is
    contiguous (every planned chunk of a contiguous K or V is), else of a contiguous copy. The
    view keeps the tensor alive; nothing may write to the tensor while the view is in use."""
    _require_little_endian()
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).toreadonly()


def _bytes_tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only tensor view of ``shape`` over raw little-endian ``data`` (no copy: the caller
    copies it into its cache; writing to the view is undefined)."""
    _require_little_endian()
    if isinstance(data, memoryview) and not data.readonly:  # a receive buffer: no warning
        return torch.frombuffer(data, dtype=DTYPES[dtype]).reshape(shape)
    with warnings.catch_warnings():  # torch warns that bytes are not writable: we never write
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=DTYPES[dtype]).reshape(shape)


def _lp_utf8(s: str) -> bytes:
    """``s`` as a uint16-length-prefixed UTF-8 string."""
    raw = s.encode()
    return struct.pack("<H", len(raw)) + raw


def chunk_crc32c(chunk: KVChunkData) -> int:
    """The CRC32C a chunk must carry: over its header fields, then k, then v."""
    header = _HEADER.pack(chunk.layer_start, chunk.layer_end, chunk.token_start, chunk.token_end,
                          chunk.head_start, chunk.head_end, chunk.k_scale, chunk.v_scale)
    crc = crc32c.crc32c(header + _lp_utf8(chunk.request_id) + _lp_utf8(chunk.dtype))
    crc = crc32c.crc32c(chunk.k, value=crc)
    return crc32c.crc32c(chunk.v, value=crc)


def _check_scale(field: str, dtype: str, scale: float) -> None:
    """fp8 scales are finite and positive; other dtypes carry exactly 1.0."""
    if dtype in SCALED_DTYPES and not (math.isfinite(scale) and scale > 0):
        raise KVChunkError(field, f"{scale} is not a finite positive scale for {dtype}")
    if dtype not in SCALED_DTYPES and scale != 1.0:
        raise KVChunkError(field, f"must be 1.0 for unscaled dtype {dtype}, got {scale}")


def _check_request_id(request_id: str) -> None:
    """Request ids are non-empty and short (they are in every chunk's header)."""
    if not request_id or len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise KVChunkError("request_id", f"must be 1..{MAX_REQUEST_ID_BYTES} UTF-8 bytes, "
                                         f"got {request_id!r:.300}")


# --------------------------------------------------------------------------- encoding


def plan_chunks(num_layers: int, num_tokens: int, row_bytes: int,
                max_chunk_bytes: int) -> Iterator[tuple[int, int, int, int]]:
    """Split [num_layers, num_tokens] into (layer_start, layer_end, token_start, token_end) boxes,
    layer-major, each holding at most ``max_chunk_bytes`` when one (layer, token) is
    ``row_bytes``: whole layers grouped when a layer fits, else one layer cut by tokens."""
    if row_bytes > max_chunk_bytes:
        raise ValueError(f"max_chunk_bytes={max_chunk_bytes} is below the K+V size of one token "
                         f"of one layer ({row_bytes} bytes); raise it to at least {row_bytes}")
    layer_bytes = num_tokens * row_bytes
    if layer_bytes <= max_chunk_bytes:
        step = max_chunk_bytes // layer_bytes
        for l0 in range(0, num_layers, step):
            yield l0, min(l0 + step, num_layers), 0, num_tokens
        return
    step = max_chunk_bytes // row_bytes
    for layer in range(num_layers):
        for t0 in range(0, num_tokens, step):
            yield layer, layer + 1, t0, min(t0 + step, num_tokens)


def _check_kv_tensors(k: torch.Tensor, v: torch.Tensor) -> str:
    """Validate a K/V pair for encoding; return its dtype name."""
    if k.shape != v.shape or k.dtype != v.dtype or k.dim() != 4 or k.numel() == 0:
        raise ValueError(f"k and v must be non-empty [layers, tokens, kv_heads, head_dim] tensors "
                         f"of one shape and dtype, got {tuple(k.shape)} {k.dtype} and "
                         f"{tuple(v.shape)} {v.dtype}")
    names = {dt: name for name, dt in DTYPES.items()}
    if k.dtype not in names:
        raise ValueError(f"KV dtype {k.dtype} is not supported; use one of {sorted(DTYPES)}")
    return names[k.dtype]


def encode_chunks(request_id: str, k: torch.Tensor, v: torch.Tensor, token_start: int = 0, *,
                  max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, layer_start: int = 0,
                  head_start: int = 0, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> Iterator[KVChunkData]:
    """Cut K and V (each [layers, tokens, kv_heads, head_dim], covering absolute layers from
    ``layer_start``, prompt positions from ``token_start`` and heads from ``head_start``) into
    chunks whose K+V payload is at most ``max_chunk_bytes``. Arguments are checked now; chunk
    bytes are produced lazily, one chunk at a time."""
    dtype = _check_kv_tensors(k, v)
    _check_request_id(request_id)
    k_scale, v_scale = _f32(k_scale), _f32(v_scale)
    _check_scale("k_scale", dtype, k_scale)
    _check_scale("v_scale", dtype, v_scale)
    if min(token_start, layer_start, head_start) < 0:
        raise ValueError("token_start, layer_start and head_start must be >= 0")
    layers, tokens, heads, head_dim = k.shape
    row_bytes = 2 * heads * head_dim * k.element_size()
    boxes = list(plan_chunks(layers, tokens, row_bytes, max_chunk_bytes))
    base = (layer_start, token_start, head_start, heads)
    return _iter_chunks(request_id, k, v, dtype, (k_scale, v_scale), base, boxes)


def _iter_chunks(request_id: str, k: torch.Tensor, v: torch.Tensor, dtype: str,
                 scales: tuple[float, float], base: tuple[int, int, int, int],
                 boxes: list[tuple[int, int, int, int]]) -> Iterator[KVChunkData]:
    """Materialize the planned chunks (see encode_chunks)."""
    layer_start, token_start, head_start, heads = base
    for l0, l1, t0, t1 in boxes:
        chunk = KVChunkData(
            request_id, layer_start + l0, layer_start + l1, token_start + t0, token_start + t1,
            head_start, head_start + heads, dtype, scales[0], scales[1],
            _tensor_bytes(k[l0:l1, t0:t1]), _tensor_bytes(v[l0:l1, t0:t1]), 0)
        yield dataclasses.replace(chunk, crc32c=chunk_crc32c(chunk))


# --------------------------------------------------------------------------- decoding


def _check_range(name: str, start: int, end: int, low: int, high: int) -> None:
    """``[start, end)`` must be non-empty and inside ``[low, high)``."""
    if start < low:
        raise KVChunkError(f"{name}_start", f"{start} is below the reserved range [{low}, {high})")
    if end <= start:
        raise KVChunkError(f"{name}_end", f"empty range [{start}, {end})")
    if end > high:
        raise KVChunkError(f"{name}_end", f"{end} is beyond the reserved range [{low}, {high})")


def _check_header(chunk: KVChunkData, res: Reservation) -> None:
    """Request id, dtype, ranges and scales of ``chunk`` against ``res``."""
    if chunk.request_id != res.request_id:
        raise KVChunkError("request_id", f"{chunk.request_id!r} is not the reserved request "
                                         f"{res.request_id!r}")
    if chunk.dtype not in DTYPES:
        raise KVChunkError("dtype", f"unknown dtype {chunk.dtype!r}")
    if chunk.dtype != res.dtype:
        raise KVChunkError("dtype", f"{chunk.dtype} does not match the reserved {res.dtype}")
    _check_range("layer", chunk.layer_start, chunk.layer_end, 0, res.num_layers)
    _check_range("token", chunk.token_start, chunk.token_end, res.token_start, res.num_tokens)
    _check_range("head", chunk.head_start, chunk.head_end, 0, res.num_kv_heads)
    _check_scale("k_scale", chunk.dtype, chunk.k_scale)
    _check_scale("v_scale", chunk.dtype, chunk.v_scale)


def chunk_shape(chunk: KVChunkData, head_dim: int) -> tuple[int, int, int, int]:
    """[layers, tokens, heads, head_dim] of the chunk's K (and V) array."""
    return (chunk.layer_end - chunk.layer_start, chunk.token_end - chunk.token_start,
            chunk.head_end - chunk.head_start, head_dim)


def decode_chunk(chunk: KVChunkData, reservation: Reservation) -> ChunkWrite:
    """Validate every field of ``chunk`` against ``reservation`` and return what to write.

    Raises KVChunkError naming the first bad field; nothing is returned for a bad chunk."""
    _check_header(chunk, reservation)
    shape = chunk_shape(chunk, reservation.head_dim)
    expected = math.prod(shape) * DTYPES[chunk.dtype].itemsize
    for field in ("k", "v"):
        if len(getattr(chunk, field)) != expected:
            raise KVChunkError(field, f"{len(getattr(chunk, field))} bytes, expected {expected} "
                                      f"for shape {list(shape)} of {chunk.dtype}")
    if chunk.crc32c != chunk_crc32c(chunk):
        raise KVChunkError("crc32c", f"checksum {chunk.crc32c:#010x} does not match the chunk "
                                     f"contents ({chunk_crc32c(chunk):#010x})")
    return ChunkWrite(slice(chunk.layer_start, chunk.layer_end),
                      slice(chunk.token_start, chunk.token_end),
                      slice(chunk.head_start, chunk.head_end),
                      _bytes_tensor(chunk.k, chunk.dtype, shape),
                      _bytes_tensor(chunk.v, chunk.dtype, shape), chunk.k_scale, chunk.v_scale)


class KVCoverage:
    """Tracks which (layer, token, head) cells of a reservation have been written, so a receiver
    refuses overlapping chunks and knows when the transfer is complete."""

    def __init__(self, reservation: Reservation):
        self.reservation = reservation
        num_tokens = reservation.num_tokens - reservation.token_start
        # numpy, not torch: a slice, any() and fill cost ~1 us each here, ~5 us in torch, and a
        # receiver does them for every chunk
        self._seen = np.zeros((reservation.num_layers, num_tokens, reservation.num_kv_heads),
                              dtype=bool)

    def add(self, write: ChunkWrite) -> None:
        """Record a validated chunk; raise KVChunkError if it overlaps one already recorded."""
        offset = self.reservation.token_start
        tokens = slice(write.tokens.start - offset, write.tokens.stop - offset)
        cells = self._seen[write.layers, tokens, write.heads]
        if cells.any():
            raise KVChunkError("ranges", "chunk overlaps KV already received")
        cells.fill(True)

    def missing(self) -> int:
        """Number of (layer, token, head) cells not yet received."""
        return int(self._seen.size - np.count_nonzero(self._seen))

    @property
    def complete(self) -> bool:
        """Whether every reserved cell has been received."""
        return bool(self._seen.all())


def max_message_bytes(max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, *,
                      max_prompt_tokens: int = 0) -> int:
    """gRPC max send/receive message size for a KV stream with chunks of at most
    ``max_chunk_bytes`` payload; pass ``max_prompt_tokens`` to also fit requests carrying a
    prompt of that many token ids."""
    if max_chunk_bytes <= 0:
        raise ValueError(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
    prompt_bytes = PROMPT_TOKEN_WIRE_BYTES * max_prompt_tokens
    return max(max_chunk_bytes, prompt_bytes) + MESSAGE_HEADROOM_BYTES


# --------------------------------------------------------------------------- protobuf conversion


def _enum_name(enum, prefix: str, value: int, field: str) -> str:
    """Lower-cased name of a protobuf enum value without its prefix; KVChunkError if unknown."""
    try:
        name = enum.Name(value)
    except ValueError:
        raise KVChunkError(field, f"unknown enum value {value}") from None
    return name.removeprefix(prefix).lower()


def chunk_to_proto(chunk: KVChunkData,
                   out: serving_pb2.KVChunk | None = None) -> serving_pb2.KVChunk:
    """The protobuf message for ``chunk``; filled into ``out`` when given (e.g. the kv_chunk field
    of a PrefillEvent, which saves copying the payload twice)."""
    msg = serving_pb2.KVChunk() if out is None else out
    msg.request_id, msg.layer_start, msg.layer_end = (chunk.request_id, chunk.layer_start,
                                                      chunk.layer_end)
    msg.token_start, msg.token_end = chunk.token_start, chunk.token_end
    msg.head_start, msg.head_end = chunk.head_start, chunk.head_end
    msg.dtype = serving_pb2.DType.Value("DTYPE_" + chunk.dtype.upper())
    msg.k_scale, msg.v_scale, msg.crc32c = chunk.k_scale, chunk.v_scale, chunk.crc32c
    msg.k, msg.v = bytes(chunk.k), bytes(chunk.v)
    return msg


def chunk_from_proto(msg: serving_pb2.KVChunk, k=None, v=None) -> KVChunkData:
    """The chunk carried by ``msg`` (not yet validated: pass it to decode_chunk); ``k`` and
    ``v``, when given, stand for the message's own (views of the bytes it was parsed from)."""
    return KVChunkData(
        msg.request_id, msg.layer_start, msg.layer_end, msg.token_start, msg.token_end,
        msg.head_start, msg.head_end, _enum_name(serving_pb2.DType, "DTYPE_", msg.dtype, "dtype"),
        msg.k_scale, msg.v_scale, msg.k if k is None else k, msg.v if v is None else v,
        msg.crc32c)


def fingerprint_to_proto(fp: ModelFingerprint) -> serving_pb2.ModelFingerprint:
    """The protobuf message for ``fp``."""
    return serving_pb2.ModelFingerprint(
        model_name=fp.model_name, num_layers=fp.num_layers, num_kv_heads=fp.num_kv_heads,
        head_dim=fp.head_dim, dtype=serving_pb2.DType.Value("DTYPE_" + fp.dtype.upper()),
        kv_quantization=serving_pb2.KVQuantization.Value(
            "KV_QUANTIZATION_" + fp.kv_quantization.upper()),
        weights_hash=fp.weights_hash)


def fingerprint_from_proto(msg: serving_pb2.ModelFingerprint) -> ModelFingerprint:
    """The fingerprint carried by ``msg``; ValueError if it is incomplete or unknown."""
    return ModelFingerprint(
        msg.model_name, msg.num_layers, msg.num_kv_heads, msg.head_dim,
        _enum_name(serving_pb2.DType, "DTYPE_", msg.dtype, "dtype"),
        _enum_name(serving_pb2.KVQuantization, "KV_QUANTIZATION_", msg.kv_quantization,
                   "kv_quantization"),
        msg.weights_hash)


# --------------------------------------------------------------------------- zero-copy framing
#
# Python protobuf copies a bytes field on every step: into the message, out to the wire, back
# out of the parsed message and again on each read of the field. For a KV chunk (the payload
# is nearly all of it) that was three copies a side on top of gRPC's own, and the transfer ran
# at ~60% of what gRPC alone moves. The two functions below write and read the *same* protobuf
# encoding of a ``PrefillEvent`` whose oneof is ``kv_chunk`` (a valid message any protobuf
# parser reads, fields in a different order than protobuf writes them), with K and V copied once
# into the message on the sender and not at all on the receiver: the small header fields still
# go through protobuf; only the top-level field boundaries are found by hand.

_EVENT_KV_CHUNK = serving_pb2.PrefillEvent.DESCRIPTOR.fields_by_name["kv_chunk"].number
_CHUNK_K = serving_pb2.KVChunk.DESCRIPTOR.fields_by_name["k"].number
_CHUNK_V = serving_pb2.KVChunk.DESCRIPTOR.fields_by_name["v"].number
_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LEN, _WIRE_FIXED32 = 0, 1, 2, 5


def _varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_prefix(field: int, size: int) -> bytes:
    """Tag and length of a length-delimited field of ``size`` bytes."""
    return _varint(field << 3 | _WIRE_LEN) + _varint(size)


def chunk_event_parts(chunk: KVChunkData) -> tuple:
    """The serialized ``PrefillEvent{kv_chunk: chunk}`` as buffers to send one after the other:
    the event and chunk header bytes, K (``chunk.k`` itself), V's field prefix, V (``chunk.v``)."""
    header = chunk_to_proto(dataclasses.replace(chunk, k=b"", v=b"")).SerializeToString()
    k_prefix, v_prefix = _len_prefix(_CHUNK_K, len(chunk.k)), _len_prefix(_CHUNK_V, len(chunk.v))
    body_size = len(header) + len(k_prefix) + len(chunk.k) + len(v_prefix) + len(chunk.v)
    return (_len_prefix(_EVENT_KV_CHUNK, body_size) + header + k_prefix, chunk.k, v_prefix,
            chunk.v)


def chunk_event_bytes(chunk: KVChunkData) -> bytes:
    """The serialized ``PrefillEvent{kv_chunk: chunk}``, K and V copied once (see above)."""
    return b"".join(chunk_event_parts(chunk))


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    """(value, next position) of the varint at ``pos``; KVChunkError if it is cut short."""
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7
    raise KVChunkError("kv_chunk", "malformed protobuf: truncated or overlong varint")


def _fields(data: memoryview) -> list[tuple[int, int, int, int, int]]:
    """(field number, wire type, start of its tag, start of its value, end) of each
    top-level field of the message in ``data``; KVChunkError on anything malformed.
    One-byte tags are read inline (the common case; a receiver runs this for every chunk)."""
    out, pos, size = [], 0, len(data)
    while pos < size:
        start, tag = pos, data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_varint(data, pos)
        field, wire = tag >> 3, tag & 7
        if wire == _WIRE_VARINT:
            _, end = _read_varint(data, pos)
        elif wire == _WIRE_LEN:
            length, pos = _read_varint(data, pos)
            end = pos + length
        elif wire in (_WIRE_FIXED64, _WIRE_FIXED32):
            end = pos + (8 if wire == _WIRE_FIXED64 else 4)
        else:  # groups (3, 4) are not used by this proto; 6, 7 do not exist
            raise KVChunkError("kv_chunk", f"malformed protobuf: wire type {wire}")
        if field == 0 or end > size:
            raise KVChunkError("kv_chunk", "malformed protobuf: field runs past the message")
        out.append((field, wire, start, pos, end))
        pos = end
    return out


def chunk_from_event_bytes(data: bytes) -> KVChunkData | None:
    """The chunk of a serialized ``PrefillEvent`` whose one field is ``kv_chunk``, its K and V
    zero-copy views of ``data``; None for any other event (parse that with protobuf). Not yet
    validated: pass it to decode_chunk.

    A receiver runs this for every chunk (30 for a 1024-token prompt of the bundled model), so it
    walks the fields in one loop and hands protobuf the header fields as one slice when they
    are contiguous (they are when chunk_event_parts wrote the event)."""
    view = memoryview(data)
    fields = _fields(view)
    if len(fields) != 1 or fields[0][:2] != (_EVENT_KV_CHUNK, _WIRE_LEN):
        return None  # first_token, done, or an unusual encoding: protobuf's semantics apply
    body = view[fields[0][3]:fields[0][4]]
    payload, header, gap = {}, [], 0  # gap: where header bytes not yet in ``header`` begin
    for field, wire, start, value, end in _fields(body):
        if field in (_CHUNK_K, _CHUNK_V) and wire == _WIRE_LEN:
            payload[field] = body[value:end]  # a repeated scalar field: the last one wins
            if start > gap:
                header.append(body[gap:start])
            gap = end
    if gap < len(body):
        header.append(body[gap:])
    try:
        msg = serving_pb2.KVChunk.FromString(header[0] if len(header) == 1 else b"".join(header))
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, named for the caller
        raise KVChunkError("kv_chunk", f"malformed protobuf: {exc}") from None
    empty = memoryview(b"")
    return chunk_from_proto(msg, payload.get(_CHUNK_K, empty), payload.get(_CHUNK_V, empty))
