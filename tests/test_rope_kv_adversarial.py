"""Adversarial decode steps for the `rope_kv` family: spellings its own tests do not use.

Each case is a plain function `step(params, caches, x, pos, cos, sin) -> outputs` run through a tiny module
holding the parameters and the caches as buffers; a `Case` dataclass says how to build it and what the report
must say. Every case is compiled with `backend="dsv41"` and run over a prompt, decode steps and a 2-token step
against an identical eager copy; outputs and both caches must agree (FP32 to 1e-5, half types to a few ulps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch

import dsv41


@dataclass(frozen=True)
class Case:
    step: Callable
    b: int = 1
    h: int = 4
    hkv: int = 2
    d: int = 16
    t: int = 20
    e: int = 32
    dtype: torch.dtype = torch.float32
    trig: str = "half"            # half | full | batch | complex
    write: str = "setitem"        # setitem | index_copy
    positions: tuple = ((0, 1, 2), (3,), (4,), (5, 6))
    caches_5d: bool = False


@dataclass
class Outcome:
    eager: list
    compiled: list
    family: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ spellings
def neox(x, c, s):
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * c - b * s, b * c + a * s), -1)


def neox_chunk(x, c, s):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * c - b * s, b * c + a * s), -1)


def hf(x, c, s):
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s


def complex_rope(x, f):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * f).flatten(3).type_as(x)


def rms(x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def put(cfg, cache, pos, val):
    if cfg.write == "index_copy":
        cache.index_copy_(2, pos, val)
    else:
        cache[:, :, pos] = val


def attend(q, kc, vc, pos):
    rep = q.shape[1] // kc.shape[1]
    kk, vv = kc.repeat_interleave(rep, 1).float(), vc.repeat_interleave(rep, 1).float()
    att = (q.float() @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    wrapped = torch.where(pos < 0, pos + kc.shape[2], pos)
    valid = torch.arange(kc.shape[2])[None, :] <= wrapped[:, None]
    return (att.masked_fill(~valid, float("-inf")).softmax(-1) @ vv).transpose(1, 2).flatten(2)


def qkv(m, x):
    cfg, (bsz, s, _) = m.cfg, x.shape
    return ((x @ m.wq.t()).view(bsz, s, cfg.h, cfg.d), (x @ m.wk.t()).view(bsz, s, cfg.hkv, cfg.d),
            (x @ m.wv.t()).view(bsz, s, cfg.hkv, cfg.d))


def plain(rope=neox):
    def step(m, x, pos, c, s):
        q, k, v = qkv(m, x)
        q, k = rope(q, c, s).transpose(1, 2), rope(k, c, s).transpose(1, 2)
        put(m.cfg, m.kc, pos, k)
        put(m.cfg, m.vc, pos, v.transpose(1, 2))
        return attend(q, m.kc, m.vc, pos)
    return step


def q_other_angles(kind):
    """q rotated by angles built from k's cos / sin: twice the angle, or the inverse rotation."""
    def step(m, x, pos, c, s):
        q, k, v = qkv(m, x)
        cq, sq = (c * c - s * s, 2 * s * c) if kind == "double" else (c, -s)
        q, k = neox(q, cq, sq).transpose(1, 2), neox(k, c, s).transpose(1, 2)
        put(m.cfg, m.kc, pos, k)
        put(m.cfg, m.vc, pos, v.transpose(1, 2))
        return attend(q, m.kc, m.vc, pos)
    return step


def k_written_twice(m, x, pos, c, s):
    q, k, v = qkv(m, x)
    q, k = neox(q, c, s).transpose(1, 2), neox(k, c, s).transpose(1, 2)
    put(m.cfg, m.kc, pos, k)
    put(m.cfg, m.vc, pos, v.transpose(1, 2))
    put(m.cfg, m.kc, pos, 2 * k)  # a second, non-RoPE write of the same cache
    return attend(q, m.kc, m.vc, pos)


def one_buffer(m, x, pos, c, s):
    q, k, v = qkv(m, x)
    q, k = neox(q, c, s).transpose(1, 2), neox(k, c, s).transpose(1, 2)
    kc, vc = m.kv[0], m.kv[1]
    put(m.cfg, kc, pos, k)
    put(m.cfg, vc, pos, v.transpose(1, 2))
    m.kc.copy_(kc)
    m.vc.copy_(vc)
    return attend(q, kc, vc, pos)


