"""`upcast_linear` family: an FP32 matmul by a stored weight reads the weight once, in its own width.

Chains matched (post-grad ATen; `F.linear(x.float(), W.float())`, `x.float() @ W.float().t()` and their addmm form
with a bias all lower to them):

    w32 = convert_element_type(W, float32)          # W bf16 / fp16 [N, K]
    y   = mm(x, permute(w32, [1, 0]))               # x float32 [M, K]     (or addmm(bias, x, ...), alpha = beta = 1)
    (the permute may also come before the convert)

    y   = mm(x, permute(W, [1, 0]))                 # W float32 [N, K], x float32 [1, K] (batch-1 decode)

become `y = dsv41::linear_upcast(x, W)` (`+ bias`). For a half-precision W, eager reads W (2 bytes per element),
writes the FP32 copy (4), and the FP32 GEMM reads the copy (4): every step, 5x the weight's bytes in two launches;
the fused op reads the 2 bytes once (dsv41/kernels/upcast_gemv.py). For an FP32 W no bytes are saved; the op's
split-K GEMV measured 6-8 % faster than cuBLAS at M = 1 on the compressor's shapes (H200: 512 x 5120 6.21 vs
6.75 us, 512 x 1024 3.20 vs 3.41 us; bench/results/2026-11-30_h200_s11), so only M = 1 is taken (a static shape;
other M, verify and prefill included, stay with Inductor and cuBLAS, unrecorded). In dsv41/model this is the LM
head (`final_logits`), the compressor's wkv / wgate (csa.py; FP32 weights at ratio 2) and DSpark's head; the MoE
router gate and the mHC projection have the same spelling but are consumed earlier by the `moe` and `mhc`
families, which run before this one. In an FP32 model every dense projection has the FP32 form.

Semantics need no probe: widening bf16 / fp16 to fp32 is exact, so the op multiplies exactly the values the
FP32 matmul multiplies (sums in another FP32 order, as any two GEMMs differ; the report's tolerance).

Only weights that are graph inputs the graph never writes (parameters and buffers, or views of them) are fused:
the kernel requests its weight tile before waiting on the previous kernel (PDL), which is only safe for memory no
kernel of the step writes. A computed or written half-precision weight is left unfused (near-miss
`weight_source`). An FP32 weight must moreover be one the compile marks static (`engine.static_inputs`: a parameter,
buffer or module tensor, not an activation input such as a regional graph's input from the previous region; None
in training graphs and subgraphs, then no FP32 match); any other FP32 matmul is an ordinary product of
activations, left to Inductor unrecorded. What neither check sees: a module tensor written by an EARLIER graph
(after a graph break, or an earlier region) and multiplied here; in dsv41/model no FP32 module state is a matmul
operand (the compressor's FP32 state is written and read inside its own region).

Near-misses (reported, not fused):

    weight_source     the upcast weight is computed, or written in place, inside the graph (e.g. a bf16 cache
                      the step updates, then multiplies by)

    weight_transform  the upcast weight goes through another op (a scale, a slice, a cast to float64) before the
                      matmul; the op multiplies by the upcast weight itself
    activation_dtype  the matmul multiplies an upcast half-precision weight by a non-FP32 operand (e.g. float64)

The upcast copy stays when something else reads it (then only the matmul's read of it is saved; the record's
bytes say so).
"""

from __future__ import annotations

import dataclasses

import sympy
import torch
import torch.fx as fx

from .records import BATCH, LENGTH, MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (Chain, FusionFamily, Role, concrete_shape, dsv41_op, eliminate_dead_code, insert_node, is_view_op,
                     node_label, register_family, static_inputs, tensor_val, token_rows)
from .small_ops import mutated_inputs, view_base

__all__ = ["UpcastLinearFamily", "SPEC"]

aten = torch.ops.aten
prims = torch.ops.prims
_PATTERN = "upcast(bf16/fp16 W) -> fp32 mm"
#: Stored widths widened by the upcast form (FP32 weights are matched without an upcast).
_HALF = (torch.bfloat16, torch.float16)
_TRANSPOSES = (aten.permute.default, aten.t.default)


def _is_transpose(n) -> bool:
    if not isinstance(n, fx.Node) or n.op != "call_function" or n.target not in _TRANSPOSES:
        return False
    return n.target == aten.t.default or list(n.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])


