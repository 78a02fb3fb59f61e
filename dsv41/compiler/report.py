"""FusionReport: what dsv41 did to a compiled model, aggregated per `torch.compile` call, kept per graph.

A compiled model can produce several graphs (graph breaks; prefill and decode shapes recompile). Every graph
the backend compiles under one `torch.compile(...)` call adds a `GraphReport` (one `PassRecord` per family,
kernel counts, and in debug mode the graph's code around the passes) to that call's `FusionReport`; the
report's family view sums over its graphs. `last_report()` returns the report most recently added to.

Per family: matches (count and sites, each with the user's source line from `node.meta["stack_trace"]`),
nodes replaced, near-misses (the failed check and why), findings (slow paths left in the graph), and bytes
moved before/after per match as sympy expressions in `B` (batch) and `L` (sequence extent of the step:
1 at decode, the prompt length at prefill), evaluated for the compiled shapes. Kernels per step before /
after are recorded when the `count_kernels` option is on (see `profiling.py` for what is counted).
Kernel launches per call per decoder layer are always counted, statically from the generated code
(`kernel_counts.py`: `kernels_by_layer`); `set_layer_roles(ModelConfig.roles)` adds `kernels_by_role`.

With a benchmark run, `step_breakdown` ("where the step goes": GPU time, byte floor and launches per op class,
`breakdown.py`) is set on the report and shown as a table.

This module aggregates; it does not render. Output: `to_dict()` (the report as data, with a `schema_version`:
`report_schema.py`, docs/USAGE.md "The report JSON") and `to_json(path)`; the renderers read that dict:
`report_text.py` (`summary()` a few lines, `print()` / `str(report)` rich tables) and `html.py` (the page).
Source: ARCHITECTURE.md "Pipeline stages" 6 and "The user's view" (the records are collected as the pipeline runs,
never scraped from logs).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass

import sympy

from ..passes.records import BATCH, LENGTH, PassRecord, SourceLocation
from ..passes.manager import FAMILY_ORDER
from .kernel_counts import OTHER, LayerKernelCounts, kernels_by_role, per_layer_by_role
from .report_schema import SCHEMA_VERSION

__all__ = ["FusionReport", "GraphReport", "KernelCount", "last_report"]

_LAST: "FusionReport | None" = None


def last_report() -> "FusionReport | None":
    """The FusionReport of the most recent dsv41 compile in this process (None before the first one)."""
    return _LAST


def set_last(report: "FusionReport") -> None:
    """Make `report` what `last_report()` returns (the pipeline calls this once per compiled graph)."""
    global _LAST
    _LAST = report


@dataclass(frozen=True)
class KernelCount:
    """Kernels one execution of a graph launches, eagerly (`before`) and compiled (`after`).

    `device` is "cuda" or "cpu"; `method` says what was counted; `note` explains a missing count.
    """

    device: str
    before: int | None
    after: int | None
    method: str
    note: str = ""


@dataclass(frozen=True)
class GraphReport:
    """One compiled graph: its index in the compile call, Dynamo's compile id, one record per family,
    kernel counts (or None), whether Inductor served it from its cache (records then come from dsv41's record
    cache), the graph's code before / after the passes in debug mode, and its side-stream schedule
    (`streams.StreamPlan.to_dict`, or None when the scheduler did not run)."""

    index: int
    compile_id: str
    records: tuple[PassRecord, ...]
    kernels: KernelCount | None = None
    from_cache: bool = False
    graph_before: str | None = None
    graph_after: str | None = None
    layer_kernels: LayerKernelCounts | None = None
    schedule: dict | None = None
    #: seconds spent profiling the kernel count on this compile (0: not counted, or the kept count was reused)
    count_s: float = 0.0

    def record(self, family: str) -> PassRecord:
        """The record of `family` (KeyError naming the valid families otherwise)."""
        for r in self.records:
            if r.family == family:
                return r
        raise KeyError(f"no family {family!r} in this graph; families: {[r.family for r in self.records]}")

    def to_dict(self) -> dict:
        """Plain-JSON form of this graph's report: index, compile id, cache hit, kernel counts, records."""
        return {"index": self.index, "compile_id": self.compile_id, "from_cache": self.from_cache,
                "kernels": None if self.kernels is None else dict(self.kernels.__dict__),
                "records": [r.to_dict() for r in self.records],
                "graph_before": self.graph_before, "graph_after": self.graph_after,
                "layer_kernels": None if self.layer_kernels is None else self.layer_kernels.to_dict(),
                "schedule": self.schedule, "count_s": round(self.count_s, 2)}


