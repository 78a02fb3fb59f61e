"""The `rope_gqa` family (CPU, real backend) on hand-written decode blocks: RoPE of the new q and k, the cache write,
then SDPA over the repeated caches. Fused when the attention is the only reader of the rotated q; left alone with
a near-miss when the rotated q is read again; and two write-then-attend pairs on one cache in one graph fuse into
two ops with no `rope_kv_store` left beside them (the second pair reads the cache the first pair's op wrote).
Compiled outputs and caches are compared with eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dsv41
from dsv41.passes.testing import eager_and_compiled, ops_after

T, D, HKV, G = 12, 16, 2, 4


def rotate(x, pos):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    f = pos[:, None].float() * inv
    c, s = torch.cat((f, f), -1).cos()[None, :, None], torch.cat((f, f), -1).sin()[None, :, None]
    a, b = x.chunk(2, -1)
    return x * c + torch.cat((-b, a), -1) * s


def attend(q, kc, vc, pos):
    mask = torch.arange(T)[None, :] <= pos[:, None]
    return F.scaled_dot_product_attention(q, kc.repeat_interleave(G, 1), vc.repeat_interleave(G, 1), attn_mask=mask)


class Block(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.register_buffer("kc", torch.randn(1, HKV, T, D))
        self.register_buffer("vc", torch.randn(1, HKV, T, D))

    def forward(self, xq, xk, xv, pa, pb):
        steps = ((pa, 1.0), (pb, 0.5)) if self.how == "twice" else ((pa, 1.0),)
        out = 0
        for p, sc in steps:
            self.kc[:, :, p] = rotate(xk * sc, p).transpose(1, 2)
            self.vc[:, :, p] = xv.transpose(1, 2) * sc
            qr = rotate(xq * sc, p).transpose(1, 2)
            out = out + attend(qr, self.kc, self.vc, p)
            if self.how == "q_twice":
                out = out + qr.sum()
        return out


@pytest.mark.parametrize("how, fused, left", [("once", 1, 0), ("twice", 2, 0), ("q_twice", 0, 1)])
def test_blocks(how, fused, left):
    torch.manual_seed(0)
    args = (torch.randn(1, 1, HKV * G, D), torch.randn(1, 1, HKV, D), torch.randn(1, 1, HKV, D), torch.tensor([3]),
            torch.tensor([4]))
    eager_mod, comp_mod = Block(how), Block(how)
    comp_mod.load_state_dict(eager_mod.state_dict())
    want = eager_mod(*args)
    _, got, graphs = eager_and_compiled(comp_mod, args)
    ops = {k: sum(ops_after(g)[k] for g in graphs) for k in ("dsv41.rope_gqa_decode_attention",
                                                              "dsv41.rope_kv_store", "dsv41.gqa_decode_attention")}
    assert ops["dsv41.rope_gqa_decode_attention"] == fused, ops
    assert ops["dsv41.rope_kv_store"] == left and ops["dsv41.gqa_decode_attention"] == left, ops
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert torch.allclose(comp_mod.kc, eager_mod.kc, atol=1e-6) and torch.allclose(comp_mod.vc, eager_mod.vc)
    records = [r for gr in dsv41.last_report().graphs for r in gr.records if r.family == "rope_gqa"]
    assert sum(len(r.matches) for r in records) == fused     # the report shows each fusion
    if left:
        misses = [m for r in records for m in r.near_misses]
        assert any(m.check == "q_readers" for m in misses), misses
