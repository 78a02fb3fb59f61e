"""`c2_compressor` family: the kv-source bank write, [pair pooling ->] RMSNorm -> RoPE -> FP4 -> row write, as one op.

Chains matched (MODEL.md §2.6, §2.8; dsv41/model/csa.py `Compressor.forward`, dsv41/model/attention.py
`_update_csa`):

    ratio 1:  latent = rms_norm(u, w, eps);  cache[b, rows] = quantize_fp4_*(apply_rope(latent, cos, sin))
              -> latent = dsv41::c2_norm_rope_fp4_store(u, w, eps, cos, sin, blk, e4m3, codes!, scales!, rows)
    ratio 2:  u = pool(k, g, prev_k, prev_g) cast to the latent dtype, then as ratio 1
              -> latent = dsv41::c2_pool_norm_rope_fp4_store(k, g, prev_k, prev_g, w, eps, dtype, cos, sin, ...)

with pool = the per-channel softmax over the pair, `(e0 prev_k + e1 k) / (e0 + e1)` in FP32.

The family runs BEFORE `rope_fp4` and finds the same RoPE -> FP4 -> cache-write chains with rope_fp4's own
matchers (imported, not copied); it takes a chain only when the rotated tensor is an RMSNorm output, and the
norm's input is, when it is, the pair pooling. Other RoPE -> FP4 chains (index keys, index queries) are left
to `rope_fp4`. The latent (pre-RoPE) stays an output of the op because the index-key branch
(`k_norm(wk latent)`) reads it; that branch is not fused here (rope_fp4 fuses its RoPE -> FP4 -> write).

Structure and semantics: the norm region is found by walking back from the rotated tensor through the ops an
RMSNorm is spelled with (mul, pow, mean, add, rsqrt, casts) to one leaf u of the latent's shape and one
weight leaf [D]; it is evaluated on probes and compared with `model.norm.rms_norm(u.to(dtype), w, eps)` for
each float literal of the region (eps). The pooling region is walked back from u through max / sub / exp /
mul / add / div to four FP32 leaves of u's shape and compared with the pooling for every role assignment.
A region that looks like a norm (a last-dim mean) but computes something else is a near-miss
(`rmsnorm_values` or `rms_eps`), and so is a four-input region that is not the pair softmax
(`pair_pool_values`: then the norm alone is fused, the pooling stays with Inductor).

Pending-token state: the ratio-2 writer's state update (`kv_state.copy_(k[:, -1])`, `score_state.copy_`) and
the `cat` that prepends the state to the shifted projections are separate graph ops; they stay with
Inductor, and the fused op takes prev_k / prev_g as inputs, so the state semantics are the graph's own.
"""

from __future__ import annotations

import itertools
import operator

import sympy
import torch
import torch.fx as fx

from ..ref.c2_compressor import pair_pool as reference_pair_pool
from ..ref.norm import rms_norm
from . import rope_fp4 as rf
from .rope_match import match_rope, rope_structure
from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (Chain, FusionFamily, GraphScan, RegionEvaluator, RegionNotClosed, Role, close_scaled,
                     concrete_shape, dsv41_op, finish_graph, insert_node, is_view_op, keep_removed, node_label,
                     probe_runs, register_family, rms_eps_reason, rms_norm_eps_outside, same_shape, size_args,
                     static_refusal, symbolic_part, tensor_val, token_rows)

__all__ = ["C2CompressorFamily", "SPEC"]

aten = torch.ops.aten
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.clone.default}
_NORM_OPS = {aten.mul.Tensor, aten.pow.Tensor_Scalar, aten.mean.dim, aten.add.Tensor, aten.add.Scalar,
             aten.rsqrt.default} | _CASTS
_POOL_OPS = {aten.maximum.default, aten.sub.Tensor, aten.exp.default, aten.mul.Tensor, aten.add.Tensor,
             aten.div.Tensor} | _CASTS
