"""`moe` family: the MoE router and the MoE tail become one `dsv41::moe_*` op each.

Chains matched (ARCHITECTURE.md "Fusion patterns", row "MoE"; MODEL.md §2.9; eager code dsv41/model/moe.py):

    router  l = (x_fp32 @ W^T) / gate_temp; s = sqrt(softplus(l)); ids = topk(s + bias, k).indices;
            w = s.gather(ids); w = w / (w.sum(-1) + eps) * route_scale
                -> (w, ids) = dsv41::moe_router(x, W, bias, k, gate_temp, route_scale, eps)
    tail    out = (sum_j [w_j *] y_j + shared).to(dtype)   [-> all_reduce(sum) -> wait_tensor under TP]
                -> out = dsv41::moe_combine(y, shared, w or None, dtype)

What the V4.1 graph really contains. The routing weight is applied BEFORE w2 (`RoutedExperts.forward_gather`:
`h = clamped_swiglu(a, b) * weights`), so the tail of the model is `y.float().sum(dim=1) + shared.float()` cast
to the activation dtype, with y [N, k, d] the k expert outputs; `moe_combine` gets `weights=None` there. Code that
weights after w2 (`einsum("nk,nkd->nd", w, y)`, `(w[..., None] * y).sum(1)`) is matched with the weights inside
the op. Inductor's post-grad passes fold `routed + shared_mm` into `addmm(routed, h, W2^T)` (FP32 graphs); when the
addmm's input is a MoE reduction the pass splits it back into `mm` + `add` (the eager order, so values do not
change), the `add` joins the tail and the `mm` stays for `dispatch`. Under tensor parallelism (dsv41/model/tp.py)
the MoE output goes through `_c10d_functional.all_reduce(.., "sum", group)` + `wait_tensor`: the pass follows the
op's output through views to that all-reduce and records it in the match (pattern `moe_combine -> all_reduce`,
detail `all_reduce`); the collective stays right after the op in the graph (it cannot run inside a Triton kernel).

Structure (cheap, spelling-independent). Router: the anchor is `aten.topk(score [.., E], k, dim=-1,
largest=True)`; walking back from the score through dataflow ops must reach exactly one FP32 `aten.mm` of shape
[R, E] (the gate GEMV) whose operands are views / exact casts of x [.., d] and of a [E, d] (or [d, E]) weight;
the other tensors the score reads are at most one [E] bias; the indices must feed an `aten.gather` of a tensor
computed from the logits (the unbiased scores), and the routing weights are the float [.., k] tensors computed
from that gather (tried farthest first). Tail: the anchor is a reduction over the k axis of a [.., k, d] tensor
(`sum` / `mean` over dim -2, or `bmm([B, 1, k], [B, k, d])`) whose input is computed, within `_ROUTER_DEPTH` ops,
from the output of a router with the same k (a `topk` or a `dsv41::moe_router`); the op's inputs are a cut of the
region ending at a non-view [.., d] tensor (y, shared, optionally w: any views of [.., k, d], [.., d], [.., k]),
found nearest first, whose intermediates nothing outside the region reads (else fusing would compute them twice);
inputs in another view than the end's leading dims are reshaped for the op (static shapes only).

Semantics (how the constants are settled). The region's own ATen nodes are evaluated on probe tensors and compared
with the op's reference (`dsv41.kernels.moe.reference_moe_router` / `reference_moe_combine`, the model's math): the
selected ids exactly, the weights and the tail at FP32 rounding. gate_temp, route_scale and eps are taken from the
region's float literals (and 1.0 / 0.0), so any constant that verifies is fused with that value (match detail).
A look-alike is a `NearMiss` naming the failed check: `router_weights_biased` (weights gathered from the biased
scores), `router_normalisation` (weights not divided by their sum), `router_scoring` (softmax / sigmoid / raw
logits instead of sqrt(softplus)), `router_bias_unused`, `router_logits_fp32` (the gate GEMV not in FP32),
`router_topk_values` (the biased top-k values are used), `router_inputs` (the score reads more than one [E] bias),
`router_values` / `router_selection` (anything else), `moe_combine_mean` (experts averaged), `moe_combine_values`.

Tie rule: the op selects the lower expert index among equal biased scores; the eager `torch.topk` leaves exact ties
implementation-defined (see dsv41/kernels/moe.py). Probes use continuous random values, so the check never
depends on ties.

Bytes per match (sympy in B, L): before = what the removed ATen ops read and write when each runs as its own eager
kernel (views free); after = the fused op's inputs and outputs. The router weight and bias count once per step,
tensors computed from activations count per token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
from collections import deque
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (FusionFamily, RegionEvaluator, RegionNotClosed, concrete_shape, dsv41_op, eliminate_dead_code,
                     insert_node, is_dataflow_op, is_table_lookup, is_view_op, node_label, size_hint, static_refusal,
                     tensor_val, token_rows)

__all__ = ["MoeFamily"]

aten = torch.ops.aten
prims = torch.ops.prims
_EVAL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.topk.default, aten.gather.default,
             aten.sort.default, aten.sort.stable}
_PASS_THROUGH = {prims.convert_element_type.default, aten.clone.default, aten._to_copy.default}
_FP32_EXACT = (torch.float32, torch.bfloat16, torch.float16)
_SCORE_REGION = 64      # nodes walked back from the selection score to the gate GEMV
_WEIGHT_FORWARD = 16    # nodes walked forward from the gather of the scores to the routing weights
_TAIL_FORWARD = 8       # nodes walked forward from a k-reduction to the end of the tail
_CUT_REGION = 48        # nodes searched back from the end of a tail for the op's inputs
_PER_ROLE = 4           # candidates tried per input of a tail
_ROUTER_DEPTH = 40      # ops between a router's output and the expert outputs y
_LITERAL_LIMIT = 8      # float literals tried per constant
_ROUTER_TOL = {"rtol": 1e-5, "atol": 1e-7}


@dataclass
class _Site:
    """A verified chain, ready to rewrite: the op, its args, the nodes it replaces (outputs in op order)."""

    pattern: str
    op_name: str
    anchor: fx.Node
    args: tuple
    outputs: tuple
    region: list
    activations: tuple
    params: tuple
    detail: tuple
    inputs_of: dict = dataclasses.field(default_factory=dict)


class MoeFamily(FusionFamily):
    """Fuse the MoE router and the MoE tail (see module docstring)."""

    name = "moe"
    summary = ("MoE: router (gate GEMV -> sqrt-softplus -> biased top-k -> normalised unbiased weights); tail "
               "(sum of routed expert outputs + shared expert [-> all-reduce])")

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Replace every verified router and tail chain of `gm` with `dsv41::moe_router` / `dsv41::moe_combine`."""
        _register_ops()
        graph = gm.graph
        ev = _Evaluator(gm)
        sites: list[_Site] = []
        misses: list[NearMiss] = []
        missing = set()
        for finder in (_find_routers, _find_tails):
            found, near = finder(graph, ev)
            misses.extend(near)
            for site in found:
                op = dsv41_op(site.op_name)
                if op is None:
                    missing.add(site.op_name)
                    misses.append(NearMiss(self.name, site.pattern, "op_registered",
                                           f"dsv41::{site.op_name} is not registered (import dsv41.kernels.moe)",
                                           SourceLocation.from_node(site.anchor)))
                    continue
                _rewrite(graph, site, op)
                sites.append(site)
            eliminate_dead_code(graph)
        from torch._inductor.pattern_matcher import stable_topological_sort
        stable_topological_sort(graph)
        eliminate_dead_code(graph)
        # Removed = region nodes no longer in the graph (including the `add` of a split addmm, created here);
        # a node shared by two regions counts for the first match only.
        alive, counted = set(graph.nodes), set()
        matches = []
        for s in sites:
            gone = [n for n in s.region if n not in alive and n not in counted]
            counted.update(gone)
            matches.append(_record(self.name, s, gone))
        note = f"ops not registered: {', '.join(sorted(missing))}" if missing else ""
        return PassRecord(self.name, True, tuple(matches), tuple(misses), (), note)


