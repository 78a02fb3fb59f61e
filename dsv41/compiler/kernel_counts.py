"""Kernel launches of one compiled graph, per decoder layer, read from the code Inductor generated.

Issue 4 ("kernels launched per decode step, per layer role") and issue 7 ("per layer role for dsv41"). After
Inductor compiles a graph, its Python wrapper (`CompiledFxGraph.source_code`) lists every launch of one call of
the graph in order: Inductor's own kernels (`cpp_fused_*(...)` on CPU, `triton_*.run(...)` on CUDA), library and
fallback calls (`extern_kernels.mm(...)`, `torch.ops.aten.*`, dsv41's fused `torch.ops.dsv41.*`) and buffer
copies/fills (`buf.copy_(...)`, `buf.zero_()`). Nothing has to run, so the count exists on CPU too.

Attribution (`count_launches`): the compile runs with Inductor's kernel provenance on
(`trace.provenance_tracking_level`, `provenance_config()`); Inductor then writes a
`# [Provenance debug handles] <kernel>:<n>` line before each launch it codegens and records, in
`CompiledFxGraph.inductor_provenance_mapping_str`, the post-grad FX nodes each `<kernel>:<n>` computes. A node's
layer is the outermost numbered submodule of its `nn_module_stack` path (`layers.3` in
`L['self'].layers.3.attn.wq` -> 3, `layer_of_path`); nodes without one are traced back through their `from_node`
provenance to the Dynamo graph's node of that name. A launch belongs to the layer most of its non-view nodes come
from (a kernel doing layer i's residual update and the first reduction of layer i+1's norm belongs to i; a tie goes
to the later layer); nodes without a layer do not vote, and a launch none of whose nodes has a layer (embedding,
final norm, head, per-step math outside the blocks) counts as `other`, and so does a launch Inductor wrote without
provenance (counted again in `no_provenance`). Where a launch has no handle
but a `Source Nodes: [...]` comment (names of Dynamo-graph nodes), those names are used.

dsv41 ops (`count_launches`' `op_census`): the wrapper calls a dsv41 op once, but its CUDA host code may launch
more (the sparse attention's split combine, the indexer's two-stage top-k, layout copies). With the post-grad graph
at hand, each op call on CUDA tensors counts what the launch census (`dsv41/kernels/census.py`) finds when it runs
the op's CUDA host code on meta tensors of the call's shapes; a side-stream program counts its steps that way. A
call it cannot census counts once, said in `note`; so does every op call of a graph Inductor served from its cache
without a kept count (no post-grad graph). On the H200, `h200` decode counted 1,763 launches statically against
1,815 profiled (bench/results/2026-11-30_h200_s13); the attention combine, one per non-SWA layer, is 38 of the 52.

Mapping layers to roles (SWA, Full, Reindex, Reuse) needs the model config, which a torch.compile backend does
not see: `kernels_by_role(by_layer, roles)` does it for callers that know it (`ModelConfig.roles`).
Source: issue 4 / issue 7, ARCHITECTURE.md "Pipeline stages" 6; torch/_inductor/debug.py provenance tracking.
"""

from __future__ import annotations

import ast
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
import torch.fx as fx

__all__ = ["LayerKernelCounts", "Launch", "WrapperCapture", "provenance_config", "parse_launches", "count_launches",
           "count_captured", "merge_counts", "graph_counts", "save_counts", "load_counts", "layer_of_path",
           "node_layers", "kernel_origins", "kernels_by_role", "per_layer_by_role", "STATIC_METHOD", "OTHER"]

#: Bucket of launches that belong to no decoder layer.
OTHER = "other"
STATIC_METHOD = ("static launches per call of the compiled graph: Inductor kernels, extern/fallback op calls and "
                 "buffer copies/fills listed in Inductor's generated wrapper, attributed to decoder layers through "
                 "Inductor's kernel provenance (post-grad nodes -> nn_module_stack); a dsv41 op on CUDA counts the "
                 "kernels its CUDA host code launches for the call's shapes (launch census, kernels/census.py)")

_HANDLE = re.compile(r"\[Provenance debug handles\]\s+(\S+:\d+)\s*$")
_SOURCE_NODES = re.compile(r"Source Nodes: \[([^\]]*)\]")
#: Wrapper-level calls that launch nothing: allocation, views, asserts, collective waits.
_NOT_LAUNCH_OPS = re.compile(r"(^|\.)(_alloc_from_pool|_assert_\w*|wait_tensor|sym_\w+|as_strided|view|"
                             r"_reinterpret_tensor|record_stream|empty\w*|resize_\w*)(\.|$)")
