"""Layout-free model state: {global parameter name: full (unsplit) tensor}.

One representation of a model's weights that does not depend on TP or PP. A rank holds the
tensor-parallel slices of its stages' parameters (see stages.StageModule.global_name); a
checkpoint stores those slices as *shards* that name where they sit in the full tensor, so any
layout can reassemble what it needs; a converted Hugging Face checkpoint is one shard per
parameter (the full tensor).

A shard is a plain dict (weights_only-loadable): {"tensor", "dim", "index", "count"}: `tensor`
is chunk `index` of `count` equal chunks of the full tensor along `dim` (dim -1 and count 1
for an unsplit parameter). A gated MLP's fc1 shard also has "halves": 2: the tensor is the
same chunk of the gate half and of the up half (init_weights.tp_slice).

Spare capacity: a TP-split parameter may be longer along its partition_dim than its TP shard
(FlexTP's fixed-size slots, megatron/flextp/stage_layers.py); its `tp_shard_size` attribute then
says how many leading entries hold the shard. Shards are saved from and loaded into those
entries only (`shard_view`); the caller keeps the even layout there while it saves or loads
(FlexTP: StageBalancer.even_layout) and the rest at zero.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from megatron.model.init_weights import full_shape, tp_slice


def shard_view(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` (parameter `like`, or optimizer state shaped like it) that holds
    its TP shard: all of it, or the leading `like.tp_shard_size` entries along partition_dim of
    a parameter with spare capacity (a view)."""
    size = getattr(like, "tp_shard_size", None)
    return tensor if size is None else tensor.narrow(like.partition_dim, 0, size)


