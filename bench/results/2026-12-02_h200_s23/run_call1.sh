#!/usr/bin/env bash
# Session 23, device call 1: the read ceiling at the h200 GEMV byte counts (bench/read_ceiling.py), then the h200
# decode at HEAD (b743d50 + the probe): tok/s, and whether the edge-probe quantiser check still takes the model's
# quantisers under torch 2.11 (dispatch patterns and quantiser_lookalike findings).
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/gpu.txt
timeout 200 python3 bench/read_ceiling.py --reps-ms 40 --json $OUT/read_ceiling.json > $OUT/read_ceiling.log 2>&1; echo "read rc=$?"
grep -v "^SUMMARY" $OUT/read_ceiling.log | tail -45
ARGS="--preset h200 --regional --backends dsv41 --prompt-len 128 --new-tokens 64 --repeats 2 --no-warm-compile --option gpu_unvalidated=true"
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_a timeout 300 python3 -m dsv41.bench $ARGS --json $OUT/head_h200.json > $OUT/head_h200.log 2>&1; echo "e2e rc=$?"
python3 - <<'PY'
import json, os, collections
p = os.path.join(os.environ["OUT"], "head_h200.json")
if os.path.exists(p):
    b = json.load(open(p))["backends"]["dsv41"]
    print("tok/s", b["decode_tok_s"], "kernels/step", b["kernels_per_step"], "roofline", b["roofline_fraction"],
          "compile_s", round(b["compile_s"], 1), "match", b["tokens_match_eager"], b["max_rel_logit_err"])
    d = b["report"]["families"]["dispatch"]
    pat = collections.Counter(f"{s['pattern']}(aq={s['detail'].get('act_quant')},x={s['detail'].get('x_dtype')})" for s in d["sites"])
    print("dispatch", d["matches"], dict(pat))
    kinds = collections.Counter(f["kind"] for f in d["findings"])
    print("findings", dict(kinds))
    for f in d["findings"]:
        if f["kind"] == "quantiser_lookalike": print("  ", f["message"][:200])
    top = {r["name"]: (r["count"], round(r["total_us"], 1)) for r in b["kernel_time_top"][:12]}
    print("  ", top)
PY
grep SUMMARY $OUT/read_ceiling.log
