#!/usr/bin/env bash
# Session 22, device call 1: install, versions, ncu of the grouped kernels, the act_quant diagnosis.
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)"; } > $OUT/gpu.txt 2>&1
cat $OUT/gpu.txt
timeout 120 python3 bench/results/2026-12-02_h200_s22/diag_act_quant.py $OUT/diag_moe.json moe > $OUT/diag_moe.txt 2>&1; echo "diag_moe rc=$?"; tail -5 $OUT/diag_moe.txt
timeout 150 ncu --clock-control none -k regex:"_grouped_frag_kernel|_grouped_words_kernel" --launch-skip 3 --launch-count 12 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  --section LaunchStats --section ComputeWorkloadAnalysis --section InstructionStats \
  python3 bench/results/2026-12-02_h200_s22/ncu_grouped.py > $OUT/ncu.txt 2>&1; echo "ncu rc=$?"
grep -E "^  _grouped|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Issued Ipc|No Eligible|Warp Cycles Per Issued|Block Limit|Executed Ipc A" $OUT/ncu.txt | head -120
timeout 330 python3 bench/results/2026-12-02_h200_s22/diag_act_quant.py $OUT/diag_bench.json bench --preset h200 --regional --backends dsv41 --prompt-len 32 --new-tokens 4 --repeats 1 --no-warm-compile --option gpu_unvalidated=true --json $OUT/diag_bench_run.json > $OUT/diag_bench.txt 2>&1; echo "diag_bench rc=$?"; tail -3 $OUT/diag_bench.txt
python3 - <<'PY'
import json, os
for f in ("diag_moe.json", "diag_bench.json"):
    p = os.path.join(os.environ["OUT"], f)
    if os.path.exists(p):
        L = json.load(open(p))
        print(f, len(L), "calls;", sum(e["found"] for e in L), "found;", "not found k:", sorted({e["k"] for e in L if not e["found"]}))
        for e in [e for e in L if not e["found"] and "tried" in e][:2]:
            print(" ", e["lhs"], e["lhs_shape"], e["stack"][-1:] )
            for t in e["tried"][:25]: print("    ", {k: v for k, v in t.items() if k != "example"}, t.get("example", "")[:2] if t.get("example") else "")
PY
