"""Shared machinery of the dsv41 fusion passes: immutable records, op classes, region probing, node insertion.

How a dsv41 pass recognises a chain (ARCHITECTURE.md "Pipeline stages" 2): it finds a candidate region by
STRUCTURE (an anchor op, the tensors the region depends on, their shapes and dtypes — never module or
parameter names), then checks the region's SEMANTICS by evaluating the region's own ATen nodes on probe
tensors and comparing the result with the fused op's reference semantics (`dsv41/model/formats.py`,
`dsv41/model/rope.py`). Inductor's traced patterns ignore every int, float, list and dtype argument
(`fx_to_pattern(ignore_types=...)`), so on their own they cannot tell "RoPE on the last R channels" from "on
the first R", an exponent bias of 127 from 100, or a 32-element block from a 16-element one; evaluating the
region settles exactly those constants, whichever way eager code spelled the math. A check that fails
becomes a `NearMiss` naming the failed check, which is what the fusion report shows.

Records are frozen dataclasses holding only tuples, strings and numbers, so they are immutable, hashable
and JSON-serialisable (`to_dict` / `from_dict`); the compiler caches them next to Inductor's FX-graph cache.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import sympy
import torch
import torch.fx as fx

__all__ = [
    "SourceLocation", "MatchRecord", "NearMiss", "Finding", "PassRecord", "FusionFamily",
    "BATCH", "LENGTH", "token_rows", "size_hint", "tensor_val", "concrete_shape", "same_shape", "is_dataflow_op", "is_view_op",
    "is_table_lookup", "sourced_nodes", "eliminate_dead_code",
    "RegionEvaluator", "RegionNotClosed", "collect_region", "insert_node", "size_args", "dsv41_op", "node_label",
    "wide_scale_probes", "agree_where_representable", "group_in_order", "snapshot_graph", "restore_graph",
    "GraphFingerprint", "symbolic_part", "static_refusal", "rms_norm_eps_outside", "rms_eps_reason",
]

#: Symbols of the per-match byte expressions: batch size and sequence extent of the step's activations.
BATCH, LENGTH = sympy.symbols("B L", positive=True, integer=True)

_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?P<code>[^\n]*)')


# ------------------------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class SourceLocation:
    """A line of the user's source that produced a graph node (from `node.meta["stack_trace"]`).

    `stack` lists every frame of the trace as "file:line (function)", outermost first; `file`/`line`/
    `function`/`code` describe the innermost frame (where the op was called).
    """

    file: str
    line: int
    function: str
    code: str = ""
    stack: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"

    def short(self) -> str:
        """Innermost frame as `basename:line (function)`, plus its caller when there is one."""
        import os
        here = f"{os.path.basename(self.file)}:{self.line} ({self.function})"
        if len(self.stack) >= 2:
            caller = self.stack[-2]
            path, _, rest = caller.partition(":")
            here += f" <- {os.path.basename(path)}:{rest}"
        return here

    @classmethod
    def from_node(cls, node: fx.Node | None) -> "SourceLocation | None":
        """Parse the node's stack trace; None when the node carries none (e.g. nodes Inductor created)."""
        trace = node.meta.get("stack_trace") if node is not None else None
        if not trace:
            return None
        frames = list(_FRAME_RE.finditer(trace))
        if not frames:
            return None
        last = frames[-1]
        stack = tuple(f"{m['file']}:{m['line']} ({m['fn']})" for m in frames)
        return cls(last["file"], int(last["line"]), last["fn"], last["code"].strip(), stack)


@dataclass(frozen=True)
class MatchRecord:
    """One fused chain.

    Fields:
        family: pass family name (`dispatch`, `rope_fp4`, `normalize`).
        pattern: what matched, e.g. `linear_fp8_block(act_quant=True)` or `rope_fp4_quant(e4m3 1x16)`.
        op: the op that replaced the chain (`dsv41::linear_fp8_block`; for `normalize` the rewrite applied).
        location: user source line of the chain's anchor node.
        nodes_replaced: names of the ATen nodes the rewrite removed from the graph.
        ops_replaced: their targets as strings (e.g. `aten.mul.Tensor`), same order.
        bytes_before / bytes_after: bytes the chain moves before and after fusion, as sympy expressions (str)
            in `B` and `L` (see `token_rows`), per execution of the graph.
        symbols: the values of `B` and `L` for the compiled shapes, as ((name, value), ...).
        detail: extra facts as ((key, value), ...), e.g. (("N", 256), ("K", 512)).
    """

    family: str
    pattern: str
    op: str
    location: SourceLocation | None = None
    nodes_replaced: tuple[str, ...] = ()
    ops_replaced: tuple[str, ...] = ()
    bytes_before: str = "0"
    bytes_after: str = "0"
    symbols: tuple[tuple[str, int], ...] = ()
    detail: tuple[tuple[str, Any], ...] = ()

    def bytes_exprs(self) -> tuple[sympy.Expr, sympy.Expr]:
        """(before, after) as sympy expressions in `BATCH`, `LENGTH`."""
        loc = {"B": BATCH, "L": LENGTH}
        return sympy.sympify(self.bytes_before, locals=loc), sympy.sympify(self.bytes_after, locals=loc)

    def bytes_evaluated(self) -> tuple[int, int]:
        """(before, after) in bytes for the compiled shapes."""
        subs = {BATCH: 1, LENGTH: 1}
        subs.update({BATCH if k == "B" else LENGTH: v for k, v in self.symbols})
        b, a = self.bytes_exprs()
        return int(b.subs(subs)), int(a.subs(subs))


