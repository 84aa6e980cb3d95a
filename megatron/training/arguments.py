"""Command line of pretrain_gpt.py / pretrain_t5.py: Megatron's flag names where they exist,
parsed into one typed, validated `TrainConfig` before anything else starts.

Each flag is declared once, in `FLAGS` (megatron/training/flags.py `Flag`: names, group,
default, choices, help, the models that show it); choice lists and the FlexTP and tokenizer
flags come from the code that owns them. The parsers (`build_parser`, tools' `add_flag_group`)
and docs/FLAGS.md (`flags_markdown`) are generated from `FLAGS`, and `config_from_args` fills
the flat `TrainConfig` from it: each flag's value to the field it names, then
`resolved_fields` for Megatron's derived defaults. TrainConfig stays flat (one typed object
the code reads) and has no defaults of its own."""
from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Sequence

from dynapipe_ext.batching.microbatch import DYNAMIC_LAYOUTS
from dynapipe_ext.batching.planners import (ATTENTION_BACKENDS, PACKING_ALGORITHMS, STRATEGIES,
                                            PlannerConfig)
from dynapipe_ext.costs.model_spec import (MODEL_OPTIONS, NORMALIZATIONS,
                                            POSITION_EMBEDDING_TYPES, ModelSpec, flag_values,
                                            option_arg, option_problems, option_values)
from dynapipe_ext.flextp.policy import balance_flags
from dynapipe_ext.plan.iteration_planner import PIPELINE_SCHEDULES, REPLICA_SPLITS, stage_layout
from dynapipe_ext.schedule.registry import SCHEDULES, layout_of
from megatron.data.blend import parse_data_path
from megatron.data.split import parse_split
from megatron.data.tokenizers import tokenizer_flags
from megatron.training.flags import MODELS, Flag, add_flags, flag_by_dest, markdown_table

MICRO_BATCHING = tuple(STRATEGIES)      # the planner's strategies, in its order
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
VOCAB_MULTIPLE = 128    # Megatron's --make-vocab-size-divisible-by default


class ConfigError(ValueError):
    """A command-line value that cannot work; the message names the flag."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a training run needs to know, checked in `__post_init__`."""

    model: str  # "gpt" or "t5"
    # model shape
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int  # GPT tokens per sample / T5 encoder tokens
    decoder_seq_length: int  # T5 decoder tokens (0 for GPT)
    max_position_embeddings: int
    decoder_num_layers: int  # T5 only (0 for GPT); num_layers counts encoder layers
    # parallelism
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    distributed_timeout_minutes: float
    # batches and planning
    tokens_per_global_batch: int
    micro_batching: str
    packing_algorithm: str
    dynamic_layout: str
    micro_batch_size: int | None  # None: padding 4 rows, packing searched per batch
    pipeline_schedule: str
    num_planner_workers: int | str  # or "auto" (dynapipe_ext/plan/cluster.py)
    plan_prefetch: int
    check_plans: bool
    cost_model: str
    attention_backend: str   # resolved at start-up (resolve_attention_backend): never "auto"
    # optimisation
    lr: float
    min_lr: float
    lr_warmup_iters: int
    lr_decay_iters: int
    lr_decay_style: str
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    use_distributed_optimizer: bool  # optimizer state sharded over data-parallel ranks
    overlap_param_gather: bool  # its parameter all-gather left to the next forwards
    ddp_bucket_size: int | None  # elements per gradient bucket; None: about 16 per rank
    train_iters: int
    bf16: bool
    fp16: bool
    seed: int
    # data and tokenizer
    data_path: tuple  # Megatron's list: one prefix, or prefixes, or W1 P1 W2 P2 ...
    tokenizer_type: str
    vocab_file: str | None
    merge_file: str | None
    tokenizer_model: str | None
    # checkpoints and logging
    save: str | None
    save_interval: int
    load: str | None
    log_interval: int
    tensorboard_dir: str | None
    stats_file: str | None
    keep_last: int  # newest complete checkpoints kept; 0 = all
    override_opt_param_scheduler: bool  # resume: this run's LR schedule flags win
    use_checkpoint_opt_param_scheduler: bool  # resume: the checkpoint's schedule wins
    finetune: bool  # --load weights only: iteration 0, fresh state
    no_load_optim: bool  # --load without optimizer / LR schedule state
    no_load_rng: bool  # --load without RNG states (reseed)
    overwrite_checkpoints: bool  # --save's checkpoints set aside, not refused
    override_data_identity: bool  # resume: other data / tokenizer than the checkpoint's
    exit_signal_handler: bool  # SIGTERM / SIGINT: save at the end of the iteration, exit 0
    global_batch_size: int  # samples per global batch; 0 = token budget
    debug: bool  # a failure prints its traceback too
    mixing_cap: int | None  # FLAN/seqio examples-proportional cap
    mixing_temperature: float
    hidden_dropout: float  # Megatron's defaults
    attention_dropout: float
    bias_gelu_fusion: bool  # megatron-core's torch.compile'd fusions (GPU)
    bias_dropout_fusion: bool
    profile: bool  # torch.profiler over the iterations below
    profile_step_start: int
    profile_step_end: int
    profile_ranks: tuple
    profile_dir: str | None
    lr_wsd_decay_style: str  # WSD's annealing phase (Megatron's default)
    lr_wsd_decay_iters: int  # its length in iterations; WSD needs > 0
    # validation (megatron/training/evaluation.py)
    eval_interval: int  # iterations between evaluations; 0 = none
    eval_iters: int  # validation global batches per evaluation
    valid_data_path: tuple | None  # validation prefixes, --data-path syntax
    split: str | None  # Megatron's "969,30,1" of --data-path
    # device figures for planning (None: from the device; megatron/planning/device_costs.py)
    device_flops: float | None
    device_memory_gb: float | None
    memory_headroom_gb: float | None
    p2p_bandwidth_gbps: float | None
    p2p_latency_us: float | None
    replica_split: str  # iteration_planner.REPLICA_SPLITS, or "auto"
    max_pack_depth: int | None  # most samples in one packed row (None: no limit)
    packing_window: int  # samples packed together ahead of training; 0: per batch
    cost_model_cache_dir: str | None  # --cost-model profile (None: ~/.cache/...)
    untie_embeddings_and_output_weights: bool  # Megatron's default: tied
    # layer options (ModelSpec fields; T5 v1.1 / FLAN-T5 need all of them)
    normalization: str  # --normalization
    norm_epsilon: float  # --norm-epsilon
    add_bias_linear: bool  # --disable-bias-linear sets False
    gated_linear_unit: bool  # --gated-gelu
    softmax_scale: float | None  # --softmax-scale (T5: 1.0)
    position_embedding_type: str  # --position-embedding-type
    relative_attention_num_buckets: int
    relative_attention_max_distance: int
    kv_channels: int  # --kv-channels; 0: hidden / heads
    group_query_attention: bool  # --group-query-attention
    num_query_groups: int  # --num-query-groups; without GQA: num_attention_heads
    add_qkv_bias: bool  # --add-qkv-bias (Qwen2: biases on q, k, v only)
    swiglu: bool  # --swiglu: gated SiLU MLP (Llama, Qwen, Mistral)
    rotary_base: float  # --rotary-base (HF rope_theta)
    rotary_percent: float  # --rotary-percent
    use_rope_scaling: bool  # --use-rope-scaling: Llama 3.1 frequency scaling
    rope_scaling_factor: float
    rope_scaling_low_freq_factor: float
    rope_scaling_high_freq_factor: float
    rope_scaling_original_max_position_embeddings: int
    vocab_extra_ids: int | None  # T5SentencePieceTokenizer sentinels (None: 100)
    make_vocab_size_divisible_by: int  # padded vocabulary: this x TP
    pipeline_split: str  # --pipeline-split: even, balanced, or units
    pipeline_waves: int  # --pipeline-waves: W of Hanayo's wave layout
    num_virtual_stages_per_pipeline_rank: int  # v of interleaving; 0: not given (2)
    # FlexTP straggler handling (megatron/flextp/stage_balance.py)
    tp_balance: str  # --tp-balance: off, resize, migrate, semi
    tp_balance_max_share: float  # slots per rank over the even share
    flextp_skip_order: str  # resize: rotate or sticky
    flextp_interval: int
    flextp_max_drop_fraction: float
    flextp_accuracy_weight: float
    flextp_min_horizon: int
    flextp_patience: int
    flextp_ffn_unit: int  # 0: ffn / (16 x TP)
    flextp_initial_speeds: str | None

    def __post_init__(self):
        problems = config_problems(self)
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def is_t5(self) -> bool:
        return self.model == "t5"

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """DP degree for `world_size` ranks; a clear error when TP x PP does not divide it."""
        check_world_size(self, world_size)
        return world_size // self.model_parallel_size

    def as_dict(self) -> dict:
        return asdict(self)


