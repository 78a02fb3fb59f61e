"""Review (session 35) of the RMSNorm prologue of `dsv41::linear_fp8_block` (`dispatch`, [decode] #37).

Adversarial eager modules: each row of `CASES` is a forward `fn(module, h)` over a tiny model (one norm weight
`w`, two block-FP8 projections `p` / `q`), an input shape / dtype and whether the norm must be taken into the GEMV
(True), must stay out (False) or may go either way (None). Every case is compiled with backend="dsv41" and compared
with eager (same shape, 2e-2 of eager's max magnitude). `ROW_VIEWS` failed before the review's fix: a view that picks
or repeats rows of the normalised tensor (last token, a slice, an expand) sits between the norm and the quantiser.
Kernel rows (`KERNEL_CASES`) run the Triton GEMV under TRITON_INTERPRET=1 against `reference_linear_fp8_block` at
odd inputs (zero rows, eps 0, NaN / inf, M > 8, strided x), NaN positions included.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from dsv41.model.formats import fake_quant_fp8_1x32
from interp_harness import InterpreterHarness
from test_pass_dispatch import quantize_fp8_block_for_test
from test_pass_dispatch_norm_prologue import _norm_sites

BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6
_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture(autouse=True, scope="module")
def _own_inductor_cache(tmp_path_factory):
    """Compile into a fresh Inductor cache: its keys cover the passes' source, not their runtime state."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    yield
    mp.undo()


