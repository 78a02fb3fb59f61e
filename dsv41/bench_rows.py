"""The rows of `dsv41 bench`: their names (`eager`, `dsv41`, `dsv41-no-<family>`, `dsv41[key=value;...]`,
`<row>+dspark`, the groups `all` / `ablations` / `toggles`), what each expands to, and the dsv41 options and
speculation of each row, and `--row-new-tokens ROW=R` parsed. Shared by the benchmark (`bench.py`), its request check (`bench_plan.py`) and the runners
of `harness.py`; imports none of them.
"""

from __future__ import annotations

import hashlib
import re
from typing import Sequence

__all__ = ["CORE_BACKENDS", "ABLATION", "DSPARK", "DSPARK_ACCEPTANCE", "TOGGLES", "ablation_families",
           "variant_options", "base_backend", "row_speculation", "expand_backends", "row_options",
           "parse_row_new_tokens", "cache_dir_name"]

#: Backends of BENCHMARK.md "Side by side", in the order they run; ablations go after `dsv41`.
CORE_BACKENDS = ("eager", "inductor", "inductor-cudagraphs", "dsv41", "torch_tensorrt")
#: Row-name prefix of an ablation (`dsv41-no-<family>`): dsv41 with that pass family disabled.
ABLATION = "dsv41-no-"
#: Row-name suffix of a DSpark speculative row (`dsv41+dspark`): the backend before it, decoding speculatively.
DSPARK = "+dspark"
#: Simulated mean acceptance of `+dspark` rows when `speculative` is not given (BENCHMARK.md "match-expected").
DSPARK_ACCEPTANCE = 5.5
def ablation_families() -> tuple[tuple[str, ...], str | None]:
    """(pass family names from `dsv41.passes.FAMILY_ORDER`, None), or ((), why) when the registry won't import."""
    try:
        from .passes import FAMILY_ORDER
    except Exception as e:  # the pass registry is optional for the benchmark: no ablations then
        return (), f"ablations skipped: dsv41.passes did not import ({type(e).__name__}: {e})"[:500]
    return tuple(FAMILY_ORDER), None


#: The `toggles` group (issue 6): CUDA graphs, PDL and side streams, each flipped alone from the backend default.
TOGGLES = ("dsv41[cuda_graphs=false]", "dsv41[pdl=false]", "dsv41[streams=false]")
_VARIANT = re.compile(r"^dsv41\[(.+)\]$")


def _split_names(spec: str) -> list:
    """Comma-separated names; commas inside `[...]` belong to the name."""
    out, depth, cur = [], 0, ""
    for ch in spec:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


def variant_options(name: str) -> dict | None:
    """The option overrides of a `dsv41[key=value;...]` row (items separated by `;`, values read as JSON where
    they parse, as with `--option`: `dsv41[disable=["moe","mhc"];pdl=false]`), or None when `name` is not such a
    row. Raises: ValueError for an item without `=` or a key /
    value the dsv41 backend rejects (its message names the key)."""
    m = _VARIANT.match(name)
    if m is None:
        return None
    from .usage import backend_options
    from .compiler.options import parse_options
    opts = backend_options([x.strip() for x in m.group(1).split(";") if x.strip()])
    try:
        parse_options(opts, environ={})
    except (TypeError, ValueError) as e:
        raise ValueError(f"backend {name!r}: {e}") from None
    return opts


def base_backend(name: str) -> str:
    """The backend of row `name` without its `+dspark` suffix."""
    return name[:-len(DSPARK)] if name.endswith(DSPARK) else name


def row_speculation(names: Sequence[str], speculative: float | None) -> dict:
    """{row: simulated acceptance E of its DSpark speculative runs, or None for plain decode}.

    With `+dspark` rows: those rows at `speculative` (default `DSPARK_ACCEPTANCE`), the others plain, so DSpark
    off and on sit side by side in one run. Without: every row at `speculative` (None: all plain).
    """
    if any(n.endswith(DSPARK) for n in names):
        e = DSPARK_ACCEPTANCE if speculative is None else speculative
        return {n: e if n.endswith(DSPARK) else None for n in names}
    return {n: speculative for n in names}


