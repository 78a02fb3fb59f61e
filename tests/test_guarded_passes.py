"""A pass family can fail; the user's compile cannot (issue [robust] item 1).

A family is made to raise after it has already rewritten part of the graph. The compile must still give eager's
numbers, with none of that family's half-done rewrite left in the graph, the other families' work kept, and a
`family_failed` finding that names the family, the exception and the user's source line. `strict=True` re-raises.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import dsv41
from dsv41.passes import manager as pass_manager
from dsv41.passes import moe as moe_family
from dsv41.passes.testing import ops_after

WIDTH, EXPERTS = 16, 8


class TwoRouters(torch.nn.Module):
    """Two DeepSeek-style routers in a row (sqrt-softplus scores, biased top-2, unbiased normalised weights)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.gates = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(EXPERTS, WIDTH, generator=g),
                                                                requires_grad=False) for _ in range(2)])
        self.register_buffer("bias0", torch.randn(EXPERTS, generator=g) * 0.1)
        self.register_buffer("bias1", torch.randn(EXPERTS, generator=g) * 0.1)

    def forward(self, h):
        outs = []
        for layer in range(2):
            score = F.softplus(h.float() @ self.gates[layer].T).sqrt()
            picked = (score + (self.bias0 if layer == 0 else self.bias1)).topk(2, dim=-1).indices
            w = score.gather(-1, picked)
            outs.append(w / w.sum(-1, keepdim=True) * 1.5)
            outs.append(picked)
            h = h * 1.0001  # a different activation for the second router
        return outs


def _rewrite_then_fail(real):
    """`moe._rewrite` that rewrites the first router whole, then the second, and raises once that one is in."""
    calls = []

    def patched(graph, site, op):
        real(graph, site, op)
        calls.append(site)
        if len(calls) == 2:
            raise RuntimeError("injected failure after a rewrite")

    return patched


@pytest.fixture
def failing_moe(monkeypatch):
    monkeypatch.setattr(moe_family, "_rewrite", _rewrite_then_fail(moe_family._rewrite))


def _run(options):
    """Compile and run TwoRouters with Inductor's caches off: a monkeypatched family changes no source the pass uuid
    hashes, so a cache hit would serve the unpatched compile."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        return _run_uncached(options)


def _run_uncached(options):
    torch._dynamo.reset()
    model = TwoRouters().eval()
    h = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got = torch.compile(model, backend="dsv41", options=options)(h)
        want = model(h)
    return got, want, dsv41.last_report().to_dict()


def test_unguarded_run_fuses_both_routers():
    """The control: without the injected failure both routers fuse (so the next test's zero is the undo)."""
    got, want, report = _run({"strict": False, "debug": True})
    assert report["families"]["moe"]["matches"] == 2
    assert ops_after(report["graphs"][0])["dsv41.moe_router.default"] == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_family_that_raises_mid_rewrite_is_undone_and_reported(failing_moe):
    got, want, report = _run({"strict": False, "debug": True})
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    moe = report["families"]["moe"]
    assert moe["matches"] == 0
    (finding,) = moe["findings"]
    assert finding["kind"] == "family_failed"
    assert "RuntimeError: injected failure after a rewrite" in finding["message"]
    assert finding["location"]["file"] == __file__
    assert "topk" in finding["location"]["code"]
    after = ops_after(report["graphs"][0])
    assert after["dsv41.moe_router"] == 0  # the first router's finished rewrite went too: all or nothing
    assert after["aten.topk.default"] > 0
    assert report["families"]["normalize"]["enabled"]  # the other families ran


def test_strict_reraises_the_family_failure(failing_moe):
    with pytest.raises(Exception) as info:
        _run({"strict": True})
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or getattr(e, "inner_exception", None)
    assert any(isinstance(x, pass_manager.FamilyFailed) and "'moe'" in str(x) for x in chain), chain
    assert any(isinstance(x, RuntimeError) and "injected failure" in str(x) for x in chain)


def test_strict_follows_the_environment(monkeypatch):
    from dsv41.compiler.options import parse_options

    assert parse_options({}, environ={"DSV41_STRICT": "1"}).strict
    assert not parse_options({}, environ={}).strict
    assert not parse_options({"strict": False}, environ={"DSV41_STRICT": "1"}).strict
    with pytest.raises(TypeError, match="strict"):
        parse_options({"strict": "yes"}, environ={})


def test_stream_rewrite_that_raises_leaves_one_stream(monkeypatch):
    from dsv41.compiler import streams

    def broken(graph, plan):
        first = next(n for n in graph.nodes if n.op == "call_function")
        with graph.inserting_before(first):
            graph.call_function(torch.ops.aten.zeros.default, ([1],))  # a half-done edit
        raise ValueError("injected stream failure")

    monkeypatch.setattr(streams, "apply_plan", broken)
    got, want, report = _run({"strict": False, "streams": True})
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    sched = report["schedule"]
    assert sched["moved"] >= 1  # the second router's chain goes to the side stream: the rewrite was attempted
    assert sched["applied"] is False and "injected stream failure" in sched["reason"]


def test_fingerprint_sees_every_kind_of_edit_and_restore_keeps_names():
    from dsv41.passes.engine import GraphFingerprint, restore_graph, snapshot_graph

    def f(x, y):
        return (x * y + 1).relu()

    gm = torch.fx.symbolic_trace(f)
    g = gm.graph
    names = [n.name for n in g.nodes]
    snap, fp = snapshot_graph(g), GraphFingerprint(g)
    assert fp.same(g)
    mul = next(n for n in g.nodes if n.target is operator.mul)
    mul.args = (mul.args[1], mul.args[0])  # a rewire without new nodes
    assert not fp.same(g)
    restore_graph(g, snap)
    assert [n.name for n in g.nodes] == names and fp.same(g) is False  # new node objects, same names
    fp = GraphFingerprint(g)
    add = next(n for n in g.nodes if n.target is operator.add)
    with g.inserting_before(add):
        g.call_function(torch.relu, (add.args[0],))  # an insertion (unused: a half-done edit)
    assert not fp.same(g)
    restore_graph(g, snap)
    gm.recompile()
    x, y = torch.randn(3), torch.randn(3)
    assert torch.equal(gm(x, y), f(x, y)) and [n.name for n in g.nodes] == names