def _register_ops() -> None:
    """Import the kernels module that registers `dsv41::moe_router` / `dsv41::moe_combine` (a chain whose op is
    missing is reported as a near-miss `op_registered`)."""
    try:
        import dsv41.kernels.moe  # noqa: F401
    except ImportError:
        pass


def _reference():
    from dsv41.kernels import moe
    return moe


# ------------------------------------------------------------------------------------------------ evaluation
class _Evaluator(RegionEvaluator):
    """`RegionEvaluator` that also evaluates the gate GEMV, batched matmuls, top-k, sort and gather: deterministic
    functions of their inputs (ties aside, which continuous probes avoid)."""

    def _compute(self, n: fx.Node, memo: dict):
        if n.op == "call_function" and n.target in _EVAL_OPS:
            conv = lambda a: memo[a] if isinstance(a, fx.Node) else size_hint(a)  # noqa: E731
            return n.target(*fx.node.map_aggregate(n.args, conv), **fx.node.map_aggregate(n.kwargs, conv))
        return super()._compute(n, memo)


@contextlib.contextmanager
def _real_tensors():
    """Run reference math on real tensors even inside Inductor's compile (no fake mode, no dispatch modes)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes(), torch.no_grad():
        yield


def _evaluate(ev, outs, env):
    """Values of `outs` given the probe `env`, or None when the region is not closed over `env`."""
    try:
        memo = ev.evaluate(outs, env)
    except (RegionNotClosed, RuntimeError, IndexError):
        return None
    return [memo[o] for o in outs]


def _close(got, ref: torch.Tensor, rtol: float, atol: float) -> bool:
    """Same shape and dtype, finite, and |got - ref| <= atol + rtol |ref| elementwise."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(ref.shape) or got.dtype != ref.dtype:
        return False
    g, r = got.double(), ref.double()
    return bool(torch.isfinite(g).all()) and bool(((g - r).abs() <= atol + rtol * r.abs()).all())


def _close_rounded(got, ref: torch.Tensor) -> bool:
    """Agreement up to one rounding of the result dtype plus FP32 noise of a differently ordered sum."""
    rtol = max(torch.finfo(ref.dtype).eps, 1e-5)
    return _close(got, ref, rtol, rtol * 1e-2 * float(ref.double().abs().max()))


