"""Block-FP8 GEMV whose weight tiles arrive by TMA (Hopper bulk tensor copies) in a software-pipelined K loop: the
default CUDA path of `dsv41::linear_fp8_block` for M <= 8 on sm_90+ (`quant_gemv`).

Why. The tile-at-once kernel (`quant_gemv._quant_gemv_kernel`) loads each weight tile through registers and leaves
the overlap of loads and arithmetic to other programs on the SM. It reached 44-47 % of the copy bandwidth on the
42 MB h200 projections (wq_b, wo_b) and 70-72 % on the 662 MB LM head. Here a program streams a K range of one
[BLOCK_N, 128]-byte row band: the pipeliner keeps STAGES - 1 tiles of TMA copies in flight in shared memory (no
registers, no per-thread address arithmetic) while the current tile is decoded and multiplied.

Measured on the H200 (bench/results/2026-12-01_h200_s16, `bench/kernels.py --pdl`, CUDA-graph replay over weight
copies beyond L2, bf16 x, fraction of the 4.25 TB/s copy bandwidth), TMA against the tile kernel:
- one row: head 178 us (88 %) vs 222 us (70 %); wq_b 15.8 us (62 %) vs 22.0 us; wo_b 18.4 us (54 %) vs 21.0 us;
  but wq_a (6.6 MB) 6.7 vs 5.7 us and shared_w1 (11.8 MB) 8.6 vs 8.2 us, hence `quant_gemv.TMA_MIN_WEIGHT_BYTES_M1`;
- six rows (DSpark verify): wq_b 61 vs 85 us, wo_b 66 vs 76 us, shared_w1 23 vs 28 us, head 792 vs 1016 us;
- one layer's five FP8 GEMVs back to back (PDL), all five on the TMA kernel: 58.5 vs 65.7 us (the shipped default,
  TMA for wq_b and wo_b only, was not measured as a chain).
A pure TMA read of the same 42 MB in one launch reaches 67 % (bench/probes/gemv_tma_probe.py), so at that size the
launch, ramp and tail of one kernel, not the arithmetic, hold the GEMV below 80 %. Scales read as int32 words (asynchronous
copies) were slower everywhere (wq_b 18.9 us). FP4 weights stay on the tile kernel: their decode is
arithmetic-bound and a TMA variant measured slower (expert_w1 11.5 vs 9.5 us, grouped experts 41-46 vs 37-38 us).

Kernel. Program (n-tile, k-split, m-tile) owns rows [n0, n0 + BLOCK_N) of W and K tiles [pid_k * K_ITERS,
(pid_k + 1) * K_ITERS) of 128 columns. Each tile is decoded and multiplied by `quant_gemv.tile_products` (the same
arithmetic as the tile kernel: FP8 1x32 activation quant inside, FP32 sums per 32-block times the power-of-two weight
scale), and the K splits merge through `quant_gemv.store_gemv_result` (arrival counters, last program sums the
partials in split order: deterministic). For one x row (decode; not fp16 x, whose
reference roundings take the several-row path) the per-32-block sums accumulate in [BLOCK_N, 4] and are summed once
after the loop. The scales are read as bytes, or as int32 words (`scale_words=True`, copied
asynchronously by the pipeliner). Out-of-range rows and columns of a tile are zero-filled by the TMA
unit (the descriptor carries the weight's shape). Under PDL the program waits before its K loop: a wait inside the
loop stops the pipeliner (Triton 3.6-3.9), so weight copies do not overlap the previous kernel here.

PDL prologue (opt-in, measured slower). `l2_prefetch=T` asks L2 for the first T K tiles of the program's rows before
`gdc_wait()` (`_common.prefetch_l2_rows`, one bulk prefetch per row) and `early_launch=True` (the default with it)
lets the next kernel launch before the K loop, so that its own prologue overlaps this grid's last programs. H200,
Triton 3.6, PDL, CUDA-graph chains (bench/pdl_prefetch_probe.py, bench/results/2026-12-02_h200_s20): slower at
every shape but the head (equal) and in one layer's five-GEMV chain: wq_b 15.8 us plain, 17.1 early launch only, 18.5 / 18.8 / 19.8 /
23.2 us with 1 / 2 / 4 / all tiles; wo_b 18.4 vs 19.8-26.1 us; head 178 vs 178-295 us; the layer chain 58.1 vs
61.6-79.5 us. The next programs wait on SM slots this grid's programs hold, and the prefetched bytes compete with
this grid's own stream for the same DRAM bandwidth. Hazard of `early_launch`: a PDL-launched kernel that skips its
own `gdc_wait()` (Inductor omits it when the kernel reads nothing its predecessor wrote) may then start before the
kernel two launches back has finished; the compiled model never passes these options.

TMA needs: the weight contiguous along K, its address and row stride multiples of 16 bytes, K >= 16 (`tma_eligible`);
the CUDA launcher falls back to the tile kernel otherwise. Under TRITON_INTERPRET=1 (CPU) the kernel runs when asked
for (`tma=True`), which is how the tests check it at odd shapes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import (check_int_options, exp2_int, is_interpreted, next_power_of_2, prefetch_l2_rows,
                      split_k_workspace, use_pdl_for)
from .gemv_tiles import (fake_quant_fp8_tile, load_scale_tile, program_tile, scale_words, store_gemv_result,
                         tile_products)

__all__ = ["tma_gemv_plan", "tma_supported", "tma_eligible", "launch_tma", "TMA_BLOCK_K", "TMA_KEYS"]

#: Columns (bytes) of a weight tile: one TMA box of [BLOCK_N, 128] bytes and four 32-blocks of K.
TMA_BLOCK_K = 128
#: Defaults of `tma_gemv_plan`, from the H200 sweeps (bench/results/2026-12-01_h200_s16, kernels_tma_pdl.json):
#: 64-row tiles, 3 stages, the grid sized for 4 programs per SM. Five per SM: wq_b 16.2 vs 15.8 us, wo_b 17.8 vs 18.4
#: us; 128-row tiles at 2 per SM: head 187 vs 178 us; 4 stages at 3 per SM and 32-row tiles slower.
_BLOCK_N = 64
_STAGES = 3
_PROGRAMS_PER_SM = 4
_DEFAULT_SMS = 132
#: Scales as int32 words (asynchronous copies) or bytes: bytes, as the H200 probe ran (see `tma_gemv_plan`).
_SCALE_WORDS = False
#: Override keys of `triton_linear_fp8_block` that shape the TMA plan (besides `tma` itself and `sm_count`).
TMA_KEYS = ("block_n", "stages", "programs_per_sm", "num_warps", "scale_words", "l2_prefetch", "early_launch")
#: K tiles (128 bytes) of each of its rows a program asks L2 for before the PDL wait (`l2_prefetch`): none, as
#: measured (module docstring "PDL prologue"). `early_launch` defaults to on with the prefetch, off without.
_L2_PREFETCH = 0


def tma_gemv_plan(m: int, n: int, k: int, *, sm_count: int | None = None, block_n: int | None = None,
                  stages: int | None = None, programs_per_sm: int | None = None, num_warps: int | None = None,
                  scale_words: bool | None = None, l2_prefetch: int | None = None,
                  early_launch: bool | None = None) -> dict:
    """Launch parameters of the TMA GEMV for x [m, k] and a block-FP8 weight [n, k].

    - BLOCK_M = next power of two >= min(m, 8); m tiles = ceil(m / BLOCK_M).
    - BLOCK_N (default 64) rows per program; BLOCK_K = `TMA_BLOCK_K`.
    - The K split is the largest that keeps n tiles x m tiles x split <= `sm_count` (default 132) x
      `programs_per_sm` (default 4), at least 1 and at most the K tiles; K_ITERS = ceil(K tiles / split), and the
      split is then evened out (ceil(K tiles / K_ITERS)). So the grid fills one wave of resident programs where the
      row bands alone do not, and each program streams its K range through the pipeline.
    - STAGES (default 3): tiles in flight + 1 (`tl.range(num_stages=)`).
    - SCALE_WORDS (default `_SCALE_WORDS`): read the scales as int32 words where `quant_gemv.scale_words` allows
      (copied asynchronously by the pipeliner) instead of bytes.
    - L2_PREFETCH (bytes per row, from `l2_prefetch` K tiles, default `_L2_PREFETCH`, at most K_ITERS): under PDL,
      each program asks L2 for the first tiles of its rows before `gdc_wait()` (`_common.prefetch_l2_rows`): the
      weight is never the previous kernel's output, so its read starts during that kernel's tail.
    - EARLY_LAUNCH (default: L2_PREFETCH > 0): under PDL, `gdc_launch_dependents()` before the K loop instead of
      after it, so that the next kernel's programs are placed (and its own prefetch runs) as this one's finish.
      Its `gdc_wait()` still waits for this grid to complete: only where programs start moves.
    Returns a dict with BLOCK_M, BLOCK_N, BLOCK_K, K_ITERS, SPLIT_K, SPLIT_POW2, STAGES, SCALE_WORDS, L2_PREFETCH,
    EARLY_LAUNCH, num_warps and grid (n tiles, K splits, m tiles).
    Raises: ValueError for block_n not a power of two in 8..256 (the TMA box's row limit), stages < 1,
    programs_per_sm < 1, sm_count < 1, num_warps not in 1, 2, 4, 8, l2_prefetch not an int >= 0, early_launch not
    a bool or None.
    """
    block_n = _BLOCK_N if block_n is None else block_n
    stages = _STAGES if stages is None else stages
    per_sm = _PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    num_warps = 4 if num_warps is None else num_warps
    if block_n & (block_n - 1) or not 8 <= block_n <= 256:
        raise ValueError(f"block_n={block_n} must be a power of two in 8..256 (TMA box rows)")
    if stages < 1:
        raise ValueError(f"stages={stages} must be >= 1")
    if per_sm < 1:
        raise ValueError(f"programs_per_sm={per_sm} must be >= 1")
    if sm_count is not None and sm_count < 1:
        raise ValueError(f"sm_count={sm_count} must be >= 1")
    if num_warps not in (1, 2, 4, 8):
        raise ValueError(f"num_warps={num_warps} must be 1, 2, 4 or 8")
    l2_prefetch = _L2_PREFETCH if l2_prefetch is None else l2_prefetch
    check_int_options(l2_prefetch=l2_prefetch)
    if l2_prefetch < 0:
        raise ValueError(f"l2_prefetch={l2_prefetch} must be >= 0 (K tiles per row)")
    if early_launch is not None and not isinstance(early_launch, bool):
        raise ValueError(f"early_launch={early_launch!r} must be True, False or None")
    block_m = min(next_power_of_2(max(m, 1)), 8)
    m_tiles = -(-max(m, 1) // block_m)
    n_tiles = -(-n // block_n)
    k_tiles = max(1, -(-k // TMA_BLOCK_K))
    slots = (sm_count or _DEFAULT_SMS) * per_sm
    split = max(1, min(k_tiles, slots // (n_tiles * m_tiles)))
    k_iters = -(-k_tiles // split)
    split = -(-k_tiles // k_iters)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=TMA_BLOCK_K, K_ITERS=k_iters, SPLIT_K=split,
                SPLIT_POW2=next_power_of_2(split), STAGES=stages, num_warps=num_warps,
                SCALE_WORDS=_SCALE_WORDS if scale_words is None else bool(scale_words),
                L2_PREFETCH=min(l2_prefetch, k_iters) * TMA_BLOCK_K,
                EARLY_LAUNCH=l2_prefetch > 0 if early_launch is None else bool(early_launch),
                grid=(n_tiles, split, m_tiles))


@functools.lru_cache(maxsize=None)
def _tensor_descriptor_class():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def tma_supported(device: torch.device) -> bool:
    """Whether the TMA GEMV can run by default on `device`: a CUDA GPU of compute capability >= 9.0 (Hopper's
    TMA unit) with Triton's host tensor descriptors (`triton.tools.tensor_descriptor`, Triton 3.6-3.9), and the
    kernel compiled (not interpreted). False on other devices (meta tensors included)."""
    if device.type != "cuda" or _tensor_descriptor_class() is None or is_interpreted(_tma_gemv_kernel):
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def tma_eligible(weight: torch.Tensor) -> bool:
    """Whether a uint8 weight [N, K] can be read through a TMA descriptor: contiguous along K, row stride and
    address multiples of 16 bytes, K >= 16 bytes (the box's inner extent) and N >= 1."""
    return (weight.dim() == 2 and weight.stride(-1) == 1 and weight.shape[0] >= 1 and weight.shape[1] >= 16
            and weight.stride(0) % 16 == 0 and weight.data_ptr() % 16 == 0)


@triton.jit
def _tma_gemv_kernel(x_ptr, w_desc, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn,
                     stride_sn, stride_ym, ACT_QUANT: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr,
                     K_ITERS: tl.constexpr, STAGES: tl.constexpr, SCALE_WORDS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, L2_PREFETCH: tl.constexpr,
                     EARLY_LAUNCH: tl.constexpr, USE_PDL: tl.constexpr):
    NKB: tl.constexpr = BLOCK_K // 32
    X_FP16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    pid_n, pid_k, pid_m, offs_n, offs_m, kb, j32, n_ok = program_tile(N, BLOCK_M, BLOCK_N, NKB)
    if USE_PDL:
        if L2_PREFETCH > 0:
            k_lo = pid_k * (K_ITERS * BLOCK_K)
            prefetch_l2_rows(w_ptr + offs_n.to(tl.int64) * stride_wn + k_lo, tl.minimum(K - k_lo, L2_PREFETCH), n_ok)
        if EARLY_LAUNCH:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if BLOCK_M == 1 and not X_FP16:
        # Decode (one x row): per-32-block sums times their scale accumulate in [BLOCK_N, NKB], summed over the
        # blocks once after the loop (no per-tile reduction across threads or layout change of the row sums;
        # the same arithmetic as `tile_products` in another FP32 order).
        acc2 = tl.zeros([BLOCK_N, NKB], dtype=tl.float32)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        for it in tl.range(0, K_ITERS, num_stages=STAGES):
            k0 = (pid_k * K_ITERS + it) * BLOCK_K
            k_ok = (k0 + kb * 32) < K
            w3 = tl.reshape(w_desc.load([pid_n * BLOCK_N, k0]), [BLOCK_N, NKB, 32]).to(tl.float8e4nv, bitcast=True)
            s_raw = load_scale_tile(s_ptr, offs_n, n_ok, kb, k0, k_ok, stride_sn, False, SCALE_WORDS)
            xv = tl.load(x_row + k0 + kb[:, None] * 32 + j32[None, :], mask=k_ok[:, None], other=0.0).to(tl.float32)
            if ACT_QUANT:
                xv = fake_quant_fp8_tile(xv)
            acc2 += tl.sum(w3.to(tl.float32) * xv[None, :, :], axis=2) * exp2_int(s_raw.to(tl.int32))
        acc = tl.sum(acc2, axis=1)[None, :]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for it in tl.range(0, K_ITERS, num_stages=STAGES):
            k0 = (pid_k * K_ITERS + it) * BLOCK_K
            k_ok = (k0 + kb * 32) < K
            w_raw = tl.reshape(w_desc.load([pid_n * BLOCK_N, k0]), [BLOCK_N, NKB, 32])
            s_raw = load_scale_tile(s_ptr, offs_n, n_ok, kb, k0, k_ok, stride_sn, False, SCALE_WORDS)
            acc = tile_products(x_ptr, w_raw, s_raw, k_ok, acc, offs_m, kb, j32, k0, pid_m, M, stride_xm, False,
                                 ACT_QUANT, X_FP16, BLOCK_M, BLOCK_N, NKB)
    if USE_PDL and not EARLY_LAUNCH:
        tl.extra.cuda.gdc_launch_dependents()
    store_gemv_result(acc, y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, n_ok, pid_m, pid_n, pid_k, M, N, stride_ym,
                       SPLIT_K, SPLIT_POW2)


def launch_tma(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool, plan: dict,
               empty, pdl_allowed: bool = True) -> torch.Tensor:
    """y [M, N] (x2's dtype) = fq8(x2) @ dequant(weight)^T through the TMA kernel with `plan` (`tma_gemv_plan`).

    x2 [M, K] fp32 / bf16 / fp16, contiguous along K; weight uint8 [N, K] E4M3 bytes (`tma_eligible`); scale uint8
    [ceil(N/32), K/32] UE8M0, contiguous along K. `empty(shape, dtype, device)` allocates y and the split-K
    partials (the caller's poisoning seam). `pdl_allowed` False launches without PDL (a weight copied just before).
    Raises RuntimeError when Triton has no host tensor descriptors, ValueError for a weight `tma_eligible` rejects.
    Arguments are otherwise checked by the caller (`quant_gemv._launch`).
    """
    desc_cls = _tensor_descriptor_class()
    if desc_cls is None:
        raise RuntimeError("the TMA GEMV needs triton.tools.tensor_descriptor (Triton >= 3.4)")
    if not tma_eligible(weight):
        raise ValueError(f"weight {tuple(weight.shape)} with strides {weight.stride()} cannot be read by TMA "
                         "(needs contiguous K, 16-byte aligned address and row stride, K >= 16)")
    m, k = x2.shape
    n = weight.shape[0]
    y = empty((m, n), x2.dtype, x2.device)
    words = scale_words(scale, k, plan["BLOCK_K"]) if plan["SCALE_WORDS"] else None
    s_arg = words if words is not None else scale
    desc = desc_cls.from_tensor(weight, [plan["BLOCK_N"], plan["BLOCK_K"]])
    n_tiles, split_k, m_tiles = plan["grid"]
    part, cnt = split_k_workspace(empty, x2.device, split_k, (m, n), n_tiles * m_tiles)
    pdl = pdl_allowed and use_pdl_for(_tma_gemv_kernel, x2.device)
    extra = {"launch_pdl": True} if pdl else {}
    _tma_gemv_kernel[plan["grid"]](
        x2, desc, weight, s_arg, y, part, cnt, m, n, k, x2.stride(0), weight.stride(0), s_arg.stride(0), y.stride(0),
        ACT_QUANT=bool(act_quant), SPLIT_K=split_k, SPLIT_POW2=plan["SPLIT_POW2"], K_ITERS=plan["K_ITERS"],
        STAGES=plan["STAGES"], SCALE_WORDS=words is not None, BLOCK_M=plan["BLOCK_M"], BLOCK_N=plan["BLOCK_N"],
        BLOCK_K=plan["BLOCK_K"], L2_PREFETCH=plan["L2_PREFETCH"], EARLY_LAUNCH=plan["EARLY_LAUNCH"], USE_PDL=pdl, num_warps=plan["num_warps"], **extra)
    return y
