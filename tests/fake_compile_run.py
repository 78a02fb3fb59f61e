"""Child-process script (not a test module): `dsv41 <argv>` with every compile replaced by eager execution and a
hand-built fusion report standing in for the backend's, so a piped `dsv41 run` finishes in seconds.

Run as `python tests/fake_compile_run.py run --prompt-len 8 ...`; the exit status is the command's.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dsv41  # noqa: E402
import dsv41.cli as cli  # noqa: E402
import dsv41.harness as harness  # noqa: E402
import dsv41.compiler.report as report_mod  # noqa: E402
from report_fixture import hand_built_report  # noqa: E402

REPORT = hand_built_report()
compiled = []


def fake_compile(model, backend, options=None, regional=False):
    compiled.append(backend)
    return model


harness.compile_model = fake_compile
report_mod.last_report = lambda: REPORT if compiled else None  # what `dsv41 report` reads
dsv41.last_report = report_mod.last_report  # what `dsv41 run` reads
torch.set_num_threads(1)
with torch.no_grad():
    sys.exit(cli.main(sys.argv[1:]))
