"""The `row_argmax` family on greedy-decoding heads written three ways (CPU, real backend): `logits.argmax(-1)` on
the last position, `torch.argmax(..., dim=-1, keepdim=True)`, and `max(dim=-1).indices`'s cousin `argmax(dim=1)`
on a 2-D tensor; plus what it leaves alone (a small vocabulary, argmax over another dim, a flattened argmax, too many
rows). Compiled results must equal eager exactly, ties and NaN included."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import dsv41
from dsv41.passes.testing import eager_and_compiled, ops_after


class Head(nn.Module):
    def __init__(self, how: str, vocab: int):
        super().__init__()
        self.how = how
        self.proj = nn.Linear(32, vocab, bias=False)

    def forward(self, h):
        logits = self.proj(h)                       # [B, S, V]
        if self.how == "last":
            return logits[:, -1].argmax(-1)
        if self.how == "keepdim":
            return torch.argmax(logits[:, -1], dim=-1, keepdim=True)
        if self.how == "dim1":
            return logits[:, -1].argmax(dim=1)
        if self.how == "other_dim":
            return logits.argmax(dim=1)
        if self.how == "flat":
            return logits[:, -1].argmax()
        return logits.argmax(-1)                    # every position: B * S rows


@pytest.mark.parametrize("how, vocab, rows, fused", [
    ("last", 5000, (1, 3), True), ("keepdim", 5000, (2, 1), True), ("dim1", 4096, (1, 2), True),
    ("last", 1000, (1, 3), False), ("other_dim", 5000, (1, 3), False), ("flat", 5000, (1, 3), False),
    ("all", 5000, (3, 4), False),
])
def test_spellings(how, vocab, rows, fused):
    torch.manual_seed(0)
    mod = Head(how, vocab)
    with torch.no_grad():
        mod.proj.weight[3] = 1.0                      # rows 3 and 7: equal logits, larger than the others for
        mod.proj.weight[7] = 1.0                      # inputs of positive sum (most of these)
    h = torch.randn(*rows, 32) + 1.0
    want, got, graphs = eager_and_compiled(mod, (h,))
    assert sum(ops_after(g)["dsv41.row_argmax"] for g in graphs) == int(fused)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
    matches = [m for gr in dsv41.last_report().graphs for r in gr.records if r.family == "row_argmax"
               for m in r.matches]
    assert len(matches) == int(fused) and all(m.op == "dsv41::row_argmax" for m in matches)
