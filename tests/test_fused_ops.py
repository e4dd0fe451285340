"""The fused CPU ops (nxdi_common/kernels/fused_ops.cpp, causal_attention.cpp): each equals the
torch chain it replaces (RMSNorm, RoPE, silu * up) bit for bit in bfloat16 and float16, to
float32 rounding in float32, the sampler's top-K equals torch.topk (equal logits ordered by
index), and context encoding's causal attention is as close to a float32 reference as torch's
SDPA in the same dtype (torch's SDPA itself where the kernel does not apply);
the models use them only as NeuronConfig.cpu_fused_ops resolves, the compiled graphs record them
and the manifest refuses a folder compiled the other way."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from nxdi_common import kernels
from nxdi_common.application_base import MANIFEST
from nxdi_common.config import NeuronConfig
from nxdi_common.models.llama.modeling_llama import (LlamaInferenceConfig, NeuronLlamaForCausalLM,
                                                     NeuronLlamaMLP)
from nxdi_common.modules.attention import NeuronAttention
from nxdi_common.modules.norm import RMSNorm
from nxdi_common.modules.rope import rope_cos_sin

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HALF_DTYPES = (torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def ops():
    return kernels.fused_ops()


def assert_same(got, want, dtype):
    """Bit for bit in the 16-bit dtypes; float32 may differ where a sum is added in another
    order or e^x comes from another polynomial (an ulp or two)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype in HALF_DTYPES:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize("size", [576, 40, 7])  # vector body only, vector + tail, tail only
@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_equals_the_module(ops, dtype, size, rows):
    """Bit for bit where the float32 sum of squares is exact in any order (x in eighths: every
    partial sum is a multiple of 1/64 far below 2^18), so only the roundings the chain makes are
    compared; on random x the sum's order (torch's vector width is the CPU's) may move the scale
    by a float32 ulp, which is at most one ulp of the 16-bit result."""
    g = torch.Generator().manual_seed(size + rows)
    norm = RMSNorm(size, 1e-5, dtype=dtype)
    norm.weight.data = (torch.randn(size, generator=g) * 0.5 + 1).to(dtype)
    x = (torch.randint(-24, 25, (rows, 3, size), generator=g) / 8).to(dtype)
    assert_same(ops.rms_norm(x, norm.weight, norm.eps), norm(x), dtype)
    assert_same(ops.rms_norm(x[:, 1], norm.weight, norm.eps), norm(x[:, 1]), dtype)  # strided
    x = (torch.randn(rows, 3, size, generator=g) * 3).to(dtype)
    if dtype in HALF_DTYPES:
        torch.testing.assert_close(ops.rms_norm(x, norm.weight, norm.eps), norm(x),
                                   rtol=torch.finfo(dtype).eps, atol=0)
    else:
        assert_same(ops.rms_norm(x, norm.weight, norm.eps), norm(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize("inter", [1536, 40, 5])
def test_silu_mul_equals_silu_times_up(ops, dtype, inter):
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(3, 2, 2 * inter, generator=g) * 4).to(dtype)
    x[0, 0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0]).to(dtype)  # e^x clamped both ways
    gate, up = x.chunk(2, dim=-1)
    assert_same(ops.silu_mul(x), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize("dim", [64, 24])  # AVX-512 body, portable
@pytest.mark.parametrize("seq", [1, 9])
def test_rope_qk_equals_the_attention_modules_rope(ops, dtype, dim, seq):
    """With and without the fused op, NeuronAttention.project gives the same q, k, v (bit for bit:
    RoPE's products and sum are rounded as torch rounds them, in every dtype)."""
    attn = NeuronAttention(48, 6, 2, dim, qkv_bias=False, o_bias=False, qk_norm_eps=None,
                           fused_qkv=True, dtype=dtype)
    g = torch.Generator().manual_seed(dim + seq)
    for p in attn.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.3).to(dtype)
    x = torch.randn(2, seq, 48, generator=g).to(dtype)
    positions = torch.randint(0, 4000, (2, seq), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)
    want = attn.project(x, cos, sin)
    attn.fused = ops
    got = attn.project(x, cos, sin)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize("dim", [64, 24])
