"""Tests of dsv41::moe_router / dsv41::moe_combine (dsv41/kernels/moe.py).

Reference: written here in float64 from MODEL.md §2.9 (plain Python per token for the router: dot products,
log1p(exp), sqrt, a sort by (-biased score, index), the normalisation; float64 tensor math for the tail), never
the code under test.

Tolerances (the kernels compute in FP32, the gate GEMV in another order than the reference):
- router ids: exactly equal (the probes have no biased scores within FP32 rounding of each other, except in the
  tie tests, which pin the lower-index rule with exactly equal scores);
- router weights: |got - ref| <= 1e-6 + 1e-5 |ref| (O(1) values; FP32 rounding of a d-long dot product, the
  softplus and the normalisation stays below 1e-6 at these shapes);
- tail in FP32: <= 1e-5 (1 + |ref|); in bf16 / fp16: one rounding of the output (2^-8 / 2^-11 relative) + 1e-5.

Interpreter tests (`@interpreted`) run in a child pytest with TRITON_INTERPRET=1 unless this process was started
with it (Triton reads the variable when it is first imported; see tests/interp_harness.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from interp_harness import IN_INTERPRETER, InterpreterHarness, poison_outputs, sm90_ttir

from dsv41.kernels import moe as mk

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()

EPS = 1e-20


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output / workspace the launchers allocate starts as NaN (ids: 0xAB..), so a forgotten element fails."""
    poison_outputs(monkeypatch, mk)


# ------------------------------------------------------------------------------------------- float64 reference
def ref_router(x, W, bias, k, temp=1.0, scale=1.5, eps=EPS):
    """(weights float64 [.., k], ids int64 [.., k]) per token: MODEL.md §2.9 steps 1-4, ties to the lower index."""
    lead = tuple(x.shape[:-1])
    rows = x.double().reshape(-1, x.shape[-1]).tolist()
    wr = W.double().tolist()
    b = bias.double().tolist() if bias is not None else [0.0] * len(wr)
    ws, ids = [], []
    for r in rows:
        s = []
        for w in wr:
            lg = sum(a * c for a, c in zip(r, w)) / temp
            s.append(math.sqrt(lg if lg > 20.0 else math.log1p(math.exp(lg))))
        order = sorted(range(len(s)), key=lambda e: (-(s[e] + b[e]), e))[:k]
        tot = sum(s[e] for e in order)
        ws.append([s[e] / (tot + eps) * scale for e in order])
        ids.append(order)
    return (torch.tensor(ws, dtype=torch.float64).reshape(*lead, k),
            torch.tensor(ids, dtype=torch.int64).reshape(*lead, k))


def ref_combine(y, shared, weights):
    """float64 sum_j w_j y_j + shared."""
    yd = y.double()
    if weights is not None:
        yd = weights.double()[..., None] * yd
    return yd.sum(-2) + shared.double()


def make_router_inputs(lead, e, d, dtype, seed, logit_scale=1.0, bias_scale=0.05):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=gen).to(dtype)
    W = (torch.randn(e, d, generator=gen) * logit_scale / math.sqrt(d)).to(dtype)
    bias = torch.randn(e, generator=gen) * bias_scale
    return x, W, bias


def assert_close(got, ref, atol, rtol, what=""):
    assert not torch.isnan(got).any(), f"{what}: NaN left in the output (an element was never written)"
    err = (got.double() - ref.double()).abs()
    bound = atol + rtol * ref.double().abs()
    excess = float((err - bound).max())
    assert bool((err <= bound).all()), f"{what}: max error {float(err.max())}, worst excess {excess}"


def assert_router(got, want, what=""):
    (gw, gi), (rw, ri) = got, want
    assert gw.dtype == torch.float32 and gi.dtype == torch.int64 and gw.shape == rw.shape and gi.shape == ri.shape
    assert torch.equal(gi, ri), f"{what}: ids {gi.tolist()} != {ri.tolist()}"
    assert_close(gw, rw, 1e-6, 1e-5, what)


