"""dsv41::sparse_fp4_attention reading its window in two parts (ring + the step's own rows, no concatenated copy)
and with no bank at all (an SWA layer: zero bank rows, zero selected slots).

The reference here is an independent float64 computation written out per (batch, query, head): FP8 E4M3 window
bytes decoded through a 256-entry table built from the E4M3 definition (sign, 4-bit exponent with bias 7, 3-bit
mantissa, subnormals, 0x7F / 0xFF NaN), UE8M0 scale 2^(e-127), rounded to q.dtype as the model's ring dequantise
does; softmax with the sink in the denominator only; inverse RoPE on the last R channels' interleaved pairs.
Outputs are poisoned (NaN) before the kernel runs. Interpreter tests run in a child pytest under
TRITON_INTERPRET=1 (tests/interp_harness.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from interp_harness import InterpreterHarness, poison_outputs

from dsv41.kernels import sparse_attention as sa
from dsv41.model.formats import quantize_fp8_1x32

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


def _e4m3_table() -> list[float]:
    out = []
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exp, man = (byte >> 3) & 0xF, byte & 0x7
        if exp == 0xF and man == 0x7:
            out.append(math.nan)
        elif exp == 0:
            out.append(sign * man / 8 * 2.0 ** -6)
        else:
            out.append(sign * (1 + man / 8) * 2.0 ** (exp - 7))
    return out


E4M3 = torch.tensor(_e4m3_table(), dtype=torch.float64)


def rows_f64(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, S, D] float64 of FP8 rows, each value rounded to `dtype` first (as the ring is dequantised)."""
    vals = E4M3[codes.long()]
    mult = torch.pow(2.0, scales.double() - 127.0).repeat_interleave(32, dim=-1)
    return (vals * mult).to(dtype).double()


def expected(q, parts, ok, sink, cos, sin, scale):
    """float64 attention of q [B, T, H, D] over the window parts' rows in order, then o.to(q.dtype) + inverse RoPE."""
    keys = torch.cat([rows_f64(c, s, q.dtype) for c, s in parts], dim=1)
    b, t, h, d = q.shape
    o = torch.zeros(b, t, h, d, dtype=torch.float64)
    for bi in range(b):
        for ti in range(t):
            for hi in range(h):
                vis = [r for r in range(keys.shape[1]) if ok[bi, ti, r]]
                if not vis:
                    continue
                logits = [float(q[bi, ti, hi].double() @ keys[bi, r]) * scale for r in vis]
                top = max(max(logits), float(sink[hi]))
                w = [math.exp(x - top) for x in logits]
                den = sum(w) + math.exp(float(sink[hi]) - top)
                for wr, r in zip(w, vis):
                    o[bi, ti, hi] += wr / den * keys[bi, r]
    o = o.to(q.dtype).double()
    half = cos.shape[-1]
    ev, od = o[..., -2 * half::2].clone(), o[..., -2 * half + 1::2].clone()
    c, s_ = cos.double()[:, :, None], sin.double()[:, :, None]
    o[..., -2 * half::2] = ev * c + od * s_
    o[..., -2 * half + 1::2] = od * c - ev * s_
    return o


def build(b=1, t=1, h=5, d=64, ring=19, new=1, r=16, dtype=torch.float32, seed=0):
    """The op's inputs as a dict: q, ring and new FP8 parts, mask, sink, angles, an empty bank, the scale."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g).to(dtype)
    rc, rs = quantize_fp8_1x32(torch.randn(b, ring, d, generator=g) * 3)
    nc, ns = quantize_fp8_1x32(torch.randn(b, new, d, generator=g))
    ok = torch.rand(b, t, ring + new, generator=g) < 0.6
    ok[..., -1] = True
    sink = torch.randn(h, generator=g)
    ang = torch.rand(b, t, r // 2, generator=g) * 6.3
    no_bank = (torch.zeros(b, 0, d // 2, dtype=torch.uint8), torch.zeros(b, 0, d // 16, dtype=torch.uint8),
               torch.zeros(b, t, 0, dtype=torch.int64))
    return dict(q=q, ring=(rc, rs), new=(nc, ns), ok=ok, sink=sink, cos=ang.cos(), sin=ang.sin(), bank=no_bank,
                scale=d ** -0.5)


def call(fn, x, split=None, parts=True):
    """fn (the op or its Triton launcher) on `build`'s inputs: two window parts, or one concatenated."""
    bc, bs, idx = x["bank"]
    if parts:
        extra = dict(new_codes=x["new"][0], new_scales=x["new"][1])
        wc, ws = x["ring"]
    else:
        extra = {}
        wc, ws = (torch.cat((x["ring"][i], x["new"][i]), 1) for i in (0, 1))
    kw = {} if split is None else dict(split=split)
    return fn(x["q"], wc, ws, x["ok"], bc, bs, idx, x["sink"], x["cos"], x["sin"], x["scale"], **extra, **kw)


