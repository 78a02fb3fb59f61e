"""Tests of dsv41.model.budget: parameter / byte / KV accounting (MODEL.md §1, §2.8, §3, §4).

Two independent references, both written here: (1) the numbers MODEL.md publishes (rounded as it states
them), and (2) a checkpoint tensor inventory built by name (MODEL.md §2.13) with storage shapes and element
sizes, whose sums must equal the budget exactly for every preset.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import sympy

from dsv41.model.budget import Budget, budget, decode_kv_read_bytes, engram_table_rows
from dsv41.model.config import ModelConfig

PRESETS = ("tiny", "small", "h200", "full")


# ------------------------------------------------------------------------------------ reference inventory
def _primes_from(start: int, count: int) -> list:
    """`count` consecutive primes >= start (sympy, independent of the module's trial division)."""
    out, p = [], start - 1
    for _ in range(count):
        p = sympy.nextprime(p)
        out.append(p)
    return out


def _reference_engram_rows(cfg: ModelConfig) -> list:
    per = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads
    primes = _primes_from(cfg.engram_vocab_size, per * len(cfg.engram_layer_ids))
    return [sum(primes[i * per:(i + 1) * per]) for i in range(len(cfg.engram_layer_ids))]


def _inventory(cfg: ModelConfig) -> list:
    """Checkpoint-style tensors: (name, storage shape, bytes per element, logical params) per tensor.

    FP8 weights are uint8 [N, K] + uint8 `.scale` [ceil(N/32), ceil(K/32)]; FP4 experts are packed uint8
    [N, K/2] (2 params per byte) + uint8 `.scale` [N, K/32]; Engram tables uint8 [rows, dim] + [rows, dim/32];
    wo_a is held BF16, ratio-2 compressor projections FP32 (the reference's in-memory dtypes).
    """
    inv = []

    def t(name, shape, size, params_per_elem=1.0):
        numel = math.prod(shape)
        inv.append((name, tuple(shape), size, int(numel * params_per_elem)))

    def fp8(name, n, k):
        t(name + ".weight", (n, k), 1)
        t(name + ".scale", (-(-n // 32), -(-k // 32)), 1, 0)

    def fp4(name, n, k):
        t(name + ".weight", (n, k // 2), 1, 2)
        t(name + ".scale", (n, k // 32), 1, 0)

    d, v, hd, h = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_attention_heads
    inter = cfg.moe_intermediate_size

    def block(p, n_exp):
        t(p + "attn_norm.weight", (d,), 2)
        t(p + "ffn_norm.weight", (d,), 2)
        for site in ("attn", "ffn"):
            t(p + f"hc_{site}_fn", (24, 4 * d), 4)
            t(p + f"hc_{site}_base", (24,), 4)
            t(p + f"hc_{site}_scale", (3,), 4)
        fp8(p + "attn.wq_a", cfg.q_lora_rank, d)
        t(p + "attn.q_norm.weight", (cfg.q_lora_rank,), 2)
        fp8(p + "attn.wq_b", h * hd, cfg.q_lora_rank)
        fp8(p + "attn.wkv", hd, d)
        t(p + "attn.kv_norm.weight", (hd,), 2)
        t(p + "attn.wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups), 2)
        fp8(p + "attn.wo_b", d, cfg.o_groups * cfg.o_lora_rank)
        t(p + "attn.attn_sink", (h,), 4)
        t(p + "ffn.gate.weight", (n_exp, d), 2)
        t(p + "ffn.gate.bias", (n_exp,), 4)
        t(p + "ffn.gate.bias_vl", (n_exp,), 4)
        for e in range(n_exp):
            fp4(p + f"ffn.experts.{e}.w1", inter, d)
            fp4(p + f"ffn.experts.{e}.w3", inter, d)
            fp4(p + f"ffn.experts.{e}.w2", d, inter)
        for s in range(cfg.n_shared_experts):
            fp8(p + f"ffn.shared_experts.{s}.w1", inter, d)
            fp8(p + f"ffn.shared_experts.{s}.w3", inter, d)
            fp8(p + f"ffn.shared_experts.{s}.w2", d, inter)

    t("embed.weight", (v, d), 2)
    t("head.weight", (v, d), 2)
    t("norm.weight", (d,), 2)
    rows = dict(zip(cfg.engram_layer_ids, _reference_engram_rows(cfg)))
    n_buckets = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        block(p, cfg.n_routed_experts)
        ratio = cfg.compress_ratios[layer]
        if layer in cfg.kv_source_layer_ids:
            size = 4 if ratio == 2 else 2
            t(p + "attn.compressor.wkv.weight", (hd, d), size)
            if ratio == 2:
                t(p + "attn.compressor.wgate.weight", (hd, d), size)
            t(p + "attn.compressor.norm.weight", (hd,), 2)
            t(p + "attn.indexer.wk.weight", (cfg.index_head_dim, hd), 2)
            t(p + "attn.indexer.k_norm.weight", (cfg.index_head_dim,), 2)
        if layer in cfg.index_source_layer_ids:
            fp8(p + "attn.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
            t(p + "attn.indexer.weights_proj.weight", (cfg.index_n_heads, d), 2)
        if layer in rows:
            t(p + "engram.embed.weight", (rows[layer], cfg.engram_row_dim), 1)
            t(p + "engram.embed.scale", (rows[layer], cfg.engram_row_dim // 32), 1, 0)
            fp8(p + "engram.wkv", (cfg.hc_mult + 1) * d, n_buckets * cfg.engram_row_dim)
            t(p + "engram.q_weight", (cfg.hc_mult, d), 2)
            t(p + "engram.k_weight", (cfg.hc_mult, d), 2)
    for s in range(cfg.num_dspark_stages):
        p = f"mtp.{s}."
        block(p, cfg.dspark_n_routed_experts)
        if s == 0:
            fp8(p + "main_proj", d, len(cfg.dspark_target_layer_ids) * d)
            t(p + "main_norm.weight", (d,), 2)
        if s == cfg.num_dspark_stages - 1:
            t(p + "norm.weight", (d,), 2)
            t(p + "markov_head.embed.weight", (v, cfg.dspark_markov_rank), 2)
            t(p + "markov_head.head.weight", (v, cfg.dspark_markov_rank), 2)
            t(p + "confidence_head.proj.weight", (1, d + cfg.dspark_markov_rank), 2)
    return inv


def _fraction_read(cfg: ModelConfig, name: str, mode: str) -> float:
    """Fraction of tensor `name` one decode step (`mode="decode"`) or one prompt token ("prefill") reads."""
    if name.startswith("mtp.") or name.endswith("bias_vl"):
        return 0.0
    if name.startswith("embed."):
        return 1.0 / cfg.vocab_size
    if name == "head.weight" or name == "norm.weight":
        return 1.0 if mode == "decode" else 0.0
    layer = int(name.split(".")[1])
    c = cfg.candidate_source_layer_id
    if mode == "prefill" and layer >= c:
        # Only what fills the candidate source's bank from the encoder output is run at layer c.
        fills_bank = (".attn_norm." in name or ".attn.compressor." in name or ".indexer.wk." in name
                      or ".indexer.k_norm." in name)
        return 1.0 if layer == c and fills_bank else 0.0
    if ".ffn.experts." in name:
        return 1.0 if int(name.split(".")[4]) < cfg.num_experts_per_tok else 0.0
    if ".engram.embed." in name:
        rows = dict(zip(cfg.engram_layer_ids, _reference_engram_rows(cfg)))[layer]
        return (cfg.engram_max_ngram - 1) * cfg.engram_n_heads / rows
    return 1.0


def _sums(cfg: ModelConfig) -> dict:
    inv = _inventory(cfg)
    out = dict(backbone=0, engram=0, dspark=0, bytes=0, dspark_bytes=0, decode=0.0, decode_bytes=0.0,
               prefill=0.0, prefill_bytes=0.0)
    for name, shape, size, params in inv:
        nbytes = math.prod(shape) * size
        if name.startswith("mtp."):
            out["dspark"] += params
            out["dspark_bytes"] += nbytes
        else:
            out["engram" if ".engram.embed." in name else "backbone"] += params
            out["bytes"] += nbytes
        for mode in ("decode", "prefill"):
            f = _fraction_read(cfg, name, mode)
            out[mode] += f * params
            out[mode + "_bytes"] += f * nbytes
    return out


@pytest.fixture(scope="module", params=PRESETS)
def preset_pair(request):
    cfg = ModelConfig.preset(request.param)
    return cfg, budget(cfg), _sums(cfg)


# ------------------------------------------------------------------------------------ exact inventory match
def test_stored_params_and_bytes_equal_checkpoint_inventory(preset_pair):
    cfg, b, ref = preset_pair
    assert b.backbone_params == ref["backbone"]
    assert b.engram_params == ref["engram"]
    assert b.dspark_params == ref["dspark"]
    assert b.total_params == ref["backbone"] + ref["engram"]
    assert b.weight_bytes == ref["bytes"]
    assert b.dspark_weight_bytes == ref["dspark_bytes"]


def test_decode_and_prefill_reads_equal_inventory_selection(preset_pair):
    cfg, b, ref = preset_pair
    # Fractions of a row (embedding / Engram rows) are exact in float64 at these sizes: compare rounded.
    assert b.active_params_decode == round(ref["decode"])
    assert b.decode_weight_bytes == round(ref["decode_bytes"])
    assert b.active_params_prefill == round(ref["prefill"])
    assert b.prefill_weight_bytes == round(ref["prefill_bytes"])


def test_components_sum_to_the_totals(preset_pair):
    cfg, b, _ = preset_pair
    comps = b.components.values()
    assert sum(c["params"] for c in comps if c["group"] == "backbone") == b.backbone_params
    assert sum(c["params"] for c in comps if c["group"] == "engram") == b.engram_params
    assert sum(c["bytes"] for c in comps if c["group"] == "dspark") == b.dspark_weight_bytes
    assert sum(c["decode_bytes"] for c in comps) == b.decode_weight_bytes
    assert sum(c["prefill_params"] for c in comps) == b.active_params_prefill


# ------------------------------------------------------------------------------------ published numbers
def test_engram_rows_follow_the_prime_rule():
    assert engram_table_rows("full") == [384_006_168, 384_016_682]  # MODEL.md §1 engram_num_embeddings
    assert engram_table_rows("h200") == [3_149_866, 3_156_856]  # §4.3
    assert engram_table_rows("small") == [197_398, 198_942]  # §4.2
    assert engram_table_rows("tiny") == [257 + 263 + 269 + 271]  # §4.1: 1060 rows


def test_per_layer_constants_match_model_md_4_3():
    b = budget("full")
    cfg = ModelConfig.full()
    layers = cfg.num_hidden_layers
    assert b.components["attention"]["params"] == 126_617_408 * layers
    assert b.components["mhc"]["params"] == 983_094 * layers
    assert b.components["routed_experts"]["params"] == 35_389_440 * cfg.n_routed_experts * layers
    assert b.components["router"]["params"] == (384 * 5120 + 2 * 384) * layers


def test_full_config_reproduces_published_totals():
    b = budget("full")
    assert round(b.backbone_params / 1e8) == 5519  # 551.9B
    assert round(b.engram_params / 1e8) == 1966  # 196.6B
    assert round(b.dspark_params / 1e8) == 142  # 14.2B
    assert abs(b.active_params_decode - 16.13e9) <= 0.05e9
    assert round(b.active_params_decode / 1e7) == 1613  # 16.13B exactly as stated
    assert b.kv_bytes_per_token == 890
    assert abs(b.decode_weight_bytes - 14.4e9) <= 0.2e9
    assert round(b.decode_weight_bytes / 1e8) == 144
    assert round(b.weight_bytes / 1e8) == 5028  # 502.8 GB (MODEL.md §4.3)


def test_full_decode_read_table_rows_of_model_md_3():
    c = budget("full").components
    # 40 x 126,617,408 = 5.0647B, which MODEL.md rounds up to "5.07B".
    assert abs(c["attention"]["decode_params"] - 5.07e9) <= 0.01e9
    assert round(c["attention"]["decode_bytes"] / 1e8) == 64  # ~6.4 GB
    assert round(c["routed_experts"]["decode_params"] / 1e7) == 849  # 8.49B
    assert round(c["routed_experts"]["decode_bytes"] / 1e8) == 45  # 4.5 GB
    assert round(c["shared_experts"]["decode_params"] / 1e7) == 142  # 1.42B
    lump = ("router", "mhc", "compressor", "indexer")
    assert round(sum(c[k]["decode_params"] for k in lump) / 1e7) == 18  # 0.18B
    assert round(sum(c[k]["decode_bytes"] for k in lump) / 1e7) == 43  # ~0.43 GB
    assert round(c["lm_head"]["decode_params"] / 1e7) == 66  # 0.66B


def test_full_prefill_reproduces_encoder_only_count():
    b = budget("full")
    c = b.components
    core = sum(c[k]["prefill_params"] for k in ("attention", "router", "routed_experts", "shared_experts"))
    assert round(core / 1e7) == 753  # MODEL.md §4.5: 7.53B encoder-only
    engram = c["engram_proj"]["prefill_params"] + c["engram_table"]["prefill_params"]
    assert round(engram / 1e8) == 3  # (+0.3B Engram)
    assert round(b.active_params_prefill / 1e8) == 79  # MODEL.md §1: prefill ~7.9B
    # Encoder alone by hand: 20 layers of attention, router weight + bias, 6 routed + 1 shared experts.
    assert core == 20 * (126_617_408 + 384 * 5120 + 384 + 7 * 35_389_440)


def test_h200_preset_reproduces_model_md_4_3():
    b = budget("h200")
    assert round(b.total_params / 1e8) == 1458  # 145.8B
    assert round(b.dspark_params / 1e8) == 23  # +2.3B
    assert round(b.weight_bytes / 1e8) == 850  # 85.0 GB
    assert round(b.decode_weight_bytes / 1e8) == 143  # 14.3 GB
    assert 16.06e9 <= b.active_params_decode <= 16.075e9  # "stays 16.06-16.07B"
    assert b.kv_bytes_per_token == 890


def test_small_preset_reproduces_model_md_4_2():
    b = budget("small")
    assert round(b.total_params / 1e6) == 1108  # 1.108B
    assert round(b.dspark_params / 1e6) == 53  # +0.053B
    assert round(b.active_params_decode / 1e6) == 319  # 0.319B
    assert b.kv_bytes_per_token == 712
    big_vocab = budget(ModelConfig(**{**ModelConfig.small().to_dict(), "vocab_size": 129280}))
    assert round(big_vocab.total_params / 1e6) == 1306  # 1.306B with V=129280
    assert round(big_vocab.active_params_decode / 1e6) == 418  # 0.418B


def test_tiny_preset_reproduces_model_md_4_1():
    b = budget("tiny")
    assert round(b.total_params / 1e4) == 267  # "2.67M backbone" (Engram table included)
    assert round(b.dspark_params / 1e4) == 44  # +0.44M
    assert round(b.active_params_decode / 1e4) == 140  # 1.40M
    assert b.kv_bytes_per_token == 79.5


# ------------------------------------------------------------------------------------ KV bytes
def test_logical_kv_bytes_per_token_by_hand():
    # Full: (288 + 68) x (3 x 1/2 + 1) = 890; tiny: (36 + 17) x (1/2 + 1) = 79.5; small (2 enc + 1 dec).
    assert budget("full").kv_bytes_per_token == 356 * 2.5
    assert budget("tiny").kv_bytes_per_token == 53 * 1.5
    assert budget("small").kv_bytes_per_token == 356 * 2


@pytest.mark.parametrize("seq", [64, 63, 1, 4096])
def test_allocated_kv_counts_ceil_rows_plus_trash_row(seq):
    # tiny: source 2 (ratio 2) and source 4 (ratio 1), 53 B per row (bank 36 + index key 17).
    expected = ((math.ceil(seq / 2) + 1) + (seq + 1)) * 53 / seq
    b = budget("tiny", max_seq_len=seq)
    assert b.kv_bytes_per_token_allocated == pytest.approx(expected, rel=1e-15)
    assert b.max_seq_len == seq
    assert b.kv_bytes_per_token_allocated > b.kv_bytes_per_token


def test_allocated_kv_default_context_and_limit():
    full = budget("full")
    assert full.max_seq_len == 5120
    assert full.kv_bytes_per_token_allocated == pytest.approx(((2561 * 3) + 5121) * 356 / 5120)
    assert budget("tiny").max_seq_len == 4096  # clipped to max_position_embeddings


def test_window_ring_bytes_per_sequence():
    full = budget("full")
    assert full.window_bytes_per_seq == 40 * 128 * 528  # 2.70 MB
    assert full.dspark_window_bytes_per_seq == 3 * 128 * 528  # 0.20 MB
    assert budget("tiny").window_bytes_per_seq == 8 * 16 * (64 + 2)


def test_decode_kv_read_bytes_full_matches_model_md_2_8():
    def hand(t):
        return 40 * 128 * 528 + 38 * 512 * 288 + 68 * (3 * (t // 2) + t + 4 * min(t, 16384))

    assert decode_kv_read_bytes("full", 4096) == hand(4096)
    assert round(decode_kv_read_bytes("full", 4096) / 1e5) == 101  # ~10.1 MB
    assert round(decode_kv_read_bytes("full", 100_000) / 1e5) == 298  # ~29.8 MB


@pytest.mark.parametrize("t,expected", [
    # tiny, T=5: window 8 layers x 5 x 66; bank: layers 2,3 -> 2 rows, layers 4-7 -> 5 rows (x 36);
    # index keys x 17: layer 2 scans 2, layer 4 scans 5, reindex layer 6 scans min(5, 16).
    (5, 8 * 5 * 66 + 2 * 2 * 36 + 4 * 5 * 36 + (2 + 5 + 5) * 17),
    # T=40: window full (16), top-k 8 everywhere, layer 6 scans the 16-row candidate pool.
    (40, 8 * 16 * 66 + 2 * 8 * 36 + 4 * 8 * 36 + (20 + 40 + 16) * 17),
    (1, 8 * 1 * 66 + 0 + 4 * 1 * 36 + (0 + 1 + 1) * 17),
])
def test_decode_kv_read_bytes_tiny_by_hand(t, expected):
    assert decode_kv_read_bytes(ModelConfig.tiny(), t) == expected


# ------------------------------------------------------------------------------------ API and errors
def test_budget_accepts_preset_name_and_config_alike():
    assert budget("small") == budget(ModelConfig.small())


def test_budget_is_frozen_and_serialisable():
    b = budget("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.backbone_params = 0
    d = json.loads(json.dumps(b.to_dict()))
    assert d["kv_bytes_per_token"] == 79.5
    assert d["components"]["attention"]["params"] == b.components["attention"]["params"]
    for name in ("backbone_params", "engram_params", "dspark_params", "active_params_decode",
                 "active_params_prefill", "decode_weight_bytes", "kv_bytes_per_token",
                 "kv_bytes_per_token_allocated", "weight_bytes", "window_bytes_per_seq", "components"):
        assert name in d
    assert isinstance(b, Budget)


def test_str_is_a_table_naming_every_component():
    text = str(budget("full"))
    for comp in budget("full").components:
        assert comp in text
    assert "16.1306B" in text and "890 B logical" in text


@pytest.mark.parametrize("bad,exc", [("huge", ValueError), (3, TypeError), (None, TypeError)])
def test_budget_rejects_bad_config(bad, exc):
    with pytest.raises(exc, match="preset|ModelConfig"):
        budget(bad)


@pytest.mark.parametrize("seq,exc", [(0, ValueError), (4097, ValueError), (64.0, TypeError), (True, TypeError)])
def test_budget_rejects_bad_max_seq_len(seq, exc):
    with pytest.raises(exc, match="max_seq_len"):
        budget("tiny", max_seq_len=seq)


@pytest.mark.parametrize("t,exc", [(0, ValueError), (4097, ValueError), (5.0, TypeError)])
def test_decode_kv_read_bytes_rejects_bad_context(t, exc):
    with pytest.raises(exc, match="context_len"):
        decode_kv_read_bytes("tiny", t)
