"""Cost model interface: time and memory of one micro-batch shape on each pipeline stage."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dynapipe_ext.costs.model_spec import (DEC_EMBEDDING, DEC_LAYER, EMBEDDING, ENC_LAYER, ENC_NORM,
                         GPT_ATTENTION, GPT_LAYER, GPT_MLP, HEAD, ModelSpec)

# Transformer layer kinds and how much of a whole layer each is (weight of the per-layer
# overhead); WHOLE_LAYER maps a half-layer kind to the layer it is half of.
LAYER_UNITS = {GPT_LAYER: 1.0, ENC_LAYER: 1.0, DEC_LAYER: 1.0, GPT_ATTENTION: 0.5, GPT_MLP: 0.5}
WHOLE_LAYER = {GPT_ATTENTION: GPT_LAYER, GPT_MLP: GPT_LAYER}


@dataclass(frozen=True)
class StageCost:
    fwd_ms: float
    bwd_ms: float
    activation_bytes: int   # kept from forward until backward
    peak_bytes: int         # transient peak above the kept activations during fwd/bwd


@dataclass(frozen=True)
class StageCostArrays:
    """Vectorised stage costs: every field has shape (num_stages, n) for n shapes; `feasible`
    (shape (n,)) is False where the model does not know the shape (its other entries are then
    meaningless)."""

    fwd_ms: np.ndarray
    bwd_ms: np.ndarray
    activation_bytes: np.ndarray
    peak_bytes: np.ndarray
    feasible: np.ndarray


class CostModel:
    """Answers per-stage costs of micro-batch shapes (rows, seq_len, dec_seq_len) under a
    recompute mode; a shape outside what the model knows is infeasible (None). Subclasses
    implement `stage_cost_arrays` or `stage_costs` (each defaults to the other)."""

    def stage_cost_arrays(self, rows: np.ndarray, seq_len: np.ndarray, dec_seq_len: np.ndarray,
                          num_stages: int, recompute: str = "none") -> StageCostArrays:
        """Costs of n shapes at once on each of `num_stages` (virtual) stages, cut by
        ModelSpec.stage_layers. A model overrides this (vectorised) or `stage_costs`; this
        default asks `stage_costs` once per distinct shape."""
        shapes = np.stack([np.asarray(rows), np.asarray(seq_len),
                           np.broadcast_to(np.asarray(dec_seq_len), np.shape(rows))], axis=1)
        uniq, inverse = np.unique(shapes.astype(np.int64), axis=0, return_inverse=True)
        table = np.zeros((4, num_stages, len(uniq)))
        feasible = np.zeros(len(uniq), dtype=bool)
        for u, (r, s, d) in enumerate(uniq):
            costs = self.stage_costs(int(r), int(s), int(d), num_stages, recompute)
            if costs is None:
                continue
            feasible[u] = True
            table[:, :, u] = [[c.fwd_ms for c in costs], [c.bwd_ms for c in costs],
                              [c.activation_bytes for c in costs], [c.peak_bytes for c in costs]]
        inverse = inverse.reshape(-1)
        return StageCostArrays(table[0][:, inverse], table[1][:, inverse], table[2][:, inverse],
                               table[3][:, inverse], feasible[inverse])

    def stage_costs(self, rows: int, seq_len: int, dec_seq_len: int, num_stages: int,
                    recompute: str = "none") -> list[StageCost] | None:
        """Costs of one shape on each stage, or None when it is infeasible."""
        arr = self.stage_cost_arrays(np.array([rows]), np.array([seq_len]),
                                     np.array([dec_seq_len]), num_stages, recompute)
        if not arr.feasible[0]:
            return None
        return [StageCost(float(arr.fwd_ms[k, 0]), float(arr.bwd_ms[k, 0]),
                          int(round(arr.activation_bytes[k, 0])), int(round(arr.peak_bytes[k, 0])))
                for k in range(num_stages)]

    # Memory: a model sets `device_memory_bytes` and `num_stages` and answers model_state_bytes.
    device_memory_bytes: float
    num_stages: int = 1
    # FlexTP (--tp-balance): a rank's slot layers hold up to this share of the even TP split
    # of every transformer layer's weights, their gradients and optimizer state
    # (--tp-balance-max-share); 1 without FlexTP
    tp_slot_share: float = 1.0

    def model_state_bytes(self, num_stages: int) -> list[float]:
        """Parameter + gradient + optimizer bytes of each of `num_stages` stages (one TP rank)."""
        raise NotImplementedError

    def activation_memory_limit(self, num_stages: int | None = None,
                                stage_to_rank: tuple[int, ...] | None = None) -> float:
        """Bytes per device available for activations: device memory minus the model states
        of the heaviest rank, the model cut into `num_stages` stages (default: the model's
        own count), stage s on rank `stage_to_rank[s]` (default: every stage on its own)."""
        states = self.model_state_bytes(num_stages or self.num_stages)
        ranks = stage_to_rank or tuple(range(len(states)))
        if len(ranks) != len(states):
            raise ValueError(f"stage_to_rank has {len(ranks)} entries for {len(states)} stages")
        per_rank: dict[int, float] = {}
        for stage, rank in enumerate(ranks):
            per_rank[rank] = per_rank.get(rank, 0.0) + states[stage]
        return self.device_memory_bytes - max(per_rank.values())


class RankCostModel(CostModel):
    """`inner`'s stages folded onto the pipeline ranks that run them (`stage_to_rank`, e.g.
    Hanayo's waves or Megatron's interleaving): "stage" r of this model is pipeline rank r,
    whose forward and backward times and kept activations are the sums over its stages and
    whose transient peak is the largest of theirs; its model states are its stages' together.
    A planner that prices one stage per rank (the micro-batch split) so sees each rank's
    whole work per micro-batch on any layout and under any pipeline cut of all the stages."""

    def __init__(self, inner: CostModel, stage_to_rank: tuple[int, ...]):
        self.inner, self.stage_to_rank = inner, tuple(stage_to_rank)
        self.num_stages = max(self.stage_to_rank) + 1
        if sorted(set(self.stage_to_rank)) != list(range(self.num_stages)):
            raise ValueError(f"stage_to_rank {self.stage_to_rank} leaves a rank without stages")
        self.device_memory_bytes = inner.device_memory_bytes
        self.tp_slot_share = inner.tp_slot_share
        self._stages_of = [[s for s, r in enumerate(self.stage_to_rank) if r == rank]
                           for rank in range(self.num_stages)]

    def _ranks(self, num_stages: int) -> None:
        if num_stages != self.num_stages:
            raise ValueError(f"this cost model prices the {self.num_stages} pipeline ranks of "
                             f"its layout, not {num_stages} stages")

    def stage_cost_arrays(self, rows, seq_len, dec_seq_len, num_stages: int,
                          recompute: str = "none") -> StageCostArrays:
        self._ranks(num_stages)
        arr = self.inner.stage_cost_arrays(rows, seq_len, dec_seq_len, len(self.stage_to_rank),
                                           recompute)

        def fold(x, combine):
            return np.stack([combine(x[stages], axis=0) for stages in self._stages_of])

        return StageCostArrays(fold(arr.fwd_ms, np.sum), fold(arr.bwd_ms, np.sum),
                               fold(arr.activation_bytes, np.sum), fold(arr.peak_bytes, np.max),
                               arr.feasible)

    def model_state_bytes(self, num_stages: int) -> list[float]:
        self._ranks(num_stages)
        states = self.inner.model_state_bytes(len(self.stage_to_rank))
        return [float(sum(states[s] for s in stages)) for stages in self._stages_of]


def shape_feasible(model: str, rows: np.ndarray, seq_len: np.ndarray, dec_seq_len: np.ndarray,
                   max_seq_len: int | None, max_dec_seq_len: int | None) -> np.ndarray:
    """Which shapes a model defined up to these max lengths can cost (non-empty, not longer)."""
    feasible = (rows >= 1) & (seq_len >= 1)
    if model == "t5":
        feasible &= dec_seq_len >= 1
        if max_dec_seq_len is not None:
            feasible &= dec_seq_len <= max_dec_seq_len
    if max_seq_len is not None:
        feasible &= seq_len <= max_seq_len
    return feasible


# ------------------------------------------------------------------ analytic (FLOP / byte) model

class LayerTerms(NamedTuple):
    """Cost terms of a transformer layer (or half layer) before a recompute mode combines
    them: flops of its linear layers and of its attention core, bytes kept outside / inside
    the attention core, transient bytes, and the bytes of its input (all that 'full'
    recompute keeps of a checkpoint unit)."""

    lin: np.ndarray
    att: np.ndarray
    kept_lin: np.ndarray
    kept_att: np.ndarray
    transient: np.ndarray
    layer_in: np.ndarray

    def plus(self, later: "LayerTerms") -> "LayerTerms":
        """This part followed by `later` as one checkpoint unit: terms add, the input is this
        part's."""
        return LayerTerms(*(x + y for x, y in zip(self[:-1], later[:-1])), self.layer_in)

    def under(self, recompute: str, zero):
        """(fwd flops, extra recompute flops, kept bytes, transient bytes) under `recompute`:
        'selective' recomputes the attention core, 'full' the whole unit from its input."""
        fwd = self.lin + self.att
        if recompute == "none":
            return fwd, zero, self.kept_lin + self.kept_att, self.transient
        if recompute == "selective":
            return fwd, self.att, self.kept_lin, self.transient + self.kept_att
        return fwd, fwd, self.layer_in, self.transient + self.kept_lin + self.kept_att


