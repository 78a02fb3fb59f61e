"""The measurement protocol of `dsv41 bench` (BENCHMARK.md "Metric", "The roofline", "Accuracy"): statistics over
runs, the alternated run order, the roofline, per-row summaries and comparisons, and the JSON's `definitions`.

Shared by the V4.1 run (`dsv41.bench.run_benchmark`) and the Llama run (`dsv41.bench_llama`); imports neither.
Every public name is also importable from `dsv41.bench`.
"""

from __future__ import annotations

import os
import statistics
from typing import Any, Callable, Mapping, Sequence

import torch

from .accuracy import DEFINITIONS as _ACCURACY_DEFINITIONS
from .bench_rows import base_backend

__all__ = ["DEFINITIONS", "summarize", "alternation_order", "measure_alternating", "roofline", "decode_context",
           "decode_bytes_per_step", "round_phase_medians", "launches_by_name", "tensorrt_import_error",
           "use_cache_dir", "max_rel_logit_err", "summarize_runs", "cudagraph_skips", "empty_row", "tensor_digest",
           "identical_rows", "fail_text", "fill_rows", "prefill_floor"]

DEFINITIONS = {
    "decode_tok_s": "tokens after the first / (time of the last token - time of the first), per run; median, "
                    "min, max over the measured runs (BENCHMARK.md 'Metric')",
    "prefill_tok_s": "prompt tokens / time to first token; prefill runs on the eager module for every backend, "
                     "unless `compiled_prefill` (then through the row's compiled model in chunks of "
                     "`prefill_chunks` tokens, dsv41/model/prefill.py)",
    "prefill_breakdown": "where one prefill goes (CUDA, with compiled_prefill; issue [prefill]): the GPU kernels "
                         "of generate(runner, prompt, 1) (cache reset, prefill, first argmax) per op class as "
                         "step_breakdown tables a decode step, without byte floors; null on CPU and without "
                         "compiled_prefill",
    "ttft_s": "time to first token (the prefill and the first token's argmax), seconds; median over the measured "
              "runs",
    "prefill_floor_tok_s": "prompt tokens / (prefill_flops / the dense tensor-core rate measured in the same run, "
                           "`tensor_core_rate`: an FP8 e4m3 8192^3 torch._scaled_mm where the GPU runs it, else bf16 "
                           "torch.mm); prefill_flops = 2 x active parameters per token x prompt tokens (the "
                           "projections and experts; attention's own FLOPs left out); null on CPU",
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


def prefill_floor(active_params: int, prompt_len: int, rate: dict | None) -> dict:
    """Result keys of the prefill's FLOP floor (`DEFINITIONS["prefill_floor_tok_s"]`): {"prefill_flops",
    "tensor_core_rate" (`harness.tensor_core_rate`'s dict, or None on CPU), "prefill_floor_tok_s" (None without a
    rate)}. Raises: ValueError for non-positive parameters or prompt length."""
    if active_params < 1 or prompt_len < 1:
        raise ValueError(f"prefill_floor needs positive parameters and prompt length, got {active_params}, "
                         f"{prompt_len}")
    flops = 2 * active_params * prompt_len
    floor = prompt_len / (flops / (rate["tflops"] * 1e12)) if rate else None
    return {"prefill_flops": flops, "tensor_core_rate": rate, "prefill_floor_tok_s": floor}


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


def tensorrt_import_error() -> str | None:
    """None when `import torch_tensorrt` works, else why it failed."""
    try:
        import torch_tensorrt  # noqa: F401  (importing registers the "torch_tensorrt" Dynamo backend)
    except Exception as e:  # ImportError, or a broken install raising OSError / RuntimeError at import
        return f"{type(e).__name__}: {e}"[:300]
    return None


def use_cache_dir(path: str) -> None:
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
           "ttft_s": summarize(o.prefill_s for o in outs)["median"],
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


def cudagraph_skips() -> int:
    """Inductor's count of graphs it compiled without the CUDA graph it was asked for (all compiles so far)."""
    from torch._dynamo.utils import counters
    return int(counters["inductor"].get("cudagraph_skips", 0))


def empty_row() -> dict:
    """A result row with every figure of BENCHMARK.md "Recorded with every result" null (filled as the run goes)."""
    return {"decode_tok_s": None, "prefill_tok_s": None, "ttft_s": None, "kernels_per_step": None,
            "memcpy_memset_per_step": None,
            "roofline_fraction": None, "compile_s": None, "compile_warm_s": None, "compile_phases_s": None,
            "peak_mem_gb": None, "tokens_match_eager": None, "matching_prefix_tokens": None, "max_rel_logit_err": None,
            "logit_err_vs_fp32": None, "logit_err_vs_fp32_over_eager": None, "teacher_forced_logits_sha256": None,
            "same_tokens_as": None, "same_logits_as": None, "step_breakdown": None, "gap_per_boundary_us": None,
            "prefill_breakdown": None,
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


def fail_text(e: Exception) -> str:
    """The text a row's note gives a failure: `failed: Type: message`, at most 500 characters."""
    return f"failed: {type(e).__name__}: {e}"[:500]


def fill_rows(r: dict, notes: Mapping[str, list], outs: Mapping[str, Sequence[dict]], *, spec_of: Mapping,
              tokens_of: Mapping[str, int], ref_tokens: torch.Tensor | None, cold_wall: Mapping[str, float],
              warm_wall: Mapping[str, float], cuda: bool) -> None:
    """Fill the rows of result `r` (`r["backends"]`, rows from `empty_row`) from their measured runs and join
    `notes` ({row: [text]}) into their `note`.

    Args: outs: {row: [{"out": GenerateResult, "wall_s": seconds, "peak_gb": GB}]} of the measured runs so far;
        spec_of: {row: simulated acceptance E or None}; tokens_of: {row: tokens per run}; ref_tokens: eager's
        greedy tokens int64 [B, N] (None before the reference ran); cold_wall / warm_wall: {row: wall seconds of
        the cold / warm-compile run}, whose excess over the median measured run is `compile_s` / `compile_warm_s`;
        cuda: peak memory is recorded only on CUDA. `r` must hold `roofline_tok_s` and `logit_err_vs_fp32_eager`.
    """
    from .accuracy import ratio_to_eager
    names = list(r["backends"])
    for n in names:
        row, runs = r["backends"][n], outs.get(n) or []
        if runs:
            row.update(summarize_runs([x["out"] for x in runs], None if spec_of[n] else ref_tokens,
                                      r["roofline_tok_s"], tokens_of[n]))
            if spec_of[n]:
                row["mean_acceptance"] = statistics.median(x["out"].mean_acceptance for x in runs)
                row["mean_natural_acceptance"] = statistics.median(x["out"].mean_natural_acceptance for x in runs)
                notes[n].append(f"DSpark, simulated acceptance {spec_of[n]}: measured mean "
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
        elif row["note"] is None and not notes[n]:
            notes[n].append("not measured")
    same = identical_rows({n: [x["out"].tokens for x in outs.get(n) or []] for n in names},
                          {n: r["backends"][n].get("teacher_forced_logits_sha256") for n in names})
    for n in names:
        row = r["backends"][n]
        row.update(same[n])
        row["logit_err_vs_fp32_over_eager"] = ratio_to_eager(row["logit_err_vs_fp32"],
                                                             r["logit_err_vs_fp32_eager"])
        if notes[n]:
            row["note"] = "; ".join(([row["note"]] if row["note"] else []) + notes[n])
