"""Where the `dsv41` commands write their files.

A file the user names (`--json PATH`, `--png PATH`, `-o page.html`) goes exactly there. A file the user did not
name goes into one output folder, `out/` under the current directory by default (the repository's `.gitignore`
lists `/out/`, so the README's flow leaves no untracked files), never loose in the current directory; every
command prints the path it wrote.

Public names: `DEFAULT_DIR`, `output_path`, `shown`.
"""

from __future__ import annotations

import os

__all__ = ["DEFAULT_DIR", "output_path", "shown"]

#: The output folder for files the user did not name (relative to the current directory).
DEFAULT_DIR = "out"


def output_path(out: str | os.PathLike | None, default_name: str, suffix: str | None = None) -> str:
    """The path to write `default_name` to, from an `-o/--out` value.

    `out` None: `out/<default_name>`. `out` ending in `suffix` (e.g. ".html"): that file. Otherwise `out` is a
    folder: `<out>/<default_name>`. Parent folders are not created here (the writers create them).
    """
    if out is None:
        return os.path.join(DEFAULT_DIR, default_name)
    out = os.fspath(out)
    if suffix and out.lower().endswith(suffix.lower()):
        return out
    return os.path.join(out, default_name)


def shown(path: str | os.PathLike) -> str:
    """`path` as printed to the user: relative to the current directory when below it, else absolute."""
    full = os.path.abspath(os.fspath(path))
    rel = os.path.relpath(full)
    return rel if not rel.startswith(os.pardir) else full
