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
- CUDA graphs: Inductor's CUDA-graph trees treat every call of a compiled function as a new generation, so the
  outputs of one region (and the Engram rows or top-k selections that later layers read) would count as
  overwritten by the next region. So the regions compile WITHOUT CUDA graphs and the wrapper captures the whole
  decode step as one `torch.cuda.CUDAGraph` per input signature (batch, length, flags, cache allocation): the
  first call of a signature runs uncaptured (it compiles), the second captures (nothing executes during capture,
  so the caches are written once per step) and replays, later calls copy the inputs into static buffers and
  replay. dsv41's kernels launch with PDL inside it, and its side-stream schedule is applied (both follow the
  capture: `Options.step_captured`). Captured for `dsv41` (unless `cuda_graphs=False`) and
  `inductor-cudagraphs`; plain `inductor` stays uncaptured, as without regions;
- regions compile with static shapes (`dynamic=False`): layer variants see differently shaped inputs (Engram
  rows, the shared top-k selection), which would otherwise turn on automatic dynamic shapes;
- the fusion report has one graph per compiled variant; since a graph serves several layers, launches per layer
  (`kernels_by_layer`, and per role) come from the first decode step: the wrapper notes which compiled graphs each
  region runs (`pipeline.record_graph_calls`) and counts a layer as the static launches of its graphs.

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
# dict's keys seen so far, and every backend of a benchmark adds its own entries on the same Block.forward code.
_RECOMPILE_LIMIT = 256


class _SharedReportBackend:
    """The dsv41 backend for every region of one `compile_regional` call: one FusionReport for all regions."""

    def __init__(self, options: dict | None, mode: str | None, step_captured: bool = False):
        import dataclasses

        from .options import parse_options
        from .report import FusionReport
        self.opts = dataclasses.replace(parse_options(options), step_captured=step_captured)
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

    def __init__(self, model, compile_fn, backend: str, report=None, cuda_graphs: bool = False):
        super().__init__()
        self._orig_mod = model
        self.backend = backend
        self.report = report
        self.cuda_graphs = cuda_graphs
        self._embed = compile_fn(model.embed_inputs)
        self._layers = [compile_fn(layer) for layer in model.layers]
        self._logits = compile_fn(model.final_logits)
        # the bound forward, like the other regions, so the compiled drafter is not registered as a child module
        self._draft = compile_fn(model.mtp.forward) if getattr(model, "mtp", None) is not None else None
        # signature -> None (seen once, uncaptured) or (graph, static input_ids, static positions, static outputs)
        self._graphs: dict = {}
        self._pool = None
        #: captures / replays so far (tests and the report read them)
        self.captures = 0
        self.replays = 0

    def _run(self, input_ids, positions, last_only, return_features):
        m = self._orig_mod
        embed, layers, head = self._embed, self._layers, self._logits
        steps = None
        if self.report is not None and self.report.regional_step_graphs is None and input_ids.shape[1] == 1:
            # The first decode step (uncaptured: the wrapper captures from the second call of a signature) notes
            # which compiled graphs each region runs, for the per-layer launch counts of the report.
            steps = {}
            embed, head = self._noting("other", embed, steps), self._noting("other", head, steps)
            layers = [self._noting(i, f, steps) for i, f in enumerate(layers)]
        with torch._dynamo.config.patch(**_limit_patch()):
            H, pre_mix, rows = embed(input_ids, positions)
            H, pre_mix, feats = m.run_layers(H, pre_mix, positions, rows, return_features, layers=layers)
            logits = head(H, pre_mix, last_only)
        if steps is not None:
            self.report.regional_step_graphs = steps
        return logits, feats

    def _noting(self, tag, fn, steps: dict):
        """`fn` (a region) that adds the indices of the dsv41 graphs it runs to `steps[tag]`."""
        from .pipeline import record_graph_calls

        def run(*args, **kwargs):
            """Call the region, recording the report graphs it ran."""
            with record_graph_calls() as log:
                out = fn(*args, **kwargs)
            steps.setdefault(tag, []).extend(i for r, i in log if r is self.report)
            return out

        return run

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last_only: bool = False,
                return_features: bool = False):
        """Logits FP32 [B, T or 1, V] (and features with `return_features`), as `DeepseekV41Flash.forward`.
        On CUDA with `cuda_graphs`, the step replays a captured CUDA graph from the second call of each input
        signature on (module docstring); the returned tensors are fresh copies."""
        m = self._orig_mod
        if m.max_seq_len == 0:
            raise RuntimeError("call setup_cache(batch_size, max_seq_len) before the forward")
        m._check_inputs(input_ids, positions, values=False)

        def run(ids, pos):
            """The regions over one input (captured or not)."""
            return self._run(ids, pos, last_only, return_features)

        if not (self.cuda_graphs and input_ids.is_cuda):
            logits, feats = run(input_ids, positions)
        else:
            sig = ("step", tuple(input_ids.shape), input_ids.dtype, bool(last_only), bool(return_features))
            logits, feats = self._graphed(sig, run, (input_ids, positions))
        return (logits, feats) if return_features else logits

    def draft(self, features: torch.Tensor, feature_positions: torch.Tensor, feature_valid: torch.Tensor,
              last_token: torch.Tensor, start: torch.Tensor, embed_weight: torch.Tensor,
              head_weight: torch.Tensor):
        """One DSpark draft round through the compiled `mtp` region: arguments and results of `DSpark.forward`
        (drafts int64 [B, K], confidence logits FP32 [B, K]); the drafter `generate(..., speculative=True)` uses
        for this wrapper. With `cuda_graphs` on CUDA it replays a CUDA graph per signature, as `forward`; the
        embedding and head weights are read in place (their addresses are part of the signature).
        Raises: ValueError when the model has no DSpark stages; RuntimeError before `setup_cache`."""
        m = self._orig_mod
        if self._draft is None:
            raise ValueError("this model has no DSpark stages (num_dspark_stages = 0): nothing to draft with")
        if m.max_seq_len == 0:
            raise RuntimeError("call setup_cache(batch_size, max_seq_len) before drafting")
        args = (features, feature_positions, feature_valid, last_token, start, embed_weight, head_weight)

        def run(*a):
            """The compiled DSpark region (captured or not)."""
            with torch._dynamo.config.patch(**_limit_patch()):
                return self._draft(*a)

        if not (self.cuda_graphs and features.is_cuda):
            return run(*args)
        sig = ("draft",) + tuple((tuple(a.shape), a.dtype) for a in args[:5]) \
            + tuple((tuple(w.shape), w.dtype, w.data_ptr()) for w in args[5:])
        return self._graphed(sig, run, args, in_place=(5, 6))

    def _graphed(self, sig, run, args: tuple, in_place=()):
        """`run(*args)` through the CUDA graph of (`sig`, the cache allocation): the first call of a key runs
        uncaptured, the second captures (copies of `args`, except the indices `in_place`, become its static inputs)
        and replays, later calls copy `args` in and replay. Returns fresh copies of the graph's output tensors."""
        from torch.utils._pytree import tree_map

        m = self._orig_mod
        # A new cache allocation (setup_cache) moves every buffer: graphs captured on the old one are dropped.
        alloc = (m.batch_size, m.max_seq_len, m.layers[0].attn.ring_codes.data_ptr())
        key = (sig, alloc)
        entry = self._graphs.get(key, ())
        if entry == ():
            self._graphs = {k: v for k, v in self._graphs.items() if k[1] == alloc}
            if not any(self._graphs.values()):
                # The memory pool dies with the last graph captured into it: the next capture starts a new one
                # (capturing into the stale handle trips the caching allocator's use-count assertion).
                self._pool = None
            self._graphs[key] = None
            return run(*args)
        if entry is None:
            static = tuple(a if i in in_place else a.clone() for i, a in enumerate(args))
            graph = torch.cuda.CUDAGraph()
            # Nothing runs during capture, so the caches see this call once (at the replay that follows). Later
            # signatures share the first graph's pool (its handle lives as long as a graph captured into it does).
            with torch.cuda.graph(graph, pool=self._pool):
                out = run(*static)
            if self._pool is None:
                self._pool = graph.pool()
            entry = self._graphs[key] = (graph, static, out)
            self.captures += 1
        graph, static, out = entry
        for i, (s, a) in enumerate(zip(static, args)):
            if i not in in_place:
                s.copy_(a)
        graph.replay()
        self.replays += 1
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def _limit_patch() -> dict:
    """Dynamo's per-code-object and total recompile limits raised for the regions (names differ across torch)."""
    cfg = torch._dynamo.config
    out = {}
    for names, floor in ((("recompile_limit", "cache_size_limit"), _RECOMPILE_LIMIT),
                         (("accumulated_recompile_limit", "accumulated_cache_size_limit"), 4 * _RECOMPILE_LIMIT)):
        name = next((n for n in names if hasattr(cfg, n)), None)
        if name is not None:
            out[name] = max(getattr(cfg, name), floor)
    return out


