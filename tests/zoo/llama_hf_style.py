"""The same Llama decoder spelled the way Hugging Face transformers' `modeling_llama` spells it.

Written from scratch for this repository after that file's layout (separate q/k/v/o and gate/up/down projections,
`rotate_half` RoPE from cos/sin tables of a rotary module, KV heads repeated by `expand` + `reshape`, eager
attention with an additive float mask and an FP32 softmax, an RMSNorm that multiplies the weight by the hidden
state cast back to its dtype), with a static cache written by indexed assignment at `cache_position`.

It computes what `llama_gptfast.Transformer` computes, with the channels of each q / k head in the other order
(HF pairs channel j with j + D/2, Meta's complex RoPE pairs 2j with 2j + 1): `load_gptfast_state` permutes the q
and k rows accordingly, so the two spellings give the same logits for the same weights.

Public names: `LlamaConfig`, `StaticCache`, `LlamaForCausalLM`, `rotate_half`, `repeat_kv`, `config_from_gptfast`,
`load_gptfast_state`, `build`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LlamaConfig", "StaticCache", "LlamaForCausalLM", "rotate_half", "repeat_kv", "config_from_gptfast",
           "load_gptfast_state", "build"]


@dataclass
class LlamaConfig:
    """Sizes with HF's names; defaults are the `llama-tiny` toy."""
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        """hidden_size // num_attention_heads."""
        return self.hidden_size // self.num_attention_heads


def config_from_gptfast(args) -> LlamaConfig:
    """The `LlamaConfig` of a `llama_gptfast.ModelArgs` (read by attribute, no import)."""
    return LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.intermediate_size,
                       num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                       num_key_value_heads=args.n_local_heads, rms_norm_eps=args.norm_eps,
                       rope_theta=args.rope_base)


class StaticCache(nn.Module):
    """Preallocated keys and values of every layer, `key_cache[i]` / `value_cache[i]` [B, Hkv, T, D]."""

    def __init__(self, config: LlamaConfig, max_batch_size: int, max_cache_len: int, dtype, device):
        super().__init__()
        shape = (max_batch_size, config.num_key_value_heads, max_cache_len, config.head_dim)
        self.max_cache_len = max_cache_len
        for i in range(config.num_hidden_layers):
            self.register_buffer(f"key_{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"value_{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_position: Tensor):
        """Store key / value states [B, Hkv, S, D] of layer `layer_idx` at cache_position int64 [S]; return that
        layer's whole cache (keys, values) [B, Hkv, T, D]."""
        k, v = getattr(self, f"key_{layer_idx}"), getattr(self, f"value_{layer_idx}")
        k[:, :, cache_position] = key_states
        v[:, :, cache_position] = value_states
        return k, v


class LlamaRMSNorm(nn.Module):
    """weight * (h / rms(h)).to(input dtype), h in FP32."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    """cos / sin [B, S, D] (FP32 angles, cast to x's dtype) of position_ids [B, S]; each frequency appears twice,
    for channel j and j + D/2."""

    def __init__(self, config: LlamaConfig, device=None):
        super().__init__()
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states: Tensor, n_rep: int) -> Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * n_rep, T, D], each KV head repeated for its n_rep query heads."""
    b, hkv, t, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    return hidden_states[:, :, None, :, :].expand(b, hkv, n_rep, t, d).reshape(b, hkv * n_rep, t, d)


class LlamaAttention(nn.Module):
    """q/k/v/o projections, rotate_half RoPE, the static cache, repeat_kv, eager attention (FP32 softmax)."""

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor], attention_mask: Tensor,
                past_key_values: StaticCache, cache_position: Tensor) -> Tensor:
        b, s, _ = hidden_states.shape
        shape = (b, s, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = past_key_values.update(k, v, self.layer_idx, cache_position)
        rep = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling + attention_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """down_proj(silu(gate_proj x) * up_proj x)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block."""

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, cache_position):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask,
                                       past_key_values, cache_position)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm, the rotary module."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """The decoder with its LM head; `forward(idx [B, S] int64, input_pos [S] int64) -> logits [B, S, vocab]`.
    Call `setup_caches(max_batch_size, max_seq_length)` first."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.past_key_values: StaticCache | None = None

    def setup_caches(self, max_batch_size: int, max_seq_length: int) -> None:
        """A zeroed `StaticCache` [max_batch_size, Hkv, max_seq_length, D] per layer in the weights' dtype; the
        rotary table recomputed on the weights' device (FP32)."""
        w = self.lm_head.weight
        self.past_key_values = StaticCache(self.config, max_batch_size, max_seq_length, w.dtype, w.device)
        self.model.rotary_emb = LlamaRotaryEmbedding(self.config, w.device)

    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        """Logits [B, S, vocab] of tokens idx [B, S] at cache positions input_pos int64 [S].
        Raises: RuntimeError when `setup_caches` has not run."""
        cache = self.past_key_values
        if cache is None:
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before forward")
        hidden = self.model.embed_tokens(idx)
        position_ids = input_pos[None, :].expand(idx.shape[0], -1)
        position_embeddings = self.model.rotary_emb(hidden, position_ids)
        # Additive mask [1, 1, S, T]: 0 where the key position is at or before the query's, the dtype's min after.
        keys = torch.arange(cache.max_cache_len, device=idx.device)
        mask = torch.zeros(keys.shape[0], dtype=hidden.dtype, device=idx.device).expand(idx.shape[1], -1)
        mask = mask.masked_fill(keys[None, :] > input_pos[:, None], torch.finfo(hidden.dtype).min)[None, None]
        for layer in self.model.layers:
            hidden = layer(hidden, position_embeddings, mask, cache, input_pos)
        return self.lm_head(self.model.norm(hidden))


