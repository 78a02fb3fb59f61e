"""A Llama-style decoder spelled the way gpt-fast spells it: a third party's model for dsv41 to compile.

Written from scratch for this repository after the layout of `pytorch-labs/gpt-fast`'s `model.py` (a `ModelArgs`
dataclass with named presets, one small module per block, a static `KVCache` written at `input_pos`), with the
RoPE of Meta's reference Llama (`torch.polar` frequencies, `view_as_complex` on interleaved pairs of channels).
Nothing here imports dsv41: `dsv41 bench --model` loads this file by path (`dsv41/bench_llama.py`).

Shapes: B batch, S new tokens of one call, T = `max_seq_length` cache positions, H query heads, Hkv KV heads,
D head_dim, E = dim = H * D. Weights random (`init_weights`: N(0, 0.02), norms 1) from a seeded generator.

Public names: `ModelArgs`, `PRESETS`, `KVCache`, `Transformer`, `build`, `init_weights`,
`precompute_freqs_cis`, `apply_rotary_emb`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ModelArgs", "PRESETS", "KVCache", "Transformer", "build", "init_weights", "precompute_freqs_cis",
           "apply_rotary_emb"]


@dataclass
class ModelArgs:
    """Sizes of a Llama decoder (gpt-fast's names). `n_local_heads` is the number of KV heads (GQA when below
    `n_head`); `head_dim` = dim // n_head. Llama 3's long-context RoPE scaling is not modelled: only the shapes
    and `rope_base` of the presets matter for decode speed."""
    n_layer: int = 2
    dim: int = 64
    n_head: int = 4
    n_local_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 256
    rope_base: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        """Channels per head, dim // n_head."""
        return self.dim // self.n_head

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        """The preset `name` of `PRESETS`. Raises: ValueError naming the presets for an unknown one."""
        if name not in PRESETS:
            raise ValueError(f"unknown Llama preset {name!r}; expected one of {', '.join(PRESETS)}")
        return cls(**PRESETS[name])


#: Named sizes: Llama-3.2-1B, Llama-3.1-8B (untied head, RoPE theta 500,000) and a toy for CPU tests.
PRESETS = {
    "llama-1b": dict(n_layer=16, dim=2048, n_head=32, n_local_heads=8, intermediate_size=8192, vocab_size=128256),
    "llama-8b": dict(n_layer=32, dim=4096, n_head=32, n_local_heads=8, intermediate_size=14336, vocab_size=128256),
    "llama-tiny": dict(n_layer=2, dim=64, n_head=4, n_local_heads=2, intermediate_size=128, vocab_size=256),
}


class KVCache(nn.Module):
    """The static cache of one layer: `k_cache`, `v_cache` [B, Hkv, T, D], written in place at `input_pos`."""

    def __init__(self, max_batch_size: int, max_seq_length: int, n_heads: int, head_dim: int,
                 dtype: torch.dtype, device=None):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k_val: Tensor, v_val: Tensor) -> tuple[Tensor, Tensor]:
        """Write k_val, v_val [B, Hkv, S, D] at positions `input_pos` (int64 [S]) and return the whole caches
        [B, Hkv, T, D] (positions not written yet hold zeros; the causal mask hides them)."""
        self.k_cache.index_copy_(2, input_pos, k_val)
        self.v_cache.index_copy_(2, input_pos, v_val)
        return self.k_cache, self.v_cache


def precompute_freqs_cis(seq_len: int, head_dim: int, base: float, device=None) -> Tensor:
    """complex64 [seq_len, head_dim // 2]: e^(i * t * base^(-2j / head_dim)) for position t and pair j."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """Rotate channel pairs (2j, 2j + 1) of x [B, S, heads, D] by freqs_cis complex64 [S, D / 2], in FP32;
    returns x's dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = pairs * freqs_cis.view(1, x.shape[1], 1, pairs.shape[-1])
    return torch.view_as_real(turned).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in FP32 and cast back before the weight (gpt-fast)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    """GQA self-attention: one fused `wqkv` projection, RoPE on q and k, the static cache, KV heads repeated
    (`repeat_interleave`) to the query heads, `scaled_dot_product_attention` under a boolean mask, `wo`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = args.n_head, args.n_local_heads, args.head_dim
        kv = args.n_local_heads * args.head_dim
        self.wqkv = nn.Linear(args.dim, args.dim + 2 * kv, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        b, s, dim = x.shape
        kv = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([dim, kv, kv], dim=-1)
        q = apply_rotary_emb(q.view(b, s, self.n_head, self.head_dim), freqs_cis)
        k = apply_rotary_emb(k.view(b, s, self.n_local_heads, self.head_dim), freqs_cis)
        v = v.view(b, s, self.n_local_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = self.kv_cache.update(input_pos, k, v)
        rep = self.n_head // self.n_local_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, input_pos: Tensor, freqs_cis: Tensor, mask: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder: token embedding, `n_layer` blocks, final norm, untied output head.

    Call `setup_caches(max_batch_size, max_seq_length)` before `forward`.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.config = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_batch_size = self.max_seq_length = -1

    def setup_caches(self, max_batch_size: int, max_seq_length: int) -> None:
        """Allocate every layer's `KVCache` [max_batch_size, Hkv, max_seq_length, D] (zeros, the weights' dtype and
        device), the RoPE table and the boolean causal mask [T, T]. Calling it again replaces them (zeroed)."""
        w = self.output.weight
        a = self.config
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, max_seq_length, a.n_local_heads, a.head_dim,
                                               w.dtype, w.device)
        # Buffers, not parameters, and made after any `.to(dtype)`: a complex table cast to a real dtype would lose
        # its imaginary part.
        self.register_buffer("freqs_cis", precompute_freqs_cis(max_seq_length, a.head_dim, a.rope_base, w.device),
                             persistent=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool,
                                                                  device=w.device)), persistent=False)

    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        """idx int64 [B, S] at positions input_pos int64 [S] -> logits [B, S, vocab] in the weights' dtype.
        Raises: RuntimeError when `setup_caches` has not run."""
        if self.max_seq_length < 0:
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before forward")
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))


def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place: norm weights (1-D) with 1, the others N(0, 0.02), from a generator on the
    parameters' device seeded with `seed` (the same seed and device give the same weights)."""
    g = None
    with torch.no_grad():
        for p in model.parameters():
            if g is None:
                g = torch.Generator(p.device).manual_seed(seed)
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def build(name: str | ModelArgs, *, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0,
          max_batch_size: int = 1, max_seq_length: int = 256) -> Transformer:
    """A `Transformer` of preset `name` (or `ModelArgs`) with random weights (`init_weights(seed)`) in `dtype` on
    `device`, caches set up, in eval mode. The weights are allocated once, in `dtype` (an 8B model never exists in
    FP32). Raises: ValueError for an unknown preset."""
    args = name if isinstance(name, ModelArgs) else ModelArgs.from_name(name)
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    model = model.to_empty(device=device)
    init_weights(model, seed)
    model.setup_caches(max_batch_size, max_seq_length)
    return model.eval()
