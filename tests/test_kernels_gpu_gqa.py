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
@pytest.mark.parametrize("dot", [False, True], ids=["fma", "dot"])
def test_llama_shapes_match_float64(hq, hkv, d, s, m, masking, dot, pdl):
    _, q, k, v = R._qkv(1, hq, hkv, m, s, d, torch.bfloat16, s)
    valid = s - 17
    if masking == "bool":
        mask = (torch.arange(s)[None, :] < valid)[None, None].expand(1, 1, m, s)
    else:
        mask = torch.where(torch.arange(s) < valid, 0.0, float("-inf")).to(torch.bfloat16)[None, None, None]
    got = ga.triton_gqa_decode_attention(q.cuda(), k.cuda(), v.cuda(), mask.cuda(), dot=dot)
    R._close(got.cpu(), R.attention64(q, k, v, mask if masking == "bool" else mask.float()), v)


RG = load_reference("test_kernels_rope_gqa")


@pytest.mark.parametrize("d, t, m, layout", [(64, 640, 1, 0), (128, 1024, 1, 1), (64, 333, 4, 2)])
@pytest.mark.parametrize("dot", [False, True], ids=["fma", "dot"])
def test_rope_prologue_at_llama_shapes(d, t, m, layout, dot, pdl):
    """dsv41::rope_gqa_decode_attention: the new rows land in the caches and the output matches float64, with the
    new positions in a split other than the last (the writer), so another split must use them in place."""
    from dsv41.kernels import rope_gqa as rg
    pos = list(range(100, 100 + m))
    q, k, v, cos, sin, pos_t, kc, vc = RG._case(1, 32, 8, m, t, d, layout, torch.bfloat16, t, pos)
    mask = (torch.arange(t) < pos[-1] + 1).expand(1, 1, m, t).clone()
    want, kc_want, vc_want = RG._expected(q, k, v, cos, sin, pos_t, kc, vc, layout, mask, d ** -0.5, torch.bfloat16)
    kc_d, vc_d = kc.cuda(), vc.cuda()
    got = rg.triton_rope_gqa_decode_attention(q.cuda(), k.cuda(), v.cuda(), cos.cuda(), sin.cuda(), pos_t.cuda(),
                                              kc_d, vc_d, layout, False, mask.cuda(), dot=dot)
    torch.cuda.synchronize()
    for have, ref in ((kc_d.cpu(), kc_want), (vc_d.cpu(), vc_want)):
        diff = (have.double() - ref.double()).abs()
        assert (diff <= torch.finfo(torch.bfloat16).eps * ref.double().abs() + 1e-6).all()
    err = (got.cpu().double() - want).abs().max().item()
    assert err <= 2 ** -6 * vc_want.double().abs().max().item(), err
