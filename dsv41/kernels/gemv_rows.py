"""Row-streaming GEMV for batch-1 decode: x held in registers, weight rows streamed through them (M = 1).

`quant_gemv` (`dsv41::linear_fp8_block`, `dsv41::linear_fp4`) and `grouped_gemv` (`dsv41::grouped_linear_fp4`)
launch this kernel for one x row per output (`rows=True` in their plans); the numbers are theirs (MODEL.md §2.1
"Quantized GEMM semantics": FP8 1x32 activation quantisation, block-FP8 32x32 or FP4 1x32 UE8M0 weight scales, FP32
accumulation, one rounding to x.dtype).

Why another tile loop. The tile-at-once kernel (`quant_gemv.gemv_tile`) reaches 46 % of copy bandwidth on the
h200 projections: Nsight Compute put 39 % of its warp stalls on shared memory, from moving x, the scales and the
block sums between register layouts (8 layout conversions and 15 barriers per tile). Here every tensor that meets
the weight tile is built in the tile's own layout, so the loop has no layout conversion and no barrier:
- Program (row range, K chunk, pair) quantises its KC-wide chunk of x once, before the loop.
- Each thread loads 16 consecutive weight bytes of one row per row block (half a 32-block of E4M3 codes, or one
  32-block of E2M1 codes), so a 32-block's dot product is a sum inside the thread (plus one shuffle for FP8);
  lanes run along K, warps along rows, so the per-row sum never leaves the warp.
- The UE8M0 scale multiplies the thread's block sum: for block FP8 one byte per (32 rows, 32 columns) is a KC/32
  vector per row block (fewer elements than threads, which Triton loads straight into the tile's layout); for FP4
  the [rows, KC/32] scale tile is addressed through a multiplier `one` that the JIT does not specialise, so its
  load gets the thread mapping of the block sums.
- A row block's results are kept in registers and written once at the end; K chunks combine through the split-K
  arrival counters (`_common.split_k_counters`), the last program to arrive summing the partials by a fixed tree
  over the chunks (deterministic).
- PREFETCH (0, 1, 2): the next one or two row blocks' weights and scales are loaded before this one is multiplied
  (register double / triple buffering), so each program keeps loads in flight while it computes.

Offline sm_90 builds (Triton 3.9): 70-130 registers at the h200 plans, no shared memory or barrier inside the row
loop (`tests/test_kernels_gemv_rows.py` checks the PTX).

Measured slower than the tile-at-once kernel at every h200 shape, so it is opt-in (`rows=True`;
`quant_gemv.ROWS_DEFAULT`). H200, torch 2.11, Triton 3.6, `bench/kernels.py --pdl --sweep` (CUDA-graph replay over
weight copies larger than L2, M = 1, bf16 x; bench/results/2026-11-30_h200_s11/), best row plan against the tile:
wq_b 25.8 vs 22.1 us, wo_b 26.8 vs 20.9 us, wq_a 6.1 vs 5.7 us, shared_w1 10.3 vs 8.1 us, expert_w1 9.8 vs 8.2 us,
head 394 vs 222 us, grouped w1/w3 38.9 vs 37.1 us, grouped w2 43.0 vs 36.9 us. Without the prefetch, or with two
row blocks ahead (2 more registers), it is slower still (wq_b 31.2 / 28.8 us), as with 8 warps or with 4 or 16
programs per SM; so neither the layout conversions nor the bytes a program keeps in flight explain the tile
kernel's 46 % of copy bandwidth. Not measured: Nsight Compute on this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (E2M1_HALF_SCALE, e2m1_value_scaled_down, exp2_int, next_power_of_2, round_bf16,
                      split_k_merge_2d, split_k_workspace, use_pdl_for)
from .gemv_tiles import fake_quant_fp8_tile

__all__ = ["rows_plan", "check_rows_options", "launch_rows", "ROWS_PROGRAMS_PER_SM"]

#: Programs per SM the default plan sizes its grid for (the row loop is split so that about this many programs per
#: SM cover the weight once; each keeps one row block in flight while it multiplies another).
ROWS_PROGRAMS_PER_SM = 8
_DEFAULT_SMS = 132
#: Default K chunk (values) and row block by weight format (False: block FP8, True: FP4): 256 weight bytes per row
#: and 16 rows per block, the fastest row plan at wq_b and the grouped w1/w3 in the H200 sweep (module docstring).
_KC = {False: 256, True: 512}
_RB = {False: 16, True: 16}
_MAX_ROW_ITERS = 64


@triton.jit
def _rows_tile(w_base, s_base, row_first, rows, r_ok, g, j, k0, N, K, stride_wn, stride_sn, one, FP4: tl.constexpr):
    """(codes uint8 [RB, G, 16], scale bytes) of rows `rows` (row_first = rows[0]) and the K chunk from k0:
    FP4 scales [RB, G] (one per row and 32-block), block-FP8 scales [G] (one per 32-row block, two 16-byte groups per
    32-block; RB divides 32). Masked loads read 0."""
    if FP4:
        gk_ok = (k0 + g * 32) < K
        w = tl.load(w_base + rows[:, None, None].to(tl.int64) * stride_wn + (k0 // 2 + g[None, :, None] * 16
                                                                           + j[None, None, :]),
                    mask=r_ok[:, None, None] & gk_ok[None, :, None], other=0)
        # `one` (= 1, not specialised): the scale tile keeps the block sums' thread mapping (module docstring).
        s = tl.load(s_base + rows[:, None].to(tl.int64) * stride_sn + (k0 // 32 + g[None, :] * one),
                    mask=r_ok[:, None] & gk_ok[None, :], other=0)
    else:
        gk_ok = (k0 + g * 16) < K
        w = tl.load(w_base + rows[:, None, None].to(tl.int64) * stride_wn + (k0 + g[None, :, None] * 16
                                                                           + j[None, None, :]),
                    mask=r_ok[:, None, None] & gk_ok[None, :, None], other=0)
        s = tl.load(s_base + (row_first // 32).to(tl.int64) * stride_sn + (k0 // 32 + g // 2),
                    mask=gk_ok & ((g * 0 + row_first) < N), other=0)
    return w, s


@triton.jit
def _rows_block(w_base, s_base, row0, b, r, e_ok, g, j, k0, N, K, stride_wn, stride_sn, one, FP4: tl.constexpr,
                RB: tl.constexpr, ROW_ITERS: tl.constexpr):
    """`_rows_tile` of the program's row block `b` (rows row0 + b * RB + r); blocks at or past ROW_ITERS (the
    prefetches after the last one) and rows past N or of an invalid expert (`e_ok` False) load nothing."""
    first = row0 + b * RB
    rows = first + r
    ok = (rows < N) & e_ok & ((r * 0 + b) < ROW_ITERS)
    return _rows_tile(w_base, s_base, first, rows, ok, g, j, k0, N, K, stride_wn, stride_sn, one, FP4)


@triton.jit
def _rows_dot(w, s, xa, xb, FP4: tl.constexpr, X_FP16: tl.constexpr):
    """[RB] FP32 dot products of the codes `w` (with scale bytes `s`, as `_rows_tile` returns them) with x: FP8:
    xa [G, 16] (xb unused); FP4: xa / xb [G, 16] the x values of the low / high nibbles. X_FP16 repeats the
    reference's fp16 roundings of the dequantised weight (code x scale, rounded to fp16 per element)."""
    sw = exp2_int(s.to(tl.int32))
    if FP4:
        c = w.to(tl.int32)
        lo = e2m1_value_scaled_down(c & 15)
        hi = e2m1_value_scaled_down(c >> 4)
        if X_FP16:
            s16 = (sw.to(tl.float16).to(tl.float32) * E2M1_HALF_SCALE)[:, :, None]
            lo = (lo * s16).to(tl.float16).to(tl.float32)
            hi = (hi * s16).to(tl.float16).to(tl.float32)
            p = tl.sum(lo * xa[None, :, :] + hi * xb[None, :, :], axis=2)
        else:
            # exact unless the scale exceeds 2^113 (UE8M0 byte > 240), as in quant_gemv
            p = tl.sum(lo * xa[None, :, :] + hi * xb[None, :, :], axis=2) * (sw * E2M1_HALF_SCALE)
    else:
        wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if X_FP16:
            wf = (wf * sw.to(tl.float16).to(tl.float32)[None, :, None]).to(tl.float16).to(tl.float32)
            p = tl.sum(wf * xa[None, :, :], axis=2)
        else:
            p = tl.sum(wf * xa[None, :, :], axis=2) * sw[None, :]
    return tl.sum(p, axis=1)


