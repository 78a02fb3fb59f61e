"""Tests of dsv41::engram_lookup / engram_gate (dsv41/kernels/engram.py).

References are written here from MODEL.md §2.10, never the code under test: row ids on Python big integers
(products wrapped to int64 two's complement, Python's floor `%` as torch.remainder), E4M3 bytes decoded bit by
bit in plain Python and scaled by 2^(e-127) in float64 (rounded once to the output dtype), and the gate in
float64 per stream.

Tolerances: the lookup is exact (an E4M3 value times a power of two is exact in FP32, rounded once); the gate
computes in FP32 with its row sums in another order than the float64 reference: |got - ref| <= 1e-5 (1 + |ref|)
in FP32, one bf16 rounding (2^-8 |ref|) for bf16 H.

Interpreter tests (`@interpreted`) run in a child pytest with TRITON_INTERPRET=1 unless this process was started
with it (Triton reads the variable when it is first imported; see tests/interp_harness.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from interp_harness import IN_INTERPRETER, InterpreterHarness, poison_outputs

from dsv41.kernels import engram as ek
from dsv41.model.formats import quantize_fp8_1x32

EPS = 1e-20

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output the launchers allocate starts as NaN, so an element the kernel forgets fails the test."""
    poison_outputs(monkeypatch, ek)


# ------------------------------------------------------------------------------------------- references
def wrap64(x: int) -> int:
    return ((x + (1 << 63)) % (1 << 64)) - (1 << 63)


def ref_row_ids(u, mults, primes, offsets, n_heads):
    """[B][T][R] Python ints: rolling XOR of u_s * m_s (int64 wrap-around), floor remainder, offset."""
    out = []
    for per_b in u:
        ob = []
        for us in per_b:
            prods = [wrap64(a * b) for a, b in zip(us, mults)]
            h, rows = prods[0], []
            for k in range(1, len(us)):
                h = h ^ prods[k]  # XOR of two int64 values stays in int64 (two's complement)
                for e in range(n_heads):
                    j = (k - 1) * n_heads + e
                    rows.append(wrap64(h % primes[j] + offsets[j]))
            ob.append(rows)
        out.append(ob)
    return out


def e4m3_value(byte: int) -> float:
    """OCP E4M3 (fn) value of a byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 15 and man == 7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def ue8m0_value(e: int) -> float:
    """dsv41's UE8M0 decoding: 2^(e-127), with byte 0 meaning 0 (formats.ue8m0_to_float)."""
    return 0.0 if e == 0 else (math.inf if e == 255 else 2.0 ** (e - 127))


