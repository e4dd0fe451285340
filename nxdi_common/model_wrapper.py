"""ModelWrapper: one sub-model (context encoding, token generation, chunked prefill, or a chunk
and a decode step together) of an
application, with its buckets, the example inputs it is traced with (`input_generator`), and the per-call bucket choice
and padding. The torch model and its weights are shared by all wrappers of an application."""
from __future__ import annotations

import torch

from nxdi_common import bucketing

CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"
# extension (NeuronConfig.prefill_chunk_size): up to prefill_chunk_size prompt tokens of one
# sequence from any position, over the cache like token generation
CHUNKED_PREFILL_MODEL_TAG = "chunked_prefill_model"
# extension: a chunk of one prompt and one token for each of a batch of decode rows in one call
# (NeuronBaseModel.forward's `mixed`), bucketed by (decode rows, length) like token generation;
# one such sub-model per chunk length (NeuronConfig.mixed_chunk_buckets), see mixed_model_tag
MIXED_MODEL_TAG = "chunked_prefill_decode_model"


def chunk_model_tag(chunk: int, neuron_config) -> str:
    """The chunked-prefill sub-model's tag for pieces of `chunk` tokens (one per
    NeuronConfig.mixed_chunk_buckets size, as the mixed ones): CHUNKED_PREFILL_MODEL_TAG for
    prefill_chunk_size, else the tag with the length appended."""
    if chunk == neuron_config.prefill_chunk_size:
        return CHUNKED_PREFILL_MODEL_TAG
    return f"{CHUNKED_PREFILL_MODEL_TAG}_{chunk}"


def mixed_model_tag(chunk: int, neuron_config) -> str:
    """The mixed sub-model's tag for chunks of `chunk` tokens: MIXED_MODEL_TAG for
    prefill_chunk_size, else the tag with the length appended."""
    if chunk == neuron_config.prefill_chunk_size:
        return MIXED_MODEL_TAG
    return f"{MIXED_MODEL_TAG}_{chunk}"


def _pad(t: torch.Tensor, dim: int, size: int, value) -> torch.Tensor:
    """Pad t along dim up to size with a constant value."""
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype)], dim=dim)


