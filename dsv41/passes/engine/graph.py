"""Facts about graph nodes that every family reads: values and shapes (hints for symbolic sizes), op classes
(which ops a fusible region may contain), the nodes fed by graph inputs, module tensors, dead-code elimination."""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable

import sympy
import torch
import torch.fx as fx

from ..records import BATCH, LENGTH

__all__ = ["token_rows", "size_hint", "tensor_val", "concrete_shape", "same_shape", "node_label", "group_in_order",
           "group_by_key", "dsv41_op", "is_view_op", "is_reshape", "is_dataflow_op", "is_table_lookup", "sourced_nodes",
           "eliminate_dead_code", "static_inputs", "shape_of", "dtype_of", "is_float", "is_shape_value", "is_step",
           "positions", "is_small_constant", "call_arg"]


def token_rows(leading: Iterable[int]) -> tuple[sympy.Expr, dict[str, int]]:
    """Rows of an activation with leading dims `leading`, as a sympy expression in `B` and `L`.

    Convention of every dsv41 byte expression: leading dim 0 is the batch `B`; leading dim 1 (when present)
    is the sequence extent of the step `L` (1 at decode, the prompt length at prefill); further leading
    dims (heads) are constants. Returns (expression, {"B": value, "L": value} for the compiled shapes).
    """
    dims = [int(d) for d in leading]
    if not dims:
        return sympy.Integer(1), {}
    expr = BATCH
    subs = {"B": dims[0]}
    if len(dims) >= 2:
        expr = expr * LENGTH
        subs["L"] = dims[1]
    for d in dims[2:]:
        expr = expr * d
    return expr, subs


def size_hint(v):
    """A concrete Python number for an int / float, or for a SymInt / SymFloat its hint (no guard is added)."""
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        node = v.node
        hint = getattr(node, "hint", None)
        if hint is None:
            hint = node.shape_env.size_hint(node.expr)
        return type(hint)(hint) if not isinstance(hint, sympy.Basic) else int(hint)
    return v


