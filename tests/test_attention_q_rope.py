"""dsv41::sparse_fp4_attention(..., rope_q=True): the queries arrive before their RoPE and are rotated while they
are loaded, which removes the queries' own RoPE kernels from every attention layer.

Reference: q rotated on the last R channels' interleaved pairs (a' = a cos - b sin, b' = a sin + b cos, MODEL.md
§2.2) in FP32 and rounded to q.dtype, as the model's `apply_rope` does, then the float64 attention of
tests/test_window_parts_attention.py (E4M3 table decode, sink in the denominator, inverse RoPE). Outputs are
poisoned before the kernel runs; interpreter tests run under TRITON_INTERPRET=1 in a child pytest.
"""

from __future__ import annotations

import pytest
import torch

import test_window_parts_attention as wp
from interp_harness import InterpreterHarness, poison_outputs

from dsv41.kernels import sparse_attention as sa

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


def rotated(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, D] with its last 2 * cos.shape[-1] channels rotated as eager PyTorch rotates them: FP32 operands,
    each product and difference a separate FP32 op, the result rounded to q.dtype (a float64 rotation rounded once
    to bf16 differs from that in the last bf16 bit of some elements)."""
    half = cos.shape[-1]
    x = q.clone()
    a, b = q[..., -2 * half::2].float(), q[..., -2 * half + 1::2].float()
    c, s = cos.float()[:, :, None], sin.float()[:, :, None]
    x[..., -2 * half::2] = (a * c - b * s).to(q.dtype)
    x[..., -2 * half + 1::2] = (a * s + b * c).to(q.dtype)
    return x


def close(got, want, dtype):
    """No NaN left; FP32: within FP32 rounding; bf16: within one bf16 rounding of either element of each rotated
    pair (the inverse RoPE mixes the two rounded outputs of a pair, so an element near 0 carries the rounding of
    its larger partner)."""
    assert not torch.isnan(got).any(), "an output element was never written"
    if dtype == torch.float32:
        wp.close(got, want, dtype)
        return
    partner = want.view(*want.shape[:-1], -1, 2).flip(-1).reshape(want.shape)
    tol = 2 ** -7 * (want.abs() + partner.abs()) + 1e-3
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), float((err - tol).max())


def want_for(x):
    """float64 attention of `build`'s inputs with q rotated first (the op's answer with rope_q)."""
    return wp.expected(rotated(x["q"], x["cos"], x["sin"]), [x["ring"], x["new"]], x["ok"], x["sink"], x["cos"],
                       x["sin"], x["scale"])


def test_cpu_op_rotates_the_queries_first():
    for dtype in (torch.float32, torch.bfloat16):
        x = wp.build(dtype=dtype, b=2, t=2, new=2, r=32, seed=7)
        got = torch.ops.dsv41.sparse_fp4_attention(x["q"], *x["ring"], x["ok"], *x["bank"], x["sink"], x["cos"],
                                                   x["sin"], x["scale"], *x["new"], True)
        close(got, want_for(x), dtype)
        # Without the flag the same q is taken as already rotated: a different answer, so the flag is read.
        plain = torch.ops.dsv41.sparse_fp4_attention(x["q"], *x["ring"], x["ok"], *x["bank"], x["sink"], x["cos"],
                                                     x["sin"], x["scale"], *x["new"])
        assert not torch.allclose(plain.double(), want_for(x), atol=1e-3)


@interpreted
@pytest.mark.parametrize("shape", [dict(), dict(ring=33, new=3, t=3, r=64, seed=2), dict(ring=31, b=2, h=17, seed=4)])
def test_triton_rotates_the_queries_while_loading(shape, monkeypatch):
    poison_outputs(monkeypatch, sa)
    for dtype in (torch.float32, torch.bfloat16):
        x = wp.build(dtype=dtype, **shape)
        want = want_for(x)
        for split in (None, 1, 2):
            got = sa.triton_sparse_fp4_attention(x["q"], *x["ring"], x["ok"], *x["bank"], x["sink"], x["cos"],
                                                 x["sin"], x["scale"], split=split, new_codes=x["new"][0],
                                                 new_scales=x["new"][1], rope_q=True)
            close(got, want, dtype)
