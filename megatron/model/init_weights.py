"""Deterministic weights that do not depend on the parallel layout.

Every parameter is drawn at its *full* (unsplit) shape from a generator seeded by
(seed, global parameter name), then the slice this tensor-parallel rank holds is kept. A
TP=2 x PP=2 run and a single process therefore start from identical weights.
Values follow Megatron's defaults: normal(0, std) for weights, std / sqrt(2 * layers) for the
output projections of attention and MLP, ones for norm weights, zeros for biases.
"""
from __future__ import annotations

import math
import zlib
from typing import Iterable

import torch
from megatron.core import parallel_state

SCALED_INIT_SUFFIXES = ("linear_proj.weight", "linear_fc2.weight")


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """Shape of the unsplit parameter (megatron marks TP-split ones with `partition_dim`; a
    parameter with spare capacity says its TP shard's length there, `tp_shard_size`)."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        if getattr(param, "partition_stride", 1) != 1:
            raise NotImplementedError("strided tensor-parallel partitions are not supported")
        shard = getattr(param, "tp_shard_size", None)
        shape[param.partition_dim] = (shape[param.partition_dim] if shard is None
                                      else shard) * tp_size
    return tuple(shape)


def name_seed(seed: int, global_name: str) -> int:
    """A stable 63-bit seed for one parameter (crc32, not Python's salted hash)."""
    return (seed * 1_000_003 + zlib.crc32(global_name.encode())) % (2 ** 63)


def full_value(global_name: str, shape: tuple[int, ...], seed: int, std: float,
               num_layers: int) -> torch.Tensor:
    """The unsplit fp32 initial value of one parameter."""
    if global_name.endswith("bias"):
        return torch.zeros(shape)
    if len(shape) == 1 and "norm" in global_name:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(name_seed(seed, global_name))
    if global_name.endswith(SCALED_INIT_SUFFIXES):
        std = std / math.sqrt(2.0 * num_layers)
    return torch.randn(shape, generator=gen) * std


def tp_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The part of `full` that this TP rank holds (contiguous chunks along partition_dim; of
    each half for a gated MLP's fc1, see stages.mark_tensor_parallel_weights)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    if getattr(param, "gated_halves", False):
        return torch.cat([torch.chunk(half, tp_size, dim=param.partition_dim)[tp_rank]
                          for half in torch.chunk(full, 2, dim=param.partition_dim)],
                         dim=param.partition_dim)
    return torch.chunk(full, tp_size, dim=param.partition_dim)[tp_rank]


@torch.no_grad()
def initialize_parameters(named_params: Iterable[tuple[str, torch.Tensor]], seed: int,
                          num_layers: int, std: float = 0.02) -> int:
    """Set every (global name, parameter) pair in place; returns how many were set."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    count = 0
    for name, param in named_params:
        full = full_value(name, full_shape(param, tp_size), seed, std, num_layers)
        part = tp_slice(full, param, tp_rank, tp_size)
        if part.shape != param.shape:
            raise RuntimeError(f"parameter {name}: slice {tuple(part.shape)} does not match the "
                               f"local shape {tuple(param.shape)} (tp rank {tp_rank}/{tp_size})")
        param.copy_(part.to(dtype=param.dtype, device=param.device))
        count += 1
    return count


def initialize_stage_weights(rank_stages, seed: int, std: float = 0.02) -> int:
    """Initialise every stage module this rank holds (see stages.build_rank_stages)."""
    total = 0
    for stage in rank_stages.values():
        total += initialize_parameters(stage.named_global_parameters(), seed,
                                       stage.spec.total_layers, std)
    return total