@pytest.mark.parametrize("batch,seq", [(3, 1), (1, 7)])  # a decode step, a chunk
def test_rope_qk_store_equals_rope_then_the_block_cache_write(ops, dtype, dim, batch, seq):
    """q as NeuronAttention.project rotates it, k and v in layer 1 of a block cache at the slots
    as BlockKVCacheManager.write stores them (bit for bit); every other cache cell untouched."""
    from nxdi_common.modules.kv_cache import BlockKVCacheManager
    heads, kv_heads, block_size = 6, 2, 4
    attn = NeuronAttention(48, heads, kv_heads, dim, qkv_bias=False, o_bias=False,
                           qk_norm_eps=None, fused_qkv=True, dtype=dtype)
    g = torch.Generator().manual_seed(dim + seq)
    for p in attn.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.3).to(dtype)
    x = torch.randn(batch, seq, 48, generator=g).to(dtype)
    positions = torch.randint(0, 4000, (batch, seq), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)
    mgr = BlockKVCacheManager(3, 5, block_size, kv_heads, dim, dtype, dtype)
    cache = torch.randn(mgr.shape, generator=g).to(dtype)
    slots = torch.randperm(6 * block_size, generator=g)[:batch * seq].view(batch, seq)
    want_cache = cache.clone()
    q, k, v = attn.project(x, cos, sin)
    mgr.write(want_cache, 1, k, v, (None, None, slots, None))
    flat_cache = cache.clone()
    heads_in = attn.qkv_proj(x).unflatten(-1, (heads + 2 * kv_heads, dim))
    got = ops.rope_qk_store(heads_in, cos, sin, heads, cache, 1, slots)
    assert torch.equal(got.transpose(1, 2), q)
    assert torch.equal(cache, want_cache)
    # the projection's [B, S, heads * D] as it is (what the decoder passes): the same
    got = ops.rope_qk_store(attn.qkv_proj(x), cos, sin, heads, flat_cache, 1, slots)
    assert torch.equal(got.transpose(1, 2), q)
    assert torch.equal(flat_cache, want_cache)


