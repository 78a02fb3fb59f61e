"""Engram: hashed n-gram memory added to the four-stream residual at layers 1 and 14 (MODEL.md §2.10).

Three pieces:
- `EngramHash`: the deterministic, pure-Python constants (odd int64 multipliers per layer, the
  consecutive-prime bucket sizes and their offsets into the layer's table).
- `engram_lookback` + `engram_row_ids`: static-shape tensor code turning compressed token ids (cids)
  into per-token table row ids (rolling XOR hash of u_s * m_s, one bucket per (n-gram order, head)).
- `Engram`: the module (table `embed`, projection `wkv`, gate weights `q_weight`, `k_weight`) that
  looks rows up, projects them to four keys and one value, and adds the gated value to each stream.

Everything in a forward is static-shape and host-sync-free (capturable with
`torch.compile(fullgraph=True)`). Sources: MODEL.md §2.10, §2.13 (names), §4 (reduced configs);
[R41] `inference/engram.py` and `inference/model.py`; [TK] `engram_gate`; [P] Engram arXiv 2601.07372.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import sympy
import torch
from torch import nn

from .config import ModelConfig
from ..ref.engram import engram_row_ids, engram_update
from ..ref.formats import dequantize_fp8_1x32, quantize_fp8_1x32
from .linear import Linear

__all__ = ["EngramHash", "engram_lookback", "engram_row_ids", "engram_update", "EngramTable", "Engram",
           "DEAD_CID"]

#: History entry of a token Engram must not see (image tokens, padding): it and everything older
#: become the pad cid in the look-back.
DEAD_CID = -1

#: Weight modes (same meaning as in `dsv41.model.moe`).
_WEIGHT_MODES = ("checkpoint", "bf16")

#: Rows generated per chunk by `EngramTable.init_random` (bounds the FP32 temporary: 64K x row_dim).
_INIT_CHUNK_ROWS = 65536

#: Standard deviation of random gate-weight perturbations around 1 (`q_weight`, `k_weight`).
_GATE_WEIGHT_STD = 0.1


def _check_weight_mode(weight_mode: str) -> None:
    if weight_mode not in _WEIGHT_MODES:
        raise ValueError(f"unknown weight_mode {weight_mode!r}; expected one of {_WEIGHT_MODES}")


class EngramHash:
    """Hash constants of every Engram layer of a config, computed once in pure Python.

    - Multipliers of layer L: `engram_max_ngram` odd values `2*v + 1`, v drawn by
      `numpy.random.default_rng(10007 * L).integers(0, ((2**63 - 1) // Vc) // 2, size=max_ngram)`
      with Vc = `engram_compressed_vocab_size` (the bound keeps every product u * m in int64).
    - Primes: walking layers in `engram_layer_ids` order, then n-gram orders k = 1..max_ngram-1
      (2-gram .. max-gram), then heads e = 0..n_heads-1, each bucket size is the next prime after the
      previous one, starting above `engram_vocab_size - 1` (so all primes are consecutive primes
      >= engram_vocab_size, none used twice).
    - Offsets: exclusive prefix sum of a layer's primes in (order, head) order; rows = their sum.

    Lists are flattened order-major: entry `k_idx * n_heads + e` is order k_idx+1 (the (k_idx+2)-gram),
    head e.

    Raises:
        ValueError: from the accessors, for a layer that is not an Engram layer.
    Source: MODEL.md §2.10 steps 4-6 (reproduces the full config's 384,006,168 / 384,016,682 rows).
    """

    def __init__(self, config: ModelConfig):
        self.layer_ids = list(config.engram_layer_ids)
        self.max_ngram = config.engram_max_ngram
        self.n_heads = config.engram_n_heads
        vc = config.engram_compressed_vocab_size
        bound = ((2 ** 63 - 1) // vc) // 2
        self._mult: Dict[int, List[int]] = {}
        self._primes: Dict[int, List[int]] = {}
        prev = config.engram_vocab_size - 1
        for layer in self.layer_ids:
            draws = np.random.default_rng(10007 * layer).integers(0, bound, size=self.max_ngram)
            self._mult[layer] = [2 * int(v) + 1 for v in draws]
            primes = []
            for _ in range((self.max_ngram - 1) * self.n_heads):
                prev = int(sympy.nextprime(prev))
                primes.append(prev)
            self._primes[layer] = primes

    def _check(self, layer: int) -> None:
        if layer not in self._primes:
            raise ValueError(f"layer {layer} is not an Engram layer; Engram layers: {self.layer_ids}")

    def multipliers(self, layer: int) -> List[int]:
        """The `max_ngram` odd multipliers of Engram layer `layer` (Python ints, each < 2^63 / Vc)."""
        self._check(layer)
        return list(self._mult[layer])

    def primes(self, layer: int) -> List[int]:
        """The `(max_ngram - 1) * n_heads` bucket sizes of layer `layer`, flattened order-major."""
        self._check(layer)
        return list(self._primes[layer])

    def offsets(self, layer: int) -> List[int]:
        """Row offset of each bucket of layer `layer` (exclusive prefix sum of `primes(layer)`)."""
        self._check(layer)
        out, acc = [], 0
        for p in self._primes[layer]:
            out.append(acc)
            acc += p
        return out

    def num_rows(self, layer: int) -> int:
        """Table rows of layer `layer` (sum of its primes)."""
        self._check(layer)
        return sum(self._primes[layer])


def engram_lookback(history: torch.Tensor, positions: torch.Tensor, max_ngram: int, pad_cid: int) -> torch.Tensor:
    """The n-gram tokens of each query position: `u_s = history[b, p - s]` for s = 0..max_ngram-1.

    Once `p - s < 0` or a DEAD (-1) entry is met, that look-back and every older one are `pad_cid`
    (the cut is cumulative: a live token behind a DEAD one is not used).

    Args:
        history: [B, S] int64 compressed token ids per absolute position (DEAD_CID = -1 for tokens
            Engram must not see).
        positions: [B, T] int64 absolute positions of the query tokens, expected in [0, S); gather
            indices are clamped into range so out-of-range positions read a wrong but valid entry
            instead of faulting (checking would need a host sync).
        max_ngram: number of look-backs (engram_max_ngram). pad_cid: cid of the pad token (M[2]).
    Returns:
        [B, T, max_ngram] int64.
    Raises:
        ValueError: wrong ranks/batch sizes or dtypes.
    Source: MODEL.md §2.10 step 3; [R41] `inference/engram.py`.
    """
    if history.dim() != 2 or positions.dim() != 2 or history.shape[0] != positions.shape[0]:
        raise ValueError(f"engram_lookback expects history [B, S] and positions [B, T], got "
                         f"{tuple(history.shape)} and {tuple(positions.shape)}")
    if history.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError(f"engram_lookback expects int64 history and positions, got {history.dtype}, "
                         f"{positions.dtype}")
    b, t = positions.shape
    s_len = history.shape[1]
    back = torch.arange(max_ngram, dtype=torch.int64, device=positions.device)
    idx = positions.unsqueeze(-1) - back                               # [B, T, M]
    tok = history.gather(1, idx.clamp(0, s_len - 1).view(b, t * max_ngram)).view(b, t, max_ngram)
    alive = (idx >= 0) & (tok != DEAD_CID)
    # Cumulative AND along the look-back axis: one dead/negative step kills all older ones.
    alive = torch.cumprod(alive.to(torch.int64), dim=-1).bool()
    return torch.where(alive, tok, torch.full_like(tok, pad_cid))


class EngramTable(nn.Module):
    """One Engram layer's embedding table (checkpoint names `engram.embed.weight` / `.scale`).

    checkpoint mode: `weight` [rows, row_dim] uint8 (FP8 E4M3 bytes) and `scale` [rows, row_dim/32]
    uint8 (UE8M0, 1x32 blocks). bf16 mode: `weight` [rows, row_dim] in `dtype`, `scale` None.

    Args:
        num_rows, row_dim: table size (row_dim divisible by 32 in checkpoint mode).
        weight_mode: `checkpoint` or `bf16`. dtype: output dtype of lookups.
    Shapes: forward row_ids [...] int64 -> [..., row_dim] in `dtype`.
    Raises:
        ValueError: unknown `weight_mode`, row_dim not divisible by 32 in checkpoint mode.
    Source: MODEL.md §2.10 "Module", §2.1 (Engram table rows FP8 1x32 UE8M0).
    """

    def __init__(self, num_rows: int, row_dim: int, weight_mode: str, dtype: torch.dtype, device=None):
        super().__init__()
        _check_weight_mode(weight_mode)
        self.num_rows, self.row_dim, self.weight_mode, self.dtype = num_rows, row_dim, weight_mode, dtype
        if weight_mode == "checkpoint":
            if row_dim % 32:
                raise ValueError(f"engram row_dim={row_dim} must be divisible by 32 (FP8 1x32 scales)")
            self.weight = nn.Parameter(torch.empty(num_rows, row_dim, dtype=torch.uint8, device=device),
                                       requires_grad=False)
            self.scale = nn.Parameter(torch.empty(num_rows, row_dim // 32, dtype=torch.uint8, device=device),
                                      requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(num_rows, row_dim, dtype=dtype, device=device),
                                       requires_grad=False)
            self.register_parameter("scale", None)

    def init_random(self, gen: torch.Generator) -> None:
        """N(0, 1) rows from `gen`, generated `_INIT_CHUNK_ROWS` at a time (tables reach millions of rows),
        quantised FP8 1x32 in checkpoint mode."""
        dev = self.weight.device
        with torch.no_grad():
            for start in range(0, self.num_rows, _INIT_CHUNK_ROWS):
                n = min(_INIT_CHUNK_ROWS, self.num_rows - start)
                rows = torch.randn(n, self.row_dim, generator=gen, device=dev)
                if self.weight_mode == "checkpoint":
                    q, s = quantize_fp8_1x32(rows)
                    self.weight[start:start + n].copy_(q)
                    self.scale[start:start + n].copy_(s)
                else:
                    self.weight[start:start + n].copy_(rows.to(self.weight.dtype))

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        """row_ids [...] int64 (in [0, num_rows)) -> dequantised rows [..., row_dim] in `dtype`."""
        rows = self.weight[row_ids]
        if self.weight_mode == "checkpoint":
            return dequantize_fp8_1x32(rows, self.scale[row_ids], self.dtype)
        return rows.to(self.dtype)

    def extra_repr(self) -> str:
        """The table's rows, row width and weight mode, for `print(module)`."""
        return f"rows={self.num_rows}, row_dim={self.row_dim}, mode={self.weight_mode}"


class Engram(nn.Module):
    """Engram module of layer `layer_id`: table lookup -> `wkv` -> per-stream gated residual update.

    Submodules/parameters (checkpoint names under `engram.`): `embed` (`EngramTable`),
    `wkv` = `Linear(R * row_dim, (hc_mult + 1) * hidden)` (`fp8_block` in checkpoint mode, `dense` in
    bf16 mode), `q_weight`, `k_weight` [hc_mult, hidden] in `dtype`. R = (max_ngram - 1) * n_heads.
    Non-persistent int64 buffers `multipliers` [max_ngram], `primes` [R], `offsets` [R] hold this
    layer's `EngramHash` constants (for `row_ids`); they are rebuilt by the constructor, not loaded.

    forward(H, row_ids): rows [B, T, R, row_dim] are dequantised and flattened to [B, T, R * row_dim];
    `wkv` yields 4 keys (output columns [i*d, (i+1)*d) for stream i) then one value ([4d, 5d));
    then `engram_update` with eps = rms_norm_eps.

    Args:
        config: uses the engram_* fields, hidden_size, hc_mult, rms_norm_eps.
        layer_id: an entry of `config.engram_layer_ids`.
        weight_mode: `checkpoint` or `bf16`. dtype: compute dtype. device: where parameters live.
    Raises:
        ValueError: unknown `weight_mode`, `layer_id` not an Engram layer, bad forward shapes.
    Source: MODEL.md §2.10, §2.13; [R41] `inference/model.py` (`Engram`).
    """

    def __init__(self, config: ModelConfig, layer_id: int, weight_mode: str, dtype: torch.dtype, device=None):
        super().__init__()
        _check_weight_mode(weight_mode)
        if layer_id not in config.engram_layer_ids:
            raise ValueError(f"layer {layer_id} is not an Engram layer; Engram layers: {config.engram_layer_ids}")
        hashing = EngramHash(config)
        self.layer_id = layer_id
        self.dim = config.hidden_size
        self.hc_mult = config.hc_mult
        self.n_heads = config.engram_n_heads
        self.max_ngram = config.engram_max_ngram
        self.n_rows_per_token = (self.max_ngram - 1) * self.n_heads
        self.row_dim = config.engram_row_dim
        self.eps = config.rms_norm_eps
        self.dtype = dtype
        fmt = "fp8_block" if weight_mode == "checkpoint" else "dense"
        self.embed = EngramTable(hashing.num_rows(layer_id), self.row_dim, weight_mode, dtype, device)
        self.wkv = Linear(self.n_rows_per_token * self.row_dim, (self.hc_mult + 1) * self.dim, fmt, dtype, device)
        self.q_weight = nn.Parameter(torch.empty(self.hc_mult, self.dim, dtype=dtype, device=device),
                                     requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(self.hc_mult, self.dim, dtype=dtype, device=device),
                                     requires_grad=False)
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        self.register_buffer("multipliers", as_tensor(hashing.multipliers(layer_id)), persistent=False)
        self.register_buffer("primes", as_tensor(hashing.primes(layer_id)), persistent=False)
        self.register_buffer("offsets", as_tensor(hashing.offsets(layer_id)), persistent=False)

    def init_random(self, gen: torch.Generator) -> None:
        """Random table (chunk-wise, N(0, 1)), `wkv` (N(0, 1/fan_in)) and gate weights (1 + N(0, 0.1^2))."""
        self.embed.init_random(gen)
        self.wkv.init_random(gen)
        dev = self.q_weight.device
        with torch.no_grad():
            for p in (self.q_weight, self.k_weight):
                noise = torch.randn(p.shape, generator=gen, device=dev) * _GATE_WEIGHT_STD
                p.copy_((1.0 + noise).to(p.dtype))

    def row_ids(self, u: torch.Tensor) -> torch.Tensor:
        """`engram_row_ids` with this layer's constants: u [B, T, max_ngram] -> [B, T, R] int64."""
        return engram_row_ids(u, self.multipliers, self.primes, self.offsets, self.n_heads)

    def forward(self, H: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """H [B, T, hc_mult, d], row_ids [B, T, R] int64 -> H' [B, T, hc_mult, d] in `H.dtype`."""
        if H.dim() != 4 or tuple(H.shape[2:]) != (self.hc_mult, self.dim):
            raise ValueError(f"Engram expects H [B, T, {self.hc_mult}, {self.dim}], got {tuple(H.shape)}")
        if tuple(row_ids.shape) != (H.shape[0], H.shape[1], self.n_rows_per_token):
            raise ValueError(f"Engram expects row_ids [B, T, {self.n_rows_per_token}], got {tuple(row_ids.shape)}")
        rows = self.embed(row_ids)                                        # [B, T, R, row_dim]
        kv = self.wkv(rows.flatten(2))                                    # [B, T, (hc+1) d]
        keys = kv[..., :self.hc_mult * self.dim].unflatten(-1, (self.hc_mult, self.dim))
        value = kv[..., self.hc_mult * self.dim:]
        return engram_update(H, keys, value, self.q_weight, self.k_weight, self.eps)
