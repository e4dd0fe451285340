"""HuggingFaceGenerationAdapter: `generate()` in the style of transformers for a NeuronBaseForCausalLM,
with greedy and multinomial sampling. The number of prompts must equal the model's batch_size."""
from __future__ import annotations

from pathlib import Path

import torch

from nxdi_common.modules.sampling import prepare_sampling_params, sample_from_logits


def _eos_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


class HuggingFaceGenerationAdapter:
    """Wraps a loaded NeuronBaseForCausalLM and runs the generation loop: one CTE call, then one
    TKG call per new token, until every row hits an EOS token or the length limit."""

    def __init__(self, model, generation_config=None):
        self.model = model
        self.neuron_config = model.neuron_config
        self.generation_config = generation_config or self._default_generation_config(model.model_path)
        self._generator = torch.Generator().manual_seed(0)

    @staticmethod
    def _default_generation_config(model_path):
        from transformers import GenerationConfig
        if model_path and (Path(model_path) / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(model_path)
        return GenerationConfig()

    def generate(self, input_ids, attention_mask=None, generation_config=None, max_length=None,
                 max_new_tokens=None, seed: int | None = None, **kwargs) -> torch.Tensor:
        """Returns [B, S + new] token ids: the prompts followed by the generated tokens (rows that
        finished early are padded with pad_token_id). kwargs override generation_config fields
        (do_sample, top_k, top_p, temperature, eos_token_id, pad_token_id)."""
        gc = self._merged_config(generation_config, kwargs)
        b, s = input_ids.shape
        if b != self.neuron_config.batch_size:
            raise ValueError(f"got {b} prompts but the model's batch_size is "
                             f"{self.neuron_config.batch_size}; the number of prompts must match it")
        if seed is not None:  # seeds host-side sampling and the model's on-device random source
            self._generator.manual_seed(seed)
            if self.model.random_source is not None:
                self.model.random_source.seed(seed)
        budget = self._new_token_budget(s, gc, max_length, max_new_tokens)
        return self._loop(input_ids, attention_mask, gc, budget)

    def _merged_config(self, generation_config, overrides: dict):
        import copy
        gc = copy.deepcopy(generation_config or self.generation_config)
        for key, value in overrides.items():
            if not hasattr(gc, key):
                raise ValueError(f"unknown generation argument {key!r}")
            setattr(gc, key, value)
        if getattr(gc, "num_beams", 1) not in (None, 1):
            raise ValueError("num_beams > 1 (beam search) is not supported; use greedy or sampling")
        return gc

    def _new_token_budget(self, prompt_len: int, gc, max_length, max_new_tokens) -> int:
        """New tokens allowed by max_new_tokens / max_length and by the model's seq_len."""
        if max_new_tokens is None and max_length is None:
            max_new_tokens = gc.max_new_tokens
            max_length = gc.max_length if max_new_tokens is None else None
        wanted = max_new_tokens if max_new_tokens is not None else max_length - prompt_len
        room = self.neuron_config.seq_len - prompt_len
        if wanted < 1 or room < 1:
            raise ValueError(f"nothing to generate: prompt length {prompt_len}, seq_len "
                             f"{self.neuron_config.seq_len}, requested {wanted} new tokens")
        return min(wanted, room)

    def _sampling_params(self, gc, batch: int):
        if not gc.do_sample:
            return prepare_sampling_params(batch, top_k=1)
        top_k = gc.top_k if gc.top_k is not None else 0
        return prepare_sampling_params(batch, top_k=top_k, top_p=gc.top_p or 1.0,
                                       temperature=gc.temperature if gc.temperature is not None else 1.0)

    def _next_tokens(self, output, params) -> torch.Tensor:
        """Tokens [B] from the model output: on-device tokens, or sampled here from logits."""
        if output.tokens is not None:
            return output.tokens.long()
        rand = torch.rand(params.shape[0], generator=self._generator)
        return sample_from_logits(output.logits, params, rand)

    def _loop(self, input_ids, attention_mask, gc, budget: int) -> torch.Tensor:
        eos = torch.tensor(_eos_ids(gc.eos_token_id), dtype=torch.long)
        pad = gc.pad_token_id if gc.pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
        params = self._sampling_params(gc, input_ids.shape[0])
        self.model.reset()
        output = self.model(input_ids, attention_mask=attention_mask, sampling_params=params)
        tokens, done = [], torch.zeros(input_ids.shape[0], dtype=torch.bool)
        for step in range(budget):
            nxt = self._next_tokens(output, params)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            tokens.append(nxt)
            done |= torch.isin(nxt, eos)
            if bool(done.all()) or step == budget - 1:
                break
            output = self.model(nxt.unsqueeze(1), sampling_params=params)
        return torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1)
