"""The RMSNorm in front of a fused GEMV's activation, found by structure and settled on probes: shared by the
families whose ops compute the norm in their prologue (`half_gemv`'s bf16 / fp16 GEMVs, `dispatch`'s block-FP8
GEMV), so the norm's launch and the normalised copy go.

`rms_prologue(x, k, dtype, ev)` answers: is x an RMSNorm of a tensor h, in which spelling
(`ref.norm.NORM_SPELLINGS`: where the result is rounded, weighted or not) and with which eps?
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dsv41.ref.norm import rms_norm_spelled

from .engine import (RegionEvaluator, close_rounded, collect_region, concrete_shape, eps_candidates, is_dataflow_op,
                     is_reshape, is_view_op, tensor_val)

__all__ = ["rms_prologue", "smooth", "SMOOTH_OPS", "NORM_REACH"]

aten = torch.ops.aten
prims = torch.ops.prims

#: Nodes above x that the finder searches for the mean of squares.
NORM_REACH = 8

#: The ops a SwiGLU or RMSNorm region may contain besides views: smooth arithmetic, the spellings' casts and the
#: norm's reductions. Why: the regions are verified on probes of bounded magnitude (|g| up to ~25, normalised rows
#: up to ~4), and a piecewise op (clamp, where, maximum, abs, a comparison) that only acts beyond them passes every
#: probe: `silu(g.clamp(-30, 30)) * u` was fused as `silu(g) * u`, and a norm clamped at 6 as the bare norm (both
#: wrong once an outlier row reaches the clamp). A smooth op cannot hide like that; anything else stays unfused.
SMOOTH_OPS = frozenset({
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.add.Tensor, aten.add.Scalar,
    aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar, aten.neg.default, aten.exp.default, aten.reciprocal.default,
    aten.sigmoid.default, aten.silu.default, aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar,
    aten.mean.dim, aten.sum.dim_IntList, aten.clone.default, aten._to_copy.default, aten.scalar_tensor.default,
    aten.full.default, prims.convert_element_type.default,
})


def smooth(n: fx.Node) -> bool:
    """Whether region node `n` is a view or one of `SMOOTH_OPS`."""
    return n.op == "call_function" and (is_view_op(n) or n.target in SMOOTH_OPS)


#: Views that keep every element in its place (another shape only): the ones a prologue may look through, since the
#: fused op reads the norm's input flattened to [rows, K]. A slice, select, expand or transpose picks, repeats or
#: moves rows (`norm(h)[:, -1]`: the op would read every row of h).
_ORDER_KEEPING = (aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)


def _producer(x: fx.Node) -> fx.Node:
    """x's source through order-keeping views (`is_reshape`, `_ORDER_KEEPING`)."""
    while (isinstance(x, fx.Node) and (is_reshape(x) or (x.op == "call_function" and x.target in _ORDER_KEEPING))
           and isinstance(x.args[0], fx.Node)):
        x = x.args[0]
    return x


def _strip_casts(n):
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target == prims.convert_element_type.default:
        n = n.args[0]
    return n


def _square_of(sq):
    """h when `sq` is h^2 (pow 2, or h * h with each factor maybe its own upcast of h), after casts; else None."""
    if not isinstance(sq, fx.Node) or sq.op != "call_function":
        return None
    if sq.target == aten.pow.Tensor_Scalar and sq.args[1] == 2:
        return _strip_casts(sq.args[0])
    if sq.target == aten.mul.Tensor and _strip_casts(sq.args[0]) is _strip_casts(sq.args[1]):
        return _strip_casts(sq.args[0])
    return None


def _mean_of_squares(xp: fx.Node):
    """(mean, h) for the nearest `mean(h^2, [-1], keepdim=True)` within NORM_REACH nodes above xp, or None (other
    means on the way, such as a centring mean, are passed over)."""
    frontier, seen = [xp], set()
    for _ in range(NORM_REACH):
        nxt = []
        for n in frontier:
            if n.op == "call_function" and n.target == aten.mean.dim and n.args[0] is not None:
                dims = list(n.args[1]) if len(n.args) > 1 else []
                keep = (n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))
                h = _square_of(n.args[0])
                if keep and h is not None and dims in ([-1], [len(concrete_shape(tensor_val(n)) or ()) - 1]):
                    return n, h
            for a in n.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    nxt.append(a)
        frontier = nxt
    return None


