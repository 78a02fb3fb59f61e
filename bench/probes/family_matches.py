"""What every pass family matched and missed on one model compile, as canonical JSON for a before/after diff.

    PYTHONPATH=. python bench/probes/family_matches.py OUT.json [--preset tiny] [--tokens 2]

Question it answers: does a refactor of the passes change behaviour? It compiles the preset (checkpoint weights,
FP32, seed 0) with backend="dsv41" in a fresh Inductor cache (so the passes run), decodes a few tokens, and writes,
per graph and family, the matches (pattern, op, source line, nodes replaced, byte expressions, detail) and the
near-misses (pattern, check, reason, source line), plus the generated tokens. Diff two outputs with `diff`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tokens", type=int, default=2)
    a = p.parse_args(argv)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsv41_fm_")
    os.environ.setdefault("DSV41_STRICT", "1")
    import torch

    import dsv41
    from dsv41.model import DeepseekV41Flash, ModelConfig, benchmark_prompt, generate

    torch.set_num_threads(1)
    cfg = ModelConfig.preset(a.preset)
    model = DeepseekV41Flash(cfg, "checkpoint", torch.float32).init_random(0).eval()
    prompt = benchmark_prompt(cfg, 40)
    with torch.no_grad():
        compiled = torch.compile(model, backend="dsv41", fullgraph=True, dynamic=False)
        tokens = generate(compiled, prompt, a.tokens).tokens.tolist()
    rep = dsv41.last_report()

    def where(loc):
        """`basename:line` of a source location (None stays None)."""
        return None if loc is None else f"{os.path.basename(loc.file)}:{loc.line}"

    graphs = []
    for g in rep.graphs:
        fams = {}
        for r in g.records:
            fams[r.family] = {
                "matches": [{"pattern": m.pattern, "op": m.op, "at": where(m.location), "nodes": len(m.nodes_replaced),
                             "ops": list(m.ops_replaced), "bytes": [m.bytes_before, m.bytes_after],
                             "detail": [list(map(str, kv)) for kv in m.detail]} for m in r.matches],
                "near_misses": [{"pattern": n.pattern, "check": n.check, "reason": n.reason, "at": where(n.location)}
                                for n in r.near_misses],
                "findings": [{"kind": f.kind, "message": f.message, "at": where(f.location)} for f in r.findings],
            }
        graphs.append(fams)
    with open(a.out, "w") as f:
        json.dump({"preset": a.preset, "tokens": tokens, "graphs": graphs}, f, indent=1, sort_keys=True)
    for gi, fams in enumerate(graphs):
        print(f"graph {gi}: " + ", ".join(f"{k} {len(v['matches'])}m/{len(v['near_misses'])}nm"
                                          for k, v in fams.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
