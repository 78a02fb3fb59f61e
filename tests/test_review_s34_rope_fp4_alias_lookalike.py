"""Review (session 34): `rope_fp4.match_quant`'s `fake_aliases` replace a look-alike of the fake-quantised values.

Found by a review helper, fixed in session 34 (only view chains of the first hit are aliases). `find(..., values=True)` collected EVERY closure node whose probe values equal the fake-quantised reference, keeps
the one of y's shape as `fake` and returns the others as `fake_aliases`; `_fuse` then points every alias read
outside the quantiser at the fused op's output. But a node that equals the fake values on the probes only is not an
alias: `qf.clamp(-1e4, 1e4)` is the identity on the probes (their magnitudes stay below 6 * 2^8 = 1536), so it is
collected, and its readers get the unclamped op output. Before this change only the first hit was taken (the real
fake node) and the clamp stayed, reading the op's output: compiled == eager.

Both the new float32-held form (`Quant.fake_widened`, a bf16 y decoded to float32) and the plain bf16 form fail.
The eager model is the reference: the second output must be clamped to +-1e4 and equal eager's bits.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from dsv41.passes.testing import eager_and_compiled, ops_after
from dsv41.ref.formats import dequantize_fp4_ue8m0_1x32, quantize_fp4_ue8m0_1x32

ROT = 16


def rotate(x, cos, sin):
    """Interleaved-pair RoPE on the last ROT channels, computed in float32 and rounded to x.dtype."""
    keep, rot = x[..., :-ROT], x[..., -ROT:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((keep, turned.to(x.dtype)), dim=-1)


class QueryWithClampedCopy(nn.Module):
    """RoPE -> FP4 fake quantisation; the values are returned as they are and, clamped to +-1e4, a second time."""

    def __init__(self, decode_dtype):
        super().__init__()
        self.decode_dtype = decode_dtype

    def forward(self, q, cos, sin):
        y = rotate(q, cos[:, :, None], sin[:, :, None])
        packed, exps = quantize_fp4_ue8m0_1x32(y)
        qf = dequantize_fp4_ue8m0_1x32(packed, exps, self.decode_dtype or y.dtype)
        return qf * 2, qf.clamp(-1e4, 1e4)


def inputs():
    g = torch.Generator().manual_seed(34)
    q = torch.randn(1, 2, 4, 64, generator=g)
    q[0, 0, 1, :32] *= 1e6  # one 32-block far above the clamp (its fake values reach ~1e6)
    ang = torch.rand(1, 2, ROT // 2, generator=g) * 6.0
    return q.to(torch.bfloat16), ang.cos(), ang.sin()


@pytest.fixture(scope="module", params=[torch.float32, None], ids=["float32_decode", "bf16_decode"])
def compiled(request):
    args = inputs()
    model = QueryWithClampedCopy(request.param)
    eager, out, graphs = eager_and_compiled(model, args)
    return eager, out, ops_after(graphs[-1])


def test_the_quantiser_is_fused(compiled):
    _, _, ops = compiled
    assert ops.get("dsv41.rope_fp4_fake_quant.default") == 1, ops


def test_the_clamped_copy_stays_clamped(compiled):
    eager, out, ops = compiled
    assert float(eager[1].float().abs().max()) <= 1e4
    assert float(out[1].float().abs().max()) <= 1e4, (
        "the clamp was replaced by the fused op's unclamped output (a probe look-alike taken as a fake alias)", ops)


def test_compiled_equals_eager(compiled):
    eager, out, _ = compiled
    for e, o in zip(eager, out):
        assert e.dtype == o.dtype and torch.equal(e, o)
