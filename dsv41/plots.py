"""The benchmark plot of BENCHMARK.md "Output": tokens/s per backend against the roofline, and kernels per step.

`plot_benchmark(result, path)` writes a PNG; `benchmark_png(result)` returns its bytes (the HTML report embeds
them). `result` is the dict `dsv41.bench.run_benchmark` returns (only `backends`, `roofline_tok_s`, `preset`,
`prompt_len`, `new_tokens` and `gpu` are read). Backends whose figures are null (not installed, failed, or not
measured on this device) keep their slot on the x axis, labelled "n/a", so none is silently dropped.

Matplotlib is driven through `matplotlib.figure.Figure` and the Agg canvas directly, never through pyplot, so
plotting changes no global backend or figure state of the caller's process.
"""

from __future__ import annotations

import io
import os

__all__ = ["benchmark_png", "plot_benchmark"]

_BAR = "#4C72B0"
_DSV41 = "#DD8452"
_ROOF = "#C44E52"
#: Largest / smallest measured tok/s (roofline included) above which the throughput axis is logarithmic.
_LOG_SPREAD = 100.0


def _check(result) -> dict:
    if not isinstance(result, dict):
        raise TypeError(f"result must be the benchmark result dict, got {type(result).__name__}")
    backends = result.get("backends")
    if not isinstance(backends, dict) or not backends:
        raise ValueError("result has no 'backends' to plot (expected a non-empty dict of backend rows)")
    return backends


def _figure(result: dict):
    """The two-panel figure: left decode tok/s (median bar, min-max whisker, roofline line); right kernels/step."""
    from matplotlib.figure import Figure

    backends = _check(result)
    names = list(backends)
    xs = list(range(len(names)))
    width = max(8.0, 0.9 * len(names) + 4.0)
    fig = Figure(figsize=(width, 4.8), dpi=100, layout="constrained")
    ax_tok, ax_k = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    colors = [_DSV41 if n.startswith("dsv41") else _BAR for n in names]

    med, lo, hi = [], [], []
    for n in names:
        d = backends[n].get("decode_tok_s") or {}
        m = d.get("median")
        med.append(m if m is not None else 0.0)
        lo.append(m - d["min"] if m is not None else 0.0)
        hi.append(d["max"] - m if m is not None else 0.0)
    roof = result.get("roofline_tok_s")
    top = max([m + h for m, h in zip(med, hi)] + ([roof] if roof else []) + [1e-9])
    positive = [m for m in med if m > 0]
    # Eager, Inductor and dsv41 span 100x and more (and the roofline more still): on a linear axis the slow
    # rows are invisible bars, so such a spread is drawn on a log axis.
    log = bool(positive) and top / min(positive) > _LOG_SPREAD
    bottom = min(positive) / 2 if log else 0.0
    ax_tok.bar(xs, [m if m > 0 else (bottom if log else 0.0) for m in med], color=colors, yerr=[lo, hi], capsize=3,
               ecolor="#333333")
    if roof:
        ax_tok.axhline(roof, color=_ROOF, linestyle="--", linewidth=1.5, label=f"roofline {roof:,.1f} tok/s")
        ax_tok.legend(loc="upper left", fontsize=8)
    for x, n, m, h in zip(xs, names, med, hi):
        row = backends[n]
        has = (row.get("decode_tok_s") or {}).get("median") is not None
        # Above the whisker, so the number never sits on the error bar.
        label = (f"{m:,.1f}" if m >= 10 else f"{m:.3g}") if has else "n/a"
        runs = row.get("new_tokens")
        if has and runs is not None and runs != result.get("new_tokens"):
            label += f"\n({runs} tok)"  # this row decoded fewer tokens per run (eager_new_tokens / row_new_tokens)
        y = (max(m + h, bottom) * 1.08) if log else m + h + 0.01 * top
        ax_tok.text(x, y, label, ha="center", va="bottom", fontsize=7)
    if log:
        ax_tok.set_yscale("log")
        ax_tok.set_ylim(bottom, 3.0 * top)
    else:
        ax_tok.set_ylim(0, 1.12 * top)
    ax_tok.set_ylabel("decode tokens/s (median; whiskers min-max)" + ("; log scale" if log else ""))
    ax_tok.set_title("decode throughput", fontsize=10)

    kern = [backends[n].get("kernels_per_step") for n in names]
    ax_k.bar(xs, [k if k is not None else 0 for k in kern], color=colors)
    ktop = max([k for k in kern if k is not None] + [1])
    for x, k in zip(xs, kern):
        ax_k.text(x, (k or 0) + 0.01 * ktop, str(k) if k is not None else "n/a", ha="center", va="bottom",
                  fontsize=7)
    ax_k.set_ylim(0, 1.12 * ktop)
    if all(k is None for k in kern):
        ax_k.text(0.5, 0.5, "not measured\n(GPU kernels are counted on CUDA only)", ha="center", va="center",
                  transform=ax_k.transAxes, fontsize=9, color="#555555")
    ax_k.set_ylabel("GPU kernels per decode step")
    ax_k.set_title("kernels per decode step", fontsize=10)
    for ax in (ax_tok, ax_k):
        ax.set_xticks(xs)
        ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"dsv41 decode benchmark: {result.get('preset')} preset, prompt {result.get('prompt_len')}, "
                 f"{result.get('new_tokens')} new tokens, {result.get('gpu') or 'cpu'}", fontsize=11)
    return fig


def benchmark_png(result: dict) -> bytes:
    """The benchmark plot as PNG bytes.

    Raises:
        TypeError: `result` is not a dict. ValueError: it has no non-empty `backends` dict.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = _figure(result)
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def plot_benchmark(result: dict, path: str | os.PathLike) -> str:
    """Write the benchmark plot to `path` as PNG (parent directories are created); returns the path.

    Raises: as `benchmark_png`.
    """
    data = benchmark_png(result)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path
