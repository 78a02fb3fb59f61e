"""Tests of dsv41::grouped_linear_fp4 (dsv41/kernels/grouped_gemv.py): FP4 GEMV over gathered experts.

Reference: an independent float64 model of MODEL.md §2.1 / §2.9 written here (E4M3 and E2M1 grids enumerated
from their bit layouts, nearest-even by grid index, UE8M0 ceil from frexp, the expert of each (token, slot)
picked with an explicit Python loop), never the code under test. The CPU op is also checked bit for bit against
the model's own gather -> dequantise -> einsum (dsv41/model/moe.py).

Interpreter tests (`@interpreted`) run in a TRITON_INTERPRET=1 child pytest unless this process already has the
variable (tests/interp_harness.py). Outputs and workspaces are poisoned (NaN) before the kernels run.
Tolerance: |y - ref| <= 2^-16 sum|terms| (FP32 accumulation in another order) + half an output ulp (2^-8 |ref|
for bf16, 2^-10 for fp16).
"""

from __future__ import annotations

import pytest
import torch

from interp_harness import IN_INTERPRETER, InterpreterHarness, poison_outputs

from dsv41.kernels import grouped_gemv as gg

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture(autouse=True)
def _no_fragment_kernel(monkeypatch):
    """This module tests the tile and word-decode kernels and their defaults; the tensor-core fragment kernel,
    which comes first by default where it applies, has tests/test_kernels_grouped_frag.py."""
    monkeypatch.setattr(gg, "FRAG_DEFAULT", False)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output/workspace the launcher allocates starts as NaN."""
    poison_outputs(monkeypatch, gg)


# ------------------------------------------------------------------------------------------- float64 reference
def _e4m3_grid() -> torch.Tensor:
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


E4M3_GRID = _e4m3_grid()
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _round_to_grid(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    a = a.contiguous()
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - grid[lo], grid[hi] - a
    return torch.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)


def ref_fake_quant_fp8(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 1x32 fake quant with a UE8M0 ceil scale (amax floored at 1e-4 in FP32); float64 of x.dtype values."""
    shp = x.shape
    xb = x.double().reshape(*shp[:-1], shp[-1] // 32, 32)
    amax32 = xb.abs().amax(-1).float().clamp(min=float(torch.tensor(1e-4, dtype=torch.float32)))
    m, e = torch.frexp((amax32 / 448.0).double())
    scale = torch.pow(2.0, torch.where(m == 0.5, e - 1, e).double())
    q = (xb / scale[..., None]).clamp(-448.0, 448.0)
    val = E4M3_GRID[_round_to_grid(q.abs(), E4M3_GRID)] * torch.sign(q) * scale[..., None]
    return val.reshape(shp).to(x.dtype).double()


def ref_dequant_expert(w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 [out, K] of one expert's packed E2M1 (low nibble = even k) times 2^(e-127) per 1x32 block."""
    codes = torch.stack(((w & 15).long(), (w >> 4).long()), -1).reshape(w.shape[0], -1)
    vals = E2M1_GRID[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    sc = torch.pow(2.0, s.double() - 127).to(dtype).double().repeat_interleave(32, 1)
    return (vals * sc).to(dtype).double()


def ref_grouped(x, w, s, idx, act_quant: bool):
    """(y64 [N, k, out], abs64): y[n, j] = xq[n (, j)] @ W_{idx[n, j] mod E}^T, one (token, slot) at a time."""
    n, k = idx.shape
    e = w.shape[0]
    xq = ref_fake_quant_fp8(x) if act_quant else x.double()
    y = torch.zeros(n, k, w.shape[1], dtype=torch.float64)
    mag = torch.zeros_like(y)
    for t in range(n):
        for j in range(k):
            ex = int(idx[t, j]) % e
            wd = ref_dequant_expert(w[ex], s[ex], x.dtype)
            row = xq[t] if x.dim() == 2 else xq[t, j]
            y[t, j] = wd @ row
            mag[t, j] = wd.abs() @ row.abs()
    return y, mag


def assert_close_to_ref(y, y64, abs64):
    rel = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}[y.dtype]
    assert not torch.isnan(y).any(), "output has NaN (an element was never written)"
    err = (y.double() - y64).abs()
    tol = 2.0 ** -16 * abs64 + rel * y64.abs() + 1e-30
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"max err/tol = {worst:.3g} (max err {err.max().item():.3g})"


def make_experts(e, out, k, gen):
    """Random packed FP4 stacks [E, out, K/2] and UE8M0 scales [E, out, K/32] (2^-10 .. 2^-4)."""
    w = torch.randint(0, 256, (e, out, k // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(117, 124, (e, out, k // 32), dtype=torch.uint8, generator=gen)
    return w, s


def make_indices(n, k, e, gen, negative=False):
    """[n, k] distinct experts per token (as the router picks them); some negative (wrapping) when asked."""
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    if negative:
        idx = torch.where(torch.arange(n * k).view(n, k) % 2 == 1, idx - e, idx)
    return idx


def make_x(n, k, kdim, dtype, shared, gen):
    shape = (n, kdim) if shared else (n, k, kdim)
    return (torch.randn(*shape, generator=gen) * 2).to(dtype)


# ------------------------------------------------------------------------------------------- CPU op (reference)
@pytest.mark.parametrize("shared", [True, False], ids=["x_per_token", "x_per_expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_op_matches_float64_model(dtype, shared):
    gen = torch.Generator().manual_seed(1)
    w, s = make_experts(6, 40, 96, gen)
    idx = make_indices(3, 2, 6, gen, negative=True)
    x = make_x(3, 2, 96, dtype, shared, gen)
    y = torch.ops.dsv41.grouped_linear_fp4(x, w, s, idx, True)
    assert y.shape == (3, 2, 40) and y.dtype == dtype
    assert_close_to_ref(y, *ref_grouped(x, w, s, idx, True))


def test_reference_op_is_the_models_gather_dequantise_einsum():
    """Bit for bit what RoutedExperts.forward_gather computes for w1 (x per token) and w2 (x per expert)."""
    from dsv41.model import ModelConfig
    from dsv41.model.formats import fake_quant_fp8_1x32
    from dsv41.model.moe import RoutedExperts

    cfg = ModelConfig.preset("tiny")
    for dtype in (torch.float32, torch.bfloat16):
        m = RoutedExperts(cfg, "checkpoint", dtype)
        m.init_random(torch.Generator().manual_seed(0))
        gen = torch.Generator().manual_seed(2)
        idx = make_indices(3, cfg.num_experts_per_tok, cfg.n_routed_experts, gen)
        x = torch.randn(3, cfg.hidden_size, generator=gen).to(dtype)
        want = torch.einsum("nd,nkfd->nkf", fake_quant_fp8_1x32(x), m.dequantized_weight("w1", idx))
        assert torch.equal(torch.ops.dsv41.grouped_linear_fp4(x, m.w1, m.w1_scale, idx, True), want)
        h = torch.randn(3, cfg.num_experts_per_tok, cfg.moe_intermediate_size, generator=gen).to(dtype)
        want = torch.einsum("nkf,nkdf->nkd", fake_quant_fp8_1x32(h), m.dequantized_weight("w2", idx))
        assert torch.equal(torch.ops.dsv41.grouped_linear_fp4(h, m.w2, m.w2_scale, idx, True), want)


def test_reference_rejects_out_of_range_indices_naming_them():
    gen = torch.Generator().manual_seed(3)
    w, s = make_experts(5, 40, 64, gen)
    x = make_x(2, 2, 64, torch.float32, True, gen)
    for bad in (5, -6, 1000):
        idx = torch.tensor([[0, 1], [bad, 2]])
        with pytest.raises(IndexError, match=rf"indices holds expert {bad}, out of range .*E = 5"):
            gg.reference_grouped_linear_fp4(x, w, s, idx, True)
        with pytest.raises(IndexError, match="indices"):
            torch.ops.dsv41.grouped_linear_fp4(x, w, s, idx, True)


# ------------------------------------------------------------------------------------------- Triton (interpreted)
GROUPED_CASES = [
    # (N, k, E, out, K, dtype, x per token, act_quant, overrides)
    (1, 2, 8, 64, 128, torch.float32, True, True, {}),                      # tiny decode: w1 / w3
    (1, 2, 8, 128, 64, torch.float32, False, True, {}),                     # tiny decode: w2
    (3, 2, 5, 40, 96, torch.bfloat16, True, True, {}),                      # odd out, half-empty K tile
    (3, 2, 5, 40, 160, torch.float32, False, True, {"block_k": 32}),        # x per expert, 5 K splits
    (2, 3, 7, 72, 64, torch.float16, False, True, {}),                      # fp16 roundings
    (1, 6, 9, 40, 96, torch.bfloat16, True, False, {"block_n": 16}),        # no act quant, 3 out tiles
    (4, 1, 3, 24, 256, torch.float32, True, True, {"block_k": 64, "k_iters": 3}),  # K loop: splits 3 + 1
    # pipelined K loops (scales read as int32 words where K % 128 == 0) and tensor-core tiles (bf16 x only)
    (2, 3, 5, 40, 384, torch.float32, True, True, {"stages": 3, "k_iters": 3}),     # words, one split
    (2, 3, 5, 40, 640, torch.float16, False, True, {"stages": 2, "k_iters": 2}),    # words, 3 uneven splits
    (1, 6, 9, 40, 160, torch.float32, True, True, {"stages": 3, "block_k": 32}),    # byte scales, 5 splits
    (2, 3, 5, 40, 384, torch.bfloat16, True, True, {"mma": True, "stages": 3, "k_iters": 3}),
    (3, 2, 5, 72, 640, torch.bfloat16, False, True, {"mma": True, "k_iters": 2, "block_n": 32}),
    (1, 6, 9, 40, 96, torch.bfloat16, True, False, {"mma": True, "block_n": 16}),   # partial K tile, no aq
]


def _case_id(c):
    n, k, e, out, kdim, dtype, shared, aq, ov = c
    tail = "-".join(f"{a}{b}" for a, b in ov.items())
    return f"{n}x{k}of{e}-{out}x{kdim}-{str(dtype)[6:]}-{'tok' if shared else 'exp'}-aq{int(aq)}-{tail}"


@interpreted
@pytest.mark.parametrize("case", GROUPED_CASES, ids=_case_id)
def test_triton_grouped_gemv_matches_float64_reference(case, poisoned_outputs):
    n, k, e, out, kdim, dtype, shared, act_quant, overrides = case
    gen = torch.Generator().manual_seed(n * 1000 + out * 7 + kdim)
    w, s = make_experts(e, out, kdim, gen)
    idx = make_indices(n, k, e, gen)
    x = make_x(n, k, kdim, dtype, shared, gen)
    y = gg.triton_grouped_linear_fp4(x, w, s, idx, act_quant, **overrides)
    assert y.shape == (n, k, out) and y.dtype == dtype
    assert_close_to_ref(y, *ref_grouped(x, w, s, idx, act_quant))


@interpreted
@pytest.mark.parametrize("stages", [1, 3])
def test_word_and_byte_scales_agree_with_reference(stages, poisoned_outputs):
    # The same scales contiguous (int32 words when pipelined) and one byte into a larger buffer (bytes), on the
    # CUDA-core and tensor-core paths.
    gen = torch.Generator().manual_seed(21 + stages)
    w, s = make_experts(4, 40, 384, gen)
    shifted = torch.empty(s.numel() + 1, dtype=torch.uint8)[1:].view(s.shape)
    shifted.copy_(s)
    idx = make_indices(2, 3, 4, gen)
    for dtype, mma in ((torch.float32, False), (torch.bfloat16, True)):
        x = make_x(2, 3, 384, dtype, True, gen)
        want = ref_grouped(x, w, s, idx, True)
        for scale in (s, shifted):
            y = gg.triton_grouped_linear_fp4(x, w, scale, idx, True, stages=stages, k_iters=3, mma=mma)
            assert_close_to_ref(y, *want)


@interpreted
def test_tensor_core_tiles_need_bf16_activations():
    gen = torch.Generator().manual_seed(22)
    w, s = make_experts(4, 40, 128, gen)
    idx = make_indices(2, 3, 4, gen)
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(ValueError, match="mma=True .* needs bf16 x, got torch.float"):
            gg.triton_grouped_linear_fp4(make_x(2, 3, 128, dtype, True, gen), w, s, idx, True, mma=True)
    with pytest.raises(ValueError, match="needs bf16"):  # also with no rows to compute
        gg.triton_grouped_linear_fp4(torch.zeros(0, 128), w, s, idx[:0], True, mma=True)


@interpreted
def test_triton_reads_strided_stacks_and_activations(poisoned_outputs):
    # Experts sliced out of a bigger stack (row stride 2 x the packed row) and x a transposed view.
    gen = torch.Generator().manual_seed(11)
    w_big, s_big = make_experts(4, 80, 96, gen)
    w, s = w_big[:, 1::2], s_big[:, 1::2]
    x = torch.randn(96, 3, generator=gen).t()
    idx = make_indices(3, 2, 4, gen)
    assert not w.is_contiguous() and not x.is_contiguous()
    y = gg.triton_grouped_linear_fp4(x, w, s, idx, True)
    assert_close_to_ref(y, *ref_grouped(x, w, s, idx, True))


@interpreted
def test_split_k_is_deterministic_and_matches_one_k_tile(poisoned_outputs):
    gen = torch.Generator().manual_seed(5)
    w, s = make_experts(6, 40, 256, gen)
    idx = make_indices(2, 3, 6, gen)
    x = make_x(2, 3, 256, torch.float32, False, gen)
    a = gg.triton_grouped_linear_fp4(x, w, s, idx, True, block_k=32)  # 8 K splits per output tile
    b = gg.triton_grouped_linear_fp4(x, w, s, idx, True, block_k=32)
    c = gg.triton_grouped_linear_fp4(x, w, s, idx, True, block_k=256)
    assert torch.equal(a, b)
    y64, abs64 = ref_grouped(x, w, s, idx, True)
    assert_close_to_ref(a, y64, abs64)
    assert_close_to_ref(c, y64, abs64)


@interpreted
def test_negative_indices_wrap_like_weight_indexing(poisoned_outputs):
    gen = torch.Generator().manual_seed(6)
    w, s = make_experts(5, 40, 64, gen)
    idx = make_indices(3, 2, 5, gen)
    x = make_x(3, 2, 64, torch.bfloat16, True, gen)
    pos = gg.triton_grouped_linear_fp4(x, w, s, idx, True)
    neg = gg.triton_grouped_linear_fp4(x, w, s, idx - 5, True)
    assert torch.equal(pos, neg)
    assert torch.equal(gg.reference_grouped_linear_fp4(x, w, s, idx - 5, True),
                       gg.reference_grouped_linear_fp4(x, w, s, idx, True))


@interpreted
def test_triton_marks_an_out_of_range_expert_with_nan_rows(poisoned_outputs):
    # CUDA behaviour (module docstring): no host check; the bad (token, slot) row is NaN, the others are exact.
    gen = torch.Generator().manual_seed(8)
    w, s = make_experts(5, 40, 64, gen)
    idx = make_indices(3, 2, 5, gen)
    x = make_x(3, 2, 64, torch.float32, True, gen)
    good = gg.triton_grouped_linear_fp4(x, w, s, idx, True)
    for bad in (5, -6, 1 << 40):
        b = idx.clone()
        b[1, 0] = bad
        y = gg.triton_grouped_linear_fp4(x, w, s, b, True)
        assert torch.isnan(y[1, 0]).all()
        keep = torch.ones(3, 2, dtype=torch.bool)
        keep[1, 0] = False
        assert torch.equal(y[keep], good[keep])


# ------------------------------------------------------------------------------------------- word-decode MMA
MMA_WORDS_CASES = [
    # (N, k, E, out, K, dtype, x per token, overrides): dsv41/kernels/grouped_mma.py
    (1, 2, 8, 64, 256, torch.float32, True, {"block_n": 64}),                # one tile, fp32 x
    (3, 2, 5, 40, 96, torch.bfloat16, True, {"block_n": 16, "block_k": 64}),   # odd out, K tail, 3 out tiles
    (2, 3, 5, 72, 640, torch.bfloat16, False, {"block_n": 32, "block_k": 128, "programs_per_sm": 64,
                                                "sm_count": 1}),             # x per expert, 5 K tiles in 3 splits
    (1, 6, 9, 40, 640, torch.float32, True, {"block_n": 16, "block_k": 64, "programs_per_sm": 1,
                                              "sm_count": 40, "stages": 2}),  # 10 K tiles in 2 splits of 5
    (2, 2, 4, 48, 1024, torch.bfloat16, True, {"block_n": 16, "block_k": 512}),  # 16 blocks: MMA_N = 16, no pad
    (1, 2, 3, 24, 1056, torch.float32, True, {"block_n": 16, "block_k": 1024}),  # MMA_N = 32, K tail
]


@interpreted
@pytest.mark.parametrize("case", MMA_WORDS_CASES, ids=lambda c: _case_id((*c[:7], True, c[7])))
def test_word_decode_mma_matches_float64_reference(case, poisoned_outputs):
    n, k, e, out, kdim, dtype, shared, overrides = case
    _assert_all_codes_case_matches((n, k, e, out, kdim, dtype, shared, True), n * 977 + out * 5 + kdim,
                                   mma_words=True, **overrides)


def _assert_all_codes_case_matches(case, seed, **over):
    """One launch of `case` (N, k, E, out, K, dtype, x per token, act_quant) with every one of the 16 E2M1 codes in
    every nibble position of a word (random bytes alone could miss one) and negative indices, against float64."""
    n, k, e, out, kdim, dtype, shared, act_quant = case
    gen = torch.Generator().manual_seed(seed)
    w, s = make_experts(e, out, kdim, gen)
    w.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    idx = make_indices(n, k, e, gen, negative=True)
    x = make_x(n, k, kdim, dtype, shared, gen)
    y = gg.triton_grouped_linear_fp4(x, w, s, idx, act_quant, **over)
    assert y.shape == (n, k, out) and y.dtype == dtype
    assert_close_to_ref(y, *ref_grouped(x, w, s, idx, act_quant))


def _assert_deterministic_with_nan_rows_for_bad_experts(x, w, s, idx, bad_values, **over):
    """Two launches give the same bits, close to float64; an expert index in `bad_values` at (1, 2) makes that row
    NaN and leaves every other row exactly as before (act_quant on, x per token, idx [2, 3])."""
    a = gg.triton_grouped_linear_fp4(x, w, s, idx, True, **over)
    assert torch.equal(a, gg.triton_grouped_linear_fp4(x, w, s, idx, True, **over))
    assert_close_to_ref(a, *ref_grouped(x, w, s, idx, True))
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 2] = False
    for bad in bad_values:
        b = idx.clone()
        b[1, 2] = bad
        y = gg.triton_grouped_linear_fp4(x, w, s, b, True, **over)
        assert torch.isnan(y[1, 2]).all()
        assert torch.equal(y[keep], a[keep])


@interpreted
def test_word_decode_mma_split_k_is_deterministic_and_marks_bad_experts(poisoned_outputs):
    gen = torch.Generator().manual_seed(31)
    w, s = make_experts(5, 40, 512, gen)
    idx = make_indices(2, 3, 5, gen)
    x = make_x(2, 3, 512, torch.bfloat16, True, gen)
    split = dict(block_n=16, block_k=64, programs_per_sm=1, sm_count=48)  # 3 out tiles x 6 pairs: 8 K tiles in 2
    from dsv41.kernels import grouped_mma as gm
    assert gm.grouped_mma_plan(6, 40, 512, **split)["SPLIT_K"] == 2
    _assert_deterministic_with_nan_rows_for_bad_experts(x, w, s, idx, (5,), mma_words=True, **split)


def test_word_decode_mma_refuses_what_it_cannot_compute_exactly():
    gen = torch.Generator().manual_seed(32)
    w, s = make_experts(4, 40, 128, gen)
    idx = make_indices(2, 3, 4, gen)
    x = make_x(2, 3, 128, torch.bfloat16, True, gen)
    with pytest.raises(ValueError, match="mma_words=True needs act_quant=True"):
        gg.triton_grouped_linear_fp4(x, w, s, idx, False, mma_words=True)
    with pytest.raises(ValueError, match="mma_words=True needs .* bf16 or fp32 x"):
        gg.triton_grouped_linear_fp4(x.half(), w, s, idx, True, mma_words=True)
    odd = torch.empty(w.numel() + 1, dtype=torch.uint8)[1:].view(w.shape)  # 1-byte offset: no int32 words
    with pytest.raises(ValueError, match="weight readable as int32 words"):
        gg.triton_grouped_linear_fp4(x, odd, s, idx, True, mma_words=True)
    with pytest.raises(ValueError, match=r"options \['k_iters'\] do not apply to mma_words=True"):
        gg.triton_grouped_linear_fp4(x, w, s, idx, True, mma_words=True, k_iters=2)
    with pytest.raises(ValueError, match=r"\['programs_per_sm'\] need mma_words=True"):
        gg.triton_grouped_linear_fp4(x, w, s, idx, True, mma_words=False, programs_per_sm=2)


def test_word_decode_mma_plan():
    from dsv41.kernels import grouped_mma as gm

    # h200 decode, 6 experts: w1/w3 [2304, 5120]: 36 row tiles x 6 pairs = 216, split 2 -> 432 <= 528 programs.
    plan = gm.grouped_mma_plan(6, 2304, 5120)
    assert plan["grid"] == (36, 2, 6) and plan["K_ITERS"] == 10 and plan["MMA_N"] == 16
    # w2 [5120, 2304]: 480 tiles already fill the 528 slots: no split, 9 K tiles per program.
    plan = gm.grouped_mma_plan(6, 5120, 2304)
    assert plan["grid"] == (80, 1, 6) and plan["K_ITERS"] == 9
    assert gm.grouped_mma_plan(1, 64, 1024, block_k=1024)["MMA_N"] == 32
    for bad in (dict(block_n=48), dict(block_k=16), dict(stages=0), dict(num_warps=2), dict(programs_per_sm=0)):
        with pytest.raises(ValueError):
            gm.grouped_mma_plan(6, 2304, 5120, **bad)
    for bad in (dict(stages=2.5), dict(block_n=64.0), dict(block_k="256"), dict(stages=True)):
        with pytest.raises(ValueError, match="must be an int"):
            gm.grouped_mma_plan(6, 2304, 5120, **bad)


# ------------------------------------------------------------------------------------------- word-decode CUDA cores
WORDS_CASES = [
    # (N, k, E, out, K, dtype, x per token, act_quant, overrides): dsv41/kernels/grouped_words.py
    (1, 2, 8, 64, 256, torch.float32, True, True, {}),                                   # default plan, 2 row tiles
    (3, 2, 5, 40, 96, torch.bfloat16, True, True, {"block_n": 16, "block_k": 64}),       # odd out, K tail, 2 splits
    (2, 3, 5, 24, 640, torch.bfloat16, False, False, {"block_k": 128, "k_iters": 2}),    # 5 K tiles in 3 splits
    (1, 6, 9, 40, 160, torch.float32, True, False, {"x_perm": True, "num_warps": 2}),    # permuted x, no act quant
    (2, 2, 4, 48, 1024, torch.bfloat16, True, True, {"block_n": 16, "block_k": 512, "x_perm": True,
                                                      "num_warps": 4}),
    (1, 2, 3, 24, 1056, torch.float32, False, True, {"block_k": 1024}),                  # one split, K tail
]


@interpreted
@pytest.mark.parametrize("case", WORDS_CASES, ids=_case_id)
def test_word_decode_cuda_core_kernel_matches_float64_reference(case, poisoned_outputs):
    n, k, e, out, kdim, dtype, shared, act_quant, overrides = case
    _assert_all_codes_case_matches(case[:8], n * 991 + out * 3 + kdim, words=True, **overrides)


@interpreted
def test_word_decode_split_k_is_deterministic_and_marks_bad_experts(poisoned_outputs):
    gen = torch.Generator().manual_seed(41)
    w, s = make_experts(5, 16, 512, gen)
    idx = make_indices(2, 3, 5, gen)
    x = make_x(2, 3, 512, torch.bfloat16, True, gen)
    split = dict(block_n=16, block_k=64, k_iters=3)  # 8 K tiles in splits of 3 + 3 + 2
    from dsv41.kernels import grouped_words as gw
    assert gw.grouped_words_plan(6, 16, 512, **split)["SPLIT_K"] == 3
    _assert_deterministic_with_nan_rows_for_bad_experts(x, w, s, idx, (5, -6, 1 << 40), words=True, **split)


@interpreted
def test_the_default_launch_takes_the_word_decode_kernel_where_it_applies(monkeypatch, poisoned_outputs):
    # bf16 / fp32 x with a word-readable weight and no plan options: grouped_words (with act_quant only from
    # WORDS_MIN_CODES_ACT_QUANT codes per call); fp16 x, a weight at an odd byte offset, words=False or a tile-loop
    # option: the tile kernel. Every result checked against float64.
    from dsv41.kernels import grouped_words as gw
    assert gg.WORDS_DEFAULT is True
    calls = []
    real = gw.launch_grouped_words
    monkeypatch.setattr(gw, "launch_grouped_words", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(42)
    w, s = make_experts(4, 40, 128, gen)
    odd = torch.empty(w.numel() + 1, dtype=torch.uint8)[1:].view(w.shape)
    odd.copy_(w)
    idx = make_indices(2, 3, 4, gen)
    codes = 6 * 40 * 128
    for dtype, weight, aq, least, over, want_words in (
            (torch.bfloat16, w, False, None, {}, True), (torch.float32, w, False, None, {}, True),
            (torch.bfloat16, w, True, None, {}, False),          # act_quant below the size threshold
            (torch.bfloat16, w, True, codes, {}, True), (torch.float32, w, True, codes + 1, {}, False),
            (torch.float16, w, False, None, {}, False), (torch.bfloat16, odd, False, None, {}, False),
            (torch.bfloat16, w, False, None, {"words": False}, False),
            (torch.bfloat16, w, False, None, {"block_k": 64}, False)):
        if least is not None:
            monkeypatch.setattr(gg, "WORDS_MIN_CODES_ACT_QUANT", least)
        calls.clear()
        x = make_x(2, 3, 128, dtype, True, gen)
        if not over:
            assert gg.takes_words_by_default(x, weight, aq, 6) == want_words
        y = gg.triton_grouped_linear_fp4(x, weight, s, idx, aq, **over)
        assert bool(calls) == want_words, (dtype, aq, least, over)
        assert_close_to_ref(y, *ref_grouped(x, w, s, idx, aq))
        monkeypatch.setattr(gg, "WORDS_MIN_CODES_ACT_QUANT", 1 << 23)


@interpreted
def test_pair_op_quantises_x_once_and_equals_the_two_calls(monkeypatch, poisoned_outputs):
    # dsv41::grouped_linear_fp4_pair (the grouped_pair pass's op): with both GEMVs on the word-decode kernel, one
    # activation preparation; results bit-identical to the two single calls, which match the float64 reference.
    from dsv41.kernels import grouped_words as gw
    monkeypatch.setattr(gg, "WORDS_MIN_CODES_ACT_QUANT", 0)
    preps = []
    real = gw.prepare_x
    monkeypatch.setattr(gw, "prepare_x", lambda *a, **kw: preps.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(45)
    (w1, s1), (w3, s3) = make_experts(5, 24, 96, gen), make_experts(5, 24, 96, gen)
    idx = make_indices(2, 3, 5, gen, negative=True)
    x = make_x(2, 3, 96, torch.bfloat16, True, gen)
    ya, yb = gg.triton_grouped_linear_fp4_pair(x, w1, s1, w3, s3, idx, True)
    assert len(preps) == 1
    assert_close_to_ref(ya, *ref_grouped(x, w1, s1, idx, True))
    assert_close_to_ref(yb, *ref_grouped(x, w3, s3, idx, True))
    assert torch.equal(ya, gg.triton_grouped_linear_fp4(x, w1, s1, idx, True))
    assert torch.equal(yb, gg.triton_grouped_linear_fp4(x, w3, s3, idx, True))
    # Not both on the word-decode kernel with act_quant (fp16 x: tile kernel; no act_quant; another out size): the
    # two calls as they are.
    w5, s5 = make_experts(5, 40, 96, gen)
    for xx, wb, sb, aq in ((x.half(), w3, s3, True), (x, w3, s3, False), (x, w5, s5, True)):
        got = gg.triton_grouped_linear_fp4_pair(xx, w1, s1, wb, sb, idx, aq)
        want = (gg.triton_grouped_linear_fp4(xx, w1, s1, idx, aq), gg.triton_grouped_linear_fp4(xx, wb, sb, idx, aq))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="weight_b / scale_b: scale has shape"):
        gg.triton_grouped_linear_fp4_pair(x, w1, s1, w3, s3[:, :, :2], idx, True)
    # Where the single calls would take the tensor-core kernel by default (MMA_WORDS_DEFAULT on a GPU it supports),
    # the pair makes those calls too.
    from dsv41.kernels import grouped_mma
    monkeypatch.setattr(gg, "MMA_WORDS_DEFAULT", True)
    monkeypatch.setattr(grouped_mma, "mma_words_supported", lambda device: True)
    launched = []
    real_mma = grouped_mma.launch_grouped_mma
    monkeypatch.setattr(grouped_mma, "launch_grouped_mma", lambda *a, **kw: launched.append(1) or real_mma(*a, **kw))
    x256 = make_x(2, 3, 256, torch.bfloat16, True, gen)
    (w6, s6), (w7, s7) = make_experts(5, 32, 256, gen), make_experts(5, 32, 256, gen)
    got = gg.triton_grouped_linear_fp4_pair(x256, w6, s6, w7, s7, idx, True)
    assert len(launched) == 2
    want = (gg.triton_grouped_linear_fp4(x256, w6, s6, idx, True), gg.triton_grouped_linear_fp4(x256, w7, s7, idx, True))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_pair_op_reference_is_the_two_references():
    gen = torch.Generator().manual_seed(46)
    (w1, s1), (w3, s3) = make_experts(4, 8, 64, gen), make_experts(4, 8, 64, gen)
    idx = make_indices(2, 2, 4, gen)
    x = make_x(2, 2, 64, torch.float32, False, gen)
    a, b = torch.ops.dsv41.grouped_linear_fp4_pair(x, w1, s1, w3, s3, idx, True)
    assert torch.equal(a, gg.reference_grouped_linear_fp4(x, w1, s1, idx, True))
    assert torch.equal(b, gg.reference_grouped_linear_fp4(x, w3, s3, idx, True))
    with pytest.raises(IndexError, match="indices"):
        torch.ops.dsv41.grouped_linear_fp4_pair(x, w1, s1, w3, s3, idx + 4, True)


@interpreted
def test_word_decode_scale_bytes_zero_and_overflow_match_the_tile_kernel(poisoned_outputs):
    # UE8M0 byte 0 is a zero scale (the reference's ue8m0_to_float); bytes above 240 overflow the FP32 scale product
    # to inf in both kernels (never a finite wrong number). Bytes per 32-block: 0, 127, 241, 255.
    gen = torch.Generator().manual_seed(44)
    w, _ = make_experts(2, 16, 128, gen)
    w.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    idx = torch.tensor([[0, 1]])
    x = torch.randn(1, 128, generator=gen).bfloat16()
    x[0, :32] = 3e38  # a block whose scale is 0 contributes exactly nothing, however large x is
    s = torch.full((2, 16, 4), 127, dtype=torch.uint8)
    s[..., 0] = 0
    y = gg.triton_grouped_linear_fp4(x, w, s, idx, False, words=True)
    x0 = x.clone()
    x0[0, :32] = 0
    # The float64 reference reads byte 0 as 2^-127, which is nothing next to x = 0 but not next to x = 3e38.
    assert_close_to_ref(y, *ref_grouped(x0, w, s, idx, False))
    assert torch.equal(y, gg.triton_grouped_linear_fp4(x0, w, s, idx, False, words=True))
    assert torch.isfinite(gg.reference_grouped_linear_fp4(x, w, s, idx, False)).all()
    for byte in (241, 255):
        s2 = s.clone()
        s2[..., 2] = byte
        a = gg.triton_grouped_linear_fp4(x, w, s2, idx, False, words=True).float()
        b = gg.triton_grouped_linear_fp4(x, w, s2, idx, False, words=False).float()
        assert not torch.isfinite(a).all() and torch.equal(torch.isfinite(a), torch.isfinite(b)), byte


def test_word_decode_refuses_what_it_cannot_take():
    gen = torch.Generator().manual_seed(43)
    w, s = make_experts(4, 40, 128, gen)
    idx = make_indices(2, 3, 4, gen)
    x = make_x(2, 3, 128, torch.bfloat16, True, gen)
    with pytest.raises(ValueError, match=r"words=True needs bf16 or fp32 x .*float16"):
        gg.triton_grouped_linear_fp4(x.half(), w, s, idx, True, words=True)
    odd = torch.empty(w.numel() + 1, dtype=torch.uint8)[1:].view(w.shape)
    with pytest.raises(ValueError, match="weight readable as int32 words"):
        gg.triton_grouped_linear_fp4(x, odd, s, idx, True, words=True)
    with pytest.raises(ValueError, match=r"options \['stages'\] do not apply to words=True"):
        gg.triton_grouped_linear_fp4(x, w, s, idx, True, words=True, stages=3)
    with pytest.raises(ValueError, match="pick different kernels"):
        gg.triton_grouped_linear_fp4(x, w, s, idx, True, words=True, mma_words=True)
    for flag in (1, "no"):
        with pytest.raises(ValueError, match="must be True, False or None"):
            gg.triton_grouped_linear_fp4(x, w, s, idx, True, words=flag)
    with pytest.raises(ValueError, match=r"options \['programs_per_sm'\] do not apply to words=True"):
        gg.triton_grouped_linear_fp4(x, w, s, idx, True, words=True, programs_per_sm=2)
    for words in (None, False):  # x_perm without the kernel it belongs to
        with pytest.raises(ValueError, match=r"\['x_perm'\] apply to the word-decode kernel only"):
            gg.triton_grouped_linear_fp4(x, w, s, idx, True, words=words, x_perm=True)


def test_word_decode_plan():
    from dsv41.kernels import grouped_words as gw

    # h200 decode, 6 experts: w1/w3 [2304, 5120] in 32 x 256 tiles, one per one-warp program; w2 [5120, 2304].
    plan = gw.grouped_words_plan(6, 2304, 5120)
    assert plan["grid"] == (72, 20, 6) and plan["K_ITERS"] == 1 and plan["num_warps"] == 1
    assert plan["SPLIT_POW2"] == 32 and plan["X_PERM"] is False
    assert gw.grouped_words_plan(6, 5120, 2304)["grid"] == (160, 9, 6)
    plan = gw.grouped_words_plan(2, 40, 640, block_n=16, block_k=128, k_iters=2)
    assert plan["grid"] == (3, 3, 2) and plan["K_ITERS"] == 2 and plan["SPLIT_POW2"] == 4
    assert gw.grouped_words_plan(1, 64, 256, k_iters=9)["K_ITERS"] == 1  # capped at the K tiles
    for bad in (dict(block_n=48), dict(block_n=512), dict(block_k=16), dict(k_iters=0), dict(num_warps=3)):
        with pytest.raises(ValueError):
            gw.grouped_words_plan(6, 2304, 5120, **bad)
    for bad in (dict(k_iters=2.0), dict(block_n="32"), dict(num_warps=True)):
        with pytest.raises(ValueError, match="must be an int"):
            gw.grouped_words_plan(6, 2304, 5120, **bad)
    with pytest.raises(ValueError, match="x_perm=1 must be a bool"):
        gw.grouped_words_plan(6, 2304, 5120, x_perm=1)
    with pytest.raises(ValueError, match="at most 65535"):
        gw.grouped_words_plan(1, 32, 32 * 65536, block_k=32)


# ------------------------------------------------------------------------------------------- launch plan
def test_decode_plan_gives_every_sm_work():
    # h200 preset decode, batch 1: k = 6 experts; w1/w3 [2304, 5120], w2 [5120, 2304]. The default plan (tile at
    # once): many short programs, at least eight per SM of the H200.
    for out, kdim in ((2304, 5120), (5120, 2304)):
        plan = gg.grouped_gemv_plan(6, out, kdim)
        n_tiles, split, pairs = plan["grid"]
        assert pairs == 6 and n_tiles == -(-out // plan["BLOCK_N"]) and split == plan["SPLIT_K"]
        assert plan["STAGES"] == 1 and not plan["MMA"] and n_tiles * split * pairs >= 8 * 132
    # The pipelined tensor-core plan (mma=True).
    for out, kdim in ((2304, 5120), (5120, 2304)):
        plan = gg.grouped_gemv_plan(6, out, kdim, mma=True)
        n_tiles, split, pairs = plan["grid"]
        assert pairs == 6 and n_tiles == -(-out // plan["BLOCK_N"]) and split == plan["SPLIT_K"]
        # Every pair's tiles count towards the grid: between 2 and 4 programs per SM of the H200 (132 SMs), each
        # streaming a K range through the software pipeline.
        assert 2 * 132 <= n_tiles * split * pairs <= 4 * 132
        assert plan["STAGES"] > 1 and plan["K_ITERS"] * split >= -(-kdim // plan["BLOCK_K"])
    with pytest.raises(ValueError, match="block_k"):
        gg.grouped_gemv_plan(2, 64, 64, block_k=48)


# ------------------------------------------------------------------------------------------- op registration
def _small(shared: bool, dtype=torch.float32):
    gen = torch.Generator().manual_seed(9)
    w, s = make_experts(5, 40, 64, gen)
    return make_x(3, 2, 64, dtype, shared, gen), w, s, make_indices(3, 2, 5, gen)


@pytest.mark.parametrize("shared", [True, False], ids=["x_per_token", "x_per_expert"])
def test_op_passes_torch_library_opcheck(shared):
    x, w, s, idx = _small(shared)
    op = torch.ops.dsv41.grouped_linear_fp4.default
    torch.library.opcheck(op, (x, w, s, idx, True))
    torch.library.opcheck(op, (x.bfloat16(), w, s, idx, False))


def test_fake_function_gives_shape_and_dtype_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        w = torch.empty(8, 40, 32, dtype=torch.uint8)
        s = torch.empty(8, 40, 2, dtype=torch.uint8)
        idx = torch.empty(5, 3, dtype=torch.int64)
        y1 = torch.ops.dsv41.grouped_linear_fp4(torch.empty(5, 64, dtype=torch.bfloat16), w, s, idx, True)
        y2 = torch.ops.dsv41.grouped_linear_fp4(torch.empty(5, 3, 64, dtype=torch.float16), w, s, idx, False)
    assert y1.shape == (5, 3, 40) and y1.dtype == torch.bfloat16
    assert y2.shape == (5, 3, 40) and y2.dtype == torch.float16


def test_bad_inputs_raise_errors_naming_the_argument():
    x, w, s, idx = _small(True)
    ref = gg.reference_grouped_linear_fp4
    with pytest.raises(TypeError, match="x has dtype"):
        ref(x.long(), w, s, idx, True)
    with pytest.raises(TypeError, match="weight"):
        ref(x, w.float(), s, idx, True)
    with pytest.raises(TypeError, match="indices has dtype"):
        ref(x, w, s, idx.int(), True)
    with pytest.raises(ValueError, match="indices must have 2 dims"):
        ref(x, w, s, idx.flatten(), True)
    with pytest.raises(ValueError, match="weight must have 3 dims"):
        ref(x, w[0], s, idx, True)
    with pytest.raises(ValueError, match=r"x has shape \(2, 64\); indices \(3, 2\)"):
        ref(x[:2], w, s, idx, True)
    with pytest.raises(ValueError, match=r"x has shape \(3, 3, 64\)"):
        ref(torch.zeros(3, 3, 64), w, s, idx, True)
    with pytest.raises(ValueError, match="divisible by 32"):
        ref(x[:, :48], w[..., :24], s, idx, True)
    with pytest.raises(ValueError, match="packed FP4 weight"):
        ref(x, w[..., :16], s, idx, True)
    with pytest.raises(ValueError, match="scale has shape"):
        ref(x, w, s[:, :, :1], idx, True)
    with pytest.raises(ValueError, match="scale has shape"):
        gg.triton_grouped_linear_fp4(x, w, s[:4], idx, True)


@pytest.mark.skipif(IN_INTERPRETER, reason="checks the error raised when Triton is NOT interpreting")
def test_cpu_launch_without_interpreter_says_how_to_enable_it():
    x, w, s, idx = _small(True)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gg.triton_grouped_linear_fp4(x, w, s, idx, True)


def test_float64_reference_guards_its_own_roundings():
    """The test's E4M3 rounding puts the tie cases where MODEL.md §2.1 says (nearest even)."""
    got = E4M3_GRID[_round_to_grid(torch.tensor([1.0625, 1.1875, 1.9375, 0.5 * 2 ** -9, 432.0],
                                                dtype=torch.float64), E4M3_GRID)]
    assert torch.equal(got, torch.tensor([1.0, 1.25, 2.0, 0.0, 448.0], dtype=torch.float64))


# ------------------------------------------------------------------------------------------- compiled (CUDA)
_GPU = torch.cuda.is_available() and not IN_INTERPRETER
_needs_gpu = pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU and TRITON_INTERPRET unset (compiled kernel)")


@_needs_gpu
@pytest.mark.parametrize("act_quant", [True, False], ids=["aq", "no_aq"])
@pytest.mark.parametrize("over", [{}, {"words": False}], ids=["default_words", "tile"])
@pytest.mark.parametrize("name,out,kdim,shared", [("w1", 2304, 5120, True), ("w2", 5120, 2304, False)])
def test_cuda_grouped_gemv_at_h200_decode_shapes(name, out, kdim, shared, over, act_quant, poisoned_outputs):
    # h200 preset, batch-1 decode: 6 of 96 experts, every E2M1 code present; the default launch (word-decode
    # kernel) and the tile kernel, PDL on as in the decode graph; the float64 reference runs on the CPU copy.
    from dsv41 import kernels

    gen = torch.Generator().manual_seed(12)
    w, s = make_experts(96, out, kdim, gen)
    w.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    idx = make_indices(1, 6, 96, gen)
    idx[0, 0] = 0
    x = make_x(1, 6, kdim, torch.bfloat16, shared, gen)
    dev = torch.device("cuda")
    kernels.set_pdl(True)
    try:
        y = gg.triton_grouped_linear_fp4(x.to(dev), w.to(dev), s.to(dev), idx.to(dev), act_quant, **over)
    finally:
        kernels.set_pdl(False)
    assert y.shape == (1, 6, out) and y.dtype == torch.bfloat16
    assert_close_to_ref(y.cpu(), *ref_grouped(x, w, s, idx, act_quant))


@_needs_gpu
@pytest.mark.parametrize("name,out,kdim,shared", [("w1", 2304, 5120, True), ("w2", 5120, 2304, False)])
def test_cuda_word_decode_mma_at_h200_decode_shapes(name, out, kdim, shared, poisoned_outputs):
    # The tensor-core path of dsv41/kernels/grouped_mma.py, compiled (packed-word decode, fp16 MMA), with every
    # E2M1 code present; PDL on, as in the decode graph.
    from dsv41 import kernels

    gen = torch.Generator().manual_seed(14)
    w, s = make_experts(96, out, kdim, gen)
    w.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    idx = make_indices(1, 6, 96, gen)
    idx[0, 0] = 0
    x = make_x(1, 6, kdim, torch.bfloat16, shared, gen)
    dev = torch.device("cuda")
    kernels.set_pdl(True)
    try:
        y = gg.triton_grouped_linear_fp4(x.to(dev), w.to(dev), s.to(dev), idx.to(dev), True, mma_words=True)
    finally:
        kernels.set_pdl(False)
    assert_close_to_ref(y.cpu(), *ref_grouped(x, w, s, idx, True))


@_needs_gpu
@pytest.mark.parametrize("least", [None, 0], ids=["default", "words_with_act_quant"])
def test_cuda_pdl_and_graph_replay_match_and_bad_index_gives_nan(least, monkeypatch):
    # At this size the op's default is the tile kernel; WORDS_MIN_CODES_ACT_QUANT = 0 makes it the word-decode
    # kernel with its activation quantisation launch (two PDL launches in the graph).
    from dsv41 import kernels

    if least is not None:
        monkeypatch.setattr(gg, "WORDS_MIN_CODES_ACT_QUANT", least)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(13)
    w, s = (t.to(dev) for t in make_experts(16, 256, 512, gen))
    idx = make_indices(2, 3, 16, gen).to(dev)
    x = make_x(2, 3, 512, torch.bfloat16, True, gen).to(dev)
    assert gg.takes_words_by_default(x, w, True, 6) == (least == 0)

    def step():
        return torch.ops.dsv41.grouped_linear_fp4(x, w, s, idx, True)

    kernels.set_pdl(False)
    want = step()
    try:
        kernels.set_pdl(True)
        assert torch.equal(step(), want)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compile and size the split-K counters outside capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = step()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    finally:
        kernels.set_pdl(False)
    bad = idx.clone()
    bad[0, 1] = 16
    y = torch.ops.dsv41.grouped_linear_fp4(x, w, s, bad, True)
    assert torch.isnan(y[0, 1]).all() and not torch.isnan(y[1]).any()
    y64, abs64 = ref_grouped(x.cpu(), w.cpu(), s.cpu(), idx.cpu(), True)
    assert_close_to_ref(want.cpu(), y64, abs64)
