"""DeepSeek-V4.1 Flash: the top-level model over its blocks (`block.py`) (MODEL.md §2.3, §3).

Static caches in the gpt-fast manner: `setup_cache(batch_size, max_seq_len)` preallocates every cache,
and `model(input_ids, positions)` runs prefill (many positions per sequence) or a decode step (one
position) with static shapes, no host synchronisation and no data-dependent Python control flow.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ref.formats import dequantize_fp8_block, quantize_fp8_block
from ..ref.mhc import mhc_collapse
from .attention import Attention
from .block import WEIGHT_MODES, Block
from .config import ModelConfig
from .engram import EngramHash, engram_lookback, engram_row_ids
from .linear import Linear
from .norm import RMSNorm

__all__ = ["Block", "DeepseekV41Flash", "WEIGHT_MODES"]


class DeepseekV41Flash(nn.Module):
    """DeepSeek-V4.1 Flash in eager PyTorch: the backbone and, as `mtp`, the DSpark draft stages (`dspark.DSpark`).

    Args:
        config: a `ModelConfig` (e.g. `ModelConfig.preset("tiny")`).
        weight_mode: `checkpoint` (dense FP8 E4M3 32x32 UE8M0, routed experts FP4 E2M1 1x32 UE8M0, explicit
            dequantise before each matmul, FP8 1x32 activation fake-quant) or `bf16` (all weights dense).
        dtype: activation / dense-weight dtype (bf16 on GPU; fp32 for CPU numerics tests).
        device: where parameters are allocated (weights are uninitialised until `init_random` or loading).
        token_map: optional int64 [vocab] tokenizer-derived Engram compressed ids; default identity (requires
            `engram_compressed_vocab_size == vocab_size`).
    Forward:
        `forward(input_ids [B, T] int64, positions [B, T] int64, last_only=False) -> logits FP32 [B, T, V]`
        (or [B, 1, V] with `last_only`). Positions must be contiguous per sequence and continue the cache.
        With `return_features=True` it returns `(logits, features)`, features [B, T, n_targets * d] in the model
        dtype: the DSpark target feature of every row (MODEL.md §2.11).
    Raises:
        ValueError: unknown weight mode; Engram layers with a non-identity vocab and no `token_map`.
        RuntimeError: forward before `setup_cache`.
    Source: MODEL.md §3 (decode-step data flow), [R41] `Transformer`.
    """

    def __init__(self, config: ModelConfig, weight_mode: str = "checkpoint", dtype: torch.dtype = torch.bfloat16,
                 device=None, token_map: torch.Tensor | None = None):
        super().__init__()
        if weight_mode not in WEIGHT_MODES:
            raise ValueError(f"unknown weight_mode {weight_mode!r}; expected one of {WEIGHT_MODES}")
        c = self.config = config
        self.weight_mode, self.dtype = weight_mode, dtype
        d = c.hidden_size
        self.embed = nn.Embedding(c.vocab_size, d, dtype=dtype, device=device)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(c, i, weight_mode, dtype, device) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(d, c.rms_norm_eps, dtype, device)
        self.head = Linear(d, c.vocab_size, "dense", dtype, device)
        if c.num_dspark_stages > 0:
            from .dspark import DSpark  # local: most configs have no DSpark stages
            self.mtp = DSpark(c, weight_mode, dtype, device)
        else:
            self.mtp = None
        self.engram_layers = [i for i in c.engram_layer_ids]
        if self.engram_layers:
            if token_map is None and c.engram_compressed_vocab_size != c.vocab_size:
                raise ValueError(
                    f"config {c.name!r} has Engram layers with engram_compressed_vocab_size="
                    f"{c.engram_compressed_vocab_size} != vocab_size={c.vocab_size}: pass the tokenizer's "
                    "token_map (the identity map only fits configs whose compressed vocab equals the vocab)")
            self.hash = EngramHash(c)
            tm = token_map if token_map is not None else torch.arange(c.vocab_size)
            self.register_buffer("token_map", tm.to(torch.int64).to(device), persistent=False)
            self.pad_cid = int(tm[c.pad_token_id])
            for i in self.engram_layers:
                self.register_buffer(f"engram_mult_{i}", torch.tensor(self.hash.multipliers(i), dtype=torch.int64,
                                                                      device=device), persistent=False)
                self.register_buffer(f"engram_primes_{i}", torch.tensor(self.hash.primes(i), dtype=torch.int64,
                                                                        device=device), persistent=False)
                self.register_buffer(f"engram_offsets_{i}", torch.tensor(self.hash.offsets(i), dtype=torch.int64,
                                                                         device=device), persistent=False)
        self.register_buffer("engram_history", None, persistent=False)
        self.max_seq_len = 0
        self.batch_size = 0

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def init_random(self, seed: int = 0) -> "DeepseekV41Flash":
        """Fill every weight with seeded random values (on the weights' device), quantising as stored.

        Projections N(0, 1/fan_in); norms 1; embedding N(0, 1); mHC `fn` N(0, 1/(4d)), base N(0, 1), scale
        U(0.5, 1.5); attention sinks N(0, 1). Deterministic for a given seed and device.
        """
        dev = self.embed.weight.device
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        self.embed.weight.copy_(torch.randn(self.embed.weight.shape, generator=gen, device=dev))
        done: list = []
        for name, mod in self.named_modules():
            if mod is self or any(name == p or name.startswith(p + ".") for p in done):
                continue
            init = getattr(mod, "init_random", None)
            if init is not None:
                init(gen)
                done.append(name)  # the module initialised its own children
            if isinstance(mod, Block):
                for site in ("attn", "ffn"):
                    fn = getattr(mod, f"hc_{site}_fn")
                    fn.copy_(torch.randn(fn.shape, generator=gen, device=dev) / math.sqrt(fn.shape[1]))
                    base = getattr(mod, f"hc_{site}_base")
                    base.copy_(torch.randn(base.shape, generator=gen, device=dev))
                    sc = getattr(mod, f"hc_{site}_scale")
                    sc.copy_(0.5 + torch.rand(sc.shape, generator=gen, device=dev))
            if isinstance(mod, Attention):
                mod.attn_sink.copy_(torch.randn(mod.attn_sink.shape, generator=gen, device=dev))
                # wo_a lies on the FP8 32x32 grid, as after the checkpoint's dequantisation.
                w = torch.randn(mod.wo_a.weight.shape, generator=gen, device=dev) / math.sqrt(mod.wo_a.in_features)
                mod.wo_a.weight.copy_(dequantize_fp8_block(*quantize_fp8_block(w), mod.wo_a.weight.dtype))
                done.append(name + ".wo_a")
        return self

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: str) -> None:
        """Write config.json + safetensors shards with the V4.1 tensor names (see `checkpoint.save_pretrained`)."""
        from .checkpoint import save_pretrained
        save_pretrained(self, path)

    @classmethod
    def from_pretrained(cls, path: str, weight_mode: str = "checkpoint", dtype: torch.dtype = torch.bfloat16,
                        device=None, token_map: torch.Tensor | None = None) -> "DeepseekV41Flash":
        """Load a checkpoint directory (see `checkpoint.from_pretrained` for the errors it raises)."""
        from .checkpoint import from_pretrained
        return from_pretrained(cls, path, weight_mode, dtype, device, token_map)

    # ------------------------------------------------------------------ caches
    def setup_cache(self, batch_size: int, max_seq_len: int) -> None:
        """Preallocate every cache for `batch_size` sequences of up to `max_seq_len` tokens.

        Raises:
            ValueError: non-positive sizes, or max_seq_len > config.max_position_embeddings.
        """
        if batch_size < 1 or max_seq_len < 1:
            raise ValueError(f"batch_size and max_seq_len must be positive, got {batch_size}, {max_seq_len}")
        if max_seq_len > self.config.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        from .speculative import forget_journals
        forget_journals(self)  # speculative round journals hold the old caches: free them before allocating anew
        dev = self.embed.weight.device
        for layer in self.layers:
            layer.attn.setup_cache(batch_size, max_seq_len, dev)
        if self.mtp is not None:
            self.mtp.setup_cache(batch_size, dev)
        if self.engram_layers:
            self.register_buffer("engram_history", torch.full((batch_size, max_seq_len), -1, dtype=torch.int64,
                                                              device=dev), persistent=False)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len

    def reset_cache(self) -> None:
        """Empty every cache in place (between benchmark runs); addresses stay the same."""
        for layer in self.layers:
            layer.attn.reset_cache()
        if self.mtp is not None:
            self.mtp.reset_cache()
        if self.engram_history is not None:
            self.engram_history.fill_(-1)

    def cache_bytes(self) -> dict:
        """Allocated cache bytes: `global` (bank + index keys), `window` (rings), `state` (compressor, history),
        `dspark_window` (the DSpark stages' rings)."""
        out = {"global": 0, "window": 0, "state": 0, "dspark_window": 0}
        for layer in self.layers:
            a = layer.attn
            for name, kind in (("bank_codes", "global"), ("bank_scales", "global"), ("key_codes", "global"),
                               ("key_scales", "global"), ("ring_codes", "window"), ("ring_scales", "window")):
                t = getattr(a, name, None)
                if t is not None:
                    out[kind] += t.numel() * t.element_size()
            if a.compressor is not None and a.compressor.kv_state is not None:
                out["state"] += 2 * a.compressor.kv_state.numel() * 4
        if self.engram_history is not None:
            out["state"] += self.engram_history.numel() * 8
        for st in (self.mtp if self.mtp is not None else ()):
            for t in (st.attn.ring_codes, st.attn.ring_scales):
                if t is not None:
                    out["dspark_window"] += t.numel() * t.element_size()
        return out

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last_only: bool = False,
                return_features: bool = False):
        """Logits FP32 [B, T or 1, V] for input_ids int64 [B, T] at positions int64 [B, T] (`last_only`: only the
        last position); with `return_features`, `(logits, features [B, T, n_targets * d])` (class docstring).
        Raises RuntimeError before `setup_cache`, ValueError for bad shapes, positions or batch size."""
        if self.max_seq_len == 0:
            raise RuntimeError("call setup_cache(batch_size, max_seq_len) before the forward")
        self._check_inputs(input_ids, positions)
        H, pre_mix, rows = self.embed_inputs(input_ids, positions)
        H, pre_mix, feats = self.run_layers(H, pre_mix, positions, rows, return_features)
        logits = self.final_logits(H, pre_mix, last_only)
        if return_features:
            return logits, feats
        return logits

    # The three pieces of `forward`, also the regions `dsv41.compiler.regional` compiles one by one.
    def embed_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Embedding -> residual streams H [B, T, hc, d] (model dtype), the first pre mix [B, T, hc] FP32 (stream
        0), and the Engram row ids {layer: int64 [B, T, R]} after recording the tokens in the Engram history
        (MODEL.md §2.10, §3 steps 1-2)."""
        b, t = input_ids.shape
        c = self.config
        x = self.embed(input_ids)
        H = x[:, :, None, :].expand(b, t, c.hc_mult, c.hidden_size).contiguous()
        pre_mix = F.one_hot(torch.zeros(b, t, dtype=torch.int64, device=x.device), c.hc_mult).to(torch.float32)
        rows = {}
        if self.engram_layers:
            bi = torch.arange(b, device=x.device)[:, None].expand(b, t)
            self.engram_history.index_put_((bi, positions), self.token_map[input_ids])
            u = engram_lookback(self.engram_history, positions, c.engram_max_ngram, self.pad_cid)
            for i in self.engram_layers:
                rows[i] = engram_row_ids(u, getattr(self, f"engram_mult_{i}"), getattr(self, f"engram_primes_{i}"),
                                         getattr(self, f"engram_offsets_{i}"), c.engram_n_heads)
        return H, pre_mix, rows

    def run_layers(self, H: torch.Tensor, pre_mix: torch.Tensor, positions: torch.Tensor, rows: dict,
                   return_features: bool = False, layers=None):
        """Every backbone layer in order -> (H, pre_mix, features or None); `layers` replaces `self.layers` with
        callables of the same signature (e.g. compiled regions). Features: [B, T, n_targets * d], the DSpark
        target layers' INPUT residual averaged over the streams (MODEL.md §2.11)."""
        c = self.config
        shared: dict = {}
        feats = []
        for i, layer in enumerate(self.layers if layers is None else layers):
            if return_features and i in c.dspark_target_layer_ids:
                feats.append(H.mean(dim=2))
            H, pre_mix = layer(H, pre_mix, positions, shared, rows.get(i))
        return H, pre_mix, (torch.cat(feats, dim=-1) if return_features else None)

    def final_logits(self, H: torch.Tensor, pre_mix: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Final collapse + RMSNorm + head -> logits FP32 [B, T or 1, V] (MODEL.md §3 step 3; the reference keeps
        the head in FP32)."""
        if last_only:
            H, pre_mix = H[:, -1:], pre_mix[:, -1:]
        h = self.norm(mhc_collapse(H, pre_mix))
        return F.linear(h.float(), self.head.weight.float())

    def _check_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, values: bool = True) -> None:
        """Shape/dtype checks always (free); value checks only in eager mode with `values` (one host sync, never
        traced)."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an int64 [batch, seq] tensor, got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if positions.shape != input_ids.shape or positions.dtype != torch.int64:
            raise ValueError(f"positions must be int64 with the shape of input_ids {tuple(input_ids.shape)}, got "
                             f"{positions.dtype} {tuple(positions.shape)}")
        if input_ids.shape[0] > self.batch_size:
            raise ValueError(f"batch of {input_ids.shape[0]} sequences exceeds the cache's batch_size="
                             f"{self.batch_size} (setup_cache)")
        if values and not torch.compiler.is_compiling():
            lo, hi = torch.aminmax(positions)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= self.max_seq_len:
                raise ValueError(f"positions must lie in [0, max_seq_len={self.max_seq_len}), got [{lo}, {hi}]")
