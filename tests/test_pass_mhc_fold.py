"""Family `mhc_fold` on a hyper-connection block written here from the mHC paper's equations, not dsv41's code.

Two residual-mixing sites around two small sublayers: the first site's expand writes H2 and the second site's
coefficients are computed from H2, so the backend should run that expand and those coefficients as one
`dsv41::mhc_expand_mixes`. The eager module in float64 is the reference for the compiled float32 one.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from dsv41.passes.testing import capture_graphs, ops_after

D, STREAMS = 48, 4


def sinkhorn_columns_last(logits, rounds, eps):
    p = torch.softmax(logits, dim=-1) + eps
    p = p / (p.sum(dim=-2, keepdim=True) + eps)
    for _ in range(rounds - 1):
        p = p / (p.sum(dim=-1, keepdim=True) + eps)
        p = p / (p.sum(dim=-2, keepdim=True) + eps)
    return p


class Site(nn.Module):
    """One mHC site's parameters and its three mixes (pre-weights, post-weights, stream mix)."""

    def __init__(self, g):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(24, STREAMS * D, generator=g) * 0.05)
        self.bias = nn.Parameter(torch.randn(24, generator=g) * 0.1)
        self.gain = nn.Parameter(torch.tensor([0.9, 1.1, 2.0]))

    def forward(self, H, proj=None):
        flat = H.flatten(start_dim=2).to(self.proj.dtype)  # FP32, or float64 for the reference
        logits = torch.matmul(flat, (self.proj if proj is None else proj).t())
        logits = logits * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + 1e-20)
        a = torch.sigmoid(logits[..., :4] * self.gain[0] + self.bias[:4]) + 1e-6
        b = 2.0 * torch.sigmoid(logits[..., 4:8] * self.gain[1] + self.bias[4:8])
        m = (logits[..., 8:] * self.gain[2] + self.bias[8:]).unflatten(-1, (4, 4))
        return a, b, sinkhorn_columns_last(m, 20, 1e-6)


class HyperPair(nn.Module):
    def __init__(self, late_proj=False, shifted=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.s1, self.s2 = Site(g), Site(g)
        self.norm1 = nn.Parameter(1 + 0.1 * torch.randn(D, generator=g))
        self.norm2 = nn.Parameter(1 + 0.1 * torch.randn(D, generator=g))
        self.f1, self.f2 = nn.Linear(D, D), nn.Linear(D, D)
        self.late_proj, self.shifted = late_proj, shifted
        if late_proj:
            self.delta = nn.Parameter(torch.zeros(24, STREAMS * D))

    @staticmethod
    def gather(H, a, w):
        x = torch.einsum("bts,btsd->btd", a.to(H.dtype), H)
        xf = x.to(w.dtype)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-20) * w).to(H.dtype)

    @staticmethod
    def scatter(y, H, b, m):
        mixed = torch.einsum("btij,btid->btjd", m, H.to(m.dtype))
        return (b.unsqueeze(-1) * y.to(m.dtype).unsqueeze(2) + mixed).to(H.dtype)

    def forward(self, H):
        a, b, m = self.s1(H)
        H2 = self.scatter(self.f1(self.gather(H, a, self.norm1)), H, b, m)
        # late_proj: the second site's projection is computed only now, after the first site's expand.
        proj = self.s2.proj + self.delta if self.late_proj else None
        a2, b2, m2 = self.s2(H2, proj)
        if self.shifted:  # DeepSeek-V4.1's order: collapse with the earlier site's weights, hand a2 to the next block
            return self.scatter(torch.tanh(self.f2(self.gather(H2, a, self.norm2))), H2, b2, m2), a2
        return self.scatter(torch.tanh(self.f2(self.gather(H2, a2, self.norm2))), H2, b2, m2)


def _compile(model, H, **options):
    torch._dynamo.reset()
    with capture_graphs() as graphs, torch.no_grad():  # inference: no activations kept for a backward
        out = torch.compile(model, backend="dsv41", options=options)(H)
    return out, ops_after(graphs, namespace="dsv41")


@pytest.fixture(scope="module")
def H():
    return torch.randn(2, 3, STREAMS, D, generator=torch.Generator().manual_seed(1))


def test_expand_and_next_coefficients_become_one_op(H):
    model = HyperPair()
    want_model = copy.deepcopy(model).double()
    out, ops = _compile(model, H)
    assert ops["dsv41.mhc_expand_mixes"] == 1
    assert ops["dsv41.mhc_mixes"] == 1 and ops["dsv41.mhc_expand"] == 1  # the first site's, the last expand
    with torch.no_grad():
        want = want_model(H.double())
    err = (out.double() - want).abs().max().item()
    assert err <= 1e-4 * (1 + want.abs().max().item()), err


def test_switching_the_family_off_keeps_two_ops(H):
    model = HyperPair()
    out, ops = _compile(model, H, disable=["mhc_fold"])
    assert ops["dsv41.mhc_expand_mixes"] == 0 and ops["dsv41.mhc_mixes"] == 2 and ops["dsv41.mhc_expand"] == 2
    fused, _ = _compile(model, H)
    assert (out - fused).abs().max().item() <= 1e-5 * (1 + out.abs().max().item())


def test_projection_computed_after_the_expand_is_a_reported_near_miss(H, tmp_path):
    report = tmp_path / "report.json"
    model = HyperPair(late_proj=True)
    want_model = copy.deepcopy(model).double()
    out, ops = _compile(model, H, report=str(report))
    assert ops["dsv41.mhc_expand_mixes"] == 0 and ops["dsv41.mhc_mixes"] == 2
    text = json.dumps(json.loads(report.read_text()))
    assert "operand_order" in text and "mhc_fold" in text
    with torch.no_grad():
        want = want_model(H.double())
    assert (out.double() - want).abs().max().item() <= 1e-4 * (1 + want.abs().max().item())


def test_coefficients_first_needed_after_a_gemv_fold_only_without_the_stream_schedule(H, tmp_path):
    # In the shifted order the second site's coefficients wait for f2's matmul anyway. With the side-stream schedule
    # applied (streams=True; on CPU its fork / join are no-ops) the mixes can hide beside that matmul, so the fold
    # is declined with a reason; without it the mixes is on the main stream either way and folds.
    report = tmp_path / "report.json"
    model = HyperPair(shifted=True)
    want_model = copy.deepcopy(model).double()
    with torch.no_grad():
        want, want_a2 = want_model(H.double())
    for streams, folds in ((True, 0), (False, 1)):
        (out, a2), ops = _compile(model, H, report=str(report), streams=streams)
        assert ops["dsv41.mhc_expand_mixes"] == folds and ops["dsv41.mhc_mixes"] == 2 - folds
        misses = json.loads(report.read_text())["families"]["mhc_fold"]["near_misses"]
        assert [m["check"] for m in misses] == ["overlappable"] * (1 - folds), misses
        assert (out.double() - want).abs().max().item() <= 1e-4 * (1 + want.abs().max().item())
        assert (a2.double() - want_a2).abs().max().item() <= 1e-5
