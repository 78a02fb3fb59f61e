"""dsv41::row_argmax under the Triton interpreter against torch.argmax, on rows built to trip an argmax up: ties
(the first index must win, also across splits), NaN (torch returns the first NaN), -inf everywhere, the maximum in the
last partial tile, and rows read through a non-contiguous view. Outputs are poisoned first (-7, an index torch
never returns)."""

from __future__ import annotations

import pytest
import torch

from interp_harness import InterpreterHarness

from dsv41.kernels import row_argmax as ra

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    real = ra._empty

    def poisoned(shape, dtype, device):
        t = real(shape, dtype, device)
        return t.fill_(-7) if dtype == torch.int64 else t.fill_(float("nan"))
    monkeypatch.setattr(ra, "_empty", poisoned)


def _rows(kind, n, dtype):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=gen).to(dtype)
    if kind == "ties":          # the maximum three times, in different splits
        x[0, [5, n // 2, n - 1]] = 9.0
        x[1, [n - 2, n - 1]] = 9.0
        x[2, :] = 1.0
    elif kind == "nan":
        x[0, [n // 3, n - 1]] = float("nan")
        x[1, 0] = float("nan")
        x[2, n - 1] = float("nan")
    elif kind == "neg_inf":
        x[0, :] = float("-inf")
        x[1, :] = float("-inf")
        x[1, n - 1] = -1e30 if dtype == torch.float32 else -60000.0
        x[2, :7] = float("-inf")
    elif kind == "last_tile":
        x[:, n - 1] = 50.0
    return x


@interpreted
@pytest.mark.parametrize("kind", ["random", "ties", "nan", "neg_inf", "last_tile"])
@pytest.mark.parametrize("n, dtype, over", [(3001, torch.bfloat16, {"block": 64}),
                                            (777, torch.float16, {"block": 32, "splits": 5}),
                                            (129, torch.float32, {"block": 16, "splits": 1})])
def test_equals_torch_argmax(kind, n, dtype, over):
    x = _rows(kind, n, dtype)
    got = ra.triton_row_argmax(x, **over)
    assert torch.equal(got, torch.argmax(x, -1)), (got, torch.argmax(x, -1))


@interpreted
def test_leading_dims_and_a_strided_row():
    logits = torch.randn(2, 5, 300, generator=torch.Generator().manual_seed(1)).bfloat16()
    last = logits[:, -1]                       # [2, 300], row stride 1500
    assert torch.equal(ra.triton_row_argmax(last, block=32), torch.argmax(last, -1))
    cols = logits.transpose(1, 2)[:, :, :4]    # last dim not contiguous
    assert torch.equal(ra.triton_row_argmax(cols, block=16), torch.argmax(cols, -1))


def test_plan_and_bad_input():
    p = ra.argmax_plan(1, 128256)
    assert p["SPLITS"] * p["TILES"] * p["BLOCK"] >= 128256 and (p["SPLITS"] - 1) * p["TILES"] * p["BLOCK"] < 128256
    with pytest.raises(ValueError, match="block"):
        ra.argmax_plan(1, 100, block=48)
    with pytest.raises(ValueError, match="empty last dim"):
        ra.reference_row_argmax(torch.zeros(2, 0))
    with pytest.raises(TypeError, match="x"):
        ra.reference_row_argmax(torch.zeros(2, 3, dtype=torch.int32))
