"""Linear layer whose single-row case runs as a matrix-vector product. Token generation at batch 1
multiplies one activation row by every weight matrix; for bfloat16 on CPU, torch.mv reads the
weights about 30% faster than F.linear's GEMM path (bench/bench_model.py). The shape test is static
per bucket, so a traced graph contains exactly one of the two paths.

Shapes are rebuilt from Python ints the module knows (never from `x.shape`): a traced graph then
holds constants instead of size/NumToTensor/Int bookkeeping nodes, which at batch 1 cost about as
much as the arithmetic around them."""
import torch
import torch.nn.functional as F
from torch import nn

_MV_DTYPES = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    """nn.Linear with a matrix-vector fast path for one row of reduced-precision input, and
    `add_to`, which folds a residual addition into the same kernel."""

    def _single_row(self, x: torch.Tensor) -> bool:
        return x.dtype in _MV_DTYPES and x.numel() == self.in_features

    def _unflatten(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y.view([1] * (x.dim() - 1) + [self.out_features])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._single_row(x):
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return self._unflatten(torch.mv(self.weight, x.view(-1)), x)
        return self._unflatten(torch.addmv(self.bias, self.weight, x.view(-1)), x)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x), as one addmv/addmm when there is no bias."""
        if self.bias is not None:
            return residual + self(x)
        if self._single_row(x):
            return self._unflatten(torch.addmv(residual.view(-1), self.weight, x.view(-1)), x)
        out = torch.addmm(residual.flatten(0, -2), x.flatten(0, -2), self.weight.t())
        return out.view_as(residual)
