"""`indexer` family: the CSA2 indexer's score, candidate-pool and top-k chains become dsv41::indexer_* ops.

A hand-written zoo (not dsv41/model/csa.py: keys decoded through a 16-entry table and `exp2(e - 127)`, q @ k^T
with a broadcast, `clamp(min=0)`, the head sum as an einsum, `masked_fill` visibility; a candidate pool from
`max(dim).values`, a `scatter` pin and `argsort(stable=True)`; top-k from `argsort` + `gather` + `masked_fill`)
holds every case, compiled once per query dtype (module-scoped fixture, debug mode):

    scores      index scores, rows < n_visible                          -> indexer_scores
    candidates  block max -> newest pinned -> top 3 blocks -> row mask   -> indexer_candidates (ids, no mask)
    topk        stable top-k -> -inf dropped -> ascending, -1 padded     -> indexer_topk
    pool        top-k of a second score chain masked by `candidates`     -> indexer_scores(candidate pool) +
                                                                            indexer_topk(candidate pool)
    pool2       a third score chain masked by the same pool (`where`)     -> the same, reading the SAME
                                                                            indexer_candidates node
    offset      top-k whose valid ids are shifted past 16 window rows     -> indexer_topk(offset=16)
    badvis      scores with rows <= n_visible                            -> near-miss visibility
    ties        torch.topk-based top-k (its CPU tie order is not the lower-index rule) -> near-miss tie_rule
    nopin       candidate pool without the newest block pinned           -> near-miss block_max_values

The compiled outputs must equal the zoo's eager outputs exactly (indices) or to FP32 rounding (scores); the
fused ops run their CPU references (the model's math) here.

The `tiny` test reads the session's fresh-interpreter dsv41 run of `tiny` (fixture `tiny_dsv41`) and checks the
match counts the config's layer roles imply (see `expected_tiny_counts`), that no sort is left in the post-pass
graph, that the candidate pool is one op, and that logits and tokens equal eager's.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("dsv41.kernels.indexer", reason="dsv41.kernels.indexer (the fused ops) is not importable")
import dsv41.kernels.indexer  # noqa: E402,F401
from zoo_sites import site_markers, site_of  # noqa: E402
from dsv41.passes.testing import capture_graphs, ops_after  # noqa: E402

SITES = site_markers(__file__)
B, T, H, D, N = 2, 1, 4, 32, 30
K, BLOCK, N_BLOCKS, WINDOW = 8, 4, 3, 16
NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------- zoo
def zoo_scores(q, w, codes, scales, n_visible, inclusive=False):
    b, n, half = codes.shape
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       device=codes.device)
    nib = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(b, n, 2 * half).long()
    k = lut[nib] * torch.exp2(scales.float() - 127.0).repeat_interleave(32, dim=-1)
    logits = q.float() @ k.transpose(1, 2)[:, None]
    s = torch.einsum("bthn,bth->btn", logits.clamp(min=0), w.float())
    rows = torch.arange(n, device=s.device)
    hidden = rows > n_visible[..., None] if inclusive else rows >= n_visible[..., None]
    return s.masked_fill(hidden, NEG_INF)


def zoo_candidates(s, n_visible, block, n_blocks, pin=True):
    b, t, n = s.shape
    nb = -(-n // block)
    bmax = F.pad(s, (0, nb * block - n), value=NEG_INF).view(b, t, nb, block).max(dim=-1).values
    if pin:
        newest = (n_visible - 1).clamp(min=0) // block
        bmax = torch.where((n_visible > 0)[..., None], bmax.scatter(-1, newest[..., None], float("inf")), bmax)
    order = torch.argsort(bmax, dim=-1, descending=True, stable=True)[..., :n_blocks]
    ok = torch.gather(bmax, -1, order) > NEG_INF
    keep = torch.zeros(b, t, nb, dtype=torch.bool, device=s.device).scatter(-1, order, ok)
    return keep.repeat_interleave(block, dim=-1)[..., :n]


def zoo_topk(s, k, offset=0, use_topk=False):
    n = s.shape[-1]
    if use_topk:
        vals, order = torch.topk(s, k, dim=-1, sorted=False)
    else:
        order = torch.argsort(s, dim=-1, descending=True, stable=True)[..., :k]
        vals = torch.gather(s, -1, order)
    idx = order.masked_fill(vals == NEG_INF, n).sort(dim=-1).values
    idx = idx.masked_fill(idx == n, -1)
    if offset:
        idx = torch.where(idx >= 0, idx + offset, idx)
    return idx


class IndexerZoo(nn.Module):
    def forward(self, q, w, q2, w2, codes, scales, positions):
        n_vis = positions + 1
        s = zoo_scores(q, w, codes, scales, n_vis)  # site:scores
        cand = zoo_candidates(s, n_vis, BLOCK, N_BLOCKS)  # site:candidates
        top = zoo_topk(s, K)  # site:topk
        s2 = zoo_scores(q2, w2, codes, scales, n_vis)
        pool = zoo_topk(s2.masked_fill(~cand, NEG_INF), K)  # site:pool
        s4 = zoo_scores(q2, w, codes, scales, n_vis)
        pool2 = zoo_topk(torch.where(cand, s4, NEG_INF), K)  # site:pool2
        shifted = zoo_topk(s * 2.0, K, offset=WINDOW)  # site:offset
        bad = zoo_scores(q, w2, codes, scales, n_vis, inclusive=True)  # site:badvis
        ties = zoo_topk(s * 3.0, K, use_topk=True)  # site:ties
        nopin = zoo_candidates(s, n_vis, BLOCK, N_BLOCKS, pin=False)  # site:nopin
        return s, top, pool, pool2, shifted, bad, ties, nopin


def zoo_inputs(dtype):
    gen = torch.Generator().manual_seed(5)
    q, q2 = (torch.randn(B, T, H, D, generator=gen).to(dtype) for _ in range(2))
    w, w2 = (torch.randn(B, T, H, generator=gen) for _ in range(2))
    codes = torch.randint(0, 256, (B, N, D // 2), generator=gen).to(torch.uint8)
    scales = torch.randint(118, 134, (B, N, D // 32), generator=gen).to(torch.uint8)
    positions = torch.tensor([[N - 1], [13]])
    return q, w, q2, w2, codes, scales, positions


DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module", params=DTYPES)
def compiled_zoo(request):
    """((inputs, eager outputs, compiled outputs, report), post-pass GraphModules)."""
    import dsv41

    args = zoo_inputs(getattr(torch, request.param))
    model = IndexerZoo()
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        eager = model(*args)
        out = torch.compile(model, backend="dsv41", options={"debug": True}, dynamic=False)(*args)
    return (args, eager, out, dsv41.last_report()), graphs


@pytest.fixture(scope="module")
def zoo(compiled_zoo):
    """(inputs, eager outputs, compiled outputs, report)."""
    return compiled_zoo[0]



def _fam(report):
    return report.to_dict()["families"]["indexer"]


def _site_of(s):
    return site_of(s, __file__, SITES)


# ------------------------------------------------------------------------------------------- zoo tests
def test_each_indexer_chain_is_fused_once(zoo):
    *_, report = zoo
    got = sorted((str(_site_of(s)), s["pattern"]) for s in _fam(report)["sites"])
    # The pool's scores are recorded at its score chain's line (`s2 = zoo_scores(...)`, no site marker).
    pool_line, pool2_line = str(SITES["pool"] - 1), str(SITES["pool2"] - 1)
    assert got == sorted([("scores", "indexer_scores"), ("candidates", "indexer_candidates"),
                          ("topk", "indexer_topk"), ("offset", "indexer_topk"),
                          ("pool", "indexer_topk(candidate pool)"), (pool_line, "indexer_scores(candidate pool)"),
                          ("pool2", "indexer_topk(candidate pool)"), (pool2_line, "indexer_scores(candidate pool)")])
    details = {str(_site_of(s)): s["detail"] for s in _fam(report)["sites"]}
    assert details["offset"]["offset"] == WINDOW and details["topk"]["offset"] == 0
    assert details["topk"]["k"] == K and details["pool"]["pool_blocks"] == N_BLOCKS
    assert details["candidates"]["block_size"] == BLOCK and details["candidates"]["n_blocks"] == N_BLOCKS


def test_look_alikes_are_near_misses_naming_the_failed_check(zoo):
    *_, report = zoo
    misses = {_site_of(m): m for m in _fam(report)["near_misses"]}
    assert set(misses) == {"badvis", "ties", "nopin"}
    assert misses["badvis"]["check"] == "visibility" and "t < n_visible" in misses["badvis"]["reason"]
    assert misses["ties"]["check"] == "tie_rule" and "torch.topk" in misses["ties"]["reason"]
    assert misses["nopin"]["check"] == "block_max_values"


def test_compiled_zoo_equals_eager(zoo):
    _, eager, out, _ = zoo
    s, top, pool, pool2, shifted, bad, ties, nopin = out
    es, etop, epool, epool2, eshifted, ebad, eties, enopin = eager
    fin = torch.isfinite(es)
    assert torch.equal(torch.isfinite(s), fin)
    assert torch.allclose(s[fin], es[fin], rtol=1e-5, atol=1e-5)
    for got, want in ((top, etop), (pool, epool), (pool2, epool2), (shifted, eshifted), (nopin, enopin)):
        assert torch.equal(got, want)
    assert bool((shifted[shifted >= 0] >= WINDOW).all())
    # the unfused look-alikes kept their meaning
    assert torch.equal(torch.isfinite(bad), torch.isfinite(ebad))
    assert torch.equal(ties, eties)


def test_pool_is_one_shared_candidates_op_and_no_mask_or_sort_is_left(zoo, zoo_after):
    *_, report = zoo
    (graph,) = report.graphs
    ops = ops_after(zoo_after)
    # one candidate pool, read by both pool chains (the Reindex layers share it)
    assert ops["dsv41.indexer_candidates.default"] == 1
    assert ops["dsv41.indexer_topk.default"] == 4
    # s and the pools' compact scores: the pool chains' full-row scores are never computed
    assert ops["dsv41.indexer_scores.default"] == 3
    # left: the argsort of the unpinned look-alike's pool and torch.topk of the tie look-alike only
    assert ops["aten.sort.stable"] == 1 and ops["aten.topk.default"] == 1
    defined = {n.name for n in zoo_after.graph.nodes}
    for rec in graph.records:
        if rec.family == "indexer":
            for mt in rec.matches:
                assert mt.nodes_replaced and not defined & set(mt.nodes_replaced), mt.pattern


def test_indexer_bytes_are_symbolic_and_shrink(zoo):
    import sympy

    *_, report = zoo
    B_, L_ = sympy.symbols("B L", positive=True, integer=True)
    for s in _fam(report)["sites"]:
        before = sympy.sympify(s["bytes_before"], locals={"B": B_, "L": L_})
        assert B_ in before.free_symbols and L_ in before.free_symbols
        assert s["bytes_before_value"] > s["bytes_after_value"] > 0, s["pattern"]


def test_family_switched_off_shows_off_and_leaves_the_chains():
    import dsv41

    args = zoo_inputs(torch.float32)

    def one_site(s):
        return zoo_topk(s, K)

    s = zoo_scores(*args[:2], *args[4:6], args[6] + 1)
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        out = torch.compile(one_site, backend="dsv41", options={"disable": ["indexer"], "debug": True})(s)
    assert torch.equal(out, zoo_topk(s, K))
    rep = dsv41.last_report()
    fam = _fam(rep)
    assert fam["enabled"] is False and fam["matches"] == 0
    ops = ops_after(graphs)
    assert [op for op in ops if op.startswith("dsv41.indexer")] == [] and ops["aten.sort"] > 0


# ------------------------------------------------------------------------------------------- tiny model
def expected_tiny_counts(cfg) -> dict:
    """Matches per pattern implied by the layer roles (MODEL.md §2.5): every index source has one score chain and
    one top-k; a Reindex layer's are restricted to the candidate pool, which is computed once per step."""
    sources = cfg.index_source_layer_ids
    reindex = [i for i in sources if cfg.layer_role(i) == "reindex"]
    full = len(sources) - len(reindex)
    counts = {"indexer_scores": full, "indexer_topk": full}
    if reindex:
        counts.update({"indexer_scores(candidate pool)": len(reindex), "indexer_topk(candidate pool)": len(reindex),
                       "indexer_candidates": 1})
    return counts


