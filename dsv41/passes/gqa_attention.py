"""`gqa_attention` family: decode attention whose KV heads are repeated to the query heads becomes one op that
reads each cached KV row once (dsv41/kernels/gqa_attention.py).

Chain matched (post-grad ATen of `F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask)`, where
`repeat` is gpt-fast's `repeat_interleave(G, dim=1)` or transformers' `repeat_kv` (expand + reshape); both lower to
unsqueeze -> expand -> clone -> reshape):

    kr  = reshape(clone(expand(unsqueeze(k_cache, 2), [B, Hkv, G, S, D])), [B, Hkv G, S, D])   (vr likewise)
    out = getitem(<SDPA overload>(q, kr, vr, mask, ..., scale=scale), 0)
        -> out = dsv41::gqa_decode_attention(q, k_cache, v_cache, mask, scale)

The same attention written out (`softmax(q @ repeat(k)^T * scale + mask) @ repeat(v)`: transformers' eager
attention, nanoGPT, a block written from the paper) lowers to two `bmm`s around the softmax; it is matched from
the second `bmm` (its right operand a repeated cache; its left computed from a first `bmm` of q and the other
repeated cache, through dataflow ops reading at most one more tensor, the mask) and verified on probes against the
op for each scale among the region's float literals, their inverses and 1/sqrt(D). The op computes in FP32 and
rounds once; eager bf16 rounds the scores and the probabilities to bf16 on the way, so the op may differ from it by
that rounding (about 2^-8 of the scores' scale in the probabilities), the tolerance of the chain's probe check.

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
    attention_values  the written-out attention reads repeated caches but agrees with the op on probes for no
                scale (KV heads in another order than repeat_interleave, or a mask the op cannot take as given,
                e.g. a 0 / 1 float mask turned into -inf by the region)
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from ..kernels.gqa_attention import reference_gqa_decode_attention
from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (Chain, FusionFamily, RegionEvaluator, Role, collect_region, concrete_shape, dsv41_op,
                     eliminate_dead_code, float_literals, insert_node, is_dataflow_op, is_view_op, node_label,
                     register_family, sourced_nodes, tensor_val, token_rows)

__all__ = ["GqaAttentionFamily", "SPEC"]

aten = torch.ops.aten
#: SDPA overloads and the names their schemas give the mask argument (None: no mask argument).
_SDPA = {"_scaled_dot_product_flash_attention_for_cpu": "attn_mask",
         "_scaled_dot_product_efficient_attention": "attn_bias",
         "_scaled_dot_product_flash_attention": None,
         "_scaled_dot_product_cudnn_attention": "attn_bias"}
_MAX_M = 8
_PATTERN = "sdpa(q, repeat_kv(k), repeat_kv(v))"
_EAGER = "softmax(q @ repeat_kv(k)^T * scale + mask) @ repeat_kv(v)"

SPEC = register_family(
    "gqa_attention", "decode attention over KV heads repeated to the query heads -> one op reading each cached KV "
    "row once", (
        Chain("gqa", "gqa_decode_attention", "SDPA overload whose k / v are a cache's KV heads repeated G times",
              (Role("q", "[B, Hq, M, D]", "bf16 / fp16 / fp32"), Role("k, v", "[B, Hkv, S, D]", "q's dtype"),
               Role("mask", "broadcastable to [B, Hq, M, S]", "bool / additive")),
              "dsv41.kernels.gqa_attention:reference_gqa_decode_attention", ("G (query heads per KV head)",),
              ("a probe cache through the repeat region equals repeat_interleave(G, dim=1) of it",),
              ("kv_layout", "sdpa_args")),
        Chain("eager", "gqa_decode_attention", "bmm(probs, repeat(v)) whose probs are a softmax of bmm(q, "
              "repeat(k)^T), scaled and masked",
              (Role("q", "[B, Hq, M, D]", "bf16 / fp16 / fp32"), Role("k, v", "[B, Hkv, S, D]", "q's dtype"),
               Role("mask", "broadcastable to [B, Hq, M, S]", "bool / additive")),
              "dsv41.kernels.gqa_attention:reference_gqa_decode_attention", ("scale",),
              ("random q / caches with a random mask; the scale among the region's literals, their inverses and "
               "1/sqrt(D)",), ("attention_values",)),
    ),
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
    for _ in range(8):
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
        ev, sourced = None, None
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
                ev = RegionEvaluator(gm, extra_ops=frozenset({aten.bmm.default}))
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
        for b2 in [n for n in graph.nodes if n.op == "call_function" and n.target == aten.bmm.default]:
            if b2.graph is not graph or not b2.users:
                continue
            if sourced is None:
                sourced = sourced_nodes(graph)
            site = eager_attention(b2, sourced)
            if site is None:
                continue
            out4, q, found_k, found_v, mask, region = site
            loc = SourceLocation.from_node(b2)
            if ev is None:
                ev = RegionEvaluator(gm, extra_ops=frozenset({aten.bmm.default}))
            # the head order is part of the probe check: another order gives other outputs on random caches
            settled = _eager_scale(ev, out4, q, found_k[0], found_v[0], mask, region)
            if settled is None:
                misses.append(NearMiss(self.name, _EAGER, "attention_values", "the written-out attention reads "
                                       "repeated caches but agrees with dsv41::gqa_decode_attention on probes for no "
                                       "scale among its literals, their inverses and 1/sqrt(D)", loc))
                continue
            if gated:
                misses.append(NearMiss(self.name, _EAGER, "gpu_unvalidated", "dsv41::gqa_decode_attention has not "
                                       "yet run on a GPU, so on CUDA this attention stays with Inductor (option "
                                       "gpu_unvalidated=True fuses it)", loc))
                continue
            scale, invert = settled
            if invert:
                mask = insert_node(graph, out4, aten.bitwise_not.default, (mask,), like=b2)
            matches.append(self._fuse(graph, b2, [out4], q, found_k, found_v[0], mask, scale,
                                      pattern=f"eager_gqa(G={found_k[1]})", extra=region))
        eliminate_dead_code(graph)
        return PassRecord(self.name, True, tuple(matches), tuple(misses))

    def _fuse(self, graph, node, outs, q, found_k, v_cache, mask, scale, pattern=None, extra=()) -> MatchRecord:
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
        nodes = [node] + outs + [n for n in extra if n is not node and n not in outs]
        return MatchRecord(self.name, pattern or f"gqa(G={g})", "dsv41::gqa_decode_attention", SourceLocation.from_node(node),
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


def _through_views_back(n: fx.Node, want_dim: int, limit: int = 8):
    """The first node with a `want_dim`-D value walking back from n through view ops (n itself first), or None."""
    for _ in range(limit):
        v = tensor_val(n) if isinstance(n, fx.Node) else None
        if v is None:
            return None
        if v.dim() == want_dim:
            return n
        if not (n.op == "call_function" and is_view_op(n)):
            return None
        n = n.args[0]
    return None


def eager_attention(b2: fx.Node, sourced: set):
    """(out [B, Hq, M, D] node, q, (k cache, G), (v cache, G), mask or None, region nodes) when `b2` is the second
    bmm of a written-out attention over repeated caches (module docstring); else None. `sourced`: the graph's nodes
    fed by its inputs (`engine.sourced_nodes`); the scores' path reads nothing else from them but the mask."""
    outs = list(b2.users)
    if len(outs) != 1 or not is_view_op(outs[0]):
        return None
    out4 = outs[0]
    shape = concrete_shape(tensor_val(out4))
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape) or shape[2] > _MAX_M:
        return None
    hq = shape[1]
    found_v = _repeated_cache(b2.args[1], hq)
    if found_v is None:
        return None
    # the first bmm above the probabilities, through dataflow ops only
    b1, seen, stack = None, set(), [b2.args[0]]
    while stack and len(seen) < 40:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target == aten.bmm.default:
            b1 = n if b1 is None else b1
            continue
        if n.op == "call_function" and (is_dataflow_op(n) or is_view_op(n)):
            stack.extend(n.all_input_nodes)
    if b1 is None:
        return None
    found_k = _repeated_cache(b1.args[1], hq)
    q = _through_views_back(b1.args[0], 4)
    if found_k is None or q is None or found_k[1] != found_v[1]:
        return None
    qv = concrete_shape(tensor_val(q))
    if tuple(qv) != (shape[0], hq, shape[2], shape[3]):
        return None
    # the scores' path from b1 to the probabilities; what else it reads (besides constants) is the mask
    inner = collect_region([b2.args[0]], [b1])
    dep = {b1}
    for n in inner:  # collect_region gives graph order
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    others = {a for n in dep if n is not b1 for a in n.all_input_nodes
              if a not in dep and isinstance(tensor_val(a), torch.Tensor) and a in sourced}
    if len(others) > 1:
        return None
    mask = next(iter(others), None)
    if mask is not None:
        try:
            torch.broadcast_shapes(tuple(concrete_shape(tensor_val(mask))), (shape[0], hq, shape[2],
                                                                             tensor_val(found_k[0]).shape[2]))
        except (RuntimeError, TypeError):
            return None
    nodes = collect_region([out4], [q, found_k[0], found_v[0]] + ([mask] if mask is not None else []))
    if not all(n.op == "call_function" and (is_dataflow_op(n) or is_view_op(n) or n.target == aten.bmm.default)
               for n in nodes):
        return None
    return out4, q, found_k, found_v, mask, nodes


