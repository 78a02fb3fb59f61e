"""Review (session 34): adversarial edge cases of the three changes that HOLD (compiled == eager bit for bit).

rope_fp4 `fake_widened`: a bf16 query FP4 fake-quantised and held in float32 (decoded to float32, or torch 2.11's
dropped `.to(bf16).float()` round trip), for both rules (UE8M0 1x32, E4M3 1x16), with blocks of subnormal-range,
near-FLT_MAX, zero, NaN and +-inf values; and genuine aliases: the fake values read in three shapes by three
consumers (a matmul, a graph output, a transpose).
moe tail `round_in_tail`: the experts' rounded result also read by a second consumer (the cast must stay), and read
through two reshapes (the tail takes the float32 result). The eager model is the reference throughout.
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv41
import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from dsv41.passes.testing import capture_graphs, ops_after, torch211_casts
from dsv41.ref.formats import (dequantize_fp4_e4m3_1x16, dequantize_fp4_ue8m0_1x32, fake_quant_fp4_ue8m0_1x32,
                               quantize_fp4_e4m3_1x16, quantize_fp4_ue8m0_1x32)

sys.path.insert(0, str(Path(__file__).parent))
import test_tail_rounds_widened_experts as tail_model  # noqa: E402
from test_indexer_float32_queries import rotate  # noqa: E402  the same RoPE / key decode

ROT = 16


class WidenedQuery(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        g = torch.Generator().manual_seed(3)
        self.w = nn.Parameter(torch.randn(4 * 64, 8, generator=g), requires_grad=False)

    def forward(self, q, cos, sin):
        y = rotate(q, cos[:, :, None], sin[:, :, None])
        if self.form == "e4m3":
            p, s = quantize_fp4_e4m3_1x16(y)
            return dequantize_fp4_e4m3_1x16(p, s, torch.float32)
        if self.form == "ue8m0":
            p, s = quantize_fp4_ue8m0_1x32(y)
            return dequantize_fp4_ue8m0_1x32(p, s, torch.float32)
        if self.form == "fake_float":
            return fake_quant_fp4_ue8m0_1x32(y).float()
        p, s = quantize_fp4_ue8m0_1x32(y)  # "aliases": one decode, three readers in three shapes
        qf = dequantize_fp4_ue8m0_1x32(p, s, torch.float32)
        b, t, h, d = qf.shape
        return qf.reshape(b, t, h * d) @ self.w, qf.reshape(b * t * h, d), qf.transpose(1, 2)


def extreme_query():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 64, generator=g)
    q[0, 0, 0] *= 1e-38            # subnormal-range scales (UE8M0 2^-126, FP4 * scale down to 2^-127)
    q[0, 0, 1] *= 3e38             # near FLT_MAX: fake values overflow to inf the same way
    q[0, 0, 2] = 0.0
    q[0, 0, 3, 5] = float("nan")
    q[0, 1, 0, 7] = float("inf")
    q[0, 1, 1, 40] = float("-inf")
    q[0, 1, 2] *= 1e-30
    q[0, 1, 3] *= 1e30
    ang = torch.rand(1, 2, ROT // 2, generator=g) * 6.0
    return q.to(torch.bfloat16), ang.cos(), ang.sin()


def same_bits(a, b):
    """Equal values, NaN at the same places, and the same sign bits (zeros included; a NaN's sign is not compared:
    IEEE leaves it unspecified, and it does differ here between eager's float32 NaN and the op's bf16 NaN upcast)."""
    num = ~a.isnan()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num()) \
        and torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.signbit(a)[num], torch.signbit(b)[num])


@pytest.mark.parametrize("form,t211", [("ue8m0", False), ("e4m3", False), ("fake_float", True), ("aliases", False)])
def test_widened_fake_quant_is_exact(form, t211):
    args = extreme_query()
    if form == "aliases":  # finite values only: the matmul would spread inf / NaN
        args = (args[0].nan_to_num(0.0, 1e4, -1e4).clamp(-1e4, 1e4),) + args[1:]
    model = WidenedQuery(form)
    torch._dynamo.reset()
    with torch.no_grad(), (torch211_casts() if t211 else contextlib.nullcontext()), capture_graphs() as graphs:
        eager = model(*args)
        out = torch.compile(model, backend="dsv41", dynamic=False)(*args)
    ops = ops_after(graphs[-1])
    assert ops.get("dsv41.rope_fp4_fake_quant.default") == 1, ops
    eager, out = (eager, out) if isinstance(eager, tuple) else ((eager,), (out,))
    for e, o in zip(eager, out):
        assert same_bits(e, o), (form, (e.double() - o.double()).abs().nan_to_num().max())


class TailVariants(tail_model.TinyMoE):
    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def forward(self, x, h):
        score = torch.sqrt(F.softplus(F.linear(x.float(), self.router)))
        pick = score.topk(tail_model.TOP, dim=-1).indices
        hq = tail_model.fake_quant_fp8_1x32(h).to(torch.bfloat16)
        w2 = tail_model.unpack_fp4(self.codes[pick], self.ex[pick])
        y = torch.einsum("nkf,nkdf->nkd", hq, w2)
        if self.variant == "views":
            y = y.reshape(-1, tail_model.HID).reshape(tail_model.TOKENS, tail_model.TOP, tail_model.HID)
        out = (y.float().sum(-2) + x.float()).to(torch.bfloat16)
        return (out, y) if self.variant == "second_reader" else out


@pytest.mark.parametrize("variant", ["second_reader", "views"])
def test_tail_rounding_variants(variant):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tail_model.TOKENS, tail_model.HID, generator=g).to(torch.bfloat16)
    h = torch.randn(tail_model.TOKENS, tail_model.TOP, tail_model.FF, generator=g) * 2
    model = TailVariants(variant).eval()
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        eager = model(x, h)
        out = torch.compile(model, backend="dsv41", dynamic=False)(x, h)
    gm = graphs[-1]
    (tail,) = [n for n in gm.graph.nodes if n.op == "call_function"
               and n.target is torch.ops.dsv41.moe_combine.default]
    ops = ops_after(gm)
    assert ops.get("dsv41.grouped_linear_fp4.default") == 1, ops
    site = next(s for s in dsv41.last_report().to_dict()["families"]["dispatch"]["sites"]
                if s["op"] == "dsv41::grouped_linear_fp4")
    took = dict(site["detail"]).get("tail_rounds_y")
    if variant == "second_reader":  # the rounded y is an output too: the cast stays, the tail reads it
        assert took is None and (len(tail.args) == 4 or tail.args[4] is None), tail.format_node()
    else:
        assert took and tail.args[4] == torch.bfloat16, (took, tail.format_node())
    eager, out = (eager, out) if isinstance(eager, tuple) else ((eager,), (out,))
    for e, o in zip(eager, out):
        assert e.dtype == o.dtype and torch.equal(e, o)
