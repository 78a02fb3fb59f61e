"""Structure of the sparse-attention chain (family `sparse_attention`, sparse_attention.py): the bank gathers, the
forward walk to the site's end, the selection / window / sink leaves, the reshapes the op reads and the near-miss
order."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from .engine import (concrete_shape, dtype_of, is_dataflow_op, is_step, is_view_op, positions, shape_of, tensor_val,
                     walk_inputs)
from .rope_match import rope_structure

__all__ = ["MATMULS", "FORWARD_LIMIT", "REGION_LIMIT", "SEL_STEPS", "FLOAT_LITERAL_MAX", "PRIORITY", "gather_pairs",
           "forward_within", "bank_tensor", "same_shape_base", "sel_candidates", "derived_from", "Leaves", "discover",
           "to_bts", "candidate_scales", "attention_close", "why_no_end", "module_path", "window_ends"]

aten = torch.ops.aten
MATMULS = {aten.bmm.default, aten.mm.default}
FORWARD_LIMIT = 1500    # nodes walked forward from the bank gathers looking for the end of the site
REGION_LIMIT = 1200     # nodes of one site's region (the model's decode site is ~170)
SEL_STEPS = 8           # nodes between the index tensor and a validity mask derived from it
FLOAT_LITERAL_MAX = 64  # softmax-scale candidates taken from the region's literals


def _walkable(n: fx.Node) -> bool:
    """A node the site's walks pass through: a region step or a matmul."""
    return is_step(n, MATMULS)


def gather_pairs(graph: fx.Graph):
    """(codes gather, scales gather) pairs: `index(src, [b, rows])` of 3-D uint8 sources [B, N, W] sharing the
    index nodes, outputs [B, T, K, W]; codes are the wider one, W_codes * 2 divisible by W_scales."""
    groups: dict = {}
    for n in graph.nodes:
        if n.op != "call_function" or n.target != aten.index.Tensor:
            continue
        src, idx = n.args[0], n.args[1]
        if dtype_of(src) != torch.uint8 or len(shape_of(src) or ()) != 3 or len(shape_of(n) or ()) != 4:
            continue
        if len(idx) != 2 or any(not isinstance(i, fx.Node) for i in idx):
            continue
        groups.setdefault(tuple(idx), []).append(n)
    for gathers in groups.values():
        for a, b in itertools.permutations(gathers, 2):
            wc, ws = shape_of(a)[-1], shape_of(b)[-1]
            if wc > ws and (2 * wc) % ws == 0 and shape_of(a)[:3] == shape_of(b)[:3]:
                yield a, b


def forward_within(starts, limit: int, stop_pos: int | None = None, pos: dict | None = None) -> list:
    """Nodes reachable from `starts` through walkable ops except 2-D `mm` (graph order is not guaranteed), at
    most `limit`. The attention's products are batched (`bmm`); stopping at `mm` (the output projection) keeps
    the walk inside the layer, so the next layer's q never counts as computed from this layer's bank."""
    seen, out, stack = set(starts), [], list(starts)
    while stack and len(out) < limit:
        n = stack.pop()
        for u in n.users:
            if u in seen or not _walkable(u) or u.target == aten.mm.default:
                continue
            if stop_pos is not None and pos[u] > stop_pos:
                continue
            seen.add(u)
            out.append(u)
            stack.append(u)
    return out


def window_ends(graph: fx.Graph, sourced: set, banked: set) -> tuple:
    """(computed, [(end, x, (trig, trig)), ...] in graph order): the inverse-RoPE-like [B, T, H, D] float nodes
    computed from a 3-D uint8 tensor whose last dim is a multiple of 32 (FP8 window codes [B, S, D]), outside
    `banked` (nodes computed from a bank gather); x is the rotated tensor, also computed from the codes;
    `computed` the set of nodes computed from such codes (what the region walk passes through rather than taking
    as a leaf). The candidates of a window-only attention site (an SWA layer), verified by the caller."""
    starts = [n for n in graph.nodes if n in sourced and n not in banked and dtype_of(n) == torch.uint8
              and len(shape_of(n) or ()) == 3 and shape_of(n)[-1] % 32 == 0 and shape_of(n)[-1] > 0]
    if not starts:
        return set(), []
    fwd = forward_within(starts, FORWARD_LIMIT * len(starts))
    computed = set(fwd)
    pos = positions(graph)
    ends = []
    for e in sorted(fwd, key=pos.__getitem__):
        shp = shape_of(e)
        if e in banked or len(shp or ()) != 4 or not dtype_of(e).is_floating_point or shp[3] % 32:
            continue
        found = rope_structure(e, sourced)
        if found is not None and found[1] in computed and len(found[2]) == 2:
            ends.append((e, found[1], tuple(found[2])))
    return computed, ends


