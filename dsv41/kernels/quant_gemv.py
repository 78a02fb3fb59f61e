"""Quantised-weight GEMV for decode (M <= 8): the `dispatch` fusion target (ARCHITECTURE.md, pattern table).

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

Measured on the H200 (bench/kernels.py --sweep --pdl, CUDA-graph replay over weight copies larger than L2,
M = 1, bf16 x, act_quant; fraction of the 4.25 TB/s copy bandwidth; bench/results/2026-11-29_h200_kernels_v2):
head 129280x5120 71 %, wq_b 45 %, wo_b 46 %; the 3-7 MB weights (wq_a, shared experts, FP4 experts) take 5.6-8.2
us, latency-bound, on par with or faster than a bf16 cuBLAS GEMV that reads 2-4x the bytes. Not reached: the
80 % target (the FP8 decode + FMA per weight byte and the split-K combine are what remains; the FP4 decode is
ALU-bound), and M = 4-8 costs M FMAs per weight byte.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv41.model.formats import dequantize_fp4_1x32, dequantize_fp8_block, fake_quant_fp8_1x32

from ._common import (E2M1_HALF_SCALE, check_same_device, check_tensor, e2m1_value_scaled_down, e4m3_round,
                      exp2_int, next_power_of_2, require_launchable, round_bf16, split_k_counters, split_k_merge_2d,
                      ue8m0_exponent, use_pdl_for)

__all__ = [
    "linear_fp8_block", "linear_fp4",
    "reference_linear_fp8_block", "reference_linear_fp4",
    "triton_linear_fp8_block", "triton_linear_fp4",
    "gemv_plan", "MAX_TRITON_M",
]

#: Largest M the CUDA implementation sends to the Triton GEMV (decode, MTP/DSpark drafts); above it the
#: op dequantises and calls cuBLAS (prefill).
MAX_TRITON_M = 8
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
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


# ------------------------------------------------------------------------------------------- checks
def _check_args(x, weight, scale, fp4: bool):
    """Validate shapes/dtypes; return (N, K). Errors name the argument at fault."""
    check_tensor("x", x, dtypes=_FLOAT_DTYPES, min_ndim=1)
    check_tensor("weight", weight, dtypes=(torch.uint8,), ndim=2)
    check_tensor("scale", scale, dtypes=(torch.uint8,), ndim=2)
    check_same_device(x=x, weight=weight, scale=scale)
    k = x.shape[-1]
    if k % 32:
        raise ValueError(f"x.shape[-1] = {k} must be divisible by 32 (1x32 activation quantisation)")
    n = weight.shape[0]
    if fp4:
        if weight.shape[1] * 2 != k:
            raise ValueError(f"packed FP4 weight {tuple(weight.shape)} does not match K = {k} (expected [N, {k // 2}])")
        want = (n, k // 32)
    else:
        if weight.shape[1] != k:
            raise ValueError(f"FP8 weight {tuple(weight.shape)} does not match K = {k} (expected [N, {k}])")
        want = (-(-n // 32), k // 32)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; expected {want} for weight {tuple(weight.shape)}")
    return n, k


# ------------------------------------------------------------------------------------------- references
def reference_linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                               act_quant: bool) -> torch.Tensor:
    """Plain-PyTorch `dsv41::linear_fp8_block`: `F.linear(fq8(x) if act_quant else x, dequant(weight))`.

    Args:
        x: [..., K] fp32/bf16/fp16, K % 32 == 0.
        weight: uint8 [N, K] E4M3 bytes. scale: uint8 [ceil(N/32), ceil(K/32)] UE8M0 exponents.
        act_quant: fake-quantise x to FP8 E4M3 with a UE8M0 scale per 32 along K first.
    Returns: [..., N] in x.dtype.
    Raises: TypeError / ValueError for wrong dtypes or shapes (named).
    Source: dsv41/model/linear.py `Linear.forward` (fmt "fp8_block"), MODEL.md §2.1.
    """
    _check_args(x, weight, scale, fp4=False)
    w = dequantize_fp8_block(weight, scale, x.dtype)
    return F.linear(fake_quant_fp8_1x32(x) if act_quant else x, w)


def reference_linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         act_quant: bool) -> torch.Tensor:
    """Plain-PyTorch `dsv41::linear_fp4`: `F.linear(fq8(x) if act_quant else x, dequant_fp4(weight))`.

    Args:
        x: [..., K] fp32/bf16/fp16, K % 32 == 0.
        weight: uint8 [N, K/2] packed E2M1 (low nibble = even k). scale: uint8 [N, K/32] UE8M0.
        act_quant: fake-quantise x to FP8 1x32 first (as every quantised GEMM of the reference does).
    Returns: [..., N] in x.dtype.
    Raises: TypeError / ValueError for wrong dtypes or shapes (named).
    Source: dsv41/model/linear.py `Linear.forward` (fmt "fp4"), MODEL.md §2.1 (routed experts).
    """
    _check_args(x, weight, scale, fp4=True)
    w = dequantize_fp4_1x32(weight, scale, x.dtype)
    return F.linear(fake_quant_fp8_1x32(x) if act_quant else x, w)


# ------------------------------------------------------------------------------------------- kernel
@triton.jit
def _gemv_tile(x_ptr, w_ptr, s_ptr, acc, offs_n, n_ok, offs_m, kb, j32, k0, pid_m, M, K, stride_xm, stride_wn,
               stride_sn, FP4: tl.constexpr, ACT_QUANT: tl.constexpr, X_FP16: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, NKB: tl.constexpr, USE_PDL: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + x[:, k0:k0+32*NKB] @ dequant(W[offs_n, k0:k0+32*NKB])^T (one weight tile)."""
    k_ok = (k0 + kb * 32) < K
    w_mask = n_ok[:, None, None] & k_ok[None, :, None]
    s_mask = n_ok[:, None] & k_ok[None, :]

    # Weights and scales first: they never come from the previous kernel, so under PDL their reads
    # overlap that kernel's tail.
    if FP4:
        j16 = tl.arange(0, 16)
        w_raw = tl.load(w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn
                        + (k0 // 2 + kb[None, :, None] * 16 + j16[None, None, :]), mask=w_mask, other=0)
        s_raw = tl.load(s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + (k0 // 32 + kb[None, :]),
                        mask=s_mask, other=0)
    else:
        w_raw = tl.load(w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn
                        + (k0 + kb[None, :, None] * 32 + j32[None, None, :]), mask=w_mask, other=0)
        s_raw = tl.load(s_ptr + (offs_n // 32)[:, None].to(tl.int64) * stride_sn + (k0 // 32 + kb[None, :]),
                        mask=s_mask, other=0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()

    # Decode to FP32 codes [BLOCK_N, NKB, 32] and the UE8M0 scales 2^(e-127) [BLOCK_N, NKB]. FP4 codes are
    # decoded divided by 2^14 (a four-instruction decode, see _common) and multiplied back per block sum.
    sw = exp2_int(s_raw.to(tl.int32))
    if X_FP16:
        # Reference: codes.to(fp16) * scale.to(fp16), rounded in fp16.
        s16 = sw.to(tl.float16).to(tl.float32)
    if FP4:
        c = w_raw.to(tl.int32)
        w3 = tl.reshape(tl.join(e2m1_value_scaled_down(c & 15), e2m1_value_scaled_down(c >> 4)),
                        [BLOCK_N, NKB, 32])
        sw = sw * E2M1_HALF_SCALE  # exact unless the scale exceeds 2^113 (UE8M0 byte > 240)
        if X_FP16:
            s16 = s16 * E2M1_HALF_SCALE
    else:
        w3 = w_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if X_FP16:
        w3 = (w3 * s16[:, :, None]).to(tl.float16).to(tl.float32)

    for mm in tl.static_range(BLOCK_M):
        m = pid_m * BLOCK_M + mm
        # Row validity as a vector: the interpreter mis-types scalar-bool & block-bool (int32 mask).
        m_ok = (j32 * 0 + m) < M
        xv = tl.load(x_ptr + m.to(tl.int64) * stride_xm + (k0 + kb[:, None] * 32 + j32[None, :]),
                     mask=k_ok[:, None] & m_ok[None, :], other=0.0).to(tl.float32)
        if ACT_QUANT:
            # formats.quantize_fp8_1x32: amax floored at 1e-4, UE8M0 ceil scale from the IEEE bits of
            # amax / 448 (correctly rounded division), q = clamp(x / scale, +-448) -> E4M3 RNE.
            amax = tl.maximum(tl.max(tl.abs(xv), axis=1), 1e-4)
            e = ue8m0_exponent(tl.math.div_rn(amax, 448.0))
            # The floor keeps e in [105, 247], so 2^(127-e) is a normal number and x * 2^(127-e) is exact.
            q = tl.minimum(tl.maximum(xv * exp2_int(254 - e)[:, None], -448.0), 448.0)
            qr = e4m3_round(tl.abs(q))
            xq = tl.where(q < 0, -qr, qr) * exp2_int(e)[:, None]
            if X_FP16:
                xq = xq.to(tl.float16).to(tl.float32)
        else:
            xq = xv
        # Per 32-block dot of codes, times the power-of-two weight scale (exact), summed over blocks.
        part = tl.sum(w3 * xq[None, :, :], axis=2)
        if not X_FP16:
            part = part * sw
        acc += tl.where((offs_m == m)[:, None], tl.sum(part, axis=1)[None, :], 0.0)

    return acc


@triton.jit
def _quant_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    FP4: tl.constexpr, ACT_QUANT: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr,
    K_ITERS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (n-tile, k-split, m-tile) multiplies K_ITERS consecutive [BLOCK_N, BLOCK_K] weight tiles, each
    # loaded with every request in flight at once; the K splits of one output tile (SPLIT_K = grid dim 1) are
    # combined by the last program to finish.
    NKB: tl.constexpr = BLOCK_K // 32
    X_FP16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.arange(0, NKB)
    j32 = tl.arange(0, 32)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(K_ITERS):
        acc = _gemv_tile(x_ptr, w_ptr, s_ptr, acc, offs_n, n_ok, offs_m, kb, j32, (pid_k * K_ITERS + it) * BLOCK_K,
                         pid_m, M, K, stride_xm, stride_wn, stride_sn,
                         FP4, ACT_QUANT, X_FP16, BLOCK_M, BLOCK_N, NKB, USE_PDL)

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
    if y_ptr.dtype.element_ty == tl.bfloat16:
        total = round_bf16(total)  # RNE on the bits; exact for the cast below
    tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask_mn)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result/workspace allocation; a seam the tests replace to poison outputs with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def gemv_plan(m: int, n: int, k: int, fp4: bool, *, block_n: int | None = None, block_k: int | None = None,
              num_warps: int | None = None, k_iters: int | None = None) -> dict:
    """Launch parameters of the GEMV kernel for x [m, k] and an [n, k] weight (the documented heuristic).

    One program per weight tile [BLOCK_N, BLOCK_K] and x row tile (grid = n tiles x k tiles x m tiles):
    a program issues all of its tile's loads at once, and the GPU overlaps programs, so no K loop stalls on
    latency. Choices (measured on the H200 with bench/kernels.py --sweep):
    - BLOCK_M = next power of two >= min(m, 8) (rows of x per program).
    - BLOCK_N = 128 rows; at most 64 for BLOCK_M >= 4 (the per-row partial sums add registers).
    - BLOCK_K = 128: 128 weight bytes per row per program for FP8, with K tiles as separate programs, even
      wq_a (1280 x 5120) gets 10 x 40 programs, so every SM has loads in flight.
    - K_ITERS = K tiles per program (`_K_ITERS_RULE`: fewer, longer programs where there are many); SPLIT_K = ceil(K tiles / K_ITERS) programs
      per output tile; when > 1 the last program of an output tile sums the FP32 partials, all SPLIT_K of them
      in one vector load (SPLIT_POW2 = SPLIT_K rounded up to a power of two).
    Explicit arguments override the heuristic (tests and benchmarks use this).
    Returns a dict with BLOCK_M, BLOCK_N, BLOCK_K, K_ITERS, SPLIT_K, SPLIT_POW2, num_warps and the grid
    (n tiles, K splits, m tiles).
    Raises: ValueError for a block_n / block_k that is not a power of two (block_k also a multiple of 32) or
    k_iters < 1.
    """
    block_m = min(next_power_of_2(max(m, 1)), MAX_TRITON_M)
    if block_n is None:
        block_n = _BLOCK_N[fp4]
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
        k_iters = next((it for it, min_programs in _K_ITERS_RULE
                        if n_tiles * m_tiles * -(-k_tiles // it) >= min_programs), 1)
    if k_iters < 1:
        raise ValueError(f"k_iters={k_iters} must be >= 1")
    k_iters = min(k_iters, k_tiles)
    split_k = -(-k_tiles // k_iters)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_ITERS=k_iters, SPLIT_K=split_k,
                SPLIT_POW2=next_power_of_2(split_k), num_warps=num_warps or _NUM_WARPS,
                grid=(n_tiles, split_k, m_tiles))


def _launch(x, weight, scale, act_quant: bool, fp4: bool, **overrides) -> torch.Tensor:
    n, k = _check_args(x, weight, scale, fp4)
    require_launchable(_quant_gemv_kernel, x.device, "triton_linear_fp4" if fp4 else "triton_linear_fp8_block")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = _empty((m, n), x.dtype, x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    plan = gemv_plan(m, n, k, fp4, **overrides)
    n_tiles, split_k, m_tiles = plan["grid"]
    if split_k > 1:
        part = _empty((split_k, m, n), torch.float32, x.device)
        cnt = split_k_counters(x.device, n_tiles * m_tiles)
    else:  # not read when SPLIT_K == 1, but typed like the real workspace (no kernel launch to allocate)
        part = torch.empty(1, dtype=torch.float32, device=x.device)
        cnt = torch.empty(1, dtype=torch.int32, device=x.device)
    pdl = use_pdl_for(_quant_gemv_kernel, x.device)
    extra = {"launch_pdl": True} if pdl else {}
    _quant_gemv_kernel[plan["grid"]](
        x2, weight, scale, y, part, cnt,
        m, n, k, x2.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        FP4=fp4, ACT_QUANT=bool(act_quant), SPLIT_K=split_k, SPLIT_POW2=plan["SPLIT_POW2"], K_ITERS=plan["K_ITERS"],
        BLOCK_M=plan["BLOCK_M"], BLOCK_N=plan["BLOCK_N"], BLOCK_K=plan["BLOCK_K"], USE_PDL=pdl,
        num_warps=plan["num_warps"], **extra)
    return y.reshape(*lead, n)


def triton_linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool,
                            **overrides) -> torch.Tensor:
    """Run the Triton GEMV for a block-FP8 weight on the tensors' device (interpreted on CPU).

    Same arguments, result and errors as `reference_linear_fp8_block`; any M works (x rows are tiled by up
    to 8). `overrides` (block_n, block_k, num_warps) replace the `gemv_plan` heuristic.
    Numerics: codes and scales bit-identical to the reference; FP32 accumulation in a different order, so
    results agree to FP32 rounding of the sum, then one rounding to x.dtype.
    """
    return _launch(x, weight, scale, act_quant, fp4=False, **overrides)


def triton_linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool,
                      **overrides) -> torch.Tensor:
    """Run the Triton GEMV for a packed-FP4 weight on the tensors' device (interpreted on CPU).

    Same arguments, result and errors as `reference_linear_fp4`; see `triton_linear_fp8_block`.
    """
    return _launch(x, weight, scale, act_quant, fp4=True, **overrides)


# ------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("dsv41::linear_fp8_block", mutates_args=(), device_types="cpu")
def linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool) -> torch.Tensor:
    """`y = fq8(x) @ dequant(weight)^T` for a block-FP8 weight; see `reference_linear_fp8_block` for shapes."""
    return reference_linear_fp8_block(x, weight, scale, act_quant)


@linear_fp8_block.register_kernel("cuda")
def _linear_fp8_block_cuda(x, weight, scale, act_quant):
    if x.numel() // max(x.shape[-1], 1) <= MAX_TRITON_M:
        return triton_linear_fp8_block(x, weight, scale, act_quant)
    return reference_linear_fp8_block(x, weight, scale, act_quant)


@linear_fp8_block.register_fake
def _linear_fp8_block_fake(x, weight, scale, act_quant):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("dsv41::linear_fp4", mutates_args=(), device_types="cpu")
def linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_quant: bool) -> torch.Tensor:
    """`y = fq8(x) @ dequant_fp4(weight)^T` for a packed-FP4 weight; see `reference_linear_fp4` for shapes."""
    return reference_linear_fp4(x, weight, scale, act_quant)


@linear_fp4.register_kernel("cuda")
def _linear_fp4_cuda(x, weight, scale, act_quant):
    if x.numel() // max(x.shape[-1], 1) <= MAX_TRITON_M:
        return triton_linear_fp4(x, weight, scale, act_quant)
    return reference_linear_fp4(x, weight, scale, act_quant)


@linear_fp4.register_fake
def _linear_fp4_fake(x, weight, scale, act_quant):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
