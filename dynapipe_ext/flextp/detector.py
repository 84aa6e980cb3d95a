"""Straggler detection from the compute times each rank measured (no oracle).

A rank's speed is the work it did (units computed, in any consistent unit) over the compute time
it measured, smoothed by an exponential moving average. A rank becomes a straggler when the
fastest rank's speed exceeds its own by `enter_ratio` for `patience` updates in a row, and stops
being one when the ratio stays below `exit_ratio` for `patience` updates: the gap between the two
ratios and the patience are the hysteresis that keeps timing noise from flipping decisions."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StragglerDetector:
    tp: int
    enter_ratio: float = 1.3
    exit_ratio: float = 1.12
    patience: int = 6
    alpha: float = 0.15
    speeds: list = field(default=None)
    stragglers: set = field(default_factory=set)
    _streak: list = field(default=None)

    def __post_init__(self):
        if not 1.0 < self.exit_ratio < self.enter_ratio:
            raise ValueError(f"StragglerDetector: need 1 < exit_ratio ({self.exit_ratio}) < "
                             f"enter_ratio ({self.enter_ratio})")
        if self.patience < 1 or not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"StragglerDetector: patience >= 1 and 0 < alpha <= 1, got "
                             f"{self.patience}, {self.alpha}")
        self._streak = [0] * self.tp

    def update(self, times, work) -> bool:
        """Feed one interval's per-rank compute seconds and work; True if the straggler set
        changed."""
        if len(times) != self.tp or len(work) != self.tp:
            raise ValueError(f"StragglerDetector.update: need {self.tp} times and work figures, "
                             f"got {len(times)} and {len(work)}")
        if any(t <= 0 for t in times) or any(w <= 0 for w in work):
            raise ValueError(f"StragglerDetector.update: times {list(times)} and work "
                             f"{list(work)} must be positive")
        now = [w / t for w, t in zip(work, times)]
        if self.speeds is None:
            self.speeds = now
        else:
            self.speeds = [(1 - self.alpha) * s + self.alpha * n for s, n in zip(self.speeds, now)]
        fastest = max(self.speeds)
        before = set(self.stragglers)
        for r, speed in enumerate(self.speeds):
            ratio = fastest / speed
            flagged = r in self.stragglers
            leaving = ratio < self.exit_ratio if flagged else ratio > self.enter_ratio
            self._streak[r] = self._streak[r] + 1 if leaving else 0
            if self._streak[r] >= self.patience:
                self._streak[r] = 0
                self.stragglers.symmetric_difference_update({r})
        return self.stragglers != before

    def relative_speeds(self) -> tuple[float, ...]:
        """Speeds the planner should balance for: measured (fastest = 1) for stragglers, 1 for
        the others, so noise on healthy ranks never reshapes the partition."""
        if self.speeds is None:
            return (1.0,) * self.tp
        fastest = max(self.speeds)
        return tuple(s / fastest if r in self.stragglers else 1.0
                     for r, s in enumerate(self.speeds))
