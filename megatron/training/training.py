"""The training run behind pretrain_gpt.py and pretrain_t5.py.

`build_run(cfg)` sets a run up in the order things can fail: open the data and check it against
the tokenizer and model (every rank, before any collective, so a bad file is the same clear error
everywhere), start the process groups, build this rank's stages and optimizer, resume from a
checkpoint, start planning ahead (unless the checkpoint has nothing left to train). `train(run)`
is the loop: per iteration fetch this rank's plan, build its micro-batch tensors, run the
executor, all-reduce gradients over data parallel, clip, step, log, validate (--eval-interval,
megatron/training/evaluation.py) and save.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dynapipe_ext.plan.cluster import default_replica_split, ranks_per_node_from_env
from dynapipe_ext.runtime.executor import Executor
from dynapipe_ext.costs.model_spec import ModelSpec, option_values
from dynapipe_ext.plan.iteration_planner import (GlobalBatch, IterationPlannerConfig,
                                            choose_auto_layout, pipeline_layout)
from dynapipe_ext.batching.planners import ATTENTION_COSTING, PlannerConfig
from dynapipe_ext.schedule.simulator import CommModel
from megatron.data.blend import BlendedMultiTaskDataset, parse_data_path, stream_rates
from megatron.data.multitask_dataset import MultiTaskDataset
from megatron.data.sampler import GlobalBatchSampler, PackingWindow
from megatron.data.split import PARTS, parse_split, split_indices
from megatron.data.flan_indexed import manifest_digest
from megatron.data.tokenizers import (TokenizerError, build_tokenizer, tokenizer_label,
                                      tokenizer_mismatch)
from megatron.model.batch_tensors import build_micro_batch
from megatron.model.init_weights import initialize_stage_weights
from megatron.model.stages import (build_rank_stages, build_transformer_config, stage_parameters,
                                   replica_groups)
from megatron.checkpoint import checkpointing
from megatron.planning import device_costs
from megatron.training.arguments import (PADDING_MICRO_BATCH_SIZE, VOCAB_MULTIPLE, TrainConfig,
                                         check_device_precision, pipeline_stage_count,
                                         split_units, virtual_stages)
from megatron.base.collectives import gather_from_ranks, problems_of_all_ranks
from megatron.base.distributed_setup import (ParallelLayout, pipeline_p2p_groups,
                                                  setup_model_parallel, use_cuda)
from megatron.training.evaluation import Evaluator, held_out_summary
from megatron.training.exit_signals import ExitSignals
from megatron.training.handlers import (HandlerTable, all_reduce_data_parallel_grads,
                                        global_step_totals, make_handlers,
                                        micro_batch_order)
from megatron.training.grad_buffer import GradBuffer, backwards_per_stage
from megatron.training.optimizer import TrainOptimizer
from megatron.training.sharded_optimizer import ShardedOptimizer
from megatron.planning.plan_delivery import PlanDelivery, start_plan_delivery
from megatron.training.profiling import IterationProfiler
from megatron.training.step_timing import StepClock, add_parts
from megatron.training.train_logging import (IterationStats, TrainLogger, peak_memory_bytes,
                                             shapes_summary, token_slots)


class RunSetupError(RuntimeError):
    """Data, tokenizer or model do not fit together; raised on every rank alike."""


class TrainingFailed(RuntimeError):
    """An iteration failed on this rank (a peer died or timed out, a plan did not fit, ...)."""


# ---------------------------------------------------------------------------- data

@dataclass
class TrainingData:
    """The multi-task dataset in the model's view, and the global batches drawn from it."""

    model: str
    dataset: MultiTaskDataset
    sampler: GlobalBatchSampler
    lengths: np.ndarray          # (n,) GPT tokens or (n, 2) T5 (encoder, decoder), truncated
    seq_length: int
    decoder_seq_length: int
    vocab_size: int              # tokenizer vocabulary (before padding)
    loss_tokens: np.ndarray      # (n,) loss tokens of each sample in the model's view
    indices: np.ndarray | None = None   # the samples the sampler draws from (--split); all
    held_out: dict | None = None        # --split: samples per part ("train", "valid", "test")
    identity: dict | None = None        # data_identity: what a checkpoint binds the run to

    @property
    def pad_id(self) -> int:
        return self.dataset.pad

    def sample_ids(self, iteration: int) -> np.ndarray:
        """Dataset indices of global batch `iteration`'s samples, in batch order."""
        ids = self.sampler.batch(iteration)
        return ids if self.indices is None else self.indices[ids]

    def batch_lengths(self, iteration: int) -> np.ndarray:
        """Lengths of global batch `iteration`'s samples, in batch order (the planner's input)."""
        return self.lengths[self.sample_ids(iteration)]

    def planner_input(self, iteration: int) -> GlobalBatch:
        """What the planner reads of global batch `iteration`: its lengths and its loss
        tokens (which the plans carry to every rank), from the lengths alone."""
        ids = self.sample_ids(iteration)
        return GlobalBatch(self.lengths[ids], int(self.loss_tokens[ids].sum()))

    def sample_arrays(self, index: int) -> tuple:
        """The arrays build_micro_batch reads of dataset sample `index` (GPT: tokens, labels,
        loss_mask; T5: encoder ids, decoder ids, labels, loss_mask)."""
        if self.model == "gpt":
            s = self.dataset.gpt_sample(index, self.seq_length)
            return s.tokens, s.labels, s.loss_mask
        s = self.dataset.t5_sample(index, self.seq_length, self.decoder_seq_length)
        return s.encoder_ids, s.decoder_ids, s.labels, s.loss_mask

    def batch_samples(self, iteration: int, positions=None) -> dict[int, tuple]:
        """Batch position -> sample_arrays, for the batch positions `positions` (None: the
        whole batch)."""
        ids = self.sample_ids(iteration)
        wanted = range(len(ids)) if positions is None else sorted(set(positions))
        return {k: self.sample_arrays(int(ids[k])) for k in wanted}

    def truncation_report(self) -> dict:
        if self.model == "gpt":
            return self.dataset.gpt_truncation(self.seq_length)
        return self.dataset.t5_truncation(self.seq_length, self.decoder_seq_length)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_MULTIPLE) -> int:
    """Round the vocabulary up to a multiple of `divisible_by` x TP so the output layer splits
    evenly over TP ranks (Megatron's --make-vocab-size-divisible-by)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def open_training_data(cfg: TrainConfig, rank: int = 0, part: str = "train") -> TrainingData:
    """Open the dataset and check it against the tokenizer; no collective is involved.
    `part` "valid" opens the validation data: --valid-data-path, or the held-out share of
    --data-path under --split (whose "train" share is what training draws from)."""
    own_path = part == "valid" and cfg.valid_data_path
    data_path = cfg.valid_data_path if own_path else cfg.data_path
    where = f"rank {rank}: {'--valid-data-path' if own_path else '--data-path'} " \
            f"{' '.join(data_path)}"
    blend = parse_data_path(data_path)
    try:
        if len(blend) == 1 and blend[0][0] is None:
            dataset = MultiTaskDataset(blend[0][1])
        else:
            dataset = BlendedMultiTaskDataset([prefix for _, prefix in blend])
    except (OSError, ValueError) as exc:
        raise RunSetupError(f"{where}: {exc}") from exc
    try:
        tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file,
                                    cfg.tokenizer_model, cfg.vocab_extra_ids)
    except TokenizerError as exc:   # every rank reads the same files: a set-up error
        raise RunSetupError(f"rank {rank}: --tokenizer-type {cfg.tokenizer_type}: {exc}") from exc
    if dataset.tokenizer_info.get("type") != cfg.tokenizer_type:
        raise RunSetupError(f"{where}: the dataset was tokenised with "
                            f"{dataset.tokenizer_info.get('type')}, this run uses "
                            f"--tokenizer-type {cfg.tokenizer_type}")
    if dataset.vocab_size != tokenizer.vocab_size:
        raise RunSetupError(f"{where}: the dataset was tokenised with a vocabulary of "
                            f"{dataset.vocab_size} tokens, the tokenizer of this run has "
                            f"{tokenizer.vocab_size}; re-run tools/preprocess_flan.py with "
                            f"the same tokenizer files")
    mismatch = tokenizer_mismatch(dataset.tokenizer_info, tokenizer)
    if mismatch:
        raise RunSetupError(f"{where}: {mismatch}")
    dataset.check_vocab_size(padded_vocab_size(tokenizer.vocab_size,
                                               cfg.tensor_model_parallel_size,
                                               cfg.make_vocab_size_divisible_by))
    if cfg.is_t5:
        lengths = dataset.t5_lengths(cfg.seq_length, cfg.decoder_seq_length)
        loss_tokens = dataset.t5_loss_tokens(cfg.decoder_seq_length)
    else:
        lengths = dataset.gpt_lengths(cfg.seq_length)
        loss_tokens = dataset.gpt_loss_tokens(cfg.seq_length)
    indices = held_out = None
    if cfg.split and not own_path:
        groups = getattr(dataset, "stream_ids", dataset.task_ids)
        parts = split_indices(groups, parse_split(cfg.split), cfg.seed)
        indices = parts[PARTS.index(part)]
        held_out = {name: len(p) for name, p in zip(PARTS, parts)}
        if len(indices) == 0:
            raise RunSetupError(f"{where}: --split {cfg.split} leaves no {part} samples of "
                                f"{len(dataset)}")
    try:
        sampler = batch_sampler(cfg, dataset, lengths, [w for w, _ in blend], indices)
    except ValueError as exc:   # e.g. a sample longer than the batch budget
        raise RunSetupError(f"{where}: {exc}") from exc
    return TrainingData(cfg.model, dataset, sampler, lengths, cfg.seq_length,
                        cfg.decoder_seq_length, tokenizer.vocab_size, loss_tokens, indices,
                        held_out, data_identity(dataset, [prefix for _, prefix in blend]))


def data_identity(dataset: MultiTaskDataset, prefixes: list[str]) -> dict:
    """The tokenizer (fingerprint) and datasets (manifest digests, prefixes) a run trains on; a
    checkpoint records it and a resume compares it (check_data_identity). Blend weights,
    --split and the batch flags are the sampler's (sampler_settings)."""
    return {"tokenizer": tokenizer_label(dataset.tokenizer_info),
            "tokenizer_fingerprint": dataset.tokenizer_info.get("fingerprint"),
            "datasets": [[os.path.abspath(p), manifest_digest(p)] for p in prefixes]}


