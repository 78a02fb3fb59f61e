"""Grouped FP4 expert GEMV on the CUDA cores with a word-parallel E2M1 decode (two codes per integer operation).

Why. `grouped_gemv`'s tile kernel is bound by instruction issue, not memory: on the H200 at the h200 expert shapes
it issues 9.2 warp instructions per FP4 code (Nsight Compute: 20.4 M for the 70.8 M codes of w1, 0.62 issued per
scheduler per cycle, DRAM 17 % busy; bench/results/2026-12-01_h200_s19). It decodes one nibble at a time from
bytes, builds each fp16 separately and reduces every 32-block across threads with shuffles. Here:

- Loads: a thread reads one 16-byte run of a weight row (one 32-block: 4 int32 words) per [row, block]; the tile is
  [BLOCK_N, BLOCK_K / 32, 4] words, so a block's whole dot product stays in one thread (no shuffles in the loop).
- Decode: for word w and I in 0..3, the nibbles I and I + 4 (codes k = 8j + I and 8j + I + 4) become one pair of
  fp16 numbers with two shifts and two masks: magnitude bits to fp16 bits 9..11 (25..27), sign to bit 15 (31). The
  pair equals the two E2M1 values times 2^-14 exactly (codes 1 and 9 are fp16 subnormals). Each half is converted
  to FP32 (`cvt.f32.f16`, inline PTX behind the ASM flag, plain Triton under the interpreter) and multiplied into
  an FP32 FMA chain.
- Scales: per block of 32 the FP32 block sum is multiplied by 2^(s - 127) * 2^14 (s the UE8M0 byte, 0 for s = 0) and added
  to an FP32 accumulator [BLOCK_N, BLOCK_K / 32]; the 32-block sums are added across the tile once, after the loop.
- Activations (`prepare_x`): with act_quant, the FP8 1x32 fake quantisation of x is one small kernel first
  (`_x_prep_kernel`, FP32 out: q * 2^e is exact in FP32), because quantising inside the GEMV would repeat it in
  every thread of every program (it doubled the loop's instruction count and spilled registers in the sm_90 SASS).
  The same kernel can also permute each 32-block (x_perm) so the GEMV reads x as 16-byte vectors.

Measured (H200, Triton 3.6, CUDA-graph replay, PDL, 6 of 96 experts beyond L2; bench/results/2026-12-01_h200_s19):
w1 / w3 [2304, 5120] 32.1 us, w2 [5120, 2304] 31.4 us, 28 % of copy bandwidth (tile kernel 37.1 / 36.7 us), the
quantisation launch included. Nsight Compute on w1: 5.6 issued instructions per code (12.3 M), 168 registers per
thread (Triton 3.6; 96 with Triton 3.9 offline), so 12 one-warp programs per SM, 0.46 issued per scheduler per
cycle, 54 % of cycles with no eligible warp: latency-bound at low occupancy now, not issue-bound. Capping the
registers (maxnreg 64-128), register prefetch of the next K tile, 2-8 warps per program and 512-code tiles all
measured slower (34-207 us); so did the permuted x at the one-warp plan (33.5 vs 31.7 us), which helps the
4-warp plans (39 vs 53-60 us).

Numerics: codes, scales and the FP8 activation values are exact in FP32; a product of a code (2 significant bits)
and an activation is exact for FP8-quantised or bf16 x (6 or 10 bits) and rounded once for fp32 x without act_quant,
unless it falls below FP32's normal range; sums are FP32 in another order than the reference's matmul, then rounded
once to x's dtype. Taken for bf16 and fp32 x only: fp16 x follows the reference's fp16 roundings on `grouped_gemv`'s
tile kernel. UE8M0 weight scale bytes above 240 overflow the FP32 scale product to inf (255 is inf itself), as in the
tile kernel; byte 0 is a zero scale.

Op: none of its own. `grouped_gemv.triton_grouped_linear_fp4` launches it (by default where
`grouped_gemv.takes_words_by_default`; argument checks, index handling with NaN rows for an invalid expert, and
split-K merging through `grouped_gemv.grouped_store`, shared with its tile kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_int_options, exp2_int, is_interpreted, next_power_of_2, use_pdl_for
from .gemv_tiles import fake_quant_fp8_tile, grouped_store, pair_expert

__all__ = ["grouped_words_plan", "words_eligible", "launch_grouped_words", "prepare_x", "x_blocks", "WORDS_KEYS",
           "WORDS_ONLY_KEYS"]

#: Defaults of `grouped_words_plan`: one-warp programs of 32 rows x 256 codes (swept on the H200 at the h200 shapes,
#: bench/results/2026-12-01_h200_s19: 31-33 us; 64- to 128-row programs of 2-4 warps took 37-60 us).
_BLOCK_N = 32
_BLOCK_K = 256
_K_ITERS = 1
_NUM_WARPS = 1
#: Override keys of `triton_grouped_linear_fp4` that shape this plan (besides `words` itself and `sm_count`).
WORDS_KEYS = ("block_n", "block_k", "k_iters", "num_warps", "x_perm")
#: Those of `WORDS_KEYS` no other kernel of `triton_grouped_linear_fp4` takes.
WORDS_ONLY_KEYS = ("x_perm",)
#: Codes of K per program of the activation preparation kernel.
_PREP_BLOCK = 1024
#: Whether the activations are permuted for 16-byte loads (`_x_prep_kernel`) by default. Off: at the default plan
#: the permuted order measured 1-2 us slower (it needs the preparation launch even without act_quant); it helps
#: the 4-warp plans (128 x 256: 39 us against 53-60 us).
_X_PERM = False


def grouped_words_plan(pairs: int, n: int, k: int, *, block_n: int | None = None, block_k: int | None = None,
                       k_iters: int | None = None, num_warps: int | None = None, x_perm: bool | None = None,
                       sm_count: int | None = None) -> dict:
    """Launch parameters of the word-decode kernel for `pairs` (token, expert) pairs of an [n, k] FP4 weight.

    BLOCK_N (default 32) weight rows and BLOCK_K (default 256) codes of K per tile, K_ITERS (default 1) tiles per
    program along K, num_warps (default 1) warps per program, so the K split is ceil(K tiles / K_ITERS) and the grid
    (n tiles, K splits, pairs): at the h200 shapes (w1/w3 [2304, 5120], 6 pairs) 72 x 20 x 6 = 8640 one-warp
    programs of 4 KiB of codes. X_PERM (x_perm, default False): the GEMV reads x in `_x_prep_kernel`'s permuted
    order. `sm_count` is accepted and unused (the grid is sized by tiles, not by SMs).
    Returns a dict with BLOCK_N, BLOCK_K, K_ITERS, SPLIT_K, SPLIT_POW2, X_PERM, num_warps and grid.
    Raises: ValueError for a value that is not an int (x_perm: not a bool), block_n not a power of two in 16..256,
    block_k not a power of two in 32..1024, k_iters < 1, num_warps not in 1, 2, 4, 8, a K split above 65535.
    """
    if x_perm is not None and not isinstance(x_perm, bool):
        raise ValueError(f"x_perm={x_perm!r} must be a bool")
    check_int_options(block_n=block_n, block_k=block_k, k_iters=k_iters, num_warps=num_warps, sm_count=sm_count)
    block_n = _BLOCK_N if block_n is None else block_n
    block_k = _BLOCK_K if block_k is None else block_k
    k_iters = _K_ITERS if k_iters is None else k_iters
    num_warps = _NUM_WARPS if num_warps is None else num_warps
    if block_n & (block_n - 1) or not 16 <= block_n <= 256:
        raise ValueError(f"block_n={block_n} must be a power of two in 16..256")
    if block_k & (block_k - 1) or not 32 <= block_k <= 1024:
        raise ValueError(f"block_k={block_k} must be a power of two in 32..1024 (codes of K per tile)")
    if k_iters < 1:
        raise ValueError(f"k_iters={k_iters} must be >= 1")
    if num_warps not in (1, 2, 4, 8):
        raise ValueError(f"num_warps={num_warps} must be 1, 2, 4 or 8")
    n_tiles = -(-n // block_n)
    k_tiles = max(1, -(-k // block_k))
    k_iters = min(k_iters, k_tiles)
    split = -(-k_tiles // k_iters)
    if split > 65535:
        raise ValueError(f"K = {k} in {block_k}-code tiles, {k_iters} per program, needs {split} K splits; a launch "
                         "takes at most 65535 (raise block_k or k_iters)")
    x_perm = _X_PERM if x_perm is None else x_perm
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, K_ITERS=k_iters, SPLIT_K=split, SPLIT_POW2=next_power_of_2(split),
                X_PERM=x_perm, num_warps=num_warps, grid=(n_tiles, split, pairs))


def words_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `launch_grouped_words` takes these arguments: x bf16 or fp32 (fp16 x needs the reference's fp16
    roundings) and a packed weight [E, out, K/2] readable in place as int32 words (contiguous along K, K/2 and
    both outer strides multiples of 4 bytes, 4-byte aligned address)."""
    return (x.dtype in (torch.bfloat16, torch.float32) and weight.dim() == 3 and weight.stride(-1) == 1
            and weight.shape[-1] % 4 == 0 and weight.stride(0) % 4 == 0 and weight.stride(1) % 4 == 0
            and weight.data_ptr() % 4 == 0)


