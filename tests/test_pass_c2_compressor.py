"""`c2_compressor` family: [pair pooling ->] RMSNorm -> RoPE -> FP4 -> bank write becomes one dsv41::c2_* op.

A hand-written zoo (not dsv41/model/csa.py: `F.linear` projections, a norm spelled with `**2`/`torch.mean`,
RoPE through `view_as_complex`, the pair softmax as exp of differences written inline, caches written with
`cache[bi, rows] = codes`) holds every case, compiled once per activation dtype (module-scoped fixture):

    r1      wkv x -> RMSNorm -> RoPE -> FP4 (E4M3 1x16) -> bank write     -> c2_norm_rope_fp4_store
    r2      pair pool (state + shifted k, g) -> cast -> RMSNorm -> ...  -> c2_pool_norm_rope_fp4_store
    scaled  a norm with mean(x^2) * 0.5 (not RMSNorm)                    -> near-miss rmsnorm_values (rope_fp4 keeps it)
    sink    a pooling with a zero third logit (a + b + 1 below)         -> near-miss pair_pool_values, norm fused alone

The fused ops run their CPU references under the compiled graph, so caches must equal eager bit for bit and
the latents (returned) must equal eager. The `tiny` test reads the session fixture `tiny_dsv41`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv41.kernels.c2_compressor  # noqa: F401
from dsv41.model import formats
from dsv41.passes.testing import capture_graphs, ops_after

B, T, D, DM, R, ROWS = 2, 3, 64, 48, 16, 6
EPS = 1e-6
DTYPES = ["float32", "bfloat16"]


def norm(u, w, eps, half=False):
    uf = u.float()
    ms = torch.mean(uf ** 2, dim=-1, keepdim=True)
    if half:
        ms = ms * 0.5
    return (uf * torch.rsqrt(ms + eps) * w.float()).to(u.dtype)


def rope(x, freqs):
    pc = torch.view_as_complex(x[..., -R:].float().reshape(*x.shape[:-1], R // 2, 2))
    rot = torch.view_as_real(pc * freqs).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-R], rot), dim=-1)


def write(codes_cache, scale_cache, lat, freqs, rows):
    codes, scales = formats.quantize_fp4_e4m3_1x16(rope(lat, freqs))
    bi = torch.arange(lat.shape[0])[:, None].expand_as(rows)
    codes_cache[bi, rows] = codes
    scale_cache[bi, rows] = scales


class C2Zoo(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.dtype = dtype
        self.w1 = nn.Parameter((torch.randn(D, DM, generator=gen) * 0.2).to(dtype), requires_grad=False)
        self.wk = nn.Parameter(torch.randn(D, DM, generator=gen) * 0.2, requires_grad=False)
        self.wg = nn.Parameter(torch.randn(D, DM, generator=gen) * 0.2, requires_grad=False)
        self.nw = nn.Parameter((0.5 + torch.rand(D, generator=gen)).to(dtype), requires_grad=False)
        for name in ("c1", "c2", "c3", "c4"):
            self.register_buffer(name, torch.zeros(B, ROWS + 1, D // 2, dtype=torch.uint8))
            self.register_buffer(name + "s", torch.zeros(B, ROWS + 1, D // 16, dtype=torch.uint8))
        for name in ("sk", "sg"):
            self.register_buffer(name, torch.randn(B, D, generator=gen))

    def pooled(self, x, sink):
        k = F.linear(x.float(), self.wk)
        g = F.linear(x.float(), self.wg)
        pk = torch.cat((self.sk[:, None], k[:, :-1]), dim=1)
        pg = torch.cat((self.sg[:, None], g[:, :-1]), dim=1)
        m = torch.maximum(pg, g)
        a, b = (pg - m).exp(), (g - m).exp()
        # sink: a third, zero logit in the denominator (an attention-sink softmax), not the pair softmax.
        z = (a * pk + b * k) / (a + b + 1.0) if sink else (a * pk + b * k) / (a + b)
        return z.to(x.dtype), k, g

    def forward(self, x, freqs, rows):
        lat1 = norm(F.linear(x, self.w1), self.nw, EPS)                                   # r1
        write(self.c1, self.c1s, lat1, freqs, rows)
        z, k, g = self.pooled(x, sink=False)
        lat2 = norm(z, self.nw, EPS)                                                      # r2
        write(self.c2, self.c2s, lat2, freqs, rows)
        lat3 = norm(F.linear(x, self.w1), self.nw, EPS, half=True)                        # scaled
        write(self.c3, self.c3s, lat3, freqs, rows)
        z4, _, _ = self.pooled(x, sink=True)
        lat4 = norm(z4, self.nw, EPS)                                                     # sink
        write(self.c4, self.c4s, lat4, freqs, rows)
        self.sk.copy_(k[:, -1])  # the pending-token state update stays with Inductor
        self.sg.copy_(g[:, -1])
        return lat1 * 2, lat2 + 1, lat4


def _inputs(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, DM, generator=gen).to(dtype)
    ang = torch.rand(B, T, R // 2, generator=gen, dtype=torch.float64) * 6
    freqs = torch.polar(torch.ones_like(ang), ang).to(torch.complex64)
    rows = torch.tensor([[0, 5, 2], [-1, 3, ROWS]])
    return x, freqs, rows


@pytest.fixture(scope="module", params=DTYPES)
def compiled_zoo(request):
    """((eager model after one call, eager outputs, compiled model after one call, compiled outputs, report), post-pass GraphModules)."""
    import dsv41

    dtype = getattr(torch, request.param)
    args = _inputs(dtype)
    eager, comp = C2Zoo(dtype), C2Zoo(dtype)
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        ref = eager(*args)
        out = torch.compile(comp, backend="dsv41", options={"debug": True}, dynamic=False)(*args)
    return (eager, ref, comp, out, dsv41.last_report()), graphs


@pytest.fixture(scope="module")
def zoo(compiled_zoo):
    """(eager model after one call, eager outputs, compiled model after one call, compiled outputs, report)."""
    return compiled_zoo[0]



def _fam(report, name="c2_compressor"):
    return report.to_dict()["families"][name]


def test_compressor_chains_fuse_and_look_alikes_are_near_misses(zoo):
    *_, report = zoo
    fam = _fam(report)
    pats = sorted(s["pattern"] for s in fam["sites"])
    # r1 and the norm part of `sink` -> c2_norm; r2 -> c2_pool; `scaled` is not an RMSNorm.
    assert pats == ["c2_norm_rope_fp4_store(e4m3_1x16)"] * 2 + ["c2_pool_norm_rope_fp4_store(e4m3_1x16)"]
    checks = sorted(m["check"] for m in fam["near_misses"])
    assert checks == ["pair_pool_values", "rmsnorm_values"]
    pooled = [s for s in fam["sites"] if s["pattern"].startswith("c2_pool")]
    assert pooled[0]["detail"]["eps"] == EPS and pooled[0]["detail"]["pending_state"] == "left to Inductor"
    # rope_fp4 still takes the look-alike's RoPE -> FP4 -> write (it runs after this family).
    assert [s["pattern"] for s in _fam(report, "rope_fp4")["sites"]] == ["rope_fp4_quant_store(e4m3_1x16)"]


def test_compiled_caches_latents_and_state_equal_eager(zoo):
    eager, ref, comp, out, _ = zoo
    for name in ("c1", "c1s", "c2", "c2s", "c3", "c3s", "c4", "c4s"):
        assert torch.equal(getattr(eager, name), getattr(comp, name)), name
    for name in ("sk", "sg"):
        assert torch.equal(getattr(eager, name), getattr(comp, name)), name
    # Inductor's own code for the unfused parts (the sink pooling, the output math) may round an ulp away.
    for r, o in zip(ref, out):
        eps = torch.finfo(r.dtype).eps
        torch.testing.assert_close(o, r, rtol=4 * eps, atol=4 * eps * float(r.abs().max()))
    assert (eager.c1 != 0).any() and (eager.c2 != 0).any()


def test_fused_chains_are_gone_from_post_pass_graph(zoo, zoo_after):
    *_, report = zoo
    (graph,) = report.graphs
    ops = ops_after(zoo_after)
    assert ops["dsv41.c2_pool_norm_rope_fp4_store.default"] == 1
    assert ops["dsv41.c2_norm_rope_fp4_store.default"] == 2
    assert ops_after(graph.graph_before)["aten.rsqrt.default"] > 0
    # Only the `scaled` look-alike keeps its rsqrt; the pooled and sink norms and r1's are gone.
    assert ops["aten.rsqrt.default"] == 1
    assert ops["aten.exp.default"] == 2  # the sink look-alike's pooling stays (2 exps)
    for s in _fam(report)["sites"]:
        b, a = s["bytes_before"], s["bytes_after"]
        assert "B" in b and "L" in b or b.isdigit() is False


def test_family_switched_off_shows_off_and_leaves_the_chains():
    import dsv41

    x, freqs, rows = _inputs(torch.float32)
    m = C2Zoo(torch.float32)

    def one_site(x, freqs, rows):
        lat = norm(F.linear(x, m.w1), m.nw, EPS)
        write(m.c1, m.c1s, lat, freqs, rows)
        return lat

    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        torch.compile(one_site, backend="dsv41", options={"disable": ["c2_compressor"], "debug": True})(x, freqs, rows)
    rep = dsv41.last_report()
    fam = _fam(rep)
    assert fam["enabled"] is False and fam["matches"] == 0
    ops = ops_after(graphs)
    assert [op for op in ops if op.startswith("dsv41.c2_")] == []
    assert ops["dsv41.rope_fp4_quant_store"] == 1


# ------------------------------------------------------------------------------------------- tiny model
def test_tiny_decode_fuses_every_compressor(tiny_dsv41, tiny_model):
    # Every Compressor's bank write: ratio 2 -> the pooled op, ratio 1 -> the norm op; and every index-key
    # write (k_norm -> RoPE -> FP4 UE8M0 -> write, the same RMSNorm chain) -> the norm op with UE8M0 1x32.
    comps = [m for m in tiny_model.modules() if type(m).__name__ == "Compressor"]
    keys = [m for m in tiny_model.modules() if type(m).__name__ == "Indexer" and m.wk is not None]
    want = {"c2_norm_rope_fp4_store(ue8m0_1x32)": len(keys)}
    for c in comps:
        key = ("c2_pool_norm_rope_fp4_store(e4m3_1x16)" if c.ratio == 2 else "c2_norm_rope_fp4_store(e4m3_1x16)")
        want[key] = want.get(key, 0) + 1
    fam = tiny_dsv41["report"]["families"]["c2_compressor"]
    counts = {}
    for s in fam["sites"]:
        counts[s["pattern"]] = counts.get(s["pattern"], 0) + 1
    assert counts == want == {"c2_pool_norm_rope_fp4_store(e4m3_1x16)": 1, "c2_norm_rope_fp4_store(e4m3_1x16)": 1,
                              "c2_norm_rope_fp4_store(ue8m0_1x32)": 2}
    assert fam["near_misses"] == []
    ops = ops_after(tiny_dsv41["report"]["graphs"][0])  # the JSON report keeps printed code only
    assert ops["dsv41.c2_pool_norm_rope_fp4_store.default"] == 1
    assert ops["dsv41.c2_norm_rope_fp4_store.default"] == 3
    assert ops["dsv41.rope_fp4_quant_store"] == 0
    assert tiny_dsv41["max_rel_logit_error"] < 1e-4
    assert tiny_dsv41["compiled_tokens"] == tiny_dsv41["eager_tokens"]
