"""Reviewer's false-positive hunt: hand-written look-alikes that are NOT the fused ops' math.

Each look-alike below differs from the op it resembles only on values the passes' probe tensors never reach
(the passes verify a region by evaluating it on random probes, so a branch / clamp that is inactive on the
probes is invisible to them). A confirmed false positive is a test asserting the CORRECT behaviour (the chain is
left unfused, the compiled output equals eager) marked `xfail(strict=True)`; look-alikes the passes correctly
reject are plain passing tests (regression tests).

    moe zoo (one compile, FP32, B=2, T=3, d=32, E=8, k=2)
      router_clamp    logits.clamp(max=8) before sqrt(softplus)      probes: logits ~ N(0, 1.5) never reach 8
      router_denclamp w / w.sum(-1).clamp(min=0.5)                   probes: top-2 sums of sqrt(softplus) > 0.5
      tail_clamp      (y.sum(-2) + shared).clamp(-30, 30)            probes: N(0, 1) never reach 30
      router_tokaxis  weights normalised over the TOKEN axis         correctly rejected (near-miss, no site)
      router_twoscore selection on sqrt(softplus(l / 2)), weights from sqrt(softplus(l))
                                                                      correctly not matched
      router_epsplace (g + 1e-6) / (sum + 2e-6)                      tiny scores: weights differ (0.5 vs 3e-5)
    small_ops       positions / a buffer mutated in place (and through an aliasing view) between duplicate
                    step subgraphs                                    correctly kept apart (output == eager)
    c2_compressor   pair softmax spelled without the max subtraction  eager overflows to NaN, fused op does not
    dispatch zoo (one compile, FP32)
      gathered_clamp  FP4 experts whose UE8M0 exponent is clamped to [-11, 4] (bytes 116..131, the probe range)
      linear_clamp    the same clamp in a plain FP4 linear
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from zoo_sites import site_markers, site_of  # noqa: E402

SITES = site_markers(__file__)

D, E, K = 32, 8, 2
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _param(t):
    return nn.Parameter(t, requires_grad=False)


def _site_of(s):
    return site_of(s, __file__, SITES, fn=None, names_only=True)


def _close(a, b, rtol=1e-4):
    scale = max(float(b.double().abs().max()), 1e-30)
    return float((a.double() - b.double()).abs().max()) <= rtol * scale


# ------------------------------------------------------------------------------------------- moe zoo
class MoeLookalikes(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w_clamp = _param(torch.randn(E, D, generator=g) / math.sqrt(D))
        self.b_clamp = _param(torch.randn(E, generator=g) * 0.01)
        # All-negative gate so that every logit of a positive x is strongly negative (tiny scores).
        self.w_den = _param(-(torch.rand(E, D, generator=g) + 0.5))
        self.b_den = _param(torch.randn(E, generator=g) * 0.01)
        self.w_tok = _param(torch.randn(E, D, generator=g) / math.sqrt(D))
        self.b_tok = _param(torch.randn(E, generator=g) * 0.01)
        self.w_two = _param(torch.randn(E, D, generator=g) / math.sqrt(D))
        self.b_two = _param(torch.randn(E, generator=g) * 0.01)
        self.wv = _param(torch.randn(D, D, generator=g) / math.sqrt(D))
        self.w_eps = _param(-(torch.rand(E, D, generator=g) + 0.5))
        self.b_eps = _param(torch.randn(E, generator=g) * 0.01)

    def forward(self, x, xpos, shared):
        # router_clamp: clamped logits (a "numerically safe" gate) -> different scores once |logit| > 8
        l1 = torch.matmul(x, self.w_clamp.t()).clamp(max=8.0)
        s1 = torch.sqrt(F.softplus(l1))
        i1 = torch.topk(s1 + self.b_clamp, K, dim=-1).indices  # site:router_clamp
        g1 = torch.gather(s1, -1, i1)
        w1 = g1 / (g1.sum(-1, keepdim=True) + 1e-20)

        # router_denclamp: the normaliser is floored at 0.5
        l2 = torch.matmul(xpos, self.w_den.t())
        s2 = torch.sqrt(F.softplus(l2))
        i2 = torch.topk(s2 + self.b_den, K, dim=-1).indices  # site:router_denclamp
        g2 = torch.gather(s2, -1, i2)
        w2 = g2 / g2.sum(-1, keepdim=True).clamp(min=0.5)

        # tail_clamp: expert sum + shared, clamped to [-30, 30]
        v = torch.matmul(x, self.wv.t())
        y = w1.unsqueeze(-1) * v.unsqueeze(-2)
        out = (y.sum(-2) + shared).clamp(-30.0, 30.0)  # site:tail_clamp

        # router_tokaxis: weights normalised over the token axis instead of the k axis
        l3 = torch.matmul(x, self.w_tok.t())
        s3 = torch.sqrt(F.softplus(l3))
        i3 = torch.topk(s3 + self.b_tok, K, dim=-1).indices  # site:router_tokaxis
        g3 = torch.gather(s3, -1, i3)
        w3 = g3 / (g3.sum(1, keepdim=True) + 1e-20)

        # router_twoscore: the selection uses a tempered score, the weights an untempered one
        l4 = torch.matmul(x, self.w_two.t())
        sel = torch.sqrt(F.softplus(l4 * 0.5)) + self.b_two
        i4 = torch.topk(sel, K, dim=-1).indices  # site:router_twoscore
        g4 = torch.gather(torch.sqrt(F.softplus(l4)), -1, i4)
        w4 = g4 / (g4.sum(-1, keepdim=True) + 1e-20)

        # router_epsplace: the eps smooths numerator AND denominator ((g + eps) / (sum + k eps))
        l5 = torch.matmul(xpos, self.w_eps.t())
        s5 = torch.sqrt(F.softplus(l5))
        i5 = torch.topk(s5 + self.b_eps, K, dim=-1).indices  # site:router_epsplace
        g5 = torch.gather(s5, -1, i5)
        w5 = (g5 + 1e-6) / (g5.sum(-1, keepdim=True) + 2e-6)
        return w1, i1, w2, i2, out, w3, i3, w4, i4, w5, i5


def _moe_inputs():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, D, generator=g) * 20.0           # logits ~ N(0, 20): the clamp at 8 is active
    xpos = torch.rand(2, 3, D, generator=g) + 1.0          # with w_den < 0: logits ~ -30, scores ~ 1e-7
    shared = torch.randn(2, 3, D, generator=g) * 100.0     # the clamp at 30 is active
    return x, xpos, shared


@pytest.fixture(scope="module")
def moe_zoo():
    import dsv41

    model = MoeLookalikes().eval()
    inputs = _moe_inputs()
    with torch.no_grad():
        eager = model(*inputs)
        torch._dynamo.reset()
        out = torch.compile(model, backend="dsv41", options={"debug": True}, dynamic=False)(*inputs)
    fam = dsv41.last_report().to_dict()["families"]["moe"]
    sites = [_site_of(s) for s in fam["sites"]]
    misses = {_site_of(m): m for m in fam["near_misses"]}
    return eager, out, sites, misses


def test_router_with_clamped_logits_is_not_fused(moe_zoo):
    # Was a false positive; moe now also probes large logits, tiny scores and x1000 tails.
    eager, out, sites, misses = moe_zoo
    assert "router_clamp" in misses, sorted(misses)
    assert "router_clamp" not in sites
    assert torch.equal(out[1], eager[1]) and _close(out[0], eager[0])


def test_router_with_floored_normaliser_is_not_fused(moe_zoo):
    # Was a false positive; moe now also probes large logits, tiny scores and x1000 tails.
    eager, out, sites, misses = moe_zoo
    assert "router_denclamp" in misses, sorted(misses)
    assert "router_denclamp" not in sites
    assert _close(out[2], eager[2])


def test_tail_with_clamp_keeps_the_clamp(moe_zoo):
    # Was a false positive (the clamp was fused away). With x1000 probes the clamped region no longer verifies;
    # the sum + shared below it may still fuse, the clamp then stays a separate op: the output equals eager.
    eager, out, sites, misses = moe_zoo
    assert "tail_clamp" in sites or "tail_clamp" in misses
    assert _close(out[4], eager[4])


def test_router_with_eps_in_numerator_is_not_fused(moe_zoo):
    # Was a false positive; moe now also probes large logits, tiny scores and x1000 tails.
    eager, out, sites, misses = moe_zoo
    assert "router_epsplace" in misses, sorted(misses)
    assert "router_epsplace" not in sites
    assert _close(out[9], eager[9])


def test_router_normalised_over_tokens_is_rejected(moe_zoo):
    eager, out, sites, misses = moe_zoo
    assert "router_tokaxis" not in sites
    assert "router_tokaxis" in misses
    assert torch.equal(out[6], eager[6]) and _close(out[5], eager[5])


def test_router_with_two_scores_is_not_fused(moe_zoo):
    eager, out, sites, _ = moe_zoo
    assert "router_twoscore" not in sites
    assert torch.equal(out[8], eager[8]) and _close(out[7], eager[7])


# ------------------------------------------------------------------------------------------- dispatch zoo
def quantize_fp4(w: torch.Tensor):
    """[.., out, K] -> packed E2M1 [.., out, K/2], UE8M0 exponents [.., out, K/32] (the test's own quantiser)."""
    *lead, n, k = w.shape
    wb = w.reshape(*lead, n, k // 32, 32)
    ex = (torch.ceil(torch.log2(wb.abs().amax(-1).clamp(min=1e-30) / 6)) + 127).to(torch.uint8)
    q = wb / torch.pow(2.0, ex.double() - 127).float()[..., None]
    codes = (q.abs()[..., None] - torch.tensor(E2M1)).abs().argmin(-1) | ((q < 0).long() << 3)
    codes = codes.reshape(*lead, n, k).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), ex


def clamped_decode(packed, exps, dtype):
    """E2M1 nibbles times 2^clamp(e - 127, -11, 4): the exponent clamp covers exactly bytes 116..131."""
    nib = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).long()
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    vals = torch.where(nib >= 8, -lut[nib & 7], lut[nib & 7])
    s = torch.exp2((exps.float() - 127).clamp(-11.0, 4.0))
    return (vals.unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2).to(dtype)


