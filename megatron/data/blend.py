"""Several preprocessed datasets trained on as one: Megatron's `--data-path [W1] P1 [W2] P2 ...`.

A blend is read as one `BlendedMultiTaskDataset` (sample indices run over the prefixes in
order; task names are merged, so a task present in two prefixes has one id). Sampling draws
from "streams", one per (prefix, task): with weights, prefix p gets share w_p / sum(w) of the
samples and its tasks share that by FLAN's examples-proportional rule (rate ~ min(n, cap) **
(1 / temperature), as seqio's mixing with a cap and temperature); without weights every
(prefix, task) stream is mixed by that rule directly, like one concatenated dataset."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from megatron.data.multitask_dataset import MultiTaskDataset
from megatron.data.sampler import mixing_rates


def parse_data_path(tokens: Sequence[str]) -> list[tuple[Optional[float], str]]:
    """(weight or None, prefix) pairs of a --data-path list: `P` or `P1 P2 ...` (no weights)
    or `W1 P1 W2 P2 ...` (every prefix weighted). ValueError names what is wrong."""
    tokens = list(tokens)
    if not tokens:
        raise ValueError("--data-path needs at least one dataset prefix")

    def weight(text: str) -> Optional[float]:
        try:
            return float(text)
        except ValueError:
            return None

    if weight(tokens[0]) is None:
        numbers = [t for t in tokens if weight(t) is not None]
        if numbers:
            raise ValueError(f"--data-path {' '.join(tokens)}: a weight ({numbers[0]}) among "
                             f"unweighted prefixes; give every prefix a weight (W1 P1 W2 P2 "
                             f"...) or none")
        return [(None, t) for t in tokens]
    if len(tokens) % 2:
        raise ValueError(f"--data-path {' '.join(tokens)}: weights and prefixes must come in "
                         f"pairs (W1 P1 W2 P2 ...)")
    pairs = []
    for w, prefix in zip(tokens[::2], tokens[1::2]):
        value = weight(w)
        if value is None or weight(prefix) is not None:
            raise ValueError(f"--data-path {' '.join(tokens)}: expected a weight then a "
                             f"prefix, got {w!r} {prefix!r}")
        if not 0 < value < float("inf"):
            raise ValueError(f"--data-path: weight {w} of {prefix} must be > 0 and "
                             f"finite")
        pairs.append((value, prefix))
    return pairs


class BlendedMultiTaskDataset(MultiTaskDataset):
    """The datasets at several prefixes as one (same interface as MultiTaskDataset); they must
    share a tokenizer. `stream_ids` numbers the (prefix, task) pairs for the sampler."""

    def __init__(self, prefixes: Sequence[str]):
        self.parts = [MultiTaskDataset(p) for p in prefixes]
        first = self.parts[0]
        for part in self.parts[1:]:
            if part.tokenizer_info != first.tokenizer_info:
                raise ValueError(f"datasets {first.prefix!r} and {part.prefix!r} were "
                                 f"tokenised differently ({first.tokenizer_info.get('type')} vs "
                                 f"{part.tokenizer_info.get('type')}, or other files); "
                                 f"preprocess them with the same tokenizer")
        self.prefix = " ".join(prefixes)
        self.table, self.vocab_size = first.table, first.vocab_size
        self.tokenizer_info = first.tokenizer_info
        self.task_names: list[str] = []
        index: dict[str, int] = {}
        task_ids, streams, offset = [], [], 0
        for part in self.parts:
            merged = np.array([index.setdefault(n, len(index)) for n in part.task_names],
                              dtype=np.int64)
            task_ids.append(merged[part.task_ids] if len(part) else part.task_ids)
            streams.append(part.task_ids + offset)
            offset += len(part.task_names)
        self.task_names = list(index)
        self.task_ids = np.concatenate(task_ids)
        self.stream_ids = np.concatenate(streams)
        self.stream_part = np.concatenate([np.full(len(p.task_names), k)
                                           for k, p in enumerate(self.parts)]).astype(np.int64)
        self.input_lengths = np.concatenate([p.input_lengths for p in self.parts])
        self.target_lengths = np.concatenate([p.target_lengths for p in self.parts])
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])

    def locate(self, i: int) -> tuple[int, int]:
        """(part, index within it) of sample i."""
        i = self._check_index(i)
        part = int(np.searchsorted(self.starts, i, side="right")) - 1
        return part, i - int(self.starts[part])

    def input_ids(self, i: int) -> np.ndarray:
        part, j = self.locate(i)
        return self.parts[part].input_ids(j)

    def target_ids(self, i: int) -> np.ndarray:
        part, j = self.locate(i)
        return self.parts[part].target_ids(j)

    def check_vocab_size(self, model_vocab_size: int) -> None:
        for part in self.parts:
            part.check_vocab_size(model_vocab_size)


def stream_rates(dataset: BlendedMultiTaskDataset, weights: Sequence[Optional[float]],
                 cap: Optional[int] = None, temperature: float = 1.0) -> np.ndarray:
    """Sampling rate of every (prefix, task) stream (see the module docstring)."""
    streams = len(dataset.stream_part)
    if weights[0] is None:
        return mixing_rates(dataset.stream_ids, streams, cap, temperature)
    total = float(sum(weights))
    rates = np.zeros(streams)
    for k, (part, w) in enumerate(zip(dataset.parts, weights)):
        sel = dataset.stream_part == k
        rates[sel] = w / total * mixing_rates(part.task_ids, int(sel.sum()), cap, temperature)
    return rates
