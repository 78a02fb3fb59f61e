"""Child-process script (not a test module): the `tiny` model through `backend="dsv41"` in a fresh interpreter.

Run as `python tests/fresh_tiny_dsv41.py OUT.json [N]` by the session fixture `tiny_dsv41` (tests/conftest.py).
It builds `tiny` (float32, checkpoint weights, seed 0), generates N greedy tokens (default 32) from the 40-token
benchmark prompt eagerly and through `torch.compile(model, backend="dsv41", fullgraph=True)` (prefill eager,
decode compiled, as `generate` does), computes the teacher-forced logits of both along eager's tokens, and
writes tokens, logit errors, the fusion report (debug: graphs before/after the passes), the number of Dynamo
graphs and whether dsv41's compiler was imported before the compile.

The SAME compiled model then decodes from a SHORT prompt (`SHORT_PROMPT` = 5 tokens, `SHORT_NEW` = 12 new tokens:
the context starts below tiny's sliding_window = 16 and index_topk = 8 and crosses both, so the decode graph sees
empty ring slots and -1 selections), recorded as `short_eager_tokens`, `short_compiled_tokens`,
`short_max_rel_logit_error` and `short_teacher_forced_argmax_equal` (teacher-forced along eager's tokens, like the
long keys), and `short_new_graphs`: Dynamo graphs compiled by the short run (0 when the static decode graph is
reused: the cache is reset in place, positions are tensors).

Then the chunked compiled prefill (issue [prefill]): `generate(compiled_prefill=True, prefill_chunks=CHUNKS)` on the
40-token prompt (`chunked_compiled_tokens`), the last prompt position's logits of `prefill(compiled, ...)` against
one eager call over the whole prompt (`chunked_prefill_max_rel_logit_error`, relative to the largest |logit|), and
`chunked_new_graphs` (1: the 16-token chunk; the 1-token chunks reuse the decode graph). `report` and
`unique_graphs` are the decode graph's, taken before. The package `dsv41` itself is imported
(the model lives there) but never its compiler: the backend must be found through the entry point.
"""

import json
import sys
import time

import torch

assert "dsv41" not in sys.modules
out_path = sys.argv[1]
n_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 32

from dsv41.model import DeepseekV41Flash, ModelConfig, benchmark_prompt, generate  # noqa: E402

cfg = ModelConfig.preset("tiny")
model = DeepseekV41Flash(cfg, "checkpoint", torch.float32).init_random(0).eval()
prompt = benchmark_prompt(cfg, 40)
#: Short-prompt run: 5 tokens < sliding_window (16) and < index_topk (8); 12 new tokens cross both.
SHORT_PROMPT, SHORT_NEW = 5, 12
#: Chunk sizes of the compiled chunked prefill of the 40-token prompt: 16, 16, then eight 1-token chunks.
CHUNKS = (16, 1)
compiler_imported_before = "dsv41.compiler" in sys.modules

with torch.no_grad():
    eager = generate(model, prompt, n_tokens)
    compiled = torch.compile(model, backend="dsv41", fullgraph=True, dynamic=False, options={"debug": True})
    t0 = time.perf_counter()
    got = generate(compiled, prompt, n_tokens)
    compile_and_decode_s = time.perf_counter() - t0
    from dsv41.bench import teacher_forced_logits  # noqa: E402  (after the compile: no compiler import before)
    ref = teacher_forced_logits(model, prompt, eager.tokens).double()
    tf = teacher_forced_logits(compiled, prompt, eager.tokens).double()
    graphs_before_short = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    short_prompt = benchmark_prompt(cfg, SHORT_PROMPT)
    short_eager = generate(model, short_prompt, SHORT_NEW)
    short_got = generate(compiled, short_prompt, SHORT_NEW)
    short_ref = teacher_forced_logits(model, short_prompt, short_eager.tokens).double()
    short_tf = teacher_forced_logits(compiled, short_prompt, short_eager.tokens).double()
    short_new_graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - graphs_before_short
    unique_graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])  # before the chunked prefill's
    import dsv41  # noqa: E402

    # The decode graph's report, as JSON now: the chunked prefill below compiles one more graph into the same report.
    report = dsv41.last_report().to_dict()
    # Chunked compiled prefill (issue [prefill]): chunks of 16 and 1 tokens, the 1-token ones through the decode graph.
    from dsv41.model.prefill import prefill  # noqa: E402
    graphs_before_chunked = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    chunked = generate(compiled, prompt, n_tokens, compiled_prefill=True, prefill_chunks=CHUNKS)
    ids = prompt.reshape(1, -1)
    positions = torch.arange(ids.shape[1])[None]
    model.reset_cache()
    prefill_ref = model(ids, positions, last_only=True)[:, -1].double()
    model.reset_cache()
    prefill_got = prefill(compiled, ids, positions, CHUNKS)[:, -1].double()
    chunked_new_graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - graphs_before_chunked
scale = ref.abs().amax(-1)
result = {
    "compiler_imported_before_compile": compiler_imported_before,
    "compiler_imported_after_compile": "dsv41.compiler" in sys.modules,
    "eager_tokens": eager.tokens.tolist(),
    "compiled_tokens": got.tokens.tolist(),
    "max_rel_logit_error": float(((tf - ref).abs().amax(-1) / scale).max()),
    "teacher_forced_argmax_equal": bool(torch.equal(tf.argmax(-1), ref.argmax(-1))),
    "unique_graphs": unique_graphs,
    "compile_and_decode_s": compile_and_decode_s,
    "short_prompt_len": SHORT_PROMPT,
    "short_eager_tokens": short_eager.tokens.tolist(),
    "short_compiled_tokens": short_got.tokens.tolist(),
    "short_max_rel_logit_error": float(((short_tf - short_ref).abs().amax(-1) / short_ref.abs().amax(-1)).max()),
    "short_teacher_forced_argmax_equal": bool(torch.equal(short_tf.argmax(-1), short_ref.argmax(-1))),
    "short_new_graphs": short_new_graphs,
    "chunked_compiled_tokens": chunked.tokens.tolist(),
    "chunked_prefill_max_rel_logit_error": float((prefill_got - prefill_ref).abs().max() / prefill_ref.abs().max()),
    "chunked_new_graphs": chunked_new_graphs,
    "report": report,
}
with open(out_path, "w") as f:
    json.dump(result, f, default=str)
print("wrote", out_path, f"{compile_and_decode_s:.1f} s")
