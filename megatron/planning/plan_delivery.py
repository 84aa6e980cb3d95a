"""Plan delivery, node by node: every node's planning leader (its lowest rank) plans ahead with
`PlanAhead` the data-parallel replicas that have a rank on the node (dynapipe_ext/plan/cluster.py),
and sends each other rank of the node exactly its execution plan over a process group of the
node's own ranks. One node (the default without torchrun's LOCAL_WORLD_SIZE) is the whole
world, rank 0 its leader. With replica_split "samples" a node plans only its replicas'
samples, so planning work per node falls as the nodes grow; nothing crosses nodes.

No store and no extra listening socket: at set-up every rank joins one dedicated gloo group,
that of its node (gloo even when training runs on NCCL: plans are host bytes), and the plans
travel over the connections of that group, which only the node's ranks hold. Per iteration
and reader the leader posts two non-blocking sends: a header (int64: kind, iteration, byte
count) and the bytes; the kind is a plan, or the planning error text, which every rank raises
as `PlanningFailed`. TP ranks of one (dp, pp) each get their own copy. A plan is sent as soon
as it exists (a worker may finish it while the leader still trains the previous iteration),
so a reader's receive finds it waiting; at most `max_outstanding` iterations of sends are in
flight. Readers receive in iteration order and wait at most `timeout_s`: a dead or stalled
leader is an error naming the rank, its node and the iteration, never a hang (a gloo timeout
also closes that rank's connections of the group, so delivery ends there; the run ends with
it anyway). A dead or stalled planner worker is a PlanningFailed on every rank of its node
naming the iteration and the node. Plans carry a CRC (dynapipe_ext/plan/serialization.py), checked
when decoded: a corrupted plan is an error, never a run on wrong data.
"""
from __future__ import annotations

import datetime
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from dynapipe_ext.plan.cluster import (all_nodes, auto_num_workers, free_cores, node_ranks,
                                  node_replicas, ranks_per_node_from_env)
from dynapipe_ext.plan.iteration_planner import IterationPlannerConfig, iteration_plan_fn
from dynapipe_ext.runtime.plan_ahead import PlanAhead, PlanningFailed

PLAN, ERROR = 1, 2                 # header kinds
HEADER_TAG, PAYLOAD_TAG = 1, 2     # point-to-point tags on the plan group
MAX_PLAN_BYTES = 1 << 30
CLOSE_GRACE_S = 10.0


class PlanDeliveryError(RuntimeError):
    """A plan could not be delivered: the leader or a reader is gone, or the bytes are bad."""


class PlanDeliveryTimeout(PlanDeliveryError):
    """A rank waited too long for a plan, or the leader for a reader to take one."""


def plan_group(timeout_s: float, world_size: int | None = None,
               ranks_per_node: int | None = None):
    """The process group plans travel on: the ranks of this rank's node, gloo (None when the
    node is this rank alone). Collective: every rank creates every node's group, in node
    order, at the same point of its set-up. Defaults: the whole world as one node."""
    world_size = dist.get_world_size() if world_size is None else world_size
    ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
    mine = None
    timeout = datetime.timedelta(seconds=timeout_s)
    for ranks in all_nodes(world_size, ranks_per_node):
        if len(ranks) == world_size:
            group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if dist.get_rank() in ranks and len(ranks) > 1:
            mine = group
    return mine


def gather_coordinates(group, ranks: list[int], dp_rank: int, pp_rank: int) -> dict[int, tuple]:
    """(dp, pp) of every rank of the group (`ranks`, its global ranks in order), by global
    rank (one all-gather on the plan group)."""
    mine = torch.tensor([dp_rank, pp_rank], dtype=torch.int64)
    everyone = [torch.empty(2, dtype=torch.int64) for _ in ranks]
    dist.all_gather(everyone, mine, group=group)
    return {r: (int(t[0]), int(t[1])) for r, t in zip(ranks, everyone)}


def coordinate_problems(coords: dict[int, tuple], dp_size: int, pp_size: int) -> list[str]:
    """Ranks whose (dp, pp) is outside the plan's dp_size x pp_size grid."""
    return [f"rank {r} is (dp {d}, pp {p})" for r, (d, p) in sorted(coords.items())
            if not (0 <= d < dp_size and 0 <= p < pp_size)]


def _wait(works: list, deadline: float) -> None:
    """Wait for point-to-point works until `deadline` (time.monotonic()). TimeoutError when it
    passes; gloo's RuntimeError when the peer is gone."""
    for work in works:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        try:
            work.wait(datetime.timedelta(seconds=left))
        except RuntimeError:
            if time.monotonic() >= deadline:
                raise TimeoutError from None
            raise


