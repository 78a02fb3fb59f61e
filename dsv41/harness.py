"""What the commands share (`dsv41 run`, `bench`, `report`, the TP launcher and the precompile workers): building a
preset with seeded weights (`build_model`), wrapping it for a backend (`compile_model`), the environment a result
records, and the benchmark's runs (`make_runner`, `bench_model`, `timed_run`, `teacher_forced_logits`), which the
benchmark and its precompile workers must do alike, and the profiled decode steps and copy bandwidth the "where the
step goes" table is built from (`profile_decode_step`, `copy_bandwidth_tb_s`, `profile_breakdown`; the table itself
is `dsv41.compiler.breakdown`'s, which runs no model). Below every command in the app layer, so that no command
imports another for these (tests/test_layers.py).

Tests replace `compile_model` / `build_model` here (`monkeypatch.setattr(harness, ...)`): every caller looks them up
on this module at call time. `bench` imports the benchmark's runs into its own namespace, where tests replace them
for `run_benchmark`.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Sequence

import torch

__all__ = ["BACKENDS", "DTYPES", "build_model", "compile_model", "environment", "teacher_forced_logits", "make_runner",
           "profiled_steps",
           "bench_model", "cache_positions", "timed_run", "copy_bandwidth_tb_s", "profile_decode_step",
           "profile_breakdown", "step_kernel_counts"]

#: Backends `dsv41 run --backend` accepts.
BACKENDS = ("dsv41", "eager", "inductor", "inductor-cudagraphs")
#: `--dtype` names -> torch dtypes.
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def build_model(preset: str, device: str, weight_mode: str = "checkpoint", dtype: str | None = None, seed: int = 0):
    """Build preset `preset` with seeded random weights generated directly on `device`.

    Returns the eval-mode `DeepseekV41Flash`. dtype defaults to fp32 on CPU and bf16 on CUDA.
    Raises: ValueError for an unknown preset, weight mode or dtype.
    """
    from .model import DeepseekV41Flash, ModelConfig
    cfg = ModelConfig.preset(preset)
    if dtype is None:
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    model = DeepseekV41Flash(cfg, weight_mode=weight_mode, dtype=DTYPES[dtype], device=device)
    return model.init_random(seed).eval()


def compile_model(model, backend: str, options: dict | None = None, regional: bool = False):
    """Wrap `model` for `backend` (one of `BACKENDS`); `eager` returns the model itself. With `regional`, the
    embedding, each layer and the head are compiled as separate regions (`dsv41.compiler.regional`).

    Raises: ValueError for an unknown backend, or options given for a backend other than dsv41; for dsv41, the
    options are validated here (`parse_options`: OptionError / OptionTypeError naming the key) rather than at the
    first call, which runs only after Dynamo has traced the model.
    """
    if options and backend != "dsv41":
        raise ValueError(f"backend options {sorted(options)} apply to the dsv41 backend only, not {backend!r}")
    if backend == "dsv41":
        from .compiler.options import parse_options
        parse_options(options, environ={})
    if backend == "eager":
        return model
    if regional:
        from .compiler.regional import compile_regional
        return compile_regional(model, backend, options)
    if backend == "inductor":
        return torch.compile(model)
    if backend == "inductor-cudagraphs":
        return torch.compile(model, mode="reduce-overhead")
    if backend == "dsv41":
        return torch.compile(model, backend="dsv41", options=options or {})
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def environment(device: str) -> dict:
    """Date, GPU name, driver, torch/Triton/CUDA versions for result JSONs (BENCHMARK.md "Recorded")."""
    import datetime
    import platform
    env = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.machine()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        try:
            import subprocess
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip().split("\n")[0]
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["gpu"], env["driver"] = None, None
    return env


@torch.no_grad()
def teacher_forced_logits(runner, prompt_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the decode steps when eager's greedy `tokens` are fed in, whatever the backend would pick.

    Mirrors `generate`: cache sized for prompt + N tokens (reset in place when it already is), prefill on the
    eager module, then decode step i (1 <= i < N) gets token `tokens[:, i-1]` at position P + i - 1.
    Args: runner (model or compiled wrapper); prompt_ids int64 [B, P] or [P]; tokens int64 [B, N], N >= 2.
    Returns: float32 [B, N-1, V] on the CPU (cloned each step: CUDA-graph outputs are overwritten by a replay).
    Raises: ValueError when N < 2 or the batch sizes differ.
    """
    from .model.results import base_model
    base = base_model(runner)
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids[None]
    b, p = prompt_ids.shape
    if tokens.dim() != 2 or tokens.shape[0] != b or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [B={b}, N>=2], got {tuple(tokens.shape)}")
    n = tokens.shape[1]
    if base.max_seq_len >= p + n and base.batch_size == b:
        base.reset_cache()
    else:
        base.setup_cache(b, p + n)
    dev = base.embed.weight.device
    pos = torch.arange(p, device=dev)[None].expand(b, p).contiguous()
    base(prompt_ids.to(dev), pos, last_only=True)
    pos = torch.full((b, 1), p, dtype=torch.int64, device=dev)
    toks = tokens.to(dev)
    out = []
    for i in range(1, n):
        # A fresh contiguous [B, 1] tensor, strided like generate's `tok[:, None]`, so no stride guard fails.
        logits = runner(toks[:, i - 1:i].clone(memory_format=torch.contiguous_format), pos)
        out.append(logits[:, -1].float().clone())
        pos += 1
    return torch.stack(out, 1).cpu()


