"""Compile one Dynamo graph: Inductor's `compile_fx` with dsv41's passes in the post-grad custom-pass hook.

ARCHITECTURE.md "Pipeline stages" 1, 2, 4, 6: Dynamo hands over an FX graph; Inductor's `compile_fx`
functionalises it to an ATen inference graph, runs its post-grad passes, then dsv41's `PassManager`
(installed as `post_grad_custom_post_pass` through `torch._inductor.config.patch`, i.e. for this compile
only — the global config and plain `torch.compile` never see it), and generates code for everything the
passes left. dsv41's fused ops are custom ops, so on CPU they run their reference implementations and the
report is the same as on a GPU.

Inductor's FX-graph / AOTAutograd caches key on `PassManager.uuid()`. A cache hit skips the passes, so the
pass records of every compiled graph are also kept in a small record cache next to Inductor's
(`<inductor cache dir>/dsv41_records/<key>.json`), keyed by everything the records depend on: the pass uuid,
the Dynamo graph's code and stack traces (source lines), the input shapes/dtypes, Inductor's portable config
and the torch version. The first compile of a graph runs with Inductor's caches on, so it fills them and a later
compile (another process, another benchmark row) is served from them in a fraction of the time. Should one be
served from them while its record or its kept launch count is missing (records deleted, `kernel_counts.py`
changed), it is compiled again with Inductor's caches off, so the passes run and the report is always complete.

The side-stream scheduler (`streams.StreamPass`, ARCHITECTURE.md "Pipeline stages" 3) is chained last in the
same hook: it plans every graph and rewrites it with fork / join ops when the `streams` option is on; its
schedule goes into the graph's report (and the record cache). After it, `write_order.WriteOrderPass` moves each
functional cache write after the last read of the cache's old contents, so Inductor writes it in place
(`schedule["cache_writes_in_place"]`).

Every compile also goes through `kernel_counts.WrapperCapture` (Inductor's `compile_fx_inner`, recording the
post-grad graph and the generated wrapper) with Inductor's kernel provenance on, so the report counts the launches
of one call per decoder layer without running anything; the count is kept next to the records for cache hits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Sequence

import torch

from ..passes.records import PassRecord
from ..passes.manager import GraphPassResult, PassManager
from .fallback_text import bounded_operator_text
from .kernel_counts import WrapperCapture, graph_counts, load_counts, provenance_config
from .options import Options
from .report import FusionReport, GraphReport, KernelCount, set_last
from .streams import StreamPass, merge_schedules
from .write_order import WriteOrderPass

__all__ = ["compile_graph"]


def _records_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older layout
        from torch._inductor.runtime.runtime_utils import cache_dir
    return os.path.join(cache_dir(), "dsv41_records")


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"T{tuple(str(s) for s in t.shape)}{tuple(str(s) for s in t.stride())}{t.dtype}{t.device.type}{t.requires_grad}"
    return f"{type(t).__name__}:{t!r}" if isinstance(t, (int, float, bool, str)) else type(t).__name__


#: While `record_graph_calls` is active: (report, graph index) of every compiled-graph call, in call order.
_CALL_LOG: list | None = None


@contextlib.contextmanager
def record_graph_calls():
    """Record which compiled dsv41 graphs run inside the block: yields a list that fills with (FusionReport,
    index of the graph in `report.graphs`) per call (nested blocks each get their own list)."""
    global _CALL_LOG
    prev, _CALL_LOG = _CALL_LOG, []
    try:
        yield _CALL_LOG
    finally:
        _CALL_LOG = prev


def _graph_call(fn, report, index: int, pdl: bool | None):
    """`fn` (a compiled graph) as Dynamo will call it: each call is noted as (report, index) in the active
    `record_graph_calls` list, and with `pdl` not None runs under `dsv41.kernels.set_pdl(pdl)` (restored after
    the call, also when it raises) -- dsv41's kernels read that switch at launch time, so each compile keeps its
    own setting next to others in the process. Inductor's calling-convention attributes are kept."""
    import functools

    from ..kernels import pdl_enabled, set_pdl

    @functools.wraps(fn)
    def call(*args, **kwargs):
        """Run the compiled graph (see `_graph_call`)."""
        log = _CALL_LOG
        if log is not None:
            log.append((report, index))
        if pdl is None:
            return fn(*args, **kwargs)
        prev = pdl_enabled()
        set_pdl(pdl)
        try:
            return fn(*args, **kwargs)
        finally:
            set_pdl(prev)

    return call


