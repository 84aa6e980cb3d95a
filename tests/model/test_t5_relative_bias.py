"""The T5 position bias built from relative positions (stages.relative_bias, a PositionBias)
equals megatron-core's RelativePositionEmbedding._compute_bias in value and in the table's
gradient, and its blocks are the full bias's top-left blocks."""
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
    got = relative_bias(rel, n).block(n, n)
    assert got.shape == expected.shape == (1, 4, n, n)
    assert torch.equal(got, expected)
    got.backward(grad)
    assert torch.allclose(rel.relative_attention_bias.weight.grad, want, rtol=1e-10, atol=1e-9)
    # a batched call of shorter segments takes the top-left block, rectangular ones too
    full = relative_bias(rel, n)
    for lq, lk in ((1, 1), (n, 1), (1, n), (max(1, n // 2), max(1, n // 3))):
        assert torch.equal(full.block(lq, lk), expected[..., :lq, :lk])
    with pytest.raises(ValueError, match="PositionBias.block"):
        full.block(n + 1, 1)
