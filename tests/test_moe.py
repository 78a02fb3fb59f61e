"""Tests of dsv41/model/moe.py against float64 references written here (MODEL.md §2.9)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from dsv41.model import moe as moe_mod
from dsv41.model.config import ModelConfig
from dsv41.model.formats import fake_quant_fp8_1x32
from dsv41.model.moe import MoE, Expert, Gate, RoutedExperts, clamped_swiglu

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
LIMIT = 10.0


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.tiny()


# ------------------------------------------------------------------------------------------ references
def decode_fp4_1x32(packed: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """Hand decode of packed E2M1 [n, k/2] (low nibble = even element) with UE8M0 [n, k/32] -> float64."""
    p = packed.numpy().astype(np.int64)
    n, half = p.shape
    codes = np.empty((n, 2 * half), dtype=np.int64)
    codes[:, 0::2] = p & 15
    codes[:, 1::2] = p >> 4
    mag = np.array(E2M1)[codes & 7]
    vals = np.where(codes & 8, -mag, mag)
    s = np.exp2(scale.numpy().astype(np.float64) - 127.0)
    return vals * np.repeat(s, 32, axis=1)


def decode_fp8_block(codes: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """E4M3 bytes [n, k] with 32x32 UE8M0 tiles [ceil(n/32), ceil(k/32)] -> float64."""
    v = codes.view(torch.float8_e4m3fn).double().numpy()
    s = np.exp2(scale.numpy().astype(np.float64) - 127.0)
    s = np.repeat(np.repeat(s, 32, axis=0), 32, axis=1)[: v.shape[0], : v.shape[1]]
    return v * s


def fq(v: np.ndarray, on: bool) -> np.ndarray:
    """FP8 1x32 activation fake-quant (the reference's per-GEMM input quantisation) in checkpoint mode."""
    return fake_quant_fp8_1x32(torch.from_numpy(v)).numpy() if on else v


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def ref_swiglu(a: np.ndarray, b: np.ndarray, clamp: bool = True) -> np.ndarray:
    if clamp:
        a = np.minimum(a, LIMIT)
        b = np.clip(b, -LIMIT, LIMIT)
    return silu(a) * b


def ref_route(x: np.ndarray, w: np.ndarray, bias: np.ndarray, k: int, temp: float, route_scale: float):
    """float64 router of one token: (selected expert ids, weights)."""
    logits = w @ x / temp
    s = np.sqrt(np.logaddexp(0.0, logits))
    order = sorted(range(len(s)), key=lambda e: -(s[e] + bias[e]))[:k]
    sel = s[order]
    return order, sel / (sel.sum() + 1e-20) * route_scale


def expert_weights(experts: RoutedExperts, name: str, e: int) -> np.ndarray:
    w = getattr(experts, name)[e]
    if experts.weight_mode == "checkpoint":
        return decode_fp4_1x32(w, getattr(experts, name + "_scale")[e])
    return w.double().numpy()


def linear_weight(lin) -> np.ndarray:
    if lin.fmt == "fp8_block":
        return decode_fp8_block(lin.weight, lin.scale)
    return lin.weight.double().numpy()


def ref_moe(moe: MoE, x: torch.Tensor, mode: str) -> np.ndarray:
    """Plain-Python loops over tokens and selected experts with dequantised float64 weights."""
    q = mode == "checkpoint"
    g = moe.gate
    gw, gb = g.weight.double().numpy(), g.bias.double().numpy()
    xs = x.reshape(-1, x.shape[-1]).double().numpy()
    ex, sh = moe.experts, moe.shared_experts
    out = np.zeros_like(xs)
    for n in range(xs.shape[0]):
        sel, wts = ref_route(xs[n], gw, gb, g.topk, g.gate_temp, g.route_scale)
        xq = fq(xs[n], q)
        for e, r in zip(sel, wts):
            h = ref_swiglu(expert_weights(ex, "w1", e) @ xq, expert_weights(ex, "w3", e) @ xq) * r
            out[n] += expert_weights(ex, "w2", e) @ fq(h, q)
        h = ref_swiglu(linear_weight(sh.w1) @ xq, linear_weight(sh.w3) @ xq)
        out[n] += linear_weight(sh.w2) @ fq(h, q)
    return out.reshape(x.shape)


def build_moe(cfg, mode, dtype, seed=0) -> MoE:
    m = MoE(cfg, mode, dtype)
    m.init_random(torch.Generator().manual_seed(seed))
    return m


# ------------------------------------------------------------------------------------------ router
def test_router_selects_on_biased_scores_but_weights_unbiased_scores(cfg):
    gate = Gate(cfg, "checkpoint", torch.float32)
    gate.init_random(torch.Generator().manual_seed(1))
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    s_unbiased = torch.sqrt(torch.nn.functional.softplus(x.double() @ gate.weight.double().t()))
    # Push the two lowest-scoring experts of every token to the top via a big bias (token 0's choice).
    low = torch.argsort(s_unbiased[0])[:2]
    with torch.no_grad():
        gate.bias.zero_()
        gate.bias[low] = 5.0
    w, idx = gate(x)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64 and w.shape == idx.shape == (6, cfg.num_experts_per_tok)
    assert set(idx[0].tolist()) == set(low.tolist())  # the bias changed the selection
    gw, gb = gate.weight.double().numpy(), gate.bias.double().numpy()
    for n in range(6):
        sel, want = ref_route(x[n].double().numpy(), gw, gb, gate.topk, 1.0, cfg.routed_scaling_factor)
        assert idx[n].tolist() == sel
        np.testing.assert_allclose(w[n].double().numpy(), want, rtol=1e-5)
        # The biased scores would give different weights: the test distinguishes the two formulas.
        s_b = s_unbiased[n, sel].numpy() + gb[sel]
        assert not np.allclose(want, s_b / s_b.sum() * cfg.routed_scaling_factor, rtol=1e-3)


def test_router_divides_logits_by_gate_temp(cfg):
    hot = dataclasses.replace(cfg, gate_temp=2.5)
    gate = Gate(hot, "bf16", torch.float32)
    gate.init_random(torch.Generator().manual_seed(3))
    x = torch.randn(4, cfg.hidden_size, generator=torch.Generator().manual_seed(4)) * 3
    w, idx = gate(x)
    for n in range(4):
        sel, want = ref_route(x[n].double().numpy(), gate.weight.double().numpy(), gate.bias.double().numpy(),
                              gate.topk, 2.5, cfg.routed_scaling_factor)
        assert idx[n].tolist() == sel
        np.testing.assert_allclose(w[n].double().numpy(), want, rtol=1e-5)


# ------------------------------------------------------------------------------------------ SwiGLU clamps
def test_clamped_swiglu_clamps_gate_above_and_up_both_sides():
    a = torch.tensor([20.0, -20.0, 5.0, 12.0])
    b = torch.tensor([15.0, -15.0, 3.0, -11.0])
    got = clamped_swiglu(a.to(torch.bfloat16), b.to(torch.bfloat16), LIMIT)
    assert got.dtype == torch.float32
    want = ref_swiglu(a.double().numpy(), b.double().numpy())
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-6)
    # a = -20 stays -20 (no lower clamp on the gate): silu(-20) * -10.
    np.testing.assert_allclose(float(got[1]), -20.0 / (1 + math.exp(20.0)) * -10.0, rtol=1e-5)


