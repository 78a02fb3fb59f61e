"""`mhc` family: the three mHC chains around every sublayer become one `dsv41::mhc_*` op each.

Chains matched (`SPEC` below, `dsv41 report --patterns mhc`; MODEL.md §2.3; eager code dsv41/model/mhc.py):

    coefficients  z = flatten(H).float(); r = rsqrt(mean(z^2) + norm_eps); m = (z @ fn^T) * r;
                  pre = sigmoid(..) + hc_eps; post = 2 sigmoid(..); comb = Sinkhorn(iters) of m[8:24]
                      -> dsv41::mhc_mixes(H, fn, base, scale, norm_eps, hc_eps, iters) -> (pre, post, comb)
                  or normalise-then-project: m = F.linear(rms_norm(flatten(H), w, norm_eps), fn), w [4d] optional
                      -> dsv41::mhc_mixes(..., iters, norm_weight=w) (structure and the operand's check in
                         passes/mhc_spellings.py; near-misses rms_input, rms_eps, rms_input_leaves)
    expand        H'_j = post_j * y + sum_i comb[i, j] H_i       -> dsv41::mhc_expand(y, H, post, comb)
    collapse+norm x = rms_norm(sum_i pre_i H_i, weight, eps)       -> dsv41::mhc_collapse_rmsnorm(H, pre, weight, eps)

They are searched in that order, so an expand or a collapse usually reads the coefficients as outputs of a fused
`mhc_mixes` (any other producer works too). In the V4.1 model each layer has two coefficient sites and two
expands; collapse + norm occurs twice per layer (attn_norm and ffn_norm inputs) plus once for the final collapse
and final norm before the LM head: 2L, 2L and 2L + 1 matches for L layers.

Structure (cheap, spelling-independent). Coefficients: the anchor is a matmul `[.., 4d] x [4d, 24]` whose left
operand is a view / cast of a four-stream tensor H [B, T, 4, d] and whose right operand a view / cast of a
[24, 4d] (or [4d, 24]) FP32 tensor fn; the region is everything computed from that matmul through dataflow
ops whose other inputs are computed from H, fn, constants and small parameter vectors only (base [24] and
scale [3] are found among those). Expand: the anchor is an add of shape [B, T, 4, d]; collapse + norm: a
reduction over the last dim of a [B, T, d] tensor, and the region ends at a [B, T, d] tensor after it. For
these two the op's inputs are a *cut* of the region found by search: nodes of the inputs' shapes ([B, T, 4, d]
H, [B, T, d] y, [B, T, 4] pre / post, [B, T, 4, 4] comb, [d] weight), nearest first, such that every path from
the end of the region back to graph inputs crosses exactly those nodes.

Semantics (how the constants are settled). The region's own ATen nodes are evaluated on probe tensors
(`RegionEvaluator`, here also evaluating the projection and batched matmuls) and compared with the op's
reference (the eager functions of dsv41/model/mhc.py and norm.py) at FP32-rounding tolerance. The eps values
are taken from the float literals of the region and pinned with probes where they matter: a probe H of
magnitude 1e-4 (mean square 1e-8, so an eps of 1e-6 changes the statistic 10-fold) and a probe whose pre
logits are -20 (so pre = 2e-9 + hc_eps). The Sinkhorn iteration count is found by comparing with 1..64 rounds
on a probe whose logits are an upper-triangular pattern (Sinkhorn converges like 1/k there: rounds k and k + 1
differ by more than 2.8e-4 up to k = 64, far above the tolerance). `iters` is an argument of `mhc_mixes`, so
any count that verifies is fused with that count (recorded in the match detail); the Sinkhorn must end at the
comb tensor the op replaces. A look-alike is a `NearMiss` naming the check that failed, e.g. `sinkhorn_order`
for a Sinkhorn that ends on the row normalisation, `comb_orientation` for an expand that mixes with
comb[j, i], `rms_eps` for an RMS statistic whose eps is not in the region, `collapse_rmsnorm_values` for a
collapse followed by another norm (e.g. mean-centred).

Bytes per match (sympy in B, L): before = what the removed ATen ops read and write when each runs as its own
eager kernel (views free); after = the fused op's inputs and outputs. Parameters count once per step, tensors
computed from activations count per token.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.fx as fx

from ..ref.mhc import HC_MULT, mhc_collapse, mhc_expand, mhc_mixes
from ..ref.norm import rms_norm
from .records import NearMiss, SourceLocation
from .engine import (ByteTally, Chain, ChainFamily, RegionEvaluator, RegionNotClosed, Role, Site, ancestors_within,
                     casts_after, close, close_rounded, collect, concrete_shape, discover, dtype_of, eps_candidates,
                     is_dataflow_op, is_float, node_label, op_inputs, per_token_closure, positions, probe_runs,
                     randn_probe, real_tensors, register_family, resolve_replaced, rewrite_outputs, rms_eps_reason,
                     rms_norm_eps_outside, shape_of, sort_region, static_refusal, tensor_val)
from .mhc_spellings import verify_normalised_input
from .mhc_structure import (BATCHED_MATMULS, N_MIX, coefficient_region, is_last_dim_reduction, mix_probes,
                            most_specific, normalised_further, projection, row_normalised, stream_cuts,
                            strip_identity_views)

__all__ = ["MhcFamily", "N_MIX", "MAX_ITERS_SEARCHED", "SPEC"]

aten = torch.ops.aten
prims = torch.ops.prims
#: Gate name of the collapse op reading a half H through its upcast (validated on an H100 in session 33).
WIDENED = "mhc_collapse_rmsnorm(widened)"
#: Sinkhorn round counts the semantic check tries.
MAX_ITERS_SEARCHED = 64
_FORWARD_NORM = 12      # nodes searched forward from an RMS reduction for the norm's output
_EPS_LIMIT = 1e-2       # float literals below this are eps candidates
_TOL = {"rtol": 1e-4, "atol": 1e-7}  # coefficient check (FP32 rounding of differently spelled chains)

#: What each mHC chain looks for (`dsv41 report --patterns`).
SPEC = register_family(
    "mhc", "mHC: RMS statistic -> 24-wide projection -> sigmoids -> Sinkhorn; expand (post-mix + residual); "
    "collapse -> RMSNorm", (
    Chain("coefficients", "mhc_mixes",
          "mm [.., 4d] x [4d, 24] of a view / cast of H [B, T, 4, d] (or of rms_norm(flatten(H), w)) and of FP32 fn",
          (Role("H", "[B, T, 4, d]"), Role("fn", "[24, 4d] or [4d, 24]", "fp32"), Role("base", "[24]", "fp32"),
           Role("scale", "[3]", "fp32"), Role("norm_weight", "[4d] (optional)")),
          "dsv41.ref.mhc:mhc_mixes", ("norm_eps", "hc_eps", "iters (Sinkhorn rounds, 1..64)"),
          ("random H, comb logit spread ~3", "H scaled by 1e-4 (pins norm_eps)",
           "scale 0, pre logits -20, triangular comb logits (pins hc_eps and the round count)"),
          ("rms_input", "rms_eps", "rms_input_leaves", "coefficient_inputs", "coefficient_dtype", "region_evaluates",
           "post_mix", "pre_mix", "sinkhorn", "sinkhorn_order", "sinkhorn_continues", "intermediate_escapes",
           "static_shapes", "gpu_unvalidated", "op_registered"),
          variants=("mhc_mixes(norm_weight)",)),
    Chain("expand", "mhc_expand", "add of shape [B, T, 4, d] (and an exact cast after it)",
          (Role("y", "[B, T, d]"), Role("H", "[B, T, 4, d]"), Role("post", "[B, T, 4]"), Role("comb", "[B, T, 4, 4]")),
          "dsv41.ref.mhc:mhc_expand", (), ("random y, H; post |N| + 0.5; comb U(0, 1)",),
          ("comb_orientation", "expand_values", "static_shapes", "op_registered")),
    Chain("collapse_rmsnorm", "mhc_collapse_rmsnorm",
          "mean / sum over the last dim of a [B, T, d] tensor, ending at a [B, T, d] tensor after it",
          (Role("H", "[B, T, 4, d]"), Role("pre", "[B, T, 4]"), Role("weight", "[d]")),
          "dsv41.ref.mhc:mhc_collapse + dsv41.ref.norm:rms_norm", ("eps",),
          ("random H at magnitudes 1 and 1e-4 (pins eps)",),
          ("rms_eps", "collapse_rmsnorm_values", "static_shapes", "op_registered")),
    Chain("collapse_rmsnorm (widened)", "mhc_collapse_rmsnorm",
          "the collapse_rmsnorm chain read through an FP32 upcast of a half H and ending at its downcast back",
          (Role("H", "[B, T, 4, d]", "bf16 / fp16"), Role("pre", "[B, T, 4]"), Role("weight", "[d]")),
          "dsv41.ref.mhc:mhc_collapse + dsv41.ref.norm:rms_norm on H.float()", ("eps",),
          ("random H at magnitudes 1 and 1e-4 (pins eps)",),
          ("rms_eps", "collapse_rmsnorm_values", "static_shapes", "op_registered"),
          variants=(WIDENED,)),
),
    # order: after rope_fp4: the place it has always run (no dependency between the two is known;
    # tests/test_chain_specs.py pins the order)
    after=("rope_fp4",),
)


def _eps_literals(nodes) -> list[float]:
    """Float literals among the nodes' arguments below `_EPS_LIMIT` (eps candidates), in graph order, then 0."""
    return eps_candidates(nodes, _EPS_LIMIT)


