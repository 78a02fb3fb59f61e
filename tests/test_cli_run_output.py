"""What `dsv41 run`, `dsv41 report` and `dsv41 bench` print and write (issue [first-contact] items 4, 5 and 7).

- progress: in a pipe, a line when each phase starts and one with its seconds when it ends (a real child process
  with piped stdout / stderr: `tests/fake_compile_run.py` replaces the compile by eager execution);
- output paths: files the user did not name go into `out/` under the current directory, never loose in it, and
  the path is printed; `-o` puts them where the user says;
- the run summary: matches per family labelled as matches, the normalize rewrites apart, kernels and bytes per
  step before -> after, compile time, the report's path; rows on one line when piped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch

import dsv41.cli as cli
import dsv41.harness as harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from report_fixture import hand_built_report  # noqa: E402


def _piped_run(cwd, *argv):
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("DSV41_REPORT", None)
    return subprocess.run([sys.executable, os.path.join(REPO, "tests", "fake_compile_run.py"), *argv], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_piped_run_prints_a_line_per_phase_with_seconds_and_writes_into_out(tmp_path):
    proc = _piped_run(tmp_path, "run", "--prompt-len", "8", "--new-tokens", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr.splitlines()
    phases = ["building tiny", "eager reference", "dsv41: compile + first run", "dsv41: measured run"]
    for ph in phases:
        start = [line for line in err if line.startswith(f"dsv41 run: {ph}") and line.endswith(" ...")]
        end = [line for line in err if line.startswith(f"dsv41 run: {ph}")
               and re.search(r": \d+\.\d s \(total \d+\.\d s\)$", line)]
        assert len(start) == 1 and len(end) == 1, (ph, err)
    assert "a cold tiny compile takes minutes" in proc.stderr  # said before the long phase, not after
    assert "USDT" not in proc.stderr and "Traceback" not in proc.stderr
    # nothing loose in the current directory: the report went to out/, and its path is printed
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(tmp_path / "out") == ["dsv41_report.html"]
    assert "out/dsv41_report.html" in proc.stdout


def test_the_run_summary_labels_matches_rewrites_kernels_bytes_compile_and_the_report(tmp_path):
    proc = _piped_run(tmp_path, "run", "--prompt-len", "8", "--new-tokens", "3", "-o", "pages/r.html", "--json",
                      "res/r.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    lines = out.splitlines()

    def row(label):
        found = [line for line in lines if line.strip().startswith(label)]
        assert len(found) == 1, (label, out)
        return found[0]

    assert "900 -> 120" in row("kernels per step")
    assert re.search(r"24\.16 MB -> 5\.24 MB", row("bytes per step"))
    assert re.search(r"\d+\.\d s", row("compile"))
    assert "pages/r.html" in row("report")
    assert "not a benchmark" in row("note")
    assert "matches per family" in out
    assert re.search(r"^\s*dispatch\s+4\s+24\.00 MB -> 5\.20 MB\s*$", out, re.M)
    assert re.search(r"^\s*mhc\s+4\s", out, re.M)
    assert not re.search(r"^\s*normalize\s+40", out, re.M)  # not among the fusions ...
    assert "rewrites" in row("rewrites") and "normalize 40" in row("rewrites")  # ... but apart
    assert "1 layers" not in out
    assert (tmp_path / "pages" / "r.html").is_file()
    r = json.loads((tmp_path / "res" / "r.json").read_text())
    assert r["report_html"] == "pages/r.html" and r["compile"]["cache"] == {
        "fxgraph_hit": 0, "fxgraph_miss": 0, "aot_autograd_hit": 0}
    assert set(r["phases_s"]) == {"build", "eager_reference", "compile_and_first_run", "measured_run"}
    assert r["options"] == {"count_kernels": True}  # the summary's kernels before -> after


def test_report_command_writes_into_out_and_prints_phases(tmp_path, monkeypatch, capsys):
    import dsv41.compiler.report as report_mod

    rep = hand_built_report()
    calls = []
    monkeypatch.setattr(harness, "compile_model", lambda model, backend, options=None, **kw: calls.append(1) or model)
    monkeypatch.setattr(report_mod, "last_report", lambda: rep if calls else None)
    monkeypatch.chdir(tmp_path)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(["report", "--prompt-len", "8", "--device", "cpu"]) == 0
    finally:
        torch.set_num_threads(n)
    out, err = capsys.readouterr()
    assert os.listdir(tmp_path) == ["out"] and (tmp_path / "out" / "dsv41_report.html").is_file()
    assert "wrote out/dsv41_report.html" in out
    assert re.search(r"^dsv41 report: dsv41: compile \+ 3 tokens: \d+\.\d s", err, re.M), err


def test_bench_png_without_a_path_goes_into_out(tmp_path, monkeypatch, capsys):
    import dsv41.bench as bench
    from test_bench import _fake_result

    monkeypatch.setattr(bench, "run_benchmark", lambda *a, **k: _fake_result())
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--backends", "eager", "--png"]) == 0
    assert os.listdir(tmp_path) == ["out"] and os.listdir(tmp_path / "out") == ["dsv41_bench.png"]
    assert "wrote out/dsv41_bench.png" in capsys.readouterr().out
    assert cli.main(["bench", "--backends", "eager", "--png", "-o", "elsewhere"]) == 0
    assert (tmp_path / "elsewhere" / "dsv41_bench.png").is_file()


def test_phases_in_a_terminal_show_a_live_timer_and_leave_one_line_each():
    import io

    from rich.console import Console

    from dsv41.progress import Phases

    buf = io.StringIO()
    ph = Phases("dsv41 run", console=Console(file=buf, force_terminal=True, width=100))
    assert ph.live
    with ph.phase("compile", hint="takes a while"):
        pass
    text = buf.getvalue()
    assert re.search(r"compile: \d+\.\d s", text) and "dsv41 run:" not in text  # no log prefix in a terminal
    assert "compile" in ph.seconds


def test_bench_prints_a_line_per_phase_with_seconds_when_piped(capsys):
    import dsv41.bench as bench

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.run_benchmark("tiny", "eager", prompt_len=8, new_tokens=3, repeats=1, device="cpu")
    finally:
        torch.set_num_threads(n)
    err = capsys.readouterr().err
    assert re.search(r"^\[\s*\d+\.\d s\] eager reference \.\.\.$", err, re.M), err
    assert re.search(r"^\[\s*\d+\.\d s\] eager reference: \d+\.\d s$", err, re.M), err
    assert re.search(r"^\[\s*\d+\.\d s\] eager: cold compile \+ first run \.\.\.$", err, re.M), err
    assert "USDT" not in err
