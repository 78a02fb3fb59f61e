"""The `half_gemv` family on bf16 / fp16 decoder code written several ways (CPU, real backend).

Each spelling below is a small module in the style of a different code base: gpt-fast (`F.silu(w1(x)) * w3(x)`,
one fused wqkv), transformers (`act_fn(gate_proj(x)) * up_proj(x)` with `nn.SiLU`, separate q/k/v), a paper
transcription (`x @ W.T`, `g * torch.sigmoid(g)`). What the family must do to each is stated as the op counts the
graph ends with; the compiled output is compared with eager on the same inputs (the CPU ops are the eager
spellings, so only Inductor's own fusions of the other ops can differ: a bf16 rounding or two).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dsv41.passes.testing import ops_after, run_family

torch.manual_seed(0)


class GptFastBlockTail(nn.Module):
    """wqkv as one projection, wo + residual, SwiGLU FFN + residual (gpt-fast's TransformerBlock shape)."""

    def __init__(self, d=64, ffn=96):
        super().__init__()
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.w1 = nn.Linear(d, ffn, bias=False)
        self.w3 = nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        q, k, v = self.wqkv(x).split(x.shape[-1], dim=-1)
        h = x + self.wo(q * k.sigmoid() + v)
        return h + self.w2(F.silu(self.w1(h)) * self.w3(h))


class HfStyleMlpAttn(nn.Module):
    """Separate q/k/v/o and gate/up/down projections, `nn.SiLU` as act_fn (transformers' LlamaMLP spelling)."""

    def __init__(self, d=64, kv=32, ffn=80):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden):
        q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        mixed = q * torch.cat([k, v], dim=-1).tanh()
        hidden = hidden + self.o_proj(mixed)
        return hidden + self.down_proj(self.act_fn(self.gate_proj(hidden)) * self.up_proj(hidden))


class PaperSpelling(nn.Module):
    """Bare parameters, `x @ W.T`, silu written as g * sigmoid(g) with the product's operands swapped."""

    def __init__(self, d=48, ffn=64):
        super().__init__()
        self.W_gate = nn.Parameter(torch.randn(ffn, d) / d ** 0.5)
        self.W_up = nn.Parameter(torch.randn(ffn, d) / d ** 0.5)
        self.W_down = nn.Parameter(torch.randn(d, ffn) / ffn ** 0.5)

    def forward(self, x):
        g = x @ self.W_gate.T
        u = x @ self.W_up.T
        return (u * (g * torch.sigmoid(g))) @ self.W_down.T


class NormedProjections(nn.Module):
    """An RMSNorm in front of q/k/v and of gate/up, in one of four spellings; the fused ops compute it themselves."""

    def __init__(self, spelling, d=64, eps=1e-5):
        super().__init__()
        self.spelling, self.eps = spelling, eps
        self.nw1 = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.nw2 = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.q, self.k, self.v = nn.Linear(d, d, bias=False), nn.Linear(d, 16, bias=False), nn.Linear(d, 16, bias=False)
        self.gate, self.up = nn.Linear(d, 96, bias=False), nn.Linear(d, 96, bias=False)

    def norm(self, x, w):
        if self.spelling == "gpt-fast":
            return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * w
        if self.spelling == "hf":
            h = x.to(torch.float32)
            var = h.pow(2).mean(-1, keepdim=True)
            return w * (h * torch.rsqrt(var + self.eps)).to(x.dtype)
        if self.spelling == "F.rms_norm":
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        if self.spelling == "eps-outside-sqrt":  # not an RMSNorm the ops compute: stays with Inductor
            h = x.float()
            return (h / (h.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)).type_as(x) * w
        raise ValueError(self.spelling)

    def forward(self, x):
        h = self.norm(x, self.nw1)
        mixed = self.q(h) + (self.k(h) * self.v(h)).repeat(1, 1, 4)
        x = x + mixed
        h2 = self.norm(x, self.nw2)
        return F.silu(self.gate(h2)) * self.up(h2)


@pytest.mark.parametrize("spelling, prologue", [("gpt-fast", True), ("hf", True), ("F.rms_norm", True),
                                                ("eps-outside-sqrt", False)])
def test_rmsnorm_in_front_becomes_the_prologue(spelling, prologue):
    torch.manual_seed(3)
    mod = NormedProjections(spelling).to(torch.bfloat16).eval()
    x = _x(64) * 0.01  # small rows: a wrong eps would show
    gm, rec = run_family("half_gemv", mod, (x,))
    counts = ops_after(gm)
    assert counts["dsv41.linear_half_multi"] == 1 and counts["dsv41.linear_half_silu_mul"] == 1
    assert (counts["aten.rsqrt"] + counts["aten.sqrt"] == 0) is prologue
    normed = [n for n in gm.graph.nodes if str(n.target).startswith("dsv41.linear_half") and n.args[-1] != 0]
    assert len(normed) == (3 if prologue else 0)  # q (whose add became its residual), k + v, gate + up
    if prologue:
        assert all(n.args[-2] == pytest.approx(1e-5, rel=1e-6) for n in normed)
    with torch.no_grad():
        want = mod(x).double()
        got = torch.compile(mod, backend="dsv41")(x).double()
    assert (got - want).abs().max().item() <= 4 * torch.finfo(torch.bfloat16).eps * want.abs().max().item()