def test_tiny_decode_fuses_every_indexer_chain_and_matches_eager(tiny_dsv41, tiny_model):
    cfg = tiny_model.config
    report = tiny_dsv41["report"]
    fam = report["families"]["indexer"]
    counts = {}
    for s in fam["sites"]:
        counts[s["pattern"]] = counts.get(s["pattern"], 0) + 1
    assert counts == expected_tiny_counts(cfg)  # tiny: 2 + 2 full scans, 1 + 1 pool, 1 candidates
    assert fam["near_misses"] == []
    for s in fam["sites"]:
        if s["pattern"].startswith("indexer_topk"):
            assert s["detail"]["k"] == min(cfg.index_topk, s["detail"]["S"]) and s["detail"]["offset"] == 0
        if s["pattern"] == "indexer_candidates":
            assert s["detail"]["block_size"] == cfg.candidate_block_size
            assert s["detail"]["n_blocks"] == cfg.candidate_topk_blocks
    (graph,) = report["graphs"]
    after, before = ops_after(graph), ops_after(graph["graph_before"])  # the JSON report keeps printed code only
    assert after["aten.sort"] == 0 and before["aten.sort"] > 0
    assert after["dsv41.indexer_candidates.default"] == 1
    assert tiny_dsv41["max_rel_logit_error"] < 1e-4
    assert tiny_dsv41["compiled_tokens"] == tiny_dsv41["eager_tokens"]
    if "short_compiled_tokens" in tiny_dsv41:  # the short-prompt decode: contexts below the window and the top-k
        assert tiny_dsv41["short_prompt_len"] < cfg.index_topk
        assert tiny_dsv41["short_compiled_tokens"] == tiny_dsv41["short_eager_tokens"]
        assert tiny_dsv41["short_max_rel_logit_error"] < 1e-4