def _find_mixes(graph: fx.Graph, ev: RegionEvaluator):
    sites, misses = [], []
    for mm in list(graph.nodes):
        proj = projection(mm)
        if proj is None:
            continue
        H, fn, fn_t, normalised = proj
        loc = SourceLocation.from_node(mm)
        pattern = "mhc coefficients (rms -> projection -> sigmoid -> sinkhorn)"
        weight = norm_eps = None
        if normalised is not None:
            pattern = "mhc coefficients (rms_norm -> projection -> sigmoid -> sinkhorn)"
            if normalised.refusal is not None:
                misses.append(NearMiss("mhc", pattern, *normalised.refusal, loc))
                continue
            weight = normalised.weight
        found = coefficient_region(mm, H, fn, weight)
        if found is None:
            continue
        forward, side, small = found
        refused = static_refusal("mhc", pattern, [mm, H, fn, *forward, *side], loc, "dsv41::mhc_mixes")
        if refused is not None:  # before any value check: those see the compiled sizes only
            misses.append(refused)
            continue
        if normalised is not None:  # the operand first: its near-miss names the norm, not a coefficient
            norm_eps, why = verify_normalised_input(ev, mm.args[0], normalised, _eps_literals(normalised.nodes))
            if why is not None:
                misses.append(NearMiss("mhc", pattern, *why, loc))
                continue
        bases = [n for n in small if shape_of(n) == (N_MIX,)]
        scales = [n for n in small if shape_of(n) == (3,)]
        if len(bases) != 1 or len(scales) != 1:
            misses.append(NearMiss("mhc", pattern, "coefficient_inputs",
                                   f"the chain reads {len(bases)} tensor(s) of shape [{N_MIX}] and {len(scales)} of "
                                   f"shape [3]; dsv41::mhc_mixes takes exactly one base [{N_MIX}] and one scale [3]",
                                   loc))
            continue
        base, scale = bases[0], scales[0]
        bad = [n for n in (base, scale) if tensor_val(n).dtype != torch.float32]
        if bad:
            misses.append(NearMiss("mhc", pattern, "coefficient_dtype",
                                   f"base / scale are {tensor_val(bad[0]).dtype}; dsv41::mhc_mixes takes FP32 "
                                   "(the checkpoint stores them in FP32, MODEL.md §2.3)", loc))
            continue
        collect(sites, misses, *_verify_mixes(ev, mm, H, fn, fn_t, base, scale, forward, side, small, loc, pattern,
                                              weight, norm_eps))
    return sites, misses


