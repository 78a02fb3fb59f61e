"""Side-stream fork / join custom ops that the stream scheduler (`dsv41/compiler/streams.py`) puts in the graph.

ARCHITECTURE.md "Pipeline stages" 3 and "Known traps" (side streams inside CUDA graphs). A region of work the
scheduler moves off the main stream — dsv41 ops written down as a small JSON *program* (the scheduler puts one op
in each region today; the format takes a chain) — becomes:

    t0   = dsv41::stream_fork(tensors, slot)                   # right after the region's inputs are produced
    ...    the first main-branch kernel                          # the main branch is issued first
    t1   = dsv41::stream_launch(t0, tensors, program, slot)    # the region, on the side stream
    ...    more main-stream work independent of the region ...
    outs = dsv41::stream_join(t1, tensors, program, slot)      # right before the first consumer
    getitem(outs, i) replaces output i of the region

`stream_fork` (CUDA): records the region's fork event on the current stream. That is the main stream: Inductor's
Triton kernels use the raw stream it fetched at the top of the call, which is the current stream then, and its
extern / custom ops use the current stream, which dsv41 never changes outside `stream_launch`.
`stream_launch`: makes the per-device side stream wait for the fork event, runs the program under
`torch.cuda.stream(side)` (every launch inside goes to the side stream), records the done event on the side
stream and keeps the outputs in a thread-local table under `slot`. `stream_join`: makes the current stream wait
for the done event and returns the kept outputs. Each op returns what the next takes (0-element tokens), so
Inductor keeps the three in order.

Why this shape (facts of Inductor's generated code, torch 2.11-2.14 `_inductor/codegen/wrapper.py`):
- consumers read the JOIN's outputs, so Inductor orders every consumer after the join by data dependence, however
  it reorders or fuses the rest; the join reads the token, so it runs after the fork;
- the join takes the region's input tensors as arguments too: Inductor's liveness then keeps their buffers alive
  (no `del`, no buffer reuse by a later kernel of the main stream) until the join, after which the main stream
  has waited for the side stream, so nothing can overwrite memory the side stream still reads;
- outputs are allocated by the ops on the side stream (the side stream's caching-allocator pool) and then read
  on the main stream; the join marks them used there (`record_stream`), otherwise a later region could reuse the
  block on the side stream while a main-stream kernel that was enqueued after that region's fork still reads it
  (during capture the allocator defers such frees to the end of the capture);
- the three ops carry the `flexible_layout` tag so that Inductor hands fork and join the very same buffers (a layout
  copy made for one of them would leave the other holding a different buffer); the program restores the strides
  the moved op was traced with (`stride` in the program) by copying on the side stream when they differ;
- dsv41's split-K kernels share one arrival-counter buffer per device (`_common.split_k_counters`); two such
  launches running at once on two streams would corrupt each other's counters, so side-stream launches use a
  second buffer of their own (swapped in for the duration of the program; Python launches are synchronous).

CUDA graphs: the fork / join events become graph edges when captured (seen on the H200; `tests/test_streams_gpu.py`
replays such graphs). cuBLAS must have run once on the side stream before capture, and the side stream's
counter buffer must exist outside the graph's memory pool: `prepare_side_stream(device)` does both (the compiler
calls it before CUDA-graph trees record; every fork also calls it, which does nothing once done or while capturing).

CPU: no streams; the launch runs the program and the join returns its outputs (a no-op schedule, same numbers).

Program format (JSON): `{"steps": [{"op": "dsv41::name.overload", "args": [...], "kwargs": {...}}...],
"outputs": [[step, index], ...], "stride": {"<tensor index>": [strides]}}` with arguments encoded as
`{"t": i}` (the i-th tensor of `tensors`), `{"o": [step, index]}` (output `index` of an earlier step; index -1
for a step returning one tensor), `{"dtype": "float32"}`, lists, and JSON scalars.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any, Sequence

import torch

__all__ = ["stream_fork", "stream_launch", "stream_join", "run_program", "encode_arg", "prepare_side_stream",
           "side_stream", "side_streams_used"]

_TLS = threading.local()
#: device index -> side stream (one reused side stream per device: ARCHITECTURE.md "Known traps").
_SIDE: dict[int, "torch.cuda.Stream"] = {}
#: device index -> split-K arrival counters used by launches on the side stream.
_SIDE_COUNTERS: dict[int, torch.Tensor] = {}
#: (device index, slot) -> (fork event, done event), created once and reused by every call.
_EVENTS: dict[tuple[int, int], tuple] = {}


def _pending() -> dict:
    p = getattr(_TLS, "pending", None)
    if p is None:
        p = _TLS.pending = {}
    return p


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one side stream of CUDA `device` (created on first use, then reused by every region and layer)."""
    idx = _index(torch.device(device))
    s = _SIDE.get(idx)
    if s is None:
        s = _SIDE[idx] = torch.cuda.Stream(device=torch.device("cuda", idx))
    return s


