"""The `dsv41` torch.compile backend, found by name through the `torch_dynamo_backends` entry point.

    torch.compile(model, backend="dsv41")                                  # no import of dsv41 needed
    torch.compile(model, backend="dsv41", options={"report": True, "disable": ["dispatch"]})

`pyproject.toml` declares `dsv41 = "dsv41.compiler.backend:dsv41_backend"`; Dynamo loads it on first use
(ARCHITECTURE.md "The user's view"). Each graph Dynamo hands over is compiled by `pipeline.compile_graph`;
the graphs of one `torch.compile(...)` call share one `FusionReport`.
"""

from __future__ import annotations

import sys
import weakref

from .options import parse_options
from .report import FusionReport

__all__ = ["dsv41_backend"]

# id(torch.compile wrapper) -> (weak reference to it, its FusionReport)
_REPORTS: dict[int, tuple] = {}


def _report_for_caller(opts) -> FusionReport:
    """The FusionReport of the torch.compile call that is compiling now.

    `torch.compile(backend="dsv41")` builds one wrapper object per call and invokes this backend from the
    wrapper's `__call__`, so the wrapper (found as `self` in a calling frame) identifies the compile call
    across graph breaks and recompiles. When the backend is called some other way (e.g. passed as a function
    to `torch._dynamo.optimize`), each graph gets its own report.
    """
    frame = sys._getframe(2)
    owner = None
    for _ in range(4):
        if frame is None:
            break
        cand = frame.f_locals.get("self")
        if cand is not None and getattr(cand, "compiler_fn", None) is dsv41_backend:
            owner = cand
            break
        frame = frame.f_back
    if owner is None:
        return FusionReport(opts)
    for k in [k for k, (ref, _) in _REPORTS.items() if ref() is None]:
        del _REPORTS[k]
    entry = _REPORTS.get(id(owner))
    if entry is None or entry[0]() is not owner:
        entry = (weakref.ref(owner), FusionReport(opts))
        _REPORTS[id(owner)] = entry
    return entry[1]


def dsv41_backend(gm, example_inputs, options=None, mode=None):
    """Compile a Dynamo FX graph with dsv41's fusion passes and Inductor.

    Args:
        gm: the `torch.fx.GraphModule` Dynamo captured.
        example_inputs: its example inputs (real tensors, or fakes under export).
        options: the dict given to `torch.compile(..., options=)`; keys in `dsv41.compiler.options.OPTION_KEYS`.
        mode: the `torch.compile` mode, forwarded to Inductor (`torch._inductor.list_mode_options`).
    Returns:
        The compiled callable.
    Raises:
        ValueError / TypeError: invalid options (Dynamo re-raises them wrapped in `BackendCompilerFailed`,
        whose `inner_exception` is the original error).
    """
    opts = parse_options(options)
    report = _report_for_caller(opts)
    from .pipeline import compile_graph
    return compile_graph(gm, example_inputs, opts, report, mode=mode)
