#!/usr/bin/env bash
# Fine-tune a Llama-architecture Hugging Face checkpoint on FLAN data and hand it back to
# transformers, all on this CPU and with nothing downloaded: make a small random-initialised
# Llama (GQA, untied head, Llama 3.1 rope scaling) with a tokenizer.json trained on the quickstart
# data, preprocess that data with its tokenizer, import the checkpoint, fine-tune it with dynamic
# micro-batches over 2 pipeline stages, evaluate it, export it, and let transformers load the
# result and generate a few tokens. For a real checkpoint directory the steps are the same from
# "preprocess" on (README.md, "Fine-tune a Llama / Qwen2 / Mistral checkpoint").
# Outputs under runs/finetune_llama/ (a rerun starts it afresh). Extra arguments go to
# pretrain_gpt.py.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/tools/setup_env.sh"
cd "$repo"
work=runs/finetune_llama
hf="$work/llama-hf"
rm -rf "$work"
mkdir -p "$work" data/quickstart
port="${MASTER_PORT:-29500}"

if [ ! -f data/quickstart/flan.jsonl ]; then
  echo "[llama] generating the quickstart FLAN-like multi-task dump"
  python tools/make_flan_sample.py --output data/quickstart/flan.jsonl --num-samples 3000 \
    --seed 1234
fi

echo "[llama] a Llama 3-style byte-level BPE tokenizer.json trained on it ($hf)"
python tools/train_tokenizer.py --tokenizer-type HuggingFaceTokenizer \
  --input data/quickstart/flan.jsonl --model-prefix "$hf" --vocab-size 2000 \
  > "$work/train_tokenizer.log"

echo "[llama] a random-initialised LlamaForCausalLM beside it"
python - "$hf" <<'EOF'
import sys

import torch
import transformers

directory = sys.argv[1]
tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
config = transformers.LlamaConfig(
    vocab_size=len(tokenizer), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
torch.manual_seed(1234)
model = transformers.LlamaForCausalLM(config)
model.save_pretrained(directory)
print(f"  {sum(p.numel() for p in model.parameters())} parameters, vocabulary "
      f"{config.vocab_size}")
EOF

echo "[llama] preprocessing the dump with the checkpoint's tokenizer ($work/flan)"
python tools/preprocess_flan.py --input data/quickstart/flan.jsonl --output-prefix "$work/flan" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$hf" --workers 2 --no-progress \
  > "$work/preprocess.log"
tail -n 1 "$work/preprocess.log"

echo "[llama] importing the checkpoint ($work/import)"
printed="$(python tools/convert_checkpoint.py --from-hf "$hf" --to "$work/import" \
  --seq-length 512)"
echo "  $printed"
read -r -a model_flags <<< "${printed#*train with: }"
data_flags=(--data-path "$work/flan" --tokenizer-type HuggingFaceTokenizer
            --tokenizer-model "$hf" --seq-length 512 --split 969,30,1)

echo "[llama] fine-tuning: 2 processes, pipeline-parallel 2, dynamic micro-batches"
torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port" pretrain_gpt.py \
  "${model_flags[@]}" "${data_flags[@]}" --load "$work/import" --finetune \
  --pipeline-model-parallel-size 2 --micro-batching dynamic --pipeline-schedule auto \
  --tokens-per-global-batch 4096 --train-iters 20 --lr 1e-3 --lr-warmup-iters 2 \
  --min-lr 1e-4 --save "$work/run" --save-interval 20 "$@"

echo "[llama] evaluating the fine-tuned checkpoint on the held-out share"
torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port" tools/evaluate.py \
  --model gpt "${model_flags[@]}" "${data_flags[@]}" --load "$work/run" \
  --pipeline-model-parallel-size 2 --eval-iters 2

echo "[llama] exporting it to a transformers directory ($work/llama-tuned)"
python tools/convert_checkpoint.py --to-hf "$work/run" --model-args "$work/import" \
  --to "$work/llama-tuned"
cp "$hf/tokenizer.json" "$hf/tokenizer_config.json" "$work/llama-tuned/"

echo "[llama] transformers loads it and generates"
python - "$work/llama-tuned" <<'EOF'
import sys

import torch
import transformers

directory = sys.argv[1]
tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
prompt = "Translate to French: the cat sat on the mat."
ids = tokenizer(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
print(f"  {type(model).__name__}: {prompt!r} -> "
      f"{tokenizer.decode(out[0, ids.shape[1]:])!r}")
EOF
