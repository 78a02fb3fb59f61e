"""The decode-versus-context sweep of `dsv41 bench --contexts` (BENCHMARK.md "Context sweep"): decode from caches
filled with random valid rows up to a context, no prefill.

Public names: `decode_from_context`, `context_sweep` (both also importable from `dsv41.bench`).
"""

from __future__ import annotations

import torch

from .bench_protocol import fail_text, roofline

__all__ = ["decode_from_context", "context_sweep"]


def decode_from_context(runner, model, context: int, n_tokens: int, cuda: bool, seed: int = 0) -> dict:
    """Decode `n_tokens` greedy steps from position `context` after `fill_synthetic_context(model, context)`.

    The caches hold random valid rows for positions [0, context) (see `dsv41.model.synthetic`), so no prefill
    runs; the first step starts from the benchmark prompt's first token id. Returns {"decode_tok_s": steps after
    the first / their seconds (CUDA events on GPU), "tokens": int64 [B, n_tokens]}.
    Raises: ValueError for n_tokens < 2 or a context the cache cannot hold (`fill_synthetic_context`).
    """
    from .model import benchmark_prompt
    from .model.results import Clock
    from .model.synthetic import fill_synthetic_context

    if n_tokens < 2:
        raise ValueError(f"decode_from_context needs n_tokens >= 2, got {n_tokens}")
    base = getattr(model, "_orig_mod", model)
    if context + n_tokens > base.max_seq_len:
        raise ValueError(f"context {context} + {n_tokens} tokens exceeds the cache's max_seq_len={base.max_seq_len}")
    fill_synthetic_context(base, context, seed)
    dev = base.embed.weight.device
    b = base.batch_size
    tok = benchmark_prompt(base.config, 1, batch_size=b, device=dev)[:, 0]
    pos = torch.full((b, 1), context, dtype=torch.int64, device=dev)
    out = torch.empty(b, n_tokens, dtype=torch.int64, device=dev)
    clock = Clock(dev)
    with torch.no_grad():
        for i in range(n_tokens):
            logits = runner(tok[:, None], pos)
            tok = logits[:, -1].argmax(-1)
            out[:, i] = tok
            pos += 1
            clock.mark()
    sec = clock.seconds()
    return {"decode_tok_s": (n_tokens - 1) / sec[-1], "tokens": out.cpu()}


def context_sweep(model, runners, names, contexts, n_tokens, cuda, copy_tb_s, prog, say) -> dict:
    """`decode_vs_context` of the result (BENCHMARK.md "Context sweep"): per context, each backend in turn (the order
    rotated per context), `n_tokens` steps from caches filled up to the context.

    Args: model: the eager `DeepseekV41Flash`; runners {row: decode callable}; names: the rows; contexts: ints;
        cuda: time with CUDA events; copy_tb_s: the run's copy bandwidth (None: no roofline); prog / say: the
        run's progress bars and log line. A failing point is None with its error under "errors", never raised.
    """
    from .model.budget import budget, decode_kv_read_bytes

    cfg = model.config
    w = budget(cfg, max_seq_len=model.max_seq_len).decode_weight_bytes
    out = {"contexts": list(contexts), "tokens_per_point": n_tokens, "cache_max_seq_len": model.max_seq_len,
           "note": "caches filled with random valid rows up to the context (dsv41.model.synthetic), no prefill; "
                   "decode tok/s over the steps after the first",
           "decode_bytes_per_step": {}, "roofline_tok_s": {}, "backends": {n: {} for n in names}, "errors": {}}
    task = prog.add_task("decode vs context", total=len(contexts) * len(names))
    for i, ctx in enumerate(contexts):
        nbytes = w + decode_kv_read_bytes(cfg, ctx + 1)  # the step at position ctx sees ctx + 1 tokens
        out["decode_bytes_per_step"][str(ctx)] = nbytes
        out["roofline_tok_s"][str(ctx)] = roofline(nbytes, copy_tb_s) if copy_tb_s else None
        order = names[i % len(names):] + names[:i % len(names)] if names else []
        for n in order:
            try:
                r = decode_from_context(runners[n], model, ctx, n_tokens, cuda)
                out["backends"][n][str(ctx)] = r["decode_tok_s"]
                say(f"{n}: context {ctx}: {r['decode_tok_s']:.2f} tok/s")
            except Exception as e:
                out["backends"][n][str(ctx)] = None
                out["errors"][f"{n}@{ctx}"] = fail_text(e)
                say(f"{n}: context {ctx}: {fail_text(e)}")
            prog.advance(task)
    return out
