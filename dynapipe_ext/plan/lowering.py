"""Lowering: a compute-only pipeline Schedule -> one ExecutionPlan (instruction list) per rank.

The semantics below are the contract between this module, the plan checker and the runtime
handlers (dynapipe_ext.runtime.executor + megatron/). Handlers key compute inputs and outputs by
(mb, stage); buffer ids only name tensors that are in flight or held for a transfer.

Per rank, in order:
* Compute: Forward / Backward in the schedule's order for that rank. Forward carries the
  micro-batch's recompute mode.
* LoadInput(mb) right before the first compute of `mb` on a rank that holds a stage needing
  data: the EMBEDDING stage (tokens), the HEAD stage (labels) and, for T5, the stage with
  DEC_EMBEDDING (decoder tokens). Once per micro-batch per rank.
* Transfers: stage s hands `stage_output_shapes(spec.stage_layers(S)[s], rows, seq_len,
  dec_seq_len, hidden)` to s+1 (activations); gradients flowing back from s+1 to s have the
  same shapes. Consecutive stages on the same rank (wave turning points, or a rank holding
  both) exchange nothing: the handler hands the tensors over locally.
* SendXStart(buffer=b) comes right after the producing compute: it takes that compute's output
  (activation of Forward(mb, s), or the input gradient of Backward(mb, s)) as buffer b and posts
  the non-blocking send. SendXFinish waits for it; it is deferred past at least one later
  compute (overlap) to the first point where it is provably safe (see below), then
  FreeBuffer(b) releases the send buffer.
* RecvXStart(buffer=b) posts a non-blocking receive into a fresh buffer b `recv_lookahead`
  computes before the consuming compute (earlier when per-pair ordering requires it);
  RecvXFinish waits right before the consuming compute. Received activations are the stage's
  input (autograd needs them): FreeBuffer after Backward(mb, s). Received gradients:
  FreeBuffer after the consuming Backward(mb, s).
* Forward-only schedules (schedule_ir.forward_only, for evaluation) lower the same way: no
  backward means no gradient transfers, and a received activation is freed right after the
  Forward that consumes it.
* Buffer ids are small integers per rank, reused once freed (lowest free id first), so the
  number of distinct ids is the peak number of live buffers.

Order of the non-compute instructions between two computes: sends of the compute just done,
frees of the buffers it consumed, receive starts, deferred send finishes (+ frees), receive
finishes of the next compute, LoadInput of the next compute.

Deadlock freedom (in-order point-to-point matching, rendezvous model: a Finish waits until the
peer has *started* the matching op). All transfers of one directed pair (src -> dst) are
ordered by their producing compute's position on src; sends on src and receives on dst are
emitted in exactly that order. Let T be a linear order of all computes consistent with
dependencies: (start, placement sequence) from simulator.simulate. A RecvFinish before
compute C waits for a send started right after its producer P, with T(P) < T(C). A SendFinish
placed before compute Z waits for the receive start that follows compute Y on dst; it is placed
only where T(Z) > T(Y) (or at the end). By induction over T every compute runs, so every plan completes.
plan_checker.check_plans verifies this on the produced plans by simulation.

Transport assumptions for handlers: messages of one directed pair (activations and gradients
alike) must match in posting order (one tag per pair), and every posted op must progress on its
own (gloo's isend/irecv do). NCCL runs the ops of one communicator in posting order on one
stream, where a pending receive would block a later send to the same peer; give each direction
of a pair its own communicator (process group) there so the model above holds.

What is assumed of NCCL, and why the order above is then safe:
1. Posting never blocks the host. NCCL creates a pair's communicator lazily, on the pair's
   first operation, and that creation blocks the host until the peer joins -- which would turn
   a Start into a rendezvous the argument above does not model (two ranks each blocked in a
   Start towards the other's later Start). The trainer therefore creates every pair's
   communicator at set-up with a warm-up exchange on each direction's group
   (megatron/base/distributed_setup.warm_up_pipeline_transfers); after it, isend/irecv
   only enqueue work and return.
2. Per communicator, operations complete in posting order on one stream: a Finish of
   transfer k waits for transfers 1..k of its communicator, all posted earlier on both ends
   in the same order (the per-pair order above), so it waits for nothing the induction has
   not already started.
3. The two directions of a pair never share a stream (one group per direction), so a
   receive posted early (recv_lookahead) never sits in front of a send of the other
   direction: a pair's communicator of one direction only carries one end's sends.
4. A send completes once the receiver has posted the matching receive (rendezvous), which
   is exactly the model above ("a Finish waits until the peer has started the matching op").
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from dynapipe_ext.plan.instructions import (Backward, ExecutionPlan, Forward, FreeBuffer, Instruction, LoadInput,
                           RecvActivationFinish, RecvActivationStart, RecvGradFinish,
                           RecvGradStart, SendActivationFinish, SendActivationStart,
                           SendGradFinish, SendGradStart)
from dynapipe_ext.batching.microbatch import MicroBatch
from dynapipe_ext.costs.model_spec import DEC_EMBEDDING, EMBEDDING, HEAD, ModelSpec, stage_output_shapes
from dynapipe_ext.schedule.schedule_ir import BACKWARD, FORWARD, Action, Schedule, validate_schedule
from dynapipe_ext.schedule.simulator import PipelineCosts, SimResult, simulate

DTYPES = ("float32", "float16", "bfloat16")
ACTIVATION = "activation"
GRADIENT = "gradient"
_INPUT_LAYERS = (EMBEDDING, DEC_EMBEDDING, HEAD)


@dataclass
class Transfer:
    """One point-to-point message of a lowered schedule (before buffer ids are assigned)."""

    kind: str                   # ACTIVATION or GRADIENT
    mb: int
    send_stage: int
    recv_stage: int
    src: int
    dst: int
    shapes: tuple
    producer_pos: int           # index of the producing compute in src's compute list
    consumer_pos: int           # index of the consuming compute in dst's compute list
    pair_index: int = -1        # position among all transfers src -> dst
    recv_gap: int = -1          # gap on dst (before compute #gap) holding the receive start
    send_finish_gap: int = -1   # gap on src holding the send finish


def default_costs(micro_batches: Sequence[MicroBatch], num_stages: int) -> PipelineCosts:
    """Rough per-action durations for ordering: forward 1/3, backward 2/3 of the micro-batch's
    predicted time (token slots when no prediction is set), the same on every stage."""
    total = np.array([mb.time_ms if mb.time_ms > 0 else float(sum(mb.slots()) or 1)
                      for mb in micro_batches])
    per_stage = np.repeat(total[:, None], num_stages, axis=1)
    return PipelineCosts(per_stage / 3, 2 * per_stage / 3)


@dataclass(frozen=True)
class CostDurations:
    """Per-action durations (callable Action -> ms) read from a simulator.PipelineCosts."""

    costs: PipelineCosts

    def __call__(self, act: Action) -> float:
        table = self.costs.fwd_ms if act.kind == FORWARD else self.costs.bwd_ms
        return float(table[act.mb, act.stage])


def action_ms_from_costs(costs: PipelineCosts) -> CostDurations:
    """Per-action durations from a simulator.PipelineCosts (fwd_ms / bwd_ms [mb][stage])."""
    return CostDurations(costs)


def costs_of_durations(schedule: Schedule, action_ms: Callable[[Action], float]
                       ) -> PipelineCosts:
    """fwd/bwd tables [mb][stage] of a per-action duration function (ValueError naming the
    action when a duration is negative or not a number)."""
    if isinstance(action_ms, CostDurations):
        return action_ms.costs
    fwd = np.zeros((schedule.num_micro_batches, schedule.num_stages))
    bwd = np.zeros_like(fwd)
    for acts in schedule.rank_actions:
        for act in acts:
            duration = float(action_ms(act))
            if not duration >= 0 or duration == math.inf:
                raise ValueError(f"action {act} has duration {duration}; need a finite number "
                                 f">= 0")
            (fwd if act.kind == FORWARD else bwd)[act.mb, act.stage] = duration
    return PipelineCosts(fwd, bwd)


def transfer_order_times(schedule: Schedule, timing: SimResult
                         ) -> list[list[tuple[float, int]]]:
    """Per rank, the (start, sequence) key of each compute from a simulation of `schedule`:
    a linear order consistent with dependencies, used to order transfers."""
    if timing.schedule is not schedule and \
            timing.schedule.rank_actions != schedule.rank_actions:
        raise ValueError(f"timing is a simulation of schedule {timing.schedule.name!r}, whose "
                         f"action order differs from {schedule.name!r}")
    return [timing.order_keys(rank) for rank in range(schedule.num_ranks)]


def needs_input(stage_layers: tuple[str, ...]) -> bool:
    """Whether a stage reads micro-batch data (tokens, decoder tokens or labels)."""
    return any(kind in _INPUT_LAYERS for kind in stage_layers)


def find_transfers(schedule: Schedule, micro_batches: Sequence[MicroBatch],
                   spec: ModelSpec) -> list[Transfer]:
    """All cross-rank messages, each with its producer and consumer compute positions."""
    layers = spec.stage_layers(schedule.num_stages)
    where = {act: (rank, i) for rank, acts in enumerate(schedule.rank_actions)
             for i, act in enumerate(acts)}
    s2r = schedule.stage_to_rank
    transfers = []
    for (rank, i), act in ((v, k) for k, v in where.items()):
        if act.kind == FORWARD and act.stage + 1 < schedule.num_stages:
            to_stage, kind, shape_stage = act.stage + 1, ACTIVATION, act.stage
        elif act.kind == BACKWARD and act.stage > 0:
            to_stage, kind, shape_stage = act.stage - 1, GRADIENT, act.stage - 1
        else:
            continue
        if s2r[to_stage] == rank:
            continue
        mb = micro_batches[act.mb]
        shapes = stage_output_shapes(layers[shape_stage], mb.num_rows, mb.seq_len,
                                     mb.dec_seq_len, spec.hidden_size)
        consumer = where[Action(to_stage, act.kind, act.mb)]
        transfers.append(Transfer(kind, act.mb, act.stage, to_stage, rank, consumer[0],
                                  shapes, i, consumer[1]))
    return transfers


def order_pairs(transfers: list[Transfer]) -> dict[tuple[int, int], list[Transfer]]:
    """Group transfers per directed pair in the producing compute's order on the sender."""
    pairs: dict[tuple[int, int], list[Transfer]] = {}
    for t in transfers:
        pairs.setdefault((t.src, t.dst), []).append(t)
    for seq in pairs.values():
        seq.sort(key=lambda t: t.producer_pos)
        for k, t in enumerate(seq):
            t.pair_index = k
    return pairs