def ref_lookup(u, mults, primes, offsets, weight, scale, dtype):
    """float64 rows [B, T, R * C] rounded once to dtype."""
    n_heads = primes.numel() // (mults.numel() - 1)
    ids = ref_row_ids(u.tolist(), mults.tolist(), primes.tolist(), offsets.tolist(), n_heads)
    w, s = weight.tolist(), scale.tolist()
    c = weight.shape[1]
    vals = [[[e4m3_value(w[r][i]) * ue8m0_value(s[r][i // 32]) for r in rows for i in range(c)] for rows in per_b]
            for per_b in ids]
    return torch.tensor(vals, dtype=torch.float64).to(dtype)


def ref_gate(H, keys, value, qw, kw, eps=EPS, floor=1e-6, signed_sqrt=True):
    """float64 H + g * value per stream (MODEL.md §2.10 "Gate per stream")."""
    h, k, v = H.double(), keys.double(), value.double()
    w = qw.double() * kw.double()
    out = torch.empty(h.shape, dtype=torch.float64)
    b_, t_, n_, d = h.shape
    for b in range(b_):
        for t in range(t_):
            for i in range(n_):
                hi, ki = h[b, t, i], k[b, t, i]
                rs = 1 / math.sqrt(float((hi ** 2).mean()) + eps) / math.sqrt(float((ki ** 2).mean()) + eps)
                dot = float((h[b, t, i] * w[i] * k[b, t, i]).sum()) * rs / math.sqrt(d)
                sgn = (dot > 0) - (dot < 0)
                z = sgn * math.sqrt(max(abs(dot), floor)) if signed_sqrt else dot
                out[b, t, i] = h[b, t, i] + v[b, t] / (1 + math.exp(-z))
    return out


# ------------------------------------------------------------------------------------------- inputs
def make_table(primes, c, seed):
    rows = int(sum(primes))
    w, s = quantize_fp8_1x32(torch.randn(rows, c, generator=torch.Generator().manual_seed(seed)) * 3)
    return w, s


def hash_consts(m, n_heads, seed, wide=False):
    """(multipliers [m], primes [R], offsets [R]): small odd multipliers (model range) or full-range ones."""
    gen = torch.Generator().manual_seed(seed)
    r = (m - 1) * n_heads
    primes = torch.tensor([101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157, 163, 167, 173][:r])
    offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), primes[:-1]]), 0)
    if wide:
        mults = torch.randint(-(1 << 63), (1 << 63) - 1, (m,), generator=gen)
    else:
        mults = torch.randint(0, ((2 ** 63 - 1) // 512) // 2, (m,), generator=gen) * 2 + 1
    return mults, primes, offsets


LOOKUP_SHAPES = [(1, 1, 3, 2, 32), (2, 3, 4, 3, 96), (1, 5, 2, 5, 64)]  # (B, T, M, n_heads, C)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_ids_lookup = lambda s: "B{}T{}M{}h{}C{}".format(*s)  # noqa: E731
_ids_dtype = lambda d: str(d).replace("torch.", "")  # noqa: E731


def lookup_inputs(shape, seed, wide=False):
    b, t, m, nh, c = shape
    mults, primes, offsets = hash_consts(m, nh, seed, wide)
    w, s = make_table(primes.tolist(), c, seed)
    hi = (1 << 31) if wide else 512
    u = torch.randint(0, hi, (b, t, m), generator=torch.Generator().manual_seed(seed + 1))
    return u, mults, primes, offsets, w, s


# ------------------------------------------------------------------------------------------- reference ops
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=_ids_dtype)
def test_cpu_ops_match_the_bigint_and_float64_spec(dtype):
    args = lookup_inputs((2, 3, 4, 3, 96), 3)
    x = torch.ops.dsv41.engram_lookup(*args, dtype)
    assert x.dtype == dtype and x.is_contiguous()
    assert torch.equal(x, ref_lookup(*args, dtype))
    gen = torch.Generator().manual_seed(4)
    H = torch.randn(2, 3, 4, 64, generator=gen).to(dtype)
    kv = torch.randn(2, 3, 5 * 64, generator=gen).to(dtype)
    keys, value = kv[..., :256].unflatten(-1, (4, 64)), kv[..., 256:]
    qw, kw = (1 + 0.1 * torch.randn(2, 4, 64, generator=gen)).to(dtype)
    out = torch.ops.dsv41.engram_gate(H, keys, value, qw, kw, EPS)
    assert_gate(out, ref_gate(H, keys, value, qw, kw), dtype)


def assert_gate(got, ref64, dtype, what="gate"):
    assert got.dtype == dtype
    assert not torch.isnan(got).any(), f"{what}: NaN left in the output (an element was never written)"
    err = (got.double() - ref64).abs()
    rtol = 1e-5 if dtype == torch.float32 else 2.0 ** -8 + 1e-5
    bound = 1e-5 + rtol * ref64.abs()
    assert bool((err <= bound).all()), f"{what}: max error {float(err.max())}"


# ------------------------------------------------------------------------------------------- Triton (interpreted)
@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids_dtype)
@pytest.mark.parametrize("shape", LOOKUP_SHAPES, ids=_ids_lookup)
def test_triton_lookup_equals_bigint_reference_bit_for_bit(shape, dtype, poisoned_outputs):
    args = lookup_inputs(shape, sum(shape))
    x = ek.triton_engram_lookup(*args, dtype)
    b, t, m, nh, c = shape
    assert x.shape == (b, t, (m - 1) * nh * c) and x.dtype == dtype
    assert torch.equal(x, ref_lookup(*args, dtype))


