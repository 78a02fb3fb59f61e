"""Structure of the MoE tail chain (family `moe`, moe.py): the k reduction anchor, the router it follows, the cut
search of its inputs (y, shared, optional w), the reshapes the op needs and the all-reduce after it."""

from __future__ import annotations

from collections import deque

import torch
import torch.fx as fx

from .engine import (Site, backward_distances, call_arg, closed_region, cut_search, dsv41_op,
                     exact_cast, insert_node, is_float, is_reshape, is_step, is_view_op, ranked, shape_of, tensor_val)

__all__ = ["TAIL_PATTERN", "ROUND_Y", "rounded_source", "round_in_tail", "k_reduction", "numel", "router_ks",
           "unfuse_addmm", "strip_upcasts", "fits", "tail_cuts",
           "tail_ends", "reshapes_static", "canonical", "all_reduce_after", "tail_site"]

aten = torch.ops.aten
prims = torch.ops.prims
_TAIL_FORWARD = 8       # nodes walked forward from a k-reduction to the end of the tail
_CUT_REGION = 48        # nodes searched back from the end of a tail for the op's inputs
_PER_ROLE = 4           # candidates tried per input of a tail
_ROUTER_DEPTH = 40      # ops between a router's output and the expert outputs y
#: The pattern name of tail near-misses.
TAIL_PATTERN = "moe tail (sum of routed experts + shared expert)"


def k_reduction(n: fx.Node):
    """(kind, y_in, rows, k, d) when `n` reduces a [.., k, d] tensor over k (rows = tokens), else None."""
    if n.op != "call_function":
        return None
    if n.target in (aten.sum.dim_IntList, aten.mean.dim):
        src = n.args[0]
        dims = call_arg(n, 1, "dim", None)
        if (not is_float(src) or not isinstance(dims, (list, tuple)) or len(dims) != 1
                or call_arg(n, 2, "keepdim", False)):
            return None
        shp = shape_of(src)
        if len(shp) < 3 or dims[0] not in (-2, len(shp) - 2):
            return None
        return "mean" if n.target == aten.mean.dim else "sum", src, numel(shp[:-2]), shp[-2], shp[-1]
    if n.target == aten.bmm.default:
        a, b = shape_of(n.args[0]), shape_of(n.args[1])
        if a is None or b is None or len(a) != 3 or a[1] != 1 or a[2] != b[1] or not is_float(n):
            return None
        return "bmm", n.args[1], b[0], b[1], b[2]
    return None


def numel(shape) -> int:
    """Product of the sizes of `shape` (1 for no dims)."""
    out = 1
    for s in shape:
        out *= s
    return out


def router_ks(y: fx.Node) -> set:
    """k of every top-k / `dsv41::moe_router` that `y` is computed from within `_ROUTER_DEPTH` ops."""
    router_op = dsv41_op("moe_router")
    ks, frontier, seen = set(), [y], {y}
    for _ in range(_ROUTER_DEPTH):
        nxt = []
        for n in frontier:
            # A k known only at run time is no k a tail can be specialised to (the router was refused: static_k).
            if n.op == "call_function" and n.target == aten.topk.default:
                ks.add(call_arg(n, 1, "k", 0))
            elif n.op == "call_function" and router_op is not None and n.target == router_op:
                ks.add(n.args[3])
            for a in n.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    nxt.append(a)
        frontier = nxt
    return {k for k in ks if isinstance(k, int)}


def unfuse_addmm(graph: fx.Graph, red: fx.Node) -> None:
    """Split `addmm(v, m1, m2)` with `v` a view chain of the k-reduction `red` into `add(v, mm(m1, m2))`.

    Inductor folds the shared expert's `mm` and the routed + shared `add` into one addmm; the eager code adds
    after the matmul, so the split restores the eager order of operations (no value changes)."""
    node = red
    while True:
        users = list(node.users)
        am = [u for u in users if u.target == aten.addmm.default and u.args[0] is node
              and u.kwargs.get("beta", 1) == 1 and u.kwargs.get("alpha", 1) == 1]
        if am:
            addmm = am[0]
            mm = insert_node(graph, addmm, aten.mm.default, (addmm.args[1], addmm.args[2]), like=addmm)
            add = insert_node(graph, addmm, aten.add.Tensor, (node, mm), like=addmm)
            addmm.replace_all_uses_with(add)
            graph.erase_node(addmm)
            return
        views = [u for u in users if is_view_op(u)]
        if len(views) != 1:
            return
        node = views[0]


def strip_upcasts(n: fx.Node):
    """(source, passed): the tensor an exact FP32 upcast / same-shape view `n` reads (the op upcasts itself)."""
    passed = []
    while (n.op == "call_function" and n.target in (prims.convert_element_type.default, aten.view.default,
                                                    aten.reshape.default, aten.alias.default)
           and isinstance(n.args[0], fx.Node) and tensor_val(n.args[0]) is not None
           and shape_of(n.args[0]) == shape_of(n) and exact_cast(n.args[0], n)):
        passed.append(n)
        n = n.args[0]
    return n, passed


