#!/usr/bin/env python
"""Training throughput of every micro-batching strategy on the same model, data and parallel
layout: real training iterations of the project's training loop (`train_step`) under padding,
packing (block-diagonal mask), packing with per-segment attention, the same packing of rows
packed ahead over a window of the data stream (packing+window: dataset-level packing, the
trainer's --packing-window) and dynamic (DynaPipe) micro-batching, after warm-up iterations.

    python tools/bench_throughput.py --data-path DATA/flan --tokenizer-model DATA/sp.model \\
        --models gpt t5 --max-lengths 512 1024 2048 4096 --output docs/bench_throughput.json

The parent launches one `torchrun --nproc-per-node N` group per (model, max length); inside it
every strategy runs in turn (same processes, same weights, same global batches but
packing+window's, which are whole rows of its window), so ratios are only taken between runs of one invocation. Each strategy plans with the run's cost model and
picks its schedule (auto: the faster of 1F1B and adaptive) and recompute mode per micro-batch;
padding gets its best rows per micro-batch by predicted time over the timed batches, packing
per batch (the planner's search); each packing takes the packer with the most real tokens per
slot on its own timed batches. The JSON (rewritten after every (model, max length)) records
its provenance: commit, UTC date, exact command, machine, load average before and after.
Recorded per run:
real tokens/s (sample tokens, no pads; wall time from a barrier before the first measured
iteration to one after the last), padding efficiency (encoder / decoder apart), peak memory
per rank, micro-batch counts and shapes, planning time and plan-wait time.

`bench_throughput.py report RESULT.json [--projection P.json] --markdown docs/BENCHMARKS.md
--plots docs` writes the tables and plots (between the throughput markers of BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dynapipe_ext.report.doc_sections import write_section  # noqa: E402
from dynapipe_ext.report.throughput import (STRATEGIES, add_ratios, merge_rounds,  # noqa: E402
                                            percent, report_markdown)
from dynapipe_ext.batching.planners import ATTENTION_COSTING  # noqa: E402
from dynapipe_ext.plan.iteration_planner import PIPELINE_SCHEDULES  # noqa: E402
from tools.benchlib.launch import run_group  # noqa: E402
from tools.benchlib.ports import free_port  # noqa: E402
from tools.benchlib.provenance import (cpu_model, provenance_end,  # noqa: E402
                                       provenance_start)
from tools.benchlib.throughput_plots import plot_padding, plot_speedup  # noqa: E402

# ============================================================================ configuration

def decoder_length(max_len: int) -> int:
    """T5 decoder max length for an encoder max length (as bench_planner: max(128, L/4))."""
    return max(128, max_len // 4)


WINDOW = "packing+window"    # packing+segment-attn on rows packed ahead (--packing-window)


def packer_of(job: dict, strategy: str) -> str:
    """The packer a strategy's rows are packed with: the window's for packing+window."""
    return job["window_packing_algorithm"] if strategy == WINDOW else job["packing_algorithm"]


def trainer_model(model: str) -> str:
    """The trainer of a bench model: T5's, or GPT's (GPT-2-style "gpt", Llama-style "llama")."""
    return "t5" if model == "t5" else "gpt"


def llama_flags(hidden_size: int, heads: int) -> list[str]:
    """A Llama-style GPT of this size, with Megatron-LM's flags: rotary positions, SwiGLU (ffn
    8/3 x hidden, a multiple of 64), grouped-query attention (half as many key / value heads),
    RMSNorm, no linear biases, untied output layer."""
    ffn = -(-8 * hidden_size // 3 // 64) * 64
    return ["--position-embedding-type", "rope", "--swiglu", "--ffn-hidden-size", str(ffn),
            "--group-query-attention", "--num-query-groups", str(max(1, heads // 2)),
            "--normalization", "RMSNorm", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights"]


def train_flags(job: dict, strategy: str) -> list[str]:
    """Megatron-style flags of one strategy's run (the same model for every strategy)."""
    model, max_len = job["model"], job["max_len"]
    flags = ["--num-layers", str(job["num_layers"]), "--hidden-size", str(job["hidden_size"]),
             "--num-attention-heads", str(job["num_attention_heads"]),
             "--max-position-embeddings", str(job["max_position_embeddings"]),
             "--pipeline-model-parallel-size", str(job["pp"]),
             "--tensor-model-parallel-size", str(job["tp"]),
             "--tokens-per-global-batch", str(job["tokens_per_global_batch"]),
             "--micro-batching", strategy.split("+")[0],
             # dynamic: one token stream per micro-batch; dynamic+padded: the paper's rows
             "--dynamic-layout", "padded" if strategy == "dynamic+padded" else "packed",
             "--packing-algorithm", packer_of(job, strategy),
             "--pipeline-schedule", job["pipeline_schedule"],
             "--train-iters", str(job["warmup_iters"] + job["iters"]),
             "--lr", "1e-4", "--lr-decay-style", "constant", "--seed", str(job["seed"]),
             # as measured for BENCHMARKS.md: no dropout (on CPU attention dropout would
             # also switch off the fused attention kernel)
             "--hidden-dropout", "0", "--attention-dropout", "0",
             # packing: one SDPA over the row with the block-diagonal mask (Megatron-style
             # packing without a varlen kernel); the rest compute only the sample blocks
             "--attention-backend", "dense-mask" if strategy == "packing" else "auto",
             "--data-path", job["data_path"], "--log-interval", "1",
             "--num-planner-workers", "1", "--plan-prefetch", "2",
             "--distributed-timeout-minutes", str(job["timeout_minutes"])]
    if strategy == WINDOW:
        flags += ["--packing-window", str(job["packing_window"])]
    if model == "llama":
        flags += llama_flags(job["hidden_size"], job["num_attention_heads"])
    if model == "t5":
        flags += ["--encoder-seq-length", str(max_len),
                  "--decoder-seq-length", str(decoder_length(max_len))]
    else:
        flags += ["--seq-length", str(max_len)]
    if job.get("tokenizer_model"):
        flags += ["--tokenizer-type", "SentencePieceTokenizer",
                  "--tokenizer-model", job["tokenizer_model"]]
    else:
        flags += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", job["vocab_file"],
                  "--merge-file", job["merge_file"]]
    if job.get("bf16"):
        flags.append("--bf16")
    flags += job.get("train_args", [])
    flags += ["--cost-model", job.get("cost_model", "analytic")]   # explicit: GPU defaults differ
    if job.get("cost_model") == "profile":
        if job.get("cost_model_cache_dir"):
            flags += ["--cost-model-cache-dir", job["cost_model_cache_dir"]]
    return flags


