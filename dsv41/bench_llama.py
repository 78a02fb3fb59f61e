"""`dsv41 bench --model llama-tiny|llama-1b|llama-8b`: a third party's Llama, written the way gpt-fast writes it,
decoded by eager, Inductor, Inductor with CUDA graphs and dsv41 side by side (BENCHMARK.md "Llama rows").

The model is `tests/zoo/llama_gptfast.py` of the source checkout, loaded by file path (dsv41 never imports
`tests`), built with seeded random weights in the run's dtype. Prefill runs eager for every row; only the decode
step (`DecodeStep`: one token at a position tensor -> the greedy next token and its logits) is compiled, once per row: the step's
shapes never change and the position is a tensor, so one compiled graph serves every position. Graphs compiled
after a row's first decode step are counted (`recompiles`, expected 0).

Protocol, as the V4.1 rows (`dsv41.bench`): an eager reference run; per row a cold compile (`torch.compiler.reset()`,
an empty Inductor cache dir) and its first run; one reset, then per row a warm compile from that cache and its
discarded warm-up run; kernels of one decode step under the profiler (CUDA); `repeats` measured runs alternated
A B C D A B C D ... (`measure_alternating`), medians (`summarize`). Roofline: `decode_bytes_per_step` / the copy
bandwidth measured in the run (`roofline`).

Public names: `LLAMA_MODELS`, `LLAMA_ROWS`, `ZOO_FILE`, `checkout_root`, `load_llama_zoo`, `check_llama_request`,
`DecodeStep`, `llama_decode_bytes`, `greedy_decode`, `teacher_forced_logits`, `run_llama_benchmark`.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch

from .bench_protocol import (decode_context, fail_text, max_rel_logit_err, measure_alternating, roofline,
                             summarize, use_cache_dir)
from .usage import UsageError
from .bench_rows import cache_dir_name

__all__ = ["LLAMA_MODELS", "LLAMA_ROWS", "ZOO_FILE", "checkout_root", "load_llama_zoo", "check_llama_request",
           "DecodeStep", "llama_decode_bytes", "greedy_decode", "teacher_forced_logits", "run_llama_benchmark"]

#: Presets of `tests/zoo/llama_gptfast.py` that `--model` accepts.
LLAMA_MODELS = ("llama-tiny", "llama-1b", "llama-8b")
#: The rows of a `--model` run, in the order they run.
LLAMA_ROWS = ("eager", "inductor", "inductor-cudagraphs", "dsv41")
#: The model's file, relative to the source checkout.
ZOO_FILE = "tests/zoo/llama_gptfast.py"
_ZOO_MODULE = "dsv41_zoo_llama_gptfast"

LLAMA_DEFINITIONS = {
    "decode_tok_s": "tokens after the first / (time of the last token - time of the first), per run (prefill, "
                    "eager for every row, excluded); median, min, max over the measured runs",
    "decode_bytes_per_step": "what one decode step must read: every weight matrix at its stored dtype, one row of "
                             "the embedding table, and the K and V cache bytes of decode_context positions "
                             "(2 x layers x KV heads x head_dim x context x bytes per element); the static cache's "
                             "masked positions beyond the context are not counted",
    "roofline_tok_s": "copy_bandwidth_tb_s (device-to-device copy, bytes read + written per second, this run) / "
                      "decode_bytes_per_step; null on CPU",
    "roofline_fraction": "median decode tok/s / roofline_tok_s",
    "kernels_per_step": "GPU kernels torch.profiler records in one warmed-up decode step (CUDA-graph replays "
                        "included; memcpy / memset are memcpy_memset_per_step), as the V4.1 rows; null on CPU",
    "tokens_match_eager": "greedy tokens of every measured run equal the eager reference's (in bf16 a random-weight "
                          "model's greedy tokens part at near-ties, even eager's from run to run on a GPU: see "
                          "max_rel_logit_err)",
    "matching_prefix_tokens": "fewest leading tokens equal to the eager reference's over the measured runs",
    "max_rel_logit_err": "the eager reference's tokens teacher-forced through the row's decode step: max |logits - "
                         "eager's| / max |eager's| over the decode steps (the eager row: eager against itself, "
                         "the run-to-run noise of its kernels)",
    "compile_s": "wall time of the first run after torch.compiler.reset() with an empty Inductor cache dir, minus "
                 "the median measured run",
    "compile_warm_s": "the same for the run compiled again from that cache after one more reset",
    "recompiles": "Dynamo graphs the row compiled after its first decode step (cold run, warm-up and measured "
                  "runs; the warm compile's own graph excluded): 0 means one compiled step served every position",
    "fusion_matches": "dsv41 row: matches per pass family of the cold compile's fusion report (aggregates only)",
}


def checkout_root() -> pathlib.Path:
    """The folder above this package: the repository root in a source checkout (an installed wheel has no
    `tests/` there)."""
    return pathlib.Path(__file__).resolve().parent.parent


def load_llama_zoo():
    """The module of `ZOO_FILE` (loaded once per process, by path). Raises: UsageError when this dsv41 is not a
    source checkout (the file is missing)."""
    if _ZOO_MODULE in sys.modules:
        return sys.modules[_ZOO_MODULE]
    path = checkout_root() / ZOO_FILE
    if not path.is_file():
        raise UsageError(f"--model needs a source checkout ({ZOO_FILE} not found)")
    spec = importlib.util.spec_from_file_location(_ZOO_MODULE, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_ZOO_MODULE] = mod  # a dataclass looks its module up by name while the file executes
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(_ZOO_MODULE, None)
        raise
    return mod


def check_llama_request(model: str, backends, prompt_len: int, new_tokens: int, repeats: int) -> list:
    """The rows of a `--model` run (`LLAMA_ROWS`, or those of `backends`: a comma-separated string or names; `all`
    or None: every row). Raises: UsageError for an unknown model or row, or sizes below 1 / 2 / 1."""
    if model not in LLAMA_MODELS:
        raise UsageError(f"argument --model: unknown model {model!r}; expected one of {', '.join(LLAMA_MODELS)}")
    if prompt_len < 1 or new_tokens < 2 or repeats < 1:
        raise UsageError(f"need prompt_len >= 1, new_tokens >= 2 and repeats >= 1, got {prompt_len}, "
                         f"{new_tokens}, {repeats}")
    names = [s.strip() for s in (backends.split(",") if isinstance(backends, str) else backends or ["all"])]
    out: list = []
    for n in names:
        group = list(LLAMA_ROWS) if n == "all" else [n]
        if n != "all" and n not in LLAMA_ROWS:
            raise UsageError(f"argument --backends: {n!r} is not a --model row; expected {', '.join(LLAMA_ROWS)} "
                             "or all")
        out += [g for g in group if g not in out]
    return out


class DecodeStep(torch.nn.Module):
    """gpt-fast's `decode_one_token` as a module (so `torch.compile` wraps it as it wraps any model): (the greedy
    next token int64 [B, 1], the logits [B, vocab] it came from) of tok int64 [B, 1] at input_pos int64 [1],
    writing the model's caches."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tok: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """(next token int64 [B, 1], last-position logits [B, vocab] in the model's dtype) of one step: `tok` int64
        [B, S] at positions `input_pos` int64 [S]."""
        logits = self.model(tok, input_pos)[:, -1]
        return logits.argmax(-1, keepdim=True), logits


def llama_decode_bytes(model: torch.nn.Module, context: int) -> dict:
    """Bytes one decode step of a `llama_gptfast.Transformer` must read at `context` cached positions:
    {"weights": every parameter except the embedding table, "embedding_row": one table row, "kv": K and V of
    `context` positions over every layer, "total"} (stored dtypes; batch = the caches' batch)."""
    emb = model.tok_embeddings.weight
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p is not emb)
    a = model.config
    cache = model.layers[0].attention.kv_cache.k_cache
    kv = 2 * a.n_layer * cache.shape[0] * a.n_local_heads * a.head_dim * context * cache.element_size()
    row = emb.shape[1] * emb.element_size()
    return {"weights": weights, "embedding_row": row, "kv": kv, "total": weights + row + kv}


