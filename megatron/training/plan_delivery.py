"""Plan delivery: the planning leader (global rank 0) plans ahead with `PlanAhead` and hands
every rank exactly its execution plan through a `torch.distributed.TCPStore`.

The store is one of our own, served by rank 0 on MASTER_ADDR at MASTER_PORT + 1 (override with
`port=` or DYNAPIPE_PLAN_STORE_PORT): torch's default store is not public API, and a separate
store keeps plan traffic away from the process-group rendezvous. Nothing else to install.

Keys of iteration i: `dynapipe/plan/<i>/<dp>/<pp>` (one per data-parallel replica x pipeline
rank; TP ranks of the same (dp, pp) read the same key) and `dynapipe/plan/<i>/acks`, a counter
every reader bumps once it has its copy. The leader deletes an iteration's keys as soon as all
world_size - 1 readers have acked, and never lets more than `max_outstanding` iterations wait for
acks, so store memory is bounded however long training runs. A value is tagged: b"P" + plan
bytes, or b"E" + the planning error text, which every rank raises as `PlanningFailed`.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from dynapipe_ext.iteration_planner import IterationPlannerConfig, iteration_plan_fn
from dynapipe_ext.plan_ahead import PlanAhead, PlanningFailed

KEY_PREFIX = "dynapipe/plan"
STORE_PORT_ENV = "DYNAPIPE_PLAN_STORE_PORT"
STORE_PORT_OFFSET = 1
_PLAN_TAG = b"P"
_ERROR_TAG = b"E"
_ACK_POLL_S = 0.005


class PlanDeliveryTimeout(RuntimeError):
    """A rank waited too long for a plan, or the leader for readers' acknowledgements."""


def plan_key(iteration: int, dp_rank: int, pp_rank: int) -> str:
    return f"{KEY_PREFIX}/{iteration}/{dp_rank}/{pp_rank}"


def ack_key(iteration: int) -> str:
    return f"{KEY_PREFIX}/{iteration}/acks"


def plan_store_address(host: str | None = None, port: int | None = None) -> tuple[str, int]:
    """(host, port) of the plan store: MASTER_ADDR and DYNAPIPE_PLAN_STORE_PORT, else
    MASTER_PORT + 1, unless given."""
    host = host or os.environ.get("MASTER_ADDR")
    if not host:
        raise ValueError("the plan store needs MASTER_ADDR (or an explicit host)")
    if port is None:
        if os.environ.get(STORE_PORT_ENV):
            port = int(os.environ[STORE_PORT_ENV])
        elif os.environ.get("MASTER_PORT"):
            port = int(os.environ["MASTER_PORT"]) + STORE_PORT_OFFSET
        else:
            raise ValueError(f"the plan store needs MASTER_PORT or {STORE_PORT_ENV} "
                             f"(or an explicit port)")
    return host, port


