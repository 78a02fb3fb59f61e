"""Tests of dsv41::linear_fp8_block / dsv41::linear_fp4 (dsv41/kernels/quant_gemv.py).

Reference: an independent float64 model of MODEL.md §2.1 written here (E4M3 and E2M1 grids enumerated from
their bit layouts, nearest-even by grid index, UE8M0 ceil from frexp), never the code under test.

Interpreter tests (`@interpreted`): Triton chooses interpreter or compiler when `triton` is first imported
and when `@triton.jit` decorates, so TRITON_INTERPRET=1 must be in the environment before `import triton`.
Setting it from a test module would be too late if another module imported triton first, and would turn
every later `@triton.jit` in the process into interpreted code. So, unless this process was started with
TRITON_INTERPRET=1, the interpreter tests run once in a child `pytest` with the variable set, and each test
here reports its child's outcome. Tolerances: bit-exact for the fake-quantised activations; for sums,
|y - ref| <= 2^-16 * sum|terms| (FP32 accumulation in another order) + half an output ulp (2^-8 |ref| for
bf16, 2^-10 for fp16).
"""

from __future__ import annotations

import math

import pytest
import torch

from interp_harness import IN_INTERPRETER, InterpreterHarness, poison_outputs  # noqa: F401

from dsv41.kernels import quant_gemv as qg  # noqa: E402

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Make every output/workspace the launcher allocates start as NaN (floats) or 0xAB (bytes)."""
    poison_outputs(monkeypatch, qg)


# ------------------------------------------------------------------------------------------- float64 reference
def e4m3_grid() -> torch.Tensor:
    """The 127 non-negative finite E4M3 (fn) values, float64, indexed by their 7-bit code (increasing)."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E4M3_GRID = e4m3_grid()


