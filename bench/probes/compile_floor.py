"""Question: how much of a cold `tiny` compile on the CPU is torch's own front end, before any backend runs?

Issue [first-contact] asks for `tiny` on the CPU at <= 60 s cold. This probe compiles the same `tiny` decode step
(greedy `generate`, prompt 8, 3 new tokens) cold in a fresh process per backend, each with its own empty Inductor
cache, one after another:
  eager      Dynamo's capture only (the graph runs as traced),
  aot_eager  Dynamo + AOTAutograd (functionalisation, metadata), no code generated,
  inductor   plain Inductor,
  dsv41      dsv41 (its passes, then Inductor for what they leave).
For each: wall seconds of the first `generate` minus a later one, CPU seconds of the process and its compile
workers (user + system, so a loaded machine still gives comparable numbers), and torch's compile phases.
The first two rows are the floor under any backend that compiles through Dynamo and AOTAutograd.

Usage: python3 bench/probes/compile_floor.py [--json OUT] [--backends eager,aot_eager,inductor,dsv41]
A row may add one Inductor config change: `dsv41@cpp.vec_isa_ok=false` (scalar C++ kernels).
Answer: bench/results/<run>/compile_floor.json (see that run's README).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, os, resource, sys, time
import torch
from dsv41.cli import build_model
from dsv41.compile_stats import CompileClock
from dsv41.model.generate import generate
backend, _, patch = sys.argv[1].partition("@")
if patch:  # e.g. dsv41@cpp.vec_isa_ok=False: an Inductor config change for this row only
    import torch._inductor.config as ic
    key, _, val = patch.partition("=")
    ic.patch({key: json.loads(val.lower())}).__enter__()
torch.manual_seed(0)
model = build_model("tiny", "cpu")
prompt = torch.randint(0, model.config.vocab_size, (8,))
compiled = torch.compile(model, backend=backend)
clock = CompileClock()
t0 = time.perf_counter(); generate(compiled, prompt, 3); first = time.perf_counter() - t0
t0 = time.perf_counter(); generate(compiled, prompt, 3); again = time.perf_counter() - t0
out = clock.result(max(0.0, first - again))
print(json.dumps({"backend": sys.argv[1], "compile_s": round(first - again, 2), "phases_s": out.get("phases_s"),
                  "cache": out.get("cache")}))
"""


def main() -> None:
    """Run each backend's cold compile in its own process and print / write one JSON row per backend."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="eager,aot_eager,inductor,dsv41")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    for b in a.backends.split(","):
        d = tempfile.mkdtemp(prefix=f"floor-{b}-")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=d, TRITON_CACHE_DIR=os.path.join(d, "triton"))
        t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run([sys.executable, "-c", _CHILD, b], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("{")), None)
        row = json.loads(line) if line else {"backend": b, "error": r.stderr[-2000:]}
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        # The child and the compile workers it reaped: comparable between backends on a loaded machine.
        row["process_cpu_s"] = round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 1)
        row["process_wall_s"] = round(wall, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    load = os.getloadavg()
    res = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "loadavg_end": [round(x, 2) for x in load],
           "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
