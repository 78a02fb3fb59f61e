"""Parameter, weight-byte and KV-byte accounting for DeepSeek-V4.1 Flash configs (MODEL.md §1, §3, §4).

`budget(config)` walks the checkpoint tensor inventory implied by a `ModelConfig` (MODEL.md §2.4-§2.11,
§2.13) and adds up, per component, the parameters and bytes stored, read by one plain decode step and
touched by one prefill token. `decode_kv_read_bytes(config, T)` gives the KV bytes one decode step reads
at context T. Everything is derived from config fields; nothing is hard-coded for the full model.

Storage dtypes: the checkpoint's (MODEL.md §2.1 "Block layouts", §2.13), except where the model holds a
tensor in another dtype in memory, as the reference does (`wo_a`, ratio-2 compressor projections):

- FP8 E4M3 32x32-block weights (`wq_a`, `wq_b`, `wkv`, `wo_b`, shared experts, indexer `wq_b`, Engram
  `wkv`, DSpark `main_proj`): 1 B/param + one UE8M0 byte per block, i.e. ceil(N/32) * ceil(K/32) bytes.
- FP4 E2M1 routed experts: 0.5 B/param + one UE8M0 byte per 32 params along K.
- Engram table rows: FP8 1 B/param + one UE8M0 byte per 32 params of a row.
- `wo_a`: stored FP8 in the checkpoint but dequantised to BF16 at load and kept so (2 B/param).
- Compressor `wkv` / `wgate` of ratio-2 kv sources: BF16 in the checkpoint, promoted to FP32 by the
  reference (MODEL.md §2.6), counted at 4 B/param; the ratio-1 compressor stays BF16.
- BF16 (2 B): embedding, LM head, every RMSNorm weight, router weight, ratio-1 compressor, indexer `wk` and
  `weights_proj`, Engram `q_weight` / `k_weight`, DSpark Markov and confidence heads.
- FP32 (4 B): mHC `fn` / `base` / `scale`, attention sinks, router biases.

Readings of MODEL.md adopted here (each reproduces the spec's published numbers, see tests/test_budget.py):

- FP32 ratio-2 compressor projections: with them counted at BF16 the h200 weights come to 84.93 GB, the
  full backbone to 502.72 GB and MODEL.md §3's "router + mHC + compressor/indexer" line to 0.40 GB; at
  FP32 they are 84.96 GB, 502.75 GB and 0.43 GB, the spec's "85.0 GB", "502.8 GB" and "~0.43 GB".
- Engram table rows: consecutive primes >= `engram_vocab_size`, `(engram_max_ngram - 1) * engram_n_heads`
  per Engram layer, walking layers, then n-gram orders, then heads (MODEL.md §2.10 step 6); a layer's
  rows are the sum of its primes. Table parameters are `engram_params`; Engram `wkv` / `q_weight` /
  `k_weight` count as backbone. MODEL.md §4.1 / §4.2 quote tiny's "2.67M backbone" and small's "1.108B"
  including the Engram table, i.e. as `total_params` (tiny's backbone alone is 2.64M).
- Decode (`active_params_decode`, `decode_weight_bytes`): every attention / compressor / indexer / mHC /
  norm / router weight of every backbone layer, top-k routed + all shared experts, Engram `wkv`, `q_weight`,
  `k_weight` and the gathered rows, one embedding row, the final norm and the LM head. The router reads its
  weight and the text `bias`; `bias_vl` is stored but only read for image tokens, so it is not counted.
  DSpark is not part of a plain decode step.
- Prefill (`active_params_prefill`, per prompt token): the encoder (every layer l < candidate_source_layer_id,
  counted as in decode), one embedding row, and of the candidate-source layer c (the decoder's kv source,
  whose bank is projected from the encoder output) only what fills that bank: `attn_norm`, the compressor
  (`wkv`, `wgate` if ratio 2, `norm`) and the key half of its indexer (`wk`, `k_norm`); Engram `wkv` / `q` /
  `k` / rows of Engram layers below c. For the full config this is 7.58B + 0.31B Engram = 7.90B (the
  release's ~8B active in prefill, MODEL.md §4.5). A count of the encoder's attention + router + routed/shared expert
  weights alone gives 7.53B (7,526,199,040, + 0.3B Engram): the `prefill_params` of the components
  `attention`, `router`, `routed_experts` and `shared_experts`, without mHC, norms, compressor/indexer and
  the embedding row.
- Earlier estimates of the DSpark bytes (+7.6 GB full, +1.2 GB h200) are not reproduced by these rules
  (they give 8.03 GB and 1.71 GB); 7.6 GB would result if the DSpark FP4 expert scales were left out, but
  no reading found gives 1.2 GB. DSpark parameter counts (14.2B, 2.3B) do match.

KV bytes (MODEL.md §2.8), with E = head_dim/2 + head_dim/16 (FP4 bank entry, 288 B at full scale) and
I = index_head_dim/2 + index_head_dim/32 (FP4 index key, 68 B):

- logical `kv_bytes_per_token` = sum over kv-source layers of (E + I) / ratio: the growth of the global
  banks per token (890 B full, 79.5 B tiny);
- allocated `kv_bytes_per_token_allocated` = sum over kv sources of (ceil(S / ratio) + 1) * (E + I) / S for
  the preallocated maximum context S. The "+1" is a trash row that absorbs the write of a token whose
  ratio-r group is not complete, so the write needs no branch; it and the ceil make the allocated number
  slightly larger than the logical one, converging to it as S grows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Union

from .config import ModelConfig

__all__ = ["Budget", "budget", "decode_kv_read_bytes", "engram_table_rows", "DEFAULT_MAX_SEQ_LEN"]

#: Default maximum context for the allocated-KV figure: a 4096-token prompt plus 1024 generated tokens
#: (clipped to the config's `max_position_embeddings`).
DEFAULT_MAX_SEQ_LEN = 4096 + 1024

_COLUMNS = ("params", "bytes", "decode_params", "decode_bytes", "prefill_params", "prefill_bytes")


# ---------------------------------------------------------------------------------------- helpers
def _resolve(config: Union[ModelConfig, str]) -> ModelConfig:
    """A `ModelConfig` from a config or a preset name; TypeError / ValueError otherwise."""
    if isinstance(config, str):
        return ModelConfig.preset(config)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig or a preset name, got {type(config).__name__}")
    return config


def _is_prime(n: int) -> bool:
    """Trial division: V4.1 bucket sizes are ~1.6e7 (sqrt ~4000 divisors), so no sieve is needed."""
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


def engram_table_rows(config: Union[ModelConfig, str]) -> List[int]:
    """Table rows of each Engram layer, in `engram_layer_ids` order (MODEL.md §2.10 step 6).

    Each layer owns `(engram_max_ngram - 1) * engram_n_heads` buckets, one per (n-gram order, head); bucket
    sizes are consecutive primes >= `engram_vocab_size`, never reused, handed out walking layers, then
    orders, then heads. A layer's rows are the sum of its primes (full: [384006168, 384016682]).

    Raises:
        TypeError / ValueError: `config` is neither a ModelConfig nor a known preset name.
    """
    cfg = _resolve(config)
    per_layer = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads
    p = cfg.engram_vocab_size
    out = []
    for _ in cfg.engram_layer_ids:
        total = 0
        for _ in range(per_layer):
            while not _is_prime(p):
                p += 1
            total += p
            p += 1
        out.append(total)
    return out


class _Tally:
    """Accumulates params / bytes per component for the stored, decode and prefill columns."""

    def __init__(self, block: int):
        self.block = block
        self.rows: Dict[str, Dict[str, int]] = {}
        self.groups: Dict[str, str] = {}

    def _bytes(self, n: int, k: int, fmt: str) -> int:
        b = self.block
        if fmt == "fp8_block":  # E4M3 codes + one UE8M0 byte per b x b tile
            return n * k + (-(-n // b)) * (-(-k // b))
        if fmt == "fp4":  # packed E2M1 codes + one UE8M0 byte per 1 x b along K
            return n * k // 2 + n * k // b
        if fmt == "fp8_rows":  # Engram rows: E4M3 + one UE8M0 byte per 1 x b of a row
            return n * k + n * k // b
        if fmt == "bf16":
            return 2 * n * k
        if fmt == "fp32":
            return 4 * n * k
        raise AssertionError(f"unknown storage format {fmt}")

    def add(self, comp: str, group: str, shape: tuple, fmt: str, stored: int = 1, decode: int = 0,
            prefill: int = 0) -> None:
        """Add `stored` copies of a tensor `shape` ([N, K] or [N]) in `fmt`, of which `decode` / `prefill`
        copies are read per decode step / per prefill token (experts and Engram / embedding rows are
        counted as copies of one expert / one row)."""
        n, k = (1, shape[0]) if len(shape) == 1 else shape  # a vector is one row of K
        p, b = n * k, self._bytes(n, k, fmt)
        row = self.rows.setdefault(comp, dict.fromkeys(_COLUMNS, 0))
        self.groups[comp] = group
        row["params"] += stored * p
        row["bytes"] += stored * b
        row["decode_params"] += decode * p
        row["decode_bytes"] += decode * b
        row["prefill_params"] += prefill * p
        row["prefill_bytes"] += prefill * b

    def total(self, column: str, group: str | None = None) -> int:
        """Sum of `column` over all rows (or the rows of `group`), in that column's unit."""
        return sum(r[column] for c, r in self.rows.items() if group is None or self.groups[c] == group)


