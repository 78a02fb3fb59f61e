"""Chunked prefill: a prompt of any length as a sequence of calls of a few fixed sizes (issue [prefill] item 2).

A compiled model prefilled with the whole prompt compiles once per prompt length (or, under automatic dynamic
shapes, a symbolic-length graph that dsv41's families refuse). Prefilling in chunks of fixed sizes instead gives a
compiled model one static graph per chunk size, whatever the prompt: `chunk_plan(length, sizes)` splits a length
greedily into the largest sizes that fit (sizes must include 1, so every length splits; no padding, so no pad
token ever reaches a cache, the compressor's pending pair or the window ring), and `prefill` runs the calls.

A causal model with static caches computes the same thing in chunks as in one call (each chunk's queries see the
cached keys of the chunks before it); the eager V4.1 model's chunked and whole-prompt logits agree to float
rounding (tests/test_prefill_chunks.py). Chunks of one token are called as `generate`'s decode steps call the
model (`model(ids, pos)`), so they reuse the decode graph.

Source: issue [prefill] ("Chunked prefill through the compiler"); the fixed-size chunking of vLLM / SGLang
chunked prefill, without their padding.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["PREFILL_CHUNKS", "chunk_plan", "check_chunk_sizes", "prefill"]

#: Default chunk sizes, largest first: a 4,096-token prompt is 8 calls of 512; any length at most 7 calls of each
#: smaller size beyond its multiples of 512.
PREFILL_CHUNKS = (512, 64, 8, 1)


def check_chunk_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """`sizes` as a tuple of distinct positive ints, largest first, that includes 1.

    Raises: ValueError naming the bad value (not an int, < 1, repeated, or no 1 among them).
    """
    try:
        out = tuple(sizes)
    except TypeError:
        raise ValueError(f"prefill chunk sizes must be a sequence of ints, got {sizes!r}") from None
    for s in out:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"prefill chunk sizes must be positive ints, got {s!r} in {out!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"prefill chunk sizes must be distinct, got {out!r}")
    if 1 not in out:
        raise ValueError(f"prefill chunk sizes must include 1 so that every prompt length splits, got {out!r}")
    return tuple(sorted(out, reverse=True))


def chunk_plan(length: int, sizes: Sequence[int] = PREFILL_CHUNKS) -> list[int]:
    """The chunk lengths, in order, that prefill `length` tokens: the largest size that fits, repeatedly.

    Example: `chunk_plan(100, (64, 8, 1)) == [64, 8, 8, 8, 8, 1, 1, 1, 1]`.
    Raises: ValueError for length < 1 or bad `sizes` (`check_chunk_sizes`).
    """
    sizes = check_chunk_sizes(sizes)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"prompt length must be a positive int, got {length!r}")
    plan, left = [], length
    for s in sizes:
        n, left = divmod(left, s)
        plan += [s] * n
    return plan


def _piece(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    # A fresh row-major [B, size] tensor: a slice of the whole prompt would carry the prompt length in its row
    # stride, which a compiled graph guards on (one graph per prompt length again).
    piece = t[:, start:start + size].clone(memory_format=torch.contiguous_format)
    if size > 1:
        # No automatic-dynamic length: one static graph per chunk size. A length of 1 is always specialised, and
        # the decode steps' tensors carry no marking: a marked one-token chunk would fail their graph's guards.
        torch._dynamo.mark_static(piece, 1)
    return piece


def prefill(model, ids: torch.Tensor, pos: torch.Tensor, sizes: Sequence[int] = PREFILL_CHUNKS, each=None,
            **kwargs):
    """Run the prompt `ids` [B, P] int64 at positions `pos` [B, P] int64 through `model` in chunks of `sizes`
    (`chunk_plan`); returns the last chunk's output.

    Chunks longer than one token are called `model(ids_c, pos_c, last_only=True, **kwargs)`; one-token chunks
    `model(ids_c, pos_c)` (the decode call) when `kwargs` is empty, else with `last_only=True, **kwargs` too. The
    caches must be set up (and reset) for the prompt by the caller, as for a whole-prompt call. `each(out, pos_c)`,
    when given, is called after every chunk with its output and positions [B, size] (speculative decoding commits
    each chunk's features to the drafter's ring there).

    Raises: ValueError for ids / pos of other shapes than [B, P] with P >= 1, or bad `sizes`.
    """
    if ids.dim() != 2 or pos.shape != ids.shape or ids.shape[1] < 1:
        raise ValueError(f"prefill wants ids and pos of one shape [B, P], P >= 1; got {tuple(ids.shape)} and "
                         f"{tuple(pos.shape)}")
    out, start = None, 0
    for size in chunk_plan(int(ids.shape[1]), sizes):
        c_ids, c_pos = _piece(ids, start, size), _piece(pos, start, size)
        if size == 1 and not kwargs:
            out = model(c_ids, c_pos)
        else:
            out = model(c_ids, c_pos, last_only=True, **kwargs)
        if each is not None:
            each(out, c_pos)
        start += size
    return out
