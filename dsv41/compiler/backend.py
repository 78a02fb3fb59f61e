"""The `dsv41` torch.compile backend, by name or as an object that keeps its report.

    torch.compile(model, backend="dsv41")                                  # no import of dsv41 needed
    torch.compile(model, backend="dsv41", options={"report": True, "disable": ["dispatch"]})
    be = dsv41.Backend(); torch.compile(model, backend=be, options={...}); ...; be.report

`pyproject.toml` declares `dsv41 = "dsv41.compiler.backend:dsv41_backend"`; Dynamo loads it on first use
(ARCHITECTURE.md "The user's view"). Each graph Dynamo hands over is compiled by `pipeline.compile_graph`; the
graphs of one `torch.compile(...)` call share one `FusionReport`, which `dsv41.last_report()` returns after the
compile (the documented hook for the string form), and which a `Backend` object also keeps as its `report`.

How the graphs of one call find their report. A `Backend` object is its own key: every graph it compiles adds to
its `report`, with no look-up. The string form has no such object of dsv41's: `torch.compile` builds a
`torch._TorchCompileWrapper` per call and invokes the registered function from the wrapper's `__call__`, passing
only (graph, example inputs, options, mode). No public API of torch (2.11 to 2.13 checked) tells a backend which
`torch.compile` call it serves: Dynamo's compile context numbers frames, not calls (a graph break starts another
frame), and its compile callbacks (`torch._dynamo.callback`) carry only that compile id. So `_torch_compile_call`,
one small function, finds the wrapper in the calling frames; `tests/test_backend_report.py` pins what it relies on,
so a torch that changes it fails there, not in a user's report.
"""

from __future__ import annotations

import sys

from .options import parse_options
from .report import FusionReport

__all__ = ["dsv41_backend", "Backend"]

#: Attribute of torch.compile's per-call wrapper that holds that call's FusionReport (string form only).
_REPORT_ATTR = "_dsv41_report"


class Backend:
    """The dsv41 backend as an object that keeps the report of what it compiled.

    `torch.compile(model, backend=dsv41.Backend(), options={...})`: every graph of that compile (graph breaks,
    recompiles for new shapes) adds to `report`, the `FusionReport` this object keeps, so the report reaches the
    caller through the object it passed in. Use one object per `torch.compile` call (a second call with the same
    object adds to the same report).

    Args:
        options: the backend options (keys in `dsv41.compiler.options.OPTION_KEYS`), used when `torch.compile` is
            given none; `torch.compile(..., options=)` takes precedence.
    Attributes:
        report: the `FusionReport` (None until the first graph is compiled).
    Raises (when called): as `dsv41_backend`.
    """

    def __init__(self, options: dict | None = None):
        self.options = options
        self.report: FusionReport | None = None

    def __call__(self, gm, example_inputs, options=None, mode=None):
        """Compile one Dynamo graph into `self.report` (arguments and result as `dsv41_backend`)."""
        opts = parse_options(options if options is not None else self.options)
        if self.report is None:
            self.report = FusionReport(opts)
        from .pipeline import compile_graph
        return compile_graph(gm, example_inputs, opts, self.report, mode=mode)


def _torch_compile_call():
    """The `torch._TorchCompileWrapper` of the `torch.compile(..., backend="dsv41")` call compiling now, or None
    when the backend was called some other way (e.g. passed as a function to `torch._dynamo.optimize`).

    The one place dsv41 reads the call stack (module docstring: torch gives a string-named backend no handle on
    its compile call). The wrapper calls `dsv41_backend` from its `__call__`, so it is `self` a frame or two above
    `dsv41_backend`; it is recognised by its `compiler_fn` being `dsv41_backend`.
    """
    frame = sys._getframe(2)  # skip this function and dsv41_backend
    for _ in range(4):
        if frame is None:
            return None
        cand = frame.f_locals.get("self")
        if cand is not None and getattr(cand, "compiler_fn", None) is dsv41_backend:
            return cand
        frame = frame.f_back
    return None


def _report_for_call(opts) -> FusionReport:
    """The FusionReport of the torch.compile call compiling now: kept on its wrapper (`_torch_compile_call`), so
    graph breaks and recompiles of that call share it and it lives as long as the compiled object; a new report
    per graph when no wrapper is found."""
    owner = _torch_compile_call()
    report = getattr(owner, _REPORT_ATTR, None)
    if report is None:
        report = FusionReport(opts)
        if owner is not None:
            setattr(owner, _REPORT_ATTR, report)
    return report


def dsv41_backend(gm, example_inputs, options=None, mode=None):
    """Compile a Dynamo FX graph with dsv41's fusion passes and Inductor (the backend named "dsv41").

    Args:
        gm: the `torch.fx.GraphModule` Dynamo captured.
        example_inputs: its example inputs (real tensors, or fakes under export).
        options: the dict given to `torch.compile(..., options=)`; keys in `dsv41.compiler.options.OPTION_KEYS`.
        mode: the `torch.compile` mode, forwarded to Inductor (`torch._inductor.list_mode_options`).
    Returns:
        The compiled callable. Its report: `dsv41.last_report()` after the compile (or use `Backend`).
    Raises:
        ValueError / TypeError: invalid options (Dynamo re-raises them wrapped in `BackendCompilerFailed`,
        whose `inner_exception` is the original error).
    """
    opts = parse_options(options)
    report = _report_for_call(opts)
    from .pipeline import compile_graph
    return compile_graph(gm, example_inputs, opts, report, mode=mode)
