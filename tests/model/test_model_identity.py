"""The model is declared once (dynapipe_ext/costs/model_spec.py MODEL_OPTIONS): every option
reaches the ModelSpec from its flag, the model the stages build, and the identity a checkpoint
records and a load compares. An option added without reaching one of them fails here."""

import dataclasses

import numpy as np
import pytest
import torch

from dynapipe_ext.costs.model_spec import MODEL_OPTIONS, ModelSpec, option_arg
from megatron.checkpoint import checkpointing as ckpt
from megatron.training.arguments import FLAGS, TrainConfig, parse_args
from megatron.training.training import model_spec
from tests.multiproc import single_process_world

BASE = ["--train-iters", "10", "--data-path", "unused", "--num-layers", "2", "--hidden-size",
        "8", "--num-attention-heads", "2", "--seq-length", "16"]
ROPE = ["--position-embedding-type", "rope"]
# head size 4: wavelengths 6.3 and 628 tokens, the second between 1024 / 4 and 1024 / 1, where
# every scaling value moves it
SCALED = ROPE + ["--use-rope-scaling", "--rope-scaling-original-max-position-embeddings", "1024"]
# few buckets, so that distances within the test's samples are bucketed by the distance too
RELATIVE = ["--position-embedding-type", "relative", "--relative-attention-num-buckets", "8"]
# option -> (model, flags of the run it differs from, flags that change that option alone)
CHANGES = {
    "model": ("t5", [], []),            # the same flags through pretrain_t5.py
    "num_layers": ("gpt", [], ["--num-layers", "4"]),
    "hidden_size": ("gpt", [], ["--hidden-size", "16"]),
    "num_attention_heads": ("gpt", [], ["--num-attention-heads", "4"]),
    "num_decoder_layers": ("t5", [], ["--decoder-num-layers", "4"]),
    "ffn_hidden_size": ("gpt", [], ["--ffn-hidden-size", "24"]),
    "max_position_embeddings": ("gpt", [], ["--max-position-embeddings", "64"]),
    "tied_embeddings": ("gpt", [], ["--untie-embeddings-and-output-weights"]),
    "normalization": ("gpt", [], ["--normalization", "RMSNorm"]),
    "layernorm_epsilon": ("gpt", [], ["--norm-epsilon", "0.1"]),
    "add_bias_linear": ("gpt", [], ["--disable-bias-linear"]),
    "add_qkv_bias": ("gpt", ["--disable-bias-linear"], ["--add-qkv-bias"]),
    "gated_linear_unit": ("gpt", [], ["--gated-gelu"]),
    "swiglu": ("gpt", [], ["--swiglu"]),
    "softmax_scale": ("gpt", [], ["--softmax-scale", "1.0"]),
    "position_embedding_type": ("gpt", [], ROPE),
    "relative_attention_num_buckets": ("t5", RELATIVE, ["--relative-attention-num-buckets", "4"]),
    "relative_attention_max_distance": ("t5", RELATIVE,
                                        ["--relative-attention-max-distance", "8"]),
    "rotary_base": ("gpt", ROPE, ["--rotary-base", "100"]),
    "rotary_percent": ("gpt", ROPE, ["--rotary-percent", "0.5"]),
    "use_rope_scaling": ("gpt", ROPE, SCALED[2:]),   # (8192 would leave both wavelengths be)
    "rope_scaling_factor": ("gpt", SCALED, ["--rope-scaling-factor", "2"]),
    "rope_scaling_low_freq_factor": ("gpt", SCALED, ["--rope-scaling-low-freq-factor", "2"]),
    "rope_scaling_high_freq_factor": ("gpt", SCALED, ["--rope-scaling-high-freq-factor", "8"]),
    "rope_scaling_original_max_position_embeddings": (
        "gpt", SCALED, ["--rope-scaling-original-max-position-embeddings", "16"]),
    "kv_channels": ("gpt", [], ["--kv-channels", "8"]),
    "num_query_groups": ("gpt", ["--group-query-attention", "--num-query-groups", "2"],
                         ["--num-query-groups", "1"]),
}


def configs(name):
    """(the run without the change, the run with it) of option `name`."""
    model, before, change = CHANGES[name]
    first = "gpt" if name == "model" else model
    return (parse_args(first, BASE + before, has_cuda=False),
            parse_args(model, BASE + before + change, has_cuda=False))


def test_every_option_has_a_change_here_a_flag_and_a_config_field():
    names = [f.name for f in MODEL_OPTIONS]
    assert sorted(CHANGES) == sorted(names)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    declared = {f.name for f in FLAGS} | {"the model (pretrain_gpt.py / pretrain_t5.py)"}
    for option in MODEL_OPTIONS:
        assert option_arg(option) in fields, option.name
        assert option.metadata["flag"] in declared, option.name


@pytest.mark.parametrize("name", list(CHANGES))
def test_an_option_reaches_the_model_spec_and_the_checkpoint_identity(name):
    before, after = configs(name)
    specs = [model_spec(cfg, 100) for cfg in (before, after)]
    assert getattr(specs[0], name) != getattr(specs[1], name)
    diffs = ckpt.signature_differences(ckpt.model_signature(before), ckpt.model_signature(after))
    flag = ckpt.FLAG_NAMES[option_arg(next(f for f in MODEL_OPTIONS if f.name == name))]
    assert any(d.startswith(f"{flag}: saved ") for d in diffs), (flag, diffs)


@pytest.fixture(scope="module")
def world():
    torch.set_num_threads(1)
    with single_process_world(seed=5):
        yield


def built_model(spec: ModelSpec):
    """(parameter names and shapes, per-token losses of a fixed two-sample packed row)."""
    from dynapipe_ext.batching.microbatch import MicroBatch
    from megatron.model.batch_tensors import build_micro_batch
    from megatron.model.init_weights import initialize_stage_weights
    from megatron.model.stages import build_rank_stages, build_transformer_config
    stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec),
                               tie_embeddings=spec.tied_embeddings)
    initialize_stage_weights(stages, 7)
    rng = np.random.default_rng(0)
    if spec.model == "gpt":
        samples = {i: (rng.integers(1, 100, n), rng.integers(1, 100, n), np.ones(n, np.float32))
                   for i, n in enumerate((9, 6))}
        mb = MicroBatch(rows=((0, 1),), seq_len=16)
    else:
        samples = {i: (rng.integers(1, 100, 7), rng.integers(1, 100, 5),
                       rng.integers(1, 100, 5), np.ones(5, np.float32)) for i in range(2)}
        mb = MicroBatch(rows=((0, 1),), seq_len=16, dec_seq_len=12)
    with torch.no_grad():
        losses = stages[0]((), build_micro_batch(mb, samples, spec.model, 0))
    shapes = {n: tuple(p.shape) for n, p in stages[0].named_global_parameters()}
    return shapes, losses


@pytest.mark.parametrize("name", [n for n in CHANGES if n != "model"])
def test_an_option_changes_the_model_the_stages_build(world, name):
    """What each option's flag builds differs from the model without it: other parameters,
    or other losses from the same weights."""
    before, after = (built_model(model_spec(cfg, 100)) for cfg in configs(name))
    assert before[0] != after[0] or not torch.equal(before[1], after[1]), name