def test_shared_expert_clamps_projections_beyond_limit(cfg):
    ex = Expert(cfg, "bf16", torch.float32)
    ex.init_random(torch.Generator().manual_seed(5))
    x = torch.randn(4, cfg.hidden_size, generator=torch.Generator().manual_seed(6)) * 30
    w1, w2, w3 = (linear_weight(l) for l in (ex.w1, ex.w2, ex.w3))
    xd = x.double().numpy()
    a, b = xd @ w1.T, xd @ w3.T
    assert (a > LIMIT).any() and (b > LIMIT).any() and (b < -LIMIT).any()  # the clamps bite
    want = ref_swiglu(a, b) @ w2.T
    got = ex(x)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-4, atol=1e-4)
    unclamped = ref_swiglu(a, b, clamp=False) @ w2.T
    assert np.abs(unclamped - want).max() > 1.0


# ------------------------------------------------------------------------------------------ routed paths
def _routed_case(cfg, mode, dtype, seed: int, n: int, x_scale: float):
    """Seeded RoutedExperts and n tokens routed to k distinct experts each: (experts, x [n, d], weights, indices)."""
    ex = RoutedExperts(cfg, mode, dtype)
    ex.init_random(torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1)
    k = cfg.num_experts_per_tok
    x = torch.randn(n, cfg.hidden_size, generator=gen) * x_scale
    idx = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[:k] for _ in range(n)])
    return ex, x, torch.rand(n, k, generator=gen) + 0.1, idx


