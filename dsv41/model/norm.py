"""RMSNorm as written in the V4.1 reference (MODEL.md §2.2)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`weight * x * rsqrt(mean(x^2) + eps)` over the last dim, computed in FP32, cast back to `x.dtype`.

    Args:
        x: [..., d] any float dtype. weight: [d] or None (the unweighted mHC statistic).
        eps: 1e-20 for every V4.1 norm.
    Source: [R41] `RMSNorm.forward`.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned weight [dim] (stored in the model dtype).

    Shapes: [..., dim] -> [..., dim], same dtype as the input. Source: MODEL.md §2.2.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x [..., d] (FP32 statistics, eps of the module) -> x.dtype."""
        return rms_norm(x, self.weight, self.eps)
