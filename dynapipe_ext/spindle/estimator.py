"""Scalability estimator T_m(n): time of MetaOp m (forward + backward) when its samples are
split data-parallel over n devices, from per-layer costs fitted to profiles, plus the
alpha-beta communication model used for activation hand-over and gradient all-reduce."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .contraction import MetaOp


@dataclass(frozen=True)
class LayerFit:
    """Seconds of one layer's forward + backward = overhead_s + per_token_s x tokens on the
    device. The overhead is what makes small per-device work scale badly (launches, an
    under-filled accelerator)."""
    overhead_s: float
    per_token_s: float

    def __post_init__(self):
        if self.overhead_s < 0 or self.per_token_s <= 0:
            raise ValueError(f"layer fit needs overhead >= 0 and per-token time > 0, got {self}")


def fit_layer(points: Sequence[tuple[float, float]], where: str = "profile") -> LayerFit:
    """Least-squares LayerFit through (tokens on one device, seconds) profile points; the
    overhead is clamped at zero (then the slope is refitted through the origin)."""
    if len(points) < 2 or len({t for t, _ in points}) < 2:
        raise ValueError(f"{where}: need profile points at two or more token counts, got "
                         f"{list(points)}")
    tokens = np.array([p[0] for p in points], dtype=float)
    secs = np.array([p[1] for p in points], dtype=float)
    if (tokens <= 0).any() or (secs <= 0).any():
        raise ValueError(f"{where}: token counts and times must be positive, got {list(points)}")
    slope, intercept = np.polyfit(tokens, secs, 1)
    if intercept < 0 or slope <= 0:
        intercept = 0.0
        slope = float(tokens @ secs / (tokens @ tokens))
    return LayerFit(float(intercept), float(slope))


@dataclass(frozen=True)
class CommModel:
    """alpha-beta links: a message of B bytes takes alpha_s + B x beta_s_per_byte."""
    alpha_s: float
    beta_s_per_byte: float

    def p2p(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.alpha_s + nbytes * self.beta_s_per_byte

    def allreduce(self, nbytes: float, n: int) -> float:
        """Ring all-reduce over n devices (reduce-scatter + all-gather)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return 2 * (n - 1) * self.alpha_s + 2 * (n - 1) / n * nbytes * self.beta_s_per_byte


@dataclass(frozen=True)
class Estimator:
    """T_m(n) and the byte sizes the planner needs, for one model dtype."""
    fits: Mapping[str, LayerFit]
    comm: CommModel
    dtype_bytes: int = 2
    replicated_bytes_per_param: int = 6  # bf16 weights + fp32 main gradient, on every user
    sharded_bytes_per_param: int = 12    # fp32 master weights + Adam moments, sharded over users
    activation_factor: float = 16.0      # kept bytes per token per layer / (width x dtype)

    def _fit(self, m: MetaOp) -> LayerFit:
        if m.kind not in self.fits:
            raise KeyError(f"no profile fit for layer kind {m.kind!r} (MetaOp {m.name})")
        return self.fits[m.kind]

    def max_devices(self, m: MetaOp, num_devices: int) -> int:
        """Most devices m can use: data parallelism splits whole samples."""
        return min(num_devices, m.samples)

    def time(self, m: MetaOp, n: float) -> float:
        """T_m(n). Integer n splits whole samples (the busiest device has ceil(samples/n));
        a fractional n is the continuous relaxation (samples/n). n above the sample count
        adds nothing."""
        if n < 1:
            raise ValueError(f"MetaOp {m.name}: device count must be >= 1, got {n}")
        n = min(n, m.samples)
        share = math.ceil(m.samples / n) if float(n).is_integer() else m.samples / n
        fit = self._fit(m)
        return m.layers * (fit.overhead_s + fit.per_token_s * m.tokens / m.samples * share)

    def output_bytes(self, m: MetaOp) -> int:
        """Activation bytes m hands to its consumers (whole iteration)."""
        return m.tokens * m.out_width * self.dtype_bytes

    def activation_bytes(self, m: MetaOp, samples_on_device: int) -> int:
        """Bytes m keeps from forward to backward on a device holding that many samples."""
        tokens = m.tokens / m.samples * samples_on_device
        return int(self.activation_factor * m.layers * tokens * m.out_width * self.dtype_bytes)
