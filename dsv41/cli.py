"""`dsv41` command line: `dsv41 run` (the main job)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

__all__ = ["main", "build_model", "compile_model", "BACKENDS"]

#: Backends `dsv41 run --backend` accepts.
BACKENDS = ("dsv41", "eager", "inductor", "inductor-cudagraphs")
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def build_model(preset: str, device: str, weight_mode: str = "checkpoint", dtype: str | None = None, seed: int = 0):
    """Build preset `preset` with seeded random weights generated directly on `device`.

    Returns the eval-mode `DeepseekV41Flash`. dtype defaults to fp32 on CPU and bf16 on CUDA.
    Raises: ValueError for an unknown preset, weight mode or dtype.
    """
    from .model import DeepseekV41Flash, ModelConfig
    cfg = ModelConfig.preset(preset)
    if dtype is None:
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    model = DeepseekV41Flash(cfg, weight_mode=weight_mode, dtype=_DTYPES[dtype], device=device)
    return model.init_random(seed).eval()


def backend_options(pairs) -> dict:
    """`--option KEY=VALUE` strings -> the dsv41 `options` dict; VALUE is read as JSON (true, 3, ["moe"]) where it
    parses, else kept as a string. Raises ValueError for an item without `=` (the backend validates the keys)."""
    import json
    out = {}
    for item in pairs or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def compile_model(model, backend: str, options: dict | None = None, regional: bool = False):
    """Wrap `model` for `backend` (one of `BACKENDS`); `eager` returns the model itself. With `regional`, the
    embedding, each layer and the head are compiled as separate regions (`dsv41.compiler.regional`).

    Raises: ValueError for an unknown backend, or options given for a backend other than dsv41.
    """
    if options and backend != "dsv41":
        raise ValueError(f"backend options {sorted(options)} apply to the dsv41 backend only, not {backend!r}")
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


def _cmd_run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .model import benchmark_prompt, generate
    from .model.budget import budget

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.preset or ("small" if device.startswith("cuda") else "tiny")
    prompt_len = args.prompt_len or (4096 if device.startswith("cuda") else 32)
    new_tokens = args.new_tokens or (64 if device.startswith("cuda") else 16)
    console = Console(stderr=True)
    torch.manual_seed(args.seed)
    with console.status(f"building {preset} ({args.weight_mode}) on {device}"):
        model = build_model(preset, device, args.weight_mode, args.dtype, args.seed)
    prompt = benchmark_prompt(model.config, prompt_len, device=device)
    result = {**environment(device), "preset": preset, "backend": args.backend, "device": device, "weight_mode": args.weight_mode,
              "dtype": str(model.dtype).replace("torch.", ""), "prompt_len": prompt_len, "new_tokens": new_tokens}
    if args.simulate_acceptance is not None and not args.speculative:
        console.print("[red]--simulate-acceptance needs --speculative[/red]")
        return 2
    spec = dict(speculative=True, simulate_acceptance=args.simulate_acceptance) if args.speculative else {}
    # Simulated acceptance emits drafts the target did not choose: its tokens are not compared with eager.
    check = args.check and args.simulate_acceptance is None
    result.update(speculative=args.speculative, simulated_acceptance=args.simulate_acceptance)

    ref = None
    if (args.backend != "eager" or args.speculative) and check:
        with console.status("eager reference run (plain greedy)"):
            ref = generate(model, prompt, new_tokens)
    regional = getattr(args, "regional", False)
    result["regional"] = regional
    runner = compile_model(model, args.backend, backend_options(args.option), regional=regional)
    t0 = time.perf_counter()
    with console.status(f"{args.backend}: compile + warm-up run"):
        generate(runner, prompt, new_tokens, **spec)
    result["compile_and_warmup_s"] = time.perf_counter() - t0
    with console.status(f"{args.backend}: measured run"):
        out = generate(runner, prompt, new_tokens, **spec)
    if args.speculative:
        result.update(mean_acceptance=out.mean_acceptance, mean_natural_acceptance=out.mean_natural_acceptance,
                      acceptance=[r[0] for r in out.acceptance])
    if device.startswith("cuda"):
        result["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    b = budget(model.config, max_seq_len=prompt_len + new_tokens)
    result.update(tokens=out.tokens[0].tolist(), prefill_tok_s=out.prefill_tok_s, decode_tok_s=out.decode_tok_s,
                  kv_bytes_per_token=b.kv_bytes_per_token, kv_bytes_per_token_allocated=b.kv_bytes_per_token_allocated,
                  tokens_match_eager=None if ref is None else bool(torch.equal(ref.tokens, out.tokens)))
    if args.backend == "dsv41":
        from .compiler.report import last_report
        rep = getattr(runner, "report", None) or last_report()
        if rep is not None:
            rep.set_layer_roles(model.config.roles)  # launches per layer role: the backend never sees the config
            result["report"] = rep.to_dict()
            result["kernels_per_step_by_role"] = result["report"]["kernels_by_role"]

    table = Table(title=f"dsv41 run: {preset} ({args.weight_mode}, {result['dtype']}) on {device}")
    for col in ("backend", "prefill tok/s", "decode tok/s", "tokens", "KV B/token (logical / allocated)",
                "matches eager"):
        table.add_column(col)
    table.add_row(args.backend, f"{out.prefill_tok_s:,.1f}", f"{out.decode_tok_s:,.2f}", str(new_tokens),
                  f"{b.kv_bytes_per_token:g} / {b.kv_bytes_per_token_allocated:.1f}",
                  "-" if ref is None else ("yes" if result["tokens_match_eager"] else "NO"))
    out_console = Console()
    if args.speculative:
        sim = "" if args.simulate_acceptance is None else f" (simulated match-expected {args.simulate_acceptance})"
        out_console.print(f"DSpark: mean acceptance length {out.mean_acceptance:.3f} tokens/round{sim}; "
                          f"greedy (natural) {out.mean_natural_acceptance:.3f}")
    if "report" in result:
        fams = result["report"].get("families", {})
        summary = ", ".join(f"{k}: {v.get('matches', 0)}" for k, v in fams.items())
        out_console.print(f"fusion report: {summary}")
        by_role = result.get("kernels_per_step_by_role")
        if by_role:
            per = by_role["per_layer"]
            out_console.print("kernel launches per decode step by layer role (static): " + ", ".join(
                f"{r}: {n}" + (f" ({per[r]['layers']} layers, {per[r]['mean']:.1f} each)" if r in per else "")
                for r, n in by_role.items() if r != "per_layer"))
    out_console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if ref is not None and not result["tokens_match_eager"]:
        console.print("[red]greedy tokens differ from eager[/red]")
        return 1
    return 0


def main(argv=None) -> int:
    """Entry point of the `dsv41` console script (also `python -m dsv41`): `run`, `bench` and `report`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from .bench import main as bench_main
        return bench_main(argv[1:])
    if argv[:1] == ["report"]:
        from .compiler.html import main as report_main
        return report_main(argv[1:])
    p = argparse.ArgumentParser(prog="dsv41", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("bench", help="the decode benchmark (see `dsv41 bench --help`)")
    sub.add_parser("report", help="compile a preset with dsv41 and write the fusion report as HTML "
                                  "(see `dsv41 report --help`)")
    r = sub.add_parser("run", help="build a preset with random weights, compile, generate, print the table")
    r.add_argument("--preset", choices=("tiny", "small", "h200"), default=None,
                   help="default: small on a GPU, tiny on CPU")
    r.add_argument("--prompt-len", type=int, default=None, help="default 4096 on GPU, 32 on CPU")
    r.add_argument("--new-tokens", type=int, default=None, help="default 64 on GPU, 16 on CPU")
    r.add_argument("--backend", choices=BACKENDS, default="dsv41",
                   help="default dsv41: compile, check the greedy tokens against eager, print the fusion report")
    r.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    r.add_argument("--weight-mode", choices=("checkpoint", "bf16"), default="checkpoint")
    r.add_argument("--dtype", choices=sorted(_DTYPES), default=None)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-check", dest="check", action="store_false", help="skip the eager token check")
    r.add_argument("--json", default=None, help="write the result JSON here")
    r.add_argument("--regional", action="store_true",
                   help="compile the embedding, each layer variant and the head as separate regions (faster compile)")
    r.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a dsv41 backend option (repeatable), VALUE as JSON where it parses: --option streams=false")
    r.add_argument("--speculative", action="store_true",
                   help="DSpark speculative decoding (greedy; the tokens must equal plain greedy eager)")
    r.add_argument("--simulate-acceptance", type=float, default=None, metavar="E",
                   help="with --speculative: BENCHMARK.md match-expected acceptance of mean length E (e.g. 5.5)")
    r.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (spawned, or one per torchrun process)")
    r.add_argument("--tp-moe", choices=("tp", "ep"), default="tp", help="MoE layout under --tp")
    r.add_argument("--tp-pad-to", type=int, default=None, help="per-rank expert inter padding multiple (default 128)")
    args = p.parse_args(argv)
    if args.cmd == "run":
        if args.tp is not None:
            if args.speculative:
                p.error("--speculative is not supported with --tp yet")
            from .launch import run_tp
            return run_tp(args)
        return _cmd_run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
