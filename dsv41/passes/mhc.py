"""`mhc` family: the three mHC chains around every sublayer become one `dsv41::mhc_*` op each.

Chains matched (ARCHITECTURE.md "Fusion patterns", row "mHC"; MODEL.md §2.3; eager code dsv41/model/mhc.py):

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

import contextlib
import dataclasses
import itertools
import operator
from collections import deque
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..model.mhc import HC_MULT, mhc_collapse, mhc_expand, mhc_mixes
from ..model.norm import rms_norm
from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (FusionFamily, RegionEvaluator, RegionNotClosed, concrete_shape, dsv41_op, eliminate_dead_code,
                     insert_node, is_dataflow_op, is_table_lookup, is_view_op, node_label, rms_eps_reason,
                     rms_norm_eps_outside, static_refusal, tensor_val, token_rows)
from .mhc_spellings import normalised_input, verify_normalised_input

__all__ = ["MhcFamily", "N_MIX", "MAX_ITERS_SEARCHED"]

aten = torch.ops.aten
prims = torch.ops.prims
#: Coefficients per token: 4 pre, 4 post, 16 comb.
N_MIX = (2 + HC_MULT) * HC_MULT
#: Sinkhorn round counts the semantic check tries.
MAX_ITERS_SEARCHED = 64
_BATCHED_MATMULS = {aten.bmm.default, aten.baddbmm.default}
_PASS_THROUGH = {prims.convert_element_type.default, aten.clone.default, aten._to_copy.default}
_CHAIN_LIMIT = 600      # nodes of a coefficient region (20 Sinkhorn rounds are ~130)
_RESOLVE_LIMIT = 200    # nodes walked back from one side input of a coefficient region
_CUT_REGION = 80        # nodes searched back from the end of a collapse / expand for the op's inputs
_FORWARD_NORM = 12      # nodes searched forward from an RMS reduction for the norm's output
_PER_ROLE = 6           # candidates tried per input of a collapse / expand
_SMALL_PARAM = 64       # graph inputs up to this many elements may be base / scale
_EPS_LIMIT = 1e-2       # float literals below this are eps candidates
_TOL = {"rtol": 1e-4, "atol": 1e-7}  # coefficient check (FP32 rounding of differently spelled chains)


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
    detail: tuple
    inputs_of: dict = dataclasses.field(default_factory=dict)  # region node -> its inputs, kept at rewrite time


class MhcFamily(FusionFamily):
    """Fuse the mHC coefficient, expand and collapse + RMSNorm chains (see module docstring)."""

    name = "mhc"
    summary = ("mHC: RMS statistic -> 24-wide projection -> sigmoids -> Sinkhorn; expand (post-mix + residual); "
               "collapse -> RMSNorm")

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Replace every verified mHC coefficient, expand and collapse + RMSNorm chain of `gm` with the dsv41::mhc_*
        ops; returns the record (matches, near-misses with the failed check)."""
        _register_ops()
        graph = gm.graph
        start = set(graph.nodes)
        ev = _Evaluator(gm)
        sites: list[_Site] = []
        misses: list[NearMiss] = []
        missing = set()
        # A finder verifies all of its sites before any is rewritten, so a site may read the output of another of
        # the same finder (layer i's attention expand feeds its FFN expand the residual): its captured argument is
        # then the node the earlier rewrite replaced, and using it would keep the whole eager chain alive next to
        # the fused op (a second expand: bmm + pointwise kernels, every layer). Arguments go through `replaced`.
        replaced: dict = {}
        for finder in (_find_mixes, _find_expands, _find_collapse_norms):
            found, near = finder(graph, ev)
            misses.extend(near)
            for site in found:
                refused = static_refusal(self.name, site.pattern, [*site.args, *site.outputs, *site.region],
                                         SourceLocation.from_node(site.anchor), f"dsv41::{site.op_name}")
                if refused is not None:
                    misses.append(refused)
                    continue
                variant = "mhc_mixes(norm_weight)" if site.op_name == "mhc_mixes" and len(site.args) == 8 else None
                if variant in self.gated_ops:
                    misses.append(NearMiss(self.name, site.pattern, "gpu_unvalidated",
                                           f"dsv41::{variant} has not yet run on a GPU, so on CUDA this chain stays "
                                           "with Inductor (option gpu_unvalidated=True fuses it)",
                                           SourceLocation.from_node(site.anchor)))
                    continue
                op = dsv41_op(site.op_name)
                if op is None:
                    missing.add(site.op_name)
                    misses.append(NearMiss(self.name, site.pattern, "op_registered",
                                           f"dsv41::{site.op_name} is not registered (import dsv41.kernels.mhc)",
                                           SourceLocation.from_node(site.anchor)))
                    continue
                site.args = _resolve(site.args, replaced)
                site.activations = _resolve(site.activations, replaced)  # the per-token byte accounting reads them
                replaced.update(_rewrite(graph, site, op))
                sites.append(site)
            eliminate_dead_code(graph)
        from torch._inductor.pattern_matcher import stable_topological_sort
        stable_topological_sort(graph)
        eliminate_dead_code(graph)
        removed = start - set(graph.nodes)
        matches = []
        for s in sites:  # a removed node shared by two regions counts for the first match only
            matches.append(_record(self.name, s, removed))
            removed = removed - set(s.region)
        matches = tuple(matches)
        note = f"ops not registered: {', '.join(sorted(missing))}" if missing else ""
        return PassRecord(self.name, True, matches, tuple(misses), (), note)


