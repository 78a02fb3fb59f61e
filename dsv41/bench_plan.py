"""What `dsv41.bench.run_benchmark` checks before it builds anything: sizes, backend rows, per-row token counts,
speculation, contexts, precompile workers, dtype / weight mode, and the cache positions against the preset's
`max_position_embeddings`.

Every check raises `dsv41.usage.UsageError` (a ValueError), so `dsv41 bench` reports a bad request as one line in a
second or two, not after the eager reference of a model it then throws away.

Public names: `check_request`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .usage import UsageError

__all__ = ["check_request"]


def check_request(preset: str, backends, prompt_len: int, new_tokens: int, repeats: int, *, weight_mode: str,
                  dtype: str | None, speculative: float | None, contexts: Sequence[int] | None, context_tokens: int,
                  tp: Mapping | None, precompile: int, precompile_only: bool, cache_dir: str | None,
                  eager_new_tokens: int | None, row_new_tokens: Mapping[str, int] | None) -> dict:
    """Validate a benchmark request (arguments as `run_benchmark`) and plan its rows.

    Returns {"families", "ablation_note" (as `bench_rows.ablation_families`), "names" (the rows, `expand_backends`),
    "spec_of" ({row: E or None}, `row_speculation`), "tokens_of" ({row: tokens per run}), "row_new_tokens" (dict),
    "contexts" (sorted, deduplicated ints, or None)}.
    Raises: UsageError naming the argument: sizes below their minimum, unknown rows, bad row token counts,
    speculation or precompile with TP, a non-positive acceptance, contexts below 1, an unknown preset, dtype or
    weight mode, or more cache positions than the preset's max_position_embeddings.
    """
    from .bench_rows import ablation_families, base_backend, expand_backends, row_speculation
    from .harness import DTYPES, cache_positions
    from .model import ModelConfig
    from .model.model import WEIGHT_MODES

    if eager_new_tokens is not None and not 2 <= eager_new_tokens <= new_tokens:
        raise UsageError(f"eager_new_tokens must lie in [2, new_tokens={new_tokens}], got {eager_new_tokens}")
    if prompt_len < 1 or new_tokens < 2 or repeats < 1:
        raise UsageError(f"need prompt_len >= 1, new_tokens >= 2 and repeats >= 1, got {prompt_len}, "
                         f"{new_tokens}, {repeats}")
    families, ablation_note = ablation_families()
    try:
        names = expand_backends(backends, families)
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None
    spec_of = row_speculation(names, speculative)
    # Eager decodes a 1,024-token h200 run in ~15 minutes: with `eager_new_tokens`, its rows and the reference
    # stop earlier.
    tokens_of = {n: (eager_new_tokens or new_tokens) if base_backend(n) == "eager" else new_tokens for n in names}
    row_new_tokens = dict(row_new_tokens or {})
    unknown = sorted(set(row_new_tokens) - set(names))
    if unknown:
        raise UsageError(f"row_new_tokens names rows that are not in this run: {unknown}; rows: {names}")
    for n, r in row_new_tokens.items():
        if base_backend(n) == "eager":
            raise UsageError(f"row_new_tokens[{n!r}]: eager rows take eager_new_tokens, which also shortens the eager "
                             "reference")
        if isinstance(r, bool) or not isinstance(r, int) or not 2 <= r <= new_tokens:
            raise UsageError(f"row_new_tokens[{n!r}] must be an int in [2, new_tokens={new_tokens}], got {r!r}")
        tokens_of[n] = r
    if speculative is not None and speculative <= 0:
        raise UsageError(f"speculative must be a positive mean acceptance length, got {speculative}")
    if tp is not None and any(spec_of.values()):
        raise UsageError("DSpark speculative rows are not supported with tensor parallelism")
    if contexts:
        contexts = sorted({int(c) for c in contexts})
        if contexts[0] < 1 or context_tokens < 2:
            raise UsageError(f"contexts must be >= 1 and context_tokens >= 2, got {contexts}, {context_tokens}")
    else:
        contexts = None
    if precompile and tp is not None:
        raise UsageError("precompile workers are not supported with tensor parallelism")
    if precompile < 0:
        raise UsageError(f"precompile must be >= 0 workers, got {precompile}")
    if precompile_only and not (precompile and cache_dir):
        raise UsageError("precompile_only needs precompile workers and a cache_dir to keep what they compile")
    # What building the model would check, so a bad request fails here and not after (or in every worker).
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if weight_mode not in WEIGHT_MODES:
        raise UsageError(f"unknown weight_mode {weight_mode!r}; expected one of {WEIGHT_MODES}")
    try:
        cfg = ModelConfig.preset(preset)
        cache_positions(cfg, prompt_len, new_tokens, contexts, context_tokens, any(spec_of.values()))
    except ValueError as e:
        raise UsageError(f"argument --prompt-len/--new-tokens: {e}") from None
    return {"families": families, "ablation_note": ablation_note, "names": names, "spec_of": spec_of,
            "tokens_of": tokens_of, "row_new_tokens": row_new_tokens, "contexts": contexts}
