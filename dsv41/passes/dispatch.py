"""`dispatch` family: dequantize(weight) -> matmul becomes one fused low-precision linear op.

Chain matched (ARCHITECTURE.md "Fusion patterns", row "dispatch"; MODEL.md §2.1 block layouts):

    y = F.linear(fake_quant_fp8_1x32(x) or x, dequantize(W, S))      # eager, e.g. dsv41/model/linear.py

with W, S in one of the checkpoint formats

    fp8_block  W uint8 [N, K] E4M3 bytes, S uint8 [ceil(N/32), ceil(K/32)] UE8M0 (value 2^(e-127))
    fp4        W uint8 [N, K/2] packed E2M1 (low nibble = even k), S uint8 [N, K/32] UE8M0

becomes `dsv41::linear_fp8_block(x, W, S, act_quant)` / `dsv41::linear_fp4(x, W, S, act_quant)`. Block-FP8 weights
laid out as FP8 checkpoints store them (float8_e4m3fn codes, float32 or UE8M0 scales per 128x128, 1x128 or 32x32
block, format "fp8_scaled") are read, probed and rewritten by `fp8_layouts` (its docstring lists its near-misses)
into `dsv41::linear_fp8_scaled(x, W_u8, S, bn, bk, weight_dtype, scale_cast)`, or `linear_fp8_block` on the uint8 view
of float8-typed codes in dsv41's own layout.

How a chain is found (structure): the dequantised weight is a float 2-D tensor computed only by pointwise
ops, views, repeats and concatenation from exactly two uint8 tensors whose shapes are a weight and its scale
grid in one of the formats above; the matmul is `aten.mm` / `aten.addmm` taking it (transposed) as the
second operand. How it is confirmed (semantics): the region is evaluated on probe codes and scales and must
equal `formats.dequantize_*` of them; the activation side is accepted as `act_quant=True` when the mm's
first operand equals `formats.fake_quant_fp8_1x32` of a tensor that dominates it, on ordinary and on edge probes
(zero, tiny, huge, NaN and infinite blocks: `_quantiser_probes`). A failed check is a
near-miss that names the rule the code follows instead (e.g. the scale used as a plain multiplier). The weight
bytes must be graph inputs no kernel of the step writes (parameters, buffers, views of them): the fused GEMV
requests its weight before waiting on the previous kernel under PDL (near-miss `weight_source` otherwise).

Gathered experts (the decode path of the routed MoE, dsv41/model/moe.py `RoutedExperts.forward_gather`):

    y = einsum(fq8(x) or x, dequantize_fp4_1x32(W[idx], S[idx]))      # W [E, out, K/2], S [E, out, K/32]

with x [N, K] (one row per token, shared by its k experts) or [N, k, K] (one row per (token, expert)) and idx
[N, k], becomes `dsv41::grouped_linear_fp4(x, W, S, idx, act_quant)` (pattern `grouped_linear_fp4`). Structure:
a `bmm` / `mm` operand computed by dataflow ops from exactly two gathers (`W[idx]`: aten.index.Tensor, or
`index_select(W, 0, idx)`) of uint8 stacks. Semantics, on probe values: the gathers must share one index tensor
and the stacks be [E, out, K/2] + [E, out, K/32]; the dequantised tensor (the last node before the views into
the matmul) must equal `formats.dequantize_fp4_1x32` of the probe codes and scales; the activation side is
`fake_quant_fp8_1x32(x)` or x (as above; failing a bfloat16 x, a float32 x with fq8(x).to(bfloat16), which is
how Inductor before torch 2.13 leaves `fq8(h.to(bfloat16))`: the op then takes the float32 x and its result is cast
once, `_act_quant_input`); and the matmul followed by its views must compute exactly
y[n, j] = x[n (, j)] @ W[idx[n, j]]^T for every output element (end-to-end, in float64 on the probes), which
pins down how einsum/bmm laid out rows, experts and K. A failed check is a near-miss (e.g. `weight_format` for
another block size, `ue8m0_scale_rule`, `output_layout` for a product over the wrong axis).

Also reported (as findings, after every family ran): a verified dequantised weight that is materialised
(feeds anything other than a fused matmul), and every ATen op Inductor will run as a fallback kernel
instead of generating code for it (complex-valued ops, ops without a lowering, explicit fallbacks).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..model import formats
from . import fp8_layouts
from .records import Finding, MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (FusionFamily, RegionEvaluator, RegionNotClosed, agree_where_representable, collect_region,
                     concrete_shape, dsv41_op, eliminate_dead_code, insert_node, is_dataflow_op, is_table_lookup,
                     is_view_op, node_label, same_shape, sourced_nodes, symbolic_part, tensor_val, token_rows,
                     wide_scale_probes)
from .small_ops import _view_base, mutated_inputs

__all__ = ["DispatchFamily", "WEIGHT_FORMATS", "GROUPED_OP"]

aten = torch.ops.aten
#: format -> fused op name ("fp8_scaled": the checkpoint layouts of `fp8_layouts`, whose verdict names the op).
WEIGHT_FORMATS = {"fp8_block": "linear_fp8_block", "fp4": "linear_fp4", "fp8_scaled": "linear_fp8_scaled"}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_MAX_LEAVES = 3
#: fused op of the gathered-experts chain (FP4 1x32 is the only gathered format in the model).
GROUPED_OP = "grouped_linear_fp4"
#: float64 tolerance of the end-to-end probe check, relative to sum |x w| (summation order only).
_E2E_RTOL = 1e-9
_DOMINATOR_STEPS = 256
#: Probe verdicts of weight regions across graphs and compiles: (region signature, format, transposed, device
#: type) -> (ok, check, reason). A signature fixes the region's function (`_signature`) when the region is made of
#: ATen calls alone (a constant tensor, `get_attr`, is keyed by name only: such regions are not cached), so a
#: regional compile (one graph per layer variant) probes each weight layout once, not once per graph (at h200 a
#: probe of one 32768 x 1280 weight takes seconds on the host). Bounded, oldest verdict dropped first.
_VERDICT_CACHE: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_VERDICT_CACHE_SIZE = 512


@dataclass(frozen=True)
class _Weight:
    """A candidate dequantised weight: `node` computed from (`codes`, `scale`) in format `fmt`."""

    node: fx.Node
    codes: fx.Node
    scale: fx.Node
    fmt: str
    n: int
    k: int
    transposed: bool  # node holds W^T [K, N] rather than W [N, K]
    layout: object = None  # fmt "fp8_scaled": a `fp8_layouts.Layout` or `fp8_layouts.Unmatched`


class DispatchFamily(FusionFamily):
    """Fuse dequantize -> mm into `dsv41::linear_fp8_block` / `dsv41::linear_fp4`, and gather -> FP4 dequantize ->
    bmm of stacked experts into `dsv41::grouped_linear_fp4` (see module docstring)."""

    name = "dispatch"
    summary = ("dequantize(block-FP8 / FP4 weight) [+ FP8 1x32 activation fake-quant] -> matmul; "
               "gather(FP4 experts) -> dequantize -> bmm")

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Replace every verified dequantise -> matmul chain in `gm` with the fused GEMV op; returns the record."""
        graph = gm.graph
        start = set(graph.nodes)
        ev = RegionEvaluator(gm)
        sourced = sourced_nodes(graph)
        findings: list[Finding] = []
        verdicts: dict = {}
        missing_ops = sorted(op for op in (*WEIGHT_FORMATS.values(), GROUPED_OP) if dsv41_op(op) is None)
        # Gathered experts first: their regions are 3-D/4-D, disjoint from the 2-D weights matched below.
        lookalikes: list = []  # (matmul, tensor, edge kind): `_act_quant_input`
        matches, misses = _GatheredMatcher(self.name, gm, ev, sourced, lookalikes).run()
        leaves = _leaf_sets(graph)
        written = mutated_inputs(graph)

        for readings in _candidates(graph, leaves):
            verdict = None
            for cand in readings:
                region = collect_region([cand.node], [cand.codes, cand.scale])
                key = (_signature(region, (cand.codes, cand.scale)), cand.fmt, cand.layout, cand.transposed,
                       tensor_val(cand.node).device.type)
                if key not in verdicts:
                    other_inputs = [n for n in region if n.op == "placeholder"]
                    if other_inputs:
                        # e.g. a SymInt input: the probe would see only its hint, the fused op not at all.
                        verdicts[key] = (False, "region_closed", (
                            f"the weight region also reads graph input {other_inputs[0].name} besides (codes, "
                            "scale); a fused op's weight must be a function of its codes and scales alone"), ())
                    elif all(n.op == "call_function" for n in region):
                        verdicts[key] = _cached_verdict(key, cand, ev)
                    else:  # a constant tensor (get_attr) is keyed by name only: the verdict holds for this graph
                        verdicts[key] = _verify_weight(cand, ev)
                if verdicts[key][0] or verdict is None:
                    verdict = (cand, verdicts[key])
                if verdicts[key][0]:
                    break
            cand, (ok, check, reason, params) = verdict
            users = list(cand.node.users)
            matmuls = [u for u in users if _is_linear_mm(u, cand.node)]
            mm_users = matmuls if cand.transposed else []
            if ok and cand.k % 32 and cand.fmt != "fp8_scaled":
                ok, check, reason = False, "op_shape", (f"K = {cand.k} is not a multiple of 32; the fused linear ops "
                                                       "quantise activations in 1x32 blocks")
            if ok:
                computed = [t for t in (cand.codes, cand.scale)
                            if _view_base(t).op not in ("placeholder", "get_attr") or _view_base(t) in written]
                if computed:
                    ok, check, reason = False, "weight_source", (
                        f"the weight bytes ({node_label(computed[0])}) are computed or written in place inside the "
                        "graph; the fused linear ops read their weight before waiting on the previous kernel (PDL), "
                        "so only weights no kernel of the step writes are fused")
            if ok:
                what = symbolic_part([cand.codes, cand.scale, cand.node])
                if what is not None:  # the activation's row count may be symbolic: the ops take any M at run time
                    ok, check, reason = False, "static_shapes", (
                        f"{what}; the fused linear ops are planned for the weight's compile-time shape, so this "
                        "chain stays with Inductor")
            if ok and dict(params).get("op", WEIGHT_FORMATS[cand.fmt]) in self.gated_ops:
                ok, check, reason = False, "gpu_unvalidated", (
                    f"dsv41::{dict(params).get('op', WEIGHT_FORMATS[cand.fmt])} has not yet run on a GPU, so on CUDA "
                    "this chain stays with Inductor (option gpu_unvalidated=True fuses it)")
            if not ok:
                # Only a chain that reaches a matmul "started to match"; other look-alike tensors are not reported.
                for u in matmuls:
                    misses.append(NearMiss(self.name, f"dequantize({cand.fmt}) -> {node_label(u)}", check, reason,
                                           SourceLocation.from_node(u)))
                continue
            op_name = dict(params).get("op", WEIGHT_FORMATS[cand.fmt])
            op = dsv41_op(op_name)
            for u in mm_users:
                if op is None:
                    misses.append(NearMiss(self.name, f"dequantize({cand.fmt}) -> {node_label(u)}", "op_registered",
                                           f"dsv41::{op_name} is not registered (import dsv41.kernels)",
                                           SourceLocation.from_node(u)))
                    continue
                matches.append(self._fuse(gm, u, cand, op, ev, sourced, lookalikes, params))
            lv = leaves[cand.node]
            for u in users:
                if u in mm_users or _continues_region(u, lv, leaves):
                    continue
                r = _reader(u)
                findings.append(Finding(
                    self.name, "materialised_dequant",
                    f"dequantised {cand.fmt} weight [{cand.n}, {cand.k}] is materialised: it feeds "
                    f"{node_label(r)}, which no fused op reads", SourceLocation.from_node(r)))
        for mm, d, kind in lookalikes:
            findings.append(Finding(
                self.name, "quantiser_lookalike",
                f"the activation of {mm.name} equals fake_quant_fp8_1x32({d}) on ordinary values but not on a {kind} "
                "block: it is not taken as the FP8 1x32 quantiser, which stays in the graph (act_quant=False)",
                SourceLocation.from_node(mm)))
        eliminate_dead_code(graph)
        removed = {n.name for n in start - set(graph.nodes)}
        matches = [_with_removed(m, removed) for m in matches]
        findings.extend(_fallback_findings(self.name, graph))
        note = f"ops not registered: {', '.join(missing_ops)}" if missing_ops else ""
        return PassRecord(self.name, True, tuple(matches), tuple(misses), tuple(findings), note)

    # -------------------------------------------------------------------------------------------- rewrite
    def _fuse(self, gm, mm: fx.Node, cand: _Weight, op, ev: RegionEvaluator, sourced: set,
              lookalikes: list, params: tuple = ()) -> MatchRecord:
        graph = gm.graph
        if mm.target == aten.addmm.default:
            bias, lhs = mm.args[0], mm.args[1]
        else:
            bias, lhs = None, mm.args[0]
        near: list = []
        scaled = dict(params).get("op") == "linear_fp8_scaled"  # no activation quantiser: x is read as it is
        x = None if scaled else _act_quant_input(lhs, cand.k, ev, sourced, lookalikes=near)
        lookalikes.extend((mm, d.name, kind) for d, kind in near)
        act_quant = x is not None
        region_nodes = collect_region([cand.node], [cand.codes, cand.scale])
        if act_quant:
            region_nodes += collect_region([lhs], [x])
        else:
            x = lhs
        x_in = x
        if not same_shape(tensor_val(x).shape, tensor_val(lhs).shape):
            # mm's operand is [M, K]; -1 keeps the reshape valid under symbolic M.
            x_in = insert_node(graph, mm, aten.reshape.default, (x, [-1, cand.k]), like=mm)
        if cand.fmt == "fp8_scaled":
            out = fp8_layouts.fused_call(graph, mm, cand, params, x_in, act_quant)
            pattern, op_name, extra = fp8_layouts.pattern(cand, params, act_quant)
        else:
            out = insert_node(graph, mm, op, (x_in, cand.codes, cand.scale, act_quant), like=mm)
            op_name, extra = WEIGHT_FORMATS[cand.fmt], ()
            pattern = f"{op_name}(act_quant={act_quant})"
        if bias is not None:
            out = insert_node(graph, mm, aten.add.Tensor, (out, bias), like=mm)
        mm.replace_all_uses_with(out)
        graph.erase_node(mm)

        xsize = tensor_val(x).element_size()
        esize = tensor_val(out).element_size()
        rows, subs = token_rows(_token_shape(x)[:-1])
        n, k = cand.n, cand.k
        w_bytes = sum(tensor_val(t).numel() * tensor_val(t).element_size() for t in (cand.codes, cand.scale))
        bias_bytes = n * esize if bias is not None else 0
        # Before: the dequantised weight crosses a kernel boundary (written once, read by the GEMM) and so
        # does the fake-quantised activation; after: the fused op reads codes, scales and x once.
        before = (w_bytes + 2 * n * k * esize + rows * k * (xsize + 2 * esize if act_quant else esize)
                  + rows * n * esize + bias_bytes)
        after = w_bytes + rows * k * xsize + rows * n * esize + bias_bytes
        return MatchRecord(
            self.name, pattern, f"dsv41::{op_name}",
            SourceLocation.from_node(mm), tuple(n_.name for n_ in region_nodes + [mm]),
            tuple(node_label(n_) for n_ in region_nodes + [mm]), str(sympy.expand(before)), str(sympy.expand(after)),
            tuple(sorted(subs.items())),
            (("format", cand.fmt), ("N", n), ("K", k), ("act_quant", act_quant), ("bias", bias is not None),
             ("x_dtype", _dtype_name(x))) + extra)


