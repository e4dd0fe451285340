"""NeuronBaseModel: the traced body shared by every decoder-only model. Subclasses build the
modules (`setup_attr_for_model`, `init_model`, `decoder_layer`); this class owns the forward that
the context-encoding and token-generation graphs run, and the KV cache manager and sampler."""
from __future__ import annotations

import torch
from torch import nn

from nxdi_common.modules.kv_cache import make_kv_cache_manager
from nxdi_common.modules.sampling import Sampler

# The positional tensors every graph takes, in order, before the KV cache and the weights.
GRAPH_INPUT_NAMES = ("input_ids", "attention_mask", "position_ids", "seq_ids", "sampling_params",
                     "rand", "slot_mapping", "block_table")


class NeuronBaseModel(nn.Module):
    """Embeddings, decoder layers, final norm, LM head, KV cache manager and on-device sampler."""

    def __init__(self, config, optimize_inference: bool = True):
        super().__init__()
        self.config, self.neuron_config = config, config.neuron_config
        self.setup_attr_for_model(config)
        self.init_model(config)
        self.kv_mgr = self.sampler = None
        if optimize_inference:
            self.kv_mgr = make_kv_cache_manager(self.neuron_config, len(self.layers),
                                                self.kv_heads_in_cache, self.head_dim)
            if self.on_device_sampling:
                self.sampler = Sampler(self.neuron_config.on_device_sampling_config)

    def setup_attr_for_model(self, config):
        raise NotImplementedError("subclasses set on_device_sampling, hidden_size, heads, ...")

    def init_model(self, config):
        raise NotImplementedError("subclasses create embed_tokens, layers, norm, lm_head")

    def forward(self, input_ids, attention_mask, position_ids, seq_ids, sampling_params, rand,
                slot_mapping, block_table, kv_cache, kv_len: int | None = None,
                mixed: int | None = None, all_positions: bool = False):
        """One graph call. input_ids/attention_mask/position_ids [B, S]; seq_ids [B];
        sampling_params [B, 3]; rand [B]; slot_mapping [B, S] and block_table [B, T/block] (block
        layout only); kv_cache is updated in place. kv_len None = context encoding, else token
        generation over the first kv_len cache positions. Returns (tokens,) or (tokens, logits)
        with on-device sampling, else (logits,); logits are [B, vocab] float32 of the last token.
        With kv_len and S > 1 (a chunk of a prompt) each query attends to the cache up to its
        own position, this call's keys included.

        mixed = C (with kv_len): one call for a chunk of a prompt and a decode step together, so
        the weights are read once for both. Token inputs are [1, C + R]: the chunk's C tokens
        (right-padded; attention_mask marks them) then one token for each of R decode rows;
        block_table [1 + R, T/block] (the chunk's sequence first), seq_ids [1 + R],
        sampling_params [1 + R, 3], rand [1 + R]. Outputs have 1 + R rows: the chunk's last
        token, then the decode rows.

        all_positions (not with mixed): return (hidden,), every position's final hidden state
        after the final norm, [B, S, hidden], instead of the last token's logits and sample: what
        scoring a prompt needs (NeuronBaseForCausalLM.forward_hidden). Never traced."""
        index = (seq_ids, position_ids, slot_mapping, block_table)
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, hidden.dtype)
        mask = self._masks(position_ids, kv_len, mixed, hidden.dtype)
        extra = {} if mixed is None else {"mixed": mixed}
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, mask, kv_cache, i, self.kv_mgr, index, kv_len, **extra)
        if all_positions:
            return (self.norm(hidden),)
        if mixed is None:
            hidden = self._last_token(hidden, attention_mask, kv_len)  # [B, 1, hidden]
        else:
            chunk = self._last_token(hidden[:, :mixed], attention_mask[:, :mixed], None)
            hidden = torch.cat([chunk, hidden[:, mixed:].transpose(0, 1)])  # [1 + R, 1, hidden]
        # [B, V] in the model's dtype: the sampler reads it as float32 values (the fused top-k
        # in place), and only logits handed out are made a float32 copy (0.25 ms a step at 16
        # rows of bf16, 49152 tokens, when every step made one)
        logits = self.lm_head.normed(hidden, self.norm).squeeze(1)
        if self.sampler is None:
            return (logits.float(),)
        tokens = self.sampler(logits, sampling_params, rand)
        return (tokens, logits.float()) if self.neuron_config.output_logits else (tokens,)

    def _masks(self, position_ids, kv_len, mixed, dtype):
        """The call's attention mask: None with the paged kernel (it needs none); for a mixed
        call the pair (the chunk's [1, 1, C, kv_len], the decode rows' [R, 1, 1, kv_len])."""
        if self.kv_mgr.paged_attention is not None:
            return None
        if mixed is None:
            return self._attention_mask(position_ids, kv_len, dtype)
        return (self._attention_mask(position_ids[:, :mixed], kv_len, dtype),
                self._attention_mask(position_ids[:, mixed:].transpose(0, 1), kv_len, dtype))

    @staticmethod
    def _attention_mask(position_ids, kv_len, dtype):
        """None for context encoding (causal attention over the call's own keys); for token
        generation an additive mask [B, 1, S, kv_len] in `dtype`: 0 for the cache positions up to
        each query's position, -inf after. Built once per call and shared by every layer."""
        if kv_len is None:
            return None
        cache_pos = torch.arange(kv_len).view(1, 1, 1, kv_len)
        allowed = cache_pos <= position_ids.unsqueeze(1).unsqueeze(-1)
        return torch.where(allowed, 0.0, float("-inf")).to(dtype)

    @staticmethod
    def _last_token(hidden, attention_mask, kv_len):
        """Hidden state of each row's last real token: [B, 1, hidden] (a chunk of a prompt, like
        a context, may end in padding; a token-generation call's one token is its last)."""
        if kv_len is not None and hidden.shape[1] == 1:
            return hidden
        last = attention_mask.long().sum(-1, keepdim=True) - 1  # [B, 1], right padding
        idx = last.clamp(min=0).unsqueeze(-1).expand(-1, 1, hidden.shape[-1])
        return hidden.gather(1, idx)
