"""RMSNorm as written in the V4.1 reference (MODEL.md §2.2), as a function."""

from __future__ import annotations

import torch

__all__ = ["rms_norm"]


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
