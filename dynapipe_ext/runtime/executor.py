"""Executor: walks one rank's ExecutionPlan and calls a handler per instruction type.

A dispatch table and nothing more (the schedule logic lives in lowering): handlers are given
at construction, every instruction type a plan may hold must have one, and a failing handler
is re-raised as InstructionError naming the rank, instruction index and instruction.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

from dynapipe_ext.plan.instructions import (Backward, ExecutionPlan, Forward, FreeBuffer, Instruction, LoadInput,
                           RecvActivationFinish, RecvActivationStart, RecvGradFinish,
                           RecvGradStart, SendActivationFinish, SendActivationStart,
                           SendGradFinish, SendGradStart)

INSTRUCTION_TYPES: tuple[type[Instruction], ...] = (
    LoadInput, Forward, Backward,
    SendActivationStart, SendActivationFinish, RecvActivationStart, RecvActivationFinish,
    SendGradStart, SendGradFinish, RecvGradStart, RecvGradFinish,
    FreeBuffer)

Handler = Callable[[Instruction], None]
TimedInstruction = tuple[Instruction, float, float]


class InstructionError(RuntimeError):
    """A handler failed; `rank`, `index` and `instruction` say where, __cause__ says why."""

    def __init__(self, rank: int, index: int, instruction: Instruction, cause: BaseException):
        super().__init__(f"rank {rank}, instruction {index} ({instruction}) failed: "
                         f"{type(cause).__name__}: {cause}")
        self.rank = rank
        self.index = index
        self.instruction = instruction


class Executor:
    """Runs plans by looking each instruction's exact type up in `handlers`."""

    def __init__(self, handlers: Mapping[type[Instruction], Handler],
                 instruction_types: tuple[type[Instruction], ...] = INSTRUCTION_TYPES):
        missing = [t.__name__ for t in instruction_types if t not in handlers]
        if missing:
            raise ValueError(f"Executor has no handler for instruction type(s): "
                             f"{', '.join(missing)}")
        not_callable = [t.__name__ for t, h in handlers.items() if not callable(h)]
        if not_callable:
            raise ValueError(f"handlers for {', '.join(not_callable)} are not callable")
        self._handlers = dict(handlers)

    def run(self, plan: ExecutionPlan, record_times: bool = False) -> list[TimedInstruction]:
        """Execute `plan` in order. With `record_times`, return (instruction, start_s, end_s)
        per instruction (time.perf_counter seconds); otherwise an empty list."""
        handlers = self._handlers
        records: list[TimedInstruction] = []
        clock = time.perf_counter
        for index, instruction in enumerate(plan.instructions):
            handler = handlers.get(type(instruction))
            if handler is None:
                raise InstructionError(plan.pp_rank, index, instruction,
                                       TypeError(f"no handler for {type(instruction).__name__}"))
            start = clock() if record_times else 0.0
            try:
                handler(instruction)
            except Exception as exc:
                raise InstructionError(plan.pp_rank, index, instruction, exc) from exc
            if record_times:
                records.append((instruction, start, clock()))
        return records
