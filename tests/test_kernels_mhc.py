"""Tests of dsv41::mhc_mixes / mhc_collapse_rmsnorm / mhc_expand (dsv41/kernels/mhc.py).

Reference: written here in float64 from MODEL.md §2.3 (plain Python per token for the coefficients and the
Sinkhorn iterations, eager float64 tensor math for collapse / norm / expand), never the code under test.

Tolerances (the kernels compute in FP32, their long sums in another order than the reference):
- coefficients: |got - ref| <= 2e-5 + 1e-4 |ref| (pre, post, comb are O(1); FP32 rounding of a 4d-long dot
  product and of 20 Sinkhorn rounds stays below 1e-5 at these shapes);
- collapse + norm and expand in FP32: <= 1e-5 (1 + |ref|); in bf16: one bf16 rounding of the result (2^-8 |ref|
  relative, the FP32 value before rounding may sit on the other side of a rounding boundary), plus for the
  norm the bf16 rounding of the collapsed intermediate the eager code also makes (another 2^-8).

Interpreter tests (`@interpreted`) run in a child pytest with TRITON_INTERPRET=1 unless this process was
started with it (Triton reads the variable when it is first imported; see tests/interp_harness.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from interp_harness import IN_INTERPRETER, InterpreterHarness, poison_outputs, sm90_ttir

from dsv41.kernels import mhc as mk

ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-20

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output the launchers allocate starts as NaN, so an element the kernel forgets fails the test."""
    poison_outputs(monkeypatch, mk)


# ------------------------------------------------------------------------------------------- float64 reference
def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def ref_sinkhorn(logits: list, iters: int, eps: float) -> list:
    """4x4 Sinkhorn in plain Python (C[i][j], i = source): softmax over j + eps, columns, then rows/columns."""
    c = []
    for row in logits:
        mx = max(row)
        ex = [math.exp(v - mx) for v in row]
        c.append([e / sum(ex) + eps for e in ex])

    def columns():
        for j in range(4):
            s = sum(c[i][j] for i in range(4))
            for i in range(4):
                c[i][j] /= s + eps

    def rows():
        for i in range(4):
            s = sum(c[i])
            c[i] = [v / (s + eps) for v in c[i]]

    columns()
    for _ in range(iters - 1):
        rows()
        columns()
    return c


def ref_mixes(H, fn, base, scale, norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=ITERS, weight=None):
    """float64 (pre [B, T, 4], post [B, T, 4], comb [B, T, 4, 4]) following MODEL.md §2.3 steps 1-6; with an RMS
    `weight` w [4d] the projection reads z * w (m_q = sum_k fn[q, k] w[k] z[k] * r: normalise, then project)."""
    b, t, _, d = H.shape
    pre = torch.empty(b, t, 4, dtype=torch.float64)
    post = torch.empty(b, t, 4, dtype=torch.float64)
    comb = torch.empty(b, t, 4, 4, dtype=torch.float64)
    f = (fn.double() if weight is None else fn.double() * weight.double().cpu()[None, :]).tolist()
    bs, sc = base.double().tolist(), scale.double().tolist()
    for bi in range(b):
        for ti in range(t):
            z = H[bi, ti].double().reshape(-1).tolist()
            r = 1.0 / math.sqrt(sum(v * v for v in z) / len(z) + norm_eps)
            m = [sum(w * v for w, v in zip(f[q], z)) * r for q in range(24)]
            for i in range(4):
                pre[bi, ti, i] = _sigmoid(m[i] * sc[0] + bs[i]) + hc_eps
                post[bi, ti, i] = 2.0 * _sigmoid(m[4 + i] * sc[1] + bs[4 + i])
            logits = [[m[8 + 4 * i + j] * sc[2] + bs[8 + 4 * i + j] for j in range(4)] for i in range(4)]
            comb[bi, ti] = torch.tensor(ref_sinkhorn(logits, iters, hc_eps), dtype=torch.float64)
    return pre, post, comb