def cost_model_options(job: dict) -> dict:
    """AnalyticCostModel settings of the run's device: throughput and activation memory per
    rank (the planners' memory limit for every strategy alike)."""
    from megatron.planning.device_costs import analytic_device_options
    return {"device_flops": float(job["device_flops"]),
            "device_mem_bytes": float(job["memory_gib"]) * 2**30,
            "dtype_bytes": 2 if job.get("bf16") else 4,
            # stages.gelu_tanh's CPU fp32 path keeps two more [tokens, ffn] temporaries
            "sigmoid_gelu": job.get("device") != "cuda" and not job.get("bf16"),
            **analytic_device_options("cuda" if job.get("device") == "cuda" else "cpu")}


# ============================================================================ planning setup

def bench_planner_config(cfg, spec, dp: int, job: dict, micro_batch_size: int | None,
                         **startup):
    """The trainer's planner config with the benchmark's cost model (device throughput and
    memory of this machine) and, for padding / packing, the tuned rows per micro-batch;
    attention is costed as the run's --attention-backend computes it (planner_config)."""
    from dataclasses import replace

    from dynapipe_ext.plan.iteration_planner import CostModelSource
    from megatron.training.training import planner_config
    plan_cfg = planner_config(cfg, spec, dp, **startup)    # startup: comm=, auto_layout=
    source = plan_cfg.cost_model
    if source.kind == "analytic":
        source = CostModelSource.analytic(**cost_model_options(job))
    else:       # the run's profile, with the benchmark's memory per rank
        memory = cost_model_options(job)["device_mem_bytes"]
        source = CostModelSource.profile(
            source.path, **dict(source.options, device_memory_bytes=memory))
    planner = replace(plan_cfg.planner, micro_batch_size=micro_batch_size)
    return replace(plan_cfg, planner=planner, cost_model=source)


def tune_micro_batch_size(plan_cfg, batches: list, limit: int = 64) -> tuple[int | None, dict]:
    """Rows per micro-batch for padding / packing: the power of two up to what fits memory
    with the least predicted time summed over `batches` (the planner's own prediction, the
    same search DynaPipe's authors ran for their baselines). None for other strategies."""
    from dataclasses import replace

    from dynapipe_ext.plan.iteration_planner import plan_iteration
    from dynapipe_ext.batching.planners import PlanningError
    if plan_cfg.micro_batching not in ("padding", "packing"):
        return None, {}
    predicted = {}
    size = 1
    while size <= limit:
        cfg = replace(plan_cfg, planner=replace(plan_cfg.planner, micro_batch_size=size))
        try:
            predicted[size] = sum(sum(plan_iteration(i, lengths, cfg).predicted_ms)
                                  for i, lengths in enumerate(batches))
        except (PlanningError, ValueError):
            break          # this many rows no longer fit memory
        size *= 2
    if not predicted:
        raise RuntimeError(f"{plan_cfg.micro_batching}: not even one row per micro-batch fits "
                           f"the memory limit; raise --memory-gib")
    return min(predicted, key=predicted.get), predicted


# ============================================================================ memory

def reset_peak_memory(device) -> None:
    """Start a fresh peak: CUDA allocator stats, or the process's peak RSS (clear_refs 5)."""
    import torch
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass          # not Linux: the peak then covers the whole process


