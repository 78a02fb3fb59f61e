"""Semantics of the RoPE + FP4 quantisation ops (`dsv41::rope_fp4_quant`, `rope_fp4_fake_quant`,
`rope_fp4_quant_store`) in plain PyTorch: `quantize_fp4_*(apply_rope(x, cos, sin))`, with an E4M3 scale per 16
(the compressed bank) or a UE8M0 scale per 32 (index keys and queries). No argument checks (the kernels'
`reference_*` make them). Sources: MODEL.md §2.1, §2.2; dsv41/model/attention.py `_update_csa`, csa.py.
"""

from __future__ import annotations

import torch

from .formats import (fake_quant_fp4_e4m3_1x16, fake_quant_fp4_ue8m0_1x32, quantize_fp4_e4m3_1x16,
                      quantize_fp4_ue8m0_1x32)
from .rope import apply_rope

__all__ = ["rope_fp4_quant", "rope_fp4_fake_quant", "rope_fp4_quant_store"]


def _quantize(v: torch.Tensor, scale_block: int, e4m3_scale: bool):
    return quantize_fp4_e4m3_1x16(v) if e4m3_scale else quantize_fp4_ue8m0_1x32(v)


def rope_fp4_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int, e4m3_scale: bool):
    """(codes uint8 [..., D/2], scales uint8 [..., D/scale_block]) of `apply_rope(x, cos, sin)`, x [..., D] float,
    cos / sin fp32 broadcastable to [..., R/2]; (scale_block, e4m3_scale) is (16, True) or (32, False)."""
    return _quantize(apply_rope(x, cos, sin), scale_block, e4m3_scale)


def rope_fp4_fake_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int,
                        e4m3_scale: bool) -> torch.Tensor:
    """`fake_quant_fp4_*(apply_rope(x, cos, sin))`: [..., D] in x.dtype (arguments as `rope_fp4_quant`)."""
    rot = apply_rope(x, cos, sin)
    return fake_quant_fp4_e4m3_1x16(rot) if e4m3_scale else fake_quant_fp4_ue8m0_1x32(rot)


def rope_fp4_quant_store(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale_block: int, e4m3_scale: bool,
                         codes_cache: torch.Tensor, scale_cache: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantise like `rope_fp4_quant` and write codes_cache[b, rows[b, t]] / scale_cache[b, rows[b, t]] (mutated)
    for every (b, t) with 0 <= rows[b, t] < Rows. x [B, T, D]; rows int64 [B, T]; codes_cache uint8
    [B, Rows, D/2]; scale_cache uint8 [B, Rows, D/scale_block]."""
    codes, scales = _quantize(apply_rope(x, cos, sin), scale_block, e4m3_scale)
    ok = (rows >= 0) & (rows < codes_cache.shape[1])
    bi = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(rows)
    codes_cache[bi[ok], rows[ok]] = codes[ok]
    scale_cache[bi[ok], rows[ok]] = scales[ok]
