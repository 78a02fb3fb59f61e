"""Tests of the row-streaming GEMV (dsv41/kernels/gemv_rows.py) behind dsv41::linear_fp8_block, dsv41::linear_fp4
(`rows=True`, M = 1) and dsv41::grouped_linear_fp4.

References: the float64 models of tests/test_kernels_quant_gemv.py and tests/test_kernels_grouped_gemv.py (E4M3 /
E2M1 grids enumerated from their bit layouts, UE8M0 from frexp), loaded by path; never the code under test.
Tolerances as stated there: bit-exact fake-quantised activations; 2^-16 sum|terms| + half an output ulp for sums.
Interpreter tests (`@interpreted`) run in a child pytest with TRITON_INTERPRET=1 (interp_harness); the sm_90
build test compiles the kernel offline (no GPU) and checks what the interpreter cannot show: that the row loop
has no barrier and no shared-memory traffic, the point of this kernel.
"""

from __future__ import annotations

import re

import pytest
import torch

from gpu_harness import load_reference
from interp_harness import IN_INTERPRETER, InterpreterHarness, poison_outputs  # noqa: F401

from dsv41.kernels import gemv_rows as gr  # noqa: E402
from dsv41.kernels import grouped_gemv as gg  # noqa: E402
from dsv41.kernels import quant_gemv as qg  # noqa: E402

G = load_reference("test_kernels_quant_gemv")
GG = load_reference("test_kernels_grouped_gemv")

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output/workspace either launcher allocates starts as NaN."""
    for module in (qg, gg, gr):
        poison_outputs(monkeypatch, module)


ROWS_CASES = [
    # (N, K, dtype, act_quant, overrides): odd N and K against the row blocks and K chunks
    (40, 64, torch.float32, True, {}),                                        # one chunk, second block half full
    (96, 160, torch.bfloat16, True, {"kc": 64, "row_iters": 2}),              # 3 chunks, the last half empty
    (72, 160, torch.float16, True, {"kc": 64, "block_r": 8, "row_iters": 3, "prefetch": 0}),
    (33, 288, torch.float32, True, {"kc": 128, "block_r": 4, "row_iters": 5}),  # 2 of 5 blocks empty
    (130, 96, torch.bfloat16, False, {"block_r": 16, "row_iters": 4, "num_warps": 8}),
    (64, 1280, torch.bfloat16, True, {"programs_per_sm": 1, "sm_count": 1}),  # row_iters from the heuristic
    (100, 96, torch.float32, True, {"block_r": 8, "row_iters": 5, "prefetch": 2}),  # two blocks ahead, 2 empty
    (40, 160, torch.bfloat16, True, {"kc": 64, "block_r": 16, "row_iters": 2, "prefetch": 2}),
]


def _rows_id(c):
    return f"{c[0]}x{c[1]}-{str(c[2])[6:]}-aq{int(c[3])}-" + "-".join(f"{k}{v}" for k, v in c[4].items())


@interpreted
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
@pytest.mark.parametrize("case", ROWS_CASES, ids=_rows_id)
def test_row_streaming_gemv_matches_float64_reference(case, fp4, poisoned_outputs):
    n, k, dtype, act_quant, overrides = case
    if fp4 and overrides.get("kc", 64) < 64:
        pytest.skip("FP4 chunks hold at least one 16-byte group")
    gen = torch.Generator().manual_seed(n * 131 + k)
    w, s = G.make_weights(n, k, fp4, gen)
    x = (torch.randn(1, k, generator=gen) * 2).to(dtype)
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    y = fn(x, w, s, act_quant, rows=True, **overrides)
    assert y.shape == (1, n) and y.dtype == dtype
    G.assert_close_to_ref(y, *G.ref_linear(x, w, s, act_quant, fp4))


@interpreted
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
def test_row_streaming_activation_quant_is_bit_exact(fp4, poisoned_outputs):
    """With an identity weight y = fq(x) exactly, so the kernel's fake quant is checked bit for bit."""
    x = G.crafted_activation(torch.float32)
    w, s = G.identity_weight(128, fp4)
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    for xx in (x, x.bfloat16()):
        for kc in (64, 128):
            y = fn(xx, w, s, True, rows=True, kc=kc, block_r=8)
            assert torch.equal(y.double(), G.ref_fake_quant_fp8(xx)), kc