# ---------------------------------------------------------------------------------------- Budget
@dataclass(frozen=True)
class Budget:
    """Parameter and byte budget of one config (all counts are element counts, all sizes bytes).

    Fields:
        name: the config name.
        backbone_params: every backbone tensor except the Engram tables (embedding and head included).
        engram_params: Engram table parameters (rows x row_dim); scales are bytes, not params.
        dspark_params: the DSpark draft stages and their extra heads (shared embedding/head excluded).
        total_params: backbone_params + engram_params (DSpark reported separately, as MODEL.md does).
        active_params_decode / decode_weight_bytes: read by one plain decode step (module docstring).
        active_params_prefill / prefill_weight_bytes: touched per prompt token (module docstring).
        weight_bytes: backbone + Engram tables stored at checkpoint dtypes; dspark_weight_bytes: DSpark.
        kv_bytes_per_token: logical global-bank growth per token (float, bytes).
        kv_bytes_per_token_allocated: allocated bank bytes / max_seq_len for the preallocated cache.
        max_seq_len: the context the allocated figure was computed for.
        window_bytes_per_seq: backbone SWA rings of one sequence, (head_dim + head_dim/32) B per entry
            (528 B at full scale); dspark_window_bytes_per_seq: the DSpark stages' rings.
        components: component name -> {"group": "backbone" | "engram" | "dspark", "params", "bytes",
            "decode_params", "decode_bytes", "prefill_params", "prefill_bytes"}.

    Source: MODEL.md §1, §2.8, §3 "Weight bytes read per plain decode step", §4.3, §4.5.
    """

    name: str
    backbone_params: int
    engram_params: int
    dspark_params: int
    total_params: int
    active_params_decode: int
    active_params_prefill: int
    weight_bytes: int
    dspark_weight_bytes: int
    decode_weight_bytes: int
    prefill_weight_bytes: int
    kv_bytes_per_token: float
    kv_bytes_per_token_allocated: float
    max_seq_len: int
    window_bytes_per_seq: int
    dspark_window_bytes_per_seq: int
    components: Dict[str, Dict[str, Union[int, str]]] = field(hash=False)

    def to_dict(self) -> dict:
        """All fields as a JSON-serialisable dict (components deep-copied)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "components"}
        d["components"] = {k: dict(v) for k, v in self.components.items()}
        return d

    def __str__(self) -> str:
        # Millions for the reduced presets, billions otherwise, so tiny's table is not all zeros.
        unit, p_lab, b_lab = (1e9, "B", "GB") if self.total_params >= 1e9 else (1e6, "M", "MB")

        def g(x: float) -> str:
            """`x` bytes in the table's unit, right-aligned to 11 columns."""
            return f"{x / unit:11.4f}"

        head = (f"{'component':<24}{'params':>11}{'stored':>11}{'decode':>11}{'decode':>11}"
                f"{'prefill':>11}{'prefill':>11}")
        sub = (f"{'':<24}{'[' + p_lab + ']':>11}{'[' + b_lab + ']':>11}{'[' + p_lab + ']':>11}"
               f"{'[' + b_lab + ']':>11}{'[' + p_lab + ']':>11}{'[' + b_lab + ']':>11}")
        rule = "-" * len(head)
        lines = [f"budget of config {self.name!r} (checkpoint dtypes; prefill = per prompt token)", head, sub,
                 rule]
        for comp, r in self.components.items():
            lines.append(f"{comp:<24}" + "".join(g(r[k]) for k in _COLUMNS))
        lines += [
            rule,
            f"backbone {self.backbone_params / unit:.4f}{p_lab} + Engram tables {self.engram_params / unit:.4f}"
            f"{p_lab} = {self.total_params / unit:.4f}{p_lab} params, {self.weight_bytes / unit:.4f} {b_lab}; "
            f"DSpark {self.dspark_params / unit:.4f}{p_lab} params, {self.dspark_weight_bytes / unit:.4f} {b_lab}",
            f"decode: {self.active_params_decode / unit:.4f}{p_lab} active params, "
            f"{self.decode_weight_bytes / unit:.4f} {b_lab} read; prefill: "
            f"{self.active_params_prefill / unit:.4f}{p_lab} params per token",
            f"KV per token: {self.kv_bytes_per_token:g} B logical, {self.kv_bytes_per_token_allocated:.3f} B "
            f"allocated at max_seq_len {self.max_seq_len}; window rings {self.window_bytes_per_seq / 1e6:.3f} MB"
            f"/seq (+{self.dspark_window_bytes_per_seq / 1e6:.3f} MB DSpark)",
        ]
        return "\n".join(lines)


