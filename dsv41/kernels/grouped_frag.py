"""Grouped FP4 expert GEMV on the tensor cores, the E2M1 codes decoded to E4M3 straight into `mma.sync` fragments.

Why. The CUDA-core kernels of the grouped expert GEMV are bound by instructions, not by memory: at the h200 shapes
the word-decode kernel (`grouped_words`) issues 5.6 instructions per FP4 code and reaches 28 % of copy bandwidth
(bench/results/2026-12-01_h200_s19). Tensor-core attempts through `tl.dot` / `tl.dot_scaled` (`grouped_mma`)
lost their gain to the register -> shared-memory -> fragment round trip Triton puts in front of every MMA whose
operand was computed in registers. Here each thread loads exactly the bytes its own `mma.sync` fragment needs,
decodes them in registers and issues the MMA itself (inline PTX): no shared memory, about one integer operation
per code.

The layout (PTX ISA, "Matrix fragments for mma.m16n8k32" with 8-bit A / B; lane = 4 g + t):
- A (16 weight rows x 32 k-slots, E4M3): a0 / a2 hold row g, k-slots 4t + i / 16 + 4t + i (i = 0..3, one byte
  each); a1 / a3 the same for row g + 8. B (32 k-slots x 8 columns): b0 / b1 hold column g, k-slots 4t + i /
  16 + 4t + i. D (16 x 8, FP32): d0, d1 row g, columns 2t, 2t + 1; d2, d3 row g + 8.
- A dot product is invariant under any permutation of k that A and B share, so the k-slots need not follow K.
  A warp steps over K in spans of 256 codes (8 blocks of 32). Column n of B is block n of the span: it holds that
  block's activations in the k-slots whose A bytes came from block n, zeros elsewhere. Thread t decodes its a0 / a1
  bytes from block t and its a2 / a3 bytes from block t + 4 (16-byte loads: one per row and block), so lane
  (g, t) with g % 4 == t supplies column g's activations (b0 for g < 4, b1 for g >= 4) and every other lane zeros.
  Eight MMAs, each taking 4 codes of every block (part p: word p // 2 of the block, its low nibbles for even p,
  its high nibbles for odd p), accumulate D[r][n] = the dot product of row r with block n, complete for all 16
  rows and 8 blocks.
- Decode: a nibble s e1 e0 m becomes the E4M3 byte s 0 0 e1 e0 m 0 0, which is exactly the E2M1 value times
  2^-6 (subnormal codes included): two shifts and two masks per 4 codes. 2^6 goes back with the scales.
- Scales: lane (g, t) multiplies D[g][2t + j] and D[g + 8][2t + j] by the weight's UE8M0 scale of that row and
  block and by the activation block's scale, and adds them to its FP32 accumulators. After the loop the four
  lanes of a row and the program's warps are summed (deterministic order), and `grouped_gemv.grouped_store`
  writes y (K splits merged through its arrival counters, NaN rows for an invalid expert).
- Activations (`prepare_frag_x`): one small launch first FP8-quantises x by 1x32 blocks (`formats.quantize_fp8_1x32`
  through `quant_gemv.fp8_1x32_parts`) and writes the E4M3 bytes of each block in part order (part p, byte i =
  code 8 (p // 2) + 2 i + p % 2) with the block scales as FP32, so the active lanes read their B words as 16-byte
  vectors.

Program (n-tile of 16 rows, K split, pair) of NUM_WARPS warps; warp w of split j takes spans
it * NUM_WARPS * SPLIT_K + j * NUM_WARPS + w (it < ITERS). Where every warp's spans lie inside K and every row
tile inside the weight (EVEN, the h200 shapes), the K loop's loads carry no per-lane masks: 20 fewer compares per
span, 62 instead of 78 registers at four warps (offline sm_90 build), 13 % less time at w1 / w3. Under the
interpreter the MMA is emulated with tensor operations on the same per-lane registers (`_mma_emulated`), which checks
the fragment bookkeeping on the CPU; the inline PTX needs sm_89 or later (FP8 `mma.sync`).

Numerics: only act_quant (FP8 activations; the reference fake-quantises every FP4 GEMM input that way). Codes,
activations and scales are exact; each product of a code and an activation is exact; the MMA adds the 32 products
of a block with the tensor core's FP32 accumulation (on Hopper not IEEE round-to-nearest at every add: a few units
of 2^-23 of the block sum), the block sums are scaled and added in FP32 in another order than the reference's
matmul, then rounded once to x's dtype (bf16 / fp32; fp16 x stays on `grouped_gemv`'s tile kernel, which repeats
the reference's fp16 roundings). A UE8M0 weight scale byte of 0 is a zero scale (`formats.ue8m0_to_float`); bytes
near 255 can overflow the FP32 product of a block sum and its scales to inf where the reference's result is finite
(as in `grouped_gemv`'s other kernels). A NaN activation makes its block's E4M3 byte NaN, so every output row is NaN,
as in the reference.

Op: none of its own. `grouped_gemv.triton_grouped_linear_fp4` launches it (`frag=True`, or by default where
`grouped_gemv.takes_frag_by_default`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_int_options, exp2_int, is_interpreted, next_power_of_2, use_pdl_for
from .gemv_tiles import fp8_1x32_parts, grouped_store, pair_expert, rms_apply, row_rstd
from .grouped_words import x_blocks

__all__ = ["grouped_frag_plan", "frag_eligible", "frag_supported", "prepare_frag_x", "launch_grouped_frag",
           "FRAG_KEYS", "FRAG_ONLY_KEYS", "SPAN", "paired_launch_fits"]

#: Codes of K one warp covers per step: 8 blocks of 32, the 8 columns of one m16n8k32 MMA.
SPAN = 256
#: Rows per program: the MMA's M.
_ROWS = 16
#: Most warps per program by default (`grouped_frag_plan`).
_NUM_WARPS = 4
#: Override keys of `triton_grouped_linear_fp4` that shape this plan (besides `frag` itself and `sm_count`).
FRAG_KEYS = ("num_warps", "split_k", "prefetch", "maxnreg", "even")
#: Those of `FRAG_KEYS` no other kernel of `triton_grouped_linear_fp4` takes (`prefetch` is also the row-streaming
#: kernel's, `num_warps` and `maxnreg` the tile kernel's too).
FRAG_ONLY_KEYS = ("split_k", "even")
#: Default register cap per thread by warps per program of the masked kernel (`grouped_frag_plan`; absent, and for
#: the unmasked EVEN kernel: the compiler's choice). Four-warp programs: Triton 3.6 gives 82 registers, so 5 programs
#: fit an H200 SM and the h200 w1 / w3 grid (864 programs) runs in 1.31 waves (ncu, bench/results/2026-12-02_h200_s22);
#: capped at 72, 7 fit (one wave) and the launch took 20.31 against 21.31 us in the same run (64: 20.44 us), with 10
#: bytes of spills. One- and two-warp programs were slower with any cap (1 warp, prefetch, w2: 19.40 us uncapped,
#: 21.15-26.19 us capped). Triton 3.9 (offline sm_90 build, not run on a GPU) gives 80 registers uncapped and spills
#: a 40-byte stack at the cap. The EVEN kernel takes 64 registers under Triton 3.6 (62 under 3.9) with no cap and no
#: spill; capped at 64 or 56 it spilled and was slower (19.07 / 18.83 against 17.56 us,
#: bench/results/2026-12-02_h200_s23).
MAXNREG_DEFAULT: dict[int, int] = {4: 72}
#: Codes of K per program of the activation preparation kernel.
_PREP_BLOCK = 1024


def grouped_frag_plan(pairs: int, n: int, k: int, *, num_warps: int | None = None, split_k: int | None = None,
                      prefetch: bool | None = None, maxnreg: int | None = None, even: bool | None = None,
                      sm_count: int | None = None) -> dict:
    """Launch parameters of the fragment kernel for `pairs` (token, expert) pairs of an [n, k] FP4 weight.

    16 rows per program (the MMA's M); num_warps warps per program, each a share of the program's 256-code spans
    (default: the largest of 4, 2, 1 that divides the spans, so with one K split no warp idles in the last step);
    split_k (default 1) programs along K per 16 rows. ITERS = ceil(spans / (num_warps * split_k)) steps per warp;
    PREFETCH (prefetch, default: with one warp per program) issues the next span's loads before this span's MMAs
    (a register double buffer); EVEN (even, default: where the shape allows it) drops the per-lane masks of the K
    loop's loads, which needs K a multiple of 256, the spans a multiple of num_warps * split_k (no warp past K) and
    n a multiple of 16 (no partial row tile); MAXNREG (maxnreg, registers per thread; default
    `MAXNREG_DEFAULT[num_warps]` for the masked kernel, else the compiler's choice); grid (ceil(n / 16), split_k,
    pairs). At the h200 shapes, both EVEN: w1 / w3 (2304 x 5120, 6 pairs, 20 spans) 144 x 1 x 6 = 864 programs of 4
    warps, 5 spans per warp; w2 (5120 x 2304, 9 spans) 320 x 1 x 6 programs of one warp, prefetching. Measured on the
    H200 (PDL, CUDA-graph replay; the activation launch included), bench/results/2026-12-02_h200_s23: w1 / w3 17.56 us
    (50.6 % of copy bandwidth) against 20.28 us masked with the cap, w2 (fp32 x) 19.62 against 19.95 us; 8 other EVEN
    plans 18.8-26.8 us. Earlier plans: bench/results/2026-12-02_h200_s21 and _s22.
    `sm_count` is accepted and unused.
    Returns a dict with SPANS, ITERS, SPLIT_K, SPLIT_POW2, PREFETCH, EVEN, MAXNREG, num_warps and grid.
    Raises: ValueError for a value that is not an int (prefetch, even: not a bool), num_warps not in 1, 2, 4, 8,
    split_k < 1 or above 65535, maxnreg outside 24..255, even=True for a shape that does not allow it.
    """
    for key, val in (("prefetch", prefetch), ("even", even)):
        if val is not None and not isinstance(val, bool):
            raise ValueError(f"{key}={val!r} must be a bool")
    check_int_options(num_warps=num_warps, split_k=split_k, maxnreg=maxnreg, sm_count=sm_count)
    spans = max(1, -(-k // SPAN))
    if num_warps is None:
        num_warps = next(w for w in (_NUM_WARPS, 2, 1) if spans % w == 0)
    prefetch = (num_warps == 1) if prefetch is None else prefetch
    split_k = 1 if split_k is None else split_k
    if num_warps not in (1, 2, 4, 8):
        raise ValueError(f"num_warps={num_warps} must be 1, 2, 4 or 8")
    if not 1 <= split_k <= 65535:
        raise ValueError(f"split_k={split_k} must be in 1..65535")
    fits = k > 0 and k % SPAN == 0 and spans % (num_warps * split_k) == 0 and n % _ROWS == 0
    if even is None:
        even = fits
    elif even and not fits:
        raise ValueError(f"even=True needs K % {SPAN} == 0, the {spans} spans a multiple of num_warps * split_k = "
                         f"{num_warps * split_k} and the {n} rows a multiple of {_ROWS}")
    if maxnreg is None:
        maxnreg = None if even else MAXNREG_DEFAULT.get(num_warps)
    elif not 24 <= maxnreg <= 255:
        raise ValueError(f"maxnreg={maxnreg} must be in 24..255 (registers per thread)")
    iters = -(-spans // (num_warps * split_k))
    return dict(SPANS=spans, ITERS=iters, SPLIT_K=split_k, SPLIT_POW2=next_power_of_2(split_k), PREFETCH=prefetch,
                MAXNREG=maxnreg, EVEN=even, num_warps=num_warps,
                grid=(-(-n // _ROWS), split_k, pairs))


def frag_eligible(x: torch.Tensor, weight: torch.Tensor, act_quant: bool) -> bool:
    """Whether `launch_grouped_frag` computes these arguments' numbers: act_quant, x bf16 or fp32, and a packed
    weight [E, out, K/2] readable as 16-byte vectors (contiguous along K, K/2 and both outer strides multiples of
    16 bytes, 16-byte aligned address)."""
    return bool(act_quant) and x.dtype in (torch.bfloat16, torch.float32) and _vector_readable(weight)


def _vector_readable(weight: torch.Tensor) -> bool:
    # [E, out, K/2] bytes readable in place as 16-byte vectors.
    return (weight.dim() == 3 and weight.stride(-1) == 1 and weight.shape[-1] % 16 == 0
            and weight.stride(0) % 16 == 0 and weight.stride(1) % 16 == 0 and weight.data_ptr() % 16 == 0)


def frag_supported(device: torch.device) -> bool:
    """Whether the fragment kernel's arithmetic is available on `device`: CPU (where only the interpreter launches
    it; the launcher raises otherwise), meta tensors (the launch census models the H200), or CUDA with compute
    capability 8.9 or later (FP8 `mma.sync.m16n8k32`)."""
    if device.type != "cuda":
        return device.type in ("cpu", "meta")
    return torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def _e4m3_bits(q):
    # E4M3 byte (int32) of fp32 q holding an E4M3 value (|q| <= 448) or NaN (0x7F); built from the bits, because
    # the interpreter's fp32 -> float8e4nv cast rounds wrongly (_common's module docstring). -0.0 keeps its sign.
    a = tl.abs(q)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((((bits >> 23) - 120) << 3) | ((bits >> 20) & 7))
    sub = (a * 512.0).to(tl.int32)
    mag = tl.where(a >= 0.015625, normal, sub)
    mag = tl.where(q != q, 0x7F, mag)
    return tl.where(q.to(tl.int32, bitcast=True) < 0, mag | 0x80, mag)


@triton.jit
def _frag_x_kernel(x_ptr, q_ptr, s_ptr, nw_ptr, eps, K, stride_xr, BLOCK: tl.constexpr, PART_ORDER: tl.constexpr,
                   USE_PDL: tl.constexpr, EARLY: tl.constexpr, NORM: tl.constexpr = 0, KP: tl.constexpr = 32):
    # Program (K chunk, row): E4M3 bytes of formats.quantize_fp8_1x32(x[row]) in part order (module docstring;
    # PART_ORDER False: in K order, for the block-FP8 kernel of `gemv_frag`) and the block scales 2^(e - 127) as
    # FP32. NORM (1-6): x[row] RMS-normalised first (`gemv_tiles.row_rstd` over the whole row, read by every
    # program, and `rms_apply` with the weight nw_ptr [K]).
    NB: tl.constexpr = BLOCK // 32
    row, kb, c, offs, ok, xv = x_blocks(x_ptr, K, stride_xr, BLOCK, USE_PDL, EARLY)
    if NORM != 0:
        r = tl.sum(row_rstd(x_ptr + row * stride_xr, tl.arange(0, 1), 1, K, 0, eps, KP), axis=0)
        if NORM != 3 and NORM != 6:
            nw = tl.load(nw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        else:
            nw = 1.0
        xv = rms_apply(xv, r, nw, NORM, x_ptr.dtype.element_ty)
    q, e = fp8_1x32_parts(xv)
    if PART_ORDER:
        pos = (c // 8) * 8 + (c % 2) * 4 + (c % 8) // 2
    else:
        pos = c
    tl.store(q_ptr + row * K + kb[:, None] * 32 + pos[None, :], _e4m3_bits(q).to(tl.uint8), mask=ok)
    tl.store(s_ptr + row * (K // 32) + kb, tl.reshape(exp2_int(e), [NB]), mask=kb * 32 < K)


@triton.jit
def split4(v, W: tl.constexpr):
    """The four int32 words of a thread's 16-byte vector, split out (shared with `gemv_frag`)."""
    # The four int32 words of [32 W, 4] `v` (a thread's own 16-byte vector) as [32 W] tensors.
    a, b = tl.split(tl.reshape(v, [32 * W, 2, 2]))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _e4m3_of_nibbles(w, HIGH: tl.constexpr):
    # The low (HIGH False) or high nibbles of the four bytes of uint32 words `w` as four E4M3 bytes, each exactly
    # its E2M1 value times 2^-6: s e1 e0 m -> s 0 0 e1 e0 m 0 0.
    if HIGH:
        return ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)
    return ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)


