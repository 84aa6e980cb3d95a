"""Validation: forward-only plans from the same planner, the held-out --split, token-weighted
per-task losses, and (slow) a pipelined, data-parallel run whose per-task validation losses
match a single-process forward of the same samples."""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from dynapipe_ext.plan.instructions import (Backward, Forward, FreeBuffer, RecvActivationFinish,
                                       RecvGradStart, SendGradStart)
from dynapipe_ext.plan.iteration_planner import plan_iteration
from dynapipe_ext.plan.lowering import lower
from dynapipe_ext.batching.microbatch import MicroBatch
from dynapipe_ext.plan.plan_checker import PlanError, check_plans
from dynapipe_ext.schedule.schedule_ir import ScheduleError, forward_only, validate_schedule
from dynapipe_ext.schedule.schedules import one_f_one_b
from dynapipe_ext.plan.serialization import plan_from_bytes
from dynapipe_ext.schedule.simulator import PipelineCosts, simulate
from megatron.data.split import parse_split, split_counts, split_indices
from megatron.training.arguments import parse_args
from megatron.training.evaluation import grouped_losses, task_families, token_tasks
from megatron.training.train_logging import ValidationStats, validation_line
from tests.planning.test_iteration_planner import (GPT, decoded, gpt_config, gpt_lengths, t5_config,
                                          t5_lengths)
from tests.integration.test_data_blend import two_prefixes  # noqa: F401
from tests.training.test_training import REPO, TINY_MODEL, env_with_repo, sp_dataset  # noqa: F401


# ---------------------------------------------------------------- forward-only plans

@pytest.mark.parametrize("schedule", ["auto", "1f1b", "adaptive", "interleaved", "wave"])
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


# ---------------------------------------------------------------- --split



def test_split_counts_are_megatrons():
    shares = parse_split("969,30,1")
    assert split_counts(1000, shares) == (969, 30, 1)
    assert split_counts(288, shares) == (279, 9, 0)
    assert split_counts(10, parse_split("8/2")) == (8, 2, 0)
    assert parse_split("1") == (1.0, 0.0, 0.0)


@pytest.mark.parametrize("text", ["a,b", "1,2,3,4", "0,0,0", "-1,2", ""])
def test_bad_split_is_an_error_naming_the_flag(text):
    with pytest.raises(ValueError, match="--split"):
        parse_split(text)


def test_split_parts_are_disjoint_cover_every_sample_and_spread_over_tasks():
    groups = np.random.default_rng(0).integers(0, 5, 10_000)
    train, valid, test = split_indices(groups, parse_split("969,30,1"), seed=1)
    assert (len(train), len(valid), len(test)) == (9690, 300, 10)
    assert not set(train) & set(valid) and not set(train) & set(test) \
        and not set(valid) & set(test)
    assert np.array_equal(np.sort(np.concatenate([train, valid, test])), np.arange(10_000))
    per_task = np.bincount(groups[valid], minlength=5)
    assert np.all(np.abs(per_task - 0.03 * np.bincount(groups)) <= 1.5), per_task
    again = split_indices(groups, parse_split("969,30,1"), seed=1)
    other = split_indices(groups, parse_split("969,30,1"), seed=2)
    assert np.array_equal(again[1], valid) and not np.array_equal(other[1], valid)


# ---------------------------------------------------------------- losses and reports



def test_token_tasks_follow_packed_rows():
    samples = {0: (np.zeros(3), np.zeros(3), np.ones(3)), 1: (np.zeros(2),) * 2 + (np.ones(2),),
               2: (np.zeros(4), np.zeros(4), np.ones(4))}
    owner = token_tasks(MicroBatch(rows=((0, 1), (2,)), seq_len=6), samples, np.array([7, 8, 9]), 6,
                        pad_task=99)
    assert owner.tolist() == [[7, 7, 7, 8, 8, 99], [9, 9, 9, 9, 99, 99]]


