"""RoPE of the decode step's q and k and the KV-cache write of k and v, in one launch: the `rope_kv` fusion target.

Why. In eager Llama-style attention the new token's q and k are rotated (RoPE) and k and v are written into a
static cache at the step's positions. torch.compile turns that into several small launches per layer: casts to
FP32, the rotation (an ATen fallback for gpt-fast's complex multiply, which Inductor does not generate), casts
back, and one scatter per cache. At batch 1 each is a few microseconds of launch and dependency for a few
kilobytes of data; this op does all of it in one launch.

Op (`dsv41::rope_kv_store(q, k, v, cos, sin, pos, k_cache!, v_cache!, layout, round_products, q_out_stride)
-> q_rot`):
    q        [B, S, H, D] bf16 / fp16 / fp32, or None (then q_rot is an empty [0] tensor)
    k, v     [B, S, Hkv, D], q's dtype
    cos, sin [B, S, W] fp32, or the dtype of k with `round_products` (any strides; stride 0 broadcasts)
    pos      int64 [S]: the cache position of each of the S new tokens; a negative one counts from the end
             (pos + T), as `index_put` wraps it; one outside [-T, T) is skipped (the op wraps, so a compiled graph
             needs no kernel of its own for it)
    k_cache, v_cache [B, Hkv, T, D], k's dtype, written in place:
             k_cache[b, h, pos[s]] = rope(k)[b, s, h];  v_cache[b, h, pos[s]] = v[b, s, h]
    layout   0: interleaved pairs (2i, 2i+1), W = D/2 (Meta's reference Llama, gpt-fast, `view_as_complex`);
             1: rotate-half pairs (i, i + D/2), W = D/2;
             2: rotate-half with full-width trig, W = D: x * cos + rotate_half(x) * sin (transformers)
    round_products  False: each output is a*c - b*s (a*s + b*c) in FP32, rounded once to x's dtype;
             True: as eager computes in x's dtype: both products rounded to x's dtype, then their sum
    q_out_stride    the strides of q_rot in [B, S, H, D] order (q_rot has q's shape), so that the op can stand in
             for a tensor of any layout
Reference: `reference_rope_kv_store` (float math on CPU). Sources: RoFormer (Su et al., 2021) eq. 34 for the
pairs; Meta's `llama/model.py` `apply_rotary_emb` (interleaved) and transformers' `rotate_half` (half split).

Kernel. Program (b s, row) for row < H (q heads), H <= row < H + Hkv (k heads) and the Hkv v heads after them:
loads the row's D values and its token's trig, rotates (v rows are copied), and stores to q_rot or the cache row
pos[s]. With PDL the program waits for the previous kernel before its first load and lets the next one start
right after its stores are issued.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (check_same_device, check_tensor, next_power_of_2, register_cuda, require_launchable,
                      round_to, use_pdl_for)

__all__ = ["rope_kv_store", "reference_rope_kv_store", "triton_rope_kv_store", "rope_apply_reference", "LAYOUTS",
           "same_layout_trig", "check_rope_kv_args"]

#: layout code -> (name, trig width as a fraction of D)
LAYOUTS = {0: ("interleaved", 2), 1: ("rotate_half", 2), 2: ("rotate_half_full", 1)}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def same_layout_trig(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> tuple:
    """(cos, sin, pos) as the kernels read them: one set of strides for both angle tensors (the kernels take
    cos's), and contiguous positions. Copies only what breaks that (cos and sin of different layouts become
    contiguous, as does a strided pos); returns the inputs themselves otherwise."""
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if pos.numel() > 1 and pos.stride(0) != 1:
        pos = pos.contiguous()
    return cos, sin, pos


def _pairs(d: int, layout: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices (p0, p1) [D/2] of the rotated pairs of `layout`."""
    i = torch.arange(d // 2, device=device)
    return (2 * i, 2 * i + 1) if layout == 0 else (i, i + d // 2)


def rope_apply_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: int,
                         round_products: bool) -> torch.Tensor:
    """RoPE of x [B, S, Hh, D] by cos / sin [B, S, W] (`layout`, `round_products` as in the module docstring), in
    x's dtype. Raises ValueError for an unknown layout or a W that does not fit it."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout}")
    d = x.shape[-1]
    w = d // LAYOUTS[layout][1]
    if cos.shape[-1] != w or sin.shape[-1] != w or d % 2:
        raise ValueError(f"layout {layout} ({LAYOUTS[layout][0]}) with D={d} needs cos / sin of width {w}, got "
                         f"{cos.shape[-1]} / {sin.shape[-1]}")
    p0, p1 = _pairs(d, layout, x.device)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if layout == 2:
        c0, c1, s0, s1 = c[..., p0], c[..., p1], s[..., p0], s[..., p1]
    else:
        c0 = c1 = c
        s0 = s1 = s
    a, b = x[..., p0], x[..., p1]
    out = torch.empty_like(x)
    if round_products:
        dt = x.dtype
        out[..., p0] = (a * c0.to(dt)).to(dt) - (b * s0.to(dt)).to(dt)
        out[..., p1] = (b * c1.to(dt)).to(dt) + (a * s1.to(dt)).to(dt)
    else:
        af, bf = a.float(), b.float()
        out[..., p0] = (af * c0.float() - bf * s0.float()).to(x.dtype)
        out[..., p1] = (af * s1.float() + bf * c1.float()).to(x.dtype)
    return out


def check_rope_kv_args(q, k, v, cos, sin, pos, k_cache, v_cache, layout, q_out_stride) -> None:
    """Validate shapes and dtypes; errors name the argument at fault."""
    check_tensor("k", k, dtypes=_DTYPES, ndim=4)
    check_tensor("v", v, dtypes=(k.dtype,), ndim=4)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, dtypes=(k.dtype,), ndim=4)
    check_tensor("pos", pos, dtypes=(torch.int64,), ndim=1)
    check_tensor("cos", cos, dtypes=(torch.float32, k.dtype), ndim=3)
    check_tensor("sin", sin, dtypes=(cos.dtype,), ndim=3)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout}")
    b, s, hkv, d = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[1] != hkv or k_cache.shape[3] != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         f"[B={b}, Hkv={hkv}, T, D={d}]")
    if pos.shape[0] != s:
        raise ValueError(f"pos has {pos.shape[0]} positions for S={s} new tokens")
    w = d // LAYOUTS[layout][1]
    if d % 2 or tuple(cos.shape) != (b, s, w) or tuple(sin.shape) != (b, s, w):
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [B={b}, S={s}, W={w}] for "
                         f"layout {layout} ({LAYOUTS[layout][0]}) and D={d}")
    if q is not None:
        check_tensor("q", q, dtypes=(k.dtype,), ndim=4)
        if q.shape[0] != b or q.shape[1] != s or q.shape[3] != d:
            raise ValueError(f"q {tuple(q.shape)} must be [B={b}, S={s}, H, D={d}]")
        if len(q_out_stride) != 4:
            raise ValueError(f"q_out_stride must give 4 strides, got {list(q_out_stride)}")
        check_same_device(q=q, k=k, v=v, cos=cos, sin=sin, pos=pos, k_cache=k_cache, v_cache=v_cache)
    else:
        check_same_device(k=k, v=v, cos=cos, sin=sin, pos=pos, k_cache=k_cache, v_cache=v_cache)


def _q_out(q: Optional[torch.Tensor], q_out_stride, device) -> torch.Tensor:
    if q is None:
        return torch.empty((0,), dtype=torch.float32, device=device)
    return _empty_strided(tuple(q.shape), tuple(q_out_stride), q.dtype, q.device)


def _empty_strided(shape, stride, dtype, device) -> torch.Tensor:
    """Uninitialised result allocation; a seam the tests replace to poison outputs with NaN."""
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def reference_rope_kv_store(q: Optional[torch.Tensor], k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            layout: int, round_products: bool, q_out_stride: list) -> torch.Tensor:
    """The op in plain PyTorch (module docstring): writes k_cache / v_cache in place at the positions in [-T, T)
    (negative ones wrapped to pos + T) and returns q_rot (an empty [0] fp32 tensor when q is None). Raises TypeError / ValueError naming the
    argument for wrong dtypes or shapes."""
    check_rope_kv_args(q, k, v, cos, sin, pos, k_cache, v_cache, layout, q_out_stride)
    t = k_cache.shape[2]
    pos = torch.where(pos < 0, pos + t, pos)
    ok = (pos >= 0) & (pos < t)
    kr = rope_apply_reference(k, cos, sin, layout, round_products)
    idx = pos[ok]
    k_cache[:, :, idx] = kr[:, ok].transpose(1, 2)
    v_cache[:, :, idx] = v[:, ok].transpose(1, 2)
    out = _q_out(q, q_out_stride, k.device)
    if q is not None:
        out.copy_(rope_apply_reference(q, cos, sin, layout, round_products))
    return out


@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, c_ptr, s_ptr, pos_ptr, kc_ptr, vc_ptr, o_ptr,
                    S, H, HKV, T,
                    sq_b, sq_s, sq_h, sq_d, sk_b, sk_s, sk_h, sk_d, sv_b, sv_s, sv_h, sv_d,
                    st_b, st_s, st_w, skc_b, skc_h, skc_t, svc_b, svc_h, svc_t, so_b, so_s, so_h, so_d,
                    D: tl.constexpr, HALF_P2: tl.constexpr, LAYOUT: tl.constexpr, ROUND: tl.constexpr,
                    DT: tl.constexpr, USE_PDL: tl.constexpr):
    bs = tl.program_id(0)
    row = tl.program_id(1)
    b = bs // S
    s = bs % S
    i = tl.arange(0, HALF_P2)
    ok = i < D // 2
    if LAYOUT == 0:
        p0 = 2 * i
        p1 = 2 * i + 1
    else:
        p0 = i
        p1 = i + D // 2
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # q / k / v and the positions come from the previous kernels
    p = tl.load(pos_ptr + s)
    p = tl.where(p < 0, p + T, p)  # index_put's wrap of a negative position
    pv = p + i * 0  # the position as a vector: the interpreter rejects a scalar in a mask
    okc = ok & (pv >= 0) & (pv < T)
    if row < H + HKV:
        if row < H:
            src = q_ptr + b * sq_b + s * sq_s + row * sq_h
            a = tl.load(src + p0 * sq_d, mask=ok, other=0.0).to(tl.float32)
            bb = tl.load(src + p1 * sq_d, mask=ok, other=0.0).to(tl.float32)
        else:
            src = k_ptr + b * sk_b + s * sk_s + (row - H) * sk_h
            a = tl.load(src + p0 * sk_d, mask=ok, other=0.0).to(tl.float32)
            bb = tl.load(src + p1 * sk_d, mask=ok, other=0.0).to(tl.float32)
        trig = b * st_b + s * st_s
        if LAYOUT == 2:
            c0 = tl.load(c_ptr + trig + p0 * st_w, mask=ok, other=0.0).to(tl.float32)
            c1 = tl.load(c_ptr + trig + p1 * st_w, mask=ok, other=0.0).to(tl.float32)
            s0 = tl.load(s_ptr + trig + p0 * st_w, mask=ok, other=0.0).to(tl.float32)
            s1 = tl.load(s_ptr + trig + p1 * st_w, mask=ok, other=0.0).to(tl.float32)
        else:
            c0 = tl.load(c_ptr + trig + i * st_w, mask=ok, other=0.0).to(tl.float32)
            s0 = tl.load(s_ptr + trig + i * st_w, mask=ok, other=0.0).to(tl.float32)
            c1 = c0
            s1 = s0
        if ROUND:
            # eager in x's dtype: each product rounded, then the sum (trig already in that dtype)
            o0 = round_to(round_to(a * c0, DT) - round_to(bb * s0, DT), DT)
            o1 = round_to(round_to(bb * c1, DT) + round_to(a * s1, DT), DT)
        else:
            o0 = round_to(a * c0 - bb * s0, DT)
            o1 = round_to(a * s1 + bb * c1, DT)
        if row < H:
            dst = o_ptr + b * so_b + s * so_s + row * so_h
            tl.store(dst + p0 * so_d, o0.to(DT), mask=ok)
            tl.store(dst + p1 * so_d, o1.to(DT), mask=ok)
        else:
            dst = kc_ptr + b * skc_b + (row - H) * skc_h + p * skc_t
            tl.store(dst + p0, o0.to(DT), mask=okc)
            tl.store(dst + p1, o1.to(DT), mask=okc)
    else:
        h = row - H - HKV
        src = v_ptr + b * sv_b + s * sv_s + h * sv_h
        dst = vc_ptr + b * svc_b + h * svc_h + p * svc_t
        x0 = tl.load(src + p0 * sv_d, mask=ok, other=0.0)
        x1 = tl.load(src + p1 * sv_d, mask=ok, other=0.0)
        tl.store(dst + p0, x0, mask=okc)
        tl.store(dst + p1, x1, mask=okc)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def triton_rope_kv_store(q: Optional[torch.Tensor], k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         layout: int, round_products: bool, q_out_stride: list) -> torch.Tensor:
    """`reference_rope_kv_store` on the Triton kernel (interpreted on CPU under TRITON_INTERPRET=1). Raises as the
    reference, plus RuntimeError when the kernel cannot run on the device and ValueError for caches whose last dim
    is not contiguous."""
    check_rope_kv_args(q, k, v, cos, sin, pos, k_cache, v_cache, layout, q_out_stride)
    require_launchable(_rope_kv_kernel, k.device, "triton_rope_kv_store")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dim (stride 1)")
    cos, sin, pos = same_layout_trig(cos, sin, pos)
    b, s, hkv, d = k.shape
    out = _q_out(q, q_out_stride, k.device)
    h = 0 if q is None else q.shape[2]
    rows = h + 2 * hkv
    if b * s == 0 or rows == 0 or d == 0:
        return out
    qq, so = (q, out.stride()) if q is not None else (k, (0, 0, 0, 0))
    pdl = use_pdl_for(_rope_kv_kernel, k.device)
    extra = {"launch_pdl": True} if pdl else {}
    _rope_kv_kernel[(b * s, rows)](
        qq, k, v, cos, sin, pos, k_cache, v_cache, out if q is not None else k,
        s, h, hkv, k_cache.shape[2], *qq.stride(), *k.stride(), *v.stride(),
        *cos.stride(), *k_cache.stride()[:3], *v_cache.stride()[:3], *so,
        D=d, HALF_P2=next_power_of_2(max(d // 2, 1)), LAYOUT=layout, ROUND=round_products, DT=_TL[k.dtype],
        USE_PDL=pdl, num_warps=1, **extra)
    return out


@torch.library.custom_op("dsv41::rope_kv_store", mutates_args=("k_cache", "v_cache"), device_types="cpu")
def rope_kv_store(q: Optional[torch.Tensor], k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: int,
                  round_products: bool, q_out_stride: list[int]) -> torch.Tensor:
    """RoPE of q and k, k and v written into their caches at `pos`; see the module docstring."""
    return reference_rope_kv_store(q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products, q_out_stride)


@register_cuda(rope_kv_store, "dsv41::rope_kv_store")
def _rope_kv_cuda(q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products, q_out_stride):
    if k.shape[-1] % 2 == 0 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1:
        return triton_rope_kv_store(q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products, q_out_stride)
    return reference_rope_kv_store(q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products, q_out_stride)


@rope_kv_store.register_fake
def _rope_kv_fake(q, k, v, cos, sin, pos, k_cache, v_cache, layout, round_products, q_out_stride):
    if q is None:
        return k.new_empty((0,), dtype=torch.float32)
    return q.new_empty_strided(tuple(q.shape), tuple(q_out_stride))
