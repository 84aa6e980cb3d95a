#!/usr/bin/env bash
# T5 (12 + 12 layers, hidden 768, encoder 2048 / decoder 512 tokens) on NVIDIA GPUs with NCCL,
# bf16 weights and fp32 optimizer state, DynaPipe micro-batching over (encoder, decoder) shapes
# planned for the device (docs/USAGE.md "GPU"). TP (default 1) x PP (default 2 with 2+ GPUs per node)
# x DP over NNODES nodes of NGPU GPUs; several nodes: run it on each with NNODES, NODE_RANK,
# MASTER_ADDR (node 0's) and MASTER_PORT. DATA_PATH + TOKENIZER_MODEL: your own SentencePiece
# dataset (docs/DATA.md); default the small sample. Extra arguments go to pretrain_t5.py.
# Without a visible CUDA device it exits with one line.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
gpu_check
tp="${TP:-1}"; pp="${PP:-$(( GPUS >= 2 ? 2 : 1 ))}"
gpu_check_layout "$tp" "$pp"
if [ -z "${DATA_PATH:-}" ]; then
  bash examples/prepare_data.sh
  DATA_PATH=data/quickstart/flan
  TOKENIZER_MODEL=data/quickstart/sp.model
fi
gpu_launch pretrain_t5.py \
  --data-path "$DATA_PATH" --tokenizer-type SentencePieceTokenizer \
  --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece model of DATA_PATH}" \
  --encoder-num-layers 12 --decoder-num-layers 12 --hidden-size 768 --num-attention-heads 12 \
  --encoder-seq-length 2048 --decoder-seq-length 512 \
  --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp" --bf16 \
  --micro-batching dynamic --pipeline-schedule auto --num-planner-workers 4 \
  --tokens-per-global-batch 65536 --train-iters 200 --lr 1e-4 --lr-warmup-iters 20 \
  --min-lr 1e-5 --clip-grad 1.0 --save runs/t5_gpu/checkpoints --load runs/t5_gpu/checkpoints --save-interval 100 \
  --stats-file runs/t5_gpu/stats.jsonl "$@"
