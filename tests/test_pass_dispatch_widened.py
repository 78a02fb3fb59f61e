"""`dispatch` family: gathered FP4 experts fed by an activation fake-quantised in float32 and cast to bfloat16
still fuse with act_quant.

Before torch 2.13, Inductor's joint-graph pass `pointless_convert` turns `fake_quant(h.to(bf16))` (h float32, as
in `RoutedExperts.forward_gather`'s w2 input) into `fake_quant(h).to(bf16)`: the quantiser then reads the float32
h. On torch 2.11 the dispatch pass found no bfloat16 quantiser input there and fused the h200 graph's 40 MoE w2
sites with act_quant=False, which keeps them off the tensor-core expert kernel (measured on the H200, session 22).
This file writes the float32 form directly, so it is tested on every torch version:

    experts  einsum over gathered FP4 experts with xq = fake_quant(h).to(bf16) -> grouped_linear_fp4(h, ..., True)
    dense    F.linear(xq, dequant_fp8_block(W), bias): the dense GEMVs do not widen (measured slower with a float32
             quantiser input), so act_quant=False on the bfloat16 xq
    narrow   fake_quant(g.to(bf16)) (the eager model's form): the bfloat16 tensor is the op's x, not its upcast

and look-alike quantisers (a clamp, NaN replaced, large values masked, another amax floor) that agree with the
quantiser on ordinary activations only: they must stay unfused (act_quant=False) and compile to eager's numbers.

References are float64, written here or in the sibling test files (E4M3 grid from its bit layout); tolerance 2e-2
of the output's max magnitude (bfloat16 outputs).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from dsv41.model.formats import fake_quant_fp8_1x32
from test_pass_dispatch import quantize_fp8_block_for_test, ref_dequant_fp8_block, ref_fake_quant_fp8_1x32
from test_pass_dispatch_gathered import hand_decode, quantize_experts, ref_experts

from dsv41.passes.testing import capture_graphs, ops_after

T, K, N, F_OUT, E, TOPK = 3, 96, 64, 40, 6, 2
TOL = 2e-2


class WidenedQuant(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        codes, exps = quantize_fp8_block_for_test(torch.randn(N, K, generator=gen) / math.sqrt(K))
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.exps = nn.Parameter(exps, requires_grad=False)
        self.bias = nn.Parameter((torch.randn(N, generator=gen) * 0.1).to(torch.bfloat16), requires_grad=False)
        ecodes, eexps = quantize_experts(torch.randn(E, F_OUT, K, generator=gen) / math.sqrt(K))
        self.ecodes = nn.Parameter(ecodes, requires_grad=False)
        self.eexps = nn.Parameter(eexps, requires_grad=False)

    def dense_weight(self):
        s = torch.exp2(self.exps.float() - 127).repeat_interleave(32, 0).repeat_interleave(32, 1)[:N, :K]
        return (self.codes.view(torch.float8_e4m3fn).float() * s).to(torch.bfloat16)

    def forward(self, h, g, idx):
        xq = fake_quant_fp8_1x32(h).to(torch.bfloat16)
        dense = F.linear(xq, self.dense_weight(), self.bias)
        w = hand_decode(self.ecodes[idx], self.eexps[idx], torch.bfloat16)
        experts = torch.einsum("nd,nkfd->nkf", xq, w)
        narrow = F.linear(fake_quant_fp8_1x32(g.to(torch.bfloat16)), self.dense_weight())
        return dense, experts, narrow


def _inputs():
    gen = torch.Generator().manual_seed(1)
    # Block magnitudes 2^-6..2^6, so the blocks' scales differ.
    mag = torch.exp2(torch.randint(-6, 7, (T, K // 32, 1), generator=gen).float())
    h = (torch.randn(T, K // 32, 32, generator=gen) * mag).reshape(T, K)
    g = torch.randn(T, K, generator=gen) * 3
    idx = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(T)])
    return h, g, idx


@pytest.fixture(scope="module")
def compiled_widened():
    """((model, inputs, eager outputs, compiled outputs, report), post-pass GraphModules)."""
    import dsv41

    model = WidenedQuant().eval()
    inputs = _inputs()
    with torch.no_grad(), capture_graphs() as graphs:
        eager = model(*inputs)
        out = torch.compile(model, backend="dsv41", dynamic=False, options={"debug": True})(*inputs)
    return (model, inputs, eager, out, dsv41.last_report()), graphs


@pytest.fixture(scope="module")
def widened(compiled_widened):
    """(model, inputs, eager outputs, compiled outputs, report)."""
    return compiled_widened[0]


@pytest.fixture(scope="module")
def widened_after(compiled_widened):
    """The graph as dsv41's families left it (torch.fx.GraphModule)."""
    (gm,) = compiled_widened[1]
    return gm


