"""`dsv41::mhc_expand_mixes`: an mHC expand and the coefficients of the next mHC site in one launch.

Why. In a V4.1 layer the attention sublayer's expand writes the four-stream residual H' and the feed-forward
sublayer's coefficients are computed from exactly that H' (`mhc_expand` -> `mhc_mixes`). Apart, the mixes kernel
is a launch that waits for the expand before it reads a byte and reduces 2 MB of fn (d = 5120) in 80 programs
with a split-K handshake and the Sinkhorn: 10.8 us per call on the H200 against a 0.48 us byte floor
(bench/results/2026-12-03_h200_s25: 80 launches, 0.87 ms of an 11.3 ms step), and issue 37 counts every launch
between two GEMVs. Fused, the program that writes channels [c0, c0 + BLOCK_D) of the four output streams also
multiplies them with the fn columns of those channels (already loaded before its PDL wait: fn is a weight), so
the coefficient reduction rides on the expand's own grid and the mixes' launch, its wait and its second read of
H' are gone.

Semantics: exactly `mhc_mixes(mhc_expand(y, H, post, comb), fn, base, scale, norm_eps, hc_eps, iters,
norm_weight)` together with that H': the mixes read H' as stored (rounded to H.dtype), as the two ops do.
Arguments and shapes are those of the two ops (`dsv41.kernels.mhc`): y [B, T, d], H [B, T, 4, d]
fp32/bf16/fp16, post fp32 [B, T, 4], comb fp32 [B, T, 4, 4]; fn fp32 [24, 4d], base fp32 [24], scale fp32 [3],
norm_weight None or [4d]. Results (H' [B, T, 4, d] in H.dtype, pre fp32 [B, T, 4], post' fp32 [B, T, 4],
comb' fp32 [B, T, 4, 4]). Reference: the two references in sequence (`reference_mhc_expand_mixes`).

Kernel. Programs (token row, channel split); split s owns CHUNK channels (a multiple of BLOCK_D) of every stream,
so its part of z = flatten(H') is the four stripes k = j d + c. Per block it computes H'_j = post_j y + sum_i
comb[i, j] H_i in FP32 (streams summed in order 0..3, as `mhc_expand`), rounds to H.dtype, stores, and adds the
rounded values' squares and their products with the 24 fn rows to its partial sums; the end (workspace, arrival
counter, fixed-tree sum, sigmoids, Sinkhorn) is `mhc.mixes_finish`, the mixes kernel's own. The first block's fn
columns (and RMS weight) are loaded before the PDL wait. The reduction order differs from the separate mixes
kernel's (blocks of channels of all four streams, not of z), so pre / post / comb agree with the two ops to FP32
rounding (tests: atol 2e-5 / rtol 1e-4), and H' is bit for bit the expand's.

On CPU the op runs the reference; on CUDA one Triton launch (`triton_mhc_expand_mixes`, also runnable on CPU
tensors under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.ref.mhc import HC_MULT

from ._common import next_power_of_2, register_cuda, require_launchable, round_to, use_pdl_for
from .mhc import (block_split, check_expand_args, check_mixes_args, mixes_finish, mixes_workspace, reference_mhc_expand,
                  reference_mhc_mixes)

__all__ = ["mhc_expand_mixes", "reference_mhc_expand_mixes", "triton_mhc_expand_mixes", "expand_mixes_plan"]

#: Channels per block of the fused kernel (its fn tile is 24 x 4 x BLOCK_D FP32 values).
_BLOCK_D = 64
#: Programs the fused kernel aims for at decode (about one per SM of an H200), as the mixes kernel does.
_TARGET_PROGRAMS = 128


def _check(y, H, post, comb, fn, base, scale, norm_eps, hc_eps, iters, norm_weight):
    check_expand_args(y, H, post, comb)
    check_mixes_args(H, fn, base, scale, norm_eps, hc_eps, iters, norm_weight)


def reference_mhc_expand_mixes(y: torch.Tensor, H: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                               fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                               hc_eps: float, iters: int, norm_weight: torch.Tensor | None = None):
    """Plain-PyTorch `dsv41::mhc_expand_mixes`: `reference_mhc_expand`, then `reference_mhc_mixes` of its result.

    Args: y [B, T, d]; H [B, T, 4, d] fp32/bf16/fp16; post fp32 [B, T, 4]; comb fp32 [B, T, 4, 4] (i = source);
        fn fp32 [24, 4d]; base fp32 [24]; scale fp32 [3]; norm_eps (1e-20 in V4.1); hc_eps (1e-6); iters (20);
        norm_weight None or [4d].
    Returns: (H' [B, T, 4, d] in H.dtype, pre fp32 [B, T, 4], post fp32 [B, T, 4], comb fp32 [B, T, 4, 4]).
    Raises: TypeError / ValueError naming the bad argument (the checks of the two ops).
    Source: MODEL.md §2.3 "expand" and steps 1-6; dsv41/ref/mhc.py.
    """
    _check(y, H, post, comb, fn, base, scale, norm_eps, hc_eps, iters, norm_weight)
    out = reference_mhc_expand(y, H, post, comb)
    return (out, *reference_mhc_mixes(out, fn, base, scale, norm_eps, hc_eps, iters, norm_weight))


@triton.jit
def _expand_block(y_ptr, h_ptr, post, c_base, out_row, b, t, cols, ok, sy_b, sy_t, sh_b, sh_t, sh_s, sc_i, sc_j,
                  D: tl.constexpr, BLOCK_D: tl.constexpr):
    # H'_j = post_j * y + sum_i comb[i, j] H_i for channels `cols` (as `_mhc_expand_kernel`), stored rounded; the
    # rounded FP32 values [4, BLOCK_D] are returned for the coefficient sums.
    i4 = tl.arange(0, 4)
    y = tl.load(y_ptr + b * sy_b + t * sy_t + cols, mask=ok, other=0.0).to(tl.float32)
    mixed = tl.zeros([4, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(4):
        c_i = tl.load(c_base + i * sc_i + i4 * sc_j).to(tl.float32)
        h_i = tl.load(h_ptr + b * sh_b + t * sh_t + i * sh_s + cols, mask=ok, other=0.0).to(tl.float32)
        mixed = mixed + c_i[:, None] * h_i[None, :]
    out = round_to(post[:, None] * y[None, :] + mixed, out_row.dtype.element_ty)
    tl.store(out_row + i4[:, None] * D + cols[None, :], out.to(out_row.dtype.element_ty), mask=ok[None, :])
    return tl.where(ok[None, :], out, 0.0)


@triton.jit
def _mhc_expand_mixes_kernel(
    y_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, base_ptr, scale_ptr, pre2_ptr, post2_ptr, comb2_ptr,
    part_ptr, cnt_ptr, nw_ptr,
    T, sy_b, sy_t, sh_b, sh_t, sh_s, sp_b, sp_t, sp_s, sc_b, sc_t, sc_i, sc_j, stride_fn, norm_eps, hc_eps, iters,
    SPLIT,
    D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, SPLIT_POW2: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_W: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    i4 = tl.arange(0, 4)
    r16 = tl.arange(0, 16)
    dd = tl.arange(0, BLOCK_D)
    # fn columns of channel c of stream j: z index k = j D + c. Tiles [coefficient, stream, channel].
    kcol = i4[None, :, None] * D + dd[None, None, :]
    fn_pre = fn_ptr + i4[:, None, None] * stride_fn + kcol
    fn_post = fn_ptr + (4 + i4)[:, None, None] * stride_fn + kcol
    fn_comb = fn_ptr + (8 + r16)[:, None, None] * stride_fn + kcol
    c_first = split * CHUNK
    ok = (c_first + dd) < D
    # fn and the RMS weight are weights: the first block's are read before the PDL wait.
    w_pre = tl.load(fn_pre + c_first, mask=ok[None, None, :], other=0.0)
    w_post = tl.load(fn_post + c_first, mask=ok[None, None, :], other=0.0)
    w_comb = tl.load(fn_comb + c_first, mask=ok[None, None, :], other=0.0)
    if HAS_W:
        nw = tl.load(nw_ptr + i4[:, None] * D + c_first + dd[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    post = tl.load(post_ptr + b * sp_b + t * sp_t + i4 * sp_s).to(tl.float32)  # [4 (destination j)]
    c_base = comb_ptr + b * sc_b + t * sc_t
    out_row = out_ptr + row.to(tl.int64) * (4 * D)
    z = _expand_block(y_ptr, h_ptr, post, c_base, out_row, b, t, c_first + dd, ok, sy_b, sy_t, sh_b, sh_t, sh_s,
                      sc_i, sc_j, D, BLOCK_D)
    sumsq = z * z
    if HAS_W:  # the statistic is over the unweighted z; the projection reads z * w
        z = z * nw
    acc_pre = w_pre * z[None, :, :]
    acc_post = w_post * z[None, :, :]
    acc_comb = w_comb * z[None, :, :]
    for c0 in range(c_first + BLOCK_D, c_first + CHUNK, BLOCK_D):
        ok = (c0 + dd) < D
        z = _expand_block(y_ptr, h_ptr, post, c_base, out_row, b, t, c0 + dd, ok, sy_b, sy_t, sh_b, sh_t, sh_s,
                          sc_i, sc_j, D, BLOCK_D)
        sumsq += z * z
        if HAS_W:
            z = z * tl.load(nw_ptr + i4[:, None] * D + c0 + dd[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
        acc_pre += tl.load(fn_pre + c0, mask=ok[None, None, :], other=0.0) * z[None, :, :]
        acc_post += tl.load(fn_post + c0, mask=ok[None, None, :], other=0.0) * z[None, :, :]
        acc_comb += tl.load(fn_comb + c0, mask=ok[None, None, :], other=0.0) * z[None, :, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    ss = tl.sum(tl.sum(sumsq, axis=1), axis=0)
    d_pre = tl.sum(tl.sum(acc_pre, axis=2), axis=1)
    d_post = tl.sum(tl.sum(acc_post, axis=2), axis=1)
    d_comb = tl.reshape(tl.sum(tl.sum(acc_comb, axis=2), axis=1), [4, 4])
    mixes_finish(ss, d_pre, d_post, d_comb, row, split, part_ptr, cnt_ptr, base_ptr, scale_ptr, pre2_ptr,
                 post2_ptr, comb2_ptr, norm_eps, hc_eps, iters, SPLIT, 4 * D, SPLIT_POW2)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result allocation; a seam the tests replace to poison outputs."""
    return torch.empty(shape, dtype=dtype, device=device)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def expand_mixes_plan(rows: int, d: int, split: int | None = None) -> dict:
    """Channel split of the fused kernel: {"SPLIT": programs per token, "CHUNK": channels each, "BLOCK_D"}.

    About `_TARGET_PROGRAMS` programs share the rows at decode (d = 5120: 80 programs of one 64-channel block);
    with many rows each program loops over more blocks. `split` forces a number of splits (tests); CHUNK is a
    multiple of the block, so the split used may be smaller. Raises ValueError for split < 1.
    """
    block_d = min(_BLOCK_D, next_power_of_2(d))
    n_split, per = block_split(-(-d // block_d), rows, _TARGET_PROGRAMS, split)
    return {"SPLIT": n_split, "CHUNK": per * block_d, "BLOCK_D": block_d}


def triton_mhc_expand_mixes(y: torch.Tensor, H: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                            fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                            hc_eps: float, iters: int, norm_weight: torch.Tensor | None = None,
                            split: int | None = None):
    """Triton `dsv41::mhc_expand_mixes` on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1).

    Same arguments, results (H' bit for bit, the coefficients to FP32 rounding: module docstring) and errors as
    `reference_mhc_expand_mixes`; `split` overrides the number of channel splits (`expand_mixes_plan`). One launch.
    Raises RuntimeError for CPU tensors without the interpreter.
    """
    _check(y, H, post, comb, fn, base, scale, norm_eps, hc_eps, iters, norm_weight)
    require_launchable(_mhc_expand_mixes_kernel, H.device, "triton_mhc_expand_mixes")
    b, t, _, d = H.shape
    out = _empty((b, t, HC_MULT, d), H.dtype, H.device)
    pre2 = _empty((b, t, HC_MULT), torch.float32, H.device)
    post2 = _empty((b, t, HC_MULT), torch.float32, H.device)
    comb2 = _empty((b, t, HC_MULT, HC_MULT), torch.float32, H.device)
    if b * t == 0:
        return out, pre2, post2, comb2
    H, y, fn = _last_dim_contiguous(H), _last_dim_contiguous(y), _last_dim_contiguous(fn)
    base, scale = base.contiguous(), scale.contiguous()
    has_w = norm_weight is not None
    nw = norm_weight.contiguous() if has_w else fn  # not read when HAS_W is False
    plan = expand_mixes_plan(b * t, d, split)
    n_split = plan["SPLIT"]
    part, cnt = mixes_workspace(b * t, n_split, H.device)
    pdl = use_pdl_for(_mhc_expand_mixes_kernel, H.device)
    _mhc_expand_mixes_kernel[(b * t, n_split)](
        y, H, post, comb, out, fn, base, scale, pre2, post2, comb2, part, cnt, nw,
        t, y.stride(0), y.stride(1), H.stride(0), H.stride(1), H.stride(2), post.stride(0), post.stride(1),
        post.stride(2), comb.stride(0), comb.stride(1), comb.stride(2), comb.stride(3), fn.stride(0),
        float(norm_eps), float(hc_eps), int(iters), n_split,
        D=d, BLOCK_D=plan["BLOCK_D"], CHUNK=plan["CHUNK"], SPLIT_POW2=next_power_of_2(n_split), USE_PDL=pdl,
        HAS_W=has_w, num_warps=4, enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    return out, pre2, post2, comb2


@torch.library.custom_op("dsv41::mhc_expand_mixes", mutates_args=(), device_types="cpu")
def mhc_expand_mixes(y: torch.Tensor, H: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                     base: torch.Tensor, scale: torch.Tensor, norm_eps: float, hc_eps: float, iters: int,
                     norm_weight: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC expand followed by the next site's coefficients of its result; see `reference_mhc_expand_mixes`."""
    return reference_mhc_expand_mixes(y, H, post, comb, fn, base, scale, norm_eps, hc_eps, iters, norm_weight)


@register_cuda(mhc_expand_mixes, "dsv41::mhc_expand_mixes")
def _mhc_expand_mixes_cuda(y, H, post, comb, fn, base, scale, norm_eps, hc_eps, iters, norm_weight=None):
    return triton_mhc_expand_mixes(y, H, post, comb, fn, base, scale, norm_eps, hc_eps, iters, norm_weight)


@mhc_expand_mixes.register_fake
def _mhc_expand_mixes_fake(y, H, post, comb, fn, base, scale, norm_eps, hc_eps, iters, norm_weight=None):
    b, t = H.shape[0], H.shape[1]
    return (torch.empty_like(H, memory_format=torch.contiguous_format),
            H.new_empty((b, t, HC_MULT), dtype=torch.float32), H.new_empty((b, t, HC_MULT), dtype=torch.float32),
            H.new_empty((b, t, HC_MULT, HC_MULT), dtype=torch.float32))

