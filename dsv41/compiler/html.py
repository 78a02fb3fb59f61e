"""The fusion report as one self-contained HTML page (ARCHITECTURE.md "Pipeline stages" 6).

`render_html(report_dict, bench=None, png_path=None)` turns `FusionReport.to_dict()` (optionally with a
`dsv41.bench` result and its plot) into a page with inline CSS and no scripts or external resources, so it can
be mailed or attached to an issue as it is. It leads with its point; sections, in order:

- summary: kernels per step and bytes moved per step before -> after, matches (fusions) apart from the
  `normalize` rewrites, what was left unfused, pass time, options; then a plot of ops and bytes per step per
  family, before / after (`report_plot.family_svg`, inline SVG: drawn from the report alone, no benchmark needed);
- per family: on/off, matches, nodes replaced, near-misses, findings, bytes before -> after;
- fused sites, heaviest first (bytes saved per step): the first `_SITES_SHOWN` rows, the rest folded, and the
  matches that move no bytes (rewrites, index math) folded apart; one row per (family, pattern, source line,
  layer when the match records one);
- near-misses with the failed check and the reason; findings (what stays on a slow path);
- kernels per step, total and per graph; kernel launches per decoder layer (folded) and per layer role;
- the side-stream schedule, folded, and left out when it was planned but not applied (CPU, streams off);
- "where the step goes" (`breakdown.py`): time, byte floor and launches per op class, when the report or the
  benchmark's dsv41 row carries the table;
- the benchmark table and plot (PNG embedded as base64) when given; each graph's code in debug mode.

Nothing is wider than the window: tables of five columns or more take the page's width with column widths from
their content (`_widths`) and wrap inside; code wraps; the plot scales (checked in headless Chromium by
tests/test_html_layout.py).

Every piece of text from the report is escaped with `html.escape` (family names, patterns, source code and
reasons come from user code and must never become markup).

The `dsv41 report` command that builds a preset, compiles and runs it and writes this page is app-layer code:
`dsv41/report_cli.py`.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
from collections import Counter

from .report_schema import check_schema
from .units import human_bytes

__all__ = ["render_html", "write_html", "read_png"]

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_LAYER_KEYS = ("layer", "layer_id", "layer_idx")

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0 auto; padding: 16px 24px;
       max-width: 1280px; color: #1d1d1f; background: #ffffff; font-size: 14px; line-height: 1.35; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 26px;
     border-bottom: 1px solid #d0d0d5; padding-bottom: 3px; } h3 { font-size: 15px; margin: 16px 0 6px 0; }
p.meta { color: #555; margin-top: 0; }
table { border-collapse: collapse; margin: 8px 0 12px 0; max-width: 100%; }
table.fixed { table-layout: fixed; width: 100%; }
th, td { border: 1px solid #d0d0d5; padding: 3px 8px; text-align: left; vertical-align: top;
         overflow-wrap: break-word; }
th { background: #f1f1f4; } tr:nth-child(even) td { background: #fafafc; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
code, pre { font-family: "SFMono-Regular", Menlo, Consolas, monospace; font-size: 12px; }
td code { overflow-wrap: anywhere; }
pre { background: #f6f6f8; padding: 8px; white-space: pre-wrap; overflow-wrap: anywhere; }
.off { color: #b00020; font-weight: bold; } .on { color: #1b7f3b; }
.bar { height: 11px; display: inline-block; vertical-align: middle; max-width: 100%; }
.before { background: #9aa7c7; } .after { background: #dd8452; }
.chart td { border: none; padding: 1px 6px; } .empty { color: #777; font-style: italic; }
img.plot, svg.plot { max-width: 100%; height: auto; border: 1px solid #d0d0d5; display: block; }
table.summary td:first-child { font-weight: 600; white-space: nowrap; width: 1%; }
table.summary td { border: none; border-bottom: 1px solid #ececf0; }
details { margin: 8px 0; } summary { cursor: pointer; color: #333; }
details > summary h2, details > summary h3 { display: inline; border: none; }
.big { font-size: 16px; font-weight: 600; }
"""


class _Raw(str):
    """Markup built here from escaped parts; `_cell` passes it through unescaped."""


def _e(x) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _cell(x) -> str:
    return x if isinstance(x, _Raw) else _e(x)