def _close(a, b):
    return float((a.double() - b.double()).abs().max()) <= TOL * float(b.abs().max())


def test_the_float32_quantiser_input_is_fused_with_act_quant(widened, widened_after):
    *_, report = widened
    sites = report.to_dict()["families"]["dispatch"]["sites"]
    got = sorted((s["pattern"], dict(s["detail"]).get("x_dtype")) for s in sites)
    # `narrow` reaches the passes as written (g cast to bfloat16, a graph input converted) from torch 2.13 on;
    # before, Inductor's pointless_convert has made it the float32 form too (seen with torch 2.11 on the H200),
    # which the dense GEMV does not take.
    kept = re.search(r"convert_element_type\.default\(arg\d+_1, torch\.bfloat16\)", report.graphs[0].graph_before)
    narrow = "linear_fp8_block(act_quant=True)" if kept else "linear_fp8_block(act_quant=False)"
    assert got == sorted([("grouped_linear_fp4(act_quant=True)", "float32"),
                          ("linear_fp8_block(act_quant=False)", "bfloat16"),
                          (narrow, "bfloat16")]), got
    # the experts' quantiser is gone, and the op's float32 result is rounded once to bfloat16
    assert ops_after(widened_after)["dsv41.grouped_linear_fp4.default"] == 1
    (op,) = widened_after.graph.find_nodes(op="call_function", target=torch.ops.dsv41.grouped_linear_fp4.default)
    rounds = [u for u in op.users if u.target == torch.ops.prims.convert_element_type.default]
    assert [u.args[1] for u in rounds] == [torch.bfloat16], widened_after.code


def test_compiled_matches_eager_and_the_float64_reference(widened):
    model, (h, g, idx), eager, out, _ = widened
    for a, b in zip(out, eager):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        assert _close(a, b)
    w = ref_dequant_fp8_block(model.codes, model.exps)
    xq = ref_fake_quant_fp8_1x32(h)
    assert _close(out[0], xq @ w.T + model.bias.double())
    experts = torch.einsum("nd,nkfd->nkf", xq, ref_experts(model.ecodes, model.eexps)[idx])
    assert _close(out[1], experts)
    assert _close(out[2], ref_fake_quant_fp8_1x32(g.to(torch.bfloat16)) @ w.T)