@triton.jit(do_not_specialize=["one"])
def _rows_gemv_kernel(
    x_ptr, w_ptr, s_ptr, idx_ptr, y_ptr, part_ptr, cnt_ptr,
    N, K, E, X_ROW_DIV, stride_xr, stride_we, stride_wn, stride_se, stride_sn, one,
    FP4: tl.constexpr, GROUPED: tl.constexpr, ACT_QUANT: tl.constexpr, SPLIT_K: tl.constexpr,
    SPLIT_POW2: tl.constexpr, KC: tl.constexpr, RB: tl.constexpr, ROW_ITERS: tl.constexpr, ITERS_P2: tl.constexpr,
    PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (row range, K chunk, pair): rows [pid_r * RB * ROW_ITERS, + RB * ROW_ITERS) of output pair `pair`
    # against x[pair // X_ROW_DIV, pid_k * KC : + KC] (module docstring).
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    pair = tl.program_id(2)
    NKB: tl.constexpr = KC // 32
    G: tl.constexpr = KC // 32 if FP4 else KC // 16
    X_FP16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    k0 = pid_k * KC
    g = tl.arange(0, G)
    j = tl.arange(0, 16)
    r = tl.arange(0, RB)
    its = tl.arange(0, ITERS_P2)
    row0 = pid_r * (RB * ROW_ITERS)
    if GROUPED:
        # The expert index is the previous kernel's output (router top-k): wait before reading it.
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        e = tl.load(idx_ptr + pair)
        e = tl.where(e < 0, e + E, e)
        e_ok = (r * 0 + e >= 0) & (r * 0 + e < E)  # [RB] (the interpreter mis-types scalar & block bools)
        e_safe = tl.where((e >= 0) & (e < E), e, 0).to(tl.int64)
        w_base = w_ptr + e_safe * stride_we
        s_base = s_ptr + e_safe * stride_se
    else:
        e_ok = r >= 0
        w_base = w_ptr
        s_base = s_ptr
    w_cur, s_cur = _rows_block(w_base, s_base, row0, 0, r, e_ok, g, j, k0, N, K, stride_wn, stride_sn, one, FP4,
                               RB, ROW_ITERS)
    if PREFETCH >= 2:
        w_nx1, s_nx1 = _rows_block(w_base, s_base, row0, 1, r, e_ok, g, j, k0, N, K, stride_wn, stride_sn, one, FP4,
                                   RB, ROW_ITERS)
    if not GROUPED:
        # Weights never come from the previous kernel: under PDL their first loads overlap its tail.
        if USE_PDL:
            tl.extra.cuda.gdc_wait()

    # x chunk, fake-quantised once per program, then laid out like one row of the weight tile.
    kb = tl.arange(0, NKB)
    kx = k0 + kb[:, None] * 32 + tl.arange(0, 32)[None, :]
    xv = tl.load(x_ptr + (pair // X_ROW_DIV).to(tl.int64) * stride_xr + kx, mask=kx < K, other=0.0).to(tl.float32)
    if ACT_QUANT:
        xv = fake_quant_fp8_tile(xv)
    if X_FP16:
        xv = xv.to(tl.float16).to(tl.float32)
    if FP4:
        xa, xb = tl.split(tl.reshape(xv, [G, 16, 2]))
    else:
        xa = tl.reshape(xv, [G, 16])
        xb = xa

    acc = tl.zeros([RB, ITERS_P2], dtype=tl.float32)
    for it in range(ROW_ITERS):
        if PREFETCH >= 2:
            w_nx2, s_nx2 = _rows_block(w_base, s_base, row0, it + 2, r, e_ok, g, j, k0, N, K, stride_wn, stride_sn,
                                       one, FP4, RB, ROW_ITERS)
            yr = _rows_dot(w_cur, s_cur, xa, xb, FP4, X_FP16)
            w_cur = w_nx1
            s_cur = s_nx1
            w_nx1 = w_nx2
            s_nx1 = s_nx2
        elif PREFETCH == 1:
            w_nx1, s_nx1 = _rows_block(w_base, s_base, row0, it + 1, r, e_ok, g, j, k0, N, K, stride_wn, stride_sn,
                                       one, FP4, RB, ROW_ITERS)
            yr = _rows_dot(w_cur, s_cur, xa, xb, FP4, X_FP16)
            w_cur = w_nx1
            s_cur = s_nx1
        else:
            if it > 0:
                w_cur, s_cur = _rows_block(w_base, s_base, row0, it, r, e_ok, g, j, k0, N, K, stride_wn, stride_sn,
                                           one, FP4, RB, ROW_ITERS)
            yr = _rows_dot(w_cur, s_cur, xa, xb, FP4, X_FP16)
        # Column `it` holds this row block; [RB, ITERS_P2] keeps the rows in the block sums' thread mapping.
        acc = tl.where((its == it)[None, :], yr[:, None], acc)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    out_rows = row0 + its[None, :] * RB + r[:, None]
    out_ok = (out_rows < N) & (its < ROW_ITERS)[None, :]
    y_ptrs = y_ptr + pair.to(tl.int64) * N + out_rows
    if SPLIT_K == 1:
        total = acc
        store_ok = out_ok
    else:
        # The last of the SPLIT_K programs of this row range sums every chunk's partial (fixed tree, .cg reads).
        p_ptrs = part_ptr + pair.to(tl.int64) * N + out_rows
        total, arrived = split_k_merge_2d(acc, p_ptrs, tl.num_programs(2).to(tl.int64) * N, out_ok, cnt_ptr,
                                          pair * tl.num_programs(0) + pid_r, pid_k, SPLIT_K, SPLIT_POW2)
        store_ok = out_ok & ((out_rows * 0 + arrived) == SPLIT_K - 1)
    if y_ptr.dtype.element_ty == tl.bfloat16:
        total = round_bf16(total)  # RNE on the bits; exact for the cast below
    if GROUPED:
        total = tl.where(e_ok[:, None], total, float("nan"))
    tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=store_ok)


#: Upper bounds of the plan options (a larger tile would not fit a program's registers).
_MAX_KC = 2048
_MAX_RB = 64


def _int_option(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    return v


def check_rows_options(fp4: bool, *, kc: int | None = None, block_r: int | None = None, row_iters: int | None = None,
                       num_warps: int | None = None, prefetch: int | None = None, programs_per_sm: int | None = None,
                       sm_count: int | None = None) -> None:
    """Raise TypeError / ValueError naming the first invalid `rows_plan` option (arguments as there): kc a power of
    two in 32..2048 (64..2048 for FP4), block_r a power of two in 1..64 (1..32 for block FP8: one scale row per
    block), row_iters in 1..64, prefetch 0..2, num_warps a power of two in 1..32, programs_per_sm and sm_count
    >= 1; every one an int (not a bool)."""
    lo = 64 if fp4 else 32
    for name, v in (("kc", kc), ("block_r", block_r), ("row_iters", row_iters), ("num_warps", num_warps),
                    ("prefetch", prefetch), ("programs_per_sm", programs_per_sm), ("sm_count", sm_count)):
        if v is not None:
            _int_option(name, v)
    if kc is not None and (not lo <= kc <= _MAX_KC or kc & (kc - 1)):
        raise ValueError(f"kc={kc} must be a power of two in {lo}..{_MAX_KC}")
    rb_max = _MAX_RB if fp4 else 32
    if block_r is not None and (not 1 <= block_r <= rb_max or block_r & (block_r - 1)):
        raise ValueError(f"block_r={block_r} must be a power of two <= {rb_max}"
                         + ("" if fp4 else " (one block-FP8 scale row)"))
    if row_iters is not None and not 1 <= row_iters <= _MAX_ROW_ITERS:
        raise ValueError(f"row_iters={row_iters} must be in 1..{_MAX_ROW_ITERS}")
    if prefetch is not None and prefetch not in (0, 1, 2):
        raise ValueError(f"prefetch={prefetch!r} must be 0, 1 or 2 (row blocks loaded ahead)")
    if num_warps is not None and (not 1 <= num_warps <= 32 or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps={num_warps} must be a power of two in 1..32")
    for name, v in (("sm_count", sm_count), ("programs_per_sm", programs_per_sm)):
        if v is not None and v < 1:
            raise ValueError(f"{name}={v} must be >= 1")


def rows_plan(n: int, k: int, fp4: bool, *, pairs: int = 1, sm_count: int | None = None, kc: int | None = None,
              block_r: int | None = None, row_iters: int | None = None, num_warps: int | None = None,
              prefetch: int | None = None, programs_per_sm: int | None = None) -> dict:
    """Launch parameters of the row-streaming kernel for `pairs` x rows against an [n, k] weight (one each).

    - KC (values of K per program; `kc`): 256 for block FP8 (256 bytes per row), 512 for FP4 (256 bytes), capped at
      K rounded up to a power of two; SPLIT_K = ceil(K / KC) programs share one output row range.
    - RB (rows per block; `block_r`): 16. Block FP8 needs RB to divide 32 (one scale row per block).
    - ROW_ITERS (row blocks per program; `row_iters`): the row blocks of all pairs and K chunks over
      `programs_per_sm` (default `ROWS_PROGRAMS_PER_SM`) programs on each of `sm_count` SMs (default 132, the H200),
      between 1 and 64.
    - PREFETCH (`prefetch`, 0-2, default 1): row blocks loaded ahead of the one being multiplied. num_warps: 4.
    Returns a dict with KC, RB, ROW_ITERS, ITERS_P2, SPLIT_K, SPLIT_POW2, PREFETCH, num_warps and the grid
    (row programs, SPLIT_K, pairs).
    Raises: ValueError for n or k below 1 (the launchers return empty or zero outputs before planning) and for the
    options `check_rows_options` rejects (TypeError for a non-int one).
    """
    check_rows_options(fp4, kc=kc, block_r=block_r, row_iters=row_iters, num_warps=num_warps, prefetch=prefetch,
                       programs_per_sm=programs_per_sm, sm_count=sm_count)
    if n < 1 or k < 1:
        raise ValueError(f"rows_plan needs a non-empty [n, k] weight, got n={n}, k={k}")
    if kc is None:
        kc = min(_KC[fp4], max(next_power_of_2(k), 64 if fp4 else 32))
    rb = _RB[fp4] if block_r is None else block_r
    split_k = -(-k // kc)
    blocks = -(-n // rb)
    if row_iters is None:
        target = (sm_count or _DEFAULT_SMS) * (programs_per_sm or ROWS_PROGRAMS_PER_SM)
        row_iters = max(1, min(_MAX_ROW_ITERS, round(blocks * split_k * max(pairs, 1) / target)))
    row_iters = min(row_iters, blocks)
    programs = -(-blocks // row_iters)
    return dict(KC=kc, RB=rb, ROW_ITERS=row_iters, ITERS_P2=next_power_of_2(row_iters), SPLIT_K=split_k,
                SPLIT_POW2=next_power_of_2(split_k), PREFETCH=1 if prefetch is None else prefetch,
                num_warps=num_warps or 4, grid=(programs, split_k, max(pairs, 1)))


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result/workspace allocation; a seam the tests replace to poison outputs with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def launch_rows(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool, fp4: bool,
                plan: dict, *, indices: torch.Tensor | None = None, x_row_div: int = 1,
                pairs: int = 1, pdl_allowed: bool = True) -> torch.Tensor:
    """y [pairs, N] in x2.dtype: one row-streaming launch (`plan` from `rows_plan`); callers check the arguments.

    Plain (indices None): x2 [1, K], weight uint8 [N, K] (block FP8, scale [ceil(N/32), K/32]) or [N, K/2] (FP4,
    scale [N, K/32]). Grouped (FP4 only): weight [E, N, K/2], scale [E, N, K/32], indices int64 [pairs] (negative
    wrap, invalid ones give NaN rows), x2 [pairs / x_row_div, K]. Last dims contiguous.
    pdl_allowed False: launch without PDL (the caller just made the weight or scale with a copy kernel, which the
    plain kernel's pre-wait weight loads would race).
    """
    grouped = indices is not None
    n = weight.shape[-2]
    k = x2.shape[-1]
    y = _empty((pairs, n), x2.dtype, x2.device)
    programs, split_k, _ = plan["grid"]
    part, cnt = split_k_workspace(_empty, x2.device, split_k, (pairs, n), programs * pairs)
    pdl = pdl_allowed and use_pdl_for(_rows_gemv_kernel, x2.device)
    extra = {"launch_pdl": True} if pdl else {}
    idx = indices if grouped else part  # unused pointer when not grouped
    e = weight.shape[0] if grouped else 1
    _rows_gemv_kernel[plan["grid"]](
        x2, weight, scale, idx, y, part, cnt,
        n, k, e, x_row_div, x2.stride(0), weight.stride(0) if grouped else 0, weight.stride(-2),
        scale.stride(0) if grouped else 0, scale.stride(-2), 1,
        FP4=fp4, GROUPED=grouped, ACT_QUANT=bool(act_quant), SPLIT_K=split_k, SPLIT_POW2=plan["SPLIT_POW2"],
        KC=plan["KC"], RB=plan["RB"], ROW_ITERS=plan["ROW_ITERS"], ITERS_P2=plan["ITERS_P2"],
        PREFETCH=plan["PREFETCH"], USE_PDL=pdl, num_warps=plan["num_warps"], **extra)
    return y
