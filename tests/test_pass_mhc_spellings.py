"""`mhc` family, second spelling: RMS-normalise the flattened streams, then project (dsv41/passes/mhc_spellings.py).

dsv41's model computes the coefficients as "project, then scale" (`(z @ fn^T) * rsqrt(mean(z^2) + eps)`); another
DeepSeek-V4 implementation writes `F.linear(rms_norm(flatten(H)), fn)` with an optional learned RMS weight w [4d].
Both must become one `dsv41::mhc_mixes` (the weight as its `norm_weight`). The zoo below is written as that other
code base would (a class per concern, `F.rms_norm`, explicit Sinkhorn loop with a counter, `torch.matmul` by a
[4d, 24] weight in one site), compiled once (module fixture, debug mode), FP32 and bf16 residuals in one graph:

    rmsnorm_w  F.rms_norm(z, (4d,), w fp32, 1e-6), F.linear, 20 rounds      -> mhc_mixes(norm_eps=fp32(1e-6), w)
    rsqrt      z * rsqrt(mean(z^2) + 1e-5), no weight, H bf16, fn [4d, 24],   -> mhc_mixes(norm_eps=1e-5, iters=7)
               hc_eps 1e-3, 7 rounds
    div_bf16w  z / sqrt(mean(z^2) + 1e-20) * w bf16, 12 rounds               -> mhc_mixes(norm_eps=1e-20, w bf16)
    centred    mean-centred (LayerNorm-like) normalisation, then projection  -> near-miss rms_input
    biased     RMS norm with a weight AND a bias [4d], then projection       -> near-miss rms_input_leaves
    bf16_norm  F.rms_norm of the bf16 streams (result rounded to bf16), then   -> near-miss rms_input
               .float() and the projection
    w_after    no RMS weight before the projection, a [24] weight after it    -> near-miss coefficient_inputs

Reference: float64, vectorised here from MODEL.md §2.3 with the weight folded into the projection
(m = ((z * w) @ fn^T) * r); the CPU op runs under the compiled graph, so the compiled coefficients must equal it to
FP32 rounding: |got - ref| <= 2e-5 + 1e-4 |ref| (the tolerance of tests/test_pass_mhc.py). Look-alikes stay eager
and must equal the eager module (FP32 vs FP32 with Inductor's own reductions: 1e-5 abs + 1e-5 rel; bf16_norm 2^-8
abs, see the test).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("dsv41.kernels.mhc", reason="dsv41.kernels.mhc (the fused ops) is not importable")
import dsv41.kernels.mhc  # noqa: E402,F401
from zoo_sites import site_markers, site_of  # noqa: E402

from dsv41.passes.testing import capture_graphs, ops_after  # noqa: E402

SITES = site_markers(__file__)
DIM = 32
STREAMS = 4
WIDTH = STREAMS * DIM
RMS_EPS_F32 = float(torch.tensor(1e-6, dtype=torch.float32))  # what F.rms_norm puts in the graph for eps=1e-6
COEF_TOL = dict(rtol=1e-4, atol=2e-5)


# ------------------------------------------------------------------------------------------- float64 reference
def reference_mixes(H, fn, base, scale, norm_eps, hc_eps, iters, w=None):
    """float64 (pre, post, comb) of F.linear(rms_norm(flatten(H), w, norm_eps), fn) -> sigmoids -> Sinkhorn."""
    z = H.double().reshape(*H.shape[:2], -1)
    zn = z / torch.sqrt((z * z).mean(-1, keepdim=True) + norm_eps)
    if w is not None:
        zn = zn * w.double()
    f = fn.double() if fn.shape[0] == 24 else fn.double().t()
    m = torch.einsum("btk,qk->btq", zn, f)
    s, bs = scale.double(), base.double()
    pre = torch.sigmoid(m[..., :4] * s[0] + bs[:4]) + hc_eps
    post = 2 * torch.sigmoid(m[..., 4:8] * s[1] + bs[4:8])
    c = torch.softmax((m[..., 8:] * s[2] + bs[8:]).reshape(*m.shape[:2], 4, 4), -1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return pre, post, c


# ------------------------------------------------------------------------------------------- zoo
class Normaliser(nn.Module):
    """The 'other implementation': its own RMS norm module, applied to the flattened residual."""

    def __init__(self, kind, eps, weight_dtype=None, gen=None):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = None
        if weight_dtype is not None:
            self.weight = nn.Parameter((0.5 + torch.rand(WIDTH, generator=gen)).to(weight_dtype), requires_grad=False)
        if kind == "biased":
            self.bias = nn.Parameter(0.1 * torch.randn(WIDTH, generator=gen), requires_grad=False)

    def forward(self, x):
        if self.kind == "functional":
            return F.rms_norm(x, (WIDTH,), self.weight, self.eps)
        if self.kind == "centred":  # the look-alike: LayerNorm without bias
            x = x - x.mean(dim=-1, keepdim=True)
        if self.kind == "div":
            y = x / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + self.eps)
        else:
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight
        if self.kind == "biased":  # the look-alike: an affine norm (weight and bias)
            y = y + self.bias
        return y


class HyperMix(nn.Module):
    """pre / post / comb of one site: normalise the flattened streams, project to 24 logits, squash, balance."""

    def __init__(self, norm, hc_eps, rounds, gen, transposed=False, upcast_after_norm=False, logit_weight=False):
        super().__init__()
        self.norm, self.hc_eps, self.rounds, self.transposed = norm, hc_eps, rounds, transposed
        self.upcast_after_norm = upcast_after_norm
        self.logit_weight = None
        if logit_weight:  # the look-alike: a learned weight on the 24 logits instead of the 4d inputs
            self.logit_weight = nn.Parameter(0.5 + torch.rand(24, generator=gen), requires_grad=False)
        proj = torch.randn(24, WIDTH, generator=gen) / math.sqrt(WIDTH)
        self.proj = nn.Parameter(proj.t().contiguous() if transposed else proj, requires_grad=False)
        self.bias = nn.Parameter(torch.randn(24, generator=gen), requires_grad=False)
        self.gain = nn.Parameter(0.5 + torch.rand(3, generator=gen), requires_grad=False)

    def forward(self, streams):
        flat = torch.flatten(streams, start_dim=2)
        if self.upcast_after_norm:  # the look-alike: normalised in bf16, rounded, then upcast
            h = self.norm(flat).to(torch.float32)
        else:
            h = self.norm(flat.to(torch.float32))
        logits = torch.matmul(h, self.proj) if self.transposed else F.linear(h, self.proj)
        if self.logit_weight is not None:
            logits = logits * self.logit_weight
        a, b, c = torch.split(logits, [4, 4, 16], dim=-1)
        pre = (a * self.gain[0] + self.bias[0:4]).sigmoid() + self.hc_eps
        post = (b * self.gain[1] + self.bias[4:8]).sigmoid() * 2.0
        mat = F.softmax((c * self.gain[2] + self.bias[8:24]).unflatten(-1, (4, 4)), dim=3) + self.hc_eps
        done = 0
        while done < self.rounds:
            if done:
                mat = mat / mat.sum(dim=3, keepdim=True).add(self.hc_eps)
            mat = mat / mat.sum(dim=2, keepdim=True).add(self.hc_eps)
            done += 1
        return pre, post, mat


class SpellingZoo(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.rmsnorm_w = HyperMix(Normaliser("functional", 1e-6, torch.float32, g), 1e-6, 20, g)
        self.rsqrt = HyperMix(Normaliser("rsqrt", 1e-5), 1e-3, 7, g, transposed=True)
        self.div_bf16w = HyperMix(Normaliser("div", 1e-20, torch.bfloat16, g), 1e-6, 12, g)
        self.centred = HyperMix(Normaliser("centred", 1e-6, torch.float32, g), 1e-6, 20, g)
        self.biased = HyperMix(Normaliser("biased", 1e-6, torch.float32, g), 1e-6, 20, g)
        self.bf16_norm = HyperMix(Normaliser("functional", 1e-6, torch.bfloat16, g), 1e-6, 20, g,
                                  upcast_after_norm=True)
        self.w_after = HyperMix(Normaliser("rsqrt", 1e-6), 1e-6, 20, g, logit_weight=True)

    def forward(self, h32, h16):
        a = self.rmsnorm_w(h32)  # site:rmsnorm_w
        b = self.rsqrt(h16)  # site:rsqrt
        c = self.div_bf16w(h32)  # site:div_bf16w
        d = self.centred(h32)  # site:centred
        e = self.biased(h16)  # site:biased
        f = self.bf16_norm(h16)  # site:bf16_norm
        w = self.w_after(h32)  # site:w_after
        return a, b, c, d, e, f, w


FUSED = {  # site -> (H input index, norm_eps in the graph, hc_eps, iters, weight dtype)
    "rmsnorm_w": (0, RMS_EPS_F32, 1e-6, 20, "float32"),
    "rsqrt": (1, 1e-5, 1e-3, 7, "none"),
    "div_bf16w": (0, 1e-20, 1e-6, 12, "bfloat16"),
}


@pytest.fixture(scope="module")
def compiled_zoo():
    """((inputs, module, compiled outputs, eager outputs, report), post-pass GraphModules)."""
    import dsv41

    g = torch.Generator().manual_seed(3)
    h32 = torch.randn(2, 3, STREAMS, DIM, generator=g) * 2
    h16 = (torch.randn(2, 3, STREAMS, DIM, generator=g) * 2).bfloat16()
    model = SpellingZoo().eval()
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        eager = model(h32, h16)
        out = torch.compile(model, backend="dsv41", options={"debug": True}, dynamic=False)(h32, h16)
    return ((h32, h16), model, out, eager, dsv41.last_report()), graphs


@pytest.fixture(scope="module")
def zoo(compiled_zoo):
    """(inputs, module, compiled outputs, eager outputs, report)."""
    return compiled_zoo[0]



def _fam(report):
    return report.to_dict()["families"]["mhc"]


def _site(record):
    return site_of(record, __file__, SITES, names_only=True)  # the outer forward names the site


# ------------------------------------------------------------------------------------------- tests
def _rounding_dropped(report) -> bool:
    """Whether the bf16_norm look-alike fused: torch 2.11's graph (before dsv41's passes) already computes that
    F.rms_norm without rounding its result to bf16 (seen on the H100, 2026-12-06), so the chain dsv41 sees IS the
    FP32 normalise-then-project and fuses as such; torch 2.13's keeps eager's rounding and gets the near-miss."""
    return any(_site(s) == "bf16_norm" for s in _fam(report)["sites"])


def test_each_normalise_then_project_site_fuses_once_with_its_constants(zoo):
    *_, report = zoo
    fam = _fam(report)
    extra = ["bf16_norm"] if _rounding_dropped(report) else []
    assert sorted((_site(s), s["pattern"]) for s in fam["sites"]) == sorted((k, "mhc_mixes") for k in [*FUSED, *extra])
    for s in fam["sites"]:
        if _site(s) in extra:
            continue
        _, norm_eps, hc_eps, iters, wdt = FUSED[_site(s)]
        det = s["detail"]
        assert det["norm_eps"] == norm_eps and det["hc_eps"] == hc_eps and det["iters"] == iters, det
        assert det["spelling"] == "rms_norm -> projection" and det["norm_weight"] == wdt, det
    assert fam["sites"][0]["detail"]["norm_eps"] != 1e-6  # F.rms_norm's eps is the FP32 value, as in the graph
    assert {_site(s): s["detail"]["fn_layout"] for s in fam["sites"]}["rsqrt"] == "[4d, 24]"


def test_look_alikes_of_the_new_spelling_are_near_misses_naming_the_check(zoo):
    *_, report = zoo
    misses = {_site(m): m for m in _fam(report)["near_misses"]}
    assert set(misses) == {"centred", "biased", "w_after"} | (set() if _rounding_dropped(report) else {"bf16_norm"})
    assert misses["centred"]["check"] == "rms_input"
    assert "rsqrt(mean(z^2) + eps) * w" in misses["centred"]["reason"]
    assert misses["biased"]["check"] == "rms_input_leaves"
    assert "at most one RMS weight" in misses["biased"]["reason"]
    if "bf16_norm" in misses:
        assert misses["bf16_norm"]["check"] == "rms_input" and "in FP32" in misses["bf16_norm"]["reason"]
    assert misses["w_after"]["check"] == "coefficient_inputs" and "2 tensor(s) of shape [24]" in \
        misses["w_after"]["reason"]


def test_post_pass_graph_calls_the_fused_op_with_the_weight_itself(zoo, zoo_after):
    *_, report = zoo
    (graph,) = report.graphs
    extra = int(_rounding_dropped(report))
    calls = zoo_after.graph.find_nodes(op="call_function", target=torch.ops.dsv41.mhc_mixes.default)
    assert len(calls) == 3 + extra
    # Weighted sites pass the RMS weight parameter itself (8 arguments, the last a graph input): no fn * w node
    # that would read and write fn every step; the unweighted one keeps the 7-argument call.
    nargs = sorted(len(c.args) for c in calls)
    assert nargs == [7, 8, 8] if not extra else nargs in ([7, 8, 8, 8], [7, 7, 8, 8])  # bf16_norm (torch 2.11)
    assert all(c.args[-1].op == "placeholder" for c in calls if len(c.args) == 8)
    # The look-alikes keep their projection and norm; the fused sites lost theirs (sqrt only in div_bf16w).
    after, before = ops_after(zoo_after), ops_after(graph.graph_before)
    assert after["aten.mm.default"] == 4 - extra and before["aten.mm.default"] == 7
    assert before["aten.sqrt.default"] > 0 and after["aten.sqrt.default"] == 0
    defined = {n.name for n in zoo_after.graph.nodes}
    for rec in graph.records:
        for mt in rec.matches if rec.family == "mhc" else ():
            assert mt.nodes_replaced and not defined & set(mt.nodes_replaced)
            assert "aten.rsqrt.default" in mt.ops_replaced or "aten.sqrt.default" in mt.ops_replaced


def test_compiled_sites_equal_the_float64_reference(zoo):
    inputs, model, out, eager, _ = zoo
    for i, name in enumerate(("rmsnorm_w", "rsqrt", "div_bf16w")):
        site = getattr(model, name)
        h_idx, _, hc_eps, iters, _ = FUSED[name]
        w = site.norm.weight
        want = reference_mixes(inputs[h_idx], site.proj, site.bias, site.gain, site.norm.eps, hc_eps, iters, w)
        for got, ref, what in zip(out[i], want, ("pre", "post", "comb")):
            assert got.dtype == torch.float32, (name, what)
            err = float((got.double() - ref).abs().max())
            assert torch.allclose(got.double(), ref, **COEF_TOL), (name, what, err)
    # The look-alikes were left to Inductor and kept their meaning. bf16_norm: Inductor may compute the bf16
    # rms_norm without rounding its result to bf16 (as eager does), so it agrees to that rounding: 2^-8 absolute
    # on O(1) coefficients (measured 4e-4).
    for i, atol in ((3, 1e-5), (4, 1e-5), (5, 2.0 ** -8), (6, 1e-5)):
        for got, ref in zip(out[i], eager[i]):
            assert torch.allclose(got, ref, rtol=1e-5, atol=atol), (i, float((got - ref).abs().max()))


def test_weighted_site_bytes_count_the_weight_once_per_step(zoo):
    *_, report = zoo
    site = next(s for s in _fam(report)["sites"] if _site(s) == "rmsnorm_w")
    # After: per step fn [24, 128] + w [128] + base [24] + scale [3] in FP32; per token H in, 24 floats out.
    per_step = 4 * (24 * WIDTH + WIDTH + 24 + 3)
    assert site["bytes_after"] == f"{4 * (WIDTH + 24)}*B*L + {per_step}"
    assert site["bytes_before_value"] > site["bytes_after_value"]


def test_weighted_mixes_are_gated_on_cuda_until_validated(monkeypatch):
    """The RMS-weighted mhc_mixes kernel variant stays off for graphs on CUDA until it has run on a GPU
    (`manager.GPU_UNVALIDATED_OPS`): simulated on CPU by gating as CUDA does; the chain keeps eager's numbers."""
    import dsv41
    from dsv41.compiler import options as opts_mod

    monkeypatch.setattr(opts_mod.Options, "gated_ops",
                        lambda self, on_cuda: frozenset({"mhc_mixes(norm_weight)"}))
    g = torch.Generator().manual_seed(21)
    H = torch.randn(1, 1, STREAMS, DIM, generator=g)
    fn = torch.randn(24, STREAMS * DIM, generator=g) / 8
    w = 0.5 + torch.rand(STREAMS * DIM, generator=g)
    base, scale = torch.randn(24, generator=g), 0.5 + torch.rand(3, generator=g)

    def mixes(H, fn, w, base, scale):
        z = H.flatten(2).float()
        m = F.linear(F.rms_norm(z, (z.shape[-1],), w, 1e-6), fn)
        pre = torch.sigmoid(m[..., :4] * scale[0] + base[:4]) + 1e-6
        post = 2 * torch.sigmoid(m[..., 4:8] * scale[1] + base[4:8])
        c = torch.softmax((m[..., 8:] * scale[2] + base[8:]).unflatten(-1, (4, 4)), -1) + 1e-6
        c = c / (c.sum(-2, keepdim=True) + 1e-6)
        for _ in range(2):
            c = c / (c.sum(-1, keepdim=True) + 1e-6)
            c = c / (c.sum(-2, keepdim=True) + 1e-6)
        return pre, post, c

    torch._dynamo.reset()
    got = torch.compile(mixes, backend="dsv41", dynamic=False)(H, fn, w, base, scale)
    for a, b in zip(got, mixes(H, fn, w, base, scale)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    fam = dsv41.last_report().to_dict()["families"]["mhc"]
    assert fam["matches"] == 0 and [m["check"] for m in fam["near_misses"]] == ["gpu_unvalidated"]
