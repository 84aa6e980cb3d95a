#!/usr/bin/env bash
# The README's main command: set up (or reuse) .venv, build a small FLAN-like multi-task dataset
# (SentencePiece tokenizer trained on it, Megatron indexed datasets), then train a small GPT on
# this CPU over 2 pipeline stages with DynaPipe's dynamic micro-batching, printing loss and
# tokens/s. A second run reuses the data. Extra arguments go to pretrain_gpt.py.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/tools/setup_env.sh"
cd "$repo"
bash examples/prepare_data.sh

echo "[quickstart] training GPT: 2 processes, pipeline-parallel 2, dynamic micro-batches"
# one thread per rank, what torchrun would set itself after printing a notice about it
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "${MASTER_PORT:-29500}" \
  pretrain_gpt.py \
  --data-path data/quickstart/flan --tokenizer-type SentencePieceTokenizer \
  --tokenizer-model data/quickstart/sp.model \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 512 \
  --pipeline-model-parallel-size 2 --micro-batching dynamic --pipeline-schedule auto \
  --tokens-per-global-batch 4096 --train-iters 20 --lr 3e-3 --lr-warmup-iters 2 \
  --min-lr 3e-4 "$@"