def tensor_val(node: Any) -> torch.Tensor | None:
    """The FakeTensor in `node.meta["val"]`, or None for non-nodes and non-tensor values."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def concrete_shape(val: torch.Tensor) -> tuple[int, ...]:
    """Shape of a (fake) tensor with symbolic sizes replaced by their hints."""
    return tuple(int(size_hint(s)) for s in val.shape)


def same_shape(a, b) -> bool:
    """Whether two (possibly symbolic) shapes are provably equal, without adding guards."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def node_label(node: fx.Node) -> str:
    """Short printable op name: `aten.mul.Tensor`, `prims.convert_element_type.default`, `getitem`."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}.{t._overloadname}"
    return getattr(t, "__name__", str(t))


def group_in_order(nodes: Iterable[fx.Node], mismatch: Callable, most: int) -> tuple[list[list[fx.Node]], dict]:
    """Greedy groups of `nodes` (graph order) for the horizontal families (`grouped_pair`, `sibling_gemv`): each node
    joins the first open group whose first member accepts it (`mismatch(first, node)` is None), else opens one; a
    group closes at `most` members. Returns (the groups of two or more, {node: (check, reason)} of the first
    refusal each refused node met, for near-misses of the nodes left alone)."""
    groups, open_groups, why_not = [], [], {}
    for n in nodes:
        home = None
        for grp in open_groups:
            why = mismatch(grp[0], n)
            if why is None:
                home = grp
                break
            why_not.setdefault(n, why)
        if home is None:
            open_groups.append([n])
            continue
        home.append(n)
        if len(home) == most:
            open_groups.remove(home)
            groups.append(home)
    return groups + [g for g in open_groups if len(g) > 1], why_not


def group_by_key(lists: Iterable[list], mismatch: Callable, most: int,
                 admit: Callable | None = None) -> tuple[list[list[fx.Node]], dict]:
    """`group_in_order` over each list of `lists` (nodes sharing a key, e.g. one activation) of two or more nodes,
    after `admit(node)` (None, or the (check, reason) that keeps a node out of every group). Returns (all groups,
    {node: (check, reason)} for the refused nodes that ended in no group), refusals in the order they were met."""
    groups, why_not = [], {}
    for nodes in lists:
        if len(nodes) < 2:
            continue
        fits = []
        for n in nodes:
            why = admit(n) if admit is not None else None
            if why is None:
                fits.append(n)
            else:
                why_not[n] = why
        found, refused = group_in_order(fits, mismatch, most)
        groups += found
        why_not.update(refused)
    grouped = {n for g in groups for n in g}
    return groups, {n: why for n, why in why_not.items() if n not in grouped}


def dsv41_op(name: str):
    """`torch.ops.dsv41.<name>.default`, or None when that op is not registered (kernels not imported)."""
    ns = torch.ops.dsv41
    return getattr(ns, name).default if hasattr(ns, name) else None


_REDUCTION_TAG = getattr(torch.Tag, "reduction", None)
_NONDET_TAG = getattr(torch.Tag, "nondeterministic_seeded", None)
_aten = torch.ops.aten
#: Non-pointwise, non-view ops that still compute a pure function of their tensor inputs without reading
#: data-dependent addresses: concatenation, copies, repeats, and constant factories.
_EXTRA_DATAFLOW = {
    _aten.cat.default, _aten.stack.default, _aten.clone.default, _aten._to_copy.default,
    _aten.repeat.default, _aten.repeat_interleave.self_int, _aten.lift_fresh_copy.default,
    _aten.full.default, _aten.full_like.default, _aten.zeros_like.default, _aten.ones_like.default,
    _aten.scalar_tensor.default, _aten.arange.start, _aten.arange.default, _aten.arange.start_step,
    _aten.amax.default, _aten.amin.default, _aten.sum.dim_IntList, _aten.mean.dim,
    torch.ops.prims.iota.default, torch.ops.prims.convert_element_type.default,
}


def is_view_op(node: fx.Node) -> bool:
    """True for ATen view ops (`OpOverload.is_view`: view, slice, select, permute, expand, ...; not `reshape` or
    `_unsafe_view`, which may copy: `is_reshape`)."""
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.is_view


_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def is_reshape(node: fx.Node) -> bool:
    """True for `view` / `reshape` / `_unsafe_view` of a tensor: the same values in the same order, another shape."""
    return node.op == "call_function" and node.target in _RESHAPES


def is_dataflow_op(node: fx.Node) -> bool:
    """True when `node` computes a deterministic function of its tensor inputs by pointwise math, views,
    reductions, concatenation or constant factories — the ops a fusible region may contain. Matmuls,
    gathers/scatters, mutations, random ops and custom ops are excluded."""
    if node.op != "call_function":
        return False
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if _NONDET_TAG is not None and _NONDET_TAG in t.tags:
        return False
    if t._schema.is_mutable:
        return False
    if t.is_view or t in _EXTRA_DATAFLOW or torch.Tag.pointwise in t.tags:
        return True
    return _REDUCTION_TAG is not None and _REDUCTION_TAG in t.tags


def is_table_lookup(node: fx.Node) -> bool:
    """`aten.index.Tensor(table, [idx, ...])`: a gather, which a region may contain only when `table` is a
    constant (the caller checks that), e.g. decoding E2M1 codes through the 16-entry value table."""
    return node.op == "call_function" and node.target == _aten.index.Tensor


def sourced_nodes(graph: fx.Graph) -> set:
    """Nodes that depend on a graph input or on a large constant; every other node is a constant factory
    (arange, full, a small lifted table) that a region may recompute freely."""
    out = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            out.add(n)
        elif n.op == "get_attr":
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor) or v.numel() > 256:
                out.add(n)
        elif any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def eliminate_dead_code(graph: fx.Graph) -> bool:
    """`graph.eliminate_dead_code()` with the same rule (erase a node that has no users and no side effect, also in
    subgraphs), asking `Node.is_impure` only of nodes without users.

    Why: torch asks every node first, and for a custom op that check (`torch._library.utils.is_impure`) is slow:
    on `small`'s whole decode graph (CPU, cProfile) 18 calls made 287,515 checks, 8.9 s of dsv41's 63.6 s of
    passes. The node's users are looked at first here, so only the few dead candidates pay for it (in the graph
    itself: torch's recursion into subgraphs keeps its own order; dsv41's decode graphs have none).
    Returns: whether anything was erased. Source: torch/fx/graph.py `Graph.eliminate_dead_code`.
    """
    from torch._guards import TracingContext
    from torch._inductor import config as inductor_config

    impure_random = True
    if TracingContext.try_get():  # what torch's own DCE decides for random ops
        impure_random = inductor_config.fallback_random
    return graph.eliminate_dead_code(is_impure_node=lambda n: bool(n.users) or n.is_impure(impure_random))


def static_inputs(graph: fx.Graph) -> set[fx.Node] | None:
    """Placeholders of `graph` that AOT autograd marks static for the running compile: the parameters, buffers
    and other module tensors Dynamo lifted into graph inputs (`ViewAndMutationMeta.static_input_indices`, the
    inputs CUDA-graph trees leave in place), as opposed to activations and other user inputs.

    None (callers must then not rely on it) when no compile is running, the installed torch does not say, the compile
    is a training one (a backward graph would see the forward's metadata), or `graph` is not the graph that metadata
    describes: its placeholder count differs from the forward's inputs (Inductor runs the post-grad passes on the
    subgraphs of `cond` / `invoke_subgraph` too, under the same metadata) or an index falls outside it.

    Static does not mean unwritten: a module tensor written by an earlier graph (after a graph break, or by an earlier
    region of a regional compile) is static here too; `small_ops.mutated_inputs` sees only this graph's writes.

    Why: a placeholder alone does not tell a weight from an activation, and in a regional compile one region's
    inputs are the previous region's outputs, written by the kernel just before in the same CUDA graph. Source:
    torch/_functorch/_aot_autograd/schemas.py (`static_input_indices`, `input_info`, `tokens`,
    `num_graphsafe_rng_states`, `traced_tangents`); torch/_inductor/
    compile_fx.py (`get_static_input_idxs`).
    """
    from torch._guards import TracingContext

    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    idx = getattr(meta, "static_input_indices", None)
    if idx is None or getattr(meta, "traced_tangents", None):  # tangents: a training (joint) compile
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    n_inputs = (len(getattr(meta, "input_info", ())) + len(getattr(meta, "tokens", ()) or ())
                + (getattr(meta, "num_graphsafe_rng_states", 0) or 0))
    if len(placeholders) != n_inputs or any(not 0 <= i < n_inputs for i in idx):
        return None
    return {placeholders[i] for i in idx}


def shape_of(n) -> tuple | None:
    """Concrete shape (hints for symbolic sizes) of a node's tensor value; None for non-tensor nodes and non-nodes."""
    v = tensor_val(n)
    return concrete_shape(v) if v is not None else None


