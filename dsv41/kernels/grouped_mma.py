"""Grouped FP4 expert GEMV on the tensor cores: packed-word E2M1 decode and a block-diagonal activation operand.

Why. The tile kernel of `grouped_gemv` issues 9.2 warp instructions per FP4 code (Nsight Compute,
bench/results/2026-12-01_h200_s19: unpack a nibble, build the fp16 bits, convert to FP32, multiply-add, reduce) and
reached 24 % of the copy bandwidth on the h200 expert shapes (37 us for 38 MB, bench/results/2026-11-30_h200_s7_gemv):
it is bound by instruction issue, not by memory. Here
the arithmetic moves to an MMA and the decode works on 32-bit words:

- Decode: eight codes per int32 word. With `u = word << 4s` the nibbles 3 - s and 7 - s sit in bits 12..15 and
  28..31, so `(u & 0x80008000) | ((u >> 3) & 0x0E000E00)` is a pair of fp16 numbers equal to those two E2M1 values
  times 2^-14 (the sign lands in bit 15, the two exponent and one mantissa bits in bits 9..11; code 1 and 9 are the
  fp16 subnormals +-2^-15, exact). Three integer operations per two codes, no table, no FP32 conversion. The eight
  halves are joined back in K order, so the tile is [BLOCK_N, BLOCK_K] fp16 in the weight's own column order.
- Multiply: one `tl.dot` per tile with a block-diagonal activation operand B [BLOCK_K, 16]: column j holds the
  E4M3 values q of the tile's 32-block j (x = q * 2^sx after the 1x32 FP8 fake quantisation) and zeros elsewhere.
  So column j of the product is the FP32 sum over block j alone of code * q, every product exact in fp16 x fp16
  -> fp32, and the per-block scales (2^sx of x, the UE8M0 weight scale, 2^14) are applied to the [BLOCK_N, 16]
  result after the MMA, as the CUDA-core kernel applies them per block sum.
- Loads: the K loop is software-pipelined (`tl.range(num_stages=STAGES)`: cp.async copies of STAGES - 1 tiles in
  flight), the grid sized for `programs_per_sm` resident programs as `gemv_tma.tma_gemv_plan` does.

Numerics (for UE8M0 weight scale bytes up to 240, as in `quant_gemv`: above that the FP32 product of the power-of-two
scales overflows, in the CUDA-core kernel too): the same numbers as `grouped_gemv.reference_grouped_linear_fp4` up
to FP32 summation order (block sums
of exact products, scaled by powers of two, summed over blocks in FP32), then one rounding to x's dtype. Taken only
for act_quant=True and bf16 / fp32 x: without the activation quantisation x is not an E4M3 value and its products
would round in fp16; fp16 x follows the reference's fp16 roundings on the CUDA-core path.

Op: none of its own. `grouped_gemv.triton_grouped_linear_fp4(..., mma_words=True)` launches it (arguments, index
handling with NaN rows for an invalid expert, and split-K merging exactly as the CUDA-core kernel, whose epilogue
it shares). It is not the default (`grouped_gemv.MMA_WORDS_DEFAULT`): measured slower.

Measured on the H200 (bench/results/2026-12-01_h200_s18, `bench/kernels.py --pdl --sweep`, CUDA-graph replay, 6 of
96 experts beyond L2): at the h200 decode shapes every swept plan took 50-72 us against 37 us for the CUDA-core
kernel (w1/w3 [2304, 5120]: 55.4 us at best, 64 x 256 tiles, 4 stages, 3 programs per SM; w2 [5120, 2304]: 50.5
us). Its K loop has 3.6-4.9 instructions per code in the sm_90 SASS (Triton 3.9, offline), about what the
CUDA-core kernel issues, so it saves no issue slots; and a program streams its K range with STAGES - 1 tiles in
flight behind a CTA barrier per tile (the A operand goes registers -> shared memory -> registers for the MMA),
while the CUDA-core kernel keeps 2,160 short independent programs in flight. Reading the scales and x one tile
ahead moved w2 from 55 to 50.5 us. What would have to change for it to win: the decoded pairs placed straight
in the MMA's register fragment (no shared-memory round trip), more tiles in flight per SM.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import check_int_options, exp2_int, is_interpreted, next_power_of_2, use_pdl_for
from .gemv_tiles import fp8_1x32_parts, grouped_store, pair_expert

__all__ = ["grouped_mma_plan", "mma_words_eligible", "mma_words_supported", "launch_grouped_mma", "MMA_WORDS_KEYS"]

#: Defaults of `grouped_mma_plan`: 64-row tiles (one warpgroup's MMA), 256 codes (128 bytes) of K per tile, three
#: pipeline stages, the grid sized for four resident programs per SM (swept on the H200: module docstring).
_BLOCK_N = 64
_BLOCK_K = 256
_STAGES = 3
_PROGRAMS_PER_SM = 4
_DEFAULT_SMS = 132
#: Warps per program when not given: None = 4 for BLOCK_N <= 64, else 8.
_NUM_WARPS = None
#: The N width of the MMA: at least 16 (the smallest tl.dot), at least one column per 32-block of a tile.
_MIN_MMA_N = 16
#: Override keys of `triton_grouped_linear_fp4` that shape this plan (besides `mma_words` itself and `sm_count`).
MMA_WORDS_KEYS = ("block_n", "block_k", "stages", "programs_per_sm", "num_warps")


def grouped_mma_plan(pairs: int, n: int, k: int, *, sm_count: int | None = None, block_n: int | None = None,
                     block_k: int | None = None, stages: int | None = None, programs_per_sm: int | None = None,
                     num_warps: int | None = None) -> dict:
    """Launch parameters of the word-decode MMA kernel for `pairs` (token, expert) pairs of an [n, k] FP4 weight.

    - BLOCK_N (default 64) weight rows per program, BLOCK_K (default 256) codes of K per tile (a multiple of 32,
      a power of two, 32 words at the default), MMA_N = max(16, BLOCK_K / 32).
    - The K split is the largest that keeps n tiles x pairs x split <= `sm_count` (default 132) x `programs_per_sm`
      (default 4), at least 1 and at most the K tiles; K_ITERS = ceil(K tiles / split), and the split is then
      evened out (ceil(K tiles / K_ITERS)).
    - STAGES (default 3): tiles in flight + 1. num_warps: 4 (BLOCK_N <= 64) or 8.
    Returns a dict with BLOCK_N, BLOCK_K, MMA_N, K_ITERS, SPLIT_K, SPLIT_POW2, STAGES, num_warps and grid
    (n tiles, K splits, pairs).
    Raises: ValueError for a value that is not an int, block_n not a power of two in 16..256, block_k not a power
    of two in 32..1024, stages < 1, programs_per_sm < 1, sm_count < 1, num_warps not in 4, 8.
    """
    check_int_options(block_n=block_n, block_k=block_k, stages=stages, programs_per_sm=programs_per_sm,
                      num_warps=num_warps, sm_count=sm_count)
    block_n = _BLOCK_N if block_n is None else block_n
    block_k = _BLOCK_K if block_k is None else block_k
    stages = _STAGES if stages is None else stages
    per_sm = _PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    if num_warps is None:
        num_warps = _NUM_WARPS if _NUM_WARPS is not None else (4 if block_n <= 64 else 8)
    if block_n & (block_n - 1) or not 16 <= block_n <= 256:
        raise ValueError(f"block_n={block_n} must be a power of two in 16..256")
    if block_k & (block_k - 1) or not 32 <= block_k <= 1024:
        raise ValueError(f"block_k={block_k} must be a power of two in 32..1024 (codes of K per tile)")
    if stages < 1:
        raise ValueError(f"stages={stages} must be >= 1")
    if per_sm < 1:
        raise ValueError(f"programs_per_sm={per_sm} must be >= 1")
    if sm_count is not None and sm_count < 1:
        raise ValueError(f"sm_count={sm_count} must be >= 1")
    if num_warps not in (4, 8):
        raise ValueError(f"num_warps={num_warps} must be 4 or 8")
    n_tiles = -(-n // block_n)
    k_tiles = max(1, -(-k // block_k))
    slots = (sm_count or _DEFAULT_SMS) * per_sm
    split = max(1, min(k_tiles, slots // max(1, n_tiles * pairs)))
    k_iters = -(-k_tiles // split)
    split = -(-k_tiles // k_iters)
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, MMA_N=max(_MIN_MMA_N, block_k // 32), K_ITERS=k_iters,
                SPLIT_K=split, SPLIT_POW2=next_power_of_2(split), STAGES=stages, num_warps=num_warps,
                grid=(n_tiles, split, pairs))


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def mma_words_supported(device: torch.device) -> bool:
    """Whether the word-decode kernel is the default choice on `device`: a CUDA GPU of compute capability >= 9.0
    (Hopper's warpgroup MMA, on which it was measured), the kernel compiled (not interpreted). False elsewhere,
    meta tensors included."""
    if device.type != "cuda" or is_interpreted(_grouped_mma_kernel):
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def mma_words_eligible(x: torch.Tensor, weight: torch.Tensor, act_quant: bool) -> bool:
    """Whether `launch_grouped_mma` takes these arguments: act_quant and x bf16 or fp32 (where it computes the
    reference's numbers), and a packed weight [E, out, K/2] readable in place as int32 words (a layout
    restriction: contiguous along K, K/2 a multiple of 4 bytes, 4-byte aligned address and strides)."""
    if not act_quant or x.dtype not in (torch.bfloat16, torch.float32):
        return False
    return _word_layout(weight) and weight.data_ptr() % 4 == 0


def _word_layout(weight: torch.Tensor) -> bool:
    # [E, out, K/2] bytes that view as int32 words: contiguous along K, K/2 and both outer strides multiples of 4.
    return (weight.dim() == 3 and weight.stride(-1) == 1 and weight.shape[-1] % 4 == 0
            and weight.stride(0) % 4 == 0 and weight.stride(1) % 4 == 0)


@triton.jit
def _words_to_fp16_tile(words, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K // 8] uint32 words of packed E2M1 codes (code 8w + p in nibble p) -> [BLOCK_N, BLOCK_K]
    fp16 values (E2M1 value x 2^-14); column c holds code 8 (c // 8) + `_code_of_column`(c % 8), so the two halves
    of one computed 32-bit pair stay neighbours (no repacking before the MMA). Bit layout: module docstring."""
    h0 = (words & 0x80008000) | ((words >> 3) & 0x0E000E00)  # codes 3 (low half) and 7 (high half)
    u = words << 4
    h1 = (u & 0x80008000) | ((u >> 3) & 0x0E000E00)  # codes 2 and 6
    u = words << 8
    h2 = (u & 0x80008000) | ((u >> 3) & 0x0E000E00)  # codes 1 and 5
    u = words << 12
    h3 = (u & 0x80008000) | ((u >> 3) & 0x0E000E00)  # codes 0 and 4
    # join(a, b) adds a last axis, so the outermost join is the fastest index of the flattened eight: low and high
    # half of each pair side by side, pairs in the order h0, h2, h1, h3.
    lo = tl.join(tl.join(_half(h0, 0), _half(h1, 0)), tl.join(_half(h2, 0), _half(h3, 0)))
    hi = tl.join(tl.join(_half(h0, 16), _half(h1, 16)), tl.join(_half(h2, 16), _half(h3, 16)))
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])