def place_receives(pairs: Mapping[tuple[int, int], list[Transfer]], recv_lookahead: int) -> None:
    """Receive start `recv_lookahead` computes before its consumer, never after a later
    receive of the same pair (so both sides post in the same order)."""
    for seq in pairs.values():
        latest = None
        for t in reversed(seq):
            gap = max(0, t.consumer_pos - recv_lookahead)
            latest = gap if latest is None else min(gap, latest)
            t.recv_gap = latest


def place_send_finishes(pairs: Mapping[tuple[int, int], list[Transfer]],
                        times: Sequence[Sequence[tuple[float, int]]]) -> None:
    """Send finish before the first compute Z on src, at least two computes after the producer,
    with T(Z) > T(compute after which dst posts the receive); at the end if none."""
    for (src, dst), seq in pairs.items():
        src_times = times[src]
        for t in seq:
            after = times[dst][t.recv_gap - 1] if t.recv_gap > 0 else (float("-inf"), -1)
            gap = max(t.producer_pos + 2, bisect.bisect_right(src_times, after))
            t.send_finish_gap = min(gap, len(src_times))


# Order of sections inside a gap between two computes.
_SEND_START, _FREE_CONSUMED, _RECV_START, _SEND_FINISH, _RECV_FINISH, _LOAD = range(6)

