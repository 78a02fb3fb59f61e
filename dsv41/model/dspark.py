"""DSpark draft stages of DeepSeek-V4.1 Flash (MODEL.md §2.11, names §2.13).

The drafter proposes `dspark_block_size` tokens per round from one block `[y, noise, ..., noise]`:

- Target feature: at backbone layers `dspark_target_layer_ids` the INPUT residual of the layer is averaged
  over the four streams; the vectors are concatenated (`DeepseekV41Flash.forward(return_features=True)`)
  and stage 0 maps them to `main_x = main_norm(main_proj(feature))` [d] per committed position.
- Context KV: every stage writes, for each committed target position q, its own window entry
  `fp8(rope_main(kv_norm_s(wkv_s main_x_q)), q)` into its own ring (`DSparkAttention.commit`). The block's own
  tokens are never stored.
- Stages: ordinary V4.1 blocks (single-pass mHC, MoE with `dspark_n_routed_experts` experts, top
  `dspark_num_experts_per_tok`, one shared expert) whose attention is SWA-only with the main RoPE table;
  every block query attends to all valid ring rows plus all block rows (bidirectional inside the block).
- Heads (last stage): base logits `U = head(norm(collapse(H, pre)))` in FP32 with the target's shared LM head;
  the Markov head applied sequentially, `logits_k = U_k + W2 W1[prev]`, `prev = argmax(logits_k)`; the
  confidence head `proj([h_k ; W1[prev_{k-1}]])` (raw logit, h_k the collapsed pre-norm hidden).

Checkpoint names: `mtp.{s}.*` with the backbone block names, `mtp.0.main_proj.*`, `mtp.0.main_norm.weight`,
last stage `norm.weight`, `markov_head.embed.weight` [V, r], `markov_head.head.weight` [V, r],
`confidence_head.proj.weight` [1, d + r].

Everything is static-shape and host-sync-free (a draft round is capturable with `torch.compile(fullgraph=True)`).
Sources: MODEL.md §2.11, §2.13; [R41] module tree; [SGL] `deepseek_v4_dspark.py`; [P] DSpark.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention
from .config import ModelConfig
from ..ref.formats import dequantize_fp8_1x32, quantize_fp8_1x32
from .linear import Linear
from ..ref.mhc import mhc_collapse
from .block import Block
from .norm import RMSNorm
from .rope import apply_rope

__all__ = ["DSpark", "DSparkStage", "DSparkAttention", "MarkovHead", "ConfidenceHead", "markov_decode",
           "dspark_config", "confidence_survival"]


def dspark_config(config: ModelConfig) -> ModelConfig:
    """The config a DSpark stage is built from: `config` with the DSpark MoE sizes (experts, top-k) in place of the
    backbone's. Raises ValueError (from `ModelConfig.validate`) when top-k exceeds the expert count."""
    return dataclasses.replace(config, n_routed_experts=config.dspark_n_routed_experts,
                               num_experts_per_tok=config.dspark_num_experts_per_tok)


