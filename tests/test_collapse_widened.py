"""`dsv41::mhc_collapse_rmsnorm(..., widened=True)` and the `mhc` family taking it.

Widened means: the four streams are collapsed in FP32 and normalised without rounding the collapsed row to H's
dtype in between; only the result is rounded, once. This is the graph torch < 2.13 leaves for V4.1 (Inductor drops
the FP32 -> bf16 -> FP32 round trip between the collapse and the norm), and it is also how a user may simply write
the sublayer input. Before, the op took H through its FP32 upcast and returned FP32, leaving two copy kernels
(the upcast of H, the downcast of the result) around it.

The reference here is float64 with no intermediate rounding, rounded once to H.dtype: the widened op must be
within one rounding of it (ties aside, the same bits). The kernel runs under TRITON_INTERPRET=1 in a child pytest
(tests/interp_harness.py) with its output poisoned.
"""

from __future__ import annotations

import pytest
import torch

from interp_harness import InterpreterHarness, poison_outputs

from dsv41.kernels import mhc as mk
from dsv41.passes.testing import capture_graphs, ops_after

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()
EPS = 1e-20


def exact(H, pre, w, eps=EPS):
    """float64 sum_i pre_i H_i, RMS-normalised with weight w; no rounding anywhere (float64 result)."""
    x = (pre.double()[..., None] * H.double()).sum(dim=2)
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def within_one_rounding(got, want64, dtype):
    """got (dtype) is within one rounding of the float64 value, elementwise, and has no NaN."""
    assert got.dtype == dtype and not torch.isnan(got.float()).any()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    err = (got.double() - want64).abs()
    assert bool((err <= ulp * want64.abs() + 1e-30).all()), float((err / want64.abs().clamp_min(1e-30)).max())


def make(b=1, t=1, d=96, dtype=torch.bfloat16, seed=0):
    """(H [b, t, 4, d] in dtype, pre [b, t, 4] fp32, weight [d] in dtype), seeded."""
    g = torch.Generator().manual_seed(seed)
    H = (torch.randn(b, t, 4, d, generator=g) * 3).to(dtype)
    pre = torch.rand(b, t, 4, generator=g) + 0.2
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    return H, pre, w


def test_reference_widened_rounds_once():
    for dtype in (torch.bfloat16, torch.float16):
        H, pre, w = make(dtype=dtype, b=2, t=3)
        got = mk.reference_mhc_collapse_rmsnorm(H, pre, w, EPS, widened=True)
        within_one_rounding(got, exact(H, pre, w), dtype)
        with pytest.raises(TypeError, match="widened"):
            mk.reference_mhc_collapse_rmsnorm(H, pre, w, EPS, widened=1)


@interpreted
@pytest.mark.parametrize("d", [96, 160])
def test_triton_widened_equals_the_fp32_op_then_one_cast(d, monkeypatch):
    poison_outputs(monkeypatch, mk)
    H, pre, w = make(d=d, b=2, t=2, seed=d)
    got = mk.triton_mhc_collapse_rmsnorm(H, pre, w, EPS, widened=True)
    within_one_rounding(got, exact(H, pre, w), torch.bfloat16)
    # What it replaces: the FP32 op on H.float(), then the downcast: the same bits.
    two_step = mk.triton_mhc_collapse_rmsnorm(H.float(), pre, w, EPS).to(torch.bfloat16)
    assert torch.equal(got, two_step)


def unrounded_sublayer_input(H, pre, w):
    """A user's sublayer input: streams mixed in FP32, normalised in FP32, cast back once at the end."""
    x = torch.einsum("btsd,bts->btd", H.to(torch.float32), pre)
    inv = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + EPS)
    return (x * inv * w.to(torch.float32)).to(H.dtype)


def test_family_takes_the_unrounded_spelling_widened_and_drops_both_casts():
    import dsv41

    H, pre, w = make(d=128, b=1, t=1, seed=3)
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        out = torch.compile(unrounded_sublayer_input, backend="dsv41", dynamic=False)(H, pre, w)
    recs = [r for g in dsv41.last_report().graphs for r in g.records if r.family == "mhc"]
    sites = [m for r in recs for m in r.matches if m.op == "dsv41::mhc_collapse_rmsnorm"]
    assert len(sites) == 1 and dict(sites[0].detail)["widened"] is True
    ops = ops_after(graphs)
    assert ops["dsv41.mhc_collapse_rmsnorm.default"] == 1
    assert ops["prims.convert_element_type.default"] == 0, "the upcast / downcast copies should be gone"
    within_one_rounding(out, exact(H, pre, w), torch.bfloat16)
    assert torch.equal(out, unrounded_sublayer_input(H, pre, w))


def test_widened_variant_runs_on_cuda_after_its_gpu_run():
    """Validated on an H100 (bench/results/2026-12-07_h100_s33/: its GPU tests, and `small` decode with it on):
    no longer gated."""
    from dsv41.passes import manager

    assert "mhc_collapse_rmsnorm(widened)" not in manager.GPU_UNVALIDATED_OPS
    assert "mhc_collapse_rmsnorm" not in manager.GPU_UNVALIDATED_OPS
