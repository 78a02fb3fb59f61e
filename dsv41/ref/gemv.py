"""Semantics of the GEMV ops (`dsv41::linear_fp8_block`, `linear_fp4`, `linear_fp8_block_multi`,
`linear_fp8_scaled`, `linear_upcast`, `grouped_linear_fp4`, `grouped_linear_fp4_pair`) in plain PyTorch.

The kernels' `reference_*` functions check their arguments and then compute with these; the passes verify
against them. Nothing here checks shapes: a wrong shape fails inside torch. Sources: MODEL.md §2.1 (block-FP8
and FP4 weights, FP8 1x32 activations), §2.9 (routed experts); the eager spellings of dsv41/model/linear.py
`Linear.forward`, dsv41/model/moe.py `RoutedExperts.forward_gather` and DeepSeek-V3 `weight_dequant`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import dequantize_fp4_1x32, dequantize_fp8_block, dequantize_fp8_scaled, fake_quant_fp8_1x32
from .norm import rms_norm_spelled

__all__ = ["linear_fp8_block", "linear_fp4", "linear_fp8_block_multi", "linear_fp8_scaled", "linear_upcast",
           "grouped_linear_fp4", "grouped_linear_fp4_pair"]


def linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0, norm_mode: int = 0) -> torch.Tensor:
    """`F.linear(fq8(x) if act_quant else x, dequant(weight))`: x [..., K] float, K % 32 == 0; weight uint8 [N, K]
    E4M3 bytes; scale uint8 [ceil(N/32), ceil(K/32)] UE8M0. Returns [..., N] in x.dtype.

    With `norm_mode` (1-6, `norm.NORM_SPELLINGS`; needs act_quant) x is first RMS-normalised as that spelling
    rounds it (`norm.rms_norm_spelled(x, norm_weight, eps, norm_mode)`, FP32 for modes 4-6), quantised, and the
    quantised values taken in x's dtype (exact: every FP8 1x32 value is a bfloat16 / float16). Raises ValueError
    for a norm without act_quant or a bad mode."""
    if norm_mode:
        if not act_quant:
            raise ValueError("an RMSNorm prologue (norm_mode != 0) needs act_quant=True")
        xq = fake_quant_fp8_1x32(rms_norm_spelled(x, norm_weight, eps, norm_mode)).to(x.dtype)
        return F.linear(xq, dequantize_fp8_block(weight, scale, x.dtype))
    w = dequantize_fp8_block(weight, scale, x.dtype)
    return F.linear(fake_quant_fp8_1x32(x) if act_quant else x, w)


def linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool) -> torch.Tensor:
    """`F.linear(fq8(x) if act_quant else x, dequant_fp4(weight))`: x [..., K] float, K % 32 == 0; weight uint8
    [N, K/2] packed E2M1 (low nibble = even k); scale uint8 [N, K/32] UE8M0. Returns [..., N] in x.dtype."""
    w = dequantize_fp4_1x32(weight, scale, x.dtype)
    return F.linear(fake_quant_fp8_1x32(x) if act_quant else x, w)


def linear_fp8_block_multi(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor],
                           act_quant: bool) -> list[torch.Tensor]:
    """`[linear_fp8_block(x, W_i, S_i, act_quant) for i]`: one x [..., K], weights[i] uint8 [N_i, K], scales[i]
    uint8 [ceil(N_i/32), K/32]. Returns the list of y_i [..., N_i] in x.dtype."""
    return [linear_fp8_block(x, w, s, act_quant) for w, s in zip(weights, scales)]


def linear_fp8_scaled(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                      weight_dtype: torch.dtype, scale_cast: torch.dtype) -> torch.Tensor:
    """`F.linear(x, dequantize_fp8_scaled(codes, scale, ...).to(x.dtype))`: x [..., K] float; codes uint8 [N, K]
    E4M3; scale float32 or uint8 UE8M0 [ceil(N/block_n), ceil(K/block_k)]; the weight is rounded to
    `weight_dtype`, the scale to `scale_cast` first. Returns [..., N] in x.dtype."""
    w = dequantize_fp8_scaled(codes, scale, block_n, block_k, weight_dtype, scale_cast)
    return F.linear(x, w.to(x.dtype))


def linear_upcast(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight.float())`: x float32 [..., K], weight bf16 / fp16 / fp32 [N, K]; float32 [..., N]."""
    return F.linear(x, weight.float())


def grouped_linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, indices: torch.Tensor,
                       act_quant: bool) -> torch.Tensor:
    """The gathered experts: gather -> dequantise -> einsum. x [N, K] (shared by a token's k experts) or
    [N, k, K]; weight uint8 [E, out, K/2] packed E2M1; scale uint8 [E, out, K/32] UE8M0; indices int64 [N, k] in
    [-E, E). Returns [N, k, out] in x.dtype."""
    w = dequantize_fp4_1x32(weight[indices], scale[indices], x.dtype)  # [N, k, out, K]
    xq = fake_quant_fp8_1x32(x) if act_quant else x
    if x.dim() == 2:
        return torch.einsum("nd,nkfd->nkf", xq, w)
    return torch.einsum("nkd,nkfd->nkf", xq, w)


def grouped_linear_fp4_pair(x: torch.Tensor, weight_a: torch.Tensor, scale_a: torch.Tensor, weight_b: torch.Tensor,
                            scale_b: torch.Tensor, indices: torch.Tensor,
                            act_quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`grouped_linear_fp4` for each of two weights with the same x and indices (shapes as there)."""
    return (grouped_linear_fp4(x, weight_a, scale_a, indices, act_quant),
            grouped_linear_fp4(x, weight_b, scale_b, indices, act_quant))