def ref_collapse_rmsnorm(H, pre, weight, eps=NORM_EPS):
    """float64 collapse, rounded to H.dtype as the eager code does, then the weighted RMSNorm; float64 result."""
    x = (pre.double()[..., None] * H.double()).sum(2).to(H.dtype).double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight.double()


def ref_expand(y, H, post, comb):
    """float64 H'_j = post_j * y + sum_i comb[i, j] H_i."""
    out = post.double()[..., None] * y.double()[:, :, None, :]
    for j in range(4):
        for i in range(4):
            out[:, :, j] += comb.double()[:, :, i, j, None] * H.double()[:, :, i]
    return out


def make_mix_inputs(b, t, d, dtype, seed, logit_scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    H = (torch.randn(b, t, 4, d, generator=gen) * 2).to(dtype)
    fn = torch.randn(24, 4 * d, generator=gen) / math.sqrt(4 * d)
    base = torch.randn(24, generator=gen)
    scale = torch.tensor([0.8, 1.2, logit_scale])
    return H, fn, base, scale


def assert_close(got, ref, atol, rtol, what=""):
    assert not torch.isnan(got).any(), f"{what}: NaN left in the output (an element was never written)"
    err = (got.double() - ref.double()).abs()
    bound = atol + rtol * ref.double().abs()
    excess = float((err - bound).max())
    assert bool((err <= bound).all()), f"{what}: max error {float(err.max())}, worst excess {excess}"


def assert_rounded(got, ref64, dtype, what="", roundings=1):
    """got (in dtype) within `roundings` roundings of dtype (plus FP32 noise) of the float64 reference."""
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert_close(got, ref64, 1e-5, 1e-5, what)
    else:
        assert_close(got, ref64, 1e-6, roundings * 2.0 ** -8 + 1e-5, what)


SHAPES = [(2, 1, 96), (1, 3, 160), (2, 3, 96)]
DTYPES = [torch.float32, torch.bfloat16]
_ids_shape = lambda s: f"B{s[0]}T{s[1]}d{s[2]}"  # noqa: E731
_ids_dtype = lambda d: str(d).replace("torch.", "")  # noqa: E731


# ------------------------------------------------------------------------------------------- reference ops
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids_dtype)
def test_cpu_ops_match_the_float64_spec(dtype):
    H, fn, base, scale = make_mix_inputs(2, 3, 96, dtype, 1)
    pre, post, comb = torch.ops.dsv41.mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    rp, rq, rc = ref_mixes(H, fn, base, scale)
    for got, ref, name in ((pre, rp, "pre"), (post, rq, "post"), (comb, rc, "comb")):
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert_close(got, ref, 2e-5, 1e-4, name)
    w = (torch.rand(96, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    x = torch.ops.dsv41.mhc_collapse_rmsnorm(H, pre, w, NORM_EPS)
    assert_rounded(x, ref_collapse_rmsnorm(H, pre, w), dtype, "collapse_rmsnorm", roundings=2)
    y = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = torch.ops.dsv41.mhc_expand(y, H, post, comb)
    assert_rounded(out, ref_expand(y, H, post, comb), dtype, "expand")


@pytest.mark.parametrize("wdtype", DTYPES, ids=_ids_dtype)
def test_cpu_op_with_norm_weight_matches_the_float64_spec(wdtype):
    H, fn, base, scale = make_mix_inputs(2, 3, 96, torch.bfloat16, 21)
    w = (0.5 + torch.rand(4 * 96, generator=torch.Generator().manual_seed(22))).to(wdtype)
    got = torch.ops.dsv41.mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS, w)
    for g, r, name in zip(got, ref_mixes(H, fn, base, scale, weight=w), ("pre", "post", "comb")):
        assert g.dtype == torch.float32 and g.is_contiguous()
        assert_close(g, r, 2e-5, 1e-4, name)
    # Without the weight (None or left out) the op is the unweighted one, bit for bit.
    plain = torch.ops.dsv41.mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    none = torch.ops.dsv41.mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS, None)
    assert all(torch.equal(a, b) for a, b in zip(plain, none))


