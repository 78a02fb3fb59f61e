"""Semantics of the indexer ops (`dsv41::indexer_scores`, `indexer_topk`, `indexer_candidates`) in plain
PyTorch: the eager `Indexer.scores` (ReLU'd, head-weighted q.k over FP4 keys, -inf past n_visible), `select_topk`
with -1 padding, and the two-level candidate pool. Shapes: dsv41/kernels/indexer.py's module docstring. No
argument checks (the kernels' `reference_*` make them). Sources: MODEL.md §2.7; dsv41/model/csa.py.
"""

from __future__ import annotations

import torch

from .formats import dequantize_fp4_ue8m0_1x32
from .topk import select_topk

__all__ = ["indexer_scores", "indexer_topk", "indexer_candidates", "block_scores", "candidate_width"]


def candidate_width(n_rows, block_size: int, n_blocks: int):
    """Blocks `indexer_candidates` returns per query: min(n_blocks, ceil(n_rows / block_size)) (`n_rows` may be
    a SymInt: no guard is added)."""
    return torch.sym_min(n_blocks, -(-n_rows // block_size))


def indexer_scores(q, weights, key_codes, key_scales, n_visible, blocks=None, block_size=1):
    """fp32 [B, T, N] index scores (einsum over the dequantised keys, ReLU, head-weighted sum, -inf past
    n_visible); with `blocks` the pool's rows gathered into compact slots (-inf for empty blocks and rows >= N)."""
    k = dequantize_fp4_ue8m0_1x32(key_codes, key_scales, torch.float32)
    logits = torch.einsum("bthd,bnd->bthn", q.float(), k)
    s = (torch.relu(logits) * weights.float()[..., None]).sum(dim=2)
    n = key_codes.shape[1]
    vis = torch.arange(n, device=s.device) < n_visible[..., None]
    s = torch.where(vis, s, torch.full_like(s, float("-inf")))
    if blocks is None:
        return s
    rows = (blocks[..., None] * block_size + torch.arange(block_size, device=s.device)).flatten(-2)
    ok = (blocks[..., None] >= 0).expand(*blocks.shape, block_size).flatten(-2) & (rows < n)
    if n == 0:
        return torch.full(rows.shape, float("-inf"), device=s.device)
    g = torch.gather(s, -1, rows.clamp(0, n - 1))
    return torch.where(ok, g, torch.full_like(g, float("-inf")))


def indexer_topk(scores, k, blocks=None, block_size=1, offset=0):
    """int64 [B, T, k]: `select_topk` (lower index on ties, -1 for -inf picks) padded with -1 to k columns, compact
    slots mapped to rows through `blocks`, then `offset` added to every selected id."""
    b, t, s = scores.shape
    idx = select_topk(scores, k) if s else scores.new_zeros((b, t, 0), dtype=torch.int64)
    if idx.shape[-1] < k:
        idx = torch.cat((idx, idx.new_full((b, t, k - idx.shape[-1]), -1)), dim=-1)
    if blocks is not None:
        slot = idx.clamp(min=0)
        rows = torch.gather(blocks, -1, slot // block_size) * block_size + slot % block_size
        idx = torch.where(idx >= 0, rows, idx)
    if offset:
        idx = torch.where(idx >= 0, idx + offset, idx)
    return idx


def block_scores(scores, n_visible, block_size):
    """fp32 [B, T, ceil(N / block_size)]: max over each block of rows (-inf padding), +inf for the block holding
    row n_visible - 1 when n_visible > 0 (the newest block is pinned). `candidate_mask`'s block statistic."""
    b, t, n = scores.shape
    nb = -(-n // block_size)
    pad = nb * block_size - n
    s = torch.nn.functional.pad(scores, (0, pad), value=float("-inf")) if pad else scores
    bmax = s.view(b, t, nb, block_size).amax(-1)
    newest = torch.div(n_visible - 1, block_size, rounding_mode="floor").clamp(min=0)
    is_newest = torch.arange(nb, device=scores.device) == newest[..., None]
    return torch.where(is_newest & (n_visible[..., None] > 0), torch.full_like(bmax, float("inf")), bmax)


def indexer_candidates(scores, n_visible, block_size, n_blocks):
    """int64 [B, T, W], W = `candidate_width`: `select_topk` over `block_scores` keeps the blocks `candidate_mask`
    keeps (top n_blocks by block max, lower block on ties, finite only)."""
    bmax = block_scores(scores, n_visible.to(torch.int64), block_size)
    w = candidate_width(scores.shape[-1], block_size, n_blocks)
    if bmax.shape[-1] == 0:
        return bmax.new_zeros(bmax.shape, dtype=torch.int64)
    return select_topk(bmax, w)
