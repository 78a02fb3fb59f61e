"""Tests of dsv41::linear_fp8_block_multi (dsv41/kernels/gemv_multi.py): several block-FP8 GEMVs of one x.

Reference: the float64 model of tests/test_kernels_quant_gemv.py (E4M3 grid from its bit layout, UE8M0 scales,
FP8 1x32 activation quantisation), never the code under test, with its tolerance; and the single-weight op, whose
results the one launch must equal bit for bit (the cases are chosen so that its plan is each weight's own).

- Interpreted (`@interpreted`, a TRITON_INTERPRET=1 child pytest): the one-launch kernel at small odd shapes (row
  counts that are not multiples of the tile, 2 / 3 / 4 weights, split-K, fp32 / bf16 / fp16 x, act_quant on and
  off), outputs poisoned; the separate calls for several x rows and for a weight on the TMA kernel.
- Everywhere: argument errors, opcheck, fake shapes.
- On a GPU (skipped here): the `h200` sibling shapes (wq_a + wkv, shared w1 + w3) against the single op, eagerly and
  replayed from a PDL CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from gpu_harness import assert_graph_replay_equals, load_reference
from interp_harness import InterpreterHarness, poison_outputs

from dsv41.kernels import gemv_multi as gm
from dsv41.kernels import quant_gemv as qg

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()
QG = load_reference("test_kernels_quant_gemv")
ON_GPU = torch.cuda.is_available() and not __import__("os").environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output/workspace either launcher allocates starts as NaN (floats) or 0xAB (bytes)."""
    poison_outputs(monkeypatch, gm)
    poison_outputs(monkeypatch, qg)


def _weights(widths, k, gen):
    return [QG.make_weights(n, k, False, gen) for n in widths]


MULTI_CASES = [
    # (N_i, K, x dtype, act_quant)
    ((40, 130), 320, torch.float32, True),            # partial tiles in both, one weight's tiles then the other's
    ((7, 256, 33), 512, torch.bfloat16, True),        # three weights, split-K (4 K tiles)
    ((128, 1, 64, 200), 96, torch.float16, False),    # four weights, a one-row weight, K below one tile
    ((96, 96), 4096, torch.float32, True),            # 32 K tiles: 32 K splits merged per weight
]


@interpreted
@pytest.mark.parametrize("case", MULTI_CASES, ids=lambda c: f"{'-'.join(map(str, c[0]))}_k{c[1]}_{c[2]}_aq{c[3]}")
def test_one_launch_matches_float64_reference_and_the_single_op(case, poisoned_outputs, monkeypatch):
    widths, k, dtype, aq = case
    gen = torch.Generator().manual_seed(sum(widths) + k)
    ws = _weights(widths, k, gen)
    x = torch.randn(1, k, generator=gen).to(dtype)
    separate = []
    real = qg.triton_linear_fp8_block
    monkeypatch.setattr(gm, "triton_linear_fp8_block", lambda *a, **kw: separate.append(1) or real(*a, **kw))
    assert gm.multi_launch_applies(x, [w for w, _ in ws])
    ys = gm.triton_linear_fp8_block_multi(x, [w for w, _ in ws], [s for _, s in ws], aq)
    assert separate == [], "one launch, not the separate calls"
    plan = qg.gemv_plan(1, sum(widths), k, False)
    for y, (w, s), n in zip(ys, ws, widths):
        assert y.shape == (1, n) and y.dtype == dtype
        QG.assert_close_to_ref(y, *QG.ref_linear(x, w, s, aq, False))
        # The cases are chosen so that the one plan is each weight's own: the same numbers bit for bit.
        alone = qg.gemv_plan(1, n, k, False)
        assert all(alone[key] == plan[key] for key in ("BLOCK_N", "BLOCK_K", "K_ITERS", "SPLIT_K"))
        assert torch.equal(y, qg.triton_linear_fp8_block(x, w, s, aq))


