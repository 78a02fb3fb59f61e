"""Regional compilation: compile the repeated decoder layer once per variant instead of the whole model.

A whole-model `torch.compile` traces and lowers every one of the model's layers, so compile time grows with depth
(`small`, 16 layers: 161 s for dsv41 and 206 s for Inductor on the H200; `h200` has 40). The layers share one
`Block.forward`, so compiling each layer as its own region lets Dynamo reuse one compiled graph for every layer
of the same variant (its guards check the layer's role, compress ratio, Engram presence and the `shared` dict's
keys, not its weights, which are graph inputs), as in PyTorch's "regional compilation" recipe. The embedding (with
the Engram hashing) and the final collapse + norm + head are two more regions, so no op of a decode step runs
outside a compiled graph.

What changes against a whole-model compile:
- fusions never cross a region boundary (no pass in dsv41 matches across layers);
- with CUDA graphs each region is its own graph in Inductor's CUDA-graph tree (one replay per region);
- regions compile with static shapes (`dynamic=False`): layer variants see differently shaped inputs (Engram
  rows, the shared top-k selection), which would otherwise turn on automatic dynamic shapes;
- the fusion report has one graph per compiled variant; launches per layer (`kernels_by_layer`) are not
  attributed, since a graph serves several layers (the report's note says so).

`RegionalModel` wraps a `DeepseekV41Flash` without changing it (the eager model stays usable as a reference) and
exposes it as `_orig_mod`, like `torch.compile`'s wrapper, so `generate` and the benchmark use it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RegionalModel", "compile_regional", "REGIONAL_BACKENDS"]

#: Backends `compile_regional` accepts (the names of `dsv41 run` / `dsv41 bench`).
REGIONAL_BACKENDS = ("inductor", "inductor-cudagraphs", "dsv41")

# Variants of one region: SWA, full (ratio 2 / 1, candidate source), reindex, reuse, x Engram, x the shared
# dict's keys seen so far; 64 leaves room without letting a guard bug recompile forever.
_RECOMPILE_LIMIT = 64


class _SharedReportBackend:
    """The dsv41 backend for every region of one `compile_regional` call: one FusionReport for all regions."""

    def __init__(self, options: dict | None, mode: str | None):
        from .options import parse_options
        from .report import FusionReport
        self.opts = parse_options(options)
        self.report = FusionReport(self.opts)
        self.mode = mode

    def __call__(self, gm, example_inputs):
        from .pipeline import compile_graph
        return compile_graph(gm, example_inputs, self.opts, self.report, mode=self.mode)


class RegionalModel(nn.Module):
    """A `DeepseekV41Flash` whose embedding, each layer and head run as separately compiled regions.

    Same call signature and results as the wrapped model's `forward` (input_ids / positions int64 [B, T],
    `last_only`, `return_features`); the wrapped model is `_orig_mod` (caches, config, DSpark drafts live there).
    Input values are not range-checked per call (that is a host sync); shapes and dtypes are.
    Attributes: `report` (the shared dsv41 FusionReport, None for Inductor backends), `backend`.
    """

    def __init__(self, model, compile_fn, backend: str, report=None):
        super().__init__()
        self._orig_mod = model
        self.backend = backend
        self.report = report
        self._embed = compile_fn(model.embed_inputs)
        self._layers = [compile_fn(layer) for layer in model.layers]
        self._logits = compile_fn(model.final_logits)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last_only: bool = False,
                return_features: bool = False):
        """Logits FP32 [B, T or 1, V] (and features with `return_features`), as `DeepseekV41Flash.forward`."""
        m = self._orig_mod
        if m.max_seq_len == 0:
            raise RuntimeError("call setup_cache(batch_size, max_seq_len) before the forward")
        m._check_inputs(input_ids, positions, values=False)
        with torch._dynamo.config.patch(**_limit_patch()):
            H, pre_mix, rows = self._embed(input_ids, positions)
            H, pre_mix, feats = m.run_layers(H, pre_mix, positions, rows, return_features, layers=self._layers)
            logits = self._logits(H, pre_mix, last_only)
        return (logits, feats) if return_features else logits


def _limit_patch() -> dict:
    cfg = torch._dynamo.config
    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return {key: max(getattr(cfg, key), _RECOMPILE_LIMIT)}


def compile_regional(model, backend: str = "dsv41", options: dict | None = None) -> RegionalModel:
    """Compile `model` (a `DeepseekV41Flash`) region by region with `backend` (module docstring).

    Args:
        model: the eager model; not modified.
        backend: `inductor`, `inductor-cudagraphs` (mode "reduce-overhead") or `dsv41`.
        options: dsv41 backend options (`dsv41.compiler.options.OPTION_KEYS`); only with `dsv41`.
    Returns:
        a `RegionalModel`; nothing compiles until its first call.
    Raises:
        ValueError: unknown backend, options for a backend other than dsv41, or invalid dsv41 options.
        TypeError: `model` is not a `DeepseekV41Flash` (or has no `embed_inputs` / `run_layers` / `final_logits`).
    """
    if backend not in REGIONAL_BACKENDS:
        raise ValueError(f"unknown backend {backend!r} for regional compilation; expected one of {REGIONAL_BACKENDS}")
    if options and backend != "dsv41":
        raise ValueError(f"backend options {sorted(options)} apply to the dsv41 backend only, not {backend!r}")
    if not all(hasattr(model, a) for a in ("embed_inputs", "run_layers", "final_logits", "layers")):
        raise TypeError(f"compile_regional expects a DeepseekV41Flash, got {type(model).__name__}")
    report = None
    if backend == "dsv41":
        be = _SharedReportBackend(options, None)
        report = be.report
        report.regional = ("regional compilation: one graph per compiled layer variant, so launches are not attributed "
                       "to layers")

        def compile_fn(fn):
            return torch.compile(fn, backend=be, dynamic=False)
    else:
        mode = "reduce-overhead" if backend == "inductor-cudagraphs" else None

        def compile_fn(fn):
            return torch.compile(fn, mode=mode, dynamic=False)
    return RegionalModel(model, compile_fn, backend, report)
