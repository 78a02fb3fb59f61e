"""dsv41::rope_kv_store against RoPE and cache writes spelled out here the ways model code spells them:
`torch.view_as_complex(x) * freqs_cis` (Meta / gpt-fast, interleaved pairs), `x * cos + rotate_half(x) * sin` with
transformers' bf16 cos / sin (half split, full-width trig), and the half split with half-width FP32 angles; the
cache rows written with `cache[:, :, pos] = ...`. Float64 math for the FP32 spellings, eager bf16 for the
transformers one (which rounds each product). Run on the reference (CPU) and the Triton kernel under the
interpreter; q_rot is NaN-poisoned before the kernel writes it and untouched cache rows must keep their values.
"""

from __future__ import annotations

import pytest
import torch

from interp_harness import InterpreterHarness

from dsv41.kernels import rope_kv as rk

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


def nan_strided(shape, stride, dtype, device):
    """`rope_kv._empty_strided` poisoned: every element of the strided result starts as NaN."""
    span = sum((n - 1) * st for n, st in zip(shape, stride)) + 1 if all(shape) else 0
    return torch.full((span,), float("nan"), dtype=dtype, device=device).as_strided(shape, stride)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(rk, "_empty_strided", nan_strided)


def _angles(b, s, d, base=10000.0, start=5):
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    t = torch.arange(start, start + s, dtype=torch.float64)
    return torch.outer(t, inv).expand(b, s, d // 2)  # [B, S, D/2]


def _meta_complex(x, ang):
    """Meta's apply_rotary_emb: interleaved channel pairs as complex numbers times e^{i angle}, in float64."""
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    f = torch.polar(torch.ones_like(ang), ang)[:, :, None, :]
    return torch.view_as_real(xc * f).flatten(-2)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _run(fn, q, k, v, cos, sin, pos, layout, rnd, t=16):
    b, s, hkv, d = k.shape
    g = torch.Generator().manual_seed(9)
    kc = torch.randn(b, hkv, t, d, generator=g).to(k.dtype)
    vc = torch.randn(b, hkv, t, d, generator=g).to(k.dtype)
    kc0, vc0 = kc.clone(), vc.clone()
    stride = list(torch.empty(q.shape).stride()) if q is not None else [1, 1, 1, 1]
    out = fn(q, k, v, cos, sin, pos, kc, vc, layout, rnd, stride)
    return out, kc, vc, kc0, vc0


def _impls():
    return [rk.reference_rope_kv_store, rk.triton_rope_kv_store]


def _qkv(b, s, h, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=g).to(dtype) for n in (h, hkv, hkv))


def _check_against(fn, dtype, b, s, h, hkv, d):
    q, k, v = _qkv(b, s, h, hkv, d, dtype)
    ang = _angles(b, s, d)
    pos = torch.arange(3, 3 + s)
    out, kc, vc, kc0, vc0 = _run(fn, q, k, v, ang.cos().float(), ang.sin().float(), pos, 0, False)
    want_q = _meta_complex(q, ang)
    want_k = _meta_complex(k, ang)
    tol = 2 * torch.finfo(dtype).eps
    assert not out.isnan().any()
    assert torch.allclose(out.double(), want_q, rtol=tol, atol=tol * 4)
    assert torch.allclose(kc[:, :, pos].transpose(1, 2).double(), want_k, rtol=tol, atol=tol * 4)
    assert torch.equal(vc[:, :, pos].transpose(1, 2), v)
    keep = torch.ones(kc.shape[2], dtype=torch.bool)
    keep[pos] = False
    assert torch.equal(kc[:, :, keep], kc0[:, :, keep]) and torch.equal(vc[:, :, keep], vc0[:, :, keep])


def test_reference_interleaved_matches_complex_multiply():
    _check_against(rk.reference_rope_kv_store, torch.float32, 2, 3, 4, 2, 16)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, s, h, hkv, d", [(1, 1, 4, 2, 16), (2, 3, 6, 3, 24)])
