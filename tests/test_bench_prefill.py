"""`dsv41 bench --compiled-prefill` and the prefill figures of the result (issue [prefill]): the rows' runs prefill
through their runner in chunks (here the eager row, whose runner is the model: chunked against the whole-prompt
eager reference, so `tokens_match_eager` is a real comparison), rows carry `ttft_s`, and the top level the FLOP
floor's inputs (null rate and floor on CPU)."""

from __future__ import annotations

import pytest

from dsv41 import bench
from dsv41.bench_protocol import prefill_floor
from dsv41.model import PREFILL_CHUNKS


def test_compiled_prefill_rows_chunk_and_report_ttft(monkeypatch):
    seen = []
    real = bench.timed_run

    def timed(runner, prompt, new_tokens, cuda, speculative=None, compiled_prefill=False):
        seen.append(compiled_prefill)
        return real(runner, prompt, new_tokens, cuda, speculative, compiled_prefill)

    monkeypatch.setattr(bench, "timed_run", timed)
    r = bench.run_benchmark("tiny", "eager", prompt_len=19, new_tokens=4, repeats=1, device="cpu",
                            warm_compile=False, compiled_prefill=True)
    assert seen and all(seen)
    assert r["compiled_prefill"] is True and r["prefill_chunks"] == list(PREFILL_CHUNKS)
    assert r["prefill_flops"] == 2 * r["params"]["active_decode"] * 19
    assert r["tensor_core_rate"] is None and r["prefill_floor_tok_s"] is None
    row = r["backends"]["eager"]
    assert row["tokens_match_eager"] is True
    assert row["ttft_s"] > 0
    assert "ttft_s" in r["definitions"] and "prefill_floor_tok_s" in r["definitions"]


def test_prefill_floor_arithmetic():
    got = prefill_floor(8_000_000_000, 4096, {"tflops": 1000.0, "dtype": "float8_e4m3fn"})
    assert got["prefill_flops"] == 2 * 8e9 * 4096
    assert got["prefill_floor_tok_s"] == pytest.approx(4096 / (2 * 8e9 * 4096 / 1e15))
    assert prefill_floor(10, 3, None)["prefill_floor_tok_s"] is None
    with pytest.raises(ValueError, match="positive"):
        prefill_floor(0, 3, None)
