"""--use-distributed-optimizer: TrainOptimizer with its fp32 state sharded over data parallel.

The gradient buffer (grad_buffer.GradBuffer with shard=True) reduce-scatters each bucket, so
data-parallel rank r holds the summed gradient of the r-th slice of every bucket. This optimizer
keeps fp32 main weights and both Adam moments for those slices only: a *piece* is the part of
one parameter that falls into this rank's slice of its bucket (a parameter may be split over
two ranks at a slice boundary). AdamW is elementwise, so stepping the pieces is stepping the
whole parameters; the gradient norm is summed over the pieces, then over data parallel and
the model-parallel group. After the step the pieces are written to the parameter buffer and
all-gathered (GradBuffer.start_param_gather).

Per rank this keeps 4 (fp32 main, bf16 runs only) + 8 (moments) bytes per parameter / DP,
against the same without the division in TrainOptimizer; weights and main gradients stay whole.
Checkpoints are those of TrainOptimizer: saving all-gathers each state tensor over data parallel
into whole parameters (a moment at a time), so a checkpoint resumes at any DP size, with or
without the flag, and at any TP / PP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.model.full_state import local_part, shard_of
from megatron.training.optimizer import (ADAM_MOMENTS, TrainOptimizer, no_weight_decay)


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of parameter `index` (flattened), at [lo + offset, hi + offset) of
    the gradient and parameter buffers."""

    index: int
    lo: int
    hi: int
    offset: int

    @property
    def span(self) -> slice:
        return slice(self.offset + self.lo, self.offset + self.hi)


def owned_pieces(grad_buffer, params) -> list[Piece]:
    """This data-parallel rank's pieces of `params`, in parameter order."""
    index = {id(p): i for i, p in enumerate(params)}
    pieces = []
    for bucket in grad_buffer.buckets:
        lo, hi = grad_buffer.owned(bucket)
        for param in bucket.params:
            offset = grad_buffer.offsets[id(param)]
            start, end = max(lo, offset), min(hi, offset + param.numel())
            if start < end and id(param) in index:
                pieces.append(Piece(index[id(param)], start - offset, end - offset, offset))
    return sorted(pieces, key=lambda piece: (piece.index, piece.lo))


