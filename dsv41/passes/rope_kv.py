"""`rope_kv` family: RoPE of the new token's q and k and the KV-cache write of k and v become one op
(dsv41/kernels/rope_kv.py), so a Llama-style layer spends one launch between its q/k/v projection and its attention.

Chain matched (post-grad ATen; a static cache [B, Hkv, T, D] written at the step's positions `pos`):

    kc' = index_put(k_cache, [None, None, pos], views(rope(xk)))      (or index_copy(k_cache, 2, pos, ...))
    vc' = index_put(v_cache, [None, None, pos], views(xv))
    qr  = rope(xq)                                                    (optional: the q sharing k's angles)
        -> qr, kc', vc' = dsv41::rope_kv_store(q, k, v, cos, sin, pos, k_cache!, v_cache!, layout, round, stride)

`rope` is any spelling the probes pin to one of the op's layouts: interleaved pairs (Meta / gpt-fast
`view_as_complex(x) * freqs_cis`, or stack/flatten), rotate-half with half-width angles, or transformers'
`x * cos + rotate_half(x) * sin` with full-width cos / sin; in FP32 or, where the angles are in x's dtype, with
each product rounded as eager rounds it; halves taken by slicing or `x.chunk(2, -1)`; after a QK-norm or not. q and k
may be rotated in [B, S, H, D] or [B, H, S, D] order (both tried when S equals the head count).

Structure: the anchor is a write of a 4-D float cache at dim 2 (`index_put` with indices [None, None, pos] or
`index_copy` on dim 2), pos int64 [S]; k's write is the one whose value is a RoPE region (`rope_region`: one x
plus cos / sin or complex freqs), v's the next write at the same positions into a cache of
the same shape whose value is views of a tensor (not a cache computed from k's write). q is the RoPE region closest
to k's in graph order that reads the same angle tensors; when the probes reject it (other angles built from k's),
k and v fuse without q. Which pairs are grouped is a scheduling choice, not a semantic one: each op still rotates and
writes what its own inputs say.

Semantics: the whole chain (q's RoPE, both writes) is evaluated on probe tensors (random x, angles, caches and
distinct positions) and compared with `reference_rope_kv_store` for each layout, each cos/sin assignment and
the rounding mode; the first that agrees exactly is used, else the first within 4 ulps, else the chain is a near-miss
(`rope_values`).

Near-misses: `rope_values` (the region reads x and angles but is no layout of the op: partial rotary, inverse
rotation, angles that differ per head), `cache_write` (accumulating write, positions not int64 [S], a value
that reads other tensors, no v write into an independent cache), `order` (an input of the op is computed from one
of its outputs), `static_shapes`.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from ..kernels.rope_kv import LAYOUTS, reference_rope_kv_store
from .engine import (Chain, FusionFamily, GraphScan, RegionNotClosed, Role, close_scaled, concrete_shape, dsv41_op,
                     finish_graph, insert_node, is_view_op, node_label, register_family, same_shape,
                     static_refusal, tensor_val, token_rows, walk_inputs)
from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .rope_match import is_rope_op, order_key, rope_structure, trig_operands

__all__ = ["RopeKvFamily", "SPEC", "cache_write_parts", "rope_region"]

aten = torch.ops.aten
_PATTERN = "rope(q), cache[:, :, pos] = rope(k), v"
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_FORWARD_LIMIT = 400

SPEC = register_family(
    "rope_kv", "RoPE of q and k and the KV-cache write of k and v -> one op", (
        Chain("rope_kv", "rope_kv_store", "a write of a 4-D float cache at dim 2 (index_put [None, None, pos] / "
              "index_copy) whose value is a RoPE of one tensor",
              (Role("q", "[B, S, H, D] or [B, H, S, D]", "bf16 / fp16 / fp32"), Role("k, v", "[B, S, Hkv, D]", "q's"),
               Role("cos, sin", "broadcastable to x", "fp32, complex64 freqs, or x's dtype"),
               Role("pos", "[S]", "int64"), Role("k_cache, v_cache", "[B, Hkv, T, D]", "k's dtype")),
              "dsv41.kernels.rope_kv:reference_rope_kv_store", ("layout", "which trig tensor is cos", "rounding"),
              ("random x, angles, caches and distinct positions through q's RoPE and both writes",),
              ("rope_values", "cache_write", "order", "static_shapes")),
    ),
    # order: after the projections are fused (their outputs are this op's inputs) and before gqa_attention, which
    # then reads the caches this op writes
    after=("half_gemv",), before=("gqa_attention",),
)


def cache_write_parts(n: fx.Node):
    """(cache, pos, value) when `n` writes a 4-D float cache at dim 2: `index_put(cache, [None, None, pos], value)`
    without accumulate, or `index_copy(cache, 2, pos, value)`, pos int64 [S]; else None."""
    if n.op != "call_function":
        return None
    if n.target == aten.index_put.default:
        cache, idx, value = n.args[0], n.args[1], n.args[2]
        acc = n.args[3] if len(n.args) > 3 else n.kwargs.get("accumulate", False)
        if acc or len(idx) != 3 or idx[0] is not None or idx[1] is not None or not isinstance(idx[2], fx.Node):
            return None
        pos = idx[2]
    elif n.target == aten.index_copy.default:
        cache, dim, pos, value = n.args[:4]
        if dim not in (2, -2):
            return None
    else:
        return None
    cv, pv, vv = (tensor_val(a) if isinstance(a, fx.Node) else None for a in (cache, pos, value))
    if cv is None or pv is None or vv is None or cv.dim() != 4 or cv.dtype not in _FLOATS or vv.dtype != cv.dtype:
        return None
    if pv.dtype != torch.int64 or pv.dim() != 1:
        return None
    return cache, pos, value


def _view_chain(value: fx.Node):
    """(source, [views from source to value]) walking back through view ops."""
    chain = []
    n = value
    while is_view_op(n) and isinstance(n.args[0], fx.Node):
        chain.append(n)
        n = n.args[0]
    return n, chain[::-1]


def rope_region(y: fx.Node, sourced: set):
    """(region, x, trig leaves) of the RoPE computing y, as `rope_match.rope_structure`; when that finds none,
    x is searched among the tensors with y's elements (up to dims of size 1: a cache write's value loses a batch dim
    of 1 to the broadcast) and dtype that y is computed from through RoPE-like ops, nearest to y first, and the first
    whose region reads nothing else than one cos / sin pair or one complex tensor is taken. That finds x behind
    products and sums of x's own shape (transformers' `x * cos + rotate_half(x) * sin` in bf16) and stops at a
    QK-norm's output, whose region would also read the norm's weight."""
    found = rope_structure(y, sourced)
    if found is not None:
        return found
    yv = tensor_val(y)
    want = (_squeezed(concrete_shape(yv)), yv.dtype)

    def cone_step(n, seen):
        """Walk every sourced RoPE-like input."""
        return [a for a in n.all_input_nodes if a in sourced and a not in seen and _rope_like(a)]

    cone = walk_inputs(y, _FORWARD_LIMIT, cone_step)
    if cone is None:
        return None
    cands = {a for n in cone for a in n.all_input_nodes if a in sourced} | (cone - {y})
    cands = [c for c in cands if tensor_val(c) is not None
             and (_squeezed(concrete_shape(tensor_val(c))), tensor_val(c).dtype) == want]
    pos = {n: i for i, n in enumerate(y.graph.nodes)}
    for x in sorted(cands, key=lambda n: -pos.get(n, -1)):
        leaves: list = []

        def step(n, region, x=x, leaves=leaves):
            """Walk RoPE-like inputs up to x; anything else is a leaf."""
            nxt = []
            for a in n.all_input_nodes:
                if a is x or a in region or a in leaves or a not in sourced:
                    continue
                (nxt if _rope_like(a) else leaves).append(a)
            return nxt

        region = walk_inputs(y, _FORWARD_LIMIT, step)
        if region is None or x in region or not _reaches_x(region, x):
            continue
        vals = [tensor_val(lf) for lf in leaves]
        if any(v is None for v in vals):
            continue
        if len(leaves) == 1 and vals[0].is_complex():
            return region, x, leaves
        if (len(leaves) == 2 and all(v.is_floating_point() for v in vals) and same_shape(vals[0].shape, vals[1].shape)
                and vals[0].dtype == vals[1].dtype):
            return region, x, leaves
    return None


_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


def _rope_like(n: fx.Node) -> bool:
    """A RoPE-like op (`rope_match.is_rope_op`), or a split and its getitems (`x.chunk(2, -1)` of rotate-half)."""
    if n.op != "call_function":
        return False
    if n.target in _SPLITS:
        return True
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and src.target in _SPLITS
    return is_rope_op(n)


def _reaches_x(region, x) -> bool:
    return any(x in n.all_input_nodes for n in region)


def _squeezed(shape):
    return None if shape is None else tuple(d for d in shape if d != 1)


def _rope_source(value: fx.Node, sourced: set):
    """(y, the views from y to `value`, `rope_region(y)`) for the first node y, from the source of `value`'s chain of
    views towards `value`, that is a RoPE output (a flatten of stacked pairs is one only after its view; a permute
    after the rotation is not part of it); (source, views, None) when none is."""
    src, chain = _view_chain(value)
    cands = [(src, chain)] + [(chain[i], chain[i + 1:]) for i in range(len(chain))]
    for y, after in cands:
        yv = tensor_val(y)
        # a complex product (view_as_complex(x) * freqs in FP32, where no cast separates it from the write's
        # view_as_real) is no RoPE output of the op: its x would be complex, of half the head dim
        if yv is None or yv.is_complex():
            continue
        found = rope_region(y, sourced)
        if found is not None:
            return y, after, found
    return src, chain, None


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, int) for d in shape)


class _Site:
    """One k write, its v write and the q RoPE found for them, with the k RoPE region."""

    def __init__(self, wk, wv, yk, region_k, xk, leaves, chain_k, yq, region_q, xq, value_v):
        self.wk, self.wv, self.yk, self.region_k, self.xk = wk, wv, yk, region_k, xk
        self.leaves, self.chain_k, self.yq, self.region_q, self.xq, self.value_v = \
            leaves, chain_k, yq, region_q, xq, value_v


class RopeKvFamily(FusionFamily):
    """Fuse RoPE of q / k with the KV-cache writes into `dsv41::rope_kv_store` (module docstring)."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Rewrite every verified chain of `gm` in place; returns the matches and near-misses."""
        op = dsv41_op("rope_kv_store")
        if op is None:
            return PassRecord(self.name, True, note="dsv41::rope_kv_store not registered")
        scan = GraphScan(gm, eval_ops=frozenset({aten.index_put.default, aten.index_copy.default}))
        graph, ev, sourced = scan.graph, scan.ev, scan.sourced
        writes = [n for n in graph.nodes if cache_write_parts(n) is not None]
        if not writes:
            return PassRecord(self.name, True)
        key = order_key(graph)
        matches, misses = [], []
        rope_of: dict = {}
        for w in writes:
            rope_of[w] = _rope_source(cache_write_parts(w)[2], sourced)
        used: set = set()
        used_q: set = set()
        gated = "rope_kv_store" in self.gated_ops
        for wk in writes:
            src, chain_k, found = rope_of[wk]
            if found is None or wk in used:
                continue
            cache_k, pos, _ = cache_write_parts(wk)
            loc = SourceLocation.from_node(wk)
            fits = [w for w in sorted(writes, key=lambda n: abs(key(n) - key(wk)))
                    if w is not wk and w not in used and rope_of[w][2] is None
                    and cache_write_parts(w)[1] is pos
                    and concrete_shape(tensor_val(cache_write_parts(w)[0])) == concrete_shape(tensor_val(cache_k))]
            # a write into the cache k's write produced (k written again, or one buffer holding both caches) is
            # no v write the op can do alongside k's: it must see k's write first
            wv = next((w for w in fits if not _reaches([cache_write_parts(w)[0]], [wk], key)), None)
            if wv is None:
                why = ("a RoPE'd k is written into a cache, but no write of v at the same positions into a cache of "
                       "the same shape was found")
                if fits:
                    why = ("a RoPE'd k is written into a cache, but every write at the same positions into a cache "
                           "of the same shape writes a cache computed from k's write (the same cache again, or one "
                           "buffer holding both caches)")
                misses.append(NearMiss(self.name, _PATTERN, "cache_write", why, loc))
                continue
            region_k, xk, leaves = found
            yq, region_q, xq = self._find_q(src, region_k, xk, leaves, sourced, key, used_q)
            site = _Site(wk, wv, src, region_k, xk, leaves, chain_k, yq, region_q, xq, cache_write_parts(wv)[2])
            refused = static_refusal(self.name, _PATTERN, [wk, wv, xk, *(n for n in (xq, yq) if n is not None)], loc,
                                     "dsv41::rope_kv_store")
            if refused is not None:
                misses.append(refused)
                continue
            rec, why = self._fuse(graph, ev, op, site, key, gated)
            if rec is None:
                misses.append(NearMiss(self.name, _PATTERN, why[0], why[1], loc))
                continue
            used.update((wk, wv))
            if site.yq is not None:  # _fuse drops a q that the probes reject
                used_q.add(site.yq)
            matches.append(rec)
        if matches:
            finish_graph(graph)
        return PassRecord(self.name, True, tuple(matches), tuple(misses))

    # ------------------------------------------------------------------ q
    @staticmethod
    def _find_q(yk, region_k, xk, leaves, sourced, key, used_q):
        """(yq, region, xq) of the RoPE region closest to k's in graph order that reads the same angle leaves; Nones
        when there is none."""
        kv = tensor_val(xk)
        seen, frontier, cands = set(), list(leaves), []
        while frontier and len(seen) < _FORWARD_LIMIT:
            n = frontier.pop()
            for u in n.users:
                if u in seen or u is yk:
                    continue
                seen.add(u)
                uv = tensor_val(u)
                if uv is None:
                    continue
                # k's region holds the angles' shared casts and views: walk through it, take nothing from it
                if (u.op == "call_function" and u not in region_k and uv.dtype == kv.dtype and uv.dim() == 4
                        and concrete_shape(uv)[-1] == _heads(concrete_shape(kv))[-1] and u not in used_q):
                    cands.append(u)
                if _rope_like(u):
                    frontier.append(u)
        found = {}
        for y in cands:
            f = rope_region(y, sourced)
            # q's x must have y's own shape: the op returns q rotated in x's layout for y's place
            if (f is not None and set(f[2]) == set(leaves) and f[1] is not xk
                    and _heads(concrete_shape(tensor_val(f[1]))) == tuple(concrete_shape(tensor_val(y)))):
                found[y] = f
        # an inner node of a larger RoPE region (a product of x's own shape and dtype) is not a RoPE output
        outer = [y for y in found if not any(y in f[0] for z, f in found.items() if z is not y)]
        y = min(outer, key=lambda n: abs(key(n) - key(yk)), default=None)
        return (None, None, None) if y is None else (y, found[y][0], found[y][1])

    # ------------------------------------------------------------------ rewrite
    def _fuse(self, graph, ev, op, site: _Site, key, gated):
        """Insert the op for `site` after checking order and values; (MatchRecord, None) or (None, (check, why))."""
        cache_k, pos, _ = cache_write_parts(site.wk)
        cache_v = cache_write_parts(site.wv)[0]
        outs = [site.wk, site.wv] + ([site.yq] if site.yq is not None else [])
        if not any(o.users for o in outs):
            return None, ("cache_write", "nothing reads the written caches or q")
        trig = trig_operands(sorted(site.region_k, key=key), site.xk, list(site.leaves))
        if any(trig.get(lf) is None for lf in site.leaves):
            return None, ("rope_values", "the angle tensors are read in more than one form")
        inputs = [site.xk, site.value_v, pos, cache_k, cache_v, *trig.values()] + \
            ([site.xq] if site.xq is not None else [])
        if _reaches(inputs, outs, key):
            return None, ("order", "an input of the fused op is computed from one of its outputs")
        # after the last input; the stable topological sort at the end moves earlier readers of the outputs after it
        anchor = max(inputs, key=key).next
        if gated:
            return None, ("gpu_unvalidated", "dsv41::rope_kv_store has not yet run on a GPU, so on CUDA this chain "
                                             "stays with Inductor (option gpu_unvalidated=True fuses it)")
        kv = tensor_val(site.xk)
        b, hkv, t, d = (int(x) for x in concrete_shape(tensor_val(cache_k)))
        s = int(concrete_shape(tensor_val(pos))[0])
        new: list = []

        def add(target, args, like=site.wk):
            """Insert `target(*args)` before the anchor, remembered for `undo`; the new node."""
            node = insert_node(graph, anchor, target, args, like=like)
            new.append(node)
            return node

        def undo(why):
            """Erase every node `add` inserted (last first); (None, why) for the caller to return."""
            for n in reversed(new):
                graph.erase_node(n)
            return None, why

        # k and v in [B, S, Hkv, D]: k's views replayed on the RoPE input, broadcast as the write broadcasts
        k_val = site.xk
        if concrete_shape(kv) != concrete_shape(tensor_val(site.yk)):
            k_val = add(aten.reshape.default, (k_val, list(concrete_shape(tensor_val(site.yk)))))
        for v in site.chain_k:
            k_val = add(v.target, (k_val, *v.args[1:]))
        canon = []
        for val in (k_val, site.value_v):
            e = add(aten.expand.default, (val, [b, hkv, s, d]))
            canon.append(add(aten.permute.default, (e, [0, 2, 1, 3])))
        k_c, v_c = canon
        kshape = _heads(concrete_shape(kv))
        perms_k = _orientations(kshape, s, hkv)
        if not perms_k:
            return undo(("rope_values", f"k's RoPE input {kshape} is neither [B, S, Hkv, D] nor "
                                        "[B, Hkv, S, D]"))
        perms_q: list = [None]
        xq = site.xq
        if xq is not None:
            qshape = _heads(concrete_shape(tensor_val(xq)))
            if qshape != tuple(concrete_shape(tensor_val(xq))):
                xq = add(aten.reshape.default, (xq, list(qshape)))
            perms_q = [p for p in ((0, 1, 2, 3), (0, 2, 1, 3))
                       if p in _orientations(qshape, s, qshape[2 if p[1] == 1 else 1])]
            if not perms_q:
                return undo(("rope_values", f"q's RoPE input {tuple(qshape)} is neither [B, S, H, D] nor [B, H, S, D]"))

        def trig_parts(perm_k):
            """cos / sin [B, S, W] from each trig operand: broadcast to k's lead dims, in [B, S, Hkv] order, head 0."""
            parts = []
            for lf in site.leaves:
                a = trig[lf]
                av = tensor_val(a)
                w = int(concrete_shape(av)[-1])
                e = add(aten.expand.default, (a, list(kshape[:-1]) + [w]))
                p = add(aten.permute.default, (e, list(perm_k)))
                sel = add(aten.select.int, (p, 2, 0))
                if av.is_complex():
                    real = add(aten.view_as_real.default, (sel,))
                    parts += [add(aten.select.int, (real, -1, 0)), add(aten.select.int, (real, -1, 1))]
                else:
                    parts.append(sel)
            return parts

        def settle():
            """(choice, parts, q_c, perm_q) of the first orientation the probes agree with; choice None when none."""
            # With S equal to the head count both orders fit the shapes; the probes settle which one the code uses.
            for perm_k in perms_k:
                parts = trig_parts(perm_k)
                if len(parts) != 2:
                    return "trig", parts, None, None
                for perm_q in perms_q:
                    q_c = None
                    if perm_q is not None:
                        q_c = add(aten.permute.default, (xq, list(perm_q))) if perm_q != (0, 1, 2, 3) else xq
                    choice = self._verify(ev, site, k_c, v_c, q_c, perm_q, parts, pos, t, kv.dtype)
                    if choice is not None:
                        return choice, parts, q_c, perm_q
            return None, None, None, None

        choice, parts, q_c, perm_q = settle()
        if choice is None and site.xq is not None:
            # The q found (the nearest RoPE on k's angle tensors) may rotate by other angles built from them
            # (a doubled angle, the inverse): k and v still fuse, and q stays with Inductor.
            site.yq = site.region_q = site.xq = None
            perms_q = [None]
            choice, parts, q_c, perm_q = settle()
        if choice == "trig":
            return undo(("rope_values", "the region reads other than one cos / sin pair or one complex freqs tensor"))
        if choice is None:
            return undo(("rope_values", "the region reads x and angle tensors but agrees with no layout of "
                                        "rope_kv_store (interleaved, rotate-half, rotate-half with full-width angles; "
                                        "whole head dim, +angle) on probes"))
        layout, swap, rnd = choice
        cos, sin = (parts[1], parts[0]) if swap else (parts[0], parts[1])
        ct = tensor_val(cos).dtype
        if ct not in (torch.float32, kv.dtype):
            cos = add(torch.ops.prims.convert_element_type.default, (cos, torch.float32))
            sin = add(torch.ops.prims.convert_element_type.default, (sin, torch.float32))
        q_stride = [0, 0, 0, 0]
        if site.yq is not None:
            ys = list(tensor_val(site.yq).stride())
            q_stride = [int(ys[i]) for i in perm_q]
        af = insert_node(graph, anchor, torch.ops.higher_order.auto_functionalized, (op,), dict(
            q=q_c, k=k_c, v=v_c, cos=cos, sin=sin, pos=pos, k_cache=cache_k, v_cache=cache_v, layout=layout,
            round_products=rnd, q_out_stride=q_stride), like=site.wk)
        q_new = insert_node(graph, anchor, operator.getitem, (af, 0), like=site.wk)
        kc_new = insert_node(graph, anchor, operator.getitem, (af, 1), like=site.wk)
        vc_new = insert_node(graph, anchor, operator.getitem, (af, 2), like=site.wv)
        site.wk.replace_all_uses_with(kc_new)
        site.wv.replace_all_uses_with(vc_new)
        if site.yq is not None:
            inv = [perm_q.index(i) for i in range(4)]
            back = insert_node(graph, anchor, aten.permute.default, (q_new, inv), like=site.yq) \
                if perm_q != (0, 1, 2, 3) else q_new
            site.yq.replace_all_uses_with(back)
        replaced = [site.wk, site.wv] + list(site.region_k) + list(site.region_q or ())
        return self._record(site, replaced, layout, rnd, b, s, hkv, d), None

    def _verify(self, ev, site, k_c, v_c, q_c, perm_q, parts, pos, t, dtype):
        """(layout, swap cos/sin, round products) for which the reference equals the chain on probes, or None."""
        g = torch.Generator().manual_seed(11)
        cache_k = cache_write_parts(site.wk)[0]
        cache_v = cache_write_parts(site.wv)[0]
        s = int(concrete_shape(tensor_val(pos))[0])

        def rnd(node):
            """A standard-normal probe of the node's compiled shape and dtype."""
            v = tensor_val(node)
            return torch.randn(tuple(concrete_shape(v)), generator=g).to(v.dtype)

        env = {cache_k: rnd(cache_k), cache_v: rnd(cache_v), site.xk: rnd(site.xk), site.value_v: rnd(site.value_v),
               pos: torch.randperm(t, generator=g)[:s].sort().values if s <= t else torch.arange(s)}
        if site.xq is not None:
            env[site.xq] = rnd(site.xq)
        for lf in site.leaves:
            v = tensor_val(lf)
            ang = torch.rand(tuple(concrete_shape(v)), generator=g, dtype=torch.float64) * 6.283
            env[lf] = (torch.polar(torch.ones_like(ang), ang) if v.is_complex() else ang.cos()).to(v.dtype)
        wanted = [site.wk, site.wv, k_c, v_c, *parts] + ([site.yq, q_c] if site.yq is not None else [])
        try:
            got = ev.evaluate(wanted, env)
        except (RegionNotClosed, RuntimeError, TypeError, ValueError, IndexError):
            return None
        d = int(_heads(concrete_shape(tensor_val(site.xk)))[-1])
        for exact in (True, False):  # an exact spelling first: within 4 ulps both roundings may pass
            for layout, (_, frac) in LAYOUTS.items():
                if int(got[parts[0]].shape[-1]) != d // frac:
                    continue
                for swap in (False, True):
                    for round_products in (True, False):
                        if self._agrees(got, env, site, k_c, v_c, q_c, perm_q, parts, pos, layout, swap,
                                        round_products, dtype, exact):
                            return layout, swap, round_products
        return None

    @staticmethod
    def _agrees(got, env, site, k_c, v_c, q_c, perm_q, parts, pos, layout, swap, round_products, dtype, exact):
        """Whether the reference with these choices reproduces the probed chain (bit for bit when `exact`)."""
        cache_k, cache_v = cache_write_parts(site.wk)[0], cache_write_parts(site.wv)[0]
        c, sn = (got[parts[1]], got[parts[0]]) if swap else (got[parts[0]], got[parts[1]])
        if round_products and (c.dtype != dtype or dtype == torch.float32):
            return False
        if c.dtype not in (torch.float32, dtype):
            c, sn = c.float(), sn.float()
        kc, vc = env[cache_k].clone(), env[cache_v].clone()
        q = got[q_c] if site.yq is not None else None
        stride = list(torch.empty(q.shape).stride()) if q is not None else [0, 0, 0, 0]
        try:
            qr = reference_rope_kv_store(q, got[k_c], got[v_c], c, sn, env[pos], kc, vc, layout, round_products,
                                         stride)
        except (ValueError, TypeError):
            return False
        same = torch.equal if exact else close_scaled
        if not (same(kc, got[site.wk]) and torch.equal(vc, got[site.wv])):
            return False
        return q is None or same(qr.permute([perm_q.index(i) for i in range(4)]).contiguous(),
                                 got[site.yq].contiguous())

    def _record(self, site, replaced, layout, rnd, b, s, hkv, d) -> MatchRecord:
        e = tensor_val(site.xk).element_size()
        qshape = None if site.xq is None else _heads(concrete_shape(tensor_val(site.xq)))
        h = 0 if qshape is None else int(qshape[2 if qshape[1] == s else 1])
        rows_expr, subs = token_rows((b, s))
        qk = (h + hkv) * d
        # Before: each RoPE reads x, writes an FP32 copy, reads it with the angles, writes the FP32 result, reads
        # it and writes x's dtype; the writes read k / v again and write the cache rows. After: x read once,
        # q written once, the cache rows written once.
        before = rows_expr * (qk * (2 * e + 16) + 2 * 2 * hkv * d * e)
        after = rows_expr * (qk * 2 * e + 2 * hkv * d * e)
        return MatchRecord(self.name, f"rope_kv({LAYOUTS[layout][0]}{', rounded products' if rnd else ''})",
                           "dsv41::rope_kv_store", SourceLocation.from_node(site.wk),
                           tuple(n.name for n in replaced), tuple(node_label(n) for n in replaced),
                           str(sympy.expand(before)), str(sympy.expand(after)), tuple(sorted(subs.items())),
                           (("layout", LAYOUTS[layout][0]), ("q", site.xq is not None), ("H", h), ("Hkv", hkv),
                            ("D", d)))


