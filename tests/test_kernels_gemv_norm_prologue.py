"""`dsv41::linear_fp8_block` with an RMSNorm prologue: the kernels normalise the x they read.

- Interpreted (`@interpreted`, a TRITON_INTERPRET=1 child pytest): the tile-at-once kernel (M = 1 and 3) and the
  fragment GEMV's activation launch (M = 1) for each norm spelling, outputs poisoned first, against a float64
  reference written here (the norm in float64 statistics with the spelling's bf16 roundings, the E4M3 grid of
  `test_pass_dispatch`, the block-FP8 weight decoded from its bytes). Tolerance: 2e-2 of the output's largest
  magnitude (the FP32 statistic may flip an FP8 rounding of an element now and then; a wrong spelling, a missing
  weight or a wrong eps is off by far more at these row magnitudes).
- Interpreted, exactly: the fragment GEMV's activation launch (`prepare_frag_x(norm=...)`, which runs the same
  `row_rstd` / `rms_apply` as the tile kernel) gives, byte for byte, the FP8 codes and scales of the spelling written
  here in eager FP32, on rows whose sum of squares is exact in any order; the neighbouring spelling's codes differ
  (so the one extra rounding that tells modes 1 / 2 and 4 / 5 apart, invisible in a bf16 GEMV output, is checked).
- On a GPU (skipped here): the same cases, and the default kernel choice (the fragment GEMV from 8 MiB of weight),
  against the same reference.
- Built offline for sm_90 with Triton's ptxas (no GPU needed): both kernels compile with the prologue on, and the
  tile kernel still issues its weight loads before the PDL wait (only x and the norm weight wait).
"""

from __future__ import annotations

import pytest
import torch

from interp_harness import InterpreterHarness, poison_outputs, sm90_ttir
from test_pass_dispatch import quantize_fp8_block_for_test, ref_dequant_fp8_block, ref_fake_quant_fp8_1x32

from dsv41.kernels import grouped_frag as gf
from dsv41.kernels import quant_gemv as qg

ON_GPU = torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1"
_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()
EPS = 1e-6


@pytest.fixture
def poisoned_outputs(monkeypatch):
    poison_outputs(monkeypatch, qg)


def _ref(h, nw, mode, codes, exps):
    hd = h.double()
    y = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS)
    if mode in (1, 4):
        y = y.to(h.dtype).double() * nw.double()
    elif mode in (2, 5):
        y = y * nw.double()
    if mode <= 3:
        y = y.to(h.dtype).double()
    return ref_fake_quant_fp8_1x32(y) @ ref_dequant_fp8_block(codes, exps).T


CASES = [
    # (M, N, K, x dtype, mode, overrides)
    (1, 64, 256, torch.bfloat16, 1, {}),
    (1, 64, 256, torch.bfloat16, 2, {}),
    (1, 48, 320, torch.bfloat16, 3, {}),                       # a K tail, no weight
    (1, 64, 256, torch.bfloat16, 5, {}),                       # torch 2.11's unrounded form
    (3, 64, 256, torch.bfloat16, 4, {}),                       # three rows: each its own statistic
    (2, 40, 1536, torch.float32, 2, {"block_k": 256}),         # several K tiles per row, KP 2048 > one chunk
    (1, 64, 512, torch.bfloat16, 2, {"frag": True}),           # the fragment GEMV's activation launch
    (1, 64, 512, torch.bfloat16, 6, {"frag": True}),
    (1, 40, 96, torch.float32, 5, {"frag": True}),
]


def _check(case, device):
    m, n, k, dt, mode, over = case
    gen = torch.Generator().manual_seed(n * 31 + k + mode)
    codes, exps = quantize_fp8_block_for_test(torch.randn(n, k, generator=gen) / k ** 0.5)
    # rows at very different magnitudes: the statistic, and eps at the tiny row, matter
    mags = torch.tensor([4.0, 3e-3, 250.0])[:m, None]
    h = (torch.randn(m, k, generator=gen) * mags).to(dt)
    nw = None if mode in (3, 6) else (1 + 0.3 * torch.randn(k, generator=gen)).to(dt)
    dev = torch.device(device)
    y = qg.triton_linear_fp8_block(h.to(dev), codes.to(dev), exps.to(dev), True, None if nw is None else nw.to(dev),
                                   EPS, mode, **over).cpu()
    want = _ref(h, nw, mode, codes, exps)
    assert y.shape == (m, n) and y.dtype == dt and torch.isfinite(y).all()
    for r in range(m):  # each row on its own scale (the tiny row's outputs are ~1e3 times smaller than its neighbours)
        err = float((y[r].double() - want[r]).abs().max())
        assert err <= 2e-2 * float(want[r].abs().max()), (r, err)


_IDS = lambda c: (f"M{c[0]}-{c[1]}x{c[2]}-{str(c[3])[6:]}-mode{c[4]}-"  # noqa: E731
                  + "-".join(f"{k}{v}" for k, v in c[5].items()))


@interpreted
@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_prologue_matches_float64_reference(case, poisoned_outputs):
    _check(case, "cpu")


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES + [(1, 4096, 2048, torch.bfloat16, 2, {}),     # 8 MiB: the default fragment GEMV
                                          (1, 4096, 2048, torch.bfloat16, 5, {})], ids=_IDS)
