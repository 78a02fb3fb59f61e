"""The "RMS-normalise, then project" spelling of the mHC coefficient projection (used by the `mhc` family).

dsv41's model scales after the projection, `m = (flatten(H) @ fn^T) * rsqrt(mean(z^2) + eps)` (MODEL.md §2.3 steps
1-3). Another DeepSeek-V4 implementation normalises the flattened streams first and projects the result:

    m = F.linear(rms_norm(flatten(H).float()), fn)     rms_norm = F.rms_norm(z, (4d,), w, eps),
                                                        z * rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) [* w],
                                                        or z / sqrt(..) [* w]

with or without a learned RMS weight w [4d]. Since F.linear(z * r * w, fn) = ((fn * w) @ z) * r with r per token,
this is `mhc_mixes(H, fn, ..)` with the weight applied to z inside the projection only (the statistic r stays
over the unweighted z), which `dsv41::mhc_mixes` takes as its optional `norm_weight`.

The projection anchor of `passes/mhc.py` (`_projection`) finds H as a view / cast of the matmul's left operand; in
this spelling the operand is computed. `normalised_input` walks back from it through the ops a region may contain
to its leaves (structure), `verify_normalised_input` evaluates the operand on probes (semantics): exactly
flatten(H) * rsqrt(mean(flatten(H)^2) + eps) [* w] in FP32 for one of the walked nodes' float literals, else a
near-miss naming the check (`rms_input_leaves`, `rms_input`, `rms_eps`).

Limitation: the walk stops at the nearest [.., 4, d] tensor, so a normalisation written on the [B, T, 4, d]
layout (`(z * r).flatten(2)` with z 4-D) takes the normalised streams for H and is reported as `rms_input`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ref.mhc import HC_MULT
from .engine import (RegionNotClosed, chain_back, close_rounded, concrete_shape, is_float, is_shape_value, is_step,
                     node_label, real_tensors, rms_eps_reason, shape_of, tensor_val)

__all__ = ["NormalisedInput", "normalised_input", "verify_normalised_input"]

_WALK_LIMIT = 48        # nodes walked back from the projection's input (F.rms_norm with a weight is 8)
_SMALL_CONSTANT = 256   # get_attr tensors up to this many elements are constants (as in the region resolver)
_PROBE_SCALES = (1.0, 1e-4)  # |H| ~ 1, then ~1e-4 (mean square 1e-8: an eps of 1e-6 changes r 10-fold)


@dataclass(frozen=True)
class NormalisedInput:
    """Leaves of a projection input in the "normalise, then project" spelling.

    H: the four-stream tensor [B, T, 4, d] (through views / exact casts, as `chain_back` finds it), weight: the
    RMS weight [4d] or None, nodes: the walked nodes between the input and its leaves (their float literals are
    the eps candidates), refusal: None, or (check, reason) when the input reads one H but also other tensors.
    """

    H: fx.Node | None
    weight: fx.Node | None
    nodes: tuple
    refusal: tuple | None = None


def normalised_input(x: fx.Node, k: int) -> NormalisedInput | None:
    """Structure of the projection's left operand `x` [rows, k = 4d] in the "normalise, then project" spelling.

    Walks back from `x` through dataflow ops (at most `_WALK_LIMIT` nodes), stopping at float tensors of shape
    [.., 4, d] (H candidates) and [4d] (RMS weight candidates); shape values and small constants are allowed leaves.
    Returns None when no H candidate is reached (or the walk is too long): not an mHC projection. Returns a
    `NormalisedInput` with `refusal` set when one H is read together with another leaf (a second
    [.., 4, d] tensor, a second [4d] vector, a graph input or a non-dataflow op), else with H and the weight found.
    Errors: none (nodes without tensor metadata are leaves of the "other" kind).
    Source: MODEL.md §2.3 steps 1-3; the spelling described in this module's docstring.
    """

    d = k // HC_MULT
    streams, weights, others = [], [], []
    seen: dict = {}  # in walk order: the eps literal search tries literals in a deterministic order
    todo = [x]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen[n] = None
        if len(seen) > _WALK_LIMIT:
            return None
        shape = shape_of(n)
        v = n.meta.get("val")
        if is_shape_value(n):
            continue
        if shape is not None and is_float(n) and len(shape) == 4 and shape[2:] == (HC_MULT, d):
            streams.append(n)
        elif shape == (k,) and is_float(n):
            weights.append(n)
        elif n.op == "get_attr" and isinstance(v, torch.Tensor) and v.numel() <= _SMALL_CONSTANT:
            continue
        elif is_step(n):
            todo.extend(n.all_input_nodes)
        else:
            others.append(n)
    if not streams:
        return None
    nodes = tuple(n for n in seen if n not in streams and n not in weights)
    extra = streams[1:] + weights[1:] + others
    if extra:
        names = ", ".join(_describe(n) for n in extra[:3])
        return NormalisedInput(None, None, nodes, (
            "rms_input_leaves",
            f"the projection's input reads the streams {streams[0].name} [.., {HC_MULT}, {d}] and also {names}; "
            f"dsv41::mhc_mixes normalises flatten(H) with at most one RMS weight [{k}] (MODEL.md §2.3 steps 1-3)"))

    def source(n, shape):
        """The farthest tensor `n` is a view / exact cast of with the same shape (a parameter, not its upcast)."""
        return [m for m in chain_back(n) if is_float(m) and shape_of(m) == shape][-1]

    H = source(streams[0], shape_of(streams[0]))
    weight = source(weights[0], (k,)) if weights else None
    return NormalisedInput(H, weight, nodes)


def _describe(n: fx.Node) -> str:
    """'graph input arg3_1 [128]' / 'aten.add.Tensor add_2 [2, 3, 128]': a leaf as a near-miss reason names it."""
    shape = list(concrete_shape(tensor_val(n))) if tensor_val(n) is not None else "?"
    kind = "graph input" if n.op == "placeholder" else node_label(n)
    return f"{kind} {n.name} {shape}"


def verify_normalised_input(ev, x: fx.Node, found: NormalisedInput, lits: list):
    """(eps, None) when `x` evaluates to flatten(H) * rsqrt(mean(flatten(H)^2) + eps) [* w] in FP32 for an eps of
    `lits`, else (None, (check, reason)).

    Probes: H random (|H| ~ 1) and the same times 1e-4 (pins eps), in H's dtype; w = 0.5 + U(0, 1) in its dtype.
    The reference is float64, rounded to FP32 once; agreement is `close_rounded` (a few FP32 ulps). `ev` is the
    family's `RegionEvaluator`; x [rows, 4d] with rows = B * T. Checks: `region_evaluates` (the probes do not
    run), `rms_eps` (right with |H| ~ 1 only: eps not among `lits`), `rms_input` (anything else: another norm,
    a rounding to bf16 before the projection, the weight elsewhere).
    Raises: nothing (probes that do not run are the `region_evaluates` check).
    Source: MODEL.md §2.3 steps 1-3; `torch.nn.functional.rms_norm`.
    """

    H, weight = found.H, found.weight
    hv = tensor_val(H)
    gen = torch.Generator().manual_seed(53)
    h = torch.randn(concrete_shape(hv), generator=gen, dtype=torch.float64)
    w = None
    if weight is not None:
        wv = tensor_val(weight)
        w = (0.5 + torch.rand(concrete_shape(wv), generator=gen, dtype=torch.float64)).to(wv.dtype)
    xs = concrete_shape(tensor_val(x))
    probes, runs = [(h * s).to(hv.dtype) for s in _PROBE_SCALES], []
    with real_tensors():
        for hp in probes:
            env = {H: hp.to(hv.device)}
            if weight is not None:
                env[weight] = w.to(wv.device)
            try:
                runs.append(ev.evaluate([x], env)[x])
            except (RegionNotClosed, RuntimeError) as e:
                return None, ("region_evaluates", f"the projection's input could not be evaluated on probes: {e}")

        def want(hp, eps, outside=False):
            """float64 flatten(H) * rsqrt(mean(z^2) + eps) [* w] in x's shape, rounded to FP32 (`outside`: the
            look-alike z / (sqrt(mean(z^2)) + eps), only to name the near-miss)."""
            z = hp.double().flatten(2)
            ms = z.square().mean(-1, keepdim=True)
            out = z / (ms.sqrt() + eps) if outside else z * torch.rsqrt(ms + eps)
            out = out if w is None else out * w.double()
            return out.reshape(xs).float() if out.numel() == torch.Size(xs).numel() else None

        for eps in lits:
            if all(close_rounded(got, want(hp, eps)) for got, hp in zip(runs, probes)):
                return eps, None
        if any(close_rounded(runs[0], want(probes[0], eps)) for eps in lits):
            return None, rms_eps_reason(lits, lambda eps: all(
                close_rounded(got, want(hp, eps, outside=True)) for got, hp in zip(runs, probes)))
    weighted = " * w" if weight is not None else ""
    return None, ("rms_input", f"the projection's input is computed from H {H.name} [B, T, 4, d]"
                  f"{f' and a weight {weight.name} [4d]' if weight is not None else ''} but is not "
                  f"z * rsqrt(mean(z^2) + eps){weighted} with z = flatten(H) in FP32 for eps in {lits} (the "
                  "'normalise, then project' spelling of MODEL.md §2.3 steps 1-3)")
