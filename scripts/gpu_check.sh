#!/usr/bin/env bash
# On a GPU machine with the project installed: the build, test and benchmark steps in one call,
# each logged to $OUT/<step>.log (or ./gpu_logs without $OUT).
#
#   bash scripts/gpu_check.sh build tests attn       # build, `pytest -m gpu`, attention benchmark
#   bash scripts/gpu_check.sh ncu-bwd256             # Nsight Compute sections of the d256 backward
#
# Steps: build (all kernels, HSTU_CUDA_ARCH_LIST default "8.0;9.0a"), tests (pytest -m gpu),
# attn (scripts/bench_attention.py --graph, JSON lines), layer (scripts/bench_layer.py), e2e
# (scripts/bench_e2e.py, 1 GPU, the docs/benchmarks.md command), data (prepare ML-1M, Amazon
# Beauty, ML-100K from data/raw), inference (scripts/bench_inference.py), small
# (scripts/bench_small.py, eager vs CUDA graphs), small-profile (the same with a profile),
# small-shared (8 Amazon Beauty runs at once: PyTorch's CPU threads, then TrainerArgs.cpu_threads=1),
# multi-gpu-graphs (2 GPUs: graphed vs eager losses, the 1 vs 2 GPU loss-curve check graphed;
# Amazon Beauty (plain and dynamic item table) and the e2e model on 1 and 2 GPUs, graphed and
# eager),
# hybrid-e2e (the e2e model with a 20M-row hybrid item table against 2M rows in HBM), e2e-graphs
# (the e2e step eager and with CUDA graphs of the encoder), e2e-graph-sizes (eager against graphs
# of 16 and 32 pad sizes, profiled), e2e-ab (the e2e step against another
# tree's, E2E_BASE=<dir>), attn-bias (the relative bias's cost), hybrid
# (scripts/bench_embedding.py --hybrid); A/B runs of one build (no
# reference): attn-ab (dispatch order), attn-fwd256 (d256 forward tiles), dq-convert-ab (where dQ
# is converted), attn-sm90 / e2e-sm90 (the backward's SM80 kernel against the wgmma one),
# e2e-residual-gemm (NetworkArgs.fused_residual_gemm on / off); ncu-bwd256 / ncu-fwd256 / ncu-bwd128 (one kernel launch under Nsight Compute);
# ncu-bias (the d128 forward and backward with the position + time bias, then without);
# ncu-bias-src (their warp-stall samples per SASS instruction, CSV); red-throughput (fp32
# reduction throughput by access pattern, kernels/hstu_attention/tools/red_throughput.cu).
# Every step runs even if an earlier one failed (a step named twice runs twice, its log appended);
# the exit code is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_logs}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: some steps run from another directory
export PYTHONUNBUFFERED=1 HSTU_ALLOW_NON_A100=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
failed=0

ncu_kernel() {  # $1: kernel name regex, $2: launches to skip, $3: shape, then bench args
  local kernel=$1 skip=$2 shape=$3
  shift 3
  ncu --kernel-name "regex:$kernel" --launch-skip "$skip" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats \
    --section Occupancy --section SourceCounters \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 scripts/bench_attention.py --shapes "$shape" --iters 2 --no-ref "$@"
}

# bench_ab NAME ARGS...: the attention benchmark without the reference, appended to
# $out/NAME.jsonl; `VAR=value bench_ab ...` sets a kernel-selection variable for that run alone
# (the rows record it, so the runs of one file can be told apart).
bench_ab() {
  local name=$1
  shift
  python3 scripts/bench_attention.py --graph --no-ref --out "$out/$name.jsonl" "$@"
}

# e2e_bench BINDINGS... [--out FILE]: the docs' e2e command (docs/benchmarks.md, 1 GPU) with
# more gin bindings; the item table's capacity is one of them ($E2E_ITEMS: 2M rows fit one GPU)
E2E_ITEMS="EmbeddingArgs.item_capacity=2000000"
e2e_bench() {
  python3 scripts/bench_e2e.py --config configs/synthetic_benchmark_ranking.gin --steps 30 \
    --paths compiled --bindings "EmbeddingArgs.user_capacity=1000000" \
    "TrainerArgs.peak_tflops=989" "$@"
}