def side_streams_used() -> int:
    """Number of side streams created in this process (one per CUDA device that ran a fork)."""
    return len(_SIDE)


def prepare_side_stream(device: torch.device) -> None:
    """Create `device`'s side stream, its split-K counter buffer, and initialise cuBLAS / cuBLASLt on it (a tiny
    matmul in fp32 and bf16), all outside any CUDA graph: capture fails with CUBLAS_STATUS_NOT_INITIALIZED
    otherwise (seen on the H200). A no-op on CPU, when already done, and while a capture is running."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return
    idx = _index(device)
    if idx in _SIDE_COUNTERS:
        return
    from ._common import COUNTER_SLOTS, prepare_device
    prepare_device(device)
    dev = torch.device("cuda", idx)
    s = side_stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for dt in (torch.float32, torch.bfloat16):
            a = torch.ones(8, 8, dtype=dt, device=dev)
            torch.mm(a, a)
            torch.nn.functional.linear(a, a, a[0])
        counters = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=dev)
    torch.cuda.current_stream(dev).wait_stream(s)
    _SIDE_COUNTERS[idx] = counters


class _SideCounters:
    """Swap `_common.COUNTERS[device]` for the side stream's own buffer while the program launches."""

    def __init__(self, idx: int):
        self.idx = idx

    def __enter__(self):
        from . import _common
        self.saved = _common.COUNTERS.get(self.idx)
        _common.COUNTERS[self.idx] = _SIDE_COUNTERS[self.idx]

    def __exit__(self, *exc):
        from . import _common
        if self.saved is None:
            _common.COUNTERS.pop(self.idx, None)
        else:
            _common.COUNTERS[self.idx] = self.saved
        return False


# ------------------------------------------------------------------------------------------------ programs
def encode_arg(a: Any, tensor_index) -> Any:
    """JSON form of one op argument for a program (module docstring). `tensor_index(x)` maps a graph value
    that is a tensor to its `{"t": i}` / `{"o": [...]}` reference. Raises TypeError for values a program cannot
    hold (SymInts, devices, memory formats...)."""
    if isinstance(a, (list, tuple)):
        return [encode_arg(x, tensor_index) for x in a]
    if a is None or isinstance(a, (bool, int, float, str)):
        if isinstance(a, float) and a != a:
            raise TypeError("NaN scalar argument")
        return a
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).replace("torch.", "")}
    ref = tensor_index(a)
    if ref is None:
        raise TypeError(f"argument of type {type(a).__name__} cannot be moved to a side-stream program")
    return ref


def _resolve_op(name: str):
    ns, _, rest = name.partition("::")
    opname, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), opname), overload or "default")


@functools.lru_cache(maxsize=512)
def _parse(program: str) -> dict:
    p = json.loads(program)
    for st in p["steps"]:
        st["_op"] = _resolve_op(st["op"])
    return p


def _decode(a: Any, tensors: Sequence[torch.Tensor], results: list) -> Any:
    if isinstance(a, list):
        return [_decode(x, tensors, results) for x in a]
    if isinstance(a, dict):
        if "t" in a:
            return tensors[a["t"]]
        if "o" in a:
            step, i = a["o"]
            r = results[step]
            return r if i < 0 else r[i]
        if "dtype" in a:
            return getattr(torch, a["dtype"])
        raise ValueError(f"bad program argument {a!r}")
    return a


def _restride(tensors: Sequence[torch.Tensor], strides: dict) -> list:
    """The tensors with the strides the moved op was traced with (copies where a dim of size > 1 differs)."""
    out = list(tensors)
    for k, want in strides.items():
        t = out[int(k)]
        if t.dim() != len(want):
            continue
        if any(s > 1 and st != w for s, st, w in zip(t.shape, t.stride(), want)):
            c = torch.empty_strided(t.shape, want, dtype=t.dtype, device=t.device)
            c.copy_(t)
            out[int(k)] = c
    return out