class DispatchLookalikes(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        # Large weights: exponent bytes ~ 134..136, outside the clamp (and the probes' 116..131).
        self.ec, self.es = map(_param, quantize_fp4(torch.randn(8, 48, 64, generator=g) * 300.0))
        self.lc, self.ls = map(_param, quantize_fp4(torch.randn(48, 64, generator=g) * 300.0))

    def forward(self, x, idx):
        w = clamped_decode(self.ec[idx], self.es[idx], x.dtype)
        g = torch.einsum("nd,nkfd->nkf", x, w)  # site:gathered_clamp
        lin = F.linear(x, clamped_decode(self.lc, self.ls, x.dtype))  # site:linear_clamp
        return g, lin


@pytest.fixture(scope="module")
def dispatch_zoo():
    import dsv41

    model = DispatchLookalikes().eval()
    assert int(model.es.min()) > 131 and int(model.ls.min()) > 131
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 64, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(3)])
    with torch.no_grad():
        eager = model(x, idx)
        torch._dynamo.reset()
        out = torch.compile(model, backend="dsv41", options={"debug": True}, dynamic=False)(x, idx)
    fam = dsv41.last_report().to_dict()["families"]["dispatch"]
    return eager, out, [_site_of(s) for s in fam["sites"]], {_site_of(m): m for m in fam["near_misses"]}


