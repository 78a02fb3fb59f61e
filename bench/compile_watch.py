"""Where a cold compile spends its time: run the dsv41 CLI with two probes and print what they saw.

    python3 bench/compile_watch.py [--every S] [--report S] run --preset small --device cuda --prompt-len 16 ...

- Every Triton compile in this process (the custom ops' kernels, JIT-compiled at their first launch; Inductor's
  own kernels compile in worker processes and are not seen) is printed as it finishes: kernel, seconds, running
  total, its upper-case constexprs.
- A sampler thread takes the main thread's stack every `--every` seconds (default 2) and counts the innermost
  dsv41 frame, the innermost frame, the innermost frames below dsv41's code, and, for samples that are formatting
  text (`__str__` / `__repr__` / textwrap), the frames that asked for the text. Every `--report` seconds (default
  60) and at exit it prints the most frequent ones, so a run cut by a time limit still says where it was.
- At exit, also on SIGTERM from `timeout`, the Dynamo / Inductor per-phase totals follow
  (torch._dynamo.utils.compile_times).
Written for the 2026-11-30 slowdown of the cold `small` compile on the H200 (bench/results/2026-11-30_h200_s8/).
"""

from __future__ import annotations

import argparse
import collections
import os
import runpy
import signal
import sys
import threading
import time

_T0 = time.perf_counter()
_SAMPLES: collections.Counter = collections.Counter()
_INNER: collections.Counter = collections.Counter()
_CHAINS: collections.Counter = collections.Counter()
_STR_CALLERS: collections.Counter = collections.Counter()
#: The stack below the formatting frames (up to dsv41's code, at most 40 frames) of the first sample charged to
#: each text caller, with the number of formatting frames above it (how deep the text nests): the 8 frames of
#: the caller key may all sit inside Inductor, and the decision to format is often further out.
_STR_STACKS: dict[str, str] = {}
#: Frames that produce text. A sample is charged to whoever asked for the text only if one of these is on top.
_FORMATTERS = {"__str__", "__repr__", "__format__", "str_helper", "common_repr", "pformat"}
#: Frames that may sit between a formatter and its caller (helpers of the formatting itself).
_FORMATTING = _FORMATTERS | {"get_stack_traces", "stack_trace", "<listcomp>", "<genexpr>", "<lambda>"}
_TRITON = {"n": 0, "s": 0.0}
_LOCK = threading.RLock()  # re-entrant: the SIGTERM handler may interrupt the main thread while it holds it
_DSV41_DIR: str | None = None


def _say(msg: str) -> None:
    """Print one timestamped line (seconds since start)."""
    print(f"[watch {time.perf_counter() - _T0:7.1f} s] {msg}", flush=True)


def _constexprs(src) -> dict:
    """Upper-case constexpr arguments of an ASTSource by name (Triton keys them by argument-index tuples)."""
    names = getattr(getattr(src, "fn", None), "arg_names", None) or ()
    out = {}
    for key, value in (getattr(src, "constants", None) or {}).items():
        idx = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        name = names[idx] if isinstance(idx, int) and idx < len(names) else idx
        if isinstance(name, str) and name.isupper():
            out[name] = value
    return out


def _hook_triton() -> None:
    """Wrap `triton.compiler.compile`, which a JITFunction looks up when it builds its launcher (first launch)."""
    import triton.compiler as tc
    inner = tc.compile

    def timed(src, *args, **kwargs):
        t = time.perf_counter()
        ok = False
        try:
            result = inner(src, *args, **kwargs)
            ok = True
            return result
        finally:
            dt = time.perf_counter() - t
            with _LOCK:
                _TRITON["n"] += 1
                _TRITON["s"] += dt
            try:
                name = getattr(getattr(src, "fn", None), "__name__", type(src).__name__)
                _say(f"triton compile {name} {dt:.2f} s{'' if ok else ' FAILED'} (#{_TRITON['n']}, total "
                     f"{_TRITON['s']:.1f} s) {_constexprs(src)}")
            except Exception as e:  # noqa: BLE001 - the probe must never hide the compile's own outcome
                _say(f"triton compile (not described: {type(e).__name__})")

    tc.compile = timed


