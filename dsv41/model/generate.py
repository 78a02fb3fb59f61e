"""Greedy generation with the BENCHMARK.md workload (random prompt, seed 42, EOS ignored)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .config import ModelConfig

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


@dataclass
class GenerateResult:
    """Output of `generate`.

    tokens: int64 [B, N] generated ids (N = max_new_tokens; the first comes from the prefill logits).
    timestamps: seconds from the start of prefill to each generated token, len N.
    prompt_len: prompt tokens per sequence.
    Speculative runs only (empty / None otherwise): acceptance: tokens emitted per verify round (accepted drafts
    + the bonus token), one list of B per round; natural_acceptance: the same under greedy acceptance (equal to
    `acceptance` unless simulated); simulated_acceptance: the "match-expected" mean length, or None.
    logits (`return_logits=True` only): float32 [B, N-1, V] on the CPU, the logits of decode steps 1..N-1 (step i
    was fed token i-1), i.e. what `dsv41.bench.teacher_forced_logits` computes for these tokens, without a second run.
    round_phases_ms (speculative with `round_phases=True` only): one {phase: milliseconds} per verify round, phases
    `speculative.ROUND_PHASES`.
    """

    tokens: torch.Tensor
    timestamps: List[float] = field(default_factory=list)
    prompt_len: int = 0
    acceptance: List[List[int]] = field(default_factory=list)
    natural_acceptance: List[List[int]] = field(default_factory=list)
    simulated_acceptance: Optional[float] = None
    logits: Optional[torch.Tensor] = None
    round_phases_ms: List[dict] = field(default_factory=list)

    @property
    def mean_acceptance(self) -> float:
        """Measured mean acceptance length (tokens per verify round); NaN for a plain run."""
        return _mean(self.acceptance)

    @property
    def mean_natural_acceptance(self) -> float:
        """Measured mean greedy acceptance length (what the drafts really earned); NaN for a plain run."""
        return _mean(self.natural_acceptance)

    @property
    def prefill_s(self) -> float:
        """Time to first token (prefill), seconds."""
        return self.timestamps[0]

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens per second (all sequences)."""
        return self.prompt_len * self.tokens.shape[0] / self.timestamps[0]

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first / (last - first timestamp), per sequence (BENCHMARK.md "Metric")."""
        if len(self.timestamps) < 2:
            return float("nan")
        return (len(self.timestamps) - 1) / (self.timestamps[-1] - self.timestamps[0])


def _mean(rounds: List[List[int]]) -> float:
    vals = [v for r in rounds for v in r]
    return sum(vals) / len(vals) if vals else float("nan")


def _base(model):
    return getattr(model, "_orig_mod", model)


class _Clock:
    """Marks on the host clock (CPU) or CUDA events (GPU); `seconds()` = each mark after the first, from the first."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self) -> None:
        """Record a timestamp (a CUDA event on GPU, the host clock on CPU)."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> List[float]:
        """Seconds from the first mark to each later one (synchronises the GPU once)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [self.marks[0].elapsed_time(e) / 1e3 for e in self.marks[1:]]
        return [m - self.marks[0] for m in self.marks[1:]]


@torch.no_grad()
def generate(model, prompt_ids: torch.Tensor, max_new_tokens: int, compiled_prefill: bool = False,
             speculative: bool = False, simulate_acceptance: float | None = None, drafter=None,
             return_logits: bool = False, round_phases: bool = False) -> GenerateResult:
    """Greedy decode: prefill `prompt_ids`, then `max_new_tokens - 1` decode steps of one token each.

    With `speculative=True`: DSpark speculative decoding instead (`speculative.generate_speculative`): each round
    drafts `dspark_block_size` tokens, verifies block + 1 rows in one forward, keeps the longest agreeing prefix plus
    one and rolls every cache back; greedy output equals the plain greedy output. `simulate_acceptance` (e.g. 5.5,
    BENCHMARK.md "match-expected") forces the acceptance lengths for benchmarks; `drafter` replaces the eager
    `model.mtp` (e.g. a compiled one). The result reports the measured mean acceptance length.

    Args:
        model: a `DeepseekV41Flash` or a `torch.compile` wrapper of one. Decode steps go through `model`;
            prefill runs on the eager module underneath unless `compiled_prefill` (gpt-fast style: only the
            static-shape decode step is compiled, so a new prompt length never triggers a compile).
            Caches are reset in place when big enough, else (re)allocated with `setup_cache`.
        prompt_ids: int64 [P] or [B, P].
        max_new_tokens: tokens to produce (>= 1). EOS is ignored.
        return_logits: also keep each decode step's last-position logits (float32, cloned, since a CUDA-graph
            output is overwritten by the next replay); costs a copy per step, so timed runs leave it off.
        round_phases: (speculative only) time each round's phases (`speculative.generate_speculative`).
    Returns:
        `GenerateResult` with tokens [B, max_new_tokens] and per-token timestamps (CUDA events on GPU).
    Raises:
        ValueError: empty prompt, max_new_tokens < 1, or a total length beyond max_position_embeddings;
        `simulate_acceptance`, `drafter` or `round_phases` without `speculative`; `return_logits` with
        `speculative` or with max_new_tokens < 2 (no decode step).
    """
    if return_logits and (speculative or max_new_tokens < 2):
        raise ValueError("return_logits needs plain decoding (speculative=False) and max_new_tokens >= 2")
    if speculative:
        from .speculative import generate_speculative
        return generate_speculative(model, prompt_ids, max_new_tokens, compiled_prefill=compiled_prefill,
                                    simulate_acceptance=simulate_acceptance, drafter=drafter,
                                    round_phases=round_phases)
    if simulate_acceptance is not None or drafter is not None or round_phases:
        raise ValueError("simulate_acceptance, drafter and round_phases need speculative=True")
    base = _base(model)
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
    clock = _Clock(dev)
    mark = clock.mark
    out = torch.empty(b, max_new_tokens, dtype=torch.int64, device=dev)
    mark()
    pos = torch.arange(p, device=dev)[None].expand(b, p).contiguous()
    logits = (model if compiled_prefill else base)(ids, pos, last_only=True)
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
