"""The terminal summary of `dsv41 run`: the result, then what dsv41 fused, as two narrow rich tables.

Both tables fit 80 columns, so a pipe or a log (where rich assumes 80) shows every row on one line. Fusions are
counted as matches per family; the `normalize` family's rewrites (canonical forms for the matchers, no bytes
moved) are listed apart from them. Kernels and bytes per decode step are shown before -> after, then the compile
time (cold or served from the caches) and the path of the HTML report.

Public names: `print_run_summary`, `summary_rows`, `family_rows`, `REWRITE_FAMILIES`.
"""

from __future__ import annotations
from .compiler.units import human_bytes
from .passes.manager import REWRITE_FAMILIES

__all__ = ["print_run_summary", "summary_rows", "family_rows", "REWRITE_FAMILIES"]



def _count(n) -> str:
    return "-" if n is None else f"{n:,}"


def _compile_text(c: dict) -> str:
    """The compile row: seconds, cold or served from the caches, and the largest phases."""
    cache = c.get("cache") or {}
    if c.get("served_from_cache"):
        how = f"served from the caches ({cache.get('fxgraph_hit', 0)} FX-graph hit(s), no miss)"
    elif cache.get("fxgraph_hit") and c.get("dsv41_records_from_cache") is False:
        how = "compiled again: Inductor's cache hit, but dsv41's records of it were missing"
    elif cache.get("fxgraph_miss"):
        how = f"cold ({cache['fxgraph_miss']} FX-graph cache miss(es))"
    else:
        how = "no Inductor graph compiled"
    ph = c.get("phases_s") or {}
    parts = [f"Dynamo {ph['bytecode_tracing']:.0f} s" if "bytecode_tracing" in ph else None,
             f"dsv41 passes {ph['pass.post_grad_passes.post_grad_custom_post_pass']:.0f} s"
             if "pass.post_grad_passes.post_grad_custom_post_pass" in ph else None,
             f"C++/Triton build {ph['compile_file']:.0f} s" if "compile_file" in ph else None]
    if c.get("count_kernels_s"):
        parts.append(f"kernel count {c['count_kernels_s']:.0f} s")
    parts = [p for p in parts if p]
    return f"{c['compile_s']:.1f} s, {how}" + (f"; {', '.join(parts)}" if parts else "")


def summary_rows(result: dict, report_path: str | None = None, acceptance=None) -> list[tuple[str, str]]:
    """(label, value) rows of the result table of a `dsv41 run` result dict (keys as `cli._cmd_run` writes them;
    `report` optional). Units: tok/s, bytes per token, seconds, bytes and kernels per decode step."""
    rows = [("decode", f"{result['decode_tok_s']:,.2f} tok/s"),
            ("prefill", f"{result['prefill_tok_s']:,.1f} tok/s ({result['prompt_len']}-token prompt)")]
    match = result.get("tokens_match_eager")
    rows.append(("new tokens", f"{result['new_tokens']}, identical to eager: "
                 + ("-" if match is None else ("yes" if match else "NO"))))
    rows.append(("KV cache per token", f"{result['kv_bytes_per_token']:g} B logical, "
                 f"{result['kv_bytes_per_token_allocated']:.1f} B allocated"))
    if acceptance is not None:
        sim = result.get("simulated_acceptance")
        rows.append(("DSpark acceptance", f"{acceptance[0]:.3f} tokens/round"
                     + (f" (simulated {sim})" if sim is not None else "") + f"; greedy {acceptance[1]:.3f}"))
    if result.get("compile"):
        rows.append(("compile", _compile_text(result["compile"])))
    rep = result.get("report")
    if rep is not None:
        k = rep.get("kernels") or {}
        kl = rep.get("kernels_by_layer") or {}
        if k.get("before") is not None:
            rows.append(("kernels per step", f"{_count(k['before'])} -> {_count(k['after'])} "
                         f"(profiled on {result['device']})"))
        elif kl.get("total") is not None:
            rows.append(("kernels per step", f"{_count(kl['total'])} launches after (static count; before: "
                         "option count_kernels)"))
        b = rep.get("bytes") or {}
        rows.append(("bytes per step", f"{human_bytes(b.get('before_value'))} -> "
                     f"{human_bytes(b.get('after_value'))} (the chains dsv41 fused)"))
        by_role = result.get("kernels_per_step_by_role") or {}
        per = by_role.get("per_layer") or {}
        if by_role:
            rows.append(("launches by layer role", ", ".join(
                f"{r} {n}" + (f" ({per[r]['layers']} layer{'s' if per[r]['layers'] != 1 else ''})" if r in per else "")
                for r, n in by_role.items() if r != "per_layer")))
    if report_path:
        rows.append(("report", f"{report_path} (open in a browser)"))
    if result.get("device") == "cpu":
        rows.append(("note", "CPU tok/s moves ~10x with other load and OpenMP threads: not a benchmark"))
    return rows


def family_rows(report: dict) -> tuple[list[tuple[str, str, str]], list[tuple[str, int]]]:
    """([(family, matches, bytes per step before -> after)] for the fusing families with a match,
    [(rewrite family, rewrites)]) of a `FusionReport.to_dict()`."""
    fused, rewrites = [], []
    for name, f in (report.get("families") or {}).items():
        n = f.get("matches", 0)
        if name in REWRITE_FAMILIES:
            rewrites.append((name, n))
        elif n:
            fused.append((name, f"{n:,}", f"{human_bytes(f.get('bytes_before_value'))} -> "
                                          f"{human_bytes(f.get('bytes_after_value'))}"))
    return fused, rewrites


def print_run_summary(result: dict, console, report_path: str | None = None, acceptance=None) -> None:
    """Print the result table, then the fusions table (matches per family) and the rewrites line.

    Args: result: the `dsv41 run` result dict; console: a rich Console; report_path: the HTML report as shown to
    the user, or None; acceptance: (mean, natural) DSpark acceptance lengths of a speculative run, or None.
    """
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    title = (f"dsv41 run: {result['preset']} ({result['weight_mode']}, {result['dtype']}) on {result['device']}, "
             f"backend {result['backend']}")
    t = Table(title=escape(title), title_justify="left", show_header=False, box=box.SIMPLE, pad_edge=False)
    t.add_column("what", style="bold", no_wrap=True)
    t.add_column("value", overflow="fold")
    for label, value in summary_rows(result, report_path, acceptance):
        t.add_row(escape(label), escape(value))
    console.print(t)
    rep = result.get("report")
    if rep is None:
        return
    fused, rewrites = family_rows(rep)
    f = Table(title="fused: matches per family", caption="each match is one fused op", title_justify="left",
              caption_justify="left", box=box.SIMPLE, pad_edge=False)
    f.add_column("family", no_wrap=True)
    f.add_column("matches", justify="right", no_wrap=True)
    f.add_column("bytes per step before -> after", no_wrap=True)
    for name, n, moved in fused:
        f.add_row(escape(name), n, moved)
    if fused:
        console.print(f)
    if rewrites:
        console.print("rewrites (canonical forms for the matchers, not fusions, no bytes moved): "
                      + ", ".join(f"{n} {c:,}" for n, c in rewrites), markup=False, highlight=False)
