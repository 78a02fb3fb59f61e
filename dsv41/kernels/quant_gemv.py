"""Quantised-weight GEMV for decode (M <= 8): the `dispatch` fusion target (`dsv41 report --patterns dispatch`).

The model's fallback path (dsv41/model/linear.py) computes
`F.linear(fake_quant_fp8_1x32(x), dequantize(weight, scale))`: it materialises the dequantised weight in
the activation dtype every step. These ops compute the same numbers while reading the uint8 weight bytes
once: one Triton kernel fake-quantises x (FP8 E4M3, one UE8M0 scale per 32 along K) and multiplies it by
the block-FP8 or FP4 weight, accumulating in FP32.

Ops (MODEL.md §2.1 "Block layouts actually used", "Quantized GEMM semantics"):

- `dsv41::linear_fp8_block(x, weight, scale, act_quant) -> y`
    x [..., K] fp32 / bf16 / fp16 (K % 32 == 0); weight uint8 [N, K] (E4M3 bytes);
    scale uint8 [ceil(N/32), ceil(K/32)] (UE8M0 per 32x32 tile); y [..., N] in x.dtype.
- `dsv41::linear_fp4(x, weight, scale, act_quant) -> y`
    weight uint8 [N, K/2] (packed E2M1, low nibble = even k); scale uint8 [N, K/32] (UE8M0 per 1x32).

On CPU both run the reference (`reference_linear_*`, the model's own math). On CUDA, M = prod(x.shape[:-1])
<= 8 runs the Triton kernel (`triton_linear_*`); larger M dequantises and calls cuBLAS through F.linear.

Kernel layout. Program (n-tile, k-tile, m-tile) owns one weight tile [BLOCK_N, BLOCK_K] (shaped
[BLOCK_N, NKB, 32], BLOCK_K = 32 * NKB) and issues all of its loads at once; the GPU overlaps many such
programs per SM, which keeps enough bytes in flight without a software-pipelined K loop. Per K block of 32 it
needs the sum of code_w * xq over the block and one multiplication by the weight scale (powers of two
commute with FP32 rounding, so this equals summing the dequantised products); the activation scale is
already inside xq. For fp16 activations the reference rounds the dequantised weight and activation to fp16;
the kernel repeats those roundings (`X_FP16`).

Split-K (why and how). The K tiles of one output tile are separate programs (SPLIT_K = K / BLOCK_K). Each
stores its FP32 partial to a workspace, then bumps a per-output-tile counter; the program that arrives last
sums the partials in K order (deterministic) and writes y, then resets the counter. One launch, no memset:
the counters live in a per-(device, stream) buffer that each launch leaves at zero.

On sm_89+ one bf16 / fp32 x row with act_quant and a block-FP8 weight of 8 MiB or more runs the tensor-core
fragment GEMV of `gemv_frag` (E4M3 bytes straight into `mma.sync` operands; `FRAG_DEFAULT`). Otherwise, on sm_90+ a
block-FP8 weight of 16 MiB or more, or any block-FP8 GEMV with several x rows, runs the TMA kernel of `gemv_tma`
instead (weight tiles copied by TMA in a software-pipelined K loop; faster there, see that module and
`TMA_DEFAULT`); the arithmetic per tile is this module's `tile_products`.

Three other loops exist, all measured slower on the H200: the row-streaming kernel of `gemv_rows` for M = 1 (x held
in registers, weight rows streamed, no layout conversion in its loop; `rows=True`, see `split_rows_overrides`),
and two tile loops opt-in through `gemv_plan` (`stages`, `mma`):
- pipelined FMA tiles (STAGES > 1): 64-row tiles in a K loop that Triton's software pipeliner turns into cp.async
  copies to shared memory (the scales are then read as int32 words, `scale_words`: byte loads are not copied
  asynchronously and stall every iteration);
- tensor-core tiles (`mma=True`, bf16 x only, `mma_tile`): the weight tile dequantised to bf16 and x fake-quantised
  to bf16 (both exact: E4M3/E2M1 codes times powers of two), multiplied by a wgmma with FP32 accumulation, which
  is the reference's own bf16 F.linear.

Measured on the H200 (bench/kernels.py --sweep --pdl, CUDA-graph replay over weight copies larger than L2,
M = 1, bf16 x, act_quant; fraction of the 4.2 TB/s copy bandwidth; bench/results/2026-11-29_h200_kernels_v2,
2026-11-30_h200_s7_gemv): tile at once, head 129280x5120 71 %, wq_b / wo_b 46-47 % (21.3 us), the 3-7 MB weights
(wq_a, shared experts, FP4 experts) 5.7-8.3 us, latency-bound, on par with or faster than a bf16 cuBLAS GEMV that
reads 2-4x the bytes. At their best (128-row tiles, 3 stages) the pipelined FMA tiles take wq_b 22.5 us, wo_b 24.4
us and the tensor-core tiles 25.4 / 27.1 us; both are slower at every h200 shape and on the grouped experts.
Nsight Compute on wq_b (tile at once): DRAM 44 % of peak, 120 registers
(4 programs, 25 % occupancy per SM), 39 % of warp stalls on shared-memory results (the layout conversions of x and
the scales into the weight tile's layout and the block-sum reductions). Not reached: the 80 % target; M = 4-8
costs M FMAs per weight byte.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl


from ._common import is_interpreted, next_power_of_2, register_cuda, require_launchable, split_k_workspace, use_pdl_for
from .gemv_args import (check_linear_args, check_norm_args, reference_linear_fp4,  # noqa: F401 (re-exported)
                        reference_linear_fp8_block)
from .gemv_tiles import gemv_tile, mma_tile, program_tile, scale_words, store_gemv_result  # noqa: F401 (scale_words)

__all__ = [
    "linear_fp8_block", "linear_fp4",
    "reference_linear_fp8_block", "reference_linear_fp4",
    "triton_linear_fp8_block", "triton_linear_fp4",
    "gemv_plan", "scale_words", "device_sm_count", "check_mma_dtype", "split_rows_overrides", "MAX_TRITON_M",
    "ROWS_KEYS", "ROWS_DEFAULT", "TMA_DEFAULT", "TMA_MIN_WEIGHT_BYTES_M1", "split_tma_overrides",
    "FRAG_DEFAULT", "FRAG_MIN_WEIGHT_BYTES_M1", "split_frag_overrides",
]

#: Largest M the CUDA implementation sends to the Triton GEMV (decode, MTP/DSpark drafts); above it the
#: op dequantises and calls cuBLAS (prefill).
MAX_TRITON_M = 8
#: Tile shape by weight format (False: fp8, True: fp4) and warps per program, from the H200 sweeps of
#: bench/kernels.py (Triton 3.6, 2026-11-29, bench/results/2026-11-29_h200_kernels*/): [128, 128] tiles with 4
#: warps were the fastest or within 5 % of it at every h200 shape for both formats (FP4 at 128 rows: 8.2 us vs
#: 10.4 us at 64 rows on expert_w1), [64, 512] tiles ran 10x slower, 8 warps 2-4x slower. See `gemv_plan`.
_BLOCK_N = {False: 128, True: 128}
_BLOCK_K = 128
_NUM_WARPS = 4
#: K tiles per program (`gemv_plan`): 4 while that still leaves >= 4096 programs, else 2 while >= 320,
#: else 1. Measured (sweep with PDL, CUDA-graph replay): head 129280x5120 239 -> 221 us (65 % -> 71 % of the
#: copy bandwidth) at 4, shared_w1 / expert_w1 9.1 / 9.3 -> 8.2 us at 2, wq_a best at 1 (400 programs).
_K_ITERS_RULE = ((4, 4096), (2, 320))
#: Software-pipeline depth of the tensor-core K loop (`gemv_plan`, STAGES): tiles a program has in flight + 1.
_MMA_STAGES = 3
#: Rows per tile of the pipelined kernel and the programs per SM its grid is sized for (all resident at once: at
#: BLOCK_N 64 the FP8 kernel takes 94 registers and 28 KiB of shared memory at 4 stages, Triton 3.9 for sm_90).
_PIPELINED_BLOCK_N = 64
_PROGRAMS_PER_SM = 4
#: Whether the tile kernel lets the next kernel launch when its programs start (`gemv_plan` EARLY_LAUNCH). Off: on
#: the H200 (bench/results/2026-12-02_h200_s20, PDL, CUDA-graph chains) it gave shared_w1 7.8 vs 8.2 us and shared_w2
#: 8.2 vs 8.7 us alone, but one layer's five-GEMV chain took 59.6 vs 58.1 us with it on the tile GEMVs.
_EARLY_LAUNCH = False
_DEFAULT_SMS = 132


# ------------------------------------------------------------------------------------------- kernel
@triton.jit
def _quant_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, nw_ptr, eps,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    FP4: tl.constexpr, ACT_QUANT: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr,
    K_ITERS: tl.constexpr, STAGES: tl.constexpr, SCALE_WORDS: tl.constexpr, MMA: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EARLY_LAUNCH: tl.constexpr,
    USE_PDL: tl.constexpr, NORM: tl.constexpr = 0, KP: tl.constexpr = 32,
):
    # Program (n-tile, k-split, m-tile) multiplies K_ITERS consecutive [BLOCK_N, BLOCK_K] weight tiles, each
    # loaded with every request in flight at once; the K splits of one output tile (SPLIT_K = grid dim 1) are
    # combined by the last program to finish.
    NKB: tl.constexpr = BLOCK_K // 32
    MMA_N: tl.constexpr = 16
    X_FP16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    pid_n, pid_k, pid_m, offs_n, offs_m, kb, j32, n_ok = program_tile(N, BLOCK_M, BLOCK_N, NKB)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if USE_PDL and EARLY_LAUNCH:
        # The next kernel may be placed as soon as every program here has started (its own wait still waits for
        # this grid to complete), so its pre-wait weight reads overlap this grid's last wave.
        tl.extra.cuda.gdc_launch_dependents()
    if MMA:
        # bf16 x: tensor-core tiles (`mma_tile`) in a software-pipelined K loop: the pipeliner copies tile
        # it + STAGES - 1 into shared memory (cp.async) while tile it is multiplied. A PDL wait inside the loop
        # stops the pipeliner (Triton 3.6-3.9), so it comes first.
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        acc_t = tl.zeros([BLOCK_N, MMA_N], dtype=tl.float32)
        for it in tl.range(0, K_ITERS, num_stages=STAGES):
            acc_t = mma_tile(x_ptr, w_ptr, s_ptr, acc_t, offs_n, n_ok, (pid_k * K_ITERS + it) * BLOCK_K, pid_m, M,
                              K, stride_xm, stride_wn, stride_sn, FP4, ACT_QUANT, BLOCK_M, BLOCK_N, BLOCK_K, MMA_N,
                              SCALE_WORDS, DOT_F32)
        # Column mm of acc_t is x row pid_m * BLOCK_M + mm: move the BLOCK_M real ones into acc [BLOCK_M, BLOCK_N].
        cols = tl.arange(0, MMA_N)
        for mm in tl.static_range(BLOCK_M):
            row = tl.sum(tl.where((cols == mm)[None, :], acc_t, 0.0), axis=1)
            acc += tl.where((tl.arange(0, BLOCK_M) == mm)[:, None], row[None, :], 0.0)
    elif STAGES > 1:
        # Software-pipelined FMA tiles (`gemv_tile`); the PDL wait comes first, as above.
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        for it in tl.range(0, K_ITERS, num_stages=STAGES):
            acc = gemv_tile(x_ptr, w_ptr, s_ptr, acc, offs_n, n_ok, offs_m, kb, j32,
                             (pid_k * K_ITERS + it) * BLOCK_K, pid_m, M, K, stride_xm, stride_wn, stride_sn,
                             FP4, ACT_QUANT, X_FP16, BLOCK_M, BLOCK_N, NKB, False, SCALE_WORDS)
    else:
        # Tile at once: each K_ITERS tile issues every load at once; under PDL the wait follows the weight loads,
        # which overlap the previous kernel's tail. NORM (the RMSNorm prologue, this path only): each tile's x is
        # normalised by the row statistic, which every program computes over all of x itself (an L2 read).
        for it in range(K_ITERS):
            acc = gemv_tile(x_ptr, w_ptr, s_ptr, acc, offs_n, n_ok, offs_m, kb, j32,
                             (pid_k * K_ITERS + it) * BLOCK_K, pid_m, M, K, stride_xm, stride_wn, stride_sn,
                             FP4, ACT_QUANT, X_FP16, BLOCK_M, BLOCK_N, NKB, USE_PDL, SCALE_WORDS, nw_ptr, eps, NORM, KP)

    if USE_PDL and not EARLY_LAUNCH:
        tl.extra.cuda.gdc_launch_dependents()
    store_gemv_result(acc, y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, n_ok, pid_m, pid_n, pid_k, M, N, stride_ym,
                       SPLIT_K, SPLIT_POW2)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result/workspace allocation; a seam the tests replace to poison outputs with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def gemv_plan(m: int, n: int, k: int, fp4: bool, *, block_n: int | None = None, block_k: int | None = None,
              num_warps: int | None = None, k_iters: int | None = None, stages: int | None = None,
              sm_count: int | None = None, groups: int = 1, mma: bool = False, maxnreg: int | None = None,
              early_launch: bool | None = None) -> dict:
    """Launch parameters of the GEMV kernel for x [m, k] and an [n, k] weight (the documented heuristic).

    Grid = n tiles x K splits x m tiles; a program multiplies K_ITERS consecutive [BLOCK_N, BLOCK_K] weight tiles.
    - BLOCK_M = next power of two >= min(m, 8) (rows of x per program).
    - Default: CUDA-core FMA tiles, STAGES = 1 (the fastest measured layout, module docstring). `mma=True` (bf16 x
      only): tensor-core tiles, STAGES = `_MMA_STAGES` by default.
    - STAGES > 1: the K loop is software-pipelined, so a program streams its whole K range
      with STAGES - 1 tiles in flight. BLOCK_N = 64, BLOCK_K = 128, and the K split starts from the largest that
      keeps the grid at or under `_PROGRAMS_PER_SM` programs per SM (`sm_count` SMs, default 132: the H200), at
      least one, before the evening-out below (which may lower it): every program is resident from the start,
      with no tail wave and few split-K partials.
      `groups` independent GEMVs of this shape in one launch (`grouped_gemv`) count towards that grid.
    - STAGES = 1 (the tile-at-once layout, also `upcast_gemv`'s): BLOCK_N = 128 (64 for BLOCK_M >= 4), BLOCK_K =
      128, K_ITERS by `_K_ITERS_RULE` (many short programs that overlap each other instead of a pipeline).
    - SPLIT_K = ceil(K tiles / K_ITERS); K_ITERS is then evened out over the splits. When SPLIT_K > 1 the last
      program of an output tile sums the FP32 partials in one vector load (SPLIT_POW2 = SPLIT_K rounded up to a
      power of two).
    - `maxnreg`: a cap on registers per thread passed to the compiler (None: its own choice). The default FP8 tile
      takes 120 registers on the H200, which allows 4 programs per SM; 96 allows 5 and 80 allows 6, at the cost of
      spills (measured with ptxas for sm_90: 40 and 124 bytes). For sweeps.
    - EARLY_LAUNCH (`early_launch`, default `_EARLY_LAUNCH`): under PDL, `gdc_launch_dependents()` when a program
      starts instead of after its K loop (for sweeps: a PDL-launched kernel that skips its own wait could then
      start before the kernel two launches back has finished; see `gemv_tma`'s "PDL prologue").
    Explicit arguments override the heuristic (tests and benchmarks use this).
    Returns a dict with BLOCK_M, BLOCK_N, BLOCK_K, K_ITERS, STAGES, MMA, MAXNREG, EARLY_LAUNCH, SPLIT_K, SPLIT_POW2,
    num_warps and the grid
    (n tiles, K splits, m tiles).
    Raises: ValueError for a block_n / block_k that is not a power of two (block_k also a multiple of 32),
    k_iters < 1, stages < 1, sm_count < 1, maxnreg outside 24..255 or early_launch not a bool or None.
    """
    stages = (_MMA_STAGES if mma else 1) if stages is None else stages
    if stages < 1:
        raise ValueError(f"stages={stages} must be >= 1")
    if sm_count is not None and sm_count < 1:
        raise ValueError(f"sm_count={sm_count} must be >= 1")
    if maxnreg is not None and not 24 <= maxnreg <= 255:
        raise ValueError(f"maxnreg={maxnreg} must be in 24..255 (registers per thread)")
    if early_launch is not None and not isinstance(early_launch, bool):
        raise ValueError(f"early_launch={early_launch!r} must be True, False or None")
    block_m = min(next_power_of_2(max(m, 1)), MAX_TRITON_M)
    if block_n is None:
        block_n = _BLOCK_N[fp4] if stages == 1 else _PIPELINED_BLOCK_N
        if block_m >= 4:
            block_n = min(block_n, 64)
    if block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two")
    n_tiles = -(-n // block_n)
    m_tiles = -(-max(m, 1) // block_m)
    if block_k is None:
        block_k = _BLOCK_K
    if block_k % 32 or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power of two and a multiple of 32")
    k_tiles = -(-k // block_k)
    if k_iters is None:
        if stages == 1:
            k_iters = next((it for it, min_programs in _K_ITERS_RULE
                            if n_tiles * m_tiles * -(-k_tiles // it) >= min_programs), 1)
        else:
            target = (sm_count or _DEFAULT_SMS) * _PROGRAMS_PER_SM
            k_iters = -(-k_tiles // max(1, target // (n_tiles * m_tiles * max(groups, 1))))
    if k_iters < 1:
        raise ValueError(f"k_iters={k_iters} must be >= 1")
    k_iters = min(k_iters, k_tiles)
    split_k = -(-k_tiles // k_iters)
    k_iters = -(-k_tiles // split_k)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_ITERS=k_iters, STAGES=stages, MMA=bool(mma),
                MAXNREG=maxnreg, EARLY_LAUNCH=_EARLY_LAUNCH if early_launch is None else bool(early_launch),
                SPLIT_K=split_k,
                SPLIT_POW2=next_power_of_2(split_k), num_warps=num_warps or _NUM_WARPS,
                grid=(n_tiles, split_k, m_tiles))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA `device` (None for other devices: plans then assume an H200)."""
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def check_mma_dtype(x: torch.Tensor, overrides: dict) -> None:
    """Raise ValueError if `overrides` ask for tensor-core tiles (`mma=True`) with x not bf16: only bf16 holds the
    dequantised weights and fake-quantised x exactly in the MMA's operand type."""
    if overrides.get("mma") and x.dtype != torch.bfloat16:
        raise ValueError(f"mma=True (tensor-core tiles) needs bf16 x, got {x.dtype}")


#: Keys of `gemv_plan`-style overrides that select and shape the row-streaming kernel (`gemv_rows.rows_plan`).
ROWS_KEYS = ("kc", "block_r", "row_iters", "prefetch", "programs_per_sm")
#: Whether M = 1 runs the row-streaming kernel (`gemv_rows`) when no tile-loop option is given: no, it measured
#: slower than the tile-at-once kernel at every h200 shape (gemv_rows' docstring); `rows=True` selects it.
ROWS_DEFAULT = False


def split_rows_overrides(overrides: dict, m: int, fp4: bool) -> dict | None:
    """Pop the row-streaming choice from `overrides` (in place): the `gemv_rows.rows_plan` arguments when the
    row-streaming kernel runs (rows=True, or M = 1 by `ROWS_DEFAULT` without tile-loop overrides), else None. The
    returned options are checked (`gemv_rows.check_rows_options`, for the weight format `fp4`) before anything runs.
    Raises ValueError for rows=True with M > 1, with a tile-loop option (stages, mma, block_n, block_k, k_iters,
    maxnreg: any value other than None / False), or with any other option than the row-streaming ones, sm_count and
    num_warps (a misspelt option is an error, never a silently different plan); for row-streaming options without
    rows; and for invalid option values (TypeError for a non-int one)."""
    rows = overrides.pop("rows", None)
    picked = {key: overrides.pop(key) for key in ROWS_KEYS if key in overrides}
    tile_keys = sorted(key for key in ("stages", "mma", "block_n", "block_k", "k_iters", "maxnreg", "early_launch")
                       if overrides.get(key) is not None and overrides.get(key) is not False)
    if rows is None:
        rows = ROWS_DEFAULT and m == 1 and not tile_keys
    if not rows:
        if picked:
            also = " (programs_per_sm also to the TMA kernel, tma=True)" if "programs_per_sm" in picked else ""
            raise ValueError(f"{sorted(picked)} apply to the row-streaming kernel only (rows=True){also}")
        return None
    if m > 1:
        raise ValueError(f"rows=True (row-streaming kernel) takes one x row, got M = {m}")
    if tile_keys:
        raise ValueError(f"rows=True does not take the tile-loop options {tile_keys}")
    unknown = sorted(key for key, v in overrides.items() if key not in ("sm_count", "num_warps")
                     and v is not None and v is not False)
    if unknown:
        raise ValueError(f"unknown options for the row-streaming kernel: {unknown}; it takes "
                         f"{sorted(ROWS_KEYS + ('sm_count', 'num_warps'))}")
    for key in ("sm_count", "num_warps"):
        if overrides.get(key) is not None:
            picked[key] = overrides[key]
    from .gemv_rows import check_rows_options
    check_rows_options(fp4, **picked)
    return picked


#: Whether block-FP8 GEMVs run the TMA kernel (`gemv_tma`) when no plan option is given, on a GPU and for a weight
#: that allow it (`gemv_tma.tma_supported`, `tma_eligible`): yes for several x rows and, for one row, from
#: `TMA_MIN_WEIGHT_BYTES_M1` of weight. Measured on the H200 with PDL (bench/results/2026-12-01_h200_s16): one row,
#: wq_b 15.8 vs 22.0 us, wo_b 18.4 vs 21.0 us, head 178 vs 222 us, but wq_a (6.6 MB) 6.7 vs 5.7 us and shared_w1
#: (11.8 MB) 8.6 vs 8.2 us; six rows, TMA faster or equal at every shape (wq_b 61 vs 85 us). FP4 weights never
#: take it by default (its decode is arithmetic-bound; slower).
TMA_DEFAULT = True
#: One-row block-FP8 GEMVs take the TMA kernel by default from this many weight bytes (N x K): 16 MiB.
TMA_MIN_WEIGHT_BYTES_M1 = 16 << 20


def split_tma_overrides(overrides: dict, fp4: bool, device: torch.device, m: int,
                        weight: torch.Tensor) -> dict | None:
    """Pop the TMA choice from `overrides` (in place): the `gemv_tma.tma_gemv_plan` options when the TMA kernel is
    to run for x with `m` rows and `weight` (uint8 [N, K or K/2]), else None (the overrides are then left for the
    other kernels).

    tma=True: the TMA kernel with block_n, stages, programs_per_sm, num_warps, scale_words, l2_prefetch,
    early_launch and sm_count (popped);
    the launcher raises if the weight cannot be read by TMA. tma=None (the default): the TMA kernel for a block-FP8
    weight when `TMA_DEFAULT`, no other option than sm_count is set (any other, even misspelt, leaves the choice to
    the other kernels, which reject what they do not take), `gemv_tma.tma_supported(device)`, m > 1 or the weight
    has >= `TMA_MIN_WEIGHT_BYTES_M1` bytes, and TMA can read the weight as launched (`gemv_tma.tma_eligible`, or a
    last stride != 1, which the launcher copies to a fresh contiguous weight). tma=False: never.
    Raises ValueError for tma=True with an FP4 weight or with another kernel's option, and for scale_words or
    l2_prefetch without tma=True (named).
    """
    tma = overrides.pop("tma", None)
    if not tma:
        for key in ("scale_words", "l2_prefetch"):
            if overrides.pop(key, None) not in (None, False, 0):
                raise ValueError(f"{key} applies to the TMA kernel only (tma=True)")
    if tma:
        if fp4:
            raise ValueError("tma=True (the TMA GEMV) takes block-FP8 weights only, not FP4")
        from .gemv_tma import TMA_KEYS
        picked = {key: overrides.pop(key) for key in (*TMA_KEYS, "sm_count") if key in overrides}
        others = sorted(key for key, v in overrides.items() if v is not None and v is not False)
        if others:
            raise ValueError(f"tma=True does not take the options {others}; it takes {sorted(TMA_KEYS)} and sm_count")
        return picked
    if tma is None and TMA_DEFAULT and not fp4 and (m > 1 or weight.numel() >= TMA_MIN_WEIGHT_BYTES_M1) and not any(
            v not in (None, False) for key, v in overrides.items() if key != "sm_count"):
        from .gemv_tma import tma_eligible, tma_supported
        if tma_supported(device) and (weight.stride(-1) != 1 or tma_eligible(weight)):
            return {"sm_count": overrides.pop("sm_count", None)}
    return None


#: Whether one-row block-FP8 GEMVs with act_quant and bf16 / fp32 x run the tensor-core fragment kernel
#: (`gemv_frag`) when no plan option is given, on a GPU that has FP8 `mma.sync` (sm_89+), from
#: `FRAG_MIN_WEIGHT_BYTES_M1` of weight. H200, PDL, CUDA-graph replay, bf16 x, in one run
#: (bench/results/2026-12-02_h200_s24): wq_b 14.7 against 15.7 us (TMA), wo_b 16.4-16.7 against 18.3 us, head
#: 162.4 against 171.8 us (96.6 % of copy bandwidth), shared w1 / w2 (11.8 MB) 7.8-8.0 / 7.7 against 8.2 / 8.7 us;
#: but wq_a (6.6 MB) 5.8 against 5.7 us (tile kernel).
FRAG_DEFAULT = True
#: One-row block-FP8 GEMVs take the fragment kernel by default from this many weight bytes (N x K): 8 MiB.
FRAG_MIN_WEIGHT_BYTES_M1 = 8 << 20


def split_frag_overrides(overrides: dict, fp4: bool, x: torch.Tensor, m: int, weight: torch.Tensor,
                         act_quant: bool) -> dict | None:
    """Pop the fragment-GEMV choice from `overrides` (in place): the `gemv_frag.frag_gemv_plan` options when that
    kernel is to run for x (`m` rows) and `weight` (uint8 [N, K] or packed FP4), else None (the overrides are then
    left for the other kernels).

    frag=True: the fragment GEMV with num_warps, split_k, prefetch, even, maxnreg, early_launch and sm_count
    (popped); the launcher raises if the weight cannot be read as 16-byte vectors. frag=None (the default): that
    kernel where `FRAG_DEFAULT`, no other option than sm_count is set, x is one bf16 / fp32 row on a CUDA device with
    FP8 `mma.sync` (`gemv_frag.frag_gemv_supported`; meta tensors too, where the launch census models the H200),
    act_quant, a block-FP8 weight of at least `FRAG_MIN_WEIGHT_BYTES_M1` bytes, readable as 16-byte vectors as
    launched (`gemv_frag.frag_gemv_eligible`, or a last stride != 1, which the launcher copies).
    frag=False: never.
    Raises ValueError for frag=True with an FP4 weight, act_quant=False, several x rows, fp16 x or another kernel's
    option (named).
    """
    frag = overrides.pop("frag", None)
    if frag:
        if fp4:
            raise ValueError("frag=True (the block-FP8 fragment GEMV) takes block-FP8 weights only, not FP4 (the FP4 "
                             "experts' fragment kernel is dsv41::grouped_linear_fp4's)")
        if not act_quant:
            raise ValueError("frag=True needs act_quant=True: the FP8 activations are the MMA's operands")
        if m != 1:
            raise ValueError(f"frag=True takes one x row; got {m}")
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"frag=True takes bf16 or fp32 x; got {x.dtype} (fp16 x repeats the reference's fp16 "
                             "roundings on the tile kernel)")
        from .gemv_frag import FRAG_GEMV_KEYS
        picked = {key: overrides.pop(key) for key in (*FRAG_GEMV_KEYS, "sm_count") if key in overrides}
        others = sorted(key for key, v in overrides.items() if v is not None and v is not False)
        if others:
            raise ValueError(f"frag=True does not take the options {others}; it takes {sorted(FRAG_GEMV_KEYS)} and "
                             "sm_count")
        return picked
    if (frag is None and FRAG_DEFAULT and not fp4 and act_quant and m == 1 and x.device.type in ("cuda", "meta")
            and x.dtype in (torch.bfloat16, torch.float32) and weight.numel() >= FRAG_MIN_WEIGHT_BYTES_M1
            and not any(v not in (None, False) for key, v in overrides.items() if key != "sm_count")):
        from .gemv_frag import frag_gemv_eligible, frag_gemv_supported
        if frag_gemv_supported(x.device) and (weight.stride(-1) != 1 or frag_gemv_eligible(x, weight, True)):
            return {"sm_count": overrides.pop("sm_count", None)}
    return None


def _launch(x, weight, scale, act_quant: bool, fp4: bool, norm_weight=None, eps: float = 0.0, norm_mode: int = 0,
            **overrides) -> torch.Tensor:
    n, k = check_linear_args(x, weight, scale, fp4)
    if norm_mode:
        check_norm_args(x, act_quant, norm_weight, eps, norm_mode)
        # The prologue lives in the tile-at-once loop and the fragment GEMV's activation launch only.
        if overrides.get("tma") or overrides.get("rows") or overrides.get("mma") or (overrides.get("stages") or 1) > 1:
            raise ValueError("an RMSNorm prologue runs on the tile-at-once or the fragment kernel only (no tma, rows, "
                             "mma or stages > 1)")
        overrides.update(tma=False, rows=False)
    check_mma_dtype(x, overrides)
    lead = x.shape[:-1]
    m = math.prod(lead)
    overrides.setdefault("sm_count", device_sm_count(x.device))
    frag = split_frag_overrides(overrides, fp4, x, m, weight, act_quant)
    tma = split_tma_overrides(overrides, fp4, x.device, m, weight) if frag is None else None
    rows = split_rows_overrides(overrides, m, fp4) if tma is None else None
    require_launchable(_quant_gemv_kernel, x.device, "triton_linear_fp4" if fp4 else "triton_linear_fp8_block")
    x2 = x.reshape(m, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if m == 0 or n == 0:
        return _empty((m, n), x.dtype, x.device).reshape(*lead, n)
    if k == 0:  # an empty sum: zeros, as F.linear gives
        return torch.zeros((*lead, n), dtype=x.dtype, device=x.device)
    # A copy made here is written by the kernel just before ours: the weight may then not be read before the PDL
    # wait, which the GEMV does (weights never come from the previous kernel), so that launch goes without PDL.
    copied = weight.stride(-1) != 1 or scale.stride(-1) != 1
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    if frag is not None:
        from . import gemv_frag
        plan = gemv_frag.frag_gemv_plan(n, k, **frag)
        norm = (norm_weight, float(eps), int(norm_mode)) if norm_mode else None
        return gemv_frag.launch_frag_gemv(x2, weight, scale, plan, _empty, pdl_allowed=not copied, norm=norm
                                          ).reshape(*lead, n)
    if tma is not None:
        from . import gemv_tma
        plan = gemv_tma.tma_gemv_plan(m, n, k, **tma)
        return gemv_tma.launch_tma(x2, weight, scale, act_quant, plan, _empty, pdl_allowed=not copied
                                   ).reshape(*lead, n)
    if rows is not None:
        from . import gemv_rows
        plan = gemv_rows.rows_plan(n, k, fp4, **rows)
        return gemv_rows.launch_rows(x2, weight, scale, act_quant, fp4, plan, pdl_allowed=not copied
                                     ).reshape(*lead, n)
    y = _empty((m, n), x.dtype, x.device)
    plan = gemv_plan(m, n, k, fp4, **overrides)
    n_tiles, split_k, m_tiles = plan["grid"]
    # Scale words only where the K loop is pipelined (cp.async copies 4+ bytes); the tile-at-once layout keeps
    # its byte loads, as measured (equal times on the H200, fewer registers with Triton 3.9).
    words = scale_words(scale, k, plan["BLOCK_K"]) if plan["STAGES"] > 1 else None
    if words is not None:
        scale = words
    part, cnt = split_k_workspace(_empty, x.device, split_k, (m, n), n_tiles * m_tiles)
    pdl = use_pdl_for(_quant_gemv_kernel, x.device) and not copied
    extra = {"launch_pdl": True} if pdl else {}
    if plan["MAXNREG"] is not None:
        extra["maxnreg"] = plan["MAXNREG"]
    _quant_gemv_kernel[plan["grid"]](
        x2, weight, scale, y, part, cnt, x2 if norm_weight is None else norm_weight, float(eps),
        m, n, k, x2.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        FP4=fp4, ACT_QUANT=bool(act_quant), SPLIT_K=split_k, SPLIT_POW2=plan["SPLIT_POW2"], K_ITERS=plan["K_ITERS"],
        STAGES=plan["STAGES"], SCALE_WORDS=words is not None, MMA=plan["MMA"],
        DOT_F32=is_interpreted(_quant_gemv_kernel), BLOCK_M=plan["BLOCK_M"],
        BLOCK_N=plan["BLOCK_N"],
        BLOCK_K=plan["BLOCK_K"], EARLY_LAUNCH=plan["EARLY_LAUNCH"], USE_PDL=pdl, NORM=int(norm_mode),
        KP=next_power_of_2(k), num_warps=plan["num_warps"], **extra)
    return y.reshape(*lead, n)


def triton_linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool,
                            norm_weight: torch.Tensor | None = None, eps: float = 0.0, norm_mode: int = 0,
                            **overrides) -> torch.Tensor:
    """Run the Triton GEMV for a block-FP8 weight on the tensors' device (interpreted on CPU).

    Same arguments (the RMSNorm prologue included: on the tile-at-once kernel each program normalises the x it
    reads, on the fragment kernel the activation launch does), result and errors as `reference_linear_fp8_block`;
    a prologue with tma / rows / mma / stages > 1 raises ValueError. Any M works (x rows are tiled by up
    to 8). Kernel: with no option, the tensor-core fragment GEMV (`gemv_frag`) for one bf16 / fp32 x row with
    act_quant and a weight of `FRAG_MIN_WEIGHT_BYTES_M1` bytes or more on a GPU with FP8 `mma.sync` (sm_89+,
    `split_frag_overrides`); else the TMA GEMV (`gemv_tma`) on a GPU with TMA (sm_90+) for an eligible weight and
    several x rows or a weight of `TMA_MIN_WEIGHT_BYTES_M1` bytes or more; else the tile kernel. `frag=True` forces
    the fragment GEMV (also under the interpreter; options num_warps, split_k, prefetch, even, maxnreg, early_launch,
    sm_count of `gemv_frag.frag_gemv_plan`), `frag=False` the others. `tma=True` forces
    the TMA kernel (also under the interpreter; options block_n, stages, programs_per_sm, num_warps, scale_words,
    l2_prefetch, early_launch, sm_count of `gemv_tma.tma_gemv_plan`), `tma=False` the others. `overrides` (block_n,
    block_k, num_warps, k_iters, stages, mma, sm_count, maxnreg, early_launch) replace the tile kernel's `gemv_plan`
    heuristic;
    `rows=True` with M = 1 runs the row-streaming kernel instead (`gemv_rows`; its `rows_plan` takes kc, block_r,
    row_iters, prefetch, programs_per_sm, num_warps, sm_count). ValueError for mma=True with x not bf16
    (`check_mma_dtype`), for invalid plan values and for mixing kernels' options (`split_tma_overrides`,
    `split_rows_overrides`).
    Numerics: codes and scales bit-identical to the reference; FP32 accumulation in a different order, so
    results agree to FP32 rounding of the sum, then one rounding to x.dtype.
    """
    return _launch(x, weight, scale, act_quant, fp4=False, norm_weight=norm_weight, eps=eps, norm_mode=norm_mode,
                   **overrides)


def triton_linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool,
                      **overrides) -> torch.Tensor:
    """Run the Triton GEMV for a packed-FP4 weight on the tensors' device (interpreted on CPU).

    Same arguments, result and errors as `reference_linear_fp4`; see `triton_linear_fp8_block`.
    """
    return _launch(x, weight, scale, act_quant, fp4=True, **overrides)


