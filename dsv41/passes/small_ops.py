"""`small_ops` family: per-step index and mask math that every layer repeats is computed once and shared.

Every attention layer of dsv41/model derives the same tensors from the step's positions: the window-ring
positions and slot (`Attention._ring_positions`, `_write_ring`: `remainder(p, W)`), the visibility mask of
the window (`ok = kpos >= 0 & kpos <= q & kpos > q - W`), the batch-row index `arange(B)[:, None]`, the
visible bank rows (`csa.visible_rows`) and the casts of the positions that feed the RoPE angles. Eager code
recomputes them per layer; the post-grad graph keeps one copy per layer (Inductor has no cross-layer CSE),
each becoming its own loop or kernel prologue. (`dsv41 report --patterns small_ops`.)

What this pass does — a structural common-subexpression elimination restricted to STEP REGIONS:

- A *leaf* is a constant (`get_attr`, or a factory with no tensor input: `iota`, `full`), or a graph input
  (placeholder) that the graph never writes and whose dtype is wider than one byte (1-byte inputs are FP8 / FP4
  codes and scales: their dequantisation chains belong to `dispatch`, which must see them unshared).
- A *step node* is a pure dataflow op (`base.is_dataflow_op`: pointwise, views, reductions, cat, casts,
  factories — no random op, no mutation, no custom op, no matmul) whose tensor inputs are leaves or step nodes,
  and that depends on an integer graph input (positions, token ids) or on no graph input at all.
- Two step nodes are equal when they have the same target and the same arguments after mapping every node
  argument to the first instance already found equal (value numbering in graph order). Literals compare by
  type and value (`16` ≠ `16.0` ≠ `True`). Equality is proven from the graph's structure alone, never from
  names or from the values a buffer happens to hold at compile time.
- Each later duplicate is replaced by the first instance, which precedes it in graph order, so the graph stays
  topologically sorted. Duplicates are grouped into connected regions; each region is one `MatchRecord`
  (`shared_step_value(<kind>)`, location = the duplicate's source line, `detail["kept"]` = the first
  instance's line, `nodes_replaced` = the removed nodes).

Near-misses (reported, never merged), each at the first node where the two copies diverge:

    mutated_input     the same op on the same arguments, but it reads a graph input the graph writes in place
                      (`copy_`, `index_put_`, any mutable op): caches change between steps, so such reads are
                      never shared, even when the functional graph would allow it.
    distinct_input    the same op on the same step values, but one argument is a different graph input (e.g. a
                      per-layer RoPE frequency buffer): equal values cannot be proven from the graph.
    constant_differs  a region of >= 2 compute ops that repeats an earlier region op for op but with another
                      literal (e.g. a window of 8 instead of 16, ratio 1 instead of 2).

Source: dsv41/model/attention.py (`forward`, `_ring_positions`, `_write_ring`), dsv41/model/csa.py
(`visible_rows`), dsv41/model/rope.py (`RotaryEmbedding.forward`); MODEL.md §2.2, §2.4, §2.7.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .records import MatchRecord, NearMiss, PassRecord, SourceLocation
from .engine import FusionFamily, is_dataflow_op, is_view_op, node_label, register_family, tensor_val

__all__ = ["SmallOpsFamily", "SPEC", "mutated_inputs", "is_index_input", "step_nodes", "view_base"]

_aten = torch.ops.aten
_INDEX_DTYPES = (torch.int32, torch.int64, torch.bool)
_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge", "bitwise_and", "bitwise_or", "logical_and", "logical_or",
            "logical_not", "where"}
_TRIG = {"cos", "sin"}
#: Ops that never count as "compute" when sizing a region for the constant_differs near-miss.
_SHAPE_ONLY = {"unsqueeze", "squeeze", "expand", "view", "reshape", "slice", "select", "permute", "clone",
               "convert_element_type", "_to_copy", "alias"}


def _op_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def view_base(node: fx.Node) -> fx.Node:
    """The tensor that owns `node`'s storage: `node` followed back through view ops (at most 64)."""
    # A mutation through a view writes its base, so the base is what a mutation check must look at.
    seen = 0
    while is_view_op(node) and node.args and isinstance(node.args[0], fx.Node) and seen < 64:
        node, seen = node.args[0], seen + 1
    return node