class Proj(nn.Module):
    """Block-FP8 linear [64, k] whose input is fake-quantised (eager: dequantise, F.linear in x's dtype)."""

    def __init__(self, k: int, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        codes, exps = quantize_fp8_block_for_test(torch.randn(64, k, generator=gen) / math.sqrt(k))
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.exps = nn.Parameter(exps, requires_grad=False)

    def weight(self, dtype):
        n, k = self.codes.shape
        s = torch.exp2(self.exps.float() - 127).repeat_interleave(32, 0).repeat_interleave(32, 1)[:n, :k]
        return (self.codes.view(torch.float8_e4m3fn).float() * s).to(dtype)

    def forward(self, x):
        return F.linear(fake_quant_fp8_1x32(x), self.weight(x.dtype))


class Net(nn.Module):
    def __init__(self, fn, k: int, dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(k)
        self.fn = fn
        self.w = nn.Parameter((1 + 0.2 * torch.randn(k, generator=gen)).to(dtype), requires_grad=False)
        self.rms = nn.RMSNorm(k, eps=None, dtype=dtype)
        with torch.no_grad():
            self.rms.weight.copy_(self.w)
        self.p, self.q = Proj(k, 1), Proj(k, 2)

    def forward(self, h, *extra):
        return self.fn(self, h, *extra)


def stat(h, eps=EPS, dim=-1):
    """float32 rsqrt(mean(h^2) + eps) over `dim`."""
    return torch.rsqrt(h.float().pow(2).mean(dim, keepdim=True) + eps)


def norm(s, h, eps=EPS):
    """The V4.1 spelling: float32 h * rstd * w, one rounding."""
    return (h.float() * stat(h, eps) * s.w.float()).to(h.dtype)


def hf(s, h):
    return (h.float() * stat(h)).to(h.dtype) * s.w


def mut_w(s, h):
    n = norm(s, h)
    s.w.mul_(-3.0)  # the weight changes after the norm read it
    return s.p(n)


def mut_h(s, h):
    n = norm(s, h)
    h.mul_(-2.0)
    return s.p(n)


# name: (fn, shape, dtype, fused?)
CASES = {
    # RMSNorm spellings, which should be taken
    "v41": (lambda s, h: s.p(norm(s, h)), (4, 128), BF, True),
    "hf_two_roundings": (lambda s, h: s.p(hf(s, h)), (4, 128), BF, True),
    "F_rms_norm_eps_none": (lambda s, h: s.p(F.rms_norm(h, (h.shape[-1],), s.w)), (4, 128), BF, True),
    "nn_RMSNorm_eps_none": (lambda s, h: s.p(s.rms(h)), (4, 128), BF, True),
    "fp32_activation": (lambda s, h: s.p(norm(s, h)), (3, 128), F32, True),
    "fp32_nn_RMSNorm": (lambda s, h: s.p(s.rms(h)), (3, 128), F32, True),
    "B2_T5_M10": (lambda s, h: s.p(hf(s, h)), (2, 5, 128), BF, True),
    "B3_T4_M12_F": (lambda s, h: s.p(F.rms_norm(h, (128,), s.w, 1e-5)), (3, 4, 128), BF, True),
    "K32": (lambda s, h: s.p(norm(s, h)), (3, 32), BF, True),
    "eps_zero": (lambda s, h: s.p(norm(s, h, 0.0)), (4, 128), BF, True),
    "h_also_residual": (lambda s, h: s.p(norm(s, h)) + h[..., :64], (4, 128), BF, True),
    "weight_float_clone": (lambda s, h: s.p((h.float() * stat(h) * s.w.float().clone()).to(BF)), (4, 128), BF, True),
    "shared_quantised_x": (lambda s, h: (lambda x: F.linear(x, s.p.weight(BF)) + F.linear(x, s.q.weight(BF)))(
        fake_quant_fp8_1x32(norm(s, h))), (4, 128), BF, True),
    "unsqueeze_flatten": (lambda s, h: s.p(norm(s, h).unsqueeze(0).flatten(0, 1)), (4, 128), BF, True),
    "mutate_w_in_forward": (mut_w, (4, 128), BF, None),
    "mutate_h_in_forward": (mut_h, (4, 128), BF, None),
    # rounding variants of rsqrt: may be taken only where they equal it
    "sqrt_then_reciprocal": (lambda s, h: s.p((h.float() * torch.reciprocal(torch.sqrt(
        h.float().pow(2).mean(-1, keepdim=True) + EPS)) * s.w.float()).to(BF)), (4, 128), BF, None),
    "div_sqrt": (lambda s, h: s.p((h.float() / torch.sqrt(h.float().pow(2).mean(-1, keepdim=True) + EPS)
                                   * s.w.float()).to(BF)), (4, 128), BF, None),
    # fp16: not taken today (a missed fusion, not wrong)
    "fp16_nn_RMSNorm": (lambda s, h: s.p(s.rms(h)), (3, 128), F16, None),
    # look-alikes that are not this RMSNorm
    "mean_over_dim0": (lambda s, h: s.p((h.float() * stat(h, dim=0) * s.w.float()).to(BF)), (4, 128), BF, False),
    "weight_added": (lambda s, h: s.p((h.float() * stat(h) + s.w.float()).to(BF)), (4, 128), BF, False),
    "eps_outside_1e-3": (lambda s, h: s.p((h.float() * (stat(h, 0.0) + 1e-3) * s.w.float()).to(BF)), (4, 128), BF,
                         False),
    "eps_big_inside": (lambda s, h: s.p(norm(s, h, 0.5)), (4, 128), BF, False),
    "layernorm_centred": (lambda s, h: s.p(norm(s, (h.float() - h.float().mean(-1, keepdim=True)).to(BF))),
                          (4, 128), BF, False),
    "gemma_one_plus_w": (lambda s, h: s.p((h.float() * stat(h) * (1 + s.w.float())).to(BF)), (4, 128), BF, False),
    "weight_times_two": (lambda s, h: s.p((h.float() * stat(h) * (s.w * 2).float()).to(BF)), (4, 128), BF, False),
    "stat_of_other_tensor": (lambda s, h: s.p((h.float() * stat(h * 1.5) * s.w.float()).to(BF)), (4, 128), BF, False),
    "two_half_norms": (lambda s, h: s.p(torch.cat([(h[:, :64].float() * stat(h[:, :64])).to(BF),
                                                   (h[:, 64:].float() * stat(h[:, 64:])).to(BF)], -1)),
                       (4, 128), BF, False),
    "scaled_after": (lambda s, h: s.p(norm(s, h) * 0.5), (4, 128), BF, False),
    "norm_read_twice": (lambda s, h: (lambda n: s.p(n) + s.q(n))(norm(s, h)), (4, 128), BF, False),
    "clamped_stat": (lambda s, h: s.p((h.float() * stat(h).clamp(max=50.0) * s.w.float()).to(BF)), (4, 128), BF,
                     False),
}

# Views that select or repeat rows of the normalised tensor before the quantiser.
ROW_VIEWS = {
    "last_token_3d": (lambda s, h: s.p(norm(s, h)[:, -1]), (2, 5, 128)),
    "last_row_2d_slice": (lambda s, h: s.p(norm(s, h)[-1:]), (4, 128)),
    "last_row_2d_select": (lambda s, h: s.p(norm(s, h)[-1]), (4, 128)),
    "token_slice_3d": (lambda s, h: s.p(norm(s, h)[:, 1:3]), (2, 5, 128)),
    "expand_batch": (lambda s, h: s.p(norm(s, h).expand(3, 5, 128)), (1, 5, 128)),
}


def _acts(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mags = torch.tensor([3.0, 2e-3, 40.0, 0.5, 7.0, 1e-2, 1.0, 9.0, 0.1, 2.0, 0.3, 5.0])
    rows = math.prod(shape[:-1])
    x = torch.randn(rows, shape[-1], generator=gen) * mags.repeat(rows)[:rows, None]
    return x.reshape(shape).to(dtype)


def _run(fn, shape, dtype, calls=1, dynamic=False, extra=()):
    """(eager outputs, compiled outputs, dispatch sites) over `calls` inputs; eager and compiled on separate copies."""
    import dsv41

    torch._dynamo.reset()
    eager_m = Net(fn, shape[-1], dtype).eval()
    comp_m = copy.deepcopy(eager_m)
    compiled = torch.compile(comp_m, backend="dsv41", dynamic=dynamic)
    eager, out = [], []
    with torch.no_grad():
        for i in range(calls):
            h = _acts(shape, dtype, seed=i) * (1 + 9 * i)
            args = [a(i) for a in extra]
            eager.append(eager_m(h.clone(), *args))
            out.append(compiled(h.clone(), *args))
    return eager, out, dsv41.last_report()


def _assert_same(eager, out):
    for e, o in zip(eager, out):
        assert o.shape == e.shape, (tuple(o.shape), tuple(e.shape))
        err, ref = float((o.double() - e.double()).abs().max()), float(e.double().abs().max())
        assert err <= 2e-2 * ref, (err, ref)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_equals_eager_and_fuses_only_rmsnorm(name):
    fn, shape, dtype, fused = CASES[name]
    eager, out, report = _run(fn, shape, dtype)
    _assert_same(eager, out)
    n = len(_norm_sites(report))
    if fused is True:
        assert n >= 1, [s["pattern"] for s in report.to_dict()["families"]["dispatch"]["sites"]]
    elif fused is False:
        assert n == 0, [s["pattern"] for s in report.to_dict()["families"]["dispatch"]["sites"]]


# Review finding (fixed): rms_prologue._producer stripped every view (select / slice / expand) between the
# quantiser's input and the norm, so the fused op read ALL rows of h (reshaped to [-1, K]): wrong shape ([10, 64] for
# [2, 64] on the last token), a reshape error at run time, or an Inductor AssertionError at compile time. It now looks
# through order-keeping views only, and x must have as many elements as the norm's output.
@pytest.mark.parametrize("name", list(ROW_VIEWS))
def test_row_view_between_norm_and_projection(name):
    fn, shape = ROW_VIEWS[name]
    eager, out, _ = _run(fn, shape, BF)
    _assert_same(eager, out)


def test_norm_weight_as_graph_input_changes_between_calls():
    eager, out, report = _run(lambda s, h, w: s.p(F.rms_norm(h, (128,), w, EPS)), (3, 128), BF, calls=3,
                              extra=[lambda i: ((1 + 0.5 * torch.randn(128)) * (i - 1.5)).to(BF)])
    _assert_same(eager, out)
    assert _norm_sites(report)


def test_parameter_mutated_between_calls():
    torch._dynamo.reset()
    m = Net(lambda s, h: s.p(norm(s, h)), 128, BF).eval()
    compiled = torch.compile(m, backend="dsv41")
    h = _acts((3, 128), BF)
    with torch.no_grad():
        _assert_same([m(h)], [compiled(h)])
        m.w.mul_(-2.5)
        _assert_same([m(h)], [compiled(h)])


@pytest.mark.parametrize("dynamic", [False, True])
def test_several_row_counts_one_compiled_model(dynamic):
    """M = 1, 3, 9 (above the Triton GEMV's 8) and 12, fed to one compiled model (recompiles or symbolic M)."""
    torch._dynamo.reset()
    m = Net(lambda s, h: s.p(hf(s, h)), 128, BF).eval()
    compiled = torch.compile(m, backend="dsv41", dynamic=dynamic)
    with torch.no_grad():
        for rows in (1, 3, 9, 12):
            h = _acts((rows, 128), BF, seed=rows)
            _assert_same([m(h)], [compiled(h)])


# ------------------------------------------------------------------------------------------- the kernel directly
def _kx(kind, m, k, dtype, gen):
    x = torch.randn(m, k, generator=gen)
    if kind == "zero_row":
        x[0] = 0
    elif kind == "nan":
        x[0, 5] = float("nan")
    elif kind == "inf":
        x[-1, 7] = float("inf")
    elif kind == "strided":
        return torch.randn(m, 2 * k, generator=gen).to(dtype)[:, ::2]
    elif kind == "tiny":
        x *= 1e-30
    return x.to(dtype)


KERNEL_CASES = [
    # (x kind, M, K, dtype, eps, mode, overrides)
    ("zero_row", 3, 256, BF, EPS, 2, {}),        # rstd = rsqrt(eps): a zero output row
    ("zero_row", 3, 256, BF, 0.0, 2, {}),        # 0 * inf: NaN, as the reference
    ("zero_row", 1, 256, BF, 0.0, 5, {"frag": True}),
    ("nan", 2, 256, BF, EPS, 1, {}),
    ("nan", 1, 256, BF, EPS, 2, {"frag": True}),
    ("inf", 3, 256, BF, EPS, 2, {}),
    ("tiny", 2, 256, F32, EPS, 2, {}),           # eps dominates the statistic
    ("plain", 9, 256, BF, EPS, 2, {}),           # more rows than one x tile
    ("plain", 2, 32, BF, EPS, 3, {}),            # K = 32: one quantiser block
    ("plain", 3, 320, F16, EPS, 1, {}),
    ("strided", 3, 256, BF, EPS, 4, {}),
    ("strided", 1, 256, BF, EPS, 5, {"frag": True}),
]


@interpreted
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[0]}-M{c[1]}-K{c[2]}-eps{c[4]}-m{c[5]}-{len(c[6])}")
def test_kernel_odd_inputs_match_reference(case):
    from dsv41.kernels import quant_gemv as qg
    kind, m, k, dtype, eps, mode, over = case
    gen = torch.Generator().manual_seed(m * 7 + k + mode)
    codes, exps = quantize_fp8_block_for_test(torch.randn(48, k, generator=gen) / k ** 0.5)
    x = _kx(kind, m, k, dtype, gen)
    nw = None if mode in (3, 6) else (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype)
    y = qg.triton_linear_fp8_block(x, codes, exps, True, nw, eps, mode, **over)
    want = qg.reference_linear_fp8_block(x, codes, exps, True, nw, eps, mode)
    assert y.shape == want.shape and y.dtype == want.dtype
    assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.isinf(), want.isinf())
    ok = want.isfinite()
    for r in range(m):
        if ok[r].any():
            err = float((y[r][ok[r]].double() - want[r][ok[r]].double()).abs().max())
            assert err <= 2e-2 * float(want[r][ok[r]].abs().max()) + 1e-30, (r, err)
