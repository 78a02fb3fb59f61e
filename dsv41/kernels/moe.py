"""MoE router and MoE tail kernels (pass family: `dsv41 report --patterns moe`; MODEL.md §2.9).

Two ops, each one Triton launch on CUDA and the model's own math on CPU:

- `dsv41::moe_router(x, weight, bias, topk, gate_temp, route_scale, norm_eps) -> (weights, ids)`:
  logits `l = (x_fp32 @ weight_fp32^T) / gate_temp`; scores `s = sqrt(softplus(l))`; selection
  `ids = top-k(s + bias)` (the bias only selects); `weights = s[ids] / (sum_k s[ids] + norm_eps) * route_scale`.
  x [..., d] fp32/bf16/fp16; weight [E, d] fp32/bf16/fp16; bias fp32 [E] or None (no selection bias);
  weights fp32 [..., k]; ids int64 [..., k], in descending biased-score order.
  Reference: `dsv41.model.moe.Gate.forward` (MODEL.md §2.9 "Router" steps 1-4).
- `dsv41::moe_combine(y, shared, weights, out_dtype) -> out`:
  `out = (sum_j w_j * y_j + shared)` in FP32 (w_j = 1 when `weights` is None), rounded to `out_dtype`.
  y [..., k, d] (routed expert outputs), shared [..., d] (shared expert output), weights [..., k] (any float dtype,
  used in FP32; the router gives FP32) or None,
  out [..., d] in `out_dtype` (fp32/bf16/fp16). Reference: the last line of `dsv41.model.moe.MoE.forward`
  (`experts(x) + shared_experts(x).float()` cast to x.dtype), where the experts' output is
  `y.float().sum(dim=1)` (`RoutedExperts.forward_gather`). V4.1 applies the routing weight BEFORE w2
  (MODEL.md §2.9 "Expert"), so the model's tail passes `weights=None`; `weights` serves code that weights the
  expert outputs after w2 (a different rounding of the same product, not the V4.1 order).

Tie rule of the top-k: among equal biased scores the LOWER expert index wins (a stable descending sort, the rule
of `dsv41.model.csa.select_topk`). The model's `Gate` calls `torch.topk`, whose choice among exact ties is
implementation-defined on CPU (it depends on E and k); the selected set of this op equals torch.topk's whenever
the k-th and (k+1)-th largest biased scores differ, and the order of the returned ids equals it whenever the
selected scores are distinct. The CPU reference and the Triton kernel both follow the lower-index rule.

Why the gate GEMV is inside the router kernel. At decode the router's logits are a 384 x 5120 BF16 GEMV (3.9 MB,
~1 us of HBM time on an H200) whose output (384 floats) only feeds the selection: a separate GEMV launch costs as
much as its bytes, and the logits would round-trip through memory for a second launch. Here the GEMV is split over
up to 384 programs (expert blocks x row blocks, `router_plan`; at decode one expert each); each writes its logits to
a small workspace and the last program of a row block to arrive (split-K arrival counter, as in quant_gemv / mhc)
runs softplus, sqrt, the top-k and the normalisation for those rows. One launch, W read once. Each program reads its
first W block before the PDL wait. On an H100 at the h200 shape (bench/results/2026-12-07_h100_s31) the launch takes
8.56 us (12.69 us before this plan and the prefetch; `torch.mv` of the same W alone 7.71 us); the selection's six
rounds cost about 2 us of it (k = 1: 10.24 against 12.36 us on the old plan), and a launch reading 8 experts 6.0 us.

`moe_combine` is one program per (token row, BLOCK_D channels): it sums the k expert rows in order 0..k-1 in FP32
(optionally weighted), adds the shared row and rounds once. Under tensor parallelism the all-reduce of the MoE
output follows this op in the graph (a collective cannot live inside a Triton kernel); the `moe` pass records it.

FP32 order. Logits: a blocked dot product (another order than BLAS), divided by gate_temp with a correctly
rounded division; softplus is `l` above 20 (torch's threshold) else log1p(exp(l)) computed as
`log(1 + u) * u / ((1 + u) - 1)` (exact-ish log1p from log, u = exp(l)); sqrt correctly rounded; the k selected
scores are summed in selection order, then `s / (sum + eps) * route_scale` with a correctly rounded division.
`exp` / `log` are Triton's FP32 ones. Results agree with the references to FP32 rounding, not bit for bit; a
selection can differ only where two biased scores are within that rounding of each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.ref import moe as _ref

from ._common import (check_same_device, check_tensor, next_power_of_2, register_cuda, require_launchable, round_to,
                      split_k_counters, use_pdl_for)

__all__ = [
    "moe_router", "moe_combine",
    "reference_moe_router", "reference_moe_combine",
    "triton_moe_router", "triton_moe_combine",
    "router_plan", "combine_plan", "MAX_EXPERTS", "MAX_TOPK",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Largest expert count: the selection holds a [BLOCK_R, next_pow2(E)] tile in registers (V4.1: 384).
MAX_EXPERTS = 4096
#: Largest k: the selection loop is unrolled k times (V4.1: 6).
MAX_TOPK = 64
#: Above this logit softplus(l) is l in FP32 (torch.nn.functional.softplus's default threshold).
SOFTPLUS_THRESHOLD = 20.0
#: Programs a router launch aims for: at decode one expert each (E = 384). H100, h200 shape, CUDA graph + PDL
#: (bench/results/2026-12-07_h100_s31/router_plans.txt): 96 programs of 4 experts, 4 warps 12.34 us; 192 of 2,
#: 4 warps 9.26 us; 384 of 1, 4 warps 9.05 us, 8 warps 8.56 us.
_ROUTER_TARGET_PROGRAMS = 384
#: Warps of a program whose row block is one token (decode; see above); 4 otherwise (not measured otherwise).
_ROUTER_DECODE_WARPS = 8
#: Register budget (FP32 elements) of the router's [BLOCK_R, BLOCK_E, BLOCK_D] product tile and of the
#: [BLOCK_R, next_pow2(E)] selection tile.
_ROUTER_TILE = 4096
_ROUTER_MAX_BLOCK_D = 1024
_ROUTER_MAX_BLOCK_R = 16
#: Programs a combine launch aims for at decode, and its channel block bounds.
_COMBINE_TARGET_PROGRAMS = 64
_COMBINE_MIN_BLOCK_D = 128
_COMBINE_MAX_BLOCK_D = 1024


# ------------------------------------------------------------------------------------------- checks
def _check_router(x, weight, bias, topk, gate_temp, route_scale, norm_eps):
    check_tensor("x", x, dtypes=_FLOAT_DTYPES, min_ndim=1)
    check_tensor("weight", weight, dtypes=_FLOAT_DTYPES, ndim=2)
    if bias is not None:
        check_tensor("bias", bias, dtypes=(torch.float32,), ndim=1)
        check_same_device(x=x, weight=weight, bias=bias)
    else:
        check_same_device(x=x, weight=weight)
    e, d = weight.shape
    if x.shape[-1] != d:
        raise ValueError(f"x must be [..., d] with d = weight.shape[1] = {d}, got {tuple(x.shape)}")
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"weight must have 1..{MAX_EXPERTS} expert rows, got {e}")
    if bias is not None and tuple(bias.shape) != (e,):
        raise ValueError(f"bias must be [E] = [{e}], got {tuple(bias.shape)}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= min(e, MAX_TOPK):
        raise ValueError(f"topk must be an int in [1, min(E, {MAX_TOPK})] = [1, {min(e, MAX_TOPK)}], got {topk!r}")
    for name, v in (("gate_temp", gate_temp), ("route_scale", route_scale), ("norm_eps", norm_eps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise ValueError(f"{name} must be a float, got {v!r}")
    if not gate_temp > 0.0:
        raise ValueError(f"gate_temp must be positive, got {gate_temp!r}")
    if not norm_eps >= 0.0:
        raise ValueError(f"norm_eps must be non-negative, got {norm_eps!r}")


def _check_combine(y, shared, weights, out_dtype, y_dtype=None):
    check_tensor("y", y, dtypes=_FLOAT_DTYPES, min_ndim=2)
    if y_dtype is not None and (not isinstance(y_dtype, torch.dtype) or y_dtype not in _FLOAT_DTYPES):
        raise TypeError(f"y_dtype must be None or one of float32, bfloat16, float16, got {y_dtype!r}")
    check_tensor("shared", shared, dtypes=_FLOAT_DTYPES, min_ndim=1)
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of float32, bfloat16, float16, got {out_dtype!r}")
    lead, k, d = tuple(y.shape[:-2]), y.shape[-2], y.shape[-1]
    if tuple(shared.shape) != lead + (d,):
        raise ValueError(f"shared must be y.shape[:-2] + (d,) = {lead + (d,)} for y {tuple(y.shape)}, "
                         f"got {tuple(shared.shape)}")
    if weights is not None:
        check_tensor("weights", weights, dtypes=_FLOAT_DTYPES, min_ndim=1)
        check_same_device(y=y, shared=shared, weights=weights)
        if tuple(weights.shape) != lead + (k,):
            raise ValueError(f"weights must be y.shape[:-1] = {lead + (k,)}, got {tuple(weights.shape)}")
    else:
        check_same_device(y=y, shared=shared)
    if k < 1 or k > MAX_TOPK:
        raise ValueError(f"y must hold 1..{MAX_TOPK} expert outputs along dim -2, got {k}")


# ------------------------------------------------------------------------------------------- references
def reference_moe_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, topk: int,
                         gate_temp: float, route_scale: float, norm_eps: float):
    """Plain-PyTorch `dsv41::moe_router`: the model's `Gate.forward` with the lower-index tie rule.

    Args:
        x: [..., d] fp32/bf16/fp16 (the FFN input after ffn_norm). weight: [E, d] router weight (any float dtype,
            upcast to FP32 as the model does). bias: fp32 [E] selection bias, or None. topk: k (6 in V4.1).
        gate_temp: logit divisor (1.0). route_scale: routed_scaling_factor (1.5). norm_eps: the eps of the
            normalisation sum (1e-20).
    Returns:
        (weights fp32 [..., k], ids int64 [..., k]) with ids in descending biased-score order.
    Raises:
        TypeError / ValueError naming the bad argument (dtype, shape, k out of [1, min(E, MAX_TOPK)],
        gate_temp <= 0, negative eps).
    Source: MODEL.md §2.9 "Router"; dsv41/model/moe.py `Gate.forward`; tie rule of dsv41/model/csa.py `select_topk`.
    """
    _check_router(x, weight, bias, topk, gate_temp, route_scale, norm_eps)
    return _ref.moe_router(x, weight, bias, topk, gate_temp, route_scale, norm_eps)


def reference_moe_combine(y: torch.Tensor, shared: torch.Tensor, weights: torch.Tensor | None,
                          out_dtype: torch.dtype, y_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain-PyTorch `dsv41::moe_combine`: `((w * y.float()).sum(-2) + shared.float()).to(out_dtype)`.

    Args:
        y: [..., k, d] routed expert outputs (fp32/bf16/fp16). shared: [..., d] shared expert output.
        weights: [..., k] routing weights applied here (upcast to FP32), or None (V4.1: already applied before w2).
        out_dtype: result dtype (the MoE input's dtype in the model).
        y_dtype: None, or the dtype y is rounded to first (y computed in FP32 and cast to bf16 by the model: the
            cast is taken into the op, which reads the FP32 y).
    Returns: [..., d] in `out_dtype`.
    Raises: TypeError / ValueError naming the bad argument.
    Source: MODEL.md §2.9 "Output"; dsv41/model/moe.py `MoE.forward`, `RoutedExperts.forward_gather`.
    """
    _check_combine(y, shared, weights, out_dtype, y_dtype)
    return _ref.moe_combine(y, shared, weights, out_dtype, y_dtype)