step() {
  local name=$1
  local t0=$SECONDS
  case "$name" in
    build)
      HSTU_CUDA_ARCH_LIST=${HSTU_CUDA_ARCH_LIST:-"8.0;9.0a"} MAX_JOBS=${MAX_JOBS:-16} \
        python3 setup.py build_ext --inplace ;;
    tests) python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests ;;
    attn)
      python3 scripts/bench_attention.py --graph --iters 20 --ref-iters 3 --out "$out/attn.jsonl" ;;
    attn-ab)  # one group over the whole batch (the old order), L2-sized groups with a last
      # group of the remainder only, the default (last group sized for the tail)
      HSTU_ATTN_PAIR_GROUP=1000000 HSTU_ATTN_LAST_GROUP=1000000 bench_ab attn_ab --iters 20
      HSTU_ATTN_LAST_GROUP=1 bench_ab attn_ab --iters 20
      bench_ab attn_ab --iters 20 ;;
    attn-fwd256)  # d256 forward: 16-row warps (a 195 KB budget) vs the 2 x 2 warp grid
      HSTU_ATTN_MAX_SMEM=200000 bench_ab attn_fwd256 --iters 30 --shapes long_d256
      bench_ab attn_fwd256 --iters 30 --shapes long_d256 ;;
    layer) python3 scripts/bench_layer.py ;;
    e2e) e2e_bench "$E2E_ITEMS" ;;
    e2e-graphs)  # the same, eager and with the encoder from CUDA graphs
      for g in False True; do e2e_bench "$E2E_ITEMS" "NetworkArgs.cuda_graphs=$g"; done ;;
    e2e-graph-sizes)  # eager, then graphs padding to 16 and to 32 token counts per power of two
      # (32: eager's own padding), each with a profile of 10 steps (its steady_* figures)
      e2e_bench "$E2E_ITEMS" "NetworkArgs.cuda_graphs=False" --profile "$out/prof_eager" \
        --profile-steps 10 --out "$out/e2e_graph_sizes.jsonl"
      for n in 16 32; do
        e2e_bench "$E2E_ITEMS" "NetworkArgs.cuda_graphs=True" "NetworkArgs.cuda_graph_pad_sizes=$n" \
          --profile "$out/prof_graphs$n" --profile-steps 10 --out "$out/e2e_graph_sizes.jsonl"
      done ;;
    data)  # the public datasets, from copies in data/raw (ml-1m.txt.gz, Beauty.txt, ml-100k/u.data)
      python3 -m hstu.data.prepare --dataset sequences --source data/raw/ml-1m.txt.gz --output data/ml-1m
      python3 -m hstu.data.prepare --dataset amazon-beauty --source data/raw/Beauty.txt --output data/amazon-beauty
      python3 -m hstu.data.prepare --dataset ml-100k --source data/raw/ml-100k --output data/ml-100k ;;
    inference)  # ranking from a KV cache (batches of 1 and 64), retrieval users/s on ML-1M
      python3 scripts/bench_inference.py ranking --batches 1,64 --profile --out "$out/inference.jsonl"
      # the cached attention without key splits, and with 16
      for s in 1 16; do
        python3 scripts/bench_inference.py ranking --batches 1 --num-splits $s --out "$out/inference.jsonl"
      done
      python3 scripts/bench_inference.py retrieval --config configs/ml_1m_retrieval.gin \
        --profile --out "$out/inference.jsonl" ;;
    small)  # the small configs, eager vs CUDA graphs of the encoder, 2000 steps each
      for g in False True; do
        python3 scripts/bench_small.py --config configs/ml_1m_retrieval.gin --steps 2000 \
          --evals 1 --bindings "NetworkArgs.cuda_graphs=$g" --out "$out/small.jsonl"
        python3 scripts/bench_small.py --config configs/amazon_beauty_retrieval.gin --steps 2000 \
          --evals 1 --bindings "NetworkArgs.cuda_graphs=$g" --out "$out/small.jsonl"
      done ;;
    multi-gpu-graphs)  # 2 GPUs: the graphed/eager loss test, then 1 vs 2 GPUs graphed and eager
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_multi_gpu_graphs.py
      # the launcher's 1 vs 2 GPU loss curves, graphed: the whole step (plain tables; the
      # default torchrec tables), then the encoder's graphs under DDP
      python3 scripts/check_multi_gpu.py --nproc 2 --precision bf16 --allow-non-a100 \
        --bindings NetworkArgs.cuda_graphs=True "EmbeddingArgs.embedding_backend='dense'" \
        NetworkArgs.use_contextual_features=False --json "$out/multi_gpu_graphs_check.jsonl"
      python3 scripts/check_multi_gpu.py --nproc 2 --precision bf16 --allow-non-a100 \
        --bindings NetworkArgs.cuda_graphs=True --json "$out/multi_gpu_graphs_check.jsonl"
      python3 scripts/check_multi_gpu.py --nproc 2 --precision bf16 --allow-non-a100 \
        --bindings NetworkArgs.cuda_graphs=True "NetworkArgs.cuda_graph_scope='encoder'" \
        --json "$out/multi_gpu_graphs_check.jsonl"
      # Amazon Beauty with its dynamic item table (sharded over the ranks): the whole step
      # against the encoder's graphs under DDP
      for scope in step encoder; do
        python3 scripts/bench_e2e.py --task retrieval --config configs/amazon_beauty_retrieval.gin \
          --nproc 1,2 --paths compiled --steps 500 --graph-warmup 300 \
          --bindings NetworkArgs.cuda_graphs=True "NetworkArgs.cuda_graph_scope='$scope'" \
          "EmbeddingArgs.embedding_backend='dynamic'" "EmbeddingArgs.plain_table_optimizer='dense'" \
          --out "$out/multi_gpu_graphs.jsonl"
      done
      for g in True False; do
        python3 scripts/bench_e2e.py --task retrieval --config configs/amazon_beauty_retrieval.gin \
          --nproc 1,2 --paths compiled --steps 500 --graph-warmup 300 \
          --bindings "NetworkArgs.cuda_graphs=$g" --out "$out/multi_gpu_graphs.jsonl"
        python3 scripts/bench_e2e.py --config configs/synthetic_benchmark_ranking.gin --nproc 1,2 \
          --steps 100 --graph-warmup 300 --paths compiled --bindings "$E2E_ITEMS" \
          "EmbeddingArgs.user_capacity=1000000" "TrainerArgs.peak_tflops=989" \
          "NetworkArgs.cuda_graphs=$g" --out "$out/multi_gpu_graphs.jsonl"
      done ;;
    small-shared)  # 8 Amazon Beauty runs at once on the GPU, PyTorch's CPU threads vs one each
      for t in 0 1; do
        python3 scripts/bench_small.py --config configs/amazon_beauty_retrieval.gin --steps 1000 \
          --evals 1 --processes 8 --bindings "TrainerArgs.cpu_threads=$t" \
          --out "$out/small_shared.jsonl"
      done ;;
    small-profile)  # the small configs with CUDA graphs, then 20 steps under torch.profiler
      for c in ml_1m_retrieval amazon_beauty_retrieval; do
        python3 scripts/bench_small.py --config "configs/$c.gin" --steps 1000 --evals 1 \
          --first-steps 100 --bindings "NetworkArgs.cuda_graphs=True" --profile "$out/profile" \
          --out "$out/small_profile.jsonl"
      done ;;
    hybrid-e2e)  # the e2e model with its 2M-row item table in HBM, then 20M rows hybrid
      e2e_bench "$E2E_ITEMS"
      e2e_bench "EmbeddingArgs.item_capacity=20000000" "EmbeddingArgs.storage='hybrid'" ;;
    attn-bias)  # the relative bias's cost (docs/benchmarks.md, "With the relative attention bias")
      for b in none position position_time; do
        python3 scripts/bench_attention.py --graph --iters 20 --ref-iters 3 \
          --shapes long_d128,rank_targets --bias "$b" --out "$out/attn_bias.jsonl"
      done ;;
    hybrid) python3 scripts/bench_embedding.py --hybrid ;;
    red-throughput)  # the dQ reductions' access patterns (docs/kernels.md, SM90 backward)
      nvcc -O3 -arch=sm_90a -o "$out/red_throughput" kernels/hstu_attention/tools/red_throughput.cu &&
        "$out/red_throughput" ;;
    ncu-bwd256) ncu_kernel hstu_bwd_kernel 2 long_d256 ;;
    ncu-fwd256) ncu_kernel hstu_fwd_kernel 2 long_d256 ;;
    ncu-bwd128) ncu_kernel hstu_bwd_kernel 2 long_d128 ;;
    ncu-bias)  # the d128 kernels with the position + time bias, then without (same shape)
      for b in position_time none; do
        ncu_kernel hstu_fwd_kernel 1 long_d128 --bias $b
        ncu_kernel hstu_bwd_kernel 1 long_d128 --bias $b
      done ;;
    ncu-bias-src)  # warp-stall samples per SASS instruction of the biased d128 kernels, as CSV
      for k in bwd fwd; do
        ncu --kernel-name "regex:hstu_${k}_kernel" --launch-skip 1 --launch-count 1 --set full \
          --import-source yes -f -o "$out/ncu_bias_$k" python3 scripts/bench_attention.py \
          --shapes long_d128 --iters 2 --no-ref --bias position_time
        ncu --import "$out/ncu_bias_$k.ncu-rep" --page source --csv --print-source sass \
          > "$out/ncu_bias_${k}_src.csv"
      done ;;
    dq-convert-ab)  # dQ converted by the separate kernel (default) vs inside the backward
      for c in kernel bwd; do
        HSTU_ATTN_DQ_CONVERT=$c bench_ab dq_convert_ab --iters 20 --shapes long_d128,long_d256
      done ;;
    attn-sm90)  # the d128/d256 backward: the SM80 kernel (HSTU_ATTN_SM90=0), then the wgmma one
      for r in 1 2; do
        HSTU_ATTN_SM90=0 bench_ab attn_sm90 --iters 20 --shapes mid_d128,long_d128,long_d256,rank_targets
        bench_ab attn_sm90 --iters 20 --shapes mid_d128,long_d128,long_d256,rank_targets
      done ;;
    e2e-sm90)  # the e2e step with the SM80 d256 backward, then the wgmma one, E2E_ROUNDS rounds
      for r in $(seq "${E2E_ROUNDS:-2}"); do
        HSTU_ATTN_SM90=0 e2e_bench "$E2E_ITEMS" --out "$out/e2e_sm80.jsonl"
        e2e_bench "$E2E_ITEMS" --out "$out/e2e_sm90.jsonl"
      done ;;
    e2e-residual-gemm)  # the e2e step with the output projection + residual as one GEMM, then
      # as two ops (NetworkArgs.fused_residual_gemm), alternating, E2E_ROUNDS rounds (default 2)
      for r in $(seq "${E2E_ROUNDS:-2}"); do
        for v in True False; do
          e2e_bench "$E2E_ITEMS" "NetworkArgs.fused_residual_gemm=$v" --out "$out/e2e_residual_gemm.jsonl"
        done
      done ;;
    e2e-ab)  # the e2e step of this tree against another tree's (E2E_BASE: a copy of the
      # sources at some commit, e.g. `git archive <ref> hstu scripts configs kernels setup.py
      # pyproject.toml | tar -x -C <dir>`, made where git is), alternating, E2E_ROUNDS rounds
      # (default 2); the base builds its own bf16 d256 attention and gating kernels into a copy
      # in /tmp and borrows this tree's dynamic-embedding extension (run `build` first)
      [ -d "${E2E_BASE:-}" ] || { echo "e2e-ab needs E2E_BASE=<dir with the base sources>"; false; } &&
      rm -rf /tmp/hstu_e2e_base && cp -r "$E2E_BASE" /tmp/hstu_e2e_base &&
      (cd /tmp/hstu_e2e_base && HSTU_KERNELS=hstu_attention,layer_norm_mul_dropout \
        HSTU_KERNEL_DIMS=bf16_hdim256 HSTU_CUDA_ARCH_LIST=${HSTU_CUDA_ARCH_LIST:-"9.0"} \
        MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace > "$out/e2e_ab_build.log" 2>&1) &&
      cp hstu/_dynamic_embedding_C*.so /tmp/hstu_e2e_base/hstu/ &&
      for r in $(seq "${E2E_ROUNDS:-2}"); do
        for label in base this; do
          tree=/tmp/hstu_e2e_base
          [ "$label" = this ] && tree=$PWD
          (cd "$tree" && PYTHONPATH=$tree:${PYTHONPATH:-} e2e_bench "$E2E_ITEMS" \
            --out "$out/e2e_ab_$label.jsonl")
        done
      done ;;
    *) echo "unknown step $name" >&2; return 2 ;;
  esac > >(tee -a "$out/$name.log") 2>&1
  local rc=$?
  echo "[gpu_check] $name rc=$rc $((SECONDS - t0))s" | tee -a "$out/summary.log"
  return $rc
}

for s in "$@"; do
  step "$s" || failed=$((failed + 1))
done
exit $failed