def _literals(nodes) -> list[float]:
    """Positive float literals among the nodes' arguments, in graph order (at most `_LITERAL_LIMIT`)."""
    out: list[float] = []

    def visit(a):
        if isinstance(a, float) and a > 0.0 and a == a and a not in out:
            out.append(a)
        return a

    for n in nodes:
        fx.node.map_aggregate(n.args, visit)
        fx.node.map_aggregate(n.kwargs, visit)
    return out[:_LITERAL_LIMIT]


# ------------------------------------------------------------------------------------------------ helpers
def _position(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def _shape(n) -> tuple | None:
    v = tensor_val(n)
    return concrete_shape(v) if v is not None else None


def _is_float(n) -> bool:
    v = tensor_val(n)
    return v is not None and v.is_floating_point()


def _is_step(n: fx.Node) -> bool:
    """A node a region may contain: a dataflow op, a constant-table lookup, or an item of a dataflow op's tuple."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and is_dataflow_op(src)
    return is_dataflow_op(n) or is_table_lookup(n)


def _exact_cast(src: fx.Node, dst: fx.Node) -> bool:
    a, b = tensor_val(src).dtype, tensor_val(dst).dtype
    return a == b or (b == torch.float32 and a in _FP32_EXACT) or (b == torch.float64 and a.is_floating_point)


def _chain_back(n) -> list:
    """`n` and the tensors it is a view, copy or exact cast of, nearest first."""
    out = []
    while isinstance(n, fx.Node) and tensor_val(n) is not None:
        out.append(n)
        if n.op != "call_function" or not (is_view_op(n) or n.target in _PASS_THROUGH):
            break
        ins = [a for a in n.all_input_nodes if tensor_val(a) is not None]
        if len(ins) != 1 or not _exact_cast(ins[0], n):
            break
        n = ins[0]
    return out


def _probe(shape, dtype, gen, scale=1.0, device=None) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def _arg(n: fx.Node, i: int, name: str, default):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


# ------------------------------------------------------------------------------------------------ router
@dataclass
class _Router:
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


def _is_topk(n: fx.Node) -> bool:
    if n.op != "call_function" or n.target != aten.topk.default or not _is_float(n.args[0]):
        return False
    nd = tensor_val(n.args[0]).dim()
    dim = _arg(n, 2, "dim", -1)
    return _arg(n, 3, "largest", True) is True and dim in (-1, nd - 1)


def _score_region(score: fx.Node):
    """(step nodes computing `score`, boundary nodes they read), walking back through dataflow ops only."""
    region, boundary, stack = set(), [], [score]
    while stack:
        n = stack.pop()
        if n in region or n in boundary:
            continue
        if _is_step(n):
            region.add(n)
            if len(region) > _SCORE_REGION:
                return None
            stack.extend(n.all_input_nodes)
        else:
            boundary.append(n)
    return region, boundary


def _router_structure(tk: fx.Node):
    """(_Router, None) for a top-k that has a router's structure, (None, NearMiss) for one that fails a structural
    check only a router would reach, (None, None) for a top-k that is not a router."""
    score = tk.args[0]
    lead, e = _shape(score)[:-1], _shape(score)[-1]
    k_arg = _arg(tk, 1, "k", None)
    ids = next((u for u in tk.users if u.target is operator.getitem and u.args[1] == 1), None)
    vals = next((u for u in tk.users if u.target is operator.getitem and u.args[1] == 0), None)
    if ids is None:
        return None, None
    found = _score_region(score)
    if found is None:
        return None, None
    region, boundary = found
    rows = 1
    for s in lead:
        rows *= s
    mms = [b for b in boundary if b.op == "call_function" and b.target == aten.mm.default and _shape(b) == (rows, e)]
    if len(mms) != 1:
        return None, None
    mm = mms[0]
    d = _shape(mm.args[0])[1]
    ws = [n for n in _chain_back(mm.args[1]) if _shape(n) in ((e, d), (d, e)) and _is_float(n)]
    xs = [n for n in _chain_back(mm.args[0]) if _shape(n) == tuple(lead) + (d,) and _is_float(n)]
    gathers = [u for u in ids.users if u.target == aten.gather.default and u.args[2] is ids
               and (u.args[0] in region or u.args[0] is mm)]
    if not ws or not xs or not gathers:
        return None, None
    loc = SourceLocation.from_node(tk)
    pattern = "moe router (gate GEMV -> sqrt(softplus) -> biased top-k -> normalised weights)"
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
        chain = [n for n in _chain_back(b) if _shape(n) == (e,) and tensor_val(n).dtype == torch.float32]
        if not chain or not _is_float(b):
            return None, NearMiss("moe", pattern, "router_inputs",
                                  f"the selection score reads {node_label(b)} ({b.name}) besides the logits; "
                                  f"dsv41::moe_router takes one FP32 bias [{e}]", loc)
        biases.append(chain[0])
    if len(biases) > 1:
        return None, NearMiss("moe", pattern, "router_inputs",
                              f"the selection score reads {len(biases)} [{e}] tensors; dsv41::moe_router takes one "
                              "selection bias", loc)
    w = ws[-1]
    ends = _weight_ends(gathers, ids)
    refused = static_refusal("moe", pattern, [xs[-1], w, *biases, *ends], loc, "dsv41::moe_router")
    if refused is not None:
        return None, refused
    k = int(k_arg)
    return _Router(tk, k, ids, mm, xs[-1], w, _holds_transpose(mm.args[1], w), biases[0] if biases else None,
                   ends, region), None


def _holds_transpose(rhs: fx.Node, w: fx.Node) -> bool:
    """Whether `w` holds W^T [d, E] like the mm's right operand `rhs` (an even number of 2-D transposes between
    them), rather than W [E, d] (shapes alone cannot tell when E == d)."""
    flips, n = 0, rhs
    while n is not w:
        if n.target == aten.permute.default and list(n.args[1]) == [1, 0] or n.target in (aten.t.default,
                                                                                          aten.transpose.int):
            flips += 1
        n = next(a for a in n.all_input_nodes if tensor_val(a) is not None)
    return flips % 2 == 0


def _weight_ends(gathers: list, ids: fx.Node) -> list:
    """Float [.., k] nodes computed from the gathers of the scores (through small dataflow ops), farthest first."""
    want = _shape(ids)
    limit = 1
    for s in want:
        limit *= s
    dist, queue, order = {}, deque((g, 0) for g in gathers), []
    while queue and len(dist) < _WEIGHT_FORWARD:
        n, dd = queue.popleft()
        if n in dist:
            continue
        dist[n] = dd
        if _is_float(n) and _shape(n) == want:
            order.append(n)
        for u in n.users:
            v = tensor_val(u)
            if _is_step(u) and v is not None and v.numel() <= limit:
                queue.append((u, dd + 1))
    return sorted(order, key=lambda n: -dist[n])


def _find_routers(graph: fx.Graph, ev: _Evaluator):
    sites, misses = [], []
    for tk in list(graph.nodes):
        if not _is_topk(tk):
            continue
        st, miss = _router_structure(tk)
        if miss is not None:
            misses.append(miss)
        if st is None:
            continue
        site, miss = _verify_router(ev, st)
        if site is not None:
            sites.append(site)
        elif miss is not None:
            misses.append(miss)
    return sites, misses


def _router_probes(st: _Router, seed: int, mode: str = "normal"):
    """One probe environment of a router region and its reference inputs (x, w [E, d], bias).

    mode "normal": logits of spread ~1.5. "large": logits of spread ~60, across softplus's threshold (20) and any
    clamp a look-alike might put on them. "tiny": every logit near -30, so every score is ~1e-7 and the selection
    is decided by the bias: pins where an eps or a floor sits in the normalisation (a region that clamps or
    smooths them agrees with the reference on "normal" probes only)."""
    gen = torch.Generator().manual_seed(seed)
    xv, wv = tensor_val(st.x), tensor_val(st.weight)
    d = _shape(st.x)[-1]
    x = _probe(_shape(st.x), xv.dtype, gen, 40.0 if mode == "large" else 1.0, device=xv.device)
    w = _probe(_shape(st.weight), wv.dtype, gen, 1.5 / d ** 0.5, device=wv.device)
    if mode == "tiny":
        x = x.abs()
        w = -(w.abs() * (30.0 / (0.64 * d) / (1.5 / d ** 0.5))).to(wv.dtype)
    env = {st.x: x, st.weight: w}
    w_ek = w.t() if st.weight_t else w
    b = None
    if st.bias is not None:
        # Larger than the model's 0.01 biases, so that the bias visibly changes the selection.
        b = _probe(_shape(st.bias), torch.float32, gen, 0.3, device=tensor_val(st.bias).device)
        env[st.bias] = b
    return env, (x, w_ek, b)


def _variant(x, w, b, k, temp, scale, eps, scoring="sqrtsoftplus", biased_weights=False, normalise=True,
             use_bias=True):
    """The router's (weights, ids) under a look-alike rule (diagnostics of a failed match)."""
    logits = x.reshape(-1, x.shape[-1]).float() @ w.float().t() / temp
    s = {"sqrtsoftplus": lambda v: torch.sqrt(torch.nn.functional.softplus(v)), "softmax": lambda v: v.softmax(-1),
         "sigmoid": torch.sigmoid, "logits": lambda v: v}[scoring](logits)
    sel = s + b if (b is not None and use_bias) else s
    ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices[..., :k]
    g = (sel if biased_weights else s).gather(1, ids)
    if normalise:
        g = g / (g.sum(-1, keepdim=True) + eps)
    lead = tuple(x.shape[:-1])
    return (g * scale).reshape(*lead, k), ids.reshape(*lead, k)


