"""CSA2 pieces of V4.1: the compressor that writes the shared bank, the indexer, and top-k selection.

MODEL.md §2.5-§2.7. Roles: kv-source layers own a `Compressor` (ratio 2 pair pooling in the encoder,
ratio 1 in the decoder's first layer) and an `Indexer` with its own index keys (`wk`, `k_norm`);
Reindex layers own an `Indexer` without keys; the candidate-source layer (ratio 1 kv source) also
builds the two-level candidate pool that Reindex layers are restricted to.

All shapes are static: invisible rows are -inf, empty selections are -1, and a token whose pair is
not complete writes its (unused) bank row to a per-sequence trash row at index `rows` of the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from ..ref.topk import candidate_mask, select_topk
from ..ref.formats import fake_quant_fp4_ue8m0_1x32, dequantize_fp4_ue8m0_1x32
from .linear import Linear
from .norm import RMSNorm
from .rope import apply_rope

__all__ = ["Compressor", "Indexer", "select_topk", "candidate_mask", "visible_rows", "SPEC_TRAIL_ROWS"]

#: Rows of a multi-token call whose (k, g) the ratio-2 compressor keeps (`kv_trail`, `score_trail`), so that a
#: speculative verify of up to this many rows can roll the pending state back to its last accepted row.
SPEC_TRAIL_ROWS = 16


class Compressor(nn.Module):
    """Produces the bank latent of a kv-source layer (MODEL.md §2.6).

    Ratio 2: per token `k = wkv x`, `g = wgate x` in FP32; the latent of group j = tokens (2j, 2j+1) is
    the per-channel softmax-over-the-pair pooling of k, cast to the model dtype, then RMSNorm. The even
    token of a pair is parked in a per-sequence state (`kv_state`, `score_state`, FP32 [B, hd]) across
    decode steps and prefill chunks. Ratio 1: `latent = norm(wkv x)` for every token (BF16, no gate).
    A call of 2..`SPEC_TRAIL_ROWS` tokens (a speculative verify) also keeps every row's (k, g) in `kv_trail`,
    `score_trail` FP32 [B, SPEC_TRAIL_ROWS, hd], which `dsv41.model.speculative` uses to roll the state back.

    Weights: `wkv.weight [hd, d]`, `wgate.weight [hd, d]` (ratio 2, held in FP32 like the reference),
    `norm.weight [hd]`.
    """

    def __init__(self, config: ModelConfig, ratio: int, dtype: torch.dtype, device=None):
        super().__init__()
        if ratio not in (1, 2):
            raise ValueError(f"compressor ratio must be 1 or 2, got {ratio}")
        d, hd = config.hidden_size, config.head_dim
        self.ratio = ratio
        # The reference keeps the ratio-2 projections in FP32 (MODEL.md §2.6); ratio 1 stays in the model dtype.
        pdtype = torch.float32 if ratio == 2 else dtype
        self.wkv = Linear(d, hd, "dense", pdtype, device)
        self.wgate = Linear(d, hd, "dense", pdtype, device) if ratio == 2 else None
        self.norm = RMSNorm(hd, config.rms_norm_eps, dtype, device)
        for name in ("kv_state", "score_state", "kv_trail", "score_trail"):
            self.register_buffer(name, None, persistent=False)

    def setup_cache(self, batch_size: int, device, dtype=torch.float32) -> None:
        """Allocate the pending-token state (ratio 2 only): FP32 [batch_size, hd] each."""
        if self.ratio == 2:
            hd = self.wkv.out_features
            self.register_buffer("kv_state", torch.zeros(batch_size, hd, dtype=torch.float32, device=device),
                                 persistent=False)
            self.register_buffer("score_state", torch.full((batch_size, hd), float("-inf"), dtype=torch.float32,
                                                           device=device), persistent=False)
            for name in ("kv_trail", "score_trail"):
                self.register_buffer(name, torch.zeros(batch_size, SPEC_TRAIL_ROWS, hd, dtype=torch.float32,
                                                       device=device), persistent=False)

    def reset_cache(self) -> None:
        """Forget the pending token (in place, addresses unchanged)."""
        if self.kv_state is not None:
            self.kv_state.zero_()
            self.score_state.fill_(float("-inf"))
            self.kv_trail.zero_()
            self.score_trail.zero_()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, trash_row: int):
        """Latents for the tokens `x` [B, T, d] at `positions` [B, T] (int64, contiguous per sequence).

        Returns:
            latent [B, T, hd] (model dtype, pre-RoPE), group_pos [B, T] int64 (RoPE position of the entry:
            first token of the group), rows [B, T] int64 (bank row to write; `trash_row` for tokens that
            complete no group).
        """
        if self.ratio == 1:
            return self.norm(self.wkv(x)), positions, positions
        k = F.linear(x.float(), self.wkv.weight.float())
        g = F.linear(x.float(), self.wgate.weight.float())
        prev_k = torch.cat((self.kv_state[:, None], k[:, :-1]), dim=1)
        prev_g = torch.cat((self.score_state[:, None], g[:, :-1]), dim=1)
        # Softmax over the two tokens of the pair, separately for every channel.
        m = torch.maximum(prev_g, g)
        e0 = torch.exp(prev_g - m)
        e1 = torch.exp(g - m)
        z = (e0 * prev_k + e1 * k) / (e0 + e1)
        latent = self.norm(z.to(x.dtype))
        completes = (positions % 2) == 1
        rows = torch.where(completes, positions // 2, torch.full_like(positions, trash_row))
        # The last token becomes the pending one; only an even (group-opening) token is ever read back.
        self.kv_state.copy_(k[:, -1])
        self.score_state.copy_(g[:, -1])
        t = k.shape[1]
        if 1 < t <= SPEC_TRAIL_ROWS:  # static shape: decode steps (t = 1) and prefills never record
            self.kv_trail[:, :t].copy_(k)
            self.score_trail[:, :t].copy_(g)
        return latent, positions - 1, rows


def visible_rows(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Bank rows visible to a query at `positions` [B, T]: floor((p + 1) / ratio) (MODEL.md §2.7)."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


class Indexer(nn.Module):
    """CSA2 lightning indexer of an index-source layer (MODEL.md §2.7).

    Weights: `wq_b [Hi*Di, q_lora]` (FP8 block), `weights_proj [Hi, d]` (BF16); on key owners also
    `wk [Di, hd]` and `k_norm [Di]` (BF16). Score of bank row t for a query:
    `I[t] = sum_h w_h * ReLU(q_h . k_t)` with `w = weights_proj(x) * Di^-0.5 * Hi^-0.5`, queries RoPE'd at p
    and FP4 fake-quantised (1x32, UE8M0); keys are the FP4 index-key cache rows.
    """

    def __init__(self, config: ModelConfig, owns_keys: bool, fmt: str, dtype: torch.dtype, device=None):
        super().__init__()
        hi, di = config.index_n_heads, config.index_head_dim
        self.n_heads, self.head_dim = hi, di
        self.wq_b = Linear(config.q_lora_rank, hi * di, fmt, dtype, device)
        self.weights_proj = Linear(config.hidden_size, hi, "dense", dtype, device)
        if owns_keys:
            self.wk = Linear(config.head_dim, di, "dense", dtype, device)
            self.k_norm = RMSNorm(di, config.rms_norm_eps, dtype, device)
        else:
            self.wk = None
            self.k_norm = None

    def keys(self, latent: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE index keys `k_norm(wk latent)` [B, T, Di] from bank latents [B, T, hd]."""
        return self.k_norm(self.wk(latent))

    def scores(self, qr: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               key_codes: torch.Tensor, key_scales: torch.Tensor, n_visible: torch.Tensor) -> torch.Tensor:
        """Index scores [B, T, N] FP32 over the N cache rows (-inf for rows >= n_visible).

        Args:
            qr: [B, T, q_lora] (the q_norm output); x: [B, T, d] (the attention-norm output).
            cos, sin: [B, T, R/2] of the query positions (compress table).
            key_codes [B, N, Di/2], key_scales [B, N, Di/32]: the index-key cache (trash row excluded).
            n_visible: [B, T] visible rows per query.
        """
        b, t, _ = qr.shape
        q = self.wq_b(qr).view(b, t, self.n_heads, self.head_dim)
        q = fake_quant_fp4_ue8m0_1x32(apply_rope(q, cos[:, :, None], sin[:, :, None]))
        w = self.weights_proj(x).float() * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        k = dequantize_fp4_ue8m0_1x32(key_codes, key_scales, torch.float32)
        logits = torch.einsum("bthd,bnd->bthn", q.float(), k)
        s = (torch.relu(logits) * w[..., None]).sum(dim=2)
        n = key_codes.shape[1]
        vis = torch.arange(n, device=s.device) < n_visible[..., None]
        return torch.where(vis, s, torch.full_like(s, float("-inf")))