_LIMIT = 60


#: The family as data (`dsv41 report --patterns`).
SPEC = register_family(
    "c2_compressor", "C2 compressor: [pair softmax pooling ->] RMSNorm -> RoPE -> FP4 -> bank row write "
    "(returns the pre-RoPE latent)", tuple(
    Chain(op, op, "a RoPE -> FP4 quantiser chain (rope_fp4's structure) whose x is an RMSNorm output"
          + (" of a pair softmax pooling" if pooled else "") + " and whose codes and scales are written into a bank",
          (Role("u", "[.., D] (pooled: [.., 2, 2D] kv and gate)"), Role("weight", "[D]"),
           Role("cos / sin", "[.., R/2]", "fp32"), Role("bank codes / scales", "[B, Rows, bytes]", "uint8"),
           Role("rows", "[B, T]", "int64")),
          "dsv41.ref.norm:rms_norm" + (" + dsv41.ref.c2_compressor:pair_pool" if pooled else ""),
          ("eps", "rule", "rope_dim"), ("random u at magnitudes 1 and 1e-3 (pins eps)",),
          ("rmsnorm_inputs", "rmsnorm_values", "rms_eps", "pair_pool_values", "pending_state", "static_shapes",
           "op_registered"))
    for op, pooled in (("c2_norm_rope_fp4_store", False), ("c2_pool_norm_rope_fp4_store", True))),
    # order: after normalize, which gives later families one form of each chain; before rope_fp4, which would
    # take the compressor's RoPE -> FP4 chains
    after=("normalize",), before=("rope_fp4",),
)