def _reaches(inputs, outputs, key) -> bool:
    """Whether any of `inputs` is computed from one of `outputs` (walking back from the inputs, never past the
    earliest output in graph order)."""
    targets = set(outputs)
    floor = min(key(o) for o in outputs)
    seen, stack = set(), list(inputs)
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n in seen or key(n) < floor:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _heads(shape):
    """`shape` as a tuple, with a trailing [..., D/2, 2] merged into [..., D]: in FP32 no cast separates
    `view_as_complex(x.reshape(..., D/2, 2))` from x, so the RoPE input found is that pair view (Meta's Llama)."""
    shape = tuple(shape) if shape is not None else None
    if shape is not None and len(shape) == 5 and shape[-1] == 2:
        return shape[:-2] + (2 * shape[-2],)
    return shape


def _orientations(shape, s: int, heads: int) -> list:
    """The permutations taking a 4-D RoPE input to [B, S, heads, D] that its shape allows: identity for
    [B, S, heads, D], (0, 2, 1, 3) for [B, heads, S, D] (both when S == heads)."""
    if shape is None or len(shape) != 4 or not _static(shape):
        return []
    out = []
    if shape[1] == s and shape[2] == heads:
        out.append((0, 1, 2, 3))
    if shape[1] == heads and shape[2] == s:
        out.append((0, 2, 1, 3))
    return out
