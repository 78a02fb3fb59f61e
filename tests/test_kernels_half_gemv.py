"""dsv41/kernels/half_gemv.py against float64, on CPU (references) and under the Triton interpreter.

The oracle is written here from the math, never from the module: dot products in float64 (exact for bf16 / fp16
operands up to the final rounding), then rounded to the activation dtype where eager rounds (a projection's
output; the residual sum; gate, up, silu(gate) and the SwiGLU product). Bounds: a projection differs from the
oracle by its FP32 summation error (2^-20 of sum |x_k W_nk|) plus one ulp of its dtype where that error moves a
rounding; each further rounding adds an ulp of the value it rounds. Every launcher output is NaN-poisoned first.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from interp_harness import InterpreterHarness, poison_outputs

from dsv41.kernels import half_gemv as hg

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture
def nan_outputs(monkeypatch):
    poison_outputs(monkeypatch, hg)


def _round(v: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    return v.to(dt).double()


def _ulp(v: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """Spacing of `dt` values around |v| (subnormal floor included), in float64."""
    fi = torch.finfo(dt)
    mag = v.abs().clamp_min(fi.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def _dot(x: torch.Tensor, w: torch.Tensor):
    xd, wd = x.reshape(-1, x.shape[-1]).double(), w.double()
    return xd @ wd.T, xd.abs() @ wd.abs().T


def _within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    got = got.reshape(want.shape).double()
    assert torch.isfinite(got).all(), f"{what}: unwritten (NaN poison) or non-finite elements"
    excess = (got - want).abs() - bound
    assert bool((excess <= 0).all()), f"{what}: max excess {excess.max().item():.3e} over the bound"


def rms_oracle(x, nw, eps, mode):
    """(x RMS-normalised as `mode` rounds it, per-element slack): rstd in float64, the spelling's roundings to x's
    dtype; the kernel's FP32 statistic may move each rounding by an ulp (two for the twice-rounded mode)."""
    dt = x.dtype
    xd = x.double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    if mode == 1:
        xn = _round(_round(xd * rstd, dt) * nw.double(), dt)
    elif mode == 2:
        xn = _round(xd * rstd * nw.double(), dt)
    else:
        xn = _round(xd * rstd, dt)
    return xn.to(dt), 2 * _ulp(xn, dt)


def check_linear(y, x, w, residual=None, slack=None):
    """`slack` [..., K]: per-element uncertainty of x (an RMSNorm prologue's roundings), weighted by |W|."""
    dt = x.dtype
    exact, mag = _dot(x, w)
    sum_err = mag * 2.0 ** -20
    if slack is not None:
        sum_err = sum_err + slack.reshape(-1, x.shape[-1]) @ w.double().abs().T
    want = _round(exact, dt)
    bound = sum_err + _ulp(exact, dt)
    if residual is not None:
        r = residual.reshape(want.shape).double()
        bound = bound + _ulp(want + r, dt)
        want = _round(want + r, dt)
    _within(y, want, bound, "linear_half")


def check_swiglu(y, x, wg, wu, slack=None):
    dt = x.dtype
    g, gmag = _dot(x, wg)
    u, umag = _dot(x, wu)
    if slack is not None:
        gmag = gmag + 2.0 ** 20 * (slack.reshape(-1, x.shape[-1]) @ wg.double().abs().T)
        umag = umag + 2.0 ** 20 * (slack.reshape(-1, x.shape[-1]) @ wu.double().abs().T)
    g_r, u_r = _round(g, dt), _round(u, dt)
    s = _round(g_r * torch.sigmoid(g_r), dt)
    want = _round(s * u_r, dt)
    # A flipped rounding of g moves silu by at most 1.1 ulp(g); each of the three later roundings adds an ulp.
    dg = gmag * 2.0 ** -20 + _ulp(g, dt)
    du = umag * 2.0 ** -20 + _ulp(u, dt)
    ds = 1.1 * dg + _ulp(s, dt)
    bound = ds * u_r.abs() + du * s.abs() + ds * du + 2 * _ulp(want, dt)
    _within(y, want, bound, "linear_half_silu_mul")


