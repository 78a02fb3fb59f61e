"""The `gqa_attention` family on decode attention written three ways (CPU, real backend): gpt-fast's
`repeat_interleave`, transformers' `repeat_kv` (expand + reshape), and a `repeat` that tiles the heads in the other
order (a look-alike: query head h must read KV head h // G, so it stays unfused with a near-miss). Compiled outputs
are compared with eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dsv41.passes.testing import ops_after, run_family


class CachedAttention(nn.Module):
    def __init__(self, repeat: str, hq=8, hkv=2, d=16, s=24):
        super().__init__()
        self.repeat, self.g = repeat, hq // hkv
        self.register_buffer("k_cache", torch.randn(1, hkv, s, d))
        self.register_buffer("v_cache", torch.randn(1, hkv, s, d))

    def forward(self, q, k_new, v_new, pos, mask):
        self.k_cache[:, :, pos] = k_new
        self.v_cache[:, :, pos] = v_new
        k, v = self.k_cache, self.v_cache
        if self.repeat == "repeat_interleave":
            k, v = k.repeat_interleave(self.g, dim=1), v.repeat_interleave(self.g, dim=1)
        elif self.repeat == "repeat_kv":
            b, h, s, d = k.shape
            k = k[:, :, None].expand(b, h, self.g, s, d).reshape(b, h * self.g, s, d)
            v = v[:, :, None].expand(b, h, self.g, s, d).reshape(b, h * self.g, s, d)
        elif self.repeat == "expand_outer":  # unsqueeze before the heads: query head h reads KV head h % Hkv
            b, h, s, d = k.shape
            k = k[:, None].expand(b, self.g, h, s, d).reshape(b, h * self.g, s, d)
            v = v[:, None].expand(b, self.g, h, s, d).reshape(b, h * self.g, s, d)
        else:  # tiles heads: query head h reads KV head h % Hkv
            k, v = k.repeat(1, self.g, 1, 1), v.repeat(1, self.g, 1, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _inputs(m=1, dtype=torch.float32, hq=8, hkv=2, d=16, s=24):
    gen = torch.Generator().manual_seed(m)
    q = torch.randn(1, hq, m, d, generator=gen).to(dtype)
    kn = torch.randn(1, hkv, m, d, generator=gen).to(dtype)
    vn = torch.randn(1, hkv, m, d, generator=gen).to(dtype)
    pos = torch.arange(10, 10 + m)
    mask = (torch.arange(s)[None, :] <= pos[:, None])[None, None]
    return q, kn, vn, pos, mask


@pytest.mark.parametrize("repeat, fused", [("repeat_interleave", True), ("repeat_kv", True), ("tile", False),
                                           ("expand_outer", False)])
@pytest.mark.parametrize("m, dtype", [(1, torch.float32), (3, torch.bfloat16)])
def test_repeat_spellings(repeat, fused, m, dtype):
    torch.manual_seed(0)
    mod = CachedAttention(repeat).to(dtype)
    gm, rec = run_family("gqa_attention", mod, _inputs(m, dtype))
    assert ops_after(gm)["dsv41.gqa_decode_attention"] == int(fused)
    assert ops_after(gm)["aten.clone"] == (0 if fused else ops_after(gm)["aten.clone"])
    # `repeat` lowers without the unsqueeze of a KV-head repeat: not a candidate at all; the outer expand is one,
    # whose probe shows the other head order
    assert [x.check for x in rec.near_misses] == (["kv_layout"] if repeat == "expand_outer" else [])
    ref_mod = CachedAttention(repeat).to(dtype)
    ref_mod.load_state_dict(mod.state_dict())
    torch._dynamo.reset()
    twin = CachedAttention(repeat).to(dtype)
    twin.load_state_dict(mod.state_dict())
    comp = torch.compile(twin, backend="dsv41")
    with torch.no_grad():
        want = ref_mod(*_inputs(m, dtype)).double()
        got = comp(*_inputs(m, dtype)).double()
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


def test_prefill_rows_and_mha_are_left_alone():
    mod = CachedAttention("repeat_interleave")
    gm, rec = run_family("gqa_attention", mod, _inputs(m=12, s=24))
    assert ops_after(gm)["dsv41.gqa_decode_attention"] == 0 and rec.match_count == 0
    mha = CachedAttention("repeat_interleave", hq=2, hkv=2)
    gm, rec = run_family("gqa_attention", mha, _inputs(hq=2, hkv=2))
    assert ops_after(gm)["dsv41.gqa_decode_attention"] == 0 and rec.match_count == 0