@torch.no_grad()
def greedy_decode(step: Callable, model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int,
                  after_first_step: Callable[[], None] | None = None) -> dict:
    """Prefill `prompt` int64 [B, P] on the eager `model`, then `new_tokens - 1` calls of `step(tok, input_pos)`.

    The position is one int64 [1] tensor incremented in place, so a compiled step sees the same input every time.
    `step` is a `DecodeStep` or its compiled wrapper.
    `after_first_step()` runs after the first decode step (the recompile count starts there).
    Returns {"tokens": int64 [B, new_tokens] on CPU, "decode_tok_s": steps / seconds from the first token to the
    last (CUDA events on GPU), "wall_s": the whole call}.
    """
    from .model.results import Clock
    t0 = time.perf_counter()
    dev = prompt.device
    p = prompt.shape[1]
    tok = model(prompt, torch.arange(p, device=dev))[:, -1:].argmax(-1)
    pos = torch.tensor([p], dtype=torch.int64, device=dev)
    out = torch.empty(prompt.shape[0], new_tokens, dtype=torch.int64, device=dev)
    out[:, :1] = tok
    clock = Clock(dev)
    clock.mark()
    for i in range(1, new_tokens):
        # A copy, as gpt-fast makes: under CUDA graphs the step's output buffer is rewritten by the next replay,
        # which also reads this token.
        tok = step(tok, pos)[0].clone()
        out[:, i:i + 1] = tok
        pos += 1
        clock.mark()
        if i == 1 and after_first_step is not None:
            after_first_step()
    sec = clock.seconds()
    return {"tokens": out.cpu(), "decode_tok_s": (new_tokens - 1) / sec[-1], "wall_s": time.perf_counter() - t0}


