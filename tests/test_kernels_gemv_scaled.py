"""Tests of dsv41::linear_fp8_scaled (dsv41/kernels/gemv_scaled.py): block-FP8 GEMV over FP8 checkpoint layouts.

Reference: a float64 model written here, never the code under test: E4M3 bytes decoded from their bit layout (1
sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 subnormal; 0x7F / 0xFF NaN), the scale's value
(float32 as stored, UE8M0 byte e as 2^(e-127)), and the eager roundings written out: the scale rounded to
`scale_cast`, the product rounded to float32 and then to `weight_dtype`, then y = x @ W^T in float64.

Interpreter tests (`@interpreted`) run in a child pytest with TRITON_INTERPRET=1 (tests/interp_harness.py), every
output and workspace poisoned with NaN first. Tolerance (`assert_close_to_ref`): |y - ref| <= 2^-16 sum|x w| (FP32
accumulation in another order, and for FP32 weights the kernel's per-block scale multiply instead of eager's
per-element one, both within a few FP32 roundings of each term) + half an output ulp (2^-8 |ref| for bf16 output,
2^-10 for fp16, 0 for fp32).
"""

from __future__ import annotations

import pytest
import torch

from interp_harness import IN_INTERPRETER, InterpreterHarness, poison_outputs  # noqa: F401

from dsv41.kernels import gemv_scaled as gs  # noqa: E402

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output / workspace the launcher allocates starts as NaN (floats) or 0xAB (bytes)."""
    poison_outputs(monkeypatch, gs)


# ------------------------------------------------------------------------------------------- float64 reference
def e4m3_value(codes: torch.Tensor) -> torch.Tensor:
    """float64 value of uint8 E4M3 (fn) bytes, from the bit layout."""
    b = codes.long()
    e, m = (b >> 3) & 15, (b & 7).double()
    mag = torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(2.0, (e - 7).double()))
    v = torch.where(b >= 128, -mag, mag)
    return torch.where((b & 127) == 127, torch.full_like(v, float("nan")), v)


def ref_weight(codes, scale, bn, bk, weight_dtype, scale_cast) -> torch.Tensor:
    """float64 [N, K]: code x scale with eager's roundings (scale -> scale_cast, product -> fp32 -> weight_dtype)."""
    n, k = codes.shape
    s = torch.pow(2.0, scale.double() - 127) if scale.dtype == torch.uint8 else scale.double()
    s = s.to(scale_cast).double()
    s = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (e4m3_value(codes) * s).float().to(weight_dtype).double()


def ref_linear(x, codes, scale, bn, bk, weight_dtype, scale_cast):
    """(y64, abs64): x @ W^T in float64 and sum |x w| per output (for the tolerance)."""
    w = ref_weight(codes, scale, bn, bk, weight_dtype, scale_cast)
    x64 = x.double().reshape(-1, x.shape[-1])
    return (x64 @ w.T).reshape(*x.shape[:-1], -1), (x64.abs() @ w.abs().T).reshape(*x.shape[:-1], -1)


def assert_close_to_ref(y, y64, abs64):
    """|y - y64| <= 2^-16 sum|terms| + half an ulp of y's dtype (module docstring); NaN exactly where y64 is."""
    assert torch.equal(torch.isnan(y), torch.isnan(y64)), "NaN where the reference has none (or the reverse)"
    ok = ~torch.isnan(y64)
    rel = {F32: 0.0, BF16: 2.0 ** -8, F16: 2.0 ** -10}[y.dtype]
    err = (y.double() - y64).abs()[ok]
    tol = 2.0 ** -16 * abs64[ok] + rel * y64.abs()[ok] + 1e-30
    worst = (err / tol).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"max err/tol = {worst:.3g} (max err {err.max().item():.3g})"


