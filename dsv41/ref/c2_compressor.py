"""Semantics of the ratio-1 / ratio-2 compressor ops (`dsv41::c2_norm_rope_fp4_store`,
`c2_pool_norm_rope_fp4_store`) in plain PyTorch: pair pooling (ratio 2), RMSNorm, then the RoPE + FP4 bank write.
No argument checks (the kernels' `reference_*` make them). Sources: MODEL.md §2.6, §2.8; dsv41/model/csa.py
`Compressor.forward`, dsv41/model/attention.py `_update_csa`.
"""

from __future__ import annotations

import torch

from .norm import rms_norm
from .rope_fp4 import rope_fp4_quant_store

__all__ = ["pair_pool", "c2_norm_rope_fp4_store", "c2_pool_norm_rope_fp4_store"]


def pair_pool(k: torch.Tensor, g: torch.Tensor, prev_k: torch.Tensor, prev_g: torch.Tensor):
    """Per-channel softmax-over-the-pair pooling (FP32): `(e0 prev_k + e1 k) / (e0 + e1)`.

    All inputs FP32 [B, T, D]; prev_g = -inf (empty state) gives z = k. Source: dsv41/model/csa.py
    `Compressor.forward` (ratio 2), MODEL.md §2.6.
    """
    m = torch.maximum(prev_g, g)
    e0 = torch.exp(prev_g - m)
    e1 = torch.exp(g - m)
    return (e0 * prev_k + e1 * k) / (e0 + e1)


def c2_norm_rope_fp4_store(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache,
                           rows) -> torch.Tensor:
    """latent = rms_norm(x, weight, eps); write quantize_fp4_*(apply_rope(latent, cos, sin)) at
    codes_cache / scale_cache[b, rows[b, t]]. x [B, T, D] float; returns latent [B, T, D] x.dtype (pre-RoPE)."""
    latent = rms_norm(x, weight, eps)
    rope_fp4_quant_store(latent, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows)
    return latent


def c2_pool_norm_rope_fp4_store(k, g, prev_k, prev_g, weight, eps, out_dtype, cos, sin, scale_block, e4m3_scale,
                                codes_cache, scale_cache, rows) -> torch.Tensor:
    """z = `pair_pool` (FP32) cast to out_dtype, then `c2_norm_rope_fp4_store(z, ...)`; k, g, prev_k, prev_g FP32
    [B, T, D]. Returns latent [B, T, D] out_dtype."""
    z = pair_pool(k, g, prev_k, prev_g).to(out_dtype)
    return c2_norm_rope_fp4_store(z, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows)
