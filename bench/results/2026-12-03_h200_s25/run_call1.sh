#!/usr/bin/env bash
# Session 25, device call 1: GPU tests of the mHC kernels and the fragment GEMV, the mixes probe (s24 against s25
# kernel), the fold_x probe, then the h200 decode (cold compile, own Inductor cache).
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
timeout 60 python3 -m pytest -q tests/test_kernels_gpu.py -k mhc > $OUT/gpu_tests_call1_mhc.log 2>&1; echo "tests rc=$?"; tail -2 $OUT/gpu_tests_call1_mhc.log
timeout 120 python3 -m pytest -q tests/test_kernels_gemv_frag.py tests/test_kernels_gemv_multi.py -k gpu > $OUT/gpu_tests_call1.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/gpu_tests_call1.log
timeout 80 python3 bench/results/2026-12-03_h200_s25/mhc_probe.py $OUT/mhc_probe.json 2>&1 | grep -v Warn | tail -12
timeout 120 python3 bench/results/2026-12-03_h200_s25/fold_probe.py $OUT/fold_probe.json 2>&1 | grep -v Warn | tail -32
ARGS="--preset h200 --regional --backends dsv41 --prompt-len 128 --new-tokens 64 --repeats 2 --no-warm-compile --option gpu_unvalidated=true"
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_c timeout 270 python3 -m dsv41.bench $ARGS --json $OUT/mixes_h200.json > $OUT/mixes_h200.log 2>&1; echo "e2e rc=$?"
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "mixes_h200.json")
if os.path.exists(p):
    b = json.load(open(p))["backends"]["dsv41"]
    print("tok/s", b["decode_tok_s"], "kernels/step", b["kernels_per_step"], "roofline", b["roofline_fraction"],
          "compile_s", round(b["compile_s"], 1), "match", b["tokens_match_eager"], b["max_rel_logit_err"])
    top = {r["name"]: (r["count"], round(r["total_us"], 1)) for r in b["kernel_time_top"][:14]}
    print("  ", top)
PY