def _is_dsv41(filename: str) -> bool:
    """Whether a code file belongs to the installed dsv41 package (not to bench/ or tests/ of the checkout)."""
    global _DSV41_DIR
    if _DSV41_DIR is None:
        try:
            import dsv41
            _DSV41_DIR = os.path.dirname(os.path.abspath(dsv41.__file__)) + os.sep
        except Exception:  # noqa: BLE001 - without the package no frame is dsv41's
            _DSV41_DIR = "\0"
    return os.path.abspath(filename).startswith(_DSV41_DIR)


def _frame_str(f) -> str:
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"


def _where(frame) -> tuple[str, str]:
    """(innermost dsv41 frame as 'path:line func', innermost frame as 'file:line func') of a stack."""
    f = frame
    while f is not None:
        if _is_dsv41(f.f_code.co_filename):
            return f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}", _frame_str(frame)
        f = f.f_back
    return "(no dsv41 frame)", _frame_str(frame)


def _chain(frame, depth: int = 10, stop_at_dsv41: bool = True) -> str:
    """The innermost `depth` frames below dsv41's own code (the first dsv41 frame included when `stop_at_dsv41` is
    False), innermost first, joined by ' <- '."""
    out = []
    f = frame
    while f is not None and len(out) < depth:
        if _is_dsv41(f.f_code.co_filename):
            if not stop_at_dsv41:
                out.append(_frame_str(f))
            break
        out.append(_frame_str(f))
        f = f.f_back
    return " <- ".join(out)


def _formatting_frames(frame):
    """(first frame below the text-formatting frames on top of `frame`, how many there were, whether a real
    formatter was among them)."""
    f, n, formatter = frame, 0, False
    while f is not None and (f.f_code.co_name in _FORMATTING or f.f_code.co_filename.endswith("textwrap.py")):
        formatter = formatter or f.f_code.co_name in _FORMATTERS or f.f_code.co_filename.endswith("textwrap.py")
        f, n = f.f_back, n + 1
    return f, n, formatter


def _str_caller(frame, depth: int = 8) -> str | None:
    """When the innermost frames only format text (IR nodes' __str__, textwrap) and include a real formatter, the
    `depth` frames that asked for it, innermost first; None otherwise."""
    f, _, formatter = _formatting_frames(frame)
    if not formatter or f is None:
        return None
    out = []
    while f is not None and len(out) < depth:
        out.append(_frame_str(f))
        f = f.f_back
    return " <- ".join(out)


def _summary_text(top: int = 12) -> str:
    """The sample counts so far as text."""
    with _LOCK:
        by_dsv41, by_inner = _SAMPLES.most_common(top), _INNER.most_common(top)
        chains, str_callers = _CHAINS.most_common(3), _STR_CALLERS.most_common(4)
        n, s = _TRITON["n"], _TRITON["s"]
    stamp = f"[watch {time.perf_counter() - _T0:7.1f} s]"
    lines = [f"{stamp} main-thread samples by innermost dsv41 frame:"]
    lines += [f"    {c:5d}  {w}" for w, c in by_dsv41]
    lines.append(f"{stamp} main-thread samples by innermost frame:")
    lines += [f"    {c:5d}  {w}" for w, c in by_inner]
    lines.append(f"{stamp} most frequent stacks below dsv41's code (innermost first):")
    lines += [f"    {c:5d}  {w}" for w, c in chains]
    if str_callers:
        lines.append(f"{stamp} samples spent formatting text, by who asked for it (innermost first):")
        lines += [f"    {c:5d}  {w}" for w, c in str_callers]
        lines.append(f"{stamp} stack of the first sample of the top caller, below its text formatting (innermost "
                     f"first):")
        lines += [f"      {fr}" for fr in _STR_STACKS.get(str_callers[0][0], "").split(" <- ")]
    lines.append(f"{stamp} in-process Triton compiles: {n}, {s:.1f} s")
    return "\n".join(lines) + "\n"


def _summary(top: int = 12) -> None:
    """Print the sample counts so far."""
    print(_summary_text(top), end="", flush=True)


