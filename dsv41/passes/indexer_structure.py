"""Structure of the indexer chains (family `indexer`, indexer.py): the region steps and cut search, the score chain's
cuts (FP4 key pair, head weights, q, n_visible), the probe tensors of scores and selections, and the near-miss order."""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from .engine import (backward_distances, closed_region, concrete_shape, cut_search, dtype_of, is_shape_value, is_step,
                     ranked, symbolic_part, tensor_val, walk_forward)

__all__ = ["MATMULS", "SORTS", "EXTRA_STEPS", "INT_DTYPES", "FLOAT_DTYPES", "FORWARD_LIMIT", "CUT_REGION", "PRIORITY",
           "clear_shapes", "shape", "forward_steps", "distances_back", "closed_steps", "cuts", "score_cuts",
           "reads_index_keys", "strip_upcast", "symbolic_reason", "most_specific", "score_probes", "scores_agree",
           "selection_probes"]

aten = torch.ops.aten
prims = torch.ops.prims
MATMULS = {aten.mm.default, aten.bmm.default}
SORTS = {aten.sort.stable, aten.sort.default}
#: Deterministic non-dataflow ops an indexer region may contain (matmul, selection, gather / scatter, padding).
EXTRA_STEPS = MATMULS | SORTS | {aten.topk.default, aten.gather.default, aten.scatter.src, aten.scatter.value,
                                 aten.constant_pad_nd.default, aten.max.dim}
INT_DTYPES = (torch.int64, torch.int32)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FORWARD_LIMIT = 40      # nodes walked forward from an anchor to the chain's end
CUT_REGION = 160        # nodes searched back from a chain's end for the op's inputs
_PER_ROLE = 4           # candidates tried per input
_SHAPES: dict = {}  # node -> concrete shape, filled during one `run` (a node's shape never changes)


def clear_shapes() -> None:
    """Forget the shapes cached by `shape` (at the start of each run: nodes of another graph may reuse ids)."""
    _SHAPES.clear()


def _step(n: fx.Node) -> bool:
    """A node an indexer region may contain: a region step or one of `EXTRA_STEPS` (or an item of its result)."""
    return is_step(n, EXTRA_STEPS)


def forward_steps(anchor: fx.Node, limit: int) -> list:
    """Users of `anchor`, breadth first through region steps, at most `limit`."""
    return walk_forward(anchor, limit, _step)


def distances_back(end: fx.Node, limit: int) -> dict:
    """node -> distance from `end`, walking back through region steps while fewer than `limit` nodes are known."""
    return backward_distances(end, limit, _step)


def closed_steps(end: fx.Node, cut, limit: int):
    """Nodes computing `end` from exactly the `cut` nodes (each used) and small constants, or None."""
    return closed_region(end, cut, limit, lambda n: _step(n) or is_shape_value(n))


def cuts(end: fx.Node, want: dict, pos: dict, dist: dict | None = None):
    """Closed cuts of `end`: `want` maps role -> predicate(node) or a list of candidate nodes; yields
    (role -> node, region), the combination nearest to `end` first."""
    dist = dist if dist is not None else distances_back(end, CUT_REGION)
    cands = {}
    for role, ok in want.items():
        c = ok if isinstance(ok, list) else [n for n in dist if n is not end and tensor_val(n) is not None and ok(n)]
        cands[role] = ranked(c, dist, pos, _PER_ROLE)
        if not cands[role]:
            return
    yield from cut_search(cands, dist, lambda combo: closed_steps(end, combo, CUT_REGION))


def shape(n):
    """Concrete shape of a node's tensor value (cached for the run), None for non-tensor nodes."""
    got = _SHAPES.get(n, False)
    if got is False:
        v = tensor_val(n)
        got = _SHAPES[n] = concrete_shape(v) if v is not None else None
    return got


