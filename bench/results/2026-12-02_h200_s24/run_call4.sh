#!/usr/bin/env bash
# Session 24, device call 4: GPU tests of the fragment GEMV (multi-weight launches too), the multi-op probe, the tiny
# fp32 GPU validation, then the h200 decode (cold compile, own Inductor cache).
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
timeout 120 python3 -m pytest -q tests/test_kernels_gemv_frag.py tests/test_kernels_gemv_multi.py -k "gpu" > $OUT/gpu_tests_call4.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/gpu_tests_call4.log
timeout 90 python3 bench/results/2026-12-02_h200_s24/multi_frag_probe.py $OUT/multi_frag_probe.json 2>&1 | grep -v Warn | tail -12
timeout 100 python3 -m dsv41 run --preset tiny --device cuda --dtype fp32 --prompt-len 40 --new-tokens 16 --option gpu_unvalidated=true --json $OUT/run_tiny_fp32_multi.json > $OUT/run_tiny_fp32_multi.log 2>&1; echo "tiny rc=$?"
python3 -c "import json; d=json.load(open('$OUT/run_tiny_fp32_multi.json')); print('tiny tokens_match_eager', d['tokens_match_eager'])"
ARGS="--preset h200 --regional --backends dsv41 --prompt-len 128 --new-tokens 64 --repeats 2 --no-warm-compile --option gpu_unvalidated=true"
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_c4 timeout 270 python3 -m dsv41.bench $ARGS --json $OUT/multi_frag_h200.json > $OUT/multi_frag_h200.log 2>&1; echo "e2e rc=$?"
python3 - <<'PY'
import json, os, collections
p = os.path.join(os.environ["OUT"], "multi_frag_h200.json")
if os.path.exists(p):
    b = json.load(open(p))["backends"]["dsv41"]
    print("tok/s", b["decode_tok_s"], "kernels/step", b["kernels_per_step"], "roofline", b["roofline_fraction"],
          "compile_s", round(b["compile_s"], 1), "match", b["tokens_match_eager"], b["max_rel_logit_err"])
    f = b["report"]["families"]["sibling_gemv"]
    print("sibling_gemv", f["matches"], collections.Counter(str(s["detail"]["N"]) for s in f["sites"]),
          "near", collections.Counter(m["check"] for m in f["near_misses"]))
    top = {r["name"]: (r["count"], round(r["total_us"], 1)) for r in b["kernel_time_top"][:14]}
    print("  ", top)
PY