def _kv_entry_bytes(cfg: ModelConfig) -> tuple:
    """(bank entry, index key, window entry) bytes: FP4+E4M3/16, FP4+UE8M0/32, FP8+UE8M0/32 (MODEL.md §2.8)."""
    bank = cfg.head_dim // 2 + cfg.head_dim // 16
    index_key = cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    window = cfg.head_dim + cfg.head_dim // 32
    return bank, index_key, window


def _add_block(t: _Tally, cfg: ModelConfig, prefix: str, group: str, n_experts: int, top_k: int,
               decode: int, prefill: int) -> None:
    """Attention, block norms, mHC, router and experts of one block (backbone layer or DSpark stage)."""
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    ql, og, ol = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    att = prefix + "attention"
    t.add(att, group, (ql, d), "fp8_block", 1, decode, prefill)  # wq_a
    t.add(att, group, (ql,), "bf16", 1, decode, prefill)  # q_norm
    t.add(att, group, (h * hd, ql), "fp8_block", 1, decode, prefill)  # wq_b
    t.add(att, group, (hd, d), "fp8_block", 1, decode, prefill)  # wkv
    t.add(att, group, (hd,), "bf16", 1, decode, prefill)  # kv_norm
    t.add(att, group, (og * ol, h * hd // og), "bf16", 1, decode, prefill)  # wo_a, BF16 in memory
    t.add(att, group, (d, og * ol), "fp8_block", 1, decode, prefill)  # wo_b
    t.add(att, group, (h,), "fp32", 1, decode, prefill)  # attn_sink
    n = cfg.hc_mult
    for _ in ("attn", "ffn"):
        t.add(prefix + "mhc", group, ((2 + n) * n, n * d), "fp32", 1, decode, prefill)  # hc_*_fn
        t.add(prefix + "mhc", group, ((2 + n) * n,), "fp32", 1, decode, prefill)  # hc_*_base
        t.add(prefix + "mhc", group, (3,), "fp32", 1, decode, prefill)  # hc_*_scale
    t.add(prefix + "block_norms", group, (d,), "bf16", 2, 2 * decode, 2 * prefill)  # attn_norm, ffn_norm
    t.add(prefix + "router", group, (n_experts, d), "bf16", 1, decode, prefill)  # gate.weight
    t.add(prefix + "router", group, (n_experts,), "fp32", 1, decode, prefill)  # gate.bias (text selection)
    t.add(prefix + "router", group, (n_experts,), "fp32", 1, 0, 0)  # gate.bias_vl: image tokens only
    inter = cfg.moe_intermediate_size
    for shape in ((inter, d), (inter, d), (d, inter)):  # w1, w3, w2
        t.add(prefix + "routed_experts", group, shape, "fp4", n_experts, top_k * decode, top_k * prefill)
        t.add(prefix + "shared_experts", group, shape, "fp8_block", cfg.n_shared_experts,
              cfg.n_shared_experts * decode, cfg.n_shared_experts * prefill)


def _tally(cfg: ModelConfig) -> _Tally:
    """The full tensor inventory of `cfg`, component by component (MODEL.md §2.4-§2.11, §2.13)."""
    t = _Tally(cfg.quant_block)
    d, hd, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    c = cfg.candidate_source_layer_id
    bb = "backbone"
    # Embedding: V rows of [d]; a decode step or a prompt token gathers one.
    t.add("embed", bb, (d,), "bf16", v, 1, 1)
    engram_rows = dict(zip(cfg.engram_layer_ids, engram_table_rows(cfg)))
    n_buckets = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads
    for layer in range(cfg.num_hidden_layers):
        enc = int(layer < c)  # prefill runs the encoder only (MODEL.md §4.5)
        if layer in engram_rows:
            t.add("engram_table", "engram", (cfg.engram_row_dim,), "fp8_rows", engram_rows[layer],
                  n_buckets, n_buckets * enc)
            t.add("engram_proj", bb, ((cfg.hc_mult + 1) * d, n_buckets * cfg.engram_row_dim), "fp8_block",
                  1, 1, enc)  # wkv
            t.add("engram_proj", bb, (cfg.hc_mult, d), "bf16", 2, 2, 2 * enc)  # q_weight, k_weight
        _add_block(t, cfg, "", bb, cfg.n_routed_experts, cfg.num_experts_per_tok, 1, enc)
        ratio = cfg.compress_ratios[layer]
        if layer in cfg.kv_source_layer_ids:
            # The candidate-source bank is projected from the encoder output during prefill, so its
            # compressor, its index-key projection and the attn_norm feeding them run per prompt token.
            bank = int(layer <= c)
            if layer == c:
                t.add("block_norms", bb, (d,), "bf16", 0, 0, 1)
            # Ratio-2 projections are held in FP32 (the reference promotes them; module docstring).
            proj = "fp32" if ratio == 2 else "bf16"
            t.add("compressor", bb, (hd, d), proj, 1, 1, bank)  # wkv
            if ratio == 2:
                t.add("compressor", bb, (hd, d), proj, 1, 1, bank)  # wgate
            t.add("compressor", bb, (hd,), "bf16", 1, 1, bank)  # norm
            t.add("indexer", bb, (cfg.index_head_dim, hd), "bf16", 1, 1, bank)  # wk
            t.add("indexer", bb, (cfg.index_head_dim,), "bf16", 1, 1, bank)  # k_norm
        if layer in cfg.index_source_layer_ids:
            t.add("indexer", bb, (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), "fp8_block", 1, 1,
                  enc)  # wq_b
            t.add("indexer", bb, (cfg.index_n_heads, d), "bf16", 1, 1, enc)  # weights_proj
    t.add("final_norm", bb, (d,), "bf16", 1, 1, 0)
    t.add("lm_head", bb, (v, d), "bf16", 1, 1, 0)

    ds = "dspark"
    for stage in range(cfg.num_dspark_stages):
        _add_block(t, cfg, "dspark.", ds, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok, 0, 0)
        if stage == 0:
            t.add("dspark.main_proj", ds, (d, len(cfg.dspark_target_layer_ids) * d), "fp8_block")
            t.add("dspark.main_proj", ds, (d,), "bf16")  # main_norm
        if stage == cfg.num_dspark_stages - 1:
            r = cfg.dspark_markov_rank
            t.add("dspark.heads", ds, (d,), "bf16")  # last-stage norm
            t.add("dspark.heads", ds, (v, r), "bf16", 2)  # markov_head.embed, markov_head.head
            t.add("dspark.heads", ds, (1, d + r), "bf16")  # confidence_head.proj
    return t


# ---------------------------------------------------------------------------------------- public API
def budget(config: Union[ModelConfig, str], max_seq_len: int | None = None) -> Budget:
    """Count parameters, stored / decode / prefill weight bytes and KV bytes of `config`.

    Args:
        config: a `ModelConfig` or a preset name (`tiny`, `small`, `h200`, `full`).
        max_seq_len: maximum context (tokens) of the preallocated cache for `kv_bytes_per_token_allocated`;
            default `min(DEFAULT_MAX_SEQ_LEN, config.max_position_embeddings)` (4096 + 1024).
    Returns:
        a frozen `Budget` (field meanings and counting rules: `Budget` and the module docstring).
    Raises:
        TypeError: `config` is not a ModelConfig / str, or `max_seq_len` is not an int.
        ValueError: unknown preset name, or `max_seq_len` outside [1, max_position_embeddings].
    Source: MODEL.md §1, §2.4-§2.13, §3, §4.3, §4.5.
    """
    cfg = _resolve(config)
    if max_seq_len is None:
        max_seq_len = min(DEFAULT_MAX_SEQ_LEN, cfg.max_position_embeddings)
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int):
        raise TypeError(f"max_seq_len must be an int, got {type(max_seq_len).__name__}")
    if not 1 <= max_seq_len <= cfg.max_position_embeddings:
        raise ValueError(f"max_seq_len={max_seq_len} must be in [1, max_position_embeddings="
                         f"{cfg.max_position_embeddings}]")
    t = _tally(cfg)
    bank, index_key, window = _kv_entry_bytes(cfg)
    logical = 0.0
    allocated_bytes = 0
    for s in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[s]
        logical += (bank + index_key) / r
        allocated_bytes += (cfg.bank_entries(s, max_seq_len) + 1) * (bank + index_key)  # +1: trash row
    components = {}
    for comp, row in t.rows.items():
        components[comp] = {"group": t.groups[comp], **row}
    backbone = t.total("params", "backbone")
    engram = t.total("params", "engram")
    return Budget(
        name=cfg.name,
        backbone_params=backbone,
        engram_params=engram,
        dspark_params=t.total("params", "dspark"),
        total_params=backbone + engram,
        active_params_decode=t.total("decode_params"),
        active_params_prefill=t.total("prefill_params"),
        weight_bytes=t.total("bytes", "backbone") + t.total("bytes", "engram"),
        dspark_weight_bytes=t.total("bytes", "dspark"),
        decode_weight_bytes=t.total("decode_bytes"),
        prefill_weight_bytes=t.total("prefill_bytes"),
        kv_bytes_per_token=logical,
        kv_bytes_per_token_allocated=allocated_bytes / max_seq_len,
        max_seq_len=max_seq_len,
        window_bytes_per_seq=cfg.num_hidden_layers * cfg.sliding_window * window,
        dspark_window_bytes_per_seq=cfg.num_dspark_stages * cfg.sliding_window * window,
        components=components,
    )


def decode_kv_read_bytes(config: Union[ModelConfig, str], context_len: int) -> int:
    """KV-cache bytes one plain decode step reads at context `context_len` (MODEL.md §2.8, last paragraph).

    `context_len` T counts the tokens visible to the step, the current one included (position p = T - 1).
    Summed over backbone layers, at the packed formats:
    - window ring: min(T, sliding_window) entries of head_dim + head_dim/32 bytes (FP8 + UE8M0), every layer;
    - selected bank rows: min(index_topk, T // r) FP4 entries (head_dim/2 + head_dim/16 bytes) for every
      layer with ratio r > 0 (sources, Reindex and Reuse layers all attend over their top-k);
    - index-key scans (index_head_dim/2 + index_head_dim/32 bytes per key): a kv-source layer scans all
      T // r visible keys; a Reindex layer scans only the candidate pool, counted at its upper bound
      min(T // r, candidate_topk_blocks * candidate_block_size).
    Not counted: compressor pending state, Engram id history, DSpark rings (all O(1) and tiny).
    Full config: ~10.1 MB at T = 4096, ~29.8 MB at T = 100,000.

    Raises:
        TypeError: `config` not a ModelConfig / str, or `context_len` not an int.
        ValueError: unknown preset, or `context_len` outside [1, max_position_embeddings].
    """
    cfg = _resolve(config)
    if isinstance(context_len, bool) or not isinstance(context_len, int):
        raise TypeError(f"context_len must be an int, got {type(context_len).__name__}")
    if not 1 <= context_len <= cfg.max_position_embeddings:
        raise ValueError(f"context_len={context_len} must be in [1, max_position_embeddings="
                         f"{cfg.max_position_embeddings}]")
    bank, index_key, window = _kv_entry_bytes(cfg)
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
    total = 0
    for layer in range(cfg.num_hidden_layers):
        total += min(context_len, cfg.sliding_window) * window
        r = cfg.compress_ratios[layer]
        if r == 0:
            continue
        visible = context_len // r
        total += min(cfg.index_topk, visible) * bank
        if layer in cfg.kv_source_layer_ids:
            total += visible * index_key
        elif layer in cfg.index_source_layer_ids:
            total += min(visible, pool) * index_key
    return total
