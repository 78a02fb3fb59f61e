"""Every name a dsv41 package or module promises can be imported (issue [robust] item 6).

Promised means: listed in a module's `__all__`, or written in backticks on the "Public names:" / "Public API:"
paragraph of a package's docstring. Each is imported the way a user writes it, `from <module> import <name>`, in a
fresh interpreter per package, so an import that only works after some other import fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys

import pytest

import dsv41


def _modules() -> list[str]:
    return ["dsv41"] + sorted(m.name for m in pkgutil.walk_packages(dsv41.__path__, "dsv41.")
                              if not m.name.endswith("__main__"))


def _docstring_names(module) -> list[str]:
    """Backticked identifiers of the 'Public names:' / 'Public API:' paragraph of the module's docstring."""
    doc = module.__doc__ or ""
    m = re.search(r"Public (?:names|API):(.*?)(?:\n\s*\n|\Z)", doc, re.S)
    if not m:
        return []
    names = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)(?:\(\))?`", m.group(1))
    return sorted(set(names))


def _promised() -> dict[str, list[str]]:
    out = {}
    for name in _modules():
        module = importlib.import_module(name)
        names = set(getattr(module, "__all__", ())) | set(_docstring_names(module))
        if names:
            out[name] = sorted(names)
    return out


PROMISED = _promised()


def test_the_packages_promise_names():
    for pkg in ("dsv41", "dsv41.model", "dsv41.passes", "dsv41.compiler", "dsv41.kernels"):
        assert PROMISED.get(pkg), pkg
    assert "budget" in PROMISED["dsv41.model"]


_PACKAGES = ("dsv41.ref", "dsv41.model", "dsv41.kernels", "dsv41.passes", "dsv41.compiler")


def _group(module: str) -> str:
    """The subpackage a module belongs to, or "dsv41" for the package itself and its top-level modules."""
    return next((p for p in _PACKAGES if module == p or module.startswith(p + ".")), "dsv41")


@pytest.mark.parametrize("group", ("dsv41",) + _PACKAGES)
def test_every_promised_name_imports_in_a_fresh_interpreter(group):
    lines = [f"from {m} import {n}" for m, names in PROMISED.items() if _group(m) == group for n in names]
    code = "\n".join(lines) + "\nprint('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_model_budget_is_the_function():
    from dsv41.model import Budget, budget

    b = budget("tiny")
    assert isinstance(b, Budget)