def _register_ops() -> None:
    """Import the kernels module that registers the `dsv41::mhc_*` ops (a chain whose op is missing is reported
    as a near-miss `op_registered`)."""
    try:
        import dsv41.kernels.mhc  # noqa: F401
    except ImportError:
        pass


# ------------------------------------------------------------------------------------------------ evaluation
class _Evaluator(RegionEvaluator):
    """`RegionEvaluator` that also evaluates matmuls (the coefficient projection, `comb^T @ H` in the expand,
    an einsum collapse): deterministic functions of their inputs, like the dataflow ops the base class accepts."""

    def _compute(self, n: fx.Node, memo: dict):
        if n.op == "call_function" and (n.target in _BATCHED_MATMULS or n.target == aten.mm.default):
            args = fx.node.map_aggregate(n.args, lambda a: memo[a] if isinstance(a, fx.Node) else a)
            kwargs = fx.node.map_aggregate(n.kwargs, lambda a: memo[a] if isinstance(a, fx.Node) else a)
            return n.target(*args, **kwargs)
        return super()._compute(n, memo)


@contextlib.contextmanager
def _real_tensors():
    """Run reference math on real tensors even inside Inductor's compile (no fake mode, no dispatch modes)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes(), torch.no_grad():
        yield


def _close(got, ref: torch.Tensor, rtol: float, atol: float) -> bool:
    """Same shape and dtype, finite, and |got - ref| <= atol + rtol |ref| elementwise."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(ref.shape) or got.dtype != ref.dtype:
        return False
    g, r = got.double().cpu(), ref.double().cpu()  # probes may have run on the graph's device
    return bool(torch.isfinite(g).all()) and bool(((g - r).abs() <= atol + rtol * r.abs()).all())


def _close_rounded(got, ref: torch.Tensor) -> bool:
    """Agreement up to one rounding of the result dtype (FP32: a few ulps of a differently ordered sum)."""
    if not isinstance(ref, torch.Tensor):
        return False
    eps = torch.finfo(ref.dtype).eps
    rtol = max(eps, 1e-5)
    return _close(got, ref, rtol, rtol * 1e-2 * float(ref.double().abs().max()))


def _literals(nodes) -> list[float]:
    """Float literals among the nodes' arguments below `_EPS_LIMIT` (eps candidates), in graph order, then 0."""
    out: list[float] = []

    def visit(a):
        """Collect `a` when it is an eps candidate (a float in (0, _EPS_LIMIT) not seen yet); returns it unchanged."""
        if isinstance(a, float) and 0.0 < a < _EPS_LIMIT and a not in out:
            out.append(a)
        return a

    for n in nodes:
        fx.node.map_aggregate(n.args, visit)
        fx.node.map_aggregate(n.kwargs, visit)
    return out + [0.0]