class AnalyticCostModel(CostModel):
    """Costs from FLOPs and activation bytes, for tests and for planning before a profile exists.

    Time: linear layers ~ tokens*h^2, attention ~ rows*s^2*h (T5 cross-attention
    ~ rows*s_enc*s_dec*h), output layer ~ tokens*h*vocab, all divided by `tp` and by the
    rate device_flops * tokens / (tokens + half_rate_tokens) (small micro-batches use a
    device poorly) / (1 + tokens / cache_tokens) (large ones outgrow the caches: a CPU's
    case; None, the default, leaves it out); backward = 2x forward, plus the recomputed
    forward part ('selective': the attention core, 'full': whole transformer layers). Kept
    activations per layer follow Korthikanti et al. (arXiv 2205.05198), ~ s*b*h*(34 + 5*a*s/h)
    bytes at 2-byte precision (scaled by dtype_bytes/2) with dropout; without
    (`dropout=False`, how the trainer builds its layers) the 1-byte dropout masks and the
    dropped-out attention copy go:
    ~ s*b*h*(32 + 2*a*s/h). The trainer's attention (SDPA, fused kernels) keeps no s^2
    tensor for backward at all, only a float32 log-sum-exp per query and head, so the s^2
    terms are replaced by that (`fused_attention=False` restores them for an unfused
    attention). 'selective' drops the attention's kept terms, 'full' keeps only the layer
    input. A stage that sends its output on also keeps it until its backward (the
    handlers hold it for autograd). `full_recompute` says how 'full' recomputes: "layer", one
    checkpoint per transformer layer (megatron-core on GPU), or "stage", the whole stage in one
    checkpoint (the trainer's CPU path): it keeps only the stage's input and output, and its
    backward re-materialises every layer of the stage at once. `sigmoid_gelu`: the MLP's tanh
    GeLU runs as x * sigmoid(2z) (megatron/model/stages.py, fp32 on CPU): it saves only its
    input for backward, as torch's kernel does, but its backward holds two [tokens, ffn]
    temporaries more (sigmoid and du/dx beside the result; measured in
    tests/training/test_memory_bench.py), counted in the transient bytes. Shapes longer than
    `max_seq_len` / `max_dec_seq_len` are infeasible.

    Host floor: launching a layer's kernels costs the host `host_fwd_ms_per_layer` /
    `host_bwd_ms_per_layer` whatever the micro-batch's size; host and device overlap, so a
    stage's forward (backward) takes max(host floor of its layers, device time), never
    their sum. It is what makes many small micro-batches slow on a GPU (0 = not modelled,
    the CPU's case: there the host is the device).

    GPT half layers (ModelSpec.pipeline_cut): GPT_ATTENTION has the QKV / projection linears,
    the s^2 attention flops, the attention core's kept and transient bytes, and Korthikanti's
    attention-block share of the rest (its norm and QKV inputs, Q, K, V and the projection
    input); GPT_MLP has the MLP linears, its norm and fc1 inputs, the fc1 / activation outputs
    and the MLP transient. A whole GPT layer is computed as the sum of the two, so they add
    up to it exactly in flops, recompute flops, kept bytes, transient bytes and parameters -
    except kept bytes under 'full' recompute: each half is its own checkpoint unit and keeps
    its own input, so the two keep 2 x layer input where the whole layer keeps one. A half
    counts as half a layer in the per-layer overhead."""

    def __init__(self, spec: ModelSpec, tp: int = 1, device_flops: float = 1e12,
                 device_mem_bytes: float = 16 * 2**30, bytes_per_param_state: float = 16,
                 dtype_bytes: int = 4, max_seq_len: int | None = None,
                 max_dec_seq_len: int | None = None, layer_overhead_ms: float = 0.01,
                 half_rate_tokens: float = 512.0, cache_tokens: float | None = None,
                 num_stages: int = 1,
                 dropout: bool = False, full_recompute: str = "layer",
                 fused_attention: bool = True, sigmoid_gelu: bool = False,
                 host_fwd_ms_per_layer: float = 0.0, host_bwd_ms_per_layer: float = 0.0,
                 tp_slot_share: float = 1.0):
        if tp < 1 or spec.num_attention_heads % tp:
            raise ValueError(f"tp={tp} must be >= 1 and divide num_attention_heads "
                             f"{spec.num_attention_heads}")
        if full_recompute not in ("layer", "stage"):
            raise ValueError(f"full_recompute must be 'layer' or 'stage', got {full_recompute!r}")
        if device_flops <= 0 or device_mem_bytes <= 0:
            raise ValueError("device_flops and device_mem_bytes must be positive")
        self.spec = spec
        self.tp = tp
        self.tp_slot_share = float(tp_slot_share)
        self.device_flops = float(device_flops)
        self.device_memory_bytes = float(device_mem_bytes)
        self.bytes_per_param_state = float(bytes_per_param_state)
        self.dtype_bytes = dtype_bytes
        self.max_seq_len = max_seq_len
        self.max_dec_seq_len = max_dec_seq_len
        self.layer_overhead_ms = layer_overhead_ms
        self.half_rate_tokens = float(half_rate_tokens)
        if cache_tokens is not None and not cache_tokens > 0:
            raise ValueError(f"cache_tokens must be positive or None, got {cache_tokens}")
        self.cache_tokens = cache_tokens
        self.num_stages = num_stages
        self.dropout = dropout
        self.full_recompute = full_recompute
        self.fused_attention = fused_attention
        self.sigmoid_gelu = sigmoid_gelu
        if host_fwd_ms_per_layer < 0 or host_bwd_ms_per_layer < 0:
            raise ValueError("host_fwd_ms_per_layer and host_bwd_ms_per_layer must be >= 0")
        self.host_ms_per_layer = (float(host_fwd_ms_per_layer), float(host_bwd_ms_per_layer))

    # ---- model states
    @property
    def mlp_matrices(self) -> int:
        """h x f matrices of the MLP: 2, or 3 with a gated linear unit (fc1 has 2f rows)."""
        return 3 if self.spec.gated_mlp else 2

    def layer_params(self, kind: str) -> float:
        """Parameters of one layer kind held by one tensor-parallel rank, linear biases
        included (norms: 2 h per norm kind, as before)."""
        h, f, v, tp = self.spec.hidden_size, self.spec.ffn_size, self.spec.vocab_size, self.tp
        m = self.mlp_matrices
        positions = (self.spec.max_position_embeddings * h
                     if self.spec.position_embedding_type == "learned_absolute" else 0)
        # Q + projection, K + V (grouped-query attention: one per query group), each h x the
        # attention width; fc1 (+ gate), fc2; biases: q / k / v rows split by TP
        # (--add-qkv-bias keeps them alone), the output projection's and fc2's h replicated
        p = self.spec.attention_width
        qkv_rows = (1 + 2 * self.spec.kv_share) * p
        biased = self.spec.add_bias_linear
        qkv_bias = qkv_rows if biased or self.spec.add_qkv_bias else 0.0
        attention = ((2 + 2 * self.spec.kv_share) * h * p + qkv_bias) / tp + biased * h
        mlp = (m * h * f + biased * (m - 1) * f) / tp + biased * h
        attention, mlp = attention * self.tp_slot_share, mlp * self.tp_slot_share
        if kind == GPT_ATTENTION:
            return attention
        if kind == GPT_MLP:
            return mlp
        if kind in (GPT_LAYER, ENC_LAYER):
            return attention + mlp
        if kind == DEC_LAYER:
            return 2 * attention + mlp     # self- and cross-attention
        if kind == EMBEDDING:
            return v * h / tp + positions
        if kind == DEC_EMBEDDING:
            return v * h / tp + positions
        if kind == HEAD:
            return v * h / tp
        return 2 * h  # norms

    def model_state_bytes(self, num_stages: int) -> list[float]:
        """Parameter + gradient + optimizer bytes of each stage."""
        return [(sum(self.layer_params(k) for k in kinds)
                 - self.spec.shared_vocab_params(kinds, self.tp)) * self.bytes_per_param_state
                for kinds in self.spec.stage_layers(num_stages)]

    # ---- per-layer costs (vectorised over shapes)
    def _layer_cost(self, kind: str, b, s, d, recompute: str):
        """(fwd_flops, extra recompute flops, kept bytes, transient bytes) of one layer kind."""
        h, v, tp, dt = self.spec.hidden_size, self.spec.vocab_size, self.tp, self.dtype_bytes
        zero = np.zeros_like(b)
        if kind in LAYER_UNITS:
            return self._layer_terms(kind, b, s, d).under(recompute, zero)
        if kind in (EMBEDDING, ENC_NORM):
            return 2 * b * s * h, zero, dt / 2 * b * s * h, dt * b * s * h
        if kind == DEC_EMBEDDING:
            return 2 * b * d * h, zero, dt / 2 * b * d * h, dt * b * d * h
        if kind == HEAD:
            tokens = b * d if self.spec.model == "t5" else b * s
            logits = 4.0 * tokens * v / tp      # fp32 softmax kept by the cross-entropy
            return 2 * tokens * h * v / tp, zero, dt * tokens * h + logits, logits
        raise ValueError(f"unknown layer kind {kind!r}")

    def _layer_terms(self, kind: str, b, s, d) -> "LayerTerms":
        """LayerTerms of a transformer layer kind: a GPT / T5 encoder layer is its attention
        half plus its MLP half (one checkpoint unit, one input), a T5 decoder layer its
        self-attention, cross-attention and MLP parts; GPT_ATTENTION / GPT_MLP are the halves
        alone (each its own checkpoint unit with its own input)."""
        if kind == DEC_LAYER:
            return self._attention_terms(b, d, causal=True).plus(
                self._cross_attention_terms(b, s, d)).plus(self._mlp_terms(b, d))
        attention = self._attention_terms(b, s, causal=self.spec.model == "gpt")
        mlp = self._mlp_terms(b, s)
        if kind == GPT_ATTENTION:
            return attention
        if kind == GPT_MLP:
            return mlp
        return attention.plus(mlp)

    def _kept_units(self):
        """(bytes per kept 2-byte element, 1-byte dropout masks per sbh, attention copies kept
        by an unfused attention: softmax output (+ dropout mask and output))."""
        masks = 1.0 if self.dropout else 0.0
        return self.dtype_bytes / 2.0, masks, (5.0 if self.dropout else 2.0)

    def _attention_terms(self, b, s, causal: bool = False) -> "LayerTerms":
        """Input norm, self-attention (QKV, core, projection) and residual add over length s.
        Causal attention (GPT, T5's decoder) computes the s (s + 1) / 2 pairs of a query and
        its earlier keys: the fused kernels skip the blocks above the diagonal (flash and
        FlexAttention on GPU, SDPA per length group on CPU), so its core flops are about half
        a bidirectional one's (measured on packed CPU streams: tools/check_cost_model.py
        --streams).
        Kept (Korthikanti et al.'s attention block): norm input and QKV input (+ mask) per
        rank, Q, K, V and the projection input split by TP, and the core's own tensors. Q, K,
        V, the core and the projection input are as wide as spec.attention_width."""
        h, a, tp, dt = (self.spec.hidden_size, self.spec.num_attention_heads, self.tp,
                        self.dtype_bytes)
        p = self.spec.attention_width
        half, masks, att_copies = self._kept_units()
        # T5 relative buckets: self-attention gets a float [b, heads, q, q] score bias (one SDPA
        # call with that mask, attention.SDPAttention._biased), kept for backward
        biased = 1.0 if self.spec.position_embedding_type == "relative" else 0.0
        kept_att = (4.0 * a * b * s / tp if self.fused_attention
                    else half * att_copies * a * b * s * s / tp) + biased * dt * a * b * s * s / tp
        score = 0.0 if self.fused_attention else dt * a * b * s * s / tp
        qkv = 2 + 2 * self.spec.kv_share     # Q + projection, and K + V of the query groups
        pairs = s * (s + 1) / 2 if causal else s * s
        # rotary positions: the turned Q and K are new tensors, kept by the core attention
        # beside the QKV output (V still a view of it), and the cosines and sines that turned
        # them, [s, b, rotary dim] each, on every TP rank
        # (grouped-query attention without them: megatron-core's Q of a group's heads is a
        # copy, reshaped out of the interleaved QKV output, kept beside that output)
        if self.spec.rotary:
            copies = dt * b * s * ((1 + self.spec.kv_share) * p / tp + 4.0 * self.spec.rotary_dim)
        else:
            copies = dt * b * s * p / tp if self.spec.kv_share < 1 else 0.0
        return LayerTerms(lin=2 * b * s * qkv * h * p / tp, att=4 * b * pairs * p / tp,
                          kept_lin=half * ((4 + masks) * b * s * h + 2 * qkv * b * s * p / tp)
                          + copies,
                          kept_att=kept_att, transient=2 * score + np.zeros_like(b),
                          layer_in=dt * b * s * h)

    def _mlp_terms(self, b, s) -> "LayerTerms":
        """Pre-MLP norm, MLP (fc1, GeLU, fc2) and residual add over length s. Kept: norm input
        and fc1 input (+ mask) per rank, fc1 and activation outputs split by TP."""
        h, f, tp, dt = self.spec.hidden_size, self.spec.ffn_size, self.tp, self.dtype_bytes
        half, masks, _ = self._kept_units()
        m = self.mlp_matrices
        # kept fc1 output and activation output (2f); gated: fc1 output (2f), activation of
        # the gate and the product (4f); the transient activation grows alike
        kept_f = 2 * m - 2
        # per token (SwiGLU's backward holds as many: the gate's and the up half's gradients)
        gelu_temps = 2.0 * dt * f / tp if self.sigmoid_gelu else 0.0
        zero = np.zeros_like(b)
        return LayerTerms(lin=2 * b * s * m * h * f / tp, att=zero,
                          kept_lin=half * ((4 + masks) * b * s * h + 2 * kept_f * b * s * f / tp),
                          kept_att=zero,
                          transient=dt * b * s * f * (m - 1) / tp + gelu_temps * b * s,
                          layer_in=dt * b * s * h)

    def _cross_attention_terms(self, b, s, d) -> "LayerTerms":
        """A T5 decoder layer's norm, cross-attention (queries of length d, keys and values
        of the encoder's s) and residual add. Kept: norm and query inputs (+ mask) per rank;
        Q and the projection input over d, K and V over s, split by TP; the core's tensors."""
        h, a, tp, dt = (self.spec.hidden_size, self.spec.num_attention_heads, self.tp,
                        self.dtype_bytes)
        p = self.spec.attention_width
        half, masks, att_copies = self._kept_units()
        kept_att = (4.0 * a * b * d / tp if self.fused_attention
                    else half * att_copies * a * b * s * d / tp)
        score = 0.0 if self.fused_attention else dt * a * b * s * d / tp
        return LayerTerms(lin=2 * b * d * 2 * h * p / tp + self._cross_kv_flops(b, s),
                          att=4 * b * s * d * p / tp,
                          kept_lin=half * ((4 + masks) * b * d * h
                                           + (4 * b * d * p + 4 * b * s * p) / tp),
                          kept_att=kept_att + np.zeros_like(b),
                          transient=2 * score + np.zeros_like(b), layer_in=dt * b * d * h)

    def _cross_kv_flops(self, b, s):
        """Forward flops of a T5 cross-attention's key and value projections, over the
        encoder's b * s tokens."""
        return 2 * b * s * 2 * self.spec.hidden_size * self.spec.attention_width / self.tp

    def stage_cost_arrays(self, rows, seq_len, dec_seq_len, num_stages: int,
                          recompute: str = "none") -> StageCostArrays:
        """Vectorised `stage_costs` over arrays of shapes (the planners' fast path)."""
        if recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none/selective/full, got {recompute!r}")
        b = np.asarray(rows, dtype=np.float64)
        s = np.asarray(seq_len, dtype=np.float64)
        d = np.broadcast_to(np.asarray(dec_seq_len, dtype=np.float64), b.shape)
        s = np.broadcast_to(s, b.shape)
        feasible = shape_feasible(self.spec.model, b, s, d, self.max_seq_len,
                                  self.max_dec_seq_len)
        stages = self.spec.stage_layers(num_stages)
        out = np.zeros((4, num_stages) + b.shape)
        per_kind = {kind: self._layer_cost(kind, b, s, d, recompute)
                    for kind in {k for kinds in stages for k in kinds}}
        for k, kinds in enumerate(stages):
            has_dec = DEC_LAYER in kinds
            for kind in dict.fromkeys(kinds):
                count = kinds.count(kind)
                fwd, extra, kept, transient = per_kind[kind]
                fwd_ms, bwd_ms = self._layer_ms(kind, fwd, extra, b, s, d, recompute)
                over = self.layer_overhead_ms * LAYER_UNITS.get(kind, 0.0)
                out[0, k] += count * (fwd_ms + over)
                out[1, k] += count * (bwd_ms + 2 * over)
                out[2, k] += count * kept
                np.maximum(out[3, k], transient, out=out[3, k])
            if has_dec and recompute == "full":
                out[2, k] += self.dtype_bytes * b * s * self.spec.hidden_size  # encoder output
            if recompute == "full" and self.full_recompute == "stage":
                out[2, k], out[3, k] = self._whole_stage_recompute(stages, k, b, s, d)
            if HEAD not in kinds:   # the output sent on (T5 decoder stages: the new decoder part)
                out[2, k] += self._hidden_bytes(kinds, b, s, d)
            units = sum(LAYER_UNITS.get(kind, 0.0) for kind in kinds)
            for part, host_ms in enumerate(self.host_ms_per_layer):
                np.maximum(out[part, k], units * host_ms, out=out[part, k])
        return StageCostArrays(out[0], out[1], out[2], out[3], feasible)

    def _ms_per_flop(self, tokens):
        """ms per flop of an operation over `tokens` tokens: small ones run below peak, at
        device_flops * tokens / (tokens + half_rate_tokens), large ones (with cache_tokens)
        below that by the factor 1 + tokens / cache_tokens."""
        tokens = np.maximum(tokens, 1.0)
        ms = 1e3 / self.device_flops * (tokens + self.half_rate_tokens) / tokens
        return ms if self.cache_tokens is None else ms * (1 + tokens / self.cache_tokens)

    def _layer_ms(self, kind: str, fwd, extra, b, s, d, recompute: str):
        """(forward ms, backward ms) of one layer kind from its flops, each part at the rate of
        the tokens it runs over: T5's decoder side (decoder embedding, decoder layers, output
        layer) over the decoder's b * d tokens, except the cross-attention's keys and values,
        which run over the encoder's b * s tokens like the encoder side. Backward is 2 x
        forward plus the recomputed part."""
        enc = self._ms_per_flop(b * s)
        decoder_side = self.spec.model == "t5" and kind in (DEC_EMBEDDING, DEC_LAYER, HEAD)
        if not decoder_side:
            return fwd * enc, (2 * fwd + extra) * enc
        dec = self._ms_per_flop(b * d)
        if kind != DEC_LAYER:
            return fwd * dec, (2 * fwd + extra) * dec
        kv = self._cross_kv_flops(b, s)
        kv_extra = kv if recompute == "full" else 0.0
        return ((fwd - kv) * dec + kv * enc,
                (2 * (fwd - kv) + extra - kv_extra) * dec + (2 * kv + kv_extra) * enc)

    def _hidden_bytes(self, kinds, b, s, d):
        """Bytes of the new hidden state a stage of these layer kinds hands on."""
        started = DEC_LAYER in kinds or DEC_EMBEDDING in kinds
        return self.dtype_bytes * b * (d if started else s) * self.spec.hidden_size

    def _whole_stage_recompute(self, stages, k, b, s, d):
        """(kept, transient peak) of stage k recomputed in one checkpoint: it keeps its inputs
        (the previous stage's output; T5 decoder stages also the encoder output) and, in
        backward, holds every layer's no-recompute activations plus the largest transient."""
        kept = np.zeros_like(b)
        if k > 0:
            prev = stages[k - 1]
            kept = kept + self._hidden_bytes(prev, b, s, d)
            if DEC_LAYER in prev or DEC_EMBEDDING in prev:
                kept = kept + self.dtype_bytes * b * s * self.spec.hidden_size
        rematerialised, transient = np.zeros_like(b), np.zeros_like(b)
        for kind in dict.fromkeys(stages[k]):
            _, _, kept_none, transient_none = self._layer_cost(kind, b, s, d, "none")
            rematerialised = rematerialised + stages[k].count(kind) * kept_none
            transient = np.maximum(transient, transient_none)
        return kept, rematerialised + transient


