"""Bounded text for Inductor's "implicit fallback" log line, so a deep graph does not stall the compile.

When Inductor lowers an op it has no lowering for (every `dsv41::` custom op the first time it meets it, and
any ATen op without one), `GraphLowering.call_function` logs "Creating implicit fallback for:" with
`OperatorIssue.operator_str(target, args, kwargs)`. Up to torch 2.11 that text is built eagerly, logging on or
off, and it is the `str()` of every input IR node, which nests the text of that node's inputs, their inputs and
their stack traces. Nothing memoises it, so on a graph shaped like a DAG the text grows with the number of paths
back to the graph inputs. On the H200 (torch 2.11, 2026-11-30) a cold whole-model compile of `small` was building
that string in 46 of the 61 samples (2 s apart) taken inside Inductor's `compile_fx_inner`, and did not finish
in 300 s (bench/results/2026-11-30_h200_s9/). torch 2.13 wraps the call in a `LazyString`, so it runs only with
Inductor's INFO log on, where the same blow-up would return.

`bounded_operator_text()` swaps `operator_str` for one that names each argument by type, buffer name, size and
dtype without calling the IR nodes' `__str__`, for the duration of one dsv41 compile. It changes log and error
text only, never what is lowered. vLLM carries the same kind of patch for the same log line.
"""

from __future__ import annotations

import contextlib
import textwrap
import threading
from typing import Any

#: Longest sequence / text rendered in full; the rest is counted.
_MAX_ITEMS = 8
_MAX_CHARS = 120


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_CHARS else text[:_MAX_CHARS - 3] + "..."


def _ir_text(x: Any) -> str:
    """`Type(of=..., name=..., size=[...], dtype=...)` of an Inductor IR node (`of`: what a TensorBox /
    StorageBox holds), from accessors that do not format inputs."""
    from torch._inductor import ir

    fields, inner = [], x
    for _ in range(4):
        if not isinstance(inner, ir.MutableBox):
            break
        inner = inner.data
    if inner is not x:
        fields.append(f"of={type(inner).__name__}")
    for label, get in (("name", "get_name"), ("size", "get_size"), ("dtype", "get_dtype")):
        try:
            value = getattr(x, get)()
        except Exception:  # noqa: BLE001 - views, boxes and extern outputs lack some accessors
            continue
        fields.append(f"{label}={_clip(str(list(value)) if label == 'size' else str(value))}")
    return f"{type(x).__name__}({', '.join(fields)})"


def brief(x: Any, depth: int = 0) -> str:
    """One argument of a lowered op as short text: by value for primitives, dtypes, devices, sizes and short
    containers of them; by type, buffer name, size and dtype for IR nodes and tensors; by type name otherwise.

    Never calls `__str__` / `__repr__` of an IR node (that is the cost this module avoids).
    """
    import torch
    from torch._inductor import ir

    if x is None or isinstance(x, (bool, int, float, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return repr(x) if not isinstance(x, (torch.dtype, torch.device)) else str(x)
    if isinstance(x, str):
        return _clip(repr(x))
    if isinstance(x, ir.IRNode):
        return _ir_text(x)
    if isinstance(x, torch.Tensor):
        return f"Tensor(size={list(x.shape)}, dtype={x.dtype}, device={x.device})"
    if isinstance(x, (list, tuple, torch.Size)):
        if depth >= 2:
            return f"{type(x).__name__}(len={len(x)})"
        items = [brief(v, depth + 1) for v in list(x)[:_MAX_ITEMS]]
        more = f", ... (+{len(x) - _MAX_ITEMS})" if len(x) > _MAX_ITEMS else ""
        open_, close = ("[", "]") if isinstance(x, list) else ("(", ")")
        return f"{open_}{', '.join(items)}{more}{close}"
    if isinstance(x, dict):
        if depth >= 2:
            return f"dict(len={len(x)})"
        items = [f"{k!r}: {brief(v, depth + 1)}" for k, v in list(x.items())[:_MAX_ITEMS]]
        more = f", ... (+{len(x) - _MAX_ITEMS})" if len(x) > _MAX_ITEMS else ""
        return "{" + ", ".join(items) + more + "}"
    try:
        import sympy
        if isinstance(x, sympy.Basic):
            return _clip(str(x))
    except ImportError:
        pass
    return type(x).__name__


def bounded_operator_str(target: Any, args: Any, kwargs: Any) -> str:
    """Drop-in for `torch._inductor.exc.OperatorIssue.operator_str`: the same layout ("target: ...",
    "args[i]: ...", "kwargs: ...", indented two spaces) with each argument rendered by `brief`."""
    lines = [f"target: {target}"] + [f"args[{i}]: {brief(a)}" for i, a in enumerate(args)]
    if kwargs:
        lines.append(f"kwargs: {brief(dict(kwargs))}")
    return textwrap.indent("\n".join(lines), "  ")


_LOCK = threading.Lock()
#: Open `bounded_operator_text` blocks (any thread) and the `operator_str` they replaced: the first block in
#: installs the bounded text, the last one out restores the original, whatever order the blocks close in.
_STATE: dict = {"depth": 0, "saved": None}


@contextlib.contextmanager
def bounded_operator_text():
    """Within the block, Inductor's `OperatorIssue.operator_str` is `bounded_operator_str`; the original comes back
    when the last open block (of any thread: compiles may overlap) closes, also on error. A torch without that
    hook is left alone. dsv41 opens it around each compile and inside its `inner_compile`, which also covers a
    backward graph that AOT autograd compiles later, at the first `.backward()`."""
    try:
        from torch._inductor.exc import OperatorIssue
    except ImportError:
        yield
        return
    with _LOCK:
        if _STATE["depth"] == 0:
            _STATE["saved"] = OperatorIssue.__dict__.get("operator_str")
            if _STATE["saved"] is not None:
                OperatorIssue.operator_str = staticmethod(bounded_operator_str)
        _STATE["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["depth"] -= 1
            if _STATE["depth"] == 0 and _STATE["saved"] is not None:
                OperatorIssue.operator_str = _STATE["saved"]
                _STATE["saved"] = None
