"""FP32 GEMV over a bf16 / fp16 / fp32 weight read in its stored width: the `upcast_linear` fusion target.

Eager code that wants FP32 products from a half-precision weight writes `F.linear(x.float(), W.float())`
(dsv41/model: the LM head, model.py `final_logits`; the compressor's wkv / wgate, csa.py; DSpark's head; the same
spelling is common for routers and heads elsewhere). Run as written, every step upcasts the whole weight (reads
2 bytes per element, writes 4) and then runs an FP32 GEMM that reads the 4-byte copy: 5x the weight's bytes. On the
H200 the `h200` LM head alone (129280 x 4096) took 629 us in cuBLAS's FP32 GEMV plus the copy
(bench/results/2026-11-30_h200_bmm_fix). `dsv41::linear_upcast` reads the weight once, in its stored dtype.
FP32 weights (the ratio-2 compressor's wkv / wgate are held in FP32) have no copy to save; at M = 1 this GEMV
measured 6-8 % faster than cuBLAS's FP32 GEMM on the compressor's shapes (H200: 512 x 5120 6.21 vs 6.75 us,
512 x 1024 3.20 vs 3.41 us; bench/results/2026-11-30_h200_s11). Not measured: FP32 weights at M > 1 (BLOCK_K 32
doubles the K splits of a 2-byte weight, and the split-K merge loads them all at once).

Op (`dsv41::linear_upcast(x, weight) -> y`):
    x       float32 [..., K]
    weight  bfloat16 / float16 / float32 [N, K]
    y       float32 [..., N] = x @ weight.float().T  (`reference_linear_upcast`, the eager spelling itself)

On CPU the op runs the reference. On CUDA, M = prod(x.shape[:-1]) <= `MAX_TRITON_M` runs the Triton kernel and a
larger M (prefill) the reference, i.e. cuBLAS, as eager would.

Numerics. Widening bf16 / fp16 to fp32 is exact, so the kernel multiplies exactly the values the eager FP32
GEMM multiplies; each product and sum is rounded in FP32 as a GEMM's are, in another order (split-K partials are
summed by the last program in split order: deterministic run to run). When eager runs FP32 matmuls in TF32
(`torch.backends.cuda.matmul.allow_tf32` or `set_float32_matmul_precision("high")`), the kernel is the more
accurate of the two; it never uses TF32.

Kernel. Program (n-tile, k-split, m-tile) loads `K_ITERS` consecutive [BLOCK_N, BLOCK_K] weight tiles (all requests
of a tile in flight at once), widens them in registers and multiplies them by up to BLOCK_M rows of x; the K splits
of one output tile combine through the arrival counters of `_common.split_k_counters`, as `quant_gemv` does. Under
PDL the weight tile is requested before `gdc_wait` (weights never come from the previous kernel), x after it.
Tile sizes (`upcast_plan`) follow `quant_gemv.gemv_plan`'s measured H200 choices for 1-byte weights with BLOCK_K
halved (2-byte weights) or quartered (4-byte), so a tile is the same 16 KiB of loads; they have not been swept for
2- or 4-byte weights yet.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv41.ref import gemv as _ref

from ._common import (check_same_device, check_tensor, register_cuda, require_launchable, split_k_workspace,
                      split_k_merge_2d, use_pdl_for)

__all__ = ["linear_upcast", "reference_linear_upcast", "triton_linear_upcast", "upcast_plan", "MAX_TRITON_M",
           "WEIGHT_DTYPES"]

#: Largest M the CUDA implementation sends to the Triton GEMV (decode, speculative verify); above it cuBLAS.
MAX_TRITON_M = 8
#: Weight dtypes the op reads (their widening to fp32 is exact; fp32 is read as it is).
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Weight columns per tile by weight element size in bytes (`upcast_plan`): 16 KiB of loads per tile.
_BLOCK_K = {2: 64, 4: 32}


def _check_args(x, weight) -> tuple[int, int]:
    """Validate dtypes and shapes; return (N, K). Errors name the argument at fault."""
    check_tensor("x", x, dtypes=(torch.float32,), min_ndim=1)
    check_tensor("weight", weight, dtypes=WEIGHT_DTYPES, ndim=2)
    check_same_device(x=x, weight=weight)
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x.shape[-1] = {x.shape[-1]} does not match weight {tuple(weight.shape)} (expected K = {k})")
    return n, k


def reference_linear_upcast(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch `dsv41::linear_upcast`: `F.linear(x, weight.float())`.

    Args:
        x: float32 [..., K].
        weight: bfloat16 / float16 / float32 [N, K].
    Returns: float32 [..., N].
    Raises: TypeError for a wrong dtype, ValueError for a wrong rank or a K mismatch (each names the argument).
    Source: the eager spelling `F.linear(x.float(), W.float())` (dsv41/model/model.py `final_logits`, csa.py).
    """
    _check_args(x, weight)
    return _ref.linear_upcast(x, weight)


