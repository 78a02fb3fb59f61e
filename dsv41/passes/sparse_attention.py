"""`sparse_attention` family: one attention site over [FP8 window ; selected FP4 bank rows] becomes one op.

Chain matched (ARCHITECTURE.md "Fusion patterns", row "sparse FP4 attention"; MODEL.md §2.4 steps 3-6; eager code
dsv41/model/attention.py `Attention.forward`):

    keys  = cat_i(dequantize_fp8_1x32(codes_i, scales_i))              # window ring + the step's new rows
    bank  = dequantize_fp4_e4m3_1x16(bank_codes[b, idx.clamp(0)], bank_scales[b, idx.clamp(0)])
    s     = [where(window_ok, q . keys, -inf) ; where(idx >= 0, q . bank, -inf)] * softmax_scale
    p     = softmax([s ; sink])[..., :-1]                                # the sink only enlarges the denominator
    o     = apply_rope((p_window @ keys + p_bank @ bank).to(q.dtype), cos, sin, inverse=True)
      -> o = dsv41::sparse_fp4_attention(q, cat(codes_i), cat(scales_i), window_ok, bank_codes, bank_scales, idx,
                                         sink, cos, sin, softmax_scale)

Structure (cheap, spelling-independent). The anchor is a pair of gathers `aten.index.Tensor(src, [b, rows])` of
two 3-D uint8 tensors sharing one index list: packed codes [B, N, D/2] and scales [B, N, D/g]. The dequantised
bank tensor is the first float node computed from both gathers, followed through views to [B, T, K, D]. The end
of the site is the first node after it of shape [B, T, H, D] that is an inverse-RoPE-like region (rope_fp4's
walker: one tensor of its own shape and dtype plus two trigonometric leaves). Walking back from that region's
input, every node that does not depend on the gathers is classified: a float [B, T, H, D] tensor is q (an exact
upcast of q is stripped), uint8 tensors are window codes (last dim D) or scales, the one bool tensor not derived
from the indices is the window mask, a float graph input with H elements is the sink; the index tensor is the
nearest int ancestor of the gathers' row index for which the whole region closes. Anything else the region reads
(a matmul output, another graph input) stops the match.

Semantics (how the constants and roles are settled). The region's own ATen nodes are evaluated on probe tensors
(realistic FP8 / FP4 codes from `formats`, random indices with -1 slots and repeats, random visibility, random
angles) and compared with `reference_sparse_fp4_attention` for every assignment the structure leaves open: the
order and pairing of the window parts, cos vs sin, the mask or its negation, and the softmax scale among D^-0.5
and the region's float literals (and their reciprocals). The bank dequantisation alone is first checked against
`formats.dequantize_fp4_e4m3_1x16` on every E4M3 scale byte. A look-alike is a `NearMiss` naming the check:
`bank_format` (another FP4 scale rule or block), `attention_sink` (plain softmax, no sink), `inverse_rope`
(rotation by +angle or another layout), `window_layout` (keys that are not whole FP8 tensors concatenated, e.g.
sliced rows of a later prefill chunk), `output_rope` (no inverse RoPE after the attention), `intermediate_used`
(a value inside the site is read elsewhere), `attention_values` (anything else).

Bytes per match (sympy in B, L): before = what the removed ATen ops read and write as separate eager kernels
(views free); after = the op's q, output, mask, indices, gathered bank rows, trig, and the window once per step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..model import formats
from . import rope_fp4 as rf
from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (FusionFamily, RegionEvaluator, RegionNotClosed, agree_where_representable, concrete_shape,
                     dsv41_op, eliminate_dead_code, insert_node, is_dataflow_op, is_table_lookup, is_view_op,
                     node_label, sourced_nodes, static_refusal, tensor_val, token_rows)

__all__ = ["SparseAttentionFamily", "OP_NAME"]

aten = torch.ops.aten
prims = torch.ops.prims
OP_NAME = "sparse_fp4_attention"
_MATMULS = {aten.bmm.default, aten.mm.default}
_FORWARD_LIMIT = 1500   # nodes walked forward from the bank gathers looking for the end of the site
_REGION_LIMIT = 1200    # nodes of one site's region (the model's decode site is ~170)
_SEL_STEPS = 8          # nodes between the index tensor and a validity mask derived from it
_FLOAT_LITERAL_MAX = 64  # softmax-scale candidates taken from the region's literals


@dataclass
class _Site:
    anchor: fx.Node
    end: fx.Node
    args: tuple         # (q, window parts, mask, inverted?, bank codes, bank scales, indices, sink, cos, sin, scale)
    region: list
    detail: tuple
    activations: tuple
    inputs_of: dict = dataclasses.field(default_factory=dict)  # region node -> its inputs, kept at rewrite time


class SparseAttentionFamily(FusionFamily):
    """Fuse gather(FP4 bank) -> dequantize -> attention over [FP8 window ; bank] with sink -> inverse RoPE into
    `dsv41::sparse_fp4_attention` (see module docstring)."""

    name = "sparse_attention"
    summary = ("gather FP4 bank rows (-1 = empty) -> dequantize -> scores with the FP8 window -> softmax with sink "
               "-> weighted sum of the same rows -> inverse RoPE")

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Replace every verified sparse-attention site of `gm` with `dsv41::sparse_fp4_attention`; returns the
        record (matches with heads / rows / scale in `detail`, near-misses naming the failed check)."""
        _register_ops()
        graph = gm.graph
        start = set(graph.nodes)
        op = dsv41_op(OP_NAME)
        ev = _Evaluator(gm)
        sourced = sourced_nodes(graph)
        sites, misses = [], []
        for gc, gs in list(_gather_pairs(graph)):
            found, near = _match(gm, ev, sourced, gc, gs)
            misses.extend(near)
            for site in found:  # sites sharing one gather (a Reuse layer and its source) are all rewritten
                refused = static_refusal(self.name, "sparse fp4 attention", [*site.args, site.end, *site.region],
                                         SourceLocation.from_node(site.anchor), f"dsv41::{OP_NAME}")
                if refused is not None:
                    misses.append(refused)
                    continue
                if op is None:
                    misses.append(NearMiss(self.name, "sparse fp4 attention", "op_registered",
                                           f"dsv41::{OP_NAME} is not registered (import dsv41.kernels."
                                           "sparse_attention)", SourceLocation.from_node(gc)))
                    continue
                _rewrite(graph, site, op)
                sites.append(site)
        eliminate_dead_code(graph)
        removed = start - set(graph.nodes)
        matches = []
        for s in sites:  # a removed node shared by several sites (CSE'd gathers) counts for the first one only
            matches.append(_record(self.name, s, removed))
            removed = removed - set(s.region)
        matches = tuple(matches)
        note = "" if op is not None else f"op not registered: {OP_NAME}"
        return PassRecord(self.name, True, matches, tuple(misses), (), note)


