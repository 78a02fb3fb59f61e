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

Output: `to_dict()`, `to_json(path)`, `summary()` (a few lines), `print()` / `str(report)` (rich tables). Source: ARCHITECTURE.md
"Pipeline stages" 6 and "The user's view" (the records are collected as the pipeline runs, never scraped from logs).
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

import sympy

from ..passes.records import BATCH, LENGTH, PassRecord, SourceLocation
from ..passes.manager import FAMILY_ORDER
from .kernel_counts import OTHER, LayerKernelCounts, kernels_by_role, per_layer_by_role
from .units import human_bytes

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


def _where(d: dict | None) -> str:
    """Short form of a location dict for tables: `file.py:line (function) <- caller.py:line (function)`."""
    if d is None:
        return "?"
    here = f"{os.path.basename(d['file'])}:{d['line']} ({d['function']})"
    if len(d.get("stack", ())) >= 2:
        path, _, rest = d["stack"][-2].partition(":")
        here += f" <- {os.path.basename(path)}:{rest}"
    return here


def _breakdown_table(d: dict) -> list:
    """The "where the step goes" table (`breakdown.table_rows`) when the report carries one, else nothing."""
    from rich.markup import escape
    from rich.table import Table

    from .breakdown import table_rows
    bd = d.get("step_breakdown")
    if not bd:
        return []
    headers, rows, foot = table_rows(bd)
    t = Table(title="where the step goes", title_justify="left", caption=escape(foot), caption_justify="left")
    for col in headers:
        t.add_column(col, justify="left" if col == headers[0] else "right")
    for r in rows:
        t.add_row(escape(r[0]), *r[1:])
    return [t]


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
        the regions moved (with their graph) and the dsv41 ops kept on the main stream with the reason; None when
        no graph has a schedule."""
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
                "kept_on_main": [dict(k, graph=gi) for gi, s in per for k in s["kept_on_main"]]}

    def to_dict(self) -> dict:
        """Plain-JSON view: families (aggregated), kernels, bytes (sympy strings + evaluated), graphs, and
        `schedule` / `buckets` when present."""
        import torch

        from .._version import __version__
        fams = {n: self.family(n) for n in self.family_names()}
        fused = [f for n, f in fams.items() if n != "normalize"]
        bb = sum((sympy.sympify(f["bytes_before"], locals={"B": BATCH, "L": LENGTH}) for f in fused), sympy.Integer(0))
        ba = sum((sympy.sympify(f["bytes_after"], locals={"B": BATCH, "L": LENGTH}) for f in fused), sympy.Integer(0))
        return {
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
    def _renderables(self) -> list:
        from rich.table import Table

        d = self.to_dict()
        fams = d["families"]
        out: list[Any] = []
        summary = Table(title=f"dsv41 fusion report: {len(self.graphs)} graph(s)", title_justify="left")
        for col in ("family", "on", "matches", "nodes replaced", "near-misses", "findings", "bytes before -> after",
                    "pass time"):
            summary.add_column(col, justify="left" if col in ("family", "on") else "right")
        for name, f in fams.items():
            moved = "-" if not f["matches"] or name == "normalize" else \
                f"{human_bytes(f['bytes_before_value'])} -> {human_bytes(f['bytes_after_value'])}"
            summary.add_row(name, "on" if f["enabled"] else "OFF", str(f["matches"]), str(f["nodes_replaced"]),
                            str(len(f["near_misses"])), str(len(f["findings"])), moved, f"{f['pass_seconds']:.2f} s")
        out.append(summary)

        sites = Counter()
        for name, f in fams.items():
            if name == "normalize":
                continue
            for s in f["sites"]:
                where = _where(s["location"])
                sites[(name, s["pattern"], where, s["bytes_before"], s["bytes_after"])] += 1
        if sites:
            t = Table(title="matches", title_justify="left")
            for col in ("family", "pattern", "where", "count", "bytes before", "bytes after (B, L symbolic)"):
                t.add_column(col)
            for (name, pat, where, bb, ba), c in sites.items():
                t.add_row(name, pat, where, str(c), bb, ba)
            out.append(t)

        misses = [(n, m) for n, f in fams.items() for m in f["near_misses"]]
        if misses:
            t = Table(title="near-misses (not fused)", title_justify="left")
            for col in ("family", "check", "where", "reason"):
                t.add_column(col)
            for name, m in misses:
                t.add_row(name, m["check"], _where(m["location"]), m["reason"])
            out.append(t)

        finds = Counter()
        for name, f in fams.items():
            for x in f["findings"]:
                finds[(name, x["kind"], x["message"], _where(x["location"]))] += 1
        if finds:
            t = Table(title="findings (left on a slow path)", title_justify="left")
            for col in ("family", "kind", "where", "message", "count"):
                t.add_column(col)
            for (name, kind, msg, where), c in finds.items():
                t.add_row(name, kind, where, msg, str(c))
            out.append(t)

        k = d["kernels"]
        if any(x is not None for x in k["per_graph"]):
            t = Table(title=f"kernels per step ({k['method']})", title_justify="left")
            for col in ("graph", "compile id", "device", "before", "after", "note"):
                t.add_column(col)
            for g in self.graphs:
                kc = g.kernels
                if kc is not None:
                    t.add_row(str(g.index), g.compile_id, kc.device, str(kc.before), str(kc.after), kc.note)
            t.add_row("total", "", "", str(k["before"]), str(k["after"]), "")
            out.append(t)
        out += self._layer_tables(d)
        sc = d.get("schedule")
        if sc is not None:
            t = Table(title=f"side-stream schedule ({'applied' if sc['applied'] else 'planned only'}: {sc['reason']})",
                      title_justify="left")
            for col in ("streams", "moved", "step before (us)", "step after (us)", "critical path (us)"):
                t.add_column(col, justify="right")
            t.add_row(str(sc["streams"]), str(sc["moved"]), f"{sc['before_us']:.2f}", f"{sc['after_us']:.2f}",
                      f"{sc['critical_path_us']:.2f}")
            out.append(t)
            if sc["regions"]:
                t = Table(title="on the side stream", title_justify="left")
                for col in ("graph", "slot", "op", "where", "fork after", "launch after", "join before", "overlap us"):
                    t.add_column(col)
                for r in sc["regions"]:
                    t.add_row(str(r["graph"]), str(r["slot"]), r["op"], r["where"], r["fork_after"], r["launch_after"],
                              r["join_before"], f"{r['overlap_us']:.2f}")
                out.append(t)
            kept = Counter((k["op"], k["reason"]) for k in sc["kept_on_main"])
            if kept:
                t = Table(title="kept on the main stream", title_justify="left")
                for col in ("op", "reason", "count"):
                    t.add_column(col)
                for (op, why), c in kept.items():
                    t.add_row(op, why, str(c))
                out.append(t)
        bk = d.get("buckets")
        if bk is not None:
            t = Table(title=f"batch-size buckets {bk['buckets']}", title_justify="left")
            for col in ("batch", "runs as", "calls"):
                t.add_column(col)
            for row in bk["seen"]:
                t.add_row(str(row["batch"]), row["runs_as"], str(row["calls"]))
            out.append(t)
        out += _breakdown_table(d)
        cached = sum(g.from_cache for g in self.graphs)
        if cached:
            out.append(f"{cached} graph(s) came from Inductor's FX-graph cache; their records from dsv41's record cache.")
        return out

    def _layer_tables(self, d: dict) -> list:
        from rich.table import Table

        kl, roles = d["kernels_by_layer"], d["layer_roles"]
        if kl is None or kl["total"] is None:  # regional compilation before its first decode step
            return []
        t = Table(title=f"launches per call by layer (static, {kl['total']} total)", title_justify="left")
        for col in ("layer", "role", "launches"):
            t.add_column(col, justify="right" if col == "launches" else "left")
        for k, v in kl["by_layer"].items():
            role = roles[int(k)] if roles is not None and k != OTHER and int(k) < len(roles) else ""
            t.add_row(k, role, str(v))
        out: list[Any] = [t]
        by_role = d["kernels_by_role"]
        if by_role is not None:
            t = Table(title="launches per call by layer role", title_justify="left")
            for col in ("role", "layers", "launches", "per layer min / mean / max"):
                t.add_column(col, justify="left" if col == "role" else "right")
            for r, v in by_role.items():
                if r == "per_layer":
                    continue
                p = by_role["per_layer"].get(r)
                t.add_row(r, str(p["layers"]) if p else "-", str(v),
                          f"{p['min']} / {p['mean']:.1f} / {p['max']}" if p else "-")
            out.append(t)
        prof = kl["profiler"]
        if prof is not None:
            out.append(f"static launches {prof['static']} vs profiler count {prof['after']} ({prof['device']}): "
                       + ("equal" if prof["equal"] else "DIFFERENT"))
        if kl["note"]:
            out.append(f"launch count note: {kl['note']}")
        return out

    def summary(self) -> str:
        """The report in a few plain-text lines: graphs; kernels per step before -> after (profiled with option
        `count_kernels`, else the static launch count after); bytes per step moved by the fused chains before ->
        after; matches per family (each match is one fused op); the `normalize` rewrites apart from them."""
        from ..passes.manager import REWRITE_FAMILIES

        d = self.to_dict()
        k, kl, b = d["kernels"], d["kernels_by_layer"] or {}, d["bytes"]
        lines = [f"dsv41 fusion report: {len(self.graphs)} graph(s)"
                 + (f", {sum(g.from_cache for g in self.graphs)} served from the caches"
                    if any(g.from_cache for g in self.graphs) else "")]
        if k["before"] is not None:
            lines.append(f"  kernels per step: {k['before']:,} -> {k['after']:,} (profiled)")
        elif kl.get("total") is not None:
            lines.append(f"  kernels per step: {kl['total']:,} launches after (static count; before: option "
                         "count_kernels)")
        lines.append(f"  bytes per step moved by the fused chains: {human_bytes(b['before_value'])} -> "
                     f"{human_bytes(b['after_value'])}")
        fams = d["families"]
        fused = [f"{n} {f['matches']}" for n, f in fams.items() if n not in REWRITE_FAMILIES and f["matches"]]
        lines.append("  matches per family: " + (", ".join(fused) if fused else "none"))
        rewrites = [f"{n} {fams[n]['matches']}" for n in REWRITE_FAMILIES if n in fams]
        if rewrites:
            lines.append("  rewrites (not fusions): " + ", ".join(rewrites))
        return "\n".join(lines)

    def print(self, file=None) -> None:
        """Print the report as rich tables to `file` (default stdout)."""
        from rich.console import Console

        console = Console(file=file, width=160)
        for r in self._renderables():
            console.print(r)

    def __str__(self) -> str:
        from rich.console import Console

        buf = io.StringIO()
        console = Console(file=buf, width=160, force_terminal=False, color_system=None)
        for r in self._renderables():
            console.print(r)
        return buf.getvalue()

    def __repr__(self) -> str:
        counts = ", ".join(f"{n}={self.family(n)['matches']}" for n in self.family_names())
        return f"FusionReport({len(self.graphs)} graphs; matches: {counts})"
