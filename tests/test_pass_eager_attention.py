"""The `gqa_attention` family on attention written out by hand (matmul, softmax, matmul) over a static cache whose
KV heads are repeated to the query heads: the way a block is written from the paper or in nanoGPT style rather than
with `F.scaled_dot_product_attention`. CPU, the real backend, bf16 (in FP32 the `upcast_linear` family takes these
batched matmuls over stored caches first). The op computes in FP32 and rounds once where eager rounds the scores and
probabilities to bf16, so the bound is eager's own error: both against a float64 attention of the same inputs, the
op no further than eager (plus one bf16 ulp of max |v|).

Spellings: a boolean "may attend" mask applied with `masked_fill(~mask, -inf)` and the scale as `* D**-0.5`; an
additive float mask and the scale as `/ math.sqrt(D)`. Look-alike: the scores
soft-capped (`c * tanh(s / c)`, Gemma 2), which the op does not compute: left to Inductor with the
`attention_values` near-miss.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import dsv41

HQ, HKV, D, T = 6, 2, 8, 20


class Attend(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        g = torch.Generator().manual_seed(0)
        self.register_buffer("k_cache", torch.randn(1, HKV, T, D, generator=g).to(torch.bfloat16))
        self.register_buffer("v_cache", torch.randn(1, HKV, T, D, generator=g).to(torch.bfloat16))

    def forward(self, q, upto):
        # q [1, HQ, 1, D]; keys at positions < upto are visible
        k = self.k_cache[:, :, None].expand(1, HKV, HQ // HKV, T, D).reshape(1, HQ, T, D)
        v = self.v_cache.repeat_interleave(HQ // HKV, dim=1)
        visible = torch.arange(T)[None, None, None, :] < upto[:, None, None, None]
        if self.spelling == "bool":
            att = (q @ k.transpose(-2, -1)) * D ** -0.5
            att = att.masked_fill(~visible, float("-inf"))
        elif self.spelling == "additive":
            bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
            att = q @ k.transpose(-2, -1) / math.sqrt(D) + bias
        else:  # "softcap": Gemma 2's logit soft-capping, which the op does not compute
            att = (q @ k.transpose(-2, -1)) * D ** -0.5
            att = 2.0 * torch.tanh(att / 2.0)
            att = att.masked_fill(~visible, float("-inf"))
        return torch.softmax(att, dim=-1) @ v


def _exact(mod, q, upto):
    """The attention in float64: keys before `upto` visible, KV head h // G for query head h."""
    k = mod.k_cache.double().repeat_interleave(HQ // HKV, dim=1)
    v = mod.v_cache.double().repeat_interleave(HQ // HKV, dim=1)
    s = (q.double() @ k.transpose(-2, -1)) / math.sqrt(D)
    s[..., upto:] = float("-inf")
    return torch.softmax(s, dim=-1) @ v


def _run(spelling):
    mod = Attend(spelling)
    torch._dynamo.reset()
    compiled = torch.compile(mod, backend="dsv41", dynamic=False, options={"report": True})
    g = torch.Generator().manual_seed(1)
    outs = []
    with torch.no_grad():
        for upto in (5, 9, 20):
            q = (torch.randn(1, HQ, 1, D, generator=g) * 2).to(torch.bfloat16)
            u = torch.tensor([upto])
            outs.append((mod(q, u), compiled(q, u), _exact(mod, q, upto)))
    return outs, dsv41.last_report().to_dict()["families"]["gqa_attention"]


@pytest.mark.parametrize("spelling", ["bool", "additive"])
def test_written_out_attention_fuses_and_equals_eager(spelling):
    outs, fam = _run(spelling)
    ulp = 2 ** -8
    for want, got, exact in outs:
        eager_err = (want.double() - exact).abs().max().item()
        assert (got.double() - exact).abs().max().item() <= eager_err + ulp * exact.abs().max().item()
    assert fam["matches"] >= 1 and not fam["near_misses"], fam
    # Inductor's own attention pattern (fuse_attention) may have turned the additive spelling into SDPA first
    assert all(s["pattern"] in ("eager_gqa(G=3)", "gqa(G=3)") for s in fam["sites"]), fam["sites"]
    if spelling == "bool":
        assert all(s["pattern"] == "eager_gqa(G=3)" for s in fam["sites"]), fam["sites"]


def test_soft_capped_scores_are_a_near_miss():
    outs, fam = _run("softcap")
    for want, got, _ in outs:
        assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2, equal_nan=True)
    assert fam["matches"] == 0
    assert {m["check"] for m in fam["near_misses"]} == {"attention_values"}, fam["near_misses"]