def describe_identity(identity: dict) -> str:
    return (f"tokenizer {identity['tokenizer']}, data " + ", ".join(
        f"{prefix} (manifest {digest[:12]})" for prefix, digest in identity["datasets"]))


def check_data_identity(cfg: TrainConfig, identity: dict) -> None:
    """Resuming binds a run to the tokenizer and datasets its checkpoint was trained on: any
    other is a RunSetupError naming both (before any collective, every rank alike), unless
    --override-data-identity says the change is meant; --finetune takes the weights alone and
    is not bound. A checkpoint that records no identity (older ones, imports) or cannot be
    read here (the load says why) is not compared."""
    if not cfg.load or cfg.finetune or cfg.override_data_identity:
        return
    try:
        saved = checkpointing.read_common(cfg.load).get("data")
    except (OSError, ValueError):
        return
    def key(ident: dict):
        return ident.get("tokenizer_fingerprint"), [d for _, d in ident.get("datasets", [])]

    if isinstance(saved, dict) and key(saved) != key(identity):
        raise RunSetupError(f"--load {cfg.load}: the checkpoint was trained on "
                            f"{describe_identity(saved)}; this run has "
                            f"{describe_identity(identity)}. Resume with the same data and "
                            f"tokenizer, pass --override-data-identity if the change is meant, "
                            f"or --finetune to take the weights alone")


