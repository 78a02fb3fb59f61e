"""`dsv41 bench`: the benchmark's command line (arguments, checks, outputs); the protocol is `dsv41.bench`.

This module does not import `dsv41.bench`: `dsv41.bench.main` hands its `run_benchmark` to `main` here, so the
command and the protocol form no import circle (`tests/test_layers.py`).

Arguments are checked before anything is built (`dsv41.usage`, `dsv41.bench_plan.check_request`): a bad one is
one line, `dsv41 bench: error: ...`, exit status 2. Files the user does not name go into the output folder
(`-o/--out`, default `out/`); every written path is printed.

Public names: `main`, `console_main`, `parser`.
"""

from __future__ import annotations

import json
import os
from typing import Callable

__all__ = ["main", "console_main", "parser"]

#: The first line of `--help` (the first line of `dsv41.bench`'s docstring).
DESCRIPTION = "The decode benchmark of BENCHMARK.md: backends side by side in one process, alternated run by run."


def parser():
    """The `dsv41 bench` argument parser (one-line errors, `dsv41.usage.OneLineParser`)."""
    from .usage import OneLineParser, int_at_least, positive_float

    p = OneLineParser(prog="dsv41 bench", description=DESCRIPTION)
    p.add_argument("--preset", choices=("tiny", "small", "h200"), default=None,
                   help="default: small on a GPU, tiny on CPU")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="instead of a V4.1 preset, a gpt-fast-style Llama from the source checkout: llama-tiny, "
                        "llama-1b or llama-8b (rows eager, inductor, inductor-cudagraphs, dsv41; BENCHMARK.md)")
    p.add_argument("--backends", default="all",
                   help="comma-separated: eager, inductor, inductor-cudagraphs, dsv41, torch_tensorrt, "
                        "dsv41-no-<family>, 'ablations', 'all' (default)")
    p.add_argument("--prompt-len", type=int_at_least(1), default=None,
                   help="default 4096 on GPU, 32 on CPU (--model: 512, 8)")
    p.add_argument("--new-tokens", type=int_at_least(2, " (decode tok/s needs a decode step)"), default=None,
                   help="default 1024 on GPU, 8 on CPU (--model: 256, 4)")
    p.add_argument("--repeats", type=int_at_least(1), default=5, help="measured runs per backend (default 5)")
    p.add_argument("--weight-mode", choices=("checkpoint", "bf16"), default=None, help="default checkpoint")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--no-warm-compile", dest="warm_compile", action="store_false",
                   help="skip the warm-cache recompile (compile_warm_s stays empty); saves a compile per backend")
    p.add_argument("--speculative", type=positive_float, default=None, metavar="E",
                   help="DSpark speculative decoding with simulated match-expected acceptance E (e.g. 5.5): every "
                        "row, or only the <row>+dspark rows when there are any (their default E: 5.5)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="dsv41 backend option for the dsv41 row and the ablations (repeatable), e.g. streams=false")
    p.add_argument("--shared-cache", action="store_true",
                   help="one Inductor cache dir for all backends (compile_s is then not cold; fits a toggle matrix)")
    p.add_argument("--regional", action="store_true",
                   help="compile the embedding, each layer variant and the head as separate regions (faster compile)")
    p.add_argument("--precompile", type=int_at_least(0), default=0, metavar="N",
                   help="N worker processes compile the rows into their caches in parallel first (dsv41.precompile)")
    p.add_argument("--precompile-only", action="store_true",
                   help="with --precompile and --cache-dir: only fill the caches (a later run is served from them)")
    p.add_argument("--cache-dir", default=None,
                   help="keep the rows' Inductor caches here (a later run with the same arguments is served from them)")
    p.add_argument("--eager-new-tokens", type=int_at_least(2), default=None, metavar="R",
                   help="eager reference and eager rows decode R tokens (<= --new-tokens); the other rows are "
                        "compared with eager over those R")
    p.add_argument("--row-new-tokens", action="append", default=[], metavar="ROW=R",
                   help="this row decodes R tokens per run (repeatable), e.g. inductor=128 for a host-bound row")
    p.add_argument("--contexts", default=None, metavar="N,N,...",
                   help="also measure decode tok/s at these contexts (synthetic caches, e.g. 4096,32768,131072)")
    p.add_argument("--context-tokens", type=int_at_least(2), default=32,
                   help="decode steps per context point (default 32)")
    p.add_argument("--compiled-prefill", action="store_true",
                   help="prefill through each row's compiled model in fixed-size chunks (dsv41/model/prefill.py) "
                        "instead of the eager module")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--png", nargs="?", const="", default=None,
                   help="write the plot; without a path, next to --json with .png (else out/dsv41_bench.png)")
    p.add_argument("--html", default=None, help="write the dsv41 fusion report with this benchmark as HTML here")
    p.add_argument("-o", "--out", default=None, metavar="DIR",
                   help="folder for the files whose path is not given (default out/)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel ranks (spawned, or one per torchrun process); rank 0 writes the outputs")
    p.add_argument("--tp-moe", choices=("tp", "ep"), default="tp", help="MoE layout under --tp")
    p.add_argument("--tp-pad-to", type=int_at_least(1), default=None, help="per-rank expert inter padding multiple")
    return p


