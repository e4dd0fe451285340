"""The panel layout for linear weights (modules/linear.py, kernels/panel_linear.cpp): the kernel's
product is the exact product rounded once to the dtype, to float32 summation error, for every
tile shape (1-6 rows, even splits of more, float16 panels widened once), partial panels, bias
and residual, int8 panels with their scale; Linear uses it when its weight is in panels, traced graphs take panels
as inputs, a model built with it gives the plain layout's tokens, "auto" picks it on x86 CPUs
without AMX, bfloat16 products run on the CPU's bf16 dot products where it has them (from
bfloat16 weights in pairs, the layout packed there, with the same results as from panels), and
bad arguments are refused with the argument named."""
import io
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nxdi_common import kernels
from nxdi_common.application_base import MANIFEST
from nxdi_common.config import NeuronConfig
from nxdi_common.models.llama import NeuronLlamaForCausalLM
from nxdi_common.models.llama.modeling_llama import LlamaInferenceConfig
from nxdi_common.modules.linear import (PANELS, PLAIN, Linear, pack_linear_weights, pack_panels,
                                       panel_pairs_native)
from nxdi_common.modules.quantization import dequantize, quantize_tensor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ops():
    return kernels.fused_ops()


def assert_rounded_product(got, x, w, bias=None, residual=None):
    """got == dtype(x @ w.T + bias + residual) up to float32 summation error: within half an ulp
    of the dtype (it is rounded once) plus K * 2^-23 times the sum of |x_k w_k|."""
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * (x.shape[-1] * 2.0 ** -23)
    for extra in (bias, residual):
        if extra is not None:
            exact = exact + extra.double()
    eps = torch.finfo(got.dtype).eps
    err = (got.double() - exact).abs()
    assert got.dtype == x.dtype and got.shape == exact.shape
    assert bool((err <= eps * exact.abs() + bound + 1e-30).all()), (err - eps * exact.abs()).max()


