"""Tests of dsv41/model/mhc.py against float64 references written here (MODEL.md §2.3)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsv41.model.mhc import mhc_collapse, mhc_expand, mhc_mixes, sinkhorn

ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-20


# ------------------------------------------------------------------------------------------ references
def ref_sinkhorn(logits: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """Plain-Python float64 Sinkhorn of one 4x4 matrix, in the §2.3 order (C[i][j], i = source)."""
    n = logits.shape[0]
    c = [[0.0] * n for _ in range(n)]
    for i in range(n):
        mx = max(float(v) for v in logits[i])
        ex = [math.exp(float(v) - mx) for v in logits[i]]
        tot = sum(ex)
        for j in range(n):
            c[i][j] = ex[j] / tot + eps

    def col_norm():
        for j in range(n):
            s = sum(c[i][j] for i in range(n))
            for i in range(n):
                c[i][j] = c[i][j] / (s + eps)

    def row_norm():
        for i in range(n):
            s = sum(c[i])
            for j in range(n):
                c[i][j] = c[i][j] / (s + eps)

    col_norm()
    for _ in range(iters - 1):
        row_norm()
        col_norm()
    return np.array(c, dtype=np.float64)


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def ref_mixes_token(h: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray):
    """float64 §2.3 steps 1-6 for one token's H [4, d]."""
    z = h.reshape(-1).astype(np.float64)
    r = 1.0 / math.sqrt(float(np.mean(z * z)) + NORM_EPS)
    m = [float(np.dot(fn[q].astype(np.float64), z)) * r for q in range(24)]
    pre = [sigmoid(m[i] * scale[0] + base[i]) + HC_EPS for i in range(4)]
    post = [2.0 * sigmoid(m[4 + j] * scale[1] + base[4 + j]) for j in range(4)]
    logits = np.array([[m[8 + 4 * i + j] * scale[2] + base[8 + 4 * i + j] for j in range(4)] for i in range(4)])
    return np.array(pre), np.array(post), ref_sinkhorn(logits, ITERS, HC_EPS)


def random_site(gen: torch.Generator, d: int):
    fn = torch.randn(24, 4 * d, generator=gen) / math.sqrt(4 * d)
    base = torch.randn(24, generator=gen)
    scale = torch.rand(3, generator=gen) * 2 + 0.5
    return fn, base, scale


# ------------------------------------------------------------------------------------------ sinkhorn
def test_sinkhorn_ends_on_column_normalisation():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 4, 4, generator=gen) * 4.0
    c = sinkhorn(logits, ITERS, HC_EPS)
    col = c.sum(dim=-2).double()
    row = c.sum(dim=-1).double()
    assert torch.all((col - 1).abs() < 1e-5)
    # Rows are normalised first in every round, so they are only approximately 1 at the end.
    assert not torch.all((row - 1).abs() < 1e-6)


def test_sinkhorn_matches_float64_recipe_op_order():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 4, 4, generator=gen) * 3.0
    for iters in (1, 2, ITERS):
        got = sinkhorn(logits, iters, HC_EPS)
        assert got.dtype == torch.float32 and got.shape == (32, 4, 4)
        want = np.stack([ref_sinkhorn(logits[b].double().numpy(), iters, HC_EPS) for b in range(32)])
        np.testing.assert_allclose(got.double().numpy(), want, rtol=2e-5, atol=1e-7)


def test_sinkhorn_eps_enters_softmax_and_both_normalisations():
    # A large eps makes its placement visible: compare against the recipe with a deliberately big eps.
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 4, 4, generator=gen)
    got = sinkhorn(logits, 3, 0.25)
    want = np.stack([ref_sinkhorn(logits[b].double().numpy(), 3, 0.25) for b in range(8)])
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-7)


def test_sinkhorn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="iters"):
        sinkhorn(torch.zeros(4, 4), 0, HC_EPS)
    with pytest.raises(ValueError, match="n, n"):
        sinkhorn(torch.zeros(4, 3), 2, HC_EPS)


