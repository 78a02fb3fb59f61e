"""Block-FP8 GEMV of one activation row on the tensor cores: the E4M3 weight bytes go straight from memory into
`mma.sync` fragments, with no decode, no shared memory and no layout conversion in the K loop.

Why. The CUDA-core kernels of `dsv41::linear_fp8_block` turn every weight byte into an FP32 value and multiply it
on the FMA units (`quant_gemv.tile_products`): at the h200 shapes they reach 44-62 % of copy bandwidth (TMA kernel
wq_b 15.8 us, wo_b 18.4 us; bench/results/2026-12-01_h200_s16). An E4M3 weight byte is already an operand of the
FP8 `mma.sync.m16n8k32` (sm_89+), and the activations are FP8 too where the model quantises them (act_quant, the
reference's `fake_quant_fp8_1x32`): each thread loads the 16-byte vectors its own fragment registers hold and
issues the MMA itself (inline PTX), as `grouped_frag` does for the FP4 experts (whose fragment layout this module
shares: see that module's docstring). The weights never come from the previous kernel, so under PDL a warp issues
its first span's weight loads before `griddepcontrol.wait`: they overlap the previous kernel's tail.

Layout (lane = 4 g + t; one warp, a 16-row tile, K in spans of 256 = 8 blocks of 32, column n of B = block n of the
span). Thread t loads, for rows g and g + 8, the 32 bytes (8 words) of blocks t and t + 4; MMA p (p = 0..7) takes
word p of each: a0 / a1 = word p of block t of rows g / g + 8, a2 / a3 the same of block t + 4. Lane (g, t) with
g % 4 == t holds x's word p of block g as b0 (g < 4) or b1 (g >= 4), other lanes zeros. After the 8 MMAs D[r][n]
is the dot product of row r with block n of the span, complete; lane (g, t) multiplies D[g][2t + j] and
D[g + 8][2t + j] by the weight's UE8M0 scale of the 32-row band and block 2t + j and by the activation block's scale
and adds them to its FP32 accumulators. After the K loop the four lanes of a row are summed and
`quant_gemv.store_gemv_result` writes y (split-K partials merged through its arrival counters, in K order).

Program (W row tiles of 16, K split j) of W warps: warp w owns rows (pid_n W + w) 16 .. + 15 and spans
j ITERS .. (j + 1) ITERS - 1. EVEN (K a multiple of 256, the spans a multiple of SPLIT_K, N a multiple of 16 W: every
h200 shape) drops the per-lane masks of the K loop; PREFETCH keeps the next span's loads in flight (registers)
while this span's MMAs run. Activations: `grouped_frag.prepare_frag_x(part_order=False)`, one small launch that
writes the E4M3 bytes of `formats.quantize_fp8_1x32(x)` in K order and the block scales as FP32.

Numerics: act_quant only (the FP8 activations are the operands). Codes, activations and scales are exact; each
product of a weight code and an activation code is exact; the MMA adds the 32 products of a block with the tensor
core's FP32 accumulation (on Hopper not IEEE round-to-nearest at every add: a few units of 2^-23 of the block sum),
block sums are scaled by powers of two and added in FP32 in another order than the reference's matmul, then rounded
once to x's dtype (bf16 / fp32; fp16 x, whose reference rounds the dequantised weight to fp16, stays on the other
kernels). A NaN weight byte or activation makes its row (activation: every row) NaN, as in the reference; a UE8M0
scale byte of 0 is a zero scale and bytes near 255 can overflow to inf where the reference is finite (as in the
other kernels).

Several weights of one x (up to 4, `launch_frag_gemv_multi`): weight i takes ceil(N_i / (16 W)) programs of one
grid, and the program picks its weight's pointers, strides and output (as `gemv_multi._gemv_multi_kernel` does).

Measured on the H200 (PDL, CUDA-graph replay over weight copies beyond L2, bf16 x, bench/results/2026-12-02_h200_s24,
fractions of the 4.25 TB/s copy bandwidth), default plans against the TMA / tile kernels in one run: wq_b 14.5 against
15.9 us (68.4 %; the GEMV launch alone, activations prepared outside the graph, 13.9 us, 71.4 %), wo_b 16.8 against
18.5 us (59.0 %), shared w2 7.3 against 8.7 us, the 662 MB LM head 165.6 against 177.3 us (94.2 %); wq_a (6.6 MB)
5.8 against 5.7 us on the tile kernel, hence `quant_gemv.FRAG_MIN_WEIGHT_BYTES_M1`. The activation launch costs
0.6-1.3 us of the smaller GEMVs' time. A launch that only reads the same bytes after its PDL wait reaches 74.8 % at
42 MB (bench/results/2026-12-02_h200_s23, read_ceiling): the 80 % target of issue #3 is above it at these sizes.

Not an op of its own: `quant_gemv.triton_linear_fp8_block` launches it (`frag=True`, or by default where
`quant_gemv.split_frag_overrides` picks it), and `gemv_multi.triton_linear_fp8_block_multi` for sibling GEMVs
(`gemv_multi.frag_launch_applies`). Under TRITON_INTERPRET=1 the MMA is emulated on the same per-lane registers
(`grouped_frag._mma_emulated`), which checks the fragment bookkeeping on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_int_options, exp2_int, is_interpreted, next_power_of_2, split_k_workspace, use_pdl_for
from .gemv_tiles import pick_operand, store_gemv_result, weight_slot
from .grouped_frag import SPAN, frag_mma, frag_supported, prepare_frag_x, split4

__all__ = ["frag_gemv_plan", "frag_gemv_eligible", "frag_gemv_supported", "launch_frag_gemv", "launch_frag_gemv_multi",
           "FRAG_GEMV_KEYS"]

#: Rows per warp: the MMA's M.
_ROWS = 16
#: Warps in flight per SM the default split-K aims for at least (`frag_gemv_plan`). H200, PDL, CUDA-graph replay
#: (bench/results/2026-12-02_h200_s24): wq_b 15.1 us unsplit (15.5 warps per SM) against 18.2 us split 5 ways; wo_b
#: split 8 (19 per SM) 16.8 us against 17.6 (4 ways) and 18.5 (16 ways).
_WARPS_PER_SM = 12
#: Row tiles per SM from which a program takes 8 warps (else 4 unsplit, 2 split): the head (8080 tiles) 162.7
#: against 170.1 us at 4 warps; 4 warps at wq_b, 2 where K is split (wo_b, shared w2, wq_a) measured best or within
#: 2 % of the best.
_EIGHT_WARP_TILES_PER_SM = 48
_DEFAULT_SMS = 132
#: Override keys of `triton_linear_fp8_block` that shape this plan (besides `frag` itself and `sm_count`).
FRAG_GEMV_KEYS = ("num_warps", "split_k", "prefetch", "even", "maxnreg", "early_launch")
#: Whether the activation launch lets the GEMV start before it waits for its own predecessor (`early_launch`):
#: faster at every h200 shape (wq_b 14.7 against 15.1 us, wo_b 16.4 against 16.8 us, shared w2 7.7 against 8.1 us).
_EARLY_LAUNCH = True


def frag_gemv_plan(n: int, k: int, *, num_warps: int | None = None, split_k: int | None = None,
                   prefetch: bool | None = None, even: bool | None = None, maxnreg: int | None = None,
                   early_launch: bool | None = None, sm_count: int | None = None) -> dict:
    """Launch parameters of the fragment GEMV for a block-FP8 weight [n, k] and one x row.

    Each warp owns a 16-row tile; split_k programs along K (default: 1 where the row tiles alone give
    `_WARPS_PER_SM` warps per SM of `sm_count` (default 132), else the smallest divisor of the spans that does, or
    all spans); W = num_warps warps per program (default 8 from `_EIGHT_WARP_TILES_PER_SM` row tiles per SM, else 4
    unsplit and 2 split); ITERS = ceil(spans / split_k) spans per warp; PREFETCH (prefetch, default on)
    double-buffers the span loads in registers; EVEN (even, default: where the shape allows it) drops the per-lane
    masks, which needs k a multiple of 256, the spans a multiple of split_k and n a multiple of 16 W; MAXNREG
    (maxnreg, registers per thread; default: the compiler's choice); EARLY_LAUNCH (early_launch, default
    `_EARLY_LAUNCH`): under PDL the activation launch lets the GEMV start before it waits for the kernel before it,
    so the GEMV's first weight loads overlap that kernel's tail (`grouped_words.x_blocks` EARLY); grid
    (ceil(n / (16 W)), split_k). h200 defaults (measured, bench/results/2026-12-02_h200_s24): wq_b 32768 x 1280
    4 warps unsplit, wo_b 5120 x 8192 2 warps x 8 splits, head 129280 x 5120 8 warps.
    Returns a dict with SPANS, ITERS, SPLIT_K, SPLIT_POW2, PREFETCH, EVEN, MAXNREG, EARLY_LAUNCH, num_warps and grid.
    Raises: ValueError for a value that is not an int (prefetch, even, early_launch: not a bool), num_warps not in
    1, 2, 4, 8, split_k outside 1..65535, maxnreg outside 24..255, even=True for a shape that does not allow it.
    """
    for key, val in (("prefetch", prefetch), ("even", even), ("early_launch", early_launch)):
        if val is not None and not isinstance(val, bool):
            raise ValueError(f"{key}={val!r} must be a bool")
    check_int_options(num_warps=num_warps, split_k=split_k, maxnreg=maxnreg, sm_count=sm_count)
    if num_warps is not None and num_warps not in (1, 2, 4, 8):
        raise ValueError(f"num_warps={num_warps} must be 1, 2, 4 or 8")
    spans = max(1, -(-k // SPAN))
    tiles = max(1, -(-n // _ROWS))
    sms = sm_count or _DEFAULT_SMS
    if split_k is None:
        want = _WARPS_PER_SM * sms
        split_k = next((d for d in range(1, spans + 1) if spans % d == 0 and tiles * d >= want), spans)
    if not 1 <= split_k <= 65535:
        raise ValueError(f"split_k={split_k} must be in 1..65535")
    if num_warps is None:
        num_warps = 8 if tiles >= _EIGHT_WARP_TILES_PER_SM * sms else (4 if split_k == 1 else 2)
    fits = k > 0 and k % SPAN == 0 and spans % split_k == 0 and n % (_ROWS * num_warps) == 0
    if even is None:
        even = fits
    elif even and not fits:
        raise ValueError(f"even=True needs K % {SPAN} == 0, the {spans} spans a multiple of split_k = {split_k} and "
                         f"the {n} rows a multiple of 16 x num_warps = {_ROWS * num_warps}")
    if maxnreg is not None and not 24 <= maxnreg <= 255:
        raise ValueError(f"maxnreg={maxnreg} must be in 24..255 (registers per thread)")
    return dict(SPANS=spans, ITERS=-(-spans // split_k), SPLIT_K=split_k, SPLIT_POW2=next_power_of_2(split_k),
                PREFETCH=True if prefetch is None else prefetch, EVEN=even, MAXNREG=maxnreg,
                EARLY_LAUNCH=_EARLY_LAUNCH if early_launch is None else early_launch, num_warps=num_warps,
                grid=(-(-tiles // num_warps), split_k))


def frag_gemv_eligible(x: torch.Tensor, weight: torch.Tensor, act_quant: bool) -> bool:
    """Whether `launch_frag_gemv` computes these arguments' numbers: act_quant, one x row (x.numel() == K), x bf16
    or fp32, and a weight uint8 [N, K] readable as 16-byte vectors (contiguous along K, K and the row stride
    multiples of 16, 16-byte aligned address)."""
    return (bool(act_quant) and x.dtype in (torch.bfloat16, torch.float32) and x.numel() == x.shape[-1]
            and weight.dim() == 2 and weight.stride(-1) == 1 and weight.shape[-1] % 16 == 0
            and weight.stride(0) % 16 == 0 and weight.data_ptr() % 16 == 0)


def frag_gemv_supported(device: torch.device) -> bool:
    """Whether the fragment GEMV's arithmetic exists on `device` (`grouped_frag.frag_supported`: CPU under the
    interpreter, meta, or CUDA with compute capability 8.9+ for the FP8 `mma.sync`)."""
    return frag_supported(device)


@triton.jit
def _weight_span(w_lo, s_band, blk0, t, wi, nkb, ok_lo, ok_hi, stride_wn, EVEN: tl.constexpr, live):
    # What a warp reads of the weight for the span from block blk0 ([32 W] lanes): words [32 W, 4] (words 0-3 and
    # 4-7) of blocks t / t + 4 of rows g / g + 8, and the weight scales of blocks 2t / 2t + 1 as FP32 2^(s - 127)
    # (byte 0 is 0.0, as formats.ue8m0_to_float). Constant across steps: read before the PDL wait.
    off_a = (blk0 + t)[:, None] * 8 + wi
    off_b = off_a + 32
    w_hi = w_lo + 8 * stride_wn
    blk_s = blk0 + 2 * t
    if EVEN:
        # `live` (a scalar) is False only for the prefetch after the last span.
        m_alo = live
        m_blo = live
        m_ahi = live
        m_bhi = live
        m_s0 = live
        m_s1 = live
    else:
        m_a = (blk0 + t < nkb)[:, None]
        m_b = (blk0 + t + 4 < nkb)[:, None]
        m_alo = m_a & ok_lo[:, None]
        m_blo = m_b & ok_lo[:, None]
        m_ahi = m_a & ok_hi[:, None]
        m_bhi = m_b & ok_hi[:, None]
        m_s0 = (blk_s < nkb) & ok_lo
        m_s1 = (blk_s + 1 < nkb) & ok_lo
    alo0 = tl.load(w_lo[:, None] + off_a, mask=m_alo, other=0)
    alo1 = tl.load(w_lo[:, None] + off_a + 4, mask=m_alo, other=0)
    blo0 = tl.load(w_lo[:, None] + off_b, mask=m_blo, other=0)
    blo1 = tl.load(w_lo[:, None] + off_b + 4, mask=m_blo, other=0)
    ahi0 = tl.load(w_hi[:, None] + off_a, mask=m_ahi, other=0)
    ahi1 = tl.load(w_hi[:, None] + off_a + 4, mask=m_ahi, other=0)
    bhi0 = tl.load(w_hi[:, None] + off_b, mask=m_bhi, other=0)
    bhi1 = tl.load(w_hi[:, None] + off_b + 4, mask=m_bhi, other=0)
    # One byte per load: a [32 W, 2] load of unproven alignment would get a layout of two lanes per pair.
    sw0 = exp2_int(tl.load(s_band + blk_s, mask=m_s0, other=0).to(tl.int32))
    sw1 = exp2_int(tl.load(s_band + blk_s + 1, mask=m_s1, other=0).to(tl.int32))
    return alo0, alo1, blo0, blo1, ahi0, ahi1, bhi0, bhi1, sw0, sw1


@triton.jit
def _x_span(xq_ptr, xs_ptr, blk0, g, t, wi, nkb, x_b0, x_b1, EVEN: tl.constexpr, live):
    # What a warp reads of the activations for the span from block blk0: x's words 0-3 / 4-7 of block g on the
    # lanes that supply b0 (x_b0) and b1 (x_b1), zeros elsewhere ([32 W, 4] each), and the activation scales of
    # blocks 2t / 2t + 1 ([32 W] FP32). Written by the previous launch: read after the PDL wait.
    blk_x = blk0 + g
    x_ptrs = xq_ptr + blk_x[:, None] * 8 + wi
    blk_s = blk0 + 2 * t
    if EVEN:
        m_x0 = x_b0[:, None] & live
        m_x1 = x_b1[:, None] & live
        m_s0 = live
        m_s1 = live
    else:
        m_x0 = ((blk_x < nkb) & x_b0)[:, None]
        m_x1 = ((blk_x < nkb) & x_b1)[:, None]
        m_s0 = blk_s < nkb
        m_s1 = blk_s + 1 < nkb
    # Two loads per register with disjoint lane masks instead of a select per MMA.
    x0a = tl.load(x_ptrs, mask=m_x0, other=0)
    x0b = tl.load(x_ptrs + 4, mask=m_x0, other=0)
    x1a = tl.load(x_ptrs, mask=m_x1, other=0)
    x1b = tl.load(x_ptrs + 4, mask=m_x1, other=0)
    sx0 = tl.load(xs_ptr + blk_s, mask=m_s0, other=0.0)
    sx1 = tl.load(xs_ptr + blk_s + 1, mask=m_s1, other=0.0)
    return x0a, x0b, x1a, x1b, sx0, sx1


@triton.jit
def _span_sums(wv, xv, W: tl.constexpr, ASM: tl.constexpr):
    # (row g, row g + 8) [32 W] FP32: this lane's two scaled block sums of the span per row. MMA p takes word p of
    # every block (the eight are written out: no loop variable indexing a tuple, which Triton 3.6's interpreter
    # rejects).
    alo0, alo1, blo0, blo1, ahi0, ahi1, bhi0, bhi1, sw0, sw1 = wv
    x0a, x0b, x1a, x1b, sx0, sx1 = xv
    al0, al1, al2, al3 = split4(alo0, W)
    al4, al5, al6, al7 = split4(alo1, W)
    bl0, bl1, bl2, bl3 = split4(blo0, W)
    bl4, bl5, bl6, bl7 = split4(blo1, W)
    ah0, ah1, ah2, ah3 = split4(ahi0, W)
    ah4, ah5, ah6, ah7 = split4(ahi1, W)
    bh0, bh1, bh2, bh3 = split4(bhi0, W)
    bh4, bh5, bh6, bh7 = split4(bhi1, W)
    p0, p1, p2, p3 = split4(x0a, W)
    p4, p5, p6, p7 = split4(x0b, W)
    q0, q1, q2, q3 = split4(x1a, W)
    q4, q5, q6, q7 = split4(x1b, W)
    d0 = tl.zeros([32 * W], dtype=tl.float32)
    d1 = d0
    d2 = d0
    d3 = d0
    d0, d1, d2, d3 = frag_mma(al0, ah0, bl0, bh0, p0, q0, d0, d1, d2, d3, W, ASM)
    d0, d1, d2, d3 = frag_mma(al1, ah1, bl1, bh1, p1, q1, d0, d1, d2, d3, W, ASM)
    d0, d1, d2, d3 = frag_mma(al2, ah2, bl2, bh2, p2, q2, d0, d1, d2, d3, W, ASM)
    d0, d1, d2, d3 = frag_mma(al3, ah3, bl3, bh3, p3, q3, d0, d1, d2, d3, W, ASM)
    d0, d1, d2, d3 = frag_mma(al4, ah4, bl4, bh4, p4, q4, d0, d1, d2, d3, W, ASM)
    d0, d1, d2, d3 = frag_mma(al5, ah5, bl5, bh5, p5, q5, d0, d1, d2, d3, W, ASM)
    d0, d1, d2, d3 = frag_mma(al6, ah6, bl6, bh6, p6, q6, d0, d1, d2, d3, W, ASM)
    d0, d1, d2, d3 = frag_mma(al7, ah7, bl7, bh7, p7, q7, d0, d1, d2, d3, W, ASM)
    c0 = sw0 * sx0
    c1 = sw1 * sx1
    return d0 * c0 + d1 * c1, d2 * c0 + d3 * c1


@triton.jit
def _frag_gemv_kernel(
    xq_ptr, xs_ptr, w0, s0, y0, w1, s1, y1, w2, s2, y2, w3, s3, y3, part_ptr, cnt_ptr, K, N0, N1, N2, N3,
    sw0, sw1, sw2, sw3, ss0, ss1, ss2, ss3,
    COUNT: tl.constexpr, ITERS: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr, W: tl.constexpr,
    PREFETCH: tl.constexpr, EVEN: tl.constexpr, USE_PDL: tl.constexpr, ASM: tl.constexpr,
):
    # Program (W row tiles, K split) of W warps; weights as int32 words (row strides sw_i in words). Tensors [32 W]
    # hold one value per thread: element i is lane i % 32 of warp i // 32 (`grouped_frag._grouped_frag_kernel`).
    # COUNT weights of one x: programs [0, P1) compute weight 0, [P1, P2) weight 1, ... (P_i from the widths; unused
    # slots of a COUNT < 4 launch repeat weight 0 and are never picked).
    pid_g = tl.program_id(0)
    if COUNT > 1:
        c1, c2, c3, pid_n, col0 = weight_slot(pid_g, N0, N1, N2, 16 * W, COUNT)
        w_ptr = pick_operand(c1, c2, c3, w0, w1, w2, w3, COUNT)
        s_ptr = pick_operand(c1, c2, c3, s0, s1, s2, s3, COUNT)
        y_ptr = pick_operand(c1, c2, c3, y0, y1, y2, y3, COUNT)
        N = pick_operand(c1, c2, c3, N0, N1, N2, N3, COUNT)
        stride_wn = pick_operand(c1, c2, c3, sw0, sw1, sw2, sw3, COUNT)
        stride_sn = pick_operand(c1, c2, c3, ss0, ss1, ss2, ss3, COUNT)
    else:
        w_ptr = w0
        s_ptr = s0
        y_ptr = y0
        N = N0
        stride_wn = sw0
        stride_sn = ss0
        pid_n = pid_g
        col0 = pid_g * 0
    pid_k = tl.program_id(1)
    li = tl.arange(0, 32 * W)
    warp = li // 32
    lane = li % 32
    g = lane // 4
    t = lane % 4
    wi = tl.arange(0, 4)[None, :]
    row0 = (pid_n * W + warp) * 16
    row_lo = row0 + g
    ok_lo = row_lo < N
    ok_hi = row_lo + 8 < N
    w_lo = w_ptr + row_lo.to(tl.int64) * stride_wn
    # A 16-row tile starts at a multiple of 16, so its rows share one 32-row scale band.
    s_band = s_ptr + (row0 // 32).to(tl.int64) * stride_sn
    x_lane = (g % 4) == t
    x_b0 = x_lane & (g < 4)
    x_b1 = x_lane & (g >= 4)
    nkb = K // 32
    acc_lo = tl.zeros([32 * W], dtype=tl.float32)
    acc_hi = tl.zeros([32 * W], dtype=tl.float32)
    blk = pid_k * ITERS * 8
    if PREFETCH:
        # The first span's weights before the wait (they overlap the previous kernel); afterwards the next span's
        # loads are issued before this span's MMAs. The trip after the last reads nothing (`live` False).
        wn = _weight_span(w_lo, s_band, blk, t, wi, nkb, ok_lo, ok_hi, stride_wn, EVEN, True)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        xn = _x_span(xq_ptr, xs_ptr, blk, g, t, wi, nkb, x_b0, x_b1, EVEN, True)
        for it in tl.range(0, ITERS, num_stages=1):
            wc = wn
            xc = xn
            nxt = blk + (it + 1) * 8
            live = it + 1 < ITERS
            # The masked loads take `live` through their K limit (the interpreter mis-types scalar-bool &
            # block-bool).
            lim = tl.where(live, nkb, 0)
            wn = _weight_span(w_lo, s_band, nxt, t, wi, lim, ok_lo, ok_hi, stride_wn, EVEN, live)
            xn = _x_span(xq_ptr, xs_ptr, nxt, g, t, wi, lim, x_b0, x_b1, EVEN, live)
            lo, hi = _span_sums(wc, xc, W, ASM)
            acc_lo += lo
            acc_hi += hi
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        for it in tl.range(0, ITERS, num_stages=1):
            cur = blk + it * 8
            lo, hi = _span_sums(_weight_span(w_lo, s_band, cur, t, wi, nkb, ok_lo, ok_hi, stride_wn, EVEN, True),
                                _x_span(xq_ptr, xs_ptr, cur, g, t, wi, nkb, x_b0, x_b1, EVEN, True), W, ASM)
            acc_lo += lo
            acc_hi += hi
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    lo8 = tl.sum(tl.reshape(acc_lo, [W, 8, 4]), axis=2)
    hi8 = tl.sum(tl.reshape(acc_hi, [W, 8, 4]), axis=2)
    # Row w 16 + h 8 + g of the program: [W, 8, 2] -> [W, 2, 8].
    acc = tl.reshape(tl.permute(tl.join(lo8, hi8), (0, 2, 1)), [1, 16 * W])
    offs_n = pid_n * (16 * W) + tl.arange(0, 16 * W)
    # Weight i's split-K partials: their own [SPLIT_K, N_i] region of the workspace; counters by global program.
    store_gemv_result(acc, y_ptr, part_ptr + col0.to(tl.int64) * SPLIT_K, cnt_ptr, tl.arange(0, 1), offs_n,
                       offs_n < N, 0, pid_g, pid_k, 1, N, N, SPLIT_K, SPLIT_POW2)


def launch_frag_gemv(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, plan: dict, empty,
                     pdl_allowed: bool = True, norm: tuple | None = None) -> torch.Tensor:
    """y [1, N] (x's dtype) = fq8(x2) @ dequant(weight)^T with `plan` (`frag_gemv_plan`): two launches, the
    activation preparation (`grouped_frag.prepare_frag_x`, K order) and the fragment GEMV, both PDL-launched where
    the device takes PDL and `pdl_allowed` (the caller passes False when it copied the weight or scale just before:
    the GEMV reads them before its wait). `norm` (norm weight or None, eps, mode): the activation launch
    RMS-normalises x2 first (`grouped_frag.prepare_frag_x`).

    x2 [1, K] bf16 / fp32 contiguous along K, K % 32 == 0; weight uint8 [N, K] E4M3 (`frag_gemv_eligible`); scale
    uint8 [ceil(N/32), K/32] UE8M0, contiguous along K. `empty(shape, dtype, device)` allocates the results and the
    split-K workspace. Raises ValueError for arguments the kernel cannot take (named); the op's own argument checks
    are `quant_gemv._check_args`.
    """
    return launch_frag_gemv_multi(x2, [weight], [scale], plan, empty, pdl_allowed, norm)[0]


def launch_frag_gemv_multi(x2: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor], plan: dict,
                           empty, pdl_allowed: bool = True, norm: tuple | None = None) -> list[torch.Tensor]:
    """[y_i [1, N_i]] = [fq8(x2) @ dequant(W_i)^T] for 1 to 4 weights of one K in one activation launch and one
    GEMV launch (`launch_frag_gemv` for the arguments; `plan` from `frag_gemv_plan` of the summed N). Weight i takes
    ceil(N_i / (16 W)) programs of the grid, so each program computes one weight; the plan's EVEN holds only where
    every N_i is a multiple of 16 W (else the masked loads run). Raises ValueError as `launch_frag_gemv`, and for a
    count outside 1..4 or weights of different K.
    """
    if not 1 <= len(weights) <= 4 or len(scales) != len(weights):
        raise ValueError(f"1 to 4 weights with one scale each; got {len(weights)} weights and {len(scales)} scales")
    if x2.dim() != 2 or x2.shape[0] != 1 or x2.dtype not in (torch.bfloat16, torch.float32) or x2.stride(-1) != 1:
        raise ValueError(f"x must be one bf16 / fp32 row contiguous along K; got {tuple(x2.shape)} {x2.dtype} with "
                         f"strides {x2.stride()}")
    k = x2.shape[1]
    for i, (w, s) in enumerate(zip(weights, scales)):
        what = "weight" if len(weights) == 1 else f"weights[{i}]"
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"{what} {tuple(w.shape)} does not match K = {k}")
        if not frag_gemv_eligible(x2, w, True):
            raise ValueError(f"{what} {tuple(w.shape)} with strides {w.stride()} cannot be read as 16-byte vectors "
                             "(needs contiguous K, K and the row stride multiples of 16 bytes, a 16-byte aligned "
                             "address)")
        if s.stride(-1) != 1:
            raise ValueError(f"the scale of {what} must be contiguous along K; got strides {s.stride()}")
    widths = [w.shape[0] for w in weights]
    warps = plan["num_warps"]
    programs = sum(-(-n // (16 * warps)) for n in widths)
    pdl = use_pdl_for(_frag_gemv_kernel, x2.device) and pdl_allowed
    # The GEMV reads only the weights and their scales (constants) before its wait and triggers its dependents
    # after it, which is what an early activation launch needs.
    xq, xs = prepare_frag_x(x2, empty, pdl, part_order=False, early=plan["EARLY_LAUNCH"], norm=norm)
    ys = [empty((1, n), x2.dtype, x2.device) for n in widths]
    if programs == 0:
        return ys
    part, cnt = split_k_workspace(empty, x2.device, plan["SPLIT_K"], (1, sum(widths)), programs)
    pad = 4 - len(weights)
    words = [w.view(torch.int32) for w in weights]
    ws, ss, yy, nn = words + [words[0]] * pad, list(scales) + [scales[0]] * pad, ys + [ys[0]] * pad, widths + [0] * pad
    even = plan["EVEN"] and all(n % (16 * warps) == 0 for n in widths)
    extra = {"launch_pdl": True} if pdl else {}
    if plan["MAXNREG"] is not None:
        extra["maxnreg"] = plan["MAXNREG"]
    _frag_gemv_kernel[(programs, plan["SPLIT_K"])](
        xq.view(torch.int32), xs, ws[0], ss[0], yy[0], ws[1], ss[1], yy[1], ws[2], ss[2], yy[2], ws[3], ss[3], yy[3],
        part, cnt, k, *nn, *(w.stride(0) for w in ws), *(s.stride(0) for s in ss),
        COUNT=len(weights), ITERS=plan["ITERS"], SPLIT_K=plan["SPLIT_K"], SPLIT_POW2=plan["SPLIT_POW2"], W=warps,
        PREFETCH=plan["PREFETCH"], EVEN=even, USE_PDL=pdl, ASM=not is_interpreted(_frag_gemv_kernel),
        num_warps=warps, **extra)
    return ys
