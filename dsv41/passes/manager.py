"""The dsv41 pass manager: runs the fusion families in a fixed order on Inductor's post-grad graph.

Order (`FAMILY_ORDER`, ARCHITECTURE.md "Pipeline stages" 2 and "Fusion patterns"): the registry (registry.py)
finds every family module of this package and sorts the families by the `after` / `before` their declarations
(`SPEC = register_family(...)`) name, ties by name; each declaration says why in a comment. `normalize` runs first,
so later families see one form of each chain; `dispatch` after the families that fuse chains around matmuls,
since it also audits what stays on a slow path; the GEMV-grouping families last. `dsv41 report --patterns` prints
every family in this order with what its chains look for.

A family can fail; the compile cannot. Each family runs on the graph as the previous one left it; if it raises,
the graph is put back as it was before that family ran (not half rewritten), the other families go on, and the
family's record carries a `Finding` of kind `family_failed` naming the exception and the user's source line of
the node it was examining. With `strict=True` (option `strict`, environment `DSV41_STRICT=1`, on in the test
suite) the exception is re-raised instead, so a failing family fails its test.

`PassManager` is an Inductor `CustomGraphPass`: the compiler installs it as
`torch._inductor.config.post_grad_custom_post_pass` for dsv41's own compile only (config patch), and its
`uuid()` hashes the sources the passes read (every pass and kernel module, and the dsv41 modules those import,
followed import by import: the model's reference math such as formats, RoPE, norm and mHC, but not the rest of
the model, so editing `model/generate.py` keeps the cache), the options that change what the passes do, and
which dsv41 ops are registered — so Inductor's FX-graph cache never serves a graph compiled with other passes
(docs/ARCHITECTURE.md, "The cache key").
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .records import Finding, PassRecord, SourceLocation
from .engine import (FusionFamily, GraphFingerprint, fused_ops, node_label, restore_graph, snapshot_graph,
                     unvalidated_ops)
from .normalize import restore_batch1_mm
from .registry import discover, family_order

__all__ = ["FAMILY_ORDER", "FAMILIES", "REWRITE_FAMILIES", "PassManager", "GraphPassResult", "GPU_UNVALIDATED",
           "GPU_UNVALIDATED_OPS", "FamilyFailed"]

#: The registry: every family class of dsv41/passes/ (registry.discover), in the order it runs
#: (registry.family_order of the declarations' after / before). Each carries its `FamilySpec` (`spec`: name,
#: summary, chains as data, place in the order; engine/chain.py); everything below is read from it.
_FOUND = discover()
FAMILY_ORDER: tuple[str, ...] = family_order(cls.spec for cls in _FOUND.values())
FAMILIES: dict[str, type[FusionFamily]] = {name: _FOUND[name] for name in FAMILY_ORDER}
_SPECS = tuple(FAMILIES[name].spec for name in FAMILY_ORDER)
#: Families that rewrite the graph into the forms the matchers read without fusing anything (`rewrites_only`): the
#: report lists their matches as rewrites, apart from the fusions.
REWRITE_FAMILIES: tuple[str, ...] = tuple(spec.name for spec in _SPECS if spec.rewrites_only)
#: Families whose Triton kernels have been tested only under the interpreter, never compiled for a GPU (a spec with
#: `gpu_validated=False`): the backend leaves them off for graphs on CUDA unless the option `gpu_unvalidated` is set
#: (compiler/options.py). Empty since 2026-11-30: `sparse_attention` and `indexer` passed the H200 kernel tests and
#: gave eager's greedy tokens end to end (tiny, FP32; bench/results/2026-11-30_h200_s6). A new family starts so
#: until it has.
GPU_UNVALIDATED: tuple[str, ...] = tuple(spec.name for spec in _SPECS if not spec.gpu_validated)
#: The same per fused op (a `Chain` with `gpu_validated=False`), for an op added to a family that has run on a GPU:
#: on CUDA, a chain that would become one of these is left unfused (near-miss `gpu_unvalidated`) unless the option
#: `gpu_unvalidated` is set. A variant of an op is named `op(argument)`, e.g. "mhc_mixes(norm_weight)" for mhc_mixes
#: with the RMS weight. Empty since 2026-12-06: linear_fp8_scaled and mhc_mixes(norm_weight) passed their GPU tests
#: on an H100 (tests/test_kernels_gpu_fp8_scaled.py, tests/test_kernels_gpu.py; bench/results/2026-12-06_h100_s26).
#: A new op variant starts so until it has.
GPU_UNVALIDATED_OPS: tuple[str, ...] = unvalidated_ops(_SPECS)
#: Every dsv41 op a family may emit (the uuid hashes which of them are registered).
_FUSED_OPS: tuple[str, ...] = fused_ops(_SPECS)


@dataclass(frozen=True)
class GraphPassResult:
    """What the manager did to one post-grad graph: one `PassRecord` per family in `FAMILY_ORDER`, and in
    debug mode the graph's Python code before and after the passes (`None` otherwise)."""

    records: tuple[PassRecord, ...]
    graph_before: str | None = None
    graph_after: str | None = None


