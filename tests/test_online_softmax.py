"""Inductor's online-softmax rewrite must not hide the softmax chains dsv41 fuses.

On CUDA, Inductor's post-grad pattern `prepare_softmax_online` replaces amax -> sub -> exp -> sum with one
`inductor_prims.prepare_softmax_online` before dsv41's custom pass runs. On the H200 that hid every sparse-attention
site and every mHC Sinkhorn chain of `tiny` (0 of 6 and 16 near-misses), while the CPU suite, where the rewrite is
off, fused them all. The backend turns the rewrite off for its own compiles (`online_softmax=False`).

Here the rewrite's device check is replaced by one that fires on CPU too (`_online_softmax_on_cpu`); a control test
shows the forced rewrite does reach plain Inductor's post-grad graph, so the dsv41 tests below would fail (near-miss
or a CPU codegen error on `online_softmax_reduce`) if the backend left the rewrite on.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import test_pass_sparse_attention as SA
from dsv41.model.mhc import mhc_mixes


@contextlib.contextmanager
def _online_softmax_on_cpu():
    """Make Inductor's `prepare_softmax_online` replacement fire on every device (its check is GPU-only)."""
    from torch._inductor.fx_passes import post_grad as pg

    check = getattr(pg, "prepare_softmax_extra_check", None)
    if check is None:
        pytest.skip("this torch has no online-softmax rewrite")
    pg.lazy_init()
    cells = []
    for entries in pg.pass_patterns[1].patterns.values():
        for e in entries:
            for cell in getattr(getattr(e, "extra_check", None), "__closure__", None) or ():
                try:
                    if cell.cell_contents is check:
                        cells.append(cell)
                except ValueError:
                    continue
    if not cells:
        pytest.skip("could not find the online-softmax rewrite's device check")
    for c in cells:
        c.cell_contents = lambda match: torch._inductor.config.online_softmax
    try:
        yield
    finally:
        for c in cells:
            c.cell_contents = check


class _Seen(Exception):
    pass


def test_control_forced_rewrite_reaches_plain_inductor():
    """Without dsv41 the forced rewrite does put prepare_softmax_online into the post-grad graph."""
    import torch._inductor.config as ic

    seen = []

    def look(g):
        seen.append(str(g))
        raise _Seen  # stop before CPU codegen, which cannot lower the online reduction

    torch._dynamo.reset()
    with _online_softmax_on_cpu(), ic.patch(post_grad_custom_post_pass=look), pytest.raises(Exception):
        torch.compile(lambda x: torch.softmax(x, -1) @ x.T)(torch.randn(4, 40))
    assert seen and "prepare_softmax_online" in seen[0]


def test_sparse_attention_and_mhc_fuse_under_the_rewrite():
    import dsv41

    inputs = SA.make_inputs(torch.float32, seed=3)
    model = SA.SparseZoo()
    g = torch.Generator().manual_seed(5)
    d = 16
    H = torch.randn(1, 2, 4, d, generator=g)
    fn = torch.randn(24, 4 * d, generator=g) / math.sqrt(4 * d)
    base, scale = torch.randn(24, generator=g), 0.5 + torch.rand(3, generator=g)

    def both(qs, rc, rs, nc, ns, ok, bc, bs, bs32, idx, cos, sin, H):
        o = SA.derotate(SA.attend(qs[0], rc, rs, nc, ns, ok, bc, bs, idx[0], model.sink_a, cos, sin), cos, sin)
        return o, mhc_mixes(H, fn, base, scale, 1e-6, 1e-6, 20)

    torch._dynamo.reset()
    with _online_softmax_on_cpu(), torch.no_grad():
        got = torch.compile(both, backend="dsv41", options={"debug": True})(*inputs, H)
    want = both(*inputs, H)
    rec = {r.family: r for gr in dsv41.last_report().graphs for r in gr.records}
    assert len(rec["sparse_attention"].matches) == 1, rec["sparse_attention"].near_misses
    assert len(rec["mhc"].matches) == 1, rec["mhc"].near_misses
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
