"""bf16 accuracy against an FP32 reference of the same weights (dsv41/accuracy.py, issue [robust] item 7).

One real benchmark run of `tiny` in bf16 with eager and dsv41 (one dsv41 compile, ~2 minutes on 2 cores) is shared
by the tests that read a run; the others build a bf16 `tiny` eagerly (milliseconds).
"""

import io
import json
import math

import pytest
import torch

from dsv41 import accuracy, bench

#: dsv41's error against FP32 may exceed eager bf16's by at most this factor (the issue's bar; never loosen it:
#: find the family that is less accurate instead, with `options={"disable": [...]}`).
MAX_OVER_EAGER = 1.5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bf16_run():
    """`tiny` in bf16 through the benchmark: eager and dsv41, 8 prompt tokens, 4 new (3 teacher-forced steps)."""
    return bench.run_benchmark("tiny", "eager,dsv41", prompt_len=8, new_tokens=4, repeats=1, device="cpu",
                               dtype="bf16", warm_compile=False)


def test_dsv41_is_as_accurate_as_eager_against_fp32_in_bf16(bf16_run):
    r = json.loads(json.dumps(bf16_run))  # plain JSON all the way down
    eager, dsv = r["backends"]["eager"], r["backends"]["dsv41"]
    e, d = eager["logit_err_vs_fp32"], dsv["logit_err_vs_fp32"]
    assert r["dtype"] == "bfloat16" and "failed" not in (dsv["note"] or "")
    assert math.isfinite(e) and math.isfinite(d) and e > 0 and d > 0
    assert r["logit_err_vs_fp32_eager"] == e and eager["logit_err_vs_fp32_over_eager"] == 1.0
    assert dsv["logit_err_vs_fp32_over_eager"] == pytest.approx(d / e)
    assert d <= MAX_OVER_EAGER * e, f"dsv41 {d:.4g} vs eager bf16 {e:.4g} against FP32"
    ref = r["fp32_reference"]
    assert ref["source"].startswith("FP32 eager copy") and ref["tokens"] == 4 and ref["new_bytes"] > 0
    for key in ("logit_err_vs_fp32", "logit_err_vs_fp32_eager", "logit_err_vs_fp32_over_eager", "fp32_reference"):
        assert key in r["definitions"]
    from rich.console import Console
    buf = io.StringIO()
    bench.print_table(bf16_run, Console(file=buf, width=400))
    assert "logit err vs fp32" in buf.getvalue() and f"{d:.2e} ({d / e:.2f}x eager)" in buf.getvalue()


def test_an_fp32_run_is_its_own_reference(monkeypatch):
    """FP32 runs build no copy: eager's own logits are the reference, so eager's error is 0 and no ratio exists."""
    monkeypatch.setattr(accuracy, "fp32_copy", lambda model: pytest.fail("an FP32 run must not build a copy"))
    r = bench.run_benchmark("tiny", "eager", prompt_len=8, new_tokens=2, repeats=1, device="cpu",
                            warm_compile=False)
    e = r["backends"]["eager"]
    assert r["dtype"] == "float32" and "own eager" in r["fp32_reference"]["source"]
    assert e["logit_err_vs_fp32"] == 0.0 and r["logit_err_vs_fp32_eager"] == 0.0
    assert e["logit_err_vs_fp32_over_eager"] is None


def test_fp32_copy_holds_the_bf16_values_upcast_and_shares_the_codes():
    from dsv41.cli import build_model
    m = build_model("tiny", "cpu", "checkpoint", "bf16")
    before = {n: t.clone() for n, t in m.state_dict().items()}
    c, info = accuracy.fp32_copy(m)
    src = dict(m.named_parameters()) | dict(m.named_buffers())
    new = shared = 0
    for n, t in list(c.named_parameters()) + list(c.named_buffers()):
        s = src[n]
        if s.dtype == torch.bfloat16:
            assert t.dtype == torch.float32 and torch.equal(t, s.float()), n
            new += t.numel() * 4
        else:  # uint8 codes / scales, int64 tables and FP32 weights: the very same storage
            assert t.dtype == s.dtype and t.data_ptr() == s.data_ptr(), n
            shared += t.numel() * t.element_size()
    assert info == {"new_bytes": new, "shared_bytes": shared} and new > 0 and shared > 0
    assert c.dtype == torch.float32 and c.mtp is None and m.mtp is not None and c.max_seq_len == 0
    assert all(torch.equal(before[n], t) for n, t in m.state_dict().items())  # the model is untouched


def test_per_step_error_is_the_max_over_steps_of_each_steps_relative_error():
    ref = torch.tensor([[[1.0, -4.0], [0.5, 0.25]]])  # [B=1, S=2, V=2]
    got = torch.tensor([[[1.5, -4.0], [0.5, 0.0]]])
    # step 0: 0.5 / 4 = 0.125; step 1: 0.25 / 0.5 = 0.5 (a whole-tensor max |d| / max |ref| would say 0.125)
    assert accuracy.per_step_rel_err(got, ref).tolist() == [[0.125, 0.5]]
    assert accuracy.logit_err_vs_fp32(got, ref) == 0.5
    assert math.isnan(accuracy.logit_err_vs_fp32(torch.full_like(ref, float("nan")), ref))
    with pytest.raises(ValueError, match="shapes differ"):
        accuracy.per_step_rel_err(got[:, :1], ref)
    with pytest.raises(ValueError, match="all zero"):
        accuracy.per_step_rel_err(got, torch.zeros_like(ref))
    assert accuracy.ratio_to_eager(0.3, 0.2) == pytest.approx(1.5)
    assert accuracy.ratio_to_eager(0.3, 0.0) is None and accuracy.ratio_to_eager(None, 0.2) is None
    assert accuracy.fp32_err_text({"logit_err_vs_fp32": None}) == "-"
