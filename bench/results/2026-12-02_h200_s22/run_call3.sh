#!/usr/bin/env bash
# Session 22, device call 3: h200 decode A/B, one lease: (a) this commit, (b) the same with the float32 quantiser
# input not taken (dispatch as before this session: w2 / wq_b / shared w2 sites act_quant=False). Separate Inductor
# caches, so neither run is served the other's graphs.
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
ARGS="--preset h200 --regional --backends dsv41 --prompt-len 128 --new-tokens 64 --repeats 2 --no-warm-compile --option gpu_unvalidated=true"
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_a timeout 290 python3 -m dsv41.bench $ARGS --json $OUT/ab_widened_on.json > $OUT/ab_widened_on.log 2>&1; echo "a rc=$?"
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_b timeout 290 python3 -c "
import sys, runpy
import dsv41.passes.dispatch as D
D._act_quant_input = lambda lhs, k, ev, s: None if k % 32 else D._quantiser_input(lhs, k, ev, s, D.tensor_val(lhs).dtype)
sys.argv = ['dsv41.bench'] + sys.argv[1:]
runpy.run_module('dsv41.bench', run_name='__main__')" $ARGS --json $OUT/ab_widened_off.json > $OUT/ab_widened_off.log 2>&1; echo "b rc=$?"
python3 - <<'PY'
import json, os
for f in ("ab_widened_on.json", "ab_widened_off.json"):
    p = os.path.join(os.environ["OUT"], f)
    if not os.path.exists(p): print(f, "missing"); continue
    b = json.load(open(p))["backends"]["dsv41"]
    top = {r["name"]: (r["count"], round(r["total_us"], 1)) for r in b["kernel_time_top"][:14]}
    print(f, "tok/s", b["decode_tok_s"], "kernels/step", b["kernels_per_step"], "roofline", b["roofline_fraction"],
          "compile_s", round(b["compile_s"], 1), "match", b["tokens_match_eager"], b["max_rel_logit_err"])
    print("  ", top)
PY
