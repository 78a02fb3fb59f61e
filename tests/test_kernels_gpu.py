"""GPU tests of the dsv41 Triton kernels at the h200 preset's real shapes (MODEL.md §4.3).

Run standalone on a CUDA machine: `python -m pytest tests/test_kernels_gpu.py -q`. Skipped on CPU-only
machines, and when TRITON_INTERPRET=1 is set (these tests are about the compiled kernels).
References: the float64 models written in tests/test_kernels_quant_gemv.py and tests/test_kernels_rope_fp4.py
(imported by path), evaluated on the GPU; tolerances as stated there (bit-exact for codes, scales and the
fake-quantised activations; 2^-16 sum|terms| + half an output ulp for GEMV sums).
"""

from __future__ import annotations


import pytest
import torch

from gpu_harness import load_bench, load_reference, skip_unless_compiled_gpu  # noqa: E402
from interp_harness import poison_outputs  # noqa: E402

skip_unless_compiled_gpu()

import dsv41.kernels as kernels  # noqa: E402
from dsv41.kernels import gemv_rows as gr  # noqa: E402
from dsv41.kernels import mhc as mk  # noqa: E402
from dsv41.kernels import quant_gemv as qg  # noqa: E402
from dsv41.kernels import rope_fp4 as rp  # noqa: E402



G = load_reference("test_kernels_quant_gemv")
R = load_reference("test_kernels_rope_fp4")
H = load_reference("test_kernels_mhc")
DEV = torch.device("cuda")

#: (name, fp4, N, K) of the h200 decode GEMVs.
GEMV_SHAPES = [
    ("wq_b", False, 32768, 1280), ("wo_b", False, 5120, 8192), ("wq_a", False, 1280, 5120),
    ("shared_w1", False, 2304, 5120), ("shared_w2", False, 5120, 2304),
    ("expert_w1", True, 2304, 5120), ("expert_w2", True, 5120, 2304), ("head", False, 129280, 5120),
]


def _weights(n, k, fp4, seed):
    gen = torch.Generator().manual_seed(seed)
    w, s = G.make_weights(n, k, fp4, gen)
    return w.to(DEV), s.to(DEV)


