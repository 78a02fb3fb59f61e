"""Progress of a `dsv41` command, one phase at a time, on stderr.

A `tiny` compile takes about two minutes on a 2-core CPU. In a terminal the running phase shows a spinner and its
live elapsed time (rich), and each finished phase leaves one line with its seconds. In a log (CI, `| tee`, nohup)
a live display draws nothing, so each phase prints a line when it starts and one with its seconds when it ends;
the log then says what the process is doing during the long compile.

Public names: `Phases`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

__all__ = ["Phases"]


class Phases:
    """The phases of one command (`dsv41 run`, `dsv41 report`, ...) with their elapsed seconds.

    Args:
        prog: the command, printed at the start of each line in a log ("dsv41 run").
        console: a rich Console to print to (default: stderr). Live display only where it is a terminal.
    Attributes:
        seconds: {phase name: wall seconds} of the phases finished so far (a repeated name adds up).
    """

    def __init__(self, prog: str, console=None):
        from rich.console import Console

        self.prog = prog
        self.console = console if console is not None else Console(stderr=True)
        self.live = bool(self.console.is_terminal) and not self.console.is_dumb_terminal
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def say(self, text: str) -> None:
        """One plain line (not rich markup; never wrapped, so a log keeps it on one line)."""
        self.console.print(text if self.live else f"{self.prog}: {text}", markup=False, highlight=False,
                           soft_wrap=True)

    @contextlib.contextmanager
    def phase(self, what: str, key: str | None = None, hint: str = "") -> Iterator[None]:
        """Run the block as phase `what`: a live spinner with elapsed time in a terminal, a start line in a log
        (both followed by `hint`, e.g. how long the phase usually takes); then one line `what: N.N s` (or `what:
        failed after N.N s` when the block raises, which it re-raises). `key` names the phase in `seconds`
        (default `what`)."""
        t0 = time.perf_counter()
        ok = False
        try:
            if self.live:
                from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

                with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                              console=self.console, transient=True) as bar:
                    bar.add_task(what + (f" ({hint})" if hint else ""), total=None)
                    yield
            else:
                self.say(f"{what}" + (f" ({hint})" if hint else "") + " ...")
                yield
            ok = True
        finally:
            dt = time.perf_counter() - t0
            self.seconds[key or what] = self.seconds.get(key or what, 0.0) + dt
            total = time.perf_counter() - self.start
            if ok:
                self.say(f"{what}: {dt:.1f} s" + ("" if self.live else f" (total {total:.1f} s)"))
            else:
                self.say(f"{what}: failed after {dt:.1f} s")
