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
- dsv41 ops called from inside (the steps of a side-stream program) through their CUDA host code, whose
  launches and ATen kernels count as above.
Composite ATen ops that reach the counting mode whole (`contiguous`, `reshape` below the autograd key) are
decomposed there, so the copy they may make is counted. Plans depend on shapes only (`attention_plan`,
`topk_plan`; `gemv_plan`'s split-K merges through persistent arrival counters, one launch), so meta tensors give
the CUDA count. Host code that reads tensor data (`.item()`), an op meta tensors cannot run, or an argument of
symbolic size is a `CensusError` (never a guard on the size: the census must not specialise a dynamic graph), and
the caller keeps the call's count from the wrapper.

Threads: the counting is per thread. The Triton launch proxy is replaced while any census runs, by one that counts
for a thread that is running a census and launches as before for every other thread; a census inside a census
(in the same thread) counts on its own.

Source: torch.utils._python_dispatch.TorchDispatchMode; Triton 3.6-3.9 `KernelInterface.__getitem__` (the launch
proxy of `fn[grid](...)`), also `InterpretedFunction.__getitem__` under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import contextlib
import threading
import types
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from . import _common

__all__ = ["CensusError", "census", "op_launches", "program_launches", "meta_like", "cuda_hosts"]


#: ATen ops (schema names, every overload) that return a tensor without running a kernel: allocation, aliasing,
#: metadata, in-place metadata changes.
_NO_KERNEL = {
    "aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided", "aten::empty_like",
    "aten::_unsafe_view", "aten::detach", "aten::detach_", "aten::alias", "aten::lift_fresh",
    "aten::_reshape_alias", "aten::as_strided", "aten::as_strided_", "aten::resize_", "aten::resize_as_",
    "aten::set_", "aten::unsqueeze_", "aten::squeeze_", "aten::t_", "aten::transpose_", "aten::swapdims_",
    "aten::swapaxes_", "aten::record_stream",
}
_TLS = threading.local()      # .counter: the Triton launch counter of this thread's innermost census
_PATCH_LOCK = threading.Lock()
_PATCH = {"refs": 0, "saved": []}


def cuda_hosts() -> Mapping[str, Callable]:
    """{"dsv41::<op>": the Python function its CUDA kernel registration runs}: the host code the census runs on
    meta tensors, for callers outside the package that follow it to the Triton kernels it launches (read-only view
    of `_common.CUDA_HOSTS`; it fills as the kernel modules are imported)."""
    return types.MappingProxyType(_common.CUDA_HOSTS)


class CensusError(RuntimeError):
    """The host code could not run on meta tensors (it reads tensor data, runs an op meta tensors cannot run, or
    an argument has a symbolic size); the call's launches are unknown."""


def _concrete(v, what: str) -> int:
    if isinstance(v, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import is_concrete_int
        if not is_concrete_int(v):  # int(v) would guard on the size and specialise the graph
            raise CensusError(f"{what} is symbolic ({v}): the launches depend on a size the census cannot know")
    return int(v)  # a constant SymInt: no guard


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `t`'s shape, strides, storage offset and dtype (`t` real, fake or meta).
    Raises CensusError for a symbolic size, stride or offset (without guarding on it)."""
    shape = [_concrete(s, "a size") for s in t.shape]
    stride = [_concrete(s, "a stride") for s in t.stride()]
    offset = _concrete(t.storage_offset(), "a storage offset")
    numel = 1
    for s in shape:
        numel *= s
    extent = offset + (1 + sum((s - 1) * st for s, st in zip(shape, stride)) if numel else 0)
    base = torch.empty(extent, dtype=t.dtype, device="meta")
    return base.as_strided(shape, stride, offset)


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return meta_like(x)
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        from torch.fx.experimental.symbolic_shapes import is_concrete_int
        if isinstance(x, torch.SymInt) and is_concrete_int(x):
            return int(x)
        raise CensusError(f"scalar argument {x} is symbolic")
    return x


def _launches_kernel(func, out) -> bool:
    if getattr(func, "is_view", False) or func._schema.name in _NO_KERNEL:
        return False
    outs = [x for x in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(x, torch.Tensor)]
    if outs:
        return any(x.numel() > 0 for x in outs)
    return func._schema.is_mutable  # an in-place op without a tensor result (e.g. `_foreach_*_`) runs a kernel


class _CountMode(TorchDispatchMode):
    """Counts ATen kernels and runs dsv41 ops through their CUDA host code (see the module docstring)."""

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
        if name.startswith("aten::") and func.has_kernel_for_dispatch_key(
                torch._C.DispatchKey.CompositeImplicitAutograd):
            # Below the autograd key composites arrive whole (`contiguous`, `reshape`, both annotated as views):
            # decompose so that the copy they may make is seen.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if name.startswith("aten::") and _launches_kernel(func, out):
            self.aten += 1
        return out


def _patched_getitem(original):
    def getitem(kernel, grid):
        """`kernel[grid]`: this thread's census counter's launch proxy, or `original` outside a census."""
        counter = getattr(_TLS, "counter", None)
        if counter is None:  # a thread that is not taking a census launches as usual
            return original(kernel, grid)
        return counter.proxy(grid)
    getitem._dsv41_census = True
    return getitem


@contextlib.contextmanager
def _launch_proxy_patched():
    """The counting launch proxy installed on Triton's kernel classes while any thread runs a census."""
    from triton.runtime import jit
    classes = [jit.KernelInterface]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    with _PATCH_LOCK:
        if _PATCH["refs"] == 0:
            for cls in dict.fromkeys(classes):
                original = cls.__dict__.get("__getitem__")
                if original is not None:
                    _PATCH["saved"].append((cls, original))
                    cls.__getitem__ = _patched_getitem(original)
        _PATCH["refs"] += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCH["refs"] -= 1
            if _PATCH["refs"] == 0:
                for cls, original in reversed(_PATCH["saved"]):
                    cls.__getitem__ = original
                _PATCH["saved"].clear()


class _TritonCounter:
    """Launches of `fn[grid](...)` counted for this thread's census."""

    def __init__(self):
        self.launches = 0

    def proxy(self, grid):
        """A stand-in for `kernel[grid]`: calling it counts one launch (none for an empty grid), runs nothing."""
        def launch(*args, **kwargs):
            """Count the launch `kernel[grid](*args, **kwargs)` would make; returns None."""
            g = grid(kwargs) if callable(grid) else grid
            dims = tuple(g) if isinstance(g, (tuple, list)) else (g,)
            if all(isinstance(d, int) for d in dims) and any(d <= 0 for d in dims):
                return None  # an empty grid launches nothing
            self.launches += 1
            return None
        return launch


@contextlib.contextmanager
def _this_thread_counts(counter: _TritonCounter):
    outer = getattr(_TLS, "counter", None)
    _TLS.counter = counter
    _common.CENSUS.depth = getattr(_common.CENSUS, "depth", 0) + 1
    try:
        yield
    finally:
        _common.CENSUS.depth -= 1
        _TLS.counter = outer


def census(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """Kernels `fn(*args, **kwargs)` would launch on CUDA, counted by running it on meta tensors.

    Tensor arguments (also inside lists / tuples / dicts) are replaced by `meta_like` copies; `fn` is a CUDA host
    function (`_common.CUDA_HOSTS`), a dsv41 op, or a function calling some. Returns Triton launches + ATen kernels
    (module docstring). Raises CensusError when the code reads tensor data, runs an op meta tensors cannot run, or
    an argument is symbolic; the host code's own ValueError / TypeError for bad arguments pass through.
    """
    margs, mkwargs = tree_map(_to_meta, (args, kwargs))
    counter = _TritonCounter()
    with _launch_proxy_patched(), _this_thread_counts(counter), _CountMode() as mode:
        try:
            fn(*margs, **mkwargs)
        except CensusError:
            raise
        except (NotImplementedError, RuntimeError) as e:  # e.g. a device copy, or an op without a meta kernel
            raise CensusError(f"the host code ran an op meta tensors cannot run: {type(e).__name__}: {e}"[:300]) \
                from e
    return counter.launches + mode.aten


_STREAM_LAUNCH_ARGS = ("token", "tensors", "program", "slot")


def op_launches(op: str | torch._ops.OpOverload, args: Sequence, kwargs: Mapping | None = None) -> int:
    """Kernels one CUDA call of the dsv41 op `op` ("dsv41::sparse_fp4_attention" or its OpOverload) launches
    with these arguments (tensors real, fake or meta: only shapes, strides and dtypes are read). A side-stream
    `stream_launch` counts its program (`program_launches`); `stream_fork` / `stream_join` launch nothing.

    Raises: KeyError when `op` has no CUDA host function in `_common.CUDA_HOSTS` (not a dsv41 kernel op);
    CensusError as `census`.
    """
    name = op if isinstance(op, str) else op._schema.name
    kwargs = dict(kwargs or {})
    if name == "dsv41::stream_launch":
        bound = dict(zip(_STREAM_LAUNCH_ARGS, args))
        bound.update(kwargs)
        return program_launches(bound["tensors"], bound["program"])
    if name in ("dsv41::stream_fork", "dsv41::stream_join"):
        return 0  # event record / wait
    if name not in _common.CUDA_HOSTS:
        raise KeyError(f"{name} has no registered CUDA host function (dsv41.kernels._common.register_cuda)")
    return census(_common.CUDA_HOSTS[name], *args, **kwargs)


def program_launches(tensors: Sequence[torch.Tensor], program: str) -> int:
    """Kernels a side-stream program (`streams.py` format) launches on `tensors`: each step's op through its CUDA
    host code, plus the restride copies the program makes. Raises as `census`."""
    from .streams import run_program
    return census(run_program, list(tensors), program)
