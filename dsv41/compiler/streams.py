"""Side-stream scheduling of the rewritten post-grad graph (ARCHITECTURE.md "Pipeline stages" 3; issue 6 item 3).

The last post-grad pass of a dsv41 compile (chained after the fusion families by `pipeline.compile_graph`):

1. **DAG.** `build_dag(graph)`: one networkx node per FX node; an edge for every data dependence, plus ordering
   edges for in-place mutation — every reader of a tensor (through views) before a mutating node, and the
   mutating node before every later reader (write-after-read / read-after-write).
2. **Cost.** `CostModel.node_us(node)`: microseconds from the bytes a node reads and writes (shapes and dtypes
   of `meta["val"]`, symbolic sizes at their hints) over HBM bandwidth, plus a launch cost per kernel (a fraction of
   one for ATen nodes that Inductor fuses). Defaults measured on the lent H200 (4.26 TB/s copy
   bandwidth, 1.18 us per kernel replayed from a CUDA graph without PDL).
3. **Critical path.** Longest path through the DAG by node cost (`critical_path`): the time with unlimited streams.
4. **Candidates.** Only dsv41's own custom ops (`torch.ops.dsv41.*`) can change stream: Inductor's Triton kernels
   launch on the stream it fetched once at the top of the call. Never moved: collectives
   (`_c10d_functional.*`, `c10d.*`: the main stream keeps the collective order every rank shares), mutating ops,
   ops with symbolic scalar arguments or non-tensor outputs.
5. **Placement.** For a candidate S the *window* is the stretch of the graph's order between S's last producer and
   its first consumer (a data consumer, or a mutation of an input it reads). Every node in the window other than
   S is independent of S (a topological order puts S's ancestors before its last producer). S goes to the side
   stream when that independent main-stream work hides it: fork right after the last producer, S launched after
   the first main-branch node of the window (the main branch is issued first), join right before the first
   consumer. A candidate with nothing to overlap (empty window: its consumer follows at once) stays on main.
6. **Choice.** Candidates by estimated gain min(cost(S), window work) - sync; each is kept only when the
   two-stream simulation (`simulate`: main and side stream in order, cross-stream waits at fork / join) gets
   shorter. One side stream for the whole graph (ARCHITECTURE.md "Known traps").
7. **Rewrite** (`apply_plan`, only when the `streams` option is on): S becomes `dsv41::stream_fork` /
   `stream_launch` / `stream_join` (dsv41/kernels/streams.py, which explains why the join takes the inputs and
   returns the outputs); its users read the join's outputs.

The plan is computed and reported even when the option is off, so a CPU compile shows what a CUDA-graph compile
would do. `StreamPass` is the Inductor `CustomGraphPass`; its `results` (one schedule dict per graph) go to the
FusionReport (`schedule`).
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import networkx as nx
import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..passes.engine import is_dataflow_op, is_view_op, node_label, restore_graph, size_hint, snapshot_graph, tensor_val

__all__ = ["CostModel", "Region", "StreamPlan", "StreamPass", "build_dag", "critical_path", "plan_streams",
           "apply_plan", "simulate", "is_collective", "is_mutating", "dsv41_eligible"]

_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor",
                                    "_c10d_functional_autograd"})
_STREAM_OPS = frozenset({"stream_fork", "stream_launch", "stream_join"})


# ------------------------------------------------------------------------------------------------ cost
@dataclass(frozen=True)
class CostModel:
    """Time of one FX node on the GPU, in microseconds.

    Attributes:
        bandwidth_gbs: HBM bandwidth in GB/s (bytes read + written per second / 1e9).
        launch_us: cost of one kernel launch replayed from a CUDA graph (us).
        fused_launch_fraction: share of `launch_us` charged to a pointwise / reduction ATen node (Inductor fuses
            chains of them into few kernels).
        sync_us: cost of one fork + join pair (two event nodes, charged on the main stream).
        min_gain_us: a region is kept only when it shortens the simulated step by more than this.
    Limits: two kernels running at once are assumed not to slow each other. HBM contention between two
    bandwidth-bound kernels (e.g. two expert GEMVs) is not modelled, so `after_us` is optimistic there; at decode
    sizes most dsv41 ops are launch / latency bound, where the model holds. The GPU measurement decides.
    """

    bandwidth_gbs: float = 4260.0
    launch_us: float = 1.18
    fused_launch_fraction: float = 0.25
    sync_us: float = 0.5
    min_gain_us: float = 0.05

    def node_bytes(self, node: fx.Node) -> int:
        """Bytes `node` reads (tensor inputs) and writes (tensor outputs), from `meta["val"]`."""
        total = 0
        for a in node.all_input_nodes:
            total += _val_bytes(a.meta.get("val"))
        return total + _val_bytes(node.meta.get("val"))

    def node_us(self, node: fx.Node) -> float:
        """0 for placeholders, constants, views, getitem and shape arithmetic; else bytes / bandwidth plus the
        launch cost (a fraction of it for fusible ATen nodes)."""
        if node.op != "call_function" or node.target is operator.getitem or is_view_op(node):
            return 0.0
        if not _has_tensor(node.meta.get("val")):
            return 0.0
        launch = self.launch_us * (self.fused_launch_fraction if is_dataflow_op(node) else 1.0)
        return self.node_bytes(node) / (self.bandwidth_gbs * 1e3) + launch


def _val_bytes(v) -> int:
    if isinstance(v, torch.Tensor):
        n = 1
        for s in v.shape:
            n *= int(size_hint(s))
        return n * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(_val_bytes(x) for x in v)
    return 0


def _has_tensor(v) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    return isinstance(v, (list, tuple)) and any(_has_tensor(x) for x in v)


# ------------------------------------------------------------------------------------------------ op classes
def _namespace(node: fx.Node) -> str | None:
    t = node.target
    return t.namespace if isinstance(t, torch._ops.OpOverload) else None


def is_collective(node: fx.Node) -> bool:
    """A collective or its wait (`_c10d_functional.*`, `c10d.*`, ...): always stays on the main stream."""
    if node.op != "call_function":
        return False
    if _namespace(node) in _COLLECTIVE_NAMESPACES:
        return True
    name = getattr(node.target, "__name__", "")
    return "all_reduce" in name or "all_gather" in name or "reduce_scatter" in name or "wait_tensor" in name


def _nodes_in(v) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(v, out.append)
    return out


def _mutated_args(node: fx.Node) -> list[fx.Node] | None:
    """Inputs `node` writes in place; None when it writes nothing. `auto_functionalized` (v1: the mutable op's
    written arguments; v2: `_all_bases`) is read precisely; any other higher-order op that may mutate
    (effects) is assumed to write all its tensor inputs."""
    if node.op != "call_function":
        return None
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        if not t._schema.is_mutable:
            return None
        out: list[fx.Node] = []
        for i, arg in enumerate(t._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                out += _nodes_in(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
        return out
    if isinstance(t, torch._ops.HigherOrderOperator):
        name = t.name()
        if name == "auto_functionalized_v2":
            return _nodes_in(node.kwargs.get("_all_bases", []))
        if name == "auto_functionalized" and node.args and isinstance(node.args[0], torch._ops.OpOverload):
            op = node.args[0]
            return [x for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write
                    for x in _nodes_in(node.kwargs.get(a.name))]
        if "functionalized" in name or "effects" in name:
            return [n for n in node.all_input_nodes if tensor_val(n) is not None]
    return None


def is_mutating(node: fx.Node) -> bool:
    """True when `node` writes one of its inputs in place (see `_mutated_args`)."""
    return _mutated_args(node) is not None


def _base(node: fx.Node) -> fx.Node:
    while is_view_op(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def dsv41_eligible(node: fx.Node) -> bool:
    """The default candidate filter: a `torch.ops.dsv41.*` op other than the stream ops themselves."""
    t = node.target
    return (_namespace(node) == "dsv41" and t._schema.name.split("::")[-1] not in _STREAM_OPS)


# ------------------------------------------------------------------------------------------------ DAG
def build_dag(graph: fx.Graph) -> nx.DiGraph:
    """Dependency DAG of `graph`: data edges, plus mutation ordering edges (module docstring, step 1).

    Nodes are the FX nodes (attribute `pos`: index in the graph's order). Raises networkx.NetworkXUnfeasible if
    the edges form a cycle (a graph that is not topologically sorted).
    """
    dag = nx.DiGraph()
    order = list(graph.nodes)
    for i, n in enumerate(order):
        dag.add_node(n, pos=i)
    readers: dict[fx.Node, list[fx.Node]] = {}
    for n in order:
        for a in n.all_input_nodes:
            dag.add_edge(a, n)
            readers.setdefault(_base(a), []).append(n)
    pos = {n: i for i, n in enumerate(order)}
    for m in order:
        written = _mutated_args(m)
        if not written:
            continue
        for w in written:
            for r in readers.get(_base(w), ()):
                if r is m:
                    continue
                if pos[r] < pos[m]:
                    dag.add_edge(r, m)
                else:
                    dag.add_edge(m, r)
    if not nx.is_directed_acyclic_graph(dag):
        raise nx.NetworkXUnfeasible("the graph's dependences form a cycle")
    return dag


def critical_path(dag: nx.DiGraph, cost: dict) -> tuple[float, list]:
    """(length in us, nodes) of the longest path through `dag` weighted by `cost[node]` (unlimited streams)."""
    best: dict = {}
    prev: dict = {}
    for n in nx.topological_sort(dag):
        b, p = 0.0, None
        for u in dag.predecessors(n):
            if best[u] > b:
                b, p = best[u], u
        best[n] = b + cost.get(n, 0.0)
        prev[n] = p
    if not best:
        return 0.0, []
    end = max(best, key=best.__getitem__)
    path = [end]
    while prev[path[-1]] is not None:
        path.append(prev[path[-1]])
    return best[end], path[::-1]


# ------------------------------------------------------------------------------------------------ plan
@dataclass
class Region:
    """One node moved to the side stream: fork after `fork_after`, launch after `launch_after`, join before
    `join_before` (FX nodes of the graph before the rewrite), overlapping `overlap_us` of main-stream work."""

    node: fx.Node
    fork_after: fx.Node
    launch_after: fx.Node
    join_before: fx.Node
    cost_us: float
    window_us: float
    slot: int = -1

    def to_dict(self) -> dict:
        """JSON view: node name, op, user's source line, placement and costs."""
        return {"slot": self.slot, "node": self.node.name, "op": node_label(self.node),
                "where": _where(self.node), "stream": "side", "cost_us": round(self.cost_us, 3),
                "overlap_us": round(min(self.cost_us, self.window_us), 3), "fork_after": self.fork_after.name,
                "launch_after": self.launch_after.name, "join_before": self.join_before.name,
                "inputs_kept_alive": [a.name for a in _tensor_inputs(self.node)]}


@dataclass
class StreamPlan:
    """The schedule of one graph: regions on the side stream, candidates kept on main (with why), and the step
    time under the cost model: `before_us` (one stream), `after_us` (with the regions), `critical_path_us`."""

    regions: list[Region] = field(default_factory=list)
    kept: list[tuple[fx.Node, str]] = field(default_factory=list)
    before_us: float = 0.0
    after_us: float = 0.0
    critical_path_us: float = 0.0
    critical_path_nodes: int = 0
    nodes: int = 0
    cost_model: CostModel = field(default_factory=CostModel)

    def to_dict(self, applied: bool, reason: str) -> dict:
        """JSON view (one graph of the report's `schedule`)."""
        return {"applied": applied, "reason": reason, "streams": 2 if (applied and self.regions) else 1,
                "side_streams_planned": 1 if self.regions else 0, "nodes": self.nodes,
                "moved": len(self.regions), "before_us": round(self.before_us, 3),
                "after_us": round(self.after_us, 3), "critical_path_us": round(self.critical_path_us, 3),
                "critical_path_nodes": self.critical_path_nodes, "cost_model": asdict(self.cost_model),
                "regions": [r.to_dict() for r in self.regions],
                "kept_on_main": [{"node": n.name, "op": node_label(n), "where": _where(n), "reason": why}
                                 for n, why in self.kept]}


def _where(node: fx.Node) -> str:
    st = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip().startswith("File ")]
    if not lines:
        return "?"
    last = lines[-1]  # File "/path/x.py", line 12, in fn
    try:
        path = last.split('"')[1]
        rest = last.split('"', 2)[2].strip(", ")
        return f"{os.path.basename(path)} {rest}"
    except IndexError:
        return last


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    seen: list[fx.Node] = []
    for a in node.all_input_nodes:
        if tensor_val(a) is not None and a not in seen:
            seen.append(a)
    return seen


