"""Review (session 34): an FP4 UE8M0 1x32 quantiser with another amax floor is taken for dsv41's rule.

Found by a review helper; failed at 9d91f76 and before the fix in session 34 (the probes now hold a block of
amax 2^-20 and an all-zero block): `_quant_probes` draws per-32-block magnitudes 2^-8 .. 2^8 (amax of a block
>= ~2^-8 * 1) and its one zero half never empties a 32-block, so the amax floor of the quantiser is never probed. A
quantiser whose floor is DeepSeek's usual `clamp(min=1e-4)` (the FP8 act_quant floor) instead of dsv41's
`6 * 2^-126` matches `quantize_fp4_ue8m0_1x32` on both probes, is fused into `dsv41::rope_fp4_fake_quant`, and every
block whose amax is below 1e-4 then gets a finer scale than the model's: eager rounds those values to zero, compiled
keeps them. The new float32-held form (`Quant.fake_widened`) inherits the hole; both forms are checked.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from dsv41.passes.testing import eager_and_compiled, ops_after
from dsv41.ref.formats import dequantize_fp4_ue8m0_1x32, e2m1_round, pack_e2m1, ue8m0_exponent, ue8m0_to_float
from test_indexer_float32_queries import rotate  # noqa: E402  the same RoPE / key decode

ROT = 16


def quantize_floor_1e4(x):
    """FP4 E2M1 with UE8M0 1x32 scales, like `quantize_fp4_ue8m0_1x32` but with the amax floored at 1e-4."""
    shp = x.shape
    xb = x.float().view(*shp[:-1], shp[-1] // 32, 32)
    amax = xb.abs().amax(-1).clamp(min=1e-4)
    e = ue8m0_exponent(amax / 6.0)
    codes = e2m1_round(xb / ue8m0_to_float(e)[..., None]).view(shp)
    return pack_e2m1(codes), e


class FlooredQuery(nn.Module):
    def __init__(self, decode_dtype):
        super().__init__()
        self.decode_dtype = decode_dtype

    def forward(self, q, cos, sin):
        y = rotate(q, cos[:, :, None], sin[:, :, None])
        packed, exps = quantize_floor_1e4(y)
        return dequantize_fp4_ue8m0_1x32(packed, exps, self.decode_dtype or y.dtype)


def reference(q, cos, sin):
    """float64: the floored rule written out (scale 2^ceil(log2(max(amax, 1e-4) / 6)), RNE onto E2M1)."""
    y = rotate(q, cos[:, :, None], sin[:, :, None]).double()
    yb = y.view(*y.shape[:-1], -1, 32)
    scale = torch.exp2(torch.ceil(torch.log2(yb.abs().amax(-1).clamp(min=1e-4) / 6)))[..., None]
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    v = (yb / scale).clamp(-6, 6)
    # nearest grid value, ties to the even grid index (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, ...)
    a = v.abs()
    hi = torch.bucketize(a, grid).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - grid[lo], grid[hi] - a
    mag = grid[torch.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)]
    return (torch.sign(v) * mag * scale).reshape(y.shape)


def inputs():
    g = torch.Generator().manual_seed(34)
    q = torch.randn(1, 2, 4, 64, generator=g)
    q[0, 0] *= 1e-6  # one token whose blocks all have amax < 1e-4: the floor decides their scale
    ang = torch.rand(1, 2, ROT // 2, generator=g) * 6.0
    return q.to(torch.bfloat16), ang.cos(), ang.sin()


@pytest.fixture(scope="module", params=[torch.float32, None], ids=["float32_decode", "bf16_decode"])
def compiled(request):
    args = inputs()
    model = FlooredQuery(request.param)
    eager, out, graphs = eager_and_compiled(model, args)
    return args, eager, out, ops_after(graphs[-1])


def test_eager_is_the_floored_rule(compiled):
    args, eager, _, _ = compiled
    assert torch.equal(eager.double(), reference(*args).to(eager.dtype).double())


def test_compiled_equals_eager(compiled):
    _, eager, out, ops = compiled
    bad = (eager != out).sum().item()
    assert bad == 0, (f"{bad} values differ: the quantiser with a 1e-4 amax floor was fused as dsv41's rule", ops)