_BUFFER_METHODS = {"copy_", "zero_", "fill_", "index_put_", "scatter_", "scatter_add_", "index_copy_"}
#: dsv41's side-stream ops (`dsv41/kernels/streams.py`): fork and join record / wait on events and launch nothing;
#: a launch runs its program's steps, each op of which launches as it would on the main stream.
_STREAM_EVENT_OPS = re.compile(r"^torch\.ops\.dsv41\.stream_(fork|join)(\.|$)")
_STREAM_LAUNCH_OP = re.compile(r"^torch\.ops\.dsv41\.stream_launch(\.|$)")
_NOT_LAUNCH_FUNCS = {"get_args", "benchmark_compiled_module"}
_PATH_NORMALISE = re.compile(r"\._modules\[|\[|\]|'|\"")
_DOTTED_LAYER = re.compile(r"(?:^|\.)[A-Za-z_]\w*\.(\d+)(?:\.|$)")
_FLAT_LAYER = re.compile(r"_modules_[A-Za-z_]\w*?_modules_(\d+)(?:_|$)|[a-z]_(\d+)(?:_|$)")


# ------------------------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class Launch:
    """One launch site of the wrapper, in program order.

    Fields: kernel (what is called: `cpp_fused_add_0`, `triton_poi_fused_add_0`, `extern_kernels.addmm`,
    `torch.ops.dsv41.mhc_mixes.default`, `copy_`); kind (`cpp`, `triton`, ... as `async_compile.<kind>`, or
    `extern`, `op`, `buffer`); handle (`<kernel>:<n>` provenance key or None); sources (post-grad node names
    from provenance, else Dynamo node names from the `Source Nodes` comment); line (1-based in the wrapper).
    """

    kernel: str
    kind: str
    line: int
    handle: str | None = None
    sources: tuple[str, ...] = ()
    sources_are_post_grad: bool = True


