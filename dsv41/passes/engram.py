"""`engram` family: the two Engram chains of an Engram layer become `dsv41::engram_lookup` / `dsv41::engram_gate`.

Chains matched (ARCHITECTURE.md "Fusion patterns", row "Engram"; MODEL.md §2.10; eager code dsv41/model/engram.py):

    lookup  h_k = XOR_{s<=k} u_s * m_s (int64); ids[j] = remainder(h_k, primes[j]) + offsets[j];
            rows = dequantize_fp8_1x32(weight[ids], scale[ids])         (the input of the `wkv` projection)
                -> dsv41::engram_lookup(u, multipliers, primes, offsets, weight, scale, dtype)
    gate    rs = rsqrt(mean(H^2) + eps) rsqrt(mean(key^2) + eps); dot = sum(H w key) rs / sqrt(d);
            H' = H + sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))) * value
                -> dsv41::engram_gate(H, keys, value, q_weight, k_weight, eps)

The `wkv` projection between them is a quantised linear: the `dispatch` family (which runs after this one)
fuses it, reading the lookup's output as its activation. The look-back `u` (the n-gram token ids, computed once
per step for all Engram layers) stays outside the lookup: it is shared. One lookup and one gate per Engram layer.

Structure (spelling-independent). Lookup: two row gathers (`aten.index.Tensor(table, [ids])` or
`aten.embedding`) with the same ids (up to reshapes, which keep the rows' order) of a uint8 table [rows, C]
(C % 32 == 0) and a uint8 table [rows, C/32]; the dequantised rows are the latest float tensor computed
elementwise from the two gathered tensors alone whose values, flattened, equal the dequantisation and whose
chain nothing else reads (the end); the ids are a closed function of an int64 look-back u [B, T, M] and int64
vectors multipliers [M], primes [R], offsets [R], with B * T * R ids (a *cut* found by search, nearest first).
Gate: an add of shape [B, T, 4, d] (or its cast) one of whose operands is H (up to casts); the region in front
of H is closed over keys [B, T, 4, d], value [B, T, d] and one or two [4, d] weights (a precomputed product
w = q * k is fused with k_weight = ones).

Semantics (how the constants are settled): the region's own ATen nodes are evaluated on probe tensors and
compared with the references (dsv41/model/engram.py, formats.py). Hash probes: look-back ids below 2^16 with
multipliers below 2^40 (no product overflows: the model's range), then full-range int64 multipliers (products
wrap around, hashes turn negative: `torch.remainder` floors, `fmod` truncates), both compared bit for bit. The
dequantisation is compared bit for bit (up to 2 ulps of the output dtype) on random E4M3 bytes (NaN codes
excluded) and UE8M0 bytes 112..140 (as the dispatch family; a spelling that differs only at bytes 0 or 255 is
accepted). Gate probes: random streams, one stream whose dot is 2e-7 (pins the 1e-6 floor) and, per eps
candidate (float literals of the region below 1e-2, then 0), streams scaled to that RMS (pins eps); compared
at FP32 rounding (bf16 outputs: one bf16 rounding, so there the floor is not pinned). A look-alike is a
`NearMiss` naming the failed check: `hash_int64_wraparound` (equal in range, not once products wrap),
`bucket_modulus` (the buckets are not h mod primes[j], or the region reads no [R] prime vector),
`bucket_offsets` (no [R] offset vector), `rolling_hash`, `dequant_values`, `gate_signed_sqrt` (sigmoid(dot)
without the signed square root), `gate_floor`, `rms_eps`, `gate_values`, `intermediate_escapes`.

Bytes per match (sympy in B, L): before = what the removed ATen ops read and write as separate eager kernels
(a gather reads the rows it gathers, not its table; views free); after = the fused op's inputs and output (the
gathered rows, not the tables). Tensors computed from activations count per token, constants once per step.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
from collections import deque
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from ..model.engram import engram_row_ids, engram_update
from ..model.formats import dequantize_fp8_1x32
from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (FusionFamily, RegionEvaluator, RegionNotClosed, agree_where_representable, concrete_shape,
                     dsv41_op, eliminate_dead_code, insert_node, is_dataflow_op, is_table_lookup, is_view_op,
                     node_label, rms_eps_reason, sourced_nodes, static_refusal, symbolic_part, tensor_val, token_rows,
                     wide_scale_probes)

__all__ = ["EngramFamily", "HC_STREAMS", "GATE_FLOOR"]

aten = torch.ops.aten
prims = torch.ops.prims
#: Residual streams of the gate (hc_mult, always 4).
HC_STREAMS = 4
#: Lower bound of |dot| under the gate's signed square root (MODEL.md §2.10).
GATE_FLOOR = 1e-6
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_PASS_THROUGH = {prims.convert_element_type.default, aten.clone.default, aten._to_copy.default}
_DEQUANT_LIMIT = 64     # nodes of the dequantisation after the two gathers
_CUT_REGION = 120       # nodes searched back from the end of a hash / gate region
_PER_ROLE = 6           # candidates tried per input role
_MAX_COMBOS = 4000      # cuts tried per chain
_EPS_LIMIT = 1e-2       # float literals below this are eps candidates


@dataclass
class _Site:
    """A verified chain: the op, its args, the node it replaces, the region nodes and what the bytes count."""

    pattern: str
    op_name: str
    anchor: fx.Node
    args: tuple
    end: fx.Node
    region: list
    activations: tuple
    detail: tuple
    gathered: tuple = ()            # (gather node, table node) pairs: a gather reads rows, not its table
    inputs_of: dict = field(default_factory=dict)


class EngramFamily(FusionFamily):
    """Fuse the Engram lookup (hash -> rows -> FP8 gather -> dequantise) and gate chains (module docstring)."""

    name = "engram"
    summary = ("Engram: n-gram hash -> bucket ids -> FP8 row gather -> dequantise (wkv input); per-stream gate "
               "(two RMS statistics, weighted dot, signed sqrt, sigmoid) + residual add")

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Replace every verified Engram lookup and gate chain of `gm`; returns the record (matches, near-misses)."""
        _register_ops()
        graph = gm.graph
        start = set(graph.nodes)
        ev = RegionEvaluator(gm)
        sites: list[_Site] = []
        misses: list[NearMiss] = []
        missing: set = set()
        # Sites are found before any is rewritten: a later site may read an earlier site's end (stacked gates).
        replaced: dict = {}
        try:
            self._fuse(graph, ev, sites, misses, missing, replaced)
        finally:
            _reset_positions()
        removed = start - set(graph.nodes)
        matches = tuple(_record(self.name, s, removed) for s in sites)
        note = f"ops not registered: {', '.join(sorted(missing))}" if missing else ""
        return PassRecord(self.name, True, matches, tuple(misses), (), note)

    def _fuse(self, graph, ev, sites, misses, missing, replaced) -> None:
        for finder in (_find_lookups, _find_gates):
            found, near = finder(graph, ev)
            misses.extend(near)
            for site in found:
                refused = static_refusal(self.name, site.pattern, [*site.args, site.end, *site.region],
                                         SourceLocation.from_node(site.anchor), f"dsv41::{site.op_name}")
                if refused is not None:
                    misses.append(refused)
                    continue
                op = dsv41_op(site.op_name)
                if op is None:
                    missing.add(site.op_name)
                    misses.append(NearMiss(self.name, site.pattern, "op_registered",
                                           f"dsv41::{site.op_name} is not registered (import dsv41.kernels.engram)",
                                           SourceLocation.from_node(site.anchor)))
                    continue
                replaced[site.end] = _rewrite(graph, site, op, replaced)
                sites.append(site)
            eliminate_dead_code(graph)


