#!/usr/bin/env bash
# Session 25, device call 3 (the committed tree: Sinkhorn with div.full, no fold_x): GPU tests of the mHC kernels,
# the h200 decode (cold compile, own Inductor cache), then the tiny fp32 GPU validation.
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt 2>&1
timeout 40 python3 -m pytest -q tests/test_kernels_gpu.py -k mhc > $OUT/gpu_tests_call3_mhc.log 2>&1; echo "tests rc=$?"; tail -1 $OUT/gpu_tests_call3_mhc.log
ARGS="--preset h200 --regional --backends dsv41 --prompt-len 128 --new-tokens 64 --repeats 2 --no-warm-compile --option gpu_unvalidated=true"
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_c timeout 250 python3 -m dsv41.bench $ARGS --json $OUT/final_h200.json > $OUT/final_h200.log 2>&1; echo "e2e rc=$?"
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "final_h200.json")
b = json.load(open(p))["backends"]["dsv41"] if os.path.exists(p) else {}
if b.get("decode_tok_s"):
    print("tok/s", b["decode_tok_s"], "kernels/step", b["kernels_per_step"], "roofline", b["roofline_fraction"])
    print("  ", {r["name"]: (r["count"], round(r["total_us"], 1)) for r in b["kernel_time_top"][:8]})
PY
timeout 110 python3 -m dsv41 run --preset tiny --device cuda --dtype fp32 --prompt-len 40 --new-tokens 16 --option gpu_unvalidated=true --json $OUT/run_tiny_fp32.json > $OUT/run_tiny_fp32.log 2>&1; echo "tiny rc=$?"; grep -i "match\|token" $OUT/run_tiny_fp32.log | head -5