def test_pack_panels_layout():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3).bfloat16()
    p = pack_panels(w, pairs=False)
    assert p.shape == (2, 3, 16) and p.dtype == torch.bfloat16
    for n in range(20):
        assert torch.equal(p[n // 16, :, n % 16], w[n])
    assert torch.equal(p[1, :, 4:], torch.zeros(3, 12, dtype=torch.bfloat16))


@pytest.mark.parametrize("out_features, in_features", [(20, 7), (32, 6), (16, 1)])
def test_pack_panels_pairs_layout(out_features, in_features):
    """pairs[p, i, 2j + h] = w[16p + j, 2i + h]; zero past the last output and the last input."""
    w = (torch.arange(out_features * in_features, dtype=torch.float32) + 1).view(
        out_features, in_features).bfloat16()
    p = pack_panels(w, pairs=True)
    panels, half = -(-out_features // 16), -(-in_features // 2)
    assert p.shape == (panels, half, 32) and p.dtype == torch.bfloat16
    expect = torch.zeros(panels * 16, 2 * half, dtype=torch.bfloat16)
    expect[:out_features, :in_features] = w
    for n in range(panels * 16):
        for k in range(2 * half):
            assert p[n // 16, k // 2, 2 * (n % 16) + k % 2] == expect[n, k], (n, k)
    with pytest.raises(ValueError, match="only bfloat16 weights come in pairs, got torch.float16"):
        pack_panels(w.half(), pairs=True)


def test_bf16_weights_come_in_pairs_where_the_kernel_multiplies_them_natively():
    native = panel_pairs_native()
    assert native == ("avx512_bf16" in kernels.cpu_flags())
    assert pack_panels(torch.ones(16, 4).bfloat16()).shape == ((1, 2, 32) if native else (1, 4, 16))
    assert pack_panels(torch.ones(16, 4).half()).shape == (1, 4, 16)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 33, 40])
@pytest.mark.parametrize("in_features", [77, 64])
def test_pairs_give_the_panels_results_bit_for_bit(ops, rows, in_features):
    """The same sums in the same order from either layout: bf16 x on the dot products (its
    tiles of 8 rows, pairs read in place vs interleaved on the fly up to 32 rows and once past),
    float32 x on the float32 path (which reorders pairs back into panels); bias and residual.
    Where pairs run on AMX tiles (their own test below) both are the rounded exact product."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(40, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    bias, residual = torch.randn(40, generator=g).bfloat16(), torch.randn(rows, 40).bfloat16()
    pairs, panels = pack_panels(w, pairs=True), pack_panels(w, pairs=False)
    for args in ((), (bias,), (None, residual), (bias, residual)):
        got = ops.panel_linear(x, pairs, 40, *args)
        if kernels.panel_amx_tiles():
            assert_rounded_product(got, x, w, *args)
        else:
            assert torch.equal(got, ops.panel_linear(x, panels, 40, *args))
    assert_rounded_product(ops.panel_linear(x, pairs, 40), x, w)
    assert torch.equal(ops.panel_linear(x.float(), pairs, 40),
                       ops.panel_linear(x.float(), panels, 40))


def same_bits_without_prefetch(ops, x, panels, out_features):
    """x times panels with panel_prefetch off, asserted bit for bit equal to the product with
    it on (the default, set back and read back afterwards); returns the product."""
    try:
        assert torch.ops.nxdi.panel_prefetch(0) is False
        without = ops.panel_linear(x, panels, out_features)
    finally:
        assert torch.ops.nxdi.panel_prefetch(1) is True
    assert torch.equal(ops.panel_linear(x, panels, out_features), without)
    return without


needs_amx_tiles = pytest.mark.skipif(
    not kernels.panel_amx_tiles(), reason="bf16 pairs run on AMX tiles only on CPUs with AMX")


@needs_amx_tiles
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32, 33, 64, 300])
@pytest.mark.parametrize("in_features", [64, 77, 600])
def test_amx_tiles_give_the_rounded_exact_product(ops, rows, in_features):
    """bf16 x times bf16 pairs on AMX tiles: one A tile (up to 16 rows) or two (up to 32) a
    block, several blocks and row blocks (300 rows of 600 inputs: 224-row blocks), inputs in
    whole 32-input tiles (64) and with a zero-padded last tile (77: odd, 600: 24 left), three
    panels (two, then one alone), the last partial; bias and residual before the one rounding."""
    g = torch.Generator().manual_seed(rows * in_features)
    w = torch.randn(40, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    bias, residual = torch.randn(40, generator=g).bfloat16(), torch.randn(rows, 40).bfloat16()
    pairs = pack_panels(w, pairs=True)
    for args in ((), (bias,), (None, residual), (bias, residual)):
        assert_rounded_product(ops.panel_linear(x, pairs, 40, *args), x, w, *args)


@needs_amx_tiles
@pytest.mark.parametrize("in_features", [600, 77])
def test_amx_stream_prefetch_changes_no_result(ops, torch_threads, in_features):
    """Up to four rows the AMX tiles prefetch both panels' stream 4 KB ahead, past the first
    panel's end into the next pair's (panel_prefetch turns it off for A/B runs): the same bits
    either way, for pairs of panels and a panel alone, on one thread and two."""
    g = torch.Generator().manual_seed(in_features)
    w = torch.randn(40, in_features, generator=g).bfloat16()
    pairs = pack_panels(w, pairs=True)
    for threads in (1, 2):
        with torch_threads(threads):
            for rows in (1, 2, 4):
                x = torch.randn(rows, in_features, generator=g).bfloat16()
                assert_rounded_product(same_bits_without_prefetch(ops, x, pairs, 40), x, w)


@needs_amx_tiles
def test_amx_tiles_beside_onednn_amx_products_on_two_threads(ops):
    """oneDNN's packed bf16 products and the causal attention's brgemm (AMX kernels of their own
    here) set the same per-thread tile configuration; ours, called in between on two threads,
    loads its own each time and releases it, and all stay right."""
    from nxdi_common.modules.linear import onednn_ops, pack_weight
    g = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(96, 256, generator=g).bfloat16(), torch.randn(40, 96, generator=g).bfloat16()
    packed, pairs = pack_weight(w1), pack_panels(w2, pairs=True)
    q = torch.randn(1, 9, 100, 64, generator=g).bfloat16()
    k, v = torch.randn(1, 3, 100, 64, generator=g).bfloat16(), torch.randn(1, 3, 100, 64).bfloat16()
    attention = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                               enable_gqa=True).transpose(1, 2)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (1, 20, 64, 5):
            x = torch.randn(rows, 256, generator=g).bfloat16()
            h = onednn_ops()[0](x, packed, None)
            assert torch.allclose(h.float(), x.float() @ w1.float().T, rtol=2e-2, atol=2e-2)
            assert_rounded_product(ops.panel_linear(h, pairs, 40), h, w2)
            torch.testing.assert_close(ops.causal_attention(q, k, v, 0.125).float(), attention,
                                       rtol=2e-2, atol=2e-2)
            assert_rounded_product(ops.panel_linear(h, pairs, 40), h, w2)
            assert torch.allclose(onednn_ops()[0](x, packed, None).float(), h.float())
    finally:
        torch.set_num_threads(previous)


@needs_amx_tiles
def test_amx_tiles_can_be_turned_off_for_comparisons():
    """NXDI_PANEL_AMX_MIN_ROWS=0: pairs run on the dot products (or wherever they would without
    AMX) and the library says so."""
    code = ("import torch; from nxdi_common import kernels; "
            "from nxdi_common.modules.linear import pack_panels; "
            "amx = kernels.panel_amx_tiles(); torch.manual_seed(0); "
            "w = torch.randn(40, 77).bfloat16(); x = torch.randn(3, 77).bfloat16(); "
            "y = torch.ops.nxdi.panel_linear(x, pack_panels(w), 40); "
            "ref = x.float() @ w.float().T; "
            "print(amx, ((y.float() - ref).abs() / (ref.abs() + 1)).max().item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "NXDI_PANEL_AMX_MIN_ROWS": "0"})
    amx, err = out.stdout.split()
    assert amx == "False" and float(err) < 2 ** -7  # the output's bf16 rounding (outputs
    # reach 30-40 here, where a bf16 step is 0.25: an absolute bound failed now and then)


def _stream_prefetch_run(env_value: str):
    """(the library's stream-prefetch choice, products of 1-5 rows) in a process whose
    NXDI_PANEL_STREAM_PREFETCH is env_value ("" leaves the default)."""
    code = ("import torch; from nxdi_common import kernels; "
            "from nxdi_common.modules.linear import pack_panels; "
            "assert kernels.kernels_unavailable_reason() is None; "
            "g = torch.Generator().manual_seed(0); "
            "w = torch.randn(600, 577, generator=g).bfloat16(); p = pack_panels(w); "
            "ys = [torch.ops.nxdi.panel_linear(torch.randn(m, 577, generator=g).bfloat16(), p, "
            "600).float().tolist() for m in range(1, 6)]; "
            "import json; print(json.dumps([torch.ops.nxdi.panel_stream_prefetch(), ys]))")
    env = {**os.environ, "NXDI_PANEL_STREAM_PREFETCH": env_value}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_panels_read_in_place_prefetch_their_stream_where_it_pays_and_where_asked():
    """Panels read in place from memory prefetch their stream in software on Intel CPUs (one
    core reads memory far slower there without), on AMD Zen 5 and later (family 26: a batch-1
    step 0.93x the time) and where the library is built without AVX512-BF16 (AVX2: every
    panel_rows tile, kStreamBytes ahead), not on AMD Zen 4 (where it decides up to 4 rows of
    bf16 pairs and the hardware prefetchers read them faster alone);
    NXDI_PANEL_STREAM_PREFETCH=0/1 decides where set. Either way the products are the same."""
    expected = (kernels.cpu_is_intel() or "avx512_bf16" not in kernels.cpu_flags()
                or kernels.cpu_family() >= 26)
    default, on, off = (_stream_prefetch_run(v) for v in ("", "1", "0"))
    assert default[0] is expected
    assert on[0] is True and off[0] is False
    assert on[1] == off[1] == default[1]


def _fma_run(env_value: str):
    """(the library's FMA row threshold, {rows: (x, w, y from pairs, y from panels)} for 1-40
    rows and an odd K) in a process whose NXDI_PANEL_FMA_MIN_ROWS is env_value ("": default)."""
    code = ("import io, sys, torch; from nxdi_common import kernels; "
            "from nxdi_common.modules.linear import pack_panels; "
            "assert kernels.kernels_unavailable_reason() is None; "
            "g = torch.Generator().manual_seed(1); "
            "w = torch.randn(40, 77, generator=g).bfloat16(); "
            "pairs, panels = pack_panels(w, pairs=True), pack_panels(w, pairs=False); "
            "xs = {m: torch.randn(m, 77, generator=g).bfloat16() "
            "for m in (1, 3, 4, 5, 8, 9, 15, 16, 17, 33, 40)}; "
            "out = {m: (x, torch.ops.nxdi.panel_linear(x, pairs, 40), "
            "torch.ops.nxdi.panel_linear(x, panels, 40)) for m, x in xs.items()}; "
            "buf = io.BytesIO(); torch.save([torch.ops.nxdi.panel_fma_min_rows(), w, out], buf); "
            "sys.stdout.buffer.write(buf.getvalue())")
    env = {**os.environ, "NXDI_PANEL_FMA_MIN_ROWS": env_value}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, env=env)
    return torch.load(io.BytesIO(out.stdout))


@pytest.mark.skipif(not panel_pairs_native(), reason="the FMA tiles are the bf16 dot-product "
                    "path's (CPUs with AVX512-BF16)")
def test_products_of_many_rows_run_on_float32_fmas_on_intel_and_where_asked():
    """From NXDI_PANEL_FMA_MIN_ROWS rows (default 4 on Intel, where vdpbf16ps is half-rate; 0,
    never, elsewhere) bf16 products widen the pairs to float32 and multiply on FMAs (tiles of up
    to 16 rows): still the rounded exact product, the same from pairs as from panels, and the
    same results as the dot products to float32 summation error."""
    intel = kernels.cpu_is_intel()
    default, fma, dot = (_fma_run(v) for v in ("", "1", "0"))
    assert default[0] == (4 if intel else 0) and fma[0] == 1 and dot[0] == 0
    w = fma[1]
    for rows, (x, from_pairs, from_panels) in fma[2].items():
        assert torch.equal(from_pairs, from_panels), rows
        assert_rounded_product(from_pairs, x, w)
        assert torch.allclose(from_pairs.float(), dot[2][rows][1].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 24, 30, 301])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_product_is_the_rounded_exact_product(ops, rows, wdtype):
    """Every tile shape: 1-6 rows in one tile, and the even splits of more (8: 4 + 4; 13: 5 + 4
    + 4; 16: 6 + 5 + 5), a bf16 panel read in place (its even and odd columns widened apart and
    put back in order), float16 panels widened once from 7 rows."""
    g = torch.Generator().manual_seed(rows)
    out_features, in_features = 40, 77  # a partial last panel, an odd K
    w = torch.randn(out_features, in_features, generator=g).to(wdtype)
    xdtype = torch.float32 if wdtype == torch.float32 else wdtype
    x = torch.randn(rows, in_features, generator=g).to(xdtype)
    assert_rounded_product(ops.panel_linear(x, pack_panels(w, pairs=False), out_features), x, w)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
def test_the_next_panel_prefetch_changes_no_result(ops, wdtype):
    """Widened panels (float16 from 7 rows) prefetch the next panel, and bf16 panels read in
    place their own stream where panel_stream_prefetch() (both under panel_prefetch, on by
    default and set for A/B runs): the same bits either way, and the setting reads back."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(72, 300, generator=g).to(wdtype)
    x = torch.randn(16, 300, generator=g).to(wdtype)
    panels = pack_panels(w, pairs=False)
    assert torch.ops.nxdi.panel_prefetch() is True
    assert_rounded_product(same_bits_without_prefetch(ops, x, panels, 72), x, w)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 40])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_products_split_over_threads_equal_one_thread(ops, torch_threads, threads, rows, wdtype):
    """Products whose tasks of four panels the threads cannot share evenly (576 outputs: nine
    tasks) run in tasks of one tile's panels; every output is still computed once, as on one
    thread, bit for bit (each output's sums do not depend on the split)."""
    g = torch.Generator().manual_seed(rows * threads)
    for out_features in (576, 40, 240, 1040):  # 9, 1, 4 and 17 tasks of four panels
        w = torch.randn(out_features, 96, generator=g).to(wdtype)
        x = torch.randn(rows, 96, generator=g).to(wdtype)
        panels = pack_panels(w)
        one = ops.panel_linear(x, panels, out_features)
        with torch_threads(threads):
            split = ops.panel_linear(x, panels, out_features)
        assert torch.equal(split, one), out_features
        assert_rounded_product(split, x, w)


@pytest.mark.parametrize("rows", [1, 8, 9, 20, 33])
def test_bf16_products_run_on_bf16_dot_products_where_the_cpu_has_them(ops, rows):
    """On AVX512-BF16 CPUs bfloat16 x times bfloat16 panels run on vdpbf16ps, which flushes
    subnormal inputs to zero; the float32 path (and any other CPU) keeps them. Both paths are
    the rounded exact product for normal values (test above). Rows cover the dot path's
    tiles (8 rows) and its panels interleaved on the fly (<= 32 rows) and once (more)."""
    tiny = torch.full((rows, 33), 2.0 ** -130).bfloat16()  # subnormal in bf16 and float32
    w = torch.ones(20, 33).bfloat16()  # two panels, the second partial; odd K
    got = ops.panel_linear(tiny, pack_panels(w, pairs=False), 20).float()
    if "avx512_bf16" in kernels.cpu_flags():
        assert not got.any()
    else:
        assert bool((got > 0).all())
    normal = torch.randn(rows, 33).bfloat16()
    assert_rounded_product(ops.panel_linear(normal, pack_panels(w, pairs=False), 20), normal, w)
    assert_rounded_product(ops.panel_linear(normal, pack_panels(w, pairs=True), 20), normal, w)


@pytest.mark.parametrize("rows", [1, 6, 7, 30])
@pytest.mark.parametrize("per_channel", [True, False])
def test_int8_panels_times_their_scale_are_the_rounded_exact_product(ops, rows, per_channel):
    """int8 weights (modules/quantization.py) with a scale per output or one for all: the
    product of the dequantized weight, rounded once; bias and residual added before that."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(40, 77, generator=g)
    q, scale = quantize_tensor(w, "per_channel_symmetric" if per_channel else
                               "per_tensor_symmetric")
    assert q.dtype == torch.int8 and scale.shape == ((40,) if per_channel else (1,))
    dense = dequantize(q, scale)
    x = torch.randn(rows, 77, generator=g).bfloat16()
    bias, residual = torch.randn(40, generator=g).bfloat16(), torch.randn(rows, 40).bfloat16()
    p = pack_panels(q)
    assert p.dtype == torch.int8 and p.shape == (3, 77, 16)
    assert_rounded_product(ops.panel_linear(x, p, 40, None, None, scale), x, dense)
    assert_rounded_product(ops.panel_linear(x, p, 40, bias, residual, scale.bfloat16()), x,
                           dequantize(q, scale.bfloat16()), bias, residual)


@pytest.mark.parametrize("rows", [1, 5, 8, 40])
@pytest.mark.parametrize("kind", ["bf16 pairs", "bf16", "float32", "int8"])
def test_a_norm_inside_the_product_is_the_norm_then_the_product_bit_for_bit(ops, rows, kind):
    """panel_linear(x, ..., norm=w, eps) normalizes x's rows as nxdi::rms_norm does, then
    multiplies: equal bits to the two ops, for every panel kind and bias (2-16 rows: on the bf16
    dot products each thread norms them for itself; 80: before the product); a norm weight of the
    wrong size is refused by rms_norm's message."""
    g = torch.Generator().manual_seed(rows)
    dtype = torch.float32 if kind == "float32" else torch.bfloat16
    w = torch.randn(40, 77, generator=g)
    scale = None
    if kind == "int8":
        q, scale = quantize_tensor(w, "per_channel_symmetric")
        panels, scale = pack_panels(q), scale.bfloat16()
    else:
        panels = pack_panels(w.to(dtype), pairs=kind == "bf16 pairs")
    x = (torch.randn(2, rows, 77, generator=g) * 3).to(dtype)
    norm_w, bias = torch.randn(77, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    want = ops.panel_linear(ops.rms_norm(x, norm_w, 1e-5), panels, 40, bias, None, scale)
    got = ops.panel_linear(x, panels, 40, bias, None, scale, norm_w, 1e-5)
    assert torch.equal(got, want)
    assert not torch.equal(ops.panel_linear(x, panels, 40, bias, None, scale, norm_w, 1e-1), want)
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be \[n\] for x"):
        ops.panel_linear(x, panels, 40, bias, None, scale, norm_w[:-1], 1e-5)


def test_products_of_other_shapes_in_turn_reuse_no_stale_rows(ops):
    """A decode step's products in turn (rows and K changing, with and without a norm): each
    thread's buffers for x's pairs and normed rows are kept between calls and only grow; every
    product still equals its two-op reference, and the same bits come out with x's pairs made
    on the calling thread instead (panel_x_per_thread off)."""
    g = torch.Generator().manual_seed(7)
    shapes = [(16, 96, 40), (3, 200, 24), (16, 96, 40), (1, 64, 32), (9, 31, 48), (32, 200, 16)]
    assert ops.panel_x_per_thread(-1)
    try:
        for turn in range(2):
            for rows, k, n in shapes:
                w = torch.randn(n, k, generator=g).bfloat16()
                x = (torch.randn(rows, k, generator=g) * 2).bfloat16()
                norm_w = torch.randn(k, generator=g).bfloat16()
                panels = pack_panels(w, pairs=turn == 0)
                plain = ops.panel_linear(x, panels, n, None, None, None)
                normed = ops.panel_linear(x, panels, n, None, None, None, norm_w, 1e-5)
                assert_rounded_product(plain, x, w.float())
                assert torch.equal(normed, ops.panel_linear(ops.rms_norm(x, norm_w, 1e-5), panels,
                                                            n, None, None, None))
                ops.panel_x_per_thread(0)
                assert torch.equal(plain, ops.panel_linear(x, panels, n, None, None, None))
                assert torch.equal(normed, ops.panel_linear(x, panels, n, None, None, None,
                                                            norm_w, 1e-5))
                ops.panel_x_per_thread(1)
    finally:
        ops.panel_x_per_thread(1)


@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 64), (2, 9, 64)])
def test_bias_and_residual_are_added_before_the_one_rounding(ops, shape):
    g = torch.Generator().manual_seed(len(shape))
    w = torch.randn(24, 64, generator=g).bfloat16()
    x = torch.randn(shape, generator=g).bfloat16()
    bias = torch.randn(24, generator=g).bfloat16()
    residual = (torch.randn(shape[:-1] + (24,), generator=g) * 4).bfloat16()
    p = pack_panels(w)
    assert_rounded_product(ops.panel_linear(x, p, 24, bias), x, w, bias=bias)
    assert_rounded_product(ops.panel_linear(x, p, 24, None, residual), x, w, residual=residual)
    assert_rounded_product(ops.panel_linear(x, p, 24, bias, residual), x, w, bias, residual)


