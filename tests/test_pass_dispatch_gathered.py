"""`dispatch` family, gathered experts: gather(W, idx) + gather(S, idx) -> FP4 dequantise -> bmm becomes
dsv41::grouped_linear_fp4.

One zoo model holds every case and is compiled once per activation dtype (module-scoped fixture, debug mode so the
post-pass graph is in the report). Three tokens, top-2 of 8 experts:

    model      dsv41 RoutedExperts.forward_gather (einsum on `w[idx]`, FP8 1x32 activation fake-quant): 3 chains
    hand_up    experts kept as module attributes, gathered with index_select on a flat int32 index, decoded through
               a constant E2M1 table with exp2(e - 127), bmm against repeat_interleave(x), view back; no act quant
    hand_down  `w[idx]` with the same hand decode, matmul(h.unsqueeze(-2), W.transpose(-1, -2)), h fake-quantised
    lookalike_scale   the scale byte used as a plain multiplier: near-miss `ue8m0_scale_rule`
    lookalike_layout  square experts contracted over `out` instead of K (einsum "nd,nkdf->nkf"): `output_layout`
    lookalike_1x16    one scale per 16 elements (a stack [E, out, K/16]): near-miss `weight_format`

References are float64, written here (E2M1 from its table, E4M3 grid from its bit layout, nearest even);
tolerances: float32 activations 1e-5, bfloat16 2e-2, relative to the output's max magnitude.
The `tiny` count reads the session fixture `tiny_dsv41` (tests/conftest.py: one fresh-interpreter compile).
"""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from dsv41.model import ModelConfig
from dsv41.model.formats import fake_quant_fp8_1x32
from dsv41.model.moe import RoutedExperts
from dsv41.passes.testing import capture_graphs, ops_after

if not hasattr(torch.ops.dsv41, "grouped_linear_fp4"):
    pytest.skip("dsv41::grouped_linear_fp4 is not registered", allow_module_level=True)

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
N_TOKENS, TOPK, N_EXPERTS = 3, 2, 8
SITES = {}  # marker -> line number in this file
for _i, _line in enumerate(open(__file__).read().splitlines(), 1):
    _m = re.search(r"# site:(\w+)$", _line)
    if _m:
        SITES[_m.group(1)] = _i


# ------------------------------------------------------------------------------------------- references
def _e4m3_values() -> torch.Tensor:
    """float64 of the non-negative finite E4M3 (fn) values, ascending (codes 0..126)."""
    b = torch.arange(127)
    e, m = b >> 3, (b & 7).double()
    return torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(2.0, (e - 7).double()))


def ref_fake_quant_fp8(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 1x32 fake quant: scale 2^ceil(log2(amax / 448)) (amax >= 1e-4, ratio in FP32), RNE onto E4M3."""
    xb = x.double().reshape(*x.shape[:-1], -1, 32)
    ratio = (xb.abs().amax(-1).clamp(min=1e-4).float() / 448.0).double()
    scale = torch.pow(2.0, torch.ceil(torch.log2(ratio)))[..., None]
    q = (xb / scale).clamp(-448, 448)
    grid, mag = _e4m3_values(), q.abs()
    hi = torch.bucketize(mag, grid).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = mag - grid[lo], grid[hi] - mag
    r = torch.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), grid[hi], grid[lo]) * torch.sign(q)
    return (r * scale).reshape(x.shape).to(x.dtype).double()


def ref_experts(packed: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """float64 [E, out, K] of packed E2M1 stacks [E, out, K/2] with UE8M0 exponents [E, out, K/32]."""
    codes = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).long()
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    return vals * torch.pow(2.0, exps.double() - 127).repeat_interleave(32, -1)


def quantize_experts(w: torch.Tensor, block: int = 32):
    """The test's own FP4 quantiser: [E, out, K] -> packed [E, out, K/2], exponents [E, out, K/block]."""
    e, n, k = w.shape
    wb = w.view(e, n, k // block, block)
    ex = (torch.ceil(torch.log2(wb.abs().amax(-1).clamp(min=1e-30) / 6)) + 127).to(torch.uint8)
    q = wb / torch.pow(2.0, ex.double() - 127).float()[..., None]
    codes = (q.abs()[..., None] - torch.tensor(E2M1)).abs().argmin(-1) | ((q < 0).long() << 3)
    codes = codes.view(e, n, k).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), ex


# ------------------------------------------------------------------------------------------- zoo
def _param(t):
    return nn.Parameter(t, requires_grad=False)


def hand_decode(packed, exps, dtype, block=32, exponent_rule=True):
    """E2M1 nibbles through a constant table, times exp2(e - 127) (or e itself) per `block` elements."""
    nib = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).long()
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    vals = torch.where(nib >= 8, -lut[nib & 7], lut[nib & 7])
    s = torch.exp2(exps.float() - 127) if exponent_rule else exps.float()
    return (vals.unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2).to(dtype)


