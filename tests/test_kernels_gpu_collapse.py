"""GPU test of `dsv41::mhc_collapse_rmsnorm(..., widened=True)` (compiled Triton on CUDA) at the h200 width
(d = 5120) and an odd width, against the float64 reference of tests/test_collapse_widened.py, output poisoned.

Skipped without CUDA and under TRITON_INTERPRET=1 (the CPU tests cover the interpreted kernel).
"""

from __future__ import annotations

import pytest
import torch

from gpu_harness import load_reference, skip_unless_compiled_gpu  # noqa: E402

skip_unless_compiled_gpu()

from interp_harness import poison_outputs  # noqa: E402

from dsv41.kernels import mhc as mk  # noqa: E402

CW = load_reference("test_collapse_widened")


@pytest.mark.parametrize("d", [5120, 96])
def test_widened_collapse_on_gpu_rounds_once_and_equals_fp32_op_then_cast(d, monkeypatch):
    poison_outputs(monkeypatch, mk)
    H, pre, w = CW.make(d=d, b=1, t=3, seed=d)
    Hc, prec, wc = H.cuda(), pre.cuda(), w.cuda()
    got = mk.triton_mhc_collapse_rmsnorm(Hc, prec, wc, CW.EPS, widened=True)
    CW.within_one_rounding(got.cpu(), CW.exact(H, pre, w), torch.bfloat16)
    two_step = mk.triton_mhc_collapse_rmsnorm(Hc.float(), prec, wc, CW.EPS).to(torch.bfloat16)
    assert torch.equal(got, two_step)
    assert torch.equal(torch.ops.dsv41.mhc_collapse_rmsnorm(Hc, prec, wc, CW.EPS, True), got)
