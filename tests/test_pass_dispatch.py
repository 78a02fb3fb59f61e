"""`dispatch` family: dequantize(weight) -> matmul becomes dsv41::linear_fp8_block / dsv41::linear_fp4.

One zoo model holds every case and is compiled once per activation dtype (module-scoped fixture, debug mode so
the post-pass graph is in the report):

    q          dsv41.model.linear.Linear, fp8_block (FP8 1x32 activation fake-quant in front)
    e          dsv41 Linear, fp4, square (N == K: W and W^T have the same shape)
    hand       nn.Linear-style layer written by hand: exp2(scale - 127) with repeat_interleave, bias (addmm),
               no activation quant
    shared     hand-written FP4 dequant through a constant E2M1 lookup table, also summed (materialised)
    lookalike  the scale byte used as a plain multiplier: must NOT fuse, must be a near-miss
    complex    a complex multiply: Inductor runs it as a fallback kernel (a slow-path finding)

References are written here in float64 (E4M3 / E2M1 decoded from their bit layouts, RNE onto the E4M3 grid);
tolerances: float32 activations 1e-5, bfloat16 activations 2e-2, relative to the output's max magnitude.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("dsv41.kernels", reason="dsv41.kernels (the fused ops) is not importable")
import dsv41.kernels  # noqa: E402,F401  registers the dsv41:: ops
from dsv41.model.linear import Linear  # noqa: E402
from dsv41.passes.testing import capture_graphs, ops_after  # noqa: E402

if not (hasattr(torch.ops.dsv41, "linear_fp8_block") and hasattr(torch.ops.dsv41, "linear_fp4")):
    pytest.skip("dsv41::linear_fp8_block / linear_fp4 are not registered", allow_module_level=True)

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SITES = {}  # marker -> line number in this file


def _site_lines():
    for i, line in enumerate(open(__file__).read().splitlines(), 1):
        m = re.search(r"# site:(\w+)$", line)
        if m:
            SITES[m.group(1)] = i
    return SITES


_site_lines()


# ------------------------------------------------------------------------------------------- references
def e4m3_values() -> torch.Tensor:
    """float64 value of every E4M3 (fn) byte, from the bit layout: 1 sign, 4 exponent (bias 7), 3 mantissa."""
    b = torch.arange(256, dtype=torch.int64)
    sign = torch.where(b >= 128, -1.0, 1.0).double()
    e = (b >> 3) & 15
    m = (b & 7).double()
    normal = torch.pow(2.0, (e - 7).double()) * (1 + m / 8)
    sub = torch.pow(2.0, torch.tensor(-6.0)).double() * (m / 8)
    v = sign * torch.where(e == 0, sub, normal)
    v[(b & 127) == 127] = float("nan")
    return v


def ref_dequant_fp8_block(codes, exps) -> torch.Tensor:
    n, k = codes.shape
    s = torch.pow(2.0, exps.double() - 127)
    s = s.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
    return e4m3_values()[codes.long()] * s


def ref_dequant_fp4(packed, exps) -> torch.Tensor:
    n = packed.shape[0]
    codes = torch.stack((packed & 15, packed >> 4), -1).reshape(n, -1).long()
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    vals = torch.where((codes & 8) != 0, -mag, mag)
    return vals * torch.pow(2.0, exps.double() - 127).repeat_interleave(32, 1)


def ref_fake_quant_fp8_1x32(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 1x32 fake-quant: scale 2^ceil(log2(amax/448)) (amax >= 1e-4, ratio in FP32), RNE onto E4M3."""
    xb = x.double().reshape(*x.shape[:-1], -1, 32)
    amax = xb.abs().amax(-1).clamp(min=1e-4).float()
    ratio = (amax / 448.0).double()
    scale = torch.pow(2.0, torch.ceil(torch.log2(ratio)))[..., None]
    q = (xb / scale).clamp(-448, 448)
    grid = e4m3_values()[:127]  # non-negative finite values, ascending
    mag = q.abs()
    hi = torch.bucketize(mag, grid).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = mag - grid[lo], grid[hi] - mag
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    r = torch.where(pick_hi, grid[hi], grid[lo]) * torch.sign(q)
    return (r * scale).reshape(x.shape)