def batch_sampler(cfg: TrainConfig, dataset: MultiTaskDataset, lengths: np.ndarray,
                  weights: list, indices: np.ndarray | None = None) -> GlobalBatchSampler:
    """Global batches over one dataset's tasks, or over a blend's (prefix, task) streams;
    `indices` (--split) limits them to those samples (the sampler numbers them 0..)."""
    common = dict(seed=cfg.seed, max_samples_per_batch=cfg.global_batch_size or None,
                  settings=sampler_settings(cfg), packing=packing_window(cfg))
    subset = (lambda values: values) if indices is None else (lambda values: values[indices])
    if not isinstance(dataset, BlendedMultiTaskDataset):
        return GlobalBatchSampler(subset(lengths), subset(dataset.task_ids),
                                  cfg.tokens_per_global_batch,
                                  mixing_cap=cfg.mixing_cap, temperature=cfg.mixing_temperature,
                                  task_names=dataset.task_names, **common)
    names = [f"{name} ({part.prefix})" for part in dataset.parts for name in part.task_names]
    rates = stream_rates(dataset, weights, cfg.mixing_cap, cfg.mixing_temperature)
    if indices is not None:     # a stream whose few samples were all held out is not drawn
        kept = np.bincount(subset(dataset.stream_ids), minlength=len(rates))
        rates = np.where(kept > 0, rates, 0.0)
    return GlobalBatchSampler(subset(lengths), subset(dataset.stream_ids),
                              cfg.tokens_per_global_batch,
                              task_names=names, rates=rates, **common)


def packing_window(cfg: TrainConfig) -> PackingWindow | None:
    """--packing-window: the sampler packs windows of the stream into rows of the run's
    maximum lengths with --packing-algorithm and --max-pack-depth; None without it."""
    if not cfg.packing_window:
        return None
    rows = (cfg.seq_length, cfg.decoder_seq_length) if cfg.is_t5 else (cfg.seq_length,)
    return PackingWindow(cfg.packing_window, cfg.packing_algorithm, rows, cfg.max_pack_depth)


def sampler_settings(cfg: TrainConfig) -> dict:
    """The flags that decide the global batches, by flag name: a checkpoint's sampler state
    records them and a resume with other values is an error naming the flag."""
    weights = [w for w, _ in parse_data_path(cfg.data_path)]
    return {"--seed": cfg.seed,
            "--global-batch-size": cfg.global_batch_size or None,
            # derived from --global-batch-size when that is given
            "--tokens-per-global-batch": (None if cfg.global_batch_size
                                          else cfg.tokens_per_global_batch),
            "--mixing-cap": cfg.mixing_cap, "--mixing-temperature": cfg.mixing_temperature,
            "--split": cfg.split,     # which samples training draws from
            # shares, so "3 A 7 B" resumes a run of "0.3 A 0.7 B"
            "--data-path weights": (None if weights[0] is None
                                    else [w / sum(weights) for w in weights]),
            # rows packed ahead of training decide the batches too
            "--packing-window": cfg.packing_window or None,
            "--packing-algorithm": cfg.packing_algorithm if cfg.packing_window else None,
            "--max-pack-depth": cfg.max_pack_depth if cfg.packing_window else None}


# ---------------------------------------------------------------------------- model

def model_spec(cfg: TrainConfig, vocab_size: int) -> ModelSpec:
    """The model of `cfg` with `vocab_size` token rows (padded as --make-vocab-size-divisible-by
    and TP say; the padding is left out of the softmax): every ModelSpec option read from the
    flag that declares it (model_spec.option_values)."""
    return ModelSpec(**option_values(cfg),
                     vocab_size=padded_vocab_size(vocab_size, cfg.tensor_model_parallel_size,
                                                  cfg.make_vocab_size_divisible_by),
                     unpadded_vocab_size=vocab_size)


def given_cut(cfg: TrainConfig, spec: ModelSpec) -> tuple[int, ...]:
    """ModelSpec.pipeline_cut as --pipeline-split gives it: () for 'even', the units given,
    or for 'balanced' the even spread of half layers that stands until balanced_cut_here
    has measured them."""
    if cfg.pipeline_split == "even":
        return ()
    from dynapipe_ext.costs.model_spec import balanced_cut
    num_stages = pipeline_stage_count(cfg)
    units = split_units(cfg.pipeline_split)
    if units is None:
        return balanced_cut([1.0] * (2 * spec.num_layers), num_stages)
    if len(units) != num_stages:
        raise ValueError(f"--pipeline-split {cfg.pipeline_split} gives {len(units)} stages; "
                         f"--pipeline-schedule {cfg.pipeline_schedule} at "
                         f"--pipeline-model-parallel-size {cfg.pipeline_model_parallel_size} "
                         f"has {num_stages}")
    return units


def balanced_cut_here(cfg: TrainConfig, spec: ModelSpec, lengths: np.ndarray,
                      layout: ParallelLayout) -> tuple[int, ...]:
    """--pipeline-split balanced: the cut (balanced_cut) of `spec`'s stages that evens their
    forward + backward time, as measured here on a two-layer copy of the model
    (profile_layers.half_layer_unit_times; averaged over all ranks, so that every rank cuts
    alike) at the token-weighted mean length of `lengths` (a global batch's samples: a token
    of the data sits in a sample that long on average, and attention grows with it), with
    rows for about an eighth of a pipeline's tokens. Measured rather than predicted: on a
    CPU the analytic model's FLOPs put too little time in attention and too much in the
    output layer, and the cut then overshoots."""
    from dynapipe_ext.costs.model_spec import balanced_cut, token_weighted_length
    from megatron.planning.profile_layers import half_layer_unit_times
    seq = max(8, int(token_weighted_length(lengths, cfg.seq_length)))
    tokens = float(np.asarray(lengths).sum())
    rows = max(1, round(tokens / layout.dp / (8 * layout.pp) / seq))
    times = half_layer_unit_times(spec, stage_config(cfg, spec, layout), rows, seq,
                                  layout.device,
                                  tie_embeddings=not cfg.untie_embeddings_and_output_weights)
    mean = torch.tensor(times, dtype=torch.float64, device=layout.device)
    dist.all_reduce(mean)
    first, mlp, attention, last = (mean / dist.get_world_size()).tolist()
    per_unit = [first] + [mlp, attention] * (spec.num_layers - 1) + [last]
    return balanced_cut(per_unit, len(spec.pipeline_cut))


