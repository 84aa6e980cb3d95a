#!/usr/bin/env bash
# GPT on CPU with gloo: NPROC processes (default 4) as TP=1 x PP=2 x DP=NPROC/2, on the sample
# data of examples/prepare_data.sh. Try --micro-batching padding|token-budget|packing|dynamic and
# --pipeline-schedule 1f1b|adaptive|wave|auto. Plans with a profile of this model on this CPU
# (--cost-model profile: made on the first run, then cached); extra arguments go to pretrain_gpt.py.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/tools/setup_env.sh"
cd "$repo"
bash examples/prepare_data.sh
exec torchrun --nproc-per-node "${NPROC:-4}" --master-addr 127.0.0.1 \
  --master-port "${MASTER_PORT:-29500}" pretrain_gpt.py \
  --data-path data/quickstart/flan --tokenizer-type SentencePieceTokenizer \
  --tokenizer-model data/quickstart/sp.model \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 512 \
  --pipeline-model-parallel-size 2 --micro-batching dynamic --pipeline-schedule auto \
  --cost-model profile \
  --tokens-per-global-batch 8192 --train-iters 30 --lr 3e-3 --lr-warmup-iters 3 --min-lr 3e-4 \
  --save runs/gpt_cpu/checkpoints --load runs/gpt_cpu/checkpoints --save-interval 10 --log-interval 1 \
  --stats-file runs/gpt_cpu/stats.jsonl "$@"
