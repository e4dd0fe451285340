"""The prefill worker's prefix cache: its prompts' KV kept in blocks, so a prompt that starts
with one computed before (a long system prompt, a document asked about again, the earlier turns
of a chat, the shared prompt of n choices) has only its new tokens computed.

Without it a prefill worker computed every prompt whole, and a decode worker that already held
the prefix computed the rest itself only while that rest was short (its
--local-prefill-uncached-tokens): a 1024-token shared prefix with a 200-token question cost the
prefill worker the whole 1224 tokens each time. With it, the worker's model has a block KV cache
(``worker.prefill_neuron_config(prefix_cache_blocks=...)``) managed by a
:class:`~nxdi_common.block_manager.BlockManager`: a batch allocates each prompt's blocks (sealed
blocks of an equal prefix are shared), prompts with nothing cached are encoded together by
context encoding as before (their slots in the blocks), each prompt with a cached prefix has the
rest encoded by the chunked-prefill sub-model in pieces (:func:`pieces`), the KV the caller asked
for is gathered out of the blocks, and the blocks are released: sealed ones stay in the hash
index until allocation evicts them, least recently released first.

A prompt to score (prompt_logprobs) is computed whole (its scores need every position's hidden
state); the positions of a shared prefix write to the scratch slot, never over the shared
blocks. Torch work; the worker thread only."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nxdi_common.block_manager import BlockManager


def pieces(start: int, end: int, sizes: list[int]) -> list[tuple[int, int]]:
    """Split prompt positions [start, end) into chunked-prefill calls (sizes ascending): each
    the largest size the rest fills, the last what is left (padded by the model to the smallest
    size that holds it). With sizes (32, 64, ..., 512): 284 tokens -> 256 + 28 (in 32)."""
    out = []
    while start < end:
        rest = end - start
        fits = [s for s in sizes if s <= rest]
        take = fits[-1] if fits else rest
        out.append((start, start + take))
        start += take
    return out


@dataclass
class Entry:
    """One prompt of a batch in the cache: its block table, and the leading positions read from
    the cache instead of computed (0 when the prompt runs whole)."""

    request_id: str
    prompt_ids: list[int]
    table: list[int]
    cached: int  # shared prefix tokens its blocks hold (allocation's num_cached_tokens)
    reuse: int  # of those, the ones not computed again (0 for a prompt run whole)


class PrefixCache:
    """Block bookkeeping and KV gathering for a prefill worker's block KV cache."""

    def __init__(self, model, num_blocks: int, block_size: int):
        nc = model.neuron_config
        if not nc.is_block_kv_layout or nc.prefill_chunk_size is None:
            raise ValueError("a prefix cache needs a block KV layout model with chunked prefill "
                             "(worker.prefill_neuron_config(prefix_cache_blocks=...))")
        self.model = model
        self.blocks = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.sizes = sorted(model.chunk_models)
        self.scratch_slot = model.scratch[1] * block_size

    def admit(self, request_id: str, prompt_ids: list[int], whole: bool,
              salt: str = "") -> Entry:
        """Allocate a prompt's blocks (OutOfBlocks when the pool cannot hold them: it holds any
        batch the worker's settings allow, PrefillSettings checks that). whole: compute every
        position (a prompt to score); salt: the request's cache salt (shares only with its
        own)."""
        alloc = self.blocks.allocate(request_id, prompt_ids, salt=salt)
        cached = alloc.num_cached_tokens
        return Entry(request_id, list(prompt_ids), alloc.block_table, cached,
                     0 if whole else cached)

    def cached_tokens(self, prompt_ids: list[int], whole: bool = False, salt: str = "") -> int:
        """Leading tokens of the prompt the cache holds now and admit would not compute (0 for
        a prompt run whole); an estimate from another thread (BlockManager.cached_prefix_tokens)."""
        return 0 if whole else self.blocks.cached_prefix_tokens(prompt_ids, salt)

    def release(self, entry: Entry, computed: bool) -> None:
        """The prompt's blocks back to the pool; computed: its KV is all written, so its full
        blocks are sealed and a later prompt may share them."""
        if computed:
            self.blocks.mark_computed(entry.request_id, len(entry.prompt_ids))
        self.blocks.free(entry.request_id)

    def slots(self, entry: Entry, start: int, end: int) -> list[int]:
        """Slots of positions [start, end); a cached position computed again (a prompt run
        whole) writes to the scratch slot, not over the shared block."""
        slots = self.blocks.slot_mapping(entry.request_id, start, end)
        return [self.scratch_slot if p < entry.cached else s
                for p, s in zip(range(start, end), slots)]

    def context_args(self, entries: list[Entry], width: int) -> dict:
        """slot_mapping [B, width] and block_table [B, blocks] of a context-encoding batch whose
        input_ids are right-padded to ``width`` (padding writes to the scratch slot)."""
        rows = [self.slots(e, 0, len(e.prompt_ids)) for e in entries]
        slots = torch.tensor([r + [self.scratch_slot] * (width - len(r)) for r in rows])
        return dict(slot_mapping=slots, block_table=self._table(entries))

    def piece_args(self, entry: Entry, start: int, end: int) -> dict:
        """forward() arguments (but sampling) of one chunked-prefill piece [start, end)."""
        return dict(input_ids=torch.tensor([entry.prompt_ids[start:end]]),
                    seq_ids=torch.tensor([0], dtype=torch.int32),
                    position_ids=torch.arange(start, end).unsqueeze(0),
                    slot_mapping=torch.tensor([self.slots(entry, start, end)]),
                    block_table=self._table([entry]))

    def _table(self, entries: list[Entry]) -> torch.Tensor:
        width = max(len(e.table) for e in entries)
        scratch = self.model.scratch[1]
        return torch.tensor([e.table + [scratch] * (width - len(e.table)) for e in entries])

    def copy_kv(self, entry: Entry, tokens: tuple[int, int],
                heads: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [t0, n), heads [h0, h1), gathered out of the prompt's blocks
        as new tensors [layers, tokens, heads, head_dim]."""
        (t0, n), (h0, h1) = tokens, heads
        slots = torch.tensor(self.blocks.slot_mapping(entry.request_id, t0, n))
        cache = self.model.kv_cache  # [L, 2, blocks + 1, block_size, kv_heads, head_dim]
        flat = cache.flatten(2, 3)  # [L, 2, slots, kv_heads, head_dim]
        if flat.dtype == torch.float8_e4m3fn:  # index_select has no float8 kernel
            flat = flat.view(torch.uint8)
        kv = flat.index_select(2, slots)[:, :, :, h0:h1]  # a copy: never a view of the cache
        k, v = (kv[:, which].contiguous().view(cache.dtype) for which in (0, 1))
        return k, v