def bank_tensor(gc, gs, pos):
    """The dequantised bank [B, T, K, D]: the first float node computed from both gathers, then through views."""
    from_c = set(forward_within([gc], FORWARD_LIMIT))
    from_s = set(forward_within([gs], FORWARD_LIMIT))
    b, t, k, wc = shape_of(gc)
    want = (b, t, k, 2 * wc)
    both = sorted((n for n in from_c & from_s if dtype_of(n) is not None and dtype_of(n).is_floating_point),
                  key=pos.__getitem__)
    if not both:
        return None
    n = both[0]
    seen = 0
    while shape_of(n) != want and seen < 6:
        views = [u for u in n.users if is_view_op(u)]
        if len(views) != 1:
            return None
        n, seen = views[0], seen + 1
    return n if shape_of(n) == want else None


def same_shape_base(n: fx.Node) -> fx.Node:
    """The tensor `n` is a same-shape view of (matmul broadcasting expands q to its own shape), else `n`."""
    while (is_view_op(n) and isinstance(n.args[0], fx.Node) and dtype_of(n.args[0]) == dtype_of(n)
           and shape_of(n.args[0]) == shape_of(n)):
        n = n.args[0]
    return n


def sel_candidates(rows: fx.Node, sourced: set) -> list:
    """Int tensors of the row index's shape it is computed from (itself first), through pointwise / view ops
    with one non-constant int input (`where(idx < 0, 0, idx)`, `clamp(idx, min=0)`)."""
    shape = shape_of(rows)
    out, n = [], rows
    for _ in range(SEL_STEPS):
        if dtype_of(n) not in (torch.int64, torch.int32) or shape_of(n) != shape:
            break
        out.append(n)
        ins = [a for a in n.all_input_nodes if dtype_of(a) in (torch.int64, torch.int32) and a in sourced]
        if n.op != "call_function" or len(ins) != 1 or not is_dataflow_op(n):
            break
        n = ins[0]
    return out


def derived_from(n: fx.Node, target: fx.Node, steps: int) -> bool:
    """Whether `n` is computed from `target` within `steps` dataflow nodes."""
    frontier, seen = [n], set()
    for _ in range(steps):
        nxt = []
        for m in frontier:
            if m is target:
                return True
            if m in seen or m.op != "call_function":
                continue
            seen.add(m)
            nxt.extend(m.all_input_nodes)
        frontier = nxt
    return any(m is target for m in frontier)


@dataclass
class Leaves:
    """The tensors an attention region reads, by role: q candidates, bank codes, bank scales, masks, parameters."""

    q: list
    codes: list
    scales: list
    masks: list
    params: list


def discover(x: fx.Node, stops: set, dep: set, sel: fx.Node, sourced: set, d: int, bth: tuple):
    """Classify what the attention region (walked back from the pre-RoPE output `x`) reads; None if it reads
    something no role explains (a matmul output, a non-dataflow op, another graph input)."""
    leaves = Leaves([], [], [], [], [])

    def step(n, seen):
        """Classify the inputs of `n`: leaves by role, dependent or walkable ones to walk next (None: unexplained)."""
        nxt = []
        for a in n.all_input_nodes:
            if a in seen or a in stops:
                continue
            v = tensor_val(a)
            if a.op == "get_attr" and a not in sourced:
                seen.add(a)  # a small lifted constant: the evaluator reads it from the module
                continue
            if v is None or a not in sourced or a in dep:
                if not (_walkable(a) or v is None):
                    return None
                nxt.append(a)
                continue
            shp = concrete_shape(v)
            if v.dtype == torch.uint8:
                (leaves.codes if shp[-1] == d else leaves.scales).append(a)
            elif v.dtype == torch.bool and not derived_from(a, sel, SEL_STEPS):
                leaves.masks.append(same_shape_base(a))
            elif v.is_floating_point() and len(shp) == 4 and shp[:3] == bth and shp[3] == d:
                leaves.q.append(same_shape_base(a))
            elif a.op in ("placeholder", "get_attr") and v.is_floating_point():
                leaves.params.append(a)
            elif _walkable(a):
                nxt.append(a)
                continue
            else:
                return None
            seen.add(a)  # a leaf: never walked through
        return nxt

    if walk_inputs(x, REGION_LIMIT, step) is None:
        return None
    for lst in (leaves.q, leaves.codes, leaves.scales, leaves.masks, leaves.params):
        lst[:] = list(dict.fromkeys(lst))
    return leaves


