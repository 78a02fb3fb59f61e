"""Batch-size buckets for captured decode steps (ARCHITECTURE.md "Pipeline stages" 5; issue 6 item 1).

Inductor's CUDA-graph trees (`triton.cudagraphs`, turned on by the backend) already record one graph per input
shape and replay it; what they do not do is bound the number of shapes. `BucketedModel` does: a decode step of
batch b runs as the next bucket k >= b of `buckets` (default `DEFAULT_BUCKETS` = 1, 2, 4, 6, 8: the powers of two
and the speculative verify width 6), with the inputs padded to k rows and the outputs sliced back to b; a batch
above the largest bucket runs uncaptured (on `fallback`, by default the eager module), and the report says which.

Why a wrapper around the compiled model and not padding inside the backend: the backend sees one Dynamo graph
whose caches are module buffers sized by `setup_cache(batch_size, ...)`. Padding the activations of that graph
to k rows would index cache rows that do not exist (or, with a larger cache, make every batch size a different
graph again), and the padded rows must never touch a real sequence's cache row. Only the code that sizes the
caches can pad safely, so `BucketedModel` sizes them for the bucket (`setup_cache(k, ...)`) and pads the inputs
by repeating the last real row (valid ids and positions, written to the padded rows' own cache rows, which no
real row reads: attention, Engram history and compressor state are per row; MoE routing is per token).
`torch.compile(model, backend="dsv41")` itself is unchanged.

Only the batch dimension is padded. A speculative verify step (rows = K + 1 tokens per sequence, dim 1) is
captured at its exact width: padding dim 1 would write cache entries (and complete compressor groups) for
tokens that do not exist.

It works with `dsv41.model.generate`: `generate(BucketedModel(compiled), prompt, n)` prefills through the padded
eager module underneath (`_orig_mod`) and decodes through the padded compiled model.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch

__all__ = ["DEFAULT_BUCKETS", "choose_bucket", "normalize_buckets", "pad_rows", "slice_rows", "BucketedModel"]

#: Decode batch sizes captured: 1, 2, 4, 8 and the speculative verify width 6 (issue 6 item 1).
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 6, 8)


def normalize_buckets(buckets: Iterable[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated bucket sizes. Raises TypeError for a non-int entry (bools included) and ValueError
    for an empty set or a size < 1."""
    out = set()
    for k in buckets:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"bucket sizes must be ints, got {k!r}")
        if k < 1:
            raise ValueError(f"bucket sizes must be >= 1, got {k}")
        out.add(k)
    if not out:
        raise ValueError("need at least one bucket size")
    return tuple(sorted(out))