def make_layout(n, k, bn, bk, ue8m0: bool, gen, nan_codes: bool = False):
    """(codes uint8 [n, k], scale [ceil(n/bn), ceil(k/bk)]): random E4M3 bytes (NaN encodings replaced unless
    `nan_codes`), float32 scales 2^-9 .. 2^-5 with full mantissas or UE8M0 bytes 118..122."""
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    if not nan_codes:
        codes[(codes & 0x7F) == 0x7F] = 0x38
    grid = (-(-n // bn), -(-k // bk))
    if ue8m0:
        scale = torch.randint(118, 123, grid, dtype=torch.uint8, generator=gen)
    else:
        scale = (1 + torch.rand(grid, generator=gen)) * torch.exp2(torch.randint(-9, -5, grid, generator=gen).float())
    return codes, scale


# ------------------------------------------------------------------------------------------- reference (CPU op)
@pytest.mark.parametrize("dtype,weight_dtype,scale_cast", [(F32, F32, F32), (BF16, BF16, F32), (BF16, BF16, BF16),
                                                           (F16, F16, F16), (F32, BF16, F32)],
                         ids=["f32", "bf16", "bf16_scale_bf16", "f16", "f32_weight_bf16"])
def test_reference_op_matches_float64_model(dtype, weight_dtype, scale_cast):
    gen = torch.Generator().manual_seed(1)
    codes, scale = make_layout(200, 300, 128, 128, False, gen)
    x = (torch.randn(2, 3, 300, generator=gen) * 2).to(dtype)
    y = torch.ops.dsv41.linear_fp8_scaled(x, codes, scale, 128, 128, weight_dtype, scale_cast)
    assert y.shape == (2, 3, 200) and y.dtype == dtype
    assert_close_to_ref(y, *ref_linear(x, codes, scale, 128, 128, weight_dtype, scale_cast))


def test_op_rejects_bad_arguments_by_name():
    gen = torch.Generator().manual_seed(2)
    codes, scale = make_layout(64, 256, 128, 128, False, gen)
    x = torch.randn(1, 256)
    op = torch.ops.dsv41.linear_fp8_scaled
    with pytest.raises(ValueError, match=r"scale has shape \(2, 1\); a 128x128 block grid of codes \(64, 256\)"):
        op(x, codes, scale.t().contiguous(), 128, 128, F32, F32)
    with pytest.raises(TypeError, match="codes has dtype float8_e4m3fn"):
        op(x, codes.view(torch.float8_e4m3fn), scale, 128, 128, F32, F32)
    with pytest.raises(TypeError, match="scale has dtype bfloat16"):
        op(x, codes, scale.bfloat16(), 128, 128, F32, F32)
    with pytest.raises(ValueError, match="x.shape"):
        op(torch.randn(1, 128), codes, scale, 128, 128, F32, F32)
    with pytest.raises(ValueError, match="weight_dtype=torch.float32 with x of dtype torch.bfloat16"):
        op(x.bfloat16(), codes, scale, 128, 128, F32, F32)
    with pytest.raises(ValueError, match="block_n=0"):
        gs.reference_linear_fp8_scaled(x, codes, scale, 0, 128, F32, F32)


def test_kernel_roundings_drop_only_exact_ones():
    # FP32 scales: every requested rounding is made. UE8M0: a power of two times an E4M3 code is exact in fp32 and
    # bf16, so only fp16's narrower range rounds.
    assert gs.kernel_rounding(F32, BF16, F32) == (0, 1) and gs.kernel_rounding(F32, F16, F16) == (2, 2)
    assert gs.kernel_rounding(torch.uint8, BF16, BF16) == (0, 0)
    assert gs.kernel_rounding(torch.uint8, F16, F16) == (2, 2)


def test_plan_splits_k_where_the_row_tiles_leave_sms_idle():
    # DeepSeek-V3 decode shapes (M = 1, 128-row tiles, 128-column K tiles): `quant_gemv.gemv_plan`'s rule.
    small = gs.scaled_plan(1, 2048, 7168, 128)  # 16 row tiles x 56 K tiles: 2 tiles per program -> 28 splits
    assert (small["grid"], small["K_ITERS"], small["SBK"]) == ((16, 28, 1), 2, 128)
    big = gs.scaled_plan(1, 24576, 7168, 128)  # 192 x 14 = 2688 programs at 4 tiles each (< 4096): 2 tiles each
    assert (big["grid"], big["K_ITERS"]) == ((192, 28, 1), 2)
    head = gs.scaled_plan(1, 129280, 7168, 128)  # 1010 x 14 = 14140 programs (>= 4096) at 4 tiles each
    assert (head["grid"], head["K_ITERS"]) == ((1010, 14, 1), 4)
    assert gs.scaled_plan(4, 7168, 2048, 32)["BLOCK_N"] == 64 and gs.scaled_plan(4, 7168, 2048, 32)["SBK"] == 32
    assert gs.scaled_plan(1, 64, 512, 256)["SBK"] == 128  # one scale spans two K tiles
    with pytest.raises(ValueError, match="power of two"):
        gs.scaled_plan(1, 64, 512, 96)


# ------------------------------------------------------------------------------------------- Triton (interpreted)
CASES = [
    # (M, N, K, (bn, bk), UE8M0 scales, x dtype, weight_dtype, scale_cast, overrides)
    (1, 200, 300, (128, 128), False, BF16, BF16, F32, {}),           # DeepSeek-V3: bf16 weight, ceil grid [2, 3]
    (3, 200, 300, (128, 128), False, F32, F32, F32, {}),             # FP32 weight: the scale per block sum
    (8, 200, 300, (128, 128), False, BF16, BF16, BF16, {}),          # scale rounded to bf16 first (kron spelling)
    (1, 70, 100, (32, 32), False, F32, F32, F32, {}),                # 32x32 FP32 scales, grid [3, 4]
    (3, 70, 100, (32, 32), False, F16, F16, F16, {}),                # fp16 weight and scale
    (8, 40, 300, (1, 128), False, F32, BF16, F32, {}),               # 1x128: one scale per row; bf16 weight, fp32 x
    (1, 40, 300, (1, 128), False, BF16, BF16, F32, {"tile_k": 32, "k_iters": 3}),  # a scale spans 4 tiles
    (3, 130, 300, (128, 128), True, F32, F32, F32, {}),              # UE8M0 per 128x128
    (8, 130, 300, (128, 128), True, F16, F16, F16, {}),              # UE8M0, fp16 rounding kept
    (3, 72, 96, (32, 32), True, BF16, BF16, BF16, {"tile_k": 64}),  # dsv41's own layout, split in 2
]


@interpreted
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}-{c[1]}x{c[2]}-{c[3][0]}x{c[3][1]}-"
                         f"{'ue8m0' if c[4] else 'f32'}-x{str(c[5])[6:]}-w{str(c[6])[6:]}-s{str(c[7])[6:]}"
                         + "".join(f"-{k}{v}" for k, v in c[8].items()))