def test_rope_qk_store_refuses_bad_input_and_writes_nothing(ops):
    x, cs = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 2, 8)
    cache = torch.zeros(2, 2, 3, 4, 1, 8)
    slots = torch.tensor([[0, 5]])
    for args, message in [
        ((x, cs, cs, 2, cache, 0, torch.tensor([[0, 12]])), r"slot 12 is not in 0..11"),
        ((x, cs, cs, 2, cache, 2, slots), r"layer 2 is not in 0..1"),
        ((x, cs, cs, 3, cache, 0, slots), r"not q_heads \(3\) \+ 2 equal numbers"),
        ((x, cs, cs, 2, cache.bfloat16(), 0, slots), "cache dtype BFloat16 differs"),
        ((x, cs, cs, 2, cache, 0, slots.int()), "slots must be int64"),
        ((x, cs, cs, 2, torch.zeros(2, 2, 3, 4, 2, 8), 0, slots), "cache must be a contiguous"),
        ((x.flatten(2)[..., :-4], cs, cs, 2, cache, 0, slots), r"x \[B, S, 28\] is not whole "
         "heads of 8"),
        ((x[0, 0], cs, cs, 2, cache, 0, slots), r"x must be \[B, S, heads, D\] or \[B, S, heads "
         r"\* D\]"),
        ((x, cs, cs, 2, cache[0], 0, slots), r"cache must be \[layers, 2"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            ops.rope_qk_store(*args)
    assert not cache.any()


@pytest.mark.parametrize("vocab,k", [(49152, 256), (5000, 64), (300, 256), (256, 256), (81, 10),
                                     (2049, 256), (49153, 1)])
def test_topk_equals_torch_topk(ops, vocab, k):
    """The fast path (rows of at least 8k values) and the plain one give torch.topk's values and
    indices for distinct logits, in any float dtype."""
    g = torch.Generator().manual_seed(vocab + k)
    logits = torch.randn(5, vocab, generator=g) * 4
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        values, ids = ops.topk(x, k)
        want_values, want_ids = torch.topk(x.float(), k)
        assert torch.equal(values, want_values)
        # bf16 has ties (torch.topk orders them arbitrarily): compare the ids of untied values,
        # the (k+1)-th largest counting as a neighbour of the k-th
        ordered = torch.sort(x.float(), descending=True).values
        ordered = torch.cat([ordered, torch.full((5, 1), float("-inf"))], 1)[:, :k + 1]
        ties = ordered[:, 1:] == ordered[:, :-1]  # [5, k]: value j equals value j + 1
        tied_left = torch.cat([torch.zeros(5, 1, dtype=torch.bool), ties[:, :-1]], 1)
        untied = ~ties & ~tied_left
        assert torch.equal(ids[untied], want_ids[untied])
        assert torch.equal(x.float().gather(1, ids), values)


@pytest.mark.parametrize("vocab,k", [(2049, 256), (81, 10), (49153, 256)])
def test_topk_where_few_values_stand_out(ops, vocab, k):
    """Rows whose large values are spread thin (one every 9 positions, the rest distinct and far
    below):
    the fast path's bound must still leave at least k candidates. Its chunks of ceil(V / k)
    values came to fewer than k chunks at these sizes (2049 / 9 -> 228), and the top-k read
    past its candidates (garbage values)."""
    g = torch.Generator().manual_seed(vocab)
    x = -100 - torch.stack([torch.randperm(vocab, generator=g) for _ in range(3)]) * 1e-3
    big = len(range(0, vocab, 9))
    x[:, ::9] = 10 + torch.stack([torch.randperm(big, generator=g) for _ in range(3)]) * 1e-3
    values, ids = ops.topk(x, k)
    want_values, want_ids = torch.topk(x, k)
    assert torch.equal(values, want_values) and torch.equal(ids, want_ids)


def test_topk_orders_equal_values_by_index_and_nan_first(ops):
    x = torch.randn(3, 20000)
    x[0, 100:400] = 50.0  # 300 equal maxima, more than k
    x[1, [7, 9, 11]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    x[2] = 1.0  # every value equal
    values, ids = ops.topk(x, 256)
    assert ids[0].tolist() == list(range(100, 356)) and bool((values[0] == 50).all())
    assert ids[1, :2].tolist() == [7, 9] and values[1, 0].isnan() and values[1, 1].isinf()
    want = torch.topk(x[1], 256).values
    assert torch.equal(values[1, 1:], want[1:])
    assert ids[2].tolist() == list(range(256))


@pytest.mark.parametrize("vocab,k", [(49152, 256), (300, 256), (81, 10)])
def test_topk_reads_bf16_and_float16_as_their_float32_values(ops, vocab, k):
    """bf16 and float16 logits (read in place, not converted to a float32 copy first) give
    exactly the top-k of their float32 values: ties, NaN, infinities and greedy rows alike."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(4, vocab, generator=g) * 3
    x[0, :40] = 7.0  # ties
    x[1, [5, 9, 11]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    greedy = torch.tensor([False, True, False, True])
    for dtype in (torch.bfloat16, torch.float16):
        low = x.to(dtype)
        for flags in (None, greedy):
            got, want = ops.topk(low, k, flags), ops.topk(low.float(), k, flags)
            assert got[0].dtype == torch.float32
            assert torch.equal(got[1], want[1]), (dtype, flags)
            assert torch.equal(got[0].nan_to_num(0.5), want[0].nan_to_num(0.5)), (dtype, flags)


def test_topk_greedy_rows_get_only_their_argmax(ops):
    """Rows flagged greedy get their argmax first (torch.argmax's first index among ties, a NaN
    row's first NaN) and -inf with that index after it; the other rows their full top-k."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 49152, generator=g) * 3
    x[1, [30000, 12]] = 99.0  # tie: 12
    x[3, [500, 40]] = float("nan")  # the first NaN, 40
    greedy = torch.tensor([True, True, False, True, False, True])
    for dtype in (torch.float32, torch.bfloat16):
        values, ids = ops.topk(x.to(dtype), 256, greedy)
        want_values, want_ids = ops.topk(x.to(dtype), 256)
        rows = ~greedy
        assert torch.equal(values[rows], want_values[rows])
        assert torch.equal(ids[rows], want_ids[rows])
        argmax = x.to(dtype).float().argmax(dim=-1)
        assert torch.equal(ids[greedy, 0], argmax[greedy])
        assert ids[[1, 3], 0].tolist() == [12, 40]
        assert bool((values[greedy, 1:] == float("-inf")).all())
        assert torch.equal(ids[greedy, 1:], ids[greedy, :1].expand(-1, 255))
    with pytest.raises(RuntimeError, match=r"topk: greedy must be \[6\] \(one flag a row\)"):
        ops.topk(x, 256, greedy[:5])


def test_sampler_uses_the_fused_topk_only_when_set(ops):
    from nxdi_common.config import OnDeviceSamplingConfig
    from nxdi_common.modules.sampling import Sampler, prepare_sampling_params
    sampler = Sampler(OnDeviceSamplingConfig(do_sample=True, dynamic=True, global_topk=256))
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 49152, generator=g) * 3
    params = prepare_sampling_params(6, top_k=[1, 50, 256, 0, 5, 1], top_p=[1, 0.9, 0.5, 1, 1, 1],
                                     temperature=[0, 1.0, 0.7, 1.3, 1.0, 1.0])
    rand = torch.rand(6, generator=g)
    want = sampler(logits, params, rand)
    sampler.fused = ops
    assert torch.equal(sampler(logits, params, rand), want)
    # bf16 logits go to the fused op as they are: the same tokens as their float32 copy (bf16
    # ties: both through the fused op, which orders equal logits by index, torch.topk not)
    low = logits.bfloat16()
    assert torch.equal(sampler(low, params, rand), sampler(low.float(), params, rand))


def test_greedy_sampler_with_the_fused_op_is_argmax(ops):
    """A greedy config's sampler reads the argmax from the fused top-1 scan: torch.argmax's
    first index among tied maxima, a NaN row's first NaN, in float32 and bf16."""
    from nxdi_common.config import OnDeviceSamplingConfig
    from nxdi_common.modules.sampling import Sampler
    sampler = Sampler(OnDeviceSamplingConfig(do_sample=False))
    sampler.fused = ops
    logits = torch.randn(16, 49152, generator=torch.Generator().manual_seed(5)) * 3
    logits[3, [40000, 17, 9000]] = 99.0  # tie: argmax takes 17
    logits[4, [300, 200]] = float("nan")  # NaN is the maximum: the first NaN, 200
    logits[5] = -1.0  # all equal: 0
    logits[6, 49151] = float("inf")
    for x in (logits, logits.bfloat16()):
        tokens = sampler(x)
        assert tokens.dtype == torch.int64 and tokens.shape == (16,)
        assert torch.equal(tokens, x.float().argmax(dim=-1))
    assert sampler(logits)[3:7].tolist() == [17, 200, 0, 49151]
    traced = torch.jit.trace(sampler, (logits,))
    shuffled = logits[:, torch.randperm(49152, generator=torch.Generator().manual_seed(6))]
    assert torch.equal(traced(shuffled), shuffled.argmax(dim=-1))


def test_bad_shapes_are_refused_with_the_field(ops):
    with pytest.raises(RuntimeError, match="rms_norm: weight must be"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="rope_qk: cos and sin must be"):
        ops.rope_qk(torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8), 2)
    with pytest.raises(RuntimeError, match="silu_mul: the last dimension"):
        ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="topk: k must lie in 1..8, got 9"):
        ops.topk(torch.randn(2, 8), 9)


def qkv_views(batch, heads, kv_heads, seq, dim, dtype, seed=0):
    """q [B, H, S, D], k and v [B, Hkv, S, D] as the attention module hands them over: strided
    views of one [B, S, H + 2 Hkv, D] projection output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    return x.transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)


def sdpa(q, k, v, **kw):  # [B, S, H, D], the op's layout
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                          **kw).transpose(1, 2)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("shape", [
    (1, 9, 3, 1100, 64),  # the bundled model's heads; three 512-key chunks, a 64-row tail block
    (2, 4, 2, 100, 64),  # batch of two, the sequence not a multiple of 16
    (3, 4, 1, 130, 64),  # MQA
    (1, 4, 4, 700, 128),  # MHA, two 64-wide head-dim panels
    (1, 2, 1, 1, 64),  # a one-token prompt
])
def test_causal_attention_is_as_close_to_float32_as_sdpa(ops, dtype, shape):
    q, k, v = qkv_views(*shape, dtype)
    scale = shape[-1] ** -0.5
    got = ops.causal_attention(q, k, v, scale)
    assert got.dtype == dtype and got.shape == (shape[0], shape[3], shape[1], shape[4])
    assert got.is_contiguous()
    want = sdpa(q.float(), k.float(), v.float())
    torch_err = (sdpa(q, k, v).float() - want).abs().max().item()
    err = (got.float() - want).abs().max().item()
    assert err <= 1.5 * torch_err + 1e-3, (err, torch_err)
    if shape[3] > 1 and kernel_expected(dtype):
        assert not torch.equal(got, sdpa(q, k, v)), "the kernel did not run (torch's SDPA did)"


def kernel_expected(dtype) -> bool:
    """Where causal_attention runs its own kernel for the 16-bit dtypes: every x86 CPU with AVX2
    and FMA (oneDNN's brgemm where it packs the dtype, i.e. AMX; else our float32 tile path, as
    on AVX2-only CPUs and on AVX-512 without AMX such as AMD Zen 4)."""
    return dtype in HALF_DTYPES and {"avx2", "fma"} <= kernels.cpu_flags()


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 64), (torch.bfloat16, 32)])
def test_causal_attention_falls_back_to_sdpa(ops, dtype, dim):
    q, k, v = qkv_views(2, 4, 2, 70, dim, dtype)
    assert torch.equal(ops.causal_attention(q, k, v, dim ** -0.5), sdpa(q, k, v))
    q, k, v = qkv_views(1, 2, 1, 40, 64, torch.bfloat16)  # scale <= 0: torch's SDPA too
    torch.testing.assert_close(ops.causal_attention(q, k, v, -0.5), sdpa(q, k, v, scale=-0.5),
                               rtol=0, atol=0, equal_nan=True)


def test_causal_attention_refuses_bad_shapes(ops):
    q, k, v = qkv_views(1, 4, 2, 8, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="causal_attention: k and v must be"):
        ops.causal_attention(q, k[:, :, :4], v[:, :, :4], 0.125)
    q3, k3, v3 = qkv_views(1, 3, 2, 8, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="kv_heads dividing the query heads"):
        ops.causal_attention(q3, k3, v3, 0.125)
    with pytest.raises(RuntimeError, match="share one dtype"):
        ops.causal_attention(q, k.float(), v, 0.125)


def chunk_case(batch, heads, kv_heads, queries, cache_len, first, dim, dtype, seed=0):
    """q [B, H, S, D] at positions first..first+S-1 (row b starts b * 7 later), k and v
    [B, Hkv, T, D] as the cache gather hands them over."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, queries, heads, dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(batch, cache_len, kv_heads, dim, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(batch, cache_len, kv_heads, dim, generator=g).to(dtype).transpose(1, 2)
    pos = first + torch.arange(queries) + 7 * torch.arange(batch).unsqueeze(1)
    return q, k, v, pos


def masked_sdpa(q, k, v, pos, **kw):  # [B, S, H, D], the op's layout
    allowed = torch.arange(k.shape[2]).view(1, 1, 1, -1) <= pos.view(pos.shape[0], 1, -1, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True,
                                          **kw).transpose(1, 2)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("shape", [
    (1, 9, 3, 128, 2048, 1664, 64),  # the bundled model: the last chunk of a 1792-token prompt
    (1, 9, 3, 100, 2048, 37, 64),  # a chunk early in the cache: keys stop far short of it
    (2, 4, 2, 70, 512, 300, 128),  # two rows at different positions, 128-wide heads
    (1, 4, 1, 5, 64, 0, 64),  # from position 0 (a whole short prompt)
    (1, 2, 2, 1, 600, 599, 64),  # one query at the cache's last position
])
def test_chunk_attention_is_as_close_to_float32_as_sdpa(ops, dtype, shape):
    q, k, v, pos = chunk_case(*shape, dtype)
    got = ops.chunk_attention(q, k, v, pos, shape[-1] ** -0.5)
    assert got.dtype == dtype and got.shape == (shape[0], shape[3], shape[1], shape[6])
    assert got.is_contiguous()
    want = masked_sdpa(q.float(), k.float(), v.float(), pos)
    torch_err = (masked_sdpa(q, k, v, pos).float() - want).abs().max().item()
    err = (got.float() - want).abs().max().item()
    assert err <= 1.5 * torch_err + 1e-3, (err, torch_err)
    if kernel_expected(dtype) and shape[3] > 4:
        assert not torch.equal(got, masked_sdpa(q, k, v, pos)), "the kernel did not run"


def test_bf16_attention_runs_on_bf16_dot_products_where_the_cpu_has_them(ops):
    """On AVX512-BF16 CPUs the tile path multiplies bf16 on vdpbf16ps, which flushes subnormal
    inputs to zero: values of 2^-130 average to 0 there and to 2^-130 on the float32 path. (The
    closeness tests above hold for both.) causal_attention runs oneDNN's brgemm on AMX CPUs."""
    flags = kernels.cpu_flags()
    q, k, v, pos = chunk_case(1, 4, 2, 70, 256, 100, 64, torch.bfloat16)
    v = torch.full_like(v, 2.0 ** -130)  # subnormal in bf16 and float32
    chunk = ops.chunk_attention(q, k, v, pos, 0.125).float()
    causal = ops.causal_attention(q, k[:, :, :70], v[:, :, :70], 0.125).float()
    results = [chunk] if "amx_bf16" in flags else [chunk, causal]
    for got in results:
        if "avx512_bf16" in flags:
            assert not got.any()
        else:
            assert bool((got > 0).all())


def test_chunk_attention_reads_no_key_past_a_querys_position(ops):
    """Keys and values past the chunk's positions (the cache's stale or unwritten slots) change
    nothing, even when they are NaN."""
    q, k, v, pos = chunk_case(1, 4, 2, 40, 512, 200, 64, torch.bfloat16)
    clean = ops.chunk_attention(q, k, v, pos, 0.125)
    k, v = k.clone(), v.clone()
    k[:, :, 240:] = float("nan")
    v[:, :, 240:] = float("nan")
    assert torch.equal(ops.chunk_attention(q, k, v, pos, 0.125), clean)


def test_chunk_attention_falls_back_to_sdpa_and_refuses_bad_input(ops):
    q, k, v, pos = chunk_case(1, 4, 2, 9, 64, 20, 64, torch.float32)
    torch.testing.assert_close(ops.chunk_attention(q, k, v, pos, 0.125),
                               masked_sdpa(q, k, v, pos, scale=0.125), rtol=1e-6, atol=1e-6)
    q, k, v, pos = chunk_case(1, 4, 2, 9, 64, 20, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"positions must lie in 0..63"):
        ops.chunk_attention(q, k, v, pos + 40, 0.125)
    with pytest.raises(RuntimeError, match=r"positions must be \[batch, queries\]"):
        ops.chunk_attention(q, k, v, pos[:, :4], 0.125)
    with pytest.raises(RuntimeError, match="kv_heads dividing the query heads"):
        ops.chunk_attention(q[:, :3], k, v, pos, 0.125)


def test_context_encoding_uses_the_attention_kernel(tmp_path):
    """A bf16 model with 64-wide heads (the kernel's case): context encoding with the fused ops
    gives the torch path's logits to bf16 rounding and the same greedy tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, num_hidden_layers=2,
                                 vocab_size=256)).save_pretrained(tmp_path)
    runs = {}
    for kind in ("fused", "torch"):
        model = NeuronLlamaForCausalLM(tmp_path, neuron_config=fused_config(cpu_fused_ops=kind))
        model.to_cpu()
        runs[kind] = greedy(model)
    assert torch.equal(runs["fused"].argmax(-1), runs["torch"].argmax(-1))
    torch.testing.assert_close(runs["fused"], runs["torch"], rtol=0, atol=0.05)


def test_mlp_uses_the_op_only_when_set(ops):
    mlp = NeuronLlamaMLP(32, 48, False, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for p in mlp.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.2).to(torch.bfloat16)
    x = torch.randn(3, 32, generator=g).bfloat16()
    want = mlp(x)
    mlp.fused = ops
    assert torch.equal(mlp(x), want)


def fused_config(**overrides) -> NeuronConfig:
    kwargs = dict(batch_size=2, seq_len=64, torch_dtype=torch.bfloat16, enable_bucketing=True,
                  context_encoding_buckets=[32, 64], token_generation_buckets=[64], backend="cpu",
                  fused_qkv=True)
    kwargs.update(overrides)
    return NeuronConfig(**kwargs)


def greedy(model, steps: int = 6) -> torch.Tensor:
    model.reset()
    prompt = (torch.arange(40) * 37 + 11).remainder(256).view(2, 20)
    logits = [model(prompt).logits]
    for _ in range(steps):
        logits.append(model(logits[-1].argmax(-1, keepdim=True)).logits)
    return torch.stack(logits)


def test_block_cache_graphs_rotate_and_store_keys_in_one_op(tiny_llama_ckpt, tmp_path,
                                                            compile_cache_dir):
    """Block KV layout, fused ops: token generation rotates q and k and stores k and v with
    nxdi::rope_qk_store (no index_copy_ left in its graph); context encoding, which attends to
    its own keys, still writes them apart. Greedy logits equal the torch-ops build's."""
    block = dict(torch_dtype=torch.float32, is_block_kv_layout=True, pa_block_size=8,
                 pa_num_blocks=16)
    fused = NeuronLlamaForCausalLM(tiny_llama_ckpt,
                                   neuron_config=fused_config(cpu_weight_layout="panels", **block))
    fused.compile(tmp_path / "fused")
    fused.load(tmp_path / "fused")
    plain = NeuronLlamaForCausalLM(tiny_llama_ckpt,
                                   neuron_config=fused_config(cpu_fused_ops="torch", **block))
    plain.to_cpu()
    tkg = str(next(iter(fused.token_generation_model.runnables.values())).inlined_graph)
    cte = str(next(iter(fused.context_encoding_model.runnables.values())).inlined_graph)
    assert "nxdi::rope_qk_store" in tkg and "aten::index_copy_" not in tkg
    # attention straight from the whole cache, q heads-last: no selects of the cache's layers
    assert "nxdi::paged_decode_attention_layer" in tkg and "aten::select" not in tkg
    assert "nxdi::rope_qk_store" not in cte and "aten::index_copy_" in cte
    # every RMSNorm inside the product it feeds (panel_linear's norm): none apart in the step;
    # context encoding keeps the attention's (its projection is not followed by rope_qk_store)
    layers = fused.config.num_hidden_layers
    assert "nxdi::rms_norm" not in tkg and tkg.count("nxdi::panel_linear") == 4 * layers + 1
    assert cte.count("nxdi::rms_norm") == layers
    torch.testing.assert_close(greedy(fused), greedy(plain), rtol=0, atol=1e-5)


def test_choice_validation_and_fallback(tiny_llama_ckpt, monkeypatch):
    with pytest.raises(ValueError, match="cpu_fused_ops must be one of"):
        fused_config(cpu_fused_ops="fast")
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=fused_config())
    assert model.resolve_fused_ops("cpu") == kernels.FUSED
    assert model.resolve_fused_ops("neuron") == kernels.TORCH_OPS
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_build_and_load",
                        lambda: (_ for _ in ()).throw(OSError("no C++ compiler")))
    assert model.resolve_fused_ops("cpu") == kernels.TORCH_OPS
    explicit = NeuronLlamaForCausalLM(tiny_llama_ckpt,
                                      neuron_config=fused_config(cpu_fused_ops="fused"))
    with pytest.raises(ValueError, match="'fused' cannot be used: .*no C\\+\\+ compiler"):
        explicit.resolve_fused_ops("cpu")


