"""The model as the planner sees it: layer kinds and how they are cut into pipeline stages.
The Megatron stage builder and the cost model both read the cut from here (one place)."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

import numpy as np

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "relative", "rope")

# Layer kinds. A stage is a tuple of them, in execution order.
EMBEDDING = "embedding"          # word (+ learned position) embedding of the GPT / T5-encoder input
DEC_EMBEDDING = "dec_embedding"  # T5 decoder input embedding (first decoder stage)
GPT_LAYER = "gpt_layer"
GPT_ATTENTION = "gpt_attention"  # first half of a GPT layer cut across stages: input norm,
                                 # self-attention, residual add
GPT_MLP = "gpt_mlp"              # its second half: pre-MLP norm, MLP, residual add
ENC_LAYER = "enc_layer"
DEC_LAYER = "dec_layer"
ENC_NORM = "enc_final_norm"      # T5 encoder final norm (stage that holds the last encoder layer)
HEAD = "head"                    # final norm + output layer + cross-entropy loss


def option(default=MISSING, *, flag: str, arg: str | None = None, core: str | None = None,
           core_from: str | None = None, hf: str | None = None, shape: bool = False,
           negate: bool = False):
    """A ModelSpec field that is part of the model's identity, declared with where it comes
    from and goes to: `flag` the training flag that sets it (Megatron-LM's name; error
    messages name it), `arg` the TrainConfig field it is read from (default: the same name;
    `negate`: the field is `not arg`), `core` the megatron-core TransformerConfig field it
    fills (None: the stage builder reads it) with the ModelSpec attribute `core_from` (default
    the field itself), `hf` the Hugging Face (transformers 5) config key of the same meaning
    where there is one ("a.b": key b of dict a), `shape`: a size rather than a layer option
    (checkpoints always compare sizes; profiles and checkpoints that predate a layer option
    leave it out)."""
    return field(default=default, metadata=dict(flag=flag, arg=arg, core=core,
                                                core_from=core_from, hf=hf, shape=shape,
                                                negate=negate))


@dataclass(frozen=True)
class ModelSpec:
    """Shape and layer options of a GPT or T5 model: the one declaration of a model's
    identity. The fields declared with `option` are what tells two models apart; the
    training flags' model checks (`option_problems`), megatron-core's TransformerConfig
    (megatron/model/stages.py build_transformer_config), the stage builder, the cost model
    and a checkpoint's recorded identity (megatron/checkpoint/checkpointing.py) all read
    them from `MODEL_OPTIONS`. For T5, `num_layers` counts encoder layers."""

    model: str = option(flag="the model (pretrain_gpt.py / pretrain_t5.py)", shape=True)
    num_layers: int = option(flag="--num-layers", core="num_layers", core_from="total_layers",
                             hf="num_hidden_layers", shape=True)
    hidden_size: int = option(flag="--hidden-size", core="hidden_size", hf="hidden_size",
                              shape=True)
    num_attention_heads: int = option(flag="--num-attention-heads", core="num_attention_heads",
                                      hf="num_attention_heads", shape=True)
    vocab_size: int = field()     # rows of the word embedding / output layer (padded)
    num_decoder_layers: int = option(0, flag="--decoder-num-layers", arg="decoder_num_layers",
                                     shape=True)
    # 0 means 4 * hidden_size
    ffn_hidden_size: int = option(0, flag="--ffn-hidden-size", core="ffn_hidden_size",
                                  core_from="ffn_size", hf="intermediate_size", shape=True)
    max_position_embeddings: int = option(4096, flag="--max-position-embeddings",
                                          hf="max_position_embeddings", shape=True)
    # output layer (and T5 decoder embedding) share the word embedding: one matrix per stage
    # that holds several uses
    tied_embeddings: bool = option(False, flag="--untie-embeddings-and-output-weights",
                                   arg="untie_embeddings_and_output_weights", negate=True,
                                   hf="tie_word_embeddings")
    # layer options (T5 v1.1 / FLAN-T5: RMSNorm, no linear biases, gated GeLU, softmax scale 1,
    # relative position buckets, kv_channels != hidden / heads; Llama / Qwen / Mistral: RMSNorm,
    # no linear biases (Qwen2: q/k/v biases), SwiGLU, rotary positions, grouped-query attention)
    normalization: str = option("LayerNorm", flag="--normalization", core="normalization")
    layernorm_epsilon: float = option(1e-5, flag="--norm-epsilon", arg="norm_epsilon",
                                      core="layernorm_epsilon", hf="rms_norm_eps")
    add_bias_linear: bool = option(True, flag="--disable-bias-linear", core="add_bias_linear")
    add_qkv_bias: bool = option(False, flag="--add-qkv-bias", core="add_qkv_bias")
    # gated GeLU: fc1 has 2 x ffn rows (3 matrices)
    gated_linear_unit: bool = option(False, flag="--gated-gelu", core="gated_linear_unit",
                                     core_from="gated_mlp")
    swiglu: bool = option(False, flag="--swiglu")   # gated SiLU: 3 matrices too
    softmax_scale: float | None = option(None, flag="--softmax-scale", core="softmax_scale")
    position_embedding_type: str = option("learned_absolute", flag="--position-embedding-type")
    relative_attention_num_buckets: int = option(32, flag="--relative-attention-num-buckets")
    relative_attention_max_distance: int = option(128, flag="--relative-attention-max-distance")
    rotary_base: float = option(10000.0, flag="--rotary-base", hf="rope_parameters.rope_theta")
    rotary_percent: float = option(1.0, flag="--rotary-percent",
                                   hf="rope_parameters.partial_rotary_factor")
    # Llama 3.1 frequency scaling (HF rope_parameters / rope_scaling with rope_type "llama3")
    use_rope_scaling: bool = option(False, flag="--use-rope-scaling")
    rope_scaling_factor: float = option(8.0, flag="--rope-scaling-factor",
                                        hf="rope_parameters.factor")
    rope_scaling_low_freq_factor: float = option(1.0, flag="--rope-scaling-low-freq-factor",
                                                 hf="rope_parameters.low_freq_factor")
    rope_scaling_high_freq_factor: float = option(4.0, flag="--rope-scaling-high-freq-factor",
                                                  hf="rope_parameters.high_freq_factor")
    rope_scaling_original_max_position_embeddings: int = option(
        8192, flag="--rope-scaling-original-max-position-embeddings",
        hf="rope_parameters.original_max_position_embeddings")
    # per-head size; 0 means hidden / heads
    kv_channels: int = option(0, flag="--kv-channels", core="kv_channels", core_from="head_dim",
                              hf="head_dim")
    # grouped-query attention: key / value heads; 0 (or the head count) means one per head
    num_query_groups: int = option(0, flag="--num-query-groups", core="num_query_groups",
                                   core_from="query_groups", hf="num_key_value_heads")
    # the tokenizer's vocabulary when vocab_size is padded past it (--make-vocab-size-divisible-by
    # x TP): the output layer's rows from here on belong to no token and are left out of the
    # softmax; 0 means every row is a token
    unpadded_vocab_size: int = 0
    # GPT: half-layer units (attention, MLP) per pipeline stage, in stage order
    # (--pipeline-split); () is the even whole-layer split
    pipeline_cut: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_query_groups == self.num_attention_heads:   # one form for "one per head"
            object.__setattr__(self, "num_query_groups", 0)
        problems = option_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        if self.pipeline_cut:
            if self.model != "gpt":
                raise ValueError("a pipeline cut into half layers is implemented for GPT only")
            if min(self.pipeline_cut) < 1 or sum(self.pipeline_cut) != 2 * self.num_layers:
                raise ValueError(f"pipeline_cut {self.pipeline_cut} must give every stage at "
                                 f"least one of the {2 * self.num_layers} half-layer units "
                                 f"and sum to that")

    @property
    def gated_mlp(self) -> bool:
        """fc1 has 2 x ffn rows (gated GeLU or SwiGLU): the MLP has three matrices."""
        return self.gated_linear_unit or self.swiglu

    @property
    def rotary(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that rotary positions turn (--rotary-percent of them)."""
        return int(self.head_dim * self.rotary_percent) if self.rotary else 0

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_width(self) -> int:
        """Width of the queries, of the attention core's output and of the output
        projection's input: heads x head size (the hidden size unless --kv-channels says
        otherwise, as in T5 v1.1 / FLAN-T5)."""
        return self.num_attention_heads * self.head_dim

    @property
    def query_groups(self) -> int:
        """Key / value heads: the query groups, or every head without grouped-query attention."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_share(self) -> float:
        """Key / value heads per attention head (1 without grouped-query attention)."""
        return self.query_groups / self.num_attention_heads

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_decoder_layers

    def shared_vocab_params(self, kinds: tuple[str, ...], tp: int = 1) -> float:
        """Parameters (per TP rank) that per-kind counts count twice in a stage of these layer
        kinds: the stage's embedding(s) and, with tied embeddings, its head are one matrix (T5's
        encoder and decoder embeddings always are; copies on other stages are theirs to count)."""
        tied = (EMBEDDING, DEC_EMBEDDING, HEAD) if self.tied_embeddings else (EMBEDDING,
                                                                              DEC_EMBEDDING)
        uses = sum(k in tied for k in kinds)
        if uses < 2:
            return 0.0
        return (uses - 1) * self.vocab_size * self.hidden_size / tp

    def stage_layers(self, num_stages: int) -> list[tuple[str, ...]]:
        """Layer kinds of each of `num_stages` (virtual) stages: transformer layers split evenly
        (or, with `pipeline_cut`, in half-layer units: a layer cut between two stages is a
        GPT_ATTENTION at the end of one and a GPT_MLP at the start of the next), embedding on
        the first stage, the head on the last; T5 encoder layers come first, then decoder
        layers (a stage may hold the end of the encoder and the start of the decoder)."""
        if self.pipeline_cut:
            return self._cut_stage_layers(num_stages)
        if num_stages <= 0 or self.total_layers % num_stages:
            raise ValueError(f"{self.total_layers} transformer layers do not split evenly over "
                             f"{num_stages} pipeline stages")
        if self.model == "gpt":
            layers = [GPT_LAYER] * self.num_layers
        else:
            layers = [ENC_LAYER] * self.num_layers + [DEC_LAYER] * self.num_decoder_layers
        per = self.total_layers // num_stages
        stages = []
        for s in range(num_stages):
            chunk = layers[s * per:(s + 1) * per]
            kinds: list[str] = [EMBEDDING] if s == 0 else []
            for i, kind in enumerate(chunk):
                if kind == DEC_LAYER and (s * per + i) == self.num_layers:
                    kinds += [ENC_NORM, DEC_EMBEDDING]
                kinds.append(kind)
            if s == num_stages - 1:
                kinds.append(HEAD)
            stages.append(tuple(kinds))
        return stages

    def _cut_stage_layers(self, num_stages: int) -> list[tuple[str, ...]]:
        """stage_layers under `pipeline_cut` (unit 2i is layer i's attention, 2i + 1 its MLP)."""
        if num_stages != len(self.pipeline_cut):
            raise ValueError(f"pipeline_cut {self.pipeline_cut} is for {len(self.pipeline_cut)} "
                             f"stages, not {num_stages}")
        stages, start = [], 0
        for s, units in enumerate(self.pipeline_cut):
            end = start + units
            kinds: list[str] = [EMBEDDING] if s == 0 else []
            for layer in range(start // 2, (end + 1) // 2):
                attention, mlp = start <= 2 * layer, 2 * layer + 1 < end
                kinds.append(GPT_LAYER if attention and mlp
                             else GPT_ATTENTION if attention else GPT_MLP)
            if s == num_stages - 1:
                kinds.append(HEAD)
            stages.append(tuple(kinds))
            start = end
        return stages

    def stage_first_layer(self, num_stages: int, stage: int) -> int:
        """Global index of the first transformer layer (or half layer) `stage` holds."""
        if self.pipeline_cut:
            return sum(self.pipeline_cut[:stage]) // 2
        return stage * (self.total_layers // num_stages)


MODEL_OPTIONS = tuple(f for f in fields(ModelSpec) if "flag" in f.metadata)


def option_flag(name: str) -> str:
    """The training flag of ModelSpec option `name` (what messages name)."""
    return next(f.metadata["flag"] for f in MODEL_OPTIONS if f.name == name)


def option_arg(option) -> str:
    """The TrainConfig field (flag dest) an option is read from."""
    return option.metadata["arg"] or option.name


def option_values(config) -> dict:
    """{ModelSpec field: value} of every option, read from a TrainConfig-like object
    (its fields named as the flags' dests), so that a ModelSpec option cannot be left out
    of the run's model."""
    values = {}
    for f in MODEL_OPTIONS:
        value = getattr(config, option_arg(f))
        values[f.name] = (not value) if f.metadata["negate"] else value
    return values


def flag_values(spec: ModelSpec) -> dict:
    """{training flag's field: value} that builds `spec` (option_values' inverse):
    what a checkpoint of it records; the query groups as --num-query-groups holds them."""
    values = {option_arg(f): (not getattr(spec, f.name)) if f.metadata["negate"]
              else getattr(spec, f.name) for f in MODEL_OPTIONS}
    values["num_query_groups"] = spec.query_groups
    return values


def flag_list(names) -> str:
    return ", ".join(option_flag(n) for n in names)


ROPE_SCALING = ("rope_scaling_factor", "rope_scaling_low_freq_factor",
                "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings")


def option_problems(spec) -> list[str]:
    """What is wrong with the options of `spec` (a ModelSpec, or any object with its option
    fields: the trainer checks its flags with this), each message naming the flag."""
    problems = []

    def need(ok: bool, message: str):
        if not ok:
            problems.append(message)

    defaults = {f.name: f.default for f in MODEL_OPTIONS}
    changed = [name for name in defaults if getattr(spec, name) != defaults[name]]
    need(spec.model in ("gpt", "t5"), f"model must be 'gpt' or 't5', got {spec.model!r}")
    need(spec.model != "t5" or spec.num_decoder_layers > 0,
         "a T5 model needs --decoder-num-layers > 0")
    need(spec.normalization in NORMALIZATIONS,
         f"--normalization must be one of {NORMALIZATIONS}, got {spec.normalization!r}")
    position = spec.position_embedding_type
    need(position in POSITION_EMBEDDING_TYPES,
         f"--position-embedding-type must be one of {POSITION_EMBEDDING_TYPES}, got "
         f"{position!r}")
    need(position != "relative" or spec.model == "t5",
         "--position-embedding-type relative is a T5 option (its bucketed position bias)")
    need(position != "rope" or spec.model == "gpt",
         "--position-embedding-type rope is implemented for GPT models (pretrain_gpt.py)")
    buckets, distance = spec.relative_attention_num_buckets, spec.relative_attention_max_distance
    exact = {buckets // 2, buckets // 4}    # the decoder's and the encoder's exact buckets
    need(position != "relative" or distance not in exact,
         f"--relative-attention-max-distance {distance} equals the exact buckets of "
         f"--relative-attention-num-buckets {buckets} ({sorted(exact)}): the log buckets "
         f"beyond them divide by log(distance / exact buckets) = 0")
    heads, groups = spec.num_attention_heads, spec.num_query_groups
    need(groups >= 0 and not (groups and heads % groups),
         f"--num-query-groups {groups} must be > 0 and divide --num-attention-heads {heads}")
    need(spec.kv_channels > 0 or spec.hidden_size % max(heads, 1) == 0,
         f"--hidden-size {spec.hidden_size} is not divisible by --num-attention-heads {heads}")
    need(not (spec.swiglu and spec.gated_linear_unit),
         "--swiglu and --gated-gelu are two gated MLPs: give one")
    rope_only = [n for n in ("rotary_base", "rotary_percent", "use_rope_scaling") if n in changed]
    need(position == "rope" or not rope_only,
         f"{flag_list(rope_only)} only with --position-embedding-type rope")
    scaling = [n for n in ROPE_SCALING if n in changed]
    need(spec.use_rope_scaling or not scaling, f"{flag_list(scaling)} only with --use-rope-scaling")
    need(spec.rotary_base > 0, f"--rotary-base must be > 0, got {spec.rotary_base}")
    need(0 < spec.rotary_percent <= 1,
         f"--rotary-percent must lie in (0, 1], got {spec.rotary_percent}")
    if position == "rope" and spec.kv_channels + spec.hidden_size and heads:
        head_dim = spec.kv_channels or spec.hidden_size // heads
        turned = int(head_dim * spec.rotary_percent)
        need(turned >= 2 and turned % 2 == 0,
             f"--rotary-percent {spec.rotary_percent} turns {turned} of the {head_dim} channels "
             f"of a head; rotary positions need an even number of them (at least 2)")
    if spec.use_rope_scaling:
        need(spec.rope_scaling_factor > 0,
             f"--rope-scaling-factor must be > 0, got {spec.rope_scaling_factor}")
        need(0 < spec.rope_scaling_low_freq_factor < spec.rope_scaling_high_freq_factor,
             f"need 0 < --rope-scaling-low-freq-factor < --rope-scaling-high-freq-factor, got "
             f"{spec.rope_scaling_low_freq_factor} and {spec.rope_scaling_high_freq_factor}")
        need(spec.rope_scaling_original_max_position_embeddings > 0,
             f"--rope-scaling-original-max-position-embeddings must be > 0, got "
             f"{spec.rope_scaling_original_max_position_embeddings}")
    return problems


def token_weighted_length(lengths, max_len: float) -> float:
    """The length of the sample an average token sits in (sum l^2 / sum l, samples' lengths
    summed over their parts and cut at `max_len`): the length a half-layer cut is balanced
    at, since attention grows with it."""
    total = np.asarray(lengths, dtype=np.float64)
    total = np.minimum(total.reshape(len(total), -1).sum(axis=1), max_len)
    return float((total ** 2).sum() / max(total.sum(), 1.0))


def balanced_cut(unit_costs, num_stages: int) -> tuple[int, ...]:
    """Cut a sequence of unit costs into `num_stages` contiguous non-empty runs so that the
    largest run's sum is least (ties: the earliest such cut); returns the run lengths. Exact
    dynamic program, O(units^2 x stages): units are half layers, a few hundred at most."""
    costs = [float(c) for c in unit_costs]
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} units into {num_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: least max-run sum cutting the first i units into k runs; back[k][i]: last start
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    back = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], back[k][i] = value, j
    runs, i = [], n
    for k in range(num_stages, 0, -1):
        j = back[k][i]
        runs.append(i - j)
        i = j
    return tuple(reversed(runs))


def stage_output_shapes(stage_layers: tuple[str, ...], rows: int, seq_len: int,
                        dec_seq_len: int, hidden_size: int) -> tuple[tuple[int, ...], ...]:
    """Tensors a stage hands to the next one, in Megatron's [seq, batch, hidden] layout:
    GPT / T5 encoder stages pass the hidden state; once the decoder has started, a stage passes
    (encoder output, decoder hidden). The last stage (with HEAD) passes nothing."""
    if HEAD in stage_layers:
        return ()
    if DEC_LAYER in stage_layers or DEC_EMBEDDING in stage_layers:
        return ((seq_len, rows, hidden_size), (dec_seq_len, rows, hidden_size))
    return ((seq_len, rows, hidden_size),)
