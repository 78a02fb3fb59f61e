"""Rotary position embedding of V4.1: interleaved pairs on the LAST `rope_dim` channels (MODEL.md §2.2).

Two tables per model: "main" (theta 10000, no scaling) for compress-ratio-0 layers and "compress"
(theta 160000 + YaRN factor 16, no mscale) for every layer with ratio > 0. Angles are computed from the
position tensor on the fly (no host sync, no table of max_position rows).
"""

from __future__ import annotations


import torch
from torch import nn

from ..ref.rope import apply_rope, rope_inv_freq
from .config import ModelConfig

__all__ = ["RotaryEmbedding", "apply_rope", "rope_inv_freq"]


class RotaryEmbedding(nn.Module):
    """Produces (cos, sin) [*positions.shape, rope_dim/2] FP32 for integer positions.

    `kind="main"` uses `config.rope_theta` without scaling; `kind="compress"` uses
    `config.compress_rope_theta` with YaRN (factor, beta_fast, beta_slow, original length from config).
    Source: MODEL.md §2.2, [R41] `precompute_freqs_cis`.
    """

    def __init__(self, config: ModelConfig, kind: str, device=None):
        super().__init__()
        if kind == "main":
            f = rope_inv_freq(config.qk_rope_head_dim, config.rope_theta)
        elif kind == "compress":
            low, high = config.yarn_band()
            f = rope_inv_freq(config.qk_rope_head_dim, config.compress_rope_theta,
                              (config.rope_scaling_factor, low, high))
        else:
            raise ValueError(f"unknown RoPE table {kind!r}; expected 'main' or 'compress'")
        self.kind = kind
        self.register_buffer("inv_freq", f.to(device) if device is not None else f, persistent=False)

    def forward(self, positions: torch.Tensor):
        """(cos, sin) FP32 [*positions.shape, R/2] for int64 positions."""
        ang = positions.to(torch.float32)[..., None] * self.inv_freq
        return torch.cos(ang), torch.sin(ang)