def _register_ops() -> None:
    """Import the kernels module registering `dsv41::engram_*` (a chain whose op is missing becomes a near-miss)."""
    try:
        import dsv41.kernels.engram  # noqa: F401
    except ImportError:
        pass


@contextlib.contextmanager
def _real_tensors():
    """Run reference math on real tensors even inside Inductor's compile (no fake mode, no dispatch modes)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes(), torch.no_grad():
        yield


# ------------------------------------------------------------------------------------------------ helpers
def _shape(n) -> tuple | None:
    v = tensor_val(n)
    return concrete_shape(v) if v is not None else None


def _dtype(n):
    v = tensor_val(n)
    return v.dtype if v is not None else None


def _is_shape_value(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def _is_step(n: fx.Node) -> bool:
    """A node a region may contain: a dataflow op, a constant-table lookup, or an item of a dataflow op's result."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and is_dataflow_op(src)
    return is_dataflow_op(n) or is_table_lookup(n)


def _literals(nodes) -> list[float]:
    """Float literals below `_EPS_LIMIT` among the nodes' arguments (eps candidates), in graph order, then 0."""
    out: list[float] = []

    def visit(a):
        if isinstance(a, float) and 0.0 < a < _EPS_LIMIT and a not in out:
            out.append(a)
        return a

    for n in nodes:
        fx.node.map_aggregate(n.args, visit)
        fx.node.map_aggregate(n.kwargs, visit)
    return out + [0.0]


def _backward(end: fx.Node, limit: int, stop: frozenset = frozenset()) -> tuple[dict, set]:
    """(node -> distance from `end`, leaves): nodes within `limit` steps back through region steps (not through
    the `stop` nodes), and the boundary tensors reached (graph inputs, large constants, non-dataflow ops, `stop`)."""
    dist, leaves = {end: 0}, set()
    queue = deque([end])
    while queue:
        n = queue.popleft()
        for a in n.all_input_nodes:
            if a in dist:
                continue
            dist[a] = dist[n] + 1
            if a not in stop and _is_step(a) and len(dist) < limit:
                queue.append(a)
            elif tensor_val(a) is not None and not _is_constant(a):
                leaves.add(a)
    return dist, leaves


