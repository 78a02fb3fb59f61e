"""dsv41/kernels/gqa_attention.py against attention written out in float64 here (scores, masked softmax, weighted
sum, each KV head serving G = Hq / Hkv query heads), on CPU through the reference and under the Triton interpreter.

Bound: the kernel computes in FP32 and rounds once; |out - ref| <= 2 ulp(out dtype) of max|v| plus 1e-5 max|v|
(FP32 softmax and sums in another order). Outputs and the workspace are NaN-poisoned first.
"""

from __future__ import annotations

import math

import pytest
import torch

from interp_harness import InterpreterHarness, poison_outputs

from dsv41.kernels import gqa_attention as ga

_harness = InterpreterHarness(__file__)
interpreted = _harness.interpreted
_record_node = _harness.record_node_fixture()


@pytest.fixture
def nan_outputs(monkeypatch):
    poison_outputs(monkeypatch, ga)


def attention64(q, k, v, mask=None, scale=None):
    b, hq, m, d = q.shape
    g = hq // k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.empty(b, hq, m, d, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // g].double(), v[:, h // g].double()
        sc = q[:, h].double() @ kh.transpose(-1, -2) * scale
        if mask is not None:
            mk = mask.expand(b, hq, m, k.shape[2])[:, h]
            sc = sc.masked_fill(~mk, float("-inf")) if mk.dtype == torch.bool else sc + mk.double()
        out[:, h] = torch.softmax(sc, -1) @ vh
    return out


def _close(got, want, v):
    got = got.double()
    scale = v.double().abs().max().item()
    tol = 2 * torch.finfo(v.dtype).eps * scale + 1e-5 * scale
    both_nan = torch.isnan(got) & torch.isnan(want)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN where the reference has none (or the reverse)"
    err = (got - want).abs()[~both_nan]
    assert err.numel() == 0 or err.max().item() <= tol, f"max error {err.max().item():.3e} > {tol:.3e}"


def _qkv(b, hq, hkv, m, s, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, m, d, generator=gen).to(dtype)
    k = (torch.randn(b, hkv, s, d, generator=gen) * 2).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    return gen, q, k, v


# (B, Hq, Hkv, M, S, D, dtype, overrides)
CASES = [
    (1, 8, 2, 1, 37, 16, torch.bfloat16, {}),
    (1, 4, 4, 3, 70, 24, torch.float16, {"block_s": 16}),
    (2, 6, 2, 2, 5, 8, torch.float32, {}),
    (1, 8, 1, 1, 129, 32, torch.bfloat16, {"block_s": 16, "splits": 3}),
    (1, 8, 2, 2, 45, 16, torch.float16, {"block_s": 8, "skip_masked": False, "num_warps": 2}),
    (1, 4, 2, 1, 90, 16, torch.bfloat16, {"block_s": 8, "merge_chunk": 2}),   # 12 splits merged 2 at a time
]


@interpreted
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-hq{c[1]}-hkv{c[2]}-m{c[3]}-s{c[4]}-d{c[5]}")
@pytest.mark.parametrize("masking", ["none", "bool", "additive"])
@pytest.mark.parametrize("dot", [False, True], ids=["fma", "dot"])
def test_matches_float64(case, masking, dot, nan_outputs):
    b, hq, hkv, m, s, d, dt, over = case
    over = {**over, "dot": dot}  # the tensor-core path where the shapes allow it (bf16 / fp16, 16+ keys and dims)
    gen, q, k, v = _qkv(b, hq, hkv, m, s, d, dt, s + d)
    mask = None
    if masking == "bool":  # a causal-style prefix per row, broadcast over batch and heads
        mask = (torch.arange(s)[None, :] <= torch.arange(s - m, s)[:, None])[None, None]
    elif masking == "additive":
        mask = (torch.randn(b, 1, m, s, generator=gen) * 3).to(dt)
    got = ga.triton_gqa_decode_attention(q, k, v, mask, **over)
    assert got.shape == q.shape and got.dtype == dt
    _close(got, attention64(q, k, v, mask), v)


@interpreted
def test_a_fully_masked_row_is_nan_and_scale_is_honoured(nan_outputs):
    _, q, k, v = _qkv(1, 4, 2, 2, 40, 16, torch.float32, 3)
    mask = torch.ones(1, 1, 2, 40, dtype=torch.bool)
    mask[..., 1, :] = False
    got = ga.triton_gqa_decode_attention(q, k, v, mask, scale=0.3, splits=4, block_s=8)
    _close(got, attention64(q, k, v, mask, scale=0.3), v)
    assert torch.isnan(got[:, :, 1]).all() and not torch.isnan(got[:, :, 0]).any()