class ShardedOptimizer(TrainOptimizer):
    """AdamW over this data-parallel rank's pieces of its parameters (module docstring);
    `dp_group` is the data-parallel group the gradient buffer shards over."""

    def __init__(self, named_params, cfg, tp_rank: int = 0, norm_group=None,
                 grad_buffer=None, dp_group=None):
        if grad_buffer is None or not grad_buffer.shard:
            raise ValueError("the sharded optimizer needs a GradBuffer made with shard=True")
        self.dp_group = dp_group
        self._stepped = False       # state exists (a step was taken or state loaded)
        super().__init__(named_params, cfg, tp_rank, norm_group, grad_buffer)

    def _main_weights(self, named):
        buf = self.grad_buffer
        self.pieces = owned_pieces(buf, self.model_params)
        fp32 = buf.param_data.dtype == torch.float32
        # fp32: the main weight is the parameter buffer's own slice, stepped in place
        main = [buf.param_data[piece.span] if fp32 else buf.param_data[piece.span].float()
                for piece in self.pieces]
        self._half = [] if fp32 else [(buf.param_data[piece.span], m)
                                      for piece, m in zip(self.pieces, main)]
        grads = [buf.data[piece.span] for piece in self.pieces]
        decayed = [not no_weight_decay(*named[piece.index]) for piece in self.pieces]
        return main, grads, decayed

    def _owners(self, named):
        return [named[piece.index] for piece in self.pieces]

    @property
    def norm_groups(self) -> list:
        return [self.dp_group, self.norm_group]

    def step(self, iteration: int) -> dict:
        """TrainOptimizer.step on the pieces, then the all-gather of the updated parameters
        (left in flight with --overlap-param-gather)."""
        self.grad_buffer.wait_param_gather()     # the last step's, if a stage ran no forward
        result = super().step(iteration)
        self._stepped = True
        self.grad_buffer.start_param_gather()
        return result

    # ---- checkpoints: whole parameters, as TrainOptimizer saves them ----
    @torch.no_grad()
    def _gathered(self, values) -> torch.Tensor:
        """The buffer-shaped fp32 tensor whose owned slices hold `values` (one per piece),
        all-gathered over data parallel: every rank then has every parameter's value."""
        buf = self.grad_buffer
        full = torch.zeros_like(buf.data)
        for piece, value in zip(self.pieces, values):
            full[piece.span].copy_(value.view(-1))
        if buf.dp_size > 1:
            for bucket in buf.buckets:
                lo, hi = buf.owned(bucket)
                dist.all_gather_single(full[bucket.start:bucket.end], full[lo:hi].clone(),
                                       group=buf.dp_group)
        return full

    def _whole(self, full: torch.Tensor, param_index: int) -> torch.Tensor:
        param = self.model_params[param_index]
        offset = self.grad_buffer.offsets[id(param)]
        return full[offset:offset + param.numel()].view_as(param).clone()

    def sharded_state_dict(self, tp_rank: int, tp_size: int) -> dict[str, dict]:
        """TrainOptimizer's layout-free state (whole parameters' moments, step, fp32 main
        weights of a bf16 run). Collective over data parallel: every rank must call it; DP
        rank 0, which writes, always holds a piece (the first element of every bucket)."""
        if not self._stepped:
            return {}
        keys = list(ADAM_MOMENTS) + (["main"] if self._half else [])
        steps = [self.adam.state[m]["step"] for m in self.main_params] if self.adam else []
        state = {name: {} for name in self.names}
        for key in keys:
            values = (self.main_params if key == "main" else
                      [self.adam.state[m][key] for m in self.main_params])
            full = self._gathered(values)
            for i, (name, param) in enumerate(zip(self.names, self.model_params)):
                state[name][key] = shard_of(self._whole(full, i), param, tp_rank, tp_size)
            del full
        step = steps[0].detach().cpu() if steps else torch.zeros(())
        for entry in state.values():
            entry["step"] = step
        return state

    @torch.no_grad()
    def load_sharded_state_dict(self, shards: dict[str, list[dict]], tp_rank: int,
                                tp_size: int, where: str) -> None:
        """Restore TrainOptimizer-format state saved at any TP / DP, with or without
        sharding: each piece takes its slice of the whole parameter's saved tensors. No
        collective: every rank reads the whole parameters it holds."""
        if not self.saved_state_found(shards, where):
            return
        with_main = all("main" in e for name in self.names for e in shards[name])
        keys = list(ADAM_MOMENTS) + (["main"] if with_main else [])
        mine: dict[int, list] = {}
        for piece, m in zip(self.pieces, self.main_params):
            mine.setdefault(piece.index, []).append((piece, m))
        for i, (name, param) in enumerate(zip(self.names, self.model_params)):
            if i not in mine and not (with_main and self._half):
                continue
            entries = shards[name]
            part = {k: local_part(f"{name} ({k})", [e[k] for e in entries], param, tp_rank,
                                  tp_size).to(device=param.device, dtype=torch.float32)
                    for k in (keys if i in mine else ["main"])}
            for piece, m in mine.get(i, []):
                self.adam.state[m] = {k: part[k].reshape(-1)[piece.lo:piece.hi].clone()
                                      for k in ADAM_MOMENTS}
                self.adam.state[m]["step"] = entries[0]["step"].clone().to(m.device)
                if with_main:
                    m.copy_(part["main"].reshape(-1)[piece.lo:piece.hi])
            if with_main and self._half:    # the whole bf16 weight from the whole main
                param.copy_(part["main"].view_as(param))
        self._stepped = True
