"""Planning ahead of training: worker processes compute the plans of the next iterations while
the current one trains, so the trainer (ideally) never waits for a plan.

`PlanAhead(plan_fn, lengths_fn, ...)` runs `plan_fn(iteration, lengths_fn(iteration))` for up to
`prefetch` iterations after the one being trained. `lengths_fn` runs in the caller (it reads the
sampler, which need not be picklable); `plan_fn` runs in the workers and must be picklable (a
module-level function or a `functools.partial` of one). `plan_fn` must be pure: results do not
depend on which worker, or how many, computed them.

Failures are errors, never hangs: an exception in `plan_fn` comes back as `PlanningFailed` with
the worker's traceback; a plan not ready `timeout_s` after the trainer starts waiting for it (and
the workers are up: start-up has its own `startup_timeout_s`) is a `PlanningTimeout`; a worker
process that dies is a `PlanningFailed` naming it and its iteration. Inline mode
(`num_workers=0`) plans in `get()` itself, where no timeout applies.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

_POLL_S = 0.2          # how often idle workers and the collector look for shutdown / parent death
_JOIN_S = 2.0          # grace period for workers to exit before they are killed on close()
_REAP_S = 5.0          # most time an ended worker's exit status may take to show
# Workers run at a lower CPU priority than the trainer (os.nice): where training keeps the
# cores busy (CPU training, a core per rank), planning takes the idle moments (a pipeline
# rank waiting for its peer) instead of time slices of the ranks' compute; a plan that falls
# behind makes the trainer wait, which frees a core for it. No effect on idle cores.
PLANNER_NICE = 10


class PlanningFailed(RuntimeError):
    """Planning of `iteration` failed; the message says why in one line, `detail` holds the
    planner's traceback text (printed under the trainer's --debug)."""

    def __init__(self, iteration: int, message: str, detail: str | None = None):
        super().__init__(message)
        self.iteration = iteration
        self.detail = detail


def failure_line(traceback_text: str) -> str:
    """'Type: message' from the last line of a formatted traceback (the module path of the
    exception's type left out)."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "unknown error"
    kind, sep, message = last.partition(": ")
    return f"{kind.rsplit('.', 1)[-1]}{sep}{message}"


class PlanningTimeout(PlanningFailed):
    """The plan of `iteration` was not ready within the timeout."""


@dataclass(frozen=True)
class Planned:
    """A finished plan: `value` is what plan_fn returned; `wait_s` is how long `get()` blocked;
    `plan_s` is how long plan_fn ran in its worker."""

    iteration: int
    value: Any
    wait_s: float
    plan_s: float


def default_num_workers(cpu_count: int | None = None) -> int:
    """Planner workers for this machine: a quarter of the usable cores, at least 1, at most 8
    (the rest stay with data loading and, on CPU, the training threads)."""
    if cpu_count is None:
        try:
            cpu_count = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpu_count = os.cpu_count() or 1
    return max(1, min(8, cpu_count // 4))


def _planner_worker(plan_fn: Callable, tasks, results) -> None:
    """Body of one worker process: plan tasks from the shared queue until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    try:
        os.nice(PLANNER_NICE)
    except OSError:      # not permitted here: plan at the trainer's priority
        pass
    parent = mp.parent_process()
    import queue as queue_mod
    results.send(("ready", -1, os.getpid()))
    while True:
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue_mod.Empty:
            if parent is not None and not parent.is_alive():
                return  # the trainer died: do not linger as an orphan
            continue
        if task is None:
            return
        iteration, lengths = task
        results.send(("start", iteration, os.getpid()))
        start = time.perf_counter()
        try:
            value = plan_fn(iteration, lengths)
            results.send(("ok", iteration, value, time.perf_counter() - start))
        except BaseException:  # noqa: BLE001 - every failure goes back to the trainer
            text = traceback.format_exc()
            try:
                results.send(("error", iteration, text))
            except BaseException:  # noqa: BLE001 - e.g. the pipe is gone: nothing left to tell
                return


def exit_code_of_ended(proc, limit_s: float = _REAP_S):
    """The exit code of a process whose sentinel has fired. The sentinel (a pipe) closes as the
    process exits, a moment before the kernel makes its exit status known, and join(timeout)
    checks the status only once when the sentinel is already ready: so ask until it shows
    (at most `limit_s`; None then)."""
    deadline = time.monotonic() + limit_s
    while True:
        code = proc.exitcode
        if code is not None or time.monotonic() >= deadline:
            return code
        time.sleep(0.01)


class PlanAhead:
    """Plans iterations ahead of training in `num_workers` processes (0: inline in `get()`).

    Call `start(first_iteration)` once (any iteration: resuming from a checkpoint starts there),
    then `get(i)` for i = first, first+1, ... in order. While the trainer works on iteration i,
    iterations i+1 .. i+prefetch are planned; at most prefetch+1 results exist at any time.
    Use as a context manager or call `close()` to stop the workers.
    """

    def __init__(self, plan_fn: Callable[[int, Any], Any], lengths_fn: Callable[[int], Any],
                 num_workers: int | None = None, prefetch: int = 2, timeout_s: float = 600.0,
                 start_method: str = "spawn", startup_timeout_s: float = 300.0):
        if num_workers is None:
            num_workers = default_num_workers()
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.plan_fn = plan_fn
        self.lengths_fn = lengths_fn
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._ready_at: float | None = None          # when the first worker was up
        self._dead_seen_at: float | None = None      # when _check_collector first saw a death
        self._ctx = mp.get_context(start_method)
        self._next_get: int | None = None
        self._next_submit = 0
        self._stop_iteration: int | None = None
        self._workers: list = []
        self._tasks = None
        self._collector: threading.Thread | None = None
        self._cond = threading.Condition()
        self._done: dict[int, tuple] = {}            # iteration -> ("ok", value, plan_s) | ("error", text)
        self._running: dict[int, int] = {}           # iteration -> pid of the worker planning it
        self._broken: str | None = None              # why the worker pool cannot go on
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, first_iteration: int = 0, stop_iteration: int | None = None) -> "PlanAhead":
        """Start the workers and submit iterations first_iteration .. first_iteration+prefetch
        (never `stop_iteration` or later, when given)."""
        if self._next_get is not None:
            raise RuntimeError("PlanAhead.start() was already called")
        if self._closed:
            raise RuntimeError("PlanAhead is closed")
        self._next_get = first_iteration
        self._next_submit = first_iteration
        self._stop_iteration = stop_iteration
        if self.num_workers > 0:
            self._start_workers()
            self._submit_up_to(first_iteration + self.prefetch)
        return self

    def _start_workers(self) -> None:
        if mp.current_process().daemon:
            raise RuntimeError(f"{mp.current_process().name} is a daemonic process and cannot "
                               f"start planner workers; plan inline there (num_workers=0)")
        self._tasks = self._ctx.Queue()
        conns = []
        for i in range(self.num_workers):
            recv_end, send_end = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(target=_planner_worker, args=(self.plan_fn, self._tasks, send_end),
                                     name=f"dynapipe-planner-{i}", daemon=True)
            proc.start()
            send_end.close()  # the child holds its own copy; EOF then means the child is gone
            self._workers.append(proc)
            conns.append(recv_end)
        self._collector = threading.Thread(target=self._collect, args=(conns,),
                                           name="dynapipe-plan-collector", daemon=True)
        self._collector.start()

    def close(self) -> None:
        """Stop the workers (killing any that are stuck) and drop unread results."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        if self._tasks is not None:
            for _ in self._workers:
                try:
                    self._tasks.put(None)
                except (OSError, ValueError):
                    break
        deadline = time.monotonic() + _JOIN_S
        for proc in self._workers:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._workers:
            if proc.is_alive():
                proc.kill()
                proc.join(_JOIN_S)
        if self._collector is not None:
            self._collector.join(_JOIN_S + _POLL_S)
        if self._tasks is not None:
            self._tasks.cancel_join_thread()
            self._tasks.close()
        self._done.clear()

    def __enter__(self) -> "PlanAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ trainer side
    def _submit_up_to(self, last_iteration: int) -> None:
        if self._stop_iteration is not None:
            last_iteration = min(last_iteration, self._stop_iteration - 1)
        while self._next_submit <= last_iteration:
            it = self._next_submit
            self._tasks.put((it, self.lengths_fn(it)))
            self._next_submit += 1

    def get(self, iteration: int) -> Planned:
        """The plan of `iteration` (the next one in order), blocking until it is ready."""
        if self._next_get is None:
            raise RuntimeError("call PlanAhead.start(first_iteration) before get()")
        if self._closed:
            raise RuntimeError("PlanAhead is closed")
        if iteration != self._next_get:
            raise ValueError(f"plans are handed out in order: expected iteration "
                             f"{self._next_get}, got {iteration}")
        if self._stop_iteration is not None and iteration >= self._stop_iteration:
            raise ValueError(f"iteration {iteration} is past stop_iteration {self._stop_iteration}")
        self._next_get = iteration + 1
        if self.num_workers == 0:
            return self._plan_inline(iteration)
        self._submit_up_to(iteration + self.prefetch)
        start = time.perf_counter()
        outcome = self._wait_for(iteration)
        wait_s = time.perf_counter() - start
        if outcome[0] == "error":
            raise PlanningFailed(iteration, f"planning iteration {iteration} failed in a planner "
                                            f"worker: {failure_line(outcome[1])}", outcome[1])
        return Planned(iteration, outcome[1], wait_s, outcome[2])

    def is_ready(self, iteration: int) -> bool:
        """True when `iteration` is the next one and `get()` would return (or raise) at once."""
        if self.num_workers == 0 or self._closed or iteration != self._next_get:
            return False
        with self._cond:
            return iteration in self._done

    def _plan_inline(self, iteration: int) -> Planned:
        start = time.perf_counter()
        try:
            value = self.plan_fn(iteration, self.lengths_fn(iteration))
        except Exception as exc:
            text = traceback.format_exc()
            raise PlanningFailed(iteration, f"planning iteration {iteration} failed: "
                                            f"{failure_line(text)}", text) from exc
        took = time.perf_counter() - start
        return Planned(iteration, value, took, took)

    def _wait_for(self, iteration: int) -> tuple:
        """Wait for the result of `iteration`. The timeout counts from when the wait began or
        the first worker was up, whichever is later: process start-up is not a stall."""
        began = time.monotonic()
        with self._cond:
            while iteration not in self._done:
                if self._broken is not None:
                    raise PlanningFailed(iteration, f"cannot plan iteration {iteration}: "
                                                    f"{self._broken}")
                self._check_collector()
                if self._ready_at is None:
                    left = began + self.startup_timeout_s - time.monotonic()
                    if left <= 0:
                        raise PlanningTimeout(iteration, f"no planner worker started within "
                                                         f"{self.startup_timeout_s:g} s; "
                                                         f"iteration {iteration} was not planned")
                    self._cond.wait(min(left, 1.0))
                    continue
                left = max(began, self._ready_at) + self.timeout_s - time.monotonic()
                if left <= 0:
                    where = (f"planner worker pid {self._running[iteration]} is still running it"
                             if iteration in self._running else "no worker has started it")
                    raise PlanningTimeout(iteration, f"the plan of iteration {iteration} was not "
                                                     f"ready after {self.timeout_s:g} s ({where})")
                self._cond.wait(min(left, 1.0))
            return self._done.pop(iteration)

    def _check_collector(self) -> None:
        """Belt and braces, should the collector miss something: a stopped collector, or a
        worker dead for over a second that the collector has not reported, breaks the pool."""
        if self._broken is not None or self._collector is None:
            return
        dead = [p for p in self._workers if p.exitcode is not None]
        if dead and self._dead_seen_at is None:
            self._dead_seen_at = time.monotonic()
        stale = dead and time.monotonic() - self._dead_seen_at > 1.0
        if stale or not self._collector.is_alive():
            with_iterations = {pid: it for it, pid in self._running.items()}
            text = "; ".join(f"planner worker pid {p.pid} died with exit code {p.exitcode} "
                             + (f"while planning iteration {with_iterations[p.pid]}"
                                if p.pid in with_iterations else "while idle") for p in dead)
            self._broken = text or "the plan collector thread stopped"

    # ------------------------------------------------------------------ collector thread
    def _collect(self, conns: list) -> None:
        """Move worker messages into `_done` as they arrive, so a worker never blocks on a
        large result while the trainer is busy; notice dead workers at once."""
        pid_of = {conn: proc.pid for conn, proc in zip(conns, self._workers)}
        proc_of_sentinel = {proc.sentinel: proc for proc in self._workers}
        try:
            while not self._closed:
                ready = mp_connection.wait(list(pid_of) + list(proc_of_sentinel), timeout=_POLL_S)
                for obj in ready:
                    if obj in pid_of:
                        self._receive(obj, pid_of)
                for obj in ready:
                    if obj in proc_of_sentinel and not self._closed:
                        proc = proc_of_sentinel.pop(obj)
                        self._worker_died(proc, pid_of)
                if self._broken is not None:
                    return
        except BaseException:  # noqa: BLE001 - the trainer must hear of it rather than wait
            with self._cond:
                self._broken = f"the plan collector thread failed:\n{traceback.format_exc()}"
                self._cond.notify_all()

    def _receive(self, conn, pid_of: dict) -> None:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            pid_of.pop(conn, None)  # its process sentinel reports the death
            return
        with self._cond:
            kind, iteration = msg[0], msg[1]
            if kind == "ready":
                if self._ready_at is None:
                    self._ready_at = time.monotonic()
            elif kind == "start":
                self._running[iteration] = msg[2]
            elif kind == "ok":
                self._running.pop(iteration, None)
                self._done[iteration] = ("ok", msg[2], msg[3])
            else:
                self._running.pop(iteration, None)
                self._done[iteration] = ("error", msg[2])
            self._cond.notify_all()

    def _worker_died(self, proc, pid_of: dict) -> None:
        # Drain what the dead worker managed to send before it died.
        for conn, pid in list(pid_of.items()):
            if pid == proc.pid:
                while conn.poll():
                    try:
                        self._receive(conn, pid_of)
                    except Exception:  # noqa: BLE001 - a torn message from a killed process
                        break
        code = exit_code_of_ended(proc)
        with self._cond:
            lost = sorted(it for it, pid in self._running.items() if pid == proc.pid)
            what = f"while planning iteration {lost[0]}" if lost else "while idle"
            self._broken = f"planner worker pid {proc.pid} died with exit code {code} {what}"
            self._cond.notify_all()