# ------------------------------------------------------------------------------------------ mixes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixes_match_float64_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    B, T, d = 2, 3, 32
    H = (torch.randn(B, T, 4, d, generator=gen) * 3).to(dtype)
    fn, base, scale = random_site(gen, d)
    pre, post, comb = mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    assert pre.shape == (B, T, 4) and post.shape == (B, T, 4) and comb.shape == (B, T, 4, 4)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    hd = H.double().numpy()
    for b in range(B):
        for t in range(T):
            rp, rq, rc = ref_mixes_token(hd[b, t], fn.double().numpy(), base.double().numpy(),
                                         scale.double().numpy())
            np.testing.assert_allclose(pre[b, t].double().numpy(), rp, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(post[b, t].double().numpy(), rq, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(comb[b, t].double().numpy(), rc, rtol=1e-4, atol=1e-6)


def test_mixes_comb_is_source_by_destination_row_major():
    # Only the comb logit (i=1, j=3) is large: after Sinkhorn the mass of destination 3 sits on source 1.
    d = 32
    H = torch.ones(1, 1, 4, d)
    fn = torch.zeros(24, 4 * d)
    base = torch.zeros(24)
    base[8 + 4 * 1 + 3] = 12.0
    comb = mhc_mixes(H, fn, base, torch.ones(3), NORM_EPS, HC_EPS, ITERS)[2][0, 0]
    # Doubly stochastic: the other entries share the rest (~1/3 each), far below the chosen one.
    assert comb[1, 3] > 0.9 and comb[3, 1] < 0.5


def test_mixes_pre_floor_is_hc_eps_and_post_ceiling_is_two():
    d = 16
    H = torch.randn(1, 2, 4, d, generator=torch.Generator().manual_seed(7))
    base = torch.zeros(24)
    base[0:4] = -200.0  # sigmoid underflows to 0: pre is exactly the hc_eps offset
    base[4:8] = 200.0  # sigmoid saturates at 1: post = 2
    pre, post, _ = mhc_mixes(H, torch.zeros(24, 4 * d), base, torch.ones(3), NORM_EPS, HC_EPS, ITERS)
    torch.testing.assert_close(pre, torch.full_like(pre, HC_EPS), rtol=1e-6, atol=0)
    torch.testing.assert_close(post, torch.full_like(post, 2.0), rtol=0, atol=0)


def test_mixes_reject_bad_shapes():
    H = torch.randn(1, 1, 4, 8)
    fn, base, scale = torch.zeros(24, 32), torch.zeros(24), torch.ones(3)
    with pytest.raises(ValueError, match="H"):
        mhc_mixes(torch.randn(1, 1, 3, 8), fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="fn"):
        mhc_mixes(H, torch.zeros(24, 16), base, scale, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="scale"):
        mhc_mixes(H, fn, base, torch.ones(2), NORM_EPS, HC_EPS, ITERS)


# ------------------------------------------------------------------------------------------ collapse / expand
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_matches_float64_reference(dtype):
    gen = torch.Generator().manual_seed(4)
    B, T, d = 2, 2, 16
    H = torch.randn(B, T, 4, d, generator=gen).to(dtype)
    pre = torch.rand(B, T, 4, generator=gen)
    x = mhc_collapse(H, pre)
    assert x.dtype == dtype and x.shape == (B, T, d)
    hd, pd = H.double().numpy(), pre.double().numpy()
    want = np.zeros((B, T, d))
    for b in range(B):
        for t in range(T):
            for c in range(d):
                want[b, t, c] = sum(pd[b, t, i] * hd[b, t, i, c] for i in range(4))
    # bf16 output: within one rounding of the exact FP32-accumulated value.
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-6)
    np.testing.assert_allclose(x.double().numpy(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_matches_float64_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    B, T, d = 2, 2, 16
    H = torch.randn(B, T, 4, d, generator=gen).to(dtype)
    y = torch.randn(B, T, d, generator=gen).to(dtype)
    post = torch.rand(B, T, 4, generator=gen) * 2
    comb = torch.rand(B, T, 4, 4, generator=gen)
    out = mhc_expand(y, H, post, comb)
    assert out.dtype == dtype and out.shape == (B, T, 4, d)
    hd, yd, qd, cd = H.double().numpy(), y.double().numpy(), post.double().numpy(), comb.double().numpy()
    want = np.zeros((B, T, 4, d))
    for b in range(B):
        for t in range(T):
            for j in range(4):
                for c in range(d):
                    want[b, t, j, c] = qd[b, t, j] * yd[b, t, c] + sum(cd[b, t, i, j] * hd[b, t, i, c]
                                                                       for i in range(4))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-6)
    np.testing.assert_allclose(out.double().numpy(), want, **tol)


def test_expand_uses_comb_source_index_first():
    # comb[i=0, j=2] = 1, all else 0: destination 2 receives stream 0; others receive nothing.
    d = 8
    H = torch.arange(4 * d, dtype=torch.float32).view(1, 1, 4, d)
    comb = torch.zeros(1, 1, 4, 4)
    comb[0, 0, 0, 2] = 1.0
    out = mhc_expand(torch.zeros(1, 1, d), H, torch.zeros(1, 1, 4), comb)
    torch.testing.assert_close(out[0, 0, 2], H[0, 0, 0])
    assert torch.all(out[0, 0, [0, 1, 3]] == 0)


def test_collapse_and_expand_reject_bad_shapes():
    H = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="pre"):
        mhc_collapse(H, torch.rand(1, 2, 3))
    with pytest.raises(ValueError, match="y"):
        mhc_expand(torch.randn(1, 2, 7), H, torch.rand(1, 2, 4), torch.rand(1, 2, 4, 4))
    with pytest.raises(ValueError, match="comb"):
        mhc_expand(torch.randn(1, 2, 8), H, torch.rand(1, 2, 4), torch.rand(1, 2, 4, 3))


# ------------------------------------------------------------------------------------------ compile
def test_mhc_site_compiles_fullgraph_and_matches_eager():
    gen = torch.Generator().manual_seed(6)
    d = 32
    fn, base, scale = random_site(gen, d)
    H = torch.randn(1, 1, 4, d, generator=gen).to(torch.bfloat16)
    y = torch.randn(1, 1, d, generator=gen).to(torch.bfloat16)

    def site(H, y):
        pre, post, comb = mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
        return mhc_collapse(H, pre), mhc_expand(y, H, post, comb)

    torch._dynamo.reset()
    compiled = torch.compile(site, fullgraph=True, backend="eager")
    got = compiled(H, y)
    want = site(H, y)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
