"""Greedy generation with the BENCHMARK.md workload (random prompt, seed 42, EOS ignored)."""

from __future__ import annotations

from typing import Sequence

import torch

from .config import ModelConfig
from .prefill import PREFILL_CHUNKS, check_chunk_sizes, prefill
from .results import Clock, GenerateResult, base_model

__all__ = ["GenerateResult", "generate", "benchmark_prompt"]


def benchmark_prompt(config: ModelConfig, length: int, batch_size: int = 1, seed: int = 42,
                     device=None) -> torch.Tensor:
    """Random prompt ids [batch_size, length] int64, uniform over the vocabulary minus special tokens.

    Special tokens excluded: bos, eos, pad and the DSpark noise token. Drawn from a CPU `torch.Generator`
    seeded with `seed`, so every backend and device gets the very same ids (BENCHMARK.md "Workload").
    Raises: ValueError for a non-positive length or batch size.
    """
    if length < 1 or batch_size < 1:
        raise ValueError(f"prompt length and batch size must be positive, got {length}, {batch_size}")
    special = sorted({config.bos_token_id, config.eos_token_id, config.pad_token_id, config.dspark_noise_token_id})
    allowed = torch.ones(config.vocab_size, dtype=torch.bool)
    allowed[[s for s in special if s < config.vocab_size]] = False
    ids = torch.nonzero(allowed).flatten()
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, ids.numel(), (batch_size, length), generator=g)
    return ids[pick].to(device)


@torch.no_grad()
def generate(model, prompt_ids: torch.Tensor, max_new_tokens: int, compiled_prefill: bool = False,
             speculative: bool = False, simulate_acceptance: float | None = None, drafter=None,
             return_logits: bool = False, round_phases: bool = False,
             prefill_chunks: Sequence[int] = PREFILL_CHUNKS) -> GenerateResult:
    """Greedy decode: prefill `prompt_ids`, then `max_new_tokens - 1` decode steps of one token each.

    With `speculative=True`: DSpark speculative decoding instead (`speculative.generate_speculative`): each round
    drafts `dspark_block_size` tokens, verifies block + 1 rows in one forward, keeps the longest agreeing prefix plus
    one and rolls every cache back; greedy output equals the plain greedy output. `simulate_acceptance` (e.g. 5.5,
    BENCHMARK.md "match-expected") forces the acceptance lengths for benchmarks; `drafter` replaces the eager
    `model.mtp` (e.g. a compiled one). The result reports the measured mean acceptance length.

    Args:
        model: a `DeepseekV41Flash` or a `torch.compile` wrapper of one. Decode steps go through `model`;
            prefill runs on the eager module underneath unless `compiled_prefill` (gpt-fast style: only the
            static-shape decode step is compiled, so a new prompt length never triggers a compile). With
            `compiled_prefill` the prompt goes through `model` in chunks of the fixed `prefill_chunks` sizes
            (`prefill.chunk_plan`): one static compiled graph per size, whatever the prompt length.
            Caches are reset in place when big enough, else (re)allocated with `setup_cache`.
        prompt_ids: int64 [P] or [B, P].
        max_new_tokens: tokens to produce (>= 1). EOS is ignored.
        return_logits: also keep each decode step's last-position logits (float32, cloned, since a CUDA-graph
            output is overwritten by the next replay); costs a copy per step, so timed runs leave it off.
        round_phases: (speculative only) time each round's phases (`speculative.generate_speculative`).
        prefill_chunks: chunk sizes of a compiled prefill (default `PREFILL_CHUNKS`; must include 1).
    Returns:
        `GenerateResult` with tokens [B, max_new_tokens] and per-token timestamps (CUDA events on GPU).
    Raises:
        ValueError: empty prompt, max_new_tokens < 1, or a total length beyond max_position_embeddings; bad
        `prefill_chunks` (`prefill.check_chunk_sizes`);
        `simulate_acceptance`, `drafter` or `round_phases` without `speculative`; `return_logits` with
        `speculative` or with max_new_tokens < 2 (no decode step).
    """
    if return_logits and (speculative or max_new_tokens < 2):
        raise ValueError("return_logits needs plain decoding (speculative=False) and max_new_tokens >= 2")
    prefill_chunks = check_chunk_sizes(prefill_chunks)
    if speculative:
        from .speculative import generate_speculative
        return generate_speculative(model, prompt_ids, max_new_tokens, compiled_prefill=compiled_prefill,
                                    simulate_acceptance=simulate_acceptance, drafter=drafter,
                                    round_phases=round_phases, prefill_chunks=prefill_chunks)
    if simulate_acceptance is not None or drafter is not None or round_phases:
        raise ValueError("simulate_acceptance, drafter and round_phases need speculative=True")
    base = base_model(model)
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids[None]
    b, p = prompt_ids.shape
    if p < 1 or max_new_tokens < 1:
        raise ValueError(f"need a non-empty prompt and max_new_tokens >= 1, got {p}, {max_new_tokens}")
    need = p + max_new_tokens
    if base.max_seq_len >= need and base.batch_size == b:
        base.reset_cache()
    else:
        base.setup_cache(b, need)
    dev = base.embed.weight.device
    ids = prompt_ids.to(dev)
    clock = Clock(dev)
    mark = clock.mark
    out = torch.empty(b, max_new_tokens, dtype=torch.int64, device=dev)
    mark()
    pos = torch.arange(p, device=dev)[None].expand(b, p).contiguous()
    if compiled_prefill:
        logits = prefill(model, ids, pos, prefill_chunks)
    else:
        logits = base(ids, pos, last_only=True)
    tok = logits[:, -1].argmax(-1)
    out[:, 0] = tok
    mark()
    pos = torch.full((b, 1), p, dtype=torch.int64, device=dev)
    kept = []
    for i in range(1, max_new_tokens):
        logits = model(tok[:, None], pos)
        if return_logits:
            kept.append(logits[:, -1].float().clone())
        tok = logits[:, -1].argmax(-1)
        out[:, i] = tok
        pos += 1
        mark()
    return GenerateResult(tokens=out.cpu(), timestamps=clock.seconds(), prompt_len=p,
                          logits=torch.stack(kept, 1).cpu() if return_logits else None)
