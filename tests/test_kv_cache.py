"""write_prompt_range: a prompt's KV range lands in a sequence's blocks exactly where a per-token
scatter over its slots puts it, for any start, length, head range and dtype."""

import random

import pytest
import torch

from nxdi_common.modules.kv_cache import write_prompt_range

LAYERS, BLOCKS, BS, HEADS, D = 3, 12, 4, 3, 2


def _reference(cache_kv, table, start, data, heads):
    """Per-token scatter (what the decode worker did before): slot = block * BS + offset."""
    positions = range(start, start + data.shape[1])
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in positions])
    flat = cache_kv.flatten(1, 2)
    flat[:, slots, heads] = data


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("start, length", [(0, 16), (0, 3), (1, 2), (2, 11), (4, 8), (5, 19),
                                           (3, 1), (7, 21)])
@pytest.mark.parametrize("heads", [slice(None), slice(0, 3), slice(1, 3), slice(0, 1)])
def test_matches_a_per_token_scatter(dtype, start, length, heads):
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


def test_writes_through_a_strided_view_of_the_cache():
    cache = torch.zeros(LAYERS, 2, BLOCKS + 1, BS, HEADS, D)  # [L, K/V, ...] as the engine has it
    data = torch.randn(LAYERS, 9, HEADS, D)
    write_prompt_range(cache[:, 1], [4, 0, 9], 2, data)
    ref = torch.zeros_like(cache)
    _reference(ref[:, 1], [4, 0, 9], 2, data, slice(None))
    assert torch.equal(cache, ref)


def test_a_cache_whose_blocks_are_not_contiguous_still_gets_every_block():
    base = torch.zeros(LAYERS, BLOCKS + 1, HEADS, BS, D)
    cache = base.transpose(2, 3)  # [L, blocks, BS, H, D] with the block's rows interleaved
    data = torch.randn(LAYERS, 12, HEADS, D)
    write_prompt_range(cache, [3, 7, 1], 0, data)
    ref = torch.zeros(LAYERS, BLOCKS + 1, BS, HEADS, D)
    _reference(ref, [3, 7, 1], 0, data, slice(None))
    assert torch.equal(cache, ref)
