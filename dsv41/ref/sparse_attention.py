"""Semantics of `dsv41::sparse_fp4_attention` in plain PyTorch: attention over an FP8 window ring and FP4 bank rows
picked by the indexer, with a per-head sink, then inverse RoPE. Shapes and dtypes: dsv41/kernels/sparse_attention.py's
module docstring. No argument checks (the kernel's `reference_*` makes them). Sources: MODEL.md §2.4 steps 3-6,
§2.1, §2.2; dsv41/model/attention.py `Attention.forward`.
"""

from __future__ import annotations

import torch

from .formats import dequantize_fp4_e4m3_1x16, dequantize_fp8_1x32
from .rope import apply_rope

__all__ = ["sparse_fp4_attention"]


def sparse_fp4_attention(q: torch.Tensor, window_codes: torch.Tensor, window_scales: torch.Tensor,
                         window_ok: torch.Tensor, bank_codes: torch.Tensor, bank_scales: torch.Tensor,
                         indices: torch.Tensor, sink: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         softmax_scale: float, rope_q: bool = False) -> torch.Tensor:
    """`rope_q`: q is rotated first (`apply_rope(q, cos, sin)`, rounded to q.dtype, as the model rotates its
    queries). Window rows dequantised into q.dtype, bank rows gathered at `indices.clamp(min=0)` and dequantised into
    FP32, scores in FP32 with -inf at hidden window rows and at -1 slots, softmax over [scores ; sink] with the
    sink column dropped, the two value products, o.to(q.dtype), inverse RoPE. q [B, T, H, D]; returns
    [B, T, H, D] in q.dtype."""
    if rope_q:
        q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    b, h = q.shape[0], q.shape[2]
    t, s = q.shape[1], window_codes.shape[1]
    keys = dequantize_fp8_1x32(window_codes, window_scales, q.dtype).float()
    qc = q.float()
    sw = torch.einsum("bthd,bsd->bths", qc, keys) * softmax_scale
    sw = torch.where(window_ok[:, :, None, :], sw, torch.full_like(sw, float("-inf")))
    rows = indices.long().clamp(min=0)
    bi = torch.arange(b, device=q.device)[:, None, None]
    bank = dequantize_fp4_e4m3_1x16(bank_codes[bi, rows], bank_scales[bi, rows], torch.float32)
    sb = torch.einsum("bthd,btkd->bthk", qc, bank) * softmax_scale
    sb = torch.where((indices >= 0)[:, :, None, :], sb, torch.full_like(sb, float("-inf")))
    logits = torch.cat((sw, sb, sink.view(1, 1, h, 1).expand(b, t, h, 1)), dim=-1)
    p = torch.softmax(logits, dim=-1)[..., :-1]
    o = torch.einsum("bths,bsd->bthd", p[..., :s], keys) + torch.einsum("bthk,btkd->bthd", p[..., s:], bank)
    return apply_rope(o.to(q.dtype), cos[:, :, None], sin[:, :, None], inverse=True)
