"""modules.linear.Linear: the single-row matrix-vector path and the residual add compute the same
product as F.linear; with oneDNN-packed weights the products equal F.linear's, survive tracing,
and the documented switch keeps oneDNN off AMX."""
import io
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nxdi_common.modules.linear import (Linear, onednn_unavailable_reason, pack_linear_weights,
                                       pack_weight)

needs_onednn = pytest.mark.skipif(onednn_unavailable_reason(torch.bfloat16) is not None,
                                  reason="this torch build cannot pack bf16 weights")


def test_single_row_bf16_matches_linear():
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=True, dtype=torch.bfloat16)
    x = torch.randn(1, 1, 96, dtype=torch.bfloat16)
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    out = layer(x)
    assert out.shape == (1, 1, 40) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.02)


def test_many_rows_and_fp32_use_the_gemm_path_exactly():
    torch.manual_seed(0)
    layer = Linear(32, 8, bias=False)
    x = torch.randn(3, 2, 32)
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    one = torch.randn(1, 1, 32)
    assert torch.equal(layer(one), F.linear(one, layer.weight))


def test_add_to_folds_the_residual_on_every_path():
    """residual + layer(x) for one bf16 row (addmv), many rows (addmm), fp32, and with a bias."""
    torch.manual_seed(0)
    for dtype, shape, bias in ((torch.bfloat16, (1, 1, 96), False), (torch.bfloat16, (3, 2, 96), False),
                               (torch.float32, (2, 5, 96), False), (torch.bfloat16, (1, 1, 96), True)):
        layer = Linear(96, 40, bias=bias, dtype=dtype)
        x, residual = torch.randn(*shape, dtype=dtype), torch.randn(*shape[:-1], 40, dtype=dtype)
        ref = residual.float() + F.linear(x.float(), layer.weight.float(),
                                          None if layer.bias is None else layer.bias.float())
        out = layer.add_to(residual, x)
        assert out.shape == residual.shape and out.dtype == dtype
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
        torch.testing.assert_close(out.float(), ref, **tol)


def test_traced_single_row_graph_has_no_shape_bookkeeping():
    """Shapes come from the module's ints: tracing the mv path records no aten::size nodes."""
    layer = Linear(64, 16, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        traced = torch.jit.trace_module(layer, {"add_to": (torch.randn(1, 1, 16).bfloat16(),
                                                           torch.randn(1, 1, 64).bfloat16())})
    graph = traced.add_to.graph
    kinds = [n.kind() for n in graph.nodes()]
    assert "aten::addmv" in kinds and "aten::size" not in kinds


def _pair(dtype, bias: bool, out_features=48, in_features=40):
    torch.manual_seed(0)
    plain = Linear(in_features, out_features, bias=bias, dtype=dtype)
    packed = Linear(in_features, out_features, bias=bias, dtype=dtype)
    packed.load_state_dict(plain.state_dict())
    assert pack_linear_weights(packed) == 1 and packed.weight.is_mkldnn
    return plain, packed


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 40), (3, 40), (2, 5, 40)])
def test_packed_product_and_residual_add_equal_the_plain_ones(dtype, bias, shape):
    plain, packed = _pair(dtype, bias)
    x = torch.randn(shape).to(dtype)
    residual = torch.randn(shape[:-1] + (48,)).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(packed(x), plain(x), **tol)
    torch.testing.assert_close(packed.add_to(residual, x), plain.add_to(residual, x), **tol)
    torch.testing.assert_close(packed(x).float(), F.linear(x.float(), plain.weight.float(),
                                                           None if plain.bias is None
                                                           else plain.bias.float()), **tol)


@needs_onednn
def test_a_traced_graph_takes_the_packed_weight_as_an_input():
    """Traced, saved and loaded: the graph calls the packed product on whatever packed weight it
    is given (weights are graph inputs, backends/weights.py)."""
    plain, packed = _pair(torch.bfloat16, bias=False)
    x = torch.randn(4, 40, dtype=torch.bfloat16)

    def graph(x, weights):
        packed.weight = weights[0]
        return packed(x)
    traced = torch.jit.trace(graph, (x, (packed.weight,)), check_trace=False)
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    torch.testing.assert_close(loaded(x, (packed.weight,)), plain(x), atol=0.05, rtol=0.02)
    other = torch.randn(48, 40, dtype=torch.bfloat16)
    torch.testing.assert_close(loaded(x, (pack_weight(other),)), F.linear(x, other),
                               atol=0.05, rtol=0.02)


_PRODUCT = """
import torch
from nxdi_common.modules.linear import Linear, pack_linear_weights
torch.manual_seed(0)
lin = Linear(576, 3072, bias=False, dtype=torch.bfloat16)
pack_linear_weights(lin)
torch.save(lin(torch.ones(16, 576, dtype=torch.bfloat16)), {path!r})
"""


@needs_onednn
def test_onednn_max_cpu_isa_keeps_the_products_off_amx(tmp_path):
    """README, "CPU kernels and AMX": ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 makes oneDNN run a
    non-AMX kernel (its verbose log names the kernel), with the same results."""
    def run(name, **env):
        path = tmp_path / f"{name}.pt"
        proc = subprocess.run([sys.executable, "-c", _PRODUCT.format(path=str(path))],
                              env={**os.environ, "ONEDNN_VERBOSE": "1", **env},
                              capture_output=True, text=True, timeout=120, check=True)
        kernels = [line for line in proc.stdout.splitlines() if ",exec," in line]
        assert kernels, proc.stdout[-2000:]
        return kernels, torch.load(path)
    capped, y_capped = run("capped", ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
    assert not any("amx" in k for k in capped), capped
    default, y_default = run("default")
    torch.testing.assert_close(y_capped, y_default, atol=0.05, rtol=0.02)
