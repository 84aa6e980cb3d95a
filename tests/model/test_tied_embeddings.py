"""Tied word embeddings (Megatron's default; issue 14): one Parameter within a stage, equal
copies across stages whose gradients GradBuffer sums, --untie-embeddings-and-output-weights for
separate weights; and the tanh GeLU that GPT-2 and megatron-core's fusion compute. The
multi-rank case (copies on two pipeline ranks, summed over tied_embedding_group) is covered by
tests/integration/test_equivalence.py's pp2 / tp2_pp2 / pp2_wave layouts against the one-stage model."""
import numpy as np
import pytest
import torch

from dynapipe_ext.costs.model_spec import ModelSpec
from megatron.model.batch_tensors import build_micro_batch, count_loss_tokens, \
    unsplit_micro_batch
from megatron.model.init_weights import initialize_stage_weights
from megatron.model.stages import (TIED_EMBEDDING, build_rank_stages, build_transformer_config,
                                   embedding_holders, gelu_tanh, stage_parameters)
from megatron.training.grad_buffer import GradBuffer
from tests.multiproc import single_process_world

GPT = ModelSpec("gpt", 2, 16, 2, 64, max_position_embeddings=32)
T5 = ModelSpec("t5", 2, 16, 2, 64, num_decoder_layers=2, max_position_embeddings=32)


@pytest.fixture(scope="module")
def world():
    torch.set_num_threads(1)
    with single_process_world(seed=5):
        yield


def samples_of(model, n=4):
    rng = np.random.default_rng(0)
    if model == "gpt":
        return {i: (rng.integers(1, 64, 9), rng.integers(1, 64, 9), np.ones(9, np.float32))
                for i in range(n)}
    return {i: (rng.integers(1, 64, 7), rng.integers(1, 64, 5), rng.integers(1, 64, 5),
                np.ones(5, np.float32)) for i in range(n)}


def build(spec, layout, tie=True):
    stages = build_rank_stages(spec, layout, 0, build_transformer_config(spec),
                               tie_embeddings=tie)
    initialize_stage_weights(stages, 7)
    return stages


def loss_backward(stages, spec):
    samples = samples_of(spec.model)
    batch = build_micro_batch(unsplit_micro_batch(sorted(samples), samples, spec.model),
                              samples, spec.model, 0)
    inputs = ()
    for s in sorted(stages):
        inputs = stages[s](inputs, batch)
    loss = (inputs * batch["loss_mask"]).sum() / count_loss_tokens(samples, sorted(samples))
    loss.backward()


@pytest.mark.parametrize("spec", [GPT, T5])
def test_one_stage_shares_one_parameter_and_untie_separates(world, spec):
    (stage,) = build(spec, (0,)).values()
    assert stage.head.output_layer.weight is stage.embedding.word_embeddings.weight
    if spec.model == "t5":
        assert stage.decoder_embedding.word_embeddings.weight is stage.head.output_layer.weight
    names = [n for n, _ in stage.named_global_parameters()]
    assert TIED_EMBEDDING in names and "output_layer.weight" not in names
    (untied,) = build(spec, (0,), tie=False).values()
    assert untied.head.output_layer.weight is not untied.embedding.word_embeddings.weight
    assert "output_layer.weight" in [n for n, _ in untied.named_global_parameters()]
    if spec.model == "t5":     # one input embedding for encoder and decoder, as in Megatron
        assert untied.decoder_embedding.word_embeddings.weight is \
            untied.embedding.word_embeddings.weight
    tied_count = sum(p.numel() for p in stage.parameters())
    assert sum(p.numel() for p in untied.parameters()) - tied_count == \
        spec.vocab_size * spec.hidden_size   # T5: the decoder embedding stays the encoder's


@pytest.mark.parametrize("spec", [GPT, T5])
def test_copies_in_other_stages_start_equal_and_get_the_summed_gradient(world, spec):
    """Two stages on one rank: each copy's main_grad after GradBuffer.finish is the gradient
    of the one-stage model's shared weight (the sum over every use)."""
    whole = build(spec, (0,))
    loss_backward(whole, spec)
    want = whole[0].embedding.word_embeddings.weight.grad

    cut = build(spec, (0, 0))
    copies = [p for _, p in stage_parameters(cut) if getattr(p, "tied_embedding", False)]
    assert len(copies) == 2 and all(torch.equal(c, copies[0]) for c in copies)
    assert [getattr(c, "shared", False) for c in copies] == [False, True]  # norm counts one
    buffer = GradBuffer({s: list(m.parameters()) for s, m in cut.items()})
    loss_backward(cut, spec)
    assert not torch.allclose(copies[0].main_grad, want, atol=1e-7)   # a part, before the sum
    buffer.finish()
    for c in copies:
        torch.testing.assert_close(c.main_grad, want, rtol=1e-5, atol=1e-7)


