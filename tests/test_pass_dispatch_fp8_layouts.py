"""`dispatch` family, FP8 checkpoint layouts (dsv41/passes/fp8_layouts.py): block-FP8 weights stored the way FP8
releases store them reach the fused GEMVs.

One zoo, written the way users and checkpoint loaders write FP8 layers (not dsv41's model code), compiled once
with `backend="dsv41"` (dynamic=False, debug=True, so the post-pass graph is in the report):

    hf_fp32     an `nn.Module` holding `weight` float8_e4m3fn [200, 300] and `weight_scale_inv` float32 per
                128x128 block (grid [2, 3], N and K not multiples of 128), dequantised with repeat_interleave and a
                slice, `.to(x.dtype)`, F.linear with a bias; float32 x
    hf_bf16     the same module class without bias, bfloat16 x (the weight rounded to bf16 from the FP32 product)
    rows        functional: 1x128 float32 scales [40, 3], repeat_interleave along K only, `x @ w.T`
    views       32x32 float32 scales by block views `(w.view(3, 32, 5, 32) * s[:, None, :, None]).reshape(96, 160)`,
                `torch.matmul(x, w.t())`
    kron        bfloat16: `w.to(bf16) * torch.kron(s, ones(128, 128)).to(bf16)` (the scale rounded to bf16 first)
    own         dsv41's UE8M0 32x32 layout with the codes typed float8_e4m3fn (exp2(e - 127)) -> linear_fp8_block

and one look-alike per layout that must stay unfused with the named near-miss:

    divisor     128x128: the codes divided by the scale                                     -> scale_divisor
    wrong_block 32x32 grid [8, 12] expanded per 128 rows and columns                         -> block_size
    clamp       1x128 scales clamped to [1e-3, 1e3] (inactive on ordinary probes)            -> scale_range
    plain       UE8M0 32x32 float8 codes, the byte used as a plain multiplier               -> ue8m0_scale_rule

References are float64, written here: E4M3 bytes decoded from their bit layout, scales as stored (UE8M0 as
2^(e-127)), y = x @ W^T. Tolerances, relative to the output's largest magnitude: float32 outputs 1e-5 (FP32
products and sums), bfloat16 outputs 2e-2 (the weight and x rounded to bf16: 2^-9 each, the output 2^-9, summed
over K in FP32).
The clamp look-alike has K = 384, a multiple of its block: with K = 300 the unfused chain
`w.float() * s.repeat_interleave(128, 1)[:, :300]` is miscompiled by Inductor's CPU backend in torch 2.13 (wrong
values even for a bfloat16 w; K = 256 or 384 are right), which would hide what this test checks.
The smaller tests run the family on `make_fx` graphs: layouts no fused op takes are reported (per-channel and
bfloat16 scales, a transposed grid, E5M2 codes), and the eager roundings of fp16 weights are told apart.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from zoo_sites import site_markers, site_of

from dsv41.passes.testing import capture_graphs, ops_after

SITES = site_markers(__file__)
FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


# ------------------------------------------------------------------------------------------- float64 reference
def e4m3_value(codes: torch.Tensor) -> torch.Tensor:
    """float64 value of E4M3 (fn) codes (uint8 bit patterns or float8_e4m3fn), from the bit layout."""
    b = codes.view(torch.uint8).long()
    e, m = (b >> 3) & 15, (b & 7).double()
    mag = torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(2.0, (e - 7).double()))
    v = torch.where(b >= 128, -mag, mag)
    return torch.where((b & 127) == 127, torch.full_like(v, float("nan")), v)


def ref_weight(codes, scale, bn, bk) -> torch.Tensor:
    """float64 W [N, K] = code * scale[n // bn, k // bk] (UE8M0 byte e: 2^(e-127))."""
    n, k = codes.shape
    s = torch.pow(2.0, scale.double() - 127) if scale.dtype == torch.uint8 else scale.double()
    return e4m3_value(codes) * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def block_fp8(w: torch.Tensor, bn: int, bk: int):
    """DeepSeek-style block FP8 of a float weight [N, K]: scale_inv = amax / 448 per bn x bk block (float32), codes
    = w / scale_inv rounded to float8_e4m3fn."""
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    pad = torch.zeros(gn * bn, gk * bk)
    pad[:n, :k] = w
    s = (pad.view(gn, bn, gk, bk).abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    codes = (w / s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]).to(FP8)
    return codes, s


def ue8m0_fp8(w: torch.Tensor):
    """dsv41's own layout of a float weight: UE8M0 exponent e = ceil(log2(amax / 448)) + 127 per 32x32 block."""
    codes, s = block_fp8(w, 32, 32)
    e = (torch.ceil(torch.log2(s)) + 127).to(torch.uint8)
    n, k = w.shape
    exact = torch.pow(2.0, e.double() - 127).float().repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
    return (w / exact).to(FP8), e


def _frozen(t):
    return nn.Parameter(t, requires_grad=False)


# ------------------------------------------------------------------------------------------- zoo
class Fp8BlockLinear(nn.Module):
    """A linear layer as FP8 checkpoints ship it: `weight` float8_e4m3fn [out, in], `weight_scale_inv` float32 per
    `block_size` block, dequantised in forward (no torch._scaled_mm)."""

    def __init__(self, in_features, out_features, bias, gen, block_size=(128, 128)):
        super().__init__()
        self.in_features, self.out_features, self.block_size = in_features, out_features, block_size
        w = torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)
        codes, s = block_fp8(w, *block_size)
        self.weight = _frozen(codes)
        self.weight_scale_inv = _frozen(s)
        self.bias = _frozen(torch.randn(out_features, generator=gen) * 0.1) if bias else None

    def forward(self, x):
        bn, bk = self.block_size
        s = self.weight_scale_inv.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
        w = self.weight.to(torch.float32) * s[: self.out_features, : self.in_features]
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w.to(x.dtype), bias)