class C2CompressorFamily(FusionFamily):
    """Fuse the compressor's [pooling ->] RMSNorm -> RoPE -> FP4 -> bank write (see module docstring)."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Replace every verified compressor chain with `dsv41::c2_[pool_]norm_rope_fp4_store`."""
        scan = GraphScan(gm)
        graph, ev, sourced = scan.graph, scan.ev, scan.sourced
        matches, misses, done = [], [], set()
        for amax in [n for n in graph.nodes if rf.is_block_amax(n)]:
            if amax in done:
                continue
            site = _rope_fp4_store_site(amax, ev, sourced)
            if site is None:
                continue
            y, rope, quant, writes = site
            done.update(quant.closure)
            norm, why = _match_norm(rope.x, ev)
            loc = SourceLocation.from_node(y)
            if norm is None:
                if why is not None:
                    misses.append(NearMiss(self.name, "rmsnorm -> rope -> fp4 -> bank write", *why, loc))
                continue
            pool, why = _match_pool(norm["u"], ev)
            if why is not None:
                misses.append(NearMiss(self.name, "pair pool -> rmsnorm -> rope -> fp4 -> bank write", *why, loc))
            refused = static_refusal(self.name, "rmsnorm -> rope -> fp4 -> bank write",
                                     [rope.x, rope.cos, rope.sin, *rope.region, *quant.closure, *writes,
                                      *norm.values(), *(pool or {}).values()], loc, "dsv41::c2_*norm_rope_fp4_store")
            if refused is not None:
                misses.append(refused)
                continue
            rec = self._fuse(graph, y, rope, quant, writes, norm, pool)
            if isinstance(rec, NearMiss):
                misses.append(rec)
            else:
                matches.append(rec)
        finish_graph(graph)
        removed = scan.removed_names()
        matches = [keep_removed(m, removed) for m in matches]
        missing = [op for op in ("c2_norm_rope_fp4_store", "c2_pool_norm_rope_fp4_store") if dsv41_op(op) is None]
        note = f"ops not registered: {', '.join(missing)}" if missing else ""
        return PassRecord(self.name, True, tuple(matches), tuple(misses), (), note)

    def _fuse(self, graph, y, rope, quant, writes, norm, pool):
        blk, e4m3, _, _ = rf.QUANT_RULES[quant.rule]
        op_name = "c2_pool_norm_rope_fp4_store" if pool else "c2_norm_rope_fp4_store"
        pattern = f"{'pair pool -> ' if pool else ''}rmsnorm -> rope -> fp4 ({quant.rule}) -> bank write"
        loc = SourceLocation.from_node(y)
        op = dsv41_op(op_name)
        if op is None:
            return NearMiss(self.name, pattern, "op_registered", f"dsv41::{op_name} is not registered", loc)
        latent = rope.x
        lv = tensor_val(latent)
        anchor = writes[0]
        half = rope.rope_dim // 2
        cos, sin = rope.cos, rope.sin
        if sin is None:  # complex freqs_cis: cos = real part, sin = imaginary part
            real = insert_node(graph, anchor, aten.view_as_real.default, (rope.cos,), like=y)
            cos = insert_node(graph, anchor, aten.select.int, (real, -1, 0), like=y)
            sin = insert_node(graph, anchor, aten.select.int, (real, -1, 1), like=y)
        size = size_args(graph, anchor, latent, range(2)) + [half]
        cos = insert_node(graph, anchor, aten.expand.default, (cos, size), like=y)
        sin = insert_node(graph, anchor, aten.expand.default, (sin, size), like=y)
        rows = writes[0].args[1][1]
        # index_put wraps a negative row to the end of the cache; the op skips rows outside [0, Rows).
        n_rows = size_args(graph, anchor, writes[0].args[0], [1])[0]
        neg = insert_node(graph, anchor, aten.lt.Scalar, (rows, 0), like=y)
        wrapped = insert_node(graph, anchor, aten.add.Tensor, (rows, n_rows), like=y)
        rows_in = insert_node(graph, anchor, aten.where.self, (neg, wrapped, rows), like=y)
        common = dict(weight=norm["w"], eps=norm["eps"], cos=cos, sin=sin, scale_block=blk, e4m3_scale=e4m3,
                      codes_cache=writes[0].args[0], scale_cache=writes[1].args[0], rows=rows_in)
        if pool:
            kwargs = dict(k=pool["k"], g=pool["g"], prev_k=pool["prev_k"], prev_g=pool["prev_g"],
                          out_dtype=lv.dtype, **common)
        else:
            u = norm["u"]
            if tensor_val(u).dtype != lv.dtype:
                u = insert_node(graph, anchor, torch.ops.prims.convert_element_type.default, (u, lv.dtype), like=y)
            kwargs = dict(x=u, **common)
        af = insert_node(graph, anchor, torch.ops.higher_order.auto_functionalized, (op,), kwargs, like=y)
        out = insert_node(graph, anchor, operator.getitem, (af, 0), like=y)
        for i, w in enumerate(writes):
            w.replace_all_uses_with(insert_node(graph, anchor, operator.getitem, (af, i + 1), like=y))
        latent.replace_all_uses_with(out)
        replaced = list(norm["region"]) + (list(pool["region"]) if pool else []) + list(rope.region) + \
            list(quant.closure) + list(writes)
        detail = (("rule", quant.rule), ("rope_dim", rope.rope_dim), ("D", concrete_shape(lv)[-1]),
                  ("eps", norm["eps"]), ("pooled", bool(pool)), ("pending_state", "left to Inductor" if pool else
                                                                  "none (ratio 1)"))
        before, after, subs = _bytes(lv, blk, bool(pool))
        return MatchRecord(self.name, f"{op_name}({quant.rule})", f"dsv41::{op_name}", loc,
                           tuple(n.name for n in replaced), tuple(node_label(n) for n in replaced),
                           before, after, subs, detail)


