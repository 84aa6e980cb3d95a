#!/usr/bin/env bash
# GPT (24 layers, hidden 1024, 2048 tokens) on NVIDIA GPUs with NCCL, bf16 weights and fp32
# optimizer state, GPT-2 BPE tokenizer, DynaPipe micro-batching and schedule search planned for
# the device (memory from the GPU, compute rate from a start-up calibration; docs/USAGE.md "GPU").
# TP (default 1) x PP (default 2 with 2+ GPUs per node) x DP over NNODES nodes of NGPU GPUs;
# several nodes: run it on each with NNODES, NODE_RANK, MASTER_ADDR (node 0's) and MASTER_PORT.
# DATA_PATH: your own preprocessed FLAN dump (docs/DATA.md); default the small sample. Extra
# arguments go to pretrain_gpt.py. Without a visible CUDA device it exits with one line.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
gpu_check
tp="${TP:-1}"; pp="${PP:-$(( GPUS >= 2 ? 2 : 1 ))}"
gpu_check_layout "$tp" "$pp"
if [ -z "${DATA_PATH:-}" ]; then
  WITH_GPT2_BPE=1 bash examples/prepare_data.sh
  DATA_PATH=data/quickstart/flan_gpt2
fi
gpu_launch pretrain_gpt.py \
  --data-path "$DATA_PATH" --tokenizer-type GPT2BPETokenizer \
  --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 \
  --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp" --bf16 \
  --micro-batching dynamic --pipeline-schedule auto --num-planner-workers 4 \
  --tokens-per-global-batch 65536 --train-iters 200 --lr 2e-4 --lr-warmup-iters 20 \
  --min-lr 2e-5 --clip-grad 1.0 --save runs/gpt_gpu/checkpoints --load runs/gpt_gpu/checkpoints --save-interval 100 \
  --stats-file runs/gpt_gpu/stats.jsonl "$@"