@triton.jit
def _e4m3_value(b):
    # FP32 value of E4M3 byte b (int32 0..255; 0x7F / 0xFF are NaN).
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    return tl.where(b >= 128, -v, v)


@triton.jit
def _lane_bytes(v, W: tl.constexpr):
    # The four bytes of each lane's word ([32 W]) as FP32 values [W, 8, 4, 4] indexed (warp, lane // 4, lane % 4,
    # byte).
    shift = tl.arange(0, 4) * 8
    return tl.reshape(_e4m3_value((v[:, None] >> shift[None, :]) & 255), [W, 8, 4, 4])


@triton.jit
def _frag_dot(a, b, W: tl.constexpr):
    # [W, 8 rows, 8 columns]: the contribution of one A register and one B register (the same k-slots) to D, the
    # sum over t and the byte i of a[w, row, t, i] * b[w, column, t, i].
    pa = _lane_bytes(a, W)
    pb = _lane_bytes(b, W)
    return tl.sum(tl.sum(pa[:, :, None, :, :] * pb[:, None, :, :, :], axis=4), axis=3)


@triton.jit
def _to_lanes(d, W: tl.constexpr):
    # D [W, 8 rows g, 8 columns] -> (D[g][2t], D[g][2t + 1]) as [32 W] per lane 4 g + t of each warp.
    even, odd = tl.split(tl.reshape(d, [W, 8, 4, 2]))
    return tl.reshape(even, [32 * W]), tl.reshape(odd, [32 * W])


