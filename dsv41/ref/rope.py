"""Rotary position embedding of V4.1 as functions: interleaved pairs on the LAST `rope_dim` channels (MODEL.md
§2.2). The tables (`dsv41.model.rope.RotaryEmbedding`) call `rope_inv_freq`; the model and the fused ops call
`apply_rope`."""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_inv_freq"]


def rope_inv_freq(rope_dim: int, theta: float, yarn: tuple | None = None) -> torch.Tensor:
    """Per-pair frequencies f_i = theta^(-2i/rope_dim), i < rope_dim/2, FP32 [rope_dim/2].

    With `yarn = (factor, low, high)` the YaRN blend of MODEL.md §2.2 is applied:
    `f_i' = f_i * (1 - ramp_i) + f_i / factor * ramp_i`, `ramp_i = clamp((i - low) / (high - low), 0, 1)`.
    """
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    f = theta ** (-2.0 * i / rope_dim)
    if yarn is not None:
        factor, low, high = yarn
        ramp = ((i - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
        f = f * (1 - ramp) + f / factor * ramp
    return f.to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of the last `2 * cos.shape[-1]` channels of `x`.

    Args:
        x: [..., D] any float dtype; channels before the rope slice pass through.
        cos, sin: FP32, broadcastable to [..., rope_dim/2].
        inverse: rotate by the negative angle (the de-rotation of the attention output).
    Returns:
        Tensor like `x` (same dtype); the rotation is computed in FP32.
    """
    r = cos.shape[-1] * 2
    nope, pe = x[..., :-r], x[..., -r:]
    pf = pe.float().unflatten(-1, (r // 2, 2))
    a, b = pf[..., 0], pf[..., 1]
    if inverse:
        sin = -sin
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rot.to(x.dtype)), dim=-1)
