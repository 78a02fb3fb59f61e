"""The fusion report's plot: per family, the ops and the bytes of one step before -> after dsv41's passes.

`family_svg(report_dict)` draws it from `FusionReport.to_dict()` alone, so the HTML report has a plot without a
benchmark run. Two panels share the families (heaviest first, by bytes before):

- ops per step: the eager ATen ops the family's matches replaced (view and metadata ops left out, as in the
  profiler count of `profiling.py`) against the fused ops that replaced them (one per match); a first row,
  `whole step`, shows the kernels per step of the whole graph (profiled with option `count_kernels`, else the
  static launch count after);
- bytes per step: the bytes the fused chains move before and after, evaluated for the compiled shapes.

Both axes are logarithmic (a family's ops span 10 to 4,000). The figure is an inline SVG string (text kept as text,
so it stays small and sharp at any width); matplotlib is driven through `Figure` and the Agg-free SVG canvas,
never pyplot. Public names: `family_svg`, `family_rows`.
"""

from __future__ import annotations

import io
import re

from ..passes.manager import REWRITE_FAMILIES  # rewrite the graph for the matchers, fuse nothing: not plotted
from .units import human_bytes

__all__ = ["family_svg", "family_rows"]

_BEFORE = "#9aa7c7"
_AFTER = "#dd8452"


def _computes(op: str) -> bool:
    """Whether ATen op `op` (e.g. "aten.mul.Tensor") launches work eagerly (views and allocations do not)."""
    from .profiling import NO_COMPUTE

    parts = op.split(".")
    name = parts[1] if len(parts) > 1 and parts[0] in ("aten", "prims") else op
    return name not in NO_COMPUTE and name not in ("unsqueeze", "squeeze", "permute", "clone", "view")


def family_rows(report_dict: dict) -> list[dict]:
    """Per fusing family with a match: {"family", "ops_before", "ops_after", "bytes_before", "bytes_after"}, bytes
    descending (ints: ops per step and bytes per step at the compiled shapes)."""
    rows = []
    for name, f in (report_dict.get("families") or {}).items():
        if name in REWRITE_FAMILIES or not f.get("matches"):
            continue
        sites = f.get("sites") or []
        rows.append({"family": name,
                     "ops_before": sum(1 for s in sites for op in s.get("ops_replaced") or () if _computes(op)),
                     "ops_after": len(sites),
                     "bytes_before": int(f.get("bytes_before_value") or 0),
                     "bytes_after": int(f.get("bytes_after_value") or 0)})
    return sorted(rows, key=lambda r: (-r["bytes_before"], -r["ops_before"], r["family"]))


def family_svg(report_dict: dict) -> str | None:
    """The plot as one `<svg>` element (width follows its container), or None when no family fused anything.

    Raises: ImportError when matplotlib is not installed (it is in the `test` extra, not a dependency).
    """
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure

    rows = family_rows(report_dict)
    if not rows:
        return None
    k = report_dict.get("kernels") or {}
    kl = report_dict.get("kernels_by_layer") or {}
    labels = [r["family"] for r in rows]
    ops_b = [r["ops_before"] for r in rows]
    ops_a = [r["ops_after"] for r in rows]
    step_note = ""
    if k.get("before") is not None:
        labels, ops_b, ops_a = ["whole step"] + labels, [k["before"]] + ops_b, [k["after"]] + ops_a
        step_note = "whole step: kernels per step, profiled"
    elif kl.get("total") is not None:
        labels, ops_b, ops_a = ["whole step"] + labels, [0] + ops_b, [kl["total"]] + ops_a
        step_note = "whole step: launches after (static count; before needs option count_kernels)"
    n = len(labels)
    fig = Figure(figsize=(10.0, 0.32 * n + 1.6), dpi=100, layout="constrained")
    ax_ops, ax_bytes = fig.subplots(1, 2, sharey=True)
    ys = list(range(n))
    h = 0.38
    ax_ops.barh([y - h / 2 for y in ys], [max(v, 0.9) if v else 0 for v in ops_b], h, color=_BEFORE,
                label="before (eager)")
    ax_ops.barh([y + h / 2 for y in ys], [max(v, 0.9) if v else 0 for v in ops_a], h, color=_AFTER,
                label="after (dsv41)")
    nb = len(rows)
    bb = [r["bytes_before"] for r in rows]
    ba = [r["bytes_after"] for r in rows]
    off = n - nb  # the whole-step row has no bytes
    ax_bytes.barh([y - h / 2 for y in ys[off:]], [max(v, 1) if v else 0 for v in bb], h, color=_BEFORE)
    ax_bytes.barh([y + h / 2 for y in ys[off:]], [max(v, 1) if v else 0 for v in ba], h, color=_AFTER)
    for ax, before, after, fmt, start in ((ax_ops, ops_b, ops_a, lambda v: f"{v:,}", 0),
                                          (ax_bytes, bb, ba, human_bytes, off)):
        ax.set_xscale("log")
        for i, (b, a) in enumerate(zip(before, after)):
            y = ys[start + i]
            for v, dy in ((b, -h / 2), (a, h / 2)):
                label = " " + (fmt(v) if v else ("0" if ax is ax_bytes else "-"))
                if v:
                    ax.text(v, y + dy, label, va="center", fontsize=7, parse_math=False)
                else:  # no bar on a log axis: the label sits at the axis
                    ax.text(0.0, y + dy, label, va="center", fontsize=7, parse_math=False,
                            transform=ax.get_yaxis_transform())
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.25)
    ax_ops.set_yticks(ys)
    # A family name is user text of any length: long ones are cut, so the labels never push past the figure.
    ax_ops.set_yticklabels([x if len(x) <= 28 else x[:27] + "\u2026" for x in labels], fontsize=8, parse_math=False)
    ax_ops.invert_yaxis()
    ax_ops.set_title("ops per step: eager ATen ops replaced -> fused ops", fontsize=9)
    ax_bytes.set_title("bytes per step moved by the fused chains", fontsize=9)
    ax_ops.legend(loc="lower right", fontsize=7)
    if step_note:
        fig.supxlabel(step_note, fontsize=7, color="#555555")
    with _svg_rc():
        buf = io.StringIO()
        FigureCanvasSVG(fig).print_svg(buf)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"\s*<metadata>.*?</metadata>", "", svg, count=1, flags=re.S)  # an RDF block of tool names
    # Scale with the page: keep the viewBox, drop the fixed size.
    svg = re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r'<svg\1 class="plot" role="img" '
                 r'aria-label="ops and bytes per step per family, before and after dsv41"', svg, count=1)
    return svg


def _svg_rc():
    """matplotlib settings for an SVG that is small and deterministic: text as <text> elements (not glyph paths),
    no random ids or dates in the output."""
    import matplotlib
    return matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "dsv41", "font.size": 8})