def compile_regional(model, backend: str = "dsv41", options: dict | None = None) -> RegionalModel:
    """Compile `model` (a `DeepseekV41Flash`) region by region with `backend` (module docstring).

    Args:
        model: the eager model; not modified.
        backend: `inductor`, `inductor-cudagraphs` or `dsv41`. `inductor-cudagraphs` compiles the regions exactly as
            `inductor` does (no `mode`: Inductor's CUDA-graph trees are not used) and the wrapper captures the whole
            step in one CUDA graph, as for `dsv41`; so within one process it reuses `inductor`'s compiled regions.
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
        opts = dict(options or {})
        # The wrapper captures the whole step (module docstring); PDL and side streams follow the capture unless
        # set (`Options.step_captured`), as they follow Inductor's CUDA graphs in a whole-model compile.
        capture = opts.get("cuda_graphs") is not False
        opts["cuda_graphs"] = False
        be = _SharedReportBackend(opts, None, step_captured=capture)
        report = be.report
        report.regional = ("regional compilation: one graph per compiled layer variant; launches per layer are those "
                           "of the graphs each layer's region ran in the first decode step")

        def compile_fn(fn):
            """`fn` compiled by the shared-report dsv41 backend with static shapes."""
            return torch.compile(fn, backend=be, dynamic=False)
    else:
        capture = backend == "inductor-cudagraphs"

        def compile_fn(fn):
            """`fn` compiled by Inductor (no CUDA-graph trees: the wrapper captures) with static shapes."""
            return torch.compile(fn, dynamic=False)
    return RegionalModel(model, compile_fn, backend, report, cuda_graphs=capture)
