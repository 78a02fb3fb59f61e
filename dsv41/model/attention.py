"""The V4.1 attention block: q low-rank path, shared K=V latent, window ring, CSA2 bank, sink (MODEL.md §2.4-§2.8).

One forward serves prefill (many positions per sequence) and decode (one position): new tokens'
window entries are FP8 fake-quantised and attend together with the ring entries written before this
call; bank rows are selected by the indexer of the latest index source (published in `shared`).
Queries are processed in static chunks so prefill memory stays bounded.

Caches (allocated by `setup_cache`, never part of the state dict):
- window ring `ring_codes` uint8 [B, W, hd] (E4M3) + `ring_scales` uint8 [B, W, hd/32] (UE8M0): 528 B/entry.
- kv sources: `bank_codes` uint8 [B, N+1, hd/2] (E2M1) + `bank_scales` uint8 [B, N+1, hd/16] (E4M3):
  288 B/entry; `key_codes` [B, N+1, Di/2] + `key_scales` [B, N+1, Di/32] (UE8M0): 68 B/entry. Row N is the
  trash row written by tokens that complete no group.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .csa import Compressor, Indexer, candidate_mask, select_topk, visible_rows
from ..ref.formats import (dequantize_fp4_e4m3_1x16, dequantize_fp8_1x32, quantize_fp4_e4m3_1x16,
                      quantize_fp4_ue8m0_1x32, quantize_fp8_1x32)
from .linear import Linear
from .norm import RMSNorm
from .rope import RotaryEmbedding, apply_rope

__all__ = ["Attention", "QUERY_CHUNK"]

#: Queries processed at once in prefill (bounds the [chunk, heads, keys] score tensors).
QUERY_CHUNK = 256


class Attention(nn.Module):
    """Attention of backbone layer `layer_id` with its CSA2 role (`swa`, `full`, `reindex`, `reuse`).

    Args:
        config: the model config; weight_mode: `checkpoint` (FP8 32x32 projections) or `bf16` (dense).
    Forward:
        x [B, T, d] (the attention-norm output), positions [B, T] int64 (contiguous per sequence),
        shared: per-forward dict where index sources publish `bank`, `keys`, `topk`, `candidates`.
        Returns [B, T, d] in x.dtype.
    Raises:
        RuntimeError: forward before `setup_cache`; a Reuse/Reindex layer with nothing published.
    Source: MODEL.md §2.4 (forward steps 1-7), §2.5 roles, [R41] `Attention.forward`.
    """

    def __init__(self, config: ModelConfig, layer_id: int, weight_mode: str, dtype: torch.dtype, device=None):
        super().__init__()
        if weight_mode not in ("checkpoint", "bf16"):
            raise ValueError(f"weight_mode must be 'checkpoint' or 'bf16', got {weight_mode!r}")
        c = config
        fmt = "fp8_block" if weight_mode == "checkpoint" else "dense"
        self.layer_id, self.dtype = layer_id, dtype
        self.role = c.layer_role(layer_id)
        self.ratio = c.compress_ratios[layer_id]
        self.n_heads, self.head_dim, self.rope_dim = c.num_attention_heads, c.head_dim, c.qk_rope_head_dim
        self.window, self.o_groups, self.o_lora = c.sliding_window, c.o_groups, c.o_lora_rank
        self.index_topk = c.index_topk
        self.is_candidate_source = layer_id == c.candidate_source_layer_id
        self.cand_block, self.cand_blocks = c.candidate_block_size, c.candidate_topk_blocks
        d, hd, h = c.hidden_size, c.head_dim, c.num_attention_heads
        self.wq_a = Linear(d, c.q_lora_rank, fmt, dtype, device)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype, device)
        self.wq_b = Linear(c.q_lora_rank, h * hd, fmt, dtype, device)
        self.wkv = Linear(d, hd, fmt, dtype, device)
        self.kv_norm = RMSNorm(hd, c.rms_norm_eps, dtype, device)
        # wo_a is FP8 in the checkpoint but dequantised to BF16 at conversion ([R41]); grouped, block-diagonal.
        self.wo_a = Linear(h * hd // c.o_groups, c.o_groups * c.o_lora_rank, "dense", dtype, device)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, d, fmt, dtype, device)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32, device=device), requires_grad=False)
        self.rotary = RotaryEmbedding(c, "main" if self.ratio == 0 else "compress", device)
        self.compressor = Compressor(c, self.ratio, dtype, device) if self.role == "full" else None
        if self.role in ("full", "reindex"):
            self.indexer = Indexer(c, owns_keys=self.role == "full", fmt=fmt, dtype=dtype, device=device)
        else:
            self.indexer = None
        for name in ("ring_codes", "ring_scales", "bank_codes", "bank_scales", "key_codes", "key_scales"):
            self.register_buffer(name, None, persistent=False)
        self.cache_rows = 0

    # ------------------------------------------------------------------ caches
    def setup_cache(self, batch_size: int, max_seq_len: int, device) -> None:
        """Allocate the window ring and (kv sources) the bank, index keys and compressor state."""
        w, hd = self.window, self.head_dim
        buf = dict(persistent=False)
        self.register_buffer("ring_codes", torch.zeros(batch_size, w, hd, dtype=torch.uint8, device=device), **buf)
        self.register_buffer("ring_scales", torch.zeros(batch_size, w, hd // 32, dtype=torch.uint8, device=device),
                             **buf)
        if self.role == "full":
            n = -(-max_seq_len // self.ratio)
            self.cache_rows = n
            di = self.indexer.head_dim
            u8 = dict(dtype=torch.uint8, device=device)
            self.register_buffer("bank_codes", torch.zeros(batch_size, n + 1, hd // 2, **u8), **buf)
            self.register_buffer("bank_scales", torch.zeros(batch_size, n + 1, hd // 16, **u8), **buf)
            self.register_buffer("key_codes", torch.zeros(batch_size, n + 1, di // 2, **u8), **buf)
            self.register_buffer("key_scales", torch.zeros(batch_size, n + 1, di // 32, **u8), **buf)
            self.compressor.setup_cache(batch_size, device)

    def reset_cache(self) -> None:
        """Zero every cache in place (tensor addresses unchanged, so captured graphs stay valid)."""
        for name in ("ring_codes", "ring_scales", "bank_codes", "bank_scales", "key_codes", "key_scales"):
            t = getattr(self, name, None)
            if t is not None:
                t.zero_()
        if self.compressor is not None:
            self.compressor.reset_cache()

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, positions: torch.Tensor, shared: dict) -> torch.Tensor:
        """One attention sublayer: x [B, T, d] at positions int64 [B, T] -> [B, T, d] in x.dtype; reads and
        writes the static caches and publishes/reads CSA selections in `shared` (see the class docstring)."""
        if self.ring_codes is None:
            raise RuntimeError("Attention.forward before setup_cache(batch_size, max_seq_len)")
        b, t, _ = x.shape
        h, hd = self.n_heads, self.head_dim
        cos, sin = self.rotary(positions)
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(b, t, h, hd)
        q = apply_rope(q, cos[:, :, None], sin[:, :, None])
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        kv_codes, kv_scales = quantize_fp8_1x32(kv)
        kv = dequantize_fp8_1x32(kv_codes, kv_scales, x.dtype)

        if self.role != "swa":
            self._update_csa(x, qr, positions, cos, sin, shared)
            bank_codes, bank_scales = shared["bank"]
            topk = shared["topk"]
        ring = dequantize_fp8_1x32(self.ring_codes, self.ring_scales, x.dtype)
        ring_pos = self._ring_positions(positions[:, 0])

        outs = []
        for c0 in range(0, t, QUERY_CHUNK):
            c1 = min(t, c0 + QUERY_CHUNK)
            k0 = max(0, c0 - self.window + 1)
            keys = torch.cat((ring, kv[:, k0:c1]), dim=1)
            kpos = torch.cat((ring_pos, positions[:, k0:c1]), dim=1)
            qpos = positions[:, c0:c1]
            ok = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos[..., None]) \
                & (kpos[:, None, :] > qpos[..., None] - self.window)
            qc = q[:, c0:c1].float()
            s = torch.einsum("bthd,bsd->bths", qc, keys.float()) * hd ** -0.5
            s = torch.where(ok[:, :, None, :], s, torch.full_like(s, float("-inf")))
            if self.role != "swa":
                sel = topk[:, c0:c1]
                rows = sel.clamp(min=0)
                bi = torch.arange(b, device=x.device)[:, None, None]
                bank = dequantize_fp4_e4m3_1x16(bank_codes[bi, rows], bank_scales[bi, rows], torch.float32)
                sb = torch.einsum("bthd,btkd->bthk", qc, bank) * hd ** -0.5
                sb = torch.where((sel >= 0)[:, :, None, :], sb, torch.full_like(sb, float("-inf")))
                s = torch.cat((s, sb), dim=-1)
            # The sink only enlarges the denominator: softmax over [scores ; sink], sink column dropped.
            sink = self.attn_sink.view(1, 1, h, 1).expand(b, c1 - c0, h, 1)
            p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
            nw = keys.shape[1]
            o = torch.einsum("bths,bsd->bthd", p[..., :nw], keys.float())
            if self.role != "swa":
                o = o + torch.einsum("bthk,btkd->bthd", p[..., nw:], bank)
            outs.append(o.to(x.dtype))
        o = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        o = apply_rope(o, cos[:, :, None], sin[:, :, None], inverse=True)

        self._write_ring(kv_codes, kv_scales, positions)

        og = o.reshape(b, t, self.o_groups, h * hd // self.o_groups)
        wo_a = self.wo_a.weight.view(self.o_groups, self.o_lora, -1)
        u = torch.einsum("btgi,goi->btgo", og, wo_a.to(og.dtype)).reshape(b, t, self.o_groups * self.o_lora)
        return self.wo_b(u)

    # ------------------------------------------------------------------ helpers
    def _ring_positions(self, start: torch.Tensor) -> torch.Tensor:
        """Position held by each ring slot before this call: the latest q < start with q = slot (mod W); <0 = empty."""
        slots = torch.arange(self.window, device=start.device)
        last = start[:, None] - 1
        return last - torch.remainder(last - slots, self.window)

    def _write_ring(self, codes: torch.Tensor, scales: torch.Tensor, positions: torch.Tensor) -> None:
        n = min(positions.shape[1], self.window)
        pos = positions[:, -n:]
        bi = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(pos)
        slot = torch.remainder(pos, self.window)
        self.ring_codes.index_put_((bi, slot), codes[:, -n:])
        self.ring_scales.index_put_((bi, slot), scales[:, -n:])

    def _update_csa(self, x, qr, positions, cos, sin, shared: dict) -> None:
        """Compressor + index keys + bank write (kv sources), indexer and top-k (index sources)."""
        if self.role == "full":
            latent, gpos, rows = self.compressor(x, positions, trash_row=self.cache_rows)
            gcos, gsin = self.rotary(gpos)
            bi = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(rows)
            kc, ks = quantize_fp4_ue8m0_1x32(apply_rope(self.indexer.keys(latent), gcos, gsin))
            self.key_codes.index_put_((bi, rows), kc)
            self.key_scales.index_put_((bi, rows), ks)
            bc, bs = quantize_fp4_e4m3_1x16(apply_rope(latent, gcos, gsin))
            self.bank_codes.index_put_((bi, rows), bc)
            self.bank_scales.index_put_((bi, rows), bs)
            n = self.cache_rows
            shared["bank"] = (self.bank_codes[:, :n], self.bank_scales[:, :n])
            shared["keys"] = (self.key_codes[:, :n], self.key_scales[:, :n])
            shared["ratio"] = self.ratio
        if "bank" not in shared:
            raise RuntimeError(f"layer {self.layer_id} ({self.role}) reads a bank but no kv source published one")
        if self.indexer is None:
            if "topk" not in shared:
                raise RuntimeError(f"Reuse layer {self.layer_id} has no published top-k selection")
            return
        key_codes, key_scales = shared["keys"]
        n_vis = visible_rows(positions, shared["ratio"])
        sel = []
        for c0 in range(0, x.shape[1], QUERY_CHUNK):
            c1 = min(x.shape[1], c0 + QUERY_CHUNK)
            s = self.indexer.scores(qr[:, c0:c1], x[:, c0:c1], cos[:, c0:c1], sin[:, c0:c1], key_codes, key_scales,
                                    n_vis[:, c0:c1])
            if self.is_candidate_source:
                shared.setdefault("candidates", []).append(
                    candidate_mask(s, n_vis[:, c0:c1], self.cand_block, self.cand_blocks))
            elif self.role == "reindex":
                if "candidates" not in shared:
                    raise RuntimeError(f"Reindex layer {self.layer_id} has no candidate pool published")
                cand = shared["candidates"][c0 // QUERY_CHUNK]
                s = torch.where(cand, s, torch.full_like(s, float("-inf")))
            sel.append(select_topk(s, self.index_topk))
        shared["topk"] = torch.cat(sel, dim=1) if len(sel) > 1 else sel[0]
