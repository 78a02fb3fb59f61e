#!/usr/bin/env bash
# Session 22, device call 4: the final commit's h200 decode (widening for the grouped experts only, maxnreg 72 at
# four warps), then the GPU tests of the fragment kernel and of the widened dispatch.
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
ARGS="--preset h200 --regional --backends dsv41 --prompt-len 128 --new-tokens 64 --repeats 2 --no-warm-compile --option gpu_unvalidated=true"
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_c timeout 280 python3 -m dsv41.bench $ARGS --json $OUT/final_h200.json > $OUT/final_h200.log 2>&1; echo "final rc=$?"
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "final_h200.json")
b = json.load(open(p))["backends"]["dsv41"]
top = {r["name"]: (r["count"], round(r["total_us"], 1)) for r in b["kernel_time_top"][:12]}
print("tok/s", b["decode_tok_s"], "kernels/step", b["kernels_per_step"], "roofline", b["roofline_fraction"],
      "compile_s", round(b["compile_s"], 1), "match", b["tokens_match_eager"], b["max_rel_logit_err"])
print("  ", top)
PY
timeout 150 python3 -m pytest -q -x tests/test_kernels_grouped_frag.py tests/test_pass_dispatch_widened.py > $OUT/gpu_tests_final.log 2>&1; echo "tests rc=$?"; tail -2 $OUT/gpu_tests_final.log