@pytest.mark.parametrize("mode", ["checkpoint", "bf16"])
def test_gather_path_equals_dense_path(cfg, mode):
    n = 5
    ex, x, w, idx = _routed_case(cfg, mode, torch.float32, 7, n, 4.0)
    g = ex.forward_gather(x, w, idx)
    d = ex.forward_dense(x, w, idx)
    assert g.dtype == d.dtype == torch.float32 and g.shape == d.shape == (n, cfg.hidden_size)
    torch.testing.assert_close(g, d, rtol=1e-5, atol=1e-5)


def test_forward_picks_gather_for_decode_and_dense_for_prefill(cfg, monkeypatch):
    ex = RoutedExperts(cfg, "bf16", torch.float32)
    ex.init_random(torch.Generator().manual_seed(9))
    calls = []
    monkeypatch.setattr(ex, "forward_gather", lambda *a: calls.append("gather") or torch.zeros(1))
    monkeypatch.setattr(ex, "forward_dense", lambda *a: calls.append("dense") or torch.zeros(1))
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    for n in (1, e // k, e // k + 1):
        ex(torch.zeros(n, cfg.hidden_size), torch.zeros(n, k), torch.zeros(n, k, dtype=torch.int64))
    assert calls == ["gather", "gather", "dense"]


def test_dense_path_chunks_tokens_without_changing_results(cfg, monkeypatch):
    ex = RoutedExperts(cfg, "checkpoint", torch.float32)
    ex.init_random(torch.Generator().manual_seed(10))
    gen = torch.Generator().manual_seed(11)
    n, k = 7, cfg.num_experts_per_tok
    x = torch.randn(n, cfg.hidden_size, generator=gen)
    idx = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=gen)
    whole = ex.forward_dense(x, w, idx)
    monkeypatch.setattr(moe_mod, "DENSE_TOKEN_CHUNK", 3)
    torch.testing.assert_close(ex.forward_dense(x, w, idx), whole, rtol=1e-6, atol=1e-6)


def _dense_one_expert_at_a_time(ex, x, weights, indices):
    """The dense path as first written, one expert at a time (dequantise, two GEMMs, SwiGLU, routing weight,
    FP8 re-quantisation, GEMM, FP32 sum in expert order): the reference the grouped path must equal bit for bit."""
    linear = torch.nn.functional.linear
    n, chunk = x.shape[0], moe_mod.DENSE_TOKEN_CHUNK
    route = torch.zeros(n, ex.n_experts).scatter(1, indices, weights.float())
    xq = ex._act_quant(x.to(ex.dtype))
    out = torch.zeros(n, ex.dim)
    for e in range(ex.n_experts):
        w1, w2, w3 = (ex.dequantized_weight(name, e) for name in ("w1", "w2", "w3"))
        parts = []
        for start in range(0, n, chunk):  # GEMMs of the same row count as the grouped path's
            xc = xq[start:start + chunk]
            h = clamped_swiglu(linear(xc, w1), linear(xc, w3), ex.limit) * route[start:start + chunk, e:e + 1]
            parts.append(linear(ex._act_quant(h.to(ex.dtype)), w2).float())
        out = out + torch.cat(parts)
    return out


@pytest.mark.parametrize("mode,dtype", [("checkpoint", torch.float32), ("checkpoint", torch.bfloat16),
                                        ("bf16", torch.bfloat16), ("bf16", torch.float32)])