def _why_not_movable(node: fx.Node) -> str | None:
    if is_collective(node):
        return "collective: stays on the main stream"
    if is_mutating(node):
        return "mutates an input in place"
    vals = node.meta.get("val")
    tuple_ok = not isinstance(vals, (list, tuple)) or all(isinstance(v, torch.Tensor) for v in vals)
    if not _has_tensor(vals) or not tuple_ok:
        return "output is not a tensor or a tuple of tensors"
    for a in node.all_input_nodes:
        if tensor_val(a) is None:
            return f"symbolic / non-tensor graph argument {a.name}"
    if not _tensor_inputs(node):
        return "no tensor input"
    return None


def _producers(node: fx.Node) -> list[fx.Node]:
    """The ops whose outputs `node` reads, looking through getitem and view nodes."""
    out = []
    for a in node.all_input_nodes:
        while _is_free_view(a) and a.args and isinstance(a.args[0], fx.Node):
            a = a.args[0]
        out.append(a)
    return out


def _is_free_view(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target is operator.getitem or is_view_op(node))


def _free_dependents(node: fx.Node) -> list[fx.Node]:
    """getitem / view nodes that only re-address `node`'s outputs (transitively): they cost nothing and move
    behind the join with it."""
    out: list[fx.Node] = []
    stack = [node]
    while stack:
        for u in stack.pop().users:
            if _is_free_view(u) and u not in out:
                out.append(u)
                stack.append(u)
    return out