@triton.jit
def _mma_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, W: tl.constexpr):
    # mma.sync.m16n8k32 E4M3 -> FP32 of the warps' registers ([32 W] int32 per register), as tensor operations.
    d_lo = _frag_dot(a0, b0, W) + _frag_dot(a2, b1, W)
    d_hi = _frag_dot(a1, b0, W) + _frag_dot(a3, b1, W)
    e0, e1 = _to_lanes(d_lo, W)
    e2, e3 = _to_lanes(d_hi, W)
    return c0 + e0, c1 + e1, c2 + e2, c3 + e3


@triton.jit
def frag_mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, W: tl.constexpr, ASM: tl.constexpr):
    """One m16n8k16 bf16 MMA on register fragments (inline PTX when ASM, else its arithmetic), accumulating into
    c0..c3 in FP32 (shared with `gemv_frag`)."""
    if ASM:
        # Not pure: a pure elementwise op may be recomputed in another layout to save a layout conversion, and this
        # one is only right where element i sits in lane i % 32 of warp i // 32.
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=False, pack=1)
    return _mma_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, W)


@triton.jit
def _span_load(w_lo, w_hi, s_lo, s_hi, xq_row, xs_row, blk0, nkb, g, t, ok_lo, ok_hi, x_b0, x_b1, wi,
               EVEN: tl.constexpr, live):
    # Everything a warp reads for the span of 8 blocks from block blk0 [32 W]: weight words [32 W, 4] of rows
    # g / g + 8 and blocks t / t + 4; the B words [32 W, 4] of parts 0-3 and 4-7 for b0 (lanes g == t < 4) and
    # b1 (lanes g == t + 4), zeros elsewhere; the weight scales of blocks 2t, 2t + 1 of both rows as FP32
    # 2^(s - 127) (byte 0 is 0.0, as formats.ue8m0_to_float) and the activation scales times 2^6 (the decode's
    # 2^-6), [32 W] each.
    blk_a = blk0 + t
    blk_b = blk_a + 4
    off_a = blk_a[:, None] * 4 + wi
    off_b = blk_b[:, None] * 4 + wi
    blk_x = blk0 + g
    x_ptrs = xq_row + blk_x[:, None] * 8 + wi
    blk_s = blk0 + 2 * t
    if EVEN:
        # Every block of every span is inside K and every row inside the weight (an invalid expert reads expert 0,
        # whose rows `grouped_store` replaces by NaN): no masks but `live` (a scalar, False only for the prefetch
        # after the last span) and the lanes that supply B.
        m_wa_lo = live
        m_wb_lo = live
        m_wa_hi = live
        m_wb_hi = live
        m_x0 = x_b0[:, None] & live
        m_x1 = x_b1[:, None] & live
        m_sl0 = live
        m_sl1 = live
        m_sh0 = live
        m_sh1 = live
        m_s0 = live
        m_s1 = live
    else:
        m_a = (blk_a < nkb)[:, None]
        m_b = (blk_b < nkb)[:, None]
        m_wa_lo = m_a & ok_lo[:, None]
        m_wb_lo = m_b & ok_lo[:, None]
        m_wa_hi = m_a & ok_hi[:, None]
        m_wb_hi = m_b & ok_hi[:, None]
        m_x0 = ((blk_x < nkb) & x_b0)[:, None]
        m_x1 = ((blk_x < nkb) & x_b1)[:, None]
        m_s0 = blk_s < nkb
        m_s1 = blk_s + 1 < nkb
        m_sl0 = m_s0 & ok_lo
        m_sl1 = m_s1 & ok_lo
        m_sh0 = m_s0 & ok_hi
        m_sh1 = m_s1 & ok_hi
    wa_lo = tl.load(w_lo[:, None] + off_a, mask=m_wa_lo, other=0)
    wb_lo = tl.load(w_lo[:, None] + off_b, mask=m_wb_lo, other=0)
    wa_hi = tl.load(w_hi[:, None] + off_a, mask=m_wa_hi, other=0)
    wb_hi = tl.load(w_hi[:, None] + off_b, mask=m_wb_hi, other=0)
    # Two loads per register with disjoint lane masks instead of a select per MMA.
    x0a = tl.load(x_ptrs, mask=m_x0, other=0)
    x0b = tl.load(x_ptrs + 4, mask=m_x0, other=0)
    x1a = tl.load(x_ptrs, mask=m_x1, other=0)
    x1b = tl.load(x_ptrs + 4, mask=m_x1, other=0)
    # One byte per load: a [32 W, 2] load of unproven alignment would get a layout of two lanes per pair.
    sl0 = exp2_int(tl.load(s_lo + blk_s, mask=m_sl0, other=0).to(tl.int32))
    sl1 = exp2_int(tl.load(s_lo + blk_s + 1, mask=m_sl1, other=0).to(tl.int32))
    sh0 = exp2_int(tl.load(s_hi + blk_s, mask=m_sh0, other=0).to(tl.int32))
    sh1 = exp2_int(tl.load(s_hi + blk_s + 1, mask=m_sh1, other=0).to(tl.int32))
    sx0 = tl.load(xs_row + blk_s, mask=m_s0, other=0.0) * 64.0
    sx1 = tl.load(xs_row + blk_s + 1, mask=m_s1, other=0.0) * 64.0
    return (wa_lo, wb_lo, wa_hi, wb_hi, x0a, x0b, x1a, x1b, sl0, sl1, sh0, sh1, sx0, sx1)