def start_plan_delivery(planner_config: IterationPlannerConfig, lengths_fn: Callable[[int], Any],
                        rank: int, world_size: int, dp_rank: int, pp_rank: int,
                        first_iteration: int, stop_iteration: int | None = None,
                        num_workers: int | str | None = None, prefetch: int = 2,
                        timeout_s: float = 900.0, ranks_per_node: int | None = None,
                        replicas=None, report: Callable[[str], None] | None = None
                        ) -> "PlanDelivery":
    """The plan groups and this rank's PlanDelivery, started at `first_iteration`; every rank
    calls it at the same point of its set-up. Each node's leader plans its node's replicas
    (`replicas`: override, for simulations standing in for a bigger layout) in `num_workers`
    background processes (None: default_num_workers(); "auto": auto_workers()) with
    `lengths_fn`. `ranks_per_node` None: torchrun's LOCAL_WORLD_SIZE. `report` (e.g. print)
    gets the leader's one-line worker choice."""
    ranks_per_node = ranks_per_node or ranks_per_node_from_env(world_size)
    ranks = node_ranks(rank, world_size, ranks_per_node)
    group = plan_group(timeout_s, world_size, ranks_per_node) if world_size > 1 else None

    def make_planner(own_replicas: tuple[int, ...]) -> PlanAhead:
        planned = tuple(replicas) if replicas is not None else own_replicas
        plan_fn = iteration_plan_fn(planner_config, planned)
        workers = num_workers
        if workers == "auto":
            workers, why = auto_workers(plan_fn, lengths_fn, first_iteration, ranks_per_node)
            if report is not None:
                report(f"[plan] node {rank // ranks_per_node}: {why}; plans replicas "
                       f"{_span(planned)}")
        return PlanAhead(plan_fn, lengths_fn, num_workers=workers, prefetch=prefetch,
                         timeout_s=timeout_s)

    delivery = PlanDelivery(group, rank, world_size, dp_rank, pp_rank, planner_config.dp,
                            planner_config.pp, planner=make_planner if rank == ranks[0] else None,
                            timeout_s=timeout_s, node_ranks=ranks)
    return delivery.start(first_iteration, stop_iteration)


def _span(values) -> str:
    values = list(values)
    if len(values) > 2 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(map(str, values))


def auto_workers(plan_fn, lengths_fn, iteration: int, ranks_per_node: int) -> tuple[int, str]:
    """`--num-planner-workers auto`: plan `iteration` once here, timed (one core), and take
    its predicted iteration time (the slowest planned replica's simulated makespan) as the
    iteration time; auto_num_workers picks from that and the node's free cores."""
    start = time.process_time()
    planned = plan_fn(iteration, lengths_fn(iteration))
    plan_s = time.process_time() - start
    predicted = getattr(planned, "predicted_ms", ())
    iteration_s = max(predicted) / 1e3 if predicted else None
    workers, why = auto_num_workers(free_cores(ranks_per_node), plan_s, iteration_s)
    return workers, f"--num-planner-workers auto: {why}"


@dataclass(frozen=True)
class DeliveredPlan:
    """This rank's plan of one iteration. `wait_s`: time fetch() blocked. `planning_ms`: the
    planner's timings (leader only, None elsewhere)."""

    iteration: int
    plan: Any
    wait_s: float
    planning_ms: dict | None = None


def _default_decode(data: bytes):
    from dynapipe_ext.plan.serialization import plan_from_bytes
    return plan_from_bytes(data)


