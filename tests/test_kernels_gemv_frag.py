"""Tests of the block-FP8 fragment GEMV (dsv41/kernels/gemv_frag.py), reached through dsv41::linear_fp8_block.

Reference: the independent float64 model of tests/test_kernels_quant_gemv.py (E4M3 grid enumerated from its bit
layout, UE8M0 ceil scales from frexp), never the code under test, with its tolerance: |y - ref| <= 2^-16 sum|terms|
+ half an output ulp.

- Interpreted (`@interpreted`, a TRITON_INTERPRET=1 child pytest): the kernel with its MMA emulated on the same
  per-lane registers, at small odd shapes (partial row tiles, K tails, one to eight warps, split-K, prefetched
  spans, the unmasked EVEN loads), every E4M3 byte, NaN weights and activations, the activation preparation in K
  order against the model's quantiser.
- Offline sm_90 build (no GPU): eight `mma.sync` per span in a one-value-per-thread layout, 16-byte loads, no
  spill; before `griddepcontrol.wait` only the weight's words and scale bytes are read; the early activation
  launch triggers its dependents before its own wait.
- Launch census on meta tensors and the kernel choice of `quant_gemv.split_frag_overrides`.
- On a GPU (skipped here): the h200 shapes at their default plans and the swept ones against the float64 model,
  outputs poisoned first; a PDL CUDA graph in which the activation is written just before each GEMV.
"""

from __future__ import annotations

import re

import pytest
import torch

from gpu_harness import assert_graph_replay_equals, load_reference
from interp_harness import InterpreterHarness, poison_outputs, sm90_ttir