def _hf_rows_of_meta_rope(w: Tensor, n_heads: int) -> Tensor:
    """q / k projection rows [n_heads * D, in] in Meta's interleaved RoPE order -> HF's half-split order: within a
    head, HF row j < D/2 is Meta row 2j and HF row j + D/2 is Meta row 2j + 1."""
    out_features, in_features = w.shape
    d = out_features // n_heads
    return w.view(n_heads, d // 2, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def load_gptfast_state(model: LlamaForCausalLM, state: dict) -> LlamaForCausalLM:
    """Copy a `llama_gptfast.Transformer` state dict into `model` (same sizes): `wqkv` split into q/k/v with the
    q and k rows permuted to the half-split RoPE order, w1/w3/w2 -> gate/up/down, norms, embedding and head.
    Returns `model`. Raises: KeyError / RuntimeError when the sizes or names do not match."""
    c = model.config
    kv = c.num_key_value_heads * c.head_dim
    new = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"],
           "lm_head.weight": state["output.weight"]}
    for i in range(c.num_hidden_layers):
        g, h = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = state[g + "attention.wqkv.weight"].split([c.hidden_size, kv, kv], dim=0)
        new[h + "self_attn.q_proj.weight"] = _hf_rows_of_meta_rope(q, c.num_attention_heads)
        new[h + "self_attn.k_proj.weight"] = _hf_rows_of_meta_rope(k, c.num_key_value_heads)
        new[h + "self_attn.v_proj.weight"] = v
        new[h + "self_attn.o_proj.weight"] = state[g + "attention.wo.weight"]
        new[h + "mlp.gate_proj.weight"] = state[g + "feed_forward.w1.weight"]
        new[h + "mlp.up_proj.weight"] = state[g + "feed_forward.w3.weight"]
        new[h + "mlp.down_proj.weight"] = state[g + "feed_forward.w2.weight"]
        new[h + "input_layernorm.weight"] = state[g + "attention_norm.weight"]
        new[h + "post_attention_layernorm.weight"] = state[g + "ffn_norm.weight"]
    model.load_state_dict(new)  # the caches and the rotary table are non-persistent buffers: not in a state dict
    return model


def build(config: LlamaConfig, *, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0,
          max_batch_size: int = 1, max_seq_length: int = 256) -> LlamaForCausalLM:
    """A model of `config` with random weights (norms 1, the rest N(0, 0.02) from a generator seeded with `seed`
    on `device`), caches set up, in eval mode."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    model = model.to_empty(device=device)
    g = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02, generator=g)
    model.setup_caches(max_batch_size, max_seq_length)
    return model.eval()