def assert_rounded(got, ref64, dtype, what=""):
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert_close(got, ref64, 1e-5, 1e-5, what)
    else:
        unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
        assert_close(got, ref64, 1e-5, unit + 1e-5, what)


# (lead dims, E, d, k): decode rows, odd expert counts and widths, a V4.1-sized expert count, many rows.
ROUTER_SHAPES = [((1,), 8, 96, 2), ((3,), 37, 160, 6), ((2, 3), 384, 64, 6), ((20,), 33, 50, 3)]
DTYPES = [torch.float32, torch.bfloat16]
_ids_rshape = lambda s: f"R{'x'.join(map(str, s[0]))}E{s[1]}d{s[2]}k{s[3]}"  # noqa: E731
_ids_dtype = lambda d: str(d).replace("torch.", "")  # noqa: E731


# ------------------------------------------------------------------------------------------- reference ops
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids_dtype)
def test_cpu_ops_match_the_float64_spec(dtype):
    x, W, bias = make_router_inputs((2, 3), 37, 96, dtype, 1)
    got = torch.ops.dsv41.moe_router(x, W, bias, 6, 1.0, 1.5, EPS)
    assert_router(got, ref_router(x, W, bias, 6), "router")
    gen = torch.Generator().manual_seed(2)
    y = torch.randn(2, 3, 6, 96, generator=gen).to(dtype)
    sh = torch.randn(2, 3, 96, generator=gen).to(dtype)
    assert_rounded(torch.ops.dsv41.moe_combine(y, sh, None, dtype), ref_combine(y, sh, None), dtype, "combine")
    assert_rounded(torch.ops.dsv41.moe_combine(y, sh, got[0], torch.float32), ref_combine(y, sh, got[0]),
                   torch.float32, "weighted combine")


def test_cpu_router_equals_the_model_gate():
    # The op's CPU implementation is dsv41.model.moe.Gate.forward's math (ties aside).
    from dsv41.model import ModelConfig
    from dsv41.model.moe import Gate

    cfg = ModelConfig.preset("tiny")
    gate = Gate(cfg, "checkpoint", torch.float32)
    gate.init_random(torch.Generator().manual_seed(3))
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    want_w, want_i = gate(x)
    got_w, got_i = torch.ops.dsv41.moe_router(x, gate.weight, gate.bias, gate.topk, gate.gate_temp,
                                              gate.route_scale, EPS)
    assert torch.equal(got_i, want_i) and torch.equal(got_w, want_w)


def test_ties_go_to_the_lower_expert_index():
    # x = 0: every logit is 0, every score sqrt(log 2); the bias decides, with exact ties between experts.
    x = torch.zeros(2, 16)
    W = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    bias = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.5, 0.0, 0.0, 0.5])
    w, ids = mk.reference_moe_router(x, W, bias, 3, 1.0, 1.5, EPS)
    assert ids.tolist() == [[1, 2, 4], [1, 2, 4]]
    assert torch.allclose(w, torch.full((2, 3), 0.5))
    # Without ties the selected set is torch.topk's (the model's Gate), in the same descending order.
    x, W, bias = make_router_inputs((7,), 37, 64, torch.float32, 6)
    _, ids = mk.reference_moe_router(x, W, bias, 6, 1.0, 1.5, EPS)
    from torch.nn.functional import softplus
    want = torch.topk(torch.sqrt(softplus(x @ W.t())) + bias, 6).indices
    assert torch.equal(ids, want)


# ------------------------------------------------------------------------------------------- Triton (interpreted)
@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids_dtype)
@pytest.mark.parametrize("shape", ROUTER_SHAPES, ids=_ids_rshape)
def test_triton_router_matches_float64_reference(shape, dtype, poisoned_outputs):
    lead, e, d, k = shape
    x, W, bias = make_router_inputs(lead, e, d, dtype, e + d)
    got = mk.triton_moe_router(x, W, bias, k, 1.0, 1.5, EPS)
    assert got[0].shape == lead + (k,)
    assert_router(got, ref_router(x, W, bias, k), "router")