# ------------------------------------------------------------------------------------------------ structure
def _leaf_sets(graph: fx.Graph) -> dict:
    """For each tensor node, the set of non-dataflow tensors it is computed from through dataflow ops only
    (None when more than `_MAX_LEAVES`). Graph inputs and non-dataflow ops are their own leaf."""
    leaves: dict = {}
    for n in graph.nodes:
        v = tensor_val(n)
        if v is None:
            continue
        if n.op == "get_attr" and v.numel() <= 256:
            leaves[n] = frozenset()
        elif is_table_lookup(n) and leaves.get(n.args[0]) == frozenset():
            # table[idx] with a constant table (e.g. the 16 E2M1 values) is a pure function of idx.
            acc = set()
            for a in n.args[1]:
                la = leaves.get(a) if a is not None else frozenset()
                if la is None:
                    acc = None
                    break
                acc |= la
            leaves[n] = frozenset(acc) if acc is not None and len(acc) <= _MAX_LEAVES else None
        elif n.op == "call_function" and is_dataflow_op(n):
            acc: set = set()
            for a in n.all_input_nodes:
                if tensor_val(a) is None:
                    continue
                la = leaves.get(a)
                if la is None:
                    acc = None
                    break
                acc |= la
            leaves[n] = frozenset(acc) if acc is not None and len(acc) <= _MAX_LEAVES else None
        else:
            leaves[n] = frozenset({n})
    return leaves