class HandExpertFFN(nn.Module):
    """Up (index_select + bmm, x repeated per expert) and down (`w[idx]` + matmul, h fake-quantised)."""

    def __init__(self, d, f, gen):
        super().__init__()
        self.up_codes, self.up_exps = map(_param, quantize_experts(torch.randn(N_EXPERTS, f, d, generator=gen)
                                                                   / math.sqrt(d)))
        self.down_codes, self.down_exps = map(_param, quantize_experts(torch.randn(N_EXPERTS, d, f, generator=gen)
                                                                       / math.sqrt(f)))

    def forward(self, x, idx):
        n, k = idx.shape
        flat = idx.flatten().int()
        w_up = hand_decode(self.up_codes.index_select(0, flat), self.up_exps.index_select(0, flat), x.dtype)
        up = torch.bmm(w_up, x.repeat_interleave(k, 0).unsqueeze(-1)).squeeze(-1).view(n, k, -1)  # site:hand_up
        h = fake_quant_fp8_1x32(F.silu(up))
        w_down = hand_decode(self.down_codes[idx], self.down_exps[idx], x.dtype)
        down = torch.matmul(h.unsqueeze(-2), w_down.transpose(-1, -2)).squeeze(-2)  # site:hand_down
        return up, down


class LookalikeExperts(nn.Module):
    """Gathered FP4-looking experts whose math is NOT grouped_linear_fp4 (see the module docstring)."""

    def __init__(self, d, f, gen, kind):
        super().__init__()
        self.kind = kind
        block = 16 if kind == "1x16" else 32
        w = torch.randn(N_EXPERTS, d if kind == "layout" else f, d, generator=gen) / math.sqrt(d)
        self.codes, self.exps = map(_param, quantize_experts(w, block))

    def forward(self, x, idx):
        w = hand_decode(self.codes[idx], self.exps[idx], x.dtype, block=16 if self.kind == "1x16" else 32,
                        exponent_rule=self.kind != "scale")
        if self.kind == "layout":
            return torch.einsum("nd,nkdf->nkf", x, w)  # site:lookalike_layout
        if self.kind == "scale":
            return torch.einsum("nd,nkfd->nkf", x, w)  # site:lookalike_scale
        return torch.einsum("nd,nkfd->nkf", x, w)  # site:lookalike_1x16


class GatheredZoo(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        cfg = ModelConfig.preset("tiny")
        assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (N_EXPERTS, TOPK)
        self.model = RoutedExperts(cfg, "checkpoint", dtype)
        self.model.init_random(gen)
        self.hand = HandExpertFFN(64, 96, gen)
        self.scale = LookalikeExperts(64, 48, gen, "scale")
        self.layout = LookalikeExperts(64, 48, gen, "layout")
        self.b16 = LookalikeExperts(64, 48, gen, "1x16")

    def forward(self, x, route, idx, xh):
        y = self.model.forward_gather(x, route, idx)  # site:model
        up, down = self.hand(xh, idx)
        return y, up, down, self.scale(xh, idx), self.layout(xh, idx), self.b16(xh, idx)


DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 2e-2)}