def test_strided_input_is_read_as_its_values(ops):
    w = torch.randn(32, 48).bfloat16()
    x = torch.randn(4, 2, 48).bfloat16()[:, 1]
    assert not x.is_contiguous()
    assert torch.equal(ops.panel_linear(x, pack_panels(w), 32),
                       ops.panel_linear(x.contiguous(), pack_panels(w), 32))


def test_bad_arguments_are_refused(ops):
    p = pack_panels(torch.randn(40, 16).bfloat16(), pairs=False)
    x = torch.randn(2, 16).bfloat16()
    for call, match in (
            (lambda: ops.panel_linear(x, p[0], 40), "panels must be \\[P, K, 16\\]"),
            (lambda: ops.panel_linear(torch.randn(2, 8).bfloat16(), p, 40), "x must be \\[..., 16\\]"),
            (lambda: ops.panel_linear(x, p, 50), "3 panels cannot hold 50 outputs"),
            (lambda: ops.panel_linear(x, p, 40, torch.randn(39).bfloat16()), "bias must be \\[40\\]"),
            (lambda: ops.panel_linear(x, p, 40, None, torch.randn(2, 41).bfloat16()),
             "residual must be"),
            (lambda: ops.panel_linear(x.double(), p, 40), "x dtype Double is not supported"),
            (lambda: ops.panel_linear(x, p.int(), 40, None, None, torch.ones(1)),
             "weight dtype Int is not supported \\(float32, bfloat16, float16, int8\\)"),
            (lambda: ops.panel_linear(x, p.to(torch.int8), 40), "int8 panels need a scale"),
            (lambda: ops.panel_linear(x, p, 40, None, None, torch.ones(39)),
             "scale must be a floating \\[1\\] or \\[40\\]"),
            (lambda: ops.panel_linear(x, p, 40, None, None, torch.ones(40, dtype=torch.int32)),
             "scale must be a floating")):
        with pytest.raises(RuntimeError, match=match):
            call()