def peak_memory(device) -> int:
    """Peak bytes since reset_peak_memory: CUDA allocated, or resident set (VmHWM)."""
    import torch
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ============================================================================ MFU

def sgemm_rate(sizes=(256, 512, 1024), seconds: float = 1.0) -> float:
    """One-thread fp32 matmul rate of this CPU (FLOP/s): the fastest of repeated n^3 products
    of each size over about `seconds`, the best size's. The fastest run and the best size, so
    that the MFU is taken against the peak: short products also slip between other processes
    on a shared machine, which stretch a long one (on this CPU under load 5, 1024^3 products
    measured 67 GFLOP/s, 512^3 ones 91). Sets this process to one torch thread."""
    import torch
    torch.set_num_threads(1)
    rates = []
    for size in sizes:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)
        best, spent = float("inf"), 0.0
        while spent < seconds:
            t0 = time.perf_counter()
            torch.mm(a, b)
            took = time.perf_counter() - t0
            best, spent = min(best, took), spent + took
        rates.append(2.0 * size ** 3 / best)
    return max(rates)


def mfu_fields(real_flops: float, computed_flops: float, parts_per_rank: list[dict],
               elapsed_s: float, sgemm_flops: float | None,
               executor_cpu_per_rank: list[float] | None = None) -> dict:
    """MFU on real tokens: model FLOPs of the real tokens / (ranks x wall time x the one-thread
    sgemm rate), and where the rest of the ranks' time went, as shares of ranks x wall time
    (all shares add up to 1; times at the sgemm rate where FLOPs are the measure):
    padding = (computed - real FLOPs) at the sgemm rate; waits = transfer and collective
    waits (pipeline bubble, stage imbalance); descheduled = forward + backward wall time the
    rank's main thread did not run (other processes had the core: executor wall time less its
    CPU time, step_timing.executor_cpu_s; 0 on a quiet machine); other_compute = the rest of
    forward + backward time less the computed FLOPs at the sgemm rate (non-GEMM work: norms,
    activations, softmax, loss, autograd; GEMMs below the peak rate; recompute); host = the
    runtime's own time and plan waits (megatron/training/step_timing.py) plus time between
    iterations; optimizer = the step. {} without a rate (GPU runs)."""
    from megatron.training.step_timing import PARTS
    if not sgemm_flops or elapsed_s <= 0 or not parts_per_rank:
        return {}
    budget = len(parts_per_rank) * elapsed_s

    def total(*names) -> float:
        return sum(p.get(n, 0.0) for p in parts_per_rank for n in names)
    compute = total("forward", "backward")
    descheduled = 0.0
    if executor_cpu_per_rank:
        descheduled = sum(max(0.0, p.get("forward", 0.0) + p.get("backward", 0.0) - cpu)
                          for p, cpu in zip(parts_per_rank, executor_cpu_per_rank))
    shares = {
        "mfu": real_flops / sgemm_flops / budget,
        "padding": max(computed_flops - real_flops, 0.0) / sgemm_flops / budget,
        "waits": total("transfer_wait", "sync_wait") / budget,
        "other_compute": (compute - descheduled - computed_flops / sgemm_flops) / budget,
        "descheduled": descheduled / budget,
        "host": (total("host", "plan_wait") + budget - total(*PARTS)) / budget,
        "optimizer": total("optimizer") / budget}
    return {"mfu": shares["mfu"], "mfu_breakdown": shares}


# ============================================================================ one strategy

def build_bench_run(cfg, job: dict, micro_batch_size: int | None):
    """The trainer's TrainingRun, planning with the benchmark's planner config (cost model of
    this device, tuned baseline micro-batch size)."""
    from megatron.training.training import build_run
    return build_run(cfg, verbose=job["verbose"],
                     make_planner_config=lambda cfg, spec, dp, **startup: bench_planner_config(
                         cfg, spec, dp, job, micro_batch_size, **startup))


class PlanRecorder:
    """Wraps a run's PlanDelivery.fetch to keep what each delivered plan says: planning time
    (leader), wait time, micro-batch shapes, schedule and recompute modes, and the model FLOPs
    of its real tokens and of what its micro-batches compute (dynapipe_ext.batching.model_flops)."""

    def __init__(self, run, packed_attention: str = "segments"):
        self.run = run
        self.packed_attention = packed_attention
        self.records: list[dict] = []
        self._fetch = run.plans.fetch
        run.plans.fetch = self.fetch

    def fetch(self, iteration: int):
        delivered = self._fetch(iteration)
        plan = delivered.plan
        lengths = self.run.data.batch_lengths(iteration)
        self.records.append({
            "iteration": iteration, "wait_s": delivered.wait_s,
            "planning_ms": dict(delivered.planning_ms or {}),
            "schedule": plan.schedule,
            "micro_batches": [[mb.num_rows, mb.seq_len, mb.dec_seq_len, mb.recompute]
                              for mb in plan.micro_batches],
            "sample_positions": sorted(s for mb in plan.micro_batches for s in mb.sample_ids),
            "real_tokens_enc_dec": real_tokens_enc_dec(plan.micro_batches, lengths),
            "plan": (plan.micro_batches, lengths)})     # FLOPs counted after the timed loop
        return delivered

    def count_flops(self) -> None:
        """Model FLOPs of each record's real tokens (the whole global batch) and of what this
        replica's micro-batches compute; done once the timed iterations are over."""
        from dynapipe_ext.batching.model_flops import computed_flops, real_flops
        for record in self.records:
            micro_batches, lengths = record.pop("plan")
            record["real_flops"] = real_flops(self.run.spec, lengths)
            record["computed_flops"] = sum(computed_flops(self.run.spec, mb, lengths,
                                                          self.packed_attention)
                                           for mb in micro_batches)


