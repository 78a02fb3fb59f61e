"""RMSNorm as written in the V4.1 reference (MODEL.md §2.2)."""

from __future__ import annotations

import torch
from torch import nn

from ..ref.norm import rms_norm

__all__ = ["RMSNorm", "rms_norm"]


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