def _cell_text(cell) -> str:
    """Visible text of a cell (markup of `_Raw` cells replaced by spaces)."""
    text = re.sub(r"<[^>]+>", " ", cell) if isinstance(cell, _Raw) else ("" if cell is None else str(cell))
    return html.unescape(text)


def _widths(headers, rows) -> list[float]:
    """Column widths in percent for a fixed-layout table, from characters: each column gets its typical (80th
    percentile) text length, at least its longest word (cells and header, up to 20 characters, so names such as
    `sparse_attention` stay whole), at most 60; plus 3 characters of padding."""
    weights = []
    for i, h in enumerate(headers):
        texts = [_cell_text(r[i]) for r in rows if i < len(r)]
        lens = sorted(len(t.strip()) for t in texts)
        typical = lens[min(len(lens) - 1, int(0.8 * len(lens)))] if lens else 0
        word = max((len(w) for t in texts + [str(h)] for w in t.split()), default=0)
        head = max((len(w) for w in str(h).split()), default=0) * 1.15  # headers are bold
        weights.append(min(60.0, max(float(typical), float(min(word, 20)), head, 3.0)) + 3.0)
    total = sum(weights)
    return [100.0 * w / total for w in weights]


#: Tables with this many columns or more are laid out at the page's width (`table-layout: fixed`), so their
#: content wraps inside the columns instead of pushing the table past the window.
_FIXED_FROM = 5


def _table(headers, rows, num_cols=(), cls: str | None = None) -> str:
    """An HTML table; cells are escaped unless `_Raw`; columns named in `num_cols` are right-aligned; no header
    row when every header is empty. Wide tables (`_FIXED_FROM` columns or more) take the page's width with column
    widths from their content (`_widths`), so nothing is wider than the window."""
    if not rows:
        return '<p class="empty">none</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers) if any(headers) else ""
    body = []
    for r in rows:
        tds = "".join(f'<td{" class=num" if h in num_cols else ""}>{_cell(c)}</td>' for h, c in zip(headers, r))
        body.append(f"<tr>{tds}</tr>")
    classes = [cls] if cls else []
    cols = ""
    if len(headers) >= _FIXED_FROM:
        classes.append("fixed")
        cols = "<colgroup>" + "".join(f'<col style="width:{w:.1f}%">' for w in _widths(headers, rows)) + "</colgroup>"
    klass = f' class="{_e(" ".join(classes))}"' if classes else ""
    thead = f"<thead><tr>{head}</tr></thead>" if head else ""
    return f"<table{klass}>{cols}{thead}<tbody>{''.join(body)}</tbody></table>"


def _dash(x) -> str:
    return "-" if x is None else str(x)


def _where(loc) -> str:
    if not loc:
        return "?"
    fn = loc.get("function")
    return f"{loc.get('where') or '?'} ({fn})" if fn else str(loc.get("where") or "?")


def _short(frame: str) -> str:
    """`/a/b/file.py:12 (fn)` -> `file.py:12 (fn)`."""
    path, sep, rest = frame.partition(":")
    return os.path.basename(path) + sep + rest


def _caller(loc) -> str:
    """The frame that called the matched line (`stack[-2]`), or "" when the stack has one frame."""
    stack = (loc or {}).get("stack") or []
    return _short(str(stack[-2])) if len(stack) >= 2 else ""


def _source(loc) -> _Raw:
    """Source line of a match: `file.py:line (function)` (full path as tooltip), the code on it, and its caller
    (a shared helper such as `Linear.forward` is only told apart by who called it)."""
    if not loc:
        return _Raw('<span class="empty">unknown</span>')
    code, caller = loc.get("code"), _caller(loc)
    out = f'<span title="{_e(_where(loc))}">{_e(_short(_where(loc)))}</span>'
    if code:
        out += f"<br><code>{_e(code)}</code>"
    if caller:
        out += f"<br>called from {_e(caller)}"
    return _Raw(out)


def _layer(detail) -> object:
    if isinstance(detail, dict):
        for k in _LAYER_KEYS:
            if k in detail:
                return detail[k]
    return None


def _bars(rows, unit) -> str:
    """Before/after bar pairs [(label, before, after)] scaled to the largest value, as a borderless table."""
    rows = [(lab, b, a) for lab, b, a in rows if b is not None and a is not None]
    top = max([max(b, a) for _, b, a in rows] + [0])
    if not rows or top <= 0:
        return ""
    out = []
    for lab, b, a in rows:
        wb, wa = 300 * b / top, 300 * a / top
        out.append([lab, _Raw(f'<span class="bar before" style="width:{wb:.1f}px"></span> {_e(unit(b))}<br>'
                              f'<span class="bar after" style="width:{wa:.1f}px"></span> {_e(unit(a))}')])
    return _table(["", "before (blue) / after (orange)"], out, cls="chart")


