"""HF → Neuron state-dict conversion for Llama-family checkpoints."""
from __future__ import annotations

import torch

from nxdi_common.modules.attention import determine_sharding_strategy, effective_kv_heads


def convert_llama_state_dict(state_dict: dict, config) -> dict:
    """Returns a new dict: lm_head tied to the embeddings when the checkpoint ties them, K/V
    projections replicated per the GQA strategy, q/k/v fused when fused_qkv is set, and the MLP's
    gate and up projections fused."""
    sd = dict(state_dict)
    if "lm_head.weight" not in sd:
        if not getattr(config, "tie_word_embeddings", False):
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is False")
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    strategy = determine_sharding_strategy(config.neuron_config.tp_degree, config.num_key_value_heads,
                                           getattr(config, "gqa_sharding_strategy", None))
    target = effective_kv_heads(strategy, config.neuron_config.tp_degree,
                                config.num_attention_heads, config.num_key_value_heads)
    for i in range(config.num_hidden_layers):
        prefix = f"layers.{i}.self_attn."
        _replicate_kv(sd, prefix, config.num_key_value_heads, target, head_dim)
        if config.neuron_config.fused_qkv:
            _fuse_qkv(sd, prefix)
        _fuse_gate_up(sd, f"layers.{i}.mlp.")
    return sd


def _fuse_gate_up(sd: dict, prefix: str) -> None:
    """mlp.gate_proj + mlp.up_proj → mlp.gate_up_proj (gate rows first)."""
    for kind in ("weight", "bias", "scale"):
        gate, up = f"{prefix}gate_proj.{kind}", f"{prefix}up_proj.{kind}"
        if gate in sd and up in sd:
            sd[f"{prefix}gate_up_proj.{kind}"] = torch.cat([sd.pop(gate), sd.pop(up)], dim=0)


def _replicate_kv(sd: dict, prefix: str, kv_heads: int, target: int, head_dim: int) -> None:
    """Repeat each KV head's rows target/kv_heads times, keeping query-group alignment."""
    if target == kv_heads:
        return
    if target % kv_heads:
        raise ValueError(f"cannot replicate {kv_heads} KV heads to {target}")
    repeat = target // kv_heads
    for proj in ("k_proj", "v_proj"):
        for kind in ("weight", "bias", "scale"):
            key = f"{prefix}{proj}.{kind}"
            if key in sd:
                t = sd[key]
                heads = t.reshape(kv_heads, head_dim, *t.shape[1:])
                sd[key] = heads.repeat_interleave(repeat, dim=0).reshape(target * head_dim,
                                                                         *t.shape[1:])


def _fuse_qkv(sd: dict, prefix: str) -> None:
    for kind in ("weight", "bias", "scale"):
        keys = [f"{prefix}{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj")]
        if all(k in sd for k in keys):
            sd[f"{prefix}qkv_proj.{kind}"] = torch.cat([sd.pop(k) for k in keys], dim=0)
