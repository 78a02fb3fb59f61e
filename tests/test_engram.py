"""Tests of dsv41/model/engram.py against pure-Python / float64 references written here (MODEL.md §2.10)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import sympy
import torch

from dsv41.model import engram as engram_mod
from dsv41.model.config import ModelConfig
from dsv41.model.engram import (DEAD_CID, Engram, EngramHash, EngramTable, engram_lookback, engram_row_ids,
                                engram_update)
from dsv41.model.formats import fake_quant_fp8_1x32


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.tiny()


@pytest.fixture(scope="module")
def full_hash() -> EngramHash:
    return EngramHash(ModelConfig.full())


# ------------------------------------------------------------------------------------------ references
def ref_primes(start: int, count: int) -> list:
    """The first `count` primes >= start, by trial with sympy.isprime (independent of nextprime)."""
    out, p = [], start
    while len(out) < count:
        if sympy.isprime(p):
            out.append(p)
        p += 1
    return out


def ref_multipliers(layer: int, vc: int, m: int) -> list:
    bound = ((2 ** 63 - 1) // vc) // 2
    return [2 * int(v) + 1 for v in np.random.default_rng(10007 * layer).integers(0, bound, size=m)]


def ref_lookback(hist: list, p: int, m: int, pad: int) -> list:
    u, alive = [], True
    for s in range(m):
        q = p - s
        if alive and (q < 0 or hist[q] == -1):
            alive = False
        u.append(hist[q] if alive else pad)
    return u


def ref_rows(u: list, mults: list, primes: list, offsets: list, n_heads: int) -> list:
    """Rolling XOR hash on Python big integers, explicit mod/offset per (order, head)."""
    prods = [a * b for a, b in zip(u, mults)]
    rows, h = [], prods[0]
    for k in range(1, len(u)):
        h = h ^ prods[k]
        assert 0 <= h < 2 ** 63  # the multiplier bound keeps the int64 hash exact
        for e in range(n_heads):
            j = (k - 1) * n_heads + e
            rows.append(h % primes[j] + offsets[j])
    return rows


def ref_gate_update(H: np.ndarray, keys: np.ndarray, value: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    B, T, S, d = H.shape
    out = np.empty_like(H)
    for b in range(B):
        for t in range(T):
            for i in range(S):
                h, k = H[b, t, i], keys[b, t, i]
                rs = 1.0 / math.sqrt(float(np.mean(h * h)) + eps) / math.sqrt(float(np.mean(k * k)) + eps)
                dot = float(np.sum(h * w[i] * k)) * rs / math.sqrt(d)
                sgn = (dot > 0) - (dot < 0)
                g = 1.0 / (1.0 + math.exp(-sgn * math.sqrt(max(abs(dot), 1e-6))))
                out[b, t, i] = h + g * value[b, t]
    return out


def decode_fp8_1x32(codes: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    v = codes.view(torch.float8_e4m3fn).double().numpy()
    return v * np.repeat(np.exp2(scale.numpy().astype(np.float64) - 127.0), 32, axis=-1)


def decode_fp8_block(codes: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    v = codes.view(torch.float8_e4m3fn).double().numpy()
    s = np.exp2(scale.numpy().astype(np.float64) - 127.0)
    return v * np.repeat(np.repeat(s, 32, axis=0), 32, axis=1)[: v.shape[0], : v.shape[1]]


# ------------------------------------------------------------------------------------------ hash constants
def test_multipliers_of_layer_1_match_published_values(full_hash):
    assert full_hash.multipliers(1) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    for layer in (1, 14):
        m = full_hash.multipliers(layer)
        assert m == ref_multipliers(layer, 99092, 4)
        assert all(v % 2 == 1 and 0 < v * 99091 < 2 ** 63 for v in m)


def test_full_config_table_rows(full_hash):
    assert [full_hash.num_rows(1), full_hash.num_rows(14)] == [384006168, 384016682]


def test_small_config_table_rows():
    h = EngramHash(ModelConfig.small())
    assert [h.num_rows(1), h.num_rows(5)] == [197398, 198942]


def test_tiny_config_primes_offsets_rows(tiny):
    h = EngramHash(tiny)
    assert h.primes(1) == [257, 263, 269, 271]
    assert h.offsets(1) == [0, 257, 520, 789]
    assert h.num_rows(1) == 1060


def test_primes_are_consecutive_across_layers_orders_heads(full_hash):
    got = full_hash.primes(1) + full_hash.primes(14)
    assert got == ref_primes(16_000_000, 48)
    assert full_hash.offsets(14)[5] == sum(full_hash.primes(14)[:5])


def test_hash_accessors_reject_non_engram_layer(full_hash):
    with pytest.raises(ValueError, match="not an Engram layer"):
        full_hash.primes(2)


# ------------------------------------------------------------------------------------------ look-back + hash
def random_history(rng: random.Random, B: int, S: int, vc: int, dead_frac: float = 0.15) -> list:
    return [[-1 if rng.random() < dead_frac else rng.randrange(vc) for _ in range(S)] for _ in range(B)]


def test_lookback_pads_before_start_and_at_and_behind_dead(tiny):
    rng = random.Random(0)
    B, S, M, pad = 3, 11, 4, 2
    hist = random_history(rng, B, S, 512, dead_frac=0.25)
    hist[0][5] = -1  # a guaranteed dead entry with live tokens behind it
    positions = [[rng.randrange(S) for _ in range(7)] + [0, 1, 2] for _ in range(B)]
    u = engram_lookback(torch.tensor(hist), torch.tensor(positions), M, pad)
    assert u.dtype == torch.int64 and u.shape == (B, 10, M)
    for b in range(B):
        for t, p in enumerate(positions[b]):
            assert u[b, t].tolist() == ref_lookback(hist[b], p, M, pad), (b, t, p)


def test_row_ids_match_big_integer_hash(full_hash):
    rng = random.Random(1)
    B, S, M, H = 2, 13, 4, 8
    hist = random_history(rng, B, S, 99092)
    hist[1][3] = 99091  # the largest cid: products closest to 2^63
    pos = torch.arange(S).repeat(B, 1)
    u = engram_lookback(torch.tensor(hist), pos, M, 2)
    for layer in (1, 14):
        mults, primes, offs = full_hash.multipliers(layer), full_hash.primes(layer), full_hash.offsets(layer)
        as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        rows = engram_row_ids(u, as_t(mults), as_t(primes), as_t(offs), H)
        assert rows.dtype == torch.int64 and rows.shape == (B, S, (M - 1) * H)
        for b in range(B):
            for p in range(S):
                want = ref_rows(ref_lookback(hist[b], p, M, 2), mults, primes, offs, H)
                assert rows[b, p].tolist() == want, (layer, b, p)
        assert int(rows.min()) >= 0 and int(rows.max()) < full_hash.num_rows(layer)


def test_engram_row_ids_method_uses_layer_constants(tiny):
    e = Engram(tiny, 1, "bf16", torch.float32)
    h = EngramHash(tiny)
    rng = random.Random(2)
    hist = random_history(rng, 1, 9, 512)
    u = engram_lookback(torch.tensor(hist), torch.arange(9)[None], 3, 2)
    rows = e.row_ids(u)
    for p in range(9):
        assert rows[0, p].tolist() == ref_rows(ref_lookback(hist[0], p, 3, 2), h.multipliers(1), h.primes(1),
                                               h.offsets(1), 2)


def test_hash_functions_reject_bad_inputs():
    with pytest.raises(ValueError, match="int64"):
        engram_lookback(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int64), 3, 2)
    with pytest.raises(ValueError, match="primes"):
        z = torch.zeros(3, dtype=torch.int64)
        engram_row_ids(torch.zeros(1, 1, 3, dtype=torch.int64), z, z, z, 2)


# ------------------------------------------------------------------------------------------ gate
def test_engram_gate_matches_float64_reference():
    gen = torch.Generator().manual_seed(3)
    B, T, d = 2, 3, 64
    H = torch.randn(B, T, 4, d, generator=gen) * 2
    H[0, 0, 1] = 0.0  # zero stream: dot = 0 -> g = sigmoid(0)
    keys = torch.randn(B, T, 4, d, generator=gen)
    keys[1, 2, 3] = 1e-3 * H[1, 2, 3]  # tiny key parallel to H: exercises the rsqrt(mean(key^2)) statistic
    value = torch.randn(B, T, d, generator=gen)
    qw = 1 + 0.3 * torch.randn(4, d, generator=gen)
    kw = 1 + 0.3 * torch.randn(4, d, generator=gen)
    eps = 1e-20
    got = engram_update(H, keys, value, qw, kw, eps)
    want = ref_gate_update(H.double().numpy(), keys.double().numpy(), value.double().numpy(),
                           (qw.double() * kw.double()).numpy(), eps)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0, 0, 1].double().numpy(), 0.5 * value[0, 0].double().numpy(), rtol=1e-6)


def test_engram_gate_floors_tiny_dot_magnitude_at_1e6():
    # Stream 0: H = [1, 1, 0...], key = [1, -1 + 2^-23, 0...]: the raw sum is exactly +2^-23 in FP32,
    # so dot = 2^-23 * rs / sqrt(d) ~ 4.8e-7 < 1e-6 and the floor decides g. Stream 1: the mirror, dot < 0.
    d = 64
    H = torch.zeros(1, 1, 4, d)
    keys = torch.zeros(1, 1, 4, d)
    H[..., :2] = 1.0
    keys[0, 0, :, 0] = 1.0
    keys[0, 0, 0, 1] = -1.0 + 2.0 ** -23
    keys[0, 0, 1, 1] = -1.0 - 2.0 ** -22
    keys[0, 0, 2:, 1] = 1.0  # large positive dot on streams 2, 3
    value = torch.full((1, 1, d), 10.0)
    out = engram_update(H, keys, value, torch.ones(4, d), torch.ones(4, d), 1e-20)
    g = (out[0, 0, :, 5] / 10.0).double()  # channel 5: H = 0, so out = g * value
    s = math.sqrt(1e-6)
    np.testing.assert_allclose(g[:2].numpy(), [1 / (1 + math.exp(-s)), 1 / (1 + math.exp(s))], rtol=1e-6)
    assert float(g[2]) > 0.6


def test_engram_gate_keeps_bf16_dtype():
    gen = torch.Generator().manual_seed(4)
    H = torch.randn(1, 1, 4, 32, generator=gen).to(torch.bfloat16)
    out = engram_update(H, torch.randn(1, 1, 4, 32, generator=gen), torch.randn(1, 1, 32, generator=gen),
                        torch.ones(4, 32), torch.ones(4, 32), 1e-20)
    assert out.dtype == torch.bfloat16 and out.shape == H.shape


# ------------------------------------------------------------------------------------------ module
def ref_engram(e: Engram, H: torch.Tensor, row_ids: torch.Tensor, mode: str) -> np.ndarray:
    if mode == "checkpoint":
        table = decode_fp8_1x32(e.embed.weight, e.embed.scale)
        wkv = decode_fp8_block(e.wkv.weight, e.wkv.scale)
    else:
        table, wkv = e.embed.weight.double().numpy(), e.wkv.weight.double().numpy()
    B, T, R = row_ids.shape
    d = e.dim
    flat = table[row_ids.reshape(-1).numpy()].reshape(B, T, R * table.shape[1])
    if mode == "checkpoint":
        flat = fake_quant_fp8_1x32(torch.from_numpy(flat)).numpy()
    kv = flat @ wkv.T
    keys, value = kv[..., : 4 * d].reshape(B, T, 4, d), kv[..., 4 * d:]
    w = (e.q_weight.double() * e.k_weight.double()).numpy()
    return ref_gate_update(H.double().numpy(), keys, value, w, e.eps)


@pytest.mark.parametrize("mode", ["checkpoint", "bf16"])
def test_engram_forward_matches_float64_reference(tiny, mode):
    e = Engram(tiny, 1, mode, torch.float32)
    e.init_random(torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)
    B, T = 2, 3
    H = torch.randn(B, T, 4, tiny.hidden_size, generator=gen)
    rows = torch.randint(0, e.embed.num_rows, (B, T, e.n_rows_per_token), generator=gen)
    got = e(H, rows)
    assert got.dtype == torch.float32 and got.shape == H.shape
    np.testing.assert_allclose(got.double().numpy(), ref_engram(e, H, rows, mode), rtol=1e-4, atol=1e-4)


def test_engram_module_layout(tiny):
    e = Engram(tiny, 1, "checkpoint", torch.bfloat16)
    R = (tiny.engram_max_ngram - 1) * tiny.engram_n_heads
    assert e.embed.weight.shape == (1060, 32) and e.embed.weight.dtype == torch.uint8
    assert e.embed.scale.shape == (1060, 1)
    assert (e.wkv.in_features, e.wkv.out_features, e.wkv.fmt) == (R * 32, 5 * tiny.hidden_size, "fp8_block")
    assert e.q_weight.shape == e.k_weight.shape == (4, tiny.hidden_size)
    assert set(e.state_dict()) == {"embed.weight", "embed.scale", "wkv.weight", "wkv.scale", "q_weight", "k_weight"}
    b = Engram(tiny, 1, "bf16", torch.bfloat16)
    assert b.embed.scale is None and b.embed.weight.dtype == torch.bfloat16 and b.wkv.fmt == "dense"


def test_table_init_random_fills_every_chunk(monkeypatch):
    monkeypatch.setattr(engram_mod, "_INIT_CHUNK_ROWS", 100)  # 1060 rows: 10 full chunks + a partial one
    t = EngramTable(1060, 64, "checkpoint", torch.float32)
    with torch.no_grad():
        t.weight.fill_(0x7F)  # E4M3 NaN
        t.scale.fill_(255)  # UE8M0 NaN
    t.init_random(torch.Generator().manual_seed(7))
    v = decode_fp8_1x32(t.weight, t.scale)
    assert np.isfinite(v).all() and 0.8 < v.std() < 1.2
    d = EngramTable(1060, 64, "bf16", torch.bfloat16)
    with torch.no_grad():
        d.weight.fill_(float("nan"))
    d.init_random(torch.Generator().manual_seed(7))
    assert torch.isfinite(d.weight).all()


def test_engram_rejects_bad_arguments(tiny):
    with pytest.raises(ValueError, match="int4_everything"):
        Engram(tiny, 1, "int4_everything", torch.bfloat16)
    with pytest.raises(ValueError, match="not an Engram layer"):
        Engram(tiny, 2, "bf16", torch.bfloat16)
    e = Engram(tiny, 1, "bf16", torch.float32)
    with pytest.raises(ValueError, match="row_ids"):
        e(torch.zeros(1, 1, 4, tiny.hidden_size), torch.zeros(1, 1, 3, dtype=torch.int64))


# ------------------------------------------------------------------------------------------ compile
def test_engram_decode_step_compiles_fullgraph_and_matches_eager(tiny):
    e = Engram(tiny, 1, "checkpoint", torch.bfloat16)
    e.init_random(torch.Generator().manual_seed(8))
    gen = torch.Generator().manual_seed(9)
    hist = torch.randint(0, tiny.vocab_size, (1, 16), generator=gen)
    hist[0, 6] = DEAD_CID
    H = torch.randn(1, 1, 4, tiny.hidden_size, generator=gen).to(torch.bfloat16)

    def step(H, history, positions):
        u = engram_lookback(history, positions, tiny.engram_max_ngram, tiny.pad_token_id)
        return e(H, e.row_ids(u))

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for p in (1, 7, 12):
        pos = torch.tensor([[p]])
        torch.testing.assert_close(compiled(H, hist, pos), step(H, hist, pos), rtol=0, atol=0)