def make_runner(model, name: str, options: dict | None, regional: bool = False):
    """A fresh `torch.compile` wrapper (or the model itself for eager) for backend `name`; with `regional`, a
    `RegionalModel` (embedding, layers and head compiled as separate regions) for the compiled backends. A
    `+dspark` row gets its backend's runner (the regional one drafts through its compiled DSpark region)."""
    from .bench_rows import base_backend, row_options
    name = base_backend(name)
    if name == "torch_tensorrt":
        return torch.compile(model, backend="torch_tensorrt")
    if name.startswith("dsv41"):
        return compile_model(model, "dsv41", row_options(name, options), regional=regional)
    return compile_model(model, name, regional=regional)


def bench_model(preset: str, device: str, weight_mode: str, dtype: str | None, prompt_len: int, new_tokens: int,
                contexts: Sequence[int] | None = None, context_tokens: int = 32, seed: int = 0, model=None,
                speculative: bool = False):
    """The benchmark's model and prompt: `build_model` (seeded weights), caches allocated once for the longest
    run of the benchmark (prompt + new tokens, + one verify block when any row decodes speculatively, or the
    longest context of `contexts`), and `benchmark_prompt` of `prompt_len` ids. Every compiled row and every
    precompile worker (`dsv41.precompile`) starts from this, so they compile the same graphs: the caches' sizes
    are static shapes of every compiled step, and `generate` reuses a cache that is big enough.

    Args: as `run_benchmark`; `model`: an already built (e.g. TP-sharded) model to allocate the caches of;
        `speculative`: some row of the run decodes with DSpark.
    Returns: (model, prompt ids int64 [1, prompt_len] on `device`).
    Raises: ValueError when the longest run exceeds the preset's max_position_embeddings.
    """
    from .model import benchmark_prompt

    if model is None:
        model = build_model(preset, device, weight_mode, dtype, seed=seed)
    model.setup_cache(1, cache_positions(model.config, prompt_len, new_tokens, contexts, context_tokens, speculative))
    return model, benchmark_prompt(model.config, prompt_len, device=device)


def cache_positions(cfg, prompt_len: int, new_tokens: int, contexts: Sequence[int] | None = None,
                    context_tokens: int = 32, speculative: bool = False) -> int:
    """Cache positions the benchmark's longest run needs (`bench_model`): prompt + new tokens, + one verify block
    (block + 1 rows) when a row speculates, or the longest context + `context_tokens`.
    Raises: ValueError beyond the config's max_position_embeddings (the numbers are named)."""
    need = prompt_len + new_tokens + (cfg.dspark_block_size + 1 if speculative else 0)
    if contexts:
        need = max(need, max(contexts) + context_tokens)
    if need > cfg.max_position_embeddings:
        raise ValueError(f"the benchmark needs {need} cache positions (prompt {prompt_len} + {new_tokens} tokens"
                         + (f", context {max(contexts)} + {context_tokens}" if contexts else "")
                         + (", + a verify block" if speculative else "")
                         + f"), beyond max_position_embeddings={cfg.max_position_embeddings} of {cfg.name!r}")
    return need