_START_OP = {(ACTIVATION, True): SendActivationStart, (ACTIVATION, False): RecvActivationStart,
             (GRADIENT, True): SendGradStart, (GRADIENT, False): RecvGradStart}
_FINISH_OP = {(ACTIVATION, True): SendActivationFinish, (ACTIVATION, False): RecvActivationFinish,
              (GRADIENT, True): SendGradFinish, (GRADIENT, False): RecvGradFinish}


def _rank_program(actions: Sequence[Action], sends: list[Transfer],
                  recvs: list[Transfer], load_stages: set[int], recompute: Sequence[str],
                  dtype: str) -> list[Instruction]:
    """Interleave compute, transfers, loads and frees for one rank; assign buffer ids."""
    n = len(actions)
    # Per gap: (section, pair index or mb, peer, unique tag, op); sorting stops at the tag.
    gaps: list[list[tuple]] = [[] for _ in range(n + 1)]
    tag = 0
    for t in sends:
        gaps[t.producer_pos + 1].append((_SEND_START, t.pair_index, t.dst, tag, t))
        gaps[t.send_finish_gap].append((_SEND_FINISH, t.pair_index, t.dst, tag + 1, t))
        tag += 2
    backward_pos = {act: i for i, act in enumerate(actions) if act.kind == BACKWARD}
    for t in recvs:
        gaps[t.recv_gap].append((_RECV_START, t.pair_index, t.src, tag, t))
        gaps[t.consumer_pos].append((_RECV_FINISH, t.pair_index, t.src, tag + 1, t))
        # Both kinds of received buffer live until Backward(mb, recv_stage) has run; in a
        # forward-only schedule (no backward) an activation lives until its Forward has run.
        after = backward_pos.get(Action(t.recv_stage, BACKWARD, t.mb), t.consumer_pos)
        gaps[after + 1].append((_FREE_CONSUMED, t.pair_index, t.src, tag + 2, t))
        tag += 3
    loaded: set[int] = set()
    for i, act in enumerate(actions):
        if act.stage in load_stages and act.mb not in loaded:
            loaded.add(act.mb)
            gaps[i].append((_LOAD, act.mb, 0, -1, act.mb))

    out: list[Instruction] = []
    emit = out.append
    free_ids: list[int] = []
    next_id = 0
    send_buffer: dict[int, int] = {}    # id(transfer) -> buffer, per side
    recv_buffer: dict[int, int] = {}
    # Instructions are built positionally (fields: mb, stage, peer, buffer, shapes, dtype):
    # this loop makes every instruction of the plan, and keywords double its cost.
    for i in range(n + 1):
        gap = gaps[i]
        if len(gap) > 1:
            gap.sort()
        for section, _, _, _, t in gap:
            if section == _LOAD:
                emit(LoadInput(t))
            elif section == _SEND_START or section == _RECV_START:
                buf = heapq.heappop(free_ids) if free_ids else next_id
                if buf == next_id:
                    next_id += 1
                is_send = section == _SEND_START
                if is_send:
                    send_buffer[id(t)] = buf
                    emit(_START_OP[t.kind, True](t.mb, t.send_stage, t.dst, buf, t.shapes, dtype))
                else:
                    recv_buffer[id(t)] = buf
                    emit(_START_OP[t.kind, False](t.mb, t.recv_stage, t.src, buf, t.shapes,
                                                  dtype))
            elif section == _SEND_FINISH:
                buf = send_buffer.pop(id(t))
                emit(_FINISH_OP[t.kind, True](t.mb, t.send_stage, t.dst, buf, t.shapes, dtype))
                emit(FreeBuffer(t.mb, buf))
                heapq.heappush(free_ids, buf)
            elif section == _RECV_FINISH:
                emit(_FINISH_OP[t.kind, False](t.mb, t.recv_stage, t.src, recv_buffer[id(t)],
                                               t.shapes, dtype))
            else:   # _FREE_CONSUMED
                buf = recv_buffer.pop(id(t))
                emit(FreeBuffer(t.mb, buf))
                heapq.heappush(free_ids, buf)
        if i < n:
            stage, kind, mb = actions[i]
            emit(Forward(mb, stage, recompute[mb]) if kind == FORWARD else Backward(mb, stage))
    return out


