"""Execution-plan instructions: the ordered work of one pipeline rank for one iteration.

Conventions shared by lowering, the plan checker, serialisation and the Megatron handlers:
* `stage` is always the (virtual) stage that *this* rank computes the instruction for: a send of
  activations names the producing stage, the matching receive names the consuming stage; a send
  of gradients names the stage whose backward produced them, the receive the stage that uses them.
* `peer` is the pipeline rank on the other side; `buffer` names the tensors that a receive fills
  or that a send reads, and a FreeBuffer releases it. Transfers carry their tensor shapes and dtype
  (T5 stages after the encoder move two tensors: encoder output and decoder hidden state), so a
  variable-shape exchange needs no metadata messages.
* Start posts a non-blocking op; Finish waits for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Instruction:
    mb: int  # micro-batch index within this replica's micro-batch list


@dataclass(frozen=True)
class LoadInput(Instruction):
    """Load micro-batch `mb`'s tensors (tokens, positions, masks, labels) on this rank."""


@dataclass(frozen=True)
class Forward(Instruction):
    stage: int
    recompute: str = "none"


@dataclass(frozen=True)
class Backward(Instruction):
    stage: int


@dataclass(frozen=True)
class Transfer(Instruction):
    stage: int
    peer: int
    buffer: int
    shapes: tuple[Shape, ...] = field(default=())
    dtype: str = "float32"


@dataclass(frozen=True)
class SendActivationStart(Transfer): pass


@dataclass(frozen=True)
class SendActivationFinish(Transfer): pass


@dataclass(frozen=True)
class RecvActivationStart(Transfer): pass


@dataclass(frozen=True)
class RecvActivationFinish(Transfer): pass


@dataclass(frozen=True)
class SendGradStart(Transfer): pass


@dataclass(frozen=True)
class SendGradFinish(Transfer): pass


@dataclass(frozen=True)
class RecvGradStart(Transfer): pass


@dataclass(frozen=True)
class RecvGradFinish(Transfer): pass


@dataclass(frozen=True)
class FreeBuffer(Instruction):
    buffer: int


@dataclass(frozen=True)
class ExecutionPlan:
    """Everything one pipeline rank of one data-parallel replica runs in one iteration."""

    iteration: int
    dp_rank: int
    pp_rank: int
    stage_to_rank: tuple[int, ...]
    schedule: str
    micro_batches: tuple  # tuple[MicroBatch, ...] of this replica, indexed by Instruction.mb
    instructions: tuple[Instruction, ...]
    dtype: str = "float32"
    # loss tokens of the whole global batch, all replicas: the denominator of the
    # token-weighted loss, which the planner sees whole and each rank would otherwise count
    # over samples it does not train on (0: the planner was not told)
    loss_tokens: int = 0