def dtype_of(n) -> torch.dtype | None:
    """dtype of a node's tensor value; None for non-tensor nodes and non-nodes."""
    v = tensor_val(n)
    return v.dtype if v is not None else None


def is_float(n) -> bool:
    """Whether the node holds a floating-point tensor."""
    v = tensor_val(n)
    return v is not None and v.is_floating_point()


def positions(graph: fx.Graph) -> dict:
    """node -> its index in graph order (for sorting regions and breaking ties between candidates)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def is_shape_value(n: fx.Node) -> bool:
    """Shape arithmetic (a SymInt / int node): evaluated from the compiled shapes, never from tensor data."""
    return isinstance(n.meta.get("val"), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def is_step(n: fx.Node, extra: frozenset | set = frozenset()) -> bool:
    """A node a region may contain: a dataflow op, a constant-table lookup, a call of one of the `extra` targets
    (a family's deterministic non-dataflow ops: matmuls, top-k), or an item of such an op's tuple result
    (`split` / `unbind` / `topk`)."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and (is_dataflow_op(src) or src.target in extra)
    return is_dataflow_op(n) or is_table_lookup(n) or n.target in extra


def is_small_constant(n: fx.Node, most: int = 256) -> bool:
    """A `get_attr` tensor of at most `most` elements (a lifted table a region may read like a literal)."""
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.numel() <= most


def call_arg(n: fx.Node, i: int, name: str, default):
    """Argument `i` of call `n`, given positionally or as keyword `name`, else `default`."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)
