"""Tests of dsv41::sparse_fp4_attention (dsv41/kernels/sparse_attention.py).

Reference: written here in float64 from MODEL.md §2.4 steps 3-6 and §2.1 (never the code under test): E4M3 bytes
decoded through torch's float8_e4m3fn view, UE8M0 as 2^(e-127), E2M1 through the code table, then per query and
head an explicit loop-free float64 softmax over [visible window rows ; valid bank rows] with the sink added to
the denominator only, the weighted sum of the same rows (K = V) and the inverse RoPE. The rows the reference
sees are the same FP8 / FP4 values the kernel reads, so the only differences are FP32 rounding: |got - ref| <=
1e-5 (1 + |ref|) for FP32 q (scores O(1) summed over <= 1000 rows), one bf16 rounding (2^-8 |ref|, plus the
rounding the op makes before the rotation) for bf16 q.

Contexts: shorter than the window and the top-k (few visible window rows, most slots -1), equal to k (all k slots
valid, full window), much longer (a 4096-row bank, indices spread over it), empty window slots, all-invalid rows
(output 0, as the reference: the sink takes the whole softmax), odd head counts and head dims, several query rows
(prefill chunk), forced splits (1, 3, one per tile). Every launcher output and workspace starts NaN
(`poisoned_outputs`), so an element the kernel forgets fails the test.

Interpreter tests (`@interpreted`) run in a child pytest with TRITON_INTERPRET=1 unless this process was started
with it (see tests/interp_harness.py).
"""

from __future__ import annotations

import pytest
import torch

from interp_harness import InterpreterHarness, poison_outputs, sm90_ttir

