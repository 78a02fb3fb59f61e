"""Structure of the Engram chains (family `engram`, engram.py): row gathers of the FP8 tables, the cut search with
leaf ranking, escaping intermediates, the hash roles and the probe tensors of the hash and the gate."""

from __future__ import annotations

import itertools
import math

import torch
import torch.fx as fx

from .records import NearMiss
from .engine import (PASS_THROUGH, backward_distances, closed_region, cut_search, dtype_of, is_shape_value,
                     is_small_constant, is_step, is_view_op, node_label, shape_of, tensor_val)

__all__ = ["FLOATS", "CUT_REGION", "backward_leaves", "leaf_sets", "graph_index", "reset_positions", "engram_cuts",
           "escapes", "escape_miss", "gather_parts", "is_reshape", "gather_pairs", "is_reduction", "probe_rows",
           "hash_roles", "hash_probes", "index_views", "gate_probes", "residuals"]

aten = torch.ops.aten
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
CUT_REGION = 120        # nodes searched back from the end of a hash / gate region
_PER_ROLE = 6           # candidates tried per input role
_MAX_COMBOS = 4000      # cuts tried per chain
_POSITIONS: dict = {}


def backward_leaves(end: fx.Node, limit: int, stop: frozenset = frozenset()) -> tuple[dict, set]:
    """(node -> distance from `end`, leaves): nodes within `limit` steps back through region steps (not through
    the `stop` nodes), and the boundary tensors reached (graph inputs, large constants, non-dataflow ops, `stop`)."""
    leaves: set = set()

    def boundary(a):
        """A tensor the walk stops at is a leaf unless it is a small lifted constant."""
        if tensor_val(a) is not None and not (a.op == "get_attr" and is_small_constant(a)):
            leaves.add(a)

    return backward_distances(end, limit, lambda a: a not in stop and is_step(a), boundary), leaves


def leaf_sets(nodes, leaves: set) -> dict:
    """node -> the leaves it is computed from (through the given nodes), for ranking cut candidates."""
    out: dict = {}
    order = sorted(nodes, key=graph_index)
    for n in order:
        if n in leaves:
            out[n] = frozenset({n})
            continue
        acc: set = set()
        for a in n.all_input_nodes:
            acc |= out.get(a, frozenset())
        out[n] = frozenset(acc)
    return out


def graph_index(n: fx.Node) -> int:
    """Position of `n` in its graph. Cached per graph; each finder starts with `reset_positions` (rewrites
    happen between finders), and a node the cache has not seen rebuilds it."""
    cache = _POSITIONS.get(id(n.graph))
    if cache is None or n not in cache:
        cache = {m: i for i, m in enumerate(n.graph.nodes)}
        _POSITIONS.clear()
        _POSITIONS[id(n.graph)] = cache
    return cache[n]


def reset_positions() -> None:
    """Forget the cached graph positions (rewrites happen between finders)."""
    _POSITIONS.clear()


def _in_region(n: fx.Node) -> bool:
    """A node an Engram region may contain: a region step or shape arithmetic."""
    return is_step(n) or is_shape_value(n)


def _engram_region(end: fx.Node, cut: tuple, limit: int):
    """Nodes computing `end` from exactly the `cut` nodes (each used) and constants, in graph order; or None."""
    nodes = closed_region(end, cut, limit, _in_region)
    return None if nodes is None else sorted(nodes, key=graph_index)


def engram_cuts(end: fx.Node, roles: dict, sourced: set, by_leaves: bool, pinned: dict | None = None):
    """Closed cuts of the region ending at `end` for `roles` (name -> (shape, dtypes)), best first; yields
    (assignment, region). `pinned` fixes some roles to a node (found structurally): the other roles are searched
    only in front of them. Candidates (tensors computed from graph inputs, not constants) are ranked by distance
    from `end`, with `by_leaves` first by the number of leaves they depend on (an input of the chain is a view or
    cast of one source tensor; the chain's own intermediates mix several)."""
    pinned = pinned or {}
    dist, leaves = backward_leaves(end, CUT_REGION, frozenset(pinned.values()))
    sets = leaf_sets(dist, leaves)
    cands = {}
    for role, (shape, dtypes) in roles.items():
        if role in pinned:
            cands[role] = [pinned[role]] if pinned[role] in dist else []
            continue
        pool = [n for n in dist if n is not end and n in sourced and n not in pinned.values()
                and dtype_of(n) in dtypes and shape_of(n) == shape]
        pool.sort(key=lambda n: (len(sets.get(n, ())) if by_leaves else 0, dist[n], -graph_index(n)))
        cands[role] = pool[:_PER_ROLE]

    def region_of(combo):
        """The region of `combo` when the combination covers every leaf the end depends on."""
        if not leaves <= frozenset().union(*(sets.get(n, frozenset()) for n in combo)):
            return None
        return _engram_region(end, combo, CUT_REGION)

    yield from cut_search(cands, dist, region_of, _MAX_COMBOS)


