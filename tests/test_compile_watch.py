"""bench/compile_watch.py: the probes that say where a cold compile spends its time (CPU, no compile needed)."""

from __future__ import annotations

import sys
import textwrap
import threading
import time
import types

import pytest
import triton
import triton.language as tl

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
    """A plain stack (and a generator expression, which only may sit inside formatting) is not charged."""
    assert watch._str_caller(sys._getframe()) is None
    assert next(watch._str_caller(sys._getframe()) for _ in range(1)) is None
    where, inner = watch._where(sys._getframe())
    assert where == "(no dsv41 frame)" and inner.endswith(" test_no_caller_outside_text_formatting")


def test_dsv41_frames_are_the_package_not_the_checkout():
    import dsv41.compiler.options as opts
    assert watch._is_dsv41(opts.__file__)
    assert not watch._is_dsv41(__file__) and not watch._is_dsv41(watch.__file__)


@triton.jit
def _probe_kernel(x_ptr, n, BLOCK_N: tl.constexpr, flag: tl.constexpr):
    offs = tl.arange(0, BLOCK_N)
    tl.store(x_ptr + offs, offs, mask=offs < n)


def test_triton_hook_times_every_compile(monkeypatch, capsys):
    """The hook wraps triton.compiler.compile, passes the result through and prints the kernel's name, time and
    upper-case constexprs by name (a real ASTSource keys them by argument index); a failing compile is marked."""
    import triton.compiler as tc
    from triton.compiler import ASTSource

    src = ASTSource(_probe_kernel, {"x_ptr": "*i32", "n": "i32", "BLOCK_N": "constexpr", "flag": "constexpr"},
                    {(2,): 128, (3,): True})
    monkeypatch.setattr(tc, "compile", lambda s, *a, **k: ("compiled", s))
    monkeypatch.setitem(watch._TRITON, "n", 0)
    monkeypatch.setitem(watch._TRITON, "s", 0.0)
    watch._hook_triton()
    assert tc.compile(src, target=None) == ("compiled", src)
    out = capsys.readouterr().out
    assert "triton compile _probe_kernel" in out and "{'BLOCK_N': 128}" in out and "FAILED" not in out
    assert watch._TRITON["n"] == 1

    def boom(s, *a, **k):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(tc, "compile", boom)
    watch._hook_triton()
    with pytest.raises(RuntimeError, match="ptxas"):
        tc.compile(src)
    assert "FAILED" in capsys.readouterr().out and watch._TRITON["n"] == 2


def test_summary_prints_counts(capsys, monkeypatch):
    """The summary lists each counter's entries with their counts."""
    monkeypatch.setattr(watch, "_SAMPLES", watch.collections.Counter({"dsv41/x.py:1 f": 3}))
    monkeypatch.setattr(watch, "_STR_CALLERS", watch.collections.Counter({"a.py:2 g <- b.py:3 h": 2}))
    watch._summary()
    out = capsys.readouterr().out
    assert "    3  dsv41/x.py:1 f" in out and "    2  a.py:2 g <- b.py:3 h" in out


def test_summary_prints_the_whole_stack_of_the_top_text_caller(monkeypatch):
    """The caller key is 8 frames deep; the summary also shows the first whole stack seen for the top caller,
    outer frames included, so the decision to format is visible even when it sits further out."""
    monkeypatch.setattr(watch, "_STR_CALLERS", watch.collections.Counter())
    monkeypatch.setattr(watch, "_STR_STACKS", {})
    stop = threading.Event()
    worker = threading.Thread(target=_asker, args=(stop,))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while not watch._STR_CALLERS and time.monotonic() < deadline:
            time.sleep(0.01)
            watch._sample_once_of(worker.ident)
    finally:
        stop.set()
        worker.join()
    text = watch._summary_text()
    stack = text.split("below its text formatting (innermost first):\n")[1]
    frames = [ln.strip() for ln in stack.splitlines() if ln.startswith("      ")]
    # the sample lands somewhere inside _Nested(25)'s recursion; the stack starts at the caller below it
    assert frames[0].startswith("(") and int(frames[0][1:].split()[0]) >= 1, frames[0]
    assert frames[1].endswith(" _asker"), frames
    assert frames[-1].endswith(" _bootstrap"), frames  # threading's bootstrap: further out than the 8-frame key


def test_sigterm_prints_the_counts_and_exits_124(tmp_path):
    """A run cut by `timeout` still reports: the SIGTERM handler writes the summary and the phases, then exits."""
    import signal
    import subprocess
    script = tmp_path / "hang.py"
    script.write_text(
        "import runpy, sys, time\n"
        "sys.argv = ['w', '--every', '0.05', 'ignored']\n"
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('w', {watch.__file__!r})\n"
        "w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)\n"
        "runpy.run_module = lambda *a, **k: time.sleep(60)\n"
        "w.main()\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen = []
    for line in proc.stdout:  # the handler is installed right after the settings line
        seen.append(line)
        if "provenance level" in line or "settings unavailable" in line:
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    out = "".join(seen) + out
    assert proc.returncode == 124, out
    assert "signal 15: stopping" in out and "main-thread samples by innermost frame:" in out
    assert "Dynamo / Inductor phases" in out or "compile_times unavailable" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
