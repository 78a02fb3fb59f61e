"""RMSNorm as written in the V4.1 reference (MODEL.md §2.2), as a function."""

from __future__ import annotations

import torch

__all__ = ["rms_norm", "rms_norm_spelled", "NORM_SPELLINGS"]


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


#: The RMSNorm spellings a fused op's prologue computes (`rms_norm_spelled`), by `norm_mode`. Modes 4-6 are 1-3
#: without the last rounding to x's dtype: what torch 2.11's Inductor leaves of a norm whose bf16 result is upcast
#: again at once (its joint-graph rule `pointless_convert` drops the round trip), e.g. in front of an FP8 quantiser.
NORM_SPELLINGS = {
    0: "none",
    1: "(x * rstd) rounded, times weight, rounded (gpt-fast, transformers)",
    2: "x * rstd * weight rounded once (V4.1 reference, torch.nn.functional.rms_norm)",
    3: "(x * rstd) rounded, no weight",
    4: "(x * rstd) rounded, times weight, in FP32",
    5: "x * rstd * weight in FP32",
    6: "x * rstd in FP32, no weight",
}


def rms_norm_spelled(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int) -> torch.Tensor:
    """RMSNorm of x's last dim as spelling `mode` of `NORM_SPELLINGS` rounds it, rstd = rsqrt(mean(x.float()^2)
    + eps). x bf16 / fp16 / fp32 [..., K]; weight x's dtype [K] (modes 1, 2, 4, 5) or None (3, 6). Returns x's
    dtype (modes 1-3) or float32 (4-6), [..., K]. Raises ValueError for another mode or a weight given to a
    weightless mode (and the reverse). Source: Zhang & Sennrich 2019 (RMSNorm)."""
    if mode not in NORM_SPELLINGS or mode == 0:
        raise ValueError(f"norm_mode={mode} is not an RMSNorm spelling ({sorted(set(NORM_SPELLINGS) - {0})})")
    if (weight is None) != (mode in (3, 6)):
        raise ValueError(f"norm_mode={mode} {'takes no' if mode in (3, 6) else 'needs a'} norm weight")
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if mode in (1, 4):
        y = y.to(x.dtype).float() * weight.float()
    elif mode in (2, 5):
        y = y * weight.float()
    if mode in (1, 2, 3):
        y = y.to(x.dtype)
    return y
