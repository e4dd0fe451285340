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