def model_dtype(cfg: TrainConfig) -> str:
    return "bfloat16" if cfg.bf16 else "float32"


def stage_config(cfg: TrainConfig, spec: ModelSpec, layout: ParallelLayout):
    """megatron-core's TransformerConfig of this run's stage modules."""
    return build_transformer_config(spec, cfg.tensor_model_parallel_size,
                                    cfg.pipeline_model_parallel_size, model_dtype(cfg),
                                    hidden_dropout=cfg.hidden_dropout,
                                    attention_dropout=cfg.attention_dropout,
                                    fused=layout.device.type == "cuda",
                                    fuse_bias_gelu=cfg.bias_gelu_fusion,
                                    fuse_bias_dropout=cfg.bias_dropout_fusion)


def build_stages(cfg: TrainConfig, spec: ModelSpec, layout: ParallelLayout,
                 stage_to_rank: tuple[int, ...]):
    """This rank's stage modules (stage index -> module), with layout-independent weights."""
    stages = build_rank_stages(spec, stage_to_rank, layout.pp_rank,
                               stage_config(cfg, spec, layout),
                               tie_embeddings=not cfg.untie_embeddings_and_output_weights,
                               attention_backend=cfg.attention_backend)
    initialize_stage_weights(stages, cfg.seed)
    return {s: m.to(layout.device) for s, m in stages.items()}


# ---------------------------------------------------------------------------- planning

def fixed_micro_batch_size(cfg: TrainConfig) -> int | None:
    """Rows per micro-batch the planner must use: --micro-batch-size for padding (default
    PADDING_MICRO_BATCH_SIZE) and packing (None: the planner picks per batch); dynamic
    micro-batching sizes every micro-batch itself (None)."""
    if cfg.micro_batching == "padding":
        return PADDING_MICRO_BATCH_SIZE if cfg.micro_batch_size is None else cfg.micro_batch_size
    return cfg.micro_batch_size if cfg.micro_batching == "packing" else None


def planner_config(cfg: TrainConfig, spec: ModelSpec, dp: int, comm: CommModel | None = None,
                   auto_layout: str = "linear") -> IterationPlannerConfig:
    """What the iteration planner needs to know about this run (picklable, for its workers),
    with the cost model of this run's device and precision (device_costs). The one place a
    run's planner settings are made: trainer, tools and tests call it. Its `pipeline_layout`
    is also the stage layout the model is built with. What the run finds out at start-up
    comes in as arguments: `comm`, the measured pipeline link (default: --p2p-* flags), and
    `auto_layout`, the layout --pipeline-schedule auto runs on."""
    pp = cfg.pipeline_model_parallel_size
    split = PlannerConfig(
        model=cfg.model, max_seq_len=cfg.seq_length, max_dec_seq_len=cfg.decoder_seq_length,
        pipeline_stages=pp, data_parallel=dp, tokens_per_global_batch=cfg.tokens_per_global_batch,
        micro_batch_size=fixed_micro_batch_size(cfg),
        # with --packing-window the sampler packed the rows already and emits them in an
        # order from which next-fit rebuilds them (megatron/data/sampler.py)
        packing_algorithm="nextfit" if cfg.packing_window else cfg.packing_algorithm,
        max_pack_depth=cfg.max_pack_depth, dynamic_layout=cfg.dynamic_layout,
        packed_attention=ATTENTION_COSTING[cfg.attention_backend])   # costed as it runs
    return IterationPlannerConfig(
        spec=spec, planner=split, micro_batching=cfg.micro_batching,
        pipeline_schedule=cfg.pipeline_schedule, pp=pp, dp=dp,
        tp=cfg.tensor_model_parallel_size, waves=cfg.pipeline_waves,
        virtual_stages=virtual_stages(cfg),
        cost_model=device_costs.cost_model_source(cfg, dp, spec=spec),
        dtype=model_dtype(cfg), check_plans=cfg.check_plans, auto_layout=auto_layout,
        comm=comm or device_costs.comm_model(cfg), replica_split=replica_split(cfg))


def replica_split(cfg: TrainConfig) -> str:
    """The run's --replica-split, with 'auto' resolved from torchrun's node layout."""
    if cfg.replica_split != "auto":
        return cfg.replica_split
    if cfg.packing_window:     # rows packed for the whole batch: dealing samples would break them
        return "micro-batches"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return default_replica_split(world, ranks_per_node_from_env(world))


def plan_problems(plan, iteration: int, layout: ParallelLayout, stage_to_rank, dtype: str,
                  batch_size: int) -> list[str]:
    """Why `plan` cannot run on this rank (empty when it can)."""
    problems = []
    if plan.iteration != iteration:
        problems.append(f"plan is for iteration {plan.iteration}, expected {iteration}")
    if (plan.dp_rank, plan.pp_rank) != (layout.dp_rank, layout.pp_rank):
        problems.append(f"plan is for (dp {plan.dp_rank}, pp {plan.pp_rank}), this rank is "
                        f"(dp {layout.dp_rank}, pp {layout.pp_rank})")
    if tuple(plan.stage_to_rank) != tuple(stage_to_rank):
        problems.append(f"plan lays stages out as {plan.stage_to_rank}, the model was built "
                        f"as {tuple(stage_to_rank)}")
    if plan.dtype != dtype:
        problems.append(f"plan moves {plan.dtype} tensors, the model runs in {dtype}")
    bad = sorted(s for mb in plan.micro_batches for s in mb.sample_ids
                 if not 0 <= s < batch_size)
    if bad:
        problems.append(f"plan names samples {bad[:5]} outside the global batch of {batch_size}")
    if plan.loss_tokens <= 0:
        problems.append(f"plan carries {plan.loss_tokens} loss tokens for the global batch (a "
                        f"plan made from the lengths alone, or a batch with nothing to learn)")
    return problems


