"""bench/compile_watch.py: the probes that say where a cold compile spends its time (CPU, no compile needed)."""

from __future__ import annotations

import sys
import textwrap
import threading
import time
import types

import pytest

from gpu_harness import load_bench

watch = load_bench("compile_watch")


class _Nested:
    """An object whose text nests its child's, indented at every level (like Inductor IR's __str__)."""

    def __init__(self, depth: int):
        self.depth = depth

    def __str__(self) -> str:
        inner = str(_Nested(self.depth - 1)) if self.depth else "x" * 100_000
        return "Nested(\n" + textwrap.indent(inner, "  ") + "\n)"


def _asker(stop: threading.Event) -> None:
    while not stop.is_set():
        str(_Nested(25))


def test_text_formatting_is_charged_to_the_caller():
    """A sample taken inside nested __str__ / textwrap frames names the function that asked for the text."""
    stop = threading.Event()
    worker = threading.Thread(target=_asker, args=(stop,))
    worker.start()
    try:
        seen = None
        deadline = time.monotonic() + 10
        while seen is None and time.monotonic() < deadline:
            time.sleep(0.01)
            frame = sys._current_frames().get(worker.ident)
            seen = watch._str_caller(frame) if frame is not None else None
    finally:
        stop.set()
        worker.join()
    assert seen is not None and seen.split(" <- ")[0].endswith(" _asker")


def test_no_caller_outside_text_formatting():
    assert watch._str_caller(sys._getframe()) is None
    where, inner = watch._where(sys._getframe())
    assert where == "(no dsv41 frame)" and inner.endswith(" test_no_caller_outside_text_formatting")


def test_triton_hook_times_every_compile(monkeypatch, capsys):
    """The hook wraps triton.compiler.compile, passes the result through and prints name, time and constants."""
    import triton.compiler as tc

    class Src:
        fn = types.SimpleNamespace(__name__="_my_kernel")  # a JITFunction carries its kernel's __name__
        constants = {("BLOCK_N",): 128, ("x",): 1}

    monkeypatch.setattr(tc, "compile", lambda src, *a, **k: ("compiled", src))
    monkeypatch.setitem(watch._TRITON, "n", 0)
    monkeypatch.setitem(watch._TRITON, "s", 0.0)
    watch._hook_triton()
    src = Src()
    assert tc.compile(src, target=None) == ("compiled", src)
    out = capsys.readouterr().out
    assert "triton compile _my_kernel" in out and "'BLOCK_N': 128" in out and "'x'" not in out
    assert watch._TRITON["n"] == 1


def test_summary_prints_counts(capsys, monkeypatch):
    monkeypatch.setattr(watch, "_SAMPLES", watch.collections.Counter({"dsv41/x.py:1 f": 3}))
    monkeypatch.setattr(watch, "_STR_CALLERS", watch.collections.Counter({"a.py:2 g <- b.py:3 h": 2}))
    watch._summary()
    out = capsys.readouterr().out
    assert "    3  dsv41/x.py:1 f" in out and "    2  a.py:2 g <- b.py:3 h" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