def _consumers(node: fx.Node, dag: nx.DiGraph) -> list[fx.Node]:
    """What must wait for `node`: the first real users behind its getitem / view nodes, and mutation
    successors (of the node or of those views)."""
    free = set(_free_dependents(node))
    out = []
    for x in [node, *free]:
        out += [s for s in dag.successors(x) if s not in free]
    return out


def simulate(order: list[fx.Node], cost: dict, regions: Iterable[Region], sync_us: float) -> float:
    """Step time (us) of `order` with `regions` on one side stream: both streams run their nodes in order; a
    region starts when the main stream reaches its fork and the side stream is free, and the main stream waits
    for it at its join (each fork + join pair costs `sync_us` on the main stream)."""
    regions = list(regions)
    side_nodes = {r.node: r for r in regions}
    fork_at: dict = {}
    launch_at: dict = {}
    join_at: dict = {}
    for r in regions:
        fork_at.setdefault(r.fork_after, []).append(r)
        launch_at.setdefault(r.launch_after, []).append(r)
        join_at.setdefault(r.join_before, []).append(r)
    main = side = 0.0
    forked: dict = {}
    done: dict = {}
    for n in order:
        for r in join_at.get(n, ()):
            main = max(main, done[r.node]) + sync_us
        if n not in side_nodes:
            main += cost.get(n, 0.0)
        for r in fork_at.get(n, ()):
            forked[r.node] = main
        for r in launch_at.get(n, ()):
            side = max(side, forked[r.node]) + cost.get(r.node, 0.0)
            done[r.node] = side
    return max(main, side)


