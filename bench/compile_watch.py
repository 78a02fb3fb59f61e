"""Where a cold compile spends its time: run the dsv41 CLI with two probes and print what they saw.

    python3 bench/compile_watch.py run --preset small --device cuda --prompt-len 16 --new-tokens 4

- Every Triton compile in this process (the custom ops' kernels, JIT-compiled at their first launch; Inductor's
  own kernels compile in worker processes and are not seen) is printed as it finishes: kernel, seconds, running
  total.
- A sampler thread takes the main thread's stack every `--every` seconds (default 2) and counts the innermost
  dsv41 frame and the innermost frame overall; every `--report` seconds (default 60) and at exit (also on
  SIGTERM from `timeout`) it prints the most frequent ones, so a run cut by a time limit still says where it was.
At exit the Dynamo / Inductor per-phase totals follow (torch._dynamo.utils.compile_times).
Written for the 2026-11-30 slowdown of the cold `small` compile on the H200 (bench/results/*_s7_gemv/README.md).
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
#: Frames that only format text: a sample inside them is charged to whoever asked for the text.
_FORMATTING = {"__str__", "__repr__", "__format__", "str_helper", "common_repr", "indent", "prefixed_lines",
               "predicate", "get_stack_traces", "stack_trace", "<listcomp>", "<genexpr>", "<lambda>", "pformat"}
_TRITON = {"n": 0, "s": 0.0}
_LOCK = threading.Lock()


def _say(msg: str) -> None:
    print(f"[watch {time.perf_counter() - _T0:7.1f} s] {msg}", flush=True)


def _hook_triton() -> None:
    """Wrap `triton.compiler.compile`, which a JITFunction looks up when it builds its launcher (first launch)."""
    import triton.compiler as tc
    inner = tc.compile

    def timed(src, *args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(src, *args, **kwargs)
        finally:
            dt = time.perf_counter() - t
            with _LOCK:
                _TRITON["n"] += 1
                _TRITON["s"] += dt
            name = getattr(getattr(src, "fn", None), "__name__", type(src).__name__)
            consts = getattr(src, "constants", {}) or {}
            short = {(k[0] if isinstance(k, tuple) and len(k) == 1 else k): v for k, v in consts.items()}
            short = {k: v for k, v in short.items() if isinstance(k, str) and k.isupper()}
            _say(f"triton compile {name} {dt:.2f} s (#{_TRITON['n']}, total {_TRITON['s']:.1f} s) {short}")

    tc.compile = timed


def _where(frame) -> tuple[str, str]:
    """(innermost dsv41 frame, innermost frame) of a stack as 'file:line func'."""
    inner = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"
    f = frame
    while f is not None:
        if f"{os.sep}dsv41{os.sep}" in f.f_code.co_filename:
            return f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}", inner
        f = f.f_back
    return "(no dsv41 frame)", inner


def _chain(frame, depth: int = 10) -> str:
    """The innermost `depth` frames below dsv41's own code, outermost first, as one line each."""
    out = []
    f = frame
    while f is not None and len(out) < depth and f"{os.sep}dsv41{os.sep}" not in f.f_code.co_filename:
        out.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}")
        f = f.f_back
    return " <- ".join(out)


def _str_caller(frame, depth: int = 8) -> str | None:
    """When the innermost frames only format text (IR nodes' __str__, textwrap), the `depth` frames that asked
    for it, innermost first; None otherwise."""
    f, formatting = frame, 0
    while f is not None and (f.f_code.co_name in _FORMATTING or f.f_code.co_filename.endswith("textwrap.py")):
        formatting += 1
        f = f.f_back
    if not formatting or f is None:
        return None
    out = []
    while f is not None and len(out) < depth:
        out.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}")
        f = f.f_back
    return " <- ".join(out)


def _summary(top: int = 12) -> None:
    with _LOCK:
        by_dsv41, by_inner = _SAMPLES.most_common(top), _INNER.most_common(top)
        chains = _CHAINS.most_common(3)
        str_callers = _STR_CALLERS.most_common(4)
    _say("main-thread samples by innermost dsv41 frame:")
    for where, n in by_dsv41:
        print(f"    {n:5d}  {where}", flush=True)
    _say("main-thread samples by innermost frame:")
    for where, n in by_inner:
        print(f"    {n:5d}  {where}", flush=True)
    _say("most frequent stacks (innermost first):")
    for chain, n in chains:
        print(f"    {n:5d}  {chain}", flush=True)
    if str_callers:
        _say("samples spent formatting text, by who asked for it (innermost first):")
        for chain, n in str_callers:
            print(f"    {n:5d}  {chain}", flush=True)
    _say(f"in-process Triton compiles: {_TRITON['n']}, {_TRITON['s']:.1f} s")


def _sampler(every: float, report: float) -> None:
    main = threading.main_thread().ident
    last = time.perf_counter()
    while True:
        time.sleep(every)
        frame = sys._current_frames().get(main)
        if frame is not None:
            d, i = _where(frame)
            with _LOCK:
                _SAMPLES[d] += 1
                _INNER[i] += 1
                _CHAINS[_chain(frame)] += 1
                caller = _str_caller(frame)
                if caller is not None:
                    _STR_CALLERS[caller] += 1
        if time.perf_counter() - last >= report:
            last = time.perf_counter()
            _say(f"now at {d} | {i}")
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
        arts = {a: li.log_state.is_artifact_enabled(a)
                for a in ("ir_pre_fusion", "ir_post_fusion", "output_code", "graph_code", "post_grad_graphs",
                          "schedule", "fusion")}
        _say(f"torch {torch.__version__}; artifact logs on: {[a for a, on in arts.items() if on]}; "
             f"trace.enabled {ic.trace.enabled}; provenance level {ic.trace.provenance_tracking_level}; "
             f"graph_partition {getattr(ic, 'graph_partition', None)}; structured trace handlers "
             f"{len(li.trace_log.handlers)}; inductor log level "
             f"{logging.getLevelName(logging.getLogger('torch._inductor').getEffectiveLevel())}")
    except Exception as e:  # noqa: BLE001 - diagnostic output only
        _say(f"settings unavailable: {type(e).__name__}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--every", type=float, default=2.0)
    ap.add_argument("--report", type=float, default=60.0)
    ours, rest = ap.parse_known_args()
    _hook_triton()
    _settings()

    def on_term(signum, _frame):
        _say(f"signal {signum}: stopping")
        _summary()
        os._exit(124)

    signal.signal(signal.SIGTERM, on_term)
    threading.Thread(target=_sampler, args=(ours.every, ours.report), daemon=True).start()
    sys.argv = ["dsv41"] + rest
    try:
        runpy.run_module("dsv41", run_name="__main__")
    finally:
        _summary()
        try:
            import torch._dynamo.utils as u
            _say("Dynamo / Inductor phases:\n" + str(u.compile_times()))
        except Exception as e:  # noqa: BLE001 - diagnostic output only
            _say(f"compile_times unavailable: {e}")


if __name__ == "__main__":
    main()
