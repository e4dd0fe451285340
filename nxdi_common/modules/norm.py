"""RMSNorm, computed in float32 and cast back, as the Llama reference does."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension with a learned scale."""

    def __init__(self, size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