class PlanDelivery:
    """Per-rank plan source. Every rank of a node constructs it (an all-gather on `group`, the
    node's plan group; None for a node of one rank), calls `start(first_iteration)` once, then
    `fetch(i)` for each iteration in order. `node_ranks`: the global ranks of this rank's node,
    lowest first (None: the whole world is one node); the lowest is the node's planning leader
    and must be given the `planner`: a PlanAhead, or a function of the node's replicas (the
    dp ranks of its ranks) that makes one.

    The planner's results must have `plan_bytes`, a mapping (dp_rank, pp_rank) -> bytes
    covering the pairs of the node's ranks, and may have `timings_ms` (a dict) for the
    benchmark. `decode` turns bytes into a plan and raises ValueError on bad bytes.
    """

    def __init__(self, group, rank: int, world_size: int, dp_rank: int, pp_rank: int,
                 dp_size: int, pp_size: int, planner: PlanAhead | Callable | None = None,
                 decode: Callable[[bytes], Any] | None = None, timeout_s: float = 900.0,
                 max_outstanding: int = 4, node_ranks: list[int] | None = None):
        self.node_ranks = list(range(world_size)) if node_ranks is None else list(node_ranks)
        if rank not in self.node_ranks or self.node_ranks != sorted(set(self.node_ranks)):
            raise ValueError(f"node ranks {self.node_ranks} must be ascending and hold rank "
                             f"{rank}")
        self.leader = self.node_ranks[0]
        self.node = self.leader // len(self.node_ranks)
        if rank == self.leader and planner is None:
            raise ValueError(f"rank {rank} is the planning leader and needs a planner "
                             f"(node {self.node})")
        if len(self.node_ranks) > 1 and group is None:
            raise ValueError(f"{len(self.node_ranks)} ranks need a plan group (plan_group())")
        if max_outstanding < 1:
            raise ValueError(f"max_outstanding must be >= 1, got {max_outstanding}")
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.dp_rank, self.pp_rank = dp_rank, pp_rank
        self.dp_size, self.pp_size = dp_size, pp_size
        self.decode = decode or _default_decode
        self.timeout_s = timeout_s
        self.max_outstanding = max_outstanding
        self.coords = (gather_coordinates(group, self.node_ranks, dp_rank, pp_rank)
                       if group is not None else {rank: (dp_rank, pp_rank)})
        problems = coordinate_problems(self.coords, dp_size, pp_size)
        if problems:   # the same data on every rank of the node, so the same error there
            raise ValueError(f"plans cover dp {dp_size} x pp {pp_size}, but "
                             + "; ".join(problems))
        self.replicas = node_replicas(d for d, _ in self.coords.values())
        if rank == self.leader and not isinstance(planner, PlanAhead):
            planner = planner(self.replicas)
        self.planner = planner if rank == self.leader else None
        self._in_flight: deque = deque()     # leader: (iteration, [(rank, works, tensors)])
        self._ahead: dict[int, Any] = {}     # leader: sent ahead -> (own bytes, timings) | error
        self._next: int | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def who(self) -> str:
        return f"rank {self.rank} (dp {self.dp_rank}, pp {self.pp_rank})"

    @property
    def where(self) -> str:
        return f"node {self.node} (ranks {_span(self.node_ranks)})"

    def start(self, first_iteration: int = 0, stop_iteration: int | None = None) -> "PlanDelivery":
        """Begin at `first_iteration` (a resumed run passes its next iteration)."""
        self._next = first_iteration
        if self.is_leader:
            self.planner.start(first_iteration, stop_iteration)
        return self

    def close(self) -> None:
        """Leader: stop the planners, then give the readers up to CLOSE_GRACE_S to take what
        was sent (a planning error above all: a dropped send is a cancelled one). A reader
        that is gone fails its send at once; one that never reads (its run stopped) is
        given up on."""
        if not self.is_leader:
            return
        self.planner.close()
        deadline = time.monotonic() + min(self.timeout_s, CLOSE_GRACE_S)
        while self._in_flight:
            _, sends = self._in_flight.popleft()
            for _, works, _ in sends:
                try:
                    _wait(works, deadline)
                except (TimeoutError, RuntimeError):
                    pass   # the run is over; its own error, if any, is already on its way

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

    def _decode(self, iteration: int, data: bytes):
        try:
            return self.decode(data)
        except ValueError as exc:
            raise PlanDeliveryError(f"{self.who}: the plan of iteration {iteration} is corrupt "
                                    f"({exc}); refusing to run it") from exc

    # ------------------------------------------------------------------ leader
    def _lead(self, iteration: int) -> DeliveredPlan:
        start = time.perf_counter()
        if iteration in self._ahead:
            ahead = self._ahead.pop(iteration)
            if isinstance(ahead, PlanningFailed):
                raise ahead
            own, timings = ahead
        else:
            own, timings = self._plan_and_send(iteration)
        self._send_ready_ahead(iteration + 1)
        plan = self._decode(iteration, own)
        return DeliveredPlan(iteration, plan, time.perf_counter() - start, timings)

    def _plan_and_send(self, iteration: int) -> tuple[bytes, dict]:
        try:
            planned = self.planner.get(iteration)
        except PlanningFailed as exc:
            message = f"{self.where}: {exc}"
            self._send_error(iteration, message)
            raise PlanningFailed(iteration, message) from exc
        except Exception as exc:
            message = (f"{self.where}: planning iteration {iteration} failed on the leader: "
                       f"{exc!r}")
            self._send_error(iteration, message)
            raise PlanningFailed(iteration, message) from exc
        plan_bytes = planned.value.plan_bytes
        needed = set(self.coords.values())
        if not needed <= set(plan_bytes):
            message = (f"{self.where}: the plan of iteration {iteration} covers (dp, pp) pairs "
                       f"{sorted(plan_bytes)}, missing {sorted(needed - set(plan_bytes))}")
            self._send_error(iteration, message)
            raise PlanningFailed(iteration, message)
        timings = dict(getattr(planned.value, "timings_ms", None) or {})
        timings["worker_total"] = planned.plan_s * 1e3
        timings["leader_wait"] = planned.wait_s * 1e3
        self._send(iteration, {r: (PLAN, bytes(plan_bytes[self.coords[r]]))
                               for r in self.node_ranks[1:]})
        return plan_bytes[(self.dp_rank, self.pp_rank)], timings

    def _send_ready_ahead(self, iteration: int) -> None:
        """Send the next plan at once if a worker already finished it, so the other ranks
        do not wait for the leader to finish its own iteration first."""
        if self.group is None or iteration in self._ahead:
            return
        if self.planner.is_ready(iteration):
            try:
                self._ahead[iteration] = self._plan_and_send(iteration)
            except PlanningFailed as exc:  # sent already; raised at fetch(iteration)
                self._ahead[iteration] = exc

    def _send_error(self, iteration: int, message: str) -> None:
        text = message.encode("utf-8", "replace")
        self._send(iteration, {r: (ERROR, text) for r in self.node_ranks[1:]})

    def _send(self, iteration: int, messages: dict[int, tuple[int, bytes]]) -> None:
        """Post the sends of one iteration (rank -> (kind, bytes)), first waiting for the
        oldest iteration in flight when `max_outstanding` are."""
        if self.group is None:
            return
        while len(self._in_flight) >= self.max_outstanding:
            self._finish_oldest()
        sends = []
        for dst, (kind, data) in messages.items():
            header = torch.tensor([kind, iteration, len(data)], dtype=torch.int64)
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
            try:
                works = [dist.isend(header, dst, group=self.group, tag=HEADER_TAG)]
                if payload is not None:
                    works.append(dist.isend(payload, dst, group=self.group, tag=PAYLOAD_TAG))
            except RuntimeError as exc:
                raise PlanDeliveryError(f"{self.where} planning leader: cannot send the plan "
                                        f"of iteration {iteration} to rank {dst}: {exc}") from exc
            sends.append((dst, works, (header, payload)))   # the tensors live until sent
        self._in_flight.append((iteration, sends))

    def _finish_oldest(self) -> None:
        iteration, sends = self._in_flight.popleft()
        deadline = time.monotonic() + self.timeout_s
        for dst, works, _ in sends:
            try:
                _wait(works, deadline)
            except TimeoutError:
                raise PlanDeliveryTimeout(
                    f"{self.where} planning leader: rank {dst} did not take its plan of "
                    f"iteration {iteration} within {self.timeout_s:g} s; a rank is stuck or "
                    f"dead") from None
            except RuntimeError as exc:
                raise PlanDeliveryError(f"{self.where} planning leader: sending the plan of "
                                        f"iteration {iteration} to rank {dst} failed; that "
                                        f"rank stopped or died: {exc}") from exc

    # ------------------------------------------------------------------ readers
    def _read(self, iteration: int) -> DeliveredPlan:
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        header = torch.empty(3, dtype=torch.int64)
        self._receive(header, HEADER_TAG, iteration, deadline)
        kind, sent_for, nbytes = header.tolist()
        if sent_for != iteration or kind not in (PLAN, ERROR) or not 0 <= nbytes <= MAX_PLAN_BYTES:
            raise PlanDeliveryError(f"{self.who}: waiting for the plan of iteration {iteration},"
                                    f" got a header (kind {kind}, iteration {sent_for}, "
                                    f"{nbytes} bytes) from the planning leader")
        payload = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self._receive(payload, PAYLOAD_TAG, iteration, deadline)
        data = payload.numpy().tobytes()
        wait_s = time.perf_counter() - start
        if kind == ERROR:
            raise PlanningFailed(iteration, f"rank {self.rank}: planning of iteration "
                                            f"{iteration} failed on the planning leader "
                                            f"(rank {self.leader}) of {self.where}:\n"
                                            f"{data.decode('utf-8', 'replace')}")
        return DeliveredPlan(iteration, self._decode(iteration, data), wait_s, None)

    def _receive(self, tensor, tag: int, iteration: int, deadline: float) -> None:
        try:
            _wait([dist.irecv(tensor, self.leader, group=self.group, tag=tag)], deadline)
        except TimeoutError:
            raise PlanDeliveryTimeout(
                f"{self.who} got no plan for iteration {iteration} from the planning leader "
                f"(rank {self.leader}) within {self.timeout_s:g} s; the planning leader of "
                f"{self.where} is stuck or plans too slowly") from None
        except RuntimeError as exc:
            raise PlanDeliveryError(
                f"{self.who} lost the planning leader (rank {self.leader}) while waiting for "
                f"the plan of iteration {iteration}; the planning leader of {self.where} "
                f"stopped or died: {exc}") from exc
