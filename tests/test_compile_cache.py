"""A second compile in a new process is served from the caches (issue [first-contact], compile time).

Two fresh interpreters compile the same small module with backend="dsv41" and `count_kernels` into one empty
Inductor cache directory. The second must see no Inductor FX-graph cache miss (torch's own counters,
`dsv41.compile_stats`), take its pass records from dsv41's record cache, and reuse the first one's profiled kernel
count instead of profiling again. (The same holds for `tiny`: `dsv41 run`'s JSON records `compile.cache` and
`served_from_cache`; a second `tiny` run measured 16.6 s of compile against 140 s cold on a 2-core CPU.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import json
import torch
from dsv41.cli import compile_model
from dsv41.compile_stats import CompileClock
from dsv41.compiler.report import last_report


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 32))
        self.register_buffer("cache", torch.zeros(4, 16))

    def forward(self, x, pos):
        h = torch.nn.functional.rms_norm(x, (32,), eps=1e-6) @ self.w.t()
        self.cache.index_copy_(0, pos, h)
        return torch.softmax(self.cache.sum(0) * 0.5, -1).sin()


torch.manual_seed(0)
model = Toy().eval()
clock = CompileClock()
fast = compile_model(model, "dsv41", {"count_kernels": True})
with torch.no_grad():
    fast(torch.randn(1, 32), torch.tensor([1]))
r = clock.result()
rep = last_report()
print("RESULT " + json.dumps({"cache": r["cache"], "served": r["served_from_cache"],
                              "from_cache": [g.from_cache for g in rep.graphs],
                              "count_s": [g.count_s for g in rep.graphs],
                              "kernels": [[g.kernels.before, g.kernels.after] for g in rep.graphs]}))
'''


def _compile_in_a_new_process(tmp_path) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env.pop("DSV41_REPORT", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_a_second_process_is_served_from_the_caches_without_an_fx_graph_miss(tmp_path):
    cold = _compile_in_a_new_process(tmp_path)
    assert cold["cache"]["fxgraph_miss"] >= 1 and not cold["served"] and cold["from_cache"] == [False]
    assert cold["count_s"][0] > 0  # profiled once
    warm = _compile_in_a_new_process(tmp_path)
    assert warm["cache"]["fxgraph_miss"] == 0 and warm["cache"]["fxgraph_hit"] >= 1, warm
    assert warm["served"] and warm["from_cache"] == [True]
    assert warm["count_s"] == [0.0] and warm["kernels"] == cold["kernels"]  # the kept count, not profiled again