def rms_prologue(x: fx.Node, k: int, dtype: torch.dtype, ev: RegionEvaluator, stored=None, exact_only: bool = False):
    """(h, norm weight node or None, eps, mode) when `x` (through order-keeping views) is an RMSNorm of a tensor h of `dtype`
    (bf16 / fp16 / fp32) over its last dim of size k, else None.

    mode (`ref.norm.NORM_SPELLINGS`): 1-3 where x has `dtype` (the norm's result rounded to it), 4-6 where x is
    float32 and `dtype` is narrower (the same spellings without the last rounding: what torch 2.11 leaves of a
    norm whose result is upcast again at once). Structure: a mean over the last dim of h^2 (pow 2 or h * h, after
    casts) within NORM_REACH nodes above x; the region from h to x holds only views and `SMOOTH_OPS` and reads
    nothing else but at most one 1-D [k] weight of `dtype` (a graph input; with `stored` (a set), one of those).
    Semantics: on probe rows at ordinary, small (where eps moves the statistic) and large magnitudes (where an eps
    outside the square root would) the region equals one spelling for one of its literals as eps: exactly first, else (unless `exact_only`) within one rounding.
    Raises nothing: a region the probes cannot run is no prologue."""
    xp = _producer(x)
    xv, x0 = tensor_val(xp), tensor_val(x)
    found = _mean_of_squares(xp)
    if found is None or xv is None or x0 is None or x0.numel() != xv.numel():
        return None
    h = found[1]
    hv = tensor_val(h) if isinstance(h, fx.Node) else None
    if hv is None or hv.dtype != dtype or tuple(hv.shape) != tuple(xv.shape) or (concrete_shape(hv) or (0,))[-1] != k:
        return None
    if xv.dtype == dtype:
        rounded = True
    elif xv.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16):
        rounded = False
    else:
        return None
    region = collect_region([xp], [h])
    leaves = [n for n in region if n.op in ("placeholder", "get_attr")]
    if len(leaves) > 1 or not all(n in leaves or (n.op == "call_function" and (is_dataflow_op(n) or is_view_op(n))
                                                  and smooth(n)) for n in region):
        return None  # another input, or an op that is not pure, or a piecewise one the probes may miss
    nw = leaves[0] if leaves else None
    if nw is not None:
        nv = tensor_val(nw)
        static = nw.op == "get_attr" or stored is None or nw in stored
        if nv is None or nv.dtype != dtype or tuple(nv.shape) != (k,) or not static:
            return None
    gen = torch.Generator().manual_seed(1)
    shape = tuple(hv.shape)
    # Small rows: eps moves the statistic; large rows: an eps outside the rsqrt moves it (1e6: rsqrt ~ 1e-6).
    big = 3e4 if dtype == torch.float16 else 1e6
    hp = [(torch.randn(shape, generator=gen, dtype=torch.float64) * s).to(dtype) for s in (1.0, 3e-3, big)]
    wp = (1 + 0.2 * torch.randn(k, generator=gen, dtype=torch.float64)).to(dtype) if nw is not None else None
    try:
        outs = [ev.evaluate([xp], {h: p, **({nw: wp} if nw is not None else {})})[xp] for p in hp]
    except Exception:  # not closed over h and the weight, or an op the probes cannot run: no prologue
        return None
    modes = (1, 2) if nw is not None else (3,)
    if not rounded:
        modes = tuple(m + 3 for m in modes)
    for same in ((torch.equal,) if exact_only else (torch.equal, close_rounded)):
        for eps in eps_candidates(region):
            for mode in modes:
                if all(same(o, rms_norm_spelled(p, wp, float(eps), mode)) for o, p in zip(outs, hp)):
                    return h, nw, float(eps), mode
    return None
