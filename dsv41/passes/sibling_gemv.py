"""`sibling_gemv` family: block-FP8 GEMVs that read the same activation become one op, launched as one kernel at
decode (horizontal fusion, as a kernel team merges q / kv or gate / up projections by hand).

Chain matched (post-grad ATen, after `dispatch` has made the GEMVs):

    y_0 = dsv41::linear_fp8_block(x, W_0, S_0, aq)
    y_1 = dsv41::linear_fp8_block(x, W_1, S_1, aq)          (up to MAX_SIBLINGS of them)
        -> [y_0, y_1, ...] = dsv41::linear_fp8_block_multi(x, [W_0, W_1, ...], [S_0, S_1, ...], aq)

In dsv41/model: the attention's `wq_a(x)` and `wkv(x)`, and the shared expert's `w1(x)` and `w3(x)`, once per layer;
any code whose dispatch result has several block-FP8 GEMVs of one x node matches (e.g. separate q / k / v
projections).

Why. At decode each of those GEMVs is one short launch, and a short launch spends much of its time on ramp and tail
(a launch that waits for its predecessor reads 6.6 MB at 42-44 % and 11.8 MB at 54-56 % of copy bandwidth,
bench/results/2026-12-02_h200_s23/read_ceiling.json). `gemv_multi.triton_linear_fp8_block_multi` runs them as one
grid (measured on the H200: shared w1 + w3 16.28 -> 14.02 us, wq_a + wkv 9.55 -> 6.97 us,
bench/results/2026-12-02_h200_s23/sibling_probe.json). Its results equal the separate ops' up to FP32 summation
order (bit for bit where the one plan equals each op's own, as at the `h200` shapes); with several x rows, or a
weight large enough for the TMA kernel, it makes the separate calls.

Conditions (proven from the graph alone): the ops read the same x (one node, or views of one node with the same
sizes) with the same act_quant; each weight is a 2-D uint8 tensor, below `quant_gemv.TMA_MIN_WEIGHT_BYTES_M1` bytes
unless the ops quantise a bf16 / fp32 x (act_quant), which the op runs on the fragment GEMV of `gemv_frag` over
every weight (fake values: otherwise a larger weight runs faster alone on the TMA kernel, so it stays alone); the
weights and scales of a
later op are defined before the group's first op, so the group can stand where the first one stood (with the first
op's x). Groups are formed in graph order, at most MAX_SIBLINGS ops each.

Near-misses (reported, not fused), for ops of one x node:

    act_quant         they differ in act_quant (one quantises x and the other not)
    tma_weight        the weight has >= TMA_MIN_WEIGHT_BYTES_M1 bytes and the GEMV is not act_quant on bf16 / fp32
                      x: it keeps its own TMA launch
    operand_order     an input of the later op is computed after the group's first op

Bytes per match (sympy in B, L): the activation rows each GEMV reads, x's dtype; before once per op, after once
(the weights, scales and outputs do not change). `detail["launches_saved"]` is ops - 1 at one x row.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from .records import MatchRecord, SourceLocation
from .engine import (Chain, HorizontalFamily, Role, concrete_shape, insert_node, node_label, register_family,
                     tensor_val, token_rows)

__all__ = ["SiblingGemvFamily", "SPEC"]

_PATTERN = "linear_fp8_block x{n} (same x)"


_VIEWS = ("view.default", "reshape.default", "_unsafe_view.default")


def _x_key(x):
    """A key equal for x nodes that are the same tensor: a node, or a view / reshape (`aten.view`, `reshape`,
    `_unsafe_view`) of one with the same target and sizes (each F.linear of one 3-D x flattens it in its own node)."""
    if isinstance(x, fx.Node) and x.op == "call_function" and any(str(x.target).endswith(v) for v in _VIEWS):
        return (str(x.target), _x_key(x.args[0]), tuple(str(a) for a in x.args[1:]), tuple(sorted(x.kwargs.items())))
    return x


def _args(node: fx.Node):
    """(x, W, S, act_quant) of a linear_fp8_block node, keyword arguments included."""
    names = ("x", "weight", "scale", "act_quant")
    return tuple(list(node.args[:4]) + [node.kwargs[k] for k in names[len(node.args):]])


def _norm_mode(node: fx.Node) -> int:
    """The RMSNorm prologue mode of a linear_fp8_block node (0: none; `dispatch` sets it). Such a GEMV reads the
    norm's input, not x, and `linear_fp8_block_multi` has no prologue: it is left alone."""
    return node.args[6] if len(node.args) > 6 else node.kwargs.get("norm_mode", 0)


