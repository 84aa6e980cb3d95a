"""The model as the planner sees it: layer kinds and how they are cut into pipeline stages.
The Megatron stage builder and the cost model both read the cut from here (one place)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "relative")

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


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a GPT or T5 model. For T5, `num_layers` counts encoder layers."""

    model: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int               # rows of the word embedding / output layer (padded)
    num_decoder_layers: int = 0
    ffn_hidden_size: int = 0      # 0 means 4 * hidden_size
    max_position_embeddings: int = 4096
    tied_embeddings: bool = False  # output layer (and T5 decoder embedding) share the word
                                   # embedding: one matrix per stage that holds several uses
    # layer options (Megatron-LM flag names; T5 v1.1 / FLAN-T5: RMSNorm, no linear biases,
    # gated GeLU, softmax scale 1, relative position buckets, kv_channels != hidden / heads)
    normalization: str = "LayerNorm"          # --normalization {LayerNorm,RMSNorm}
    layernorm_epsilon: float = 1e-5           # --norm-epsilon
    add_bias_linear: bool = True              # --disable-bias-linear sets False
    gated_linear_unit: bool = False           # --gated-gelu: fc1 has 2 x ffn rows (3 matrices)
    softmax_scale: float | None = None        # None: 1/sqrt(kv_channels); T5: 1.0
    position_embedding_type: str = "learned_absolute"   # or "relative" (T5 buckets)
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    kv_channels: int = 0                      # per-head size; 0 means hidden / heads
    num_query_groups: int = 0                 # --num-query-groups (grouped-query attention:
                                              # key / value heads); 0 means one per head
    # the tokenizer's vocabulary when vocab_size is padded past it (--make-vocab-size-divisible-by
    # x TP): the output layer's rows from here on belong to no token and are left out of the
    # softmax; 0 means every row is a token
    unpadded_vocab_size: int = 0
    # GPT: half-layer units (attention, MLP) per pipeline stage, in stage order
    # (--pipeline-split); () is the even whole-layer split
    pipeline_cut: tuple[int, ...] = ()

    def __post_init__(self):
        if self.model not in ("gpt", "t5"):
            raise ValueError(f"model must be 'gpt' or 't5', got {self.model!r}")
        if self.model == "t5" and self.num_decoder_layers <= 0:
            raise ValueError("a T5 ModelSpec needs num_decoder_layers > 0")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be LayerNorm or RMSNorm, got "
                             f"{self.normalization!r}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError("position_embedding_type must be learned_absolute or relative, "
                             f"got {self.position_embedding_type!r}")
        if self.position_embedding_type == "relative" and self.model != "t5":
            raise ValueError("relative position buckets are a T5 option")
        if self.pipeline_cut:
            if self.model != "gpt":
                raise ValueError("a pipeline cut into half layers is implemented for GPT only")
            if min(self.pipeline_cut) < 1 or sum(self.pipeline_cut) != 2 * self.num_layers:
                raise ValueError(f"pipeline_cut {self.pipeline_cut} must give every stage at "
                                 f"least one of the {2 * self.num_layers} half-layer units "
                                 f"and sum to that")
        if self.num_query_groups < 0 or (self.num_query_groups and
                                         self.num_attention_heads % self.num_query_groups):
            raise ValueError(f"num_query_groups {self.num_query_groups} must be > 0 and divide "
                             f"num_attention_heads {self.num_attention_heads}")
        if not self.kv_channels and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")

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