@interpreted
def test_triton_lookup_wraps_products_like_int64_and_floors_the_remainder(poisoned_outputs):
    # Full-range multipliers: products overflow and wrap, hashes are negative about half the time, so a
    # truncating `%` (C, fmod) would pick other rows than torch.remainder.
    args = lookup_inputs((2, 4, 4, 3, 32), 7, wide=True)
    u, mults, primes, offsets, *_ = args
    ids = ref_row_ids(u.tolist(), mults.tolist(), primes.tolist(), offsets.tolist(), 3)
    prods = [[[wrap64(a * b) for a, b in zip(us, mults.tolist())] for us in per_b] for per_b in u.tolist()]
    assert any(p[0] ^ p[1] < 0 for per_b in prods for p in per_b), "the probe must produce negative hashes"
    assert max(max(max(r) for r in per_b) for per_b in ids) < int(primes.sum())
    assert torch.equal(ek.triton_engram_lookup(*args, torch.float32), ref_lookup(*args, torch.float32))


@interpreted
def test_triton_lookup_reads_strided_lookback_and_matches_model_op():
    # u as a strided view (every other look-back column of a wider tensor), as a slice of the model's buffer.
    u, mults, primes, offsets, w, s = lookup_inputs((2, 3, 3, 2, 64), 11)
    wide = torch.stack([u, u + 1], dim=-1).flatten(-2)[..., 0::2]
    assert not wide.is_contiguous() and torch.equal(wide, u)
    got = ek.triton_engram_lookup(wide, mults, primes, offsets, w, s, torch.bfloat16)
    assert torch.equal(got, torch.ops.dsv41.engram_lookup(u, mults, primes, offsets, w, s, torch.bfloat16))


@interpreted
def test_triton_lookup_decodes_every_e4m3_byte_and_ue8m0_extreme():
    # One 256-byte row per table row holds every E4M3 code (NaN codes included); scale bytes 0 (value 0),
    # 1, 127, 254, 255 (inf). NaN where the reference has NaN (code NaN, or 0 * inf).
    primes = torch.tensor([5, 7])
    offsets = torch.tensor([0, 5])
    codes = torch.arange(256, dtype=torch.uint8).roll(37).repeat(12, 1)
    scales = torch.tensor([0, 1, 127, 254, 255, 100, 130, 140], dtype=torch.uint8).repeat(12, 1)
    scales = torch.stack([scales[i].roll(i) for i in range(12)])
    u = torch.arange(12, dtype=torch.int64).view(2, 3, 2)
    mults = torch.tensor([1, 3])
    got = ek.triton_engram_lookup(u, mults, primes, offsets, codes, scales, torch.float32)
    ref = ref_lookup(u, mults, primes, offsets, codes, scales, torch.float32)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(ref))


@interpreted
def test_triton_lookup_clamps_row_ids_outside_the_table(poisoned_outputs):
    # Offsets past the end: the reference raises IndexError; the kernel reads the last row (documented).
    u, mults, primes, offsets, w, s = lookup_inputs((1, 2, 3, 2, 32), 13)
    big = offsets + 10_000
    got = ek.triton_engram_lookup(u, mults, primes, big, w, s, torch.float32)
    last = torch.ops.dsv41.engram_lookup(torch.zeros_like(u), torch.ones_like(mults), torch.ones_like(primes),
                                         torch.full_like(offsets, w.shape[0] - 1), w, s, torch.float32)
    assert torch.equal(got, last.expand_as(got))
    with pytest.raises(IndexError):
        ek.reference_engram_lookup(u, mults, primes, big, w, s, torch.float32)


GATE_SHAPES = [(1, 1, 128), (2, 3, 96), (1, 2, 1056)]
_ids_gate = lambda s: "B{}T{}d{}".format(*s)  # noqa: E731


def gate_inputs(b, t, d, dtype, seed):
    """H, keys and value as the model has them: keys / value are strided views of one wkv output [B, T, 5d]."""
    gen = torch.Generator().manual_seed(seed)
    H = (torch.randn(b, t, 4, d, generator=gen) * 2).to(dtype)
    kv = torch.randn(b, t, 5 * d, generator=gen).to(dtype)
    keys, value = kv[..., :4 * d].unflatten(-1, (4, d)), kv[..., 4 * d:]
    qw, kw = (1 + 0.1 * torch.randn(2, 4, d, generator=gen)).to(dtype)
    return H, keys, value, qw, kw


