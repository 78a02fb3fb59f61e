"""Values known only at run time (dynamic shapes): finding them among a chain's inputs, and the near-miss of a
chain that reads one (families verify and plan kernels for the compiled sizes only)."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.fx as fx

from ..records import NearMiss, SourceLocation
from .graph import node_label

__all__ = ["symbolic_part", "static_refusal"]


def _runtime_int(v) -> bool:
    """Whether `v` is a SymInt / SymFloat / SymBool whose value is known only at run time."""
    if not isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    expr = getattr(v.node, "expr", None)
    return expr is None or bool(getattr(expr, "free_symbols", True))


def symbolic_part(values: Iterable) -> str | None:
    """A description of the first of `values` (graph nodes, or the plain arguments a rewrite would pass) that is
    known only at run time, or None when all are static: a tensor node with a symbolic size (dynamic shapes), a
    node whose value is a symbolic int (`sym_size`, `min(k, length)`), or a SymInt argument. Strides are not
    looked at: the fused ops read them at run time."""
    for v in values:
        if isinstance(v, (list, tuple)):
            inner = symbolic_part(v)
            if inner is not None:
                return inner
            continue
        if _runtime_int(v):
            return f"the value {v} known only at run time"
        if not isinstance(v, fx.Node):
            continue
        val = v.meta.get("val")
        if isinstance(val, torch.Tensor):
            dims = [f"dim {d} = {s}" for d, s in enumerate(val.shape) if _runtime_int(s)]
            if dims:
                return f"{v.name} ({node_label(v) if v.op == 'call_function' else v.op}) has a size known only at " \
                       f"run time ({', '.join(dims)})"
        elif _runtime_int(val):
            return f"{v.name} ({node_label(v) if v.op == 'call_function' else v.op}) is an int known only at run " \
                   f"time ({val})"
    return None


def static_refusal(family: str, pattern: str, values: Iterable, location: "SourceLocation | None",
                   op: str = "the fused op", check: str = "static_shapes") -> "NearMiss | None":
    """The near-miss of a chain that matched on its compile-time sizes but reads `values` of which one is known
    only at run time (see `symbolic_part`), or None when all are static.

    Why: a family verifies a chain on probe tensors of the compiled sizes and bakes sizes into the fused op's
    arguments and kernel plans; under dynamic shapes (Dynamo's automatic dynamic after a size changes, or
    `dynamic=True`) the same graph then runs at other sizes, where such an op would read the wrong extent. Such a
    chain stays with Inductor, which compiles it for every size. `check` names it (`static_shapes`, or `static_k`
    for a top-k whose k is computed in the graph)."""
    what = symbolic_part(values)
    if what is None:
        return None
    return NearMiss(family, pattern, check, f"{what}; {family} fuses this chain into {op} only at compile-time sizes "
                    "(it verifies the chain and plans the kernel for them), so it stays with Inductor, which handles "
                    "sizes known only at run time", location)
