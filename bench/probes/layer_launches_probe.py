"""Issue 37 probe: what each decoder layer launches, in program order, on this device.

Compiles a preset region by region with `backend="dsv41"` (checkpoint weights, bf16), decodes a few tokens, and
for every compiled graph lists its launches from the generated wrapper (`kernel_counts.parse_launches`): dsv41 ops,
library calls and Inductor kernels, each Inductor kernel with its origins (user source lines and ATen ops of its
post-grad nodes, `kernel_counts.kernel_origins`). On CUDA this is the list the step's Inductor glue is read from
(the profiler gives only kernel names, and regional graphs reuse them).

    python3 bench/probes/layer_launches_probe.py OUT.json [preset (tiny)] [device (cuda)] [options JSON ({})]

Also writes, per family of the fusion report, its matches, the ops it emitted and its near-misses (graph, check,
reason): what a device-specific miss is read from.
"""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import dsv41.compiler.pipeline as pl  # noqa: E402
from dsv41.compiler import kernel_counts as kc  # noqa: E402
from dsv41.harness import build_model, compile_model  # noqa: E402
from dsv41.model.generate import generate  # noqa: E402

out_path = sys.argv[1]
preset = sys.argv[2] if len(sys.argv) > 2 else "tiny"
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
graphs = []
count_captured = kc.count_captured


def spy(capture, from_cache=False):
    """Record each captured graph's launches, then count as the pipeline does."""
    for src, prov, gm in zip(capture.sources, capture.provenance, capture.graphs):
        if src is None:
            continue
        launches = kc.parse_launches(src, prov)
        origins = dict(kc.kernel_origins(launches, gm.graph))
        graphs.append([{"kernel": x.kernel, "kind": x.kind, "origins": list(origins.get(x.kernel, ()))}
                       for x in launches])
    return count_captured(capture, from_cache)


pl.graph_counts.__globals__["count_captured"] = spy
model = build_model(preset, device, "checkpoint", "bf16")
model.setup_cache(1, 64)
runner = compile_model(model, "dsv41", {"count_kernels": True, **options}, regional=True)
generate(runner, torch.randint(0, model.config.vocab_size, (1, 8), device=device), 3)
import dsv41  # noqa: E402

# What each family took and why the rest did not fuse on this device (the near-misses name the failed check).
rep = dsv41.last_report()
families = {}
if rep is not None:
    for name in rep.family_names():
        f = rep.family(name)
        families[name] = {"enabled": f["enabled"], "matches": f["matches"], "note": f["note"],
                          "ops": sorted({s["op"] for s in f["sites"]}),
                          "near_misses": [{k: m[k] for k in ("graph", "check", "reason")} for m in f["near_misses"]],
                          "findings": [{k: x[k] for k in ("graph", "kind", "message")} for x in f["findings"]]}
json.dump({"preset": preset, "device": device, "options": options, "roles": model.config.roles, "torch": torch.__version__,
           "graphs": graphs, "families": families}, open(out_path, "w"), indent=1)
for name, f in families.items():
    print(f"{name}: {f['matches']} matches, {len(f['near_misses'])} near-misses "
          f"{sorted({m['check'] for m in f['near_misses']})}", flush=True)
for i, g in enumerate(graphs):
    glue = sum(1 for x in g if x["kind"] not in ("op", "extern"))
    print(f"graph {i}: {len(g)} launches, {glue} Inductor", flush=True)
