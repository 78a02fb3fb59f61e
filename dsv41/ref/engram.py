"""Engram's hash and gate as functions (MODEL.md §2.10): table row ids of the look-back tokens, and the gated
residual update. The module tree (`dsv41.model.engram`) and the fused ops (`dsv41::engram_lookup`, `engram_gate`)
both compute with these. Sources: MODEL.md §2.10; [R41] `inference/engram.py`; [TK] `engram_gate`."""

from __future__ import annotations

import math

import torch

from .formats import dequantize_fp8_1x32

__all__ = ["engram_row_ids", "engram_update", "engram_lookup", "engram_gate"]


def engram_row_ids(u: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
                   n_heads: int) -> torch.Tensor:
    """Table row ids of each token: rolling XOR hash, one bucket per (n-gram order, head).

    `h_1 = (u_0*m_0) XOR (u_1*m_1)`, `h_k = h_{k-1} XOR (u_k*m_k)`; row for order k, head e is
    `h_k mod primes[(k-1)*n_heads + e] + offsets[(k-1)*n_heads + e]`. All int64; cids must lie in
    [0, Vc) so that no product overflows (the multiplier bound guarantees it).

    Args:
        u: [B, T, M] int64 from `engram_lookback` (M = max_ngram).
        multipliers: [M] int64. primes, offsets: [R] int64 with R = (M-1) * n_heads (order-major).
        n_heads: engram_n_heads.
    Returns:
        [B, T, R] int64 row ids into the layer's table.
    Raises:
        ValueError: shapes or dtypes that do not agree.
    Source: MODEL.md §2.10 steps 5-6.
    """
    if u.dim() != 3:
        raise ValueError(f"engram_row_ids: u must be [B, T, M], got {tuple(u.shape)}")
    m = u.shape[-1]
    r = (m - 1) * n_heads
    if tuple(multipliers.shape) != (m,):
        raise ValueError(f"engram_row_ids: multipliers must be [{m}] (M of u), got {tuple(multipliers.shape)}")
    if tuple(primes.shape) != (r,) or tuple(offsets.shape) != (r,):
        raise ValueError(f"engram_row_ids: primes and offsets must be [{r}] ((M-1)*n_heads), got "
                         f"{tuple(primes.shape)} and {tuple(offsets.shape)}")
    for name, x in (("u", u), ("multipliers", multipliers), ("primes", primes), ("offsets", offsets)):
        if x.dtype != torch.int64:
            raise ValueError(f"engram_row_ids: {name} must be int64, got {x.dtype}")
    prod = u * multipliers                                             # [B, T, M]
    h = prod[..., 0]
    hashes = []
    for k in range(1, m):
        h = torch.bitwise_xor(h, prod[..., k])
        hashes.append(h)
    hk = torch.stack(hashes, dim=-1).repeat_interleave(n_heads, dim=-1)  # [B, T, R], order-major
    return torch.remainder(hk, primes) + offsets


def engram_update(H: torch.Tensor, keys: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated Engram residual update, all in FP32: `H_i + g_i * value` per stream i.

    `w = q_weight * k_weight`; `rs_i = rsqrt(mean(H_i^2) + eps) * rsqrt(mean(key_i^2) + eps)`;
    `dot_i = sum_c H_i[c] w[i, c] key_i[c] * rs_i / sqrt(d)`;
    `g_i = sigmoid(sign(dot_i) * sqrt(max(|dot_i|, 1e-6)))`.

    Args:
        H: [B, T, 4, d] residual streams. keys: [B, T, 4, d] (one key per stream). value: [B, T, d]
            (shared by all streams). q_weight, k_weight: [4, d]. eps: rms_norm_eps.
    Returns:
        [B, T, 4, d] in `H.dtype`.
    Raises:
        ValueError: shapes that do not agree.
    Source: MODEL.md §2.10 "Gate per stream", "Update"; [TK] `engram_gate`.
    """
    if H.dim() != 4 or tuple(keys.shape) != tuple(H.shape) or tuple(value.shape) != (H.shape[0], H.shape[1], H.shape[3]):
        raise ValueError(f"engram_update: H {tuple(H.shape)}, keys {tuple(keys.shape)} (same as H) and value "
                         f"{tuple(value.shape)} ([B, T, d]) do not agree")
    if tuple(q_weight.shape) != tuple(H.shape[2:]) or tuple(k_weight.shape) != tuple(H.shape[2:]):
        raise ValueError(f"engram_update: q_weight {tuple(q_weight.shape)} and k_weight {tuple(k_weight.shape)} "
                         f"must be {tuple(H.shape[2:])}")
    d = H.shape[-1]
    hf = H.float()
    kf = keys.float()
    w = q_weight.float() * k_weight.float()
    rs = torch.rsqrt(hf.square().mean(dim=-1) + eps) * torch.rsqrt(kf.square().mean(dim=-1) + eps)
    dot = (hf * w * kf).sum(dim=-1) * rs / math.sqrt(d)
    g = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
    return (hf + g.unsqueeze(-1) * value.float().unsqueeze(2)).to(H.dtype)


def engram_lookup(u: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
                  weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dsv41::engram_lookup`: row ids (`engram_row_ids`), gather, FP8 1x32 dequantisation, rows concatenated.

    Args: u int64 [B, T, M], M >= 2; multipliers int64 [M]; primes, offsets int64 [R], R = (M - 1) * n_heads;
        weight uint8 [rows, C] E4M3 bytes; scale uint8 [rows, C/32] UE8M0; dtype of the result.
    Returns: [B, T, R * C] in `dtype`. Raises: IndexError (from the gather) for a row id outside [0, rows).
    Source: MODEL.md §2.10 steps 5-6; dsv41/model/engram.py `EngramTable.forward`, `Engram.forward`.
    """
    n_heads = primes.shape[0] // (u.shape[2] - 1)
    ids = engram_row_ids(u, multipliers, primes, offsets, n_heads)
    return dequantize_fp8_1x32(weight[ids], scale[ids], dtype).flatten(2).contiguous()


def engram_gate(H: torch.Tensor, keys: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`dsv41::engram_gate`: `engram_update` with a float eps, contiguous; [B, T, 4, d] in H.dtype."""
    return engram_update(H, keys, value, q_weight, k_weight, float(eps)).contiguous()
