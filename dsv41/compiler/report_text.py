"""The fusion report as text: rich tables (`render`, `print_report`) and a few plain lines (`summary`).

Renders the report's data, `FusionReport.to_dict()` (or a report JSON read back with `report_schema.read_report`),
never the `FusionReport` object, so a report written by another process renders the same; `FusionReport.print()`,
`str(report)` and `report.summary()` call these. The HTML page is `html.py`'s. Every entry point checks the
report's `schema_version` first (`report_schema.check_schema`).

Public names: `render`, `print_report`, `renderables`, `summary`.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from typing import Any

from ..passes.manager import REWRITE_FAMILIES
from .kernel_counts import OTHER
from .report_schema import check_schema
from .units import human_bytes

__all__ = ["render", "print_report", "renderables", "summary"]

#: Width of the rich console the tables are laid out for (wide enough for the match table's byte expressions).
WIDTH = 160


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


def renderables(d: dict) -> list:
    """The report `d` (`FusionReport.to_dict()`) as rich renderables (tables and lines), in the order they print.

    Raises: ReportSchemaError when `d` is of a newer schema than this dsv41 reads."""
    from rich.table import Table

    check_schema(d)
    fams = d["families"]
    out: list[Any] = []
    summary = Table(title=f"dsv41 fusion report: {len(d['graphs'])} graph(s)", title_justify="left")
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
        for g in d["graphs"]:
            kc = g["kernels"]
            if kc is not None:
                t.add_row(str(g["index"]), g["compile_id"], kc["device"], str(kc["before"]), str(kc["after"]),
                          kc["note"])
        t.add_row("total", "", "", str(k["before"]), str(k["after"]), "")
        out.append(t)
    out += _layer_tables(d)
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
        writes = sc.get("cache_writes_in_place") or []
        if writes:
            failed = [w for w in writes if "failed" in w]
            out.append(f"cache writes moved after the last read of the old contents (Inductor writes them in place): "
                       f"{len(writes) - len(failed)}" + (f"; the pass failed on {len(failed)} graph(s): "
                                                         f"{failed[0]['failed']}" if failed else ""))
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
    cached = sum(bool(g["from_cache"]) for g in d["graphs"])
    if cached:
        out.append(f"{cached} graph(s) came from Inductor's FX-graph cache; their records from dsv41's record cache.")
    return out


def _layer_tables(d: dict) -> list:
    """The launches per layer and per layer role tables, and the notes on the launch count."""
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


def summary(d: dict) -> str:
    """The report `d` (`FusionReport.to_dict()`) in a few plain-text lines: graphs; kernels per step before ->
    after (profiled with option `count_kernels`, else the static launch count after); bytes per step moved by the fused chains before ->
    after; matches per family (each match is one fused op); the `normalize` rewrites apart from them."""
    check_schema(d)
    k, kl, b = d["kernels"], d["kernels_by_layer"] or {}, d["bytes"]
    cached = sum(bool(g["from_cache"]) for g in d["graphs"])
    lines = [f"dsv41 fusion report: {len(d['graphs'])} graph(s)"
             + (f", {cached} served from the caches" if cached else "")]
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


def print_report(d: dict, file=None) -> None:
    """Print the report `d` (`FusionReport.to_dict()`) as rich tables to `file` (default stdout).

    Raises: ReportSchemaError when `d` is of a newer schema than this dsv41 reads."""
    from rich.console import Console

    console = Console(file=file, width=WIDTH)
    for r in renderables(d):
        console.print(r)


def render(d: dict) -> str:
    """The report `d` (`FusionReport.to_dict()`) as plain text: the tables of `print_report`, without colour.

    Raises: ReportSchemaError when `d` is of a newer schema than this dsv41 reads."""
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=WIDTH, force_terminal=False, color_system=None)
    for r in renderables(d):
        console.print(r)
    return buf.getvalue()
