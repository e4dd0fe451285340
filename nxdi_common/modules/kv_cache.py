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
  for padding slots.

With `kv_cache_quant` the cache holds float8_e4m3fn and is cast back to the compute dtype on read.
"""
from __future__ import annotations

import torch

K, V = 0, 1


def kv_cache_dtype(neuron_config) -> torch.dtype:
    """float8_e4m3fn when kv_cache_quant is on, else the compute dtype."""
    if getattr(neuron_config, "kv_cache_quant", False):
        return torch.float8_e4m3fn
    return neuron_config.torch_dtype


class KVCacheManager:
    """Flat per-sequence KV layout addressed by seq_ids and positions."""

    is_block = False

    def __init__(self, num_layers: int, max_batch_size: int, kv_heads: int, seq_len: int,
                 head_dim: int, dtype: torch.dtype, compute_dtype: torch.dtype):
        self.shape = (num_layers, 2, max_batch_size + 1, kv_heads, seq_len, head_dim)
        self.scratch_row = max_batch_size
        self.dtype, self.compute_dtype = dtype, compute_dtype

    def allocate(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype)

    def write(self, cache, layer: int, k, v, index) -> None:
        """Store k, v [B, Hkv, S, D] at (seq_ids [B], position_ids [B, S]) of `index`."""
        seq_ids, position_ids = index[0], index[1]
        rows = seq_ids.long().unsqueeze(1)  # [B, 1]
        for which, value in ((K, k), (V, v)):
            # Advanced indices on dims 0 and 2 put [B, S] first: values are [B, S, Hkv, D].
            cache[layer, which][rows, :, position_ids] = self._store(value)

    def read(self, cache, layer: int, index, length: int):
        """k, v [B, Hkv, length, D] for the rows seq_ids, in the compute dtype."""
        seq_ids = index[0].long()
        k = cache[layer, K][:, :, :length].index_select(0, seq_ids)  # copies only `length`
        v = cache[layer, V][:, :, :length].index_select(0, seq_ids)
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def _store(self, value):
        return value.transpose(1, 2).to(self.dtype)


class BlockKVCacheManager:
    """Block (paged) KV layout: writes by slot_mapping, reads by block_table."""

    is_block = True

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, compute_dtype: torch.dtype):
        self.shape = (num_layers, 2, num_blocks + 1, block_size, kv_heads, head_dim)
        self.block_size, self.scratch_block = block_size, num_blocks
        self.dtype, self.compute_dtype = dtype, compute_dtype

    def allocate(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype)

    def write(self, cache, layer: int, k, v, index) -> None:
        """Store k, v [B, Hkv, S, D] at slot_mapping [B, S] (index[2])."""
        slots = index[2].reshape(-1).long()
        for which, value in ((K, k), (V, v)):
            flat = cache[layer, which].view(-1, value.shape[1], value.shape[3])  # [NB*BS, Hkv, D]
            rows = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[3])
            flat.index_copy_(0, slots, rows.to(self.dtype))

    def read(self, cache, layer: int, index, length: int):
        """Gather block_table [B, length / block_size] (index[3]) into k, v [B, Hkv, length, D]."""
        table = index[3].long()
        b, nb = table.shape
        flat = table.reshape(-1)
        out = []
        for which in (K, V):
            # index_select on the block dim copies each block once (about 4x faster here than
            # advanced indexing cache[table], which dominated token generation at long lengths).
            blocks = cache[layer, which].index_select(0, flat)  # [B * NBt, BS, Hkv, D]
            _, bs, h, d = blocks.shape
            out.append(blocks.view(b, nb * bs, h, d).transpose(1, 2).to(self.compute_dtype))
        return out[0], out[1]


def make_kv_cache_manager(neuron_config, num_layers: int, kv_heads: int, head_dim: int):
    """The cache manager the config asks for (block when is_block_kv_layout, else flat)."""
    dtype, compute = kv_cache_dtype(neuron_config), neuron_config.torch_dtype
    if getattr(neuron_config, "is_block_kv_layout", False):
        return BlockKVCacheManager(num_layers, neuron_config.pa_num_blocks, neuron_config.pa_block_size,
                                   kv_heads, head_dim, dtype, compute)
    return KVCacheManager(num_layers, neuron_config.max_batch_size, kv_heads,
                          neuron_config.seq_len, head_dim, dtype, compute)
