"""CPU test of the mHC rows of `bench/kernels.py --families` (issue #4: each kernel's time against its byte floor).

One interpreted `--families --tiny --device cpu --m 2` run of the three mHC ops. Checked: each op has a Triton and a
reference row; the Triton output matches the eager reference within FP32 rounding (`check`, computed by the script
from `dsv41.kernels.mhc.reference_*`, which are the model's own functions); and the byte floor equals the count
written out here from the `tiny` config, independently of the script's `nbytes`.
"""

import json
import os
import subprocess
import sys

import pytest

from dsv41.model import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "kernels.py")
KERNELS = ("mhc_mixes", "mhc_collapse_rmsnorm", "mhc_expand")
M = 2


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_mhc") / "rows.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, SCRIPT, "--families", "--tiny", "--device", "cpu", "--m", str(M), "--json", str(out),
           "--only", *KERNELS]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)["rows"]


def test_every_mhc_op_has_a_checked_triton_row_and_a_reference_row(rows):
    for k in KERNELS:
        mine = [r for r in rows if r["kernel"] == k]
        assert {r["variant"].split(" ")[0] for r in mine} == {"triton", "reference"}, k
        c = mine[0]["check"]
        assert c["nan_mismatch"] == 0 and c["unequal_ints"] == 0, (k, c)
        # bf16 H: one bf16 ulp of the largest output for the collapse / expand, FP32 rounding for the mixes
        tol = 2e-5 if k == "mhc_mixes" else 2 ** -7
        assert c["max_abs_diff"] <= tol * max(1.0, c["max_abs_ref"]), (k, c)


def test_byte_floors_count_what_each_op_must_move(rows):
    cfg = ModelConfig.preset("tiny")
    d, hc, e = cfg.hidden_size, cfg.hc_mult, 2  # activations bf16 (2 bytes)
    want = {
        "mhc_mixes": M * hc * d * e + 24 * hc * d * 4 + 24 * 4 + 3 * 4 + M * 24 * 4,
        "mhc_collapse_rmsnorm": M * hc * d * e + M * hc * 4 + d * e + M * d * e,
        "mhc_expand": M * d * e + 2 * M * hc * d * e + M * hc * 4 + M * hc * hc * 4,
    }
    for k, nbytes in want.items():
        got = {r["bytes"] for r in rows if r["kernel"] == k}
        assert got == {nbytes}, (k, got, nbytes)
