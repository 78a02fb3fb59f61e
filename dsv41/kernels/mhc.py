"""mHC coefficient, collapse + RMSNorm and expand kernels (`dsv41 report --patterns mhc`).

Around every sublayer the eager model (dsv41/ref/mhc.py, MODEL.md §2.3) runs three chains of small ops on the
four-stream residual H [B, T, 4, d]; each becomes one op here:

- `dsv41::mhc_mixes(H, fn, base, scale, norm_eps, hc_eps, iters, norm_weight=None) -> (pre, post, comb)`:
  z = flatten(H) in FP32, r = rsqrt(mean(z^2) + norm_eps), m = (z @ fn^T) * r (24 values), pre = sigmoid(m[0:4] *
  scale[0] + base[0:4]) + hc_eps, post = 2 sigmoid(m[4:8] * scale[1] + base[4:8]), comb = Sinkhorn of the 4x4
  logits m[8:24] * scale[2] + base[8:24] (softmax over j + hc_eps, column normalisation, then `iters - 1` times
  row then column normalisation, each `C / (sum + hc_eps)`). H [B, T, 4, d] fp32/bf16/fp16, fn fp32 [24, 4d],
  base fp32 [24], scale fp32 [3]; pre, post fp32 [B, T, 4]; comb fp32 [B, T, 4, 4] (comb[..., i, j] = weight of
  source stream i in destination stream j). With `norm_weight` w [4d] (fp32/bf16/fp16; schema `Tensor?
  norm_weight=None`) m = ((z * w) @ fn^T) * r, the spelling `F.linear(rms_norm(flatten(H), (4d,), w, eps), fn)`
  (the statistic r stays unweighted). Reference: `dsv41.ref.mhc.mhc_mixes` (with fn * w for the weight).
- `dsv41::mhc_collapse_rmsnorm(H, pre, weight, eps, widened=False) -> x`: x = rms_norm(sum_i pre_i H_i, weight, eps) with the
  collapse accumulated in FP32 and rounded to H.dtype before the norm (as the eager code does), the norm in FP32;
  x [B, T, d] in H.dtype, pre fp32 [B, T, 4], weight [d] any float dtype. Reference: `rms_norm(mhc_collapse(...))`.
  With `widened=True` the row is not rounded between the collapse and the norm (the reference of H.float(), then
  one rounding of x to H.dtype): the graph torch < 2.13 leaves, which reads H through an upcast and writes x
  through a downcast, without either copy.
- `dsv41::mhc_expand(y, H, post, comb) -> H'`: H'_j = post_j * y + sum_i comb[i, j] H_i in FP32, rounded to
  H.dtype; y [B, T, d] any float dtype, post fp32 [B, T, 4], comb fp32 [B, T, 4, 4]. Reference: `mhc_expand`.

On CPU the ops run the references; on CUDA one Triton launch each (`triton_<name>`, also runnable on CPU tensors
under TRITON_INTERPRET=1, see `_common`).

Kernels. `mhc_mixes`: programs (token row, K split); each reduces its CHUNK of the 4d-long z in blocks of
BLOCK_K elements (streams concatenated, so any d works), accumulating sum(z^2) and the three coefficient groups as
[4], [4] and [4, 4] tiles (fn rows 0:4, 4:8, 8:24 loaded in that shape). With more than one split the 25
partial sums go to a workspace and the last program of the row to arrive (split-K counter, as in quant_gemv)
sums them, every split in one vector load per group and a fixed reduction tree (deterministic), then runs the
sigmoids and the Sinkhorn iterations on the 4x4 tile in registers. With a norm_weight (constexpr HAS_W) each
block also loads its BLOCK_K weights and multiplies z by them after the sum of squares (the weight is never
folded into fn: that would read and write all of fn every step); without it the kernel is unchanged. So at
decode the 2 MB fn read (d = 5120) is spread over 80 programs instead of one. Under PDL each program reads
its first fn block before waiting for the previous kernel (fn is a weight); at the h200 decode shape (80
programs of one block) that took the kernel from 11.98 to 10.80 us on the H200 against a 0.48 us byte floor
(bench/results/2026-12-01_h200_s17/kernels_mhc_*.json), and the Sinkhorn's approximate divisions (below) from 12.2 to
9.4 us (bench/results/2026-12-03_h200_s25): it is latency-bound (reductions, split-K handshake, Sinkhorn), not
bandwidth-bound. `mhc_collapse_rmsnorm`: one program per token holding the whole [d] row (d <= MAX_D).
`mhc_expand`: one program per (token, BLOCK_D channels) computing all four output streams.

FP32 order. The kernels keep the reference's operation order where the reference fixes it: the collapse sums the
streams 0, 1, 2, 3 in order; the Sinkhorn steps, the `+ eps` and the divisions are elementwise the same ops, the
norms' divisions correctly rounded (`div_rn`), rsqrt as a correctly rounded sqrt and division, FMA contraction off.
The Sinkhorn divisions are Triton's FP32 `/` (div.full.f32, at most 2 ulp from the correctly rounded quotient; the
interpreter divides exactly): with correctly rounded divisions rounds 2..20 took 5.3 of the kernel's 12.2 us on the
H200 (with `/` 2.7 of 9.4 us). The long reductions (z @ fn^T, mean of squares over 4d or d) are blocked tree sums
whose order differs from the reference's BLAS / vectorised sums, and `exp` / `sigmoid` use Triton's FP32 exp; results
therefore agree with the references to FP32 rounding, not bit for bit (tests: atol 2e-5 / rtol 1e-4 in FP32, also
on the GPU; one bf16 ulp for bf16 H).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.ref import mhc as _ref
from dsv41.ref.mhc import HC_MULT

from ._common import (check_same_device, check_tensor, next_power_of_2, register_cuda, require_launchable, round_to,
                      split_k_counters, use_pdl_for)

__all__ = [
    "mhc_mixes", "mhc_collapse_rmsnorm", "mhc_expand_op",
    "reference_mhc_mixes", "reference_mhc_collapse_rmsnorm", "reference_mhc_expand",
    "triton_mhc_mixes", "triton_mhc_collapse_rmsnorm", "triton_mhc_expand",
    "mixes_plan", "block_split", "mixes_finish", "mixes_workspace", "check_mixes_args", "check_expand_args", "N_MIX", "MAX_D", "MAX_ITERS",
]

#: Coefficients per token: 4 pre + 4 post + 16 comb ((2 + n) * n for n = 4 streams).
N_MIX = (2 + HC_MULT) * HC_MULT
#: Largest hidden size `mhc_collapse_rmsnorm` keeps in one program's registers (its row is one tile).
MAX_D = 16384
#: Largest Sinkhorn iteration count accepted (the model uses 20; the bound only rejects nonsense).
MAX_ITERS = 1024
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Elements of z per block of the mixes reduction (the fn tile is 24 x BLOCK_K FP32 values).
_MIXES_BLOCK_K = 256
#: Programs the mixes reduction aims for at decode (about one per SM of an H200).
_MIXES_TARGET_PROGRAMS = 128
#: Channels per program of the expand kernel.
_EXPAND_BLOCK_D = 1024


# ------------------------------------------------------------------------------------------- checks
def _check_h(H):
    check_tensor("H", H, dtypes=_FLOAT_DTYPES, ndim=4)
    if H.shape[2] != HC_MULT:
        raise ValueError(f"H must be [B, T, {HC_MULT}, d] (four residual streams), got {tuple(H.shape)}")
    if H.shape[3] < 1:
        raise ValueError(f"H has an empty hidden dim: {tuple(H.shape)}")


def check_mixes_args(H, fn, base, scale, norm_eps, hc_eps, iters, norm_weight=None):
    """The argument checks of `mhc_mixes` (shared with `mhc_fold`): TypeError / ValueError naming the bad one."""
    _check_h(H)
    check_tensor("fn", fn, dtypes=(torch.float32,), ndim=2)
    check_tensor("base", base, dtypes=(torch.float32,), ndim=1)
    check_tensor("scale", scale, dtypes=(torch.float32,), ndim=1)
    check_same_device(H=H, fn=fn, base=base, scale=scale)
    k = HC_MULT * H.shape[3]
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, dtypes=_FLOAT_DTYPES, ndim=1)
        check_same_device(H=H, norm_weight=norm_weight)
        if tuple(norm_weight.shape) != (k,):
            raise ValueError(f"norm_weight must be [4d] = [{k}] for H {tuple(H.shape)}, "
                             f"got {tuple(norm_weight.shape)}")
    if tuple(fn.shape) != (N_MIX, k):
        raise ValueError(f"fn must be [{N_MIX}, 4d] = [{N_MIX}, {k}] for H {tuple(H.shape)}, got {tuple(fn.shape)}")
    if tuple(base.shape) != (N_MIX,):
        raise ValueError(f"base must be [{N_MIX}], got {tuple(base.shape)}")
    if tuple(scale.shape) != (3,):
        raise ValueError(f"scale must be [3], got {tuple(scale.shape)}")
    if isinstance(iters, bool) or not isinstance(iters, int) or not 1 <= iters <= MAX_ITERS:
        raise ValueError(f"iters must be an int in [1, {MAX_ITERS}], got {iters!r}")
    for name, v in (("norm_eps", norm_eps), ("hc_eps", hc_eps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0.0:
            raise ValueError(f"{name} must be a non-negative float, got {v!r}")


def _check_collapse(H, pre, weight, eps, widened=False):
    _check_h(H)
    if not isinstance(widened, bool):
        raise TypeError(f"widened must be a bool, got {type(widened).__name__}")
    check_tensor("pre", pre, dtypes=_FLOAT_DTYPES, ndim=3)
    check_tensor("weight", weight, dtypes=_FLOAT_DTYPES, ndim=1)
    check_same_device(H=H, pre=pre, weight=weight)
    if tuple(pre.shape) != tuple(H.shape[:3]):
        raise ValueError(f"pre must be H.shape[:3] = {tuple(H.shape[:3])}, got {tuple(pre.shape)}")
    if tuple(weight.shape) != (H.shape[3],):
        raise ValueError(f"weight must be [d] = [{H.shape[3]}], got {tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def check_expand_args(y, H, post, comb):
    """The argument checks of `mhc_expand` (shared with `mhc_fold`): TypeError / ValueError naming the bad one."""
    _check_h(H)
    check_tensor("y", y, dtypes=_FLOAT_DTYPES, ndim=3)
    check_tensor("post", post, dtypes=_FLOAT_DTYPES, ndim=3)
    check_tensor("comb", comb, dtypes=_FLOAT_DTYPES, ndim=4)
    check_same_device(y=y, H=H, post=post, comb=comb)
    b, t, n, d = H.shape
    if tuple(y.shape) != (b, t, d):
        raise ValueError(f"y must be [B, T, d] = {(b, t, d)} for H {tuple(H.shape)}, got {tuple(y.shape)}")
    if tuple(post.shape) != (b, t, n):
        raise ValueError(f"post must be [B, T, 4] = {(b, t, n)}, got {tuple(post.shape)}")
    if tuple(comb.shape) != (b, t, n, n):
        raise ValueError(f"comb must be [B, T, 4, 4] = {(b, t, n, n)}, got {tuple(comb.shape)}")


# ------------------------------------------------------------------------------------------- references
def reference_mhc_mixes(H: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                        norm_eps: float, hc_eps: float, iters: int, norm_weight: torch.Tensor | None = None):
    """Plain-PyTorch `dsv41::mhc_mixes`: `dsv41.ref.mhc.mhc_mixes` with contiguous results.

    With `norm_weight` w the projection reads the weighted normalised streams, m = (z * r * w) @ fn^T, the
    "RMS-normalise, then project" spelling `F.linear(rms_norm(flatten(H), (4d,), w, eps), fn)`; the statistic r
    stays over the unweighted z. Computed as `mhc_mixes` with fn * w[None, :] (one more FP32 rounding per fn
    element than the eager spelling's z * r * w: equal to FP32 rounding).

    Args:
        H: [B, T, 4, d] fp32/bf16/fp16. fn: fp32 [24, 4d]. base: fp32 [24]. scale: fp32 [3].
        norm_eps: eps of the RMS statistic (1e-20 in V4.1). hc_eps: 1e-6. iters: Sinkhorn rounds (20), >= 1.
        norm_weight: None, or the RMS weight [4d] fp32/bf16/fp16.
    Returns: (pre fp32 [B, T, 4], post fp32 [B, T, 4], comb fp32 [B, T, 4, 4]).
    Raises: TypeError / ValueError naming the bad argument (dtype, shape, iters out of range, negative eps).
    Source: MODEL.md §2.3 steps 1-6; dsv41/ref/mhc.py.
    """
    check_mixes_args(H, fn, base, scale, norm_eps, hc_eps, iters, norm_weight)
    return _ref.mhc_mixes_normed(H, fn, base, scale, norm_eps, hc_eps, iters, norm_weight)


def reference_mhc_collapse_rmsnorm(H: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor,
                                   eps: float, widened: bool = False) -> torch.Tensor:
    """Plain-PyTorch `dsv41::mhc_collapse_rmsnorm`: `rms_norm(mhc_collapse(H, pre), weight, eps)`.

    Args: H [B, T, 4, d] fp32/bf16/fp16; pre [B, T, 4] (fp32 from mhc_mixes); weight [d]; eps (1e-20 in V4.1);
    widened: compute as for `H.float()` (the collapsed row is not rounded to H.dtype before the norm) and round
    only the result to H.dtype: what a graph computes once Inductor has removed the FP32 -> H.dtype -> FP32 round
    trip between the collapse and the norm (torch < 2.13).
    Returns: [B, T, d] in H.dtype.
    Raises: TypeError / ValueError naming the bad argument.
    Source: MODEL.md §2.2, §2.3 "collapse"; dsv41/ref/mhc.py `mhc_collapse`, dsv41/ref/norm.py `rms_norm`.
    """
    _check_collapse(H, pre, weight, eps, widened)
    if widened:
        return _ref.mhc_collapse_rmsnorm(H.float(), pre, weight, eps).to(H.dtype)
    return _ref.mhc_collapse_rmsnorm(H, pre, weight, eps)


def reference_mhc_expand(y: torch.Tensor, H: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch `dsv41::mhc_expand`: `dsv41.ref.mhc.mhc_expand(y, H, post, comb)`.

    Args: y [B, T, d]; H [B, T, 4, d] fp32/bf16/fp16; post fp32 [B, T, 4]; comb fp32 [B, T, 4, 4] (i = source).
    Returns: [B, T, 4, d] in H.dtype.
    Raises: TypeError / ValueError naming the bad argument.
    Source: MODEL.md §2.3 "expand"; dsv41/ref/mhc.py `mhc_expand`.
    """
    check_expand_args(y, H, post, comb)
    return _ref.mhc_expand(y, H, post, comb).contiguous()


# ------------------------------------------------------------------------------------------- kernels
@triton.jit
def _mhc_mixes_kernel(
    h_ptr, fn_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, part_ptr, cnt_ptr, nw_ptr,
    T, sh_b, sh_t, sh_s, stride_fn, norm_eps, hc_eps, iters, SPLIT,
    D: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, SPLIT_POW2: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_W: tl.constexpr,
):
    # Program (row, split) reduces z[split * CHUNK : (split + 1) * CHUNK] against the 24 fn rows; with
    # SPLIT > 1 the partial sums go to a workspace and the last program of the row to arrive sums them (all
    # splits in one vector load per group, a fixed reduction tree: deterministic) and runs the sigmoid /
    # Sinkhorn epilogue.
    K: tl.constexpr = 4 * D
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // T
    t = row % T
    h_row = h_ptr + b.to(tl.int64) * sh_b + t.to(tl.int64) * sh_t
    i4 = tl.arange(0, 4)
    kk = tl.arange(0, BLOCK_K)
    # fn rows as the three coefficient groups: pre rows 0..3, post rows 4..7, comb rows 8 + 4 i + j.
    fn_pre = fn_ptr + i4[:, None] * stride_fn + kk[None, :]
    fn_post = fn_ptr + (4 + i4)[:, None] * stride_fn + kk[None, :]
    fn_comb = fn_ptr + (8 + 4 * i4[:, None, None] + i4[None, :, None]) * stride_fn + kk[None, None, :]

    # The first block of fn is read before the PDL wait: fn is a weight, never the previous kernel's output, so
    # its DRAM round trip overlaps that kernel's tail (at decode each program owns one block: the whole read).
    k_first = split * CHUNK
    k_ok = (k_first + kk) < K
    w_pre = tl.load(fn_pre + k_first, mask=k_ok[None, :], other=0.0)
    w_post = tl.load(fn_post + k_first, mask=k_ok[None, :], other=0.0)
    w_comb = tl.load(fn_comb + k_first, mask=k_ok[None, None, :], other=0.0)
    if HAS_W:  # the RMS weight is a weight too
        nw = tl.load(nw_ptr + k_first + kk, mask=k_ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    # z[k] = H[stream k // D, channel k % D] (flatten(H) of the reference, any row stride per stream).
    k = k_first + kk
    z = tl.load(h_row + (k // D) * sh_s + (k % D), mask=k_ok, other=0.0).to(tl.float32)
    sumsq = z * z
    if HAS_W:  # the statistic is over the unweighted z; the projection reads z * w (r is applied at the end)
        z = z * nw
    acc_pre = w_pre * z[None, :]
    acc_post = w_post * z[None, :]
    acc_comb = w_comb * z[None, None, :]
    for k0 in range(k_first + BLOCK_K, k_first + CHUNK, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        z = tl.load(h_row + (k // D) * sh_s + (k % D), mask=k_ok, other=0.0).to(tl.float32)
        sumsq += z * z
        w_pre = tl.load(fn_pre + k0, mask=k_ok[None, :], other=0.0)
        w_post = tl.load(fn_post + k0, mask=k_ok[None, :], other=0.0)
        w_comb = tl.load(fn_comb + k0, mask=k_ok[None, None, :], other=0.0)
        if HAS_W:
            z = z * tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        acc_pre += w_pre * z[None, :]
        acc_post += w_post * z[None, :]
        acc_comb += w_comb * z[None, None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    ss = tl.sum(sumsq, axis=0)
    d_pre = tl.sum(acc_pre, axis=1)
    d_post = tl.sum(acc_post, axis=1)
    d_comb = tl.sum(acc_comb, axis=2)
    mixes_finish(ss, d_pre, d_post, d_comb, row, split, part_ptr, cnt_ptr, base_ptr, scale_ptr, pre_ptr,
                 post_ptr, comb_ptr, norm_eps, hc_eps, iters, SPLIT, K, SPLIT_POW2)


@triton.jit
def mixes_finish(ss, d_pre, d_post, d_comb, row, split, part_ptr, cnt_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr,
                 comb_ptr, norm_eps, hc_eps, iters, SPLIT, K: tl.constexpr, SPLIT_POW2: tl.constexpr):
    """The end of an mHC coefficient reduction, shared by `_mhc_mixes_kernel` and `mhc_fold`'s fused kernel:
    program `split` of token `row` holds its partial sums (ss: sum of z^2; d_pre / d_post [4], d_comb [4, 4]: fn
    rows times z over its part of the K = 4d elements). With SPLIT > 1 they go to the workspace (`part_ptr`, 32
    floats per split and row) and the last program of the row to arrive (`cnt_ptr` counter) sums every split in a
    fixed tree; that program (or the only one) writes pre, post and the Sinkhorn comb of the row."""
    i4 = tl.arange(0, 4)
    is_last = split == 0
    if SPLIT > 1:
        # Workspace row layout (32 floats): [sumsq, pre 0..3, post 0..3, comb 0..15].
        p_row = part_ptr + row.to(tl.int64) * SPLIT * 32
        p_mine = p_row + split * 32
        tl.store(p_mine + i4 * 0, tl.where(i4 == 0, ss, 0.0), mask=i4 == 0)
        tl.store(p_mine + 1 + i4, d_pre)
        tl.store(p_mine + 5 + i4, d_post)
        tl.store(p_mine + 9 + 4 * i4[:, None] + i4[None, :], d_comb)
        # Every thread's partial must be visible before the counter moves (release at GPU scope).
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
        is_last = arrived == SPLIT - 1
        ss = 0.0
        d_pre = tl.zeros([4], dtype=tl.float32)
        d_post = tl.zeros([4], dtype=tl.float32)
        d_comb = tl.zeros([4, 4], dtype=tl.float32)
        if is_last:
            # Every split's partials in four independent vector loads, not a loop of dependent L2 round trips
            # (64 splits at d = 4096: the serial loop was most of the kernel's 35 us on the H200). .cg: read L2.
            sp = tl.arange(0, SPLIT_POW2)
            sp_ok = sp < SPLIT
            p_sp = p_row + sp * 32
            ss = tl.sum(tl.load(p_sp, mask=sp_ok, other=0.0, cache_modifier=".cg"), axis=0)
            d_pre = tl.sum(tl.load(p_sp[:, None] + 1 + i4[None, :], mask=sp_ok[:, None], other=0.0,
                                   cache_modifier=".cg"), axis=0)
            d_post = tl.sum(tl.load(p_sp[:, None] + 5 + i4[None, :], mask=sp_ok[:, None], other=0.0,
                                    cache_modifier=".cg"), axis=0)
            d_comb = tl.sum(tl.load(p_sp[:, None, None] + 9 + 4 * i4[None, :, None] + i4[None, None, :],
                                    mask=sp_ok[:, None, None], other=0.0, cache_modifier=".cg"), axis=0)
            tl.atomic_xchg(cnt_ptr + row, 0)

    base_pre = tl.load(base_ptr + i4)
    base_post = tl.load(base_ptr + 4 + i4)
    base_comb = tl.load(base_ptr + 8 + 4 * i4[:, None] + i4[None, :])
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    # r = rsqrt(mean(z^2) + eps): mean as sum / K, rsqrt as a correctly rounded sqrt and division.
    r = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(ss, K * 1.0) + norm_eps))
    pre = tl.sigmoid((d_pre * r) * s_pre + base_pre) + hc_eps
    post = 2.0 * tl.sigmoid((d_post * r) * s_post + base_post)

    # Sinkhorn (dsv41.ref.mhc.sinkhorn): softmax over j (dim -1) + eps, column normalisation (sum over the
    # source axis i, dim -2), then iters - 1 rounds of row then column normalisation.
    logits = (d_comb * r) * s_comb + base_comb
    # The divisions are Triton's FP32 `/` (div.full.f32, within 2 ulp), not div_rn: a correctly rounded division
    # is a branchy instruction sequence on the critical path; at the h200 decode shape rounds 2..20 took 5.3 of the
    # kernel's 12.2 us with div_rn and take 2.7 of 9.4 us so (bench/results/2026-12-03_h200_s25/mhc_probe.json).
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    c = e / tl.sum(e, axis=1)[:, None] + hc_eps
    c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
    for _ in range(1, iters):
        c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)

    last4 = (i4 * 0 + is_last.to(tl.int32)) != 0
    tl.store(pre_ptr + row * 4 + i4, pre, mask=last4)
    tl.store(post_ptr + row * 4 + i4, post, mask=last4)
    tl.store(comb_ptr + row * 16 + 4 * i4[:, None] + i4[None, :], c, mask=last4[:, None] & last4[None, :])


@triton.jit
def _mhc_collapse_rmsnorm_kernel(
    h_ptr, pre_ptr, w_ptr, x_ptr,
    T, sh_b, sh_t, sh_s, sp_b, sp_t, sp_s, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr, ROUND_X: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // T
    t = row % T
    h_row = h_ptr + b.to(tl.int64) * sh_b + t.to(tl.int64) * sh_t
    p_row = pre_ptr + b.to(tl.int64) * sp_b + t.to(tl.int64) * sp_t
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    # Collapse: sum over the streams in order 0, 1, 2, 3 of pre_i * H_i (FP32), as the eager sum(dim=2).
    acc = tl.load(p_row).to(tl.float32) * tl.load(h_row + cols, mask=ok, other=0.0).to(tl.float32)
    for s in tl.static_range(1, 4):
        p = tl.load(p_row + s * sp_s).to(tl.float32)
        acc = acc + p * tl.load(h_row + s * sh_s + cols, mask=ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if ROUND_X:
        # mhc_collapse casts to H.dtype; rms_norm reads that tensor back in FP32.
        x = round_to(acc, x_ptr.dtype.element_ty)
    else:
        # widened: the collapse and the norm run on H.float() (no rounding between), only y is rounded.
        x = acc
    ms = tl.math.div_rn(tl.sum(x * x, axis=0), D * 1.0)
    r = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
    y = round_to((x * r) * w, x_ptr.dtype.element_ty)
    tl.store(x_ptr + row.to(tl.int64) * D + cols, y.to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _mhc_expand_kernel(
    y_ptr, h_ptr, post_ptr, comb_ptr, out_ptr,
    T, sy_b, sy_t, sh_b, sh_t, sh_s, sp_b, sp_t, sp_s, sc_b, sc_t, sc_i, sc_j,
    D: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    i4 = tl.arange(0, 4)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    y = tl.load(y_ptr + b * sy_b + t * sy_t + cols, mask=ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + b * sp_b + t * sp_t + i4 * sp_s).to(tl.float32)  # [4 (destination j)]
    c_base = comb_ptr + b * sc_b + t * sc_t
    # mixed_j = sum_i comb[i, j] H_i, summed over i in order 0..3; then H'_j = post_j * y + mixed_j.
    mixed = tl.zeros([4, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(4):
        c_i = tl.load(c_base + i * sc_i + i4 * sc_j).to(tl.float32)  # comb[i, :] over destinations j
        h_i = tl.load(h_ptr + b * sh_b + t * sh_t + i * sh_s + cols, mask=ok, other=0.0).to(tl.float32)
        mixed = mixed + c_i[:, None] * h_i[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out = post[:, None] * y[None, :] + mixed
    out = round_to(out, out_ptr.dtype.element_ty)
    o_row = out_ptr + row.to(tl.int64) * (4 * D)
    tl.store(o_row + i4[:, None] * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok[None, :])


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result allocation; a seam the tests replace to poison outputs."""
    return torch.empty(shape, dtype=dtype, device=device)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def mixes_plan(rows: int, d: int, split: int | None = None) -> dict:
    """Split of the mixes reduction (K = 4d) over programs: {"SPLIT": programs per token, "CHUNK": elements each}.

    At decode (one token) a single program would read all of fn (24 x 4d FP32, 1.5 MB at d = 4096) alone;
    the reduction is spread so that about `_MIXES_TARGET_PROGRAMS` programs share the rows' work, each over a
    multiple of the block size. `split` forces a number of splits (tests, benchmarks); CHUNK is rounded up to
    a multiple of the block, so the split actually used may be smaller.
    Raises ValueError for split < 1.
    """
    k = HC_MULT * d
    block_k = min(_MIXES_BLOCK_K, next_power_of_2(k))
    n_split, blocks_per = block_split(-(-k // block_k), rows, _MIXES_TARGET_PROGRAMS, split)
    return {"SPLIT": n_split, "CHUNK": blocks_per * block_k}


def block_split(n_blocks: int, rows: int, target: int, split: int | None = None) -> tuple[int, int]:
    """(programs per row, blocks each) spreading `n_blocks` blocks of a per-row reduction so that about `target`
    programs share `rows` rows (`split` forces a number of splits; the split used may be smaller, as every program
    takes the same whole number of blocks). Shared by `mixes_plan` and `mhc_fold.expand_mixes_plan`.
    Raises ValueError for split < 1."""
    if split is None:
        split = max(1, min(n_blocks, target // max(rows, 1)))
    elif split < 1:
        raise ValueError(f"split must be >= 1, got {split}")
    per = -(-n_blocks // min(split, n_blocks))
    return -(-n_blocks // per), per


def mixes_workspace(rows: int, n_split: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial sums fp32 [rows, n_split, 32], arrival counters int32) of a split coefficient reduction
    (`mixes_finish`); with one split neither is read and both are one-element placeholders."""
    if n_split > 1:
        return _empty((rows, n_split, 32), torch.float32, device), split_k_counters(device, rows)
    return torch.empty(1, dtype=torch.float32, device=device), torch.empty(1, dtype=torch.int32, device=device)


def triton_mhc_mixes(H: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     norm_eps: float, hc_eps: float, iters: int, split: int | None = None,
                     norm_weight: torch.Tensor | None = None):
    """Triton `dsv41::mhc_mixes` on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1).

    Same arguments, results (to FP32 rounding, see the module docstring) and errors as `reference_mhc_mixes`.
    One launch over (token, K split) programs (`mixes_plan`; `split` overrides the number of splits); H's and
    fn's last dims are made contiguous if they are not. `norm_weight` (keyword: `split` came first) is read in
    the same loop as fn, one [4d] vector per program's chunk; without it the kernel is the unweighted one
    (constexpr HAS_W False). Raises RuntimeError for CPU tensors without the interpreter.
    """
    check_mixes_args(H, fn, base, scale, norm_eps, hc_eps, iters, norm_weight)
    require_launchable(_mhc_mixes_kernel, H.device, "triton_mhc_mixes")
    b, t, _, d = H.shape
    pre = _empty((b, t, HC_MULT), torch.float32, H.device)
    post = _empty((b, t, HC_MULT), torch.float32, H.device)
    comb = _empty((b, t, HC_MULT, HC_MULT), torch.float32, H.device)
    if b * t == 0:
        return pre, post, comb
    H = _last_dim_contiguous(H)
    fn = _last_dim_contiguous(fn)
    base = base.contiguous()
    scale = scale.contiguous()
    has_w = norm_weight is not None
    nw = norm_weight.contiguous() if has_w else fn  # not read when HAS_W is False
    k = HC_MULT * d
    block_k = min(_MIXES_BLOCK_K, next_power_of_2(k))
    plan = mixes_plan(b * t, d, split=split)
    n_split, chunk = plan["SPLIT"], plan["CHUNK"]
    part, cnt = mixes_workspace(b * t, n_split, H.device)
    pdl = use_pdl_for(_mhc_mixes_kernel, H.device)
    _mhc_mixes_kernel[(b * t, n_split)](
        H, fn, base, scale, pre, post, comb, part, cnt, nw,
        t, H.stride(0), H.stride(1), H.stride(2), fn.stride(0), float(norm_eps), float(hc_eps), int(iters), n_split,
        D=d, BLOCK_K=block_k, CHUNK=chunk, SPLIT_POW2=next_power_of_2(n_split), USE_PDL=pdl, HAS_W=has_w,
        num_warps=4, enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    return pre, post, comb


def triton_mhc_collapse_rmsnorm(H: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float,
                                widened: bool = False) -> torch.Tensor:
    """Triton `dsv41::mhc_collapse_rmsnorm` on the tensors' device (interpreted on CPU).

    Same arguments, result and errors as `reference_mhc_collapse_rmsnorm`, plus ValueError for d > MAX_D (the
    row is one tile). One launch, one program per token.
    """
    _check_collapse(H, pre, weight, eps, widened)
    require_launchable(_mhc_collapse_rmsnorm_kernel, H.device, "triton_mhc_collapse_rmsnorm")
    b, t, _, d = H.shape
    if d > MAX_D:
        raise ValueError(f"mhc_collapse_rmsnorm keeps a row in one program: d = {d} exceeds MAX_D = {MAX_D}")
    x = _empty((b, t, d), H.dtype, H.device)
    if b * t == 0:
        return x
    H = _last_dim_contiguous(H)
    weight = weight.contiguous()
    block_d = next_power_of_2(d)
    pdl = use_pdl_for(_mhc_collapse_rmsnorm_kernel, H.device)
    _mhc_collapse_rmsnorm_kernel[(b * t,)](
        H, pre, weight, x,
        t, H.stride(0), H.stride(1), H.stride(2), pre.stride(0), pre.stride(1), pre.stride(2), float(eps),
        D=d, BLOCK_D=block_d, USE_PDL=pdl, ROUND_X=not widened,
        num_warps=max(1, min(16, block_d // 512)), enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    return x


def triton_mhc_expand(y: torch.Tensor, H: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Triton `dsv41::mhc_expand` on the tensors' device (interpreted on CPU).

    Same arguments, result and errors as `reference_mhc_expand`. One launch over (token, BLOCK_D channels).
    """
    check_expand_args(y, H, post, comb)
    require_launchable(_mhc_expand_kernel, H.device, "triton_mhc_expand")
    b, t, _, d = H.shape
    out = _empty((b, t, HC_MULT, d), H.dtype, H.device)
    if b * t == 0:
        return out
    H = _last_dim_contiguous(H)
    y = _last_dim_contiguous(y)
    block_d = min(_EXPAND_BLOCK_D, next_power_of_2(d))
    pdl = use_pdl_for(_mhc_expand_kernel, H.device)
    _mhc_expand_kernel[(b * t, triton.cdiv(d, block_d))](
        y, H, post, comb, out,
        t, y.stride(0), y.stride(1), H.stride(0), H.stride(1), H.stride(2),
        post.stride(0), post.stride(1), post.stride(2), comb.stride(0), comb.stride(1), comb.stride(2),
        comb.stride(3),
        D=d, BLOCK_D=block_d, USE_PDL=pdl,
        num_warps=4, enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    return out


# ------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("dsv41::mhc_mixes", mutates_args=(), device_types="cpu")
def mhc_mixes(H: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
              hc_eps: float, iters: int,
              norm_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre / post / Sinkhorn coefficients of one site (optionally with the RMS weight of the "normalise,
    then project" spelling); see `reference_mhc_mixes`."""
    return reference_mhc_mixes(H, fn, base, scale, norm_eps, hc_eps, iters, norm_weight)


@register_cuda(mhc_mixes, "dsv41::mhc_mixes")
def _mhc_mixes_cuda(H, fn, base, scale, norm_eps, hc_eps, iters, norm_weight=None):
    return triton_mhc_mixes(H, fn, base, scale, norm_eps, hc_eps, iters, norm_weight=norm_weight)


@mhc_mixes.register_fake
def _mhc_mixes_fake(H, fn, base, scale, norm_eps, hc_eps, iters, norm_weight=None):
    b, t = H.shape[0], H.shape[1]
    return (H.new_empty((b, t, HC_MULT), dtype=torch.float32), H.new_empty((b, t, HC_MULT), dtype=torch.float32),
            H.new_empty((b, t, HC_MULT, HC_MULT), dtype=torch.float32))


@torch.library.custom_op("dsv41::mhc_collapse_rmsnorm", mutates_args=(), device_types="cpu")
def mhc_collapse_rmsnorm(H: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float,
                         widened: bool = False) -> torch.Tensor:
    """mHC collapse with `pre` followed by RMSNorm; see `reference_mhc_collapse_rmsnorm`."""
    return reference_mhc_collapse_rmsnorm(H, pre, weight, eps, widened)


@register_cuda(mhc_collapse_rmsnorm, "dsv41::mhc_collapse_rmsnorm")
def _mhc_collapse_rmsnorm_cuda(H, pre, weight, eps, widened=False):
    return triton_mhc_collapse_rmsnorm(H, pre, weight, eps, widened)


@mhc_collapse_rmsnorm.register_fake
def _mhc_collapse_rmsnorm_fake(H, pre, weight, eps, widened=False):
    return H.new_empty((H.shape[0], H.shape[1], H.shape[3]))


@torch.library.custom_op("dsv41::mhc_expand", mutates_args=(), device_types="cpu")
def mhc_expand_op(y: torch.Tensor, H: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC post-mix with the residual update; see `reference_mhc_expand`. (Python name `mhc_expand_op` so it
    does not shadow the model's `mhc_expand`, which is its reference.)"""
    return reference_mhc_expand(y, H, post, comb)


@register_cuda(mhc_expand_op, "dsv41::mhc_expand")
def _mhc_expand_cuda(y, H, post, comb):
    return triton_mhc_expand(y, H, post, comb)


@mhc_expand_op.register_fake
def _mhc_expand_fake(y, H, post, comb):
    return torch.empty_like(H, memory_format=torch.contiguous_format)