def test_gpu_prologue_matches_float64_reference(case, poisoned_outputs):
    _check(case, "cuda")


def test_prologue_refuses_other_kernels():
    h = torch.randn(1, 64, dtype=torch.bfloat16)
    codes, exps = quantize_fp8_block_for_test(torch.randn(32, 64))
    for over in ({"tma": True}, {"rows": True}, {"stages": 2}, {"mma": True}):
        with pytest.raises(ValueError, match="tile-at-once or the fragment kernel"):
            qg.triton_linear_fp8_block(h, codes, exps, True, None, EPS, 3, **over)


def test_sm90_builds_of_the_prologue_wait_only_for_x():
    """Both kernels compile for sm_90 with NORM on; the tile kernel loads its weight tile before griddepcontrol.wait
    and reads x (the row statistic included) after it."""
    ptrs = dict(x_ptr="bf16", w_ptr="u8", s_ptr="u8", y_ptr="bf16", part_ptr="fp32", cnt_ptr="i32", nw_ptr="bf16")
    plan = qg.gemv_plan(1, 4096, 512, False)
    consts = dict(FP4=False, ACT_QUANT=True, SPLIT_K=plan["SPLIT_K"], SPLIT_POW2=plan["SPLIT_POW2"],
                  K_ITERS=plan["K_ITERS"], STAGES=1, SCALE_WORDS=False, MMA=False, DOT_F32=False, BLOCK_M=1,
                  BLOCK_N=plan["BLOCK_N"], BLOCK_K=plan["BLOCK_K"], EARLY_LAUNCH=False, USE_PDL=True, NORM=2, KP=512)
    ptx = sm90_ttir(qg._quant_gemv_kernel, ptrs, consts, {"eps": "fp32"}, num_warps=plan["num_warps"], stage="ptx")
    wait = ptx.find("griddepcontrol.wait")
    loads = [i for i in range(len(ptx)) if ptx.startswith("ld.global", i)]
    assert wait > 0 and loads and loads[0] < wait < loads[-1], (wait, loads[:3], loads[-1:])
    before, after = ptx.split("griddepcontrol.wait", 1)
    assert "sqrt.rn.f32" in after and "sqrt.rn.f32" not in before  # the statistic reads x: after the wait
    fptrs = dict(x_ptr="bf16", q_ptr="u8", s_ptr="fp32", nw_ptr="bf16")
    fconsts = dict(BLOCK=gf._PREP_BLOCK, PART_ORDER=False, USE_PDL=True, EARLY=True, NORM=5, KP=1024)
    fptx = sm90_ttir(gf._frag_x_kernel, fptrs, fconsts, {"eps": "fp32"}, stage="ptx")
    assert "griddepcontrol.wait" in fptx


def _spelled_f32(h, nw, mode):
    """The spelling in eager FP32 with the statistic as the kernels compute it: 1 / sqrt (each correctly rounded)
    of the FP32 mean of squares plus eps (torch.rsqrt on the CPU differs from that by up to 2 ulp)."""
    xf = h.float()
    y = xf * (1 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + EPS))
    if mode in (1, 4):
        y = y.to(h.dtype).float() * nw.float()
    elif mode in (2, 5):
        y = y * nw.float()
    return y.to(h.dtype).float() if mode <= 3 else y


@interpreted
@pytest.mark.parametrize("mode, dt", [(1, torch.bfloat16), (2, torch.bfloat16), (3, torch.bfloat16),
                                      (4, torch.bfloat16), (5, torch.bfloat16), (6, torch.bfloat16),
                                      (2, torch.float32)])
def test_activation_launch_quantises_the_spelling_exactly(mode, dt):
    k = 512
    gen = torch.Generator().manual_seed(mode)
    # small integers times a power of two: the sum of squares is exact in any order, the mean (k = 2^9) too
    h = (torch.randint(-7, 8, (3, k), generator=gen).float() * torch.tensor([[8.0], [2.0 ** -7], [1.0]])).to(dt)
    nw = None if mode in (3, 6) else (1 + 0.3 * torch.randn(k, generator=gen)).to(dt)

    def poisoned(shape, dtype, device):
        return torch.full(shape, 0xAB if dtype == torch.uint8 else float("nan"), dtype=dtype, device=device)

    xq, xs = gf.prepare_frag_x(h, poisoned, False, part_order=False, norm=(nw, EPS, mode))
    got = xq.view(torch.float8_e4m3fn).double() * xs.double().repeat_interleave(32, 1)
    want = ref_fake_quant_fp8_1x32(_spelled_f32(h, nw, mode))
    assert torch.equal(got, want), float((got - want).abs().max())
    if mode in (1, 2, 4, 5) and dt != torch.float32:  # the neighbouring spelling (one bf16 rounding more or less)
        # quantises differently here (in FP32 modes 1 and 2 are one computation)
        other = {1: 2, 2: 1, 4: 5, 5: 4}[mode]
        assert not torch.equal(ref_fake_quant_fp8_1x32(_spelled_f32(h, nw, other)), want)
