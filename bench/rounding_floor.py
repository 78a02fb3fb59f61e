"""The rounding noise floor of the bench's `max_rel_logit_err`: eager in one dtype against eager in another, same
weights, teacher-forced on the first dtype's greedy tokens.

    python3 bench/rounding_floor.py [--preset small] [--device cpu] [--prompt-len 128] [--new-tokens 16]
                                    [--dtypes bf16,fp32] [--json F]

A backend's error against eager bf16 (`dsv41.bench` column "max rel logit err") can only be read against what
rounding alone does to the same model. This script measures that with no compiler involved: the model is built
twice from one seed (`dsv41.cli.build_model`), the first dtype decodes greedily, both are teacher-forced on those
tokens (`dsv41.bench.teacher_forced_logits`), and the error is `dsv41.bench.max_rel_logit_err` (max |a - b| /
max |b| over all decode steps), also per step, with the two argmaxes. 2026-11-30, CPU: `small` bf16 vs fp32
gives 0.72 (bench/results/2026-11-30_h200_s9/rounding_floor_small_cpu.json), where dsv41 and plain Inductor
measure 0.62-0.65 against eager bf16 on the H200.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def rounding_floor(preset: str, device: str, prompt_len: int, new_tokens: int, dtypes: tuple[str, str],
                   seed: int = 0) -> dict:
    """Teacher-forced relative logit error of eager `dtypes[1]` against eager `dtypes[0]` (see the module docstring).

    Returns {"preset", "device", "dtypes", "prompt_len", "new_tokens", "tokens" (greedy, first dtype),
    "max_rel_logit_err", "per_step" [{"step", "rel_err", "argmax_a", "argmax_b"}], "seconds"}.
    Raises ValueError for new_tokens < 2 or an unknown preset / dtype (from build_model).
    """
    import torch

    from dsv41.bench import max_rel_logit_err, teacher_forced_logits
    from dsv41.cli import build_model
    from dsv41.model import generate
    from dsv41.model.generate import benchmark_prompt

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (one decode step), got {new_tokens}")
    t0 = time.perf_counter()
    with torch.no_grad():
        first = build_model(preset, device, "checkpoint", dtypes[0], seed)
        prompt = benchmark_prompt(first.config, prompt_len, device=device)
        tokens = generate(first, prompt, new_tokens).tokens
        ref = teacher_forced_logits(first, prompt, tokens)
        del first
        second = build_model(preset, device, "checkpoint", dtypes[1], seed)
        got = teacher_forced_logits(second, prompt, tokens)
    steps = [{"step": i, "rel_err": max_rel_logit_err(got[:, i], ref[:, i]), "argmax_a": int(ref[0, i].argmax()),
              "argmax_b": int(got[0, i].argmax())} for i in range(ref.shape[1])]
    return {"preset": preset, "device": device, "dtypes": list(dtypes), "prompt_len": prompt_len,
            "new_tokens": new_tokens, "tokens": tokens.tolist(), "max_rel_logit_err": max_rel_logit_err(got, ref),
            "per_step": steps, "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--dtypes", default="bf16,fp32", help="reference dtype, compared dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dtypes = tuple(a.dtypes.split(","))
    if len(dtypes) != 2:
        ap.error(f"--dtypes takes two comma-separated dtypes, got {a.dtypes!r}")
    out = rounding_floor(a.preset, a.device, a.prompt_len, a.new_tokens, dtypes, a.seed)
    import torch
    out["torch"] = torch.__version__
    for s in out["per_step"]:
        print(f"step {s['step']:3d}: rel err {s['rel_err']:.4f}  argmax {s['argmax_a']} / {s['argmax_b']}")
    print(f"{a.preset} on {a.device}: eager {dtypes[1]} vs eager {dtypes[0]}, teacher-forced: max rel logit err "
          f"{out['max_rel_logit_err']:.4f} ({out['seconds']:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
