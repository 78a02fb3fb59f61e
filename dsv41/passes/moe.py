"""`moe` family: the MoE router and the MoE tail become one `dsv41::moe_*` op each.

Chains matched (`SPEC` below, `dsv41 report --patterns moe`; MODEL.md §2.9; eager code dsv41/model/moe.py):

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

import functools

import itertools

import torch
import torch.fx as fx

from .records import NearMiss, SourceLocation
from .engine import (ByteTally, Chain, ChainFamily, RegionEvaluator, RegionNotClosed, Role, Site, close, close_rounded,
                     collect, concrete_shape, float_literals, is_view_op, op_inputs, positions, randn_probe,
                     real_tensors, register_family, rewrite_outputs, sort_region, static_refusal, tensor_val)
from .moe_router import Router, is_topk, region_between, router_probes, router_site, router_structure
from .moe_tail import (ROUND_Y, canonical, k_reduction, reshapes_static, router_ks, tail_cuts, tail_ends, tail_site,
                       unfuse_addmm)

__all__ = ["MoeFamily", "SPEC"]

aten = torch.ops.aten
_EVAL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.topk.default, aten.gather.default,
             aten.sort.default, aten.sort.stable}
_LITERAL_LIMIT = 8      # float literals tried per constant
_ROUTER_TOL = {"rtol": 1e-5, "atol": 1e-7}

#: What each MoE chain looks for (`dsv41 report --patterns`).
SPEC = register_family(
    "moe", "MoE: router (gate GEMV -> sqrt-softplus -> biased top-k -> normalised unbiased weights); tail "
    "(sum of routed expert outputs + shared expert [-> all-reduce])", (
    Chain("router", "moe_router", "aten.topk(score [.., E], k, dim=-1, largest=True) whose score is computed from one "
          "FP32 mm [R, E] of x and a gate weight", (Role("x", "[.., d]"), Role("W", "[E, d] or [d, E]"),
                                                    Role("bias", "[E] (optional)", "fp32")),
          "dsv41.kernels.moe:reference_moe_router", ("gate_temp", "route_scale", "norm_eps"),
          ("two random x, W", "logits spread ~60 (across softplus's threshold)",
           "logits near -30 (selection decided by the bias; pins eps)"),
          ("static_k", "static_shapes", "router_logits_fp32", "router_topk_values", "router_inputs",
           "router_weights_biased", "router_normalisation", "router_scoring", "router_bias_unused",
           "router_selection", "router_values", "op_registered")),
    Chain("tail", "moe_combine", "sum / mean over dim -2 of a [.., k, d] tensor (or bmm [B, 1, k] x [B, k, d]) "
          "computed from a router with the same k", (Role("y", "[.., k, d]"), Role("shared", "[.., d]"),
                                                     Role("w", "[.., k] (optional)")),
          "dsv41.kernels.moe:reference_moe_combine", (), ("random y, shared at magnitudes 1 and 1000",),
          ("moe_combine_mean", "moe_combine_values", "static_shapes", "op_registered")),
    Chain("tail (y cast taken in)", "moe_combine", "the tail chain whose y is a cast of an FP32 tensor to bf16 / "
          "fp16 that only the tail reads", (Role("y", "[.., k, d]", "float32, rounded by the op"),
                                            Role("shared", "[.., d]"), Role("w", "[.., k] (optional)")),
          "dsv41.kernels.moe:reference_moe_combine(y_dtype)", (), ("the tail chain's probes; the rounding is exact",),
          ("gpu_unvalidated", "op_registered"), variants=(ROUND_Y,)),
),
    # order: after engram: the place it has always run (no dependency between the two is known;
    # tests/test_chain_specs.py pins the order)
    after=("engram",),
)


def _reference():
    from dsv41.kernels import moe
    return moe


def _evaluate(ev, outs, env):
    """Values of `outs` given the probe `env`, or None when the region is not closed over `env`."""
    try:
        memo = ev.evaluate(outs, env)
    except (RegionNotClosed, RuntimeError, IndexError):
        return None
    return [memo[o] for o in outs]


def _pos_literals(nodes) -> list[float]:
    """Positive float literals among the nodes' arguments, in graph order, at most `_LITERAL_LIMIT`."""
    return float_literals(nodes)[:_LITERAL_LIMIT]


def _find_routers(graph: fx.Graph, ev: RegionEvaluator):
    sites, misses = [], []
    for tk in list(graph.nodes):
        if not is_topk(tk):
            continue
        st, miss = router_structure(tk)
        if miss is not None:
            misses.append(miss)
        if st is None:
            continue
        collect(sites, misses, *_verify_router(ev, st))
    return sites, misses


@real_tensors()
def _verify_router(ev, st: Router):
    loc = SourceLocation.from_node(st.topk)
    pattern = "moe router (gate GEMV -> sqrt(softplus) -> biased top-k -> normalised weights)"
    mk = _reference()
    probes = [router_probes(st, seed) for seed in (51, 52)] + [router_probes(st, 53, "large"),
                                                                 router_probes(st, 54, "tiny")]
    reasons = []
    for end in st.ends:
        runs = [_evaluate(ev, [end, st.ids], env) for env, _ in probes]
        if any(r is None for r in runs):
            continue
        region_nodes = region_between([end, st.ids], [st.x, st.weight] + ([st.bias] if st.bias is not None else []))
        lits = _pos_literals(region_nodes)
        temps = [1.0] + [v for v in lits if v != 1.0] + [1.0 / v for v in lits if v != 1.0]
        scales = [1.0] + [v for v in lits if v != 1.0]
        epss = [v for v in lits if v < 1e-2] + [0.0]
        for temp, scale, eps in itertools.product(temps, scales, epss):
            ok = True
            for (got_w, got_ids), (_, (x, w, b)) in zip(runs, probes):
                ref_w, ref_ids = mk.reference_moe_router(x, w, b, st.k, temp, scale, eps)
                if not (torch.equal(got_ids, ref_ids) and close(got_w, ref_w, **_ROUTER_TOL)):
                    ok = False
                    break
            if ok:
                return router_site(st, end, region_nodes, temp, scale, eps), None
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
        """Whether router variant `rule` gives the region's weights and ids on every probe for some (temperature,
        scale, eps) of the candidates."""
        for temp, scale, eps in consts:
            if all(torch.equal(gi, v[1]) and close(gw, v[0], **_ROUTER_TOL)
                   for (gw, gi), (_, (x, w, b)) in zip(runs, probes)
                   for v in [_variant(x, w, b, st.k, temp, scale, eps, **rule)]):
                return True
        return False

    def selects(**rule):
        """Whether router variant `rule` selects the region's expert ids on every probe at some temperature."""
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