def test_triton_gemv_matches_float64_reference(case, poisoned_outputs):
    m, n, k, (bn, bk), ue8m0, dtype, weight_dtype, scale_cast, overrides = case
    gen = torch.Generator().manual_seed(n * 7 + k + m)
    codes, scale = make_layout(n, k, bn, bk, ue8m0, gen)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    y = gs.triton_linear_fp8_scaled(x, codes, scale, bn, bk, weight_dtype, scale_cast, **overrides)
    assert y.shape == (m, n) and y.dtype == dtype
    assert_close_to_ref(y, *ref_linear(x, codes, scale, bn, bk, weight_dtype, scale_cast))


@interpreted
def test_nan_codes_give_nan_rows_and_a_strided_scale_is_read_in_place(poisoned_outputs):
    # E4M3 0x7F / 0xFF are NaN: the rows holding them are NaN, the others are not. The scale is passed transposed
    # back (a [3, 2] buffer read as [2, 3] through its strides), as a checkpoint stored the other way round would be.
    gen = torch.Generator().manual_seed(5)
    codes, scale = make_layout(200, 300, 128, 128, False, gen)
    codes[7, 11], codes[150, 299] = 0x7F, 0xFF
    strided = scale.t().contiguous().t()
    assert not strided.is_contiguous()
    x = torch.randn(3, 300, generator=gen).to(BF16)
    for weight_dtype in (BF16,):
        y = gs.triton_linear_fp8_scaled(x, codes, strided, 128, 128, weight_dtype, F32)
        assert torch.isnan(y[:, 7]).all() and torch.isnan(y[:, 150]).all()
        assert_close_to_ref(y, *ref_linear(x, codes, scale, 128, 128, weight_dtype, F32))
    y32 = gs.triton_linear_fp8_scaled(x.float(), codes, scale, 128, 128, F32, F32)
    assert int(torch.isnan(y32).any(0).sum()) == 2


@interpreted
def test_split_k_is_deterministic_and_equals_one_program_per_row_tile(poisoned_outputs):
    gen = torch.Generator().manual_seed(9)
    codes, scale = make_layout(70, 640, 1, 128, False, gen)
    x = torch.randn(3, 640, generator=gen)
    split = gs.triton_linear_fp8_scaled(x, codes, scale, 1, 128, F32, F32, k_iters=1)  # 5 K splits
    again = gs.triton_linear_fp8_scaled(x, codes, scale, 1, 128, F32, F32, k_iters=1)
    whole = gs.triton_linear_fp8_scaled(x, codes, scale, 1, 128, F32, F32, k_iters=5)
    assert gs.scaled_plan(3, 70, 640, 128, k_iters=1)["SPLIT_K"] == 5
    assert torch.equal(split, again)
    y64, abs64 = ref_linear(x, codes, scale, 1, 128, F32, F32)
    assert_close_to_ref(split, y64, abs64)
    assert_close_to_ref(whole, y64, abs64)


@interpreted
def test_empty_shapes_and_leading_dims():
    gen = torch.Generator().manual_seed(4)
    codes, scale = make_layout(40, 256, 128, 128, False, gen)
    assert gs.triton_linear_fp8_scaled(torch.zeros(0, 256), codes, scale, 128, 128, F32, F32).shape == (0, 40)
    x = torch.randn(2, 3, 256, generator=gen)
    y = gs.triton_linear_fp8_scaled(x, codes, scale, 128, 128, F32, F32)
    assert y.shape == (2, 3, 40)
    assert_close_to_ref(y, *ref_linear(x, codes, scale, 128, 128, F32, F32))


