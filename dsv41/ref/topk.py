"""Top-k selection with a fixed tie rule, and the two-level candidate pool of the CSA indexer (MODEL.md §2.7
steps 4-5). The eager indexer (`dsv41.model.csa`) and the fused indexer ops select with these."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["select_topk", "candidate_mask", "topk_lowest_index_on_ties"]


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k rows of `scores` [B, T, N] (FP32, -inf = not selectable), as sorted indices with -1 padding.

    Returns int64 [B, T, min(k, N)]: selected row indices ascending, then -1 for every slot whose score was
    -inf (fewer than k selectable rows).
    Tie rule: among equal scores the LOWER row index wins (a stable descending sort). ReLU makes exact ties
    common (rows whose every head is negative score exactly 0), and `torch.topk`'s tie order depends on the
    row count, so without a rule the selection would depend on the cache size.
    Source: MODEL.md §2.7 step 5.
    """
    k = min(k, scores.shape[-1])
    vals, idx = topk_lowest_index_on_ties(scores, k)
    big = scores.shape[-1]
    idx = torch.where(vals > float("-inf"), idx, torch.full_like(idx, big))
    idx, _ = torch.sort(idx, dim=-1)
    return torch.where(idx == big, torch.full_like(idx, -1), idx)


def topk_lowest_index_on_ties(scores: torch.Tensor, k: int):
    """(values, indices) of the k largest entries along the last dim, equal values in ascending index order (a
    stable descending sort; `torch.topk` leaves that order unspecified). Shapes: scores [..., N] -> two [..., k]."""
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def candidate_mask(scores: torch.Tensor, n_visible: torch.Tensor, block: int, n_blocks: int) -> torch.Tensor:
    """Two-level candidate pool of the candidate-source layer (MODEL.md §2.7 step 4).

    Args:
        scores: [B, T, N] FP32 index scores, -inf where invisible.
        n_visible: [B, T] visible rows per query (the newest block is the one holding row n-1).
        block: rows per block (8); n_blocks: blocks kept (2048).
    Returns:
        bool [B, T, N]: rows of the top-`n_blocks` blocks by block max (the newest block forced in), only
        blocks with a finite score; ties between equal block maxima go to the lower block index.
    """
    b, t, n = scores.shape
    nb = -(-n // block)
    pad = nb * block - n
    s = F.pad(scores, (0, pad), value=float("-inf")) if pad else scores
    bmax = s.view(b, t, nb, block).amax(-1)
    newest = torch.div(n_visible - 1, block, rounding_mode="floor").clamp(min=0)
    is_newest = torch.arange(nb, device=scores.device) == newest[..., None]
    bmax = torch.where(is_newest & (n_visible[..., None] > 0), torch.full_like(bmax, float("inf")), bmax)
    vals, idx = topk_lowest_index_on_ties(bmax, min(n_blocks, nb))
    keep = torch.zeros(b, t, nb, dtype=torch.bool, device=scores.device)
    keep = keep.scatter(-1, idx, vals > float("-inf"))
    return keep[..., None].expand(b, t, nb, block).reshape(b, t, nb * block)[..., :n]
