"""Where a decode step goes: GPU time, byte floor and launches per op class (issue 37, items 2 and 5).

`step_breakdown(steps, report, copy_bandwidth_tb_s)` builds the benchmark rows' `step_breakdown` table from the
GPU kernels of a few profiled decode steps (`dsv41.harness.profile_decode_step`, torch.profiler) and the fusion report
of the row's compile:

- op class of a kernel (`classify_kernel`): a dsv41 Triton kernel belongs to the fused op whose CUDA host code
  launches it (`kernel_ops`: read off the host functions of `kernels.census.cuda_hosts()`, following the functions
  and modules they name, so a new kernel is found without a table). Variants of one op that launch the same kernels
  are one class, named after the first op of `OP_GROUPS` (the profiler cannot tell a `linear_fp4` launch of
  `_quant_gemv_kernel` from a `linear_fp8_block` one). A kernel several classes launch (`_frag_x_kernel`, the
  activation quantisation in front of both GEMV kinds) is a class of its own, named after the kernel. Inductor's
  kernels (`triton_poi_...`, `triton_per_...`) are one class, `inductor`, split by kind under `by_kind`; then
  `blas` (cuBLAS / cuBLASLt / CUTLASS), `aten` (ATen's own CUDA kernels), `copies` (memcpy / memset), `nccl`,
  `other`.
- `time_us`: the class's summed kernel durations per step, mean over the profiled steps; `launches`: its kernels
  per step (median over the steps). Without a GPU profile (CPU) `time_us` is null and `launches` is the static count
  of the compiled code (`FusionReport` graphs' `layer_kernels.detail`), or null when there is none.
- `bytes`: what the class must move per step, the `bytes_after` of the fusion report's sites of its ops (weights,
  activations read and written, at the compiled shapes); `floor_us` = bytes / the copy bandwidth of the same run
  (bytes read + written per second, as the roofline). Null for classes without sites: Inductor glue, libraries,
  copies, and shared kernels, whose bytes are counted with the ops around them.
- the step's timeline: `span_us` (first kernel start to last kernel end), `busy_us` (time with at least one kernel
  running: the union of the intervals, so PDL and side-stream overlap is not counted twice), `overlap_us` (summed
  durations minus busy), and `gap_per_boundary_us` = (span - busy) / (launches - 1): the idle GPU time per kernel
  boundary. Medians over the profiled steps.

Public names: `step_breakdown`, `classify_kernel`, `kernel_ops`, `op_class`, `set_step_time`, `table_rows`,
`find_breakdown`. Profiling a runner is the app layer's (`dsv41.harness.profile_decode_step`, and
`dsv41.harness.profile_breakdown` for `dsv41 report`): the compiler runs no model.
"""

from __future__ import annotations

import functools
import re
import statistics
import types
from collections import Counter
from typing import Iterable, Mapping, NamedTuple, Sequence

__all__ = ["KernelEvent", "STEP_MARK", "OP_GROUPS", "op_class", "kernel_ops", "classify_kernel", "inductor_kind",
           "classify_static", "kernel_events", "split_steps", "step_timeline", "static_counts", "step_breakdown",
           "set_step_time", "table_rows", "find_breakdown"]

#: Name of the `record_function` range around each profiled decode step (`harness.profile_decode_step`).
STEP_MARK = "dsv41 decode step"
INDUCTOR, BLAS, ATEN, COPIES, NCCL, OTHER = "inductor", "blas", "aten", "copies", "nccl", "other"

