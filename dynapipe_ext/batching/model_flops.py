"""Model FLOPs of training on real tokens, and the FLOPs a micro-batch actually computes: the
numerator of MFU (model FLOPs utilisation) and its padding loss.

Counted (multiply-add = 2 FLOPs; training = forward + backward = 3 x forward, recompute not
counted, as in Megatron's MFU): the transformer layers' linear layers (QKV, attention output,
MLP; T5 decoder layers also the cross-attention's Q, KV and output), attention scores and
their weighted sum, and the output layer (padded vocabulary, what is computed). Not counted:
embeddings, norms, activations, softmax, the loss (non-GEMM work, a share of the time MFU
leaves out). Causal attention counts the pairs a sample needs, n(n+1)/2 per sequence of n
(the fused kernels skip the blocks above the diagonal); bidirectional and cross-attention
count every pair.

Real FLOPs take every sample alone at its own length. Computed FLOPs take a micro-batch as it
runs: linear and output layers over every token slot (pads included); attention per row over
the padded length when the row holds one sample, per sample when it is packed and attention
runs per segment ("segments"), and over the whole row when packed rows run one call with a
block-diagonal mask ("mask": every pair, causal or not).
"""
from __future__ import annotations

import numpy as np

from dynapipe_ext.batching.microbatch import MicroBatch
from dynapipe_ext.costs.model_spec import ModelSpec


def _per_token_linear(spec: ModelSpec) -> tuple[float, float, float]:
    """Forward FLOPs per token of (a self-attention layer's linears, a decoder layer's extra
    cross-attention linears on decoder tokens, the cross-attention K and V per encoder
    token); the MLP is in the first."""
    h, f, p = spec.hidden_size, spec.ffn_size, spec.attention_width
    kv = spec.query_groups * spec.head_dim     # K and V: one head per query group
    mlp = (3 if spec.gated_mlp else 2) * h * f
    return 2.0 * (h * p + 2 * h * kv + p * h + mlp), 2.0 * (2 * h * p), 2.0 * (2 * h * kv)


def _forward_flops(spec: ModelSpec, enc_tokens, dec_tokens, enc_pairs, dec_pairs,
                   cross_pairs):
    """Forward FLOPs from token counts and attention pair counts (arrays or floats)."""
    layer, cross_q_out, cross_kv = _per_token_linear(spec)
    p = spec.attention_width
    head = 2.0 * spec.hidden_size * spec.vocab_size
    if spec.model == "gpt":
        return spec.num_layers * (layer * enc_tokens + 4.0 * p * enc_pairs) + head * enc_tokens
    encoder = spec.num_layers * (layer * enc_tokens + 4.0 * p * enc_pairs)
    decoder = spec.num_decoder_layers * ((layer + cross_q_out) * dec_tokens
                                         + cross_kv * enc_tokens
                                         + 4.0 * p * (dec_pairs + cross_pairs))
    return encoder + decoder + head * dec_tokens


def _causal(n):
    return n * (n + 1) / 2.0


def real_flops(spec: ModelSpec, lengths) -> float:
    """Training FLOPs of these samples, each alone at its own length: `lengths` (n,) GPT
    tokens or (n, 2) T5 (encoder, decoder) tokens."""
    arr = np.asarray(lengths, dtype=np.float64)
    if spec.model == "gpt":
        n = arr.reshape(-1)
        fwd = _forward_flops(spec, n, 0.0, _causal(n), 0.0, 0.0)
    else:
        arr = arr.reshape(-1, 2)
        e, d = arr[:, 0], arr[:, 1]
        fwd = _forward_flops(spec, e, d, e * e, _causal(d), d * e)
    return 3.0 * float(np.sum(fwd))


def computed_flops(spec: ModelSpec, mb: MicroBatch, lengths, packed_attention: str = "segments"
                   ) -> float:
    """Training FLOPs micro-batch `mb` computes, pads included (module docstring);
    `lengths[sample id]` as in real_flops."""
    if packed_attention not in ("segments", "mask"):
        raise ValueError(f"packed_attention must be 'segments' or 'mask', got "
                         f"{packed_attention!r}")
    arr = np.asarray(lengths, dtype=np.float64)
    arr = arr.reshape(len(arr), -1)
    S, D = float(mb.seq_len), float(mb.dec_seq_len)
    enc_pairs = dec_pairs = cross_pairs = 0.0
    for row in mb.rows:
        e, d = arr[list(row), 0], (arr[list(row), 1] if arr.shape[1] > 1 else None)
        if len(row) > 1 and packed_attention == "segments":
            enc_pairs += float(np.sum(_causal(e) if spec.model == "gpt" else e * e))
            if d is not None:
                dec_pairs += float(np.sum(_causal(d)))
                cross_pairs += float(np.sum(d * e))
        elif len(row) > 1:        # one call over the whole row with a dense mask
            enc_pairs += S * S
            dec_pairs += D * D
            cross_pairs += D * S
        else:                     # one sample, right-padded: the kernel runs the padded length
            enc_pairs += _causal(S) if spec.model == "gpt" else S * S
            dec_pairs += _causal(D)
            cross_pairs += D * S
    rows = float(mb.num_rows)
    return 3.0 * float(_forward_flops(spec, rows * S, rows * D, enc_pairs, dec_pairs,
                                      cross_pairs))
