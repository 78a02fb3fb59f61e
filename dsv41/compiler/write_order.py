"""Cache writes placed after the last read of the cache's old contents, so that Inductor writes them in place.

A static cache (a module buffer: the window ring, a KV cache) written with `cache.index_put_(idx, v)` reaches the
post-grad graph functionalised: `new = index_put(cache, idx, v)`, and an epilogue `copy_(cache, new)` that writes
the new version back. Inductor's reinplacing (`torch._inductor.fx_passes.reinplace`, after the custom post-grad
passes) turns the pair back into one in-place scatter only when nothing reads the old `cache` after `new` in graph
order; otherwise it keeps `new` as a clone of the whole cache plus the scatter, and launches the copy-back at the
end of the graph. dsv41's rewrites can create that case: a fused op that reads the cache (`sparse_fp4_attention`
reading the ring) is inserted where its region ended, after the functional write that the model performed last.
Measured on `tiny`, CUDA, torch 2.11 (bench/results/2026-12-07_h100_s32/layer_launches_tiny.json): every layer
ended in two `copy_` kernels of its ring (codes and scales).

`order_cache_writes(graph)` moves each such write to just after the last reader of the old contents. In a
functional graph that is always allowed when every user of the write still comes after it; the move changes no
value, only where Inductor's reinplacing looks. Stream joins (`dsv41::stream_join`) take the inputs of the op they
join, so a write moved after the join of a side-stream reader cannot race it.
"""

from __future__ import annotations

import hashlib

import torch
import torch.fx as fx

from ..passes.engine import node_label

__all__ = ["order_cache_writes", "WriteOrderPass"]


def _writes() -> dict:
    """Functional write op -> index of the argument it writes, from Inductor's own reinplacing table (so the set
    follows the installed torch); {} when that table is not where torch 2.11-2.14 keep it."""
    try:
        from torch._inductor.fx_passes.reinplace import inplaceable_ops
    except ImportError:
        return {}
    out = {}
    for op, spec in inplaceable_ops.items():
        arg = getattr(spec, "mutated_arg", None)
        if isinstance(arg, int) and isinstance(op, torch._ops.OpOverload) and op.namespace == "aten":
            out[op] = arg
    return out


def _storage(node: fx.Node):
    from torch._inductor.fx_utils import get_node_storage
    try:
        return get_node_storage(node)
    except Exception:  # noqa: BLE001 - a node without a tensor value shares no storage
        return None


def order_cache_writes(graph: fx.Graph) -> list[dict]:
    """Move each functional write of a graph input after the last read of the input's old contents.

    A write qualifies when it is one of Inductor's reinplaceable ATen ops (`index_put`, `_unsafe_index_put`) whose
    written argument is a placeholder `cache` that the graph's epilogue `copy_(cache, write)` writes back. Readers of
    the old contents are the users of every node sharing `cache`'s storage (its views), except the write itself,
    the copy-back and shape-only users. The write moves to just after the last such reader when that reader comes
    later, every user of the write comes after it, and its index and value are not computed from the cache (made
    in place, such a scatter would read rows it has already overwritten; found by review, `_reads_storage`).

    Args:
        graph: a post-grad FX graph (nodes carry `meta["val"]`); changed in place.
    Returns:
        One dict per moved write: `write` (its label), `cache` (the placeholder's name), `after` (the reader's label).
    Raises:
        Nothing of its own: callers guard it as a pass (`WriteOrderPass`).
    """
    writes = _writes()
    if not writes:
        return []
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    copy_back = {}
    for n in nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default \
                and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder":
            copy_back.setdefault((n.args[0], n.args[1]), n)
    by_storage: dict = {}
    for n in nodes:
        s = _storage(n)
        if s is not None:
            by_storage.setdefault(s, []).append(n)
    moved = []
    for (cache, write), back in copy_back.items():
        if not isinstance(write, fx.Node) or writes.get(write.target) is None:
            continue
        if write.args[writes[write.target]] is not cache:
            continue
        storage = _storage(cache)
        if storage is None:
            continue
        shared = set(by_storage.get(storage, ()))
        last = None
        for view in shared:
            for u in view.users:
                # A view is not a read: its own users are visited as readers of the same storage.
                if u is write or u is back or u in shared or u.target is torch.ops.aten.sym_size.int:
                    continue
                if u.target is torch.ops.aten.copy_.default and u.args[0] is cache:
                    continue
                if last is None or order[u] > order[last]:
                    last = u
        if last is None or order[last] < order[write]:
            continue
        if _reads_storage(write, cache, shared):
            continue
        if any(order[u] <= order[last] for u in write.users):
            continue
        last.append(write)
        order = {n: i for i, n in enumerate(graph.nodes)}
        moved.append({"write": node_label(write), "cache": cache.name, "after": node_label(last)})
    return moved


def _reads_storage(write: fx.Node, cache: fx.Node, shared: set, limit: int = 2000) -> bool:
    """Whether the write's index or value is computed from the cache (through a view or any op): moved later and
    made in place, its scatter would read rows it has already overwritten, so such a write stays where it is.
    True also when the walk back exceeds `limit` nodes (unknown counts as reading)."""
    arg = _writes()[write.target]
    todo: list = []
    fx.node.map_arg(([a for i, a in enumerate(write.args) if i != arg], write.kwargs), todo.append)
    seen: set = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n is cache or n in shared:
            return True
        seen.add(n)
        if len(seen) > limit:
            return True
        todo.extend(n.all_input_nodes)
    return False


class WriteOrderPass:
    """Post-grad pass chained after the stream scheduler: `order_cache_writes` on each graph, guarded (a failure
    leaves the graph as it was; `strict` re-raises).

    Attributes:
        results: one list of moved writes (see `order_cache_writes`) per graph, or a one-item list
            `[{"failed": "<exception>"}]` where the pass raised.
    """

    def __init__(self, strict: bool = False):
        self.strict = bool(strict)
        self.results: list[list[dict]] = []

    def __call__(self, graph: fx.Graph) -> None:
        from ..passes.engine import restore_graph, snapshot_graph
        snap = None if self.strict else snapshot_graph(graph)
        try:
            moved = order_cache_writes(graph)
            graph.lint()
        except Exception as e:  # noqa: BLE001 - the graph as it was is always correct
            if self.strict:
                raise
            restore_graph(graph, snap)
            moved = [{"failed": f"{type(e).__name__}: {e}"}]
        self.results.append(moved)

    def uuid(self) -> str:
        """SHA-256 of this module's source and `strict` (part of the compile's cache key)."""
        with open(__file__, "rb") as f:
            return hashlib.sha256(f.read() + repr(self.strict).encode()).hexdigest()
