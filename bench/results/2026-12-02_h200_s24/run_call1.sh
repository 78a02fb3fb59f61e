#!/usr/bin/env bash
# Session 24, device calls 1 and 2: the fragment GEMV probe at the h200 dense shapes (call 2: its PLANS as committed; call 1 swept W, prefetch, maxnreg and split_k with an earlier PLANS list, see the README).
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
timeout 400 python3 bench/results/2026-12-02_h200_s24/frag_gemv_probe.py $OUT/frag_gemv_probe2.json 40 2>&1 | grep -v Warn | tee $OUT/frag_gemv_probe2.log | tail -90