def test_grouped_losses_are_token_weighted_and_ordered_by_tokens():
    got = grouped_losses([10.0, 6.0, 3.0, 0.0], [5, 2, 1, 0], ["a", "b", "a", "c"])
    assert list(got) == ["a", "b"]                     # "c" has no tokens
    assert got["a"] == (pytest.approx(13.0 / 6), 6) and got["b"] == (3.0, 2)
    assert grouped_losses([1.0], [1], [""]) == {}       # no family named


def test_validation_line_and_record_name_overall_top_tasks_and_families():
    v = ValidationStats(iteration=5, loss=2.0, loss_tokens=30, samples=4, batches=2,
                        tasks={"t1": (1.5, 20), "t2": (3.0, 10)}, families={"NIv2": (2.0, 30)},
                        eval_s=0.5, plan_s=0.25)
    line = validation_line(v, top=1)
    assert line.startswith("[valid] iteration 5 | loss 2.0000 | ppl 7.39")
    assert "t1 1.5000 (20) (+1 more)" in line and "families: NIv2 2.0000 (30)" in line
    assert "planning 0.25s" in line
    record = v.record()
    assert record["iteration"] == 5 and record["validation"]["tasks"]["t2"] == \
        {"loss": 3.0, "tokens": 10}


# ---------------------------------------------------------------- flags and data



def gpt_args(*extra) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--train-iters", "4", "--data-path", "x", *extra]


@pytest.mark.parametrize("extra, message", [
    (("--eval-interval", "5"), "--eval-interval needs validation data"),
    (("--eval-interval", "5", "--split", "100,0,0"), "holds out no validation samples"),
    (("--split", "9,1", "--valid-data-path", "y"), "not both"),
    (("--eval-interval", "5", "--split", "9,1", "--eval-iters", "0"), "--eval-iters must be > 0"),
    (("--split", "9,x"), "--split '9,x'"),
])
def test_bad_validation_flags_are_one_clear_error(extra, message, capsys):
    with pytest.raises(SystemExit):
        parse_args("gpt", gpt_args(*extra), has_cuda=False)
    assert message in capsys.readouterr().err


def test_default_run_has_no_validation():
    cfg = parse_args("gpt", gpt_args(), has_cuda=False)
    assert (cfg.eval_interval, cfg.split, cfg.valid_data_path) == (0, None, None)


def test_split_holds_validation_samples_out_of_every_training_batch(sp_dataset):
    from megatron.training.training import open_training_data
    cfg = parse_args("gpt", ["--num-layers", "2", "--hidden-size", "32",
                             "--num-attention-heads", "2", "--train-iters", "4",
                             "--seq-length", "128", "--tokens-per-global-batch", "1024",
                             "--split", "80,20,0", "--eval-interval", "2", *sp_dataset],
                     has_cuda=False)
    train, valid = open_training_data(cfg, 0, "train"), open_training_data(cfg, 0, "valid")
    assert train.held_out == valid.held_out == {"train": 240, "valid": 60, "test": 0}
    assert not set(train.indices) & set(valid.indices)
    drawn = {int(i) for it in range(60) for i in train.sample_ids(it)}
    assert drawn <= set(train.indices) and len(drawn) > 200    # many batches, none held out
    assert {int(i) for it in range(10) for i in valid.sample_ids(it)} <= set(valid.indices)
    names = train.dataset.task_names
    assert len({names[t] for t in valid.dataset.task_ids[valid.indices]}) > 10
    families = task_families(valid.dataset)
    assert all(families) and len(set(families)) > 1         # every task names its source
    assert {"NIv2", "CoT"} <= set(families)