# (leading dims of x, [N per weight], K, dtype, plan overrides): odd N and K, M from 1 to 11 (over MAX_TRITON_M
# the rows tile in m), one and several K splits, fp16.
SHAPES = [
    ((1,), [37], 100, torch.bfloat16, {}),
    ((1, 1), [130], 257, torch.bfloat16, {"block_k": 32, "k_iters": 2}),
    ((3,), [65], 96, torch.float16, {"block_n": 16, "block_k": 32, "k_iters": 1}),
    ((2, 3), [33], 200, torch.bfloat16, {"block_k": 32, "k_iters": 1}),
    ((11,), [9], 64, torch.float16, {}),
]
MULTI = [
    ((1,), [40, 24, 24], 96, torch.bfloat16, {"block_n": 16, "block_k": 32, "k_iters": 1}),
    ((2,), [17, 64], 130, torch.float16, {"block_k": 32, "k_iters": 2}),
    ((1, 1), [8, 8, 8, 33], 64, torch.bfloat16, {}),
]


def _data(lead, widths, k, dt, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, k, generator=gen) * 2).to(dt)
    ws = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(dt) for n in widths]
    return gen, x, ws


@interpreted
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-{str(c[3])[6:]}")
@pytest.mark.parametrize("with_residual", [False, True])
def test_one_weight_with_and_without_residual(case, with_residual, nan_outputs):
    lead, (n,), k, dt, over = case
    gen, x, (w,) = _data(lead, [n], k, dt, n + k)
    r = (torch.randn(*lead, n, generator=gen) * 4).to(dt) if with_residual else None
    y = hg.triton_linear_half(x, w, r, **over)
    assert y.shape == (*lead, n) and y.dtype == dt
    check_linear(y, x, w, r)


@interpreted
@pytest.mark.parametrize("case", MULTI, ids=lambda c: "-".join(map(str, c[1])))
def test_sibling_weights_in_one_launch(case, nan_outputs):
    lead, widths, k, dt, over = case
    _, x, ws = _data(lead, widths, k, dt, sum(widths))
    ys = hg.triton_linear_half_multi(x, ws, **over)
    assert [tuple(y.shape) for y in ys] == [(*lead, n) for n in widths]
    for y, w in zip(ys, ws):
        check_linear(y, x, w)


@interpreted
@pytest.mark.parametrize("lead, n, k, dt, over", [
    ((1,), 48, 64, torch.bfloat16, {}),
    ((1,), 37, 300, torch.bfloat16, {"block_k": 32, "k_iters": 2}),   # 5 K splits through one counter
    ((5,), 20, 96, torch.float16, {"block_n": 8, "block_k": 32, "k_iters": 1}),
])
def test_swiglu_gate_and_up_in_one_launch(lead, n, k, dt, over, nan_outputs):
    _, x, (wg, wu) = _data(lead, [n, n], k, dt, 3 * n + k)
    y = hg.triton_linear_half_silu_mul(x, wg, wu, **over)
    assert y.shape == (*lead, n) and y.dtype == dt
    check_swiglu(y, x, wg, wu)


@interpreted
def test_counters_return_to_zero_across_kinds(nan_outputs, monkeypatch):
    """A split-K single, a split-K multi and a split-K pair launch share one counter buffer; the repeat of the first
    equals it bit for bit, so none left a counter behind."""
    buf = torch.zeros(256, dtype=torch.int32)
    from dsv41.kernels import _common
    monkeypatch.setattr(_common, "split_k_counters", lambda device, n: buf)
    monkeypatch.setattr(hg, "split_k_workspace",
                        lambda empty, dev, sk, shape, tiles: (empty((sk, *shape), torch.float32, dev), buf)
                        if sk > 1 else (torch.empty(1), torch.empty(1, dtype=torch.int32)))
    _, x, ws = _data((1,), [20, 20], 160, torch.bfloat16, 11)
    over = dict(block_n=16, block_k=32, k_iters=1)
    a = hg.triton_linear_half(x, ws[0], **over)
    hg.triton_linear_half_multi(x, ws, **over)
    hg.triton_linear_half_silu_mul(x, ws[0], ws[1], **over)
    assert int(buf.abs().sum()) == 0
    assert torch.equal(a, hg.triton_linear_half(x, ws[0], **over))


@interpreted
def test_strided_inputs_are_read_as_values(nan_outputs):
    gen = torch.Generator().manual_seed(4)
    base = (torch.randn(3, 2 * 64, generator=gen) * torch.logspace(-2, 2, 2 * 64)).bfloat16()
    x = base[:, ::2]
    w = (torch.randn(64, 30, generator=gen)).bfloat16().T  # [30, 64], stride (1, 30)
    r = torch.randn(30, 3, generator=gen).bfloat16().T     # [3, 30], transposed
    check_linear(hg.triton_linear_half(x, w, r), x, w, r)


