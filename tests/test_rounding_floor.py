"""bench/rounding_floor.py: the rounding noise floor of the bench's relative logit error (tiny, CPU)."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "rounding_floor.py")
_spec = importlib.util.spec_from_file_location("rounding_floor", _PATH)
rf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rf)


def test_same_dtype_is_exactly_zero_and_another_dtype_is_not():
    """The metric's two ends: the same model in the same dtype twice gives 0 (deterministic CPU eager), bf16 against
    fp32 gives a positive error; each decode step is reported with both argmaxes."""
    same = rf.rounding_floor("tiny", "cpu", 8, 4, ("fp32", "fp32"))
    assert same["max_rel_logit_err"] == 0.0 and len(same["per_step"]) == 3
    assert all(s["argmax_a"] == s["argmax_b"] for s in same["per_step"])
    other = rf.rounding_floor("tiny", "cpu", 8, 4, ("fp32", "bf16"))
    assert other["max_rel_logit_err"] > 1e-4
    assert len(other["per_step"]) == 3 and max(s["rel_err"] for s in other["per_step"]) > 0
    assert other["tokens"] == same["tokens"]  # the fp32 reference decodes the same greedy tokens both times


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="new_tokens"):
        rf.rounding_floor("tiny", "cpu", 8, 1, ("fp32", "bf16"))
    with pytest.raises(SystemExit):
        rf.main(["--dtypes", "fp32"])