def create_plan_store(rank: int, world_size: int, timeout_s: float = 300.0,
                      host: str | None = None, port: int | None = None):
    """The plan store: served by rank 0, joined by every other rank (waits up to timeout_s)."""
    import torch.distributed as dist
    host, port = plan_store_address(host, port)
    try:
        return dist.TCPStore(host, port, world_size, is_master=(rank == 0),
                             timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - re-raised with where and how to fix it
        role = "serve" if rank == 0 else "reach"
        raise RuntimeError(f"rank {rank} could not {role} the plan store at {host}:{port} "
                           f"({exc}); set {STORE_PORT_ENV} to a free port") from exc


def start_plan_delivery(planner_config: IterationPlannerConfig, lengths_fn: Callable[[int], Any],
                        rank: int, world_size: int, dp_rank: int, pp_rank: int,
                        first_iteration: int, stop_iteration: int | None = None,
                        num_workers: int | None = None, prefetch: int = 2,
                        timeout_s: float = 900.0) -> "PlanDelivery":
    """Plan store + PlanDelivery for this rank, started at `first_iteration`. Rank 0 plans in
    `num_workers` background processes (None: default_num_workers()) with `lengths_fn`."""
    planner = None
    if rank == 0:
        planner = PlanAhead(iteration_plan_fn(planner_config), lengths_fn,
                            num_workers=num_workers, prefetch=prefetch, timeout_s=timeout_s)
    store = create_plan_store(rank, world_size, timeout_s) if world_size > 1 else None
    delivery = PlanDelivery(store, rank, world_size, dp_rank, pp_rank, planner_config.dp,
                            planner_config.pp, planner=planner, timeout_s=timeout_s)
    return delivery.start(first_iteration, stop_iteration)


@dataclass(frozen=True)
class DeliveredPlan:
    """This rank's plan of one iteration. `wait_s`: time fetch() blocked. `planning_ms`: the
    planner's timings (leader only, None elsewhere)."""

    iteration: int
    plan: Any
    wait_s: float
    planning_ms: dict | None = None


def _default_decode(data: bytes):
    from dynapipe_ext.serialization import plan_from_bytes
    return plan_from_bytes(data)


class PlanDelivery:
    """Per-rank plan source. Every rank calls `start(first_iteration)` once, then
    `fetch(i)` for each iteration in order; rank 0 must be given the `planner`.

    The planner's results must have `plan_bytes`, a mapping (dp_rank, pp_rank) -> bytes for all
    dp_size x pp_size pairs, and may have `timings_ms` (a dict) for the benchmark.
    """

    def __init__(self, store, rank: int, world_size: int, dp_rank: int, pp_rank: int,
                 dp_size: int, pp_size: int, planner: PlanAhead | None = None,
                 decode: Callable[[bytes], Any] | None = None, timeout_s: float = 900.0,
                 max_outstanding: int = 4):
        if rank == 0 and planner is None:
            raise ValueError("rank 0 is the planning leader and needs a planner")
        if world_size > 1 and store is None:
            raise ValueError(f"{world_size} ranks need a plan store")
        if max_outstanding < 1:
            raise ValueError(f"max_outstanding must be >= 1, got {max_outstanding}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.dp_rank, self.pp_rank = dp_rank, pp_rank
        self.dp_size, self.pp_size = dp_size, pp_size
        self.planner = planner if rank == 0 else None
        self.decode = decode or _default_decode
        self.timeout_s = timeout_s
        self.max_outstanding = max_outstanding
        self._readers = world_size - 1
        self._outstanding: list[int] = []      # leader: published, not yet acked by every reader
        self._ahead: dict[int, tuple] = {}     # leader: published ahead -> (own bytes, timings)
        self._next: int | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def start(self, first_iteration: int = 0, stop_iteration: int | None = None) -> "PlanDelivery":
        """Begin at `first_iteration` (a resumed run passes its next iteration)."""
        self._next = first_iteration
        if self.is_leader:
            self.planner.start(first_iteration, stop_iteration)
        return self

    def close(self) -> None:
        """Leader: stop the planners and delete the keys every reader has acked."""
        if self.is_leader:
            self.planner.close()
            if self.store is not None:
                self._reap()

    def __enter__(self) -> "PlanDelivery":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fetch(self, iteration: int) -> DeliveredPlan:
        """This rank's plan of `iteration`, blocking until it is there."""
        if self._next is None:
            raise RuntimeError("call PlanDelivery.start(first_iteration) before fetch()")
        if iteration != self._next:
            raise ValueError(f"rank {self.rank}: plans are fetched in order: expected iteration "
                             f"{self._next}, got {iteration}")
        self._next = iteration + 1
        if self.is_leader:
            return self._lead(iteration)
        return self._read(iteration)

    # ------------------------------------------------------------------ leader
    def _lead(self, iteration: int) -> DeliveredPlan:
        start = time.perf_counter()
        if iteration in self._ahead:
            ahead = self._ahead.pop(iteration)
            if isinstance(ahead, PlanningFailed):
                raise ahead
            own, timings = ahead
        else:
            own, timings = self._plan_and_publish(iteration)
        self._publish_ready_ahead(iteration + 1)
        plan = self.decode(own)
        return DeliveredPlan(iteration, plan, time.perf_counter() - start, timings)

    def _plan_and_publish(self, iteration: int) -> tuple[bytes, dict]:
        try:
            planned = self.planner.get(iteration)
        except PlanningFailed as exc:
            self._publish_error(iteration, str(exc))
            raise
        except Exception as exc:
            message = f"planning iteration {iteration} failed on the leader: {exc!r}"
            self._publish_error(iteration, message)
            raise PlanningFailed(iteration, message) from exc
        plan_bytes = planned.value.plan_bytes
        expected = {(d, p) for d in range(self.dp_size) for p in range(self.pp_size)}
        if set(plan_bytes) != expected:
            message = (f"the plan of iteration {iteration} covers (dp, pp) pairs "
                       f"{sorted(plan_bytes)}, expected all of {sorted(expected)}")
            self._publish_error(iteration, message)
            raise PlanningFailed(iteration, message)
        timings = dict(getattr(planned.value, "timings_ms", None) or {})
        timings["worker_total"] = planned.plan_s * 1e3
        timings["leader_wait"] = planned.wait_s * 1e3
        self._publish(iteration, {k: _PLAN_TAG + bytes(v) for k, v in plan_bytes.items()})
        return plan_bytes[(self.dp_rank, self.pp_rank)], timings

    def _publish_ready_ahead(self, iteration: int) -> None:
        """Publish the next plan at once if a worker already finished it, so the other ranks
        do not wait for the leader to finish its own iteration first."""
        if self.store is None or iteration in self._ahead:
            return
        if self.planner.is_ready(iteration):
            try:
                self._ahead[iteration] = self._plan_and_publish(iteration)
            except PlanningFailed as exc:  # published already; raised at fetch(iteration)
                self._ahead[iteration] = exc

    def _publish_error(self, iteration: int, message: str) -> None:
        if self.store is None:
            return
        payload = _ERROR_TAG + message.encode("utf-8", "replace")
        keys = {(d, p): payload for d in range(self.dp_size) for p in range(self.pp_size)}
        self._publish(iteration, keys)

    def _publish(self, iteration: int, values: dict) -> None:
        if self.store is None:
            return
        self._reap()
        if len(self._outstanding) >= self.max_outstanding:
            self._wait_for_acks(self._outstanding[0])
        keys = [plan_key(iteration, d, p) for d, p in values]
        self.store.multi_set(keys, list(values.values()))
        self._outstanding.append(iteration)

    def _acks(self, iteration: int) -> int:
        return self.store.add(ack_key(iteration), 0)

    def _reap(self) -> None:
        """Delete the keys of every published iteration all readers have acked."""
        for it in list(self._outstanding):
            if self._acks(it) >= self._readers:
                self._delete(it)

    def _delete(self, iteration: int) -> None:
        for d in range(self.dp_size):
            for p in range(self.pp_size):
                self.store.delete_key(plan_key(iteration, d, p))
        self.store.delete_key(ack_key(iteration))
        self._outstanding.remove(iteration)

    def _wait_for_acks(self, iteration: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while (acks := self._acks(iteration)) < self._readers:
            if time.monotonic() > deadline:
                raise PlanDeliveryTimeout(
                    f"planning leader: only {acks} of {self._readers} ranks read the plan of "
                    f"iteration {iteration} within {self.timeout_s:g} s; a rank is stuck or dead")
            time.sleep(_ACK_POLL_S)
        self._delete(iteration)

    # ------------------------------------------------------------------ readers
    def _read(self, iteration: int) -> DeliveredPlan:
        key = plan_key(iteration, self.dp_rank, self.pp_rank)
        start = time.perf_counter()
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
            data = self.store.get(key)
        except Exception as exc:  # noqa: BLE001 - DistStoreError / connection loss
            raise PlanDeliveryTimeout(
                f"rank {self.rank} (dp {self.dp_rank}, pp {self.pp_rank}) got no plan for "
                f"iteration {iteration} (store key {key}) from the planning leader, rank 0, "
                f"within {self.timeout_s:g} s: {exc}") from exc
        wait_s = time.perf_counter() - start
        try:
            self.store.add(ack_key(iteration), 1)
        except Exception:  # noqa: BLE001 - the leader is gone; this rank has its plan, and
            pass           # its next fetch (or collective) reports the loss with a timeout
        tag, body = data[:1], data[1:]
        if tag == _ERROR_TAG:
            raise PlanningFailed(iteration, f"rank {self.rank}: planning of iteration "
                                            f"{iteration} failed on the planning leader "
                                            f"(rank 0):\n{body.decode('utf-8', 'replace')}")
        if tag != _PLAN_TAG:
            raise ValueError(f"rank {self.rank}: store key {key} holds no plan (tag {tag!r})")
        return DeliveredPlan(iteration, self.decode(body), wait_s, None)
