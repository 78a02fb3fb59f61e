"""The `rope_kv` family on attention blocks written here in other people's spellings (CPU, the real backend).

One small attention block, its rotary embedding chosen by name:
- "neox": rotate-half on [B, S, H, D] with half-width FP32 angles (GPT-NeoX), caches written by `index_copy_`;
- "gptj": interleaved pairs via even/odd slices and stack/flatten, rotated after the heads are transposed to
  [B, H, S, D] (GPT-J), caches written by `cache[:, :, pos] = ...`;
- "neox" after a per-head RMSNorm of q and k (QK-norm: Qwen3, OLMo 2);
and look-alikes the family must leave alone with a reason: the inverse rotation, RoPE on half the head dim only,
and an accumulating cache write. Compiled in FP32 with `backend="dsv41"`, every decode step (and a 2-token verify
step) must equal eager within FP32 rounding, the caches included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import dsv41

H, HKV, D, E, T = 4, 2, 16, 32, 24


def _rotary(x, c, s, how):
    """x [..., D] rotated by angles whose cos / sin c, s broadcast to [..., D/2]."""
    if how in ("neox", "inverse"):
        a, b = x[..., : D // 2], x[..., D // 2:]
        sg = -1.0 if how == "inverse" else 1.0
        return torch.cat((a * c - sg * b * s, b * c + sg * a * s), dim=-1)
    if how == "gptj":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    if how == "partial":  # only the first D/2 channels, interleaved
        r = x[..., : D // 2]
        a, b = r[..., 0::2], r[..., 1::2]
        c, s = c[..., : D // 4], s[..., : D // 4]
        return torch.cat((torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2), x[..., D // 2:]), dim=-1)
    raise ValueError(how)


class Block(nn.Module):
    def __init__(self, how: str, write: str = "index_copy", qk_norm: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.how, self.write, self.qk_norm = how, write, qk_norm
        self.qn = nn.Parameter(1 + 0.1 * torch.randn(D, generator=g))
        self.kn = nn.Parameter(1 + 0.1 * torch.randn(D, generator=g))
        self.wq = nn.Parameter(torch.randn(H * D, E, generator=g) * 0.2)
        self.wk = nn.Parameter(torch.randn(HKV * D, E, generator=g) * 0.2)
        self.wv = nn.Parameter(torch.randn(HKV * D, E, generator=g) * 0.2)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
        self.register_buffer("kc", torch.zeros(1, HKV, T, D))
        self.register_buffer("vc", torch.zeros(1, HKV, T, D))

    def forward(self, x, pos):
        s = x.shape[1]
        ang = pos[:, None].float() * self.inv_freq[None]
        c, sn = ang.cos(), ang.sin()  # [S, D/2]
        q = (x @ self.wq.t()).view(1, s, H, D)
        k = (x @ self.wk.t()).view(1, s, HKV, D)
        v = (x @ self.wv.t()).view(1, s, HKV, D).transpose(1, 2)
        if self.qk_norm:  # per-head RMSNorm of q and k before the rotation (Qwen3, OLMo 2)
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * self.qn
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * self.kn
        if self.how == "gptj":  # heads first, then rotate
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q, k = _rotary(q, c[None, None], sn[None, None], "gptj"), _rotary(k, c[None, None], sn[None, None], "gptj")
        else:
            q = _rotary(q, c[None, :, None], sn[None, :, None], self.how).transpose(1, 2)
            k = _rotary(k, c[None, :, None], sn[None, :, None], self.how).transpose(1, 2)
        if self.write == "index_copy":
            self.kc.index_copy_(2, pos, k)
            self.vc.index_copy_(2, pos, v)
        elif self.write == "setitem":
            self.kc[:, :, pos] = k
            self.vc[:, :, pos] = v
        else:  # adds to what the cache held: not a write the op can stand in for
            self.kc[:, :, pos] += k
            self.vc[:, :, pos] = v
        kk = self.kc.repeat_interleave(H // HKV, dim=1)
        vv = self.vc.repeat_interleave(H // HKV, dim=1)
        att = (q @ kk.transpose(-1, -2)) * D ** -0.5
        valid = torch.arange(T)[None, :] <= pos[:, None]
        att = att.masked_fill(~valid, float("-inf")).softmax(-1)
        return (att @ vv).transpose(1, 2).reshape(1, s, H * D)


def _decode(how, write="index_copy", qk_norm=False):
    """(eager outputs and caches, compiled outputs and caches, the family's report entry) over a 3-token prompt,
    3 decode steps and one 2-token verify step."""
    eager, comp = Block(how, write, qk_norm), Block(how, write, qk_norm)
    torch._dynamo.reset()
    compiled = torch.compile(comp, backend="dsv41", dynamic=False, options={"report": True})
    g = torch.Generator().manual_seed(5)
    outs_e, outs_c = [], []
    with torch.no_grad():
        x = torch.randn(1, 3, E, generator=g)
        eager(x, torch.arange(3))
        comp(x, torch.arange(3))
        steps = [(torch.randn(1, 1, E, generator=g), torch.tensor([p])) for p in (3, 4, 5)]
        steps.append((torch.randn(1, 2, E, generator=g), torch.tensor([6, 7])))
        for x, p in steps:
            outs_e.append(eager(x, p))
            outs_c.append(compiled(x, p))
    # one report for the compiled module, over all of its graphs (one per token count)
    fam = dsv41.last_report().to_dict()["families"]["rope_kv"]
    return (outs_e, eager.kc, eager.vc), (outs_c, comp.kc, comp.vc), fam


def _equal_fp32(got, want):
    for a, b in zip(got[0], want[0]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-6) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("how, write, qk_norm", [("neox", "index_copy", False), ("gptj", "setitem", False),
                                                 ("neox", "setitem", True)])
def test_other_spellings_fuse_and_equal_eager(how, write, qk_norm):
    want, got, fam = _decode(how, write, qk_norm)
    _equal_fp32(got, want)
    assert fam["matches"] == 2 and not fam["near_misses"], fam  # the decode graph and the 2-token verify graph
    layout = {"neox": "rotate_half", "gptj": "interleaved"}[how]
    assert all(f"rope_kv({layout})" == site["pattern"] for site in fam["sites"]), fam["sites"]
    assert all(site["detail"]["q"] for site in fam["sites"]), "q's RoPE was left out of the op"


@pytest.mark.parametrize("how", ["inverse", "partial"])
def test_look_alike_rotations_are_near_misses(how):
    want, got, fam = _decode(how)
    _equal_fp32(got, want)
    assert fam["matches"] == 0
    assert {m["check"] for m in fam["near_misses"]} == {"rope_values"}, fam["near_misses"]


def test_an_accumulating_write_is_left_alone():
    want, got, fam = _decode("neox", "accumulate")
    _equal_fp32(got, want)
    assert fam["matches"] == 0
