"""mHC: four-stream manifold-constrained hyper-connections, as plain functions (MODEL.md §2.3).

The residual state of a token is `H [4, d]` (hc_mult = 4 streams). Around every sublayer the block
computes three mixes from H (`mhc_mixes`), collapses the four streams into the sublayer input with a
pre mix (`mhc_collapse`) and writes the sublayer output back into four streams with a post mix and a
doubly-stochastic-ish stream mixing matrix (`mhc_expand`). The parameters (`hc_*_fn/base/scale`) and
the V4.1 single-pass ordering (pre mix shifted one site back) belong to the Block that calls these.

Everything is static-shape and host-sync-free so a decode step is capturable with
`torch.compile(fullgraph=True)`. Sources: MODEL.md §2.3; [R41] `inference/model.py` (`hc_pre`,
`hc_post`, `sinkhorn`); [P] mHC arXiv 2512.24880.
"""

from __future__ import annotations

import torch

from .norm import rms_norm

__all__ = ["HC_MULT", "sinkhorn", "mhc_mixes", "mhc_collapse", "mhc_expand", "mhc_mixes_normed",
           "mhc_collapse_rmsnorm"]

HC_MULT = 4


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn normalisation of stream-mixing logits, ending on the column (source-axis) normalisation.

    Recipe (MODEL.md §2.3 step 6, keep this exact order):
    `C = softmax_j(logits) + eps`; `C = C / (sum_i C + eps)`; then `iters - 1` times
    `C = C / (sum_j C + eps)` (rows) followed by `C = C / (sum_i C + eps)` (columns).
    Index convention: `C[..., i, j]`, i = source stream (dim -2), j = destination stream (dim -1).
    After the last step every column sums to ~1; rows only approximately.

    Args:
        logits: [..., 4, 4] FP32 (other float dtypes are promoted to FP32).
        iters: total number of normalisation rounds (20 in V4.1), >= 1.
        eps: hc_eps (1e-6 in V4.1).
    Returns:
        [..., 4, 4] FP32.
    Raises:
        ValueError: `iters < 1` or the last two dims are not square.
    Source: MODEL.md §2.3; [R41] `sinkhorn`.
    """
    if iters < 1:
        raise ValueError(f"sinkhorn needs iters >= 1, got {iters}")
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn expects [..., n, n] logits, got shape {tuple(logits.shape)}")
    c = torch.softmax(logits.float(), dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def mhc_mixes(H: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
              hc_eps: float, iters: int):
    """Pre, post and stream-mixing coefficients of one mHC site (MODEL.md §2.3 steps 1-6).

    1. `z = flatten(H)` in FP32 (4d values per token);
    2. `r = rsqrt(mean(z^2) + norm_eps)` (one unweighted statistic over all four streams);
    3. `m = (z @ fn^T) * r` (24 values: 0:4 pre, 4:8 post, 8:24 comb row-major);
    4. `pre = sigmoid(m[0:4] * scale[0] + base[0:4]) + hc_eps`;
    5. `post = 2 * sigmoid(m[4:8] * scale[1] + base[4:8])`;
    6. `comb = sinkhorn((m[8:24] * scale[2] + base[8:24]).view(4, 4), iters, hc_eps)`.

    Args:
        H: [B, T, 4, d] residual streams, any float dtype.
        fn: [24, 4d] FP32 (`hc_{attn,ffn}_fn`). base: [24] FP32. scale: [3] FP32.
        norm_eps: rms_norm_eps (1e-20 in V4.1). hc_eps: 1e-6. iters: Sinkhorn rounds (20).
    Returns:
        (pre [B, T, 4] FP32, post [B, T, 4] FP32, comb [B, T, 4, 4] FP32 with comb[..., i, j] the weight
        of source stream i in destination stream j).
    Raises:
        ValueError: H is not [B, T, 4, d] or fn/base/scale have the wrong shapes.
    Source: MODEL.md §2.3; [R41] `hc_pre`.
    """
    if H.dim() != 4 or H.shape[2] != HC_MULT:
        raise ValueError(f"mhc_mixes expects H [B, T, {HC_MULT}, d], got {tuple(H.shape)}")
    n_mix = (2 + HC_MULT) * HC_MULT
    width = HC_MULT * H.shape[3]
    if tuple(fn.shape) != (n_mix, width):
        raise ValueError(f"mhc_mixes: fn must be [{n_mix}, {width}], got {tuple(fn.shape)}")
    if tuple(base.shape) != (n_mix,):
        raise ValueError(f"mhc_mixes: base must be [{n_mix}], got {tuple(base.shape)}")
    if tuple(scale.shape) != (3,):
        raise ValueError(f"mhc_mixes: scale must be [3], got {tuple(scale.shape)}")
    z = H.flatten(2).float()
    r = torch.rsqrt(z.square().mean(dim=-1, keepdim=True) + norm_eps)
    m = (z @ fn.float().t()) * r
    base = base.float()
    scale = scale.float()
    pre = torch.sigmoid(m[..., 0:HC_MULT] * scale[0] + base[0:HC_MULT]) + hc_eps
    post = 2.0 * torch.sigmoid(m[..., HC_MULT:2 * HC_MULT] * scale[1] + base[HC_MULT:2 * HC_MULT])
    comb_logits = m[..., 2 * HC_MULT:] * scale[2] + base[2 * HC_MULT:]
    comb = sinkhorn(comb_logits.unflatten(-1, (HC_MULT, HC_MULT)), iters, hc_eps)
    return pre, post, comb


def mhc_collapse(H: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse four streams into a sublayer input: `x = sum_i pre_i * H_i`, accumulated in FP32.

    Args:
        H: [B, T, 4, d] any float dtype. pre: [B, T, 4] (FP32 from `mhc_mixes`, or the one-hot initial mix).
    Returns:
        [B, T, d] in `H.dtype`.
    Raises:
        ValueError: shapes do not agree.
    Source: MODEL.md §2.3 "collapse"; [R41] `hc_pre`.
    """
    if H.dim() != 4 or tuple(pre.shape) != tuple(H.shape[:3]):
        raise ValueError(f"mhc_collapse: pre {tuple(pre.shape)} must be H.shape[:3] of H {tuple(H.shape)}")
    x = (pre.float().unsqueeze(-1) * H.float()).sum(dim=2)
    return x.to(H.dtype)


