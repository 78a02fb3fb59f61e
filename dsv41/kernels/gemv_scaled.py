"""Block-FP8 GEMV for the weight layouts FP8 checkpoints ship: `dsv41::linear_fp8_scaled`, a `dispatch` target.

Most FP8 releases (DeepSeek-V3 / R1 and others) store a linear layer's weight as `float8_e4m3fn` [N, K] with one
FP32 `weight_scale_inv` per 128x128 block (grid [ceil(N/128), ceil(K/128)]); others use 32x32 blocks or 1x128
blocks along K (grid [N, ceil(K/128)]), or UE8M0 bytes instead of FP32 scales. Eager code dequantises with
`w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]` (or block views, `torch.kron`, expand)
and multiplies: every step writes the dequantised weight (2-4 bytes per element) and reads it back. This op reads
the E4M3 bytes and the scales once (the `dispatch` family's `fp8_layouts` recognises the spellings,
dsv41/passes/fp8_layouts.py). dsv41's own layout (UE8M0 per 32x32, K % 32 == 0) goes to `dsv41::linear_fp8_block`.

Op (`dsv41::linear_fp8_scaled(x, codes, scale, block_n, block_k, weight_dtype, scale_cast) -> y`):
    x             [..., K] float32 / bfloat16 / float16
    codes         uint8 [N, K]: E4M3 bit patterns (a `float8_e4m3fn` weight viewed as uint8, no copy); 0x7F / 0xFF
                  are NaN
    scale         float32 [ceil(N/block_n), ceil(K/block_k)] (the scale's value), or uint8 of that shape (UE8M0
                  exponent e, value 2^(e-127)); any strides
    block_n, block_k   rows / columns of the weight one scale covers (128, 128 / 32, 32 / 1, 128)
    weight_dtype  the dtype eager's dequantised weight is rounded to (its materialised dtype): x.dtype, or any of
                  the three for float32 x
    scale_cast    the dtype eager rounds the scale to before the product (float32: not rounded)
    y             [..., N] in x.dtype = x @ W^T,  W = `formats.dequantize_fp8_scaled(codes, scale, block_n, block_k,
                  weight_dtype, scale_cast)` (`reference_linear_fp8_scaled`)

On CPU the op runs the reference. On CUDA, M = prod(x.shape[:-1]) <= `MAX_TRITON_M` with a power-of-two block_k
runs the Triton GEMV; otherwise the reference (dequantise, then F.linear through cuBLAS, as eager does).

Numerics. E4M3 codes are exact in FP32. Where eager's weight is rounded (weight_dtype bf16 / fp16 with FP32 scales;
fp16 with UE8M0 scales, whose products may leave fp16's range), the kernel rounds code x scale per element exactly
as eager does: the FP32 product, then round-to-nearest-even to weight_dtype (bf16 on the bits, `_common.round_bf16`,
because the interpreter's `.to(bfloat16)` truncates). Otherwise (an FP32 weight, or a UE8M0 scale whose products are
exact) the scale multiplies each block's FP32 sum of code x x instead of every element: for an FP32 weight this
differs from eager by FP32 rounding of the products only, as any two GEMMs differ in summation order. A scale_cast
of bf16 / fp16 rounds the scale once per block. Sums are FP32, then rounded once to x.dtype; split-K partials are
summed by the last program in split order (deterministic).

Kernel. Program (n-tile, k-split, m-tile) multiplies K_ITERS consecutive [BLOCK_N, BLOCK_K] code tiles, each loaded
with every request in flight at once, shaped [BLOCK_N, BLOCK_K / SBK, SBK] with SBK = min(block_k, BLOCK_K) so that
one scale covers a [1, 1, SBK] row segment (the scale tile is [BLOCK_N, BLOCK_K / SBK], one load per element, which
the caches serve for the rows of one 128-row block). Under PDL the first code and scale tiles are requested before
`gdc_wait` (weights never come from the previous kernel), x after it, and `gdc_launch_dependents` follows the K loop.
Plan (`scaled_plan`): `quant_gemv.gemv_plan`'s tile-at-once rules, measured for 1-byte weights on the H200 (BLOCK_N
128, or 64 for 4+ x rows; BLOCK_K 128; K_ITERS 4 / 2 / 1 by program count), so grids too small to fill the SMs
split K (e.g. 2048 x 7168 at M = 1: 16 row tiles x 28 K splits). The K splits of one output tile combine through
the arrival counters of `_common.split_k_counters` (`quant_gemv.store_gemv_result`).

E4M3 decode: `.to(float8e4nv, bitcast=True).to(float32)`, the GPU's cvt, which gives NaN for 0x7F / 0xFF. The
Triton 3.9 interpreter decodes those bytes as +-480, so under the interpreter only (`FIX_NAN`) the kernel selects
NaN for them. On the GPU the select would add three instructions per code byte; by an estimate (not measured),
an H100 issues about nine per byte at its copy bandwidth, and the decode and the FMAs of up to 8 x rows need most.

Not measured yet: no GPU time of this kernel exists. `bench/probes/fp8_layouts_probe.py` times it at DeepSeek-V3
decode shapes against the copy bandwidth; `tests/test_kernels_gpu_fp8_scaled.py` checks it on a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv41.ref import gemv as _ref

from ._common import (check_same_device, check_tensor, exp2_int, is_interpreted, register_cuda, require_launchable,
                      round_bf16, split_k_workspace, use_pdl_for)
from .gemv_tiles import store_gemv_result
from .quant_gemv import device_sm_count, gemv_plan

__all__ = ["linear_fp8_scaled", "reference_linear_fp8_scaled", "triton_linear_fp8_scaled", "scaled_plan",
           "kernel_rounding", "MAX_TRITON_M", "WEIGHT_DTYPES", "SCALE_DTYPES"]

#: Largest M the CUDA implementation sends to the Triton GEMV (decode, speculative drafts); above it cuBLAS.
MAX_TRITON_M = 8
#: Dtypes of x, of `weight_dtype` and of `scale_cast`.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Scale dtypes: float32 values or uint8 UE8M0 exponents.
SCALE_DTYPES = (torch.float32, torch.uint8)
#: Kernel rounding codes (`ROUND_S`, `ROUND_W`): 0 none, 1 bf16 (RNE on the bits), 2 fp16.
_ROUND_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# ------------------------------------------------------------------------------------------- checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_args(x, codes, scale, block_n, block_k, weight_dtype, scale_cast) -> tuple[int, int]:
    """Validate dtypes, shapes and block sizes; return (N, K). Errors name the argument at fault."""
    check_tensor("x", x, dtypes=WEIGHT_DTYPES, min_ndim=1)
    check_tensor("codes", codes, dtypes=(torch.uint8,), ndim=2)
    check_tensor("scale", scale, dtypes=SCALE_DTYPES, ndim=2)
    check_same_device(x=x, codes=codes, scale=scale)
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    for name, v in (("weight_dtype", weight_dtype), ("scale_cast", scale_cast)):
        if v not in WEIGHT_DTYPES:
            raise ValueError(f"{name}={v} must be one of float32, bfloat16, float16")
    if weight_dtype != x.dtype and x.dtype != torch.float32:
        raise ValueError(f"weight_dtype={weight_dtype} with x of dtype {x.dtype}: the dequantised weight must be held "
                         "exactly in x's dtype (weight_dtype == x.dtype, or x float32)")
    n, k = codes.shape
    if x.shape[-1] != k:
        raise ValueError(f"x.shape[-1] = {x.shape[-1]} does not match codes {tuple(codes.shape)} (expected K = {k})")
    grid = (-(-n // block_n), -(-k // block_k))
    if tuple(scale.shape) != grid:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; a {block_n}x{block_k} block grid of codes "
                         f"{tuple(codes.shape)} is {grid}")
    return n, k


def kernel_rounding(scale_dtype: torch.dtype, weight_dtype: torch.dtype, scale_cast: torch.dtype) -> tuple[int, int]:
    """(ROUND_S, ROUND_W): the roundings the kernel must apply to the scale and to code x scale (0 none, 1 bf16,
    2 fp16) for a scale of `scale_dtype`. A UE8M0 scale (uint8) is a power of two, exact in fp32 and bf16, and so is
    its product with an E4M3 code: only fp16's narrower range rounds. Raises KeyError for a dtype outside
    `WEIGHT_DTYPES`."""
    rs, rw = _ROUND_CODE[scale_cast], _ROUND_CODE[weight_dtype]
    if scale_dtype == torch.uint8:
        rs = rs if rs == 2 else 0
        rw = rw if rw == 2 else 0
    return rs, rw


# ------------------------------------------------------------------------------------------- reference
def reference_linear_fp8_scaled(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block_n: int,
                                block_k: int, weight_dtype: torch.dtype, scale_cast: torch.dtype) -> torch.Tensor:
    """Plain-PyTorch `dsv41::linear_fp8_scaled`: `F.linear(x, dequantize_fp8_scaled(...).to(x.dtype))`.

    Args:
        x: [..., K] float32 / bfloat16 / float16.
        codes: uint8 [N, K] E4M3 bit patterns. scale: float32 or uint8 (UE8M0) [ceil(N/block_n), ceil(K/block_k)].
        block_n, block_k: block size (ints >= 1). weight_dtype: rounding of the dequantised weight (x.dtype, or any
            for float32 x). scale_cast: rounding of the scale before the product (float32: none).
    Returns: [..., N] in x.dtype.
    Raises: TypeError for a wrong dtype; ValueError for a wrong rank, K, scale grid, block size or weight_dtype (named).
    Source: the eager spellings of FP8 checkpoints (module docstring); `formats.dequantize_fp8_scaled`.
    """
    _check_args(x, codes, scale, block_n, block_k, weight_dtype, scale_cast)
    return _ref.linear_fp8_scaled(x, codes, scale, block_n, block_k, weight_dtype, scale_cast)


# ------------------------------------------------------------------------------------------- kernel
@triton.jit
def _round(v, R: tl.constexpr):
    """fp32 `v` rounded to bf16 (R = 1, nearest even on the bits) or fp16 (R = 2), as fp32; R = 0: unchanged."""
    if R == 1:
        v = round_bf16(v)
    elif R == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _scaled_tile(x_ptr, w_ptr, s_ptr, acc, offs_n, n_ok, offs_m, kb, j, k0, pid_m, M, K, stride_xm, stride_wn,
                 stride_sn, stride_sk, BN_S: tl.constexpr, BK_S: tl.constexpr, SBK: tl.constexpr,
                 SCALE_UE8M0: tl.constexpr, ROUND_S: tl.constexpr, ROUND_W: tl.constexpr, FIX_NAN: tl.constexpr,
                 BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + x[m-tile, k0 : k0 + BLOCK_K] @ W[offs_n, k0 : k0 + BLOCK_K]^T for one code tile
    [BLOCK_N, NKB, SBK] (kb: its NKB segments, j: SBK columns each) and its scale tile [BLOCK_N, NKB]."""
    kk = k0 + kb[:, None] * SBK + j[None, :]                     # [NKB, SBK] weight columns
    k_ok = kk < K
    w_raw = tl.load(w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn + kk[None, :, :],
                    mask=n_ok[:, None, None] & k_ok[None, :, :], other=0)
    seg = k0 + kb * SBK                                          # first column of each segment
    s_raw = tl.load(s_ptr + (offs_n // BN_S)[:, None].to(tl.int64) * stride_sn
                    + (seg // BK_S)[None, :].to(tl.int64) * stride_sk,
                    mask=n_ok[:, None] & (seg < K)[None, :], other=0)
    # Weights and scales never come from the previous kernel: under PDL their reads overlap its tail.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if SCALE_UE8M0:
        s = exp2_int(s_raw.to(tl.int32))
    else:
        s = s_raw.to(tl.float32)
    s = _round(s, ROUND_S)
    w = w_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if FIX_NAN:
        w = tl.where((w_raw & 0x7F) == 0x7F, float("nan"), w)
    if ROUND_W != 0:
        # Eager materialises code x scale in bf16 / fp16: the same FP32 product, the same rounding.
        w = _round(w * s[:, :, None], ROUND_W)
    for mm in tl.static_range(BLOCK_M):
        m = pid_m * BLOCK_M + mm
        # Row validity as a vector: the interpreter mis-types scalar-bool & block-bool.
        m_ok = (j * 0 + m) < M
        xv = tl.load(x_ptr + m.to(tl.int64) * stride_xm + kk, mask=k_ok & m_ok[None, :], other=0.0).to(tl.float32)
        seg_sum = tl.sum(w * xv[None, :, :], axis=2)             # [BLOCK_N, NKB]
        if ROUND_W == 0:
            seg_sum = seg_sum * s  # one multiplication per scale block instead of one per element
        acc += tl.where((offs_m == m)[:, None], tl.sum(seg_sum, axis=1)[None, :], 0.0)
    return acc


@triton.jit
def _scaled_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_sk, stride_ym,
    BN_S: tl.constexpr, BK_S: tl.constexpr, SBK: tl.constexpr, SCALE_UE8M0: tl.constexpr, ROUND_S: tl.constexpr,
    ROUND_W: tl.constexpr, FIX_NAN: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr,
    K_ITERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program (n-tile, k-split, m-tile): K_ITERS consecutive [BLOCK_N, BLOCK_K] code tiles, each loaded at once; the
    # K splits of one output tile (grid dim 1) are combined by the last program to finish (module docstring).
    NKB: tl.constexpr = BLOCK_K // SBK
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.arange(0, NKB)
    j = tl.arange(0, SBK)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(K_ITERS):
        acc = _scaled_tile(x_ptr, w_ptr, s_ptr, acc, offs_n, n_ok, offs_m, kb, j, (pid_k * K_ITERS + it) * BLOCK_K,
                           pid_m, M, K, stride_xm, stride_wn, stride_sn, stride_sk, BN_S, BK_S, SBK, SCALE_UE8M0,
                           ROUND_S, ROUND_W, FIX_NAN, BLOCK_M, USE_PDL)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    store_gemv_result(acc, y_ptr, part_ptr, cnt_ptr, offs_m, offs_n, n_ok, pid_m, pid_n, pid_k, M, N, stride_ym,
                       SPLIT_K, SPLIT_POW2)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result/workspace allocation; a seam the tests replace to poison outputs with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def scaled_plan(m: int, n: int, k: int, block_k_scale: int, *, tile_n: int | None = None,
                tile_k: int | None = None, k_iters: int | None = None, num_warps: int | None = None,
                sm_count: int | None = None) -> dict:
    """Launch parameters for x [m, k], an [n, k] code matrix and scale blocks `block_k_scale` columns wide.

    `quant_gemv.gemv_plan`'s tile-at-once rules (BLOCK_M, BLOCK_N, BLOCK_K = 128, K_ITERS, SPLIT_K, SPLIT_POW2,
    num_warps, grid (n tiles, K splits, m tiles)) plus SBK = min(block_k_scale, BLOCK_K), the columns one scale covers
    inside a tile. Explicit arguments override the heuristic: tile_n / tile_k are gemv_plan's block_n / block_k
    (the tile's rows and columns, not the scale block's).
    Returns: that dict (with SBK).
    Raises: ValueError for a block_k_scale that is not a power of two (the tile is shaped by it), and for what
    `gemv_plan` rejects (tile_n / tile_k not powers of two, tile_k not a multiple of 32, k_iters < 1).
    """
    if not _is_int(block_k_scale) or block_k_scale < 1 or block_k_scale & (block_k_scale - 1):
        raise ValueError(f"block_k_scale={block_k_scale!r} must be a power of two for the Triton GEMV")
    plan = gemv_plan(m, n, k, False, block_n=tile_n, block_k=tile_k, k_iters=k_iters, num_warps=num_warps,
                     sm_count=sm_count, stages=1)
    return dict(plan, SBK=min(block_k_scale, plan["BLOCK_K"]))


def triton_linear_fp8_scaled(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                             weight_dtype: torch.dtype, scale_cast: torch.dtype, **overrides) -> torch.Tensor:
    """Run the Triton GEMV on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1).

    Same arguments, result and errors as `reference_linear_fp8_scaled`, plus RuntimeError when the kernel cannot run
    on the device and ValueError for a block_k that is not a power of two; any M works (rows tiled by up to 8).
    `overrides` (tile_n, tile_k, k_iters, num_warps, sm_count) replace `scaled_plan`'s heuristic. Numerics: module
    docstring.
    """
    n, k = _check_args(x, codes, scale, block_n, block_k, weight_dtype, scale_cast)
    require_launchable(_scaled_gemv_kernel, x.device, "triton_linear_fp8_scaled")
    lead = x.shape[:-1]
    m = math.prod(lead)
    x2 = x.reshape(m, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    overrides.setdefault("sm_count", device_sm_count(x.device))
    # Planned for a non-empty shape first, so bad options raise whatever the shape.
    plan = scaled_plan(max(m, 1), max(n, 1), max(k, 1), block_k, **overrides)
    if m == 0 or n == 0:
        return _empty((m, n), x.dtype, x.device).reshape(*lead, n)
    if k == 0:  # an empty sum: zeros, as F.linear gives
        return torch.zeros((*lead, n), dtype=x.dtype, device=x.device)
    plan = scaled_plan(m, n, k, block_k, **overrides)
    # A copy made here is written by the kernel just before ours, and the GEMV reads its codes before the PDL wait:
    # that launch goes without PDL. The scale is read through its strides (no copy).
    copied = codes.stride(-1) != 1
    if copied:
        codes = codes.contiguous()
    y = _empty((m, n), x.dtype, x.device)
    n_tiles, split_k, m_tiles = plan["grid"]
    part, cnt = split_k_workspace(_empty, x.device, split_k, (m, n), n_tiles * m_tiles)
    pdl = use_pdl_for(_scaled_gemv_kernel, x.device) and not copied
    extra = {"launch_pdl": True} if pdl else {}
    round_s, round_w = kernel_rounding(scale.dtype, weight_dtype, scale_cast)
    _scaled_gemv_kernel[plan["grid"]](
        x2, codes, scale, y, part, cnt,
        m, n, k, x2.stride(0), codes.stride(0), scale.stride(0), scale.stride(1), y.stride(0),
        BN_S=block_n, BK_S=block_k, SBK=plan["SBK"], SCALE_UE8M0=scale.dtype == torch.uint8, ROUND_S=round_s,
        ROUND_W=round_w, FIX_NAN=is_interpreted(_scaled_gemv_kernel), SPLIT_K=split_k, SPLIT_POW2=plan["SPLIT_POW2"],
        K_ITERS=plan["K_ITERS"], BLOCK_M=plan["BLOCK_M"], BLOCK_N=plan["BLOCK_N"], BLOCK_K=plan["BLOCK_K"],
        USE_PDL=pdl, num_warps=plan["num_warps"], **extra)
    return y.reshape(*lead, n)


# ------------------------------------------------------------------------------------------- op
@torch.library.custom_op("dsv41::linear_fp8_scaled", mutates_args=(), device_types="cpu")
def linear_fp8_scaled(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                      weight_dtype: torch.dtype, scale_cast: torch.dtype) -> torch.Tensor:
    """`y = x @ dequantize_fp8_scaled(codes, scale, ...)^T` reading the E4M3 bytes and the scales once; see
    `reference_linear_fp8_scaled` for shapes, dtypes and errors."""
    return reference_linear_fp8_scaled(x, codes, scale, block_n, block_k, weight_dtype, scale_cast)


@register_cuda(linear_fp8_scaled, "dsv41::linear_fp8_scaled")
def _linear_fp8_scaled_cuda(x, codes, scale, block_n, block_k, weight_dtype, scale_cast):
    pow2 = _is_int(block_k) and block_k >= 1 and not block_k & (block_k - 1)
    if pow2 and x.numel() // max(x.shape[-1], 1) <= MAX_TRITON_M:
        return triton_linear_fp8_scaled(x, codes, scale, block_n, block_k, weight_dtype, scale_cast)
    return reference_linear_fp8_scaled(x, codes, scale, block_n, block_k, weight_dtype, scale_cast)


@linear_fp8_scaled.register_fake
def _linear_fp8_scaled_fake(x, codes, scale, block_n, block_k, weight_dtype, scale_cast):
    return x.new_empty((*x.shape[:-1], codes.shape[0]))