def fits(n: fx.Node, role: tuple) -> bool:
    """Whether `n` can hold a role (numel, trailing dims): any view of the canonical shape with those last dims."""
    numel, tail = role
    v = tensor_val(n)
    return (v is not None and v.is_floating_point() and v.dim() >= len(tail) and v.numel() == numel
            and shape_of(n)[v.dim() - len(tail):] == tail)


def tail_ends(red: fx.Node, d: int, numel: int) -> list:
    """Float [.., d] non-view nodes holding `numel` elements computed from the reduction through dataflow ops,
    farthest first (a view of an end adds nothing to the chain)."""
    dist, queue, found = {}, deque([(red, 0)]), []
    while queue and len(dist) < _TAIL_FORWARD * 4:
        n, dd = queue.popleft()
        if n in dist or dd > _TAIL_FORWARD:
            continue
        dist[n] = dd
        if not is_view_op(n) and fits(n, (numel, (d,))) and tensor_val(n).dim() >= 2:
            found.append(n)
        for u in n.users:
            if is_step(u):
                queue.append((u, dd + 1))
    return sorted(found, key=lambda n: -dist[n])


def reshapes_static(end: fx.Node, cut: dict, k: int) -> bool:
    """Whether every input that must be reshaped to the end's leading dims can be, with the end's shape static
    (a reshape to concrete sizes would specialise a dynamic graph)."""
    canon = canonical(end, k)
    if all(shape_of(n) == canon[r] for r, n in cut.items()):
        return True
    return all(isinstance(s, int) for s in tensor_val(end).shape)


def canonical(end: fx.Node, k: int) -> dict:
    """Role -> shape the op reads, from the end's leading dims: y [.., k, d], shared [.., d], w [.., k]."""
    shp = shape_of(end)
    lead, d = shp[:-1], shp[-1]
    return {"y": lead + (k, d), "shared": shp, "w": lead + (k,)}


def all_reduce_after(end: fx.Node):
    """(all_reduce node, group) when `end` flows through views only into `_c10d_functional.all_reduce(.., "sum")`
    followed by `wait_tensor`; else None."""
    ns = getattr(torch.ops, "_c10d_functional", None)
    if ns is None or not hasattr(ns, "all_reduce"):
        return None
    node = end
    for _ in range(8):
        users = list(node.users)
        ar = [u for u in users if u.target == ns.all_reduce.default]
        if ar:
            a = ar[0]
            waits = [u for u in a.users if u.target == ns.wait_tensor.default]
            if call_arg(a, 1, "reduce_op", None) in ("sum", "SUM") and waits:
                return a, str(call_arg(a, 2, "group_name", ""))
            return None
        if len(users) != 1 or not is_view_op(users[0]):
            return None
        node = users[0]
    return None


#: Gate name of the tail reading an FP32 y and rounding it itself. Its GPU tests pass (H100, sessions 33-35). On
#: torch 2.11 graphs the cast it takes appears only when `dispatch` widens the experts' GEMV, after `moe` ran
#: (`round_in_tail`); with that, `small` on an H100 lost one launch per MoE layer and decoded 3.6 % faster (619.9 ->
#: 642.0 tok/s, bench/results/2026-12-07_h100_s35), so it runs on CUDA by default since then.
ROUND_Y = "moe_combine(y_dtype)"


def rounded_source(y: fx.Node, region) -> fx.Node | None:
    """The FP32 tensor y is a same-shape cast of to bf16 / fp16, when nothing outside the tail reads that cast (the op
    then reads the FP32 tensor and rounds it itself, and the cast's kernel goes); else None."""
    if y.op != "call_function" or y.target is not prims.convert_element_type.default:
        return None
    src = y.args[0]
    if not isinstance(src, fx.Node) or tensor_val(src) is None or tensor_val(src).dtype != torch.float32:
        return None
    if tensor_val(y).dtype not in (torch.bfloat16, torch.float16) or shape_of(src) != shape_of(y):
        return None
    inside = set(region)
    return src if all(u in inside for u in y.users) else None