def quantize_fp8_block_for_test(w: torch.Tensor):
    n, k = w.shape
    nb, kb = -(-n // 32), -(-k // 32)
    wp = torch.zeros(nb * 32, kb * 32)
    wp[:n, :k] = w
    amax = wp.view(nb, 32, kb, 32).abs().amax(dim=(1, 3)).clamp(min=1e-4)
    e = (torch.ceil(torch.log2(amax / 448)) + 127).to(torch.uint8)
    s = torch.pow(2.0, e.double() - 127).float().repeat_interleave(32, 0).repeat_interleave(32, 1)[:n, :k]
    return (w / s).to(torch.float8_e4m3fn).view(torch.uint8), e


def quantize_fp4_for_test(w: torch.Tensor):
    n, k = w.shape
    wb = w.view(n, k // 32, 32)
    e = (torch.ceil(torch.log2(wb.abs().amax(-1).clamp(min=1e-30) / 6)) + 127).to(torch.uint8)
    q = wb / torch.pow(2.0, e.double() - 127).float()[..., None]
    grid = torch.tensor(E2M1)
    codes = (q.abs()[..., None] - grid).abs().argmin(-1) | ((q < 0).long() << 3)
    codes = codes.view(n, k).to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), e


# ------------------------------------------------------------------------------------------- zoo
class HandFp8Linear(nn.Module):
    """nn.Linear-style layer holding block-FP8 codes and UE8M0 exponents, dequantised by hand (no act quant)."""

    def __init__(self, k, n, gen, exponent_rule: bool):
        super().__init__()
        codes, exps = quantize_fp8_block_for_test(torch.randn(n, k, generator=gen) / math.sqrt(k))
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.exps = nn.Parameter(exps, requires_grad=False)
        self.bias = nn.Parameter(torch.randn(n, generator=gen) * 0.1, requires_grad=False)
        self.exponent_rule = exponent_rule

    def dequantized(self):
        n, k = self.codes.shape
        s = torch.exp2(self.exps.float() - 127) if self.exponent_rule else self.exps.float()
        s = s.repeat_interleave(32, 0).repeat_interleave(32, 1)[:n, :k]
        return self.codes.view(torch.float8_e4m3fn).float() * s

    def forward(self, x):
        return F.linear(x, self.dequantized().to(x.dtype), self.bias.to(x.dtype))  # site:hand


class HandFp4Shared(nn.Module):
    """FP4 weights decoded through a constant E2M1 table; the dequantised weight is also summed."""

    def __init__(self, k, n, gen):
        super().__init__()
        packed, exps = quantize_fp4_for_test(torch.randn(n, k, generator=gen) / math.sqrt(k))
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.exps = nn.Parameter(exps, requires_grad=False)

    def dequantized(self, dtype):
        n = self.packed.shape[0]
        idx = torch.stack((self.packed & 15, self.packed >> 4), -1).reshape(n, -1).long()
        lut = torch.tensor(E2M1, dtype=torch.float32, device=idx.device)
        vals = torch.where((idx & 8) != 0, -lut[idx & 7], lut[idx & 7])
        w = vals.view(n, -1, 32) * torch.exp2(self.exps.float() - 127)[..., None]
        return w.reshape(n, -1).to(dtype)

    def forward(self, x):
        w = self.dequantized(x.dtype)
        return x @ w.t(), w.float().sum()  # site:shared


class DispatchZoo(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.q = Linear(64, 96, "fp8_block", dtype)
        self.q.init_random(gen)
        self.e = Linear(64, 64, "fp4", dtype)
        self.e.init_random(gen)
        self.hand = HandFp8Linear(64, 48, gen, exponent_rule=True)
        self.lookalike = HandFp8Linear(64, 48, gen, exponent_rule=False)
        self.shared = HandFp4Shared(64, 32, gen)

    def forward(self, x):
        yq = self.q(x)  # site:q
        ye = self.e(x)  # site:e
        yh = self.hand(x)
        yl = self.lookalike(x)  # site:lookalike
        ys, total = self.shared(x)
        c = torch.view_as_complex(ye.float().reshape(*ye.shape[:-1], -1, 2))
        yc = torch.view_as_real(c * c).flatten(-2)  # site:complex
        return yq, ye, yh, yl, ys, total, yc


DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 2e-2)}