def test_bytes_count_the_float32_activation(widened):
    *_, report = widened
    for s in report.to_dict()["families"]["dispatch"]["sites"]:
        d = dict(s["detail"])
        xsize = 4 if d["x_dtype"] == "float32" else 2
        if s["op"] == "dsv41::linear_fp8_block":
            w_bytes = N * K + math.ceil(N / 32) * math.ceil(K / 32)
            bias = 2 * N if d["bias"] else 0
            assert s["bytes_after_value"] == w_bytes + T * K * xsize + T * N * 2 + bias
        else:
            w_bytes = T * TOPK * F_OUT * (K // 2 + K // 32)
            assert s["bytes_after_value"] == w_bytes + T * K * xsize + T * TOPK * F_OUT * 2


# ------------------------------------------------------------------------------------------- look-alike quantisers
def _other_floor_fq(x):
    """FP8 1x32 fake-quant with an amax floor of 1e-12 instead of the model's 1e-4 (written here)."""
    from dsv41.model.formats import FP8_MAX, e4m3_to_bytes, ue8m0_exponent, ue8m0_to_float
    shp = x.shape
    xb = x.float().view(*shp[:-1], shp[-1] // 32, 32)
    s = ue8m0_to_float(ue8m0_exponent(xb.abs().amax(-1).clamp(min=1e-12) / FP8_MAX))[..., None]
    return (e4m3_to_bytes(xb / s).view(torch.float8_e4m3fn).float() * s).view(shp).to(x.dtype)


LOOKALIKES = {
    # each is the quantiser on ordinary activations and something else at the edges
    "clamp_after": lambda h: fake_quant_fp8_1x32(h).to(torch.bfloat16).clamp(-3000, 3000),
    "nan_to_num_after": lambda h: torch.nan_to_num(fake_quant_fp8_1x32(h).to(torch.bfloat16)),
    "mask_big": lambda h: torch.where(h.abs() > 5000, 0.0, fake_quant_fp8_1x32(h)).to(torch.bfloat16),
    "clamp_blocks": lambda h: fake_quant_fp8_1x32(h.view(T, K // 32, 32).clamp(-3000, 3000)).reshape(T, K).to(
        torch.bfloat16),
    "other_floor": lambda h: _other_floor_fq(h).to(torch.bfloat16),
}


class LookalikeQuant(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        ecodes, eexps = quantize_experts(torch.randn(E, F_OUT, K, generator=gen) / math.sqrt(K))
        self.ecodes = nn.Parameter(ecodes, requires_grad=False)
        self.eexps = nn.Parameter(eexps, requires_grad=False)
        codes, exps = quantize_fp8_block_for_test(torch.randn(N, K, generator=gen) / math.sqrt(K))
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.exps = nn.Parameter(exps, requires_grad=False)

    def forward(self, h, idx):
        w = hand_decode(self.ecodes[idx], self.eexps[idx], torch.bfloat16)
        experts = tuple(torch.einsum("nd,nkfd->nkf", pre(h), w) for pre in LOOKALIKES.values())
        # and a dense FP8 GEMV (the same check): NaN replaced after the quantiser of a bfloat16 x
        s = torch.exp2(self.exps.float() - 127).repeat_interleave(32, 0).repeat_interleave(32, 1)[:N, :K]
        wd = (self.codes.view(torch.float8_e4m3fn).float() * s).to(torch.bfloat16)
        return experts + (F.linear(torch.nan_to_num(fake_quant_fp8_1x32(h.to(torch.bfloat16))), wd),)


def test_quantiser_lookalikes_are_not_taken_as_the_quantiser():
    # Found in review (session 22): these agreed with the quantiser on the old ordinary-magnitude probe only, were
    # fused as act_quant=True and changed the model's numbers (NaN where eager had none, a clamp dropped, tiny
    # activations flushed to zero). Inputs: one block with amax 1e4, one NaN, one block of magnitude 1e-10.
    import dsv41

    h, _, idx = _inputs()
    h = h.clone()
    h[0, :32] *= 1e4 / h[0, :32].abs().max()
    h[1, 37] = float("nan")
    h[2, 64:] *= 1e-10 / h[2, 64:].abs().max()
    model = LookalikeQuant().eval()
    with torch.no_grad():
        eager = model(h, idx)
        out = torch.compile(model, backend="dsv41", dynamic=False)(h, idx)
    fam = dsv41.last_report().to_dict()["families"]["dispatch"]
    got = sorted(s["pattern"] for s in fam["sites"])
    assert got == ["grouped_linear_fp4(act_quant=False)"] * len(LOOKALIKES) + ["linear_fp8_block(act_quant=False)"], got
    # the report says why each quantiser stayed: which edge block it differs on (other_floor: the tiny block)
    found = [f for f in fam["findings"] if f["kind"] == "quantiser_lookalike"]
    assert len(found) >= len(LOOKALIKES) + 1, fam["findings"]
    kinds = {re.search(r"not on a (\S+) block", f["message"]).group(1) for f in found}
    assert "tiny" in kinds and ({"huge", "nan"} & kinds), kinds
    assert all(f["location"]["file"].endswith("test_pass_dispatch_widened.py") for f in found)
    for name, a, b in zip([*LOOKALIKES, "dense_nan_to_num"], out, eager):
        assert torch.equal(a.isnan(), b.isnan()), name
        fin = ~b.isnan()
        assert float((a[fin].double() - b[fin].double()).abs().max()) <= TOL * float(b[fin].abs().max()), name
