"""Validation: forward-only plans from the same planner, the held-out --split, token-weighted
per-task losses, and (slow) a pipelined, data-parallel run whose per-task validation losses
match a single-process forward of the same samples."""
import dataclasses

import numpy as np
import pytest

from dynapipe_ext.instructions import (Backward, Forward, FreeBuffer, RecvActivationFinish,
                                       RecvGradStart, SendGradStart)
from dynapipe_ext.iteration_planner import plan_iteration
from dynapipe_ext.lowering import lower
from dynapipe_ext.microbatch import MicroBatch
from dynapipe_ext.plan_checker import PlanError, check_plans
from dynapipe_ext.schedule_ir import ScheduleError, forward_only, validate_schedule
from dynapipe_ext.schedules import one_f_one_b
from dynapipe_ext.serialization import plan_from_bytes
from dynapipe_ext.simulator import PipelineCosts, simulate
from tests.test_iteration_planner import (GPT, decoded, gpt_config, gpt_lengths, t5_config,
                                          t5_lengths)


# ---------------------------------------------------------------- forward-only plans

@pytest.mark.parametrize("schedule", ["auto", "1f1b", "adaptive", "wave"])
@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_forward_only_plans_pass_the_checker_and_hold_no_backward(model, schedule):
    base = gpt_config(schedule) if model == "gpt" else t5_config(schedule)
    config = dataclasses.replace(base, forward_only=True)     # check_plans=True in both
    lengths = gpt_lengths(5) if model == "gpt" else t5_lengths(5)
    plan = plan_iteration(5, lengths, config)
    train = plan_iteration(5, lengths, base)
    assert plan.batch_plan == train.batch_plan          # the same split as training
    for dp_rank in range(config.dp):
        plans = decoded(plan, dp_rank, config.pp)
        check_plans(plans, GPT if model == "gpt" else config.spec, forward_only=True)
        kinds = {type(i) for p in plans for i in p.instructions}
        assert Backward not in kinds and SendGradStart not in kinds and RecvGradStart not in kinds
        forwards = sorted((i.mb, i.stage) for p in plans for i in p.instructions
                          if isinstance(i, Forward))
        stages = len(plans[0].stage_to_rank)
        assert forwards == [(m, s) for m in range(len(plans[0].micro_batches))
                            for s in range(stages)]
        assert all(p.schedule.endswith("-fwd") for p in plans)
        # training plans are still the checker's full plans, and not forward-only ones
        with pytest.raises(PlanError, match="(Backward|gradient transfer) in a forward-only plan"):
            check_plans(decoded(train, dp_rank, config.pp), config.spec, forward_only=True)


def test_forward_only_schedule_keeps_no_activation_past_its_forward():
    costs = PipelineCosts(np.ones((4, 2)), 2 * np.ones((4, 2)), act_bytes=10 * np.ones((4, 2)),
                          peak_bytes=np.ones((4, 2)))
    train = one_f_one_b(4, 2)
    evaluation = forward_only(train)
    validate_schedule(evaluation)
    trained, evaluated = simulate(train, costs), simulate(evaluation, costs)
    assert trained.peak_memory_bytes == (21.0, 11.0)    # rank 0 keeps 2 micro-batches (1F1B)
    assert evaluated.peak_memory_bytes == (11.0, 11.0)  # in flight: one forward at a time
    assert evaluated.makespan_ms == 5.0                 # 4 forwards + 1 of pipeline fill
    partial = dataclasses.replace(train, rank_actions=(train.rank_actions[0][:-1],
                                                       train.rank_actions[1]))
    with pytest.raises(ScheduleError, match="missing"):
        validate_schedule(partial)                      # a lost backward is still an error


def test_checker_rejects_a_received_activation_freed_before_its_forward():
    mbs = [MicroBatch(rows=((0,), (1,)), seq_len=16), MicroBatch(rows=((2,),), seq_len=32)]
    plans = lower(forward_only(one_f_one_b(2, 2)), mbs, GPT)
    check_plans(plans, GPT, forward_only=True)
    rank1 = list(plans[1].instructions)
    finish = next(k for k, i in enumerate(rank1) if isinstance(i, RecvActivationFinish))
    free = next(k for k, i in enumerate(rank1) if isinstance(i, FreeBuffer) and k > finish)
    rank1.insert(finish + 1, rank1.pop(free))           # free between receive and Forward
    bad = dataclasses.replace(plans[1], instructions=tuple(rank1))
    with pytest.raises(PlanError, match="freed before Forward"):
        check_plans([plans[0], bad], GPT, forward_only=True)


def test_forward_only_plans_serialise_like_training_plans():
    config = dataclasses.replace(gpt_config("1f1b"), forward_only=True)
    plan = plan_iteration(2, gpt_lengths(2), config)
    first = plan_from_bytes(plan.plan_bytes[(0, 0)])
    assert first.schedule == "1f1b-fwd" and first.iteration == 2