# ------------------------------------------------------------------------------------------- Triton (interpreted)
@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids_dtype)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids_shape)
def test_triton_mixes_match_float64_reference(shape, dtype, poisoned_outputs):
    b, t, d = shape
    H, fn, base, scale = make_mix_inputs(b, t, d, dtype, d + t)
    pre, post, comb = mk.triton_mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    rp, rq, rc = ref_mixes(H, fn, base, scale)
    assert pre.shape == (b, t, 4) and post.shape == (b, t, 4) and comb.shape == (b, t, 4, 4)
    assert_close(pre, rp, 2e-5, 1e-4, "pre")
    assert_close(post, rq, 2e-5, 1e-4, "post")
    assert_close(comb, rc, 2e-5, 1e-4, "comb")


@interpreted
@pytest.mark.parametrize("split", [1, 2, 5])
def test_triton_mixes_split_k_sums_partials_of_every_split(split, poisoned_outputs):
    # K = 4 * 320 = 1280 = 5 blocks of 256: split 1 (no workspace), 2 (uneven 3 + 2 blocks), 5 (one each).
    H, fn, base, scale = make_mix_inputs(2, 1, 320, torch.float32, 11, logit_scale=4.0)
    assert mk.mixes_plan(2, 320, split=split)["SPLIT"] == split
    got = mk.triton_mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS, split=split)
    for g, w, name in zip(got, ref_mixes(H, fn, base, scale), ("pre", "post", "comb")):
        assert_close(g, w, 2e-5, 1e-4, name)


@interpreted
@pytest.mark.parametrize("split, hdtype, wdtype", [(1, torch.float32, torch.float32),
                                                   (2, torch.bfloat16, torch.bfloat16),
                                                   (5, torch.float32, torch.bfloat16)],
                         ids=["split1-fp32", "split2-bf16", "split5-fp32-wbf16"])
def test_triton_mixes_with_norm_weight_match_float64_reference(split, hdtype, wdtype, poisoned_outputs):
    # K = 1280 = 5 blocks of 256 (as above); the weight is read block by block with z, also across splits.
    H, fn, base, scale = make_mix_inputs(2, 1, 320, hdtype, 31, logit_scale=4.0)
    w = (0.5 + torch.rand(1280, generator=torch.Generator().manual_seed(32))).to(wdtype)
    assert mk.mixes_plan(2, 320, split=split)["SPLIT"] == split
    got = mk.triton_mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS, split=split, norm_weight=w)
    for g, r, name in zip(got, ref_mixes(H, fn, base, scale, weight=w), ("pre", "post", "comb")):
        assert_close(g, r, 2e-5, 1e-4, name)


@interpreted
def test_triton_mixes_norm_weight_with_masked_tail_and_small_rms(poisoned_outputs):
    # K = 384: the second block is half masked (the weight load must be too); |H| ~ 1e-3 so that norm_eps = 1e-6
    # matters; the weight must not enter the statistic (a weight of 4 on every other channel would make the mean
    # square 8.5 times larger).
    H, fn, base, scale = make_mix_inputs(2, 3, 96, torch.float32, 33, logit_scale=6.0)
    H = H * 1e-3
    w = torch.ones(384)
    w[::2] = 4.0
    got = mk.triton_mhc_mixes(H, fn, base, scale, 1e-6, 1e-3, 5, norm_weight=w)
    want = ref_mixes(H, fn, base, scale, norm_eps=1e-6, hc_eps=1e-3, iters=5, weight=w)
    for g, r, name in zip(got, want, ("pre", "post", "comb")):
        assert_close(g, r, 2e-5, 1e-4, name)


