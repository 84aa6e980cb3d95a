"""Where one iteration's wall time goes on this rank: the host-overhead measurement of issue 11.

Parts, in seconds of one iteration on one rank (they add up to the iteration time):
* forward / backward: the Forward / Backward handlers (stage compute, autograd, the loss), less
  the time they waited for micro-batch tensors;
* transfer_wait: the Send/Recv Finish handlers, i.e. waiting for point-to-point transfers (the
  pipeline bubble and any imbalance between stages show up here);
* sync_wait: collectives outside the executor, where a rank waits for the others (plan
  agreement, data-parallel gradient reduction, global loss);
* optimizer: gradient norm (with its model-parallel all-reduce), clipping and the AdamW step;
* plan_wait: waiting for this iteration's plan;
* host: everything else, the runtime's own work on the critical path: checks, waiting for
  micro-batch tensors, posting transfers, the executor's loop, bookkeeping.

`host_share` = (host + plan_wait) / iteration: what the runtime spends outside forward /
backward compute, transfer and collective waits and the optimizer step.

`executor_cpu_s`: CPU time of the main thread while the executor ran (compute and the
runtime's own work, not the waits): on a shared machine, where other processes stretch wall
times, it still measures the work a rank did.
"""
from __future__ import annotations

import time

from dynapipe_ext.plan.instructions import (Backward, Forward, RecvActivationFinish,
                                       RecvGradFinish, SendActivationFinish, SendGradFinish)

PARTS = ("forward", "backward", "transfer_wait", "sync_wait", "optimizer", "plan_wait", "host")
EXECUTOR_PARTS = {Forward: "forward", Backward: "backward",
                  SendActivationFinish: "transfer_wait", SendGradFinish: "transfer_wait",
                  RecvActivationFinish: "transfer_wait", RecvGradFinish: "transfer_wait"}


class StepClock:
    """Splits wall time into PARTS: `lap(part)` books the time since the previous lap.
    `now` / `cpu_now` read the wall clock and this thread's CPU time (injectable, so the
    bookkeeping is tested with given times, not with whatever a loaded machine measures)."""

    def __init__(self, now=time.perf_counter, cpu_now=time.thread_time):
        self.now, self.cpu_now = now, cpu_now
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.executor_cpu_s = 0.0
        self._last = self._started = now()
        self._last_cpu = cpu_now()

    @property
    def elapsed(self) -> float:
        """Seconds from the clock's start to its last lap: the sum of the parts."""
        return self._last - self._started

    def lap(self, part: str) -> None:
        """Book the time since the previous lap (or add_executor) to `part`."""
        now = self.now()
        self.parts[part] += now - self._last
        self._last = now
        self._last_cpu = self.cpu_now()

    def add_executor(self, records, batch_wait_s: float = 0.0) -> None:
        """Book one Executor.run's (instruction, start, end) records, which must cover the time
        since the last lap: each instruction's time to its part (others, and the loop between
        instructions, to host); `batch_wait_s` of forward time (waiting for micro-batch
        tensors) moves to host."""
        now = self.now()
        total = now - self._last
        booked = 0.0
        for instr, start, end in records:
            part = EXECUTOR_PARTS.get(type(instr))
            if part is not None:
                self.parts[part] += end - start
                booked += end - start
        wait = min(batch_wait_s, self.parts["forward"])
        self.parts["forward"] -= wait
        self.parts["host"] += total - booked + wait
        self._last = now
        cpu = self.cpu_now()
        self.executor_cpu_s += cpu - self._last_cpu
        self._last_cpu = cpu


def add_parts(total: dict, parts: dict) -> dict:
    """Sum of two parts dicts (missing parts count 0)."""
    return {p: total.get(p, 0.0) + parts.get(p, 0.0) for p in PARTS}


def host_share(parts: dict) -> float:
    """(host + plan wait) / iteration time of a parts dict (one iteration or a sum)."""
    total = sum(parts.get(p, 0.0) for p in PARTS)
    return (parts.get("host", 0.0) + parts.get("plan_wait", 0.0)) / total if total > 0 else 0.0


def shares_line(parts: dict) -> str:
    """'forward 31.0% | backward 52.1% | ...' of a parts dict, host share first."""
    total = sum(parts.get(p, 0.0) for p in PARTS) or 1.0
    shown = " | ".join(f"{p.replace('_', ' ')} {100 * parts.get(p, 0.0) / total:.1f}%"
                       for p in PARTS)
    return f"host overhead {100 * host_share(parts):.2f}% ({shown})"
