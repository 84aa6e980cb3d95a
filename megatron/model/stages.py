"""Pipeline stage modules built from megatron-core parts, one per (virtual) stage of a ModelSpec.

A stage holds exactly the layer kinds of `spec.stage_layers(num_stages)[stage]`:
EMBEDDING (word + learned absolute position embedding, none with rotary positions, which
RotaryPositions gives every stage with GPT layers), GPT_LAYER / ENC_LAYER / DEC_LAYER
(megatron-core TransformerLayers from the local specs, grouped in a TransformerBlock),
ENC_NORM (T5 encoder final norm), DEC_EMBEDDING (T5 decoder embedding) and HEAD (final norm,
ColumnParallelLinear output layer, vocab-parallel cross-entropy).

Word embeddings are tied by default, as in Megatron: the output layer (and the T5 decoder
embedding) use the input word embedding's weight, global name `embedding.word_embeddings.weight`.
Within one stage module it is one Parameter; stages that hold a copy elsewhere (another stage
module, maybe on another pipeline rank) start from the same value (same global name, same init)
and their gradients are summed before the optimizer step (grad_buffer.GradBuffer with the
groups of replica_groups), so the copies stay equal; T5's relative-position-bias tables, one per
stack on every stage with layers of that stack, are replicated the same way.
`tie_embeddings=False` (Megatron's `--untie-embeddings-and-output-weights`) gives the output
layer its own weight (`output_layer.weight`); the T5 decoder embedding stays the encoder's, as in
Megatron's T5Model (one embedding for both) and HF's T5 (`shared`).

Stage forward: `stage(inputs, batch)` where `inputs` is the tuple handed over by the previous
stage (empty for the first stage) in [seq, batch, hidden] layout and `batch` the micro-batch
tensors of batch_tensors.build_micro_batch (at least the keys of `batch_keys`). It returns the
tuple for the next stage (GPT / encoder: (hidden,); after the decoder starts: (encoder output,
decoder hidden)) or, on the HEAD stage, the per-token losses [rows, seq] (the logits
[seq, rows, vocab / tp] when `batch` has no "labels").

Core attention is attention.SDPAttention in every layer spec (torch's fused attention kernels fed
by the micro-batch's Segments, never a dense mask); megatron-core's bias-GELU and
bias-dropout-add fusions are on with CUDA (build_transformer_config says why not on CPU). With
TransformerEngine importable the layers use its specs (fused LayerNorm-linear), still with
SDPAttention as core attention.
"""
from __future__ import annotations

import datetime
import functools
import math
import re
from typing import Mapping

