"""Several block-FP8 GEMVs of one activation in one launch: `dsv41::linear_fp8_block_multi`, the `sibling_gemv`
target.

`linear_fp8_block_multi(x, [W_0, ..], [S_0, ..], act_quant)` = `[linear_fp8_block(x, W_i, S_i, act_quant) for i]`
for 2 to `MAX_SIBLINGS` weights [N_i, K] of one K (e.g. an attention block's q / kv down-projections, an MLP's gate
and up projections). Same shapes, dtypes, reference numerics and errors as `quant_gemv.linear_fp8_block` per weight.

Why. At decode (one x row) each of those GEMVs is a short launch whose ramp and tail are a large part of its time:
a launch that waits for its predecessor reads 6.6 MB at 42-44 % and 11.8 MB at 54-56 % of copy bandwidth
(bench/results/2026-12-02_h200_s23, read_ceiling). One grid over all the weights pays that once. Measured on the
H200 (CUDA-graph replay, PDL, one x row, bench/results/2026-12-02_h200_s23/sibling_probe.json, as weights
concatenated along N through the tile kernel): the `h200` shared expert's w1 + w3 16.28 -> 14.02 us, wq_a + wkv
9.55 -> 6.97 us.

Kernel. The tile-at-once program of `quant_gemv` (`gemv_tile`: weight tile loads before the PDL wait, FP8 1x32
activation quantisation, FP32 block sums, split-K merge) on a grid of the weights' n-tiles one after another: n-tile
t belongs to the weight whose tile range holds it, and the program reads that weight, its scales and strides and
writes that output. One plan for all (`quant_gemv.gemv_plan` for the summed N), so where it equals each weight's own
plan (the `h200` pairs) the results are those of the separate ops bit for bit; otherwise they differ by FP32
summation order only. The split-K workspace holds every weight's partials in its own region, and the arrival
counters are indexed by the global tile.

When. For one bf16 / fp32 x row with act_quant and 8 MiB or more of weights (`frag_launch_applies`, a GPU with FP8
`mma.sync`): the tensor-core fragment GEMV of `gemv_frag` over every weight, one activation launch and one GEMV
launch (`gemv_frag.launch_frag_gemv_multi`; its plan is that of the summed N, so results differ from the single ops'
by FP32 summation order only). H200, PDL, CUDA-graph replay, in one run (bench/results/2026-12-02_h200_s24,
multi_frag_probe): wq_a + wkv 6.97 us against 8.39 (tile launch below) and 9.78 (separate ops); shared w1 + w3 12.89
against 14.38 and 16.29; wq_b + the indexer's wq_b 16.86 against 20.72 (separate ops, wq_b on the fragment GEMV).
Otherwise one tile launch (`multi_launch_applies`) for one x row where every weight would take the tile kernel alone
(below `quant_gemv.TMA_MIN_WEIGHT_BYTES_M1` bytes, or no TMA on the device) and is contiguous along K; otherwise the
separate `triton_linear_fp8_block` calls (several x rows take the TMA kernel; a large weight is faster on it: wq_b +
the indexer's wq_b measured 23.33 us as two launches against 24.43 us as one tile launch).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import check_same_device, register_cuda, require_launchable, split_k_workspace, use_pdl_for
from .gemv_tiles import gemv_tile, pick_operand, store_gemv_result, weight_slot
from .quant_gemv import (MAX_TRITON_M, check_linear_args, device_sm_count, gemv_plan, reference_linear_fp8_block,
                         split_tma_overrides, triton_linear_fp8_block)

__all__ = ["linear_fp8_block_multi", "reference_linear_fp8_block_multi", "triton_linear_fp8_block_multi",
           "multi_launch_applies", "frag_launch_applies", "FRAG_MULTI_MIN_WEIGHT_BYTES", "MAX_SIBLINGS"]

#: Most weights one op (and one launch) takes: the kernel has this many pointer slots.
MAX_SIBLINGS = 4


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result/workspace allocation; a seam the tests replace to poison outputs with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_multi(x: torch.Tensor, weights, scales) -> list[int]:
    """Output widths N_i; ValueError for a count outside 2..MAX_SIBLINGS or unequal list lengths, and the ValueError
    / TypeError `quant_gemv.linear_fp8_block` raises for an (x, weight, scale) it rejects, prefixed with the weight's
    position unless it is about x."""
    if len(weights) != len(scales):
        raise ValueError(f"{len(weights)} weights but {len(scales)} scales")
    if not 2 <= len(weights) <= MAX_SIBLINGS:
        raise ValueError(f"linear_fp8_block_multi takes 2 to {MAX_SIBLINGS} weights, got {len(weights)}")
    widths = []
    for i, (w, s) in enumerate(zip(weights, scales)):
        try:
            n, _ = check_linear_args(x, w, s, False)
        except (ValueError, TypeError) as err:
            where = "" if str(err).startswith("x ") else f"weight {i}: "  # an error about x names x alone
            raise type(err)(f"{where}{err}") from None
        widths.append(n)
    return widths


def reference_linear_fp8_block_multi(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor],
                                     act_quant: bool) -> list[torch.Tensor]:
    """Plain PyTorch: `[quant_gemv.reference_linear_fp8_block(x, W_i, S_i, act_quant) for i]`.

    x [..., K] (fp32 / bf16 / fp16); weights[i] uint8 E4M3 [N_i, K]; scales[i] uint8 UE8M0 [ceil(N_i / 32), K / 32]
    (MODEL.md §2.1, 32 x 32 blocks). Returns y_i [..., N_i] in x's dtype.
    Raises ValueError / TypeError as `_check_multi` (2 to MAX_SIBLINGS weights; each as
    `reference_linear_fp8_block`)."""
    _check_multi(x, weights, scales)
    return [reference_linear_fp8_block(x, w, s, act_quant) for w, s in zip(weights, scales)]


#: Whether one x row with act_quant runs the block-FP8 fragment kernel over all the weights (`frag_launch_applies`),
#: from this many weight bytes in all (`quant_gemv.FRAG_DEFAULT` must be on too).
FRAG_MULTI_MIN_WEIGHT_BYTES = 8 << 20


def frag_launch_applies(x: torch.Tensor, weights: list[torch.Tensor], act_quant: bool) -> bool:
    """Whether `triton_linear_fp8_block_multi` runs the tensor-core fragment kernel (`gemv_frag`, one activation
    launch and one GEMV launch for every weight): `quant_gemv.FRAG_DEFAULT`, one bf16 / fp32 x row with act_quant on
    a CUDA device with FP8 `mma.sync` (or meta tensors, where the launch census models the H200), at least
    `FRAG_MULTI_MIN_WEIGHT_BYTES` of weights, each readable as 16-byte vectors in place."""
    from . import quant_gemv
    from .gemv_frag import frag_gemv_eligible, frag_gemv_supported
    m = x.numel() // max(x.shape[-1], 1)
    return (quant_gemv.FRAG_DEFAULT and bool(act_quant) and m == 1 and x.dtype in (torch.bfloat16, torch.float32)
            and x.device.type in ("cuda", "meta") and frag_gemv_supported(x.device)
            and sum(w.numel() for w in weights) >= FRAG_MULTI_MIN_WEIGHT_BYTES
            and all(frag_gemv_eligible(x, w, True) for w in weights))


def multi_launch_applies(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether `triton_linear_fp8_block_multi` runs one launch (module docstring "When"): one x row, every weight
    contiguous along K and on the tile kernel by default (`quant_gemv.split_tma_overrides` picks no TMA for it)."""
    m = x.numel() // max(x.shape[-1], 1)
    return m == 1 and all(w.stride(-1) == 1 and split_tma_overrides({}, False, x.device, m, w) is None
                          for w in weights)