def _bytes(lv: torch.Tensor, blk: int, pooled: bool):
    """(before, after, symbols): eager traffic of pool + norm + rope + quant + write vs the fused op.

    Per token of D channels, e bytes each: the pooling reads 4 FP32 rows and writes z (several elementwise
    passes, counted as 3 reads + 1 write of FP32 rows beyond the inputs); the norm reads u twice and writes
    the latent; RoPE reads it and writes the rotated copy; the quantiser reads it and writes codes + scales,
    which the index_put reads back and writes. Fused: inputs once, latent and codes + scales once."""
    d = concrete_shape(lv)[-1]
    e = lv.element_size()
    rows, subs = token_rows(concrete_shape(lv)[:-1])
    codes = d // 2 + d // blk
    pool_in = 4 * 4 * d if pooled else 0
    before = pool_in + (4 * 4 * d + e * d if pooled else 0) + 3 * e * d + 2 * e * d + e * d + codes + 2 * codes
    after = (pool_in if pooled else e * d) + e * d + codes
    return str(sympy.expand(before * rows)), str(sympy.expand(after * rows)), tuple(sorted(subs.items()))


# ------------------------------------------------------------------------------------------------ rope -> fp4 -> write
def _rope_fp4_store_site(amax, ev, sourced):
    """(y, rope, quant, (codes write, scales write)) for a RoPE -> FP4 chain whose codes and scales go to
    [B, Rows, *] caches at rows [B, T] of a [B, T, D] latent (rope_fp4's matchers); None otherwise."""
    ys = rf.quantised_tensor_candidates(amax)
    if not ys or rope_structure(ys[0], sourced) is None:
        return None
    if symbolic_part([amax, *ys]) is not None:  # rope_fp4 reports it (static_shapes); no probe sees such sizes
        return None
    for y in ys:
        quant = rf.match_quant(y, amax, ev, sourced)
        if quant is not None:
            break
    if quant is None or quant.packed is None or quant.scale is None:
        return None
    rope, _ = match_rope(y, ev, sourced)
    if rope is None:
        return None
    writes, _ = rf.cache_write(quant, ev, sourced)
    if not writes:
        return None
    xv = tensor_val(rope.x)
    if xv.dim() != 3 or not same_shape(xv.shape[:2], tensor_val(writes[0].args[1][1]).shape):
        return None
    return y, rope, quant, writes


# ------------------------------------------------------------------------------------------------ regions
def _walk(end: fx.Node, ops: set, stop_shape=None):
    """Walk back from `end` through `ops` (views only when their output is not `stop_shape`). Returns
    (region in graph order, leaves) or None when the region is larger than `_LIMIT` nodes."""
    region, leaves, stack = [], [], [end]
    seen = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        is_op = n.op == "call_function" and (n.target in ops or (is_view_op(n) and n is not end and (
            stop_shape is None or concrete_shape(tensor_val(n)) != stop_shape)))
        if n is end or is_op:
            region.append(n)
            if len(region) > _LIMIT:
                return None
            stack.extend(a for a in n.all_input_nodes if a not in seen)
        elif n not in leaves:
            leaves.append(n)
    order = {n: i for i, n in enumerate(end.graph.nodes)}
    return sorted(region, key=order.__getitem__), leaves


def _literals(region) -> list:
    out = []
    for n in region:
        for a in n.args:
            if isinstance(a, float) and a not in out:
                out.append(a)
    return out


