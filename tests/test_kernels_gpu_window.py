"""GPU tests of dsv41::sparse_fp4_attention with its window in two parts and with an empty bank (compiled Triton on
CUDA), at the h200 decode shape (64 heads, D 512, ring 128 + 1 new row) and at small odd shapes, against the float64
reference of tests/test_window_parts_attention.py. Outputs are poisoned before the kernel runs.

Skipped without CUDA and under TRITON_INTERPRET=1 (the CPU tests cover the interpreted kernel).
"""

from __future__ import annotations

import pytest
import torch

from gpu_harness import load_reference, skip_unless_compiled_gpu  # noqa: E402

skip_unless_compiled_gpu()

from interp_harness import poison_outputs  # noqa: E402

from dsv41.kernels import sparse_attention as sa  # noqa: E402

WP = load_reference("test_window_parts_attention")
DEV = torch.device("cuda")


def _to(x, dev):
    out = {}
    for k, v in x.items():
        if isinstance(v, tuple):
            out[k] = tuple(t.to(dev) for t in v)
        elif isinstance(v, torch.Tensor):
            out[k] = v.to(dev)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("shape", [dict(h=64, d=512, ring=128, new=1, r=64, dtype=torch.bfloat16, seed=11),
                                   dict(ring=33, new=3, t=3, seed=2), dict(ring=0, new=5, seed=3),
                                   dict(ring=31, new=1, b=2, h=17, seed=4, dtype=torch.bfloat16)])
def test_two_part_window_without_bank_matches_float64_on_gpu(shape, monkeypatch):
    poison_outputs(monkeypatch, sa)
    x = WP.build(**shape)
    want = WP.expected(x["q"], [x["ring"], x["new"]], x["ok"], x["sink"], x["cos"], x["sin"], x["scale"])
    for split in (None, 1, 3):
        got = WP.call(sa.triton_sparse_fp4_attention, _to(x, DEV), split=split)
        WP.close(got.cpu(), want, x["q"].dtype)
    # One part (the concatenated window) gives the same bits as two.
    one = WP.call(sa.triton_sparse_fp4_attention, _to(x, DEV), parts=False)
    two = WP.call(sa.triton_sparse_fp4_attention, _to(x, DEV))
    assert torch.equal(one, two)


QR = load_reference("test_attention_q_rope")


@pytest.mark.parametrize("shape", [dict(h=64, d=512, ring=128, new=1, r=64, dtype=torch.bfloat16, seed=12),
                                   dict(ring=33, new=3, t=3, r=64, seed=5),
                                   dict(ring=31, new=1, b=2, h=17, seed=6, dtype=torch.bfloat16)])
def test_queries_rotated_by_the_op_match_float64_on_gpu(shape, monkeypatch):
    """rope_q: q before its RoPE, rotated by the kernel while loading (compiled, so FMA contraction is off as in
    the interpreter); the float64 reference rotates first and rounds to q.dtype as the model does."""
    poison_outputs(monkeypatch, sa)
    x = WP.build(**shape)
    want = QR.want_for(x)
    g = _to(x, DEV)
    for split in (None, 1, 3):
        got = sa.triton_sparse_fp4_attention(g["q"], *g["ring"], g["ok"], *g["bank"], g["sink"], g["cos"], g["sin"],
                                             g["scale"], split=split, new_codes=g["new"][0], new_scales=g["new"][1],
                                             rope_q=True)
        QR.close(got.cpu(), want, x["q"].dtype)
    # The op on CUDA equals its own CPU reference applied to the same inputs (the rotation rounds alike).
    ref = torch.ops.dsv41.sparse_fp4_attention(x["q"], *x["ring"], x["ok"], *x["bank"], x["sink"], x["cos"],
                                               x["sin"], x["scale"], *x["new"], True)
    QR.close(got.cpu(), ref.double(), x["q"].dtype)
