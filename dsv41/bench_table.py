"""The tables `dsv41 bench` prints last (so a log's tail shows them): the rows of a run (`print_table`) and the
decode-versus-context sweep (`print_context_table`). Both also importable from `dsv41.bench`.
"""

from __future__ import annotations

__all__ = ["print_table", "print_context_table"]


def _fmt(x, spec: str) -> str:
    """`x` formatted with `spec`, or "-" for None."""
    return "-" if x is None else format(x, spec)


def _workload(res: dict) -> str:
    """What a result ran: `<preset> (<weight mode>)` of a V4.1 run, `<model> (<dtype>)` of a `--model` run."""
    return f"{res['model']} ({res['dtype']})" if res.get("model") else f"{res['preset']} ({res['weight_mode']})"


def print_table(res: dict, console=None) -> None:
    """Print the roofline line and then the result table (the table comes last, so a log's tail shows it)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .accuracy import fp32_err_text
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file: rich would wrap at 80 columns
            console = Console(width=220)
    if res.get("roofline_tok_s"):
        console.print(f"roofline: {res['decode_bytes_per_step'] / 1e9:.4f} GB/step at "
                      f"{res['copy_bandwidth_tb_s']:.2f} TB/s copy bandwidth = {res['roofline_tok_s']:.1f} tok/s "
                      f"(context {res['decode_context']})")
    t = Table(title_justify="left",
              title=f"decode benchmark: {_workload(res)}, prompt {res['prompt_len']}, "
                    f"{res['new_tokens']} new tokens, {res['repeats']} runs, {res.get('gpu') or 'cpu'}")
    for col in ("backend", "decode tok/s med [min, max]", "prefill tok/s", "kernels/step", "roofline",
                "compile s cold / warm", "peak GB", "= eager", "max rel logit err", "logit err vs fp32", "note"):
        t.add_column(escape(col), overflow="fold", no_wrap=col != "note")
    for name, e in res["backends"].items():
        d = e.get("decode_tok_s")
        match = e.get("tokens_match_eager")
        # Names and notes are text, not rich markup (an error message may hold "[...]").
        t.add_row(escape(name), f"{d['median']:.2f} [{d['min']:.2f}, {d['max']:.2f}]" if d else "-",
                  _fmt((e.get("prefill_tok_s") or {}).get("median"), ".0f"),
                  # On CPU no GPU kernel is profiled; a dsv41 row still knows its static launches per step.
                  _fmt(e.get("kernels_per_step"), "d") if e.get("kernels_per_step") is not None
                  or e.get("kernels_per_step_static") is None else f"{e['kernels_per_step_static']} static",
                  _fmt(e.get("roofline_fraction"), ".3f"),
                  f"{_fmt(e.get('compile_s'), '.1f')} / {_fmt(e.get('compile_warm_s'), '.1f')}"
                  + (f" (worker {e['precompile_wall_s']:.0f})" if e.get("precompile_wall_s") else ""),
                  _fmt(e.get("peak_mem_gb"), ".2f"), "-" if match is None else ("yes" if match else "NO"),
                  _fmt(e.get("max_rel_logit_err"), ".2e"), fp32_err_text(e), escape(e.get("note") or ""))
    console.print(t)


def print_context_table(res: dict, console) -> None:
    """The decode-versus-context table (tok/s per backend per context, and the roofline), if the run had one."""
    from rich.markup import escape
    from rich.table import Table

    dvc = res.get("decode_vs_context")
    if not dvc:
        return
    t = Table(title_justify="left", title=f"decode tok/s vs context ({dvc['tokens_per_point']} steps per point, "
                                          f"synthetic caches of {dvc['cache_max_seq_len']} positions)")
    t.add_column("backend")
    for c in dvc["contexts"]:
        t.add_column(str(c), justify="right")
    for n, per in dvc["backends"].items():
        t.add_row(escape(n), *(_fmt(per.get(str(c)), ".2f") for c in dvc["contexts"]))
    t.add_row("roofline", *(_fmt(dvc["roofline_tok_s"].get(str(c)), ".0f") for c in dvc["contexts"]))
    console.print(t)