def half_layer_shares(spec: ModelSpec, tp: int = 1, b=1.0, s=1.0, recompute: str = "none",
                      dtype_bytes: int = 4) -> dict[str, dict[str, np.ndarray]]:
    """Each GPT half layer's share of its whole layer in the analytic model (default options:
    no dropout, fused attention, as the trainer builds layers) at shapes (rows b, length s):
    {GPT_ATTENTION: {field: share}, GPT_MLP: {...}} for "fwd_ms" (by forward flops), "bwd_ms"
    (by 2 x forward + recompute flops), "activation_bytes" (by kept bytes) and "param_count".
    For cost models that know whole layers only: a profile times whole megatron-core
    TransformerLayers (the module the profiler runs), so a half's cost is its layer's measured
    cost times this share. The two shares add up to 1, except kept bytes under 'full'
    recompute: each half keeps its own input, i.e. all that the whole layer keeps (share 1
    each)."""
    model = AnalyticCostModel(spec, tp=tp, dtype_bytes=dtype_bytes)
    # at least one row / token: a query bounded below the grid may ask for 0
    b, s = (np.maximum(x, 1.0) for x in np.broadcast_arrays(np.asarray(b, np.float64),
                                                              np.asarray(s, np.float64)))

    def costs(kind):
        fwd, extra, kept, _ = model._layer_cost(kind, b, s, np.zeros_like(b), recompute)
        return {"fwd_ms": fwd, "bwd_ms": 2 * fwd + extra, "activation_bytes": kept,
                "param_count": model.layer_params(kind)}

    whole = costs(GPT_LAYER)
    return {kind: {name: value / whole[name] for name, value in costs(kind).items()}
            for kind in (GPT_ATTENTION, GPT_MLP)}


