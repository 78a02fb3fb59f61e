"""Review (session 34): at one query row (B = T = 1, a batch-1 decode step) any visibility rule passes as `t < n`.

Found by a review helper; failed at 9d91f76 and before the fix in session 34 (`score_probes(partial=True)`: a
second probe hides rows even for one query row; the float32-query form is the one the 160-node lookback of
`reads_index_keys` was widened for, so the change keeps this hole open for it). `score_probes` sets the LAST n_visible to N (every row visible) and the
FIRST to 0 only when there are several; with B * T = 1 both probes hold n_visible = N, so the rule that decides
which rows are hidden is never exercised. A score chain that keeps rows t <= n_visible (the zoo's `badvis`, a
near-miss at B = 2) is fused into `dsv41::indexer_scores` at B = T = 1, and the compiled scores hide row n_visible,
which eager (and the float64 reference below) keep.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dsv41.kernels  # noqa: F401  registers the dsv41:: ops
from dsv41.passes.testing import eager_and_compiled, ops_after
from dsv41.ref.formats import dequantize_fp4_ue8m0_1x32, quantize_fp4_ue8m0_1x32
from test_indexer_float32_queries import rotate, table_keys, E2M1  # noqa: E402  the same RoPE / key decode

HEADS, DIM, ROWS, ROT, VISIBLE = 8, 64, 40, 16, 33


class InclusiveScores(nn.Module):
    """Index scores whose visibility keeps rows t <= n_visible (not the op's t < n_visible)."""

    def __init__(self, query: str):
        super().__init__()
        self.query = query

    def forward(self, q, cos, sin, head_w, codes, scales, visible):
        if self.query == "float32_fp4":  # the torch 2.11 form: FP4 query decoded straight to float32
            packed, exps = quantize_fp4_ue8m0_1x32(rotate(q, cos[:, :, None], sin[:, :, None]))
            qf = dequantize_fp4_ue8m0_1x32(packed, exps, torch.float32)
        else:  # a plain bf16 query
            qf = q.float()
        logits = torch.einsum("bthd,bnd->bthn", qf, table_keys(codes, scales))
        s = (logits.relu() * head_w.float()[..., None]).sum(2)
        seen = torch.arange(codes.shape[1], device=codes.device) <= visible[..., None]
        return torch.where(seen, s, float("-inf"))


def inputs():
    g = torch.Generator().manual_seed(34)
    q = torch.randn(1, 1, HEADS, DIM, generator=g).to(torch.bfloat16)
    ang = torch.rand(1, 1, ROT // 2, generator=g) * 6.0
    head_w = torch.randn(1, 1, HEADS, generator=g).abs().to(torch.bfloat16)
    codes = torch.randint(0, 256, (1, ROWS, DIM // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(121, 131, (1, ROWS, DIM // 32), generator=g, dtype=torch.uint8)
    return q, ang.cos(), ang.sin(), head_w, codes, scales, torch.tensor([[VISIBLE]])


@pytest.fixture(scope="module", params=["float32_fp4", "bf16"])
def compiled(request):
    args = inputs()
    model = InclusiveScores(request.param)
    eager, out, graphs = eager_and_compiled(model, args)
    return eager, out, ops_after(graphs[-1])


def test_eager_keeps_rows_up_to_and_including_n_visible(compiled):
    eager, _, _ = compiled
    finite = torch.isfinite(eager[0, 0])
    assert finite[: VISIBLE + 1].all() and not finite[VISIBLE + 1:].any()


def test_compiled_hides_the_same_rows_as_eager(compiled):
    eager, out, ops = compiled
    assert torch.equal(torch.isinf(out), torch.isinf(eager)), (
        "row n_visible hidden: an inclusive visibility chain was fused into indexer_scores (t < n_visible)", ops)