def _generic(v, depth: int = 0) -> str:
    """Render an arbitrary JSON value (the `schedule` section, whose shape the scheduler owns)."""
    scalar = (str, int, float, bool, type(None))
    if isinstance(v, scalar):
        return _e(v)
    if depth >= 4:
        return f"<pre>{_e(json.dumps(v, indent=1, default=str))}</pre>"
    if isinstance(v, dict):
        if all(isinstance(x, scalar) for x in v.values()):
            return _table(["key", "value"], [[k, x] for k, x in v.items()])
        return "".join(f"<h4>{_e(k)}</h4>{_generic(x, depth + 1)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        if v and all(isinstance(x, dict) for x in v):
            keys: list = []
            for x in v:
                keys += [k for k in x if k not in keys]
            def cell(y):
                """A table cell: scalars as they are, anything else as escaped JSON in <code>."""
                return y if isinstance(y, scalar) else _Raw(f"<code>{_e(json.dumps(y, default=str))}</code>")
            rows = [[cell(x.get(k)) for k in keys] for x in v]
            return _table([str(k) for k in keys], rows)
        if all(isinstance(x, scalar) for x in v):
            return _e(", ".join(str(x) for x in v)) if v else '<p class="empty">none</p>'
        return "".join(_generic(x, depth + 1) for x in v)
    return _e(repr(v))


# ------------------------------------------------------------------------------------------------ sections
def _options_text(opts) -> str:
    """The compile options as `key=value` pairs, `auto` for the ones left to the backend (None)."""
    if not isinstance(opts, dict):
        return "-"
    def val(v):
        """One option value as written by the user: true / false, auto for None, a list joined by commas."""
        if v is None:
            return "auto"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(map(str, v)) + "]"
        return str(v)
    return ", ".join(f"{k}={val(v)}" for k, v in opts.items())


def _summary(d: dict) -> str:
    """The page's first section: what the passes did to one step in a few lines, then the plot."""
    from ..passes.manager import REWRITE_FAMILIES

    k = d.get("kernels") or {}
    kl = d.get("kernels_by_layer") or {}
    b = d.get("bytes") or {}
    fams = d.get("families") or {}
    fused = {n: f for n, f in fams.items() if n not in REWRITE_FAMILIES and f.get("matches")}
    rewrites = [f"{n} {fams[n].get('matches', 0):,}" for n in REWRITE_FAMILIES if n in fams]
    if k.get("before") is not None:
        kern = _Raw(f'<span class="big">{k["before"]:,} &rarr; {k["after"]:,}</span> (profiled: {_e(k.get("method"))})')
    elif kl.get("total") is not None:
        kern = _Raw(f'<span class="big">{kl["total"]:,}</span> launches after the passes (static count; before '
                    "needs option <code>count_kernels</code>)")
    else:
        kern = "not counted"
    rows = [["kernels per step", kern],
            ["bytes per step moved by the fused chains",
             _Raw(f'<span class="big">{_e(human_bytes(b.get("before_value")))} &rarr; '
                  f'{_e(human_bytes(b.get("after_value")))}</span>')],
            ["fused", f"{sum(f['matches'] for f in fused.values()):,} matches in {len(fused)} families, each match "
                      "one fused op" + (f"; rewrites (canonical forms, no bytes moved): {', '.join(rewrites)}"
                                        if rewrites else "")],
            ["left unfused", f"{sum(len(f.get('near_misses') or []) for f in fams.values()):,} near-misses, "
                             f"{sum(len(f.get('findings') or []) for f in fams.values()):,} findings (below)"],
            ["dsv41 pass time", f"{sum(f.get('pass_seconds') or 0 for f in fams.values()):.1f} s over "
                                f"{len(d.get('graphs') or [])} graph(s)"],
            ["options", _options_text(d.get("options"))]]
    sym = [[f"symbol {k_}", meaning] for k_, meaning in (d.get("symbols") or {}).items()]
    sym += [["bytes before (symbolic)", _Raw(f"<code>{_e(b.get('before'))}</code>")],
            ["bytes after (symbolic)", _Raw(f"<code>{_e(b.get('after'))}</code>")]]
    out = ("<h2>Summary</h2>" + _table(["", ""], rows, cls="summary")
           + "<details><summary>symbolic bytes (B, L)</summary>" + _table(["", ""], sym, cls="summary")
           + "</details>")
    try:
        from .report_plot import family_svg
        svg = family_svg(d)
    except ImportError as e:  # matplotlib is in the test extra, not a dependency
        return out + f'<p class="empty">plot left out: {_e(e)}</p>'
    if svg:
        out += "<h3>Ops and bytes per step, per family: before &rarr; after</h3>" + svg
    return out


def _families(fams: dict) -> str:
    rows = []
    for name, f in fams.items():
        on = _Raw('<span class="on">on</span>' if f.get("enabled") else '<span class="off">OFF</span>')
        rows.append([name, on, f.get("matches", 0), f.get("nodes_replaced", 0), len(f.get("near_misses") or []),
                     len(f.get("findings") or []),
                     f"{human_bytes(f.get('bytes_before_value'))} -> {human_bytes(f.get('bytes_after_value'))}",
                     _Raw(f"<code>{_e(f.get('bytes_before'))}</code> -> <code>{_e(f.get('bytes_after'))}</code>"),
                     f.get("note") or ""])

    cols = ["family", "on", "matches", "nodes replaced", "near-misses", "findings", "bytes before -> after",
            "symbolic (B, L)", "note"]
    return "<h2>Per family</h2>" + _table(cols, rows, num_cols=("matches", "nodes replaced", "near-misses",
                                                                "findings"))


#: Fused-site rows shown before the rest are folded (the heaviest carry most of the bytes saved).
_SITES_SHOWN = 15


def _sites(fams: dict) -> str:
    """Fused sites grouped by family, pattern, source line (and layer), heaviest first (bytes saved per step); the
    matches that move no bytes (normalize's rewrites, index math) are folded below."""
    groups: Counter = Counter()
    info: dict = {}
    for name, f in fams.items():
        for s in f.get("sites") or []:
            loc = s.get("location") or {}
            key = (name, s.get("pattern"), s.get("op"), loc.get("where"), _caller(loc),
                   str(_layer(s.get("detail"))), s.get("bytes_before"), s.get("bytes_after"))
            groups[key] += 1
            info.setdefault(key, s)
    with_layer = any(_layer(s.get("detail")) is not None for s in info.values())

    def saved(key) -> float:
        """Bytes per step this group's matches save (before - after, times the matches)."""
        s = info[key]
        return ((s.get("bytes_before_value") or 0) - (s.get("bytes_after_value") or 0)) * groups[key]

    def moves(key) -> bool:
        """Whether the group's matches move bytes at all (before or after)."""
        s = info[key]
        return bool(s.get("bytes_before_value") or s.get("bytes_after_value"))

    def rows_of(keys) -> list:
        """Table rows for these group keys."""
        rows = []
        for key in keys:
            s = info[key]
            layer = _layer(s.get("detail"))
            detail = s.get("detail") or {}
            row = [key[0], s.get("pattern"), _Raw(f"<code>{_e(s.get('op'))}</code>"), _source(s.get("location"))]
            row += (["-" if layer is None else layer] if with_layer else [])
            sym = f"{s.get('bytes_before')} -> {s.get('bytes_after')} (B, L symbolic)"
            row += [groups[key], _Raw(f'<span title="{_e(sym)}">{_e(human_bytes(s.get("bytes_before_value")))} -&gt; '
                                      f'{_e(human_bytes(s.get("bytes_after_value")))}</span>'),
                    ", ".join(f"{k}={v}" for k, v in detail.items())]
            rows.append(row)
        return rows

    order = sorted(groups, key=lambda k: (-saved(k), -groups[k], k[0], str(k[1])))
    heavy = [k for k in order if moves(k)]
    light = [k for k in order if not moves(k)]
    cols = ["family", "pattern", "fused op", "source"] + (["layer"] if with_layer else []) + [
        "matches", "bytes per match", "detail"]
    out = ("<h2>Fused sites</h2><p>Heaviest first (bytes saved per step). One row per family, pattern and source "
           "line (and layer, where the match records one): a line that every layer runs lists one match per "
           "layer. Hover the bytes for their formula in B (batch) and L (tokens per step).</p>"
           + _table(cols, rows_of(heavy[:_SITES_SHOWN]), num_cols=("matches",)))
    if heavy[_SITES_SHOWN:]:
        rest = heavy[_SITES_SHOWN:]
        out += (f"<details><summary>{len(rest)} lighter sites ({sum(groups[k] for k in rest):,} matches)</summary>"
                + _table(cols, rows_of(rest), num_cols=("matches",)) + "</details>")
    if light:
        fams_light = sorted({k[0] for k in light})
        out += (f"<details><summary>{sum(groups[k] for k in light):,} matches that move no bytes "
                f"({_e(', '.join(fams_light))}): rewrites for the matchers and index math</summary>"
                + _table(cols, rows_of(light), num_cols=("matches",)) + "</details>")
    return out


def _misses(fams: dict) -> str:
    groups: Counter = Counter()
    first: dict = {}
    for name, f in fams.items():
        for m in f.get("near_misses") or []:
            loc = m.get("location") or {}
            key = (name, m.get("pattern"), m.get("check"), m.get("reason"), loc.get("where"), _caller(loc))
            groups[key] += 1
            first.setdefault(key, m)
    rows = [[k[0], k[1], k[2], k[3], _source(first[k].get("location")), c] for k, c in groups.items()]
    return ("<h2>Near-misses (not fused)</h2>"
            + _table(["family", "pattern", "failed check", "reason", "source", "count"], rows, num_cols=("count",)))


def _findings(fams: dict) -> str:
    groups: Counter = Counter()
    for name, f in fams.items():
        for x in f.get("findings") or []:
            groups[(name, x.get("kind"), x.get("message"), _where(x.get("location")))] += 1
    rows = [[n, k, m, w, c] for (n, k, m, w), c in groups.items()]
    return ("<h2>Findings (left on a slow path)</h2>"
            + _table(["family", "kind", "message", "source", "count"], rows, num_cols=("count",)))


def _kernels(d: dict) -> str:
    k = d.get("kernels") or {}
    per = k.get("per_graph") or []
    rows = [[i, g.get("device"), g.get("before"), g.get("after"), g.get("method"), g.get("note")]
            for i, g in enumerate(per) if g is not None]
    if not rows:
        return "<h2>Kernels per step</h2><p class=\"empty\">not counted (compile with option count_kernels)</p>"
    rows.append(["total", "", k.get("before"), k.get("after"), k.get("method"), ""])
    chart = _bars([("kernels per step", k.get("before"), k.get("after"))], lambda x: f"{x:.0f}")
    return ("<h2>Kernels per step</h2>" + chart
            + _table(["graph", "device", "before", "after", "method", "note"], rows, num_cols=("before", "after")))


def _layer_kernels(d: dict) -> str:
    """Static launches per call by decoder layer (and by layer role when the report knows the roles)."""
    k = d.get("kernels_by_layer") or {}
    by_layer = k.get("by_layer")
    if not by_layer:
        return ""
    roles = d.get("layer_roles")

    def role(layer):
        """Role name of a layer key ('' for 'other' or when roles are unknown)."""
        if roles is None or layer == "other" or not str(layer).isdigit() or int(layer) >= len(roles):
            return ""
        return roles[int(layer)]

    rows = [[layer, role(layer), n] for layer, n in by_layer.items()]
    rows.append(["total", "", k.get("total")])
    out = (f"<h2>Kernel launches per layer</h2><p>{_e(k.get('method'))}. Launches outside every decoder layer "
           "(embedding, head, per-step math) count as <code>other</code>.</p>"
           + f"<details><summary>{len(by_layer)} rows: launches of each layer</summary>"
           + _table(["layer", "role", "launches"], rows, num_cols=("launches",)) + "</details>")
    by_role = d.get("kernels_by_role")
    if by_role:
        per = by_role.get("per_layer") or {}
        rrows = []
        for r, n in by_role.items():
            if r == "per_layer":
                continue
            p = per.get(r)
            rrows.append([r, p["layers"] if p else "-", n,
                          f"{p['min']} / {p['mean']:.1f} / {p['max']}" if p else "-"])
        out += "<h3>By layer role</h3>" + _table(["role", "layers", "launches", "per layer min / mean / max"],
                                                 rrows, num_cols=("layers", "launches"))
    prof = k.get("profiler")
    if prof:
        out += (f"<p>static launches {_e(prof.get('static'))} vs profiler count {_e(prof.get('after'))} "
                f"({_e(prof.get('device'))}): {'equal' if prof.get('equal') else 'different'}</p>")
    if k.get("note"):
        out += f'<p class="empty">{_e(k["note"])}</p>'
    return out


def _schedule(sc) -> str:
    """The side-stream schedule, folded: nothing when the report says it was planned but not applied (CPU, or
    option streams off), else one sentence and the moved regions / kept ops in tables."""
    if isinstance(sc, dict) and sc.get("applied") is False:
        return ""
    head = "<details><summary><h2>Schedule</h2> (side streams)</summary>"
    if not (isinstance(sc, dict) and {"regions", "kept_on_main", "before_us", "after_us"} <= set(sc)):
        return head + _generic(sc) + "</details>"
    text = (f"{len(sc['regions'])} region(s) on {_e(sc.get('streams'))} stream(s), modelled step "
            f"{sc['before_us']:.1f} &rarr; {sc['after_us']:.1f} us (critical path {sc.get('critical_path_us', 0):.1f} us); "
            f"{_e(sc.get('reason'))}")
    regions = [[r.get("graph"), r.get("slot"), _Raw(f"<code>{_e(r.get('op'))}</code>"), r.get("where"),
                r.get("fork_after"), r.get("join_before"), f"{r.get('overlap_us') or 0:.2f}"] for r in sc["regions"]]
    kept: Counter = Counter((k.get("op"), k.get("reason")) for k in sc["kept_on_main"])
    return (head + f"<p>{text}</p>"
            + _table(["graph", "slot", "op", "where", "fork after", "join before", "overlap us"], regions,
                     num_cols=("overlap us",))
            + "<h3>Kept on the main stream</h3>"
            + _table(["op", "reason", "count"], [[_Raw(f"<code>{_e(op)}</code>"), why, c] for (op, why), c in
                                                 kept.most_common()], num_cols=("count",))
            + "</details>")


def _bench(bench: dict) -> str:
    from ..result_text import fp32_err_text
    rows = []
    for name, r in (bench.get("backends") or {}).items():
        d = r.get("decode_tok_s") or {}
        rows.append([name, "-" if not d else f"{d['median']:.2f} [{d['min']:.2f}, {d['max']:.2f}]",
                     _dash(r.get("kernels_per_step")),
                     "-" if r.get("roofline_fraction") is None else f"{r['roofline_fraction']:.3f}",
                     "-" if r.get("compile_s") is None else f"{r['compile_s']:.1f}",
                     "-" if r.get("compile_warm_s") is None else f"{r['compile_warm_s']:.1f}",
                     "-" if r.get("tokens_match_eager") is None else ("yes" if r["tokens_match_eager"] else "NO"),
                     "-" if r.get("max_rel_logit_err") is None else f"{r['max_rel_logit_err']:.2e}",
                     fp32_err_text(r), r.get("note") or ""])
    roof = bench.get("roofline_tok_s")
    head = (f"{bench.get('preset')} preset, prompt {bench.get('prompt_len')}, {bench.get('new_tokens')} new "
            f"tokens, {bench.get('gpu') or 'cpu'}, torch {bench.get('torch')}, triton {bench.get('triton')}")
    if roof:
        head += (f"; roofline {roof:,.1f} tok/s = {human_bytes(bench.get('decode_bytes_per_step'))}/step at "
                 f"{bench.get('copy_bandwidth_tb_s'):.2f} TB/s")
    cols = ["backend", "decode tok/s median [min, max]", "kernels/step", "roofline fraction", "compile s (cold)",
            "compile s (warm)", "tokens = eager", "max rel logit err", "logit err vs fp32", "note"]
    return f"<h2>Benchmark</h2><p>{_e(head)}</p>" + _table(cols, rows, num_cols=("kernels/step",))


def _step_breakdown(d: dict, bench: dict | None) -> str:
    """The "where the step goes" table (`breakdown.table_rows`) of the report, or of the bench's dsv41 row."""
    from .breakdown import find_breakdown, table_rows
    bd = find_breakdown(d, bench)
    if bd is None:
        return ""
    headers, rows, foot = table_rows(bd)
    return (f"<h2>Where the step goes</h2><p>{_e(foot)}</p>"
            + _table(headers, rows, num_cols=tuple(headers[1:])))


def _plot(png: bytes) -> str:
    data = base64.b64encode(png).decode("ascii")
    return ('<h2>Plot</h2><img class="plot" alt="decode tokens/s per backend with the roofline, and kernels per '
            f'step" src="data:image/png;base64,{data}">')


def _graph_code(d: dict) -> str:
    parts = []
    for g in d.get("graphs") or []:
        for when in ("before", "after"):
            code = g.get(f"graph_{when}")
            if code:
                parts.append(f"<details><summary>graph {_e(g.get('index'))} ({_e(g.get('compile_id'))}) "
                             f"{when} the passes</summary><pre>{_e(code)}</pre></details>")
    return "<h2>Graph code</h2>" + "".join(parts) if parts else ""


def read_png(png_path) -> bytes:
    """The bytes of the PNG file `png_path`. Raises FileNotFoundError when it is missing, ValueError when it does
    not start with the PNG signature."""
    path = os.fspath(png_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"png_path {path!r} does not exist")
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(_PNG_MAGIC):
        raise ValueError(f"png_path {path!r} is not a PNG file (bad signature)")
    return data


# ------------------------------------------------------------------------------------------------ public API
def render_html(report_dict: dict, bench: dict | None = None, png_path: str | None = None) -> str:
    """The fusion report page as one HTML string (inline CSS, no scripts, images embedded as base64).

    Args:
        report_dict: `FusionReport.to_dict()` (keys read: families, kernels, bytes, symbols, options, graphs,
            dsv41_version, torch_version, and `schedule` when present).
        bench: a `dsv41.bench.run_benchmark` result to show (table + plot), or None.
        png_path: a PNG to embed as the plot; when None and `bench` is given, the plot is drawn with
            `dsv41.plots.benchmark_png` (left out, with a note, if matplotlib is missing).
    Raises:
        TypeError: report_dict is not a dict, or bench is neither a dict nor None.
        ReportSchemaError (a ValueError): report_dict is of a newer `schema_version` than this dsv41 reads.
        FileNotFoundError / ValueError: png_path is missing or not a PNG.
    """
    if not isinstance(report_dict, dict):
        raise TypeError(f"report_dict must be FusionReport.to_dict() (a dict), got {type(report_dict).__name__}")
    if bench is not None and not isinstance(bench, dict):
        raise TypeError(f"bench must be a benchmark result dict or None, got {type(bench).__name__}")
    check_schema(report_dict)
    png = read_png(png_path) if png_path is not None else None
    plot_note = ""
    if png is None and bench is not None and bench.get("backends"):
        try:
            from ..plots import benchmark_png
            png = benchmark_png(bench)
        except ImportError as e:
            plot_note = f'<p class="empty">plot left out: {_e(e)}</p>'
    fams = report_dict.get("families") or {}
    title = "dsv41 fusion report"
    meta = (f"dsv41 {report_dict.get('dsv41_version', '?')}, torch {report_dict.get('torch_version', '?')}, "
            f"{len(report_dict.get('graphs') or [])} graph(s), {len(fams)} families")
    body = [f"<h1>{_e(title)}</h1>", f'<p class="meta">{_e(meta)}</p>', _summary(report_dict), _families(fams),
            _sites(fams), _misses(fams), _findings(fams), _kernels(report_dict), _layer_kernels(report_dict)]
    if "schedule" in report_dict:
        body.append(_schedule(report_dict["schedule"]))
    if "buckets" in report_dict:
        body.append("<h2>Batch-size buckets</h2>" + _generic(report_dict["buckets"]))
    body.append(_step_breakdown(report_dict, bench))
    if bench is not None:
        body.append(_bench(bench))
    if png is not None:
        body.append(_plot(png))
    body.append(plot_note)
    body.append(_graph_code(report_dict))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(b for b in body if b) + "\n</body></html>\n")


def write_html(report, path, bench: dict | None = None, png_path: str | None = None) -> str:
    """Write `render_html` of `report` (a FusionReport or its `to_dict()`) to `path`; returns the path.

    Parent directories are created. Raises: TypeError when `report` is neither; as `render_html` otherwise.
    """
    if hasattr(report, "to_dict") and not isinstance(report, dict):
        report = report.to_dict()
    if not isinstance(report, dict):
        raise TypeError(f"report must be a FusionReport or its to_dict(), got {type(report).__name__}")
    text = render_html(report, bench=bench, png_path=png_path)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
