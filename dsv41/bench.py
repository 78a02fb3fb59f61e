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

Prefill runs on the eager module for every backend (`generate(compiled_prefill=False)`, gpt-fast style: only
the static-shape decode step is compiled), so `prefill_tok_s` measures the same code for every row.

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
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from .accuracy import DEFINITIONS as _ACCURACY_DEFINITIONS
# Public names of this module too (`__all__`); tests replace them on this module, where `run_benchmark` looks them up.
from .bench_rows import (CORE_BACKENDS, DSPARK, DSPARK_ACCEPTANCE, ablation_families, base_backend,  # noqa: F401
                         expand_backends, row_options, row_speculation)
from .harness import (bench_model, cache_positions, copy_bandwidth_tb_s, make_runner, profile_decode_step,  # noqa: F401
                      teacher_forced_logits, timed_run)

__all__ = ["CORE_BACKENDS", "summarize", "alternation_order", "measure_alternating", "copy_bandwidth_tb_s",
           "roofline", "decode_context", "decode_bytes_per_step", "ablation_families", "expand_backends",
           "summarize_runs", "teacher_forced_logits", "max_rel_logit_err", "profile_decode_step",
           "run_benchmark", "print_table", "main", "DSPARK", "DSPARK_ACCEPTANCE", "base_backend", "row_speculation",
           "tensor_digest", "identical_rows", "bench_model", "cache_positions", "parse_row_new_tokens", "make_runner",
           "timed_run"]

_GB = 1e9