@interpreted
@pytest.mark.parametrize("split", [1, 2, 5])
def test_triton_router_last_program_sees_every_expert_block(split, poisoned_outputs):
    # E = 40 over 1 block (no counter), 2 blocks of 32 (the second half empty) or 5 blocks of 8.
    x, W, bias = make_router_inputs((3,), 40, 72, torch.float32, 11, bias_scale=0.3)
    assert mk.router_plan(3, 40, 72, split=split)["SPLIT_E"] == split
    got = mk.triton_moe_router(x, W, bias, 4, 1.0, 1.5, EPS, split=split)
    assert_router(got, ref_router(x, W, bias, 4), f"split {split}")
    # The arrival counters are left at zero: a second launch on the same stream is just as right.
    assert_router(mk.triton_moe_router(x, W, bias, 4, 1.0, 1.5, EPS, split=split), ref_router(x, W, bias, 4))


@interpreted
@pytest.mark.parametrize("prefetch", [True, False])
def test_triton_router_with_and_without_the_weight_prefetch(prefetch, poisoned_outputs):
    # d = 200 is not a multiple of the channel block: the peeled first block and the loop's last one are masked.
    x, W, bias = make_router_inputs((2,), 24, 200, torch.bfloat16, 5)
    got = mk.triton_moe_router(x, W, bias, 3, 1.0, 1.5, EPS, prefetch=prefetch)
    assert_router(got, ref_router(x, W, bias, 3), f"prefetch {prefetch}")


def test_router_warp_count_is_checked_before_any_launch():
    x, W, bias = make_router_inputs((1,), 16, 64, torch.float32, 3)
    with pytest.raises(ValueError, match="num_warps"):
        mk.triton_moe_router(x, W, bias, 2, 1.0, 1.5, EPS, num_warps=3)


def test_router_reads_its_first_weight_block_before_the_pdl_wait():
    # Built offline for sm_90 at the h200 decode plan (E = 384, d = 5120: 4 experts x 1024 channels a program):
    # with PREFETCH one bf16 weight load precedes griddepcontrol.wait and x only follows it; without, none does.
    ptrs = dict(x_ptr="bf16", w_ptr="bf16", bias_ptr="fp32", logit_ptr="fp32", wout_ptr="fp32", ids_ptr="i64",
                cnt_ptr="i32")
    consts = dict(K=6, BLOCK_R=1, BLOCK_E=4, BLOCK_D=1024, E_PAD=512, K_PAD=8, HAS_BIAS=True, USE_PDL=True)
    scalars = {"gate_temp": "fp32", "route_scale": "fp32", "norm_eps": "fp32"}
    for prefetch, before in ((True, 1), (False, 0)):
        lines = sm90_ttir(mk._moe_router_kernel, ptrs, dict(consts, PREFETCH=prefetch), scalars).splitlines()
        wait = next(i for i, ln in enumerate(lines) if "tt.grid_dependency_wait" in ln)
        loads = [i for i, ln in enumerate(lines) if "tt.load" in ln and "!tt.ptr<bf16>" in ln]
        assert sum(i < wait for i in loads) == before and len(loads) >= 4


@interpreted
def test_triton_router_ties_go_to_the_lower_expert_index(poisoned_outputs):
    x = torch.zeros(3, 32)
    W = torch.randn(12, 32, generator=torch.Generator().manual_seed(7))
    bias = torch.tensor([0.0, 0.25, 0.0, 0.25, 0.25, 0.0, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0])
    w, ids = mk.triton_moe_router(x, W, bias, 5, 1.0, 1.5, EPS, split=3)
    assert ids.tolist() == [[1, 3, 4, 8, 0]] * 3
    assert torch.equal(ids, mk.reference_moe_router(x, W, bias, 5, 1.0, 1.5, EPS)[1])
    assert_close(w, torch.full((3, 5), 0.3, dtype=torch.float64), 1e-7, 1e-6, "equal weights")