def test_gathered_experts_with_clamped_exponent_are_not_fused(dispatch_zoo):
    # Was a false positive (probe scale bytes 116..131 only); dispatch now also probes bytes 1..254.
    eager, out, sites, misses = dispatch_zoo
    assert "gathered_clamp" not in sites
    assert misses["gathered_clamp"]["check"] == "scale_range"
    assert _close(out[0], eager[0])


def test_fp4_linear_with_clamped_exponent_is_not_fused(dispatch_zoo):
    # Was a false positive (probe scale bytes 116..131 only); dispatch now also probes bytes 1..254.
    eager, out, sites, misses = dispatch_zoo
    assert "linear_clamp" not in sites
    assert misses["linear_clamp"]["check"] == "scale_range"
    assert _close(out[1], eager[1])


# ------------------------------------------------------------------------------------------- c2_compressor zoo
CB, CT, CD, CDM, CR, CROWS = 2, 3, 64, 48, 16, 6


def _c2_norm(u, w, eps=1e-6):
    uf = u.float()
    return (uf * torch.rsqrt(torch.mean(uf ** 2, dim=-1, keepdim=True) + eps) * w.float()).to(u.dtype)


def _c2_rope(x, freqs):
    pc = torch.view_as_complex(x[..., -CR:].float().reshape(*x.shape[:-1], CR // 2, 2))
    rot = torch.view_as_real(pc * freqs).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-CR], rot), dim=-1)


