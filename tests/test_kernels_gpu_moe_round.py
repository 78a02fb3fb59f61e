"""GPU test of dsv41::moe_combine with y_dtype (compiled Triton on CUDA): an FP32 y rounded to bf16 by the op, against
the float64 sum of torch's bf16 rounding (tests/test_moe_combine_round_y.py), at the h200 decode shape (k 6,
d 7168) and a small odd one. Outputs are poisoned before the kernel runs. Skipped without CUDA and under
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from gpu_harness import load_reference, skip_unless_compiled_gpu  # noqa: E402

skip_unless_compiled_gpu()

from interp_harness import poison_outputs  # noqa: E402

from dsv41.kernels import moe as km  # noqa: E402

RY = load_reference("test_moe_combine_round_y")


@pytest.mark.parametrize("shape", [dict(rows=1, k=6, d=7168, seed=1), dict(rows=3, k=5, d=300, weighted=True, seed=2)])
def test_moe_combine_rounds_fp32_y_on_gpu(shape, monkeypatch):
    poison_outputs(monkeypatch, km)
    y, shared, w = RY.probe(**shape)
    dev = torch.device("cuda")
    for out_dtype in (torch.float32, torch.bfloat16):
        got = km.triton_moe_combine(y.to(dev), shared.to(dev), None if w is None else w.to(dev), out_dtype,
                                    torch.bfloat16).cpu()
        assert not torch.isnan(got).any()
        want = RY.want64(y, shared, w)
        if out_dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
        else:
            torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-3)
