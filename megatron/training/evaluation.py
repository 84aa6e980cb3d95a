"""Validation as Megatron-LM runs it, on DynaPipe's plans.

Every --eval-interval iterations, and after the last one, the model runs --eval-iters global
batches of validation data (--valid-data-path, or the held-out share of --split) -- the same
batches each time, so evaluations compare -- through forward-only plans of the training planner
(IterationPlannerConfig.forward_only: no backward, memory for in-flight activations only), under
torch.no_grad with the modules in eval mode. Rank 0 plans these batches once, at the first
evaluation, and broadcasts the plans (plans are deterministic, but the planner's device figures
are rank 0's). The HEAD stage keeps every micro-batch's masked per-token losses; they are
summed per task on the device (every sample carries its task id), and the sums of loss x tokens
and of tokens are all-reduced over the pipeline group (only the last stage holds losses) and the
data-parallel group, so every rank gets the same token-weighted loss overall, per task, and per
task family (the task's `task_source` in the data, where the data names one). Evaluation time is
measured and reported apart: the training iterations' tokens/s never include it.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dynapipe_ext.plan.iteration_planner import IterationPlannerConfig, plan_iteration
from dynapipe_ext.plan.serialization import plan_from_bytes
from megatron.model.batch_tensors import build_micro_batch, count_loss_tokens
from megatron.training.handlers import micro_batch_order
from megatron.training.train_logging import ValidationStats


def evaluation_config(model: str, argv):
    """The trainer's config for evaluating --load: weights only (--finetune), validation on
    every call, no saving, planning inline. --train-iters is not needed (1 unless given)."""
    from megatron.training.arguments import ConfigError, parse_args
    cfg = parse_args(model, ["--train-iters", "1", "--num-planner-workers", "0", *argv],
                     prog="tools/evaluate.py")
    if not cfg.load:
        raise ConfigError("--load DIR is required: the checkpoint to evaluate")
    if cfg.save:
        raise ConfigError("--save: evaluation writes no checkpoint")
    valid = cfg.valid_data_path or (None if cfg.split else cfg.data_path)
    return dataclasses.replace(cfg, finetune=True, no_load_optim=False, no_load_rng=False,
                               valid_data_path=valid, eval_interval=1, save_interval=0)


class ValidationPlanningError(RuntimeError):
    """Rank 0 could not plan the validation batches; raised on every rank alike."""


def task_families(dataset) -> list[str]:
    """Per task id of `dataset`, the task source its samples name most ('' when none), read
    from the task table that tools/preprocess_flan.py writes (blends: over all prefixes)."""
    index = {name: t for t, name in enumerate(dataset.task_names)}
    counts = [Counter() for _ in dataset.task_names]
    for part in getattr(dataset, "parts", [dataset]):
        for task in part.table.get("tasks", []):
            sources = {k: v for k, v in (task.get("sources") or {}).items() if k}
            counts[index[task["name"]]].update(sources)
    return [c.most_common(1)[0][0] if c else "" for c in counts]


def token_tasks(micro_batch, samples, tasks, seq_len: int, pad_task: int) -> torch.Tensor:
    """[rows, seq_len] task id of every loss position of a micro-batch (packed rows hold their
    samples one after another, as build_micro_batch lays them out); pads get `pad_task`."""
    out = np.full((micro_batch.num_rows, seq_len), pad_task, dtype=np.int64)
    for r, row in enumerate(micro_batch.rows):
        at = 0
        for s in row:
            n = len(samples[s][-1])         # the loss mask spans the sample's loss positions
            out[r, at:at + n] = tasks[s]
            at += n
    return torch.from_numpy(out)


def share_plans(blobs: list[bytes] | None, error: str, count: int, device) -> list[bytes]:
    """Rank 0's `count` plan byte strings on every rank (one broadcast of the sizes, one of
    the bytes); rank 0's planning error (`error`) becomes ValidationPlanningError everywhere."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error:
            raise ValidationPlanningError(error)
        return blobs
    leader = dist.get_rank() == 0
    head = torch.zeros(count + 1, dtype=torch.int64, device=device)
    if leader:
        payload = error.encode() if error else b"".join(blobs)
        sizes = [1, len(payload)] + [0] * (count - 1) if error else [0] + [len(b) for b in blobs]
        head.copy_(torch.tensor(sizes, dtype=torch.int64))
    dist.broadcast(head, 0)
    sizes = head.cpu().tolist()
    data = torch.empty(max(sum(sizes[1:]), 1), dtype=torch.uint8, device=device)
    if leader:
        data[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    dist.broadcast(data, 0)
    raw = data.cpu().numpy().tobytes()
    if sizes[0]:
        raise ValidationPlanningError(raw[:sizes[1]].decode(errors="replace"))
    starts = np.cumsum([0] + sizes[1:])
    return [raw[a:b] for a, b in zip(starts[:-1], starts[1:])]


def reduce_over_stages_and_replicas(sums: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over the pipeline group (only the last stage holds losses) and the
    data-parallel group (each replica ran its share of every batch), in place."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(sums, group=parallel_state.get_pipeline_model_parallel_group())
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
    return sums


def grouped_losses(loss_sums, token_counts, names) -> dict[str, tuple[float, int]]:
    """name -> (token-weighted loss, tokens) summed over the entries sharing a name, most
    tokens first; names without tokens are left out."""
    loss, tokens = Counter(), Counter()
    for name, total, n in zip(names, loss_sums, token_counts):
        if name and n > 0:
            loss[name] += float(total)
            tokens[name] += float(n)
    return {name: (loss[name] / n, int(round(n))) for name, n in tokens.most_common()}


def held_out_summary(split: str, counts: dict) -> str:
    """What --split made of --data-path, e.g. for the start-up lines."""
    return (f"--split {split} of --data-path: {counts['train']} train, {counts['valid']} "
            f"validation, {counts['test']} test samples (spread over the tasks; no sample in "
            f"two parts)")


def repeats(valid_data, batches: int) -> str:
    """'; ...' when the first `batches` validation batches draw more samples than the
    validation set holds (--eval-iters past it: samples repeat), else ''."""
    drawn = sum(len(valid_data.sample_ids(k)) for k in range(batches))
    held = len(valid_data.dataset) if valid_data.indices is None else len(valid_data.indices)
    if drawn <= held:
        return ""
    return (f"; the {batches} batches draw {drawn} samples, more than the {held} validation "
            f"samples (--eval-iters past the validation set: samples repeat)")


class Evaluator:
    """Runs validation for a training run (see the module docstring)."""

    def __init__(self, data, planner_config: IterationPlannerConfig, interval: int,
                 iters: int, train_iters: int):
        if not planner_config.forward_only:
            raise ValueError("the evaluator needs a forward_only planner config")
        self.data = data                 # training.TrainingData of the validation samples
        self.config = planner_config
        self.interval, self.iters, self.train_iters = interval, iters, train_iters
        self.task_names = list(data.dataset.task_names)
        self.families = task_families(data.dataset)
        self.plans = None                # this rank's ExecutionPlan per validation batch

    def due(self, iterations_done: int) -> bool:
        """Whether to evaluate after `iterations_done` iterations."""
        return iterations_done % self.interval == 0 or iterations_done == self.train_iters

    @staticmethod
    def describe(cfg, valid_data) -> str:
        """The run's validation set-up in one line (rank 0 prints it)."""
        if valid_data.held_out:
            source = held_out_summary(cfg.split, valid_data.held_out)
        else:
            source = f"--valid-data-path: {len(valid_data.dataset)} samples"
        return (f"[valid] every {cfg.eval_interval} iterations and after the last: "
                f"{cfg.eval_iters} validation batches of <= {cfg.tokens_per_global_batch} "
                f"tokens, forward-only plans; {source}{repeats(valid_data, cfg.eval_iters)}")

    def _make_plans(self, layout) -> list:
        dp, pp = self.config.dp, self.config.pp
        blobs, error = None, ""
        if layout.rank == 0:
            try:
                made = [plan_iteration(k, self.data.batch_lengths(k), self.config)
                        for k in range(self.iters)]
                blobs = [p.plan_bytes[(d, q)] for p in made for d in range(dp)
                         for q in range(pp)]
            except Exception as err:     # every rank must learn of it, not wait for plans
                error = f"{type(err).__name__}: {err}"
        blobs = share_plans(blobs, error, self.iters * dp * pp, layout.device)
        return [plan_from_bytes(blobs[(k * dp + layout.dp_rank) * pp + layout.pp_rank])
                for k in range(self.iters)]

    def _run_batch(self, run, k: int, plan, sums: torch.Tensor) -> None:
        """Validation batch k through this rank's forward-only plan; adds its per-task sums
        of loss x tokens (row 0) and tokens (row 1) to `sums` on the HEAD stage."""
        samples = self.data.batch_samples(k)
        tasks = self.data.dataset.task_ids[self.data.sample_ids(k)]
        runtime = run.handlers.runtime
        keys, micro_batches = runtime.batch_keys, plan.micro_batches
        runtime.reset(lambda mb: build_micro_batch(micro_batches[mb], samples, run.cfg.model,
                                                   self.data.pad_id, keys),
                      max(1, count_loss_tokens(samples, list(samples))),
                      micro_batch_order(plan), forward_only=True)
        run.executor.run(plan)
        runtime.check_drained()
        for mb, (losses, mask) in runtime.token_losses.items():
            owner = token_tasks(micro_batches[mb], samples, tasks, losses.shape[1],
                                len(self.task_names)).to(losses.device).flatten()
            sums[0].index_add_(0, owner, losses.flatten().double())
            sums[1].index_add_(0, owner, mask.flatten().double())
        runtime.token_losses.clear()

    def evaluate(self, run, iterations_done: int) -> ValidationStats:
        """Validation after `iterations_done` iterations; the same result on every rank."""
        start = time.perf_counter()
        plan_s = 0.0
        if self.plans is None:
            self.plans = self._make_plans(run.layout)
            plan_s = time.perf_counter() - start
        sums = torch.zeros((2, len(self.task_names) + 1), dtype=torch.float64,
                           device=run.layout.device)
        modes = [module.training for module in run.modules]
        for module in run.modules:
            module.eval()                # no dropout in validation, as in Megatron
        try:
            for k, plan in enumerate(self.plans):
                self._run_batch(run, k, plan, sums)
        finally:
            for module, mode in zip(run.modules, modes):
                module.train(mode)
        loss_sums, tokens = reduce_over_stages_and_replicas(sums).cpu().numpy()
        loss_sums, tokens = loss_sums[:-1], tokens[:-1]     # the last column collects pads
        total = float(tokens.sum())
        return ValidationStats(
            iteration=iterations_done, loss=float(loss_sums.sum()) / max(total, 1.0),
            loss_tokens=int(round(total)),
            samples=sum(len(self.data.sample_ids(k)) for k in range(self.iters)),
            batches=self.iters,
            tasks=grouped_losses(loss_sums, tokens, self.task_names),
            families=grouped_losses(loss_sums, tokens, self.families),
            eval_s=time.perf_counter() - start, plan_s=plan_s)