def expand_backends(spec: str | Sequence[str], families: Sequence[str]) -> list:
    """Backend names from a comma-separated string or a list.

    `all` = `CORE_BACKENDS` with one `dsv41-no-<family>` per family right after `dsv41`; `ablations` = the
    ablations alone; `toggles` = `TOGGLES`; `dsv41[key=value;...]` = dsv41 with those options over the run's
    `--option`s (e.g. `dsv41[cuda_graphs=false]`); `<row>+dspark` = that row decoding with DSpark speculation
    (`row_speculation`). Duplicates are dropped, order kept.
    Raises: ValueError for an unknown name, an ablation of a family not in `families` (when it is non-empty), or
    a `dsv41[...]` row with options the backend rejects.
    """
    names = [s.strip() for s in (_split_names(spec) if isinstance(spec, str) else spec) if s.strip()]
    ablations = [ABLATION + f for f in families]
    out: list = []
    for n in names:
        if n.endswith(DSPARK):
            b = base_backend(n)
            if b in ("all", "ablations", "toggles", "torch_tensorrt") or not b or b.endswith(DSPARK) or b != b.strip():
                raise ValueError(f"unknown backend {n!r}: +dspark follows one backend row directly (e.g. "
                                 "dsv41+dspark), not a group, torch_tensorrt, a space or another +dspark")
            expand_backends([b], families)  # raises for an unknown row
            group = [n]
        elif n == "all":
            group = list(CORE_BACKENDS)
            group[group.index("dsv41") + 1:group.index("dsv41") + 1] = ablations
        elif n == "ablations":
            group = ablations
        elif n == "toggles":
            group = list(TOGGLES)
        elif n in CORE_BACKENDS:
            group = [n]
        elif n.startswith(ABLATION) and len(n) > len(ABLATION):
            if families and n[len(ABLATION):] not in families:
                raise ValueError(f"unknown pass family in backend {n!r}; families: {', '.join(families)}")
            group = [n]
        elif variant_options(n) is not None:
            group = [n]
        else:
            raise ValueError(f"unknown backend {n!r}; expected one of {', '.join(CORE_BACKENDS)}, "
                             f"dsv41-no-<family> (families: {', '.join(families) or 'unavailable'}), "
                             "dsv41[key=value;...], <row>+dspark, 'ablations', 'toggles' or 'all'")
        out += [g for g in group if g not in out]
    if not out:
        raise ValueError("no backends given")
    return out


def row_options(name: str, options: dict | None) -> dict | None:
    """dsv41 options of a dsv41 row (None for another backend): `options` for `dsv41`, plus the disabled family for an ablation, plus the
    overrides of a `dsv41[...]` row (a `+dspark` row: those of its backend)."""
    name = base_backend(name)
    if name == "dsv41":
        return dict(options or {})
    if name.startswith(ABLATION):
        opts = dict(options or {})
        opts["disable"] = sorted(set(opts.get("disable", ())) | {name[len(ABLATION):]})
        return opts
    over = variant_options(name)
    if over is not None:
        return {**dict(options or {}), **over}
    return None


def parse_row_new_tokens(items: Sequence[str]) -> dict:
    """`--row-new-tokens ROW=R` values -> {row: R}. Raises ValueError for an item without `=`, a non-integer R or
    a row given twice (the range of R is checked by `run_benchmark`)."""
    out: dict = {}
    for item in items:
        name, sep, val = item.rpartition("=")  # a row name may hold "=" itself: dsv41[pdl=false]=3
        name, val = name.strip(), val.strip()
        if not sep or not name or not re.fullmatch(r"[0-9]+", val):
            raise ValueError(f"argument --row-new-tokens: expected ROW=R with R a number of tokens, got {item!r}")
        if name in out:
            raise ValueError(f"argument --row-new-tokens: row {name!r} given twice")
        out[name] = int(val)
    return out


def cache_dir_name(row: str) -> str:
    """A directory name for row `row`'s compile caches: the name itself when it holds only letters, digits and
    `_ . + -`; else those characters with the rest as `_`, plus 8 hex digits of its SHA-1 so that two rows stay
    apart. (A name such as `dsv41[streams=false;disable=["mhc_fold"]]` in a path breaks the C++ compiler command
    Inductor runs on CPU.)"""
    safe = re.sub(r"[^A-Za-z0-9_.+-]", "_", row)
    return row if safe == row else f"{safe}-{hashlib.sha1(row.encode()).hexdigest()[:8]}"
