"""Sparse FP4 attention with the attention sink: the `sparse_attention` fusion target (ARCHITECTURE.md pattern
table, row "sparse FP4 attention"; MODEL.md §2.4 steps 3-6, §2.8).

One decode step of a V4.1 attention layer with a compressed bank reads, per query token, the FP8 window rows
(the ring plus the current token) and the bank rows the indexer selected, and the eager model
(dsv41/model/attention.py `Attention.forward`) materialises every step of that: the dequantised window, the
gathered and dequantised bank rows [B, T, K, D] in FP32, two score tensors, the softmax over [scores ; sink]
and two value products, then the inverse RoPE. This op computes the same numbers in one kernel:

- `dsv41::sparse_fp4_attention(q, window_codes, window_scales, window_ok, bank_codes, bank_scales, indices,
  sink, cos, sin, softmax_scale, new_codes=None, new_scales=None, rope_q=False) -> o`
    q              [B, T, H, D] fp32 / bf16 / fp16 (post-RoPE queries, or pre-RoPE with rope_q; D % 32 == 0)
    window_codes   uint8 [B, S, D]      FP8 E4M3 bytes of the window rows (S >= 0)
    window_scales  uint8 [B, S, D/32]   UE8M0 exponents (value 2^(e-127)), one per 32 channels
    window_ok      bool  [B, T, S]      window row s is visible to query t
    bank_codes     uint8 [B, N, D/2]    packed E2M1 (low nibble = even channel) of the bank rows
    bank_scales    uint8 [B, N, D/16]   E4M3 bytes, one scale per 16 channels
    indices        int64 / int32 [B, T, K]  selected bank rows, -1 = empty slot (K >= 0; rows must be < N)
    sink           fp32 [H]             per-head sink logit (finite)
    cos, sin       fp32 [B, T, R/2]     RoPE angles of the query positions; R = 2 * cos.shape[-1] <= D
    softmax_scale  float                scores are (q . kv) * softmax_scale (the model: D^-0.5)
    new_codes      uint8 [B, S2, D] or None   FP8 rows that follow window_codes' S rows (the step's own entries
    new_scales     uint8 [B, S2, D/32] or None  next to the ring; read in place instead of a concatenated copy);
                                        window_ok then covers S + S2 rows. Both or neither.
    rope_q         bool                 rotate q first as the model does (`apply_rope(q, cos, sin)`: interleaved
                                        pairs of the last R channels, FP32, rounded to q.dtype), while it is
                                        loaded: the queries' RoPE launches no kernel of its own
    o              [B, T, H, D] in q.dtype

  Per head h and query t, with rows k over [visible window rows ; valid selected bank rows] and K = V:
  `s_k = (q_h . kv_k) * softmax_scale`, `o_h = sum_k e^(s_k - M) kv_k / (sum_k e^(s_k - M) + e^(sink_h - M))`,
  M = max(max_k s_k, sink_h); o is rounded to q.dtype, then its last R channels are rotated by the negative
  angle (interleaved pairs (2i, 2i+1), MODEL.md §2.2) and rounded again. A query without any valid row returns
  0 (the sink takes the whole softmax mass). Window values are dequantised into q.dtype (the eager model
  dequantises the ring into the activation dtype) and bank values into FP32, as in the model.

On CPU the op runs the reference (`reference_sparse_fp4_attention`, the model's own math). On CUDA it launches
the Triton kernel for any number of query rows (`triton_sparse_fp4_attention`; prefill chunks included: the
kernel's memory is O(B T H D), where the reference materialises [B, T, K, D] FP32 bank rows).

Kernel layout (FlashMLA-style split over the rows). The rows of one query are the window rows padded to a
multiple of BLOCK_N, then the K selected bank rows, in tiles of BLOCK_N rows (each tile is all-window or
all-bank). Program (query row, head block, split) owns BLOCK_H heads and a contiguous range of tiles; it keeps
an online-softmax state (running max m, sum l, accumulator [BLOCK_H, D]) in registers. At batch-1 decode
there is one query and few head blocks (64 heads -> 4), so the tiles are split over `attention_plan` programs
(about `_TARGET_PROGRAMS`, one or two per SM of an H200) instead of one program per head block. Every split
stores (m, l, acc) to a workspace, and a second launch (`_sparse_attention_combine_kernel`, `combine_plan`)
merges them: one program per (query row, head block, slice of channels) loads every split's state for its
slice at once, reduces over the splits by a fixed tree (deterministic), adds the sink to the denominator,
divides, applies the inverse RoPE and stores o. (Until 2026-11-30 the last split to arrive merged all splits
alone, one dependent L2 round trip per split: an estimated 50-60 of the 86 us the h200 decode call took.) Channels are held as two halves (even and odd channels), which is what a
packed E2M1 byte holds (low nibble even, high nibble odd): each bank byte is loaded once per head block and
decoded into both halves, and the inverse RoPE pairs (2i, 2i+1) are elementwise partners in registers.
HBM reads: each selected bank row (D/2 + D/16 bytes) and window row (D + D/32 bytes) once; head blocks after
the first re-read them from L2.

Numerics: the scores are `tl.dot`s in TF32 on the tensor cores for bf16 / fp16 q and in IEEE FP32 for FP32 q;
both are exact products (bf16 / fp16 q and every dequantised key are TF32 values), so the scores equal the
reference's FP32 einsum up to summation order. The weighted sums p @ kv are "tf32x3" dots for bf16 / fp16 q:
kv is a TF32 value, p is carried as a TF32 high part plus a TF32 low part (about 22 of its 24 bits, relative
error <= 2^-21 per product), far below the one rounding of q.dtype the output gets; FP32 q keeps IEEE FP32
there. exp is Triton's FP32 exp; the inverse RoPE is bit-exact to the reference's (FMA contraction off). Tests
bound the result by 1e-5 relative (FP32) or one rounding of q.dtype.
Measured on the H200 at the h200 decode shape (2026-11-30, bench/probes/attention_sweep.py): 39.6 us per call with
16-row tiles and IEEE weighted sums, 33.0 us with 32-row tiles, 26.6 us with 32-row tiles and tf32x3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.ref import sparse_attention as _ref

from ._common import (check_same_device, check_tensor, e2m1_value, exp2_int, next_power_of_2, register_cuda,
                      require_launchable, round_to, use_pdl_for)

__all__ = ["sparse_fp4_attention", "reference_sparse_fp4_attention", "triton_sparse_fp4_attention",
           "attention_plan", "combine_plan", "pv_precision_for", "MAX_HEAD_DIM"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Largest head dim one program holds (two [BLOCK_H, D/2] FP32 accumulators in registers).
MAX_HEAD_DIM = 1024
#: Heads per program: the smallest `tl.dot` M; 64 heads -> 4 head blocks.
_BLOCK_H = 16
#: Programs a launch aims for (about two per SM of a 132-SM H200), reached by splitting the rows.
_TARGET_PROGRAMS = 256
#: Fewest programs a plan of 32-row tiles may have before `attention_plan` takes 16-row tiles (twice the programs).
_MIN_PROGRAMS_32 = 64
#: `tl.dot` precision of the weighted sums p @ kv for bf16 / fp16 q (FP32 q always uses "ieee"); see Numerics.
PV_PRECISION = "tf32x3"
#: FP32 accumulator values one combine program loads at once (`combine_plan`).
_COMBINE_ELEMENTS = 4096


# ------------------------------------------------------------------------------------------- checks
def _check_args(q, window_codes, window_scales, window_ok, bank_codes, bank_scales, indices, sink, cos, sin,
                softmax_scale, new_codes=None, new_scales=None):
    """Validate dtypes and shapes (errors name the argument); return (B, T, H, D, S, N, K, R) with S the window
    rows of both parts."""
    check_tensor("q", q, dtypes=_FLOAT_DTYPES, ndim=4)
    check_tensor("window_codes", window_codes, dtypes=(torch.uint8,), ndim=3)
    check_tensor("window_scales", window_scales, dtypes=(torch.uint8,), ndim=3)
    check_tensor("window_ok", window_ok, dtypes=(torch.bool,), ndim=3)
    check_tensor("bank_codes", bank_codes, dtypes=(torch.uint8,), ndim=3)
    check_tensor("bank_scales", bank_scales, dtypes=(torch.uint8,), ndim=3)
    check_tensor("indices", indices, dtypes=(torch.int64, torch.int32), ndim=3)
    check_tensor("sink", sink, dtypes=(torch.float32,), ndim=1)
    check_tensor("cos", cos, dtypes=(torch.float32,), ndim=3)
    check_tensor("sin", sin, dtypes=(torch.float32,), ndim=3)
    check_same_device(q=q, window_codes=window_codes, window_scales=window_scales, window_ok=window_ok,
                      bank_codes=bank_codes, bank_scales=bank_scales, indices=indices, sink=sink, cos=cos, sin=sin)
    b, t, h, d = q.shape
    if d % 32 or d == 0:
        raise ValueError(f"head dim D = {d} must be a positive multiple of 32 (FP8 1x32 window, FP4 1x16 bank)")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim D = {d} exceeds MAX_HEAD_DIM = {MAX_HEAD_DIM}")
    s = window_codes.shape[1]
    n = bank_codes.shape[1]
    k = indices.shape[2]
    want = {"window_codes": (window_codes, (b, s, d)), "window_scales": (window_scales, (b, s, d // 32))}
    if (new_codes is None) != (new_scales is None):
        raise ValueError("new_codes and new_scales go together: pass both or neither")
    if new_codes is not None:
        check_tensor("new_codes", new_codes, dtypes=(torch.uint8,), ndim=3)
        check_tensor("new_scales", new_scales, dtypes=(torch.uint8,), ndim=3)
        check_same_device(q=q, new_codes=new_codes, new_scales=new_scales)
        s2 = new_codes.shape[1]
        want.update(new_codes=(new_codes, (b, s2, d)), new_scales=(new_scales, (b, s2, d // 32)))
        s += s2
    want.update({"window_ok": (window_ok, (b, t, s)), "bank_codes": (bank_codes, (b, n, d // 2)),
                 "bank_scales": (bank_scales, (b, n, d // 16)), "indices": (indices, (b, t, k)),
                 "sink": (sink, (h,))})
    for name, (ten, shape) in want.items():
        if tuple(ten.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(ten.shape)}; expected {shape} for q {tuple(q.shape)}")
    r2 = cos.shape[-1]
    if tuple(cos.shape) != (b, t, r2) or tuple(sin.shape) != (b, t, r2) or r2 < 1 or 2 * r2 > d:
        raise ValueError(f"cos / sin must both be [B, T, R/2] = [{b}, {t}, R/2] with 2 <= R <= D = {d}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    return b, t, h, d, s, n, k, 2 * r2


# ------------------------------------------------------------------------------------------- reference
def reference_sparse_fp4_attention(q: torch.Tensor, window_codes: torch.Tensor, window_scales: torch.Tensor,
                                   window_ok: torch.Tensor, bank_codes: torch.Tensor, bank_scales: torch.Tensor,
                                   indices: torch.Tensor, sink: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                   softmax_scale: float, new_codes: torch.Tensor | None = None,
                                   new_scales: torch.Tensor | None = None, rope_q: bool = False) -> torch.Tensor:
    """Plain-PyTorch `dsv41::sparse_fp4_attention` (shapes and dtypes: module docstring).

    Follows dsv41/model/attention.py `Attention.forward` op for op: q's RoPE when `rope_q`, window rows dequantised
    into q.dtype, bank rows gathered at `indices.clamp(min=0)` and dequantised into FP32, scores in FP32 with -inf
    at hidden window rows and at -1 slots, softmax over [scores ; sink] with the sink column dropped, the two value products,
    o.to(q.dtype), inverse RoPE. Returns [B, T, H, D] in q.dtype.
    Raises: TypeError / ValueError for wrong dtypes or shapes (named); IndexError for an index >= N.
    Source: MODEL.md §2.4 steps 3-6, §2.1 (FP8 1x32 UE8M0, FP4 1x16 E4M3), §2.2 (inverse RoPE).
    """
    _check_args(q, window_codes, window_scales, window_ok, bank_codes, bank_scales, indices, sink, cos, sin,
                softmax_scale, new_codes, new_scales)
    if new_codes is not None:
        window_codes, window_scales = torch.cat((window_codes, new_codes), 1), torch.cat((window_scales, new_scales), 1)
    return _ref.sparse_fp4_attention(q, window_codes, window_scales, window_ok, bank_codes, bank_scales, indices, sink,
                                     cos, sin, softmax_scale, rope_q=bool(rope_q))


# ------------------------------------------------------------------------------------------- kernel
@triton.jit
def _e4m3_value(byte):
    """fp32 value of FP8 E4M3 (fn) bytes (int32 0..255), exact, from the bits: normals (exponent field e > 0)
    are (-1)^s 2^(e-7) (1 + m/8), subnormals m 2^-9, and 0x7F / 0xFF (e = 15, m = 7) are NaN."""
    e = (byte >> 3) & 15
    m = byte & 7
    sign = (byte & 128) << 24
    normal = (((e + 120) << 23) | (m << 20) | sign).to(tl.float32, bitcast=True)
    sub = (m.to(tl.float32) * 0.001953125)
    sub = tl.where(sign != 0, -sub, sub)
    v = tl.where(e == 0, sub, normal)
    return tl.where((e == 15) & (m == 7), float("nan"), v)


@triton.jit
def _sparse_fp4_attention_kernel(
    q_ptr, wc_ptr, ws_ptr, wc2_ptr, ws2_ptr, wok_ptr, bc_ptr, bs_ptr, idx_ptr, sink_ptr, cos_ptr, sin_ptr, o_ptr,
    part_ptr, T, H, S, S1, K, N, n_win_tiles, tiles_per_split, softmax_scale,
    sq_b, sq_t, sq_h, swc_b, swc_s, sws_b, sws_s, swc2_b, swc2_s, sws2_b, sws2_s, sok_b, sok_t, sok_s,
    sbc_b, sbc_n, sbs_b, sbs_n, si_b, si_t, si_k, scs_b, scs_t, ssn_b, ssn_t,
    D2: tl.constexpr, HALF_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D2: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr, PV_PRECISION: tl.constexpr,
    ROPE_Q: tl.constexpr = False,
):
    row = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    n_hb = tl.num_programs(1)
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    Q_DT: tl.constexpr = q_ptr.dtype.element_ty
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    i = tl.arange(0, BLOCK_D2)
    i_ok = i < D2
    n_loc = tl.arange(0, BLOCK_N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    # Queries as even / odd channel halves [BLOCK_H, BLOCK_D2] (padded heads and channels read 0).
    q_rows = q_ptr + b * sq_b + t * sq_t + heads[:, None].to(tl.int64) * sq_h + 2 * i[None, :]
    qmask = h_ok[:, None] & i_ok[None, :]
    q_e = tl.load(q_rows, mask=qmask, other=0.0).to(tl.float32)
    q_o = tl.load(q_rows + 1, mask=qmask, other=0.0).to(tl.float32)
    if ROPE_Q:  # a' = a cos - b sin, b' = a sin + b cos on the last R channels, each rounded to q.dtype as eager
        pair = i - (D2 - HALF_R)
        rot = (pair >= 0) & i_ok
        c = tl.load(cos_ptr + b * scs_b + t * scs_t + pair, mask=rot, other=1.0)
        sn = tl.load(sin_ptr + b * ssn_b + t * ssn_t + pair, mask=rot, other=0.0)
        r_e = round_to(q_e * c[None, :] - q_o * sn[None, :], Q_DT)
        r_o = round_to(q_e * sn[None, :] + q_o * c[None, :], Q_DT)
        q_e = tl.where(rot[None, :], r_e, q_e)
        q_o = tl.where(rot[None, :], r_o, q_o)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_e = tl.zeros([BLOCK_H, BLOCK_D2], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_H, BLOCK_D2], dtype=tl.float32)
    for it in range(tiles_per_split):
        tile = split * tiles_per_split + it
        if tile < n_win_tiles:
            # Window tile: FP8 E4M3 rows, UE8M0 scale per 32 channels (channel 2i and 2i+1 -> scale i // 16),
            # dequantised into q.dtype like the eager ring. Rows from S1 on come from the second part (the step's
            # own entries), read where they are instead of from a concatenated copy.
            srow = tile * BLOCK_N + n_loc
            ok = srow < S
            vis = tl.load(wok_ptr + b * sok_b + t * sok_t + srow.to(tl.int64) * sok_s, mask=ok, other=0)
            ok = ok & (vis != 0)
            lmask = ok[:, None] & i_ok[None, :]
            first = (srow < S1)[:, None]
            m1 = lmask & first
            m2 = lmask & (srow >= S1)[:, None]
            r1 = srow[:, None].to(tl.int64)
            r2 = tl.maximum(r1 - S1, 0)
            base1 = wc_ptr + b * swc_b + r1 * swc_s + 2 * i[None, :]
            base2 = wc2_ptr + b * swc2_b + r2 * swc2_s + 2 * i[None, :]
            # A row is in one part: the other part's masked load gives 0, so OR-ing the two is a select.
            c_e = (tl.load(base1, mask=m1, other=0) | tl.load(base2, mask=m2, other=0)).to(tl.int32)
            c_o = (tl.load(base1 + 1, mask=m1, other=0) | tl.load(base2 + 1, mask=m2, other=0)).to(tl.int32)
            sc_i = (i // 16)[None, :]
            e = (tl.load(ws_ptr + b * sws_b + r1 * sws_s + sc_i, mask=m1, other=0)
                 | tl.load(ws2_ptr + b * sws2_b + r2 * sws2_s + sc_i, mask=m2, other=0)).to(tl.int32)
            scale = exp2_int(e)
            kv_e = round_to(_e4m3_value(c_e) * scale, Q_DT)
            kv_o = round_to(_e4m3_value(c_o) * scale, Q_DT)
        else:
            # Bank tile: gather the selected rows (-1 = empty); one packed byte holds channels 2i (low nibble)
            # and 2i + 1 (high nibble); E4M3 scale per 16 channels -> scale i // 8.
            j = (tile - n_win_tiles) * BLOCK_N + n_loc
            ok = j < K
            r = tl.load(idx_ptr + b * si_b + t * si_t + j.to(tl.int64) * si_k, mask=ok, other=-1).to(tl.int64)
            ok = ok & (r >= 0) & (r < N)
            lmask = ok[:, None] & i_ok[None, :]
            packed = tl.load(bc_ptr + b * sbc_b + r[:, None] * sbc_n + i[None, :], mask=lmask, other=0).to(tl.int32)
            sc = tl.load(bs_ptr + b * sbs_b + r[:, None] * sbs_n + (i // 8)[None, :], mask=lmask,
                         other=0).to(tl.int32)
            scale = _e4m3_value(sc)
            kv_e = e2m1_value(packed & 15) * scale
            kv_o = e2m1_value(packed >> 4) * scale
        if Q_DT == tl.float32:
            s = (tl.dot(q_e, tl.trans(kv_e), input_precision="ieee")
                 + tl.dot(q_o, tl.trans(kv_o), input_precision="ieee"))
        else:
            # bf16 / fp16 q (<= 11 significant bits) times window values (E4M3 x UE8M0 rounded to q.dtype) or
            # bank values (E2M1 x E4M3, <= 6 bits): TF32 operands whose products are exact, so the tensor cores
            # give the IEEE scores up to the order of the FP32 sum. p @ kv is PV_PRECISION (module docstring).
            s = (tl.dot(q_e, tl.trans(kv_e), input_precision="tf32")
                 + tl.dot(q_o, tl.trans(kv_o), input_precision="tf32"))
        s = s * softmax_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows seen so far may all be empty (m = -inf): shift by 0 there, so exp gives 0, never NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc_e = acc_e * alpha[:, None] + tl.dot(p, kv_e, input_precision=PV_PRECISION)
        acc_o = acc_o * alpha[:, None] + tl.dot(p, kv_o, input_precision=PV_PRECISION)
        m_i = m_new
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    if SPLIT == 1:
        sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)
        big_m = tl.maximum(m_i, sink)
        w = tl.exp(m_i - big_m)
        l_tot = l_i * w + tl.exp(sink - big_m)
        _finish(acc_e * w[:, None], acc_o * w[:, None], l_tot, i, qmask, heads, b, t, T, H, cos_ptr, sin_ptr,
                o_ptr, scs_b, scs_t, ssn_b, ssn_t, D2, HALF_R, Q_DT)
    else:
        # Workspace record per (row, head block, split): m [BLOCK_H], l [BLOCK_H], acc_e, acc_o [BLOCK_H, BLOCK_D2];
        # `_sparse_attention_combine_kernel` merges the splits.
        PW: tl.constexpr = 2 * BLOCK_H + 2 * BLOCK_H * BLOCK_D2
        mine = part_ptr + ((row * n_hb + hb).to(tl.int64) * SPLIT + split) * PW
        hh = tl.arange(0, BLOCK_H)
        acc_off = hh[:, None] * BLOCK_D2 + i[None, :]
        tl.store(mine + hh, m_i)
        tl.store(mine + BLOCK_H + hh, l_i)
        tl.store(mine + 2 * BLOCK_H + acc_off, acc_e)
        tl.store(mine + 2 * BLOCK_H + BLOCK_H * BLOCK_D2 + acc_off, acc_o)


@triton.jit
def _finish(o_e, o_o, l_tot, i, mask, heads, b, t, T, H, cos_ptr, sin_ptr, o_ptr, scs_b, scs_t, ssn_b, ssn_t,
            D2: tl.constexpr, HALF_R: tl.constexpr, Q_DT: tl.constexpr):
    """Store o = (o_e, o_o) / l_tot for channels 2i, 2i+1 of `heads`: o.to(q.dtype), then the inverse RoPE on the
    last R channels (pairs = (even, odd) halves at i >= D2 - HALF_R): a' = a cos + b sin, b' = b cos - a sin, in
    FP32 rounded to q.dtype (model.rope.apply_rope)."""
    o_e = round_to(o_e / l_tot[:, None], Q_DT)
    o_o = round_to(o_o / l_tot[:, None], Q_DT)
    pair = i - (D2 - HALF_R)
    rot = (pair >= 0) & (i < D2)
    c = tl.load(cos_ptr + b * scs_b + t * scs_t + pair, mask=rot, other=1.0)
    sn = tl.load(sin_ptr + b * ssn_b + t * ssn_t + pair, mask=rot, other=0.0)
    r_e = round_to(o_e * c[None, :] + o_o * sn[None, :], Q_DT)
    r_o = round_to(o_o * c[None, :] - o_e * sn[None, :], Q_DT)
    out_e = tl.where(rot[None, :], r_e, o_e)
    out_o = tl.where(rot[None, :], r_o, o_o)
    o_rows = o_ptr + ((b * T + t) * H + heads[:, None].to(tl.int64)) * (2 * D2) + 2 * i[None, :]
    tl.store(o_rows, out_e.to(Q_DT), mask=mask)
    tl.store(o_rows + 1, out_o.to(Q_DT), mask=mask)


@triton.jit
def _sparse_attention_combine_kernel(
    part_ptr, sink_ptr, cos_ptr, sin_ptr, o_ptr, T, H, SPLIT, scs_b, scs_t, ssn_b, ssn_t,
    D2: tl.constexpr, HALF_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr,
    SPLIT_POW2: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (query row, head block, channel slice of BLOCK_C) merges the SPLIT online-softmax states of its
    # (row, head block): every split's m, l and accumulator slice in one vector load each (a fixed reduction
    # tree over the splits: deterministic), the sink in the denominator, then the division and inverse RoPE.
    row = tl.program_id(0)
    hb = tl.program_id(1)
    cs = tl.program_id(2)
    n_hb = tl.num_programs(1)
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    Q_DT: tl.constexpr = o_ptr.dtype.element_ty
    PW: tl.constexpr = 2 * BLOCK_H + 2 * BLOCK_H * BLOCK_D2
    hh = tl.arange(0, BLOCK_H)
    heads = hb * BLOCK_H + hh
    h_ok = heads < H
    i = cs * BLOCK_C + tl.arange(0, BLOCK_C)
    sp = tl.arange(0, SPLIT_POW2)
    sp_ok = sp < SPLIT
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    rec = part_ptr + ((row * n_hb + hb).to(tl.int64) * SPLIT + sp) * PW
    m = tl.load(rec[:, None] + hh[None, :], mask=sp_ok[:, None], other=float("-inf"), cache_modifier=".cg")
    l_sp = tl.load(rec[:, None] + BLOCK_H + hh[None, :], mask=sp_ok[:, None], other=0.0, cache_modifier=".cg")
    off = rec[:, None, None] + 2 * BLOCK_H + hh[None, :, None] * BLOCK_D2 + i[None, None, :]
    a_e = tl.load(off, mask=sp_ok[:, None, None], other=0.0, cache_modifier=".cg")
    a_o = tl.load(off + BLOCK_H * BLOCK_D2, mask=sp_ok[:, None, None], other=0.0, cache_modifier=".cg")
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)
    big_m = tl.maximum(tl.max(m, axis=0), sink)
    # Splits past SPLIT (and splits without a visible row) have m = -inf: weight 0.
    w = tl.where(sp_ok[:, None], tl.exp(m - big_m[None, :]), 0.0)
    l_tot = tl.sum(w * l_sp, axis=0) + tl.exp(sink - big_m)
    o_e = tl.sum(w[:, :, None] * a_e, axis=0)
    o_o = tl.sum(w[:, :, None] * a_o, axis=0)
    _finish(o_e, o_o, l_tot, i, h_ok[:, None] & (i < D2)[None, :], heads, b, t, T, H, cos_ptr, sin_ptr, o_ptr,
            scs_b, scs_t, ssn_b, ssn_t, D2, HALF_R, Q_DT)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result / workspace allocation; a seam the tests replace to poison outputs."""
    return torch.empty(shape, dtype=dtype, device=device)