def run_program(tensors: Sequence[torch.Tensor], program: str) -> list[torch.Tensor]:
    """Run a program's steps in order on the current stream and return its output tensors (list).

    Works on real and on fake tensors (the join's fake function runs it under FakeTensorMode).
    Raises ValueError for a malformed program, and whatever the ops themselves raise.
    """
    p = _parse(program)
    tensors = _restride(tensors, p.get("stride", {}))
    results: list = []
    for st in p["steps"]:
        args = _decode(st["args"], tensors, results)
        kwargs = {k: _decode(v, tensors, results) for k, v in st["kwargs"].items()}
        results.append(st["_op"](*args, **kwargs))
    outs = []
    for step, i in p["outputs"]:
        r = results[step]
        outs.append(r if i < 0 else r[i])
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise ValueError("a side-stream program output is not a tensor")
    return outs


# ------------------------------------------------------------------------------------------------ ops
_TAGS = (torch.Tag.flexible_layout,)


def _events(idx: int, slot: int) -> tuple:
    ev = _EVENTS.get((idx, slot))
    if ev is None:
        ev = _EVENTS[(idx, slot)] = (torch.cuda.Event(), torch.cuda.Event())
    return ev


@torch.library.custom_op("dsv41::stream_fork", mutates_args=(), tags=_TAGS)
def stream_fork(tensors: list[torch.Tensor], slot: int) -> torch.Tensor:
    """Fork point of side-stream region `slot`: record its fork event on the current (main) stream, i.e. after
    every kernel that produced `tensors` (the region's inputs, which also name the device).

    Returns: an empty token tensor (int8 [0]) that `stream_launch` takes, which orders it after this op.
    Raises: ValueError for an empty `tensors` list. CPU: records nothing.
    """
    if not tensors:
        raise ValueError("stream_fork needs at least one input tensor (it names the device)")
    dev = tensors[0].device
    if dev.type == "cuda":
        prepare_side_stream(dev)
        _events(_index(dev), slot)[0].record(torch.cuda.current_stream(dev))
    return torch.empty(0, dtype=torch.int8, device=dev)


@stream_fork.register_fake
def _stream_fork_fake(tensors, slot):
    return tensors[0].new_empty((0,), dtype=torch.int8)


@torch.library.custom_op("dsv41::stream_launch", mutates_args=(), tags=_TAGS)
def stream_launch(token: torch.Tensor, tensors: list[torch.Tensor], program: str, slot: int) -> torch.Tensor:
    """Launch region `slot`: the side stream waits for the fork event, runs `program` (module docstring) on
    `tensors` under `torch.cuda.stream(side)` and records the done event; the outputs are kept (thread-local)
    for `stream_join`. Placed by the scheduler after the first main-branch launch ("issue the main branch
    first"); the side work still starts as soon as the fork event completes.

    Returns: a new empty token (int8 [0]) for `stream_join`.
    Raises: ValueError for a malformed program; what the region's ops raise. CPU: runs the program in place.
    """
    dev = token.device
    if dev.type != "cuda":
        _pending()[slot] = (run_program(tensors, program), None)
        return torch.empty(0, dtype=torch.int8, device=dev)
    idx = _index(dev)
    if idx not in _SIDE_COUNTERS:
        raise RuntimeError(f"side stream of cuda:{idx} not prepared while a CUDA graph is being captured; call "
                           "dsv41.kernels.streams.prepare_side_stream(device) before capturing")
    fork, done = _events(idx, slot)
    side = side_stream(dev)
    side.wait_event(fork)
    with torch.cuda.stream(side), _SideCounters(idx):
        outs = run_program(tensors, program)
        done.record(side)
    _pending()[slot] = (outs, done)
    return torch.empty(0, dtype=torch.int8, device=dev)


@stream_launch.register_fake
def _stream_launch_fake(token, tensors, program, slot):
    return token.new_empty((0,))


@torch.library.custom_op("dsv41::stream_join", mutates_args=(), tags=_TAGS)
def stream_join(token: torch.Tensor, tensors: list[torch.Tensor], program: str, slot: int) -> list[torch.Tensor]:
    """Join region `slot`: the current (main) stream waits for its done event; returns its outputs.

    Args: token: `stream_launch`'s result; tensors / program / slot: the launch's (the tensors keep the region's
    inputs alive until here). Returns: the program's outputs, in program order.
    Raises: RuntimeError when no launch of `slot` is pending on this thread.
    """
    entry = _pending().pop(slot, None)
    if entry is None:
        raise RuntimeError(f"stream_join of slot {slot} without a pending stream_launch")
    outs, done = entry
    if done is not None:
        main = torch.cuda.current_stream(token.device)
        main.wait_event(done)
        for o in outs:
            o.record_stream(main)
    return list(outs)


@stream_join.register_fake
def _stream_join_fake(token, tensors, program, slot):
    return run_program(tensors, program)
