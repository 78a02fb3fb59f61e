"""`small_ops` family: per-step index / mask math that every layer repeats is computed once and shared.

A hand-written zoo (not dsv41/model: free functions, `narrow`, `%`, `logical_and`, one ring buffer attribute per
layer written with `index_put_`) runs three "layers" that each rebuild the same window positions, visibility
mask, ring slot and batch-row index from the positions, compiled once (module-scoped fixture, debug mode):

    window / visible   ring positions + window visibility of 3 layers   -> layers 2, 3 reuse layer 1's mask
    slot               pos % W (the ring slot each layer writes)          -> layers 2, 3 reuse layer 1's slot
    limit              pos < self.limit, a buffer written in place later   -> near-miss mutated_input
    lookalike          the same window math with W = 4 instead of 8       -> near-miss constant_differs

The compiled outputs and ring buffers must equal eager's exactly (integer math and the same float ops).
Small graphs traced with `make_fx` pin the safety rules (random ops and mutated reads are never merged).

The `tiny` model test reads the session's fresh-interpreter dsv41 run of `tiny` (fixture `tiny_dsv41`).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41.passes.small_ops import SmallOpsFamily, mutated_inputs, step_nodes
from zoo_sites import site_markers, site_of  # noqa: E402
from dsv41.passes.testing import capture_graphs, ops_after  # noqa: E402

SITES = site_markers(__file__)

W, D, LAYERS = 8, 16, 3


# ------------------------------------------------------------------------------------------- zoo
def window_positions(pos, w):
    first = pos.narrow(1, 0, 1) - 1
    return torch.cat([first - (first - torch.arange(w, device=pos.device)) % w, pos], dim=1)  # site:window


def window_visible(kpos, qpos, w):
    k, q = kpos.unsqueeze(1), qpos.unsqueeze(-1)
    return (k >= 0).logical_and(k <= q).logical_and(q - k < w)  # site:visible


class WindowZoo(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = nn.Parameter(torch.randn(LAYERS, D, D, generator=g) / D ** 0.5, requires_grad=False)
        for i in range(LAYERS):
            self.register_buffer(f"ring{i}", torch.randn(2, W, D, generator=g))
        self.register_buffer("limit", torch.full((2, 1), 10, dtype=torch.int64))

    def forward(self, x, pos):
        h = x
        rows = None
        for i in range(LAYERS):
            ring = getattr(self, f"ring{i}")
            vis = window_visible(window_positions(pos, W), pos, W)
            q = h @ self.proj[i]
            keys = torch.cat([ring, q], dim=1)
            s = torch.einsum("btd,bsd->bts", q, keys).masked_fill(~vis, float("-inf"))  # site:mask
            o = torch.einsum("bts,bsd->btd", s.softmax(-1), keys)
            live = (pos < self.limit).to(o.dtype)  # site:limit
            slot = pos % W  # site:slot
            rows = torch.arange(pos.shape[0], device=pos.device).unsqueeze(1).expand_as(pos)  # site:batch_rows
            ring.index_put_((rows, slot), q)
            h = h + o * live.unsqueeze(-1)
        vis4 = window_visible(window_positions(pos, 4), pos, 4)  # site:lookalike_mask
        s4 = torch.einsum("btd,bsd->bts", h, torch.cat([self.ring0[:, :4], h], 1)).masked_fill(~vis4, -1e9)  # site:lookalike
        self.limit.add_(1)
        return h, s4, rows


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 1, D, generator=g), torch.tensor([[5], [12]])


@pytest.fixture(scope="module")
def compiled_zoo():
    """((eager model after one call, eager outputs, compiled model after one call, compiled outputs, report), post-pass GraphModules)."""
    import dsv41

    x, pos = _inputs()
    eager_m, comp_m = WindowZoo(), WindowZoo()
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        want = eager_m(x, pos)
        got = torch.compile(comp_m, backend="dsv41", options={"debug": True}, dynamic=False)(x, pos)
    return (eager_m, want, comp_m, got, dsv41.last_report()), graphs


@pytest.fixture(scope="module")
def zoo(compiled_zoo):
    """(eager model after one call, eager outputs, compiled model after one call, compiled outputs, report)."""
    return compiled_zoo[0]



def _fam(report):
    return report.to_dict()["families"]["small_ops"]


def _site_of(s):
    return site_of(s, __file__, SITES)


# ------------------------------------------------------------------------------------------- zoo tests
def test_layers_two_and_three_reuse_layer_one_window_mask_and_slot(zoo):
    *_, report = zoo
    fam = _fam(report)
    assert fam["enabled"] is True
    by_site = {}
    for s in fam["sites"]:
        by_site.setdefault(_site_of(s), []).append(s)
    # One shared region per later layer for the visibility mask (with its window positions), the slot and the
    # batch rows; the mask's -inf fill constant is shared too.
    masks = [s for s in by_site["mask"] if s["detail"]["kind"] == "visibility_mask"]
    assert len(masks) == LAYERS - 1
    assert len(by_site["slot"]) == LAYERS - 1
    assert [s["detail"]["kind"] for s in by_site["batch_rows"]] == ["index_constants"] * (LAYERS - 1)
    for s in masks:
        assert s["detail"]["kept"].startswith("test_pass_small_ops.py:%d" % SITES["mask"])
        assert "aten.remainder.Scalar" in s["ops_replaced"] and "aten.le.Tensor" in s["ops_replaced"]
        assert s["nodes_replaced"] >= 10
    # The look-alike (W = 4) shares only what does not depend on W: pos[:, :1] - 1 and q = pos[..., None].
    assert sorted(s["ops_replaced"][0] for s in fam["sites"] if _site_of(s) == "lookalike_mask") == [
        "aten.sub.Tensor", "aten.unsqueeze.default"]
    for s in by_site["slot"]:
        assert s["detail"]["kind"] == "ring_slot" and s["ops_replaced"] == ["aten.remainder.Scalar"]
    assert fam["nodes_replaced"] >= (LAYERS - 1) * 10


def test_mutated_buffer_and_other_window_are_near_misses(zoo):
    *_, report = zoo
    misses = {(_site_of(m), m["check"]): m for m in _fam(report)["near_misses"]}
    assert set(misses) == {("limit", "mutated_input"), ("lookalike", "constant_differs")}
    assert "writes in place" in misses[("limit", "mutated_input")]["reason"]
    reason = misses[("lookalike", "constant_differs")]["reason"]
    assert "literal 4 where the first instance has 8" in reason


def test_duplicates_are_gone_and_lookalikes_stay(zoo, zoo_after):
    *_, report = zoo
    (graph,) = report.graphs
    before, after = ops_after(graph.graph_before), ops_after(zoo_after)
    # Per layer: the window's remainder and the slot's; plus the look-alike's (W = 4).
    assert before["aten.remainder.Scalar"] == 2 * LAYERS + 1
    assert after["aten.remainder.Scalar"] == 3
    assert after["aten.lt.Tensor"] == LAYERS  # pos < limit reads a mutated buffer: one per layer
    defined = {n.name for n in zoo_after.graph.nodes}
    for rec in graph.records:
        if rec.family == "small_ops":
            for mt in rec.matches:
                assert mt.nodes_replaced and not defined & set(mt.nodes_replaced)


def test_compiled_zoo_equals_eager_including_buffers(zoo):
    eager_m, want, comp_m, got, _ = zoo
    for a, b in zip(want, got):
        assert torch.equal(a, b) if a.dtype == torch.int64 else torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    for i in range(LAYERS):
        assert torch.allclose(getattr(eager_m, f"ring{i}"), getattr(comp_m, f"ring{i}"), rtol=1e-5, atol=1e-5)
    assert torch.equal(eager_m.limit, comp_m.limit)


def test_family_switched_off_shows_off_and_keeps_every_copy():
    import dsv41

    x, pos = _inputs()

    def three_masks(pos):
        return [window_visible(window_positions(pos, W), pos, W) for _ in range(3)]

    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        out = torch.compile(three_masks, backend="dsv41", options={"disable": ["small_ops"], "debug": True})(pos)
    rep = dsv41.last_report()
    fam = _fam(rep)
    assert fam["enabled"] is False and fam["matches"] == 0
    assert ops_after(graphs)["aten.remainder.Scalar"] == 3
    assert all(torch.equal(o, three_masks(pos)[0]) for o in out)


# ------------------------------------------------------------------------------------------- rules (make_fx)
def _run(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    rec = SmallOpsFamily().run(gm)
    gm.graph.lint()
    gm.recompile()
    return gm, rec


def _count(gm, target):
    return sum(n.target == target for n in gm.graph.nodes)


def test_random_ops_are_never_merged():
    def fn(pos):
        a = torch.rand(pos.shape) + pos
        b = torch.rand(pos.shape) + pos
        return a, b

    gm, rec = _run(fn, torch.tensor([[3]]))
    assert _count(gm, torch.ops.aten.rand.default) == 2
    assert _count(gm, torch.ops.aten.add.Tensor) == 2
    assert rec.matches == ()


def test_reads_of_a_buffer_written_through_a_view_are_never_merged():
    def fn(pos, cache):
        a = (pos < cache[:, :1]).sum()
        b = (pos < cache[:, :1]).sum()
        cache[:, :1].add_(1)
        return a, b

    pos, cache = torch.tensor([[3]]), torch.tensor([[4, 5]])
    gm = make_fx(fn, tracing_mode="fake")(pos, cache)
    mutated = mutated_inputs(gm.graph)
    assert [n.name for n in mutated] == ["cache_1"]
    assert not any(n.target == torch.ops.aten.lt.Tensor for n in step_nodes(gm.graph, mutated))
    gm, rec = _run(fn, pos, cache)
    assert _count(gm, torch.ops.aten.lt.Tensor) == 2 and rec.matches == ()
    assert [m.check for m in rec.near_misses] == ["mutated_input"]


def test_same_op_on_a_different_constant_or_table_is_not_merged():
    def fn(pos, inv_a, inv_b):
        r1, r2, r3 = pos % 8, pos % 8, pos % 8.0  # int 8 twice, then the float literal 8.0
        ang_a = pos.float()[..., None] * inv_a
        ang_b = pos.float()[..., None] * inv_b
        return r1, r2, r3, ang_a.cos(), ang_b.cos()

    gm, rec = _run(fn, torch.tensor([[13]]), torch.rand(4), torch.rand(4))
    assert _count(gm, torch.ops.aten.remainder.Scalar) == 2  # r2 reuses r1; r3 (float literal) stays
    assert _count(gm, torch.ops.aten.cos.default) == 2
    # The position cast feeding both angle tables is shared; the products with the two tables are not.
    assert _count(gm, torch.ops.prims.convert_element_type.default) + _count(gm, torch.ops.aten._to_copy.default) == 1
    assert [m.check for m in rec.near_misses] == ["non_index_input"]
    out = gm(torch.tensor([[13]]), torch.ones(4), torch.ones(4) * 2)
    assert out[0].item() == 5 and out[2].dtype == torch.float32


# ------------------------------------------------------------------------------------------- tiny model
def test_tiny_decode_shares_every_layers_window_mask_and_ring_slot(tiny_dsv41, tiny_model):
    report = tiny_dsv41["report"]
    layers = tiny_model.config.num_hidden_layers
    fam = report["families"]["small_ops"]
    attn = [s for s in fam["sites"] if s["location"]["file"].endswith("attention.py")]
    # Every layer after the first reuses layer 0's window visibility mask (ring positions + ok, one region of
    # the same size each time) and its ring slot (measured: 62 regions, 247 nodes in all; 7 masks of 20 nodes).
    masks = [s for s in attn if s["detail"]["kind"] == "visibility_mask"]
    # One mask region per later layer; 20 nodes each, 21 where the region also takes a node the sparse_attention
    # rewrite left shared (measured with all 10 families).
    assert len(masks) == layers - 1 and {s["nodes_replaced"] for s in masks} <= {20, 21}
    assert all("aten.remainder.Scalar" in s["ops_replaced"] and "aten.le.Tensor" in s["ops_replaced"] for s in masks)
    assert sum(s["detail"]["kind"] == "ring_slot" for s in attn) == layers - 1
    # Per-layer RoPE frequency tables and the two kv sources' bank sizes stay apart, with the reason.
    assert {m["check"] for m in fam["near_misses"]} == {"non_index_input", "constant_differs"}
    (graph,) = report["graphs"]
    after = graph["graph_after"]
    # the JSON report keeps printed code only
    assert ops_after(after)["aten.remainder.Scalar"] < ops_after(graph["graph_before"])["aten.remainder.Scalar"]
    defined = set(re.findall(r"^\s+(\w+) = ", after, flags=re.M))
    for rec in graph["records"]:
        if rec["family"] == "small_ops":
            for mt in rec["matches"]:
                assert not defined & set(mt["nodes_replaced"])
    assert tiny_dsv41["max_rel_logit_error"] < 1e-4
    assert tiny_dsv41["compiled_tokens"] == tiny_dsv41["eager_tokens"]