def real_tokens_enc_dec(micro_batches, lengths) -> list[int]:
    """Real (encoder-or-GPT, decoder) tokens of the samples these micro-batches hold."""
    import numpy as np
    ids = np.array([s for mb in micro_batches for s in mb.sample_ids], dtype=np.int64)
    arr = np.asarray(lengths).reshape(len(lengths), -1)
    enc = int(arr[ids, 0].sum())
    dec = int(arr[ids, 1].sum()) if arr.shape[1] > 1 else 0
    return [enc, dec]


def bench_strategy(job: dict, strategy: str) -> dict:
    """Run one strategy: warm-up iterations, then timed ones; returns rank 0's record."""
    import torch
    import torch.distributed as dist

    from megatron.training.arguments import parse_args
    from megatron.training.step_timing import add_parts
    from megatron.training.training import train_step
    cfg = parse_args(trainer_model(job["model"]), train_flags(job, strategy))
    micro_batch_size, tuning = None, {}
    if strategy.split("+")[0] == "padding":
        micro_batch_size, tuning = tune_for(cfg, job)
    run = build_bench_run(cfg, job, micro_batch_size)
    recorder = PlanRecorder(run, ATTENTION_COSTING[cfg.attention_backend])
    stats = []
    total = job["warmup_iters"] + job["iters"]
    compiles_before = 0
    try:
        for it in range(total):
            if it == job["warmup_iters"]:
                dist.barrier()
                reset_peak_memory(run.layout.device)
                compiles_before = compile_count()
                started = time.perf_counter()
            s = train_step(run, it)
            run.logger.log(s)
            stats.append(s)
        if run.layout.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        elapsed = time.perf_counter() - started
        compiles_timed = compile_count() - compiles_before
    finally:
        run.close()
    recorder.count_flops()
    measured = stats[job["warmup_iters"]:]
    records = recorder.records[job["warmup_iters"]:]
    parts = {}
    for s in measured:
        parts = add_parts(parts, s.time_parts or {})
    mine = {"peak": peak_memory(run.layout.device), "parts": parts, "dp_rank": run.layout.dp_rank,
            "computed_flops": sum(r["computed_flops"] for r in records),
            "executor_cpu_s": sum(s.executor_cpu_s for s in measured)}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    peaks = [r["peak"] for r in ranks]
    computed = sum({r["dp_rank"]: r["computed_flops"] for r in ranks}.values())   # per replica
    real_fl = sum(r["real_flops"] for r in records)
    real = sum(s.real_tokens for s in measured)
    enc_real = sum(r["real_tokens_enc_dec"][0] for r in records)
    dec_real = sum(r["real_tokens_enc_dec"][1] for r in records)
    enc_slots = sum(m[0] * m[1] for r in records for m in r["micro_batches"])
    dec_slots = sum(m[0] * m[2] for r in records for m in r["micro_batches"])
    planning = [r["planning_ms"].get("total", r["planning_ms"].get("worker_total", 0.0))
                for r in records]
    return {
        "model": job["model"], "max_len": job["max_len"],
        "dec_max_len": decoder_length(job["max_len"]) if job["model"] == "t5" else 0,
        "strategy": strategy, "micro_batch_size": micro_batch_size,
        "packing_algorithm": packer_of(job, strategy),
        "packer_real_per_slot": job.get("window_packer_efficiency" if strategy == WINDOW
                                        else "packer_efficiency"),
        "packing_window": job["packing_window"] if strategy == WINDOW else 0,
        "rows_per_micro_batch": sorted({m[0] for r in records for m in r["micro_batches"]}),
        "memory_gib": job["memory_gib"],
        "micro_batch_size_predicted_ms": tuning, "attention_backend": cfg.attention_backend,
        "iterations": len(measured), "warmup_iterations": job["warmup_iters"],
        "real_tokens": real, "elapsed_s": elapsed, "tokens_per_s": real / elapsed,
        "iteration_s": [s.iteration_s for s in measured],
        "iteration_tokens_per_s": [s.real_tokens / s.iteration_s for s in measured],
        "compiles_in_timed_iterations": compiles_timed,
        "padding_efficiency_enc": enc_real / enc_slots if enc_slots else 1.0,
        "padding_efficiency_dec": dec_real / dec_slots if dec_slots else None,
        "micro_batches": [s.num_micro_batches for s in measured],
        "shapes": [s.shapes for s in measured],
        "recompute": sorted({m[3] for r in records for m in r["micro_batches"]}),
        "schedules": [r["schedule"] for r in records],
        "planning_ms": planning, "plan_wait_s": [s.plan_wait_s for s in measured],
        "peak_memory_bytes": peaks, "loss": [s.loss for s in measured],
        "real_flops": real_fl, "computed_flops": computed,
        "time_parts_per_rank": [r["parts"] for r in ranks],
        "executor_cpu_s_per_rank": [r["executor_cpu_s"] for r in ranks],
        "sgemm_flops": job.get("sgemm_flops"),
        **mfu_fields(real_fl, computed, [r["parts"] for r in ranks], elapsed,
                     job.get("sgemm_flops"), [r["executor_cpu_s"] for r in ranks]),
        "batch_ids": [[int(i) for i in run.data.sampler.batch(r["iteration"])]
                      for r in records],
        "sample_positions_planned": [r["sample_positions"] for r in records],
    }


