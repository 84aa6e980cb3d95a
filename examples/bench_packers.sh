#!/usr/bin/env bash
# Reproduce the "Packers: per batch and dataset-level" section of docs/BENCHMARKS.md: the
# FLAN-like sample of examples/reproduce_throughput.sh, every packer's real / slots per batch
# and with --packing-window (tools/bench_packers.py), and short timed training runs of each
# packer (tools/bench_throughput.py, packing+segment-attn, PP=2). About 35 minutes on 2 CPU
# cores; TIMED=0 skips the training runs (2 minutes).
#
#   bash examples/bench_packers.sh
#   MAX_LENGTHS=2048 TIMED=0 bash examples/bench_packers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-runs/packers}
MAX_LENGTHS=${MAX_LENGTHS:-"2048 4096"}
TIMED=${TIMED:-1}
TOKENS=${TOKENS:-8192}
mkdir -p "$WORK/timed"

# 1. data: as examples/reproduce_throughput.sh (4,000 samples, seed 1234, 2,000 pieces)
if [ ! -f "$WORK/flan_tasks.json" ]; then
  "$PY" tools/make_flan_sample.py --output "$WORK/flan.jsonl" --num-samples 4000 --seed 1234
  "$PY" tools/train_tokenizer.py --input "$WORK/flan.jsonl" --model-prefix "$WORK/sp" \
      --vocab-size 2000
  "$PY" tools/preprocess_flan.py --input "$WORK/flan.jsonl" --output-prefix "$WORK/flan" \
      --tokenizer-type SentencePieceTokenizer --tokenizer-model "$WORK/sp.model" --no-progress
fi
SAMPLES=$("$PY" -c "import json; print(json.load(open('$WORK/flan_tasks.json'))['num_samples'])" \
  2>/dev/null || echo 4000)

# 2. timed training runs: each packer, each global batch packed alone / the dataset packed ahead
TIMED_FILES=()
if [ "$TIMED" = 1 ]; then
  for L in $MAX_LENGTHS; do
    for model in gpt t5; do
      for packer in nextfit spfhp lpfhp nnlshp; do
        for mode in batch window; do
          name="${model}_${L}_${packer}_${mode}"
          extra=""
          [ "$mode" = window ] && extra="--packing-window $SAMPLES"
          if [ ! -f "$WORK/timed/$name.json" ]; then
            "$PY" tools/bench_throughput.py --data-path "$WORK/flan" \
                --tokenizer-model "$WORK/sp.model" --models "$model" --max-lengths "$L" \
                --strategies packing+segment-attn --packing-algorithm "$packer" \
                --train-args "$extra" --warmup-iters 1 --iters 3 \
                --tokens-per-global-batch "$TOKENS" --nproc 2 --pp 2 --device cpu \
                --work-dir "$WORK/timed/work_$name" --output "$WORK/timed/$name.json" \
                > "$WORK/timed/$name.log" 2>&1 || echo "failed: $name (see $WORK/timed/$name.log)"
          fi
          [ -f "$WORK/timed/$name.json" ] && TIMED_FILES+=("$WORK/timed/$name.json")
        done
      done
    done
  done
fi

# 3. efficiency of every packer and the docs section
"$PY" tools/bench_packers.py --data-path "$WORK/flan" --max-lengths $MAX_LENGTHS \
    --tokens-per-global-batch "$TOKENS" 65536 --json-out docs/bench_packers.json \
    --markdown docs/BENCHMARKS.md --command "bash examples/bench_packers.sh" \
    --timed "${TIMED_FILES[@]}"