def test_compiled_graphs_record_the_choice(tiny_llama_ckpt, tmp_path, compile_cache_dir):
    """Fused and torch builds of the same bf16 model: the graphs call the fused ops only when
    chosen, give the same greedy logits to bf16 rounding, and a folder compiled one way is
    refused by a config that resolves the other."""
    fused_dir, torch_dir = tmp_path / "fused", tmp_path / "torch"
    fused = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=fused_config())
    fused.compile(fused_dir)
    fused.load(fused_dir)
    plain = NeuronLlamaForCausalLM(tiny_llama_ckpt,
                                   neuron_config=fused_config(cpu_fused_ops="torch"))
    plain.compile(torch_dir)
    plain.load(torch_dir)
    for model, folder, kind in ((fused, fused_dir, "fused"), (plain, torch_dir, "torch")):
        assert model.fused_ops == kind
        assert json.loads((folder / MANIFEST).read_text())["fused_ops"] == kind
        for wrapper in (model.context_encoding_model, model.token_generation_model):
            graph = str(next(iter(wrapper.runnables.values())).inlined_graph)
            for op in ("nxdi::rms_norm", "nxdi::rope_qk", "nxdi::silu_mul"):
                assert (op in graph) == (kind == "fused"), (wrapper.tag, op)
            attention = "nxdi::causal_attention" in graph  # context encoding only
            assert attention == (kind == "fused" and wrapper is model.context_encoding_model)
    a, b = greedy(fused), greedy(plain)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    torch.testing.assert_close(a, b, rtol=0, atol=0.05)
    other = NeuronLlamaForCausalLM(tiny_llama_ckpt, config=LlamaInferenceConfig.load(fused_dir))
    with pytest.raises(ValueError, match="compiled for 'torch' "
                                         "norm/RoPE/activation/top-K/prefill-attention ops"):
        other.load(torch_dir)
