"""Numeric formats of MODEL.md §2.1 against plain-Python references written here."""

import math
import struct

import pytest
import torch

from dsv41.ref import formats as F

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _ref_e2m1_code(x: float) -> int:
    """Nearest E2M1 value, ties to the even code (pure Python)."""
    a = min(abs(x), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1[c] - a), c % 2))
    return best | (8 if x < 0 else 0)


def test_every_e2m1_code_decodes_to_the_table():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = F.e2m1_to_float(codes).tolist()
    assert vals[:8] == E2M1 and vals[8:] == [-v for v in E2M1]


@pytest.mark.parametrize("x,code", [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
                                    (-0.75, 10), (7.0, 7), (-100.0, 15)])
def test_e2m1_round_nearest_even_ties(x, code):
    assert F.e2m1_round(torch.tensor([x])).item() == code


def test_e2m1_round_matches_python_reference_on_a_grid():
    xs = torch.linspace(-7, 7, 2801)
    got = F.e2m1_round(xs).tolist()
    assert got == [_ref_e2m1_code(x) for x in xs.tolist()]


def test_nibble_order_low_nibble_is_even_element():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = F.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(F.unpack_e2m1(packed), codes)
    # Same convention as torch's float4_e2m1fn_x2 byte layout.
    assert packed.view(torch.float4_e2m1fn_x2).view(torch.uint8).tolist() == [[0x21, 0xF3]]


def _ref_ue8m0(ratio: float) -> int:
    bits = struct.unpack("<I", struct.pack("<f", ratio))[0]
    exp, man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    return exp + (1 if man else 0)


@pytest.mark.parametrize("ratio", [1.0, 2.0, 0.5, 2.0 ** -20, 2.0 ** 30, 3.0, 1.0000001, 0.75])
def test_ue8m0_ceil_is_exact_at_powers_of_two(ratio):
    e = F.ue8m0_exponent(torch.tensor([ratio], dtype=torch.float32)).item()
    assert e == _ref_ue8m0(ratio)
    assert 2.0 ** (e - 127) >= ratio and (2.0 ** (e - 128) < ratio)
    assert F.ue8m0_to_float(torch.tensor([e], dtype=torch.uint8)).item() == 2.0 ** (e - 127)


def test_block_fp8_round_trip_error_bound():
    torch.manual_seed(0)
    w = torch.randn(70, 100, dtype=torch.float64) * torch.logspace(-3, 2, 100, dtype=torch.float64)
    q, s = F.quantize_fp8_block(w)
    assert q.shape == (70, 100) and s.shape == (3, 4)
    d = F.dequantize_fp8_block(q, s, torch.float64)
    for i in range(0, 70, 32):
        for j in range(0, 100, 32):
            tile, dt = w[i:i + 32, j:j + 32], d[i:i + 32, j:j + 32]
            scale = 2.0 ** (s[i // 32, j // 32].item() - 127)
            assert scale >= tile.abs().max().item() / 448 and scale < 2 * tile.abs().max().item() / 448 + 1e-30
            # E4M3 has 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= scale * 2^-10 below them.
            err = (dt - tile).abs()
            bound = torch.maximum(tile.abs() * 2.0 ** -4, torch.full_like(tile, scale * 2.0 ** -10))
            assert (err <= bound + 1e-12).all()


def test_bank_scale_rule_is_e4m3_of_amax_over_6():
    x = torch.zeros(1, 32)
    x[0, :16] = torch.linspace(-1.0, 2.9, 16)       # amax 2.9 -> 2.9/6 = 0.4833 -> E4M3 0.46875 (rounds down)
    x[0, 16:] = 1e-6                                # tiny block: scale clamps at 2^-9
    packed, sb = F.quantize_fp4_e4m3_1x16(x)
    s = F.e4m3_from_bytes(sb)[0].tolist()
    assert s[0] == 0.46875 and s[1] == 2.0 ** -9
    vals = F.dequantize_fp4_e4m3_1x16(packed, sb, torch.float64)[0, :16]
    # 2.9 / 0.46875 = 6.19 > 6: clamped to the top code.
    assert vals[-1].item() == 6 * 0.46875
    ref = [E2M1[_ref_e2m1_code(v / 0.46875) & 7] * math.copysign(1, v) * 0.46875 for v in x[0, :16].tolist()]
    assert vals.tolist() == pytest.approx(ref)


def test_fp8_activation_fake_quant_uses_ue8m0_per_32():
    torch.manual_seed(1)
    x = torch.randn(3, 64, dtype=torch.float64)
    y = F.fake_quant_fp8_1x32(x)
    for r in range(3):
        for b in range(2):
            blk = x[r, 32 * b:32 * (b + 1)]
            scale = 2.0 ** math.ceil(math.log2(blk.abs().max().item() / 448))
            ref = (blk / scale).to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64) * scale
            assert torch.equal(y[r, 32 * b:32 * (b + 1)], ref)


@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, torch.int16), (torch.float16, torch.int16),
                                        (torch.float32, torch.int32)])
def test_byte_table_dequantisation_has_the_bits_of_the_arithmetic_form(dtype, bits):
    """The dense prefill MoE decodes FP4 through a byte table: every byte under every UE8M0 exponent must give the
    bits of `dequantize_fp4_1x32` (-0.0 and the zero scale included), and the values of the plain-Python table."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 16)             # [256, 4096]: each row every byte
    scale = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 256)    # row r: exponent r everywhere
    got = F.dequantize_fp4_1x32_table(packed, scale.contiguous(), dtype)
    want = F.dequantize_fp4_1x32(packed, scale.contiguous(), dtype)
    assert got.dtype == dtype and got.shape == (256, 8192)
    assert torch.equal(got.view(bits), want.view(bits))
    lo = [E2M1[b & 7] * (-1 if b & 8 else 1) for b in range(16)]
    row = [v for b in range(256) for v in (lo[b & 15], lo[b >> 4])]
    assert got[127, :512].tolist() == row                                     # exponent 127: scale 1
    assert math.copysign(1.0, got[127, 16].item()) == -1.0                    # byte 8, low nibble: -0.0


def test_byte_table_is_never_cached_from_a_fake_tensor_or_a_trace():
    """A table built from a FakeTensor, or while Dynamo traces, must not be served to later real calls (a fake table
    breaks them; a cached one under Dynamo adds a dict guard and a recompile); uint8 codes only."""
    from torch._dynamo.testing import CompileCounter
    from torch._subclasses.fake_tensor import FakeTensorMode

    F._FP4_BYTE_TABLES.clear()
    packed = torch.randint(0, 256, (4, 16), dtype=torch.uint8)
    scale = torch.randint(120, 135, (4, 1), dtype=torch.uint8)
    want = F.dequantize_fp4_1x32(packed, scale, torch.float32)
    with FakeTensorMode() as mode:
        F.dequantize_fp4_1x32_table(mode.from_tensor(packed), mode.from_tensor(scale), torch.float32)
    assert not F._FP4_BYTE_TABLES
    counter = CompileCounter()
    fn = torch.compile(lambda p, s: F.dequantize_fp4_1x32_table(p, s, torch.float32), backend=counter,
                       fullgraph=True)
    for _ in range(3):
        assert torch.equal(fn(packed, scale), want)
    assert counter.frame_count == 1 and not F._FP4_BYTE_TABLES
    assert torch.equal(F.dequantize_fp4_1x32_table(packed, scale, torch.float32), want)
    assert len(F._FP4_BYTE_TABLES) == 1
    with pytest.raises(TypeError, match="uint8"):
        F.dequantize_fp4_1x32_table(packed.view(torch.int8), scale, torch.float32)
