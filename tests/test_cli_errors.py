"""User errors of `dsv41 run`, `dsv41 bench` and `dsv41 report` (issue [first-contact] items 1 and 3).

Each bad input is one line on stderr, `dsv41 <cmd>: error: ...`, naming the flag or key and what is allowed, with
exit status 2, in well under 10 s and before any model is built (building one fails these tests). Most cases run
in this process (`dsv41.cli.main`); `test_errors_in_a_fresh_process` runs a few through `python -m dsv41`, torch
import included.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import dsv41.cli as cli
import dsv41.harness as harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: (argv, substrings the one error line must contain)
CASES = [
    # item 1: zero lengths used to run the defaults
    (["run", "--prompt-len", "0"], ["argument --prompt-len", ">= 1", "'0'"]),
    (["run", "--new-tokens", "0"], ["argument --new-tokens", ">= 2", "'0'"]),
    (["bench", "--prompt-len", "0"], ["argument --prompt-len", ">= 1"]),
    (["bench", "--new-tokens", "0"], ["argument --new-tokens", ">= 2"]),
    # item 3
    (["run", "--prompt-len", "-5"], ["argument --prompt-len", ">= 1", "'-5'"]),
    (["run", "--new-tokens", "-1"], ["argument --new-tokens", ">= 2"]),
    (["run", "--option", "bogus=1"], ["argument --option", "'bogus'", "valid options", "streams", "count_kernels"]),
    (["run", "--option", "streams=maybe"], ["argument --option", "'streams'", "bool"]),
    (["run", "--option", 'disable=["nope"]'], ["argument --option", "nope", "valid families", "dispatch"]),
    (["run", "--option", "streams"], ["argument --option", "'streams'", "KEY=VALUE"]),
    (["run", "--backend", "eager", "--option", "streams=false"], ["argument --option", "dsv41 only", "'eager'"]),
    (["run", "--prompt-len", "5000"], ["--prompt-len", "max_position_embeddings 4096", "at most 4080"]),
    (["run", "--device", "tpu"], ["argument --device", "'tpu'", "cpu, cuda"]),
    (["run", "--preset", "huge"], ["argument --preset", "'huge'", "tiny"]),
    (["run", "--simulate-acceptance", "3"], ["--simulate-acceptance", "--speculative"]),
    (["bench", "--backends", "nosuch"], ["argument --backends", "'nosuch'", "eager", "dsv41"]),
    (["bench", "--option", "bogus=1"], ["argument --option", "'bogus'"]),
    (["bench", "--device", "tpu"], ["argument --device", "'tpu'"]),
    (["bench", "--prompt-len", "4090"], ["--prompt-len", "max_position_embeddings=4096"]),
    (["bench", "--contexts", "4k"], ["argument --contexts", "'4k'"]),
    (["bench", "--row-new-tokens", "inductor"], ["argument --row-new-tokens", "ROW=R"]),
    (["report", "--prompt-len", "0"], ["argument --prompt-len", ">= 1"]),
    (["report", "--device", "tpu"], ["argument --device", "'tpu'"]),
    (["report", "--bench", "/nonexistent/r.json"], ["argument --bench", "/nonexistent/r.json"]),
]
if not torch.cuda.is_available():
    CASES += [(["run", "--device", "cuda"], ["argument --device", "'cuda'", "allowed here: cpu"]),
              (["bench", "--device", "cuda"], ["argument --device", "'cuda'", "allowed here: cpu"]),
              (["report", "--device", "cuda"], ["argument --device", "'cuda'", "allowed here: cpu"])]


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: every error must come before it."""
    def boom(*a, **k):
        raise AssertionError("a model was built before the error was reported")
    monkeypatch.setattr(harness, "build_model", boom)


def _run_in_process(argv, capsys) -> tuple[int, str, str, float]:
    t0 = time.perf_counter()
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    dt = time.perf_counter() - t0
    out, err = capsys.readouterr()
    return rc, out, err, dt


@pytest.mark.parametrize("argv, want", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_input_is_one_line_naming_the_flag_with_exit_status_2(argv, want, capsys, no_model):
    rc, out, err, dt = _run_in_process(argv, capsys)
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # no usage block, no traceback
    assert lines[0].startswith(f"dsv41 {argv[0]}: error: "), lines[0]
    for w in want:
        assert w in lines[0], (w, lines[0])
    assert "Traceback" not in err and "PyTorch" not in err and out == ""
    assert dt < 10, dt


def test_errors_in_a_fresh_process():
    """Through `python -m dsv41` (torch imported in the child): one line, status 2, under 10 s each."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = REPO
    argvs = [["run", "--prompt-len", "0"], ["run", "--option", "bogus=1"], ["bench", "--backends", "nosuch"],
             ["run", "--device", "tpu"]]
    for argv in argvs:  # one at a time: the 10 s are each command's, not a share of two cores
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dsv41", *argv], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)
        dt = time.perf_counter() - t0
        assert proc.returncode == 2, (argv, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"dsv41 {argv[0]}: error: argument "), proc.stderr
        assert dt < 10, (argv, dt)


def test_bad_options_through_torch_compile_are_one_line_not_a_pytorch_bug():
    """The Python API: `torch.compile(..., options=)` reaches the backend only at the first call; the error is then
    the option's own (a ValueError naming the key), not BackendCompilerFailed with PyTorch's bug-report hint."""
    from dsv41.compiler.options import OptionError, OptionTypeError

    fast = torch.compile(lambda x: x * 2, backend="dsv41", options={"streamz": True})
    with pytest.raises(ValueError) as e:
        fast(torch.ones(3))
    assert isinstance(e.value, OptionError)
    msg = str(e.value)
    assert "'streamz'" in msg and "streams" in msg and "\n" not in msg and "PyTorch" not in msg
    fast = torch.compile(lambda x: x * 3, backend="dsv41", options={"debug": "yes"})
    with pytest.raises(TypeError) as e:
        fast(torch.ones(3))
    assert isinstance(e.value, OptionTypeError) and "'debug'" in str(e.value) and "\n" not in str(e.value)


def test_compile_model_validates_options_before_any_trace():
    """`dsv41.cli.compile_model` (the Python API the commands use) checks the options eagerly."""
    from dsv41.compiler.options import OptionError
    with pytest.raises(OptionError, match="'bogus'"):
        cli.compile_model(torch.nn.Linear(2, 2), "dsv41", {"bogus": 1})