@interpreted
def test_row_streaming_split_k_is_deterministic_and_strided_inputs_work(poisoned_outputs):
    gen = torch.Generator().manual_seed(3)
    w_big, s_big = G.make_weights(80, 512, False, gen)
    w, s = w_big[:, :256], s_big[:, :8]  # row stride 512 bytes, scale row stride 16
    x = torch.randn(256, 2, generator=gen)[:, :1].t()  # a strided view
    assert not w.is_contiguous() and not x.is_contiguous()
    a = qg.triton_linear_fp8_block(x, w, s, True, rows=True, kc=32)  # 8 chunks
    b = qg.triton_linear_fp8_block(x, w, s, True, rows=True, kc=32)
    assert torch.equal(a, b)
    G.assert_close_to_ref(a, *G.ref_linear(x, w.contiguous(), s.contiguous(), True, False))


ROWS_GROUPED_CASES = [
    # (N tokens, k, E, out, K, dtype, x per token, act_quant, overrides)
    (1, 2, 8, 64, 128, torch.float32, True, True, {}),
    (1, 6, 9, 40, 96, torch.bfloat16, False, True, {"kc": 64, "block_r": 16}),   # partial chunk, 2 blocks
    (2, 3, 7, 72, 160, torch.float16, True, True, {"kc": 64, "block_r": 8, "row_iters": 2}),
    (3, 2, 5, 40, 256, torch.float32, False, False, {"kc": 64, "prefetch": 0}),
    (1, 6, 9, 72, 128, torch.bfloat16, False, True, {"kc": 64, "block_r": 8, "row_iters": 4, "prefetch": 2}),
]


@interpreted
@pytest.mark.parametrize("case", ROWS_GROUPED_CASES, ids=lambda c: GG._case_id(c))
def test_row_streaming_grouped_gemv_matches_float64_reference(case, poisoned_outputs):
    n, k, e, out, kdim, dtype, shared, act_quant, overrides = case
    gen = torch.Generator().manual_seed(n * 1000 + out * 7 + kdim + 1)
    w, s = GG.make_experts(e, out, kdim, gen)
    idx = GG.make_indices(n, k, e, gen, negative=True)
    x = GG.make_x(n, k, kdim, dtype, shared, gen)
    y = gg.triton_grouped_linear_fp4(x, w, s, idx, act_quant, rows=True, **overrides)
    assert y.shape == (n, k, out) and y.dtype == dtype
    GG.assert_close_to_ref(y, *GG.ref_grouped(x, w, s, idx, act_quant))


@interpreted
def test_row_streaming_grouped_marks_an_out_of_range_expert_with_nan_rows(poisoned_outputs):
    gen = torch.Generator().manual_seed(8)
    w, s = GG.make_experts(5, 40, 128, gen)
    idx = GG.make_indices(3, 2, 5, gen)
    x = GG.make_x(3, 2, 128, torch.float32, True, gen)
    good = gg.triton_grouped_linear_fp4(x, w, s, idx, True, rows=True, kc=64, block_r=16)
    GG.assert_close_to_ref(good, *GG.ref_grouped(x, w, s, idx, True))
    for bad in (5, -6, 1 << 40):
        b = idx.clone()
        b[1, 0] = bad
        y = gg.triton_grouped_linear_fp4(x, w, s, b, True, rows=True, kc=64, block_r=16)
        assert torch.isnan(y[1, 0]).all()
        keep = torch.ones(3, 2, dtype=torch.bool)
        keep[1, 0] = False
        assert torch.equal(y[keep], good[keep])