def to_bts(val: torch.Tensor, b: int, t: int, last: int):
    """A mask / trig value as the op's [B, T, last] (a broadcast head axis of size 1 dropped), or None."""
    if val.dim() == 4:
        if val.shape[2] != 1:
            return None
        val = val[:, :, 0]
    try:
        return val.expand(b, t, last)
    except RuntimeError:
        return None


def candidate_scales(region_nodes, d: int) -> list:
    """Softmax-scale candidates: 1/sqrt(d), then the region's finite float literals and their reciprocals."""
    vals = [d ** -0.5]

    def visit(a):
        """Remember finite float literals and their reciprocals (softmax-scale candidates)."""
        if isinstance(a, float) and math.isfinite(a) and a not in (0.0, 1.0, -1.0) and len(vals) < FLOAT_LITERAL_MAX:
            for c in (a, 1.0 / a):
                if c > 0 and c not in vals:
                    vals.append(c)
        return a

    for n in region_nodes:
        fx.node.map_aggregate(n.args, visit)
    return vals


def attention_close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Same shape and dtype, finite, and within max(2 eps, 2e-5) of |ref| + 5 % of max |ref| elementwise."""
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    g, r = got.double().cpu(), ref.double().cpu()
    if not bool(torch.isfinite(g).all()) or not bool(torch.isfinite(r).all()):
        return False
    rtol = max(2 * torch.finfo(ref.dtype).eps, 2e-5)
    return bool(((g - r).abs() <= rtol * (r.abs() + r.abs().max() * 0.05)).all())


def why_no_end(fwd: list, fwd_set: set, ends: list, sourced: set) -> str:
    """What the search for the site's end saw, for the near-miss text: how far the forward walk got, the ops that
    stopped it, and why each [B, T, H, D] candidate is not an inverse RoPE of a tensor computed from the bank (so a
    graph spelled differently, e.g. by another device's rewrites, can be diagnosed from the report alone)."""
    blocked: dict = {}
    for n in fwd:
        for u in n.users:
            if u not in fwd_set and u.op == "call_function":
                name = str(getattr(u.target, "__name__", u.target))
                blocked[name] = blocked.get(name, 0) + 1
    parts = [f"walked {len(fwd)} nodes (limit {FORWARD_LIMIT})",
             "stopped at " + (", ".join(f"{k} x{v}" for k, v in sorted(blocked.items(), key=lambda kv: -kv[1])[:6])
                              or "nothing")]
    for e in ends[-3:]:
        found = rope_structure(e, sourced)
        if found is None:
            why = "not RoPE-like"
        elif found[1] not in fwd_set:
            why = f"rotates {found[1].name}, not computed from the bank"
        else:
            why = f"{len(found[2])} trig inputs"
        parts.append(f"{e.name} {tuple(shape_of(e))}: {why}")
    if not ends:
        parts.append("no [B, T, H, D] float tensor computed from the bank")
    return "; ".join(parts)


PRIORITY = ("attention_sink", "inverse_rope", "intermediate_used", "window_layout", "attention_values")


def module_path(n: fx.Node) -> str:
    """The innermost module path of the node (report only; matching never reads names)."""
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    last = list(stack.values())[-1]
    return str(last[0]) if isinstance(last, tuple) else str(last)