def agree_or_raise(problems: list[str], what: str) -> None:
    """Every rank learns whether any rank found a problem, and all raise the same error, so
    no rank goes on into a collective that a failed peer will never join."""
    reports = problems_of_all_ranks(problems)
    if len(reports) == 1:
        if problems:
            raise RunSetupError(f"{what}: " + "; ".join(problems))
        return
    lines = [f"rank {r}: {p}" for r, ps in enumerate(reports) for p in ps]
    if lines:
        raise RunSetupError(f"{what}:\n  " + "\n  ".join(lines))


def auto_layout_here(trial_config, lengths, rank: int) -> str:
    """--pipeline-schedule auto: the layout rank 0 finds predicted fastest for the first batch
    (choose_auto_layout on `trial_config()`, the run's planner config on the linear layout,
    with its cost model and link), the same on every rank."""
    problems, chosen = [], "linear"
    if rank == 0:
        try:
            chosen = choose_auto_layout(trial_config(), lengths).auto_layout
        except ValueError as err:
            problems.append(str(err))
    agree_or_raise(problems, "--pipeline-schedule auto")
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [chosen]
        dist.broadcast_object_list(box, src=0)
        chosen = box[0]
    return chosen


# ---------------------------------------------------------------------------- the run

@dataclass
class TrainingRun:
    cfg: TrainConfig
    data: TrainingData
    layout: ParallelLayout
    spec: ModelSpec
    stage_to_rank: tuple
    stages: dict
    optimizer: TrainOptimizer
    handlers: HandlerTable
    executor: Executor
    plans: PlanDelivery | None     # None when the checkpoint has nothing left to train
    logger: TrainLogger
    start_iteration: int
    evaluator: Evaluator | None = None     # --eval-interval: validation between iterations
    flextp: object | None = None           # --tp-balance: stage_balance.StageBalancer

    @property
    def modules(self) -> list:
        return [self.stages[s] for s in sorted(self.stages)]

    def close(self, finished: bool = True) -> None:
        if self.plans is not None:
            self.plans.close()
        self.logger.close(finished)
        self.handlers.runtime.close()
        if self.cfg.save and self.layout.rank == 0:
            checkpointing.release_save_lock(self.cfg.save)


def check_imported_window(cfg: TrainConfig) -> None:
    """RunSetupError where --load names a Hugging Face import with a sliding window shorter
    than --seq-length (hf_convert.imported_window_problem)."""
    if not cfg.load:
        return
    from megatron.checkpoint.hf_convert import ConversionError, imported_window_problem
    try:
        problem = imported_window_problem(cfg.load, cfg.seq_length)
    except ConversionError as err:
        raise RunSetupError(str(err)) from err
    if problem:
        raise RunSetupError(f"--load {problem}")


