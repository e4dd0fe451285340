"""NeuronBaseForCausalLM: a causal LM made of a context-encoding (CTE) and a token-generation (TKG)
sub-model sharing one KV cache. forward() routes sequences that start at position 0 to CTE and the
rest to TKG (NxD Inference API reference, "NeuronBaseForCausalLM"). Extension: with
NeuronConfig.prefill_chunk_size a third sub-model encodes a piece of a prompt that starts past
position 0 (several tokens with explicit position_ids), attending to the positions before it in
the cache: chunked prefill, so a long prompt can be encoded between token-generation steps; and
a fourth runs such a piece and a token-generation step together in one call (forward_mixed),
reading the weights once for both. Both come in one size per NeuronConfig.mixed_chunk_buckets
length (default: prefill_chunk_size alone); a piece runs in the smallest that holds it."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nxdi_common.application_base import NeuronApplicationBase
from nxdi_common.models.base import GRAPH_INPUT_NAMES
from nxdi_common.model_wrapper import (CONTEXT_ENCODING_MODEL_TAG, TOKEN_GENERATION_MODEL_TAG,
                                       ModelWrapper, chunk_model_tag, mixed_model_tag)
from nxdi_common.modules.sampling import SamplingRandomSource, sampling_params_from_config


# The forward() arguments each part of a forward_mixed call may hold.
MIXED_ARGS = frozenset({"input_ids", "position_ids", "seq_ids", "sampling_params", "slot_mapping",
                        "block_table", "rand"})
MAX_CONSTANTS = 256  # NeuronBaseForCausalLM._constant's entries (a few per batch size in use)


@dataclass
class CausalLMOutput:
    """tokens [B] when sampling on device; logits [B, vocab] float32 of the last position when not
    sampling on device, or when output_logits is set."""

    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


class NeuronBaseForCausalLM(NeuronApplicationBase):
    """Application class for text generation with CTE and TKG sub-models."""

    def __init__(self, model_path, config=None, neuron_config=None):
        super().__init__(model_path, config, neuron_config)
        args = self.get_compiler_args()
        self.context_encoding_model = ModelWrapper(self.config, self._model_cls,
                                                   CONTEXT_ENCODING_MODEL_TAG, args)
        self.token_generation_model = ModelWrapper(self.config, self._model_cls,
                                                   TOKEN_GENERATION_MODEL_TAG, args)
        self.models = [self.context_encoding_model, self.token_generation_model]
        self.warmup_seconds: dict[tuple[str, tuple[int, int]], float] = {}  # warmup()
        self.chunked_prefill_model = self.mixed_model = None
        # the chunked-prefill and mixed sub-models by chunk length
        # (NeuronConfig.mixed_chunk_buckets); chunked_prefill_model and mixed_model are the ones
        # for prefill_chunk_size. A piece runs in the smallest that holds it.
        self.chunk_models: dict[int, ModelWrapper] = {}
        self.mixed_models: dict[int, ModelWrapper] = {}
        nc = self.neuron_config
        if nc.prefill_chunk_size is not None:
            sizes = nc.mixed_chunk_buckets or [nc.prefill_chunk_size]
            self.chunk_models = {
                c: ModelWrapper(self.config, self._model_cls, chunk_model_tag(c, nc), args, c)
                for c in sizes}
            if nc.mixed_steps:
                self.mixed_models = {
                    c: ModelWrapper(self.config, self._model_cls, mixed_model_tag(c, nc), args, c)
                    for c in sizes}
                self.mixed_model = self.mixed_models[nc.prefill_chunk_size]
            self.chunked_prefill_model = self.chunk_models[nc.prefill_chunk_size]
            self.models += [*self.chunk_models.values(), *self.mixed_models.values()]
        odsc = self.neuron_config.on_device_sampling_config
        self.random_source = SamplingRandomSource.from_config(odsc) if odsc else None
        self.kv_cache = None
        self.kv_cache_populated = False
        # each cache row's next position, in Python: a decode step's few values are read and
        # written without a tensor op (see _run_token_gen)
        self._next = [0] * self.neuron_config.max_batch_size
        # small inputs that never change for their key (_constant): one tensor op less each
        self._constants: dict[tuple, object] = {}

    @property
    def next_positions(self) -> torch.Tensor:
        """[max_batch_size] each cache row's next position (a copy)."""
        return torch.tensor(self._next, dtype=torch.long)

    def _constant(self, key: tuple, make):
        """make()'s value, made once per key: small graph inputs that depend only on the key
        (the graphs never write their inputs). At most MAX_CONSTANTS are kept."""
        value = self._constants.get(key)
        if value is None:
            if len(self._constants) >= MAX_CONSTANTS:
                self._constants.clear()
            value = self._constants[key] = make()
        return value

    def _on_loaded(self) -> None:
        self.kv_cache = self._model.kv_mgr.allocate()
        self.reset()
        if not self.neuron_config.skip_warmup:
            self.warmup()
        self.reset_kv_cache()

    @torch.no_grad()
    def warmup(self) -> None:
        """Run every bucket twice so the first requests do not pay one-time costs (TorchScript's
        executor profiles a graph on its first call and optimizes it on the second); the second
        call's seconds are kept (warmup_seconds, warmup_prefill_rate)."""
        for wrapper in self.models:
            for key, example in zip(wrapper.bucket_keys(), wrapper.input_generator()):
                for _ in range(2):
                    began = time.perf_counter()
                    wrapper.runnables[key](*example, self.kv_cache, self.weights)
                self.warmup_seconds[(wrapper.tag, key)] = time.perf_counter() - began

    def warmup_prefill_rate(self, tokens: int) -> float | None:
        """Prompt tokens per second a context encoding of one ``tokens``-token prompt went at
        in warm-up (its bucket's second call; the threads the model was loaded with): what this
        process prefills at before it has served a prompt. None without a warm-up or a bucket
        that holds it."""
        cte = self.context_encoding_model
        lengths = [n for b, n in cte.bucket_keys() if b == 1 and n >= tokens]
        seconds = (self.warmup_seconds.get((cte.tag, (1, min(lengths))))
                   if lengths and tokens > 0 else None)
        return tokens / seconds if seconds else None

    def warmup_step_seconds(self) -> float | None:
        """Seconds a token-generation call for one sequence took in warm-up (the smallest
        batch and length buckets' second call): a decode step's time before one is measured.
        None without a warm-up."""
        tkg = self.token_generation_model
        keys = tkg.bucket_keys()
        return self.warmup_seconds.get((tkg.tag, min(keys))) if keys else None

    def reset(self) -> None:
        """After a reset the next forward runs context encoding."""
        self.kv_cache_populated = False
        self._next = [0] * self.neuron_config.max_batch_size
        if self.random_source is not None:
            self.random_source.reset()

    def reset_kv_cache(self) -> None:
        """Zero the KV cache (and reset)."""
        if self.kv_cache is not None:
            self.kv_cache.zero_()
        self.reset()

    @property
    def scratch(self) -> tuple[int, int]:
        mgr = self._model.kv_mgr
        return getattr(mgr, "scratch_row", 0), getattr(mgr, "scratch_block", 0)

    @torch.no_grad()
    def forward(self, input_ids=None, seq_ids=None, attention_mask=None, position_ids=None,
                sampling_params=None, prev_hidden=None, past_key_values=None, inputs_embeds=None,
                labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                medusa_args=None, return_dict=None, input_capture_hook=None, slot_mapping=None,
                block_table=None, rand=None) -> CausalLMOutput:
        """Run CTE when the sequences start at position 0 (or the cache is empty), else TKG; a
        sequence of several tokens with position_ids past 0 runs the chunked-prefill sub-model
        (prefill_chunk_size). input_ids [B, S]; seq_ids [B] (cache rows, default 0..B-1); attention_mask [B, S] (left or
        right padding); sampling_params [B, 3] (top_k, top_p, temperature); slot_mapping [B, S]
        and block_table [B, blocks] for the block KV layout (default: contiguous blocks per row);
        rand [B] float32 uniforms in [0, 1) for the sampler (default: drawn by random_source)."""
        if self.kv_cache is None:
            raise RuntimeError("model is not loaded: call to_cpu(), or compile() then load()")
        for name, value in (("inputs_embeds", inputs_embeds), ("labels", labels),
                            ("medusa_args", medusa_args), ("prev_hidden", prev_hidden)):
            if value is not None:
                raise NotImplementedError(f"{name} is not supported by this model")
        if input_capture_hook is not None:
            input_capture_hook(self, [input_ids, attention_mask, position_ids, seq_ids, sampling_params])
        seq_ids = self._seq_ids(input_ids, seq_ids)
        # the positions as Python ints, read once: the checks and bookkeeping below need no
        # tensor op (each costs ~10 us right after a step has streamed the weights through the
        # caches, BENCHMARKS.md session 31)
        if position_ids is not None and position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [batch, seq] like input_ids, got shape "
                             f"{list(position_ids.shape)}")
        rows = None if position_ids is None else position_ids.tolist()
        if self._is_context(input_ids, rows):
            return self._run_context(input_ids, attention_mask, seq_ids, sampling_params,
                                     slot_mapping, block_table, rand)
        if input_ids.shape[1] > 1 and position_ids is not None:
            return self._run_chunk(input_ids, position_ids, seq_ids, sampling_params,
                                   slot_mapping, block_table, rand)
        return self._run_token_gen(input_ids, position_ids, seq_ids, sampling_params, slot_mapping,
                                   block_table, rand, rows)

    @torch.no_grad()
    def forward_hidden(self, input_ids, seq_ids=None, attention_mask=None, position_ids=None,
                       slot_mapping=None, block_table=None) -> torch.Tensor:
        """Encode prompts like forward() (context encoding from position 0, or a chunk of one
        prompt past it, writing the KV cache the same way) and return every position's final
        hidden state (after the final norm), [B, S, hidden], instead of sampling from the last
        one: with lm_logits(), the log-probability of each prompt token given the ones before
        it (prompt logprobs, scoring). Extension. Runs the model eagerly on the inputs the
        bucket's graph would get (a rarely used path: no graph per bucket is compiled for it), so
        it needs the model's weights on the host: not with the neuron backend. Rows come
        right-aligned (each row's real tokens first, as forward() orders a left-padded batch)."""
        if self.kv_cache is None:
            raise RuntimeError("model is not loaded: call to_cpu(), or compile() then load()")
        if self.backend is not None and self.backend.name == "neuron":
            raise NotImplementedError("forward_hidden runs the model eagerly on the host; the "
                                      "neuron backend keeps the weights on the device")
        seq_ids = self._seq_ids(input_ids, seq_ids)
        rows = None if position_ids is None else position_ids.tolist()
        b = input_ids.shape[0]
        if rows is None or min(row[0] for row in rows) == 0:
            inputs, lengths = self._context_inputs(input_ids, attention_mask, seq_ids, None,
                                                   slot_mapping, block_table, torch.zeros(b))
            hidden = self.context_encoding_model(inputs, self.kv_cache, self.weights,
                                                 self.scratch, all_positions=True)
            for row, length in zip(seq_ids.tolist(), lengths.tolist()):
                self._next[row] = length
        else:
            if attention_mask is not None and not bool(attention_mask.bool().all()):
                raise ValueError("a prompt chunk has no padding: attention_mask must be all ones")
            inputs, model = self._chunk_inputs(input_ids, position_ids, seq_ids, None,
                                               slot_mapping, block_table, torch.zeros(b))
            hidden = model(inputs, self.kv_cache, self.weights, self.scratch, all_positions=True)
            self._advance(seq_ids, [row[-1] for row in inputs[2].tolist()])
        self.kv_cache_populated = True
        return hidden[0][:b, :inputs[0].shape[1]]

    @torch.no_grad()
    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [..., vocab] of final hidden states [..., hidden] (forward_hidden's),
        by the model's LM head run eagerly. Extension."""
        shape = hidden.shape
        flat = hidden.reshape(1, -1, shape[-1])  # [1, N, hidden]: the LM head's graph shape
        return self._model.lm_head(flat).float().reshape(*shape[:-1], -1)

    def _seq_ids(self, input_ids, seq_ids) -> torch.Tensor:
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("input_ids must be a [batch, seq] integer tensor")
        b = input_ids.shape[0]
        if seq_ids is None:
            seq_ids = self._constant(("seq_ids", b), lambda: torch.arange(b, dtype=torch.int32))
        elif seq_ids.dtype != torch.int32:
            seq_ids = seq_ids.to(torch.int32)
        limit = self.neuron_config.max_batch_size
        ids = seq_ids.tolist()  # a batch's few ints, checked in Python: no tensor op per check
        if (seq_ids.shape != (b,) or not ids or min(ids) < 0 or max(ids) >= limit
                or len(set(ids)) != b):
            raise ValueError(f"seq_ids must be {b} distinct ids in [0, {limit}) (max_batch_size); "
                             f"got {ids}")
        return seq_ids

    def _check_token_ids(self, ids) -> None:
        """Token ids must index the vocabulary (an out-of-range id fails deep in the embedding)."""
        vocab = self.config.vocab_size
        n = ids.numel()
        if not n:
            return
        if n <= 64:  # a decode step's few tokens: one tolist, not a reduction and two items
            values = [v for row in ids.tolist() for v in row]  # ids [B, S], as every caller's
            low, high = int(min(values)), int(max(values))
        else:
            low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is out of range: input_ids must be in [0, {vocab}) "
                             f"(vocab_size)")

    def _is_context(self, input_ids, rows) -> bool:
        """rows: position_ids as lists (None when not given)."""
        if rows is not None:
            return min(row[0] for row in rows) == 0
        return input_ids.shape[1] > 1 or not self.kv_cache_populated

    def _sampling_inputs(self, batch: int, sampling_params, rand=None):
        """sampling_params [B, 3] and rand [B] for the graph (the caller's rand when given)."""
        if sampling_params is None:
            sampling_params = self._config_params(batch)
        elif sampling_params.dtype != torch.float32:
            sampling_params = sampling_params.to(torch.float32)
        if rand is not None:
            if tuple(rand.shape) != (batch,):
                raise ValueError(f"rand must be [batch] = [{batch}] uniforms in [0, 1), "
                                 f"got shape {list(rand.shape)}")
            return sampling_params, rand if rand.dtype == torch.float32 else rand.to(torch.float32)
        rand = self.random_source.draw(batch) if self.random_source else torch.zeros(batch)
        return sampling_params, rand

    def _config_params(self, batch: int) -> torch.Tensor:
        """[batch, 3] sampling_params from the on-device sampling config (ones without one),
        kept per batch and config values: the graph only reads them."""
        odsc = self.neuron_config.on_device_sampling_config
        values = tuple(getattr(odsc, name, None) for name in ("top_k", "top_p", "temperature"))
        return self._constant(("params", batch, odsc is not None) + values, lambda: (
            sampling_params_from_config(odsc, batch) if odsc else torch.ones(batch, 3)))

    def _context_inputs(self, input_ids, attention_mask, seq_ids, sampling_params, slots,
                        table, rand):
        """The 8 graph inputs of a context-encoding call (rows right-aligned, trimmed to the
        longest) and each row's length."""
        ids, mask, lengths = right_align(input_ids, attention_mask)
        if slots is not None:  # the caller's slots follow input_ids' layout: move them alike
            slots = right_align(slots, attention_mask)[0]
        self._check_token_ids(ids)
        b, s = ids.shape
        positions = torch.arange(s).expand(b, s).contiguous()
        slots, table = self._block_indices(seq_ids, positions, mask, slots, table)
        params, rand = self._sampling_inputs(b, sampling_params, rand)
        return (ids, mask, positions, seq_ids, params, rand, slots, table), lengths

    def _run_context(self, input_ids, attention_mask, seq_ids, sampling_params, slots, table,
                     rand=None):
        inputs, lengths = self._context_inputs(input_ids, attention_mask, seq_ids,
                                               sampling_params, slots, table, rand)
        outputs = self.context_encoding_model(inputs, self.kv_cache, self.weights, self.scratch)
        for row, length in zip(seq_ids.tolist(), lengths.tolist()):
            self._next[row] = length
        self.kv_cache_populated = True
        return self._output(outputs)

    def _run_token_gen(self, input_ids, position_ids, seq_ids, sampling_params, slots, table,
                       rand=None, rows=None):
        position_ids, last = self._token_gen_positions(input_ids, position_ids, seq_ids, rows)
        inputs = self._graph_inputs(input_ids, position_ids, seq_ids, sampling_params, slots,
                                    table, rand)
        outputs = self.token_generation_model(inputs, self.kv_cache, self.weights, self.scratch,
                                              needed=max(last) + 1)
        self._advance(seq_ids, last)
        return self._output(outputs)

    def _advance(self, seq_ids, last: list[int]) -> None:
        """Each row's next position follows the last one it just ran."""
        for row, position in zip(seq_ids.tolist(), last):
            self._next[row] = position + 1

    def _token_gen_positions(self, input_ids, position_ids, seq_ids, rows=None):
        """Checked [B, 1] positions of a token-generation call (default: each row's next), and
        the same as a list of ints. rows: position_ids.tolist() when the caller has it."""
        if input_ids.shape[1] != 1:
            raise ValueError("token generation takes one new token per sequence (input_ids [B, 1])")
        if position_ids is None:
            last = [self._next[row] for row in seq_ids.tolist()]
            position_ids = torch.tensor([[p] for p in last], dtype=torch.long)
        else:
            last = [row[-1] for row in (position_ids.tolist() if rows is None else rows)]
            if position_ids.shape[1] != 1:
                position_ids = position_ids[:, -1:]
            if position_ids.dtype != torch.long:
                position_ids = position_ids.long()
                last = [int(p) for p in last]
        if min(last) < 0:
            raise ValueError(f"position_ids must be >= 0, got {min(last)}")
        if max(last) >= self.neuron_config.seq_len:
            raise ValueError(f"position {max(last)} is past seq_len "
                             f"{self.neuron_config.seq_len}; the sequence is full")
        self._check_token_ids(input_ids)
        return position_ids, last

    def _run_chunk(self, input_ids, position_ids, seq_ids, sampling_params, slots, table,
                   rand=None):
        """One piece of one prompt: input_ids and position_ids [1, S], S <= prefill_chunk_size;
        the positions before it must be in the cache (block_table). Samples from its last token.
        Runs in the chunked-prefill sub-model of the smallest chunk length that holds S."""
        inputs, model = self._chunk_inputs(input_ids, position_ids, seq_ids, sampling_params,
                                           slots, table, rand)
        outputs = model(inputs, self.kv_cache, self.weights, self.scratch)
        self._advance(seq_ids, [row[-1] for row in inputs[2].tolist()])
        self.kv_cache_populated = True
        return self._output(outputs)

    def _chunk_inputs(self, input_ids, position_ids, seq_ids, sampling_params, slots, table,
                      rand):
        """The 8 graph inputs of a chunk of a prompt (positions checked), and the
        chunked-prefill sub-model of the smallest chunk length that holds it."""
        position_ids = self._chunk_positions(input_ids, position_ids)
        inputs = self._graph_inputs(input_ids, position_ids, seq_ids, sampling_params, slots,
                                    table, rand)
        size = min(c for c in self.chunk_models if c >= position_ids.shape[1])
        return inputs, self.chunk_models[size]

    @torch.no_grad()
    def forward_mixed(self, chunk: dict, decode: dict) -> CausalLMOutput:
        """forward(**chunk) and forward(**decode) in one call of the mixed sub-model (extension):
        `chunk` a piece of one prompt (input_ids and position_ids [1, S], S <=
        prefill_chunk_size, its earlier positions in the cache), `decode` a token-generation
        step of other sequences (input_ids [R, 1]); each dict holds the keyword arguments
        forward() takes (seq_ids, position_ids, sampling_params, slot_mapping, block_table,
        rand). The weights are read once for both, by the mixed sub-model of the smallest chunk
        length that holds S (NeuronConfig.mixed_chunk_buckets). Output rows: the chunk's last
        token, then the R decode rows."""
        if self.kv_cache is None:
            raise RuntimeError("model is not loaded: call to_cpu(), or compile() then load()")
        if self.mixed_model is None:
            raise ValueError("forward_mixed needs NeuronConfig.prefill_chunk_size (block KV "
                             "layout) and mixed_steps")
        unknown = (set(chunk) | set(decode)) - MIXED_ARGS
        if unknown:
            raise ValueError(f"forward_mixed: unsupported arguments {sorted(unknown)}")
        if chunk.get("position_ids") is None:
            raise ValueError("position_ids is required for the chunk ([1, S])")
        c_seq = self._seq_ids(chunk.get("input_ids"), chunk.get("seq_ids"))
        d_seq = self._seq_ids(decode.get("input_ids"), decode.get("seq_ids"))
        c_pos = self._chunk_positions(chunk["input_ids"], chunk["position_ids"])
        d_pos, d_last = self._token_gen_positions(decode["input_ids"], decode.get("position_ids"),
                                                  d_seq)
        c, d = ({name: t for name, t in zip(GRAPH_INPUT_NAMES, self._graph_inputs(
                    part["input_ids"], pos, seq, part.get("sampling_params"),
                    part.get("slot_mapping"), part.get("block_table"), part.get("rand")))}
                for part, pos, seq in ((chunk, c_pos, c_seq), (decode, d_pos, d_seq)))

        def tokens(name):  # the chunk's [1, S] and the decode rows' [R, 1] as one [1, S + R]
            return torch.cat([c[name], d[name].reshape(1, -1)], dim=1)

        def rows(name):  # per sequence: the chunk's row first
            return torch.cat([c[name], d[name]])
        width = max(c["block_table"].shape[1], d["block_table"].shape[1])
        for part in (c, d):
            part["block_table"] = F.pad(part["block_table"],
                                        (0, width - part["block_table"].shape[1]),
                                        value=self.scratch[1])
        inputs = (tokens("input_ids"), tokens("attention_mask"), tokens("position_ids"),
                  rows("seq_ids"), rows("sampling_params"), rows("rand"), tokens("slot_mapping"),
                  rows("block_table"))
        size = min(c for c in self.mixed_models if c >= c_pos.shape[1])
        outputs = self.mixed_models[size](inputs, self.kv_cache, self.weights, self.scratch)
        self._advance(c_seq, [row[-1] for row in c_pos.tolist()])
        self._advance(d_seq, d_last)
        self.kv_cache_populated = True
        return self._output(outputs)

    def _graph_inputs(self, input_ids, positions, seq_ids, sampling_params, slots, table,
                      rand) -> tuple:
        """The 8 graph inputs of a call whose every token is real (token generation, a chunk):
        checked positions [B, S] given."""
        slots, table = self._block_indices(seq_ids, positions, None, slots, table)
        params, rand = self._sampling_inputs(positions.shape[0], sampling_params, rand)
        shape = tuple(positions.shape)  # the attention mask: every token real
        mask = self._constant(("mask",) + shape, lambda: torch.ones(shape, dtype=torch.long))
        ids = input_ids if input_ids.dtype == torch.long else input_ids.long()
        return ids, mask, positions, seq_ids, params, rand, slots, table

    def _chunk_positions(self, input_ids, position_ids) -> torch.Tensor:
        """Checked [1, S] positions of a chunk of a prompt."""
        chunk = self.neuron_config.prefill_chunk_size
        if self.chunked_prefill_model is None:
            raise ValueError("token generation takes one new token per sequence (input_ids "
                             "[B, 1]); several tokens at positions past 0 are a chunk of a "
                             "prompt: set NeuronConfig.prefill_chunk_size (block KV layout) to "
                             "run them, or start the sequence at position 0")
        b, s = input_ids.shape
        if s > chunk or b != 1:
            raise ValueError(f"a prompt chunk is input_ids [1, S] with S <= prefill_chunk_size "
                             f"({chunk}), got {list(input_ids.shape)}")
        if tuple(position_ids.shape) != (b, s):
            raise ValueError(f"position_ids must be [1, {s}] like input_ids, got "
                             f"{list(position_ids.shape)}")
        position_ids = position_ids.long()
        if int(position_ids.max()) >= self.neuron_config.seq_len:
            raise ValueError(f"position {int(position_ids.max())} is past seq_len "
                             f"{self.neuron_config.seq_len}")
        self._check_token_ids(input_ids)
        return position_ids

    def _block_indices(self, seq_ids, positions, mask, slots, table):
        """slot_mapping / block_table for the block layout (contiguous default), dummies for flat.
        mask None: every position is a real token (none writes to the scratch block)."""
        nc = self.neuron_config
        b = positions.shape[0]
        if not nc.is_block_kv_layout:
            dummy = self._constant(("flat", b), lambda: torch.zeros(b, 1, dtype=torch.long))
            return dummy, dummy  # the flat layout's graph ignores them
        if slots is not None and table is not None:  # padding positions write to scratch
            if mask is None:
                return (slots if slots.dtype == torch.long else slots.long(),
                        table if table.dtype == torch.long else table.long())
            pad = torch.full_like(slots.long(), self.scratch[1] * nc.pa_block_size)
            return torch.where(mask.bool(), slots.long(), pad), table.long()
        bs, per_seq = nc.pa_block_size, -(-nc.seq_len // nc.pa_block_size)
        if nc.pa_num_blocks < nc.max_batch_size * per_seq:
            raise ValueError("pass slot_mapping and block_table: pa_num_blocks is too small for a "
                             "contiguous block range per sequence")
        rows = tuple(seq_ids.tolist())

        def contiguous():  # row r holds blocks r * per_seq .. (r + 1) * per_seq - 1
            first = torch.tensor([[r * per_seq * bs] for r in rows])  # [B, 1]: its first slot
            return first // bs + torch.arange(per_seq), first  # [B, per_seq], [B, 1]
        table, first = self._constant(("table",) + rows, contiguous)
        slots = positions + first
        if mask is not None:
            slots = torch.where(mask.bool(), slots, torch.full_like(slots, self.scratch[1] * bs))
        return slots, table

    def _output(self, outputs) -> CausalLMOutput:
        if self.neuron_config.on_device_sampling_config is None:
            return CausalLMOutput(logits=outputs[0])
        return CausalLMOutput(tokens=outputs[0], logits=outputs[1] if len(outputs) > 1 else None)


def right_align(input_ids, attention_mask):
    """Move each row's real tokens (attention_mask == 1) to the front, in order, and trim the batch
    to its longest row: (ids [B, S], mask [B, S], lengths [B])."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mask = attention_mask.long()
    lengths = mask.sum(1)
    if int(lengths.min()) < 1:
        raise ValueError("every row needs at least one token (attention_mask row of zeros)")
    order = torch.argsort(1 - mask, dim=1, stable=True)
    s = int(lengths.max())
    ids = (input_ids.long().gather(1, order) * mask.gather(1, order))[:, :s]
    return ids.contiguous(), mask.gather(1, order)[:, :s].contiguous(), lengths