def test_mixes_kernel_reads_the_norm_weight_only_with_has_w_and_before_the_pdl_wait():
    # Built offline for sm_90: without HAS_W the weight pointer is never used (the unweighted kernel is unchanged);
    # with it, the first weight block is loaded before the PDL wait (a weight, like fn) and once more per loop block.
    ptrs = {n: "fp32" for n in ("h_ptr", "fn_ptr", "base_ptr", "scale_ptr", "pre_ptr", "post_ptr", "comb_ptr",
                                "part_ptr")}
    ptrs.update(cnt_ptr="i32", nw_ptr="bf16")
    consts = dict(D=320, BLOCK_K=256, CHUNK=512, SPLIT_POW2=4, USE_PDL=True)
    scalars = {"norm_eps": "fp32", "hc_eps": "fp32"}
    plain = sm90_ttir(mk._mhc_mixes_kernel, ptrs, dict(consts, HAS_W=False), scalars).splitlines()
    assert not [ln for ln in plain if "%nw_ptr" in ln and "tt.func" not in ln]
    weighted = sm90_ttir(mk._mhc_mixes_kernel, ptrs, dict(consts, HAS_W=True), scalars).splitlines()
    w_loads = [i for i, ln in enumerate(weighted) if "tt.load" in ln and "!tt.ptr<bf16>" in ln]
    wait = next(i for i, ln in enumerate(weighted) if "tt.grid_dependency_wait" in ln)
    assert len(w_loads) == 2 and w_loads[0] < wait < w_loads[1]


def test_mixes_plan_spreads_the_decode_reduction():
    # d = 4096 at decode: K = 16384 = 64 blocks -> 64 programs of one block; prefill rows need no split.
    assert mk.mixes_plan(1, 4096) == {"SPLIT": 64, "CHUNK": 256}
    assert mk.mixes_plan(256, 4096)["SPLIT"] == 1
    assert mk.mixes_plan(1, 4096, split=3) == {"SPLIT": 3, "CHUNK": 22 * 256}
    with pytest.raises(ValueError, match="split"):
        mk.mixes_plan(1, 64, split=0)


@interpreted
def test_triton_sinkhorn_ends_on_column_normalisation(poisoned_outputs):
    # Large logits: after 20 rounds the columns sum to 1 (the last step) while the rows still do not.
    H, fn, base, scale = make_mix_inputs(1, 3, 96, torch.float32, 5, logit_scale=8.0)
    _, _, comb = mk.triton_mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    cols = comb.double().sum(-2)
    rows = comb.double().sum(-1)
    assert float((cols - 1).abs().max()) < 1e-5
    assert float((rows - 1).abs().max()) > 1e-4
    assert_close(comb, ref_mixes(H, fn, base, scale)[2], 2e-5, 1e-4, "comb")


@interpreted
@pytest.mark.parametrize("iters", [1, 7])
def test_triton_mixes_honour_iteration_count_and_eps(iters, poisoned_outputs):
    H, fn, base, scale = make_mix_inputs(1, 2, 160, torch.float32, 9, logit_scale=6.0)
    H = H * 1e-3  # mean square 4e-6: norm_eps = 1e-6 changes the statistic, so a dropped eps would fail
    got = mk.triton_mhc_mixes(H, fn, base, scale, 1e-6, 1e-3, iters)
    want = ref_mixes(H, fn, base, scale, norm_eps=1e-6, hc_eps=1e-3, iters=iters)
    for g, w, name in zip(got, want, ("pre", "post", "comb")):
        assert_close(g, w, 2e-5, 1e-4, name)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids_dtype)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids_shape)