def build_run(cfg: TrainConfig, make_planner_config=None, verbose: bool = True) -> TrainingRun:
    """Everything a run needs, in the order in which things can go wrong.
    `make_planner_config(cfg, spec, dp, comm=, auto_layout=)` replaces `planner_config` (the
    throughput benchmark plans with its own cost-model figures); it is called once, when the
    pipeline cut, link and layout are known. `verbose=False` keeps rank 0 from printing."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_device_precision(cfg, use_cuda())
    check_save_dir(cfg)
    check_imported_window(cfg)
    data = open_training_data(cfg, rank)
    check_data_identity(cfg, data.identity)
    valid = open_training_data(cfg, rank, "valid") if cfg.eval_interval else None
    # a checkpoint with more token rows than the tokenizer has tokens keeps them (FLAN-T5);
    # one with fewer is refused at load (checkpointing.signature_differences)
    saved_vocab = checkpointing.saved_vocab_size(cfg.load) if cfg.load else None
    spec = model_spec(cfg, max(data.vocab_size, saved_vocab or 0))
    try:
        spec = dataclasses.replace(spec, pipeline_cut=given_cut(cfg, spec))
    except ValueError as err:
        raise RunSetupError(str(err)) from err
    make = make_planner_config or planner_config
    dp = cfg.data_parallel_size(world_size)
    layout = setup_model_parallel(     # 'auto' is checked on its linear layout here
        cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.seed,
        timeout_s=cfg.distributed_timeout_minutes * 60,
        total_layers=spec.total_layers if cfg.pipeline_split == "even" else None,
        num_stages=pipeline_stage_count(cfg), vocab_size=spec.vocab_size,
        num_attention_heads=cfg.num_attention_heads)
    if cfg.cost_model == "profile":      # made on first use, then read from the cache
        try:
            device_costs.ensure_cost_profile(cfg, spec, layout.rank, layout.device,
                                             say=(lambda line: print(line, flush=True))
                                             if verbose else (lambda line: None))
        except device_costs.CostProfileError as err:
            raise RunSetupError(str(err)) from err
    link = None     # read on rank 0, the planner
    if device_costs.comm_model(cfg) is None and layout.device.type == "cuda" and layout.pp > 1:
        link = device_costs.measure_link(pipeline_p2p_groups(), layout.device)
    if cfg.pipeline_split == "balanced":     # every rank cuts alike (averaged measurement)
        cut = balanced_cut_here(cfg, spec, data.batch_lengths(0), layout)
        spec = dataclasses.replace(spec, pipeline_cut=cut)
    auto_layout = "linear"
    choose_layout = (cfg.pipeline_schedule == "auto" and cfg.pipeline_split == "even"
                     and layout.pp > 1)
    if choose_layout:
        auto_layout = auto_layout_here(
            lambda: make(cfg, spec, dp, comm=link, auto_layout="linear"),
            data.batch_lengths(0), layout.rank)
    plan_cfg = make(cfg, spec, dp, comm=link, auto_layout=auto_layout)   # the run's, once
    stage_to_rank = pipeline_layout(plan_cfg)
    if choose_layout and verbose and layout.rank == 0:
        print(f"[train] --pipeline-schedule auto: {auto_layout} layout "
              f"({len(stage_to_rank)} stages), predicted fastest on the first batch", flush=True)
    stages = build_stages(cfg, spec, layout, stage_to_rank)
    flextp = None
    if cfg.tp_balance != "off":    # uneven TP slots; before the gradient buffer sees shapes
        from megatron.flextp.stage_balance import build_balancer
        flextp = build_balancer(cfg, stages, layout, verbose)
    elif os.environ.get("FLEXTP_SLOWDOWN") and verbose and layout.rank == 0:
        print(f"[train] warning: FLEXTP_SLOWDOWN={os.environ['FLEXTP_SLOWDOWN']} has no effect "
              f"with --tp-balance off (only FlexTP's slot layers repeat their GEMMs; "
              f"--tp-balance resize --flextp-max-drop-fraction 0 keeps the even partition)",
              flush=True)
    tied_group = replica_groups(spec, stage_to_rank, not cfg.untie_embeddings_and_output_weights,
                                cfg.distributed_timeout_minutes * 60)
    dp_group = parallel_state.get_data_parallel_group() if layout.dp > 1 else None
    grad_buffer = GradBuffer({s: list(m.parameters()) for s, m in stages.items()}, dp_group,
                             bucket_numel=cfg.ddp_bucket_size, tied_group=tied_group,
                             shard=cfg.use_distributed_optimizer,
                             overlap_param_gather=cfg.overlap_param_gather)
    if cfg.use_distributed_optimizer:
        optimizer = ShardedOptimizer(stage_parameters(stages), cfg, layout.tp_rank,
                                     parallel_state.get_model_parallel_group(), grad_buffer,
                                     dp_group)
    else:
        optimizer = TrainOptimizer(stage_parameters(stages), cfg, layout.tp_rank,
                                   parallel_state.get_model_parallel_group(), grad_buffer)
    if flextp is not None:
        flextp.optimizer = optimizer       # migration moves its main copies and moments
    start = 0
    if cfg.load:
        with checkpoint_layout(flextp):
            done = resume(cfg, data, stages, optimizer, layout)
        start = agree_on_start(done, cfg.load, layout)
    if cfg.save:
        checkpointing.prepare_save_dir(cfg.save, layout.rank, cfg.overwrite_checkpoints)
    handlers = make_handlers(stages, batch_provider=None, global_loss_tokens=1,
                             pp_group=pipeline_p2p_groups(),
                             device=layout.device, timeout_s=cfg.distributed_timeout_minutes * 60,
                             grad_buffer=grad_buffer)
    logger = TrainLogger(cfg.log_interval, cfg.tensorboard_dir,
                         enabled=layout.rank == 0 and verbose, stats_file=cfg.stats_file)
    finished = start >= cfg.train_iters
    if layout.rank == 0 and verbose:
        if finished:
            print(f"[train] checkpoint at iteration {start} of --train-iters {cfg.train_iters}: "
                  f"nothing left to train", flush=True)
        else:
            describe_run(cfg, data, spec, layout, start)
            if valid is not None:
                print(Evaluator.describe(cfg, valid), flush=True)
            elif data.held_out:
                print(f"[train] {held_out_summary(cfg.split, data.held_out)}; training draws "
                      f"only from the train part", flush=True)
    plans = None   # a finished run starts neither planners nor plan delivery
    if not finished:
        plans = start_plan_delivery(plan_cfg, data.planner_input, layout.rank,
                                    layout.world_size, layout.dp_rank, layout.pp_rank, start,
                                    cfg.train_iters, num_workers=cfg.num_planner_workers,
                                    prefetch=cfg.plan_prefetch,
                                    timeout_s=cfg.distributed_timeout_minutes * 60,
                                    report=functools.partial(print, flush=True)
                                    if verbose else None)
    evaluator = None
    if valid is not None and not finished:
        evaluator = Evaluator(valid, dataclasses.replace(plan_cfg, forward_only=True),
                              cfg.eval_interval, cfg.eval_iters, cfg.train_iters)
    return TrainingRun(cfg, data, layout, spec, stage_to_rank, stages, optimizer, handlers,
                       Executor(handlers), plans, logger, start, evaluator, flextp)


def check_save_dir(cfg: TrainConfig) -> None:
    """A run never writes over checkpoints it does not resume: --save holding checkpoints is
    refused (every rank alike, before any collective) unless this run resumes them (--load the
    same folder, without --finetune) or --overwrite-checkpoints sets them aside."""
    if not cfg.save or cfg.overwrite_checkpoints:
        return
    try:
        newest = checkpointing.newest_checkpoint(cfg.save)
    except checkpointing.CheckpointError as err:
        raise RunSetupError(f"--save {cfg.save}: {err}") from None
    resumes = (cfg.load and not cfg.finetune
               and os.path.realpath(cfg.load) == os.path.realpath(cfg.save))
    if newest is not None and not resumes:
        raise RunSetupError(f"--save {cfg.save} holds checkpoints of another run (newest: "
                            f"iteration {newest}); resume them with --load {cfg.save}, save to "
                            f"a new folder, or start over there with --overwrite-checkpoints "
                            f"(they are set aside as iter_N.abandoned)")


def checkpoint_layout(flextp):
    """Where a checkpoint is saved or loaded: in FlexTP's even partition (--tp-balance; the
    format of an ordinary TP run's checkpoint), in place otherwise."""
    return contextlib.nullcontext() if flextp is None else flextp.even_layout()


