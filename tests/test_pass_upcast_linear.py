"""`upcast_linear` family: FP32 matmul by an upcast bf16 / fp16 weight, or by an FP32 weight at decode M ->
dsv41::linear_upcast.

A hand-written zoo (not dsv41/model) compiled once with backend="dsv41" (module fixture, debug mode):
    head      F.linear(h.float(), W_bf16.float()), h bf16 [B, T, K]            -> fused
    matmul_t  x @ W_fp16.float().t()                                           -> fused
    bias      F.linear(x, W.float(), b.float())  (addmm)                       -> fused, bias added after
    shared    the upcast weight also feeds a sum                                -> fused, the upcast copy stays
    scaled    F.linear(x, W.float() * 0.5)                                     -> near-miss weight_transform
    f64       F.linear(x.double(), W.double())                                  -> near-miss weight_transform
    computed  W made in the graph (w_bf16 * 2, exact), then upcast              -> near-miss weight_source
    cache     a bf16 buffer written this step, then multiplied by (PDL hazard)  -> near-miss weight_source
    plain     an FP32 weight, no upcast, M = 1                                 -> fused (no bytes saved: a GEMV)
    verify    the same FP32 weight at M = 2 (only M = 1 was measured faster)   -> left to Inductor, no record
    prefill   the same FP32 weight at M = 12                                   -> left to Inductor, no record
    product   an FP32 product of two activations (x @ y^T)                     -> left to Inductor, no record
Reference: the eager module in float64 (the weights' values are exact in it). Compiled outputs must equal it to
FP32 summation rounding, and equal eager FP32 to the same tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv41
from dsv41.passes.testing import capture_graphs, ops_after

B, T, K, N = 2, 1, 96, 40
#: K of the FP32 sites: wide enough that Inductor's CPU pass for memory-bound matmuls (decompose_mem_bound_mm) leaves
#: the M = 1 product an mm instead of a multiply-and-sum
KW = 640


class UpcastZoo(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w_head = nn.Parameter(torch.randn(N, K, generator=g).bfloat16(), requires_grad=False)
        self.w_t = nn.Parameter(torch.randn(N + 3, K, generator=g).half(), requires_grad=False)
        self.w_bias = nn.Parameter(torch.randn(N, K, generator=g).bfloat16(), requires_grad=False)
        self.b = nn.Parameter(torch.randn(N, generator=g).bfloat16(), requires_grad=False)
        self.w_shared = nn.Parameter(torch.randn(N, K, generator=g).bfloat16(), requires_grad=False)
        self.w_scaled = nn.Parameter(torch.randn(N, K, generator=g).bfloat16(), requires_grad=False)
        self.w_f64 = nn.Parameter(torch.randn(N, K, generator=g).bfloat16(), requires_grad=False)
        self.w_plain = nn.Parameter(torch.randn(N, KW, generator=g), requires_grad=False)
        self.w_c = nn.Parameter(torch.randn(N, K, generator=g).bfloat16(), requires_grad=False)
        self.register_buffer("cache", torch.randn(N, K, generator=g).bfloat16())

    def forward(self, h, x, xw, xp):
        head = F.linear(h.float(), self.w_head.float())  # site:head
        mt = x @ self.w_t.float().t()  # site:matmul_t
        bias = F.linear(x, self.w_bias.float(), self.b.float())  # site:bias
        ws = self.w_shared.float()
        shared = F.linear(x, ws) + ws.sum()  # site:shared
        scaled = F.linear(x, self.w_scaled.float() * 0.5)  # site:scaled
        f64 = F.linear(x.double(), self.w_f64.double()).float()  # site:f64
        plain = F.linear(xw[0], self.w_plain)  # site:plain
        verify = F.linear(xw, self.w_plain)  # site:verify
        prefill = F.linear(xp, self.w_plain)  # site:prefill
        product = xw[0] @ xp.t()  # site:product
        computed = F.linear(x, (self.w_c * 2).float())  # site:computed
        self.cache[0] = h[0, 0]
        cache = x @ self.cache.float().t()  # site:cache
        return head, mt, bias, shared, scaled, f64, plain, computed, cache, prefill, product, verify


def _site(loc) -> str | None:
    code = getattr(loc, "code", "") or ""
    return code.split("# site:")[-1].strip() if "# site:" in code else None


def _inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(B, T, K, generator=g).bfloat16(), torch.randn(B, T, K, generator=g),
            torch.randn(B, T, KW, generator=g), torch.randn(12, KW, generator=g))


@pytest.fixture(scope="module")
def compiled():
    model = UpcastZoo()
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        got = torch.compile(model, backend="dsv41", options={"debug": True})(*_inputs())
    rep = dsv41.last_report()
    rec = {r.family: r for gr in rep.graphs for r in gr.records}["upcast_linear"]
    return model, got, rep, rec, graphs


def test_fused_sites_and_near_misses(compiled):
    _, _, _, rec, _ = compiled
    fused = {_site(m.location): m for m in rec.matches}
    assert set(fused) == {"head", "matmul_t", "bias", "shared", "plain"}, [m.location for m in rec.matches]
    assert dict(fused["shared"].detail)["upcast_kept"] is True
    assert dict(fused["head"].detail)["upcast_kept"] is False
    assert dict(fused["matmul_t"].detail)["weight_dtype"] == "torch.float16"
    assert dict(fused["bias"].detail)["bias"] is True
    assert dict(fused["plain"].detail)["weight_dtype"] == "torch.float32"
    assert dict(fused["plain"].detail)["upcast_kept"] is False
    assert fused["plain"].pattern == "linear_upcast(torch.float32)"
    plain_before, plain_after = fused["plain"].bytes_evaluated()
    assert plain_before == plain_after  # nothing to save but the kernel: the same bytes in a GEMV
    misses = {_site(m.location): m for m in rec.near_misses}
    assert set(misses) == {"scaled", "f64", "computed", "cache"}, rec.near_misses
    assert misses["computed"].check == misses["cache"].check == "weight_source"
    assert misses["scaled"].check == "weight_transform" and "mul" in misses["scaled"].reason
    assert "float64" in misses["f64"].reason
    # Bytes: the head reads its bf16 weight once instead of 2 + 4 + 4 bytes per element.
    before, after = fused["head"].bytes_evaluated()
    assert before - after == 2 * N * K * 4


def test_the_upcasts_are_gone_from_the_graph(compiled):
    """5 fused matmuls; the weight upcasts of head, matmul_t and bias are gone, the shared one (read by the sum)
    and the look-alikes' stay; the FP32 matmuls at M = 2 and 12 and the product of activations stay mm's."""
    _, _, rep, _, graphs = compiled

    def upcasts(code):
        return sum(1 for ln in code.splitlines() if "convert_element_type.default(arg" in ln and "torch.float32)" in ln)

    before = "\n".join(gr.graph_before for gr in rep.graphs)
    after = "\n".join(gr.graph_after for gr in rep.graphs)
    ops = ops_after(graphs)
    assert ops["dsv41.linear_upcast.default"] == 5
    # head, matmul_t, shared and plain were mm's (bias an addmm); verify, prefill, product and the look-alikes stay
    assert ops_after(before)["aten.mm.default"] - ops["aten.mm.default"] == 4
    assert upcasts(before) - upcasts(after) == 3, (upcasts(before), upcasts(after))


def test_outputs_equal_eager_and_float64(compiled):
    model, got, _, _, _ = compiled
    h, x, xw, xp = _inputs()
    with torch.no_grad():
        want = model(h, x, xw, xp)
    names = ("head", "mt", "bias", "shared", "scaled", "f64", "plain", "computed", "cache", "prefill", "product",
             "verify")
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4, msg=name)
    # float64 for the fused sites (bf16 / fp16 weights and bf16 h are exact in float64).
    ref = {"head": h.double() @ model.w_head.double().T, "mt": x.double() @ model.w_t.double().T,
           "bias": x.double() @ model.w_bias.double().T + model.b.double(),
           "plain": xw[0].double() @ model.w_plain.double().T}
    for i, name in ((0, "head"), (1, "mt"), (2, "bias"), (6, "plain")):
        torch.testing.assert_close(got[i].double(), ref[name], rtol=1e-5, atol=1e-4, msg=name)


def test_family_can_be_switched_off():
    model = UpcastZoo()
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="dsv41", options={"disable": ["upcast_linear"]})(*_inputs())
    rec = {r.family: r for gr in dsv41.last_report().graphs for r in gr.records}["upcast_linear"]
    assert not rec.enabled and not rec.matches
    with torch.no_grad():
        torch.testing.assert_close(got[0], model(*_inputs())[0])


class CondZoo(nn.Module):
    """An FP32 weight outside, and FP32 products of activations inside `torch.cond`'s branches."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(N, KW, generator=torch.Generator().manual_seed(3)), requires_grad=False)

    def forward(self, x, a, b):
        # x is read before self.w, so the outer graph's placeholders are (x, w, ...) and its static index 1 (w) is
        # where a branch graph's second placeholder, b, sits
        pred = x.sum() > 0
        y = F.linear(x, self.w)  # site:outer

        def yes(a, b):
            return a @ b.t()

        def no(a, b):
            return a @ (b * 2).t()

        return y, torch.cond(pred, yes, no, (a, b))


def test_fp32_products_inside_subgraphs_are_not_taken_for_weights():
    """Inductor runs the post-grad passes on the branch subgraphs too, under the outer graph's AOT metadata; their
    placeholders are activations (here `b`, and `b * 2` computed just before), which a GEMV must not read before its
    PDL wait. Only the outer FP32 weight is taken."""
    g = torch.Generator().manual_seed(4)
    x, a, b = torch.randn(1, KW, generator=g), torch.randn(1, KW, generator=g), torch.randn(N, KW, generator=g)
    model = CondZoo()
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="dsv41")(x, a, b)
        want = model(x, a, b)
    fused = [m for gr in dsv41.last_report().graphs for r in gr.records if r.family == "upcast_linear"
             for m in r.matches]
    assert [_site(m.location) for m in fused] == ["outer"], [(m.pattern, m.location) for m in fused]
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-4)
