"""Child-process script (not a test module): DSpark speculative decoding of `tiny` through `backend="dsv41"`.

Run as `python tests/fresh_tiny_dspark.py OUT.json [N]` by the module fixture of tests/test_dspark.py. It builds
`tiny` (float32, checkpoint weights, seed 0) and, from the 40-token benchmark prompt, decodes N tokens (default
64): plain greedy eagerly (the reference), then speculative through
`torch.compile(model, backend="dsv41", fullgraph=True, dynamic=False)` with the real drafter (eager) and with an
oracle drafter (tests/dspark_helpers.py) whose schedule makes every acceptance length occur (the eager speculative
runs are tests/test_dspark.py's own). Only the verify
forward (block + 1 rows) is ever compiled: prefill and drafter run eagerly, no M = 1 decode step is compiled
(tests/fresh_tiny_dsv41.py covers that graph), so this is one Dynamo graph and one Inductor compile.
It also runs one verify round eagerly and compiled from the same cache state and records the logit error and
whether every cache is bit-identical afterwards (after the rollback too).
Writes tokens, acceptance lengths, Dynamo graph count, timings and the fusion report (families per graph).
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
out_path = sys.argv[1]
n_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 64

from dspark_helpers import OracleDrafter  # noqa: E402
from dsv41.model import DeepseekV41Flash, ModelConfig, benchmark_prompt, generate  # noqa: E402
from dsv41.model.speculative import CacheJournal  # noqa: E402

cfg = ModelConfig.preset("tiny")
model = DeepseekV41Flash(cfg, "checkpoint", torch.float32).init_random(0).eval()
prompt = benchmark_prompt(cfg, 40)
k = cfg.dspark_block_size
schedule = list(range(k + 1)) * 2 + [k, 0, 1]


def buffers(m):
    return {n: b.clone() for n, b in m.named_buffers() if b is not None}


T0 = time.perf_counter()


def say(msg):
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


with torch.no_grad():
    plain = generate(model, prompt, n_tokens)
    ref = torch.cat((prompt, plain.tokens), dim=1)
    say("eager plain greedy done")

    compiled = torch.compile(model, backend="dsv41", fullgraph=True, dynamic=False)
    t0 = time.perf_counter()
    spec = generate(compiled, prompt, n_tokens, speculative=True)
    compile_and_decode_s = time.perf_counter() - t0
    say("compiled speculative done (compile included)")
    oracle = OracleDrafter(ref, k, schedule, cfg.vocab_size)
    spec_oracle = generate(compiled, prompt, n_tokens, speculative=True, drafter=oracle)
    say("compiled speculative with the oracle drafter done")
    graphs_generate = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    # One verify round from the same state, eager vs compiled (4 rows: the plain continuation, 2 wrong at the end).
    model.reset_cache()  # same buffers: a new allocation would be a Dynamo guard failure (recompile)
    p = prompt.shape[1]
    model(prompt, torch.arange(p)[None])
    # Standard strides, as generate's rows: a [1, 4] slice keeps the stride of its parent (a Dynamo guard).
    rows = ref[:, p:p + k + 1].clone(memory_format=torch.contiguous_format)
    rows[:, -1] = (rows[:, -1] + 1) % cfg.vocab_size
    pos = torch.arange(p, p + k + 1)[None]
    snap = buffers(model)
    j = CacheJournal(model, pos)
    le, fe = model(rows, pos, return_features=True)
    j.rollback(torch.tensor([k]))
    after_eager = buffers(model)
    for n, b in model.named_buffers():
        if b is not None:
            b.copy_(snap[n])
    j = CacheJournal(model, pos)
    lc, fc = compiled(rows, pos, return_features=True)
    j.rollback(torch.tensor([k]))
    after_compiled = buffers(model)
    scale = le.abs().amax(-1)
    # The compressor trails are scratch rows (read only at rollback); every other buffer must match bit for bit.
    say("one verify round eager vs compiled done")
    differ = sorted(n for n in after_eager if "trail" not in n and not torch.equal(after_eager[n], after_compiled[n]))

import dsv41  # noqa: E402

report = dsv41.last_report()
result = {
    "plain_tokens": plain.tokens.tolist(),
    "spec_tokens": spec.tokens.tolist(),
    "spec_oracle_tokens": spec_oracle.tokens.tolist(),
    "acceptance": spec.acceptance,
    "oracle_acceptance": spec_oracle.acceptance,
    "oracle_expected": oracle.expected[:len(spec_oracle.acceptance)],
    "mean_acceptance": spec.mean_acceptance,
    "verify_max_rel_logit_error": float(((lc - le).abs().amax(-1) / scale).max()),
    "verify_argmax_equal": bool(torch.equal(lc.argmax(-1), le.argmax(-1))),
    "verify_features_max_abs_error": float((fc - fe).abs().max()),
    "caches_differing_after_rollback": differ,
    "unique_graphs_generate": graphs_generate,
    "unique_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
    "compile_and_decode_s": compile_and_decode_s,
    "report": report.to_dict() if report is not None else None,
}
with open(out_path, "w") as f:
    json.dump(result, f, default=str)
print("wrote", out_path, f"{compile_and_decode_s:.1f} s")
