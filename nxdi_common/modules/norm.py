"""RMSNorm, computed in float32 and cast back, as the Llama reference does."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension with a learned scale."""

    def __init__(self, size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps
        # torch.ops.nxdi when the CPU backends' fused ops are on (NeuronConfig.cpu_fused_ops):
        # the same arithmetic as below in one op instead of eight
        self.fused = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, self.weight, self.eps)
        x32 = x.float() if x.dtype != torch.float32 else x
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (normed.to(x.dtype) if x.dtype != torch.float32 else normed)
