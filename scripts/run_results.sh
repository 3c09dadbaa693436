#!/usr/bin/env bash
# Reproduces the runs of docs/results.md, one command each, with the exact bindings.
#
#   bash scripts/run_results.sh prepare        # data/amazon-beauty, data/amazon-beauty-val, data/ml-1m
#   bash scripts/run_results.sh beauty-hstu    # Amazon Beauty retrieval, HSTU attention
#   bash scripts/run_results.sh beauty-sasrec  # the same run with the SASRec-style softmax attention
#   bash scripts/run_results.sh ml-1m          # ML-1M retrieval, CPU development mode (< 15 min)
#   bash scripts/run_results.sh ml-1m-sasrec   # the same run with the SASRec-style softmax attention
#   bash scripts/run_results.sh beauty-val-hstu|beauty-val-sasrec  # the tuning runs (validation)
#
# Arguments after the run name are passed on (they win over the bindings below), e.g. a second
# seed: SUFFIX=-seed2 bash scripts/run_results.sh beauty-hstu --gin-bindings "TrainerArgs.seed=2"
#
# Environment: SHARED (default ../shared/data) holds the raw files; RESULTS_DIR (default
# runs/results) receives the run directories (TensorBoard, config.gin) and <run>.log;
# THREADS (default 1) sets OMP_NUM_THREADS (one thread per run keeps timings stable on a shared
# 2-core box). The runs below are CPU development mode (HSTU_ALLOW_NON_A100=1); on an A100 drop
# the CPU-only bindings (sparse optimizer) to get the configs' own settings.
set -euo pipefail
cd "$(dirname "$0")/.."

SHARED=${SHARED:-../shared/data}
RESULTS_DIR=${RESULTS_DIR:-runs/results}
THREADS=${THREADS:-1}
SUFFIX=${SUFFIX:-}

# Amazon Beauty: both attention types share every binding below (see docs/results.md for how
# they were chosen on the validation split; the CPU runs there used the torchrec item table and
# the unfused layer, kept here so that they reproduce; the config's own plain table trained by
# row-wise Adagrad: add --gin-bindings "EmbeddingArgs.embedding_backend='dense'" --gin-bindings
# "EmbeddingArgs.plain_table_optimizer='sparse'").
BEAUTY_BINDINGS=(
  --gin-bindings "EmbeddingArgs.sparse_optimizer_str='rowwise_adagrad'"
  --gin-bindings "EmbeddingArgs.sparse_learning_rate=0.2"
  --gin-bindings "EmbeddingArgs.embedding_backend='torchrec'"
  --gin-bindings "EmbeddingArgs.plain_table_optimizer='dense'"
  --gin-bindings "NetworkArgs.fused_layer=False"
  --gin-bindings "NetworkArgs.fused_stage_compile=True"
  --gin-bindings "TrainerArgs.max_train_iters=8750"
  --gin-bindings "TrainerArgs.eval_interval=1750"
  --gin-bindings "TrainerArgs.log_interval=250"
  --gin-bindings "TrainerArgs.ckpt_save_interval=-1"
)
# ML-1M: the paper's setup (configs/ml_1m_retrieval.gin: dense Adam item table, which runs on
# CPU too) with fewer steps: 800 steps = 12 epochs, inside 15 minutes on a 2-core box.
ML1M_BINDINGS=(
  --gin-bindings "TrainerArgs.max_train_iters=800"
  --gin-bindings "TrainerArgs.eval_interval=400"
  --gin-bindings "TrainerArgs.log_interval=100"
  --gin-bindings "TrainerArgs.ckpt_save_interval=-1"
)

train() {  # train <run name> <gin file> [extra args...]
  local name=$1$SUFFIX gin=$2
  shift 2
  mkdir -p "$RESULTS_DIR"
  local start=$SECONDS
  OMP_NUM_THREADS=$THREADS HSTU_ALLOW_NON_A100=1 torchrun --nproc_per_node=1 \
    --master_port=$((29500 + RANDOM % 400)) scripts/pretrain_gr_retrieval.py \
    --gin-config-file "$gin" \
    --gin-bindings "TrainerArgs.log_dir='$RESULTS_DIR'" \
    --gin-bindings "TrainerArgs.run_name='$name'" \
    --gin-bindings "TrainerArgs.progress_bar=False" \
    "$@" 2>&1 | tee "$RESULTS_DIR/$name.log"
  echo "$name: wall time $((SECONDS - start)) s" | tee -a "$RESULTS_DIR/$name.log"
}

cmd=${1:-}
shift || true
case "$cmd" in
  prepare)
    python -m hstu.data.prepare --dataset amazon-beauty --source "$SHARED/amazon-beauty/Beauty.txt"
    python -m hstu.data.prepare --dataset sequences --source "$SHARED/ml-1m-sasrec/ml-1m.txt.gz" \
      --output data/ml-1m
    # validation copy: every user's last item dropped, so leave-one-out evaluation on it scores
    # the second-to-last item (used for tuning; the test item is never looked at)
    mkdir -p data/raw
    awk '{NF = NF - 1; print}' "$SHARED/amazon-beauty/Beauty.txt" > data/raw/beauty_val.txt
    python -m hstu.data.prepare --dataset amazon-beauty --source data/raw/beauty_val.txt \
      --output data/amazon-beauty-val
    ;;
  beauty-hstu)
    train beauty-hstu configs/amazon_beauty_retrieval.gin "${BEAUTY_BINDINGS[@]}" "$@"
    ;;
  beauty-sasrec)
    train beauty-sasrec configs/amazon_beauty_sasrec_retrieval.gin "${BEAUTY_BINDINGS[@]}" "$@"
    ;;
  beauty-val-hstu)
    train beauty-val-hstu configs/amazon_beauty_retrieval.gin "${BEAUTY_BINDINGS[@]}" \
      --gin-bindings "DatasetArgs.dataset_path='data/amazon-beauty-val'" "$@"
    ;;
  beauty-val-sasrec)
    train beauty-val-sasrec configs/amazon_beauty_sasrec_retrieval.gin "${BEAUTY_BINDINGS[@]}" \
      --gin-bindings "DatasetArgs.dataset_path='data/amazon-beauty-val'" "$@"
    ;;
  ml-1m)
    train ml-1m-hstu configs/ml_1m_retrieval.gin "${ML1M_BINDINGS[@]}" "$@"
    ;;
  ml-1m-sasrec)
    train ml-1m-sasrec configs/ml_1m_sasrec_retrieval.gin "${ML1M_BINDINGS[@]}" "$@"
    ;;
  *)
    sed -n '2,14p' "$0" >&2
    exit 2
    ;;
esac
