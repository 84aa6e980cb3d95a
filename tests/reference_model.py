"""The single-process reference every parallel plan must match: the whole global batch as one
unsplit micro-batch (each sample in its own row, padded to the longest) through the uncut model,
loss = sum of token losses / loss tokens. Also gathers a parallel run's gradients back to full,
unsharded tensors keyed by global parameter name, so the two can be compared."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dynapipe_ext.costs.model_spec import ModelSpec
from megatron.model.batch_tensors import build_micro_batch, count_loss_tokens, unsplit_micro_batch
from megatron.model.init_weights import initialize_stage_weights
from megatron.model.stages import build_rank_stages, build_transformer_config, stage_parameters


def reference_loss_and_grads(spec: ModelSpec, samples: Mapping[int, tuple],
                             sample_ids: Sequence[int], seed: int, pad_id: int = 0,
                             dtype: str = "float32", tie_embeddings: bool = True
                             ) -> tuple[float, dict[str, np.ndarray]]:
    """Token-weighted mean loss of the global batch and the gradient of every parameter
    (`tie_embeddings` False: an output layer of its own). Needs an initialised TP=1, PP=1
    megatron-core world (setup_model_parallel(1, 1))."""
    if parallel_state.get_tensor_model_parallel_world_size() != 1 or \
            parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise RuntimeError("the reference runs in a TP=1, PP=1 world")
    stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec, dtype=dtype),
                               tie_embeddings=tie_embeddings)
    initialize_stage_weights(stages, seed)
    mb = unsplit_micro_batch(sample_ids, samples, spec.model)
    batch = build_micro_batch(mb, samples, spec.model, pad_id)
    token_losses = stages[0]((), batch)
    loss = (token_losses.float() * batch["loss_mask"]).sum() / count_loss_tokens(samples,
                                                                                  sample_ids)
    loss.backward()
    grads = {name: p.grad.detach().float().cpu().numpy().copy()
             for name, p in stage_parameters(stages)}
    return loss.item(), grads


def _full_tp_tensor(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """All-gather a tensor-parallel shard along its partition dim (no-op if replicated)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return grad
    parts = [torch.empty_like(grad) for _ in range(tp)]
    dist.all_gather(parts, grad.contiguous(),
                    group=parallel_state.get_tensor_model_parallel_group())
    if getattr(param, "gated_halves", False):   # [gate_i; up_i] per rank -> [gate; up]
        halves = [torch.chunk(p, 2, dim=param.partition_dim) for p in parts]
        parts = [h[0] for h in halves] + [h[1] for h in halves]
    return torch.cat(parts, dim=param.partition_dim)


def gather_full_grads(rank_stages) -> dict[str, np.ndarray]:
    """Every parameter's full gradient by global name, on every rank (a test / debugging tool:
    it moves all gradients through all_gather_object). Raises if data-parallel replicas
    disagree, i.e. if the gradient all-reduce was skipped."""
    local = {}
    for name, param in stage_parameters(rank_stages):
        grad = getattr(param, "main_grad", None)   # GradBuffer's fp32 gradient, if any
        grad = param.grad if grad is None else grad
        grad = torch.zeros_like(param) if grad is None else grad
        local[name] = _full_tp_tensor(param, grad.detach()).float().cpu().numpy()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    full: dict[str, np.ndarray] = {}
    for rank, grads in enumerate(everyone):
        for name, value in grads.items():
            if name in full and not np.array_equal(full[name], value):
                raise RuntimeError(f"gradient of {name} differs between ranks (rank {rank}); "
                                   "data-parallel gradients were not all-reduced")
            full.setdefault(name, value)
    return full
