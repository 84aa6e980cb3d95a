# Sourced by examples/train_gpt_gpu.sh and examples/train_t5_gpu.sh (not run on its own).
#   gpu_check           one line on stderr and exit 1 when no CUDA device is visible; else sets
#                       GPUS (processes per node: NGPU, default all visible GPUs), NNODES,
#                       NODE_RANK, MASTER_ADDR, MASTER_PORT, and enters the project environment
#   gpu_check_layout TP PP   exit 1 unless TP x PP divides the world (NNODES x GPUS)
#   gpu_launch SCRIPT ARGS...  torchrun on this node of the NNODES-node job

gpu_fail() {
  echo "$(basename "$0"): $*" >&2
  exit 1
}

gpu_check() {
  local repo py visible
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  py="$repo/.venv/bin/python"
  if [ ! -x "$py" ]; then            # first use: create the environment (prints its progress)
    source "$repo/tools/setup_env.sh"
    py=python
  fi
  visible="$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
  [ "$visible" -ge 1 ] || gpu_fail "no CUDA device is visible (torch.cuda.is_available() is" \
    "False): this launcher trains on NVIDIA GPUs; on CPU use examples/train_*_cpu.sh"
  GPUS="${NGPU:-$visible}"
  NNODES="${NNODES:-1}"; NODE_RANK="${NODE_RANK:-0}"
  MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"; MASTER_PORT="${MASTER_PORT:-29500}"
  [ "$GPUS" -ge 1 ] && [ "$GPUS" -le "$visible" ] \
    || gpu_fail "NGPU=$GPUS but $visible CUDA device(s) are visible"
  [ "$NNODES" -ge 1 ] && [ "$NODE_RANK" -ge 0 ] && [ "$NODE_RANK" -lt "$NNODES" ] \
    || gpu_fail "NODE_RANK=$NODE_RANK must lie in 0..$(( NNODES - 1 )) (NNODES=$NNODES)"
  [ "$NNODES" = 1 ] || [ "$MASTER_ADDR" != 127.0.0.1 ] \
    || gpu_fail "NNODES=$NNODES needs MASTER_ADDR set to node 0's address on every node"
  source "$repo/tools/setup_env.sh"
  cd "$repo"
  export CUDA_DEVICE_MAX_CONNECTIONS=1      # megatron-core asks for it with TP > 1
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
}

gpu_check_layout() {
  local world=$(( NNODES * GPUS ))
  [ $(( world % ($1 * $2) )) = 0 ] || gpu_fail "world size $world (NNODES=$NNODES x" \
    "$GPUS GPU(s)) is not divisible by TP=$1 x PP=$2 = $(( $1 * $2 ))"
  echo "[launch] node $NODE_RANK of $NNODES, $GPUS GPU(s) each: TP=$1 x PP=$2 x" \
    "DP=$(( world / ($1 * $2) ))"
}

gpu_launch() {
  exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$@"
}
