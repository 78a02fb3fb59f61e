"""Structure of the mHC chains (family `mhc`, mhc.py): the coefficient projection and region, probe tensors of the
coefficients, the cut search of the expand and collapse chains, and the check order of their near-misses."""

from __future__ import annotations

from collections import deque

import torch
import torch.fx as fx

from ..ref.mhc import HC_MULT
from .engine import (FP32_EXACT, chain_back, closed_region, concrete_shape, cut_search, backward_distances, is_float,
                     is_shape_value, is_step, randn_probe, ranked, shape_of, tensor_val)
from .mhc_spellings import normalised_input

__all__ = ["N_MIX", "BATCHED_MATMULS", "CHECK_PRIORITY", "TRIANGLE", "strip_identity_views", "projection", "Resolver",
           "coefficient_region", "mix_probes", "row_normalised", "normalised_further", "most_specific",
           "is_last_dim_reduction", "stream_cuts"]

aten = torch.ops.aten
prims = torch.ops.prims
#: Coefficients per token: 4 pre, 4 post, 16 comb.
N_MIX = (2 + HC_MULT) * HC_MULT
#: Batched products a region may contain (`comb^T @ H` in the expand, an einsum collapse).
BATCHED_MATMULS = {aten.bmm.default, aten.baddbmm.default}
_CHAIN_LIMIT = 600      # nodes of a coefficient region (20 Sinkhorn rounds are ~130)
_RESOLVE_LIMIT = 200    # nodes walked back from one side input of a coefficient region
_CUT_REGION = 80        # nodes searched back from the end of a collapse / expand for the op's inputs
_PER_ROLE = 6           # candidates tried per input of a collapse / expand
_SMALL_PARAM = 64       # graph inputs up to this many elements may be base / scale


_IDENTITY_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                   aten.alias.default}


def strip_identity_views(n: fx.Node, upcasts: bool):
    """(source, passed): the tensor `n` is an identity view of (a view / reshape / expand to the same shape),
    else `n`, and the nodes passed on the way; with `upcasts`, also the tensor an exact cast to FP32 reads (for
    inputs the op reads in FP32 anyway, so the cast is not materialised for the op)."""
    passed = []
    while n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) and tensor_val(n.args[0]) is not None:
        src = n.args[0]
        same = shape_of(src) == shape_of(n)
        identity = n.target in _IDENTITY_VIEWS and same and tensor_val(src).dtype == tensor_val(n).dtype
        upcast = (upcasts and same and n.target == prims.convert_element_type.default
                  and tensor_val(n).dtype == torch.float32 and tensor_val(src).dtype in FP32_EXACT)
        if not (identity or upcast):
            break
        passed.append(n)
        n = src
    return n, passed


