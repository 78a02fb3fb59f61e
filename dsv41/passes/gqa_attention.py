"""`gqa_attention` family: decode attention whose KV heads are repeated to the query heads becomes one op that
reads each cached KV row once (dsv41/kernels/gqa_attention.py).

Chain matched (post-grad ATen of `F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask)`, where
`repeat` is gpt-fast's `repeat_interleave(G, dim=1)` or transformers' `repeat_kv` (expand + reshape); both lower to
unsqueeze -> expand -> clone -> reshape):

    kr  = reshape(clone(expand(unsqueeze(k_cache, 2), [B, Hkv, G, S, D])), [B, Hkv G, S, D])   (vr likewise)
    out = getitem(<SDPA overload>(q, kr, vr, mask, ..., scale=scale), 0)
        -> out = dsv41::gqa_decode_attention(q, k_cache, v_cache, mask, scale)

SDPA overloads read (by their schema's argument names): `_scaled_dot_product_flash_attention_for_cpu` (CPU,
attn_mask), `_scaled_dot_product_efficient_attention` (CUDA, attn_bias), `_scaled_dot_product_flash_attention`
(CUDA, no mask) and `_scaled_dot_product_cudnn_attention` (CUDA, attn_bias).

Why. torch.compile materialises the repeated cache: every decode step writes and reads G copies of each layer's
whole K and V cache (two `clone` kernels per layer) before the attention reads them again.

Conditions: dropout_p 0, not is_causal, q [B, Hq, M, D] with a static M <= MAX_TRITON_M, only the attention
output used (no log-sum-exp), G > 1, and the repeat region, evaluated on a probe cache, equals
`repeat_interleave(G, dim=1)` of it exactly (a `repeat` that tiles heads in the other order is a near-miss).

Near-misses (reported, not fused):

    kv_layout   the KV operand is built from a cache of fewer heads, but not as repeat_interleave(G, dim=1)
    sdpa_args   dropout, is_causal, or the log-sum-exp output is used
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (Chain, FusionFamily, RegionEvaluator, Role, collect_region, concrete_shape, dsv41_op,
                     eliminate_dead_code, insert_node, is_dataflow_op, is_view_op, node_label, register_family,
                     tensor_val, token_rows)

__all__ = ["GqaAttentionFamily", "SPEC"]

aten = torch.ops.aten
#: SDPA overloads and the names their schemas give the mask argument (None: no mask argument).
_SDPA = {"_scaled_dot_product_flash_attention_for_cpu": "attn_mask",
         "_scaled_dot_product_efficient_attention": "attn_bias",
         "_scaled_dot_product_flash_attention": None,
         "_scaled_dot_product_cudnn_attention": "attn_bias"}
_MAX_M = 8
_PATTERN = "sdpa(q, repeat_kv(k), repeat_kv(v))"

SPEC = register_family(
    "gqa_attention", "decode attention over KV heads repeated to the query heads -> one op reading each cached KV "
    "row once", (
        Chain("gqa", "gqa_decode_attention", "SDPA overload whose k / v are a cache's KV heads repeated G times",
              (Role("q", "[B, Hq, M, D]", "bf16 / fp16 / fp32"), Role("k, v", "[B, Hkv, S, D]", "q's dtype"),
               Role("mask", "broadcastable to [B, Hq, M, S]", "bool / additive")),
              "dsv41.kernels.gqa_attention:reference_gqa_decode_attention", ("G (query heads per KV head)",),
              ("a probe cache through the repeat region equals repeat_interleave(G, dim=1) of it",),
              ("kv_layout", "sdpa_args"), gpu_validated=False),
    ), gpu_validated=False,
    # order: independent of the other families (none emits or reads SDPA); last
    after=("half_gemv",),
)


def _bound(node: fx.Node) -> dict:
    """The node's arguments by its schema's names (defaults filled in)."""
    schema = node.target._schema
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def _sdpa_kind(node: fx.Node):
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    name = node.target._schema.name.split("::")[-1]
    return name if name in _SDPA else None


def _repeated_cache(kv: fx.Node, hq: int):
    """(cache node [B, Hkv, S, D], G) when `kv` is built from a cache of fewer heads through views / expand / clone
    within 6 nodes; else None."""
    n = kv
    for _ in range(6):
        if not (isinstance(n, fx.Node) and n.op == "call_function"):
            return None
        if n.target == aten.unsqueeze.default:
            base = n.args[0]
            bv = tensor_val(base) if isinstance(base, fx.Node) else None
            shape = concrete_shape(bv) if bv is not None else None
            if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape):
                return None
            hkv = shape[1]
            if hkv == 0 or hq % hkv or hq == hkv:
                return None
            return base, hq // hkv
        if not (is_view_op(n) or n.target in (aten.expand.default, aten.clone.default)):
            return None
        n = n.args[0]
    return None


class GqaAttentionFamily(FusionFamily):
    """Fuse SDPA over repeated KV heads into `dsv41::gqa_decode_attention` (module docstring)."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Rewrite every matching attention of `gm` in place; returns the matches and near-misses."""
        graph = gm.graph
        matches, misses = [], []
        gated = "gqa_decode_attention" in self.gated_ops
        ev = None
        for node in list(graph.nodes):
            kind = _sdpa_kind(node)
            if kind is None:
                continue
            args = _bound(node)
            q, k, v = args["query"], args["key"], args["value"]
            qv = tensor_val(q) if isinstance(q, fx.Node) else None
            shape = concrete_shape(qv) if qv is not None else None
            if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape) or shape[2] > _MAX_M:
                continue
            found_k, found_v = _repeated_cache(k, shape[1]), _repeated_cache(v, shape[1])
            if found_k is None or found_v is None or found_k[1] != found_v[1]:
                continue
            loc = SourceLocation.from_node(node)
            outs = [u for u in node.users]
            if (args.get("dropout_p") or 0.0) != 0.0 or args.get("is_causal") or \
                    not all(u.target is operator.getitem and u.args[1] == 0 for u in outs):
                misses.append(NearMiss(self.name, _PATTERN, "sdpa_args",
                                       "the attention uses dropout, is_causal or its log-sum-exp output; "
                                       "dsv41::gqa_decode_attention computes the plain masked attention", loc))
                continue
            if ev is None:
                ev = RegionEvaluator(gm)
            why = None
            if not all(_is_repeat_interleave(ev, kv, *found) for kv, found in ((k, found_k), (v, found_v))):
                why = ("kv_layout", "the KV heads reach the attention in another order than repeat_interleave(G, "
                                    "dim=1) (query head h reading KV head h // G)")
            elif gated:
                why = ("gpu_unvalidated", "dsv41::gqa_decode_attention has not yet run on a GPU, so on CUDA this "
                                          "attention stays with Inductor (option gpu_unvalidated=True fuses it)")
            if why is not None:
                misses.append(NearMiss(self.name, _PATTERN, *why, loc))
                continue
            mask = args.get(_SDPA[kind]) if _SDPA[kind] else None
            matches.append(self._fuse(graph, node, outs, q, found_k, found_v[0], mask, args.get("scale")))
        eliminate_dead_code(graph)
        return PassRecord(self.name, True, tuple(matches), tuple(misses))

    def _fuse(self, graph, node, outs, q, found_k, v_cache, mask, scale) -> MatchRecord:
        k_cache, g = found_k
        out = insert_node(graph, outs[0], dsv41_op("gqa_decode_attention"), (q, k_cache, v_cache, mask, scale),
                          like=node)
        for u in outs:
            u.replace_all_uses_with(out)
        b, hkv, s, d = (int(x) for x in concrete_shape(tensor_val(k_cache)))
        e = tensor_val(k_cache).element_size()
        cache = 2 * b * hkv * s * d * e
        rows, subs = token_rows((b,))
        # Before: the repeat reads the caches and writes G copies, the attention reads the copies. After: one read.
        before = cache + 2 * g * cache
        after = cache
        nodes = [node] + outs
        return MatchRecord(self.name, f"gqa(G={g})", "dsv41::gqa_decode_attention", SourceLocation.from_node(node),
                           tuple(n.name for n in nodes), tuple(node_label(n) for n in nodes),
                           str(sympy.expand(before)), str(sympy.expand(after)), tuple(sorted(subs.items())),
                           (("G", g), ("S", s), ("D", d), ("launches_saved", 2)))


def _is_repeat_interleave(ev: RegionEvaluator, kv: fx.Node, cache: fx.Node, g: int) -> bool:
    """The region from `cache` to `kv` maps a probe cache to repeat_interleave(g, dim=1) of it, exactly."""
    region = collect_region([kv], [cache])
    if not all(n.op == "call_function" and (is_dataflow_op(n) or is_view_op(n)) for n in region):
        return False
    cv = tensor_val(cache)
    probe = torch.randn(tuple(cv.shape), generator=torch.Generator().manual_seed(0)).to(cv.dtype)
    try:
        got = ev.evaluate([kv], {cache: probe})[kv]
    except Exception:  # not closed over the cache: not this chain
        return False
    want = probe.repeat_interleave(g, dim=1)
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)