def _inputs(dtype):
    gen = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(N_EXPERTS, generator=gen)[:TOPK] for _ in range(N_TOKENS)])
    x = (torch.randn(N_TOKENS, 128, generator=gen) * 2).to(dtype)
    route = torch.rand(N_TOKENS, TOPK, generator=gen)
    xh = (torch.randn(N_TOKENS, 64, generator=gen) * 2).to(dtype)
    return x, route, idx, xh


@pytest.fixture(scope="module", params=list(DTYPES))
def compiled_zoo(request):
    """((dtype name, model, inputs, eager outputs, compiled outputs, FusionReport): one compile per dtype, post-pass GraphModules)."""
    import dsv41

    dtype, _ = DTYPES[request.param]
    model = GatheredZoo(dtype).eval()
    inputs = _inputs(dtype)
    with torch.no_grad(), capture_graphs() as graphs:
        eager = model(*inputs)
        compiled = torch.compile(model, backend="dsv41", options={"debug": True}, dynamic=False)
        out = compiled(*inputs)
    return (request.param, model, inputs, eager, out, dsv41.last_report()), graphs


@pytest.fixture(scope="module")
def zoo(compiled_zoo):
    """(dtype name, model, inputs, eager outputs, compiled outputs, FusionReport): one compile per dtype."""
    return compiled_zoo[0]



def _dispatch(report):
    return report.to_dict()["families"]["dispatch"]


def _grouped_sites(report):
    return [s for s in _dispatch(report)["sites"] if s["pattern"].startswith("grouped_linear_fp4")]


def _close(a, b, tol):
    scale = max(float(b.abs().max()), 1e-30)
    return float((a.double() - b.double()).abs().max()) <= tol * scale


# ------------------------------------------------------------------------------------------- zoo tests
def test_each_gathered_chain_is_fused_once_with_its_activation_quant(zoo):
    _, _, _, _, _, report = zoo
    sites = _grouped_sites(report)
    assert len(sites) == 5, [(s["pattern"], s["location"]["line"]) for s in sites]
    model = [s for s in sites if s["location"]["file"].endswith("dsv41/model/moe.py")]
    assert len(model) == 3 and all(s["pattern"] == "grouped_linear_fp4(act_quant=True)" for s in model)
    assert all(s["location"]["stack"][-2].endswith(f"test_pass_dispatch_gathered.py:{SITES['model']} (forward)")
               for s in model)
    assert sorted(s["detail"]["x"] for s in model) == ["per_expert", "per_token", "per_token"]
    hand = {s["location"]["line"]: s for s in sites if s["location"]["file"].endswith("test_pass_dispatch_gathered.py")}
    assert set(hand) == {SITES["hand_up"], SITES["hand_down"]}
    assert hand[SITES["hand_up"]]["pattern"] == "grouped_linear_fp4(act_quant=False)"
    assert hand[SITES["hand_down"]]["pattern"] == "grouped_linear_fp4(act_quant=True)"
    assert hand[SITES["hand_down"]]["detail"]["x"] == "per_expert"
    for s in sites:
        assert s["op"] == "dsv41::grouped_linear_fp4"
        assert s["detail"]["experts"] == N_EXPERTS and s["detail"]["topk"] == TOPK


def test_compiled_zoo_matches_eager_and_float64_reference(zoo):
    name, model, (x, route, idx, xh), eager, out, _ = zoo
    _, tol = DTYPES[name]
    for a, b in zip(out, eager):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _close(a, b, tol)
    # Independent float64 references of the fused hand layers.
    h = model.hand
    w_up = ref_experts(h.up_codes, h.up_exps)[idx]                          # [N, k, F, D]
    up = torch.einsum("nd,nkfd->nkf", xh.double(), w_up)
    assert _close(out[1], up, tol)
    hq = ref_fake_quant_fp8(F.silu(eager[1].float()).to(xh.dtype))
    down = torch.einsum("nkf,nkdf->nkd", hq, ref_experts(h.down_codes, h.down_exps)[idx])
    assert _close(out[2], down, tol)
    # and the model's routed experts (w2 of the weighted SwiGLU) against the eager module
    assert _close(out[0], model.model.forward_gather(x, route, idx), tol)