def test_launcher_needs_the_interpreter_for_cpu_tensors():
    if IN_INTERPRETER:
        pytest.skip("checks the compiled-mode error")
    codes, scale = make_layout(40, 256, 128, 128, False, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gs.triton_linear_fp8_scaled(torch.randn(1, 256), codes, scale, 128, 128, F32, F32)


def test_pdl_wait_follows_the_first_weight_loads_in_the_sm90_build():
    # Built offline for sm_90 (no GPU): under USE_PDL the first code and scale loads come before griddepcontrol.wait,
    # the x load after it, and launch_dependents after the K loop.
    from interp_harness import sm90_ttir
    ptx = sm90_ttir(gs._scaled_gemv_kernel, {"x_ptr": "bf16", "w_ptr": "u8", "s_ptr": "fp32", "y_ptr": "bf16",
                                             "part_ptr": "fp32", "cnt_ptr": "i32"},
                    dict(BN_S=128, BK_S=128, SBK=128, SCALE_UE8M0=False, ROUND_S=0, ROUND_W=1, FIX_NAN=False,
                         SPLIT_K=2, SPLIT_POW2=2, K_ITERS=1, BLOCK_M=1, BLOCK_N=128, BLOCK_K=128, USE_PDL=True),
                    stage="ptx")
    wait = ptx.index("griddepcontrol.wait")
    loads = [i for i, line in enumerate(ptx.splitlines()) if "ld.global" in line]
    lines = ptx.splitlines()
    wait_line = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    assert loads and loads[0] < wait_line, "no weight load before the PDL wait"
    assert any(i > wait_line for i in loads), "x is loaded after the PDL wait"
    assert ptx.index("griddepcontrol.launch_dependents") > wait


def test_launch_census_counts_one_kernel_and_a_copy_for_strided_codes():
    # The compiler's static launch count (kernels/census.py) runs the CUDA host code on meta tensors: one GEMV launch;
    # codes whose rows are not contiguous are copied first (one more kernel); above 8 rows the dequantise-then-cuBLAS
    # reference runs ATen kernels instead.
    if IN_INTERPRETER:
        pytest.skip("the census replaces the compiled-mode launch proxy")
    from dsv41.kernels.census import op_launches
    codes = torch.empty(7168, 2048, dtype=torch.uint8)
    scale = torch.empty(56, 16, dtype=torch.float32)
    x = torch.empty(1, 2048, dtype=BF16)
    args = [x, codes, scale, 128, 128, BF16, F32]
    assert op_launches("dsv41::linear_fp8_scaled", args) == 1
    strided = torch.empty(2048, 7168, dtype=torch.uint8).t()
    assert op_launches("dsv41::linear_fp8_scaled", [x, strided, scale, 128, 128, BF16, F32]) == 2
    assert op_launches("dsv41::linear_fp8_scaled", [torch.empty(16, 2048, dtype=BF16)] + args[1:]) > 2


def test_formats_reference_dequantisation_matches_the_float64_model():
    # formats.dequantize_fp8_scaled is what the dispatch pass probes regions against and what the CPU op computes:
    # every byte (NaN codes too), both scale kinds, every rounding, bit for bit; and its argument errors.
    from dsv41.model.formats import dequantize_fp8_scaled
    gen = torch.Generator().manual_seed(6)
    for (bn, bk), ue8m0 in (((128, 128), False), ((1, 128), False), ((32, 32), True)):
        codes, scale = make_layout(130, 260, bn, bk, ue8m0, gen, nan_codes=True)
        codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
        for wd, sc in ((F32, F32), (BF16, F32), (BF16, BF16), (F16, F16), (F16, F32)):
            got = dequantize_fp8_scaled(codes, scale, bn, bk, wd, sc)
            want = ref_weight(codes, scale, bn, bk, wd, sc)
            assert got.dtype == wd and torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.double().nan_to_num(0.0), want.nan_to_num(0.0)), (bn, bk, wd, sc)
        assert torch.equal(dequantize_fp8_scaled(codes.view(torch.float8_e4m3fn), scale, bn, bk, F32).nan_to_num(0.0),
                           dequantize_fp8_scaled(codes, scale, bn, bk, F32).nan_to_num(0.0))
    with pytest.raises(ValueError, match="a 128x128 grid of"):
        dequantize_fp8_scaled(codes, torch.ones(3, 3), 128, 128, F32)
    with pytest.raises(TypeError, match="scale must be float32 or uint8"):
        dequantize_fp8_scaled(codes, torch.ones(5, 9, dtype=torch.float64), 32, 32, F32)
