"""`PassManager.uuid()` (Inductor's cache key for dsv41's passes) covers what the passes read and nothing else: the
pass and kernel modules and the dsv41 modules they import, found from their imports. Checked on a copy of the
package in a temporary directory, whose files the tests edit."""

import os
import shutil

import pytest

from dsv41.passes import manager
from dsv41.passes.manager import PassManager

_PARENT = manager._PACKAGE_PARENT


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """A copy of the dsv41 sources under tmp_path, made the package `uuid()` reads; returns its dsv41/ path."""
    shutil.copytree(os.path.join(_PARENT, "dsv41"), tmp_path / "dsv41",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    monkeypatch.setattr(manager, "_PACKAGE_PARENT", str(tmp_path))
    return tmp_path / "dsv41"


def _append(path, text):
    with open(path, "a") as f:
        f.write(text)


def _rel(files, parent):
    return {os.path.relpath(f, parent).replace(os.sep, "/") for f in files}


def test_pass_sources_are_the_passes_kernels_and_the_references_they_import():
    files = _rel(manager._source_files(), _PARENT)
    assert {"dsv41/passes/manager.py", "dsv41/passes/mhc.py", "dsv41/kernels/mhc.py"} <= files
    # the references the passes verify against and the kernels compute with (dsv41/ref/)
    assert {"dsv41/ref/formats.py", "dsv41/ref/rope.py", "dsv41/ref/norm.py", "dsv41/ref/mhc.py",
            "dsv41/ref/engram.py", "dsv41/ref/topk.py", "dsv41/ref/indexer.py"} <= files
    # the backend no longer imports the model package: no model module is in the key, nor anything else a pass
    # does not read (the package __init__ that imports them all, the app layer)
    assert not {f for f in files if f.startswith("dsv41/model/")}
    assert not files & {"dsv41/__init__.py", "dsv41/bench.py", "dsv41/cli.py"}


def test_uuid_does_not_depend_on_where_the_package_lives(package_copy, monkeypatch):
    copy = PassManager().uuid()
    assert copy == PassManager().uuid()
    monkeypatch.setattr(manager, "_PACKAGE_PARENT", _PARENT)
    assert copy == PassManager().uuid()


def test_editing_generate_keeps_the_uuid(package_copy):
    before = PassManager().uuid()
    _append(package_copy / "model" / "generate.py", "\n# an edit no pass can see\n")
    _append(package_copy / "model" / "model.py", "\n# nor this one\n")
    _append(package_copy / "model" / "formats.py", "\n# nor the model's re-export of the formats\n")
    assert PassManager().uuid() == before


@pytest.mark.parametrize("rel", ["passes/mhc.py", "passes/manager.py", "kernels/quant_gemv.py",
                                 "ref/formats.py", "ref/rope.py", "ref/topk.py"])
def test_editing_a_pass_kernel_or_reference_module_changes_the_uuid(package_copy, rel):
    before = PassManager().uuid()
    _append(package_copy / rel, "\n# edited\n")
    assert PassManager().uuid() != before


def test_the_sources_follow_the_imports_not_a_list(package_copy):
    """A pass that starts importing generate.py (here a function-level import) brings it into the key."""
    _append(package_copy / "passes" / "normalize.py", "\n\ndef _uses_generate():\n    from ..model import generate\n")
    assert "dsv41/model/generate.py" in _rel(manager._source_files(), package_copy.parent)
    before = PassManager().uuid()
    _append(package_copy / "model" / "generate.py", "\n# now a pass reads this\n")
    assert PassManager().uuid() != before


def test_editing_the_family_test_harness_keeps_the_uuid(package_copy):
    """passes/testing.py is imported by tests, never by a compile: an edit to it must not cold-start every cache."""
    before = PassManager().uuid()
    _append(package_copy / "passes" / "testing.py", "\n# a new query helper for tests\n")
    assert PassManager().uuid() == before
    assert "dsv41/passes/testing.py" not in _rel(manager._source_files(), package_copy.parent)
