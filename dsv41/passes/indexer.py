"""`indexer` family: the CSA2 lightning indexer's score, candidate-pool and top-k chains become dsv41::indexer_* ops.

Chains matched (`SPEC` below, `dsv41 report --patterns indexer`; MODEL.md §2.7; eager code dsv41/model/csa.py):

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

import itertools
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .records import NearMiss, PassRecord, SourceLocation
from .engine import (ByteTally, Chain, FusionFamily, RegionEvaluator, RegionNotClosed, Role, concrete_shape, dsv41_op,
                     dtype_of, eliminate_dead_code, finish_graph, import_kernels, insert_node, int_literals,
                     match_record, positions, real_tensors, register_family, shape_of, tensor_val)
from .indexer_structure import (EXTRA_STEPS, FORWARD_LIMIT, CUT_REGION, INT_DTYPES, MATMULS, SORTS, clear_shapes,
                                closed_steps, cuts, distances_back, forward_steps, most_specific, reads_index_keys,
                                score_cuts, score_probes, scores_agree, selection_probes, shape, strip_upcast,
                                symbolic_reason)

__all__ = ["IndexerFamily", "SPEC"]

aten = torch.ops.aten

#: What each indexer chain looks for (`dsv41 report --patterns`).
SPEC = register_family(
    "indexer", "CSA2 indexer: FP4 index scores (q.k -> ReLU -> head sum -> visibility), candidate blocks (shared "
    "across Reindex layers), top-k with the -inf / -1 / offset epilogue; indices, never masks", (
    Chain("scores", "indexer_scores", "mm / bmm a few steps after a uint8 [B, N, D/2] + [B, N, D/32] key pair",
          (Role("q", "[B, T, H, D]"), Role("weights", "[B, T, H]"), Role("key_codes", "[B, N, D/2]", "uint8 (E2M1)"),
           Role("key_scales", "[B, N, D/32]", "uint8 (UE8M0)"), Role("n_visible", "[B, T]", "int")),
          "dsv41.ref.indexer:indexer_scores", (),
          ("every key byte, scales 2^-17 .. 2^13, signed head weights, n_visible 0 .. N",),
          ("static_shapes", "visibility", "index_score_values")),
    Chain("candidates", "indexer_candidates", "amax / max over the last dim of an FP32 [B, T, NB, block] tensor, "
          "ending at a bool [B, T, N] mask", (Role("scores", "[B, T, N]", "fp32"), Role("n_visible", "[B, T]", "int")),
          "dsv41.ref.indexer:indexer_candidates", ("block_size", "n_blocks"),
          ("-inf holes, exact ties, sparse rows, an all -inf row; all blocks finite (pins n_blocks)",),
          ("static_shapes", "block_max_values", "pool_mask")),
    Chain("topk", "indexer_topk", "topk / descending sort of an FP32 [B, T, S] tensor, ending at int [B, T, k]",
          (Role("scores", "[B, T, S]", "fp32"),), "dsv41.ref.indexer:indexer_topk", ("k", "offset"),
          ("-inf holes, exact ties, sparse rows, an all -inf row",),
          ("static_k", "static_shapes", "tie_rule", "topk_values", "pool_mask")),
),
    # order: after rope_fp4, whose fused index query it reads; before small_ops, which would share the
    # visibility / n_visible math its regions contain, and dispatch, which rewrites the matmuls around it
    after=("rope_fp4",), before=("small_ops", "dispatch"),
)


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


class IndexerFamily(FusionFamily):
    """Fuse the indexer's score, candidate-pool and top-k chains (see module docstring)."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Replace every verified indexer chain of `gm` with the dsv41::indexer_* ops; returns the record."""
        import_kernels("dsv41.kernels.indexer")
        ops = {name: dsv41_op(name) for name in ("indexer_scores", "indexer_candidates", "indexer_topk")}
        if any(op is None for op in ops.values()):
            return PassRecord(self.name, True, note="ops not registered: import dsv41.kernels.indexer")
        graph = gm.graph
        clear_shapes()
        start = set(graph.nodes)
        ev = RegionEvaluator(gm, extra_ops=EXTRA_STEPS)
        scores, misses = _find_scores(graph, ev)
        cands, m2, claimed = _find_candidates(graph, ev)
        topks, m3 = _find_topks(graph, ev, claimed)
        misses = misses + m2 + m3
        pos = positions(graph)
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
            near = distances_back(x, 12)
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
        finish_graph(graph)
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


def _record(family: str, site: _Site, removed: set):
    """The `MatchRecord` of `site`: its removed region nodes and bytes; the kind names the op."""
    gone = [n for n in site.region if n in removed]
    detail = tuple((k, v) for k, v in site.detail.items() if k != "op_node")
    return match_record(family, site.kind, site.kind.split("(")[0], site.anchor, gone, _bytes(site, gone), detail)


