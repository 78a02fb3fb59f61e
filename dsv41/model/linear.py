"""Linear layers holding weights in the checkpoint's formats, dequantised explicitly before the matmul.

This is the day-0 "fallback" path a serving stack starts from (MODEL.md, "How `dsv41/model/` is written"):
`F.linear(fake_quant_fp8_1x32(x), dequantize(W))`. Recognising dequantize -> matmul and reading
the low-precision bytes directly is the compiler's job (dsv41 `dispatch` pass), not the model's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ref.formats import (dequantize_fp4_1x32, dequantize_fp8_block, fake_quant_fp8_1x32,
                      quantize_fp4_1x32, quantize_fp8_block)

__all__ = ["Linear", "WEIGHT_FORMATS"]

#: `fp8_block`: E4M3 codes [N, K] + UE8M0 scales [ceil(N/32), ceil(K/32)];
#: `fp4`: packed E2M1 [N, K/2] + UE8M0 scales [N, K/32]; `dense`: weight [N, K] in the model dtype.
WEIGHT_FORMATS = ("fp8_block", "fp4", "dense")


class Linear(nn.Module):
    """`y = x W^T` with W in one of `WEIGHT_FORMATS` (no bias: V4.1 has none).

    Args:
        in_features, out_features: K and N.
        fmt: storage format (see `WEIGHT_FORMATS`). Quantised formats fake-quantise the input to FP8 1x32
            (UE8M0) first, as every quantised GEMM of the reference does.
        dtype: compute dtype of activations and of dense weights.
    Shapes: x [..., K] -> [..., N] in `dtype`.
    Raises:
        ValueError: unknown `fmt`, or K not divisible by 32 for a quantised format.
    Source: MODEL.md §2.1 (block layouts, quantised GEMM semantics), [R41] `Linear`.
    """

    def __init__(self, in_features: int, out_features: int, fmt: str, dtype: torch.dtype = torch.bfloat16,
                 device=None):
        super().__init__()
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; expected one of {WEIGHT_FORMATS}")
        if fmt != "dense" and in_features % 32:
            raise ValueError(f"in_features={in_features} must be divisible by 32 for format {fmt}")
        self.in_features, self.out_features, self.fmt, self.dtype = in_features, out_features, fmt, dtype
        n, k = out_features, in_features
        if fmt == "fp8_block":
            w = torch.empty(n, k, dtype=torch.uint8, device=device)
            s = torch.empty(-(-n // 32), -(-k // 32), dtype=torch.uint8, device=device)
        elif fmt == "fp4":
            w = torch.empty(n, k // 2, dtype=torch.uint8, device=device)
            s = torch.empty(n, k // 32, dtype=torch.uint8, device=device)
        else:
            w = torch.empty(n, k, dtype=dtype, device=device)
            s = None
        self.weight = nn.Parameter(w, requires_grad=False)
        self.scale = nn.Parameter(s, requires_grad=False) if s is not None else None

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as a dense [N, K] tensor in `dtype` (default: the layer's compute dtype)."""
        dtype = dtype or self.dtype
        if self.fmt == "fp8_block":
            return dequantize_fp8_block(self.weight, self.scale, dtype)
        if self.fmt == "fp4":
            return dequantize_fp4_1x32(self.weight, self.scale, dtype)
        return self.weight.to(dtype)

    def set_weight(self, w: torch.Tensor) -> None:
        """Store a dense weight [N, K] (any float dtype), quantising it to this layer's format."""
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(w.shape)} != {(self.out_features, self.in_features)}")
        with torch.no_grad():
            if self.fmt == "fp8_block":
                q, s = quantize_fp8_block(w)
                self.weight.copy_(q)
                self.scale.copy_(s)
            elif self.fmt == "fp4":
                q, s = quantize_fp4_1x32(w)
                self.weight.copy_(q)
                self.scale.copy_(s)
            else:
                self.weight.copy_(w.to(self.weight.dtype))

    def init_random(self, gen: torch.Generator, std: float | None = None) -> None:
        """Fill with N(0, std^2) weights (default std = 1/sqrt(in_features)) drawn from `gen`, then quantise."""
        std = std if std is not None else 1.0 / math.sqrt(self.in_features)
        w = torch.randn(self.out_features, self.in_features, generator=gen, device=self.weight.device) * std
        self.set_weight(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x.dtype: `F.linear` on the dense weight, or on the dequantised FP8/FP4 weight
        with x fake-quantised to FP8 1x32 first (MODEL.md §2.1 "Quantized GEMM semantics")."""
        if self.fmt == "dense":
            return F.linear(x, self.weight)
        w = self.dequantized_weight(x.dtype)
        return F.linear(fake_quant_fp8_1x32(x), w)

    def extra_repr(self) -> str:
        """In / out features and the weight format, for `print(module)`."""
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}"