def choose_bucket(batch: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int | None:
    """The smallest bucket >= `batch`, or None when `batch` exceeds every bucket (the step then runs uncaptured).

    Raises ValueError for batch < 1.
    """
    if batch < 1:
        raise ValueError(f"batch size must be >= 1, got {batch}")
    for k in normalize_buckets(buckets):
        if k >= batch:
            return k
    return None


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` [b, ...] padded to [rows, ...] along dim 0 by repeating its last row (a new contiguous tensor; `t`
    itself when b == rows). Raises ValueError when b > rows or `t` is 0-dim / empty along dim 0."""
    if t.dim() == 0 or t.shape[0] == 0:
        raise ValueError(f"cannot pad a tensor of shape {tuple(t.shape)} along dim 0")
    b = t.shape[0]
    if b > rows:
        raise ValueError(f"cannot pad {b} rows down to {rows}")
    if b == rows:
        return t
    return torch.cat([t, t[-1:].expand(rows - b, *t.shape[1:])], dim=0)


def slice_rows(out: Any, rows: int) -> Any:
    """The first `rows` rows (dim 0) of every tensor in `out` (a tensor, or a tuple / list / dict of them);
    other values are returned as they are."""
    if isinstance(out, torch.Tensor):
        return out[:rows] if out.dim() > 0 else out
    if isinstance(out, tuple):
        return tuple(slice_rows(o, rows) for o in out)
    if isinstance(out, list):
        return [slice_rows(o, rows) for o in out]
    if isinstance(out, dict):
        return {k: slice_rows(v, rows) for k, v in out.items()}
    return out


def _eager(model):
    return getattr(model, "_orig_mod", model)


class _PaddedModule:
    """The eager module under a `BucketedModel`, seen with the caller's batch size (what `generate` talks to for
    `setup_cache`, `reset_cache`, `batch_size` and the prefill call). Other attributes are the module's."""

    def __init__(self, owner: "BucketedModel"):
        object.__setattr__(self, "_owner", owner)

    @property
    def batch_size(self) -> int:
        """The logical batch size given to `setup_cache` (the caches hold its bucket's rows)."""
        return self._owner.batch

    def setup_cache(self, batch_size: int, max_seq_len: int) -> None:
        """Caches for the bucket of `batch_size` (exactly `batch_size` above the largest bucket). When the
        allocated caches already have the bucket's rows and at least `max_seq_len` positions they are reset in
        place instead: same addresses and shapes, so the captured graph is replayed, not recompiled."""
        o = self._owner
        o.batch = batch_size
        k = choose_bucket(batch_size, o.buckets)
        rows = k if k is not None else batch_size
        m = o.module
        if getattr(m, "batch_size", 0) == rows and getattr(m, "max_seq_len", 0) >= max_seq_len:
            m.reset_cache()
        else:
            m.setup_cache(rows, max_seq_len)

    def __call__(self, input_ids, positions, *args, **kwargs):
        return self._owner._run(self._owner.module, input_ids, positions, args, kwargs, eager=True)

    def __getattr__(self, name):
        return getattr(self._owner.module, name)

    def __setattr__(self, name, value):
        setattr(self._owner.module, name, value)


class BucketedModel:
    """A decode callable `model(input_ids [B, T], positions [B, T], *args, **kwargs)` whose batch is padded to a
    bucket (module docstring).

    Args:
        model: the compiled model (`torch.compile(m, backend="dsv41")`) or any module with `setup_cache(batch,
            max_len)`; its eager module is `model._orig_mod` when it has one.
        buckets: batch sizes that are captured (default `DEFAULT_BUCKETS`).
        fallback: what runs a batch above the largest bucket (default: the eager module, i.e. uncaptured).
        report: a `FusionReport` to record the bucket use in (`report.buckets`); default: the report of the most
            recent dsv41 compile after each call (`dsv41.last_report()`).
    Attributes:
        batch: the caller's batch size as given to `setup_cache` (0 before).
        seen: batch size -> [bucket or None, calls].
    Raises:
        TypeError / ValueError: bad bucket sizes (`normalize_buckets`); in calls, inputs whose batch differs from
        the cache's logical batch are allowed only up to it.
    """

    def __init__(self, model, buckets: Iterable[int] = DEFAULT_BUCKETS, fallback: Callable | None = None,
                 report=None):
        self.model = model
        self.module = _eager(model)
        self.buckets = normalize_buckets(buckets)
        self.fallback = fallback if fallback is not None else self.module
        self.report = report
        self.batch = 0
        self.seen: dict[int, list] = {}
        self._orig_mod = _PaddedModule(self)

    def setup_cache(self, batch_size: int, max_seq_len: int) -> None:
        """Size the caches for `batch_size` sequences (allocates the bucket's rows)."""
        self._orig_mod.setup_cache(batch_size, max_seq_len)

    def _run(self, fn, input_ids, positions, args, kwargs, eager: bool):
        b = input_ids.shape[0]
        k = choose_bucket(b, self.buckets)
        if not eager:
            entry = self.seen.setdefault(b, [k, 0])
            entry[1] += 1
        if k is None:
            out = (self.module if eager else self.fallback)(input_ids, positions, *args, **kwargs)
        else:
            out = slice_rows(fn(pad_rows(input_ids, k), pad_rows(positions, k), *args, **kwargs), b)
        if not eager:
            self._publish()
        return out

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, *args, **kwargs):
        """One decode step through the compiled model at the bucket of `input_ids.shape[0]`; outputs sliced
        back to the real rows."""
        return self._run(self.model, input_ids, positions, args, kwargs, eager=False)

    def summary(self) -> dict:
        """Bucket use for the report: the bucket sizes and, per batch size seen, what it ran as and how often."""
        rows = []
        for b in sorted(self.seen):
            k, calls = self.seen[b]
            runs = (f"bucket {k}" + (f" (padded from {b})" if k != b else "")) if k is not None else \
                f"uncaptured (above the largest bucket {self.buckets[-1]})"
            rows.append({"batch": b, "bucket": k, "runs_as": runs, "calls": calls})
        return {"buckets": list(self.buckets), "seen": rows,
                "uncaptured": [b for b in sorted(self.seen) if self.seen[b][0] is None]}

    def _publish(self) -> None:
        rep = self.report
        if rep is None:
            from .report import last_report
            rep = last_report()
        if rep is not None:
            rep.buckets = self.summary()
