"""Graph editing shared by the families: inserting a node with its fake value and provenance, symbolic size
arguments, and the snapshot / restore that undoes a family that raised."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch
import torch.fx as fx

from .graph import tensor_val

__all__ = ["insert_node", "size_args", "snapshot_graph", "restore_graph", "GraphFingerprint"]


def _fake_mode_of(nodes: Iterable[fx.Node]):
    from torch._guards import detect_fake_mode
    vals = []
    for n in nodes:  # a multi-output op's value is a tuple of tensors (its getitem users read one)
        v = n.meta.get("val") if isinstance(n, fx.Node) else None
        vals.extend(x for x in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(x, torch.Tensor))
    mode = detect_fake_mode(vals)
    if mode is None:
        from torch._inductor.virtualized import V
        mode = V.fake_mode
    return mode


def insert_node(graph: fx.Graph, before: fx.Node, target: Callable, args: tuple, kwargs: Mapping | None = None,
                like: fx.Node | None = None) -> fx.Node:
    """Insert `target(*args, **kwargs)` before `before`, with `meta["val"]` computed by running `target` on the
    inputs' fake values (so Inductor's lowering and later passes see shapes), and the stack trace, module stack
    and `from_node` provenance of `like` (the matched anchor), so the report still points at the user's line and
    counts the new node's kernel in the anchor's layer (`dsv41/compiler/kernel_counts.py`)."""
    kwargs = dict(kwargs or {})
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    inputs = node.all_input_nodes
    mode = _fake_mode_of(inputs)

    def conv(a):
        """Fake value of a node argument (other arguments unchanged)."""
        return a.meta["val"] if isinstance(a, fx.Node) else a

    fargs = fx.node.map_aggregate(args, conv)
    fkwargs = fx.node.map_aggregate(kwargs, conv)
    with mode:
        node.meta["val"] = target(*fargs, **fkwargs)
    if like is not None:
        # from_node too: Inductor's kernel provenance (and the "Source Nodes" comments of the generated code)
        # follow it back to the Dynamo graph, which is how the report attributes launches to layers.
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


def size_args(graph: fx.Graph, before: fx.Node, src: fx.Node, dims: Iterable[int]) -> list:
    """Sizes `src.shape[d]` for `d` in `dims` as graph arguments: ints when static, `aten.sym_size.int` nodes
    (inserted before `before`) when symbolic, so a new `expand` / `reshape` stays valid under dynamic shapes."""
    val = tensor_val(src)
    out: list = []
    for d in dims:
        s = val.shape[d]
        if isinstance(s, torch.SymInt):
            out.append(insert_node(graph, before, torch.ops.aten.sym_size.int, (src, d)))
        else:
            out.append(int(s))
    return out


def snapshot_graph(graph: fx.Graph) -> fx.Graph:
    """A node-for-node copy of `graph` (names, targets, arguments, shallow-copied meta) to restore from."""
    copy = fx.Graph()
    env: dict = {}
    for n in graph.nodes:
        env[n] = copy.node_copy(n, env.__getitem__)
    return copy


class GraphFingerprint:
    """The identity of every node of a graph and of its argument tuples, in order: equal before and after a family
    that changed nothing, so a snapshot need not be taken again.

    FX keeps a node's args / kwargs as immutable containers and every edit (`node.args = ...`, `replace_input_with`,
    `replace_all_uses_with`) installs new ones, so comparing by identity sees every change; the objects are held
    here, so an id cannot be reused meanwhile. On `tiny`'s 11,127-node decode graph this takes milliseconds, where a
    hash of the nodes' printed arguments took 0.40 s (more than copying the graph, 0.37 s)."""

    def __init__(self, graph: fx.Graph):
        self._items = [(n, n.args, n.kwargs, n.target) for n in graph.nodes]

    def same(self, graph: fx.Graph) -> bool:
        """Whether `graph` still has exactly these nodes, in this order, with these argument objects and targets."""
        if len(graph.nodes) != len(self._items):
            return False
        return all(n is a and n.args is b and n.kwargs is c and n.target is d
                   for n, (a, b, c, d) in zip(graph.nodes, self._items))


def restore_graph(graph: fx.Graph, snap: fx.Graph) -> None:
    """Make `graph` (in place: Inductor keeps using this object) node-for-node equal to `snap`, names included.

    A family that raised may have left the graph with dangling users or out of order, so every node's arguments are
    cleared before any is erased; the name table is reset so the copies get their old names back."""
    from torch.fx.graph import _Namespace

    nodes = list(graph.nodes)
    for n in nodes:
        n.args, n.kwargs = (), {}
    for n in reversed(nodes):
        graph.erase_node(n)
    graph._graph_namespace = _Namespace()
    env: dict = {}
    for n in snap.nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
