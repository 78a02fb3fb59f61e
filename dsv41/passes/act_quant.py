"""The FP8 1x32 activation quantiser in front of a fused linear (family `dispatch`): the tensor it quantises (a
dominator of the matmul's operand), verified on ordinary and edge-case probe blocks."""

from __future__ import annotations

import heapq
import math

import torch
import torch.fx as fx

from ..ref import formats
from .engine import RegionEvaluator, RegionNotClosed, collect_region, concrete_shape, is_dataflow_op, tensor_val
from .rms_prologue import rms_prologue

__all__ = ["dominators", "dtype_name", "widened", "act_quant_input", "norm_prologue", "quantiser_input", "quantiser_difference",
           "EDGE_BLOCKS", "quantiser_probes"]

aten = torch.ops.aten


_DOMINATOR_STEPS = 256


def dominators(node: fx.Node, sourced: set, limit: int = _DOMINATOR_STEPS):
    """Yield the nodes every input-path of `node` passes through, nearest first (constant factories ignored)."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    heap = [(-order[node], node)]
    inheap = {node}
    steps = 0
    while heap and steps < limit:
        if len(heap) == 1:
            yield heap[0][1]
        _, n = heapq.heappop(heap)
        inheap.discard(n)
        steps += 1
        for a in n.all_input_nodes:
            if a in sourced and tensor_val(a) is not None and a not in inheap:
                heapq.heappush(heap, (-order[a], a))
                inheap.add(a)


def dtype_name(x: fx.Node) -> str:
    """`x`'s dtype as the report writes it (`float32`, `bfloat16`)."""
    return str(tensor_val(x).dtype).removeprefix("torch.")


def widened(x: fx.Node, like: fx.Node) -> bool:
    """x (the fused op's input) is float32 where `like` (the matmul) computes in bfloat16 (`act_quant_input`)."""
    return tensor_val(x).dtype != tensor_val(like).dtype


def act_quant_input(lhs: fx.Node, k: int, ev: RegionEvaluator, sourced: set, widen: bool = False,
                     lookalikes: list | None = None) -> fx.Node | None:
    """The tensor x with `lhs == fake_quant_fp8_1x32(x)` (reshaped), or None if lhs is not fake-quantised.

    x has lhs's dtype; failing that and with `widen`, x may be float32 where lhs is bfloat16 and
    `lhs == fake_quant_fp8_1x32(x).to(bfloat16)`. Before torch 2.13, Inductor's joint-graph pass `pointless_convert`
    removes the `float32 -> bfloat16 -> float32` round trip in front of the quantiser, so the graph quantises the
    float32 value and casts the result (exactly: every FP8 1x32 value is a bfloat16). The fused op then takes the
    float32 x (`widened`). Same-dtype inputs are searched first, so an exact upcast of a bfloat16 x is not taken.
    When none is found, `lookalikes` (if given) gets (tensor, edge kind) for each tensor that agreed with the
    quantiser on the ordinary probe but not on an edge block (`quantiser_probes`), for the report.
    Only the grouped expert GEMV widens (`GatheredMatcher`): its tensor-core kernel needs act_quant (h200 decode
    on the H200: 109.6 -> 115.0 tok/s in one lease). The dense FP8 GEMVs stream Inductor's quantised bfloat16 x as
    fast and did not gain from widening: 115.0 tok/s with them widened, 118.0 without, in two leases
    (bench/results/2026-12-02_h200_s22)."""
    lv = tensor_val(lhs)
    if k % 32:
        return None
    near: list = []
    found = quantiser_input(lhs, k, ev, sourced, lv.dtype, near)
    if found is None and widen and lv.dtype == torch.bfloat16:
        found = quantiser_input(lhs, k, ev, sourced, torch.float32, near)
    if found is None and lookalikes is not None:
        lookalikes.extend(near)
    return found


def quantiser_input(lhs: fx.Node, k: int, ev: RegionEvaluator, sourced: set, dtype: torch.dtype,
                     near: list) -> fx.Node | None:
    """The nearest dominator of `lhs` of `dtype` with lhs == fake_quant_fp8_1x32(it) on probes (see
    `act_quant_input`), or None; `near` gets (dominator, edge kind) for those that fail on an edge block only."""
    lv = tensor_val(lhs)
    for d in dominators(lhs, sourced):
        if d is lhs:
            continue
        dv = tensor_val(d)
        shape = concrete_shape(dv)
        if dv.dtype == dtype and shape and shape[-1] == k and math.prod(shape) == math.prod(concrete_shape(lv)):
            differs = quantiser_difference(lhs, d, shape, ev, lv.dtype)
            if differs is None:
                return d
            if differs != "ordinary":
                near.append((d, differs))
        if d.op != "call_function" or not is_dataflow_op(d):
            # Everything farther up reaches lhs through this non-dataflow node: no fake-quant region can.
            return None
    return None