@interpreted
def test_triton_router_softplus_across_its_threshold(poisoned_outputs):
    # Logits spread over about [-60, 60]: softplus is l above 20 and exp(l)-small far below 0.
    x, W, bias = make_router_inputs((4,), 24, 64, torch.float32, 13, logit_scale=25.0, bias_scale=0.0)
    got = mk.triton_moe_router(x, W, bias, 6, 1.0, 1.0, EPS)
    logits = x.double() @ W.double().t()
    assert float(logits.max()) > 20 and float(logits.min()) < -20
    assert_router(got, ref_router(x, W, bias, 6, scale=1.0), "wide logits")


@interpreted
def test_triton_router_honours_temperature_scale_eps_and_no_bias(poisoned_outputs):
    x, W, _ = make_router_inputs((2, 2), 19, 48, torch.bfloat16, 17)
    # eps = 0.5 is comparable to the sum of the selected scores, so a dropped eps fails.
    got = mk.triton_moe_router(x, W, None, 3, 2.0, 2.5, 0.5)
    zero = torch.zeros(19)
    assert_router(got, ref_router(x, W, zero, 3, temp=2.0, scale=2.5, eps=0.5), "no bias")


@interpreted
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_ids_dtype)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_triton_combine_matches_reference(out_dtype, weighted, poisoned_outputs):
    gen = torch.Generator().manual_seed(19)
    y = torch.randn(2, 3, 6, 200, generator=gen).to(torch.bfloat16)  # odd d: a masked tail block
    sh = torch.randn(2, 3, 200, generator=gen).to(torch.bfloat16)
    w = torch.rand(2, 3, 6, generator=gen) if weighted else None
    out = mk.triton_moe_combine(y, sh, w, out_dtype)
    assert out.shape == (2, 3, 200)
    assert_rounded(out, ref_combine(y, sh, w), out_dtype, "combine")


