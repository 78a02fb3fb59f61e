"""`dsv41 bench --tp N` on CPU with gloo: the benchmark protocol on a sharded `tiny`, rank 0 writing the JSON.

The reference is the unsharded eager model's greedy tokens (computed here in this process): the sharded run's
eager reference tokens must equal them, every rank must agree, and the result must carry the TP plan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_bench_tp2_eager_equals_unsharded(tmp_path, moe):
    from dsv41.cli import build_model
    from dsv41.model import benchmark_prompt, generate

    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "dsv41.bench", "--tp", "2", "--tp-moe", moe, "--device", "cpu", "--preset", "tiny",
           "--backends", "eager", "--prompt-len", "20", "--new-tokens", "6", "--repeats", "1", "--no-warm-compile",
           "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tp"]["world_size"] == 2 and res["tp"]["moe_mode"] == moe and res["tp"]["ranks_agree"] is True
    assert res["tp"]["backend"] == "gloo"
    model = build_model("tiny", "cpu")
    want = generate(model, benchmark_prompt(model.config, 20), 6).tokens.tolist()
    assert res["reference_tokens"] == want
    row = res["backends"]["eager"]
    assert row["tokens_match_eager"] is True and row["decode_tok_s"]["median"] > 0


def test_bench_tp_rejects_unsupported_options():
    from dsv41.bench import main

    with pytest.raises(ValueError, match="not supported with --tp"):
        main(["--tp", "2", "--device", "cpu", "--contexts", "64"])
    with pytest.raises(ValueError, match="positive"):
        main(["--tp", "0", "--device", "cpu"])