class C2NoMaxPool(nn.Module):
    """Ratio-2 compressor whose pair softmax is spelled WITHOUT the max subtraction: exp(g) overflows to inf for
    logits > 88 (eager: inf / inf = NaN), while the fused op's pooling subtracts the max (finite)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.wk = _param(torch.randn(CD, CDM, generator=gen) * 0.2)
        self.wg = _param(torch.randn(CD, CDM, generator=gen) * 0.2)
        self.nw = _param(0.5 + torch.rand(CD, generator=gen))
        self.register_buffer("c", torch.zeros(CB, CROWS + 1, CD // 2, dtype=torch.uint8))
        self.register_buffer("cs", torch.zeros(CB, CROWS + 1, CD // 16, dtype=torch.uint8))
        self.register_buffer("sk", torch.randn(CB, CD, generator=gen))
        self.register_buffer("sg", torch.randn(CB, CD, generator=gen))

    def forward(self, x, freqs, rows):
        from dsv41.model import formats
        k = F.linear(x, self.wk)
        g = F.linear(x, self.wg)
        pk = torch.cat((self.sk[:, None], k[:, :-1]), dim=1)
        pg = torch.cat((self.sg[:, None], g[:, :-1]), dim=1)
        a, b = pg.exp(), g.exp()
        z = (a * pk + b * k) / (a + b)  # site:c2_nomax
        lat = _c2_norm(z, self.nw)
        codes, scales = formats.quantize_fp4_e4m3_1x16(_c2_rope(lat, freqs))
        bi = torch.arange(CB)[:, None].expand_as(rows)
        self.c[bi, rows] = codes
        self.cs[bi, rows] = scales
        return lat


@pytest.fixture(scope="module")
def c2_zoo():
    import dsv41

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(CB, CT, CDM, generator=gen) * 60.0   # logits ~ N(0, 80): exp overflows in FP32
    ang = torch.rand(CB, CT, CR // 2, generator=gen, dtype=torch.float64) * 6
    freqs = torch.polar(torch.ones_like(ang), ang).to(torch.complex64)
    rows = torch.tensor([[0, 5, 2], [1, 3, 4]])
    eager, comp = C2NoMaxPool(), C2NoMaxPool()
    with torch.no_grad():
        ref = eager(x, freqs, rows)
        torch._dynamo.reset()
        out = torch.compile(comp, backend="dsv41", options={"debug": True}, dynamic=False)(x, freqs, rows)
    fam = dsv41.last_report().to_dict()["families"]["c2_compressor"]
    return ref, out, fam


def test_pair_pool_without_max_subtraction_is_not_fused(c2_zoo):
    ref, out, fam = c2_zoo
    assert torch.isnan(ref).any()  # the test input does overflow eager's spelling
    assert not any(s["pattern"].startswith("c2_pool") for s in fam["sites"])
    assert torch.equal(torch.isnan(out), torch.isnan(ref))


# ------------------------------------------------------------------------------------------- small_ops zoo
class SmallOpsMutations(nn.Module):
    """Two "layers" deriving the same step values from positions, with the positions / a start-offset buffer
    mutated in place between them (eager: the second layer sees the new values), plus an aliasing view write."""

    def __init__(self):
        super().__init__()
        self.register_buffer("start", torch.tensor([3], dtype=torch.int64))

    def layer(self, pos, x):
        p = pos + self.start
        ring = torch.remainder(p, 16)
        kpos = torch.arange(16)
        ok = (kpos[None, None, :] >= 0) & (kpos[None, None, :] <= p[..., None]) & (kpos[None, None, :] > p[..., None] - 16)
        cos = torch.cos(p.float()[..., None] * 0.1)
        return x * cos + ok.float().sum(-1, keepdim=True) + ring[..., None].float()

    def forward(self, pos, x):
        a = self.layer(pos, x)               # site:small_first
        pos.add_(5)                           # mutate the positions between the two layers
        b = self.layer(pos, x)               # site:small_second
        self.start.copy_(self.start * 2)      # mutate the buffer the step values read
        c = self.layer(pos, x)               # site:small_third
        pos.view(-1)[:2] = 0                  # write through an aliasing view
        d = self.layer(pos, x)               # site:small_fourth
        e = self.layer(pos, x)               # a true duplicate of d (may be shared)
        return a, b, c, d, e


def test_small_ops_does_not_share_across_in_place_mutations():
    import dsv41

    gen = torch.Generator().manual_seed(4)
    pos = torch.randint(0, 40, (2, 3), generator=gen)
    x = torch.randn(2, 3, 8, generator=gen)
    eager_m, comp_m = SmallOpsMutations(), SmallOpsMutations()
    pe, pc = pos.clone(), pos.clone()
    with torch.no_grad():
        ref = eager_m(pe, x)
        torch._dynamo.reset()
        out = torch.compile(comp_m, backend="dsv41", options={"debug": True}, dynamic=False)(pc, x)
    fam = dsv41.last_report().to_dict()["families"]["small_ops"]
    for r, o in zip(ref, out):
        assert _close(o, r, 1e-6)
    assert torch.equal(pe, pc) and torch.equal(eager_m.start, comp_m.start)
    # small_ops does merge here (constant mask pieces), yet every merge must keep eager's values
    assert fam["sites"]


# ------------------------------------------------------------------------------------------- scale probes
def test_wide_scale_probes_cover_every_byte_and_expose_a_clamped_exponent():
    # The helper dispatch and engram use after their finite-range probe (bytes 116..131 / 112..140).
    from dsv41.passes.engine import agree_where_representable, wide_scale_probes

    scale = torch.zeros(4, 10, dtype=torch.uint8)  # 40 entries: 7 probes to hold all 254 bytes
    probes = wide_scale_probes(scale)
    assert all(p.shape == scale.shape and p.dtype == torch.uint8 for p in probes)
    assert set(torch.cat([p.flatten() for p in probes]).tolist()) == set(range(1, 255))
    codes = torch.linspace(-6, 6, 40).reshape(4, 10)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        hits = 0
        for p in probes:
            e = p.to(torch.int32) - 127
            ref = (codes * torch.exp2(e.double())).to(dtype)
            assert agree_where_representable(ref.clone(), ref)
            clamped = (codes * torch.exp2(e.clamp(-11, 4).double())).to(dtype)
            hits += not agree_where_representable(clamped, ref)
        assert hits > 0, dtype
