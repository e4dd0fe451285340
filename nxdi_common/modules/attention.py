"""Grouped-query attention with NxD Inference's KV-head sharding strategies, RoPE, optional
qk-layernorm and projection biases, writing to and reading from a KV cache manager."""
from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import nn

from nxdi_common.modules.linear import Linear

from nxdi_common.modules.norm import RMSNorm
from nxdi_common.modules.rope import apply_rope


class GQA(enum.Enum):
    """How KV heads are laid out across tensor-parallel ranks (feature guide, "GQA support")."""

    CONVERT_TO_MHA = "convert-to-mha"
    REPLICATE_TO_TP_DEGREE = "replicate-to-tp-degree"


def determine_sharding_strategy(tp_degree: int, num_kv_heads: int, desired=None) -> GQA:
    """REPLICATE_TO_TP_DEGREE unless the KV heads cannot be spread evenly over tp_degree ranks."""
    if desired is not None:
        return GQA(desired) if not isinstance(desired, GQA) else desired
    if tp_degree % num_kv_heads == 0 or num_kv_heads % tp_degree == 0:
        return GQA.REPLICATE_TO_TP_DEGREE
    return GQA.CONVERT_TO_MHA


def effective_kv_heads(strategy: GQA, tp_degree: int, num_heads: int, num_kv_heads: int) -> int:
    """KV heads the cache holds after the strategy's replication."""
    if strategy is GQA.CONVERT_TO_MHA:
        return num_heads
    if tp_degree % num_kv_heads == 0:
        return max(num_kv_heads, tp_degree)
    if num_kv_heads % tp_degree == 0:
        return num_kv_heads
    raise ValueError(
        f"REPLICATE_TO_TP_DEGREE needs tp_degree ({tp_degree}) and num_key_value_heads "
        f"({num_kv_heads}) to divide one another; use gqa_sharding_strategy='convert-to-mha'"
    )


class NeuronAttention(nn.Module):
    """Self-attention of one decoder layer. Weights: q/k/v/o projections (or one fused qkv)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool, o_bias: bool, qk_norm_eps: float | None, fused_qkv: bool,
                 dtype: torch.dtype, device=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.fused_qkv = fused_qkv
        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        kw = dict(dtype=dtype, device=device)
        if fused_qkv:
            self.qkv_proj = Linear(hidden_size, q_out + 2 * kv_out, bias=qkv_bias, **kw)
        else:
            self.q_proj = Linear(hidden_size, q_out, bias=qkv_bias, **kw)
            self.k_proj = Linear(hidden_size, kv_out, bias=qkv_bias, **kw)
            self.v_proj = Linear(hidden_size, kv_out, bias=qkv_bias, **kw)
        self.o_proj = Linear(q_out, hidden_size, bias=o_bias, **kw)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype=dtype, device=device)

    def project(self, x):
        """q [B, H, S, D], k and v [B, Hkv, S, D] from hidden states x [B, S, hidden]."""
        b, s, _ = x.shape
        if self.fused_qkv:
            q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([q_out, kv_out, kv_out], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, cos, sin, mask, cache, layer: int, kv_mgr, index, kv_len: int | None):
        """x [B, S, hidden]; mask [B, 1, S, T] boolean (True = attend). kv_len None means context
        encoding (attend to this call's own keys); an int means token generation (attend to the
        first kv_len cached positions, after writing this step's keys)."""
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv_mgr.write(cache, layer, k, v, index)
        if kv_len is not None:
            k, v = kv_mgr.read(cache, layer, index, kv_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))
