#!/usr/bin/env bash
# T5 on CPU with gloo: 2 processes, encoder and decoder layers spread over 2 pipeline stages,
# dynamic micro-batching over (encoder, decoder) shapes, planned with a profile of this model
# on this CPU (--cost-model profile: made on the first run, then read from
# ~/.cache/megatron-dynapipe/profiles); extra arguments go to pretrain_t5.py.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/tools/setup_env.sh"
cd "$repo"
bash examples/prepare_data.sh
exec torchrun --nproc-per-node "${NPROC:-2}" --master-addr 127.0.0.1 \
  --master-port "${MASTER_PORT:-29500}" pretrain_t5.py \
  --data-path data/quickstart/flan --tokenizer-type SentencePieceTokenizer \
  --tokenizer-model data/quickstart/sp.model \
  --encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 128 --num-attention-heads 4 \
  --encoder-seq-length 512 --decoder-seq-length 128 \
  --pipeline-model-parallel-size 2 --micro-batching dynamic --pipeline-schedule auto \
  --cost-model profile \
  --tokens-per-global-batch 4096 --train-iters 20 --lr 1e-3 --lr-warmup-iters 2 --min-lr 1e-4 \
  --stats-file runs/t5_cpu/stats.jsonl "$@"