@interpreted
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=_ids_dtype)
@pytest.mark.parametrize("shape", GATE_SHAPES, ids=_ids_gate)
def test_triton_gate_matches_float64_reference(shape, dtype, poisoned_outputs):
    args = gate_inputs(*shape, dtype, sum(shape))
    out = ek.triton_engram_gate(*args, EPS)
    assert out.shape == args[0].shape and out.is_contiguous()
    assert_gate(out, ref_gate(*args), dtype)


@interpreted
@pytest.mark.parametrize("chunks", [1, 3, 5])
def test_triton_gate_chunks_cover_every_channel_with_one_gate(chunks, poisoned_outputs):
    # d = 1056 = 5 output blocks of 256 (the last one 32 wide): 1 chunk, 3 uneven chunks (2 + 2 + 1 blocks), 5.
    args = gate_inputs(1, 2, 1056, torch.float32, 21)
    plan = ek.gate_plan(2, 1056, chunks=chunks)
    assert plan["CHUNKS"] == chunks and plan["RBLOCK"] == 1024
    out = ek.triton_engram_gate(*args, EPS, chunks=chunks)
    assert_gate(out, ref_gate(*args), torch.float32)


@interpreted
def test_triton_gate_honours_the_floor_and_eps(poisoned_outputs):
    # Stream 1: one non-zero key channel makes dot = H[0] w[0] / rms(H) = 2e-7 exactly enough (below the 1e-6
    # floor). Stream 2: H of RMS 1e-10, so eps = 1e-20 doubles its mean square. Both would fail a kernel that
    # dropped the floor or the eps (the float64 variants below differ by far more than the tolerance).
    H, keys, value, qw, kw = gate_inputs(1, 1, 160, torch.float32, 31)
    keys = keys.clone()
    keys[:, :, 1] = 0.0
    keys[:, :, 1, 0] = 1.0
    w0 = float(qw[1, 0]) * float(kw[1, 0])
    H[:, :, 1, 0] = 2e-7 * float(H[0, 0, 1].double().square().mean().sqrt()) / w0
    H[:, :, 2] *= 1e-10 / float(H[0, 0, 2].double().square().mean().sqrt())
    out = ek.triton_engram_gate(H, keys, value, qw, kw, EPS)
    want = ref_gate(H, keys, value, qw, kw)
    assert_gate(out, want, torch.float32)
    for other in (ref_gate(H, keys, value, qw, kw, floor=0.0), ref_gate(H, keys, value, qw, kw, eps=0.0)):
        assert float((other - want).abs().max()) > 1e-5


@interpreted
def test_triton_gate_keeps_nan_and_zero_dot_semantics():
    # A zero key row: dot = 0 exactly, sign 0, g = 1/2. A NaN in H propagates to that stream only.
    H, keys, value, qw, kw = gate_inputs(1, 1, 64, torch.float32, 41)
    keys = keys.clone()
    keys[:, :, 0] = 0.0
    H[:, :, 3, 5] = float("nan")
    out = ek.triton_engram_gate(H, keys, value, qw, kw, EPS)
    ref = ek.reference_engram_gate(H, keys, value, qw, kw, EPS)
    assert torch.allclose(out[:, :, 0], H[:, :, 0] + 0.5 * value, atol=1e-6)
    assert torch.isnan(out[:, :, 3]).all() and torch.isnan(ref[:, :, 3]).all()
    assert torch.allclose(out[:, :, :3], ref[:, :, :3], atol=1e-5, rtol=1e-5)