def _find_tails(graph: fx.Graph, ev: RegionEvaluator, gated=frozenset()):
    sites, misses = [], []
    done: set = set()
    for red in list(graph.nodes):
        info = k_reduction(red)
        if info is None or red in done:
            continue
        kind, y_in, rows, k, d = info
        if k not in router_ks(y_in):
            continue
        refused = static_refusal("moe", "moe tail (sum of routed experts + shared expert)", [red, y_in],
                                 SourceLocation.from_node(red), "dsv41::moe_combine")
        if refused is not None:
            misses.append(refused)
            continue
        unfuse_addmm(graph, red)
        pos = positions(graph)
        reasons, found = [], None
        for with_w in (True, False):
            for end in tail_ends(red, d, rows * d):
                roles = {"y": (rows * k * d, (k, d)), "shared": (rows * d, (d,))}
                if with_w:
                    roles["w"] = (rows * k, (k,))
                for cut, region in tail_cuts(end, roles, pos):
                    if red not in region or not reshapes_static(end, cut, k):
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
        sites.append(tail_site(end, cut, region, kind, k, gated))
    return sites, misses


@real_tensors()
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
    canon = canonical(end, k)
    for role in ("y", "shared", "w"):
        if role not in cut:
            continue
        n = cut[role]
        v = tensor_val(n)
        p = (torch.rand(concrete_shape(v), generator=gen, dtype=torch.float64) + 0.25 if role == "w"
             else randn_probe(concrete_shape(v), torch.float64, gen, magnitude))
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
    if close_rounded(got, ref):
        return True, None
    yf = vals["y"].float() if w is None else w.float().unsqueeze(-1) * vals["y"].float()
    mean = (yf.mean(-2) + vals["shared"].float()).to(out_dtype)
    if close_rounded(got, mean):
        return False, ("moe_combine_mean", "the expert outputs are AVERAGED over the k experts; the MoE output is "
                       "their sum (the routing weights already sum to route_scale, MODEL.md §2.9 'Output')")
    return False, ("moe_combine_values", "the region reads the routed outputs y [.., k, d] and a shared output [.., d] "
                   "but does not compute sum_j " + ("w_j * " if w is not None else "") + "y_j + shared "
                   "(MODEL.md §2.9 'Output')")


# ------------------------------------------------------------------------------------------------ rewrite + bytes
def _rewrite(graph: fx.Graph, site: Site, op) -> None:
    """Insert the op for `site` and hand it the users of its outputs: the router at its top-k (x, W and bias are
    its ancestors), the tail at its end; views the op reads (W^T -> W, a tail input in the end's leading shape) are
    materialised there."""
    pos = sort_region(graph, site)
    # A view of a parameter is resolved to the parameter now, while the view still has its input.
    params = set(site.params)
    site.inputs_of = {n: [_param_source(a, params) for a in ins] for n, ins in site.inputs_of.items()}
    first = site.anchor if site.op_name == "moe_router" else min(site.outputs, key=pos.__getitem__)
    rewrite_outputs(graph, site, op, first)


def _bytes(site: Site, gone: list):
    """(before, after, symbol values): eager traffic of the removed ops vs the fused op's inputs and outputs; the
    router weight and bias count once per step, everything else per token."""
    params = set(site.params)
    tally = ByteTally(concrete_shape(tensor_val(site.outputs[0]))[:-1], lambda n: n not in params)
    tally.add_removed(gone, site.inputs_of)
    for n in op_inputs(site.args) + list(site.outputs):
        tally.add("after", n)
    return tally.result()


def _param_source(n: fx.Node, params: set) -> fx.Node:
    """The parameter `n` is a view of (its bytes are the parameter's, read once per step), else `n`."""
    m = n
    while is_view_op(m) and m.all_input_nodes:
        m = m.all_input_nodes[0]
        if m in params:
            return m
    return n


class MoeFamily(ChainFamily):
    """Fuse the MoE router and the MoE tail (see module docstring). The finders refuse sizes known only at run time
    themselves, before their value checks; the removed nodes include the `add` of an addmm a tail finder split."""

    spec = SPEC
    kernels = "dsv41.kernels.moe"
    eval_ops = _EVAL_OPS
    hint_args = True
    check_static = False
    count_created = True
    traffic = staticmethod(_bytes)

    def finders(self) -> tuple:
        """Routers, then tails (a tail follows a router with its k), the tails told the gated op variants."""
        return _find_routers, functools.partial(_find_tails, gated=self.gated_ops)

    def rewrite(self, graph: fx.Graph, site: Site, op, replaced: dict) -> dict:
        """`_rewrite` (looked up at call time: tests wrap it); the tail reads no replaced node."""
        _rewrite(graph, site, op)
        return {}
