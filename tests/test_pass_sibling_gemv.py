"""`sibling_gemv` family: dsv41::linear_fp8_block ops of one x node with the same act_quant become one
dsv41::linear_fp8_block_multi (one launch at decode).

The pass runs on graphs traced with make_fx from small functions that call the single op directly (what `dispatch`
leaves behind); a compiled model written here in another style (q / k / v projections of one normalised x through a
hand-written block-FP8 dequantise) checks the whole pipeline, and the `tiny` model's count is checked on the shared
compiled fixture. Cases:

    pair        two GEMVs of one x                          -> one op of two, outputs exactly the two ops'
    five        five GEMVs of one x                         -> one op of four, the fifth alone
    aq          one with act_quant, one without             -> near-miss act_quant
    big         a weight of >= TMA_MIN_WEIGHT_BYTES_M1 bytes -> near-miss tma_weight (the other stays alone)
    order       the second op's scale computed from the first's y -> near-miss operand_order (also as a keyword
                call with the weight first)
    other_x     two GEMVs of different x                     -> left alone, no near-miss
    mixed_aq    aq False, aq True, aq False, aq True          -> two ops of two
Reference: the same functions run eagerly (the CPU ops are the float64-checked references of quant_gemv).
"""

from __future__ import annotations

import pytest
import torch

import dsv41.kernels  # noqa: F401  (registers the dsv41:: ops)
from dsv41.passes.sibling_gemv import SiblingGemvFamily

op = torch.ops.dsv41.linear_fp8_block
multi = torch.ops.dsv41.linear_fp8_block_multi.default