def test_bad_pairs_are_refused(ops):
    p = pack_panels(torch.randn(40, 16).bfloat16(), pairs=True)  # [3, 8, 32]
    for call, match in (
            (lambda: ops.panel_linear(torch.randn(2, 14).bfloat16(), p, 40),
             "x must be \\[..., 15\\] or \\[..., 16\\] for pairs of 8 rows"),
            (lambda: ops.panel_linear(torch.randn(2, 16).bfloat16(), p.half(), 40),
             "only bfloat16 panels come in pairs, got Half"),
            (lambda: ops.panel_linear(torch.randn(2, 16).bfloat16(), p[:, :, :24], 40),
             "panels must be \\[P, K, 16\\] or bfloat16 pairs \\[P, ceil\\(K / 2\\), 32\\]")):
        with pytest.raises(RuntimeError, match=match):
            call()


def _pair(bias: bool):
    torch.manual_seed(0)
    plain = Linear(40, 48, bias=bias, dtype=torch.bfloat16)
    paneled = Linear(40, 48, bias=bias, dtype=torch.bfloat16)
    paneled.load_state_dict(plain.state_dict())
    assert pack_linear_weights(paneled, PANELS) == 1
    assert paneled.weight.shape == ((3, 20, 32) if panel_pairs_native() else (3, 40, 16))
    return plain, paneled


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 40), (3, 40), (2, 5, 40)])
def test_linear_with_panels_computes_forward_and_add_to(bias, shape):
    plain, paneled = _pair(bias)
    x = torch.randn(shape).bfloat16()
    residual = torch.randn(shape[:-1] + (48,)).bfloat16()
    b = None if plain.bias is None else plain.bias.detach()
    assert_rounded_product(paneled(x), x, plain.weight.detach(), bias=b)
    got = paneled.add_to(residual, x)
    if b is None:
        assert_rounded_product(got, x, plain.weight.detach(), residual=residual)
    else:  # with a bias, add_to rounds the product first, then adds (as the plain path does)
        assert torch.equal(got, residual + paneled(x))


