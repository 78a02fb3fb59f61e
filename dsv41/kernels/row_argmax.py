"""Greedy decoding's argmax over a vocabulary row, split across the GPU: the `row_argmax` fusion target.

Why. A decode step ends with `logits.argmax(-1)` over a row of 128K+ logits. Inductor makes that one reduction
kernel with one program per row: at batch 1, one program walks the whole row (33 µs a step on an H100 at Llama's
128,256 vocabulary, session 37's profile; 0.26 MB that the copy bandwidth reads in 0.1 µs). This op splits each row
over many programs; the last program of a row to arrive merges the splits' results.

Op (`dsv41::row_argmax(x) -> idx`):
    x    bf16 / fp16 / fp32 [..., N], N >= 1
    idx  int64 [...]: torch.argmax(x, dim=-1): the index of the largest value, the first one among equal values,
         and the first NaN where the row has one (torch treats NaN as the largest)
Reference: `reference_row_argmax` (torch.argmax). Exact: the values are compared, never rounded.

Kernel. Program (row, split) reads CHUNK consecutive values in BLOCK-wide tiles, keeping the largest value, its
first index and the first NaN index; it writes them to a workspace, and the last split of the row to arrive
(arrival counter, acquire/release) merges them in split order. Under PDL a program waits for the previous kernel
before its first load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (check_tensor, next_power_of_2, register_cuda, require_launchable, split_k_counters,
                      use_pdl_for)

__all__ = ["row_argmax", "reference_row_argmax", "triton_row_argmax", "argmax_plan", "MAX_TRITON_ROWS"]

#: Rows (the product of the leading dims) the CUDA implementation sends to the kernel; more rows (prefill) are
#: parallel enough for torch.argmax.
MAX_TRITON_ROWS = 8
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(x) -> None:
    check_tensor("x", x, dtypes=_DTYPES, min_ndim=1)
    if x.shape[-1] == 0:
        raise ValueError(f"x {tuple(x.shape)} has an empty last dim: argmax of no values")


def reference_row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(x, dim=-1)`.

    Args: x bf16 / fp16 / fp32 [..., N], N >= 1. Returns: int64 [...].
    Raises: TypeError for another dtype or a non-tensor, ValueError for N = 0 (named).
    """
    _check(x)
    return torch.argmax(x, dim=-1)


@triton.jit
def _argmax_kernel(x_ptr, o_ptr, wv_ptr, wi_ptr, cnt_ptr, N, sx_r,
                   BLOCK: tl.constexpr, TILES: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                   USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the logits come from the previous kernel
    offs0 = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], N, tl.int64)
    nan_i = tl.full([BLOCK], N, tl.int64)
    for t in range(TILES):
        offs = (sp * TILES + t) * BLOCK + offs0
        ok = offs < N
        v = tl.load(x_ptr + row * sx_r + offs, mask=ok, other=float("-inf")).to(tl.float32)
        isn = v != v
        nan_i = tl.minimum(nan_i, tl.where(isn & ok, offs, N))
        # per lane: a strictly larger value replaces (an equal later one does not: the first index wins)
        take = ok & (v > best_v) & ~isn
        first_lane = ok & (best_i == N) & ~isn   # a lane's first value, -inf included
        take = take | first_lane
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, offs, best_i)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    bv = tl.max(best_v, axis=0)
    bi = tl.min(tl.where((best_v == bv) & (best_i < N), best_i, N), axis=0)
    ni = tl.min(nan_i, axis=0)
    slot = row * SPLITS + sp
    tl.store(wv_ptr + slot, bv)
    tl.store(wi_ptr + 2 * slot, bi)
    tl.store(wi_ptr + 2 * slot + 1, ni)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
    if arrived == SPLITS - 1:
        j = tl.arange(0, SPLITS_P2)
        j_ok = j < SPLITS
        sv = tl.load(wv_ptr + row * SPLITS + j, mask=j_ok, other=float("-inf"), cache_modifier=".cg")
        si = tl.load(wi_ptr + 2 * (row * SPLITS + j), mask=j_ok, other=N, cache_modifier=".cg")
        sn = tl.load(wi_ptr + 2 * (row * SPLITS + j) + 1, mask=j_ok, other=N, cache_modifier=".cg")
        mv = tl.max(sv, axis=0)
        idx = tl.min(tl.where((sv == mv) & (si < N), si, N), axis=0)
        first_nan = tl.min(sn, axis=0)
        tl.store(o_ptr + row, tl.where(first_nan < N, first_nan, idx))
        tl.atomic_xchg(cnt_ptr + row, 0)


def argmax_plan(rows: int, n: int, *, block: int | None = None, splits: int | None = None,
                sm_count: int = 132) -> dict:
    """Launch parameters: BLOCK values per tile (default 1,024), SPLITS programs per row (default: about 2 per SM
    over all rows, each at least one tile, at most 128), TILES per program; grid (rows, splits). Raises ValueError for
    a block that is not a power of two or splits < 1."""
    block = block or 1024
    if block < 1 or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two")
    tiles = max(1, -(-n // block))
    if splits is None:
        splits = max(1, min(tiles, 128, -(-2 * sm_count // max(rows, 1))))
    if splits < 1:
        raise ValueError(f"splits={splits} must be >= 1")
    splits = min(splits, tiles)
    per = -(-tiles // splits)
    splits = -(-tiles // per)
    return dict(BLOCK=block, TILES=per, SPLITS=splits, SPLITS_P2=next_power_of_2(splits), grid=(rows, splits))


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result/workspace allocation; a seam the tests replace to poison outputs."""
    return torch.empty(shape, dtype=dtype, device=device)


def triton_row_argmax(x: torch.Tensor, **overrides) -> torch.Tensor:
    """`reference_row_argmax` on the Triton kernel (interpreted on CPU under TRITON_INTERPRET=1); `overrides`
    (block, splits) replace the `argmax_plan` heuristic. Raises as the reference, plus RuntimeError when the kernel
    cannot run on the device."""
    _check(x)
    require_launchable(_argmax_kernel, x.device, "triton_row_argmax")
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = _empty((rows,), torch.int64, x.device)
    if rows == 0:
        return out.reshape(x.shape[:-1])
    plan = argmax_plan(rows, n, **overrides)
    wv = _empty((rows * plan["SPLITS"],), torch.float32, x.device)
    wi = _empty((rows * plan["SPLITS"] * 2,), torch.int64, x.device)
    cnt = split_k_counters(x.device, rows)
    pdl = use_pdl_for(_argmax_kernel, x.device)
    extra = {"launch_pdl": True} if pdl else {}
    _argmax_kernel[plan["grid"]](x2, out, wv, wi, cnt, n, x2.stride(0), BLOCK=plan["BLOCK"], TILES=plan["TILES"],
                                 SPLITS=plan["SPLITS"], SPLITS_P2=plan["SPLITS_P2"], USE_PDL=pdl, num_warps=4,
                                 **extra)
    return out.reshape(x.shape[:-1])


@torch.library.custom_op("dsv41::row_argmax", mutates_args=(), device_types="cpu")
def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of x [..., N]; see the module docstring."""
    return reference_row_argmax(x)


@register_cuda(row_argmax, "dsv41::row_argmax")
def _row_argmax_cuda(x):
    if x.numel() // max(x.shape[-1], 1) <= MAX_TRITON_ROWS and x.shape[-1] > 0:
        return triton_row_argmax(x)
    return reference_row_argmax(x)


@row_argmax.register_fake
def _row_argmax_fake(x):
    return x.new_empty(x.shape[:-1], dtype=torch.int64)
