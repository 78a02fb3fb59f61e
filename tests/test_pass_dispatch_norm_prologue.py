"""An RMSNorm in front of a block-FP8 projection goes into the GEMV's prologue (`dispatch`, issue [decode] #37).

What a user writes: `proj(norm(h))`, where `norm` is any of the usual RMSNorm spellings and `proj` an FP8 block
linear that fake-quantises its input (DeepSeek's `act_quant` then an FP8 GEMM). The compiled graph should read h
once, in one launch: `dsv41::linear_fp8_block(h, W, S, True, norm_weight, eps, norm_mode)`, with no normalised copy
in between. Spellings here, none of them dsv41's own `RMSNorm` module:

    torch_rms      torch.nn.functional.rms_norm(h, (K,), w, eps)
    hf_style       h.float(); h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps); .to(dtype) * w   (two roundings)
    no_weight      h * rsqrt(mean(h * h) + eps) without a weight
    widened        the float32 form torch 2.11 leaves: fake_quant(norm_f32(h)).to(bf16), never rounded to bf16

and what must stay unfused: the normalised activation also returned to the caller (the norm's launch stays for that
reader), a clamp inside the norm (a piecewise op the probes may never reach), eps added outside the rsqrt.

References: float64 (`test_pass_dispatch`'s E4M3 grid and FP8 block decode), the norm written out here in float64
with the spelling's roundings; tolerance 2e-2 of the output's max magnitude (bfloat16 outputs), and the compiled
output against eager's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from dsv41.model.formats import fake_quant_fp8_1x32
from test_pass_dispatch import quantize_fp8_block_for_test, ref_dequant_fp8_block, ref_fake_quant_fp8_1x32

from dsv41.passes.testing import eager_and_compiled

T, K, N = 2, 128, 96
EPS = 1e-6
TOL = 2e-2
BF = torch.bfloat16


def _norm_f64(h, w, eps, round_twice: bool):
    """The RMSNorm in float64 statistics, rounded to bfloat16 as the spelling does (once, or before and after the
    weight)."""
    hd = h.double()
    y = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps)
    if w is None:
        return y.to(BF)
    if round_twice:
        return (y.to(BF).double() * w.double()).to(BF)
    return (y * w.double()).to(BF)


class Fp8Proj(nn.Module):
    """An FP8 block linear as checkpoints store it: E4M3 bytes + UE8M0 exponents per 32x32, input fake-quantised."""

    def __init__(self, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        codes, exps = quantize_fp8_block_for_test(torch.randn(N, K, generator=gen) / math.sqrt(K))
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.exps = nn.Parameter(exps, requires_grad=False)

    def weight(self):
        s = torch.exp2(self.exps.float() - 127).repeat_interleave(32, 0).repeat_interleave(32, 1)[:N, :K]
        return (self.codes.view(torch.float8_e4m3fn).float() * s).to(BF)

    def forward(self, x):
        return F.linear(fake_quant_fp8_1x32(x), self.weight())

    def ref(self, x64):
        return ref_fake_quant_fp8_1x32(x64) @ ref_dequant_fp8_block(self.codes, self.exps).T


class Spellings(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.w1 = nn.Parameter((1 + 0.2 * torch.randn(K, generator=gen)).to(BF), requires_grad=False)
        self.w2 = nn.Parameter((1 + 0.2 * torch.randn(K, generator=gen)).to(BF), requires_grad=False)
        self.w4 = nn.Parameter((1 + 0.2 * torch.randn(K, generator=gen)).to(BF), requires_grad=False)
        self.p1, self.p2, self.p3, self.p4 = Fp8Proj(1), Fp8Proj(2), Fp8Proj(3), Fp8Proj(4)

    def forward(self, h1, h2, h3, h4):
        a = self.p1(F.rms_norm(h1, (K,), self.w1, EPS))
        hf = h2.float()
        b = self.p2((hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(BF) * self.w2)
        c = self.p3((h3.float() * torch.rsqrt((h3.float() * h3.float()).mean(-1, keepdim=True) + EPS)).to(BF))
        h4f = h4.float()
        n4 = h4f * torch.rsqrt(h4f.pow(2).mean(-1, keepdim=True) + EPS) * self.w4.float()
        d = F.linear(fake_quant_fp8_1x32(n4).to(BF), self.p4.weight())
        return a, b, c, d


class Refused(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(8)
        self.w = nn.Parameter((1 + 0.2 * torch.randn(K, generator=gen)).to(BF), requires_grad=False)
        self.p1, self.p2, self.p3 = Fp8Proj(5), Fp8Proj(6), Fp8Proj(7)

    def _norm(self, h, clamp=None, eps_outside=False):
        hf = h.float()
        ms = hf.pow(2).mean(-1, keepdim=True)
        r = torch.rsqrt(ms) + EPS if eps_outside else torch.rsqrt(ms + EPS)
        y = hf * r
        if clamp is not None:
            y = y.clamp(-clamp, clamp)
        return (y * self.w.float()).to(BF)

    def forward(self, h1, h2, h3):
        shared = self._norm(h1)
        return self.p1(shared), shared, self.p2(self._norm(h2, clamp=2.5)), self.p3(self._norm(h3, eps_outside=True))


def _acts(n, seed):
    gen = torch.Generator().manual_seed(seed)
    # rows at very different magnitudes, so the statistic (and eps at the small one) matters
    return [(torch.randn(T, K, generator=gen) * torch.tensor([[3.0], [2e-3]])).to(BF) for _ in range(n)]


def _compile(model, inputs):
    import dsv41

    eager, out, graphs = eager_and_compiled(model, inputs, {"debug": True})
    return eager, out, dsv41.last_report(), graphs


@pytest.fixture(scope="module")
def spellings():
    model = Spellings().eval()
    inputs = _acts(4, 11)
    return model, inputs, *_compile(model, inputs)


@pytest.fixture(scope="module")
def refused():
    model = Refused().eval()
    inputs = _acts(3, 12)
    return model, inputs, *_compile(model, inputs)


def _close(a, b):
    return float((a.double() - b.double()).abs().max()) <= TOL * float(b.double().abs().max())


def _norm_sites(report):
    sites = report.to_dict()["families"]["dispatch"]["sites"]
    return [s for s in sites if "rms_norm" in s["pattern"]]


def _prologue_ops(graphs):
    return [n for gm in graphs for n in gm.graph.nodes
            if n.target == torch.ops.dsv41.linear_fp8_block.default and len(n.args) > 4 and n.args[6]]


def test_every_spelling_is_read_once_by_the_gemv(spellings):
    *_, report, graphs = spellings
    sites = _norm_sites(report)
    assert len(sites) == 4, [s["pattern"] for s in report.to_dict()["families"]["dispatch"]["sites"]]
    modes = sorted(dict(s["detail"])["rms_norm_mode"] for s in sites)
    # F.rms_norm and the one-rounding spelling are mode 2 or 1 as torch lowers them; no weight is 3; the float32 form
    # one of the unrounded modes
    assert modes[0] in (1, 2) and modes[1] in (1, 2) and modes[2] == 3 and modes[3] in (4, 5), modes
    ops = _prologue_ops(graphs)
    assert len(ops) == 4
    # each op reads the raw activation, a graph input, not a normalised copy
    for op in ops:
        src = op.args[0]
        while src.op == "call_function" and src.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default):
            src = src.args[0]
        assert src.op == "placeholder", op.format_node()
    for gm in graphs:
        assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.rsqrt.default), gm.code


def test_spellings_equal_eager_and_float64(spellings):
    model, (h1, h2, h3, h4), eager, out, *_ = spellings
    for a, b in zip(out, eager):
        assert a.dtype == b.dtype == BF and a.shape == b.shape
        assert _close(a, b)
    assert _close(out[0], model.p1.ref(_norm_f64(h1, model.w1, EPS, False).double()))
    assert _close(out[1], model.p2.ref(_norm_f64(h2, model.w2, EPS, True).double()))
    assert _close(out[2], model.p3.ref(_norm_f64(h3, None, EPS, False).double()))
    h4d = h4.double()
    n4 = h4d * torch.rsqrt(h4d.pow(2).mean(-1, keepdim=True) + EPS) * model.w4.double()
    assert _close(out[3], model.p4.ref(n4))


def test_refused_norms_stay_unfused_and_equal_eager(refused):
    model, inputs, eager, out, report, graphs = refused
    assert _norm_sites(report) == []
    assert _prologue_ops(graphs) == []
    for a, b in zip(out, eager):
        assert a.shape == b.shape and _close(a, b)


@pytest.mark.parametrize("mode", range(1, 7))
def test_op_reference_follows_the_spelling(mode):
    """The op on CPU (its reference) against the float64 spelling written here."""
    gen = torch.Generator().manual_seed(mode)
    h = _acts(1, mode)[0]
    w = (1 + 0.2 * torch.randn(K, generator=gen)).to(BF) if mode not in (3, 6) else None
    proj = Fp8Proj(mode)
    got = torch.ops.dsv41.linear_fp8_block(h, proj.codes, proj.exps, True, w, EPS, mode)
    hd = h.double()
    y = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS)
    if mode in (1, 4):
        y = y.to(BF).double() * w.double()
    elif mode in (2, 5):
        y = y * w.double()
    if mode <= 3:
        y = y.to(BF).double()
    assert got.dtype == BF and _close(got, proj.ref(y))


@pytest.mark.parametrize("bad, match", [
    (dict(act_quant=False), "needs act_quant"),
    (dict(norm_mode=7), "norm_mode=7"),
    (dict(norm_mode=3), "takes no norm_weight"),
    (dict(eps=-1.0), "eps=-1.0"),
    (dict(norm_weight=torch.ones(K + 32, dtype=BF)), "does not match K"),
])
def test_bad_prologue_arguments_are_named(bad, match):
    proj = Fp8Proj(0)
    args = dict(act_quant=True, norm_weight=torch.ones(K, dtype=BF), eps=EPS, norm_mode=2)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        torch.ops.dsv41.linear_fp8_block(_acts(1, 0)[0], proj.codes, proj.exps, args["act_quant"],
                                         args["norm_weight"], args["eps"], args["norm_mode"])


def test_gate_on_cuda_and_the_option_that_lifts_it_alone(monkeypatch):
    """Gated on CUDA (as the prologue was until its kernels ran on an H100 in session 35; simulated here: the options
    are asked for CUDA's gate set, with the variant put back into it), the prologue stays off;
    `gpu_unvalidated=["linear_fp8_block(rms_norm)"]` lifts that gate and no other."""
    from dsv41.compiler.options import Options, parse_options
    from dsv41.passes import manager
    from dsv41.passes.dispatch import NORM_VARIANT

    monkeypatch.setattr(manager, "GPU_UNVALIDATED_OPS", (NORM_VARIANT, "sparse_fp4_attention(rope_q)"))
    real = Options.gated_ops
    monkeypatch.setattr(Options, "gated_ops", lambda self, on_cuda: real(self, True))
    opts = parse_options({"gpu_unvalidated": [NORM_VARIANT]}, environ={})
    assert opts.gated_ops(True) == {"sparse_fp4_attention(rope_q)"}
    assert parse_options({}, environ={}).gated_ops(True) == {NORM_VARIANT, "sparse_fp4_attention(rope_q)"}
    model, inputs = Spellings().eval(), _acts(4, 13)
    import dsv41
    for option, want in (({}, 0), ({"gpu_unvalidated": ["linear_fp8_block(rms_norm)"]}, 4)):
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(model, backend="dsv41", dynamic=False, options=option)(*inputs)
        assert len(_norm_sites(dsv41.last_report())) == want, option
        for a, b in zip(out, model(*inputs)):
            assert _close(a, b)


@pytest.mark.parametrize("value, error, match", [
    (["no_such_op"], ValueError, "unknown families / ops"),
    ("linear_fp8_block(rms_norm)", TypeError, "bool or a list of names"),
    ([3], TypeError, "bool or a list of names"),
])
def test_gpu_unvalidated_names_are_checked(value, error, match):
    from dsv41.compiler.options import parse_options
    with pytest.raises(error, match=match):
        parse_options({"gpu_unvalidated": value}, environ={})