def _contexts(text: str | None) -> list | None:
    """`--contexts 4096,32768` -> [4096, 32768] (None without the flag); UsageError for anything else."""
    from .usage import UsageError
    if not text:
        return None
    try:
        out = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise UsageError(f"argument --contexts: expected comma-separated integers >= 1, e.g. 4096,32768; got {text!r}")
    return out


def check_args(a) -> None:
    """Check parsed `dsv41 bench` arguments `a` before anything is built, and fill in `a.device` (unless under
    --tp, where each rank picks its own), `a.preset`, `a.weight_mode`, `a.prompt_len`, `a.new_tokens`,
    `a.contexts_list`, `a.options` and `a.row_new_tokens_map` (a `--model` run: `_check_model_args`).

    Raises: UsageError naming the flag (`dsv41.usage`, `dsv41.bench_plan.check_request`).
    """
    from .bench_plan import check_request
    from .bench_rows import ablation_families, expand_backends, parse_row_new_tokens
    from .usage import UsageError, check_options, resolve_device

    if a.model is not None:
        return _check_model_args(a)
    a.weight_mode = a.weight_mode or "checkpoint"

    if a.tp is not None and a.tp < 1:
        raise UsageError(f"argument --tp: must be a positive number of ranks (>= 1), got {a.tp}")
    if a.tp is not None and (a.speculative is not None or a.contexts):
        raise UsageError("argument --tp: --speculative and --contexts are not supported with --tp yet")
    device = resolve_device(a.device)
    if a.tp is None:  # under --tp each rank picks its own device (`launch.init_distributed`)
        a.device = device
    cuda = device.startswith("cuda")
    a.preset = a.preset or ("small" if cuda else "tiny")
    a.prompt_len = a.prompt_len if a.prompt_len is not None else (4096 if cuda else 32)
    a.new_tokens = a.new_tokens if a.new_tokens is not None else (1024 if cuda else 8)
    a.contexts_list = _contexts(a.contexts)
    try:
        expand_backends(a.backends, ablation_families()[0])
    except ValueError as e:
        raise UsageError(f"argument --backends: {e}") from None
    a.options = check_options(a.option) or None
    try:
        a.row_new_tokens_map = parse_row_new_tokens(a.row_new_tokens)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_request(a.preset, a.backends, a.prompt_len, a.new_tokens, a.repeats, weight_mode=a.weight_mode,
                  dtype=a.dtype, speculative=a.speculative, contexts=a.contexts_list,
                  context_tokens=a.context_tokens, tp={} if a.tp is not None else None, precompile=a.precompile,
                  precompile_only=a.precompile_only, cache_dir=a.cache_dir, eager_new_tokens=a.eager_new_tokens,
                  row_new_tokens=a.row_new_tokens_map)


#: Flags of the V4.1 run that a `--model` run does not take (flag, attribute, its unset value).
_V41_ONLY = (("--weight-mode", "weight_mode", None), ("--speculative", "speculative", None),
             ("--contexts", "contexts", None), ("--tp", "tp", None), ("--precompile", "precompile", 0),
             ("--precompile-only", "precompile_only", False), ("--regional", "regional", False),
             ("--shared-cache", "shared_cache", False), ("--cache-dir", "cache_dir", None),
             ("--eager-new-tokens", "eager_new_tokens", None), ("--row-new-tokens", "row_new_tokens", []),
             ("--png", "png", None), ("--html", "html", None))


def _check_model_args(a) -> None:
    """`check_args` for a `--model` run: no V4.1-only flag, a known model and rows, the source checkout's model
    file; fills `a.device`, `a.prompt_len`, `a.new_tokens`, `a.options`. Raises: UsageError naming the flag."""
    from .bench_llama import check_llama_request, load_llama_zoo
    from .harness import DTYPES
    from .usage import UsageError, check_options, resolve_device

    if a.preset is not None:
        raise UsageError("arguments --model and --preset are mutually exclusive: --model runs a Llama, --preset a "
                         "V4.1 model")
    for flag, attr, unset in _V41_ONLY:
        if getattr(a, attr) != unset:
            raise UsageError(f"argument --model: not allowed with {flag} ({flag} belongs to the V4.1 presets' run)")
    a.device = resolve_device(a.device)
    cuda = a.device.startswith("cuda")
    a.prompt_len = a.prompt_len if a.prompt_len is not None else (512 if cuda else 8)
    a.new_tokens = a.new_tokens if a.new_tokens is not None else (256 if cuda else 4)
    if a.dtype is not None and a.dtype not in DTYPES:
        raise UsageError(f"argument --dtype: unknown dtype {a.dtype!r}")
    check_llama_request(a.model, a.backends, a.prompt_len, a.new_tokens, a.repeats)
    a.options = check_options(a.option) or None
    load_llama_zoo()  # a missing file is one line now, not after the argument checks


