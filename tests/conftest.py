"""Shared fixtures: one eager `tiny` model per session (float32, checkpoint weights).

The suite runs the backend strict (`DSV41_STRICT=1`): a pass family that raises fails its test instead of being
undone and reported, which is what a user's compile gets. Tests of that fallback pass `options={"strict": False}`.
"""

import os

import pytest
import torch

os.environ.setdefault("DSV41_STRICT", "1")


@pytest.fixture(scope="session")
def tiny_model():
    """`tiny` preset, checkpoint weight mode, float32 activations, seeded random weights (seed 0)."""
    from dsv41.model import DeepseekV41Flash, ModelConfig
    return DeepseekV41Flash(ModelConfig.preset("tiny"), "checkpoint", torch.float32).init_random(0).eval()


@pytest.fixture(scope="session")
def tiny_prompt():
    """BENCHMARK.md workload prompt for `tiny`: 40 ids (longer than the window 16 and top-k 8)."""
    from dsv41.model import ModelConfig, benchmark_prompt
    return benchmark_prompt(ModelConfig.preset("tiny"), 40)


@pytest.fixture(scope="session")
def tiny_dsv41(tmp_path_factory):
    """`tiny` decoded through `backend="dsv41"` in a FRESH interpreter (tests/fresh_tiny_dsv41.py), once per session.

    The only full-model dsv41 compile of the test suite (Inductor's CPU compile of `tiny` takes minutes on 2
    cores): tests of the backend and of every family read its result dict (tokens, logit error, report with
    the graphs before/after the passes). See the script's docstring for the keys.
    """
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp("tiny_dsv41") / "result.json"
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DSV41_REPORT", None)
    proc = subprocess.run([sys.executable, os.path.join(repo, "tests", "fresh_tiny_dsv41.py"), str(out), "32"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for the module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`): eager decode
    of `tiny` is thousands of small ops, which on a shared 2-core box run much faster on one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def zoo_after(compiled_zoo):
    """The one graph of the module's `compiled_zoo` (a `(results, graphs)` pair whose graphs come from
    `dsv41.passes.testing.capture_graphs`) as dsv41's families left it: a torch.fx.GraphModule. Each pass-test module
    that uses it defines its own module-scoped `compiled_zoo`."""
    (gm,) = compiled_zoo[1]
    return gm