@_real_tensors()
def _verify_router(ev, st: _Router):
    loc = SourceLocation.from_node(st.topk)
    pattern = "moe router (gate GEMV -> sqrt(softplus) -> biased top-k -> normalised weights)"
    mk = _reference()
    probes = [_router_probes(st, seed) for seed in (51, 52)] + [_router_probes(st, 53, "large"),
                                                                 _router_probes(st, 54, "tiny")]
    reasons = []
    for end in st.ends:
        runs = [_evaluate(ev, [end, st.ids], env) for env, _ in probes]
        if any(r is None for r in runs):
            continue
        region_nodes = _region_between([end, st.ids], [st.x, st.weight] + ([st.bias] if st.bias is not None else []))
        lits = _literals(region_nodes)
        temps = [1.0] + [v for v in lits if v != 1.0] + [1.0 / v for v in lits if v != 1.0]
        scales = [1.0] + [v for v in lits if v != 1.0]
        epss = [v for v in lits if v < 1e-2] + [0.0]
        for temp, scale, eps in itertools.product(temps, scales, epss):
            ok = True
            for (got_w, got_ids), (_, (x, w, b)) in zip(runs, probes):
                ref_w, ref_ids = mk.reference_moe_router(x, w, b, st.k, temp, scale, eps)
                if not (torch.equal(got_ids, ref_ids) and _close(got_w, ref_w, **_ROUTER_TOL)):
                    ok = False
                    break
            if ok:
                return _router_site(st, end, region_nodes, temp, scale, eps), None
        reasons.append(_diagnose_router(runs, probes, st, temps, scales, epss))
    if not reasons:
        return None, None
    order = ("router_weights_biased", "router_normalisation", "router_scoring", "router_bias_unused",
             "router_selection", "router_values")
    check, why = min(reasons, key=lambda r: order.index(r[0]))
    return None, NearMiss("moe", pattern, check, why, loc)