DEFINITIONS = {
    "decode_tok_s": "tokens after the first / (time of the last token - time of the first), per run; median, "
                    "min, max over the measured runs (BENCHMARK.md 'Metric')",
    "prefill_tok_s": "prompt tokens / time to first token; prefill runs on the eager module for every backend",
    "kernels_per_step": "GPU kernel activities recorded by torch.profiler during one decode step after warm-up "
                        "(memcpy/memset activities are memcpy_memset_per_step); CUDA only",
    "kernels_per_step_by_role": "dsv41 rows: static launches of one decode step (generated code of the cold "
                                "compile) per decoder-layer role (swa, full, reindex, reuse; other = outside the "
                                "layers), with per-layer min/mean/max; kernels_per_step_static is their total",
    "compile_s": "wall time of the first run after torch.compiler.reset() with an empty inductor cache dir, "
                 "minus the median wall time of the measured runs (with shared_cache: one dir for all backends, "
                 "so rows after the first are not cold; with precompile or a reused cache_dir the row's caches "
                 "were filled before: compile_cache_hits counts the FX-graph / AOT autograd cache hits of it, "
                 "compile_cache_misses the FX-graph lookups that missed and compiled)",
    "compile_warm_s": "the same after another torch.compiler.reset() with the warm cache dir (FX-graph cache hit)",
    "compile_phases_s": "seconds per Dynamo / Inductor compile phase during the cold run (torch._dynamo.utils."
                        "compile_times, nested phases overlap); the cold run's wall time minus "
                        "OutputGraph.call_user_compiler and bytecode_tracing is mostly first-launch work (Triton "
                        "JIT of custom-op kernels, CUDA-graph capture)",
    "roofline": "decode_bytes_per_step (budget().decode_weight_bytes + decode_kv_read_bytes at decode_context) / "
                "device-to-device copy bandwidth (bytes read + written per second) measured in this run",
    "roofline_fraction": "median decode tok/s / roofline_tok_s",
    "peak_mem_gb": "max torch.cuda.max_memory_allocated() over the backend's measured runs (1e9 bytes)",
    "tokens_match_eager": "greedy tokens of every measured run equal eager's, over the shorter of the row's "
                          "new_tokens and the eager reference's",
    "teacher_forced_logits_sha256": "SHA-256 of the row's teacher-forced decode logits (dtype, shape, bytes)",
    "same_tokens_as": "other rows whose measured runs all gave exactly this row's greedy tokens (rows that decoded "
                      "different numbers of tokens never do)",
    "same_logits_as": "other rows whose teacher-forced logits are bit-identical to this row's (equal SHA-256)",
    "matching_prefix_tokens": "fewest leading tokens equal to eager's over the backend's measured runs",
    "max_rel_logit_err": "eager's greedy tokens teacher-forced through the backend's decode steps: "
                         "max |logits - eager logits| / max |eager logits| over the decode steps of the shorter of "
                         "the row's run (row_new_tokens) and the reference (one scale for all the steps; "
                         "logit_err_vs_fp32 scales each step by its own)",
    **_ACCURACY_DEFINITIONS,
    "step_gpu_busy_us": "sum of the GPU activity durations of the profiled decode step (torch.profiler); CUDA only",
    "step_span_us": "first GPU activity start to last end of the profiled step; busy > span means activities "
                    "overlapped (PDL, side streams), busy < span means gaps between them",
    "kernel_time_top": "the profiled step's 20 costliest kernel names: launches and summed microseconds; for "
                       "Inductor's own kernels of dsv41 rows also `origin`: the user source lines and ATen ops of "
                       "the graph nodes the kernel computes (from the compile's kernel provenance)",
    "step_breakdown": "where the step goes (issue 37; dsv41/compiler/breakdown.py): per op class (a dsv41 fused op "
                      "with its variants, a dsv41 kernel several classes launch, inductor, blas, aten, copies, "
                      "other) `launches` per step, `time_us` (summed GPU kernel time per step, mean over the "
                      "profiled decode steps, PROFILE_STEPS = 3, eager rows 1; null without a GPU profile), "
                      "`bytes` (bytes_after of the fusion report's sites of the class's ops: weights + "
                      "activations read and written per step) and `floor_us` = bytes / copy_bandwidth_tb_s "
                      "(null without bytes or bandwidth); "
                      "`total` sums them (floor and bytes over the classes that have them); `step_us` = 1e6 / "
                      "median decode tok/s; `roofline_step_us` = decode_bytes_per_step / copy bandwidth (the "
                      "budget's floor of the whole step); span_us, busy_us (union of the kernel intervals), "
                      "overlap_us and gap_per_boundary_us of the profiled steps (medians); `source` says where "
                      "each figure came from (on CPU: static launches of the compiled code, no time)",
    "gap_per_boundary_us": "(span - busy) / (launches - 1) of a profiled decode step: span from the first GPU "
                           "activity's start to the last one's end, busy the time at least one ran (overlap from "
                           "PDL or side streams counted once), launches every kernel, memcpy and memset; median "
                           "over the profiled steps; null on CPU",
    "kernel_launches_by_name": "every kernel name of the profiled step with its launches (most first): what the "
                               "profiler counted, to set against the static per-layer count of the report",
    "speculative_round_ms": "(+dspark rows) median milliseconds of each phase of a verify round over the rounds "
                            "of one extra, untimed run (journal save, verify forward, acceptance + rollback, the "
                            "host sync on the accepted tokens, draft; CUDA events on GPU, so idle gaps count), "
                            "`round` their sum, `rounds` how many",
    "cudagraph_skips": "graphs Inductor compiled for this backend without the CUDA graph it was asked for "
                       "(Inductor's cudagraph_skips counter around the cold compile)",
    "reference_tokens": "(top level) eager's greedy tokens [B][new_tokens], the reference of tokens_match_eager",
    "tp": "(top level, --tp runs) world size, process-group backend, MoE mode, padding, per-rank sizes, and "
          "ranks_agree: every rank's eager reference tokens are equal",
    "decode_vs_context": "(top level) decode tok/s per backend at each --contexts length, caches filled with random "
                         "valid rows (dsv41.model.synthetic), with the roofline at that context",
}


# ------------------------------------------------------------------------------------------ statistics
def summarize(values) -> dict:
    """{median, min, max} of a non-empty sequence of floats (median of an even count: mean of the middle two).

    Raises: ValueError when empty.
    """
    values = [float(v) for v in values]
    if not values:
        raise ValueError("summarize() needs at least one value")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def alternation_order(backends: Sequence[str], repeats: int) -> list:
    """Run order A B C A B C ... (`repeats` rounds), as BENCHMARK.md asks, so drift hits every backend alike.

    Raises: ValueError for repeats < 0.
    """
    if repeats < 0:
        raise ValueError(f"repeats must be >= 0, got {repeats}")
    return [b for _ in range(repeats) for b in backends]