def test_a_traced_graph_takes_the_panels_as_an_input():
    plain, paneled = _pair(bias=False)
    x = torch.randn(4, 40, dtype=torch.bfloat16)

    def graph(x, weights):
        paneled.weight = weights[0]
        return paneled(x)
    traced = torch.jit.trace(graph, (x, (paneled.weight,)), check_trace=False)
    assert "nxdi::panel_linear" in str(traced.inlined_graph)
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    assert torch.equal(loaded(x, (paneled.weight,)), paneled(x))
    other = torch.randn(48, 40, dtype=torch.bfloat16)
    assert_rounded_product(loaded(x, (pack_panels(other),)), x, other)


def config(**overrides) -> NeuronConfig:
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


def test_compiled_model_with_panels_gives_the_plain_layouts_tokens(tiny_llama_ckpt, tmp_path,
                                                                   compile_cache_dir):
    """bf16 model compiled with panels and with plain weights: every projection of the panel
    graphs is the kernel (none is a plain product), the greedy tokens agree and the logits agree
    to bf16 rounding; the manifest records the layout and a plain config refuses the folder."""
    runs = {}
    for layout in (PANELS, PLAIN):
        model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=config(
            cpu_weight_layout=layout))
        model.compile(tmp_path / layout)
        model.load(tmp_path / layout)
        assert model.weight_layout == layout
        assert json.loads((tmp_path / layout / MANIFEST).read_text())["weight_layout"] == layout
        graph = str(next(iter(model.token_generation_model.runnables.values())).inlined_graph)
        if layout == PANELS:  # 2 layers x (qkv, o, gate_up, down) + LM head
            assert graph.count("nxdi::panel_linear") == 9
            assert "aten::linear" not in graph and "aten::mv" not in graph
        runs[layout] = greedy(model)
    assert torch.equal(runs[PANELS].argmax(-1), runs[PLAIN].argmax(-1))
    torch.testing.assert_close(runs[PANELS], runs[PLAIN], rtol=0, atol=0.05)
    other = NeuronLlamaForCausalLM(tiny_llama_ckpt,
                                   config=LlamaInferenceConfig.load(tmp_path / PLAIN))
    with pytest.raises(ValueError, match="compiled for 'plain' linear weights"):
        other.neuron_config.cpu_weight_layout = PANELS
        other.load(tmp_path / PLAIN)