def _weight(gen, n=48, k=64):
    w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    w[(w & 0x7F) == 0x7F] = 0x38
    s = torch.randint(118, 126, (-(-n // 32), k // 32), dtype=torch.uint8, generator=gen)
    return w, s


def _case(name):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 3, 64, generator=gen)
    ws = [_weight(gen, n) for n in (48, 16, 40, 8, 24)]
    flat = [t for w in ws for t in w]
    if name == "pair":
        return (lambda x, a, sa, b, sb: (op(x, a, sa, True), op(x, b, sb, True))), (x, *flat[:4])
    if name == "five":
        return (lambda x, *t: tuple(op(x, t[2 * i], t[2 * i + 1], True) for i in range(5))), (x, *flat)
    if name == "aq":
        return (lambda x, a, sa, b, sb: (op(x, a, sa, True), op(x, b, sb, False))), (x, *flat[:4])
    if name == "big":
        return (lambda x, a, sa, b, sb: (op(x, a, sa, True), op(x, b, sb, True))), (x, *flat[:4])
    if name == "big_fp16":
        return (lambda x, a, sa, b, sb: (op(x, a, sa, True), op(x, b, sb, True))), (x.half(), *flat[:4])
    if name == "big_no_aq":
        return (lambda x, a, sa, b, sb: (op(x, a, sa, False), op(x, b, sb, False))), (x, *flat[:4])
    if name == "order":
        def f(x, a, sa, b, sb):
            ya = op(x, a, sa, True)
            sb2 = sb + (ya.sum() * 0).to(torch.uint8)  # the same bytes, computed after the first GEMV
            return ya, op(x, b, sb2, True)
        return f, (x, *flat[:4])
    if name == "other_x":
        return (lambda x, x2, a, sa, b, sb: (op(x, a, sa, True), op(x2, b, sb, True))), (x, x * 2, *flat[:4])
    if name == "mixed_aq":
        return (lambda x, *t: tuple(op(x, t[2 * i], t[2 * i + 1], i % 2 == 1) for i in range(4))), (x, *flat[:8])
    raise KeyError(name)


def _run(name):
    from torch.fx.experimental.proxy_tensor import make_fx
    fn, args = _case("order" if name == "order_kwargs" else name)
    gm = make_fx(fn, tracing_mode="fake")(*args)
    if name == "order_kwargs":  # the second GEMV as a keyword call, weight first (what another pass may write)
        second = [n for n in gm.graph.nodes if n.target == op.default][1]
        xx, ww, ss, aq = second.args
        second.args, second.kwargs = (), {"weight": ww, "x": xx, "scale": ss, "act_quant": aq}
    rec = SiblingGemvFamily().run(gm)
    gm.graph.lint()
    gm.recompile()
    return rec, gm, fn, args


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and "dsv41" in str(n.target)]


@pytest.mark.parametrize("name, groups, singles, misses", [("pair", [2], 0, []), ("five", [4], 1, []),
                                                            ("mixed_aq", [2, 2], 0, [])])
def test_siblings_become_one_op_with_the_same_outputs(name, groups, singles, misses):
    rec, gm, fn, args = _run(name)
    assert rec.match_count == len(groups) and [mm.check for mm in rec.near_misses] == misses
    assert sorted(len(m.nodes_replaced) for m in rec.matches) == groups
    for m in rec.matches:
        det = dict(m.detail)
        assert m.op == "dsv41::linear_fp8_block_multi" and det["K"] == 64
        assert det["launches_saved"] == len(m.nodes_replaced) - 1
        # x [B = 1, L = 3, 64] fp32 read once instead of once per GEMV
        assert (m.bytes_before, m.bytes_after) == (f"{len(m.nodes_replaced) * 256}*B*L", "256*B*L")
        assert dict(m.symbols) == {"B": 1, "L": 3}
    ops = _ops(gm)
    assert ops.count(multi) == len(groups) and ops.count(op.default) == singles
    want, got = fn(*args), gm(*args)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_look_alikes_stay_separate(monkeypatch):
    from dsv41.kernels import quant_gemv as qg
    for name, check in (("aq", "act_quant"), ("order", "operand_order"), ("other_x", None)):
        rec, gm, fn, args = _run(name)
        assert rec.match_count == 0, name
        assert [mm.check for mm in rec.near_misses] == ([check] if check else []), name
        assert _ops(gm).count(op.default) == 2
        assert all(torch.equal(g, w) for g, w in zip(gm(*args), fn(*args)))
    # A keyword-argument call (weight before x) whose weight is computed after the first GEMV: operand_order.
    rec, gm, fn, args = _run("order_kwargs")
    assert rec.match_count == 0 and [mm.check for mm in rec.near_misses] == ["operand_order"]
    assert all(torch.equal(g, w) for g, w in zip(gm(*args), fn(*args)))
    # The first weight (48 x 64 bytes) at the TMA threshold: on fp16 x or without act_quant it stays alone, and so
    # does its only sibling; act_quant on fp32 x groups it (the op runs the fragment GEMV over both weights).
    monkeypatch.setattr(qg, "TMA_MIN_WEIGHT_BYTES_M1", 48 * 64)
    for name in ("big_fp16", "big_no_aq"):
        rec, gm, fn, args = _run(name)
        assert rec.match_count == 0 and [mm.check for mm in rec.near_misses] == ["tma_weight"], name
        assert "3072 bytes" in rec.near_misses[0].reason
        assert all(torch.equal(g, w) for g, w in zip(gm(*args), fn(*args)))
    rec, gm, fn, args = _run("big")
    assert rec.match_count == 1 and not rec.near_misses
    assert all(torch.equal(g, w) for g, w in zip(gm(*args), fn(*args)))


# ------------------------------------------------------------------------------------------- compiled
class _Fp8Proj(torch.nn.Module):
    """A projection stored as E4M3 bytes with 32 x 32 UE8M0 block scales, dequantised by hand (not dsv41's
    Linear): w = e4m3(bytes) * 2^(scale - 127) per block, y = F.linear(fq(x), w)."""

    def __init__(self, n, k, gen):
        super().__init__()
        w, s = _weight(gen, n, k)
        self.register_buffer("codes", w)
        self.register_buffer("scale", s)

    def forward(self, xq):
        vals = self.codes.view(torch.float8_e4m3fn).float()
        sc = torch.exp2(self.scale.float() - 127.0)
        sc = sc.repeat_interleave(32, 0)[: vals.shape[0]].repeat_interleave(32, 1)
        return torch.nn.functional.linear(xq, (vals * sc).to(xq.dtype))


def _fq(x):
    # The FP8 1x32 activation quantiser, written out (formats.fake_quant_fp8_1x32's math).
    from dsv41.model.formats import fake_quant_fp8_1x32
    return fake_quant_fp8_1x32(x)


class _Qkv(torch.nn.Module):
    """RMS-normalised x, then q / k / v projections of it and a product of their sums."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(8)
        self.q, self.k, self.v = _Fp8Proj(64, 128, gen), _Fp8Proj(32, 128, gen), _Fp8Proj(32, 128, gen)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        hq = _fq(h)
        q, k, v = self.q(hq), self.k(hq), self.v(hq)
        return q[..., :32] * k + v


def test_compiled_qkv_projections_are_one_op_and_match_eager():
    import dsv41
    torch._dynamo.reset()
    model = _Qkv()
    x = torch.randn(1, 1, 128, generator=torch.Generator().manual_seed(9))
    want = model(x)
    got = torch.compile(model, backend="dsv41", fullgraph=True)(x)
    fams = dsv41.last_report().to_dict()["families"]
    assert fams["dispatch"]["matches"] == 3
    (site,) = fams["sibling_gemv"]["sites"]
    assert site["op"] == "dsv41::linear_fp8_block_multi" and list(site["detail"]["N"]) == [64, 32, 32]
    assert site["location"]["file"].endswith("test_pass_sibling_gemv.py")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
