"""Hugging Face `transformers` checkpoints <-> this project's layout-free full state.

A full state is {global parameter name (stages.StageModule.global_name): full tensor}
(full_state.py); `load_full_state` slices it for any TP rank. The functions here are pure
renames and reshapes of tensors, both ways, plus the model shape a state needs (`ModelArgs`):

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

Vocabulary padding: the training run pads the vocabulary (training.padded_vocab_size, a
multiple of --make-vocab-size-divisible-by x TP); `fit_vocab` pads a full state's vocabulary
rows the way Megatron's converters do (copies of the last row) and `*_from_full_state` drops
them again; the output head gives them -inf logits (stages.OutputHead), so they change no loss.
Export keeps the non-weight fields of the imported config.json (SOURCE_CONFIG_FILE).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping

import torch

from megatron.model.stages import TIED_EMBEDDING

GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")
VOCAB_ROWS = (TIED_EMBEDDING, "output_layer.weight",
              "decoder_embedding.word_embeddings.weight")


@dataclass(frozen=True)
class ModelArgs:
    """What a converted state needs from the model built to hold it (the training flags of the
    same names: --num-layers, --hidden-size, ...)."""

    model: str                     # "gpt" or "t5"
    num_layers: int                # GPT layers / T5 encoder layers
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int                # the checkpoint's vocabulary (before padding)
    max_position_embeddings: int
    decoder_num_layers: int = 0
    untie_embeddings_and_output_weights: bool = False
    # layer options (ModelSpec fields of the same names; GPT-2 keeps the defaults)
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    add_bias_linear: bool = True
    gated_linear_unit: bool = False
    softmax_scale: float | None = None
    position_embedding_type: str = "learned_absolute"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    kv_channels: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def spec(self, vocab_rows: int | None = None):
        """The ModelSpec of this model with `vocab_rows` (default: the unpadded vocabulary)."""
        from dynapipe_ext.costs.model_spec import ModelSpec
        return ModelSpec(model=self.model, num_layers=self.num_layers,
                         hidden_size=self.hidden_size,
                         num_attention_heads=self.num_attention_heads,
                         vocab_size=vocab_rows or self.vocab_size,
                         unpadded_vocab_size=self.vocab_size,
                         num_decoder_layers=self.decoder_num_layers,
                         ffn_hidden_size=self.ffn_hidden_size,
                         max_position_embeddings=self.max_position_embeddings,
                         normalization=self.normalization,
                         layernorm_epsilon=self.layernorm_epsilon,
                         add_bias_linear=self.add_bias_linear,
                         gated_linear_unit=self.gated_linear_unit,
                         softmax_scale=self.softmax_scale,
                         position_embedding_type=self.position_embedding_type,
                         relative_attention_num_buckets=self.relative_attention_num_buckets,
                         relative_attention_max_distance=self.relative_attention_max_distance,
                         kv_channels=self.kv_channels,
                         tied_embeddings=not self.untie_embeddings_and_output_weights)


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

def gpt2_args(config) -> ModelArgs:
    """ModelArgs of a transformers GPT2Config; ConversionError for GPT-2 variants the
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
    return ModelArgs(model="gpt", num_layers=config.n_layer, hidden_size=config.n_embd,
                     num_attention_heads=config.n_head,
                     ffn_hidden_size=config.n_inner or 4 * config.n_embd,
                     vocab_size=config.vocab_size, max_position_embeddings=config.n_positions)


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


def _gpt2_pairs(args: ModelArgs) -> list[tuple[str, str, str]]:
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


def full_state_from_gpt2(hf_state: Mapping[str, torch.Tensor], args: ModelArgs,
                         where: str = "GPT-2 checkpoint") -> dict[str, torch.Tensor]:
    """Full state of our GPT from a GPT2LMHeadModel state dict (fp32, contiguous). With
    `args.untie_embeddings_and_output_weights` the output layer is the checkpoint's own
    lm_head (tie_word_embeddings false) or a copy of the tied embedding."""
    full = {ours: _conv1d_qkv_from_hf(_take(hf_state, hf, where).float(), how,
                                      args.num_attention_heads).contiguous()
            for hf, ours, how in _gpt2_pairs(args)}
    head = hf_state.get("lm_head.weight")
    untied = head is not None and not torch.equal(head, hf_state["transformer.wte.weight"])
    if untied and not args.untie_embeddings_and_output_weights:
        raise ConversionError(f"{where}: lm_head.weight differs from transformer.wte.weight; "
                              "import it with --untie-embeddings-and-output-weights")
    if args.untie_embeddings_and_output_weights:
        full["output_layer.weight"] = (head.float().contiguous() if untied
                                       else full[TIED_EMBEDDING].clone())
    return full


