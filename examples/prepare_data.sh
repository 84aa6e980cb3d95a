#!/usr/bin/env bash
# Build (or reuse) the small FLAN-like sample the examples train on, under data/quickstart/:
# a multi-task dump, a SentencePiece tokenizer trained on it, and its indexed datasets for that
# tokenizer and for GPT-2 BPE. Expects tools/setup_env.sh to have been sourced.
set -euo pipefail
data=data/quickstart
mkdir -p "$data"
if [ ! -f "$data/flan.jsonl" ]; then
  echo "[data] generating a FLAN-like multi-task dump"
  python tools/make_flan_sample.py --output "$data/flan.jsonl" --num-samples 3000 --seed 1234
fi
if [ ! -f "$data/sp.model" ]; then
  echo "[data] training a SentencePiece tokenizer on it"
  python tools/train_tokenizer.py --input "$data/flan.jsonl" --model-prefix "$data/sp" \
    --vocab-size 4000 > "$data/train_tokenizer.log"
fi
if ! grep -qs 'megatron-dynapipe-flan/2' "$data/flan_tasks.json"; then   # absent or old format
  echo "[data] tokenising with SentencePiece into Megatron indexed datasets ($data/flan_*)"
  python tools/preprocess_flan.py --input "$data/flan.jsonl" --output-prefix "$data/flan" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$data/sp.model" --workers 2 \
    --no-progress > "$data/preprocess_sp.log"
  tail -n 1 "$data/preprocess_sp.log"
fi
if [ "${WITH_GPT2_BPE:-0}" = 1 ] && \
    ! grep -qs 'megatron-dynapipe-flan/2' "$data/flan_gpt2_tasks.json"; then
  echo "[data] tokenising with GPT-2 BPE ($data/flan_gpt2_*)"
  python tools/preprocess_flan.py --input "$data/flan.jsonl" --output-prefix "$data/flan_gpt2" \
    --tokenizer-type GPT2BPETokenizer --workers 2 --no-progress > "$data/preprocess_gpt2.log"
  tail -n 1 "$data/preprocess_gpt2.log"
fi
