"""Compile-time figures of this process from torch's own counters: seconds per Dynamo / Inductor phase and the
Inductor / AOTAutograd cache hits and misses. `dsv41 run --json` and `dsv41 bench` record them per compile.

`CompileClock` takes a snapshot before a compile and returns what the compile added: wall seconds, the phases that
grew (`torch._dynamo.utils.compile_times`), cache hits / misses (`torch._dynamo.utils.counters`) and whether the
compile was cold (no FX-graph cache hit) or served from the caches (no FX-graph cache miss).

Public names: `COMPILE_PHASES`, `phase_totals`, `phase_deltas`, `cache_hits`, `cache_misses`, `CompileClock`.
"""

from __future__ import annotations

import time

__all__ = ["COMPILE_PHASES", "phase_totals", "phase_deltas", "cache_hits", "cache_misses", "CompileClock"]

#: Dynamo / Inductor compile phases kept (torch._dynamo.utils.compile_times names), outermost first:
#: Dynamo's whole frame compile, its bytecode trace, the backend call, AOTAutograd, Inductor's compile of the graph,
#: its post-grad passes (dsv41's run in the custom post pass), lowering, scheduling, code generation, the C++ /
#: Triton compile of the kernels and the guards.
COMPILE_PHASES = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler",
                  "create_aot_dispatcher_function", "aot_collect_metadata", "compile_fx_inner",
                  "_recursive_post_grad_passes", "pass.post_grad_passes.post_grad_custom_post_pass",
                  "GraphLowering.run", "Scheduler.__init__", "Scheduler.codegen", "GraphLowering.codegen",
                  "async_compile.wait", "PyCodeCache.load_by_key_path", "compile_file", "build_guards")


def phase_totals() -> dict:
    """Cumulative seconds per compile phase of this process ({phase: s} for `COMPILE_PHASES`; {} when torch does
    not report them)."""
    try:
        from torch._dynamo.utils import compile_times
        heads, vals = compile_times(repr="csv", aggregate=True)
        return {h: float(v) for h, v in zip(heads, vals) if h in COMPILE_PHASES}
    except Exception:  # noqa: BLE001 - a diagnostic only; its absence is visible as {}
        return {}


def phase_deltas(before: dict, after: dict) -> dict:
    """{phase: seconds added between two `phase_totals`} for the phases that grew (2 decimals)."""
    out = {h: round(v - before.get(h, 0.0), 2) for h, v in after.items()}
    return {h: d for h, d in out.items() if d > 0}


def cache_hits() -> dict:
    """Inductor's FX-graph and AOTAutograd cache hits so far in this process (torch._dynamo.utils.counters)."""
    from torch._dynamo.utils import counters
    return {"fxgraph": int(counters["inductor"]["fxgraph_cache_hit"]),
            "aot_autograd": int(counters["aot_autograd"]["autograd_cache_hit"])}


def cache_misses() -> int:
    """Inductor's FX-graph cache misses so far in this process (lookups that compiled; torch's counters)."""
    from torch._dynamo.utils import counters
    return int(counters["inductor"]["fxgraph_cache_miss"])


class CompileClock:
    """Snapshot of the compile counters at construction; `result(wall_s)` is what happened since.

    Usage: `clock = CompileClock()`, run the first (compiling) call, then `clock.result(seconds)`.
    """

    def __init__(self):
        self.t0 = time.perf_counter()
        self.phases = phase_totals()
        self.hits = cache_hits()
        self.misses = cache_misses()

    def result(self, compile_s: float | None = None) -> dict:
        """{"compile_s": compile seconds (given, else wall seconds since the snapshot), "cache": {"fxgraph_hit",
        "fxgraph_miss", "aot_autograd_hit"}, "served_from_cache": no FX-graph miss and at least one hit,
        "phases_s": {phase: seconds} that grew}."""
        hits = cache_hits()
        miss = cache_misses() - self.misses
        fx_hit = hits["fxgraph"] - self.hits["fxgraph"]
        return {"compile_s": round(time.perf_counter() - self.t0 if compile_s is None else compile_s, 2),
                "cache": {"fxgraph_hit": fx_hit, "fxgraph_miss": miss,
                          "aot_autograd_hit": hits["aot_autograd"] - self.hits["aot_autograd"]},
                "served_from_cache": miss == 0 and fx_hit > 0,
                "phases_s": phase_deltas(self.phases, phase_totals())}