def score_cuts(end: fx.Node, pos: dict):
    """Closed cuts of a score chain ending at `end` [B, T, N]: the byte pair (codes [B, N, D/2], scales
    [B, N, D/32]) fixes D, the head weights [B, T, H] fix H, then q must be [B, T, H, D]."""
    b, t, n = shape(end)
    dist = distances_back(end, CUT_REGION)
    nodes = [x for x in dist if x is not end and shape(x) is not None]
    u8 = [x for x in nodes if dtype_of(x) == torch.uint8 and len(shape(x)) == 3 and shape(x)[:2] == (b, n)]
    if len(u8) < 2:
        return
    nvis = [x for x in nodes if dtype_of(x) in INT_DTYPES and shape(x) == (b, t)]
    floats: dict = {}
    for x in nodes:
        if dtype_of(x) in FLOAT_DTYPES:
            floats.setdefault(shape(x), []).append(x)
    for codes, scales in itertools.product(u8, u8):
        d = 2 * shape(codes)[2]
        if codes is scales or d % 32 or shape(scales)[2] != d // 32:
            continue
        for shp, heads in floats.items():
            if len(shp) != 3 or shp[:2] != (b, t):
                continue
            qs = floats.get((b, t, shp[2], d))
            if not qs:
                continue
            want = {"key_codes": [codes], "key_scales": [scales], "q": qs, "weights": heads, "n_visible": nvis}
            yield from cuts(end, want, pos, dist)


def reads_index_keys(mm: fx.Node) -> bool:
    """Cheap structural filter for a score anchor: a uint8 [B, N, D/2] / [B, N, D/32] pair a few steps back."""
    dist = distances_back(mm, CUT_REGION)
    u8 = [shape(x) for x in dist if dtype_of(x) == torch.uint8 and shape(x) is not None and len(shape(x)) == 3]
    return any(a[:2] == c[:2] and a[2] == 16 * c[2] for a in u8 for c in u8)


def strip_upcast(n: fx.Node):
    """(tensor, passed): the tensor an exact cast to FP32 of the same shape reads (the op reads in FP32 anyway)."""
    passed = []
    while (n.op == "call_function" and n.target in (prims.convert_element_type.default, aten._to_copy.default)
           and isinstance(n.args[0], fx.Node) and dtype_of(n) == torch.float32
           and dtype_of(n.args[0]) in FLOAT_DTYPES and shape(n.args[0]) == shape(n)):
        passed.append(n)
        n = n.args[0]
    return n, passed


def symbolic_reason(nodes, op: str, k=None):
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


PRIORITY = ("static_k", "static_shapes", "visibility", "tie_rule", "index_score_values", "block_max_values",
            "topk_values")


def most_specific(reasons):
    """The (check, reason) of `reasons` whose check comes first in `PRIORITY`."""
    return min(reasons, key=lambda r: PRIORITY.index(r[0]) if r[0] in PRIORITY else 99)


def score_probes(cut, gen, partial: bool = False):
    """Probe inputs of a score chain: every key byte value, scales 2^-17 .. 2^13, signed head weights, n_visible
    spanning 0 .. N (the last query sees every row; with `partial` it sees fewer than N, so a single query row, as
    at batch-1 decode, still tells which rows a visibility rule hides)."""
    q, w, kc, ks, nv = (tensor_val(cut[r]) for r in ("q", "weights", "key_codes", "key_scales", "n_visible"))
    b, n, half = concrete_shape(kc)
    codes = torch.randint(0, 256, (b, n, half), generator=gen, dtype=torch.int64)
    codes.view(-1)[: min(256, codes.numel())] = torch.arange(min(256, codes.numel()))
    scales = torch.randint(110, 141, concrete_shape(ks), generator=gen)
    qv = torch.randn(concrete_shape(q), generator=gen)
    wv = torch.randn(concrete_shape(w), generator=gen)
    nvv = torch.randint(0, n + 1, concrete_shape(nv), generator=gen)
    nvv.view(-1)[-1] = n - 1 - n // 3 if partial and n > 1 else n
    if nvv.numel() > 1:
        nvv.view(-1)[0] = 0
    dev = q.device
    return {cut["q"]: qv.to(q.dtype).to(dev), cut["weights"]: wv.to(w.dtype).to(dev),
            cut["key_codes"]: codes.to(torch.uint8).to(dev), cut["key_scales"]: scales.to(torch.uint8).to(dev),
            cut["n_visible"]: nvv.to(nv.dtype).to(dev)}


def scores_agree(got, ref) -> bool:
    """FP32 `got` has -inf exactly where `ref` has, and agrees elsewhere to 1e-5 (relative to max |ref|)."""
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


def selection_probes(shape, gen, n_visible=None):
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