#: Ops whose kernels the profiler cannot tell apart (they launch the same Triton kernels): one class, named after
#: the first. An op not listed is a class of its own.
OP_GROUPS = {
    "linear_fp8_block": ("linear_fp8_block", "linear_fp4", "linear_fp8_block_multi"),
    "grouped_linear_fp4": ("grouped_linear_fp4", "grouped_linear_fp4_pair"),
    "rope_fp4": ("rope_fp4_quant", "rope_fp4_fake_quant", "rope_fp4_quant_store"),
    "c2_compressor": ("c2_norm_rope_fp4_store", "c2_pool_norm_rope_fp4_store"),
    "indexer_topk": ("indexer_topk", "indexer_candidates"),
}
_GROUP_OF = {op: g for g, ops in OP_GROUPS.items() for op in ops}
_BLAS = re.compile(r"cublas|nvjet|cutlass|xmma|gemm|gemv|splitkreduce", re.I)
_ATEN = re.compile(r"at::native|at_cuda_detail|at::cuda", re.I)
_DSV41_LIKE = re.compile(r"^_[A-Za-z0-9_]+_kernel$")
#: Inductor kernels whose fused-op words are all data movement are copies / casts (`triton_poi_fused__to_copy_3`).
_MOVE_WORDS = {"to", "copy", "clone", "view", "unsafe", "slice", "select", "unsqueeze", "squeeze", "expand",
               "permute", "cat", "transpose", "reshape", "alias", "t"}
_BUFFER_CALLS = {"copy_", "zero_", "fill_", "index_put_", "scatter_", "scatter_add_", "index_copy_"}


class KernelEvent(NamedTuple):
    """One GPU activity of a profiled step: kernel (or memcpy / memset) name, start and end in µs (profiler clock)."""

    name: str
    start_us: float
    end_us: float


# ------------------------------------------------------------------------------------------------ classes
def op_class(op: str) -> str:
    """Class name of a dsv41 op, in any spelling (`dsv41::linear_fp4`, `torch.ops.dsv41.linear_fp4.default`,
    `linear_fp4`): its `OP_GROUPS` group, else the op name itself."""
    name = _bare(op)
    return _GROUP_OF.get(name, name)


def _code_objects(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_objects(c)


def _kernel_name(obj) -> str | None:
    """`__name__` of the `@triton.jit` function under `obj` (autotuner / heuristics wrappers keep it as `.fn`)."""
    from triton.runtime.jit import JITFunction
    for _ in range(4):
        if isinstance(obj, JITFunction):
            return getattr(obj, "__name__", None) or getattr(getattr(obj, "fn", None), "__name__", None)
        obj = getattr(obj, "fn", None)
    return None


def _reached_kernels(host) -> set:
    """Names of the Triton kernels `host` can launch: kernels named by it or by the dsv41 functions it names,
    transitively (globals, closure cells, attributes of the dsv41 modules it names or imports inside a function).
    Over-approximates (every branch counts); never runs anything."""
    import sys

    from triton.runtime.jit import KernelInterface
    seen, found, todo = set(), set(), [host]
    while todo:
        fn = todo.pop()
        fn = getattr(fn, "__wrapped__", fn)
        code = getattr(fn, "__code__", None)
        if code is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        names = set()
        for co in _code_objects(code):
            names |= set(co.co_names) | set(co.co_freevars)
        glb = getattr(fn, "__globals__", {})
        objs = [glb[n] for n in names if n in glb]
        objs += [c.cell_contents for c in (fn.__closure__ or ()) if _cell_filled(c)]
        pkg = (getattr(fn, "__module__", "") or "").rpartition(".")[0]
        objs += [sys.modules[f"{pkg}.{n}"] for n in names if f"{pkg}.{n}" in sys.modules]  # `from . import x`
        for m in [o for o in objs if isinstance(o, types.ModuleType) and o.__name__.startswith("dsv41.")]:
            objs += [getattr(m, n) for n in names if hasattr(m, n)]
        for o in objs:
            if isinstance(o, KernelInterface):
                k = _kernel_name(o)
                if k:
                    found.add(k)
            elif isinstance(o, types.FunctionType) and (o.__module__ or "").startswith("dsv41."):
                todo.append(o)
            elif isinstance(o, type) and (o.__module__ or "").startswith("dsv41."):
                todo += [getattr(v, "__func__", v) for v in vars(o).values()
                         if isinstance(v, (types.FunctionType, staticmethod, classmethod))]
    return found


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty closure cell
        return False
    return True


@functools.lru_cache(maxsize=1)
def kernel_ops() -> Mapping[str, frozenset]:
    """{Triton kernel name: frozenset of the dsv41 op names (no namespace) whose CUDA host code can launch it}, plus
    every other `@triton.jit` function defined in `dsv41.kernels` mapped to an empty set. Imports every module of
    `dsv41.kernels` (the hosts import some lazily). Empty when the kernels do not import (no Triton): the
    classification then falls back to name patterns. Cached for the process."""
    import importlib
    import pkgutil
    try:
        from ..kernels.census import cuda_hosts
        import dsv41.kernels as pkg
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"dsv41.kernels.{info.name}")
    except Exception:  # no Triton, or a kernel module broken on this host: classify by name patterns only
        return {}
    out: dict = {}
    for op, host in sorted(cuda_hosts().items()):
        try:
            reached = _reached_kernels(host)
        except Exception:  # one host the walk cannot read leaves its kernels to the name patterns
            continue
        for k in reached:
            out.setdefault(k, set()).add(op.split("::")[-1])
    import sys
    for name, mod in list(sys.modules.items()):
        if name.startswith("dsv41.kernels.") and mod is not None:
            for v in list(vars(mod).values()):
                k = _kernel_name(v) if not isinstance(v, type) else None
                if k and not k.startswith(("triton_", "tl_")):
                    out.setdefault(k, set())
    return {k: frozenset(v) for k, v in out.items()}


