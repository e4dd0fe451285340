"""KV cache managers. The cache is one tensor owned by the application and passed into every model
call (state is passed, not global), so that the context-encoding and token-generation graphs of every
bucket share it and update it in place.

Two layouts, as in NxD Inference:

* flat (`KVCacheManager`): [layers, 2, max_batch_size + 1, kv_heads, seq_len, head_dim]. A row per
  sequence slot, addressed by `seq_ids` (continuous batching). The extra last row is a scratch row
  that padded batch rows write into, so padding never touches a live sequence.
* block (`BlockKVCacheManager`, `is_block_kv_layout`): [layers, 2, pa_num_blocks + 1, pa_block_size,
  kv_heads, head_dim]. Writes go to `slot_mapping` (slot = block * block_size + offset), reads gather
  the sequence's blocks through its `block_table` into a flat view. The extra last block is scratch
  for padding slots. Token generation can skip the gather: with `paged_attention` set (the C++
  kernel of nxdi_common/kernels), `attend` reads each row's blocks where they lie, up to its own
  position, so a step's cost follows the real lengths rather than the length bucket.

With `kv_cache_quant` the cache holds float8_e4m3fn and is cast back to the compute dtype on read.
"""
from __future__ import annotations

import numpy as np
import torch

from nxdi_common import kernels
from nxdi_common.runtime import huge_page_zeros

K, V = 0, 1


def kv_cache_dtype(neuron_config) -> torch.dtype:
    """float8_e4m3fn when kv_cache_quant is on, else the compute dtype."""
    if getattr(neuron_config, "kv_cache_quant", False):
        return torch.float8_e4m3fn
    return neuron_config.torch_dtype


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype (no graph op when it already is)."""
    return t if t.dtype == dtype else t.to(dtype)


class KVCacheManager:
    """Flat per-sequence KV layout addressed by seq_ids and positions."""

    is_block = False
    paged_attention = None  # token generation always gathers (read) and runs SDPA

    def __init__(self, num_layers: int, max_batch_size: int, kv_heads: int, seq_len: int,
                 head_dim: int, dtype: torch.dtype, compute_dtype: torch.dtype):
        self.shape = (num_layers, 2, max_batch_size + 1, kv_heads, seq_len, head_dim)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.scratch_row = max_batch_size
        self.dtype, self.compute_dtype = dtype, compute_dtype

    def allocate(self) -> torch.Tensor:
        return huge_page_zeros(self.shape, self.dtype)

    def write(self, cache, layer: int, k, v, index) -> None:
        """Store k, v [B, Hkv, S, D] at (seq_ids [B], position_ids [B, S]) of `index`."""
        seq_ids, position_ids = index[0], index[1]
        rows = seq_ids.long().unsqueeze(1)  # [B, 1]
        kv = _as_dtype(torch.stack((k, v)), self.dtype)  # [2, B, Hkv, S, D]
        # Advanced indices on dims 1 and 3 put [B, S] first: the values are [B, S, 2, Hkv, D].
        cache[layer][:, rows, :, position_ids] = kv.permute(1, 3, 0, 2, 4)

    def read(self, cache, layer: int, index, length: int):
        """k, v [B, Hkv, length, D] for the rows seq_ids, in the compute dtype."""
        seq_ids = index[0].long()
        # index_select on dim 0 (per K and V) is about 2x faster here than one select on dim 1.
        k = cache[layer, K][:, :, :length].index_select(0, seq_ids)  # copies only `length`
        v = cache[layer, V][:, :, :length].index_select(0, seq_ids)
        return _as_dtype(k, self.compute_dtype), _as_dtype(v, self.compute_dtype)


class BlockKVCacheManager:
    """Block (paged) KV layout: writes by slot_mapping, reads by block_table."""

    is_block = True

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, compute_dtype: torch.dtype):
        self.shape = (num_layers, 2, num_blocks + 1, block_size, kv_heads, head_dim)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.block_size, self.scratch_block = block_size, num_blocks
        self.dtype, self.compute_dtype = dtype, compute_dtype
        # torch.ops.nxdi.paged_decode_attention when the model uses the paged kernel (set by
        # application_base); attend() calls it through paged_decode_attention_layer
        self.paged_attention = None

    def allocate(self) -> torch.Tensor:
        return huge_page_zeros(self.shape, self.dtype)

    def write(self, cache, layer: int, k, v, index) -> None:
        """Store k, v [B, Hkv, S, D] at slot_mapping [B, S] (index[2])."""
        slots = index[2].reshape(-1).long()
        kv = _as_dtype(torch.stack((k, v)).transpose(2, 3), self.dtype)  # [2, B, S, Hkv, D]
        rows = kv.flatten(1, 2)  # [2, B * S, Hkv, D]
        dest = cache[layer].view(2, -1, self.kv_heads, self.head_dim)
        if self.dtype == torch.float8_e4m3fn:
            dest[:, slots] = rows  # index_copy_ has no float8 kernel; index_put has
        else:
            dest.index_copy_(1, slots, rows)

    def read(self, cache, layer: int, index, length: int):
        """Gather block_table [B, length / block_size] (index[3]) into k, v [B, Hkv, length, D]."""
        flat = index[3].reshape(-1).long()
        out = []
        for which in (K, V):
            # index_select on the block dim copies each block once (about 4x faster here than
            # advanced indexing cache[table]; 2x faster on dim 0 than one select over K and V).
            blocks = cache[layer, which].index_select(0, flat)  # [B * blocks, BS, Hkv, D]
            kv = blocks.view(-1, length, self.kv_heads, self.head_dim).transpose(1, 2)
            out.append(_as_dtype(kv, self.compute_dtype))  # [B, Hkv, length, D]
        return out[K], out[V]

    def attend(self, cache, layer: int, q, index):
        """Token-generation attention in place (paged_attention set): q [B, H, S, D] over each
        row's cached positions 0..position_ids[b, s] through block_table. Returns [B, S, H, D]."""
        heads, dim = q.shape[1], q.shape[3]
        return self.attend_heads_last(cache, layer, q.transpose(1, 2), index).unflatten(
            -1, (heads, dim))

    def attend_heads_last(self, cache, layer: int, q, index):
        """attend() for q [B, S, H, D] (rope_qk_store's layout), to [B, S, H * D] (o_proj's):
        nxdi::paged_decode_attention_layer reads the layer's K and V from the whole cache, so the
        traced graph holds one node, not the cache's four selects around the kernel."""
        return torch.ops.nxdi.paged_decode_attention_layer(q, cache, layer, index[3], index[1],
                                                           self.head_dim ** -0.5)


