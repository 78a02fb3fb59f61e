"""GPU tests of dsv41::rope_kv_store (dsv41/kernels/rope_kv.py) at Llama-3.2-1B / 8B decode shapes (32 query heads,
8 KV heads, head dim 64 / 128, caches of 4,096 positions), one and six new tokens, against the float64 spellings of
tests/test_kernels_rope_kv.py (imported by path), under PDL and without; q_rot NaN-poisoned. Skipped without a CUDA
GPU and under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from gpu_harness import load_reference, skip_unless_compiled_gpu  # noqa: E402

skip_unless_compiled_gpu()

from dsv41.kernels import rope_kv as rk  # noqa: E402
from dsv41.kernels import set_pdl  # noqa: E402

R = load_reference("test_kernels_rope_kv")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(rk, "_empty_strided", R.nan_strided)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("h, hkv, d, s", [(32, 8, 64, 1), (32, 8, 128, 1), (32, 8, 128, 6)])
def test_llama_shapes_interleaved_match_float64(h, hkv, d, s, pdl):
    set_pdl(pdl)
    try:
        q, k, v = R._qkv(1, s, h, hkv, d, torch.bfloat16, seed=1)
        ang = R._angles(1, s, d, base=500000.0, start=4000)
        t = 4096
        pos = torch.arange(4000, 4000 + s)
        kc = torch.randn(1, hkv, t, d).to(torch.bfloat16)
        vc = torch.randn(1, hkv, t, d).to(torch.bfloat16)
        kc_g, vc_g = kc.cuda(), vc.cuda()
        out = rk.triton_rope_kv_store(q.cuda(), k.cuda(), v.cuda(), ang.cos().float().cuda(), ang.sin().float().cuda(),
                                      pos.cuda(), kc_g, vc_g, 0, False, list(torch.empty(q.shape).stride()))
        torch.cuda.synchronize()
        tol = 2 * torch.finfo(torch.bfloat16).eps
        assert torch.allclose(out.cpu().double(), R._meta_complex(q, ang), rtol=tol, atol=4 * tol)
        assert torch.allclose(kc_g[:, :, pos].transpose(1, 2).cpu().double(), R._meta_complex(k, ang), rtol=tol,
                              atol=4 * tol)
        assert torch.equal(vc_g[:, :, pos].transpose(1, 2).cpu(), v)
        keep = torch.ones(t, dtype=torch.bool)
        keep[pos] = False
        assert torch.equal(kc_g[:, :, keep].cpu(), kc[:, :, keep]) and torch.equal(vc_g[:, :, keep].cpu(), vc[:, :, keep])
    finally:
        set_pdl(False)


def test_transformers_rotate_half_bf16_bit_exact_on_gpu():
    q, k, v = R._qkv(1, 1, 32, 8, 64, torch.bfloat16, seed=2)
    ang = R._angles(1, 1, 64, base=500000.0, start=77)
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    kc = torch.zeros(1, 8, 128, 64, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    out = rk.triton_rope_kv_store(q.cuda(), k.cuda(), v.cuda(), cos.cuda(), sin.cuda(), torch.tensor([77]).cuda(),
                                  kc, vc, 2, True, list(torch.empty(q.shape).stride()))

    def hf(x):
        return x * cos[:, :, None] + R._rotate_half(x) * sin[:, :, None]

    assert torch.equal(out.cpu(), hf(q))
    assert torch.equal(kc[:, :, 77].cpu(), hf(k)[:, 0])