@pytest.fixture(scope="module", params=list(DTYPES))
def compiled_zoo(request):
    """((dtype name, model, input, eager outputs, compiled outputs, FusionReport), post-pass GraphModules) — one
    compile per dtype."""
    import dsv41

    dtype, _ = DTYPES[request.param]
    torch.manual_seed(1)
    model = DispatchZoo(dtype).eval()
    x = (torch.randn(2, 3, 64) * 3).to(dtype)  # [B=2, L=3, K]
    with torch.no_grad(), capture_graphs() as graphs:
        eager = model(x)
        compiled = torch.compile(model, backend="dsv41", options={"debug": True}, dynamic=False)
        out = compiled(x)
    return (request.param, model, x, eager, out, dsv41.last_report()), graphs


@pytest.fixture(scope="module")
def zoo(compiled_zoo):
    """(dtype name, model, input, eager outputs, compiled outputs, FusionReport)."""
    return compiled_zoo[0]



def _dispatch(report):
    return report.to_dict()["families"]["dispatch"]


def _close(a, b, tol):
    scale = max(float(b.abs().max()), 1e-30)
    return float((a.double() - b.double()).abs().max()) <= tol * scale


# ------------------------------------------------------------------------------------------- tests
def test_dispatch_fuses_each_quantised_linear_exactly_once(zoo):
    _, _, _, _, _, report = zoo
    fam = _dispatch(report)
    assert fam["enabled"]
    assert fam["matches"] == 4, [s["pattern"] for s in fam["sites"]]
    patterns = sorted(s["pattern"] for s in fam["sites"])
    assert patterns == sorted(["linear_fp8_block(act_quant=True)", "linear_fp4(act_quant=True)",
                               "linear_fp8_block(act_quant=False)", "linear_fp4(act_quant=False)"])


def test_match_locations_point_at_user_source_lines(zoo):
    _, _, _, _, _, report = zoo
    by_pattern = {}
    for s in _dispatch(report)["sites"]:
        by_pattern[s["pattern"]] = s["location"]
    # dsv41 Linear: innermost frame is linear.py's F.linear, its caller is the zoo's line.
    q = by_pattern["linear_fp8_block(act_quant=True)"]
    assert q["file"].endswith("dsv41/model/linear.py")
    assert q["stack"][-2].endswith(f"test_pass_dispatch.py:{SITES['q']} (forward)")
    e = by_pattern["linear_fp4(act_quant=True)"]
    assert e["stack"][-2].endswith(f"test_pass_dispatch.py:{SITES['e']} (forward)")
    hand = by_pattern["linear_fp8_block(act_quant=False)"]
    assert hand["file"].endswith("test_pass_dispatch.py") and hand["line"] == SITES["hand"]
    shared = by_pattern["linear_fp4(act_quant=False)"]
    assert shared["line"] == SITES["shared"]


def test_compiled_zoo_matches_eager_and_float64_reference(zoo):
    name, model, x, eager, out, _ = zoo
    _, tol = DTYPES[name]
    for a, b in zip(out, eager):
        assert a.dtype == b.dtype and a.shape == b.shape
    for i in range(7):
        assert _close(out[i], eager[i], tol), i
    # Independent float64 references of the fused layers.
    xq = ref_fake_quant_fp8_1x32(x.float())
    yq = xq @ ref_dequant_fp8_block(model.q.weight, model.q.scale).T
    assert _close(out[0], yq, tol)
    ye = xq @ ref_dequant_fp4(model.e.weight, model.e.scale).T
    assert _close(out[1], ye, tol)
    yh = x.double() @ ref_dequant_fp8_block(model.hand.codes, model.hand.exps).T + model.hand.bias.double()
    assert _close(out[2], yh, tol)
    ws = ref_dequant_fp4(model.shared.packed, model.shared.exps)
    assert _close(out[4], x.double() @ ws.T, tol)
    assert abs(float(out[5]) - float(ws.to(x.dtype).double().sum())) <= 1e-3 * float(ws.abs().sum())