def test_split_of_a_weighted_blend_holds_out_from_every_prefix(two_prefixes):  # noqa: F811
    from megatron.training.training import open_training_data
    a, b, tokenizer = two_prefixes
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--train-iters", "4", "--seq-length", "128", "--tokens-per-global-batch", "1024",
            "--data-path", "0.3", a, "0.7", b, "--split", "60,40,0", "--eval-interval", "2",
            *tokenizer]
    cfg = parse_args("gpt", argv, has_cuda=False)
    train, valid = open_training_data(cfg, 0, "train"), open_training_data(cfg, 0, "valid")
    n_a = len(train.dataset.parts[0])
    assert train.held_out == {"train": 252, "valid": 168, "test": 0}      # of 300 + 120
    assert not set(train.indices) & set(valid.indices)
    assert (valid.indices < n_a).any() and (valid.indices >= n_a).any()
    drawn = np.concatenate([train.sample_ids(i) for i in range(200)])
    assert set(drawn.tolist()) <= set(train.indices.tolist())
    assert abs(float((drawn < n_a).mean()) - 0.3) < 0.05       # the blend weights still hold
    # a (prefix, task) stream whose samples all went to validation is simply not drawn
    kept = np.bincount(train.dataset.stream_ids[train.indices],
                       minlength=len(train.sampler.rates))
    assert np.all(train.sampler.rates[kept == 0] == 0)


# ---------------------------------------------------------------- runs (slow)

def _validate(rank, world_size, model, argv):
    """build_run + one evaluation at the initial weights; returns the stats, the kinds of
    instruction this rank's validation plans hold, and whether any gradient appeared."""
    import torch
    from megatron.training.training import build_run
    cfg = parse_args(model, argv, has_cuda=False)
    run = build_run(cfg, verbose=False)
    try:
        stats = run.evaluator.evaluate(run, 0)
        again = run.evaluator.evaluate(run, 0)
        kinds = sorted({type(i).__name__ for p in run.evaluator.plans for i in p.instructions})
        grads = any(p.grad is not None or bool(getattr(p, "main_grad", torch.zeros(1)).any())
                    for m in run.modules for p in m.parameters())
        return stats, again, kinds, grads, [p.schedule for p in run.evaluator.plans]
    finally:
        run.close()


def _reference(rank, world_size, model, argv):
    """Per-task (loss sum, tokens) of the validation batches, one process, the whole model,
    every sample in its own row (batch_tensors.unsplit_micro_batch)."""
    import torch
    from megatron.model.batch_tensors import build_micro_batch, unsplit_micro_batch
    from megatron.model.init_weights import initialize_stage_weights
    from megatron.model.stages import build_rank_stages, build_transformer_config
    from megatron.base.distributed_setup import setup_model_parallel
    from megatron.training.training import model_spec, open_training_data
    cfg = parse_args(model, argv, has_cuda=False)
    setup_model_parallel(1, 1, cfg.seed)
    data = open_training_data(cfg, 0, "valid")
    spec = model_spec(cfg, data.vocab_size)
    stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec, dtype="float32"))
    initialize_stage_weights(stages, cfg.seed)
    sums: dict = {}
    for k in range(cfg.eval_iters):
        samples, ids = data.batch_samples(k), data.sample_ids(k)
        order = list(samples)
        batch = build_micro_batch(unsplit_micro_batch(order, samples, model), samples, model,
                                  data.pad_id)
        with torch.no_grad():
            losses = stages[0]((), batch).float() * batch["loss_mask"]
        for row, pos in enumerate(order):
            name = data.dataset.task_names[data.dataset.task_ids[ids[pos]]]
            total, tokens = sums.get(name, (0.0, 0))
            sums[name] = (total + float(losses[row].double().sum()),
                          tokens + int(batch["loss_mask"][row].sum()))
    return sums


@pytest.mark.slow
@pytest.mark.parametrize("model, layout, world", [
    ("gpt", ("--pipeline-model-parallel-size", "2", "--micro-batching", "dynamic"), 4),
    ("gpt", ("--micro-batching", "packing"), 1),
    ("gpt", ("--tensor-model-parallel-size", "2"), 2),
    ("t5", ("--pipeline-model-parallel-size", "2", "--decoder-seq-length", "32"), 2)])
