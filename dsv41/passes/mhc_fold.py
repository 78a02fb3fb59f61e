"""`mhc_fold` family: an mHC expand and the coefficients computed from its result become one op.

Chain matched (post-grad ATen, after `mhc` has made its ops):

    H2 = dsv41::mhc_expand(y, H, post, comb)
    (pre, post2, comb2) = dsv41::mhc_mixes(H2, fn, base, scale, norm_eps, hc_eps, iters[, norm_weight])
        -> (H2, pre, post2, comb2) = dsv41::mhc_expand_mixes(y, H, post, comb, fn, base, scale, norm_eps, hc_eps,
                                                             iters[, norm_weight])

Where it fires: mHC code in the paper's order, where a site's coefficients are computed from the residual and its
pre weights collapse that residual at once (`collapse(H2, pre2)` right after `mixes(H2)`): there the mixes sit on
the critical path between two GEMVs, and folding removes a launch and its wait. Not in DeepSeek-V4.1's
single-pass order (dsv41/model/block.py) where the side-stream schedule is applied (CUDA graphs on CUDA): a layer
collapses with the pre weights of the site before, so each site's coefficients are first used by the expand after
the sublayer's GEMVs; the schedule runs those mixes on the side stream (the report's `schedule`), and folding
would move them back onto the critical path (near-miss `overlappable`). Without the schedule (CPU, `streams=False`,
no CUDA graph) every mixes runs on the main stream, and V4.1's fold there too (one per layer).

Why. The fused op is one launch instead of two, and the coefficients are reduced by the expand's own programs
from the values they have just written (`dsv41.kernels.mhc_fold`): issue 37 counts 80 `mhc_mixes` launches of
10.8 us in an `h200` decode step, each waiting for the expand before it reads a byte.

Conditions (proven from the graph alone): the mixes' H is the expand's result node itself (not a view or copy);
the mixes' other tensor inputs (fn, base, scale, norm_weight) are defined before the expand, so the fused op can
stand where the expand stood; every user of the mixes is a `getitem` of its tuple. The fused op's results are the
two ops' results (H2 bit for bit on CUDA, the coefficients to FP32 rounding as the mixes kernel's own: the
reduction is blocked differently), so no value check is needed beyond the `mhc` family's own.

Near-misses (reported, not fused), for an expand whose result is a mixes' H:

    operand_order   an fn / base / scale / norm_weight input is computed after the expand
    tuple_use       the mixes' tuple is used other than through getitem
    overlappable    (only where the side-stream schedule is applied: `streams`, on by default for CUDA graphs on
                    CUDA) a GEMV or another fused op that does not need the coefficients runs between the expand
                    and the coefficients' first use: the schedule (compiler/streams.py) can hide the mixes there,
                    and folding would put its reduction and Sinkhorn on the critical path instead

Bytes per match (sympy in B, L): the mixes' read of H2 (4d elements of H's dtype per token) is gone; the other
reads and writes are the same.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (Chain, FusionFamily, Role, concrete_shape, insert_node, node_label, ops_or_note, positions,
                     register_family, tensor_val, token_rows)

__all__ = ["MhcFoldFamily", "SPEC"]

aten = torch.ops.aten
_PATTERN = "mhc_expand -> mhc_mixes of its result"

#: The family as data (`dsv41 report --patterns`).
SPEC = register_family(
    "mhc_fold", "an mHC expand and the next site's coefficients of its result -> one op (one launch)", (
        Chain("expand_mixes", "mhc_expand_mixes", "dsv41::mhc_mixes whose H is the result of a dsv41::mhc_expand",
              (Role("y", "[B, T, d]"), Role("H", "[B, T, 4, d]"), Role("post, comb", "[B, T, 4], [B, T, 4, 4]",
                                                                         "fp32"),
               Role("fn, base, scale", "[24, 4d], [24], [3]", "fp32"), Role("norm_weight", "[4d] (optional)")),
              "dsv41.kernels.mhc_fold:reference_mhc_expand_mixes", (), (),
              ("operand_order", "tuple_use", "overlappable")),),
    # GPU-validated: its GPU tests passed on an H100, one launch 8.01 against 9.74 us for the two, `small` decode
    # +0.7 % where it folds (bench/results/2026-12-07_h100_s31).
    # order: after mhc, which makes the two ops it merges
    after=("mhc",),
)


class MhcFoldFamily(FusionFamily):
    """Merge `dsv41::mhc_expand` and the `dsv41::mhc_mixes` of its result into `dsv41::mhc_expand_mixes` (module
    docstring)."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Fuse every expand -> mixes pair of `gm` in place; returns the record (matches and near-misses)."""
        graph = gm.graph
        found, empty = ops_or_note(self.name, ("mhc_expand", "mhc_mixes", "mhc_expand_mixes"),
                                   "mhc_expand_mixes")
        if empty is not None:
            return empty
        expand_op, mixes_op, fused_op = found
        order = positions(graph)
        pairs, misses = [], []
        for e in [n for n in graph.nodes if n.op == "call_function" and n.target == expand_op]:
            # The first mixes of H2 in graph order that can fold does; one that cannot, before it, is a near-miss.
            mixes = sorted((u for u in e.users if u.target == mixes_op and u.args and u.args[0] is e),
                           key=order.__getitem__)
            for m in mixes:
                why = _mismatch(e, m, order, self.side_stream)
                if why is None:
                    pairs.append((e, m))
                    break
                misses.append(NearMiss(self.name, _PATTERN, why[0], why[1], SourceLocation.from_node(m)))
        matches = [self._fuse(graph, e, m, fused_op) for e, m in pairs]
        return PassRecord(self.name, True, tuple(matches), tuple(misses))

    def _fuse(self, graph: fx.Graph, e: fx.Node, m: fx.Node, fused_op) -> MatchRecord:
        y, H, post, comb = _expand_args(e)
        margs = _mixes_args(m)
        fused = insert_node(graph, e, fused_op, (y, H, post, comb, *margs[1:]), like=e)
        outs = [insert_node(graph, e, operator.getitem, (fused, i), like=e if i == 0 else m) for i in range(4)]
        hv = tensor_val(H)
        shp = [int(s) for s in concrete_shape(hv)]
        tokens, subs = token_rows(shp[:2])
        before = _expand_bytes((y, H, post, comb), tokens) + _mixes_bytes(margs, tokens)
        after = before - tokens * 4 * shp[3] * hv.element_size()  # the mixes' read of H2
        loc_m = SourceLocation.from_node(m)
        record = MatchRecord(
            self.name, "mhc_expand_mixes" + ("(norm_weight)" if len(margs) == 8 else ""), "dsv41::mhc_expand_mixes",
            SourceLocation.from_node(e), (e.name, m.name), (node_label(e), node_label(m)), str(sympy.expand(before)),
            str(sympy.expand(after)), tuple(sorted(subs.items())),
            (("d", shp[3]), ("iters", margs[6]), ("mixes", loc_m.short() if loc_m else None)))
        e.replace_all_uses_with(outs[0])
        for u in list(m.users):
            u.replace_all_uses_with(outs[1 + u.args[1]])
            graph.erase_node(u)
        graph.erase_node(m)
        graph.erase_node(e)
        return record


