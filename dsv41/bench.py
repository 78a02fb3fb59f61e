"""The decode benchmark of BENCHMARK.md: backends side by side in one process, alternated run by run.

`python -m dsv41.bench --preset small --backends all --json r.json --png` (also `dsv41 bench ...`).

Backends: `eager`, `inductor` (`torch.compile` default), `inductor-cudagraphs` (`mode="reduce-overhead"`; with
`--regional`, Inductor's regions replayed in one whole-step CUDA graph that the regional wrapper captures),
`dsv41`, `torch_tensorrt` (a row with every figure null and the note "not installed" when `import
torch_tensorrt` fails; never dropped), and the ablations `dsv41-no-<family>`: dsv41 with the option
`{"disable": [<family>]}` for each pass family of `dsv41.passes.FAMILY_ORDER` (the project's ladder).
`--backends all` is all of them; `ablations` expands to every ablation. `dsv41[key=value;...]` rows run dsv41 with
those options over the run's `--option`s, and `toggles` expands to `TOGGLES` (CUDA graphs off, PDL off, side streams
off: each toggled alone from the default, issue 6).

Protocol, in this order (every backend gets the same prompt, seed 42, and the same eager module underneath):
1. eager reference: greedy tokens of `generate(model, prompt, N)` and the logits of its N-1 decode steps, kept
   from that run (`return_logits=True`: the same logits as teacher-forcing those tokens, without a second run).
   Then the FP32 reference (`dsv41.accuracy.fp32_reference`): those tokens teacher-forced through an FP32 eager copy
   of the same weights (shared quantised codes), freed before anything compiles; the run's own logits when FP32.
2. cold compile: per backend, `torch.compiler.reset()` and an empty TORCHINDUCTOR_CACHE_DIR of its own, then
   the first `generate` run (capture + compile + one run of the workload). `compile_s` = that run's wall time
   minus the median wall time of the backend's measured runs.
3. warm compile: one `torch.compiler.reset()`, then per backend a fresh `torch.compile` wrapper over the same
   cache directory and one `generate` run (Inductor's FX-graph cache hits): `compile_warm_s`, computed as
   above. This run is also BENCHMARK.md's discarded warm-up run; eager rows, which compile nothing, skip it
   (their first run warmed them).
4. per backend: kernels of ONE decode step under torch.profiler (CUDA only), and the teacher-forced logits
   against eager's (`max_rel_logit_err`; eager rows run the reference's module and step, so their logits are
   the reference's, not recomputed), and against the FP32 reference (`logit_err_vs_fp32`, `dsv41.accuracy`).
5. `repeats` measured runs per backend in the order A B C A B C ...; caches are reset in place by `generate`.

`kernels_per_step`: GPU kernel activities torch.profiler records while one warmed-up decode step runs (CUDA
graph replays included: CUPTI reports each kernel of a replayed graph); memcpy and memset activities are
`memcpy_memset_per_step`, not kernels. Null with a note on CPU, which launches no device kernels.

`kernels_per_step_by_role` (dsv41 rows): launches of one decode step per decoder-layer role, counted statically
from the code Inductor generated for the cold compile (`dsv41/compiler/kernel_counts.py`: every Inductor kernel,
extern / fallback / dsv41 op call and buffer copy of one call of the compiled graphs, attributed to a layer through
Inductor's kernel provenance and mapped to roles with `ModelConfig.roles`): {swa, full, reindex, reuse: launches
summed over the layers of that role, other: launches outside the layers, per_layer: {role: {layers, min, max,
mean}}}. `kernels_per_step_static` is their total; on CPU it is the only count, on CUDA it stands next to the
profiler's `kernels_per_step` (one dsv41 op may launch more than one kernel, and copies may run as memcpy), and
`kernels_static_minus_profiler` is the difference the GPU run checks.

`step_breakdown` (every row; `dsv41/compiler/breakdown.py`): where the step goes, per op class: `launches`,
`time_us` (GPU kernel time per step from the same profiler session as `kernels_per_step`, which profiles
`PROFILE_STEPS` steps, eager rows one; the other profiler figures are of the first), `bytes` and `floor_us` (the
fusion report's bytes of the class's ops / the copy bandwidth), with `total`, `step_us` (1e6 / median decode tok/s)
and the timeline of the profiled steps; `gap_per_boundary_us` = (span - busy) / (launches - 1). On CPU `time_us`
is null and `launches` the static count of dsv41 rows.

Roofline: `decode_bytes_per_step` = `budget(config).decode_weight_bytes` + `decode_kv_read_bytes(config, C)`
at the mean decode context C = prompt_len + new_tokens // 2; `roofline_tok_s` = device-to-device copy
bandwidth measured in this run (bytes read + written per second) / decode_bytes_per_step; a backend's
`roofline_fraction` = its median decode tok/s / roofline_tok_s. Null on CPU.

Prefill runs on the eager module for every backend (gpt-fast style), so `prefill_tok_s` measures the same code for
every row; with `compiled_prefill` it goes through each row's compiled model in `PREFILL_CHUNKS`-token chunks.
Rows carry `ttft_s`; the top level `prefill_floor_tok_s` (FLOP floor, `bench_protocol.prefill_floor`).

Result JSON (extend, don't rename; `null` where not measured, with the reason in the row's `note`):
top level `date`, `gpu`, `driver`, `torch`, `triton`, `cuda`, `host`, `preset`, `weight_mode`, `dtype`,
`device`, `prompt_len`, `new_tokens`, `repeats`, `params` {backbone, engram, total, active_decode},
`kv_bytes_per_token` {logical, allocated}, `copy_bandwidth_tb_s`, `decode_context`, `decode_bytes_per_step`,
`roofline_tok_s`, `run_order` (the measured order), `ablations_note`, `definitions` (the rules above, as
text), and `backends` = {name: {`decode_tok_s`: {median, min, max}, `prefill_tok_s`: {median, min, max},
`kernels_per_step`, `memcpy_memset_per_step`, `roofline_fraction`, `compile_s`, `compile_warm_s`,
`peak_mem_gb`, `tokens_match_eager`, `matching_prefix_tokens`, `max_rel_logit_err`, `logit_err_vs_fp32`,
`logit_err_vs_fp32_over_eager`, `step_breakdown`, `gap_per_boundary_us`, `options`, `new_tokens`
(tokens each of the row's runs decodes: `new_tokens`, `eager_new_tokens` for eager rows, or the row's
`row_new_tokens`), `note`}}; top level `row_new_tokens` {row: R} (the rows run shorter on request, else {}),
`logit_err_vs_fp32_eager` and `fp32_reference` (how the FP32 reference was built, its bytes and seconds);
the `dsv41` row also has `report` (its `FusionReport.to_dict()` from the cold compile), and every dsv41 row
`fusion_matches` {family: matches}, `kernels_per_step_by_role`, `kernels_per_step_static` and
`kernels_static_minus_profiler` (null on CPU). With `--speculative E` (DSpark, simulated acceptance) the top level
has `speculative` {simulated_acceptance, block_size} (else null) and every row `mean_acceptance` and
`mean_natural_acceptance`.

Where the rest lives (the names this module had before the split, and `run_llama_benchmark`, import from here
too): `bench_protocol` (the measurement rules and
`DEFINITIONS`), `bench_context` (the context sweep), `bench_reports` (the rows' fusion reports and step
breakdowns), `bench_table` (the printed tables), `bench_llama` (`--model`), `bench_cli` (the command line).
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import torch

# The public names of the split modules stay importable from here. Tests replace `make_runner`, `timed_run`,
# `teacher_forced_logits`, `bench_model` and the underscored helpers on this module, where `run_benchmark` looks
# them up.
from .bench_context import context_sweep as _context_sweep
from .bench_context import decode_from_context  # noqa: F401
from .bench_protocol import (DEFINITIONS, alternation_order, decode_bytes_per_step, decode_context,  # noqa: F401
                             fill_rows, identical_rows, launches_by_name, max_rel_logit_err, measure_alternating, roofline,
                             prefill_floor, round_phase_medians, summarize, summarize_runs, tensor_digest)
from .model.prefill import PREFILL_CHUNKS
from .bench_protocol import cudagraph_skips as _cudagraph_skips
from .bench_protocol import empty_row as _empty_row
from .bench_protocol import fail_text as _fail
from .bench_protocol import tensorrt_import_error as _tensorrt_import_error
from .bench_protocol import use_cache_dir as _use_cache_dir
from .bench_llama import run_llama_benchmark  # noqa: F401
from .bench_reports import ORIGINS as _ORIGINS
from .bench_reports import PROFILE_STEPS  # noqa: F401
from .bench_reports import REPORTS as _REPORTS
from .bench_reports import attach_report as _attach_report
from .bench_reports import set_breakdown as _set_breakdown
from .bench_reports import profiled_row as _profiled_row
from .bench_reports import set_prefill_breakdown as _set_prefill_breakdown
from .bench_reports import with_origins as _with_origins
from .bench_rows import (CORE_BACKENDS, DSPARK, DSPARK_ACCEPTANCE, ablation_families, base_backend,  # noqa: F401
                         cache_dir_name, expand_backends, parse_row_new_tokens, row_options, row_speculation)
from .bench_table import print_context_table, print_table  # noqa: F401
from .compile_stats import COMPILE_PHASES as _COMPILE_PHASES  # noqa: F401
from .compile_stats import cache_hits as _cache_hits
from .compile_stats import cache_misses as _cache_misses
from .compile_stats import phase_deltas as _phase_deltas
from .compile_stats import phase_totals as _compile_phase_totals
from .harness import (bench_model, cache_positions, copy_bandwidth_tb_s, make_runner, profile_decode_step,  # noqa: F401
                      teacher_forced_logits, timed_run)

__all__ = ["CORE_BACKENDS", "summarize", "alternation_order", "measure_alternating", "copy_bandwidth_tb_s",
           "roofline", "decode_context", "decode_bytes_per_step", "ablation_families", "expand_backends",
           "summarize_runs", "teacher_forced_logits", "max_rel_logit_err", "profile_decode_step",
           "run_benchmark", "print_table", "main", "DSPARK", "DSPARK_ACCEPTANCE", "base_backend", "row_speculation",
           "tensor_digest", "identical_rows", "bench_model", "cache_positions", "parse_row_new_tokens", "make_runner",
           "timed_run", "console_main", "DEFINITIONS", "decode_from_context", "print_context_table",
           "run_llama_benchmark"]


# ------------------------------------------------------------------------------------------ the run
def run_benchmark(preset: str, backends, prompt_len: int, new_tokens: int, repeats: int = 5,
                  weight_mode: str = "checkpoint", device: str | None = None, options: dict | None = None,
                  dtype: str | None = None, warm_compile: bool = True, speculative: float | None = None,
                  contexts: Sequence[int] | None = None, context_tokens: int = 32,
                  tp: Mapping[str, Any] | None = None, regional: bool = False, shared_cache: bool = False,
                  precompile: int = 0, cache_dir: str | None = None, precompile_only: bool = False,
                  on_update: Callable[[dict], None] | None = None, eager_new_tokens: int | None = None,
                  row_new_tokens: Mapping[str, int] | None = None, compiled_prefill: bool = False) -> dict:
    """Run the protocol of the module docstring and return the result dict (schema there).

    Args:
        preset: model preset (`tiny`, `small`, `h200`); weight_mode `checkpoint` | `bf16`; dtype as `build_model`.
        backends: names or a comma-separated string (`expand_backends`: `all`, `ablations`, `dsv41-no-<family>`).
        prompt_len: prompt tokens (>= 1); new_tokens: tokens per run (>= 2: decode tok/s needs two timestamps).
        repeats: measured runs per backend (>= 1); device: `cpu` / `cuda` (default cuda when available).
        options: dsv41 options for the `dsv41` row and the base of every ablation.
        warm_compile: False skips the warm-cache recompile (step 3): the discarded warm-up run then reuses the
            cold-compiled runner and `compile_warm_s` stays None (saves one compile per backend on a tight
            GPU budget; recorded as `warm_compile: false` in the result).
        speculative: None (plain decode) or E: every timed run (cold, warm-up, measured) is DSpark speculative
            decoding with simulated "match-expected" acceptance of mean length E (BENCHMARK.md "Speculative runs");
            rows then carry `mean_acceptance` (measured, median over runs) and `mean_natural_acceptance` (greedy
            agreement of the drafts), and `tokens_match_eager` is null (simulated rounds emit drafts the target
            did not choose). The eager reference, teacher-forced logits and kernel counts stay plain M = 1 decode.
            With `<row>+dspark` rows in `backends`, only those rows decode speculatively (at E, default
            `DSPARK_ACCEPTANCE`) and the others plainly, in the same run (`row_speculation`).
        eager_new_tokens: R <= new_tokens: the eager reference and the eager rows decode R tokens instead of
            new_tokens (eager `h200` takes ~0.7 s a token on the H200); the other rows' tokens and teacher-forced
            logits are compared with eager's over those R (result `eager_new_tokens`; None: new_tokens).
        row_new_tokens: {row name: R}, 2 <= R <= new_tokens: those rows decode R tokens in every run (precompile
            worker, cold, warm-up, measured), for rows whose step is host-bound (Inductor without CUDA graphs
            decodes ~10 tok/s on `h200`, so 1,024 tokens take ~100 s a run): their tok/s does not depend on the
            count. Their tokens and teacher-forced logits are compared with eager's over the shorter of R and the
            reference. Recorded per row (`new_tokens`, with a note) and as `row_new_tokens`. Not for eager rows
            (ValueError): `eager_new_tokens` shortens them and the reference together.
        shared_cache: every backend compiles into ONE Inductor cache dir, so rows after the first reuse its
            Triton binaries and autotuning (a toggle matrix fits a GPU call); their `compile_s` is then not a cold
            compile (result `shared_cache: true`).
        contexts: optional context lengths for the decode-versus-context sweep (`decode_from_context`: caches
            filled with random rows up to the context, `context_tokens` greedy steps from there, backends
            alternated per context) in `res["decode_vs_context"]`. The caches are then allocated once for the
            longest context, for every run of every backend (a compiled decode step has the cache shapes baked
            in), so the main rows also run on that allocation; recorded as `cache_max_seq_len`.
        regional: compile the embedding, each layer variant and the head as separate regions
            (`dsv41.compiler.regional`) for every compiled backend; recorded as `regional`.
        precompile: N > 0 starts N worker processes at once (`dsv41.precompile`) that compile every compiled row
            into its cache dir; the benchmark process builds its model only after they exit (a model that fits the
            GPU once leaves them no room otherwise); each row's cold compile is then served from that cache
            (`compile_s` is that compile; rows gain `precompiled` and the worker's `precompile_wall_s`, the result
            `precompile`). Workers have exited before anything is timed.
        cache_dir: root of the rows' Inductor cache dirs (`<cache_dir>/<row>` or `<cache_dir>/shared`), kept after
            the run, so a later run (e.g. the next GPU call) with the same arguments is served from it; default a
            temporary dir removed at the end. Recorded as `cache_dir`.
        precompile_only: run the precompile workers into `cache_dir` and return (no eager reference, nothing
            measured): the first of two GPU calls when the workers and the timed rows do not fit one.
        tp: tensor parallelism, inside an initialised process group (`dsv41.launch`): {"moe_mode": "tp" | "ep",
            "pad_to": int | None}; every rank shards the same seeded model with `apply_tp` and runs the same
            protocol in lockstep (collectives); the result gains `tp` (plan, world size, whether every rank's
            eager tokens agree) and only rank 0 prints progress. The roofline stays the whole model's bytes over
            one GPU's copy bandwidth (a TP rank reads about 1/N of them).
        on_update: called with a finalised copy of the result so far (`partial: true`) after the eager reference
            and after each backend's cold compile, warm-up and kernel count, after the measured runs and after the
            context sweep, so a run killed by a time limit still leaves what it measured.
        compiled_prefill: every timed run prefills through its runner in chunks (`generate(compiled_prefill=True)`).
    Raises:
        UsageError (a ValueError): a bad request, before anything is built (`dsv41.bench_plan.check_request`:
            sizes, rows, token counts, contexts, workers, dtype, weight mode, cache positions).
    A backend that fails to compile or run is reported in its row's `note`, never dropped.
    """
    from rich.console import Console
    from rich.progress import Progress, TimeElapsedColumn

    from .accuracy import fp32_reference, logit_err_vs_fp32
    from . import harness
    from .model import generate
    from .model.budget import budget

    from .bench_plan import check_request
    plan = check_request(preset, backends, prompt_len, new_tokens, repeats, weight_mode=weight_mode, dtype=dtype,
                         speculative=speculative, contexts=contexts, context_tokens=context_tokens, tp=tp,
                         precompile=precompile, precompile_only=precompile_only, cache_dir=cache_dir,
                         eager_new_tokens=eager_new_tokens, row_new_tokens=row_new_tokens)
    families, ablation_note, names = plan["families"], plan["ablation_note"], plan["names"]
    spec_of, tokens_of, row_new_tokens, contexts = (plan["spec_of"], plan["tokens_of"], plan["row_new_tokens"],
                                                    plan["contexts"])
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    tp_info, rank = None, 0
    if tp is not None:
        import torch.distributed as dist

        from .model.tp import apply_tp
        model = harness.build_model(preset, device, weight_mode, dtype)
        plan = apply_tp(model, moe_mode=tp.get("moe_mode", "tp"), pad_to=tp.get("pad_to"))
        rank = dist.get_rank()
        tp_info = {"world_size": dist.get_world_size(), "backend": dist.get_backend(), "moe_mode": plan.moe_mode,
                   "pad_to": plan.pad_to, "inter_per_rank": plan.inter, "heads_per_rank": plan.heads}
        model, prompt = bench_model(preset, device, weight_mode, dtype, prompt_len, new_tokens, contexts,
                                    context_tokens, model=model, speculative=any(spec_of.values()))
    elif precompile_only or precompile:
        # Only the workers build models while they run: a preset that fits the GPU once (h200, 87 GB) leaves them no
        # room otherwise (2026-12-01: a worker beside the benchmark's h200 model ran out of memory). With precompile
        # workers the benchmark builds its model after they exit, before the eager reference.
        from .model import ModelConfig
        model, prompt = None, None  # dtype, weight mode and cache positions: checked by check_request above
        cfg = ModelConfig.preset(preset)
    else:
        model, prompt = bench_model(preset, device, weight_mode, dtype, prompt_len, new_tokens, contexts,
                                    context_tokens, speculative=any(spec_of.values()))
    cfg = model.config if model is not None else cfg
    b = budget(cfg, max_seq_len=prompt_len + new_tokens)
    decode_bytes = decode_bytes_per_step(cfg, prompt_len, new_tokens)
    res = {**harness.environment(device), "preset": preset, "weight_mode": weight_mode,
           "dtype": str(model.dtype if model is not None else
                        harness.DTYPES[dtype or ("bf16" if cuda else "fp32")]).replace("torch.", ""),
           "device": device, "prompt_len": prompt_len,
           "new_tokens": new_tokens, "eager_new_tokens": eager_new_tokens or new_tokens,
           "row_new_tokens": row_new_tokens,
           "repeats": repeats, "warm_compile": warm_compile, "regional": regional,
           "shared_cache": shared_cache,
           "speculative": None if not any(spec_of.values()) else {
               "simulated_acceptance": next(e for e in spec_of.values() if e),
               "rows": [n for n in names if spec_of[n]],
                                                            "block_size": cfg.dspark_block_size},
           "params": {"backbone": b.backbone_params, "engram": b.engram_params, "total": b.total_params,
                      "active_decode": b.active_params_decode},
           "kv_bytes_per_token": {"logical": b.kv_bytes_per_token, "allocated": b.kv_bytes_per_token_allocated},
           "decode_context": decode_context(prompt_len, new_tokens), "decode_bytes_per_step": decode_bytes,
           "copy_bandwidth_tb_s": copy_bandwidth_tb_s() if cuda else None,
           "ablations_note": ablation_note, "definitions": dict(DEFINITIONS), "logit_err_vs_fp32_eager": None,
           "fp32_reference": None, "backends": {}}
    res["roofline_tok_s"] = roofline(decode_bytes, res["copy_bandwidth_tb_s"]) if cuda else None
    res.update(prefill_floor(b.active_params_decode, prompt_len, harness.tensor_core_rate() if cuda else None),
               compiled_prefill=compiled_prefill, prefill_chunks=list(PREFILL_CHUNKS) if compiled_prefill else None)
    if tp_info is not None:
        res["tp"] = tp_info
    rows = res["backends"]
    notes: dict = {n: [] for n in names}
    for n in names:
        rows[n] = _empty_row()
        rows[n]["options"] = row_options(n, options)
        rows[n]["new_tokens"] = tokens_of[n]

    ref = ref32 = None
    runnable, cold_wall, warm_wall, runners = [], {}, {}, {}
    outs: dict = {}
    order: list = []

    def finalize(r: dict, notes_: dict) -> None:
        """Fill the rows of result `r` from the measured runs so far and join `notes_` into their notes."""
        r["run_order"] = list(order)
        r["reference_tokens"] = ref.tokens.tolist() if ref is not None else None
        r["cache_max_seq_len"] = getattr(model, "max_seq_len", None)
        fill_rows(r, notes_, outs, spec_of=spec_of, tokens_of=tokens_of,
                  ref_tokens=ref.tokens if ref is not None else None, cold_wall=cold_wall, warm_wall=warm_wall,
                  cuda=cuda)

    console = Console(stderr=True, quiet=rank != 0)
    _ORIGINS.clear()  # rows of an earlier run in this process are gone: their ids may be reused
    _REPORTS.clear()
    cache_root = os.path.abspath(cache_dir) if cache_dir else tempfile.mkdtemp(prefix="dsv41-bench-cache-")
    res["cache_dir"] = cache_dir

    def row_cache(n: str) -> str:
        """Inductor cache dir of row `n`: `<cache_root>/<n as a file name>`, or `<cache_root>/shared`."""
        return os.path.join(cache_root, "shared" if shared_cache else cache_dir_name(n))

    compiled_rows = [n for n in names if base_backend(n) not in ("eager", "torch_tensorrt")]
    precompiler, pre_ok = None, {}
    if precompile_only and not compiled_rows:
        for n in names:
            rows[n]["note"] = "precompile only: nothing to compile"
        return res
    if precompile and compiled_rows:
        from .precompile import Precompiler
        precompiler = Precompiler(
            {"preset": preset, "prompt_len": prompt_len, "new_tokens": new_tokens, "weight_mode": weight_mode,
             "device": device, "options": options, "dtype": dtype, "speculative": speculative,
             "speculative_rows": spec_of,
             "contexts": list(contexts) if contexts else None, "context_tokens": context_tokens,
             "regional": regional, "share_weights": regional, "run_tokens": tokens_of}, compiled_rows, row_cache,
            precompile).start()
        if precompile_only:
            try:
                res["precompile"] = pre = precompiler.wait()
            finally:
                precompiler.close()
            for n in names:
                w = pre["rows"].get(n)
                rows[n].update(precompiled=bool(w and w["rc"] == 0), precompile_wall_s=w and w["wall_s"],
                               note="precompile only, not measured" + (f": {w['note']}" if w and w["note"] else ""))
            return res
    saved_cache_env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if os.environ.get("TRITON_CACHE_DIR"):
        res["cache_note"] = "TRITON_CACHE_DIR is set, so cold compiles may reuse Triton binaries from it"
    try:
        with torch._dynamo.config.patch(cache_size_limit=max(torch._dynamo.config.cache_size_limit, 64)), \
                Progress(*Progress.get_default_columns(), TimeElapsedColumn(), console=console,
                         transient=True) as prog:
            t_start = time.perf_counter()

            def say(msg: str) -> None:  # one line per step, so the log of a non-interactive run shows progress
                """Print one progress line above the bars (plain text, not rich markup), with the seconds since the
                run started, never wrapped (a log keeps it on one line)."""
                prog.console.print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", markup=False, highlight=False,
                                   soft_wrap=True)

            def update() -> None:
                """Hand `on_update` a finalised copy of the result so far, with `partial: true` (a failing
                callback is reported and the run goes on)."""
                if on_update is None:
                    return
                try:
                    snap = copy.deepcopy(res)
                    finalize(snap, copy.deepcopy(notes))
                    on_update({**snap, "partial": True})
                except Exception as e:  # noqa: BLE001 - reported, the run goes on
                    say(f"on_update failed: {_fail(e)}")

            def wait_workers() -> None:
                """Wait for the precompile workers and note the rows whose worker failed (once)."""
                nonlocal precompiler
                if precompiler is None:
                    return
                say(f"waiting for {len(compiled_rows)} precompile worker(s), {precompile} at once")
                res["precompile"] = pre = precompiler.wait()
                for n, w in pre["rows"].items():
                    rows[n]["precompile_wall_s"] = w["wall_s"]
                    if w["rc"] == 0:
                        pre_ok[n] = w["wall_s"]
                    else:
                        notes[n].append(f"precompile failed, compiled cold: {w['note']}"[:600])
                say(f"precompile: {pre['wall_s']:.1f} s for {len(compiled_rows)} row(s)")
                precompiler = None

            if model is None:  # precompile workers: they had the GPU to themselves
                wait_workers()
                model, prompt = bench_model(preset, device, weight_mode, dtype, prompt_len, new_tokens, contexts,
                                            context_tokens, speculative=any(spec_of.values()))
            task = prog.add_task("eager reference (tokens + teacher-forced logits)", total=1)
            say("eager reference ...")
            t_ref = time.perf_counter()
            # The greedy run's own step logits are eager's teacher-forced logits for its tokens: one eager pass,
            # not two (an eager `h200` decode step takes ~0.7 s on the H200).
            ref = generate(model, prompt, eager_new_tokens or new_tokens, return_logits=True)
            ref_logits = ref.logits
            if tp_info is not None:  # replicated head on all-reduced activations: every rank picks the same tokens
                import torch.distributed as dist
                toks = [None] * tp_info["world_size"]
                dist.all_gather_object(toks, ref.tokens.tolist())
                tp_info["ranks_agree"] = all(t == toks[0] for t in toks)
            prog.advance(task)
            say(f"eager reference: {time.perf_counter() - t_ref:.1f} s")
            try:  # before any compile, so the FP32 copy never shares the GPU with a compiled runner
                if tp_info is not None and model.dtype != torch.float32:  # an FP32 run is its own reference
                    raise ValueError("not built under tensor parallelism (the copy would need the same sharding)")
                ref32, res["fp32_reference"] = fp32_reference(model, prompt, ref.tokens, ref_logits)
                res["logit_err_vs_fp32_eager"] = logit_err_vs_fp32(ref_logits, ref32)
                say(f"FP32 reference: {res['fp32_reference']['seconds']:.1f} s; eager's error against it "
                    f"{res['logit_err_vs_fp32_eager']:.3e}")
            except Exception as e:  # the rows keep every other figure
                ref32, res["fp32_reference"] = None, {"source": None, "note": _fail(e)}
                say(f"FP32 reference: {_fail(e)}")
            wait_workers()
            update()

            task = prog.add_task("cold compile + first run", total=len(names))
            for n in names:
                prog.update(task, description=f"cold compile + first run: {n}")
                if n == "torch_tensorrt":
                    err = _tensorrt_import_error()
                    if err is not None:
                        rows[n]["note"] = "not installed"
                        rows[n]["import_error"] = err
                        say(f"{n}: not installed ({err})")
                        prog.advance(task)
                        continue
                if not cuda:
                    notes[n].append("CPU: kernels_per_step (GPU kernels), roofline and peak_mem are CUDA-only; CPU "
                                    "launches per step: kernels_per_step_static (dsv41 rows), `dsv41 report`")
                if base_backend(n) == "eager":
                    notes[n].append("eager does not compile")
                if n in row_new_tokens and tokens_of[n] != new_tokens:
                    notes[n].append(f"runs {tokens_of[n]} new tokens, not {new_tokens} (row_new_tokens)")
                elif tokens_of[n] != new_tokens:
                    notes[n].append(f"eager runs {tokens_of[n]} new tokens, not {new_tokens} (eager_new_tokens)")
                try:
                    if warm_compile:
                        # Without a warm recompile the runners compiled here are the measured ones: a reset
                        # would drop them (Dynamo keeps one cache entry per backend, so none is needed).
                        torch.compiler.reset()
                    _use_cache_dir(row_cache(n))
                    runner = runners[n] = make_runner(model, n, options, regional)
                    say(f"{n}: cold compile + first run ...")
                    skips, phases, hits = _cudagraph_skips(), _compile_phase_totals(), _cache_hits()
                    misses = _cache_misses()
                    cold_wall[n] = timed_run(runner, prompt, tokens_of[n], cuda, spec_of[n],
                                             compiled_prefill)["wall_s"]
                    rows[n]["cudagraph_skips"] = _cudagraph_skips() - skips
                    rows[n]["compile_cache_hits"] = {k: v - hits[k] for k, v in _cache_hits().items()}
                    rows[n]["compile_cache_misses"] = _cache_misses() - misses
                    if n in pre_ok:
                        # the worker's caches served this compile only if Inductor says it hit them
                        rows[n]["precompiled"] = sum(rows[n]["compile_cache_hits"].values()) > 0
                        notes[n].append(
                            f"compiled from the cache a precompile worker filled (its compile + first run: "
                            f"{pre_ok[n]:.1f} s, {precompile} workers at once)" if rows[n]["precompiled"] else
                            "a precompile worker compiled this row, but this compile missed its cache: cold")
                    elif sum(rows[n]["compile_cache_hits"].values()):
                        notes[n].append("compile served from a cache filled before this run (not cold)")
                    rows[n]["compile_phases_s"] = _phase_deltas(phases, _compile_phase_totals())
                    if n.startswith("dsv41"):
                        _attach_report(rows[n], n == "dsv41", cfg.roles)
                    runnable.append(n)
                    ph = rows[n]["compile_phases_s"]
                    say(f"{n}: cold compile + first run {cold_wall[n]:.1f} s"
                        + (f" (Dynamo trace {ph.get('bytecode_tracing', 0):.1f} s, backend compile "
                           f"{ph.get('OutputGraph.call_user_compiler', 0):.1f} s, of it compile_fx_inner "
                           f"{ph.get('compile_fx_inner', 0):.1f} s)" if ph else ""))
                except Exception as e:  # reported in the row, never silently dropped
                    notes[n].append(_fail(e))
                    say(f"{n}: {_fail(e)}")
                update()
                prog.advance(task)

            # One reset, then every backend recompiles from its own warm cache dir: the discarded warm-up run.
            if warm_compile:
                torch.compiler.reset()
            what = "warm compile + warm-up run" if warm_compile else "warm-up run"
            task = prog.add_task(what, total=len(runnable))
            for n in list(runnable):
                prog.update(task, description=f"{what}: {n}")
                if base_backend(n) == "eager":  # compiles nothing: its first run above was its warm-up
                    notes[n].append("no separate warm-up run: eager compiles nothing, its first run warmed it")
                    say(f"{n}: no warm-up run (eager: the first run warmed it)")
                    update()
                    prog.advance(task)
                    continue
                try:
                    if warm_compile:
                        _use_cache_dir(row_cache(n))
                        runners[n] = make_runner(model, n, options, regional)
                        warm_wall[n] = timed_run(runners[n], prompt, tokens_of[n], cuda, spec_of[n],
                                                 compiled_prefill)["wall_s"]
                    else:
                        timed_run(runners[n], prompt, tokens_of[n], cuda, spec_of[n], compiled_prefill)
                    say(f"{n}: {what} done" + (f" {warm_wall[n]:.1f} s" if n in warm_wall else ""))
                except Exception as e:
                    notes[n].append(_fail(e))
                    runnable.remove(n)
                    say(f"{n}: warm compile {_fail(e)}")
                update()
                prog.advance(task)

            task = prog.add_task("kernels per step + teacher-forced logits", total=len(runnable))
            for n in runnable:
                prog.update(task, description=f"kernels per step + teacher-forced logits: {n}")
                if cuda:
                    try:
                        # eager: one step (an eager `h200` step is ~0.7 s and tens of thousands of profiler events)
                        k = profile_decode_step(runners[n], prompt, new_tokens,
                                                1 if base_backend(n) == "eager" else PROFILE_STEPS)
                        _profiled_row(rows[n], k, res, say, n, notes[n])
                    except Exception as e:
                        notes[n].append("kernel count " + _fail(e))
                    if compiled_prefill:  # prefill runs only: an eager h200 prefill profiles slowly
                        _set_prefill_breakdown(rows[n], runners[n], prompt, True, notes[n])
                if rows[n].get("step_breakdown") is None:  # CPU, or the profile failed: static counts only
                    _set_breakdown(rows[n], None, res["copy_bandwidth_tb_s"], say, n, notes[n],
                                   res["decode_bytes_per_step"])
                if spec_of[n]:
                    try:
                        rows[n]["speculative_round_ms"] = round_phase_medians(generate(
                            runners[n], prompt, tokens_of[n], speculative=True, simulate_acceptance=spec_of[n],
                            round_phases=True))
                    except Exception as e:
                        notes[n].append("round phases " + _fail(e))
                try:
                    if base_backend(n) == "eager":
                        # The same module and decode step as the reference: its teacher-forced logits are the
                        # reference's (an eager `h200` step takes ~0.7 s on the H200, so they are not recomputed).
                        tf = ref_logits
                        notes[n].append("teacher-forced logits: the eager reference's own (same module and step)")
                        want = ref_logits
                    else:
                        # Over the row's own length (row_new_tokens): a host-bound row teacher-forced over all of
                        # eager's tokens would cost what its shorter runs saved, and cover steps it never decodes.
                        nt = min(tokens_of[n], ref.tokens.shape[1])
                        tf = teacher_forced_logits(runners[n], prompt, ref.tokens[:, :nt])
                        want = ref_logits[:, :nt - 1]
                        if nt < ref.tokens.shape[1]:
                            notes[n].append(f"teacher-forced over eager's first {nt} tokens (its run length)")
                    rows[n]["max_rel_logit_err"] = max_rel_logit_err(tf, want)
                    if ref32 is not None:
                        rows[n]["logit_err_vs_fp32"] = logit_err_vs_fp32(tf, ref32[:, :tf.shape[1]])
                    rows[n]["teacher_forced_logits_sha256"] = tensor_digest(tf)
                except Exception as e:
                    notes[n].append("teacher forcing " + _fail(e))
                say(f"{n}: kernels/step {rows[n]['kernels_per_step']}, max rel logit err "
                    f"{rows[n]['max_rel_logit_err']}")
                update()
                prog.advance(task)

            task = prog.add_task("measured runs (alternating)", total=len(runnable) * repeats)
            fns = {n: (lambda r=runners[n], e=spec_of[n], t=tokens_of[n]:
                       timed_run(r, prompt, t, cuda, e, compiled_prefill)) for n in runnable}
            outs, errors, order = measure_alternating(fns, repeats, on_run=lambda n: prog.advance(task))
            for n, err in errors.items():
                notes[n].append("measured run failed: " + err)
            say(f"measured {len(order)} runs in the order {' '.join(order)}")
            update()

            if contexts:
                res["decode_vs_context"] = _context_sweep(model, runners, runnable, contexts, context_tokens, cuda,
                                                          res.get("copy_bandwidth_tb_s"), prog, say)
                update()
    finally:
        if precompiler is not None:
            precompiler.close()  # a run stopped before `wait` leaves no worker behind
        if saved_cache_env is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_cache_env
        if not cache_dir:
            shutil.rmtree(cache_root, ignore_errors=True)

    finalize(res, notes)
    return res


def main(argv=None) -> int:
    """CLI of the benchmark (`python -m dsv41.bench`, `dsv41 bench`); see `--help` and `dsv41.bench_cli.main`.

    Returns the exit status. Raises: UsageError (a ValueError) for a bad argument found after parsing; the
    console entry points print it as one line and exit with status 2.
    """
    from .bench_cli import main as _main
    # The module's `run_benchmark` at call time: one a caller (or test) put on this module is the one that runs. A
    # module-level function, so `--tp`'s spawned ranks can unpickle it.
    return _main(argv, run_benchmark=run_benchmark)


def console_main(argv=None) -> int:
    """`main` for a console: a UsageError is one line on stderr (`dsv41 bench: error: ...`) and status 2."""
    from .usage import UsageError, usage_error
    try:
        return main(argv)
    except UsageError as e:
        return usage_error("dsv41 bench", e)


if __name__ == "__main__":
    sys.exit(console_main())