def gpt2_from_full_state(full: Mapping[str, torch.Tensor], args: ModelArgs,
                         where: str = "full state") -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel state dict from our GPT's full state, with lm_head.weight when the
    output layer is untied; padded vocabulary rows are dropped."""
    hf = {hf: _conv1d_qkv_to_hf(_take(full, ours, where), how,
                                args.num_attention_heads).contiguous()
          for hf, ours, how in _gpt2_pairs(args)}
    if args.untie_embeddings_and_output_weights:
        hf["lm_head.weight"] = _take(full, "output_layer.weight", where)
    for name in ("transformer.wte.weight", "lm_head.weight"):
        if name in hf:
            hf[name] = hf[name][:args.vocab_size].contiguous()
    return hf


def gpt2_config(args: ModelArgs, source: Mapping | None = None):
    """transformers GPT2Config for a model of `args`; the fields that do not change the
    function (dropout, token ids, ...) are those of `source` (a config.json's dict) if given."""
    from transformers import GPT2Config
    fields = dict(vocab_size=args.vocab_size, n_positions=args.max_position_embeddings,
                  n_embd=args.hidden_size, n_layer=args.num_layers,
                  n_head=args.num_attention_heads, n_inner=args.ffn_hidden_size,
                  activation_function="gelu_new", layer_norm_epsilon=1e-5,
                  scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                  reorder_and_upcast_attn=False,
                  tie_word_embeddings=not args.untie_embeddings_and_output_weights)
    return GPT2Config.from_dict({**_kept_fields(source, "gpt2"), **fields})


def _kept_fields(source: Mapping | None, model_type: str) -> dict:
    """The fields of a source config.json dict that an export keeps (none for another model
    type; the ones transformers writes itself are left to it)."""
    if not source or source.get("model_type") != model_type:
        return {}
    return {k: v for k, v in source.items() if k not in ("transformers_version", "architectures",
                                                         "_name_or_path")}


# ---------------------------------------------------------------- T5 v1.1 / FLAN-T5

def t5_args(config) -> ModelArgs:
    """ModelArgs of a transformers T5Config (T5 v1.1 / FLAN-T5); ConversionError for T5
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
    return ModelArgs(model="t5", num_layers=config.num_layers, hidden_size=config.d_model,
                     num_attention_heads=config.num_heads, ffn_hidden_size=config.d_ff,
                     vocab_size=config.vocab_size,
                     max_position_embeddings=getattr(config, "n_positions", 512),
                     decoder_num_layers=decoder_layers,
                     untie_embeddings_and_output_weights=True, normalization="RMSNorm",
                     layernorm_epsilon=config.layer_norm_epsilon, add_bias_linear=False,
                     gated_linear_unit=True, softmax_scale=1.0,
                     position_embedding_type="relative",
                     relative_attention_num_buckets=config.relative_attention_num_buckets,
                     relative_attention_max_distance=config.relative_attention_max_distance,
                     kv_channels=config.d_kv)


def pack_per_head(tensors: list[torch.Tensor], heads: int) -> torch.Tensor:
    """HF's separate projections [q], [k], [v] (rows = heads x d) -> megatron-core's rows
    grouped per head [q_h, k_h, v_h] (or [k_h, v_h] for cross-attention's linear_kv)."""
    d = tensors[0].shape[0] // heads
    stacked = torch.stack([t.reshape(heads, d, *t.shape[1:]) for t in tensors], dim=1)
    return stacked.reshape(len(tensors) * heads * d, *tensors[0].shape[1:])


def unpack_per_head(tensor: torch.Tensor, parts: int, heads: int) -> list[torch.Tensor]:
    """Inverse of pack_per_head."""
    d = tensor.shape[0] // (parts * heads)
    grouped = tensor.reshape(heads, parts, d, *tensor.shape[1:])
    return [grouped[:, i].reshape(heads * d, *tensor.shape[1:]) for i in range(parts)]


def _t5_layer(i: int, stack: str) -> tuple[str, str]:
    return f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."


def _t5_pairs(args: ModelArgs) -> list[tuple[str, str]]:
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
    for i in range(args.decoder_num_layers):
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


def _t5_packed(args: ModelArgs) -> list[tuple[list[str], str]]:
    """([HF names], our name) of the tensors packed from several HF ones: self-attention
    q, k, v; cross-attention k, v (per head); the gated MLP's wi_0, wi_1 (halves)."""
    packed = []
    for stack, layers, mlp in (("encoder", args.num_layers, "1"),
                               ("decoder", args.decoder_num_layers, "2")):
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


def full_state_from_t5(hf_state: Mapping[str, torch.Tensor], args: ModelArgs,
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


def t5_from_full_state(full: Mapping[str, torch.Tensor], args: ModelArgs,
                       where: str = "full state") -> dict[str, torch.Tensor]:
    """T5ForConditionalGeneration state dict from our T5's full state (padded vocabulary rows
    dropped)."""
    heads = args.num_attention_heads
    if not args.untie_embeddings_and_output_weights:     # a tied T5: its head is the embedding
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


def t5_config(args: ModelArgs, source: Mapping | None = None):
    """transformers T5Config (T5 v1.1 / FLAN-T5 style: untied, unscaled head) for a model of
    `args`; the fields that do not change the function (dropout, token ids, ...) are those of
    `source` (a config.json's dict) if given."""
    from transformers import T5Config
    defaults = dict(dropout_rate=0.0,
                    # T5's ids (T5SentencePieceTokenizer): the decoder starts from pad
                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    fields = dict(vocab_size=args.vocab_size, d_model=args.hidden_size,
                  d_kv=args.kv_channels or args.hidden_size // args.num_attention_heads,
                  d_ff=args.ffn_hidden_size, num_layers=args.num_layers,
                  num_decoder_layers=args.decoder_num_layers,
                  num_heads=args.num_attention_heads,
                  relative_attention_num_buckets=args.relative_attention_num_buckets,
                  relative_attention_max_distance=args.relative_attention_max_distance,
                  layer_norm_epsilon=args.layernorm_epsilon, feed_forward_proj="gated-gelu",
                  tie_word_embeddings=False)
    config = T5Config.from_dict({**defaults, **_kept_fields(source, "t5"), **fields})
    config.tie_word_embeddings = False       # transformers >= 5 sets True in __init__
    return config


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

ARGS_FILE = "model_args.json"             # ModelArgs, and the flags to train it with
SOURCE_CONFIG_FILE = "hf_config.json"     # the imported config.json, for export to keep


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


def hf_kind(config) -> str:
    """'gpt' for a GPT-2 config, 't5' for a T5 one; ConversionError otherwise."""
    kinds = {"gpt2": "gpt", "t5": "t5"}
    if config.model_type not in kinds:
        raise ConversionError(f"model_type {config.model_type!r}: only GPT-2 "
                              "(GPT2LMHeadModel) and T5 (T5ForConditionalGeneration) convert")
    return kinds[config.model_type]


def read_hf(directory: str, untie: bool = False) -> tuple[dict, ModelArgs]:
    """(full state, ModelArgs) of a transformers checkpoint directory (config.json plus
    safetensors / bin weights, as save_pretrained writes them; nothing is downloaded)."""
    from transformers import AutoConfig, GPT2LMHeadModel, T5ForConditionalGeneration
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    kind = hf_kind(config)
    if kind == "gpt":
        args = gpt2_args(config)
        untie = untie or not config.tie_word_embeddings      # a GPT-2 with its own lm_head
        args = ModelArgs(**{**args.as_dict(), "untie_embeddings_and_output_weights": untie})
        model = GPT2LMHeadModel.from_pretrained(directory, local_files_only=True,
                                                dtype=torch.float32)
        return full_state_from_gpt2(model.state_dict(), args, where=directory), args
    args = t5_args(config)    # T5 v1.1's head is untied whatever `untie` says
    model = T5ForConditionalGeneration.from_pretrained(directory, local_files_only=True,
                                                       dtype=torch.float32)
    return full_state_from_t5(model.state_dict(), args, where=directory), args


def write_hf(full: Mapping[str, torch.Tensor], args: ModelArgs, directory: str,
             source: Mapping | None = None) -> None:
    """Save our full state as a transformers checkpoint directory (save_pretrained): every
    tensor, the output layer too when it is untied, and a config that says so; the config's
    other fields are `source`'s (read_source_config) when given."""
    from transformers import GPT2LMHeadModel
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
    untied = args.untie_embeddings_and_output_weights
    missing, unexpected = model.load_state_dict(gpt2_from_full_state(full, args), strict=False)
    if set(missing) - (set() if untied else {"lm_head.weight"}) or unexpected:
        raise ConversionError(f"{directory}: GPT-2 export left {missing} unset and "
                              f"{unexpected} unused")
    if (model.lm_head.weight is model.transformer.wte.weight) == untied:
        raise ConversionError(f"{directory}: transformers built a head that is "
                              f"{'tied' if untied else 'untied'}, the checkpoint's is not")
    model.save_pretrained(directory)


def write_converted(full: Mapping[str, torch.Tensor], args: ModelArgs, directory: str,
                    source: Mapping | None = None) -> str:
    """Save a converted model for training, the one place where the on-disk form is chosen: a
    layout-free, model-only checkpoint (iteration 0) that `--load DIR --finetune` reads at any
    TP / PP / DP, plus its ModelArgs (the flags to train it with) and the source's config.json
    (`source`, which export keeps the other fields of). Returns the iteration directory."""
    import json
    import os

    from megatron.checkpoint.checkpointing import atomic_write, save_model_only_checkpoint
    os.makedirs(directory, exist_ok=True)
    signature = {"model": args.model, "num_layers": args.num_layers,
                 "decoder_num_layers": args.decoder_num_layers, "hidden_size": args.hidden_size,
                 "num_attention_heads": args.num_attention_heads,
                 "ffn_hidden_size": args.ffn_hidden_size,
                 "max_position_embeddings": args.max_position_embeddings,
                 # what a run must build alike (the flags of training_flags), so that a load
                 # with other flags is refused instead of training another function
                 "untie_embeddings_and_output_weights":
                     args.untie_embeddings_and_output_weights,
                 "normalization": args.normalization, "norm_epsilon": args.layernorm_epsilon,
                 "add_bias_linear": args.add_bias_linear,
                 "gated_linear_unit": args.gated_linear_unit,
                 "softmax_scale": args.softmax_scale, "kv_channels": args.kv_channels,
                 "position_embedding_type": args.position_embedding_type,
                 "relative_attention_num_buckets": args.relative_attention_num_buckets,
                 "relative_attention_max_distance": args.relative_attention_max_distance,
                 "vocab_size": args.vocab_size}
    folder = save_model_only_checkpoint(directory, 0, {n: t.contiguous() for n, t in full.items()},
                                        signature)

    def write_args(tmp):
        with open(tmp, "w") as f:
            json.dump(args.as_dict(), f, indent=1)
    atomic_write(os.path.join(directory, ARGS_FILE), write_args)
    if source is not None:
        def write_source(tmp):
            with open(tmp, "w") as f:
                json.dump(dict(source), f, indent=1)
        atomic_write(os.path.join(directory, SOURCE_CONFIG_FILE), write_source)
    return folder


def read_converted(directory: str, args_directory: str | None = None) -> tuple[dict, ModelArgs]:
    """(full state, ModelArgs) of a checkpoint for export: one written by write_converted, or a
    training run's (`--save`) with the ModelArgs of the converted directory it was fine-tuned
    from (`args_directory`); its model shape must be that of the ModelArgs."""
    import json
    import os

    from megatron.checkpoint.checkpointing import read_common, read_full_model_state
    args_file = os.path.join(args_directory or directory, ARGS_FILE)
    if not os.path.isfile(args_file):
        raise ConversionError(f"{args_file} not found: export reads the model flags from a "
                              "directory tools/convert_checkpoint.py wrote; for a training "
                              "run's checkpoint give --model-args DIR, the converted directory "
                              "it was fine-tuned from")
    with open(args_file) as f:
        args = ModelArgs(**json.load(f))
    saved = read_common(directory)["config"]
    differ = [f"{k} {saved[k]} (ModelArgs: {getattr(args, k)})" for k in sorted(saved)
              if k != "model" and getattr(args, k, saved[k]) != saved[k]]
    if saved.get("model") != args.model or differ:
        raise ConversionError(f"{directory} holds another model than {args_file} describes: "
                              f"{', '.join(differ) or saved.get('model')}")
    return read_full_model_state(directory), args