def mutated_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Graph inputs (placeholders) that some node may write in place.

    Conservative: every tensor argument of an op with a mutable schema (`copy_`, `index_put_`, `add_`, ...)
    counts as written, and so does every tensor argument of a call that is not an ATen/prims `OpOverload`
    (higher-order ops such as `auto_functionalized`, `with_effects`; `operator.getitem` excepted), each
    followed back through views to its base. Returns the set of placeholder nodes.
    """
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        t = n.target
        if isinstance(t, torch._ops.OpOverload) and not t._schema.is_mutable:
            continue
        for a in n.all_input_nodes:
            base = view_base(a)
            if base.op == "placeholder":
                out.add(base)
    return out


def is_index_input(node: fx.Node, mutated: set[fx.Node]) -> bool:
    """A graph input holding the step's indices: an int32 / int64 / bool placeholder the graph never writes."""
    val = tensor_val(node)
    return node.op == "placeholder" and node not in mutated and val is not None and val.dtype in _INDEX_DTYPES


def step_nodes(graph: fx.Graph, mutated: set[fx.Node]) -> set[fx.Node]:
    """Pure dataflow nodes (`base.is_dataflow_op`) whose every tensor input is an index input (`is_index_input`),
    a `get_attr` constant or another step node: the candidates for sharing. `mutated` is `mutated_inputs(graph)`."""
    ok: set[fx.Node] = set()
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "get_attr" or is_index_input(n, mutated):
            ok.add(n)
        elif is_dataflow_op(n) and all(a in ok for a in n.all_input_nodes):
            ok.add(n)
            out.add(n)
    return out


def _literal(a: Any) -> Any:
    # bool is an int and 1 == 1.0 in Python: tag literals by type so `16`, `16.0` and `True` never compare equal.
    if isinstance(a, float) and a != a:
        return ("float", "nan")
    if isinstance(a, (bool, int, float, str, type(None))):
        return (type(a).__name__, a)
    if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(a).__name__, str(a))
    return ("repr", type(a).__name__, repr(a))


def _key(node: fx.Node, canon: dict[fx.Node, fx.Node], wild: set[fx.Node] = frozenset(),
         wild_literals: bool = False):
    """Hashable structural key of `node`: target + arguments with nodes mapped to their canonical instance.
    Nodes in `wild` become a placeholder mark; with `wild_literals` every literal becomes a mark too."""
    def conv(a):
        """An argument as a hashable key: `wild` nodes as ("input",), other nodes by their canonical instance,
        containers element-wise, literals as themselves (or one mark with `wild_literals`)."""
        if isinstance(a, fx.Node):
            if a in wild:
                return ("input",)
            return ("node", id(canon.get(a, a)))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__,) + tuple(conv(x) for x in a)
        if isinstance(a, dict):
            return ("dict",) + tuple(sorted((k, conv(v)) for k, v in a.items()))
        return ("lit",) if wild_literals else _literal(a)

    return (node.op, node.target, conv(tuple(node.args)), conv(dict(node.kwargs)))


def _kind(nodes: list[fx.Node]) -> str:
    """Short label of a region by the ops it holds (for the report only; equality never depends on it)."""
    ops = {_op_name(n) for n in nodes}
    if ops & _TRIG:
        return "rope_angles"
    if ops & _COMPARE:
        return "visibility_mask"
    if "remainder" in ops:
        return "ring_slot"
    if "div" in ops or "floor_divide" in ops:
        return "index_math"
    if ops <= {"iota", "arange", "full", "scalar_tensor"} | _SHAPE_ONLY:
        return "index_constants" if ops & {"iota", "arange", "full", "scalar_tensor"} else "position_views"
    return "position_math"


def _nbytes(node: fx.Node) -> int:
    val = tensor_val(node)
    if val is None:
        return 0
    try:
        return int(val.numel()) * val.dtype.itemsize
    except Exception:  # symbolic numel: not part of the decode graphs this family targets
        return 0


def _describe(node: fx.Node) -> str:
    val = tensor_val(node)
    if val is None:
        return "not a tensor"
    return f"{str(val.dtype).replace('torch.', '')} {list(val.shape)}"


def _where(node: fx.Node | None) -> str:
    loc = SourceLocation.from_node(node)
    return loc.short() if loc is not None else (node.name if node is not None else "?")


