"""Static launch counts of h200 decode (regional, shared weights, CPU compile) with and without the op census.

    mkdir -p /tmp/h200census && TORCHINDUCTOR_CACHE_DIR=<empty dir> python3 bench/probes/census_h200_cpu.py

29 min on 2 cores; writes /tmp/h200census/out.json. Results: bench/results/2026-12-01_cpu_census/README.md."""
import json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # dsv41 from this checkout
import torch
import dsv41
from dsv41.compiler import kernel_counts as kc
import dsv41.compiler.pipeline as pl
saved = []
orig = kc.count_captured
def spy(capture, from_cache=False):
    for src, prov, gm in zip(capture.sources, capture.provenance, capture.graphs):
        if from_cache: print("CACHE HIT: no post-grad graph", flush=True); continue
        a = kc.count_launches(src, prov, gm.graph, capture.dynamo_layers, op_census=False)
        b = kc.count_launches(src, prov, gm.graph, capture.dynamo_layers, op_census=True)
        la = {}
        for x in kc.parse_launches(src, prov): la[x.kernel] = la.get(x.kernel, 0) + 1
        lb = {}
        for x in kc._census_sites(kc.parse_launches(src, prov), gm.graph, True)[0]: lb[x.kernel] = lb.get(x.kernel, 0) + 1
        diff = {k: (la.get(k, 0), v) for k, v in lb.items() if la.get(k, 0) != v}
        rec = {"graph": len(saved), "without": a.total, "with": b.total, "note": b.note, "diff": diff,
               "layers": [k for k, _ in a.by_layer]}
        print(json.dumps(rec), flush=True)
        saved.append(rec)
    return orig(capture, from_cache)
pl.graph_counts.__globals__['count_captured'] = spy
from dsv41.precompile import blocks_sharing_weights
# Diagnostic only: shared weights are initialised once (40 layers would re-fill the same tensors 40 times).
import inspect
import dsv41.model.linear, dsv41.model.moe, dsv41.model.engram
_seen = set()
for mod in (dsv41.model.linear, dsv41.model.moe, dsv41.model.engram):
    for _n, cls in inspect.getmembers(mod, inspect.isclass):
        f = cls.__dict__.get("init_random")
        if f is None:
            continue
        def wrap(self, *a, _f=f, **k):
            key = tuple(id(p) for p in self.parameters(recurse=False)) or (id(self),)
            if key in _seen:
                return None
            _seen.add(key)
            return _f(self, *a, **k)
        cls.init_random = wrap
from dsv41.cli import build_model, compile_model
from dsv41.model import generate
t0 = time.time()
with blocks_sharing_weights():
    model = build_model("h200", "cpu", "checkpoint", "bf16", seed=0)
model.setup_cache(1, 192)
print("built", time.time() - t0, flush=True)
runner = compile_model(model, "dsv41", None, regional=True)
prompt = torch.tensor([[5]], dtype=torch.int64)
with torch._dynamo.config.patch(cache_size_limit=64):
    out = generate(runner, prompt, 3)
print("done", time.time() - t0, flush=True)
json.dump(saved, open("/tmp/h200census/out.json", "w"), indent=1)
