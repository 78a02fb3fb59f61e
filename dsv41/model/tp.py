"""Tensor parallelism for the eager DeepSeek-V4.1 Flash model, applied to a BUILT model (gpt-fast style).

`apply_tp(model)` shards an initialised `DeepseekV41Flash` in place: every rank builds (or loads) the same
full model, then keeps its own slice of each sharded weight. The model code is not changed: sharded
projections become smaller `Linear`s, a few attributes are set to their per-rank values, and the
collectives are module hooks that call functional collectives (`_functional_collectives.all_reduce`), so
Dynamo captures them in the graph (`torch.compile(fullgraph=True)` of a sharded decode step is one graph).

What is split, per layer (MODEL.md §2.4, §2.9, §2.1 last paragraph):

- Attention: heads. Rank r owns heads [r*h/W, (r+1)*h/W): its rows of `wq_b` (by head, 32-row FP8
  blocks stay whole because head_dim % 32 == 0) and its `attn_sink` entries. The output path depends on how
  the `o_groups` G compare with the world size W:
  * W divides G: rank r owns G/W whole groups: their `wo_a` rows and the matching `wo_b` input columns
    (32-aligned, so the FP8 1x32 activation blocks of `wo_b` are the unsharded ones). `wo_b` gives a partial
    [.., d] output that is all-reduced (forward hook on `wo_b`).
  * G divides W (e.g. tiny: G = 2, W = 4): W/G ranks share one group; each holds the group's `wo_a` rows
    restricted to its own heads' input columns and produces a partial low-rank vector u_g. Quantising a
    partial sum would change the FP8 activation blocks of `wo_b`, so the partial u (zeros in the other
    groups' slots) is all-reduced BEFORE `wo_b` (forward pre-hook) and `wo_b` stays replicated (full).
  * otherwise: ValueError.
  Replicated (small, shared by every head, and they produce the caches every rank needs): `wq_a`,
  `q_norm`, `wkv`, `kv_norm`, the compressor, the indexer, the window ring, the bank and the index keys.
  Every rank computes the same ring/bank/top-k from the same (all-reduced, hence identical) inputs.
- MoE, `moe_mode="tp"`: every routed expert and the shared expert are split along the intermediate
  dimension in whole 32-element blocks (`w1`/`w3` rows, `w2` columns; FP4 packed bytes, UE8M0 1x32 scales
  and FP8 32x32 block scales are sliced on those block boundaries, so every rank's bytes are the unsharded
  bytes). Rank r gets blocks [r*c, (r+1)*c) with c = ceil(blocks / W); each rank's slice is padded to
  `inter_per_rank = roundup(c * 32, pad_to)` rows/columns with ZERO codes and UNIT scales (UE8M0 byte 127):
  a padded row gives silu(0) * 0 = 0 and a padded `w2` column multiplies that 0, and because padding is
  whole 32-blocks the FP8 1x32 re-quantisation of the real blocks is unchanged. Router replicated. The
  routed partial and the shared partial are summed (inside `MoE.forward`) and all-reduced once.
- MoE, `moe_mode="ep"`: routed experts are partitioned by id (rank r holds experts [r*E/W, (r+1)*E/W));
  each rank adds only its experts' contributions (the others' routing weights are masked to 0); the shared
  expert is TP-split and padded as above; one all-reduce of the MoE output.

Replicated everywhere else: embedding, mHC, norms, Engram, LM head.

Padding default (`pad_to=None` -> `DEFAULT_PAD_TO` = 128): the per-rank size is rounded up to a multiple
of 128, the tile/scale-group width of Hopper FP8 GEMMs (DeepGEMM SM90 scales in 128-wide K groups; a
128x128 block-scale conversion is lossless only on 128-aligned shapes). Full scale: 2304 / 4 = 576 ->
640, the serving number of MODEL.md §2.1/§2.9. (The rule "smallest multiple of 64 >= inter/W" would keep
576, which is already a multiple of 64.) `pad_to=32` means "no padding beyond whole 32-blocks".

Sources: MODEL.md §2.4 (head/group layout of wq_b, wo_a, wo_b), §2.9 (MoE), §2.1 (block layouts, TP4
padding with zero weights and scale 1); gpt-fast `tp.py` (sharding applied to a built model, all-reduce as a
forward hook).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .linear import Linear
from .moe import DENSE_TOKEN_CHUNK, RoutedExperts, clamped_swiglu

__all__ = ["TPPlan", "tp_plan", "apply_tp", "ExpertParallelRoutedExperts", "MOE_MODES", "DEFAULT_PAD_TO",
           "UNIT_SCALE"]

#: MoE sharding modes accepted by `apply_tp` / `tp_plan`.
MOE_MODES = ("tp", "ep")
#: Default padding multiple of the per-rank expert intermediate size (see the module docstring).
DEFAULT_PAD_TO = 128
#: UE8M0 byte of the scale 2^(127-127) = 1, used for padded blocks.
UNIT_SCALE = 127
#: Quantisation block (FP8 32x32 and FP4/FP8 1x32 blocks): every split is on this boundary.
_BLOCK = 32


@dataclass(frozen=True)
class TPPlan:
    """What one rank holds after `apply_tp` (all sizes in elements; ranges are [start, start + size)).

    rank, world_size: this rank in the sharding group. moe_mode: `tp` or `ep`.
    heads, head_start: attention heads of this rank.
    o_groups: `wo_a` groups held (G/W when W divides G, else 1 shared group).
    group_share: ranks sharing one o-group (1 when W divides G; W/G otherwise, `wo_b` then replicated).
    o_group: the shared group's index when group_share > 1, else the first group held.
    inter: per-rank intermediate size after padding (shared expert; routed experts too in `tp` mode).
    inter_start, inter_real: first real intermediate row of this rank and the real rows it holds
        (inter - inter_real rows are padding).
    experts, expert_start: routed experts held (all E in `tp` mode).
    pad_to: the padding multiple used.
    """

    rank: int
    world_size: int
    moe_mode: str
    heads: int
    head_start: int
    o_groups: int
    group_share: int
    o_group: int
    inter: int
    inter_start: int
    inter_real: int
    experts: int
    expert_start: int
    pad_to: int

    def to_dict(self) -> dict:
        """Plain dict (for result JSONs)."""
        return asdict(self)


def tp_plan(config: ModelConfig, rank: int, world_size: int, moe_mode: str = "tp",
            pad_to: int | None = None) -> TPPlan:
    """Compute rank `rank`'s shard of a `config` model split over `world_size` ranks (no tensors touched).

    Args:
        config: the model config. rank: 0 <= rank < world_size. moe_mode: one of `MOE_MODES`.
        pad_to: padding multiple of the per-rank expert intermediate size, a positive multiple of 32;
            None -> `DEFAULT_PAD_TO`.
    Returns: a `TPPlan`.
    Raises:
        ValueError: world_size < 1 or rank out of range; unknown moe_mode; pad_to not a positive multiple
            of 32; num_attention_heads not divisible by world_size; neither o_groups divisible by world_size
            nor world_size divisible by o_groups (a rank's heads must lie in whole groups or in one group);
            a `wo_b` column shard not on a 32-column block boundary; `ep` with n_routed_experts not
            divisible by world_size.
    Source: MODEL.md §2.4 (wo_a groups = consecutive heads), §2.9, §2.1 (TP padding).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if moe_mode not in MOE_MODES:
        raise ValueError(f"unknown moe_mode {moe_mode!r}; expected one of {MOE_MODES}")
    if pad_to is None:
        pad_to = DEFAULT_PAD_TO
    if isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < 1 or pad_to % _BLOCK:
        raise ValueError(f"pad_to must be a positive multiple of {_BLOCK} (whole quantisation blocks), got {pad_to!r}")
    c, w = config, world_size
    h, g = c.num_attention_heads, c.o_groups
    if h % w:
        raise ValueError(f"tensor parallelism splits attention heads: num_attention_heads={h} is not divisible "
                         f"by world_size={w}")
    heads = h // w
    if g % w == 0:
        o_groups, share, o_group = g // w, 1, rank * (g // w)
        width = o_groups * c.o_lora_rank
        if w > 1 and width % _BLOCK:
            raise ValueError(f"wo_b would be split into {width}-column shards (o_groups/world_size * o_lora_rank), "
                             f"not whole {_BLOCK}-column FP8 blocks")
    elif w % g == 0:
        o_groups, share, o_group = 1, w // g, rank // (w // g)
    else:
        raise ValueError(f"o_groups={g} and world_size={w}: one must divide the other (a rank's heads must form "
                         f"whole wo_a groups, or lie inside one group)")
    if moe_mode == "ep" and c.n_routed_experts % w:
        raise ValueError(f"moe_mode='ep' partitions routed experts by id: n_routed_experts={c.n_routed_experts} "
                         f"is not divisible by world_size={w}")
    nb = c.moe_intermediate_size // _BLOCK
    per = -(-nb // w)
    b0, b1 = min(rank * per, nb), min((rank + 1) * per, nb)
    inter = -(-(per * _BLOCK) // pad_to) * pad_to
    if moe_mode == "ep":
        experts, e0 = c.n_routed_experts // w, rank * (c.n_routed_experts // w)
    else:
        experts, e0 = c.n_routed_experts, 0
    return TPPlan(rank=rank, world_size=w, moe_mode=moe_mode, heads=heads, head_start=rank * heads,
                  o_groups=o_groups, group_share=share, o_group=o_group, inter=inter, inter_start=b0 * _BLOCK,
                  inter_real=(b1 - b0) * _BLOCK, experts=experts, expert_start=e0, pad_to=pad_to)


# ---------------------------------------------------------------------------------------- slicing
def _narrow_pad(t: torch.Tensor, dim: int, start: int, length: int, size: int, fill: int) -> torch.Tensor:
    """New contiguous tensor: t[start:start+length] along `dim`, then `size - length` entries of `fill`."""
    shape = list(t.shape)
    shape[dim] = size
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    if length:
        out.narrow(dim, 0, length).copy_(t.narrow(dim, start, length))
    return out


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


#: Elements per stored unit, (weight, scale), for a split along [rows, cols] of a `Linear` of each format.
_LINEAR_UNITS = {"dense": ((1, 1), None), "fp8_block": ((1, 1), (_BLOCK, _BLOCK)), "fp4": ((1, 2), (1, _BLOCK))}


def _shard_linear(lin: Linear, dim: int, start: int, length: int, size: int) -> Linear:
    """A new `Linear` with `lin`'s elements [start, start+length) along `dim` (0: output rows, 1: input
    columns), zero-padded to `size` with unit scales. Boundaries must be whole quantisation blocks."""
    out_f = size if dim == 0 else lin.out_features
    in_f = size if dim == 1 else lin.in_features
    new = Linear(in_f, out_f, lin.fmt, lin.dtype, lin.weight.device)
    wu, su = _LINEAR_UNITS[lin.fmt]
    new.weight = _param(_narrow_pad(lin.weight, dim, start // wu[dim], length // wu[dim], size // wu[dim], 0))
    if su is not None:
        u = su[dim]
        new.scale = _param(_narrow_pad(lin.scale, dim, start // u, -(-length // u), -(-size // u), UNIT_SCALE))
    return new


def _shard_expert_stack(ex: RoutedExperts, start: int, length: int, size: int) -> None:
    """Split stacked routed experts along the intermediate dim in place (w1/w3 rows, w2 columns)."""
    packed = ex.weight_mode == "checkpoint"
    for name in ("w1", "w3"):
        setattr(ex, name, _param(_narrow_pad(getattr(ex, name), 1, start, length, size, 0)))
        if packed:
            setattr(ex, name + "_scale",
                    _param(_narrow_pad(getattr(ex, name + "_scale"), 1, start, length, size, UNIT_SCALE)))
    u = 2 if packed else 1
    ex.w2 = _param(_narrow_pad(ex.w2, 2, start // u, length // u, size // u, 0))
    if packed:
        ex.w2_scale = _param(_narrow_pad(ex.w2_scale, 2, start // _BLOCK, length // _BLOCK, size // _BLOCK,
                                         UNIT_SCALE))
    ex.inter = size


# ---------------------------------------------------------------------------------------- collectives
def _all_reduce_output(group, module, inputs, output):
    """Forward hook: the module's output is a partial sum over ranks."""
    return funcol.all_reduce(output, "sum", group)


def _all_reduce_group_slot(group, slot: int, n_slots: int, module, args):
    """Forward pre-hook of a replicated `wo_b`: place this rank's partial u_g [..., o_lora] in group slot
    `slot` of a zero [..., n_slots * o_lora] vector and all-reduce, so every rank gets the full u."""
    (u,) = args
    w = u.shape[-1]
    full = F.pad(u, (slot * w, (n_slots - 1 - slot) * w))
    return (funcol.all_reduce(full, "sum", group),)


# ---------------------------------------------------------------------------------------- expert parallel
class ExpertParallelRoutedExperts(RoutedExperts):
    """`RoutedExperts` holding experts [expert_start, expert_start + n_experts) of `n_global_experts`.

    Created by `apply_tp(moe_mode="ep")` from a full `RoutedExperts` (same parameter names, stacks cut to
    the local experts). `forward` takes the router's GLOBAL indices: selections of other ranks' experts get
    routing weight 0 (and a harmless local index 0), so this rank returns only its own experts' share.
    The path choice uses the global expert count, as the unsharded model does (decode: gather, which
    still reads k experts' bytes per rank at static shapes; a kernel may skip zero-weight selections).

    Shapes: x [N, d]; weights [N, k] FP32; indices [N, k] int64 global ids. Returns [N, d] FP32.
    Source: MODEL.md §2.9; the same expert math as `RoutedExperts`.
    """

    expert_start: int = 0
    n_global_experts: int = 0

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """This rank's share of the routed output, FP32 [N, d]: x [N, d], global weights FP32 / indices int64
        [N, k]; experts held by other ranks get weight 0 (their sum arrives through the all-reduce)."""
        local = indices - self.expert_start
        mine = (local >= 0) & (local < self.n_experts)
        weights = torch.where(mine, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
        local = torch.where(mine, local, torch.zeros_like(local))
        if x.shape[0] * self.topk <= self.n_global_experts:
            return self.forward_gather(x, weights, local)
        return self._forward_dense_local(x, weights, local)

    def _forward_dense_local(self, x, weights, local):
        # RoutedExperts.forward_dense builds its route matrix with `scatter`, whose result is undefined for
        # the duplicate local indices that masking creates; `scatter_add` of the zero weights is exact.
        self._check_inputs(x, weights, local)
        n = x.shape[0]
        route = torch.zeros(n, self.n_experts, dtype=torch.float32, device=x.device).scatter_add(1, local, weights)
        xq = self._act_quant(x.to(self.dtype))
        out = torch.zeros(n, self.dim, dtype=torch.float32, device=x.device)
        for e in range(self.n_experts):
            w1, w2, w3 = (self.dequantized_weight(name, e) for name in ("w1", "w2", "w3"))
            parts = []
            for s in range(0, n, DENSE_TOKEN_CHUNK):  # bounds the [tokens, inter] FP32 intermediates
                xc, rc = xq[s:s + DENSE_TOKEN_CHUNK], route[s:s + DENSE_TOKEN_CHUNK, e:e + 1]
                h = clamped_swiglu(F.linear(xc, w1), F.linear(xc, w3), self.limit) * rc
                parts.append(F.linear(self._act_quant(h.to(self.dtype)), w2).float())
            out = out + (parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
        return out


# ---------------------------------------------------------------------------------------- apply
def _shard_attention(attn, plan: TPPlan, group) -> None:
    h0, hl, hd = plan.head_start, plan.heads, attn.head_dim
    attn.wq_b = _shard_linear(attn.wq_b, 0, h0 * hd, hl * hd, hl * hd)
    attn.attn_sink = _param(attn.attn_sink[h0:h0 + hl].clone())
    o_lora = attn.o_lora
    if plan.group_share == 1:
        g0, gl = plan.o_group, plan.o_groups
        attn.wo_a = _shard_linear(attn.wo_a, 0, g0 * o_lora, gl * o_lora, gl * o_lora)
        attn.wo_b = _shard_linear(attn.wo_b, 1, g0 * o_lora, gl * o_lora, gl * o_lora)
        attn.wo_b.register_forward_hook(functools.partial(_all_reduce_output, group))
    else:
        g, s = plan.o_group, plan.rank % plan.group_share
        wo_a = _shard_linear(attn.wo_a, 0, g * o_lora, o_lora, o_lora)
        attn.wo_a = _shard_linear(wo_a, 1, s * hl * hd, hl * hd, hl * hd)
        attn.wo_b.register_forward_pre_hook(
            functools.partial(_all_reduce_group_slot, group, g, attn.o_groups))
    attn.n_heads, attn.o_groups = hl, plan.o_groups


def _shard_moe(moe, plan: TPPlan, group) -> None:
    se = moe.shared_experts
    s0, n, size = plan.inter_start, plan.inter_real, plan.inter
    se.w1 = _shard_linear(se.w1, 0, s0, n, size)
    se.w3 = _shard_linear(se.w3, 0, s0, n, size)
    se.w2 = _shard_linear(se.w2, 1, s0, n, size)
    ex = moe.experts
    if plan.moe_mode == "tp":
        _shard_expert_stack(ex, s0, n, size)
    else:
        e0, el = plan.expert_start, plan.experts
        for name in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"):
            t = getattr(ex, name)
            if t is not None:
                setattr(ex, name, _param(t[e0:e0 + el].clone()))
        # Same instance, same parameter names; only `forward` changes (see the class docstring).
        ex.__class__ = ExpertParallelRoutedExperts
        ex.expert_start, ex.n_global_experts, ex.n_experts = e0, ex.n_experts, el
    moe.register_forward_hook(functools.partial(_all_reduce_output, group))


@torch.no_grad()
def apply_tp(model: nn.Module, group: dist.ProcessGroup | None = None, moe_mode: str = "tp",
             pad_to: int | None = None) -> TPPlan:
    """Shard a built `DeepseekV41Flash` in place over the ranks of `group` (see the module docstring).

    Every rank must hold the same full model (same seed or checkpoint); each keeps its slice. Call once,
    before `torch.compile`; caches may be set up before or after.

    Args:
        model: a `DeepseekV41Flash` (checkpoint or bf16 weight mode, any dtype/device).
        group: the process group (default: the WORLD group; torch.distributed must be initialised).
        moe_mode: `tp` (experts split along the intermediate dim) or `ep` (routed experts by id).
        pad_to: padding multiple of the per-rank intermediate size (default `DEFAULT_PAD_TO`).
    Returns:
        this rank's `TPPlan` (also stored as `model.tp_plan`).
    Raises:
        TypeError: `model` is not a `DeepseekV41Flash`.
        RuntimeError: torch.distributed not initialised; `model` already sharded.
        ValueError: everything `tp_plan` rejects (heads / o_groups / experts vs world size, bad pad_to or mode).
    Source: MODEL.md §2.4, §2.9, §2.1; gpt-fast `tp.py`.
    """
    from .model import DeepseekV41Flash
    if not isinstance(model, DeepseekV41Flash):
        raise TypeError(f"apply_tp expects a DeepseekV41Flash, got {type(model).__name__}")
    if getattr(model, "tp_plan", None) is not None:
        raise RuntimeError("apply_tp: this model is already sharded")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("apply_tp needs torch.distributed initialised (see dsv41.launch.init_distributed)")
    group = group if group is not None else dist.group.WORLD
    plan = tp_plan(model.config, dist.get_rank(group), dist.get_world_size(group), moe_mode, pad_to)
    for layer in model.layers:
        _shard_attention(layer.attn, plan, group)
        _shard_moe(layer.ffn, plan, group)
    model.tp_plan = plan
    return plan
