"""dsv41::mhc_expand_mixes (dsv41/kernels/mhc_fold.py): an mHC expand and the next site's coefficients, one launch.

The reference here is numpy float64 written from MODEL.md §2.3 (expand: H'_j = post_j y + sum_i comb[i, j] H_i;
coefficients: RMS statistic, 24 projections, sigmoids, Sinkhorn ending on the column step), not dsv41's own
functions. H' is compared after rounding the float64 value to the tensor dtype (one rounding apart at most: the
kernel rounds an FP32 value). The coefficients are checked against the float64 coefficients of H' *as the kernel
stored it* (the op's contract: the mixes read H' rounded to H.dtype), at the mixes kernel's tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interp_harness import InterpreterHarness, poison_outputs, sm90_ttir

from dsv41.kernels import mhc as mk
from dsv41.kernels import mhc_fold as fk

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()

ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-20


@pytest.fixture
def poisoned(monkeypatch):
    poison_outputs(monkeypatch, fk)


def np_expand(y, H, post, comb):
    y, H, post, comb = (np.asarray(a.double()) for a in (y, H, post, comb))
    return post[..., :, None] * y[..., None, :] + np.einsum("btij,btid->btjd", comb, H)


def np_coefficients(H, fn, base, scale, w=None, norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=ITERS):
    z = np.asarray(H.double()).reshape(H.shape[0], H.shape[1], -1)
    r = 1.0 / np.sqrt((z ** 2).mean(-1, keepdims=True) + norm_eps)
    zw = z if w is None else z * np.asarray(w.double())
    m = (zw @ np.asarray(fn.double()).T) * r
    s, bs = np.asarray(scale.double()), np.asarray(base.double())
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731
    pre = sig(m[..., 0:4] * s[0] + bs[0:4]) + hc_eps
    post = 2.0 * sig(m[..., 4:8] * s[1] + bs[4:8])
    lg = (m[..., 8:] * s[2] + bs[8:]).reshape(*m.shape[:2], 4, 4)
    c = np.exp(lg - lg.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + hc_eps
    c = c / (c.sum(-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + hc_eps)
        c = c / (c.sum(-2, keepdims=True) + hc_eps)
    return pre, post, c


def inputs(b, t, d, dtype, seed, weighted=False):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(b, t, d, generator=g).to(dtype)
    H = (torch.randn(b, t, 4, d, generator=g) * 1.5).to(dtype)
    post = 2 * torch.rand(b, t, 4, generator=g)
    comb = torch.rand(b, t, 4, 4, generator=g)
    comb = comb / comb.sum(-2, keepdim=True)
    fn = torch.randn(24, 4 * d, generator=g) / (4 * d) ** 0.5
    base = torch.randn(24, generator=g)
    scale = torch.tensor([0.7, 1.1, 3.0])
    w = (0.5 + torch.rand(4 * d, generator=g)).to(dtype) if weighted else None
    return y, H, post, comb, fn, base, scale, w


def check(got, ref, atol, rtol, what):
    got = np.asarray(got.double())
    assert not np.isnan(got).any(), f"{what}: NaN left (an element never written)"
    err, bound = np.abs(got - ref), atol + rtol * np.abs(ref)
    assert (err <= bound).all(), f"{what}: worst error {err.max():.3g} (bound at it {bound.flat[err.argmax()]:.3g})"


def check_all(got, y, H, post, comb, fn, base, scale, w):
    out, pre, post2, comb2 = got
    assert out.dtype == H.dtype and out.shape == H.shape and out.is_contiguous()
    ulp = 1e-6 if H.dtype == torch.float32 else 2.0 ** -8 if H.dtype == torch.bfloat16 else 2.0 ** -11
    check(out, np_expand(y, H, post, comb), 1e-5, ulp + 1e-6, "H'")
    for g, r, name in zip((pre, post2, comb2), np_coefficients(out, fn, base, scale, w), ("pre", "post", "comb")):
        assert g.dtype == torch.float32
        check(g, r, 2e-5, 1e-4, name)


CASES = [  # (B, T, d, dtype, weighted)
    (1, 1, 64, torch.float32, False),
    (2, 3, 96, torch.bfloat16, False),
    (1, 2, 200, torch.float32, True),
    (1, 1, 320, torch.bfloat16, True),
    (1, 1, 48, torch.float16, False),
]


@interpreted
@pytest.mark.parametrize("b, t, d, dtype, weighted", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_fused_kernel_matches_float64(b, t, d, dtype, weighted, poisoned):
    args = inputs(b, t, d, dtype, d + t, weighted)
    y, H, post, comb, fn, base, scale, w = args
    got = fk.triton_mhc_expand_mixes(y, H, post, comb, fn, base, scale, NORM_EPS, HC_EPS, ITERS, w)
    check_all(got, *args)


@interpreted
@pytest.mark.parametrize("split", [1, 2, 5])
def test_every_channel_split_contributes(split, poisoned):
    # d = 320 = 5 blocks of 64 channels: one program, 3 + 2 blocks, one block each (workspace + arrival counter).
    assert fk.expand_mixes_plan(1, 320, split)["SPLIT"] == split
    args = inputs(2, 1, 320, torch.float32, 7)
    y, H, post, comb, fn, base, scale, w = args
    got = fk.triton_mhc_expand_mixes(y, H, post, comb, fn, base, scale, NORM_EPS, HC_EPS, ITERS, split=split)
    check_all(got, *args)


@interpreted
def test_stored_residual_equals_the_separate_expand_kernel():
    # H' is the expand kernel's to the bit (the same FP32 sums, rounded once), with non-contiguous y and H.
    g = torch.Generator().manual_seed(3)
    y = torch.randn(1, 2, 2 * 160, generator=g).to(torch.bfloat16)[..., ::2]
    H = torch.randn(1, 2, 4, 160, generator=g).to(torch.bfloat16).transpose(0, 1).contiguous().transpose(0, 1)
    post, comb = torch.rand(1, 2, 4, generator=g), torch.rand(1, 2, 4, 4, generator=g)
    fn, base, scale = torch.randn(24, 640, generator=g) * 0.05, torch.zeros(24), torch.ones(3)
    fused = fk.triton_mhc_expand_mixes(y, H, post, comb, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    assert torch.equal(fused[0], mk.triton_mhc_expand(y, H, post, comb))


def test_cpu_op_is_the_two_ops_in_sequence():
    y, H, post, comb, fn, base, scale, w = inputs(2, 2, 96, torch.bfloat16, 11, weighted=True)
    got = torch.ops.dsv41.mhc_expand_mixes(y, H, post, comb, fn, base, scale, NORM_EPS, HC_EPS, ITERS, w)
    out = torch.ops.dsv41.mhc_expand(y, H, post, comb)
    want = (out, *torch.ops.dsv41.mhc_mixes(out, fn, base, scale, NORM_EPS, HC_EPS, ITERS, w))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_bad_arguments_name_what_is_wrong():
    y, H, post, comb, fn, base, scale, _ = inputs(1, 1, 64, torch.float32, 1)
    with pytest.raises(ValueError, match="fn must be"):
        torch.ops.dsv41.mhc_expand_mixes(y, H, post, comb, fn[:, :128], base, scale, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="y must be"):
        torch.ops.dsv41.mhc_expand_mixes(y[..., :32], H, post, comb, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="iters"):
        torch.ops.dsv41.mhc_expand_mixes(y, H, post, comb, fn, base, scale, NORM_EPS, HC_EPS, 0)


def test_plan_spreads_a_decode_token_over_the_channels():
    assert fk.expand_mixes_plan(1, 5120) == {"SPLIT": 80, "CHUNK": 64, "BLOCK_D": 64}
    assert fk.expand_mixes_plan(256, 5120)["SPLIT"] == 1
    assert fk.expand_mixes_plan(1, 40) == {"SPLIT": 1, "CHUNK": 64, "BLOCK_D": 64}
    with pytest.raises(ValueError, match="split"):
        fk.expand_mixes_plan(1, 64, split=0)


def test_fn_is_read_before_the_pdl_wait_and_the_activations_after():
    # Built offline for sm_90: the first block's fn columns (a weight) load before griddepcontrol.wait; y, H, post
    # and comb (the previous kernels' results) only after it.
    ptrs = {n: "fp32" for n in ("post_ptr", "comb_ptr", "fn_ptr", "base_ptr", "scale_ptr", "pre2_ptr", "post2_ptr",
                                "comb2_ptr", "part_ptr")}
    ptrs.update(y_ptr="bf16", h_ptr="bf16", out_ptr="bf16", cnt_ptr="i32", nw_ptr="fp32")
    consts = dict(D=320, BLOCK_D=64, CHUNK=128, SPLIT_POW2=4, USE_PDL=True, HAS_W=False)
    lines = sm90_ttir(fk._mhc_expand_mixes_kernel, ptrs, consts, {"norm_eps": "fp32", "hc_eps": "fp32"}).splitlines()
    wait = next(i for i, ln in enumerate(lines) if "tt.grid_dependency_wait" in ln)
    fp32_loads = [i for i, ln in enumerate(lines) if "tt.load" in ln and "!tt.ptr<f32>" in ln]
    bf16_loads = [i for i, ln in enumerate(lines) if "tt.load" in ln and "!tt.ptr<bf16>" in ln]
    assert sum(i < wait for i in fp32_loads) == 3  # pre, post and comb rows of fn
    assert bf16_loads and min(bf16_loads) > wait
