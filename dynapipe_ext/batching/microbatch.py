"""What every micro-batch planner returns: micro-batches (rows of sample ids in a padded shape)
per data-parallel replica. Training, tests and benchmarks only ever see these types.

A packed micro-batch (several samples in a row, attention within a sample only) costs what its
samples cost, not what its padded rectangle would: `packed_cost_shape` gives the shape a cost
model is asked for instead (see there)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

RECOMPUTE_MODES = ("none", "selective", "full")
MODEL_TYPES = ("gpt", "t5")
# how the dynamic planner lays out a micro-batch: one token stream of its samples (no padding
# but the alignment at the end) or the paper's one sample per row, padded to the longest
DYNAMIC_LAYOUTS = ("packed", "padded")


@dataclass(frozen=True)
class MicroBatch:
    """A padded tensor of `len(rows)` rows. Each row holds one sample, or several when packed;
    a packed row's samples sit one after another (the model masks them block-diagonally)."""

    rows: tuple[tuple[int, ...], ...]
    seq_len: int                 # padded length of every row (GPT tokens / T5 encoder tokens)
    dec_seq_len: int = 0         # padded T5 decoder length; 0 for GPT
    recompute: str = "none"
    time_ms: float = 0.0         # predicted forward+backward time on the slowest stage
    memory_bytes: int = 0        # predicted activation bytes kept for backward, busiest stage
    # (rows, seq_len, dec_seq_len) a cost model prices this micro-batch as; None = its tensor
    # shape. Packed micro-batches carry packed_cost_shape(...) here (planning only: plans sent
    # to ranks do not carry it)
    cost_shape: tuple[float, float, float] | None = field(default=None, compare=False)

    @property
    def sample_ids(self) -> tuple[int, ...]:
        return tuple(s for row in self.rows for s in row)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def is_packed(self) -> bool:
        return any(len(row) > 1 for row in self.rows)

    def costed_shape(self) -> tuple[float, float, float]:
        """The shape cost models price this micro-batch at (see `cost_shape`)."""
        if self.cost_shape is not None:
            return self.cost_shape
        return float(self.num_rows), float(self.seq_len), float(self.dec_seq_len)

    def slots(self) -> tuple[int, int]:
        """Token slots in the (encoder, decoder) tensors, pads included."""
        return self.num_rows * self.seq_len, self.num_rows * self.dec_seq_len


@dataclass(frozen=True)
class BatchPlan:
    """Micro-batches of one global batch, split over data-parallel replicas."""

    strategy: str
    replicas: tuple[tuple[MicroBatch, ...], ...]
    predicted_time_ms: float = 0.0
    info: dict = field(default_factory=dict, compare=False)

    @property
    def micro_batches(self) -> list[MicroBatch]:
        return [mb for rep in self.replicas for mb in rep]

    def sample_ids(self) -> list[int]:
        return [s for mb in self.micro_batches for s in mb.sample_ids]


def packed_cost_shape(enc_slots, enc_square, dec_slots=0.0):
    """(rows, seq_len, dec_seq_len) of the padded rectangle that costs what packed samples cost:
    `enc_slots` token slots (real tokens plus pads) whose attention works on `enc_square` = sum
    of the samples' squared lengths. rows * seq_len = slots and rows * seq_len^2 = sum l_i^2,
    so a cost model's token-linear terms (matmuls, kept bytes, logits) see the slots and its
    attention terms the per-sample work, never a row's S^2. T5: the decoder side shares the
    rows, dec_seq_len = dec_slots / rows (its self- and cross-attention are then exact for
    samples of equal shape and close for the similar shapes a planner groups). Lengths stay at
    least 1 (rows at most the slots of either side: a stream mostly of pads keeps its linear
    work and is charged a little more attention than it does). Vectorised."""
    slots = np.asarray(enc_slots, dtype=np.float64)
    dec = np.asarray(dec_slots, dtype=np.float64)
    square = np.maximum(np.asarray(enc_square, dtype=np.float64), 1.0)
    most = np.where(dec > 0, np.minimum(slots, dec), slots)
    rows = np.clip(slots * slots / square, 1.0, np.maximum(most, 1.0))
    return rows, slots / rows, dec / rows


def as_lengths(lengths: Sequence, model: str) -> np.ndarray:
    """Normalise sample lengths to int64 array: shape (n,) for GPT, (n, 2) (enc, dec) for T5."""
    if model not in MODEL_TYPES:
        raise ValueError(f"model must be one of {MODEL_TYPES}, got {model!r}")
    arr = np.asarray(lengths, dtype=np.int64)
    if model == "gpt" and arr.ndim != 1:
        raise ValueError(f"GPT lengths must be 1-D, got shape {arr.shape}")
    if model == "t5" and (arr.ndim != 2 or arr.shape[1] != 2):
        raise ValueError(f"T5 lengths must have shape (n, 2) = (encoder, decoder), got {arr.shape}")
    return arr


def padding_efficiency(plan: BatchPlan, lengths: np.ndarray) -> tuple[float, float]:
    """Real tokens / token slots in micro-batch tensors, (encoder-or-GPT, decoder)."""
    mbs = plan.micro_batches
    ids = np.asarray(plan.sample_ids(), dtype=np.int64)
    if lengths.ndim == 1:
        slots = sum(mb.slots()[0] for mb in mbs)
        return float(lengths[ids].sum() / max(slots, 1)), 1.0
    enc_slots = sum(mb.slots()[0] for mb in mbs)
    dec_slots = sum(mb.slots()[1] for mb in mbs)
    return (float(lengths[ids, 0].sum() / max(enc_slots, 1)),
            float(lengths[ids, 1].sum() / max(dec_slots, 1)))