class GeluLookAlike(nn.Module):
    """GeGLU, not SwiGLU: the product must not become linear_half_silu_mul."""

    def __init__(self, d=48, ffn=64):
        super().__init__()
        self.a = nn.Linear(d, ffn, bias=False)
        self.b = nn.Linear(d, ffn, bias=False)

    def forward(self, x):
        return F.gelu(self.a(x)) * self.b(x)


class Biased(nn.Module):
    """A bias the op cannot take: scaled by addmm's beta (a plain `nn.Linear` bias is fused)."""

    def __init__(self, d=48):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=True)

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        return torch.addmm(self.proj.bias, x2, self.proj.weight.t(), beta=0.5).reshape(*x.shape[:-1], -1)


class PlainBiased(nn.Module):
    def __init__(self, d=48):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=True)

    def forward(self, x):
        return self.proj(x)


class ComputedWeight(nn.Module):
    """The weight is made inside the step (a LoRA-style merge): it may not be read before the PDL wait."""

    def __init__(self, d=48):
        super().__init__()
        self.base = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.delta = nn.Parameter(torch.randn(d, d) * 1e-2)

    def forward(self, x):
        return F.linear(x, self.base + self.delta)


def _x(d, rows=1, dtype=torch.bfloat16, seed=1):
    return torch.randn(1, rows, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


# (module factory, d, dtype, rows, {op: count after}, matches)
CASES = {
    "gpt-fast": (GptFastBlockTail, 64, torch.bfloat16, 1,
                 {"dsv41.linear_half_silu_mul": 1, "dsv41.linear_half": 3, "dsv41.linear_half_multi": 0,
                  "aten.mm": 0}, 4),
    "hf-style": (HfStyleMlpAttn, 64, torch.bfloat16, 1,
                 {"dsv41.linear_half_silu_mul": 1, "dsv41.linear_half_multi": 1, "dsv41.linear_half": 2,
                  "aten.mm": 0}, 4),
    "paper-fp16-verify-rows": (PaperSpelling, 48, torch.float16, 6,
                               {"dsv41.linear_half_silu_mul": 1, "dsv41.linear_half": 1, "aten.mm": 0}, 2),
    "geglu": (GeluLookAlike, 48, torch.bfloat16, 1,
              {"dsv41.linear_half_silu_mul": 0, "dsv41.linear_half_multi": 1, "aten.mm": 0}, 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_spellings_fuse_as_declared_and_equal_eager(name):
    make, d, dtype, rows, want_ops, want_matches = CASES[name]
    torch.manual_seed(len(name))
    mod = make().to(dtype).eval()
    x = _x(d, rows, dtype)
    gm, rec = run_family("half_gemv", mod, (x,))
    counts = ops_after(gm)
    assert {op: counts[op] for op in want_ops} == want_ops
    assert rec.match_count == want_matches, [m.pattern for m in rec.matches]
    with torch.no_grad():
        want = mod(x).double()
        got = torch.compile(mod, backend="dsv41")(x).double()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 4 * torch.finfo(dtype).eps * scale


def test_a_plain_bias_is_fused_with_its_projection():
    mod = PlainBiased().to(torch.bfloat16).eval()
    with torch.no_grad():
        mod.proj.bias.normal_(0.0, 2.0)
    x = _x(48)
    gm, rec = run_family("half_gemv", mod, (x,))
    assert ops_after(gm, namespace="dsv41") == {"dsv41.linear_half.default": 1} and rec.match_count == 1
    with torch.no_grad():
        want = mod(x).double()
        got = torch.compile(mod, backend="dsv41")(x).double()
    assert (got - want).abs().max().item() <= 4 * torch.finfo(torch.bfloat16).eps * want.abs().max().item()


def test_prefill_rows_and_fp32_are_left_alone():
    mod = GptFastBlockTail().to(torch.bfloat16).eval()
    gm, rec = run_family("half_gemv", mod, (_x(64, rows=16),))
    assert ops_after(gm, namespace="dsv41") == {} and rec.match_count == 0 and not rec.near_misses
    gm, rec = run_family("half_gemv", GptFastBlockTail().eval(), (_x(64, dtype=torch.float32),))
    assert ops_after(gm, namespace="dsv41") == {} and rec.match_count == 0


@pytest.mark.parametrize("make, check", [(Biased, "bias"), (ComputedWeight, "weight_source")])
def test_look_alikes_are_reported_not_fused(make, check):
    mod = make().to(torch.bfloat16).eval()
    gm, rec = run_family("half_gemv", mod, (_x(48),))
    assert ops_after(gm, namespace="dsv41") == {}
    assert [m.check for m in rec.near_misses] == [check]


def test_swiglu_gate_is_told_from_up_by_probes():
    """Swapping which projection goes through silu changes which weight the fused op takes as the gate."""

    class Swapped(PaperSpelling):
        def forward(self, x):
            g = x @ self.W_up.T
            u = x @ self.W_gate.T
            return F.silu(g) * u

    mod = Swapped().to(torch.bfloat16).eval()
    x = _x(48)
    gm, _ = run_family("half_gemv", mod, (x,))
    assert ops_after(gm)["dsv41.linear_half_silu_mul"] == 1
    with torch.no_grad():
        want = mod(x).double()
        got = torch.compile(mod, backend="dsv41")(x).double()
        wrong = (F.silu(x @ mod.W_gate.T) * (x @ mod.W_up.T)).double()
    tol = 4 * torch.finfo(torch.bfloat16).eps * want.abs().max().item()
    assert (got - want).abs().max().item() <= tol < (wrong - want).abs().max().item()