def complex_step(m, x, pos, f):
    q, k, v = qkv(m, x)
    q, k = complex_rope(q, f).transpose(1, 2), complex_rope(k, f).transpose(1, 2)
    put(m.cfg, m.kc, pos, k)
    put(m.cfg, m.vc, pos, v.transpose(1, 2))
    return attend(q, m.kc, m.vc, pos)


def qk_norm(m, x, pos, c, s):
    q, k, v = qkv(m, x)
    q, k = hf(rms(q), c, s).transpose(1, 2), hf(rms(k), c, s).transpose(1, 2)
    put(m.cfg, m.kc, pos, k)
    put(m.cfg, m.vc, pos, v.transpose(1, 2))
    return attend(q, m.kc, m.vc, pos)


def fp32_rope_then_cast(m, x, pos, c, s):
    q, k, v = qkv(m, x)
    q = neox(q.float(), c, s).to(x.dtype).transpose(1, 2)
    k = neox(k.float(), c, s).to(x.dtype).transpose(1, 2)
    put(m.cfg, m.kc, pos, k)
    put(m.cfg, m.vc, pos, v.transpose(1, 2))
    return attend(q, m.kc, m.vc, pos)


def two_layers_one_cache(m, x, pos, c, s):
    h = x
    for layer in range(2):
        q, k, v = qkv(m, h)
        q, k = neox(q, c, s).transpose(1, 2), neox(k * (layer + 1), c, s).transpose(1, 2)
        put(m.cfg, m.kc, pos, k)
        put(m.cfg, m.vc, pos, v.transpose(1, 2) - layer)
        h = attend(q, m.kc, m.vc, pos)[..., : m.cfg.e] + h
    return h


def read_before_write(m, x, pos, c, s):
    old_k, old_v = m.kc.sum(2), m.vc.clone()
    return plain()(m, x, pos, c, s), old_k, old_v


def returns_written(m, x, pos, c, s):
    q, k, v = qkv(m, x)
    q, k, v = neox(q, c, s).transpose(1, 2), neox(k, c, s).transpose(1, 2), v.transpose(1, 2)
    put(m.cfg, m.kc, pos, k)
    put(m.cfg, m.vc, pos, v)
    return attend(q, m.kc, m.vc, pos), q, k, v


def q_heads_first(m, x, pos, c, s):
    q, k, v = qkv(m, x)
    q = neox(q.transpose(1, 2), c.transpose(1, 2), s.transpose(1, 2))
    k = neox(k, c, s).transpose(1, 2)
    put(m.cfg, m.kc, pos, k)
    put(m.cfg, m.vc, pos, v.transpose(1, 2))
    return attend(q, m.kc, m.vc, pos)


def v_roped_too(m, x, pos, c, s):
    q, k, v = qkv(m, x)
    q, k, v = (neox(t, c, s).transpose(1, 2) for t in (q, k, v))
    put(m.cfg, m.kc, pos, k)
    put(m.cfg, m.vc, pos, v)
    return attend(q, m.kc, m.vc, pos)


def kv_at_other_positions(m, x, pos, c, s):
    q, k, v = qkv(m, x)
    q, k = neox(q, c, s).transpose(1, 2), neox(k, c, s).transpose(1, 2)
    put(m.cfg, m.kc, pos, k)
    put(m.cfg, m.vc, pos.flip(0), v.transpose(1, 2))
    return attend(q, m.kc, m.vc, pos)


# ------------------------------------------------------------------------------------------------ harness
class Holder(torch.nn.Module):
    """Parameters and caches of one case; forward is the case's step function."""

    def __init__(self, cfg: Case):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(1)

        def w(rows):
            return torch.nn.Parameter((torch.randn(rows, cfg.e, generator=g) * 0.2).to(cfg.dtype))

        self.wq, self.wk, self.wv = w(cfg.h * cfg.d), w(cfg.hkv * cfg.d), w(cfg.hkv * cfg.d)
        shape = (cfg.b, cfg.hkv, cfg.t, cfg.d)
        self.register_buffer("kc", torch.zeros(shape, dtype=cfg.dtype))
        self.register_buffer("vc", torch.zeros(shape, dtype=cfg.dtype))
        if cfg.caches_5d:
            self.register_buffer("kv", torch.zeros((2, *shape), dtype=cfg.dtype))

    def forward(self, *args):
        return self.cfg.step(self, *args)


