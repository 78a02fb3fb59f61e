"""Kernels per step before / after dsv41, counted with torch.profiler on a real execution of one graph.

`count_step_kernels(gm, compiled, example_inputs)` runs the graph twice — the Dynamo graph op by op (eager,
"before") and the compiled artifact ("after") — each once to warm up and once under the profiler, and counts:

- on CUDA: every device activity the profiler records in the run (kernel launches, plus the memcpy/memset
  the run issues), i.e. launches per step;
- on CPU (no device kernels exist): every top-level operator call that computes — an ATen / dsv41 op with no
  enclosing op whose subtree contains at least one non-view, non-allocation op — plus every kernel Inductor
  generated (its C++ kernels carry a profiler label while counting, `cpp.enable_kernel_profile`). An eager
  `aten::linear` counts once, as does a fused dsv41 op; views, reshapes and empty allocations count zero.

The graph's inputs are the example inputs Dynamo passed to the backend. Inputs the graph mutates (caches)
are found by running the graph on fake tensors and watching their version counters; the counting runs get
clones of those, so counting never changes the model's state. The RNG state is restored afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from typing import Callable, Iterator, Sequence

import torch

from .report import KernelCount

__all__ = ["count_step_kernels", "quiet_profile", "CPU_METHOD", "CUDA_METHOD"]

CUDA_METHOD = "CUDA device activities recorded by torch.profiler in one run of the graph"
CPU_METHOD = ("top-level computing operator calls + Inductor C++ kernels in one run of the graph "
              "(views and allocations excluded)")
_MARK = "dsv41 counted step"
_INDUCTOR_KERNEL = re.compile(r"^graph_\d+_|cpp_fused|^kernel_cpp")
#: ATen ops that move no data: views, metadata and allocations (an op counts only if its subtree has others).
NO_COMPUTE = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view", "reshape", "_reshape_alias",
    "_unsafe_view", "as_strided", "expand", "expand_as", "t", "transpose", "permute", "unsqueeze", "squeeze",
    "select", "slice", "narrow", "alias", "detach", "detach_", "lift_fresh", "resolve_conj", "resolve_neg",
    "view_as_real", "view_as_complex", "unflatten", "flatten", "split", "split_with_sizes", "chunk", "unbind",
    "numpy_T", "movedim", "unfold", "diagonal", "result_type", "size", "stride", "dim", "is_nonzero",
    "_has_compatible_shallow_copy_type", "set_", "resize_", "record_stream", "to",
}


@contextlib.contextmanager
def _quiet_fd2() -> Iterator[None]:
    """Send the process's file descriptor 2 to /dev/null inside the block (Python's sys.stderr is flushed first).

    Kineto, below Python, prints "USDT: ... profiler_start" / "profiler_stop" lines to fd 2 at every profiler
    start and stop; its log level (KINETO_LOG_LEVEL) is read once per process, at the first start, so setting it
    here would not help after a user's own profiler run. Only the start and the stop are wrapped, never the
    profiled code, so nothing of the user's goes missing."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no fd 2 (embedded interpreters): nothing to quiet
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
        finally:
            os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def quiet_profile(activities) -> Iterator:
    """`torch.profiler.profile(activities=activities)` without Kineto's start / stop lines on stderr.

    Yields the started profiler (read `prof.events()` after the block). Raises what the profiler raises.
    """
    from torch.profiler import profile

    prof = profile(activities=activities)
    with _quiet_fd2():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _quiet_fd2():
            prof.__exit__(None, None, None)


def _is_op(name: str) -> bool:
    return "::" in name or bool(_INDUCTOR_KERNEL.search(name))


def _computes(name: str) -> bool:
    if _INDUCTOR_KERNEL.search(name):
        return True
    return name.split("::", 1)[-1].split(".")[0] not in NO_COMPUTE


