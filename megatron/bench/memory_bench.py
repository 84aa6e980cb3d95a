"""Predicted vs measured activation memory of one pipeline rank under a real plan.

Predicted: the peak the schedule simulator gives the rank with the planner's cost model
(`simulate(schedule, costs).peak_memory_bytes[rank]`: kept activations of the micro-batches in
flight plus the transient peak of the running one). Measured: the same rank's computation
replayed in this process, in the schedule's order, through the real stage module and
`run_stage_forward` (same recompute paths as training): a forward keeps what autograd saves,
its received input and its output (the handlers hold both until the backward); the
backward gets a gradient of the output's shape. Transfers are left out: inputs and output
gradients are fresh tensors of the shapes the plan would receive. Parameter gradients are
allocated before the measurement, so it counts activations only. Memory is read as in
megatron/planning/profile_layers.py: torch.cuda's peak counter on GPU; on CPU glibc's bytes in
use after every aten op (allocations inside one op are not seen).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dynapipe_ext.costs.cost_model import AnalyticCostModel
from dynapipe_ext.costs.model_spec import ModelSpec, stage_output_shapes
from dynapipe_ext.batching.planners import PlannerConfig, plan_micro_batches
from dynapipe_ext.schedule.schedule_ir import FORWARD, Schedule
from dynapipe_ext.schedule.schedule_search import costs_from_micro_batches
from dynapipe_ext.schedule.schedules import one_f_one_b
from dynapipe_ext.schedule.simulator import PipelineCosts, simulate
from megatron.model.batch_tensors import build_micro_batch
from megatron.model.init_weights import initialize_stage_weights
from megatron.planning.profile_layers import _PeakAfterEachOp, cpu_bytes_in_use
from megatron.model.stages import build_rank_stages, build_transformer_config, run_stage_forward


@dataclass(frozen=True)
class RankMemory:
    rank: int
    predicted_bytes: float
    measured_bytes: float

    @property
    def ratio(self) -> float:
        """predicted / measured (1.0: exact; above 1: the model over-predicts)."""
        return self.predicted_bytes / self.measured_bytes if self.measured_bytes else float("inf")


def random_samples(model: str, lengths, vocab_size: int, seed: int = 0) -> dict[int, tuple]:
    """Samples of the given lengths (GPT: n; T5: (n, 2)) with random tokens, loss everywhere."""
    rng = np.random.default_rng(seed)
    samples = {}
    for i, length in enumerate(np.asarray(lengths).tolist()):
        if model == "gpt":
            samples[i] = (rng.integers(1, vocab_size, length), rng.integers(1, vocab_size, length),
                          np.ones(length, np.float32))
        else:
            enc, dec = length
            samples[i] = (rng.integers(1, vocab_size, enc), rng.integers(1, vocab_size, dec),
                          rng.integers(1, vocab_size, dec), np.ones(dec, np.float32))
    return samples


def predicted_rank_peaks(schedule: Schedule, costs: PipelineCosts) -> tuple[float, ...]:
    """Activation peak per rank the simulator gives this schedule with these costs."""
    return simulate(schedule, costs).peak_memory_bytes


def measure_rank_peak(spec: ModelSpec, schedule: Schedule, micro_batches, samples, rank: int,
                      dtype: str = "float32", seed: int = 0) -> float:
    """Peak activation bytes of `rank`'s computation of `schedule` (see the module docstring).
    Needs an initialised TP=1 world (setup_model_parallel(1, 1)); runs on the CPU."""
    num_stages = schedule.num_stages
    layers = spec.stage_layers(num_stages)
    config = build_transformer_config(spec, dtype=dtype)
    stages = build_rank_stages(spec, (0,) * num_stages, 0, config)
    stages = {s: m for s, m in stages.items() if schedule.stage_to_rank[s] == rank}
    initialize_stage_weights(stages, seed)
    for module in stages.values():
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    live: dict = {}
    base = cpu_bytes_in_use()
    if base is None:
        raise RuntimeError("measuring CPU memory needs glibc (mallinfo2)")
    tracker = _PeakAfterEachOp(cpu_bytes_in_use)
    with tracker:
        for stage, kind, mb_index in schedule.rank_actions[rank]:
            mb = micro_batches[mb_index]
            if kind == FORWARD:
                batch = build_micro_batch(mb, samples, spec.model, 0)
                inputs = () if stage == 0 else tuple(
                    torch.randn(shape, generator=gen, dtype=torch_dtype).requires_grad_()
                    for shape in stage_output_shapes(layers[stage - 1], mb.num_rows, mb.seq_len,
                                                     mb.dec_seq_len, spec.hidden_size))
                out = run_stage_forward(stages[stage], inputs, batch, mb.recompute)
                if stage == num_stages - 1:
                    out = ((out.float() * batch["loss_mask"]).sum(),)
                live[(mb_index, stage)] = (inputs, out)
            else:
                inputs, out = live.pop((mb_index, stage))
                grads = None if stage == num_stages - 1 else [
                    torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in out]
                torch.autograd.backward(out, grads)
                del inputs, out, grads
    return float(tracker.peak - base)


def predicted_vs_measured(spec: ModelSpec, lengths, max_seq_len: int, max_dec_seq_len: int,
                          recompute: str, pp: int = 2, seed: int = 0) -> list[RankMemory]:
    """Plan `lengths` with the dynamic planner and the analytic cost model (fp32, every
    micro-batch in `recompute`), schedule it with 1F1B over `pp` ranks, and give each rank's
    predicted and measured activation peak."""
    is_t5 = spec.model == "t5"
    cost = AnalyticCostModel(spec, dtype_bytes=4, max_seq_len=max_seq_len,
                             max_dec_seq_len=max_dec_seq_len if is_t5 else None, num_stages=pp,
                             full_recompute="stage",    # run_stage_forward, every device
                             sigmoid_gelu=True)         # gelu_tanh's CPU fp32 path
    planner = PlannerConfig(model=spec.model, max_seq_len=max_seq_len,
                            max_dec_seq_len=max_dec_seq_len if is_t5 else 0,
                            pipeline_stages=pp, recompute_modes=(recompute,),
                            dynamic_layout="padded")
    mbs = plan_micro_batches(lengths, planner, cost, "dynamic").micro_batches
    schedule = one_f_one_b(len(mbs), pp)
    predicted = predicted_rank_peaks(schedule, costs_from_micro_batches(mbs, cost, pp))
    samples = random_samples(spec.model, lengths, spec.vocab_size, seed)
    return [RankMemory(r, float(predicted[r]),
                       measure_rank_peak(spec, schedule, mbs, samples, r, seed=seed))
            for r in range(pp)]