@triton.jit
def _gemv_multi_kernel(
    x_ptr, w0, s0, y0, w1, s1, y1, w2, s2, y2, w3, s3, y3, part_ptr, cnt_ptr,
    M, K, N0, N1, N2, N3, stride_xm, sw0, sw1, sw2, sw3, ss0, ss1, ss2, ss3, sy0, sy1, sy2, sy3,
    COUNT: tl.constexpr, ACT_QUANT: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr,
    K_ITERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program (global n-tile, K split, m-tile): the n-tiles of weight 0, then weight 1's, ... (unused slots of a
    # COUNT < 4 launch repeat weight 0 and are never picked).
    NKB: tl.constexpr = BLOCK_K // 32
    X_FP16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    c1, c2, c3, tile_n, col0 = weight_slot(pid_n, N0, N1, N2, BLOCK_N, COUNT)
    w_ptr = pick_operand(c1, c2, c3, w0, w1, w2, w3, COUNT)
    s_ptr = pick_operand(c1, c2, c3, s0, s1, s2, s3, COUNT)
    y_ptr = pick_operand(c1, c2, c3, y0, y1, y2, y3, COUNT)
    N = pick_operand(c1, c2, c3, N0, N1, N2, N3, COUNT)
    stride_wn = pick_operand(c1, c2, c3, sw0, sw1, sw2, sw3, COUNT)
    stride_sn = pick_operand(c1, c2, c3, ss0, ss1, ss2, ss3, COUNT)
    stride_ym = pick_operand(c1, c2, c3, sy0, sy1, sy2, sy3, COUNT)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.arange(0, NKB)
    j32 = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(K_ITERS):
        acc = gemv_tile(x_ptr, w_ptr, s_ptr, acc, offs_n, n_ok, offs_m, kb, j32, (pid_k * K_ITERS + it) * BLOCK_K,
                         pid_m, M, K, stride_xm, stride_wn, stride_sn, False, ACT_QUANT, X_FP16, BLOCK_M, BLOCK_N,
                         NKB, USE_PDL, False)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # Weight i's split-K partials: their own [SPLIT_K, M, N_i] region of the workspace; counters by global tile.
    part_i = part_ptr + col0.to(tl.int64) * SPLIT_K * M
    store_gemv_result(acc, y_ptr, part_i, cnt_ptr, offs_m, offs_n, n_ok, pid_m, pid_n, pid_k, M, N, stride_ym,
                       SPLIT_K, SPLIT_POW2)


def triton_linear_fp8_block_multi(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor],
                                  act_quant: bool) -> list[torch.Tensor]:
    """Run the GEMVs on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1): the fragment kernel of
    `gemv_frag` over every weight where `frag_launch_applies` (an activation launch and one GEMV launch), else one
    launch of `_gemv_multi_kernel` where `multi_launch_applies`, else `quant_gemv.triton_linear_fp8_block` per
    weight.

    Same arguments, results and errors as `reference_linear_fp8_block_multi` (numerics: module docstring); also
    ValueError for tensors on different devices and RuntimeError on CPU tensors without the interpreter.
    """
    widths = _check_multi(x, weights, scales)
    check_same_device(x=x, **{f"weights[{i}]": w for i, w in enumerate(weights)},
                      **{f"scales[{i}]": s for i, s in enumerate(scales)})
    frag = frag_launch_applies(x, weights, act_quant)
    if not frag and not multi_launch_applies(x, weights):
        return [triton_linear_fp8_block(x, w, s, act_quant) for w, s in zip(weights, scales)]
    require_launchable(_gemv_multi_kernel, x.device, "triton_linear_fp8_block_multi")
    lead = x.shape[:-1]
    k = x.shape[-1]
    m = math.prod(lead)
    x2 = x.reshape(m, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if k == 0:  # empty sums: zeros, as F.linear gives
        return [torch.zeros((*lead, n), dtype=x.dtype, device=x.device) for n in widths]
    # A scale copied here is written just before the launch, and the kernel reads its tiles before the PDL wait
    # (as `quant_gemv` does): that launch goes without PDL.
    copied = any(s.stride(-1) != 1 for s in scales)
    scales = [s if s.stride(-1) == 1 else s.contiguous() for s in scales]
    if frag:
        from .gemv_frag import frag_gemv_plan, launch_frag_gemv_multi
        plan = frag_gemv_plan(sum(widths), k, sm_count=device_sm_count(x.device))
        ys = launch_frag_gemv_multi(x2, list(weights), scales, plan, _empty, pdl_allowed=not copied)
        return [y.reshape(*lead, n) for y, n in zip(ys, widths)]
    ys = [_empty((m, n), x.dtype, x.device) for n in widths]
    plan = gemv_plan(m, sum(widths), k, False, sm_count=device_sm_count(x.device))
    block_n = plan["BLOCK_N"]
    tiles = sum(-(-n // block_n) for n in widths)
    split_k, m_tiles = plan["SPLIT_K"], plan["grid"][2]
    if tiles == 0:
        return [y.reshape(*lead, n) for y, n in zip(ys, widths)]
    part, cnt = split_k_workspace(_empty, x.device, split_k, (m, sum(widths)), tiles * m_tiles)
    pad = MAX_SIBLINGS - len(weights)
    ws, ss, yy, nn = (list(weights) + [weights[0]] * pad, scales + [scales[0]] * pad, ys + [ys[0]] * pad,
                      widths + [0] * pad)
    pdl = use_pdl_for(_gemv_multi_kernel, x.device) and not copied
    extra = {"launch_pdl": True} if pdl else {}
    _gemv_multi_kernel[(tiles, split_k, m_tiles)](
        x2, ws[0], ss[0], yy[0], ws[1], ss[1], yy[1], ws[2], ss[2], yy[2], ws[3], ss[3], yy[3], part, cnt,
        m, k, *nn, x2.stride(0), *(w.stride(0) for w in ws), *(s.stride(0) for s in ss), *(y.stride(0) for y in yy),
        COUNT=len(weights), ACT_QUANT=bool(act_quant), SPLIT_K=split_k, SPLIT_POW2=plan["SPLIT_POW2"],
        K_ITERS=plan["K_ITERS"], BLOCK_M=plan["BLOCK_M"], BLOCK_N=block_n, BLOCK_K=plan["BLOCK_K"], USE_PDL=pdl,
        num_warps=plan["num_warps"], **extra)
    return [y.reshape(*lead, n) for y, n in zip(ys, widths)]


# ------------------------------------------------------------------------------------------- op
@torch.library.custom_op("dsv41::linear_fp8_block_multi", mutates_args=(), device_types="cpu")
def linear_fp8_block_multi(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor],
                           act_quant: bool) -> list[torch.Tensor]:
    """`[fq8(x) @ dequant(W_i)^T for i]` for 2 to `MAX_SIBLINGS` block-FP8 weights of one K; see
    `reference_linear_fp8_block_multi` for shapes."""
    return reference_linear_fp8_block_multi(x, weights, scales, act_quant)


@register_cuda(linear_fp8_block_multi, "dsv41::linear_fp8_block_multi")
def _linear_fp8_block_multi_cuda(x, weights, scales, act_quant):
    if x.numel() // max(x.shape[-1], 1) <= MAX_TRITON_M:
        return triton_linear_fp8_block_multi(x, weights, scales, act_quant)
    return reference_linear_fp8_block_multi(x, weights, scales, act_quant)


@linear_fp8_block_multi.register_fake
def _linear_fp8_block_multi_fake(x, weights, scales, act_quant):
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]