def test_per_task_validation_losses_match_a_single_process_forward(sp_dataset, model, layout,
                                                                   world):
    from tests.multiproc import run_in_processes
    data_path = sp_dataset[sp_dataset.index("--data-path") + 1]
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "128", "--tokens-per-global-batch", "1024", "--train-iters", "2",
            "--num-planner-workers", "0", "--check-plans", "--eval-interval", "1",
            "--eval-iters", "3", "--valid-data-path", data_path, *sp_dataset, *layout]
    ranks = run_in_processes(_validate, world, (model, argv), timeout_s=400)
    reference = run_in_processes(_reference, 1, (model, argv), timeout_s=200)[0]
    stats, again, kinds, grads, schedules = ranks[0]
    untimed = [dataclasses.replace(r[0], eval_s=0.0, plan_s=0.0) for r in ranks]
    assert all(u == untimed[0] for u in untimed)     # every rank learns the same result
    assert again.loss == stats.loss and again.tasks == stats.tasks   # same batches each time
    assert all(r[2] and "Backward" not in r[2] and "SendGradStart" not in r[2] for r in ranks)
    assert not any(r[3] for r in ranks)              # no gradient from validation
    assert all(s.endswith("-fwd") for s in schedules)
    if "--pipeline-model-parallel-size" in layout:
        assert any("SendActivationStart" in r[2] for r in ranks)     # really pipelined
    assert set(stats.tasks) == set(reference) and len(reference) > 5
    for name, (total, tokens) in reference.items():
        assert stats.tasks[name][1] == tokens
        assert stats.tasks[name][0] == pytest.approx(total / tokens, rel=1e-5, abs=1e-6), name
    everything = sum(t for t, _ in reference.values()) / sum(n for _, n in reference.values())
    assert stats.loss == pytest.approx(everything, rel=1e-6)
    assert stats.loss_tokens == sum(n for _, n in reference.values())


@pytest.mark.slow
def test_quickstart_with_eval_prints_validation_and_writes_stats(sp_dataset, tmp_path):
    from tests.multiproc import free_port
    stats_file = tmp_path / "stats.jsonl"
    args = sp_dataset + TINY_MODEL + ["--pipeline-model-parallel-size", "2", "--seq-length",
                                      "128", "--train-iters", "10", "--eval-interval", "5",
                                      "--eval-iters", "2", "--split", "969,30,1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "pretrain_gpt.py", *args, "--stats-file", str(stats_file)]
    done = subprocess.run(cmd, cwd=REPO, env=env_with_repo(), capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    out = done.stdout
    assert "291 train, 9 validation, 0 test samples" in out
    lines = [line for line in out.splitlines() if line.startswith("[valid] iteration")]
    assert [line.split(" | ")[0] for line in lines] == ["[valid] iteration 5",
                                                        "[valid] iteration 10"]
    assert all("top tasks by tokens: " in line and "families: " in line for line in lines)
    records = [json.loads(line) for line in open(stats_file)]
    train = [r for r in records if "validation" not in r]
    valid = [r for r in records if "validation" in r]
    assert [r["iteration"] for r in train] == list(range(1, 11))
    assert [r["iteration"] for r in valid] == [5, 10]
    for r in valid:
        v = r["validation"]
        assert sum(t["tokens"] for t in v["tasks"].values()) == v["loss_tokens"] > 0
        assert sum(f["tokens"] for f in v["families"].values()) == v["loss_tokens"]
        assert 0 < v["loss"] < 20 and v["eval_s"] > 0
    # the evaluations ran on the weights of their iteration
    assert valid[0]["validation"]["loss"] != valid[1]["validation"]["loss"]
    assert "evaluations took" in out and "kept out of the training tokens/s" in out