def _expand_args(n: fx.Node) -> tuple:
    names = ("y", "H", "post", "comb")
    return tuple(list(n.args) + [n.kwargs[k] for k in names[len(n.args):]])


def _mixes_args(n: fx.Node) -> tuple:
    """(H, fn, base, scale, norm_eps, hc_eps, iters[, norm_weight]) of a mixes node, keywords included; the
    weight only when it is given (not None)."""
    names = ("H", "fn", "base", "scale", "norm_eps", "hc_eps", "iters", "norm_weight")
    vals = list(n.args) + [n.kwargs[k] for k in names[len(n.args):] if k in n.kwargs]
    return tuple(vals[:7]) + ((vals[7],) if len(vals) > 7 and vals[7] is not None else ())


def _mismatch(e: fx.Node, m: fx.Node, order: dict, side_stream: bool):
    """None when `m` (a mixes of `e`'s result) can fold into `e`, else (check, reason); `side_stream`: whether the
    stream schedule is applied (only then can the mixes overlap other work)."""
    late = [a.name for a in m.all_input_nodes if a is not e and order[a] > order[e]]
    if late:
        return ("operand_order", f"{late} are computed after the expand ({e.name}); the fused op would have to wait "
                                 "for them")
    odd = [u.name for u in m.users if u.target is not operator.getitem or not isinstance(u.args[1], int)]
    if odd:
        return ("tuple_use", f"the coefficients' tuple is used whole by {odd}, not through getitem")
    uses = [c for g in m.users for c in g.users]
    if not side_stream or not uses:  # without the schedule the mixes run on the main stream anyway
        return None
    first = min(uses, key=order.__getitem__)
    heavy = [n.name for n in _between(e, first, order) if n is not m and _is_heavy(n)]
    if heavy:
        return ("overlappable", f"the coefficients are first used by {first.name}, after {len(heavy)} independent "
                                f"GEMV / fused op(s) ({', '.join(heavy[:3])}{', ...' if len(heavy) > 3 else ''}): "
                                "the stream schedule can run them beside that work, where the fused op would put "
                                "them on the expand's critical path")
    return None


#: aten matmuls: work a side-stream op can overlap (besides any dsv41 op).
_MATMULS = frozenset({aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten._scaled_mm})


def _is_heavy(n: fx.Node) -> bool:
    """A kernel worth overlapping: a dsv41 op or an aten matmul."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    return n.target.namespace == "dsv41" or n.target.overloadpacket in _MATMULS


def _between(a: fx.Node, b: fx.Node, order: dict) -> list:
    """Nodes strictly between `a` and `b` in graph order."""
    lo, hi = order[a], order[b]
    return [n for n, i in order.items() if lo < i < hi]


def _nbytes(node, tokens: sympy.Expr, per_token: bool) -> sympy.Expr:
    v = tensor_val(node)
    if v is None:
        return sympy.Integer(0)
    shp = [int(s) for s in concrete_shape(v)]
    n = 1
    for s in (shp[2:] if per_token else shp):
        n *= s
    return (tokens * n if per_token else sympy.Integer(n)) * v.element_size()


def _expand_bytes(args: tuple, tokens: sympy.Expr) -> sympy.Expr:
    """Reads of y, H, post, comb (`args`) and the write of H2 (H's size), per token."""
    y, H, post, comb = args
    return sum((_nbytes(a, tokens, True) for a in (y, H, post, comb, H)), sympy.Integer(0))


def _mixes_bytes(margs: tuple, tokens: sympy.Expr) -> sympy.Expr:
    """Reads of H2 (per token) and of the parameters (once), writes of the 24 coefficients per token."""
    params = [a for a in (margs[1], margs[2], margs[3], *margs[7:]) if isinstance(a, fx.Node)]
    return (_nbytes(margs[0], tokens, True) + sum((_nbytes(a, tokens, False) for a in params), sympy.Integer(0))
            + tokens * 24 * 4)