# ------------------------------------------------------------------------------------------- kernels
@triton.jit
def _sqrt_softplus(l):
    """sqrt(softplus(l)) in FP32: l above the threshold 20, else log1p(exp(l)) via log(1 + u) * u / ((1 + u) - 1)
    (the quotient cancels the rounding of 1 + u, so small u keeps full relative precision)."""
    u = tl.exp(tl.minimum(l, 20.0))
    w = 1.0 + u
    lp = tl.where(w == 1.0, u, tl.log(w) * tl.math.div_rn(u, w - 1.0))
    return tl.sqrt_rn(tl.where(l > 20.0, l, lp))


@triton.jit
def _moe_router_kernel(
    x_ptr, w_ptr, bias_ptr, logit_ptr, wout_ptr, ids_ptr, cnt_ptr,
    R, E, D, sx_r, sw_e, gate_temp, route_scale, norm_eps, SPLIT_E,
    K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, E_PAD: tl.constexpr,
    K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr = True,
):
    # Program (row block, expert block): logits of BLOCK_R tokens x BLOCK_E experts over all of d, stored to the
    # [R, E] workspace; the last program of the row block to arrive runs the selection for its rows.
    rb = tl.program_id(0)
    eb = tl.program_id(1)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < R
    es = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = es < E
    dd = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + rows.to(tl.int64)[:, None, None] * sx_r
    w_rows = w_ptr + es.to(tl.int64)[None, :, None] * sw_e
    # PREFETCH: the first block of W (a weight, never the previous kernel's output) is loaded before the PDL wait,
    # so its DRAM round trip overlaps that kernel's tail, as the mixes kernel does with fn (mhc.py).
    d_ok = (dd < D)[None, None, :]
    if PREFETCH:
        w_first = tl.load(w_rows + dd[None, None, :], mask=e_ok[None, :, None] & d_ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if not PREFETCH:
        w_first = tl.load(w_rows + dd[None, None, :], mask=e_ok[None, :, None] & d_ok, other=0.0).to(tl.float32)
    acc = tl.load(x_rows + dd[None, None, :], mask=r_ok[:, None, None] & d_ok, other=0.0).to(tl.float32) * w_first
    for d0 in range(BLOCK_D, D, BLOCK_D):
        d = d0 + dd
        d_ok = (d < D)[None, None, :]
        xv = tl.load(x_rows + d[None, None, :], mask=r_ok[:, None, None] & d_ok, other=0.0).to(tl.float32)
        wv = tl.load(w_rows + d[None, None, :], mask=e_ok[None, :, None] & d_ok, other=0.0).to(tl.float32)
        acc += xv * wv
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    logits = tl.math.div_rn(tl.sum(acc, axis=2), gate_temp)
    tl.store(logit_ptr + rows[:, None] * E + es[None, :], logits, mask=r_ok[:, None] & e_ok[None, :])
    # Every thread's logits must be visible before the counter moves (release at GPU scope); with one expert
    # block the barrier alone orders this program's own stores and reloads.
    tl.debug_barrier()
    is_last = SPLIT_E == 1
    if SPLIT_E > 1:
        arrived = tl.atomic_add(cnt_ptr + rb, 1, sem="acq_rel")
        is_last = arrived == SPLIT_E - 1
    if is_last:
        ee = tl.arange(0, E_PAD)
        ee_ok = ee < E
        ok2 = r_ok[:, None] & ee_ok[None, :]
        lg = tl.load(logit_ptr + rows[:, None] * E + ee[None, :], mask=ok2, other=0.0, cache_modifier=".cg")
        s = _sqrt_softplus(lg)
        if HAS_BIAS:
            biased = s + tl.load(bias_ptr + ee, mask=ee_ok, other=0.0)[None, :]
        else:
            biased = s
        biased = tl.where(ee_ok[None, :], biased, float("-inf"))
        kk = tl.arange(0, K_PAD)
        chosen = tl.zeros([BLOCK_R, K_PAD], dtype=tl.float32)
        picked = tl.zeros([BLOCK_R, K_PAD], dtype=tl.int32)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        for j in tl.static_range(K):
            top = tl.max(biased, axis=1)
            # Lower index wins among equal scores: the smallest index holding the maximum.
            idx = tl.min(tl.where(biased == top[:, None], ee[None, :], E_PAD), axis=1)
            hit = ee[None, :] == idx[:, None]
            sj = tl.sum(tl.where(hit, s, 0.0), axis=1)
            total = total + sj
            chosen = tl.where(kk[None, :] == j, sj[:, None], chosen)
            picked = tl.where(kk[None, :] == j, idx[:, None], picked)
            biased = tl.where(hit, float("-inf"), biased)
        wts = tl.math.div_rn(chosen, (total + norm_eps)[:, None]) * route_scale
        ok_k = r_ok[:, None] & (kk < K)[None, :]
        offs = rows.to(tl.int64)[:, None] * K + kk[None, :]
        tl.store(wout_ptr + offs, wts, mask=ok_k)
        tl.store(ids_ptr + offs, picked.to(tl.int64), mask=ok_k)
        if SPLIT_E > 1:
            tl.atomic_xchg(cnt_ptr + rb, 0)


@triton.jit
def _moe_combine_kernel(
    y_ptr, sh_ptr, w_ptr, o_ptr,
    D, sy_r, sy_k, ss_r, sw_r, sw_k,
    K: tl.constexpr, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr, USE_PDL: tl.constexpr,
    Y_DT: tl.constexpr = tl.float32,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    y_row = y_ptr + row * sy_r + cols
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    # Experts summed in order 0..k-1 in FP32 (each optionally weighted first), then the shared row, one rounding.
    # Y_DT: each y value is first rounded to it (the model's cast of an FP32 y; float32: unchanged).
    acc = round_to(tl.load(y_row, mask=ok, other=0.0).to(tl.float32), Y_DT)
    if HAS_W:
        acc = tl.load(w_ptr + row * sw_r).to(tl.float32) * acc
    for j in tl.static_range(1, K):
        yj = round_to(tl.load(y_row + j * sy_k, mask=ok, other=0.0).to(tl.float32), Y_DT)
        if HAS_W:
            yj = tl.load(w_ptr + row * sw_r + j * sw_k).to(tl.float32) * yj
        acc = acc + yj
    sh = tl.load(sh_ptr + row * ss_r + cols, mask=ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out = round_to(acc + sh, o_ptr.dtype.element_ty)
    tl.store(o_ptr + row * D + cols, out.to(o_ptr.dtype.element_ty), mask=ok)


#: `moe_combine`'s y_dtype -> the kernel's rounding dtype (None: y is read as it is).
_TL_DTYPES = {None: tl.float32, torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised result allocation; a seam the tests replace to poison outputs."""
    return torch.empty(shape, dtype=dtype, device=device)


def router_plan(rows: int, n_experts: int, d: int, split: int | None = None) -> dict:
    """Launch shape of the router: {"BLOCK_R", "BLOCK_E", "BLOCK_D", "SPLIT_E", "NUM_WARPS"} (programs = row blocks
    x SPLIT_E).

    Rows per program: as many as the [BLOCK_R, next_pow2(E)] selection tile allows in `_ROUTER_TILE` registers
    (at most 16). Experts per program: the expert range is spread so that about `_ROUTER_TARGET_PROGRAMS` programs
    share the GEMV (decode, E = 384: 384 programs of one expert, each reading one row of W); `split` forces the
    number of expert blocks (tests), rounded to what power-of-two blocks allow. BLOCK_D fills the rest of the
    product tile. Raises ValueError for split < 1.
    """
    e_pad = next_power_of_2(n_experts)
    block_r = max(1, min(next_power_of_2(rows), _ROUTER_MAX_BLOCK_R, _ROUTER_TILE // e_pad))
    row_blocks = -(-rows // block_r)
    if split is None:
        split = max(1, min(n_experts, _ROUTER_TARGET_PROGRAMS // max(row_blocks, 1)))
    elif split < 1:
        raise ValueError(f"split must be >= 1, got {split}")
    # A product tile of at least 16 channels must fit the budget: many rows leave room for fewer experts.
    block_e = min(next_power_of_2(-(-n_experts // min(split, n_experts))), max(1, _ROUTER_TILE // (block_r * 16)))
    block_d = max(16, min(_ROUTER_MAX_BLOCK_D, next_power_of_2(d), _ROUTER_TILE // (block_r * block_e)))
    return {"BLOCK_R": block_r, "BLOCK_E": block_e, "BLOCK_D": block_d, "SPLIT_E": -(-n_experts // block_e),
            "NUM_WARPS": _ROUTER_DECODE_WARPS if block_r == 1 else 4}


def combine_plan(rows: int, d: int) -> int:
    """Channels per program of `moe_combine`: about `_COMBINE_TARGET_PROGRAMS` programs at decode (d = 5120: 40
    programs of 128), wide blocks (up to 1024) when many rows already fill the GPU."""
    want = -(-d * max(rows, 1) // _COMBINE_TARGET_PROGRAMS)
    return max(_COMBINE_MIN_BLOCK_D, min(_COMBINE_MAX_BLOCK_D, next_power_of_2(want)))


def triton_moe_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, topk: int,
                      gate_temp: float, route_scale: float, norm_eps: float, split: int | None = None,
                      prefetch: bool = True, num_warps: int | None = None):
    """Triton `dsv41::moe_router` on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1).

    Same arguments, results (to FP32 rounding, see the module docstring) and errors as `reference_moe_router`;
    `split` forces the number of expert blocks (`router_plan`); `prefetch=False` loads W's first block after the
    PDL wait instead of before (the order before issue 37, kept for the probe's comparison; results are the same);
    `num_warps` per program (a power of two, 1..16; default the plan's `NUM_WARPS`). One launch. Raises RuntimeError for CPU
    tensors without the interpreter, ValueError for a bad `num_warps`.
    """
    _check_router(x, weight, bias, topk, gate_temp, route_scale, norm_eps)
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be a power of two in 1..16, got {num_warps!r}")
    require_launchable(_moe_router_kernel, x.device, "triton_moe_router")
    lead = tuple(x.shape[:-1])
    e, d = weight.shape
    wts = _empty(lead + (topk,), torch.float32, x.device)
    ids = _empty(lead + (topk,), torch.int64, x.device)
    r = wts.numel() // topk
    if r == 0:
        return wts, ids
    xf = x.reshape(r, d)
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    plan = router_plan(r, e, d, split=split)
    row_blocks = -(-r // plan["BLOCK_R"])
    logits = _empty((r, e), torch.float32, x.device)
    if plan["SPLIT_E"] > 1:
        cnt = split_k_counters(x.device, row_blocks)
    else:  # not read with one expert block
        cnt = torch.empty(1, dtype=torch.int32, device=x.device)
    bias_arg = bias.contiguous() if bias is not None else logits  # never read without HAS_BIAS
    pdl = use_pdl_for(_moe_router_kernel, x.device)
    _moe_router_kernel[(row_blocks, plan["SPLIT_E"])](
        xf, weight, bias_arg, logits, wts, ids, cnt,
        r, e, d, xf.stride(0), weight.stride(0), float(gate_temp), float(route_scale), float(norm_eps),
        plan["SPLIT_E"],
        K=topk, BLOCK_R=plan["BLOCK_R"], BLOCK_E=plan["BLOCK_E"], BLOCK_D=plan["BLOCK_D"],
        E_PAD=next_power_of_2(e), K_PAD=next_power_of_2(topk), HAS_BIAS=bias is not None, USE_PDL=pdl,
        PREFETCH=bool(prefetch), num_warps=num_warps or plan["NUM_WARPS"], enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    return wts, ids


def triton_moe_combine(y: torch.Tensor, shared: torch.Tensor, weights: torch.Tensor | None,
                       out_dtype: torch.dtype, y_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton `dsv41::moe_combine` on the tensors' device (interpreted on CPU under TRITON_INTERPRET=1).

    Same arguments, result and errors as `reference_moe_combine`. One launch over (token row, BLOCK_D channels)
    (`combine_plan`); rows of y / shared / weights may be strided (last dims contiguous, else copied).
    """
    _check_combine(y, shared, weights, out_dtype, y_dtype)
    require_launchable(_moe_combine_kernel, y.device, "triton_moe_combine")
    k, d = y.shape[-2], y.shape[-1]
    out = _empty(tuple(shared.shape), out_dtype, y.device)
    r = out.numel() // d if d else 0
    if r == 0:
        return out
    y3 = y.reshape(r, k, d)
    if y3.stride(-1) != 1:
        y3 = y3.contiguous()
    sh = shared.reshape(r, d)
    if sh.stride(-1) != 1:
        sh = sh.contiguous()
    w2 = weights.reshape(r, k) if weights is not None else None
    w_arg, sw = (w2, (w2.stride(0), w2.stride(1))) if w2 is not None else (sh, (0, 0))
    block_d = combine_plan(r, d)
    pdl = use_pdl_for(_moe_combine_kernel, y.device)
    _moe_combine_kernel[(r, triton.cdiv(d, block_d))](
        y3, sh, w_arg, out,
        d, y3.stride(0), y3.stride(1), sh.stride(0), sw[0], sw[1],
        K=k, BLOCK_D=block_d, HAS_W=weights is not None, USE_PDL=pdl,
        Y_DT=_TL_DTYPES[y_dtype],
        num_warps=4, enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    return out


# ------------------------------------------------------------------------------------------- ops
@torch.library.custom_op("dsv41::moe_router", mutates_args=(), device_types="cpu")
def moe_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, topk: int, gate_temp: float,
               route_scale: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE router (GEMV, sqrt-softplus, biased top-k, normalised unbiased weights); see `reference_moe_router`."""
    return reference_moe_router(x, weight, bias, topk, gate_temp, route_scale, norm_eps)


@register_cuda(moe_router, "dsv41::moe_router")
def _moe_router_cuda(x, weight, bias, topk, gate_temp, route_scale, norm_eps):
    return triton_moe_router(x, weight, bias, topk, gate_temp, route_scale, norm_eps)


@moe_router.register_fake
def _moe_router_fake(x, weight, bias, topk, gate_temp, route_scale, norm_eps):
    shape = tuple(x.shape[:-1]) + (topk,)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op("dsv41::moe_combine", mutates_args=(), device_types="cpu")
def moe_combine(y: torch.Tensor, shared: torch.Tensor, weights: torch.Tensor | None,
                out_dtype: torch.dtype, y_dtype: torch.dtype | None = None) -> torch.Tensor:
    """MoE tail: (weighted) sum of the routed expert outputs + shared expert output; see `reference_moe_combine`."""
    return reference_moe_combine(y, shared, weights, out_dtype, y_dtype)


@register_cuda(moe_combine, "dsv41::moe_combine")
def _moe_combine_cuda(y, shared, weights, out_dtype, y_dtype=None):
    return triton_moe_combine(y, shared, weights, out_dtype, y_dtype)


@moe_combine.register_fake
def _moe_combine_fake(y, shared, weights, out_dtype, y_dtype=None):
    return shared.new_empty(tuple(shared.shape), dtype=out_dtype)