import torch
import torch.utils.checkpoint
from megatron.core import tensor_parallel
from megatron.core.parallel_state import get_tensor_model_parallel_rank
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.relative_pos_embedding import (
    RelativePositionEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.T5.t5_spec import (
    decoder_model_with_local_spec,
    encoder_model_with_local_spec,
)
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.model.attention import AttentionMask, PositionBias, sdpa_layer_spec, segment_bucket

from dynapipe_ext.costs.model_spec import (
    DEC_EMBEDDING,
    DEC_LAYER,
    EMBEDDING,
    ENC_LAYER,
    ENC_NORM,
    GPT_ATTENTION,
    GPT_LAYER,
    GPT_MLP,
    HEAD,
    MODEL_OPTIONS,
    ModelSpec,
)

try:   # optional: TransformerEngine's fused layers where it is installed (never required)
    import transformer_engine  # noqa: F401
    HAVE_TE = True
except ImportError:
    HAVE_TE = False

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TIED_EMBEDDING = "embedding.word_embeddings.weight"   # global name of the tied word embedding
# local names of the other copies of the tied word embedding
TIED_COPIES = ("decoder_embedding.word_embeddings.weight", "head.output_layer.weight")


GELU_C = 2.0 * math.sqrt(2.0 / math.pi)   # 0.5 (1 + tanh(z)) = sigmoid(2 z)
GELU_A = 0.044715


class _SigmoidGeluTanh(torch.autograd.Function):
    """The tanh GeLU written as x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) (the same
    function: 0.5 (1 + tanh z) = sigmoid(2 z)), in a few in-place passes. torch's vectorised
    tanh is slow on CPU: at [1100, 1024] fp32, one thread, F.gelu(approximate="tanh") took
    4.0 ms forward and 4.0 ms backward on this project's CPU, this 1.7 and 3.5 ms. Keeps only
    its input for backward, as F.gelu does (same kept activations); its backward holds two
    [tokens, ffn] temporaries more than F.gelu's (AnalyticCostModel's `sigmoid_gelu`)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        y = torch.addcmul(x, x * x, x, value=GELU_A).mul_(GELU_C).sigmoid_()
        return y.mul_(x)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        x2 = x * x
        s = torch.addcmul(x, x2, x, value=GELU_A).mul_(GELU_C).sigmoid_()   # sigmoid(u)
        du = x2.mul_(3.0 * GELU_A * GELU_C).add_(GELU_C)                     # du / dx
        # d/dx [x s(u)] = s + x s (1 - s) du
        out = torch.addcmul(s, s, s, value=-1.0).mul_(x).mul_(du).add_(s)
        return out.mul_(grad)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeLU, tanh approximation: what GPT-2 (`gelu_new`), T5 v1.1 (`gelu_new`) and megatron-core's
    fused bias-GeLU compute, so fused and unfused runs agree. fp32 on CPU goes through
    _SigmoidGeluTanh (faster there, equal to float32 rounding); elsewhere torch's own kernel
    (one fused kernel on GPU; bf16 computed in fp32 inside it)."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return _SigmoidGeluTanh.apply(x)
    return torch.nn.functional.gelu(x, approximate="tanh")


def build_transformer_config(spec: ModelSpec, tp: int = 1, pp: int = 1,
                             dtype: str = "float32", hidden_dropout: float = 0.0,
                             attention_dropout: float = 0.0, recompute: str = "none",
                             fused: bool | None = None,
                             fuse_bias_gelu: bool = True,
                             fuse_bias_dropout: bool = True) -> TransformerConfig:
    """megatron-core config for the stage modules: CPU initialisation (the weights are set by
    init_weights, so megatron's own init is skipped). `fused` (default: when CUDA is there)
    switches on megatron-core's bias-GELU (tanh GELU, as Megatron-LM trains) and
    bias-dropout-add fusions. They are torch.compile'd: on CPU they run, but each new shape
    costs tens of seconds of compilation and the compiled kernels were slower than eager
    (bias-GELU fwd+bwd 176 vs 76 ms at [512, 4, 1024], one thread), so CPU runs leave them off.
    Unfused runs use gelu_tanh, the same function as the fusion (megatron-core's default
    activation, exact F.gelu, would make CPU and GPU runs differ and would not match GPT-2).
    --swiglu runs SiLU unfused (megatron-core's gated MLP: silu(gate) * up).
    `fuse_bias_gelu` / `fuse_bias_dropout` (Megatron's --no-bias-gelu-fusion and
    --no-bias-dropout-fusion) switch one of them off where `fused` is on.
    Always off: the fusions that need CUDA extensions or apex (gradient accumulation,
    persistent LayerNorm, RoPE) and the softmax fusion SDPAttention does not use.
    Dropout defaults to 0 here (tests and tools compare exact numbers); the trainer passes
    --hidden-dropout / --attention-dropout, whose streams megatron/base/rng.py seeds."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    fused = torch.cuda.is_available() if fused is None else fused
    # megatron-core fuses bias + GeLU; it needs a bias to fuse (SwiGLU runs unfused)
    fuse_activation = fused and fuse_bias_gelu and spec.add_bias_linear and not spec.swiglu
    if spec.swiglu:
        activation = torch.nn.functional.silu
    else:   # megatron-core fuses F.gelu as its tanh approximation; unfused, say so explicitly
        activation = torch.nn.functional.gelu if fuse_activation else gelu_tanh
    config = TransformerConfig(
        **core_options(spec),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        hidden_dropout=hidden_dropout,
        attention_dropout=attention_dropout,
        params_dtype=DTYPES[dtype],
        pipeline_dtype=DTYPES[dtype],
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_dropout_fusion=fused and fuse_bias_dropout,
        bias_activation_fusion=fuse_activation,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        sequence_parallel=False,
        cuda_graph_scope=[],   # no CUDA graphs; silences megatron-core's "full scope" warning
        activation_func=activation,
    )
    set_recompute(config, recompute)
    return config


def core_options(spec: ModelSpec) -> dict:
    """The TransformerConfig fields the ModelSpec options declare (`core`), each from the
    ModelSpec attribute it names (`core_from`: e.g. kv_channels from head_dim, so that 0
    means hidden / heads). The options without one are built by StageModule (positions,
    tied and padded embeddings) or, for --swiglu, by build_transformer_config (activation)."""
    return {f.metadata["core"]: getattr(spec, f.metadata["core_from"] or f.name)
            for f in MODEL_OPTIONS if f.metadata["core"]}


def set_recompute(config: TransformerConfig, mode: str) -> None:
    """Switch megatron-core's recompute settings on a config ('none', 'selective' = core
    attention only, 'full' = every layer of a block, one checkpoint per layer)."""
    if mode == "none":
        config.recompute_granularity = None
    elif mode == "selective":
        config.recompute_granularity = "selective"
        config.recompute_modules = ["core_attn"]
    elif mode == "full":
        config.recompute_granularity = "full"
        config.recompute_method = "uniform"
        config.recompute_num_layers = 1
    else:
        raise ValueError(f"recompute mode must be none, selective or full, got {mode!r}")


def layer_spec(kind: str, use_te: bool = HAVE_TE, attention_backend: str = "flex"):
    """The ModuleSpec of one GPT_LAYER / ENC_LAYER / DEC_LAYER with SDPAttention (on
    `attention_backend`) as core attention: TransformerEngine's spec when `use_te`, else
    megatron-core's local one."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.models.T5.t5_spec import (
            decoder_model_with_transformer_engine_default_spec,
            encoder_model_with_transformer_engine_default_spec,
        )
        specs = {GPT_LAYER: get_gpt_layer_with_transformer_engine_spec,
                 ENC_LAYER: encoder_model_with_transformer_engine_default_spec,
                 DEC_LAYER: decoder_model_with_transformer_engine_default_spec}
    else:
        specs = {GPT_LAYER: get_gpt_layer_local_spec, ENC_LAYER: encoder_model_with_local_spec,
                 DEC_LAYER: decoder_model_with_local_spec}
    if kind not in specs:
        raise ValueError(f"no layer spec for layer kind {kind!r}")
    return sdpa_layer_spec(specs[kind](), attention_backend)


def _relative(config: TransformerConfig, spec: ModelSpec, bidirectional: bool):
    """megatron-core's T5 relative position bias for this TP rank's heads (weights set later
    by init_weights / a checkpoint, hence the no-op init)."""
    tp = config.tensor_model_parallel_size
    return RelativePositionEmbedding(bidirectional, lambda w: None,
                                     spec.num_attention_heads // tp,
                                     spec.relative_attention_num_buckets,
                                     spec.relative_attention_max_distance)


def relative_bias(relative: RelativePositionEmbedding, n: int) -> PositionBias:
    """The position bias of megatron-core's RelativePositionEmbedding over n positions, as a
    PositionBias: bias[0, h, i, j] = table[bucket(j - i), h], the values of its
    _compute_bias(n, n), from the 2n - 1 relative positions. The bias depends on j - i only,
    so the buckets and the table lookup run over 2n - 1 positions instead of n^2, and the
    table's gradient is a sum along diagonals instead of an embedding backward over n^2
    indices. Forward + backward on this project's CPU (4 heads, one thread): n = 256, 4.8 ms
    that way, 0.7 ms this way; n = 512, 17.2 vs 1.8 ms; once per stack per stage call, which no
    cost model prices (tests/model/test_t5_relative_bias.py checks the values and the table's
    gradient)."""
    weight = relative.relative_attention_bias.weight
    positions = torch.arange(-(n - 1), n, device=weight.device)
    buckets = relative._relative_position_bucket(
        positions, bidirectional=relative.bidirectional,
        num_buckets=relative.relative_attention_num_buckets,
        max_distance=relative.relative_attention_max_distance)
    return PositionBias(relative.relative_attention_bias(buckets).t(), n)   # [heads, 2n - 1]


def _self_mask(segments, relative) -> AttentionMask:
    """Self-attention mask of `segments`, with the relative position bias when the stack has
    one (a fresh object then: the bias is part of this forward's graph), over positions from
    each sample's start: the padded length for right-padded rows, the longest sample for
    packed ones, rounded up to its group's padded shape (attention.segment_bucket;
    attention.SDPAttention takes each group's block)."""
    if relative is None:
        return AttentionMask.of(segments)
    n = (segment_bucket(max(max(row) for row in segments.lengths if row)) if segments.packed
         else segments.seq_len)
    return AttentionMask(segments, segments, bias=relative_bias(relative, n))


def _block(config: TransformerConfig, layer_spec, num_layers: int) -> TransformerBlock:
    """A TransformerBlock of exactly `num_layers` layers and no final norm (the norms are
    separate stage parts, so a block never depends on megatron's pipeline bookkeeping)."""
    spec = TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=None)
    return TransformerBlock(config, spec, post_layer_norm=False, pre_process=True,
                            post_process=False)


def _keep_half(layer, part: str) -> None:
    """Drop the half of a megatron-core TransformerLayer that another stage runs (GPT_ATTENTION
    keeps input norm + self-attention, GPT_MLP pre-MLP norm + MLP); its parameters then live
    only on that stage, under the same global names."""
    if part == GPT_ATTENTION:
        layer.pre_mlp_layernorm, layer.mlp = IdentityOp(), IdentityOp()
    elif part == GPT_MLP:
        layer.input_layernorm, layer.self_attention = IdentityOp(), IdentityOp()


def _run_parts(layers, parts, hidden, mask, rotary=None):
    """The GPT layers of a stage cut inside a layer: whole layers as TransformerBlock runs
    them, halves through megatron-core's own two halves of TransformerLayer.forward (the same
    operations in the same order, so a cut changes no number)."""
    for layer, part in zip(layers, parts):
        if part == GPT_MLP:
            hidden = layer._forward_mlp(hidden)
        elif part == GPT_ATTENTION:
            hidden, _ = layer._forward_attention(hidden_states=hidden, attention_mask=mask,
                                                 rotary_pos_emb=rotary)
        else:
            hidden, _ = layer(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)
    return hidden


class RotaryPositions(torch.nn.Module):
    """Rotary angles of each token from its position inside its own sample (the micro-batch's
    position_ids, 0 at every sample's first token, in packed streams and rows too), for
    megatron-core's attention to turn queries and keys with (its apply_rotary_pos_emb, in
    every layer, before the core attention: so every attention path, padded, per-segment,
    masked or FlexAttention, sees the same rotated q / k). The frequencies are megatron-core's
    RotaryEmbedding's (--rotary-base, --rotary-percent), with Llama 3.1's scaling by its
    `_apply_scaling` at all four of HF's rope_scaling values (its constructor passes the
    factor only). Angles are gathered per token from the table of positions 0..seq-1, never
    taken by offset in the stream. Holds no parameters."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rotary_percent,
                                      rotary_base=spec.rotary_base,
                                      use_cpu_initialization=True)
        if spec.use_rope_scaling:
            self.rotary.inv_freq = self.rotary._apply_scaling(
                self.rotary.inv_freq, factor=spec.rope_scaling_factor,
                low_freq_factor=spec.rope_scaling_low_freq_factor,
                high_freq_factor=spec.rope_scaling_high_freq_factor,
                original_max_position_embeddings=spec.rope_scaling_original_max_position_embeddings)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """[seq, rows, 1, rotary dim] fp32 angles of position_ids [rows, seq]."""
        if self.rotary.inv_freq.device != position_ids.device:   # a plain attribute
            self.rotary.inv_freq = self.rotary.inv_freq.to(position_ids.device)
        freqs = self.rotary.get_freqs_non_repeated(position_ids.shape[1])
        table = torch.cat((freqs, freqs), dim=-1)          # megatron's rotate-half layout
        return table[position_ids.t()].unsqueeze(2)


def norm(config: TransformerConfig) -> torch.nn.Module:
    """A final norm (T5 encoder, head) of config.normalization: megatron-core's torch norm
    (LayerNorm with bias, or RMSNorm with a weight only, as HF's T5LayerNorm)."""
    return WrappedTorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)


def mark_tensor_parallel_weights(module: torch.nn.Module) -> None:
    """Set megatron's `tensor_model_parallel` / `partition_dim` attributes on split weights.
    megatron-core only sets them while initialising, which we skip (perform_initialization
    False); init_weights, gradient gathering and norm clipping read them. A gated MLP's fc1
    is marked `gated_halves`: its full tensor is [gate rows; up rows] and a TP rank holds the
    same chunk of each half (what megatron-core's MLP chunks its local output into)."""
    for name, sub in module.named_modules():
        if isinstance(sub, RelativePositionEmbedding):
            set_tensor_model_parallel_attributes(sub.relative_attention_bias.weight, True, 1, 1)
            continue
        if name.endswith("mlp.linear_fc1") and sub.config.gated_linear_unit:
            for p in (sub.weight, sub.bias):
                if p is not None:
                    p.gated_halves = True
        if isinstance(sub, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(sub, RowParallelLinear):
            dim = 1
        else:
            continue
        if sub.weight is not None:
            set_tensor_model_parallel_attributes(sub.weight, True, dim, 1)
        bias = getattr(sub, "bias", None)
        if getattr(bias, "partition_stride", 1) != 1:   # megatron-core's gated fc1 bias: 2
            bias.partition_stride = 1                      # (gated_halves says how it splits)


class OutputHead(torch.nn.Module):
    """Final norm + vocab-parallel output layer + per-token cross-entropy. The logits of
    padded vocabulary rows (`unpadded_vocab_size` and beyond: rows that belong to no token)
    are -inf, so they take no part in the softmax of the loss and no probability in the
    logits returned: the loss is that of the unpadded model at any padding and TP."""

    def __init__(self, config: TransformerConfig, vocab_size: int,
                 unpadded_vocab_size: int = 0):
        super().__init__()
        self.final_norm = norm(config)
        self.output_layer = ColumnParallelLinear(
            config.hidden_size, vocab_size, config=config, init_method=config.init_method,
            bias=False, gather_output=False)
        self.unpadded_vocab_size = unpadded_vocab_size if unpadded_vocab_size < vocab_size \
            else 0

    def mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """This TP rank's logits slice with the columns of padded rows set to -inf."""
        if not self.unpadded_vocab_size:
            return logits
        part = logits.shape[-1]
        first = self.unpadded_vocab_size - part * get_tensor_model_parallel_rank()
        if first >= part:
            return logits
        columns = torch.arange(max(first, 0), part, device=logits.device)
        return logits.index_fill(-1, columns, float("-inf"))

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Per-token losses [rows, seq]; without labels, this TP rank's vocabulary slice of
        the logits [seq, rows, vocab / tp] (inference and the checkpoint-import tests)."""
        logits, _ = self.output_layer(self.final_norm(hidden))
        if labels is None:
            return self.mask_padding(logits)
        losses = tensor_parallel.vocab_parallel_cross_entropy(
            self.mask_padding(logits.float()), labels.transpose(0, 1).contiguous())
        return losses.transpose(0, 1).contiguous()   # [rows, seq]


class StageModule(torch.nn.Module):
    """The layers of one pipeline stage; see the module docstring for the forward contract."""

    def __init__(self, spec: ModelSpec, num_stages: int, stage: int,
                 config: TransformerConfig, tie_embeddings: bool = True,
                 attention_backend: str = "flex"):
        super().__init__()
        self.spec, self.stage, self.num_stages = spec, stage, num_stages
        self.config = config
        self.tie_embeddings = tie_embeddings
        self.kinds = spec.stage_layers(num_stages)[stage]
        first_layer = spec.stage_first_layer(num_stages, stage)   # global index
        # GPT layers in order, a layer cut between stages (ModelSpec.pipeline_cut) as its half
        self.gpt_parts = tuple(k for k in self.kinds if k in (GPT_LAYER, GPT_ATTENTION, GPT_MLP))
        n_gpt = len(self.gpt_parts)
        n_enc = self.kinds.count(ENC_LAYER)
        n_dec = self.kinds.count(DEC_LAYER)
        self.first_encoder_layer = first_layer
        self.first_decoder_layer = first_layer + n_enc - spec.num_layers
        self.has_embedding = EMBEDDING in self.kinds
        self.has_head = HEAD in self.kinds
        self.starts_decoder = DEC_EMBEDDING in self.kinds

        position = ("learned_absolute" if spec.position_embedding_type == "learned_absolute"
                    else "none")     # T5 relative buckets are a bias inside attention
        self.embedding = (LanguageModelEmbedding(config, spec.vocab_size,
                                                 spec.max_position_embeddings, position)
                          if self.has_embedding else None)
        self.attention_backend = attention_backend

        def layers(kind):
            return layer_spec(kind, attention_backend=attention_backend)
        self.decoder = _block(config, layers(GPT_LAYER), n_gpt) if n_gpt else None
        self.rotary = RotaryPositions(spec) if spec.rotary and n_gpt else None
        if self.decoder is not None:
            for layer, part in zip(self.decoder.layers, self.gpt_parts):
                _keep_half(layer, part)
        self.encoder = _block(config, layers(ENC_LAYER), n_enc) if n_enc else None
        self.encoder_norm = norm(config) if ENC_NORM in self.kinds else None
        self.decoder_embedding = (LanguageModelEmbedding(config, spec.vocab_size,
                                                         spec.max_position_embeddings, position)
                                  if self.starts_decoder else None)
        if n_dec:
            self.decoder = _block(config, layers(DEC_LAYER), n_dec)
        # T5 relative position buckets: one per-head bias table per stack, computed once per
        # stage forward and added in every self-attention of that stack (HF computes it in
        # the first layer and passes it on); every stage holding layers of a stack has a copy
        relative = spec.position_embedding_type == "relative"
        self.encoder_relative_pos = _relative(config, spec, True) if relative and n_enc else None
        self.decoder_relative_pos = _relative(config, spec, False) if relative and n_dec else None
        self.head = (OutputHead(config, spec.vocab_size, spec.unpadded_vocab_size)
                     if self.has_head else None)
        mark_tensor_parallel_weights(self)
        # as Megatron's Float16Module: the whole stage in the model dtype (megatron-core leaves
        # position embeddings and local-spec norms fp32); the loss is fp32 (OutputHead)
        self.to(dtype=config.params_dtype)
        if tie_embeddings or spec.model == "t5":
            self._tie_word_embeddings(with_head=tie_embeddings)
        self._mark_relative_copies()

    def _tie_word_embeddings(self, with_head: bool = True) -> None:
        """One Parameter for every word-embedding copy of this stage (the output layer's too
        `with_head`); marks it `tied_embedding` (GradBuffer sums the copies' gradients) and,
        on stages without the input embedding, `shared` (megatron-core's mark: left out of the
        gradient norm, counted once there)."""
        holders = [m.word_embeddings for m in (self.embedding, self.decoder_embedding)
                   if m is not None] + ([self.head.output_layer] if self.head and with_head
                                        else [])
        if not holders:
            return
        weight = holders[0].weight
        for module in holders[1:]:
            module.weight = weight
        weight.tied_embedding = True
        weight.replicated = TIED_EMBEDDING
        weight.shared = not self.has_embedding

    def _mark_relative_copies(self) -> None:
        """The relative-position-bias tables are replicated on every stage that holds layers
        of their stack: `replicated` (their global name; GradBuffer sums the copies'
        gradients) and, except on the stage with the stack's first layer, `shared` (counted
        once in the gradient norm)."""
        for module, owner in ((self.encoder_relative_pos, self.first_encoder_layer == 0),
                              (self.decoder_relative_pos, self.first_decoder_layer <= 0)):
            if module is not None:
                weight = module.relative_attention_bias.weight
                weight.replicated = next(n for n, p in self.named_parameters() if p is weight)
                weight.shared = not owner

    # ---- global parameter names (independent of TP/PP layout) ----
    def global_name(self, local_name: str) -> str:
        """Name of a parameter in the whole unsplit model: block layer indices are shifted to
        their global index; GPT layers count from 0, T5 decoder layers from 0 after the encoder."""
        m = re.match(r"(encoder|decoder)\.layers\.(\d+)\.(.*)", local_name)
        if m:
            block, idx, rest = m.group(1), int(m.group(2)), m.group(3)
            if block == "encoder":
                offset = self.first_encoder_layer
            elif self.spec.model == "gpt":
                offset = self.first_encoder_layer
            else:
                offset = max(self.first_decoder_layer, 0)
            return f"{block}.layers.{idx + offset}.{rest}"
        if local_name == TIED_COPIES[0] or (self.tie_embeddings and local_name in TIED_COPIES):
            return TIED_EMBEDDING
        if local_name.startswith("head."):
            return local_name[len("head."):]
        return local_name

    def named_global_parameters(self):
        """(global name, parameter) pairs of this stage."""
        for name, param in self.named_parameters():
            yield self.global_name(name), param

    def batch_keys(self) -> tuple[str, ...]:
        """The micro-batch keys this stage's forward reads (batch_tensors names)."""
        if self.spec.model == "gpt":
            keys = (("tokens", "position_ids") if self.has_embedding else ()) \
                + (("segments",) if self.decoder is not None else ()) \
                + (("position_ids",) if self.rotary is not None and not self.has_embedding
                   else ())
        else:
            keys = (("enc_tokens", "enc_position_ids") if self.has_embedding else ()) \
                + (("enc_segments",) if self.encoder is not None else ()) \
                + (("dec_tokens", "dec_position_ids") if self.starts_decoder else ()) \
                + (("enc_segments", "dec_segments") if self.decoder is not None else ())
        return keys + (("labels", "loss_mask") if self.has_head else ())

    # ---- forward ----
    def forward(self, inputs: tuple, batch: Mapping[str, torch.Tensor]):
        if self.spec.model == "gpt":
            return self._forward_gpt(inputs, batch)
        return self._forward_t5(inputs, batch)

    def _forward_gpt(self, inputs, batch):
        hidden = (self.embedding(batch["tokens"], batch["position_ids"]) if self.has_embedding
                  else inputs[0])
        if self.decoder is not None:
            mask = AttentionMask.of(batch["segments"])
            rotary = None if self.rotary is None else self.rotary(batch["position_ids"])
            if all(part == GPT_LAYER for part in self.gpt_parts):
                hidden = self.decoder(hidden, mask, rotary_pos_emb=rotary)
            else:
                hidden = _run_parts(self.decoder.layers, self.gpt_parts, hidden, mask, rotary)
        if self.has_head:
            return self.head(hidden, batch.get("labels"))
        return (hidden,)

    def _forward_t5(self, inputs, batch):
        enc = dec = None
        if self.has_embedding:
            enc = self.embedding(batch["enc_tokens"], batch["enc_position_ids"])
        else:
            enc = inputs[0]
            dec = inputs[1] if len(inputs) > 1 else None
        if self.encoder is not None:
            enc = self.encoder(enc, _self_mask(batch["enc_segments"], self.encoder_relative_pos))
        if self.encoder_norm is not None:
            enc = self.encoder_norm(enc)
        if self.starts_decoder:
            dec = self.decoder_embedding(batch["dec_tokens"], batch["dec_position_ids"])
        if self.decoder is not None:
            dec = self.decoder(dec, _self_mask(batch["dec_segments"], self.decoder_relative_pos),
                               context=enc,
                               context_mask=AttentionMask.of(batch["dec_segments"],
                                                             batch["enc_segments"]))
        if self.has_head:
            return self.head(dec, batch.get("labels"))
        return (enc,) if dec is None else (enc, dec)


def embedding_holders(spec: ModelSpec, stage_to_rank: tuple[int, ...],
                      tie_embeddings: bool = True) -> tuple[int, ...]:
    """Pipeline ranks that hold a copy of the tied word embedding (the stages with the input
    embedding, the T5 decoder embedding or, when tied, the head), sorted."""
    return replica_holders(spec, stage_to_rank, TIED_EMBEDDING, tie_embeddings)


RELATIVE_TABLES = {"encoder_relative_pos.relative_attention_bias.weight": ENC_LAYER,
                   "decoder_relative_pos.relative_attention_bias.weight": DEC_LAYER}


def replicated_names(spec: ModelSpec, tie_embeddings: bool = True) -> tuple[str, ...]:
    """Global names of the parameters of which several stages may hold a copy: the tied word
    embedding and the T5 relative-position-bias tables."""
    names = (TIED_EMBEDDING,) if tie_embeddings or spec.model == "t5" else ()
    if spec.position_embedding_type == "relative":
        names += tuple(RELATIVE_TABLES)
    return names


def replica_holders(spec: ModelSpec, stage_to_rank: tuple[int, ...], name: str,
                    tie_embeddings: bool = True) -> tuple[int, ...]:
    """Pipeline ranks holding a copy of replicated parameter `name`, sorted."""
    kinds = spec.stage_layers(len(stage_to_rank))
    if name == TIED_EMBEDDING:
        holds = (EMBEDDING, DEC_EMBEDDING, HEAD) if tie_embeddings else (EMBEDDING, DEC_EMBEDDING)
    elif name in RELATIVE_TABLES:
        holds = (RELATIVE_TABLES[name],)
    else:
        raise ValueError(f"{name} is not a replicated parameter")
    return tuple(sorted({stage_to_rank[s] for s, k in enumerate(kinds)
                         if any(h in k for h in holds)}))


def build_rank_stages(spec: ModelSpec, stage_to_rank: tuple[int, ...], pp_rank: int,
                      config: TransformerConfig,
                      device: torch.device | str | None = None,
                      tie_embeddings: bool = True,
                      attention_backend: str = "flex") -> dict[int, StageModule]:
    """The stage modules pipeline rank `pp_rank` holds under `stage_to_rank`
    (stage index -> module, in stage order), built on the CPU and moved to `device` if given;
    their core attention runs on `attention_backend` (the run's --attention-backend).
    Weights are not yet set: call init_weights.initialize_stage_weights next.
    Each replicated parameter (tied word embedding, T5 relative-bias tables) records
    `tied_ranks`, the pipeline ranks holding a copy (GradBuffer needs replica_groups when
    that is more than one)."""
    num_stages = len(stage_to_rank)
    if pp_rank not in stage_to_rank:
        raise ValueError(f"pipeline rank {pp_rank} holds no stage in layout {stage_to_rank}")
    spec.stage_layers(num_stages)   # raises when the layers do not split evenly
    stages = {s: StageModule(spec, num_stages, s, config, tie_embeddings, attention_backend)
              for s, r in enumerate(stage_to_rank) if r == pp_rank}
    for module in stages.values():
        for param in module.parameters():
            name = getattr(param, "replicated", None)
            if name is not None:
                param.tied_ranks = replica_holders(spec, stage_to_rank, name, tie_embeddings)
    if device is not None:
        for module in stages.values():
            module.to(device)
    return stages


def replica_groups(spec: ModelSpec, stage_to_rank: tuple[int, ...],
                   tie_embeddings: bool = True, timeout_s: float = 120.0) -> dict:
    """{replicated parameter name: the process group over which this rank's copies'
    gradients are summed} (the ranks of its pipeline holding a copy; megatron-core's
    embedding group only knows the first and last pipeline rank, while a wave layout, the T5
    decoder embedding or the relative-bias tables put copies elsewhere). Collective: every
    rank calls it; names with nothing to reduce across ranks, or no copy here, are left out."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    if not dist.is_initialized():
        return {}
    mine = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    groups = {}
    for name in replicated_names(spec, tie_embeddings):
        holders = replica_holders(spec, stage_to_rank, name, tie_embeddings)
        if len(holders) < 2:
            continue
        for ranks in sorted({tuple(r) for r in everyone}):   # same order on every rank
            members = [ranks[r] for r in holders]
            made = dist.new_group(members, timeout=datetime.timedelta(seconds=timeout_s))
            if dist.get_rank() in members:
                groups[name] = made
    return groups


def tied_embedding_group(spec: ModelSpec, stage_to_rank: tuple[int, ...],
                         tie_embeddings: bool = True, timeout_s: float = 120.0):
    """The group of the tied word embedding alone (replica_groups; None where there is
    nothing to reduce across ranks or this rank holds no copy). Collective."""
    only = ModelSpec(**{**spec.__dict__, "position_embedding_type": "learned_absolute"}) \
        if spec.position_embedding_type == "relative" else spec
    return replica_groups(only, stage_to_rank, tie_embeddings, timeout_s).get(TIED_EMBEDDING)


def stage_parameters(rank_stages: Mapping[int, StageModule]):
    """(global name, parameter) of every parameter this rank holds."""
    for stage in sorted(rank_stages):
        yield from rank_stages[stage].named_global_parameters()


def batch_keys(rank_stages) -> tuple[str, ...]:
    """The micro-batch keys any of these stages reads (what this rank needs built)."""
    keys = []
    for stage in (rank_stages.values() if isinstance(rank_stages, Mapping) else rank_stages):
        keys += [k for k in stage.batch_keys() if k not in keys]
    return tuple(keys)


def _checkpoint(function, *args, **kwargs):
    """torch.utils.checkpoint that also replays megatron's model-parallel RNG states (attention
    dropout draws from them), as megatron-core's own checkpoint does. Ours rather than
    megatron's because the attention masks are AttentionMask objects, which megatron's
    checkpoint (save_for_backward) cannot hold."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = dict(tracker.get_states())
    calls = []

    def run(*xs, **kw):
        if not calls:
            calls.append(True)
            return function(*xs, **kw)
        now = tracker.get_states()
        tracker.set_states(dict(states))
        try:
            return function(*xs, **kw)
        finally:
            tracker.set_states(now)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


def _checkpointed_core_attention(module, *args, **kwargs):
    """Core attention forward that recomputes itself in backward when the module is flagged."""
    if getattr(module, "recompute_core_attention", False) and torch.is_grad_enabled():
        return _checkpoint(module.plain_forward, *args, **kwargs)
    return module.plain_forward(*args, **kwargs)


def _core_attentions(stage: StageModule):
    for name, module in stage.named_modules():
        if name.endswith("core_attention"):
            yield module


def run_stage_forward(stage: StageModule, inputs: tuple, batch, recompute: str = "none"):
    """Stage forward under a recompute mode, the same on every device: 'full' recomputes the
    whole stage, 'selective' every core attention (torch.utils.checkpoint with megatron's RNG
    states, see _checkpoint; megatron-core's own recompute settings stay off)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute mode must be none, selective or full, got {recompute!r}")
    set_recompute(stage.config, "none")
    if recompute == "full" and torch.is_grad_enabled():
        # the replay in backward must not depend on flags a later micro-batch has set
        def replay(*xs):
            _flag_core_attention(stage, False)
            return stage(xs, batch)
        return _checkpoint(replay, *inputs)
    _flag_core_attention(stage, recompute == "selective")
    return stage(inputs, batch)


def _flag_core_attention(stage: StageModule, recompute: bool) -> None:
    """Route every core attention through _checkpointed_core_attention and set its flag."""
    for module in _core_attentions(stage):
        if not hasattr(module, "plain_forward"):
            module.plain_forward = module.forward
            module.forward = functools.partial(_checkpointed_core_attention, module)
        module.recompute_core_attention = recompute