def attention_plan(rows: int, heads: int, s: int, k: int, d: int, split: int | None = None,
                   block_n: int | None = None) -> dict:
    """Launch plan: {"BLOCK_H", "BLOCK_N", "BLOCK_D2", "HB" (head blocks), "n_win_tiles", "n_tiles",
    "tiles_per_split", "SPLIT", "num_warps", "grid"}.

    Args: rows = B * T query rows, heads H, s window rows, k selected bank rows, d head dim; `split` forces the
    number of splits (tests, benchmarks; the number used may be smaller so that no split is empty);
    `block_n` the rows per tile (a power of two >= 16).
    Heuristic: split the tiles so that rows * head blocks * splits reaches about `_TARGET_PROGRAMS` (at batch-1
    decode with 64 heads: 4 head blocks x 21 tiles of 32 rows of 129 + 512 -> 21 splits of one tile); BLOCK_N
    32, or 16 where 32-row tiles give fewer than `_MIN_PROGRAMS_32` programs; 8 warps from D = 512. On the H200 at
    the h200 shape 32-row tiles beat 16-row tiles (twice the programs, and the combine merges twice the splits):
    33.0 vs 39.6 us; 64-row tiles need more than its 227 KB of shared memory with IEEE weighted sums
    (bench/probes/attention_sweep.py, 2026-11-30). At the `small` shape (16 heads: one head block, 4 + 4 tiles of
    32 rows, 8 programs) 16-row tiles (16 programs) took 16.9 against 25.7 us per call on an H100
    (bench/results/2026-12-07_h100_s35): with so few programs each one's latency is the call's.
    Raises: ValueError for split < 1 or a bad block_n.
    """
    bd2 = max(16, next_power_of_2(d // 2))
    hb = -(-heads // _BLOCK_H)
    if block_n is None:
        tiles_32 = -(-s // 32) + -(-k // 32)
        block_n = 16 if rows * hb * tiles_32 < _MIN_PROGRAMS_32 else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two >= 16")
    n_win = -(-s // block_n)
    n_tiles = n_win + -(-k // block_n)
    if split is None:
        split = max(1, _TARGET_PROGRAMS // max(rows * hb, 1))
    elif split < 1:
        raise ValueError(f"split must be >= 1, got {split}")
    split = max(1, min(split, n_tiles))
    per = max(1, -(-n_tiles // split))
    split = max(1, -(-n_tiles // per))
    return {"BLOCK_H": _BLOCK_H, "BLOCK_N": block_n, "BLOCK_D2": bd2, "HB": hb, "n_win_tiles": n_win,
            "n_tiles": n_tiles, "tiles_per_split": per if n_tiles else 0, "SPLIT": split,
            "num_warps": 8 if d >= 512 else 4, "grid": (rows, hb, split)}


def pv_precision_for(dtype: torch.dtype) -> str:
    """`tl.dot` input precision of the weighted sums p @ kv for queries of `dtype`: `PV_PRECISION` ("tf32x3")
    for bf16 / fp16, "ieee" for FP32 (module docstring, Numerics)."""
    return "ieee" if dtype == torch.float32 else PV_PRECISION


def combine_plan(split: int, block_h: int, block_d2: int) -> dict:
    """Launch plan of the split combine: {"SPLIT_POW2", "BLOCK_C", "num_warps"}. A program holds every split's
    [BLOCK_H, BLOCK_C] accumulator slice of both channel halves at once, at most `_COMBINE_ELEMENTS` FP32 values
    (32 registers per thread at 4 warps + the m / l tiles), so BLOCK_C = the largest power of two <= BLOCK_D2
    within that; at h200 decode (41 splits -> 64, 16 heads) that is 4 channels, 64 x 4 x 64 = 16,384 programs."""
    sp2 = next_power_of_2(split)
    c = max(1, min(block_d2, _COMBINE_ELEMENTS // (2 * sp2 * block_h)))
    c = 1 << (c.bit_length() - 1)
    return {"SPLIT_POW2": sp2, "BLOCK_C": c, "num_warps": 4}


def triton_sparse_fp4_attention(q: torch.Tensor, window_codes: torch.Tensor, window_scales: torch.Tensor,
                                window_ok: torch.Tensor, bank_codes: torch.Tensor, bank_scales: torch.Tensor,
                                indices: torch.Tensor, sink: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                softmax_scale: float, split: int | None = None,
                                block_n: int | None = None, pv_precision: str | None = None,
                                num_warps: int | None = None, new_codes: torch.Tensor | None = None,
                                new_scales: torch.Tensor | None = None, rope_q: bool = False) -> torch.Tensor:
    """Triton `dsv41::sparse_fp4_attention` on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1).

    Same arguments, result (to FP32 rounding, module docstring) and errors as `reference_sparse_fp4_attention`,
    except that an index >= N is treated as an empty slot instead of raising. One launch over (query row,
    head block, split) programs (`attention_plan`; `split` / `block_n` / `num_warps` override it);
    `pv_precision` ("ieee" or "tf32x3") overrides `PV_PRECISION` for the weighted sums. Inputs may be strided;
    only the last dim of q and of the code / scale tensors must be contiguous (made so otherwise).
    Raises RuntimeError for CPU tensors without the interpreter.
    """
    b, t, h, d, s, n, k, r = _check_args(q, window_codes, window_scales, window_ok, bank_codes, bank_scales,
                                         indices, sink, cos, sin, softmax_scale, new_codes, new_scales)
    pv = pv_precision_for(q.dtype) if pv_precision is None else pv_precision
    if pv not in ("ieee", "tf32x3"):
        raise ValueError(f"pv_precision must be 'ieee' or 'tf32x3', got {pv_precision!r}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps!r}")
    require_launchable(_sparse_fp4_attention_kernel, q.device, "triton_sparse_fp4_attention")
    out = _empty((b, t, h, d), q.dtype, q.device)
    if b * t * h == 0:
        return out

    def last_contig(x):
        """`x` with a unit last stride (copied only when it has none)."""
        return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()

    q, window_codes, window_scales = last_contig(q), last_contig(window_codes), last_contig(window_scales)
    s1 = window_codes.shape[1]
    if new_codes is None:  # one part: the second part's pointers are never selected
        new_codes, new_scales = window_codes, window_scales
    new_codes, new_scales = last_contig(new_codes), last_contig(new_scales)
    bank_codes, bank_scales = last_contig(bank_codes), last_contig(bank_scales)
    cos, sin, sink = last_contig(cos), last_contig(sin), sink.contiguous()
    ok = window_ok.view(torch.uint8)
    plan = attention_plan(b * t, h, s, k, d, split=split, block_n=block_n)
    if num_warps is not None:
        plan["num_warps"] = num_warps
    n_split = plan["SPLIT"]
    if n_split > 1:
        width = 2 * plan["BLOCK_H"] + 2 * plan["BLOCK_H"] * plan["BLOCK_D2"]
        part = _empty((b * t * plan["HB"] * n_split, width), torch.float32, q.device)
    else:  # not read when SPLIT == 1
        part = torch.empty(1, dtype=torch.float32, device=q.device)
    pdl = use_pdl_for(_sparse_fp4_attention_kernel, q.device)
    _sparse_fp4_attention_kernel[plan["grid"]](
        q, window_codes, window_scales, new_codes, new_scales, ok, bank_codes, bank_scales, indices, sink, cos, sin,
        out, part, t, h, s, s1, k, n, plan["n_win_tiles"], plan["tiles_per_split"], float(softmax_scale),
        q.stride(0), q.stride(1), q.stride(2), window_codes.stride(0), window_codes.stride(1),
        window_scales.stride(0), window_scales.stride(1), new_codes.stride(0), new_codes.stride(1),
        new_scales.stride(0), new_scales.stride(1), ok.stride(0), ok.stride(1), ok.stride(2),
        bank_codes.stride(0), bank_codes.stride(1), bank_scales.stride(0), bank_scales.stride(1),
        indices.stride(0), indices.stride(1), indices.stride(2), cos.stride(0), cos.stride(1),
        sin.stride(0), sin.stride(1),
        D2=d // 2, HALF_R=r // 2, BLOCK_H=plan["BLOCK_H"], BLOCK_N=plan["BLOCK_N"], BLOCK_D2=plan["BLOCK_D2"],
        SPLIT=n_split, USE_PDL=pdl, PV_PRECISION=pv, ROPE_Q=bool(rope_q), num_warps=plan["num_warps"],
        enable_fp_fusion=False,
        **({"launch_pdl": True} if pdl else {}))
    if n_split > 1:
        c = combine_plan(n_split, plan["BLOCK_H"], plan["BLOCK_D2"])
        _sparse_attention_combine_kernel[(b * t, plan["HB"], plan["BLOCK_D2"] // c["BLOCK_C"])](
            part, sink, cos, sin, out, t, h, n_split, cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            D2=d // 2, HALF_R=r // 2, BLOCK_H=plan["BLOCK_H"], BLOCK_D2=plan["BLOCK_D2"],
            SPLIT_POW2=c["SPLIT_POW2"], BLOCK_C=c["BLOCK_C"], USE_PDL=pdl, num_warps=c["num_warps"],
            enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    return out


# ------------------------------------------------------------------------------------------- op
@torch.library.custom_op("dsv41::sparse_fp4_attention", mutates_args=(), device_types="cpu")
def sparse_fp4_attention(q: torch.Tensor, window_codes: torch.Tensor, window_scales: torch.Tensor,
                         window_ok: torch.Tensor, bank_codes: torch.Tensor, bank_scales: torch.Tensor,
                         indices: torch.Tensor, sink: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         softmax_scale: float, new_codes: torch.Tensor | None = None,
                         new_scales: torch.Tensor | None = None, rope_q: bool = False) -> torch.Tensor:
    """Sparse FP4 attention with sink and inverse RoPE; see `reference_sparse_fp4_attention` (module docstring)."""
    return reference_sparse_fp4_attention(q, window_codes, window_scales, window_ok, bank_codes, bank_scales,
                                          indices, sink, cos, sin, softmax_scale, new_codes, new_scales, rope_q)


@register_cuda(sparse_fp4_attention, "dsv41::sparse_fp4_attention")
def _sparse_fp4_attention_cuda(q, window_codes, window_scales, window_ok, bank_codes, bank_scales, indices, sink,
                               cos, sin, softmax_scale, new_codes=None, new_scales=None, rope_q=False):
    return triton_sparse_fp4_attention(q, window_codes, window_scales, window_ok, bank_codes, bank_scales, indices,
                                       sink, cos, sin, softmax_scale, new_codes=new_codes, new_scales=new_scales,
                                       rope_q=rope_q)


@sparse_fp4_attention.register_fake
def _sparse_fp4_attention_fake(q, window_codes, window_scales, window_ok, bank_codes, bank_scales, indices, sink,
                               cos, sin, softmax_scale, new_codes=None, new_scales=None, rope_q=False):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