def _diagnose_router(runs, probes, st, temps, scales, epss):
    """(check, reason) naming the look-alike rule a failed router region follows."""
    consts = list(itertools.product(temps, scales, epss))

    def follows(**rule):
        for temp, scale, eps in consts:
            if all(torch.equal(gi, v[1]) and _close(gw, v[0], **_ROUTER_TOL)
                   for (gw, gi), (_, (x, w, b)) in zip(runs, probes)
                   for v in [_variant(x, w, b, st.k, temp, scale, eps, **rule)]):
                return True
        return False

    def selects(**rule):
        return any(all(torch.equal(gi, _variant(x, w, b, st.k, t, 1.0, 0.0, **rule)[1])
                       for (_, gi), (_, (x, w, b)) in zip(runs, probes)) for t in temps)

    if follows(biased_weights=True):
        return ("router_weights_biased", "the routing weights are gathered from the BIASED scores (s + bias); the "
                "bias only selects experts, the weights are the unbiased scores (MODEL.md §2.9 step 4)")
    if follows(normalise=False):
        return ("router_normalisation", "the gathered scores are not divided by their sum; dsv41::moe_router "
                "normalises them (w = s / (sum s + eps) * route_scale, MODEL.md §2.9 step 4)")
    for scoring in ("softmax", "sigmoid", "logits"):
        if selects(scoring=scoring):
            return ("router_scoring", f"the scores are {scoring}(logits), not sqrt(softplus(logits)) (V4.1's "
                    "sqrtsoftplus scoring, MODEL.md §2.9 step 2)")
    if st.bias is not None and selects(use_bias=False):
        return ("router_bias_unused", "the top-k does not use the bias [E] the score reads; V4.1 selects on "
                "s + bias (MODEL.md §2.9 step 3)")
    if not selects():
        return ("router_selection", "the selected experts are not top-k(sqrt(softplus(x W^T / t)) + bias) for any "
                "temperature among the region's literals (MODEL.md §2.9 steps 1-3)")
    return ("router_values", "the experts are selected like V4.1's router but the weights are not "
            "s[ids] / (sum + eps) * route_scale for any of the region's literals (MODEL.md §2.9 step 4)")


def _region_between(outs: list, ins: list) -> list:
    """Nodes computing `outs` from `ins` (graph order not guaranteed): ancestors of `outs` that are not behind `ins`."""
    stop, seen, stack = set(ins), set(), [o for o in outs if o not in ins]
    while stack:
        n = stack.pop()
        if n in seen or n in stop or n.op != "call_function":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return list(seen)


def _router_site(st: _Router, end, region_nodes, temp, scale, eps) -> _Site:
    weight_arg = ("permute", st.weight) if st.weight_t else st.weight
    detail = (("k", st.k), ("experts", _shape(st.weight)[0 if not st.weight_t else 1]), ("d", _shape(st.x)[-1]),
              ("gate_temp", temp), ("route_scale", scale), ("norm_eps", eps), ("bias", st.bias is not None),
              ("tie_rule", "lower expert index wins"))
    params = (st.weight,) + ((st.bias,) if st.bias is not None else ())
    return _Site("moe_router", "moe_router", st.topk, (st.x, weight_arg, st.bias, st.k, temp, scale, eps),
                 (end, st.ids), region_nodes, (st.x,), params, detail)


