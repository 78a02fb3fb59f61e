"""What the commands share (`dsv41 run`, `bench`, `report`, the TP launcher and the precompile workers): building a
preset with seeded weights (`build_model`), wrapping it for a backend (`compile_model`), the environment a result
records, and the benchmark's runs (`make_runner`, `bench_model`, `timed_run`, `teacher_forced_logits`), which the
benchmark and its precompile workers must do alike. Below every command in the app layer, so that no command
imports another for these (tests/test_layers.py).

Tests replace `compile_model` / `build_model` here (`monkeypatch.setattr(harness, ...)`): every caller looks them up
on this module at call time. `bench` imports the benchmark's runs into its own namespace, where tests replace them
for `run_benchmark`.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

__all__ = ["BACKENDS", "DTYPES", "build_model", "compile_model", "environment", "teacher_forced_logits", "make_runner",
           "bench_model", "cache_positions", "timed_run"]

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


def timed_run(runner, prompt, new_tokens: int, cuda: bool, speculative: float | None = None) -> dict:
    """One `generate` run: {"out": GenerateResult, "wall_s": seconds incl. sync, "peak_gb": float | None}.
    `speculative`: DSpark speculative decoding with simulated "match-expected" acceptance of that mean length."""
    from .model import generate
    spec = {} if speculative is None else dict(speculative=True, simulate_acceptance=speculative)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = generate(runner, prompt, new_tokens, **spec)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"out": out, "wall_s": wall, "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None}