def resume(cfg, data: TrainingData, stages, optimizer, layout: ParallelLayout) -> int:
    """Load the newest checkpoint of --load that every rank can read (an unreadable latest one
    is skipped with a warning); returns the iterations it had completed. The LR schedule flags
    must match the checkpoint's unless --override-opt-param-scheduler or
    --use-checkpoint-opt-param-scheduler says which wins. Like Megatron, a --load directory
    without a checkpoint yet (e.g. --save and --load the same directory on a first run)
    starts from iteration 0 (with --finetune that is an error: the weights are the point).
    The checkpoint may come from another TP / PP / DP layout (checkpointing.py)."""
    newest = checkpointing.newest_checkpoint(cfg.load)
    if cfg.finetune and newest is None:
        raise RunSetupError(f"--load {cfg.load} --finetune: no {checkpointing.LATEST} there "
                            f"(no complete checkpoint to take the weights from)")
    if newest is None:
        if layout.rank == 0:
            print(f"[train] --load {cfg.load}: no checkpoint there yet, starting from "
                  f"iteration 0", flush=True)
        return 0
    if layout.rank == 0 and checkpointing.rebuild_tracker(cfg.load) is not None:
        print(f"[train] --load {cfg.load}: {checkpointing.LATEST} was missing; rebuilt it "
              f"from the newest complete checkpoint, iteration {newest}", flush=True)
    modules = [stages[s] for s in sorted(stages)]
    done, sampler_state = checkpointing.load_checkpoint(cfg.load, modules, optimizer, cfg,
                                                        layout.rank, layout.world_size, layout)
    if sampler_state:
        try:
            data.sampler.check_resume(sampler_state)
        except ValueError as exc:
            raise RunSetupError(f"--load {cfg.load}: {exc}") from None
    consumed = data.sampler.consumed_before(done)
    if sampler_state and sampler_state["consumed_samples"] != consumed:
        raise RunSetupError(f"--load {cfg.load}: the checkpoint consumed "
                            f"{sampler_state['consumed_samples']} samples in {done} iterations, "
                            f"this run's data and batch settings give {consumed}")
    return done


def agree_on_start(start: int, load_dir: str, layout: ParallelLayout) -> int:
    """The iteration every rank resumes from; ranks that loaded different checkpoints (e.g.
    per-node copies of --load) would run different iterations against each other, so that
    is the same error on every rank."""
    if layout.world_size == 1:
        return start
    mine = torch.tensor([start], dtype=torch.int64, device=layout.device)
    everyone = [torch.empty_like(mine) for _ in range(layout.world_size)]
    dist.all_gather(everyone, mine)
    starts = [int(t.item()) for t in everyone]
    if len(set(starts)) > 1:
        found = ", ".join(f"rank {r}: iteration {it}" for r, it in enumerate(starts))
        raise RunSetupError(f"--load {load_dir}: the ranks resume from different checkpoints "
                            f"({found}); every rank must load the same iteration")
    return start


def describe_stage(kinds: tuple[str, ...]) -> str:
    """A stage's layers in a few words: '3.5 layers + head' (a half layer counts 0.5)."""
    from dynapipe_ext.costs.model_spec import EMBEDDING, GPT_ATTENTION, GPT_LAYER, GPT_MLP, HEAD
    layers = kinds.count(GPT_LAYER) + 0.5 * (kinds.count(GPT_ATTENTION) + kinds.count(GPT_MLP))
    text = f"{layers:g} layers"
    if EMBEDDING in kinds:
        text = "embedding + " + text
    return text + (" + head" if HEAD in kinds else "")


def describe_run(cfg, data: TrainingData, spec: ModelSpec, layout: ParallelLayout,
                 start: int) -> None:
    cut = data.truncation_report()
    print(f"[train] {cfg.model.upper()} {spec.total_layers} layers, hidden {spec.hidden_size}, "
          f"vocab {spec.vocab_size}; TP={layout.tp} PP={layout.pp} DP={layout.dp} on "
          f"{layout.device.type}; attention {cfg.attention_backend}; micro-batching "
          f"{cfg.micro_batching}, schedule {cfg.pipeline_schedule}; {len(data.dataset)} samples, {cut['truncated']} truncated "
          f"to the sequence length; iterations {start}..{cfg.train_iters}", flush=True)
    if spec.pipeline_cut:
        stages = spec.stage_layers(len(spec.pipeline_cut))
        print(f"[train] --pipeline-split {cfg.pipeline_split}: stages of "
              f"{' | '.join(describe_stage(kinds) for kinds in stages)}", flush=True)
    times = "" if cfg.cost_model == "analytic" else "; times from the cost profile"
    print(f"[train] planning for {device_costs.device_figures(cfg).describe()}{times}",
          flush=True)


def train_step(run: TrainingRun, iteration: int) -> IterationStats:
    """One iteration on this rank: plan, tensors, executor, gradient reduce, optimizer step.
    Its stats carry where the time went on this rank (step_timing.PARTS)."""
    cfg, layout = run.cfg, run.layout
    clock = StepClock()
    delivered = run.plans.fetch(iteration)
    clock.lap("plan_wait")
    plan = delivered.plan
    problems = plan_problems(plan, iteration, layout, run.stage_to_rank, model_dtype(cfg),
                             len(run.data.sample_ids(iteration)))
    clock.lap("host")
    what = f"iteration {iteration}: the plan does not match this rank"
    if cfg.check_plans:      # every rank learns of any rank's problem (one collective)
        agree_or_raise(problems, what)
    elif problems:           # the peers stop at their next collective's timeout
        raise RunSetupError(f"{what}: " + "; ".join(problems))
    clock.lap("sync_wait")
    micro_batches = plan.micro_batches
    keys = run.handlers.runtime.batch_keys      # only what this rank's stages read
    samples = run.data.batch_samples(   # this replica's samples only
        iteration, [s for mb in micro_batches for s in mb.sample_ids])
    run.handlers.runtime.reset(
        lambda mb: build_micro_batch(micro_batches[mb], samples, cfg.model, run.data.pad_id,
                                     keys),
        plan.loss_tokens, micro_batch_order(plan))
    run.optimizer.grad_buffer.expect_backwards(backwards_per_stage(plan.instructions))
    if run.flextp is not None:
        run.flextp.begin()
    clock.lap("host")
    records = run.executor.run(plan, record_times=True)
    clock.add_executor(records, run.handlers.runtime.batch_wait_s)
    run.handlers.runtime.check_drained()
    clock.lap("host")
    all_reduce_data_parallel_grads(run.optimizer.grad_buffer)
    loss, _, (slots, count) = global_step_totals(
        run.handlers.runtime, (token_slots(micro_batches), len(micro_batches)))
    clock.lap("sync_wait")
    step = run.optimizer.step(iteration)
    clock.lap("optimizer")
    if run.flextp is not None:     # measure, detect, rebalance at the iteration boundary
        run.flextp.end(iteration)
    real_tokens = int(run.data.batch_lengths(iteration).sum())
    shapes = ("replica 0: " if layout.dp > 1 else "") + shapes_summary(micro_batches)
    clock.lap("host")
    return IterationStats(
        iteration=iteration + 1, train_iters=cfg.train_iters, loss=loss, lr=step["lr"],
        grad_norm=step["grad_norm"], real_tokens=real_tokens,
        token_slots=slots, num_micro_batches=count, shapes=shapes,
        plan_wait_s=delivered.wait_s, iteration_s=clock.elapsed,
        peak_memory_bytes=peak_memory_bytes(layout.device), time_parts=clock.parts,
        executor_cpu_s=clock.executor_cpu_s)