def test_copies_on_two_pipeline_ranks_need_the_tied_group(world):
    assert embedding_holders(GPT, (0, 1)) == (0, 1)
    gpt4 = ModelSpec("gpt", 4, 16, 2, 64, max_position_embeddings=32)
    assert embedding_holders(gpt4, (0, 1, 1, 0)) == (0,)      # wave: both ends on rank 0
    assert embedding_holders(T5, (0, 1, 2, 3)) == (0, 2, 3)   # decoder embedding on stage 2
    stages = build_rank_stages(GPT, (0, 1), 1, build_transformer_config(GPT))
    with pytest.raises(ValueError, match=r"copies on pipeline ranks \[0, 1\]; pass tied_group"):
        GradBuffer({s: list(m.parameters()) for s, m in stages.items()})
    untied = build_rank_stages(GPT, (0, 1), 1, build_transformer_config(GPT),
                               tie_embeddings=False)
    GradBuffer({s: list(m.parameters()) for s, m in untied.items()})


def test_unfused_gelu_is_the_tanh_approximation_of_the_fusion_and_gpt2():
    config = build_transformer_config(GPT, fused=False)
    assert config.activation_func is gelu_tanh
    x = torch.linspace(-4, 4, 101)
    from megatron.core.fusions.fused_bias_gelu import bias_gelu
    torch.testing.assert_close(gelu_tanh(x), bias_gelu(torch.zeros(()), x), rtol=1e-6,
                               atol=1e-6)
    assert not torch.allclose(gelu_tanh(x), torch.nn.functional.gelu(x), atol=1e-4)
    assert build_transformer_config(GPT, fused=True).activation_func is \
        torch.nn.functional.gelu   # what megatron-core fuses (as tanh GeLU)


def test_unfused_gelu_gradient_is_the_tanh_gelus():
    """gelu_tanh's own fp32 CPU kernel (sigmoid form) against torch's tanh GeLU in float64."""
    x = (torch.randn(4096, dtype=torch.float64) * 4).requires_grad_()
    grad = torch.randn_like(x)
    torch.nn.functional.gelu(x, approximate="tanh").backward(grad)
    ours = x.detach().float().requires_grad_()
    out = gelu_tanh(ours)
    out.backward(grad.float())
    torch.testing.assert_close(out.double(), torch.nn.functional.gelu(
        x.detach(), approximate="tanh"), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.grad.double(), x.grad, rtol=1e-5, atol=1e-5)


def test_untie_flag(tmp_path):
    from megatron.training.arguments import parse_args
    base = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--train-iters", "1", "--data-path", str(tmp_path / "x")]
    assert not parse_args("gpt", base, has_cuda=False).untie_embeddings_and_output_weights
    assert parse_args("gpt", base + ["--untie-embeddings-and-output-weights"],
                      has_cuda=False).untie_embeddings_and_output_weights


def test_cost_model_counts_a_tied_matrix_once_per_stage():
    import dataclasses

    from dynapipe_ext.costs.cost_model import AnalyticCostModel
    from dynapipe_ext.costs.cost_profile import profile_key
    tied = dataclasses.replace(GPT, tied_embeddings=True)
    vocab_bytes = GPT.vocab_size * GPT.hidden_size / 2 * 16
    untied_one = AnalyticCostModel(GPT, tp=2).model_state_bytes(1)
    assert AnalyticCostModel(tied, tp=2).model_state_bytes(1)[0] == untied_one[0] - vocab_bytes
    # on two stages each end holds its own copy, as in Megatron
    assert AnalyticCostModel(tied, tp=2).model_state_bytes(2) == \
        AnalyticCostModel(GPT, tp=2).model_state_bytes(2)
    t5 = dataclasses.replace(T5, tied_embeddings=True)
    assert AnalyticCostModel(T5).model_state_bytes(1)[0] - \
        AnalyticCostModel(t5).model_state_bytes(1)[0] == vocab_bytes * 2   # the head alone
    # per-kind profiles do not depend on tying, so existing profiles keep matching
    assert profile_key(tied, 1, "cpu", "float32") == profile_key(GPT, 1, "cpu", "float32")