def test_kernel_interleaved_matches_complex_multiply(dtype, b, s, h, hkv, d):
    _check_against(rk.triton_rope_kv_store, dtype, b, s, h, hkv, d)


def _transformers_rotate_half_in_bf16_rounds_like_eager(impl):
    b, s, h, hkv, d = 1, 2, 4, 2, 32
    q, k, v = _qkv(b, s, h, hkv, d, torch.bfloat16, seed=4)
    ang = _angles(b, s, d, base=500000.0)
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    pos = torch.tensor([7, 8])
    out, kc, vc, _, _ = _run(impl, q, k, v, cos, sin, pos, 2, True)

    def hf(x):  # transformers' apply_rotary_pos_emb in bf16, on [B, S, H, D]
        return x * cos[:, :, None] + _rotate_half(x) * sin[:, :, None]

    assert torch.equal(out, hf(q))
    assert torch.equal(kc[:, :, pos].transpose(1, 2), hf(k))
    assert torch.equal(vc[:, :, pos].transpose(1, 2), v)


def test_transformers_rotate_half_in_bf16_rounds_like_eager_on_the_reference():
    _transformers_rotate_half_in_bf16_rounds_like_eager(rk.reference_rope_kv_store)


@interpreted
def test_transformers_rotate_half_in_bf16_rounds_like_eager_on_the_kernel():
    _transformers_rotate_half_in_bf16_rounds_like_eager(rk.triton_rope_kv_store)


def _half_split_with_half_width_fp32_angles(impl):
    b, s, h, hkv, d = 1, 1, 2, 1, 8
    q, k, v = _qkv(b, s, h, hkv, d, torch.float32, seed=5)
    ang = _angles(b, s, d)
    emb = torch.cat((ang, ang), -1)[:, :, None]
    pos = torch.tensor([0])
    out, kc, _, _, _ = _run(impl, q, k, v, ang.cos().float(), ang.sin().float(), pos, 1, False)
    want = q.double() * emb.cos() + _rotate_half(q.double()) * emb.sin()
    assert torch.allclose(out.double(), want, atol=1e-6)


def test_half_split_with_half_width_fp32_angles_on_the_reference():
    _half_split_with_half_width_fp32_angles(rk.reference_rope_kv_store)


@interpreted
def test_half_split_with_half_width_fp32_angles_on_the_kernel():
    _half_split_with_half_width_fp32_angles(rk.triton_rope_kv_store)


def _no_q_and_out_of_range_positions_write_nothing_else(impl):
    _, k, v = _qkv(1, 2, 2, 2, 8, torch.float32, seed=6)
    ang = _angles(1, 2, 8)
    pos = torch.tensor([16, 2])  # 16 is past T = 16: skipped
    out, kc, vc, kc0, vc0 = _run(impl, None, k, v, ang.cos().float(), ang.sin().float(), pos, 0, False)
    assert out.numel() == 0
    assert torch.equal(vc[:, :, 2], v[:, 1]) and torch.equal(kc[:, :, :2], kc0[:, :, :2])
    assert torch.equal(kc[:, :, 3:], kc0[:, :, 3:])


def test_no_q_and_out_of_range_positions_write_nothing_else_on_the_reference():
    _no_q_and_out_of_range_positions_write_nothing_else(rk.reference_rope_kv_store)


@interpreted
def test_no_q_and_out_of_range_positions_write_nothing_else_on_the_kernel():
    _no_q_and_out_of_range_positions_write_nothing_else(rk.triton_rope_kv_store)