def projection(mm: fx.Node):
    """(H, fn, fn_transposed, normalised) when `mm` is `[.., 4d] x [4d, 24]` with the right operand a view / cast
    of an FP32 [24, 4d] or [4d, 24] tensor fn and the left one a view / cast of a [B, T, 4, d] tensor H
    (normalised None), or computed from H (and an RMS weight) through dataflow ops (normalised: the
    `mhc_spellings.NormalisedInput`, possibly a refusal); else None."""
    if mm.op != "call_function" or mm.target != aten.mm.default:
        return None
    rs = shape_of(mm.args[1])
    if rs is None or len(rs) != 2 or rs[1] != N_MIX or rs[0] % HC_MULT:
        return None
    k = rs[0]
    fs = [n for n in chain_back(mm.args[1]) if tensor_val(n).dtype == torch.float32
          and shape_of(n) in ((N_MIX, k), (k, N_MIX))]
    if not fs:
        return None
    fn = fs[-1]
    hs = [n for n in chain_back(mm.args[0]) if is_float(n) and len(shape_of(n)) == 4
          and shape_of(n)[2:] == (HC_MULT, k // HC_MULT)]
    if hs:
        return hs[-1], fn, shape_of(fn) == (k, N_MIX), None
    normalised = normalised_input(mm.args[0], k)
    return None if normalised is None else (normalised.H, fn, shape_of(fn) == (k, N_MIX), normalised)


class Resolver:
    """Decides which side inputs a coefficient region may read: tensors computed (through dataflow ops) only
    from H, fn, constants and small parameter vectors (the candidates for base and scale). Calling it on a node
    says whether the node qualifies; `small` and `side` collect the parameter leaves and side nodes seen."""

    def __init__(self, stops: set):
        self.stops = stops
        self.memo: dict = {}
        self.small: list = []
        self.side: list = []

    def __call__(self, a: fx.Node) -> bool:
        """Whether `a` is computed only from the stops, shape values, constants and small parameters."""
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
            elif n in self.stops or is_shape_value(n):
                continue
            elif n.op in ("placeholder", "get_attr"):
                if v is not None and v.is_floating_point() and v.numel() <= _SMALL_PARAM:
                    small.append(n)
                elif not (n.op == "get_attr" and v is not None and v.numel() <= 256):
                    ok = False
            elif is_step(n):
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


def coefficient_region(mm: fx.Node, H: fx.Node, fn: fx.Node, weight: fx.Node | None = None):
    """(forward nodes, side nodes, small parameter leaves) of the chain anchored at `mm`, or None if too large.
    `weight` (the RMS weight [4d] of the normalise-then-project spelling) is an input like H and fn."""
    resolve = Resolver({H, fn} if weight is None else {H, fn, weight})
    if not (resolve(mm.args[0]) and resolve(mm.args[1])):
        return None
    region = {mm}
    forward: list = []
    queue = deque(mm.users)
    while queue:
        u = queue.popleft()
        if u in region or not is_step(u):
            continue
        if all(a in region or resolve(a) for a in u.all_input_nodes):
            region.add(u)
            forward.append(u)
            if len(forward) > _CHAIN_LIMIT:
                return None
            queue.extend(u.users)
    return forward, resolve.side, resolve.small


TRIANGLE = torch.tensor([[0.0, 0.0, 0.0, 0.0], [-30.0, 0.0, 0.0, 0.0], [-30.0, -30.0, 0.0, 0.0],
                          [-30.0, -30.0, -30.0, 0.0]])


def mix_probes(H: fx.Node, fn: fx.Node, fn_t: bool, small: list, base: fx.Node, scale: fx.Node,
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
                        TRIANGLE.double().flatten()])
    scale_c = torch.zeros(3, dtype=torch.float64)
    h_a = randn_probe(hs, hv.dtype, gen)
    h_c = randn_probe(hs, hv.dtype, gen)
    # Every probe lives on its node's device: the region's own ops (and any constants it creates) run there.
    others = {n: randn_probe(concrete_shape(tensor_val(n)), tensor_val(n).dtype, gen).to(tensor_val(n).device)
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


def row_normalised(c: torch.Tensor, eps: float) -> torch.Tensor:
    """`c` [.., 4, 4] divided by its row sums plus `eps` (the row normalisation of a Sinkhorn round)."""
    return c / (c.sum(dim=-1, keepdim=True) + eps)


def normalised_further(comb: fx.Node, forward: list):
    """The first division of a [B, T, 4, 4] tensor computed from `comb` (through views and arithmetic) inside
    the coefficient chain, or None: a Sinkhorn step after the one that produced `comb`."""
    inside = set(forward)
    shape = shape_of(comb)
    seen, queue = {comb}, deque(comb.users)
    while queue:
        u = queue.popleft()
        if u in seen or u not in inside:
            continue
        seen.add(u)
        if u.target in (aten.div.Tensor, prims.div.default) and shape_of(u) == shape:
            return u
        queue.extend(u.users)
    return None


#: Near-miss checks from the most to the least specific: when several candidate cuts of one chain fail, the
#: report names the most specific failure (a cut with a stray cast fails only the generic value check).
CHECK_PRIORITY = ("comb_orientation", "rms_eps", "expand_values", "collapse_rmsnorm_values")


def most_specific(reasons: list):
    """The (why, node) of `reasons` whose check comes first in `CHECK_PRIORITY`."""
    return min(reasons, key=lambda r: CHECK_PRIORITY.index(r[0][0]) if r[0][0] in CHECK_PRIORITY else 99)


def is_last_dim_reduction(n: fx.Node) -> bool:
    """A mean / sum over the last dim of a floating [B, T, d] tensor (the RMS statistic's reduction)."""
    if n.op != "call_function" or n.target not in (aten.mean.dim, aten.sum.dim_IntList):
        return False
    src = tensor_val(n.args[0])
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return (src is not None and src.dim() == 3 and src.is_floating_point() and isinstance(dims, (list, tuple))
            and list(dims) in ([-1], [2]))


def _walkable(n: fx.Node) -> bool:
    """A node the cut search walks back through: a region step or a batched product."""
    return is_step(n, BATCHED_MATMULS)


def _in_region(n: fx.Node) -> bool:
    """A node a collapse / expand region may contain: a walkable op or shape arithmetic."""
    return _walkable(n) or is_shape_value(n)


def stream_cuts(end: fx.Node, roles: dict, pos: dict):
    """Closed cuts for `roles` (name -> shape) of the region ending at `end`, nearest first: yields (role -> node,
    region nodes). Each role's node is then traced back through identity views (and, but for H, exact upcasts to
    FP32, which the op reads anyway) to the tensor the op reads; the nodes passed join the region."""
    dist = backward_distances(end, _CUT_REGION, _walkable)
    cands = {r: ranked([n for n in dist if n is not end and is_float(n) and shape_of(n) == s], dist, pos, _PER_ROLE)
             for r, s in roles.items()}
    for cut, region in cut_search(cands, dist, lambda combo: closed_region(end, combo, _CUT_REGION, _in_region)):
        for r, n in list(cut.items()):
            cut[r], passed = strip_identity_views(n, upcasts=r != "H")
            region.extend(passed)
        yield cut, region