def lower(schedule: Schedule, micro_batches: Sequence[MicroBatch], spec: ModelSpec,
          dtype: str = "float32", iteration: int = 0, dp_rank: int = 0,
          recv_lookahead: int = 1,
          action_ms: Callable[[Action], float] | None = None,
          timing: SimResult | None = None) -> list[ExecutionPlan]:
    """Lower `schedule` over `micro_batches` to one ExecutionPlan per pipeline rank.

    `recv_lookahead`: receives are posted this many computes before their consumer (>= 0;
    larger overlaps more but holds more receive buffers). Transfers are ordered by a simulation
    of the schedule (simulator.simulate): `timing`, one already made (e.g. by the schedule
    search), else one played here with per-action durations `action_ms` (e.g.
    action_ms_from_costs(costs); default default_costs)."""
    if len(micro_batches) != schedule.num_micro_batches:
        raise ValueError(f"schedule {schedule.name!r} is for {schedule.num_micro_batches} "
                         f"micro-batches, got {len(micro_batches)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if recv_lookahead < 0:
        raise ValueError(f"recv_lookahead must be >= 0, got {recv_lookahead}")
    if len(set(schedule.stage_to_rank)) != schedule.num_ranks or \
            set(schedule.stage_to_rank) != set(range(schedule.num_ranks)):
        raise ValueError(f"schedule {schedule.name!r}: stage_to_rank {schedule.stage_to_rank} "
                         f"does not use exactly ranks 0..{schedule.num_ranks - 1}")
    validate_schedule(schedule)
    layers = spec.stage_layers(schedule.num_stages)
    if timing is None:
        costs = (default_costs(micro_batches, schedule.num_stages) if action_ms is None
                 else costs_of_durations(schedule, action_ms))
        timing = simulate(schedule, costs, validate=False)
    times = transfer_order_times(schedule, timing)
    transfers = find_transfers(schedule, micro_batches, spec)
    pairs = order_pairs(transfers)
    place_receives(pairs, recv_lookahead)
    place_send_finishes(pairs, times)
    sends: list[list[Transfer]] = [[] for _ in range(schedule.num_ranks)]
    recvs: list[list[Transfer]] = [[] for _ in range(schedule.num_ranks)]
    for t in transfers:
        sends[t.src].append(t)
        recvs[t.dst].append(t)
    load_stages = {s for s, kinds in enumerate(layers) if needs_input(kinds)}
    recompute = [mb.recompute for mb in micro_batches]
    plans = []
    for rank, actions in enumerate(schedule.rank_actions):
        program = _rank_program(actions, sends[rank], recvs[rank], load_stages,
                                recompute, dtype)
        plans.append(ExecutionPlan(iteration=iteration, dp_rank=dp_rank, pp_rank=rank,
                                   stage_to_rank=tuple(schedule.stage_to_rank),
                                   schedule=schedule.name, micro_batches=tuple(micro_batches),
                                   instructions=tuple(program), dtype=dtype))
    return plans
