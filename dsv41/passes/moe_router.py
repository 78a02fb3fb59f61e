"""Structure of the MoE router chain (family `moe`, moe.py): the top-k anchor, the gate GEMV and bias behind its
score, the routing weights after the gather, and the probes that verify it."""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass

import torch
import torch.fx as fx

from .records import NearMiss, SourceLocation
from .engine import (Site, call_arg, chain_back, is_float, is_step, node_label, randn_probe, shape_of, static_refusal,
                     tensor_val)

__all__ = ["Router", "ROUTER_PATTERN", "is_topk", "score_region", "router_structure", "holds_transpose",
           "weight_ends", "router_probes", "region_between", "router_site"]

aten = torch.ops.aten
_SCORE_REGION = 64      # nodes walked back from the selection score to the gate GEMV
_WEIGHT_FORWARD = 16    # nodes walked forward from the gather of the scores to the routing weights
#: The pattern name of router matches and near-misses.
ROUTER_PATTERN = "moe router (gate GEMV -> sqrt(softplus) -> biased top-k -> normalised weights)"


@dataclass
class Router:
    """The structure around one top-k: selection score, gate GEMV, x / W / bias, ids, gather, weight candidates."""

    topk: fx.Node
    k: int
    ids: fx.Node
    mm: fx.Node
    x: fx.Node
    weight: fx.Node
    weight_t: bool
    bias: fx.Node | None
    ends: list
    score_region: set


def is_topk(n: fx.Node) -> bool:
    """`aten.topk` of the largest values over the last dim of a floating tensor (a router's selection)."""
    if n.op != "call_function" or n.target != aten.topk.default or not is_float(n.args[0]):
        return False
    nd = tensor_val(n.args[0]).dim()
    dim = call_arg(n, 2, "dim", -1)
    return call_arg(n, 3, "largest", True) is True and dim in (-1, nd - 1)


def score_region(score: fx.Node):
    """(step nodes computing `score`, boundary nodes they read), walking back through dataflow ops only."""
    region, boundary, stack = set(), [], [score]
    while stack:
        n = stack.pop()
        if n in region or n in boundary:
            continue
        if is_step(n):
            region.add(n)
            if len(region) > _SCORE_REGION:
                return None
            stack.extend(n.all_input_nodes)
        else:
            boundary.append(n)
    return region, boundary


def router_structure(tk: fx.Node):
    """(Router, None) for a top-k that has a router's structure, (None, NearMiss) for one that fails a structural
    check only a router would reach, (None, None) for a top-k that is not a router."""
    score = tk.args[0]
    lead, e = shape_of(score)[:-1], shape_of(score)[-1]
    k_arg = call_arg(tk, 1, "k", None)
    ids = next((u for u in tk.users if u.target is operator.getitem and u.args[1] == 1), None)
    vals = next((u for u in tk.users if u.target is operator.getitem and u.args[1] == 0), None)
    if ids is None:
        return None, None
    found = score_region(score)
    if found is None:
        return None, None
    region, boundary = found
    rows = 1
    for s in lead:
        rows *= s
    mms = [b for b in boundary if b.op == "call_function" and b.target == aten.mm.default and shape_of(b) == (rows, e)]
    if len(mms) != 1:
        return None, None
    mm = mms[0]
    d = shape_of(mm.args[0])[1]
    ws = [n for n in chain_back(mm.args[1]) if shape_of(n) in ((e, d), (d, e)) and is_float(n)]
    xs = [n for n in chain_back(mm.args[0]) if shape_of(n) == tuple(lead) + (d,) and is_float(n)]
    gathers = [u for u in ids.users if u.target == aten.gather.default and u.args[2] is ids
               and (u.args[0] in region or u.args[0] is mm)]
    if not ws or not xs or not gathers:
        return None, None
    loc = SourceLocation.from_node(tk)
    pattern = ROUTER_PATTERN
    # Sizes first: the value checks below evaluate the chain at the compiled sizes only.
    refused = (static_refusal("moe", pattern, [k_arg], loc, "dsv41::moe_router", "static_k")
               or static_refusal("moe", pattern, [tk, mm, *region, *boundary], loc, "dsv41::moe_router"))
    if refused is not None:
        return None, refused
    if tensor_val(mm).dtype != torch.float32:
        return None, NearMiss("moe", pattern, "router_logits_fp32",
                              f"the gate GEMV runs in {tensor_val(mm).dtype}; dsv41::moe_router computes the logits "
                              "in FP32 (x.float() @ W.float().T, MODEL.md §2.9 step 1)", loc)
    if vals is not None and vals.users:
        return None, NearMiss("moe", pattern, "router_topk_values",
                              "the top-k VALUES (biased scores) are used; dsv41::moe_router returns weights and ids "
                              "only (the weights come from the unbiased scores, MODEL.md §2.9 step 4)", loc)
    sides = [b for b in boundary if b is not mm]
    biases = []
    for b in sides:
        chain = [n for n in chain_back(b) if shape_of(n) == (e,) and tensor_val(n).dtype == torch.float32]
        if not chain or not is_float(b):
            return None, NearMiss("moe", pattern, "router_inputs",
                                  f"the selection score reads {node_label(b)} ({b.name}) besides the logits; "
                                  f"dsv41::moe_router takes one FP32 bias [{e}]", loc)
        biases.append(chain[0])
    if len(biases) > 1:
        return None, NearMiss("moe", pattern, "router_inputs",
                              f"the selection score reads {len(biases)} [{e}] tensors; dsv41::moe_router takes one "
                              "selection bias", loc)
    w = ws[-1]
    ends = weight_ends(gathers, ids)
    refused = static_refusal("moe", pattern, [xs[-1], w, *biases, *ends], loc, "dsv41::moe_router")
    if refused is not None:
        return None, refused
    k = int(k_arg)
    return Router(tk, k, ids, mm, xs[-1], w, holds_transpose(mm.args[1], w), biases[0] if biases else None,
                   ends, region), None