def _position(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def _shape(n) -> tuple | None:
    v = tensor_val(n)
    return concrete_shape(v) if v is not None else None


def _is_float(n) -> bool:
    v = tensor_val(n)
    return v is not None and v.is_floating_point()


def _probe(shape, dtype, gen, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def _is_shape_value(n: fx.Node) -> bool:
    """Shape arithmetic (a SymInt / int node): evaluated from the compiled shapes, never from tensor data."""
    return isinstance(n.meta.get("val"), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def _is_step(n: fx.Node) -> bool:
    """A node a region may contain: a dataflow op, a constant-table lookup, or an item of a dataflow op's
    tuple result (`split` / `unbind`)."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and is_dataflow_op(src)
    return is_dataflow_op(n) or is_table_lookup(n)


_FP32_EXACT = (torch.float32, torch.bfloat16, torch.float16)
_IDENTITY_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                   aten.alias.default}


def _strip_identity_views(n: fx.Node, upcasts: bool):
    """(source, passed): the tensor `n` is an identity view of (a view / reshape / expand to the same shape),
    else `n`, and the nodes passed on the way; with `upcasts`, also the tensor an exact cast to FP32 reads (for
    inputs the op reads in FP32 anyway, so the cast is not materialised for the op)."""
    passed = []
    while n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) and tensor_val(n.args[0]) is not None:
        src = n.args[0]
        same = _shape(src) == _shape(n)
        identity = n.target in _IDENTITY_VIEWS and same and tensor_val(src).dtype == tensor_val(n).dtype
        upcast = (upcasts and same and n.target == prims.convert_element_type.default
                  and tensor_val(n).dtype == torch.float32 and tensor_val(src).dtype in _FP32_EXACT)
        if not (identity or upcast):
            break
        passed.append(n)
        n = src
    return n, passed


# ------------------------------------------------------------------------------------------------ coefficients
def _chain_back(n) -> list:
    """`n` and the tensors it is a view, copy or exact cast of, nearest first (a rounding cast, e.g. FP32 ->
    bf16, ends the chain: the tensor before it holds other values)."""
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


def _exact_cast(src: fx.Node, dst: fx.Node) -> bool:
    """Whether every value of `src`'s dtype is exactly representable in `dst`'s dtype."""
    a, b = tensor_val(src).dtype, tensor_val(dst).dtype
    return a == b or (b == torch.float32 and a in _FP32_EXACT) or (b == torch.float64 and a.is_floating_point)


def _projection(mm: fx.Node):
    """(H, fn, fn_transposed, normalised) when `mm` is `[.., 4d] x [4d, 24]` with the right operand a view / cast
    of an FP32 [24, 4d] or [4d, 24] tensor fn and the left one a view / cast of a [B, T, 4, d] tensor H
    (normalised None), or computed from H (and an RMS weight) through dataflow ops (normalised: the
    `mhc_spellings.NormalisedInput`, possibly a refusal); else None."""
    if mm.op != "call_function" or mm.target != aten.mm.default:
        return None
    rs = _shape(mm.args[1])
    if rs is None or len(rs) != 2 or rs[1] != N_MIX or rs[0] % HC_MULT:
        return None
    k = rs[0]
    fs = [n for n in _chain_back(mm.args[1]) if tensor_val(n).dtype == torch.float32
          and _shape(n) in ((N_MIX, k), (k, N_MIX))]
    if not fs:
        return None
    fn = fs[-1]
    hs = [n for n in _chain_back(mm.args[0]) if _is_float(n) and len(_shape(n)) == 4
          and _shape(n)[2:] == (HC_MULT, k // HC_MULT)]
    if hs:
        return hs[-1], fn, _shape(fn) == (k, N_MIX), None
    normalised = normalised_input(mm.args[0], k)
    return None if normalised is None else (normalised.H, fn, _shape(fn) == (k, N_MIX), normalised)


class _Resolver:
    """Decides which side inputs a coefficient region may read: tensors computed (through dataflow ops) only
    from H, fn, constants and small parameter vectors (the candidates for base and scale)."""

    def __init__(self, stops: set):
        self.stops = stops
        self.memo: dict = {}
        self.small: list = []
        self.side: list = []

    def __call__(self, a: fx.Node) -> bool:
        if a in self.memo:
            return self.memo[a]
        todo, seen, small, ok = [a], [], [], True
        while todo and ok:
            n = todo.pop()
            if n in self.memo or n in seen:
                ok = self.memo.get(n, True)
                continue
            seen.append(n)
            v = tensor_val(n)
            if len(seen) > _RESOLVE_LIMIT:
                ok = False
            elif n in self.stops or _is_shape_value(n):
                continue
            elif n.op in ("placeholder", "get_attr"):
                if v is not None and v.is_floating_point() and v.numel() <= _SMALL_PARAM:
                    small.append(n)
                elif not (n.op == "get_attr" and v is not None and v.numel() <= 256):
                    ok = False
            elif _is_step(n):
                todo.extend(n.all_input_nodes)
            else:
                ok = False
        if not ok:
            self.memo[a] = False
            return False
        for n in seen:
            self.memo[n] = True
            if n.op == "call_function" and n not in self.side:
                self.side.append(n)
        self.small.extend(n for n in small if n not in self.small)
        return True


def _coefficient_region(mm: fx.Node, H: fx.Node, fn: fx.Node, weight: fx.Node | None = None):
    """(forward nodes, side nodes, small parameter leaves) of the chain anchored at `mm`, or None if too large.
    `weight` (the RMS weight [4d] of the normalise-then-project spelling) is an input like H and fn."""
    resolve = _Resolver({H, fn} if weight is None else {H, fn, weight})
    if not (resolve(mm.args[0]) and resolve(mm.args[1])):
        return None
    region = {mm}
    forward: list = []
    queue = deque(mm.users)
    while queue:
        u = queue.popleft()
        if u in region or not _is_step(u):
            continue
        if all(a in region or resolve(a) for a in u.all_input_nodes):
            region.add(u)
            forward.append(u)
            if len(forward) > _CHAIN_LIMIT:
                return None
            queue.extend(u.users)
    return forward, resolve.side, resolve.small


_TRIANGLE = torch.tensor([[0.0, 0.0, 0.0, 0.0], [-30.0, 0.0, 0.0, 0.0], [-30.0, -30.0, 0.0, 0.0],
                          [-30.0, -30.0, -30.0, 0.0]])


def _mix_probes(H: fx.Node, fn: fx.Node, fn_t: bool, small: list, base: fx.Node, scale: fx.Node,
                weight: fx.Node | None = None):
    """Three probe environments (node -> tensor) and the matching reference arguments (H, fn [24, 4d], base,
    scale): A random with comb logits of spread ~3; B the same with H scaled by 1e-4 (pins norm_eps); C with
    scale = 0 and base = (-20 for pre, random for post, the triangular pattern for comb) (pins hc_eps and the
    Sinkhorn round count). An RMS `weight` w gets 0.5 + U(0, 1) in its dtype, and the reference fn is then
    fn * w[None, :] (F.linear(z * r * w, fn) = ((fn * w) @ z) * r), rounded to FP32 once."""
    gen = torch.Generator().manual_seed(41)
    hv, fv = tensor_val(H), tensor_val(fn)
    hs = concrete_shape(hv)
    k = HC_MULT * hs[3]
    fn_p = torch.randn(N_MIX, k, generator=gen, dtype=torch.float64) / k ** 0.5
    base_a = torch.randn(N_MIX, generator=gen, dtype=torch.float64)
    scale_a = torch.tensor([0.9, 1.1, 3.0], dtype=torch.float64)
    base_c = torch.cat([torch.full((4,), -20.0, dtype=torch.float64), torch.randn(4, generator=gen).double(),
                        _TRIANGLE.double().flatten()])
    scale_c = torch.zeros(3, dtype=torch.float64)
    h_a = _probe(hs, hv.dtype, gen)
    h_c = _probe(hs, hv.dtype, gen)
    # Every probe lives on its node's device: the region's own ops (and any constants it creates) run there.
    others = {n: _probe(concrete_shape(tensor_val(n)), tensor_val(n).dtype, gen).to(tensor_val(n).device)
              for n in small if n not in (base, scale)}
    fn_ref = fn_p.float()
    if weight is not None:  # drawn last: the other probes are those of the unweighted spelling
        wv = tensor_val(weight)
        w = (0.5 + torch.rand(k, generator=gen, dtype=torch.float64)).to(wv.dtype)
        others[weight] = w.to(wv.device)
        fn_ref = (fn_p * w.double()[None, :]).float()
    envs, refs = [], []
    for h, b, s in ((h_a, base_a, scale_a), ((h_a.double() * 1e-4).to(hv.dtype), base_a, scale_a),
                    (h_c, base_c, scale_c)):
        f32 = fn_p.float()
        env = {H: h.to(hv.device), fn: (f32.t().contiguous() if fn_t else f32).to(fv.device),
               base: b.to(tensor_val(base).dtype).to(tensor_val(base).device),
               scale: s.to(tensor_val(scale).dtype).to(tensor_val(scale).device)}
        env.update(others)
        envs.append(env)
        refs.append((h, fn_ref, b.float(), s.float()))
    return envs, refs


def _row_normalised(c: torch.Tensor, eps: float) -> torch.Tensor:
    return c / (c.sum(dim=-1, keepdim=True) + eps)


def _find_mixes(graph: fx.Graph, ev: _Evaluator):
    sites, misses = [], []
    for mm in list(graph.nodes):
        proj = _projection(mm)
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
        found = _coefficient_region(mm, H, fn, weight)
        if found is None:
            continue
        forward, side, small = found
        refused = static_refusal("mhc", pattern, [mm, H, fn, *forward, *side], loc, "dsv41::mhc_mixes")
        if refused is not None:  # before any value check: those see the compiled sizes only
            misses.append(refused)
            continue
        if normalised is not None:  # the operand first: its near-miss names the norm, not a coefficient
            norm_eps, why = verify_normalised_input(ev, mm.args[0], normalised, _literals(normalised.nodes))
            if why is not None:
                misses.append(NearMiss("mhc", pattern, *why, loc))
                continue
        bases = [n for n in small if _shape(n) == (N_MIX,)]
        scales = [n for n in small if _shape(n) == (3,)]
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
        site, miss = _verify_mixes(ev, mm, H, fn, fn_t, base, scale, forward, side, small, loc, pattern, weight,
                                   norm_eps)
        if site is not None:
            sites.append(site)
        if miss is not None:
            misses.append(miss)
    return sites, misses


@_real_tensors()
def _verify_mixes(ev, mm, H, fn, fn_t, base, scale, forward, side, small, loc, pattern, weight=None,
                  norm_eps_found=None):
    """Evaluate the coefficient region on the probes and pin (pre, post, comb, norm_eps, hc_eps, iters).
    `norm_eps_found` is given only for the normalise-then-project spelling (the eps its normalised operand was
    verified with, then the only candidate); its RMS `weight` (or None) makes the reference project with fn * w."""
    envs, refs = _mix_probes(H, fn, fn_t, small, base, scale, weight)
    try:
        runs = [ev.evaluate(forward, env) for env in envs]
    except (RegionNotClosed, RuntimeError) as e:
        return None, NearMiss("mhc", pattern, "region_evaluates", f"the chain could not be evaluated on probes: {e}",
                              loc)
    hv = tensor_val(H)
    b, t = concrete_shape(hv)[:2]
    vec = [n for n in forward if _shape(n) == (b, t, HC_MULT) and tensor_val(n).dtype == torch.float32]
    mat = [n for n in forward if _shape(n) == (b, t, HC_MULT, HC_MULT) and tensor_val(n).dtype == torch.float32]
    lits = _literals(forward + side)

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
            if n not in exclude and all(_close(runs[i][n], wanted[i], **_TOL) for i in probes):
                return n
        return None

    post = norm_eps = None
    norm_lits = lits if norm_eps_found is None else [norm_eps_found]
    for e in norm_lits:
        post = find(vec, [r[1] for r in reference(e, 0.0, 1)])
        if post is not None:
            norm_eps = e
            break
    if post is None:
        # Probes A and C do not depend on norm_eps (|H| ~ 1, or scale = 0); B does (|H| ~ 1e-4).
        if any(find(vec, [r[1] for r in reference(e, 0.0, 1)], probes=(0, 2)) is not None for e in norm_lits):
            return None, NearMiss("mhc", pattern, "rms_eps",
                                  f"the RMS statistic's eps is none of the chain's literals {norm_lits}", loc)
        return None, NearMiss("mhc", pattern, "post_mix",
                              "no tensor of the chain equals post = 2 * sigmoid(m[4:8] * scale[1] + base[4:8]) with "
                              "m = (flatten(H) @ fn^T) * rsqrt(mean(z^2) + eps) (MODEL.md §2.3 steps 2, 3, 5)", loc)
    pre = hc_eps = None
    for e in lits:
        pre = find(vec, [r[0] for r in reference(norm_eps, e, 1)], exclude=(post,))
        if pre is not None:
            hc_eps = e
            break
    if pre is None:
        return None, NearMiss("mhc", pattern, "pre_mix",
                              "no tensor of the chain equals pre = sigmoid(m[0:4] * scale[0] + base[0:4]) + hc_eps "
                              f"for hc_eps in {lits} (MODEL.md §2.3 step 4)", loc)
    # First guess: two divisions of a [B, T, 4, 4] tensor per round (softmax + column, then row + column).
    n_div = sum(1 for n in mat if n.target in (aten.div.Tensor, prims.div.default))
    order = [n_div // 2, n_div // 2 + 1, n_div // 2 - 1] + list(range(1, MAX_ITERS_SEARCHED + 1))
    comb = iters = None
    for k in dict.fromkeys(o for o in order if 1 <= o <= MAX_ITERS_SEARCHED):
        comb = find(mat, [r[2] for r in reference(norm_eps, hc_eps, k)])
        if comb is not None:
            iters = k
            break
    if comb is None:
        return None, NearMiss("mhc", pattern, "sinkhorn",
                              "no tensor of the chain equals Sinkhorn(softmax_j(logits) + hc_eps, column first, then "
                              f"row/column) of the comb logits for 1..{MAX_ITERS_SEARCHED} rounds (MODEL.md §2.3 "
                              "step 6)", loc)
    # The Sinkhorn must end at comb: a further normalisation of it inside the chain is another algorithm (and
    # fusing the prefix would hide it), e.g. a last row normalisation.
    more = _normalised_further(comb, forward)
    if more is not None:
        ends_on_rows = all(_close(runs[i][more], _row_normalised(runs[i][comb], hc_eps), **_TOL) for i in range(3))
        if ends_on_rows:
            return None, NearMiss(
                "mhc", pattern, "sinkhorn_order",
                f"the Sinkhorn normalisation ends on the row (destination-axis) normalisation after {iters} rounds; "
                "dsv41::mhc_mixes ends on the column (source-axis) normalisation (MODEL.md §2.3 step 6)", loc)
        return None, NearMiss("mhc", pattern, "sinkhorn_continues",
                              f"after {iters} Sinkhorn rounds the chain divides the stream-mixing matrix again "
                              f"({node_label(more)} {more.name}); dsv41::mhc_mixes ends on the column "
                              "normalisation (MODEL.md §2.3 step 6)", loc)
    chain = _ancestors_within({pre, post, comb}, set(forward) | {mm})
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
    inside = _ancestors_within({pre, post, comb}, chain | set(side))
    region = [n for n in (forward + side + [mm]) if n in inside]
    detail = (("iters", iters), ("norm_eps", norm_eps), ("hc_eps", hc_eps), ("d", concrete_shape(hv)[3]),
              ("fn_layout", "[4d, 24]" if fn_t else "[24, 4d]"))
    args = (H, fn_arg, base, scale, norm_eps, hc_eps, iters)
    if norm_eps_found is not None:  # the normalise-then-project spelling
        wdt = "none" if weight is None else str(tensor_val(weight).dtype).replace("torch.", "")
        detail += (("spelling", "rms_norm -> projection"), ("norm_weight", wdt))
        args += (weight,) if weight is not None else ()
    return _Site("mhc_mixes", "mhc_mixes", mm, args, (pre, post, comb), region, (H,), detail), None


def _normalised_further(comb: fx.Node, forward: list):
    """The first division of a [B, T, 4, 4] tensor computed from `comb` (through views and arithmetic) inside
    the coefficient chain, or None: a Sinkhorn step after the one that produced `comb`."""
    inside = set(forward)
    shape = _shape(comb)
    seen, queue = {comb}, deque(comb.users)
    while queue:
        u = queue.popleft()
        if u in seen or u not in inside:
            continue
        seen.add(u)
        if u.target in (aten.div.Tensor, prims.div.default) and _shape(u) == shape:
            return u
        queue.extend(u.users)
    return None


def _ancestors_within(outputs: set, allowed: set) -> set:
    seen = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in seen or n not in allowed:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


# ------------------------------------------------------------------------------------------------ cut search
def _walkable(n: fx.Node) -> bool:
    return _is_step(n) or (n.op == "call_function" and n.target in _BATCHED_MATMULS)


def _backward_distances(end: fx.Node, limit: int) -> dict:
    """node -> distance from `end` for the nodes within `limit` steps back through walkable ops (boundary
    nodes, which are not walked through, included)."""
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
    """Nodes computing `end` from exactly the `cut` nodes (each of them used) and constants, or None."""
    cutset = set(cut)
    seen: set = set()
    nodes: list = []
    reached: set = set()
    stack = [end]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in cutset:
            reached.add(n)
            continue
        v = n.meta.get("val")
        if n.op == "placeholder":
            return None
        if n.op == "get_attr":
            if not isinstance(v, torch.Tensor) or v.numel() > 256:
                return None
            continue
        if n.op != "call_function":
            return None
        if not (_walkable(n) or _is_shape_value(n)):
            return None
        nodes.append(n)
        if len(nodes) > limit:
            return None
        stack.extend(n.all_input_nodes)
    return nodes if reached == cutset else None


def _role_candidates(dist: dict, end: fx.Node, shape: tuple, pos: dict) -> list:
    cands = [n for n in dist if n is not end and _is_float(n) and _shape(n) == shape]
    return sorted(cands, key=lambda n: (dist[n], -pos.get(n, 0)))[:_PER_ROLE]


def _cuts(end: fx.Node, roles: dict, pos: dict):
    """Closed cuts for `roles` (name -> shape), nearest first: yields (assignment dict, region nodes)."""
    dist = _backward_distances(end, _CUT_REGION)
    cands = {r: _role_candidates(dist, end, s, pos) for r, s in roles.items()}
    if not all(cands.values()):
        return
    combos = sorted(itertools.product(*cands.values()), key=lambda c: sum(dist[n] for n in c))
    for combo in combos:
        if len(set(combo)) != len(combo):
            continue
        region = _closed_region(end, combo, _CUT_REGION)
        if region is not None:
            cut = {}
            for r, n in zip(roles, combo):
                cut[r], passed = _strip_identity_views(n, upcasts=r != "H")
                region.extend(passed)
            yield cut, region


#: Near-miss checks from the most to the least specific: when several candidate cuts of one chain fail, the
#: report names the most specific failure (a cut with a stray cast fails only the generic value check).
_CHECK_PRIORITY = ("comb_orientation", "rms_eps", "expand_values", "collapse_rmsnorm_values")


def _most_specific(reasons: list):
    """The (why, node) of `reasons` whose check comes first in `_CHECK_PRIORITY`."""
    return min(reasons, key=lambda r: _CHECK_PRIORITY.index(r[0][0]) if r[0][0] in _CHECK_PRIORITY else 99)


# ------------------------------------------------------------------------------------------------ expand
def _find_expands(graph: fx.Graph, ev: _Evaluator):
    sites, misses = [], []
    pos = _position(graph)
    for add in list(graph.nodes):
        if add.op != "call_function" or add.target != aten.add.Tensor or not _is_float(add):
            continue
        shp = _shape(add)
        if len(shp) != 4 or shp[2] != HC_MULT:
            continue
        b, t, _, d = shp
        roles = {"y": (b, t, d), "H": shp, "post": (b, t, HC_MULT), "comb": (b, t, HC_MULT, HC_MULT)}
        # The result may be cast back to H's dtype after the add: try the cast first (it is the op's output).
        ends = [add]
        while len(ends[-1].users) == 1:
            u = next(iter(ends[-1].users))
            if u.op != "call_function" or u.target not in _PASS_THROUGH or _shape(u) != shp:
                break
            ends.append(u)
        reasons, found = [], False
        for end in reversed(ends):
            for cut, region in _cuts(end, roles, pos):
                refused = static_refusal("mhc", "mhc expand (post-mix + stream mixing)", [end, *cut.values(), *region],
                                         SourceLocation.from_node(add), "dsv41::mhc_expand")
                if refused is not None:  # the value check below would see the compiled sizes only
                    misses.append(refused)
                    reasons, found = [], True
                    break
                ok, why_cut = _verify_expand(ev, end, cut)
                if ok:
                    sites.append(_Site("mhc_expand", "mhc_expand", end,
                                       (cut["y"], cut["H"], cut["post"], cut["comb"]), (end,), region,
                                       (cut["y"], cut["H"], cut["post"], cut["comb"]), (("d", d),)))
                    found = True
                    break
                if why_cut is not None:
                    reasons.append((why_cut, add))
            if found:
                break
        if not found and reasons:
            misses.append(NearMiss("mhc", "mhc expand (post-mix + stream mixing)", *_most_specific(reasons)[0],
                                   SourceLocation.from_node(add)))
    return sites, misses


@_real_tensors()
def _verify_expand(ev, end, cut):
    gen = torch.Generator().manual_seed(43)
    env, refs = {}, {}
    for role in ("y", "H", "post", "comb"):
        n = cut[role]
        v = tensor_val(n)
        p = _probe(concrete_shape(v), torch.float64, gen)
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
    if _close_rounded(got, ref):
        return True, None
    if _close_rounded(got, mhc_expand(refs["y"], refs["H"], refs["post"], refs["comb"].transpose(-1, -2))):
        return False, ("comb_orientation", "the streams are mixed with comb[j, i] (rows as destinations); "
                       "dsv41::mhc_expand computes H'_j = post_j * y + sum_i comb[i, j] H_i with i the source "
                       "stream (MODEL.md §2.3)")
    return False, ("expand_values", "the region reads y [B, T, d], H [B, T, 4, d], post [B, T, 4] and comb "
                   "[B, T, 4, 4] but does not compute post_j * y + sum_i comb[i, j] H_i (MODEL.md §2.3 expand)")


# ------------------------------------------------------------------------------------------------ collapse + norm
def _is_last_dim_reduction(n: fx.Node) -> bool:
    if n.op != "call_function" or n.target not in (aten.mean.dim, aten.sum.dim_IntList):
        return False
    src = tensor_val(n.args[0])
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return (src is not None and src.dim() == 3 and src.is_floating_point() and isinstance(dims, (list, tuple))
            and list(dims) in ([-1], [2]))


def _find_collapse_norms(graph: fx.Graph, ev: _Evaluator):
    sites, misses = [], []
    pos = _position(graph)
    done: set = set()
    for red in list(graph.nodes):
        if red in done or not _is_last_dim_reduction(red):
            continue
        b, t, d = concrete_shape(tensor_val(red.args[0]))
        ends, queue = [], deque(red.users)
        seen = {red}
        while queue and len(seen) < _FORWARD_NORM:
            u = queue.popleft()
            if u in seen or u.op != "call_function" or not is_dataflow_op(u):
                continue
            seen.add(u)
            if _is_float(u) and _shape(u) == (b, t, d):
                ends.append(u)
            queue.extend(u.users)
        roles = {"H": (b, t, HC_MULT, d), "pre": (b, t, HC_MULT), "weight": (d,)}
        reasons, matched = [], False
        for end in ends:
            if end in done:
                continue
            for cut, region in _cuts(end, roles, pos):
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
                    sites.append(_Site("mhc_collapse_rmsnorm", "mhc_collapse_rmsnorm", end,
                                       (cut["H"], cut["pre"], cut["weight"], eps), (end,), region,
                                       (cut["H"], cut["pre"]), (("eps", eps), ("d", d))))
                    done.update(region)
                    done.add(end)
                    matched = True
                    break
                if why is not None:
                    reasons.append((why, end))
            if matched:
                break
        if not matched and reasons and not any(e in done for _, e in reasons):
            why, end = _most_specific(reasons)
            misses.append(NearMiss("mhc", "mhc collapse -> rmsnorm", *why, SourceLocation.from_node(end)))
            done.update(e for _, e in reasons)
    return sites, misses


@_real_tensors()
def _verify_collapse_norm(ev, end, cut, region):
    """(eps, None) when the region computes rms_norm(collapse(H, pre), weight, eps) for one of its literals."""
    gen = torch.Generator().manual_seed(47)
    hv, pv, wv = (tensor_val(cut[r]) for r in ("H", "pre", "weight"))
    h = _probe(concrete_shape(hv), torch.float64, gen)
    pre = torch.rand(concrete_shape(pv), generator=gen, dtype=torch.float64).to(pv.dtype)
    w = (0.5 + torch.rand(concrete_shape(wv), generator=gen, dtype=torch.float64)).to(wv.dtype)
    envs = [{cut["H"]: (h * s).to(hv.dtype), cut["pre"]: pre, cut["weight"]: w} for s in (1.0, 1e-4)]
    try:
        runs = [ev.evaluate([end], env)[end] for env in envs]
    except (RegionNotClosed, RuntimeError):
        return None, None
    lits = _literals(region)
    for eps in lits:
        if all(_close_rounded(got, rms_norm(mhc_collapse(env[cut["H"]], pre), w, eps))
               for got, env in zip(runs, envs)):
            return eps, None
    if any(_close_rounded(runs[0], rms_norm(mhc_collapse(envs[0][cut["H"]], pre), w, eps)) for eps in lits):
        return None, rms_eps_reason(lits, lambda eps: all(
            _close_rounded(got, rms_norm_eps_outside(mhc_collapse(env[cut["H"]], pre), w, eps))
            for got, env in zip(runs, envs)))
    return None, ("collapse_rmsnorm_values", "the region reads H [B, T, 4, d], pre [B, T, 4] and a weight [d] but "
                  "does not compute rms_norm(sum_i pre_i H_i, weight, eps) (MODEL.md §2.2, §2.3 collapse)")


# ------------------------------------------------------------------------------------------------ rewrite + record
def _resolve(arg, replaced: dict):
    """`arg` (a node, a constant, or a tuple of them) with every node an earlier rewrite replaced swapped for its
    replacement (transitively)."""
    if isinstance(arg, tuple):
        return tuple(_resolve(a, replaced) for a in arg)
    while isinstance(arg, fx.Node) and arg in replaced:
        arg = replaced[arg]
    return arg


def _rewrite(graph: fx.Graph, site: _Site, op) -> dict:
    """Insert `op(*site.args)` before the site's first output and hand it the outputs' users; returns {old output:
    its replacement node}."""
    pos = _position(graph)
    # Graph order and each node's inputs, for the byte accounting after the rewrite (erased nodes lose their args).
    site.region.sort(key=pos.__getitem__)
    site.inputs_of = {n: list(n.all_input_nodes) for n in site.region}
    first = min(site.outputs, key=pos.__getitem__)
    args = list(site.args)
    if isinstance(args[1], tuple) and args[1][0] == "permute":
        args[1] = insert_node(graph, first, aten.permute.default, (args[1][1], [1, 0]), like=site.anchor)
    out = insert_node(graph, first, op, tuple(args), like=site.anchor)
    if len(site.outputs) == 1:
        site.outputs[0].replace_all_uses_with(out)
        return {site.outputs[0]: out}
    done = {}
    for i, old in enumerate(site.outputs):
        new = insert_node(graph, first, operator.getitem, (out, i), like=site.anchor)
        old.replace_all_uses_with(new)
        done[old] = new
    return done


def _record(family: str, site: _Site, removed: set) -> MatchRecord:
    gone = [n for n in site.region if n in removed]
    before, after, subs = _bytes(site, gone)
    return MatchRecord(family, site.pattern, f"dsv41::{site.op_name}", SourceLocation.from_node(site.anchor),
                       tuple(n.name for n in gone), tuple(node_label(n) for n in gone), before, after,
                       tuple(sorted(subs.items())), site.detail)


def _bytes(site: _Site, gone: list):
    """(before, after, symbol values): eager traffic of the removed ops vs the fused op's inputs and outputs."""
    b, t = concrete_shape(tensor_val(site.activations[0]))[:2]
    rows, subs = token_rows((b, t))
    per_token: set = set(site.activations)
    for n in site.region:  # graph order
        if any(a in per_token for a in site.inputs_of[n]):
            per_token.add(n)
    per_token.update(site.outputs)
    totals = {"before": [0, 0], "after": [0, 0]}  # [bytes per token, bytes per step]

    def add(key: str, n) -> None:
        """Add the bytes of node `n`'s tensor value (its fake `meta["val"]`) to `totals[key]`: per token when `n` is
        in `per_token` and its size divides by B * T, else per step; nodes without a tensor value add nothing."""
        v = tensor_val(n)
        if v is None:
            return
        nbytes = v.numel() * v.element_size()
        if n in per_token and nbytes % (b * t) == 0:
            totals[key][0] += nbytes // (b * t)
        else:
            totals[key][1] += nbytes

    for n in gone:
        if is_view_op(n) or tensor_val(n) is None:
            continue
        add("before", n)
        for a in site.inputs_of[n]:
            add("before", a)
    ins = [a for a in site.args if isinstance(a, fx.Node)]
    if isinstance(site.args[1], tuple):
        ins.append(site.args[1][1])
    for n in ins + list(site.outputs):
        add("after", n)
    before, after = (sympy.Integer(totals[k][0]) * rows + totals[k][1] for k in ("before", "after"))
    return str(sympy.expand(before)), str(sympy.expand(after)), subs
