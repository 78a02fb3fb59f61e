"""`sparse_attention` taking the queries' own RoPE into the fused op (`rope_q`), on a sliding-window layer written
as a user would: q projected from the hidden state by a plain matmul, its last R channels rotated on interleaved
pairs built with `torch.stack`, then the window attention of tests/test_pass_window_attention.py.

    rotated_q        q's RoPE uses the output's angles, nothing else reads it -> the op with rope_q (no q RoPE left)
    q_also_returned  the rotated q is also an output                         -> fused, q's RoPE stays outside
    other_angles     q rotated by twice the output's angles                  -> fused, q's RoPE stays outside

Each case is compared with float64 computed here: q's rotation, rounded to q.dtype, then the reference attention.
"""

from __future__ import annotations

import pytest
import torch

import test_pass_window_attention as wa

D, R = wa.D, wa.R


def rope_pairs(x, cos, sin):
    """x [B, 1, H, D] with its last R channels rotated by +angle, pairs (2i, 2i+1) from a reshape to [.., R/2, 2]."""
    pe = x[..., -R:].float().reshape(*x.shape[:-1], R // 2, 2)
    a, b = pe.unbind(-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    rot = torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(*x.shape[:-1], R)
    return torch.cat([x[..., :-R], rot.to(x.dtype)], dim=-1)


def layer(hidden, wq, rc, rs, nc, ns, vis, sink, cos, sin):
    """q = hidden @ wq, rotated with the output's angles, then the window attention."""
    q = (hidden @ wq).view(wa.B, 1, wa.H, D)
    return wa.window_attention(rope_pairs(q, cos, sin), rc, rs, nc, ns, vis, sink, cos, sin)


def layer_returning_q(hidden, wq, rc, rs, nc, ns, vis, sink, cos, sin):
    """`layer`, also returning the rotated q (read outside the site)."""
    q = rope_pairs((hidden @ wq).view(wa.B, 1, wa.H, D), cos, sin)
    return wa.window_attention(q, rc, rs, nc, ns, vis, sink, cos, sin), q


def layer_other_angles(hidden, wq, rc, rs, nc, ns, vis, sink, cos, sin):
    """`layer` with q rotated by twice the output's angles."""
    ang2 = torch.atan2(sin, cos) * 2
    q = rope_pairs((hidden @ wq).view(wa.B, 1, wa.H, D), ang2.cos(), ang2.sin())
    return wa.window_attention(q, rc, rs, nc, ns, vis, sink, cos, sin)


def rotated64(q, cos, sin):
    """q rotated by +angle in float64 on the last R channels' interleaved pairs, rounded to q.dtype."""
    x = q.double().clone()
    a, b = x[..., -R::2].clone(), x[..., -R + 1::2].clone()
    c, s = cos.double()[:, :, None], sin.double()[:, :, None]
    x[..., -R::2], x[..., -R + 1::2] = a * c - b * s, a * s + b * c
    return x.to(q.dtype)


def case_inputs(dtype, seed):
    """(hidden [B, 1, 32], wq [32, H*D], then the window inputs of test_pass_window_attention), seeded."""
    q, rc, rs, nc, ns, vis, sink, cos, sin = wa.inputs(dtype, seed)
    g = torch.Generator().manual_seed(seed + 100)
    hidden = torch.randn(wa.B, 1, 32, generator=g).to(dtype)
    wq = (torch.randn(32, wa.H * D, generator=g) / 6).to(dtype)
    return hidden, wq, rc, rs, nc, ns, vis, sink, cos, sin


def tolerance(dtype):
    """assert_close tolerances: FP32 rounding, or one bf16 rounding."""
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=3e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_rotated_inside_the_op(dtype):
    args = case_inputs(dtype, 3)
    out, recs, ops = wa.compile_case(layer, args)
    (m,) = [m for r in recs for m in r.matches]
    assert dict(m.detail).get("q_rope") is True
    assert ops["dsv41.sparse_fp4_attention.default"] == 1
    hidden, wq, rc, rs, nc, ns, vis, sink, cos, sin = args
    q = (hidden @ wq).view(wa.B, 1, wa.H, D)
    want = wa.reference(rotated64(q, cos, sin), rc, rs, nc, ns, vis, sink, cos, sin)
    torch.testing.assert_close(out.double(), want, **tolerance(dtype))
    eager = layer(*args)
    torch.testing.assert_close(out, eager, **tolerance(dtype))


@pytest.mark.parametrize("fn", [layer_returning_q, layer_other_angles])
def test_queries_keep_their_rope_when_it_cannot_move(fn):
    args = case_inputs(torch.float32, 5)
    out, recs, ops = wa.compile_case(fn, args)
    (m,) = [m for r in recs for m in r.matches]
    assert "q_rope" not in dict(m.detail)
    eager = fn(*args)
    if isinstance(out, tuple):
        torch.testing.assert_close(out[1], eager[1], rtol=0, atol=0)
        out, eager = out[0], eager[0]
    torch.testing.assert_close(out, eager, **tolerance(torch.float32))


def test_gated_variant_leaves_the_rope_outside_and_says_why(monkeypatch):
    """On CUDA without `gpu_unvalidated` the variant is gated; the options hand the manager that gate set, here on
    CPU, and the family must then keep q's RoPE outside and name the gate in the match."""
    from dsv41.compiler.options import Options
    from dsv41.passes.sparse_attention import ROPE_Q

    monkeypatch.setattr(Options, "gated_ops", lambda self, on_cuda: frozenset({ROPE_Q}))
    args = case_inputs(torch.float32, 4)
    out, recs, ops = wa.compile_case(layer, args)
    (m,) = [m for r in recs for m in r.matches]
    assert ROPE_Q in str(dict(m.detail).get("q_rope"))
    torch.testing.assert_close(out, layer(*args), **tolerance(torch.float32))
