"""Plan checker: accepts lowered plans, rejects every kind of broken plan with a reason."""
import dataclasses
import random

import pytest
from hypothesis import given, settings, strategies as st

from dynapipe_ext.plan.instructions import (Backward, ExecutionPlan, Forward, FreeBuffer, Instruction,
                                       LoadInput, RecvActivationFinish, RecvActivationStart,
                                       RecvGradFinish, SendActivationStart)
from dynapipe_ext.plan.lowering import lower
from dynapipe_ext.plan.plan_checker import PlanError, check_plans
from dynapipe_ext.schedule.schedule_ir import wave_layout
from tests.planning.test_lowering import gpt_spec, micro_batches, one_f_one_b, random_schedule


def lowered(num_ranks=3, num_mbs=4, seed=0):
    rng = random.Random(seed)
    return lower(one_f_one_b(num_ranks, num_mbs), micro_batches(num_mbs, rng),
                 gpt_spec(num_ranks))


def with_instructions(plans, rank, instructions):
    out = list(plans)
    out[rank] = dataclasses.replace(plans[rank], instructions=tuple(instructions))
    return out


def index_of(plan, pred):
    return next(i for i, ins in enumerate(plan.instructions) if pred(ins))


def edit(plans, rank, pred, new):
    """Replace the first instruction of `rank` matching `pred` by new(instruction) (a list)."""
    ins = list(plans[rank].instructions)
    i = index_of(plans[rank], pred)
    ins[i:i + 1] = new(ins[i])
    return with_instructions(plans, rank, ins)


def test_lowered_plans_pass():
    plans = lowered()
    check_plans(plans)
    check_plans(plans, gpt_spec(3))


def test_sends_out_of_order_on_a_pair_are_reported():
    plans = lowered()
    ins = list(plans[0].instructions)
    a = index_of(plans[0], lambda i: type(i) is SendActivationStart and i.mb == 0)
    b = index_of(plans[0], lambda i: type(i) is SendActivationStart and i.mb == 1)
    ins[a], ins[b] = (dataclasses.replace(ins[b], buffer=ins[a].buffer),
                      dataclasses.replace(ins[a], buffer=ins[b].buffer))
    with pytest.raises(PlanError, match="rank 0.*matched in order|rank 0.*before the compute"):
        check_plans(with_instructions(plans, 0, ins))


def test_receive_with_other_shapes_is_reported():
    plans = edit(lowered(), 1, lambda i: type(i) is RecvActivationStart,
                 lambda i: [dataclasses.replace(i, shapes=((1, 2, 3),))])
    with pytest.raises(PlanError, match=r"rank 1, instruction \d+ .*"
                                        r"(differs from its start|shapes)"):
        check_plans(plans)


def test_shapes_disagreeing_with_the_model_are_reported_with_spec():
    plans = lowered()
    for rank, prefix in ((0, "SendActivation"), (1, "RecvActivation")):
        plans = with_instructions(plans, rank, [
            dataclasses.replace(i, shapes=((9, 9, 9),))
            if type(i).__name__.startswith(prefix) and i.mb == 0 else i
            for i in plans[rank].instructions])
    check_plans(plans)                    # consistent between the two sides ...
    with pytest.raises(PlanError, match=r"rank 0.*\(\(9, 9, 9\),\) but the model hands over"):
        check_plans(plans, gpt_spec(3))   # ... but not what the model produces


def test_dtype_mismatch_is_reported():
    plans = edit(lowered(), 0, lambda i: type(i) is SendActivationStart,
                 lambda i: [dataclasses.replace(i, dtype="bfloat16")])
    with pytest.raises(PlanError, match="dtype 'bfloat16' differs"):
        check_plans(plans)