@real_tensors()
def _verify_mixes(ev, mm, H, fn, fn_t, base, scale, forward, side, small, loc, pattern, weight=None,
                  norm_eps_found=None):
    """Evaluate the coefficient region on the probes and pin (pre, post, comb, norm_eps, hc_eps, iters).
    `norm_eps_found` is given only for the normalise-then-project spelling (the eps its normalised operand was
    verified with, then the only candidate); its RMS `weight` (or None) makes the reference project with fn * w."""
    envs, refs = mix_probes(H, fn, fn_t, small, base, scale, weight)
    try:
        runs = [ev.evaluate(forward, env) for env in envs]
    except (RegionNotClosed, RuntimeError) as e:
        return None, NearMiss("mhc", pattern, "region_evaluates", f"the chain could not be evaluated on probes: {e}",
                              loc)
    hv = tensor_val(H)
    b, t = concrete_shape(hv)[:2]
    vec = [n for n in forward if shape_of(n) == (b, t, HC_MULT) and tensor_val(n).dtype == torch.float32]
    mat = [n for n in forward if shape_of(n) == (b, t, HC_MULT, HC_MULT) and tensor_val(n).dtype == torch.float32]
    lits = _eps_literals(forward + side)

    refs_for: dict = {}

    def reference(norm_eps, hc_eps, iters) -> list:
        """mhc_mixes of each probe (cached: the searches below ask for the same parameters repeatedly)."""
        key = (norm_eps, hc_eps, iters)
        if key not in refs_for:
            refs_for[key] = [mhc_mixes(*ref, norm_eps, hc_eps, iters) for ref in refs]
        return refs_for[key]

    def find(cands, wanted: list, exclude=(), probes=(0, 1, 2)):
        """The first node of `cands` (not in `exclude`) whose value in every probe run `i` of `probes` is close
        (`_TOL`) to `wanted[i]`; None if there is none."""
        for n in cands:
            if n not in exclude and all(close(runs[i][n], wanted[i], **_TOL) for i in probes):
                return n
        return None

    norm_lits = lits if norm_eps_found is None else [norm_eps_found]
    norm_eps, post = discover(norm_lits, lambda e: find(vec, [r[1] for r in reference(e, 0.0, 1)]))
    if post is None:
        # Probes A and C do not depend on norm_eps (|H| ~ 1, or scale = 0); B does (|H| ~ 1e-4).
        if any(find(vec, [r[1] for r in reference(e, 0.0, 1)], probes=(0, 2)) is not None for e in norm_lits):
            return None, NearMiss("mhc", pattern, "rms_eps",
                                  f"the RMS statistic's eps is none of the chain's literals {norm_lits}", loc)
        return None, NearMiss("mhc", pattern, "post_mix",
                              "no tensor of the chain equals post = 2 * sigmoid(m[4:8] * scale[1] + base[4:8]) with "
                              "m = (flatten(H) @ fn^T) * rsqrt(mean(z^2) + eps) (MODEL.md §2.3 steps 2, 3, 5)", loc)
    hc_eps, pre = discover(lits, lambda e: find(vec, [r[0] for r in reference(norm_eps, e, 1)], exclude=(post,)))
    if pre is None:
        return None, NearMiss("mhc", pattern, "pre_mix",
                              "no tensor of the chain equals pre = sigmoid(m[0:4] * scale[0] + base[0:4]) + hc_eps "
                              f"for hc_eps in {lits} (MODEL.md §2.3 step 4)", loc)
    # First guess: two divisions of a [B, T, 4, 4] tensor per round (softmax + column, then row + column).
    n_div = sum(1 for n in mat if n.target in (aten.div.Tensor, prims.div.default))
    order = [n_div // 2, n_div // 2 + 1, n_div // 2 - 1] + list(range(1, MAX_ITERS_SEARCHED + 1))
    iters, comb = discover(dict.fromkeys(o for o in order if 1 <= o <= MAX_ITERS_SEARCHED),
                           lambda k: find(mat, [r[2] for r in reference(norm_eps, hc_eps, k)]))
    if comb is None:
        return None, NearMiss("mhc", pattern, "sinkhorn",
                              "no tensor of the chain equals Sinkhorn(softmax_j(logits) + hc_eps, column first, then "
                              f"row/column) of the comb logits for 1..{MAX_ITERS_SEARCHED} rounds (MODEL.md §2.3 "
                              "step 6)", loc)
    # The Sinkhorn must end at comb: a further normalisation of it inside the chain is another algorithm (and
    # fusing the prefix would hide it), e.g. a last row normalisation.
    more = normalised_further(comb, forward)
    if more is not None:
        ends_on_rows = all(close(runs[i][more], row_normalised(runs[i][comb], hc_eps), **_TOL) for i in range(3))
        if ends_on_rows:
            return None, NearMiss(
                "mhc", pattern, "sinkhorn_order",
                f"the Sinkhorn normalisation ends on the row (destination-axis) normalisation after {iters} rounds; "
                "dsv41::mhc_mixes ends on the column (source-axis) normalisation (MODEL.md §2.3 step 6)", loc)
        return None, NearMiss("mhc", pattern, "sinkhorn_continues",
                              f"after {iters} Sinkhorn rounds the chain divides the stream-mixing matrix again "
                              f"({node_label(more)} {more.name}); dsv41::mhc_mixes ends on the column "
                              "normalisation (MODEL.md §2.3 step 6)", loc)
    chain = ancestors_within({pre, post, comb}, set(forward) | {mm})
    escaping = [n for n in chain if n not in (pre, post, comb)
                and any(u not in chain for u in n.users)]
    if escaping:
        e = escaping[0]
        user = next(u for u in e.users if u not in chain)
        return None, NearMiss("mhc", pattern, "intermediate_escapes",
                              f"{node_label(e)} ({e.name}) inside the chain is also read by {node_label(user)} "
                              f"({user.name}); fusing would compute the chain twice", loc)
    fn_arg = ("permute", fn) if fn_t else fn
    # The region: the chain and the side nodes it reads (the RMS statistic, views of H and fn), not side nodes
    # that only other consumers in `forward` read.
    inside = ancestors_within({pre, post, comb}, chain | set(side))
    region = [n for n in (forward + side + [mm]) if n in inside]
    detail = (("iters", iters), ("norm_eps", norm_eps), ("hc_eps", hc_eps), ("d", concrete_shape(hv)[3]),
              ("fn_layout", "[4d, 24]" if fn_t else "[24, 4d]"))
    args = (H, fn_arg, base, scale, norm_eps, hc_eps, iters)
    if norm_eps_found is not None:  # the normalise-then-project spelling
        wdt = "none" if weight is None else str(tensor_val(weight).dtype).replace("torch.", "")
        detail += (("spelling", "rms_norm -> projection"), ("norm_weight", wdt))
        args += (weight,) if weight is not None else ()
    variant = "mhc_mixes(norm_weight)" if len(args) == 8 else None  # gated apart from the plain op
    return Site("mhc_mixes", "mhc_mixes", mm, args, (pre, post, comb), region, (H,), detail, variant=variant), None


def _find_expands(graph: fx.Graph, ev: RegionEvaluator):
    sites, misses = [], []
    pos = positions(graph)
    for add in list(graph.nodes):
        if add.op != "call_function" or add.target != aten.add.Tensor or not is_float(add):
            continue
        shp = shape_of(add)
        if len(shp) != 4 or shp[2] != HC_MULT:
            continue
        b, t, _, d = shp
        roles = {"y": (b, t, d), "H": shp, "post": (b, t, HC_MULT), "comb": (b, t, HC_MULT, HC_MULT)}
        # The result may be cast back to H's dtype after the add: try the cast first (it is the op's output).
        ends = casts_after(add, shp)
        reasons, found = [], False
        for end in reversed(ends):
            for cut, region in stream_cuts(end, roles, pos):
                refused = static_refusal("mhc", "mhc expand (post-mix + stream mixing)", [end, *cut.values(), *region],
                                         SourceLocation.from_node(add), "dsv41::mhc_expand")
                if refused is not None:  # the value check below would see the compiled sizes only
                    misses.append(refused)
                    reasons, found = [], True
                    break
                ok, why_cut = _verify_expand(ev, end, cut)
                if ok:
                    sites.append(Site("mhc_expand", "mhc_expand", end,
                                       (cut["y"], cut["H"], cut["post"], cut["comb"]), (end,), region,
                                       (cut["y"], cut["H"], cut["post"], cut["comb"]), (("d", d),)))
                    found = True
                    break
                if why_cut is not None:
                    reasons.append((why_cut, add))
            if found:
                break
        if not found and reasons:
            misses.append(NearMiss("mhc", "mhc expand (post-mix + stream mixing)", *most_specific(reasons)[0],
                                   SourceLocation.from_node(add)))
    return sites, misses


@real_tensors()
def _verify_expand(ev, end, cut):
    gen = torch.Generator().manual_seed(43)
    env, refs = {}, {}
    for role in ("y", "H", "post", "comb"):
        n = cut[role]
        v = tensor_val(n)
        p = randn_probe(concrete_shape(v), torch.float64, gen)
        if role == "post":
            p = p.abs() + 0.5
        elif role == "comb":
            p = torch.rand(concrete_shape(v), generator=gen, dtype=torch.float64)
        env[n] = p.to(v.dtype).to(v.device)
        refs[role] = env[n]
    try:
        got = ev.evaluate([end], env)[end]
    except (RegionNotClosed, RuntimeError):
        return False, None
    ref = mhc_expand(refs["y"], refs["H"], refs["post"], refs["comb"])
    if close_rounded(got, ref):
        return True, None
    if close_rounded(got, mhc_expand(refs["y"], refs["H"], refs["post"], refs["comb"].transpose(-1, -2))):
        return False, ("comb_orientation", "the streams are mixed with comb[j, i] (rows as destinations); "
                       "dsv41::mhc_expand computes H'_j = post_j * y + sum_i comb[i, j] H_i with i the source "
                       "stream (MODEL.md §2.3)")
    return False, ("expand_values", "the region reads y [B, T, d], H [B, T, 4, d], post [B, T, 4] and comb "
                   "[B, T, 4, 4] but does not compute post_j * y + sum_i comb[i, j] H_i (MODEL.md §2.3 expand)")


def _find_collapse_norms(graph: fx.Graph, ev: RegionEvaluator):
    sites, misses = [], []
    pos = positions(graph)
    done: set = set()
    for red in list(graph.nodes):
        if red in done or not is_last_dim_reduction(red):
            continue
        b, t, d = concrete_shape(tensor_val(red.args[0]))
        ends, queue = [], deque(red.users)
        seen = {red}
        while queue and len(seen) < _FORWARD_NORM:
            u = queue.popleft()
            if u in seen or u.op != "call_function" or not is_dataflow_op(u):
                continue
            seen.add(u)
            if is_float(u) and shape_of(u) == (b, t, d):
                ends.append(u)
            queue.extend(u.users)
        roles = {"H": (b, t, HC_MULT, d), "pre": (b, t, HC_MULT), "weight": (d,)}
        reasons, matched = [], False
        for end in ends:
            if end in done:
                continue
            for cut, region in stream_cuts(end, roles, pos):
                refused = static_refusal("mhc", "mhc collapse -> rmsnorm", [end, *cut.values(), *region],
                                         SourceLocation.from_node(end), "dsv41::mhc_collapse_rmsnorm")
                if refused is not None:
                    misses.append(refused)
                    done.update(region)
                    done.add(end)
                    reasons, matched = [], True
                    break
                eps, why = _verify_collapse_norm(ev, end, cut, region)
                if eps is not None:
                    sites.append(_collapse_site(end, cut, region, eps, d))
                    done.update(region)
                    done.add(end)
                    matched = True
                    break
                if why is not None:
                    reasons.append((why, end))
            if matched:
                break
        if not matched and reasons and not any(e in done for _, e in reasons):
            why, end = most_specific(reasons)
            misses.append(NearMiss("mhc", "mhc collapse -> rmsnorm", *why, SourceLocation.from_node(end)))
            done.update(e for _, e in reasons)
    return sites, misses


def _collapse_site(end, cut, region, eps, d) -> Site:
    """The verified collapse + RMSNorm site; widened when H is an FP32 upcast of a half tensor and the result's
    only use is its downcast back to that dtype (the graph torch < 2.13 leaves once Inductor removed the round trip
    between the collapse and the norm): the op then reads the half H and writes the half result itself, the two
    casts' copies gone. Exact: it computes what the FP32 op computes, rounded once as the downcast rounds."""
    h, out, region, variant = cut["H"], end, list(region), None
    half, passed = strip_identity_views(h, upcasts=True)
    after = casts_after(end, shape_of(end))
    if dtype_of(h) == torch.float32 and dtype_of(half) in (torch.bfloat16, torch.float16) and len(after) >= 2 \
            and dtype_of(after[1]) == dtype_of(half):
        h, out, variant = half, after[1], WIDENED
        region += [out] + [n for n in passed if n not in region]
    args = (h, cut["pre"], cut["weight"], eps) + ((True,) if variant else ())
    return Site("mhc_collapse_rmsnorm", "mhc_collapse_rmsnorm", end, args, (out,), region, (h, cut["pre"]),
                (("eps", eps), ("d", d), ("widened", variant is not None)), variant=variant)


@real_tensors()
def _verify_collapse_norm(ev, end, cut, region):
    """(eps, None) when the region computes rms_norm(collapse(H, pre), weight, eps) for one of its literals."""
    gen = torch.Generator().manual_seed(47)
    hv, pv, wv = (tensor_val(cut[r]) for r in ("H", "pre", "weight"))
    h = randn_probe(concrete_shape(hv), torch.float64, gen)
    pre = torch.rand(concrete_shape(pv), generator=gen, dtype=torch.float64).to(pv.dtype)
    w = (0.5 + torch.rand(concrete_shape(wv), generator=gen, dtype=torch.float64)).to(wv.dtype)
    envs = [{cut["H"]: (h * s).to(hv.dtype), cut["pre"]: pre, cut["weight"]: w} for s in (1.0, 1e-4)]
    runs = probe_runs(ev, end, envs)
    if runs is None:
        return None, None
    lits = _eps_literals(region)
    for eps in lits:
        if all(close_rounded(got, rms_norm(mhc_collapse(env[cut["H"]], pre), w, eps))
               for got, env in zip(runs, envs)):
            return eps, None
    if any(close_rounded(runs[0], rms_norm(mhc_collapse(envs[0][cut["H"]], pre), w, eps)) for eps in lits):
        return None, rms_eps_reason(lits, lambda eps: all(
            close_rounded(got, rms_norm_eps_outside(mhc_collapse(env[cut["H"]], pre), w, eps))
            for got, env in zip(runs, envs)))
    return None, ("collapse_rmsnorm_values", "the region reads H [B, T, 4, d], pre [B, T, 4] and a weight [d] but "
                  "does not compute rms_norm(sum_i pre_i H_i, weight, eps) (MODEL.md §2.2, §2.3 collapse)")


# ------------------------------------------------------------------------------------------------ rewrite + bytes
def _rewrite(graph: fx.Graph, site: Site, op, replaced: dict) -> dict:
    """Insert `op(*site.args)` (arguments through the earlier replacements) before the site's first output and hand
    it the outputs' users; returns {old output: its replacement node}."""
    site.args = resolve_replaced(site.args, replaced)
    site.activations = resolve_replaced(site.activations, replaced)  # the per-token byte accounting reads them
    pos = sort_region(graph, site)
    return rewrite_outputs(graph, site, op, min(site.outputs, key=pos.__getitem__))


def _bytes(site: Site, gone: list):
    """(before, after, symbol values): eager traffic of the removed ops vs the fused op's inputs and outputs; the
    activations, what the region computes from them and the outputs count per token."""
    per_token = per_token_closure(site.activations, site.region, site.inputs_of) | set(site.outputs)
    tally = ByteTally(concrete_shape(tensor_val(site.activations[0]))[:2], per_token.__contains__)
    tally.add_removed(gone, site.inputs_of)
    for n in op_inputs(site.args) + list(site.outputs):
        tally.add("after", n)
    return tally.result()


class MhcFamily(ChainFamily):
    """Fuse the mHC coefficient, expand and collapse + RMSNorm chains (see module docstring); coefficients first, so
    an expand or a collapse reads the outputs of a fused `mhc_mixes`."""

    spec = SPEC
    kernels = "dsv41.kernels.mhc"
    eval_ops = BATCHED_MATMULS | {aten.mm.default}
    rewrite = staticmethod(_rewrite)
    traffic = staticmethod(_bytes)

    def finders(self) -> tuple:
        """Coefficients, then expands, then collapse + RMSNorm chains."""
        return _find_mixes, _find_expands, _find_collapse_norms
