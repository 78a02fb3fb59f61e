"""GPU tests of `dsv41::mhc_expand_mixes` (dsv41/kernels/mhc_fold.py) at the model widths, compiled for the GPU.

Skipped on CPU-only machines and under TRITON_INTERPRET=1. The references are the numpy float64 functions of
tests/test_kernels_mhc_fold.py (imported by path) and the separate expand kernel for the stored residual; the
outputs are poisoned (NaN) before the launch, so an element the kernel never writes fails.
"""

from __future__ import annotations

import pytest
import torch

from gpu_harness import load_reference, skip_unless_compiled_gpu  # noqa: E402
from interp_harness import poison_outputs  # noqa: E402

skip_unless_compiled_gpu()

from dsv41.kernels import mhc as mk  # noqa: E402
from dsv41.kernels import mhc_fold as fk  # noqa: E402

F = load_reference("test_kernels_mhc_fold")
DEV = torch.device("cuda")


@pytest.mark.parametrize("d", [1024, 5120], ids=["small", "h200"])
@pytest.mark.parametrize("dtype, weighted", [(torch.bfloat16, False), (torch.float32, False),
                                             (torch.bfloat16, True)], ids=["bf16", "fp32", "bf16-weighted"])
@pytest.mark.parametrize("rows", [(1, 1), (2, 5)], ids=["decode", "rows10"])
def test_fused_kernel_matches_float64_at_model_widths(d, dtype, weighted, rows, monkeypatch):
    poison_outputs(monkeypatch, fk)
    host = F.inputs(*rows, d, dtype, d + rows[1], weighted)
    args = [a.to(DEV) if a is not None else None for a in host]
    got = fk.triton_mhc_expand_mixes(*args[:7], F.NORM_EPS, F.HC_EPS, F.ITERS, args[7])
    F.check_all([g.cpu() for g in got], *host)
    # H' is the separate expand kernel's to the bit, and the split-K combine is deterministic.
    assert torch.equal(got[0], mk.triton_mhc_expand(*args[:4]))
    again = fk.triton_mhc_expand_mixes(*args[:7], F.NORM_EPS, F.HC_EPS, F.ITERS, args[7])
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_fused_kernel_inside_a_cuda_graph_replays_fresh_inputs(monkeypatch):
    # The arrival counters must be back at zero after every launch, or the second replay finishes early.
    host = F.inputs(1, 1, 5120, torch.bfloat16, 3)
    args = [a.to(DEV) if a is not None else None for a in host]
    outs = fk.triton_mhc_expand_mixes(*args[:7], F.NORM_EPS, F.HC_EPS, F.ITERS)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = fk.triton_mhc_expand_mixes(*args[:7], F.NORM_EPS, F.HC_EPS, F.ITERS)
    for seed in (4, 5):
        new = F.inputs(1, 1, 5120, torch.bfloat16, seed)
        for a, n in zip(args[:4], new[:4]):
            a.copy_(n.to(DEV))
        g.replay()
        torch.cuda.synchronize()
        F.check_all([o.cpu() for o in outs], *new[:4], *host[4:])