def _is_constant(n: fx.Node) -> bool:
    """A small lifted constant (a region may read it freely)."""
    v = tensor_val(n)
    return n.op == "get_attr" and v is not None and v.numel() <= 256


def _leaf_sets(nodes, leaves: set) -> dict:
    """node -> the leaves it is computed from (through the given nodes), for ranking cut candidates."""
    out: dict = {}
    order = sorted(nodes, key=_graph_index)
    for n in order:
        if n in leaves:
            out[n] = frozenset({n})
            continue
        acc: set = set()
        for a in n.all_input_nodes:
            acc |= out.get(a, frozenset())
        out[n] = frozenset(acc)
    return out


_POSITIONS: dict = {}


def _graph_index(n: fx.Node) -> int:
    """Position of `n` in its graph. Cached per graph; each finder starts with `_reset_positions` (rewrites
    happen between finders), and a node the cache has not seen rebuilds it."""
    cache = _POSITIONS.get(id(n.graph))
    if cache is None or n not in cache:
        cache = {m: i for i, m in enumerate(n.graph.nodes)}
        _POSITIONS.clear()
        _POSITIONS[id(n.graph)] = cache
    return cache[n]


def _reset_positions() -> None:
    _POSITIONS.clear()


def _closed_region(end: fx.Node, cut: tuple, limit: int):
    """Nodes computing `end` from exactly the `cut` nodes (each used) and constants, in graph order; or None."""
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
        if n.op == "get_attr":
            if not _is_constant(n):
                return None
            continue
        if n.op != "call_function" or not (_is_step(n) or _is_shape_value(n)):
            return None
        nodes.append(n)
        if len(nodes) > limit:
            return None
        stack.extend(n.all_input_nodes)
    if reached != cutset:
        return None
    return sorted(nodes, key=_graph_index)


def _cuts(end: fx.Node, roles: dict, sourced: set, by_leaves: bool, pinned: dict | None = None):
    """Closed cuts of the region ending at `end` for `roles` (name -> (shape, dtypes)), best first; yields
    (assignment, region). `pinned` fixes some roles to a node (found structurally): the other roles are searched
    only in front of them. Candidates (tensors computed from graph inputs, not constants) are ranked by distance
    from `end`, with `by_leaves` first by the number of leaves they depend on (an input of the chain is a view or
    cast of one source tensor; the chain's own intermediates mix several)."""
    pinned = pinned or {}
    dist, leaves = _backward(end, _CUT_REGION, frozenset(pinned.values()))
    sets = _leaf_sets(dist, leaves)
    cands = {}
    for role, (shape, dtypes) in roles.items():
        if role in pinned:
            cands[role] = [pinned[role]] if pinned[role] in dist else []
            continue
        pool = [n for n in dist if n is not end and n in sourced and n not in pinned.values()
                and _dtype(n) in dtypes and _shape(n) == shape]
        pool.sort(key=lambda n: (len(sets.get(n, ())) if by_leaves else 0, dist[n], -_graph_index(n)))
        cands[role] = pool[:_PER_ROLE]
    if not all(cands.values()):
        return
    combos = sorted(itertools.product(*cands.values()), key=lambda c: sum(dist[n] for n in c))
    for combo in combos[:_MAX_COMBOS]:
        if len(set(combo)) != len(combo):
            continue
        if not leaves <= frozenset().union(*(sets.get(n, frozenset()) for n in combo)):
            continue
        region = _closed_region(end, combo, _CUT_REGION)
        if region is not None:
            yield dict(zip(roles, combo)), region


def _escapes(region: list, keep: set, sourced: set):
    """The first region node (not in `keep`, not a constant factory) that a node outside the region reads."""
    inside = set(region) | keep
    for n in region:
        if n in keep or n not in sourced:
            continue
        for u in n.users:
            if u not in inside:
                return n, u
    return None


def _escape_miss(pattern: str, esc, loc) -> NearMiss:
    n, u = esc
    return NearMiss("engram", pattern, "intermediate_escapes",
                    f"{node_label(n)} ({n.name}) inside the chain is also read by {node_label(u)} ({u.name}); fusing "
                    "would compute the chain twice", loc)


# ------------------------------------------------------------------------------------------------ lookup
def _gather_parts(n: fx.Node):
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
    if tv is None or tv.dtype != torch.uint8 or tv.dim() != 2 or _dtype(ids) not in (torch.int64, torch.int32):
        return None
    while _is_reshape(ids):
        ids = ids.args[0]
    return table, ids


#: Views that keep the logical (row-major) element order: the gathered rows come in the order of the ids.
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
             aten.squeeze.dim, aten.squeeze.default, aten.flatten.using_ints, aten.alias.default}
if hasattr(aten.squeeze, "dims"):
    _RESHAPES.add(aten.squeeze.dims)


