"""Stage modules in one process: a model cut into pipeline stages computes what the uncut model
computes, with identical weights, and packed rows equal their samples run alone."""

import dataclasses

import numpy as np
import pytest
import torch

from dynapipe_ext.batching.microbatch import MicroBatch
from dynapipe_ext.costs.model_spec import GPT_ATTENTION, ModelSpec
from megatron.model.batch_tensors import build_micro_batch, unsplit_micro_batch
from megatron.model.init_weights import initialize_stage_weights
from megatron.model.stages import TIED_EMBEDDING, build_rank_stages, build_transformer_config
from megatron.base.distributed_setup import check_parallel_sizes
from tests.multiproc import single_process_world

GPT = ModelSpec("gpt", 4, 32, 4, 64, max_position_embeddings=64)
T5 = ModelSpec("t5", 2, 32, 4, 64, num_decoder_layers=2, max_position_embeddings=64)
# Llama-style: RMSNorm, rotary positions, SwiGLU, grouped-query attention, q/k/v biases only
LLAMA = dataclasses.replace(GPT, normalization="RMSNorm", position_embedding_type="rope",
                            swiglu=True, num_query_groups=2, add_bias_linear=False,
                            add_qkv_bias=True, ffn_hidden_size=48)


@pytest.fixture(scope="module")
def world():
    torch.set_num_threads(1)
    with single_process_world(seed=5):
        yield