def test_triton_collapse_rmsnorm_matches_reference(shape, dtype, poisoned_outputs):
    b, t, d = shape
    gen = torch.Generator().manual_seed(d * 3 + t)
    H = (torch.randn(b, t, 4, d, generator=gen) * 3).to(dtype)
    pre = torch.rand(b, t, 4, generator=gen) + 1e-6
    w = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    x = mk.triton_mhc_collapse_rmsnorm(H, pre, w, NORM_EPS)
    assert x.shape == (b, t, d)
    assert_rounded(x, ref_collapse_rmsnorm(H, pre, w), dtype, "collapse_rmsnorm", roundings=2)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids_dtype)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids_shape)
def test_triton_expand_matches_reference(shape, dtype, poisoned_outputs):
    b, t, d = shape
    gen = torch.Generator().manual_seed(d * 5 + t)
    H = (torch.randn(b, t, 4, d, generator=gen) * 3).to(dtype)
    y = torch.randn(b, t, d, generator=gen).to(dtype)
    post = 2 * torch.rand(b, t, 4, generator=gen)
    comb = torch.rand(b, t, 4, 4, generator=gen)
    out = mk.triton_mhc_expand(y, H, post, comb)
    assert out.shape == (b, t, 4, d)
    assert_rounded(out, ref_expand(y, H, post, comb), dtype, "expand")


@interpreted
def test_triton_expand_splits_wide_rows_over_programs(poisoned_outputs):
    # d = 1056 > BLOCK_D = 1024: the second program covers the 32-channel tail.
    gen = torch.Generator().manual_seed(8)
    H = torch.randn(1, 1, 4, 1056, generator=gen)
    y = torch.randn(1, 1, 1056, generator=gen)
    post, comb = torch.rand(1, 1, 4, generator=gen), torch.rand(1, 1, 4, 4, generator=gen)
    assert_rounded(mk.triton_mhc_expand(y, H, post, comb), ref_expand(y, H, post, comb), torch.float32, "expand")


@interpreted
def test_triton_ops_read_strided_and_broadcast_streams(poisoned_outputs):
    # The model's first layer: H is the embedding broadcast over the streams (stream stride 0), and strided
    # views (a slice of a wider buffer) must be read through their strides.
    gen = torch.Generator().manual_seed(12)
    emb = torch.randn(2, 3, 96, generator=gen).bfloat16()
    H = emb[:, :, None, :].expand(2, 3, 4, 96)
    _, fn, base, scale = make_mix_inputs(2, 3, 96, torch.bfloat16, 13)
    got = mk.triton_mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    for g, w in zip(got, ref_mixes(H, fn, base, scale)):
        assert_close(g, w, 2e-5, 1e-4)
    wide = torch.randn(2, 3, 4, 128, generator=gen).bfloat16()
    Hs = wide[..., 16:112]
    pre = torch.rand(2, 3, 4, generator=gen)
    pre_t = torch.rand(2, 4, 3, generator=gen).transpose(1, 2)  # non-contiguous coefficients
    w = torch.rand(96, generator=gen).bfloat16() + 0.5
    assert_rounded(mk.triton_mhc_collapse_rmsnorm(Hs, pre_t, w, NORM_EPS), ref_collapse_rmsnorm(Hs, pre_t, w),
                   torch.bfloat16, "collapse", roundings=2)
    y = torch.randn(2, 3, 128, generator=gen).bfloat16()[..., :96]
    comb_t = torch.rand(2, 3, 4, 4, generator=gen).transpose(-1, -2)
    assert_rounded(mk.triton_mhc_expand(y, Hs, pre, comb_t), ref_expand(y, Hs, pre, comb_t), torch.bfloat16, "expand")


# ------------------------------------------------------------------------------------------- op registration
def _op_args():
    H, fn, base, scale = make_mix_inputs(1, 2, 32, torch.float32, 3)
    gen = torch.Generator().manual_seed(4)
    pre, post, comb = torch.rand(1, 2, 4, generator=gen), torch.rand(1, 2, 4, generator=gen), \
        torch.rand(1, 2, 4, 4, generator=gen)
    return H, fn, base, scale, pre, post, comb


