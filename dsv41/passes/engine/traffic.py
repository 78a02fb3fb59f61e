"""The default byte rule of a match: what the removed ATen ops read and write when each runs as its own eager
kernel (views free) against what the fused op reads and writes, as sympy expressions in `B` and `L`.

A tensor counts per token (times the rows `B L` of the step) when the family says so and its size divides by the
token count, else once per step (parameters, caches)."""

from __future__ import annotations

from typing import Callable, Iterable

import sympy
import torch.fx as fx

from .graph import is_view_op, tensor_val, token_rows

__all__ = ["ByteTally", "per_token_closure", "op_inputs"]


def per_token_closure(seeds: Iterable[fx.Node], region: Iterable[fx.Node], inputs_of: dict) -> set:
    """`seeds` (the chain's activations) and every node of `region` (graph order) computed from one of them."""
    out = set(seeds)
    for n in region:
        if any(a in out for a in inputs_of.get(n, ())):
            out.add(n)
    return out


class ByteTally:
    """Bytes before and after one fusion, split into per-token and per-step parts.

    `lead`: the leading dims of the chain's activations ([B] or [B, T] or more: see `token_rows`); `per_token(n)`
    says whether node `n`'s tensor scales with the tokens of the step."""

    def __init__(self, lead: Iterable[int], per_token: Callable[[fx.Node], bool]):
        self.rows, self.subs = token_rows(tuple(lead))
        ntok = 1
        for s in lead:
            ntok *= int(s)
        self.ntok = max(ntok, 1)
        self.per_token = per_token
        self.totals = {"before": [0, 0], "after": [0, 0]}  # [bytes per token, bytes per step]

    def add(self, key: str, n, value_of: fx.Node | None = None, per: bool | None = None) -> None:
        """Add the bytes of `n`'s tensor value (of `value_of`'s when given: a gather's rows instead of its table) to
        `key` ("before" / "after"): per token when `per` (default: `per_token(n)`) and the size divides by the
        tokens, else per step; a node without a tensor value adds nothing."""
        v = tensor_val(value_of if value_of is not None else n)
        if v is None:
            return
        nbytes = v.numel() * v.element_size()
        tok = self.per_token(n) if per is None else per
        if tok and nbytes % self.ntok == 0:
            self.totals[key][0] += nbytes // self.ntok
        else:
            self.totals[key][1] += nbytes

    def add_removed(self, gone: Iterable[fx.Node], inputs_of: dict, read=None) -> None:
        """The eager traffic of the removed nodes `gone`: each non-view node's output and its inputs
        (`inputs_of`, kept from before the rewrite). `read(key, node, input)` replaces the default count of one
        input when given (a gather that reads rows, not its whole table)."""
        for n in gone:
            if is_view_op(n) or tensor_val(n) is None:
                continue
            self.add("before", n)
            for a in inputs_of.get(n, ()):
                if read is not None:
                    read("before", n, a)
                else:
                    self.add("before", a)

    def result(self) -> tuple[str, str, dict]:
        """(before, after, {"B": value, "L": value}): expressions as strings for a `MatchRecord`."""
        before, after = (sympy.Integer(self.totals[k][0]) * self.rows + self.totals[k][1] for k in ("before", "after"))
        return str(sympy.expand(before)), str(sympy.expand(after)), self.subs


def op_inputs(args: tuple) -> list:
    """The node arguments of a fused op, with the tensor of a ("permute" / "reshape", node, ...) deferred view."""
    return [a for a in args if isinstance(a, fx.Node)] + [a[1] for a in args if isinstance(a, tuple)]
