"""Plan checker: proves a set of per-rank ExecutionPlans well formed before anything runs.

Checks (each failure is a PlanError naming rank, instruction index and what is wrong):
* the plans agree (ranks 0..P-1, one stage_to_rank, iteration, replica, dtype, micro-batches);
* each (mb, stage) has exactly one Forward and one Backward, on the rank holding the stage,
  forward first (forward-only plans: one Forward, and no Backward or gradient transfer);
  compute inputs are present (LoadInput on data stages, the local previous stage or a finished
  receive);
* each transfer starts then finishes once with the same peer/buffer/shapes/dtype; a send
  follows its producing compute; peers hold the neighbouring stage;
* buffers: written (by a Start) only when free, read only while live, freed exactly once per
  lifetime after its transfer finished (received activations after the stage's Backward, or
  its Forward in a forward-only plan);
* per directed pair, the k-th send on src matches the k-th receive on dst (same mb, kind,
  neighbouring stages, shapes, dtype) — in-order point-to-point matching;
* no deadlock: a rendezvous simulation (each rank in order; a Finish waits until the peer has
  started the matching op) runs every rank to its end; otherwise the wait-for cycle is reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from dynapipe_ext.plan.instructions import (Backward, ExecutionPlan, Forward, FreeBuffer, LoadInput,
                           RecvActivationFinish, RecvActivationStart, RecvGradFinish,
                           RecvGradStart, SendActivationFinish, SendActivationStart,
                           SendGradFinish, SendGradStart)
from dynapipe_ext.plan.lowering import needs_input
from dynapipe_ext.costs.model_spec import ModelSpec, stage_output_shapes


class PlanError(ValueError):
    """A set of execution plans is not well formed (message says rank, index and why)."""


# type -> (is_send, is_activation, is_start)
_TRANSFER = {SendActivationStart: (True, True, True), SendActivationFinish: (True, True, False),
             SendGradStart: (True, False, True), SendGradFinish: (True, False, False),
             RecvActivationStart: (False, True, True), RecvActivationFinish: (False, True, False),
             RecvGradStart: (False, False, True), RecvGradFinish: (False, False, False)}


def _fail(rank: int, index: int, instr, why: str) -> None:
    raise PlanError(f"rank {rank}, instruction {index} ({instr}): {why}")


def _check_headers(plans: Sequence[ExecutionPlan]) -> None:
    if not plans:
        raise PlanError("no plans to check")
    first = plans[0]
    s2r = tuple(first.stage_to_rank)
    if set(s2r) != set(range(len(plans))):
        raise PlanError(f"stage_to_rank {s2r} does not use exactly ranks 0..{len(plans) - 1} "
                        f"for {len(plans)} plans")
    for r, plan in enumerate(plans):
        if not isinstance(plan, ExecutionPlan):
            raise PlanError(f"plan {r} is a {type(plan).__name__}, not an ExecutionPlan")
        if plan.pp_rank != r:
            raise PlanError(f"plan {r} says pp_rank {plan.pp_rank}; plans must be in rank order")
        for field in ("stage_to_rank", "iteration", "dp_rank", "dtype", "schedule"):
            mine, theirs = getattr(plan, field), getattr(first, field)
            if (tuple(mine) if field == "stage_to_rank" else mine) != \
                    (tuple(theirs) if field == "stage_to_rank" else theirs):
                raise PlanError(f"rank {r}: {field} {mine!r} differs from rank 0's {theirs!r}")
        if len(plan.micro_batches) != len(first.micro_batches):
            raise PlanError(f"rank {r}: {len(plan.micro_batches)} micro-batches, rank 0 has "
                            f"{len(first.micro_batches)}")


@dataclass
class _OpenTransfer:
    """A transfer this rank started: its start instruction and index, whether it finished,
    and `order`: how many starts of its kind to the same peer came before it."""

    start: object
    index: int
    order: int
    finished: bool = False


class _Wait(NamedTuple):
    """A finish blocks until rank `peer` has run more than `after` starts counted under `key`
    ((rank, peer, is_send) of the matching op)."""

    peer: int
    key: tuple
    after: int


class _RankState:
    """What one rank's structural pass learned: its messages per pair and its waits."""

    def __init__(self):
        self.sends: dict[int, list] = {}    # dst -> [(index, instr)] of send starts, in order
        self.recvs: dict[int, list] = {}    # src -> [(index, instr)] of receive starts
        self.waits: list = []               # per instruction: None or a _Wait
        self.starts: list = []              # per instruction: None or key whose count grows


