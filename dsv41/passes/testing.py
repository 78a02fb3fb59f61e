"""Test helpers for fusion families: run one family on a module, then ask the rewritten graph which ops it holds.

    gm, rec = run_family("mhc", module, (H, fn, base, scale))
    assert ops_after(gm)["dsv41.mhc_mixes"] == 1          # every overload of the op
    assert ops_after(gm, namespace="aten")["aten.topk.default"] == 0
    assert rec.match_count == 1 and not rec.near_misses

`run_family` compiles through the real backend (`torch.compile(..., backend="dsv41")`), so the family sees the
post-grad ATen graph a user's compile gives it, with every other family switched off by the public `disable`
option. `capture_graphs` is the part that reaches inside: it takes the graph as the manager leaves it, by
installing a post-grad pass that dsv41's pipeline chains after its families (compiler/pipeline.py). A fixture that
compiles with every family can use it directly.

Op names are torch's printed names, `namespace.op.overload` ("aten.mm.default", "dsv41.linear_fp4.default");
a query by `namespace.op` (or an `OpOverloadPacket`) adds up its overloads. An op that a graph runs through
`auto_functionalized` counts under its own name, and once more under "higher_order.auto_functionalized".
"""

from __future__ import annotations

import ast
import collections
import contextlib
from typing import Iterable, Iterator, Sequence

import torch
import torch.fx as fx

# Only the package's public names: the record types and the engine may move between modules without breaking this.
from . import FAMILY_ORDER, PassRecord

__all__ = ["OpCounts", "capture_graphs", "ops_after", "ops_between", "run_family", "PREREQUISITES",
           "torch211_casts"]

#: The families `run_family` runs before each family, which finds nothing without them. `normalize` comes first in
#: every compile, and the others match the one form of each chain it leaves; `grouped_pair` and `sibling_gemv` merge
#: ops that only `dispatch` emits.
PREREQUISITES: dict[str, tuple[str, ...]] = {
    **{name: ("normalize",) for name in FAMILY_ORDER if name != "normalize"},
    "normalize": (),
    "grouped_pair": ("normalize", "dispatch"),
    "sibling_gemv": ("normalize", "dispatch"),
}
#: Higher-order ops whose first argument is the op they run: counted under that op as well.
_WRAPPERS = ("auto_functionalized", "auto_functionalized_v2")


class OpCounts(collections.Counter):
    """Counts of ops by printed name (`ns.op.overload`). Indexing also takes `ns.op` (the sum of its overloads),
    an `OpOverload` or an `OpOverloadPacket`; a missing op counts 0."""

    def __getitem__(self, op) -> int:
        """Calls of `op`: a printed name, `ns.op`, an `OpOverload`, `OpOverloadPacket` or higher-order op."""
        key = _op_key(op)
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        if key.count(".") != 1:  # a full name that is absent, or a bare namespace: not an op packet
            return 0
        return sum(n for name, n in self.items() if name.rpartition(".")[0] == key)


def _op_key(op) -> str:
    """Printed name of an op or of a query for one (a string is kept as it is)."""
    if isinstance(op, str):
        return op
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(op)
    if isinstance(op, torch._ops.HigherOrderOperator):
        return f"higher_order.{op.name()}"
    return f"{getattr(op, '__module__', None) or '?'}.{getattr(op, '__name__', repr(op))}"


def _node_ops(node: fx.Node) -> list[str]:
    """Names a call_function node counts under: its target, and the op it wraps if it is a functionalising HOP."""
    names = [_op_key(node.target)]
    if isinstance(node.target, torch._ops.HigherOrderOperator) and node.target.name() in _WRAPPERS and node.args:
        names.append(_op_key(node.args[0]))
    return names


def _graph_of(graph) -> fx.Graph | None:
    """The FX graph of a GraphModule or Graph; None for anything else (a report graph, printed code)."""
    if isinstance(graph, fx.GraphModule):
        return graph.graph
    return graph if isinstance(graph, fx.Graph) else None