def close(got, want, dtype):
    """No NaN left, and within FP32 rounding (FP32 q) or one bf16 rounding of the float64 reference."""
    assert not torch.isnan(got).any(), "an output element was never written"
    tol = 1e-5 * (1 + want.abs()) if dtype == torch.float32 else 2 ** -7 * want.abs() + 1e-3
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), float(err.max())


def test_cpu_op_two_parts_and_no_bank_match_float64():
    for dtype in (torch.float32, torch.bfloat16):
        x = build(dtype=dtype, b=2, t=2, new=2, seed=1)
        want = expected(x["q"], [x["ring"], x["new"]], x["ok"], x["sink"], x["cos"], x["sin"], x["scale"])
        close(call(torch.ops.dsv41.sparse_fp4_attention, x), want, dtype)
        close(call(torch.ops.dsv41.sparse_fp4_attention, x, parts=False), want, dtype)


def test_half_given_second_part_is_refused_by_name():
    x = build()
    bc, bs, idx = x["bank"]
    wc, ws = x["ring"]
    with pytest.raises(ValueError, match="new_codes and new_scales"):
        sa.reference_sparse_fp4_attention(x["q"], wc, ws, x["ok"], bc, bs, idx, x["sink"], x["cos"], x["sin"],
                                          x["scale"], new_codes=x["new"][0])
    with pytest.raises(ValueError, match="window_ok"):  # the mask must cover both parts
        sa.reference_sparse_fp4_attention(x["q"], wc, ws, x["ok"][..., :-1], bc, bs, idx, x["sink"], x["cos"],
                                          x["sin"], x["scale"], new_codes=x["new"][0], new_scales=x["new"][1])
    with pytest.raises(ValueError, match="new_scales"):
        sa.reference_sparse_fp4_attention(x["q"], wc, ws, x["ok"], bc, bs, idx, x["sink"], x["cos"], x["sin"],
                                          x["scale"], new_codes=x["new"][0], new_scales=x["new"][1][..., :1])


@interpreted
@pytest.mark.parametrize("shape", [dict(), dict(ring=33, new=3, t=3, seed=2), dict(ring=0, new=5, seed=3),
                                   dict(ring=31, new=1, b=2, h=17, seed=4)])
def test_triton_reads_both_parts_in_place(shape, monkeypatch):
    poison_outputs(monkeypatch, sa)
    for dtype in (torch.float32, torch.bfloat16):
        x = build(dtype=dtype, **shape)
        want = expected(x["q"], [x["ring"], x["new"]], x["ok"], x["sink"], x["cos"], x["sin"], x["scale"])
        for split in (None, 1, 2):
            close(call(sa.triton_sparse_fp4_attention, x, split=split), want, dtype)


@interpreted
def test_triton_second_part_strided_like_a_slice(monkeypatch):
    """The step's rows are often a slice of a larger buffer (row stride > D): read through its strides."""
    poison_outputs(monkeypatch, sa)
    x = build(new=2, seed=5)
    big_c = torch.full((1, 6, 64), 0x7F, dtype=torch.uint8)  # NaN bytes around the rows that count
    big_s = torch.full((1, 6, 2), 255, dtype=torch.uint8)
    big_c[:, 1:5:2] = x["new"][0]
    big_s[:, 1:5:2] = x["new"][1]
    x2 = dict(x, new=(big_c[:, 1:5:2], big_s[:, 1:5:2]))
    want = expected(x["q"], [x["ring"], x["new"]], x["ok"], x["sink"], x["cos"], x["sin"], x["scale"])
    close(call(sa.triton_sparse_fp4_attention, x2), want, torch.float32)
