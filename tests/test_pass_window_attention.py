"""`sparse_attention` on attention over an FP8 window alone (a sliding-window layer with no compressed bank).

Written as a user would for a sliding-window layer whose KV ring is stored as FP8 bytes with one power-of-two
scale byte per 32 channels: the ring and the new token's rows dequantised separately with `torch.ldexp`, joined
after dequantisation, scores by `torch.einsum`, `masked_fill` of hidden rows, a sink column appended to the logits
and dropped after `F.softmax`, the output rounded and de-rotated on interleaved pairs (strided slices). Cases,
each its own function compiled with dynamic=False:

    window        the chain above                               -> dsv41::sparse_fp4_attention, bank False
    no_sink       plain softmax over the window                 -> fused too (sink = -inf)
    plus_angle    output rotated by +angle                      -> near-miss inverse_rope
    no_rotation   no RoPE of the output                         -> nothing fused, nothing reported

References are float64, written here from the definitions.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import dsv41
from dsv41.model.formats import quantize_fp8_1x32
from dsv41.passes.testing import capture_graphs, ops_after

B, H, D, R, RING = 1, 4, 64, 16, 24


def fp8_rows(codes, scales):
    """FP8 E4M3 rows times 2^(e - 127) per 32 channels, through ldexp (FP32)."""
    mant = codes.view(torch.float8_e4m3fn).to(torch.float32)
    return torch.ldexp(mant, (scales.to(torch.int32) - 127).repeat_interleave(32, dim=-1))


def rotate_out(o, cos, sin, sign):
    """Rotate the last R channels of o [B, 1, H, D] by sign * angle (sign -1: the inverse RoPE), pairs (2i, 2i+1)
    taken as strided slices."""
    tail = o[..., -R:].float()
    ev, od = tail[..., 0::2], tail[..., 1::2]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    if sign < 0:
        pair = (ev * c + od * s, od * c - ev * s)
    else:
        pair = (ev * c - od * s, od * c + ev * s)
    return torch.cat([o[..., :-R], torch.stack(pair, dim=-1).flatten(-2).to(o.dtype)], dim=-1)


def window_attention(q, ring_c, ring_s, new_c, new_s, visible, sink, cos, sin, sign=-1.0, rotate=True):
    """Attention of q [B, 1, H, D] over the ring and the new row (sink optional), then the output rotation."""
    kv = torch.cat([fp8_rows(ring_c, ring_s).to(q.dtype), fp8_rows(new_c, new_s).to(q.dtype)], dim=1)
    logits = torch.einsum("bqhd,bkd->bqhk", q.float(), kv.float()) / math.sqrt(D)
    logits = logits.masked_fill(~visible[:, :, None, :], float("-inf"))
    if sink is not None:
        col = sink.float().view(1, 1, H, 1).expand(*logits.shape[:3], 1)
        probs = F.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = F.softmax(logits, dim=-1)
    o = torch.einsum("bqhk,bkd->bqhd", probs, kv.float()).to(q.dtype)
    return rotate_out(o, cos, sin, sign) if rotate else o


def inputs(dtype=torch.float32, seed=0):
    """(q, ring codes / scales, new codes / scales, visibility, sink, cos, sin), seeded."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, D, generator=g).to(dtype)
    rc, rs = quantize_fp8_1x32(torch.randn(B, RING, D, generator=g))
    nc, ns = quantize_fp8_1x32(torch.randn(B, 1, D, generator=g))
    vis = torch.rand(B, 1, RING + 1, generator=g) < 0.5
    vis[..., -1] = True
    sink = torch.randn(H, generator=g)
    ang = torch.rand(B, 1, R // 2, generator=g) * 6.0
    return q, rc, rs, nc, ns, vis, sink, ang.cos(), ang.sin()


def reference(q, rc, rs, nc, ns, vis, sink, cos, sin):
    """float64: softmax over the visible rows with the sink in the denominator, o.to(q.dtype), rotate by -angle."""
    def rows(c, s):
        v = c.view(torch.float8_e4m3fn).double() * torch.pow(2.0, s.double() - 127).repeat_interleave(32, -1)
        return v.to(q.dtype).double()

    kv = torch.cat([rows(rc, rs), rows(nc, ns)], 1)[0]
    o = torch.zeros(1, 1, H, D, dtype=torch.float64)
    for h in range(H):
        sc = kv @ q[0, 0, h].double() / math.sqrt(D)
        sc = sc[vis[0, 0]]
        top = max(float(sc.max()), float(sink[h]) if sink is not None else -math.inf)
        e = torch.exp(sc - top)
        den = e.sum() + (math.exp(float(sink[h]) - top) if sink is not None else 0.0)
        o[0, 0, h] = (e[:, None] * kv[vis[0, 0]]).sum(0) / den
    o = o.to(q.dtype).double()
    a, b = o[..., -R::2].clone(), o[..., -R + 1::2].clone()
    c, s = cos.double()[:, :, None], sin.double()[:, :, None]
    o[..., -R::2], o[..., -R + 1::2] = a * c + b * s, b * c - a * s
    return o


def compile_case(fn, args):
    """Compile fn with dsv41 (static shapes): (output, sparse_attention records, ops after the passes)."""
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        out = torch.compile(fn, backend="dsv41", dynamic=False)(*args)
    recs = [r for g in dsv41.last_report().graphs for r in g.records if r.family == "sparse_attention"]
    return out, recs, ops_after(graphs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_only_attention_is_fused_and_equals_float64(dtype):
    args = inputs(dtype)
    out, recs, ops = compile_case(window_attention, args)
    matches = [m for r in recs for m in r.matches]
    assert len(matches) == 1 and ops["dsv41.sparse_fp4_attention.default"] == 1
    detail = dict(matches[0].detail)
    assert detail["bank"] is False and detail["topk"] == 0 and detail["window_parts"] == 2
    assert detail["window_rows"] == RING + 1 and detail["sink"] is True
    assert "aten.bmm.default" in matches[0].ops_replaced and ops["aten.bmm.default"] == 0
    want = reference(*args)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2e-3)
    assert out.dtype == dtype and torch.allclose(out.double(), want, **tol)


def test_window_only_without_sink_is_fused_with_an_empty_sink():
    args = inputs(seed=1)

    def no_sink(q, rc, rs, nc, ns, vis, sink, cos, sin):
        return window_attention(q, rc, rs, nc, ns, vis, None, cos, sin)

    out, recs, ops = compile_case(no_sink, args)
    assert [dict(m.detail)["sink"] for r in recs for m in r.matches] == [False]
    want = reference(*args[:6], None, *args[7:])
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)


def test_window_output_rotated_forward_is_a_named_near_miss_and_keeps_its_meaning():
    args = inputs(seed=2)

    def plus_angle(q, rc, rs, nc, ns, vis, sink, cos, sin):
        return window_attention(q, rc, rs, nc, ns, vis, sink, cos, sin, sign=1.0)

    out, recs, ops = compile_case(plus_angle, args)
    assert not any(r.matches for r in recs) and ops["dsv41.sparse_fp4_attention.default"] == 0
    assert [m.check for r in recs for m in r.near_misses] == ["inverse_rope"]
    assert torch.allclose(out, plus_angle(*args), rtol=1e-5, atol=1e-5)


def test_window_attention_without_output_rotation_is_left_alone_silently():
    args = inputs(seed=3)

    def plain(q, rc, rs, nc, ns, vis, sink, cos, sin):
        return window_attention(q, rc, rs, nc, ns, vis, sink, cos, sin, rotate=False)

    out, recs, ops = compile_case(plain, args)
    assert not any(r.matches or r.near_misses for r in recs)
    assert torch.allclose(out, plain(*args), rtol=1e-5, atol=1e-5)
