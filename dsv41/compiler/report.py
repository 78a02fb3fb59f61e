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

Output: `to_dict()`, `to_json(path)`, `print()` / `str(report)` (a rich table). Source: ARCHITECTURE.md
"Pipeline stages" 6 and "The user's view"; STYLE.md (records collected as the pipeline runs).
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

import sympy

from ..passes.base import BATCH, LENGTH, PassRecord, SourceLocation
from ..passes.manager import FAMILY_ORDER

__all__ = ["FusionReport", "GraphReport", "KernelCount", "last_report"]

_LAST: "FusionReport | None" = None


def last_report() -> "FusionReport | None":
    """The FusionReport of the most recent dsv41 compile in this process (None before the first one)."""
    return _LAST


def _set_last(report: "FusionReport") -> None:
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
    cache), and the graph's code before / after the passes in debug mode."""

    index: int
    compile_id: str
    records: tuple[PassRecord, ...]
    kernels: KernelCount | None = None
    from_cache: bool = False
    graph_before: str | None = None
    graph_after: str | None = None

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
                "graph_before": self.graph_before, "graph_after": self.graph_after}


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


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


class FusionReport:
    """The fusion report of one `torch.compile(..., backend="dsv41")` call (see module docstring).

    Attributes:
        options: the validated `Options` of the compile call (None if built by hand).
        graphs: one `GraphReport` per compiled graph, in compile order.
    """

    def __init__(self, options=None):
        self.options = options
        self.graphs: list[GraphReport] = []

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

    def to_dict(self) -> dict:
        """Plain-JSON view: families (aggregated), kernels, bytes (sympy strings + evaluated), graphs."""
        import torch

        from .. import __version__
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
            "bytes": {"before": str(bb), "after": str(ba),
                      "before_value": sum(f["bytes_before_value"] for f in fused),
                      "after_value": sum(f["bytes_after_value"] for f in fused)},
            "graphs": [g.to_dict() for g in self.graphs],
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
                f"{_human(f['bytes_before_value'])} -> {_human(f['bytes_after_value'])}"
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
        cached = sum(g.from_cache for g in self.graphs)
        if cached:
            out.append(f"{cached} graph(s) came from Inductor's FX-graph cache; their records from dsv41's record cache.")
        return out

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
