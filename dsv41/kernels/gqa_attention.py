"""Decode attention over a static KV cache with grouped-query heads read once (M <= 8 query rows): the
`gqa_attention` fusion target.

Why. Eager Llama-style code repeats the cache's KV heads to the query heads before attention (gpt-fast
`k.repeat_interleave(n_head // n_local_heads, dim=1)`, transformers' `repeat_kv`: unsqueeze -> expand -> reshape),
and torch.compile materialises that copy: every decode step writes and reads G = Hq / Hkv copies of every layer's
whole cache (the `clone` kernels of an Inductor Llama step) before `scaled_dot_product_attention` reads them once
more. This op reads each cached K and V row once, for all G query heads that share it, split over the sequence
(flash-decoding) so a batch-1 step fills the GPU.

Op (`dsv41::gqa_decode_attention(q, k, v, mask, scale) -> out`):
    q      bf16 / fp16 / fp32 [B, Hq, M, D]   (M <= MAX_TRITON_M on the Triton path)
    k, v   q's dtype [B, Hkv, S, D], Hq a multiple of Hkv (G = Hq / Hkv query heads per KV head)
    mask   None, bool (True = attend) or q's dtype / fp32 additive, broadcastable to [B, Hq, M, S]
    scale  float (SDPA's default is 1 / sqrt(D))
    out    q's dtype [B, Hq, M, D] = softmax(q k^T * scale + mask) v per head, KV head h // G for query head h
    (`reference_gqa_decode_attention`: SDPA on the repeated heads, what the eager spelling computes)

On CPU the op runs the reference. On CUDA, M <= MAX_TRITON_M and D <= 256 run the Triton kernel, else the
reference.

Kernel. Program (b, kv head, sequence split) holds the G * M query rows of its KV head; per BLOCK_S keys it loads
the K and V tiles once, computes the [G M, BLOCK_S] scores with FP32 products, adds the mask, and keeps an online
softmax (running max, sum, FP32 accumulator). Keys the mask hides from all its rows are not loaded (a static
cache's positions past the context cost no bytes). Each split writes its (max, sum, accumulator) to a workspace; the
last split of a (b, kv head) to arrive (arrival counter, acquire/release) merges them in split order
(deterministic) and writes the output rounded once to q's dtype. Under PDL a program waits for the previous
kernel before its first load and lets the next kernel launch once its loop is done. A row whose every key is masked
gives NaN (softmax over no keys; SDPA gives NaN or 0 there by version and backend: torch 2.13's CPU kernel, this
op's reference, gives 0). Numerics: FP32 throughout, one rounding at the end; SDPA's kernels also compute in FP32 (a different
summation order: differences of an ulp of q's dtype).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import (check_same_device, check_tensor, is_interpreted, next_power_of_2, register_cuda,
                      require_launchable, round_to, split_k_counters, use_pdl_for)

__all__ = ["gqa_decode_attention", "reference_gqa_decode_attention", "triton_gqa_decode_attention",
           "gqa_plan", "launch_gqa", "check_gqa_args", "MAX_TRITON_M"]

#: Largest M (query rows per head) the CUDA implementation sends to the Triton kernel; above it, the reference.
MAX_TRITON_M = 8
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Whether `gqa_plan` picks the tensor-core path (`DOT`) by default. Off: it has run only under the interpreter
#: (session 37 lost its GPU lease); on an H100 the FP32 [rows, keys, head dim] products cost about 3.6 us per 32-key
#: tile at Llama-1B's shape, which is what the path replaces. `bench/probes/half_chain_probe.py --gqa` sweeps both.
_DOT = False


def check_gqa_args(q, k, v, mask) -> tuple[int, int]:
    """Validate `gqa_decode_attention`'s arguments (shapes in the module docstring); return (G, S).

    Raises: TypeError for a dtype the op does not take, ValueError for shapes that do not fit, each naming the
    argument at fault."""
    check_tensor("q", q, dtypes=_DTYPES, ndim=4)
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, dtypes=(q.dtype,), ndim=4)
    check_same_device(q=q, k=k, v=v)
    b, hq, m, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} (batch and head dim)")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the {hkv} KV heads of k / v")
    s = k.shape[2]
    if mask is not None:
        check_tensor("mask", mask, dtypes=(torch.bool, q.dtype, torch.float32))
        check_same_device(q=q, mask=mask)
        try:
            torch.broadcast_shapes(mask.shape, (b, hq, m, s))
        except RuntimeError:
            raise ValueError(f"mask {tuple(mask.shape)} does not broadcast to [B, Hq, M, S] = {[b, hq, m, s]}")
        if mask.dim() > 4:
            raise ValueError(f"mask has {mask.dim()} dims; at most 4 ([B, Hq, M, S])")
    return hq // hkv, s


def reference_gqa_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   mask: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Plain-PyTorch `dsv41::gqa_decode_attention`: `F.scaled_dot_product_attention` on k / v with each KV head
    repeated G times (`repeat_interleave(G, dim=1)`), the eager spelling.

    Args: q [B, Hq, M, D]; k, v [B, Hkv, S, D] of q's dtype; mask None / bool / additive, broadcastable to
    [B, Hq, M, S]; scale float or None (1 / sqrt(D)).
    Returns: q's dtype [B, Hq, M, D].
    Raises: TypeError for a dtype the op does not take, ValueError for shapes that do not fit (named).
    Source: Ainslie et al. 2023, "GQA"; torch.nn.functional.scaled_dot_product_attention.
    """
    g, _ = check_gqa_args(q, k, v, mask)
    kk = k.repeat_interleave(g, dim=1)
    vv = v.repeat_interleave(g, dim=1)
    # Contiguous like the Triton path's output and the fake's: SDPA's own CPU output is laid out [B, M, H, D]
    # underneath, and Inductor checks a custom op's strides against its fake (M > 1: a prefill-sized chunk).
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale).contiguous()