#: The directory holding the `dsv41` package (the parent of dsv41/); module names are resolved under it.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Packages whose every module is a root of the uuid's sources: the passes, and the kernels (the fused ops' fake
#: functions, CPU references and the compile-time weight layouts a rewritten graph bakes in).
_ROOT_PACKAGES = ("passes", "kernels")


def _module_file(parent: str, name: str) -> str | None:
    """The file of dsv41 module `name` ("dsv41.model.formats") under `parent`, or None if it is not one."""
    parts = name.split(".")
    if parts[0] != "dsv41":
        return None
    base = os.path.join(parent, *parts)
    if os.path.isfile(base + ".py"):
        return base + ".py"
    init = os.path.join(base, "__init__.py")
    return init if os.path.isfile(init) else None


def _module_name(parent: str, path: str) -> str:
    rel = os.path.relpath(path, parent)[:-len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _stamp(path: str) -> tuple:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=None)
def _import_statements(path: str, stamp: tuple) -> tuple:
    """(level, module, names) of every import in `path`, function-level ones too (`names` None for `import x`);
    cached per file state `stamp` (mtime, size)."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((0, a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or "", tuple((a.name, a.asname) for a in node.names)))
    return tuple(out)


def _imports(parent: str, path: str) -> set[str]:
    """Files of the dsv41 modules `path` imports. `from X import name` is X's submodule `name` where there is one;
    otherwise the module that defines `name`: for a package X, the module its `__init__` imports `name` from
    (so importing a re-exported name does not pull in everything the package's `__init__` imports)."""
    package = _module_name(parent, path)
    if not path.endswith("__init__.py"):
        package = package.rpartition(".")[0]
    found: set[str] = set()
    for level, module, names in _import_statements(path, _stamp(path)):
        if level:
            base = package.split(".")[:len(package.split(".")) - (level - 1)]
            module = ".".join(base + ([module] if module else []))
        if names is None:
            f = _module_file(parent, module)
            if f is not None:
                found.add(f)
            continue
        for name, _ in names:
            f = _module_file(parent, f"{module}.{name}")
            if f is None:
                f = _defining_file(parent, module, name)
            if f is not None:
                found.add(f)
    return found


def _defining_file(parent: str, module: str, name: str, depth: int = 0) -> str | None:
    """The file that defines `name` imported from dsv41 module `module`: the module itself, or, for a package
    whose `__init__` re-exports the name, the module it takes it from."""
    f = _module_file(parent, module)
    if f is None or not f.endswith("__init__.py") or depth > 8:
        return f
    for level, src, names in _import_statements(f, _stamp(f)):
        if names is None or not any((alias or n) == name for n, alias in names):
            continue
        orig = next(n for n, alias in names if (alias or n) == name)
        if level:
            base = module.split(".")[:len(module.split(".")) - (level - 1)]
            src = ".".join(base + ([src] if src else []))
        return _module_file(parent, f"{src}.{orig}") or _defining_file(parent, src, orig, depth + 1)
    return f


# Modules in those packages that no compile runs: the family test harness (tests import it, the passes never do),
# so editing it keeps Inductor's caches.
_NOT_READ_BY_PASSES = {("passes", "testing.py")}


def _source_files(parent: str | None = None) -> list[str]:
    """The sources `uuid()` hashes: every module of dsv41/passes and dsv41/kernels, and every dsv41 module they
    import, followed import by import (function-level imports too). The passes verify their matches against the
    model's reference math (formats, RoPE, norm, mHC, ...), so those model modules are in; model modules no pass
    or kernel imports (generate.py, model.py, ...) are not, so editing them keeps Inductor's caches."""
    parent = parent or _PACKAGE_PARENT
    todo = [os.path.join(parent, "dsv41", d, f) for d in _ROOT_PACKAGES
            for f in sorted(os.listdir(os.path.join(parent, "dsv41", d)))
            if f.endswith(".py") and (d, f) not in _NOT_READ_BY_PASSES]
    seen: set[str] = set()
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo.extend(_imports(parent, f) - seen)
    return sorted(seen)


def _drop_restored(rec: PassRecord, restored: set) -> PassRecord:
    """`rec` without the `normalize` batch1_bmm matches whose bmm was restored to Inductor's mm form."""
    if rec.family != "normalize":
        return rec
    keep = tuple(m for m in rec.matches if dict(m.detail).get("bmm") not in restored)
    return dataclasses.replace(rec, matches=keep)


class FamilyFailed(RuntimeError):
    """Raised in strict mode when a family raises on a graph: names the family and the node it was examining; the
    family's own exception is the `__cause__`."""


def _examined_node(family: FusionFamily, tb) -> fx.Node | None:
    """The graph node the family was examining when it raised: its explicit `family.anchor` if it set one, else the
    innermost frame of the family's own module that holds a node (a local named `anchor`, a `site` with an
    `anchor`, or any node local with a stack trace)."""
    if isinstance(getattr(family, "anchor", None), fx.Node):
        return family.anchor
    module_file = getattr(sys.modules.get(type(family).__module__), "__file__", None)
    frames = [f for f, _ in traceback.walk_tb(tb)]
    for frame in reversed(frames):
        if module_file is None or os.path.abspath(frame.f_code.co_filename) != os.path.abspath(module_file):
            continue
        local = frame.f_locals
        for name in ("anchor", "site", "st"):
            v = local.get(name)
            v = v if isinstance(v, fx.Node) else getattr(v, "anchor", None)
            if isinstance(v, fx.Node):
                return v
        for v in local.values():
            if isinstance(v, fx.Node) and v.meta.get("stack_trace"):
                return v
    return None


def _failure_record(family: FusionFamily, exc: BaseException, node: fx.Node | None) -> PassRecord:
    """The record of a family that raised on a graph: no matches, one `family_failed` finding."""
    where = SourceLocation.from_node(node)
    at = f" while examining {node.name} ({node_label(node)})" if node is not None else ""
    msg = (f"{family.name} raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{at}; the "
           "graph was left as it was before this family ran and the other families went on (option strict=True "
           "re-raises)")
    return PassRecord(family.name, True, findings=(Finding(family.name, "family_failed", msg, where),),
                      note=f"failed on this graph ({type(exc).__name__}); its changes were undone")


class PassManager(CustomGraphPass):
    """Run the enabled families on a post-grad graph and keep one `GraphPassResult` per graph in `results`.

    Args:
        disabled: family names to switch off (each still gets a record with `enabled=False`).
        notes: {family: why it is off} for records of families switched off for another reason than `disable`.
        debug: keep the graph's code before/after the passes in each result.
        chained: a post-grad custom pass that was installed before dsv41's (or a list of them); it runs after
            dsv41's families, and its uuid is part of ours (None if it has none, which disables caching).
        strict: re-raise a family's exception (as `FamilyFailed`) instead of undoing its changes and recording a
            `family_failed` finding.
        gated_ops: fused op names no family may emit on these graphs (`FusionFamily.gated_ops`).
        side_stream: whether the side-stream schedule will be applied to these graphs (`FusionFamily.side_stream`:
            a family may leave work apart that the schedule can overlap).
    Raises:
        ValueError: a name in `disabled` that is not a family.
        FamilyFailed: (when called, strict only) a family raised on the graph.
    """

    def __init__(self, disabled: Iterable[str] = (), debug: bool = False, chained=None, notes=None,
                 strict: bool = False, gated_ops: Iterable[str] = (), side_stream: bool = False):
        disabled = frozenset(disabled)
        self.notes = dict(notes or {})
        unknown = sorted(disabled - set(FAMILY_ORDER))
        if unknown:
            raise ValueError(f"unknown pass families {unknown}; valid families: {', '.join(FAMILY_ORDER)}")
        self.disabled = disabled
        self.debug = bool(debug)
        self.strict = bool(strict)
        self.gated_ops = frozenset(gated_ops)
        self.side_stream = bool(side_stream)
        if chained is None:
            self.chained: tuple = ()
        elif isinstance(chained, (list, tuple)):
            self.chained = tuple(chained)
        else:
            self.chained = (chained,)
        self.results: list[GraphPassResult] = []

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        before = graph.python_code("self").src if self.debug else None
        records = []
        self._snap = None
        for name in FAMILY_ORDER:
            if name in self.disabled:
                records.append(PassRecord(name, False, note=self.notes.get(name, "disabled by options")))
                continue
            t0 = time.perf_counter()
            family = FAMILIES[name]()
            family.gated_ops, family.side_stream = self.gated_ops, self.side_stream
            rec = self._guarded(graph, family, lambda: family.run(gm))
            records.append(dataclasses.replace(rec, elapsed_s=time.perf_counter() - t0))
        restored = self._guarded(graph, FAMILIES["normalize"](), lambda: restore_batch1_mm(gm))
        if isinstance(restored, PassRecord):  # the restore raised: the bmm forms stay, which Inductor lowers too
            records = [dataclasses.replace(r, findings=r.findings + restored.findings) if r.family == "normalize"
                       else r for r in records]
        elif restored:
            records = [_drop_restored(r, restored) for r in records]
        self._snap = None
        after = graph.python_code("self").src if self.debug else None
        for p in self.chained:
            p(graph)
        self.results.append(GraphPassResult(tuple(records), before, after))

    def _guarded(self, graph: fx.Graph, family: FusionFamily, step):
        """`step()` (which rewrites `graph` for `family`), or, when it raises, the graph put back as it was and a
        `family_failed` record (strict: `FamilyFailed`). A snapshot is taken only when the graph changed since the
        last one."""
        if self._snap is None and not self.strict:
            self._snap = (snapshot_graph(graph), GraphFingerprint(graph))
        try:
            out = step()
            graph.lint()
        except Exception as exc:  # noqa: BLE001 - any failure of a family must leave the user's compile working
            node = _examined_node(family, exc.__traceback__)
            if self.strict:
                where = f" while examining {node.name}" if node is not None else ""
                raise FamilyFailed(f"dsv41 pass family {family.name!r} raised {type(exc).__name__}{where}: {exc}") \
                    from exc
            restore_graph(graph, self._snap[0])
            return _failure_record(family, exc, node)
        if not self.strict and not self._snap[1].same(graph):
            self._snap = None
        return out

    def uuid(self) -> str | None:
        """SHA-256 (hex) of the sources the passes read (`_source_files`: pass and kernel modules and the dsv41
        modules they import), the options and the registered dsv41 ops; None if a chained pass has no uuid
        (Inductor then bypasses its cache, the only safe choice). Files are keyed by their path inside the
        package, so two checkouts with the same sources share the caches."""
        h = hashlib.sha256()
        for path in _source_files():
            with open(path, "rb") as f:
                h.update(os.path.relpath(path, _PACKAGE_PARENT).replace(os.sep, "/").encode() + b"\0" + f.read())
        state = {"disabled": sorted(self.disabled), "debug": self.debug, "strict": self.strict,
                 "gated_ops": sorted(self.gated_ops), "side_stream": self.side_stream,
                 "torch": torch.__version__, "ops": [op for op in _FUSED_OPS if hasattr(torch.ops.dsv41, op)]}
        h.update(json.dumps(state, sort_keys=True).encode())
        for p in self.chained:
            u = p.uuid() if hasattr(p, "uuid") else None
            if u is None:
                return None
            h.update(repr(u).encode())
        return h.hexdigest()
