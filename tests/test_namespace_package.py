"""dsv41 works from the folder that holds a fresh clone (issue [first-contact] item 2).

A script beside a clone named `dsv41` imports the clone root as a namespace package (its parent is first on
`sys.path`; the editable install's finder comes after the path scan), so `dsv41/__init__.py` never ran: the
fusion report's version and `dsv41.last_report()` were missing. See `tests/clone_helpers.py` for how the
situation is reproduced without installing anything.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from clone_helpers import EDITABLE_FINDER, REPO, fresh_clone, script_env

TOY = '''
import json
import dsv41
namespace = getattr(dsv41, "__file__", None) is None and not hasattr(dsv41, "last_report")
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
fast = torch.compile(model, backend="dsv41", options={"report": True})
with torch.no_grad():
    y = fast(torch.randn(2, 8))
import dsv41.compiler
rep = dsv41.last_report()
print("RESULT", json.dumps({"namespace_at_first_import": namespace, "version": dsv41.__version__,
                            "report_version": rep.to_dict()["dsv41_version"], "graphs": len(rep.graphs),
                            "compiler_file": dsv41.compiler.__file__, "dsv41_file": dsv41.__file__}))
'''


def _run(tmp_path, body: str, timeout: int):
    clone = fresh_clone(tmp_path)
    script = tmp_path / "try.py"
    script.write_text(EDITABLE_FINDER.format(pkg=str(clone / "dsv41")) + body)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=script_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return clone, proc


def test_a_script_beside_the_clone_compiles_with_the_report_on_and_reads_last_report(tmp_path):
    clone, proc = _run(tmp_path, TOY, timeout=600)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    assert r["namespace_at_first_import"] is True  # the user's situation was reproduced
    from dsv41._version import __version__
    assert r["version"] == r["report_version"] == __version__
    assert r["graphs"] >= 1
    assert r["compiler_file"].startswith(str(clone / "dsv41")) and r["dsv41_file"] == str(clone / "dsv41" /
                                                                                            "__init__.py")
    assert "dsv41 fusion report" in proc.stdout  # options={"report": True} printed it


def _readme_snippet() -> str:
    text = (REPO / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_readme_snippet_runs_beside_a_fresh_clone_and_prints_tokens_and_the_summary(tmp_path):
    """The README's first snippet, verbatim, as a user's try.py beside the clone (one `tiny` compile: about two
    minutes on a 2-core CPU when Inductor's cache is cold)."""
    _, proc = _run(tmp_path, _readme_snippet(), timeout=1500)
    out = proc.stdout
    tokens = re.search(r"^\[(\d+(?:, \d+)*)\]$", out, re.M)
    assert tokens and len(tokens.group(1).split(", ")) == 16, out[-2000:]
    assert "kernels per step" in out and "matches" in out, out[-2000:]
