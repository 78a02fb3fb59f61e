"""`half_gemv` family: the projections of a bf16 / fp16 decoder block at decode (M <= 8), with the SwiGLU, the
residual adds and the sibling projections of one activation folded into their GEMV launches.

Chains matched (post-grad ATen of the eager spellings `F.linear(x, W)` / `nn.Linear` / `x @ W.T`; gpt-fast's and
transformers' Llama, Qwen and Mistral blocks lower to them):

    y = mm(x, permute(W, [1, 0]))          x bf16 / fp16 [M, K] (M <= 8), W the same dtype [N, K], a stored weight

    1. swiglu     e = silu(view(mm(x, Wg^T))) * view(mm(x, Wu^T))       (any spelling of silu and the product
                  whose probe values equal F.silu(g) * u in x's dtype
                  up to three roundings)  -> dsv41::linear_half_silu_mul(x, Wg, Wu)
    2. residual   e = r + view(mm(x, W^T))  (or view(mm) + r; r not computed from the mm)
                                                                      -> dsv41::linear_half(x, W, r)
    3. siblings   2 to 4 remaining mm of one x (q / k / v)            -> dsv41::linear_half_multi(x, [W_i])
    4. the rest   each remaining mm                                   -> dsv41::linear_half(x, W)

    and in front of any of them, when x is an RMSNorm of h (gpt-fast's, transformers', torch's F.rms_norm spelling;
    eps and spelling settled on probes): the op takes h and computes the norm in its prologue (norm_weight, eps,
    norm_mode), so the norm's launch and the normalised copy go.

Why. Inductor runs each projection of a bf16 decoder as its own cuBLAS call and the SwiGLU and residual adds as
separate Triton kernels: a Llama-3.2-1B-shaped step was 311 kernels, at 49 % of its copy roofline on an H100
(issue [generic]). Each fused op is one launch that reads its weights once at their stored width, before its PDL
wait (dsv41/kernels/half_gemv.py).

Conditions (proven from the graph): x and W share one half-precision dtype; M is a static int <= MAX_TRITON_M
(larger M, prefill, stays with Inductor and cuBLAS, unrecorded); W is a 2-D graph input the graph never writes and
that the compile marks static (`engine.static_inputs`: a parameter or buffer; a `get_attr` constant counts too),
because the kernel reads it before waiting on the previous kernel. For the SwiGLU: the two weights have one shape,
the region between the two matmuls and e reads nothing else and nothing outside it reads its inner values, it holds
only views and smooth ops (`rms_prologue.SMOOTH_OPS`: no clamp or where that the probes' magnitudes may never reach; the same
holds for an RMSNorm region), and on probes it equals F.silu(g) * u rounded in x's dtype (gate and up told apart by
the probes). The matmul's output is followed only through views that keep its elements in order (a reshape, not a
transpose, slice or expand: `_through_views`). For the residual: the
add is the matmul's only user (through views) and adds a tensor of the output's shape and dtype.

Near-misses (reported, not fused):

    weight_source   the half-precision weight is computed, written in place, or not a stored module tensor
    bias            addmm whose bias the ops cannot take (not x's dtype [N], or alpha / beta not 1), or a SwiGLU
                    half with a bias: the projection stays with cuBLAS. A plain `F.linear(x, W, b)` (Qwen's q / k / v)
                    is fused with its bias, which joins the FP32 sum before the one rounding (cuBLAS's addmm)
    static_shapes   x or W has a size known only at run time (dynamic shapes) and M's hint is <= MAX_TRITON_M: the
                    rewrites and probes are for the compiled sizes, so the projection stays with Inductor
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import (Chain, FusionFamily, RegionEvaluator, Role, close, collect_region,
                     concrete_shape, dsv41_op, eliminate_dead_code, insert_node, is_dataflow_op,
                     is_view_op, node_label, register_family, static_inputs, static_refusal, tensor_val,
                     token_rows)
from .rms_prologue import rms_prologue, smooth
from .small_ops import mutated_inputs, view_base

__all__ = ["HalfGemvFamily", "SPEC"]

aten = torch.ops.aten
_HALF = (torch.bfloat16, torch.float16)
_TRANSPOSES = (aten.permute.default, aten.t.default)
#: Largest M taken (`half_gemv.MAX_TRITON_M`, repeated here so the finder needs no kernel import).
_MAX_M = 8
#: Most weights of one sibling launch (`half_gemv.MAX_WEIGHTS`).
_MAX_SIBLINGS = 4
#: The ops the family emits (one kernel).
_OPS = ("linear_half", "linear_half_multi", "linear_half_silu_mul")
#: Nodes between a gate matmul and the SwiGLU product that the finder walks at the most.
_SWIGLU_REACH = 16

#: What every chain discovers about an RMSNorm in front of x (the op's prologue), and how.
_NORM_CONSTANTS = ("RMSNorm prologue: eps among the region's literals", "RMSNorm spelling (half_gemv.NORM_MODES)")
_NORM_PROBES = ("RMSNorm: rows at scales 1, 3e-3 (where eps moves the statistic) and 1e6 (3e4 for fp16: where an eps "
                "outside the square root would), exact first, else one rounding")

SPEC = register_family(
    "half_gemv", "bf16 / fp16 projections at M <= 8 -> GEMVs reading each weight once, with SwiGLU, residual add and "
    "sibling projections in the same launch", (
        Chain("swiglu", "linear_half_silu_mul", "silu(mm(x, Wg^T)) * mm(x, Wu^T) in any spelling",
              (Role("x", "[M, K]", "bf16 / fp16"), Role("Wg, Wu", "[N, K]", "x's dtype")),
              "dsv41.kernels.half_gemv:reference_linear_half_silu_mul", ("which matmul is the gate", *_NORM_CONSTANTS),
              ("standard-normal g, u at scales 1 and 6, within three roundings of x's dtype", _NORM_PROBES),
              ("weight_source", "static_shapes")),
        Chain("residual", "linear_half", "r + mm(x, W^T)",
              (Role("x", "[M, K]", "bf16 / fp16"), Role("W", "[N, K]", "x's dtype"), Role("r", "[M, N]", "x's dtype")),
              "dsv41.kernels.half_gemv:reference_linear_half (structure only: an add of one shape and dtype)",
              _NORM_CONSTANTS, (_NORM_PROBES,),
              ("weight_source", "static_shapes")),
        Chain("siblings", "linear_half_multi", "2 to 4 mm(x, W_i^T) of one x",
              (Role("x", "[M, K]", "bf16 / fp16"), Role("W_i", "[N_i, K]", "x's dtype")),
              "dsv41.kernels.half_gemv:reference_linear_half_multi (structure only)", _NORM_CONSTANTS, (_NORM_PROBES,),
              ("weight_source", "static_shapes")),
        Chain("linear", "linear_half", "mm(x, W^T)",
              (Role("x", "[M, K]", "bf16 / fp16"), Role("W", "[N, K]", "x's dtype")),
              "dsv41.kernels.half_gemv:reference_linear_half (structure only)", _NORM_CONSTANTS, (_NORM_PROBES,),
              ("weight_source", "bias", "static_shapes")),
    ),
    # order: after the quantised-weight families (a dequantised weight is theirs: here it is a computed weight,
    # a near-miss) and after sibling_gemv, so no family sees this one's ops
    after=("dispatch", "sibling_gemv"),
)


def _transposed(rhs) -> fx.Node | None:
    """W when `rhs` is W [N, K] transposed to [K, N], else None."""
    if not isinstance(rhs, fx.Node) or rhs.op != "call_function" or rhs.target not in _TRANSPOSES:
        return None
    if rhs.target == aten.permute.default and list(rhs.args[1]) not in ([1, 0], [-1, -2], [1, -2], [-1, 0]):
        return None
    w = rhs.args[0]
    wv = tensor_val(w) if isinstance(w, fx.Node) else None
    return w if wv is not None and wv.dim() == 2 else None


def _x_key(x):
    """Equal for x nodes that are one tensor: the node, or a view / reshape of one node with the same arguments."""
    if isinstance(x, fx.Node) and x.op == "call_function" and is_view_op(x):
        return (str(x.target), _x_key(x.args[0]), tuple(str(a) for a in x.args[1:]))
    return x


def _through_views(node: fx.Node) -> fx.Node:
    """The last node of the single-user view chain that starts at `node` (the matmul's output as the code sees it),
    following only views that keep every element of the matmul's output in its row-major order (`_same_elements`).

    Why: the rewrites put the fused op's [M, N] result back with a plain reshape to the add's / product's shape, and
    the probes of the SwiGLU feed values straight into this node. A transpose (`y.transpose(1, 2)` of a square
    output), a slice (`y[:, -1:]`, `y[..., :n]`) or an expand between the matmul and the add / product has the
    shape the add wants but not the matmul's elements in order: following it fused `r + y.T` as `r + y` and
    `silu(g.T) * u.T` as `silu(g) * u` (wrong values), and a slice or expand as a reshape of the wrong size (the
    family raised). Such views stay inside the add's / product's region, where the probes see them."""
    while len(node.users) == 1:
        (u,) = node.users
        if not (u.op == "call_function" and is_view_op(u) and _same_elements(u, node)):
            break
        node = u
    return node


def _same_elements(view: fx.Node, base: fx.Node) -> bool:
    """Whether `view` holds exactly `base`'s elements in `base`'s row-major order (both contiguous, one element
    count, no storage offset): a reshape, an unsqueeze, a transpose of size-1 dims, not a permute, slice or
    expand."""
    v, b = tensor_val(view), tensor_val(base)
    if v is None or b is None:
        return False
    try:
        return (b.is_contiguous() and v.is_contiguous() and v.numel() == b.numel()
                and v.storage_offset() == b.storage_offset())
    except Exception:  # a size the fake tensor cannot decide on (symbolic): not provably the same
        return False


class _Cand:
    """A half-precision matmul the family may take: the mm node, its x and W, and the facts the chains need
    (`norm`: (h, norm weight or None, eps, mode) when x is an RMSNorm of h the op can compute itself)."""

    def __init__(self, mm: fx.Node, x: fx.Node, w: fx.Node, bias: fx.Node | None = None):
        self.mm, self.x, self.w, self.bias = mm, x, w, bias
        self.norm = None
        self.m, self.k = (int(d) for d in concrete_shape(tensor_val(x)))
        self.n = int(concrete_shape(tensor_val(w))[0])
        self.dtype = tensor_val(x).dtype
        self.out = _through_views(mm)


class HalfGemvFamily(FusionFamily):
    """Fuse bf16 / fp16 projections at M <= 8 into `dsv41::linear_half*` (module docstring)."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Rewrite every matching projection of `gm` in place; returns the matches and near-misses."""
        graph = gm.graph
        cands, misses = self._candidates(graph)
        matches = []
        gated = sorted(set(_OPS) & set(self.gated_ops))
        if cands and gated:
            # One kernel serves the three ops: on CUDA the family waits for its GPU tests as a whole.
            misses += [NearMiss(self.name, "mm(x half, permute(W half))", "gpu_unvalidated",
                                f"dsv41::{gated[0]} has not yet run on a GPU, so on CUDA this projection stays with "
                                "Inductor (option gpu_unvalidated=True fuses it)", SourceLocation.from_node(c.mm))
                       for c in cands]
            cands = []
        # Nodes a rewrite replaced -> their replacement: an RMSNorm prologue read later may name one as its input
        # (the next layer's norm reads the residual sum that a residual rewrite took over; with 2-D activations a
        # norm reads a projection's mm itself, which a sibling / single rewrite took over: without the entry the
        # prologue's reshape revived that mm, left with cuBLAS, while its fused op was dead code).
        self._moved = {}
        if cands:
            ev = RegionEvaluator(gm)
            stored = static_inputs(graph)
            norms: dict = {}
            for c in cands:
                key = _x_key(c.x)
                if key not in norms:
                    norms[key] = rms_prologue(c.x, c.k, c.dtype, ev, stored)
                c.norm = norms[key]
            taken: set = set()
            for gate, up, end, region in self._swiglus(cands, ev):
                if gate.mm in taken or up.mm in taken:
                    continue
                taken |= {gate.mm, up.mm}
                matches.append(self._fuse_swiglu(graph, gate, up, end, region))
            rest = [c for c in cands if c.mm not in taken]
            plain = []
            for c in rest:
                add = self._residual_add(c)
                if add is None:
                    plain.append(c)
                else:
                    matches.append(self._fuse_residual(graph, c, *add))
            groups: dict = {}
            for c in plain:  # siblings all with biases or all without: one op takes biases for all or none
                groups.setdefault((_x_key(c.x), c.dtype, c.bias is None), []).append(c)
            for members in groups.values():
                for i in range(0, len(members), _MAX_SIBLINGS):
                    chunk = members[i:i + _MAX_SIBLINGS]
                    if len(chunk) == 1:
                        matches.append(self._fuse_single(graph, chunk[0]))
                    else:
                        matches.append(self._fuse_siblings(graph, chunk))
            eliminate_dead_code(graph)
            graph.lint()
        return PassRecord(self.name, True, tuple(matches), tuple(misses))

    # ------------------------------------------------------------------------------------------------- finding
    def _candidates(self, graph: fx.Graph):
        """(candidates in graph order, near-misses) over every mm / addmm of a half-precision x."""
        written = mutated_inputs(graph)
        stored = static_inputs(graph)
        cands, misses = [], []
        pattern = "mm(x half, permute(W half))"
        for mm in graph.nodes:
            if mm.op != "call_function" or mm.target not in (aten.mm.default, aten.addmm.default):
                continue
            is_addmm = mm.target == aten.addmm.default
            x, rhs = mm.args[1:3] if is_addmm else mm.args[:2]
            xv = tensor_val(x) if isinstance(x, fx.Node) else None
            w = _transposed(rhs)
            if xv is None or w is None or xv.dtype not in _HALF or tensor_val(w).dtype != xv.dtype:
                continue
            shape = concrete_shape(xv)
            if shape[0] > _MAX_M:
                continue  # prefill-sized: cuBLAS's GEMM, by design
            loc = SourceLocation.from_node(mm)
            # `concrete_shape` gives hints, so it cannot tell a symbolic M (dynamic=True, or Dynamo's automatic
            # dynamic after a second length) from a static one: the rewrites bake [M, N] / [M, K] into reshapes
            # and the probes run at the hint, so a symbolic size stays with Inductor (the family used to raise on
            # such a graph, or would reshape at the compiled M).
            refusal = static_refusal(self.name, pattern, [x, w], loc, "dsv41::linear_half")
            if refusal is not None:
                misses.append(refusal)
                continue
            base = view_base(w)
            is_stored = base.op == "get_attr" or (base.op == "placeholder" and (stored is None or base in stored))
            if base in written or not is_stored:
                why = ("written in place by the graph" if base in written else
                       f"not a stored module tensor ({node_label(base)})")
                misses.append(NearMiss(self.name, pattern, "weight_source",
                                       f"the weight is {why}; dsv41::linear_half reads its weight before waiting "
                                       "on the previous kernel (PDL), so only weights no kernel of the step "
                                       "writes are fused", loc))
                continue
            bias = None
            if is_addmm:
                bias = mm.args[0]
                bv = tensor_val(bias) if isinstance(bias, fx.Node) else None
                n = concrete_shape(tensor_val(w))[0]
                scaled = mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1
                if bv is None or bv.dim() != 1 or bv.dtype != xv.dtype or concrete_shape(bv)[0] != n or scaled:
                    misses.append(NearMiss(self.name, pattern, "bias",
                                           "the projection adds a bias that is not one x-dtype value per output "
                                           "column (or scales it: alpha / beta), which dsv41::linear_half does not "
                                           "take; it stays with cuBLAS", loc))
                    continue
            cands.append(_Cand(mm, x, w, bias))
        return cands, misses

    def _swiglus(self, cands: list, ev: RegionEvaluator):
        """(gate, up, end node, region nodes) for each SwiGLU of two candidates of one x, graph order."""
        order = {n: i for i, n in enumerate(cands[0].mm.graph.nodes)}
        by_x: dict = {}
        for c in cands:
            by_x.setdefault((_x_key(c.x), c.dtype), []).append(c)
        found = []
        for members in by_x.values():
            for a_i, a in enumerate(members):
                for b in members[a_i + 1:]:
                    if a.n != b.n or a.bias is not None or b.bias is not None:
                        continue
                    hit = self._swiglu_end(a, b, order, ev)
                    if hit is not None:
                        found.append(hit)
        return found

    def _swiglu_end(self, a: _Cand, b: _Cand, order: dict, ev: RegionEvaluator):
        """(gate, up, end, region) when a node downstream of both matmuls computes silu(one) * other, else None."""
        reach_a = _forward(a.out, _SWIGLU_REACH)
        reach_b = _forward(b.out, _SWIGLU_REACH)
        for end in sorted(reach_a & reach_b, key=order.__getitem__):
            region = collect_region([end], [a.out, b.out])
            inner = [n for n in region if n is not end]
            if not all(n.op == "call_function" and (is_dataflow_op(n) or is_view_op(n)) for n in region):
                continue
            if not all(smooth(n) for n in region):
                return None  # a piecewise op the probes may never reach (`rms_prologue.SMOOTH_OPS`): no SwiGLU here
            if not all(set(u for u in n.users) <= set(region) for n in inner + [a.out, b.out]):
                continue
            ev_out = tensor_val(end)
            if ev_out is None or ev_out.dtype != a.dtype or tuple(ev_out.shape) != tuple(tensor_val(a.out).shape):
                continue
            roles = _swiglu_roles(ev, end, a, b)
            if roles is not None:
                return (*roles, end, region)
            return None  # the first node that joins the two is where a SwiGLU would end
        return None

    @staticmethod
    def _residual_add(c: _Cand):
        """(add node, residual) when the matmul's only consumer is `r + y` of one shape and dtype, else None."""
        if len(c.out.users) != 1:
            return None
        (add,) = c.out.users
        if add.op != "call_function" or add.target != aten.add.Tensor or add.kwargs.get("alpha", 1) != 1:
            return None
        if len(add.args) != 2 or not all(isinstance(a, fx.Node) for a in add.args):
            return None
        r = add.args[1] if add.args[0] is c.out else add.args[0]
        if r is c.out:
            return None
        rv, ov, av = tensor_val(r), tensor_val(c.out), tensor_val(add)
        if rv is None or rv.dtype != c.dtype or tuple(rv.shape) != tuple(ov.shape) or av.dtype != c.dtype:
            return None
        # r cannot depend on the matmul: the add is the only user of its output.
        return add, r

    # ---------------------------------------------------------------------------------------------- rewriting
    def _fuse_swiglu(self, graph, gate: _Cand, up: _Cand, end: fx.Node, region: list) -> MatchRecord:
        x, norm = _x_args(graph, gate, end, self._moved)
        y = insert_node(graph, end, dsv41_op("linear_half_silu_mul"), (x, gate.w, up.w, *norm), like=gate.mm)
        out = insert_node(graph, end, aten.reshape.default, (y, list(tensor_val(end).shape)), like=end)
        end.replace_all_uses_with(out)
        self._moved[end] = out
        nodes = [gate.mm, up.mm] + list(region)
        e = gate.dtype.itemsize
        rows, subs = _rows(gate)
        inner = sum(1 for n in region if isinstance(tensor_val(n), torch.Tensor))
        before = 2 * gate.n * gate.k * e + 2 * rows * gate.k * e + (2 + 2 * inner) * rows * gate.n * e
        after = 2 * gate.n * gate.k * e + rows * gate.k * e + rows * gate.n * e
        return self._record("swiglu", "dsv41::linear_half_silu_mul", gate.mm, nodes, before, after, subs,
                            (("N", gate.n), ("K", gate.k), ("launches_saved", 2), *_norm_detail(gate)))

    def _fuse_residual(self, graph, c: _Cand, add: fx.Node, r: fx.Node) -> MatchRecord:
        r2 = insert_node(graph, add, aten.reshape.default, (r, [c.m, c.n]), like=add)
        x, norm = _x_args(graph, c, add, self._moved)
        y = insert_node(graph, add, dsv41_op("linear_half"), (x, c.w, r2, *norm, *_bias_arg(c.bias)),
                        like=c.mm)
        out = insert_node(graph, add, aten.reshape.default, (y, list(tensor_val(add).shape)), like=add)
        add.replace_all_uses_with(out)
        self._moved[add] = out
        e = c.dtype.itemsize
        rows, subs = _rows(c)
        before = c.n * c.k * e + rows * c.k * e + 4 * rows * c.n * e
        after = c.n * c.k * e + rows * c.k * e + 2 * rows * c.n * e
        return self._record("residual", "dsv41::linear_half", c.mm, [c.mm, add], before, after, subs,
                            (("N", c.n), ("K", c.k), ("launches_saved", 1), *_norm_detail(c)))

    def _fuse_siblings(self, graph, group: list) -> MatchRecord:
        first = group[0]
        x, norm = _x_args(graph, first, first.mm, self._moved)
        biases = None if first.bias is None else [c.bias for c in group]
        multi = insert_node(graph, first.mm, dsv41_op("linear_half_multi"), (x, [c.w for c in group], *norm,
                                                                           *_bias_arg(biases)),
                            like=first.mm)
        for i, c in enumerate(group):
            y = insert_node(graph, first.mm, operator.getitem, (multi, i), like=c.mm)
            c.mm.replace_all_uses_with(y)
            self._moved[c.mm] = y
        e = first.dtype.itemsize
        rows, subs = _rows(first)
        weights = sum(c.n * c.k for c in group) * e
        outs = sum(rows * c.n for c in group) * e
        before = weights + len(group) * rows * first.k * e + outs
        after = weights + rows * first.k * e + outs
        return self._record("siblings", "dsv41::linear_half_multi", first.mm, [c.mm for c in group], before, after,
                            subs, (("N", tuple(c.n for c in group)), ("K", first.k),
                                   ("launches_saved", len(group) - 1), *_norm_detail(first)))

    def _fuse_single(self, graph, c: _Cand) -> MatchRecord:
        x, norm = _x_args(graph, c, c.mm, self._moved)
        y = insert_node(graph, c.mm, dsv41_op("linear_half"), (x, c.w, None, *norm, *_bias_arg(c.bias)),
                        like=c.mm)
        c.mm.replace_all_uses_with(y)
        self._moved[c.mm] = y
        e = c.dtype.itemsize
        rows, subs = _rows(c)
        total = c.n * c.k * e + rows * c.k * e + rows * c.n * e
        return self._record("linear", "dsv41::linear_half", c.mm, [c.mm], total, total, subs,
                            (("N", c.n), ("K", c.k), ("launches_saved", 0), *_norm_detail(c)))

    def _record(self, chain, op, anchor, nodes, before, after, subs, detail) -> MatchRecord:
        return MatchRecord(self.name, f"{chain}({tensor_val(anchor).dtype})", op, SourceLocation.from_node(anchor),
                           tuple(n.name for n in nodes), tuple(node_label(n) for n in nodes),
                           str(sympy.expand(before)), str(sympy.expand(after)), tuple(sorted(subs.items())), detail)


def _x_args(graph: fx.Graph, c: _Cand, before: fx.Node, moved: dict):
    """(x operand, norm arguments) of a fused op for `c`: x itself and (None, 0.0, 0), or the RMSNorm's input h as
    [M, K] and (norm weight, eps, mode) when the op computes the norm (`rms_prologue`); `moved` maps nodes that
    earlier rewrites replaced to their replacements."""
    if c.norm is None:
        return c.x, (None, 0.0, 0)
    h, nw, eps, mode = c.norm
    while h in moved:
        h = moved[h]
    h2 = insert_node(graph, before, aten.reshape.default, (h, [c.m, c.k]), like=c.mm)
    return h2, (nw, eps, mode)


def _bias_arg(bias) -> tuple:
    """The op's trailing bias argument: none without a bias (the graph reads as before biases were taken)."""
    return () if bias is None else (bias,)


def _norm_detail(c: _Cand) -> tuple:
    """The record's detail entries of the RMSNorm prologue (none without one)."""
    if c.norm is None:
        return ()
    return (("rms_norm_eps", c.norm[2]), ("rms_norm_mode", c.norm[3]), ("launches_saved_norm", 1))


def _forward(start: fx.Node, limit: int) -> set:
    """Nodes reachable from `start` through at most `limit` dataflow / view ops."""
    seen, frontier = set(), [start]
    for _ in range(limit):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u not in seen and u.op == "call_function" and (is_dataflow_op(u) or is_view_op(u)):
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return seen


def _swiglu_roles(ev: RegionEvaluator, end: fx.Node, a: _Cand, b: _Cand):
    """(gate, up) when `end` equals F.silu(gate) * up in the matmuls' dtype on probe values, else None."""
    shape = tuple(tensor_val(a.out).shape)
    gen = torch.Generator().manual_seed(0)
    probes = []
    for scale in (1.0, 6.0):
        g = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(a.dtype)
        u = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(a.dtype)
        probes.append((g, u))
    for gate, up in ((a, b), (b, a)):
        try:
            ok = all(_within_roundings(ev.evaluate([end], {gate.out: g, up.out: u})[end], F.silu(g) * u)
                     for g, u in probes)
        except Exception:  # a region the probes cannot run (not closed, an op that raises): not this chain
            ok = False
        if ok:
            return gate, up
    return None


def _within_roundings(got, ref: torch.Tensor) -> bool:
    """`got` equals `ref` up to three roundings of its dtype: a spelling that rounds sigmoid(g) and g * sigmoid(g)
    separately (`g * torch.sigmoid(g)` in bf16) differs from F.silu's one rounding by about an ulp; any other
    activation (GELU, ReLU, a scaled silu) differs by far more on these probes."""
    eps = torch.finfo(ref.dtype).eps
    return close(got, ref, 3 * eps, 3 * eps * 0.05 * float(ref.double().abs().max()))


def _rows(c: _Cand):
    """(rows as a sympy expression in B and L, their compiled values) of the matmul's activation."""
    node = c.x
    for _ in range(4):
        if not (isinstance(node, fx.Node) and node.op == "call_function" and is_view_op(node) and node.args):
            break
        node = node.args[0]
        shp = concrete_shape(tensor_val(node)) if isinstance(node, fx.Node) and tensor_val(node) is not None else ()
        if shp and len(shp) >= 2:
            lead = shp[:-1]
            prod = 1
            for d in lead:
                prod *= int(d)
            if prod == c.m:
                return token_rows(lead)
    return token_rows((c.m,))