@triton.jit
def _part(d0, d1, d2, d3, wa_lo, wa_hi, wb_lo, wb_hi, b0, b1, HIGH: tl.constexpr, W: tl.constexpr,
          ASM: tl.constexpr):
    # One MMA: the low (HIGH False) or high nibbles of the weight words of rows g / g + 8, blocks t / t + 4.
    a0 = _e4m3_of_nibbles(wa_lo, HIGH).to(tl.int32, bitcast=True)
    a1 = _e4m3_of_nibbles(wa_hi, HIGH).to(tl.int32, bitcast=True)
    a2 = _e4m3_of_nibbles(wb_lo, HIGH).to(tl.int32, bitcast=True)
    a3 = _e4m3_of_nibbles(wb_hi, HIGH).to(tl.int32, bitcast=True)
    return frag_mma(a0, a1, a2, a3, b0, b1, d0, d1, d2, d3, W, ASM)


@triton.jit
def _span_sums(v, W: tl.constexpr, ASM: tl.constexpr):
    # (row g, row g + 8) [32 W] FP32: this lane's two block sums of the span per row, scaled (`_span_load`).
    # Part p is word p // 2 of each block, its low nibbles for even p and its high nibbles for odd p; the eight
    # parts are written out (no loop variable indexing a tuple, which Triton 3.6's interpreter rejects).
    wa_lo, wb_lo, wa_hi, wb_hi, x0a, x0b, x1a, x1b, sl0, sl1, sh0, sh1, sx0, sx1 = v
    al0, al1, al2, al3 = split4(wa_lo.to(tl.uint32, bitcast=True), W)
    bl0, bl1, bl2, bl3 = split4(wb_lo.to(tl.uint32, bitcast=True), W)
    ah0, ah1, ah2, ah3 = split4(wa_hi.to(tl.uint32, bitcast=True), W)
    bh0, bh1, bh2, bh3 = split4(wb_hi.to(tl.uint32, bitcast=True), W)
    p0, p1, p2, p3 = split4(x0a, W)
    p4, p5, p6, p7 = split4(x0b, W)
    q0, q1, q2, q3 = split4(x1a, W)
    q4, q5, q6, q7 = split4(x1b, W)
    d0 = tl.zeros([32 * W], dtype=tl.float32)
    d1 = d0
    d2 = d0
    d3 = d0
    d0, d1, d2, d3 = _part(d0, d1, d2, d3, al0, ah0, bl0, bh0, p0, q0, False, W, ASM)
    d0, d1, d2, d3 = _part(d0, d1, d2, d3, al0, ah0, bl0, bh0, p1, q1, True, W, ASM)
    d0, d1, d2, d3 = _part(d0, d1, d2, d3, al1, ah1, bl1, bh1, p2, q2, False, W, ASM)
    d0, d1, d2, d3 = _part(d0, d1, d2, d3, al1, ah1, bl1, bh1, p3, q3, True, W, ASM)
    d0, d1, d2, d3 = _part(d0, d1, d2, d3, al2, ah2, bl2, bh2, p4, q4, False, W, ASM)
    d0, d1, d2, d3 = _part(d0, d1, d2, d3, al2, ah2, bl2, bh2, p5, q5, True, W, ASM)
    d0, d1, d2, d3 = _part(d0, d1, d2, d3, al3, ah3, bl3, bh3, p6, q6, False, W, ASM)
    d0, d1, d2, d3 = _part(d0, d1, d2, d3, al3, ah3, bl3, bh3, p7, q7, True, W, ASM)
    return d0 * sl0 * sx0 + d1 * sl1 * sx1, d2 * sh0 * sx0 + d3 * sh1 * sx1


