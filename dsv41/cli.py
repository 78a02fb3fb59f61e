"""`dsv41` command line: `dsv41 run` (the main job); `dsv41 bench` and `dsv41 report` are dispatched from here."""

from __future__ import annotations

import json
import sys

import torch

from . import harness
from .harness import BACKENDS, DTYPES, build_model, compile_model, environment  # noqa: F401 (public names here)
from .usage import backend_options  # noqa: F401 (a public name here)

__all__ = ["main", "build_model", "compile_model", "backend_options", "BACKENDS"]


def _run_request(args) -> dict:
    """Check `dsv41 run`'s arguments against this machine and fill the defaults, before anything is built.

    Returns {"device", "preset", "prompt_len", "new_tokens", "options", "regional"}. Raises: UsageError naming the
    flag (device, lengths beyond the preset's max_position_embeddings, --option, --simulate-acceptance).
    """
    from .usage import UsageError, check_lengths, check_options, resolve_device

    device = resolve_device(args.device)
    cuda = device.startswith("cuda")
    preset = args.preset or ("small" if cuda else "tiny")
    prompt_len = args.prompt_len if args.prompt_len is not None else (4096 if cuda else 32)
    new_tokens = args.new_tokens if args.new_tokens is not None else (64 if cuda else 16)
    if args.simulate_acceptance is not None and not args.speculative:
        raise UsageError("argument --simulate-acceptance: needs --speculative")
    if args.tp is not None and args.speculative:
        raise UsageError("argument --speculative: not supported with --tp yet")
    from .model.config import ModelConfig
    block = ModelConfig.preset(preset).dspark_block_size + 1 if args.speculative else 0
    check_lengths(preset, prompt_len, new_tokens, block, "a speculative verify block")
    options = check_options(args.option, args.backend)
    if args.backend == "dsv41" and "count_kernels" not in options:
        # The summary's kernels per step before -> after: one profiled eager and compiled run of each graph.
        options["count_kernels"] = True
    return {"device": device, "preset": preset, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "options": options, "regional": bool(getattr(args, "regional", False))}