def trig_for(cfg: Case, pos: torch.Tensor) -> tuple:
    """The angle inputs of one step: cos / sin broadcast over [B, S, H, D*], or complex freqs."""
    inv = 1.0 / 10000 ** (torch.arange(0, cfg.d, 2).float() / cfg.d)
    if cfg.trig == "batch":  # per-batch position ids: row b is 3 * b tokens ahead
        ang = (pos[None] + 3 * torch.arange(cfg.b)[:, None])[..., None].float() * inv
    else:
        ang = (pos[:, None].float() * inv)[None]
    if cfg.trig == "complex":
        return (torch.polar(torch.ones_like(ang), ang)[:, :, None],)
    if cfg.trig in ("full", "batch"):
        ang = torch.cat((ang, ang), -1)
    c, s = ang.cos()[:, :, None], ang.sin()[:, :, None]
    if cfg.trig == "full":
        c, s = c.to(cfg.dtype), s.to(cfg.dtype)
    return c, s


def decode(cfg: Case) -> Outcome:
    """Eager and compiled outputs (caches appended) over `cfg.positions`, and the family's report entry."""
    eager, comp = Holder(cfg), Holder(cfg)
    torch._dynamo.reset()
    compiled = torch.compile(comp, backend="dsv41", dynamic=False, options={"report": True})
    g = torch.Generator().manual_seed(5)
    out = Outcome([], [])
    with torch.no_grad():
        for p in cfg.positions:
            x = torch.randn(cfg.b, len(p), cfg.e, generator=g).to(cfg.dtype)
            pos = torch.tensor(p)
            for mod, sink in ((eager, out.eager), (compiled, out.compiled)):
                r = mod(x, pos, *trig_for(cfg, pos))
                sink.extend(r if isinstance(r, tuple) else (r,))
    out.eager += [eager.kc, eager.vc]
    out.compiled += [comp.kc, comp.vc]
    out.family = dsv41.last_report().to_dict()["families"]["rope_kv"]
    return out


def assert_same(o: Outcome, dtype: torch.dtype) -> None:
    assert len(o.eager) == len(o.compiled)
    for i, (want, got) in enumerate(zip(o.eager, o.compiled)):
        want, got = want.float(), got.float()
        if dtype == torch.float32:
            ok = torch.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
        else:  # a few ulps of the tensor's scale
            ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
            ok = torch.allclose(got, want, rtol=0, atol=4 * ulp * max(want.abs().max().item(), 1e-3), equal_nan=True)
        assert ok, f"tensor {i}: max diff {(got - want).abs().max().item()}"


def checks(fam) -> set:
    return {m["check"] for m in fam["near_misses"]}


# ------------------------------------------------------------------------------------------------ should fuse
FUSING = {
    "per_batch_positions_b2": Case(plain(hf), b=2, trig="batch"),
    "d80_single_kv_head": Case(plain(), h=2, hkv=1, d=80),
    "mqa_d128": Case(plain(), h=4, hkv=1, d=128),
    "fp16_fp32_rope_then_cast_index_copy": Case(fp32_rope_then_cast, dtype=torch.float16, write="index_copy"),
    "bf16_qk_norm_hf": Case(qk_norm, dtype=torch.bfloat16, trig="full"),
    "bf16_complex_b2": Case(complex_step, b=2, dtype=torch.bfloat16, trig="complex"),
    "two_layers_one_cache": Case(two_layers_one_cache, write="index_copy"),
    "cache_read_before_write": Case(read_before_write),
    "written_values_returned": Case(returns_written),
    "negative_positions": Case(plain(), positions=((0, 1, 2), (3,), (-16,), (-15, -14))),
    "q_heads_first_k_tokens_first": Case(q_heads_first, h=2, hkv=2, positions=((0, 1), (2, 3), (4,))),
}