def _check_rank(plan: ExecutionPlan, num_ranks: int, stage_layers, hidden_size: int,
                data_stages: set[int], forward_only: bool = False) -> _RankState:
    """Single pass over one rank's instructions: compute order, transfers and buffers."""
    r = plan.pp_rank
    s2r = plan.stage_to_rank
    num_stages = len(s2r)
    num_mbs = len(plan.micro_batches)
    dtype = plan.dtype
    forward_done: set = set()
    backward_done: set = set()
    loaded: set = set()
    transfers: dict = {}    # (is_send, is_act, mb, stage) -> _OpenTransfer
    live: dict = {}         # buffer id -> transfer key owning it
    received: dict = {}     # (is_act, mb, stage) -> buffer id of a finished receive
    state = _RankState()
    shape_cache: dict = {}

    def holds(is_act: bool, mb: int, stage: int) -> bool:
        buf = received.get((is_act, mb, stage))
        return buf is not None and live.get(buf) == (False, is_act, mb, stage)

    def expected_shapes(mb: int, stage: int):
        key = (mb, stage)
        if key not in shape_cache:
            m = plan.micro_batches[mb]
            shape_cache[key] = stage_output_shapes(stage_layers[stage], m.num_rows, m.seq_len,
                                                   m.dec_seq_len, hidden_size)
        return shape_cache[key]

    for i, ins in enumerate(plan.instructions):
        kind = type(ins)
        wait = start = None
        mb = getattr(ins, "mb", None)
        if not isinstance(mb, int) or not 0 <= mb < num_mbs:
            _fail(r, i, ins, f"micro-batch {mb!r} outside 0..{num_mbs - 1}")
        if kind is Forward or kind is Backward:
            s = ins.stage
            if not isinstance(s, int) or not 0 <= s < num_stages or s2r[s] != r:
                _fail(r, i, ins, f"stage {s!r} is not held by rank {r}")
            if kind is Forward:
                if (mb, s) in forward_done:
                    _fail(r, i, ins, "second Forward of this micro-batch and stage")
                if s in data_stages and mb not in loaded:
                    _fail(r, i, ins, "stage reads micro-batch data but no LoadInput came before")
                if s > 0:
                    if s2r[s - 1] == r:
                        if (mb, s - 1) not in forward_done:
                            _fail(r, i, ins, f"input from local stage {s - 1} not computed yet")
                    elif not holds(True, mb, s):
                        _fail(r, i, ins, "input activation not received (no finished "
                                         "RecvActivation with a live buffer)")
                forward_done.add((mb, s))
            else:
                if forward_only:
                    _fail(r, i, ins, "Backward in a forward-only plan")
                if (mb, s) not in forward_done:
                    _fail(r, i, ins, "Backward before its Forward")
                if (mb, s) in backward_done:
                    _fail(r, i, ins, "second Backward of this micro-batch and stage")
                if s < num_stages - 1:
                    if s2r[s + 1] == r:
                        if (mb, s + 1) not in backward_done:
                            _fail(r, i, ins, f"gradient from local stage {s + 1} not computed")
                    elif not holds(False, mb, s):
                        _fail(r, i, ins, "output gradient not received (no finished RecvGrad "
                                         "with a live buffer)")
                if s > 0 and s2r[s - 1] != r and not holds(True, mb, s):
                    _fail(r, i, ins, "received input activation was freed before Backward")
                backward_done.add((mb, s))
        elif kind is LoadInput:
            if mb in loaded:
                _fail(r, i, ins, "second LoadInput of this micro-batch on this rank")
            loaded.add(mb)
        elif kind is FreeBuffer:
            buf = ins.buffer
            owner = live.get(buf)
            if owner is None:
                _fail(r, i, ins, f"buffer {buf!r} is not live (never written or already freed)")
            entry = transfers[owner]
            if not entry.finished:
                _fail(r, i, ins, f"buffer {buf} freed before its transfer finished")
            is_send, is_act, tmb, tstage = owner
            user, used = (("Forward", forward_done) if forward_only
                          else ("Backward", backward_done))
            if not is_send and (tmb, tstage) not in used:
                _fail(r, i, ins, f"received buffer {buf} freed before {user}(mb={tmb}, "
                                 f"stage={tstage}) used it")
            if ins.mb != tmb:
                _fail(r, i, ins, f"buffer {buf} belongs to micro-batch {tmb}")
            del live[buf]
        elif kind in _TRANSFER:
            is_send, is_act, is_start = _TRANSFER[kind]
            if forward_only and not is_act:
                _fail(r, i, ins, "gradient transfer in a forward-only plan")
            s, peer, buf = ins.stage, ins.peer, ins.buffer
            if not isinstance(s, int) or not 0 <= s < num_stages or s2r[s] != r:
                _fail(r, i, ins, f"stage {s!r} is not held by rank {r}")
            other = s + 1 if is_send == is_act else s - 1
            if not 0 <= other < num_stages:
                _fail(r, i, ins, f"stage {s} has no neighbour stage {other} in this direction")
            if peer != s2r[other] or peer == r or not 0 <= peer < num_ranks:
                _fail(r, i, ins, f"peer {peer!r} does not hold stage {other} (rank "
                                 f"{s2r[other]} does) or is this rank")
            if ins.dtype != dtype:
                _fail(r, i, ins, f"dtype {ins.dtype!r} differs from the plan's {dtype!r}")
            key = (is_send, is_act, mb, s)
            if is_start:
                if key in transfers:
                    _fail(r, i, ins, "transfer started twice")
                if buf in live:
                    _fail(r, i, ins, f"buffer {buf} is still live (held by "
                                     f"{transfers[live[buf]].start})")
                if not isinstance(buf, int) or buf < 0:
                    _fail(r, i, ins, f"buffer id {buf!r} is not a non-negative integer")
                if is_send and (mb, s) not in (forward_done if is_act else backward_done):
                    _fail(r, i, ins, "send before the compute that produces its tensors")
                if stage_layers is not None:
                    shape_stage = s if is_act == is_send else s - 1
                    want = expected_shapes(mb, shape_stage)
                    if tuple(ins.shapes) != want:
                        _fail(r, i, ins, f"shapes {ins.shapes} but the model hands over {want}")
                seq = (state.sends if is_send else state.recvs).setdefault(peer, [])
                transfers[key] = _OpenTransfer(ins, i, len(seq))
                live[buf] = key
                seq.append((i, ins))
                start = (r, peer, is_send)
            else:
                entry = transfers.get(key)
                if entry is None:
                    _fail(r, i, ins, "finish without a start")
                if entry.finished:
                    _fail(r, i, ins, "transfer finished twice")
                begun = entry.start
                if (begun.peer, begun.buffer, tuple(begun.shapes), begun.dtype) != \
                        (peer, buf, tuple(ins.shapes), ins.dtype):
                    _fail(r, i, ins, f"differs from its start at instruction {entry.index} "
                                     f"({begun}) in peer, buffer, shapes or dtype")
                if live.get(buf) != key:
                    _fail(r, i, ins, f"buffer {buf} no longer holds this transfer")
                entry.finished = True
                if not is_send:
                    received[(is_act, mb, s)] = buf
                # A finish waits for the peer to have started its (k+1)-th matching op.
                wait = _Wait(peer, (peer, r, not is_send), entry.order)
        else:
            _fail(r, i, ins, f"unknown instruction type {kind.__name__}")
        state.waits.append(wait)
        state.starts.append(start)

    n = len(plan.instructions)
    required = [(forward_done, "Forward")] + ([] if forward_only
                                              else [(backward_done, "Backward")])
    for s in range(num_stages):
        if s2r[s] != r:
            continue
        for mb in range(num_mbs):
            for done, what in required:
                if (mb, s) not in done:
                    _fail(r, n, "end of plan", f"{what}(mb={mb}, stage={s}) is missing")
    for key, entry in transfers.items():
        if not entry.finished:
            _fail(r, entry.index, entry.start, "transfer started but never finished")
    if live:
        buf, key = next(iter(live.items()))
        _fail(r, n, "end of plan", f"{len(live)} buffer(s) never freed, e.g. buffer {buf} of "
                                   f"{transfers[key].start}")
    return state