def _record_key(gm: torch.fx.GraphModule, example_inputs: Sequence, uuid: str, config_patches: dict) -> str:
    from torch._inductor import config as inductor_config

    h = hashlib.sha256()
    h.update(uuid.encode())
    h.update(gm.code.encode())
    for n in gm.graph.nodes:
        h.update(str(n.meta.get("stack_trace", "")).encode())
    h.update("|".join(_describe(t) for t in example_inputs).encode())
    portable = getattr(inductor_config, "save_config_portable", lambda: {})()
    h.update(repr(sorted((k, repr(v)) for k, v in portable.items())).encode())
    h.update(repr(sorted((k, repr(v)) for k, v in config_patches.items())).encode())
    h.update(f"{torch.__version__}|{torch.is_grad_enabled()}".encode())
    return h.hexdigest()


def _merge(results: list[GraphPassResult]) -> GraphPassResult:
    """One result per compiled graph: subgraphs (control flow bodies) are folded into their parent's records."""
    if len(results) == 1:
        return results[0]
    merged = []
    for recs in zip(*(r.records for r in results)):
        first = recs[0]
        merged.append(PassRecord(first.family, all(r.enabled for r in recs),
                                 tuple(m for r in recs for m in r.matches),
                                 tuple(m for r in recs for m in r.near_misses),
                                 tuple(f for r in recs for f in r.findings),
                                 "; ".join(sorted({r.note for r in recs if r.note})),
                                 sum(r.elapsed_s for r in recs)))

    def join(parts):
        """Non-empty parts joined by newlines, or None when all are empty."""
        parts = [p for p in parts if p]
        return "\n".join(parts) if parts else None

    return GraphPassResult(tuple(merged), join(r.graph_before for r in results), join(r.graph_after for r in results))


def _save(key: str, result: GraphPassResult, schedule: dict | None = None,
          kernels: KernelCount | None = None) -> None:
    """Keep the records of a compiled graph (and its schedule and profiled kernel count) under `key`."""
    path = os.path.join(_records_dir(), key + ".json")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"records": [r.to_dict() for r in result.records], "graph_before": result.graph_before,
                       "graph_after": result.graph_after, "schedule": schedule,
                       "kernels": None if kernels is None else dict(kernels.__dict__)}, f, default=str)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory only costs cache hits later, never correctness


def _load(key: str) -> tuple[GraphPassResult, dict | None, KernelCount | None] | None:
    """(records, schedule, profiled kernel count or None) kept under `key`, or None."""
    path = os.path.join(_records_dir(), key + ".json")
    try:
        with open(path) as f:
            d = json.load(f)
        k = d.get("kernels")
        kernels = KernelCount(**k) if isinstance(k, dict) and k.get("before") is not None else None
        return (GraphPassResult(tuple(PassRecord.from_dict(r) for r in d["records"]), d.get("graph_before"),
                                d.get("graph_after")), d.get("schedule"), kernels)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _register_ops() -> None:
    """Import dsv41.kernels, which registers the fused `dsv41::` ops the passes emit. If it cannot be imported
    the passes still run and report each chain as a near-miss with check `op_registered`."""
    try:
        import dsv41.kernels  # noqa: F401
    except ImportError:
        pass