def _phases_text() -> str:
    try:
        import torch._dynamo.utils as u
        return f"Dynamo / Inductor phases:\n{u.compile_times()}\n"
    except Exception as e:  # noqa: BLE001 - diagnostic output only
        return f"compile_times unavailable: {type(e).__name__}: {e}\n"


def _sample_once() -> tuple[str, str] | None:
    """Count one sample of the main thread's stack; return its (innermost dsv41 frame, innermost frame)."""
    return _sample_once_of(threading.main_thread().ident)


def _sample_once_of(ident: int) -> tuple[str, str] | None:
    """Count one sample of thread `ident`'s stack; return its (innermost dsv41 frame, innermost frame)."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return None
    d, i = _where(frame)
    caller = _str_caller(frame)
    with _LOCK:
        _SAMPLES[d] += 1
        _INNER[i] += 1
        _CHAINS[_chain(frame)] += 1
        if caller is not None:
            _STR_CALLERS[caller] += 1
            if caller not in _STR_STACKS:
                below, nested, _ = _formatting_frames(frame)
                _STR_STACKS[caller] = (f"({nested} formatting frames on top)"
                                       f" <- {_chain(below, depth=40, stop_at_dsv41=False)}")
    return d, i


def _sampler(every: float, report: float) -> None:
    """Sample every `every` seconds; print the counts every `report` seconds."""
    last = time.perf_counter()
    while True:
        time.sleep(every)
        where = _sample_once()
        if time.perf_counter() - last >= report:
            last = time.perf_counter()
            if where is not None:
                _say(f"now at {where[0]} | {where[1]}")
            _summary(6)


def _settings() -> None:
    """Print what could make Inductor format IR as text: environment, artifact logs, trace config."""
    keys = ("TORCH", "INDUCTOR", "TRITON", "PYTORCH", "CUDA_LAUNCH", "DSV41")
    env = {k: v for k, v in sorted(os.environ.items()) if any(t in k for t in keys)}
    _say(f"environment: {env}")
    try:
        import logging

        import torch
        import torch._inductor.config as ic
        import torch._logging._internal as li

        from dsv41.compiler.kernel_counts import provenance_config
        arts = {a: li.log_state.is_artifact_enabled(a)
                for a in ("ir_pre_fusion", "ir_post_fusion", "output_code", "graph_code", "post_grad_graphs",
                          "schedule", "fusion")}
        _say(f"torch {torch.__version__}; artifact logs on: {[a for a, on in arts.items() if on]}; "
             f"trace.enabled {ic.trace.enabled}; provenance level {ic.trace.provenance_tracking_level} "
             f"(dsv41's compiles patch {provenance_config()}); graph_partition "
             f"{getattr(ic, 'graph_partition', None)}; structured trace handlers {len(li.trace_log.handlers)}; "
             f"torch._inductor log level "
             f"{logging.getLevelName(logging.getLogger('torch._inductor').getEffectiveLevel())}")
    except Exception as e:  # noqa: BLE001 - diagnostic output only
        _say(f"settings unavailable: {type(e).__name__}: {e}")


def _on_term(signum, _frame) -> None:
    """SIGTERM (a `timeout`): write the counts and phases with os.write (a print could re-enter a buffered write
    the main thread was in) and exit 124."""
    try:
        text = (f"[watch {time.perf_counter() - _T0:7.1f} s] signal {signum}: stopping\n" + _summary_text()
                + _phases_text())
        os.write(sys.stdout.fileno(), text.encode())
    finally:
        os._exit(124)


def main() -> None:
    """Parse `--every` / `--report`, install the probes, run `python -m dsv41` with the remaining arguments."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--every", type=float, default=2.0)
    ap.add_argument("--report", type=float, default=60.0)
    ours, rest = ap.parse_known_args()
    _hook_triton()
    _settings()
    signal.signal(signal.SIGTERM, _on_term)
    threading.Thread(target=_sampler, args=(ours.every, ours.report), daemon=True).start()
    sys.argv = ["dsv41"] + rest
    try:
        runpy.run_module("dsv41", run_name="__main__")
    finally:
        _summary()
        print(_phases_text(), end="", flush=True)


if __name__ == "__main__":
    main()