def _bytes(site: _Site, gone: list):
    """(before, after, symbols): eager traffic of the removed ops vs the fused op's inputs and outputs; tensors
    whose leading dims are the step's [B, T] count per token (B L), the rest (key caches) per step."""
    bt = tuple(shape(site.end)[:2])

    def per_token(n) -> bool:
        """Whether `n` has the step's [B, T] lead."""
        s = shape_of(n)
        return s is not None and len(s) >= 2 and tuple(s[:2]) == bt

    tally = ByteTally(bt, per_token)
    tally.add_removed(gone, site.inputs_of)
    for n in site.after:
        tally.add("after", n)
    return tally.result()


# ------------------------------------------------------------------------------------------------ finders
def _find_scores(graph: fx.Graph, ev: RegionEvaluator):
    sites, misses, taken = [], [], set()
    pos = positions(graph)
    for mm in list(graph.nodes):
        if mm.op != "call_function" or mm.target not in MATMULS or mm in taken or not reads_index_keys(mm):
            continue
        ends = [n for n in forward_steps(mm, FORWARD_LIMIT)
                if dtype_of(n) == torch.float32 and len(shape(n)) == 3]
        reasons, found = [], None
        for end in ends:  # nearest first: the first end that verifies closes the chain (the visibility where)
            for cut, region in score_cuts(end, pos):
                if mm not in region:
                    continue
                why = (symbolic_reason([end, *cut.values(), *region], "dsv41::indexer_scores")
                       or _verify_scores(ev, end, cut))
                if why is None:
                    found = (end, cut, region)
                    break
                reasons.append(why)
                taken.update(n for n in region if n.target in MATMULS)  # one near-miss per look-alike chain
            if found:
                break
        if found:
            end, cut, region = found
            for role in ("q", "weights"):
                cut[role], passed = strip_upcast(cut[role])
                region.extend(passed)
            site = _Site("indexer_scores", mm, end, cut, region, {"N": shape(end)[2], "H": shape(cut["q"])[2],
                                                                  "D": shape(cut["q"])[3]})
            sites.append(site)
            taken.update(n for n in region if n.target in MATMULS)
        elif reasons:
            check, reason = most_specific(reasons)
            misses.append(NearMiss("indexer", "index scores (FP4 keys -> q.k -> ReLU -> head sum -> visibility)",
                                   check, reason, SourceLocation.from_node(mm)))
    return sites, misses


@real_tensors()
def _verify_scores(ev, end, cut):
    from dsv41.ref.indexer import indexer_scores as reference_indexer_scores

    gen = torch.Generator().manual_seed(71)
    for partial in (False, True):
        env = score_probes(cut, gen, partial)
        try:
            got = ev.evaluate([end], env)[end]
        except (RegionNotClosed, RuntimeError, IndexError, TypeError):
            return "index_score_values", "the region could not be evaluated on probe tensors"
        args = [env[cut[r]] for r in ("q", "weights", "key_codes", "key_scales", "n_visible")]
        ref = reference_indexer_scores(*[a.cpu() for a in args], None, 1)
        if scores_agree(got, ref):
            continue
        shifted = reference_indexer_scores(*[a.cpu() for a in args[:4]], args[4].cpu() + 1, None, 1)
        if scores_agree(got, shifted):
            return ("visibility", "rows t <= n_visible are scored; dsv41::indexer_scores scores rows t < n_visible "
                    "(MODEL.md §2.7 step 3: n = floor((p + 1) / r) visible rows)")
        return ("index_score_values", "the region reads FP4 index keys (uint8 codes [B, N, D/2], scales [B, N, "
                "D/32]), q [B, T, H, D], w [B, T, H] and n_visible [B, T] but does not compute sum_h w_h ReLU(q_h . "
                "k_t) with UE8M0 1x32 keys and -inf for t >= n_visible (MODEL.md §2.7 steps 1-3)")
    return None


def _find_candidates(graph: fx.Graph, ev: RegionEvaluator):
    """(sites, near-misses, claimed): claimed = the nodes of verified and near-miss candidate regions, which the
    top-k search must not read as top-k chains of their own (a candidate pool contains a block top-k)."""
    sites, misses, done = [], [], set()
    claimed = set()
    pos = positions(graph)
    for amax in list(graph.nodes):
        if amax.op != "call_function" or amax.target not in (aten.amax.default, aten.max.dim) or amax in done:
            continue
        src = shape(amax.args[0])
        dims = amax.args[1] if len(amax.args) > 1 else amax.kwargs.get("dim")
        dims = [dims] if isinstance(dims, int) else list(dims or [])  # max.dim takes one int
        if src is None or len(src) != 4 or dtype_of(amax.args[0]) != torch.float32 or dims not in ([-1], [3]):
            continue
        b, t, nb, block = src
        ends = [n for n in forward_steps(amax, FORWARD_LIMIT) if dtype_of(n) == torch.bool and len(shape(n)) == 3
                and shape(n)[:2] == (b, t) and -(-shape(n)[2] // block) == nb]
        reasons, found = [], None
        for end in reversed(ends):  # furthest first: the mask at the scores' width, not a padded one
            n = shape(end)[2]
            want = {"scores": lambda x: dtype_of(x) == torch.float32 and shape(x) == (b, t, n),
                    "n_visible": lambda x: dtype_of(x) in INT_DTYPES and shape(x) == (b, t)}
            for cut, region in cuts(end, want, pos):
                if amax not in region:
                    continue
                why = symbolic_reason([end, *cut.values(), *region], "dsv41::indexer_candidates")
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
                               {"block_size": block, "n_blocks": n_blocks, "N": shape(end)[2]}))
            done.update(region)
            claimed.update(region)
        elif reasons:
            check, reason = most_specific(reasons)
            misses.append(NearMiss("indexer", "candidate pool (block max -> newest pinned -> top blocks -> mask)",
                                   check, reason, SourceLocation.from_node(amax)))
    return sites, misses, claimed