def test_row_streaming_options_are_checked():
    w, s = torch.zeros(40, 64, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="rows=True .* one x row, got M = 2"):
        qg.triton_linear_fp8_block(x, w, s, True, rows=True)
    with pytest.raises(ValueError, match=r"\['kc'\] apply to the row-streaming kernel only"):
        qg.triton_linear_fp8_block(x[:1], w, s, True, rows=False, kc=64)
    with pytest.raises(ValueError, match=r"does not take the tile-loop options \['block_n', 'stages'\]"):
        qg.triton_linear_fp8_block(x[:1], w, s, True, rows=True, stages=3, block_n=64)
    with pytest.raises(ValueError, match=r"tile-loop options \['k_iters'\]"):  # 0 is a value, not "not given"
        qg.triton_linear_fp8_block(x[:1], w, s, True, rows=True, k_iters=0)
    # a misspelt option is an error, never a silently different plan (also for the grouped op, before any launch)
    with pytest.raises(ValueError, match=r"unknown options for the row-streaming kernel: \['row_iter'\]"):
        qg.triton_linear_fp8_block(x[:1], w, s, True, rows=True, row_iter=4)
    we, se = torch.zeros(3, 40, 32, dtype=torch.uint8), torch.zeros(3, 40, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\['blok_r'\]"):
        gg.triton_grouped_linear_fp4(x[:1], we, se, torch.zeros(1, 2, dtype=torch.int64), True, rows=True, blok_r=4)
    with pytest.raises(ValueError, match="kc=96"):  # checked before the empty-output early return
        qg.triton_linear_fp8_block(x[:1], w[:0], s[:0], True, rows=True, kc=96)


@pytest.mark.parametrize("fp4, kwargs, error, match", [
    (False, {"block_r": 64}, ValueError, "block_r=64 must be a power of two <= 32"),
    (True, {"block_r": 128}, ValueError, "block_r=128 must be a power of two <= 64"),
    (True, {"kc": 32}, ValueError, "kc=32 must be a power of two in 64..2048"),
    (False, {"kc": 96}, ValueError, "kc=96"),
    (False, {"kc": 4096}, ValueError, "kc=4096"),
    (False, {"kc": 64.0}, TypeError, "kc must be an int, got float"),
    (False, {"block_r": True}, TypeError, "block_r must be an int, got bool"),
    (False, {"row_iters": 2.5}, TypeError, "row_iters must be an int"),
    (False, {"prefetch": 3}, ValueError, "prefetch=3 must be 0, 1 or 2"),
    (False, {"row_iters": 0}, ValueError, "row_iters=0"),
    (False, {"num_warps": 3}, ValueError, "num_warps=3 must be a power of two"),
    (False, {"programs_per_sm": 0}, ValueError, "programs_per_sm=0"),
], ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}{x}" for k, x in v.items()))
def test_row_streaming_plan_rejects_bad_options(fp4, kwargs, error, match):
    with pytest.raises(error, match=match):
        gr.rows_plan(64, 128, fp4, **kwargs)


def test_row_streaming_plan_needs_a_weight():
    with pytest.raises(ValueError, match="non-empty"):
        gr.rows_plan(0, 128, False)


@interpreted
def test_row_streaming_empty_shapes_give_empty_or_zero_outputs(poisoned_outputs):
    """M = 0 gives an empty result, K = 0 an empty sum: zeros, as the reference (never uninitialised memory)."""
    w, s = torch.zeros(5, 0, dtype=torch.uint8), torch.zeros(1, 0, dtype=torch.uint8)
    for over in ({"rows": True}, {}):
        y = qg.triton_linear_fp8_block(torch.zeros(1, 0), w, s, True, **over)
        assert torch.equal(y, torch.zeros(1, 5)), over
        y = qg.triton_linear_fp4(torch.zeros(1, 0), w, torch.zeros(5, 0, dtype=torch.uint8), True, **over)
        assert torch.equal(y, torch.zeros(1, 5)), over
        y = gg.triton_grouped_linear_fp4(torch.zeros(1, 0), torch.zeros(3, 5, 0, dtype=torch.uint8),
                                         torch.zeros(3, 5, 0, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.int64),
                                         True, **over)
        assert torch.equal(y, torch.zeros(1, 2, 5)), over
    w, s = G.make_weights(40, 64, False, torch.Generator().manual_seed(0))
    assert qg.triton_linear_fp8_block(torch.zeros(0, 64), w, s, True, rows=True).shape == (0, 40)


def test_row_streaming_plan_at_h200_shapes():
    # The default plan: 256 weight bytes per row and program, K chunks combined by split-K, row blocks spread so
    # that about ROWS_PROGRAMS_PER_SM programs per SM of the H200 cover the weight once.
    for n, k, fp4, split in ((32768, 1280, False, 5), (5120, 8192, False, 32), (2304, 5120, True, 10)):
        p = gr.rows_plan(n, k, fp4)
        assert p["SPLIT_K"] == split and p["KC"] == (512 if fp4 else 256)
        programs = p["grid"][0] * p["grid"][1]
        assert 0.5 * 132 * gr.ROWS_PROGRAMS_PER_SM <= programs <= 2 * 132 * gr.ROWS_PROGRAMS_PER_SM, p
        assert p["grid"][0] * p["RB"] * p["ROW_ITERS"] >= n > (p["grid"][0] - 1) * p["RB"] * p["ROW_ITERS"]
    assert gr.rows_plan(2304, 5120, True, pairs=6)["grid"][2] == 6


def _offline_ptx(fp4: bool, prefetch: bool) -> str:
    """PTX of the row-streaming kernel built offline for sm_90 (h200 plans, bf16 x, PDL): block FP8 at wq_b, FP4 at
    the grouped w1 / w3 of six experts (four row blocks per program)."""
    if IN_INTERPRETER:
        pytest.skip("builds the kernel for sm_90; TRITON_INTERPRET=1 is set")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kern = gr._rows_gemv_kernel
    plan = gr.rows_plan(2304, 5120, True, pairs=6) if fp4 else gr.rows_plan(32768, 1280, False)
    assert plan["ROW_ITERS"] > 1
    consts = dict(FP4=fp4, GROUPED=fp4, ACT_QUANT=True, SPLIT_K=plan["SPLIT_K"], SPLIT_POW2=plan["SPLIT_POW2"],
                  KC=plan["KC"], RB=plan["RB"], ROW_ITERS=plan["ROW_ITERS"], ITERS_P2=plan["ITERS_P2"],
                  PREFETCH=prefetch, USE_PDL=True)
    ptrs = dict(x_ptr="bf16", w_ptr="u8", s_ptr="u8", idx_ptr="i64", y_ptr="bf16", part_ptr="fp32", cnt_ptr="i32")
    sig = {a: "constexpr" if a in consts else ("*" + ptrs[a] if a in ptrs else "i32") for a in kern.arg_names}
    # What the JIT tells the compiler at a real launch: 16-byte aligned pointers, strides and K.
    aligned = [a for a in kern.arg_names if a in ptrs or a in ("K", "stride_xr", "stride_we", "stride_wn", "stride_se",
                                                                 "stride_sn")]
    attrs = {(kern.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(kern, sig, {(kern.arg_names.index(a),): v for a, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": plan["num_warps"]}).asm["ptx"]


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
def test_row_loop_has_no_barrier_or_shared_memory_on_sm90(fp4):
    ptx = _offline_ptx(fp4, prefetch=True)
    head = ptx.find("Inner Loop Header")
    assert head >= 0, "no row loop in the PTX"
    back = re.search(r"bra(\.uni)?\s+\$L__BB0_\d+;", ptx[head:])
    body = ptx[head:head + back.end()]
    assert "bar.sync" not in body and ".shared" not in body
    # 16-byte weight loads: the tile is read in vectors, never byte by byte
    assert len(re.findall(r"ld\.global(\.\w+)*\.v4\.b32", body)) >= 2
