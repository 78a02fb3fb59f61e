"""RoPE, the KV-cache write and grouped-query decode attention in one launch: the `rope_gqa` fusion target.

Why. After the `rope_kv` and `gqa_attention` families a Llama-style layer still spends two launches between its
q/k/v projection and its o_proj: `rope_kv_store` (a few kilobytes: rotate q and k, write the new k and v rows into
the caches) and the attention over the caches. At batch 1 the first is almost all launch ramp and dependency
wait. This op does both in the attention's launch: every program rotates its own query rows and the step's new K
and V rows of its KV head, the last split writes those rows into the caches, and every split uses them in place of
the cache rows at their positions (another split may read those rows before they are written).

Op (`dsv41::rope_gqa_decode_attention(q, k, v, cos, sin, pos, k_cache!, v_cache!, layout, round_products, mask,
scale) -> out`):
    q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products   as `dsv41::rope_kv_store` takes them
             (dsv41/kernels/rope_kv.py): q [B, M, Hq, D], k, v [B, M, Hkv, D], caches [B, Hkv, T, D] written in
             place at `pos`
    mask, scale   as `dsv41::gqa_decode_attention` takes them (dsv41/kernels/gqa_attention.py): mask
             broadcastable to [B, Hq, M, T]
    out      q's dtype [B, Hq, M, D] (contiguous) = gqa_decode_attention(rope(q) transposed to [B, Hq, M, D],
             k_cache, v_cache, mask, scale) after the caches are written
Reference: `reference_rope_gqa_decode_attention`, the two ops' references one after the other. Numerics: as the
two ops (q rotated and rounded to q's dtype as `rope_kv_store` returns it, the new K row rounded as the cache
stores it; attention in FP32, rounded once). On CUDA, M <= MAX_TRITON_M, D <= 256, even D and caches with a
contiguous last dim run the Triton kernel (`gqa_attention._gqa_kernel` with its RoPE prologue), else the
reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import register_cuda
from .gqa_attention import MAX_TRITON_M, check_gqa_args, launch_gqa, reference_gqa_decode_attention
from .rope_kv import check_rope_kv_args, reference_rope_kv_store, same_layout_trig

__all__ = ["rope_gqa_decode_attention", "reference_rope_gqa_decode_attention", "triton_rope_gqa_decode_attention"]


def _contiguous_strides(shape) -> list[int]:
    """The strides of a contiguous tensor of `shape` (what the reference's rotated q is laid out as)."""
    return list(torch.empty(shape, device="meta").stride())


def _check(q, k, v, cos, sin, pos, k_cache, v_cache, layout, mask) -> None:
    """Both ops' argument checks (errors name the argument), plus q's presence (this op attends with it)."""
    if q is None:
        raise ValueError("q is None: rope_gqa_decode_attention attends with the rotated q")
    check_rope_kv_args(q, k, v, cos, sin, pos, k_cache, v_cache, layout, _contiguous_strides(q.shape))
    check_gqa_args(q.transpose(1, 2), k_cache, v_cache, mask)


def reference_rope_gqa_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                        sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                                        v_cache: torch.Tensor, layout: int, round_products: bool,
                                        mask: Optional[torch.Tensor] = None,
                                        scale: Optional[float] = None) -> torch.Tensor:
    """`reference_rope_kv_store` (writes k_cache / v_cache in place at pos, returns rope(q) [B, M, Hq, D]), then
    `reference_gqa_decode_attention` of rope(q) transposed to [B, Hq, M, D] over the written caches.

    Args: see the module docstring. Returns: q's dtype [B, Hq, M, D], contiguous.
    Raises: TypeError / ValueError naming the argument for dtypes or shapes either op rejects, ValueError for q None.
    Sources: RoFormer (Su et al., 2021); Ainslie et al. 2023, "GQA".
    """
    _check(q, k, v, cos, sin, pos, k_cache, v_cache, layout, mask)
    qr = reference_rope_kv_store(q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products,
                                 _contiguous_strides(q.shape))
    return reference_gqa_decode_attention(qr.transpose(1, 2), k_cache, v_cache, mask, scale)


def triton_rope_gqa_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                     sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                                     v_cache: torch.Tensor, layout: int, round_products: bool,
                                     mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                                     **overrides) -> torch.Tensor:
    """`reference_rope_gqa_decode_attention` on the Triton kernel (interpreted on CPU under TRITON_INTERPRET=1);
    `overrides` as `gqa_plan` takes them. Raises as the reference, plus RuntimeError when the kernel cannot run on
    the device and ValueError for D > 256, an odd D or caches whose last dim is not contiguous."""
    _check(q, k, v, cos, sin, pos, k_cache, v_cache, layout, mask)
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dim (stride 1)")
    if q.shape[-1] % 2:
        raise ValueError(f"head dim {q.shape[-1]} is odd: RoPE rotates pairs")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cos, sin, pos = same_layout_trig(cos, sin, pos)
    rope = dict(k=k, v=v, cos=cos, sin=sin, pos=pos, layout=layout, round_products=round_products)
    return launch_gqa(q.transpose(1, 2), k_cache, v_cache, mask, scale, overrides, rope=rope,
                      caller="triton_rope_gqa_decode_attention")


@torch.library.custom_op("dsv41::rope_gqa_decode_attention", mutates_args=("k_cache", "v_cache"),
                         device_types="cpu")
def rope_gqa_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              layout: int, round_products: bool, mask: Optional[torch.Tensor] = None,
                              scale: Optional[float] = None) -> torch.Tensor:
    """RoPE of q and k, k and v written into their caches at `pos`, then attention of rope(q) over the caches;
    see the module docstring."""
    return reference_rope_gqa_decode_attention(q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products,
                                               mask, scale)


@register_cuda(rope_gqa_decode_attention, "dsv41::rope_gqa_decode_attention")
def _rope_gqa_cuda(q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products, mask=None, scale=None):
    if (q.shape[1] <= MAX_TRITON_M and q.shape[-1] <= 256 and q.shape[-1] % 2 == 0 and k_cache.stride(3) == 1
            and v_cache.stride(3) == 1):
        return triton_rope_gqa_decode_attention(q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products,
                                                mask, scale)
    return reference_rope_gqa_decode_attention(q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products,
                                               mask, scale)


@rope_gqa_decode_attention.register_fake
def _rope_gqa_fake(q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products, mask=None, scale=None):
    b, m, hq, d = q.shape
    return q.new_empty((b, hq, m, d))