@triton.jit
def _rope_load(base, trig, dd, ok, c_ptr, s_ptr, st_w, D, LAYOUT: tl.constexpr):
    """The loads of a RoPE of rows x[r, d] = base[r][d] (d < D, `ok` [R, DP] the live elements) by the angles at
    c_ptr / s_ptr + trig[r] + index * st_w (layouts of dsv41/kernels/rope_kv.py): (x, its pair partner, cos, sin),
    fp32 [R, DP] each. Apart from `_rope_apply`, so that the cache tile's loads are issued before the rotation
    waits for these."""
    half = D // 2
    if LAYOUT == 0:
        first = (dd % 2) == 0
        partner = tl.where(first, dd + 1, dd - 1)
        ti = dd // 2
    else:
        first = dd < half
        partner = tl.where(first, dd + half, dd - half)
        if LAYOUT == 1:
            ti = tl.where(first, dd, dd - half)
        else:
            ti = dd
    x = tl.load(base[:, None] + dd[None, :], mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(base[:, None] + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + trig[:, None] + ti[None, :] * st_w, mask=ok, other=0.0).to(tl.float32)
    sn = tl.load(s_ptr + trig[:, None] + ti[None, :] * st_w, mask=ok, other=0.0).to(tl.float32)
    return x, xp, c, sn


@triton.jit
def _rope_apply(x, xp, c, sn, dd, D, LAYOUT: tl.constexpr, ROUND: tl.constexpr, DT: tl.constexpr):
    """The rotation of `_rope_load`'s values as `rope_kv`'s kernel computes it (rounding of
    dsv41/kernels/rope_kv.py), rounded to DT; fp32 [R, DP]."""
    if LAYOUT == 0:
        first = (dd % 2) == 0
    else:
        first = dd < D // 2
    if ROUND:
        # eager in x's dtype: each product rounded, then the sum (the angles already in that dtype)
        xc = round_to(x * c, DT)
        ps = round_to(xp * sn, DT)
        o = tl.where(first[None, :], xc - ps, xc + ps)
    else:
        o = tl.where(first[None, :], x * c - xp * sn, xp * sn + x * c)
    return round_to(o, DT)


@triton.jit
def _gqa_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, ws_ptr, cnt_ptr,
                kn_ptr, vn_ptr, c_ptr, s_ptr, pos_ptr,
                HKV, M, S, D, scale,
                sq_b, sq_h, sq_m, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_m,
                sm_b, sm_h, sm_m, sm_s,
                skn_b, skn_m, skn_h, svn_b, svn_m, svn_h, st_b, st_m, st_w,
                G: tl.constexpr, RP: tl.constexpr, DP: tl.constexpr, BLOCK_S: tl.constexpr,
                S_ITERS: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, MASK: tl.constexpr,
                MASK_BOOL: tl.constexpr, SKIP_MASKED: tl.constexpr, ROPE: tl.constexpr, LAYOUT: tl.constexpr,
                ROUND: tl.constexpr, MP: tl.constexpr, RW: tl.constexpr, DOT: tl.constexpr,
                DOT_F32: tl.constexpr, JC: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)   # b * HKV + kv head
    sp = tl.program_id(1)    # sequence split
    b = pid // HKV
    hk = pid % HKV
    r = tl.arange(0, RP)     # query row r = g * M + m of this KV head (RP >= RW = next_power_of_2(G M): DOT pads)
    g = r // M
    m = r % M
    r_ok = r < G * M
    dd = tl.arange(0, DP)
    d_ok = dd < D
    h = hk * G + g
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # q and the cache rows of this step come from the previous kernels
    DT: tl.constexpr = o_ptr.dtype.element_ty
    if ROPE:
        # q arrives unrotated; the step's new K and V rows are rotated / copied here, written to the caches by
        # the last split, and stand in for the cache rows at their positions in every split (another split may
        # read a row before it is written; the interpreter runs the splits in order, so its tests see that case).
        # Only their loads come here: the rotations follow the first cache tile's loads, which so are not one
        # round trip later.
        qx, qxp, qc, qsn = _rope_load(q_ptr + b * sq_b + h * sq_h + m * sq_m, b * st_b + m * st_m, dd,
                                      r_ok[:, None] & d_ok[None, :], c_ptr, s_ptr, st_w, D, LAYOUT)
        jj = tl.arange(0, MP)
        jn_ok = jj < M
        jd_ok = jn_ok[:, None] & d_ok[None, :]
        kx, kxp, kc, ksn = _rope_load(kn_ptr + b * skn_b + jj * skn_m + hk * skn_h, b * st_b + jj * st_m, dd,
                                      jd_ok, c_ptr, s_ptr, st_w, D, LAYOUT)
        vrow = tl.load(vn_ptr + b * svn_b + jj[:, None] * svn_m + hk * svn_h + dd[None, :], mask=jd_ok, other=0.0)
        pn = tl.load(pos_ptr + jj, mask=jn_ok, other=-1)
        pn = tl.where(pn < 0, pn + S, pn)  # index_put's wrap of a negative position, as rope_kv_store wraps it
        # Two new tokens at one position: the later one is the row the cache keeps (index_put's order on CPU).
        later = tl.max(((pn[None, :] == pn[:, None]) & (jj[None, :] > jj[:, None]) & jn_ok[None, :]).to(tl.int32),
                       axis=1) > 0
        live = jn_ok & (pn >= 0) & (pn < S) & (later == 0)
    else:
        q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + m[:, None] * sq_m + dd[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    KT: tl.constexpr = k_ptr.dtype.element_ty
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, DP], tl.float32)
    ss = tl.arange(0, BLOCK_S)
    for it in range(S_ITERS):
        s = (sp * S_ITERS + it) * BLOCK_S + ss
        s_ok = s < S
        kv_ok = s_ok
        if MASK:
            mv = tl.load(mask_ptr + b * sm_b + h[:, None] * sm_h + m[:, None] * sm_m + s[None, :] * sm_s,
                         mask=r_ok[:, None] & s_ok[None, :], other=0)
            if MASK_BOOL:
                keep = mv != 0
            else:
                keep = mv.to(tl.float32) > float("-inf")
            if SKIP_MASKED:
                # A key no query row attends is never read: a static cache's positions past the context are masked
                # in every row, and their bytes are most of what a decode step would otherwise waste.
                kv_ok = s_ok & (tl.max(keep.to(tl.int32), axis=0) > 0)
        kt = tl.load(k_ptr + b * sk_b + hk * sk_h + s[:, None] * sk_s + dd[None, :],
                     mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        vt = tl.load(v_ptr + b * sv_b + hk * sv_h + s[:, None] * sv_s + dd[None, :],
                     mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        if ROPE:
            q = _rope_apply(qx, qxp, qc, qsn, dd, D, LAYOUT, ROUND, DT)
            krow = _rope_apply(kx, kxp, kc, ksn, dd, D, LAYOUT, ROUND, DT)
            eq = (s[:, None] == pn[None, :]) & live[None, :]   # [BLOCK_S, MP]: key s is new token j's row
            hit = tl.max(eq.to(tl.int32), axis=1) > 0
            kt = tl.where(hit[:, None], tl.sum(tl.where(eq[:, :, None], krow[None, :, :], 0.0), axis=1).to(KT), kt)
            vt = tl.where(hit[:, None], tl.sum(tl.where(eq[:, :, None], vrow[None, :, :].to(tl.float32), 0.0),
                                               axis=1).to(KT), vt)
        if DOT:
            # q holds values of the cache's dtype (loaded, or rotated and rounded): exact in it, so the tensor-core
            # products are the FP32 products of the other path
            qd = q.to(KT)
        if DOT_F32:
            # the interpreter's bf16 dot is wrong (Triton 3.9): the same exact products in FP32
            sc = tl.dot(qd.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee") * scale
        elif DOT:
            sc = tl.dot(qd, tl.trans(kt)) * scale
        else:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
            sc = tl.sum(q[:, None, :] * kt[None, :, :], axis=2) * scale
        if MASK:
            if MASK_BOOL:
                sc = tl.where(keep, sc, float("-inf"))
            else:
                sc = sc + mv.to(tl.float32)
        sc = tl.where(s_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        # A row with no finite score yet keeps its max at -inf: shift by 0 there so exp gives 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - shift)
        p = tl.exp(sc - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT:
            # p split into two values of the cache's dtype (about 16 significant bits together): the tensor-core
            # product stays within ~2^-17 of the FP32 one
            p_hi = p.to(KT)
            p_lo = (p - p_hi.to(tl.float32)).to(KT)
            if DOT_F32:
                vf = vt.to(tl.float32)
                acc = (acc * alpha[:, None] + tl.dot(p_hi.to(tl.float32), vf, input_precision="ieee")
                       + tl.dot(p_lo.to(tl.float32), vf, input_precision="ieee"))
            else:
                acc = acc * alpha[:, None] + tl.dot(p_hi, vt) + tl.dot(p_lo, vt)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vt[None, :, :], axis=1)
        m_i = m_new
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if ROPE:
        if sp == SPLITS - 1:
            krow = _rope_apply(kx, kxp, kc, ksn, dd, D, LAYOUT, ROUND, DT)
            w_ok = live[:, None] & d_ok[None, :]
            tl.store(k_ptr + b * sk_b + hk * sk_h + pn[:, None] * sk_s + dd[None, :], krow.to(DT), mask=w_ok)
            tl.store(v_ptr + b * sv_b + hk * sv_h + pn[:, None] * sv_s + dd[None, :], vrow, mask=w_ok)
    # Split sp's partial: [max, sum, acc...] per row, then the merge by the last split to arrive.
    W: tl.constexpr = DP + 2
    base = ws_ptr + (pid * SPLITS + sp).to(tl.int64) * (RW * W)
    w_r = r < RW
    tl.store(base + r * W, m_i, mask=w_r)
    tl.store(base + r * W + 1, l_i, mask=w_r)
    tl.store(base + r[:, None] * W + 2 + dd[None, :], acc, mask=w_r[:, None])
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
    if arrived == SPLITS - 1:
        j = tl.arange(0, SPLITS_P2)
        j_ok = j < SPLITS
        rr = tl.arange(0, RW)
        hr = hk * G + rr // M
        mr = rr % M
        pb = ws_ptr + (pid * SPLITS + j).to(tl.int64) * (RW * W)
        mj = tl.load(pb[:, None] + rr[None, :] * W, mask=j_ok[:, None], other=float("-inf"), cache_modifier=".cg")
        lj = tl.load(pb[:, None] + rr[None, :] * W + 1, mask=j_ok[:, None], other=0.0, cache_modifier=".cg")
        mx = tl.max(mj, axis=0)
        mxs = tl.where(mx == float("-inf"), 0.0, mx)
        wj = tl.exp(mj - mxs[None, :])
        den = tl.sum(wj * lj, axis=0)
        # the accumulators JC splits at a time (a fixed order: deterministic); all SPLITS_P2 x RW x DP at once is
        # 128 FP32 registers a thread at Llama-8B's shape (`gqa_plan(merge_chunk=)`)
        num = tl.zeros([RW, DP], tl.float32)
        for c in tl.static_range(SPLITS_P2 // JC):
            jc = c * JC + tl.arange(0, JC)
            jc_ok = jc < SPLITS
            pc = ws_ptr + (pid * SPLITS + jc).to(tl.int64) * (RW * W)
            mc = tl.load(pc[:, None] + rr[None, :] * W, mask=jc_ok[:, None], other=float("-inf"), cache_modifier=".cg")
            ac = tl.load(pc[:, None, None] + rr[None, :, None] * W + 2 + dd[None, None, :], mask=jc_ok[:, None, None],
                         other=0.0, cache_modifier=".cg")
            num += tl.sum(tl.exp(mc - mxs[None, :])[:, :, None] * ac, axis=0)
        out = num / den[:, None]  # 0 / 0 = NaN for a row whose every key is masked (module docstring)
        tl.store(o_ptr + b * so_b + hr[:, None] * so_h + mr[:, None] * so_m + dd[None, :],
                 round_to(out, DT).to(DT), mask=(rr < G * M)[:, None] & d_ok[None, :])
        tl.atomic_xchg(cnt_ptr + pid, 0)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result/workspace allocation; a seam the tests replace to poison outputs with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def gqa_plan(b: int, hkv: int, s: int, *, block_s: int | None = None, splits: int | None = None,
             num_warps: int | None = None, skip_masked: bool | None = None, dot: bool | None = None,
             merge_chunk: int | None = None, sm_count: int = 132) -> dict:
    """Launch parameters: BLOCK_S keys per iteration (default 32), SPLITS sequence splits (default: enough that
    b x hkv x splits programs give about 2 per SM, each at least one BLOCK_S), S_ITERS per split, num_warps
    (default 4), SKIP_MASKED (default True: a key that the mask hides from every query row of a program is not
    read), DOT (default `_DOT`: scores and the weighted sum on tensor cores for bf16 / fp16, where BLOCK_S and the
    head dim are at least 16), JC (`merge_chunk`: splits the merge sums at a time, a power of two; default all of
    them at once, as GPU-measured; 4 keeps the merge's registers small at Llama-8B's shape, not yet measured); grid
    (b hkv, splits). Raises ValueError for a block_s that is not a power of two, splits < 1 or a
    num_warps that is not 1, 2, 4 or 8."""
    block_s = block_s or 32
    if block_s & (block_s - 1) or block_s < 1:
        raise ValueError(f"block_s={block_s} must be a power of two")
    num_warps = 4 if num_warps is None else num_warps
    if num_warps not in (1, 2, 4, 8):
        raise ValueError(f"num_warps={num_warps} must be 1, 2, 4 or 8")
    tiles = max(1, -(-s // block_s))
    if splits is None:
        splits = max(1, min(tiles, -(-2 * sm_count // max(b * hkv, 1))))
    if splits < 1:
        raise ValueError(f"splits={splits} must be >= 1")
    splits = min(splits, tiles)
    iters = -(-tiles // splits)
    splits = -(-tiles // iters)
    p2 = next_power_of_2(splits)
    if merge_chunk is not None and (merge_chunk < 1 or merge_chunk & (merge_chunk - 1)):
        raise ValueError(f"merge_chunk={merge_chunk} must be a power of two")
    return dict(BLOCK_S=block_s, SPLITS=splits, SPLITS_P2=p2, S_ITERS=iters, JC=min(merge_chunk or p2, p2),
                SKIP_MASKED=True if skip_masked is None else bool(skip_masked), num_warps=num_warps,
                DOT=_DOT if dot is None else bool(dot),
                grid=(b * hkv, splits))


def triton_gqa_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                                **overrides) -> torch.Tensor:
    """`reference_gqa_decode_attention` on the Triton kernel (interpreted on CPU under TRITON_INTERPRET=1);
    `overrides` (block_s, splits, num_warps, skip_masked) replace the `gqa_plan` heuristic. Raises as the
    reference, plus RuntimeError when the kernel cannot run on the device and ValueError for D > 256."""
    check_gqa_args(q, k, v, mask)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return launch_gqa(q, k, v, mask, scale, overrides, caller="triton_gqa_decode_attention")


def launch_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
               scale: Optional[float], overrides: dict, rope: Optional[dict] = None,
               caller: str = "launch_gqa") -> torch.Tensor:
    """One `_gqa_kernel` launch on checked arguments whose last dims are contiguous: q [B, Hq, M, D] (with `rope`,
    the unrotated q seen as [B, Hq, M, D], e.g. a transpose of [B, M, Hq, D]), k / v [B, Hkv, S, D] (with `rope`,
    the caches the new rows are written to). `rope` = dict(k, v [B, M, Hkv, D] (last dim contiguous), cos, sin
    [B, M, W], pos int64 [M], layout, round_products) as `rope_kv_store` takes them. Returns the output
    [B, Hq, M, D] in q's dtype. Raises ValueError for D > 256 or a plan override it rejects, RuntimeError (naming
    `caller`) when the kernel cannot run on q's device."""
    require_launchable(_gqa_kernel, q.device, caller)
    b, hq, m, d = q.shape
    if d > 256:
        raise ValueError(f"head dim {d} > 256 is not taken by the kernel")
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    out = _empty((b, hq, m, d), q.dtype, q.device)
    if out.numel() == 0:
        return out
    if s == 0:  # softmax over no keys: NaN (module docstring)
        return out.fill_(float("nan"))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    plan = gqa_plan(b, hkv, s, **overrides)
    rw, dp = next_power_of_2(g * m), next_power_of_2(d)
    dot = plan["DOT"] and q.dtype != torch.float32 and plan["BLOCK_S"] >= 16 and dp >= 16
    rp = max(rw, 16) if dot else rw
    ws = _empty((b * hkv * plan["SPLITS"] * rw * (dp + 2),), torch.float32, q.device)
    cnt = split_k_counters(q.device, b * hkv)
    pdl = use_pdl_for(_gqa_kernel, q.device)
    extra = {"launch_pdl": True} if pdl else {}
    if mask is not None:
        mask4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(b, hq, m, s)
        ms = [st if sz > 1 else 0 for st, sz in zip(mask4.stride(), mask4.shape)]
    else:
        mask4, ms = q, [0, 0, 0, 0]
    if rope is not None:
        kn, vn, cos = rope["k"], rope["v"], rope["cos"]
        rargs = (kn, vn, cos, rope["sin"], rope["pos"])
        rstrides = (*kn.stride()[:3], *vn.stride()[:3], *cos.stride())
        rconst = dict(ROPE=True, LAYOUT=int(rope["layout"]), ROUND=bool(rope["round_products"]),
                      MP=next_power_of_2(m))
    else:
        rargs, rstrides = (q, q, q, q, q), (0,) * 9
        rconst = dict(ROPE=False, LAYOUT=0, ROUND=False, MP=1)
    _gqa_kernel[plan["grid"]](
        q, k, v, mask4, out, ws, cnt, *rargs, hkv, m, s, d, scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *ms, *rstrides,
        G=g, RP=rp, DP=dp, BLOCK_S=plan["BLOCK_S"], S_ITERS=plan["S_ITERS"], SPLITS=plan["SPLITS"],
        SPLITS_P2=plan["SPLITS_P2"], MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.bool,
        SKIP_MASKED=plan["SKIP_MASKED"], RW=rw, DOT=dot,
        DOT_F32=dot and q.dtype == torch.bfloat16 and is_interpreted(_gqa_kernel), JC=plan["JC"],
        USE_PDL=pdl, num_warps=plan["num_warps"], **rconst,
        **extra)
    return out


@torch.library.custom_op("dsv41::gqa_decode_attention", mutates_args=(), device_types="cpu")
def gqa_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                         scale: Optional[float] = None) -> torch.Tensor:
    """Attention of q over a static cache's KV heads, each read once for its G query heads; see
    `reference_gqa_decode_attention`."""
    return reference_gqa_decode_attention(q, k, v, mask, scale)


@register_cuda(gqa_decode_attention, "dsv41::gqa_decode_attention")
def _gqa_cuda(q, k, v, mask=None, scale=None):
    if q.shape[2] <= MAX_TRITON_M and q.shape[3] <= 256:
        return triton_gqa_decode_attention(q, k, v, mask, scale)
    return reference_gqa_decode_attention(q, k, v, mask, scale)


@gqa_decode_attention.register_fake
def _gqa_fake(q, k, v, mask=None, scale=None):
    return q.new_empty(q.shape)
