"""PlanAhead: background planning gives the same plans as inline planning, in order, and every
failure (exception, stall, killed worker) is a clear error instead of a hang."""
import hashlib
import os
import signal
import time

import numpy as np
import pytest

from dynapipe_ext.runtime.plan_ahead import (PlanAhead, PlanningFailed, PlanningTimeout,
                                     default_num_workers)


def lengths_of(iteration: int) -> np.ndarray:
    return np.random.default_rng(1000 + iteration).integers(8, 512, size=200)


def digest_plan(iteration: int, lengths) -> bytes:
    """A pure stand-in planner: bytes that depend on every input value."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    return iteration.to_bytes(4, "little") + hashlib.sha256(order.tobytes()).digest()


def failing_plan(iteration: int, lengths) -> bytes:
    if iteration == 3:
        raise ValueError(f"no feasible split for {len(lengths)} samples")
    return digest_plan(iteration, lengths)


def stalling_plan(iteration: int, lengths) -> bytes:
    if iteration == 2:
        time.sleep(120)
    return digest_plan(iteration, lengths)


def dying_plan(iteration: int, lengths) -> bytes:
    if iteration == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return digest_plan(iteration, lengths)


def niceness_plan(iteration: int, lengths) -> int:
    return os.nice(0)


def test_workers_plan_at_a_lower_cpu_priority_than_the_trainer():
    from dynapipe_ext.runtime.plan_ahead import PLANNER_NICE
    with PlanAhead(niceness_plan, lengths_of, num_workers=1, prefetch=1).start(0) as planner:
        worker_nice = planner.get(0).value
    assert worker_nice == min(19, os.nice(0) + PLANNER_NICE)


def collect(planner: PlanAhead, first: int, count: int) -> list[bytes]:
    return [planner.get(i).value for i in range(first, first + count)]


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_give_the_same_plans_as_inline(workers):
    with PlanAhead(digest_plan, lengths_of, num_workers=0).start(0) as inline:
        expected = collect(inline, 0, 8)
    with PlanAhead(digest_plan, lengths_of, num_workers=workers, prefetch=3).start(0) as pool:
        got = collect(pool, 0, 8)
    assert got == expected
    assert [g[:4] for g in got] == [i.to_bytes(4, "little") for i in range(8)]


def test_resume_at_iteration_k_matches_uninterrupted_run():
    with PlanAhead(digest_plan, lengths_of, num_workers=0).start(0) as full:
        uninterrupted = collect(full, 0, 9)
    with PlanAhead(digest_plan, lengths_of, num_workers=1, prefetch=2).start(5) as resumed:
        assert collect(resumed, 5, 4) == uninterrupted[5:]


def test_get_reports_wait_and_planning_time():
    with PlanAhead(digest_plan, lengths_of, num_workers=1, prefetch=2).start(0) as planner:
        first = planner.get(0)
        # "training" until the next plan is finished (a fixed sleep is not enough for a
        # worker process on a loaded machine)
        deadline = time.monotonic() + 60
        while not planner.is_ready(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert planner.is_ready(1)
        second = planner.get(1)
    assert first.wait_s >= 0 and first.plan_s > 0
    assert second.wait_s < 0.1     # a finished plan is handed over without waiting


def test_prefetch_bounds_submitted_iterations():
    submitted = []

    def recording_lengths(iteration):
        submitted.append(iteration)
        return lengths_of(iteration)

    with PlanAhead(digest_plan, recording_lengths, num_workers=1, prefetch=2).start(4) as planner:
        assert submitted == [4, 5, 6]
        planner.get(4)  # while iteration 4 trains, 5 and 6 are planned
        assert submitted == [4, 5, 6]
        planner.get(5)
        assert submitted == [4, 5, 6, 7]


def test_stop_iteration_is_never_planned():
    submitted = []

    def recording_lengths(iteration):
        submitted.append(iteration)
        return lengths_of(iteration)

    with PlanAhead(digest_plan, recording_lengths, num_workers=1, prefetch=4).start(0, 2) as p:
        collect(p, 0, 2)
        with pytest.raises(ValueError, match="past stop_iteration"):
            p.get(2)
    assert submitted == [0, 1]


def test_out_of_order_get_is_an_error():
    with PlanAhead(digest_plan, lengths_of, num_workers=0).start(0) as planner:
        with pytest.raises(ValueError, match="expected iteration 0, got 1"):
            planner.get(1)


@pytest.mark.parametrize("workers", [0, 1])
def test_planner_exception_reaches_trainer_in_one_line_with_its_traceback_beside(workers):
    with PlanAhead(failing_plan, lengths_of, num_workers=workers, prefetch=2).start(0) as p:
        assert len(collect(p, 0, 3)) == 3  # the iterations before the failure still arrive
        with pytest.raises(PlanningFailed) as err:
            p.get(3)
    assert err.value.iteration == 3
    assert "iteration 3" in str(err.value)
    assert str(err.value).endswith("failed: ValueError: no feasible split for 200 samples") \
        or str(err.value).endswith("worker: ValueError: no feasible split for 200 samples")
    assert "\n" not in str(err.value)     # the traceback was flattened into the error line
    assert "failing_plan" in err.value.detail  # the worker's traceback text, for --debug


def test_stalled_planner_times_out_naming_the_iteration():
    start = time.monotonic()
    with PlanAhead(stalling_plan, lengths_of, num_workers=1, prefetch=1, timeout_s=1.0) as p:
        p.start(0)
        p.get(0)
        p.get(1)
        with pytest.raises(PlanningTimeout, match=r"iteration 2 was not ready after 1 s"):
            p.get(2)
    assert time.monotonic() - start < 30  # close() killed the stuck worker


def test_killed_worker_is_an_error_not_a_hang():
    start = time.monotonic()
    with PlanAhead(dying_plan, lengths_of, num_workers=1, prefetch=1, timeout_s=60.0) as p:
        p.start(0)
        p.get(0)
        p.get(1)
        with pytest.raises(PlanningFailed, match=r"died with exit code -9 while planning "
                                                 r"iteration 2"):
            p.get(2)
    assert time.monotonic() - start < 30


def test_default_worker_count_follows_cores():
    assert default_num_workers(2) == 1
    assert default_num_workers(16) == 4
    assert default_num_workers(256) == 8
    assert default_num_workers() >= 1


def test_timeout_does_not_count_worker_start_up():
    """Even a tiny timeout passes when plans are quick: spawning workers is not a stall."""
    with PlanAhead(digest_plan, lengths_of, num_workers=2, prefetch=1, timeout_s=0.5) as p:
        p.start(0)
        assert len(collect(p, 0, 3)) == 3


def test_is_ready_only_for_the_next_finished_iteration():
    with PlanAhead(digest_plan, lengths_of, num_workers=1, prefetch=2).start(0) as p:
        deadline = time.monotonic() + 30
        while not p.is_ready(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.is_ready(0)
        assert not p.is_ready(1)  # not the next one in order
        p.get(0)
    with PlanAhead(digest_plan, lengths_of, num_workers=0).start(0) as inline:
        assert not inline.is_ready(0)


def test_a_dead_workers_exit_code_is_asked_for_until_it_shows():
    """The sentinel of a killed worker fires a moment before its exit status is known; the
    status is asked for again (the message said 'exit code None' on a loaded machine), and
    None comes back only after the limit."""
    from dynapipe_ext.runtime.plan_ahead import exit_code_of_ended

    class Ending:
        reads = 0

        @property
        def exitcode(self):
            self.reads += 1
            return None if self.reads < 4 else -9

    ending = Ending()
    assert exit_code_of_ended(ending) == -9 and ending.reads == 4

    class Never:
        exitcode = None

    assert exit_code_of_ended(Never(), limit_s=0.05) is None
