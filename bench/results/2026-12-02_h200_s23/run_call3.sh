#!/usr/bin/env bash
# Session 23, device call 3: GPU tests of the multi-GEMV op and the paired fragment launch, the probe of both, then
# the h200 decode with sibling_gemv and the paired launch (cold compile, own Inductor cache).
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
timeout 100 python3 -m pytest -q tests/test_kernels_gemv_multi.py tests/test_kernels_grouped_frag.py -k "gpu" > $OUT/gpu_tests_call3.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/gpu_tests_call3.log
timeout 100 python3 bench/results/2026-12-02_h200_s23/multi_probe.py $OUT/multi_probe.json 2>&1 | grep -v Warn | tail -8
ARGS="--preset h200 --regional --backends dsv41 --prompt-len 128 --new-tokens 64 --repeats 2 --no-warm-compile --option gpu_unvalidated=true"
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_c timeout 300 python3 -m dsv41.bench $ARGS --json $OUT/multi_h200.json > $OUT/multi_h200.log 2>&1; echo "e2e rc=$?"
python3 - <<'PY'
import json, os, collections
p = os.path.join(os.environ["OUT"], "multi_h200.json")
if os.path.exists(p):
    b = json.load(open(p))["backends"]["dsv41"]
    print("tok/s", b["decode_tok_s"], "kernels/step", b["kernels_per_step"], "roofline", b["roofline_fraction"],
          "compile_s", round(b["compile_s"], 1), "match", b["tokens_match_eager"], b["max_rel_logit_err"])
    f = b["report"]["families"]
    print("sibling_gemv", f["sibling_gemv"]["matches"], collections.Counter(str(s["detail"]["N"]) for s in f["sibling_gemv"]["sites"]),
          "near", collections.Counter(m["check"] for m in f["sibling_gemv"]["near_misses"]))
    top = {r["name"]: (r["count"], round(r["total_us"], 1)) for r in b["kernel_time_top"][:14]}
    print("  ", top)
PY
