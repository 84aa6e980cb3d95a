"""Dropout's random streams with megatron-core's semantics, on GPU and on CPU.

Megatron-LM seeds each rank with `seed + 100 * pipeline rank` (so pipeline stages draw
different masks; data-parallel replicas share the seed, Megatron's default without
--data-parallel-random-init) and then keeps, per rank:
* the default generator: dropout outside tensor-parallel regions (embedding dropout, the
  bias-dropout-add after attention and MLP). Equal on every TP rank of a group, so the
  replicated hidden states stay equal across TP ranks;
* megatron-core's RNG tracker state 'model-parallel-rng' (seed + 2718 + TP rank): dropout
  inside tensor-parallel regions (attention probabilities, whose heads are split over TP
  ranks), forked with `get_cuda_rng_tracker().fork()`;
* 'data-parallel-rng' (seed) and 'expert-parallel-rng', as megatron-core adds them.

On CUDA megatron-core's own tracker does this (`model_parallel_cuda_manual_seed`). Its tracker
reads and writes the CUDA generator only, so on CPU `CpuRNGStatesTracker` keeps the same
named states for the CPU generator and is installed as megatron-core's tracker, which every
`get_cuda_rng_tracker()` caller (attention dropout, recompute) then uses unchanged."""
from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel import random as mcore_random

PIPELINE_SEED_STRIDE = 100     # Megatron-LM's _set_random_seed: seed + 100 * pipeline rank
TENSOR_PARALLEL_OFFSET = 2718  # megatron-core's model_parallel_cuda_manual_seed
EXPERT_OFFSET = 1024


def rank_seed(seed: int, pp_rank: int) -> int:
    """The seed of one pipeline rank (every TP and DP rank of that stage shares it)."""
    return seed + PIPELINE_SEED_STRIDE * pp_rank


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """megatron-core's tracker for the CPU generator: named generator states, `fork(name)`
    runs a block on that state and keeps where it got to; `get_states` / `set_states` (what
    recompute and checkpoints use) are megatron-core's."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install_cpu_tracker() -> CpuRNGStatesTracker:
    """Make a CpuRNGStatesTracker megatron-core's tracker (what get_cuda_rng_tracker returns)."""
    tracker = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


def seed_model_parallel(seed: int, tp_rank: int, pp_rank: int, on_cuda: bool) -> None:
    """Seed this rank's dropout streams as Megatron-LM does (see the module docstring)."""
    seed = rank_seed(seed, pp_rank)
    torch.manual_seed(seed)
    if on_cuda:
        mcore_random.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0,
                                                     etp_rank=0, force_reset_rng=True)
        return
    tracker = install_cpu_tracker()
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + TENSOR_PARALLEL_OFFSET + tp_rank)
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + EXPERT_OFFSET)