def _first_literal_difference(a: fx.Node, b: fx.Node, canon: dict, depth: int = 0):
    """Walk two structurally equal trees in parallel and return (node, old literal, new literal) of the first
    literal that differs, or None."""
    if depth > 64:
        return None

    def flat(x):
        """Every leaf of a nested list / tuple argument, in order."""
        if isinstance(x, (list, tuple)):
            for y in x:
                yield from flat(y)
        elif isinstance(x, dict):
            for k in sorted(x):
                yield from flat(x[k])
        else:
            yield x

    for x, y in zip(flat((a.args, a.kwargs)), flat((b.args, b.kwargs))):
        if isinstance(x, fx.Node) and isinstance(y, fx.Node):
            if canon.get(x, x) is canon.get(y, y):
                continue
            found = _first_literal_difference(canon.get(x, x), canon.get(y, y), canon, depth + 1)
            if found is not None:
                return found
        elif not isinstance(x, fx.Node) and not isinstance(y, fx.Node) and _literal(x) != _literal(y):
            return a, x, y
    return None


#: The family as data (`dsv41 report --patterns`).
SPEC = register_family(
    "small_ops", "compute per-step index and mask math (ring slot, visibility, positions) once and share it")


class SmallOpsFamily(FusionFamily):
    """Share per-step index / mask math across layers (see module docstring); one match per shared region."""

    spec = SPEC

    def run(self, gm: fx.GraphModule) -> PassRecord:
        """Merge duplicate step nodes of `gm.graph` into their first instance; record regions and near-misses.

        Raises nothing on an unmatched graph (returns an empty record). The graph stays valid and sorted.
        """
        graph = gm.graph
        mutated = mutated_inputs(graph)
        step = step_nodes(graph, mutated)
        canon: dict[fx.Node, fx.Node] = {}
        table: dict[Any, fx.Node] = {}
        wild_table: dict[Any, fx.Node] = {}
        blocked_table: dict[Any, fx.Node] = {}
        misses: list[NearMiss] = []
        missed: set[tuple[str, Any]] = set()

        def miss(check: str, node: fx.Node, first: fx.Node, reason: str) -> None:
            """Record near-miss `check` at `node` once per group (keyed by the group's first node)."""
            tag = (check, id(first))
            if tag in missed:
                return
            missed.add(tag)
            misses.append(NearMiss(self.name, f"shared_step_value({_op_name(node)})", check, reason,
                                   SourceLocation.from_node(node)))

        placeholders = {n for n in graph.nodes if n.op == "placeholder"}
        tables = {n for n in placeholders if n not in mutated and not is_index_input(n, mutated)}
        for n in list(graph.nodes):
            if n in step:
                k = _key(n, canon)
                first = table.get(k)
                if first is not None:
                    canon[n] = first
                    continue
                table[k] = n
                continue
            if (n.op == "call_function" and is_dataflow_op(n) and any(a in step for a in n.all_input_nodes)
                    and any(a in tables for a in n.all_input_nodes)
                    and all(a in step or a in tables or a.op == "get_attr" for a in n.all_input_nodes)):
                # A step value combined with a non-index input (a per-layer RoPE frequency table): report only.
                other = wild_table.setdefault(_key(n, canon, wild=tables), n)
                if other is not n:
                    ins = sorted({f"{a.name} ({_describe(a)})" for a in n.all_input_nodes if a in tables})
                    miss("non_index_input", n, other,
                         f"{node_label(n)} repeats {_where(other)} on the same step values but also reads "
                         f"{', '.join(ins)}, a graph input that is not an index input: only functions of the "
                         f"step's positions / token ids and constants are shared")
                continue
            # A pure op that only a mutated input keeps out of the step set: report a repeat, never merge it.
            if (n.op == "call_function" and is_dataflow_op(n) and n.all_input_nodes
                    and any(view_base(a) in mutated for a in n.all_input_nodes)
                    and all(a in step or a in placeholders or a.op == "get_attr" or view_base(a) in mutated
                            for a in n.all_input_nodes)):
                k = _key(n, canon)
                other = blocked_table.setdefault(k, n)
                if other is not n:
                    bufs = sorted({view_base(a).name for a in n.all_input_nodes if view_base(a) in mutated})
                    miss("mutated_input", n, other,
                         f"{node_label(n)} repeats {_where(other)} exactly but reads {', '.join(bufs)}, a graph "
                         f"input the graph writes in place: reads of mutated buffers are never shared")

        dups = [n for n in graph.nodes if n in canon]
        matches = self._regions(dups, canon, step)
        misses += self._constant_differs(graph, step, canon)
        for n in dups:
            n.replace_all_uses_with(canon[n])
        for n in reversed(dups):
            if not n.users:
                graph.erase_node(n)
        note = "" if dups else "no per-step value is computed twice"
        return PassRecord(self.name, True, tuple(matches), tuple(misses), note=note)

    def _regions(self, dups: list[fx.Node], canon: dict, step: set) -> list[MatchRecord]:
        """Group duplicates into connected regions (through their arguments) and build one record per region."""
        dupset = set(dups)
        parent = {n: n for n in dups}

        def find(x):
            """Union-find root of `x`, halving the path on the way."""
            while parent[x] is not x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for n in dups:
            for a in n.all_input_nodes:
                if a in dupset:
                    parent[find(a)] = find(n)
        groups: dict[fx.Node, list[fx.Node]] = {}
        for n in dups:  # graph order
            groups.setdefault(find(n), []).append(n)
        out = []
        for nodes in groups.values():
            # Outputs of the region: duplicates read by a node outside the region (their bytes are no longer
            # recomputed/written per layer).
            outs = [n for n in nodes if any(u not in dupset for u in n.users)] or nodes[-1:]
            root = outs[-1]
            kept = canon[root]
            before = sum(_nbytes(n) for n in outs)
            reads = sorted({a.name for n in nodes for a in n.all_input_nodes
                            if a.op in ("placeholder", "get_attr")} |
                           {a.name for n in nodes for a in canon[n].all_input_nodes if a.op == "placeholder"})
            detail = (("kind", _kind(nodes)), ("nodes", len(nodes)), ("kept", _where(kept)),
                      ("kept_node", kept.name), ("reads", ", ".join(reads)))
            out.append(MatchRecord(self.name, f"shared_step_value({_kind(nodes)})", "reuse first instance",
                                   SourceLocation.from_node(root), tuple(n.name for n in nodes),
                                   tuple(node_label(n) for n in nodes), str(before), "0", (), detail))
        return out

    def _constant_differs(self, graph: fx.Graph, step: set, canon: dict) -> list[NearMiss]:
        """Regions that repeat an earlier region op for op with another literal (not merged: different math)."""
        kept = [n for n in graph.nodes if n in step and n not in canon]
        # Roots: surviving step nodes read by a node outside the step set.
        roots = [n for n in kept if any(u not in step for u in n.users)]
        shape_id: dict[fx.Node, Any] = {}
        sizes: dict[fx.Node, int] = {}
        for n in kept:
            def conv(a):
                """An argument as a hashable key: nodes by the shape id already given to their canonical instance
                (nodes without one by identity), containers element-wise."""
                if isinstance(a, fx.Node):
                    c = canon.get(a, a)
                    return shape_id.get(c, ("input", id(c)))
                if isinstance(a, (list, tuple)):
                    return tuple(conv(x) for x in a)
                if isinstance(a, dict):
                    return tuple(sorted((k, conv(v)) for k, v in a.items()))
                return "lit"
            shape_id[n] = (n.target, conv(tuple(n.args)), conv(dict(n.kwargs)))
            own = 0 if _op_name(n) in _SHAPE_ONLY or not n.all_input_nodes else 1
            sizes[n] = own + sum(sizes.get(canon.get(a, a), 0) for a in n.all_input_nodes)
        seen: dict[Any, fx.Node] = {}
        out = []
        for r in roots:
            if sizes[r] < 2:
                continue
            first = seen.setdefault(shape_id[r], r)
            if first is r:
                continue
            diff = _first_literal_difference(first, r, canon)
            if diff is None:
                continue
            at, old, new = diff
            out.append(NearMiss(self.name, f"shared_step_value({_kind([r])})", "constant_differs",
                                f"repeats {_where(first)} op for op, but {node_label(at)} has the literal {new!r} "
                                f"where the first instance has {old!r}: different math, not shared",
                                SourceLocation.from_node(r)))
        return out