@interpreted
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_keys_masked_in_every_row_are_never_read(kind, nan_outputs):
    """A static cache past its context: NaN in the K and V rows that no query row attends must not reach the output
    (had the kernel read them, 0 * NaN poisons the weighted sum). A key that only some rows attend is still read."""
    s, live = 50, 29
    _, q, k, v = _qkv(1, 6, 3, 2, s, 16, torch.float32, 8)
    keep = torch.zeros(1, 1, 2, s, dtype=torch.bool)
    keep[..., 0, :live] = True
    keep[..., 1, :live - 3] = True          # keys live-3 .. live-1 attended by row 0 only
    want = attention64(q, k, v, keep)
    k[:, :, live:], v[:, :, live:] = float("nan"), float("nan")
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    got = ga.triton_gqa_decode_attention(q, k, v, mask, block_s=8, splits=3)
    _close(got, want, v[:, :, :live])


def test_plan_rejects_bad_overrides():
    with pytest.raises(ValueError, match="num_warps"):
        ga.gqa_plan(1, 8, 64, num_warps=3)
    with pytest.raises(ValueError, match="block_s"):
        ga.gqa_plan(1, 8, 64, block_s=24)
    with pytest.raises(ValueError, match="merge_chunk"):
        ga.gqa_plan(1, 8, 64, merge_chunk=3)
    assert ga.gqa_plan(1, 8, 64, skip_masked=False)["SKIP_MASKED"] is False


def test_reference_is_sdpa_on_repeated_heads_and_contiguous():
    """Several query rows: the CPU op's output must have the fake's (contiguous) strides, which Inductor checks
    (SDPA's own output is [B, M, H, D] underneath; a compiled 8-token prefill failed on it)."""
    _, q, k, v = _qkv(1, 8, 2, 3, 20, 16, torch.float32, 5)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, M, D] over [B, M, H, D] storage, as after RoPE
    want = attention64(q, k, v)
    got = torch.ops.dsv41.gqa_decode_attention(q, k, v, None, None)
    _close(got, want, v)
    assert got.is_contiguous()


@pytest.mark.parametrize("bad, kind, words", [
    (lambda q, k, v: (q, k[:, :, :, :8], v[:, :, :, :8]), ValueError, "head dim"),
    (lambda q, k, v: (q[:, :3], k, v), ValueError, "not a multiple"),
    (lambda q, k, v: (q, k, v[:, :, :5]), ValueError, "one shape"),
    (lambda q, k, v: (q, k.half(), v), TypeError, "k"),
])
def test_bad_arguments_are_named(bad, kind, words):
    _, q, k, v = _qkv(1, 4, 2, 1, 10, 16, torch.float32, 1)
    with pytest.raises(kind, match=words):
        ga.reference_gqa_decode_attention(*bad(q, k, v))


@pytest.mark.parametrize("rope, dot", [(False, False), (False, True), (True, True)],
                         ids=["attention", "attention_dot", "rope_prologue_dot"])
def test_sm90_build_waits_before_its_first_load(rope, dot):
    """Built offline for sm_90 with PDL: no global load before griddepcontrol.wait (q, the new K / V rows and the
    cache rows of the step come from the previous kernels), and the next kernel is released once."""
    from interp_harness import sm90_ttir
    ptrs = dict(q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", mask_ptr="i1", o_ptr="bf16", ws_ptr="fp32", cnt_ptr="i32",
                kn_ptr="bf16", vn_ptr="bf16", c_ptr="fp32", s_ptr="fp32", pos_ptr="i64")
    consts = dict(G=4, RP=16 if dot else 4, DP=64, BLOCK_S=32, S_ITERS=4, SPLITS=8, SPLITS_P2=8, MASK=True,
                  MASK_BOOL=True, SKIP_MASKED=True, ROPE=rope, LAYOUT=1, ROUND=False, MP=1, RW=4, DOT=dot,
                  DOT_F32=False, JC=4, USE_PDL=True)
    ptx = sm90_ttir(ga._gqa_kernel, ptrs, consts, stage="ptx", num_warps=4, scalar_types={"scale": "fp32"})
    lines = [ln.strip() for ln in ptx.splitlines()]
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    assert not any("ld.global" in ln for ln in lines[:wait])
    assert sum("griddepcontrol.launch_dependents" in ln for ln in lines) == 1