# ------------------------------------------------------------------------------------------------ tail
def _k_reduction(n: fx.Node):
    """(kind, y_in, rows, k, d) when `n` reduces a [.., k, d] tensor over k (rows = tokens), else None."""
    if n.op != "call_function":
        return None
    if n.target in (aten.sum.dim_IntList, aten.mean.dim):
        src = n.args[0]
        dims = _arg(n, 1, "dim", None)
        if not _is_float(src) or not isinstance(dims, (list, tuple)) or len(dims) != 1 or _arg(n, 2, "keepdim", False):
            return None
        shp = _shape(src)
        if len(shp) < 3 or dims[0] not in (-2, len(shp) - 2):
            return None
        return "mean" if n.target == aten.mean.dim else "sum", src, _numel(shp[:-2]), shp[-2], shp[-1]
    if n.target == aten.bmm.default:
        a, b = _shape(n.args[0]), _shape(n.args[1])
        if a is None or b is None or len(a) != 3 or a[1] != 1 or a[2] != b[1] or not _is_float(n):
            return None
        return "bmm", n.args[1], b[0], b[1], b[2]
    return None


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _router_ks(y: fx.Node) -> set:
    """k of every top-k / `dsv41::moe_router` that `y` is computed from within `_ROUTER_DEPTH` ops."""
    router_op = dsv41_op("moe_router")
    ks, frontier, seen = set(), [y], {y}
    for _ in range(_ROUTER_DEPTH):
        nxt = []
        for n in frontier:
            # A k known only at run time is no k a tail can be specialised to (the router was refused: static_k).
            if n.op == "call_function" and n.target == aten.topk.default:
                ks.add(_arg(n, 1, "k", 0))
            elif n.op == "call_function" and router_op is not None and n.target == router_op:
                ks.add(n.args[3])
            for a in n.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    nxt.append(a)
        frontier = nxt
    return {k for k in ks if isinstance(k, int)}


def _unfuse_addmm(graph: fx.Graph, red: fx.Node) -> None:
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


def _walkable(n: fx.Node) -> bool:
    return _is_step(n) or (n.op == "call_function" and n.target == aten.bmm.default)


def _backward_distances(end: fx.Node, limit: int) -> dict:
    dist = {end: 0}
    queue = deque([end])
    while queue:
        n = queue.popleft()
        for a in n.all_input_nodes:
            if a in dist:
                continue
            dist[a] = dist[n] + 1
            if _walkable(a) and len(dist) < limit:
                queue.append(a)
    return dist


def _closed_region(end: fx.Node, cut: tuple, limit: int):
    """Nodes computing `end` from exactly the `cut` nodes (each used) and small constants, or None."""
    cutset, seen, nodes, reached, stack = set(cut), set(), [], set(), [end]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in cutset:
            reached.add(n)
            continue
        v = n.meta.get("val")
        if n.op == "get_attr" and isinstance(v, torch.Tensor) and v.numel() <= 256:
            continue
        if n.op != "call_function" or not (_walkable(n) or not isinstance(v, torch.Tensor)):
            return None
        nodes.append(n)
        if len(nodes) > limit:
            return None
        stack.extend(n.all_input_nodes)
    return nodes if reached == cutset else None


def _strip_upcasts(n: fx.Node):
    """(source, passed): the tensor an exact FP32 upcast / same-shape view `n` reads (the op upcasts itself)."""
    passed = []
    while (n.op == "call_function" and n.target in (prims.convert_element_type.default, aten.view.default,
                                                    aten.reshape.default, aten.alias.default)
           and isinstance(n.args[0], fx.Node) and tensor_val(n.args[0]) is not None
           and _shape(n.args[0]) == _shape(n) and _exact_cast(n.args[0], n)):
        passed.append(n)
        n = n.args[0]
    return n, passed


def _fits(n: fx.Node, role: tuple) -> bool:
    """Whether `n` can hold a role (numel, trailing dims): any view of the canonical shape with those last dims."""
    numel, tail = role
    v = tensor_val(n)
    return (v is not None and v.is_floating_point() and v.dim() >= len(tail) and v.numel() == numel
            and _shape(n)[v.dim() - len(tail):] == tail)


def _cuts(end: fx.Node, roles: dict, pos: dict):
    """Closed cuts for `roles` (name -> (numel, trailing dims)), nearest first: yields (assignment, region)."""
    dist = _backward_distances(end, _CUT_REGION)
    cands = {}
    for r, role in roles.items():
        c = [n for n in dist if n is not end and _fits(n, role)]
        cands[r] = sorted(c, key=lambda n: (dist[n], -pos.get(n, 0)))[:_PER_ROLE]
    if not all(cands.values()):
        return
    for combo in sorted(itertools.product(*cands.values()), key=lambda c: sum(dist[n] for n in c)):
        if len(set(combo)) != len(combo):
            continue
        region = _closed_region(end, combo, _CUT_REGION)
        if region is None:
            continue
        # Fusing is a win only if nothing outside reads the chain's intermediates (else they are computed twice).
        inner = set(region)
        if any(u not in inner for n in region if n is not end for u in n.users):
            continue
        cut = {}
        for r, n in zip(roles, combo):
            cut[r], passed = _strip_upcasts(n)
            region.extend(passed)
        yield cut, region