def test_gate_plan_spreads_the_decode_rows():
    # h200 width (d = 4096) at decode: 16 output blocks, 64 programs = 4 streams x 16 chunks; prefill: 1 chunk.
    assert ek.gate_plan(1, 4096) == {"CHUNKS": 16, "CHUNK": 256, "RBLOCK": 1024, "OBLOCK": 256}
    assert ek.gate_plan(64, 4096)["CHUNKS"] == 1
    assert ek.gate_plan(1, 96) == {"CHUNKS": 1, "CHUNK": 128, "RBLOCK": 128, "OBLOCK": 128}
    with pytest.raises(ValueError, match="chunks"):
        ek.gate_plan(1, 64, chunks=0)


# ------------------------------------------------------------------------------------------- op registration
def test_ops_pass_torch_library_opcheck():
    args = lookup_inputs((1, 2, 3, 2, 32), 5)
    torch.library.opcheck(torch.ops.dsv41.engram_lookup.default, (*args, torch.bfloat16))
    g = gate_inputs(1, 2, 32, torch.float32, 6)
    torch.library.opcheck(torch.ops.dsv41.engram_gate.default, (*g, EPS))


def test_fake_functions_give_shapes_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        u = torch.empty(2, 3, 4, dtype=torch.int64)
        x = torch.ops.dsv41.engram_lookup(u, torch.empty(4, dtype=torch.int64), torch.empty(24, dtype=torch.int64),
                                          torch.empty(24, dtype=torch.int64), torch.empty(1000, 256, dtype=torch.uint8),
                                          torch.empty(1000, 8, dtype=torch.uint8), torch.bfloat16)
        assert x.shape == (2, 3, 24 * 256) and x.dtype == torch.bfloat16
        H = torch.empty(2, 3, 4, 160, dtype=torch.bfloat16)
        out = torch.ops.dsv41.engram_gate(H, H, torch.empty(2, 3, 160), torch.empty(4, 160), torch.empty(4, 160), EPS)
        assert out.shape == H.shape and out.dtype == torch.bfloat16


def test_bad_inputs_raise_errors_naming_the_argument():
    u, mults, primes, offsets, w, s = lookup_inputs((1, 2, 3, 2, 32), 8)
    f32 = torch.float32
    with pytest.raises(TypeError, match="u has dtype"):
        ek.reference_engram_lookup(u.int(), mults, primes, offsets, w, s, f32)
    with pytest.raises(ValueError, match="multipliers must be"):
        ek.reference_engram_lookup(u, mults[:2], primes, offsets, w, s, f32)
    with pytest.raises(ValueError, match="primes must be"):
        ek.reference_engram_lookup(u, mults, primes[:3], offsets[:3], w, s, f32)
    with pytest.raises(ValueError, match="offsets must be"):
        ek.reference_engram_lookup(u, mults, primes, offsets[:3], w, s, f32)
    with pytest.raises(ValueError, match="scale must be"):
        ek.reference_engram_lookup(u, mults, primes, offsets, w, s[:, :0], f32)
    with pytest.raises(ValueError, match="multiple of 32"):
        ek.reference_engram_lookup(u, mults, primes, offsets, w[:, :16], s, f32)
    with pytest.raises(TypeError, match="dtype must be"):
        ek.reference_engram_lookup(u, mults, primes, offsets, w, s, torch.int32)
    H, keys, value, qw, kw = gate_inputs(1, 2, 32, f32, 9)
    with pytest.raises(ValueError, match="four residual streams"):
        ek.reference_engram_gate(H[:, :, :3], keys[:, :, :3], value, qw[:3], kw[:3], EPS)
    with pytest.raises(ValueError, match="value must be"):
        ek.reference_engram_gate(H, keys, value[..., :16], qw, kw, EPS)
    with pytest.raises(ValueError, match="k_weight must be"):
        ek.reference_engram_gate(H, keys, value, qw, kw[:, :16], EPS)
    with pytest.raises(ValueError, match="eps"):
        ek.reference_engram_gate(H, keys, value, qw, kw, -1.0)


@pytest.mark.skipif(IN_INTERPRETER, reason="checks the error raised when Triton is NOT interpreting")
def test_cpu_launch_without_interpreter_says_how_to_enable_it():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ek.triton_engram_lookup(*lookup_inputs((1, 1, 3, 2, 32), 1), torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ek.triton_engram_gate(*gate_inputs(1, 1, 32, torch.float32, 1), EPS)