def _dotted(expr: ast.expr) -> str | None:
    """`torch.ops.ns.op.overload` of an attribute chain as "ns.op.overload", else None."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id != "torch" or len(parts) < 2 or parts[-1] != "ops":
        return None
    return ".".join(reversed(parts[:-1]))


def _code_ops(code: str) -> list[str]:
    """Op names of every `torch.ops.*` call in FX-printed Python code (several graphs may be concatenated)."""
    names = []
    for node in ast.walk(ast.parse(code)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        names.append(name)
        if name.startswith("higher_order.") and name.split(".", 1)[1] in _WRAPPERS and node.args:
            inner = _dotted(node.args[0])
            if inner is not None:
                names.append(inner)
    return names


def ops_after(graph, namespace: str | None = None) -> OpCounts:
    """Count the ops a graph calls.

    Args:
        graph: a `torch.fx.GraphModule` or `torch.fx.Graph` (every call_function node is counted); or the graph as
            the report keeps it in debug mode: a `GraphReport` / its dict (its `graph_after`) or the printed code
            itself (every `torch.ops.*` call is counted, so Python builtins such as `getitem` are not); or a list
            or tuple of any of these (as `capture_graphs` gives them), whose counts are added.
        namespace: keep only ops of this namespace ("dsv41", "aten", "prims", "higher_order").
    Returns:
        `OpCounts`: printed op name ("aten.mm.default") -> number of calls.
    Raises:
        TypeError: `graph` is none of the above.
        ValueError: a report graph without its code (compiled without `debug=True`).
    """
    if isinstance(graph, (list, tuple)):
        names = [name for one in graph for name in ops_after(one).elements()]
    elif (g := _graph_of(graph)) is not None:
        names = [name for n in g.nodes if n.op == "call_function" for name in _node_ops(n)]
    else:
        code = graph.get("graph_after") if isinstance(graph, dict) else getattr(graph, "graph_after", graph)
        if code is None:
            raise ValueError("the report graph holds no code: compile with options={'debug': True}")
        if not isinstance(code, str):
            raise TypeError(f"ops_after takes a GraphModule, a Graph, a report graph or its code, not "
                            f"{type(graph).__name__}")
        names = _code_ops(code)
    if namespace is not None:
        names = [n for n in names if n.split(".", 1)[0] == namespace]
    return OpCounts(names)


def ops_between(graph, first, second) -> OpCounts:
    """The ops that stand between two ops: computed from a `first` node's output and feeding a `second` node.

    Args:
        graph: a `torch.fx.GraphModule` or `torch.fx.Graph`.
        first, second: ops as `ops_after` indexes them (printed name, `ns.op`, `OpOverload`, `OpOverloadPacket`).
    Returns:
        `OpCounts` of the nodes that are descendants of some `first` node and ancestors of some `second` node
        (neither end counted); empty when no `first` node reaches a `second` node.
    Raises:
        TypeError: `graph` is not an FX graph (printed code has no edges to follow).
    """
    g = _graph_of(graph)
    if g is None:
        raise TypeError(f"ops_between takes a GraphModule or a Graph, not {type(graph).__name__}")

    def matches(node, op):
        """Whether `node` calls `op` (directly or through a functionalising wrapper)."""
        return node.op == "call_function" and OpCounts(_node_ops(node))[op] > 0

    def closure(starts, step):
        """Nodes reached from `starts` by repeated `step` (users or inputs), the starts themselves excluded
        unless reached again."""
        seen, todo = set(), [m for s in starts for m in step(s)]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(step(n))
        return seen

    down = closure([n for n in g.nodes if matches(n, first)], lambda n: n.users)
    up = closure([n for n in g.nodes if matches(n, second)], lambda n: n.all_input_nodes)
    between = [n for n in g.nodes if n in down and n in up and n.op == "call_function"]
    return OpCounts(name for n in between for name in _node_ops(n))


def _copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` that Inductor's later rewrites of the original (reinplacing, lowering) do not reach."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


@contextlib.contextmanager
def capture_graphs() -> Iterator[list[fx.GraphModule]]:
    """Keep the graph of every dsv41 compile inside the block as dsv41's families leave it.

    This is the harness's only dependency on the compiler's internals: dsv41's pipeline reads
    `torch._inductor.config.post_grad_custom_post_pass` when it compiles and chains that pass after its families
    (compiler/pipeline.py). The capturing pass has no cache key, so Inductor's caches are bypassed and the
    families run on every graph (a cache hit would leave nothing to capture).

    Yields:
        A list that fills with one `torch.fx.GraphModule` per post-grad graph compiled in the block (a copy taken
        after the families ran, before Inductor lowers it), in compile order.
    Raises:
        Whatever the block raises; the previous post-grad pass is put back in any case.
    """
    from torch._inductor import config as inductor_config

    graphs: list[fx.GraphModule] = []
    prev = inductor_config.post_grad_custom_post_pass

    def capture(graph: fx.Graph) -> None:
        """Keep a copy of the graph as the families left it."""
        graphs.append(_copy_module(graph.owning_module))

    chain = () if prev is None else tuple(prev) if isinstance(prev, (list, tuple)) else (prev,)
    with inductor_config.patch(post_grad_custom_post_pass=[*chain, capture] if chain else capture):
        yield graphs


def eager_and_compiled(model, args: Sequence, options: dict | None = None) -> tuple:
    """(eager outputs, dsv41-compiled outputs, the graphs as dsv41's families left them) of `model(*args)`: Dynamo
    reset first, both under `torch.no_grad()`, compiled with `dynamic=False` and `options`, graphs captured with
    `capture_graphs` (so the families run even where a cache would serve the graph). Raises whatever the model or
    the compile raises."""
    import torch._dynamo
    torch._dynamo.reset()
    with torch.no_grad(), capture_graphs() as graphs:
        eager = model(*args)
        out = torch.compile(model, backend="dsv41", dynamic=False, options=options)(*args)
    return eager, out, graphs


def run_family(name: str, module, inputs: Sequence, *, also: Iterable[str] = (), dynamic: bool = False,
               fullgraph: bool = True) -> tuple[fx.GraphModule, PassRecord]:
    """Compile `module` with dsv41's backend running only family `name` (and its prerequisites), and return the
    graph it left and what it recorded.

    Args:
        name: a family name (`FAMILY_ORDER`).
        module: a `torch.nn.Module` or function, called as `module(*inputs)` under `torch.no_grad()`.
        inputs: its positional arguments.
        also: further families to run with it (they keep their place in `FAMILY_ORDER`). The family's
            prerequisites run in any case: `normalize`, and what `PREREQUISITES` names for it.
        dynamic: passed to `torch.compile` (False: shapes specialised, as dsv41 compiles decode steps).
        fullgraph: passed to `torch.compile`; with False a graph break gives several graphs, and the last one
            compiled is returned.
    Returns:
        (graph_after, record): the post-grad `torch.fx.GraphModule` as the families left it (before Inductor's
        lowering), and the family's `PassRecord` (matches, near-misses, findings). The compile is strict: a
        family that raises fails the call.
    Raises:
        ValueError: `name` or a name in `also` is not a family (the message lists the known ones), or the compile
            produced no post-grad graph (nothing for a family to see).
        dsv41.passes.manager.FamilyFailed: (wrapped by Dynamo) a family raised on the graph.
    """
    unknown = sorted({name, *also} - set(FAMILY_ORDER))
    if unknown:
        raise ValueError(f"unknown pass famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))}; "
                         f"known families: {', '.join(FAMILY_ORDER)}")
    keep = {name, *also, *PREREQUISITES[name]}
    options = {"disable": [f for f in FAMILY_ORDER if f not in keep], "strict": True}
    import dsv41  # the report's public entry point (tests/test_layers.py allow-lists this passes -> dsv41 edge)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend="dsv41", dynamic=dynamic, fullgraph=fullgraph, options=options)
    with capture_graphs() as graphs, torch.no_grad():
        compiled(*inputs)
    if not graphs:
        raise ValueError(f"compiling {type(module).__name__} gave no post-grad graph for {name!r} to run on")
    report = dsv41.last_report()
    records = [r for gr in report.graphs for r in gr.records if r.family == name]
    return graphs[-1], records[-1]


def _pointless_convert_211(match, arg, dtype1, dtype2):
    """Torch 2.11's `pointless_convert`: any chain of two float casts becomes one cast to the last dtype."""
    graph = match.graph
    node = match.output_node()
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    val = arg.meta.get("val", None)
    if isinstance(val, torch.Tensor) and val.dtype in floats and dtype1 in floats and dtype2 in floats:
        repl = graph.call_function(torch.ops.prims.convert_element_type.default, (arg, dtype2))
        repl.meta.update(node.meta)
        node.replace_all_uses_with(repl)
        match.erase_nodes()


@contextlib.contextmanager
def torch211_casts() -> Iterator[None]:
    """Compile inside the block with the graphs torch 2.11's Inductor hands dsv41's passes (the GPU machines' torch).

    Before torch 2.13, Inductor's joint-graph pattern `pointless_convert` removes every float round trip
    `convert(convert(x, dtype1), dtype2)`, also through a narrower dtype1: `fake_quant(q).to(bf16).float()` reaches the
    passes as the float32 `fake_quant(q)`. Torch 2.13 keeps a narrower intermediate. Chains that only miss in the 2.11
    form are invisible on a 2.13 CPU (session 34: the indexer's score chain, 16 % of a `small` step on an H100);
    this swaps 2.11's rule into the pattern table for the block and puts 2.13's back after.

    Raises:
        RuntimeError: this torch's Inductor has no `pointless_convert` pattern to swap (its rules changed: the
            emulation would test nothing).
    """
    import torch._inductor.fx_passes.joint_graph as jg

    entries = [e for group in jg.patterns.patterns.values() for e in group
               if getattr(getattr(e, "handler", None), "__name__", "") == "pointless_convert"]
    if len(entries) != 1:
        raise RuntimeError(f"expected one pointless_convert pattern in Inductor's joint-graph table, found "
                           f"{len(entries)}")
    (entry,) = entries
    saved = entry.handler
    entry.handler = _pointless_convert_211
    try:
        # The compile caches do not key on the pattern table: a cached 2.13 graph would be served here.
        with torch._inductor.config.patch(force_disable_caches=True):
            yield
    finally:
        entry.handler = saved