def _match_pairs(plans: Sequence[ExecutionPlan], states: Sequence[_RankState]) -> None:
    """The k-th send src -> dst must match the k-th receive on dst from src."""
    for src, st in enumerate(states):
        for dst in set(st.sends) | {d for d, o in enumerate(states) if src in o.recvs}:
            sends = st.sends.get(dst, [])
            recvs = states[dst].recvs.get(src, [])
            for k in range(max(len(sends), len(recvs))):
                if k >= len(sends):
                    i, ins = recvs[k]
                    _fail(dst, i, ins, f"receive #{k} from rank {src} has no matching send "
                                       f"(rank {src} sends only {len(sends)} to rank {dst})")
                if k >= len(recvs):
                    i, ins = sends[k]
                    _fail(src, i, ins, f"send #{k} to rank {dst} has no matching receive "
                                       f"(rank {dst} receives only {len(recvs)} from rank {src})")
                (si, s), (ri, rv) = sends[k], recvs[k]
                is_act = type(s) is SendActivationStart
                ok = (is_act == (type(rv) is RecvActivationStart) and s.mb == rv.mb
                      and rv.stage == (s.stage + 1 if is_act else s.stage - 1))
                if not ok:
                    _fail(src, si, s, f"send #{k} to rank {dst} is matched in order by rank "
                                      f"{dst}'s instruction {ri} ({rv}), a different message")
                if tuple(s.shapes) != tuple(rv.shapes) or s.dtype != rv.dtype:
                    _fail(src, si, s, f"shapes/dtype {s.shapes}/{s.dtype} differ from the "
                                      f"receive on rank {dst} instruction {ri}: "
                                      f"{rv.shapes}/{rv.dtype}")