def test_missing_free_is_a_leak():
    plans = lowered()
    ins = list(plans[2].instructions)
    last_free = max(k for k, i in enumerate(ins) if type(i) is FreeBuffer)
    del ins[last_free]
    with pytest.raises(PlanError, match="rank 2.*1 buffer.*never freed"):
        check_plans(with_instructions(plans, 2, ins))
    plans = edit(lowered(), 2, lambda i: type(i) is FreeBuffer, lambda i: [])
    with pytest.raises(PlanError, match="rank 2.*is still live"):
        check_plans(plans)


def test_double_free_is_reported():
    plans = edit(lowered(), 2, lambda i: type(i) is FreeBuffer, lambda i: [i, i])
    with pytest.raises(PlanError, match="rank 2.*not live"):
        check_plans(plans)


def test_freeing_a_received_activation_before_backward_is_reported():
    plans = lowered()
    ins = list(plans[1].instructions)
    recv = index_of(plans[1], lambda i: type(i) is RecvActivationFinish and i.mb == 0)
    free = index_of(plans[1], lambda i: type(i) is FreeBuffer and i.buffer == ins[recv].buffer)
    moved = ins.pop(free)
    ins.insert(recv + 2, moved)           # right after Forward(mb=0, stage=1)
    with pytest.raises(PlanError, match="rank 1.*freed before Backward"):
        check_plans(with_instructions(plans, 1, ins))


def test_buffer_overwritten_while_live_is_reported():
    plans = lowered()
    first = index_of(plans[1], lambda i: type(i) is RecvActivationStart and i.mb == 0)
    second = index_of(plans[1], lambda i: type(i) is RecvActivationStart and i.mb == 1)
    buf = plans[1].instructions[first].buffer
    ins = [dataclasses.replace(i, buffer=buf)
           if k == second or (type(i) is RecvActivationFinish and i.mb == 1) else i
           for k, i in enumerate(plans[1].instructions)]
    with pytest.raises(PlanError, match=f"rank 1.*buffer {buf} is still live"):
        check_plans(with_instructions(plans, 1, ins))


def test_missing_backward_and_backward_before_forward_are_reported():
    plans = edit(lowered(), 0, lambda i: type(i) is Backward and i.mb == 3, lambda i: [])
    with pytest.raises(PlanError, match=r"rank 0.*Backward\(mb=3, stage=0\)"):
        check_plans(plans)
    plans = lowered()
    ins = list(plans[2].instructions)
    f = index_of(plans[2], lambda i: type(i) is Forward and i.mb == 0)
    b = index_of(plans[2], lambda i: type(i) is Backward and i.mb == 0)
    ins[f], ins[b] = ins[b], ins[f]
    with pytest.raises(PlanError, match="rank 2.*Backward before its Forward"):
        check_plans(with_instructions(plans, 2, ins))


def test_forward_without_load_input_on_a_data_stage_is_reported():
    plans = edit(lowered(), 0, lambda i: type(i) is LoadInput and i.mb == 2, lambda i: [])
    with pytest.raises(PlanError, match="rank 0.*no LoadInput"):
        check_plans(plans)


def test_wrong_peer_and_foreign_stage_are_reported():
    plans = edit(lowered(), 0, lambda i: type(i) is SendActivationStart,
                 lambda i: [dataclasses.replace(i, peer=2)])
    with pytest.raises(PlanError, match="rank 0.*peer 2 does not hold stage 1"):
        check_plans(plans)
    plans = edit(lowered(), 0, lambda i: type(i) is Forward,
                 lambda i: [dataclasses.replace(i, stage=1)])
    with pytest.raises(PlanError, match="rank 0.*stage 1 is not held by rank 0"):
        check_plans(plans)


def test_receive_waited_before_the_peer_sends_is_a_deadlock():
    # Two ranks, one micro-batch: rank 0 waits for the gradient before sending the
    # activation that produces it.
    plans = lower(one_f_one_b(2, 1), micro_batches(1, random.Random(0)), gpt_spec(2))
    ins = list(plans[0].instructions)
    send = index_of(plans[0], lambda i: type(i) is SendActivationStart)
    wait = index_of(plans[0], lambda i: type(i) is RecvGradFinish)
    moved = ins.pop(send)
    ins.insert(wait, moved)
    plans = with_instructions(plans, 0, ins)
    with pytest.raises(PlanError, match="deadlock.*rank [01] at instruction.*waits for rank"):
        check_plans(plans)


