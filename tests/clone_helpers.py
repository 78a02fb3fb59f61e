"""Helpers (not a test module) for running a script from the folder that holds a fresh clone of this repository.

`fresh_clone(tmp)` clones this worktree into `tmp/dsv41` and copies the working tree's uncommitted changes over it,
so the test sees the code under test, not the last commit. `EDITABLE_FINDER` is the preamble of such a script: it
stands in for the editable install a user makes from that clone (`pip install -e dsv41`). This machine's own
editable install points at another checkout, so the script takes that finder off `sys.meta_path` and appends one
that maps `dsv41` to the clone, placed as setuptools places its own: after the path scan. With the clone's parent
first on `sys.path` (the script's own folder), `import dsv41` then finds the clone root as a namespace portion, as
it does for the user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

EDITABLE_FINDER = '''
import sys
from importlib.machinery import PathFinder
from importlib.util import spec_from_file_location

CLONE_PKG = {pkg!r}


class EditableFinder:
    """setuptools' editable finder for one top-level package (`__editable___*_finder.py`), mapped to the clone."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == "dsv41":
            return spec_from_file_location(fullname, CLONE_PKG + "/__init__.py",
                                           submodule_search_locations=[CLONE_PKG])
        parent, _, _ = fullname.rpartition(".")
        if parent == "dsv41":
            return PathFinder.find_spec(fullname, path=[CLONE_PKG])
        return None


sys.meta_path[:] = [f for f in sys.meta_path if "dsv41" not in getattr(f, "__module__", "")]
sys.meta_path.append(EditableFinder)
'''


def fresh_clone(tmp: Path) -> Path:
    """`git clone` of this worktree into `tmp/dsv41`, plus the working tree's modified, untracked (not ignored) and
    deleted files, so the clone holds exactly the files under test. Returns the clone root.

    Raises: subprocess.CalledProcessError when git fails.
    """
    dst = tmp / "dsv41"
    subprocess.run(["git", "clone", "-q", str(REPO), str(dst)], check=True, capture_output=True)
    changed = subprocess.run(["git", "ls-files", "-m", "-o", "--exclude-standard", "-z"], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout.split("\0")
    deleted = subprocess.run(["git", "ls-files", "-d", "-z"], cwd=REPO, check=True, capture_output=True,
                             text=True).stdout.split("\0")
    for rel in filter(None, changed):
        if os.path.isfile(REPO / rel):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dst / rel)
    for rel in filter(None, deleted):
        if (dst / rel).exists():
            (dst / rel).unlink()
    return dst


def script_env() -> dict:
    """The environment of the script: this one without PYTHONPATH (which would put the worktree first) and with
    the test suite's strict mode."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DSV41_REPORT")}
    env["DSV41_STRICT"] = "1"
    return env