def _compile_id() -> str:
    try:
        from torch._guards import CompileContext
        cid = CompileContext.current_compile_id()
        return str(cid) if cid is not None else "?"
    except Exception:  # compile ids are informative only
        return "?"


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence, opts: Options, report: FusionReport,
                  mode: str | None = None):
    """Compile `gm` with dsv41's passes, add its `GraphReport` to `report`, and return the compiled callable.

    Args:
        gm, example_inputs: what Dynamo passed to the backend.
        opts: validated options; report: the FusionReport of this torch.compile call.
        mode: torch.compile's `mode` ("max-autotune", ...), forwarded to Inductor as its option set.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    _register_ops()
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    # The side-stream scheduler runs last, after dsv41's families and any post-grad pass installed before.
    apply_streams, streams_reason = opts.use_streams(on_cuda)
    stream_pass = StreamPass(apply_streams, streams_reason, debug=opts.debug, strict=opts.strict)
    write_pass = WriteOrderPass(strict=opts.strict)
    prev = inductor_config.post_grad_custom_post_pass
    prev = () if prev is None else tuple(prev) if isinstance(prev, (list, tuple)) else (prev,)
    gated = opts.gated_families(on_cuda)
    manager = PassManager(opts.disable | gated.keys(), opts.debug, chained=(*prev, stream_pass, write_pass), notes=gated,
                          strict=opts.strict, gated_ops=opts.gated_ops(on_cuda),
                          side_stream=apply_streams)
    patches = {"post_grad_custom_post_pass": manager}
    if "emulate_precision_casts" in inductor_config.get_config_copy():
        # Inductor keeps fused bf16/fp16 intermediates in FP32, which is not what eager computes: measured on
        # the H200, plain Inductor on `small` (bf16) drifts to a 0.62 relative logit error and other greedy
        # tokens; on CPU `x.to(bfloat16).float()` came back unrounded. The backend must not change the model's
        # numbers, so round every intermediate as eager does, on every device.
        patches["emulate_precision_casts"] = True
    if "online_softmax" in inductor_config.get_config_copy():
        # Inductor's online-softmax rewrite (on GPUs) turns amax/exp/sum into `prepare_softmax_online` before the
        # custom pass runs, which hid the softmax of sparse attention and of mHC's Sinkhorn from dsv41's passes on
        # the H200 (0 of 6 attention sites on `tiny`). At batch size 1 the rows it would help are short.
        patches["online_softmax"] = False
    if opts.use_cuda_graphs(on_cuda):
        patches["triton.cudagraphs"] = True
        from ..kernels import prepare_device
        for t in example_inputs:  # before CUDA-graph trees record: keep kernel state out of their pool
            if isinstance(t, torch.Tensor) and t.is_cuda:
                prepare_device(t.device)
    pdl = bool(opts.use_pdl(on_cuda))
    if pdl:
        if "triton.enable_pdl" in inductor_config.get_config_copy():
            patches["triton.enable_pdl"] = True
    if apply_streams:
        # Inductor's peak-memory reordering does not know streams: moving a join up to its fork (or the fork
        # down to its join) would undo the overlap the scheduler placed.
        patches["reorder_for_peak_memory"] = False
        if on_cuda:
            from ..kernels.streams import prepare_side_stream
            for t in example_inputs:  # side stream, its counters and its cuBLAS state exist before any capture
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    prepare_side_stream(t.device)
    if opts.count_kernels and not on_cuda:
        patches["cpp.enable_kernel_profile"] = True  # labels Inductor's C++ kernels for the profiler
    patches.update(provenance_config())  # kernel -> post-grad node provenance for the per-layer launch count
    config_patches = {}
    if mode is not None and mode != "default":
        from torch._inductor import list_mode_options
        config_patches = dict(list_mode_options(mode))
    uuid = manager.uuid()
    key = None
    if uuid is not None:
        other_patches = {k: v for k, v in patches.items() if k != "post_grad_custom_post_pass"}
        key = _record_key(gm, example_inputs, uuid, {**config_patches, **other_patches})
    loaded = _load(key) if key is not None else None
    if loaded is not None and load_counts(_records_dir(), key) is None:
        # Records without the launch count kept by the current counting rules (kernel_counts.py changed since, or
        # the count file is gone): a cache hit would skip the compile the count is read from, so compile afresh.
        loaded = None
    stored, stored_schedule, stored_kernels = loaded if loaded is not None else (None, None, None)
    dynamo_view = WrapperCapture()
    dynamo_view.remember_dynamo_graph(gm)  # before compile_fx, which may rewrite gm; shared by both compiles

    def compile_once(caches: bool):
        """compile_fx through a fresh `WrapperCapture`; `caches=False` keeps Inductor's FX-graph and AOT autograd
        caches from serving the graph, so dsv41's passes run."""
        p, ac = dict(patches), {}
        if not caches:
            p["fx_graph_cache"] = False
            if hasattr(functorch_config, "enable_autograd_cache"):
                ac["enable_autograd_cache"] = False
        cap = WrapperCapture()
        cap.dynamo_layers = dynamo_view.dynamo_layers
        # bounded_operator_text: torch <= 2.11 formats every implicit fallback's input IR as nested text, which
        # stalled whole-model compiles (see fallback_text.py).
        with inductor_config.patch(p), functorch_config.patch(ac), bounded_operator_text():
            out = compile_fx(gm, example_inputs, inner_compile=cap.inner_compile, config_patches=config_patches or None)
        return out, cap

    # Inductor's caches stay on even without dsv41's records of this graph, so this compile fills them and the next
    # one (another process, a bench row) is served from them. Their keys cover the pass uuid, so a hit is the
    # output of these passes; only the report would be missing.
    compiled, capture = compile_once(caches=True)
    if not manager.results and stored is None and key is not None:
        # Served from Inductor's caches, but dsv41 kept no records of that compile (records deleted, counting rules
        # changed, another process still writing them): compile again with the caches off for a whole report.
        compiled, capture = compile_once(caches=False)
    layer_kernels = graph_counts(capture, bool(manager.results), _records_dir() if key else None, key)
    from_cache = not manager.results and stored is not None
    schedule = merge_schedules(stream_pass.results)
    if schedule is not None and write_pass.results:
        schedule["cache_writes_in_place"] = [w for r in write_pass.results for w in r]
    if manager.results:
        result = _merge(manager.results)
        if schedule is not None and "code_after" in schedule:  # debug: show the graph with its fork / join ops
            result = GraphPassResult(result.records, result.graph_before, schedule.pop("code_after"))
    elif stored is not None:
        result, schedule = stored, stored_schedule
    else:  # Inductor had nothing to lower (e.g. a graph without ops): no post-grad graph, nothing to fuse
        from ..passes.manager import FAMILY_ORDER
        result = GraphPassResult(tuple(PassRecord(n, n not in opts.disable, note="no post-grad graph")
                                       for n in FAMILY_ORDER))

    compiled = _graph_call(compiled, report, len(report.graphs), pdl if on_cuda else None)
    kernels, count_s = None, 0.0
    if opts.count_kernels:
        if from_cache and stored_kernels is not None:
            # The same graph and the same compiled code as when it was counted (the record key covers both): the
            # profiled count is kept, not re-measured (about 10 s of a 25 s warm `tiny` compile on a 2-core CPU).
            kernels = stored_kernels
        else:
            import time

            from .profiling import count_step_kernels
            t0 = time.perf_counter()
            kernels = count_step_kernels(gm, compiled, example_inputs)
            count_s = time.perf_counter() - t0
    if key is not None and (manager.results or (kernels is not None and stored_kernels is None
                                                and kernels.before is not None)):
        _save(key, result, schedule, kernels if kernels is not None and kernels.before is not None else None)
    report.add_graph(GraphReport(len(report.graphs), _compile_id(), result.records, kernels, from_cache,
                                 result.graph_before, result.graph_after, layer_kernels=layer_kernels,
                                 schedule=schedule, count_s=count_s))
    set_last(report)
    if opts.print_report:
        report.print()
    if opts.report_path:
        report.to_json(opts.report_path)
    return compiled
