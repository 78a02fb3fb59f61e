"""`indexer` family: the CSA2 lightning indexer's score, candidate-pool and top-k chains become dsv41::indexer_* ops.

Chains matched (ARCHITECTURE.md "Fusion patterns", row "indexer"; MODEL.md §2.7; eager code dsv41/model/csa.py):

    scores      dequantize_fp4_ue8m0_1x32(key codes, scales) -> q . k (matmul) -> ReLU -> * w -> sum over heads
                -> where(row < n_visible, ., -inf)
                    -> dsv41::indexer_scores(q, w, key_codes, key_scales, n_visible, None, 1)      [B, T, N] fp32
    candidates  pad to blocks -> block max -> newest block +inf -> top-n_blocks blocks -> finite -> row mask
                    -> dsv41::indexer_candidates(scores, n_visible, block, n_blocks)    block ids, never a mask
    top-k       sort descending (stable) / topk -> first k -> -inf picks dropped -> indices ascending, -1 padded
                [-> + offset on the valid ids]
                    -> dsv41::indexer_topk(scores, k, None, 1, offset)
    pool top-k  top-k of where(candidate mask, scores, -inf) where the mask is a matched candidate chain and the
                scores a matched score chain (the Reindex layers)
                    -> dsv41::indexer_scores(..., blocks, block) (compact: only the pool's rows are scored)
                       + dsv41::indexer_topk(compact, k, blocks, block, offset)

The candidate pool is computed ONCE per step: candidate chains with the same inputs share one
`indexer_candidates` node, and every Reindex layer's pool top-k reads it (the eager model builds the mask once
at the candidate source and every Reindex layer reads that same tensor). In `tiny` (index sources [2, 4, 6],
candidate source 4): 3 score chains (two full scans, the Reindex layer 6 restricted to the pool), 1 candidate
chain, 3 top-k chains. In general: index sources = score chains = top-k chains, one candidate chain when any
Reindex layer exists, and as many pool top-k chains (`indexer_topk(candidate pool)`) as Reindex layers.

Structure (spelling-independent). Score chain: the anchor is a matmul (mm / bmm); the chain's end is a 3-d
fp32 tensor [B, T, N] reached forward from it; the op's inputs are a CUT of the region found by search, nearest
first (uint8 [B, N, D/2] codes and [B, N, D/32] scales, float [B, T, H, D] q, float [B, T, H] w, integer [B, T]
n_visible) such that every path from the end back to graph inputs crosses exactly those nodes. Candidate chain:
the anchor is an amax over the last dim of a [B, T, NB, block] float tensor; the end is a bool [B, T, N] tensor;
the cut is (scores [B, T, N], n_visible [B, T]). Top-k chain: the anchor is a descending sort or a topk of a 3-d
fp32 tensor; the end is an integer [B, T, k] tensor computed from that tensor alone.

Semantics (how constants are settled). Every region's own ATen nodes are evaluated on probe tensors (matmuls,
sorts, topk, gather and scatter included) and compared with the op's reference (dsv41/kernels/indexer.py, the
model's own math): scores to FP32 rounding on random keys (every byte value), scales 2^-17 .. 2^13, negative
head weights and n_visible from 0 to N; candidates and top-k exactly, on probes with -inf rows, rows with fewer
finite scores than k, and exact ties (zeros of both signs, repeated values) — so a chain that breaks ties
another way fails. n_blocks and the offset are taken from the region's integer literals and pinned by probes.
A look-alike is a `NearMiss` naming the failed check: `visibility` (rows <= n_visible instead of <),
`index_score_values`, `block_max_values`, `tie_rule` (equal scores resolved to the higher index, or torch.topk
whose tie order differs from the lower-index rule on the probes), `topk_values`, `pool_mask` (a pool top-k whose
mask or scores were not matched: it is fused as a plain top-k, the mask stays).

Bytes per match (sympy in B, L): before = what the removed ATen ops read and write as separate eager kernels
(views free); after = the fused op's inputs and outputs (a pool top-k counts the compact scores twice and not
the [B, T, N] ones).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections import deque
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (FusionFamily, RegionEvaluator, RegionNotClosed, concrete_shape, dsv41_op, eliminate_dead_code,
                     insert_node, is_dataflow_op, is_table_lookup, is_view_op, node_label, symbolic_part, tensor_val,
                     token_rows)

__all__ = ["IndexerFamily"]

aten = torch.ops.aten
prims = torch.ops.prims
_MATMULS = {aten.mm.default, aten.bmm.default}
_SORTS = {aten.sort.stable, aten.sort.default}
#: Deterministic non-dataflow ops an indexer region may contain (matmul, selection, gather / scatter, padding).
_EXTRA_STEPS = _MATMULS | _SORTS | {aten.topk.default, aten.gather.default, aten.scatter.src, aten.scatter.value,
                                    aten.constant_pad_nd.default, aten.max.dim}
_INT_DTYPES = (torch.int64, torch.int32)
_FORWARD_LIMIT = 40     # nodes walked forward from an anchor to the chain's end
_CUT_REGION = 160       # nodes searched back from a chain's end for the op's inputs
_PER_ROLE = 4           # candidates tried per input
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _is_step(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and _is_step(src)
    return is_dataflow_op(n) or is_table_lookup(n) or n.target in _EXTRA_STEPS


class _Evaluator(RegionEvaluator):
    """`RegionEvaluator` that also evaluates the deterministic non-dataflow ops of `_EXTRA_STEPS`."""

    def _compute(self, n: fx.Node, memo: dict):
        if n.op == "call_function" and n.target in _EXTRA_STEPS:
            conv = lambda a: memo[a] if isinstance(a, fx.Node) else a  # noqa: E731
            return n.target(*fx.node.map_aggregate(n.args, conv), **fx.node.map_aggregate(n.kwargs, conv))
        return super()._compute(n, memo)


@contextlib.contextmanager
def _real_tensors():
    """Run probes and references on real tensors even inside Inductor's compile (no fake mode, no modes)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes(), torch.no_grad():
        yield