def _llama_from_args(a) -> int:
    """Run the `--model` benchmark for checked arguments `a`, write --json, print the table last."""
    from .bench_llama import run_llama_benchmark
    from .bench_table import print_table
    from .outputs import shown

    res = run_llama_benchmark(a.model, a.backends, a.prompt_len, a.new_tokens, a.repeats, device=a.device,
                              dtype=a.dtype, options=a.options, warm_compile=a.warm_compile)
    console = _console()
    if a.json:
        _write_json(a.json, res)
        console.print(f"wrote {shown(a.json)}", markup=False, highlight=False)
    print_table(res, console)
    return 0


def _console():
    """A rich console for the tables, 220 columns wide when not a terminal (a log would wrap at 80)."""
    from rich.console import Console
    console = Console()
    return console if console.is_terminal else Console(width=220)


def _write_json(path: str, r: dict) -> None:
    """Write result `r` to `path` through a temporary file, so a kill mid-write leaves the previous file whole."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(r, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv=None, *, run_benchmark: Callable[..., dict]) -> int:
    """Parse and check `dsv41 bench` arguments, run the benchmark, write and print the results; returns the exit
    status (0). `run_benchmark` is the protocol (`dsv41.bench.run_benchmark`, which `dsv41.bench.main` passes).
    Raises: UsageError for a bad argument (before anything is built; `console_main` prints it as one line with
    status 2); argparse's own errors exit with status 2 after one line."""
    a = parser().parse_args(argv)
    check_args(a)
    if a.model is not None:
        return _llama_from_args(a)
    a.run_benchmark = run_benchmark
    if a.tp is not None:
        from .launch import launch_ranks
        return launch_ranks(_bench_from_args, a.tp, a, device=a.device)
    return _bench_from_args(a)


def console_main(argv=None, *, run_benchmark: Callable[..., dict]) -> int:
    """`main` for a console: a UsageError is one line on stderr (`dsv41 bench: error: ...`) and status 2."""
    from .usage import UsageError, usage_error
    try:
        return main(argv, run_benchmark=run_benchmark)
    except UsageError as e:
        return usage_error("dsv41 bench", e)


def _bench_from_args(a) -> int:
    """Run the benchmark for checked CLI arguments `a` (`check_args`, plus `a.run_benchmark`); under TP (an
    initialised group) only rank 0 writes and prints."""
    from .bench_table import print_context_table, print_table
    from .outputs import output_path, shown

    tp, rank = None, 0
    if a.tp is not None:
        from .launch import init_distributed
        info = init_distributed(a.device)
        a.device, rank = str(info.device), info.rank
        tp = {"moe_mode": a.tp_moe, "pad_to": a.tp_pad_to}

    def write_json(r: dict) -> None:
        """Write `r` to --json (rank 0 only); the partial results along the way, the final one at the end."""
        if a.json and rank == 0:
            _write_json(a.json, r)

    res = a.run_benchmark(a.preset, a.backends, a.prompt_len, a.new_tokens, a.repeats, a.weight_mode, a.device,
                          options=a.options, dtype=a.dtype, warm_compile=a.warm_compile, speculative=a.speculative,
                          contexts=a.contexts_list, context_tokens=a.context_tokens, tp=tp, regional=a.regional,
                          shared_cache=a.shared_cache, precompile=a.precompile, cache_dir=a.cache_dir,
                          precompile_only=a.precompile_only, on_update=write_json,
                          eager_new_tokens=a.eager_new_tokens, row_new_tokens=a.row_new_tokens_map,
                          compiled_prefill=a.compiled_prefill)
    if rank != 0:
        return 0
    console = _console()

    def wrote(path: str) -> None:
        """Print the path of a file just written (relative to the current directory when below it)."""
        console.print(f"wrote {shown(path)}", markup=False, highlight=False)

    if a.json:
        write_json(res)
        wrote(a.json)
    png = None
    if a.png is not None:
        from .plots import plot_benchmark
        png = a.png or (os.path.splitext(a.json)[0] + ".png" if a.json else output_path(a.out, "dsv41_bench.png"))
        plot_benchmark(res, png)
        wrote(png)
    if a.html:
        report = (res["backends"].get("dsv41") or {}).get("report")
        if report is None:
            console.print("no dsv41 fusion report in this run (dsv41 not run or failed): --html skipped")
        else:
            from .compiler.html import write_html
            write_html(report, a.html, bench=res, png_path=png)
            wrote(a.html)
    print_context_table(res, console)
    print_table(res, console)
    return 0


