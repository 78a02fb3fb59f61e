"""Tests of dsv41::rope_fp4_quant / rope_fp4_fake_quant / rope_fp4_quant_store (dsv41/kernels/rope_fp4.py).

Reference: written here from MODEL.md §2.1/§2.2 — RoPE as eager FP32 ops on interleaved pairs of the last
R channels, cast to x.dtype; E2M1 and E4M3 by nearest-even on enumerated float64 grids; UE8M0 ceil from
frexp. Codes and scales must be bit-identical (no tolerance), fake-quantised values equal.

Interpreter tests (`@interpreted`) run in a child pytest with TRITON_INTERPRET=1 unless this process was
started with it; see tests/test_kernels_quant_gemv.py for why.
"""

from __future__ import annotations


import pytest
import torch

from interp_harness import IN_INTERPRETER, InterpreterHarness, poison_outputs  # noqa: F401

from dsv41.kernels import rope_fp4 as rp  # noqa: E402

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Make every output the launcher allocates start as NaN (floats) or 0xAB (bytes)."""
    poison_outputs(monkeypatch, rp)


# ------------------------------------------------------------------------------------------- reference
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E4M3_GRID = torch.tensor([m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
                          for e in range(16) for m in range(8)][:127], dtype=torch.float64)


def round_to_grid(a: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid value to float64 `a` >= 0; ties to the even index (= even mantissa)."""
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - grid[lo], grid[hi] - a
    take_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    return torch.where(take_hi, hi, lo)


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of the last 2*cos.shape[-1] channels in FP32 (each op rounded), cast to x.dtype."""
    r = 2 * cos.shape[-1]
    out = x.clone()
    a = x[..., -r::2].float()
    b = x[..., -r + 1::2].float()
    ra = torch.sub(torch.mul(a, cos), torch.mul(b, sin))
    rb = torch.add(torch.mul(a, sin), torch.mul(b, cos))
    out[..., -r::2] = ra.to(x.dtype)
    out[..., -r + 1::2] = rb.to(x.dtype)
    return out


def ref_fp4_quant(v: torch.Tensor, block: int, e4m3: bool):
    """(codes uint8 [..., D/2], scale bytes uint8 [..., D/block], dequantised float64 [..., D]) of v."""
    shp = v.shape
    vb = v.float().reshape(*shp[:-1], shp[-1] // block, block)
    amax = vb.abs().amax(-1)
    if e4m3:
        ratio = (amax / 6.0).clamp(2.0 ** -9, 448.0)
        sbyte = round_to_grid(ratio.double(), E4M3_GRID)
        scale32 = E4M3_GRID[sbyte].float()
    else:
        ratio = amax.clamp(min=6.0 * 2.0 ** -126) / 6.0
        m, e = torch.frexp(ratio.double())
        sbyte = torch.where(m == 0.5, e - 1, e) + 127
        scale32 = torch.pow(2.0, sbyte.double() - 127).float()
    q = (vb / scale32[..., None]).double().clamp(-6.0, 6.0)  # FP32 division, as the spec
    mag = round_to_grid(q.abs(), E2M1_GRID)
    codes = (mag | torch.where(q < 0, 8, 0)).reshape(shp)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    deq = (E2M1_GRID[mag] * torch.where(q < 0, -1.0, 1.0).double() * scale32.double()[..., None]).reshape(shp)
    return packed, sbyte.to(torch.uint8), deq


def make_inputs(lead, d, r_half, dtype, gen, cos_lead=None, scale=3.0):
    x = (torch.randn(*lead, d, generator=gen) * scale).to(dtype)
    cos_lead = lead if cos_lead is None else cos_lead
    ang = torch.rand(*cos_lead, r_half, generator=gen) * 50
    return x, ang.cos(), ang.sin()


# ------------------------------------------------------------------------------------------- reference op
@pytest.mark.parametrize("mode", rp.FP4_MODES, ids=["e4m3x16", "ue8m0x32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_ops_match_the_spec_model(mode, dtype):
    gen = torch.Generator().manual_seed(11)
    x, c, s = make_inputs((3, 5), 64, 8, dtype, gen)
    block, e4m3 = mode
    p, sc = torch.ops.dsv41.rope_fp4_quant(x, c, s, block, e4m3)
    wp, ws, wdeq = ref_fp4_quant(ref_rope(x, c, s), block, e4m3)
    assert torch.equal(p, wp) and torch.equal(sc, ws)
    y = torch.ops.dsv41.rope_fp4_fake_quant(x, c, s, block, e4m3)
    assert y.dtype == dtype and torch.equal(y.double(), wdeq.to(dtype).double())


# ------------------------------------------------------------------------------------------- Triton (interpreted)
ROPE_CASES = [
    # (leading shape of x, leading shape of cos (None = same), D, R/2)
    ((1,), None, 64, 8),
    ((3, 5), None, 64, 8),
    ((2, 3, 4), (2, 3, 1), 128, 32),  # index queries: cos broadcast over heads
    ((2, 1, 3, 2), None, 96, 16),  # four leading dims, D/block not a power of two for block 32
    ((1, 1), None, 512, 32),  # the bank vector
]


@interpreted
@pytest.mark.parametrize("mode", rp.FP4_MODES, ids=["e4m3x16", "ue8m0x32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-D{c[2]}-R{2 * c[3]}")
def test_triton_rope_fp4_quant_codes_and_scales_are_bit_exact(case, dtype, mode, poisoned_outputs):
    lead, cos_lead, d, r_half = case
    block, e4m3 = mode
    gen = torch.Generator().manual_seed(d + r_half)
    x, c, s = make_inputs(lead, d, r_half, dtype, gen, cos_lead)
    wp, ws, wdeq = ref_fp4_quant(ref_rope(x, c, s), block, e4m3)
    p, sc = rp.triton_rope_fp4_quant(x, c, s, block, e4m3)
    assert p.shape == (*lead, d // 2) and sc.shape == (*lead, d // block)
    assert torch.equal(p, wp), (p != wp).sum()
    assert torch.equal(sc, ws), (sc != ws).sum()
    y = rp.triton_rope_fp4_fake_quant(x, c, s, block, e4m3)
    assert y.dtype == dtype and torch.equal(y.double(), wdeq.to(dtype).double())


def tie_vector(e4m3: bool) -> torch.Tensor:
    """x [1, 64] (no rotation applied by the test's cos=1, sin=0) hitting every E2M1 tie after scaling.

    Both modes: block 0 has amax 6 (scale exactly 1) and values 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 (and
    negatives), which must round to codes 0, 2, 2, 4, 4, 6, 6 (nearest even). E4M3 mode also: a block with
    amax 6.375 whose scale 1.0625 rounds down (tie) to 1.0, so 6.375 / 1 is clamped to 6; a block whose
    amax / 6 is below 2^-9 (scale clamped up to 2^-9).
    """
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    b0 = torch.tensor(ties + [-t for t in ties], dtype=torch.float64)
    if e4m3:
        b1 = torch.tensor([6.375, 0.25, 0.75, 5.0, -6.375, 1.0, 2.5, 3.0] * 2, dtype=torch.float64)
        b2 = torch.full((16,), 2.0 ** -13, dtype=torch.float64)
        b3 = torch.linspace(-3, 3, 16, dtype=torch.float64)
        v = torch.cat([b0, b1, b2, b3])
    else:
        b1 = torch.cat([torch.tensor([12.0, 0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0], dtype=torch.float64),
                        torch.linspace(-9, 9, 24, dtype=torch.float64)])
        v = torch.cat([b0, b0, b1])
    return v[None]


@interpreted
@pytest.mark.parametrize("mode", rp.FP4_MODES, ids=["e4m3x16", "ue8m0x32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_e2m1_ties_round_to_even_and_e4m3_scale_rounds_down(mode, dtype, poisoned_outputs):
    block, e4m3 = mode
    x = tie_vector(e4m3).to(dtype)
    c, s = torch.ones(1, 4), torch.zeros(1, 4)
    p, sc = rp.triton_rope_fp4_quant(x, c, s, block, e4m3)
    wp, ws, _ = ref_fp4_quant(x, block, e4m3)
    assert torch.equal(p, wp) and torch.equal(sc, ws)
    assert (p[0, 0] & 15).item() == 0 and (p[0, 0] >> 4).item() == 2  # 0.25 -> 0, 0.75 -> 1.0
    assert (p[0, 1] & 15).item() == 2 and (p[0, 1] >> 4).item() == 4  # 1.25 -> 1.0, 1.75 -> 2.0
    assert (p[0, 2] & 15).item() == 4 and (p[0, 2] >> 4).item() == 6  # 2.5 -> 2.0, 3.5 -> 4.0
    assert (p[0, 3] & 15).item() == 6 and (p[0, 3] >> 4).item() == 7  # 5 -> 4.0, 6 -> 6.0
    if e4m3:
        assert sc[0, 1].item() == 0x38  # 6.375 / 6 = 1.0625 -> E4M3 1.0 (tie to even)
        assert sc[0, 2].item() == 0x01  # clamped to 2^-9
        assert (p[0, 8] & 15).item() == 7  # 6.375 / 1.0 clamped to 6


@interpreted
@pytest.mark.parametrize("mode", rp.FP4_MODES, ids=["e4m3x16", "ue8m0x32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quant_store_writes_only_the_addressed_cache_rows(mode, dtype):
    block, e4m3 = mode
    gen = torch.Generator().manual_seed(21)
    b, t, d, n_rows = 2, 3, 64, 7
    x, c, s = make_inputs((b, t), d, 8, dtype, gen)
    rows = torch.tensor([[4, 0, 6], [2, -1, 7]], dtype=torch.int64)  # -1 and 7 are out of range: skipped
    cc = torch.full((b, n_rows, d // 2), 0xAB, dtype=torch.uint8)
    scc = torch.full((b, n_rows, d // block), 0xCD, dtype=torch.uint8)
    rp.triton_rope_fp4_quant_store(x, c, s, block, e4m3, cc, scc, rows)
    wp, ws, _ = ref_fp4_quant(ref_rope(x, c, s), block, e4m3)
    want_c = torch.full_like(cc, 0xAB)
    want_s = torch.full_like(scc, 0xCD)
    for bi in range(b):
        for ti in range(t):
            r = rows[bi, ti].item()
            if 0 <= r < n_rows:
                want_c[bi, r], want_s[bi, r] = wp[bi, ti], ws[bi, ti]
    assert torch.equal(cc, want_c) and torch.equal(scc, want_s)
    cc2, scc2 = torch.full_like(cc, 0xAB), torch.full_like(scc, 0xCD)
    torch.ops.dsv41.rope_fp4_quant_store(x, c, s, block, e4m3, cc2, scc2, rows)  # the CPU reference op
    assert torch.equal(cc2, want_c) and torch.equal(scc2, want_s)


@interpreted
def test_non_contiguous_x_and_strided_cache_are_handled(poisoned_outputs):
    gen = torch.Generator().manual_seed(4)
    big = torch.randn(2, 3, 160, generator=gen).bfloat16()
    x = big[..., 16:144]  # D = 128, row stride 160
    ang = torch.rand(2, 3, 32, generator=gen)
    c, s = ang.cos(), ang.sin()
    wp, ws, _ = ref_fp4_quant(ref_rope(x, c, s), 32, False)
    p, sc = rp.triton_rope_fp4_quant(x, c, s, 32, False)
    assert torch.equal(p, wp) and torch.equal(sc, ws)
    cache = torch.zeros(2, 5, 80, dtype=torch.uint8)[..., :64]  # a view with row stride 80
    scache = torch.zeros(2, 5, 4, dtype=torch.uint8)
    rows = torch.tensor([[0, 1, 2], [4, 3, 2]])
    rp.triton_rope_fp4_quant_store(x, c, s, 32, False, cache, scache, rows)
    assert torch.equal(cache[0, :3], wp[0]) and torch.equal(cache[1, [4, 3, 2]], wp[1])


# ------------------------------------------------------------------------------------------- op registration
def _args(block=16, e4m3=True):
    gen = torch.Generator().manual_seed(2)
    x, c, s = make_inputs((2, 3), 64, 8, torch.float32, gen)
    return x, c, s, block, e4m3


@pytest.mark.parametrize("mode", rp.FP4_MODES, ids=["e4m3x16", "ue8m0x32"])
def test_ops_pass_torch_library_opcheck(mode):
    x, c, s, _, _ = _args()
    block, e4m3 = mode
    torch.library.opcheck(torch.ops.dsv41.rope_fp4_quant.default, (x, c, s, block, e4m3))
    torch.library.opcheck(torch.ops.dsv41.rope_fp4_fake_quant.default, (x.bfloat16(), c, s, block, e4m3))
    cc = torch.zeros(2, 4, 32, dtype=torch.uint8)
    scc = torch.zeros(2, 4, 64 // block, dtype=torch.uint8)
    rows = torch.tensor([[0, 1, 2], [3, 2, 1]])
    torch.library.opcheck(torch.ops.dsv41.rope_fp4_quant_store.default, (x, c, s, block, e4m3, cc, scc, rows))


def test_fake_functions_give_shapes_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(2, 3, 4, 128, dtype=torch.bfloat16)
        c = torch.empty(2, 3, 1, 32)
        p, sc = torch.ops.dsv41.rope_fp4_quant(x, c, c, 32, False)
        y = torch.ops.dsv41.rope_fp4_fake_quant(x, c, c, 16, True)
        assert p.shape == (2, 3, 4, 64) and p.dtype == torch.uint8 and sc.shape == (2, 3, 4, 4)
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        xs = torch.empty(2, 3, 512, dtype=torch.bfloat16)
        cc = torch.empty(2, 9, 256, dtype=torch.uint8)
        scc = torch.empty(2, 9, 32, dtype=torch.uint8)
        assert torch.ops.dsv41.rope_fp4_quant_store(xs, c[:, :, 0], c[:, :, 0], 16, True, cc, scc,
                                                    torch.empty(2, 3, dtype=torch.int64)) is None


def test_bad_inputs_raise_errors_naming_the_argument():
    x, c, s, _, _ = _args()
    with pytest.raises(ValueError, match="not a supported FP4 mode"):
        rp.reference_rope_fp4_quant(x, c, s, 16, False)
    with pytest.raises(TypeError, match="cos has dtype"):
        rp.reference_rope_fp4_quant(x, c.double(), s, 16, True)
    with pytest.raises(ValueError, match="exceeds"):
        rp.reference_rope_fp4_quant(x[..., :32], torch.ones(2, 3, 20), torch.zeros(2, 3, 20), 16, True)
    with pytest.raises(ValueError, match="divisible by scale_block"):
        rp.reference_rope_fp4_quant(x[..., :48], c[..., :4], s[..., :4], 32, False)
    with pytest.raises(ValueError, match="does not broadcast"):
        rp.reference_rope_fp4_quant(x, c[:1, :2], s[:1, :2], 16, True)
    cc = torch.zeros(2, 4, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scale_cache has shape"):
        rp.reference_rope_fp4_quant_store(x, c, s, 16, True, cc, torch.zeros(2, 4, 2, dtype=torch.uint8),
                                          torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="rows has dtype"):
        rp.reference_rope_fp4_quant_store(x, c, s, 16, True, cc, torch.zeros(2, 4, 4, dtype=torch.uint8),
                                          torch.zeros(2, 3, dtype=torch.int32))


@pytest.mark.skipif(IN_INTERPRETER, reason="checks the error raised when Triton is NOT interpreting")
def test_cpu_launch_without_interpreter_says_how_to_enable_it():
    x, c, s, block, e4m3 = _args()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        rp.triton_rope_fp4_quant(x, c, s, block, e4m3)
