"""Options of the dsv41 backend: `torch.compile(model, backend="dsv41", options={...})`.

One plain dict, validated here (ARCHITECTURE.md "The user's view"): an unknown key is a ValueError that names
it and lists the valid keys; a value of the wrong type is a TypeError naming the key.

| key            | type              | default | meaning |
|----------------|-------------------|---------|---------|
| `report`       | bool or str path  | False   | True: print the fusion report after each graph compiles; a path: write it there as JSON |
| `disable`      | list of str       | ()      | pass families to switch off, by name (`dsv41.passes.FAMILY_ORDER`); they show as off in the report |
| `count_kernels`| bool              | False   | run each compiled graph once eagerly and once compiled under torch.profiler and record kernels per step before/after |
| `debug`        | bool              | False   | keep each graph's code before and after dsv41's passes in the report (`GraphReport.graph_after`) |
| `cuda_graphs`  | bool or None      | None    | CUDA graphs for graphs on CUDA (None: on) through Inductor's CUDA-graph trees (`triton.cudagraphs`): the step is recorded once per input shape and replayed; caches are module buffers, so they stay static. Ignored on CPU |
| `pdl`          | bool or None      | None    | Programmatic Dependent Launch for dsv41's kernels (None: on where the graph replays as a CUDA graph: `cuda_graphs`, or the regional wrapper's capture): `dsv41.kernels.set_pdl` around each call of the compiled graphs (other compiles keep their own), and Inductor's own `triton.enable_pdl` where the installed torch has it. Ignored on CPU |
| `gpu_unvalidated` | bool or list of str | False | also run, on CUDA, the families and fused ops whose kernels have not yet run on a GPU (`dsv41.passes.manager.GPU_UNVALIDATED`: today `rope_gqa` and `row_argmax`; `GPU_UNVALIDATED_OPS`, e.g. `linear_fp8_scaled`); off, such a family shows in the report as off with that reason and such an op's chains as near-misses `gpu_unvalidated`. CPU always runs them. A list runs only the named ones (family names, op names, variant names such as `linear_fp8_block(rms_norm)`), to measure one at a time |
| `streams`      | bool or None      | None    | side-stream overlap (`dsv41/compiler/streams.py`): None: on for graphs on CUDA replayed as CUDA graphs, Inductor's or the regional wrapper's (validated on the H200: `tests/test_streams_gpu.py`, `small` 365.6 -> 407.5 tok/s), off otherwise (outside a graph every fork/join is a host-side event record and wait; on CPU they are no-ops); True: on (on CPU fork/join are no-ops); False: off. The schedule is planned and reported either way |

| `strict`       | bool or None      | None    | re-raise when a pass family (or the stream rewrite) raises on a graph; None: the environment variable `DSV41_STRICT` (`1`/`true`/`yes`; the test suite sets it), else off. Off, a failing family's changes to that graph are undone, the other families run, and the report records a `family_failed` finding naming the family, the exception and the source line it was examining |

The environment variable `DSV41_REPORT` adds to `report`: `1`/`true`/`yes` prints the report, any other
non-empty value except `0`/`false`/`no` is a JSON path to write it to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["Options", "parse_options", "OPTION_KEYS", "OptionError", "OptionTypeError"]

#: Every valid option key, with a one-line description (printed in the unknown-key error).
OPTION_KEYS = {
    "report": "bool or JSON path: print the fusion report / write it as JSON",
    "disable": "list of pass family names to switch off",
    "count_kernels": "bool: profile one eager and one compiled run per graph and record kernels per step",
    "debug": "bool: keep each graph's code before and after the passes in the report",
    "cuda_graphs": "bool or None (auto: on): record CUDA graphs of graphs on CUDA (Inductor CUDA-graph trees)",
    "pdl": "bool or None (auto: as cuda_graphs): Programmatic Dependent Launch for the kernels on CUDA",
    "streams": "bool or None (auto: on with CUDA graphs on CUDA): move off-critical-path dsv41 ops to a side stream",
    "gpu_unvalidated": "bool, or a list of their names: also run on CUDA the families and fused ops whose kernels have "
                       "not yet run on a GPU",
    "strict": "bool or None (auto: environment DSV41_STRICT, else off): re-raise when a pass family fails on a graph",
}
_TRUE = {"1", "true", "yes", "on"}

try:
    # Dynamo re-raises a ShortenTraceback from a backend as it is; any other exception it wraps in
    # BackendCompilerFailed, whose message ends in PyTorch's "reporting a bug to PyTorch" hint. A bad option is the
    # user's error, not PyTorch's: it should read as the one line below.
    from torch._dynamo.exc import ShortenTraceback as _PassThrough
except ImportError:  # pragma: no cover - every supported torch has it; without it the error is only wrapped
    _PassThrough = Exception


class _OptionErrorBase(_PassThrough):
    """Shared part of the option errors: raised through Dynamo unwrapped, and printed as the message alone (Dynamo
    appends its "from user code" frames and hints to an exception's first argument)."""

    def __init__(self, message: str):
        if _PassThrough is Exception:
            super().__init__(message)
        else:
            super().__init__(message, first_useful_frame=None)
        self.message = message

    def __str__(self) -> str:
        return self.message


class OptionError(_OptionErrorBase, ValueError):
    """An unknown option key or a bad value (a ValueError; the key is named, and the valid keys or values)."""


class OptionTypeError(_OptionErrorBase, TypeError):
    """An option value of the wrong type, or options that are not a dict (a TypeError; the key is named)."""
_FALSE = {"", "0", "false", "no", "off"}


@dataclass(frozen=True)
class Options:
    """Validated backend options (see the module docstring for each field)."""

    print_report: bool = False
    report_path: str | None = None
    disable: frozenset = frozenset()
    count_kernels: bool = False
    debug: bool = False
    cuda_graphs: bool | None = None
    pdl: bool | None = None
    streams: bool | None = None
    #: True / False, or the frozenset of gate names (families, ops, `op(argument)` variants) run anyway.
    gpu_unvalidated: bool | frozenset = False
    strict: bool = False
    #: Not a user option: set by `compile_regional` when its wrapper captures the whole step as one CUDA graph while
    #: the regions compile without Inductor's (cuda_graphs False). PDL and side streams follow it when unset.
    step_captured: bool = False

    def to_dict(self) -> dict:
        """JSON-friendly form (shown in the report)."""
        return {"report": self.report_path or self.print_report, "disable": sorted(self.disable),
                "count_kernels": self.count_kernels, "debug": self.debug, "cuda_graphs": self.cuda_graphs,
                "pdl": self.pdl, "streams": self.streams, "gpu_unvalidated": (sorted(self.gpu_unvalidated) if isinstance(self.gpu_unvalidated, frozenset)
                                    else self.gpu_unvalidated),
                "strict": self.strict, **({"step_captured": True} if self.step_captured else {})}

    def gated_families(self, on_cuda: bool) -> dict:
        """{family: reason} of the families switched off for a graph on CUDA because their kernels have not yet
        run on a GPU (none on CPU, none with `gpu_unvalidated=True`, none already in `disable`)."""
        from ..passes import manager
        if not on_cuda or self.gpu_unvalidated is True:
            return {}
        allowed = self.gpu_unvalidated or frozenset()
        return {n: "off on CUDA: its kernels have not yet run on a GPU (option gpu_unvalidated=True runs them)"
                for n in manager.GPU_UNVALIDATED if n not in self.disable and n not in allowed}

    def gated_ops(self, on_cuda: bool) -> frozenset:
        """Fused ops the families must not emit on a graph on CUDA because their kernels have not yet run on a GPU
        (`dsv41.passes.manager.GPU_UNVALIDATED_OPS`; none on CPU, none with `gpu_unvalidated=True`, all but the
        named ones with a list)."""
        from ..passes import manager
        if not on_cuda or self.gpu_unvalidated is True:
            return frozenset()
        return frozenset(manager.GPU_UNVALIDATED_OPS) - (self.gpu_unvalidated or frozenset())

    def use_cuda_graphs(self, on_cuda: bool) -> bool:
        """Whether a graph on CUDA (`on_cuda`) is compiled with CUDA graphs (never on CPU)."""
        return on_cuda and self.cuda_graphs is not False

    def replays_as_graph(self, on_cuda: bool) -> bool:
        """Whether a graph on CUDA replays inside a CUDA graph: Inductor's (`use_cuda_graphs`) or a wrapper's that
        captures the whole step (`step_captured`, regional compilation). Never on CPU."""
        return on_cuda and (self.use_cuda_graphs(on_cuda) or self.step_captured)

    def use_pdl(self, on_cuda: bool) -> bool:
        """Whether kernels of a graph on CUDA launch with PDL (default: when it replays as a CUDA graph; never on
        CPU)."""
        return on_cuda and (self.replays_as_graph(on_cuda) if self.pdl is None else self.pdl)

    def use_streams(self, on_cuda: bool) -> tuple[bool, str]:
        """(whether the side-stream schedule is applied to a graph on CUDA (`on_cuda`) or CPU, and why)."""
        if self.streams is False:
            return False, "off: option streams=False (schedule planned, not applied)"
        if self.streams is True:
            return True, "on: option streams=True" + ("" if on_cuda else " (CPU: fork/join are no-ops)")
        # Auto: on where the step replays as a CUDA graph, the configuration validated on the H200 (greedy tokens
        # equal eager, logits bit-identical to one stream: tests/test_streams_gpu.py; `small` decode 365.6 ->
        # 407.5 tok/s, bench/results/2026-11-30_h200_s11/). Outside a graph each fork/join is a host-side event
        # record and wait, not measured; on CPU fork/join are no-ops.
        if self.replays_as_graph(on_cuda):
            return True, "on: auto (CUDA graph on CUDA" + (", captured by the regional wrapper)"
                                                           if not self.use_cuda_graphs(on_cuda) else ")")
        return False, ("off: auto (" + ("no CUDA graph" if on_cuda else "this graph is on CPU")
                       + "; streams=True applies it) (schedule planned, not applied)")


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise OptionTypeError(f"dsv41 option {key!r} must be a bool (true or false), got {type(v).__name__} {v!r}")
    return v


def _gate_names(v: Any) -> bool | frozenset:
    """The `gpu_unvalidated` value: a bool, or a list of gate names: family names and the ops / `op(argument)`
    variants of the families' chains (a name that is no longer gated is accepted and changes nothing, so a script
    keeps working once its op has run on a GPU)."""
    if isinstance(v, bool):
        return v
    from ..passes import manager
    gated = tuple(manager.GPU_UNVALIDATED) + tuple(manager.GPU_UNVALIDATED_OPS)
    if not isinstance(v, (list, tuple, set, frozenset)) or not all(isinstance(n, str) for n in v):
        raise OptionTypeError(f"dsv41 option 'gpu_unvalidated' must be a bool or a list of names, got {v!r}; "
                              f"gated now: {', '.join(gated) or 'none'}")
    known = set(manager.FAMILY_ORDER) | {name for spec in manager.FAMILIES.values() for c in spec.spec.chains
                                         for name in (c.op, *c.variants)}
    bad = sorted(set(v) - known)
    if bad:
        raise OptionError(f"dsv41 option 'gpu_unvalidated' names unknown families / ops {bad}; gated now: "
                          f"{', '.join(gated) or 'none'}")
    return frozenset(v)


def parse_options(options: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> Options:
    """Validate `options` (the dict given to `torch.compile(..., options=)`) into an `Options`.

    Args:
        options: None or a mapping with keys from `OPTION_KEYS`.
        environ: environment to read `DSV41_REPORT` and `DSV41_STRICT` from (default `os.environ`).
    Raises:
        OptionError (a ValueError): an unknown key (named, with the list of valid keys), or an unknown family in
            `disable`.
        OptionTypeError (a TypeError): `options` is not a mapping, or a value has the wrong type (the key is named).
        Both pass through Dynamo unwrapped (not as BackendCompilerFailed) and print as their one-line message.
    """
    from ..passes.manager import FAMILY_ORDER

    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise OptionTypeError(f"dsv41 options must be a dict, got {type(options).__name__}")
    unknown = sorted(str(k) for k in options if k not in OPTION_KEYS)
    if unknown:
        import difflib
        near = [m for k in unknown for m in difflib.get_close_matches(k, OPTION_KEYS, n=1)]
        hint = f" (did you mean {', '.join(repr(m) for m in near)}?)" if near else ""
        raise OptionError(f"unknown dsv41 option(s) {', '.join(repr(k) for k in unknown)}{hint}; valid options: "
                          f"{', '.join(OPTION_KEYS)} (dsv41.compiler.options.OPTION_KEYS describes each)")
    report = options.get("report", False)
    print_report, path = False, None
    if isinstance(report, bool):
        print_report = report
    elif isinstance(report, (str, os.PathLike)) and str(report):
        path = os.fspath(report)
    else:
        raise OptionTypeError(f"dsv41 option 'report' must be a bool or a JSON file path, got {report!r}")
    environ = environ if environ is not None else os.environ
    env = environ.get("DSV41_REPORT", "").strip()
    if env.lower() in _TRUE:
        print_report = True
    elif env.lower() not in _FALSE and path is None:
        path = env
    disable = options.get("disable", ())
    if not isinstance(disable, (list, tuple, set, frozenset)) or not all(isinstance(d, str) for d in disable):
        raise OptionTypeError(f"dsv41 option 'disable' must be a list of family names, got {disable!r}; "
                              f"families: {', '.join(FAMILY_ORDER)}")
    bad = sorted(set(disable) - set(FAMILY_ORDER))
    if bad:
        raise OptionError(f"dsv41 option 'disable' names unknown pass families {bad}; valid families: "
                         f"{', '.join(FAMILY_ORDER)}")
    tri = {}
    for key in ("cuda_graphs", "pdl", "streams"):
        v = options.get(key)
        tri[key] = None if v is None else _bool(key, v)
    gpu_unvalidated = _gate_names(options.get("gpu_unvalidated", False))
    strict = options.get("strict")
    if strict is None:
        strict = environ.get("DSV41_STRICT", "").strip().lower() in _TRUE
    return Options(print_report, path, frozenset(disable), _bool("count_kernels", options.get("count_kernels", False)),
                   _bool("debug", options.get("debug", False)), tri["cuda_graphs"], tri["pdl"], tri["streams"],
                   gpu_unvalidated, _bool("strict", strict))