def _is_reshape(n) -> bool:
    return (isinstance(n, fx.Node) and n.op == "call_function" and n.target in _RESHAPES
            and isinstance(n.args[0], fx.Node) and tensor_val(n.args[0]) is not None)


def _gather_pairs(graph: fx.Graph) -> list:
    """(weight gather, scale gather, weight table, scale table, ids) for gathers of a [rows, C] and a [rows, C/32]
    uint8 table with the same ids."""
    by_ids: dict = {}
    for n in graph.nodes:
        parts = _gather_parts(n)
        if parts is not None:
            by_ids.setdefault(parts[1], []).append((n, parts[0]))
    pairs = []
    for ids, gathers in by_ids.items():
        for (gw, w), (gs, s) in itertools.permutations(gathers, 2):
            rows, c = _shape(w)
            if c % 32 == 0 and _shape(s) == (rows, c // 32):
                pairs.append((gw, gs, w, s, ids))
    return pairs


def _dequant_ends(gw: fx.Node, gs: fx.Node, ev, sourced: set):
    """(ends, why): the float nodes computed from the two gathered tensors alone (elementwise, no reduction) whose
    flattened values equal `dequantize_fp8_1x32` of them, latest first, each with its region (graph order); or
    ([], near-miss reason or None)."""
    inside = {gw, gs}
    forward: list = []
    queue = deque(list(gw.users) + list(gs.users))
    while queue and len(forward) < _DEQUANT_LIMIT:
        u = queue.popleft()
        # Dequantisation is elementwise per 1x32 block: a reduction (e.g. the amax of the next linear's activation
        # fake-quant) starts another chain, which dispatch fuses into the projection.
        if u in inside or not _is_step(u) or _is_reduction(u):
            continue
        if all(a in inside or a not in sourced for a in u.all_input_nodes):
            inside.add(u)
            forward.append(u)
            queue.extend(u.users)
    numel = tensor_val(gw).numel()
    cands = [n for n in forward if _dtype(n) in _FLOATS and tensor_val(n).numel() == numel]
    if not cands:
        return [], None
    codes, scales = _probe_rows(gw, gs)
    with _real_tensors():
        try:
            got = ev.evaluate(cands, {gw: codes, gs: scales})
        except (RegionNotClosed, RuntimeError):
            return [], None
        c = _shape(gw)[-1]
        flat = (codes.reshape(-1, c), scales.reshape(-1, c // 32))
        ok = [n for n in cands if _close_exact(got[n].reshape(-1), dequantize_fp8_1x32(*flat, _dtype(n)).reshape(-1))]
        # The probe's scale bytes 112..140 keep products finite; also compare on every byte 1..254, so a spelling
        # that clamps or saturates other exponents is not taken for the UE8M0 rule.
        for wide in wide_scale_probes(scales) if ok else ():
            got_w = ev.evaluate(ok, {gw: codes, gs: wide})
            ref_w = (codes.reshape(-1, c), wide.reshape(-1, c // 32))
            ok = [n for n in ok if agree_where_representable(got_w[n].reshape(-1),
                                                             dequantize_fp8_1x32(*ref_w, _dtype(n)).reshape(-1))]
    if not ok:
        return [], ("dequant_values", "the gathered E4M3 rows and UE8M0 scales are not dequantised as "
                    "codes * 2^(scale - 127) per 1x32 block (MODEL.md §2.1; dsv41/model/formats.py "
                    "dequantize_fp8_1x32)")
    ok.sort(key=_graph_index, reverse=True)
    return [(end, _ancestors_within(end, set(forward))) for end in ok], None


def _is_reduction(n: fx.Node) -> bool:
    t = n.target
    tag = getattr(torch.Tag, "reduction", None)
    return isinstance(t, torch._ops.OpOverload) and (
        (tag is not None and tag in t.tags) or t in (aten.amax.default, aten.amin.default, aten.sum.dim_IntList,
                                                     aten.mean.dim))


def _probe_rows(gw: fx.Node, gs: fx.Node):
    gen = torch.Generator().manual_seed(2601)
    codes = torch.randint(0, 256, _shape(gw), generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)  # no NaN encodings
    scales = torch.randint(112, 141, _shape(gs), generator=gen, dtype=torch.int32)
    dev = tensor_val(gw).device
    return codes.to(torch.uint8).to(dev), scales.to(torch.uint8).to(dev)


def _close_exact(got, ref: torch.Tensor) -> bool:
    """Equal, or within 2 ulps of the dtype (a hand-written exp2 may round its last bit differently)."""
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    if torch.equal(got, ref):
        return True
    eps = torch.finfo(ref.dtype).eps
    return bool(torch.allclose(got.float(), ref.float(), rtol=2 * eps, atol=0.0))


def _ancestors_within(end: fx.Node, allowed: set) -> list:
    seen, stack = set(), [end]
    while stack:
        n = stack.pop()
        if n in seen or n not in allowed:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return sorted(seen, key=_graph_index)


def _hash_roles(ids: fx.Node, dist_nodes) -> list:
    """Role sets (u [B, T, M], multipliers [M], primes [R], offsets [R]) for each look-back shape [B, T, M] and
    bucket count R seen in the region with B * T * R = the number of ids (the ids may be [B, T, R], flattened, or
    [B, T, M-1, heads])."""
    numel = tensor_val(ids).numel()
    ints = (torch.int64,)
    shapes = [_shape(n) for n in dist_nodes if _dtype(n) == torch.int64 and _shape(n) is not None]
    looks = sorted({s for s in shapes if len(s) == 3 and s[2] >= 2})
    counts = sorted({s[0] for s in shapes if len(s) == 1})
    out = []
    for b, t, m in looks:
        for r in counts:
            if r % (m - 1) == 0 and b * t * r == numel:
                out.append({"u": ((b, t, m), ints), "multipliers": ((m,), ints), "primes": ((r,), ints),
                            "offsets": ((r,), ints)})
    return out


def _find_hash(ids: fx.Node, ev, sourced: set, loc, pattern):
    """(cut, region, None) for the verified hash region ending at `ids`, else (None, None, near-miss or None)."""
    if _dtype(ids) != torch.int64 or _shape(ids) is None:
        return None, None, None
    dist, _ = _backward(ids, _CUT_REGION)
    whys: list = []
    for roles in _hash_roles(ids, dist):
        for cut, region in _cuts(ids, roles, sourced, by_leaves=False):
            why = _verify_hash(ev, ids, cut)
            if why is None:
                return cut, region, None
            whys.append(why)
        if whys:
            continue
        # No cut reads both [R] vectors: a look-alike that reduces the hash by another modulus or drops the offsets.
        for absent, check, what in (("primes", "bucket_modulus", "prime bucket sizes"),
                                    ("offsets", "bucket_offsets", "row offsets")):
            partial = {k: v for k, v in roles.items() if k != absent}
            if next(_cuts(ids, partial, sourced, by_leaves=False), None) is not None:
                whys.append((check, f"the row ids read no [R] vector of per-(order, head) {what}: "
                             "dsv41::engram_lookup computes remainder(h_k, primes[j]) + offsets[j] (MODEL.md §2.10 "
                             "step 6)"))
                break
    if not whys:
        return None, None, None
    # Several assignments of the cut may fail (e.g. primes and offsets swapped): report the most specific check.
    why = min(whys, key=lambda w: _HASH_PRIORITY.index(w[0]) if w[0] in _HASH_PRIORITY else 99)
    return None, None, NearMiss("engram", pattern, *why, loc)


_HASH_PRIORITY = ("hash_int64_wraparound", "bucket_modulus", "bucket_offsets", "rolling_hash", "region_evaluates")


def _hash_probes(cut: dict, gen):
    """Probe environments: A in range (products < 2^56), B full-range multipliers (products wrap), C like A with
    huge bucket sizes and zero offsets (the reference is then the bare hash)."""
    (b, t, m), r = _shape(cut["u"]), _shape(cut["primes"])[0]
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


@_real_tensors()
def _verify_hash(ev, ids: fx.Node, cut: dict):
    """None when the region computes `engram_row_ids` on every probe, else (check, reason)."""
    gen = torch.Generator().manual_seed(10007)
    m, r = _shape(cut["multipliers"])[0], _shape(cut["primes"])[0]
    n_heads = r // (m - 1)
    dev = tensor_val(ids).device
    results = []
    for probe in _hash_probes(cut, gen):
        env = {cut[k]: v.to(dev) for k, v in zip(("u", "multipliers", "primes", "offsets"), probe)}
        try:
            got = ev.evaluate([ids], env)[ids]
        except (RegionNotClosed, RuntimeError):
            return ("region_evaluates", "the row-id region could not be evaluated on probe tensors")
        ref = engram_row_ids(*(x.to(dev) for x in probe), n_heads)
        results.append(isinstance(got, torch.Tensor) and got.numel() == ref.numel()
                       and torch.equal(got.long().reshape(ref.shape), ref))
    if all(results[:2]):
        return None
    if results[0]:
        return ("hash_int64_wraparound", "the row ids equal the model's while no product overflows, but not once the "
                "int64 products wrap around (e.g. fmod instead of the floor remainder, or a float hash); "
                "dsv41::engram_lookup follows torch's int64 wrap-around and remainder (MODEL.md §2.10 steps 5-6)")
    if results[2]:
        return ("bucket_modulus", "the hash h_k is the model's rolling XOR, but the bucket of row j is not "
                "remainder(h_k, primes[j]) + offsets[j] (MODEL.md §2.10 step 6)")
    return ("rolling_hash", "the row ids are not built from the rolling hash h_k = XOR_{s<=k} u_s * m_s with "
            "remainder(h_k, primes[j]) + offsets[j] per (order, head) (MODEL.md §2.10 steps 5-6)")


def _find_lookups(graph: fx.Graph, ev):
    _reset_positions()
    sites, misses = [], []
    sourced = sourced_nodes(graph)
    done: set = set()
    for gw, gs, w, s, ids in _gather_pairs(graph):
        if gw in done:
            continue
        loc = SourceLocation.from_node(gw)
        pattern = "engram hash -> row gather (FP8 + UE8M0) -> dequantise"
        refused = static_refusal("engram", pattern, [gw, gs, ids], loc, "dsv41::engram_lookup")
        if refused is not None:  # before the value checks, which see the compiled sizes only
            misses.append(refused)
            continue
        cut, hash_region, miss = _find_hash(ids, ev, sourced, loc, pattern)
        if cut is None:
            if miss is not None:
                misses.append(miss)
            continue
        ends, why = _dequant_ends(gw, gs, ev, sourced)
        if not ends:
            if why is not None:
                misses.append(NearMiss("engram", pattern, *why, loc))
            continue
        # The latest end whose chain nothing else reads (a later reshape for the matmul, say, may not be it when
        # the rows are also returned).
        views = _index_views(gw) + _index_views(gs)
        end = esc = None
        for cand, deq_region in ends:
            region = sorted(set(hash_region) | {gw, gs} | set(views) | set(deq_region), key=_graph_index)
            esc = _escapes(region, {cand}, sourced)
            if esc is None:
                end = cand
                break
        if end is None:
            misses.append(_escape_miss(pattern, esc, loc))
            continue
        m, r, c = _shape(cut["u"])[2], _shape(cut["primes"])[0], _shape(w)[1]
        detail = (("M", m), ("n_heads", r // (m - 1)), ("R", r), ("C", c), ("rows", _shape(w)[0]),
                  ("dtype", str(_dtype(end)).replace("torch.", "")))
        args = (cut["u"], cut["multipliers"], cut["primes"], cut["offsets"], w, s, _dtype(end))
        sites.append(_Site("engram_lookup", "engram_lookup", gw, args, end, region, (cut["u"],), detail,
                           gathered=((gw, w), (gs, s))))
        done.update((gw, gs))
    return sites, misses


def _index_views(gather: fx.Node) -> list:
    """View nodes between a gather and its (stripped) ids."""
    idx = gather.args[1][0] if gather.target == aten.index.Tensor else gather.args[1]
    out = []
    while _is_reshape(idx):
        out.append(idx)
        idx = idx.args[0]
    return out


# ------------------------------------------------------------------------------------------------ gate
def _gate_ref(H, keys, value, qw, kw, eps, floor=GATE_FLOOR, signed_sqrt=True):
    """The gate in FP32 with its constants as parameters (diagnosis of look-alikes only; the accepted match is
    checked against the model's `engram_update`)."""
    hf, kf = H.float(), keys.float()
    w = qw.float() * kw.float()
    rs = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(kf.square().mean(-1) + eps)
    dot = (hf * w * kf).sum(-1) * rs / math.sqrt(H.shape[-1])
    z = torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=floor)) if signed_sqrt else dot
    return (hf + torch.sigmoid(z).unsqueeze(-1) * value.float().unsqueeze(2)).to(H.dtype)


def _gate_probes(cut: dict, lits: list, gen):
    """Probe environments (role -> tensor in the role node's dtype): run 0 random streams, stream 1 with a dot
    of 2e-7 (below the floor); then one run per eps literal with streams 2 (H) and 3 (keys) scaled to that RMS."""
    b, t, n, d = _shape(cut["H"])
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
            r = max(math.sqrt(scale), 1e-3 if _dtype(cut["H"]) == torch.float16 else 0.0)
            h[:, :, 2] *= r / h[:, :, 2].square().mean(-1, keepdim=True).sqrt()
            k[:, :, 3] *= r / k[:, :, 3].square().mean(-1, keepdim=True).sqrt()
        vals = {"H": h, "keys": k, "value": V, **W}
        runs.append({role: vals[role].to(_dtype(node)).to(tensor_val(node).device) for role, node in cut.items()})
    return runs


def _close_rounded(got, ref: torch.Tensor) -> bool:
    """Agreement up to one rounding of the result dtype (FP32: a few ulps of a differently ordered sum)."""
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    rtol = max(torch.finfo(ref.dtype).eps, 1e-5)
    g, r = got.double(), ref.double()
    atol = rtol * 1e-2 * float(r.abs().max())
    return bool(torch.isfinite(g).all()) and bool(((g - r).abs() <= atol + rtol * r.abs()).all())


@_real_tensors()
def _verify_gate(ev, end: fx.Node, cut: dict, region: list):
    """(eps, None) when the region computes `engram_update` for one of its literals, else (None, (check, why))."""
    lits = _literals(region)
    runs = _gate_probes(cut, lits, torch.Generator().manual_seed(1401))
    try:
        got = [ev.evaluate([end], {cut[k]: v for k, v in env.items()})[end] for env in runs]
    except (RegionNotClosed, RuntimeError):
        return None, ("region_evaluates", "the gate region could not be evaluated on probe tensors")

    def args(env):
        if "weight" in env:
            return env["H"], env["keys"], env["value"], env["weight"], torch.ones_like(env["weight"])
        return env["H"], env["keys"], env["value"], env["q_weight"], env["k_weight"]

    def matches(fn) -> bool:
        return all(_close_rounded(g, fn(*args(env))) for g, env in zip(got, runs))

    for eps in lits:
        if matches(lambda *a: engram_update(*a, eps)):
            return eps, None
    if any(matches(lambda *a: _gate_ref(*a, eps, signed_sqrt=False)) for eps in lits):
        return None, ("gate_signed_sqrt", "the gate is sigmoid(dot) without the signed square root "
                      "sign(dot) * sqrt(max(|dot|, 1e-6)) (MODEL.md §2.10 \"Gate per stream\")")
    first = lambda eps, **kw: _close_rounded(got[0], _gate_ref(*args(runs[0]), eps, **kw))  # noqa: E731
    if any(first(eps, floor=f) for eps in lits for f in (0.0, 1e-5, 1e-7, 1e-8)):
        return None, ("gate_floor", "the gate's |dot| is floored at another value than 1e-6 under the signed square "
                      "root (MODEL.md §2.10)")
    if any(_close_rounded(got[0], engram_update(*args(runs[0]), eps)) for eps in lits):
        return None, rms_eps_reason(lits, lambda eps: False)
    return None, ("gate_values", "the region reads H and keys [B, T, 4, d], value [B, T, d] and [4, d] weights but "
                  "does not compute H + sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))) * value with the two RMS "
                  "statistics (MODEL.md §2.10; dsv41/model/engram.py engram_update)")


_CHECK_PRIORITY = ("static_shapes", "gate_signed_sqrt", "gate_floor", "rms_eps", "gate_values", "region_evaluates")


def _find_gates(graph: fx.Graph, ev):
    _reset_positions()
    sites, misses = [], []
    sourced = sourced_nodes(graph)
    for add in list(graph.nodes):
        if add.op != "call_function" or add.target != aten.add.Tensor or _dtype(add) not in _FLOATS:
            continue
        shp = _shape(add)
        if len(shp) != 4 or shp[2] != HC_STREAMS:
            continue
        b, t, n, d = shp
        ends = [add]
        while len(ends[-1].users) == 1:
            u = next(iter(ends[-1].users))
            if u.op != "call_function" or u.target not in _PASS_THROUGH or _shape(u) != shp:
                break
            ends.append(u)
        act = ((b, t, n, d), _FLOATS)
        two = {"H": act, "keys": act, "value": ((b, t, d), _FLOATS), "q_weight": ((n, d), _FLOATS),
               "k_weight": ((n, d), _FLOATS)}
        one = {k: v for k, v in two.items() if k not in ("q_weight", "k_weight")}
        one["weight"] = ((n, d), _FLOATS)
        reasons, site = [], None
        for end, h, roles in itertools.product(reversed(ends), _residuals(add), (two, one)):
            for cut, region in _cuts(end, roles, sourced, by_leaves=True, pinned={"H": h}):
                symbolic = symbolic_part([end, *cut.values(), *region])
                if symbolic is not None:
                    reasons.append(("static_shapes", f"{symbolic}; engram fuses this chain into dsv41::engram_gate "
                                    "only at compile-time sizes, so it stays with Inductor"))
                    continue
                eps, why = _verify_gate(ev, end, cut, region)
                if eps is not None:
                    site = _gate_site(end, add, cut, region, eps, d)
                    break
                reasons.append(why)
            if site is not None:
                break
        loc = SourceLocation.from_node(add)
        pattern = "engram gate (two RMS statistics -> dot -> signed sqrt -> sigmoid) + residual add"
        if site is None:
            if reasons:
                why = min(reasons, key=lambda r: _CHECK_PRIORITY.index(r[0]) if r[0] in _CHECK_PRIORITY else 99)
                misses.append(NearMiss("engram", pattern, *why, loc))
            continue
        esc = _escapes(site.region, {site.end}, sourced)
        if esc is not None:
            misses.append(_escape_miss(pattern, esc, loc))
            continue
        sites.append(site)
    return sites, misses


def _residuals(add: fx.Node) -> list:
    """Candidates for H: each operand of the residual add of H's shape and the tensors it is a cast or identity
    view of, the farthest source first (the op reads H in its own dtype)."""
    out = []
    for side in add.args[:2]:
        if not isinstance(side, fx.Node) or _shape(side) != _shape(add):
            continue
        chain, n = [side], side
        while (n.op == "call_function" and (n.target in _PASS_THROUGH or is_view_op(n)) and n.args
               and isinstance(n.args[0], fx.Node) and _shape(n.args[0]) == _shape(add)
               and _dtype(n.args[0]) in _FLOATS):
            n = n.args[0]
            chain.append(n)
        out.extend(reversed(chain))
    return out


def _gate_site(end, add, cut, region, eps, d) -> _Site:
    if "weight" in cut:
        qw, kw, how = cut["weight"], ("ones", cut["weight"]), "w (precomputed q * k)"
    else:
        qw, kw, how = cut["q_weight"], cut["k_weight"], "q_weight * k_weight"
    return _Site("engram_gate", "engram_gate", add, (cut["H"], cut["keys"], cut["value"], qw, kw, eps), end, region,
                 (cut["H"], cut["keys"], cut["value"]), (("eps", eps), ("d", d), ("weights", how)))


# ------------------------------------------------------------------------------------------------ rewrite + record
def _rewrite(graph: fx.Graph, site: _Site, op, replaced: dict) -> fx.Node:
    """Insert the fused op for `site` (reading the replacements of ends already rewritten) and route the end's
    users to it; returns the node that now stands for the end."""
    site.inputs_of = {n: list(n.all_input_nodes) for n in site.region}
    args = [replaced.get(a, a) if isinstance(a, fx.Node) else a for a in site.args]
    if site.op_name == "engram_gate" and isinstance(args[4], tuple):
        wv = tensor_val(args[4][1])
        # `full` (not ones_like, which Inductor only decomposes before the post-grad passes).
        args[4] = insert_node(graph, site.end, aten.full.default, (list(concrete_shape(wv)), 1.0),
                              {"dtype": wv.dtype, "layout": torch.strided, "device": wv.device, "pin_memory": False},
                              like=site.anchor)
    out = insert_node(graph, site.end, op, tuple(args), like=site.anchor)
    if _shape(out) != _shape(site.end):
        out = insert_node(graph, site.end, aten.reshape.default, (out, _reshape_args(graph, site)), like=site.anchor)
    site.end.replace_all_uses_with(out)
    return out


def _reshape_args(graph: fx.Graph, site: _Site) -> list:
    """The end's shape as reshape arguments: static dims as ints, B and T from the look-back u, any other
    symbolic dim as -1."""
    u = site.args[0]
    uv = tensor_val(u)
    out = []
    for s in tensor_val(site.end).shape:
        if not isinstance(s, torch.SymInt):
            out.append(int(s))
        elif s is uv.shape[0] or str(s) == str(uv.shape[0]):
            out.append(insert_node(graph, site.end, aten.sym_size.int, (u, 0)))
        elif str(s) == str(uv.shape[1]):
            out.append(insert_node(graph, site.end, aten.sym_size.int, (u, 1)))
        else:
            out.append(-1)
    return out


def _record(family: str, site: _Site, removed: set) -> MatchRecord:
    gone = [n for n in site.region if n in removed]
    before, after, subs = _bytes(site, gone)
    return MatchRecord(family, site.pattern, f"dsv41::{site.op_name}", SourceLocation.from_node(site.anchor),
                       tuple(n.name for n in gone), tuple(node_label(n) for n in gone), before, after,
                       tuple(sorted(subs.items())), site.detail)


def _bytes(site: _Site, gone: list):
    """(before, after, symbol values): eager traffic of the removed ops vs the fused op's inputs and output."""
    b, t = concrete_shape(tensor_val(site.activations[0]))[:2]
    rows, subs = token_rows((b, t))
    per_token: set = set(site.activations)
    for n in site.region:
        if any(a in per_token for a in site.inputs_of.get(n, ())):
            per_token.add(n)
    per_token.add(site.end)
    tables = {table: gather for gather, table in site.gathered}
    totals = {"before": [0, 0], "after": [0, 0]}  # [bytes per token, bytes per step]

    def add(key: str, n, as_node=None) -> None:
        v = tensor_val(as_node if as_node is not None else n)
        if v is None:
            return
        nbytes = v.numel() * v.element_size()
        if (n in per_token or as_node is not None) and nbytes % (b * t) == 0:
            totals[key][0] += nbytes // (b * t)
        else:
            totals[key][1] += nbytes

    for n in gone:
        if is_view_op(n) or tensor_val(n) is None:
            continue
        add("before", n)
        for a in site.inputs_of.get(n, ()):
            if a in tables:  # a gather reads the rows it returns, not its whole table
                add("before", a, as_node=tables[a])
            else:
                add("before", a)
    for a in site.args:
        if isinstance(a, fx.Node):
            add("after", a, as_node=tables[a]) if a in tables else add("after", a)
        elif isinstance(a, tuple):
            add("after", a[1])
    add("after", site.end)
    before, after = (sympy.Integer(totals[k][0]) * rows + totals[k][1] for k in ("before", "after"))
    return str(sympy.expand(before)), str(sympy.expand(after)), subs