def test_fused_chains_are_gone_from_post_pass_graph(zoo, zoo_after):
    _, _, _, _, _, report = zoo
    (graph,) = report.graphs
    after = graph.graph_after
    assert after is not None, "debug=True keeps the post-pass graph"
    ops = ops_after(zoo_after)
    assert ops["dsv41.linear_fp8_block.default"] == 2
    assert ops["dsv41.linear_fp4.default"] == 2
    # The hand layer's bias matmul (addmm) was fused; the look-alike's stays.
    assert ops["aten.addmm"] == 1
    assert ops["aten.mm"] == 0
    defined = set(re.findall(r"^\s+(\w+) = ", after, flags=re.M))
    for site in _dispatch(report)["sites"]:
        if site["location"]["line"] == SITES["shared"]:
            # its dequantised weight is still read by the sum: only the transpose and the matmul go
            assert sorted(site["ops_replaced"]) == ["aten.mm.default", "aten.permute.default"]
        else:
            assert site["nodes_replaced"] > 5
        assert "aten.mm.default" in site["ops_replaced"] or "aten.addmm.default" in site["ops_replaced"]
    for rec in graph.records:
        for m in rec.matches:
            if rec.family == "dispatch":
                assert not defined & set(m.nodes_replaced), m.pattern


def test_dispatch_detects_activation_fake_quant(zoo):
    _, _, _, _, _, report = zoo
    for s in _dispatch(report)["sites"]:
        loc = s["location"]
        if loc["file"].endswith("dsv41/model/linear.py"):  # Linear fake-quantises x to FP8 1x32 first
            assert s["detail"]["act_quant"] is True, s["pattern"]
        else:  # the hand-written layers feed x straight into the matmul
            assert loc["line"] in (SITES["hand"], SITES["shared"]) and s["detail"]["act_quant"] is False


def test_scale_used_as_multiplier_is_a_reported_near_miss(zoo):
    _, _, _, _, _, report = zoo
    misses = _dispatch(report)["near_misses"]
    assert len(misses) == 1, misses
    (m,) = misses
    assert m["check"] == "ue8m0_scale_rule"
    assert "2^(e-127)" in m["reason"]
    assert m["location"]["line"] == SITES["hand"]  # the look-alike's F.linear
    assert m["location"]["stack"][-2].endswith(f":{SITES['lookalike']} (forward)")


def test_materialised_dequant_and_fallback_ops_are_findings(zoo):
    _, _, _, _, _, report = zoo
    finds = _dispatch(report)["findings"]
    mat = [f for f in finds if f["kind"] == "materialised_dequant"]
    assert len(mat) == 1 and mat[0]["location"]["line"] == SITES["shared"]
    assert "fp4 weight [32, 64]" in mat[0]["message"]
    fallback = [f for f in finds if f["kind"] == "fallback_op"]
    assert any("aten.mul.Tensor" in f["message"] and f["location"]["line"] == SITES["complex"] for f in fallback)


def test_bytes_expressions_use_batch_and_length_symbols(zoo):
    import sympy

    name, _, _, _, _, report = zoo
    B, L = sympy.symbols("B L", positive=True, integer=True)
    for s in _dispatch(report)["sites"]:
        before = sympy.sympify(s["bytes_before"], locals={"B": B, "L": L})
        after = sympy.sympify(s["bytes_after"], locals={"B": B, "L": L})
        assert before.free_symbols <= {B, L} and B in before.free_symbols
        assert s["symbols"] == {"B": 2, "L": 3}
        assert int(before.subs({B: 2, L: 3})) == s["bytes_before_value"] > s["bytes_after_value"] \
            == int(after.subs({B: 2, L: 3}))
        # the unfused chain writes and re-reads the dequantised weight: at least 2 * N * K elements more
        n, k = s["detail"]["N"], s["detail"]["K"]
        esize = 4 if name == "float32" else 2
        assert s["bytes_before_value"] - s["bytes_after_value"] >= 2 * n * k * esize