#: The family as data (`dsv41 report --patterns`).
SPEC = register_family(
    "sibling_gemv", "block-FP8 GEMVs of the same activation (q / kv down-projections, gate / up) -> one op, one "
    "launch at decode", (
    Chain("siblings", "linear_fp8_block_multi", "2 to MAX_SIBLINGS dsv41::linear_fp8_block of one x node",
          (Role("x", "[M, K]"), Role("codes, scales (each)", "[N_i, K], [N_i/32, K/32]", "uint8")),
          "dsv41.kernels (the op group)", (), (), ("act_quant", "operand_order", "tma_weight")),),
    # order: after dispatch, which makes the GEMVs; last, so no family sees its op
    after=("dispatch", "grouped_pair"),
)


class SiblingGemvFamily(HorizontalFamily):
    """Fuse 2 to `gemv_multi.MAX_SIBLINGS` `dsv41::linear_fp8_block` of one x node into
    `dsv41::linear_fp8_block_multi` (module docstring)."""

    spec = SPEC
    single_op, miss_pattern = "linear_fp8_block", _PATTERN.format(n="N")

    def members(self, graph: fx.Graph, single) -> dict:
        """The block-FP8 GEMVs by activation (`_x_key`)."""
        by_x: dict = {}
        for n in graph.nodes:
            if n.op == "call_function" and n.target == single and not _norm_mode(n):
                by_x.setdefault(_x_key(_args(n)[0]), []).append(n)
        return by_x

    def most(self) -> int:
        """`gemv_multi.MAX_SIBLINGS`."""
        from dsv41.kernels.gemv_multi import MAX_SIBLINGS
        return MAX_SIBLINGS

    @staticmethod
    def admit(node: fx.Node) -> tuple[str, str] | None:
        """None, or (`tma_weight`, reason) for a weight that runs faster alone on the TMA GEMV."""
        from dsv41.kernels.quant_gemv import TMA_MIN_WEIGHT_BYTES_M1
        x, weight, _, aq = _args(node)
        w = tensor_val(weight)
        shape = concrete_shape(w) if w is not None else None
        if shape is None or len(shape) != 2:
            return ("tma_weight", f"weight shape {shape} is not a static 2-D shape")
        nbytes = int(shape[0]) * int(shape[1]) * w.element_size()
        xv = tensor_val(x)
        # act_quant on bf16 / fp32 x: the op runs every weight on the fragment GEMV (one launch), large ones too.
        frag = aq is True and xv is not None and xv.dtype in (torch.bfloat16, torch.float32)
        if nbytes >= TMA_MIN_WEIGHT_BYTES_M1 and not frag:
            return ("tma_weight", f"weight [{shape[0]}, {shape[1]}] has {nbytes} bytes (>= {TMA_MIN_WEIGHT_BYTES_M1}) "
                                  "and the GEMV is not act_quant on bf16 / fp32 x: it runs faster alone on the TMA "
                                  "GEMV")
        return None

    @staticmethod
    def mismatch(first: fx.Node, later: fx.Node, order: dict) -> tuple[str, str] | None:
        """None when `later` can join the group that `first` starts, else (check, reason)."""
        qa, qb = _args(first)[3], _args(later)[3]
        if qa != qb:
            return ("act_quant", f"act_quant is {qa} / {qb}: one launch quantises x one way")
        # x is the first op's (the same tensor: `_x_key`); the weight and scale must exist before it (keyword
        # arguments included: `_args`).
        late = [a.name for a in _args(later)[1:3] if isinstance(a, fx.Node) and order[a] > order[first]]
        if late:
            return ("operand_order", f"{late} are computed after the first GEMV ({first.name}); the group would "
                                     "have to wait for them")
        return None

    def fuse(self, graph: fx.Graph, group: list[fx.Node], multi) -> MatchRecord:
        """Replace `group` by one `linear_fp8_block_multi` and a getitem per member; returns the match."""
        first = group[0]
        x, _, _, aq = _args(first)
        ws = [_args(n)[1] for n in group]
        ss = [_args(n)[2] for n in group]
        node = insert_node(graph, first, multi, (x, ws, ss, aq), like=first)
        for i, n in enumerate(group):
            y = insert_node(graph, first, operator.getitem, (node, i), like=n)
            n.replace_all_uses_with(y)
        for n in group:
            graph.erase_node(n)

        xv = tensor_val(x)
        shape = concrete_shape(xv)
        kk = int(shape[-1])
        rows, subs = token_rows(shape[:-1])
        x_bytes = rows * kk * xv.element_size()
        widths = [int(concrete_shape(tensor_val(w))[0]) for w in ws]
        others = [SourceLocation.from_node(n) for n in group[1:]]
        return MatchRecord(
            self.name, _PATTERN.format(n=len(group)) + f"(act_quant={aq})", "dsv41::linear_fp8_block_multi",
            SourceLocation.from_node(first), tuple(n.name for n in group), tuple(node_label(n) for n in group),
            str(sympy.expand(len(group) * x_bytes)), str(sympy.expand(x_bytes)), tuple(sorted(subs.items())),
            (("K", kk), ("N", tuple(widths)), ("act_quant", aq), ("launches_saved", len(group) - 1),
             ("others", tuple(loc.short() if loc else None for loc in others))))