def measure_alternating(fns: Mapping[str, Callable[[], Any]], repeats: int,
                        on_run: Callable[[str], None] | None = None) -> tuple[dict, dict, list]:
    """Call every `fns[name]()` `repeats` times in `alternation_order(list(fns), repeats)`.

    A backend whose call raises is reported once and skipped for the rest of the rounds (the others go on).
    `on_run(name)` is called after every attempted run (progress bars).
    Returns: (results {name: [return values in order]}, errors {name: "Type: message"}, the order actually run).
    """
    results: dict = {n: [] for n in fns}
    errors: dict = {}
    ran = []
    for name in alternation_order(list(fns), repeats):
        if name in errors:
            continue
        ran.append(name)
        try:
            results[name].append(fns[name]())
        except Exception as e:  # a backend failing mid-measurement is reported, the others keep running
            errors[name] = f"{type(e).__name__}: {e}"[:500]
        if on_run is not None:
            on_run(name)
    return results, errors, ran


# ------------------------------------------------------------------------------------------ roofline
def roofline(decode_bytes: float, bandwidth_tb_s: float) -> float:
    """Tokens/s bound of a decode step that must read `decode_bytes` bytes at `bandwidth_tb_s` TB/s (1e12 B/s).

    Raises: ValueError for a non-positive byte count or bandwidth.
    """
    if not decode_bytes > 0 or not bandwidth_tb_s > 0:
        raise ValueError(f"roofline needs positive bytes and bandwidth, got {decode_bytes}, {bandwidth_tb_s}")
    return bandwidth_tb_s * 1e12 / decode_bytes


def decode_context(prompt_len: int, new_tokens: int) -> int:
    """Mean context of the decode steps, tokens: prompt_len + new_tokens // 2 (the roofline's KV read)."""
    return prompt_len + new_tokens // 2


def decode_bytes_per_step(config, prompt_len: int, new_tokens: int) -> int:
    """Bytes one decode step must read: active weights at their stored dtype + KV read at `decode_context`.

    `config`: a ModelConfig or preset name. Source: `dsv41.model.budget` (MODEL.md §3, §2.8).
    """
    from .model.budget import budget, decode_kv_read_bytes
    b = budget(config, max_seq_len=prompt_len + new_tokens)
    return b.decode_weight_bytes + decode_kv_read_bytes(config, decode_context(prompt_len, new_tokens))


def round_phase_medians(out) -> dict:
    """{phase: median ms over the rounds, "round": median of the rounds' sums, "rounds": count} of a
    `generate(..., speculative=True, round_phases=True)` result (`speculative.ROUND_PHASES`).
    Raises: ValueError for a result without round phases."""
    from .model.speculative import ROUND_PHASES
    ph = out.round_phases_ms
    if not ph:
        raise ValueError("no round phases: run generate(..., speculative=True, round_phases=True)")
    med = {k: statistics.median(r[k] for r in ph) for k in ROUND_PHASES}
    return {**med, "round": statistics.median(sum(r.values()) for r in ph), "rounds": len(ph)}


def launches_by_name(names: Mapping[str, int]) -> dict:
    """{kernel name: launches} of a profiled step, most launched first, names kept whole.

    Inductor names kernels by the ops they fuse, so two kernels often share a long prefix; a truncated key merged
    them and dropped counts (2026-12-01: 1,739 of 1,820 `h200` launches were left, at 120 characters).
    """
    return dict(sorted(names.items(), key=lambda kv: (-kv[1], kv[0])))


def _tensorrt_import_error() -> str | None:
    """None when `import torch_tensorrt` works, else why it failed."""
    try:
        import torch_tensorrt  # noqa: F401  (importing registers the "torch_tensorrt" Dynamo backend)
    except Exception as e:  # ImportError, or a broken install raising OSError / RuntimeError at import
        return f"{type(e).__name__}: {e}"[:300]
    return None