@interpreted
def test_triton_combine_reads_strided_rows_and_spreads_wide_rows(poisoned_outputs):
    # y as the permuted view of a batched-GEMM output (rows not contiguous), d = 1100 over several programs.
    gen = torch.Generator().manual_seed(23)
    base = torch.randn(2, 1100, 4, generator=gen)
    y = base.permute(0, 2, 1)  # [2, 4, 1100], last dim strided: the launcher makes it contiguous
    sh = torch.randn(2, 1300, generator=gen)[:, :1100]  # row stride 1300
    w = torch.rand(4, 2, generator=gen).t()  # non-contiguous weights
    assert mk.combine_plan(2, 1100) >= 128 and -(-1100 // mk.combine_plan(2, 1100)) > 1
    assert_rounded(mk.triton_moe_combine(y, sh, w, torch.float32), ref_combine(y, sh, w), torch.float32, "strided")
    y_rows = torch.randn(6, 2, 64, generator=gen)[::2]  # [3, 2, 64] with a gap between rows (no copy)
    sh_rows = torch.randn(3, 64, generator=gen)
    assert_rounded(mk.triton_moe_combine(y_rows, sh_rows, None, torch.float32), ref_combine(y_rows, sh_rows, None),
                   torch.float32, "row gaps")


def test_plans_spread_the_decode_work():
    # V4.1 at decode: 384 experts over 384 programs of one (each reads one row of W), 8 warps (the fastest plan on
    # an H100, bench/results/2026-12-07_h100_s31/router_plans.txt); prefill rows need fewer splits.
    assert mk.router_plan(1, 384, 5120) == {"BLOCK_R": 1, "BLOCK_E": 1, "BLOCK_D": 1024, "SPLIT_E": 384,
                                            "NUM_WARPS": 8}
    p = mk.router_plan(4096, 384, 5120)
    assert p["BLOCK_R"] * 512 <= 4096 and p["BLOCK_R"] * p["BLOCK_E"] * p["BLOCK_D"] <= 4096
    assert p["SPLIT_E"] * p["BLOCK_E"] >= 384
    assert mk.router_plan(1, 40, 64, split=3) == {"BLOCK_R": 1, "BLOCK_E": 16, "BLOCK_D": 64, "SPLIT_E": 3,
                                                  "NUM_WARPS": 8}
    assert p["NUM_WARPS"] == 4
    assert mk.combine_plan(1, 5120) == 128 and mk.combine_plan(64, 5120) == 1024
    with pytest.raises(ValueError, match="split"):
        mk.router_plan(1, 8, 64, split=0)


# ------------------------------------------------------------------------------------------- op registration
def test_ops_pass_torch_library_opcheck():
    x, W, bias = make_router_inputs((2, 3), 8, 32, torch.float32, 29)
    torch.library.opcheck(torch.ops.dsv41.moe_router.default, (x, W, bias, 2, 1.0, 1.5, EPS))
    torch.library.opcheck(torch.ops.dsv41.moe_router.default, (x.bfloat16(), W.bfloat16(), None, 3, 1.0, 1.0, 0.0))
    y, sh = torch.randn(2, 3, 2, 32), torch.randn(2, 3, 32)
    torch.library.opcheck(torch.ops.dsv41.moe_combine.default, (y, sh, None, torch.float32))
    torch.library.opcheck(torch.ops.dsv41.moe_combine.default, (y, sh, torch.rand(2, 3, 2), torch.bfloat16))


def test_fake_functions_give_shapes_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(2, 3, 160, dtype=torch.bfloat16)
        w, ids = torch.ops.dsv41.moe_router(x, torch.empty(384, 160, dtype=torch.bfloat16), torch.empty(384), 6,
                                            1.0, 1.5, EPS)
        assert w.shape == ids.shape == (2, 3, 6) and w.dtype == torch.float32 and ids.dtype == torch.int64
        out = torch.ops.dsv41.moe_combine(torch.empty(2, 3, 6, 160), x, w, torch.bfloat16)
        assert out.shape == (2, 3, 160) and out.dtype == torch.bfloat16


def test_bad_inputs_raise_errors_naming_the_argument():
    x, W, bias = make_router_inputs((2,), 8, 32, torch.float32, 31)
    with pytest.raises(ValueError, match="x must be"):
        mk.reference_moe_router(x[:, :16], W, bias, 2, 1.0, 1.5, EPS)
    with pytest.raises(ValueError, match="bias must be"):
        mk.reference_moe_router(x, W, bias[:7], 2, 1.0, 1.5, EPS)
    with pytest.raises(TypeError, match="bias has dtype"):
        mk.reference_moe_router(x, W, bias.double(), 2, 1.0, 1.5, EPS)
    with pytest.raises(ValueError, match="topk"):
        mk.reference_moe_router(x, W, bias, 9, 1.0, 1.5, EPS)
    with pytest.raises(ValueError, match="gate_temp"):
        mk.reference_moe_router(x, W, bias, 2, 0.0, 1.5, EPS)
    with pytest.raises(ValueError, match="norm_eps"):
        mk.reference_moe_router(x, W, bias, 2, 1.0, 1.5, -1.0)
    y, sh = torch.randn(2, 3, 32), torch.randn(2, 32)
    with pytest.raises(ValueError, match="shared must be"):
        mk.reference_moe_combine(y, sh[:, :16], None, torch.float32)
    with pytest.raises(ValueError, match="weights must be"):
        mk.reference_moe_combine(y, sh, torch.rand(2, 2), torch.float32)
    with pytest.raises(TypeError, match="out_dtype"):
        mk.reference_moe_combine(y, sh, None, torch.int32)
    with pytest.raises(TypeError, match="y has dtype"):
        mk.reference_moe_combine(y.long(), sh, None, torch.float32)


@pytest.mark.skipif(IN_INTERPRETER, reason="checks the error raised when Triton is NOT interpreting")
def test_cpu_launch_without_interpreter_says_how_to_enable_it():
    x, W, bias = make_router_inputs((2,), 8, 32, torch.float32, 37)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        mk.triton_moe_router(x, W, bias, 2, 1.0, 1.5, EPS)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        mk.triton_moe_combine(torch.randn(2, 3, 32), torch.randn(2, 32), None, torch.float32)
