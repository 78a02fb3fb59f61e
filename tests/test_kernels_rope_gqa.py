"""dsv41::rope_gqa_decode_attention (RoPE + cache write + GQA decode attention in one launch) under the Triton
interpreter, against RoPE and attention written out here in float64 from the formulas:

    interleaved pairs (2i, 2i+1), angle i;  rotate-half pairs (i, i + D/2), angle i;  full-width angles d
    (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)

The caches must hold the rotated k and the v of each new token at its position (the later token where two share
one; none for a position outside [0, T)); the output must be softmax(rope(q) K^T * scale + mask) V per query head
over the written caches, KV head h // G. Bounds: FP32 inputs 1e-5 of the values' scale; bf16 inputs 2^-6 (q and
k are rounded to bf16 after the rotation, so scores move by a few bf16 ulps). Outputs and workspaces are
NaN-poisoned first; the split that owns a new row is not the one that writes it (several splits)."""

from __future__ import annotations

import math

import pytest
import torch

from interp_harness import InterpreterHarness, poison_outputs

from dsv41.kernels import gqa_attention as ga
from dsv41.kernels import rope_gqa as rg

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture
def nan_outputs(monkeypatch):
    poison_outputs(monkeypatch, ga)


def rotate64(x, cos, sin, layout):
    """x [B, M, H, D], cos / sin [B, M, W] -> float64 rotated x."""
    x = x.double()
    d = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(d // 2):
        a, b = (2 * i, 2 * i + 1) if layout == 0 else (i, i + d // 2)
        ca, sa = (cos[..., i], sin[..., i]) if layout != 2 else (cos[..., a], sin[..., a])
        cb, sb = (cos[..., i], sin[..., i]) if layout != 2 else (cos[..., b], sin[..., b])
        ca, sa, cb, sb = (t.double()[:, :, None] for t in (ca, sa, cb, sb))
        out[..., a] = x[..., a] * ca - x[..., b] * sa
        out[..., b] = x[..., b] * cb + x[..., a] * sb
    return out


def attend64(q, kc, vc, mask, scale):
    """q [B, Hq, M, D] float64, caches [B, Hkv, T, D], mask bool [.., M, T] -> [B, Hq, M, D]."""
    g = q.shape[1] // kc.shape[1]
    kk = kc.double().repeat_interleave(g, 1)
    vv = vc.double().repeat_interleave(g, 1)
    sc = q @ kk.transpose(-1, -2) * scale
    sc = sc.masked_fill(~mask, float("-inf"))
    return torch.softmax(sc, -1) @ vv


def _case(b, hq, hkv, m, t, d, layout, dtype, seed, pos):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, hq, d, generator=gen).to(dtype)
    k = torch.randn(b, m, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, m, hkv, d, generator=gen).to(dtype)
    w = d if layout == 2 else d // 2
    ang = torch.rand(b, m, w, generator=gen, dtype=torch.float64) * 6.0
    kc = torch.randn(b, hkv, t, d, generator=gen).to(dtype)
    vc = torch.randn(b, hkv, t, d, generator=gen).to(dtype)
    return q, k, v, ang.cos().float(), ang.sin().float(), torch.tensor(pos), kc, vc


def _expected(q, k, v, cos, sin, pos, kc, vc, layout, mask, scale, dtype):
    kc, vc = kc.clone(), vc.clone()
    kr = rotate64(k, cos, sin, layout).to(dtype)
    for j, p in enumerate(pos.tolist()):  # in token order: the later token at one position wins
        p = p + kc.shape[2] if p < 0 else p   # index_put's wrap
        if 0 <= p < kc.shape[2]:
            kc[:, :, p] = kr[:, j]
            vc[:, :, p] = v[:, j]
    qr = rotate64(q, cos, sin, layout).to(dtype).double().transpose(1, 2)
    return attend64(qr, kc, vc, mask, scale), kc, vc


# (B, Hq, Hkv, M, T, D, layout, dtype, positions, overrides)
CASES = [
    (1, 8, 2, 1, 40, 16, 0, torch.float32, [13], {"block_s": 8, "splits": 2}),   # 3 tiles a split
    (1, 8, 2, 1, 40, 16, 1, torch.bfloat16, [5], {"block_s": 8, "splits": 5}),
    (2, 4, 1, 3, 24, 8, 2, torch.float32, [20, 21, 22], {"block_s": 4}),
    (1, 6, 3, 3, 30, 12, 1, torch.float16, [9, 9, -1], {"block_s": 8}),   # two tokens at 9; -1 is row 29
    (1, 4, 2, 3, 20, 16, 0, torch.bfloat16, [19, -20, 20], {"block_s": 16}),  # -20 is row 0; 20 skipped
    (1, 4, 2, 2, 32, 16, 0, torch.bfloat16, [31, 3], {"block_s": 16, "skip_masked": False}),
]


@interpreted
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"l{c[6]}-m{c[3]}-{str(c[7])[6:]}-pos{c[8]}")
@pytest.mark.parametrize("dot", [False, True], ids=["fma", "dot"])
def test_output_and_caches_match_float64(case, dot, nan_outputs):
    b, hq, hkv, m, t, d, layout, dtype, pos, over = case
    over = {**over, "dot": dot}
    q, k, v, cos, sin, pos_t, kc, vc = _case(b, hq, hkv, m, t, d, layout, dtype, t + m, pos)
    # each token attends the cache up to the last position written, as a causal decode would
    limit = max(p for p in pos if p < t) + 1
    mask = (torch.arange(t) < limit).expand(1, 1, m, t).clone()
    scale = 1 / math.sqrt(d)
    want, kc_want, vc_want = _expected(q, k, v, cos, sin, pos_t, kc, vc, layout, mask, scale, dtype)
    got = rg.triton_rope_gqa_decode_attention(q, k, v, cos, sin, pos_t, kc, vc, layout, False, mask, **over)
    assert got.shape == (b, hq, m, d) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    ulp = 0 if dtype == torch.float32 else 1
    # the caches: written rows equal the float64 rotation within one rounding, the others untouched
    for name, have, ref in (("k_cache", kc, kc_want), ("v_cache", vc, vc_want)):
        diff = (have.double() - ref.double()).abs()
        bound = ulp * torch.finfo(dtype).eps * ref.double().abs() + 1e-6
        assert (diff <= bound).all(), f"{name} differs by {diff.max().item():.3e}"
    scale_v = vc_want.double().abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= tol * scale_v, f"output off by {err:.3e} (bound {tol * scale_v:.3e})"