def _match_norm(latent: fx.Node, ev: RegionEvaluator):
    """({u, w, eps, region}, None) when latent = rms_norm(u.to(latent.dtype), w, eps); (None, why) for a
    region with a last-dim mean that computes something else; (None, None) when it is not norm-like."""
    lv = tensor_val(latent)
    shape = concrete_shape(lv)
    walked = _walk(latent, _NORM_OPS, stop_shape=shape)
    if walked is None:
        return None, None
    region, leaves = walked
    if not any(n.target == aten.mean.dim for n in region):
        return None, None
    us = [lf for lf in leaves if tensor_val(lf) is not None and concrete_shape(tensor_val(lf)) == shape
          and tensor_val(lf).is_floating_point()]
    ws = [lf for lf in leaves if tensor_val(lf) is not None and concrete_shape(tensor_val(lf)) == (shape[-1],)
          and tensor_val(lf).is_floating_point()]
    if len(us) != 1 or len(ws) != 1 or len(leaves) != 2:
        return None, ("rmsnorm_inputs", "the normalised tensor is computed from other inputs than one [..., D] "
                      "tensor and one [D] weight; dsv41::c2_*_store computes rms_norm(u, weight, eps)")
    u, w = us[0], ws[0]
    uv, wv = tensor_val(u), tensor_val(w)
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(shape, generator=gen, dtype=torch.float64)
    wp = (0.5 + torch.rand(shape[-1], generator=gen, dtype=torch.float64)).to(wv.dtype).to(wv.device)
    envs = [{u: (base * s).to(uv.dtype).to(uv.device), w: wp} for s in (1.0, 1e-3)]
    runs = probe_runs(ev, latent, envs)
    if runs is None:
        return None, None
    lits = _literals(region)
    for eps in lits:
        if all(close_scaled(got, rms_norm(env[u].to(lv.dtype), wp, eps)) for got, env in zip(runs, envs)):
            return dict(u=u, w=w, eps=float(eps), region=region), None
    if any(close_scaled(runs[0], rms_norm(envs[0][u].to(lv.dtype), wp, eps)) for eps in lits):
        return None, rms_eps_reason(lits, lambda eps: all(
            close_scaled(got, rms_norm_eps_outside(env[u].to(lv.dtype), wp, eps)) for got, env in zip(runs, envs)))
    return None, ("rmsnorm_values", "the region reads a [..., D] tensor and a [D] weight but does not compute "
                  "w * x * rsqrt(mean(x^2) + eps) in FP32 (MODEL.md §2.2)")


def _match_pool(u: fx.Node, ev: RegionEvaluator):
    """({k, g, prev_k, prev_g, region}, None) when u = the pair softmax pooling of four FP32 tensors of u's
    shape; (None, why) for such a region computing something else; (None, None) otherwise."""
    uv = tensor_val(u)
    if u.op != "call_function" or uv.dtype != torch.float32 or u.target not in _POOL_OPS:
        return None, None
    shape = concrete_shape(uv)
    walked = _walk(u, _POOL_OPS, stop_shape=shape)
    if walked is None:
        return None, None
    region, leaves = walked
    if len(leaves) != 4 or not any(n.target == aten.exp.default for n in region) or any(
            tensor_val(lf) is None or concrete_shape(tensor_val(lf)) != shape or tensor_val(lf).dtype != torch.float32
            for lf in leaves):
        return None, None
    gen = torch.Generator().manual_seed(9)
    env = {lf: torch.randn(shape, generator=gen).to(uv.device) for lf in leaves}
    # The same values x100: exp of a logit above ~88 overflows FP32, so a spelling without the max subtraction
    # (NaN there, where the fused op stays finite) agrees with the reference on the first probe only.
    wide = {lf: v * 100.0 for lf, v in env.items()}
    try:
        got = ev.evaluate([u], env)[u]
        got_wide = ev.evaluate([u], wide)[u]
    except (RegionNotClosed, RuntimeError):
        return None, None
    for perm in itertools.permutations(leaves):
        k, g, pk, pg = perm
        if close_scaled(got, reference_pair_pool(env[k], env[g], env[pk], env[pg])) and close_scaled(
                got_wide, reference_pair_pool(wide[k], wide[g], wide[pk], wide[pg])):
            return dict(k=k, g=g, prev_k=pk, prev_g=pg, region=region), None
    return None, ("pair_pool_values", "the norm input is computed from four FP32 tensors with exp but is not the "
                  "per-channel softmax over the pair (e0 prev_k + e1 k) / (e0 + e1) (MODEL.md §2.6); only the "
                  "norm -> rope -> fp4 -> write is fused")