def escapes(region: list, keep: set, sourced: set):
    """The first region node (not in `keep`, not a constant factory) that a node outside the region reads."""
    inside = set(region) | keep
    for n in region:
        if n in keep or n not in sourced:
            continue
        for u in n.users:
            if u not in inside:
                return n, u
    return None


def escape_miss(pattern: str, esc, loc) -> NearMiss:
    """The near-miss `intermediate_escapes` of `escapes`' (node, reader) pair."""
    n, u = esc
    return NearMiss("engram", pattern, "intermediate_escapes",
                    f"{node_label(n)} ({n.name}) inside the chain is also read by {node_label(u)} ({u.name}); fusing "
                    "would compute the chain twice", loc)


def gather_parts(n: fx.Node):
    """(table, ids) of a row gather `table[ids]` of a uint8 2-D table (views of ids stripped), else None."""
    if n.op != "call_function":
        return None
    if n.target == aten.index.Tensor:
        idx = n.args[1]
        if len(idx) != 1 or not isinstance(idx[0], fx.Node):
            return None
        table, ids = n.args[0], idx[0]
    elif n.target == aten.embedding.default:
        table, ids = n.args[0], n.args[1]
    else:
        return None
    tv = tensor_val(table)
    if tv is None or tv.dtype != torch.uint8 or tv.dim() != 2 or dtype_of(ids) not in (torch.int64, torch.int32):
        return None
    while is_reshape(ids):
        ids = ids.args[0]
    return table, ids


#: Views that keep the logical (row-major) element order: the gathered rows come in the order of the ids.
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
             aten.squeeze.dim, aten.squeeze.default, aten.flatten.using_ints, aten.alias.default}
if hasattr(aten.squeeze, "dims"):
    _RESHAPES.add(aten.squeeze.dims)


def is_reshape(n) -> bool:
    """A view that keeps the row-major element order (`_RESHAPES`) of a tensor node."""
    return (isinstance(n, fx.Node) and n.op == "call_function" and n.target in _RESHAPES
            and isinstance(n.args[0], fx.Node) and tensor_val(n.args[0]) is not None)