def test_auto_picks_panels_on_x86_without_amx_or_with_amx_tiles(tiny_llama_ckpt, monkeypatch):
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=config())
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert model.resolve_weight_layout("cpu") == PANELS
    assert model.resolve_weight_layout("neuron") == PLAIN
    fp32 = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=config(torch_dtype=torch.float32))
    assert fp32.resolve_weight_layout("cpu") == PLAIN
    monkeypatch.setattr(kernels, "cpu_flags",  # AMD Zen 4: bf16 dot products, no AMX
                        lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    assert model.resolve_weight_layout("cpu") == PANELS
    monkeypatch.setattr(kernels, "cpu_flags",  # Intel Sapphire Rapids: AMX
                        lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}))
    monkeypatch.setattr(kernels, "panel_amx_tiles", lambda: True)
    assert model.resolve_weight_layout("cpu") == PANELS  # pairs on the tiles
    int8 = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=config(quantized=True))
    assert int8.resolve_weight_layout("cpu") != PANELS  # int8 panels would widen to float32
    monkeypatch.setattr(kernels, "panel_amx_tiles", lambda: False)  # tile state refused
    assert model.resolve_weight_layout("cpu") != PANELS
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset())  # not x86, or unknown
    assert model.resolve_weight_layout("cpu") != PANELS


def test_explicit_panels_without_the_kernels_is_refused(tiny_llama_ckpt, monkeypatch):
    with pytest.raises(ValueError, match="cpu_weight_layout must be one of"):
        config(cpu_weight_layout="tiles")
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_build_and_load",
                        lambda: (_ for _ in ()).throw(OSError("no C++ compiler")))
    model = NeuronLlamaForCausalLM(tiny_llama_ckpt, neuron_config=config(
        cpu_weight_layout=PANELS))
    with pytest.raises(ValueError, match="'panels' cannot be used: .*no C\\+\\+ compiler"):
        model.resolve_weight_layout("cpu")