def analytic_balanced_cut(spec: ModelSpec, num_stages: int, seq_len: float,
                          **options) -> tuple[int, ...]:
    """model_spec.balanced_cut of a GPT `spec`'s half layers by the AnalyticCostModel's
    forward + backward time of each unit (embedding counted with the first, output layer
    and loss with the last) for one row of `seq_len` tokens; `options` go to the model
    (device figures, tp, ...). The trainer measures its units instead (its CPU is far from
    the FLOP counts); for projections the analytic model is the device."""
    from dataclasses import replace

    from dynapipe_ext.costs.model_spec import balanced_cut
    units = 2 * spec.num_layers
    model = AnalyticCostModel(replace(spec, pipeline_cut=(1,) * units), num_stages=units,
                              **options)
    costs = model.stage_cost_arrays(np.array([1.0]), np.array([float(seq_len)]),
                                    np.array([0.0]), units)
    return balanced_cut((costs.fwd_ms + costs.bwd_ms)[:, 0], num_stages)


# ------------------------------------------------------------------ micro-batch costing

@dataclass(frozen=True)
class MicroBatchCosts:
    """Costs of n micro-batch shapes under the cheapest recompute mode that fits:
    `mode` indexes the allowed modes (-1: no mode fits / shape unknown), `time_ms` is the
    forward+backward time of the slowest stage (inf where mode is -1), `memory_bytes` the
    activation bytes kept by the busiest stage."""

    time_ms: np.ndarray
    memory_bytes: np.ndarray
    mode: np.ndarray


