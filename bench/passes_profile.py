"""Where dsv41's post-grad passes spend a compile: cProfile around `PassManager.__call__` on one model compile.

    python bench/passes_profile.py [--preset small] [--device cpu] [--top 45]

Builds the preset (checkpoint weights, seed 0), compiles it with backend="dsv41" (whole model), decodes two tokens,
then prints the compile + run wall time, each family's `pass_seconds` from the fusion report, and the profile of
the passes alone (cumulative, then own time). Use an empty TORCHINDUCTOR_CACHE_DIR: a compile served from Inductor's
caches runs no passes. Only the passes are profiled, so Dynamo and Inductor run at full speed.
Results: bench/results/2026-11-30_cpu_precompile/passes_profile_small_*.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--top", type=int, default=45, help="rows of each profile table")
    a = p.parse_args(argv)

    import dsv41
    from dsv41.cli import build_model
    from dsv41.model import benchmark_prompt, generate
    from dsv41.passes import manager

    prof = cProfile.Profile()
    orig = manager.PassManager.__call__

    def profiled(self, graph):
        prof.enable()
        try:
            return orig(self, graph)
        finally:
            prof.disable()

    manager.PassManager.__call__ = profiled
    try:
        model = build_model(a.preset, a.device, "checkpoint", None)
        prompt = benchmark_prompt(model.config, a.prompt_len, device=a.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            generate(torch.compile(model, backend="dsv41"), prompt, 2)
        print(f"compile + run: {time.perf_counter() - t0:.1f} s")
    finally:
        manager.PassManager.__call__ = orig
    fams = dsv41.last_report().to_dict()["families"]
    print("pass seconds:", {f: round(v["pass_seconds"], 2) for f, v in fams.items()},
          f"total {sum(v['pass_seconds'] for v in fams.values()):.1f}")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(a.top)
    stats.sort_stats("tottime").print_stats(max(10, a.top // 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