def _tail_ends(red: fx.Node, d: int, numel: int) -> list:
    """Float [.., d] non-view nodes holding `numel` elements computed from the reduction through dataflow ops,
    farthest first (a view of an end adds nothing to the chain)."""
    dist, queue, found = {}, deque([(red, 0)]), []
    while queue and len(dist) < _TAIL_FORWARD * 4:
        n, dd = queue.popleft()
        if n in dist or dd > _TAIL_FORWARD:
            continue
        dist[n] = dd
        if not is_view_op(n) and _fits(n, (numel, (d,))) and tensor_val(n).dim() >= 2:
            found.append(n)
        for u in n.users:
            if _is_step(u):
                queue.append((u, dd + 1))
    return sorted(found, key=lambda n: -dist[n])


def _find_tails(graph: fx.Graph, ev: _Evaluator):
    sites, misses = [], []
    done: set = set()
    for red in list(graph.nodes):
        info = _k_reduction(red)
        if info is None or red in done:
            continue
        kind, y_in, rows, k, d = info
        if k not in _router_ks(y_in):
            continue
        refused = static_refusal("moe", "moe tail (sum of routed experts + shared expert)", [red, y_in],
                                 SourceLocation.from_node(red), "dsv41::moe_combine")
        if refused is not None:
            misses.append(refused)
            continue
        _unfuse_addmm(graph, red)
        pos = _position(graph)
        reasons, found = [], None
        for with_w in (True, False):
            for end in _tail_ends(red, d, rows * d):
                roles = {"y": (rows * k * d, (k, d)), "shared": (rows * d, (d,))}
                if with_w:
                    roles["w"] = (rows * k, (k,))
                for cut, region in _cuts(end, roles, pos):
                    if red not in region or not _reshapes_static(end, cut, k):
                        continue
                    ok, why = _verify_tail(ev, end, cut, k)
                    if ok:
                        found = (end, cut, region)
                        break
                    if why is not None:
                        reasons.append(why)
                if found:
                    break
            if found:
                break
        loc = SourceLocation.from_node(red)
        if found is None:
            if reasons:
                check, why = min(reasons, key=lambda r: ("moe_combine_mean", "moe_combine_values").index(r[0]))
                misses.append(NearMiss("moe", "moe tail (sum of routed experts + shared expert)", check, why, loc))
            continue
        end, cut, region = found
        done.update(region)
        refused = static_refusal("moe", "moe tail (sum of routed experts + shared expert)",
                                 [end, *cut.values(), *region], loc, "dsv41::moe_combine")
        if refused is not None:
            misses.append(refused)
            continue
        sites.append(_tail_site(end, cut, region, kind, k))
    return sites, misses


def _reshapes_static(end: fx.Node, cut: dict, k: int) -> bool:
    """Whether every input that must be reshaped to the end's leading dims can be, with the end's shape static
    (a reshape to concrete sizes would specialise a dynamic graph)."""
    canon = _canonical(end, k)
    if all(_shape(n) == canon[r] for r, n in cut.items()):
        return True
    return all(isinstance(s, int) for s in tensor_val(end).shape)


def _canonical(end: fx.Node, k: int) -> dict:
    """Role -> shape the op reads, from the end's leading dims: y [.., k, d], shared [.., d], w [.., k]."""
    shp = _shape(end)
    lead, d = shp[:-1], shp[-1]
    return {"y": lead + (k, d), "shared": shp, "w": lead + (k,)}


@_real_tensors()
def _verify_tail(ev, end, cut, k):
    # Two magnitudes: N(0, 1) and x1000 (a look-alike that clamps or saturates the sum agrees on the first only).
    for magnitude in (1.0, 1000.0):
        ok, why = _verify_tail_at(ev, end, cut, k, magnitude)
        if not ok:
            return ok, why
    return True, None


def _verify_tail_at(ev, end, cut, k, magnitude):
    gen = torch.Generator().manual_seed(61)
    env, vals = {}, {}
    canon = _canonical(end, k)
    for role in ("y", "shared", "w"):
        if role not in cut:
            continue
        n = cut[role]
        v = tensor_val(n)
        p = (torch.rand(concrete_shape(v), generator=gen, dtype=torch.float64) + 0.25 if role == "w"
             else _probe(concrete_shape(v), torch.float64, gen, magnitude))
        env[n] = p.to(v.dtype).to(v.device)
        vals[role] = env[n].reshape(canon[role])
    got = _evaluate(ev, [end], env)
    if got is None:
        return False, None
    got = got[0]
    mk = _reference()
    out_dtype = tensor_val(end).dtype
    w = vals.get("w")
    ref = mk.reference_moe_combine(vals["y"], vals["shared"], w, out_dtype)
    if _close_rounded(got, ref):
        return True, None
    yf = vals["y"].float() if w is None else w.float().unsqueeze(-1) * vals["y"].float()
    mean = (yf.mean(-2) + vals["shared"].float()).to(out_dtype)
    if _close_rounded(got, mean):
        return False, ("moe_combine_mean", "the expert outputs are AVERAGED over the k experts; the MoE output is "
                       "their sum (the routing weights already sum to route_scale, MODEL.md §2.9 'Output')")
    return False, ("moe_combine_values", "the region reads the routed outputs y [.., k, d] and a shared output [.., d] "
                   "but does not compute sum_j " + ("w_j * " if w is not None else "") + "y_j + shared "
                   "(MODEL.md §2.9 'Output')")


