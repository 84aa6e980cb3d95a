"""Where an iteration's time goes (megatron/training/step_timing.py): every second of the
iteration lands in exactly one part, executor instructions by their type."""
import time

import pytest

from dynapipe_ext.plan.instructions import (Backward, Forward, FreeBuffer, LoadInput,
                                       RecvActivationFinish, RecvActivationStart,
                                       SendGradFinish)
from megatron.training.step_timing import PARTS, StepClock, add_parts, host_share, shares_line


class GivenClock:
    """Wall and CPU time that move only when the test says (StepClock's now / cpu_now)."""

    def __init__(self):
        self.wall, self.cpu = 100.0, 7.0

    def now(self) -> float:
        return self.wall

    def cpu_now(self) -> float:
        return self.cpu

    def passes(self, seconds: float, cpu: float = 0.0) -> None:
        self.wall += seconds
        self.cpu += cpu


def run_instructions(given: GivenClock, durations, gap: float):
    """Executor records of (instruction, seconds) run back to back with `gap` between them
    (the executor loop's own time), moving the given clock past the last one."""
    records = []
    for instr, seconds in durations:
        given.passes(gap)
        start = given.wall
        given.passes(seconds)
        records.append((instr, start, given.wall))
    given.passes(gap)
    return records


def test_executor_records_are_booked_by_instruction_type():
    given = GivenClock()
    clock = StepClock(given.now, given.cpu_now)
    given.passes(0.002, cpu=0.001)
    clock.lap("plan_wait")
    shapes = ((4, 1, 8),)
    durations = [(LoadInput(0), 0.003),
                 (RecvActivationStart(0, stage=1, peer=0, buffer=0, shapes=shapes,
                                      dtype="float32"), 0.001),
                 (RecvActivationFinish(0, stage=1, peer=0, buffer=0, shapes=shapes,
                                       dtype="float32"), 0.004),
                 (Forward(0, stage=1), 0.010),
                 (Backward(0, stage=1), 0.020),
                 (SendGradFinish(0, stage=1, peer=0, buffer=1, shapes=shapes,
                                 dtype="float32"), 0.005),
                 (FreeBuffer(0, buffer=0), 0.001)]
    records = run_instructions(given, durations, gap=0.0005)
    given.cpu += 0.044                       # the executor thread's CPU time meanwhile
    # 3 ms of the forward were spent waiting for the micro-batch tensors: host time
    clock.add_executor(records, batch_wait_s=0.003)
    given.passes(0.002, cpu=0.002)
    clock.lap("optimizer")
    parts = clock.parts
    assert set(parts) == set(PARTS)
    assert parts["forward"] == pytest.approx(0.010 - 0.003, abs=1e-12)
    assert parts["backward"] == pytest.approx(0.020, abs=1e-12)
    assert parts["transfer_wait"] == pytest.approx(0.004 + 0.005, abs=1e-12)
    # LoadInput, the receive start, the free, the forward's tensor wait and the loop's 8 gaps
    assert parts["host"] == pytest.approx(0.003 + 0.001 + 0.001 + 0.003 + 8 * 0.0005,
                                          abs=1e-12)
    assert parts["plan_wait"] == pytest.approx(0.002, abs=1e-12)
    assert parts["optimizer"] == pytest.approx(0.002, abs=1e-12)
    assert parts["sync_wait"] == 0.0
    # the executor's main-thread CPU time, not that of the laps outside it
    assert clock.executor_cpu_s == pytest.approx(0.044, abs=1e-12)


def test_parts_add_up_to_the_wall_time():
    given = GivenClock()
    clock = StepClock(given.now, given.cpu_now)
    given.passes(0.003)
    clock.lap("sync_wait")
    clock.add_executor(run_instructions(given, [(Forward(0, stage=0), 0.004)], gap=0.0002))
    given.passes(0.001)
    clock.lap("host")
    assert clock.elapsed == pytest.approx(0.003 + 0.004 + 0.0004 + 0.001, abs=1e-12)
    assert sum(clock.parts.values()) == pytest.approx(clock.elapsed, abs=1e-12)
    assert clock.parts["forward"] == pytest.approx(0.004, abs=1e-12)


def test_the_real_clocks_by_default():
    """Without injected clocks StepClock reads perf_counter and the thread's CPU time."""
    clock = StepClock()
    assert clock.now is time.perf_counter and clock.cpu_now is time.thread_time
    clock.lap("host")
    assert clock.parts["host"] >= 0 and clock.elapsed == clock.parts["host"]


def test_host_share_and_the_summary_line():
    parts = dict.fromkeys(PARTS, 0.0)
    parts.update(forward=3.0, backward=5.0, transfer_wait=1.0, host=0.6, plan_wait=0.4)
    assert host_share(parts) == pytest.approx(0.1)
    assert host_share(add_parts(parts, parts)) == pytest.approx(0.1)
    line = shares_line(parts)
    assert line.startswith("host overhead 10.00%") and "backward 50.0%" in line
    assert host_share({}) == 0.0