@real_tensors()
def _verify_candidates(ev, end, cut, region, block):
    from dsv41.ref.indexer import candidate_width, indexer_candidates as reference_indexer_candidates

    sv, nv = tensor_val(cut["scores"]), tensor_val(cut["n_visible"])
    b, t, n = concrete_shape(sv)
    nb = -(-n // block)
    gen = torch.Generator().manual_seed(73)
    envs = []
    for probe in selection_probes((b, t, n), gen):
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

    for n_blocks in sorted(set(int_literals(region)) | {nb}):
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


def _find_topks(graph: fx.Graph, ev: RegionEvaluator, exclude: set):
    sites, misses, done = [], [], set(exclude)
    for anchor in list(graph.nodes):
        if anchor.op != "call_function" or anchor in done:
            continue
        if anchor.target in SORTS:
            desc = anchor.kwargs.get("descending", None)
            if desc is None:
                desc = anchor.args[2] if anchor.target == aten.sort.default and len(anchor.args) > 2 else (
                    anchor.args[3] if anchor.target == aten.sort.stable and len(anchor.args) > 3 else False)
            if not desc:
                continue
        elif anchor.target != aten.topk.default:
            continue
        x = anchor.args[0]
        xs = shape(x)
        if xs is None or len(xs) != 3 or dtype_of(x) != torch.float32:
            continue
        b, t, s = xs
        ends = [n for n in forward_steps(anchor, FORWARD_LIMIT) if dtype_of(n) in INT_DTYPES and len(shape(n)) == 3
                and shape(n)[:2] == (b, t) and 0 < shape(n)[2] <= s]
        reasons, found = [], None
        for end in reversed(ends):
            region = closed_steps(end, (x,), CUT_REGION)
            if region is None or anchor not in region:
                continue
            k = anchor.args[1] if anchor.target == aten.topk.default and len(anchor.args) > 1 else None
            why = symbolic_reason([end, x, *region], "dsv41::indexer_topk", k)
            offset, why = (None, why) if why is not None else _verify_topk(ev, end, x, region, anchor)
            if why is None:
                found = (end, region, offset)
                break
            reasons.append(why)
        if found:
            end, region, offset = found
            sites.append(_Site("indexer_topk", anchor, end, {"scores": x}, region,
                               {"k": shape(end)[2], "offset": offset, "S": s}))
            done.update(region)
        elif reasons:
            check, reason = most_specific(reasons)
            misses.append(NearMiss("indexer", "top-k (select -> -inf filter -> ascending indices, -1 padded)", check,
                                   reason, SourceLocation.from_node(anchor)))
    return sites, misses


@real_tensors()
def _verify_topk(ev, end, x, region, anchor):
    from dsv41.ref.indexer import indexer_topk as reference_indexer_topk

    xv = tensor_val(x)
    k = shape(end)[2]
    gen = torch.Generator().manual_seed(79)
    probes = selection_probes(concrete_shape(xv), gen)
    try:
        runs = [ev.evaluate([end], {x: p.to(xv.device)})[end] for p in probes]
    except (RegionNotClosed, RuntimeError, IndexError, TypeError):
        return None, ("topk_values", "the region could not be evaluated on probe tensors")
    for offset in [0] + int_literals(region):
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


@real_tensors()
def _is_pool_where(ev, node, mask_end, score_end) -> bool:
    """Whether `node` computes where(mask, scores, -inf) from the candidate mask and the score tensor alone
    (any spelling: where, masked_fill of the negated mask, ...), checked on a probe."""
    if closed_steps(node, (mask_end, score_end), 12) is None:
        return False
    gen = torch.Generator().manual_seed(83)
    m = torch.rand(shape(mask_end), generator=gen) < 0.5
    s = torch.randn(shape(score_end), generator=gen)
    dev = tensor_val(score_end).device
    try:
        got = ev.evaluate([node], {mask_end: m.to(dev), score_end: s.to(dev)})[node]
    except (RegionNotClosed, RuntimeError):
        return False
    return torch.equal(got.cpu(), torch.where(m, s, torch.full_like(s, float("-inf"))))