def plan_streams(graph: fx.Graph, cost_model: CostModel | None = None,
                 eligible: Callable[[fx.Node], bool] = dsv41_eligible) -> StreamPlan:
    """Choose which nodes of `graph` go to the side stream (module docstring, steps 1-6). Does not modify
    `graph`. `eligible(node)` selects candidates (default: dsv41 custom ops); collectives and mutating ops are
    never moved whatever it says."""
    cm = cost_model or CostModel()
    order = list(graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    dag = build_dag(graph)
    cost = {n: cm.node_us(n) for n in order}
    plan = StreamPlan(nodes=len(order), cost_model=cm)
    plan.before_us = sum(cost.values())
    plan.critical_path_us, path = critical_path(dag, cost)
    plan.critical_path_nodes = sum(1 for n in path if cost[n] > 0)

    proposals: list[tuple[float, Region]] = []
    for n in order:
        if n.op != "call_function" or not (is_collective(n) or eligible(n)):
            continue
        why = _why_not_movable(n)
        if why is not None:
            plan.kept.append((n, why))
            continue
        cons = _consumers(n, dag)
        if not cons:
            plan.kept.append((n, "no consumer"))
            continue
        first = min(cons, key=pos.__getitem__)
        producers = n.all_input_nodes
        last = max(producers, key=pos.__getitem__)
        fork_after = last
        leaf = ("placeholder", "get_attr")
        while fork_after.op in leaf and order[pos[fork_after] + 1].op in leaf:  # fork after the inputs' block
            fork_after = order[pos[fork_after] + 1]
        own = {n, *_free_dependents(n)}
        window = [m for m in order[pos[fork_after] + 1:pos[first]] if m not in own]
        work = [m for m in window if cost[m] > 0]
        window_us = sum(cost[m] for m in work)
        if not work:
            plan.kept.append((n, "nothing to overlap: its first consumer follows its inputs at once"))
            continue
        gain = min(cost[n], window_us) - cm.sync_us
        if gain <= cm.min_gain_us:
            plan.kept.append((n, f"overlap {min(cost[n], window_us):.3f} us does not pay the fork/join "
                                 f"({cm.sync_us} us)"))
            continue
        proposals.append((gain, Region(n, fork_after, work[0], first, cost[n], window_us)))

    chosen: list[Region] = []
    current = plan.before_us
    for gain, r in sorted(proposals, key=lambda p: (-p[0], pos[p[1].node])):
        near = set(_producers(r.node)) | set(_consumers(r.node, dag))
        if any(c.node in near for c in chosen):
            plan.kept.append((r.node, "reads or feeds another side-stream region (regions are not chained)"))
            continue
        t = simulate(order, cost, chosen + [r], cm.sync_us)
        if t < current - cm.min_gain_us:
            chosen.append(r)
            current = t
        else:
            plan.kept.append((r.node, "no gain in the two-stream simulation (side stream busy, or the join waits)"))
    chosen.sort(key=lambda r: pos[r.node])
    moved = {r.node for r in chosen}
    for i, r in enumerate(chosen):
        r.slot = i
        if r.launch_after in moved:  # launch after the first main-branch node of the window that stays on main
            work = [m for m in order[pos[r.fork_after] + 1:pos[r.join_before]] if cost[m] > 0 and m not in moved]
            r.launch_after = work[0] if work else r.fork_after
    plan.regions = chosen
    plan.after_us = simulate(order, cost, chosen, cm.sync_us) if chosen else plan.before_us
    plan.kept.sort(key=lambda k: pos[k[0]])
    return plan


# ------------------------------------------------------------------------------------------------ rewrite
def _program(node: fx.Node) -> tuple[str, list[fx.Node], int]:
    """(JSON program, tensor inputs, number of outputs) for moving `node` (dsv41/kernels/streams.py format)."""
    from ..kernels.streams import encode_arg

    tensors = _tensor_inputs(node)
    index = {t: i for i, t in enumerate(tensors)}

    def ref(a):
        """Reference to an earlier scheduled tensor ({'t': index}) or None for a non-node argument."""
        return {"t": index[a]} if isinstance(a, fx.Node) and a in index else None

    op = node.target
    name = f"{op.namespace}::{op._schema.name.split('::')[-1]}.{op._overloadname}"
    val = node.meta["val"]
    n_out = len(val) if isinstance(val, (list, tuple)) else 1
    outputs = [[0, i] for i in range(n_out)] if isinstance(val, (list, tuple)) else [[0, -1]]
    stride = {str(i): [int(size_hint(s)) for s in t.meta["val"].stride()] for i, t in enumerate(tensors)}
    prog = {"steps": [{"op": name, "args": encode_arg(list(node.args), ref),
                       "kwargs": {k: encode_arg(v, ref) for k, v in node.kwargs.items()}}],
            "outputs": outputs, "stride": stride}
    return json.dumps(prog, sort_keys=True), tensors, n_out


def _copy_meta(dst: fx.Node, src: fx.Node) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def apply_plan(graph: fx.Graph, plan: StreamPlan) -> None:
    """Rewrite `graph` in place: each region's node becomes fork / launch / join (module docstring, step 7).

    Raises RuntimeError when dsv41's stream ops are not registered (dsv41.kernels.streams not importable).
    """
    try:
        from ..kernels import streams as _ops  # noqa: F401  (registers dsv41::stream_*)
    except ImportError as e:  # pragma: no cover - the package ships the module
        raise RuntimeError(f"dsv41 stream ops are not available: {e}") from e
    fork_op = torch.ops.dsv41.stream_fork.default
    launch_op = torch.ops.dsv41.stream_launch.default
    join_op = torch.ops.dsv41.stream_join.default
    for r in plan.regions:
        n = r.node
        program, tensors, n_out = _program(n)
        # Views of the outputs placed before the join (free in the cost model) must follow it after the rewrite.
        free_set = set(_free_dependents(n))
        free, seen_join = [], False
        for v in graph.nodes:
            seen_join = seen_join or v is r.join_before
            if v in free_set and not seen_join and v.target is not operator.getitem:
                free.append(v)
        with graph.inserting_after(r.fork_after):
            fork = graph.call_function(fork_op, (tensors, r.slot))
        fork.meta["val"] = tensor_val(tensors[0]).new_empty((0,), dtype=torch.int8)
        anchor = fork if r.launch_after is r.fork_after else r.launch_after
        with graph.inserting_after(anchor):
            launch = graph.call_function(launch_op, (fork, tensors, program, r.slot))
        launch.meta["val"] = fork.meta["val"].new_empty((0,))
        with graph.inserting_before(r.join_before):
            join = graph.call_function(join_op, (launch, tensors, program, r.slot))
        val = n.meta["val"]
        outs = list(val) if isinstance(val, (list, tuple)) else [val]
        join.meta["val"] = outs
        for x in (fork, launch, join):
            _copy_meta(x, n)
        if isinstance(val, (list, tuple)):
            for u in list(n.users):
                if u.target is operator.getitem:
                    with graph.inserting_before(r.join_before):
                        g = graph.call_function(operator.getitem, (join, u.args[1]))
                    g.meta.update(u.meta)
                    u.replace_all_uses_with(g)
                    graph.erase_node(u)
            if n.users:
                raise RuntimeError(f"{n.name}: a user reads the tuple itself, not through getitem")
        else:
            with graph.inserting_before(r.join_before):
                g = graph.call_function(operator.getitem, (join, 0))
            g.meta.update(n.meta)
            n.replace_all_uses_with(g)
        graph.erase_node(n)
        for v in free:  # in graph order, so each view still follows its input
            r.join_before.prepend(v)
    graph.lint()


# ------------------------------------------------------------------------------------------------ the pass
def _sources() -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    return [os.path.join(here, "streams.py"), os.path.join(os.path.dirname(here), "kernels", "streams.py")]


class StreamPass(CustomGraphPass):
    """Post-grad pass: plan the side stream of each graph and, when `apply`, rewrite it with fork / join ops.

    Args:
        apply: rewrite the graph (the `streams` option resolved for this compile); False only plans.
        reason: why it is on or off (shown in the report).
        cost_model: the cost model (default `CostModel()`).
        debug: keep the graph's code after the pass in each result (`code_after`; the compiler shows it as the
            graph's code after the passes).
        strict: re-raise an exception of the rewrite; otherwise the graph is put back on one stream as it was and
            the schedule says why it was not applied.
    Attributes:
        results: one schedule dict (`StreamPlan.to_dict`) per graph the pass ran on.
    """

    def __init__(self, apply: bool, reason: str = "", cost_model: CostModel | None = None, debug: bool = False,
                 strict: bool = False):
        self.apply = bool(apply)
        self.strict = bool(strict)
        self.reason = reason
        self.cost_model = cost_model or CostModel()
        self.debug = debug
        self.results: list[dict] = []

    def __call__(self, graph: fx.Graph) -> None:
        try:
            plan = plan_streams(graph, self.cost_model)
        except Exception as e:  # planning only reads the graph: a graph it cannot model runs on one stream
            plan = StreamPlan(nodes=len(graph.nodes), cost_model=self.cost_model)
            d = plan.to_dict(False, f"not scheduled: {type(e).__name__}: {e}")
            if self.debug:
                d["code_after"] = graph.python_code("self").src
            self.results.append(d)
            return
        applied = self.apply and bool(plan.regions)
        reason = self.reason
        if applied:
            snap = None if self.strict else snapshot_graph(graph)
            try:
                apply_plan(graph, plan)
                graph.lint()
            except Exception as e:  # noqa: BLE001 - one stream is always a correct schedule
                if self.strict:
                    raise
                restore_graph(graph, snap)
                applied, reason = False, f"not applied: the rewrite raised {type(e).__name__}: {e}"
        d = plan.to_dict(applied, reason)
        if self.debug:
            d["code_after"] = graph.python_code("self").src
        self.results.append(d)

    def uuid(self) -> str:
        """SHA-256 of this module's and the stream ops' source, `apply` and the cost model."""
        h = hashlib.sha256()
        for path in _sources():
            with open(path, "rb") as f:
                h.update(f.read())
        h.update(json.dumps({"apply": self.apply, "reason": self.reason, "cost": asdict(self.cost_model),
                             "debug": self.debug}, sort_keys=True).encode())
        return h.hexdigest()


def merge_schedules(results: list[dict]) -> dict | None:
    """One schedule dict per compiled graph from the pass's results (a graph with subgraphs has several): times
    and counts add up, regions and kept nodes are concatenated. None when the pass did not run."""
    if not results:
        return None
    if len(results) == 1:
        return dict(results[0])
    out = dict(results[0])
    for key in ("nodes", "moved", "before_us", "after_us", "critical_path_us", "critical_path_nodes"):
        out[key] = round(sum(r[key] for r in results), 3) if key.endswith("_us") else sum(r[key] for r in results)
    out["applied"] = any(r["applied"] for r in results)
    out["streams"] = max(r["streams"] for r in results)
    out["side_streams_planned"] = max(r["side_streams_planned"] for r in results)
    out["regions"] = [x for r in results for x in r["regions"]]
    out["kept_on_main"] = [x for r in results for x in r["kept_on_main"]]
    if all("code_after" in r for r in results):
        out["code_after"] = "\n".join(r["code_after"] for r in results)
    return out