def quantiser_difference(lhs: fx.Node, d: fx.Node, shape: tuple, ev: RegionEvaluator,
                          out_dtype: torch.dtype) -> str | None:
    """None when lhs == fake_quant_fp8_1x32(d) (cast to `out_dtype`) on every probe of `quantiser_probes`;
    otherwise "ordinary" (it differs on ordinary values, or the region is not closed) or the `EDGE_BLOCKS` kind
    of the first block where it differs."""
    dv = tensor_val(d)
    for probe, kinds in quantiser_probes(shape, dv.dtype):
        probe = probe.to(dv.device)
        try:
            got = ev.evaluate([lhs], {d: probe})[lhs]
        except RegionNotClosed:
            return "ordinary"
        ref = formats.fake_quant_fp8_1x32(probe).reshape(got.shape).to(out_dtype)
        if got.dtype != ref.dtype:
            return "ordinary"
        same = (got == ref) | (got.isnan() & ref.isnan())
        if not bool(same.all()):
            if kinds is None:
                return "ordinary"
            bad = (~same).reshape(-1, 32).any(-1).nonzero()
            return kinds[int(bad[0])]
    return None


#: Per-32-block contents of the edge probes (`quantiser_probes`).
EDGE_BLOCKS = ("zero", "tiny", "huge", "nan", "+inf", "-inf", "spread")


def quantiser_probes(shape: tuple, dtype: torch.dtype) -> list:
    """(probe, kind of each 32-block or None) pairs: probes of `shape` (last dim a multiple of 32) in `dtype` for the
    fake-quant check.

    First, random blocks with per-block magnitudes 2^-8..2^8 (every block's UE8M0 exponent choice). Then edge
    probes, each block one of `EDGE_BLOCKS` in turn (as many probes as it takes to show every kind at least once):
    all zeros, magnitudes below the quantiser's 1e-4 amax floor (2^-40), huge magnitudes (2^40, or a quarter of the
    dtype's largest value), one NaN, one +inf, one -inf, and one element 2^20 times the others. A region that
    clamps, masks, replaces NaN or uses another amax floor agrees with the quantiser on the first probe and differs
    on these (found in review: such regions were fused as the quantiser and changed the model's numbers)."""
    gen = torch.Generator().manual_seed(99)
    lead, blocks = shape[:-1], shape[-1] // 32
    mag = torch.exp2(torch.randint(-8, 9, (*lead, blocks, 1), generator=gen).double())
    probes = [((torch.randn(*lead, blocks, 32, generator=gen, dtype=torch.float64) * mag).reshape(shape).to(dtype),
               None)]
    n = math.prod(lead) * blocks
    if n == 0:
        return probes
    huge = min(2.0 ** 40, float(torch.finfo(dtype).max) / 4)
    for offset in range(0, len(EDGE_BLOCKS), n):
        base = torch.randn(n, 32, generator=gen, dtype=torch.float64)
        kinds = [EDGE_BLOCKS[(b + offset) % len(EDGE_BLOCKS)] for b in range(n)]
        for b, kind in enumerate(kinds):
            if kind == "zero":
                base[b] = 0.0
            elif kind == "tiny":
                base[b] *= 2.0 ** -40
            elif kind == "huge":
                base[b] *= huge / 8
            elif kind == "nan":
                base[b, 3] = float("nan")
            elif kind in ("+inf", "-inf"):
                base[b, 7] = float(kind)
            else:
                base[b, 11] = 2.0 ** 20
        probes.append((base.reshape(shape).to(dtype), kinds))
    return probes


def norm_prologue(lhs: fx.Node, x: fx.Node | None, k: int, ev: RegionEvaluator, sourced: set):
    """(h, norm weight node or None, eps, mode) when the quantised activation `lhs` of a block-FP8 matmul is
    `fake_quant_fp8_1x32(RMSNorm(h))` and the fused op can compute the norm in its prologue
    (`dsv41::linear_fp8_block(h, ..., norm_weight, eps, norm_mode)`), else None.

    x is `act_quant_input`'s answer: the quantiser's input of lhs's dtype (torch 2.13 keeps the norm's rounding:
    modes 1-3), or None, when the quantiser's input is float32 (torch 2.11's `pointless_convert` dropped the
    rounding, the widened input is searched here: modes 4-6). The norm itself is `rms_prologue`'s (spelling and
    eps settled on probes, exactly). Taken only where no value of the norm or of the quantiser between h and lhs is
    read outside that region (else the norm stays for its other readers and the prologue would only repeat it)."""
    dt = tensor_val(lhs).dtype
    if x is None:
        x = act_quant_input(lhs, k, ev, sourced, widen=True)
        if x is None or not widened(x, lhs):
            return None
    found = rms_prologue(x, k, dt, ev, exact_only=True)
    if found is None:
        return None
    h, nw = found[0], found[1]
    region = collect_region([lhs], [h] + ([nw] if nw is not None else []))
    inside = set(region)
    if any(u not in inside for n in region if n is not lhs for u in n.users):
        return None
    return found