@dataclass(frozen=True)
class LayerKernelCounts:
    """Static launches of one call of a compiled graph, per decoder layer.

    Fields:
        total: launches in the wrapper (sum of `by_layer` counts and `other`).
        by_layer: ((layer index, launches), ...) sorted by layer.
        other: launches of no layer (embedding, head, per-step math outside the blocks, no provenance).
        no_provenance: launches Inductor wrote without provenance (included in `other`).
        by_kind: ((kind, launches), ...): `cpp` / `triton` (Inductor kernels), `extern`, `op`, `buffer`.
        method: what was counted (`STATIC_METHOD`); note: why something is missing or approximate.
        detail: ((layer or "other", ((what, launches), ...)), ...): what each layer launches; `what` is the called
            op for extern / op / buffer launches (`torch.ops.dsv41.mhc_mixes.default`, `extern_kernels.mm`) and
            the kind for Inductor's generated kernels (`cpp`, `triton`).
        origins: ((kernel name, (origin, ...)), ...): for each Inductor-generated kernel, where its work comes
            from (`kernel_origins`): the user source lines of its post-grad nodes, most nodes first, and the ATen
            ops it computes. The profiler shows the same kernel names, so a costly kernel of a profiled step can
            be traced to the model code (the bench's `kernel_time_top` rows carry them).
    """

    total: int
    by_layer: tuple[tuple[int, int], ...] = ()
    other: int = 0
    no_provenance: int = 0
    by_kind: tuple[tuple[str, int], ...] = ()
    method: str = STATIC_METHOD
    note: str = ""
    detail: tuple = ()
    origins: tuple = ()

    def layer_dict(self) -> dict:
        """{"0": n, "1": n, ..., "other": n} (JSON keys are strings)."""
        out = {str(k): v for k, v in self.by_layer}
        out[OTHER] = self.other
        return out

    def to_dict(self) -> dict:
        """Plain-JSON form (inverse: `from_dict`)."""
        return {"total": self.total, "by_layer": self.layer_dict(), "no_provenance": self.no_provenance,
                "by_kind": dict(self.by_kind), "method": self.method, "note": self.note,
                "detail": {str(k): dict(v) for k, v in self.detail},
                "origins": {k: list(v) for k, v in self.origins}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "LayerKernelCounts":
        """Inverse of `to_dict`."""
        layers = {k: int(v) for k, v in d["by_layer"].items()}
        other = layers.pop(OTHER, 0)
        detail = tuple((int(k) if k != OTHER else OTHER, tuple(sorted(v.items())))
                       for k, v in (d.get("detail") or {}).items())
        return cls(int(d["total"]), tuple(sorted((int(k), v) for k, v in layers.items())), other,
                   int(d.get("no_provenance", 0)), tuple(sorted(d.get("by_kind", {}).items())),
                   d.get("method", STATIC_METHOD), d.get("note", ""), detail,
                   tuple((k, tuple(v)) for k, v in sorted((d.get("origins") or {}).items())))


# ------------------------------------------------------------------------------------------------ capture
def provenance_config() -> dict:
    """Inductor config patch that makes it record kernel -> post-grad node provenance (empty if unsupported).

    `trace.provenance_tracking_level` 2 ("basic") where the installed torch has it (2.9+), else the older boolean
    `trace.provenance_tracking`. Both only add comments to the generated code and a JSON string to the output.
    """
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    if "trace.provenance_tracking_level" in known:
        return {"trace.provenance_tracking_level": 2}
    if "trace.provenance_tracking" in known:
        return {"trace.provenance_tracking": True}
    return {}


@dataclass
class WrapperCapture:
    """An `inner_compile` for `compile_fx` that keeps what the compile produced for `count_launches`.

    `compile_fx(gm, inputs, inner_compile=capture.inner_compile)`: each call runs Inductor's `compile_fx_inner`
    and records the post-grad graph (Inductor's post-grad passes rewrite the graph it is given in place), the
    wrapper's source code and the provenance JSON of the `CompiledFxGraph` it returns. `dynamo_layers` is filled
    by `remember_dynamo_graph` before the compile (the Dynamo graph is changed by compile_fx).
    """

    graphs: list = field(default_factory=list)
    sources: list = field(default_factory=list)
    provenance: list = field(default_factory=list)
    dynamo_layers: dict = field(default_factory=dict)

    def remember_dynamo_graph(self, gm: fx.GraphModule) -> None:
        """Record the layer of every node of the Dynamo graph (fallback for nodes known by their origin's name)."""
        self.dynamo_layers = {n.name: _meta_layer(n) for n in gm.graph.nodes}

    def inner_compile(self, gm, example_inputs, *args, **kwargs):
        """Inductor's `compile_fx_inner`, recording its post-grad graph and generated code."""
        from torch._inductor.compile_fx import compile_fx_inner

        from .fallback_text import bounded_operator_text

        with bounded_operator_text():  # also for a backward graph, compiled after compile_fx returned
            out = compile_fx_inner(gm, example_inputs, *args, **kwargs)
        self.graphs.append(gm)
        self.sources.append(getattr(out, "source_code", None))
        self.provenance.append(getattr(out, "inductor_provenance_mapping_str", None))
        return out


# ------------------------------------------------------------------------------------------------ layers
def layer_of_path(path: str) -> int | None:
    """Index of the outermost numbered submodule in a module path, or None.

    `L['self'].layers.3.attn.wq` -> 3, `L['self']._modules['layers']._modules['3'].ffn` -> 3,
    `L__self___layers_3_attn` -> 3, `L['self'].embed` -> None. The first `<name>.<int>` component counts, so
    numbered submodules inside a layer (`layers.3.ffn.experts.5`) do not move the launch to another layer.
    """
    norm = re.sub(r"\.+", ".", _PATH_NORMALISE.sub(".", str(path))).strip(".")
    m = _DOTTED_LAYER.search(norm)
    if m:
        return int(m.group(1))
    if "." not in norm:
        m = _FLAT_LAYER.search(norm)
        if m:
            return int(m.group(1) or m.group(2))
    return None


def _meta_layer(node: fx.Node) -> int | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for value in stack.values():  # outermost first: the first entry with a number is the layer
        path = value[0] if isinstance(value, (tuple, list)) else value
        layer = layer_of_path(path)
        if layer is not None:
            return layer
    return None


def _origin_names(node: fx.Node) -> list[str]:
    """Names of the nodes `node` was created from, nearest first, then their sources (`from_node` chain)."""
    out, todo = [], list(node.meta.get("from_node") or ())
    while todo:
        src = todo.pop(0)
        name = getattr(src, "name", "")
        if name:
            out.append(name)
        todo.extend(getattr(src, "from_node", ()) or ())
    return out


def node_layers(graph: fx.Graph, dynamo_layers: Mapping[str, int | None] | None = None) -> dict:
    """{node name: (layer or None, is_view, position)} for every call_function node of a post-grad graph.

    The layer comes from the node's `nn_module_stack`, else from the first node of its `from_node` provenance
    that the Dynamo graph (`dynamo_layers`: name -> layer) places in a layer.
    """
    dynamo_layers = dynamo_layers or {}
    out = {}
    for i, n in enumerate(graph.nodes):
        if n.op != "call_function":
            continue
        layer = _meta_layer(n)
        if layer is None:
            for name in _origin_names(n):
                if dynamo_layers.get(name) is not None:
                    layer = dynamo_layers[name]
                    break
        t = n.target
        is_view = isinstance(t, torch._ops.OpOverload) and t.is_view
        out[n.name] = (layer, is_view, i)
    return out


# ------------------------------------------------------------------------------------------------ parsing
def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _kernel_defs(tree: ast.Module) -> dict:
    """{name: kind} of the module-level `name = async_compile.<kind>(...)` kernel definitions."""
    out = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
            fn = _dotted(stmt.value.func) or ""
            if fn.startswith("async_compile.") and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                out[stmt.targets[0].id] = fn.split(".", 1)[1].split("_", 1)[0]
    return out


def _program_launches(call: ast.Call) -> int:
    """Launches of a `stream_launch` call: the steps of its program (the JSON string literal among its arguments)
    whose op launches work; 1 when the program is not a literal the wrapper spells out."""
    import json
    for arg in call.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.lstrip().startswith("{"):
            try:
                steps = json.loads(arg.value)["steps"]
            except (ValueError, KeyError, TypeError):
                return 1
            return sum(1 for st in steps if not _NOT_LAUNCH_OPS.search(str(st.get("op", "")).replace("::", ".")))
    return 1


def _classify(call: ast.Call, kernels: Mapping[str, str]) -> tuple[str, str] | None:
    """(kernel, kind) when `call` launches work, else None (`parse_launches` counts a `stream_launch` as the
    launches of its program)."""
    if isinstance(call.func, ast.Attribute) and call.func.attr in _BUFFER_METHODS:
        return call.func.attr, "buffer"  # e.g. buf3.copy_(buf1), reinterpret_tensor(...).zero_()
    fn = _dotted(call.func)
    if fn is None or _STREAM_EVENT_OPS.search(fn):
        return None
    head, _, last = fn.rpartition(".")
    if fn in kernels:
        return fn, kernels[fn]
    if last == "run" and head in kernels:
        return head, kernels[head]
    if fn.startswith("extern_kernels."):
        return fn, "extern"
    if fn.startswith(("torch.ops.", "aten.", "prims.", "inductor_ops.", "_quantized.")):
        return None if _NOT_LAUNCH_OPS.search(fn) else (fn, "op")
    return None


def _comments_before(lines: Sequence[str], lineno: int, after: int, kernel: str) -> tuple[str | None, tuple[str, ...]]:
    """(provenance handle, Source Nodes names) of the launch of `kernel` on line `lineno` (1-based): the nearest
    comments between the previous launch (line `after`) and it. Statements may sit in between (Inductor writes
    `stream0 = get_raw_stream(0)` or a device guard before a launch); a handle must name `kernel`, so the handle
    of something that is not counted as a launch is never taken."""
    handle, sources = None, ()
    for i in range(lineno - 2, max(after, 1) - 1, -1):
        text = lines[i].strip()
        if not text.startswith("#"):
            continue
        m = _HANDLE.search(text)
        if m and handle is None and m.group(1).rsplit(":", 1)[0] == kernel:
            handle = m.group(1)
        m = _SOURCE_NODES.search(text)
        if m and not sources:
            sources = tuple(s.strip() for s in m.group(1).split(",") if s.strip())
    return handle, sources


def parse_launches(source: str, provenance: str | Mapping | None = None) -> list[Launch]:
    """Every launch site of an Inductor Python wrapper, in program order.

    Args:
        source: `CompiledFxGraph.source_code` (a Python module).
        provenance: `CompiledFxGraph.inductor_provenance_mapping_str` (JSON) or its parsed dict, or None.
    Returns: one `Launch` per call in the wrapper's functions (`call`, graph partitions, subgraphs) that runs a
        kernel; the code of `get_args` / `benchmark_compiled_module` is skipped. dsv41's side-stream fork / join
        launch nothing; a `stream_launch` gives one `Launch` per launching step of its program (same site).
    Raises: SyntaxError when `source` is not Python (e.g. a C++ wrapper).
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    kernels = _kernel_defs(tree)
    mapping = _kernel_to_post(provenance)
    found = []

    def visit(fn: ast.AST) -> None:
        """Collect (line, column, kernel, launches) for every launch call inside `fn`."""
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                hit = _classify(node, kernels)
                if hit is not None:
                    times = _program_launches(node) if _STREAM_LAUNCH_OP.search(hit[0]) else 1
                    found.append((node.lineno, node.col_offset, hit, times))

    for top in tree.body:
        for fn in _outer_functions(top):
            visit(fn)
    out = []
    previous = 0
    for lineno, _, (kernel, kind), times in sorted(set(found)):
        handle, names = _comments_before(lines, lineno, previous, kernel)
        previous = lineno
        if handle is not None and handle in mapping:
            launch = Launch(kernel, kind, lineno, handle, tuple(mapping[handle]), True)
        else:
            launch = Launch(kernel, kind, lineno, handle, names, False)
        out += [launch] * times
    return out


def _outer_functions(stmt: ast.stmt) -> Iterable[ast.AST]:
    """Outermost function definitions in `stmt` (module-level defs and methods of module-level classes)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if stmt.name not in _NOT_LAUNCH_FUNCS:
            yield stmt
    elif isinstance(stmt, ast.ClassDef):
        for s in stmt.body:
            yield from _outer_functions(s)


def _kernel_to_post(provenance) -> dict:
    """{"<kernel>:<n>": [post-grad node names]} from Inductor's provenance JSON (any version's key name)."""
    if provenance is None:
        return {}
    if isinstance(provenance, str):
        try:
            provenance = json.loads(provenance)
        except ValueError:
            return {}
    if not isinstance(provenance, Mapping):
        return {}
    for key in ("cppCodeToPost", "tritonKernelToPost", "kernelToPost"):
        v = provenance.get(key)
        if isinstance(v, Mapping) and v:
            return {str(k): list(x) for k, x in v.items() if isinstance(x, list)}
    return {}


# ------------------------------------------------------------------------------------------------ counting
def _launch_layer(launch: Launch, post: Mapping, dynamo_layers: Mapping) -> int | None:
    """The layer of one launch: majority of its layered non-view nodes, ties to the later layer (module docstring)."""
    if launch.sources_are_post_grad:
        known = [post[n] for n in launch.sources if n in post]
    else:  # Source Nodes comment: Dynamo node names, listed in topological order
        known = [(dynamo_layers.get(n), False, i) for i, n in enumerate(launch.sources)]
    layered = [x for x in known if x[0] is not None]
    compute = [x for x in layered if not x[1]] or layered
    if not compute:
        return None
    votes = Counter(x[0] for x in compute)
    last = {x[0]: x[2] for x in sorted(compute, key=lambda x: x[2])}
    return max(votes, key=lambda layer: (votes[layer], last[layer]))


def count_launches(source: str | None, provenance=None, post_grad: fx.Graph | None = None,
                   dynamo_layers: Mapping[str, int | None] | None = None,
                   op_census: bool | None = None) -> LayerKernelCounts:
    """Launches of one call of a compiled graph, per decoder layer (see the module docstring for the rules).

    Args:
        source: the wrapper's Python source (`CompiledFxGraph.source_code`); None gives a count of 0 with a note.
        provenance: `inductor_provenance_mapping_str` (JSON) or None.
        post_grad: the post-grad graph Inductor lowered (node meta: nn_module_stack, from_node), or None (e.g.
            a cache hit, where only the Dynamo graph is known).
        dynamo_layers: {Dynamo graph node name: layer or None}.
        op_census: count each dsv41 op call (and side-stream program) as the kernels its CUDA host code launches
            for the call's shapes (`kernels/census.py`; needs `post_grad`) instead of one; None: for calls on CUDA
            tensors only (a CPU call runs the reference, not kernels), True: also for CPU graphs (as if on CUDA).
    Returns: a `LayerKernelCounts` whose `by_layer` counts plus `other` equal `total`.
    """
    if not source:
        return LayerKernelCounts(0, note="no generated wrapper source (Inductor produced no Python wrapper)")
    try:
        launches = parse_launches(source, provenance)
    except SyntaxError as e:
        return LayerKernelCounts(0, note=f"wrapper is not Python ({e.msg}): launches not counted")
    dynamo_layers = dynamo_layers or {}
    notes = []
    if post_grad is not None and op_census is not False:
        launches, unknown = _census_sites(launches, post_grad, op_census)
        if unknown:
            notes.append(f"{unknown} dsv41 op call(s) could not be censused on meta tensors and count as the "
                         "wrapper lists them")
    elif post_grad is None and op_census is not False and any(
            x.kind == "op" and x.kernel.startswith("torch.ops.dsv41.") for x in launches):
        notes.append("no post-grad graph (a cache hit): each dsv41 op call counts once, not its kernels")
    post = node_layers(post_grad, dynamo_layers) if post_grad is not None else {}
    if not post and dynamo_layers:
        # Without the post-grad graph, provenance names resolve through the Dynamo graph (postToPre).
        post = _post_from_pre(provenance, dynamo_layers)
    layers: Counter = Counter()
    detail: dict = {}
    other = no_prov = 0
    for launch in launches:
        layer = _launch_layer(launch, post, dynamo_layers)
        if layer is None:
            other += 1
            no_prov += not launch.sources
        else:
            layers[layer] += 1
        what = launch.kernel if launch.kind in ("extern", "op", "buffer") else launch.kind
        detail.setdefault(OTHER if layer is None else layer, Counter())[what] += 1
    kinds = Counter(x.kind for x in launches)
    origins = kernel_origins(launches, post_grad) if post_grad is not None else ()
    if launches and not any(x.handle for x in launches):
        notes.append("Inductor wrote no provenance handles: only launches with a Source Nodes comment are "
                     "attributed to layers")
    return LayerKernelCounts(len(launches), tuple(sorted(layers.items())), other, no_prov,
                             tuple(sorted(kinds.items())), STATIC_METHOD, "; ".join(notes), _detail(detail), origins)


def _op_node(launch: Launch, by_name: Mapping[str, fx.Node]) -> fx.Node | None:
    """The post-grad node a dsv41 op launch calls: among the nodes its provenance handle names, the one whose
    target is the called op (None without post-grad provenance)."""
    if not launch.sources_are_post_grad:
        return None
    want = launch.kernel[len("torch.ops."):]
    for name in launch.sources:
        node = by_name.get(name)
        if node is not None and node.op == "call_function" and str(node.target) == want:
            return node
    return None


def _all_nodes(graph: fx.Graph) -> list:
    """Nodes of `graph` and of the subgraphs its module holds (branches of `cond`, bodies of `while_loop`)."""
    nodes = list(graph.nodes)
    owner = getattr(graph, "owning_module", None)
    if owner is not None:
        for name, mod in owner.named_modules():
            if name and isinstance(mod, fx.GraphModule):
                nodes += list(mod.graph.nodes)
    return nodes


def _node_value(a):
    if isinstance(a, fx.Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(_node_value(x) for x in a)
    if isinstance(a, dict):
        return {k: _node_value(v) for k, v in a.items()}
    return a


def _on_cuda(values) -> bool:
    from torch.utils._pytree import tree_leaves
    return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in tree_leaves(values))


def _census_sites(launches: list[Launch], post_grad: fx.Graph, op_census: bool | None) -> tuple[list, int]:
    """`launches` with each dsv41 op site repeated as many times as the launch census counts for its call
    (`count_launches`' `op_census`), and the number of op sites that could not be censused (left as listed).

    A site's call is the post-grad node its provenance names (`_op_node`). Inductor sometimes names only a view
    next to the op (a fallback kernel's origins): then every call of that op in the graph is censused, and their
    count is used when they all agree."""
    try:
        from ..kernels.census import op_launches
    except Exception:  # diagnostic count: without the kernels (no Triton) every op call counts as listed
        return launches, sum(1 for x in launches if x.kind == "op" and x.kernel.startswith("torch.ops.dsv41."))
    nodes = _all_nodes(post_grad)
    by_name = {n.name: n for n in nodes}
    memo: dict = {}

    def applies(node: fx.Node) -> bool:
        """Whether the census counts this call: forced (`op_census`), or its arguments are CUDA tensors."""
        return bool(op_census) or _on_cuda((_node_value(node.args), _node_value(node.kwargs)))

    def count(node: fx.Node) -> int | None:
        """Census of one op call, None when it fails."""
        if node not in memo:
            try:
                memo[node] = op_launches(node.target, _node_value(node.args), _node_value(node.kwargs))
            except Exception:  # diagnostic count: any failure leaves the wrapper's count
                memo[node] = None
        return memo[node]

    out: list = []
    unknown = i = 0
    while i < len(launches):
        launch = launches[i]
        j = i + 1
        while j < len(launches) and launches[j] is launch:  # one site (a side-stream program's steps)
            j += 1
        site = launches[i:j]
        i = j
        if launch.kind != "op" or not launch.kernel.startswith("torch.ops.dsv41."):
            out += site
            continue
        node = _op_node(launch, by_name)
        if node is not None:
            calls = [node]
        else:
            want = launch.kernel[len("torch.ops."):]
            calls = [x for x in nodes if x.op == "call_function" and str(x.target) == want]
        if not calls:
            unknown += bool(op_census)  # no call to read: the device is unknown, so only a forced census notes it
            out += site
            continue
        if not applies(calls[0]):
            out += site
            continue
        found = {count(x) for x in calls}
        if len(found) == 1 and None not in found:
            site = [launch] * found.pop()
        else:
            unknown += 1
        out += site
    return out, unknown


#: Origins kept per kernel: source lines, then ATen op names.
_ORIGIN_LINES = 3
_ORIGIN_OPS = 4


def kernel_origins(launches: Sequence[Launch], post_grad: fx.Graph) -> tuple:
    """((kernel, (origin, ...)), ...) for the Inductor-generated kernels among `launches` (sorted by name).

    A kernel's origins are the user source lines of the post-grad nodes its provenance lists, as
    `basename:line (function): code`, the line most of its nodes come from first (at most `_ORIGIN_LINES`), then
    `ops: aten.x xN, ...` (the `_ORIGIN_OPS` commonest ATen ops). Launches without post-grad provenance and
    extern / op / buffer launches (named by what they call) are skipped.
    """
    from ..passes.records import SourceLocation

    by_name = {n.name: n for n in post_grad.nodes}
    lines: dict = {}
    ops: dict = {}
    for launch in launches:
        if launch.kind in ("extern", "op", "buffer") or not launch.sources_are_post_grad:
            continue
        for name in launch.sources:
            node = by_name.get(name)
            if node is None or node.op != "call_function":
                continue
            loc = SourceLocation.from_node(node)
            if loc is not None:
                text = f"{os.path.basename(loc.file)}:{loc.line} ({loc.function}): {loc.code}"[:160]
                lines.setdefault(launch.kernel, Counter())[text] += 1
            target = node.target
            op = f"{target.namespace}.{target._schema.name.split('::')[-1]}" if hasattr(target, "_schema") \
                else getattr(target, "__name__", str(target))
            ops.setdefault(launch.kernel, Counter())[op] += 1
    out = []
    for kernel in sorted(set(lines) | set(ops)):
        found = [t for t, _ in lines.get(kernel, Counter()).most_common(_ORIGIN_LINES)]
        common = ops.get(kernel, Counter()).most_common(_ORIGIN_OPS)
        if common:
            found.append("ops: " + ", ".join(f"{o} x{n}" for o, n in common))
        out.append((kernel, tuple(found)))
    return tuple(out)


def _detail(detail: Mapping) -> tuple:
    order = sorted((k for k in detail if k != OTHER)) + ([OTHER] if OTHER in detail else [])
    return tuple((k, tuple(sorted(detail[k].items()))) for k in order)


def _post_from_pre(provenance, dynamo_layers: Mapping) -> dict:
    if isinstance(provenance, str):
        try:
            provenance = json.loads(provenance)
        except ValueError:
            return {}
    post_to_pre = (provenance or {}).get("postToPre") if isinstance(provenance, Mapping) else None
    if not isinstance(post_to_pre, Mapping):
        return {}
    out = {}
    for i, (name, pres) in enumerate(post_to_pre.items()):
        found = [dynamo_layers.get(p) for p in pres or ()]
        found = [x for x in found if x is not None]
        out[name] = (found[-1] if found else None, False, i)
    return out


def merge_counts(counts: Sequence[LayerKernelCounts]) -> LayerKernelCounts:
    """One count for several wrappers of one graph (e.g. a graph compiled in partitions)."""
    if len(counts) == 1:
        return counts[0]
    layers: Counter = Counter()
    kinds: Counter = Counter()
    detail: dict = {}
    origins: dict = {}
    for c in counts:
        layers.update(dict(c.by_layer))
        kinds.update(dict(c.by_kind))
        for k, v in c.detail:
            detail.setdefault(k, Counter()).update(dict(v))
        for k, v in c.origins:
            # Kernel names are numbered per graph: one name may stand for different kernels of two graphs.
            origins[k] = tuple(dict.fromkeys(origins.get(k, ()) + tuple(v)))
    return LayerKernelCounts(sum(c.total for c in counts), tuple(sorted(layers.items())),
                             sum(c.other for c in counts), sum(c.no_provenance for c in counts),
                             tuple(sorted(kinds.items())), STATIC_METHOD,
                             "; ".join(sorted({c.note for c in counts if c.note})), _detail(detail),
                             tuple(sorted(origins.items())))


def count_captured(capture: WrapperCapture, from_cache: bool = False) -> LayerKernelCounts | None:
    """`count_launches` over everything `capture` saw (None when Inductor compiled nothing through it).

    `from_cache`: Inductor served the graph from its FX-graph cache, so the graph it was handed is not the
    post-grad graph: names then resolve through the Dynamo graph only.
    """
    if not capture.sources:
        return None
    counts = [count_launches(src, prov, None if from_cache else gm.graph, capture.dynamo_layers)
              for src, prov, gm in zip(capture.sources, capture.provenance, capture.graphs)]
    return merge_counts(counts)


# ------------------------------------------------------------------------------------------------ store
def _kept_path(directory: str, key: str) -> str:
    # The rules of this module and the code the launch census runs (the kernels' host code and the model's
    # reference functions some of them fall back to) are part of what a kept count means: a changed module never
    # reads an old count.
    import glob
    import hashlib
    h = hashlib.sha256()
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hosts = [p for sub in ("kernels", "model") for p in sorted(glob.glob(os.path.join(pkg, sub, "*.py")))]
    for path in [__file__, *hosts]:
        with open(path, "rb") as f:
            h.update(f.read())
    rules = h.hexdigest()[:12]
    return os.path.join(directory, f"{key}.kernels.{rules}.json")


def save_counts(directory: str, key: str, counts: LayerKernelCounts) -> None:
    """Keep `counts` next to dsv41's pass records (`<directory>/<key>.kernels.<rules>.json`, `<rules>` a hash of
    this module and of the code the launch census runs) for a later compile that Inductor serves from its caches."""
    path = _kept_path(directory, key)
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(counts.to_dict(), f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory only loses the count on later cache hits


def load_counts(directory: str, key: str) -> LayerKernelCounts | None:
    """Counts saved by `save_counts`, or None."""
    try:
        with open(_kept_path(directory, key)) as f:
            return LayerKernelCounts.from_dict(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------------------------ roles
def kernels_by_role(by_layer: Mapping, roles: Sequence[str]) -> dict:
    """Sum per-layer launch counts by layer role.

    Args:
        by_layer: {layer index (int or str): launches, ..., "other": launches} (`LayerKernelCounts.layer_dict`).
        roles: role of each layer by index, e.g. `ModelConfig.roles` (`swa`, `full`, `reindex`, `reuse`).
    Returns: {role: launches, ..., "other": launches}, roles in first-appearance order; a layer index outside
        `roles` counts under `other`. The values sum to the sum of `by_layer`.
    """
    out: dict = {r: 0 for r in dict.fromkeys(roles)}
    out[OTHER] = 0
    for k, v in by_layer.items():
        if k == OTHER:
            out[OTHER] += int(v)
            continue
        i = int(k)
        out[roles[i] if 0 <= i < len(roles) else OTHER] += int(v)
    return out


def per_layer_by_role(by_layer: Mapping, roles: Sequence[str]) -> dict:
    """{role: {"layers": n, "min": launches, "max": launches, "mean": launches}} over the layers of each role
    (every layer of `roles` counts, a layer with no launch as 0): what one SWA / Full / Reindex / Reuse layer costs."""
    per: dict = {}
    counts = {int(k): int(v) for k, v in by_layer.items() if k != OTHER}
    for i, r in enumerate(roles):
        per.setdefault(r, []).append(counts.get(i, 0))
    return {r: {"layers": len(v), "min": min(v), "max": max(v), "mean": sum(v) / len(v)} for r, v in per.items()}


def graph_counts(capture: WrapperCapture, passes_ran: bool, records_dir: str | None,
                 key: str | None) -> LayerKernelCounts | None:
    """The compiler's entry point: count what `capture` saw, keep it for cache hits, or load the kept count.

    Args:
        capture: the `WrapperCapture` the graph was compiled through.
        passes_ran: whether dsv41's post-grad passes ran on this compile (False: Inductor served it from a cache,
            so the graph handed to Inductor is not the post-grad graph).
        records_dir / key: where dsv41's record cache keeps this graph's records (None: no caching).
    Returns: the counts, or None when nothing was compiled and nothing was kept. Never raises: a failure becomes
        a count of 0 with the reason in `note` (counting is diagnostic and must not fail a compile).
    """
    if not passes_ran and records_dir is not None and key is not None:
        # Served from Inductor's caches: the count made when this graph was compiled (same key, same code) was
        # read off the post-grad graph, which a cache hit does not have.
        kept = load_counts(records_dir, key)
        if kept is not None:
            return kept
    try:
        counts = count_captured(capture, from_cache=not passes_ran)
    except Exception as e:  # diagnostic only; kept like a count, or every later compile would redo this one
        counts = LayerKernelCounts(0, note=f"counting failed: {type(e).__name__}: {e}"[:300])
    if counts is not None and passes_ran and records_dir is not None and key is not None:
        save_counts(records_dir, key, counts)
    return counts