def _all_reduce_after(end: fx.Node):
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
            if _arg(a, 1, "reduce_op", None) in ("sum", "SUM") and waits:
                return a, str(_arg(a, 2, "group_name", ""))
            return None
        if len(users) != 1 or not is_view_op(users[0]):
            return None
        node = users[0]
    return None


def _tail_site(end, cut, region, kind, k) -> _Site:
    w = cut.get("w")
    canon = _canonical(end, k)
    d = canon["shared"][-1]
    detail = [("k", k), ("d", d), ("weights", "in the tail" if w is not None else "before w2 (in h)"),
              ("reduction", kind), ("out_dtype", str(tensor_val(end).dtype).replace("torch.", ""))]
    pattern = "moe_combine"
    ar = _all_reduce_after(end)
    if ar is not None:
        pattern = "moe_combine -> all_reduce"
        detail.append(("all_reduce", f"sum over group {ar[1]} (kept right after the op)"))

    def arg(role):
        n = cut.get(role)
        if n is None or _shape(n) == canon[role]:
            return n
        return ("reshape", n, list(canon[role]))

    args = (arg("y"), arg("shared"), arg("w"), tensor_val(end).dtype)
    acts = (cut["y"], cut["shared"]) + ((w,) if w is not None else ())
    return _Site(pattern, "moe_combine", end, args, (end,), region, acts, (), tuple(detail))


# ------------------------------------------------------------------------------------------------ rewrite + record
def _rewrite(graph: fx.Graph, site: _Site, op) -> None:
    pos = _position(graph)
    site.region = sorted((n for n in site.region if n in pos), key=pos.__getitem__)
    # Inputs per region node, kept for the byte accounting (erased nodes lose their args); a view of a parameter
    # is resolved to the parameter now, while the view still has its input.
    params = set(site.params)
    site.inputs_of = {n: [_param_source(a, params) for a in n.all_input_nodes] for n in site.region}
    # The router replaces its top-k: insert there (x, W and bias are its ancestors); the tail at its end.
    first = site.anchor if site.op_name == "moe_router" else min(site.outputs, key=pos.__getitem__)
    args = list(site.args)
    for i, a in enumerate(args):  # views the op reads: W^T -> W, a tail input in the end's leading shape
        if isinstance(a, tuple) and a[0] == "permute":
            args[i] = insert_node(graph, first, aten.permute.default, (a[1], [1, 0]), like=site.anchor)
        elif isinstance(a, tuple) and a[0] == "reshape":
            args[i] = insert_node(graph, first, aten.reshape.default, (a[1], a[2]), like=site.anchor)
    out = insert_node(graph, first, op, tuple(args), like=site.anchor)
    if len(site.outputs) == 1:
        site.outputs[0].replace_all_uses_with(out)
        return
    for i, old in enumerate(site.outputs):
        new = insert_node(graph, first, operator.getitem, (out, i), like=site.anchor)
        old.replace_all_uses_with(new)


def _record(family: str, site: _Site, gone: list) -> MatchRecord:
    before, after, subs = _bytes(site, gone)
    return MatchRecord(family, site.pattern, f"dsv41::{site.op_name}", SourceLocation.from_node(site.anchor),
                       tuple(n.name for n in gone), tuple(node_label(n) for n in gone), before, after,
                       tuple(sorted(subs.items())), site.detail)


def _bytes(site: _Site, gone: list):
    """(before, after, symbol values): eager traffic of the removed ops vs the fused op's inputs and outputs."""
    lead = concrete_shape(tensor_val(site.outputs[0]))[:-1]
    rows, subs = token_rows(lead)
    ntok = 1
    for s in lead:
        ntok *= s
    per_step = set(site.params)
    totals = {"before": [0, 0], "after": [0, 0]}  # [bytes per token, bytes per step]

    def add(key: str, n) -> None:
        v = tensor_val(n)
        if v is None:
            return
        nbytes = v.numel() * v.element_size()
        if n not in per_step and nbytes % max(ntok, 1) == 0:
            totals[key][0] += nbytes // max(ntok, 1)
        else:
            totals[key][1] += nbytes

    for n in gone:
        if is_view_op(n) or tensor_val(n) is None:
            continue
        add("before", n)
        for a in site.inputs_of.get(n, ()):
            add("before", a)
    ins = [a for a in site.args if isinstance(a, fx.Node)] + [a[1] for a in site.args if isinstance(a, tuple)]
    for n in ins + list(site.outputs):
        add("after", n)
    before, after = (sympy.Integer(totals[k][0]) * rows + totals[k][1] for k in ("before", "after"))
    return str(sympy.expand(before)), str(sympy.expand(after)), subs


def _param_source(n: fx.Node, params: set) -> fx.Node:
    """The parameter `n` is a view of (its bytes are the parameter's, read once per step), else `n`."""
    m = n
    while is_view_op(m) and m.all_input_nodes:
        m = m.all_input_nodes[0]
        if m in params:
            return m
    return n