def _eager_scale(ev: RegionEvaluator, out4, q, k_cache, v_cache, mask, nodes):
    """(scale, invert the boolean mask) for which the op equals the written-out attention on probes (module
    docstring), or None."""
    g = torch.Generator().manual_seed(4)
    qv, kv = tensor_val(q), tensor_val(k_cache)
    env = {q: (torch.randn(tuple(qv.shape), generator=g) * 2).to(qv.dtype),
           k_cache: torch.randn(tuple(kv.shape), generator=g).to(kv.dtype),
           v_cache: torch.randn(tuple(tensor_val(v_cache).shape), generator=g).to(kv.dtype)}
    if mask is not None:
        mv = tensor_val(mask)
        keep = torch.rand(tuple(mv.shape), generator=g) < 0.7
        keep[..., 0] = True
        env[mask] = keep if mv.dtype == torch.bool else \
            torch.where(keep, 0.0, float("-inf")).to(mv.dtype)
    try:
        got = ev.evaluate([out4], env)[out4]
    except Exception:  # not closed over q, the caches and the mask: not this chain
        return None
    if not isinstance(got, torch.Tensor) or got.isnan().any():
        return None
    d = int(qv.shape[-1])
    lits = float_literals(nodes)
    cands = lits + [1.0 / x for x in lits if x != 0] + [d ** -0.5, 1.0]
    f32 = {n: (t.float() if t.is_floating_point() else t) for n, t in env.items()}
    ref_mask = f32.get(mask) if mask is not None else None
    # eager in bf16 / fp16 rounds the scores and probabilities to that dtype; the op does not (module docstring)
    tol = 1e-5 if qv.dtype == torch.float32 else 4 * torch.finfo(qv.dtype).eps
    scale_v = float(env[v_cache].float().abs().max())
    # a boolean mask may mark what to hide (`masked_fill(~visible, -inf)` hands the region ~visible): its complement
    # is the op's "may attend" mask
    masks = [(ref_mask, False)] + ([(~ref_mask, True)] if ref_mask is not None and ref_mask.dtype == torch.bool
                                   else [])
    for sc in cands:
        for m, invert in masks:
            want = reference_gqa_decode_attention(f32[q], f32[k_cache], f32[v_cache], m, sc)
            if torch.allclose(got.float(), want, rtol=tol, atol=tol * scale_v):
                return sc, invert
    return None
