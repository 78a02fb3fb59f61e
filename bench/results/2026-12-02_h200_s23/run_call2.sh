#!/usr/bin/env bash
# Session 23, device call 2: the fragment kernel's unmasked (EVEN) path: probe against the masked kernel, the h200
# decode with EVEN by default, then the fragment kernel's GPU tests.
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
timeout 150 python3 bench/results/2026-12-02_h200_s23/frag_even_probe.py $OUT/frag_even_probe.json > $OUT/frag_even_probe.log 2>&1; echo "probe rc=$?"
cat $OUT/frag_even_probe.log | grep -v Warn | tail -30
ARGS="--preset h200 --regional --backends dsv41 --prompt-len 128 --new-tokens 64 --repeats 2 --no-warm-compile --option gpu_unvalidated=true"
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_b timeout 280 python3 -m dsv41.bench $ARGS --json $OUT/even_h200.json > $OUT/even_h200.log 2>&1; echo "e2e rc=$?"
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "even_h200.json")
if os.path.exists(p):
    b = json.load(open(p))["backends"]["dsv41"]
    print("tok/s", b["decode_tok_s"], "kernels/step", b["kernels_per_step"], "roofline", b["roofline_fraction"],
          "compile_s", round(b["compile_s"], 1), "match", b["tokens_match_eager"], b["max_rel_logit_err"])
    top = {r["name"]: (r["count"], round(r["total_us"], 1)) for r in b["kernel_time_top"][:12]}
    print("  ", top)
PY
timeout 120 python3 -m pytest -q -x tests/test_kernels_grouped_frag.py > $OUT/gpu_tests_frag.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/gpu_tests_frag.log
