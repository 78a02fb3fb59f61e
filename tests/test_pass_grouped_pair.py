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
    chain       a pair whose first output is the (per-expert) x of a second pair -> two pairs
    late_pair   act_quant False, then three with it                 -> one pair, the third alone, no near-miss
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
    if name == "chain":
        (wa, sa), (wb, sb) = _experts(gen, out=32), _experts(gen, out=32)
        (wc, sc), (wd, sd) = _experts(gen, k=32), _experts(gen, k=32)

        def f(x, idx, wa, sa, wb, sb, wc, sc, wd, sd):
            a = op(x, wa, sa, idx, True)  # [N, k, 32]: the per-expert x of the next two
            return op(x, wb, sb, idx, True), op(a, wc, sc, idx, True), op(a, wd, sd, idx, True)
        return f, (x, idx, wa, sa, wb, sb, wc, sc, wd, sd)
    if name == "late_pair":
        return (lambda x, idx, w1, s1, w3, s3, w5, s5: (op(x, w5, s5, idx, False), op(x, w1, s1, idx, True),
                                                        op(x, w3, s3, idx, True), op(x, w5, s5, idx, True))), (
            x, idx, w1, s1, w3, s3, w5, s5)
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


@pytest.mark.parametrize("name, pairs, singles, misses", [("pair", 1, 0, []), ("triple", 1, 1, []),
                                                           ("chain", 2, 0, []), ("late_pair", 1, 2, ["act_quant"])])
def test_pairs_become_one_op_with_the_same_outputs(name, pairs, singles, misses):
    # late_pair: the fourth GEMV stays alone; its only candidate, the first, does not quantise x (a near-miss); the
    # second, which met the first too, paired with the third and is not reported.
    rec, gm, fn, args = _run(name)
    assert rec.match_count == pairs and [mm.check for mm in rec.near_misses] == misses
    for m in rec.matches:
        assert m.op == "dsv41::grouped_linear_fp4_pair" and len(m.nodes_replaced) == 2
        assert dict(m.detail)["out"] in (16, 32)
    ops = _ops(gm)
    assert ops.count(torch.ops.dsv41.grouped_linear_fp4_pair.default) == pairs
    assert ops.count(torch.ops.dsv41.grouped_linear_fp4.default) == singles
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


def test_bytes_count_the_shared_preparation_only_where_the_word_decode_kernel_runs(monkeypatch):
    # At this size (6 pairs x 16 x 64 codes) both GEMVs quantise inside the tile kernel: nothing is saved. From the
    # word-decode threshold on, one FP32 preparation of x (2 rows x 64: read 4 B + write 4 B per value) per GEMV
    # before, one after; per-expert x [N, k, K] has N * k rows.
    from dsv41.kernels import grouped_gemv as gg
    (m,) = _run("pair")[0].matches
    assert (m.bytes_before, m.bytes_after, dict(m.detail)["shares_act_quant"]) == ("0", "0", False)
    monkeypatch.setattr(gg, "WORDS_MIN_CODES_ACT_QUANT", 0)
    (m,) = _run("pair")[0].matches
    assert (m.bytes_before, m.bytes_after, dict(m.symbols)) == ("1024*B", "512*B", {"B": 2})
    assert dict(m.detail)["shares_act_quant"] is True and dict(m.detail)["K"] == 64
    per_expert = [m for m in _run("chain")[0].matches if dict(m.detail)["K"] == 32]
    assert [(m.bytes_before, m.bytes_after) for m in per_expert] == [("1536*B", "768*B")]  # 2 x 3 rows x 32 x 8 B
