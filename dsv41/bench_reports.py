"""What `dsv41 bench` keeps of each compiled row's fusion report: the matches per family and the static launches
(`attach_report`), the kernels' source lines (`with_origins`) and the "where the step goes" table
(`set_breakdown`, `dsv41/compiler/breakdown.py`).

`ORIGINS` and `REPORTS` are keyed by id(result row) and cleared at the start of each run (an earlier run's row ids
may be reused). Every public name is also importable from `dsv41.bench` (with a leading underscore there, as
before the split).
"""

from __future__ import annotations

from .bench_protocol import fail_text, launches_by_name

__all__ = ["ORIGINS", "REPORTS", "PROFILE_STEPS", "set_breakdown", "with_origins", "attach_report", "profiled_row",
           "set_prefill_breakdown"]

#: id(result row) -> {Inductor kernel name: origins} of the row's cold compile (`FusionReport.kernel_origins`).
ORIGINS: dict = {}


#: id(result row) -> the FusionReport of the row's cold compile (launch detail and bytes for `step_breakdown`).
REPORTS: dict = {}
#: Decode steps `profile_decode_step` profiles per compiled row (eager rows: one): the breakdown's times are their
#: mean.
PROFILE_STEPS = 3


def set_breakdown(row: dict, step_events, copy_tb_s, say, name: str, notes: list,
                   decode_bytes: float | None = None) -> None:
    """Put the `step_breakdown` table (`compiler/breakdown.py`) and `gap_per_boundary_us` into a row, from the
    profiled steps' kernels (None: static counts only) and the row's fusion report; the dsv41 row's report (JSON
    and object) gets the table too, so the fusion report shows it. A failure becomes a note in `notes`, never a
    number."""
    from .compiler.breakdown import step_breakdown
    rep = REPORTS.get(id(row))
    try:
        bd = step_breakdown(step_events, rep, copy_tb_s)
    except Exception as e:  # diagnostic: the row keeps every other figure
        notes.append("step breakdown " + fail_text(e))
        return
    if decode_bytes and copy_tb_s:  # the budget's floor of the whole step, beside the report's per class
        bd["roofline_step_us"] = decode_bytes / (copy_tb_s * 1e12) * 1e6
    row["step_breakdown"] = bd
    row["gap_per_boundary_us"] = bd["gap_per_boundary_us"]
    if isinstance(row.get("report"), dict):
        row["report"]["step_breakdown"] = bd
        if rep is not None:
            rep.step_breakdown = bd
    if step_events is not None:
        top = ", ".join(f"{c} {e['time_us']:.0f} us x{e['launches']}" for c, e in list(bd["classes"].items())[:6])
        gap = bd["gap_per_boundary_us"]
        say(f"{name}: where the step goes ({bd['steps_profiled']} steps): {top}; gap per boundary "
            + ("-" if gap is None else f"{gap:.3f}") + " us")


def profiled_row(row: dict, k: dict, res: dict, say, name: str, notes: list) -> None:
    """Fill a row from `harness.profile_decode_step`'s result `k`: the step breakdown (`set_breakdown`, with the
    result's copy bandwidth and decode bytes), `kernels_per_step`, `memcpy_memset_per_step`, `step_gpu_busy_us`,
    `step_span_us`, `kernel_time_top` (with the compile's source lines), `kernel_launches_by_name` and, where a static
    count exists, `kernels_static_minus_profiler`; says one line with the costliest kernels."""
    set_breakdown(row, k["step_events"], res["copy_bandwidth_tb_s"], say, name, notes, res["decode_bytes_per_step"])
    row["kernels_per_step"] = k["kernels"]
    row["memcpy_memset_per_step"] = k["memcpy_memset"]
    row["step_gpu_busy_us"] = k["gpu_busy_us"]
    row["step_span_us"] = k["span_us"]
    row["kernel_time_top"] = with_origins(k["top_us"], ORIGINS.get(id(row), {}))
    row["kernel_launches_by_name"] = launches_by_name(k["names"])
    say(f"{name}: one step: GPU busy {k['gpu_busy_us']:.0f} us over a {k['span_us'] or 0:.0f} us span; top: "
        + ", ".join(f"{t['name'][:40]} x{t['count']} {t['total_us']:.0f} us"
                    + (f" [{t['origin'][0][:70]}]" if t.get("origin") else "") for t in row["kernel_time_top"][:8]))
    if row.get("kernels_per_step_static") is not None:
        row["kernels_static_minus_profiler"] = row["kernels_per_step_static"] - k["kernels"]


def set_prefill_breakdown(row: dict, runner, prompt, compiled_prefill: bool, notes: list) -> None:
    """`prefill_breakdown` of a row on CUDA (issue [prefill] "profile first"): the GPU kernels of one prefill of
    `prompt` (`generate(runner, prompt, 1)`: the cache reset, the prefill, eager or through `runner` in chunks with
    `compiled_prefill`, and the first token's argmax) per op class, as `compiler.breakdown.step_breakdown` tables a
    decode step (`launches`, `time_us`, the timeline's `span_us`, `busy_us`, `gap_per_boundary_us`), without byte
    floors (the report's bytes are a decode step's). A failure becomes a note, never a number."""
    from .compiler.breakdown import step_breakdown
    from .harness import profiled_steps
    from .model import generate
    try:
        steps = profiled_steps([lambda: generate(runner, prompt, 1, compiled_prefill=compiled_prefill)])
        row["prefill_breakdown"] = step_breakdown(steps, None, None)
    except Exception as e:  # diagnostic: the row keeps every other figure
        notes.append("prefill breakdown " + fail_text(e))


def with_origins(top: list, origins: dict) -> list:
    """`kernel_time_top` rows with `origin` (the kernel's source lines and ATen ops) where the compile knew it."""
    return [dict(t, origin=origins.get(t["name"])) if origins.get(t["name"]) else t for t in top]


def attach_report(row: dict, full: bool, roles=None) -> None:
    """Put the dsv41 FusionReport of the compile that just ran into a dsv41 row (whole report for `dsv41`), with
    its static launches per step by layer role when the layer `roles` (`ModelConfig.roles`) are given."""
    from ._package import repair
    repair()  # dsv41 imported as a namespace package: its __init__ (last_report) runs first
    from . import last_report  # the package's name, which callers may replace
    rep = last_report()
    if rep is None:
        row["note"] = "the dsv41 backend produced no fusion report"
        return
    if roles is not None:
        rep.set_layer_roles(roles)
    d = rep.to_dict()
    ORIGINS[id(row)] = rep.kernel_origins()
    REPORTS[id(row)] = rep
    row["fusion_matches"] = {f: v.get("matches") for f, v in d.get("families", {}).items()}
    row["kernels_per_step_by_role"] = d.get("kernels_by_role")
    row["kernels_per_step_static"] = (d.get("kernels_by_layer") or {}).get("total")
    row.setdefault("kernels_static_minus_profiler", None)
    if full:
        row["report"] = d