def timed_run(runner, prompt, new_tokens: int, cuda: bool, speculative: float | None = None,
              compiled_prefill: bool = False) -> dict:
    """One `generate` run: {"out": GenerateResult, "wall_s": seconds incl. sync, "peak_gb": float | None}.
    `speculative`: DSpark speculative decoding with simulated "match-expected" acceptance of that mean length.
    `compiled_prefill`: the prompt goes through `runner` in fixed-size chunks (`model.prefill`), not the eager
    module."""
    from .model import generate
    spec = {} if speculative is None else dict(speculative=True, simulate_acceptance=speculative)
    if compiled_prefill:
        spec["compiled_prefill"] = True
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = generate(runner, prompt, new_tokens, **spec)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"out": out, "wall_s": wall, "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None}


def copy_bandwidth_tb_s(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth of the current CUDA device, TB/s (bytes read + written per second).

    Copies `nbytes // 2` bytes `reps` times (CUDA events), median time. Raises: RuntimeError without CUDA.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("copy_bandwidth_tb_s needs a CUDA device")
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() / statistics.median(times) / 1e12


def tensor_core_rate(n: int = 8192, reps: int = 10) -> dict:
    """Dense matmul rate of the current CUDA device: {"tflops": median of `reps` [n, n] x [n, n] products, "dtype":
    "float8_e4m3fn" (`torch._scaled_mm`, per-tensor scales, bf16 out) where the device and torch run it, else
    "bfloat16" (`torch.mm`)}. The prefill's FLOP floor divides by it (issue [prefill]). Raises: RuntimeError without
    CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("tensor_core_rate needs a CUDA device")
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    one = torch.ones((), device="cuda")
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        run, dtype = (lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)), "float8_e4m3fn"
        run()
    except (RuntimeError, AttributeError, TypeError):  # no FP8 tensor cores (pre-sm_89) or another signature
        run, dtype = (lambda: torch.mm(a, b)), "bfloat16"
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return {"tflops": 2 * n ** 3 / statistics.median(times) / 1e12, "dtype": dtype}


@torch.no_grad()
def profile_decode_step(runner, prompt_ids: torch.Tensor, new_tokens: int, steps: int = 1) -> dict:
    """Kernels of decode steps of `runner` on CUDA, after a prefill and one unprofiled (warm-up) step.

    Uses `generate(runner, prompt, 2)` (cache reset in place when sized for `new_tokens`, so buffer addresses and
    CUDA graphs stay valid), then profiles the next `steps` steps in one profiler session (at most new_tokens - 1, so
    the positions stay inside the cache), each inside a `breakdown.STEP_MARK` range that ends after its
    `torch.cuda.synchronize()`. Returns {"kernels": int, "memcpy_memset": int, "names": {kernel name: count},
    "gpu_busy_us", "span_us", "top_us"} of the FIRST profiled step (CUDA device activities, memcpy/memset split off
    by name), and "step_events": one list of `breakdown.KernelEvent` per profiled step (`breakdown.split_steps`).
    Raises: RuntimeError when the model is not on a CUDA device.
    """
    from .model import generate
    from .model.results import base_model
    base = base_model(runner)
    dev = base.embed.weight.device
    if dev.type != "cuda":
        raise RuntimeError("profile_decode_step counts GPU kernels; the model is on " + str(dev))
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids[None]
    b, p = prompt_ids.shape
    if base.max_seq_len < p + new_tokens or base.batch_size != b:
        base.setup_cache(b, p + new_tokens)
    steps = max(1, min(int(steps), new_tokens - 1))
    out = generate(runner, prompt_ids, 2)
    tok = out.tokens[:, -1:].to(dev).clone(memory_format=torch.contiguous_format)
    # One position tensor per step, made before profiling: an in-place `pos += 1` between the steps would be a GPU
    # kernel of its own on the profiled timeline, counted into a step.
    positions = [torch.full((b, 1), p + 1 + i, dtype=torch.int64, device=dev) for i in range(steps)]
    per_step = profiled_steps([lambda pos=pos: runner(tok, pos) for pos in positions])
    return {**step_kernel_counts(per_step[0] if per_step else ()), "step_events": per_step}


def profiled_steps(calls) -> list:
    """Run each of `calls` (decode steps on CUDA) in one profiler session, each inside a `breakdown.STEP_MARK` range
    that ends after its `torch.cuda.synchronize()`; returns one list of `breakdown.KernelEvent` per call
    (`breakdown.split_steps`). Shared by the V4.1 rows (`profile_decode_step`) and the Llama rows."""
    from torch.profiler import ProfilerActivity, record_function

    from .compiler.breakdown import STEP_MARK, kernel_events, split_steps
    from .compiler.profiling import quiet_profile
    torch.cuda.synchronize()
    with quiet_profile([ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i, call in enumerate(calls):
            with record_function(f"{STEP_MARK} {i}"):
                call()
                torch.cuda.synchronize()
    events = prof.events()
    windows = [(float(e.time_range.start), float(e.time_range.end)) for e in events
               if e.device_type != torch.autograd.DeviceType.CUDA and str(e.name).startswith(STEP_MARK)]
    return split_steps(kernel_events(events), windows, len(calls))


def step_kernel_counts(step) -> dict:
    """What one profiled decode step launched, from its `breakdown.KernelEvent`s: {"kernels": GPU kernels (memcpy /
    memset activities not counted), "memcpy_memset": those, "names": {kernel name: launches}, "gpu_busy_us": summed
    activity µs, "span_us": first start to last end (None for no event), "top_us": the 20 costliest names with
    launches and summed µs}. The one rule `kernels_per_step` follows, for every `dsv41 bench` row."""
    kernels, copies, names, times, busy, t0, t1 = 0, 0, {}, {}, 0.0, None, None
    for e in step:
        us = e.end_us - e.start_us
        busy += us
        t0 = e.start_us if t0 is None else min(t0, e.start_us)
        t1 = e.end_us if t1 is None else max(t1, e.end_us)
        low = e.name.lower()
        if low.startswith("memcpy") or low.startswith("memset"):
            copies += 1
        else:
            kernels += 1
            names[e.name] = names.get(e.name, 0) + 1
        times[e.name] = times.get(e.name, 0.0) + us
    top = sorted(times.items(), key=lambda kv: -kv[1])[:20]
    return {"kernels": kernels, "memcpy_memset": copies, "names": names, "gpu_busy_us": busy,
            "span_us": (t1 - t0) if t0 is not None else None,
            "top_us": [{"name": n[:120], "count": names.get(n, 0), "total_us": t} for n, t in top]}


def profile_breakdown(runner, prompt_ids, new_tokens: int, report=None, steps: int = 3) -> dict | None:
    """For `dsv41 report` on a GPU: the `step_breakdown` (`dsv41.compiler.breakdown`) of `runner` from `steps`
    profiled decode steps (`profile_decode_step`) and the copy bandwidth measured now (`copy_bandwidth_tb_s`), also
    set as `report.step_breakdown` when a report is given. `step_us` stays None (no timed run here). Never raises: a
    failure (e.g. a model not on CUDA) prints one line on stderr and returns None, and the report is written without
    it."""
    from .compiler.breakdown import step_breakdown
    try:
        k = profile_decode_step(runner, prompt_ids, new_tokens, steps)
        table = step_breakdown(k["step_events"], report, copy_bandwidth_tb_s())
    except Exception as e:  # noqa: BLE001 - a diagnostic table; the page stays useful without it
        print(f"dsv41 report: step breakdown left out: {type(e).__name__}: {e}"[:400], file=sys.stderr)
        return None
    if report is not None:
        report.step_breakdown = table
    return table