from dsv41.kernels import sparse_attention as sa
from dsv41.model.formats import quantize_fp4_e4m3_1x16, quantize_fp8_1x32

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output / workspace the launcher allocates starts as NaN."""
    poison_outputs(monkeypatch, sa)


# ------------------------------------------------------------------------------------------- float64 reference
def _e4m3(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).to(torch.float64)


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    mag = E2M1[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def ref_attention(q, wc, ws, ok, bc, bs, idx, sink, cos, sin, scale):
    """float64 o [B, T, H, D] (before the final rounding to q.dtype)."""
    b, t, h, d = q.shape
    # Window rows: E4M3 x 2^(e-127) per 32 channels, in q.dtype (the model dequantises the ring into it).
    win = (_e4m3(wc).view(b, -1, d // 32, 32) * torch.exp2(ws.double() - 127)[..., None]).view(b, -1, d)
    win = win.to(q.dtype).double()
    # Bank rows: low nibble = even channel, E4M3 scale per 16 channels.
    codes = torch.stack((bc & 15, bc >> 4), dim=-1).flatten(-2)
    bank = (_e2m1(codes).view(*bc.shape[:2], d // 16, 16) * _e4m3(bs)[..., None]).view(*bc.shape[:2], d)
    out = torch.zeros(b, t, h, d, dtype=torch.float64)
    qd = q.double()
    for bi in range(b):
        for ti in range(t):
            rows = [win[bi, s] for s in range(win.shape[1]) if ok[bi, ti, s]]
            rows += [bank[bi, int(j)] for j in idx[bi, ti] if int(j) >= 0]
            if not rows:
                continue  # softmax over [-inf, ..., sink] puts all mass on the sink: o = 0
            kv = torch.stack(rows)                                      # [n, D]
            s = qd[bi, ti] @ kv.T * scale                               # [H, n]
            m = torch.maximum(s.max(-1).values, sink.double())
            e = torch.exp(s - m[:, None])
            den = e.sum(-1) + torch.exp(sink.double() - m)
            out[bi, ti] = (e @ kv) / den[:, None]
    # o.to(q.dtype), then rotate the last R channels' pairs (2i, 2i+1) by -angle.
    o = out.to(q.dtype).double()
    r2 = cos.shape[-1]
    a, bb = o[..., -2 * r2::2].clone(), o[..., -2 * r2 + 1::2].clone()
    c, sn = cos.double()[:, :, None], sin.double()[:, :, None]
    o[..., -2 * r2::2] = a * c + bb * sn
    o[..., -2 * r2 + 1::2] = bb * c - a * sn
    return o


def make_inputs(b=1, t=1, h=4, d=64, s=17, n=32, k=8, r=16, dtype=torch.float32, seed=0, p_visible=0.7,
                p_empty=0.2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g).to(dtype)
    wc, ws = quantize_fp8_1x32(torch.randn(b, s, d, generator=g))
    ok = torch.rand(b, t, s, generator=g) < p_visible
    bc, bs = quantize_fp4_e4m3_1x16(torch.randn(b, n, d, generator=g))
    idx = torch.randint(0, n, (b, t, k), generator=g)
    idx = torch.where(torch.rand(b, t, k, generator=g) < p_empty, torch.full_like(idx, -1), idx)
    sink = torch.randn(h, generator=g)
    ang = torch.rand(b, t, r // 2, generator=g) * 6.283
    return [q, wc, ws, ok, bc, bs, idx, sink, ang.cos(), ang.sin(), d ** -0.5]


def check(got, args, what=""):
    q = args[0]
    assert not torch.isnan(got).any(), f"{what}: NaN left in the output (an element was never written)"
    assert got.dtype == q.dtype and got.shape == q.shape
    ref = ref_attention(*args)
    err = (got.double() - ref).abs()
    if q.dtype == torch.float32:
        bound = 1e-5 * (1 + ref.abs())
    else:
        bound = 2 ** -7 * ref.abs() + 1e-3
    assert bool((err <= bound).all()), f"{what}: max err {float(err.max()):.3g}"


# ------------------------------------------------------------------------------------------- CPU reference (op)
def test_cpu_op_equals_float64_reference():
    for seed, kw in enumerate([{}, dict(b=2, t=3, h=5, d=96, s=7, n=10, k=12, r=32), dict(s=0, k=4)]):
        args = make_inputs(seed=seed, **kw)
        check(torch.ops.dsv41.sparse_fp4_attention(*args), args, f"cpu op {kw}")


def test_all_invalid_rows_return_zero_in_the_reference():
    args = make_inputs(p_visible=0.0, p_empty=1.0)
    out = sa.reference_sparse_fp4_attention(*args)
    assert torch.equal(out, torch.zeros_like(out))


def test_bad_shapes_and_dtypes_are_named():
    args = make_inputs()
    bad = list(args)
    bad[4] = args[4][:, :, :-1]
    with pytest.raises(ValueError, match="bank_codes"):
        sa.reference_sparse_fp4_attention(*bad)
    bad = list(args)
    bad[3] = args[3].to(torch.uint8)
    with pytest.raises(TypeError, match="window_ok"):
        sa.reference_sparse_fp4_attention(*bad)
    bad = list(args)
    bad[0] = torch.randn(1, 1, 4, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        sa.reference_sparse_fp4_attention(*bad)


def test_fake_gives_q_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = make_inputs(dtype=torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.dsv41.sparse_fp4_attention(*fargs)
    assert out.shape == args[0].shape and out.dtype == torch.bfloat16


def test_tensor_core_precision_per_query_dtype():
    """q . kv in TF32 is exact for bf16 / fp16 q (every dequantised key is a TF32 value); p @ kv (p has 24 bits)
    is tf32x3 there (p as two TF32 parts); FP32 q stays IEEE in both. Checked on the kernel built for sm_90 with
    the precision the wrapper picks for each dtype: the interpreter does not round to TF32."""
    consts = {"D2": 256, "HALF_R": 32, "BLOCK_H": 16, "BLOCK_N": 32, "BLOCK_D2": 256, "SPLIT": 8, "USE_PDL": False}
    got = {}
    for q_type, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        ptrs = {"q_ptr": q_type, "wc_ptr": "u8", "ws_ptr": "u8", "wc2_ptr": "u8", "ws2_ptr": "u8", "wok_ptr": "u8",
                "bc_ptr": "u8", "bs_ptr": "u8", "idx_ptr": "i64", "sink_ptr": "fp32", "cos_ptr": "fp32", "sin_ptr": "fp32", "o_ptr": q_type,
                "part_ptr": "fp32"}
        pv = sa.pv_precision_for(dtype)
        ttir = sm90_ttir(sa._sparse_fp4_attention_kernel, ptrs, {**consts, "PV_PRECISION": pv},
                         {"softmax_scale": "fp32"}, num_warps=8)
        got[q_type] = [line.split("inputPrecision = ")[1].split()[0] if "inputPrecision" in line else "ieee"
                       for line in ttir.splitlines() if "tt.dot" in line]
    # program order: the two score dots (even / odd channels), then the two weighted sums
    assert got == {"fp32": ["ieee"] * 4, "bf16": ["tf32", "tf32", "tf32x3", "tf32x3"],
                   "fp16": ["tf32", "tf32", "tf32x3", "tf32x3"]}


def test_pv_precision_is_checked():
    args = make_inputs(s=5, k=4)
    for bad in ("tf32", ""):
        with pytest.raises(ValueError, match="pv_precision"):
            sa.triton_sparse_fp4_attention(*args, pv_precision=bad)
    with pytest.raises(ValueError, match="num_warps"):
        sa.triton_sparse_fp4_attention(*args, num_warps=3)


def test_plan_splits_decode_over_many_programs_and_covers_every_tile():
    p = sa.attention_plan(1, 64, 129, 512, 512)
    rows, hb, split = p["grid"]
    # batch-1 decode: one 32-row tile per program (measured faster than twice the programs with 16-row tiles)
    assert hb == 4 and p["BLOCK_N"] == 32 and p["tiles_per_split"] == 1 and split == p["n_tiles"] == 5 + 16
    assert split * p["tiles_per_split"] >= p["n_tiles"] > (split - 1) * p["tiles_per_split"]
    assert p["n_win_tiles"] == -(-129 // p["BLOCK_N"])
    prefill = sa.attention_plan(256, 64, 384, 512, 512)
    assert prefill["SPLIT"] == 1
    with pytest.raises(ValueError):
        sa.attention_plan(1, 4, 10, 8, 64, split=0)


# ------------------------------------------------------------------------------------------- interpreter
CASES = {
    # name: make_inputs kwargs
    "short_context": dict(s=17, k=8, p_visible=0.2, p_empty=0.7),          # few window rows, most slots -1
    "context_equals_k": dict(s=17, k=8, n=8, p_visible=1.0, p_empty=0.0),  # every slot valid, full window
    "long_context": dict(s=129, n=4096, k=64, p_visible=1.0, p_empty=0.0, seed=3),
    "empty_window_slots": dict(s=17, k=8, p_visible=0.3, p_empty=0.0, seed=4),
    "odd_heads_and_dims": dict(b=2, t=3, h=5, d=96, s=7, n=10, k=12, r=32, seed=5),
    "prefill_rows": dict(b=1, t=6, h=3, d=64, s=22, n=16, k=8, seed=6),
    "no_window": dict(s=0, k=8, seed=7),
}


@interpreted
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_equals_float64_reference(name, poisoned_outputs):
    args = make_inputs(**CASES[name])
    for split in (None, 1, 3):
        got = sa.triton_sparse_fp4_attention(*args, split=split)
        check(got, args, f"{name} split={split}")


@interpreted
def test_triton_one_split_per_tile_and_small_tiles(poisoned_outputs):
    args = make_inputs(s=40, n=64, k=40, seed=8)
    check(sa.triton_sparse_fp4_attention(*args, split=1000, block_n=16), args, "split per tile")


@interpreted
def test_triton_all_invalid_rows_give_zero(poisoned_outputs):
    # All indices -1 and no visible window row: the sink takes the whole softmax, o = 0 (the reference does the
    # same: softmax([-inf, ..., sink]) = [0, ..., 1], and the sink column is dropped).
    for kw in (dict(p_visible=0.0, p_empty=1.0), dict(s=0, p_empty=1.0)):
        args = make_inputs(**kw)
        for split in (None, 1):
            out = sa.triton_sparse_fp4_attention(*args, split=split)
            assert torch.equal(out, torch.zeros_like(out)), kw
    # One query row all-invalid next to a valid one.
    args = make_inputs(t=2, seed=9)
    args[3][:, 0] = False
    args[6][:, 0] = -1
    out = sa.triton_sparse_fp4_attention(*args)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    check(out, args, "mixed rows")


@interpreted
def test_triton_bf16_queries(poisoned_outputs):
    args = make_inputs(dtype=torch.bfloat16, s=20, k=16, n=40, seed=10)
    check(sa.triton_sparse_fp4_attention(*args), args, "bf16")


@interpreted
def test_triton_strided_inputs_and_int32_indices(poisoned_outputs):
    args = make_inputs(b=2, t=2, seed=12)
    args[3] = args[3][:, :1].expand(2, 2, args[3].shape[-1])        # broadcast visibility (stride 0)
    args[6] = args[6].to(torch.int32)
    big = torch.zeros(2, 40, 32, dtype=torch.uint8)
    big[:, 3:35] = args[4]
    args[4] = big[:, 3:35]                                           # a row slice of a larger bank
    q = torch.randn(2, 4, 2, 64)
    args[0] = q.transpose(1, 2)                                      # non-contiguous q
    check(sa.triton_sparse_fp4_attention(*args), args, "strided")


@interpreted
def test_triton_is_deterministic(poisoned_outputs):
    args = make_inputs(s=33, n=64, k=32, seed=13)
    a = sa.triton_sparse_fp4_attention(*args, split=5)
    b = sa.triton_sparse_fp4_attention(*args, split=5)
    assert torch.equal(a, b)