def round_to_grid(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the grid value nearest to float64 `a` >= 0 (a <= grid max); ties go to the even index,
    which for E4M3 and E2M1 is the even mantissa (round-to-nearest-even)."""
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - grid[lo], grid[hi] - a
    take_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    return torch.where(take_hi, hi, lo)


def ceil_log2_fp32(ratio32: torch.Tensor) -> torch.Tensor:
    """ceil(log2(r)) of positive FP32 values, exactly (frexp: r = m 2^e, m in [0.5, 1))."""
    m, e = torch.frexp(ratio32.double())
    return torch.where(m == 0.5, e - 1, e).long()


def ref_fake_quant_fp8(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 1x32 fake quantisation with a UE8M0 ceil scale; float64 of the values rounded to x.dtype."""
    shp = x.shape
    xb = x.double().reshape(*shp[:-1], shp[-1] // 32, 32)
    amax32 = xb.abs().amax(-1).float().clamp(min=float(torch.tensor(1e-4, dtype=torch.float32)))
    scale = torch.pow(2.0, ceil_log2_fp32(amax32 / 448.0).double())
    q = (xb / scale[..., None]).clamp(-448.0, 448.0)
    val = E4M3_GRID[round_to_grid(q.abs(), E4M3_GRID)] * torch.sign(q) * scale[..., None]
    return val.reshape(shp).to(x.dtype).double()


def e4m3_byte_values() -> torch.Tensor:
    """float64 value of every E4M3 byte 0..255 (NaN bytes 0x7F, 0xFF -> nan)."""
    pos = torch.cat([E4M3_GRID, torch.full((1,), float("nan"), dtype=torch.float64, device=E4M3_GRID.device)])
    return torch.cat([pos, -pos])


def ref_dequant_fp8_block(w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 [N, K] of E4M3 bytes times 2^(e-127) per 32x32 tile, rounded to `dtype` like the model."""
    n, k = w.shape
    vals = e4m3_byte_values()[w.long()]
    sc = torch.pow(2.0, s.double() - 127).repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
    sc = sc.to(dtype).double()
    return (vals * sc).to(dtype).double()


def ref_dequant_fp4(w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 [N, K] of packed E2M1 (low nibble = even k) times 2^(e-127) per 1x32, rounded to `dtype`."""
    lo, hi = (w & 15).long(), (w >> 4).long()
    codes = torch.stack((lo, hi), -1).reshape(w.shape[0], -1)
    vals = E2M1_GRID[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    sc = torch.pow(2.0, s.double() - 127).to(dtype).double().repeat_interleave(32, 1)
    return (vals * sc).to(dtype).double()


def ref_linear(x, w, s, act_quant: bool, fp4: bool):
    """(y64, abs_sum64): float64 result [..., N] and sum of |terms| for the tolerance."""
    xq = ref_fake_quant_fp8(x) if act_quant else x.double()
    wd = (ref_dequant_fp4 if fp4 else ref_dequant_fp8_block)(w, s, x.dtype)
    return xq @ wd.T, xq.abs() @ wd.abs().T


def assert_close_to_ref(y, y64, abs64):
    """|y - y64| <= 2^-16 sum|terms| + half-ulp of the output dtype (see the module docstring)."""
    rel = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}[y.dtype]
    assert not torch.isnan(y).any(), "output has NaN (an element was never written)"
    err = (y.double() - y64).abs()
    tol = 2.0 ** -16 * abs64 + rel * y64.abs() + 1e-30
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"max err/tol = {worst:.3g} (max err {err.max().item():.3g})"


def make_weights(n, k, fp4: bool, gen: torch.Generator):
    """Random quantised weight bytes and scales (all codes valid; scales 2^-10..2^-4)."""
    if fp4:
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        s = torch.randint(117, 124, (n, k // 32), dtype=torch.uint8, generator=gen)
    else:
        w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
        w[(w & 0x7F) == 0x7F] = 0x38
        s = torch.randint(117, 124, (-(-n // 32), k // 32), dtype=torch.uint8, generator=gen)
    return w, s


# ------------------------------------------------------------------------------------------- reference (CPU op)
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_op_matches_float64_model(fp4, dtype):
    gen = torch.Generator().manual_seed(1)
    w, s = make_weights(72, 96, fp4, gen)
    x = (torch.randn(2, 3, 96, generator=gen) * 3).to(dtype)
    op = torch.ops.dsv41.linear_fp4 if fp4 else torch.ops.dsv41.linear_fp8_block
    y = op(x, w, s, True)
    y64, abs64 = ref_linear(x, w, s, True, fp4)
    assert y.shape == (2, 3, 72) and y.dtype == dtype
    assert_close_to_ref(y, y64, abs64)


# ------------------------------------------------------------------------------------------- Triton (interpreted)
GEMV_CASES = [
    # (leading shape, N, K, dtype, act_quant, overrides)
    ((1,), 40, 64, torch.float32, True, {}),
    ((1,), 96, 160, torch.bfloat16, True, {"block_k": 256}),  # one K tile
    ((3,), 96, 160, torch.float32, True, {"block_k": 32}),  # five K tiles
    ((3,), 40, 160, torch.bfloat16, False, {}),
    ((8,), 40, 160, torch.bfloat16, True, {"block_k": 128}),  # half-empty last K tile
    ((5,), 40, 64, torch.float32, True, {}),  # M not a power of two: masked rows
    ((2, 3), 40, 64, torch.float16, True, {}),  # odd leading shape, fp16 roundings
    ((12,), 40, 64, torch.bfloat16, True, {}),  # two m-tiles
    # tensor-core tiles (bf16 x only), pipelined over K
    ((1,), 96, 384, torch.bfloat16, True, {"mma": True, "stages": 3, "k_iters": 3}),
    ((3,), 40, 160, torch.bfloat16, False, {"mma": True, "block_k": 32, "k_iters": 2}),  # split K, masked rows
    ((8,), 72, 160, torch.bfloat16, True, {"mma": True, "block_n": 32}),  # half-empty last K tile
    ((12,), 40, 64, torch.bfloat16, True, {"mma": True}),  # two m-tiles, the second of 4 rows
    ((1,), 40, 64, torch.bfloat16, True, {"maxnreg": 96}),  # a register cap (ignored by the interpreter)
]


@interpreted
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[2]}-"
                         f"{str(c[3])[6:]}-aq{int(c[4])}-{'-'.join(f'{k}{v}' for k, v in c[5].items())}")
def test_triton_gemv_matches_float64_reference(case, fp4, poisoned_outputs):
    lead, n, k, dtype, act_quant, overrides = case
    gen = torch.Generator().manual_seed(n * 131 + k)
    w, s = make_weights(n, k, fp4, gen)
    x = (torch.randn(*lead, k, generator=gen) * 2).to(dtype)
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    y = fn(x, w, s, act_quant, **overrides)
    assert y.shape == (*lead, n) and y.dtype == dtype
    y64, abs64 = ref_linear(x, w, s, act_quant, fp4)
    assert_close_to_ref(y, y64, abs64)


def crafted_activation(dtype: torch.dtype) -> torch.Tensor:
    """x [1, 128] whose four 32-blocks hit the FP8 fake-quant edge cases.

    Block 0: amax exactly 448 (scale 1, ratio a power of two: no +1) with E4M3 ties 1.0625 -> 1.0,
    1.1875 -> 1.25, 1.9375 -> 2.0 (mantissa carry), subnormal ties 0.5, 4.5 and 7.5 (x 2^-9) -> 0, 4, 8.
    Block 1: amax just above 56 (ratio just above 2^-3: scale 2^-2). Block 2: amax below the 1e-4 floor.
    Block 3: large random values with both signs.
    """
    gen = torch.Generator().manual_seed(7)
    b0 = torch.tensor([448.0, 1.0625, 1.1875, 1.9375, -1.0625, 0.5 * 2 ** -9, 4.5 * 2 ** -9, 7.5 * 2 ** -9,
                       -7.5 * 2 ** -9, 432.0, 447.0, 3.0, -0.0, 0.0, 17.0, 0.3],
                      dtype=torch.float64)
    b0 = torch.cat([b0, torch.linspace(-5, 5, 16, dtype=torch.float64)])
    b1 = torch.randn(32, generator=gen, dtype=torch.float64) * 10
    b1[5] = 56.0 * (1 + 2.0 ** -20)
    b2 = torch.randn(32, generator=gen, dtype=torch.float64) * 1e-6
    b3 = torch.randn(32, generator=gen, dtype=torch.float64) * 3e4
    return torch.cat([b0, b1, b2, b3])[None].to(dtype)


def identity_weight(k: int, fp4: bool):
    """(weight, scale) of the k x k identity: E2M1 code 2 (1.0, packed two per byte) with 1x32 scales, or E4M3
    0x38 (1.0) with 32x32 scales, every scale 2^0; y = fq(x) @ I^T is then fq(x) exactly."""
    if fp4:
        codes = torch.zeros(k, k, dtype=torch.uint8)
        codes[torch.arange(k), torch.arange(k)] = 2
        return codes[:, 0::2] | (codes[:, 1::2] << 4), torch.full((k, k // 32), 127, dtype=torch.uint8)
    w = torch.zeros(k, k, dtype=torch.uint8)
    w[torch.arange(k), torch.arange(k)] = 0x38
    return w, torch.full((k // 32, k // 32), 127, dtype=torch.uint8)


@interpreted
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_in_kernel_activation_quant_is_bit_exact(fp4, dtype, poisoned_outputs):
    """With an identity weight y = fq(x) exactly, so the kernel's fake quant is checked bit for bit."""
    x = crafted_activation(dtype)
    w, s = identity_weight(128, fp4)
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    want = ref_fake_quant_fp8(x)
    for mma in (False, True) if dtype == torch.bfloat16 else (False,):
        y = fn(x, w, s, True, block_k=128, mma=mma)
        assert torch.equal(y.double(), want), (mma, (y.double() - want).abs().max())
    # and the model's own fake quant agrees with the float64 model on the same edge cases
    from dsv41.model.formats import fake_quant_fp8_1x32
    assert torch.equal(fake_quant_fp8_1x32(x).double(), want)


@interpreted
def test_split_k_result_is_deterministic_and_matches_unsplit(poisoned_outputs):
    gen = torch.Generator().manual_seed(3)
    w, s = make_weights(40, 256, False, gen)
    x = torch.randn(2, 256, generator=gen)
    a = qg.triton_linear_fp8_block(x, w, s, True, block_k=32)  # 8 K tiles
    b = qg.triton_linear_fp8_block(x, w, s, True, block_k=32)
    c = qg.triton_linear_fp8_block(x, w, s, True, block_k=256)  # 1 K tile
    assert torch.equal(a, b)
    y64, abs64 = ref_linear(x, w, s, True, False)
    assert_close_to_ref(a, y64, abs64)
    assert_close_to_ref(c, y64, abs64)


@interpreted
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
@pytest.mark.parametrize("k_iters", [2, 3, 5])
def test_k_loop_per_program_matches_reference(k_iters, fp4, poisoned_outputs):
    # K = 160 = 5 tiles of 32: 2 -> splits of 2, 2, 1 (the last loops past K), 3 -> 3 + 2, 5 -> no split.
    gen = torch.Generator().manual_seed(7 + k_iters)
    w, s = make_weights(72, 160, fp4, gen)
    x = torch.randn(3, 160, generator=gen)
    plan = qg.gemv_plan(3, 72, 160, fp4, block_k=32, k_iters=k_iters)
    assert plan["SPLIT_K"] == -(-5 // k_iters) and plan["SPLIT_POW2"] >= plan["SPLIT_K"]
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    y = fn(x, w, s, True, block_k=32, k_iters=k_iters)
    y64, abs64 = ref_linear(x, w, s, True, fp4)
    assert_close_to_ref(y, y64, abs64)


@interpreted
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fma_fp32", "mma_bf16"])
def test_scales_read_as_words_or_bytes_match_reference(dtype, stages, fp4, poisoned_outputs):
    # K = 384: three 128-wide tiles in one program (k_iters 3), pipelined or not, on the CUDA-core (fp32 x) and
    # tensor-core (bf16 x) paths. Pipelined, a contiguous scale is read as int32 words; the same scale one byte
    # into a larger buffer is not 4-byte aligned and is read byte by byte (as every scale is with stages 1).
    gen = torch.Generator().manual_seed(11 + stages)
    w, s = make_weights(72, 384, fp4, gen)
    x = torch.randn(3, 384, generator=gen).to(dtype)
    assert qg.gemv_plan(3, 72, 384, fp4, mma=dtype == torch.bfloat16)["MMA"] == (dtype == torch.bfloat16)
    shifted = torch.empty(s.numel() + 1, dtype=torch.uint8)[1:].view(s.shape)
    shifted.copy_(s)
    assert qg.scale_words(s, 384, 128) is not None and qg.scale_words(shifted, 384, 128) is None
    assert qg.scale_words(s, 384, 64) is None and qg.scale_words(s, 352, 128) is None
    fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
    y64, abs64 = ref_linear(x, w, s, True, fp4)
    for scale in (s, shifted):
        y = fn(x, w, scale, True, k_iters=3, stages=stages, mma=dtype == torch.bfloat16)
        assert_close_to_ref(y, y64, abs64)


@interpreted
def test_tensor_core_tiles_need_bf16_activations():
    gen = torch.Generator().manual_seed(23)
    for fp4 in (False, True):
        w, s = make_weights(40, 128, fp4, gen)
        fn = qg.triton_linear_fp4 if fp4 else qg.triton_linear_fp8_block
        for dtype in (torch.float32, torch.float16):
            with pytest.raises(ValueError, match="mma=True .* needs bf16 x, got torch.float"):
                fn(torch.randn(2, 128).to(dtype), w, s, True, mma=True)
        with pytest.raises(ValueError, match="needs bf16"):  # also with no rows to compute
            fn(torch.zeros(0, 128), w, s, True, mma=True)


def test_scale_words_checks_the_address_too():
    # A view at storage offset 0 whose memory starts one byte past an int32 boundary cannot be read as words.
    buf = bytearray(4 + 8 * 12)
    base = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
    raw = torch.frombuffer(buf, dtype=torch.uint8, offset=(1 - base) % 4, count=8 * 12).view(8, 12)
    assert raw.storage_offset() == 0 and raw.data_ptr() % 4 == 1
    assert qg.scale_words(raw, 384, 128) is None
    aligned = torch.zeros(8, 12, dtype=torch.uint8)
    assert qg.scale_words(aligned, 384, 128).dtype == torch.int32 and qg.scale_words(aligned, 384, 128).shape == (8, 3)


# ------------------------------------------------------------------------------------------- launch heuristic
def test_gemv_plan_sizes_the_pipelined_grid_to_the_sms():
    # bf16 x (mma=True: tensor-core tiles, pipelined, STAGES 3, 64-row tiles): the largest K split that keeps the
    # grid at or under 4 programs per SM (132 SMs -> 528), K tiles evened out over the splits. Hand-computed for
    # the h200 shapes:
    wq_b = qg.gemv_plan(1, 32768, 1280, False, mma=True)  # 512 row tiles -> no split, 10 K tiles per program
    assert (wq_b["MMA"], wq_b["STAGES"], wq_b["BLOCK_N"], wq_b["K_ITERS"], wq_b["SPLIT_K"], wq_b["grid"]) == (
        True, 3, 64, 10, 1, (512, 1, 1))
    wo_b = qg.gemv_plan(1, 5120, 8192, False, mma=True)  # 80 row tiles -> 528 // 80 = 6 splits of 11 of the 64 K tiles
    assert (wo_b["K_ITERS"], wo_b["SPLIT_K"], wo_b["SPLIT_POW2"], wo_b["grid"]) == (11, 6, 8, (80, 6, 1))
    wq_a = qg.gemv_plan(1, 1280, 5120, False, mma=True)  # 20 row tiles -> 26 splits -> 2 K tiles each -> 20 splits
    assert (wq_a["K_ITERS"], wq_a["grid"]) == (2, (20, 20, 1))
    # half the SMs: 13 splits -> 4 tiles -> 10 splits
    assert qg.gemv_plan(1, 1280, 5120, False, sm_count=66, mma=True)["K_ITERS"] == 4
    head = qg.gemv_plan(1, 129280, 5120, False, mma=True)  # 2020 row tiles: more than 528 already, no split
    assert (head["K_ITERS"], head["SPLIT_K"]) == (40, 1)
    # Grouped experts: 6 pairs x 36 row tiles = 216 -> 2 splits of 20 of the 40 K tiles (432 programs).
    grouped = qg.gemv_plan(1, 2304, 5120, True, groups=6, mma=True)
    assert (grouped["K_ITERS"], grouped["SPLIT_K"]) == (20, 2)
    assert qg.gemv_plan(8, 5120, 2304, True)["BLOCK_M"] == 8
    assert qg.gemv_plan(3, 5120, 2304, True)["BLOCK_M"] == 4
    assert qg.gemv_plan(20, 64, 64, False)["grid"][2] == 3  # x rows tiled by 8
    with pytest.raises(ValueError, match="block_k"):
        qg.gemv_plan(1, 64, 64, False, block_k=48)
    with pytest.raises(ValueError, match="k_iters"):
        qg.gemv_plan(1, 64, 64, False, k_iters=0)
    with pytest.raises(ValueError, match="stages"):
        qg.gemv_plan(1, 64, 64, False, stages=0)
    with pytest.raises(ValueError, match="sm_count"):
        qg.gemv_plan(1, 64, 64, False, sm_count=0)
    with pytest.raises(ValueError, match="maxnreg"):
        qg.gemv_plan(1, 64, 64, False, maxnreg=300)
    assert qg.gemv_plan(1, 64, 64, False)["MAXNREG"] is None
    assert qg.gemv_plan(1, 64, 64, False, maxnreg=96)["MAXNREG"] == 96


def test_gemv_plan_tile_at_once_loops_over_k_only_where_programs_stay_plentiful():
    # FMA tiles (the default, and upcast_gemv), STAGES 1, the rule measured on the H200 (module constants): 4 K
    # tiles per program if >= 4096 programs remain, 2 if >= 320, else 1. head: 1010 n-tiles x 40 K tiles -> 4
    # (10100 programs); shared_w1 (18 x 40) -> 2; wq_a (10 x 40) -> 1, since 2 would leave 200 programs for 132 SMs.
    head = qg.gemv_plan(1, 129280, 5120, False)
    assert (head["MMA"], head["STAGES"], head["K_ITERS"], head["SPLIT_K"], head["SPLIT_POW2"], head["BLOCK_N"]) == (
        False, 1, 4, 10, 16, 128)
    assert qg.gemv_plan(1, 2304, 5120, True, stages=1)["K_ITERS"] == 2
    assert qg.gemv_plan(1, 1280, 5120, False, stages=1)["K_ITERS"] == 1
    assert qg.gemv_plan(1, 64, 64, False, stages=1)["K_ITERS"] == 1  # never more tiles per program than K has


# ------------------------------------------------------------------------------------------- op registration
def _small_inputs(fp4: bool):
    gen = torch.Generator().manual_seed(5)
    w, s = make_weights(40, 64, fp4, gen)
    return torch.randn(3, 64, generator=gen, dtype=torch.float32), w, s


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
def test_ops_pass_torch_library_opcheck(fp4):
    x, w, s = _small_inputs(fp4)
    op = torch.ops.dsv41.linear_fp4.default if fp4 else torch.ops.dsv41.linear_fp8_block.default
    torch.library.opcheck(op, (x, w, s, True))
    torch.library.opcheck(op, (x.bfloat16(), w, s, False))


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8_block", "fp4"])
def test_fake_functions_give_shape_and_dtype_under_fake_tensor_mode(fp4):
    from torch._subclasses.fake_tensor import FakeTensorMode
    op = torch.ops.dsv41.linear_fp4 if fp4 else torch.ops.dsv41.linear_fp8_block
    with FakeTensorMode():
        x = torch.empty(2, 5, 64, dtype=torch.bfloat16)
        w = torch.empty(40, 32 if fp4 else 64, dtype=torch.uint8)
        s = torch.empty(40 if fp4 else 2, 2, dtype=torch.uint8)
        y = op(x, w, s, True)
    assert y.shape == (2, 5, 40) and y.dtype == torch.bfloat16


def test_bad_inputs_raise_errors_naming_the_argument():
    x, w, s = _small_inputs(False)
    with pytest.raises(TypeError, match="weight"):
        qg.reference_linear_fp8_block(x, w.float(), s, True)
    with pytest.raises(TypeError, match="x has dtype"):
        qg.reference_linear_fp8_block(x.long(), w, s, True)
    with pytest.raises(ValueError, match="divisible by 32"):
        qg.reference_linear_fp8_block(x[:, :48], w[:, :48], s, True)
    with pytest.raises(ValueError, match="scale has shape"):
        qg.reference_linear_fp8_block(x, w, s[:1], True)
    x4, w4, s4 = _small_inputs(True)
    with pytest.raises(ValueError, match="packed FP4 weight"):
        qg.reference_linear_fp4(x4, w4[:, :16], s4, True)
    with pytest.raises(ValueError, match="scale has shape"):
        qg.triton_linear_fp4(x4, w4, s4.T.contiguous(), True)


@pytest.mark.skipif(IN_INTERPRETER, reason="checks the error raised when Triton is NOT interpreting")
def test_cpu_launch_without_interpreter_says_how_to_enable_it():
    x, w, s = _small_inputs(False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        qg.triton_linear_fp8_block(x, w, s, True)


def test_float64_reference_rounds_e4m3_ties_to_even():
    """Guards the test's own reference: the tie cases crafted above land where MODEL.md §2.1 says."""
    got = E4M3_GRID[round_to_grid(torch.tensor([1.0625, 1.1875, 1.9375, 0.5 * 2 ** -9, 4.5 * 2 ** -9,
                                                7.5 * 2 ** -9, 432.0], dtype=torch.float64), E4M3_GRID)]
    want = torch.tensor([1.0, 1.25, 2.0, 0.0, 4 * 2 ** -9, 2 ** -6, 448.0], dtype=torch.float64)
    assert torch.equal(got, want)
    assert math.isclose(E4M3_GRID[-1].item(), 448.0)


class _RecordingLaunch:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kwargs)` records the launch keywords."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)


def test_a_weight_copied_at_launch_is_not_read_under_pdl(monkeypatch):
    """The GEMVs read their weight tile before the PDL wait (weights never come from the previous kernel). A weight
    or scale view with a last stride != 1 is copied by the launcher, i.e. written by the kernel just before, so
    that launch must go without PDL; a contiguous one keeps it. Checked on the launch keywords (PDL forced on)."""
    from dsv41.kernels import gemv_rows as gr
    from dsv41.kernels import upcast_gemv as ug
    stubs = {}
    for mod, name in ((qg, "_quant_gemv_kernel"), (gr, "_rows_gemv_kernel"), (ug, "_upcast_gemv_kernel")):
        stubs[name] = _RecordingLaunch()
        monkeypatch.setattr(mod, name, stubs[name])
        monkeypatch.setattr(mod, "use_pdl_for", lambda kernel, device: True)
    for mod in (qg, ug):
        monkeypatch.setattr(mod, "require_launchable", lambda *args: None)

    def pdl_of(name):
        kw = stubs[name].calls[-1]
        assert kw["USE_PDL"] == ("launch_pdl" in kw)
        return kw["USE_PDL"]

    gen = torch.Generator().manual_seed(2)
    w, s = make_weights(40, 64, False, gen)
    w_view = torch.zeros(40, 128, dtype=torch.uint8)[:, ::2]
    w_view.copy_(w)
    s_view = torch.zeros(2, 4, dtype=torch.uint8)[:, ::2]
    s_view.copy_(s)
    x = torch.randn(1, 64, generator=gen)
    for rows, name in ((False, "_quant_gemv_kernel"), (True, "_rows_gemv_kernel")):
        qg.triton_linear_fp8_block(x, w, s, True, rows=rows)
        assert pdl_of(name) is True
        for ww, ss in ((w_view, s), (w, s_view)):
            qg.triton_linear_fp8_block(x, ww, ss, True, rows=rows)
            assert pdl_of(name) is False, (rows, ww.stride(), ss.stride())
    wb = torch.randn(40, 64, generator=gen).bfloat16()
    ug.triton_linear_upcast(x, wb)
    assert pdl_of("_upcast_gemv_kernel") is True
    ug.triton_linear_upcast(x, torch.zeros(40, 128, dtype=torch.bfloat16)[:, ::2])
    assert pdl_of("_upcast_gemv_kernel") is False


# ------------------------------------------------------------------------------------------- TMA GEMV (gemv_tma)
TMA_CASES = [
    # (leading shape, N, K, dtype, act_quant, overrides of tma_gemv_plan)
    ((1,), 40, 64, torch.float32, True, {}),  # one K tile narrower than the 128-byte box (zero-filled)
    ((1,), 96, 160, torch.bfloat16, True, {}),  # 2 K tiles, the second a quarter full; split K
    ((3,), 96, 416, torch.float32, True, {"block_n": 32}),  # 4 K tiles, masked x rows, 3 row bands
    ((8,), 72, 384, torch.bfloat16, False, {"stages": 2}),  # N not a multiple of the band, no act quant
    ((2, 3), 40, 256, torch.float16, True, {}),  # fp16 roundings of the reference
    ((12,), 40, 128, torch.bfloat16, True, {"programs_per_sm": 1, "sm_count": 1}),  # two m-tiles, no split
    ((1,), 200, 1280, torch.bfloat16, True, {"sm_count": 2}),  # 4 bands x 2 splits of 5 K tiles
    ((1,), 200, 1280, torch.float32, False, {"sm_count": 2, "scale_words": True}),  # scales as int32 words
    ((2,), 72, 384, torch.bfloat16, True, {"scale_words": True}),  # the same for two rows
    ((1,), 40, 256, torch.float16, True, {}),  # one fp16 row takes the several-row path (fp16 roundings)
]


@interpreted
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[2]}-"
                         f"{str(c[3])[6:]}-aq{int(c[4])}-{'-'.join(f'{k}{v}' for k, v in c[5].items())}")
def test_tma_gemv_matches_float64_reference(case, poisoned_outputs, monkeypatch):
    from dsv41.kernels import gemv_tma
    lead, n, k, dtype, act_quant, overrides = case
    plans = []
    real = gemv_tma.launch_tma
    monkeypatch.setattr(gemv_tma, "launch_tma", lambda x2, w, s, aq, plan, *a, **kw: plans.append(plan) or real(
        x2, w, s, aq, plan, *a, **kw))
    gen = torch.Generator().manual_seed(n * 17 + k)
    w, s = make_weights(n, k, False, gen)
    x = (torch.randn(*lead, k, generator=gen) * 2).to(dtype)
    y = qg.triton_linear_fp8_block(x, w, s, act_quant, tma=True, **overrides)
    assert y.shape == (*lead, n) and y.dtype == dtype
    y64, abs64 = ref_linear(x, w, s, act_quant, False)
    assert_close_to_ref(y, y64, abs64)
    assert plans == [gemv_tma.tma_gemv_plan(math.prod(lead), n, k, **overrides)]  # the plan asked for ran
    if n == 200:  # the split-K merge ran: K tiles spread over programs
        assert plans[0]["SPLIT_K"] == 2


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tma_gemv_activation_quant_is_bit_exact_and_scales_read_as_bytes_or_words(dtype, poisoned_outputs):
    """Identity weight: y = fq(x) exactly through the TMA kernel. The scale is read as int32 words when aligned and
    as bytes when the same scale sits one byte into a larger buffer (both give the same bits)."""
    x = crafted_activation(dtype)
    w, s = identity_weight(128, False)
    want = ref_fake_quant_fp8(x)
    shifted = torch.empty(s.numel() + 1, dtype=torch.uint8)[1:].view(s.shape)
    shifted.copy_(s)
    assert qg.scale_words(s, 128, 128) is not None and qg.scale_words(shifted, 128, 128) is None
    for scale in (s, shifted):
        for words in (False, True):
            y = qg.triton_linear_fp8_block(x, w, scale, True, tma=True, scale_words=words)
            assert torch.equal(y.double(), want), (words, (y.double() - want).abs().max())
            y = qg.triton_linear_fp8_block(x.expand(3, -1), w, scale, True, tma=True, scale_words=words)
            assert torch.equal(y.double(), want.expand(3, -1)), (words, (y.double() - want).abs().max())


def test_tma_gemv_plan_fills_one_wave_of_programs():
    # Defaults: 64-row bands, 3 stages, grid sized for 4 programs per SM on 132 SMs (528 slots). Hand-computed:
    from dsv41.kernels.gemv_tma import tma_gemv_plan
    wq_b = tma_gemv_plan(1, 32768, 1280)  # 512 bands already fill the wave: no split, 10 K tiles each
    assert (wq_b["BLOCK_N"], wq_b["BLOCK_K"], wq_b["STAGES"], wq_b["K_ITERS"], wq_b["SPLIT_K"], wq_b["grid"]) == (
        64, 128, 3, 10, 1, (512, 1, 1))
    wo_b = tma_gemv_plan(1, 5120, 8192)  # 80 bands: 528 // 80 = 6 splits of ceil(64 / 6) = 11 K tiles
    assert (wo_b["K_ITERS"], wo_b["SPLIT_K"], wo_b["SPLIT_POW2"], wo_b["grid"]) == (11, 6, 8, (80, 6, 1))
    wq_a = tma_gemv_plan(1, 1280, 5120)  # 20 bands: 26 splits -> 2 K tiles each -> 20 splits (400 programs)
    assert (wq_a["K_ITERS"], wq_a["grid"]) == (2, (20, 20, 1))
    head = tma_gemv_plan(1, 129280, 5120)  # 2020 bands: several waves, no split
    assert (head["K_ITERS"], head["SPLIT_K"]) == (40, 1)
    assert tma_gemv_plan(1, 1280, 5120, sm_count=66)["K_ITERS"] == 4  # 13 splits -> 4 tiles -> 10 splits
    assert tma_gemv_plan(6, 5120, 8192)["BLOCK_M"] == 8 and tma_gemv_plan(3, 64, 64)["BLOCK_M"] == 4
    assert tma_gemv_plan(20, 64, 64)["grid"][2] == 3  # x rows tiled by 8
    for bad, match in ((dict(block_n=48), "block_n"), (dict(block_n=512), "block_n"), (dict(stages=0), "stages"),
                       (dict(programs_per_sm=0), "programs_per_sm"), (dict(sm_count=0), "sm_count"),
                       (dict(num_warps=3), "num_warps"), (dict(l2_prefetch=-1), "l2_prefetch"),
                       (dict(l2_prefetch=1.5), "l2_prefetch"), (dict(l2_prefetch=True), "l2_prefetch"),
                       (dict(early_launch="no"), "early_launch")):
        with pytest.raises(ValueError, match=match):
            tma_gemv_plan(1, 64, 64, **bad)
    # PDL prologue options (opt-in): bytes per row prefetched, capped at the program's K range; early launch with it
    assert (wq_b["L2_PREFETCH"], wq_b["EARLY_LAUNCH"]) == (0, False)
    pf = tma_gemv_plan(1, 32768, 1280, l2_prefetch=2)
    assert (pf["L2_PREFETCH"], pf["EARLY_LAUNCH"]) == (256, True)
    assert tma_gemv_plan(1, 32768, 1280, l2_prefetch=99)["L2_PREFETCH"] == 10 * 128
    assert tma_gemv_plan(1, 32768, 1280, l2_prefetch=2, early_launch=False)["EARLY_LAUNCH"] is False
    assert qg.gemv_plan(1, 1280, 5120, False)["EARLY_LAUNCH"] is False
    assert qg.gemv_plan(1, 1280, 5120, False, early_launch=True)["EARLY_LAUNCH"] is True
    with pytest.raises(ValueError, match="early_launch=2 must be True, False or None"):
        qg.gemv_plan(1, 1280, 5120, False, early_launch=2)
    from dsv41.kernels import grouped_gemv as gg
    with pytest.raises(ValueError, match="not to the grouped expert GEMV"):  # its tile kernel has no such option
        gg.grouped_gemv_plan(6, 2304, 5120, early_launch=True)
    assert "EARLY_LAUNCH" in gg.grouped_gemv_plan(6, 2304, 5120, early_launch=False)


def test_pdl_prologue_options_order_the_ptx_on_sm90():
    """l2_prefetch: one bulk L2 prefetch per row, then the early launch, then the PDL wait (TMA kernel, wq_b);
    early_launch on the tile kernel: the launch comes before the first wait. Without them: the wait comes first and
    nothing is prefetched."""
    from interp_harness import sm90_ttir
    from dsv41.kernels import gemv_tma as gt
    ptrs = dict(x_ptr="bf16", w_ptr="u8", s_ptr="u8", y_ptr="bf16", part_ptr="fp32", cnt_ptr="i32")
    for l2 in (0, 2):
        plan = gt.tma_gemv_plan(1, 32768, 1280, l2_prefetch=l2)
        consts = dict(ACT_QUANT=True, SPLIT_K=plan["SPLIT_K"], SPLIT_POW2=plan["SPLIT_POW2"], K_ITERS=plan["K_ITERS"],
                      STAGES=plan["STAGES"], SCALE_WORDS=False, BLOCK_M=1, BLOCK_N=64, BLOCK_K=128,
                      L2_PREFETCH=plan["L2_PREFETCH"], EARLY_LAUNCH=plan["EARLY_LAUNCH"], USE_PDL=True)
        ptx = sm90_ttir(gt._tma_gemv_kernel, ptrs, consts, {"w_desc": "tensordesc<u8[64, 128]>"}, stage="ptx")
        wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        prefetch = ptx.find("cp.async.bulk.prefetch.L2.global")
        assert wait >= 0 and launch >= 0
        if l2:
            assert 0 <= prefetch < launch < wait, (prefetch, launch, wait)
        else:
            assert prefetch < 0 and wait < launch
    for early in (False, True):
        plan = qg.gemv_plan(1, 1280, 5120, False, early_launch=early)
        consts = dict(FP4=False, ACT_QUANT=True, SPLIT_K=plan["SPLIT_K"], SPLIT_POW2=plan["SPLIT_POW2"],
                      K_ITERS=plan["K_ITERS"], STAGES=1, SCALE_WORDS=False, MMA=False, DOT_F32=False, BLOCK_M=1,
                      BLOCK_N=plan["BLOCK_N"], BLOCK_K=plan["BLOCK_K"], EARLY_LAUNCH=early, USE_PDL=True)
        ptx = sm90_ttir(qg._quant_gemv_kernel, ptrs, consts, num_warps=plan["num_warps"], stage="ptx")
        wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        assert (launch < wait) == early and wait >= 0 and launch >= 0, (early, launch, wait)


def test_tma_option_rules():
    """Which kernel a block-FP8 launch picks: tma=True forces the TMA kernel and rejects FP4 and other kernels'
    options by name; the default takes it only on a TMA GPU with no other option set, for several rows or a weight of
    16 MiB and more that TMA can read; tma=False never."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def weight(n, k, **kw):  # a weight's shape, strides and address (meta: address 0), without its bytes
        return torch.empty(n, k, dtype=torch.uint8, device="meta", **kw)

    big, small = weight(32768, 1280), weight(1280, 5120)  # wq_b (40 MiB), wq_a (6.25 MiB)
    assert qg.split_tma_overrides({}, False, cpu, 1, big) is None  # no TMA unit here
    over = {"tma": True, "block_n": 32, "sm_count": 4}
    assert qg.split_tma_overrides(over, False, cpu, 1, small) == {"block_n": 32, "sm_count": 4}
    assert over == {}
    with pytest.raises(ValueError, match="FP4"):
        qg.split_tma_overrides({"tma": True}, True, cpu, 1, big)
    with pytest.raises(ValueError, match=r"\['k_iters', 'mma'\]"):
        qg.split_tma_overrides({"tma": True, "mma": True, "k_iters": 2}, False, cpu, 1, big)
    assert qg.split_tma_overrides({"tma": False, "block_n": 64}, False, cpu, 1, big) is None
    import dsv41.kernels.gemv_tma as gt
    real = gt.tma_supported
    try:
        gt.tma_supported = lambda device: device.type == "cuda"
        assert qg.split_tma_overrides({"sm_count": 132}, False, cuda, 1, big) == {"sm_count": 132}
        # any other option set, even one no kernel knows, leaves the choice to the other kernels (which reject it)
        for other in ({"block_k": 64}, {"stages": 3}, {"rows": True}, {"programs_per_sm": 8}, {"mma": True},
                      {"blockn": 32}):
            assert qg.split_tma_overrides(dict(other), False, cuda, 1, big) is None, other
        assert qg.split_tma_overrides({"rows": False, "kc": None}, False, cuda, 1, big) is not None  # unset ones don't
        assert qg.split_tma_overrides({}, True, cuda, 1, big) is None  # FP4 stays on the tile kernel
        # one x row takes it from 16 MiB of weight (wq_b does, wq_a does not), more rows always
        assert qg.split_tma_overrides({}, False, cuda, 1, small) is None
        assert qg.split_tma_overrides({}, False, cuda, 6, small) is not None
        # a weight TMA cannot read as launched: row stride 1300, not a multiple of 16 bytes; a last stride != 1 is
        # copied to a contiguous weight first, which TMA reads
        assert qg.split_tma_overrides({}, False, cuda, 6, weight(64, 1300)[:, :1280]) is None
        assert qg.split_tma_overrides({}, False, cuda, 6, weight(1280, 64).T) is not None
    finally:
        gt.tma_supported = real
    assert not gt.tma_supported(torch.device("meta"))
    with pytest.raises(ValueError, match="scale_words applies to the TMA kernel only"):
        qg.split_tma_overrides({"scale_words": True}, False, cpu, 1, big)
    with pytest.raises(ValueError, match="l2_prefetch applies to the TMA kernel only"):
        qg.split_tma_overrides({"tma": False, "l2_prefetch": 2}, False, cpu, 1, big)
    assert qg.split_tma_overrides({"tma": True, "l2_prefetch": 2, "early_launch": False}, False, cpu, 1, big) == {
        "l2_prefetch": 2, "early_launch": False}
    with pytest.raises(ValueError, match=r"tile-loop options \['early_launch'\]"):
        qg.split_rows_overrides({"rows": True, "early_launch": True}, 1, False)
    with pytest.raises(ValueError, match="also to the TMA kernel"):
        qg.split_rows_overrides({"programs_per_sm": 2}, 1, False)


@interpreted
def test_default_launch_takes_tma_where_supported_and_falls_back_for_an_unaligned_weight(monkeypatch,
                                                                                         poisoned_outputs):
    # With the GPU check forced on (the interpreter runs the TMA kernel on CPU), a plain launch runs the TMA kernel;
    # a weight whose address is not 16-byte aligned runs the tile kernel, and tma=True on it is an error.
    import dsv41.kernels.gemv_tma as gt
    monkeypatch.setattr(gt, "tma_supported", lambda device: True)
    calls = []
    real_launch = gt.launch_tma
    monkeypatch.setattr(gt, "launch_tma", lambda *a, **kw: calls.append(1) or real_launch(*a, **kw))
    monkeypatch.setattr(qg, "TMA_MIN_WEIGHT_BYTES_M1", 0)  # the small test weight counts as a large one
    gen = torch.Generator().manual_seed(31)
    w, s = make_weights(40, 128, False, gen)
    x = torch.randn(1, 128, generator=gen)
    y64, abs64 = ref_linear(x, w, s, True, False)
    assert_close_to_ref(qg.triton_linear_fp8_block(x, w, s, True), y64, abs64)
    assert calls == [1]
    buf = torch.empty(w.numel() + 8, dtype=torch.uint8)
    shifted = buf[8:].view(w.shape)
    shifted.copy_(w)
    assert shifted.data_ptr() % 16 == 8 and not gt.tma_eligible(shifted)
    assert_close_to_ref(qg.triton_linear_fp8_block(x, shifted, s, True), y64, abs64)
    assert_close_to_ref(qg.triton_linear_fp8_block(x, shifted, s, True, rows=False, sm_count=4), y64, abs64)
    assert calls == [1]  # the tile kernel ran
    with pytest.raises(ValueError, match="cannot be read by TMA"):
        qg.triton_linear_fp8_block(x, shifted, s, True, tma=True)