@triton.jit
def _upcast_gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr, K_ITERS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(K_ITERS):
        kk = (pid_k * K_ITERS + it) * BLOCK_K + offs_k
        k_ok = kk < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # x may come from the previous kernel; the weight never does
        for mm in tl.static_range(BLOCK_M):
            m = pid_m * BLOCK_M + mm
            # Row validity as a vector: the interpreter mis-types scalar-bool & block-bool.
            m_ok = (offs_k * 0 + m) < M
            xv = tl.load(x_ptr + m.to(tl.int64) * stride_xm + kk, mask=k_ok & m_ok, other=0.0)
            acc += tl.where((offs_m == m)[:, None], tl.sum(w * xv[None, :], axis=1)[None, :], 0.0)

    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    mask_mn = (offs_m[:, None] < M) & n_ok[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        total = acc
    else:
        p_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        total, arrived = split_k_merge_2d(acc, p_ptrs, M * N, mask_mn, cnt_ptr, pid_m * tl.num_programs(0) + pid_n,
                                          pid_k, SPLIT_K, SPLIT_POW2)
        mask_mn = mask_mn & ((offs_n * 0 + arrived) == SPLIT_K - 1)[None, :]
    tl.store(y_ptrs, total, mask=mask_mn)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result/workspace allocation; a seam the tests replace to poison outputs with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def upcast_plan(m: int, n: int, k: int, *, weight_bytes: int = 2, block_n: int | None = None,
                block_k: int | None = None, k_iters: int | None = None, num_warps: int | None = None) -> dict:
    """Launch parameters for x [m, k] and an [n, k] weight of `weight_bytes` (2: bf16 / fp16, 4: fp32) bytes per
    element (module docstring, "Kernel"): `quant_gemv.gemv_plan`'s rules (BLOCK_M, BLOCK_N, K_ITERS, SPLIT_K, grid)
    with BLOCK_K = 64 (2-byte) or 32 (4-byte) by default, so a tile is the 16 KiB of loads of a 1-byte FP8 tile.
    Explicit arguments override the heuristic.
    Raises: ValueError for a weight_bytes other than 2 or 4, a block_n that is not a power of two, a block_k that is
    not a power-of-two multiple of 32, or k_iters < 1.
    """
    from .quant_gemv import gemv_plan
    if weight_bytes not in _BLOCK_K:
        raise ValueError(f"weight_bytes={weight_bytes} must be 2 (bf16 / fp16) or 4 (fp32)")
    return gemv_plan(m, n, k, False, block_n=block_n, block_k=block_k or _BLOCK_K[weight_bytes],
                     num_warps=num_warps, k_iters=k_iters, stages=1)


def triton_linear_upcast(x: torch.Tensor, weight: torch.Tensor, **overrides) -> torch.Tensor:
    """Run the Triton GEMV on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1).

    Same arguments, result and errors as `reference_linear_upcast`, plus RuntimeError when the kernel cannot
    run on the device; any M works (rows tiled by up to 8). `overrides` (block_n, block_k, k_iters, num_warps)
    replace the `upcast_plan` heuristic. Numerics: module docstring.
    """
    n, k = _check_args(x, weight)
    require_launchable(_upcast_gemv_kernel, x.device, "triton_linear_upcast")
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), k)  # not reshape(-1, k): that is ambiguous for K = 0
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    # A copy made here is written by the kernel just before ours, and the GEMV reads its weight before the PDL
    # wait: that launch goes without PDL.
    copied = weight.stride(-1) != 1
    if copied:
        weight = weight.contiguous()
    m = x2.shape[0]
    y = _empty((m, n), torch.float32, x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    if k == 0:
        return y.zero_().reshape(*lead, n)
    plan = upcast_plan(m, n, k, weight_bytes=weight.element_size(), **overrides)
    n_tiles, split_k, m_tiles = plan["grid"]
    part, cnt = split_k_workspace(_empty, x.device, split_k, (m, n), n_tiles * m_tiles)
    pdl = use_pdl_for(_upcast_gemv_kernel, x.device) and not copied
    extra = {"launch_pdl": True} if pdl else {}
    _upcast_gemv_kernel[plan["grid"]](
        x2, weight, y, part, cnt, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        SPLIT_K=split_k, SPLIT_POW2=plan["SPLIT_POW2"], K_ITERS=plan["K_ITERS"], BLOCK_M=plan["BLOCK_M"],
        BLOCK_N=plan["BLOCK_N"], BLOCK_K=plan["BLOCK_K"], USE_PDL=pdl, num_warps=plan["num_warps"], **extra)
    return y.reshape(*lead, n)


@torch.library.custom_op("dsv41::linear_upcast", mutates_args=(), device_types="cpu")
def linear_upcast(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`y = x @ weight.float().T` reading the bf16 / fp16 / fp32 weight once; see `reference_linear_upcast`."""
    return reference_linear_upcast(x, weight)


@register_cuda(linear_upcast, "dsv41::linear_upcast")
def _linear_upcast_cuda(x, weight):
    if x.numel() // max(x.shape[-1], 1) <= MAX_TRITON_M:
        return triton_linear_upcast(x, weight)
    return reference_linear_upcast(x, weight)


@linear_upcast.register_fake
def _linear_upcast_fake(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
