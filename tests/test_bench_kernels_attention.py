"""CPU test of the attention / indexer rows of `bench/kernels.py --families` (`CONTEXT_CASES`).

Runs the script once, in a child process started with TRITON_INTERPRET=1 (Triton decides interpreter or compiler
when it is first imported, so the variable cannot be set from inside this pytest process; see
tests/interp_harness.py), at the tiny preset and two small contexts:
  - 12 tokens: fewer visible ratio-2 rows (6) than index_topk (8), so the attention indices and the ratio-2 top-k
    carry -1 slots, the window holds fewer rows than sliding_window, and the candidate pool is every block;
  - 200 tokens: every top-k slot filled, the window full, the pool a strict subset of the blocks.
It also runs one old family (moe_combine) at `--m 2`, so `--only` and `--m` are checked to still select and
shape the old rows while the new rows stay at M = 1.

Checked: every new (kernel, shape) has a Triton row whose output matches the eager reference (`check` in the row):
  fp32 scores: max |d| <= 1e-5 (1 + max |ref|) (FP32 dot products of 32 channels summed in another order);
  bf16 attention output: max |d| <= 2^-7 max |ref| + 1e-3 (the op rounds to bf16 twice: before and after the
  inverse RoPE; one rounding-boundary flip each);
  integer outputs (top-k / candidate ids): no element differs; no NaN where the reference has none.
And the attention and ratio-1 score rows' byte floors equal the sums written out below from the tiny preset.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "kernels.py")
CONTEXTS = (12, 200)
NEW_KERNELS = ("sparse_fp4_attention", "indexer_scores", "indexer_topk", "indexer_candidates")
#: (kernel, shape suffix) of every new case, per context.
NEW_CASES = [("sparse_fp4_attention", ""), ("indexer_scores", "_r2"), ("indexer_scores", "_r1"),
             ("indexer_scores", "_pool"), ("indexer_topk", "_r2"), ("indexer_topk", "_r1"), ("indexer_topk", "_pool"),
             ("indexer_candidates", "_r1")]


@pytest.fixture(scope="module")
def bench_rows(tmp_path_factory):
    """(meta, rows) of one interpreted `--families --tiny --device cpu` run (about 10 s on 2 cores)."""
    out = tmp_path_factory.mktemp("bench_attn") / "rows.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, SCRIPT, "--families", "--tiny", "--device", "cpu", "--m", "2",
           "--contexts", ",".join(map(str, CONTEXTS)), "--json", str(out), "--only", "moe_combine", *NEW_KERNELS]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        data = json.load(f)
    return data["meta"], data["rows"]


def _triton_row(rows, kernel, shape):
    hits = [r for r in rows if r["kernel"] == kernel and r["shape"] == shape and r["variant"].startswith("triton")]
    assert len(hits) == 1, f"{kernel} {shape}: {len(hits)} triton rows"
    return hits[0]


def test_every_new_case_has_a_triton_row_matching_its_reference(bench_rows):
    meta, rows = bench_rows
    assert meta["errors"] == [] and meta["preset"] == "tiny" and meta["contexts"] == list(CONTEXTS)
    for ctx in CONTEXTS:
        for kernel, suffix in NEW_CASES:
            r = _triton_row(rows, kernel, f"tiny_ctx{ctx}{suffix}")
            assert r["M"] == 1 and r["context"] == ctx and r["bytes"] > 0
            c = r["check"]
            what = f"{kernel} ctx{ctx}{suffix}: {c}"
            assert c["nan_mismatch"] == 0 and c["unequal_ints"] == 0, what
            if kernel == "sparse_fp4_attention":
                assert c["max_abs_ref"] > 0, what  # a zero output (all mass on the sink) would check nothing
                assert c["max_abs_diff"] <= 2 ** -7 * c["max_abs_ref"] + 1e-3, what
            elif kernel == "indexer_scores":
                assert c["max_abs_ref"] > 0, what
                assert c["max_abs_diff"] <= 1e-5 * (1 + c["max_abs_ref"]), what
            # A reference row of the same case was timed too.
            assert any(x["kernel"] == kernel and x["shape"] == r["shape"] and x["variant"].startswith("reference")
                       for x in rows), what


def test_only_and_m_still_apply_to_the_old_families(bench_rows):
    _, rows = bench_rows
    old = [r for r in rows if r["kernel"] not in NEW_KERNELS]
    assert old and {r["kernel"] for r in old} == {"moe_combine"}
    assert all(r["M"] == 2 and "context" not in r for r in old)
    assert len(rows) - len(old) == 2 * len(NEW_CASES) * len(CONTEXTS)  # triton + reference per new case


def test_tiny_preset_has_the_sizes_the_floors_below_assume():
    from dsv41.model import ModelConfig
    c = ModelConfig.preset("tiny")
    assert (c.num_attention_heads, c.head_dim, c.qk_rope_head_dim, c.sliding_window, c.index_topk) == (4, 64, 16, 16, 8)
    assert (c.index_n_heads, c.index_head_dim) == (4, 32)


def test_attention_byte_floor_by_hand(bench_rows):
    _, rows = bench_rows
    # tiny: H = 4 heads, D = 64, R = 16 rope channels (8 cos + 8 sin), window 16, k = 8 index_topk, bf16 q / o.
    q_and_o = 2 * (4 * 64 * 2)          # q read + o written, 2 B each: 1024
    window_row = 64 + 64 // 32 + 1      # E4M3 bytes + UE8M0 scales + the window_ok byte: 67
    bank_row = 64 // 2 + 64 // 16       # packed E2M1 + E4M3 scale per 16 channels: 36
    indices = 8 * 8                     # k int64 slots, -1 ones included: 64
    sink_cos_sin = 4 * 4 + 2 * 8 * 4    # fp32 sink per head, fp32 cos and sin: 80
    # 12 tokens: window min(16, 12) = 12 rows; ratio-2 bank: floor(12 / 2) = 6 visible rows < k -> 6 gathered.
    want_12 = q_and_o + 12 * window_row + 6 * bank_row + indices + sink_cos_sin
    # 200 tokens: window 16 rows; floor(200 / 2) = 100 visible rows >= k -> 8 gathered.
    want_200 = q_and_o + 16 * window_row + 8 * bank_row + indices + sink_cos_sin
    assert (want_12, want_200) == (2188, 2528)
    assert _triton_row(rows, "sparse_fp4_attention", "tiny_ctx12")["bytes"] == want_12
    assert _triton_row(rows, "sparse_fp4_attention", "tiny_ctx200")["bytes"] == want_200


def test_index_score_byte_floor_by_hand(bench_rows):
    _, rows = bench_rows
    # Ratio 1 at 200 tokens: 200 key rows of Di = 32 channels (16 B E2M1 + 1 B UE8M0), q 4 heads x 32 bf16,
    # 4 fp32 head weights, one int64 n_visible, 200 fp32 scores written.
    want = 200 * (16 + 1) + 4 * 32 * 2 + 4 * 4 + 8 + 200 * 4
    assert want == 4480
    assert _triton_row(rows, "indexer_scores", "tiny_ctx200_r1")["bytes"] == want


def test_contexts_argument():
    spec = importlib.util.spec_from_file_location("_dsv41_bench_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports torch only; Triton is imported by the --families run
    assert mod._contexts_arg("4096,32768,131072") == [4096, 32768, 131072]
    for bad in ("1", "64,x", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            mod._contexts_arg(bad)
    assert mod.main(["--contexts", "64"]) == 2  # GEMV mode: --contexts belongs to --families
