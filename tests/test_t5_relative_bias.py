"""The T5 position bias built from relative positions (stages.relative_bias) equals
megatron-core's RelativePositionEmbedding._compute_bias in value and in the table's gradient."""
import pytest
import torch
from megatron.core.models.common.embeddings.relative_pos_embedding import (
    RelativePositionEmbedding,
)

from megatron.model.stages import relative_bias


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("n", [1, 7, 300])
def test_relative_bias_equals_megatron_core(bidirectional, n):
    torch.manual_seed(0)
    # float64: the two sum a bucket's gradient in different orders
    rel = RelativePositionEmbedding(bidirectional, torch.nn.init.normal_, 4, 32, 128).double()
    grad = torch.randn(1, 4, n, n, dtype=torch.float64)
    expected = rel._compute_bias(n, n)
    expected.backward(grad)
    want = rel.relative_attention_bias.weight.grad.clone()
    rel.zero_grad(set_to_none=True)
    got = relative_bias(rel, n)
    assert got.shape == expected.shape == (1, 4, n, n)
    assert torch.equal(got, expected)
    got.backward(grad)
    assert torch.allclose(rel.relative_attention_bias.weight.grad, want, rtol=1e-10, atol=1e-9)
    # the bias of a sample is the top-left block of a longer one's: shorter samples share it
    if n > 1:
        assert torch.equal(relative_bias(rel, n)[..., : n - 1, : n - 1],
                           relative_bias(rel, n - 1))
