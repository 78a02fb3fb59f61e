"""Launch census: how many GPU kernels one call of a dsv41 op launches on CUDA, counted without a GPU.

Issue 4 asks for the kernels a decode step launches per layer role, and the compiler counts them statically from
Inductor's wrapper (`dsv41/compiler/kernel_counts.py`), where a dsv41 op is one call. Some ops launch more than
one kernel: `sparse_fp4_attention` adds a combine kernel when its keys are split across programs, the indexer's
top-k a second select stage over wide rows, and any op a layout copy when an input arrives with a stride its
kernel cannot read. On the H200 (bench/results/2026-11-30_h200_s13, `h200`, 64-token decode) the static count
was 1,763 and the profiler's 1,815: 38 of the 52 missing launches were the attention combine kernel.

The census runs the op's CUDA host function (`_common.CUDA_HOSTS`, the code a CUDA call runs) on meta tensors of
the call's shapes, strides and dtypes, and counts instead of launching:
- every Triton launch `kernel[grid](...)` with a non-empty grid (Triton's launch proxy is replaced for the
  duration; nothing is compiled);
- every ATen op that runs a kernel on CUDA: not a view, not an allocation, not metadata, with a non-empty output
  (`.contiguous()` copies, `zeros` fills, gathers, casts);
- dsv41 ops called from inside (side-stream programs) by their own census.
Plans depend on shapes only (`attention_plan`, `topk_plan`, `gemv_plan`'s split-K uses arrival counters, one
launch), so meta tensors give the CUDA count. Host code that reads tensor data (`.item()`) cannot run on meta
tensors: `CensusError`, and the caller counts the call as one launch.

Source: torch.utils._python_dispatch.TorchDispatchMode; Triton 3.6-3.9 `KernelInterface.__getitem__` (the launch
proxy of `fn[grid](...)`), also `InterpretedFunction.__getitem__` under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from . import _common

__all__ = ["CensusError", "census", "op_launches", "program_launches", "meta_like"]

aten = torch.ops.aten

#: ATen ops that return a tensor without running a kernel (allocation, aliasing, metadata).
_NO_KERNEL = {
    aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default, aten.new_empty_strided.default,
    aten.empty_like.default, aten._unsafe_view.default, aten.detach.default, aten.alias.default,
    aten.lift_fresh.default, aten._reshape_alias.default, aten.as_strided.default, aten.resize_.default,
    aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
}
_LOCK = threading.Lock()


class CensusError(RuntimeError):
    """The host code could not run on meta tensors (it reads tensor data, or an argument has a symbolic
    shape); the call's launches are unknown."""


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `t`'s shape, strides, storage offset and dtype (`t` real, fake or meta).
    Raises CensusError for symbolic sizes or strides."""
    try:
        shape = [int(s) for s in t.shape]
        stride = [int(s) for s in t.stride()]
        offset = int(t.storage_offset())
    except (TypeError, ValueError, RuntimeError) as e:  # an unbacked / symbolic size has no int value
        raise CensusError(f"argument of shape {tuple(t.shape)} has no concrete size: {e}") from e
    numel = 1
    for s in shape:
        numel *= s
    extent = offset + (1 + sum((s - 1) * st for s, st in zip(shape, stride)) if numel else 0)
    base = torch.empty(extent, dtype=t.dtype, device="meta")
    return base.as_strided(shape, stride, offset)


def _launches_kernel(func, out) -> bool:
    if getattr(func, "is_view", False) or func in _NO_KERNEL:
        return False
    outs = [x for x in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(x, torch.Tensor)]
    if outs:
        return any(x.numel() > 0 for x in outs)
    # In-place ops that return nothing (e.g. `_foreach`): count when they touch a non-empty tensor.
    return func._schema.is_mutable


class _CountMode(TorchDispatchMode):
    """Counts ATen kernels and expands dsv41 ops into their CUDA host code (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.aten = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        host = _common.CUDA_HOSTS.get(name)
        if host is not None:
            with self:
                return host(*args, **kwargs)
        if name in ("aten::_local_scalar_dense", "aten::item"):
            raise CensusError(f"{name}: the host code reads tensor data")
        out = func(*args, **kwargs)
        if name.startswith("aten::") and _launches_kernel(func, out):
            self.aten += 1
        return out


class _TritonCounter:
    """Replaces the `fn[grid]` launch proxy of every Triton kernel with a counter while active."""

    def __init__(self):
        self.launches = 0
        self.saved: list = []

    def _proxy(self, kernel, grid):
        def launch(*args, **kwargs):
            g = grid(kwargs) if callable(grid) else grid
            dims = tuple(g) if isinstance(g, (tuple, list)) else (g,)
            if all(isinstance(d, int) for d in dims) and any(d <= 0 for d in dims):
                return None  # an empty grid launches nothing
            self.launches += 1
            return None
        return launch

    def __enter__(self):
        from triton.runtime import jit
        classes = [jit.KernelInterface, jit.JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction
            classes.append(InterpretedFunction)
        except ImportError:
            pass
        counter = self
        for cls in dict.fromkeys(classes):
            self.saved.append((cls, cls.__dict__.get("__getitem__")))
            cls.__getitem__ = lambda kernel, grid: counter._proxy(kernel, grid)
        return self

    def __exit__(self, *exc):
        for cls, orig in reversed(self.saved):
            if orig is None:
                del cls.__getitem__
            else:
                cls.__getitem__ = orig
        return False


@contextlib.contextmanager
def _census_scope():
    _common._CENSUS.depth = getattr(_common._CENSUS, "depth", 0) + 1
    try:
        yield
    finally:
        _common._CENSUS.depth -= 1


def census(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """Kernels `fn(*args, **kwargs)` would launch on CUDA, counted by running it on meta tensors.

    Tensor arguments (also inside lists / tuples / dicts) are replaced by `meta_like` copies; `fn` is typically a
    dsv41 op (`torch.ops.dsv41.<op>.default`) or a function calling some. Returns Triton launches + ATen kernels
    (module docstring). Raises CensusError when the code reads tensor data or a size is symbolic; whatever the
    host code itself raises for bad arguments (its ValueError / TypeError) passes through.
    """
    margs, mkwargs = tree_map(lambda x: meta_like(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    with _LOCK, _census_scope(), _TritonCounter() as triton_count, _CountMode() as mode:
        try:
            fn(*margs, **mkwargs)
        except NotImplementedError as e:  # a meta kernel missing for an ATen op the host code calls
            raise CensusError(f"host code ran an op without a meta kernel: {e}") from e
    return triton_count.launches + mode.aten


def op_launches(op: str | torch._ops.OpOverload, args: Sequence, kwargs: Mapping | None = None) -> int:
    """Kernels one CUDA call of the dsv41 op `op` ("dsv41::sparse_fp4_attention" or its OpOverload) launches
    with these arguments (tensors real, fake or meta: only shapes, strides and dtypes are read).

    Raises: KeyError when `op` has no CUDA host function in `_common.CUDA_HOSTS` (not a dsv41 kernel op);
    CensusError as `census`.
    """
    name = op if isinstance(op, str) else op._schema.name
    if name == "dsv41::stream_launch":
        a = list(args) + [None] * 4
        return program_launches(a[1], a[2])
    if name in ("dsv41::stream_fork", "dsv41::stream_join"):
        return 0  # event record / wait
    if name not in _common.CUDA_HOSTS:
        raise KeyError(f"{name} has no registered CUDA host function (dsv41.kernels._common.register_cuda)")
    return census(_common.CUDA_HOSTS[name], *args, **(kwargs or {}))


def program_launches(tensors: Sequence[torch.Tensor], program: str) -> int:
    """Kernels a side-stream program (`streams.py` format) launches on `tensors`: each step's op as by
    `op_launches`, plus the restride copies the program makes. Raises as `census`."""
    from .streams import run_program
    return census(run_program, list(tensors), program)