def _formats_for(a: fx.Node, b: fx.Node, shape: tuple) -> list:
    """(fmt, codes, scale, N, K, transposed) readings of uint8 tensors `a`, `b` producing a weight of `shape`."""
    out = []
    for codes, scale in ((a, b), (b, a)):
        c, s = concrete_shape(tensor_val(codes)), concrete_shape(tensor_val(scale))
        if len(c) != 2 or len(s) != 2:
            continue
        for transposed in (False, True):
            n, k = (shape[1], shape[0]) if transposed else shape
            if c == (n, k) and s == (-(-n // 32), -(-k // 32)) and k % 32 == 0:  # else linear_fp8_scaled's
                out.append(("fp8_block", codes, scale, n, k, transposed))
            if k % 32 == 0 and c == (n, k // 2) and s == (n, k // 32):
                out.append(("fp4", codes, scale, n, k, transposed))
    return out


def _candidates(graph: fx.Graph, leaves: dict) -> list:
    """Boundary nodes of dequantisation regions: float 2-D tensors computed from exactly a (codes, scale) pair
    of uint8 tensors in a known weight format, or of an FP8 checkpoint layout (`fp8_layouts.readings`; an FP8-typed
    weight with another scale is read as `fp8_layouts.unmatched`, to be reported), with a user outside the region.
    One list of `_Weight` readings (format, orientation, layout) per boundary node."""
    found = []
    for n in graph.nodes:
        v = tensor_val(n)
        if v is None or v.dtype not in _FLOATS or v.dim() != 2 or n.op != "call_function":
            continue
        lv = leaves.get(n)
        if not lv or len(lv) != 2:
            continue
        a, b = sorted(lv, key=lambda x: x.name)
        if all(_continues_region(u, lv, leaves) for u in n.users):
            continue
        shape = concrete_shape(v)
        readings = ((_formats_for(a, b, shape) if tensor_val(a).dtype == tensor_val(b).dtype == torch.uint8 else [])
                    + fp8_layouts.readings(a, b, shape)) or fp8_layouts.unmatched(a, b, shape)
        if readings:
            # A square weight reads as W or W^T; the transposed reading (what mm's operand holds) goes first.
            readings.sort(key=lambda r: not r[5])
            found.append([_Weight(n, codes, scale, fmt, *rest) for fmt, codes, scale, *rest in readings])
    return found


def _token_shape(x: fx.Node) -> tuple:
    """Shape of the activation before F.linear flattened its leading dims: walk back through reshapes that keep
    the last dim and the element count (so byte expressions see [B, L, K] rather than [B*L, K])."""
    shape = concrete_shape(tensor_val(x))
    n = x
    while n.op == "call_function" and n.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        src = n.args[0]
        sv = tensor_val(src)
        if sv is None or sv.dim() == 0:
            break
        ss = concrete_shape(sv)
        if math.prod(ss) != math.prod(shape) or ss[-1] != shape[-1]:
            break
        shape, n = concrete_shape(sv), src
    return shape


def _continues_region(u: fx.Node, lv: frozenset, leaves: dict) -> bool:
    """`u` is still part of the weight region: a 2-D dataflow op of the same (codes, scale) pair (a cast, a
    transpose); anything else (a matmul, a reduction, a reshape to 3-D, an output) reads the weight."""
    v = tensor_val(u)
    return is_dataflow_op(u) and leaves.get(u) == lv and v is not None and v.dim() == 2


def _reader(u: fx.Node) -> fx.Node:
    """The first non-view consumer behind a chain of single-user views (for messages)."""
    while is_view_op(u) and len(u.users) == 1:
        u = next(iter(u.users))
    return u


def _is_linear_mm(user: fx.Node, weight: fx.Node) -> bool:
    """`mm(x, W^T)` or `addmm(bias, x, W^T)` (alpha = beta = 1) with `weight` as the W^T operand."""
    if user.target == aten.mm.default:
        return user.args[1] is weight and user.args[0] is not weight
    if user.target == aten.addmm.default:
        return (user.args[2] is weight and user.args[1] is not weight
                and user.kwargs.get("beta", 1) == 1 and user.kwargs.get("alpha", 1) == 1)
    return False


def _signature(region: list, inputs: tuple) -> tuple:
    """Structural key of a region (targets, literal args, input shapes/dtypes): equal keys compute the same
    function, so one probe verdict serves every expert / layer with the same code and shapes."""
    index = {n: i for i, n in enumerate(region)}
    index.update({n: f"in{i}" for i, n in enumerate(inputs)})

    def lit(a):
        """A hashable form of argument `a`: nodes by their position in the region (or input slot), literals by repr."""
        if isinstance(a, fx.Node):
            return ("node", index.get(a, a.name))
        if isinstance(a, (list, tuple)):
            return tuple(lit(x) for x in a)
        return repr(a)

    body = tuple((str(n.target), lit(n.args), lit(tuple(sorted(n.kwargs.items())))) for n in region)
    ins = tuple((concrete_shape(tensor_val(i)), str(tensor_val(i).dtype)) for i in inputs)
    return body, ins


# ------------------------------------------------------------------------------------------------ semantics
def _cached_verdict(key: tuple, cand: _Weight, ev: RegionEvaluator) -> tuple[bool, str, str, tuple]:
    """`_verify_weight(cand, ev)`, served from `_VERDICT_CACHE` when a region with the same `key` was probed."""
    hit = _VERDICT_CACHE.get(key)
    if hit is not None:
        _VERDICT_CACHE.move_to_end(key)
        return hit
    verdict = _verify_weight(cand, ev)
    _VERDICT_CACHE[key] = verdict
    while len(_VERDICT_CACHE) > _VERDICT_CACHE_SIZE:
        _VERDICT_CACHE.popitem(last=False)
    return verdict


def _probe_weight(cand: _Weight, device) -> tuple:
    gen = torch.Generator().manual_seed(1234)
    cshape = concrete_shape(tensor_val(cand.codes))
    sshape = concrete_shape(tensor_val(cand.scale))
    codes = torch.randint(0, 256, cshape, generator=gen, dtype=torch.uint8)  # uint8 directly: h200 weights are big
    if cand.fmt == "fp8_block":
        codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)  # no NaN encodings
    # Exponents 2^-11 .. 2^4 keep every product normal (and finite) even in float16.
    scale = torch.randint(116, 132, sshape, generator=gen, dtype=torch.uint8)
    return codes.to(device), scale.to(device)


_SCALE_RANGE_REASON = ("the region equals the UE8M0 dequantisation only for scale exponents 2^-11 .. 2^4: it "
                       "differs for other scale bytes (clamped or saturated exponent; bytes 1..254 probed)")


def _reference_weight(fmt: str, codes, scale, dtype):
    if fmt == "fp8_block":
        return formats.dequantize_fp8_block(codes, scale, dtype)
    return formats.dequantize_fp4_1x32(codes, scale, dtype)


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal, or within 2 ulps of the dtype (an exp2 written by hand may round its last bit differently)."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    if torch.equal(got, ref):
        return True
    eps = torch.finfo(ref.dtype).eps
    return bool(torch.allclose(got.float(), ref.float(), rtol=2 * eps, atol=0.0))


def _verify_weight(cand: _Weight, ev: RegionEvaluator) -> tuple[bool, str, str, tuple]:
    """(ok, failed check id, reason, op params) for a candidate dequantised weight, by probe evaluation (params:
    `fp8_layouts.verify`'s for its layouts, else ())."""
    if cand.fmt == "fp8_scaled":
        return fp8_layouts.verify(cand, ev)
    val = tensor_val(cand.node)
    codes, scale = _probe_weight(cand, val.device)
    try:
        got = ev.evaluate([cand.node], {cand.codes: codes, cand.scale: scale})[cand.node]
    except RegionNotClosed as e:
        return False, "region_closed", f"the weight region is not a pure function of (codes, scale): {e}", ()
    if cand.transposed:
        got = got.t()
    ref = _reference_weight(cand.fmt, codes, scale, val.dtype)
    if not _close(got, ref):
        return (False, *_diagnose_weight(cand, codes, scale, got, ref), ())
    for wide in wide_scale_probes(scale):
        got = ev.evaluate([cand.node], {cand.codes: codes, cand.scale: wide})[cand.node]
        if not agree_where_representable(got.t() if cand.transposed else got,
                                          _reference_weight(cand.fmt, codes, wide, val.dtype)):
            return False, "scale_range", _SCALE_RANGE_REASON, ()
    return True, "", "", ()


def _block_scale(cand: _Weight, scale: torch.Tensor) -> torch.Tensor:
    """The scale tensor broadcast to one value per weight element [N, K] (as float64 of the raw byte)."""
    s = scale.double()
    if cand.fmt == "fp8_block":
        return s.repeat_interleave(32, 0)[:cand.n].repeat_interleave(32, 1)[:, :cand.k]
    return s.repeat_interleave(32, 1)


def _diagnose_weight(cand: _Weight, codes, scale, got, ref) -> tuple[str, str]:
    """Name the rule the region follows instead of the checkpoint's dequantisation."""
    if got.shape != ref.shape:
        return "weight_shape", f"the region produces shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    g = got.double()
    unit = ref.double() / torch.exp2(_block_scale(cand, scale) - 127)  # the element values without scale
    e = _block_scale(cand, scale)
    nz = unit != 0
    if torch.allclose(g, unit * e, rtol=1e-2):
        return ("ue8m0_scale_rule", "the scale byte is used as a plain multiplier (value e) instead of the UE8M0 "
                "exponent 2^(e-127)")
    if torch.allclose(g, unit, rtol=1e-2):
        return "scale_missing", "the element values are not multiplied by the block scale"
    if nz.any():
        ratio = (g[nz] / unit[nz]).abs()
        if bool((ratio > 0).all()):
            shift = torch.log2(ratio) - (e[nz] - 127)
            if torch.allclose(shift, shift.flatten()[0].expand_as(shift), atol=1e-6):
                bias = 127 - float(shift.flatten()[0])
                return ("ue8m0_exponent_bias", f"the scale exponent bias is {bias:g}, not 127 "
                        "(UE8M0 value 2^(e-127))")
    if cand.fmt == "fp4":
        swapped = ((codes & 15) << 4) | (codes >> 4)
        alt = formats.dequantize_fp4_1x32(swapped, scale, ref.dtype)
        if _close(got, alt):
            return ("e2m1_nibble_order", "the packed E2M1 nibbles are read high-first; the checkpoint stores the even "
                    "element in the LOW nibble")
    diff = (g - ref.double()).abs()
    idx = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
    return ("dequant_values", f"the weight computed from (codes, scale) differs from the {cand.fmt} dequantisation "
            f"(max |diff| {float(diff.max()):.3g} at {idx})")


def _dominators(node: fx.Node, sourced: set, limit: int = _DOMINATOR_STEPS):
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


def _dtype_name(x: fx.Node) -> str:
    """`x`'s dtype as the report writes it (`float32`, `bfloat16`)."""
    return str(tensor_val(x).dtype).removeprefix("torch.")


def _widened(x: fx.Node, like: fx.Node) -> bool:
    """x (the fused op's input) is float32 where `like` (the matmul) computes in bfloat16 (`_act_quant_input`)."""
    return tensor_val(x).dtype != tensor_val(like).dtype


def _act_quant_input(lhs: fx.Node, k: int, ev: RegionEvaluator, sourced: set, widen: bool = False,
                     lookalikes: list | None = None) -> fx.Node | None:
    """The tensor x with `lhs == fake_quant_fp8_1x32(x)` (reshaped), or None if lhs is not fake-quantised.

    x has lhs's dtype; failing that and with `widen`, x may be float32 where lhs is bfloat16 and
    `lhs == fake_quant_fp8_1x32(x).to(bfloat16)`. Before torch 2.13, Inductor's joint-graph pass `pointless_convert`
    removes the `float32 -> bfloat16 -> float32` round trip in front of the quantiser, so the graph quantises the
    float32 value and casts the result (exactly: every FP8 1x32 value is a bfloat16). The fused op then takes the
    float32 x (`_widened`). Same-dtype inputs are searched first, so an exact upcast of a bfloat16 x is not taken.
    When none is found, `lookalikes` (if given) gets (tensor, edge kind) for each tensor that agreed with the
    quantiser on the ordinary probe but not on an edge block (`_quantiser_probes`), for the report.
    Only the grouped expert GEMV widens (`_GatheredMatcher`): its tensor-core kernel needs act_quant (h200 decode
    on the H200: 109.6 -> 115.0 tok/s in one lease). The dense FP8 GEMVs stream Inductor's quantised bfloat16 x as
    fast and did not gain from widening: 115.0 tok/s with them widened, 118.0 without, in two leases
    (bench/results/2026-12-02_h200_s22)."""
    lv = tensor_val(lhs)
    if k % 32:
        return None
    near: list = []
    found = _quantiser_input(lhs, k, ev, sourced, lv.dtype, near)
    if found is None and widen and lv.dtype == torch.bfloat16:
        found = _quantiser_input(lhs, k, ev, sourced, torch.float32, near)
    if found is None and lookalikes is not None:
        lookalikes.extend(near)
    return found


def _quantiser_input(lhs: fx.Node, k: int, ev: RegionEvaluator, sourced: set, dtype: torch.dtype,
                     near: list) -> fx.Node | None:
    # The nearest dominator of `dtype` with lhs == fake_quant_fp8_1x32(it) on probes (`_act_quant_input`); near
    # gets (dominator, edge kind) for those that fail on an edge block only.
    lv = tensor_val(lhs)
    for d in _dominators(lhs, sourced):
        if d is lhs:
            continue
        dv = tensor_val(d)
        shape = concrete_shape(dv)
        if dv.dtype == dtype and shape and shape[-1] == k and math.prod(shape) == math.prod(concrete_shape(lv)):
            differs = _quantiser_difference(lhs, d, shape, ev, lv.dtype)
            if differs is None:
                return d
            if differs != "ordinary":
                near.append((d, differs))
        if d.op != "call_function" or not is_dataflow_op(d):
            # Everything farther up reaches lhs through this non-dataflow node: no fake-quant region can.
            return None
    return None


def _quantiser_difference(lhs: fx.Node, d: fx.Node, shape: tuple, ev: RegionEvaluator,
                          out_dtype: torch.dtype) -> str | None:
    """None when lhs == fake_quant_fp8_1x32(d) (cast to `out_dtype`) on every probe of `_quantiser_probes`;
    otherwise "ordinary" (it differs on ordinary values, or the region is not closed) or the `_EDGE_BLOCKS` kind
    of the first block where it differs."""
    dv = tensor_val(d)
    for probe, kinds in _quantiser_probes(shape, dv.dtype):
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


#: Per-32-block contents of the edge probes (`_quantiser_probes`).
_EDGE_BLOCKS = ("zero", "tiny", "huge", "nan", "+inf", "-inf", "spread")


def _quantiser_probes(shape: tuple, dtype: torch.dtype) -> list:
    """(probe, kind of each 32-block or None) pairs: probes of `shape` (last dim a multiple of 32) in `dtype` for the
    fake-quant check.

    First, random blocks with per-block magnitudes 2^-8..2^8 (every block's UE8M0 exponent choice). Then edge
    probes, each block one of `_EDGE_BLOCKS` in turn (as many probes as it takes to show every kind at least once):
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
    for offset in range(0, len(_EDGE_BLOCKS), n):
        base = torch.randn(n, 32, generator=gen, dtype=torch.float64)
        kinds = [_EDGE_BLOCKS[(b + offset) % len(_EDGE_BLOCKS)] for b in range(n)]
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


# ------------------------------------------------------------------------------------------------ gathered experts
_MATMULS = (aten.bmm.default, aten.mm.default)


def _is_layout(n: fx.Node) -> bool:
    """`n` only re-indexes all of one tensor: a clone, or a view that is not a dtype bitcast and drops no element
    (reshape, permute, unsqueeze, expand, ...; a slice or select reads a part and ends the layout chain)."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if n.target == aten.clone.default:
        return True
    src, val = tensor_val(n.args[0]), tensor_val(n)
    return (is_view_op(n) and n.target != aten.view.dtype and src is not None and val is not None
            and math.prod(concrete_shape(val)) >= math.prod(concrete_shape(src)))


def _layout_top(n: fx.Node) -> fx.Node:
    """The tensor that `n` re-indexes (walk up through `_is_layout` nodes)."""
    while _is_layout(n):
        n = n.args[0]
    return n


def _gather(n: fx.Node):
    """(stack, idx) when `n` is `stack[idx]` (aten.index.Tensor, one integer index on dim 0) or
    `index_select(stack, 0, idx)` of a 3-D uint8 stack; None otherwise."""
    if n.op != "call_function":
        return None
    if n.target == aten.index.Tensor and len(n.args[1]) == 1:
        stack, idx = n.args[0], n.args[1][0]
    elif n.target == aten.index_select.default and n.args[1] in (0, -3):
        stack, idx = n.args[0], n.args[2]
    else:
        return None
    sv, iv = tensor_val(stack), tensor_val(idx)
    if sv is None or iv is None or sv.dtype != torch.uint8 or sv.dim() != 3 or iv.dtype not in (torch.int64,
                                                                                                 torch.int32):
        return None
    return stack, idx


def _probe_activation(val: torch.Tensor, seed: int) -> torch.Tensor:
    """Random activation probe of `val`'s shape and dtype, magnitudes 2^-4..2^4 (several UE8M0 exponents)."""
    gen = torch.Generator().manual_seed(seed)
    shape = concrete_shape(val)
    p = torch.randn(shape, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-4, 5, shape, generator=gen).double())
    return p.to(val.dtype).to(val.device)


@dataclass(frozen=True)
class _Gathered:
    """A verified gathered chain: `mm` computes y[n, j] = x[n (, j)] @ dequant(W[idx[n, j]])^T, read at `out_node`."""

    mm: fx.Node
    out_node: fx.Node
    x: fx.Node
    act_quant: bool
    shared: bool          # x holds one row per token (shared by its experts) rather than one per (token, expert)
    codes: fx.Node        # the stacks W [E, out, K/2], S [E, out, K/32]
    scale: fx.Node
    idx: fx.Node
    tokens: int
    topk: int
    experts: int
    n: int                # out features
    k: int                # in features K


class _GatheredMatcher:
    """gather(W, idx) + gather(S, idx) -> FP4 dequantise -> bmm/mm  =>  `dsv41::grouped_linear_fp4` (module
    docstring, "Gathered experts"). `run()` rewrites the graph and returns (matches, near-misses)."""

    def __init__(self, family: str, gm: fx.GraphModule, ev: RegionEvaluator, sourced: set, lookalikes: list):
        self.family = family
        self.gm = gm
        self.ev = ev
        self.sourced = sourced
        self.lookalikes = lookalikes  # (matmul, tensor, edge kind) of `_act_quant_input`, for the report
        # Verdicts by region signature (one probe evaluation serves every layer with the same code and shapes)
        # and probe codes/scales by shape: at h200 size a probe is ~35 MB and its evaluation a few GB-seconds.
        self.verdicts: dict = {}
        self.probes: dict = {}

    def run(self) -> tuple[list, list]:
        """Find, verify and replace every gathered chain; returns (list of MatchRecord, list of NearMiss)."""
        graph = self.gm.graph
        leaves = _leaf_sets(graph)
        matches, misses = [], []
        for mm in list(graph.nodes):
            if mm.op != "call_function" or mm.target not in _MATMULS:
                continue
            for wpos in (1, 0):
                lv = leaves.get(mm.args[wpos])
                if not lv or len(lv) != 2:
                    continue
                gathers = [(g, *_gather(g)) for g in sorted(lv, key=lambda g: g.name) if _gather(g) is not None]
                if len(gathers) != 2:
                    continue
                found = self._verify(mm, wpos, gathers)
                if isinstance(found, NearMiss):
                    misses.append(found)
                else:
                    matches.append(self._fuse(found))
                break
        eliminate_dead_code(graph)
        return matches, misses

    # -------------------------------------------------------------------------------------------- checks
    def _verify(self, mm: fx.Node, wpos: int, gathers: list):
        """A `_Gathered` for a chain that passes every check, else the `NearMiss` of the first failed check."""
        where = SourceLocation.from_node(mm)

        def miss(check, reason):
            """The `NearMiss` of failed check `check` (id) with `reason` (one sentence), at the matmul."""
            return NearMiss(self.family, f"gather -> dequantize(fp4) -> {node_label(mm)}", check, reason, where)

        (ga, sa, ia), (gb, sb, ib) = gathers
        if ia is not ib:
            return miss("same_indices", "the codes and the scales are gathered with different index tensors")
        reading = None
        for gc, stc, gs, sts in ((ga, sa, gb, sb), (gb, sb, ga, sa)):
            c, t = concrete_shape(tensor_val(stc)), concrete_shape(tensor_val(sts))
            if c[:2] == t[:2] and t[2] > 0 and c[2] == 16 * t[2]:
                reading = (gc, stc, gs, sts, c[0], c[1], 2 * c[2])
        if reading is None:
            shapes = " and ".join(str(list(concrete_shape(tensor_val(s)))) for s in (sa, sb))
            return miss("weight_format", f"the gathered uint8 stacks {shapes} are not FP4 1x32 experts [E, out, K/2] "
                        "+ [E, out, K/32] (one UE8M0 scale per 32 elements along K)")
        gc, stc, gs, sts, experts, n_out, kdim = reading
        if dsv41_op(GROUPED_OP) is None:
            return miss("op_registered", f"dsv41::{GROUPED_OP} is not registered (import dsv41.kernels)")
        if any(not isinstance(d, int) for d in (*tensor_val(mm).shape, *tensor_val(ia).shape)):
            return miss("static_shape", "the gathered chain has symbolic sizes; the rewrite needs static shapes")
        b_node, a_node = mm.args[wpos], mm.args[1 - wpos]
        dq = _layout_top(b_node)
        dval = tensor_val(dq)
        if dval is None or dval.dtype != tensor_val(mm).dtype:
            return miss("dtype", "the dequantised experts are not in the matmul's dtype")

        codes_p, scale_p = self._probe_codes(gc, gs)
        key = ("dequant",) + _signature(collect_region([dq], [gc, gs]), (gc, gs))
        if key not in self.verdicts:
            self.verdicts[key] = self._verify_dequant(dq, gc, gs, codes_p, scale_p, kdim)
        ok, check, reason, dprobe = self.verdicts[key]
        if not ok:
            return miss(check, reason)

        q = _layout_top(a_node)
        near: list = []
        x = _act_quant_input(q, kdim, self.ev, self.sourced, widen=True, lookalikes=near)
        self.lookalikes.extend((mm, d.name, kind) for d, kind in near)
        act_quant = x is not None
        x = x if act_quant else q
        xv = tensor_val(x)
        if (xv is None or (xv.dtype != dval.dtype and not (act_quant and _widened(x, mm)))
                or any(not isinstance(d, int) for d in xv.shape)):
            return miss("dtype", "the activation reaching the matmul is not a static tensor of the experts' dtype")
        ishape = concrete_shape(tensor_val(ia))
        pairs, xn = math.prod(ishape), math.prod(concrete_shape(xv))
        tokens, topk = (math.prod(ishape[:-1]), ishape[-1]) if len(ishape) >= 2 else (pairs, 1)
        if len(ishape) < 2 and xn != pairs * kdim and xn % kdim == 0 and xn and pairs % (xn // kdim) == 0:
            tokens, topk = xn // kdim, pairs // (xn // kdim)  # 1-D index of (token, expert) pairs, x per token
        if xn not in (tokens * kdim, pairs * kdim):
            return miss("activation_shape", f"the activation has {xn} elements; {tokens} tokens x {topk} experts "
                        f"need [N, K] = {tokens * kdim} or [N, k, K] = {pairs * kdim}")
        shared = xn == tokens * kdim

        chain = [mm]
        while len(chain[-1].users) == 1:
            u = next(iter(chain[-1].users))
            if not (_is_layout(u) and u.args[0] is chain[-1]):
                break
            chain.append(u)
        key = ("e2e", act_quant, shared, tokens, topk, wpos) + _signature(
            collect_region([chain[-1]], [x, gc, gs]), (x, gc, gs))
        if key not in self.verdicts:
            self.verdicts[key] = self._verify_end_to_end(
                mm, wpos, chain, x, act_quant, shared, (gc, gs, dq), (codes_p, scale_p, dprobe),
                (tokens, topk, n_out, kdim))
        pos, check, reason = self.verdicts[key]
        if pos is None:
            return miss(check, reason)
        return _Gathered(mm, chain[pos], x, act_quant, shared, stc, sts, ia, tokens, topk, experts, n_out, kdim)

    def _probe_codes(self, gc: fx.Node, gs: fx.Node) -> tuple:
        """Probe (codes, scales) for gathers of these shapes (memoised: the same for every chain of that shape)."""
        cshape, sshape = concrete_shape(tensor_val(gc)), concrete_shape(tensor_val(gs))
        key = (cshape, sshape, str(tensor_val(gc).device))
        if key not in self.probes:
            gen = torch.Generator().manual_seed(1234)
            codes = torch.randint(0, 256, cshape, generator=gen, dtype=torch.uint8)
            # Exponents 2^-11 .. 2^4 keep every product normal (and finite) even in float16.
            scale = torch.randint(116, 132, sshape, generator=gen, dtype=torch.uint8)
            dev = tensor_val(gc).device
            self.probes[key] = (codes.to(dev), scale.to(dev))
        return self.probes[key]

    def _verify_dequant(self, dq: fx.Node, gc, gs, codes, scale, kdim: int) -> tuple:
        """(ok, check, reason, value of `dq` on the probes): `dq` must be FP4 1x32 of the gathered (codes, scale)."""
        try:
            got = self.ev.evaluate([dq], {gc: codes, gs: scale})[dq]
        except RegionNotClosed as e:
            return False, "region_closed", f"the dequantised experts are not a pure function of the gathers: {e}", None
        ref = formats.dequantize_fp4_1x32(codes, scale, got.dtype)
        if got.numel() != ref.numel():
            return (False, "weight_shape", f"the dequantised tensor has shape {tuple(got.shape)}; FP4 1x32 of the "
                    f"gathered codes has shape {tuple(ref.shape)}", None)
        if _close(got, ref.reshape(got.shape)):
            for wide in wide_scale_probes(scale):
                g = self.ev.evaluate([dq], {gc: codes, gs: wide})[dq]
                r = formats.dequantize_fp4_1x32(codes, wide, g.dtype)
                if not agree_where_representable(g, r.reshape(g.shape)):
                    return False, "scale_range", _SCALE_RANGE_REASON, None
            return True, "", "", got
        flat = _Weight(dq, gc, gs, "fp4", ref.numel() // kdim, kdim, False)
        check, reason = _diagnose_weight(flat, codes.reshape(-1, kdim // 2), scale.reshape(-1, kdim // 32),
                                         got.reshape(-1, kdim), ref.reshape(-1, kdim))
        if check == "dequant_values" and torch.equal(got.flatten().sort().values, ref.flatten().sort().values):
            check, reason = "weight_layout", ("the dequantised experts hold the FP4 1x32 values in another element "
                                              "order than [..., out, K]")
        return False, check, reason, None

    def _verify_end_to_end(self, mm, wpos, chain, x, act_quant, shared, nodes, probes, dims) -> tuple:
        """(index in `chain` of the node holding y [N, k, out] in row-major order, or None; check; reason)."""
        gc, gs, dq = nodes
        codes, scale, dprobe = probes
        tokens, topk, n_out, kdim = dims
        px = _probe_activation(tensor_val(x), 99)
        try:
            vals = self.ev.evaluate(list(mm.args[:2]), {x: px, gc: codes, gs: scale, dq: dprobe})
            lhs, rhs = (vals[a].double() for a in mm.args[:2])
            env = {mm: torch.bmm(lhs, rhs) if mm.target == aten.bmm.default else torch.mm(lhs, rhs)}
            outs = self.ev.evaluate(chain[1:], env)
        except RegionNotClosed as e:
            return None, "region_closed", f"the matmul's operands are not a function of x and the gathers: {e}"
        xr = formats.fake_quant_fp8_1x32(px) if act_quant else px
        xr = xr.double().reshape((tokens, kdim) if shared else (tokens, topk, kdim))
        w = formats.dequantize_fp4_1x32(codes.reshape(tokens, topk, n_out, kdim // 2),
                                        scale.reshape(tokens, topk, n_out, kdim // 32), px.dtype).double()
        eq = "nd,nkfd->nkf" if shared else "nkd,nkfd->nkf"
        ref, mag = torch.einsum(eq, xr, w), torch.einsum(eq, xr.abs(), w.abs())
        for pos in range(len(chain) - 1, -1, -1):
            got = outs[chain[pos]]
            if got.numel() == ref.numel() and bool(
                    ((got - ref.reshape(got.shape)).abs() <= _E2E_RTOL * mag.reshape(got.shape)).all()):
                return pos, "", ""
        rows = "x[n]" if shared else "x[n, j]"
        return (None, "output_layout", f"the matmul over the gathered FP4 experts does not compute y[n, j] = {rows} "
                f"@ W[idx[n, j]]^T (it contracts or orders rows, experts or K differently)")

    # -------------------------------------------------------------------------------------------- rewrite
    def _fuse(self, c: _Gathered) -> MatchRecord:
        graph = self.gm.graph
        mm = c.mm
        op = dsv41_op(GROUPED_OP)
        x_in, idx_in = c.x, c.idx
        want_x = (c.tokens, c.k) if c.shared else (c.tokens, c.topk, c.k)
        if concrete_shape(tensor_val(c.x)) != want_x:
            x_in = insert_node(graph, mm, aten.reshape.default, (c.x, [-1, *want_x[1:]]), like=mm)
        if tensor_val(c.idx).dtype != torch.int64:
            idx_in = insert_node(graph, mm, torch.ops.prims.convert_element_type.default, (idx_in, torch.int64),
                                 like=mm)
        if concrete_shape(tensor_val(c.idx)) != (c.tokens, c.topk):
            idx_in = insert_node(graph, mm, aten.reshape.default, (idx_in, [-1, c.topk]), like=mm)
        y = insert_node(graph, mm, op, (x_in, c.codes, c.scale, idx_in, c.act_quant), like=mm)
        if _widened(c.x, mm):
            # The op computes in x's float32; one rounding to the matmul's dtype, as its FP32 accumulator had.
            y = insert_node(graph, mm, torch.ops.prims.convert_element_type.default, (y, tensor_val(mm).dtype),
                            like=mm)
        oshape = concrete_shape(tensor_val(c.out_node))
        if oshape != (c.tokens, c.topk, c.n):
            y = insert_node(graph, mm, aten.reshape.default, (y, list(oshape)), like=mm)
        c.out_node.replace_all_uses_with(y)

        region = [n for n in collect_region([c.out_node], [c.x, c.codes, c.scale, c.idx]) if n is not y]
        xsize, esize = tensor_val(c.x).element_size(), tensor_val(mm).element_size()
        ishape = concrete_shape(tensor_val(c.idx))
        rows, subs = token_rows(_token_shape(c.idx)[:-1] if len(ishape) >= 2 else (c.tokens,))
        pairs = rows * c.topk
        w_bytes = pairs * c.n * (c.k // 2 + c.k // 32)  # the selected experts' codes and scales
        x_elems = (rows if c.shared else pairs) * c.k
        y_bytes = pairs * c.n * esize
        # Before: the dequantised experts [N, k, out, K] are written and re-read, the fake-quantised activation
        # too; after: the fused op reads the selected experts' bytes and x once.
        before = (w_bytes + 2 * pairs * c.n * c.k * esize + x_elems * (xsize + 2 * esize if c.act_quant else esize)
                  + y_bytes)
        after = w_bytes + x_elems * xsize + y_bytes
        return MatchRecord(
            self.family, f"{GROUPED_OP}(act_quant={c.act_quant})", f"dsv41::{GROUPED_OP}", SourceLocation.from_node(mm),
            tuple(n.name for n in region), tuple(node_label(n) for n in region), str(sympy.expand(before)),
            str(sympy.expand(after)), tuple(sorted(subs.items())),
            (("format", "fp4"), ("N", c.n), ("K", c.k), ("experts", c.experts), ("topk", c.topk),
             ("act_quant", c.act_quant), ("x", "per_token" if c.shared else "per_expert"),
             ("x_dtype", _dtype_name(c.x))))


# ------------------------------------------------------------------------------------------------ findings
def _exotic(n: fx.Node) -> bool:
    """Whether a node touches a dtype Inductor may refuse to generate code for (cheap pre-check)."""
    vals = [tensor_val(a) for a in n.all_input_nodes] + [tensor_val(n)]
    odd = {getattr(torch, "float8_e8m0fnu", None)} - {None}
    return any(v is not None and (v.is_complex() or v.dtype in odd or v.is_meta) for v in vals)


def _fallback_findings(family: str, graph: fx.Graph) -> list[Finding]:
    """ATen ops Inductor will not generate code for (it calls them as fallback kernels), one finding each:
    ops without a lowering, ops whose lowering is an explicit fallback, and ops on dtypes Inductor does not
    generate code for (complex). Views are skipped: they launch nothing."""
    from torch._inductor import lowering

    unsupported = getattr(lowering, "fallback_node_due_to_unsupported_type", None)
    out = []
    for n in graph.nodes:
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten" or t.is_view:
            continue
        low = lowering.lowerings.get(t)
        if low is None:
            why = "no Inductor lowering"
        elif getattr(low, "_is_fallback_handler", False):
            why = "Inductor lowers it to a fallback"
        elif unsupported is not None and _exotic(n) and unsupported(n):
            why = "dtype Inductor does not generate code for (e.g. complex)"
        else:
            continue
        out.append(Finding(family, "fallback_op", f"{node_label(n)} runs as a fallback kernel ({why})",
                           SourceLocation.from_node(n)))
    return out


def _with_removed(m: MatchRecord, removed: set) -> MatchRecord:
    """Keep only the chain nodes that really left the graph (a shared node another consumer still reads stays);
    `removed` holds node names."""
    keep = [(a, b) for a, b in zip(m.nodes_replaced, m.ops_replaced) if a in removed]
    return dataclasses.replace(m, nodes_replaced=tuple(a for a, _ in keep), ops_replaced=tuple(b for _, b in keep))
