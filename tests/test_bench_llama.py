"""`dsv41 bench --model llama-tiny` (issue [generic] #42): a third party's Llama decoded by the four rows on CPU.

One run of the command, shared by the assertions (`llama_run`); its figures are checked against references the
test computes itself: parameter and byte counts from the model's sizes, the greedy tokens from the zoo model run
eagerly here. Bad requests are a table of argument lists and the one line each must print.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from zoo import llama_gptfast as gf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = ("eager", "inductor", "inductor-cudagraphs", "dsv41")
PROMPT, NEW = 8, 4


@pytest.fixture(scope="session")
def llama_run(tmp_path_factory):
    """(result JSON, stdout) of `python -m dsv41.bench --model llama-tiny` on CPU, prompt 8, 4 tokens, 1 repeat."""
    out = tmp_path_factory.mktemp("llama") / "llama_tiny.json"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "dsv41.bench", "--model", "llama-tiny", "--device", "cpu",
                           "--prompt-len", str(PROMPT), "--new-tokens", str(NEW), "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=1800, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _sizes(args):
    """(parameters, bytes one fp32 decode step reads at context C) of ModelArgs `args`, from the Llama layout:
    per layer q/k/v/o, gate/up/down and two norms; the embedding (one row read per step), final norm and head."""
    e, f, v, kv = args.dim, args.intermediate_size, args.vocab_size, args.n_local_heads * args.head_dim
    layer = e * (e + 2 * kv) + e * e + 3 * e * f + 2 * e
    params = v * e + args.n_layer * layer + e + v * e
    c = PROMPT + NEW // 2
    step = 4 * (params - v * e + e) + 4 * 2 * args.n_layer * kv * c
    return params, step


def test_the_json_names_the_model_and_every_row(llama_run):
    res, _ = llama_run
    assert res["model"] == "llama-tiny"
    assert tuple(res["backends"]) == ROWS
    for key in ("params", "decode_bytes_per_step", "copy_bandwidth_tb_s", "roofline_tok_s", "date", "torch",
                "triton", "gpu"):
        assert key in res, key
    for name, row in res["backends"].items():
        for key in ("decode_tok_s", "roofline_fraction", "kernels_per_step", "tokens_match_eager", "compile_s",
                    "max_rel_logit_err"):
            assert key in row, (name, key)


def test_params_and_bytes_per_step_follow_from_the_sizes(llama_run):
    res, _ = llama_run
    params, step = _sizes(gf.ModelArgs.from_name("llama-tiny"))
    assert res["params"]["total"] == params
    assert res["decode_bytes_per_step"] == step
    assert res["decode_context"] == PROMPT + NEW // 2


@pytest.mark.parametrize("row", ROWS)
def test_every_row_decodes_eagers_greedy_tokens_in_fp32(llama_run, row):
    res, _ = llama_run
    r = res["backends"][row]
    assert r["tokens_match_eager"] is True, r["note"]
    assert r["decode_tok_s"]["min"] > 0 and r["decode_tok_s"]["min"] <= r["decode_tok_s"]["median"]
    assert r["recompiles"] == 0  # one compiled step served every position
    assert r["matching_prefix_tokens"] == NEW
    assert r["max_rel_logit_err"] < 1e-5  # eager's tokens teacher-forced: the same logits as eager's in fp32


@pytest.mark.parametrize("row", ROWS)
def test_cpu_rows_have_no_kernel_count_or_roofline_and_say_why(llama_run, row):
    res, _ = llama_run
    r = res["backends"][row]
    assert r["kernels_per_step"] is None and r["roofline_fraction"] is None and res["roofline_tok_s"] is None
    assert "CPU" in r["note"]
    assert (r["compile_s"] is None) == (row == "eager")


def test_the_reference_is_the_zoo_model_decoded_here(llama_run):
    res, _ = llama_run
    m = gf.build("llama-tiny", max_seq_length=PROMPT + NEW)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(42))
    toks = []
    with torch.no_grad():
        logits = m(ids, torch.arange(PROMPT))
        for t in range(PROMPT, PROMPT + NEW):
            toks.append(int(logits[0, -1].argmax()))
            logits = m(torch.tensor([[toks[-1]]]), torch.tensor([t]))
    assert res["reference_tokens"] == [toks]


def test_the_dsv41_row_carries_match_counts_not_the_report(llama_run):
    res, _ = llama_run
    row = res["backends"]["dsv41"]
    assert "report" not in row
    assert row["fusion_matches"] and all(isinstance(v, int) for v in row["fusion_matches"].values())


def test_the_table_is_printed_last(llama_run):
    _, out = llama_run
    lines = out.strip().splitlines()
    title = max(i for i, line in enumerate(lines) if "decode benchmark: llama-tiny" in line)
    assert title > max(i for i, line in enumerate(lines) if line.startswith("wrote "))
    after = "\n".join(lines[title:])
    assert all(f"│ {r} " in after for r in ROWS), after


BAD = [
    (["--model", "llama-tiny", "--preset", "tiny"], "--model and --preset are mutually exclusive"),
    (["--model", "llama-70b"], "argument --model: unknown model 'llama-70b'"),
    (["--model", "llama-tiny", "--backends", "eager,dsv41-no-moe"], "'dsv41-no-moe' is not a --model row"),
    (["--model", "llama-tiny", "--speculative", "3"], "not allowed with --speculative"),
    (["--model", "llama-tiny", "--contexts", "64"], "not allowed with --contexts"),
    (["--model", "llama-tiny", "--weight-mode", "bf16"], "not allowed with --weight-mode"),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(b[0][2:]) or b[0][1] for b in BAD])
def test_a_bad_combination_is_one_line(argv, words, capsys):
    from dsv41 import bench
    assert bench.console_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsv41 bench: error: ") and words in err[0], err


def test_without_a_source_checkout_model_is_one_line(tmp_path, monkeypatch, capsys):
    from dsv41 import bench, bench_llama
    monkeypatch.setattr(bench_llama, "checkout_root", lambda: tmp_path)
    monkeypatch.delitem(sys.modules, "dsv41_zoo_llama_gptfast", raising=False)
    assert bench.console_main(["--model", "llama-tiny", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == ("dsv41 bench: error: --model needs a source checkout "
                                               "(tests/zoo/llama_gptfast.py not found)")