def _is_upcast(n, to: torch.dtype | None = torch.float32) -> bool:
    """`n` is convert_element_type(bf16/fp16 tensor, to)."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or n.target != prims.convert_element_type.default:
        return False
    src = tensor_val(n.args[0])
    return src is not None and src.dtype in _HALF and (to is None or n.args[1] == to)


def _weight_of(rhs: fx.Node):
    """(W [N, K] half-precision node, [nodes between W and the mm]) when `rhs` is W upcast and transposed, in
    either order; else None."""
    if _is_transpose(rhs) and _is_upcast(rhs.args[0]):
        w = rhs.args[0].args[0]
        return (w, [rhs.args[0], rhs]) if len(concrete_shape(tensor_val(w))) == 2 else None
    if _is_upcast(rhs) and _is_transpose(rhs.args[0]):
        wt = rhs.args[0]
        w = wt.args[0]
        if len(concrete_shape(tensor_val(w))) != 2:
            return None
        # convert(permute(W)): the op wants W itself, which the permute's input is.
        return w, [wt, rhs]
    if _is_transpose(rhs):
        wv = tensor_val(rhs.args[0])
        if wv is not None and wv.dtype == torch.float32 and len(concrete_shape(wv)) == 2:
            return rhs.args[0], [rhs]
    return None


def _one_row(x: fx.Node) -> bool:
    """The mm's activation [M, K] has exactly M = 1 row (batch-1 decode: the only M the FP32 GEMV was measured at).
    A symbolic M is not compared (that would add a guard to the compile): it is not taken."""
    m = tensor_val(x).shape[0]
    return isinstance(m, int) and m == 1


def _look_alike(rhs: fx.Node) -> str | None:
    """Why `rhs` (the mm's second operand) is an upcast half-precision weight transformed before the matmul, or
    None when it is not built from one within two ops."""
    node = rhs.args[0] if _is_transpose(rhs) else rhs
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if _is_upcast(node, to=None) and node.args[1] != torch.float32:
        return (f"the weight is upcast to {node.args[1]}, not float32; dsv41::linear_upcast computes FP32 "
                "products")
    for a in node.all_input_nodes:
        if _is_upcast(a) or (_is_transpose(a) and _is_upcast(a.args[0])):
            return (f"the upcast weight goes through {node_label(node)} before the matmul; dsv41::linear_upcast "
                    "multiplies by the upcast weight itself")
    return None


def _token_leading(x: fx.Node) -> tuple:
    """Leading dims of the activation before the mm flattened it (through views), for the byte expressions."""
    m = concrete_shape(tensor_val(x))[0]
    n = x
    for _ in range(4):
        if not (isinstance(n, fx.Node) and n.op == "call_function" and is_view_op(n) and n.args):
            break
        n = n.args[0]
        shp = concrete_shape(tensor_val(n)) if isinstance(n, fx.Node) and tensor_val(n) is not None else ()
        if len(shp) >= 2:
            lead = shp[:-1]
            prod = 1
            for d in lead:
                prod *= d
            if prod == m:
                return tuple(lead)
    return (m,)


#: The family as data (`dsv41 report --patterns`).
SPEC = register_family(
    "upcast_linear", "FP32 matmul by an upcast bf16/fp16 weight, or by an FP32 weight at M = 1 -> GEMV reading the "
    "weight once in its stored width", (
    Chain("upcast", "linear_upcast", "mm / addmm of an FP32 x by permute(convert(W half)) (or an FP32 static W at "
          "M = 1)", (Role("x", "[M, K]", "fp32"), Role("W", "[N, K]", "bf16 / fp16 / fp32")),
          "exact widening (no probe)", (), (), ("activation_dtype", "weight_source", "weight_transform")),),
    # order: after mhc and moe, whose projection and router gate have the same spelling inside their chains
    after=("mhc", "moe"),
)


class UpcastLinearFamily(FusionFamily):
    """Fuse `mm(x_f32, upcast(W_half)^T)`, and `mm(x_f32, W_f32^T)` at M = 1, into `dsv41::linear_upcast`
    (module docstring)."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Rewrite every matching matmul of `gm` in place; returns the matches and near-misses."""
        graph = gm.graph
        matches, misses = [], []
        written = mutated_inputs(graph)
        stored = static_inputs(graph)  # parameters / buffers (None: unknown, then no FP32-weight match)
        for mm in list(graph.nodes):
            if mm.op != "call_function" or mm.target not in (aten.mm.default, aten.addmm.default):
                continue
            if mm.target == aten.addmm.default:
                if mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1:
                    continue
                bias, x, rhs = mm.args[:3]
            else:
                bias, (x, rhs) = None, mm.args[:2]
            if not isinstance(rhs, fx.Node):
                continue
            found = _weight_of(rhs)
            loc = SourceLocation.from_node(mm)
            if found is None:
                why = _look_alike(rhs)
                if why is not None:
                    misses.append(NearMiss(self.name, _PATTERN, "weight_transform", why, loc))
                continue
            base = view_base(found[0])
            if tensor_val(found[0]).dtype == torch.float32:
                # No upcast: a stored FP32 weight (a parameter or buffer the graph does not write) at M = 1;
                # anything else is an ordinary FP32 matmul, left to Inductor unrecorded.
                is_stored = base.op == "get_attr" or (stored is not None and base in stored)
                xv = tensor_val(x)
                if not is_stored or base in written or xv is None or xv.dtype != torch.float32 or not _one_row(x):
                    why = _look_alike(rhs)  # e.g. an upcast weight scaled before the matmul
                    if why is not None:
                        misses.append(NearMiss(self.name, _PATTERN, "weight_transform", why, loc))
                    continue
                matches.append(self._fuse(graph, mm, x, bias, *found))
                continue
            if base.op not in ("placeholder", "get_attr") or base in written:
                how = "written in place by" if base in written else "computed by"
                misses.append(NearMiss(self.name, _PATTERN, "weight_source",
                                       f"the upcast weight is {how} the graph ({node_label(base)}); "
                                       "dsv41::linear_upcast reads its weight before waiting on the previous kernel "
                                       "(PDL), so only weights no kernel of the step writes are fused", loc))
                continue
            xv = tensor_val(x)
            if xv is None or xv.dtype != torch.float32:
                misses.append(NearMiss(self.name, _PATTERN, "activation_dtype",
                                       f"the matmul multiplies the upcast weight by a {getattr(xv, 'dtype', None)} "
                                       "operand; dsv41::linear_upcast takes an FP32 activation", loc))
                continue
            matches.append(self._fuse(graph, mm, x, bias, *found))
        eliminate_dead_code(graph)
        alive = {n.name for n in graph.nodes}
        return PassRecord(self.name, True, tuple(_finish(m, alive) for m in matches), tuple(misses))

    def _fuse(self, graph: fx.Graph, mm: fx.Node, x: fx.Node, bias, w: fx.Node, chain: list) -> MatchRecord:
        y = insert_node(graph, mm, dsv41_op("linear_upcast"), (x, w), like=mm)
        if bias is not None:
            y = insert_node(graph, mm, aten.add.Tensor, (y, bias), like=mm)
        mm.replace_all_uses_with(y)
        graph.erase_node(mm)

        n, k = concrete_shape(tensor_val(w))
        half = tensor_val(w).element_size()
        rows, subs = token_rows(_token_leading(x))
        upcast = next((c for c in chain if c.target == prims.convert_element_type.default), None)
        io = rows * k * 4 + rows * n * 4 + (n * 4 if bias is not None else 0)
        # Before: W read, its FP32 copy written, the GEMM reads the copy. After: W read once (`_finish` adds the
        # copy back if something else still reads it). An FP32 weight has no copy: the same bytes, in a GEMV.
        before = n * k * half + (2 * n * k * 4 if upcast is not None else 0) + io
        after = n * k * half + io
        region = chain + [mm]
        return MatchRecord(
            self.name, f"linear_upcast({tensor_val(w).dtype})", "dsv41::linear_upcast", SourceLocation.from_node(mm),
            tuple(r.name for r in region), tuple(node_label(r) for r in region), str(sympy.expand(before)),
            str(sympy.expand(after)), tuple(sorted(subs.items())),
            (("N", n), ("K", k), ("weight_dtype", str(tensor_val(w).dtype)), ("bias", bias is not None),
             ("upcast", upcast.name if upcast is not None else None),
             ("upcast_bytes", n * k * (half + 4) if upcast is not None else 0)))


def _finish(m: MatchRecord, alive: set) -> MatchRecord:
    """After dead-code elimination: keep only the chain nodes that really left the graph, and when the upcast
    copy stayed (another consumer reads it) count its bytes in `bytes_after` (`detail["upcast_kept"]`)."""
    detail = dict(m.detail)
    kept = detail.pop("upcast") in alive
    extra = detail.pop("upcast_bytes") if kept else 0
    detail["upcast_kept"] = kept
    keep = [(a, b) for a, b in zip(m.nodes_replaced, m.ops_replaced) if a not in alive]
    after = str(sympy.expand(sympy.sympify(m.bytes_after, locals={"B": BATCH, "L": LENGTH}) + extra))
    return dataclasses.replace(m, nodes_replaced=tuple(a for a, _ in keep), ops_replaced=tuple(b for _, b in keep),
                               bytes_after=after, detail=tuple(detail.items()))