def _negative_positions_count_from_the_end(impl):
    """As `cache[:, :, pos] = x` does: -1 is row T - 1; -17 is outside [-T, T) for T = 16, so nothing is written."""
    _, k, v = _qkv(1, 2, 2, 2, 8, torch.float32, seed=9)
    ang = _angles(1, 2, 8)
    pos = torch.tensor([-17, -1])
    out, kc, vc, kc0, vc0 = _run(impl, None, k, v, ang.cos().float(), ang.sin().float(), pos, 0, False)
    assert torch.equal(vc[:, :, 15], v[:, 1]) and torch.equal(vc[:, :, :15], vc0[:, :, :15])
    assert torch.equal(kc[:, :, :15], kc0[:, :, :15]) and not torch.equal(kc[:, :, 15], kc0[:, :, 15])


def test_negative_positions_count_from_the_end_on_the_reference():
    _negative_positions_count_from_the_end(rk.reference_rope_kv_store)


@interpreted
def test_negative_positions_count_from_the_end_on_the_kernel():
    _negative_positions_count_from_the_end(rk.triton_rope_kv_store)


@interpreted
def test_sin_laid_out_unlike_cos_and_strided_positions_on_the_kernel():
    """Same values as the reference gets, other layouts: sin transposed in memory, pos a strided column."""
    q, k, v = _qkv(2, 2, 2, 2, 8, torch.float32, seed=12)
    ang = _angles(2, 2, 8)
    cos, sin = ang.cos().float(), ang.sin().float()
    sin_t = sin.transpose(0, 2).contiguous().transpose(0, 2)
    pos = torch.tensor([5, 6])
    pos_col = torch.tensor([[5, 99], [6, 98]])[:, 0]
    want = _run(rk.reference_rope_kv_store, q, k, v, cos, sin, pos, 0, False)
    got = _run(rk.triton_rope_kv_store, q, k, v, cos, sin_t, pos_col, 0, False)
    for a, b in zip(got[:3], want[:3]):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()


def test_bad_arguments_name_the_argument():
    q, k, v = _qkv(1, 1, 4, 2, 16, torch.float32)
    ang = _angles(1, 1, 16)
    c, s = ang.cos().float(), ang.sin().float()
    kc = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="cos"):
        rk.reference_rope_kv_store(q, k, v, c[..., :4], s, torch.tensor([0]), kc, kc.clone(), 0, False, [64, 64, 16, 1])
    with pytest.raises(ValueError, match="pos"):
        rk.reference_rope_kv_store(q, k, v, c, s, torch.tensor([0, 1]), kc, kc.clone(), 0, False, [64, 64, 16, 1])
    with pytest.raises(ValueError, match="layout"):
        rk.reference_rope_kv_store(q, k, v, c, s, torch.tensor([0]), kc, kc.clone(), 5, False, [64, 64, 16, 1])
    with pytest.raises(TypeError, match="k_cache"):
        rk.reference_rope_kv_store(q, k, v, c, s, torch.tensor([0]), kc.half(), kc.clone(), 0, False, [64, 64, 16, 1])


def test_sm90_build_waits_before_its_first_load_and_releases_after_its_stores():
    """Built offline for sm_90 (Triton's own ptxas, no GPU) with PDL: no global load before griddepcontrol.wait (q,
    k, v and the positions come from the previous kernels), and the dependents are released after the last store."""
    from interp_harness import sm90_ttir
    ptrs = dict(q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", c_ptr="fp32", s_ptr="fp32", pos_ptr="i64",
                kc_ptr="bf16", vc_ptr="bf16", o_ptr="bf16")
    import triton.language as tl
    consts = dict(D=128, HALF_P2=64, LAYOUT=0, ROUND=False, DT=tl.bfloat16, USE_PDL=True)
    ptx = sm90_ttir(rk._rope_kv_kernel, ptrs, consts, stage="ptx", num_warps=1)
    lines = [ln.strip() for ln in ptx.splitlines()]
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    release = max(i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln)
    assert not any("ld.global" in ln for ln in lines[:wait])
    assert any("ld.global" in ln for ln in lines[wait:])
    last_store = max(i for i, ln in enumerate(lines) if "st.global" in ln)
    assert release > last_store