def shaped_like(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A new tensor shaped like parameter `like` holding `part` (its TP shard) where
    `shard_view` finds it, zero elsewhere."""
    if getattr(like, "tp_shard_size", None) is None:
        return part.clone()
    out = part.new_zeros(like.shape)
    shard_view(out, like).copy_(part)
    return out


def shard_of(tensor: torch.Tensor, like: torch.Tensor, tp_rank: int, tp_size: int) -> dict:
    """`tensor` (this rank's part of a parameter, or of optimizer state shaped like it) as a
    shard, split the way parameter `like` is (megatron's tensor_model_parallel attributes)."""
    split = getattr(like, "tensor_model_parallel", False) and tp_size > 1
    tensor = tensor.detach()
    if getattr(like, "tp_shard_size", None) is not None:   # a copy: not the whole storage
        tensor = shard_view(tensor, like).clone()
    shard = {"tensor": tensor.cpu(),
             "dim": int(like.partition_dim) if split else -1,
             "index": tp_rank if split else 0,
             "count": tp_size if split else 1}
    if split and getattr(like, "gated_halves", False):
        shard["halves"] = 2
    return shard


def whole(tensor: torch.Tensor) -> dict:
    """A full tensor as its only shard."""
    return {"tensor": tensor.detach().cpu(), "dim": -1, "index": 0, "count": 1}


def local_shards(named_params: Iterable[tuple[str, torch.Tensor]], tp_rank: int,
                 tp_size: int) -> dict[str, dict]:
    """The shards this rank holds, keyed by global name (tensors detached, on the CPU)."""
    return {name: shard_of(param, param, tp_rank, tp_size) for name, param in named_params}


def saved_shape(shards: list[dict]) -> tuple[int, ...]:
    """The full tensor's shape, from its shards' metadata (no data is read)."""
    first = shards[0]
    shape = list(first["tensor"].shape)
    if first["count"] > 1:
        shape[first["dim"]] *= first["count"]
    return tuple(shape)


def local_part(name: str, shards: list[dict], like: torch.Tensor, tp_rank: int,
               tp_size: int) -> torch.Tensor:
    """The part of parameter `name` that this rank holds, shaped like `like`'s full tensor
    sliced at `tp_rank` of `tp_size`. When the shards were split the same way as this rank
    splits, the one chunk needed is taken as is (nothing else read); otherwise the full
    tensor is assembled and sliced."""
    split = getattr(like, "tensor_model_parallel", False) and tp_size > 1
    if split:
        halves = 2 if getattr(like, "gated_halves", False) else 1
        for s in shards:
            if (s["dim"], s["count"], s["index"], s.get("halves", 1)) == (
                    like.partition_dim, tp_size, tp_rank, halves):
                return s["tensor"]
    return tp_slice(assemble(name, shards), like, tp_rank, tp_size)


def assemble(name: str, shards: list[dict]) -> torch.Tensor:
    """The full tensor of parameter `name` from its shards (any order; duplicates of the
    same chunk, e.g. from several DP replicas, are allowed). ValueError naming the parameter
    when chunks are missing or disagree on how the tensor is split."""
    if not shards:
        raise ValueError(f"parameter {name}: no shard of it was saved")
    layouts = {(s["dim"], s["count"], s.get("halves", 1)) for s in shards}
    if len(layouts) != 1:
        raise ValueError(f"parameter {name}: shards split it in different ways: "
                         f"{sorted(layouts)}")
    dim, count, halves = layouts.pop()
    chunks = {s["index"]: s["tensor"] for s in shards}
    missing = sorted(set(range(count)) - set(chunks))
    if missing:
        raise ValueError(f"parameter {name}: chunks {missing} of {count} are missing")
    if count == 1:
        return chunks[0]
    if halves == 2:    # [gate_i; up_i] per chunk -> [gate; up]
        parts = [torch.chunk(chunks[i], 2, dim=dim) for i in range(count)]
        return torch.cat([p[0] for p in parts] + [p[1] for p in parts], dim=dim)
    return torch.cat([chunks[i] for i in range(count)], dim=dim)


@torch.no_grad()
def load_full_state(named_params: Iterable[tuple[str, torch.Tensor]],
                    full: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int,
                    where: str) -> int:
    """Copy this rank's slice of every full tensor into its parameter; returns how many were
    set. ValueError naming `where` and every parameter that is missing or has the wrong shape."""
    return load_sharded_state(named_params, {n: [whole(t)] for n, t in full.items()}, tp_rank,
                              tp_size, where)


@torch.no_grad()
def load_sharded_state(named_params: Iterable[tuple[str, torch.Tensor]],
                       shards: Mapping[str, list[dict]], tp_rank: int, tp_size: int,
                       where: str) -> int:
    """As load_full_state, from shards ({global name: [shard, ...]}, any split)."""
    named = list(named_params)
    problems = shape_problems(named, shards, tp_size)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more"
                                           if len(problems) > 8 else "")
        raise ValueError(f"{where}: does not fit this model: {shown}")
    for name, param in named:
        shard_view(param, param).copy_(local_part(name, shards[name], param, tp_rank,
                                                  tp_size).to(param.dtype))
    return len(named)


def shape_problems(named_params, shards: Mapping[str, list[dict]], tp_size: int) -> list[str]:
    """Parameters missing from `shards`, saved with another full shape or as tensors that are
    not floating point (any float type loads: the precision may differ)."""
    problems = []
    for name, param in named_params:
        if not shards.get(name):
            problems.append(f"{name}: missing")
            continue
        problems += state_problems(name, shards[name], param, tp_size)
    return problems


def state_problems(name: str, shards: list[dict], like: torch.Tensor,
                   tp_size: int) -> list[str]:
    """What is wrong with the saved shards of a tensor that must be shaped like parameter
    `like`'s full tensor and floating point (a parameter, an Adam moment, a main weight)."""
    dtypes = sorted({str(s["tensor"].dtype) for s in shards
                     if not s["tensor"].is_floating_point()})
    if dtypes:
        return [f"{name}: dtype {', '.join(dtypes)}, the model needs a floating-point tensor "
                f"({like.dtype})"]
    want, have = full_shape(like, tp_size), saved_shape(shards)
    return [f"{name}: shape {have}, the model needs {want}"] if have != want else []
