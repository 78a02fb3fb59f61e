"""What a generation loop returns and the tools both loops (`generate.generate`, `speculative.generate_speculative`)
time and unwrap with; a module of its own so that neither loop imports the other's module back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

__all__ = ["GenerateResult", "Clock", "base_model"]


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


def base_model(model):
    """The eager module behind `model`: `torch.compile`'s `_orig_mod` when it has one, else `model` itself."""
    return getattr(model, "_orig_mod", model)


class Clock:
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
