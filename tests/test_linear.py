"""The single-row matrix-vector path of modules.linear.Linear computes the same product."""
import torch
import torch.nn.functional as F

from nxdi_common.modules.linear import Linear


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