class DSparkAttention(Attention):
    """Attention of a DSpark stage: SWA-only, main RoPE, its own ring of committed target positions.

    Parameters are the backbone attention's (`wq_a`, `q_norm`, `wq_b`, `wkv`, `kv_norm`, `wo_a`, `wo_b`,
    `attn_sink`); caches: `ring_codes` uint8 [B, W, hd] (E4M3) + `ring_scales` [B, W, hd/32] (UE8M0).
    Forward: x [B, K, d] (the stage's attention-norm output of the K block rows) at positions [B, K] (contiguous,
    starting right after the last committed position) -> [B, K, d]. Each block query attends to every valid
    ring row and every block row (no causal mask inside the block); block rows are FP8 fake-quantised like
    window KV and never written to the ring.
    Raises: RuntimeError before `setup_cache`.
    Source: MODEL.md §2.11 steps 1-3, §2.4 steps 1-7.
    """

    def forward(self, x: torch.Tensor, positions: torch.Tensor, shared: dict | None = None) -> torch.Tensor:
        """Block attention, see the class docstring; `shared` is accepted for the Block interface and unused."""
        if self.ring_codes is None:
            raise RuntimeError("DSparkAttention.forward before setup_cache")
        b, t, _ = x.shape
        h, hd = self.n_heads, self.head_dim
        cos, sin = self.rotary(positions)
        qr = self.q_norm(self.wq_a(x))
        q = apply_rope(self.wq_b(qr).view(b, t, h, hd), cos[:, :, None], sin[:, :, None])
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        kv = dequantize_fp8_1x32(*quantize_fp8_1x32(kv), x.dtype)
        ring = dequantize_fp8_1x32(self.ring_codes, self.ring_scales, x.dtype)
        ring_ok = self._ring_positions(positions[:, 0]) >= 0
        keys = torch.cat((ring, kv), dim=1).float()
        ok = torch.cat((ring_ok, torch.ones(b, t, dtype=torch.bool, device=x.device)), dim=1)
        s = torch.einsum("bthd,bsd->bths", q.float(), keys) * hd ** -0.5
        s = torch.where(ok[:, None, None, :], s, torch.full_like(s, float("-inf")))
        # The sink only enlarges the denominator (MODEL.md §2.4 step 5).
        sink = self.attn_sink.view(1, 1, h, 1).expand(b, t, h, 1)
        p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
        o = torch.einsum("bths,bsd->bthd", p, keys).to(x.dtype)
        o = apply_rope(o, cos[:, :, None], sin[:, :, None], inverse=True)
        og = o.reshape(b, t, self.o_groups, h * hd // self.o_groups)
        wo_a = self.wo_a.weight.view(self.o_groups, self.o_lora, -1)
        u = torch.einsum("btgi,goi->btgo", og, wo_a.to(og.dtype)).reshape(b, t, self.o_groups * self.o_lora)
        return self.wo_b(u)

    def commit(self, main_x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Write the context entries of committed target positions into the ring.

        Args:
            main_x: [B, N, d] stage-0 projected target features (model dtype).
            positions: [B, N] int64 target positions of the rows. valid: [B, N] bool; False rows (rejected
                verify rows) leave their ring slot unchanged. With N > W only the last W rows are written, which
                is correct only when they are all valid (a prompt); verify commits have N <= W.
        Entry: `fp8_1x32(rope_main(kv_norm(wkv(main_x)), q))` at slot q mod W (MODEL.md §2.11 "Context KV").
        """
        cos, sin = self.rotary(positions)
        kv = apply_rope(self.kv_norm(self.wkv(main_x)), cos, sin)
        codes, scales = quantize_fp8_1x32(kv)
        n = min(positions.shape[1], self.window)
        codes, scales, pos, ok = codes[:, -n:], scales[:, -n:], positions[:, -n:], valid[:, -n:, None]
        bi = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(pos)
        slot = torch.remainder(pos, self.window)
        self.ring_codes.index_put_((bi, slot), torch.where(ok, codes, self.ring_codes[bi, slot]))
        self.ring_scales.index_put_((bi, slot), torch.where(ok, scales, self.ring_scales[bi, slot]))


class MarkovHead(nn.Module):
    """Rank-r Markov head: `W2 W1[prev]` added to the base logits of the next block position.

    Parameters: `embed.weight` W1 [V, r], `head.weight` W2 [V, r] (model dtype). The projection runs in FP32.
    Source: MODEL.md §2.11 step 5; [SGL] `markov_w1` / `markov_w2`.
    """

    def __init__(self, vocab_size: int, rank: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank, dtype=dtype, device=device)
        self.embed.weight.requires_grad_(False)
        self.head = Linear(rank, vocab_size, "dense", dtype, device)

    def init_random(self, gen: torch.Generator) -> None:
        """W1 ~ N(0, 1), W2 ~ N(0, 1/r) from `gen` (Markov logits of unit scale)."""
        w = self.embed.weight
        with torch.no_grad():
            w.copy_(torch.randn(w.shape, generator=gen, device=w.device).to(w.dtype))
        self.head.init_random(gen)

    def forward(self, prev: torch.Tensor):
        """prev int64 [B] -> (W1[prev] [B, r] model dtype, Markov logits `W2 W1[prev]` FP32 [B, V])."""
        e = self.embed(prev)
        return e, F.linear(e.float(), self.head.weight.float())


class ConfidenceHead(nn.Module):
    """`proj([h ; e])` -> one raw confidence logit (serving applies the sigmoid and a calibration).

    Parameters: `proj.weight` [1, d + r] (model dtype); computed in FP32.
    Shapes: h [B, d] (collapsed pre-norm hidden of a block position), e [B, r] (W1 of the previous token)
    -> [B] FP32. Source: MODEL.md §2.11 step 6.
    """

    def __init__(self, dim: int, rank: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.proj = Linear(dim + rank, 1, "dense", dtype, device)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Raw confidence logit [B] FP32 of `cat(h, e)` (see the class docstring)."""
        z = torch.cat((h.float(), e.float()), dim=-1)
        return F.linear(z, self.proj.weight.float())[..., 0]


def markov_decode(base_logits: torch.Tensor, hidden: torch.Tensor, last_token: torch.Tensor,
                  markov: MarkovHead, confidence: ConfidenceHead):
    """Sequential greedy Markov sampling over a block, with the confidence logit of every drafted token.

    For k = 1..K: `e = W1[prev]`; `logits_k = U_k + W2 e`; `d_k = argmax(logits_k)` (lowest index on ties);
    `c_k = proj([h_k ; e])`; `prev = d_k`, starting from prev = `last_token`.

    Args:
        base_logits: U [B, K, V] FP32. hidden: [B, K, d] collapsed pre-norm hidden of the block rows.
        last_token: y [B] int64 (the token the target emitted last, block row 0).
    Returns:
        (drafts [B, K] int64, logits [B, K, V] FP32, confidence logits [B, K] FP32).
    Source: MODEL.md §2.11 steps 5-6.
    """
    prev = last_token
    drafts, logits, conf = [], [], []
    for k in range(base_logits.shape[1]):
        e, m = markov(prev)
        lk = base_logits[:, k] + m
        conf.append(confidence(hidden[:, k], e))
        prev = lk.argmax(-1)
        drafts.append(prev)
        logits.append(lk)
    return torch.stack(drafts, 1), torch.stack(logits, 1), torch.stack(conf, 1)


class DSparkStage(Block):
    """One DSpark stage: an ordinary V4.1 block with `DSparkAttention` and the DSpark MoE sizes (MODEL.md §2.11).

    Parameters: the backbone block names (`attn_norm`, `ffn_norm`, `hc_{attn,ffn}_{fn,base,scale}`, `attn.*`,
    `ffn.*` with `dspark_n_routed_experts` experts); stage 0 adds `main_proj` [d, n_targets * d] (FP8 block in
    checkpoint mode) and `main_norm` [d]; the last stage adds `norm` [d], `markov_head` and `confidence_head`.
    Forward: the `Block` forward (H [B, K, 4, d], pre mix [B, K, 4], positions [B, K]) -> (H', next pre mix).
    Raises: ValueError for a stage index outside [0, num_dspark_stages).
    """

    def __init__(self, config: ModelConfig, stage: int, weight_mode: str, dtype: torch.dtype, device=None):
        if not 0 <= stage < config.num_dspark_stages:
            raise ValueError(f"DSpark stage {stage} out of range [0, {config.num_dspark_stages})")
        dc = dspark_config(config)
        layer_id = config.num_hidden_layers + stage
        super().__init__(dc, layer_id, weight_mode, dtype, device)
        self.attn = DSparkAttention(dc, layer_id, weight_mode, dtype, device)
        self.stage = stage
        d = config.hidden_size
        fmt = "fp8_block" if weight_mode == "checkpoint" else "dense"
        if stage == 0:
            self.main_proj = Linear(len(config.dspark_target_layer_ids) * d, d, fmt, dtype, device)
            self.main_norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
        if stage == config.num_dspark_stages - 1:
            r = config.dspark_markov_rank
            self.norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
            self.markov_head = MarkovHead(config.vocab_size, r, dtype, device)
            self.confidence_head = ConfidenceHead(d, r, dtype, device)


class DSpark(nn.ModuleList):
    """The DSpark drafter: `num_dspark_stages` stages (registered as `mtp.{s}` on the model) and the draft round.

    Args:
        config: model config (uses every `dspark_*` field, `sliding_window`, `vocab_size`, `hidden_size`).
        weight_mode, dtype, device: as for `DeepseekV41Flash`.
    Raises:
        ValueError: no stages; a target layer out of range or carrying Engram (the feature is taken before the
            layer, so Engram there would be skipped); a block of more than `sliding_window - 1` tokens (a verify
            commit of block + 1 rows must not wrap the ring).
    Source: MODEL.md §2.11, §2.13.
    """

    def __init__(self, config: ModelConfig, weight_mode: str, dtype: torch.dtype, device=None):
        c = config
        if c.num_dspark_stages < 1:
            raise ValueError("DSpark needs num_dspark_stages >= 1")
        for t in c.dspark_target_layer_ids:
            if not 0 <= t < c.num_hidden_layers:
                raise ValueError(f"DSpark target layer {t} is not a backbone layer")
            if t in c.engram_layer_ids:
                raise ValueError(f"DSpark target layer {t} is an Engram layer: the feature would precede Engram")
        if c.dspark_block_size + 1 > c.sliding_window:
            raise ValueError(f"dspark_block_size + 1 = {c.dspark_block_size + 1} exceeds sliding_window="
                             f"{c.sliding_window}: a verify commit would wrap the DSpark ring")
        super().__init__(DSparkStage(c, s, weight_mode, dtype, device) for s in range(c.num_dspark_stages))
        self.config = c
        self.block_size = c.dspark_block_size
        self.noise_token = c.dspark_noise_token_id

    # ------------------------------------------------------------------ caches
    def setup_cache(self, batch_size: int, device) -> None:
        """Allocate every stage's ring ([batch_size, W] entries of 528 B at full scale)."""
        for st in self:
            st.attn.setup_cache(batch_size, 1, device)

    def reset_cache(self) -> None:
        """Empty every stage's ring in place (addresses unchanged)."""
        for st in self:
            st.attn.reset_cache()

    # ------------------------------------------------------------------ pieces
    def main_x(self, features: torch.Tensor) -> torch.Tensor:
        """`main_norm(main_proj(features))`: [B, N, n_targets * d] -> [B, N, d] (MODEL.md §2.11 "Target features")."""
        st = self[0]
        return st.main_norm(st.main_proj(features))

    def commit(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Commit target features [B, N, n_targets * d] of positions [B, N] (rows with valid [B, N] False skipped)
        to every stage's ring (see `DSparkAttention.commit`)."""
        x = self.main_x(features)
        for st in self:
            st.attn.commit(x, positions, valid)

    def forward(self, features: torch.Tensor, feature_positions: torch.Tensor, feature_valid: torch.Tensor,
                last_token: torch.Tensor, start: torch.Tensor, embed_weight: torch.Tensor,
                head_weight: torch.Tensor):
        """One draft round: commit the new target features, then draft a block.

        Args:
            features: [B, N, n_targets * d] target features of the last verify rows (model dtype);
                feature_positions [B, N] int64; feature_valid [B, N] bool (accepted rows only).
            last_token: y [B] int64, the last token the target emitted (block row 0), at position `start` [B].
            embed_weight: the target's token embedding [V, d]; head_weight: the target's LM head [V, d].
        Returns:
            (drafts [B, K] int64 for positions start+1 .. start+K, confidence logits [B, K] FP32).
        Source: MODEL.md §2.11 steps 1-6.
        """
        self.commit(features, feature_positions, feature_valid)
        k = self.block_size
        b = last_token.shape[0]
        ids = torch.cat((last_token[:, None], torch.full((b, k - 1), self.noise_token, dtype=last_token.dtype,
                                                        device=last_token.device)), dim=1)
        positions = start[:, None] + torch.arange(k, device=start.device)
        x = F.embedding(ids, embed_weight)
        n = self.config.hc_mult
        H = x[:, :, None, :].expand(b, k, n, x.shape[-1]).contiguous()
        pre = F.one_hot(torch.zeros(b, k, dtype=torch.int64, device=x.device), n).to(torch.float32)
        for st in self:
            H, pre = st(H, pre, positions, {})
        last = self[-1]
        hidden = mhc_collapse(H, pre)
        base = F.linear(last.norm(hidden).float(), head_weight.float())
        drafts, _, conf = markov_decode(base, hidden, last_token, last.markov_head, last.confidence_head)
        return drafts, conf


def confidence_survival(conf_logits: torch.Tensor) -> torch.Tensor:
    """Survival of each drafted position, `cumprod(sigmoid(c))` over the block: [B, K] FP32 (MODEL.md §2.11 step 6,
    without the serving-side temperature calibration)."""
    return torch.cumprod(torch.sigmoid(conf_logits.float()), dim=-1)

