"""GPU tests of dsv41::gqa_decode_attention (dsv41/kernels/gqa_attention.py) at Llama-3.2-1B / 8B decode shapes
(32 query heads over 8 KV heads, head dim 64 / 128, contexts to 4,096), against the float64 attention of
tests/test_kernels_gqa_attention.py (imported by path), with a boolean and an additive mask; outputs poisoned.
Skipped without a CUDA GPU and under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from gpu_harness import load_reference, skip_unless_compiled_gpu  # noqa: E402
from interp_harness import poison_outputs  # noqa: E402

skip_unless_compiled_gpu()

from dsv41.kernels import gqa_attention as ga  # noqa: E402

R = load_reference("test_kernels_gqa_attention")


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    poison_outputs(monkeypatch, ga)


@pytest.fixture(params=[False, True], ids=["no_pdl", "pdl"])
def pdl(request):
    from dsv41.kernels import set_pdl
    set_pdl(request.param)
    yield request.param
    set_pdl(False)


@pytest.mark.parametrize("hq, hkv, d, s, m", [(32, 8, 64, 768, 1), (32, 8, 128, 4096, 1), (32, 8, 64, 333, 6)])
@pytest.mark.parametrize("masking", ["bool", "additive"])
def test_llama_shapes_match_float64(hq, hkv, d, s, m, masking, pdl):
    _, q, k, v = R._qkv(1, hq, hkv, m, s, d, torch.bfloat16, s)
    valid = s - 17
    if masking == "bool":
        mask = (torch.arange(s)[None, :] < valid)[None, None].expand(1, 1, m, s)
    else:
        mask = torch.where(torch.arange(s) < valid, 0.0, float("-inf")).to(torch.bfloat16)[None, None, None]
    got = ga.triton_gqa_decode_attention(q.cuda(), k.cuda(), v.cuda(), mask.cuda())
    R._close(got.cpu(), R.attention64(q, k, v, mask if masking == "bool" else mask.float()), v)
