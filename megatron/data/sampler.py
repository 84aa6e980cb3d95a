"""Global batches by token budget over a multi-task mixture, deterministic and resumable.

The sampler draws an endless stream of sample indices: stream position p picks a task with
the mixing rates (examples-proportional with a cap, as FLAN mixes: rate_t ~ min(n_t, cap)),
then that task's next sample in a seeded per-pass permutation (every sample of a task is seen
once before any is seen twice). A global batch takes stream samples in order while their
token sum stays within `tokens_per_global_batch`. Everything is a pure function of the seed
and the stream position, so a batch can be looked up by iteration or by consumed-sample count,
planned ahead without consuming, and a resumed run sees exactly the same batches.

With a packing window (`PackingWindow`, the trainer's --packing-window) the stream is cut into
windows of that many samples, each packed as a whole into rows ahead of training (Krell et
al. pack the whole dataset); the rows are shuffled and global batches take whole rows while
their tokens fit the budget. Samples are emitted row by row in an order from which next-fit
rebuilds the rows (dynapipe_ext.batching.packing.next_fit_order), so `--micro-batching packing`
trains on exactly these rows. Still a pure function of the seed and the stream position."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

import numpy as np

from dynapipe_ext.batching.packing import ALGORITHMS, next_fit_order, pack_pairs, pack_sequences

STREAM_BLOCK = 8192  # stream positions generated per block


def mixing_rates(task_ids: np.ndarray, num_tasks: Optional[int] = None,
                 cap: Optional[int] = None, temperature: float = 1.0) -> np.ndarray:
    """Per-task sampling rates: proportional to min(n_t, cap) ** (1 / temperature)."""
    counts = np.bincount(np.asarray(task_ids, dtype=np.int64), minlength=num_tasks or 0)
    if counts.sum() == 0:
        raise ValueError("no samples to mix")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if cap is not None and cap < 1:
        raise ValueError(f"mixing cap must be >= 1, got {cap}")
    sizes = (np.minimum(counts, cap) if cap is not None else counts).astype(np.float64)
    weights = np.where(counts > 0, sizes ** (1.0 / temperature), 0.0)
    return weights / weights.sum()


def given_rates(rates: Sequence[float], task_ids: np.ndarray) -> np.ndarray:
    """Checked, normalised explicit rates: one per task id, > 0 only where samples exist."""
    rates = np.asarray(rates, dtype=np.float64)
    counts = np.bincount(task_ids, minlength=len(rates))
    if len(counts) != len(rates) or (rates < 0).any() or rates.sum() <= 0:
        raise ValueError(f"rates must be {len(counts)} non-negative numbers, not all 0")
    if (rates[counts == 0] > 0).any():
        raise ValueError("a rate > 0 for a task without samples")
    return rates / rates.sum()


@dataclass(frozen=True)
class PackingWindow:
    """Dataset-level packing: `samples` stream positions per window, packed with `algorithm`
    into rows of `row_lengths` (GPT (seq_length,), T5 (encoder, decoder)) holding at most
    `max_depth` samples (None: no limit)."""

    samples: int
    algorithm: str
    row_lengths: tuple
    max_depth: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.samples, bool) or not isinstance(self.samples, (int, np.integer)) \
                or self.samples < 1:
            raise ValueError(f"packing window must be a positive number of samples, "
                             f"got {self.samples!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"packing algorithm must be one of {ALGORITHMS}, "
                             f"got {self.algorithm!r}")
        if len(self.row_lengths) not in (1, 2) or min(self.row_lengths) < 1:
            raise ValueError(f"row lengths must be 1 (GPT) or 2 (T5) positive lengths, "
                             f"got {self.row_lengths!r}")

    def pack(self, lengths: np.ndarray) -> list[list[int]]:
        """Rows of positions into `lengths` ((n,) or (n, 2))."""
        if len(self.row_lengths) == 1:
            return pack_sequences(lengths.reshape(-1), self.row_lengths[0], self.algorithm,
                                  self.max_depth)
        return pack_pairs(lengths[:, 0], lengths[:, 1], self.row_lengths[0],
                          self.row_lengths[1], self.algorithm, self.max_depth)


class GlobalBatchSampler:
    """Global batches of sample indices under a token budget, over a task mixture.

    sample_lengths: (n,) tokens per sample (GPT view), or (n, 2) encoder and decoder tokens
    (T5 view; both count toward the budget). Lengths are after truncation. `rates` replaces
    the mixing rates of the task ids (a blend passes one rate per (dataset, task) stream and
    those stream ids as `task_ids`, see megatron/data/blend.py). `settings` names whatever
    else decided the batches (the trainer: its batch and mixing flags, by flag name); the
    checkpoint state records them and a resume must match them (`check_resume`); without
    it, the seed and the token budget are recorded. `packing` (a PackingWindow) makes global
    batches of whole packed rows of each window (see the module docstring); it excludes
    `max_samples_per_batch`."""

    def __init__(self, sample_lengths: Sequence, task_ids: Sequence, tokens_per_global_batch: int,
                 seed: int = 1234, mixing_cap: Optional[int] = None, temperature: float = 1.0,
                 max_samples_per_batch: Optional[int] = None,
                 task_names: Optional[Sequence[str]] = None,
                 rates: Optional[Sequence[float]] = None,
                 settings: Optional[Mapping[str, object]] = None,
                 packing: Optional[PackingWindow] = None):
        lengths = np.asarray(sample_lengths, dtype=np.int64)
        self.lengths = lengths
        self.costs = lengths.sum(axis=1) if lengths.ndim == 2 else lengths
        self.task_ids = np.asarray(task_ids, dtype=np.int64)
        if self.costs.ndim != 1 or len(self.costs) != len(self.task_ids):
            raise ValueError(f"sample_lengths {lengths.shape} and task_ids "
                             f"{self.task_ids.shape} disagree")
        self.tokens_per_global_batch = int(tokens_per_global_batch)
        self.seed = int(seed)
        self.max_samples_per_batch = max_samples_per_batch
        self.settings = (dict(settings) if settings is not None else
                         {"seed": self.seed,
                          "tokens_per_global_batch": self.tokens_per_global_batch})
        num_tasks = len(task_names) if task_names is not None else None
        self.task_names = list(task_names) if task_names is not None else None
        self.rates = (mixing_rates(self.task_ids, num_tasks, mixing_cap, temperature)
                      if rates is None else given_rates(rates, self.task_ids))
        self._members = [np.flatnonzero(self.task_ids == t) for t in range(len(self.rates))]
        self.packing = packing
        self._check_budget()
        self._check_packing()
        self._window_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._block_starts: list[np.ndarray] = [np.zeros(len(self.rates), dtype=np.int64)]
        self._block_cache: dict[int, np.ndarray] = {}
        self._batch_starts: list[int] = [0]
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

    def _check_budget(self) -> None:
        if self.tokens_per_global_batch < 1:
            raise ValueError("tokens_per_global_batch must be >= 1")
        if self.max_samples_per_batch is not None and self.max_samples_per_batch < 1:
            raise ValueError("max_samples_per_batch must be >= 1")
        too_long = np.flatnonzero(self.costs > self.tokens_per_global_batch)
        if too_long.size:
            i = int(too_long[0])
            task = self.task_ids[i]
            name = self.task_names[task] if self.task_names else f"task id {task}"
            raise ValueError(
                f"{too_long.size} samples exceed tokens_per_global_batch="
                f"{self.tokens_per_global_batch} on their own, e.g. sample {i} ({name}) with "
                f"{int(self.costs[i])} tokens: raise the budget or lower the sequence length")

    def _check_packing(self) -> None:
        if self.packing is None:
            return
        if self.max_samples_per_batch is not None:
            raise ValueError("a packing window makes batches of whole packed rows; it cannot "
                             "also hold a fixed number of samples per batch (give a token "
                             "budget instead of a global batch size)")
        sides = 1 if self.lengths.ndim == 1 else self.lengths.shape[1]
        if len(self.packing.row_lengths) != sides:
            raise ValueError(f"packing rows of {len(self.packing.row_lengths)} side(s) for "
                             f"samples of {sides}")
        row_tokens = sum(self.packing.row_lengths)
        if row_tokens > self.tokens_per_global_batch:
            raise ValueError(f"a packed row holds up to {row_tokens} tokens, more than "
                             f"tokens_per_global_batch={self.tokens_per_global_batch}: raise "
                             f"the budget to at least one row")
        over = np.flatnonzero((self.lengths.reshape(len(self.lengths), -1)
                               > np.asarray(self.packing.row_lengths)).any(axis=1))
        if over.size:
            i = int(over[0])
            raise ValueError(f"sample {i} has length {self.lengths[i].tolist()}, over the "
                             f"packed row length {list(self.packing.row_lengths)} "
                             f"({over.size} such samples)")

    # ---- the sample stream ------------------------------------------------------------------
    def _permutation(self, task: int, epoch: int) -> np.ndarray:
        key = (task, epoch)
        if key not in self._perm_cache:
            if len(self._perm_cache) > 4 * len(self.rates) + 64:
                self._perm_cache.clear()
            rng = np.random.default_rng([self.seed, 1, task, epoch])
            self._perm_cache[key] = self._members[task][rng.permutation(len(self._members[task]))]
        return self._perm_cache[key]

    def _block_tasks(self, block: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0, block])
        return rng.choice(len(self.rates), size=STREAM_BLOCK, p=self.rates)

    def _block(self, block: int) -> np.ndarray:
        """Sample indices of stream positions [block * STREAM_BLOCK, (block + 1) * ...)."""
        if block in self._block_cache:
            return self._block_cache[block]
        while len(self._block_starts) <= block:  # per-task draws before each block
            prev = len(self._block_starts) - 1
            counts = np.bincount(self._block_tasks(prev), minlength=len(self.rates))
            self._block_starts.append(self._block_starts[prev] + counts)
        tasks = self._block_tasks(block)
        out = np.empty(STREAM_BLOCK, dtype=np.int64)
        order = np.argsort(tasks, kind="stable")
        present, first = np.unique(tasks[order], return_index=True)
        for t, where in zip(present, np.split(order, first[1:])):
            cursors = self._block_starts[block][t] + np.arange(len(where))
            n = len(self._members[t])
            for epoch in np.unique(cursors // n):
                sel = cursors // n == epoch
                out[where[sel]] = self._permutation(int(t), int(epoch))[cursors[sel] % n]
        if len(self._block_cache) > 8:
            self._block_cache.clear()
        self._block_cache[block] = out
        return out

    def stream(self, start: int, count: int) -> np.ndarray:
        """Sample indices at stream positions [start, start + count)."""
        if start < 0 or count < 0:
            raise ValueError("stream positions must be >= 0")
        parts, pos, end = [], start, start + count
        while pos < end:
            block, offset = divmod(pos, STREAM_BLOCK)
            take = min(end - pos, STREAM_BLOCK - offset)
            parts.append(self._block(block)[offset:offset + take])
            pos += take
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    # ---- batches ----------------------------------------------------------------------------
    def batch_at(self, consumed_samples: int) -> np.ndarray:
        """The global batch that starts after `consumed_samples` stream samples."""
        if self.packing is not None:
            return self._packed_batch_at(consumed_samples)
        picked, used, pos = [], 0, consumed_samples
        limit = self.max_samples_per_batch or np.inf
        while True:
            chunk = self.stream(pos, 256)
            cum = used + np.cumsum(self.costs[chunk])
            fit = int(np.searchsorted(cum, self.tokens_per_global_batch, side="right"))
            fit = int(min(fit, limit - sum(len(p) for p in picked)))
            picked.append(chunk[:fit])
            if fit < len(chunk):
                return np.concatenate(picked)
            used, pos = int(cum[-1]), pos + len(chunk)

    def _window(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """Window `window` packed: (its sample indices in emitted order, batch start offsets
        into that order, ending with the window size)."""
        if window in self._window_cache:
            return self._window_cache[window]
        size = self.packing.samples
        ids = self.stream(window * size, size)
        window_lengths = self.lengths[ids]
        rows = self.packing.pack(window_lengths)
        rng = np.random.default_rng([self.seed, 2, window])
        rows = [rows[k] for k in rng.permutation(len(rows))]
        row_costs = np.array([int(self.costs[ids[row]].sum()) for row in rows])
        order: list[int] = []
        starts = [0]
        first = 0
        while first < len(rows):
            cum = np.cumsum(row_costs[first:])
            last = first + max(1, int(np.searchsorted(cum, self.tokens_per_global_batch,
                                                      side="right")))
            batch = next_fit_order(rows[first:last], window_lengths,
                                   self.packing.row_lengths, self.packing.max_depth)
            order.extend(i for row in batch for i in row)
            starts.append(len(order))
            first = last
        out = (ids[np.asarray(order, dtype=np.int64)], np.asarray(starts, dtype=np.int64))
        if len(self._window_cache) > 2:
            self._window_cache.clear()
        self._window_cache[window] = out
        return out

    def _packed_batch_at(self, consumed_samples: int) -> np.ndarray:
        window, offset = divmod(int(consumed_samples), self.packing.samples)
        order, starts = self._window(window)
        k = int(np.searchsorted(starts, offset))
        if k >= len(starts) - 1 or starts[k] != offset:
            raise ValueError(f"consumed_samples={consumed_samples} is not a batch boundary of "
                             f"packing window {window} (seed {self.seed}, window "
                             f"{self.packing.samples}): checkpoint from another config?")
        return order[starts[k]:starts[k + 1]]

    def consumed_before(self, iteration: int) -> int:
        """Stream samples consumed by iterations [0, iteration)."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        while len(self._batch_starts) <= iteration:
            start = self._batch_starts[-1]
            self._batch_starts.append(start + len(self.batch_at(start)))
        return self._batch_starts[iteration]

    def batch(self, iteration: int) -> np.ndarray:
        """Sample indices of global batch `iteration` (a pure function of seed and iteration)."""
        return self.batch_at(self.consumed_before(iteration))

    def batch_costs(self, iteration: int) -> np.ndarray:
        """Budget tokens of each sample of batch `iteration` (for planning ahead)."""
        return self.costs[self.batch(iteration)]

    def iteration_of(self, consumed_samples: int) -> int:
        """The iteration that starts at `consumed_samples`; error if no batch starts there."""
        it = int(np.searchsorted(self._batch_starts, consumed_samples))
        while self.consumed_before(it) < consumed_samples:
            it += 1
        if self.consumed_before(it) != consumed_samples:
            raise ValueError(f"consumed_samples={consumed_samples} is not a batch boundary of "
                             f"this sampler (seed {self.seed}, budget "
                             f"{self.tokens_per_global_batch}): checkpoint from another config?")
        return it

    def batches(self, consumed_samples: int = 0) -> Iterator[np.ndarray]:
        """Endless global batches from a consumed-sample count (0 = from the start)."""
        while True:
            batch = self.batch_at(consumed_samples)
            yield batch
            consumed_samples += len(batch)

    def state_dict(self, consumed_samples: int) -> dict:
        """What a checkpoint keeps to resume (plus the settings to check on load)."""
        return {"consumed_samples": int(consumed_samples), "seed": self.seed,
                "tokens_per_global_batch": self.tokens_per_global_batch,
                "settings": dict(self.settings)}

    def check_resume(self, state: dict) -> None:
        """ValueError, one line, for the first setting that differs from the checkpoint's
        (settings a checkpoint does not record, from before they were, are not compared)."""
        saved = state.get("settings")
        if saved is None:   # written before settings were recorded
            saved = {k: state[k] for k in ("seed", "tokens_per_global_batch") if k in state}
        for name, now in self.settings.items():
            if name in saved and _differs(saved[name], now):
                raise ValueError(
                    f"{name} was {_shown(saved[name])} when the checkpoint was written, this "
                    f"run has {_shown(now)}; the batches depend on it, so resume with the "
                    f"checkpoint's value")

    def resume_from(self, state: dict) -> Iterator[np.ndarray]:
        """Batches that follow a checkpoint written with state_dict()."""
        self.check_resume(state)
        return self.batches(int(state["consumed_samples"]))


def _differs(saved, now) -> bool:
    """Checkpointed values come back as lists where they were tuples."""
    norm = (lambda v: list(v) if isinstance(v, (list, tuple)) else v)
    return norm(saved) != norm(now)


def _shown(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)