def inductor_kind(name: str) -> str:
    """Kind of an Inductor kernel by its name: `copy/cast` (a pointwise kernel whose fused ops only move data),
    `pointwise` (`triton_poi_`), `reduction` (`triton_per_`, `triton_red_`), `template` (`triton_tem_`), else
    `other`."""
    m = re.match(r"^triton_(poi|per|red|tem)_fused_?(.*?)(_\d+)?$", name)
    if m is None:
        return "other"
    if m.group(1) == "poi":
        words = [w for w in m.group(2).split("_") if w]
        return "copy/cast" if words and set(words) <= _MOVE_WORDS else "pointwise"
    return {"per": "reduction", "red": "reduction", "tem": "template"}[m.group(1)]


def classify_kernel(name: str, known: Mapping[str, frozenset] | None = None) -> tuple[str, str]:
    """(class, kind) of one profiler kernel name. kind: `dsv41` (the kernel of one op class), `dsv41 shared`
    (launched by several op classes: the class is the kernel's name), `dsv41 unattributed` (a dsv41-looking kernel
    no host was seen to launch: the class is its name), `inductor`, `library` (blas, nccl), `aten`, `copy`, `other`.
    `known`: `kernel_ops()` (the default) or a stand-in."""
    known = kernel_ops() if known is None else known
    low = name.lower()
    if low.startswith(("memcpy", "memset")):
        return COPIES, "copy"
    ops = known.get(name)
    if ops:
        classes = sorted({op_class(o) for o in ops})
        return (classes[0], "dsv41") if len(classes) == 1 else (name, "dsv41 shared")
    if name.startswith("triton_"):
        return INDUCTOR, "inductor"
    if "nccl" in low:
        return NCCL, "library"
    if _ATEN.search(name):
        return ATEN, "aten"
    if _BLAS.search(name):
        return BLAS, "library"
    if name in known or _DSV41_LIKE.match(name):
        return name, "dsv41 unattributed"
    return OTHER, "other"


def classify_static(what: str) -> tuple[str, str]:
    """(class, kind) of one entry of a static launch count (`LayerKernelCounts.detail`: the called op for
    op / extern / buffer launches, the kernel kind `cpp` / `triton` for Inductor's own kernels)."""
    if what.startswith("torch.ops.dsv41."):
        return op_class(what), "dsv41"
    if what.startswith("extern_kernels."):
        return BLAS, "library"
    if what.startswith(("torch.ops.", "aten.", "prims.")):
        return ATEN, "aten"
    if what in _BUFFER_CALLS:
        return COPIES, "copy"
    if re.fullmatch(r"[a-z]+", what):  # `cpp`, `triton`, `cuda`, ...: async_compile.<kind>, Inductor's code
        return INDUCTOR, "inductor"
    return OTHER, "other"