def _check(y, x, w, s, act_quant, fp4):
    """Compare with the float64 model evaluated on the GPU, in row chunks (the head is 129280 x 5120)."""
    assert not torch.isnan(y).any()
    xq = G.ref_fake_quant_fp8(x) if act_quant else x.double()
    for n0 in range(0, w.shape[0], 16384):
        n1 = min(w.shape[0], n0 + 16384)
        if fp4:
            wd = G.ref_dequant_fp4(w[n0:n1], s[n0:n1], x.dtype)
        else:
            wd = G.ref_dequant_fp8_block(w[n0:n1], s[n0 // 32:-(-n1 // 32)], x.dtype)
        G.assert_close_to_ref(y[..., n0:n1], xq @ wd.T, xq.abs() @ wd.abs().T)


@pytest.fixture(autouse=True)
def _gpu_references_on_device(monkeypatch):
    # the float64 grids of the reference modules live on the CPU; move them next to the data
    monkeypatch.setattr(G, "E4M3_GRID", G.E4M3_GRID.to(DEV))
    monkeypatch.setattr(G, "E2M1_GRID", G.E2M1_GRID.to(DEV))
    monkeypatch.setattr(R, "E4M3_GRID", R.E4M3_GRID.to(DEV))
    monkeypatch.setattr(R, "E2M1_GRID", R.E2M1_GRID.to(DEV))
    yield
    kernels.set_pdl(False)


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=[s[0] for s in GEMV_SHAPES])
def test_gemv_matches_float64_reference_at_h200_shapes(shape, m):
    name, fp4, n, k = shape
    w, s = _weights(n, k, fp4, seed=n + k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16) * 2
    op = torch.ops.dsv41.linear_fp4 if fp4 else torch.ops.dsv41.linear_fp8_block
    y = op(x, w, s, True)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _check(y, x, w, s, True, fp4)


_BENCH = load_bench("kernels")
_SWEEP_SHAPES = {"wo_b": (False, 5120, 8192), "expert_w2": (True, 5120, 2304), "wq_b": (False, 32768, 1280)}
_SWEEP_DATA: dict = {}


@pytest.mark.parametrize("cfg", _BENCH.SWEEP, ids=lambda c: "-".join(
    f"{k}{v}" for k, v in c.items()) if isinstance(c, dict) else "-".join(map(str, c)))
@pytest.mark.parametrize("name", list(_SWEEP_SHAPES))
def test_sweep_configs_are_correct(name, cfg, monkeypatch):
    # bench/kernels.py --sweep times these configurations (tile-at-once or row-streaming, split or not, 4-8 warps);
    # each must match the float64 reference: wo_b splits K unevenly for the tiles, expert_w2 has a partial K range
    # (2304 = 4.5 row-streaming chunks of 512), wq_b's 32768 rows end a program's row range mid-way.
    fp4, n, k = _SWEEP_SHAPES[name]
    picked = _BENCH.sweep_overrides(cfg, fp4)
    if picked is None:
        pytest.skip("block-FP8 rows take block_r <= 32")
    if name not in _SWEEP_DATA:
        w, s = _weights(n, k, fp4, seed=n + k + 1)
        _SWEEP_DATA[name] = (w, s, torch.randn(1, k, device=DEV, dtype=torch.bfloat16) * 2)
    w, s, x = _SWEEP_DATA[name]
    poison_outputs(monkeypatch, qg)
    poison_outputs(monkeypatch, gr)
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    _check(fn(x, w, s, True, **picked[0]), x, w, s, True, fp4)


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
def test_row_streaming_kernel_other_dtypes_pdl_graph_and_counters(fp4, monkeypatch):
    # fp32 / fp16 x (fp16 repeats the reference's fp16 roundings), no act quant, split-K counters left at zero,
    # and PDL launches replayed from a CUDA graph giving the same bits as plain launches.
    poison_outputs(monkeypatch, gr)
    w, s = _weights(2304, 5120, fp4, seed=19)
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = (torch.randn(1, 5120, device=DEV) * 2).to(dtype)
        for aq in (True, False):
            _check(fn(x, w, s, aq, rows=True), x, w, s, aq, fp4)
    x = torch.randn(1, 5120, device=DEV, dtype=torch.bfloat16)
    assert gr.rows_plan(2304, 5120, fp4)["SPLIT_K"] > 1
    from dsv41.kernels import _common
    want = fn(x, w, s, True, rows=True)
    assert int(_common.COUNTERS[x.device.index].abs().sum()) == 0
    kernels.set_pdl(True)
    assert torch.equal(fn(x, w, s, True, rows=True), want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(x, w, s, True, rows=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, w, s, True, rows=True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert int(_common.COUNTERS[x.device.index].abs().sum()) == 0


@pytest.mark.parametrize("name", list(_SWEEP_SHAPES))
def test_opt_in_tile_loops_with_several_rows_and_other_dtypes(name, monkeypatch):
    # The real bf16 wgmma with 4 and 8 live x columns, and the pipelined FMA loop with fp32 / fp16 x (the sweep
    # times M = 1 bf16 only), against the float64 reference.
    fp4, n, k = _SWEEP_SHAPES[name]
    w, s = _weights(n, k, fp4, seed=n + k + 2)
    poison_outputs(monkeypatch, qg)
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    for m in (4, 8):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16) * 2
        for over in (dict(mma=True), dict(mma=True, block_n=128, stages=3)):
            _check(fn(x, w, s, True, **over), x, w, s, True, fp4)
    for dtype in (torch.float32, torch.float16):
        x = (torch.randn(3, k, device=DEV) * 2).to(dtype)
        for aq in (True, False):
            _check(fn(x, w, s, aq, stages=3), x, w, s, aq, fp4)


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gemv_other_dtypes_and_no_act_quant(fp4, dtype):
    w, s = _weights(2304, 5120, fp4, seed=9)
    x = (torch.randn(3, 5120, device=DEV) * 2).to(dtype)
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    for aq in (True, False):
        _check(fn(x, w, s, aq), x, w, s, aq, fp4)


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
def test_in_kernel_activation_quant_is_bit_exact_on_gpu(fp4):
    x = G.crafted_activation(torch.float32).to(DEV)
    w, s = (t.to(DEV) for t in G.identity_weight(128, fp4))
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    for xx in (x, x.bfloat16()):
        y = fn(xx, w, s, True, block_k=128)
        assert torch.equal(y.double(), G.ref_fake_quant_fp8(xx))
        if not fp4:
            y = fn(xx, w, s, True, tma=True)
            assert torch.equal(y.double(), G.ref_fake_quant_fp8(xx))


@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("shape", [GEMV_SHAPES[0], GEMV_SHAPES[1], GEMV_SHAPES[4]], ids=["wq_b", "wo_b", "shared_w2"])
def test_default_fp8_gemv_is_the_tma_kernel_and_agrees_with_the_tile_kernel(shape, m, monkeypatch):
    # On the H200 a block-FP8 launch with no option runs the TMA kernel (gemv_tma) for several rows or a weight of
    # 16 MiB and more (quant_gemv.TMA_MIN_WEIGHT_BYTES_M1); it, forced or not, and the tile kernel
    # (tma=False) both match the float64 reference; a weight view 8 bytes off 16-byte alignment falls back to the tile
    # kernel (checked against the reference: the tile kernel's layout, hence its FP32 sum order, follows the
    # pointer alignment).
    from dsv41.kernels import gemv_tma
    name, fp4, n, k = shape
    w, s = _weights(n, k, fp4, seed=n + k + 7)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16) * 2
    assert gemv_tma.tma_supported(DEV) and gemv_tma.tma_eligible(w)
    calls = []
    real = gemv_tma.launch_tma
    monkeypatch.setattr(gemv_tma, "launch_tma", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    poison_outputs(monkeypatch, qg)
    y_tma = qg.triton_linear_fp8_block(x, w, s, True)
    expect = [1] if m > 1 or n * k >= qg.TMA_MIN_WEIGHT_BYTES_M1 else []  # shared_w2 at one row: the tile kernel
    assert calls == expect
    _check(y_tma, x, w, s, True, False)
    y_forced = qg.triton_linear_fp8_block(x, w, s, True, tma=True)
    _check(y_forced, x, w, s, True, False)
    calls.clear()
    y_tile = qg.triton_linear_fp8_block(x, w, s, True, tma=False)
    _check(y_tile, x, w, s, True, False)
    buf = torch.empty(w.numel() + 8, dtype=torch.uint8, device=DEV)
    shifted = buf[8:].view(w.shape)
    shifted.copy_(w)
    assert not gemv_tma.tma_eligible(shifted)
    _check(qg.triton_linear_fp8_block(x, shifted, s, True), x, w, s, True, False)
    assert calls == []


def test_split_k_is_deterministic_and_counters_reset():
    w, s = _weights(1280, 5120, False, seed=3)
    x = torch.randn(1, 5120, device=DEV, dtype=torch.bfloat16)
    from dsv41.kernels.gemv_tma import tma_gemv_plan
    assert qg.gemv_plan(1, 1280, 5120, False)["SPLIT_K"] > 1 and tma_gemv_plan(1, 1280, 5120)["SPLIT_K"] > 1
    from dsv41.kernels import _common
    for tma in (False, True):  # this 6.6 MB weight runs the tile kernel by default at one row: both, explicitly
        ys = [qg.triton_linear_fp8_block(x, w, s, True, tma=tma) for _ in range(5)]
        assert all(torch.equal(ys[0], y) for y in ys[1:])
        counters = _common.COUNTERS[x.device.index]
        assert int(counters.abs().sum()) == 0
        _check(ys[0], x, w, s, True, False)


def test_cuda_dispatch_uses_cublas_fallback_above_eight_rows():
    w, s = _weights(2304, 5120, False, seed=4)
    x = torch.randn(16, 5120, device=DEV, dtype=torch.bfloat16)
    y = torch.ops.dsv41.linear_fp8_block(x, w, s, True)
    assert torch.equal(y, qg.reference_linear_fp8_block(x, w, s, True))
    _check(qg.triton_linear_fp8_block(x, w, s, True), x, w, s, True, False)


def test_pdl_launches_give_identical_results_also_in_a_cuda_graph():
    w, s = _weights(1280, 5120, False, seed=5)
    w4, s4 = _weights(2304, 5120, True, seed=6)
    x = torch.randn(1, 5120, device=DEV, dtype=torch.bfloat16)
    lat = torch.randn(1, 1, 512, device=DEV, dtype=torch.bfloat16)
    ang = torch.rand(1, 1, 32, device=DEV) * 100
    cos, sin = ang.cos(), ang.sin()

    def step():
        a = torch.ops.dsv41.linear_fp8_block(x, w, s, True)
        b = torch.ops.dsv41.linear_fp4(x, w4, s4, True)
        c, d = torch.ops.dsv41.rope_fp4_quant(lat, cos, sin, 16, True)
        e = qg.triton_linear_fp8_block(x, w, s, True, tma=True)  # the TMA kernel (by default from 16 MiB)
        # L2 prefetch before the PDL wait and the early launch of the next kernel: same arithmetic as e and a.
        f = qg.triton_linear_fp8_block(x, w, s, True, tma=True, l2_prefetch=2)
        g = qg.triton_linear_fp8_block(x, w, s, True, tma=False, early_launch=True)
        h = torch.ops.dsv41.linear_fp4(x, w4, s4, True)  # after an early launch
        return a, b, c, d, e, f, g, h

    kernels.set_pdl(False)
    want = step()
    kernels.set_pdl(True)
    got = step()
    assert all(torch.equal(p, q) for p, q in zip(want, got))
    assert torch.equal(want[5], want[4]) and torch.equal(want[6], want[0]) and torch.equal(want[7], want[1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up (compile) outside capture, on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(want, out))


ROPE_GPU = [
    # (leading shape of x, leading shape of cos, D, R/2, mode)
    ((1, 1), (1, 1), 512, 32, (16, True)),  # bank write, decode
    ((2, 37), (2, 37), 512, 32, (16, True)),  # prefill
    ((1, 1), (1, 1), 128, 32, (32, False)),  # index key
    ((1, 1, 32), (1, 1, 1), 128, 32, (32, False)),  # index queries, cos broadcast over heads
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", ROPE_GPU, ids=lambda c: f"{'x'.join(map(str, c[0]))}-D{c[2]}-b{c[4][0]}")
def test_rope_fp4_ops_are_bit_exact_on_gpu(case, dtype):
    lead, cos_lead, d, r_half, (block, e4m3) = case
    torch.manual_seed(d + len(lead))
    x = (torch.randn(*lead, d, device=DEV) * 3).to(dtype)
    ang = torch.rand(*cos_lead, r_half, device=DEV) * 1000
    cos, sin = ang.cos(), ang.sin()
    wp, ws, wdeq = R.ref_fp4_quant(R.ref_rope(x, cos, sin), block, e4m3)
    p, sc = torch.ops.dsv41.rope_fp4_quant(x, cos, sin, block, e4m3)
    assert torch.equal(p, wp) and torch.equal(sc, ws)
    y = torch.ops.dsv41.rope_fp4_fake_quant(x, cos, sin, block, e4m3)
    assert torch.equal(y.double(), wdeq.to(dtype).double())
    # and the model's own reference, on the GPU, agrees
    rp_ref, rs_ref = rp.reference_rope_fp4_quant(x, cos, sin, block, e4m3)
    assert torch.equal(p, rp_ref) and torch.equal(sc, rs_ref)
    if len(lead) == 2:
        b, t = lead
        n_rows = 64
        cc = torch.full((b, n_rows, d // 2), 0xAB, dtype=torch.uint8, device=DEV)
        scc = torch.full((b, n_rows, d // block), 0xCD, dtype=torch.uint8, device=DEV)
        rows = torch.stack([torch.randperm(n_rows, device=DEV)[:t] for _ in range(b)])
        torch.ops.dsv41.rope_fp4_quant_store(x, cos, sin, block, e4m3, cc, scc, rows)
        bi = torch.arange(b, device=DEV)[:, None].expand_as(rows)
        assert torch.equal(cc[bi, rows], wp) and torch.equal(scc[bi, rows], ws)
        untouched = torch.ones(b, n_rows, dtype=torch.bool, device=DEV)
        untouched[bi, rows] = False
        assert bool((cc[untouched] == 0xAB).all()) and bool((scc[untouched] == 0xCD).all())


@pytest.mark.parametrize("cfg", [(128, 128, 4, 2), (128, 128, 8, 2), (64, 128, 4, 4), (128, 256, 4, 1),
                                 (64, 256, 4, 2), (32, 512, 4, 1), (64, 64, 2, 4)],
                         ids=lambda c: "bn{}-bk{}-w{}-it{}".format(*c))
@pytest.mark.parametrize("shape", [GEMV_SHAPES[1], GEMV_SHAPES[5]], ids=["wo_b", "expert_w1"])
def test_gemv_sweep_configs_are_correct(shape, cfg):
    # bench/kernels.py --sweep times these launch configurations; each must compute the same result.
    name, fp4, n, k = shape
    bn, bk, nw, it = cfg
    w, s = _weights(n, k, fp4, seed=n + 3 * k)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16) * 2
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    _check(fn(x, w, s, True, block_n=bn, block_k=bk, num_warps=nw, k_iters=it), x, w, s, True, fp4)


@pytest.mark.parametrize("d", [1024, 5120], ids=["small", "h200"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mhc_kernels_match_float64_reference_at_model_widths(d, dtype, monkeypatch):
    poison_outputs(monkeypatch, mk)  # NaN outputs until the kernels write them
    hh, fn, base, scale = (t.to(DEV) for t in H.make_mix_inputs(1, 1, d, dtype, d))
    plan = mk.mixes_plan(1, d)
    assert plan["SPLIT"] > 1  # decode spreads the fn read over programs
    pre, post, comb = mk.triton_mhc_mixes(hh, fn, base, scale, H.NORM_EPS, H.HC_EPS, H.ITERS)
    rp_, rq, rc = H.ref_mixes(hh.cpu(), fn.cpu(), base.cpu(), scale.cpu())
    H.assert_close(pre.cpu(), rp_, 2e-5, 1e-4, "pre")
    H.assert_close(post.cpu(), rq, 2e-5, 1e-4, "post")
    H.assert_close(comb.cpu(), rc, 2e-5, 1e-4, "comb")
    w = (torch.randn(d, generator=torch.Generator().manual_seed(1)) * 0.1 + 1).to(dtype).to(DEV)
    x = mk.triton_mhc_collapse_rmsnorm(hh, pre, w, H.NORM_EPS)
    H.assert_rounded(x.cpu(), H.ref_collapse_rmsnorm(hh.cpu(), pre.cpu(), w.cpu()), dtype, "collapse_rmsnorm",
                     roundings=2)
    y = torch.randn(1, 1, d, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEV)
    out = mk.triton_mhc_expand(y, hh, post, comb)
    H.assert_rounded(out.cpu(), H.ref_expand(y.cpu(), hh.cpu(), post.cpu(), comb.cpu()), dtype, "expand")
    ys = [mk.triton_mhc_mixes(hh, fn, base, scale, H.NORM_EPS, H.HC_EPS, H.ITERS)[2] for _ in range(3)]
    assert all(torch.equal(ys[0], c) for c in ys[1:])  # split-K combine is deterministic


@pytest.mark.parametrize("logit_scale, iters", [(8.0, 20), (8.0, 64), (0.5, 20)])
def test_mhc_sinkhorn_with_approximate_division_stays_within_tolerance(logit_scale, iters, monkeypatch):
    poison_outputs(monkeypatch, mk)
    # The Sinkhorn rounds divide with div.full.f32 (within 2 ulp) on the GPU, which the interpreter cannot show:
    # sharp logits (near-permutation matrices), more rounds than the model's 20, and flat logits.
    hh, fn, base, scale = (t.to(DEV) for t in H.make_mix_inputs(2, 1, 5120, torch.float32, 7,
                                                                logit_scale=logit_scale))
    got = mk.triton_mhc_mixes(hh, fn, base, scale, H.NORM_EPS, H.HC_EPS, iters)
    want = H.ref_mixes(hh.cpu(), fn.cpu(), base.cpu(), scale.cpu(), iters=iters)
    for g, w, name in zip(got, want, ("pre", "post", "comb")):
        H.assert_close(g.cpu(), w, 2e-5, 1e-4, name)



@pytest.mark.parametrize("d", [1024, 5120], ids=["small", "h200"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["w_fp32", "w_bf16"])
def test_mhc_mixes_with_norm_weight_match_float64_reference(d, wdtype, monkeypatch):
    # The normalise-then-project spelling (norm_weight, HAS_W): decode (split-K over programs), prefill rows in one
    # program each (split 1), and PDL (the weight block is read before the wait) bit-identical to no PDL.
    poison_outputs(monkeypatch, mk)
    w = (0.5 + torch.rand(4 * d, generator=torch.Generator().manual_seed(d + 5))).to(wdtype).to(DEV)
    hh, fn, base, scale = (t.to(DEV) for t in H.make_mix_inputs(1, 1, d, torch.bfloat16, d + 1))
    assert mk.mixes_plan(1, d)["SPLIT"] > 1
    got = mk.triton_mhc_mixes(hh, fn, base, scale, H.NORM_EPS, H.HC_EPS, H.ITERS, norm_weight=w)
    want = H.ref_mixes(hh.cpu(), fn.cpu(), base.cpu(), scale.cpu(), weight=w.cpu())
    for g, r, name in zip(got, want, ("pre", "post", "comb")):
        H.assert_close(g.cpu(), r, 2e-5, 1e-4, name)
    kernels.set_pdl(True)
    again = mk.triton_mhc_mixes(hh, fn, base, scale, H.NORM_EPS, H.HC_EPS, H.ITERS, norm_weight=w)
    kernels.set_pdl(False)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    rows, fn1, base1, scale1 = (t.to(DEV) for t in H.make_mix_inputs(2, 3, 1024, torch.float32, 9))
    w1 = (0.5 + torch.rand(4096, generator=torch.Generator().manual_seed(6))).to(wdtype).to(DEV)
    got = mk.triton_mhc_mixes(rows, fn1, base1, scale1, H.NORM_EPS, H.HC_EPS, H.ITERS, split=1, norm_weight=w1)
    want = H.ref_mixes(rows.cpu(), fn1.cpu(), base1.cpu(), scale1.cpu(), weight=w1.cpu())
    for g, r, name in zip(got, want, ("pre", "post", "comb")):
        H.assert_close(g.cpu(), r, 2e-5, 1e-4, name)


# ------------------------------------------------------------------------------------------- linear_upcast
U = load_reference("test_kernels_upcast_gemv")


@pytest.mark.parametrize("n, k", [(129280, 5120), (2048, 5120), (24, 16384), (512, 5120), (512, 1024)],
                         ids=["head", "wide", "narrow", "compressor", "compressor_small"])
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_upcast_gemv_matches_float64_at_h200_shapes(n, k, m, wdt):
    """The FP32 GEMV over a bf16 / fp16 / fp32 weight (the h200 LM head and the compressor's FP32 wkv among them)
    against float64, run twice with identical bits (split-K combine is deterministic), and the op's CUDA dispatch
    giving the same."""
    from dsv41.kernels import upcast_gemv as ug
    gen = torch.Generator().manual_seed(n + m)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(wdt).to(DEV)
    x = torch.randn(m, k, generator=gen).to(DEV)
    y = ug.triton_linear_upcast(x, w)
    assert torch.equal(y, ug.triton_linear_upcast(x, w))
    assert torch.equal(y, torch.ops.dsv41.linear_upcast(x, w))
    for n0 in range(0, n, 16384):
        U.assert_close64(y[:, n0:n0 + 16384], x, w[n0:n0 + 16384])
