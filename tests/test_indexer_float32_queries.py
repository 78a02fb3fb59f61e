"""Index scores whose queries are FP4-quantised for real and decoded straight to float32 still fuse.

Torch 2.11's Inductor (the GPU machines' version) drops the bfloat16 rounding between a fake-quantised query and
its `.float()` (`pointless_convert`, before dsv41's passes), so the query reaching the score matmul is the float32
decode of RoPE'd FP4 codes, one long chain of bit arithmetic, instead of a bfloat16 tensor. Measured on an H100
(session 34): with that chain in front of it the score matmul looked too far from the FP4 key bytes, the chain was
not matched, and `small` spent 6 x 53 µs per decode step in an FP32 cuBLAS GEMM of the decoded keys.

Here the model is written in that float32 form on purpose (any torch version sees it), with two styles of key
decoding: a lookup table, and the bit arithmetic of `dsv41.ref.formats`. Each must become
`dsv41::rope_fp4_fake_quant` (the query) and `dsv41::indexer_scores` with nothing between them, and the compiled
scores must equal a float64 reference computed here from the codes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from dsv41.passes.testing import capture_graphs, ops_after
from dsv41.ref.formats import dequantize_fp4_ue8m0_1x32, quantize_fp4_ue8m0_1x32

BATCH, STEPS, HEADS, DIM, ROWS, ROT = 1, 1, 8, 64, 40, 16
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def rotate(x, cos, sin):
    """Interleaved-pair RoPE on the last ROT channels (GPT-J order)."""
    keep, rot = x[..., :-ROT], x[..., -ROT:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((keep, turned.to(x.dtype)), dim=-1)


def table_keys(codes, scales):
    lut = torch.tensor(E2M1 + [-v for v in E2M1], device=codes.device)
    nibbles = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2).long()
    return lut[nibbles] * torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)


class FloatQueryScores(nn.Module):
    """The scores of every key row, queries FP4 round-tripped in float32."""

    def __init__(self, keys: str):
        super().__init__()
        self.keys = keys

    def forward(self, q, cos, sin, head_w, codes, scales, visible):
        packed, exps = quantize_fp4_ue8m0_1x32(rotate(q, cos[:, :, None], sin[:, :, None]))
        qf = dequantize_fp4_ue8m0_1x32(packed, exps, torch.float32)
        if self.keys == "table":
            k = table_keys(codes, scales)
        else:
            k = dequantize_fp4_ue8m0_1x32(codes, scales, torch.float32)
        logits = torch.einsum("bthd,bnd->bthn", qf, k)
        s = (logits.relu() * head_w.float()[..., None]).sum(2)
        seen = torch.arange(codes.shape[1], device=codes.device) < visible[..., None]
        return torch.where(seen, s, float("-inf"))


def decode_codes(codes, scales):
    """float64 keys from the E2M1 nibbles (low nibble first) and UE8M0 exponents."""
    c = codes.long()
    nib = torch.stack((c & 15, c >> 4), dim=-1).flatten(-2)
    mag = torch.tensor(E2M1, dtype=torch.float64)[nib & 7]
    val = torch.where(nib >= 8, -mag, mag)
    return val * (2.0 ** (scales.double() - 127)).repeat_interleave(32, dim=-1)


def reference(q, cos, sin, head_w, codes, scales, visible):
    """float64 scores: the query's FP4 codes come from the model's own quantiser (its rounding is the model's
    definition), decoded and multiplied here in float64."""
    packed, exps = quantize_fp4_ue8m0_1x32(rotate(q, cos[:, :, None], sin[:, :, None]))
    qd, kd = decode_codes(packed, exps), decode_codes(codes, scales)
    s = (torch.einsum("bthd,bnd->bthn", qd, kd).clamp(min=0) * head_w.double()[..., None]).sum(2)
    rows = torch.arange(codes.shape[1])
    return s.masked_fill(rows >= visible[..., None], float("-inf"))


def inputs(dtype):
    g = torch.Generator().manual_seed(34)
    q = torch.randn(BATCH, STEPS, HEADS, DIM, generator=g).to(dtype)
    ang = torch.rand(BATCH, STEPS, ROT // 2, generator=g) * 6.0
    head_w = torch.randn(BATCH, STEPS, HEADS, generator=g).to(dtype)
    codes = torch.randint(0, 256, (BATCH, ROWS, DIM // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(121, 131, (BATCH, ROWS, DIM // 32), generator=g, dtype=torch.uint8)
    visible = torch.tensor([[ROWS - 7]])
    return q, ang.cos(), ang.sin(), head_w, codes, scales, visible


@pytest.fixture(scope="module", params=["table", "bits"])
def compiled(request):
    import dsv41

    args = inputs(torch.bfloat16)
    model = FloatQueryScores(request.param)
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        out = torch.compile(model, backend="dsv41", dynamic=False)(*args)
    return args, out, graphs, dsv41.last_report()


def test_the_score_chain_becomes_one_op(compiled):
    _, _, graphs, report = compiled
    ops = ops_after(graphs[-1])
    assert ops.get("dsv41.indexer_scores.default") == 1, (ops, report.to_dict()["families"]["indexer"])
    # the query's RoPE + FP4 round trip is one op too: its float32 decode is the op's bfloat16 values, upcast
    assert ops.get("dsv41.rope_fp4_fake_quant.default") == 1, (ops, report.to_dict()["families"]["rope_fp4"])
    glue = {k for k in ops if not k.startswith("dsv41.")} - {"aten.unsqueeze.default", "aten.expand.default"}
    assert glue == set(), ops
    leftover = [n for n in graphs[-1].graph.nodes if n.op == "call_function"
                and n.target in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default)]
    assert leftover == [], [str(n) for n in leftover]


def test_scores_equal_the_float64_reference(compiled):
    args, out, _, _ = compiled
    ref = reference(*args)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    hidden = torch.isinf(ref)
    assert torch.equal(torch.isinf(out) & (out < 0), hidden)
    scale = float(ref[~hidden].abs().max())
    err = float((out.double() - ref)[~hidden].abs().max())
    assert err <= 1e-5 * scale, (err, scale)