def gather_time_parts(history: list[IterationStats]) -> list[dict]:
    """Every rank's step_timing parts summed over `history` (its own iterations), in rank
    order. Collective over the world group when there is one."""
    mine = {}
    for stats in history:
        mine = add_parts(mine, stats.time_parts or {})
    return gather_from_ranks(mine)


def save(run: TrainingRun, iterations_done: int, say: bool = True) -> None:
    sampler_state = run.data.sampler.state_dict(run.data.sampler.consumed_before(iterations_done))
    run.optimizer.grad_buffer.wait_param_gather()     # --overlap-param-gather
    with checkpoint_layout(run.flextp):
        checkpointing.save_checkpoint(run.cfg.save, iterations_done, run.modules,
                                      run.optimizer, sampler_state, run.cfg, run.layout.rank,
                                      run.layout.world_size, run.layout,
                                      data_identity=run.data.identity)
    if run.layout.rank == 0 and say:
        print(f"[train] saved checkpoint of iteration {iterations_done} to {run.cfg.save}",
              flush=True)


def stop_on_signal(run: TrainingRun, name: str, done: int, saved: bool) -> None:
    """After the iteration in which some rank received signal `name` (exit_signals.py): save
    unless that iteration just did, and say so in one line on rank 0."""
    cfg = run.cfg
    if cfg.save and not saved:
        save(run, done, say=False)
    if run.layout.rank == 0:
        what = (f"saved checkpoint of iteration {done} to {cfg.save} (resume with --load "
                f"{cfg.save})" if cfg.save else "no --save, so no checkpoint")
        print(f"[train] {name}: stopped after iteration {done} of {cfg.train_iters}; {what}",
              flush=True)


def evaluate_or_fail(run: TrainingRun, iterations_done: int):
    """Validation after `iterations_done` iterations (ValidationStats), or TrainingFailed."""
    run.optimizer.grad_buffer.wait_param_gather()     # --overlap-param-gather
    with failure_named(run, f"validation after iteration {iterations_done}"):
        if run.flextp is not None:     # the whole model, not the resized one
            with run.flextp.all_units():
                return run.evaluator.evaluate(run, iterations_done)
        return run.evaluator.evaluate(run, iterations_done)


# how gloo and NCCL report a collective whose peer process has ended
PEER_ENDED = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote process exited")


@contextlib.contextmanager
def failure_named(run: TrainingRun, what: str):
    """Any error inside re-raised as TrainingFailed naming this rank's place in the layout and
    `what` failed; where a peer process ended (PEER_ENDED), the message says so first, since
    the cause is in that rank's own error line, not here."""
    try:
        yield
    except TrainingFailed:
        raise
    except Exception as err:
        cause = ("another rank's process ended (its own error line says why): "
                 if PEER_ENDED.search(str(err)) else "")
        raise TrainingFailed(f"rank {run.layout.rank} (tp {run.layout.tp_rank}, pp "
                             f"{run.layout.pp_rank}, dp {run.layout.dp_rank}): {what} failed: "
                             f"{cause}{type(err).__name__}: {err}") from err


def train(run: TrainingRun) -> list[IterationStats]:
    """The training loop; returns the per-iteration stats (identical on every rank). SIGTERM /
    SIGINT end it after the current iteration, with a checkpoint (exit_signals.py)."""
    cfg = run.cfg
    profiler = IterationProfiler(cfg, run.layout.rank, run.layout.device)
    finished = False
    try:
        with ExitSignals(cfg.exit_signal_handler) as signals:
            for iteration in range(run.start_iteration, cfg.train_iters):
                profiler.before(iteration)
                with failure_named(run, f"iteration {iteration}"):
                    stats = train_step(run, iteration)
                profiler.after(iteration)
                run.logger.log(stats)
                done = iteration + 1
                if run.evaluator is not None and run.evaluator.due(done):
                    run.logger.log_validation(evaluate_or_fail(run, done))
                saved = bool(cfg.save) and (done == cfg.train_iters or
                                            (cfg.save_interval and done % cfg.save_interval == 0))
                if saved:
                    save(run, done)
                with failure_named(run, f"the exit-signal check after iteration {done}"):
                    name = signals.agreed()      # a collective: a dead peer fails it
                if name:
                    stop_on_signal(run, name, done, saved)
                    break
        run.optimizer.grad_buffer.wait_param_gather()     # the weights the run ends with
        profiler.stop(cfg.train_iters)
        run.logger.log_time_parts(gather_time_parts(run.logger.history[1:]
                                                    or run.logger.history))
        finished = True
    finally:
        run.close(finished)
    return run.logger.history