def _use_cache_dir(path: str) -> None:
    """Point Inductor at cache dir `path` and drop its in-memory caches, so the next compile sees only `path`."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        from torch._inductor.utils import clear_caches
    except ImportError:  # older layouts: in-memory caches are keyed by content, so a stale hit is still valid
        return
    clear_caches()


# ------------------------------------------------------------------------------------------ measurements
def max_rel_logit_err(logits: torch.Tensor, ref: torch.Tensor) -> float:
    """max |logits - ref| / max |ref| (float64). Raises ValueError for different shapes or an all-zero ref."""
    if logits.shape != ref.shape:
        raise ValueError(f"logit shapes differ: {tuple(logits.shape)} vs reference {tuple(ref.shape)}")
    scale = ref.double().abs().max().item()
    if scale == 0:
        raise ValueError("reference logits are all zero: relative error undefined")
    return (logits.double() - ref.double()).abs().max().item() / scale


def decode_from_context(runner, model, context: int, n_tokens: int, cuda: bool, seed: int = 0) -> dict:
    """Decode `n_tokens` greedy steps from position `context` after `fill_synthetic_context(model, context)`.

    The caches hold random valid rows for positions [0, context) (see `dsv41.model.synthetic`), so no prefill
    runs; the first step starts from the benchmark prompt's first token id. Returns {"decode_tok_s": steps after
    the first / their seconds (CUDA events on GPU), "tokens": int64 [B, n_tokens]}.
    Raises: ValueError for n_tokens < 2 or a context the cache cannot hold (`fill_synthetic_context`).
    """
    from .model import benchmark_prompt
    from .model.results import Clock
    from .model.synthetic import fill_synthetic_context

    if n_tokens < 2:
        raise ValueError(f"decode_from_context needs n_tokens >= 2, got {n_tokens}")
    base = getattr(model, "_orig_mod", model)
    if context + n_tokens > base.max_seq_len:
        raise ValueError(f"context {context} + {n_tokens} tokens exceeds the cache's max_seq_len={base.max_seq_len}")
    fill_synthetic_context(base, context, seed)
    dev = base.embed.weight.device
    b = base.batch_size
    tok = benchmark_prompt(base.config, 1, batch_size=b, device=dev)[:, 0]
    pos = torch.full((b, 1), context, dtype=torch.int64, device=dev)
    out = torch.empty(b, n_tokens, dtype=torch.int64, device=dev)
    clock = Clock(dev)
    with torch.no_grad():
        for i in range(n_tokens):
            logits = runner(tok[:, None], pos)
            tok = logits[:, -1].argmax(-1)
            out[:, i] = tok
            pos += 1
            clock.mark()
    sec = clock.seconds()
    return {"decode_tok_s": (n_tokens - 1) / sec[-1], "tokens": out.cpu()}


def _prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Leading positions where every sequence of `a` equals `b` ([B, N] each)."""
    eq = (a == b).all(0)
    bad = torch.nonzero(~eq)
    return int(bad[0, 0]) if bad.numel() else int(eq.numel())


def summarize_runs(outs: Sequence, ref_tokens: torch.Tensor | None, roofline_tok_s: float | None,
                   expected_tokens: int | None = None) -> dict:
    """Row figures from a backend's measured `GenerateResult`s.

    Returns {decode_tok_s, prefill_tok_s ({median, min, max} each), tokens_match_eager, matching_prefix_tokens,
    roofline_fraction}; the last three are None without `ref_tokens` / `roofline_tok_s`. Tokens are compared over
    the shorter of each run and the reference; `tokens_match_eager` is False for a run with no token to compare
    or, with `expected_tokens`, a run of another length than the row was asked to decode.
    Raises: ValueError for no runs.
    """
    if not outs:
        raise ValueError("summarize_runs needs at least one run")
    dec = summarize(o.decode_tok_s for o in outs)
    row = {"decode_tok_s": dec, "prefill_tok_s": summarize(o.prefill_tok_s for o in outs),
           "tokens_match_eager": None, "matching_prefix_tokens": None,
           "roofline_fraction": dec["median"] / roofline_tok_s if roofline_tok_s else None}
    if ref_tokens is not None:
        # Over the shorter of the two: `eager_new_tokens` may stop the reference early, `row_new_tokens` a row.
        def matches(o) -> bool:
            """Run `o` (tokens int64 [B, N]) equals the reference over min(N, reference length) > 0 tokens, and N is
            `expected_tokens` when that is given."""
            r = min(o.tokens.shape[1], ref_tokens.shape[1])
            return (r > 0 and (expected_tokens is None or o.tokens.shape[1] == expected_tokens)
                    and torch.equal(o.tokens[:, :r], ref_tokens[:, :r]))
        row["tokens_match_eager"] = all(matches(o) for o in outs)
        row["matching_prefix_tokens"] = min(
            _prefix(o.tokens[:, :ref_tokens.shape[1]], ref_tokens[:, :o.tokens.shape[1]]) for o in outs)
    return row


