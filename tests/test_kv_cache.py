"""write_prompt_range: a prompt's KV range lands in a sequence's blocks exactly where a per-token
scatter over its slots puts it, for any start, length, head range and dtype, through our
kernel's copy_blocks (non-temporal stores where rows allow) and through the numpy fallback."""

import random

import pytest
import torch

from nxdi_common import kernels
from nxdi_common.modules import kv_cache
from nxdi_common.modules.kv_cache import SequenceKVWriter, write_prompt_range

LAYERS, BLOCKS, BS, HEADS, D = 3, 12, 4, 3, 2


def _reference(cache_kv, table, start, data, heads):
    """Per-token scatter (what the decode worker did before): slot = block * BS + offset."""
    positions = range(start, start + data.shape[1])
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in positions])
    flat = cache_kv.flatten(1, 2)
    flat[:, slots, heads] = data


@pytest.fixture(params=["kernel", "numpy"])
def copy_path(request, monkeypatch):
    """Whole blocks through copy_blocks, or through the numpy fallback (kernel 'unavailable')."""
    if request.param == "numpy":
        monkeypatch.setattr(kv_cache.kernels, "kernels_unavailable_reason", lambda: "off here")
    elif kernels.kernels_unavailable_reason() is not None:
        pytest.skip(kernels.kernels_unavailable_reason())
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("start, length", [(0, 16), (0, 3), (1, 2), (2, 11), (4, 8), (5, 19),
                                           (3, 1), (7, 21)])
@pytest.mark.parametrize("heads", [slice(None), slice(0, 3), slice(1, 3), slice(0, 1)])
def test_matches_a_per_token_scatter(copy_path, dtype, start, length, heads):
    rng = random.Random(start * 100 + length)
    table = rng.sample(range(BLOCKS), 7)  # scattered blocks, 28 positions
    n_heads = len(range(*heads.indices(HEADS)))
    data = (torch.randn(LAYERS - 1, length, n_heads, D) * 4).to(dtype)
    ours = torch.zeros(LAYERS, BLOCKS + 1, BS, HEADS, D).to(dtype)
    ref = ours.clone()
    write_prompt_range(ours[1:], table, start, data, heads)
    _reference(ref.view(torch.uint8)[1:], table, start, data.view(torch.uint8), heads)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    assert not ours[0].view(torch.uint8).any()  # the layer outside the range is untouched


@pytest.mark.parametrize("start, length", [(0, 16), (0, 3), (1, 2), (2, 11), (4, 8), (5, 19),
                                           (3, 1), (7, 21)])
@pytest.mark.parametrize("heads", [slice(None), slice(0, 3), slice(1, 3)])
def test_sequence_writer_puts_k_and_v_where_a_per_token_scatter_does(copy_path, start, length,
                                                                    heads):
    """SequenceKVWriter (what the decode worker writes received chunks with): K into [:, 0], V
    into [:, 1] of the layers named, partial blocks at both ends, any head range."""
    rng = random.Random(start * 100 + length)
    table = rng.sample(range(BLOCKS), 7)
    n_heads = len(range(*heads.indices(HEADS)))
    k = torch.randn(LAYERS - 1, length, n_heads, D).to(torch.bfloat16)
    v = torch.randn(LAYERS - 1, length, n_heads, D).to(torch.bfloat16)
    ours = torch.zeros(LAYERS, 2, BLOCKS + 1, BS, HEADS, D, dtype=torch.bfloat16)
    ref = ours.clone()
    writer = SequenceKVWriter(ours, table)
    assert writer.kernel == (copy_path == "kernel")
    writer.write(slice(1, LAYERS), start, k, v, heads)
    _reference(ref[1:, 0], table, start, k, heads)
    _reference(ref[1:, 1], table, start, v, heads)
    assert torch.equal(ours, ref)
    assert not ours[0].any()  # the layer outside the range is untouched


def test_sequence_writer_refuses_a_cache_without_k_and_v():
    with pytest.raises(ValueError, match="cache must be"):
        SequenceKVWriter(torch.zeros(LAYERS, BLOCKS + 1, BS, HEADS, D), [0, 1])


def test_writes_through_a_strided_view_of_the_cache(copy_path):
    cache = torch.zeros(LAYERS, 2, BLOCKS + 1, BS, HEADS, D)  # [L, K/V, ...] as the engine has it
    data = torch.randn(LAYERS, 9, HEADS, D)
    write_prompt_range(cache[:, 1], [4, 0, 9], 2, data)
    ref = torch.zeros_like(cache)
    _reference(ref[:, 1], [4, 0, 9], 2, data, slice(None))
    assert torch.equal(cache, ref)