def test_fused_chains_leave_the_post_pass_graph(zoo, zoo_after):
    _, _, _, _, _, report = zoo
    (graph,) = report.graphs
    before, after = graph.graph_before, ops_after(zoo_after)
    # the model's w1 / w3 (same x, same experts, act_quant) are one dsv41::grouped_linear_fp4_pair after grouped_pair
    assert after["dsv41.grouped_linear_fp4.default"] == 3
    assert after["dsv41.grouped_linear_fp4_pair.default"] == 1
    (pair,) = report.to_dict()["families"]["grouped_pair"]["sites"]
    assert pair["location"]["code"] == 'a = torch.einsum("nd,nkfd->nkf", xq, w1)'
    assert pair["detail"]["second"].startswith("moe.py:") and pair["op"] == "dsv41::grouped_linear_fp4_pair"
    # Only the three look-alikes still multiply gathered, dequantised experts.
    n_mm = lambda ops: ops["aten.bmm.default"] + ops["aten.mm.default"]  # noqa: E731
    assert n_mm(ops_after(before)) == 8 and n_mm(after) == 3
    # gathers of the expert stacks (graph inputs): 2 per chain; index_select is decomposed to aten.index by now
    assert len(re.findall(r"aten\.index\.Tensor\(arg\d+_1, ", before)) == 16  # printed: no graph before the passes
    gathers = [n for n in zoo_after.graph.find_nodes(op="call_function", target=torch.ops.aten.index.Tensor)
               if n.args[0].op == "placeholder"]
    assert len(gathers) == 6
    defined = {n.name for n in zoo_after.graph.nodes}
    grouped = [m for r in graph.records if r.family == "dispatch" for m in r.matches
               if m.op == "dsv41::grouped_linear_fp4"]
    assert len(grouped) == 5
    for m in grouped:
        assert len(m.nodes_replaced) > 20 and "aten.bmm.default" in m.ops_replaced
        assert not defined & set(m.nodes_replaced), m.pattern  # what the record says is gone is gone


def test_lookalikes_are_near_misses_naming_the_failed_check(zoo):
    _, _, _, _, _, report = zoo
    misses = {m["location"]["line"]: m for m in _dispatch(report)["near_misses"]}
    assert set(misses) == {SITES["lookalike_scale"], SITES["lookalike_layout"], SITES["lookalike_1x16"]}, misses
    scale = misses[SITES["lookalike_scale"]]
    assert scale["check"] == "ue8m0_scale_rule" and "2^(e-127)" in scale["reason"]
    layout = misses[SITES["lookalike_layout"]]
    assert layout["check"] == "output_layout" and "W[idx[n, j]]^T" in layout["reason"]
    b16 = misses[SITES["lookalike_1x16"]]
    assert b16["check"] == "weight_format" and "[8, 48, 32]" in b16["reason"] and "[8, 48, 4]" in b16["reason"]
    for m in misses.values():
        assert m["pattern"].startswith("gather -> dequantize(fp4) -> aten.bmm")