def move_after(instructions, moved, anchor, count=1):
    """Move `count` instructions starting at the first matching `moved` to after `anchor`."""
    ins = list(instructions)
    i = next(k for k, x in enumerate(ins) if moved(x))
    block = ins[i:i + count]
    del ins[i:i + count]
    j = next(k for k, x in enumerate(ins) if anchor(x))
    ins[j + 1:j + 1] = block
    return ins


def is_(name, mb):
    return lambda i: type(i).__name__ == name and i.mb == mb


def test_send_waited_before_the_peer_can_post_the_receive_is_a_deadlock():
    # Rank 0 waits for its activation send of mb 1 before posting the gradient receive of mb 0;
    # rank 1 waits for that gradient send before posting the activation receive of mb 1.
    plans = lower(one_f_one_b(2, 2), micro_batches(2, random.Random(0)), gpt_spec(2),
                  recv_lookahead=0)
    check_plans(plans)
    r0 = move_after(plans[0].instructions, is_("SendActivationFinish", 1),
                    is_("SendActivationStart", 1), count=2)          # finish + its free
    r0 = move_after(r0, is_("RecvGradStart", 0), lambda i: type(i) is FreeBuffer and i.mb == 1)
    r1 = move_after(plans[1].instructions, is_("SendGradFinish", 0),
                    is_("SendGradStart", 0), count=2)
    assert r1.index(next(filter(is_("SendGradFinish", 0), r1))) < \
        r1.index(next(filter(is_("RecvActivationStart", 1), r1)))
    plans = with_instructions(with_instructions(plans, 0, r0), 1, r1)
    with pytest.raises(PlanError, match="deadlock.*rank [01] at instruction.*"
                                        "(SendActivationFinish|SendGradFinish)"):
        check_plans(plans)


class Mystery(Instruction):
    pass


def test_unknown_instruction_and_inconsistent_headers_are_reported():
    plans = edit(lowered(), 1, lambda i: type(i) is Forward, lambda i: [Mystery(mb=0), i])
    with pytest.raises(PlanError,
                       match=r"rank 1, instruction \d+ \(Mystery.*unknown instruction type"):
        check_plans(plans)
    plans = lowered()
    plans[2] = dataclasses.replace(plans[2], iteration=5)
    with pytest.raises(PlanError, match="rank 2: iteration 5 differs"):
        check_plans(plans)
    with pytest.raises(PlanError, match="rank order"):
        check_plans(list(reversed(lowered())))
    with pytest.raises(PlanError, match="no plans"):
        check_plans([])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), num_ranks=st.integers(2, 4), num_mbs=st.integers(1, 6),
       wave=st.booleans(), data=st.data())
def test_deleting_any_single_instruction_is_caught(seed, num_ranks, num_mbs, wave, data):
    rng = random.Random(seed)
    layout = wave_layout(num_ranks, 1) if wave else tuple(range(num_ranks))
    sched = random_schedule(layout, num_mbs, rng)
    plans = lower(sched, micro_batches(num_mbs, rng), gpt_spec(len(layout)))
    check_plans(plans)
    rank = data.draw(st.integers(0, num_ranks - 1))
    ins = list(plans[rank].instructions)
    del ins[data.draw(st.integers(0, len(ins) - 1))]
    with pytest.raises(PlanError):
        check_plans(with_instructions(plans, rank, ins))


def test_plans_as_execution_plan_type_is_required():
    with pytest.raises(PlanError, match="not an ExecutionPlan"):
        check_plans([lowered()[0], "rank 1"] + lowered()[2:])
    assert isinstance(lowered()[0], ExecutionPlan)
