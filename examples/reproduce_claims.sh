#!/usr/bin/env bash
# Rerun the CPU claims of docs/BENCHMARKS.md and README.md and rewrite their JSONs and tables:
# every JSON a rerun writes records its commit, UTC date, exact command, machine and load
# average before and after; then tools/write_claims.py writes the claims table, README's
# results table and the padding-free section from the JSONs and checks them (--check).
#
#   bash examples/reproduce_claims.sh --quick   # every CPU claim's tool on a small setting:
#       21 minutes from a fresh clone on 2 cores at load average 20-46 (2026-11-29), 4 of them
#       the packers at two max lengths, since cut to one
#   bash examples/reproduce_claims.sh           # the settings of the committed JSONs: several
#                                               # hours on 2 CPU cores (padding-free alone ~1 h)
#
# Not rerun here: the GPU figures (docs/gpu_h100_runs.json: `bash tools/gpu_check.sh` on a GPU
# machine), the cost-model check (tools/check_cost_model.py, flags in BENCHMARKS) and, in the
# quick tier, FlexTP and the measured pipeline schedules; their committed JSONs stay as they are.
# A quick run rewrites docs/ with figures of its small settings: compare, do not commit them.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK=${WORK:-runs/claims}
mkdir -p "$WORK"
CMD="bash examples/reproduce_claims.sh${1:+ $1}"
step() { echo "[claims] $(date -u +%H:%M:%S) $*"; }

# 1. data: the FLAN-like sample of examples/reproduce_throughput.sh (4,000 samples, seed 1234)
if [ ! -f "$WORK/flan_tasks.json" ]; then
  step "data"
  "$PY" tools/make_flan_sample.py --output "$WORK/flan.jsonl" --num-samples 4000 --seed 1234
  "$PY" tools/train_tokenizer.py --input "$WORK/flan.jsonl" --model-prefix "$WORK/sp" \
      --vocab-size 2000
  "$PY" tools/preprocess_flan.py --input "$WORK/flan.jsonl" --output-prefix "$WORK/flan" \
      --tokenizer-type SentencePieceTokenizer --tokenizer-model "$WORK/sp.model" --no-progress
fi

# 2. dynamic vs packing at its very best (per batch and dataset-level), GPT and T5, PP=2
if [ "$QUICK" = 1 ]; then
  PF=(--max-lengths 2048 --warmup-iters 1 --iters 2 --rounds 2)
else
  PF=(--max-lengths 2048 4096 8192 --warmup-iters 2 --iters 8 --rounds 3 --timeout-minutes 60)
fi
step "padding-free comparison (tools/bench_throughput.py)"
"$PY" tools/bench_throughput.py --data-path "$WORK/flan" --tokenizer-model "$WORK/sp.model" \
    --models gpt t5 --rows-per-global-batch 4 \
    --strategies packing+segment-attn packing+window dynamic "${PF[@]}" \
    --work-dir "$WORK/padding_free" --output docs/bench_padding_free.json --command "$CMD"

# 3. planner, schedules, packers, memory model, Spindle
Q=(); [ "$QUICK" = 1 ] && Q=(--quick)
step "planner (tools/bench_planner.py)"
"$PY" tools/bench_planner.py "${Q[@]}" > "$WORK/planner.log"
step "schedules (tools/bench_schedules.py)"
"$PY" tools/bench_schedules.py "${Q[@]}" > "$WORK/schedules.log"
step "packers (tools/bench_packers.py, no training runs)"
PACK_LENGTHS=(2048 4096); [ "$QUICK" = 1 ] && PACK_LENGTHS=(2048)
"$PY" tools/bench_packers.py --data-path "$WORK/flan" --models gpt t5 \
    --max-lengths "${PACK_LENGTHS[@]}" \
    --json-out docs/bench_packers.json --markdown docs/BENCHMARKS.md \
    --command "$CMD" > "$WORK/packers.log"
step "memory model (tools/bench_memory.py)"
if [ "$QUICK" = 1 ]; then MEM=(--max-lens 256); else MEM=(); fi
"$PY" tools/bench_memory.py "${MEM[@]}" > "$WORK/memory.log"
step "Spindle (tools/bench_spindle.py, tools/run_spindle.py)"
"$PY" tools/bench_spindle.py > "$WORK/spindle.log"
if [ "$QUICK" = 1 ]; then SPIN=(--iterations 10); else SPIN=(--iterations 40); fi
"$PY" -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \
    --master-port "${SPINDLE_PORT:-29541}" tools/run_spindle.py "${SPIN[@]}" > "$WORK/spindle_run.log"

# 4. full tier only: measured schedules and FlexTP (each an hour or more here)
if [ "$QUICK" = 0 ]; then
  step "pipeline schedules measured (tools/bench_pipeline_training.py)"
  "$PY" tools/bench_pipeline_training.py > "$WORK/pipeline_training.log"
  step "FlexTP (tools/bench_flextp_trainer.py): synthetic and busy-process stragglers, PP=1 and 2"
  for pp in 1 2; do
    for straggler in synthetic taskset; do
      rounds=7; [ "$pp$straggler" = 1taskset ] && rounds=14
      "$PY" tools/bench_flextp_trainer.py --rounds "$rounds" --iters 25 --skip 10 \
          --pipeline-model-parallel-size "$pp" --straggler "$straggler" --write-doc \
          > "$WORK/flextp_pp${pp}_$straggler.log"
    done
  done
  "$PY" tools/bench_flextp_trainer.py --loss-seeds 8 --seed 1234 --iters 200 --write-doc \
      > "$WORK/flextp_loss.log"
fi

# 5. the tables, from the JSONs, and the check that they say what the JSONs give
step "tables (tools/write_claims.py)"
"$PY" tools/write_claims.py
"$PY" tools/write_claims.py --check
step "done: git diff docs README.md shows what changed"
