#!/usr/bin/env bash
# All GPU checks and benchmarks in one call (run on the lent H200 from the repository root):
#   bash bench/run_gpu.sh [SECTION ...]     sections: tests regional kernels sweep grouped frag prefetch families eager backends toggles ablate dspark tp e2e ctx diag compile attnplan
#                                           tpbench h200 robust llama generic halfchain llamafinal waitcheck prefill mhcfold router window
#                                           collapse inplace qrope scorechain yround prologue
#                                           (default: tests kernels eager backends)
# JSON results land in $OUT (or bench/results/raw) and a short table is printed last.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUTDIR=${OUT:-bench/results/raw}
mkdir -p "$OUTDIR"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation -e .
python3 -c "import torch._dynamo as d; assert 'dsv41' in d.list_backends(), 'dsv41 backend not installed'" || exit 3
sections=${*:-"tests kernels eager backends"}
WARM=${WARM_COMPILE:-1}; warmflag=""; [ "$WARM" = 0 ] && warmflag="--no-warm-compile"
# REGIONAL=1: ctx / toggles / ablate compile region by region (one graph per layer variant, whole-step CUDA graph
# by the wrapper), as the h200 section does. (A whole-model cold `small` compile stalled on torch 2.11 until
# dsv41/compiler/fallback_text.py; it took 180.8 s after, bench/results/2026-11-30_h200_s9/.)
regional=""; [ "${REGIONAL:-0}" = 1 ] && regional="--regional"
# ROW_NEW_TOKENS="inductor=256 inductor-cudagraphs=256" (the backends section only: the names must be rows of the
# run): those rows decode fewer tokens per run (host-bound rows, whose tok/s does not depend on the count; each row
# notes it). Words split on blanks, never glob-expanded.
rowtok=()
read -ra _rnt <<< "${ROW_NEW_TOKENS:-}"
for x in "${_rnt[@]}"; do rowtok+=(--row-new-tokens "$x"); done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUTDIR/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUTDIR/gpu.txt"
# ab_small STEM: `small` regional dsv41 decode (one row, BENCH_OPTIONS) with the tree in .bench_cache/base.tar
# (`git archive` of the commit before, carried) and then with this tree, one after the other on this lease:
# $OUTDIR/STEM_base.json and STEM_new.json.
ab_small() {
  local wargs=(--preset ${AB_PRESET:-small} --regional --backends ${AB_BACKENDS:-dsv41} --prompt-len ${PROMPT_LEN:-128}
               --new-tokens ${NEW_TOKENS:-64} --repeats ${REPEATS:-2} --no-warm-compile)
  # BASE_BENCH_OPTIONS (when set, even empty) replaces BENCH_OPTIONS for the base tree.
  local base_opts=${BASE_BENCH_OPTIONS-${BENCH_OPTIONS:-}}
  if [ -f .bench_cache/base.tar ]; then
    rm -rf /tmp/dsv41_base && mkdir -p /tmp/dsv41_base && tar xf .bench_cache/base.tar -C /tmp/dsv41_base
    local absout; absout=$(cd "$OUTDIR" && pwd)
    if [ "${AB_PARALLEL:-0}" = 1 ]; then
      # Both trees' cold compiles at once (one worker each, CPU-bound), then each timed run served from its cache.
      (cd /tmp/dsv41_base && PYTHONPATH=/tmp/dsv41_base timeout ${AB_TIMEOUT:-240} python3 -m dsv41.bench "${wargs[@]}" \
         $base_opts --precompile 1 --precompile-only --cache-dir /tmp/dsv41_base/.bench_cache >/tmp/ab_base_pre.log 2>&1) &
      timeout ${AB_TIMEOUT:-240} python3 -m dsv41.bench "${wargs[@]}" ${BENCH_OPTIONS:-} --precompile 1 --precompile-only \
        --cache-dir .bench_cache/$1 >/tmp/ab_new_pre.log 2>&1 &
      wait
      tail -3 /tmp/ab_base_pre.log /tmp/ab_new_pre.log
    fi
    (cd /tmp/dsv41_base && PYTHONPATH=/tmp/dsv41_base python3 -c "import dsv41; print('base tree:', dsv41.__file__)"
     PYTHONPATH=/tmp/dsv41_base timeout ${AB_TIMEOUT:-240} python3 -m dsv41.bench "${wargs[@]}" $base_opts \
       --cache-dir /tmp/dsv41_base/.bench_cache --json "$absout/$1_base.json" 2>&1 | tail -14)
  fi
  timeout ${AB_TIMEOUT:-240} python3 -m dsv41.bench "${wargs[@]}" ${BENCH_OPTIONS:-} --cache-dir .bench_cache/$1 \
    --json "$OUTDIR/$1_new.json" 2>&1 | tail -14
}
for s in $sections; do
  case $s in
    tests)
      python3 -m pytest -q tests/test_kernels_gpu.py tests/test_kernels_gpu_families.py tests/test_kernels_gpu_attention.py tests/test_kernels_gpu_fp8_scaled.py tests/test_kernels_gpu_mhc_fold.py ${GPU_TESTS_EXTRA:-} 2>&1 | tail -25 | tee "$OUTDIR/gpu_tests.log" ;;
    robust)
      # Issue [robust]: the GPU tests of the new kernels (mhc_mixes with an RMS weight, the fp32-scaled block-FP8
      # GEMV of real checkpoint layouts) with their outputs poisoned first, the byte-floor probe of that GEMV, and
      # tiny in FP32 end to end (greedy tokens must equal eager's) with the guarded pass manager.
      python3 -m pytest -q tests/test_kernels_gpu_fp8_scaled.py tests/test_kernels_gpu.py -k "scaled or mhc" 2>&1 \
        | tail -8 | tee "$OUTDIR/gpu_tests_robust.log"
      timeout ${PROBE_TIMEOUT:-120} python3 bench/probes/fp8_layouts_probe.py --out "$OUTDIR/fp8_layouts.json" 2>&1 | tail -30
      timeout ${E2E_TINY_TIMEOUT:-200} python3 -m dsv41 run --preset tiny --device cuda --dtype fp32 --prompt-len 40 \
        --new-tokens 16 --json "$OUTDIR/run_tiny_fp32_dsv41.json" 2>&1 | tail -12 ;;
    mhcfold)
      # Issue [decode] #37: mhc_fold (expand + the next site's coefficients in one launch). Its GPU tests, the kernel
      # probe (fused against the two launches, h200 width, CUDA graph + PDL), then `small` regional, three rows in one
      # run: streams on (V4.1's mixes on the side stream, no fold), streams off with the fold, streams off without it
      # (precompiled by 3 workers into .bench_cache/mhcfold).
      python3 -m pytest -q tests/test_kernels_gpu_mhc_fold.py 2>&1 | tail -8 | tee "$OUTDIR/gpu_tests_mhc_fold.log"
      timeout ${PROBE_TIMEOUT:-120} python3 bench/probes/latency_ops_probe.py "$OUTDIR/latency_ops_probe.json" 2>&1 | tail -8
      rows=${FOLD_BACKENDS:-'dsv41,dsv41[streams=false],dsv41[streams=false;disable=["mhc_fold"]]'}
      timeout ${FOLD_TIMEOUT:-400} python3 -m dsv41.bench --preset ${FOLD_PRESET:-small} --regional --backends "$rows" \
        --prompt-len ${PROMPT_LEN:-128} --new-tokens ${NEW_TOKENS:-64} --repeats ${REPEATS:-2} --no-warm-compile \
        --precompile ${PRECOMPILE:-3} --cache-dir .bench_cache/mhcfold \
        ${BENCH_OPTIONS:---option gpu_unvalidated=true} --json "$OUTDIR/mhc_fold_${FOLD_PRESET:-small}${TAG:-}.json" 2>&1 | tail -30 ;;
    window)
      # Issue [decode] #37: sparse_attention reads the window in two parts (no cat launches) and takes the SWA
      # layers' window-only attention. GPU tests, the op probe at h200 shape, then `small` regional dsv41 decode with
      # this tree and, when .bench_cache/base.tar holds `git archive` of the commit before (carried), with that
      # tree, one after the other on this lease.
      python3 -m pytest -q tests/test_kernels_gpu_window.py tests/test_kernels_gpu_attention.py 2>&1 | tail -8 \
        | tee "$OUTDIR/gpu_tests_window.log"
      timeout ${PROBE_TIMEOUT:-120} python3 bench/probes/window_parts_probe.py "$OUTDIR/window_parts_probe.json" 2>&1 \
        | tail -6
      ab_small window
      timeout ${PROBE_TIMEOUT:-120} python3 bench/probes/layer_launches_probe.py "$OUTDIR/layer_launches_tiny.json" \
        tiny cuda 2>&1 | tail -10 ;;
    collapse)
      # Issue [decode] #37: mhc_collapse_rmsnorm reads a bf16 H through its upcast and writes the downcast itself
      # (widened; torch < 2.13 graphs): its GPU tests, then ab_small with the variant let through.
      python3 -m pytest -q tests/test_kernels_gpu_collapse.py tests/test_kernels_gpu.py -k "collapse" 2>&1 | tail -6 \
        | tee "$OUTDIR/gpu_tests_collapse.log"
      BENCH_OPTIONS=${BENCH_OPTIONS:-'--option gpu_unvalidated=true --option disable=["half_gemv","rope_kv","gqa_attention","mhc_fold"]'} \
        ab_small collapse ;;
    inplace)
      # Issue [decode] #37: the window ring written in place (write_order.py: no clone + copy-back per cache
      # write), the queries' RoPE inside the attention op (rope_q) and the widened collapse. Their GPU tests, with
      # LAYER_PROBE=1 the per-layer launch list of tiny, then ab_small: the base tree with its default options
      # against this tree with the gated variants let through.
      python3 -m pytest -q tests/test_kernels_gpu_collapse.py tests/test_kernels_gpu.py -k "collapse" 2>&1 | tail -6 \
        | tee "$OUTDIR/gpu_tests_collapse.log"
      python3 -m pytest -q tests/test_kernels_gpu_window.py 2>&1 | tail -6 | tee "$OUTDIR/gpu_tests_window.log"
      if [ "${LAYER_PROBE:-0}" = 1 ]; then
        timeout ${PROBE_TIMEOUT:-180} python3 bench/probes/layer_launches_probe.py "$OUTDIR/layer_launches_tiny.json" \
          tiny cuda '{"gpu_unvalidated": true, "disable": ["half_gemv", "rope_kv", "gqa_attention", "mhc_fold"]}' \
          2>&1 | tail -10
      fi
      BENCH_OPTIONS=${BENCH_OPTIONS:-'--option gpu_unvalidated=true --option disable=["half_gemv","rope_kv","gqa_attention","mhc_fold"]'} \
        BASE_BENCH_OPTIONS=${BASE_BENCH_OPTIONS:-} ab_small inplace ;;
    attnplan)
      # Issue [decode] #37: sparse attention's 16-row tiles where 32-row tiles give few programs (`attention_plan`):
      # the kernel tests, the plan sweep at the h200 shape (which must keep 32-row tiles), then `small` with the tree
      # before (.bench_cache/base.tar) and this tree, compiled in parallel, timed one after another.
      # ATTN_CHECKS=0 skips the tests and the sweep (a lease with little device time left).
      if [ "${ATTN_CHECKS:-1}" = 1 ]; then
        python3 -m pytest -q tests/test_kernels_gpu_attention.py 2>&1 | tail -3 | tee "$OUTDIR/gpu_tests_attention.log"
        timeout ${PROBE_TIMEOUT:-60} python3 bench/probes/attention_sweep.py --preset h200 --ctx 4096 --splits 0 \
          --block-n 16,32 --copies 64 --reps-ms 40 --json "$OUTDIR/attn_sweep_h200.json" 2>&1 | tail -4
      fi
      AB_PARALLEL=1 ab_small attnplan ;;
    prologue)
      # Issue [decode] #37: the block-FP8 GEMV's RMSNorm prologue (q_norm -> wq_b in one launch) and
      # moe_combine(y_dtype), each gated on CUDA until this runs: their GPU tests, then `small` regional with three
      # rows on this tree, each lifting its gates alone (`gpu_unvalidated` as a list), compiled in parallel by 3
      # workers into .bench_cache/prologue, then timed one after another.
      python3 -m pytest -q tests/test_kernels_gemv_norm_prologue.py tests/test_kernels_gpu_moe_round.py 2>&1 | tail -6 \
        | tee "$OUTDIR/gpu_tests_prologue.log"
      rows=${PROLOGUE_BACKENDS:-'dsv41,dsv41[gpu_unvalidated=["linear_fp8_block(rms_norm)"]],dsv41[gpu_unvalidated=["linear_fp8_block(rms_norm)","moe_combine(y_dtype)"]]'}
      timeout ${PROLOGUE_TIMEOUT:-420} python3 -m dsv41.bench --preset ${PROLOGUE_PRESET:-small} --regional --backends "$rows" \
        --prompt-len ${PROMPT_LEN:-128} --new-tokens ${NEW_TOKENS:-64} --repeats ${REPEATS:-2} --no-warm-compile \
        --precompile ${PRECOMPILE:-3} --cache-dir .bench_cache/prologue \
        --json "$OUTDIR/prologue_${PROLOGUE_PRESET:-small}${TAG:-}.json" 2>&1 | tail -30 ;;
    yround)
      # Issue [decode] #37: moe_combine(y_dtype) (the routed experts' FP32 output rounded by the tail, one Inductor
      # cast launch fewer per MoE layer on torch 2.11) ungated: its GPU test, then `small` with the tree before
      # (.bench_cache/base.tar, the variant gated) and this tree, default options on both.
      python3 -m pytest -q tests/test_kernels_gpu_moe_round.py 2>&1 | tail -4 | tee "$OUTDIR/gpu_tests_moe_round.log"
      BENCH_OPTIONS='--option gpu_unvalidated=false' BASE_BENCH_OPTIONS='--option gpu_unvalidated=false' ab_small yround ;;
    scorechain)
      # Issue [decode] #37: why the indexer's score chain (FP4 keys -> q.k -> ReLU -> head sum) fuses on CPU but not
      # on CUDA, where it leaves one FP32 cuBLAS GEMM per index layer (small: 6 x 53 us per step). The probe records
      # every value check of the chain (deviation over tolerance, TF32 settings) and every region that raises.
      timeout ${PROBE_TIMEOUT:-240} python3 bench/probes/score_chain_probe.py "$OUTDIR/score_chain_${SC_PRESET:-tiny}.json" \
        ${SC_PRESET:-tiny} cuda 2>&1 | tail -30 ;;
    qrope)
      # Issue [decode] #37: the gated variants sparse_fp4_attention(rope_q) and moe_combine(y_dtype), on one tree:
      # their GPU tests, with LAYER_PROBE=1 the per-layer launch list of tiny with them on, the static-input probe
      # (why upcast_linear misses the compressor's FP32 matmuls on CUDA), then `small` regional with the variants
      # gated (default options) and let through (gpu_unvalidated, the unvalidated families disabled).
      python3 -m pytest -q tests/test_kernels_gpu_window.py tests/test_kernels_gpu_moe_round.py 2>&1 | tail -6 \
        | tee "$OUTDIR/gpu_tests_window.log"
      if [ "${LAYER_PROBE:-0}" = 1 ]; then
        timeout ${PROBE_TIMEOUT:-180} python3 bench/probes/layer_launches_probe.py "$OUTDIR/layer_launches_tiny.json" \
          tiny cuda '{"gpu_unvalidated": true, "disable": ["half_gemv", "rope_kv", "gqa_attention", "mhc_fold"]}' \
          2>&1 | tail -10
      fi
      timeout ${PROBE_TIMEOUT:-150} python3 bench/probes/static_inputs_probe.py "$OUTDIR/static_inputs_tiny.json" cuda \
        2>&1 | tail -12
      BENCH_OPTIONS='--option gpu_unvalidated=false' BASE_BENCH_OPTIONS= ab_small qrope_off
      BENCH_OPTIONS='--option gpu_unvalidated=true --option disable=["half_gemv","rope_kv","gqa_attention","mhc_fold"]' \
        ab_small qrope_on ;;
    router)
      # Issue [decode] #37: where the router's time goes at the h200 decode shape (plans, warps, k, a plain GEMV).
      timeout ${PROBE_TIMEOUT:-180} python3 bench/probes/router_sweep_probe.py "$OUTDIR/router_sweep.json" 2>&1 | tail -14 ;;
    regional)
      # The regional wrapper's whole-step CUDA graph (no faulthandler_timeout: its dump segfaulted inside Dynamo here).
      timeout ${REGIONAL_TIMEOUT:-240} python3 -m pytest -q -x -s tests/test_regional_gpu.py \
        2>&1 | tee "$OUTDIR/gpu_regional.log" | tail -${REGIONAL_TAIL:-40} ;;
    kernels)
      python3 bench/kernels.py --json "$OUTDIR/kernels.json" 2>&1 | tail -30 ;;
    sweep)
      python3 bench/kernels.py --pdl --sweep --only ${SWEEP_SHAPES:-grouped_w1w3 grouped_w2 wq_b wo_b wq_a shared_w1 expert_w1 head} \
        --json "$OUTDIR/kernels_sweep_pdl.json" 2>&1 | tail -120 ;;
    grouped)
      # The grouped FP4 expert GEMV: its GPU tests (word-decode CUDA-core default, tile and word-decode tensor-core
      # kernels, h200 shapes, every sweep configuration) and the launch-plan sweep of the kernels at the h200 decode
      # shapes, PDL on (dsv41/kernels/grouped_words.py, grouped_mma.py); then the word-decode probe (act_quant on
      # and off, small preset shapes too).
      python3 -m pytest -q tests/test_kernels_grouped_gemv.py tests/test_kernels_gpu_families.py -k "cuda or grouped" \
        2>&1 | tail -8 | tee "$OUTDIR/gpu_tests_grouped.log"
      python3 bench/grouped_words_probe.py --small --json "$OUTDIR/grouped_words_probe.json" 2>&1 | tail -12
      python3 bench/kernels.py --pdl --sweep --only grouped_w1w3 grouped_w2 \
        --json "$OUTDIR/kernels_grouped_sweep.json" 2>&1 | tail -40 ;;
    frag)
      # The tensor-core fragment kernel of the grouped FP4 expert GEMV (dsv41/kernels/grouped_frag.py): its GPU
      # tests, then the probe against the tile and word-decode kernels with its plan sweep (h200 and small shapes).
      python3 -m pytest -q tests/test_kernels_grouped_frag.py ${FRAG_TESTS_EXTRA:-} 2>&1 | tail -8 | tee "$OUTDIR/gpu_tests_frag.log"
      python3 bench/grouped_words_probe.py --frag --small --json "$OUTDIR/grouped_frag_probe.json" 2>&1 | grep -E "SUMMARY|Error|error|copy" | tail -40 ;;
    prefetch)
      # PDL prologue of the block-FP8 GEMVs: L2 prefetch of the weights before the wait and the early launch of the
      # next kernel (dsv41/kernels/gemv_tma.py, quant_gemv.py), their GPU tests first.
      python3 -m pytest -q tests/test_kernels_gpu.py -k "pdl or tma or fp8" 2>&1 | tail -6 | tee "$OUTDIR/gpu_tests_prefetch.log"
      python3 bench/pdl_prefetch_probe.py --json "$OUTDIR/pdl_prefetch_probe.json" 2>&1 | tail -80 ;;
    families)
      python3 bench/kernels.py --families --pdl --json "$OUTDIR/kernels_families.json" 2>&1 | tail -40 ;;
    eager)
      for wm in bf16 checkpoint; do
        python3 -m dsv41 run --preset small --weight-mode $wm --backend eager --device cuda \
          --prompt-len 4096 --new-tokens 64 --json "$OUTDIR/eager_small_$wm.json" 2>&1 | tail -8
      done
      python3 -m dsv41 run --preset h200 --weight-mode checkpoint --backend eager --device cuda \
        --prompt-len 128 --new-tokens 8 --json "$OUTDIR/eager_h200_checkpoint.json" 2>&1 | tail -8 ;;
    e2e)
      # The compiled model end to end: tiny in FP32 (greedy tokens must equal eager's), then small in bf16 with
      # kernels per step counted by the profiler (count_kernels) and the per-role static counts in the report.
      timeout ${E2E_TINY_TIMEOUT:-150} python3 -m dsv41 run --preset tiny --device cuda --dtype fp32 --prompt-len 40 \
        --new-tokens 16 ${E2E_OPTIONS:---option gpu_unvalidated=true} --json "$OUTDIR/run_tiny_fp32_dsv41.json" 2>&1 | tail -12
      timeout ${E2E_SMALL_TIMEOUT:-330} python3 -m dsv41 run --preset small --device cuda --prompt-len ${PROMPT_LEN:-1024} \
        --new-tokens ${NEW_TOKENS:-32} --option count_kernels=true ${E2E_OPTIONS:---option gpu_unvalidated=true} \
        --json "$OUTDIR/run_small_dsv41.json" 2>&1 | tail -30 ;;
    tp)
      # h200 under tensor parallelism on all local GPUs (an nvidia-h200-x2 / -x4 machine): MoE TP without padding
      # (pad to 32), TP padded to 256 columns, and EP; eager (a dsv41 compile of h200 per layout does not fit a call).
      for cfg in "tp 32" "tp 256" "ep 32"; do
        read -r moe pad <<< "$cfg"
        timeout ${TP_TIMEOUT:-240} python3 -m dsv41 run --tp ${TP:-2} --tp-moe $moe --tp-pad-to $pad \
          --preset ${TP_PRESET:-h200} --weight-mode checkpoint --backend ${TP_BACKEND:-eager} --device cuda \
          --prompt-len ${TP_PROMPT_LEN:-64} --new-tokens ${TP_NEW_TOKENS:-8} \
          --json "$OUTDIR/tp${TP:-2}_${moe}_pad${pad}.json" 2>&1 | tail -12
      done ;;
    compile)
      # Where a cold `small` compile goes. bench/compile_watch.py samples the main thread and names who asked for
      # any text it formats (2026-11-30: Inductor's implicit-fallback log line, fixed by fallback_text.py). The
      # default options and WATCH_OPTIONS (default: CUDA graphs off) run side by side (two 330 s runs one after
      # the other do not fit a call), each with its own empty Inductor and Triton caches; they share the CPUs and
      # the GPU, so their times are not solo compile times.
      wopts=${WATCH_OPTIONS:---option cuda_graphs=false}
      pids=""
      for v in default alt; do
        [ $v = default ] && o="" || o="$wopts"
        d=$(mktemp -d)
        TORCHINDUCTOR_CACHE_DIR=$d TRITON_CACHE_DIR=$d/triton timeout -k 30 -s TERM ${COMPILE_TIMEOUT:-330} \
          python3 bench/compile_watch.py --report 60 run --preset ${PRESET:-small} --device cuda --prompt-len 16 \
          --new-tokens 4 $o --json "$OUTDIR/compile_${PRESET:-small}_$v.json" > "$OUTDIR/compile_watch_$v.log" 2>&1 &
        pids="$pids $!:$v:$d"
      done
      for p in $pids; do
        IFS=: read -r pid v d <<< "$p"; wait "$pid"; echo "== $v (rc $?)"; rm -rf "$d"
        grep -v "UserWarning\|warnings.warn(" "$OUTDIR/compile_watch_$v.log" | tail -${WATCH_TAIL:-90}
      done ;;
    ctx)
      # Decode tok/s vs context (synthetic caches), plus the attention / indexer kernels at h200 shapes at the same
      # contexts against their byte floors. Three cold `small` compiles do not fit a call (2026-11-30: inductor
      # 205 s, dsv41 181 s, plus the runs), so the default is eager and dsv41; BACKENDS=eager,inductor for the other.
      timeout ${CTX_TIMEOUT:-560} python3 -m dsv41.bench --preset ${PRESET:-small} --backends ${BACKENDS:-eager,dsv41} $regional \
        --prompt-len 128 --new-tokens 16 --repeats 2 --no-warm-compile ${BENCH_OPTIONS:---option gpu_unvalidated=true} \
        --contexts ${CONTEXTS:-4096,32768,131072} --context-tokens 16 --json "$OUTDIR/ctx_${PRESET:-small}.json" 2>&1 | tail -40
      python3 bench/kernels.py --families --pdl --only sparse_fp4_attention indexer_scores indexer_topk indexer_candidates \
        --json "$OUTDIR/kernels_attention.json" 2>&1 | tail -30 ;;
    diag)
      # The post-grad graphs before / after the passes on CUDA (debug report), for families that fuse on CPU but not
      # on the GPU: tiny in FP32, greedy tokens checked against eager.
      timeout ${DIAG_TIMEOUT:-200} python3 -m dsv41 run --preset tiny --device cuda --dtype fp32 --prompt-len 40 --new-tokens 16 \
        --option debug=true --option gpu_unvalidated=true ${DIAG_OPTIONS:-} --json "$OUTDIR/diag_tiny_fp32.json" 2>&1 | tail -12 ;;
    tpbench)
      # The benchmark protocol under tensor parallelism (a -x2 / -x4 machine), eager and dsv41 side by side.
      timeout ${TP_TIMEOUT:-540} python3 -m dsv41.bench --tp ${TP:-2} --tp-moe ${TP_MOE:-tp} --preset ${TP_PRESET:-h200} \
        --backends ${TP_BACKENDS:-eager,dsv41} --prompt-len ${TP_PROMPT_LEN:-64} --new-tokens ${TP_NEW_TOKENS:-8} \
        --repeats 1 --no-warm-compile --json "$OUTDIR/bench_tp${TP:-2}.json" 2>&1 | tail -20 ;;
    h200)
      # The h200 preset side by side, compiled region by region (one graph per layer variant, whole-step CUDA graph
      # captured by the wrapper): a whole-model h200 compile does not fit a 10-minute call. Issue [first-contact]'s
      # served compile: BENCH_FLAGS="--cache-dir .bench_cache/h200" in two calls on one warm machine, the second
      # (TAG=_served) compiles from the caches the first filled (compile_cache_hits / misses in its row).
      timeout ${H200_TIMEOUT:-580} python3 -m dsv41.bench --preset h200 --regional --backends ${H200_BACKENDS:-eager,dsv41} \
        --prompt-len ${H200_PROMPT_LEN:-4096} --new-tokens ${H200_NEW_TOKENS:-64} --repeats ${H200_REPEATS:-1} --no-warm-compile \
        ${EAGER_NEW_TOKENS:+--eager-new-tokens $EAGER_NEW_TOKENS} ${BENCH_FLAGS:-} \
        ${BENCH_OPTIONS:---option gpu_unvalidated=true} --json "$OUTDIR/backends_h200_regional${TAG:-}.json" --png 2>&1 | tail -30 ;;
    toggles|ablate|dspark)
      # Issue 6 (toggles: CUDA graphs, PDL, side streams each flipped alone, and inductor reduce-overhead) and issue 4
      # (ablate: dsv41 with each family off in turn). A cold `small` compile is ~180 s of one Python thread, so rows
      # compiled one after another do not fit a call: PRECOMPILE workers (default 6) compile the rows in parallel
      # into .bench_cache/ (kept between calls while the machine is warm), and the bench compiles each row from
      # there, then times them one after another. PRECOMPILE_ONLY=1 stops after the workers (call 1); the same
      # command with PRECOMPILE=0 instead (call 2) is then served from the cache. h200 (REGIONAL=1 PRESET=h200): the
      # benchmark process builds no model in call 1 and the workers share one tensor per weight name and shape
      # across layers (8.2 GB each, dsv41/precompile.py); 2026-11-30: 5 rows precompiled in 335-387 s, and each row
      # of call 2 compiled from its cache in 13-28 s (11 FX-graph hits, 0 misses); the whole h200 toggles call 2
      # took 439 s at NEW_TOKENS=64 REPEATS=2 (bench/results/2026-11-30_h200_s13), before the byte-table prefill.
      # dspark (issue 8): DSpark off and on (simulated acceptance 5.5) for eager, inductor and dsv41 in one run.
      # h200, 2026-12-01: BENCH_FLAGS=--shared-cache (a +dspark worker then finds the M = 1 graphs its plain twin
      # compiles) PRECOMPILE=4 PRECOMPILE_ONLY=1 took 364 s, then PRECOMPILE=0 REPEATS=2 286 s
      # (bench/results/2026-12-01_h200_s15). small toggles at NEW_TOKENS=64 REGIONAL=1: 214 s, then 153 s.
      case $s in
        toggles) rows=${TOGGLE_BACKENDS:-dsv41,toggles,inductor-cudagraphs} ;;
        ablate) rows=${ABL_BACKENDS:-dsv41,ablations} ;;
        dspark) rows=${DSPARK_BACKENDS:-eager,eager+dspark,inductor,inductor+dspark,dsv41,dsv41+dspark} ;;
      esac
      only=""; [ "${PRECOMPILE_ONLY:-0}" = 1 ] && only="--precompile-only"
      timeout ${BENCH_TIMEOUT:-580} python3 -m dsv41.bench --preset ${PRESET:-small} $regional --backends "$rows" \
        --prompt-len ${PROMPT_LEN:-128} --new-tokens ${NEW_TOKENS:-32} --repeats ${REPEATS:-2} --no-warm-compile \
        --precompile ${PRECOMPILE:-6} --cache-dir .bench_cache/$s $only ${BENCH_FLAGS:-} \
        ${EAGER_NEW_TOKENS:+--eager-new-tokens $EAGER_NEW_TOKENS} \
        ${BENCH_OPTIONS:---option gpu_unvalidated=true} --json "$OUTDIR/${s}_${PRESET:-small}${TAG:-}.json" 2>&1 | tail -40 ;;
    backends)
      # PRECOMPILE=N (N workers, .bench_cache/backends; PRECOMPILE_ONLY=1 for a first call, PRECOMPILE=0 for the
      # timed call served from it), REGIONAL=1 and EAGER_NEW_TOKENS as in the sections above (issue 7: h200 at
      # 4,096 / 1,024 with eager stopped early).
      pre=""; [ -n "${PRECOMPILE:-}" ] && pre="--precompile $PRECOMPILE --cache-dir .bench_cache/backends"
      [ "${PRECOMPILE_ONLY:-0}" = 1 ] && pre="$pre --precompile-only"
      timeout ${BENCH_TIMEOUT:-3600} python3 -m dsv41.bench --preset ${PRESET:-small} --prompt-len ${PROMPT_LEN:-4096} --new-tokens ${NEW_TOKENS:-1024} \
        --repeats ${REPEATS:-5} --backends ${BACKENDS:-eager,inductor,inductor-cudagraphs,dsv41,torch_tensorrt} $warmflag \
        ${EAGER_NEW_TOKENS:+--eager-new-tokens $EAGER_NEW_TOKENS} "${rowtok[@]}" $regional $pre \
        ${BENCH_OPTIONS:-} --json "$OUTDIR/backends_${PRESET:-small}${TAG:-}.json" --png 2>&1 | tail -40 ;;
    llama)
      # A third party's model (tests/zoo/llama_gptfast.py, gpt-fast style): eager, inductor, inductor-cudagraphs and
      # dsv41 rows of Llama-3.2-1B and Llama-3.1-8B shapes, random bf16 weights (BENCHMARK.md "Llama rows"). Each
      # run prints its table last; 8B decodes fewer tokens (its eager row is the slow one).
      timeout ${LLAMA_TIMEOUT:-540} python3 -m dsv41.bench --model llama-1b --prompt-len 512 --new-tokens 256 --repeats 3 \
        $warmflag ${BENCH_OPTIONS:-} --json "$OUTDIR/llama_1b.json" 2>&1 | tail -${LLAMA_TAIL:-20}
      timeout ${LLAMA_TIMEOUT:-540} python3 -m dsv41.bench --model llama-8b --prompt-len 512 --new-tokens ${LLAMA_8B_NEW_TOKENS:-128} \
        --repeats 3 $warmflag ${BENCH_OPTIONS:-} --json "$OUTDIR/llama_8b.json" 2>&1 | tail -${LLAMA_TAIL:-20} ;;
    generic)
      # Issue [generic]: the GPU tests of the gated Llama families' kernels (half_gemv, rope_kv, gqa_attention, and
      # the GEMV kernels sharing gemv_tiles), then Llama-1B with the families gated (default) and on, one lease.
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q tests/test_kernels_gpu_rope_kv.py tests/test_kernels_gpu_half.py \
        tests/test_kernels_gpu_gqa.py tests/test_kernels_gemv_multi.py tests/test_kernels_gemv_frag.py 2>&1 | tail -6 \
        | tee "$OUTDIR/generic_tests.log"
      for fam in gated on; do
        if [ $fam = on ]; then rows=dsv41; opt="--option gpu_unvalidated=true"; else rows=${GENERIC_BASE:-inductor-cudagraphs,dsv41}; opt=""; fi
        timeout ${LLAMA_TIMEOUT:-170} python3 -m dsv41.bench --model ${GENERIC_MODEL:-llama-1b} --prompt-len 512 \
          --new-tokens ${GENERIC_NEW_TOKENS:-128} --repeats 2 --no-warm-compile --backends $rows $opt \
          --json "$OUTDIR/generic_${fam}.json" 2>&1 | grep -v Warning | tail -7 | cut -c1-200
      done ;;
    halfchain)
      # Issue [generic], session 36: the half GEMV's GPU tests (each PDL prologue in a graph chain), then the Llama
      # step's GEMV chain swept (bench/probes/half_chain_probe.py) and, with HALF_E2E=1, the model end to end with the
      # tree's defaults and with the sweep's winners, one lease.
      timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q tests/test_kernels_gpu_half.py ${HALF_TESTS_K:+-k "$HALF_TESTS_K"} 2>&1 | tail -4 \
        | tee "$OUTDIR/half_tests.log"
      e2e=""; [ "${HALF_E2E:-1}" = 1 ] && e2e="--e2e"
      timeout ${CHAIN_TIMEOUT:-420} python3 bench/probes/half_chain_probe.py --model ${GENERIC_MODEL:-llama-1b} $e2e \
        ${CHAIN_FLAGS:-} --json "$OUTDIR/half_chain_${GENERIC_MODEL:-llama-1b}.json" 2>&1 | grep -v Warning | cut -c1-200 ;;
    llamafinal)
      # Issue [generic], sessions 36-37: the half GEMV's and the attention's GPU tests, then Llama-1B (the step's
      # GEMV chain with the defaults, the attention plans swept, end to end as the tree has it, with the best
      # attention plan, and with the gated rope_gqa family on) and Llama-8B (chain and end to end), one lease.
      # LLAMA_FLAGS (e.g. --skip-chain) and LLAMA8_ROWS (the 8B first e2e run's rows) trim a short lease.
      timeout ${TESTS_TIMEOUT:-60} python3 -m pytest -q ${LLAMA_TEST_FILES:-tests/test_kernels_gpu_half.py tests/test_kernels_gpu_gqa.py tests/test_kernels_gpu_row_argmax.py tests/test_kernels_gpu_rope_kv.py} \
        ${HALF_TESTS_K:+-k "$HALF_TESTS_K"} 2>&1 | tail -3 | tee "$OUTDIR/llama_tests.log"
      timeout ${LLAMA1_TIMEOUT:-170} python3 bench/probes/half_chain_probe.py --model llama-1b --no-sweep --gqa --e2e \
        --ungate rope_gqa --ungate rope_gqa,row_argmax ${LLAMA_FLAGS:-} --json "$OUTDIR/final_llama_1b.json" 2>&1 | grep -v Warning | cut -c1-180
      timeout ${LLAMA8_TIMEOUT:-220} python3 bench/probes/half_chain_probe.py --model llama-8b --no-sweep ${LLAMA8_GQA---gqa} --e2e \
        --ungate rope_gqa,row_argmax ${LLAMA_FLAGS:-} --tree-rows ${LLAMA8_ROWS:-inductor-cudagraphs,dsv41} \
        --json "$OUTDIR/final_llama_8b.json" 2>&1 | grep -v Warning | cut -c1-180 ;;
    prefill)
      # Issue [prefill]: rows prefilling through their compiled model in fixed chunks (--compiled-prefill) against
      # the eager prefill, one lease: ttft_s / prefill_tok_s per row and the FLOP floor at the top level.
      timeout ${PREFILL_TIMEOUT:-420} python3 -m dsv41.bench --preset ${PREFILL_PRESET:-small} --backends ${PREFILL_ROWS:-eager,dsv41} \
        --prompt-len ${PREFILL_PROMPT_LEN:-1024} --new-tokens 8 --repeats ${PREFILL_REPEATS:-2} --no-warm-compile \
        ${PREFILL_FLAGS:---regional} --compiled-prefill --json "$OUTDIR/prefill_${PREFILL_PRESET:-small}.json" 2>&1 \
        | grep -v Warning | tail -12 | cut -c1-200 ;;
    waitcheck)
      # Session 30: the loads Triton 3.6 puts before griddepcontrol.wait in the fragment GEMV built without weight
      # prefetch (the assertion lists them), and rope_kv_store against Inductor's unfused chain.
      timeout ${TESTS_TIMEOUT:-120} python3 -m pytest -q -x tests/test_kernels_gemv_frag.py \
        -k "sm90_build_reads_only and 2-False" 2>&1 | grep -E "^E |passed|failed" | cut -c1-400 | head -30 \
        | tee "$OUTDIR/gemv_frag_wait.log"
      timeout ${PROBE_TIMEOUT:-150} python3 bench/probes/rope_kv_probe.py "$OUTDIR/rope_kv_probe.json" 2>&1 | tail -8 ;;
  esac
done
python3 bench/summarize.py "$OUTDIR"
