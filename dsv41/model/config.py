"""Model configuration and presets for DeepSeek-V4.1 Flash (MODEL.md §1 and §4).

`ModelConfig` holds every hyper-parameter of the published architecture. Four presets exist:
`tiny` (CPU tests), `small` (quick GPU runs), `h200` (the checkpoint-like single-H200 variant of
MODEL.md §4.3: full per-token dimensions, 96 routed experts) and `full` (the published config, for
parameter and byte accounting only).

Layer roles (MODEL.md §2.5) are derived, never stored: a layer with compress ratio 0 is `swa`; a
kv-source layer is `full` (compressor + indexer with its own index keys); an index source that is
not a kv source is `reindex`; every other compressed layer is `reuse`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import List

__all__ = ["ModelConfig", "PRESETS"]


@dataclass
class ModelConfig:
    """Hyper-parameters of DeepSeek-V4.1 Flash (field names follow the V4.1 `config.json`).

    Sizes are element counts; `compress_ratios` has `num_hidden_layers + num_dspark_stages` entries.

    Raises:
        ValueError: from `validate()` (called by `__post_init__`) naming the inconsistent field, e.g. a
            head_dim not divisible by 32, a candidate pool smaller than `index_topk`, or a kv source
            layer whose compress ratio is 0.

    Source: MODEL.md §1 (full-scale values), §4 (reduced presets and their invariants).
    """

    name: str = "custom"
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: List[int] = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    kv_source_layer_ids: List[int] = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: List[int] = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling_factor: float = 16.0
    rope_original_max_position: int = 65536
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-20
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2304
    routed_scaling_factor: float = 1.5
    gate_temp: float = 1.0
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: List[int] = field(default_factory=lambda: [1, 14])
    engram_max_ngram: int = 4
    engram_n_heads: int = 8
    engram_row_dim: int = 256
    engram_vocab_size: int = 16_000_000
    engram_compressed_vocab_size: int = 99_092
    num_dspark_stages: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: List[int] = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    quant_block: int = 32

    def __post_init__(self) -> None:
        self.compress_ratios = list(self.compress_ratios)
        self.validate()

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """Return a fresh config for preset `name` (`tiny`, `small`, `h200`, `full`).

        Raises:
            ValueError: an unknown preset name (the message lists the valid ones).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid presets: {sorted(PRESETS)}")
        return cls(**PRESETS[name])

    @classmethod
    def tiny(cls) -> "ModelConfig":
        """The `tiny` preset (MODEL.md §4.1)."""
        return cls.preset("tiny")

    @classmethod
    def small(cls) -> "ModelConfig":
        """The `small` preset (MODEL.md §4.2)."""
        return cls.preset("small")

    @classmethod
    def h200(cls) -> "ModelConfig":
        """The checkpoint-like `h200` preset (MODEL.md §4.3)."""
        return cls.preset("h200")

    @classmethod
    def full(cls) -> "ModelConfig":
        """The published full-scale config (MODEL.md §1); for accounting, never instantiated here."""
        return cls.preset("full")

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        """All fields as a JSON-serialisable dict (the `config.json` of a checkpoint)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Build from a dict; unknown keys are an error naming them.

        Raises:
            ValueError: a key that is not a `ModelConfig` field.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid keys: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """Read `config.json` from a checkpoint directory.

        Raises:
            FileNotFoundError: no `config.json` in `path`.
            ValueError: unknown or inconsistent fields.
        """
        fn = os.path.join(path, "config.json")
        if not os.path.exists(fn):
            raise FileNotFoundError(f"no config.json in checkpoint directory {path!r}")
        with open(fn) as f:
            return cls.from_dict(json.load(f))

    def save_pretrained(self, path: str) -> None:
        """Write `config.json` into directory `path` (created if missing)."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    # ------------------------------------------------------------------ derived topology
    @property
    def num_layers_total(self) -> int:
        """Backbone layers plus DSpark stages (length of `compress_ratios`)."""
        return self.num_hidden_layers + self.num_dspark_stages

    @property
    def index_sources(self) -> List[int]:
        """Index-source layers (own indexer query)."""
        return list(self.index_source_layer_ids)

    def layer_role(self, layer: int) -> str:
        """Role of backbone layer `layer`: `swa`, `full`, `reindex` or `reuse` (MODEL.md §2.5)."""
        if self.compress_ratios[layer] == 0:
            return "swa"
        if layer in self.kv_source_layer_ids:
            return "full"
        if layer in self.index_source_layer_ids:
            return "reindex"
        return "reuse"

    def kv_source_of(self, layer: int) -> int:
        """The kv-source layer whose bank `layer` reads (the latest source at or before it).

        Raises:
            ValueError: `layer` is an SWA layer (it reads no bank).
        """
        if self.compress_ratios[layer] == 0:
            raise ValueError(f"layer {layer} has compress ratio 0 and reads no bank")
        srcs = [s for s in self.kv_source_layer_ids if s <= layer]
        return srcs[-1]

    def bank_entries(self, layer: int, max_seq_len: int) -> int:
        """Rows a kv-source bank needs for `max_seq_len` tokens (ceil(max_seq_len / ratio))."""
        r = self.compress_ratios[layer]
        return -(-max_seq_len // r)

    @property
    def roles(self) -> List[str]:
        """`layer_role` of every backbone layer."""
        return [self.layer_role(i) for i in range(self.num_hidden_layers)]

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check the invariants of MODEL.md §4; raise ValueError naming the first broken one."""
        def bad(msg: str) -> None:
            raise ValueError(f"invalid ModelConfig {self.name!r}: {msg}")

        if self.hc_mult != 4:
            bad(f"hc_mult must be 4 (kernels are specialised for 4 streams), got {self.hc_mult}")
        if self.head_dim % 32 or self.head_dim % 16:
            bad(f"head_dim={self.head_dim} must be divisible by 32 (FP8 window) and 16 (FP4 bank)")
        if self.index_head_dim % 32:
            bad(f"index_head_dim={self.index_head_dim} must be divisible by 32")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            bad(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= head_dim and index_head_dim")
        if self.num_attention_heads % self.o_groups:
            bad(f"num_attention_heads={self.num_attention_heads} not divisible by o_groups={self.o_groups}")
        if len(self.compress_ratios) != self.num_layers_total:
            bad(f"compress_ratios has {len(self.compress_ratios)} entries, expected "
                f"num_hidden_layers + num_dspark_stages = {self.num_layers_total}")
        for r in self.compress_ratios:
            if r not in (0, 1, 2):
                bad(f"compress ratio {r} not supported (V4.1 uses 0, 1 and 2)")
        for s in self.kv_source_layer_ids:
            if not 0 <= s < self.num_hidden_layers or self.compress_ratios[s] == 0:
                bad(f"kv source layer {s} must be a backbone layer with compress ratio > 0")
        for s in self.index_source_layer_ids:
            if not 0 <= s < self.num_hidden_layers or self.compress_ratios[s] == 0:
                bad(f"index source layer {s} must be a backbone layer with compress ratio > 0")
        for s in self.kv_source_layer_ids:
            if s not in self.index_source_layer_ids:
                bad(f"kv source layer {s} must also be an index source (it owns index keys)")
        for l in range(self.num_hidden_layers):
            if self.compress_ratios[l] > 0:
                srcs = [s for s in self.kv_source_layer_ids if s <= l]
                if not srcs:
                    bad(f"compressed layer {l} has no kv source at or before it")
                if self.compress_ratios[srcs[-1]] != self.compress_ratios[l]:
                    bad(f"layer {l} has ratio {self.compress_ratios[l]} but its bank (layer {srcs[-1]}) "
                        f"has ratio {self.compress_ratios[srcs[-1]]}")
        c = self.candidate_source_layer_id
        if c not in self.kv_source_layer_ids or self.compress_ratios[c] != 1:
            bad(f"candidate source layer {c} must be a ratio-1 kv source")
        if self.candidate_topk_blocks * self.candidate_block_size - (self.candidate_block_size - 1) < self.index_topk:
            bad("candidate pool cannot hold a full top-k: candidate_topk_blocks * candidate_block_size - "
                f"(candidate_block_size - 1) = {self.candidate_topk_blocks * self.candidate_block_size - self.candidate_block_size + 1}"
                f" < index_topk = {self.index_topk}")
        if self.hidden_size % self.quant_block:
            bad(f"hidden_size={self.hidden_size} must be divisible by quant_block={self.quant_block}")
        if self.moe_intermediate_size % self.quant_block:
            bad(f"moe_intermediate_size={self.moe_intermediate_size} must be divisible by {self.quant_block}")
        if self.engram_row_dim % self.quant_block:
            bad(f"engram_row_dim={self.engram_row_dim} must be divisible by {self.quant_block}")
        if self.engram_max_ngram < 2 and self.engram_layer_ids:
            bad("engram_max_ngram must be >= 2")
        for l in self.engram_layer_ids:
            if not 0 <= l < self.num_hidden_layers:
                bad(f"engram layer {l} out of range")
        if self.num_experts_per_tok > self.n_routed_experts:
            bad("num_experts_per_tok > n_routed_experts")
        if self.engram_compressed_vocab_size > self.vocab_size and self.engram_layer_ids:
            # The identity map of reduced configs needs compressed vocab == vocab; full uses the real map.
            pass

    # ------------------------------------------------------------------ RoPE constants
    def yarn_band(self) -> tuple:
        """(low, high) pair indices of the YaRN ramp of the compress table (MODEL.md §2.2)."""
        d = self.qk_rope_head_dim

        def corr(r: float) -> float:
            return d * math.log(self.rope_original_max_position / (2 * math.pi * r)) / (2 * math.log(self.compress_rope_theta))

        low = max(math.floor(corr(self.rope_beta_fast)), 0)
        high = min(math.ceil(corr(self.rope_beta_slow)), d // 2 - 1)
        return low, high


_FULL = dict(name="full")

_H200 = dict(
    name="h200",
    n_routed_experts=96,
    dspark_n_routed_experts=16,
    engram_vocab_size=131072,
    engram_compressed_vocab_size=129280,
)

_SMALL = dict(
    name="small",
    vocab_size=32768,
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=512,
    o_groups=4,
    o_lora_rank=256,
    sliding_window=128,
    compress_ratios=[0, 0] + [2] * 6 + [1] * 8 + [0, 0],
    kv_source_layer_ids=[2, 5, 8],
    index_source_layer_ids=[2, 5, 8, 10, 12, 14],
    candidate_source_layer_id=8,
    candidate_topk_blocks=64,
    candidate_block_size=8,
    index_n_heads=8,
    index_head_dim=128,
    index_topk=128,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_shared_experts=1,
    moe_intermediate_size=512,
    engram_layer_ids=[1, 5],
    engram_max_ngram=4,
    engram_n_heads=4,
    engram_row_dim=128,
    engram_vocab_size=16384,
    engram_compressed_vocab_size=32768,
    num_dspark_stages=2,
    dspark_block_size=5,
    dspark_noise_token_id=32000,
    dspark_target_layer_ids=[13, 14, 15],
    dspark_markov_rank=64,
    dspark_n_routed_experts=8,
    dspark_num_experts_per_tok=2,
)

_TINY = dict(
    name="tiny",
    vocab_size=512,
    hidden_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    sliding_window=16,
    compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0, 0],
    kv_source_layer_ids=[2, 4],
    index_source_layer_ids=[2, 4, 6],
    candidate_source_layer_id=4,
    candidate_topk_blocks=4,
    candidate_block_size=4,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=8,
    rope_original_max_position=64,
    max_position_embeddings=4096,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=64,
    engram_layer_ids=[1],
    engram_max_ngram=3,
    engram_n_heads=2,
    engram_row_dim=32,
    engram_vocab_size=257,
    engram_compressed_vocab_size=512,
    num_dspark_stages=2,
    dspark_block_size=3,
    dspark_noise_token_id=500,
    dspark_target_layer_ids=[6, 7],
    dspark_markov_rank=16,
    dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=1,
)

PRESETS = {"tiny": _TINY, "small": _SMALL, "h200": _H200, "full": _FULL}
