"""The installed dsv41 version, read from the package metadata (`pyproject.toml` `[project] version`).

Read here rather than kept in `dsv41/__init__.py`: a script that sits beside a clone named `dsv41` imports the clone
root as a namespace package, whose `__init__` never runs, and every module that needs the version (the fusion
report) must still find it. Public names: `__version__`, `version()`.
"""

from __future__ import annotations

import os
import re

__all__ = ["__version__", "version"]


def _from_pyproject() -> str | None:
    """`version = "..."` of the `pyproject.toml` next to the package, for a source tree that was never installed."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r'^\[project\].*?^version\s*=\s*"([^"]+)"', text, re.S | re.M)
    return m.group(1) if m else None


def version() -> str:
    """The dsv41 version string, e.g. "0.1.0".

    Source: the installed distribution's metadata (`importlib.metadata.version("dsv41")`); for a source tree that
    was never installed, `pyproject.toml` beside the package; "0+unknown" when neither exists. Never raises.
    """
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as _dist_version
        try:
            return _dist_version("dsv41")
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover - importlib.metadata is in every supported Python
        pass
    return _from_pyproject() or "0+unknown"


__version__ = version()