def _register_ops() -> None:
    """Import the kernel module that registers `dsv41::sparse_fp4_attention` (else matches become near-misses)."""
    try:
        import dsv41.kernels.sparse_attention  # noqa: F401
    except ImportError:
        pass


class _Evaluator(RegionEvaluator):
    """`RegionEvaluator` that also evaluates the attention's matmuls (deterministic functions of their inputs)."""

    def _compute(self, n: fx.Node, memo: dict):
        if n.op == "call_function" and n.target in _MATMULS:
            args = fx.node.map_aggregate(n.args, lambda a: memo[a] if isinstance(a, fx.Node) else a)
            return n.target(*args)
        return super()._compute(n, memo)


# ------------------------------------------------------------------------------------------------ structure
def _shape(n) -> tuple | None:
    v = tensor_val(n)
    return concrete_shape(v) if v is not None else None


def _dtype(n):
    v = tensor_val(n)
    return v.dtype if v is not None else None


def _walkable(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and is_dataflow_op(src)
    return is_dataflow_op(n) or is_table_lookup(n) or n.target in _MATMULS


def _gather_pairs(graph: fx.Graph):
    """(codes gather, scales gather) pairs: `index(src, [b, rows])` of 3-D uint8 sources [B, N, W] sharing the
    index nodes, outputs [B, T, K, W]; codes are the wider one, W_codes * 2 divisible by W_scales."""
    groups: dict = {}
    for n in graph.nodes:
        if n.op != "call_function" or n.target != aten.index.Tensor:
            continue
        src, idx = n.args[0], n.args[1]
        if _dtype(src) != torch.uint8 or len(_shape(src) or ()) != 3 or len(_shape(n) or ()) != 4:
            continue
        if len(idx) != 2 or any(not isinstance(i, fx.Node) for i in idx):
            continue
        groups.setdefault(tuple(idx), []).append(n)
    for gathers in groups.values():
        for a, b in itertools.permutations(gathers, 2):
            wc, ws = _shape(a)[-1], _shape(b)[-1]
            if wc > ws and (2 * wc) % ws == 0 and _shape(a)[:3] == _shape(b)[:3]:
                yield a, b


def _forward(starts, limit: int, stop_pos: int | None = None, pos: dict | None = None) -> list:
    """Nodes reachable from `starts` through walkable ops except 2-D `mm` (graph order is not guaranteed), at
    most `limit`. The attention's products are batched (`bmm`); stopping at `mm` (the output projection) keeps
    the walk inside the layer, so the next layer's q never counts as computed from this layer's bank."""
    seen, out, stack = set(starts), [], list(starts)
    while stack and len(out) < limit:
        n = stack.pop()
        for u in n.users:
            if u in seen or not _walkable(u) or u.target == aten.mm.default:
                continue
            if stop_pos is not None and pos[u] > stop_pos:
                continue
            seen.add(u)
            out.append(u)
            stack.append(u)
    return out


def _bank_tensor(gc, gs, pos):
    """The dequantised bank [B, T, K, D]: the first float node computed from both gathers, then through views."""
    from_c = set(_forward([gc], _FORWARD_LIMIT))
    from_s = set(_forward([gs], _FORWARD_LIMIT))
    b, t, k, wc = _shape(gc)
    want = (b, t, k, 2 * wc)
    both = sorted((n for n in from_c & from_s if _dtype(n) is not None and _dtype(n).is_floating_point),
                  key=pos.__getitem__)
    if not both:
        return None
    n = both[0]
    seen = 0
    while _shape(n) != want and seen < 6:
        views = [u for u in n.users if is_view_op(u)]
        if len(views) != 1:
            return None
        n, seen = views[0], seen + 1
    return n if _shape(n) == want else None


def _same_shape_base(n: fx.Node) -> fx.Node:
    """The tensor `n` is a same-shape view of (matmul broadcasting expands q to its own shape), else `n`."""
    while (is_view_op(n) and isinstance(n.args[0], fx.Node) and _dtype(n.args[0]) == _dtype(n)
           and _shape(n.args[0]) == _shape(n)):
        n = n.args[0]
    return n


def _sel_candidates(rows: fx.Node, sourced: set) -> list:
    """Int tensors of the row index's shape it is computed from (itself first), through pointwise / view ops
    with one non-constant int input (`where(idx < 0, 0, idx)`, `clamp(idx, min=0)`)."""
    shape = _shape(rows)
    out, n = [], rows
    for _ in range(_SEL_STEPS):
        if _dtype(n) not in (torch.int64, torch.int32) or _shape(n) != shape:
            break
        out.append(n)
        ins = [a for a in n.all_input_nodes if _dtype(a) in (torch.int64, torch.int32) and a in sourced]
        if n.op != "call_function" or len(ins) != 1 or not is_dataflow_op(n):
            break
        n = ins[0]
    return out


def _derived_from(n: fx.Node, target: fx.Node, steps: int) -> bool:
    """Whether `n` is computed from `target` within `steps` dataflow nodes."""
    frontier, seen = [n], set()
    for _ in range(steps):
        nxt = []
        for m in frontier:
            if m is target:
                return True
            if m in seen or m.op != "call_function":
                continue
            seen.add(m)
            nxt.extend(m.all_input_nodes)
        frontier = nxt
    return any(m is target for m in frontier)


@dataclass
class _Leaves:
    q: list
    codes: list
    scales: list
    masks: list
    params: list


def _discover(x: fx.Node, stops: set, dep: set, sel: fx.Node, sourced: set, d: int, bth: tuple):
    """Classify what the attention region (walked back from the pre-RoPE output `x`) reads; None if it reads
    something no role explains (a matmul output, a non-dataflow op, another graph input)."""
    leaves = _Leaves([], [], [], [], [])
    seen, stack = set(), [x]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > _REGION_LIMIT:
            return None
        for a in n.all_input_nodes:
            if a in seen or a in stops:
                continue
            v = tensor_val(a)
            if a.op == "get_attr" and a not in sourced:
                seen.add(a)  # a small lifted constant: the evaluator reads it from the module
                continue
            if v is None or a not in sourced or a in dep:
                if not (_walkable(a) or v is None):
                    return None
                stack.append(a)
                continue
            shp = concrete_shape(v)
            if v.dtype == torch.uint8:
                (leaves.codes if shp[-1] == d else leaves.scales).append(a)
            elif v.dtype == torch.bool and not _derived_from(a, sel, _SEL_STEPS):
                leaves.masks.append(_same_shape_base(a))
            elif v.is_floating_point() and len(shp) == 4 and shp[:3] == bth and shp[3] == d:
                leaves.q.append(_same_shape_base(a))
            elif a.op in ("placeholder", "get_attr") and v.is_floating_point():
                leaves.params.append(a)
            elif _walkable(a):
                stack.append(a)
                continue
            else:
                return None
            seen.add(a)  # a leaf: never walked through
    for lst in (leaves.q, leaves.codes, leaves.scales, leaves.masks, leaves.params):
        lst[:] = list(dict.fromkeys(lst))
    return leaves


# ------------------------------------------------------------------------------------------------ probes
def _probe_window(shape, gen, device):
    """(codes, scales) of realistic window rows [.., R, D]: FP8 1x32 quantisation of N(0, 2) values."""
    codes, scales = formats.quantize_fp8_1x32(torch.randn(shape, generator=gen, dtype=torch.float64).float() * 2)
    return codes.to(device), scales.to(device)


def _probe_bank(codes_shape, scales_shape, gen, device):
    codes = torch.randint(0, 256, codes_shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    scale_vals = torch.rand(scales_shape, generator=gen, dtype=torch.float64).float() * 0.45 + 0.05
    return codes.to(device), formats.e4m3_to_bytes(scale_vals).to(device)


def _to_bts(val: torch.Tensor, b: int, t: int, last: int):
    """A mask / trig value as the op's [B, T, last] (a broadcast head axis of size 1 dropped), or None."""
    if val.dim() == 4:
        if val.shape[2] != 1:
            return None
        val = val[:, :, 0]
    try:
        return val.expand(b, t, last)
    except RuntimeError:
        return None


@dataclass
class _Assignment:
    order: tuple        # ((codes leaf, scales leaf), ...) window parts in concatenation order
    cos: fx.Node
    sin: fx.Node
    invert_mask: bool
    scale: float


def _candidate_scales(region_nodes, d: int) -> list:
    vals = [d ** -0.5]

    def visit(a):
        """Remember finite float literals and their reciprocals (softmax-scale candidates)."""
        if isinstance(a, float) and math.isfinite(a) and a not in (0.0, 1.0, -1.0) and len(vals) < _FLOAT_LITERAL_MAX:
            for c in (a, 1.0 / a):
                if c > 0 and c not in vals:
                    vals.append(c)
        return a

    for n in region_nodes:
        fx.node.map_aggregate(n.args, visit)
    return vals


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    g, r = got.double().cpu(), ref.double().cpu()
    if not bool(torch.isfinite(g).all()) or not bool(torch.isfinite(r).all()):
        return False
    rtol = max(2 * torch.finfo(ref.dtype).eps, 2e-5)
    return bool(((g - r).abs() <= rtol * (r.abs() + r.abs().max() * 0.05)).all())


# ------------------------------------------------------------------------------------------------ match
def _match(gm, ev, sourced, gc: fx.Node, gs: fx.Node):
    """([`_Site`, ...], [NearMiss, ...]) for the attention sites reading the gathered bank rows (gc, gs): one per
    inverse-RoPE end after them (several when CSE merged the gathers of layers reading the same bank and
    indices), each verified on its own; a look-alike is a near-miss."""
    from ..kernels.sparse_attention import reference_sparse_fp4_attention as ref_op

    graph = gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    loc = SourceLocation.from_node(gc)
    pattern = "gather fp4 bank -> attention with sink -> inverse rope"
    bank = _bank_tensor(gc, gs, pos)
    if bank is None:
        return [], []
    refused = static_refusal("sparse_attention", pattern, [gc, gs, bank], loc, f"dsv41::{OP_NAME}")
    if refused is not None:  # before the value checks, which see the compiled sizes only
        return [], [refused]
    bsrc_c, bsrc_s = gc.args[0], gs.args[0]
    b, t, k, wc = _shape(gc)
    d = 2 * wc
    ok, why = _check_bank_format(ev, gc, gs, bank)
    if not ok:
        return [], [NearMiss("sparse_attention", pattern, "bank_format", why, loc)]
    fwd = _forward([bank], _FORWARD_LIMIT)
    fwd_set = set(fwd) | {bank}
    ends = sorted((n for n in fwd if len(_shape(n) or ()) == 4 and _shape(n)[:2] == (b, t) and _shape(n)[3] == d
                   and _dtype(n).is_floating_point), key=pos.__getitem__)
    found_ends = []
    for e in ends:
        found = rf._rope_structure(e, sourced)
        if found is not None and found[1] in fwd_set and len(found[2]) == 2:
            found_ends.append((e, found))
    if not found_ends:
        return [], [NearMiss("sparse_attention", pattern, "output_rope",
                             "no inverse RoPE of the attention output follows the site; dsv41::sparse_fp4_attention "
                             "de-rotates its output (MODEL.md §2.4 step 6). " + _why_no_end(fwd, fwd_set, ends, sourced),
                             loc)]
    rows = gc.args[1][1]
    sites, misses = [], []
    for end, (_, x, trig) in found_ends:
        h = _shape(end)[2]
        dep = set(_forward([gc, gs], _FORWARD_LIMIT, pos[end], pos)) | {gc, gs}
        reasons = []
        for sel in _sel_candidates(rows, sourced):
            stops = {bsrc_c, bsrc_s, sel, *trig}
            leaves = _discover(x, stops, dep, sel, sourced, d, (b, t, h))
            if leaves is None:
                continue
            res = _verify(ev, gm, end, gc, gs, sel, leaves, trig, (b, t, h, d, k), ref_op, sourced)
            if isinstance(res, _Site):
                sites.append(res)
                reasons = []
                break
            if res is not None:
                reasons.append(res)
        if reasons:
            check, reason = min(reasons, key=lambda r: _PRIORITY.index(r[0]))
            misses.append(NearMiss("sparse_attention", pattern, check, reason, SourceLocation.from_node(end) or loc))
    return sites, misses


def _why_no_end(fwd: list, fwd_set: set, ends: list, sourced: set) -> str:
    """What the search for the site's end saw, for the near-miss text: how far the forward walk got, the ops that
    stopped it, and why each [B, T, H, D] candidate is not an inverse RoPE of a tensor computed from the bank (so a
    graph spelled differently, e.g. by another device's rewrites, can be diagnosed from the report alone)."""
    blocked: dict = {}
    for n in fwd:
        for u in n.users:
            if u not in fwd_set and u.op == "call_function":
                name = str(getattr(u.target, "__name__", u.target))
                blocked[name] = blocked.get(name, 0) + 1
    parts = [f"walked {len(fwd)} nodes (limit {_FORWARD_LIMIT})",
             "stopped at " + (", ".join(f"{k} x{v}" for k, v in sorted(blocked.items(), key=lambda kv: -kv[1])[:6])
                              or "nothing")]
    for e in ends[-3:]:
        found = rf._rope_structure(e, sourced)
        if found is None:
            why = "not RoPE-like"
        elif found[1] not in fwd_set:
            why = f"rotates {found[1].name}, not computed from the bank"
        else:
            why = f"{len(found[2])} trig inputs"
        parts.append(f"{e.name} {tuple(_shape(e))}: {why}")
    if not ends:
        parts.append("no [B, T, H, D] float tensor computed from the bank")
    return "; ".join(parts)


_PRIORITY = ("attention_sink", "inverse_rope", "intermediate_used", "window_layout", "attention_values")


def _check_bank_format(ev, gc, gs, bank):
    """The bank dequantisation must be `formats.dequantize_fp4_e4m3_1x16` of the gathered bytes (every E4M3
    scale bytes spread over 0..254 minus the NaN encodings 0x7F, 0xFF); (ok, reason)."""
    gen = torch.Generator().manual_seed(5)
    cv, sv = tensor_val(gc), tensor_val(gs)
    codes = torch.randint(0, 256, concrete_shape(cv), generator=gen, dtype=torch.int32).to(torch.uint8)
    n = sv.numel()
    allowed = torch.tensor([i for i in range(256) if i not in (0x7F, 0xFF)], dtype=torch.uint8)
    scales = allowed[(torch.arange(n) * 7 + 3) % allowed.numel()].reshape(concrete_shape(sv))
    env = {gc: codes.to(cv.device), gs: scales.to(sv.device)}
    try:
        got = ev.evaluate([bank], env)[bank]
    except (RegionNotClosed, RuntimeError):
        return False, "the bank rows are gathered but not dequantised by dataflow ops alone"
    want_d = concrete_shape(cv)[-1] * 2
    if concrete_shape(sv)[-1] * 16 == want_d:
        ref = formats.dequantize_fp4_e4m3_1x16(codes, scales, got.dtype)
        if agree_where_representable(got.cpu(), ref):
            return True, ""
    blk = want_d // concrete_shape(sv)[-1]
    if blk == 32:
        alt = formats.dequantize_fp4_ue8m0_1x32(codes, scales, got.dtype)
        if agree_where_representable(got.cpu(), alt):
            return False, ("the bank rows are FP4 E2M1 with UE8M0 scales per 32 channels (the index-key format); "
                           "dsv41::sparse_fp4_attention reads FP4 E2M1 with one E4M3 scale per 16 channels "
                           "(MODEL.md §2.8 'V41_FP4')")
    return False, (f"the gathered bank bytes are not dequantised as FP4 E2M1 with one E4M3 scale per 16 channels "
                   f"(codes [.., {concrete_shape(cv)[-1]}], scales [.., {concrete_shape(sv)[-1]}]); MODEL.md §2.8")


def _verify(ev, gm, end, gc, gs, sel, lv: _Leaves, trig, dims, ref_op, sourced):
    """A `_Site` when the region computes the op for one assignment; else (check, reason) or None."""
    b, t, h, d, k = dims
    if len(lv.q) != 1 or len(lv.masks) > 1 or not lv.codes or len(lv.codes) != len(lv.scales):
        return None
    sinks = [p for p in lv.params if tensor_val(p).numel() == h]
    if len(sinks) > 1 or len(lv.params) > len(sinks):
        return None
    q = lv.q[0]
    if prims.convert_element_type.default == q.target and _shape(q.args[0]) == _shape(q) \
            and _dtype(q.args[0]) in (torch.bfloat16, torch.float16) and _dtype(q.args[0]) == _dtype(end):
        q_op = q.args[0]
    else:
        q_op = q
    if _dtype(q_op) != _dtype(end):
        return None
    for c in lv.codes:
        if len(_shape(c)) != 3 or _shape(c)[0] != b:
            return "window_layout", "the window codes are not [B, rows, D] uint8 tensors"
    for s in lv.scales:
        if len(_shape(s)) != 3 or _shape(s)[0] != b or _shape(s)[2] * 32 != d:
            return "window_layout", ("the window scales are not [B, rows, D/32] uint8 (FP8 with UE8M0 per 32 "
                                     "channels, MODEL.md §2.8)")
    device = tensor_val(q).device
    gen = torch.Generator().manual_seed(11)
    env = {}
    qv = tensor_val(q)
    # q's probe lies on q_op's grid, so that the stripped upcast is exact on it.
    qp = torch.randn(concrete_shape(qv), generator=gen, dtype=torch.float64).to(_dtype(q_op)).to(device)
    env[q] = qp.to(qv.dtype)
    for c in lv.codes:
        env[c] = _probe_window(_shape(c), gen, device)[0]
    for s in lv.scales:  # scales get their own values; the pairing decides which codes they belong to
        env[s] = _probe_window((*_shape(s)[:2], d), gen, device)[1]
    bank_c, bank_s = _probe_bank(concrete_shape(tensor_val(gc.args[0])), concrete_shape(tensor_val(gs.args[0])),
                                 gen, device)
    env[gc.args[0]], env[gs.args[0]] = bank_c, bank_s
    n_rows = concrete_shape(tensor_val(gc.args[0]))[1]
    selv = tensor_val(sel)
    sel_p = torch.randint(-1, n_rows, concrete_shape(selv), generator=gen, dtype=torch.int64)
    env[sel] = sel_p.to(selv.dtype).to(device)
    sink = sinks[0] if sinks else None
    if sink is not None:
        env[sink] = torch.randn(concrete_shape(tensor_val(sink)), generator=gen, dtype=torch.float64) \
            .to(_dtype(sink)).to(device)
    mask = lv.masks[0] if lv.masks else None
    if mask is not None:
        env[mask] = (torch.rand(concrete_shape(tensor_val(mask)), generator=gen) < 0.7).to(device)
    for tr in trig:
        env[tr] = (torch.rand(concrete_shape(tensor_val(tr)), generator=gen, dtype=torch.float64) * 2 - 1) \
            .to(_dtype(tr)).to(device)
    try:
        memo = ev.evaluate([end], env)
    except (RegionNotClosed, RuntimeError):
        return None
    got = memo[end]
    region = [n for n in memo if n not in env]
    # Pairings of window codes with scales of the same rows, and their orders.
    pairings = []
    for perm in itertools.permutations(lv.scales):
        pairs = tuple(zip(lv.codes, perm))
        if all(_shape(c)[:2] == _shape(s)[:2] for c, s in pairs):
            pairings.extend(itertools.permutations(pairs))
    if not pairings:
        return "window_layout", "the window codes and scales do not pair up row for row"
    s_rows = sum(_shape(c)[1] for c in lv.codes)
    scales = _candidate_scales(region, d)
    sink_val = env[sink].float().cpu() if sink is not None else torch.full((h,), float("-inf"))
    mask_p = env[mask].cpu() if mask is not None else torch.ones(b, t, s_rows, dtype=torch.bool)
    wmask = _to_bts(mask_p, b, t, s_rows)
    if wmask is None:
        return "window_layout", f"the window mask {tuple(mask_p.shape)} is not a [B, T, S] visibility mask"
    tvals = {tr: _to_bts(env[tr].float().cpu(), b, t, _shape(tr)[-1]) for tr in trig}
    if any(v is None for v in tvals.values()):
        return None

    def reference(order, cs, sn, inv, sc, sink_v, inverse=True):
        """The op's CPU reference on the probe values for one window order / mask / RoPE / scale hypothesis."""
        wc_ = torch.cat([env[c] for c, _ in order], 1).cpu()
        ws_ = torch.cat([env[s] for _, s in order], 1).cpu()
        m = ~wmask if inv else wmask
        sn_ = tvals[sn] if inverse else -tvals[sn]
        return ref_op(qp.cpu(), wc_, ws_, m.contiguous(), bank_c.cpu(), bank_s.cpu(), env[sel].cpu(), sink_v,
                      tvals[cs].contiguous(), sn_.contiguous(), sc)

    # Codes and scales got independent probes: whichever scales a part is paired with, the reference reads the
    # same values the region did.
    trig_orders = [(trig[0], trig[1]), (trig[1], trig[0])]
    mask_options = (False, True) if mask is not None else (False,)
    if wmask.shape[-1] != s_rows:
        return "window_layout", ("the keys are not whole FP8 tensors concatenated (e.g. sliced rows of a prefill "
                                 "chunk after the first); left to Inductor")
    for order in pairings:
        for cs, sn in trig_orders:
            for inv in mask_options:
                for sc in scales:
                    try:
                        ref = reference(order, cs, sn, inv, sc, sink_val)
                    except (RuntimeError, IndexError, ValueError):
                        continue
                    if _close(got.cpu(), ref):
                        return _site(end, gc, gs, sel, q_op, q, order, mask, inv, sink, cs, sn, sc, region,
                                     (b, t, h, d, k, s_rows))
    # Look-alikes: the most telling alternative that fits.
    for order in pairings[:2]:
        for cs, sn in trig_orders:
            for inv in mask_options:
                for sc in scales[:8]:
                    try:
                        if _close(got.cpu(), reference(order, cs, sn, inv, sc, torch.full((h,), float("-inf")))):
                            return "attention_sink", (
                                "the region reads a per-head sink but its softmax equals a plain softmax over the "
                                "rows (e.g. the sink shifts every score, which softmax ignores); dsv41::sparse_fp4_"
                                "attention adds exp(sink_h - M) to the denominator only (MODEL.md §2.4 step 5)")
                        if _close(got.cpu(), reference(order, cs, sn, inv, sc, sink_val, inverse=False)):
                            return "inverse_rope", (
                                "the attention output is rotated by +angle; the op de-rotates (angle -p) the last "
                                "R channels (MODEL.md §2.4 step 6)")
                    except (RuntimeError, IndexError, ValueError):
                        continue
    return "attention_values", ("the region reads q, FP8 window rows, a visibility mask, gathered FP4 bank rows, "
                                "indices and a sink but does not compute sparse attention with sink and inverse RoPE "
                                "(MODEL.md §2.4 steps 3-6)")


def _site(end, gc, gs, sel, q_op, q_leaf, order, mask, inv, sink, cs, sn, sc, region, dims):
    b, t, h, d, k, s_rows = dims
    inside = set(region)
    # Values computed from q (scores, probabilities, partial outputs) must not be read outside the site: fusing
    # would compute the attention twice. The bank / window dequantisation and the index math may be shared (CSE
    # merges them between layers reading the same bank and indices); they stay alive while anything reads them.
    from_q = {q_op, q_leaf}
    for n in region:  # evaluation order: inputs first
        if any(a in from_q for a in n.all_input_nodes):
            from_q.add(n)
    for n in region:
        if n is end or n not in from_q:
            continue
        if n.op == "call_function" and any(u not in inside for u in n.users):
            return "intermediate_used", (f"{n.name} ({node_label(n)}) inside the attention site is also read "
                                         "elsewhere; fusing would compute it twice")
    detail = (("heads", h), ("head_dim", d), ("window_rows", s_rows), ("topk", k), ("window_parts", len(order)),
              ("rope_dim", 2 * _shape(cs)[-1]), ("softmax_scale", sc), ("sink", sink is not None),
              ("mask", "inverted" if inv else "as is"), ("module", _module_path(gc)))
    return _Site(gc, end, (q_op, order, mask, inv, gc.args[0], gs.args[0], sel, sink, cs, sn, sc), region, detail,
                 (q_op, sel))


def _module_path(n: fx.Node) -> str:
    """The innermost module path of the node (report only; matching never reads names)."""
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    last = list(stack.values())[-1]
    return str(last[0]) if isinstance(last, tuple) else str(last)


# ------------------------------------------------------------------------------------------------ rewrite
def _rewrite(graph: fx.Graph, site: _Site, op) -> None:
    q, order, mask, inv, bc, bs, sel, sink, cs, sn, sc = site.args
    end = site.end
    b, t, h, d = _shape(end)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    site.region.sort(key=pos.__getitem__)
    site.inputs_of = {n: list(n.all_input_nodes) for n in site.region}
    like = site.anchor  # provenance: the bank gather's line in the user's code

    def ins(target, args):
        """Insert `target(*args)` before the site's end node."""
        return insert_node(graph, end, target, args, like=like)

    codes = [c for c, _ in order]
    scales = [s for _, s in order]
    wc = codes[0] if len(codes) == 1 else ins(aten.cat.default, (codes, 1))
    ws = scales[0] if len(scales) == 1 else ins(aten.cat.default, (scales, 1))
    s_rows = _shape(wc)[1]

    def bts(node, last):
        """`node` viewed as [b, t, last] (select the head dim, then expand) for the op's arguments."""
        n = node
        if len(_shape(n)) == 4:
            n = ins(aten.select.int, (n, 2, 0))
        if _shape(n) != (b, t, last):
            n = ins(aten.expand.default, (n, [b, t, last]))
        return n

    if mask is None:
        ok = insert_node(graph, end, aten.ones.default, ([b, t, s_rows],), {"dtype": torch.bool,
                                                                              "device": tensor_val(q).device},
                         like=like)
    else:
        ok = bts(mask, s_rows)
        if inv:
            ok = ins(aten.logical_not.default, (ok,))
    if sink is None:
        sk = insert_node(graph, end, aten.full.default, ([h], float("-inf")),
                         {"dtype": torch.float32, "device": tensor_val(q).device}, like=like)
    else:
        sk = sink if _dtype(sink) == torch.float32 else ins(prims.convert_element_type.default, (sink, torch.float32))
        if _shape(sk) != (h,):
            sk = ins(aten.reshape.default, (sk, [h]))
    half = _shape(cs)[-1]
    cos_in, sin_in = bts(cs, half), bts(sn, half)
    idx = sel
    out = ins(op, (q, wc, ws, ok, bc, bs, idx, sk, cos_in, sin_in, float(sc)))
    end.replace_all_uses_with(out)


# ------------------------------------------------------------------------------------------------ record
def _record(family: str, site: _Site, removed: set) -> MatchRecord:
    gone = [n for n in site.region if n in removed]
    before, after, subs = _bytes(site, gone)
    return MatchRecord(family, OP_NAME, f"dsv41::{OP_NAME}", SourceLocation.from_node(site.anchor),
                       tuple(n.name for n in gone), tuple(node_label(n) for n in gone), before, after,
                       tuple(sorted(subs.items())), site.detail)


def _bytes(site: _Site, gone: list):
    """(before, after, symbol values): eager traffic of the removed ops vs the fused op's reads and writes."""
    b, t, h, d = _shape(site.end)
    rows, subs = token_rows((b, t))
    q, sel = site.activations
    per_token = {q, sel}
    for n in site.region:  # graph order
        if any(a in per_token for a in site.inputs_of.get(n, ())):
            per_token.add(n)
    totals = {"before": [0, 0], "after": [0, 0]}  # [bytes per token, bytes per step]

    def nbytes(n):
        """Bytes of a node's value (0 without one)."""
        v = tensor_val(n)
        return 0 if v is None else v.numel() * v.element_size()

    def add(key, n, per=None):
        """Add node `n`'s bytes to `totals[key]`: per token when `per` (default: in `per_token`), else fixed."""
        nb = nbytes(n)
        tok = (n in per_token) if per is None else per
        if tok and nb % (b * t) == 0:
            totals[key][0] += nb // (b * t)
        else:
            totals[key][1] += nb

    for n in gone:
        if is_view_op(n) or tensor_val(n) is None:
            continue
        add("before", n)
        for a in site.inputs_of.get(n, ()):
            if not is_view_op(a):
                add("before", a)
    k = _shape(sel)[-1]
    _, order, mask, *_rest = site.args
    cs = site.args[8]
    qb = nbytes(q) // (b * t)
    win = sum(nbytes(c) + nbytes(s) for c, s in order)
    s_rows = sum(_shape(c)[1] for c, _ in order)
    per_tok_after = 2 * qb + s_rows + k * (tensor_val(sel).element_size() + d // 2 + d // 16) + 8 * _shape(cs)[-1]
    totals["after"] = [per_tok_after, win + 4 * h]
    before, after = (sympy.Integer(totals[key][0]) * rows + totals[key][1] for key in ("before", "after"))
    return str(sympy.expand(before)), str(sympy.expand(after)), subs
