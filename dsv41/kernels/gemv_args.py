"""Argument checks and plain-PyTorch references of the quantised-weight GEMV ops `dsv41::linear_fp8_block` and
`dsv41::linear_fp4` (the ops, kernels and launch choices are in `quant_gemv`, which re-exports these names)."""

from __future__ import annotations

import torch

from dsv41.ref import gemv as _ref
from dsv41.ref.norm import NORM_SPELLINGS

from ._common import check_same_device, check_tensor

__all__ = ["check_linear_args", "check_norm_args", "reference_linear_fp8_block", "reference_linear_fp4"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------- checks
def check_linear_args(x, weight, scale, fp4: bool):
    """Validate the arguments of `linear_fp8_block` / `linear_fp4` (x [..., K] float, K % 32 == 0; uint8 weight and
    scale of the shapes of the format); return (N, K). Raises TypeError / ValueError naming the argument at fault."""
    check_tensor("x", x, dtypes=_FLOAT_DTYPES, min_ndim=1)
    check_tensor("weight", weight, dtypes=(torch.uint8,), ndim=2)
    check_tensor("scale", scale, dtypes=(torch.uint8,), ndim=2)
    check_same_device(x=x, weight=weight, scale=scale)
    k = x.shape[-1]
    if k % 32:
        raise ValueError(f"x.shape[-1] = {k} must be divisible by 32 (1x32 activation quantisation)")
    n = weight.shape[0]
    if fp4:
        if weight.shape[1] * 2 != k:
            raise ValueError(f"packed FP4 weight {tuple(weight.shape)} does not match K = {k} (expected [N, {k // 2}])")
        want = (n, k // 32)
    else:
        if weight.shape[1] != k:
            raise ValueError(f"FP8 weight {tuple(weight.shape)} does not match K = {k} (expected [N, {k}])")
        want = (-(-n // 32), k // 32)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; expected {want} for weight {tuple(weight.shape)}")
    return n, k


def check_norm_args(x: torch.Tensor, act_quant: bool, norm_weight, eps, norm_mode) -> None:
    """Validate an RMSNorm prologue of `linear_fp8_block` (`ref.norm.NORM_SPELLINGS`): norm_mode 1-6 with
    act_quant, a float eps >= 0, and norm_weight x's dtype [K] on x's device (modes 1, 2, 4, 5) or None (3, 6).
    Raises ValueError / TypeError naming the argument at fault."""
    if norm_mode not in NORM_SPELLINGS:
        raise ValueError(f"norm_mode={norm_mode!r} must be one of {sorted(NORM_SPELLINGS)} ({NORM_SPELLINGS})")
    if norm_mode == 0:
        return
    if not act_quant:
        raise ValueError("an RMSNorm prologue (norm_mode != 0) needs act_quant=True")
    if not (isinstance(eps, float) and eps >= 0.0):
        raise ValueError(f"eps={eps!r} must be a float >= 0")
    if norm_mode in (3, 6):
        if norm_weight is not None:
            raise ValueError(f"norm_mode={norm_mode} takes no norm_weight")
        return
    check_tensor("norm_weight", norm_weight, dtypes=(x.dtype,), ndim=1)
    if norm_weight.shape[0] != x.shape[-1]:
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} does not match K = {x.shape[-1]}")
    check_same_device(x=x, norm_weight=norm_weight)


# ------------------------------------------------------------------------------------------- references
def reference_linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool,
                               norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                               norm_mode: int = 0) -> torch.Tensor:
    """Plain-PyTorch `dsv41::linear_fp8_block`: `F.linear(fq8(x) if act_quant else x, dequant(weight))`.

    Args:
        x: [..., K] fp32/bf16/fp16, K % 32 == 0.
        weight: uint8 [N, K] E4M3 bytes. scale: uint8 [ceil(N/32), ceil(K/32)] UE8M0 exponents.
        act_quant: fake-quantise x to FP8 E4M3 with a UE8M0 scale per 32 along K first.
        norm_weight, eps, norm_mode: an RMSNorm prologue (`ref.norm.NORM_SPELLINGS`, 0 = none; needs act_quant):
            x is RMS-normalised as that spelling rounds it (FP32 for modes 4-6) before the quantisation, and the
            quantised values are taken in x's dtype. norm_weight x's dtype [K] (modes 1, 2, 4, 5) or None.
    Returns: [..., N] in x.dtype.
    Raises: TypeError / ValueError for wrong dtypes or shapes, and for a bad prologue (`check_norm_args`; named).
    Source: dsv41/model/linear.py `Linear.forward` (fmt "fp8_block") after `RMSNorm`, MODEL.md §2.1-2.2.
    """
    check_linear_args(x, weight, scale, fp4=False)
    check_norm_args(x, act_quant, norm_weight, eps, norm_mode)
    return _ref.linear_fp8_block(x, weight, scale, act_quant, norm_weight, eps, norm_mode)


def reference_linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         act_quant: bool) -> torch.Tensor:
    """Plain-PyTorch `dsv41::linear_fp4`: `F.linear(fq8(x) if act_quant else x, dequant_fp4(weight))`.

    Args:
        x: [..., K] fp32/bf16/fp16, K % 32 == 0.
        weight: uint8 [N, K/2] packed E2M1 (low nibble = even k). scale: uint8 [N, K/32] UE8M0.
        act_quant: fake-quantise x to FP8 1x32 first (as every quantised GEMM of the reference does).
    Returns: [..., N] in x.dtype.
    Raises: TypeError / ValueError for wrong dtypes or shapes (named).
    Source: dsv41/model/linear.py `Linear.forward` (fmt "fp4"), MODEL.md §2.1 (routed experts).
    """
    check_linear_args(x, weight, scale, fp4=True)
    return _ref.linear_fp4(x, weight, scale, act_quant)
