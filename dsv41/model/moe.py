"""Mixture of experts of DeepSeek-V4.1 Flash: sqrt-softplus router, clamped SwiGLU experts (MODEL.md §2.9).

Weight modes (shared by every module here):
- `checkpoint`: the checkpoint's formats. Routed experts are FP4 E2M1 packed two per byte along K with
  one UE8M0 scale per 1x32 block; the shared expert is block-FP8 (`Linear(fmt="fp8_block")`). Every
  quantised GEMM fake-quantises its input to FP8 1x32 first, as the reference does.
- `bf16`: every weight dense in the model dtype (`Linear(fmt="dense")`, no activation quantisation),
  for numerics comparisons.

Routed experts are STACKED (`w1 [E, inter, ...]`) so that decode can gather exactly the k selected
experts' bytes with one index op; the checkpoint's per-expert names (`ffn.experts.{e}.w1.weight`, ...)
are slices of these stacks. All code is static-shape and host-sync-free (no `.item()`, no `nonzero`);
which routed path runs is decided by static shapes only.

Sources: MODEL.md §2.9 (router, expert, output), §2.1 (formats, fake-quant points), §2.13 (names);
[R41] `inference/model.py` (`Gate`, `Expert`, `MoE`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from ..ref.formats import dequantize_fp4_1x32, dequantize_fp4_1x32_table, fake_quant_fp8_1x32, quantize_fp4_1x32
from .linear import Linear

__all__ = ["WEIGHT_MODES", "clamped_swiglu", "Gate", "Expert", "RoutedExperts", "MoE"]

#: Weight modes accepted by every module of this file (see the module docstring).
WEIGHT_MODES = ("checkpoint", "bf16")

#: Standard deviation of the random router biases (small: they only nudge the selection).
_ROUTER_BIAS_STD = 0.01

#: Tokens per chunk of the dense (prefill) routed path; bounds the [tokens, inter] FP32 intermediates.
DENSE_TOKEN_CHUNK = 4096

#: Bytes of dense expert weights and intermediates one group of the dense path may hold (`_dense_group`).
_DENSE_GROUP_BYTES = 4 << 30

#: Temporary bytes per weight element while the dense path dequantises one matrix of a group: the int32 index per
#: byte (2), the table's output and the scaled result (one element each in the model dtype, at most 4 + 4), rounded up.
_DENSE_DEQUANT_TEMP_BYTES = 12


def _check_weight_mode(weight_mode: str) -> None:
    if weight_mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weight_mode {weight_mode!r}; expected one of {WEIGHT_MODES}")


def clamped_swiglu(a: torch.Tensor, b: torch.Tensor, limit: float) -> torch.Tensor:
    """SwiGLU with the V4 clamps, in FP32: `silu(min(a, limit)) * clamp(b, -limit, limit)`.

    Args:
        a: gate projection `w1 x` [..., inter], any float dtype. b: up projection `w3 x`, same shape.
        limit: `swiglu_limit` (10.0).
    Returns:
        [..., inter] FP32.
    Source: MODEL.md §2.9 "Expert"; [R41] `Expert.forward`.
    """
    a = a.float().clamp(max=limit)
    b = b.float().clamp(min=-limit, max=limit)
    return F.silu(a) * b


class Gate(nn.Module):
    """Router: sqrt-softplus scores, top-k on biased scores, weights from the unbiased scores.

    Parameters: `weight [E, d]` in `dtype`, `bias [E]` FP32 (selection only), `bias_vl [E]` FP32 (the
    image-token selection bias; kept for the checkpoint name, unused for text tokens).

    Args:
        config: uses `n_routed_experts` (E), `hidden_size` (d), `num_experts_per_tok` (k), `gate_temp`,
            `routed_scaling_factor`.
        weight_mode: `checkpoint` or `bf16` (the router weight is BF16 in the checkpoint, so both modes
            store it in `dtype`).
        dtype: storage dtype of `weight`. device: where parameters live.
    Raises:
        ValueError: unknown `weight_mode`; `forward` input not [N, d].
    Source: MODEL.md §2.9 "Router"; [R41] `Gate`.
    """

    def __init__(self, config: ModelConfig, weight_mode: str, dtype: torch.dtype, device=None):
        super().__init__()
        _check_weight_mode(weight_mode)
        self.n_experts = config.n_routed_experts
        self.dim = config.hidden_size
        self.topk = config.num_experts_per_tok
        self.gate_temp = config.gate_temp
        self.route_scale = config.routed_scaling_factor
        e, d = self.n_experts, self.dim
        self.weight = nn.Parameter(torch.empty(e, d, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(e, dtype=torch.float32, device=device), requires_grad=False)
        self.bias_vl = nn.Parameter(torch.empty(e, dtype=torch.float32, device=device), requires_grad=False)

    def init_random(self, gen: torch.Generator) -> None:
        """Weight ~ N(0, 1/d), biases ~ N(0, 0.01^2), drawn from `gen` (on the parameters' device)."""
        dev = self.weight.device
        with torch.no_grad():
            w = torch.randn(self.n_experts, self.dim, generator=gen, device=dev) / math.sqrt(self.dim)
            self.weight.copy_(w.to(self.weight.dtype))
            self.bias.copy_(torch.randn(self.n_experts, generator=gen, device=dev) * _ROUTER_BIAS_STD)
            self.bias_vl.copy_(torch.randn(self.n_experts, generator=gen, device=dev) * _ROUTER_BIAS_STD)

    def forward(self, x: torch.Tensor):
        """Route tokens.

        `l = x @ W^T / gate_temp` (FP32); `s = sqrt(softplus(l))`; `idx = topk(s + bias, k)`;
        `w = s[idx] / (sum(s[idx]) + 1e-20) * routed_scaling_factor`.

        Args:
            x: [N, d] any float dtype.
        Returns:
            (weights [N, k] FP32, indices [N, k] int64), indices in descending biased-score order.
        """
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"Gate expects x [N, {self.dim}], got {tuple(x.shape)}")
        logits = x.float() @ self.weight.float().t() / self.gate_temp
        scores = torch.sqrt(F.softplus(logits))
        indices = torch.topk(scores + self.bias, self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.route_scale
        return weights, indices


class Expert(nn.Module):
    """The shared expert: clamped SwiGLU with three `Linear`s (`w1`, `w3`: d -> inter; `w2`: inter -> d).

    `a = w1 x`, `b = w3 x`; `h = silu(min(a, limit)) * clamp(b, -limit, limit)` in FP32;
    `y = w2(h.to(dtype))` (in `checkpoint` mode `Linear` fake-quantises h to FP8 1x32 before w2, the
    reference's re-quantisation).

    Args:
        config: uses `hidden_size`, `moe_intermediate_size`, `swiglu_limit`.
        weight_mode: `checkpoint` (`fp8_block` weights) or `bf16` (`dense`). dtype: compute dtype.
    Shapes: forward x [..., d] -> [..., d] in `dtype`.
    Raises:
        ValueError: unknown `weight_mode`.
    Source: MODEL.md §2.9 "Expert"; [R41] `Expert`.
    """

    def __init__(self, config: ModelConfig, weight_mode: str, dtype: torch.dtype, device=None):
        super().__init__()
        _check_weight_mode(weight_mode)
        fmt = "fp8_block" if weight_mode == "checkpoint" else "dense"
        d, inter = config.hidden_size, config.moe_intermediate_size
        self.dtype = dtype
        self.limit = config.swiglu_limit
        self.w1 = Linear(d, inter, fmt, dtype, device)
        self.w2 = Linear(inter, d, fmt, dtype, device)
        self.w3 = Linear(d, inter, fmt, dtype, device)

    def init_random(self, gen: torch.Generator) -> None:
        """N(0, 1/fan_in) weights from `gen`, quantised to the layer formats."""
        for lin in (self.w1, self.w2, self.w3):
            lin.init_random(gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] -> [..., d] in `dtype` (clamped SwiGLU, see the class docstring)."""
        x = x.to(self.dtype)
        h = clamped_swiglu(self.w1(x), self.w3(x), self.limit)
        return self.w2(h.to(self.dtype))


class RoutedExperts(nn.Module):
    """All E routed experts with STACKED weights, and the two static routed paths.

    Parameters (checkpoint mode): `w1`, `w3` [E, inter, d/2] uint8 (packed E2M1) with `w1_scale`,
    `w3_scale` [E, inter, d/32] uint8 (UE8M0); `w2` [E, d, inter/2] with `w2_scale` [E, d, inter/32].
    bf16 mode: `w1`, `w3` [E, inter, d] and `w2` [E, d, inter] in `dtype`; the `*_scale` are None.

    Per selected expert e with routing weight r (FP32):
    `a = w1_e xq`, `b = w3_e xq` (GEMMs in `dtype`); `h = clamped_swiglu(a, b) * r` (weight applied
    BEFORE w2); `y_e = w2_e hq` with `xq`, `hq` fake-quantised FP8 1x32 in checkpoint mode (identity in
    bf16 mode). Output `sum_e y_e` accumulated in FP32.

    Path choice (static, from shapes): `N * k <= E` -> `forward_gather` (decode: reads exactly the
    selected experts' bytes); otherwise `forward_dense` (prefill: every expert over every token, masked
    by a scattered [N, E] weight matrix).

    Args:
        config: uses `n_routed_experts`, `num_experts_per_tok`, `hidden_size`, `moe_intermediate_size`,
            `swiglu_limit`.
        weight_mode: `checkpoint` or `bf16`. dtype: compute dtype (and weight dtype in bf16 mode).
    Raises:
        ValueError: unknown `weight_mode`; d or inter not divisible by 32 in checkpoint mode; forward
            inputs of the wrong shape.
    Source: MODEL.md §2.9, §2.1 (FP4 1x32 experts, FP8 1x32 activations); [R41] `MoE`, `Expert`.
    """

    def __init__(self, config: ModelConfig, weight_mode: str, dtype: torch.dtype, device=None):
        super().__init__()
        _check_weight_mode(weight_mode)
        self.weight_mode = weight_mode
        self.dtype = dtype
        self.n_experts = config.n_routed_experts
        self.topk = config.num_experts_per_tok
        self.dim = config.hidden_size
        self.inter = config.moe_intermediate_size
        self.limit = config.swiglu_limit
        e, d, f = self.n_experts, self.dim, self.inter
        if weight_mode == "checkpoint":
            if d % 32 or f % 32:
                raise ValueError(f"checkpoint mode needs hidden_size ({d}) and moe_intermediate_size ({f}) "
                                 "divisible by 32 (FP4 1x32 blocks)")
            shapes = {"w1": (e, f, d), "w2": (e, d, f), "w3": (e, f, d)}
            for name, (ne, n, k) in shapes.items():
                self.register_parameter(name, nn.Parameter(
                    torch.empty(ne, n, k // 2, dtype=torch.uint8, device=device), requires_grad=False))
                self.register_parameter(name + "_scale", nn.Parameter(
                    torch.empty(ne, n, k // 32, dtype=torch.uint8, device=device), requires_grad=False))
        else:
            self.w1 = nn.Parameter(torch.empty(e, f, d, dtype=dtype, device=device), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(e, d, f, dtype=dtype, device=device), requires_grad=False)
            self.w3 = nn.Parameter(torch.empty(e, f, d, dtype=dtype, device=device), requires_grad=False)
            self.register_parameter("w1_scale", None)
            self.register_parameter("w2_scale", None)
            self.register_parameter("w3_scale", None)

    # ------------------------------------------------------------------ weights
    def init_random(self, gen: torch.Generator) -> None:
        """N(0, 1/fan_in) dense weights from `gen`, expert by expert (w1, w2, w3), quantised to FP4 1x32
        in checkpoint mode (`formats.quantize_fp4_1x32`) or cast to `dtype` in bf16 mode."""
        dev = self.w1.device
        with torch.no_grad():
            for e in range(self.n_experts):
                for name in ("w1", "w2", "w3"):
                    param = getattr(self, name)
                    n = param.shape[1]
                    k = self.inter if name == "w2" else self.dim
                    w = torch.randn(n, k, generator=gen, device=dev) / math.sqrt(k)
                    self.set_expert_weight(name, e, w)

    def set_expert_weight(self, name: str, expert: int, w: torch.Tensor) -> None:
        """Store dense weight `w` ([inter, d] for w1/w3, [d, inter] for w2) as expert `expert`'s `name`.

        Raises:
            ValueError: unknown `name` or wrong shape.
        """
        if name not in ("w1", "w2", "w3"):
            raise ValueError(f"unknown expert weight {name!r}; expected w1, w2 or w3")
        want = (self.dim, self.inter) if name == "w2" else (self.inter, self.dim)
        if tuple(w.shape) != want:
            raise ValueError(f"expert weight {name} must be {want}, got {tuple(w.shape)}")
        with torch.no_grad():
            if self.weight_mode == "checkpoint":
                q, s = quantize_fp4_1x32(w)
                getattr(self, name)[expert].copy_(q)
                getattr(self, name + "_scale")[expert].copy_(s)
            else:
                getattr(self, name)[expert].copy_(w.to(self.dtype))

    def dequantized_weight(self, name: str, index) -> torch.Tensor:
        """Dense `name` weights of experts `index` (an int or an int64 index tensor) in `dtype`.

        Shapes: int -> [n, k]; index tensor of shape S -> [*S, n, k].
        """
        w = getattr(self, name)[index]
        if self.weight_mode == "checkpoint":
            return dequantize_fp4_1x32(w, getattr(self, name + "_scale")[index], self.dtype)
        return w

    def _act_quant(self, x: torch.Tensor) -> torch.Tensor:
        # Every FP4/FP8 GEMM of the reference quantises its input to FP8 1x32 (UE8M0) first.
        if self.weight_mode == "checkpoint":
            return fake_quant_fp8_1x32(x)
        return x

    def _check_inputs(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"RoutedExperts expects x [N, {self.dim}], got {tuple(x.shape)}")
        want = (x.shape[0], self.topk)
        if tuple(weights.shape) != want or tuple(indices.shape) != want:
            raise ValueError(f"RoutedExperts expects weights and indices {want}, got "
                             f"{tuple(weights.shape)} and {tuple(indices.shape)}")

    # ------------------------------------------------------------------ paths
    def forward_gather(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Decode path: gather the k selected experts' weights per token, dequantise, einsum.

        Args: x [N, d]; weights [N, k] FP32; indices [N, k] int64. Returns [N, d] FP32.
        """
        self._check_inputs(x, weights, indices)
        xq = self._act_quant(x.to(self.dtype))
        w1 = self.dequantized_weight("w1", indices)          # [N, k, inter, d]
        w3 = self.dequantized_weight("w3", indices)
        a = torch.einsum("nd,nkfd->nkf", xq, w1)
        b = torch.einsum("nd,nkfd->nkf", xq, w3)
        h = clamped_swiglu(a, b, self.limit) * weights.float().unsqueeze(-1)
        hq = self._act_quant(h.to(self.dtype))
        w2 = self.dequantized_weight("w2", indices)          # [N, k, d, inter]
        y = torch.einsum("nkf,nkdf->nkd", hq, w2)
        return y.float().sum(dim=1)

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Prefill path: every expert over every token, weighted by the routing weight (0 if not routed).

        Args: x [N, d]; weights [N, k] FP32; indices [N, k] int64. Returns [N, d] FP32.
        Experts run in groups (`_dense_group`) and tokens in chunks of `DENSE_TOKEN_CHUNK`, to bound the
        intermediates. Per expert the GEMMs are `F.linear` on that expert's weight, and every output row adds the
        experts' FP32 contributions in expert order; the elementwise steps (dequantisation, SwiGLU, routing
        weight, FP8 re-quantisation) run on a whole group at once, and FP4 weights are decoded through a byte
        table (`formats.dequantize_fp4_1x32_table`, the same bits as `dequantized_weight`). Each element's
        arithmetic is that of one expert at a time, with ~3.6x fewer kernel launches for `h200` (3,840 experts per
        prefill). One caveat: on
        CPU with more than two threads, ATen evaluates `exp` in vector or scalar code depending on where a
        thread's slice of the tensor ends, so SwiGLU's last bit can differ from a one-expert-at-a-time run.
        """
        self._check_inputs(x, weights, indices)
        n = x.shape[0]
        route = torch.zeros(n, self.n_experts, dtype=torch.float32, device=x.device)
        route = route.scatter(1, indices, weights.float())
        xq = self._act_quant(x.to(self.dtype))
        out = torch.zeros(n, self.dim, dtype=torch.float32, device=x.device)
        group = self._dense_group(min(n, DENSE_TOKEN_CHUNK))
        for g0 in range(0, self.n_experts, group):
            g1 = min(g0 + group, self.n_experts)
            w1, w3, w2 = (self._dense_weights(name, g0, g1).unbind(0) for name in ("w1", "w3", "w2"))
            for start in range(0, n, DENSE_TOKEN_CHUNK):
                rows = slice(start, start + DENSE_TOKEN_CHUNK)
                xc = xq[rows]
                a = torch.stack([F.linear(xc, w) for w in w1])                    # [g, chunk, inter]
                b = torch.stack([F.linear(xc, w) for w in w3])
                h = clamped_swiglu(a, b, self.limit) * route[rows, g0:g1].t().unsqueeze(-1)
                hq = self._act_quant(h.to(self.dtype))
                acc = out[rows]
                for j, w in enumerate(w2):
                    acc += F.linear(hq[j], w).float()  # in place on `out`, in expert order per row
        return out

    def _dense_weights(self, name: str, g0: int, g1: int) -> torch.Tensor:
        """Dense `name` weights of experts g0..g1-1, [g1-g0, n, k] in `dtype`: the values of `dequantized_weight`,
        decoded through the byte table (`formats.dequantize_fp4_1x32_table`: 3 passes instead of ~20). The dense path
        is the prefill path, which the benchmark runs eager; it is also traced where a compiled step routes more
        rows than experts (e.g. `small`'s DSpark drafter, 5 x top-2 over 8 experts), and the dispatch pass matches
        neither form there."""
        w = getattr(self, name)[g0:g1]
        if self.weight_mode == "checkpoint":
            return dequantize_fp4_1x32_table(w, getattr(self, name + "_scale")[g0:g1], self.dtype)
        return w

    def _dense_group(self, tokens: int) -> int:
        """Experts per group of `forward_dense` for `tokens` rows per chunk: as many as keep within
        `_DENSE_GROUP_BYTES` the group's dense weights (3 per expert in `dtype`), the dequantisation's temporaries
        (`_DENSE_DEQUANT_TEMP_BYTES` per element of the group's matrix being dequantised) and the chunk's
        [tokens, inter] FP32 intermediates (a, b, SwiGLU, re-quantisation; at least 1)."""
        d, f = self.dim, self.inter
        per_expert = d * f * (3 * self.dtype.itemsize + _DENSE_DEQUANT_TEMP_BYTES) + 8 * tokens * f * 4
        return max(1, min(self.n_experts, _DENSE_GROUP_BYTES // per_expert))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Routed expert output `sum_e w_e * expert_e(x)`: [N, d] FP32 (see the class docstring)."""
        if x.shape[0] * self.topk <= self.n_experts:
            return self.forward_gather(x, weights, indices)
        return self.forward_dense(x, weights, indices)


class MoE(nn.Module):
    """The V4.1 FFN: router + routed experts + one shared expert.

    Submodules: `gate` (`Gate`), `experts` (`RoutedExperts`), `shared_experts` (`Expert`).
    `y = experts(x, gate(x)) + shared_experts(x)` accumulated in FP32, cast to `x.dtype`.
    DSpark stages (fewer experts, other top-k) use a config copy with `n_routed_experts` and
    `num_experts_per_tok` replaced.

    Args:
        config, weight_mode, dtype, device: as for the submodules.
    Shapes: forward x [B, T, d] -> [B, T, d] in `x.dtype`.
    Raises:
        ValueError: unknown `weight_mode`; `n_shared_experts != 1` (V4.1 has one shared expert);
            input not [B, T, d].
    Source: MODEL.md §2.9; [R41] `MoE`.
    """

    def __init__(self, config: ModelConfig, weight_mode: str, dtype: torch.dtype, device=None):
        super().__init__()
        _check_weight_mode(weight_mode)
        if config.n_shared_experts != 1:
            raise ValueError(f"MoE supports exactly one shared expert (V4.1), got n_shared_experts="
                             f"{config.n_shared_experts}")
        self.dim = config.hidden_size
        self.gate = Gate(config, weight_mode, dtype, device)
        self.experts = RoutedExperts(config, weight_mode, dtype, device)
        self.shared_experts = Expert(config, weight_mode, dtype, device)

    def init_random(self, gen: torch.Generator) -> None:
        """Random weights for gate, routed experts and shared expert, in that order, from `gen`."""
        self.gate.init_random(gen)
        self.experts.init_random(gen)
        self.shared_experts.init_random(gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d] in `x.dtype`; raises ValueError for another shape."""
        if x.dim() != 3 or x.shape[2] != self.dim:
            raise ValueError(f"MoE expects x [B, T, {self.dim}], got {tuple(x.shape)}")
        b, t, d = x.shape
        xf = x.reshape(b * t, d)
        weights, indices = self.gate(xf)
        y = self.experts(xf, weights, indices) + self.shared_experts(xf).float()
        return y.to(x.dtype).view(b, t, d)
