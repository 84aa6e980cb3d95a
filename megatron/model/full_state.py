"""Layout-free model state: {global parameter name: full (unsplit) tensor}.

One representation of a model's weights that does not depend on TP or PP. A rank holds the
tensor-parallel slices of its stages' parameters (see stages.StageModule.global_name); a
checkpoint stores those slices as *shards* that name where they sit in the full tensor, so any
layout can reassemble what it needs; a converted Hugging Face checkpoint is one shard per
parameter (the full tensor).

A shard is a plain dict (weights_only-loadable): {"tensor", "dim", "index", "count"}: `tensor`
is chunk `index` of `count` equal chunks of the full tensor along `dim` (dim -1 and count 1
for an unsplit parameter).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from megatron.model.init_weights import full_shape, tp_slice


def local_shards(named_params: Iterable[tuple[str, torch.Tensor]], tp_rank: int,
                 tp_size: int) -> dict[str, dict]:
    """The shards this rank holds, keyed by global name (tensors detached, on the CPU)."""
    shards = {}
    for name, param in named_params:
        split = getattr(param, "tensor_model_parallel", False) and tp_size > 1
        shards[name] = {"tensor": param.detach().cpu(),
                        "dim": int(param.partition_dim) if split else -1,
                        "index": tp_rank if split else 0,
                        "count": tp_size if split else 1}
    return shards


def assemble(name: str, shards: list[dict]) -> torch.Tensor:
    """The full tensor of parameter `name` from its shards (any order; duplicates of the
    same chunk, e.g. from several DP replicas, are allowed). ValueError naming the parameter
    when chunks are missing or disagree on how the tensor is split."""
    if not shards:
        raise ValueError(f"parameter {name}: no shard of it was saved")
    layouts = {(s["dim"], s["count"]) for s in shards}
    if len(layouts) != 1:
        raise ValueError(f"parameter {name}: shards split it in different ways: "
                         f"{sorted(layouts)}")
    dim, count = layouts.pop()
    chunks = {s["index"]: s["tensor"] for s in shards}
    missing = sorted(set(range(count)) - set(chunks))
    if missing:
        raise ValueError(f"parameter {name}: chunks {missing} of {count} are missing")
    if count == 1:
        return chunks[0]
    return torch.cat([chunks[i] for i in range(count)], dim=dim)


@torch.no_grad()
def load_full_state(named_params: Iterable[tuple[str, torch.Tensor]],
                    full: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int,
                    where: str) -> int:
    """Copy this rank's slice of every full tensor into its parameter; returns how many were
    set. ValueError naming `where` and every parameter that is missing or has the wrong shape."""
    problems, count = [], 0
    for name, param in named_params:
        if name not in full:
            problems.append(f"{name}: missing")
            continue
        want = full_shape(param, tp_size)
        if tuple(full[name].shape) != want:
            problems.append(f"{name}: shape {tuple(full[name].shape)}, the model needs {want}")
            continue
        param.copy_(tp_slice(full[name], param, tp_rank, tp_size).to(param.dtype))
        count += 1
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more"
                                           if len(problems) > 8 else "")
        raise ValueError(f"{where}: does not fit this model: {shown}")
    return count