def virtual_stages_given(args, total_layers: int) -> int:
    """--num-virtual-stages-per-pipeline-rank, or v from Megatron's
    --num-layers-per-virtual-pipeline-stage N (layers / (P x N), which must be whole); 0
    when neither is given."""
    if args.num_virtual_stages_per_pipeline_rank is not None:
        return args.num_virtual_stages_per_pipeline_rank
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return 0
    pp = args.pipeline_model_parallel_size
    if per_stage < 1 or total_layers % (pp * per_stage):
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: {total_layers} "
                          f"layers are not a whole number of virtual stages of {per_stage} "
                          f"layers on each of --pipeline-model-parallel-size {pp} ranks")
    return total_layers // (pp * per_stage)


def config_problems(cfg: TrainConfig) -> list[str]:
    """Every inconsistency of a config, as messages that name the flag (empty when fine)."""
    problems = []

    def need(ok: bool, message: str):
        if not ok:
            problems.append(message)

    problems += choice_problems(cfg)
    problems += option_problems(SimpleNamespace(**option_values(cfg)))
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "tokens_per_global_batch", "train_iters", "log_interval",
                 "max_position_embeddings", "plan_prefetch"):
        need(getattr(cfg, name) > 0, f"--{flag(name)} must be > 0, got {getattr(cfg, name)}")
    need(cfg.micro_batch_size is None or cfg.micro_batch_size > 0,
         f"--micro-batch-size must be > 0, got {cfg.micro_batch_size}")
    need(cfg.num_attention_heads % max(cfg.tensor_model_parallel_size, 1) == 0,
         f"--num-attention-heads {cfg.num_attention_heads} is not divisible by "
         f"--tensor-model-parallel-size {cfg.tensor_model_parallel_size}")
    problems += query_group_problems(cfg)
    need(cfg.ffn_hidden_size % max(cfg.tensor_model_parallel_size, 1) == 0,
         f"--ffn-hidden-size {cfg.ffn_hidden_size} is not divisible by "
         f"--tensor-model-parallel-size {cfg.tensor_model_parallel_size}")
    total_layers = cfg.num_layers + cfg.decoder_num_layers
    need(cfg.pipeline_model_parallel_size <= 0 or cfg.pipeline_split != "even"
         or total_layers % cfg.pipeline_model_parallel_size == 0,
         f"{total_layers} transformer layers do not split evenly over "
         f"--pipeline-model-parallel-size {cfg.pipeline_model_parallel_size} stages "
         f"(GPT: --pipeline-split balanced cuts stages in half layers)")
    problems += pipeline_split_problems(cfg)
    problems += virtual_stage_problems(cfg)
    if cfg.model == "t5":
        need(cfg.decoder_seq_length > 0, "a T5 model needs --decoder-seq-length > 0")
    longest = max(cfg.seq_length, cfg.decoder_seq_length)
    need(cfg.max_position_embeddings >= longest,
         f"--max-position-embeddings {cfg.max_position_embeddings} is smaller than the longest "
         f"sequence ({longest} tokens)")
    need(cfg.global_batch_size >= 0,
         f"--global-batch-size must be > 0, got {cfg.global_batch_size}")
    need(cfg.tokens_per_global_batch >= cfg.seq_length,
         f"--tokens-per-global-batch {cfg.tokens_per_global_batch} cannot hold one sample of "
         f"--seq-length {cfg.seq_length}")
    need(cfg.max_pack_depth is None or cfg.max_pack_depth >= 1,
         f"--max-pack-depth must be >= 1, got {cfg.max_pack_depth}")
    need(cfg.packing_window >= 0, f"--packing-window must be >= 0, got {cfg.packing_window}")
    if cfg.packing_window:
        need(cfg.micro_batching == "packing",
             f"--packing-window packs rows for --micro-batching packing, not "
             f"{cfg.micro_batching}")
        need(not cfg.global_batch_size,
             "--packing-window makes global batches of whole packed rows: give "
             "--tokens-per-global-batch, not --global-batch-size")
        need(cfg.replica_split != "samples",
             "--packing-window packs each global batch as a whole: it needs --replica-split "
             "micro-batches (or auto), not samples")
        row_tokens = cfg.seq_length + cfg.decoder_seq_length
        need(cfg.tokens_per_global_batch >= row_tokens,
             f"--tokens-per-global-batch {cfg.tokens_per_global_batch} cannot hold one packed "
             f"row of {row_tokens} tokens (--packing-window)")
    need(cfg.num_planner_workers == "auto"
         or (isinstance(cfg.num_planner_workers, int) and cfg.num_planner_workers >= 0),
         f"--num-planner-workers must be >= 0 or 'auto', got {cfg.num_planner_workers!r}")
    need(cfg.cost_model in ("analytic", "profile") or os.path.isfile(cfg.cost_model),
         f"--cost-model must be 'analytic', 'profile' or an existing profile file; "
         f"{cfg.cost_model!r} does not exist")
    need(cfg.cost_model_cache_dir is None or cfg.cost_model == "profile",
         "--cost-model-cache-dir needs --cost-model profile")
    need(cfg.distributed_timeout_minutes > 0,
         f"--distributed-timeout-minutes must be > 0, got {cfg.distributed_timeout_minutes}")
    need(cfg.lr > 0 and 0 <= cfg.min_lr <= cfg.lr,
         f"need --lr > 0 and 0 <= --min-lr <= --lr, got lr={cfg.lr} min_lr={cfg.min_lr}")
    need(cfg.lr_wsd_decay_iters >= 0,
         f"--lr-wsd-decay-iters must be >= 0, got {cfg.lr_wsd_decay_iters}")
    if cfg.lr_decay_style == "WSD":
        room = cfg.lr_decay_iters - cfg.lr_warmup_iters
        need(0 < cfg.lr_wsd_decay_iters <= room,
             f"--lr-decay-style WSD needs 0 < --lr-wsd-decay-iters <= --lr-decay-iters - "
             f"--lr-warmup-iters = {room} (the annealing phase ends at --lr-decay-iters), "
             f"got {cfg.lr_wsd_decay_iters}")
    need(not cfg.profile or 0 <= cfg.profile_step_start < cfg.profile_step_end,
         f"--profile needs 0 <= --profile-step-start < --profile-step-end, got "
         f"{cfg.profile_step_start} and {cfg.profile_step_end}")
    for name in ("hidden_dropout", "attention_dropout"):
        need(0 <= getattr(cfg, name) < 1,
             f"--{flag(name)} must lie in [0, 1), got {getattr(cfg, name)}")
    need(cfg.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {cfg.lr_warmup_iters}")
    need(cfg.lr_decay_iters >= cfg.lr_warmup_iters,
         f"--lr-decay-iters {cfg.lr_decay_iters} is shorter than --lr-warmup-iters "
         f"{cfg.lr_warmup_iters}")
    need(0 <= cfg.adam_beta1 < 1 and 0 <= cfg.adam_beta2 < 1,
         f"--adam-beta1/--adam-beta2 must lie in [0, 1), got {cfg.adam_beta1}, {cfg.adam_beta2}")
    need(cfg.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    need(cfg.clip_grad >= 0, f"--clip-grad must be >= 0 (0 = off), got {cfg.clip_grad}")
    need(cfg.ddp_bucket_size is None or cfg.ddp_bucket_size > 0,
         f"--ddp-bucket-size must be > 0, got {cfg.ddp_bucket_size}")
    need(cfg.use_distributed_optimizer or not cfg.overlap_param_gather,
         "--overlap-param-gather needs --use-distributed-optimizer")
    need(not (cfg.bf16 and cfg.fp16), "--bf16 and --fp16 are mutually exclusive")
    need(not cfg.fp16, "--fp16 is not supported (it needs loss scaling); use --bf16, or fp32 "
                       "(the default)")
    if cfg.tokenizer_type in ("SentencePieceTokenizer", "T5SentencePieceTokenizer",
                              "HuggingFaceTokenizer"):
        need(bool(cfg.tokenizer_model),
             f"--tokenizer-type {cfg.tokenizer_type} needs --tokenizer-model")
    need(cfg.tokenizer_type != "T5SentencePieceTokenizer" or cfg.model == "t5",
         "--tokenizer-type T5SentencePieceTokenizer is for pretrain_t5.py (its ids end in "
         "eos and its decoder starts from pad)")
    need(cfg.tokenizer_type != "HuggingFaceTokenizer" or cfg.model != "t5",
         "--tokenizer-type HuggingFaceTokenizer is for decoder models (pretrain_gpt.py); "
         "a T5 checkpoint's spiece.model goes with T5SentencePieceTokenizer")
    need(cfg.vocab_extra_ids is None or cfg.tokenizer_type == "T5SentencePieceTokenizer",
         f"--vocab-extra-ids applies to --tokenizer-type T5SentencePieceTokenizer, not "
         f"{cfg.tokenizer_type}")
    need(cfg.vocab_extra_ids is None or cfg.vocab_extra_ids >= 0,
         f"--vocab-extra-ids must be >= 0, got {cfg.vocab_extra_ids}")
    need(cfg.make_vocab_size_divisible_by > 0,
         f"--make-vocab-size-divisible-by must be > 0, got {cfg.make_vocab_size_divisible_by}")
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        path = getattr(cfg, name)
        wants_dir = name == "tokenizer_model" and cfg.tokenizer_type == "HuggingFaceTokenizer"
        exists = os.path.isdir if wants_dir else os.path.isfile
        need(path is None or exists(path),
             f"--{flag(name)} {path}: no such {'directory' if wants_dir else 'file'}")
    try:
        parse_data_path(cfg.data_path)
    except ValueError as exc:
        problems.append(str(exc))
    need(cfg.mixing_cap is None or cfg.mixing_cap >= 1,
         f"--mixing-cap must be >= 1, got {cfg.mixing_cap}")
    need(cfg.mixing_temperature > 0,
         f"--mixing-temperature must be > 0, got {cfg.mixing_temperature}")
    problems.extend(validation_problems(cfg))
    need(cfg.tensorboard_dir is None or importlib.util.find_spec("tensorboard") is not None,
         f"--tensorboard-dir {cfg.tensorboard_dir}: the tensorboard package is not installed "
         f"(requirements.txt leaves it out); install it with `pip install tensorboard` in "
         f"this environment, or leave the flag out (--stats-file writes the same numbers)")
    need(not (cfg.stats_file and os.path.isdir(cfg.stats_file)),
         f"--stats-file {cfg.stats_file} is a folder; give the path of a file (JSON lines)")
    need(cfg.save_interval >= 0, f"--save-interval must be >= 0, got {cfg.save_interval}")
    need(not (cfg.save_interval and not cfg.save), "--save-interval needs --save DIR")
    need(cfg.keep_last >= 0, f"--keep-last must be >= 0 (0 = keep all), got {cfg.keep_last}")
    need(not (cfg.keep_last and not cfg.save), "--keep-last needs --save DIR")
    need(not (cfg.overwrite_checkpoints and not cfg.save), "--overwrite-checkpoints needs --save DIR")
    for load_flag in ("finetune", "no_load_optim", "no_load_rng", "override_data_identity"):
        need(not (getattr(cfg, load_flag) and not cfg.load), f"--{flag(load_flag)} needs --load DIR")
    need(not (cfg.override_opt_param_scheduler and cfg.use_checkpoint_opt_param_scheduler),
         "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are "
         "mutually exclusive")
    for name in ("device_flops", "device_memory_gb", "p2p_bandwidth_gbps"):
        value = getattr(cfg, name)
        need(value is None or value > 0, f"--{flag(name)} must be > 0, got {value}")
    for name in ("memory_headroom_gb", "p2p_latency_us"):
        value = getattr(cfg, name)
        need(value is None or value >= 0, f"--{flag(name)} must be >= 0, got {value}")
    need(cfg.p2p_latency_us is None or cfg.p2p_bandwidth_gbps is not None,
         "--p2p-latency-us needs --p2p-bandwidth-gbps")
    return problems + flextp_problems(cfg)


def query_group_problems(cfg: TrainConfig) -> list[str]:
    """What --group-query-attention / --num-query-groups cannot do (empty when fine):
    Megatron's rules (groups divisible by TP; heads by groups: option_problems) and GPT
    only."""
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    tp = cfg.tensor_model_parallel_size
    if not cfg.group_query_attention:
        return [] if groups == heads else [
            f"--num-query-groups {groups} needs --group-query-attention (without it every "
            f"one of the {heads} heads has its own key and value)"]
    if groups < 1:
        return [f"--num-query-groups must be > 0, got {groups}"]
    problems = []
    if cfg.model != "gpt":
        problems.append("--group-query-attention is GPT only: megatron-core's T5 "
                        "cross-attention does not support grouped-query attention")
    if tp > 0 and groups % tp:
        problems.append(f"--num-query-groups {groups} is not divisible by "
                        f"--tensor-model-parallel-size {tp}")
    return problems


def choice_problems(cfg: TrainConfig) -> list[str]:
    """Values outside the choices their flag declares, for the flags whose value no other
    class validates (`validated_by`: IterationPlannerConfig, PlannerConfig, ModelSpec)."""
    return [f"{f.name} must be one of {tuple(f.choices)}, got {getattr(cfg, f.field_name)!r}"
            for f in FLAGS if f.choices and f.field_name and not f.validated_by
            and getattr(cfg, f.field_name) not in f.choices]


def split_units(value: str) -> tuple[int, ...] | None:
    """--pipeline-split as half-layer units per stage ("5,3"), or None for even / balanced."""
    if value in ("even", "balanced"):
        return None
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise ValueError(f"--pipeline-split must be even, balanced or half-layer units per "
                         f"stage such as 5,3; got {value!r}") from None


def pipeline_split_problems(cfg: TrainConfig) -> list[str]:
    """What --pipeline-split cannot do (empty when fine)."""
    if cfg.pipeline_split == "even":
        return []
    try:
        units = split_units(cfg.pipeline_split)
    except ValueError as exc:
        return [str(exc)]
    checks = [(cfg.model == "gpt", "is implemented for GPT only (pretrain_gpt.py)"),
              (cfg.pipeline_model_parallel_size > 1, "needs --pipeline-model-parallel-size > 1"),
              (units is None or (min(units) >= 1 and sum(units) == 2 * cfg.num_layers),
               f"units must each be >= 1 and sum to 2 x --num-layers = {2 * cfg.num_layers} "
               f"(a layer's attention and MLP halves)")]
    return [f"--pipeline-split {cfg.pipeline_split} {why}" for ok, why in checks if not ok]


def virtual_stages(cfg: TrainConfig) -> int:
    """v of the interleaved layout: --num-virtual-stages-per-pipeline-rank, default 2."""
    return cfg.num_virtual_stages_per_pipeline_rank or 2


def pipeline_stage_count(cfg: TrainConfig) -> int:
    """Stages the model is cut into on the layout of --pipeline-schedule (the schedule
    registry's): P (linear), v*P (interleaved), 2*W*P (wave); 'auto' is counted on the linear
    layout and may run on any (iteration_planner.choose_auto_layout)."""
    return len(stage_layout(cfg.pipeline_schedule, cfg.pipeline_model_parallel_size,
                            cfg.pipeline_waves, virtual_stages(cfg)))


def virtual_stage_problems(cfg: TrainConfig) -> list[str]:
    """What --pipeline-waves / --num-virtual-stages-per-pipeline-rank cannot do."""
    problems = []
    if cfg.pipeline_waves < 1:
        problems.append(f"--pipeline-waves must be >= 1, got {cfg.pipeline_waves}")
    if cfg.num_virtual_stages_per_pipeline_rank < 0:
        problems.append(f"--num-virtual-stages-per-pipeline-rank must be >= 1, got "
                        f"{cfg.num_virtual_stages_per_pipeline_rank}")
    if problems or cfg.pipeline_schedule not in SCHEDULES \
            or layout_of(cfg.pipeline_schedule) == "linear":
        return problems
    stages = pipeline_stage_count(cfg)
    total = cfg.num_layers + cfg.decoder_num_layers
    what = (f"--pipeline-schedule {cfg.pipeline_schedule} with --pipeline-waves "
            f"{cfg.pipeline_waves}" if layout_of(cfg.pipeline_schedule) == "wave" else
            f"--pipeline-schedule {cfg.pipeline_schedule} with {virtual_stages(cfg)} virtual "
            f"stages per rank")
    if cfg.pipeline_split == "even" and total % stages:
        problems.append(f"{what} cuts the model into {stages} stages at "
                        f"--pipeline-model-parallel-size {cfg.pipeline_model_parallel_size}: "
                        f"{total} transformer layers do not split evenly over {stages} "
                        f"pipeline stages ("
                        + ("T5 stages hold whole layers" if cfg.model == "t5" else
                           "GPT: --pipeline-split balanced cuts in half layers") + ")")
    elif cfg.pipeline_split not in ("even", "balanced") and \
            len(split_units(cfg.pipeline_split)) != stages:
        problems.append(f"--pipeline-split {cfg.pipeline_split} gives "
                        f"{len(split_units(cfg.pipeline_split))} stages; {what} has {stages}")
    return problems


def flextp_problems(cfg: TrainConfig) -> list[str]:
    """What --tp-balance and the --flextp-* flags cannot do (empty when fine)."""
    from dynapipe_ext.flextp.policy import MODES, parse_speeds
    if cfg.tp_balance == "off" or cfg.tp_balance not in MODES:   # choice_problems says so
        return []
    checks = [(cfg.tensor_model_parallel_size >= 2, "needs --tensor-model-parallel-size >= 2"),
              (cfg.model == "gpt", "supports GPT models only: T5's encoder and decoder "
               "stages would need one partition per stack and FlexTP's slot layers cover GPT "
               "layers"),
              (cfg.tp_balance_max_share >= 1, "needs --tp-balance-max-share >= 1"),
              (cfg.flextp_interval >= 1, "needs --flextp-interval >= 1"),
              (cfg.flextp_patience >= 1, "needs --flextp-patience >= 1"),
              (cfg.flextp_ffn_unit >= 0, "needs --flextp-ffn-unit >= 0"),
              (0 <= cfg.flextp_max_drop_fraction < 1, "needs 0 <= --flextp-max-drop-fraction "
               "< 1"),
              (not cfg.use_distributed_optimizer, "cannot run with --use-distributed-optimizer: "
               "moving TP rows between ranks moves their whole Adam state, which the flag "
               "splits over data-parallel ranks")]
    problems = [f"--tp-balance {cfg.tp_balance} {why}" for ok, why in checks if not ok]
    if cfg.flextp_initial_speeds:
        if cfg.tp_balance not in ("migrate", "semi"):
            problems.append("--flextp-initial-speeds needs --tp-balance migrate or semi")
        try:
            parse_speeds(cfg.flextp_initial_speeds, cfg.tensor_model_parallel_size)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def validation_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with the validation flags (empty when fine)."""
    problems = []
    if cfg.eval_interval < 0:
        problems.append(f"--eval-interval must be >= 0 (0 = no validation), got "
                        f"{cfg.eval_interval}")
    if cfg.eval_iters < 1:
        problems.append(f"--eval-iters must be > 0, got {cfg.eval_iters}")
    if cfg.valid_data_path and cfg.split:
        problems.append("give --valid-data-path or --split, not both")
    if cfg.valid_data_path:
        try:
            parse_data_path(cfg.valid_data_path)
        except ValueError as exc:
            problems.append(f"--valid-data-path: {exc}")
    shares = None
    if cfg.split:
        try:
            shares = parse_split(cfg.split)
        except ValueError as exc:
            problems.append(str(exc))
    if cfg.eval_interval > 0 and not cfg.valid_data_path:
        if not cfg.split:
            problems.append("--eval-interval needs validation data: --valid-data-path PREFIX, "
                            "or --split 969,30,1 to hold out a share of --data-path")
        elif shares is not None and shares[1] == 0:
            problems.append(f"--split {cfg.split} holds out no validation samples (the second "
                            f"number is 0) but --eval-interval asks for validation")
    return problems


def check_world_size(cfg: TrainConfig, world_size: int) -> None:
    """Raise when `world_size` ranks cannot host TP x PP model-parallel groups."""
    if world_size % cfg.model_parallel_size:
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size "
            f"{cfg.tensor_model_parallel_size} x --pipeline-model-parallel-size "
            f"{cfg.pipeline_model_parallel_size} = {cfg.model_parallel_size}")


def check_device_precision(cfg: TrainConfig, has_cuda: bool,
                           bf16_supported: bool | None = None) -> None:
    """bf16 runs wherever the device computes it: CPU torch always does, a GPU must say so
    (torch.cuda.is_bf16_supported(), asked when `bf16_supported` is None)."""
    if not cfg.bf16 or not has_cuda:
        return
    if bf16_supported is None:
        import torch
        bf16_supported = torch.cuda.is_bf16_supported()
    if not bf16_supported:
        raise ConfigError("--bf16: this GPU does not support bfloat16 (torch.cuda."
                          "is_bf16_supported() is False); leave --bf16 out to train in fp32")


def flag(field_name: str) -> str:
    return field_name.replace("_", "-")


GLOBAL_BATCH_HELP = (
    "samples per global batch (all data-parallel replicas), Megatron's flag; an alternative to "
    "--tokens-per-global-batch (give one, not both): the sampler takes exactly N samples per "
    "global batch whatever their lengths, and dynamic micro-batching still cuts those N "
    "samples into variable-size micro-batches")
TOKENS_HELP = ("token budget of one global batch (all data-parallel replicas): the sampler "
               "takes samples while their tokens fit; default 4096 when --global-batch-size "
               "is not given")


def planner_workers(text: str) -> int | str:
    """--num-planner-workers: a count, or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


PADDING_MICRO_BATCH_SIZE = 4   # rows per padded micro-batch when --micro-batch-size is not given

# Groups: key -> argparse title (the order of --help and docs/FLAGS.md).
MODEL, PARALLEL, FLEXTP, PLANNING, OPTIMIZER, DATA, CHECKPOINT = (
    "model", "parallel", "flextp", "planning", "optimizer", "data", "checkpoint")
GROUP_TITLES = {
    MODEL: "model", PARALLEL: "parallelism",
    FLEXTP: "FlexTP straggler handling (docs/BENCHMARKS.md, FlexTP)",
    PLANNING: "batches and planning", OPTIMIZER: "optimisation", DATA: "data",
    CHECKPOINT: "checkpoints and logging"}
T5, GPT = ("t5",), ("gpt",)
# ModelSpec's option defaults: the model flags' defaults are the model's own
OPTION = {f.name: f.default for f in MODEL_OPTIONS}


def declare(group: str, *names: str, models=MODELS, exclusive: str | None = None,
            field: str | None = "", negate: bool = False, validated_by: str | None = None,
            **kwargs) -> Flag:
    return Flag(names, group, kwargs, models, exclusive, field, negate, validated_by)


# Every flag of pretrain_gpt.py / pretrain_t5.py, declared here only (the FlexTP ones in
# dynapipe_ext/flextp/policy.py); choices come from the code that owns them.
FLAGS: tuple[Flag, ...] = (
    # model
    declare(MODEL, "--num-layers", type=int, default=None, field=None,
            help={"gpt": "transformer layers, required",
                  "t5": "transformer layers, required (T5: encoder and decoder each, unless "
                        "the two flags below are given)"}),
    declare(MODEL, "--encoder-num-layers", type=int, default=None, models=T5, field=None,
            help="T5 encoder layers"),
    declare(MODEL, "--decoder-num-layers", type=int, default=None, models=T5, field=None,
            help="T5 decoder layers"),
    declare(MODEL, "--hidden-size", type=int, required=True),
    declare(MODEL, "--num-attention-heads", type=int, required=True),
    declare(MODEL, "--ffn-hidden-size", field=None, type=int, default=None,
            help="default 4 x hidden size"),
    declare(MODEL, "--seq-length", type=int, default=None, field=None,
            help={"gpt": "GPT: max tokens per sample (longer ones are truncated), default 512",
                  "t5": "T5: same as --encoder-seq-length"}),
    declare(MODEL, "--encoder-seq-length", type=int, default=None, models=T5, field=None,
            help="T5 encoder max tokens, default 512"),
    declare(MODEL, "--decoder-seq-length", type=int, default=None, models=T5, field=None,
            help="T5 decoder max tokens, default 128"),
    declare(MODEL, "--max-position-embeddings", field=None, type=int, default=None,
            help="default: the longest sequence length"),
    declare(MODEL, "--untie-embeddings-and-output-weights", action="store_true",
            help="give the output layer its own weights; by default it shares the "
                 "input word embedding, as in Megatron (T5's decoder embedding always "
                 "does; T5 v1.1 / FLAN-T5 are untied)"),
    declare(MODEL, "--normalization", choices=NORMALIZATIONS, default=OPTION["normalization"],
            validated_by="ModelSpec",
            help="norm of every layer and the final norms (T5 v1.1 / FLAN-T5, Llama, Qwen, "
                 "Mistral: RMSNorm)"),
    declare(MODEL, "--norm-epsilon", type=float, default=OPTION["layernorm_epsilon"],
            help="epsilon of the norms (T5 v1.1 / FLAN-T5: 1e-6; HF rms_norm_eps)"),
    declare(MODEL, "--disable-bias-linear", field="add_bias_linear", negate=True,
            action="store_true",
            help="no biases in the attention and MLP linears (T5 v1.1 / FLAN-T5, Llama, "
                 "Qwen, Mistral)"),
    declare(MODEL, "--add-qkv-bias", action="store_true",
            help="biases on the query, key and value projections, also with "
                 "--disable-bias-linear (Qwen2)"),
    declare(MODEL, "--gated-gelu", field="gated_linear_unit", action="store_true",
            help="gated GeLU MLP, gelu(x W0) * (x W1) (T5 v1.1's gated-gelu; the MLP "
                 "then has 3 matrices)"),
    declare(MODEL, "--swiglu", action="store_true",
            help="SwiGLU MLP, silu(x W0) * (x W1) (Llama, Qwen, Mistral; 3 matrices)"),
    declare(MODEL, "--softmax-scale", type=float, default=OPTION["softmax_scale"],
            help="attention score scale; default 1/sqrt(kv channels), T5 uses 1.0"),
    declare(MODEL, "--kv-channels", field=None, type=int, default=None,
            help="per-head size; default hidden size / heads (FLAN-T5-small: 64)"),
    declare(MODEL, "--attention-backend", field=None, choices=ATTENTION_BACKENDS,
            default="auto",
            help="core attention for packed streams and biased rows, resolved once at start-up "
                 "and printed in the run's first line: 'flex' (FlexAttention's document mask; "
                 "CUDA, no attention dropout), 'sdpa' (scaled_dot_product_attention per group "
                 "of sample lengths), 'dense-mask' (one SDPA over each packed row with a "
                 "block-diagonal mask: S^2 work, packing without a varlen kernel); 'auto': "
                 "flex on a GPU without attention dropout, else sdpa. The planner costs "
                 "attention as the backend computes it"),
    declare(MODEL, "--group-query-attention", action="store_true",
            help="grouped-query attention: the heads share key and value heads, one per "
                 "query group (GPT only: megatron-core's T5 cross-attention has none)"),
    declare(MODEL, "--num-query-groups", field=None, type=int, default=None,
            help="query groups with --group-query-attention, default 1; must divide "
                 "--num-attention-heads and be divisible by --tensor-model-parallel-size"),
    declare(MODEL, "--position-embedding-type", choices=POSITION_EMBEDDING_TYPES,
            validated_by="ModelSpec", default=OPTION["position_embedding_type"],
            help={"gpt": "learned_absolute: a learned table of positions (GPT-2); rope: "
                         "rotary positions in every attention layer (Llama, Qwen, Mistral), "
                         "counted from each sample's start in packed rows",
                  "t5": "relative: T5's bucketed per-head position bias"}),
    declare(MODEL, "--rotary-base", type=float, default=OPTION["rotary_base"], models=GPT,
            help="base of the rotary frequencies (HF rope_theta; Llama 3: 500000)"),
    declare(MODEL, "--rotary-percent", type=float, default=OPTION["rotary_percent"],
            models=GPT,
            help="share of each head's channels that rotary positions turn (HF "
                 "partial_rotary_factor)"),
    declare(MODEL, "--use-rope-scaling", action="store_true", models=GPT,
            help="Llama 3.1's rotary frequency scaling (HF rope_scaling with rope_type "
                 "llama3), set by the four flags below"),
    declare(MODEL, "--rope-scaling-factor", type=float, default=OPTION["rope_scaling_factor"],
            models=GPT, help="HF rope_scaling factor: long wavelengths are divided by it"),
    declare(MODEL, "--rope-scaling-low-freq-factor", type=float,
            default=OPTION["rope_scaling_low_freq_factor"], models=GPT,
            help="HF rope_scaling low_freq_factor"),
    declare(MODEL, "--rope-scaling-high-freq-factor", type=float,
            default=OPTION["rope_scaling_high_freq_factor"], models=GPT,
            help="HF rope_scaling high_freq_factor"),
    declare(MODEL, "--rope-scaling-original-max-position-embeddings", type=int,
            default=OPTION["rope_scaling_original_max_position_embeddings"], models=GPT,
            help="HF rope_scaling original_max_position_embeddings: the context length "
                 "the frequencies were trained for"),
    declare(MODEL, "--relative-attention-num-buckets", type=int,
            default=OPTION["relative_attention_num_buckets"], models=T5,
            help="relative position buckets"),
    declare(MODEL, "--relative-attention-max-distance", type=int,
            default=OPTION["relative_attention_max_distance"], models=T5,
            help="distance at which relative position buckets stop"),
    # parallelism
    declare(PARALLEL, "--tensor-model-parallel-size", type=int, default=1),
    declare(PARALLEL, "--pipeline-model-parallel-size", type=int, default=1),
    declare(PARALLEL, "--pipeline-split", default="even",
            help="how GPT layers are cut into pipeline stages: 'even': whole layers "
                 "(they must divide evenly); 'balanced': in half layers (attention | "
                 "MLP), so that the stages' predicted times, output layer included, "
                 "are as even as they can be; or half-layer units per (virtual) "
                 "stage, e.g. 5,3"),
    declare(PARALLEL, "--distributed-timeout-minutes", field=None, type=float, default=None,
            help="collective / point-to-point timeout; default 2 on CPU, 30 on GPU"),
    # FlexTP straggler handling (docs/BENCHMARKS.md, FlexTP)
    *(declare(FLEXTP, *names, **kwargs) for names, kwargs in balance_flags()),
    declare(FLEXTP, "--flextp-patience", type=int, default=6,
            help="measurements in a row that must agree before a rank is (no longer) "
                 "a straggler"),
    declare(FLEXTP, "--flextp-ffn-unit", type=int, default=0,
            help="ffn columns per MLP unit (what FlexTP moves or skips); 0: ffn / (16 TP)"),
    declare(FLEXTP, "--flextp-initial-speeds", default=None,
            help="relative speed of each TP rank known up front, e.g. 1,0.5: migrate "
                 "and semi start from the partition proportional to them"),
    # batches and planning
    declare(PLANNING, "--tokens-per-global-batch", field=None, exclusive="batch", type=int,
            default=None,
            help=TOKENS_HELP),
    declare(PLANNING, "--global-batch-size", field=None, exclusive="batch", type=int, default=None,
            help=GLOBAL_BATCH_HELP),
    declare(PLANNING, "--micro-batching", choices=MICRO_BATCHING, default="dynamic",
            validated_by="IterationPlannerConfig"),
    declare(PLANNING, "--packing-algorithm", choices=PACKING_ALGORITHMS, default="spfhp",
            validated_by="PlannerConfig",
            help="packer for --micro-batching packing (GPT and T5; T5 packs the "
                 "(encoder, decoder) pairs with both length limits held)"),
    declare(PLANNING, "--max-pack-depth", type=int, default=None,
            help="most samples in one packed row (default: no limit; nnlshp then "
                 "uses 3, Krell et al.'s depth)"),
    declare(PLANNING, "--packing-window", type=int, default=0,
            help="pack this many samples of the data stream together ahead of "
                 "training (dataset-level packing, Krell et al.) and make global "
                 "batches of whole rows; 0 (default): pack each global batch alone"),
    declare(PLANNING, "--dynamic-layout", choices=DYNAMIC_LAYOUTS,
            default=PlannerConfig.dynamic_layout,
            validated_by="PlannerConfig",
            help="how --micro-batching dynamic lays out a micro-batch: 'packed' "
                 "(default), one token stream of its samples (no padding but the "
                 "alignment at its end; attention within each sample), or 'padded', "
                 "the DynaPipe paper's one sample per row padded to the longest"),
    declare(PLANNING, "--micro-batch-size", type=int, default=None,
            help="rows per micro-batch for --micro-batching padding (default "
                 f"{PADDING_MICRO_BATCH_SIZE}) and packing (packed rows; default: per global "
                 "batch, the count of least predicted makespan); dynamic sizes its own"),
    declare(PLANNING, "--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="auto",
            validated_by="IterationPlannerConfig",
            help="auto: per run the layout (linear, interleaved, wave) predicted fastest "
                 "on the first batch, per iteration the fastest fitting schedule on it; "
                 + "; ".join(f"{d.name}: {d.summary}" for d in SCHEDULES.values())),
    declare(PLANNING, "--pipeline-waves", type=int, default=1,
            help="W of Hanayo's wave schedule: the model in 2*W*P stages, folded W times "
                 "down and up the pipeline ranks"),
    declare(PLANNING, "--num-virtual-stages-per-pipeline-rank", field=None, exclusive="virtual",
            type=int, default=None,
            help="v of interleaved 1F1B (Megatron's virtual pipeline): v*P "
                 "stages, stage s on rank s mod P (default 2)"),
    declare(PLANNING, "--num-layers-per-virtual-pipeline-stage", field=None, exclusive="virtual",
            type=int, default=None,
            help="Megatron's other spelling: v = layers / (P x this)"),
    declare(PLANNING, "--num-planner-workers", type=planner_workers, default=1,
            help="background planner processes per node (0: plan inline on the "
                 "node's planning leader; 'auto': from the node's free cores and the "
                 "measured planning time against the predicted iteration time)"),
    declare(PLANNING, "--replica-split", choices=REPLICA_SPLITS + ("auto",), default="auto",
            validated_by="IterationPlannerConfig",
            help="'auto' (default): 'micro-batches' on one node, 'samples' when the "
                 "run spans several nodes (torchrun's LOCAL_WORLD_SIZE < WORLD_SIZE); "
                 "'micro-batches': plan the whole batch, then split its micro-batches "
                 "over data-parallel replicas (best balance; planning is global); "
                 "'samples': deal samples to replicas first, then plan each replica "
                 "on its own node (planning per node ~ samples / nodes)"),
    declare(PLANNING, "--plan-prefetch", type=int, default=2,
            help="how many iterations ahead plans are made"),
    declare(PLANNING, "--check-plans", action="store_true",
            help="run the plan checker on every plan before executing it, and have the "
                 "ranks agree each iteration that their plans fit them (one collective; "
                 "without it a rank whose plan does not fit stops alone)"),
    declare(PLANNING, "--cost-model", field=None, default=None,
            help="'analytic'; 'profile': profile this run's model, device, precision "
                 "and TP on first use (a minute or two) and reuse it from the cache "
                 "later; or the path of a profile made by tools/profile_cost_model.py. "
                 "Default: 'profile' on GPU (the analytic model knows no per-micro-batch "
                 "launch cost there and cuts too many micro-batches), 'analytic' on CPU"),
    declare(PLANNING, "--cost-model-cache-dir", default=None,
            help="where --cost-model profile keeps profiles (default "
                 "$XDG_CACHE_HOME or ~/.cache, then megatron-dynapipe/profiles)"),
    declare(PLANNING, "--device-flops", type=float, default=None,
            help="device compute rate (FLOP/s) the planner assumes; default: a short "
                 "matmul calibration on GPU, a fixed nominal rate on CPU"),
    declare(PLANNING, "--device-memory-gb", type=float, default=None,
            help="memory per rank (GiB) the planner assumes; default: the GPU's total "
                 "memory, on CPU the physical memory / ranks on this node"),
    declare(PLANNING, "--memory-headroom-gb", type=float, default=None,
            help="memory (GiB) kept free for the allocator, CUDA context and NCCL; "
                 "default 10%% of the memory, + 1 GiB on GPU"),
    declare(PLANNING, "--p2p-bandwidth-gbps", type=float, default=None,
            help="pipeline link bandwidth (GB/s) for the schedule search; default: "
                 "timed at start-up on GPU with PP > 1, not modelled on CPU"),
    declare(PLANNING, "--p2p-latency-us", type=float, default=None,
            help="pipeline link latency (microseconds), with --p2p-bandwidth-gbps"),
    # optimisation
    declare(OPTIMIZER, "--lr", type=float, default=1e-3),
    declare(OPTIMIZER, "--min-lr", type=float, default=0.0),
    declare(OPTIMIZER, "--lr-warmup-iters", type=int, default=0),
    declare(OPTIMIZER, "--lr-decay-iters", field=None, type=int, default=None,
            help="default --train-iters (at least the warm-up)"),
    declare(OPTIMIZER, "--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine",
            help="after warm-up: constant, linear or cosine from --lr to --min-lr over "
                 "--lr-decay-iters, inverse-square-root (lr x sqrt(warm-up / step), "
                 "at least --min-lr), or WSD (warm-up, stable at --lr, then decay to "
                 "--min-lr over the last --lr-wsd-decay-iters before --lr-decay-iters)"),
    declare(OPTIMIZER, "--lr-wsd-decay-style", choices=LR_WSD_DECAY_STYLES, default="exponential",
            help="WSD's annealing shape (megatron-core's OptimizerParamScheduler): "
                 "exponential (2 x 0.5^r - 1), linear (1 - r), cosine or minus_sqrt "
                 "(1 - sqrt(r)) of the annealing progress r"),
    declare(OPTIMIZER, "--lr-wsd-decay-iters", field=None, type=int, default=None,
            help="iterations of WSD's annealing phase, required with --lr-decay-style "
                 "WSD (Megatron's --lr-wsd-decay-samples has no counterpart: a global "
                 "batch here has a variable number of samples)"),
    declare(OPTIMIZER, "--weight-decay", type=float, default=0.01),
    declare(OPTIMIZER, "--adam-beta1", type=float, default=0.9),
    declare(OPTIMIZER, "--adam-beta2", type=float, default=0.999),
    declare(OPTIMIZER, "--adam-eps", type=float, default=1e-8),
    declare(OPTIMIZER, "--clip-grad", type=float, default=1.0, help="global norm; 0 disables"),
    declare(OPTIMIZER, "--use-distributed-optimizer", action="store_true",
            help="shard the fp32 main weights and Adam moments over the data-parallel "
                 "ranks (gradients reduce-scattered, updated weights all-gathered): 12 of "
                 "a bf16 run's 18 bytes per parameter become 12 / DP; checkpoints stay "
                 "layout-free"),
    declare(OPTIMIZER, "--ddp-bucket-size", type=int, default=None,
            help="elements per data-parallel gradient bucket (reduced while backward runs); "
                 "default: about 16 buckets per rank, 2^18 to 4e7 elements each"),
    declare(OPTIMIZER, "--overlap-param-gather", action="store_true",
            help="with --use-distributed-optimizer: leave the all-gather of updated "
                 "weights in flight; each stage's first forward of the next iteration "
                 "waits for its own buckets only"),
    declare(OPTIMIZER, "--train-iters", type=int, required=True),
    declare(OPTIMIZER, "--bf16", action="store_true",
            help="bf16 parameters and activations; fp32 main gradients, master weights "
                 "and Adam state (CPU, or a GPU with bf16)"),
    declare(OPTIMIZER, "--fp16", action="store_true", help="not supported; use --bf16"),
    declare(OPTIMIZER, "--seed", type=int, default=1234),
    declare(OPTIMIZER, "--hidden-dropout", type=float, default=0.1,
            help="dropout on the embeddings and after attention and MLP (Megatron's "
                 "default 0.1; 0 turns it off)"),
    declare(OPTIMIZER, "--attention-dropout", type=float, default=0.1,
            help="dropout on the attention probabilities (Megatron's default 0.1); on "
                 "CPU any value > 0 runs attention unfused (torch's fused CPU kernel "
                 "has no dropout): slower, and s^2 activations per head"),
    declare(OPTIMIZER, "--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
            help="GPU: run bias + GeLU unfused (megatron-core's fusion is torch.compile'd "
                 "and compiles again for new micro-batch shapes while it warms up)"),
    declare(OPTIMIZER, "--no-bias-dropout-fusion", action="store_false",
            dest="bias_dropout_fusion",
            help="GPU: run bias + dropout + residual add unfused"),
    # data
    declare(DATA, "--data-path", required=True, nargs="+",
            help="output prefix given to tools/preprocess_flan.py; Megatron's blend "
                 "'W1 P1 W2 P2 ...' samples prefix Pi with share Wi / sum(W) (several "
                 "prefixes without weights are mixed as one dataset); task names are "
                 "merged across prefixes"),
    declare(DATA, "--mixing-cap", type=int, default=None,
            help="FLAN's examples-proportional mixing (seqio): a task of n samples is "
                 "drawn at a rate proportional to min(n, cap), within each weighted "
                 "prefix; default no cap (rate proportional to n)"),
    declare(DATA, "--mixing-temperature", type=float, default=1.0,
            help="rates proportional to min(n, cap) ** (1 / T); T > 1 flattens the "
                 "mixture towards small tasks (default 1)"),
    declare(DATA, "--split", default=None,
            help="Megatron's train,validation,test shares of --data-path, e.g. "
                 "969,30,1: Megatron's part sizes, each part spread over the tasks "
                 "(seeded; no sample in two parts); training draws from the first. "
                 "Default: train on every sample"),
    declare(DATA, "--valid-data-path", nargs="+", default=None,
            help="validation data, the same syntax as --data-path (instead of --split)"),
    *(declare(DATA, *names, **kwargs) for names, kwargs in tokenizer_flags()),
    declare(DATA, "--make-vocab-size-divisible-by", type=int, default=VOCAB_MULTIPLE,
            help="pad the vocabulary to a multiple of this x --tensor-model-parallel-"
                 "size, as Megatron (default 128); a checkpoint loads where the padded "
                 "sizes agree, e.g. 64 pads FLAN-T5's 32100 tokens to its 32128 rows at "
                 "TP=1 and TP=2"),
    # checkpoints and logging
    declare(CHECKPOINT, "--save", default=None, help="checkpoint directory to write"),
    declare(CHECKPOINT, "--save-interval", type=int, default=0, help="iterations between saves"),
    declare(CHECKPOINT, "--load", default=None, help="checkpoint directory to resume from"),
    declare(CHECKPOINT, "--keep-last", type=int, default=0,
            help="keep only the newest N complete checkpoints (0: keep all)"),
    declare(CHECKPOINT, "--override-opt-param-scheduler", "--override-opt_param-scheduler",
            dest="override_opt_param_scheduler", action="store_true",
            help="on --load, follow this run's LR schedule flags, not the checkpoint's"),
    declare(CHECKPOINT, "--use-checkpoint-opt-param-scheduler",
            "--use-checkpoint-opt_param-scheduler",
            dest="use_checkpoint_opt_param_scheduler", action="store_true",
            help="on --load, keep the checkpoint's LR schedule settings"),
    declare(CHECKPOINT, "--finetune", action="store_true",
            help="on --load, load the model weights only and start at iteration 0 with "
                 "a fresh optimizer, LR schedule and sampler (e.g. converted weights)"),
    declare(CHECKPOINT, "--no-load-optim", action="store_true",
            help="on --load, keep a fresh optimizer and follow this run's LR flags"),
    declare(CHECKPOINT, "--no-load-rng", action="store_true",
            help="on --load, do not restore RNG states (reseed from --seed)"),
    declare(CHECKPOINT, "--exit-signal-handler", action=argparse.BooleanOptionalAction,
            default=True,
            help="on SIGTERM or SIGINT, finish the current iteration, save a checkpoint "
                 "(with --save), say so in one line and exit 0; a second signal exits at "
                 "once (Megatron-LM's flag; on by default here, --no-exit-signal-handler "
                 "leaves the signals to Python)"),
    declare(CHECKPOINT, "--override-data-identity", action="store_true",
            help="on --load, resume although the tokenizer or datasets differ from those "
                 "the checkpoint was trained on (refused otherwise, naming both)"),
    declare(CHECKPOINT, "--overwrite-checkpoints", action="store_true",
            help="start over in a --save folder that holds checkpoints this run does not "
                 "resume (they are renamed iter_N.abandoned, not deleted); without it such "
                 "a run is refused"),
    declare(CHECKPOINT, "--log-interval", type=int, default=1),
    declare(CHECKPOINT, "--eval-interval", type=int, default=0,
            help="evaluate on the validation data every N iterations and after the "
                 "last one (0: never, the default)"),
    declare(CHECKPOINT, "--eval-iters", type=int, default=100,
            help="validation global batches per evaluation (the same batches each "
                 "time, so evaluations compare)"),
    declare(CHECKPOINT, "--tensorboard-dir", default=None,
            help="write TensorBoard scalars here (needs `pip install tensorboard`, "
                 "which requirements.txt leaves out)"),
    declare(CHECKPOINT, "--stats-file", default=None,
            help="append every iteration's numbers as a JSON line (rank 0)"),
    declare(CHECKPOINT, "--profile", action="store_true",
            help="run torch.profiler over iterations [--profile-step-start, "
                 "--profile-step-end) on --profile-ranks: a table of the costliest ops "
                 "on stdout, and a Chrome trace in --profile-dir when given"),
    declare(CHECKPOINT, "--profile-dir", default=None,
            help="where --profile writes Chrome traces"),
    declare(CHECKPOINT, "--profile-step-start", type=int, default=10),
    declare(CHECKPOINT, "--profile-step-end", type=int, default=12),
    declare(CHECKPOINT, "--profile-ranks", type=int, nargs="+", default=[0]),
    declare(CHECKPOINT, "--debug", action="store_true",
            help="on a failure print the traceback, not just the one-line error"),
)


def training_flags(spec: ModelSpec) -> str:
    """The model flags of pretrain_*.py that build `spec`, from each option's flag: a switch
    where it is on, a value where it is not the default (sizes always; T5's relative-position
    fields whenever it uses them)."""
    switches = {f.name: f.negate for f in FLAGS if f.kwargs.get("action") == "store_true"}
    values = flag_values(spec)
    flags = []
    for f in MODEL_OPTIONS:
        name, value = f.metadata["flag"], values[option_arg(f)]
        if not name.startswith("--"):
            continue
        if spec.model == "t5" and name == "--num-layers":
            name = "--encoder-num-layers"
        if f.name == "num_query_groups":
            if value != spec.num_attention_heads:
                flags.append(f"--group-query-attention {name} {value}")
        elif name in switches:
            if value != switches[name]:
                flags.append(name)
        elif f.metadata["shape"] and value or value != f.default \
                or f.name.startswith("relative_") and spec.position_embedding_type == "relative":
            flags.append(f"{name} {value}")
    return " ".join(flags)


def build_parser(model: str) -> argparse.ArgumentParser:
    """All flags, generated from FLAGS. Like Megatron, the model size and --train-iters have
    no defaults; the T5-only flags are hidden from GPT's --help (and rejected with a clear
    message if given)."""
    p = argparse.ArgumentParser(
        prog=f"pretrain_{model}.py",
        description=f"Train a {model.upper()} model on multi-task data with variable-size "
                    f"micro-batches (DynaPipe) on megatron-core.")
    add_flags(p, FLAGS, GROUP_TITLES, model)
    return p


def add_flag_group(parser: argparse.ArgumentParser, group: str,
                   only: Sequence[str] | None = None, model: str | None = None,
                   title: str | None = None, **overrides: dict) -> None:
    """The trainer's flags of `group` (all, or the dests in `only`, in that order) on a
    tool's parser, as FLAGS declares them, in the argument group `title` (default the
    trainer's; "": no group). `overrides`: per dest, keywords that replace the declared
    ones, e.g. num_layers=dict(default=4), plus `aliases` (extra spellings)."""
    chosen = [f for f in FLAGS if f.group == group]
    if only is not None:
        chosen = [flag_by_dest(chosen, dest) for dest in only]
    add_flags(parser, chosen, {group: GROUP_TITLES[group] if title is None else title}, model,
              overrides)


def parse_args(model: str, argv: Sequence[str] | None = None, has_cuda: bool | None = None,
               prog: str | None = None) -> TrainConfig:
    """Parse and validate; a bad value exits with status 2 and a message naming the flag
    (`prog`: the program its messages name, default pretrain_<model>.py)."""
    parser = build_parser(model)
    parser.prog = prog or parser.prog
    args = parser.parse_args(argv)
    asked = has_cuda is None
    if asked:
        import torch
        has_cuda = torch.cuda.is_available()
    try:
        cfg = config_from_args(model, args, has_cuda)
        # a caller that names the device (tests) names one that computes bf16
        check_device_precision(cfg, has_cuda, None if asked else True)
    except ConfigError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return cfg


def resolve_attention_backend(given: str, has_cuda: bool, attention_dropout: float) -> str:
    """The --attention-backend a run uses: 'auto' becomes 'flex' where FlexAttention runs (a
    GPU that DYNAPIPE_DEVICE=cpu does not turn off, no attention dropout: flex has none), else
    'sdpa'; a backend named that cannot run here is a ConfigError."""
    on_gpu = has_cuda and os.environ.get("DYNAPIPE_DEVICE", "").strip().lower() != "cpu"
    if given == "auto":
        return "flex" if on_gpu and attention_dropout == 0 else "sdpa"
    if given == "flex" and not on_gpu:
        raise ConfigError("--attention-backend flex runs on CUDA only (FlexAttention has no "
                          "CPU backward); use sdpa or dense-mask here")
    if given == "flex" and attention_dropout:
        raise ConfigError(f"--attention-backend flex has no attention dropout: give "
                          f"--attention-dropout 0 (got {attention_dropout}) or use sdpa")
    return given


def default_cost_model(has_cuda: bool) -> str:
    """'profile' where the run trains on a GPU (DYNAPIPE_DEVICE=cpu keeps a GPU host on CPU),
    else 'analytic' (CPU plans then do not depend on timings of a loaded machine)."""
    on_gpu = has_cuda and os.environ.get("DYNAPIPE_DEVICE", "").strip().lower() != "cpu"
    return "profile" if on_gpu else "analytic"


# Flags whose absence means "the default": given as 0 or less they mean nothing, and are an
# error naming the flag rather than silently replaced by the default.
FLAGS_WITH_DEFAULTS = ("num_layers", "encoder_num_layers", "decoder_num_layers", "seq_length",
                       "encoder_seq_length", "decoder_seq_length", "max_position_embeddings",
                       "ffn_hidden_size", "kv_channels", "num_query_groups",
                       "tokens_per_global_batch", "global_batch_size",
                       "distributed_timeout_minutes", "lr_wsd_decay_iters")


def given(value, default):
    """`value` unless the flag was left out (None): 0 is a value, not "the default"."""
    return default if value is None else value


def config_from_args(model: str, args: argparse.Namespace, has_cuda: bool) -> TrainConfig:
    """A TrainConfig from parsed flags: each flag's value goes to the field it declares
    (lists as tuples), then `resolved_fields` fills the fields with Megatron's derived
    defaults (T5 layer counts, sequence lengths, ...)."""
    for name in FLAGS_WITH_DEFAULTS:
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag(name)} must be > 0, got {value} (leave the flag out "
                              f"for its default)")
    values = {}
    for f in FLAGS:
        if f.field_name is not None:
            value = getattr(args, f.dest)
            values[f.field_name] = (not value if f.negate else
                                    tuple(value) if isinstance(value, list) else value)
    values.update(resolved_fields(model, args, has_cuda))
    return TrainConfig(model=model, **values)


def resolved_fields(model: str, args: argparse.Namespace, has_cuda: bool) -> dict:
    """The fields whose flags (`field=None` in FLAGS) default from other flags, the model
    or the device, as Megatron resolves them."""
    if model == "t5":
        num_layers = given(args.encoder_num_layers, args.num_layers)
        decoder_layers = given(args.decoder_num_layers, args.num_layers)
        if num_layers is None or decoder_layers is None:
            raise ConfigError("the number of layers is required: --num-layers N (encoder and "
                              "decoder each), or --encoder-num-layers and --decoder-num-layers")
        seq_length = given(args.encoder_seq_length, given(args.seq_length, 512))
        dec_length = given(args.decoder_seq_length, 128)
    else:
        if (args.encoder_num_layers, args.decoder_num_layers,
                args.decoder_seq_length) != (None, None, None):
            raise ConfigError("--encoder-num-layers, --decoder-num-layers and "
                              "--decoder-seq-length are T5 flags; GPT uses --num-layers and "
                              "--seq-length")
        if args.num_layers is None:
            raise ConfigError("the number of layers is required: --num-layers N")
        num_layers, decoder_layers = args.num_layers, 0
        seq_length = given(args.seq_length, given(args.encoder_seq_length, 512))
        dec_length = 0
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ConfigError(f"--num-query-groups {args.num_query_groups} needs "
                          f"--group-query-attention")
    tokens = given(args.tokens_per_global_batch, 4096)
    if args.global_batch_size is not None:   # N samples: a token budget they always fit in
        tokens = args.global_batch_size * (seq_length + dec_length)
    return dict(
        num_layers=num_layers, decoder_num_layers=decoder_layers,
        seq_length=seq_length, decoder_seq_length=dec_length,
        ffn_hidden_size=given(args.ffn_hidden_size, 4 * args.hidden_size),
        max_position_embeddings=given(args.max_position_embeddings,
                                      max(seq_length, dec_length)),
        kv_channels=given(args.kv_channels, 0),
        num_query_groups=(given(args.num_query_groups, 1) if args.group_query_attention
                          else args.num_attention_heads),
        distributed_timeout_minutes=given(args.distributed_timeout_minutes,
                                          30.0 if has_cuda else 2.0),
        tokens_per_global_batch=tokens, global_batch_size=given(args.global_batch_size, 0),
        num_virtual_stages_per_pipeline_rank=virtual_stages_given(
            args, num_layers + decoder_layers),
        cost_model=given(args.cost_model, default_cost_model(has_cuda)),
        attention_backend=resolve_attention_backend(args.attention_backend, has_cuda,
                                                    args.attention_dropout),
        lr_decay_iters=given(args.lr_decay_iters, max(args.train_iters, args.lr_warmup_iters)),
        lr_wsd_decay_iters=given(args.lr_wsd_decay_iters, 0))


FLAGS_DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs", "FLAGS.md")


def flags_markdown() -> str:
    """docs/FLAGS.md: per group a table of the flags of pretrain_gpt.py and pretrain_t5.py
    (flag, default, choices, help), generated from FLAGS, the declarations the parsers are
    built from."""
    parts = ["# Flags of pretrain_gpt.py and pretrain_t5.py", "",
             "Generated from the flag declarations in `megatron/training/arguments.py` (`FLAGS`);",
             "do not edit by hand. Regenerate with",
             "`python -m megatron.training.arguments --write-flags-doc`.",
             "A flag marked (T5 only) is hidden from pretrain_gpt.py's --help (given there, a",
             "T5 value is rejected with a message). Help that differs between the models is",
             "given per model.", ""]
    for group, title in GROUP_TITLES.items():
        flags = [f for f in FLAGS if f.group == group]
        parts += [f"## {title}", "", markdown_table(flags, MODELS), ""]
    return "\n".join(parts)


def write_flags_doc(path: str = FLAGS_DOC) -> str:
    with open(path, "w") as f:
        f.write(flags_markdown())
    return path


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--write-flags-doc"]:
        sys.exit("usage: python -m megatron.training.arguments --write-flags-doc")
    print(f"wrote {write_flags_doc()}")