@torch.no_grad()
def teacher_forced_logits(step: Callable, model: torch.nn.Module, prompt: torch.Tensor,
                          tokens: torch.Tensor) -> torch.Tensor:
    """The logits [N - 1, B, vocab] (FP32, CPU) of `step`'s decode steps when fed the given greedy tokens int64
    [B, N] (e.g. eager's) after an eager prefill of `prompt`: the rows' numbers compared on the same inputs, which
    free-running greedy decoding stops being at the first near-tie."""
    dev = prompt.device
    p = prompt.shape[1]
    model(prompt, torch.arange(p, device=dev))
    tokens = tokens.to(dev)
    out = []
    for i in range(1, tokens.shape[1]):
        # A fresh [B, 1] tensor, strided as the greedy loop's tokens: a slice's strides would be a new guard.
        tok = tokens[:, i - 1:i].clone(memory_format=torch.contiguous_format)
        out.append(step(tok, torch.tensor([p + i - 1], device=dev))[1].float().cpu())
    return torch.stack(out)


def _profile_step(step, model, prompt: torch.Tensor) -> dict:
    """Kernels of one decode step after a prefill and one unprofiled step, counted as the V4.1 rows count them
    (`harness.step_kernel_counts`). Raises: RuntimeError off CUDA."""
    from .harness import profiled_steps, step_kernel_counts
    if prompt.device.type != "cuda":
        raise RuntimeError("kernels per step are counted on CUDA only")
    with torch.no_grad():
        p = prompt.shape[1]
        tok = model(prompt, torch.arange(p, device=prompt.device))[:, -1:].argmax(-1)
        tok = step(tok, torch.tensor([p], device=prompt.device))[0].clone()
        pos = torch.tensor([p + 1], device=prompt.device)  # made before profiling: no stray kernel in the step
        per_step = profiled_steps([lambda: step(tok, pos)])
    return step_kernel_counts(per_step[0] if per_step else ())


