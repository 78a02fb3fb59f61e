"""Tests of dsv41::c2_norm_rope_fp4_store / c2_pool_norm_rope_fp4_store (dsv41/kernels/c2_compressor.py).

References written here: the pair pooling and RMSNorm in float64 (MODEL.md §2.2, §2.6), cast to the latent
dtype; RoPE and FP4 from tests/test_kernels_rope_fp4.py (float64 grids, independent of dsv41/model). The
latent must agree with the float64 reference to ~an ulp of its dtype (the kernel's exp / sqrt / reduction
order differ from PyTorch's); the written codes and scales must be BIT-exact for the latent the kernel
returned (RoPE + FP4 of that latent), at exactly the rows asked for, and no other row may change.

Interpreter tests (`@interpreted`) run in a child pytest with TRITON_INTERPRET=1 unless this process was
started with it; see tests/test_kernels_quant_gemv.py for why.
"""

from __future__ import annotations

import pytest
import torch

from interp_harness import IN_INTERPRETER, InterpreterHarness, poison_outputs  # noqa: F401
from test_kernels_rope_fp4 import ref_fp4_quant, ref_rope

from dsv41.kernels import c2_compressor as c2  # noqa: E402

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()

MODES = ((16, True), (32, False))
# (B, T, D, R/2, cache rows): odd T, a D whose 1x16 blocks need 3 programs (20 blocks, 8 per program).
CASES = [(2, 3, 64, 8, 5), (1, 1, 320, 16, 4), (3, 2, 96, 4, 7)]


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Make every output the launcher allocates start as NaN (floats) or 0xAB (bytes)."""
    poison_outputs(monkeypatch, c2)


def ref_norm(u64: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return u64 / torch.sqrt((u64 ** 2).mean(-1, keepdim=True) + eps) * w.double()


def ref_pool(k, g, pk, pg):
    k, g, pk, pg = (t.double() for t in (k, g, pk, pg))
    m = torch.maximum(pg, g)
    e0, e1 = torch.exp(pg - m), torch.exp(g - m)
    return (e0 * pk + e1 * k) / (e0 + e1)


def _setup(case, dtype, block, seed):
    b, t, d, rh, n = case
    gen = torch.Generator().manual_seed(seed)
    w = (0.5 + torch.rand(d, generator=gen)).to(dtype)
    ang = torch.rand(b, t, rh, generator=gen) * 6
    rows = torch.randint(0, n, (b, t), generator=gen)
    if b * t > 2:
        rows[0, 0] = n + 3  # outside the cache: skipped
        rows[-1, -1] = -1  # negative: skipped
    codes = torch.full((b, n, d // 2), 0x5A, dtype=torch.uint8)
    scales = torch.full((b, n, d // block), 0x5A, dtype=torch.uint8)
    return gen, w, ang.cos(), ang.sin(), rows, codes, scales


def _check_written(latent, cos, sin, block, e4m3, rows, codes, scales):
    want_c, want_s, _ = ref_fp4_quant(ref_rope(latent, cos, sin), block, e4m3)
    b, t = rows.shape
    touched = torch.zeros(codes.shape[:2], dtype=torch.bool)
    for i in range(b):
        for j in range(t):
            r = int(rows[i, j])
            if 0 <= r < codes.shape[1]:
                touched[i, r] = True
                # The last token writing a row wins in this test's row choice only if rows are unique.
                if (rows[i] == r).sum() == 1:
                    assert torch.equal(codes[i, r], want_c[i, j]), (i, j)
                    assert torch.equal(scales[i, r], want_s[i, j]), (i, j)
    assert (codes[~touched] == 0x5A).all() and (scales[~touched] == 0x5A).all()
    assert touched.any()


@interpreted
@pytest.mark.parametrize("mode", MODES, ids=["e4m3x16", "ue8m0x32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_triton_norm_rope_fp4_store(case, dtype, mode, poisoned_outputs):
    block, e4m3 = mode
    gen, w, cos, sin, rows, codes, scales = _setup(case, dtype, block, 1)
    b, t, d, _, _ = case
    x = (torch.randn(b, t, d, generator=gen) * 3).to(dtype)
    lat = c2.triton_c2_norm_rope_fp4_store(x, w, 1e-6, cos, sin, block, e4m3, codes, scales, rows)
    assert lat.dtype == dtype and lat.shape == x.shape
    ref = ref_norm(x.double(), w, 1e-6)
    tol = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(lat.double(), ref.to(dtype).double(), rtol=tol, atol=tol * float(ref.abs().max()))
    _check_written(lat, cos, sin, block, e4m3, rows, codes, scales)


@interpreted
@pytest.mark.parametrize("mode", MODES, ids=["e4m3x16", "ue8m0x32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_triton_pool_norm_rope_fp4_store(case, dtype, mode, poisoned_outputs):
    block, e4m3 = mode
    gen, w, cos, sin, rows, codes, scales = _setup(case, dtype, block, 2)
    b, t, d, _, _ = case
    k, g, pk, pg = (torch.randn(b, t, d, generator=gen) * 2 for _ in range(4))
    pg[0, 0] = float("-inf")  # the empty pending state: the latent is norm(k)
    pk[0, 0] = 0.0
    lat = c2.triton_c2_pool_norm_rope_fp4_store(k, g, pk, pg, w, 1e-6, dtype, cos, sin, block, e4m3, codes, scales,
                                                rows)
    assert lat.dtype == dtype
    z = ref_pool(k, g, pk, pg).to(dtype)
    ref = ref_norm(z.double(), w, 1e-6)
    tol = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(lat.double(), ref.to(dtype).double(), rtol=tol, atol=tol * float(ref.abs().max()))
    torch.testing.assert_close(lat[0, 0].double(), ref_norm(k[0, 0].to(dtype).double(), w, 1e-6).to(dtype).double(),
                               rtol=tol, atol=tol * float(ref.abs().max()))
    _check_written(lat, cos, sin, block, e4m3, rows, codes, scales)


@interpreted
def test_triton_agrees_with_the_cpu_op_and_the_model_compressor(poisoned_outputs):
    """The CPU op (the model's own math) and the Triton path write the same rows for the same inputs."""
    from dsv41.model.csa import Compressor

    gen = torch.Generator().manual_seed(4)
    k, g, pk, pg = (torch.randn(2, 3, 64, generator=gen) for _ in range(4))
    w = 0.5 + torch.rand(64, generator=gen)
    ang = torch.rand(2, 3, 8, generator=gen)
    rows = torch.tensor([[0, 1, 2], [3, 4, 5]])
    outs = []
    for fn in (c2.reference_c2_pool_norm_rope_fp4_store, c2.triton_c2_pool_norm_rope_fp4_store):
        cc = torch.zeros(2, 6, 32, dtype=torch.uint8)
        sc = torch.zeros(2, 6, 4, dtype=torch.uint8)
        lat = fn(k, g, pk, pg, w, 1e-20, torch.float32, ang.cos(), ang.sin(), 16, True, cc, sc, rows)
        outs.append((lat, cc, sc))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-6, atol=1e-6)
    # An ulp in the latent can move one FP4 code in rare cases; nearly all bytes must agree.
    assert (outs[1][1] != outs[0][1]).float().mean() < 0.02 and torch.equal(outs[1][2], outs[0][2])
    assert Compressor.__doc__  # the reference follows csa.Compressor (pooling) and rms_norm


def test_bad_arguments_raise_before_launch():
    x = torch.randn(1, 2, 64)
    cos = sin = torch.zeros(1, 2, 8)
    cc = torch.zeros(1, 4, 32, dtype=torch.uint8)
    sc = torch.zeros(1, 4, 4, dtype=torch.uint8)
    rows = torch.zeros(1, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="weight"):
        c2.reference_c2_norm_rope_fp4_store(x, torch.ones(32), 1e-6, cos, sin, 16, True, cc, sc, rows)
    with pytest.raises(ValueError, match="FP4 mode"):
        c2.reference_c2_norm_rope_fp4_store(x, torch.ones(64), 1e-6, cos, sin, 16, False, cc, sc, rows)
    with pytest.raises(TypeError):
        c2.reference_c2_pool_norm_rope_fp4_store(x, x, x, x.double(), torch.ones(64), 1e-6, torch.float32, cos, sin,
                                                 16, True, cc, sc, rows)
    with pytest.raises(ValueError, match="rows"):
        c2.reference_c2_norm_rope_fp4_store(x, torch.ones(64), 1e-6, cos, sin, 16, True, cc, sc, rows[:, :1])