@triton.jit
def _grouped_frag_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, idx_ptr, y_ptr, part_ptr, cnt_ptr, w2_ptr, s2_ptr, y2_ptr,
    P, N_OUT, K, E, X_ROW_DIV, stride_we, stride_wn, stride_se, stride_sn,
    ITERS: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr, W: tl.constexpr, PREFETCH: tl.constexpr,
    EVEN: tl.constexpr, PAIRED: tl.constexpr, USE_PDL: tl.constexpr, ASM: tl.constexpr,
):
    # ITERS is a constexpr: Triton 3.6's interpreter cannot take a runtime int as a range bound (numpy 2).
    # Program (16-row tile, K split, pair) of W warps; w_ptr / xq_ptr as int32 words (strides in words), xq / xs
    # from `prepare_frag_x`. Tensors [32 W] hold one value per thread. PAIRED: grid dimension 2 is 2 P, and
    # programs z >= P compute pair z - P of the second weight (w2_ptr, s2_ptr: same shape and strides) into y2_ptr;
    # the split-K workspace holds 2 P pairs, indexed by z.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    z = tl.program_id(2)
    if PAIRED:
        second = z >= P
        pair = tl.where(second, z - P, z)
        w_ptr = tl.where(second, w2_ptr, w_ptr)
        s_ptr = tl.where(second, s2_ptr, s_ptr)
        # y row z of the store below is row z - P of y2.
        y_ptr = tl.where(second, y2_ptr - (z - pair).to(tl.int64) * N_OUT, y_ptr)
        ws_pairs = 2 * P
    else:
        pair = z
        ws_pairs = P
    rows16 = pid_n * 16 + tl.arange(0, 16)
    e_ok, e_safe, _ = pair_expert(idx_ptr, pair, E, rows16, N_OUT, USE_PDL)
    e_flag = tl.max(e_ok.to(tl.int32), axis=0)
    # One value per thread: element i of a [32 W] tensor is lane i % 32 of warp i // 32 (a 1-D layout has no other
    # natural order; with a [W, 32] tensor Triton 3.6 put warps along the lane axis and the MMAs got other lanes'
    # registers).
    li = tl.arange(0, 32 * W)
    warp = li // 32
    lane = li % 32
    g = lane // 4
    t = lane % 4
    wi = tl.arange(0, 4)[None, :]
    row_lo = pid_n * 16 + g
    # The expert's validity as a vector (the interpreter mis-types scalar-bool & block-bool).
    ok_lo = (row_lo < N_OUT) & (row_lo * 0 + e_flag > 0)
    ok_hi = (row_lo + 8 < N_OUT) & (row_lo * 0 + e_flag > 0)
    w_lo = w_ptr + e_safe * stride_we + row_lo.to(tl.int64) * stride_wn
    w_hi = w_lo + 8 * stride_wn
    s_lo = s_ptr + e_safe * stride_se + row_lo.to(tl.int64) * stride_sn
    s_hi = s_lo + 8 * stride_sn
    x_row = (pair // X_ROW_DIV).to(tl.int64)
    xq_row = xq_ptr + x_row * (K // 4)
    xs_row = xs_ptr + x_row * (K // 32)
    x_lane = (g % 4) == t
    x_b0 = x_lane & (g < 4)
    x_b1 = x_lane & (g >= 4)
    nkb = K // 32
    acc_lo = tl.zeros([32 * W], dtype=tl.float32)
    acc_hi = tl.zeros([32 * W], dtype=tl.float32)
    step = W * SPLIT_K
    blk = (pid_k * W + warp) * 8
    if PREFETCH:
        # Register double buffer: the next span's loads are issued before this span's MMAs, so a warp always has
        # one span's bytes in flight. The trip after the last reads nothing (masked loads: every block is past K;
        # EVEN loads: the scalar `live` is False).
        n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13 = _span_load(
            w_lo, w_hi, s_lo, s_hi, xq_row, xs_row, blk, nkb, g, t, ok_lo, ok_hi, x_b0, x_b1, wi, EVEN, True)
        for it in tl.range(0, ITERS, num_stages=1):
            cur = (n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13)
            n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13 = _span_load(
                w_lo, w_hi, s_lo, s_hi, xq_row, xs_row, blk + (it + 1) * step * 8, nkb, g, t, ok_lo, ok_hi, x_b0,
                x_b1, wi, EVEN, it + 1 < ITERS)
            lo, hi = _span_sums(cur, W, ASM)
            acc_lo += lo
            acc_hi += hi
    else:
        for it in tl.range(0, ITERS, num_stages=1):
            lo, hi = _span_sums(_span_load(w_lo, w_hi, s_lo, s_hi, xq_row, xs_row, blk + it * step * 8, nkb, g, t,
                                           ok_lo, ok_hi, x_b0, x_b1, wi, EVEN, True), W, ASM)
            acc_lo += lo
            acc_hi += hi
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    lo8 = tl.sum(tl.sum(tl.reshape(acc_lo, [W, 8, 4]), axis=2), axis=0)
    hi8 = tl.sum(tl.sum(tl.reshape(acc_hi, [W, 8, 4]), axis=2), axis=0)
    acc16 = tl.reshape(tl.permute(tl.join(lo8, hi8), (1, 0)), [16])
    grouped_store(acc16, e_ok, rows16, z, pid_n, pid_k, y_ptr, part_ptr, cnt_ptr, ws_pairs, N_OUT, SPLIT_K,
                   SPLIT_POW2)


def prepare_frag_x(x2: torch.Tensor, empty, pdl: bool, part_order: bool = True,
                   early: bool = False, norm: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations the fragment kernel reads, from one launch (PDL-launched when `pdl`): x2 [rows, K] (bf16 /
    fp32, contiguous along K, K % 32 == 0) FP8-quantised by 1x32 blocks (formats.quantize_fp8_1x32, MODEL.md
    §2.1) as (E4M3 bytes uint8 [rows, K] in the kernel's part order, or in K order with part_order=False (the
    block-FP8 fragment GEMV of `gemv_frag`), block scales 2^(e - 127) fp32 [rows, K/32]).
    `empty(shape, dtype, device)` allocates the results. `early`: under PDL the next launch may start before this
    one waits for its predecessor (`grouped_words.x_blocks` EARLY: only for a next kernel that touches nothing but
    constants before its own wait). `norm` = (norm weight [K] of x2's dtype or None, eps, mode 1-6 of
    `ref.norm.NORM_SPELLINGS`): each row is RMS-normalised as that spelling rounds it before the quantisation."""
    rows, kk = x2.shape
    nw, eps, mode = norm if norm is not None else (None, 0.0, 0)
    q = empty((rows, kk), torch.uint8, x2.device)
    s = empty((rows, kk // 32), torch.float32, x2.device)
    extra = {"launch_pdl": True} if pdl else {}
    _frag_x_kernel[(triton.cdiv(kk, _PREP_BLOCK), rows)](x2, q, s, x2 if nw is None else nw, float(eps), kk,
                                                         x2.stride(0), BLOCK=_PREP_BLOCK, PART_ORDER=part_order,
                                                         USE_PDL=pdl, EARLY=early, NORM=int(mode),
                                                         KP=next_power_of_2(kk), num_warps=4, **extra)
    return q, s


def launch_grouped_frag(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        idx: torch.Tensor, y: torch.Tensor, part: torch.Tensor, cnt: torch.Tensor, x_row_div: int,
                        plan: dict, pdl: bool, second: tuple | None = None) -> torch.Tensor:
    """Launch the fragment kernel into `y` [pairs, out] (bf16 / fp32) with `plan` (`grouped_frag_plan`).

    xq / xs from `prepare_frag_x` (row pair // x_row_div feeds pair); weight uint8 [E, out, K/2] (`frag_eligible`);
    scale uint8 [E, out, K/32] contiguous along K; idx int64 [pairs]; part / cnt the split-K workspace of
    `_common.split_k_workspace`. `second` = (weight2, scale2, y2): one launch also computes y2 from weight2 / scale2
    (the same shapes and strides as weight / scale, y2 like y; `paired_launch_fits`) for the same x and experts,
    with a workspace of 2 pairs x out (MoE w1 and w3: one grid, one ramp and tail instead of two). Returns y.
    Raises ValueError for a weight that cannot be read as 16-byte vectors, and for a `second` that does not fit or
    a split-K workspace too small for 2 x pairs; other arguments are checked by the caller
    (`grouped_gemv.triton_grouped_linear_fp4`).
    """
    if not _vector_readable(weight):
        raise ValueError(f"weight {tuple(weight.shape)} with strides {weight.stride()} cannot be read as 16-byte "
                         "vectors (needs contiguous K, K/2, the strides and the address multiples of 16 bytes)")
    words = weight.view(torch.int32)
    grid = plan["grid"]
    # Unmasked loads read expert 0 for an invalid index: an empty stack has none (its rows are all NaN).
    even = plan["EVEN"] and weight.shape[0] > 0
    if second is not None:
        if not paired_launch_fits(weight, scale, y, *second):
            raise ValueError("the second weight / scale / y of a paired fragment launch must match the first's "
                             "shapes, strides and dtypes, be readable as 16-byte vectors, and 2 x pairs must fit "
                             "grid dimension 2 (65535)")
        pairs = idx.numel()
        if plan["SPLIT_K"] > 1 and (part.numel() < plan["SPLIT_K"] * 2 * pairs * weight.shape[1]
                                    or cnt.numel() < grid[0] * 2 * pairs):
            raise ValueError(f"a paired split-K launch needs a workspace for 2 x {pairs} pairs: partials "
                             f"[{plan['SPLIT_K']}, {2 * pairs}, {weight.shape[1]}] and {grid[0] * 2 * pairs} "
                             f"counters; got {part.numel()} and {cnt.numel()} elements")
        w2, s2, y2 = second[0].view(torch.int32), second[1], second[2]
        grid = (grid[0], grid[1], 2 * grid[2])
    else:
        w2, s2, y2 = words, scale, y
    extra = {"launch_pdl": True} if pdl else {}
    if plan["MAXNREG"] is not None:
        extra["maxnreg"] = plan["MAXNREG"]
    _grouped_frag_kernel[grid](
        xq.view(torch.int32), xs, words, scale, idx, y, part, cnt, w2, s2, y2,
        idx.numel(), weight.shape[1], xq.shape[1], weight.shape[0], x_row_div, words.stride(0), words.stride(1),
        scale.stride(0), scale.stride(1),
        ITERS=plan["ITERS"], SPLIT_K=plan["SPLIT_K"], SPLIT_POW2=plan["SPLIT_POW2"], W=plan["num_warps"],
        PREFETCH=plan["PREFETCH"], EVEN=even, PAIRED=second is not None, USE_PDL=pdl,
        ASM=not is_interpreted(_grouped_frag_kernel), num_warps=plan["num_warps"], **extra)
    return y


def paired_launch_fits(weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, weight2: torch.Tensor,
                       scale2: torch.Tensor, y2: torch.Tensor) -> bool:
    """Whether one fragment launch can compute y from (weight, scale) and y2 from (weight2, scale2): the same
    shapes, strides and dtypes, both weights readable as 16-byte vectors, and 2 x pairs (y.shape[0] of y [pairs,
    out]) within CUDA's 65535 for grid dimension 2."""
    return (weight2.shape == weight.shape and weight2.stride() == weight.stride() and weight2.dtype == weight.dtype
            and scale2.shape == scale.shape and scale2.stride() == scale.stride() and scale2.dtype == scale.dtype
            and y2.shape == y.shape and y2.stride() == y.stride() and y2.dtype == y.dtype
            and _vector_readable(weight) and _vector_readable(weight2) and 2 * y.shape[0] <= 65535)


def pdl_for(device) -> bool:
    """Whether `_grouped_frag_kernel` launches with programmatic dependent launch on `device` (`use_pdl_for`); asked by
    `grouped_gemv`, which chains it after the router."""
    return use_pdl_for(_grouped_frag_kernel, device)
