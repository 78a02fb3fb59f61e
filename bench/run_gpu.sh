#!/usr/bin/env bash
# All GPU checks and benchmarks in one call (run on the lent H200 from the repository root):
#   bash bench/run_gpu.sh [SECTION ...]     sections: tests kernels sweep eager backends  (default: all but sweep)
# JSON results land in $OUT (or bench/results/raw) and a short table is printed last.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUTDIR=${OUT:-bench/results/raw}
mkdir -p "$OUTDIR"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation -e .
sections=${*:-"tests kernels eager backends"}
WARM=${WARM_COMPILE:-1}; warmflag=""; [ "$WARM" = 0 ] && warmflag="--no-warm-compile"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUTDIR/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUTDIR/gpu.txt"
for s in $sections; do
  case $s in
    tests)
      python3 -m pytest -q tests/test_kernels_gpu.py 2>&1 | tail -25 | tee "$OUTDIR/gpu_tests.log" ;;
    kernels)
      python3 bench/kernels.py --json "$OUTDIR/kernels.json" 2>&1 | tail -30 ;;
    sweep)
      python3 bench/kernels.py --pdl --sweep --only ${SWEEP_SHAPES:-wq_b wo_b wq_a shared_w1 expert_w1 head} \
        --json "$OUTDIR/kernels_sweep_pdl.json" 2>&1 | tail -120 ;;
    eager)
      for wm in bf16 checkpoint; do
        python3 -m dsv41 run --preset small --weight-mode $wm --backend eager --device cuda \
          --prompt-len 4096 --new-tokens 64 --json "$OUTDIR/eager_small_$wm.json" 2>&1 | tail -8
      done
      python3 -m dsv41 run --preset h200 --weight-mode checkpoint --backend eager --device cuda \
        --prompt-len 128 --new-tokens 8 --json "$OUTDIR/eager_h200_checkpoint.json" 2>&1 | tail -8 ;;
    backends)
      python3 -m dsv41.bench --preset ${PRESET:-small} --prompt-len ${PROMPT_LEN:-4096} --new-tokens ${NEW_TOKENS:-1024} \
        --repeats ${REPEATS:-5} --backends ${BACKENDS:-eager,inductor,inductor-cudagraphs,dsv41} $warmflag \
        --json "$OUTDIR/backends_${PRESET:-small}${TAG:-}.json" --png 2>&1 | tail -40 ;;
  esac
done
python3 bench/summarize.py "$OUTDIR"