def _cudagraph_skips() -> int:
    """Inductor's count of graphs it compiled without the CUDA graph it was asked for (all compiles so far)."""
    from torch._dynamo.utils import counters
    return int(counters["inductor"].get("cudagraph_skips", 0))


# Compile phases and cache counters live in compile_stats (dsv41 run records them too); the old names stay, since
# tests and callers patch them here.
from .compile_stats import COMPILE_PHASES as _COMPILE_PHASES  # noqa: E402
from .compile_stats import cache_hits as _cache_hits  # noqa: E402
from .compile_stats import cache_misses as _cache_misses  # noqa: E402
from .compile_stats import phase_deltas as _phase_deltas  # noqa: E402
from .compile_stats import phase_totals as _compile_phase_totals  # noqa: E402


def _empty_row() -> dict:
    return {"decode_tok_s": None, "prefill_tok_s": None, "kernels_per_step": None, "memcpy_memset_per_step": None,
            "roofline_fraction": None, "compile_s": None, "compile_warm_s": None, "compile_phases_s": None,
            "peak_mem_gb": None, "tokens_match_eager": None, "matching_prefix_tokens": None, "max_rel_logit_err": None,
            "logit_err_vs_fp32": None, "logit_err_vs_fp32_over_eager": None, "teacher_forced_logits_sha256": None,
            "same_tokens_as": None, "same_logits_as": None, "step_breakdown": None, "gap_per_boundary_us": None,
            "options": None, "new_tokens": None, "note": None}


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 (hex) of a tensor's dtype, shape and bytes: equal digests mean bit-identical tensors."""
    import hashlib
    c = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{c.dtype}{tuple(c.shape)}".encode())
    h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.hexdigest()


def identical_rows(tokens: Mapping[str, Sequence[torch.Tensor]], digests: Mapping[str, str | None]) -> dict:
    """Which rows computed exactly what another row computed.

    Args: tokens: row -> the greedy tokens int64 [B, N] of each of its measured runs (empty: not measured);
        digests: row -> `tensor_digest` of its teacher-forced logits (None: not computed).
    Returns: row -> {"same_tokens_as": the other rows whose every run's tokens equal every run of this one (None
    when this row has no runs), "same_logits_as": the other rows with bit-identical teacher-forced logits (None
    without a digest)}. E.g. the CUDA-graph replay check of a toggle matrix: `dsv41` against
    `dsv41[cuda_graphs=false]` (same kernels, launched without the graph).
    """
    def runs_equal(a, b):
        """Whether every run of `a` gave exactly the tokens of every run of `b` (lists of int64 [B, N])."""
        return all(torch.equal(x, y) for x in a for y in b)

    out = {}
    for n in tokens:
        mine = tokens[n]
        out[n] = {"same_tokens_as": None if not mine else
                  [m for m in tokens
                   if m != n and tokens[m] and runs_equal(mine, tokens[m]) and runs_equal(mine, mine)],
                  "same_logits_as": None if digests.get(n) is None else
                  [m for m in digests if m != n and digests.get(m) == digests[n]]}
    return out


