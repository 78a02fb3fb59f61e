"""dsv41::moe_combine(..., y_dtype): the routed experts' output arrives in FP32 and the op rounds it to bf16 itself,
so the cast between the last expert GEMV and the tail launches no kernel of its own (torch 2.11 graphs compute the
expert products in FP32 and cast after, `dispatch_gathered.widened`).

References: the sum written out in float64 from y rounded to bf16 by torch (`Tensor.to`, round to nearest even),
and, for the pass, the eager function itself. Kernel outputs are poisoned first; interpreter tests run in a child
pytest under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

import test_pass_moe as tm
from interp_harness import InterpreterHarness, poison_outputs

import dsv41
from dsv41.kernels import moe as km
from dsv41.passes.testing import capture_graphs, ops_after

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


def want64(y32, shared, weights):
    """float64 of sum_j w_j * bf16(y_j) + shared, per row."""
    y = y32.to(torch.bfloat16).double()
    if weights is not None:
        y = weights.double().unsqueeze(-1) * y
    return y.sum(-2) + shared.double()


def probe(rows=3, k=6, d=80, weighted=False, seed=0):
    """(y FP32 [rows, k, d] with bf16 ties in row 0, shared [rows, d], weights [rows, k] or None), seeded."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, k, d, generator=g) * 3
    y[0, 0, :4] = torch.tensor([1.00390625, 1.01171875, -2.0078125, 3.0117188])  # bf16 ties and near-ties
    shared = torch.randn(rows, d, generator=g)
    w = torch.rand(rows, k, generator=g) if weighted else None
    return y, shared, w


def test_cpu_op_rounds_y_like_a_cast_before_it():
    for weighted in (False, True):
        y, shared, w = probe(weighted=weighted)
        got = torch.ops.dsv41.moe_combine(y, shared, w, torch.float32, torch.bfloat16)
        assert torch.equal(got, torch.ops.dsv41.moe_combine(y.to(torch.bfloat16), shared, w, torch.float32))
        assert not torch.equal(got, torch.ops.dsv41.moe_combine(y, shared, w, torch.float32))
        torch.testing.assert_close(got.double(), want64(y, shared, w), rtol=1e-6, atol=1e-5)


def test_bad_y_dtype_is_named():
    y, shared, _ = probe()
    with pytest.raises(TypeError, match="y_dtype"):
        km.reference_moe_combine(y, shared, None, torch.float32, torch.int8)


@interpreted
@pytest.mark.parametrize("weighted", [False, True])
def test_triton_rounds_y_first(weighted, monkeypatch):
    poison_outputs(monkeypatch, km)
    y, shared, w = probe(rows=2, k=6, d=300, weighted=weighted, seed=3)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = km.triton_moe_combine(y, shared, w, out_dtype, torch.bfloat16)
        ref = km.reference_moe_combine(y, shared, w, out_dtype, torch.bfloat16)
        assert not torch.isnan(got).any()
        if out_dtype == torch.float32:
            torch.testing.assert_close(got.double(), want64(y, shared, w), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got, ref)  # the FP32 sums may differ in order, not in the rounding of y


def experts_then_cast(x, idx, w, W1, W3, W2):
    """The experts in FP32, their output cast to bf16 by the user's code (a bf16 model that widened its GEMVs)."""
    return tm.experts(x, idx, w, W1, W3, W2, True).to(torch.bfloat16)


def moe_block(x, gate, bias, W1, W3, W2, S1, S3, S2):
    """A router, FP32 experts cast to bf16, and the tail that upcasts the cast again."""
    w, idx = tm.flat_router(x, gate, bias, tm.K)
    y = experts_then_cast(x, idx, w, W1, W3, W2)
    shared = tm.shared_expert(x, S1, S3, S2)
    return (y.float().sum(-2) + shared).to(torch.bfloat16)


def test_tail_takes_the_cast_of_fp32_expert_outputs():
    m = tm.MoeZoo(torch.bfloat16)
    params = (m.gate_b, m.bias_b, m.w1_b, m.w3_b, m.w2_b, m.s1_b, m.s3_b, m.s2_b)
    x = torch.randn(2, 3, tm.D, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        out = torch.compile(moe_block, backend="dsv41", dynamic=False)(x, *params)
    recs = [r for g in dsv41.last_report().graphs for r in g.records if r.family == "moe"]
    tails = [m for r in recs for m in r.matches if m.op == "dsv41::moe_combine"]
    assert len(tails) == 1 and dict(tails[0].detail).get("y_dtype") == "bfloat16", [t.detail for t in tails]
    assert ops_after(graphs)["dsv41.moe_combine.default"] == 1
    with torch.no_grad():
        eager = moe_block(x, *params)
    torch.testing.assert_close(out, eager, rtol=2 ** -7, atol=1e-2)