def mhc_expand(y: torch.Tensor, H: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Write a sublayer output back into four streams: `H'_j = post_j * y + sum_i comb[i, j] * H_i` (FP32).

    Args:
        y: [B, T, d] sublayer output. H: [B, T, 4, d] the sublayer's residual input.
        post: [B, T, 4] FP32. comb: [B, T, 4, 4] FP32 (i = source, j = destination).
    Returns:
        [B, T, 4, d] in `H.dtype`.
    Raises:
        ValueError: shapes do not agree.
    Source: MODEL.md §2.3 "expand"; [R41] `hc_post`.
    """
    if H.dim() != 4 or H.shape[2] != HC_MULT:
        raise ValueError(f"mhc_expand expects H [B, T, {HC_MULT}, d], got {tuple(H.shape)}")
    B, T = H.shape[0], H.shape[1]
    if tuple(y.shape) != (B, T, H.shape[3]):
        raise ValueError(f"mhc_expand: y {tuple(y.shape)} must be [B, T, d] of H {tuple(H.shape)}")
    if tuple(post.shape) != tuple(H.shape[:3]) or tuple(comb.shape) != (B, T, HC_MULT, HC_MULT):
        raise ValueError(f"mhc_expand: post {tuple(post.shape)} / comb {tuple(comb.shape)} do not match "
                         f"H {tuple(H.shape)}")
    # comb^T @ H: row j of the product is sum_i comb[i, j] * H_i.
    mixed = comb.float().transpose(-1, -2) @ H.float()
    out = post.float().unsqueeze(-1) * y.float().unsqueeze(2) + mixed
    return out.to(H.dtype)


def mhc_mixes_normed(H: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                     hc_eps: float, iters: int, norm_weight: torch.Tensor | None = None):
    """`dsv41::mhc_mixes`: `mhc_mixes` with contiguous results and an optional RMS weight.

    With `norm_weight` w [4d] the projection reads the weighted normalised streams, m = (z * r * w) @ fn^T (the
    "RMS-normalise, then project" spelling); r stays over the unweighted z. Computed as `mhc_mixes` with
    fn * w[None, :]: one more FP32 rounding per fn element than z * r * w, equal to FP32 rounding.
    Shapes and errors as `mhc_mixes`. Source: MODEL.md §2.3 steps 1-6.
    """
    if norm_weight is not None:
        fn = fn * norm_weight.float()[None, :]
    pre, post, comb = mhc_mixes(H, fn, base, scale, float(norm_eps), float(hc_eps), int(iters))
    return pre.contiguous(), post.contiguous(), comb.contiguous()


def mhc_collapse_rmsnorm(H: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`dsv41::mhc_collapse_rmsnorm`: `rms_norm(mhc_collapse(H, pre), weight, eps)`, contiguous.

    H [B, T, 4, d]; pre [B, T, 4]; weight [d]. Returns [B, T, d] in H.dtype. Source: MODEL.md §2.2, §2.3.
    """
    return rms_norm(mhc_collapse(H, pre), weight, float(eps)).contiguous()