# ------------------------------------------------------------------------------------------- tiny model
def test_tiny_decode_has_one_dispatch_match_per_quantised_linear(tiny_dsv41, tiny_model):
    # Session fixture: the fresh-interpreter dsv41 run of `tiny` (tests/fresh_tiny_dsv41.py).
    # The backbone only: the DSpark stages (`mtp`) are not part of the decode step.
    n_quant = sum(1 for m in tiny_model.layers.modules() if isinstance(m, Linear) and m.fmt != "dense")
    assert n_quant == 60  # tiny: 8 layers x (wq_a, wq_b, wkv, wo_b, shared w1/w2/w3) + 3 indexer wq_b + engram wkv
    fam = tiny_dsv41["report"]["families"]["dispatch"]
    linear_sites = [s for s in fam["sites"] if s["pattern"].startswith("linear_fp8_block")]
    assert len(linear_sites) == n_quant
    assert fam["near_misses"] == []
    assert [f for f in fam["findings"] if f["kind"] == "materialised_dequant"] == []
    ops = ops_after(tiny_dsv41["report"]["graphs"][0])  # the JSON report keeps the printed code only
    # sibling_gemv (after dispatch) puts GEMVs of one x into one op: each layer's wq_a + wkv and shared w1 + w3, and
    # wq_b + the indexer's wq_b where a layer has an indexer (3 of 8): 19 ops of two; every GEMV is in one of them
    # or alone.
    groups = [len(s["detail"]["N"]) for s in tiny_dsv41["report"]["families"]["sibling_gemv"]["sites"]]
    assert groups == [2] * 19
    assert ops["dsv41.linear_fp8_block_multi"] == len(groups)
    assert ops["dsv41.linear_fp8_block"] + sum(groups) == n_quant
    # No block-FP8 weight is dequantised in the post-pass graph: its 32x32 scale expansion is gone.
    after = tiny_dsv41["report"]["graphs"][0]["graph_after"]
    before = tiny_dsv41["report"]["graphs"][0]["graph_before"]
    assert before.count("float8_e4m3fn") > after.count("float8_e4m3fn")



# ------------------------------------------------------------------------------------------- probe verdict cache
def test_a_weight_layout_is_probed_once_across_graphs_but_constants_are_not_trusted(monkeypatch):
    """A regional compile runs the passes on one graph per layer variant: the probe verdict of a weight region is
    reused in another graph with the same region signature. It is not reused for a look-alike of the same
    shapes (other ops), nor for a region reading a constant tensor, whose name (`_tensor_constant0`) says nothing
    of its values: a wrong E2M1 table under the same name must still be probed and rejected."""
    import collections

    from torch.fx.experimental.proxy_tensor import make_fx

    from dsv41.model.formats import dequantize_fp8_block, fake_quant_fp8_1x32
    from dsv41.passes import dispatch

    monkeypatch.setattr(dispatch, "_VERDICT_CACHE", collections.OrderedDict())
    probed = []
    verify = dispatch._verify_weight
    monkeypatch.setattr(dispatch, "_verify_weight", lambda cand, ev: probed.append(cand.fmt) or verify(cand, ev))
    gen = torch.Generator().manual_seed(5)
    lin = Linear(64, 96, "fp8_block", torch.float32, "cpu")
    lin.init_random(gen)
    packed, exps = quantize_fp4_for_test(torch.randn(40, 64, generator=gen) / 8)
    x = torch.randn(2, 64)

    def good(x, w, s):
        return F.linear(fake_quant_fp8_1x32(x), dequantize_fp8_block(w, s, torch.float32))

    def other_graph(x, w, s):
        return torch.relu(good(x, w, s)) * 2

    def lookalike(x, w, s):  # the scale byte as a plain multiplier
        sc = s.float().repeat_interleave(32, 0)[:96].repeat_interleave(32, 1)[:, :64]
        return F.linear(x, w.view(torch.float8_e4m3fn).float() * sc)

    def lut_linear(table):
        def fn(x, p, e):
            idx = torch.stack((p & 15, p >> 4), -1).reshape(p.shape[0], -1).long()
            lut = torch.tensor(table, dtype=torch.float32)
            vals = torch.where((idx & 8) != 0, -lut[idx & 7], lut[idx & 7])
            return x @ (vals.view(p.shape[0], -1, 32) * torch.exp2(e.float() - 127)[..., None]).reshape(
                p.shape[0], -1).t()
        return fn

    runs = [(good, lin.weight, lin.scale), (other_graph, lin.weight, lin.scale), (lookalike, lin.weight, lin.scale),
            (lut_linear(E2M1), packed, exps), (lut_linear(E2M1[::-1]), packed, exps)]
    matched = []
    for fn, w, s in runs:
        rec = dispatch.DispatchFamily().run(make_fx(fn, tracing_mode="fake")(x, w, s))
        matched.append(len(rec.matches))
    assert matched == [1, 1, 0, 1, 0]
    # good probed; other_graph served from the cache; lookalike and both table regions probed
    assert probed == ["fp8_block", "fp8_block", "fp4", "fp4"]