def test_ops_pass_torch_library_opcheck():
    H, fn, base, scale, pre, post, comb = _op_args()
    torch.library.opcheck(torch.ops.dsv41.mhc_mixes.default, (H, fn, base, scale, NORM_EPS, HC_EPS, ITERS))
    torch.library.opcheck(torch.ops.dsv41.mhc_mixes.default,
                          (H, fn, base, scale, NORM_EPS, HC_EPS, ITERS, torch.rand(128).bfloat16() + 0.5))
    torch.library.opcheck(torch.ops.dsv41.mhc_collapse_rmsnorm.default, (H.bfloat16(), pre, torch.ones(32), 1e-6))
    torch.library.opcheck(torch.ops.dsv41.mhc_expand.default, (torch.randn(1, 2, 32), H, post, comb))


def test_fake_functions_give_shapes_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        H = torch.empty(2, 3, 4, 160, dtype=torch.bfloat16)
        pre, post, comb = torch.ops.dsv41.mhc_mixes(H, torch.empty(24, 640), torch.empty(24), torch.empty(3),
                                                    NORM_EPS, HC_EPS, ITERS)
        assert pre.shape == post.shape == (2, 3, 4) and comb.shape == (2, 3, 4, 4) and comb.dtype == torch.float32
        weighted = torch.ops.dsv41.mhc_mixes(H, torch.empty(24, 640), torch.empty(24), torch.empty(3), NORM_EPS,
                                             HC_EPS, ITERS, torch.empty(640, dtype=torch.bfloat16))
        assert [tuple(r.shape) for r in weighted] == [(2, 3, 4), (2, 3, 4), (2, 3, 4, 4)]
        x = torch.ops.dsv41.mhc_collapse_rmsnorm(H, pre, torch.empty(160, dtype=torch.bfloat16), NORM_EPS)
        assert x.shape == (2, 3, 160) and x.dtype == torch.bfloat16
        out = torch.ops.dsv41.mhc_expand(x, H, post, comb)
        assert out.shape == H.shape and out.dtype == torch.bfloat16


def test_bad_inputs_raise_errors_naming_the_argument():
    H, fn, base, scale, pre, post, comb = _op_args()
    with pytest.raises(ValueError, match="fn must be"):
        mk.reference_mhc_mixes(H, fn[:, :64], base, scale, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(TypeError, match="fn has dtype"):
        mk.reference_mhc_mixes(H, fn.double(), base, scale, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="four residual streams"):
        mk.reference_mhc_mixes(H[:, :, :3], fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="iters"):
        mk.reference_mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, 0)
    with pytest.raises(ValueError, match="scale must be"):
        mk.reference_mhc_mixes(H, fn, base, scale[:2], NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="norm_weight must be"):
        mk.reference_mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS, torch.ones(32))
    with pytest.raises(TypeError, match="norm_weight has dtype"):
        mk.reference_mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS, torch.ones(128, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight must be"):
        mk.reference_mhc_collapse_rmsnorm(H, pre, torch.ones(31), NORM_EPS)
    with pytest.raises(ValueError, match="pre must be"):
        mk.reference_mhc_collapse_rmsnorm(H, pre[:, :1], torch.ones(32), NORM_EPS)
    with pytest.raises(ValueError, match="y must be"):
        mk.reference_mhc_expand(torch.randn(1, 2, 16), H, post, comb)
    with pytest.raises(ValueError, match="comb must be"):
        mk.reference_mhc_expand(torch.randn(1, 2, 32), H, post, comb[..., :3])
    with pytest.raises(TypeError, match="post has dtype"):
        mk.reference_mhc_expand(torch.randn(1, 2, 32), H, post.long(), comb)


@pytest.mark.skipif(IN_INTERPRETER, reason="checks the error raised when Triton is NOT interpreting")
def test_cpu_launch_without_interpreter_says_how_to_enable_it():
    H, fn, base, scale, *_ = _op_args()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        mk.triton_mhc_mixes(H, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
