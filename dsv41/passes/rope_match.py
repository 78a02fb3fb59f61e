"""RoPE matching shared by `rope_fp4`, `c2_compressor` and `sparse_attention`: the RoPE-like region behind a
tensor, its trig operands, the layouts a region may implement, and the probe check that settles which one it is."""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ref.rope import apply_rope
from .engine import (RegionEvaluator, RegionNotClosed, close_scaled, concrete_shape, is_view_op, same_shape,
                     tensor_val, walk_inputs)

__all__ = ["Rope", "ROPE_OPS", "order_key", "is_rope_op", "rope_walk", "trig_operands", "rope_layouts", "broadcasts",
           "rope_structure", "match_rope"]

aten = torch.ops.aten
#: Ops a RoPE region may contain besides views.
ROPE_OPS = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.cat.default,
            aten.clone.default, aten._to_copy.default, torch.ops.prims.convert_element_type.default}
_ROPE_LIMIT = 300
#: Ops whose several outputs are views taken by `getitem` (`a, b = pairs.unbind(-1)`; `x.split(...)`).
_MULTI_VIEWS = {aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default}


@dataclass
class Rope:
    """A verified RoPE region: its input x, the trig tensors as the op reads them, the rotated width and its nodes."""

    x: fx.Node
    cos: fx.Node          # aligned (broadcastable to x's leading dims) real cos, or the complex freqs node
    sin: fx.Node | None   # None when `cos` is complex freqs_cis
    rope_dim: int
    region: list


_ORDERS: "weakref.WeakKeyDictionary[fx.Graph, tuple]" = weakref.WeakKeyDictionary()


def order_key(graph: fx.Graph):
    """Sort key: a node's index in the graph (the map is rebuilt when the graph changed size or a node
    inserted since is met)."""
    cached = _ORDERS.get(graph)
    if cached is None or cached[0] != len(graph.nodes):
        cached = (len(graph.nodes), {n: i for i, n in enumerate(graph.nodes)})
        _ORDERS[graph] = cached
    order = cached[1]

    def key(n):
        """Index of `n`, rebuilding the map for a node it has not seen."""
        if n not in order:
            _ORDERS.pop(graph, None)
            return order_key(graph)(n)
        return order[n]

    return key


def is_rope_op(n: fx.Node) -> bool:
    """A view or one of the arithmetic / copy ops a RoPE spelling uses (`ROPE_OPS`)."""
    return n.op == "call_function" and (is_view_op(n) or n.target in ROPE_OPS)


def rope_walk(y: fx.Node, sourced: set):
    """Walk back from y through RoPE-like ops. Returns (region, xs, leaves) or None if too large: `xs` are
    the reached tensors with y's shape and dtype, `leaves` every other tensor the region reads."""
    yv = tensor_val(y)
    yshape = concrete_shape(yv)
    xs: list = []
    leaves: list = []

    def step(n, region):
        """Sort the inputs of `n`: x candidates, RoPE ops (walked next) and other leaves."""
        nxt = []
        for a in n.all_input_nodes:
            if a in region or a in xs or a in leaves or a not in sourced:
                continue
            if a.op == "call_function" and a.target in _MULTI_VIEWS:  # its pieces are views: walk through
                nxt.append(a)
                continue
            av = tensor_val(a)
            if av is None:
                continue
            if concrete_shape(av) == yshape and av.dtype == yv.dtype:
                xs.append(a)
            elif is_rope_op(a) or (a.target is operator.getitem and a.args[0].target in _MULTI_VIEWS):
                nxt.append(a)
            else:
                leaves.append(a)
        return nxt

    region = walk_inputs(y, _ROPE_LIMIT, step)
    return None if region is None else (region, xs, leaves)


def trig_operands(order: list, x: fx.Node, leaves: list) -> dict:
    """For each trig leaf, the node the RoPE arithmetic reads it through: the last node computed from that
    leaf alone (e.g. `cos[:, :, None, :]`, or `cat((cos, cos), -1)` in the rotate-half spelling) that feeds
    a node depending on x. None for a leaf read in two different forms."""
    region = set(order)
    deps: dict = {x: frozenset({x})}
    deps.update({lf: frozenset({lf}) for lf in leaves})
    for n in order:
        deps[n] = frozenset().union(*(deps[a] for a in n.all_input_nodes if a in deps))
    out = {}
    for lf in leaves:
        ops = [n for n in [lf] + order if deps.get(n) == frozenset({lf})
               and any(u in region and x in deps.get(u, ()) for u in n.users)]
        same = len({(o.target, repr(o.args[1:]), concrete_shape(tensor_val(o))) for o in ops}) == 1
        out[lf] = ops[0] if ops and same else None
    return out