@interpreted
def test_round_products_follows_eager_in_bf16(nan_outputs):
    """round_products: each product rounded to bf16, then the sum, as eager bf16 code computes the rotation."""
    q, k, v, cos, sin, pos, kc, vc = _case(1, 4, 2, 1, 16, 8, 1, torch.bfloat16, 4, [7])
    cb, sb = cos.bfloat16(), sin.bfloat16()
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    got = rg.triton_rope_gqa_decode_attention(q, k, v, cb, sb, pos, kc, vc, 1, True, mask, block_s=4)
    half = 4
    k0, k1 = k[..., :half], k[..., half:]
    c, s = cb[:, :, None], sb[:, :, None]
    eager = torch.cat([k0 * c - k1 * s, k1 * c + k0 * s], -1)  # bf16 ops: products rounded, then the sum
    assert torch.equal(kc[:, :, 7], eager[:, 0])
    assert not torch.isnan(got).any()


def test_reference_matches_the_two_ops_in_turn():
    q, k, v, cos, sin, pos, kc, vc = _case(1, 8, 2, 2, 20, 16, 0, torch.float32, 3, [10, 11])
    kc2, vc2 = kc.clone(), vc.clone()
    mask = torch.ones(1, 1, 2, 20, dtype=torch.bool)
    got = torch.ops.dsv41.rope_gqa_decode_attention(q, k, v, cos, sin, pos, kc, vc, 0, False, mask, None)
    want, kcw, vcw = _expected(q, k, v, cos, sin, pos, kc2, vc2, 0, mask, 0.25, torch.float32)
    assert torch.allclose(got.double(), want, atol=1e-5) and got.is_contiguous()
    assert torch.allclose(kc, kcw, atol=1e-6) and torch.equal(vc, vcw)


@pytest.mark.parametrize("mutate, words", [
    (lambda a: {**a, "q": None}, "q is None"),
    (lambda a: {**a, "k_cache": a["k_cache"][..., :4]}, "k_cache"),
    (lambda a: {**a, "mask": torch.ones(1, 1, 1, 7, dtype=torch.bool)}, "mask"),
    (lambda a: {**a, "k": a["k"].double()}, "k"),
])
def test_bad_arguments_are_named(mutate, words):
    q, k, v, cos, sin, pos, kc, vc = _case(1, 4, 2, 1, 12, 8, 0, torch.float32, 1, [3])
    args = dict(q=q, k=k, v=v, cos=cos, sin=sin, pos=pos, k_cache=kc, v_cache=vc, layout=0, round_products=False,
                mask=None, scale=None)
    with pytest.raises((TypeError, ValueError), match=words):
        rg.reference_rope_gqa_decode_attention(**mutate(args))


@interpreted
def test_sin_laid_out_unlike_cos_and_strided_positions(nan_outputs):
    """The kernel reads both angle tensors with one set of strides and positions as contiguous: the launcher must
    hand it such copies (found by a break attempt: sin transposed in memory, pos a column of a 2-D tensor)."""
    q, k, v, cos, sin, pos, kc, vc = _case(2, 4, 2, 2, 16, 8, 0, torch.float32, 21, [3, 4])
    sin_t = sin.transpose(0, 2).contiguous().transpose(0, 2)
    pos_col = torch.tensor([[3, 99], [4, 98]])[:, 0]
    mask = torch.ones(1, 1, 2, 16, dtype=torch.bool)
    want, kc_want, _ = _expected(q, k, v, cos, sin, pos, kc, vc, 0, mask, 8 ** -0.5, torch.float32)
    got = rg.triton_rope_gqa_decode_attention(q, k, v, cos, sin_t, pos_col, kc, vc, 0, False, mask, block_s=4)
    assert (got.double() - want).abs().max().item() < 1e-5
    assert torch.allclose(kc.double(), kc_want.double(), atol=1e-6)
