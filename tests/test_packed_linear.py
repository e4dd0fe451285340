"""oneDNN-packed linear weights (modules/linear.py): the products equal F.linear's, survive
tracing, and the documented switch keeps oneDNN off AMX."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nxdi_common.modules.linear import (Linear, onednn_unavailable_reason, pack_linear_weights,
                                       pack_weight)

pytestmark = pytest.mark.skipif(onednn_unavailable_reason(torch.bfloat16) is not None,
                                reason="this torch build cannot pack bf16 weights")


def _pair(dtype, bias: bool, out_features=48, in_features=40):
    torch.manual_seed(0)
    plain = Linear(in_features, out_features, bias=bias, dtype=dtype)
    packed = Linear(in_features, out_features, bias=bias, dtype=dtype)
    packed.load_state_dict(plain.state_dict())
    assert pack_linear_weights(packed) == 1 and packed.weight.is_mkldnn
    return plain, packed


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
