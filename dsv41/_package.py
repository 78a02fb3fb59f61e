"""Make `import dsv41` whole when Python imported the clone root as a namespace package.

A script beside a clone (`git clone ... dsv41`, then `./try.py` next to it) has the clone's parent first on
`sys.path`. Python's path scan finds the directory `dsv41/` (the clone root, no `__init__.py`) and records it as a
namespace portion; the editable install's finder runs after the path scan, so it is asked only for the submodules
(`dsv41.model`, `dsv41.compiler`), which it finds in the real package. The result: `dsv41` is an empty namespace
module (`dsv41.last_report`, `dsv41.__version__` missing) whose submodules work. `repair()` runs the real
`dsv41/__init__.py` into that namespace module, so the top-level names exist however `dsv41` was imported.

`dsv41.compiler` and `dsv41.model` call `repair()` when they are imported (the backend's entry point always imports
`dsv41.compiler`). Public names: `repair()`.
"""

from __future__ import annotations

import os
import sys

__all__ = ["repair"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def repair() -> bool:
    """If `sys.modules["dsv41"]` is a namespace package, execute this package's `__init__.py` in it and put this
    package's directory first on its `__path__`. Returns True when it repaired the module, False when there was
    nothing to do (a regular import, or already repaired). Never raises for a missing module."""
    mod = sys.modules.get("dsv41")
    if mod is None or getattr(mod, "__file__", None) is not None:
        return False
    init = os.path.join(_PACKAGE_DIR, "__init__.py")
    with open(init, encoding="utf-8") as f:
        code = compile(f.read(), init, "exec")
    # A plain list, not the namespace's dynamic path: that one is recomputed from sys.path on its next use and
    # would drop this directory again.
    portions = [p for p in list(getattr(mod, "__path__", [])) if os.path.abspath(p) != _PACKAGE_DIR]
    mod.__path__ = [_PACKAGE_DIR, *portions]
    mod.__file__ = init
    exec(code, mod.__dict__)
    return True
