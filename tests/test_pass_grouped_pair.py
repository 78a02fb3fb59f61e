"""`grouped_pair` family: two dsv41::grouped_linear_fp4 of one x and one indices tensor, both with act_quant, become
dsv41::grouped_linear_fp4_pair (the activation is FP8-quantised once).

The pass runs here on graphs traced with make_fx from small functions that call the grouped op directly (what
`dispatch` leaves behind), so no Inductor compile is needed; the model-level counts (the gathered zoo and `tiny`)
are in tests/test_pass_dispatch_gathered.py. Cases:

    pair        w1 / w3 of one x and idx, act_quant both            -> one pair, outputs exactly the two ops'
    triple      three such ops                                      -> the first two paired, the third alone
    aq          one with act_quant, one without                     -> near-miss act_quant
    shape       weights of another out size                         -> near-miss weight_shape
    order       the second op's scale computed from the first's y   -> near-miss operand_order
    other_idx   the same x with another indices tensor              -> left alone, no near-miss
Reference: the same functions run eagerly (the CPU ops are the float64-checked references of grouped_gemv).
"""

from __future__ import annotations

import pytest
import torch

import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from dsv41.passes.grouped_pair import GroupedPairFamily

op = torch.ops.dsv41.grouped_linear_fp4


def _experts(gen, e=6, out=16, k=64):
    w = torch.randint(0, 256, (e, out, k // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(120, 130, (e, out, k // 32), dtype=torch.uint8, generator=gen)
    return w, s


def _case(name):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=gen)
    idx = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(2)])
    (w1, s1), (w3, s3), (w5, s5) = _experts(gen), _experts(gen), _experts(gen)
    wide = _experts(gen, out=24)
    if name == "pair":
        return (lambda x, idx, w1, s1, w3, s3: (op(x, w1, s1, idx, True), op(x, w3, s3, idx, True))), (
            x, idx, w1, s1, w3, s3)
    if name == "triple":
        return (lambda x, idx, w1, s1, w3, s3, w5, s5: (op(x, w1, s1, idx, True), op(x, w3, s3, idx, True),
                                                        op(x, w5, s5, idx, True))), (x, idx, w1, s1, w3, s3, w5, s5)
    if name == "aq":
        return (lambda x, idx, w1, s1, w3, s3: (op(x, w1, s1, idx, True), op(x, w3, s3, idx, False))), (
            x, idx, w1, s1, w3, s3)
    if name == "shape":
        return (lambda x, idx, w1, s1, w3, s3: (op(x, w1, s1, idx, True), op(x, w3, s3, idx, True))), (
            x, idx, w1, s1, *wide)
    if name == "order":
        def f(x, idx, w1, s1, w3, s3):
            a = op(x, w1, s1, idx, True)
            s3b = s3 + (a.sum() * 0).to(torch.uint8)  # the same bytes, but computed after the first GEMV
            return a, op(x, w3, s3b, idx, True)
        return f, (x, idx, w1, s1, w3, s3)
    if name == "other_idx":
        return (lambda x, idx, idx2, w1, s1, w3, s3: (op(x, w1, s1, idx, True), op(x, w3, s3, idx2, True))), (
            x, idx, idx.flip(1), w1, s1, w3, s3)
    raise KeyError(name)


def _run(name):
    from torch.fx.experimental.proxy_tensor import make_fx
    fn, args = _case(name)
    gm = make_fx(fn, tracing_mode="fake")(*args)
    rec = GroupedPairFamily().run(gm)
    gm.graph.lint()
    gm.recompile()
    return rec, gm, fn, args


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and "dsv41" in str(n.target)]


@pytest.mark.parametrize("name", ["pair", "triple"])
def test_pairs_become_one_op_with_the_same_outputs(name):
    rec, gm, fn, args = _run(name)
    assert rec.match_count == 1 and not rec.near_misses
    (m,) = rec.matches
    assert m.op == "dsv41::grouped_linear_fp4_pair" and len(m.nodes_replaced) == 2
    assert dict(m.detail)["K"] == 64 and dict(m.detail)["out"] == 16
    # the activation preparation is counted twice before and once after: x (fp32) read + FP32 copy written
    assert m.bytes_before == "1024*B" and m.bytes_after == "512*B" and dict(m.symbols) == {"B": 2}
    ops = _ops(gm)
    assert ops.count(torch.ops.dsv41.grouped_linear_fp4_pair.default) == 1
    assert ops.count(torch.ops.dsv41.grouped_linear_fp4.default) == (1 if name == "triple" else 0)
    want = fn(*args)
    got = gm(*args)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("name, check", [("aq", "act_quant"), ("shape", "weight_shape"),
                                         ("order", "operand_order"), ("other_idx", None)])
def test_look_alikes_stay_two_ops(name, check):
    rec, gm, fn, args = _run(name)
    assert rec.match_count == 0
    assert [mm.check for mm in rec.near_misses] == ([check] if check else [])
    assert _ops(gm).count(torch.ops.dsv41.grouped_linear_fp4.default) == 2
    assert all(torch.equal(g, w) for g, w in zip(gm(*args), fn(*args)))
