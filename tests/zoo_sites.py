"""Zoo site markers shared by the pass tests (imported by tests/test_pass_*.py; not a test module).

A zoo line that ends in `# site:NAME` names the chain computed on it; a match or near-miss of the fusion report
is mapped back to that name through the stack of its source location.
"""

from __future__ import annotations

import os
import re


def site_markers(test_file: str) -> dict:
    """{marker name: 1-based line} of every `# site:NAME` line of `test_file`."""
    sites = {}
    with open(test_file) as f:
        for i, line in enumerate(f.read().splitlines(), 1):
            m = re.search(r"# site:(\w+)$", line)
            if m:
                sites[m.group(1)] = i
    return sites


def site_of(record: dict, test_file: str, sites: dict, fn: str | None = "forward", names_only: bool = False):
    """Marker name of a report match / near-miss dict: the innermost frame of its stack in `test_file` (inside
    function `fn`, any function if None). Returns the bare line number when that line has no marker (None with
    `names_only`, which then keeps looking further out), or None when no frame is in the file."""
    base = os.path.basename(test_file)
    for frame in reversed(record["location"]["stack"]):
        if base in frame and (fn is None or frame.endswith(f"({fn})")):
            line = int(frame.split(":")[1].split(" ")[0])
            name = next((k for k, v in sites.items() if v == line), None)
            if name is not None or not names_only:
                return line if name is None else name
    return None