from dsv41.kernels import gemv_frag as gfm
from dsv41.kernels import quant_gemv as qg

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()
QG = load_reference("test_kernels_quant_gemv")
ON_GPU = torch.cuda.is_available() and not __import__("os").environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output/workspace the launcher allocates starts as NaN (floats) or 0xAB (bytes)."""
    poison_outputs(monkeypatch, qg)


@pytest.fixture
def plans_run(monkeypatch):
    """The plans `launch_frag_gemv` ran, in order."""
    ran = []
    real = gfm.launch_frag_gemv
    monkeypatch.setattr(gfm, "launch_frag_gemv", lambda x2, w, s, plan, *a, **kw: ran.append(plan) or real(
        x2, w, s, plan, *a, **kw))
    return ran


def _case(n, k, dtype, seed, device="cpu", all_codes=False, **over):
    gen = torch.Generator().manual_seed(seed)
    w, s = QG.make_weights(n, k, False, gen)
    if all_codes:  # every E4M3 byte but the two NaNs, in every row, at shifting positions
        codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
        for r in range(n):
            w[r, :254] = codes.roll(r)[:min(254, k)]
    x = (torch.randn(1, k, generator=gen) * 2).to(dtype)
    y = qg.triton_linear_fp8_block(x.to(device), w.to(device), s.to(device), True, frag=True, **over)
    assert y.shape == (1, n) and y.dtype == dtype
    QG.assert_close_to_ref(y.cpu(), *QG.ref_linear(x, w, s, True, False))
    return y


FRAG_CASES = [
    # (N, K, dtype, overrides, EVEN expected)
    (40, 96, torch.float32, {}, False),                                       # K < one span, rows 40..47 off
    (64, 512, torch.bfloat16, {}, True),                                      # 2 spans, 2 warps, 2 splits
    (200, 1280, torch.bfloat16, {"num_warps": 1, "split_k": 5}, False),       # a half tile of rows, 5 splits
    (64, 1024, torch.float32, {"num_warps": 2, "prefetch": False}, True),     # no register double buffer
    (48, 800, torch.bfloat16, {"num_warps": 1, "split_k": 2}, False),         # 25 blocks: a K tail
    (64, 1024, torch.bfloat16, {"even": False}, False),                       # the masked loads, an EVEN shape
    (128, 768, torch.bfloat16, {"num_warps": 8, "split_k": 1}, True),         # 8 warps, 3 spans each
    (96, 2048, torch.float32, {"num_warps": 2, "split_k": 3}, False),         # 8 spans in 3 splits: the last short
    (32, 1024, torch.bfloat16, {"num_warps": 2, "split_k": 1, "early_launch": True}, True),  # 4 spans per warp
]


@interpreted
@pytest.mark.parametrize("case", FRAG_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{str(c[2])[6:]}-" + "-".join(
    f"{k}{v}" for k, v in c[3].items()))
def test_fragment_gemv_matches_float64_reference(case, poisoned_outputs, plans_run):
    n, k, dtype, over, even = case
    _case(n, k, dtype, n * 7 + k, **over)
    assert plans_run == [gfm.frag_gemv_plan(n, k, **over)]  # the plan asked for ran
    assert plans_run[0]["EVEN"] is even


MULTI_CASES = [
    # (widths, K, dtype, plan overrides): each weight its own programs of one grid
    ((64, 32), 512, torch.bfloat16, {}),                                     # EVEN for both (16 W = 32)
    ((40, 72, 16), 288, torch.float32, {"num_warps": 1, "split_k": 2}),     # partial tiles, K tail: masked
    ((64, 64, 32, 96), 1024, torch.bfloat16, {"num_warps": 2, "split_k": 2}),  # four weights, split-K
]


@interpreted
@pytest.mark.parametrize("case", MULTI_CASES, ids=lambda c: "+".join(map(str, c[0])) + f"x{c[1]}")
def test_several_weights_in_one_launch_match_float64_reference(case, poisoned_outputs):
    widths, k, dtype, over = case
    gen = torch.Generator().manual_seed(k + len(widths))
    ws = [QG.make_weights(n, k, False, gen) for n in widths]
    x = (torch.randn(1, k, generator=gen) * 2).to(dtype)
    ys = gfm.launch_frag_gemv_multi(x, [w for w, _ in ws], [s for _, s in ws], gfm.frag_gemv_plan(sum(widths), k,
                                                                                                  **over), qg._empty)
    assert [tuple(y.shape) for y in ys] == [(1, n) for n in widths]
    for y, (w, s) in zip(ys, ws):
        QG.assert_close_to_ref(y, *QG.ref_linear(x, w, s, True, False))


@interpreted
def test_every_e4m3_byte_and_split_k_is_deterministic(poisoned_outputs):
    a = _case(64, 512, torch.float32, 3, all_codes=True, num_warps=1, split_k=2)
    b = _case(64, 512, torch.float32, 3, all_codes=True, num_warps=1, split_k=2)
    assert torch.equal(a, b)
    _case(48, 288, torch.bfloat16, 4, all_codes=True, num_warps=1)


@interpreted
def test_nan_weight_byte_and_nan_activation_give_nan_like_the_reference(monkeypatch):
    poison_outputs(monkeypatch, qg, 12345.0)  # a NaN must have been written, not left over
    gen = torch.Generator().manual_seed(5)
    w, s = QG.make_weights(64, 512, False, gen)
    w[9, 300] = 0x7F
    w[40, 3] = 0xFF
    x = torch.randn(1, 512, generator=gen)
    y = qg.triton_linear_fp8_block(x, w, s, True, frag=True)
    ref = qg.reference_linear_fp8_block(x, w, s, True)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.isnan(y[0, [9, 40]]).all()
    assert torch.isfinite(y[0, :9]).all()
    x[0, 100] = float("nan")
    assert torch.isnan(qg.triton_linear_fp8_block(x, w, s, True, frag=True)).all()


@interpreted
def test_activation_preparation_in_k_order_matches_the_models_quantiser(poisoned_outputs):
    from dsv41.kernels import grouped_frag as gf
    from dsv41.model import formats
    gen = torch.Generator().manual_seed(6)
    mag = torch.exp2(torch.randint(-12, 12, (2, 4, 1), generator=gen).float())
    x = (torch.randn(2, 4, 32, generator=gen) * mag).reshape(2, 128)
    x[1, 32:64] = torch.tensor([448.0 * 2 ** 5, 2.0 ** -9 * 2 ** 5, -(2.0 ** -7) * 2 ** 5] * 10 + [0.0, -1.0])
    codes, e = formats.quantize_fp8_1x32(x)
    for early in (False, True):
        xq, xs = gf.prepare_frag_x(x, qg._empty, False, part_order=False, early=early)
        assert torch.equal(xq, codes) and torch.equal(xs, torch.exp2(e.float() - 127))


def test_option_rules():
    x = torch.zeros(1, 256)
    w, s = torch.zeros(64, 256, dtype=torch.uint8), torch.full((2, 8), 127, dtype=torch.uint8)
    wf4, sf4 = torch.zeros(64, 128, dtype=torch.uint8), torch.full((64, 8), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block-FP8 weights only"):
        qg.triton_linear_fp4(x, wf4, sf4, True, frag=True)
    with pytest.raises(ValueError, match="act_quant=True"):
        qg.triton_linear_fp8_block(x, w, s, False, frag=True)
    with pytest.raises(ValueError, match="one x row; got 2"):
        qg.triton_linear_fp8_block(torch.zeros(2, 256), w, s, True, frag=True)
    with pytest.raises(ValueError, match="float16"):
        qg.triton_linear_fp8_block(x.half(), w, s, True, frag=True)
    with pytest.raises(ValueError, match=r"does not take the options \['block_n'\]"):
        qg.triton_linear_fp8_block(x, w, s, True, frag=True, block_n=64)
    with pytest.raises(ValueError, match="even=True needs"):
        gfm.frag_gemv_plan(40, 256, even=True)
    with pytest.raises(ValueError, match="num_warps=3"):
        gfm.frag_gemv_plan(64, 256, num_warps=3)
    with pytest.raises(ValueError, match="early_launch"):
        gfm.frag_gemv_plan(64, 256, early_launch=1)
    w2, s2 = torch.zeros(8, 512, dtype=torch.uint8), torch.full((1, 16), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"weights\[1\] \(8, 512\) does not match K = 256"):
        gfm.launch_frag_gemv_multi(x, [w, w2], [s, s2], gfm.frag_gemv_plan(72, 256), qg._empty)
    with pytest.raises(ValueError, match="1 to 4 weights"):
        gfm.launch_frag_gemv_multi(x, [w] * 5, [s] * 5, gfm.frag_gemv_plan(320, 256), qg._empty)
    with pytest.raises(ValueError, match="16-byte"):
        gfm.launch_frag_gemv(x, torch.zeros(64, 272, dtype=torch.uint8)[:, 8:264], s, gfm.frag_gemv_plan(64, 256),
                             qg._empty)


def test_plans_at_the_h200_shapes():
    # The measured defaults (bench/results/2026-12-02_h200_s24): 12 warps per SM at least, 8-warp programs for the
    # head, 4 unsplit, 2 where K is split; every h200 shape EVEN.
    want = {(32768, 1280): (4, 1, (512, 1)), (5120, 8192): (2, 8, (160, 8)), (129280, 5120): (8, 1, (1010, 1)),
            (5120, 2304): (2, 9, (160, 9)), (2304, 5120): (2, 20, (72, 20))}
    for (n, k), (warps, split, grid) in want.items():
        plan = gfm.frag_gemv_plan(n, k, sm_count=132)
        assert (plan["num_warps"], plan["SPLIT_K"], plan["grid"]) == (warps, split, grid), (n, k, plan)
        assert plan["EVEN"] and plan["PREFETCH"] and plan["EARLY_LAUNCH"] and plan["ITERS"] * split == plan["SPANS"]
    assert gfm.frag_gemv_plan(5120, 8192, sm_count=66)["SPLIT_K"] == 4  # fewer SMs, fewer splits


def test_default_choice_and_launch_census():
    from dsv41.kernels.census import op_launches
    meta = torch.device("meta")
    x = torch.empty(1, 1280, dtype=torch.bfloat16, device=meta)
    wq_b = torch.empty(32768, 1280, dtype=torch.uint8, device=meta)
    small = torch.empty(4096, 1280, dtype=torch.uint8, device=meta)  # 5 MiB: below FRAG_MIN_WEIGHT_BYTES_M1
    assert qg.split_frag_overrides({}, False, x, 1, wq_b, True) == {"sm_count": None}
    assert qg.split_frag_overrides({}, False, x, 1, small, True) is None
    assert qg.split_frag_overrides({}, False, x, 1, wq_b, False) is None
    assert qg.split_frag_overrides({}, False, x.half(), 1, wq_b, True) is None
    assert qg.split_frag_overrides({}, False, x, 2, wq_b, True) is None
    assert qg.split_frag_overrides({"frag": False}, False, x, 1, wq_b, True) is None
    assert qg.split_frag_overrides({"block_n": 64}, False, x, 1, wq_b, True) is None
    xc, wc = torch.empty(1, 1280, dtype=torch.bfloat16), torch.empty(32768, 1280, dtype=torch.uint8)
    assert qg.split_frag_overrides({}, False, xc, 1, wc, True) is None  # CPU: no default kernel choice
    # One activation launch and the GEMV; the tile / TMA kernels elsewhere (one launch each).
    s = torch.empty(1024, 40, dtype=torch.uint8)
    assert op_launches("dsv41::linear_fp8_block", [xc, wc, s, True]) == 2
    assert op_launches("dsv41::linear_fp8_block", [xc, wc, s, False]) == 1
    assert op_launches("dsv41::linear_fp8_block", [xc.half(), wc, s, True]) == 1
    assert op_launches("dsv41::linear_fp8_block", [torch.empty(3, 1280), wc, s, True]) == 1
    assert op_launches("dsv41::linear_fp8_block", [xc, wc[:4096], s[:128], True]) == 1


def _triton_before(major: int, minor: int) -> bool:
    import triton
    return tuple(int(p) for p in triton.__version__.split(".")[:2]) < (major, minor)


_PTR = dict(xq_ptr="i32", xs_ptr="fp32", part_ptr="fp32", cnt_ptr="i32",
            **{f"{a}{i}": t for i in range(4) for a, t in (("w", "i32"), ("s", "u8"), ("y", "bf16"))})


def _build(stage, warps=4, prefetch=True, even=True, split=1, count=1):
    consts = dict(COUNT=count, ITERS=5, SPLIT_K=split, SPLIT_POW2=split, W=warps, PREFETCH=prefetch, EVEN=even,
                  USE_PDL=True, ASM=True)
    # As launched at the h200 shapes: aligned tensors, K, the widths and the weights' row strides multiples of 16.
    return sm90_ttir(gfm._frag_gemv_kernel, _PTR, consts, stage=stage, num_warps=warps,
                     aligned=(*_PTR, "K", "N0", "N1", "N2", "N3", "sw0", "sw1", "sw2", "sw3"))


@pytest.mark.parametrize("warps,prefetch,even,count", [(4, True, True, 1), (2, False, True, 1), (4, True, False, 1),
                                                       (8, True, True, 1), (2, True, True, 2)])
def test_sm90_build_reads_only_the_weight_before_the_wait_and_keeps_lanes_in_their_threads(warps, prefetch, even,
                                                                                            count):
    build = dict(warps=warps, prefetch=prefetch, even=even, count=count)
    ttgir = _build("ttgir", **build)
    asm = [ln for ln in ttgir.splitlines() if "elementwise_inline_asm" in ln and "mma.sync" in ln]
    assert len(asm) == 8, "eight MMAs per span"
    (name,) = set(re.findall(r"tensor<\d+xi32, (#\w+)>", " ".join(asm)))
    decl = re.search(rf"^{name} = (.*)$", ttgir, re.M).group(1)
    warp_bases = ", ".join(f"[{32 << i}]" for i in range(warps.bit_length() - 1))
    assert (f"sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [{warps}]" in decl
            or f"register = [], lane = [[1], [2], [4], [8], [16]], warp = [{warp_bases}]" in decl), decl
    ptx = _build("ptx", **build)
    assert ptx.count("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32") == 8
    loads = [ln.strip() for ln in ptx.splitlines() if "ld.global" in ln or "griddepcontrol.wait" in ln]
    wait = next(i for i, ln in enumerate(loads) if "griddepcontrol.wait" in ln)
    before = loads[:wait]
    if prefetch:
        # The first span's weight: 8 16-byte vectors of words and 2 scale bytes; no activation word or scale.
        assert sum("ld.global.v4.b32" in ln for ln in before) == 8 and sum(".b8" in ln or ".u8" in ln
                                                                             for ln in before) == 2, before
        assert len(before) == 10, before
    else:
        assert not before
    sass = _build("sass", **build)
    if (warps, prefetch) == (2, False) and _triton_before(3, 9):
        # Measured on an H100 under Triton 3.6 (bench/results/2026-12-07_h100_s30/gemv_frag_wait.log): this plan, no
        # default, spills one register (one STL); the load-order checks above pass. Under Triton 3.9 it does not.
        if "STL" in sass or "LDL" in sass:
            pytest.xfail("Triton < 3.9 spills one register in the 2-warp plan without prefetch (not a default plan)")
    assert "STL" not in sass and "LDL" not in sass, "register spills"


def test_sm90_build_of_the_early_activation_launch_triggers_before_it_waits():
    from dsv41.kernels import grouped_frag as gf
    ptr = dict(x_ptr="bf16", q_ptr="u8", s_ptr="fp32")
    for early in (True, False):
        ptx = sm90_ttir(gf._frag_x_kernel, ptr, dict(BLOCK=1024, PART_ORDER=False, USE_PDL=True, EARLY=early),
                        stage="ptx")
        order = [w for w in re.findall(r"griddepcontrol\.(wait|launch_dependents)", ptx)]
        assert order == (["launch_dependents", "wait"] if early else ["wait", "launch_dependents"]), order


# ------------------------------------------------------------------------------------------- GPU
#: The h200 dense shapes the default takes the kernel at, and swept plans (bench/results/2026-12-02_h200_s24).
GPU_SHAPES = {"wq_b": (32768, 1280), "wo_b": (5120, 8192), "shared_w2": (5120, 2304), "shared_w1": (2304, 5120)}
GPU_PLANS = [{}, {"num_warps": 1}, {"num_warps": 8, "split_k": 1}, {"prefetch": False}, {"even": False},
             {"early_launch": False}]


@pytest.fixture(scope="module")
def dense():
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU (compiled Triton kernels)")
    gen = torch.Generator().manual_seed(61)
    out = {}
    for name, (n, k) in GPU_SHAPES.items():
        w, s = QG.make_weights(n, k, False, gen)
        w[:, :254] = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
        x = (torch.randn(1, k, generator=gen) * 2).bfloat16()
        out[name] = (x, w, s, QG.ref_linear(x, w, s, True, False), x.cuda(), w.cuda(), s.cuda())
    return out


@pytest.mark.parametrize("cfg", GPU_PLANS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_gpu_fragment_gemv_at_h200_shapes(dense, name, cfg, poisoned_outputs, plans_run):
    x, w, s, ref, xc, wc, sc = dense[name]
    y = qg.triton_linear_fp8_block(xc, wc, sc, True, **({"frag": True, **cfg} if cfg else {}))
    assert len(plans_run) == 1, "the default launch takes the fragment kernel at this shape"
    QG.assert_close_to_ref(y.cpu(), *ref)
    yf = qg.triton_linear_fp8_block(xc.float(), wc, sc, True, frag=True, **cfg)
    QG.assert_close_to_ref(yf.cpu(), *QG.ref_linear(x.float(), w, s, True, False))


def test_gpu_pdl_graph_with_the_activation_written_just_before_each_gemv(dense):
    # The early activation launch lets each GEMV start before the kernel that writes x has finished: the GEMV may
    # read only its weight until its wait. Each x is written by a copy right before its GEMV into one buffer, and
    # the last GEMV's input is the output of the one before it.
    from dsv41 import kernels
    w, s = dense["wq_b"][5:7]
    w2, s2 = dense["shared_w2"][5:7]
    gen = torch.Generator().manual_seed(62)
    srcs = [(torch.randn(1, 1280, generator=gen) * 2).bfloat16().cuda() for _ in range(3)]
    buf = torch.empty_like(srcs[0])

    def step():
        outs = []
        for src in srcs:
            buf.copy_(src)
            outs.append(torch.ops.dsv41.linear_fp8_block(buf, w, s, True))
        z = torch.ops.dsv41.linear_fp8_block(outs[-1][:, :2304].contiguous(), w2, s2, True)
        return (*outs, z)

    kernels.set_pdl(True)
    try:
        want = step()
        torch.cuda.synchronize()
        for src, y in zip(srcs, want[:3]):
            QG.assert_close_to_ref(y.cpu(), *QG.ref_linear(src.cpu(), w.cpu(), s.cpu(), True, False))
        assert_graph_replay_equals(step, want)
    finally:
        kernels.set_pdl(False)
