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

# A prompt chunk of at most this many tokens attends through the paged kernel (its blocks read in
# place); a longer one gathers the cache up to the length bucket and runs chunk_attention (K and
# V packed once for all its queries). Bundled model shapes, bf16, one core of the Zen 4 VM, 30
# layers at prefix 256 / 1024 / 1792: 16 tokens 3.3 / 11 / 20 ms paged against 28 / 60 / 96 ms
# gathered (the gather of a 2048-position bucket is most of it), 64 tokens 12 / 43 / 71 against
# 25 / 56 / 96, 128 tokens 27 / 102 / 192 against 35 / 87 / 140, 256 tokens 86 / 267 / 459 against
# 67 / 170 / 269.
PAGED_CHUNK_MAX_TOKENS = 64


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
        # torch.ops.nxdi with NeuronConfig.cpu_fused_ops: RoPE in one op, and context encoding's
        # and prompt chunks' attention in our kernels (they fall back to SDPA themselves where
        # they do not apply)
        self.fused = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype=dtype, device=device)

    def _qkv_heads(self, x):
        """The fused QKV projection of x as heads: [B, S, H + 2Hkv, D] (q, then k, then v)."""
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        return self.qkv_proj(x).unflatten(-1, (h + 2 * hkv, d))

    def project(self, x, cos, sin):
        """Rotated q [B, H, S, D] and k [B, Hkv, S, D], and v [B, Hkv, S, D], from hidden states
        x [B, S, hidden]. Head counts and sizes are the module's ints, never read from x."""
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.fused_qkv:
            heads = self._qkv_heads(x)
            if self.q_norm is None and self.fused is not None:  # the same RoPE, one op
                q, k, v = self.fused.rope_qk(heads, cos, sin, h + hkv).transpose(1, 2).split(
                    [h, hkv, hkv], dim=1)
                return q, k, v
            if self.q_norm is None:  # rotate q and k together: one RoPE over H + Hkv heads
                qk, v = heads.split([h + hkv, hkv], dim=2)
                qk = apply_rope(qk.transpose(1, 2), cos, sin, d // 2)
                q, k = qk.split([h, hkv], dim=1)
                return q, k, v.transpose(1, 2)
            q, k, v = heads.split([h, hkv, hkv], dim=2)
        else:
            q = self.q_proj(x).unflatten(-1, (h, d))
            k = self.k_proj(x).unflatten(-1, (hkv, d))
            v = self.v_proj(x).unflatten(-1, (hkv, d))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin, d // 2)
        k = apply_rope(k.transpose(1, 2), cos, sin, d // 2)
        return q, k, v.transpose(1, 2)

    def forward(self, x, cos, sin, mask, cache, layer: int, kv_mgr, index, kv_len: int | None,
                residual=None, mixed: int | None = None, norm=None):
        """x [B, S, hidden]; cos/sin from rope_cos_sin; mask None (causal) or [B, 1, S, T] additive
        float (0 = attend, -inf = not). kv_len None means context encoding (attend to this call's
        own keys); an int means token generation (attend to the first kv_len cached positions,
        after writing this step's keys; with kv_mgr.paged_attention, to each row's own positions,
        and mask is unused). mixed = C: x is [1, C + R, hidden], a C-token chunk of a prompt
        (block_table row 0) then one token for each of R decode rows (block_table rows 1..R), and
        mask is the pair (chunk's, decode rows') or None; each part attends as it would alone.
        Returns residual + attention output when residual is given. norm: an RMSNorm that x
        goes through first (inside the QKV product where rope_qk_store follows it)."""
        if kv_len is not None and self._stores_in_one_op(kv_mgr, x.dtype):
            # attention reads this call's keys from the cache: rotate and store them in one op
            # the projection as it is, [B, S, (H + 2Hkv) * D]: the op finds the heads itself
            qkv = self.qkv_proj(x) if norm is None else self.qkv_proj.normed(x, norm)
            q = self.fused.rope_qk_store(qkv, cos, sin, self.num_heads, cache, layer,
                                         index[2])  # [B, S, H, D]
            if mixed is None and self._attends_in_one_op(kv_mgr, q.shape[1]):
                out = kv_mgr.attend_heads_last(cache, layer, q, index)  # [B, S, H * D]
                return self.o_proj(out) if residual is None else self.o_proj.add_to(residual, out)
            q, k, v = q.transpose(1, 2), None, None
        else:
            q, k, v = self.project(x if norm is None else norm(x), cos, sin)
            kv_mgr.write(cache, layer, k, v, index)  # slots are per token: one write for all
        if mixed is None:
            out = self._attend(q, k, v, mask, cache, layer, kv_mgr, index, kv_len)
        else:
            seq_ids, positions, slots, table = index
            masks = mask if mask is not None else (None, None)
            chunk = (seq_ids[:1], positions[:, :mixed], slots[:, :mixed], table[:1])
            rows = (seq_ids[1:], positions[:, mixed:].transpose(0, 1).contiguous(),
                    slots[:, mixed:].transpose(0, 1).contiguous(), table[1:])
            out_chunk = self._attend(q[:, :, :mixed], None, None, masks[0], cache, layer, kv_mgr,
                                     chunk, kv_len)  # [1, C, H, D]
            q_rows = q[:, :, mixed:].transpose(0, 2).contiguous()  # [R, H, 1, D]
            out_rows = self._attend(q_rows, None, None, masks[1], cache, layer, kv_mgr, rows,
                                    kv_len)  # [R, 1, H, D]
            out = torch.cat([out_chunk, out_rows.transpose(0, 1)], dim=1)
        out = out.flatten(2)  # [B, S, H * D]
        return self.o_proj(out) if residual is None else self.o_proj.add_to(residual, out)

    def _stores_in_one_op(self, kv_mgr, dtype) -> bool:
        """Whether nxdi::rope_qk_store can rotate q and k and store k and v (fused ops, fused QKV
        without qk-norm, a block cache in the compute dtype)."""
        return (self.fused is not None and self.fused_qkv and self.q_norm is None
                and kv_mgr.is_block and kv_mgr.dtype == dtype)

    def _attends_in_one_op(self, kv_mgr, tokens: int) -> bool:
        """Whether a token-generation call of `tokens` a row, its keys stored by rope_qk_store,
        attends with nxdi::paged_decode_attention_layer: where _attend would take the paged
        kernel (its cache, q heads-last and the output as o_proj takes it, one graph node)."""
        return kv_mgr.paged_attention is not None and tokens <= PAGED_CHUNK_MAX_TOKENS

    def _attend(self, q, k, v, mask, cache, layer: int, kv_mgr, index, kv_len: int | None):
        """Attention of q [B, H, S, D] after this call's keys are in the cache: [B, S, H, D]. k and
        v are this call's own keys (context encoding only, kv_len None)."""
        paged_chunk = q.shape[2] <= PAGED_CHUNK_MAX_TOKENS and kv_mgr.paged_attention is not None
        if kv_len is not None and q.shape[2] > 1 and self.fused is not None and not paged_chunk:
            # a long chunk of a prompt: its queries over the cache gathered up to the length
            # bucket; the kernel reads keys only up to the chunk's last position
            k, v = kv_mgr.read(cache, layer, index, kv_len)
            return self.fused.chunk_attention(q, k, v, index[1], self.head_dim ** -0.5)
        if kv_len is not None and kv_mgr.paged_attention is not None:
            # reads the blocks in place; no mask
            return kv_mgr.attend(cache, layer, q, index)
        if kv_len is None and mask is None and self.fused is not None:
            return self.fused.causal_attention(q, k, v, self.head_dim ** -0.5)  # [B, S, H, D]
        if kv_len is not None:
            k, v = kv_mgr.read(cache, layer, index, kv_len)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=True).transpose(1, 2)