def _loc(loc: SourceLocation | None) -> dict | None:
    if loc is None:
        return None
    return {"where": str(loc), "file": loc.file, "line": loc.line, "function": loc.function, "code": loc.code,
            "stack": list(loc.stack)}


class FusionReport:
    """The fusion report of one `torch.compile(..., backend="dsv41")` call (see module docstring).

    Attributes:
        options: the validated `Options` of the compile call (None if built by hand).
        graphs: one `GraphReport` per compiled graph, in compile order.
    """

    def __init__(self, options=None):
        self.options = options
        self.graphs: list[GraphReport] = []
        #: batch-size buckets seen by a `buckets.BucketedModel` wrapping the compiled model (None: not wrapped).
        self.buckets: dict | None = None
        self.layer_roles: tuple[str, ...] | None = None
        #: set by `regional.compile_regional`: how launches are attributed under regional compilation (None: whole
        #: model)
        self.regional: str | None = None
        #: set by `regional.RegionalModel` on its first decode step: {layer index or "other": [indices of the graphs
        #: that region ran]}; None before (or for a whole-model compile)
        self.regional_step_graphs: dict | None = None
        #: set by `dsv41.bench` after profiling decode steps: the "where the step goes" table
        #: (`breakdown.step_breakdown`); None when no benchmark ran
        self.step_breakdown: dict | None = None

    def set_layer_roles(self, roles) -> None:
        """Name the role of each decoder layer (e.g. `ModelConfig.roles`: swa / full / reindex / reuse), so the
        report can sum launches per role; the backend itself never sees the model config."""
        self.layer_roles = None if roles is None else tuple(str(r) for r in roles)

    def add_graph(self, graph: GraphReport) -> None:
        """Append a graph's report (the compiler calls this once per compiled graph)."""
        self.graphs.append(graph)

    # -------------------------------------------------------------------------------------------- views
    def family_names(self) -> list[str]:
        """Family names in pass order, then any extra family seen in a graph's records."""
        names = [n for n in FAMILY_ORDER]
        for g in self.graphs:
            names += [r.family for r in g.records if r.family not in names]
        return names

    def family(self, name: str) -> dict:
        """Aggregate of one family over all graphs (the value of `to_dict()["families"][name]`)."""
        recs = [(g.index, r) for g in self.graphs for r in g.records if r.family == name]
        enabled = bool(recs) and all(r.enabled for _, r in recs)
        if not recs and self.options is not None:
            enabled = name not in self.options.disable
        sites, misses, finds = [], [], []
        before = after = sympy.Integer(0)
        before_v = after_v = 0
        for gi, r in recs:
            for m in r.matches:
                b, a = m.bytes_exprs()
                bv, av = m.bytes_evaluated()
                before, after = before + b, after + a
                before_v, after_v = before_v + bv, after_v + av
                sites.append({"graph": gi, "pattern": m.pattern, "op": m.op, "location": _loc(m.location),
                              "nodes_replaced": len(m.nodes_replaced), "ops_replaced": list(m.ops_replaced),
                              "bytes_before": m.bytes_before, "bytes_after": m.bytes_after,
                              "bytes_before_value": bv, "bytes_after_value": av, "symbols": dict(m.symbols),
                              "detail": dict(m.detail)})
            misses += [{"graph": gi, "pattern": n.pattern, "check": n.check, "reason": n.reason,
                        "location": _loc(n.location)} for n in r.near_misses]
            finds += [{"graph": gi, "kind": f.kind, "message": f.message, "location": _loc(f.location)}
                      for f in r.findings]
        notes = sorted({r.note for _, r in recs if r.note})
        return {"enabled": enabled, "pass_seconds": sum(r.elapsed_s for _, r in recs), "matches": len(sites), "nodes_replaced": sum(s["nodes_replaced"] for s in sites),
                "near_misses": misses, "findings": finds, "sites": sites, "bytes_before": str(before),
                "bytes_after": str(after), "bytes_before_value": before_v, "bytes_after_value": after_v,
                "note": "; ".join(notes)}

    def kernels(self) -> dict:
        """Kernels per step before/after, summed over the graphs that were counted, plus each graph's count."""
        counted = [g.kernels for g in self.graphs if g.kernels is not None]
        ok = [k for k in counted if k.before is not None and k.after is not None]
        return {"before": sum(k.before for k in ok) if ok else None, "after": sum(k.after for k in ok) if ok else None,
                "method": ok[0].method if ok else (counted[0].method if counted else None),
                "per_graph": [None if g.kernels is None else dict(g.kernels.__dict__) for g in self.graphs]}

    def kernels_by_layer(self) -> dict:
        """Static launches per call of the compiled graphs, per decoder layer (`kernel_counts.py`), summed over
        the graphs that were counted: {total, by_layer {"0": n, ..., "other": n}, no_provenance, by_kind,
        method, note, graphs_counted, profiler, detail {layer: {what: launches}}, per_graph (each graph's own
        count or None)}. `profiler` compares
        the total with the profiler's count of the same graphs when `count_kernels` was on ({device, after,
        static, equal}; on CUDA the GPU run checks it)."""
        counted = [g.layer_kernels for g in self.graphs if g.layer_kernels is not None]
        if not counted:
            return {"total": None, "by_layer": None, "no_provenance": None, "by_kind": None, "method": None,
                    "note": "no graph counted", "graphs_counted": 0, "profiler": None, "detail": None,
                    "per_graph": [None for _ in self.graphs]}
        by_layer: Counter = Counter()
        kinds: Counter = Counter()
        detail: dict = {}
        for c in counted:
            by_layer.update(c.layer_dict())
            kinds.update(dict(c.by_kind))
            for layer, what in c.to_dict()["detail"].items():
                detail.setdefault(layer, Counter()).update(what)
        layers = {str(k): by_layer[str(k)] for k in sorted(int(x) for x in by_layer if x != OTHER)}
        layers[OTHER] = by_layer[OTHER]
        total = sum(c.total for c in counted)
        prof = None
        k = self.kernels()
        if k["after"] is not None:
            devices = sorted({g.kernels.device for g in self.graphs if g.kernels is not None})
            prof = {"device": ",".join(devices), "after": k["after"], "static": total, "equal": k["after"] == total}
        return {"total": total, "by_layer": layers, "no_provenance": sum(c.no_provenance for c in counted),
                "by_kind": dict(sorted(kinds.items())), "method": counted[0].method,
                "note": "; ".join(sorted({c.note for c in counted if c.note})), "graphs_counted": len(counted),
                "profiler": prof, "detail": {k: dict(sorted(v.items())) for k, v in detail.items()},
                "per_graph": [None if g.layer_kernels is None else g.layer_kernels.to_dict() for g in self.graphs]}

    def kernel_origins(self) -> dict:
        """{Inductor kernel name: [origin, ...]} over every counted graph (`kernel_counts.kernel_origins`: user
        source lines of the kernel's nodes and the ATen ops it computes). Kernel names are numbered per graph, so
        one name may list the origins of several graphs' kernels."""
        out: dict = {}
        for g in self.graphs:
            for name, found in (g.layer_kernels.origins if g.layer_kernels is not None else ()):
                out[name] = list(dict.fromkeys(out.get(name, []) + list(found)))
        return out

    def regional_kernels_by_layer(self) -> dict | None:
        """Under regional compilation: launches of one decode step per decoder layer, each layer counted as the
        static launches (`kernel_counts`) of the graphs its region ran during `RegionalModel`'s first decode step
        (`regional_step_graphs`; embedding and head regions are `other`). Same keys as `kernels_by_layer()`;
        None before a decode step ran."""
        steps = self.regional_step_graphs
        if not steps:
            return None
        by_layer: Counter = Counter()
        kinds: Counter = Counter()
        uncounted = 0
        for tag, indices in steps.items():
            for i in indices:
                lk = self.graphs[i].layer_kernels if 0 <= i < len(self.graphs) else None
                if lk is None:
                    uncounted += 1
                    continue
                by_layer[str(tag)] += lk.total
                kinds.update(dict(lk.by_kind))
        layers = {str(k): by_layer[str(k)] for k in sorted(int(x) for x in by_layer if x != OTHER)}
        layers[OTHER] = by_layer[OTHER]
        note = f"{uncounted} region call(s) ran a graph without a launch count" if uncounted else ""
        return {"total": sum(layers.values()), "by_layer": layers, "no_provenance": None,
                "by_kind": dict(sorted(kinds.items())),
                "method": "regional: per layer, the static launches of the compiled graphs that layer's region ran "
                          "in the first decode step (embedding and head regions: other)",
                "note": note, "graphs_counted": len({i for v in steps.values() for i in v}), "profiler": None,
                "detail": None, "per_graph": None}

    def kernels_by_role(self) -> dict | None:
        """`kernels_by_layer()` summed per layer role ({role: launches, ..., "other": n}, plus
        "per_layer": {role: {layers, min, max, mean}}), or None before `set_layer_roles` or without counts."""
        kl = self.regional_kernels_by_layer() if self.regional else self.kernels_by_layer()
        by_layer = None if kl is None else kl["by_layer"]
        if self.layer_roles is None or by_layer is None:
            return None
        out = kernels_by_role(by_layer, self.layer_roles)
        out["per_layer"] = per_layer_by_role(by_layer, self.layer_roles)
        return out

    def schedule(self) -> dict | None:
        """Side-stream schedule over the graphs (to_dict key `schedule`): whether it was applied, streams used,
        nodes moved, step time before / after and critical path under the cost model (us, summed over graphs),
        the regions moved (with their graph), the dsv41 ops kept on the main stream with the reason and the cache
        writes moved after their last read (`write_order.order_cache_writes`, with their graph); None when no graph
        has a schedule."""
        per = [(g.index, g.schedule) for g in self.graphs if g.schedule is not None]
        if not per:
            return None
        return {"applied": any(s["applied"] for _, s in per), "reason": "; ".join(sorted({s["reason"] for _, s in per})),
                "streams": max(s["streams"] for _, s in per), "moved": sum(s["moved"] for _, s in per),
                "before_us": round(sum(s["before_us"] for _, s in per), 3),
                "after_us": round(sum(s["after_us"] for _, s in per), 3),
                "critical_path_us": round(sum(s["critical_path_us"] for _, s in per), 3),
                "cost_model": per[0][1].get("cost_model"),
                "regions": [dict(r, graph=gi) for gi, s in per for r in s["regions"]],
                "kept_on_main": [dict(k, graph=gi) for gi, s in per for k in s["kept_on_main"]],
                "cache_writes_in_place": [dict(w, graph=gi) for gi, s in per
                                          for w in s.get("cache_writes_in_place", ())]}

    def to_dict(self) -> dict:
        """Plain-JSON view, the report as data (fields: docs/USAGE.md "The report JSON"): `schema_version`
        (`report_schema.SCHEMA_VERSION`), families (aggregated), kernels, bytes (sympy strings + evaluated), graphs,
        and `schedule` / `buckets` / `step_breakdown` when present."""
        import torch

        from .._version import __version__
        fams = {n: self.family(n) for n in self.family_names()}
        fused = [f for n, f in fams.items() if n != "normalize"]
        bb = sum((sympy.sympify(f["bytes_before"], locals={"B": BATCH, "L": LENGTH}) for f in fused), sympy.Integer(0))
        ba = sum((sympy.sympify(f["bytes_after"], locals={"B": BATCH, "L": LENGTH}) for f in fused), sympy.Integer(0))
        return {
            "schema_version": SCHEMA_VERSION,
            "dsv41_version": __version__, "torch_version": torch.__version__,
            "options": None if self.options is None else self.options.to_dict(),
            "symbols": {"B": "batch size (leading dim 0 of the activations)",
                        "L": "sequence extent of the step (leading dim 1: 1 at decode, prompt length at prefill)"},
            "families": fams,
            "kernels": self.kernels(),
            "kernels_by_layer": self.regional_kernels_by_layer() if self.regional else self.kernels_by_layer(),
            "layer_roles": None if self.layer_roles is None else list(self.layer_roles),
            "kernels_by_role": self.kernels_by_role(),
            **({"regional": self.regional} if self.regional else {}),
            "bytes": {"before": str(bb), "after": str(ba),
                      "before_value": sum(f["bytes_before_value"] for f in fused),
                      "after_value": sum(f["bytes_after_value"] for f in fused)},
            "graphs": [g.to_dict() for g in self.graphs],
            **({"schedule": sched} if (sched := self.schedule()) is not None else {}),
            **({"buckets": self.buckets} if self.buckets is not None else {}),
            **({"step_breakdown": self.step_breakdown} if getattr(self, "step_breakdown", None) else {}),
        }

    def to_json(self, path: str | os.PathLike) -> None:
        """Write `to_dict()` as indented JSON to `path` (parent directories are created)."""
        path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)

    # -------------------------------------------------------------------------------------------- text
    def summary(self) -> str:
        """The report in a few plain-text lines (`report_text.summary` of `to_dict()`): graphs; kernels per step
        before -> after; bytes per step moved by the fused chains; matches per family; the `normalize` rewrites."""
        from .report_text import summary
        return summary(self.to_dict())

    def print(self, file=None) -> None:
        """Print the report as rich tables to `file` (default stdout; `report_text.print_report`)."""
        from .report_text import print_report
        print_report(self.to_dict(), file=file)

    def __str__(self) -> str:
        from .report_text import render
        return render(self.to_dict())

    def __repr__(self) -> str:
        counts = ", ".join(f"{n}={self.family(n)['matches']}" for n in self.family_names())
        return f"FusionReport({len(self.graphs)} graphs; matches: {counts})"