def round_in_tail(graph: fx.Graph, cast: fx.Node, gated=frozenset()) -> str | None:
    """Give a fused tail the FP32 tensor behind `cast` (a same-shape cast of FP32 to bf16 / fp16, then at most two
    reshapes, each read once) when the only reader is a `dsv41::moe_combine` taking it as y and not yet rounding
    y: the op then reads the FP32 tensor and rounds it itself (`y_dtype`, bit-identical to the cast), and the
    cast's kernel goes. For casts that appear after `moe` ran: `dispatch` widens the routed experts' w2 GEMV to
    an FP32 input on torch 2.11 graphs and rounds its result (`dispatch_gathered`), behind a tail fused before.

    Returns the match detail to record (what was done, or that `ROUND_Y` is gated), or None when the cast does not
    feed such a tail.
    """
    src = cast.args[0] if cast.op == "call_function" and cast.target is prims.convert_element_type.default else None
    # the cast's own users as the region: only its dtype / shape conditions are asked here, its readers below
    if not isinstance(src, fx.Node) or rounded_source(cast, list(cast.users)) is not src:
        return None
    views, node = [], cast
    while len(node.users) == 1 and len(views) < 2:
        (user,) = node.users
        if not is_reshape(user) or user.args[0] is not node:
            break
        views.append(user)
        node = user
    combine = dsv41_op("moe_combine")
    if len(node.users) != 1:
        return None
    (tail,) = node.users
    if (combine is None or tail.op != "call_function" or tail.target is not combine or tail.args[0] is not node
            or len(tail.args) < 4 or (len(tail.args) > 4 and tail.args[4] is not None)):
        return None
    if ROUND_Y in gated:
        return f"cast of y left to Inductor: {ROUND_Y} is gated (gpu_unvalidated)"
    y = src
    for v in views:
        y = insert_node(graph, tail, v.target, (y, *v.args[1:]), like=v)
    tail.args = (y, *tail.args[1:4], tensor_val(cast).dtype)
    return f"moe_combine reads the FP32 result and rounds it to {str(tensor_val(cast).dtype).replace('torch.', '')}"


def tail_site(end, cut, region, kind, k, gated=frozenset()) -> Site:
    """The verified tail ending at `end` (cut: role -> node; kind: the k reduction) as a `Site`; inputs in another
    view than the end's leading dims become deferred reshapes. A y that is a cast of an FP32 tensor to a half
    dtype read only by the tail is replaced by that tensor with `y_dtype` (`rounded_source`), unless `ROUND_Y` is
    in `gated` (then the detail says so)."""
    w = cut.get("w")
    canon = canonical(end, k)
    d = canon["shared"][-1]
    detail = [("k", k), ("d", d), ("weights", "in the tail" if w is not None else "before w2 (in h)"),
              ("reduction", kind), ("out_dtype", str(tensor_val(end).dtype).replace("torch.", ""))]
    pattern = "moe_combine"
    ar = all_reduce_after(end)
    if ar is not None:
        pattern = "moe_combine -> all_reduce"
        detail.append(("all_reduce", f"sum over group {ar[1]} (kept right after the op)"))

    def arg(role):
        """The op argument of `role`: its node, a deferred reshape of it, or None when absent."""
        n = cut.get(role)
        if n is None or shape_of(n) == canon[role]:
            return n
        return ("reshape", n, list(canon[role]))

    args = (arg("y"), arg("shared"), arg("w"), tensor_val(end).dtype)
    acts = (cut["y"], cut["shared"]) + ((w,) if w is not None else ())
    src = rounded_source(cut["y"], region)
    if src is not None and ROUND_Y in gated:
        detail.append(("y_dtype", f"cast of y left to Inductor: {ROUND_Y} is gated (gpu_unvalidated)"))
    elif src is not None:
        y_dtype = tensor_val(cut["y"]).dtype
        region = region + [cut["y"]]
        y_arg = src if shape_of(src) == canon["y"] else ("reshape", src, list(canon["y"]))
        args = (y_arg, *args[1:], y_dtype)
        acts = (src, *acts[1:])
        detail.append(("y_dtype", str(y_dtype).replace("torch.", "")))
    return Site(pattern, "moe_combine", end, args, (end,), region, acts, tuple(detail))


def _walkable(n: fx.Node) -> bool:
    """A node the cut search walks back through: a region step or a batched product."""
    return is_step(n, {aten.bmm.default})


def _in_region(n: fx.Node) -> bool:
    """A node a tail region may contain: a walkable op or a non-tensor value (shape arithmetic)."""
    return _walkable(n) or not isinstance(n.meta.get("val"), torch.Tensor)


def tail_cuts(end: fx.Node, roles: dict, pos: dict):
    """Closed cuts for `roles` (name -> (numel, trailing dims)) of the region ending at `end`, nearest first: yields
    (role -> node, region). A cut whose intermediates something outside the region reads is skipped (fusing would
    compute them twice); each role's node is traced back through exact upcasts / same-shape views."""
    dist = backward_distances(end, _CUT_REGION, _walkable)
    cands = {r: ranked([n for n in dist if n is not end and fits(n, role)], dist, pos, _PER_ROLE)
             for r, role in roles.items()}

    def region_of(combo):
        """The closed region of `combo`, or None when it is not closed or leaks an intermediate."""
        region = closed_region(end, combo, _CUT_REGION, _in_region)
        if region is None:
            return None
        inner = set(region)
        if any(u not in inner for n in region if n is not end for u in n.users):
            return None
        return region

    for cut, region in cut_search(cands, dist, region_of):
        for r, n in list(cut.items()):
            cut[r], passed = strip_upcasts(n)
            region.extend(passed)
        yield cut, region