def gather_pairs(graph: fx.Graph) -> list:
    """(weight gather, scale gather, weight table, scale table, ids) for gathers of a [rows, C] and a [rows, C/32]
    uint8 table with the same ids."""
    by_ids: dict = {}
    for n in graph.nodes:
        parts = gather_parts(n)
        if parts is not None:
            by_ids.setdefault(parts[1], []).append((n, parts[0]))
    pairs = []
    for ids, gathers in by_ids.items():
        for (gw, w), (gs, s) in itertools.permutations(gathers, 2):
            rows, c = shape_of(w)
            if c % 32 == 0 and shape_of(s) == (rows, c // 32):
                pairs.append((gw, gs, w, s, ids))
    return pairs


def is_reduction(n: fx.Node) -> bool:
    """A reduction op (tagged so, or amax / amin / sum / mean)."""
    t = n.target
    tag = getattr(torch.Tag, "reduction", None)
    return isinstance(t, torch._ops.OpOverload) and (
        (tag is not None and tag in t.tags) or t in (aten.amax.default, aten.amin.default, aten.sum.dim_IntList,
                                                     aten.mean.dim))


def probe_rows(gw: fx.Node, gs: fx.Node):
    """Probe (codes, scales) for the two gathers: random E4M3 bytes without NaN encodings, UE8M0 bytes 112..140
    (products stay finite)."""
    gen = torch.Generator().manual_seed(2601)
    codes = torch.randint(0, 256, shape_of(gw), generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)  # no NaN encodings
    scales = torch.randint(112, 141, shape_of(gs), generator=gen, dtype=torch.int32)
    dev = tensor_val(gw).device
    return codes.to(torch.uint8).to(dev), scales.to(torch.uint8).to(dev)


def hash_roles(ids: fx.Node, dist_nodes) -> list:
    """Role sets (u [B, T, M], multipliers [M], primes [R], offsets [R]) for each look-back shape [B, T, M] and
    bucket count R seen in the region with B * T * R = the number of ids (the ids may be [B, T, R], flattened, or
    [B, T, M-1, heads])."""
    numel = tensor_val(ids).numel()
    ints = (torch.int64,)
    shapes = [shape_of(n) for n in dist_nodes if dtype_of(n) == torch.int64 and shape_of(n) is not None]
    looks = sorted({s for s in shapes if len(s) == 3 and s[2] >= 2})
    counts = sorted({s[0] for s in shapes if len(s) == 1})
    out = []
    for b, t, m in looks:
        for r in counts:
            if r % (m - 1) == 0 and b * t * r == numel:
                out.append({"u": ((b, t, m), ints), "multipliers": ((m,), ints), "primes": ((r,), ints),
                            "offsets": ((r,), ints)})
    return out


def hash_probes(cut: dict, gen):
    """Probe environments: A in range (products < 2^56), B full-range multipliers (products wrap), C like A with
    huge bucket sizes and zero offsets (the reference is then the bare hash)."""
    (b, t, m), r = shape_of(cut["u"]), shape_of(cut["primes"])[0]
    u_a = torch.randint(0, 1 << 16, (b, t, m), generator=gen)
    m_a = torch.randint(0, 1 << 39, (m,), generator=gen) * 2 + 1
    p_a = torch.randint(2, 1 << 20, (r,), generator=gen)
    o_a = torch.randint(0, 1 << 30, (r,), generator=gen)
    u_b = torch.randint(0, 1 << 31, (b, t, m), generator=gen)
    m_b = torch.randint(-(1 << 63), (1 << 63) - 1, (m,), generator=gen)
    p_b = torch.randint(2, 1 << 31, (r,), generator=gen)
    o_b = torch.randint(-(1 << 40), 1 << 40, (r,), generator=gen)
    p_c = torch.full((r,), (1 << 62) - 57, dtype=torch.int64)
    o_c = torch.zeros(r, dtype=torch.int64)
    return [(u_a, m_a, p_a, o_a), (u_b, m_b, p_b, o_b), (u_a, m_a, p_c, o_c)]


def index_views(gather: fx.Node) -> list:
    """View nodes between a gather and its (stripped) ids."""
    idx = gather.args[1][0] if gather.target == aten.index.Tensor else gather.args[1]
    out = []
    while is_reshape(idx):
        out.append(idx)
        idx = idx.args[0]
    return out


def gate_probes(cut: dict, lits: list, gen):
    """Probe environments (role -> tensor in the role node's dtype): run 0 random streams, stream 1 with a dot
    of 2e-7 (below the floor); then one run per eps literal with streams 2 (H) and 3 (keys) scaled to that RMS."""
    b, t, n, d = shape_of(cut["H"])
    f64 = torch.float64
    H = torch.randn(b, t, n, d, generator=gen, dtype=f64)
    K = torch.randn(b, t, n, d, generator=gen, dtype=f64)
    V = torch.randn(b, t, d, generator=gen, dtype=f64)
    W = {k: 1.0 + 0.1 * torch.randn(n, d, generator=gen, dtype=f64) for k in ("q_weight", "k_weight", "weight")}
    w1 = W["weight"] if "weight" in cut else W["q_weight"] * W["k_weight"]
    # Stream 1: one non-zero key channel, so the dot is the single product H[c0] w[c0] k[c0] scaled by rs.
    K[:, :, 1] = 0.0
    K[:, :, 1, 0] = 1.0
    rms = H[:, :, 1].square().mean(-1).sqrt()
    H[:, :, 1, 0] = 2e-7 * rms / w1[1, 0]
    runs = []
    for scale in [None] + [lit for lit in lits if lit > 0.0]:
        h, k = H.clone(), K.clone()
        if scale is not None:
            r = max(math.sqrt(scale), 1e-3 if dtype_of(cut["H"]) == torch.float16 else 0.0)
            h[:, :, 2] *= r / h[:, :, 2].square().mean(-1, keepdim=True).sqrt()
            k[:, :, 3] *= r / k[:, :, 3].square().mean(-1, keepdim=True).sqrt()
        vals = {"H": h, "keys": k, "value": V, **W}
        runs.append({role: vals[role].to(dtype_of(node)).to(tensor_val(node).device) for role, node in cut.items()})
    return runs


def residuals(add: fx.Node) -> list:
    """Candidates for H: each operand of the residual add of H's shape and the tensors it is a cast or identity
    view of, the farthest source first (the op reads H in its own dtype)."""
    out = []
    for side in add.args[:2]:
        if not isinstance(side, fx.Node) or shape_of(side) != shape_of(add):
            continue
        chain, n = [side], side
        while (n.op == "call_function" and (n.target in PASS_THROUGH or is_view_op(n)) and n.args
               and isinstance(n.args[0], fx.Node) and shape_of(n.args[0]) == shape_of(add)
               and dtype_of(n.args[0]) in FLOATS):
            n = n.args[0]
            chain.append(n)
        out.extend(reversed(chain))
    return out