@triton.jit
def x_blocks(x_ptr, K, stride_xr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr = False):
    """The activation preparation kernels' load (this module's `_x_prep_kernel`, `grouped_frag._frag_x_kernel`):
    program (K chunk, row) reads x[row] blocks of 32 as FP32 [BLOCK / 32, 32]. Returns (row int64, block indices
    kb [BLOCK / 32], position j [32] in a block, offsets [BLOCK / 32, 32] along K, in-range mask, values). Under PDL
    it waits for the previous kernel before the load and lets the GEMV launch after it, or (EARLY) before its own
    wait, so that a GEMV whose weights do not depend on the previous kernels starts reading them during their tail.
    EARLY is safe only for a dependent that reads nothing but constants and writes nothing before its own wait and
    triggers its dependents only after that wait (this grid finishes only after its own wait, so the dependent's
    wait still orders it after every earlier kernel)."""
    NB: tl.constexpr = BLOCK // 32
    row = tl.program_id(1).to(tl.int64)
    kb = tl.program_id(0) * NB + tl.arange(0, NB)
    j = tl.arange(0, 32)
    offs = kb[:, None] * 32 + j[None, :]
    ok = offs < K
    if USE_PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    xv = tl.load(x_ptr + row * stride_xr + offs, mask=ok, other=0.0).to(tl.float32)
    if USE_PDL and not EARLY:
        # The GEMV's gdc_wait still waits for this grid to finish: it may start its index and weight set-up now.
        tl.extra.cuda.gdc_launch_dependents()
    return row, kb, j, offs, ok, xv


