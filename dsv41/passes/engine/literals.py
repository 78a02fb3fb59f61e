"""Literal discovery: the numbers a region spells out (eps, softmax scales, offsets), in graph order, which a family
tries as the values of its op's constants before pinning them with probes."""

from __future__ import annotations

from typing import Iterable

import torch.fx as fx

__all__ = ["float_literals", "int_literals", "eps_candidates", "discover"]


def _distinct_arguments(nodes: Iterable[fx.Node], keep) -> list:
    """Distinct arguments `a` (args and kwargs, nested lists included) of `nodes` with `keep(a)`, in order."""
    out: list = []

    def visit(a):
        """Collect `a` when kept and not seen yet; returns it unchanged."""
        if keep(a) and a not in out:
            out.append(a)
        return a

    for n in nodes:
        fx.node.map_aggregate(n.args, visit)
        fx.node.map_aggregate(n.kwargs, visit)
    return out


def float_literals(nodes: Iterable[fx.Node], above: float = 0.0, below: float | None = None) -> list[float]:
    """Distinct float arguments (args and kwargs, nested lists included) of `nodes` with above < value (< below when
    given), in order of appearance; NaN never qualifies."""
    return _distinct_arguments(nodes, lambda a: isinstance(a, float) and a > above and (below is None or a < below))


def int_literals(nodes: Iterable[fx.Node], above: int = 0, below: int = 2 ** 31) -> list[int]:
    """Distinct int arguments (not bools; args and kwargs, nested lists included) of `nodes` with above < value <
    below, in order of appearance."""
    return _distinct_arguments(nodes, lambda a: isinstance(a, int) and not isinstance(a, bool) and above < a < below)


def eps_candidates(nodes: Iterable[fx.Node], below: float = 1e-2) -> list[float]:
    """The eps candidates of a region: its float literals in (0, `below`), in order of appearance, then 0.0."""
    return float_literals(nodes, below=below) + [0.0]


def discover(candidates, match) -> tuple:
    """(value, found) for the first of `candidates` for which `match(value)` finds something (not None), else
    (None, None): how a family settles a constant (an eps, a round count) among the values a region may use."""
    for value in candidates:
        found = match(value)
        if found is not None:
            return value, found
    return None, None