@interpreted
def test_several_rows_and_tma_sized_weights_take_the_separate_calls(poisoned_outputs, monkeypatch):
    gen = torch.Generator().manual_seed(71)
    ws = _weights((40, 72), 128, gen)
    calls = []
    real = qg.triton_linear_fp8_block
    monkeypatch.setattr(gm, "triton_linear_fp8_block", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x2 = torch.randn(2, 3, 128, generator=gen)  # six x rows
    assert not gm.multi_launch_applies(x2, [w for w, _ in ws])
    ys = gm.triton_linear_fp8_block_multi(x2, [w for w, _ in ws], [s for _, s in ws], True)
    assert len(calls) == 2
    for y, (w, s) in zip(ys, ws):
        assert y.shape == (2, 3, w.shape[0])
        QG.assert_close_to_ref(y, *QG.ref_linear(x2, w, s, True, False))
    # A weight the single op would run on the TMA kernel (threshold lowered; TMA eligible under the interpreter)
    from dsv41.kernels import gemv_tma
    monkeypatch.setattr(qg, "TMA_MIN_WEIGHT_BYTES_M1", 72 * 128)
    monkeypatch.setattr(gemv_tma, "tma_supported", lambda device: True)
    x1 = torch.randn(1, 128, generator=gen)
    assert not gm.multi_launch_applies(x1, [w for w, _ in ws])
    calls.clear()
    gm.triton_linear_fp8_block_multi(x1, [w for w, _ in ws], [s for _, s in ws], True)
    assert len(calls) == 2


def test_bad_arguments_raise_errors_naming_the_weight():
    gen = torch.Generator().manual_seed(72)
    (w0, s0), (w1, s1) = _weights((40, 64), 64, gen)
    x = torch.randn(1, 64, generator=gen)
    for fn in (gm.reference_linear_fp8_block_multi, gm.triton_linear_fp8_block_multi):
        with pytest.raises(ValueError, match="2 to 4 weights"):
            fn(x, [w0], [s0], True)
        with pytest.raises(ValueError, match="2 to 4 weights"):
            fn(x, [w0] * 5, [s0] * 5, True)
        with pytest.raises(ValueError, match="2 weights but 1 scales"):
            fn(x, [w0, w1], [s0], True)
        with pytest.raises(ValueError, match="weight 1: "):
            fn(x, [w0, w1[:, :32]], [s0, s1], True)
        with pytest.raises(TypeError, match="weight 0: weight has dtype float32"):
            fn(x, [w0.float(), w1], [s0, s1], True)
        with pytest.raises(TypeError, match="^x has dtype float64"):
            fn(x.double(), [w0, w1], [s0, s1], True)


def test_a_scale_copied_at_launch_is_not_read_under_pdl(monkeypatch):
    # The kernel reads weight and scale tiles before its PDL wait (they never come from the previous kernel). A scale
    # with a last stride != 1 is copied by the launcher, i.e. written just before: that launch must not use PDL.
    rec = QG._RecordingLaunch()  # records the launch keywords instead of launching
    monkeypatch.setattr(gm, "_gemv_multi_kernel", rec)
    monkeypatch.setattr(gm, "use_pdl_for", lambda kernel, device: True)
    monkeypatch.setattr(gm, "require_launchable", lambda *a: None)
    gen = torch.Generator().manual_seed(75)
    (w0, s0), (w1, s1) = _weights((32, 64), 128, gen)
    x = torch.randn(1, 128, generator=gen)
    gm.triton_linear_fp8_block_multi(x, [w0, w1], [s0, s1], True)
    strided = s1.t().contiguous().t()
    assert strided.stride(-1) != 1 and torch.equal(strided, s1)
    gm.triton_linear_fp8_block_multi(x, [w0, w1], [s0, strided], True)
    assert [c["USE_PDL"] for c in rec.calls] == [True, False]
    assert [c.get("launch_pdl", False) for c in rec.calls] == [True, False]


def test_op_passes_opcheck_and_its_fake_gives_each_shape():
    gen = torch.Generator().manual_seed(73)
    (w0, s0), (w1, s1) = _weights((40, 24), 64, gen)
    x = torch.randn(3, 64, generator=gen)
    op = torch.ops.dsv41.linear_fp8_block_multi.default
    torch.library.opcheck(op, (x, [w0, w1], [s0, s1], True))
    torch.library.opcheck(op, (x.bfloat16(), [w0, w1], [s0, s1], False))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fx_ = torch.empty(2, 5, 64, dtype=torch.bfloat16)
        ys = op(fx_, [torch.empty(40, 64, dtype=torch.uint8), torch.empty(24, 64, dtype=torch.uint8)],
                [torch.empty(2, 2, dtype=torch.uint8), torch.empty(1, 2, dtype=torch.uint8)], True)
    assert [tuple(y.shape) for y in ys] == [(2, 5, 40), (2, 5, 24)] and all(y.dtype == torch.bfloat16 for y in ys)
    # The CPU op is the single op per weight, bit for bit.
    for y, w, s in zip(op(x, [w0, w1], [s0, s1], True), (w0, w1), (s0, s1)):
        assert torch.equal(y, torch.ops.dsv41.linear_fp8_block(x, w, s, True))


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.parametrize("frag", [True, False], ids=["fragment", "tile"])
@pytest.mark.parametrize("widths,k", [((1280, 512), 5120), ((2304, 2304), 5120), ((32768, 4096), 1280)],
                         ids=["wq_a+wkv", "shared_w1+w3", "wq_b+indexer_wq_b"])
def test_gpu_h200_siblings_match_the_reference_also_in_a_pdl_graph(widths, k, frag, monkeypatch):
    # The fragment kernel over every weight (the default at these shapes), or with it off the tile launch, which
    # equals the single op bit for bit where its plan is each weight's own (wq_a + wkv, shared w1 + w3); wq_b is
    # then too large for one tile launch (separate calls).
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU (compiled Triton kernels)")
    from dsv41 import kernels
    from dsv41.kernels import gemv_frag
    poison_outputs(monkeypatch, gm)
    if not frag:
        monkeypatch.setattr(gm, "FRAG_MULTI_MIN_WEIGHT_BYTES", 1 << 62)
        monkeypatch.setattr(qg, "FRAG_DEFAULT", False)
    launches = []
    real = gemv_frag.launch_frag_gemv_multi
    monkeypatch.setattr(gemv_frag, "launch_frag_gemv_multi", lambda x2, ws, *a, **kw: launches.append(len(ws)) or
                        real(x2, ws, *a, **kw))
    gen = torch.Generator().manual_seed(74)
    ws = [(w.cuda(), s.cuda()) for w, s in _weights(widths, k, gen)]
    x = (torch.randn(1, k, generator=gen) * 2).bfloat16().cuda()
    assert gm.frag_launch_applies(x, [w for w, _ in ws], True) is frag

    def step():
        return (*torch.ops.dsv41.linear_fp8_block_multi(x, [w for w, _ in ws], [s for _, s in ws], True),
                *(torch.ops.dsv41.linear_fp8_block(x, w, s, True) for w, s in ws))

    kernels.set_pdl(True)
    try:
        out = step()
        assert launches[:1] == ([2] if frag else [])  # one fragment launch for both weights
        for y, single, (w, s) in zip(out[:2], out[2:], ws):
            if not frag and k == 5120:
                assert torch.equal(y, single)
            QG.assert_close_to_ref(y.cpu(), *QG.ref_linear(x.cpu(), w.cpu(), s.cpu(), True, False))
        assert_graph_replay_equals(step, out)
    finally:
        kernels.set_pdl(False)