NORMS = [(1, 1e-5), (2, 1e-6), (3, 1e-5)]


@interpreted
@pytest.mark.parametrize("mode, eps", NORMS)
@pytest.mark.parametrize("op", ["single", "multi", "swiglu"])
def test_rmsnorm_prologue_of_every_op(op, mode, eps, nan_outputs):
    """x arrives un-normalised, at magnitudes where eps matters for one row; the op normalises it as the spelling
    rounds it."""
    gen, x, ws = _data((3,), [24, 40], 160, torch.bfloat16, 17 * mode)
    x[1] *= 1e-3  # mean(x^2) ~ 4e-6: the eps moves rstd
    nw = (1 + torch.randn(160, generator=gen) * 0.1).bfloat16() if mode != 3 else None
    xn, slack = rms_oracle(x, nw, eps, mode)
    over = dict(block_k=32, k_iters=2)
    if op == "single":
        r = torch.randn(3, 24, generator=gen).bfloat16()
        check_linear(hg.triton_linear_half(x, ws[0], r, nw, eps, mode, **over), xn, ws[0], r, slack)
    elif op == "multi":
        for y, w in zip(hg.triton_linear_half_multi(x, ws, nw, eps, mode, **over), ws):
            check_linear(y, xn, w, slack=slack)
    else:
        wu = (torch.randn(24, 160, generator=gen) / 13).bfloat16()
        check_swiglu(hg.triton_linear_half_silu_mul(x, ws[0], wu, nw, eps, mode, **over), xn, ws[0], wu, slack)


def test_cpu_ops_are_the_eager_spellings():
    """On CPU each op is bit-identical to what eager runs for its spelling."""
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 48, generator=gen).bfloat16()
    w1, w2, w3 = (torch.randn(40, 48, generator=gen).bfloat16() for _ in range(3))
    r = torch.randn(2, 3, 40, generator=gen).bfloat16()
    assert torch.equal(torch.ops.dsv41.linear_half(x, w1, r), r + F.linear(x, w1))
    assert torch.equal(torch.ops.dsv41.linear_half(x, w1, None), F.linear(x, w1))
    assert torch.equal(torch.ops.dsv41.linear_half_silu_mul(x, w1, w2), F.silu(F.linear(x, w1)) * F.linear(x, w2))
    for a, b in zip(torch.ops.dsv41.linear_half_multi(x, [w1, w2, w3]), (F.linear(x, w) for w in (w1, w2, w3))):
        assert torch.equal(a, b)
    nw = torch.randn(48, generator=gen).bfloat16()
    xf = x.float()
    gpt_fast = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * nw
    assert torch.equal(torch.ops.dsv41.linear_half(x, w1, None, nw, 1e-5, 1), F.linear(gpt_fast, w1))
    assert torch.equal(torch.ops.dsv41.linear_half(x, w1, None, nw, 1e-6, 2),
                       F.linear(F.rms_norm(x, (48,), nw, 1e-6), w1))


@pytest.mark.parametrize("call, kind, words", [
    (lambda: hg.reference_linear_half(torch.randn(2, 8), torch.randn(3, 8)), TypeError, "x"),
    (lambda: hg.reference_linear_half(torch.randn(2, 8).half(), torch.randn(3, 8).bfloat16()), TypeError,
     "weight is torch.bfloat16 but x is torch.float16"),
    (lambda: hg.reference_linear_half(torch.randn(2, 9).half(), torch.randn(3, 8).half()), ValueError, "K = 8"),
    (lambda: hg.reference_linear_half(torch.randn(2, 8).half(), torch.randn(3, 8).half(), torch.randn(2, 4).half()),
     ValueError, "residual"),
    (lambda: hg.reference_linear_half_multi(torch.randn(2, 8).half(), []), ValueError, "1 to 4"),
    (lambda: hg.reference_linear_half_multi(torch.randn(2, 8).half(), [torch.randn(3, 8).half()] * 5), ValueError,
     "1 to 4"),
    (lambda: hg.reference_linear_half_silu_mul(torch.randn(2, 8).half(), torch.randn(3, 8).half(),
                                               torch.randn(4, 8).half()), ValueError, "one shape"),
    (lambda: hg.reference_linear_half(torch.randn(2, 8).half(), torch.randn(3, 8).half(), None, None, 1e-5, 4),
     ValueError, "norm_mode=4"),
    (lambda: hg.reference_linear_half(torch.randn(2, 8).half(), torch.randn(3, 8).half(), None,
                                      torch.ones(7).half(), 1e-5, 1), ValueError, "K = 8"),
    (lambda: hg.reference_linear_half(torch.randn(2, 8).half(), torch.randn(3, 8).half(), None,
                                      torch.ones(8).half(), 1e-5, 3), ValueError, "takes no norm_weight"),
])
def test_bad_arguments_are_named(call, kind, words):
    with pytest.raises(kind, match=words):
        call()