def _simulate(plans: Sequence[ExecutionPlan], states: Sequence[_RankState]) -> None:
    """Rendezvous run of all ranks; a PlanError with the wait-for cycle if it gets stuck."""
    num_ranks = len(plans)
    pos = [0] * num_ranks
    started: dict = {}      # (rank, peer, is_send) -> how many such starts ran
    waiters: dict = {}      # same key -> ranks blocked on it
    todo = list(range(num_ranks))
    while todo:
        r = todo.pop()
        waits, starts, n = states[r].waits, states[r].starts, len(plans[r].instructions)
        i = pos[r]
        while i < n:
            w = waits[i]
            if w is not None and started.get(w.key, 0) <= w.after:
                waiters.setdefault(w.key, []).append(r)
                break
            key = starts[i]
            if key is not None:
                started[key] = started.get(key, 0) + 1
                if key in waiters:
                    todo.extend(waiters.pop(key))
            i += 1
        pos[r] = i
    stuck = [r for r in range(num_ranks) if pos[r] < len(plans[r].instructions)]
    if not stuck:
        return
    lines = []
    r = stuck[0]
    seen: list[int] = []
    while r not in seen and r in stuck:
        seen.append(r)
        i = pos[r]
        peer = states[r].waits[i].peer
        lines.append(f"rank {r} at instruction {i} ({plans[r].instructions[i]}) waits for rank "
                     f"{peer} to start the matching op; rank {peer} is at instruction "
                     f"{pos[peer]}")
        r = peer
    raise PlanError("deadlock under in-order point-to-point matching: " + "; ".join(lines))


def check_plans(plans: Sequence[ExecutionPlan], spec: ModelSpec | None = None,
                forward_only: bool = False) -> None:
    """Raise PlanError unless `plans` (one per pipeline rank, in rank order) are well formed.
    With `spec`, transfer shapes are also checked against the model's stage cut.
    `forward_only`: evaluation plans (schedule_ir.forward_only), which must hold no backward."""
    _check_headers(plans)
    num_stages = len(plans[0].stage_to_rank)
    if spec is not None:
        stage_layers, hidden = spec.stage_layers(num_stages), spec.hidden_size
        data_stages = {s for s, kinds in enumerate(stage_layers) if needs_input(kinds)}
    else:
        stage_layers, hidden = None, 0
        data_stages = {0, num_stages - 1}
    states = [_check_rank(plan, len(plans), stage_layers, hidden, data_stages, forward_only)
              for plan in plans]
    _match_pairs(plans, states)
    _simulate(plans, states)