def test_a_cache_whose_blocks_are_not_contiguous_still_gets_every_block(copy_path):
    base = torch.zeros(LAYERS, BLOCKS + 1, HEADS, BS, D)
    cache = base.transpose(2, 3)  # [L, blocks, BS, H, D] with the block's rows interleaved
    data = torch.randn(LAYERS, 12, HEADS, D)
    write_prompt_range(cache, [3, 7, 1], 0, data)
    ref = torch.zeros(LAYERS, BLOCKS + 1, BS, HEADS, D)
    _reference(ref, [3, 7, 1], 0, data, slice(None))
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("offset", [0, 1])  # 0: 64-byte aligned rows (streamed), 1: misaligned
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_blocks_streams_aligned_rows_and_copies_the_rest(copy_path, offset, dtype):
    """Rows of 16 x 2 x 32 elements (a multiple of 64 bytes) as a KV pool has them, written
    through a view that starts ``offset`` elements into its storage."""
    shape = (LAYERS, 2, BLOCKS + 1, 16, 2, 32)
    storage = torch.zeros(int(torch.Size(shape).numel()) + offset, dtype=dtype)
    cache = storage[offset:].view(shape)
    data = torch.randn(LAYERS, 16 * 5 + 7, 2, 32).to(dtype)
    table = [11, 2, 7, 0, 5, 9]
    write_prompt_range(cache[:, 0], table, 3, data)
    ref = torch.zeros(shape, dtype=dtype)
    bs = 16
    positions = range(3, 3 + data.shape[1])
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in positions])
    ref[:, 0].flatten(1, 2)[:, slots] = data
    assert torch.equal(cache, ref) and not storage[:offset].any()


def test_copy_blocks_refuses_bad_input():
    if kernels.kernels_unavailable_reason() is not None:
        pytest.skip(kernels.kernels_unavailable_reason())
    op = torch.ops.nxdi.copy_blocks
    dst, src = torch.zeros(2, 5, 4, 8), torch.ones(2, 2, 4, 8)
    with pytest.raises(RuntimeError, match="outside 0..4"):
        op(dst, torch.tensor([1, 5]), src)
    with pytest.raises(RuntimeError, match="blocks must be"):
        op(dst, torch.tensor([1]), src)
    with pytest.raises(RuntimeError, match="disagree"):
        op(dst, torch.tensor([1, 2]), torch.ones(2, 2, 4, 4))
    with pytest.raises(RuntimeError, match="dtypes differ"):
        op(dst, torch.tensor([1, 2]), src.double())
    with pytest.raises(RuntimeError, match="not contiguous"):
        op(dst.transpose(2, 3), torch.tensor([1, 2]), torch.ones(2, 2, 8, 4))
    assert not dst.any()  # nothing written by a refused call


def test_write_prompt_kv_refuses_bad_input():
    if kernels.kernels_unavailable_reason() is not None:
        pytest.skip(kernels.kernels_unavailable_reason())
    op = torch.ops.nxdi.write_prompt_kv
    cache = torch.zeros(LAYERS, 2, BLOCKS + 1, BS, HEADS, D)
    k = v = torch.ones(2, 9, HEADS, D)  # positions 2..10: blocks 0, 1 and 2 of the table
    table = torch.tensor([4, 0, 9])
    with pytest.raises(RuntimeError, match="need 3 blocks"):
        op(cache, 0, table[:2], 2, k, v)
    with pytest.raises(RuntimeError, match="block 13 outside"):
        op(cache, 0, torch.tensor([4, 13, 9]), 2, k, v)
    with pytest.raises(RuntimeError, match="layers 2..4 outside"):
        op(cache, 2, table, 2, k, v)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        op(cache, 0, table, 2, k.double(), v.double())
    with pytest.raises(RuntimeError, match="do not match the cache"):
        op(cache, 0, table, 2, torch.ones(2, 9, HEADS, D + 1), torch.ones(2, 9, HEADS, D + 1))
    with pytest.raises(RuntimeError, match="must be contiguous"):
        op(cache, 0, table, 2, k.transpose(2, 3).contiguous().transpose(2, 3), v)
    assert not cache.any()  # nothing written by a refused call
    op(cache, 1, table, 2, k, v)
    ref = torch.zeros_like(cache)
    _reference(ref[1:, 0], [4, 0, 9], 2, k, slice(None))
    _reference(ref[1:, 1], [4, 0, 9], 2, v, slice(None))
    assert torch.equal(cache, ref)