def test_plans_read_16_kib_tiles_of_32_rows_and_cover_k():
    """The measured default (session 36): 32 rows by 256 columns, 16 KiB of bf16, for single weights and pairs."""
    one = hg.half_plan(1, 2048, 2048)
    pair = hg.half_plan(1, 2048, 2048, pair=True)
    assert (one["BLOCK_N"], one["BLOCK_K"]) == (32, 256) and one["BLOCK_N"] * one["BLOCK_K"] * 2 == 16384
    assert (pair["BLOCK_N"], pair["BLOCK_K"]) == (32, 256)
    for m, n, k in itertools.product((1, 4, 8), (64, 3072), (64, 8192)):
        p = hg.half_plan(m, n, k)
        assert p["SPLIT_K"] * p["K_ITERS"] * p["BLOCK_K"] >= k
    assert hg.half_plan(1, 64, 64, block_n=128, block_k=64)["BLOCK_N"] == 128


def test_rmsnorm_prologue_builds_for_sm90_without_a_loop():
    """The prologue's x loads are unrolled (all in flight at once): built for sm_90 with NORM on, the kernel keeps
    one loop, its K loop. Its first version looped over x in front of every program's K loop (a dependent L2 round
    trip per chunk), and with it a Llama-1B step ran at 0.88x Inductor's on an H100."""
    from interp_harness import sm90_ttir

    ptrs = {n: "bf16" for n in ("x_ptr", "w0", "w1", "w2", "w3", "y0", "y1", "y2", "y3", "r_ptr", "nw_ptr")}
    ptrs.update(part_ptr="fp32", cnt_ptr="i32")
    consts = dict(COUNT=2, PAIR=True, RESIDUAL=False, SPLIT_K=1, SPLIT_POW2=1, K_ITERS=4, BLOCK_M=1, BLOCK_N=64,
                  BLOCK_K=64, L2_PREFETCH=True, USE_PDL=True, EARLY_LAUNCH=0, STAGES=1)
    loops = {}
    for norm in (0, 1):
        ttir = sm90_ttir(hg._half_gemv_kernel, ptrs, dict(consts, NORM=norm, KP=4096 if norm else 1),
                         scalar_types={"eps": "fp32"})
        loops[norm] = ttir.count("scf.for")
    assert loops == {0: 1, 1: 1}


@pytest.mark.parametrize("bad", [dict(early_launch=3), dict(early_launch=-1), dict(early_launch="1"),
                                 dict(stages=0), dict(stages=7), dict(stages=2.5)])
def test_pdl_prologue_and_pipeline_overrides_are_checked(bad):
    """A sweep knob outside its range is refused by name before any launch, not passed to the compiler."""
    x = torch.randn(1, 64).bfloat16()
    w = torch.randn(32, 64).bfloat16()
    with pytest.raises(ValueError, match=next(iter(bad))):
        hg.triton_linear_half(x, w, **bad)


@interpreted
@pytest.mark.parametrize("over", [dict(early_launch=1, l2_prefetch=False), dict(early_launch=2),
                                  dict(stages=3, k_iters=4, block_k=32)])
def test_overrides_keep_the_numbers(over, nan_outputs):
    """Every knob only moves launches and loads: the product equals the float64 GEMV within bf16 rounding."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=gen).bfloat16()
    w = (torch.randn(96, 256, generator=gen) / 16).bfloat16()
    want = (x.double() @ w.double().T)
    got = hg.triton_linear_half(x, w, **over).double()
    assert torch.allclose(got, want, rtol=2 ** -7, atol=1e-3), (got - want).abs().max()
