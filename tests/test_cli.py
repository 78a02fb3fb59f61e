"""`dsv41 run`: defaults and wiring (the real dsv41 compile of `tiny` is covered by the session fixture
`tiny_dsv41`; here the compile step is replaced by eager execution to keep the test fast)."""

from __future__ import annotations

import json

import pytest
import torch

import dsv41.cli as cli
import dsv41.harness as harness


def test_run_defaults_to_the_dsv41_backend_and_checks_against_eager(tmp_path, monkeypatch):
    calls = []

    def fake_compile(model, backend, options=None, regional=False):
        calls.append(backend)
        return model

    monkeypatch.setattr(harness, "compile_model", fake_compile)
    out = tmp_path / "run.json"
    with torch.no_grad():
        rc = cli.main(["run", "--device", "cpu", "--prompt-len", "8", "--new-tokens", "3", "--json", str(out)])
    assert rc == 0
    assert calls == ["dsv41"]
    r = json.loads(out.read_text())
    assert r["backend"] == "dsv41" and r["preset"] == "tiny" and r["tokens_match_eager"] is True
    assert len(r["tokens"]) == 3 and r["prompt_len"] == 8


def test_run_reports_a_token_mismatch_with_exit_status_1(tmp_path, monkeypatch):
    class Wrong(torch.nn.Module):
        """A 'compiled' model whose logits always pick token 0 (an empty wrapper would match eager)."""

        def __init__(self, model):
            super().__init__()
            self._orig_mod = model

        def forward(self, ids, pos, last_only=False):
            logits = self._orig_mod(ids, pos, last_only=last_only)
            fake = torch.zeros_like(logits)
            fake[..., 0] = 1.0
            return fake

    monkeypatch.setattr(harness, "compile_model", lambda model, backend, options=None, regional=False: Wrong(model))
    with torch.no_grad():
        rc = cli.main(["run", "--device", "cpu", "--prompt-len", "8", "--new-tokens", "3",
                       "--json", str(tmp_path / "r.json")])
    assert rc == 1
    assert json.loads((tmp_path / "r.json").read_text())["tokens_match_eager"] is False


def test_option_flags_become_the_backend_options_dict():
    from dsv41.cli import backend_options, compile_model
    assert backend_options(["streams=false", "disable=[\"moe\"]", "report=out.html", "cuda_graphs=null"]) == {
        "streams": False, "disable": ["moe"], "report": "out.html", "cuda_graphs": None}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        backend_options(["streams"])
    with pytest.raises(ValueError, match="dsv41 backend only"):
        compile_model(torch.nn.Linear(2, 2), "inductor", {"streams": False})


def test_compiled_prefill_flag_sends_the_prompt_through_the_runner_in_chunks(tmp_path, monkeypatch):
    """`dsv41 run --compiled-prefill`: the prompt (11 tokens: chunks 8, 1, 1, 1) goes through the runner, not the
    eager module, and the tokens are still checked against an eager whole-prompt run."""
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self._orig_mod = model

        def forward(self, ids, pos, last_only=False):
            seen.append(ids.shape[1])
            return self._orig_mod(ids, pos, last_only=last_only)

    monkeypatch.setattr(harness, "compile_model", lambda model, backend, options=None, regional=False: Spy(model))
    out = tmp_path / "run.json"
    with torch.no_grad():
        rc = cli.main(["run", "--device", "cpu", "--prompt-len", "11", "--new-tokens", "3", "--compiled-prefill",
                       "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["compiled_prefill"] is True and r["tokens_match_eager"] is True
    # two runs (first + measured), each: chunks 8, 1, 1, 1 then two decode steps
    assert seen == [8, 1, 1, 1, 1, 1] * 2