# ------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("dsv41::linear_fp8_block", mutates_args=(), device_types="cpu")
def linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0, norm_mode: int = 0) -> torch.Tensor:
    """`y = fq8(rmsnorm?(x)) @ dequant(weight)^T` for a block-FP8 weight; see `reference_linear_fp8_block`."""
    return reference_linear_fp8_block(x, weight, scale, act_quant, norm_weight, eps, norm_mode)


@register_cuda(linear_fp8_block, "dsv41::linear_fp8_block")
def _linear_fp8_block_cuda(x, weight, scale, act_quant, norm_weight=None, eps=0.0, norm_mode=0):
    if x.numel() // max(x.shape[-1], 1) <= MAX_TRITON_M:
        return triton_linear_fp8_block(x, weight, scale, act_quant, norm_weight=norm_weight, eps=eps,
                                       norm_mode=norm_mode)
    return reference_linear_fp8_block(x, weight, scale, act_quant, norm_weight, eps, norm_mode)


@linear_fp8_block.register_fake
def _linear_fp8_block_fake(x, weight, scale, act_quant, norm_weight=None, eps=0.0, norm_mode=0):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("dsv41::linear_fp4", mutates_args=(), device_types="cpu")
def linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool) -> torch.Tensor:
    """`y = fq8(x) @ dequant_fp4(weight)^T` for a packed-FP4 weight; see `reference_linear_fp4` for shapes."""
    return reference_linear_fp4(x, weight, scale, act_quant)


@register_cuda(linear_fp4, "dsv41::linear_fp4")
def _linear_fp4_cuda(x, weight, scale, act_quant):
    if x.numel() // max(x.shape[-1], 1) <= MAX_TRITON_M:
        return triton_linear_fp4(x, weight, scale, act_quant)
    return reference_linear_fp4(x, weight, scale, act_quant)


@linear_fp4.register_fake
def _linear_fp4_fake(x, weight, scale, act_quant):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