@triton.jit
def _x_prep_kernel(x_ptr, y_ptr, K, stride_xr, ACT_QUANT: tl.constexpr, PERM: tl.constexpr, BLOCK: tl.constexpr,
                   USE_PDL: tl.constexpr):
    # Program (K block, row): y[row] = x[row] in FP32, FP8 1x32 fake-quantised (formats.fake_quant_fp8_1x32, exact
    # in FP32) when ACT_QUANT; with PERM, element 8 w + i of each 32-block goes to position 4 i + w, so the GEMV
    # reads the activations of nibble i of a block's four words as one 16-byte vector.
    row, kb, j, offs, ok, xv = x_blocks(x_ptr, K, stride_xr, BLOCK, USE_PDL)
    if ACT_QUANT:
        xv = fake_quant_fp8_tile(xv)
    if PERM:
        offs = kb[:, None] * 32 + (j % 8)[None, :] * 4 + (j // 8)[None, :]
    tl.store(y_ptr + row * K + offs, xv, mask=ok)


@triton.jit
def _pair_halves(w, I: tl.constexpr, ASM: tl.constexpr):
    # FP32 values * 2^-14 of the nibbles I (low half) and I + 4 (high half) of each uint32 word (module docstring).
    if I == 3:
        h = ((w >> 3) & 0x0E000E00) | (w & 0x80008000)
    else:
        h = ((w << (9 - 4 * I)) & 0x0E000E00) | ((w << (12 - 4 * I)) & 0x80008000)
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r", [h], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _x_slot(x_row, k0, kb, wi, k_ok, I: tl.constexpr, X_PERM: tl.constexpr):
    # x[k0 + 32 kb + 8 wi + I] as [NKB, 4]: the activation of nibble I of word wi of block kb (at 32 kb + 4 I + wi
    # of the permuted row, `_x_prep_kernel`).
    if X_PERM:
        offs = tl.max_contiguous(tl.multiple_of(kb[:, None] * 32 + I * 4 + wi[None, :], [1, 4]), [1, 4])
    else:
        offs = kb[:, None] * 32 + wi[None, :] * 8 + I
    return tl.load(x_row + k0 + offs, mask=k_ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _load_tile(w_rows, s_rows, n_ok, t, K, kb, wi, BLOCK_K: tl.constexpr):
    # (words [BLOCK_N, NKB, 4] uint32, scale bytes [BLOCK_N, NKB] int32, k_ok [NKB]) of K tile t; 16-byte loads.
    k0 = t * BLOCK_K
    k_ok = k0 + kb * 32 < K
    w_offs = t * (BLOCK_K // 8) + kb[None, :, None] * 4 + wi[None, None, :]
    w = tl.load(w_rows + tl.max_contiguous(tl.multiple_of(w_offs, [1, 1, 4]), [1, 1, 4]),
                mask=n_ok[:, None, None] & k_ok[None, :, None], other=0).to(tl.uint32, bitcast=True)
    sb = tl.load(s_rows + (k0 // 32 + kb[None, :]), mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.int32)
    return w, sb, k_ok


@triton.jit
def _tile_block_sums(w, sb, k_ok, x_row, k0, kb, wi, X_PERM: tl.constexpr, ASM: tl.constexpr):
    # FP32 [BLOCK_N, NKB]: each 32-block's dot product with x, times its weight scale.
    x0 = _x_slot(x_row, k0, kb, wi, k_ok, 0, X_PERM)
    x1 = _x_slot(x_row, k0, kb, wi, k_ok, 1, X_PERM)
    x2 = _x_slot(x_row, k0, kb, wi, k_ok, 2, X_PERM)
    x3 = _x_slot(x_row, k0, kb, wi, k_ok, 3, X_PERM)
    x4 = _x_slot(x_row, k0, kb, wi, k_ok, 4, X_PERM)
    x5 = _x_slot(x_row, k0, kb, wi, k_ok, 5, X_PERM)
    x6 = _x_slot(x_row, k0, kb, wi, k_ok, 6, X_PERM)
    x7 = _x_slot(x_row, k0, kb, wi, k_ok, 7, X_PERM)
    lo, hi = _pair_halves(w, 0, ASM)
    p = tl.fma(hi, x4[None], lo * x0[None])
    lo, hi = _pair_halves(w, 1, ASM)
    p = tl.fma(hi, x5[None], tl.fma(lo, x1[None], p))
    lo, hi = _pair_halves(w, 2, ASM)
    p = tl.fma(hi, x6[None], tl.fma(lo, x2[None], p))
    lo, hi = _pair_halves(w, 3, ASM)
    p = tl.fma(hi, x7[None], tl.fma(lo, x3[None], p))
    # 2^(s - 127) (UE8M0; byte 0 is 0.0, as `ue8m0_to_float` has it) times 2^14 for the decode's 2^-14: exactly the
    # tile kernel's product, so bytes above 240 overflow to inf there as here.
    return tl.sum(p, axis=2) * (exp2_int(sb) * 16384.0)


@triton.jit
def _grouped_words_kernel(
    x_ptr, w_ptr, s_ptr, idx_ptr, y_ptr, part_ptr, cnt_ptr,
    P, N_OUT, K, E, X_ROW_DIV, stride_xr, stride_we, stride_wn, stride_se, stride_sn,
    SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr, K_ITERS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, X_PERM: tl.constexpr, USE_PDL: tl.constexpr, ASM: tl.constexpr,
):
    # Program (n-tile, k-split, pair); w_ptr is the weight as int32 words (strides in words), x already prepared
    # (`prepare_x`).
    NKB: tl.constexpr = BLOCK_K // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pair = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.arange(0, NKB)
    wi = tl.arange(0, 4)
    e_ok, e_safe, n_ok = pair_expert(idx_ptr, pair, E, offs_n, N_OUT, USE_PDL)
    x_row = x_ptr + (pair // X_ROW_DIV).to(tl.int64) * stride_xr
    w_rows = w_ptr + e_safe * stride_we + offs_n[:, None, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + e_safe * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, NKB], dtype=tl.float32)
    for it in tl.range(0, K_ITERS, num_stages=1):
        w, sb, k_ok = _load_tile(w_rows, s_rows, n_ok, pid_k * K_ITERS + it, K, kb, wi, BLOCK_K)
        acc += _tile_block_sums(w, sb, k_ok, x_row, (pid_k * K_ITERS + it) * BLOCK_K, kb, wi, X_PERM, ASM)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    grouped_store(tl.sum(acc, axis=1), e_ok, offs_n, pair, pid_n, pid_k, y_ptr, part_ptr, cnt_ptr, P, N_OUT,
                   SPLIT_K, SPLIT_POW2)


def prepare_x(x2: torch.Tensor, act_quant: bool, perm: bool, empty, pdl: bool) -> torch.Tensor:
    """The activation rows the GEMV reads: x2 [rows, K] (bf16 / fp32, contiguous along K, K % 32 == 0) itself when
    neither `act_quant` nor `perm`, else FP32 [rows, K] from one launch (PDL-launched when `pdl`): the values of
    `formats.fake_quant_fp8_1x32(x2)` when act_quant, in the GEMV's per-block order (`_x_prep_kernel`) when perm.
    `empty(shape, dtype, device)` allocates the result.
    Source: formats.quantize_fp8_1x32 (MODEL.md §2.1), through `quant_gemv.fake_quant_fp8_tile`."""
    if not (act_quant or perm):
        return x2
    rows, kk = x2.shape
    out = empty((rows, kk), torch.float32, x2.device)
    extra = {"launch_pdl": True} if pdl else {}
    _x_prep_kernel[(triton.cdiv(kk, _PREP_BLOCK), rows)](x2, out, kk, x2.stride(0), ACT_QUANT=bool(act_quant),
                                                         PERM=bool(perm), BLOCK=_PREP_BLOCK, USE_PDL=pdl,
                                                         num_warps=4, **extra)
    return out


def launch_grouped_words(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor,
                         y: torch.Tensor, part: torch.Tensor, cnt: torch.Tensor, x_row_div: int, plan: dict,
                         pdl: bool) -> torch.Tensor:
    """Launch the word-decode kernel into `y` [pairs, out] (dtype of the caller's x) with `plan`
    (`grouped_words_plan`).

    x2 [rows, K] fp32 / bf16 (already FP8-quantised where the op asks for it; row pair // x_row_div feeds pair),
    contiguous along K; weight uint8 [E, out, K/2] (`words_eligible`); scale uint8 [E, out, K/32] contiguous along
    K; idx int64 [pairs]; part / cnt the split-K workspace of `_common.split_k_workspace`. Returns y.
    Raises ValueError for a weight that cannot be read as words; other arguments are checked by the caller
    (`grouped_gemv.triton_grouped_linear_fp4`).
    """
    if not (weight.dim() == 3 and weight.stride(-1) == 1 and weight.shape[-1] % 4 == 0 and weight.stride(0) % 4 == 0
            and weight.stride(1) % 4 == 0 and weight.data_ptr() % 4 == 0):
        raise ValueError(f"weight {tuple(weight.shape)} with strides {weight.stride()} cannot be read as int32 "
                         "words (needs contiguous K, K/2, the strides and the address multiples of 4 bytes)")
    words = weight.view(torch.int32)
    extra = {"launch_pdl": True} if pdl else {}
    _grouped_words_kernel[plan["grid"]](
        x2, words, scale, idx, y, part, cnt,
        idx.numel(), weight.shape[1], x2.shape[1], weight.shape[0], x_row_div, x2.stride(0), words.stride(0),
        words.stride(1), scale.stride(0), scale.stride(1),
        SPLIT_K=plan["SPLIT_K"], SPLIT_POW2=plan["SPLIT_POW2"], K_ITERS=plan["K_ITERS"], BLOCK_N=plan["BLOCK_N"],
        BLOCK_K=plan["BLOCK_K"], X_PERM=plan["X_PERM"], USE_PDL=pdl, ASM=not is_interpreted(_grouped_words_kernel),
        num_warps=plan["num_warps"], **extra)
    return y


def pdl_for(device) -> bool:
    """Whether `_grouped_words_kernel` launches with programmatic dependent launch on `device` (`use_pdl_for`); asked by
    `grouped_gemv`, which chains it after the router."""
    return use_pdl_for(_grouped_words_kernel, device)