def _fail(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {e}"[:500]


# ------------------------------------------------------------------------------------------ the run
def run_benchmark(preset: str, backends, prompt_len: int, new_tokens: int, repeats: int = 5,
                  weight_mode: str = "checkpoint", device: str | None = None, options: dict | None = None,
                  dtype: str | None = None, warm_compile: bool = True, speculative: float | None = None,
                  contexts: Sequence[int] | None = None, context_tokens: int = 32,
                  tp: Mapping[str, Any] | None = None, regional: bool = False, shared_cache: bool = False,
                  precompile: int = 0, cache_dir: str | None = None, precompile_only: bool = False,
                  on_update: Callable[[dict], None] | None = None, eager_new_tokens: int | None = None,
                  row_new_tokens: Mapping[str, int] | None = None) -> dict:
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
    Raises:
        UsageError (a ValueError): a bad request, before anything is built (`dsv41.bench_plan.check_request`:
            sizes, rows, token counts, contexts, workers, dtype, weight mode, cache positions).
    A backend that fails to compile or run is reported in its row's `note`, never dropped.
    """
    from rich.console import Console
    from rich.progress import Progress, TimeElapsedColumn

    from .accuracy import fp32_reference, logit_err_vs_fp32, ratio_to_eager
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
        for n in names:
            row, runs = r["backends"][n], outs.get(n) or []
            if runs:
                row.update(summarize_runs([x["out"] for x in runs], None if spec_of[n] else ref.tokens,
                                          r["roofline_tok_s"], tokens_of[n]))
                if spec_of[n]:
                    row["mean_acceptance"] = statistics.median(x["out"].mean_acceptance for x in runs)
                    row["mean_natural_acceptance"] = statistics.median(x["out"].mean_natural_acceptance for x in runs)
                    notes_[n].append(f"DSpark, simulated acceptance {spec_of[n]}: measured mean "
                                     f"{row['mean_acceptance']:.3f} tokens/round; tokens not compared with eager")
                walls = statistics.median(x["wall_s"] for x in runs)
                if base_backend(n) != "eager" and n in cold_wall:
                    row["compile_s"] = max(0.0, cold_wall[n] - walls)
                if base_backend(n) != "eager" and n in warm_wall:
                    row["compile_warm_s"] = max(0.0, warm_wall[n] - walls)
                row["peak_mem_gb"] = max(x["peak_gb"] for x in runs) if cuda else None
                if not spec_of[n]:  # a speculative row's tok/s is tokens per round time, not a plain step
                    from .compiler.breakdown import set_step_time
                    set_step_time(row.get("step_breakdown"), row["decode_tok_s"]["median"])
            elif row["note"] is None and not notes_[n]:
                notes_[n].append("not measured")
        same = identical_rows({n: [x["out"].tokens for x in outs.get(n) or []] for n in names},
                              {n: r["backends"][n].get("teacher_forced_logits_sha256") for n in names})
        for n in names:
            row = r["backends"][n]
            row.update(same[n])
            row["logit_err_vs_fp32_over_eager"] = ratio_to_eager(row["logit_err_vs_fp32"],
                                                                 r["logit_err_vs_fp32_eager"])
            if notes_[n]:
                row["note"] = "; ".join(([row["note"]] if row["note"] else []) + notes_[n])

    console = Console(stderr=True, quiet=rank != 0)
    _ORIGINS.clear()  # rows of an earlier run in this process are gone: their ids may be reused
    _REPORTS.clear()
    cache_root = os.path.abspath(cache_dir) if cache_dir else tempfile.mkdtemp(prefix="dsv41-bench-cache-")
    res["cache_dir"] = cache_dir

    def row_cache(n: str) -> str:
        """Inductor cache dir of row `n`: `<cache_root>/<n>`, or `<cache_root>/shared` with shared_cache."""
        return os.path.join(cache_root, "shared" if shared_cache else n)

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
                    cold_wall[n] = timed_run(runner, prompt, tokens_of[n], cuda, spec_of[n])["wall_s"]
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
                        warm_wall[n] = timed_run(runners[n], prompt, tokens_of[n], cuda, spec_of[n])["wall_s"]
                    else:
                        timed_run(runners[n], prompt, tokens_of[n], cuda, spec_of[n])
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
                        _set_breakdown(rows[n], k["step_events"], res["copy_bandwidth_tb_s"], say, n, notes[n],
                                       res["decode_bytes_per_step"])
                        rows[n]["kernels_per_step"] = k["kernels"]
                        rows[n]["memcpy_memset_per_step"] = k["memcpy_memset"]
                        rows[n]["step_gpu_busy_us"] = k["gpu_busy_us"]
                        rows[n]["step_span_us"] = k["span_us"]
                        rows[n]["kernel_time_top"] = _with_origins(k["top_us"], _ORIGINS.get(id(rows[n]), {}))
                        rows[n]["kernel_launches_by_name"] = launches_by_name(k["names"])
                        say(f"{n}: one step: GPU busy {k['gpu_busy_us']:.0f} us over a {k['span_us'] or 0:.0f} us "
                            "span; top: " + ", ".join(f"{t['name'][:40]} x{t['count']} {t['total_us']:.0f} us"
                                                      + (f" [{t['origin'][0][:70]}]" if t.get("origin") else "")
                                                      for t in rows[n]["kernel_time_top"][:8]))
                        if rows[n].get("kernels_per_step_static") is not None:
                            rows[n]["kernels_static_minus_profiler"] = rows[n]["kernels_per_step_static"] - k["kernels"]
                    except Exception as e:
                        notes[n].append("kernel count " + _fail(e))
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
            fns = {n: (lambda r=runners[n], e=spec_of[n], t=tokens_of[n]: timed_run(r, prompt, t, cuda, e))
                   for n in runnable}
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


def _context_sweep(model, runners, names, contexts, n_tokens, cuda, copy_tb_s, prog, say) -> dict:
    """`decode_vs_context` of the result: per context, each backend in turn (order rotated per context)."""
    from .model.budget import budget, decode_kv_read_bytes

    cfg = model.config
    w = budget(cfg, max_seq_len=model.max_seq_len).decode_weight_bytes
    out = {"contexts": list(contexts), "tokens_per_point": n_tokens, "cache_max_seq_len": model.max_seq_len,
           "note": "caches filled with random valid rows up to the context (dsv41.model.synthetic), no prefill; "
                   "decode tok/s over the steps after the first",
           "decode_bytes_per_step": {}, "roofline_tok_s": {}, "backends": {n: {} for n in names}, "errors": {}}
    task = prog.add_task("decode vs context", total=len(contexts) * len(names))
    for i, ctx in enumerate(contexts):
        nbytes = w + decode_kv_read_bytes(cfg, ctx + 1)  # the step at position ctx sees ctx + 1 tokens
        out["decode_bytes_per_step"][str(ctx)] = nbytes
        out["roofline_tok_s"][str(ctx)] = roofline(nbytes, copy_tb_s) if copy_tb_s else None
        order = names[i % len(names):] + names[:i % len(names)] if names else []
        for n in order:
            try:
                r = decode_from_context(runners[n], model, ctx, n_tokens, cuda)
                out["backends"][n][str(ctx)] = r["decode_tok_s"]
                say(f"{n}: context {ctx}: {r['decode_tok_s']:.2f} tok/s")
            except Exception as e:
                out["backends"][n][str(ctx)] = None
                out["errors"][f"{n}@{ctx}"] = _fail(e)
                say(f"{n}: context {ctx}: {_fail(e)}")
            prog.advance(task)
    return out


#: id(result row) -> {Inductor kernel name: origins} of the row's cold compile (`FusionReport.kernel_origins`).
_ORIGINS: dict = {}


#: id(result row) -> the FusionReport of the row's cold compile (launch detail and bytes for `step_breakdown`).
_REPORTS: dict = {}
#: Decode steps `profile_decode_step` profiles per compiled row (eager rows: one): the breakdown's times are their
#: mean.
PROFILE_STEPS = 3


def _set_breakdown(row: dict, step_events, copy_tb_s, say, name: str, notes: list,
                   decode_bytes: float | None = None) -> None:
    """Put the `step_breakdown` table (`compiler/breakdown.py`) and `gap_per_boundary_us` into a row, from the
    profiled steps' kernels (None: static counts only) and the row's fusion report; the dsv41 row's report (JSON
    and object) gets the table too, so the fusion report shows it. A failure becomes a note in `notes`, never a
    number."""
    from .compiler.breakdown import step_breakdown
    rep = _REPORTS.get(id(row))
    try:
        bd = step_breakdown(step_events, rep, copy_tb_s)
    except Exception as e:  # diagnostic: the row keeps every other figure
        notes.append("step breakdown " + _fail(e))
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


def _with_origins(top: list, origins: dict) -> list:
    """`kernel_time_top` rows with `origin` (the kernel's source lines and ATen ops) where the compile knew it."""
    return [dict(t, origin=origins.get(t["name"])) if origins.get(t["name"]) else t for t in top]


def _attach_report(row: dict, full: bool, roles=None) -> None:
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
    _ORIGINS[id(row)] = rep.kernel_origins()
    _REPORTS[id(row)] = rep
    row["fusion_matches"] = {f: v.get("matches") for f, v in d.get("families", {}).items()}
    row["kernels_per_step_by_role"] = d.get("kernels_by_role")
    row["kernels_per_step_static"] = (d.get("kernels_by_layer") or {}).get("total")
    row.setdefault("kernels_static_minus_profiler", None)
    if full:
        row["report"] = d


# ------------------------------------------------------------------------------------------ output
def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(res: dict, console=None) -> None:
    """Print the roofline line and then the result table (the table comes last, so a log's tail shows it)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .accuracy import fp32_err_text
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file: rich would wrap at 80 columns
            console = Console(width=220)
    if res.get("roofline_tok_s"):
        console.print(f"roofline: {res['decode_bytes_per_step'] / 1e9:.4f} GB/step at "
                      f"{res['copy_bandwidth_tb_s']:.2f} TB/s copy bandwidth = {res['roofline_tok_s']:.1f} tok/s "
                      f"(context {res['decode_context']})")
    t = Table(title_justify="left",
              title=f"decode benchmark: {res['preset']} ({res['weight_mode']}), prompt {res['prompt_len']}, "
                    f"{res['new_tokens']} new tokens, {res['repeats']} runs, {res.get('gpu') or 'cpu'}")
    for col in ("backend", "decode tok/s med [min, max]", "prefill tok/s", "kernels/step", "roofline",
                "compile s cold / warm", "peak GB", "= eager", "max rel logit err", "logit err vs fp32", "note"):
        t.add_column(escape(col), overflow="fold", no_wrap=col != "note")
    for name, e in res["backends"].items():
        d = e.get("decode_tok_s")
        match = e.get("tokens_match_eager")
        # Names and notes are text, not rich markup (an error message may hold "[...]").
        t.add_row(escape(name), f"{d['median']:.2f} [{d['min']:.2f}, {d['max']:.2f}]" if d else "-",
                  _fmt((e.get("prefill_tok_s") or {}).get("median"), ".0f"),
                  # On CPU no GPU kernel is profiled; a dsv41 row still knows its static launches per step.
                  _fmt(e.get("kernels_per_step"), "d") if e.get("kernels_per_step") is not None
                  or e.get("kernels_per_step_static") is None else f"{e['kernels_per_step_static']} static",
                  _fmt(e.get("roofline_fraction"), ".3f"),
                  f"{_fmt(e.get('compile_s'), '.1f')} / {_fmt(e.get('compile_warm_s'), '.1f')}"
                  + (f" (worker {e['precompile_wall_s']:.0f})" if e.get("precompile_wall_s") else ""),
                  _fmt(e.get("peak_mem_gb"), ".2f"), "-" if match is None else ("yes" if match else "NO"),
                  _fmt(e.get("max_rel_logit_err"), ".2e"), fp32_err_text(e), escape(e.get("note") or ""))
    console.print(t)


def main(argv=None) -> int:
    """CLI of the benchmark (`python -m dsv41.bench`, `dsv41 bench`); see `--help` and `dsv41.bench_cli.main`.

    Returns the exit status. Raises: UsageError (a ValueError) for a bad argument found after parsing; the
    console entry points print it as one line and exit with status 2.
    """
    from .bench_cli import main as _main
    return _main(argv)


def parse_row_new_tokens(items: Sequence[str]) -> dict:
    """`--row-new-tokens ROW=R` values -> {row: R}. Raises ValueError for an item without `=`, a non-integer R or
    a row given twice (the range of R is checked by `run_benchmark`)."""
    out: dict = {}
    for item in items:
        name, sep, val = item.rpartition("=")  # a row name may hold "=" itself: dsv41[pdl=false]=3
        name, val = name.strip(), val.strip()
        if not sep or not name or not re.fullmatch(r"[0-9]+", val):
            raise ValueError(f"argument --row-new-tokens: expected ROW=R with R a number of tokens, got {item!r}")
        if name in out:
            raise ValueError(f"argument --row-new-tokens: row {name!r} given twice")
        out[name] = int(val)
    return out


def print_context_table(res: dict, console) -> None:
    """The decode-versus-context table (tok/s per backend per context, and the roofline), if the run had one."""
    from rich.markup import escape
    from rich.table import Table

    dvc = res.get("decode_vs_context")
    if not dvc:
        return
    t = Table(title_justify="left", title=f"decode tok/s vs context ({dvc['tokens_per_point']} steps per point, "
                                          f"synthetic caches of {dvc['cache_max_seq_len']} positions)")
    t.add_column("backend")
    for c in dvc["contexts"]:
        t.add_column(str(c), justify="right")
    for n, per in dvc["backends"].items():
        t.add_row(escape(n), *(_fmt(per.get(str(c)), ".2f") for c in dvc["contexts"]))
    t.add_row("roofline", *(_fmt(dvc["roofline_tok_s"].get(str(c)), ".0f") for c in dvc["contexts"]))
    console.print(t)


if __name__ == "__main__":
    from .bench_cli import console_main
    sys.exit(console_main())