def _cmd_run(args) -> int:
    """`dsv41 run` for parsed `args`: check them (`_run_request`), build, eager reference, compile + first run,
    measured run, report page and summary. Returns 0, or 1 when the tokens differ from eager. Raises: UsageError."""
    from rich.console import Console

    from .compile_stats import CompileClock
    from .model import benchmark_prompt, generate
    from .model.budget import budget
    from .outputs import output_path, shown
    from .progress import Phases
    from .run_summary import print_run_summary

    req = _run_request(args)
    device, preset, prompt_len, new_tokens = req["device"], req["preset"], req["prompt_len"], req["new_tokens"]
    phases = Phases("dsv41 run")
    torch.manual_seed(args.seed)
    with phases.phase(f"building {preset} ({args.weight_mode}) on {device}", "build"):
        model = harness.build_model(preset, device, args.weight_mode, args.dtype, args.seed)
    prompt = benchmark_prompt(model.config, prompt_len, device=device)
    result = {**harness.environment(device), "preset": preset, "backend": args.backend, "device": device,
              "weight_mode": args.weight_mode, "dtype": str(model.dtype).replace("torch.", ""),
              "prompt_len": prompt_len, "new_tokens": new_tokens, "options": req["options"] or None}
    spec = dict(speculative=True, simulate_acceptance=args.simulate_acceptance) if args.speculative else {}
    # Simulated acceptance emits drafts the target did not choose: its tokens are not compared with eager.
    check = args.check and args.simulate_acceptance is None
    result.update(speculative=args.speculative, simulated_acceptance=args.simulate_acceptance)
    if getattr(args, "compiled_prefill", False):  # the prompt through the compiled model, in fixed-size chunks
        spec["compiled_prefill"] = True
    result["compiled_prefill"] = bool(spec.get("compiled_prefill"))

    ref = None
    if (args.backend != "eager" or args.speculative) and check:
        with phases.phase(f"eager reference ({new_tokens} tokens, plain greedy)", "eager_reference"):
            ref = generate(model, prompt, new_tokens)
    result["regional"] = req["regional"]
    runner = harness.compile_model(model, args.backend, req["options"] or None, regional=req["regional"])
    compiles = args.backend != "eager"
    what = f"{args.backend}: compile + first run" if compiles else "eager: first run"
    hint = f"a cold {preset} compile takes minutes on a 2-core CPU" if compiles and not device.startswith("cuda") \
        else ""
    clock = CompileClock()
    with phases.phase(what, "compile_and_first_run", hint):
        generate(runner, prompt, new_tokens, **spec)
    first_s = phases.seconds["compile_and_first_run"]
    with phases.phase(f"{args.backend}: measured run ({new_tokens} tokens)", "measured_run"):
        out = generate(runner, prompt, new_tokens, **spec)
    result["compile_and_warmup_s"] = first_s
    if compiles:
        # The first run's compile is its wall time less one run's (the measured run's) wall time.
        result["compile"] = {**clock.result(max(0.0, first_s - phases.seconds["measured_run"])),
                             "compile_and_first_run_s": round(first_s, 2)}
    if args.speculative:
        result.update(mean_acceptance=out.mean_acceptance, mean_natural_acceptance=out.mean_natural_acceptance,
                      acceptance=[r[0] for r in out.acceptance])
    if device.startswith("cuda"):
        result["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    b = budget(model.config, max_seq_len=prompt_len + new_tokens)
    result.update(tokens=out.tokens[0].tolist(), prefill_tok_s=out.prefill_tok_s, decode_tok_s=out.decode_tok_s,
                  kv_bytes_per_token=b.kv_bytes_per_token, kv_bytes_per_token_allocated=b.kv_bytes_per_token_allocated,
                  tokens_match_eager=None if ref is None else bool(torch.equal(ref.tokens, out.tokens)))
    report_path = None
    if args.backend == "dsv41":
        from ._package import repair
        repair()  # dsv41 imported as a namespace package: its __init__ (last_report) runs first
        from . import last_report  # the package's name, which callers may replace
        rep = getattr(runner, "report", None) or last_report()
        if rep is not None:
            rep.set_layer_roles(model.config.roles)  # launches per layer role: the backend never sees the config
            result["report"] = rep.to_dict()
            result["kernels_per_step_by_role"] = result["report"]["kernels_by_role"]
            if "compile" in result:
                c = result["compile"]
                # Served means Inductor's caches AND dsv41's kept records: a cache hit whose records are missing is
                # compiled again with the caches off (pipeline.py), which the cache counters alone do not show.
                c["dsv41_records_from_cache"] = bool(rep.graphs) and all(g.from_cache for g in rep.graphs)
                c["served_from_cache"] = c["served_from_cache"] and c["dsv41_records_from_cache"]
                c["count_kernels_s"] = round(sum(g.count_s for g in rep.graphs), 2)
                if not any(g.from_cache for g in rep.graphs):
                    c["dsv41_passes_s"] = {n: round(f["pass_seconds"], 2)
                                           for n, f in result["report"]["families"].items()}
            from .compiler.html import write_html
            report_path = write_html(result["report"], output_path(args.out, "dsv41_report.html", ".html"))
            result["report_html"] = report_path
    result["phases_s"] = {k: round(v, 2) for k, v in phases.seconds.items()}

    out_console = Console()
    if not out_console.is_terminal:  # a pipe or a log: rich would fit the table to 80 columns
        out_console = Console(width=160)
    print_run_summary(result, out_console, report_path=report_path and shown(report_path),
                      acceptance=(out.mean_acceptance, out.mean_natural_acceptance) if args.speculative else None)
    if args.json:
        import os
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        out_console.print(f"wrote {shown(args.json)}", markup=False, highlight=False)
    if ref is not None and not result["tokens_match_eager"]:
        Console(stderr=True).print("[red]greedy tokens differ from eager[/red]")
        return 1
    return 0


def _run_parser(sub) -> None:
    """The `dsv41 run` subparser."""
    from .usage import int_at_least, positive_float

    r = sub.add_parser("run", help="build a preset with random weights, compile, generate, print the table")
    r.add_argument("--preset", choices=("tiny", "small", "h200"), default=None,
                   help="default: small on a GPU, tiny on CPU")
    r.add_argument("--prompt-len", type=int_at_least(1), default=None, help="default 4096 on GPU, 32 on CPU")
    r.add_argument("--new-tokens", type=int_at_least(2, " (one from the prefill, then decode steps)"), default=None,
                   help="default 64 on GPU, 16 on CPU")
    r.add_argument("--backend", choices=BACKENDS, default="dsv41",
                   help="default dsv41: compile, check the greedy tokens against eager, print the fusion report")
    r.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    r.add_argument("--weight-mode", choices=("checkpoint", "bf16"), default="checkpoint")
    r.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-check", dest="check", action="store_false", help="skip the eager token check")
    r.add_argument("--json", default=None, help="write the result JSON here")
    r.add_argument("-o", "--out", default=None, metavar="PATH",
                   help="the fusion report page: a .html path, or a folder for dsv41_report.html (default out/)")
    r.add_argument("--regional", action="store_true",
                   help="compile the embedding, each layer variant and the head as separate regions (faster compile)")
    r.add_argument("--compiled-prefill", action="store_true",
                   help="prefill through the compiled model in fixed-size chunks (512, 64, 8, 1 tokens) instead of "
                        "the eager module")
    r.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a dsv41 backend option (repeatable), VALUE as JSON where it parses: --option streams=false")
    r.add_argument("--speculative", action="store_true",
                   help="DSpark speculative decoding (greedy; the tokens must equal plain greedy eager)")
    r.add_argument("--simulate-acceptance", type=positive_float, default=None, metavar="E",
                   help="with --speculative: BENCHMARK.md match-expected acceptance of mean length E (e.g. 5.5)")
    r.add_argument("--tp", type=int_at_least(1), default=None,
                   help="tensor-parallel ranks (spawned, or one per torchrun process)")
    r.add_argument("--tp-moe", choices=("tp", "ep"), default="tp", help="MoE layout under --tp")
    r.add_argument("--tp-pad-to", type=int_at_least(1), default=None,
                   help="per-rank expert inter padding multiple (default 128)")


def print_patterns(families: list[str]) -> int:
    """`dsv41 report --patterns [FAMILY ...]`: print what each chain of the named families (default: all, in pass
    order) looks for, from their declarations (`dsv41.passes.engine.chain`). Builds nothing, compiles nothing.
    Returns 0, or 2 naming an unknown family on stderr."""
    from .passes.engine import describe_families
    from .passes.manager import FAMILIES, FAMILY_ORDER

    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        print(f"dsv41 report: error: unknown families {unknown}; valid: {', '.join(FAMILY_ORDER)}", file=sys.stderr)
        return 2
    print(describe_families(FAMILIES[f].spec for f in (families or FAMILY_ORDER)))
    return 0


def main(argv=None) -> int:
    """Entry point of the `dsv41` console script (also `python -m dsv41`): `run`, `bench` and `report`.

    Returns the exit status: 0, 1 when the greedy tokens differ from eager, 2 for a user error (one line on
    stderr, `dsv41 <cmd>: error: ...`, raised before any model is built).
    """
    from .usage import OneLineParser, UsageError, usage_error

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from .bench import console_main
        return console_main(argv[1:])
    if argv[:1] == ["report"] and "--patterns" in argv[1:]:
        return print_patterns([a for a in argv[1:] if a != "--patterns"])
    if argv[:1] == ["report"]:
        from .report_cli import main as report_main
        try:
            return report_main(argv[1:])
        except UsageError as e:
            return usage_error("dsv41 report", e)
    p = OneLineParser(prog="dsv41", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("bench", help="the decode benchmark (see `dsv41 bench --help`)")
    sub.add_parser("report", help="compile a preset with dsv41 and write the fusion report as HTML "
                                  "(see `dsv41 report --help`); `dsv41 report --patterns [FAMILY ...]` prints what "
                                  "each fusion chain looks for")
    _run_parser(sub)
    args = p.parse_args(argv)
    if args.cmd != "run":
        return 2
    try:
        if args.tp is not None:
            _run_request(args)  # the same checks, before any rank starts
            from .launch import run_tp
            return run_tp(args)
        return _cmd_run(args)
    except UsageError as e:
        return usage_error("dsv41 run", e)


if __name__ == "__main__":
    sys.exit(main())
