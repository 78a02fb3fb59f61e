#!/usr/bin/env bash
# Session 22, device call 2: GPU tests of the fragment kernel, the maxnreg / warps probe.
cd "$(dirname "$0")/../../.."
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
timeout 200 python3 -m pytest -q -x tests/test_kernels_grouped_frag.py tests/test_pass_dispatch_widened.py > $OUT/gpu_tests_frag.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/gpu_tests_frag.log
timeout 300 python3 bench/results/2026-12-02_h200_s22/frag_maxnreg_probe.py $OUT/frag_maxnreg_probe.json > $OUT/frag_maxnreg_probe.log 2>&1; echo "probe rc=$?"
grep -E "BEST|copy|Error" $OUT/frag_maxnreg_probe.log; grep -E "cap=None" $OUT/frag_maxnreg_probe.log
