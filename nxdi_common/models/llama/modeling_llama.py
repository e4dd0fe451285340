"""Llama-family decoder (Llama 2/3/3.1, SmolLM, Qwen2-style attention bias, Qwen3-style
qk-layernorm): GQA, RoPE with llama3 scaling, RMSNorm, SwiGLU, tied embeddings, explicit head_dim."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from nxdi_common.application import NeuronBaseForCausalLM
from nxdi_common.config import InferenceConfig, NeuronConfig
from nxdi_common.models.base import NeuronBaseModel
from nxdi_common.modules.attention import (NeuronAttention, determine_sharding_strategy,
                                           effective_kv_heads)
from nxdi_common.modules.linear import Linear
from nxdi_common.modules.norm import RMSNorm
from nxdi_common.modules.rope import rope_cos_sin, rope_inv_freq

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class LlamaNeuronConfig(NeuronConfig):
    """NeuronConfig for Llama-family models (no extra attributes)."""


class LlamaInferenceConfig(InferenceConfig):
    """InferenceConfig with the attributes a Llama-family decoder needs."""

    def get_required_attributes(self):
        return ["hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                "vocab_size", "max_position_embeddings", "rms_norm_eps", "intermediate_size"]

    @classmethod
    def get_neuron_config_cls(cls):
        return LlamaNeuronConfig

    def add_derived_config(self):
        if getattr(self, "num_key_value_heads", None) is None and hasattr(self, "num_attention_heads"):
            self.num_key_value_heads = self.num_attention_heads

    def validate_config(self):
        model_type = getattr(self, "model_type", "llama")  # checked first: a GPT-2 config would
        if model_type not in SUPPORTED_MODEL_TYPES:          # otherwise fail on missing attributes
            raise ValueError(f"model_type {model_type!r} is not a Llama-family model; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        super().validate_config()
        if getattr(self, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; Llama uses 'silu'")
        if getattr(self, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported; set it to False")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def uses_qk_norm(config) -> bool:
    return bool(config.neuron_config.qk_layernorm) or getattr(config, "model_type", "") == "qwen3"


def attention_biases(config) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) as the checkpoint's architecture has them."""
    model_type = getattr(config, "model_type", "llama")
    if model_type == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


class NeuronLlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate and up fused into one
    projection (one larger matrix-vector product per token reads weights faster than two)."""

    def __init__(self, hidden: int, inter: int, bias: bool, dtype, device=None):
        super().__init__()
        kw = dict(bias=bias, dtype=dtype, device=device)
        self.gate_up_proj = Linear(hidden, 2 * inter, **kw)
        self.down_proj = Linear(inter, hidden, **kw)
        self.fused = None  # torch.ops.nxdi with NeuronConfig.cpu_fused_ops: silu * up in one op

    def forward(self, x, residual=None, norm=None):
        """The MLP of x (of norm(x) with an RMSNorm `norm`, inside the gate/up product where it
        can be); plus residual, in the down projection's kernel, when given."""
        gate_up = self.gate_up_proj(x) if norm is None else self.gate_up_proj.normed(x, norm)
        if self.fused is not None:
            hidden = self.fused.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        if residual is None:
            return self.down_proj(hidden)
        return self.down_proj.add_to(residual, hidden)


class NeuronLlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, config, kv_heads: int, device=None):
        super().__init__()
        nc, dtype = config.neuron_config, config.neuron_config.torch_dtype
        qkv_bias, o_bias = attention_biases(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = NeuronAttention(
            config.hidden_size, config.num_attention_heads, kv_heads, head_dim_of(config),
            qkv_bias=qkv_bias, o_bias=o_bias, fused_qkv=nc.fused_qkv, dtype=dtype, device=device,
            qk_norm_eps=config.rms_norm_eps if uses_qk_norm(config) else None)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = NeuronLlamaMLP(config.hidden_size, config.intermediate_size,
                                  bool(getattr(config, "mlp_bias", False)), dtype, device)

    def forward(self, x, cos, sin, mask, cache, layer, kv_mgr, index, kv_len, mixed=None):
        x = self.self_attn(x, cos, sin, mask, cache, layer, kv_mgr, index, kv_len, residual=x,
                           mixed=mixed, norm=self.input_layernorm)
        return self.mlp(x, residual=x, norm=self.post_attention_layernorm)


class NeuronLlamaModel(NeuronBaseModel):
    """The Llama decoder as traced per bucket."""

    def setup_attr_for_model(self, config):
        nc = config.neuron_config
        self.on_device_sampling = nc.on_device_sampling_config is not None
        self.tp_degree, self.hidden_size = nc.tp_degree, config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.max_batch_size, self.head_dim = nc.max_batch_size, head_dim_of(config)
        self.gqa_strategy = determine_sharding_strategy(
            nc.tp_degree, config.num_key_value_heads, getattr(config, "gqa_sharding_strategy", None))
        self.kv_heads_in_cache = effective_kv_heads(self.gqa_strategy, nc.tp_degree,
                                                    config.num_attention_heads,
                                                    config.num_key_value_heads)

    def init_model(self, config, device=None):
        dtype = config.neuron_config.torch_dtype
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                         device=device)
        self.layers = nn.ModuleList(NeuronLlamaDecoderLayer(config, self.kv_heads_in_cache, device)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
                                 device=device)
        self.register_buffer("inv_freq", rope_inv_freq(config, self.head_dim), persistent=False)

    def rotary(self, position_ids, dtype):
        return rope_cos_sin(position_ids, self.inv_freq, dtype)


class NeuronLlamaForCausalLM(NeuronBaseForCausalLM):
    """Application class for Llama-family causal LMs."""

    _model_cls = NeuronLlamaModel

    @classmethod
    def get_config_cls(cls):
        return LlamaInferenceConfig

    @staticmethod
    def load_hf_model(model_path, **kwargs):
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict: dict, config) -> dict:
        """HF Llama names → ours: tied lm_head, KV-head replication for the GQA strategy, fused QKV."""
        from nxdi_common.models.llama.convert import convert_llama_state_dict
        return convert_llama_state_dict(state_dict, config)
