"""What a run reports each iteration: loss, real tokens/s, padding efficiency, micro-batch
shapes, time spent waiting for plans and peak memory; a progress line on stdout and, when
TensorBoard's backend is importable, the same numbers as scalars. Validation results
(megatron/training/evaluation.py) get their own line, their own stats-file records (a JSON line
{"iteration": N, "validation": {...}}) and TensorBoard's validation/ scalars."""
from __future__ import annotations

import json
import math
import os
import resource
import sys
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from megatron.training.step_timing import shares_line


@dataclass(frozen=True)
class IterationStats:
    iteration: int           # 1-based count of completed iterations
    train_iters: int
    loss: float
    lr: float
    grad_norm: float
    real_tokens: int         # sample tokens of the global batch (no pads)
    token_slots: int         # tokens in the micro-batch tensors, pads included
    num_micro_batches: int
    shapes: str              # e.g. "4x96 2x200 1x512"
    plan_wait_s: float
    iteration_s: float
    peak_memory_bytes: int
    time_parts: dict | None = None   # this rank's seconds per step_timing.PARTS
    executor_cpu_s: float = 0.0      # this rank's main-thread CPU time in the executor

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.iteration_s if self.iteration_s > 0 else 0.0

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.token_slots if self.token_slots else 1.0


@dataclass(frozen=True)
class ValidationStats:
    iteration: int           # completed training iterations when it ran
    loss: float              # token-weighted over all validation batches
    loss_tokens: int
    samples: int
    batches: int
    tasks: dict              # task name -> (loss, loss tokens), most tokens first
    families: dict           # task family (task source) -> (loss, loss tokens)
    eval_s: float            # wall time of this evaluation (planning included)
    plan_s: float            # of which planning the validation batches (first time only)

    @property
    def ppl(self) -> float:
        """exp(loss), uncapped (Megatron caps the exponent at 20, which hid how bad a loss
        was); inf past the float range."""
        try:
            return math.exp(self.loss)
        except OverflowError:
            return math.inf

    def record(self) -> dict:
        """The stats-file record: {"iteration": N, "validation": {...}}."""
        def table(losses: dict) -> dict:
            return {name: {"loss": loss, "tokens": tokens}
                    for name, (loss, tokens) in losses.items()}
        body = dict(asdict(self), ppl=self.ppl, tasks=table(self.tasks),
                    families=table(self.families))
        return {"iteration": body.pop("iteration"), "validation": body}


def validation_line(v: ValidationStats, top: int = 5, label: str | None = None) -> str:
    """Overall validation loss, then the `top` tasks (and families) with the most tokens;
    `label` replaces the leading '[valid] iteration N'."""
    def listing(losses: dict) -> str:
        shown = [f"{name} {loss:.4f} ({tokens:,})" for name, (loss, tokens)
                 in list(losses.items())[:top]]
        more = len(losses) - top
        return ", ".join(shown) + (f" (+{more} more)" if more > 0 else "")
    line = (f"{label or f'[valid] iteration {v.iteration}'} | loss {v.loss:.4f} | "
            f"ppl {v.ppl:.2f} | "
            f"{v.loss_tokens:,} loss tokens in {v.samples} samples ({v.batches} batches) | "
            f"eval {v.eval_s:.2f}s" + (f" (planning {v.plan_s:.2f}s)" if v.plan_s else "") +
            f" | top tasks by tokens: {listing(v.tasks)}")
    if v.families:
        line += f" | families: {listing(v.families)}"
    return line


def shapes_summary(micro_batches) -> str:
    """Micro-batch shapes as 'rows x seq' (T5: 'rows x enc/dec'), most frequent first."""
    def shape(mb) -> str:
        if mb.dec_seq_len:
            return f"{mb.num_rows}x{mb.seq_len}/{mb.dec_seq_len}"
        return f"{mb.num_rows}x{mb.seq_len}"
    counts = Counter(shape(mb) for mb in micro_batches)
    parts = [f"{n}*{s}" if n > 1 else s for s, n in counts.most_common()]
    return " ".join(parts[:6]) + (f" (+{len(parts) - 6} more)" if len(parts) > 6 else "")


def token_slots(micro_batches) -> int:
    """Token positions in all micro-batch tensors (encoder + decoder for T5)."""
    return sum(sum(mb.slots()) for mb in micro_batches)


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: peak bytes allocated by torch; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def progress_line(s: IterationStats) -> str:
    return (f"iter {s.iteration}/{s.train_iters} | loss {s.loss:.4f} | lr {s.lr:.2e} | "
            f"grad norm {s.grad_norm:.3f} | {s.tokens_per_s:,.0f} tokens/s | "
            f"padding eff {s.padding_efficiency:.2f} | {s.num_micro_batches} micro-batches "
            f"[{s.shapes}] | plan wait {s.plan_wait_s:.3f}s | {s.iteration_s:.2f}s/iter | "
            f"peak mem {s.peak_memory_bytes / 2**20:,.0f} MiB")