def compile_count() -> int:
    """Graphs torch.compile has compiled in this process so far (FlexAttention, fused
    kernels): a rise inside the timed iterations is a recompile the warm-up did not cover."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


def tune_for(cfg, job: dict):
    """Tuned rows per micro-batch of a padding / packing run (same on every rank)."""
    from megatron.training.training import model_spec, open_training_data
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    data = open_training_data(cfg, rank)
    spec = model_spec(cfg, data.vocab_size)
    plan_cfg = bench_planner_config(cfg, spec, cfg.data_parallel_size(world), job, None)
    total = job["warmup_iters"] + job["iters"]
    batches = [data.batch_lengths(i) for i in range(job["warmup_iters"], total)]
    return tune_micro_batch_size(plan_cfg, batches)


def timed_batches(job: dict, strategy: str, algorithm: str) -> list:
    """Lengths of the timed global batches of `strategy` packed with `algorithm`."""
    import numpy as np

    from megatron.training.arguments import parse_args
    from megatron.training.training import open_training_data
    flags = train_flags(dict(job, packing_algorithm=algorithm,
                             window_packing_algorithm=algorithm), strategy)
    data = open_training_data(parse_args(trainer_model(job["model"]), flags),
                              int(os.environ.get("RANK", "0")))
    total = job["warmup_iters"] + job["iters"]
    return [np.asarray(data.batch_lengths(i)) for i in range(job["warmup_iters"], total)]


def best_packer(job: dict, strategy: str = "packing") -> tuple[str, dict]:
    """The packer whose rows of the max length hold the most real tokens per slot (T5: the
    mean of encoder and decoder) over the timed global batches, and every packer's share;
    deterministic, so every rank picks the same. For packing+window each packer packs the
    window ahead (its global batches differ) and next-fit rebuilds its rows from a batch,
    as the trainer does."""
    from dynapipe_ext.batching.packing import ALGORITHMS, pack_pairs, pack_sequences
    share = {}
    batches = None if strategy == WINDOW else timed_batches(job, strategy, "nextfit")
    for algorithm in ALGORITHMS:
        real = slots = 0.0
        packer = "nextfit" if strategy == WINDOW else algorithm
        try:
            for lengths in batches or timed_batches(job, strategy, algorithm):
                if job["model"] != "t5":
                    rows = len(pack_sequences(lengths, job["max_len"], packer))
                    real, slots = real + lengths.sum(), slots + rows * job["max_len"]
                else:
                    dec_len = decoder_length(job["max_len"])
                    rows = len(pack_pairs(lengths[:, 0], lengths[:, 1], job["max_len"],
                                          dec_len, packer))
                    real += lengths[:, 0].sum() / job["max_len"] + lengths[:, 1].sum() / dec_len
                    slots += 2 * rows
        except ValueError:         # refused (e.g. NNLSHP's system too big): not a candidate
            continue
        share[algorithm] = float(real / slots)
    return max(share, key=share.get), share


def group_memory_gib(job: dict, most_doublings: int = 3) -> float:
    """The activation memory per rank for every strategy of this (model, max length): the
    asked one, doubled until one packed row of the max length fits (packing cannot run
    otherwise). Deterministic, so every rank arrives at the same figure."""
    from dynapipe_ext.plan.iteration_planner import plan_iteration
    from dynapipe_ext.batching.planners import PlanningError
    from megatron.training.arguments import parse_args
    from megatron.training.training import model_spec, open_training_data
    cfg = parse_args(trainer_model(job["model"]), train_flags(job, "packing"))
    data = open_training_data(cfg, int(os.environ.get("RANK", "0")))
    spec = model_spec(cfg, data.vocab_size)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    memory = float(job["memory_gib"])
    for _ in range(most_doublings + 1):
        plan_cfg = bench_planner_config(cfg, spec, cfg.data_parallel_size(world),
                                        replace_memory(job, memory), 1)
        try:
            plan_iteration(0, data.batch_lengths(job["warmup_iters"]), plan_cfg)
            return memory
        except (PlanningError, ValueError):
            memory *= 2
    return float(job["memory_gib"])     # packing will report that it does not fit


def ensure_profile(job: dict) -> None:
    """--cost-model profile: make (or find) the run's profile before anything plans with it
    (every rank calls this; see device_costs.ensure_cost_profile)."""
    from megatron.planning import device_costs
    from megatron.training.arguments import parse_args
    from megatron.base.distributed_setup import setup_model_parallel
    from megatron.training.training import model_spec, open_training_data
    cfg = parse_args(trainer_model(job["model"]), train_flags(job, "dynamic"))
    spec = model_spec(cfg, open_training_data(cfg, int(os.environ.get("RANK", "0"))).vocab_size)
    layout = setup_model_parallel(
        cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.seed,
        timeout_s=cfg.distributed_timeout_minutes * 60, total_layers=spec.total_layers,
        num_stages=cfg.pipeline_model_parallel_size, vocab_size=spec.vocab_size,
        num_attention_heads=cfg.num_attention_heads)
    device_costs.ensure_cost_profile(cfg, spec, layout.rank, layout.device)


def replace_memory(job: dict, memory_gib: float) -> dict:
    return dict(job, memory_gib=memory_gib)


def worker_main(job_file: str) -> int:
    """One torchrun rank: every strategy of one (model, max length) in turn."""
    import torch
    import torch.distributed as dist
    job = json.loads(Path(job_file).read_text())
    torch.set_num_threads(job["threads"])
    if job.get("device") == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if job["packing_algorithm"] == "best":    # before anything parses the job's flags
        job["packing_algorithm"], job["packer_efficiency"] = best_packer(job)
    if WINDOW in job["strategies"]:
        job["window_packing_algorithm"], job["window_packer_efficiency"] = (
            best_packer(job, WINDOW) if job["window_packing_algorithm"] == "best"
            else (job["window_packing_algorithm"], None))
    if job.get("cost_model") == "profile":
        ensure_profile(job)
    job["memory_gib"] = group_memory_gib(job)
    results = []
    for round_index, strategy in enumerate(job["strategies"] * job.get("rounds", 1)):
        try:
            results.append(dict(bench_strategy(job, strategy),
                                round=round_index // len(job["strategies"])))
        except Exception as err:   # noqa: BLE001 - recorded, the other strategies still run
            if dist.is_initialized():
                raise
            results.append({"model": job["model"], "max_len": job["max_len"],
                            "strategy": strategy, "error": f"{type(err).__name__}: {err}"})
        if int(os.environ.get("RANK", "0")) == 0:
            Path(job["result_file"]).write_text(json.dumps(results))
            r = results[-1]
            print(f"[bench] {job['model']} L={job['max_len']} {strategy}: "
                  f"{r.get('tokens_per_s', 0):,.0f} tokens/s "
                  f"({r.get('error', 'ok')})", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


# ============================================================================ report

def report_main(argv) -> int:
    p = argparse.ArgumentParser(prog="bench_throughput.py report",
                                description="tables and plots from a bench_throughput JSON")
    p.add_argument("result", help="JSON written by a benchmark run")
    p.add_argument("--projection", default=None, help="JSON of tools/project_paper_scale.py")
    p.add_argument("--json-out", default=None, help="combined JSON to write")
    p.add_argument("--markdown", default=None, help="BENCHMARKS.md to update between markers")
    p.add_argument("--plots", default=None, help="folder for throughput_*.png")
    args = p.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    if args.projection:
        result["projection"] = json.loads(Path(args.projection).read_text())
    plots = {}
    if args.plots:
        folder = Path(args.plots)
        folder.mkdir(parents=True, exist_ok=True)
        plot_speedup(result, folder / "throughput_speedup.png")
        plot_padding(result, folder / "throughput_padding.png")
        if args.markdown:
            rel = os.path.relpath(folder, Path(args.markdown).parent)
            plots = {"speedup": f"{rel}/throughput_speedup.png",
                     "padding": f"{rel}/throughput_padding.png"}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    body = report_markdown(result, plots)
    if args.markdown:
        write_section(args.markdown, "throughput", "Training throughput", body)
        print(f"[bench] updated {args.markdown}")
    else:
        print(body)
    return 0


# ============================================================================ parent

def run_job(job: dict, nproc: int, timeout_s: float, log) -> list[dict]:
    """Launch one torchrun group for `job`; its rows (or one error row per strategy)."""
    work = Path(job["result_file"]).parent
    job_file = work / f"job_{job['model']}_{job['max_len']}.json"
    job_file.write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]), PYTHONWARNINGS="ignore")
    started = time.perf_counter()
    for attempt in range(3):
        # a free port can be taken by another process before torchrun binds it: try anew
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               str(Path(__file__).resolve()), "worker", str(job_file)]
        output, status = run_group(cmd, timeout_s, cwd=ROOT, env=env)
        failed = status != 0
        if status is None:
            output += f"\n[bench] timed out after {timeout_s:.0f} s"
        log.write(output)
        log.flush()
        if not (failed and "EADDRINUSE" in output and not Path(job["result_file"]).exists()):
            break
    rows = json.loads(Path(job["result_file"]).read_text()) \
        if Path(job["result_file"]).exists() else []
    done = {r["strategy"] for r in rows}
    if failed:
        errors = [line for line in output.splitlines() if "Error: " in line]
        tail = errors[-1] if errors else " | ".join(output.strip().splitlines()[-3:])
        rows += [{"model": job["model"], "max_len": job["max_len"], "strategy": s,
                  "error": f"worker group failed after {time.perf_counter() - started:.0f} s:"
                           f" {tail[-400:]}"}
                 for s in job["strategies"] if s not in done]
    return rows


def machine_description(device: str) -> str:
    if device == "cuda":
        import torch
        return f"{torch.cuda.get_device_name(0)} (CUDA), Python {platform.python_version()}"
    return f"{cpu_model()}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}"


def parse_args(argv=None) -> argparse.Namespace:
    from dynapipe_ext.batching.packing import ALGORITHMS
    from megatron.training.arguments import add_flag_group
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data-path", required=True, help="prefix of tools/preprocess_flan.py")
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece model")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab (without --tokenizer-model)")
    g.add_argument("--merge-file", default=None)
    g = p.add_argument_group("runs")
    g.add_argument("--models", nargs="+", choices=("gpt", "t5", "llama"), default=["gpt", "t5"],
                   help="llama: a Llama-style GPT (RoPE, SwiGLU, GQA, RMSNorm; llama_flags)")
    g.add_argument("--max-lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    g.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    g.add_argument("--tokens-per-global-batch", type=int, default=8192)
    g.add_argument("--rows-per-global-batch", type=int, default=0,
                   help="global batches of at least this many max-length rows of tokens "
                        "(tokens per global batch = max(--tokens-per-global-batch, N x max "
                        "length)), so every strategy has micro-batches to fill a pipeline")
    g.add_argument("--rounds", type=int, default=1,
                   help="run the strategies this many times, interleaved (A B C A B C ...); "
                        "a row's tokens/s is the median over its rounds, with their spread")
    g.add_argument("--warmup-iters", type=int, default=1)
    g.add_argument("--iters", type=int, default=3)
    add_flag_group(p, "model", ["num_layers", "hidden_size", "num_attention_heads"], title="",
                   num_layers=dict(default=4, help="GPT layers; T5 gets this many encoder and "
                                                   "decoder layers each / 2"),
                   hidden_size=dict(default=256, required=False),
                   num_attention_heads=dict(default=4, required=False))
    g.add_argument("--nproc", type=int, default=2, help="processes (ranks)")
    g.add_argument("--pp", type=int, default=2)
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--bf16", action="store_true", help="bf16 model (GPU; default there)")
    g.add_argument("--packing-algorithm", default="best",
                   choices=("best",) + ALGORITHMS,
                   help="packer of the packing rows (and of dynamic's packing candidate); "
                        "'best' (default): the one with the most real tokens per slot on the "
                        "timed global batches, chosen per (model, max length) and recorded")
    g.add_argument("--packing-window", type=int, default=4000,
                   help="samples packed together ahead of training for packing+window (the "
                        "trainer's --packing-window; default 4000: the whole FLAN sample of "
                        "examples/reproduce_throughput.sh)")
    g.add_argument("--pipeline-schedule", default="auto", choices=PIPELINE_SCHEDULES,
                   help="the trainer's --pipeline-schedule, the same for every strategy")
    g.add_argument("--device-flops", type=float, default=None,
                   help="cost model throughput (default: 2e10 on CPU, 3e14 on GPU)")
    g.add_argument("--cost-model", choices=("analytic", "profile"), default="analytic",
                   help="plan with the analytic model or the run's profile (made on first "
                        "use, see pretrain's --cost-model profile)")
    g.add_argument("--cost-model-cache-dir", default=None,
                   help="profile cache of --cost-model profile")
    g.add_argument("--memory-gib", type=float, default=None,
                   help="activation memory per rank for the planners (default 3 on CPU, "
                        "60 on GPU)")
    g.add_argument("--train-args", default="",
                   help="more trainer flags for every run, one string (e.g. "
                        "'--no-bias-gelu-fusion --profile')")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--timeout-minutes", type=float, default=20.0,
                   help="per (model, max length) group")
    g = p.add_argument_group("output")
    g.add_argument("--output", default=str(ROOT / "docs" / "bench_throughput.json"))
    g.add_argument("--work-dir", default=None, help="job files and logs (default: a temp dir)")
    g.add_argument("--command", default=None,
                   help="the script that ran this command, quoted beside it (e.g. 'bash "
                        "examples/reproduce_claims.sh')")
    g.add_argument("--verbose", action="store_true", help="trainer progress lines in the log")
    return p.parse_args(argv)


def resolve_device(args) -> str:
    if args.device != "auto":
        return args.device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


PATH_SETTINGS = ("data_path", "tokenizer_model", "vocab_file", "merge_file",
                 "cost_model_cache_dir")


def repo_relative(path: str | None) -> str | None:
    """`path` relative to the repository when it lies inside it (the evidence JSON names no
    machine's directories), else as given."""
    if not path:
        return path
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def make_job(args, model: str, max_len: int, device: str, work: Path) -> dict:
    layers = args.num_layers
    t5_layers = max(args.pp, layers // 2)
    max_pos = max(max(args.max_lengths), decoder_length(max(args.max_lengths)))
    return {
        "model": model, "max_len": max_len, "strategies": list(args.strategies),
        "num_layers": t5_layers if model == "t5" else layers,
        "hidden_size": args.hidden_size, "num_attention_heads": args.num_attention_heads,
        "max_position_embeddings": max_pos, "pp": args.pp, "tp": args.tp,
        "tokens_per_global_batch": max(args.tokens_per_global_batch, max_len,
                                       args.rows_per_global_batch * max_len),
        "rounds": args.rounds, "rows_per_global_batch": args.rows_per_global_batch,
        "packing_algorithm": args.packing_algorithm, "pipeline_schedule": args.pipeline_schedule,
        "window_packing_algorithm": args.packing_algorithm, "packing_window": args.packing_window,
        "warmup_iters": args.warmup_iters, "iters": args.iters, "seed": args.seed,
        "data_path": str(Path(args.data_path).resolve()),
        "tokenizer_model": str(Path(args.tokenizer_model).resolve())
        if args.tokenizer_model else None,
        "vocab_file": args.vocab_file, "merge_file": args.merge_file,
        "bf16": args.bf16 or device == "cuda", "device": device, "threads": args.threads,
        "device_flops": args.device_flops or (3e14 if device == "cuda" else 2e10),
        "memory_gib": args.memory_gib or (60.0 if device == "cuda" else 3.0),
        "cost_model": args.cost_model, "cost_model_cache_dir": args.cost_model_cache_dir,
        "train_args": shlex.split(args.train_args),
        "timeout_minutes": max(2.0, args.timeout_minutes / 2), "verbose": args.verbose,
        "result_file": str(work / f"result_{model}_{max_len}.json"),
    }


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["worker"]:
        return worker_main(argv[1])
    if argv[:1] == ["report"]:
        return report_main(argv[1:])
    args = parse_args(argv)
    device = resolve_device(args)
    work = Path(args.work_dir or f"/tmp/bench_throughput_{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    start = provenance_start("python tools/bench_throughput.py " + shlex.join(argv))
    groups = [(model, max_len) for model in args.models for max_len in args.max_lengths]
    rows: list[dict] = []
    with open(work / "workers.log", "a") as log:
        for done, (model, max_len) in enumerate(groups, 1):
            job = make_job(args, model, max_len, device, work)
            if device == "cpu":
                job["sgemm_flops"] = sgemm_rate()
            t0 = time.perf_counter()
            new = run_job(job, args.nproc, args.timeout_minutes * 60, log)
            rows += new
            print(f"[bench] {model} max length {max_len}: {len(new)} rows in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            for r in new:
                print("   ", r["strategy"], f"{r.get('tokens_per_s', 0):,.0f} tokens/s",
                      f"MFU {percent(r.get('mfu'))}", r.get("error", ""), flush=True)
            # after every (model, max length): a cut-off run still leaves its groups
            write_result(args, device, work, start, rows, groups[:done], len(groups))
    print(f"[bench] wrote {args.output}")
    return 0


def write_result(args, device: str, work: Path, start: dict, rows: list[dict],
                 done: list, total: int) -> None:
    """The JSON of the groups run so far (`complete` once all are), written whole to a
    temporary file first so that a cut-off write never leaves a broken file."""
    rows = merge_rounds(rows)
    add_ratios(rows)
    prov = provenance_end(start)
    result = {
        **prov, "invoked_by": args.command, "device": device,
        "machine": machine_description(device),
        "load_average_end": prov["load_average_after"],
        "complete": len(done) == total, "groups_done": [list(g) for g in done],
        "settings": {k: repo_relative(v) if k in PATH_SETTINGS else v
                     for k, v in make_job(args, "gpt", max(args.max_lengths), device,
                                          work).items()
                     if k not in ("model", "max_len", "result_file", "strategies")},
        "strategies": list(args.strategies), "rows": rows,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)


if __name__ == "__main__":
    status = main()
    if sys.argv[1:2] == ["worker"]:     # a torchrun rank: see end_process
        from megatron.base.distributed_setup import end_process
        end_process(status)
    sys.exit(status)