def _graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Leading positions where the token rows a, b int64 [B, N] agree in every sequence."""
    bad = torch.nonzero(~(a == b).all(0))
    return int(bad[0, 0]) if bad.numel() else a.shape[1]


def _empty_llama_row() -> dict:
    """A `--model` row with every figure null."""
    return {"decode_tok_s": None, "roofline_fraction": None, "kernels_per_step": None,
            "memcpy_memset_per_step": None, "tokens_match_eager": None, "matching_prefix_tokens": None,
            "max_rel_logit_err": None, "compile_s": None, "compile_warm_s": None,
            "recompiles": None, "options": None, "note": None}


def run_llama_benchmark(model: str, backends=None, prompt_len: int = 16, new_tokens: int = 8, repeats: int = 5,
                        device: str | None = None, dtype: str | None = None, options: dict | None = None,
                        warm_compile: bool = True, say: Callable[[str], None] | None = None) -> dict:
    """Run the protocol of the module docstring on Llama preset `model` and return the result dict.

    Args: model: one of `LLAMA_MODELS`; backends: rows (`check_llama_request`); prompt_len: random prompt tokens
        (CPU generator seeded 42, ids uniform over the vocabulary); new_tokens: greedy tokens per run (the first
        from prefill); repeats: measured runs per row; device `cpu` / `cuda[:N]` (default cuda when available);
        dtype `bf16` | `fp16` | `fp32` (default bf16 on GPU, fp32 on CPU); options: dsv41 backend options of the
        `dsv41` row; warm_compile: False skips the warm recompile (the warm-up run reuses the cold runner);
        say: progress lines (default: stderr).
    Returns: {"model", "params", "decode_context", "decode_bytes_per_step", "decode_bytes", "copy_bandwidth_tb_s",
        "roofline_tok_s", environment (date, gpu, driver, torch, triton, cuda, host), "dtype", "device",
        "prompt_len", "new_tokens", "repeats", "run_order", "reference_tokens", "definitions", "backends": {row:
        {decode_tok_s {median, min, max}, roofline_fraction, kernels_per_step, memcpy_memset_per_step,
        tokens_match_eager, matching_prefix_tokens, max_rel_logit_err, compile_s, compile_warm_s, recompiles,
        options, note, and for dsv41 fusion_matches,
        kernels_per_step_by_role, kernels_per_step_static}}}. A row that fails keeps its nulls and says why in
        `note`.
    Raises: UsageError for a bad request (before anything is built) or a missing `ZOO_FILE`.
    """
    from .bench_reports import attach_report
    from .harness import DTYPES, compile_model, copy_bandwidth_tb_s, environment

    names = check_llama_request(model, backends, prompt_len, new_tokens, repeats)
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    zoo = load_llama_zoo()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    tdtype = DTYPES[dtype or ("bf16" if cuda else "fp32")]
    t_start = time.perf_counter()
    say = say or (lambda msg: print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True))

    net = zoo.build(model, dtype=tdtype, device=device, seed=0, max_batch_size=1,
                    max_seq_length=prompt_len + new_tokens)
    cfg = net.config
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(42))
    prompt = prompt.to(device)
    ctx = decode_context(prompt_len, new_tokens)
    nbytes = llama_decode_bytes(net, ctx)
    n_params = sum(p.numel() for p in net.parameters())
    res = {**environment(device), "model": model, "dtype": str(tdtype).replace("torch.", ""), "device": device,
           "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats, "warm_compile": warm_compile,
           "params": {"total": n_params, "embedding": net.tok_embeddings.weight.numel()},
           "decode_context": ctx, "decode_bytes_per_step": nbytes["total"], "decode_bytes": nbytes,
           "copy_bandwidth_tb_s": copy_bandwidth_tb_s() if cuda else None, "definitions": dict(LLAMA_DEFINITIONS),
           "backends": {n: _empty_llama_row() for n in names}}
    res["roofline_tok_s"] = roofline(nbytes["total"], res["copy_bandwidth_tb_s"]) if cuda else None
    rows = res["backends"]
    notes: dict = {n: [] for n in names}
    for n in names:
        rows[n]["options"] = dict(options or {}) if n == "dsv41" else None
        if not cuda:
            notes[n].append("CPU: kernels_per_step (GPU kernels) and the roofline are CUDA-only")

    say(f"{model}: {n_params / 1e9:.3f} B parameters, {nbytes['total'] / 1e9:.4f} GB per decode step at context "
        f"{ctx}, {res['dtype']} on {device}")
    eager_step = DecodeStep(net)
    ref = greedy_decode(eager_step, net, prompt, new_tokens)
    res["reference_tokens"] = ref["tokens"].tolist()
    ref_logits = teacher_forced_logits(eager_step, net, prompt, ref["tokens"])
    say(f"eager reference: {ref['wall_s']:.1f} s")

    runners, cold_wall, warm_wall, first_graphs, extra, runnable = {}, {}, {}, {}, {}, []
    cache_root = tempfile.mkdtemp(prefix="dsv41-bench-llama-")
    saved_cache_env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")

    def compiled(n: str):
        """A fresh runner of row `n` over the shared eager model."""
        return DecodeStep(net) if n == "eager" else compile_model(DecodeStep(net), n,
                                                                  (options or {}) if n == "dsv41" else None)
    try:
        with torch._dynamo.config.patch(cache_size_limit=max(torch._dynamo.config.cache_size_limit, 64)):
            for n in names:  # cold compile + first run
                try:
                    if warm_compile:
                        torch.compiler.reset()
                    use_cache_dir(os.path.join(cache_root, cache_dir_name(n)))
                    runners[n] = compiled(n)
                    out = greedy_decode(runners[n], net, prompt, new_tokens,
                                        after_first_step=lambda n=n: first_graphs.__setitem__(n, _graphs()))
                    cold_wall[n] = out["wall_s"]
                    extra[n] = _graphs() - first_graphs[n]
                    if n == "dsv41":
                        attach_report(rows[n], False)
                    runnable.append(n)
                    say(f"{n}: cold compile + first run {cold_wall[n]:.1f} s")
                except Exception as e:  # reported in the row, never dropped
                    notes[n].append(fail_text(e))
                    say(f"{n}: {fail_text(e)}")
            if warm_compile:
                torch.compiler.reset()
            for n in list(runnable):  # warm compile (from the row's cache) + the discarded warm-up run
                try:
                    if warm_compile and n != "eager":
                        use_cache_dir(os.path.join(cache_root, cache_dir_name(n)))
                        runners[n] = compiled(n)
                        out = greedy_decode(runners[n], net, prompt, new_tokens,
                                            after_first_step=lambda n=n: first_graphs.__setitem__(n, _graphs()))
                        warm_wall[n] = out["wall_s"]
                        extra[n] += _graphs() - first_graphs[n]
                    else:
                        g = _graphs()
                        greedy_decode(runners[n], net, prompt, new_tokens)
                        extra[n] += _graphs() - g
                except Exception as e:
                    notes[n].append(fail_text(e))
                    runnable.remove(n)
            for n in runnable:
                if cuda:
                    try:
                        g = _graphs()
                        k = _profile_step(runners[n], net, prompt)
                        extra[n] += _graphs() - g
                        rows[n]["kernels_per_step"] = k["kernels"]
                        rows[n]["memcpy_memset_per_step"] = k["memcpy_memset"]
                        # where the profiled step goes: summed kernel time, first start to last end, costliest names
                        rows[n]["step_gpu_busy_us"] = k["gpu_busy_us"]
                        rows[n]["step_span_us"] = k["span_us"]
                        rows[n]["top_kernels_us"] = k["top_us"]
                        say(f"{n}: {k['kernels']} kernels per step")
                    except Exception as e:
                        notes[n].append("kernel count " + fail_text(e))
            for n in runnable:  # the same inputs for every row: eager's tokens, teacher-forced
                try:
                    g = _graphs()
                    tf = teacher_forced_logits(runners[n], net, prompt, ref["tokens"])
                    extra[n] += _graphs() - g
                    rows[n]["max_rel_logit_err"] = max_rel_logit_err(tf, ref_logits)
                except Exception as e:
                    notes[n].append("teacher forcing " + fail_text(e))
            g_measure = _graphs()
            fns = {n: (lambda r=runners[n]: greedy_decode(r, net, prompt, new_tokens)) for n in runnable}
            outs, errors, order = measure_alternating(fns, repeats)
            measured_graphs = _graphs() - g_measure  # one process-wide counter: a row of its own only if nonzero
    finally:
        if saved_cache_env is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_cache_env
        shutil.rmtree(cache_root, ignore_errors=True)

    res["run_order"] = order
    res["graphs_compiled_while_measuring"] = measured_graphs
    for n, err in errors.items():
        notes[n].append("measured run failed: " + err)
    for n in runnable:
        row, runs = rows[n], outs.get(n) or []
        row["recompiles"] = extra[n] + measured_graphs
        if not runs:
            continue
        row["decode_tok_s"] = summarize(o["decode_tok_s"] for o in runs)
        if res["roofline_tok_s"]:
            row["roofline_fraction"] = row["decode_tok_s"]["median"] / res["roofline_tok_s"]
        row["tokens_match_eager"] = all(torch.equal(o["tokens"], ref["tokens"]) for o in runs)
        row["matching_prefix_tokens"] = min(_prefix(o["tokens"], ref["tokens"]) for o in runs)
        walls = statistics.median(o["wall_s"] for o in runs)
        if n != "eager":
            row["compile_s"] = max(0.0, cold_wall[n] - walls)
            if n in warm_wall:
                row["compile_warm_s"] = max(0.0, warm_wall[n] - walls)
        else:
            notes[n].append("eager does not compile")
    for n in names:
        if notes[n]:
            rows[n]["note"] = "; ".join(([rows[n]["note"]] if rows[n]["note"] else []) + notes[n])
    return res
