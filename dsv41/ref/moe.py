"""Semantics of the MoE ops (`dsv41::moe_router`, `moe_combine`) in plain PyTorch: the router's sqrt-softplus
scores, biased top-k with the lower-index tie rule and normalised weights, and the weighted sum of the expert
outputs plus the shared expert. No argument checks (the kernels' `reference_*` make them). Sources: MODEL.md §2.9;
dsv41/model/moe.py `Gate.forward`, `MoE.forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .topk import topk_lowest_index_on_ties

__all__ = ["moe_router", "moe_combine"]


def moe_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, topk: int, gate_temp: float,
               route_scale: float, norm_eps: float):
    """(weights fp32 [..., k], ids int64 [..., k]) of x [..., d] with router weight [E, d] (upcast to FP32) and
    fp32 selection bias [E] or None; ids in descending biased-score order, lower index first on ties."""
    lead = x.shape[:-1]
    xf = x.reshape(-1, x.shape[-1])
    logits = xf.float() @ weight.float().t() / gate_temp
    scores = torch.sqrt(F.softplus(logits))
    biased = scores + bias if bias is not None else scores
    ids = topk_lowest_index_on_ties(biased, topk)[1]
    w = scores.gather(1, ids)
    w = w / (w.sum(dim=-1, keepdim=True) + norm_eps) * route_scale
    return w.reshape(*lead, topk).contiguous(), ids.reshape(*lead, topk).contiguous()


def moe_combine(y: torch.Tensor, shared: torch.Tensor, weights: torch.Tensor | None,
                out_dtype: torch.dtype, y_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`((w * y.float()).sum(-2) + shared.float()).to(out_dtype)`: y [..., k, d], shared [..., d], weights
    [..., k] or None (V4.1 applies them before w2); y_dtype: y is first rounded to it (an FP32 y whose cast to
    bf16 the op takes over). Returns [..., d] in out_dtype."""
    if y_dtype is not None:
        y = y.to(y_dtype)
    yf = y.float()
    if weights is not None:
        yf = weights.float().unsqueeze(-1) * yf
    return (yf.sum(dim=-2) + shared.float()).to(out_dtype).contiguous()