def memory_needed(arrays: StageCostArrays) -> np.ndarray:
    """Bytes a micro-batch shape needs on its busiest stage under 1F1B among copies of itself.

    Rule: stage k of P keeps at most P - k micro-batches in flight (their kept activations)
    plus the transient peak of the one it is computing, so (P - k) * activation_k + peak_k is
    what a 1F1B pipeline of this shape alone peaks at. It is a per-shape filter, NOT a bound
    for a mix: with P = 2 and a limit of 10, micro-batch A (kept 5, transient 0) and B (kept 0,
    transient 10) each need 10, yet B's forward while A is in flight peaks at 15. The
    iteration planner therefore checks every split against the simulated peak of its candidate
    schedules and re-splits under a lower limit when none fits
    (iteration_planner.split_that_runs)."""
    num_stages = arrays.activation_bytes.shape[0]
    in_flight = (num_stages - np.arange(num_stages)).reshape((num_stages,) + (1,) *
                                                             (arrays.activation_bytes.ndim - 1))
    return (in_flight * arrays.activation_bytes + arrays.peak_bytes).max(axis=0)


def cost_micro_batches(cost_model: CostModel, rows, seq_len, dec_seq_len, num_stages: int,
                       modes: tuple[str, ...], memory_limit: float) -> MicroBatchCosts:
    """Cost each shape under the first mode of `modes` (cheapest first) whose memory need
    (see `memory_needed`) fits `memory_limit`."""
    rows = np.asarray(rows)
    time_ms = np.full(rows.shape, np.inf)
    memory = np.zeros(rows.shape)
    mode = np.full(rows.shape, -1, dtype=np.int64)
    todo = np.ones(rows.shape, dtype=bool)
    seq_len = np.broadcast_to(np.asarray(seq_len), rows.shape)
    dec_seq_len = np.broadcast_to(np.asarray(dec_seq_len), rows.shape)
    for m, name in enumerate(modes):
        idx = np.flatnonzero(todo)
        if idx.size == 0:
            break
        arr = cost_model.stage_cost_arrays(rows[idx], seq_len[idx], dec_seq_len[idx], num_stages,
                           name)
        fits = arr.feasible & (memory_needed(arr) <= memory_limit)
        hit = idx[fits]
        time_ms[hit] = (arr.fwd_ms + arr.bwd_ms).max(axis=0)[fits]
        memory[hit] = arr.activation_bytes.max(axis=0)[fits]
        mode[hit] = m
        todo[hit] = False
    return MicroBatchCosts(time_ms, memory, mode)