def rows_linear(x, w, s):
    """1x128 blocks: one float32 scale per row and 128 columns."""
    deq = w.float() * s.repeat_interleave(128, dim=1)[:, : w.shape[1]]
    return x @ deq.T  # site:rows


def views_linear(x, w, s):
    """32x32 blocks by block views (N, K multiples of 32)."""
    n, k = w.shape
    deq = (w.float().view(n // 32, 32, k // 32, 32) * s[:, None, :, None]).reshape(n, k)
    return torch.matmul(x, deq.t())  # site:views


def kron_linear(x, w, s):
    """bfloat16 throughout: the scale grid broadcast by a Kronecker product and rounded to bf16."""
    deq = w.to(torch.bfloat16) * torch.kron(s, torch.ones(128, 128)).to(torch.bfloat16)
    return F.linear(x.to(torch.bfloat16), deq)  # site:kron


def own_linear(x, w, e, plain=False):
    """dsv41's layout (UE8M0 per 32x32) with float8-typed codes; `plain` uses the byte itself as the scale."""
    s = e.float() if plain else torch.exp2(e.float() - 127)
    deq = w.float() * s.repeat_interleave(32, 0).repeat_interleave(32, 1)[: w.shape[0], : w.shape[1]]
    return F.linear(x, deq)


class LayoutZoo(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.hf_fp32 = Fp8BlockLinear(300, 200, True, gen)
        self.hf_bf16 = Fp8BlockLinear(300, 200, False, gen)
        for name, (n, k, bn, bk) in dict(rows=(40, 300, 1, 128), views=(96, 160, 32, 32), kron=(256, 384, 128, 128),
                                         divisor=(200, 300, 128, 128), wrong_block=(256, 384, 32, 32),
                                         clamp=(40, 384, 1, 128)).items():
            codes, s = block_fp8(torch.randn(n, k, generator=gen) / math.sqrt(k), bn, bk)
            setattr(self, f"{name}_w", _frozen(codes))
            setattr(self, f"{name}_s", _frozen(s))
        for name in ("own", "plain"):
            codes, e = ue8m0_fp8(torch.randn(72, 96, generator=gen) / math.sqrt(96))
            setattr(self, f"{name}_w", _frozen(codes))
            setattr(self, f"{name}_s", _frozen(e))

    def forward(self, x300, x160, x384, x96):
        y_hf32 = self.hf_fp32(x300)  # site:hf_fp32
        y_hf16 = self.hf_bf16(x300.to(torch.bfloat16))  # site:hf_bf16
        y_rows = rows_linear(x300, self.rows_w, self.rows_s)
        y_views = views_linear(x160, self.views_w, self.views_s)
        y_kron = kron_linear(x384, self.kron_w, self.kron_s)
        y_own = own_linear(x96, self.own_w, self.own_s)  # site:own
        s = self.divisor_s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
        y_div = F.linear(x300, self.divisor_w.float() / s)  # site:divisor
        s = self.wrong_block_s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:256, :384]
        y_wb = x384 @ (self.wrong_block_w.float() * s).T  # site:wrong_block
        s = self.clamp_s.clamp(1e-3, 1e3).repeat_interleave(128, 1)
        y_clamp = F.linear(x384, self.clamp_w.float() * s)  # site:clamp
        y_plain = own_linear(x96, self.plain_w, self.plain_s, plain=True)  # site:plain
        return y_hf32, y_hf16, y_rows, y_views, y_kron, y_own, y_div, y_wb, y_clamp, y_plain


FUSED = {  # site -> (pattern, weight_dtype, scale_cast)
    "hf_fp32": ("linear_fp8_scaled(fp32 128x128)", "float32", "float32"),
    "hf_bf16": ("linear_fp8_scaled(fp32 128x128)", "bfloat16", "float32"),
    "rows": ("linear_fp8_scaled(fp32 1x128)", "float32", "float32"),
    "views": ("linear_fp8_scaled(fp32 32x32)", "float32", "float32"),
    "kron": ("linear_fp8_scaled(fp32 128x128)", "bfloat16", "bfloat16"),
    "own": ("linear_fp8_block(act_quant=False)", "float32", "float32"),
}
MISSES = {"divisor": "scale_divisor", "wrong_block": "block_size", "clamp": "scale_range", "plain": "ue8m0_scale_rule"}


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randn(2, 3, k, generator=gen) * 2 for k in (300, 160, 384, 96))


@pytest.fixture(scope="module")
def zoo():
    """(model, inputs, eager outputs, compiled outputs, dispatch report dict, post-pass GraphModule, Inductor code)."""
    import dsv41
    from torch._inductor.utils import run_and_get_code

    model = LayoutZoo().eval()
    xs = _inputs()
    with torch.no_grad(), capture_graphs() as graphs:
        eager = model(*xs)
        compiled = torch.compile(model, backend="dsv41", options={"debug": True}, dynamic=False)
        out, code = run_and_get_code(compiled, *xs)
    report = dsv41.last_report()
    (gm,) = graphs
    return model, xs, eager, out, report.to_dict()["families"]["dispatch"], gm, "\n".join(code)


def _by_site(records):
    return {site_of(r, __file__, SITES, fn=None, names_only=True): r for r in records}


# ------------------------------------------------------------------------------------------- tests
def test_every_layout_fuses_once_with_the_rounding_eager_makes(zoo):
    *_, fam, _, _ = zoo
    sites = _by_site(fam["sites"])
    assert fam["matches"] == len(FUSED) and set(sites) == set(FUSED), [s["pattern"] for s in fam["sites"]]
    for name, (pattern, weight_dtype, scale_cast) in FUSED.items():
        d = sites[name]["detail"]
        assert (sites[name]["pattern"], d["weight_dtype"], d["scale_cast"]) == (pattern, weight_dtype, scale_cast), name
        assert d["format"] == "fp8_scaled" and d["act_quant"] is False
    assert sites["hf_fp32"]["detail"]["bias"] is True
    assert sites["hf_fp32"]["detail"]["layout"] == "float8_e4m3fn codes, float32 scales per 128x128 block"
    assert (sites["hf_fp32"]["detail"]["N"], sites["hf_fp32"]["detail"]["K"]) == (200, 300)


def test_look_alikes_are_near_misses_naming_the_rule_they_follow(zoo):
    *_, fam, _, _ = zoo
    misses = _by_site(fam["near_misses"])
    assert len(fam["near_misses"]) == len(MISSES)
    assert {name: m["check"] for name, m in misses.items()} == MISSES
    assert "divided by the scale" in misses["divisor"]["reason"]
    assert "per 128x128 block" in misses["wrong_block"]["reason"] and "32x32" in misses["wrong_block"]["reason"]
    assert "2^-126" in misses["clamp"]["reason"]
    assert "2^(e-127)" in misses["plain"]["reason"]


def test_the_dequantise_chains_are_gone_and_the_codes_are_viewed_not_copied(zoo):
    *_, fam, after, code = zoo
    ops = ops_after(after)
    assert ops["dsv41.linear_fp8_scaled.default"] == 5
    assert ops["dsv41.linear_fp8_block.default"] == 1
    # every fused weight is float8-typed: its codes reach the op through one dtype view each
    assert ops["aten.view.dtype"] == 6
    # only the four look-alikes still multiply (mm / addmm) and decode float8 codes
    assert ops["aten.mm"] + ops["aten.addmm"] == len(MISSES)
    for s in fam["sites"]:
        assert {"aten.mul.Tensor"} <= set(s["ops_replaced"]) or s["detail"]["layout"].endswith("32x32 block")
        assert "aten.mm.default" in s["ops_replaced"] or "aten.addmm.default" in s["ops_replaced"]
    for s in fam["sites"]:
        assert s["nodes_replaced"] >= 4
    # Inductor passes the reinterpreted codes straight to the op: no kernel writes a uint8 copy of them.
    calls = [_call_args(line) for line in code.splitlines()
             if re.search(r"= torch\.ops\.dsv41\.linear_fp8_(scaled|block)\.default\(", line)]
    assert len(calls) == 6, calls
    assert all(re.match(r"(aten\.view\.dtype\(|reinterpret_tensor\()?arg\d+_\d+\b", c[1]) for c in calls), calls


def _call_args(line: str) -> list:
    """The top-level arguments of the first call on a line of Inductor's wrapper code, as strings."""
    body = line[line.index("(") + 1:]
    args, depth, cur = [], 0, ""
    for ch in body:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return args + [cur.strip()]


def test_fused_sites_equal_float64_references_and_eager(zoo):
    model, xs, eager, out, *_ = zoo
    x300, x160, x384, x96 = (x.double() for x in xs)
    hf = model.hf_fp32
    refs = {
        0: x300 @ ref_weight(hf.weight, hf.weight_scale_inv, 128, 128).T + hf.bias.double(),
        1: xs[0].to(torch.bfloat16).double() @ ref_weight(model.hf_bf16.weight, model.hf_bf16.weight_scale_inv,
                                                          128, 128).T,
        2: x300 @ ref_weight(model.rows_w, model.rows_s, 1, 128).T,
        3: x160 @ ref_weight(model.views_w, model.views_s, 32, 32).T,
        4: xs[2].to(torch.bfloat16).double() @ ref_weight(model.kron_w, model.kron_s, 128, 128).T,
        5: x96 @ ref_weight(model.own_w, model.own_s, 32, 32).T,
    }
    for i, ref in refs.items():
        tol = TOL[out[i].dtype] * float(ref.abs().max())
        assert out[i].shape == eager[i].shape and out[i].dtype == eager[i].dtype
        assert float((out[i].double() - ref).abs().max()) <= tol, i
        assert float((out[i].double() - eager[i].double()).abs().max()) <= tol, i
    for i in range(6, 10):  # the look-alikes compile to eager's numbers
        assert torch.allclose(out[i], eager[i], rtol=1e-5, atol=1e-5 * float(eager[i].abs().max())), i


# ------------------------------------------------------------------------------------------- make_fx graphs
def _run_family(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    from dsv41.passes import dispatch
    gm = make_fx(fn, tracing_mode="fake")(*args)
    rec = dispatch.DispatchFamily().run(gm)
    gm.recompile()
    return gm, rec


def _grid(s, bn, bk, n, k):
    return s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]


def test_fp8_weights_with_scales_no_fused_op_takes_are_reported():
    gen = torch.Generator().manual_seed(3)
    w = block_fp8(torch.randn(256, 384, generator=gen), 128, 128)[0]
    x = torch.randn(2, 384, generator=gen)
    cases = {
        "weight_format": (lambda x, w, s: F.linear(x, w.float() * s[:, None]), w, torch.rand(256, generator=gen)),
        "scale_dtype": (lambda x, w, s: F.linear(x, w.float() * _grid(s, 128, 128, 256, 384).float()), w,
                        torch.rand(2, 3, generator=gen).bfloat16()),
        "scale_grid": (lambda x, w, s: F.linear(x, w.float() * _grid(s.t(), 128, 128, 256, 384)), w,
                       torch.rand(3, 2, generator=gen)),
        "codes_dtype": (lambda x, w, s: F.linear(x, w.float() * _grid(s, 128, 128, 256, 384)),
                        w.float().to(torch.float8_e5m2), torch.rand(2, 3, generator=gen)),
    }
    for check, (fn, wt, s) in cases.items():
        gm, rec = _run_family(fn, x, wt, s)
        assert not rec.matches and [m.check for m in rec.near_misses] == [check], (check, rec.near_misses)
        assert torch.equal(gm(x, wt, s), fn(x, wt, s))
    assert "stored transposed" in _run_family(cases["scale_grid"][0], x, w, cases["scale_grid"][2])[1] \
        .near_misses[0].reason


def test_a_square_grid_read_transposed_is_a_near_miss_and_the_right_one_fuses():
    gen = torch.Generator().manual_seed(4)
    w, s = block_fp8(torch.randn(384, 384, generator=gen), 128, 128)
    x = torch.randn(3, 384, generator=gen)
    _, bad = _run_family(lambda x, w, s: F.linear(x, w.float() * _grid(s.t(), 128, 128, 384, 384)), x, w, s)
    assert [m.check for m in bad.near_misses] == ["scale_grid"] and "scale[k // 128, n // 128]" in \
        bad.near_misses[0].reason
    gm, good = _run_family(lambda x, w, s: F.linear(x, w.float() * _grid(s, 128, 128, 384, 384)), x, w, s)
    assert [m.pattern for m in good.matches] == ["linear_fp8_scaled(fp32 128x128)"] and not good.near_misses
    assert torch.allclose(gm(x, w, s), x.double().matmul(ref_weight(w, s, 128, 128).T).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spelling", ["fp32_product", "fp16_operands", "uint8_codes_ue8m0", "own_k_not_32"])
def test_eager_roundings_and_stored_dtypes_become_op_arguments(spelling):
    # (w.float() * s).half() rounds the FP32 product once; w.half() * s.half() rounds the scale first; uint8 codes
    # with UE8M0 scales per 128x128; dsv41's own layout with K = 300 (not a multiple of 32: linear_fp8_block's
    # activation blocks do not fit, linear_fp8_scaled takes it). The fused graph computes eager's numbers exactly
    # (the CPU op is the reference dequantisation, bit for bit the same weight).
    gen = torch.Generator().manual_seed(5)
    w, s = block_fp8(torch.randn(200, 300, generator=gen), 128, 128)
    x = torch.randn(3, 300, generator=gen)
    e = torch.randint(118, 126, (2, 3), dtype=torch.uint8, generator=gen)
    e32 = torch.randint(118, 126, (7, 10), dtype=torch.uint8, generator=gen)
    u8 = w.view(torch.uint8)
    fn, args, want = {
        "fp32_product": (lambda x, w, s: F.linear(x, (w.float() * _grid(s, 128, 128, 200, 300)).half()),
                         (x.half(), w, s), ("float16", "float32", "linear_fp8_scaled(fp32 128x128)")),
        "fp16_operands": (lambda x, w, s: F.linear(x, w.half() * _grid(s, 128, 128, 200, 300).half()),
                          (x.half(), w, s), ("float16", "float16", "linear_fp8_scaled(fp32 128x128)")),
        "uint8_codes_ue8m0": (lambda x, w, e: x @ (w.view(FP8).float() * _grid(torch.exp2(e.float() - 127), 128,
                                                                                 128, 200, 300)).T,
                              (x, u8, e), ("float32", "float32", "linear_fp8_scaled(ue8m0 128x128)")),
        "own_k_not_32": (lambda x, w, e: F.linear(x, w.view(FP8).float() * _grid(torch.exp2(e.float() - 127), 32, 32,
                                                                                 200, 300)),
                         (x, u8, e32), ("float32", "float32", "linear_fp8_scaled(ue8m0 32x32)")),
    }[spelling]
    gm, rec = _run_family(fn, *args)
    assert not rec.near_misses and len(rec.matches) == 1, rec.near_misses
    d = dict(rec.matches[0].detail)
    assert (d["weight_dtype"], d["scale_cast"], rec.matches[0].pattern) == want
    assert torch.equal(gm(*args), fn(*args))


def test_unvalidated_op_is_gated_on_cuda_graphs(monkeypatch):
    """An op whose kernel has not yet run on a GPU (`manager.GPU_UNVALIDATED_OPS`) is not emitted for a graph on
    CUDA: the chain is a near-miss `gpu_unvalidated` and keeps eager's numbers. Simulated on CPU by gating as CUDA
    does."""
    import dsv41
    from dsv41.compiler import options as opts_mod
    from dsv41.passes import manager

    monkeypatch.setattr(manager, "GPU_UNVALIDATED_OPS", ("linear_fp8_scaled",))
    monkeypatch.setattr(opts_mod.Options, "gated_ops",
                        lambda self, on_cuda: frozenset() if self.gpu_unvalidated else frozenset({"linear_fp8_scaled"}))
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(256, 256, generator=g) * 4).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2, generator=g) + 0.5
    x = torch.randn(1, 256, generator=g)

    def layer(x, w, s):
        deq = w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return x @ deq.T

    for unvalidated, fused in ((False, False), (True, True)):
        torch._dynamo.reset()
        got = torch.compile(layer, backend="dsv41", dynamic=False,
                            options={"gpu_unvalidated": unvalidated})(x, w, s)
        torch.testing.assert_close(got, layer(x, w, s), rtol=1e-5, atol=1e-4)
        fam = dsv41.last_report().to_dict()["families"]["dispatch"]
        assert fam["matches"] == (1 if fused else 0)
        checks = [m["check"] for m in fam["near_misses"]]
        assert checks == ([] if fused else ["gpu_unvalidated"]), checks
