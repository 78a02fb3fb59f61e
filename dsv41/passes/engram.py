"""`engram` family: the two Engram chains of an Engram layer become `dsv41::engram_lookup` / `dsv41::engram_gate`.

Chains matched (`SPEC` below, `dsv41 report --patterns engram`; MODEL.md §2.10; eager code dsv41/model/engram.py):

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

import itertools
import math
from collections import deque

import torch
import torch.fx as fx

from ..ref.engram import engram_row_ids, engram_update
from ..ref.formats import dequantize_fp8_1x32
from .records import NearMiss, SourceLocation
from .engine import (ByteTally, Chain, ChainFamily, RegionNotClosed, Role, Site, agree_where_representable,
                     ancestors_within, casts_after, close_exact, close_rounded, concrete_shape, dtype_of,
                     eps_candidates, insert_node, is_step, per_token_closure, real_tensors, register_family,
                     rms_eps_reason, shape_of, sourced_nodes, static_refusal, symbolic_part, tensor_val,
                     wide_scale_probes)
from .engram_structure import (CUT_REGION, FLOATS, backward_leaves, engram_cuts, escape_miss, escapes, gate_probes,
                               gather_pairs, graph_index, hash_probes, hash_roles, index_views, is_reduction,
                               probe_rows, reset_positions, residuals)

__all__ = ["EngramFamily", "HC_STREAMS", "GATE_FLOOR", "SPEC"]

aten = torch.ops.aten
#: Residual streams of the gate (the mHC stream count).
HC_STREAMS = 4
#: Floor of |dot| under the gate's signed square root.
GATE_FLOOR = 1e-6
_DEQUANT_LIMIT = 64     # nodes of the dequantisation after the two gathers
_EPS_LIMIT = 1e-2       # float literals below this are eps candidates

#: What each Engram chain looks for (`dsv41 report --patterns`).
SPEC = register_family(
    "engram", "Engram: n-gram hash -> bucket ids -> FP8 row gather -> dequantise (wkv input); per-stream gate "
    "(two RMS statistics, weighted dot, signed sqrt, sigmoid) + residual add", (
    Chain("lookup", "engram_lookup", "two row gathers (index / embedding) of a uint8 [rows, C] and [rows, C/32] table "
          "with the same int ids", (Role("u", "[B, T, M]", "int64"), Role("multipliers", "[M]", "int64"),
                                    Role("primes", "[R]", "int64"), Role("offsets", "[R]", "int64"),
                                    Role("weight", "[rows, C]", "uint8 (E4M3)"), Role("scale", "[rows, C/32]",
                                                                                     "uint8 (UE8M0)")),
          "dsv41.ref.engram:engram_row_ids + dsv41.ref.formats:dequantize_fp8_1x32", ("n_heads", "M", "R"),
          ("hash products in range, wrapping, and with huge buckets", "E4M3 rows with every UE8M0 byte 1..254"),
          ("static_shapes", "hash_int64_wraparound", "bucket_modulus", "bucket_offsets", "rolling_hash",
           "region_evaluates", "dequant_values", "intermediate_escapes", "op_registered")),
    Chain("gate", "engram_gate", "add of shape [B, T, 4, d] (the residual) and the casts after it",
          (Role("H", "[B, T, 4, d]"), Role("keys", "[B, T, 4, d]"), Role("value", "[B, T, d]"),
           Role("q_weight / k_weight or weight", "[4, d]")),
          "dsv41.ref.engram:engram_update", ("eps",),
          ("random streams", "a dot below the 1e-6 floor", "streams scaled to each eps literal's RMS"),
          ("static_shapes", "gate_signed_sqrt", "gate_floor", "rms_eps", "gate_values", "region_evaluates",
           "intermediate_escapes", "op_registered")),
),
    # order: after mhc: the place it has always run (no dependency between the two is known;
    # tests/test_chain_specs.py pins the order)
    after=("mhc",),
)


def _eps_literals(nodes) -> list[float]:
    """Float literals among the nodes' arguments below `_EPS_LIMIT` (eps candidates), in graph order, then 0."""
    return eps_candidates(nodes, _EPS_LIMIT)


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
        if u in inside or not is_step(u) or is_reduction(u):
            continue
        if all(a in inside or a not in sourced for a in u.all_input_nodes):
            inside.add(u)
            forward.append(u)
            queue.extend(u.users)
    numel = tensor_val(gw).numel()
    cands = [n for n in forward if dtype_of(n) in FLOATS and tensor_val(n).numel() == numel]
    if not cands:
        return [], None
    codes, scales = probe_rows(gw, gs)
    with real_tensors():
        try:
            got = ev.evaluate(cands, {gw: codes, gs: scales})
        except (RegionNotClosed, RuntimeError):
            return [], None
        c = shape_of(gw)[-1]
        flat = (codes.reshape(-1, c), scales.reshape(-1, c // 32))
        ok = [n for n in cands if close_exact(got[n].reshape(-1), dequantize_fp8_1x32(*flat, dtype_of(n)).reshape(-1))]
        # The probe's scale bytes 112..140 keep products finite; also compare on every byte 1..254, so a spelling
        # that clamps or saturates other exponents is not taken for the UE8M0 rule.
        for wide in wide_scale_probes(scales) if ok else ():
            got_w = ev.evaluate(ok, {gw: codes, gs: wide})
            ref_w = (codes.reshape(-1, c), wide.reshape(-1, c // 32))
            ok = [n for n in ok if agree_where_representable(got_w[n].reshape(-1),
                                                             dequantize_fp8_1x32(*ref_w, dtype_of(n)).reshape(-1))]
    if not ok:
        return [], ("dequant_values", "the gathered E4M3 rows and UE8M0 scales are not dequantised as "
                    "codes * 2^(scale - 127) per 1x32 block (MODEL.md §2.1; dsv41/model/formats.py "
                    "dequantize_fp8_1x32)")
    ok.sort(key=graph_index, reverse=True)
    return [(end, sorted(ancestors_within([end], set(forward)), key=graph_index)) for end in ok], None


def _find_hash(ids: fx.Node, ev, sourced: set, loc, pattern):
    """(cut, region, None) for the verified hash region ending at `ids`, else (None, None, near-miss or None)."""
    if dtype_of(ids) != torch.int64 or shape_of(ids) is None:
        return None, None, None
    dist, _ = backward_leaves(ids, CUT_REGION)
    whys: list = []
    for roles in hash_roles(ids, dist):
        for cut, region in engram_cuts(ids, roles, sourced, by_leaves=False):
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
            if next(engram_cuts(ids, partial, sourced, by_leaves=False), None) is not None:
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


@real_tensors()
def _verify_hash(ev, ids: fx.Node, cut: dict):
    """None when the region computes `engram_row_ids` on every probe, else (check, reason)."""
    gen = torch.Generator().manual_seed(10007)
    m, r = shape_of(cut["multipliers"])[0], shape_of(cut["primes"])[0]
    n_heads = r // (m - 1)
    dev = tensor_val(ids).device
    results = []
    for probe in hash_probes(cut, gen):
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
    reset_positions()
    sites, misses = [], []
    sourced = sourced_nodes(graph)
    done: set = set()
    for gw, gs, w, s, ids in gather_pairs(graph):
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
        views = index_views(gw) + index_views(gs)
        end = esc = None
        for cand, deq_region in ends:
            region = sorted(set(hash_region) | {gw, gs} | set(views) | set(deq_region), key=graph_index)
            esc = escapes(region, {cand}, sourced)
            if esc is None:
                end = cand
                break
        if end is None:
            misses.append(escape_miss(pattern, esc, loc))
            continue
        m, r, c = shape_of(cut["u"])[2], shape_of(cut["primes"])[0], shape_of(w)[1]
        detail = (("M", m), ("n_heads", r // (m - 1)), ("R", r), ("C", c), ("rows", shape_of(w)[0]),
                  ("dtype", str(dtype_of(end)).replace("torch.", "")))
        args = (cut["u"], cut["multipliers"], cut["primes"], cut["offsets"], w, s, dtype_of(end))
        sites.append(Site("engram_lookup", "engram_lookup", gw, args, (end,), region, (cut["u"],), detail,
                           gathered=((gw, w), (gs, s))))
        done.update((gw, gs))
    return sites, misses


def _gate_ref(H, keys, value, qw, kw, eps, floor=GATE_FLOOR, signed_sqrt=True):
    """The gate in FP32 with its constants as parameters (diagnosis of look-alikes only; the accepted match is
    checked against the model's `engram_update`)."""
    hf, kf = H.float(), keys.float()
    w = qw.float() * kw.float()
    rs = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(kf.square().mean(-1) + eps)
    dot = (hf * w * kf).sum(-1) * rs / math.sqrt(H.shape[-1])
    z = torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=floor)) if signed_sqrt else dot
    return (hf + torch.sigmoid(z).unsqueeze(-1) * value.float().unsqueeze(2)).to(H.dtype)


@real_tensors()
def _verify_gate(ev, end: fx.Node, cut: dict, region: list):
    """(eps, None) when the region computes `engram_update` for one of its literals, else (None, (check, why))."""
    lits = _eps_literals(region)
    runs = gate_probes(cut, lits, torch.Generator().manual_seed(1401))
    try:
        got = [ev.evaluate([end], {cut[k]: v for k, v in env.items()})[end] for env in runs]
    except (RegionNotClosed, RuntimeError):
        return None, ("region_evaluates", "the gate region could not be evaluated on probe tensors")

    def args(env):
        """The reference's arguments from one probe run's environment (a plain weight gets unit k weights)."""
        if "weight" in env:
            return env["H"], env["keys"], env["value"], env["weight"], torch.ones_like(env["weight"])
        return env["H"], env["keys"], env["value"], env["q_weight"], env["k_weight"]

    def matches(fn) -> bool:
        """Whether reference `fn` reproduces the region's output on every probe run (rounded compare)."""
        return all(close_rounded(g, fn(*args(env))) for g, env in zip(got, runs))

    for eps in lits:
        if matches(lambda *a: engram_update(*a, eps)):
            return eps, None
    if any(matches(lambda *a: _gate_ref(*a, eps, signed_sqrt=False)) for eps in lits):
        return None, ("gate_signed_sqrt", "the gate is sigmoid(dot) without the signed square root "
                      "sign(dot) * sqrt(max(|dot|, 1e-6)) (MODEL.md §2.10 \"Gate per stream\")")
    first = lambda eps, **kw: close_rounded(got[0], _gate_ref(*args(runs[0]), eps, **kw))  # noqa: E731
    if any(first(eps, floor=f) for eps in lits for f in (0.0, 1e-5, 1e-7, 1e-8)):
        return None, ("gate_floor", "the gate's |dot| is floored at another value than 1e-6 under the signed square "
                      "root (MODEL.md §2.10)")
    if any(close_rounded(got[0], engram_update(*args(runs[0]), eps)) for eps in lits):
        return None, rms_eps_reason(lits, lambda eps: False)
    return None, ("gate_values", "the region reads H and keys [B, T, 4, d], value [B, T, d] and [4, d] weights but "
                  "does not compute H + sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))) * value with the two RMS "
                  "statistics (MODEL.md §2.10; dsv41/model/engram.py engram_update)")


_CHECK_PRIORITY = ("static_shapes", "gate_signed_sqrt", "gate_floor", "rms_eps", "gate_values", "region_evaluates")


def _find_gates(graph: fx.Graph, ev):
    reset_positions()
    sites, misses = [], []
    sourced = sourced_nodes(graph)
    for add in list(graph.nodes):
        if add.op != "call_function" or add.target != aten.add.Tensor or dtype_of(add) not in FLOATS:
            continue
        shp = shape_of(add)
        if len(shp) != 4 or shp[2] != HC_STREAMS:
            continue
        b, t, n, d = shp
        ends = casts_after(add, shp)
        act = ((b, t, n, d), FLOATS)
        two = {"H": act, "keys": act, "value": ((b, t, d), FLOATS), "q_weight": ((n, d), FLOATS),
               "k_weight": ((n, d), FLOATS)}
        one = {k: v for k, v in two.items() if k not in ("q_weight", "k_weight")}
        one["weight"] = ((n, d), FLOATS)
        reasons, site = [], None
        for end, h, roles in itertools.product(reversed(ends), residuals(add), (two, one)):
            for cut, region in engram_cuts(end, roles, sourced, by_leaves=True, pinned={"H": h}):
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
        esc = escapes(site.region, {site.end}, sourced)
        if esc is not None:
            misses.append(escape_miss(pattern, esc, loc))
            continue
        sites.append(site)
    return sites, misses


def _gate_site(end, add, cut, region, eps, d) -> Site:
    """The verified gate ending at `end` (residual add `add`, discovered `eps`) as a `Site`; a precomputed weight w
    is passed as q_weight = w, k_weight = ones."""
    if "weight" in cut:
        qw, kw, how = cut["weight"], ("ones", cut["weight"]), "w (precomputed q * k)"
    else:
        qw, kw, how = cut["q_weight"], cut["k_weight"], "q_weight * k_weight"
    return Site("engram_gate", "engram_gate", add, (cut["H"], cut["keys"], cut["value"], qw, kw, eps), (end,),
                region, (cut["H"], cut["keys"], cut["value"]), (("eps", eps), ("d", d), ("weights", how)))


# ------------------------------------------------------------------------------------------------ rewrite + bytes
def _rewrite(graph: fx.Graph, site: Site, op, replaced: dict) -> dict:
    """Insert the fused op for `site` (reading the replacements of ends already rewritten) and route the end's
    users to it; returns {end: the node that now stands for it}."""
    site.inputs_of = {n: list(n.all_input_nodes) for n in site.region}
    args = [replaced.get(a, a) if isinstance(a, fx.Node) else a for a in site.args]
    if site.op_name == "engram_gate" and isinstance(args[4], tuple):
        wv = tensor_val(args[4][1])
        # `full` (not ones_like, which Inductor only decomposes before the post-grad passes).
        args[4] = insert_node(graph, site.end, aten.full.default, (list(concrete_shape(wv)), 1.0),
                              {"dtype": wv.dtype, "layout": torch.strided, "device": wv.device, "pin_memory": False},
                              like=site.anchor)
    out = insert_node(graph, site.end, op, tuple(args), like=site.anchor)
    if shape_of(out) != shape_of(site.end):
        out = insert_node(graph, site.end, aten.reshape.default, (out, _reshape_args(graph, site)), like=site.anchor)
    site.end.replace_all_uses_with(out)
    return {site.end: out}


def _reshape_args(graph: fx.Graph, site: Site) -> list:
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


def _bytes(site: Site, gone: list):
    """(before, after, symbol values): eager traffic of the removed ops vs the fused op's inputs and output; a
    gather reads the rows it returns (per token), not its whole table."""
    per_token = per_token_closure(site.activations, site.region, site.inputs_of) | {site.end}
    tally = ByteTally(concrete_shape(tensor_val(site.activations[0]))[:2], per_token.__contains__)
    tables = {table: gather for gather, table in site.gathered}

    def read(key, n, a):
        """Count input `a` of removed node `n`: a table as the rows its gather returns."""
        if a in tables:
            tally.add(key, a, value_of=tables[a], per=True)
        else:
            tally.add(key, a)

    tally.add_removed(gone, site.inputs_of, read)
    for a in site.args:
        if isinstance(a, fx.Node):
            read("after", None, a)
        elif isinstance(a, tuple):
            tally.add("after", a[1])
    tally.add("after", site.end)
    return tally.result()


class EngramFamily(ChainFamily):
    """Fuse the Engram lookup (hash -> rows -> FP8 gather -> dequantise) and gate chains (module docstring). Sites
    are found before any is rewritten: a later gate may read an earlier gate's end (stacked gates)."""

    spec = SPEC
    kernels = "dsv41.kernels.engram"
    toposort = False
    first_only = False
    rewrite = staticmethod(_rewrite)
    traffic = staticmethod(_bytes)
    cleanup = staticmethod(reset_positions)

    def finders(self) -> tuple:
        """Lookups, then gates."""
        return _find_lookups, _find_gates
