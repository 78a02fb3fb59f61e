"""Tests of dsv41::linear_upcast (dsv41/kernels/upcast_gemv.py): FP32 GEMV over a bf16 / fp16 weight.

Reference: float64 `x @ W^T` written here (widening bf16 / fp16 to float64 is exact, so it is the true product
of the values the op multiplies), never the code under test. Tolerance for the FP32 sums, in any order:
|y - ref| <= 2^-20 * sum|x_k W_nk| + 1e-30. Outputs are poisoned (NaN) before the kernel runs, so an element the
kernel forgets to write fails. Interpreter tests run in a child pytest with TRITON_INTERPRET=1 (interp_harness).
"""

from __future__ import annotations

import pytest
import torch

from interp_harness import InterpreterHarness, poison_outputs

from dsv41.kernels import upcast_gemv as ug

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output / workspace the launcher allocates starts as NaN."""
    poison_outputs(monkeypatch, ug)


def ref64(x: torch.Tensor, w: torch.Tensor):
    """(x @ w^T, |x| @ |w|^T) in float64."""
    xd, wd = x.double(), w.double()
    return xd @ wd.T, xd.abs() @ wd.abs().T


def assert_close64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want, mag = ref64(x.reshape(-1, x.shape[-1]), w)
    got = y.reshape(want.shape).double()
    assert torch.isfinite(got).all(), "the kernel left elements unwritten (NaN poison) or produced inf"
    err = (got - want).abs()
    bound = mag * 2.0 ** -20 + 1e-30
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3e}"


# (leading dims of x, N, K, weight dtype, plan overrides): odd N and K, M from 1 to 11 (12 > MAX_TRITON_M rows
# tile in m), one and several K splits, the BLOCK_M >= 4 tile width, fp16 weights.
CASES = [
    ((1,), 37, 100, torch.bfloat16, {}),
    ((1, 1), 130, 257, torch.bfloat16, {"block_k": 32, "k_iters": 2}),
    ((3,), 65, 96, torch.float16, {"block_n": 16, "block_k": 32, "k_iters": 1}),
    ((2, 3), 33, 200, torch.bfloat16, {"block_k": 32, "k_iters": 1}),
    ((11,), 9, 64, torch.float16, {}),
    ((1,), 300, 40, torch.bfloat16, {"block_n": 32}),
    # FP32 weights (the compressor's wkv / wgate): BLOCK_K 32 by default, several K splits
    ((1,), 37, 100, torch.float32, {}),
    ((2, 1), 130, 257, torch.float32, {"k_iters": 2}),
    ((5,), 65, 96, torch.float32, {"block_n": 16, "block_k": 64, "k_iters": 1}),
]


@interpreted
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}x{c[2]}-{str(c[3])[6:]}"
                         f"-{'-'.join(f'{k}{v}' for k, v in c[4].items())}")
def test_triton_upcast_gemv_matches_float64(case, poisoned_outputs):
    lead, n, k, wdt, overrides = case
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=gen) * 0.5).to(wdt)
    x = torch.randn(*lead, k, generator=gen) * 3
    y = ug.triton_linear_upcast(x, w, **overrides)
    assert y.shape == (*lead, n) and y.dtype == torch.float32
    assert_close64(y, x, w)


@interpreted
def test_split_k_counters_are_left_at_zero(poisoned_outputs, monkeypatch):
    """Two launches sharing one counter buffer give the same result: the first left its counters at zero."""
    buf = torch.zeros(64, dtype=torch.int32)
    from dsv41.kernels import _common
    monkeypatch.setattr(_common, "split_k_counters", lambda device, n: buf)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(20, 160, generator=gen).bfloat16()
    x = torch.randn(2, 160, generator=gen)
    a = ug.triton_linear_upcast(x, w, block_n=16, block_k=32, k_iters=1)
    assert int(buf.abs().sum()) == 0
    b = ug.triton_linear_upcast(x, w, block_n=16, block_k=32, k_iters=1)
    assert torch.equal(a, b)
    assert_close64(a, x, w)


@interpreted
def test_large_and_non_contiguous_inputs(poisoned_outputs):
    """A strided x row view and a transposed-then-copied weight; values with a wide dynamic range."""
    gen = torch.Generator().manual_seed(9)
    base = torch.randn(4, 2 * 96, generator=gen) * torch.logspace(-3, 3, 2 * 96)
    x = base[:, ::2]  # stride 2 along K
    w = (torch.randn(96, 50, generator=gen).T * 100).to(torch.bfloat16)  # [50, 96], stride (1, 50)
    y = ug.triton_linear_upcast(x, w)
    assert_close64(y, x, w)


@interpreted
@pytest.mark.parametrize("lead", [(3,), (2, 0), ()])
def test_an_empty_k_gives_zeros_as_f_linear(lead, poisoned_outputs):
    """K = 0 is an empty sum: zeros of [..., N], as F.linear gives (was a reshape error)."""
    x = torch.empty(*lead, 0)
    w = torch.empty(7, 0, dtype=torch.bfloat16)
    y = ug.triton_linear_upcast(x, w)
    want = torch.nn.functional.linear(x, w.float())
    assert y.shape == want.shape and y.dtype == torch.float32
    assert torch.equal(y, want)


def test_reference_is_the_eager_spelling():
    """The CPU op is bit-identical to `F.linear(x.float(), W.float())` (what eager runs)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(17, 48, generator=gen).bfloat16()
    x = torch.randn(2, 5, 48, generator=gen)
    want = torch.nn.functional.linear(x.float(), w.float())
    assert torch.equal(torch.ops.dsv41.linear_upcast(x, w), want)


@pytest.mark.parametrize("bad, match", [
    (lambda: (torch.randn(2, 8).double(), torch.randn(3, 8).bfloat16()), "x"),
    (lambda: (torch.randn(2, 8), torch.randn(3, 8).double()), "weight"),
    (lambda: (torch.randn(2, 8), torch.randn(3, 8, 1).bfloat16()), "weight"),
    (lambda: (torch.randn(2, 9), torch.randn(3, 8).bfloat16()), "K = 8"),
])
def test_bad_inputs_are_named(bad, match):
    x, w = bad()
    with pytest.raises((TypeError, ValueError), match=match):
        ug.reference_linear_upcast(x, w)


def test_fp32_weights_are_taken_with_16_kib_tiles():
    assert ug.upcast_plan(1, 1024, 1024, weight_bytes=4)["BLOCK_K"] == 32
    assert ug.upcast_plan(1, 1024, 1024)["BLOCK_K"] == 64
    with pytest.raises(ValueError, match="weight_bytes=8"):
        ug.upcast_plan(1, 8, 8, weight_bytes=8)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(17, 48, generator=gen)
    x = torch.randn(1, 48, generator=gen)
    assert torch.equal(torch.ops.dsv41.linear_upcast(x, w), torch.nn.functional.linear(x, w))


def test_plan_splits_the_head_and_keeps_small_weights_whole():
    head = ug.upcast_plan(1, 129280, 4096)
    assert head["SPLIT_K"] > 1 and head["grid"][0] * head["grid"][1] >= 4096
    small = ug.upcast_plan(1, 256, 64)
    assert small["SPLIT_K"] == 1 and small["grid"] == (2, 1, 1)
    assert ug.upcast_plan(8, 64, 64)["BLOCK_N"] == 64
    with pytest.raises(ValueError, match="block_k"):
        ug.upcast_plan(1, 8, 8, block_k=48)
