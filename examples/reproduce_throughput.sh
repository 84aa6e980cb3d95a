#!/usr/bin/env bash
# Reproduce the "Training throughput" section of docs/BENCHMARKS.md end to end on this machine:
# FLAN-like data -> SentencePiece tokenizer -> indexed dataset -> real training iterations of
# every micro-batching strategy (tools/bench_throughput.py) -> paper-scale simulation
# (tools/project_paper_scale.py) -> tables and plots. About 40-60 minutes on 2 CPU cores.
#
#   bash examples/reproduce_throughput.sh              # CPU: 2 ranks, gloo, PP=2
#   MAX_LENGTHS="512 1024" bash examples/reproduce_throughput.sh   # a quicker subset
#   DEVICE=cuda NPROC=1 PP=1 bash examples/reproduce_throughput.sh # one GPU, bf16
#   DEVICE=cuda NPROC=1 PP=1 NUM_LAYERS=16 HIDDEN=2048 HEADS=16 TOKENS=65536 WARMUP=3 ITERS=4 \
#     MAX_LENGTHS="2048 4096" bash examples/reproduce_throughput.sh   # the H100 table (BENCHMARKS "GPU")
#   COST_MODEL=profile bash examples/reproduce_throughput.sh  # plan with the run's profile
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-runs/throughput}
MAX_LENGTHS=${MAX_LENGTHS:-"512 1024 2048 4096 8192"}
NPROC=${NPROC:-2}
PP=${PP:-2}
DEVICE=${DEVICE:-auto}
ITERS=${ITERS:-3}
WARMUP=${WARMUP:-1}             # GPU: 3 (torch.compile'd fusions compile for the first shapes)
NUM_LAYERS=${NUM_LAYERS:-4}; HIDDEN=${HIDDEN:-256}; HEADS=${HEADS:-4}; TOKENS=${TOKENS:-8192}
COST_MODEL=${COST_MODEL:-analytic}   # or profile: made on first use, cached (several minutes)
mkdir -p "$WORK"

# 1. data: 4,000 FLAN-like samples (seeded), a 2,000-piece SentencePiece vocabulary, indexed
"$PY" tools/make_flan_sample.py --output "$WORK/flan.jsonl" --num-samples 4000 --seed 1234
"$PY" tools/train_tokenizer.py --input "$WORK/flan.jsonl" --model-prefix "$WORK/sp" \
    --vocab-size 2000
"$PY" tools/preprocess_flan.py --input "$WORK/flan.jsonl" --output-prefix "$WORK/flan" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$WORK/sp.model" --no-progress

# 2. real training iterations: GPT and T5, every max length, every strategy
CMD="bash examples/reproduce_throughput.sh"
"$PY" tools/bench_throughput.py --data-path "$WORK/flan" --tokenizer-model "$WORK/sp.model" \
    --models gpt t5 --max-lengths $MAX_LENGTHS --tokens-per-global-batch "$TOKENS" \
    --warmup-iters "$WARMUP" --iters "$ITERS" --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" \
    --num-attention-heads "$HEADS" --nproc "$NPROC" --pp "$PP" --device "$DEVICE" \
    --cost-model "$COST_MODEL" --work-dir "$WORK/bench" \
    --output "$WORK/bench_throughput.json" --command "$CMD"

# 3. paper-scale simulation (cost model, planners and schedule search; no training)
"$PY" tools/project_paper_scale.py --output "$WORK/projection.json"

# 4. tables and plots
"$PY" tools/bench_throughput.py report "$WORK/bench_throughput.json" \
    --projection "$WORK/projection.json" --json-out docs/bench_throughput.json \
    --markdown docs/BENCHMARKS.md --plots docs