def test_bytes_drop_by_the_dequantised_experts(zoo):
    name, _, _, _, _, report = zoo
    esize = 4 if name == "float32" else 2
    for s in _grouped_sites(report):
        assert s["symbols"] == {"B": N_TOKENS}
        n, k, topk = s["detail"]["N"], s["detail"]["K"], s["detail"]["topk"]
        # the unfused chain writes and re-reads [N, k, out, K] dequantised experts
        assert s["bytes_before_value"] - s["bytes_after_value"] >= 2 * N_TOKENS * topk * n * k * esize
        # what is left: the selected experts' FP4 bytes (codes + scales), x and y
        w_bytes = N_TOKENS * topk * n * (k // 2 + k // 32)
        x_rows = N_TOKENS * (topk if s["detail"]["x"] == "per_expert" else 1)
        assert s["bytes_after_value"] == w_bytes + (x_rows * k + N_TOKENS * topk * n) * esize


def test_switching_dispatch_off_keeps_the_gathered_chain():
    import dsv41

    model = RoutedExperts(ModelConfig.preset("tiny"), "checkpoint", torch.float32)
    model.init_random(torch.Generator().manual_seed(3))
    x, route, idx, _ = _inputs(torch.float32)
    with torch.no_grad(), capture_graphs() as graphs:
        got = torch.compile(model.forward_gather, backend="dsv41", dynamic=False,
                            options={"disable": ["dispatch"], "debug": True})(x, route, idx)
        assert _close(got, model.forward_gather(x, route, idx), 1e-6)
    report = dsv41.last_report()
    fam = _dispatch(report)
    assert fam["enabled"] is False and fam["matches"] == 0
    ops = ops_after(graphs)
    assert ops["dsv41.grouped_linear_fp4"] == ops["dsv41.grouped_linear_fp4_pair"] == 0
    assert ops["aten.bmm.default"] > 0


# ------------------------------------------------------------------------------------------- tiny model
def test_tiny_decode_fuses_three_gathered_matmuls_per_moe_layer(tiny_dsv41):
    # fresh_tiny_dsv41.py decodes one sequence one token per step: N = 1 token, so N * k <= E selects the gather
    # path (RoutedExperts.forward) in every layer, whose w1, w3 and w2 einsums each become one grouped GEMV.
    cfg = ModelConfig.preset("tiny")
    assert 1 * cfg.num_experts_per_tok <= cfg.n_routed_experts
    expected = 3 * cfg.num_hidden_layers
    assert expected == 24
    fam = tiny_dsv41["report"]["families"]["dispatch"]
    sites = [s for s in fam["sites"] if s["pattern"].startswith("grouped_linear_fp4")]
    assert len(sites) == expected
    assert {s["pattern"] for s in sites} == {"grouped_linear_fp4(act_quant=True)"}
    by_code = Counter(s["location"]["code"] for s in sites)
    assert by_code == {'a = torch.einsum("nd,nkfd->nkf", xq, w1)': 8, 'b = torch.einsum("nd,nkfd->nkf", xq, w3)': 8,
                       'y = torch.einsum("nkf,nkdf->nkd", hq, w2)': 8}
    assert [m for m in fam["near_misses"] if m["pattern"].startswith("gather")] == []
    graph = tiny_dsv41["report"]["graphs"][0]
    # grouped_pair (after dispatch) joins each layer's w1 and w3, which share x and the experts, into one op
    ops = ops_after(graph)  # the JSON report keeps printed code only
    assert ops["dsv41.grouped_linear_fp4.default"] == expected // 3
    assert ops["dsv41.grouped_linear_fp4_pair.default"] == expected // 3
    pairs = tiny_dsv41["report"]["families"]["grouped_pair"]
    assert pairs["matches"] == cfg.num_hidden_layers and not pairs["near_misses"]
    assert {s["location"]["code"] for s in pairs["sites"]} == {'a = torch.einsum("nd,nkfd->nkf", xq, w1)'}
    # each took its bmm and both gathers (codes, scales) out of the graph (other families rewrite other bmms)
    defined = set(re.findall(r"^\s+(\w+) = ", graph["graph_after"], flags=re.M))
    (rec,) = [r for r in graph["records"] if r["family"] == "dispatch"]
    grouped = [m for m in rec["matches"] if m["op"] == "dsv41::grouped_linear_fp4"]
    assert len(grouped) == expected
    for m in grouped:
        assert Counter(m["ops_replaced"])["aten.bmm.default"] == 1
        assert Counter(m["ops_replaced"])["aten.index.Tensor"] == 2
        assert not defined & set(m["nodes_replaced"])
    # the expert bytes of a step: 9x (fp32: 17x) less than the dequantise -> einsum chain moved
    before = sum(s["bytes_before_value"] for s in sites)
    after = sum(s["bytes_after_value"] for s in sites)
    assert before > 10 * after
