"""The decode benchmark of BENCHMARK.md: backends side by side in one process, alternated run by run.

`python -m dsv41.bench --preset small --backends eager,inductor,dsv41` (also `dsv41 bench`). Every backend
gets the same prompt (seed 42); one warm-up run per backend (its wall time is the cold compile + first
run), then `--repeats` measured rounds in the order A B C A B C ...; caches are reset in place between runs.
The roofline is the decode step's byte floor (`budget().decode_weight_bytes` + KV read at the context)
divided by the device-to-device copy bandwidth measured in the same run.

Result JSON (schema; `null` where not measured, with a `note`): top level `date`, `gpu`, `driver`, `torch`,
`triton`, `cuda`, `preset`, `weight_mode`, `prompt_len`, `new_tokens`, `copy_bandwidth_tb_s`,
`decode_bytes_per_step`, `roofline_tok_s`, `backends` = {name: {`decode_tok_s`: {median, min, max},
`prefill_tok_s`: {median, min, max}, `kernels_per_step`, `roofline_fraction`, `compile_s`, `peak_mem_gb`,
`tokens_match_eager`, `max_rel_logit_err`, `note`}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

__all__ = ["summarize", "alternation_order", "copy_bandwidth_tb_s", "roofline", "run_benchmark", "main"]


def summarize(values) -> dict:
    """{median, min, max} of a non-empty sequence of floats. Raises ValueError when empty."""
    values = list(values)
    if not values:
        raise ValueError("summarize() needs at least one value")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def alternation_order(backends, repeats: int):
    """Run order A B C A B C ... (`repeats` rounds), as BENCHMARK.md asks, so drift hits every backend alike."""
    return [b for _ in range(repeats) for b in backends]


def copy_bandwidth_tb_s(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second, TB/s) on the current CUDA device."""
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


def roofline(decode_bytes: float, bandwidth_tb_s: float) -> float:
    """Tokens/s bound of a decode step that must read `decode_bytes` at `bandwidth_tb_s` (TB/s)."""
    return bandwidth_tb_s * 1e12 / decode_bytes


def run_benchmark(preset: str, backends, prompt_len: int, new_tokens: int, repeats: int = 5,
                  weight_mode: str = "checkpoint", device: str | None = None, options: dict | None = None) -> dict:
    """Run the protocol and return the result dict (schema in the module docstring)."""
    from rich.progress import Progress

    from .cli import build_model, compile_model, environment
    from .model import benchmark_prompt, generate
    from .model.budget import budget, decode_kv_read_bytes

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    model = build_model(preset, device, weight_mode)
    prompt = benchmark_prompt(model.config, prompt_len, device=device)
    b = budget(model.config, max_seq_len=prompt_len + new_tokens)
    ctx = prompt_len + new_tokens // 2
    decode_bytes = b.decode_weight_bytes + decode_kv_read_bytes(model.config, ctx)
    res = {**environment(device), "preset": preset, "weight_mode": weight_mode, "prompt_len": prompt_len,
           "new_tokens": new_tokens, "decode_bytes_per_step": decode_bytes, "backends": {}}
    cuda = device.startswith("cuda")
    res["copy_bandwidth_tb_s"] = copy_bandwidth_tb_s() if cuda else None
    res["roofline_tok_s"] = roofline(decode_bytes, res["copy_bandwidth_tb_s"]) if cuda else None

    runners, runs, eager_tokens = {}, {}, None
    with Progress(transient=True) as prog:
        task = prog.add_task("compile + warm-up", total=len(backends))
        for name in backends:
            entry = res["backends"][name] = {"note": None}
            try:
                runners[name] = compile_model(model, name, options if name == "dsv41" else None)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                out = generate(runners[name], prompt, new_tokens)
                entry["compile_s"] = time.perf_counter() - t0
                entry["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
                if name == "eager":
                    eager_tokens = out.tokens
                runs[name] = []
            except Exception as e:  # a backend that fails is reported, never silently dropped
                entry["note"] = f"failed: {type(e).__name__}: {e}"[:500]
            prog.advance(task)
        order = [n for n in alternation_order(backends, repeats) if n in runners]
        task = prog.add_task("measured runs", total=len(order))
        for name in order:
            runs[name].append(generate(runners[name], prompt, new_tokens))
            prog.advance(task)
    for name, outs in runs.items():
        entry = res["backends"][name]
        entry["decode_tok_s"] = summarize(o.decode_tok_s for o in outs)
        entry["prefill_tok_s"] = summarize(o.prefill_tok_s for o in outs)
        entry["tokens_match_eager"] = (None if eager_tokens is None
                                       else all(torch.equal(o.tokens, eager_tokens) for o in outs))
        entry["roofline_fraction"] = (entry["decode_tok_s"]["median"] / res["roofline_tok_s"]
                                      if res["roofline_tok_s"] else None)
        entry.setdefault("kernels_per_step", None)
        if name == "dsv41":
            import dsv41
            rep = dsv41.last_report()
            if rep is not None:
                entry["report"] = rep.to_dict()
    return res


def _print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"decode benchmark: {res['preset']} ({res['weight_mode']}), prompt {res['prompt_len']}, "
                    f"{res['new_tokens']} new tokens, {res.get('gpu') or 'cpu'}")
    for col in ("backend", "decode tok/s (median [min, max])", "prefill tok/s", "roofline fraction", "compile s",
                "matches eager", "note"):
        t.add_column(col)
    for name, e in res["backends"].items():
        d = e.get("decode_tok_s")
        t.add_row(name, f"{d['median']:.2f} [{d['min']:.2f}, {d['max']:.2f}]" if d else "-",
                  f"{e['prefill_tok_s']['median']:.0f}" if e.get("prefill_tok_s") else "-",
                  f"{e['roofline_fraction']:.3f}" if e.get("roofline_fraction") else "-",
                  f"{e['compile_s']:.1f}" if e.get("compile_s") else "-", str(e.get("tokens_match_eager")),
                  e.get("note") or "")
    Console().print(t)
    if res.get("roofline_tok_s"):
        Console().print(f"roofline: {res['decode_bytes_per_step'] / 1e9:.3f} GB/step at "
                        f"{res['copy_bandwidth_tb_s']:.2f} TB/s copy bandwidth = {res['roofline_tok_s']:.1f} tok/s")


def main(argv=None) -> int:
    """CLI of the benchmark (`python -m dsv41.bench`, `dsv41 bench`)."""
    p = argparse.ArgumentParser(prog="dsv41 bench", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None)
    p.add_argument("--backends", default="eager,inductor,dsv41")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--weight-mode", default="checkpoint")
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    cuda = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    res = run_benchmark(a.preset or ("small" if cuda else "tiny"), a.backends.split(","),
                        a.prompt_len or (4096 if cuda else 32), a.new_tokens or (1024 if cuda else 8), a.repeats,
                        a.weight_mode, a.device)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    _print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