@triton.jit
def _half(h, SHIFT: tl.constexpr):
    """fp16 whose bits are bits SHIFT .. SHIFT + 15 of the uint32 `h`."""
    return ((h >> SHIFT) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _code_of_column(p):
    """Code index within its word (0..7) held by tile column 8w + p of `_words_to_fp16_tile`: the pairs h0 = (3, 7),
    h2 = (1, 5), h1 = (2, 6), h3 = (0, 4) in that order, i.e. 3 - bitreverse2(p // 2) + 4 (p % 2)."""
    q = p // 2
    return 3 - (((q & 1) << 1) | (q >> 1)) + 4 * (p % 2)


@triton.jit
def _x_tile(x_row, k0, K, NKB: tl.constexpr, EVEN: tl.constexpr):
    """FP32 x[k0 : k0 + 32 NKB] as [NKB, 32], each group of eight in the weight tile's column order
    (`_code_of_column`); 0 past K (unless EVEN: never past K)."""
    kb = tl.arange(0, NKB)
    j32 = tl.arange(0, 32)
    offs = k0 + kb[:, None] * 32 + ((j32 // 8) * 8 + _code_of_column(j32 % 8))[None, :]
    if EVEN:
        return tl.load(x_row + offs).to(tl.float32)
    return tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)


@triton.jit
def _scale_tile(s_rows, n_ok, k0, K, NKB: tl.constexpr, MMA_N: tl.constexpr, EVEN: tl.constexpr):
    """UE8M0 bytes [BLOCK_N, MMA_N] of the tile at k0: column j < NKB is 32-block j, other columns 0."""
    jn = tl.arange(0, MMA_N)
    if EVEN:
        # Every row and block in range (an invalid expert reads expert 0's rows; its y row is NaN anyway).
        if NKB == MMA_N:
            return tl.load(s_rows + (k0 // 32 + jn)[None, :])
        return tl.load(s_rows + (k0 // 32 + jn)[None, :], mask=(jn < NKB)[None, :], other=0)
    return tl.load(s_rows + (k0 // 32 + jn)[None, :], mask=n_ok[:, None] & ((jn < NKB) & (k0 + jn * 32 < K))[None, :],
                   other=0)


@triton.jit
def _x_block_operand(xv, NKB: tl.constexpr, MMA_N: tl.constexpr):
    """(B [NKB * 32, MMA_N] fp16, x scales [MMA_N] fp32) of an `_x_tile` after the 1x32 FP8 fake quantisation (as
    `quant_gemv.fp8_1x32_parts`): B[c, j] = q of tile column c (the E4M3 value) where c // 32 == j, else 0;
    scale j = 2^sx of block j (0 for columns without a block)."""
    jn = tl.arange(0, MMA_N)
    kb = tl.arange(0, NKB)
    q, e = fp8_1x32_parts(xv)
    e = tl.reshape(e, [NKB])
    q16 = q.to(tl.float16)
    on = jn[:, None] == kb[None, :]  # [MMA_N, NKB]: column j takes block j
    bt = tl.where(on[:, :, None], q16[None, :, :], 0.0)  # [MMA_N, NKB, 32]
    b = tl.trans(tl.reshape(bt, [MMA_N, NKB * 32]))
    sx = tl.max(tl.where(on, exp2_int(e)[None, :], 0.0), axis=1)
    return b, sx


@triton.jit
def _grouped_mma_kernel(
    x_ptr, w_ptr, s_ptr, idx_ptr, y_ptr, part_ptr, cnt_ptr,
    P, N_OUT, K, E, X_ROW_DIV, stride_xr, stride_we, stride_wn, stride_se, stride_sn,
    SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr, K_ITERS: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MMA_N: tl.constexpr, EVEN: tl.constexpr, USE_PDL: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # Program (n-tile, k-split, pair), as `grouped_gemv._grouped_gemv_kernel`; w_ptr is the int32-word view of the
    # packed codes (strides in words).
    WORDS: tl.constexpr = BLOCK_K // 8
    NKB: tl.constexpr = BLOCK_K // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pair = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wi = tl.arange(0, WORDS)
    e_ok, e_safe, n_ok = pair_expert(idx_ptr, pair, E, offs_n, N_OUT, USE_PDL)
    x_row = x_ptr + (pair // X_ROW_DIV).to(tl.int64) * stride_xr
    w_rows = w_ptr + e_safe * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + e_safe * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
    KW = K // 8
    acc = tl.zeros([BLOCK_N, MMA_N], dtype=tl.float32)
    # The scales and x of a tile are read one iteration ahead (synchronous loads the pipeliner does not stage
    # would otherwise wait a full memory round trip inside every iteration); the weight words are staged by the
    # pipeliner (STAGES - 1 tiles in flight). The last iteration re-reads its own tile instead of one past the range.
    k_start = pid_k * K_ITERS * BLOCK_K
    s_next = _scale_tile(s_rows, n_ok, k_start, K, NKB, MMA_N, EVEN)
    x_next = _x_tile(x_row, k_start, K, NKB, EVEN)
    for it in tl.range(0, K_ITERS, num_stages=STAGES):
        k0 = k_start + it * BLOCK_K
        s_raw = s_next
        xv = x_next
        k1 = tl.where(it + 1 < K_ITERS, k0 + BLOCK_K, k0)
        s_next = _scale_tile(s_rows, n_ok, k1, K, NKB, MMA_N, EVEN)
        x_next = _x_tile(x_row, k1, K, NKB, EVEN)
        kw = k0 // 8 + wi
        if EVEN:
            words = tl.load(w_rows + kw[None, :])
        else:
            words = tl.load(w_rows + kw[None, :], mask=n_ok[:, None] & (kw < KW)[None, :], other=0)
        a = _words_to_fp16_tile(words.to(tl.uint32, bitcast=True), BLOCK_N, BLOCK_K)
        b, sx = _x_block_operand(xv, NKB, MMA_N)
        if DOT_F32:
            # The interpreter's half-precision tl.dot is not trusted (see quant_gemv.mma_tile): the same exact
            # fp16 values multiplied in FP32.
            res = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            res = tl.dot(a, b)
        # Block sums (units of 2^-14) times 2^sx, then times the weight's UE8M0 scale and 2^14: the CUDA-core
        # kernel's order (x scale inside the block sum, weight scale on it).
        acc += (res * sx[None, :]) * (exp2_int(s_raw.to(tl.int32)) * 16384.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    grouped_store(tl.sum(acc, axis=1), e_ok, offs_n, pair, pid_n, pid_k, y_ptr, part_ptr, cnt_ptr, P, N_OUT,
                   SPLIT_K, SPLIT_POW2)


def launch_grouped_mma(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor, y: torch.Tensor,
                       part: torch.Tensor, cnt: torch.Tensor, x_row_div: int, plan: dict, pdl: bool) -> torch.Tensor:
    """Launch the word-decode MMA kernel into `y` [pairs, out] (x2's dtype) with `plan` (`grouped_mma_plan`).

    x2 [rows, K] bf16 / fp32 contiguous along K (row pair // x_row_div feeds pair); weight uint8 [E, out, K/2]
    (`mma_words_eligible`); scale uint8 [E, out, K/32] contiguous along K; idx int64 [pairs]; part / cnt the
    split-K workspace of `_common.split_k_workspace`. Returns y. Raises ValueError for a weight that cannot be
    read as words. Other arguments are checked by the caller (`grouped_gemv.triton_grouped_linear_fp4`).
    """
    if not _word_layout(weight):
        raise ValueError(f"weight {tuple(weight.shape)} with strides {weight.stride()} cannot be read as int32 "
                         "words (needs contiguous K, K/2 and the strides multiples of 4 bytes)")
    words = weight.view(torch.int32)
    e = weight.shape[0]
    out = weight.shape[1]
    kk = x2.shape[1]
    pairs = idx.numel()
    # No row or K tile out of range in any program: the loads go unmasked.
    even = (out % plan["BLOCK_N"] == 0 and kk % plan["BLOCK_K"] == 0
            and kk // plan["BLOCK_K"] == plan["SPLIT_K"] * plan["K_ITERS"])
    extra = {"launch_pdl": True} if pdl else {}
    _grouped_mma_kernel[plan["grid"]](
        x2, words, scale, idx, y, part, cnt,
        pairs, out, kk, e, x_row_div, x2.stride(0), words.stride(0), words.stride(1), scale.stride(0),
        scale.stride(1),
        SPLIT_K=plan["SPLIT_K"], SPLIT_POW2=plan["SPLIT_POW2"], K_ITERS=plan["K_ITERS"], STAGES=plan["STAGES"],
        BLOCK_N=plan["BLOCK_N"], BLOCK_K=plan["BLOCK_K"], MMA_N=plan["MMA_N"], EVEN=even, USE_PDL=pdl,
        DOT_F32=is_interpreted(_grouped_mma_kernel), num_warps=plan["num_warps"], **extra)
    return y


def pdl_for(device) -> bool:
    """Whether `_grouped_mma_kernel` launches with programmatic dependent launch on `device` (`use_pdl_for`); asked by
    `grouped_gemv`, which chains it after the router."""
    return use_pdl_for(_grouped_mma_kernel, device)