def write_prompt_range(cache_kv: torch.Tensor, block_table: list[int], start: int,
                       data: torch.Tensor, heads: slice = slice(None)) -> None:
    """Copy ``data`` [layers', tokens, heads', D] (one sequence's positions ``start`` onwards,
    in the cache's dtype) into ``cache_kv`` [layers', num_blocks + 1, block_size, kv_heads, D]
    (K or V of those layers in the block layout) through the sequence's ``block_table``.

    The whole blocks of the range are copied as opaque rows of bytes, one memmove each (see
    _copy_block_rows); the partial blocks at its ends, and every block when only some heads
    are written, by slice. A KV transfer's chunk is mostly whole blocks: for a 1024-token
    prompt the per-token scatter this replaced (index_put over slots) took ~4x as long."""
    block_size = cache_kv.shape[2]
    end = start + data.shape[1]
    all_heads = range(*heads.indices(cache_kv.shape[3])) == range(cache_kv.shape[3])
    full_start = min(-(-start // block_size) * block_size, end)
    full_end = max(end // block_size * block_size, full_start)
    pieces = [(start, full_start), (full_end, end)]
    if not (full_end > full_start and all_heads and _copy_block_rows(
            cache_kv, block_table[full_start // block_size:full_end // block_size],
            data[:, full_start - start:full_end - start])):
        pieces[1:1] = [(p, p + block_size) for p in range(full_start, full_end, block_size)]
    for lo, hi in pieces:
        if hi > lo:
            block, offset = block_table[lo // block_size], lo % block_size
            cache_kv[:, block, offset:offset + hi - lo, heads] = data[:, lo - start:hi - start]


class SequenceKVWriter:
    """Writes one sequence's received prompt KV, chunk after chunk, into its blocks of a block
    cache ``[L, 2, num_blocks + 1, block_size, kv_heads, D]`` (K at index 0, V at 1).

    write_prompt_range does the same one range at a time; this keeps what every chunk of one
    sequence shares (the block table as a tensor, whether our kernel can take the cache), so a
    chunk with every head costs one call of our kernel's write_prompt_kv for its K and V. A
    1024-token prompt arrives in 30 chunks of one layer each, and the per-call work this saves
    (~25 us of Python for each of K and V, more on a busy core) was a quarter of the time a
    chunk took on the decode worker."""

    def __init__(self, cache: torch.Tensor, block_table: list[int]):
        if cache.dim() != 6 or cache.shape[1] != 2:
            raise ValueError(f"cache must be [layers, 2, blocks, block_size, kv_heads, head_dim], "
                             f"got {tuple(cache.shape)}")
        self.cache, self.table = cache, list(block_table)
        self.num_heads = cache.shape[4]
        self.ids = torch.tensor(self.table, dtype=torch.long)
        self.kernel = (cache[0, 0, 0].is_contiguous()
                       and kernels.kernels_unavailable_reason() is None)

    def write(self, layers: slice, start: int, k: torch.Tensor, v: torch.Tensor,
              heads: slice = slice(None)) -> None:
        """``cache[layers, 0]`` and ``cache[layers, 1]`` at positions ``start`` onwards (and
        ``heads``) := ``k`` and ``v``, each ``[layers', tokens, heads', D]`` in the cache's dtype."""
        if (self.kernel and heads.start in (None, 0) and heads.stop in (None, self.num_heads)
                and heads.step in (None, 1) and layers.step in (None, 1)
                and k.is_contiguous() and v.is_contiguous()):
            torch.ops.nxdi.write_prompt_kv(self.cache, layers.start or 0, self.ids, start, k, v)
            return
        for which, data in ((0, k), (1, v)):
            write_prompt_range(self.cache[layers, which], self.table, start, data, heads)


def _copy_block_rows(cache_kv: torch.Tensor, blocks: list[int], data: torch.Tensor) -> bool:
    """``cache_kv[:, blocks] = data`` (data [layers', len(blocks) * block_size, H, D]), a block
    at a time: our kernel's copy_blocks where it is built (non-temporal stores: ~2x faster into
    a cold pool), else with each block a numpy void element (numpy's fancy assignment copies a
    block with one memmove, where torch's index_copy_ / index_put went element by element, ~2.3x
    slower). False (nothing written) when a block of ``cache_kv`` is not one contiguous row."""
    if cache_kv[0, 0].is_contiguous() and kernels.kernels_unavailable_reason() is None:
        src = data.reshape(data.shape[0], len(blocks), *cache_kv.shape[2:])
        torch.ops.nxdi.copy_blocks(cache_kv, torch.tensor(blocks, dtype=torch.long), src)
        return True
    return _copy_block_rows_numpy(cache_kv, blocks, data)


def _copy_block_rows_numpy(cache_kv: torch.Tensor, blocks: list[int], data: torch.Tensor) -> bool:
    """_copy_block_rows without our kernel."""
    dst = cache_kv.view(torch.uint8).numpy()
    layers, num_blocks = dst.shape[:2]
    row = dst[0, 0].nbytes
    rows = dst.reshape(layers, num_blocks, row).view(np.dtype((np.void, row)))[..., 0]
    if rows.__array_interface__["data"][0] != cache_kv.data_ptr():
        return False  # reshape had to copy: writing there would not reach the cache
    src = data.reshape(layers, len(blocks), -1).view(torch.uint8).numpy()
    rows[:, np.asarray(blocks, dtype=np.intp)] = src.view(np.dtype((np.void, row)))[..., 0]
    return True


def make_kv_cache_manager(neuron_config, num_layers: int, kv_heads: int, head_dim: int):
    """The cache manager the config asks for (block when is_block_kv_layout, else flat)."""
    dtype, compute = kv_cache_dtype(neuron_config), neuron_config.torch_dtype
    if getattr(neuron_config, "is_block_kv_layout", False):
        return BlockKVCacheManager(num_layers, neuron_config.pa_num_blocks, neuron_config.pa_block_size,
                                   kv_heads, head_dim, dtype, compute)
    return KVCacheManager(num_layers, neuron_config.max_batch_size, kv_heads,
                          neuron_config.seq_len, head_dim, dtype, compute)