def holds_transpose(rhs: fx.Node, w: fx.Node) -> bool:
    """Whether `w` holds W^T [d, E] like the mm's right operand `rhs` (an even number of 2-D transposes between
    them), rather than W [E, d] (shapes alone cannot tell when E == d)."""
    flips, n = 0, rhs
    while n is not w:
        if n.target == aten.permute.default and list(n.args[1]) == [1, 0] or n.target in (aten.t.default,
                                                                                          aten.transpose.int):
            flips += 1
        n = next(a for a in n.all_input_nodes if tensor_val(a) is not None)
    return flips % 2 == 0


def weight_ends(gathers: list, ids: fx.Node) -> list:
    """Float [.., k] nodes computed from the gathers of the scores (through small dataflow ops), farthest first."""
    want = shape_of(ids)
    limit = 1
    for s in want:
        limit *= s
    dist, queue, order = {}, deque((g, 0) for g in gathers), []
    while queue and len(dist) < _WEIGHT_FORWARD:
        n, dd = queue.popleft()
        if n in dist:
            continue
        dist[n] = dd
        if is_float(n) and shape_of(n) == want:
            order.append(n)
        for u in n.users:
            v = tensor_val(u)
            if is_step(u) and v is not None and v.numel() <= limit:
                queue.append((u, dd + 1))
    return sorted(order, key=lambda n: -dist[n])


def router_probes(st: Router, seed: int, mode: str = "normal"):
    """One probe environment of a router region and its reference inputs (x, w [E, d], bias).

    mode "normal": logits of spread ~1.5. "large": logits of spread ~60, across softplus's threshold (20) and any
    clamp a look-alike might put on them. "tiny": every logit near -30, so every score is ~1e-7 and the selection
    is decided by the bias: pins where an eps or a floor sits in the normalisation (a region that clamps or
    smooths them agrees with the reference on "normal" probes only)."""
    gen = torch.Generator().manual_seed(seed)
    xv, wv = tensor_val(st.x), tensor_val(st.weight)
    d = shape_of(st.x)[-1]
    x = randn_probe(shape_of(st.x), xv.dtype, gen, 40.0 if mode == "large" else 1.0, device=xv.device)
    w = randn_probe(shape_of(st.weight), wv.dtype, gen, 1.5 / d ** 0.5, device=wv.device)
    if mode == "tiny":
        x = x.abs()
        w = -(w.abs() * (30.0 / (0.64 * d) / (1.5 / d ** 0.5))).to(wv.dtype)
    env = {st.x: x, st.weight: w}
    w_ek = w.t() if st.weight_t else w
    b = None
    if st.bias is not None:
        # Larger than the model's 0.01 biases, so that the bias visibly changes the selection.
        b = randn_probe(shape_of(st.bias), torch.float32, gen, 0.3, device=tensor_val(st.bias).device)
        env[st.bias] = b
    return env, (x, w_ek, b)


def region_between(outs: list, ins: list) -> list:
    """Nodes computing `outs` from `ins` (graph order not guaranteed): ancestors of `outs` that are not behind `ins`."""
    stop, seen, stack = set(ins), set(), [o for o in outs if o not in ins]
    while stack:
        n = stack.pop()
        if n in seen or n in stop or n.op != "call_function":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return list(seen)


def router_site(st: Router, end, region_nodes, temp, scale, eps) -> Site:
    """The verified router `st` ending at the weights `end`, with its discovered constants, as a `Site`."""
    weight_arg = ("permute", st.weight) if st.weight_t else st.weight
    detail = (("k", st.k), ("experts", shape_of(st.weight)[0 if not st.weight_t else 1]), ("d", shape_of(st.x)[-1]),
              ("gate_temp", temp), ("route_scale", scale), ("norm_eps", eps), ("bias", st.bias is not None),
              ("tie_rule", "lower expert index wins"))
    params = (st.weight,) + ((st.bias,) if st.bias is not None else ())
    return Site("moe_router", "moe_router", st.topk, (st.x, weight_arg, st.bias, st.k, temp, scale, eps),
                (end, st.ids), region_nodes, (st.x,), detail, params)