def _count_cpu(events) -> int:
    """Top-level computing ops under the marker (see module docstring)."""
    children: dict = {}
    roots = []
    for e in events:
        if e.name == _MARK:
            roots.append(e)
        parent = e.cpu_parent
        if parent is not None:
            children.setdefault(id(parent), []).append(e)

    def subtree_computes(e) -> bool:
        """Whether profiler event `e` or any event nested under it is a computing (non-annotation) op."""
        stack = [e]
        while stack:
            x = stack.pop()
            if _is_op(x.name) and _computes(x.name):
                return True
            stack.extend(children.get(id(x), ()))
        return False

    count = 0
    for root in roots:
        stack = list(children.get(id(root), ()))
        while stack:
            e = stack.pop()
            if _is_op(e.name):
                count += subtree_computes(e)
            else:  # an annotation (e.g. Inductor's "## Call CompiledFxGraph ##"): look inside
                stack.extend(children.get(id(e), ()))
    return count


def _count_cuda(events) -> int:
    cuda = torch.autograd.DeviceType.CUDA
    return sum(1 for e in events if e.device_type == cuda)


def _mutated_inputs(gm: Callable, inputs: Sequence) -> set[int] | None:
    """Indices of tensor inputs the graph writes in place (fake run, version counters); None if unknown."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakes = []
    with mode:
        for t in inputs:
            if isinstance(t, torch.Tensor):
                # Fresh fakes (not from_tensor) so inference-mode inputs still get version counters.
                fakes.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device))
            else:
                fakes.append(t)
    versions = [f._version if isinstance(f, torch.Tensor) else None for f in fakes]
    try:
        with torch.inference_mode(False), torch.no_grad(), mode:
            gm(*fakes)
    except Exception:  # the fake run is only a probe for mutations; a failure means "unknown"
        return None
    return {i for i, (f, v) in enumerate(zip(fakes, versions)) if isinstance(f, torch.Tensor) and f._version != v}


def _concrete(v):
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        from ..passes.engine import size_hint
        return size_hint(v)
    return v


def count_step_kernels(gm: Callable, compiled: Callable, example_inputs: Sequence) -> KernelCount:
    """Count the kernels one run of `gm` (eager) and of `compiled` launch on `example_inputs`.

    Returns a `KernelCount` (before = eager, after = compiled); `before`/`after` are None with a `note` when the
    inputs are not real tensors (e.g. fake tensors under export) or a run failed.
    """
    from torch._subclasses.fake_tensor import is_fake

    # Dynamic-shape graphs take their symbolic sizes as inputs: run with the sizes of this example.
    example_inputs = [_concrete(v) for v in example_inputs]
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    device = "cuda" if any(t.is_cuda for t in tensors) else "cpu"
    method = CUDA_METHOD if device == "cuda" else CPU_METHOD
    if any(is_fake(t) or t.is_meta for t in tensors):
        return KernelCount(device, None, None, method, "example inputs are not real tensors")
    mutated = _mutated_inputs(gm, example_inputs)
    if mutated is None:  # unknown: protect every input
        mutated = {i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)}

    def fresh():
        """The example inputs, with the ones the graph writes in place cloned so every run starts alike."""
        return [t.clone() if i in mutated else t for i, t in enumerate(example_inputs)]

    from torch.profiler import ProfilerActivity, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device == "cuda" else None

    def measure(fn) -> int:
        """Kernels one profiled run of `fn` launches, after one unprofiled warm-up run."""
        fn(*fresh())  # warm-up: lazy initialisation and autotuning are not part of a step
        args = fresh()
        if device == "cuda":
            torch.cuda.synchronize()
        with warnings.catch_warnings():
            # torch 2.11 warns that a profiler cycle keeps only its own events: exactly what is wanted here.
            warnings.simplefilter("ignore", UserWarning)
            with quiet_profile(activities) as prof:
                with record_function(_MARK):
                    fn(*args)
                if device == "cuda":
                    torch.cuda.synchronize()
            events = prof.events()
        return _count_cuda(events) if device == "cuda" else _count_cpu(events)

    try:
        with torch.no_grad():
            before = measure(gm)
            after = measure(compiled)
    except Exception as e:  # counting is diagnostic: report why, never fail the compile
        return KernelCount(device, None, None, method, f"profiling failed: {type(e).__name__}: {e}")
    finally:
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return KernelCount(device, before, after, method)