@dataclass(frozen=True)
class NearMiss:
    """A chain that started to match and failed one check.

    Fields: family; pattern (what it looked like, e.g. `dequantize(fp8_block) -> mm`); check (the id of the
    failed check, e.g. `ue8m0_scale_rule`, `rope_channels`); reason (one sentence a user can act on);
    location (user source line of the anchor).
    """

    family: str
    pattern: str
    check: str
    reason: str
    location: SourceLocation | None = None


@dataclass(frozen=True)
class Finding:
    """Something in the graph that stays on a slow path (not a failed match): e.g. a dequantised weight that is
    materialised (`materialised_dequant`) or an ATen op Inductor runs as a fallback kernel (`fallback_op`)."""

    family: str
    kind: str
    message: str
    location: SourceLocation | None = None


@dataclass(frozen=True)
class PassRecord:
    """What one family did to one graph. `enabled=False` records a family switched off by the options;
    `elapsed_s` is the family's wall time on this graph (seconds)."""

    family: str
    enabled: bool
    matches: tuple[MatchRecord, ...] = ()
    near_misses: tuple[NearMiss, ...] = ()
    findings: tuple[Finding, ...] = ()
    note: str = ""
    elapsed_s: float = 0.0

    @property
    def match_count(self) -> int:
        """Number of fused matches."""
        return len(self.matches)

    @property
    def nodes_replaced(self) -> int:
        """Graph nodes removed by all matches of this record."""
        return sum(len(m.nodes_replaced) for m in self.matches)

    def to_dict(self) -> dict:
        """Plain-JSON form (inverse: `PassRecord.from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "PassRecord":
        """Inverse of `to_dict` (used by the record cache next to Inductor's FX-graph cache)."""
        def loc(x):
            """SourceLocation from its dict form (None stays None)."""
            if x is None:
                return None
            return SourceLocation(x["file"], x["line"], x["function"], x.get("code", ""), tuple(x.get("stack", ())))

        def pairs(x):
            """Tuple of (key, value) pairs from a JSON list of pairs."""
            return tuple((k, v) for k, v in x)

        matches = tuple(MatchRecord(m["family"], m["pattern"], m["op"], loc(m["location"]),
                                    tuple(m["nodes_replaced"]), tuple(m["ops_replaced"]), m["bytes_before"],
                                    m["bytes_after"], pairs(m["symbols"]), pairs(m["detail"]))
                        for m in d["matches"])
        misses = tuple(NearMiss(n["family"], n["pattern"], n["check"], n["reason"], loc(n["location"]))
                       for n in d["near_misses"])
        finds = tuple(Finding(f["family"], f["kind"], f["message"], loc(f["location"])) for f in d["findings"])
        return cls(d["family"], d["enabled"], matches, misses, finds, d.get("note", ""), float(d.get("elapsed_s", 0.0)))


class FusionFamily:
    """Base class of a pass family: `name`, a one-line `summary`, and `run(gm) -> PassRecord`.

    `run` rewrites `gm.graph` in place (post-grad ATen IR, functional except for the trailing input
    mutations) and returns the immutable record of what it did. Families must leave the graph valid and
    topologically sorted.
    """

    name: str = ""
    summary: str = ""
    #: Fused ops this family must not emit on this graph (set by the pass manager: ops whose kernels have not yet
    #: run on a GPU, for a graph on CUDA); a chain that would become one is a near-miss `gpu_unvalidated`.
    gated_ops: frozenset = frozenset()

    def run(self, gm: fx.GraphModule) -> PassRecord:  # pragma: no cover - interface
        """Rewrite `gm` in place and return what was matched, skipped and why (abstract: each family implements it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement run()")


# ------------------------------------------------------------------------------------------------ shapes
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


def dsv41_op(name: str):
    """`torch.ops.dsv41.<name>.default`, or None when that op is not registered (kernels not imported)."""
    ns = torch.ops.dsv41
    return getattr(ns, name).default if hasattr(ns, name) else None


# ------------------------------------------------------------------------------------------------ symbolic values
def _runtime_int(v) -> bool:
    """Whether `v` is a SymInt / SymFloat / SymBool whose value is known only at run time."""
    if not isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    expr = getattr(v.node, "expr", None)
    return expr is None or bool(getattr(expr, "free_symbols", True))


def symbolic_part(values: Iterable) -> str | None:
    """A description of the first of `values` (graph nodes, or the plain arguments a rewrite would pass) that is
    known only at run time, or None when all are static: a tensor node with a symbolic size (dynamic shapes), a
    node whose value is a symbolic int (`sym_size`, `min(k, length)`), or a SymInt argument. Strides are not
    looked at: the fused ops read them at run time."""
    for v in values:
        if isinstance(v, (list, tuple)):
            inner = symbolic_part(v)
            if inner is not None:
                return inner
            continue
        if _runtime_int(v):
            return f"the value {v} known only at run time"
        if not isinstance(v, fx.Node):
            continue
        val = v.meta.get("val")
        if isinstance(val, torch.Tensor):
            dims = [f"dim {d} = {s}" for d, s in enumerate(val.shape) if _runtime_int(s)]
            if dims:
                return f"{v.name} ({node_label(v) if v.op == 'call_function' else v.op}) has a size known only at " \
                       f"run time ({', '.join(dims)})"
        elif _runtime_int(val):
            return f"{v.name} ({node_label(v) if v.op == 'call_function' else v.op}) is an int known only at run " \
                   f"time ({val})"
    return None


def static_refusal(family: str, pattern: str, values: Iterable, location: "SourceLocation | None",
                   op: str = "the fused op", check: str = "static_shapes") -> "NearMiss | None":
    """The near-miss of a chain that matched on its compile-time sizes but reads `values` of which one is known
    only at run time (see `symbolic_part`), or None when all are static.

    Why: a family verifies a chain on probe tensors of the compiled sizes and bakes sizes into the fused op's
    arguments and kernel plans; under dynamic shapes (Dynamo's automatic dynamic after a size changes, or
    `dynamic=True`) the same graph then runs at other sizes, where such an op would read the wrong extent. Such a
    chain stays with Inductor, which compiles it for every size. `check` names it (`static_shapes`, or `static_k`
    for a top-k whose k is computed in the graph)."""
    what = symbolic_part(values)
    if what is None:
        return None
    return NearMiss(family, pattern, check, f"{what}; {family} fuses this chain into {op} only at compile-time sizes "
                    "(it verifies the chain and plans the kernel for them), so it stays with Inductor, which handles "
                    "sizes known only at run time", location)


# ------------------------------------------------------------------------------------------------ op classes
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
    """True for ATen view ops (`OpOverload.is_view`: view, reshape, slice, select, permute, expand, ...)."""
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.is_view


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


# ------------------------------------------------------------------------------------------------ regions
class RegionNotClosed(Exception):
    """Raised by `RegionEvaluator` when a region reads a graph input that was not given a probe value."""


def collect_region(outputs: Iterable[fx.Node], inputs: Iterable[fx.Node]) -> list[fx.Node]:
    """Nodes needed to compute `outputs` from `inputs`: every ancestor of `outputs` up to (excluding)
    `inputs`, in graph order. Shape-only nodes (SymInt arithmetic) are included; the caller checks closure."""
    stop = set(inputs)
    seen: set[fx.Node] = set()
    stack = [o for o in outputs if o not in stop]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for a in n.all_input_nodes:
            if a not in stop and a not in seen:
                stack.append(a)
    order = {n: i for i, n in enumerate(next(iter(seen)).graph.nodes)} if seen else {}
    return sorted(seen, key=order.__getitem__)


class RegionEvaluator:
    """Evaluate graph nodes eagerly on real probe tensors.

    `evaluate(nodes, env)` computes each node of `nodes` (recursively through its ancestors) by calling the
    node's ATen target on real tensors, starting from `env` (node -> real tensor). Symbolic sizes are
    replaced by their hints; `get_attr` constants are read from the GraphModule. A placeholder (or an
    ancestor that is not a pure dataflow op) missing from `env` raises `RegionNotClosed`, so a region that
    secretly depends on another tensor is never accepted.
    """

    def __init__(self, gm: fx.GraphModule, max_nodes: int = 2000):
        self.gm = gm
        self.max_nodes = max_nodes

    def evaluate(self, nodes: Iterable[fx.Node], env: Mapping[fx.Node, Any]) -> dict[fx.Node, Any]:
        """Run the region's own ATen nodes eagerly on real probe tensors `env` (node -> value); value per node."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._python_dispatch import _disable_current_modes

        memo: dict[fx.Node, Any] = dict(env)
        with unset_fake_temporarily(), _disable_current_modes(), torch.no_grad():
            for n in nodes:
                self._eval(n, memo)
        return memo

    def _eval(self, root: fx.Node, memo: dict) -> Any:
        # Iterative post-order walk: regions can be hundreds of nodes deep.
        stack = [root]
        steps = 0
        while stack:
            n = stack[-1]
            if n in memo:
                stack.pop()
                continue
            pending = [a for a in n.all_input_nodes if a not in memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            steps += 1
            if steps > self.max_nodes:
                raise RegionNotClosed(f"region larger than {self.max_nodes} nodes")
            memo[n] = self._compute(n, memo)
        return memo[root]

    def _compute(self, n: fx.Node, memo: dict) -> Any:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) and isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat,
                                                                   torch.SymBool)):
            return size_hint(val)  # shape arithmetic: its value is the compiled shape
        if n.op == "get_attr":
            obj = self.gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part)
            return obj
        if n.op != "call_function":
            raise RegionNotClosed(f"region reads {n.op} {n.name} without a probe value")
        if n.target is operator.getitem:
            base = memo[n.args[0]]
            return base[n.args[1]]
        if not (is_dataflow_op(n) or is_table_lookup(n)):
            raise RegionNotClosed(f"region contains {node_label(n)} ({n.name}), not a pure dataflow op")

        def conv(a):
            """Probe value of a node argument, or the size hint of a symbolic int."""
            if isinstance(a, fx.Node):
                return memo[a]
            return size_hint(a)

        args = fx.node.map_aggregate(n.args, conv)
        kwargs = fx.node.map_aggregate(n.kwargs, conv)
        if "device" in kwargs and isinstance(val, torch.Tensor):
            kwargs = dict(kwargs, device=val.device)
        return n.target(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ editing
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


def rms_norm_eps_outside(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The RMSNorm look-alike `weight * x / (sqrt(mean(x^2)) + eps)` (eps outside the square root), in FP32, cast
    back to `x.dtype`: x [..., d], weight [d] or None. Only for naming a near-miss (`rms_eps_reason`)."""
    xf = x.float()
    y = xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rms_eps_reason(lits: Iterable[float], outside_matches: Callable[[float], bool]) -> tuple[str, str]:
    """(check, reason) of an RMS statistic that agrees with `x * rsqrt(mean(x^2) + eps)` at ordinary magnitudes but
    with none of the region's literals `lits` as eps at small ones. `outside_matches(eps)` says whether the region
    computes the eps-outside-the-square-root look-alike (`rms_norm_eps_outside`); the reason then says that, since
    the literal is there, only placed elsewhere."""
    lits = list(lits)
    for eps in lits:
        if outside_matches(eps):
            return "rms_eps", (f"the RMSNorm adds its eps {eps} outside the square root, x / (sqrt(mean(x^2)) + eps); "
                               "the fused op computes x * rsqrt(mean(x^2) + eps) (MODEL.md §2.2), which differs "
                               "for small x")
    return "rms_eps", ("the RMS statistic agrees with x * rsqrt(mean(x^2) + eps) at ordinary magnitudes but, at small "
                       f"ones, with none of the region's literals {lits} as the eps inside the square root")


# ------------------------------------------------------------------------------------------------ undo
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



# ------------------------------------------------------------------------------------------------ probes
def wide_scale_probes(scale: torch.Tensor) -> list:
    """Probe scale tensors (uint8, shaped like `scale`) that together hold every UE8M0 byte 1..254.

    The first probe keeps its exponents in 2^-11 .. 2^4 so that products stay finite in float16; a region that
    equals the reference there but clamps or saturates other exponents (e.g. `exp2((e - 127).clamp(-11, 4))`)
    would pass it, so the weight is also compared on these. Bytes 0 and 255 (2^-127, NaN) are left out: spellings
    may legitimately differ there. At most 8 probes (small scale tensors see fewer bytes).
    """
    n = scale.numel()
    gen = torch.Generator().manual_seed(4321)
    out = []
    for i in range(min(8, -(-254 // max(n, 1)))):
        vals = (torch.arange(n) + i * n) % 254 + 1
        out.append(vals[torch.randperm(n, generator=gen)].reshape(scale.shape).to(torch.uint8).to(scale.device))
    return out


def agree_where_representable(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """`got` equals `ref` (2 ulps) at every element where the reference is 0 or a normal number of its dtype;
    overflowed and subnormal reference values are not compared (rounding spellings may differ there)."""
    if got.shape != ref.shape:
        return False
    if got.dtype == ref.dtype and torch.equal(got, ref):
        return True  # the usual verdict, in one pass (the masked float64 compare below is ~20x slower)
    g, r = got.double(), ref.double()
    fi = torch.finfo(ref.dtype)
    keep = (r == 0) | ((r.abs() >= fi.tiny) & (r.abs() <= fi.max))
    return bool(torch.allclose(g[keep], r[keep], rtol=2 * fi.eps, atol=0.0))