_SHAPES: dict = {}  # node -> concrete shape, filled during one `run` (a node's shape never changes)


def _shape(n):
    got = _SHAPES.get(n, False)
    if got is False:
        v = tensor_val(n)
        got = _SHAPES[n] = concrete_shape(v) if v is not None else None
    return got


def _dtype(n):
    v = tensor_val(n)
    return v.dtype if v is not None else None


def _position(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


@dataclass
class _Site:
    """A verified chain: kind, anchor, end node, op inputs (role -> node), region nodes, constants."""

    kind: str
    anchor: fx.Node
    end: fx.Node
    cut: dict
    region: list
    detail: dict = field(default_factory=dict)
    inputs_of: dict = field(default_factory=dict)
    after: list = field(default_factory=list)  # the fused op's inputs and outputs (byte accounting)


# ------------------------------------------------------------------------------------------------ region search
def _forward(anchor: fx.Node, limit: int) -> list:
    """Nodes computed from `anchor` through region steps, breadth first (nearest first), anchor excluded."""
    seen, out, queue = {anchor}, [], deque(anchor.users)
    while queue and len(out) < limit:
        u = queue.popleft()
        if u in seen or not _is_step(u):
            continue
        seen.add(u)
        out.append(u)
        queue.extend(u.users)
    return out


def _backward_distances(end: fx.Node, limit: int) -> dict:
    dist = {end: 0}
    queue = deque([end])
    while queue:
        n = queue.popleft()
        for a in n.all_input_nodes:
            if a in dist:
                continue
            dist[a] = dist[n] + 1
            if _is_step(a) and len(dist) < limit:
                queue.append(a)
    return dist


def _is_shape_value(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def _closed_region(end: fx.Node, cut, limit: int):
    """Nodes computing `end` from exactly the `cut` nodes (each used) and small constants, or None."""
    cutset = set(cut)
    seen, nodes, reached = set(), [], set()
    stack = [end]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in cutset:
            reached.add(n)
            continue
        if n.op == "placeholder":
            return None
        if n.op == "get_attr":
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor) or v.numel() > 256:
                return None
            continue
        if n.op != "call_function" or not (_is_step(n) or _is_shape_value(n)):
            return None
        nodes.append(n)
        if len(nodes) > limit:
            return None
        stack.extend(n.all_input_nodes)
    return nodes if reached == cutset else None


def _cuts(end: fx.Node, want: dict, pos: dict, dist: dict | None = None):
    """Closed cuts of `end`: `want` maps role -> predicate(node) or a list of candidate nodes; yields
    (role -> node, region), the combination nearest to `end` first."""
    dist = dist if dist is not None else _backward_distances(end, _CUT_REGION)
    cands = {}
    for role, ok in want.items():
        c = ok if isinstance(ok, list) else [n for n in dist if n is not end and tensor_val(n) is not None and ok(n)]
        cands[role] = sorted(c, key=lambda n: (dist[n], -pos.get(n, 0)))[:_PER_ROLE]
        if not cands[role]:
            return
    for combo in sorted(itertools.product(*cands.values()), key=lambda c: sum(dist[n] for n in c)):
        if len(set(combo)) != len(combo):
            continue
        region = _closed_region(end, combo, _CUT_REGION)
        if region is not None:
            yield dict(zip(want, combo)), region


def _score_cuts(end: fx.Node, pos: dict):
    """Closed cuts of a score chain ending at `end` [B, T, N]: the byte pair (codes [B, N, D/2], scales
    [B, N, D/32]) fixes D, the head weights [B, T, H] fix H, then q must be [B, T, H, D]."""
    b, t, n = _shape(end)
    dist = _backward_distances(end, _CUT_REGION)
    nodes = [x for x in dist if x is not end and _shape(x) is not None]
    u8 = [x for x in nodes if _dtype(x) == torch.uint8 and len(_shape(x)) == 3 and _shape(x)[:2] == (b, n)]
    if len(u8) < 2:
        return
    nvis = [x for x in nodes if _dtype(x) in _INT_DTYPES and _shape(x) == (b, t)]
    floats: dict = {}
    for x in nodes:
        if _dtype(x) in _FLOAT_DTYPES:
            floats.setdefault(_shape(x), []).append(x)
    for codes, scales in itertools.product(u8, u8):
        d = 2 * _shape(codes)[2]
        if codes is scales or d % 32 or _shape(scales)[2] != d // 32:
            continue
        for shp, heads in floats.items():
            if len(shp) != 3 or shp[:2] != (b, t):
                continue
            qs = floats.get((b, t, shp[2], d))
            if not qs:
                continue
            want = {"key_codes": [codes], "key_scales": [scales], "q": qs, "weights": heads, "n_visible": nvis}
            yield from _cuts(end, want, pos, dist)


def _reads_index_keys(mm: fx.Node) -> bool:
    """Cheap structural filter for a score anchor: a uint8 [B, N, D/2] / [B, N, D/32] pair a few steps back."""
    dist = _backward_distances(mm, 60)
    u8 = [_shape(x) for x in dist if _dtype(x) == torch.uint8 and _shape(x) is not None and len(_shape(x)) == 3]
    return any(a[:2] == c[:2] and a[2] == 16 * c[2] for a in u8 for c in u8)


def _int_literals(nodes) -> list:
    out = []

    def visit(a):
        """Remember positive int literals (the candidate block counts); returns `a` unchanged."""
        if isinstance(a, int) and not isinstance(a, bool) and 0 < a < 2 ** 31 and a not in out:
            out.append(a)
        return a

    for n in nodes:
        fx.node.map_aggregate(n.args, visit)
        fx.node.map_aggregate(n.kwargs, visit)
    return out


def _device(nodes) -> torch.device:
    for n in nodes:
        v = tensor_val(n)
        if v is not None:
            return v.device
    return torch.device("cpu")


def _strip_upcast(n: fx.Node):
    """(tensor, passed): the tensor an exact cast to FP32 of the same shape reads (the op reads in FP32 anyway)."""
    passed = []
    while (n.op == "call_function" and n.target in (prims.convert_element_type.default, aten._to_copy.default)
           and isinstance(n.args[0], fx.Node) and _dtype(n) == torch.float32
           and _dtype(n.args[0]) in _FLOAT_DTYPES and _shape(n.args[0]) == _shape(n)):
        passed.append(n)
        n = n.args[0]
    return n, passed


# ------------------------------------------------------------------------------------------------ scores
def _find_scores(graph: fx.Graph, ev: _Evaluator):
    sites, misses, taken = [], [], set()
    pos = _position(graph)
    for mm in list(graph.nodes):
        if mm.op != "call_function" or mm.target not in _MATMULS or mm in taken or not _reads_index_keys(mm):
            continue
        ends = [n for n in _forward(mm, _FORWARD_LIMIT)
                if _dtype(n) == torch.float32 and len(_shape(n)) == 3]
        reasons, found = [], None
        for end in ends:  # nearest first: the first end that verifies closes the chain (the visibility where)
            for cut, region in _score_cuts(end, pos):
                if mm not in region:
                    continue
                why = (_symbolic_reason([end, *cut.values(), *region], "dsv41::indexer_scores")
                       or _verify_scores(ev, end, cut))
                if why is None:
                    found = (end, cut, region)
                    break
                reasons.append(why)
                taken.update(n for n in region if n.target in _MATMULS)  # one near-miss per look-alike chain
            if found:
                break
        if found:
            end, cut, region = found
            for role in ("q", "weights"):
                cut[role], passed = _strip_upcast(cut[role])
                region.extend(passed)
            site = _Site("indexer_scores", mm, end, cut, region, {"N": _shape(end)[2], "H": _shape(cut["q"])[2],
                                                                  "D": _shape(cut["q"])[3]})
            sites.append(site)
            taken.update(n for n in region if n.target in _MATMULS)
        elif reasons:
            check, reason = _most_specific(reasons)
            misses.append(NearMiss("indexer", "index scores (FP4 keys -> q.k -> ReLU -> head sum -> visibility)",
                                   check, reason, SourceLocation.from_node(mm)))
    return sites, misses


def _symbolic_reason(nodes, op: str, k=None):
    """(check, reason) when the chain reads a size or a top-k k known only at run time (`static_k` /
    `static_shapes`), else None: checked before the value checks, which see the compiled sizes only."""
    what = symbolic_part([k]) if k is not None else None
    check = "static_k"
    if what is None:
        what, check = symbolic_part(nodes), "static_shapes"
    if what is None:
        return None
    return check, (f"{what}; indexer fuses this chain into {op} only at compile-time sizes (it verifies the chain and "
                   "plans the kernel for them), so it stays with Inductor, which handles sizes known only at run time")


_PRIORITY = ("static_k", "static_shapes", "visibility", "tie_rule", "index_score_values", "block_max_values", "topk_values")


def _most_specific(reasons):
    return min(reasons, key=lambda r: _PRIORITY.index(r[0]) if r[0] in _PRIORITY else 99)


def _score_probes(cut, gen):
    """Probe inputs of a score chain: every key byte value, scales 2^-17 .. 2^13, signed head weights, n_visible
    spanning 0 .. N (the last query sees every row)."""
    q, w, kc, ks, nv = (tensor_val(cut[r]) for r in ("q", "weights", "key_codes", "key_scales", "n_visible"))
    b, n, half = concrete_shape(kc)
    codes = torch.randint(0, 256, (b, n, half), generator=gen, dtype=torch.int64)
    codes.view(-1)[: min(256, codes.numel())] = torch.arange(min(256, codes.numel()))
    scales = torch.randint(110, 141, concrete_shape(ks), generator=gen)
    qv = torch.randn(concrete_shape(q), generator=gen)
    wv = torch.randn(concrete_shape(w), generator=gen)
    nvv = torch.randint(0, n + 1, concrete_shape(nv), generator=gen)
    nvv.view(-1)[-1] = n
    if nvv.numel() > 1:
        nvv.view(-1)[0] = 0
    dev = q.device
    return {cut["q"]: qv.to(q.dtype).to(dev), cut["weights"]: wv.to(w.dtype).to(dev),
            cut["key_codes"]: codes.to(torch.uint8).to(dev), cut["key_scales"]: scales.to(torch.uint8).to(dev),
            cut["n_visible"]: nvv.to(nv.dtype).to(dev)}


def _scores_agree(got, ref) -> bool:
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != torch.float32:
        return False
    g, r = got.double().cpu(), ref.double().cpu()
    if not torch.equal(torch.isinf(g) & (g < 0), torch.isinf(r) & (r < 0)):
        return False
    fin = torch.isfinite(r)
    if not bool(torch.isfinite(g[fin]).all()):
        return False
    scale = float(r[fin].abs().max()) if bool(fin.any()) else 1.0
    return bool(((g[fin] - r[fin]).abs() <= 1e-5 * scale + 1e-5 * r[fin].abs()).all())


@_real_tensors()
def _verify_scores(ev, end, cut):
    from dsv41.kernels.indexer import reference_indexer_scores

    gen = torch.Generator().manual_seed(71)
    for _ in range(2):
        env = _score_probes(cut, gen)
        try:
            got = ev.evaluate([end], env)[end]
        except (RegionNotClosed, RuntimeError, IndexError, TypeError):
            return "index_score_values", "the region could not be evaluated on probe tensors"
        args = [env[cut[r]] for r in ("q", "weights", "key_codes", "key_scales", "n_visible")]
        ref = reference_indexer_scores(*[a.cpu() for a in args], None, 1)
        if _scores_agree(got, ref):
            continue
        shifted = reference_indexer_scores(*[a.cpu() for a in args[:4]], args[4].cpu() + 1, None, 1)
        if _scores_agree(got, shifted):
            return ("visibility", "rows t <= n_visible are scored; dsv41::indexer_scores scores rows t < n_visible "
                    "(MODEL.md §2.7 step 3: n = floor((p + 1) / r) visible rows)")
        return ("index_score_values", "the region reads FP4 index keys (uint8 codes [B, N, D/2], scales [B, N, "
                "D/32]), q [B, T, H, D], w [B, T, H] and n_visible [B, T] but does not compute sum_h w_h ReLU(q_h . "
                "k_t) with UE8M0 1x32 keys and -inf for t >= n_visible (MODEL.md §2.7 steps 1-3)")
    return None


# ------------------------------------------------------------------------------------------------ candidates
def _find_candidates(graph: fx.Graph, ev: _Evaluator):
    """(sites, near-misses, claimed): claimed = the nodes of verified and near-miss candidate regions, which the
    top-k search must not read as top-k chains of their own (a candidate pool contains a block top-k)."""
    sites, misses, done = [], [], set()
    claimed = set()
    pos = _position(graph)
    for amax in list(graph.nodes):
        if amax.op != "call_function" or amax.target not in (aten.amax.default, aten.max.dim) or amax in done:
            continue
        src = _shape(amax.args[0])
        dims = amax.args[1] if len(amax.args) > 1 else amax.kwargs.get("dim")
        dims = [dims] if isinstance(dims, int) else list(dims or [])  # max.dim takes one int
        if src is None or len(src) != 4 or _dtype(amax.args[0]) != torch.float32 or dims not in ([-1], [3]):
            continue
        b, t, nb, block = src
        ends = [n for n in _forward(amax, _FORWARD_LIMIT) if _dtype(n) == torch.bool and len(_shape(n)) == 3
                and _shape(n)[:2] == (b, t) and -(-_shape(n)[2] // block) == nb]
        reasons, found = [], None
        for end in reversed(ends):  # furthest first: the mask at the scores' width, not a padded one
            n = _shape(end)[2]
            want = {"scores": lambda x: _dtype(x) == torch.float32 and _shape(x) == (b, t, n),
                    "n_visible": lambda x: _dtype(x) in _INT_DTYPES and _shape(x) == (b, t)}
            for cut, region in _cuts(end, want, pos):
                if amax not in region:
                    continue
                why = _symbolic_reason([end, *cut.values(), *region], "dsv41::indexer_candidates")
                n_blocks, why = (None, why) if why is not None else _verify_candidates(ev, end, cut, region, block)
                if why is None:
                    found = (end, cut, region, n_blocks)
                    break
                reasons.append(why)
                claimed.update(region)
            if found:
                break
        if found:
            end, cut, region, n_blocks = found
            sites.append(_Site("indexer_candidates", amax, end, cut, region,
                               {"block_size": block, "n_blocks": n_blocks, "N": _shape(end)[2]}))
            done.update(region)
            claimed.update(region)
        elif reasons:
            check, reason = _most_specific(reasons)
            misses.append(NearMiss("indexer", "candidate pool (block max -> newest pinned -> top blocks -> mask)",
                                   check, reason, SourceLocation.from_node(amax)))
    return sites, misses, claimed


def _selection_probes(shape, gen, n_visible=None):
    """fp32 score probes of `shape` [B, T, S]: distinct values with -inf holes, exact ties (zeros of both signs,
    repeated values), rows with fewer finite values than most k, an all -inf row."""
    b, t, s = shape
    out = []
    base = torch.randn(b, t, s, generator=gen, dtype=torch.float64).float()
    holes = torch.rand(b, t, s, generator=gen) < 0.2
    out.append(torch.where(holes, torch.full_like(base, float("-inf")), base))
    ties = torch.randint(-2, 3, (b, t, s), generator=gen).float()
    ties = torch.where(torch.rand(b, t, s, generator=gen) < 0.3, torch.full_like(ties, -0.0), ties)
    out.append(ties)
    sparse = torch.full((b, t, s), float("-inf"))
    keep = torch.rand(b, t, s, generator=gen) < min(0.5, 3.0 / max(s, 1))
    sparse[keep] = torch.randint(0, 3, (int(keep.sum()),), generator=gen).float()
    sparse.view(b * t, s)[-1] = float("-inf")
    out.append(sparse)
    return out


@_real_tensors()
def _verify_candidates(ev, end, cut, region, block):
    from dsv41.kernels.indexer import candidate_width, reference_indexer_candidates

    sv, nv = tensor_val(cut["scores"]), tensor_val(cut["n_visible"])
    b, t, n = concrete_shape(sv)
    nb = -(-n // block)
    gen = torch.Generator().manual_seed(73)
    envs = []
    for probe in _selection_probes((b, t, n), gen):
        nvv = torch.randint(0, n + 1, (b, t), generator=gen)
        nvv.view(-1)[0] = n
        envs.append({cut["scores"]: probe.to(sv.device), cut["n_visible"]: nvv.to(nv.dtype).to(nv.device)})
    # All blocks finite and distinct: the number of kept blocks is min(n_blocks, NB), which pins n_blocks.
    envs.append({cut["scores"]: torch.randn(b, t, n, generator=gen).to(sv.device),
                 cut["n_visible"]: torch.full((b, t), n, dtype=nv.dtype, device=nv.device)})
    try:
        runs = [ev.evaluate([end], env)[end] for env in envs]
    except (RegionNotClosed, RuntimeError, IndexError, TypeError):
        return None, ("block_max_values", "the region could not be evaluated on probe tensors")

    def as_mask(blocks):
        """Bool row mask [b, t, n] of the rows in the selected `blocks` (-1 = none)."""
        rows = torch.arange(n)
        keep = torch.zeros(b, t, nb + 1, dtype=torch.bool)
        keep.scatter_(-1, torch.where(blocks >= 0, blocks, nb), True)
        return keep[..., :nb].repeat_interleave(block, dim=-1)[..., :n] & (rows < n)

    for n_blocks in sorted(set(_int_literals(region)) | {nb}):
        if n_blocks > nb:  # keeps every block, as nb does
            continue
        w = candidate_width(n, block, n_blocks)
        ok = True
        for env, got in zip(envs, runs):
            ref = as_mask(reference_indexer_candidates(env[cut["scores"]].cpu(), env[cut["n_visible"]].cpu(), block,
                                                       n_blocks))
            if not (isinstance(got, torch.Tensor) and got.dtype == torch.bool and torch.equal(got.cpu(), ref)):
                ok = False
                break
        if ok and w >= 1:
            return n_blocks, None
    return None, ("block_max_values", f"the region reads scores [B, T, N] and n_visible [B, T] and takes block "
                  f"maxima over {block} rows, but does not keep the top blocks with the newest block pinned as "
                  "candidate_mask does for any block count among its literals (MODEL.md §2.7 step 4)")


# ------------------------------------------------------------------------------------------------ top-k
def _find_topks(graph: fx.Graph, ev: _Evaluator, exclude: set):
    sites, misses, done = [], [], set(exclude)
    pos = _position(graph)
    for anchor in list(graph.nodes):
        if anchor.op != "call_function" or anchor in done:
            continue
        if anchor.target in _SORTS:
            desc = anchor.kwargs.get("descending", None)
            if desc is None:
                desc = anchor.args[2] if anchor.target == aten.sort.default and len(anchor.args) > 2 else (
                    anchor.args[3] if anchor.target == aten.sort.stable and len(anchor.args) > 3 else False)
            if not desc:
                continue
        elif anchor.target != aten.topk.default:
            continue
        x = anchor.args[0]
        xs = _shape(x)
        if xs is None or len(xs) != 3 or _dtype(x) != torch.float32:
            continue
        b, t, s = xs
        ends = [n for n in _forward(anchor, _FORWARD_LIMIT) if _dtype(n) in _INT_DTYPES and len(_shape(n)) == 3
                and _shape(n)[:2] == (b, t) and 0 < _shape(n)[2] <= s]
        reasons, found = [], None
        for end in reversed(ends):
            region = _closed_region(end, (x,), _CUT_REGION)
            if region is None or anchor not in region:
                continue
            k = anchor.args[1] if anchor.target == aten.topk.default and len(anchor.args) > 1 else None
            why = _symbolic_reason([end, x, *region], "dsv41::indexer_topk", k)
            offset, why = (None, why) if why is not None else _verify_topk(ev, end, x, region, anchor)
            if why is None:
                found = (end, region, offset)
                break
            reasons.append(why)
        if found:
            end, region, offset = found
            sites.append(_Site("indexer_topk", anchor, end, {"scores": x}, region,
                               {"k": _shape(end)[2], "offset": offset, "S": s}))
            done.update(region)
        elif reasons:
            check, reason = _most_specific(reasons)
            misses.append(NearMiss("indexer", "top-k (select -> -inf filter -> ascending indices, -1 padded)", check,
                                   reason, SourceLocation.from_node(anchor)))
    return sites, misses


@_real_tensors()
def _verify_topk(ev, end, x, region, anchor):
    from dsv41.kernels.indexer import reference_indexer_topk

    xv = tensor_val(x)
    k = _shape(end)[2]
    gen = torch.Generator().manual_seed(79)
    probes = _selection_probes(concrete_shape(xv), gen)
    try:
        runs = [ev.evaluate([end], {x: p.to(xv.device)})[end] for p in probes]
    except (RegionNotClosed, RuntimeError, IndexError, TypeError):
        return None, ("topk_values", "the region could not be evaluated on probe tensors")
    for offset in [0] + _int_literals(region):
        if all(isinstance(g, torch.Tensor)
               and torch.equal(g.cpu().long(), reference_indexer_topk(p, k, None, 1, offset))
               for p, g in zip(probes, runs)):
            return offset, None
    # Same selection as SETS on the distinct probe but not on the tie probe: another tie rule.
    distinct_ok = isinstance(runs[0], torch.Tensor) and torch.equal(
        runs[0].cpu().long().sort(-1).values, reference_indexer_topk(probes[0], k).sort(-1).values)
    if distinct_ok:
        how = "torch.topk" if anchor.target == aten.topk.default else "the sort"
        return None, ("tie_rule", f"equal scores are resolved differently by {how} than by the lower-index rule of "
                      "dsv41::indexer_topk (select_topk: a stable descending sort, MODEL.md §2.7 step 5)")
    return None, ("topk_values", f"the region sorts / selects scores [B, T, S] into {k} integer indices but not as "
                  "select_topk does (k best, -inf picks -> -1, ascending; MODEL.md §2.7 step 5)")


# ------------------------------------------------------------------------------------------------ pool top-k
@_real_tensors()
def _is_pool_where(ev, node, mask_end, score_end) -> bool:
    """Whether `node` computes where(mask, scores, -inf) from the candidate mask and the score tensor alone
    (any spelling: where, masked_fill of the negated mask, ...), checked on a probe."""
    if _closed_region(node, (mask_end, score_end), 12) is None:
        return False
    gen = torch.Generator().manual_seed(83)
    m = torch.rand(_shape(mask_end), generator=gen) < 0.5
    s = torch.randn(_shape(score_end), generator=gen)
    dev = tensor_val(score_end).device
    try:
        got = ev.evaluate([node], {mask_end: m.to(dev), score_end: s.to(dev)})[node]
    except (RegionNotClosed, RuntimeError):
        return False
    return torch.equal(got.cpu(), torch.where(m, s, torch.full_like(s, float("-inf"))))


# ------------------------------------------------------------------------------------------------ family
class IndexerFamily(FusionFamily):
    """Fuse the indexer's score, candidate-pool and top-k chains (see module docstring)."""

    name = "indexer"
    summary = ("CSA2 indexer: FP4 index scores (q.k -> ReLU -> head sum -> visibility), candidate blocks (shared "
               "across Reindex layers), top-k with the -inf / -1 / offset epilogue; indices, never masks")

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Replace every verified indexer chain of `gm` with the dsv41::indexer_* ops; returns the record."""
        _register_ops()
        ops = {name: dsv41_op(name) for name in ("indexer_scores", "indexer_candidates", "indexer_topk")}
        if any(op is None for op in ops.values()):
            return PassRecord(self.name, True, note="ops not registered: import dsv41.kernels.indexer")
        graph = gm.graph
        _SHAPES.clear()
        start = set(graph.nodes)
        ev = _Evaluator(gm)
        scores, misses = _find_scores(graph, ev)
        cands, m2, claimed = _find_candidates(graph, ev)
        topks, m3 = _find_topks(graph, ev, claimed)
        misses = misses + m2 + m3
        pos = _position(graph)
        for site in scores + cands + topks:
            site.region.sort(key=pos.__getitem__)
            site.inputs_of = {n: list(n.all_input_nodes) for n in site.region}
        records = []
        cand_of = {c.end: c for c in cands}
        replaced: dict = {}  # score chain end -> its op node
        shared: dict = {}    # candidate chains with the same inputs and constants -> one op node
        for s in scores:
            new = insert_node(graph, s.end, ops["indexer_scores"], (s.cut["q"], s.cut["weights"], s.cut["key_codes"],
                              s.cut["key_scales"], s.cut["n_visible"], None, 1), like=s.anchor)
            s.end.replace_all_uses_with(new)
            replaced[s.end] = new
            s.after = list(s.cut.values()) + [new]
        score_of = {replaced[s.end]: s for s in scores}
        for c in cands:
            c.cut = {r: replaced.get(n, n) for r, n in c.cut.items()}
        for tk in topks:
            x = replaced.get(tk.cut["scores"], tk.cut["scores"])
            tk.cut["scores"] = x
            near = _backward_distances(x, 12)
            masks = [a for a in near if a in cand_of]
            pool = None
            for a, o in itertools.product(masks, [o for o in near if o in score_of]):
                if pool is None and _is_pool_where(ev, x, a, o):
                    pool = (cand_of[a], score_of[o])
            if pool is None:
                if masks:
                    misses.append(NearMiss("indexer", "pool top-k (where(candidate mask, scores, -inf) -> top-k)",
                                           "pool_mask", "the candidate mask is not applied to a matched score chain "
                                           "as where(mask, scores, -inf); fused as a plain top-k, the mask stays",
                                           SourceLocation.from_node(tk.anchor)))
                new = insert_node(graph, tk.end, ops["indexer_topk"], (x, tk.detail["k"], None, 1,
                                  tk.detail["offset"]), like=tk.anchor)
                tk.end.replace_all_uses_with(new)
                tk.after = [x, new]
                records.append(tk)
                continue
            c, sc = pool
            key = (c.cut["scores"], c.cut["n_visible"], c.detail["block_size"], c.detail["n_blocks"])
            if key not in shared:
                shared[key] = insert_node(graph, c.end, ops["indexer_candidates"], (c.cut["scores"],
                                          c.cut["n_visible"], c.detail["block_size"], c.detail["n_blocks"]),
                                          like=c.anchor)
                c.after = [c.cut["scores"], c.cut["n_visible"], shared[key]]
                records.append(c)
            blocks = shared[key]
            bs = c.detail["block_size"]
            compact = insert_node(graph, tk.end, ops["indexer_scores"], (sc.cut["q"], sc.cut["weights"],
                                  sc.cut["key_codes"], sc.cut["key_scales"], sc.cut["n_visible"], blocks, bs),
                                  like=sc.anchor)
            new = insert_node(graph, tk.end, ops["indexer_topk"], (compact, tk.detail["k"], blocks, bs,
                              tk.detail["offset"]), like=tk.anchor)
            tk.end.replace_all_uses_with(new)
            tk.after = [compact, blocks, new]
            sc.after = [sc.cut[r] for r in ("q", "weights", "key_codes", "key_scales", "n_visible")] + [blocks, compact]
            tk.kind = "indexer_topk(candidate pool)"
            sc.kind = "indexer_scores(candidate pool)"
            sc.detail["pool_blocks"] = c.detail["n_blocks"]
            tk.detail["pool_blocks"] = c.detail["n_blocks"]
            records.append(tk)
        eliminate_dead_code(graph)
        from torch._inductor.pattern_matcher import stable_topological_sort
        stable_topological_sort(graph)
        eliminate_dead_code(graph)
        removed = start - set(graph.nodes)
        matches = []
        for s in scores + records:
            matches.append(_record(self.name, s, removed))
            removed = removed - set(s.region)
        for c in cands:
            if c not in records:
                misses.append(NearMiss("indexer", "candidate pool (block max -> newest pinned -> top blocks -> mask)",
                                       "pool_mask", "the candidate mask restricts no matched top-k chain; left as is",
                                       SourceLocation.from_node(c.anchor)))
        return PassRecord(self.name, True, tuple(matches), tuple(misses))


def _register_ops() -> None:
    try:
        import dsv41.kernels.indexer  # noqa: F401
    except ImportError:
        pass


# ------------------------------------------------------------------------------------------------ records
def _record(family: str, site: _Site, removed: set) -> MatchRecord:
    gone = [n for n in site.region if n in removed]
    before, after, subs = _bytes(site, gone)
    detail = tuple((k, v) for k, v in site.detail.items() if k != "op_node")
    return MatchRecord(family, site.kind, f"dsv41::{site.kind.split('(')[0]}", SourceLocation.from_node(site.anchor),
                       tuple(n.name for n in gone), tuple(node_label(n) for n in gone), before, after,
                       tuple(sorted(subs.items())), detail)


def _bytes(site: _Site, gone: list):
    """(before, after, symbols): eager traffic of the removed ops vs the fused op's inputs and outputs; tensors
    whose leading dims are the step's [B, T] count per token (B L), the rest (key caches) per step."""
    bt = _shape(site.end)[:2]
    rows, subs = token_rows(bt)
    b, t = bt
    totals = {"before": [0, 0], "after": [0, 0]}

    def add(key, n):
        """Count node `n`'s bytes under `key`, per token when it has a [b, t] lead."""
        v = tensor_val(n)
        if v is None:
            return
        nbytes = v.numel() * v.element_size()
        shp = concrete_shape(v)
        if len(shp) >= 2 and tuple(shp[:2]) == (b, t) and nbytes % max(b * t, 1) == 0:
            totals[key][0] += nbytes // max(b * t, 1)
        else:
            totals[key][1] += nbytes

    for n in gone:
        if is_view_op(n) or tensor_val(n) is None:
            continue
        add("before", n)
        for a in site.inputs_of.get(n, ()):
            add("before", a)
    for n in site.after:
        add("after", n)
    before, after = (sympy.Integer(totals[k][0]) * rows + totals[k][1] for k in ("before", "after"))
    return str(sympy.expand(before)), str(sympy.expand(after)), subs
