"""Gathered experts of family `dispatch` (dispatch.py): gather(FP4 experts) -> dequantise -> bmm chains, verified on
probe codes and activations and fused into `dsv41::grouped_linear_fp4`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..ref import formats
from .records import MatchRecord, NearMiss, SourceLocation
from .act_quant import act_quant_input, dtype_name, widened
from .moe_tail import round_in_tail
from .dispatch_weights import SCALE_RANGE_REASON, Weight, diagnose_weight, leaf_sets, signature, token_shape
from .engine import (RegionEvaluator, RegionNotClosed, agree_where_representable, close_exact, collect_region,
                     concrete_shape, dsv41_op, eliminate_dead_code, insert_node, is_view_op, node_label, tensor_val,
                     token_rows, wide_scale_probes)

__all__ = ["GROUPED_OP", "Gathered", "GatheredMatcher"]

aten = torch.ops.aten
#: fused op of the gathered-experts chain (FP4 1x32 is the only gathered format in the model).
GROUPED_OP = "grouped_linear_fp4"


#: float64 tolerance of the end-to-end probe check, relative to sum |x w| (summation order only).
_E2E_RTOL = 1e-9


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
class Gathered:
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


class GatheredMatcher:
    """gather(W, idx) + gather(S, idx) -> FP4 dequantise -> bmm/mm  =>  `dsv41::grouped_linear_fp4` (module
    docstring, "Gathered experts"). `run()` rewrites the graph and returns (matches, near-misses)."""

    def __init__(self, family: str, gm: fx.GraphModule, ev: RegionEvaluator, sourced: set, lookalikes: list,
                 gated=frozenset()):
        self.family = family
        self.gated = gated  # op variants left off on this device (`moe_combine(y_dtype)` is read here)
        self.gm = gm
        self.ev = ev
        self.sourced = sourced
        self.lookalikes = lookalikes  # (matmul, tensor, edge kind) of `act_quant_input`, for the report
        # Verdicts by region signature (one probe evaluation serves every layer with the same code and shapes)
        # and probe codes/scales by shape: at h200 size a probe is ~35 MB and its evaluation a few GB-seconds.
        self.verdicts: dict = {}
        self.probes: dict = {}

    def run(self) -> tuple[list, list]:
        """Find, verify and replace every gathered chain; returns (list of MatchRecord, list of NearMiss)."""
        graph = self.gm.graph
        leaves = leaf_sets(graph)
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
        """A `Gathered` for a chain that passes every check, else the `NearMiss` of the first failed check."""
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
        key = ("dequant",) + signature(collect_region([dq], [gc, gs]), (gc, gs))
        if key not in self.verdicts:
            self.verdicts[key] = self._verify_dequant(dq, gc, gs, codes_p, scale_p, kdim)
        ok, check, reason, dprobe = self.verdicts[key]
        if not ok:
            return miss(check, reason)

        q = _layout_top(a_node)
        near: list = []
        x = act_quant_input(q, kdim, self.ev, self.sourced, widen=True, lookalikes=near)
        self.lookalikes.extend((mm, d.name, kind) for d, kind in near)
        act_quant = x is not None
        x = x if act_quant else q
        xv = tensor_val(x)
        if (xv is None or (xv.dtype != dval.dtype and not (act_quant and widened(x, mm)))
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
        key = ("e2e", act_quant, shared, tokens, topk, wpos) + signature(
            collect_region([chain[-1]], [x, gc, gs]), (x, gc, gs))
        if key not in self.verdicts:
            self.verdicts[key] = self._verify_end_to_end(
                mm, wpos, chain, x, act_quant, shared, (gc, gs, dq), (codes_p, scale_p, dprobe),
                (tokens, topk, n_out, kdim))
        pos, check, reason = self.verdicts[key]
        if pos is None:
            return miss(check, reason)
        return Gathered(mm, chain[pos], x, act_quant, shared, stc, sts, ia, tokens, topk, experts, n_out, kdim)

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
        if close_exact(got, ref.reshape(got.shape)):
            for wide in wide_scale_probes(scale):
                g = self.ev.evaluate([dq], {gc: codes, gs: wide})[dq]
                r = formats.dequantize_fp4_1x32(codes, wide, g.dtype)
                if not agree_where_representable(g, r.reshape(g.shape)):
                    return False, "scale_range", SCALE_RANGE_REASON, None
            return True, "", "", got
        flat = Weight(dq, gc, gs, "fp4", ref.numel() // kdim, kdim, False)
        check, reason = diagnose_weight(flat, codes.reshape(-1, kdim // 2), scale.reshape(-1, kdim // 32),
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
    def _fuse(self, c: Gathered) -> MatchRecord:
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
        cast, tail = None, None
        if widened(c.x, mm):
            # The op computes in x's float32; one rounding to the matmul's dtype, as its FP32 accumulator had.
            y = cast = insert_node(graph, mm, torch.ops.prims.convert_element_type.default,
                                   (y, tensor_val(mm).dtype), like=mm)
        oshape = concrete_shape(tensor_val(c.out_node))
        if oshape != (c.tokens, c.topk, c.n):
            y = insert_node(graph, mm, aten.reshape.default, (y, list(oshape)), like=mm)
        c.out_node.replace_all_uses_with(y)
        if cast is not None:  # a tail fused before reads the rounded result: it can round it itself
            tail = round_in_tail(graph, cast, self.gated)

        region = [n for n in collect_region([c.out_node], [c.x, c.codes, c.scale, c.idx]) if n is not y]
        xsize, esize = tensor_val(c.x).element_size(), tensor_val(mm).element_size()
        ishape = concrete_shape(tensor_val(c.idx))
        rows, subs = token_rows(token_shape(c.idx)[:-1] if len(ishape) >= 2 else (c.tokens,))
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
             ("x_dtype", dtype_name(c.x))) + ((("tail_rounds_y", tail),) if tail else ()))