def random_samples(model, n, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        if model == "gpt":
            length = int(rng.integers(3, 17))
            out[i] = (rng.integers(1, 64, length), rng.integers(1, 64, length),
                      np.ones(length, np.float32))
        else:
            le, ld = int(rng.integers(3, 13)), int(rng.integers(2, 9))
            out[i] = (rng.integers(1, 64, le), rng.integers(1, 64, ld), rng.integers(1, 64, ld),
                      np.ones(ld, np.float32))
    return out


def build(spec, num_stages, seed=11):
    config = build_transformer_config(spec)
    stages = build_rank_stages(spec, tuple([0] * num_stages), 0, config)
    initialize_stage_weights(stages, seed)
    return stages


def run_chain(stages, batch):
    """Forward through the stages in order, detaching at every boundary as the executor does."""
    inputs = ()
    for s in sorted(stages):
        out = stages[s](inputs, batch)
        inputs = tuple(t.detach() for t in out) if isinstance(out, tuple) else out
    return inputs


@pytest.mark.parametrize("spec,num_stages", [(GPT, 2), (GPT, 4), (T5, 2), (T5, 4),
                                             (LLAMA, 4)])
def test_cut_model_matches_uncut_model(world, spec, num_stages):
    samples = random_samples(spec.model, 5)
    batch = build_micro_batch(unsplit_micro_batch(list(samples), samples, spec.model),
                              samples, spec.model, 0)
    whole, cut = build(spec, 1), build(spec, num_stages)
    whole_params = dict(whole[0].named_global_parameters())
    cut_params = {n: p for s in cut.values() for n, p in s.named_global_parameters()}
    assert sorted(whole_params) == sorted(cut_params)
    for name, p in whole_params.items():
        assert torch.equal(p, cut_params[name]), name
    with torch.no_grad():
        torch.testing.assert_close(run_chain(cut, batch), run_chain(whole, batch),
                                   rtol=1e-6, atol=1e-6)


def _loss_and_grads(stages, batch):
    """Mean loss through the stage chain and every parameter's gradient by global name, with
    each stage's input gradient handed back as the executor does."""
    inputs, chain = (), []
    for s in sorted(stages):
        inputs = tuple(t.detach().requires_grad_() for t in inputs)
        out = stages[s](inputs, batch)
        chain.append((inputs, out))
        inputs = out
    loss = (inputs * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    for k in range(len(chain) - 2, -1, -1):
        torch.autograd.backward(chain[k][1], tuple(t.grad for t in chain[k + 1][0]))
    return loss.detach(), {n: p.grad for m in stages.values()
                           for n, p in m.named_global_parameters()}


@pytest.mark.parametrize("cut, base", [((5, 3), GPT), ((3, 5), GPT), ((1, 2, 4, 1), GPT),
                                       ((2, 2, 2, 2), GPT), ((1, 2, 4, 1), LLAMA)])
def test_half_layer_cut_matches_uncut_model_exactly(world, cut, base):
    """A GPT cut between a layer's attention and MLP (ModelSpec.pipeline_cut) holds each
    parameter once and gives the same loss and gradients, bit for bit, as the uncut model."""
    samples = random_samples("gpt", 5, seed=4)
    batch = build_micro_batch(unsplit_micro_batch(list(samples), samples, "gpt"),
                              samples, "gpt", 0)
    spec = dataclasses.replace(base, pipeline_cut=cut)
    whole, split = build(base, 1), build(spec, len(cut))
    names = [n for m in split.values() for n, _ in m.named_global_parameters()]
    assert set(names) == {n for n, _ in whole[0].named_global_parameters()}
    layers = [n for n in names if n.startswith("decoder.layers.")]
    assert len(layers) == len(set(layers))     # no half layer's weights on two stages
    loss_whole, grads_whole = _loss_and_grads(whole, batch)
    loss_split, grads_split = _loss_and_grads(split, batch)
    assert torch.equal(loss_split, loss_whole)
    for name, grad in grads_whole.items():
        if name != TIED_EMBEDDING:   # its copies' gradients are summed by the GradBuffer
            assert torch.equal(grads_split[name], grad), name
    kinds = spec.stage_layers(len(cut))
    assert [split[s].kinds for s in sorted(split)] == kinds
    assert any(GPT_ATTENTION in k for k in kinds) == any(c % 2 for c in cut)


def test_stage_kinds_follow_model_spec(world):
    stages = build(T5, 4)
    assert stages[0].embedding is not None and stages[0].encoder is not None
    assert stages[2].encoder_norm is not None and stages[2].decoder_embedding is not None
    assert stages[3].head is not None and stages[1].head is None
    assert [n for n, _ in stages[3].named_global_parameters()][0].startswith("decoder.layers.1.")


@pytest.mark.parametrize("spec", [GPT, T5, LLAMA])
def test_packed_row_equals_samples_alone(world, spec):
    samples = random_samples(spec.model, 2, seed=3)
    stages = build(spec, 1)
    alone = build_micro_batch(unsplit_micro_batch([0, 1], samples, spec.model),
                              samples, spec.model, 0)
    seq = sum(len(samples[s][0]) for s in (0, 1)) + 2
    dec = sum(len(samples[s][1]) for s in (0, 1)) + 1 if spec.model == "t5" else 0
    packed = build_micro_batch(MicroBatch(rows=((0, 1),), seq_len=seq, dec_seq_len=dec),
                               samples, spec.model, 0)
    with torch.no_grad():
        loss_alone = run_chain(stages, alone)
        loss_packed = run_chain(stages, packed)
    target_len = [len(samples[s][1 if spec.model == "gpt" else 2]) for s in (0, 1)]
    expected = torch.cat([loss_alone[0, :target_len[0]], loss_alone[1, :target_len[1]]])
    torch.testing.assert_close(loss_packed[0, :sum(target_len)], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", [T5, LLAMA])
def test_gradients_flow_to_every_parameter(world, spec):
    samples = random_samples(spec.model, 3)
    stages = build(spec, 1)
    batch = build_micro_batch(unsplit_micro_batch(list(samples), samples, spec.model), samples,
                              spec.model, 0)
    losses = stages[0]((), batch)
    ((losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()
    no_grad = [n for n, p in stages[0].named_global_parameters()
               if p.grad is None or not p.grad.abs().sum() > 0]
    # only never-used position rows would be zero; the parameters themselves all get gradients
    assert no_grad == []


def test_uneven_layouts_are_clear_errors():
    with pytest.raises(ValueError, match="not divisible by tensor-parallel size 2"):
        check_parallel_sizes(6, 2, 2)
    with pytest.raises(ValueError, match="4 transformer layers do not split evenly over 3"):
        check_parallel_sizes(3, 1, 3, total_layers=4)
    with pytest.raises(ValueError, match="vocabulary size 63"):
        check_parallel_sizes(2, 2, 1, vocab_size=63)
    assert check_parallel_sizes(8, 2, 2) == 2
    with pytest.raises(ValueError, match="do not split evenly"):
        build_rank_stages(GPT, (0, 0, 0), 0, build_transformer_config(GPT))