def run_summary(history: list[IterationStats]) -> str:
    """One closing line: throughput and the share of time spent waiting for plans, both over
    the iterations after the first (the first one waits for the planners to start)."""
    steady = history[1:] or history
    seconds = sum(s.iteration_s for s in steady)
    wait = sum(s.plan_wait_s for s in steady)
    tokens = sum(s.real_tokens for s in steady)
    share = 100.0 * wait / seconds if seconds > 0 else 0.0
    return (f"[train] done: {len(history)} iterations | after the first: "
            f"{tokens / seconds if seconds > 0 else 0.0:,.0f} tokens/s, plan wait {wait:.3f}s of "
            f"{seconds:.2f}s ({share:.2f}% of iteration time)")


def open_tensorboard(directory: str | None):
    """A SummaryWriter when a directory was asked for and TensorBoard is installed, else None."""
    if not directory:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(f"[train] --tensorboard-dir {directory}: tensorboard is not installed "
              f"(pip install tensorboard); scalars are only printed", file=sys.stderr)
        return None
    return SummaryWriter(log_dir=directory)


class TrainLogger:
    """Prints a progress line every `interval` iterations and mirrors it to TensorBoard."""

    def __init__(self, interval: int, tensorboard_dir: str | None = None, enabled: bool = True,
                 stream=sys.stdout, stats_file: str | None = None):
        self.interval = interval
        self.enabled = enabled
        self.stream = stream
        self.stats_file = stats_file if enabled else None
        if self.stats_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.stats_file)), exist_ok=True)
        self.writer = open_tensorboard(tensorboard_dir) if enabled else None
        self.history: list[IterationStats] = []
        self.validation: list[ValidationStats] = []

    def log(self, stats: IterationStats) -> None:
        self.history.append(stats)
        if not self.enabled:
            return
        if stats.iteration % self.interval == 0 or stats.iteration == stats.train_iters:
            print(progress_line(stats), file=self.stream, flush=True)
        if self.stats_file:
            record = dict(asdict(stats), tokens_per_s=stats.tokens_per_s,
                          padding_efficiency=stats.padding_efficiency)
            with open(self.stats_file, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in (("loss", stats.loss), ("lr", stats.lr),
                                ("grad_norm", stats.grad_norm),
                                ("tokens_per_s", stats.tokens_per_s),
                                ("padding_efficiency", stats.padding_efficiency),
                                ("micro_batches", stats.num_micro_batches),
                                ("plan_wait_s", stats.plan_wait_s),
                                ("iteration_s", stats.iteration_s),
                                ("peak_memory_mib", stats.peak_memory_bytes / 2**20)):
                self.writer.add_scalar(f"train/{name}", value, stats.iteration)

    def log_validation(self, v: ValidationStats) -> None:
        """Validation line, stats-file record and TensorBoard scalars (rank 0)."""
        self.validation.append(v)
        if not self.enabled:
            return
        print(validation_line(v), file=self.stream, flush=True)
        if self.stats_file:
            with open(self.stats_file, "a") as f:
                f.write(json.dumps(v.record()) + "\n")
        if self.writer is not None:
            for name, value in (("loss", v.loss), ("ppl", v.ppl), ("eval_s", v.eval_s)):
                self.writer.add_scalar(f"validation/{name}", value, v.iteration)
            for group, losses in (("tasks", v.tasks), ("families", v.families)):
                for name, (loss, _) in losses.items():
                    self.writer.add_scalar(f"validation/{group}/{name}", loss, v.iteration)

    def log_time_parts(self, per_rank: list[dict]) -> None:
        """Where each rank's iteration time went (step_timing), summed over the iterations
        after the first: one line per rank (each iteration's stats-file record holds rank 0's
        parts of that iteration)."""
        if not self.enabled or not any(per_rank):
            return
        for rank, parts in enumerate(per_rank):
            print(f"[train] rank {rank}: {shares_line(parts)}", file=self.stream, flush=True)

    def close(self, finished: bool = True) -> None:
        """End the log: the run summary and validation line only if the run `finished` (a
        failed run's error is its last word, never a "done")."""
        if self.enabled and self.history and finished:
            print(run_summary(self.history), file=self.stream, flush=True)
        if self.enabled and self.validation and finished:
            seconds = sum(v.eval_s for v in self.validation)
            print(f"[valid] {len(self.validation)} evaluations took {seconds:.2f}s, kept out of "
                  f"the training tokens/s; last loss {self.validation[-1].loss:.4f}",
                  file=self.stream, flush=True)
        if self.writer is not None:
            self.writer.close()