@pytest.mark.parametrize("group", [1, 3, None])  # one expert per group, a ragged last group, all at once
def test_dense_path_groups_experts_bit_identically(cfg, monkeypatch, mode, dtype, group):
    """Experts run in groups (elementwise steps batched, GEMMs per expert, each row summing the experts in order):
    the same bits as one expert at a time, for any group size and with token chunks. Top-k 4 of 8, so a row sums
    four non-zero terms and a different summation order would show. One CPU thread: with more, ATen's vector /
    scalar `exp` split follows the tensor size (the forward_dense docstring)."""
    cfg4 = dataclasses.replace(cfg, num_experts_per_tok=4)
    n = 9
    ex, x, w, idx = _routed_case(cfg4, mode, dtype, 12, n, 3.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = _dense_one_expert_at_a_time(ex, x, w, idx)
        if group is not None:
            per_expert = cfg4.hidden_size * cfg4.moe_intermediate_size * (3 * dtype.itemsize
                                                                          + moe_mod._DENSE_DEQUANT_TEMP_BYTES) \
                + 8 * n * cfg4.moe_intermediate_size * 4
            monkeypatch.setattr(moe_mod, "_DENSE_GROUP_BYTES", group * per_expert)
            assert ex._dense_group(n) == group
        else:
            assert ex._dense_group(n) == cfg4.n_routed_experts
        assert torch.equal(ex.forward_dense(x, w, idx), want)
        monkeypatch.setattr(moe_mod, "DENSE_TOKEN_CHUNK", 4)
        assert torch.equal(ex.forward_dense(x, w, idx), _dense_one_expert_at_a_time(ex, x, w, idx))
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------ whole MoE
@pytest.mark.parametrize("mode", ["checkpoint", "bf16"])
@pytest.mark.parametrize("shape,amp", [((1, 1), 1.0), ((2, 4), 1.0), ((2, 3), 20.0)])
def test_moe_matches_float64_reference(cfg, mode, shape, amp):
    moe = build_moe(cfg, mode, torch.float32, seed=12)
    x = torch.randn(*shape, cfg.hidden_size, generator=torch.Generator().manual_seed(13)) * amp
    got = moe(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    want = ref_moe(moe, x, mode)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-4, atol=1e-4 * scale)


def test_moe_bf16_activations_track_float64_reference(cfg):
    moe = build_moe(cfg, "checkpoint", torch.bfloat16, seed=14)
    x = torch.randn(1, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16)
    got = moe(x)
    assert got.dtype == torch.bfloat16
    want = ref_moe(moe, x, "checkpoint")
    err = np.abs(got.double().numpy() - want).max()
    assert err < 0.05 * np.abs(want).max()


def test_init_random_is_seeded(cfg):
    a, b = build_moe(cfg, "checkpoint", torch.bfloat16, seed=3), build_moe(cfg, "checkpoint", torch.bfloat16, seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert list(a.experts.w1_scale.shape) == [cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size // 32]
    assert a.experts.w2.shape == (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size // 2)


def test_bf16_mode_has_dense_stacks_and_no_scales(cfg):
    m = MoE(cfg, "bf16", torch.bfloat16)
    e, f, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert m.experts.w1.shape == (e, f, d) and m.experts.w1.dtype == torch.bfloat16
    assert m.experts.w2.shape == (e, d, f)
    assert m.experts.w1_scale is None and m.experts.w2_scale is None and m.experts.w3_scale is None
    assert m.shared_experts.w1.fmt == "dense"


@pytest.mark.parametrize("cls", [Gate, Expert, RoutedExperts, MoE])
def test_bad_weight_mode_is_named_in_error(cfg, cls):
    with pytest.raises(ValueError, match="fp8_everything"):
        cls(cfg, "fp8_everything", torch.bfloat16)


def test_bad_input_shapes_raise(cfg):
    m = MoE(cfg, "bf16", torch.float32)
    with pytest.raises(ValueError, match="MoE expects"):
        m(torch.zeros(2, cfg.hidden_size))
    with pytest.raises(ValueError, match="weights and indices"):
        m.experts(torch.zeros(2, cfg.hidden_size), torch.zeros(2, 1), torch.zeros(2, 1, dtype=torch.int64))


# ------------------------------------------------------------------------------------------ compile
@pytest.mark.parametrize("tokens", [1, 6])  # 1: gather (decode) path; 6: dense path (6 * k > E)
def test_moe_compiles_fullgraph_and_matches_eager(cfg, tokens):
    moe = build_moe(cfg, "checkpoint", torch.bfloat16, seed=16)
    x = torch.randn(1, tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(17)).to(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), moe(x), rtol=0, atol=0)