# ------------------------------------------------------------------------------------------------ events
def kernel_events(events) -> list[KernelEvent]:
    """The GPU activities (kernels, memcpy, memset) among torch.profiler `FunctionEvent`s (`prof.events()`), in
    start order. Kineto also puts a `record_function` range on the GPU timeline (`gpu_user_annotation`, a CUDA
    event spanning the range's kernels): user annotations and `STEP_MARK` ranges are not activities, so they are
    left out."""
    import torch
    cuda = torch.autograd.DeviceType.CUDA
    out = [KernelEvent(str(e.name), float(e.time_range.start), float(e.time_range.end))
           for e in events if e.device_type == cuda and not getattr(e, "is_user_annotation", False)
           and not str(e.name).startswith(STEP_MARK)]
    return sorted(out, key=lambda k: (k.start_us, k.end_us))


def split_steps(kernels: Sequence[KernelEvent], windows: Sequence[tuple[float, float]], steps: int = 1) -> list:
    """Kernels grouped into decode steps.

    With `windows` (the (start, end) µs of each step's `STEP_MARK` range on the host, which runs until the step's
    `torch.cuda.synchronize()` returns, so a step's kernels start after its range begins and end before it ends): each
    kernel goes to the window holding its start, or the nearest one (clock skew). Without: the `steps` - 1 widest
    idle gaps between consecutive kernels separate the steps. Returns one start-ordered list per step.
    Raises: ValueError for steps < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    ks = sorted(kernels, key=lambda k: (k.start_us, k.end_us))
    if windows:
        wins = sorted(windows)
        out: list = [[] for _ in wins]
        for k in ks:
            dist = [0.0 if a <= k.start_us <= b else min(abs(k.start_us - a), abs(k.start_us - b)) for a, b in wins]
            out[dist.index(min(dist))].append(k)
        return out
    if steps == 1 or len(ks) < 2:
        return [ks]
    end, gaps = ks[0].end_us, []
    for i in range(1, len(ks)):
        gaps.append((ks[i].start_us - end, i))
        end = max(end, ks[i].end_us)
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[:steps - 1])
    bounds = [0] + cuts + [len(ks)]
    return [ks[a:b] for a, b in zip(bounds, bounds[1:])]


def step_timeline(kernels: Sequence[KernelEvent]) -> dict:
    """{launches, span_us, busy_us, sum_us, overlap_us, gap_per_boundary_us} of one step's kernels: span = first
    start to last end, busy = union of the intervals, sum = summed durations, overlap = sum - busy,
    gap per boundary = (span - busy) / (launches - 1) (None below two launches; every value None without kernels)."""
    if not kernels:
        return {"launches": 0, "span_us": None, "busy_us": None, "sum_us": None, "overlap_us": None,
                "gap_per_boundary_us": None}
    ks = sorted(kernels, key=lambda k: (k.start_us, k.end_us))
    busy, cur_a, cur_b = 0.0, ks[0].start_us, ks[0].end_us
    for k in ks[1:]:
        if k.start_us > cur_b:
            busy += cur_b - cur_a
            cur_a, cur_b = k.start_us, k.end_us
        else:
            cur_b = max(cur_b, k.end_us)
    busy += cur_b - cur_a
    span = max(k.end_us for k in ks) - ks[0].start_us
    total = sum(k.end_us - k.start_us for k in ks)
    n = len(ks)
    return {"launches": n, "span_us": span, "busy_us": busy, "sum_us": total, "overlap_us": total - busy,
            "gap_per_boundary_us": (span - busy) / (n - 1) if n > 1 else None}


# ------------------------------------------------------------------------------------------------ report
def _graph_runs(report) -> tuple[dict, str]:
    """{position in report.graphs: runs per decode step} and how that was decided."""
    steps = getattr(report, "regional_step_graphs", None)
    if steps:
        return dict(Counter(i for v in steps.values() for i in v)), \
            "regional: the graphs the first decode step ran, each as often as it ran"
    return {i: 1 for i in range(len(report.graphs))}, "every compiled graph once per step"


def static_counts(report) -> dict:
    """What the fusion report knows of one decode step per class: {"launches": {class: n} or None, "bytes":
    {class: bytes}, "kinds": {class: kind}, "ops": {class: [op, ...]}, "graphs": how graphs were weighted}.
    `launches` sums the static detail of the graphs a step runs (`_graph_runs`), None when one of them was not
    counted or has no detail; `bytes` sums `bytes_after` of the sites of dsv41 ops (the `normalize` rewrites and
    other non-op records move nothing of their own)."""
    runs, how = _graph_runs(report)
    launches: Counter = Counter()
    nbytes: Counter = Counter()
    kinds: dict = {}
    ops: dict = {}
    complete = True
    for i, g in enumerate(report.graphs):
        r = runs.get(i, 0)
        if not r:
            continue
        lk = g.layer_kernels
        if lk is None or (lk.total and not lk.detail):  # a graph the step runs without a launch detail
            complete = False
        for _, items in (lk.detail if lk is not None else ()):
            for what, n in items:
                cls, kind = classify_static(str(what))
                launches[cls] += r * int(n)
                kinds.setdefault(cls, kind)
                if kind == "dsv41":
                    ops.setdefault(cls, set()).add(_bare(str(what)))
        for rec in g.records:
            for m in rec.matches:
                if rec.family == "normalize" or not m.op.startswith("dsv41::"):
                    continue
                try:
                    after = m.bytes_evaluated()[1]
                except Exception:  # an expression the compiled shapes cannot evaluate: no bytes for it
                    continue
                cls = op_class(m.op)
                nbytes[cls] += r * after
                kinds.setdefault(cls, "dsv41")
                ops.setdefault(cls, set()).add(_bare(m.op))
    return {"launches": dict(launches) if complete and report.graphs else None, "bytes": dict(nbytes),
            "kinds": kinds, "ops": {k: sorted(v) for k, v in ops.items()}, "graphs": how}


def _bare(op: str) -> str:
    """`torch.ops.dsv41.x.default`, `dsv41::x`, `x` -> `x`."""
    name = op[len("torch.ops."):] if op.startswith("torch.ops.") else op
    name = name.replace("::", ".")
    return (name[len("dsv41."):] if name.startswith("dsv41.") else name).split(".")[0]


# ------------------------------------------------------------------------------------------------ table
def _sum(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) if vals else None


def _median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def step_breakdown(steps: Sequence[Sequence[KernelEvent]] | None = None, report=None,
                   copy_bandwidth_tb_s: float | None = None,
                   known: Mapping[str, frozenset] | None = None) -> dict:
    """The "where the step goes" table of one benchmark row (module docstring for the rules).

    Args:
        steps: the GPU activities of each profiled decode step (`split_steps`), or None without a GPU profile.
        report: the row's `FusionReport` (launch detail and bytes of its compiled graphs), or None.
        copy_bandwidth_tb_s: the run's copy bandwidth, TB/s (1e12 bytes read + written per second), or None.
        known: `kernel_ops()` or a stand-in (tests).
    Returns: {"source", "steps_profiled", "copy_bandwidth_tb_s", "step_us" (None: `set_step_time` fills it),
        "roofline_step_us" (None: the benchmark fills it),
        "span_us", "busy_us", "overlap_us", "gap_per_boundary_us" (µs, medians over the steps; None without a
        profile), "classes": {class: {"kind", "launches", "time_us", "floor_us", "bytes"[, "ops"][, "by_kind"]}}
        (costliest first), "total": {"launches", "time_us", "floor_us", "bytes"}, "note"}. Plain JSON.
    Raises: ValueError for an empty `steps` list.
    """
    known = kernel_ops() if known is None else known
    static = static_counts(report) if report is not None else None
    bw = copy_bandwidth_tb_s if copy_bandwidth_tb_s and copy_bandwidth_tb_s > 0 else None
    classes: dict = {}
    notes: list = []

    def entry(cls: str, kind: str) -> dict:
        """The row of class `cls`, created empty (every figure None) on first use."""
        if cls not in classes:
            classes[cls] = {"kind": kind, "launches": None, "time_us": None, "floor_us": None, "bytes": None}
        return classes[cls]

    timelines: list = []
    if steps is not None:
        steps = [list(s) for s in steps]
        if not steps:
            raise ValueError("steps is empty: pass None when no step was profiled")
        counts, times, sub_n, sub_t = [], [], [], []
        for s in steps:
            c, t, sn, st = Counter(), Counter(), Counter(), Counter()
            for k in s:
                cls, kind = classify_kernel(k.name, known)
                entry(cls, kind)
                c[cls] += 1
                t[cls] += k.end_us - k.start_us
                if kind == "dsv41 shared":
                    classes[cls]["ops"] = sorted(known.get(k.name, ()))
                if cls == INDUCTOR:
                    sub = inductor_kind(k.name)
                    sn[sub] += 1
                    st[sub] += k.end_us - k.start_us
            counts.append(c)
            times.append(t)
            sub_n.append(sn)
            sub_t.append(st)
        for cls, e in classes.items():
            e["launches"] = statistics.median_low([c[cls] for c in counts])
            e["time_us"] = sum(t[cls] for t in times) / len(steps)
        if INDUCTOR in classes:
            subs = sorted({k for sn in sub_n for k in sn})
            classes[INDUCTOR]["by_kind"] = {k: {"launches": statistics.median_low([sn[k] for sn in sub_n]),
                                                "time_us": sum(st[k] for st in sub_t) / len(steps)} for k in subs}
        timelines = [step_timeline(s) for s in steps]
        per_step = [t["launches"] for t in timelines]
        if len(set(per_step)) > 1:
            notes.append(f"the profiled steps launched different numbers of kernels: {per_step}")
    elif static is not None and static["launches"] is not None:
        for cls, n in static["launches"].items():
            entry(cls, static["kinds"].get(cls, OTHER))["launches"] = n
    if static is not None:
        for cls, b in static["bytes"].items():
            e = entry(cls, static["kinds"].get(cls, "dsv41"))
            e["bytes"] = b
            e["floor_us"] = b / (bw * 1e12) * 1e6 if bw else None
        for cls, ops in static["ops"].items():
            if cls in classes:  # with a profile, a class only the static count names is not shown
                classes[cls].setdefault("ops", ops)
    for cls, e in classes.items():
        if e["kind"] == "dsv41":
            e.setdefault("ops", list(OP_GROUPS.get(cls, (cls,))))
        if steps is not None and e["launches"] is None:
            # a class the report names whose kernels the profile did not see under its name: measured as none
            e["launches"], e["time_us"] = 0, 0.0
    order = sorted(classes, key=lambda c: (-(classes[c]["time_us"] or 0.0), -(classes[c]["launches"] or 0),
                                           -(classes[c]["bytes"] or 0), c))
    classes = {c: classes[c] for c in order}
    total = {"launches": _sum(e["launches"] for e in classes.values()),
             "time_us": _sum(e["time_us"] for e in classes.values()),
             "floor_us": _sum(e["floor_us"] for e in classes.values()),
             "bytes": _sum(e["bytes"] for e in classes.values())}
    return {"source": _source(steps, static, bw), "steps_profiled": len(steps) if steps is not None else 0,
            "copy_bandwidth_tb_s": bw, "step_us": None, "roofline_step_us": None,
            **{k: _median(t[k] for t in timelines) for k in ("span_us", "busy_us", "overlap_us",
                                                            "gap_per_boundary_us")},
            "classes": classes, "total": total, "note": "; ".join(notes)}


def _source(steps, static, bw) -> str:
    """Where the numbers of a breakdown came from, in words (the `source` field)."""
    parts = []
    if steps is not None:
        parts.append(f"time_us and launches: torch.profiler over {len(steps)} decode step(s) after warm-up (time: "
                     "mean per step, launches: median per step)")
    elif static is not None and static["launches"] is not None:
        parts.append("launches: static count of the code compiled for this row (fusion report launch detail, "
                     f"{static['graphs']}); time_us: null, no GPU profile")
    else:
        parts.append("launches and time_us: null (no GPU profile and no static count for this row)")
    if static is not None:
        parts.append(f"bytes: bytes_after of the fusion report's dsv41 op sites ({static['graphs']})")
        parts.append("floor_us: bytes / copy bandwidth of this run" if bw else "floor_us: null, no copy bandwidth "
                     "measured (CPU)")
    else:
        parts.append("bytes and floor_us: null (no fusion report for this row)")
    return "; ".join(parts)


def set_step_time(breakdown: dict | None, decode_tok_s: float | None) -> dict | None:
    """Fill `step_us` = 1e6 / `decode_tok_s` (median decode tokens/s of the row at batch 1, so µs per step) in a
    `step_breakdown` table, or None when tok/s is unknown or not positive. Returns the table (None stays None)."""
    if breakdown is not None:
        breakdown["step_us"] = 1e6 / decode_tok_s if decode_tok_s and decode_tok_s > 0 else None
    return breakdown


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _us(x) -> str:
    """µs for a table cell: one decimal from 10 µs up, two below (a 0.13 µs floor is not "0.1")."""
    return "-" if x is None else format(x, ".1f" if abs(x) >= 10 else ".2f")


def table_rows(bd: Mapping) -> tuple[list, list, str]:
    """(headers, rows of strings, one-line footer) of a `step_breakdown` table for the terminal and HTML reports:
    one row per class (Inductor's kinds indented under it), then `total`; the footer sets the sum against the step
    (step time from tok/s, GPU span, busy time, gap per boundary) and says where the numbers came from."""
    step = bd.get("step_us")
    headers = ["op class", "launches", "time us", "floor us", "time / floor", "% of step"]

    def row(name, e, ratio: bool = True) -> list:
        """The cells of one class (or total) row; `ratio` False leaves time / floor out."""
        t, fl = e.get("time_us"), e.get("floor_us")
        return [name, _f(e.get("launches"), "d"), _us(t), _us(fl),
                _f(t / fl if ratio and t is not None and fl else None, ".1f"),
                _f(100 * t / step if t is not None and step else None, ".1f")]

    rows = []
    for name, e in (bd.get("classes") or {}).items():
        rows.append(row(name + (" (shared)" if e.get("kind") == "dsv41 shared" else ""), e))
        for sub, s in (e.get("by_kind") or {}).items():
            rows.append(row(f"  {name}: {sub}", s))
    # the total floor covers only the classes with bytes, so a total time / floor would mix two sets of classes
    rows.append(row("total", bd.get("total") or {}, ratio=False))
    total = (bd.get("total") or {}).get("launches")
    foot = [f"step {_f(step, '.1f')} us (1e6 / median decode tok/s)"]
    if bd.get("roofline_step_us") is not None:
        foot.append(f"roofline step {bd['roofline_step_us']:.1f} us (decode_bytes_per_step / copy bandwidth)")
    if bd.get("span_us") is not None:
        foot.append(f"GPU span {bd['span_us']:.1f} us, busy {_f(bd.get('busy_us'), '.1f')} us, overlap "
                    f"{_f(bd.get('overlap_us'), '.1f')} us, gap per boundary {_f(bd.get('gap_per_boundary_us'), '.3f')}"
                    f" us" + (f" over {total - 1} boundaries" if total else ""))
    span = bd.get("span_us")
    if step and span and span > 1.05 * step:
        foot.append(f"the profiled step's GPU span is {span / step:.2f}x the timed step (the profiler slows each "
                    "launch down): weigh classes against each other and their floors, not against the step alone")
    foot.append(bd.get("source") or "")
    if bd.get("note"):
        foot.append(bd["note"])
    return headers, rows, "; ".join(x for x in foot if x)


def find_breakdown(report_dict: Mapping | None, bench: Mapping | None = None) -> dict | None:
    """The `step_breakdown` to show with a report: the report's own (set by the benchmark), else the `dsv41` row's
    of a benchmark result, else None."""
    bd = (report_dict or {}).get("step_breakdown")
    if bd is None and bench is not None:
        bd = ((bench.get("backends") or {}).get("dsv41") or {}).get("step_breakdown")
    return bd if isinstance(bd, dict) else None

