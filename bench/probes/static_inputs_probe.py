"""Issue 37 probe: why `upcast_linear` takes the compressor's FP32 matmuls on CPU but not on CUDA (torch 2.11).

Compiles `tiny` region by region with `backend="dsv41"` (checkpoint weights, bf16) on the given device, decodes two
tokens, and for every post-grad graph records what `engine.static_inputs` saw (the AOT metadata's placeholder
count, input / token / RNG-state counts, `static_input_indices`, whether tangents exist) and what `upcast_linear`
matched or missed. The FP32-weight branch of `upcast_linear` needs `static_inputs` to say which placeholders are
parameters; a None there (metadata that does not describe the graph) leaves every FP32 matmul to cuBLAS.

    python3 bench/probes/static_inputs_probe.py OUT.json [device (cuda)]
"""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import dsv41.passes.engine.graph as eg  # noqa: E402
import dsv41.passes.upcast_linear as ul  # noqa: E402
from dsv41.harness import build_model, compile_model  # noqa: E402
from dsv41.model.generate import generate  # noqa: E402

out_path = sys.argv[1]
device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
seen = []
real = eg.static_inputs


def spy(graph):
    """Record the metadata static_inputs reads, then answer as it does."""
    from torch._guards import TracingContext
    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    got = real(graph)
    fp32_mms = [n.name for n in graph.nodes if n.op == "call_function" and n.target in
                (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    seen.append({
        "placeholders": len(placeholders), "meta": meta is not None,
        "input_info": len(getattr(meta, "input_info", ()) or ()),
        "tokens": repr(getattr(meta, "tokens", None))[:80],
        "rng_states": getattr(meta, "num_graphsafe_rng_states", None),
        "static_input_indices": list(getattr(meta, "static_input_indices", None) or [])[:64],
        "traced_tangents": bool(getattr(meta, "traced_tangents", None)),
        "static_inputs": None if got is None else len(got), "mms": fp32_mms[:12]})
    return got


ul.static_inputs = spy
model = build_model("tiny", device, "checkpoint", "bf16")
model.setup_cache(1, 64)
runner = compile_model(model, "dsv41", {}, regional=True)
generate(runner, torch.randint(0, model.config.vocab_size, (1, 8), device=device), 2)
import dsv41  # noqa: E402

recs = []
rep = dsv41.last_report()
for g in (rep.graphs if rep is not None else ()):
    for r in g.records:
        if r.family == "upcast_linear":
            recs.append({"graph": g.index, "matches": len(r.matches),
                         "misses": [(m.check, m.reason[:160]) for m in r.near_misses]})
json.dump({"device": device, "torch": torch.__version__, "graphs": seen, "upcast_linear": recs},
          open(out_path, "w"), indent=1)
for s in seen:
    print(s["placeholders"], s["input_info"], s["tokens"], s["rng_states"], len(s["static_input_indices"]),
          s["static_inputs"], s["mms"][:4], flush=True)
print(recs, flush=True)