def rope_layouts(x, c, s):
    """Reference outputs of the RoPE variants a region may implement: ((check, reason or None), reference).

    `c`, `s` are the aligned trig tensors; their last dim is R/2 (one angle per pair) or, for the
    Hugging Face rotate-half spelling, R (angles duplicated over the two halves)."""
    d = x.shape[-1]
    w = c.shape[-1]

    def split(r, first):
        """(rotated part, rest) of x: the first or the last r channels."""
        return (x[..., :r], x[..., r:]) if first else (x[..., -r:], x[..., :-r])

    def join(rot, rest, first):
        """x again from its rotated part and the rest."""
        return torch.cat((rot, rest) if first else (rest, rot), -1)

    def interleaved(first: bool, sin):
        """Interleaved-pair RoPE of the first / last 2w channels by angle sin."""
        r = 2 * w
        pe, rest = split(r, first)
        pf = pe.float().unflatten(-1, (r // 2, 2))
        a, b = pf[..., 0], pf[..., 1]
        rot = torch.stack((a * c - b * sin, a * sin + b * c), dim=-1).flatten(-2).to(x.dtype)
        return join(rot, rest, first)

    def rotate_half(first: bool, full: bool):
        """Rotate-half RoPE of the first / last channels."""
        # full: the Hugging Face spelling pe * cos + rotate_half(pe) * sin with cos/sin of width R.
        r = w if full else 2 * w
        pe, rest = split(r, first)
        pf = pe.float()
        a, b = pf[..., : r // 2], pf[..., r // 2:]
        if full:
            rot = pf * c + torch.cat((-b, a), -1) * s
        else:
            rot = torch.cat((a * c - b * s, b * c + a * s), -1)
        return join(rot.to(x.dtype), rest, first)

    if 2 * w <= d:
        r = 2 * w
        yield ("ok", None), apply_rope(x, c, s)
        yield ("rope_channels", f"RoPE rotates the FIRST {r} of {d} channels; the rope_fp4 ops rotate the last R "
               "channels (MODEL.md §2.2)"), interleaved(True, s)
        yield ("rope_direction", "RoPE rotates by the negative angle (inverse rotation); the rope_fp4 ops rotate "
               "by +angle"), interleaved(False, -s)
    for full in (False, True):
        r = w if full else 2 * w
        if r > d or r % 2:
            continue
        yield ("rope_layout", f"rotate-half RoPE (channel i paired with i+{r // 2}) on the last {r} channels; the "
               "rope_fp4 ops rotate interleaved pairs (2i, 2i+1), and regrouping channels would change which values "
               "share an FP4 scale block"), rotate_half(False, full)
        yield ("rope_layout", f"rotate-half RoPE on the FIRST {r} of {d} channels; the rope_fp4 ops rotate "
               "interleaved pairs of the last R channels"), rotate_half(True, full)


def broadcasts(shape: tuple, target: tuple) -> bool:
    """Whether `shape` broadcasts to exactly `target`."""
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def rope_structure(y: fx.Node, sourced: set):
    """(region, x, trig leaves) when y is computed by RoPE-like ops from exactly one tensor x of y's shape
    and dtype plus either two float tensors of one shape (cos, sin) or one complex tensor (freqs_cis)."""
    walked = rope_walk(y, sourced)
    if walked is None:
        return None
    region, xs, leaves = walked
    if len(xs) != 1:
        return None
    vals = [tensor_val(lf) for lf in leaves]
    if len(leaves) == 1 and vals[0].is_complex():
        return region, xs[0], leaves
    if (len(leaves) == 2 and all(v.is_floating_point() for v in vals) and same_shape(vals[0].shape, vals[1].shape)
            and vals[0].dtype == vals[1].dtype):
        return region, xs[0], leaves
    return None


def match_rope(y: fx.Node, ev: RegionEvaluator, sourced: set):
    """(`Rope`, None) when y = interleaved RoPE of one tensor on its last R channels; else (None, why) with
    why = (check, reason) for a recognised look-alike, or None when y is not RoPE-like at all."""
    found_structure = rope_structure(y, sourced)
    if found_structure is None:
        return None, None
    region, x, leaves = found_structure
    xv = tensor_val(x)
    order = sorted(region, key=order_key(y.graph))
    operands = trig_operands(order, x, leaves)
    trig = [(lf, operands[lf]) for lf in leaves]
    if any(a is None for _, a in trig):
        return None, None
    cplx = len(trig) == 1
    gen = torch.Generator().manual_seed(3)
    dev = xv.device
    env = {x: torch.randn(concrete_shape(xv), generator=gen).to(xv.dtype).to(dev)}
    for lf, _ in trig:
        v = tensor_val(lf)
        ang = torch.rand(concrete_shape(v), generator=gen, dtype=torch.float64) * 6.283
        if v.is_complex():
            env[lf] = torch.polar(torch.ones_like(ang), ang).to(v.dtype).to(dev)
        else:
            env[lf] = (torch.rand(concrete_shape(v), generator=gen, dtype=torch.float64) * 2 - 1).to(v.dtype).to(dev)
    try:
        vals = ev.evaluate(order + [a for _, a in trig], env)
    except RegionNotClosed:
        return None, None
    got = vals[y]
    lead = tuple(concrete_shape(xv)[:-1])
    if cplx:
        f = vals[trig[0][1]]
        assignments = [(trig[0][1], None, f.real.float(), f.imag.float())]
    else:
        (_, a1), (_, a2) = trig
        assignments = [(a1, a2, vals[a1].float(), vals[a2].float()), (a2, a1, vals[a2].float(), vals[a1].float())]
    found = None
    d = int(concrete_shape(xv)[-1])
    for cnode, snode, c, s in assignments:
        if c.shape != s.shape or int(c.shape[-1]) > d:
            continue
        w = int(c.shape[-1])
        if not broadcasts(tuple(c.shape), lead + (w,)):
            continue
        for (check, reason), ref in rope_layouts(env[x], c, s):
            if close_scaled(got, ref):
                if reason is None:
                    dt = tensor_val(cnode).dtype
                    if dt not in (torch.float32, torch.complex64):
                        return None, ("rope_trig_dtype", f"cos/sin are {dt}; the rope_fp4 ops take float32 cos/sin "
                                      "(or complex64 freqs_cis)")
                    return Rope(x, cnode, snode, 2 * w, order), None
                found = found or (check, reason)
                break
    if found is not None:
        return None, found
    return None, ("rope_values", "the region reads x and two broadcast trigonometric tensors but matches no known "
                  "RoPE layout (interleaved / rotate-half, last / first R channels)")
