"""C2 compressor bank write in one kernel: [pair pooling ->] RMSNorm -> RoPE -> FP4 -> bank row write.

The kv-source layers of V4.1 (MODEL.md §2.6, §2.8; dsv41/model/csa.py `Compressor`, dsv41/model/attention.py
`_update_csa`) turn the compressor projections into a bank row:

- ratio 2: `z = (e0 * prev_k + e1 * k) / (e0 + e1)` with `e0 = exp(prev_g - m)`, `e1 = exp(g - m)`,
  `m = max(prev_g, g)` (per-channel softmax over the pair, FP32), cast to the model dtype;
- ratio 1: `z = wkv x` (model dtype);

then `latent = rms_norm(z, weight, eps)` (FP32 math, cast back), and the bank row
`quantize_fp4_*(apply_rope(latent, cos, sin))` written at `rows` of the codes / scales caches.

Ops (x/k/g/prev_k/prev_g [B, T, D]; weight [D]; cos, sin fp32 broadcastable to [B, T, R/2]; rows int64
[B, T]; codes_cache uint8 [B, Rows, D/2]; scale_cache uint8 [B, Rows, D/scale_block]; (scale_block,
e4m3_scale) one of `rope_fp4.FP4_MODES`):

- `dsv41::c2_norm_rope_fp4_store(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache,
  rows) -> latent` [B, T, D] in x.dtype (the pre-RoPE latent, which the index-key branch reads);
- `dsv41::c2_pool_norm_rope_fp4_store(k, g, prev_k, prev_g, weight, eps, out_dtype, cos, sin, scale_block,
  e4m3_scale, codes_cache, scale_cache, rows) -> latent` [B, T, D] in `out_dtype`; k, g, prev_k, prev_g FP32.

Both mutate the two caches (rows outside [0, Rows) are skipped; when two tokens share a row, which one
lands is unspecified, as in `rope_fp4_quant_store`). The pending-token state of the ratio-2 writer is NOT
touched here: the caller's graph keeps its own state update (prev_k / prev_g are its inputs).

Kernel: grid (tokens, splits); every program reads the whole row (the RMS statistic needs it; a 512-wide
row is 2-8 KB) and writes the latent, codes and scales of its `BLOCKS` scale blocks only, so one decode
token still spreads over D / (BLOCKS * scale_block) programs. Even/odd channels are separate tensors so a
RoPE pair is one lane. Bit-exactness with the reference is not claimed for the norm and the pooling:
`exp`, `rsqrt` and the reduction order differ from PyTorch's CPU kernels by an ulp (tests use tolerances);
RoPE and the FP4 rounding are done like `rope_fp4` (FMA contraction off, correctly rounded division).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.ref import c2_compressor as _ref

from ._common import (check_same_device, check_tensor, e2m1_code, fp4_block_scale, next_power_of_2, register_cuda,
                      require_launchable, round_to, use_pdl_for)
from .rope_fp4 import check_rope_fp4_args, check_store_args

__all__ = [
    "c2_norm_rope_fp4_store", "c2_pool_norm_rope_fp4_store",
    "reference_c2_norm_rope_fp4_store", "reference_c2_pool_norm_rope_fp4_store", "reference_pair_pool",
    "triton_c2_norm_rope_fp4_store", "triton_c2_pool_norm_rope_fp4_store",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Scale blocks one program quantises and writes (a 512-wide bank row with 1x16 scales: 4 programs).
_BLOCKS_PER_PROGRAM = 8


# ------------------------------------------------------------------------------------------- checks
def _check(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows):
    check_tensor("weight", weight, dtypes=_FLOAT_DTYPES, ndim=1)
    check_same_device(x=x, weight=weight)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} channels; x has {x.shape[-1]}")
    if not isinstance(eps, float) or eps < 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    check_rope_fp4_args(x, cos, sin, scale_block, e4m3_scale)
    check_store_args(x, rows, codes_cache, scale_cache, scale_block)


def _check_pool(k, g, prev_k, prev_g, out_dtype):
    for name, t in (("k", k), ("g", g), ("prev_k", prev_k), ("prev_g", prev_g)):
        check_tensor(name, t, dtypes=(torch.float32,), ndim=3)
        if t.shape != k.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected k's {tuple(k.shape)}")
    check_same_device(k=k, g=g, prev_k=prev_k, prev_g=prev_g)
    if out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {_FLOAT_DTYPES}, got {out_dtype}")


# ------------------------------------------------------------------------------------------- references
def reference_pair_pool(k: torch.Tensor, g: torch.Tensor, prev_k: torch.Tensor, prev_g: torch.Tensor):
    """Per-channel softmax-over-the-pair pooling (FP32): `(e0 prev_k + e1 k) / (e0 + e1)`.

    All inputs FP32 [B, T, D]; prev_g = -inf (empty state) gives z = k. Source: dsv41/model/csa.py
    `Compressor.forward` (ratio 2), MODEL.md §2.6.
    """
    return _ref.pair_pool(k, g, prev_k, prev_g)


def reference_c2_norm_rope_fp4_store(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache,
                                     rows) -> torch.Tensor:
    """Plain-PyTorch `dsv41::c2_norm_rope_fp4_store`: latent = rms_norm(x, weight, eps); write
    quantize_fp4_*(apply_rope(latent, cos, sin)) at codes_cache / scale_cache[b, rows[b, t]].

    Args: x [B, T, D] fp32/bf16/fp16; weight [D]; eps float; cos, sin fp32 broadcastable to [B, T, R/2];
        (scale_block, e4m3_scale) in rope_fp4.FP4_MODES; caches uint8 (mutated); rows int64 [B, T].
    Returns: latent [B, T, D] x.dtype (pre-RoPE).
    Raises: TypeError / ValueError naming the bad argument.
    Source: dsv41/model/csa.py (ratio 1), dsv41/model/attention.py `_update_csa`; MODEL.md §2.2, §2.6, §2.8.
    """
    check_tensor("x", x, dtypes=_FLOAT_DTYPES, ndim=3)
    _check(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows)
    return _ref.c2_norm_rope_fp4_store(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache,
                                       rows)


def reference_c2_pool_norm_rope_fp4_store(k, g, prev_k, prev_g, weight, eps, out_dtype, cos, sin, scale_block,
                                          e4m3_scale, codes_cache, scale_cache, rows) -> torch.Tensor:
    """Plain-PyTorch `dsv41::c2_pool_norm_rope_fp4_store`: z = pair pool (FP32) cast to out_dtype, then as
    `reference_c2_norm_rope_fp4_store(z, ...)`.

    Args: k, g, prev_k, prev_g FP32 [B, T, D] (prev_* = the previous token's projections, the pending state
        for t = 0); out_dtype the model dtype; the rest as `reference_c2_norm_rope_fp4_store`.
    Returns: latent [B, T, D] out_dtype. Raises: TypeError / ValueError naming the bad argument.
    Source: dsv41/model/csa.py `Compressor.forward` (ratio 2); MODEL.md §2.6.
    """
    _check_pool(k, g, prev_k, prev_g, out_dtype)
    z = reference_pair_pool(k, g, prev_k, prev_g).to(out_dtype)
    return reference_c2_norm_rope_fp4_store(z, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache,
                                            scale_cache, rows)


# ------------------------------------------------------------------------------------------- kernel
@triton.jit
def _c2_kernel(
    x_ptr, k_ptr, g_ptr, pk_ptr, pg_ptr, w_ptr, cos_ptr, sin_ptr, rows_ptr, lat_ptr, codes_ptr, scales_ptr,
    T, eps, cache_rows,
    sx0, sx1, sp0, sp1, sc0, sc1, ss0, ss1, sr0, sr1, sco0, sco1, ssc0, ssc1,
    D: tl.constexpr, R_HALF: tl.constexpr, SCALE_BLOCK: tl.constexpr, E4M3_SCALE: tl.constexpr,
    POOL: tl.constexpr, NB_P2: tl.constexpr, BLOCKS: tl.constexpr, USE_PDL: tl.constexpr,
):
    HB: tl.constexpr = SCALE_BLOCK // 2
    NB: tl.constexpr = D // SCALE_BLOCK
    P0: tl.constexpr = D // 2 - R_HALF
    tok = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    bi = tok // T
    ti = tok % T
    nb = tl.arange(0, NB_P2)
    p = nb[:, None] * HB + tl.arange(0, HB)[None, :]  # pair index [NB_P2, HB]
    ok = (nb < NB)[:, None] & (p >= 0)
    mine = (nb >= split * BLOCKS) & (nb < split * BLOCKS + BLOCKS) & (nb < NB)
    ci = p - P0
    rot = ci >= 0
    lat_ty: tl.constexpr = lat_ptr.dtype.element_ty

    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if POOL:
        base = bi * sp0 + ti * sp1 + 2 * p
        k0 = tl.load(k_ptr + base, mask=ok, other=0.0)
        k1 = tl.load(k_ptr + base + 1, mask=ok, other=0.0)
        g0 = tl.load(g_ptr + base, mask=ok, other=0.0)
        g1 = tl.load(g_ptr + base + 1, mask=ok, other=0.0)
        pk0 = tl.load(pk_ptr + base, mask=ok, other=0.0)
        pk1 = tl.load(pk_ptr + base + 1, mask=ok, other=0.0)
        pg0 = tl.load(pg_ptr + base, mask=ok, other=0.0)
        pg1 = tl.load(pg_ptr + base + 1, mask=ok, other=0.0)
    else:
        xb = bi * sx0 + ti * sx1 + 2 * p
        a = tl.load(x_ptr + xb, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + xb + 1, mask=ok, other=0.0).to(tl.float32)
    w_a = tl.load(w_ptr + 2 * p, mask=ok, other=0.0).to(tl.float32)
    w_b = tl.load(w_ptr + 2 * p + 1, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + bi * sc0 + ti * sc1 + ci, mask=ok & rot, other=1.0)
    s = tl.load(sin_ptr + bi * ss0 + ti * ss1 + ci, mask=ok & rot, other=0.0)
    dst = tl.load(rows_ptr + bi * sr0 + ti * sr1 + nb * 0)  # the row, once per scale block
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    if POOL:
        # Softmax over the pair per channel; an empty state (prev_g = -inf) gives e0 = 0, z = k.
        m0 = tl.maximum(pg0, g0)
        m1 = tl.maximum(pg1, g1)
        e00 = tl.exp(pg0 - m0)
        e01 = tl.exp(g0 - m0)
        e10 = tl.exp(pg1 - m1)
        e11 = tl.exp(g1 - m1)
        a = tl.math.div_rn(e00 * pk0 + e01 * k0, e00 + e01)
        b = tl.math.div_rn(e10 * pk1 + e11 * k1, e10 + e11)
        a = round_to(a, lat_ty)
        b = round_to(b, lat_ty)
        a = tl.where(ok, a, 0.0)
        b = tl.where(ok, b, 0.0)

    # rms_norm: FP32 mean of squares over the whole row, x * rsqrt(mean + eps) * w, cast to the latent dtype.
    ms = tl.math.div_rn(tl.sum(tl.sum(a * a + b * b, axis=1), axis=0), D * 1.0)
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
    a = round_to(a * inv * w_a, lat_ty)
    b = round_to(b * inv * w_b, lat_ty)
    lat = lat_ptr + tok * D + 2 * p
    st = ok & mine[:, None]
    tl.store(lat, a.to(lat_ty), mask=st)
    tl.store(lat + 1, b.to(lat_ty), mask=st)

    # apply_rope on the latent: each product and the sum rounded separately (FMA contraction off).
    ar = a * c - b * s
    br = a * s + b * c
    a = round_to(tl.where(rot, ar, a), lat_ty)
    b = round_to(tl.where(rot, br, b), lat_ty)

    amax = tl.maximum(tl.max(tl.abs(a), axis=1), tl.max(tl.abs(b), axis=1))  # [NB_P2]
    scale, sbyte = fp4_block_scale(amax, E4M3_SCALE)
    code_a = e2m1_code(a, scale[:, None])
    code_b = e2m1_code(b, scale[:, None])
    packed = (code_a | (code_b << 4)).to(tl.uint8)
    w_ok = (dst >= 0) & (dst < cache_rows)
    tl.store(codes_ptr + bi * sco0 + dst[:, None] * sco1 + p, packed, mask=st & w_ok[:, None])
    tl.store(scales_ptr + bi * ssc0 + dst * ssc1 + nb, sbyte.to(tl.uint8), mask=mine & w_ok)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result allocation; a seam the tests replace to poison outputs."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch(x, pool, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows, out_dtype):
    require_launchable(_c2_kernel, weight.device, "triton_c2_*")
    for name, t in (("codes_cache", codes_cache), ("scale_cache", scale_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have last-dim stride 1 (it is written in place), got {t.stride()}")
    ref = pool[0] if pool is not None else x
    bsz, t, d = ref.shape
    latent = _empty((bsz, t, d), out_dtype, ref.device)
    if bsz * t == 0:
        return latent
    if pool is not None:
        # The kernel indexes the four inputs with one set of strides.
        if pool[0].stride(-1) != 1 or any(q.stride() != pool[0].stride() for q in pool):
            pool = [q.contiguous() for q in pool]
        x = pool[0]
    elif x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    r_half = cos.shape[-1]
    cos = cos.expand(bsz, t, r_half)
    sin = sin.expand(bsz, t, r_half)
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    nb = d // scale_block
    blocks = min(_BLOCKS_PER_PROGRAM, nb)
    pdl = use_pdl_for(_c2_kernel, ref.device)
    extra = {"launch_pdl": True} if pdl else {}
    ks = pool if pool is not None else (x, x, x, x)
    sp = pool[0].stride() if pool is not None else (0, 0)
    _c2_kernel[(bsz * t, -(-nb // blocks))](
        x, *ks, weight, cos, sin, rows, latent, codes_cache, scale_cache,
        t, float(eps), codes_cache.shape[1],
        x.stride(0), x.stride(1), sp[0], sp[1], cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        rows.stride(0), rows.stride(1), codes_cache.stride(0), codes_cache.stride(1),
        scale_cache.stride(0), scale_cache.stride(1),
        D=d, R_HALF=r_half, SCALE_BLOCK=scale_block, E4M3_SCALE=bool(e4m3_scale), POOL=pool is not None,
        NB_P2=next_power_of_2(nb), BLOCKS=blocks, USE_PDL=pdl, num_warps=4, enable_fp_fusion=False, **extra)
    return latent


def triton_c2_norm_rope_fp4_store(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache,
                                  rows) -> torch.Tensor:
    """Triton `dsv41::c2_norm_rope_fp4_store` on the tensors' device (interpreted on CPU).

    Same arguments, result and errors as `reference_c2_norm_rope_fp4_store`; the latent agrees to an ulp of
    x.dtype (reduction order, rsqrt), the written rows are the FP4 quantisation of that latent.
    """
    check_tensor("x", x, dtypes=_FLOAT_DTYPES, ndim=3)
    _check(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows)
    return _launch(x, None, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows, x.dtype)


def triton_c2_pool_norm_rope_fp4_store(k, g, prev_k, prev_g, weight, eps, out_dtype, cos, sin, scale_block,
                                       e4m3_scale, codes_cache, scale_cache, rows) -> torch.Tensor:
    """Triton `dsv41::c2_pool_norm_rope_fp4_store` on the tensors' device (interpreted on CPU).

    Same arguments, result and errors as `reference_c2_pool_norm_rope_fp4_store` (latent to an ulp).
    """
    _check_pool(k, g, prev_k, prev_g, out_dtype)
    _check(k, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows)
    return _launch(None, (k, g, prev_k, prev_g), weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache,
                   scale_cache, rows, out_dtype)


# ------------------------------------------------------------------------------------------- ops
_MUT = ("codes_cache", "scale_cache")


@torch.library.custom_op("dsv41::c2_norm_rope_fp4_store", mutates_args=_MUT, device_types="cpu")
def c2_norm_rope_fp4_store(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                           scale_block: int, e4m3_scale: bool, codes_cache: torch.Tensor, scale_cache: torch.Tensor,
                           rows: torch.Tensor) -> torch.Tensor:
    """RMSNorm -> RoPE -> FP4 -> bank row write; returns the latent. See `reference_c2_norm_rope_fp4_store`."""
    return reference_c2_norm_rope_fp4_store(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache,
                                            scale_cache, rows)


@register_cuda(c2_norm_rope_fp4_store, "dsv41::c2_norm_rope_fp4_store")
def _c2_norm_cuda(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows):
    return triton_c2_norm_rope_fp4_store(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache,
                                         scale_cache, rows)


@c2_norm_rope_fp4_store.register_fake
def _c2_norm_fake(x, weight, eps, cos, sin, scale_block, e4m3_scale, codes_cache, scale_cache, rows):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("dsv41::c2_pool_norm_rope_fp4_store", mutates_args=_MUT, device_types="cpu")
def c2_pool_norm_rope_fp4_store(k: torch.Tensor, g: torch.Tensor, prev_k: torch.Tensor, prev_g: torch.Tensor,
                                weight: torch.Tensor, eps: float, out_dtype: torch.dtype, cos: torch.Tensor,
                                sin: torch.Tensor, scale_block: int, e4m3_scale: bool, codes_cache: torch.Tensor,
                                scale_cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Pair pooling -> RMSNorm -> RoPE -> FP4 -> bank row write; see `reference_c2_pool_norm_rope_fp4_store`."""
    return reference_c2_pool_norm_rope_fp4_store(k, g, prev_k, prev_g, weight, eps, out_dtype, cos, sin, scale_block,
                                                 e4m3_scale, codes_cache, scale_cache, rows)


@register_cuda(c2_pool_norm_rope_fp4_store, "dsv41::c2_pool_norm_rope_fp4_store")
def _c2_pool_cuda(k, g, prev_k, prev_g, weight, eps, out_dtype, cos, sin, scale_block, e4m3_scale, codes_cache,
                  scale_cache, rows):
    return triton_c2_pool_norm_rope_fp4_store(k, g, prev_k, prev_g, weight, eps, out_dtype, cos, sin, scale_block,
                                              e4m3_scale, codes_cache, scale_cache, rows)


@c2_pool_norm_rope_fp4_store.register_fake
def _c2_pool_fake(k, g, prev_k, prev_g, weight, eps, out_dtype, cos, sin, scale_block, e4m3_scale, codes_cache,
                  scale_cache, rows):
    return k.new_empty(k.shape, dtype=out_dtype)
