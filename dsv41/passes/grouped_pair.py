"""`grouped_pair` family: two grouped FP4 expert GEMVs of one activation and one expert selection become one op,
so that the activation is FP8-quantised once for both.

Chain matched (post-grad ATen, after `dispatch` has made the grouped GEMVs):

    y_a = dsv41::grouped_linear_fp4(x, W_a, S_a, idx, True)
    y_b = dsv41::grouped_linear_fp4(x, W_b, S_b, idx, True)
        -> (y_a, y_b) = dsv41::grouped_linear_fp4_pair(x, W_a, S_a, W_b, S_b, idx, True)

In dsv41/model this is the routed experts' w1 and w3 (`RoutedExperts.forward_gather`: `silu(x W1) * (x W3)` over
the k selected experts), once per MoE layer; any code whose dispatch result has two such GEMVs matches.

Why. With act_quant, each word-decode launch of `dsv41::grouped_linear_fp4` first quantises x in its own launch
(`grouped_words.prepare_x`): 80 of the 1,811 launches of an `h200` decode step, 3.7 us each
(bench/results/2026-12-02_h200_s20). The pair op quantises once and runs both GEMVs on that copy
(`grouped_gemv.triton_grouped_linear_fp4_pair`), where both take the word-decode kernel; otherwise it makes the two
calls it replaces. Its results are those of the two ops, bit for bit: the preparation is a pure function of x and
both GEMVs keep their own plan. Measured on the H200 (same lease, bench/results/2026-12-02_h200_s20): `h200` decode
98.69 against 97.82 tok/s without this family, 1,771 against 1,811 launches per step.

Conditions (proven from the graph alone): the two ops read the same x node and the same indices node, both with
act_quant=True, and weights of one shape and dtype (fake values); every input of the later op is defined before
the earlier op, so the pair can stand where the earlier one stood (the later op cannot depend on the earlier's
result). Ops are paired in graph order, each at most once (a third op with the same inputs pairs with a fourth).

Near-misses (reported, not fused), for two ops with the same x and indices nodes:

    act_quant         one of them quantises x and the other does not, or neither does (nothing to share)
    weight_shape      their weights differ in shape or dtype (one plan, one launch shape each)
    operand_order     an input of the later op is computed after the earlier op

Bytes per match (sympy in B): the activation preparation each op runs, read x (its dtype) + write the FP32 copy;
before twice, after once, where the word-decode kernel takes both launches by the compiled dtype and size
(`detail["shares_act_quant"]`; 0 and 0 otherwise: below `grouped_gemv.WORDS_MIN_CODES_ACT_QUANT` codes, e.g. the
`small` and `tiny` presets, or for fp16 x, both GEMVs quantise inside the tile kernel and the op saves nothing). The
weights and outputs do not change.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from .records import MatchRecord, SourceLocation
from .engine import (Chain, HorizontalFamily, Role, concrete_shape, insert_node, node_label, register_family,
                     tensor_val, token_rows)

__all__ = ["GroupedPairFamily", "SPEC"]

_PATTERN = "grouped_linear_fp4 x2 (same x, same experts)"


def _grouped_nodes(graph: fx.Graph, op) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target == op]


def _args(node: fx.Node):
    """(x, W, S, idx, act_quant) of a grouped_linear_fp4 node, keyword arguments included."""
    names = ("x", "weight", "scale", "indices", "act_quant")
    vals = list(node.args) + [node.kwargs[k] for k in names[len(node.args):]]
    return tuple(vals)


def _weight_key(w) -> tuple:
    v = tensor_val(w)
    return (concrete_shape(v), v.dtype) if v is not None else (None, None)


#: The family as data (`dsv41 report --patterns`).
SPEC = register_family(
    "grouped_pair", "two grouped FP4 expert GEMVs of the same activation and experts (MoE w1 / w3) -> one op that "
    "quantises the activation once", (
    Chain("pair", "grouped_linear_fp4_pair", "two dsv41::grouped_linear_fp4 with act_quant of one x and one "
          "indices tensor", (Role("x", "[E, M, K]"), Role("w1 / w3 codes, scales", "[experts, N, K/2], [.., K/32]",
                                                         "uint8"), Role("ids", "[..]", "int")),
          "dsv41.kernels.grouped_gemv (the op pair)", (), (), ("act_quant", "operand_order", "weight_shape")),),
    # order: after dispatch, which makes the grouped GEMVs it pairs
    after=("dispatch",),
)


class GroupedPairFamily(HorizontalFamily):
    """Fuse two `dsv41::grouped_linear_fp4` of one x and one indices tensor, both with act_quant, into
    `dsv41::grouped_linear_fp4_pair` (module docstring)."""

    spec = SPEC
    single_op, miss_pattern = "grouped_linear_fp4", _PATTERN

    def members(self, graph: fx.Graph, single) -> dict:
        """The grouped GEMVs by (x, indices)."""
        by_inputs: dict = {}
        for n in _grouped_nodes(graph, single):
            x, _, _, idx, _ = _args(n)
            by_inputs.setdefault((x, idx), []).append(n)
        return by_inputs

    def most(self) -> int:
        """A pair."""
        return 2

    @staticmethod
    def mismatch(first: fx.Node, later: fx.Node, order: dict) -> tuple[str, str] | None:
        """None when `later` can join `first` in a pair, else (check, reason)."""
        _, wa, _, _, qa = _args(first)
        _, wb, _, _, qb = _args(later)
        if qa is not True or qb is not True:
            return ("act_quant", f"act_quant is {qa} / {qb}: only two GEMVs that both quantise x share the "
                                 "quantisation")
        if _weight_key(wa) != _weight_key(wb):
            return ("weight_shape", f"weights {_weight_key(wa)} and {_weight_key(wb)} differ; the pair runs one "
                                    "plan for both")
        late = [a.name for a in later.all_input_nodes if order[a] > order[first]]
        if late:
            return ("operand_order", f"{late} are computed after the first GEMV ({first.name}); the pair would "
                                     "have to wait for them")
        return None

    def fuse(self, graph: fx.Graph, group: list, pair_op) -> MatchRecord:
        """Replace the pair `group` by one `grouped_linear_fp4_pair` and two getitems; returns the match."""
        a, b = group
        x, wa, sa, idx, _ = _args(a)
        _, wb, sb, _, _ = _args(b)
        pair = insert_node(graph, a, pair_op, (x, wa, sa, wb, sb, idx, True), like=a)
        ya = insert_node(graph, a, operator.getitem, (pair, 0), like=a)
        yb = insert_node(graph, a, operator.getitem, (pair, 1), like=b)
        a.replace_all_uses_with(ya)
        b.replace_all_uses_with(yb)
        graph.erase_node(b)
        graph.erase_node(a)

        xv, wv = tensor_val(x), tensor_val(wa)
        kk = int(concrete_shape(xv)[-1])
        e, out = (int(v) for v in concrete_shape(wv)[:2])
        n_tok, topk = (int(v) for v in concrete_shape(tensor_val(idx)))
        tokens, subs = token_rows((n_tok,))  # rows of x: one per token, or one per (token, expert)
        rows = tokens * (topk if xv.dim() == 3 else 1)
        # The shared preparation exists only where both launches take the word-decode kernel on CUDA: by the
        # shapes and dtypes known here (the layout is checked at run time); otherwise the op makes the two calls.
        shares = _shares_preparation(xv.dtype, n_tok * topk, out, kk)
        prep = rows * kk * (xv.element_size() + 4) if shares else sympy.Integer(0)  # read x, write the FP32 copy
        loc_b = SourceLocation.from_node(b)
        return MatchRecord(
            self.name, "grouped_linear_fp4_pair(act_quant=True)", "dsv41::grouped_linear_fp4_pair",
            SourceLocation.from_node(a), (a.name, b.name), (node_label(a), node_label(b)),
            str(sympy.expand(2 * prep)), str(sympy.expand(prep)), tuple(sorted(subs.items())),
            (("K", kk), ("out", out), ("experts", e), ("shares_act_quant", shares),
             ("second", loc_b.short() if loc_b else None)))


def _shares_preparation(dtype: torch.dtype, pairs: int, out: int, k: int) -> bool:
    """Whether the pair's CUDA launches quantise x once instead of twice, by dtype and size
    (`grouped_gemv.frag_by_default_for` or `words_by_default_for`; the layout is checked at run time, on the real
    tensors)."""
    from dsv41.kernels import grouped_gemv as gg
    return not gg.MMA_WORDS_DEFAULT and (gg.words_by_default_for(dtype, True, pairs, out, k)
                                         or gg.frag_by_default_for(dtype, True, pairs, out, k))
