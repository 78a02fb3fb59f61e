"""Decode with the grouped FP4 expert GEMV on the word-decode tensor-core kernel (dsv41/kernels/grouped_mma.py).

Reads the grouped sweep of `bench/kernels.py --sweep --only grouped_w1w3 grouped_w2` (JSON), takes the `mma_words`
configuration with the least summed time over the two h200 decode shapes, makes it the default plan and
`grouped_gemv.MMA_WORDS_DEFAULT` True in this process, and runs `dsv41 bench` with the remaining arguments (the
compile happens in this process, so the kernel choice applies). Compare the decode tok/s with a run of the same
command line without this wrapper.

    python3 bench/grouped_e2e.py SWEEP.json -- --preset small --backends dsv41 ... --json OUT.json

The chosen configuration and its sweep times are printed and written under `grouped_mma_config` in the JSON.
Exits 3 when no mma_words configuration of the sweep has rows for both shapes.
"""

from __future__ import annotations

import json
import os
import sys


def best_config(rows: list) -> tuple[dict, dict]:
    """(plan overrides, {shape: us}) of the mma_words sweep configuration with the least summed time."""
    times: dict = {}
    for r in rows:
        if r.get("kernel") == "grouped_linear_fp4" and r["variant"].startswith("sweep mma_words"):
            times.setdefault(r["variant"], {})[r["shape"]] = r["time_us"]
    full = {v: t for v, t in times.items() if len(t) == 2}
    if not full:
        return {}, {}
    label = min(full, key=lambda v: sum(full[v].values()))
    cfg = {}
    for tok in label.split()[2:]:
        key, _, val = tok.partition("=")
        cfg[key] = int(val)
    return cfg, full[label]


def main(argv=None) -> int:
    """See the module docstring."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sweep_path, rest = argv[0], argv[argv.index("--") + 1:] if "--" in argv else []
    with open(sweep_path) as f:
        cfg, times = best_config(json.load(f)["rows"])
    if not cfg:
        print("no mma_words rows in the sweep", file=sys.stderr)
        return 3
    from dsv41.kernels import grouped_gemv, grouped_mma
    grouped_mma._BLOCK_N = cfg.get("block_n", grouped_mma._BLOCK_N)
    grouped_mma._BLOCK_K = cfg.get("block_k", grouped_mma._BLOCK_K)
    grouped_mma._STAGES = cfg.get("stages", grouped_mma._STAGES)
    grouped_mma._PROGRAMS_PER_SM = cfg.get("programs_per_sm", grouped_mma._PROGRAMS_PER_SM)
    grouped_mma._NUM_WARPS = cfg.get("num_warps")
    grouped_gemv.MMA_WORDS_DEFAULT = True
    print(f"grouped_mma config {cfg}, sweep times (us) {times}")
    from dsv41.bench import main as bench_main
    rc = bench_main(rest)
    if "--json" in rest and os.path.exists(rest[rest.index("--json") + 1]):
        path = rest[rest.index("--json") + 1]
        with open(path) as f:
            doc = json.load(f)
        doc["grouped_mma_config"] = dict(config=cfg, sweep_us=times)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
