"""Where an iteration's time goes (megatron/training/step_timing.py): every second of the
iteration lands in exactly one part, executor instructions by their type."""
import time

import pytest

from dynapipe_ext.instructions import (Backward, Forward, FreeBuffer, LoadInput,
                                       RecvActivationFinish, RecvActivationStart,
                                       SendGradFinish)
from megatron.training.step_timing import PARTS, StepClock, add_parts, host_share, shares_line


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def timed(instr, seconds):
    start = time.perf_counter()
    spin(seconds)
    return instr, start, time.perf_counter()


def test_executor_records_are_booked_by_instruction_type():
    clock = StepClock()
    spin(0.002)
    clock.lap("plan_wait")
    records = [timed(LoadInput(0), 0.003),
               timed(RecvActivationStart(0, stage=1, peer=0, buffer=0, shapes=((4, 1, 8),),
                                         dtype="float32"), 0.001),
               timed(RecvActivationFinish(0, stage=1, peer=0, buffer=0, shapes=((4, 1, 8),),
                                          dtype="float32"), 0.004),
               timed(Forward(0, stage=1), 0.010),
               timed(Backward(0, stage=1), 0.020),
               timed(SendGradFinish(0, stage=1, peer=0, buffer=1, shapes=((4, 1, 8),),
                                    dtype="float32"), 0.005),
               timed(FreeBuffer(0, buffer=0), 0.001)]
    # 3 ms of the forward were spent waiting for the micro-batch tensors: host time
    clock.add_executor(records, batch_wait_s=0.003)
    spin(0.002)
    clock.lap("optimizer")
    took = {type(i).__name__: end - start for i, start, end in records}
    parts = clock.parts
    assert set(parts) == set(PARTS)
    assert parts["forward"] == pytest.approx(took["Forward"] - 0.003)
    assert parts["backward"] == pytest.approx(took["Backward"])
    assert parts["transfer_wait"] == pytest.approx(took["RecvActivationFinish"]
                                                   + took["SendGradFinish"])
    # LoadInput, the receive start, the free, the forward's tensor wait and the loop's gaps
    others = took["LoadInput"] + took["RecvActivationStart"] + took["FreeBuffer"] + 0.003
    assert others <= parts["host"] < others + 0.02      # (gaps: microseconds unless descheduled)
    assert parts["plan_wait"] >= 0.002 and parts["optimizer"] >= 0.002
    assert parts["sync_wait"] == 0.0
    # the executor's main-thread CPU time: the 44 ms of spinning above (less if this process
    # was descheduled meanwhile), not the laps outside it
    assert 0.01 < clock.executor_cpu_s < sum(took.values()) + 0.001


def test_parts_add_up_to_the_wall_time():
    start = time.perf_counter()
    clock = StepClock()
    spin(0.003)
    clock.lap("sync_wait")
    clock.add_executor([timed(Forward(0, stage=0), 0.004)])    # the loop itself: host
    spin(0.001)
    clock.lap("host")
    wall = time.perf_counter() - start
    assert sum(clock.parts.values()) == pytest.approx(wall, abs=1e-4)


def test_host_share_and_the_summary_line():
    parts = dict.fromkeys(PARTS, 0.0)
    parts.update(forward=3.0, backward=5.0, transfer_wait=1.0, host=0.6, plan_wait=0.4)
    assert host_share(parts) == pytest.approx(0.1)
    assert host_share(add_parts(parts, parts)) == pytest.approx(0.1)
    line = shares_line(parts)
    assert line.startswith("host overhead 10.00%") and "backward 50.0%" in line
    assert host_share({}) == 0.0
