"""GPU tests of dsv41::linear_fp8_scaled (dsv41/kernels/gemv_scaled.py) and of the FP8 checkpoint layouts reaching
it through `torch.compile(backend="dsv41")`, at DeepSeek-V3 decode shapes.

Run on a CUDA machine: `python -m pytest tests/test_kernels_gpu_fp8_scaled.py -q`. Skipped without a CUDA GPU and
under TRITON_INTERPRET=1 (these tests are about the compiled kernel; the interpreter cases are in
tests/test_kernels_gemv_scaled.py).
References: the float64 model of tests/test_kernels_gemv_scaled.py (imported by path), evaluated on the GPU in
row chunks; tolerance as stated there (2^-16 sum|x w| + half an output ulp). Every launcher output and workspace
is poisoned with NaN first (an element the kernel never writes shows). The GPU's E4M3 conversion must give NaN for
0x7F / 0xFF (the kernel relies on it: the interpreter's does not, and the CPU tests cannot show it).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from gpu_harness import load_reference, skip_unless_compiled_gpu  # noqa: E402
from interp_harness import poison_outputs  # noqa: E402

skip_unless_compiled_gpu()

import dsv41.kernels as kernels  # noqa: E402
from dsv41.kernels import gemv_scaled as gs  # noqa: E402

G = load_reference("test_kernels_gemv_scaled")
DEV = torch.device("cuda")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
#: (name, N, K) of DeepSeek-V3 decode GEMVs (q_a / kv_a down-projections, o_proj, q_b up-projection, dense FFN down).
SHAPES = [("q_a", 2048, 7168), ("o_proj", 7168, 2048), ("q_b", 24576, 1536), ("ffn_down", 7168, 18432)]
#: (name, (bn, bk), UE8M0 scales, x dtype, weight_dtype, scale_cast): the checkpoint layouts and eager roundings.
LAYOUTS = [("fp32_128x128_bf16", (128, 128), False, BF16, BF16, F32),
           ("fp32_1x128_f32", (1, 128), False, F32, F32, F32),
           ("fp32_32x32_f16", (32, 32), False, F16, F16, F16),
           ("ue8m0_128x128_bf16", (128, 128), True, BF16, BF16, BF16)]


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    poison_outputs(monkeypatch, gs)
    yield
    kernels.set_pdl(False)


def _layout(n, k, bn, bk, ue8m0, seed, nan_codes=False):
    codes, scale = G.make_layout(n, k, bn, bk, ue8m0, torch.Generator().manual_seed(seed), nan_codes)
    return codes.to(DEV), scale.to(DEV)


def _check(y, x, codes, scale, bn, bk, weight_dtype, scale_cast):
    """Compare with the float64 model on the GPU in row chunks (a whole 24576 x 1536 float64 weight is 300 MB)."""
    for n0 in range(0, codes.shape[0], 4096):
        n1 = min(codes.shape[0], n0 + 4096)
        # a chunk starting on a block boundary keeps the block grid: rows n0 .. n1 read scale rows n0 // bn ..
        s = scale[n0 // bn: -(-n1 // bn)]
        y64, abs64 = G.ref_linear(x, codes[n0:n1], s, bn, bk, weight_dtype, scale_cast)
        G.assert_close_to_ref(y[..., n0:n1], y64, abs64)


@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_gemv_matches_float64_reference_at_deepseek_v3_shapes(shape, layout, m):
    _, n, k = shape
    _, (bn, bk), ue8m0, dtype, weight_dtype, scale_cast = layout
    codes, scale = _layout(n, k, bn, bk, ue8m0, seed=n + k + m)
    x = (torch.randn(m, k, device=DEV) * 2).to(dtype)
    y = torch.ops.dsv41.linear_fp8_scaled(x, codes, scale, bn, bk, weight_dtype, scale_cast)
    assert y.shape == (m, n) and y.dtype == dtype
    _check(y, x, codes, scale, bn, bk, weight_dtype, scale_cast)


def test_nan_codes_odd_shapes_and_a_strided_scale():
    # N, K not multiples of the block (ceil grid), the two NaN encodings, a scale read through transposed strides.
    codes, scale = _layout(1000, 1100, 128, 128, False, seed=3)
    codes[7, 11], codes[900, 1099] = 0x7F, 0xFF
    strided = scale.t().contiguous().t()
    for m in (1, 3, 8):
        x = torch.randn(m, 1100, device=DEV).to(BF16)
        y = gs.triton_linear_fp8_scaled(x, codes, strided, 128, 128, BF16, F32)
        assert torch.isnan(y[:, 7]).all() and torch.isnan(y[:, 900]).all()
        assert int(torch.isnan(y).any(0).sum()) == 2
        _check(y, x, codes, scale, 128, 128, BF16, F32)


def test_pdl_launches_in_a_cuda_graph_give_the_plain_launch_bits_and_leave_counters_at_zero():
    from dsv41.kernels import _common
    codes, scale = _layout(2048, 7168, 128, 128, False, seed=5)  # 16 row tiles: split K
    x = torch.randn(1, 7168, device=DEV).to(BF16)
    assert gs.scaled_plan(1, 2048, 7168, 128)["SPLIT_K"] > 1

    def step():
        return (gs.triton_linear_fp8_scaled(x, codes, scale, 128, 128, BF16, F32),)
    want = step()[0].clone()
    kernels.set_pdl(True)
    assert torch.equal(step()[0], want)
    from gpu_harness import assert_graph_replay_equals
    assert_graph_replay_equals(lambda: step() + step(), (want, want))
    assert int(_common.COUNTERS[x.device.index].abs().sum()) == 0


def test_more_than_eight_rows_take_the_dequantise_then_cublas_path():
    codes, scale = _layout(512, 1024, 128, 128, False, seed=7)
    x = torch.randn(20, 1024, device=DEV)
    y = torch.ops.dsv41.linear_fp8_scaled(x, codes, scale, 128, 128, F32, F32)
    _check(y, x, codes, scale, 128, 128, F32, F32)


class _HfFp8Linear(torch.nn.Module):
    """FP8 checkpoint layer: `weight` float8_e4m3fn [N, K], `weight_scale_inv` float32 per 128x128 block."""

    def __init__(self, n, k):
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        codes, scale = G.make_layout(n, k, 128, 128, False, gen)
        self.weight = torch.nn.Parameter(codes.view(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)

    def forward(self, x):
        n, k = self.weight.shape
        s = self.weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        return F.linear(x, (self.weight.float() * s).to(x.dtype))


@pytest.mark.parametrize("pdl", [False, True])
def test_compiled_checkpoint_layer_fuses_and_reads_the_float8_weight_in_place(pdl):
    import dsv41
    from torch._inductor.utils import run_and_get_code

    kernels.set_pdl(pdl)
    model = _HfFp8Linear(7168, 2048 + 64).to(DEV).eval()  # K not a multiple of 128
    x = torch.randn(1, 2048 + 64, device=DEV).to(BF16)
    with torch.no_grad():
        torch._dynamo.reset()
        y, code = run_and_get_code(torch.compile(model, backend="dsv41", dynamic=False), x)
    fam = dsv41.last_report().to_dict()["families"]["dispatch"]
    assert [s["pattern"] for s in fam["sites"]] == ["linear_fp8_scaled(fp32 128x128)"] and not fam["near_misses"]
    text = "\n".join(code)
    call = next(line for line in text.splitlines() if "= torch.ops.dsv41.linear_fp8_scaled.default(" in line)
    codes_arg = load_reference("test_pass_dispatch_fp8_layouts")._call_args(call)[1]
    assert re.match(r"(aten\.view\.dtype\(|reinterpret_tensor\()?arg\d+_\d+\b", codes_arg), call
    codes = model.weight.view(torch.uint8)
    _check(y, x, codes, model.weight_scale_inv, 128, 128, BF16, F32)
    assert math.isfinite(float(y.float().abs().max()))
