"""`dispatch` family: dequantize(weight) -> matmul becomes one fused low-precision linear op.

Chain matched (`SPEC` below, `dsv41 report --patterns dispatch`; MODEL.md §2.1 block layouts):

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

RMSNorm prologue (issue [decode] #37; its kernels passed their GPU tests on an H100 and `small` decoded 1.0 % faster
with 20 launches fewer per step, bench/results/2026-12-07_h100_s35):
when the quantiser's input of a block-FP8 chain is an RMSNorm of h (`act_quant.norm_prologue`, the finder
`rms_prologue` shared with `half_gemv`: spelling and eps settled on probes, exactly) and nothing else reads the
norm's or the quantiser's values, the op takes h: `dsv41::linear_fp8_block(h, W, S, True, norm_weight, eps,
norm_mode)`, and the norm's launch and its normalised copy go (the q_norm -> wq_b pair of every V4.1 attention
layer). Torch 2.11's form, where the quantiser reads the norm's float32 result before its bfloat16 rounding, is
taken too (norm modes 4-6 of `ref.norm.NORM_SPELLINGS`).

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

import sympy
import torch
import torch.fx as fx

from . import fp8_layouts
from .act_quant import act_quant_input, dtype_name, norm_prologue
from .dispatch_gathered import GROUPED_OP, GatheredMatcher
from .dispatch_weights import (Weight, candidates, continues_region, is_linear_mm, leaf_sets, reader, signature,
                               token_shape, verify_weight)
from .records import Finding, MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (Chain, FusionFamily, GraphScan, RegionEvaluator, Role, collect_region, dsv41_op,
                     eliminate_dead_code, insert_node, keep_removed, node_label, register_family, same_shape,
                     symbolic_part, tensor_val, token_rows)
from .small_ops import mutated_inputs, view_base

__all__ = ["DispatchFamily", "WEIGHT_FORMATS", "GROUPED_OP", "SPEC"]

aten = torch.ops.aten
#: format -> fused op name ("fp8_scaled": the checkpoint layouts of `fp8_layouts`, whose verdict names the op).
WEIGHT_FORMATS = {"fp8_block": "linear_fp8_block", "fp4": "linear_fp4", "fp8_scaled": "linear_fp8_scaled"}
#: Gate name of the block-FP8 GEMV with an RMSNorm prologue (`act_quant.norm_prologue`).
NORM_VARIANT = "linear_fp8_block(rms_norm)"
#: Probe verdicts of weight regions across graphs and compiles: (region signature, format, transposed, device
#: type) -> (ok, check, reason). A signature fixes the region's function (`signature`) when the region is made of
#: ATen calls alone (a constant tensor, `get_attr`, is keyed by name only: such regions are not cached), so a
#: regional compile (one graph per layer variant) probes each weight layout once, not once per graph (at h200 a
#: probe of one 32768 x 1280 weight takes seconds on the host). Bounded, oldest verdict dropped first.
_VERDICT_CACHE: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_VERDICT_CACHE_SIZE = 512
#: The weight verification (a module global, so a test can wrap it).
_verify_weight = verify_weight

_WEIGHT_ROLES = (Role("x", "[.., K]"), Role("codes", "[N, K] / [N, K/2]", "uint8"),
                 Role("scale", "[N/32, K/32] / [N, K/32]", "uint8"))
_WEIGHT_CHECKS = ("ue8m0_scale_rule", "scale_missing", "ue8m0_exponent_bias", "e2m1_nibble_order", "dequant_values",
                  "weight_shape", "scale_range", "region_closed", "op_shape", "weight_source", "static_shapes",
                  "gpu_unvalidated", "op_registered", "orientation")
#: What each dispatch chain looks for (`dsv41 report --patterns`).
SPEC = register_family(
    "dispatch", "dequantize(block-FP8 / FP4 weight) [+ FP8 1x32 activation fake-quant] -> matmul; "
    "gather(FP4 experts) -> dequantize -> bmm", (
    Chain("linear_fp8_block", "linear_fp8_block", "mm / addmm whose weight operand is a float 2-D tensor computed from "
          "exactly one (codes, scale) uint8 pair", _WEIGHT_ROLES, "dsv41.ref.formats:dequantize_fp8_block",
          ("act_quant (an FP8 1x32 fake-quant of a dominator of x)", "orientation"),
          ("random E4M3 codes, scale bytes 116..131, then every UE8M0 byte 1..254", "activation edge blocks"),
          _WEIGHT_CHECKS),
    Chain("linear_fp8_block (RMSNorm prologue)", "linear_fp8_block", "the linear_fp8_block chain whose quantised x is "
          "an RMSNorm of h that nothing else reads", (Role("h", "[M, K]", "x's dtype"),
                                                      Role("norm_weight", "[K] (optional)", "x's dtype"),
                                                      *_WEIGHT_ROLES[1:]),
          "dsv41.ref.gemv:linear_fp8_block(norm_mode)", ("norm spelling (ref.norm.NORM_SPELLINGS)", "eps"),
          ("rms_prologue's probe rows at magnitudes 1, 3e-3 and 1e6, exactly",),
          ("gpu_unvalidated", "op_registered"), variants=(NORM_VARIANT,)),
    Chain("linear_fp4", "linear_fp4", "mm / addmm whose weight operand is computed from packed E2M1 codes and UE8M0 "
          "1x32 scales", _WEIGHT_ROLES, "dsv41.ref.formats:dequantize_fp4_1x32", ("act_quant", "orientation"),
          ("random E2M1 bytes, scale bytes 116..131, then every UE8M0 byte 1..254", "activation edge blocks"),
          _WEIGHT_CHECKS),
    Chain("linear_fp8_scaled", "linear_fp8_scaled", "mm / addmm whose weight is an FP8 checkpoint layout with a "
          "per-tensor / per-channel / block scale (fp8_layouts.py)", _WEIGHT_ROLES, "dsv41/passes/fp8_layouts.py",
          ("layout", "scale granularity"), ("layout probes of fp8_layouts",), _WEIGHT_CHECKS),
    Chain("grouped_linear_fp4", GROUPED_OP, "bmm whose weight operand is gather(stacked FP4 experts, ids) -> "
          "dequantise", (Role("x", "[E, M, K]"), Role("codes", "[experts, N, K/2]", "uint8"),
                         Role("scale", "[experts, N, K/32]", "uint8"), Role("ids", "[..]", "int")),
          "dsv41.ref.formats:dequantize_fp4_1x32", ("act_quant", "layout"),
          ("probe codes and activations end to end in float64",), _WEIGHT_CHECKS),
),
    # order: after the families that fuse chains around matmuls, because it also audits what stays on a slow
    # path (a new such family declares before="dispatch")
    after=("c2_compressor", "rope_fp4", "mhc", "engram", "moe", "sparse_attention", "indexer", "small_ops",
           "upcast_linear"),
)


class DispatchFamily(FusionFamily):
    """Fuse dequantize -> mm into `dsv41::linear_fp8_block` / `dsv41::linear_fp4`, and gather -> FP4 dequantize ->
    bmm of stacked experts into `dsv41::grouped_linear_fp4` (see module docstring)."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Replace every verified dequantise -> matmul chain in `gm` with the fused GEMV op; returns the record."""
        scan = GraphScan(gm)
        graph, ev, sourced = scan.graph, scan.ev, scan.sourced
        findings: list[Finding] = []
        verdicts: dict = {}
        missing_ops = sorted(op for op in (*WEIGHT_FORMATS.values(), GROUPED_OP) if dsv41_op(op) is None)
        # Gathered experts first: their regions are 3-D/4-D, disjoint from the 2-D weights matched below.
        lookalikes: list = []  # (matmul, tensor, edge kind): `act_quant_input`
        matches, misses = GatheredMatcher(self.name, gm, ev, sourced, lookalikes, self.gated_ops).run()
        leaves = leaf_sets(graph)
        written = mutated_inputs(graph)

        for readings in candidates(graph, leaves):
            verdict = None
            for cand in readings:
                region = collect_region([cand.node], [cand.codes, cand.scale])
                key = (signature(region, (cand.codes, cand.scale)), cand.fmt, cand.layout, cand.transposed,
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
            matmuls = [u for u in users if is_linear_mm(u, cand.node)]
            mm_users = matmuls if cand.transposed else []
            if ok and cand.k % 32 and cand.fmt != "fp8_scaled":
                ok, check, reason = False, "op_shape", (f"K = {cand.k} is not a multiple of 32; the fused linear ops "
                                                       "quantise activations in 1x32 blocks")
            if ok:
                computed = [t for t in (cand.codes, cand.scale)
                            if view_base(t).op not in ("placeholder", "get_attr") or view_base(t) in written]
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
            if not cand.transposed:
                for u in matmuls:  # x @ W with W held [K, N]: everything else fits, so say why it stays
                    misses.append(NearMiss(
                        self.name, f"dequantize({cand.fmt}) -> {node_label(u)}", "orientation",
                        f"the weight is used as stored, x @ W with its codes held [K, N] = [{cand.n}, {cand.k}]; the "
                        "fused linear ops read codes as [N, K] rows (nn.Linear's layout, x @ W.t()), so this matmul "
                        "stays with Inductor (storing the codes and scale grid transposed would fuse it)",
                        SourceLocation.from_node(u)))
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
                if u in mm_users or continues_region(u, lv, leaves):
                    continue
                r = reader(u)
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
        removed = scan.removed_names()
        matches = [keep_removed(m, removed) for m in matches]
        findings.extend(_fallback_findings(self.name, graph))
        note = f"ops not registered: {', '.join(missing_ops)}" if missing_ops else ""
        return PassRecord(self.name, True, tuple(matches), tuple(misses), tuple(findings), note)

    # -------------------------------------------------------------------------------------------- rewrite
    def _fuse(self, gm, mm: fx.Node, cand: Weight, op, ev: RegionEvaluator, sourced: set,
              lookalikes: list, params: tuple = ()) -> MatchRecord:
        graph = gm.graph
        if mm.target == aten.addmm.default:
            bias, lhs = mm.args[0], mm.args[1]
        else:
            bias, lhs = None, mm.args[0]
        near: list = []
        scaled = dict(params).get("op") == "linear_fp8_scaled"  # no activation quantiser: x is read as it is
        x = None if scaled else act_quant_input(lhs, cand.k, ev, sourced, lookalikes=near)
        # An RMSNorm in front of the quantiser goes into the op's prologue (dsv41's own block format only).
        norm = (norm_prologue(lhs, x, cand.k, ev, sourced)
                if cand.fmt == "fp8_block" and NORM_VARIANT not in self.gated_ops else None)
        if norm is not None:
            x, near = norm[0], []
        lookalikes.extend((mm, d.name, kind) for d, kind in near)
        act_quant = x is not None
        region_nodes = collect_region([cand.node], [cand.codes, cand.scale])
        if act_quant:
            region_nodes += collect_region([lhs], [x] + ([norm[1]] if norm is not None and norm[1] is not None
                                                         else []))
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
            prologue = () if norm is None else norm[1:]
            out = insert_node(graph, mm, op, (x_in, cand.codes, cand.scale, act_quant, *prologue), like=mm)
            op_name, extra = WEIGHT_FORMATS[cand.fmt], ()
            pattern = f"{op_name}(act_quant={act_quant})"
            if norm is not None:
                pattern = f"{op_name}(rms_norm, act_quant=True)"
                extra = (("rms_norm_eps", norm[2]), ("rms_norm_mode", norm[3]), ("launches_saved_norm", 1))
        if bias is not None:
            out = insert_node(graph, mm, aten.add.Tensor, (out, bias), like=mm)
        mm.replace_all_uses_with(out)
        graph.erase_node(mm)

        xsize = tensor_val(x).element_size()
        esize = tensor_val(out).element_size()
        rows, subs = token_rows(token_shape(x)[:-1])
        n, k = cand.n, cand.k
        w_bytes = sum(tensor_val(t).numel() * tensor_val(t).element_size() for t in (cand.codes, cand.scale))
        bias_bytes = n * esize if bias is not None else 0
        # Before: the dequantised weight crosses a kernel boundary (written once, read by the GEMM) and so
        # does the fake-quantised activation; after: the fused op reads codes, scales and x once.
        before = (w_bytes + 2 * n * k * esize + rows * k * (xsize + 2 * esize if act_quant else esize)
                  + rows * n * esize + bias_bytes)
        if norm is not None:  # the norm's own launch read h and wrote the normalised x
            before += 2 * rows * k * xsize
        after = w_bytes + rows * k * xsize + rows * n * esize + bias_bytes
        return MatchRecord(
            self.name, pattern, f"dsv41::{op_name}",
            SourceLocation.from_node(mm), tuple(n_.name for n_ in region_nodes + [mm]),
            tuple(node_label(n_) for n_ in region_nodes + [mm]), str(sympy.expand(before)), str(sympy.expand(after)),
            tuple(sorted(subs.items())),
            (("format", cand.fmt), ("N", n), ("K", k), ("act_quant", act_quant), ("bias", bias is not None),
             ("x_dtype", dtype_name(x))) + extra)


def _cached_verdict(key: tuple, cand: Weight, ev: RegionEvaluator) -> tuple[bool, str, str, tuple]:
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
