"""Hugging Face `transformers` checkpoints <-> this project's layout-free full state.

A full state is {global parameter name (stages.StageModule.global_name): full tensor}
(full_state.py); `load_full_state` slices it for any TP rank. The functions here are pure
renames and reshapes of tensors, both ways, plus the model shape a state needs (`ModelSpec`):

* GPT2LMHeadModel: HF's Conv1D stores weights as [in, out], megatron-core's linears as
  [out, in], so every matrix is transposed. HF's fused c_attn output is [q of all heads,
  k of all heads, v of all heads]; megatron-core's linear_qkv packs per head (query group)
  [q_h, k_h, v_h] (see SelfAttention.get_query_key_value_tensors), so rows are regrouped.
  The word embedding is tied to the output layer (GPT-2's lm_head is wte), unless the
  checkpoint has its own lm_head (tie_word_embeddings false): then both ways it is untied.

* T5ForConditionalGeneration (T5 v1.1 / FLAN-T5: gated GeLU, RMSNorm, no biases, relative
  position buckets, untied lm_head): HF's separate q, k, v (and cross-attention k, v) are packed
  per head into linear_qkv (linear_kv); the gated MLP's wi_0 (GeLU) and wi_1 (linear) are the
  two halves of linear_fc1; the relative-attention-bias tables of the first encoder / decoder
  block become `encoder_relative_pos` / `decoder_relative_pos`. HF's `shared` input embedding
  is ours too (the decoder embedding is the encoder's); lm_head is the untied output layer,
  written on export with a config that says untied (t5_model).

* LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM (RMSNorm, SwiGLU, rotary positions,
  grouped-query attention, no linear biases but Qwen2's on q/k/v, tied or untied head): the
  model is a ModelSpec whose options are read from the config through each option's `hf` key
  (model_spec.MODEL_OPTIONS, the one declaration of a model's identity) and written back the
  same way; what a family fixes is DECODER_OPTIONS. HF's separate q, k, v (weights and biases)
  are packed per query group into linear_qkv ([q heads of group g, k_g, v_g]); gate_proj and
  up_proj are the two halves of linear_fc1. A sliding window shorter than the sequence is
  refused (attention here sees every earlier position of a sample), at import and by a run
  that loads the import (imported_window_problem).

A converted model is described by its ModelSpec (vocab_size: the checkpoint's vocabulary),
written as model_args.json (spec_record) beside the checkpoint; its training flags
(megatron/training/arguments.py training_flags) and its checkpoint identity
(model_spec.flag_values) are derived from the same options.

Vocabulary padding: the training run pads the vocabulary (training.padded_vocab_size, a
multiple of --make-vocab-size-divisible-by x TP); `fit_vocab` pads a full state's vocabulary
rows the way Megatron's converters do (copies of the last row) and `*_from_full_state` drops
them again; the output head gives them -inf logits (stages.OutputHead), so they change no loss.
Export keeps the non-weight fields of the imported config.json (SOURCE_CONFIG_FILE).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch

from dynapipe_ext.costs.model_spec import MODEL_OPTIONS, ROPE_SCALING, ModelSpec, flag_values
from megatron.model.stages import TIED_EMBEDDING

GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")
VOCAB_ROWS = (TIED_EMBEDDING, "output_layer.weight",
              "decoder_embedding.word_embeddings.weight")


def padded_spec(spec: ModelSpec, vocab_rows: int | None = None) -> ModelSpec:
    """The model of a converted state (`spec`: its vocab_size the checkpoint's vocabulary)
    with `vocab_rows` embedding rows (default: the vocabulary), the rows past the vocabulary
    belonging to no token, as a training run pads it."""
    if not vocab_rows or vocab_rows == spec.vocab_size:
        return spec
    return replace(spec, vocab_size=vocab_rows, unpadded_vocab_size=spec.vocab_size)


class ConversionError(ValueError):
    """A checkpoint this converter cannot map; the message names what and where."""


HF_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def check_hf_source(directory: str) -> None:
    """ConversionError naming what is wrong unless `directory` holds what save_pretrained
    writes: config.json and weights, each safetensors file as long as its header says (for a
    missing, empty or truncated folder transformers speaks of model types, hub repo ids or a
    deserialising error instead)."""
    import os

    from safetensors import safe_open
    if not os.path.isdir(directory):
        raise ConversionError(f"--from-hf {directory}: no such folder")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ConversionError(f"--from-hf {directory}: no config.json there (a folder that "
                              f"save_pretrained wrote holds one)")
    weights = sorted(n for n in os.listdir(directory) if n.endswith(HF_WEIGHT_SUFFIXES))
    if not weights:
        raise ConversionError(f"--from-hf {directory}: no weights there (*.safetensors or "
                              f"pytorch_model.bin)")
    for name in (n for n in weights if n.endswith(".safetensors")):
        path = os.path.join(directory, name)
        try:
            with safe_open(path, framework="pt") as f:
                f.keys()
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ConversionError(f"{path}: truncated or damaged ({type(err).__name__}: "
                                  f"{detail})") from None


# ---------------------------------------------------------------- QKV row layouts

def qkv_from_hf(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """HF fused rows [q(all heads); k; v] -> megatron-core rows [q_h, k_h, v_h per head].
    Works on a weight [3h, in] or a bias [3h]."""
    rest = tensor.shape[1:]
    d = tensor.shape[0] // (3 * heads)
    return tensor.reshape(3, heads, d, *rest).transpose(0, 1).reshape(3 * heads * d, *rest)


def qkv_to_hf(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of qkv_from_hf."""
    rest = tensor.shape[1:]
    d = tensor.shape[0] // (3 * heads)
    return tensor.reshape(heads, 3, d, *rest).transpose(0, 1).reshape(3 * heads * d, *rest)


# ---------------------------------------------------------------- GPT-2

def gpt2_args(config) -> ModelSpec:
    """ModelSpec of a transformers GPT2Config; ConversionError for GPT-2 variants the
    megatron-core layers do not compute."""
    problems = []
    if config.activation_function not in GELU_TANH:
        problems.append(f"activation_function {config.activation_function!r} (only the tanh "
                        f"GeLU {GELU_TANH} is supported)")
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx \
            or config.reorder_and_upcast_attn:
        problems.append("non-default attention scaling (scale_attn_weights False, "
                        "scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn)")
    if abs(config.layer_norm_epsilon - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon {config.layer_norm_epsilon} (the model uses 1e-5)")
    if problems:
        raise ConversionError("GPT-2 config: " + "; ".join(problems))
    return ModelSpec(model="gpt", num_layers=config.n_layer, hidden_size=config.n_embd,
                     num_attention_heads=config.n_head,
                     ffn_hidden_size=config.n_inner or 4 * config.n_embd,
                     vocab_size=config.vocab_size, max_position_embeddings=config.n_positions,
                     tied_embeddings=True)


def _gpt2_layer_pairs(i: int) -> list[tuple[str, str, str]]:
    """(HF name, our name, how) for layer i; how: 'copy', 't' (transpose) or 'qkv'."""
    hf, ours = f"transformer.h.{i}.", f"decoder.layers.{i}."
    return [(hf + "ln_1.weight", ours + "input_layernorm.weight", "copy"),
            (hf + "ln_1.bias", ours + "input_layernorm.bias", "copy"),
            (hf + "attn.c_attn.weight", ours + "self_attention.linear_qkv.weight", "qkv"),
            (hf + "attn.c_attn.bias", ours + "self_attention.linear_qkv.bias", "qkv"),
            (hf + "attn.c_proj.weight", ours + "self_attention.linear_proj.weight", "t"),
            (hf + "attn.c_proj.bias", ours + "self_attention.linear_proj.bias", "copy"),
            (hf + "ln_2.weight", ours + "pre_mlp_layernorm.weight", "copy"),
            (hf + "ln_2.bias", ours + "pre_mlp_layernorm.bias", "copy"),
            (hf + "mlp.c_fc.weight", ours + "mlp.linear_fc1.weight", "t"),
            (hf + "mlp.c_fc.bias", ours + "mlp.linear_fc1.bias", "copy"),
            (hf + "mlp.c_proj.weight", ours + "mlp.linear_fc2.weight", "t"),
            (hf + "mlp.c_proj.bias", ours + "mlp.linear_fc2.bias", "copy")]


def _gpt2_pairs(args: ModelSpec) -> list[tuple[str, str, str]]:
    pairs = [("transformer.wte.weight", TIED_EMBEDDING, "copy"),
             ("transformer.wpe.weight", "embedding.position_embeddings.weight", "copy")]
    for i in range(args.num_layers):
        pairs += _gpt2_layer_pairs(i)
    return pairs + [("transformer.ln_f.weight", "final_norm.weight", "copy"),
                    ("transformer.ln_f.bias", "final_norm.bias", "copy")]


def _conv1d_qkv_from_hf(tensor: torch.Tensor, how: str, heads: int) -> torch.Tensor:
    if how == "copy":
        return tensor
    if tensor.ndim == 2:
        tensor = tensor.t()             # Conv1D [in, out] -> [out, in]
    return qkv_from_hf(tensor, heads) if how == "qkv" else tensor


def _conv1d_qkv_to_hf(tensor: torch.Tensor, how: str, heads: int) -> torch.Tensor:
    if how == "copy":
        return tensor
    if how == "qkv":
        tensor = qkv_to_hf(tensor, heads)
    return tensor.t() if tensor.ndim == 2 else tensor


def _take(hf_state: Mapping[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    if name not in hf_state:
        raise ConversionError(f"{where}: tensor {name} is missing")
    return hf_state[name]


def full_state_from_gpt2(hf_state: Mapping[str, torch.Tensor], args: ModelSpec,
                         where: str = "GPT-2 checkpoint") -> dict[str, torch.Tensor]:
    """Full state of our GPT from a GPT2LMHeadModel state dict (fp32, contiguous). With
    an untied `args` (tied_embeddings False) the output layer is the checkpoint's own
    lm_head (tie_word_embeddings false) or a copy of the tied embedding."""
    full = {ours: _conv1d_qkv_from_hf(_take(hf_state, hf, where).float(), how,
                                      args.num_attention_heads).contiguous()
            for hf, ours, how in _gpt2_pairs(args)}
    head = hf_state.get("lm_head.weight")
    untied = head is not None and not torch.equal(head, hf_state["transformer.wte.weight"])
    if untied and args.tied_embeddings:
        raise ConversionError(f"{where}: lm_head.weight differs from transformer.wte.weight; "
                              "import it with --untie-embeddings-and-output-weights")
    if not args.tied_embeddings:
        full["output_layer.weight"] = (head.float().contiguous() if untied
                                       else full[TIED_EMBEDDING].clone())
    return full


def gpt2_from_full_state(full: Mapping[str, torch.Tensor], args: ModelSpec,
                         where: str = "full state") -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel state dict from our GPT's full state, with lm_head.weight when the
    output layer is untied; padded vocabulary rows are dropped."""
    hf = {hf: _conv1d_qkv_to_hf(_take(full, ours, where), how,
                                args.num_attention_heads).contiguous()
          for hf, ours, how in _gpt2_pairs(args)}
    if not args.tied_embeddings:
        hf["lm_head.weight"] = _take(full, "output_layer.weight", where)
    for name in ("transformer.wte.weight", "lm_head.weight"):
        if name in hf:
            hf[name] = hf[name][:args.vocab_size].contiguous()
    return hf


def gpt2_config(args: ModelSpec, source: Mapping | None = None):
    """transformers GPT2Config for a model of `args`; the fields that do not change the
    function (dropout, token ids, ...) are those of `source` (a config.json's dict) if given."""
    from transformers import GPT2Config
    fields = dict(vocab_size=args.vocab_size, n_positions=args.max_position_embeddings,
                  n_embd=args.hidden_size, n_layer=args.num_layers,
                  n_head=args.num_attention_heads, n_inner=args.ffn_size,
                  activation_function="gelu_new", layer_norm_epsilon=1e-5,
                  scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                  reorder_and_upcast_attn=False,
                  tie_word_embeddings=args.tied_embeddings)
    return GPT2Config.from_dict({**_kept_fields(source, "gpt2"), **fields})


def _kept_fields(source: Mapping | None, model_type: str) -> dict:
    """The fields of a source config.json dict that an export keeps (none for another model
    type; the ones transformers writes itself are left to it)."""
    if not source or source.get("model_type") != model_type:
        return {}
    return {k: v for k, v in source.items() if k not in ("transformers_version", "architectures",
                                                         "_name_or_path")}


# ---------------------------------------------------------------- T5 v1.1 / FLAN-T5

def t5_args(config) -> ModelSpec:
    """ModelSpec of a transformers T5Config (T5 v1.1 / FLAN-T5); ConversionError for T5
    variants the megatron-core layers do not compute (the original T5's ReLU MLP and its
    tied, rescaled lm_head)."""
    problems = []
    if config.feed_forward_proj not in ("gated-gelu",):
        problems.append(f"feed_forward_proj {config.feed_forward_proj!r} (only 'gated-gelu', "
                        "T5 v1.1 / FLAN-T5, is supported)")
    # transformers >= 5 keeps the original T5's rescaled output in `scale_decoder_outputs`
    if getattr(config, "scale_decoder_outputs", config.tie_word_embeddings):
        problems.append("the original T5's rescaled tied output (tie_word_embeddings / "
                        "scale_decoder_outputs; only the T5 v1.1 / FLAN-T5 head is supported)")
    if problems:
        raise ConversionError("T5 config: " + "; ".join(problems))
    decoder_layers = config.num_decoder_layers or config.num_layers
    return ModelSpec(model="t5", num_layers=config.num_layers, hidden_size=config.d_model,
                     num_attention_heads=config.num_heads, ffn_hidden_size=config.d_ff,
                     vocab_size=config.vocab_size,
                     max_position_embeddings=getattr(config, "n_positions", 512),
                     num_decoder_layers=decoder_layers,
                     tied_embeddings=False, normalization="RMSNorm",
                     layernorm_epsilon=config.layer_norm_epsilon, add_bias_linear=False,
                     gated_linear_unit=True, softmax_scale=1.0,
                     position_embedding_type="relative",
                     relative_attention_num_buckets=config.relative_attention_num_buckets,
                     relative_attention_max_distance=config.relative_attention_max_distance,
                     kv_channels=config.d_kv)


def pack_per_head(tensors: list[torch.Tensor], heads: int) -> torch.Tensor:
    """HF's separate projections [q], [k], [v] -> megatron-core's rows grouped per head, or per
    query group under grouped-query attention (`heads` = groups: q's heads of a group, then its
    k and v head): [q_g, k_g, v_g] for each g (or [k_h, v_h] for cross-attention's linear_kv).
    Works on weights [rows, in] and biases [rows]."""
    rest = tensors[0].shape[1:]
    grouped = torch.cat([t.reshape(heads, -1, *rest) for t in tensors], dim=1)
    return grouped.reshape(-1, *rest)


def unpack_per_head(tensor: torch.Tensor, parts: int, heads: int,
                    rows: list[int] | None = None) -> list[torch.Tensor]:
    """Inverse of pack_per_head; `rows`: each part's rows per group (default: equal parts)."""
    rest = tensor.shape[1:]
    grouped = tensor.reshape(heads, -1, *rest)
    rows = rows or [grouped.shape[1] // parts] * parts
    return [p.reshape(-1, *rest) for p in torch.split(grouped, rows, dim=1)]


def _t5_layer(i: int, stack: str) -> tuple[str, str]:
    return f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."


def _t5_pairs(args: ModelSpec) -> list[tuple[str, str]]:
    """(HF name, our name) of the T5 tensors that map one to one."""
    pairs = [("shared.weight", TIED_EMBEDDING), ("lm_head.weight", "output_layer.weight"),
             ("encoder.final_layer_norm.weight", "encoder_norm.weight"),
             ("decoder.final_layer_norm.weight", "final_norm.weight")]
    for stack in ("encoder", "decoder"):
        pairs.append((f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                      f"{stack}_relative_pos.relative_attention_bias.weight"))
    for i in range(args.num_layers):
        hf, ours = _t5_layer(i, "encoder")
        pairs += [(hf + "0.layer_norm.weight", ours + "input_layernorm.weight"),
                  (hf + "0.SelfAttention.o.weight", ours + "self_attention.linear_proj.weight"),
                  (hf + "1.layer_norm.weight", ours + "pre_mlp_layernorm.weight"),
                  (hf + "1.DenseReluDense.wo.weight", ours + "mlp.linear_fc2.weight")]
    for i in range(args.num_decoder_layers):
        hf, ours = _t5_layer(i, "decoder")
        pairs += [(hf + "0.layer_norm.weight", ours + "input_layernorm.weight"),
                  (hf + "0.SelfAttention.o.weight", ours + "self_attention.linear_proj.weight"),
                  (hf + "1.layer_norm.weight", ours + "pre_cross_attn_layernorm.weight"),
                  (hf + "1.EncDecAttention.q.weight", ours + "cross_attention.linear_q.weight"),
                  (hf + "1.EncDecAttention.o.weight",
                   ours + "cross_attention.linear_proj.weight"),
                  (hf + "2.layer_norm.weight", ours + "pre_mlp_layernorm.weight"),
                  (hf + "2.DenseReluDense.wo.weight", ours + "mlp.linear_fc2.weight")]
    return pairs


def _t5_packed(args: ModelSpec) -> list[tuple[list[str], str]]:
    """([HF names], our name) of the tensors packed from several HF ones: self-attention
    q, k, v; cross-attention k, v (per head); the gated MLP's wi_0, wi_1 (halves)."""
    packed = []
    for stack, layers, mlp in (("encoder", args.num_layers, "1"),
                               ("decoder", args.num_decoder_layers, "2")):
        for i in range(layers):
            hf, ours = _t5_layer(i, stack)
            packed.append(([hf + f"0.SelfAttention.{x}.weight" for x in "qkv"],
                           ours + "self_attention.linear_qkv.weight"))
            if stack == "decoder":
                packed.append(([hf + f"1.EncDecAttention.{x}.weight" for x in "kv"],
                               ours + "cross_attention.linear_kv.weight"))
            packed.append(([hf + f"{mlp}.DenseReluDense.wi_{x}.weight" for x in "01"],
                           ours + "mlp.linear_fc1.weight"))
    return packed


def full_state_from_t5(hf_state: Mapping[str, torch.Tensor], args: ModelSpec,
                       where: str = "T5 checkpoint") -> dict[str, torch.Tensor]:
    """Full state of our T5 from a T5ForConditionalGeneration state dict (fp32, contiguous)."""
    heads = args.num_attention_heads
    full = {ours: _take(hf_state, hf, where).float().contiguous()
            for hf, ours in _t5_pairs(args)}
    for names, ours in _t5_packed(args):
        tensors = [_take(hf_state, n, where).float() for n in names]
        full[ours] = (torch.cat(tensors) if ours.endswith("linear_fc1.weight")
                      else pack_per_head(tensors, heads)).contiguous()
    return full


def t5_from_full_state(full: Mapping[str, torch.Tensor], args: ModelSpec,
                       where: str = "full state") -> dict[str, torch.Tensor]:
    """T5ForConditionalGeneration state dict from our T5's full state (padded vocabulary rows
    dropped)."""
    heads = args.num_attention_heads
    if args.tied_embeddings:     # a tied T5: its head is the embedding
        full = {**full, "output_layer.weight": _take(full, TIED_EMBEDDING, where)}
    hf = {name: _take(full, ours, where).contiguous() for name, ours in _t5_pairs(args)}
    for names, ours in _t5_packed(args):
        tensor = _take(full, ours, where)
        parts = (torch.chunk(tensor, 2) if ours.endswith("linear_fc1.weight")
                 else unpack_per_head(tensor, len(names), heads))
        hf.update({n: p.contiguous() for n, p in zip(names, parts)})
    for name in ("shared.weight", "lm_head.weight"):
        hf[name] = hf[name][:args.vocab_size].contiguous()
    return hf


def t5_model(config):
    """T5ForConditionalGeneration of `config` with T5 v1.1's head: its own lm_head, the
    encoder's and decoder's input embeddings the `shared` one. transformers >= 5 forces
    T5Config.tie_word_embeddings to True whatever it is given (the v1.1 head is told apart by
    `scale_decoder_outputs`), which would make lm_head and shared one tensor; setting the
    attribute after construction unties all three, so the input embeddings are re-shared."""
    from transformers import T5ForConditionalGeneration
    config.tie_word_embeddings = False
    model = T5ForConditionalGeneration(config)
    model.set_input_embeddings(model.shared)
    return model


def t5_config(args: ModelSpec, source: Mapping | None = None):
    """transformers T5Config (T5 v1.1 / FLAN-T5 style: untied, unscaled head) for a model of
    `args`; the fields that do not change the function (dropout, token ids, ...) are those of
    `source` (a config.json's dict) if given."""
    from transformers import T5Config
    defaults = dict(dropout_rate=0.0,
                    # T5's ids (T5SentencePieceTokenizer): the decoder starts from pad
                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    fields = dict(vocab_size=args.vocab_size, d_model=args.hidden_size,
                  d_kv=args.kv_channels or args.hidden_size // args.num_attention_heads,
                  d_ff=args.ffn_size, num_layers=args.num_layers,
                  num_decoder_layers=args.num_decoder_layers,
                  num_heads=args.num_attention_heads,
                  relative_attention_num_buckets=args.relative_attention_num_buckets,
                  relative_attention_max_distance=args.relative_attention_max_distance,
                  layer_norm_epsilon=args.layernorm_epsilon, feed_forward_proj="gated-gelu",
                  tie_word_embeddings=False)
    config = T5Config.from_dict({**defaults, **_kept_fields(source, "t5"), **fields})
    config.tie_word_embeddings = False       # transformers >= 5 sets True in __init__
    return config


# ---------------------------------------------------------------- Llama / Qwen2 / Mistral

# The layer options these families fix (Megatron-LM's flags for them: --normalization RMSNorm
# --disable-bias-linear --swiglu --position-embedding-type rope); Qwen2 adds q/k/v biases.
DECODER_OPTIONS = dict(normalization="RMSNorm", add_bias_linear=False, swiglu=True,
                       position_embedding_type="rope")
LLAMA3_ROPE = "llama3"     # HF rope_type of Llama 3.1's frequency scaling (--use-rope-scaling)
DEFAULT_ROPE = "default"


def is_hf_decoder(spec: ModelSpec) -> bool:
    """Whether `spec` is a model of the Llama / Qwen2 / Mistral families (rotary, SwiGLU)."""
    return spec.model == "gpt" and spec.position_embedding_type == "rope"


def _hf_value(config: Mapping, key: str):
    """config[key], or config[a][b] for key "a.b"; None where it is not set."""
    value = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def sliding_window(fields: Mapping) -> int | None:
    """The attention window of a Mistral / Qwen2 config's fields (config.json as a dict), None
    where every layer attends to all earlier positions."""
    if fields.get("model_type") == "qwen2" and not fields.get("use_sliding_window", False):
        return None
    return fields.get("sliding_window")


def imported_window_problem(directory: str, seq_length: int) -> str | None:
    """Why a run of `seq_length` tokens must not train the import in `directory` (None if it
    may): the layers here attend to every earlier position, which equals a sliding window's
    attention only on sequences within the window (its hf_config.json says how long)."""
    source = read_source_config(directory)
    window = sliding_window(source) if source is not None else None
    if window is None or seq_length <= window:
        return None
    return (f"{directory} was imported from a model whose attention reaches back "
            f"{window} tokens (sliding_window in {SOURCE_CONFIG_FILE}); full attention over "
            f"--seq-length {seq_length} would compute another function: train with "
            f"--seq-length {window} or less")


def decoder_spec(config, seq_length: int | None = None) -> ModelSpec:
    """ModelSpec of a transformers Llama / Qwen2 / Mistral config: the options whose `hf` key
    (model_spec.MODEL_OPTIONS) the config sets, plus what the family fixes (DECODER_OPTIONS;
    Qwen2's q/k/v biases; Llama 3.1 rope scaling). ConversionError, naming every field, for a
    variant the layers here do not compute, and for a sliding window shorter than
    `seq_length` (default: max_position_embeddings)."""
    fields = config.to_dict()       # rotary fields in transformers' `rope_parameters` form
    kind = (fields.get("rope_parameters") or {}).get("rope_type", DEFAULT_ROPE)
    qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (SwiGLU needs 'silu')")
    if config.model_type == "llama" and getattr(config, "attention_bias", False):
        problems.append("attention_bias true (a bias on o_proj too; only q/k/v biases, "
                        "Qwen2's, are supported)")
    if getattr(config, "mlp_bias", False):
        problems.append("mlp_bias true (the MLP has no biases here)")
    if kind not in (DEFAULT_ROPE, LLAMA3_ROPE):
        problems.append(f"rope_scaling of rope_type {kind!r} (only Llama 3.1's "
                        f"{LLAMA3_ROPE!r} is supported)")
    window = sliding_window(fields)
    longest = seq_length or config.max_position_embeddings
    if window is not None and window < longest:
        problems.append(f"sliding_window {window} is shorter than "
                        f"{'--seq-length' if seq_length else 'max_position_embeddings'} "
                        f"{longest} (attention beyond the window is not computed here); "
                        f"import with --seq-length {window} or less and train no longer")
    if problems:
        raise ConversionError(f"{type(config).__name__}: " + "; ".join(problems))
    options = {f.name: _hf_value(fields, f.metadata["hf"]) for f in MODEL_OPTIONS
               if f.metadata["hf"]}
    options = {name: value for name, value in options.items() if value is not None}
    if options.get("kv_channels") == config.hidden_size // config.num_attention_heads:
        options["kv_channels"] = 0                     # hidden / heads, the default
    return ModelSpec(**{**options, **DECODER_OPTIONS}, model="gpt", add_qkv_bias=qkv_bias,
                     use_rope_scaling=kind == LLAMA3_ROPE, vocab_size=config.vocab_size)


def decoder_config_fields(spec: ModelSpec) -> dict:
    """config.json fields of a model of `spec`: each option's `hf` key ("a.b": key b of dict
    a), valued as megatron-core reads it (`core_from`: e.g. head_dim for kv_channels 0); the
    scaling fields only with --use-rope-scaling, the partial rotary factor only below 1 and
    head_dim only where it is not hidden / heads (the configs' own defaults)."""
    rope_type = LLAMA3_ROPE if spec.use_rope_scaling else DEFAULT_ROPE
    fields: dict = {"vocab_size": spec.vocab_size, "hidden_act": "silu",
                    "rope_parameters": {"rope_type": rope_type}}
    for f in MODEL_OPTIONS:
        key = f.metadata["hf"]
        if not key or (f.name in ROPE_SCALING and not spec.use_rope_scaling) \
                or (f.name == "rotary_percent" and spec.rotary_percent == 1.0) \
                or (f.name == "kv_channels" and not spec.kv_channels):
            continue
        value = getattr(spec, f.metadata["core_from"] or f.name)
        outer, _, inner = key.rpartition(".")
        (fields.setdefault(outer, {}) if outer else fields)[inner] = value
    return fields


def _decoder_layer(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def _decoder_pairs(spec: ModelSpec) -> list[tuple[str, str]]:
    """(HF name, our name) of the tensors that map one to one."""
    pairs = [("model.embed_tokens.weight", TIED_EMBEDDING), ("model.norm.weight",
                                                             "final_norm.weight")]
    if not spec.tied_embeddings:
        pairs.append(("lm_head.weight", "output_layer.weight"))
    for i in range(spec.num_layers):
        hf, ours = _decoder_layer(i)
        pairs += [(hf + "input_layernorm.weight", ours + "input_layernorm.weight"),
                  (hf + "self_attn.o_proj.weight", ours + "self_attention.linear_proj.weight"),
                  (hf + "post_attention_layernorm.weight", ours + "pre_mlp_layernorm.weight"),
                  (hf + "mlp.down_proj.weight", ours + "mlp.linear_fc2.weight")]
    return pairs


def _decoder_packed(spec: ModelSpec) -> list[tuple[list[str], str]]:
    """([HF names], our name) of the tensors packed from several: q, k, v (weights, and
    biases with --add-qkv-bias) per query group into linear_qkv; gate and up as the halves
    of linear_fc1."""
    packed = []
    for i in range(spec.num_layers):
        hf, ours = _decoder_layer(i)
        kinds = ("weight", "bias") if spec.add_qkv_bias else ("weight",)
        packed += [([hf + f"self_attn.{x}_proj.{kind}" for x in "qkv"],
                    ours + f"self_attention.linear_qkv.{kind}") for kind in kinds]
        packed.append(([hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
                       ours + "mlp.linear_fc1.weight"))
    return packed


def _qkv_rows(spec: ModelSpec) -> list[int]:
    """Rows of q, k and v per query group."""
    d = spec.head_dim
    return [spec.num_attention_heads // spec.query_groups * d, d, d]


def full_state_from_decoder(hf_state: Mapping[str, torch.Tensor], spec: ModelSpec,
                            where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Full state of our GPT from a Llama / Qwen2 / Mistral ...ForCausalLM state dict (fp32,
    contiguous). An untied `spec` takes the checkpoint's lm_head, or a copy of the embedding
    where the checkpoint ties them; a tied one refuses a checkpoint whose lm_head differs."""
    head = hf_state.get("lm_head.weight")
    embedding = _take(hf_state, "model.embed_tokens.weight", where)
    if spec.tied_embeddings and head is not None and not torch.equal(head, embedding):
        raise ConversionError(f"{where}: lm_head.weight differs from "
                              "model.embed_tokens.weight; import it with "
                              "--untie-embeddings-and-output-weights")
    if not spec.tied_embeddings and head is None:
        hf_state = {**hf_state, "lm_head.weight": embedding}
    full = {ours: _take(hf_state, hf, where).float().contiguous()
            for hf, ours in _decoder_pairs(spec)}
    for names, ours in _decoder_packed(spec):
        tensors = [_take(hf_state, n, where).float() for n in names]
        full[ours] = (torch.cat(tensors) if ours.endswith("linear_fc1.weight")
                      else pack_per_head(tensors, spec.query_groups)).contiguous()
    return full


def decoder_from_full_state(full: Mapping[str, torch.Tensor], spec: ModelSpec,
                            where: str = "full state") -> dict[str, torch.Tensor]:
    """...ForCausalLM state dict from our GPT's full state (padded vocabulary rows dropped;
    lm_head.weight only when untied)."""
    hf = {name: _take(full, ours, where).contiguous() for name, ours in _decoder_pairs(spec)}
    for names, ours in _decoder_packed(spec):
        tensor = _take(full, ours, where)
        parts = (torch.chunk(tensor, 2) if ours.endswith("linear_fc1.weight")
                 else unpack_per_head(tensor, 3, spec.query_groups, _qkv_rows(spec)))
        hf.update({n: p.contiguous() for n, p in zip(names, parts)})
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in hf:
            hf[name] = hf[name][:spec.vocab_size].contiguous()
    return hf


def decoder_config(spec: ModelSpec, source: Mapping | None = None):
    """The transformers config of a model of `spec`: the family of `source` (a config.json
    dict; default Qwen2 with q/k/v biases, else Llama) with its fields that do not change the function (token ids,
    dropout, ...) kept, and `spec`'s (decoder_config_fields) over them."""
    from transformers import AutoConfig
    model_type = (source or {}).get("model_type")
    if model_type not in HF_DECODERS:
        model_type = "qwen2" if spec.add_qkv_bias else "llama"
    if spec.add_qkv_bias and model_type != "qwen2":
        raise ConversionError(f"--add-qkv-bias: a {model_type} config has no q/k/v-only "
                              "biases (Qwen2's have)")
    kept = {k: v for k, v in _kept_fields(source, model_type).items()
            if k not in ("model_type", "rope_parameters", "rope_theta", "rope_scaling",
                         "partial_rotary_factor")}
    fields = {**kept, **decoder_config_fields(spec)}
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [HF_DECODERS[model_type]]
    return config


def write_decoder(full: Mapping[str, torch.Tensor], spec: ModelSpec, directory: str,
                  source: Mapping | None = None) -> None:
    """Save our full state as a Llama / Qwen2 / Mistral checkpoint directory."""
    from transformers import AutoModelForCausalLM
    config = decoder_config(spec, source)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    save_causal_lm(model, decoder_from_full_state(full, spec), spec, directory,
                   config.architectures[0], model.model.embed_tokens)


def save_causal_lm(model, state: Mapping[str, torch.Tensor], spec: ModelSpec, directory: str,
                   name: str, embedding) -> None:
    """Load `state` into a transformers causal LM, check that every weight was set and that
    its head is tied exactly when the checkpoint's is, and save it to `directory`."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    untied = not spec.tied_embeddings
    if set(missing) - (set() if untied else {"lm_head.weight"}) or unexpected:
        raise ConversionError(f"{directory}: {name} export left {missing} unset and "
                              f"{unexpected} unused")
    if (model.lm_head.weight is embedding.weight) == untied:
        raise ConversionError(f"{directory}: transformers built a head that is "
                              f"{'tied' if untied else 'untied'}, the checkpoint's is not")
    model.save_pretrained(directory)


# ---------------------------------------------------------------- vocabulary padding

def fit_vocab(full: Mapping[str, torch.Tensor], vocab_rows: int,
              where: str = "full state") -> dict[str, torch.Tensor]:
    """The state with every vocabulary-sized tensor padded to `vocab_rows` rows with copies of
    its last row (Megatron's converters do the same; the rows belong to no token). Padding
    only: fewer rows than the state has is a ConversionError."""
    out = dict(full)
    for name in VOCAB_ROWS:
        if name not in out:
            continue
        rows = out[name].shape[0]
        if rows > vocab_rows:
            raise ConversionError(f"{where}: {name} has {rows} vocabulary rows, more than the "
                                  f"model's {vocab_rows}")
        if rows < vocab_rows:
            extra = out[name][-1:].expand(vocab_rows - rows, -1)
            out[name] = torch.cat([out[name], extra]).contiguous()
    return out


# ---------------------------------------------------------------- files

ARGS_FILE = "model_args.json"             # the ModelSpec options, and the flags to train with
SOURCE_CONFIG_FILE = "hf_config.json"     # the imported config.json, for export to keep
# model_args.json of earlier imports named some options as the flags' fields do
RECORD_RENAMES = {"decoder_num_layers": "num_decoder_layers"}


def spec_record(spec: ModelSpec) -> dict:
    """model_args.json: every ModelSpec option of `spec` and its vocabulary."""
    return {**{f.name: getattr(spec, f.name) for f in MODEL_OPTIONS},
            "vocab_size": spec.vocab_size}


def read_spec_record(path: str) -> ModelSpec:
    """The ModelSpec of a model_args.json (this form, or the one of earlier imports)."""
    import json
    try:
        with open(path) as f:
            record = json.load(f)
        record = {RECORD_RENAMES.get(k, k): v for k, v in record.items()}
        if "untie_embeddings_and_output_weights" in record:
            record["tied_embeddings"] = not record.pop("untie_embeddings_and_output_weights")
        return ModelSpec(**record)
    except (UnicodeDecodeError, ValueError, TypeError) as err:
        raise ConversionError(f"{path}: not a model_args.json ({err})") from None


def read_source_config(directory: str) -> dict | None:
    """The config.json an import kept in `directory` (SOURCE_CONFIG_FILE), or None."""
    import json
    import os
    path = os.path.join(directory, SOURCE_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (UnicodeDecodeError, ValueError) as err:
        raise ConversionError(f"{path}: not a JSON config ({err})") from None


HF_DECODERS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "mistral": "MistralForCausalLM"}


def hf_kind(config) -> str:
    """'gpt' for a GPT-2 config, 't5' for a T5 one, 'decoder' for Llama / Qwen2 / Mistral;
    ConversionError otherwise."""
    kinds = {"gpt2": "gpt", "t5": "t5", **{t: "decoder" for t in HF_DECODERS}}
    if config.model_type not in kinds:
        raise ConversionError(f"model_type {config.model_type!r}: only GPT-2 "
                              "(GPT2LMHeadModel), T5 (T5ForConditionalGeneration) and "
                              f"{', '.join(HF_DECODERS.values())} convert")
    return kinds[config.model_type]


def read_hf(directory: str, untie: bool = False,
            seq_length: int | None = None) -> tuple[dict, ModelSpec]:
    """(full state, ModelSpec) of a transformers checkpoint directory (config.json plus
    safetensors / bin weights, as save_pretrained writes them; nothing is downloaded);
    `seq_length`: the longest sequence a run will train on (a sliding window must cover it)."""
    from transformers import (AutoConfig, AutoModelForCausalLM, GPT2LMHeadModel,
                              T5ForConditionalGeneration)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    kind = hf_kind(config)
    if kind == "t5":
        args = t5_args(config)    # T5 v1.1's head is untied whatever `untie` says
        model = T5ForConditionalGeneration.from_pretrained(directory, local_files_only=True,
                                                           dtype=torch.float32)
        return full_state_from_t5(model.state_dict(), args, where=directory), args
    args = gpt2_args(config) if kind == "gpt" else decoder_spec(config, seq_length)
    if untie or not config.tie_word_embeddings:     # a checkpoint with its own lm_head
        args = replace(args, tied_embeddings=False)
    model_class = GPT2LMHeadModel if kind == "gpt" else AutoModelForCausalLM
    model = model_class.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    read = full_state_from_gpt2 if kind == "gpt" else full_state_from_decoder
    return read(model.state_dict(), args, where=directory), args


def write_hf(full: Mapping[str, torch.Tensor], args: ModelSpec, directory: str,
             source: Mapping | None = None) -> None:
    """Save our full state as a transformers checkpoint directory (save_pretrained): every
    tensor, the output layer too when it is untied, and a config that says so; the config's
    other fields are `source`'s (read_source_config) when given."""
    from transformers import GPT2LMHeadModel
    if is_hf_decoder(args):
        write_decoder(full, args, directory, source)
        return
    if args.model == "t5":
        model = t5_model(t5_config(args, source))
        state = t5_from_full_state(full, args)
        missing, unexpected = model.load_state_dict(state, strict=False)
        shared = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
        if set(missing) - shared or unexpected:
            raise ConversionError(f"{directory}: T5 export left {missing} unset and "
                                  f"{unexpected} unused")
        if model.lm_head.weight is model.shared.weight:
            raise ConversionError(f"{directory}: transformers tied lm_head to the embedding")
        model.save_pretrained(directory)
        return
    model = GPT2LMHeadModel(gpt2_config(args, source))
    save_causal_lm(model, gpt2_from_full_state(full, args), args, directory, "GPT-2",
                   model.transformer.wte)


def write_converted(full: Mapping[str, torch.Tensor], args: ModelSpec, directory: str,
                    source: Mapping | None = None) -> str:
    """Save a converted model for training, the one place where the on-disk form is chosen: a
    layout-free, model-only checkpoint (iteration 0) that `--load DIR --finetune` reads at any
    TP / PP / DP, plus its ModelSpec (the flags to train it with) and the source's config.json
    (`source`, which export keeps the other fields of). Returns the iteration directory."""
    import json
    import os

    from megatron.checkpoint.checkpointing import atomic_write, save_model_only_checkpoint
    os.makedirs(directory, exist_ok=True)
    # what a run must build alike (the flags of training_flags), so that a load with other
    # flags is refused instead of training another function
    signature = {**flag_values(args), "vocab_size": args.vocab_size}
    folder = save_model_only_checkpoint(directory, 0, {n: t.contiguous() for n, t in full.items()},
                                        signature)

    def write_args(tmp):
        with open(tmp, "w") as f:
            json.dump(spec_record(args), f, indent=1)
    atomic_write(os.path.join(directory, ARGS_FILE), write_args)
    if source is not None:
        def write_source(tmp):
            with open(tmp, "w") as f:
                json.dump(dict(source), f, indent=1)
        atomic_write(os.path.join(directory, SOURCE_CONFIG_FILE), write_source)
    return folder


def read_converted(directory: str, args_directory: str | None = None) -> tuple[dict, ModelSpec]:
    """(full state, ModelSpec) of a checkpoint for export: one written by write_converted, or a
    training run's (`--save`) with the ModelSpec of the converted directory it was fine-tuned
    from (`args_directory`); its model shape must be that of the ModelSpec."""
    import json
    import os

    from megatron.checkpoint.checkpointing import (read_common, read_full_model_state,
                                                   signature_differences)
    args_file = os.path.join(args_directory or directory, ARGS_FILE)
    if not os.path.isfile(args_file):
        raise ConversionError(f"{args_file} not found: export reads the model flags from a "
                              "directory tools/convert_checkpoint.py wrote; for a training "
                              "run's checkpoint give --model-args DIR, the converted directory "
                              "it was fine-tuned from")
    args = read_spec_record(args_file)
    saved = read_common(directory)["config"]
    differ = signature_differences(saved, {**flag_values(args), "vocab_size": args.vocab_size})
    if differ:
        raise ConversionError(f"{directory} holds another model than {args_file} describes: "
                              f"{'; '.join(differ)}")
    return read_full_model_state(directory), args
