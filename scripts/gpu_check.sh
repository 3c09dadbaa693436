#!/usr/bin/env bash
# On the lent GPU machine, after `bash .device/p4/install.sh && source /tmp/site/env.sh`: the steps
# of a kernel session in one call, each logged to $OUT/<step>.log (or ./gpu_logs without $OUT).
#
#   bash scripts/gpu_check.sh build tests attn       # build, `pytest -m gpu`, attention benchmark
#   bash scripts/gpu_check.sh ncu-bwd256             # Nsight Compute sections of the d256 backward
#
# Steps: build (all kernels, HSTU_CUDA_ARCH_LIST default "8.0;9.0"), tests (pytest -m gpu),
# attn (scripts/bench_attention.py --graph, JSON lines), attn-ab (no reference; dispatch order A/B), attn-fwd256 (d256 forward tiles A/B), layer (scripts/bench_layer.py),
# e2e (scripts/bench_e2e.py, 1 GPU, the docs/benchmarks.md command), ncu-bwd256 / ncu-fwd256
# (one launch of the long_d256 kernel under ncu), ncu-bwd128 (long_d128), dq-convert-ab. Every step runs even if an earlier one failed;
# the exit code is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HSTU_ALLOW_NON_A100=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
failed=0

ncu_kernel() {  # $1: kernel name regex, $2: launches to skip, $3: shape
  ncu --kernel-name "regex:$1" --launch-skip "$2" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats \
    --section Occupancy --section SourceCounters \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 scripts/bench_attention.py --shapes "$3" --iters 2 --no-ref
}

step() {
  local name=$1
  local t0=$SECONDS
  case "$name" in
    build)
      HSTU_CUDA_ARCH_LIST=${HSTU_CUDA_ARCH_LIST:-"8.0;9.0"} MAX_JOBS=${MAX_JOBS:-16} \
        python3 setup.py build_ext --inplace ;;
    tests) python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests ;;
    attn) python3 scripts/bench_attention.py --graph --iters 20 --ref-iters 3 --out "$out/attn.jsonl" ;;
    attn-ab)  # dispatch order: one group over the whole batch (before), L2-sized groups with a
      # last group of one size (1), the default (last group sized for the tail)
      for g in 1000000,1000000 default,1 default,default; do
        unset HSTU_ATTN_PAIR_GROUP HSTU_ATTN_LAST_GROUP
        [ "${g%,*}" = default ] || export HSTU_ATTN_PAIR_GROUP=${g%,*}
        [ "${g#*,}" = default ] || export HSTU_ATTN_LAST_GROUP=${g#*,}
        python3 scripts/bench_attention.py --graph --iters 20 --no-ref --out "$out/attn_ab.jsonl"
      done
      unset HSTU_ATTN_PAIR_GROUP HSTU_ATTN_LAST_GROUP ;;
    attn-fwd256)  # d256 forward: 16-row warps (HSTU_ATTN_MAX_SMEM=200000) vs the 2 x 2 warp grid
      for m in 200000 default; do
        if [ "$m" = default ]; then unset HSTU_ATTN_MAX_SMEM; else export HSTU_ATTN_MAX_SMEM=$m; fi
        python3 scripts/bench_attention.py --graph --iters 30 --no-ref --shapes long_d256 \
          --out "$out/attn_fwd256.jsonl"
      done
      unset HSTU_ATTN_MAX_SMEM ;;
    layer) python3 scripts/bench_layer.py ;;
    e2e)
      python3 scripts/bench_e2e.py --config configs/synthetic_benchmark_ranking.gin --steps 30 \
        --paths compiled --bindings "EmbeddingArgs.item_capacity=2000000" \
        "EmbeddingArgs.user_capacity=1000000" "TrainerArgs.peak_tflops=989" ;;
    ncu-bwd256) ncu_kernel hstu_bwd_kernel 2 long_d256 ;;
    ncu-fwd256) ncu_kernel hstu_fwd_kernel 2 long_d256 ;;
    ncu-bwd128) ncu_kernel hstu_bwd_kernel 2 long_d128 ;;
    dq-convert-ab)  # dQ converted by the separate kernel (default) vs inside the backward
      for c in kernel bwd; do
        HSTU_ATTN_DQ_CONVERT=$c python3 scripts/bench_attention.py --graph --iters 20 --no-ref \
          --shapes long_d128,long_d256 --out "$out/dq_convert_ab.jsonl"
      done ;;
    *) echo "unknown step $name" >&2; return 2 ;;
  esac > >(tee "$out/$name.log") 2>&1
  local rc=$?
  echo "[gpu_check] $name rc=$rc $((SECONDS - t0))s" | tee -a "$out/summary.log"
  return $rc
}

for s in "$@"; do
  step "$s" || failed=$((failed + 1))
done
exit $failed
