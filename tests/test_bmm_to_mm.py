"""Inductor's GPU-only `bmm_to_mm` rewrite must not hide the chains dsv41 fuses.

On GPUs Inductor's joint-graph pattern `bmm_to_mm` rewrites every `bmm` whose batch is 1 into
squeeze -> mm -> unsqueeze before dsv41's post-grad pass runs. At batch size 1 decode that is every attention
product: on the H200 the `tiny` model fused 0 of 6 sparse-attention sites (near-miss `output_rope`, "stopped at
mm.default x2") while the CPU suite, where the rewrite is off, fused them all. The `normalize` family turns the
rewrite's output back into `bmm` (`batch1_bmm`) and the pass manager restores the mm form of the ones no fusion
consumed (`restore_batch1_mm`).

Here the rewrite's device check is replaced by one that accepts CPU tensors (`_bmm_to_mm_on_cpu`); a control test
shows the forced rewrite does reach plain Inductor's post-grad graph, so the dsv41 test fails with the GPU's
near-miss if `batch1_bmm` is removed.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import test_pass_sparse_attention as SA

from dsv41.passes.testing import capture_graphs, ops_after


@contextlib.contextmanager
def _bmm_to_mm_on_cpu():
    """Make Inductor's `bmm_to_mm` joint-graph rewrite fire on CPU tensors too (its check is GPU-only); FX graph
    cache off, since the cache key does not see this patch."""
    from torch._inductor.fx_passes import joint_graph as jg

    if not hasattr(jg, "bmm_to_mm") or not hasattr(jg, "check_device"):
        pytest.skip("this torch has no bmm_to_mm rewrite")
    mp = pytest.MonkeyPatch()
    mp.setattr(jg, "check_device", lambda a, b, *rest: True)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            yield
    finally:
        mp.undo()


class _Seen(Exception):
    pass


def _post_grad_of(fn, *args) -> str:
    """Plain Inductor's post-grad graph of `fn` (compile stopped before CPU codegen)."""
    import torch._inductor.config as ic

    seen = []

    def look(g):
        seen.append(str(g))
        raise _Seen

    torch._dynamo.reset()
    with ic.patch(post_grad_custom_post_pass=look), pytest.raises(Exception):
        torch.compile(fn)(*args)
    return seen[0]


def test_control_forced_rewrite_reaches_plain_inductor():
    """Without dsv41, a batch-1 bmm becomes mm under the forced rewrite (and stays bmm without it)."""
    a, b = torch.randn(1, 3, 5), torch.randn(1, 5, 4)
    assert "aten.bmm" in _post_grad_of(torch.bmm, a, b)
    with _bmm_to_mm_on_cpu():
        g = _post_grad_of(torch.bmm, a, b)
    assert "aten.mm" in g and "aten.bmm" not in g


def _batch1(inputs):
    """The zoo's inputs cut to batch 1 (qs and idx carry a leading site axis)."""
    qs, rc, rs, nc, ns, ok, bc, bs, bs32, idx, cos, sin = inputs
    return (qs[:, :1], rc[:1], rs[:1], nc[:1], ns[:1], ok[:1], bc[:1], bs[:1], bs32[:1], idx[:, :1], cos[:1],
            sin[:1])


def test_sparse_attention_fuses_under_the_rewrite_and_leftovers_go_back_to_mm():
    """Batch-1 attention fuses under the forced rewrite and equals eager; an unrelated batch-1 bmm that no
    family consumes is handed back to Inductor as mm."""
    import dsv41

    inputs = _batch1(SA.make_inputs(torch.float32, seed=4))
    model = SA.SparseZoo()
    x, w = torch.randn(1, 3, 8), torch.randn(1, 8, 5)

    def fn(qs, rc, rs, nc, ns, ok, bc, bs, bs32, idx, cos, sin, x, w):
        o = SA.derotate(SA.attend(qs[0], rc, rs, nc, ns, ok, bc, bs, idx[0], model.sink_a, cos, sin), cos, sin)
        return o, torch.bmm(x, w).relu()

    torch._dynamo.reset()
    with _bmm_to_mm_on_cpu(), torch.no_grad(), capture_graphs() as graphs:
        got = torch.compile(fn, backend="dsv41", options={"debug": True})(*inputs, x, w)
    want = fn(*inputs, x, w)
    rep = dsv41.last_report()
    rec = {r.family: r for gr in rep.graphs for r in gr.records}
    assert len(rec["sparse_attention"].matches) == 1, rec["sparse_attention"].near_misses
    # The four attention products (QK and PV over window and bank) were fused, so their rewrites stay in the
    # record; the unrelated bmm was restored to mm, so its record is dropped.
    assert sum(m.pattern == "batch1_bmm" for m in rec["normalize"].matches) == 4
    after = ops_after(graphs)
    assert after["aten.bmm"] == 0 and after["aten.mm.default"] > 0
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