@pytest.mark.parametrize("name", sorted(FUSING))
def test_fuses_and_equals_eager(name):
    cfg = FUSING[name]
    o = decode(cfg)
    assert_same(o, cfg.dtype)
    assert o.family["matches"] == len({len(p) for p in cfg.positions}) * (2 if cfg.step is two_layers_one_cache
                                                                          else 1), o.family
    assert not o.family["near_misses"], o.family["near_misses"]


@pytest.mark.parametrize("kind", ["double", "inverse"])
def test_q_with_other_angles_leaves_k_and_v_fused(kind):
    """Finding: a q rotated by other angles built from k's cos / sin was taken as the op's q; its probe failure
    refused the whole site as `rope_values`. k and v must still fuse, q left to Inductor."""
    cfg = Case(q_other_angles(kind))
    o = decode(cfg)
    assert_same(o, cfg.dtype)
    assert o.family["matches"] == 3 and not o.family["near_misses"], o.family
    assert all(site["detail"]["q"] is False for site in o.family["sites"]), o.family["sites"]


def test_second_write_of_k_cache_is_not_taken_for_v():
    """Finding: k's cache written twice at the same positions; the second write (nearest in graph order) was
    paired as v's write, and the site refused as `order`."""
    cfg = Case(k_written_twice)
    o = decode(cfg)
    assert_same(o, cfg.dtype)
    # the second write, 2 * rope(k), is itself RoPE-like and has no v write of its own: at most that near-miss
    assert o.family["matches"] == 3, o.family
    assert {m["check"] for m in o.family["near_misses"]} <= {"cache_write"}, o.family["near_misses"]


def test_one_buffer_for_both_caches_says_why():
    """Finding: with k and v caches as views of one [2, B, Hkv, T, D] buffer, v's write reads the buffer k's
    write produced; the near-miss said `order` about an op input. Now `cache_write`, naming the cause."""
    cfg = Case(one_buffer, caches_5d=True)
    o = decode(cfg)
    assert_same(o, cfg.dtype)
    assert o.family["matches"] == 0
    assert checks(o.family) == {"cache_write"}, o.family["near_misses"]
    assert all("computed from k's write" in m["reason"] for m in o.family["near_misses"])


def test_fp32_complex_freqs_reason_is_not_a_layout_mismatch():
    """Finding: FP32 `view_as_complex(x) * freqs` (no cast between the product and the write's view_as_real)
    took the complex product for k's RoPE and reported an interleaved RoPE as agreeing with no layout."""
    cfg = Case(complex_step, trig="complex")
    o = decode(cfg)
    assert_same(o, cfg.dtype)
    assert not any("agrees with no layout" in m["reason"] for m in o.family["near_misses"]), o.family


def test_fp32_complex_freqs_fuses():
    """Meta's reference Llama spelling in FP32: `view_as_complex(x.reshape(..., D/2, 2)) * freqs_cis`, no cast, so
    the RoPE input found is the pair view; the family walks back to the 4-D heads."""
    cfg = Case(complex_step, trig="complex")
    o = decode(cfg)
    assert_same(o, cfg.dtype)
    assert o.family["matches"] == 3, o.family


def test_chunk_rotate_half_fuses():
    """Finding: rotate-half spelled with `x.chunk(2, -1)` (split + getitem) was not seen as RoPE at all; rope_kv's own
    walk now passes through splits and their getitems."""
    cfg = Case(plain(neox_chunk))
    o = decode(cfg)
    assert_same(o, cfg.dtype)
    assert o.family["matches"] == 3, o.family


# ------------------------------------------------------------------------------------------------ look-alikes
LOOK_ALIKES = {
    "v_roped_too": (Case(v_roped_too), {"cache_write"}),
    "k_and_v_at_other_positions": (Case(kv_at_other_positions), {"cache_write"}),
}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alikes_stay_unfused(name):
    cfg, want = LOOK_ALIKES[name]
    o = decode(cfg)
    assert_same(o, cfg.dtype)
    assert o.family["matches"] == 0
    assert checks(o.family) == want, o.family["near_misses"]