def test_a_weight_region_reading_another_graph_input_is_a_near_miss():
    """A weight scaled by a SymInt graph input: probing sees only the input's hint (right for c = 7 by chance of
    the construction), the fused op would not see it at all, so the region is rejected for every c."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dsv41.model.formats import dequantize_fp8_block
    from dsv41.passes import dispatch

    gen = torch.Generator().manual_seed(0)
    w = torch.randint(0, 120, (96, 64), dtype=torch.uint8, generator=gen)  # no NaN encodings
    s = torch.randint(120, 130, (3, 2), dtype=torch.uint8, generator=gen)
    x = torch.randn(2, 64)

    def fn(x, w, s, c):
        return F.linear(x, dequantize_fp8_block(w, s, torch.float32) * (c - 6))

    for c in (7, 9):
        gm = make_fx(fn, tracing_mode="symbolic")(x, w, s, c)
        rec = dispatch.DispatchFamily().run(gm)
        assert len(rec.matches) == 0 and [m.check for m in rec.near_misses] == ["region_closed"]
        assert "c_1" in rec.near_misses[0].reason
        gm.recompile()
        assert torch.equal(gm(x, w, s, c), fn(x, w, s, c))


def test_codes_held_k_by_n_and_used_as_stored_are_an_orientation_near_miss():
    """`x @ dequantize(codes [K, N])` (a checkpoint that stores the matmul's right operand as is): the fused ops read
    [N, K] rows, so the matmul stays unfused, and the report says so by name instead of only noting a materialised
    weight; the same codes read as nn.Linear's [N, K] still fuse."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dsv41.model.formats import dequantize_fp8_block
    from dsv41.passes import dispatch

    gen = torch.Generator().manual_seed(3)
    w = torch.randint(0, 120, (64, 96), dtype=torch.uint8, generator=gen)  # [K, N], no NaN encodings
    s = torch.randint(120, 130, (2, 3), dtype=torch.uint8, generator=gen)
    x = torch.randn(2, 64)

    def as_stored(x, w, s):
        return x @ dequantize_fp8_block(w, s, torch.float32)

    gm = make_fx(as_stored, tracing_mode="fake")(x, w, s)
    rec = dispatch.DispatchFamily().run(gm)
    assert len(rec.matches) == 0
    assert [m.check for m in rec.near_misses] == ["orientation"], rec.near_misses
    assert "[K, N]" in rec.near_misses[0].reason
    gm.recompile()
    assert torch.equal(gm(x, w, s), as_stored(x, w, s))

    wt, st = w.t().contiguous(), s.t().contiguous()  # the same weight held as nn.Linear holds it

    def linear(x, w, s):
        return F.linear(x, dequantize_fp8_block(w, s, torch.float32))

    rec = dispatch.DispatchFamily().run(make_fx(linear, tracing_mode="fake")(x, wt, st))
    assert len(rec.matches) == 1 and not rec.near_misses
