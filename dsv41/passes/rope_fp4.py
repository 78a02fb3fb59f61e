"""`rope_fp4` family: RoPE followed by FP4 quantisation becomes one op (one pass over the latent).

Chains matched (`SPEC` below, `dsv41 report --patterns rope_fp4`; MODEL.md §2.1, §2.2, §2.8):

    quantize_fp4_e4m3_1x16(apply_rope(x, cos, sin))      -> dsv41::rope_fp4_quant(x, cos, sin, 16, True)
    quantize_fp4_ue8m0_1x32(apply_rope(x, cos, sin))     -> dsv41::rope_fp4_quant(x, cos, sin, 32, False)
    fake_quant_fp4_*(apply_rope(x, cos, sin))            -> dsv41::rope_fp4_fake_quant(x, cos, sin, blk, e4m3)
    ... whose codes and scales are then written at `rows` of two caches (index_put / index_copy_)
                                                         -> dsv41::rope_fp4_quant_store(..., codes!, scale!, rows)

RoPE here means interleaved pairs (2i, 2i+1) rotated on the LAST R channels of x (dsv41/model/rope.py);
spelled with stack/flatten (dsv41 style) or `torch.view_as_complex(x) * freqs_cis` (the same pairs), with
cos/sin either expanded or broadcast (`cos[:, :, None, :]`) — the replacement expands them to x's leading
dims, as the ops expect. Rotate-half RoPE (channel i paired with i + R/2), RoPE on the first R channels and
the inverse rotation are recognised and reported as near-misses: the ops rotate interleaved pairs of the
last R channels, and regrouping channels would change which ones share an FP4 scale block.

Structure: every block quantiser takes an `amax` over the last dim of a [..., D/16, 16] or [..., D/32, 32]
view of the tensor it quantises; that `amax` is the anchor. The quantised tensor y is found by walking back
from it; the quantiser's outputs are found among the nodes computed from y alone, and the RoPE region by
walking back from y to the single tensor x of y's shape and dtype plus the trigonometric leaves. Semantics:
both regions are evaluated on probe tensors and compared with `formats.quantize_fp4_*` / `rope.apply_rope`.

Cache writes: after functionalisation an in-place write `cache.index_copy_(0, rows, codes)` or
`cache[rows] = codes` is `index_put(cache_version, [rows], codes)`. When the packed codes and the scales
each feed only such a write (same `rows`, dim 0, no accumulate), both writes become one
`auto_functionalized(rope_fp4_quant_store)` whose outputs are the new cache versions, so the write stays
correct under functionalisation and Inductor's reinplacing turns it back into an in-place kernel. Any other
write is left to Inductor, and the match record says why (`detail["cache_write"]`).
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..ref import formats
from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (Chain, FusionFamily, GraphScan, RegionEvaluator, RegionNotClosed, Role, concrete_shape, dsv41_op,
                     eliminate_dead_code, insert_node, is_dataflow_op, is_reshape, is_view_op, keep_removed, node_label,
                     register_family, same_shape, size_args, static_refusal, tensor_val, token_rows)
from .rope_match import Rope, match_rope, order_key, rope_structure

__all__ = ["RopeFp4Family", "QUANT_RULES", "SPEC", "Quant", "is_block_amax", "quantised_tensor_candidates",
           "match_quant", "cache_write"]

aten = torch.ops.aten
prims = torch.ops.prims
#: rule name -> (scale block, E4M3 scales?, quantise fn, fake-quant fn) of formats.py.
QUANT_RULES = {
    "e4m3_1x16": (16, True, formats.quantize_fp4_e4m3_1x16, formats.fake_quant_fp4_e4m3_1x16),
    "ue8m0_1x32": (32, False, formats.quantize_fp4_ue8m0_1x32, formats.fake_quant_fp4_ue8m0_1x32),
}
#: What each RoPE -> FP4 chain looks for (`dsv41 report --patterns`).
SPEC = register_family(
    "rope_fp4", "interleaved RoPE on the last R channels -> FP4 E2M1 quant (E4M3 1x16 / UE8M0 1x32) "
    "[-> cache write]", tuple(
    Chain(name, name, "amax over a last dim of 16 / 32 (a block quantiser) of a tensor y computed by RoPE-like ops "
          "from one x and a cos / sin pair (or complex freqs)",
          (Role("x", "[.., D]"), Role("cos / sin", "[.., R/2]", "fp32 (or complex64 freqs)")) + extra,
          "dsv41.ref.rope:apply_rope + dsv41.ref.formats:quantize_fp4_*", ("rule (e4m3_1x16 / ue8m0_1x32)",
                                                                              "rope_dim", "layout"),
          ("random x and angles; quantiser probes of every block edge case",),
          ("static_shapes", "fp4_quantiser", "rope_channels", "rope_direction", "rope_layout", "rope_trig_dtype",
           "rope_values", "op_registered") + checks)
    for name, extra, checks in (
        ("rope_fp4_quant", (), ("output_dtype", "dynamic_reshape")),
        ("rope_fp4_fake_quant", (), ("output_dtype", "dynamic_reshape")),
        ("rope_fp4_quant_store", (Role("codes_cache / scale_cache", "[B, Rows, bytes]", "uint8"),
                                  Role("rows", "[B, T]", "int64")), ()))))
_WRITE_OPS = {aten.index_put.default, aten.index_put_.default, aten.index_copy.default, aten.index_copy_.default,
              aten.scatter.src, aten.scatter_.src, aten.copy_.default}
_UNARY_TO_Y = {aten.abs.default, aten.clone.default, torch.ops.prims.convert_element_type.default}
_CLOSURE_LIMIT = 800
@dataclass
class Quant:
    """A verified FP4 quantiser: its rule, its outputs (packed codes, scales, or the fake-quantised values) and
    the nodes computed from y alone."""

    rule: str
    packed: fx.Node | None
    scale: fx.Node | None
    fake: fx.Node | None
    closure: list
    #: The fake-quantised values are held in float32 while y is bfloat16: Inductor before torch 2.13 drops the
    #: round trip `fake(y).to(bf16).float()` to `fake(y)` computed in float32 (`pointless_convert`). Every FP4 value
    #: times its scale is a bfloat16 (E2M1 has 2 significant bits, the scales at most 4, and the amax floor keeps
    #: them >= 2^-126), so the op's bfloat16 output upcast is the same float32 tensor.
    fake_widened: bool = False
    #: Other nodes holding the same fake-quantised values in another shape (views of `fake`).
    fake_aliases: tuple = ()


class RopeFp4Family(FusionFamily):
    """Fuse RoPE -> FP4 quantisation (-> cache write) into the `dsv41::rope_fp4_*` ops (see module docstring)."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Replace every verified RoPE -> FP4 quantisation chain (and its cache write) with the fused op."""
        scan = GraphScan(gm)
        graph, ev, sourced = scan.graph, scan.ev, scan.sourced
        matches: list[MatchRecord] = []
        misses: list[NearMiss] = []
        done: set = set()
        for amax in [n for n in graph.nodes if is_block_amax(n)]:
            if amax in done:
                continue
            ys = quantised_tensor_candidates(amax)
            # Structure first (cheap): only a tensor computed from one x and a cos/sin pair is worth probing.
            if not ys or rope_structure(ys[0], sourced) is None:
                continue
            refused = static_refusal(self.name, "rope -> fp4 quant", [amax, *ys], SourceLocation.from_node(ys[0]),
                                     "dsv41::rope_fp4_*")
            if refused is not None:  # before the value checks, which see the compiled sizes only
                misses.append(refused)
                continue
            quant, y = None, ys[0]
            for cand in ys:
                quant = match_quant(cand, amax, ev, sourced)
                if quant is not None:
                    y = cand
                    break
            rope, why = match_rope(y, ev, sourced)
            loc = SourceLocation.from_node(y)
            if quant is None:
                if rope is not None:
                    misses.append(NearMiss(self.name, "rope -> quantise", "fp4_quantiser",
                                           _describe_other_quantiser(y, ev, sourced), loc))
                continue
            done.update(quant.closure)
            pattern = f"rope -> fp4 quant ({quant.rule})"
            if rope is None:
                if why is not None:
                    misses.append(NearMiss(self.name, pattern, why[0], why[1], loc))
                continue
            refused = static_refusal(self.name, pattern, [rope.x, rope.cos, rope.sin, *rope.region, *quant.closure],
                                     loc, "dsv41::rope_fp4_*")
            if refused is not None:
                misses.append(refused)
                continue
            rec, miss = self._fuse(gm, y, rope, quant, ev, sourced)
            if rec is not None:
                matches.append(rec)
            if miss is not None:
                misses.append(miss)
        from torch._inductor.pattern_matcher import stable_topological_sort
        stable_topological_sort(graph)
        eliminate_dead_code(graph)
        removed = scan.removed_names()
        matches = [keep_removed(m, removed) for m in matches]
        missing = [op for op in ("rope_fp4_quant", "rope_fp4_fake_quant", "rope_fp4_quant_store")
                   if dsv41_op(op) is None]
        note = f"ops not registered: {', '.join(missing)}" if missing else ""
        return PassRecord(self.name, True, tuple(matches), tuple(misses), (), note)

    # -------------------------------------------------------------------------------------------- rewrite
    def _fuse(self, gm, y, rope: Rope, quant: Quant, ev: RegionEvaluator, sourced: set):
        graph = gm.graph
        blk, e4m3, _, _ = QUANT_RULES[quant.rule]
        loc = SourceLocation.from_node(y)
        pattern = f"rope -> fp4 quant ({quant.rule})"
        outputs = [n for n in (quant.packed, quant.scale, quant.fake) if n is not None]
        first = min(outputs, key=order_key(graph))
        use_fake = quant.fake is not None and not _used_outside(quant.packed, quant.closure) \
            and not _used_outside(quant.scale, quant.closure)
        store, store_why = (None, "")
        if not use_fake:
            store, store_why = cache_write(quant, ev, sourced)
        op_name = "rope_fp4_fake_quant" if use_fake else ("rope_fp4_quant_store" if store else "rope_fp4_quant")
        op = dsv41_op(op_name)
        if op is None:
            return None, NearMiss(self.name, pattern, "op_registered",
                                  f"dsv41::{op_name} is not registered (import dsv41.kernels)", loc)
        if not store:
            problem = _output_mismatch(rope.x, quant, blk, use_fake)
            if problem is not None:
                return None, NearMiss(self.name, pattern, *problem, loc)
        xv = tensor_val(rope.x)
        nd = xv.dim()
        half = rope.rope_dim // 2
        anchor = store[0] if store else first
        cos, sin = rope.cos, rope.sin
        if sin is None:  # complex freqs_cis: cos = real part, sin = imaginary part
            real = insert_node(graph, anchor, aten.view_as_real.default, (rope.cos,), like=y)
            cos = insert_node(graph, anchor, aten.select.int, (real, -1, 0), like=y)
            sin = insert_node(graph, anchor, aten.select.int, (real, -1, 1), like=y)
        size = size_args(graph, anchor, rope.x, range(nd - 1)) + [half]
        cos = insert_node(graph, anchor, aten.expand.default, (cos, size), like=y)
        sin = insert_node(graph, anchor, aten.expand.default, (sin, size), like=y)
        replaced = list(rope.region) + list(quant.closure)
        detail = [("rule", quant.rule), ("rope_dim", rope.rope_dim), ("D", concrete_shape(xv)[-1])]
        if store:
            writes = store
            rows = writes[0].args[1][1]
            d = concrete_shape(xv)[-1]
            if xv.dim() == 3 and same_shape(xv.shape[:2], tensor_val(rows).shape):
                x_in = rope.x
            else:  # the op takes x [B, T, D] with rows [B, T]
                bt = size_args(graph, anchor, rows, [0, 1])
                x_in = insert_node(graph, anchor, aten.reshape.default, (rope.x, bt + [d]), like=y)
                cos = insert_node(graph, anchor, aten.reshape.default, (cos, bt + [half]), like=y)
                sin = insert_node(graph, anchor, aten.reshape.default, (sin, bt + [half]), like=y)
            # index_put wraps a negative row to the end of the cache; the op skips rows outside [0, Rows),
            # so wrap them here to keep eager semantics exactly.
            n_rows = size_args(graph, anchor, writes[0].args[0], [1])[0]
            neg = insert_node(graph, anchor, aten.lt.Scalar, (rows, 0), like=y)
            wrapped = insert_node(graph, anchor, aten.add.Tensor, (rows, n_rows), like=y)
            rows_in = insert_node(graph, anchor, aten.where.self, (neg, wrapped, rows), like=y)
            hop = torch.ops.higher_order.auto_functionalized
            af = insert_node(graph, anchor, hop, (op,), dict(
                x=x_in, cos=cos, sin=sin, scale_block=blk, e4m3_scale=e4m3, codes_cache=writes[0].args[0],
                scale_cache=writes[1].args[0], rows=rows_in), like=y)
            for i, w in enumerate(writes):
                new = insert_node(graph, anchor, operator.getitem, (af, i + 1), like=y)
                w.replace_all_uses_with(new)
                replaced.append(w)
            detail.append(("cache_write", "fused (rope_fp4_quant_store)"))
        else:
            if not use_fake:
                detail.append(("cache_write", store_why or "none"))
            out = insert_node(graph, first, op, (rope.x, cos, sin, blk, e4m3), like=y)
            if use_fake and quant.fake_widened:
                out = insert_node(graph, first, prims.convert_element_type.default, (out, torch.float32), like=y)
                detail.append(("fake_output", "float32 (exact upcast of the op's bfloat16 values)"))
            targets = [(quant.fake, out)] if use_fake else [
                (quant.packed, insert_node(graph, first, operator.getitem, (out, 0), like=y)),
                (quant.scale, insert_node(graph, first, operator.getitem, (out, 1), like=y))]
            if use_fake:  # the same values in other shapes, where something outside the quantiser reads them
                targets += [(a, out) for a in quant.fake_aliases if _used_outside(a, quant.closure)]
            for old, new in targets:
                if old is None:
                    continue
                if not same_shape(tensor_val(old).shape, tensor_val(new).shape):
                    new = insert_node(graph, first, aten.reshape.default, (new, list(concrete_shape(tensor_val(old)))),
                                      like=y)
                old.replace_all_uses_with(new)
        rec = MatchRecord(self.name, f"{op_name}({quant.rule})", f"dsv41::{op_name}", loc,
                          tuple(n.name for n in replaced), tuple(node_label(n) for n in replaced),
                          *self._bytes(rope, quant, blk, use_fake, bool(store)), tuple(detail))
        return rec, None

    @staticmethod
    def _bytes(rope: Rope, quant: Quant, blk: int, fake: bool, store: bool):
        xv = tensor_val(rope.x)
        e = xv.element_size()
        d = concrete_shape(xv)[-1]
        rows, subs = token_rows(concrete_shape(xv)[:-1])
        trig = sum(tensor_val(t).numel() * tensor_val(t).element_size() for t in (rope.cos, rope.sin) if t is not None)
        codes = rows * (d // 2 + d // blk)
        x_rw = rows * d * e
        if fake:
            # before: rope reads x and writes y; the fake-quant reads y and writes the dequantised values.
            before, after = 3 * x_rw + trig + x_rw, x_rw + trig + x_rw
        else:
            before, after = 3 * x_rw + trig + codes, x_rw + trig + codes
            if store:  # the unfused write reads the codes back and writes them into the caches
                before += 2 * codes
        return str(sympy.expand(before)), str(sympy.expand(after)), tuple(sorted(subs.items()))


def _output_mismatch(x: fx.Node, quant: Quant, blk: int, fake: bool):
    """(check, reason) when the op's outputs cannot stand in for the matched nodes (dtype, or a reshape that
    would need symbolic sizes); None when they can. Checked before the graph is touched."""
    xv = tensor_val(x)
    lead = list(xv.shape[:-1])
    d = concrete_shape(xv)[-1]
    if fake:
        wanted = [(quant.fake, torch.float32 if quant.fake_widened else xv.dtype, lead + [d])]
    else:
        wanted = [(quant.packed, torch.uint8, lead + [d // 2]), (quant.scale, torch.uint8, lead + [d // blk])]
    for node, dtype, shape in wanted:
        if node is None:
            continue
        v = tensor_val(node)
        if v.dtype != dtype:
            return "output_dtype", f"the matched output is {v.dtype}; the fused op returns {dtype}"
        if not same_shape(v.shape, shape) and any(isinstance(s, torch.SymInt) for s in (*v.shape, *shape)):
            return "dynamic_reshape", "the quantised output is reshaped with symbolic sizes"
    return None


# ------------------------------------------------------------------------------------------------ structure
def is_block_amax(n: fx.Node) -> bool:
    """`amax(t, [-1])` over a last dim of 16 or 32: the block absmax every FP4/FP8 block quantiser takes."""
    if n.op != "call_function" or n.target != aten.amax.default:
        return False
    src = tensor_val(n.args[0])
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", ())
    if src is None or src.dim() == 0 or list(dims) not in ([-1], [src.dim() - 1]):
        return False
    return concrete_shape(src)[-1] in (16, 32)


def quantised_tensor_candidates(amax: fx.Node) -> list:
    """Tensors the block quantiser may be quantising, farthest first: walk back from the amax through abs,
    casts and views to the first op that is none of those (that op's output is the farthest candidate)."""
    chain = []
    n = amax.args[0]
    while True:
        chain.append(n)
        ins = [a for a in n.all_input_nodes if tensor_val(a) is not None]
        if n.op != "call_function" or len(ins) != 1 or not (is_view_op(n) or n.target in _UNARY_TO_Y):
            break
        n = ins[0]
    out = []
    for c in reversed(chain):
        v = tensor_val(c)
        if v is not None and v.is_floating_point() and v.dim() >= 1 and concrete_shape(v)[-1] % 16 == 0:
            out.append(c)
    return out


def _forward_closure(y: fx.Node, sourced: set) -> list:
    """Dataflow nodes computed from `y` alone (plus constants), in graph order."""
    inset = {y}
    closure = []
    queue = deque(y.users)
    while queue and len(closure) < _CLOSURE_LIMIT:
        u = queue.popleft()
        if u in inset or not is_dataflow_op(u):
            continue
        if all(a in inset or a not in sourced for a in u.all_input_nodes):
            inset.add(u)
            closure.append(u)
            queue.extend(u.users)
    pos = order_key(y.graph)
    return sorted(closure, key=pos)


def _quant_probes(shape, dtype, device) -> list:
    """Two probes for a block quantiser of tensors `shape`: random values with per-32-block magnitudes
    2^-8..2^8 (never on an FP4 grid), and the same with 16-element halves that hit every E2M1 rounding tie
    exactly (amax = 6 * 2^k, the other elements at midpoints times 2^k) and one zero half when there are
    several. With two blocks or more, the first random block is scaled to 2^-20 (its amax below the 1e-4 floor
    common in other quantisers, so a quantiser with another amax floor differs there) and with three or more the
    first tied block is all zeros. A region must match the reference on both."""
    gen = torch.Generator().manual_seed(7)
    d = shape[-1]
    lead = 1
    for s in shape[:-1]:
        lead *= s
    nb = -(-d // 32)
    mag = torch.exp2(torch.randint(-8, 9, (lead, nb, 1), generator=gen).double())
    if lead * nb >= 2:
        mag[0, 0] = 2.0 ** -20
    rand = torch.randn(lead, nb, 32, generator=gen, dtype=torch.float64) * mag
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, 5.0],
                        dtype=torch.float64)
    sign = torch.where(torch.rand(lead, nb, 32, generator=gen) < 0.5, -1.0, 1.0).double()
    tie = ties.repeat(2) * sign * mag
    halves = (torch.arange(lead * nb * 2) % 2 == 1).reshape(lead, nb, 2, 1)  # every other 16-element half
    tied = torch.where(halves, tie.view(lead, nb, 2, 16), rand.view(lead, nb, 2, 16)).reshape(lead, nb, 32)
    if lead * nb > 2:
        tied[-1, -1, :16] = 0.0
        tied[0, 0, :] = 0.0
    return [v.reshape(lead, nb * 32)[:, :d].reshape(shape).to(dtype).to(device) for v in (rand, tied)]


def _equal_flat(a, ref) -> bool:
    return (isinstance(a, torch.Tensor) and a.dtype == ref.dtype and a.numel() == ref.numel()
            and torch.equal(a.reshape(-1), ref.reshape(-1)))


def match_quant(y: fx.Node, amax: fx.Node, ev: RegionEvaluator, sourced: set) -> Quant | None:
    """Which FP4 rule (if any) the nodes computed from y implement, and which nodes hold its outputs.

    Outputs are searched only among the nodes that depend on the block `amax` (a quantiser's results all
    depend on its scales), so the quantiser's input views can never pass for its output."""
    yv = tensor_val(y)
    shape = concrete_shape(yv)
    closure = _forward_closure(y, sourced)
    if not closure:
        return None
    inside = set(closure)
    after_amax = {amax}
    for n in closure:
        if n is not amax and any(a in after_amax for a in n.all_input_nodes if a in inside):
            after_amax.add(n)
    outputs = [n for n in closure if n in after_amax]
    probes = _quant_probes(shape, yv.dtype, yv.device)
    try:
        runs = [ev.evaluate(closure, {y: p}) for p in probes]
    except RegionNotClosed:
        return None
    for rule, (blk, _, qfn, ffn) in QUANT_RULES.items():
        if shape[-1] % blk:
            continue
        refs = [(qfn(p), ffn(p), p) for p in probes]

        def find(pick, values=False):
            """The output node whose probe values equal the reference part `pick` selects (the first with y's
            shape, else the first), or None. `values`: the part is the fake-quantised values (a probe already on
            the grid proves nothing); replacing the node of y's shape leaves no reshape behind the op."""
            hits = []
            for n in outputs:
                ok = True
                for vals, ((pq, sq), fq, p) in zip(runs, refs):
                    if values and torch.equal(fq, p):
                        ok = False  # the probe is already on the grid: identity would pass
                    if not ok or not _equal_flat(vals[n], pick(pq, sq, fq)):
                        ok = False
                        break
                if ok:
                    hits.append(n)
            if not hits or not values:
                return hits[0] if hits else None
            # Only reshapes of the first hit hold the same values by construction; another node may agree on the
            # probes alone (a clamp wider than the probes' range) and must keep reading the op's output.
            views, todo = [hits[0]], [hits[0]]
            while todo:
                for u in todo.pop().users:
                    if u in hits and u not in views and is_reshape(u):
                        views.append(u)
                        todo.append(u)
            best = next((n for n in views if same_shape(tensor_val(n).shape, yv.shape)), hits[0])
            aliases[pick] = tuple(n for n in views if n is not best)
            return best

        aliases = {}
        packed = find(lambda pq, sq, fq: pq)
        scale = find(lambda pq, sq, fq: sq)
        same, wide = (lambda pq, sq, fq: fq), (lambda pq, sq, fq: fq.float())
        fake, widened = find(same, values=True), False
        if fake is None and yv.dtype == torch.bfloat16:
            fake = find(wide, values=True)
            widened = fake is not None
        if (packed is not None and scale is not None) or fake is not None:
            if packed is None or scale is None:
                packed = scale = None
            return Quant(rule, packed, scale, fake, closure, widened, aliases.get(wide if widened else same, ()))
    return None


def _describe_other_quantiser(y: fx.Node, ev: RegionEvaluator, sourced: set) -> str:
    """Reason text for a RoPE output that is quantised, but not to FP4 with a supported scale rule."""
    yv = tensor_val(y)
    closure = _forward_closure(y, sourced)
    if closure and concrete_shape(yv)[-1] % 32 == 0:
        probe = _quant_probes(concrete_shape(yv), yv.dtype, yv.device)[0]
        try:
            vals = ev.evaluate(closure, {y: probe})
        except RegionNotClosed:
            vals = {}
        codes, _ = formats.quantize_fp8_1x32(probe)
        fq = formats.fake_quant_fp8_1x32(probe)
        if any(_equal_flat(vals.get(n), codes) or _equal_flat(vals.get(n), fq) for n in closure):
            return ("the RoPE output is quantised to FP8 E4M3 with 1x32 UE8M0 scales; rope_fp4 ops quantise to FP4 "
                    "E2M1 (E4M3 1x16 or UE8M0 1x32 scales)")
    return ("the RoPE output is block-quantised with a rule that is neither FP4 E2M1 + E4M3 1x16 nor FP4 E2M1 + "
            "UE8M0 1x32 scales")


def _used_outside(node: fx.Node | None, closure: list) -> bool:
    if node is None:
        return False
    inside = set(closure)
    return any(u not in inside for u in node.users)


# ------------------------------------------------------------------------------------------------ cache write
def _write_of(node: fx.Node | None, closure: set, ev: RegionEvaluator, sourced: set):
    """(index_put node, None) if `node` flows only through views into the model's cache write
    `index_put(cache [B, Rows, W], [batch_index, rows], value [B, T, W])` (batch_index = arange(B)[:, None]
    broadcast to rows' shape, no accumulate) — the layout `rope_fp4_quant_store` writes; else (None, reason),
    or (None, "") when the node feeds no cache write at all. Users inside the quantiser's own region
    (`closure`, e.g. the scale dividing the values) are not "other readers"."""
    if node is None:
        return None, ""
    terminals: list = []
    stack = [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in closure and not is_view_op(u):
                continue
            if is_view_op(u):
                stack.append(u)
            else:
                terminals.append((u, n))
    writes = [(u, n) for u, n in terminals if u.target in _WRITE_OPS]
    if not writes:
        return None, ""
    w, n = writes[0]
    if len(terminals) != 1:
        return None, "the quantised values are also read elsewhere, so the cache write is left to Inductor"
    if w.target != aten.index_put.default:
        return None, f"{node_label(w)} writes are left to Inductor (only index_put / index_put_ writes are fused)"
    base, idx, value = w.args[0], w.args[1], w.args[2]
    accumulate = w.args[3] if len(w.args) > 3 else w.kwargs.get("accumulate", False)
    layout = ("the cache write is not `cache[batch, rows] = values` on a [B, Rows, bytes] cache (the layout "
              "rope_fp4_quant_store writes); left to Inductor")
    if value is not n or accumulate or len(idx) != 2 or any(i is None for i in idx):
        return None, layout
    bv, vv, rv = tensor_val(base), tensor_val(value), tensor_val(idx[1])
    if bv.dim() != 3 or vv.dim() != 3 or rv.dim() != 2 or rv.dtype != torch.int64:
        return None, layout
    if not (same_shape(vv.shape[:2], rv.shape) and same_shape(bv.shape[::2], vv.shape[::2])):
        return None, layout
    bi = idx[0]
    if bi in sourced:
        return None, "the batch index of the cache write is not arange(B); left to Inductor"
    try:
        got = ev.evaluate([bi], {})[bi]
    except RegionNotClosed:
        return None, "the batch index of the cache write is not arange(B); left to Inductor"
    b, t = concrete_shape(rv)
    want = torch.arange(b, device=got.device)[:, None].expand(b, t)
    if got.shape != want.shape or not torch.equal(got.to(torch.int64), want):
        return None, "the batch index of the cache write is not arange(B); left to Inductor"
    return w, None


def cache_write(quant: Quant, ev: RegionEvaluator, sourced: set):
    """Both index_put writes (codes, scales) when they can be fused into rope_fp4_quant_store, else (None, why)."""
    closure = set(quant.closure)
    wp, why_p = _write_of(quant.packed, closure, ev, sourced)
    ws, why_s = _write_of(quant.scale, closure, ev, sourced)
    if wp is None or ws is None:
        why = why_p or why_s
        if not why and (wp is not None or ws is not None):
            why = "only one of codes / scales is written to a cache; the write is left to Inductor"
        return None, why
    if wp.args[1][1] is not ws.args[1][1]:
        return None, "codes and scales are written at different row indices; the writes are left to Inductor"
    return (wp, ws), ""