class ModelWrapper:
    """A sub-model compiled per (batch, length) bucket. `runnables` maps a bucket key to a callable
    taking (*graph_inputs, kv_cache, weights), installed by a backend."""

    def __init__(self, config, model_cls, tag: str, compiler_args: str | None = None,
                 chunk: int | None = None):
        """chunk: a chunked-prefill or mixed sub-model's chunk length (default
        prefill_chunk_size)."""
        self.config, self.neuron_config = config, config.neuron_config
        self.model_cls, self.tag, self.compiler_args = model_cls, tag, compiler_args
        self.is_context = tag == CONTEXT_ENCODING_MODEL_TAG
        self.is_chunk = tag.startswith(CHUNKED_PREFILL_MODEL_TAG)
        self.is_mixed = tag.startswith(MIXED_MODEL_TAG)
        nc = self.neuron_config
        # tokens per row of a call: the length bucket for context encoding, else static (for a
        # mixed call, the chunk's; its decode rows have one each)
        self.queries = 1
        if self.is_chunk or self.is_mixed:
            self.queries = chunk or nc.prefill_chunk_size
        if self.is_context:
            self.length_buckets = bucketing.context_encoding_buckets(nc)
            self.batch_buckets = self._context_batch_buckets(nc)
        elif self.is_chunk:  # one sequence at a time, over the token-generation cache lengths
            self.length_buckets = bucketing.token_generation_buckets(nc)
            self.batch_buckets = [1]
        else:
            self.length_buckets = bucketing.token_generation_buckets(nc)
            self.batch_buckets = (bucketing.mixed_batch_buckets(nc) if self.is_mixed
                                  else bucketing.token_generation_batch_buckets(nc))
        self.model = None
        self.runnables: dict[tuple[int, int], object] = {}

    @staticmethod
    def _context_batch_buckets(nc) -> list[int]:
        if nc.is_continuous_batching and nc.enable_bucketing:
            return bucketing.generate_buckets(1, nc.ctx_batch_size) if nc.ctx_batch_size > 1 else [1]
        return [nc.ctx_batch_size]

    def bucket_keys(self) -> list[tuple[int, int]]:
        """(batch, length) buckets; for context encoding, batches of several prompts only within
        neuron_config.max_context_batch_tokens."""
        budget = self.neuron_config.max_context_batch_tokens if self.is_context else None
        return [(b, n) for b in self.batch_buckets for n in self.length_buckets
                if budget is None or b == self.batch_buckets[0] or b * n <= budget]

    def max_batch(self, length_bucket: int) -> int:
        """The largest batch bucket with a bucket of this length."""
        return max(b for b, n in self.bucket_keys() if n == length_bucket)

    def kv_len(self, length: int) -> int | None:
        """Static cache length a token-generation bucket attends over (None for context)."""
        if self.is_context:
            return None
        bs = self.neuron_config.pa_block_size if self.neuron_config.is_block_kv_layout else 1
        return -(-length // bs) * bs

    def input_generator(self) -> list[tuple[torch.Tensor, ...]]:
        """Example graph inputs, one tuple per bucket, in bucket_keys() order."""
        return [self.example_inputs(b, n) for b, n in self.bucket_keys()]

    def example_inputs(self, batch: int, length: int) -> tuple[torch.Tensor, ...]:
        if self.is_mixed:
            return self._mixed_example(batch, length)
        s = length if self.is_context else self.queries
        first = 0 if self.is_context else length - s
        positions = torch.arange(first, first + s).clamp(min=0).expand(batch, s)
        table_width = max(1, (self.kv_len(length) or length) // self._block_size())
        return (torch.zeros(batch, s, dtype=torch.long), torch.ones(batch, s, dtype=torch.long),
                positions.contiguous(), torch.arange(batch, dtype=torch.int32),
                torch.ones(batch, 3), torch.zeros(batch), torch.zeros(batch, s, dtype=torch.long),
                torch.zeros(batch, table_width, dtype=torch.long))

    def _mixed_example(self, rows: int, length: int) -> tuple[torch.Tensor, ...]:
        """A chunk ending at position length - 1 and `rows` decode rows at that position."""
        c, width = self.queries, max(1, self.kv_len(length) // self._block_size())
        positions = torch.cat([torch.arange(length - c, length).clamp(min=0),
                               torch.full((rows,), length - 1)]).unsqueeze(0)
        return (torch.zeros(1, c + rows, dtype=torch.long),
                torch.ones(1, c + rows, dtype=torch.long), positions,
                torch.arange(rows + 1, dtype=torch.int32), torch.ones(rows + 1, 3),
                torch.zeros(rows + 1), torch.zeros(1, c + rows, dtype=torch.long),
                torch.zeros(rows + 1, width, dtype=torch.long))

    def _block_size(self) -> int:
        return self.neuron_config.pa_block_size if self.neuron_config.is_block_kv_layout else 1

    def select_bucket(self, batch: int, needed_length: int) -> tuple[int, int]:
        what = "prompt length" if self.is_context else "sequence length"
        if self.is_chunk and batch > 1:
            raise ValueError(f"chunked prefill runs one sequence per call, got a batch of {batch}")
        length = bucketing.select_bucket(needed_length, self.length_buckets, what)
        batches = [b for b in self.batch_buckets if b <= self.max_batch(length)]
        if batches[-1] < batch <= self.batch_buckets[-1]:
            budget = self.neuron_config.max_context_batch_tokens
            raise ValueError(f"batch size {batch} of {length}-token prompts is over "
                             f"max_context_batch_tokens ({budget}): at most {batches[-1]} "
                             f"prompts of that length run together")
        return bucketing.select_bucket(batch, batches, "batch size"), length

    def graph_fn(self, length: int, weights_as_inputs: bool = True):
        """The function run for a bucket: (*8 graph inputs, kv_cache, weights) -> outputs. With
        weights_as_inputs the model's parameters are taken from `weights` (for tracing); without,
        the module's own parameters are used and `weights` is ignored (eager)."""
        from nxdi_common.backends.weights import swapped_parameters
        model, kw = self.model, {"kv_len": self.kv_len(length)}
        if self.is_mixed:
            kw["mixed"] = self.queries

        def run(*args):
            *inputs, kv_cache, weights = args
            if not weights_as_inputs:
                return model(*inputs, kv_cache, **kw)
            with swapped_parameters(model, weights):
                return model(*inputs, kv_cache, **kw)
        return run

    def __call__(self, inputs: tuple, kv_cache, weights, scratch: tuple[int, int],
                 needed: int | None = None, all_positions: bool = False):
        """Pad `inputs` (the 8 graph inputs, unpadded) to the chosen bucket, run, unpad. A mixed
        call's batch is its decode rows (block_table's rows after the chunk's); its outputs keep
        the chunk's row first. needed: the sequence length the bucket must hold (default: the
        prompt's for context encoding, else the largest position + 1). all_positions (context
        encoding and chunks): run the model eagerly, on the same padded inputs as the bucket's
        graph, for every position's final hidden state (NeuronBaseModel.forward); its rows and
        positions are those of the bucket (the caller takes the real ones)."""
        batch = inputs[7].shape[0] - 1 if self.is_mixed else inputs[0].shape[0]
        if needed is None:
            needed = inputs[0].shape[1] if self.is_context else int(inputs[2].max()) + 1
        key = self.select_bucket(batch, needed)
        pad = self._pad_mixed_inputs if self.is_mixed else self._pad_inputs
        if all_positions:
            if self.is_mixed:
                raise ValueError("all_positions runs a context or a chunk, not a mixed call")
            kw = {"kv_len": self.kv_len(key[1]), "all_positions": True}
            return self.model(*pad(inputs, key, scratch), kv_cache, **kw)
        outputs = self.runnables[key](*pad(inputs, key, scratch), kv_cache, weights)
        rows = batch + 1 if self.is_mixed else batch
        if all(o.shape[0] == rows for o in outputs):  # the batch filled its bucket
            return tuple(outputs)
        return tuple(o[:rows] for o in outputs)

    def _pad_inputs(self, inputs, key, scratch):
        """Pad rows with the scratch sequence slot and columns with padding tokens; padded
        positions of a real row continue its positions in context encoding and repeat its last
        one in a chunk (which attends over the cache: it must stay within the length bucket).
        Padding tokens write to the scratch block and are never attended to."""
        b, n = key
        ids, mask, pos, seq, params, rand, slots, table = inputs
        s = n if self.is_context else self.queries
        width = max(1, (self.kv_len(n) or n) // self._block_size())
        scratch_row, scratch_block = scratch
        slot_fill = scratch_block * self._block_size()
        step = 1 if self.is_context else 0
        if s > pos.shape[1]:
            more = torch.arange(1, s - pos.shape[1] + 1)
            pos = torch.cat([pos, pos[:, -1:] + step * more], dim=1)
        rows = [_pad(_pad(ids, 1, s, 0), 0, b, 0), _pad(_pad(mask, 1, s, 0), 0, b, 0),
                _pad(pos, 0, b, 0), _pad(seq, 0, b, scratch_row), _pad(params, 0, b, 1.0),
                _pad(rand, 0, b, 0.0), _pad(_pad(slots, 1, s, slot_fill), 0, b, slot_fill),
                _pad(_pad(table[:, :width] if table.shape[1] > width else table, 1, width,
                          scratch_block), 0, b, scratch_block)]
        return tuple(rows)

    def _pad_mixed_inputs(self, inputs, key, scratch):
        """A mixed call's inputs padded to bucket key = (decode rows, length): the chunk to
        `queries` tokens as a chunk call pads it, the decode rows as a token-generation call
        pads its batch (scratch row, scratch block, position 0)."""
        b, n = key
        ids, mask, pos, seq, params, rand, slots, table = inputs
        rows = table.shape[0] - 1
        c, s = ids.shape[1] - rows, self.queries
        width = max(1, self.kv_len(n) // self._block_size())
        scratch_row, scratch_block = scratch
        slot_fill = scratch_block * self._block_size()

        def tokens(t, chunk_fill, row_fill):
            return torch.cat([_pad(t[:, :c], 1, s, chunk_fill), _pad(t[:, c:], 1, b, row_fill)], 1)
        chunk_pos = pos[:, :c]
        pos = torch.cat([chunk_pos, chunk_pos[:, -1:].expand(1, s - c), _pad(pos[:, c:], 1, b, 0)], 1)
        return (tokens(ids, 0, 0), tokens(mask, 0, 0), pos, _pad(seq, 0, b + 1, scratch_row),
                _pad(params, 0, b + 1, 1.0), _pad(rand, 0, b + 1, 0.0),
                tokens(slots, slot_fill, slot_fill),
                _pad(_pad(table[:, :width], 1, width, scratch_block), 0, b + 1, scratch_block))
