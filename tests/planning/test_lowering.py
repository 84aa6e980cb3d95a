"""Lowering: compute schedules -> per-rank execution plans that the plan checker accepts."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from dynapipe_ext.plan.instructions import (Backward, Forward, FreeBuffer, LoadInput,
                                       RecvActivationFinish, RecvActivationStart, RecvGradFinish,
                                       RecvGradStart, SendActivationFinish, SendActivationStart,
                                       SendGradFinish, SendGradStart)
from dynapipe_ext.plan.lowering import (action_ms_from_costs, costs_of_durations, lower,
                                  transfer_order_times)
from dynapipe_ext.batching.microbatch import MicroBatch
from dynapipe_ext.costs.model_spec import ModelSpec
from dynapipe_ext.plan.plan_checker import check_plans
from dynapipe_ext.schedule.schedule_ir import (BACKWARD, FORWARD, Action, Schedule, interleaved_layout,
                                      linear_layout, wave_layout)
from dynapipe_ext.schedule.simulator import CommModel, simulate

STARTS = (SendActivationStart, RecvActivationStart, SendGradStart, RecvGradStart)
FINISHES = (SendActivationFinish, RecvActivationFinish, SendGradFinish, RecvGradFinish)
SEND_STARTS = (SendActivationStart, SendGradStart)
RECV_STARTS = (RecvActivationStart, RecvGradStart)


# ---- schedules built by hand (independent of dynapipe_ext.schedule.schedules) ----

def one_f_one_b(num_ranks: int, num_mbs: int) -> Schedule:
    """Textbook 1F1B on a linear layout: P-1-r warm-up forwards, then alternate."""
    ranks = []
    for r in range(num_ranks):
        warmup = min(num_ranks - 1 - r, num_mbs)
        acts = [Action(r, FORWARD, m) for m in range(warmup)]
        nxt = warmup
        for b in range(num_mbs):
            if nxt < num_mbs:
                acts.append(Action(r, FORWARD, nxt))
                nxt += 1
            acts.append(Action(r, BACKWARD, b))
        ranks.append(tuple(acts))
    return Schedule("1f1b", linear_layout(num_ranks), tuple(ranks), num_mbs)


def random_schedule(layout: tuple, num_mbs: int, rng: random.Random) -> Schedule:
    """A random valid schedule: a random topological order of all actions, split per rank."""
    num_stages, num_ranks = len(layout), max(layout) + 1
    done: set = set()
    ready = [Action(0, FORWARD, m) for m in range(num_mbs)]
    ranks: list[list] = [[] for _ in range(num_ranks)]
    while ready:
        act = ready.pop(rng.randrange(len(ready)))
        done.add(act)
        ranks[layout[act.stage]].append(act)
        if act.kind == FORWARD and act.stage + 1 < num_stages:
            ready.append(Action(act.stage + 1, FORWARD, act.mb))
        elif act.kind == FORWARD:
            ready.append(Action(act.stage, BACKWARD, act.mb))
        elif act.stage > 0:
            ready.append(Action(act.stage - 1, BACKWARD, act.mb))
    return Schedule("random", layout, tuple(map(tuple, ranks)), num_mbs)


def micro_batches(num: int, rng: random.Random, t5: bool = False) -> list[MicroBatch]:
    out, sample = [], 0
    for _ in range(num):
        rows = rng.randint(1, 4)
        ids = tuple((sample + i,) for i in range(rows))
        sample += rows
        out.append(MicroBatch(rows=ids, seq_len=8 * rng.randint(1, 16),
                              dec_seq_len=8 * rng.randint(1, 4) if t5 else 0,
                              time_ms=rng.uniform(0.5, 5.0),
                              recompute=rng.choice(("none", "selective", "full"))))
    return out


def gpt_spec(num_stages: int) -> ModelSpec:
    return ModelSpec("gpt", num_layers=2 * num_stages, hidden_size=16, num_attention_heads=2,
                     vocab_size=64)


def t5_spec(num_stages: int) -> ModelSpec:
    return ModelSpec("t5", num_layers=num_stages, num_decoder_layers=num_stages, hidden_size=16,
                     num_attention_heads=2, vocab_size=64)


def transfers_by_pair(plans):
    """(src, dst) -> [(kind, mb)] of sends on src, and the same for receives on dst."""
    sends, recvs = {}, {}
    for p in plans:
        for ins in p.instructions:
            if isinstance(ins, SEND_STARTS):
                sends.setdefault((p.pp_rank, ins.peer), []).append(
                    (type(ins) is SendActivationStart, ins.mb))
            elif isinstance(ins, RECV_STARTS):
                recvs.setdefault((ins.peer, p.pp_rank), []).append(
                    (type(ins) is RecvActivationStart, ins.mb))
    return sends, recvs


# ---- tests ----

def test_1f1b_plans_pass_checker_and_keep_compute_order():
    sched = one_f_one_b(4, 8)
    mbs = micro_batches(8, random.Random(0))
    plans = lower(sched, mbs, gpt_spec(4))
    check_plans(plans, gpt_spec(4))
    for plan, acts in zip(plans, sched.rank_actions):
        computes = [(ins.stage, "F" if type(ins) is Forward else "B", ins.mb)
                    for ins in plan.instructions if type(ins) in (Forward, Backward)]
        assert computes == [tuple(a) for a in acts]


def test_sends_and_receives_of_each_pair_are_in_the_same_order():
    rng = random.Random(1)
    sched = random_schedule(interleaved_layout(3, 2), 6, rng)
    plans = lower(sched, micro_batches(6, rng), gpt_spec(6))
    sends, recvs = transfers_by_pair(plans)
    assert sends.keys() == recvs.keys() and sends
    for pair in sends:
        assert sends[pair] == recvs[pair]


def test_transfer_shapes_follow_the_stage_cut_and_t5_decoder_stages_move_two_tensors():
    spec = t5_spec(4)
    mbs = micro_batches(3, random.Random(2), t5=True)
    plans = lower(one_f_one_b(4, 3), mbs, spec)
    check_plans(plans, spec)
    for plan in plans:
        for ins in plan.instructions:
            if type(ins) is SendActivationStart:
                mb = mbs[ins.mb]
                enc = (mb.seq_len, mb.num_rows, 16)
                dec = (mb.dec_seq_len, mb.num_rows, 16)
                # stages 0, 1 hold encoder layers; stage 2 starts the decoder.
                assert ins.shapes == ((enc,) if ins.stage < 2 else (enc, dec))
            if type(ins) is SendGradStart:
                assert len(ins.shapes) == (1 if ins.stage <= 2 else 2)


def test_stages_on_the_same_rank_exchange_nothing():
    layout = wave_layout(3, 1)        # stages 0..5 on ranks 0 1 2 2 1 0
    sched = random_schedule(layout, 4, random.Random(3))
    plans = lower(sched, micro_batches(4, random.Random(3)), gpt_spec(6))
    check_plans(plans, gpt_spec(6))
    for plan in plans:
        for ins in plan.instructions:
            if isinstance(ins, STARTS + FINISHES):
                assert ins.peer != plan.pp_rank
    # The turning point 2 -> 3 is on rank 2: no activation leaves stage 2.
    assert not any(type(i) is SendActivationStart and i.stage == 2
                   for p in plans for i in p.instructions)


def test_load_input_once_per_micro_batch_only_on_data_ranks_before_first_use():
    spec = t5_spec(4)                 # data stages: 0 (embedding), 2 (decoder emb.), 3 (head)
    plans = lower(one_f_one_b(4, 5), micro_batches(5, random.Random(4), t5=True), spec)
    for plan in plans:
        loads = [i.mb for i in plan.instructions if type(i) is LoadInput]
        if plan.pp_rank == 1:
            assert loads == []
            continue
        assert sorted(loads) == list(range(5))
        first_compute = {}
        for idx, ins in enumerate(plan.instructions):
            if type(ins) in (Forward, Backward):
                first_compute.setdefault(ins.mb, idx)
        for idx, ins in enumerate(plan.instructions):
            if type(ins) is LoadInput:
                assert idx < first_compute[ins.mb]


def test_receives_are_posted_before_the_compute_preceding_their_consumer():
    rng = random.Random(5)
    plans = lower(one_f_one_b(4, 8), micro_batches(8, rng), gpt_spec(4))
    for plan in plans:
        computes_seen, start_at = 0, {}
        for ins in plan.instructions:
            if type(ins) in (Forward, Backward):
                computes_seen += 1
            elif isinstance(ins, RECV_STARTS):
                start_at[(type(ins) is RecvActivationStart, ins.mb)] = computes_seen
            elif type(ins) in (RecvActivationFinish, RecvGradFinish):
                consumer = computes_seen         # index of the compute that follows
                assert start_at[(type(ins) is RecvActivationFinish, ins.mb)] <= \
                    max(consumer - 1, 0)


def test_send_finish_waits_at_least_one_compute_after_its_start():
    plans = lower(one_f_one_b(4, 8), micro_batches(8, random.Random(6)), gpt_spec(4))
    overlapped = 0
    for plan in plans:
        n_compute = sum(type(i) in (Forward, Backward) for i in plan.instructions)
        computes_seen, started = 0, {}
        for ins in plan.instructions:
            if type(ins) in (Forward, Backward):
                computes_seen += 1
            elif isinstance(ins, SEND_STARTS):
                started[(type(ins), ins.mb)] = computes_seen
            elif type(ins) in (SendActivationFinish, SendGradFinish):
                start_type = SendActivationStart if type(ins) is SendActivationFinish \
                    else SendGradStart
                began = started[(start_type, ins.mb)]
                assert computes_seen > began or computes_seen == n_compute
                overlapped += computes_seen > began
    assert overlapped > 0


def test_buffer_ids_are_reused_and_bounded_by_peak_live_buffers():
    plans = lower(one_f_one_b(4, 16), micro_batches(16, random.Random(7)), gpt_spec(4))
    for plan in plans:
        live, peak, ids = set(), 0, set()
        for ins in plan.instructions:
            if isinstance(ins, STARTS):
                live.add(ins.buffer)
                ids.add(ins.buffer)
                peak = max(peak, len(live))
            elif type(ins) is FreeBuffer:
                live.remove(ins.buffer)
        assert ids == set(range(peak))
        assert peak < 16


def test_forward_carries_the_micro_batch_recompute_mode_and_plan_headers():
    mbs = micro_batches(4, random.Random(8))
    plans = lower(one_f_one_b(2, 4), mbs, gpt_spec(2), dtype="bfloat16", iteration=7,
                  dp_rank=3)
    for plan in plans:
        assert (plan.iteration, plan.dp_rank, plan.dtype) == (7, 3, "bfloat16")
        assert plan.micro_batches == tuple(mbs)
        for ins in plan.instructions:
            if type(ins) is Forward:
                assert ins.recompute == mbs[ins.mb].recompute
            if hasattr(ins, "dtype"):
                assert ins.dtype == "bfloat16"


def test_single_stage_plan_has_no_transfers():
    plans = lower(one_f_one_b(1, 3), micro_batches(3, random.Random(9)), gpt_spec(1))
    check_plans(plans, gpt_spec(1))
    assert [type(i) for i in plans[0].instructions] == [LoadInput, Forward, Backward] * 3


@pytest.mark.parametrize("mutate, message", [
    (lambda s: Schedule(s.name, s.stage_to_rank, (s.rank_actions[1],) + s.rank_actions[1:],
                        s.num_micro_batches), "held by rank"),
    (lambda s: Schedule(s.name, s.stage_to_rank, (s.rank_actions[0][:-1],) + s.rank_actions[1:],
                        s.num_micro_batches), "1 action.*missing"),
    (lambda s: Schedule(s.name, s.stage_to_rank, (tuple(reversed(s.rank_actions[0])),)
                        + s.rank_actions[1:], s.num_micro_batches), "cannot complete"),
])
def test_malformed_schedules_are_rejected_with_a_reason(mutate, message):
    sched = mutate(one_f_one_b(2, 3))
    with pytest.raises(ValueError, match=message):
        lower(sched, micro_batches(3, random.Random(0)), gpt_spec(2))


def test_wrong_micro_batch_count_and_dtype_are_rejected():
    sched = one_f_one_b(2, 3)
    with pytest.raises(ValueError, match="3 micro-batches, got 2"):
        lower(sched, micro_batches(2, random.Random(0)), gpt_spec(2))
    with pytest.raises(ValueError, match="dtype"):
        lower(sched, micro_batches(3, random.Random(0)), gpt_spec(2), dtype="int8")


def order_keys(sched: Schedule, action_ms) -> dict:
    """Action -> the (start, sequence) key lowering orders transfers by."""
    timing = simulate(sched, costs_of_durations(sched, action_ms))
    keys = transfer_order_times(sched, timing)
    return {a: k for acts, ks in zip(sched.rank_actions, keys) for a, k in zip(acts, ks)}


def test_transfer_order_times_respect_dependencies_and_rank_order():
    sched = random_schedule(wave_layout(2, 2), 5, random.Random(10))
    start = order_keys(sched, lambda a: 1.0 if a.kind == FORWARD else 2.0)
    time = {a: t for a, (t, _) in start.items()}
    for acts in sched.rank_actions:
        assert all(start[a] < start[b] for a, b in zip(acts, acts[1:]))
    for m in range(5):
        for s in range(1, 8):
            assert time[Action(s, FORWARD, m)] >= time[Action(s - 1, FORWARD, m)] + 1.0
            assert time[Action(s - 1, BACKWARD, m)] >= time[Action(s, BACKWARD, m)] + 2.0


def test_zero_durations_still_give_a_dependency_order_and_valid_plans():
    sched = random_schedule(wave_layout(3, 1), 4, random.Random(12))
    start = order_keys(sched, lambda a: 0.0)
    for m in range(4):
        for s in range(1, 6):
            assert start[Action(s, FORWARD, m)] > start[Action(s - 1, FORWARD, m)]
            assert start[Action(s - 1, BACKWARD, m)] > start[Action(s, BACKWARD, m)]
    plans = lower(sched, micro_batches(4, random.Random(12)), gpt_spec(6),
                  action_ms=lambda a: 0.0)
    check_plans(plans, gpt_spec(6))
    with pytest.raises(ValueError, match="duration -1.0"):
        lower(sched, micro_batches(4, random.Random(12)), gpt_spec(6), action_ms=lambda a: -1.0)


def test_a_given_simulation_orders_transfers_like_its_durations():
    """lower(timing=simulate(...)) equals lower(action_ms=...) for the same durations, and a
    simulation of another order of the actions is refused."""
    import numpy as np
    from dynapipe_ext.schedule.simulator import PipelineCosts
    rng = random.Random(13)
    sched = random_schedule(interleaved_layout(3, 2), 6, rng)
    mbs = micro_batches(6, rng)
    table = np.array([[rng.choice([0.0, 0.5, 3.0]) for _ in range(6)] for _ in range(6)])
    costs = PipelineCosts(table, 2 * table, comm_bytes=np.full((6, 6), 1e3))
    by_durations = lower(sched, mbs, gpt_spec(6), action_ms=action_ms_from_costs(costs))
    by_timing = lower(sched, mbs, gpt_spec(6), timing=simulate(sched, costs))
    assert by_timing == by_durations
    # Communication time shifts the simulated starts; the plans must still be well formed.
    slow = simulate(sched, costs, CommModel(latency_ms=2.0, bandwidth_bytes_per_ms=1.0))
    check_plans(lower(sched, mbs, gpt_spec(6), timing=slow), gpt_spec(6))
    other = random_schedule(interleaved_layout(3, 2), 6, random.Random(99))
    with pytest.raises(ValueError, match="action order differs"):
        lower(sched, mbs, gpt_spec(6), timing=simulate(other, costs))


LAYOUTS = {
    "linear": lambda p: linear_layout(p),
    "interleaved": lambda p: interleaved_layout(p, 2),
    "wave1": lambda p: wave_layout(p, 1),
    "wave2": lambda p: wave_layout(p, 2),
}


@settings(max_examples=80, deadline=None)
@given(num_ranks=st.integers(1, 5), num_mbs=st.integers(1, 9),
       layout=st.sampled_from(sorted(LAYOUTS)), model=st.sampled_from(["gpt", "t5"]),
       lookahead=st.integers(0, 3), durations=st.sampled_from(["default", "zero", "random"]),
       seed=st.integers(0, 2**16))
def test_random_schedules_lower_to_plans_the_checker_accepts(num_ranks, num_mbs, layout, model,
                                                              lookahead, durations, seed):
    rng = random.Random(seed)
    stage_to_rank = LAYOUTS[layout](num_ranks)
    spec = (gpt_spec if model == "gpt" else t5_spec)(len(stage_to_rank))
    sched = random_schedule(stage_to_rank, num_mbs, rng)
    random_ms = {}
    action_ms = {"default": None, "zero": lambda a: 0.0,
                 "random": lambda a: random_ms.setdefault(a, rng.choice([0.0, 0.5, 3.0]))}
    plans = lower(sched, micro_batches(num_mbs, rng, t5=model == "t5"), spec,
                  recv_lookahead=lookahead, action_ms=action_ms[durations])
    check_plans(plans, spec)
    sends, recvs = transfers_by_pair(plans)
    assert sends == recvs


# ---- the project's schedules (dynapipe_ext.schedule.schedules) ----

def real_schedule(kind: str, num_ranks: int, mbs, rng: random.Random):
    """(schedule, costs) of one of the planner's schedules over costs drawn from `mbs`."""
    import numpy as np
    from dynapipe_ext.schedule import schedules
    from dynapipe_ext.schedule.simulator import PipelineCosts
    num_stages = num_ranks * {"1f1b": 1, "interleaved": 2, "adaptive": 1, "wave": 2,
                              "hanayo": 4}[kind]
    base = np.array([[mb.time_ms * rng.uniform(0.8, 1.2) for _ in range(num_stages)]
                     for mb in mbs]) / (3 * num_stages)
    costs = PipelineCosts(base, 2 * base, act_bytes=base * 1000)
    if kind == "1f1b":
        return schedules.one_f_one_b(len(mbs), num_ranks), costs
    if kind == "interleaved":
        return schedules.interleaved_one_f_one_b(len(mbs), num_ranks, 2), costs
    if kind == "adaptive":
        return schedules.adaptive(costs), costs
    if kind == "hanayo":
        return schedules.hanayo(len(mbs), num_ranks, 2), costs
    return schedules.wave(len(mbs), num_ranks, 1, costs), costs


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["1f1b", "interleaved", "adaptive", "wave", "hanayo"]),
       num_ranks=st.integers(1, 4), num_mbs=st.integers(1, 10),
       model=st.sampled_from(["gpt", "t5"]), seed=st.integers(0, 2**16))
def test_planner_schedules_lower_to_plans_the_checker_accepts(kind, num_ranks, num_mbs, model,
                                                               seed):
    rng = random.Random(seed)     # any micro-batch count, interleaved included
    mbs = micro_batches(num_mbs, rng, t5=model == "t5")
    sched, costs = real_schedule(kind, num_ranks, mbs, rng)
    spec = (gpt_spec if model == "gpt" else t5_spec)(sched.num_stages)
    plans = lower(sched, mbs, spec, action_ms=action_ms_from_costs(costs))
    check_plans(plans, spec)
    assert len(plans) == num_ranks


def test_lowering_and_checking_64_micro_batches_on_8_stages_is_fast():
    import time
    from dynapipe_ext.schedule import schedules
    rng = random.Random(11)
    mbs = micro_batches(64, rng)
    sched = schedules.one_f_one_b(64, 8)
    spec = gpt_spec(8)
    timings = []
    for _ in range(5):
        t0 = time.process_time()
        check_plans(lower(sched, mbs, spec), spec)
        timings.append(time.process_time() - t0)
    # ~30 ms of CPU on one core. CPU time, not wall time: other processes on a loaded machine
    # do not add to it
    assert sorted(timings)[2] < 0.5
