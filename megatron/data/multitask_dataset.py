"""A tokenised multi-task dataset (written by tools/preprocess_flan.py) and its GPT and T5 views.

A sample is (input ids, target ids, task id). GPT view: the sequence input ++ target ++ [eod];
the model reads all but its last token and predicts all but its first, loss on the target
(+eod) predictions by default. T5 view: encoder = input; labels = target + [eos];
decoder = [decoder start] + labels[:-1]; the decoder start is bos. A tokenizer whose ids
already end in eos (T5SentencePieceTokenizer: "appends_eos", decoder start = pad, as Hugging
Face's T5) gets no second eos, and a cut sequence keeps its eos last, as HF's truncation does.
The input may be empty (a zero-shot sample): GPT then sees the target only (target ++ [eod],
loss on every prediction), T5 an encoder input of just [eos]."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from megatron.data.flan_indexed import dataset_paths, import_indexed_dataset, manifest_path


def read_dataset_file(path: str, read):
    """read(path); any failure (a damaged or foreign file) is a ValueError naming the file."""
    try:
        return read(path)
    except Exception as exc:   # noqa: BLE001 - numpy / megatron-core raise many kinds
        raise ValueError(f"{path}: cannot read it ({type(exc).__name__}: {exc}); rebuild the "
                         f"dataset with tools/preprocess_flan.py") from exc


def open_indexed(idx_path: str):
    """megatron-core's IndexedDataset of `X.idx` + `X.bin`, after checking the index header
    here (megatron-core asserts on a bad one and then fails again while being collected)."""
    indexed_dataset = import_indexed_dataset()
    with open(idx_path, "rb") as f:
        header = f.read(len(indexed_dataset._INDEX_HEADER))
    if header != indexed_dataset._INDEX_HEADER:
        raise ValueError("not a Megatron indexed dataset index (bad header)")
    return indexed_dataset.IndexedDataset(idx_path[:-len(".idx")])


def check_index_fits_data(indexed, idx_path: str) -> None:
    """ValueError naming `idx_path` and the first sample whose length and offset do not tile
    its .bin file (a damaged index would otherwise fail only when that sample is drawn, naming
    neither file nor sample). Reads the index only: O(samples)."""
    bin_path = idx_path[:-len(".idx")] + ".bin"
    bin_bytes = os.path.getsize(bin_path)
    lengths = indexed.sequence_lengths.astype(np.int64)
    starts = indexed.index.sequence_pointers.astype(np.int64)
    if len(lengths) == 0:
        return
    ends = starts + lengths * indexed.index.dtype_size
    follows = np.append(starts[1:], bin_bytes)     # where each sample's successor begins
    bad = np.flatnonzero((lengths < 0) | (ends != follows))
    if starts[0] != 0:
        raise ValueError(f"{idx_path}: damaged: sample 0 starts at byte {starts[0]} of "
                         f"{bin_path}, not 0; rebuild the dataset with tools/preprocess_flan.py")
    if bad.size:
        i = int(bad[0])
        after = f"sample {i + 1} starts" if i + 1 < len(lengths) else "the file ends"
        raise ValueError(f"{idx_path}: damaged: sample {i} of {lengths[i]} tokens would end at "
                         f"byte {ends[i]} of {bin_path}, where {after} at byte {follows[i]}; "
                         f"rebuild the dataset with tools/preprocess_flan.py")


@dataclass(frozen=True)
class GPTSample:
    """One GPT training row of n <= seq_length positions: `tokens` in, `labels` out."""

    tokens: np.ndarray       # int64 (n,)
    labels: np.ndarray       # int64 (n,), tokens shifted by one
    loss_mask: np.ndarray    # float32 (n,), 1 where the label is trained on
    task_id: int
    truncated: bool


@dataclass(frozen=True)
class T5Sample:
    """One T5 sample: encoder ids, decoder input ids and labels (same length as decoder ids)."""

    encoder_ids: np.ndarray  # int64 (e,)
    decoder_ids: np.ndarray  # int64 (d,), [decoder start] + labels[:-1]
    labels: np.ndarray       # int64 (d,), target + [eos]
    loss_mask: np.ndarray    # float32 (d,), all ones
    task_id: int
    truncated: bool


def gpt_input_keep(input_len: int, target_len: int, seq_length: int) -> int:
    """Input tokens kept when input ++ target ++ [eod] must fit seq_length + 1 tokens: inputs
    are cut first (from their end), but keep at least half the budget if they have it, so that
    a long input does not leave its target without loss tokens."""
    budget = seq_length + 1
    full = target_len + 1
    if input_len + full <= budget:
        return input_len
    keep_target = min(full, budget - min(input_len, budget // 2))
    return budget - keep_target


class MultiTaskDataset:
    """Random access to the samples of a dataset at an output prefix of preprocess_flan (the
    files its manifest `P_tasks.json` names)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.table, paths = dataset_paths(prefix)
        self._inputs = read_dataset_file(paths["inputs"] + ".idx", open_indexed)
        self._targets = read_dataset_file(paths["targets"] + ".idx", open_indexed)
        self._bin_paths = {side: paths[side] + ".bin" for side in ("inputs", "targets")}
        for side, indexed in (("inputs", self._inputs), ("targets", self._targets)):
            check_index_fits_data(indexed, paths[side] + ".idx")
        self.task_ids = read_dataset_file(
            paths["task_ids"], lambda path: np.load(path, allow_pickle=False).astype(np.int64))
        self.input_lengths = self._inputs.sequence_lengths.astype(np.int64)
        self.target_lengths = self._targets.sequence_lengths.astype(np.int64)
        self.task_names, self.vocab_size, self.tokenizer_info = read_dataset_file(
            manifest_path(prefix), lambda _: (
                [str(t["name"]) for t in sorted(self.table["tasks"], key=lambda t: t["id"])],
                int(self.table["vocab_size"]), dict(self.table["tokenizer"])))
        sizes = {"inputs": len(self.input_lengths), "targets": len(self.target_lengths),
                 "task ids": len(self.task_ids), "task table": int(self.table["num_samples"])}
        # written by preprocessing since it was recorded; older manifests: the vocabulary
        self.max_token_id = int(self.table.get("max_token_id", self.vocab_size - 1))
        if self.max_token_id >= self.vocab_size:
            raise ValueError(f"{manifest_path(prefix)}: records token ids up to "
                             f"{self.max_token_id}, past its vocabulary of {self.vocab_size}")
        if len(set(sizes.values())) != 1:
            raise ValueError(f"dataset at {prefix!r} is inconsistent: sample counts {sizes}")
        if len(self.task_ids) and (self.task_ids.min() < 0
                                   or self.task_ids.max() >= len(self.task_names)):
            raise ValueError(f"{paths['task_ids']}: task id outside the task table")

    def __len__(self) -> int:
        return len(self.task_ids)

    def _check_index(self, i: int) -> int:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples in {self.prefix}")
        return int(i) % len(self)

    def input_ids(self, i: int) -> np.ndarray:
        return self._checked_ids("inputs", self._inputs, i)

    def target_ids(self, i: int) -> np.ndarray:
        return self._checked_ids("targets", self._targets, i)

    def _checked_ids(self, side: str, indexed, i: int) -> np.ndarray:
        """Sample i's ids of one side, each within [0, max_token_id] (a flipped bit or data of
        a larger tokenizer would index past the embedding: an IndexError at TP=1, and at TP>1
        silently masked by the vocab-parallel embedding)."""
        i = self._check_index(i)
        ids = indexed[i].astype(np.int64)
        if ids.size and (ids.max() > self.max_token_id or ids.min() < 0):
            bad = int(ids.max() if ids.max() > self.max_token_id else ids.min())
            raise ValueError(f"{self._bin_paths[side]}: sample {i} holds token id {bad}, outside "
                             f"0..{self.max_token_id} ({manifest_path(self.prefix)}: vocabulary "
                             f"of {self.vocab_size}); the file is damaged or was written with "
                             f"another tokenizer: rebuild it with tools/preprocess_flan.py")
        return ids

    def task_id(self, i: int) -> int:
        return int(self.task_ids[self._check_index(i)])

    def check_vocab_size(self, model_vocab_size: int) -> None:
        """The model's (padded) vocabulary must cover every token id of the dataset."""
        if model_vocab_size < self.vocab_size:
            raise ValueError(f"dataset {self.prefix!r} was tokenised with vocab size "
                             f"{self.vocab_size} ({self.tokenizer_info['type']}), larger than "
                             f"the model's {model_vocab_size}")

    @property
    def eod(self) -> int:
        return int(self.tokenizer_info["eod"])

    @property
    def bos(self) -> int:
        return int(self.tokenizer_info["bos"])

    @property
    def eos(self) -> int:
        return int(self.tokenizer_info["eos"])

    @property
    def pad(self) -> int:
        return int(self.tokenizer_info["pad"])

    @property
    def decoder_start(self) -> int:
        """First decoder input of the T5 view: the tokenizer's decoder start, else bos."""
        return int(self.tokenizer_info.get("decoder_start", self.tokenizer_info["bos"]))

    @property
    def appends_eos(self) -> bool:
        """Whether the stored inputs and targets already end in eos (T5SentencePieceTokenizer)."""
        return bool(self.tokenizer_info.get("appends_eos", False))

    # ---- GPT view -------------------------------------------------------------------------
    def gpt_lengths(self, seq_length: int) -> np.ndarray:
        """Model positions of every sample in the GPT view: min(input + target, seq_length)."""
        return np.minimum(self.input_lengths + self.target_lengths, seq_length)

    def gpt_loss_tokens(self, seq_length: int) -> np.ndarray:
        """Loss tokens of every sample in the GPT view (its loss_mask's sum, gpt_sample), from
        the lengths alone: the positions minus the kept inputs but their last."""
        inp, tgt = self.input_lengths, self.target_lengths
        budget = seq_length + 1
        keep_target = np.minimum(tgt + 1, budget - np.minimum(inp, budget // 2))
        keep_in = np.where(inp + tgt + 1 <= budget, inp, budget - keep_target)
        positions = np.minimum(keep_in + tgt + 1, budget) - 1
        return np.maximum(positions - np.maximum(keep_in - 1, 0), 0)

    def t5_loss_tokens(self, decoder_seq_length: int) -> np.ndarray:
        """Loss tokens of every sample in the T5 view: its labels, all trained on."""
        return np.minimum(self._label_lengths(), decoder_seq_length)

    def gpt_sample(self, i: int, seq_length: int, loss_on_all_tokens: bool = False) -> GPTSample:
        """Row of input ++ target ++ [eod], cut to seq_length positions (see gpt_input_keep)."""
        inp, tgt = self.input_ids(i), self.target_ids(i)
        keep_in = gpt_input_keep(len(inp), len(tgt), seq_length)
        seq = np.concatenate([inp[:keep_in], tgt, [self.eod]])[:seq_length + 1]
        truncated = keep_in < len(inp) or len(seq) < len(inp) + len(tgt) + 1
        loss_mask = np.ones(len(seq) - 1, dtype=np.float32)
        if not loss_on_all_tokens:
            loss_mask[:max(keep_in - 1, 0)] = 0.0
        return GPTSample(seq[:-1], seq[1:], loss_mask, self.task_id(i), bool(truncated))

    def gpt_truncation(self, seq_length: int) -> dict:
        """How many samples (per task) the GPT view cuts at seq_length, and tokens dropped."""
        full = self.input_lengths + self.target_lengths
        return self._truncation_report(full > seq_length,
                                       {"tokens": np.maximum(full - seq_length, 0)})

    # ---- T5 view --------------------------------------------------------------------------
    def t5_lengths(self, encoder_seq_length: int, decoder_seq_length: int) -> np.ndarray:
        """(n, 2) encoder and decoder lengths of every sample in the T5 view."""
        return np.stack([np.clip(self.input_lengths, 1, encoder_seq_length),
                         np.minimum(self._label_lengths(), decoder_seq_length)], axis=1)

    def _label_lengths(self) -> np.ndarray:
        return self.target_lengths + (0 if self.appends_eos else 1)

    def _cut(self, ids: np.ndarray, length: int) -> np.ndarray:
        """ids cut to `length`; with appends_eos the eos stays last (HF's truncation)."""
        if len(ids) <= length or not self.appends_eos:
            return ids[:length]
        return np.concatenate([ids[:length - 1], ids[-1:]])

    def t5_sample(self, i: int, encoder_seq_length: int, decoder_seq_length: int) -> T5Sample:
        inp, tgt = self.input_ids(i), self.target_ids(i)
        if len(inp) == 0:   # a zero-shot sample: the encoder reads just the end token
            inp = np.array([self.eos], dtype=np.int64)
        full = tgt if self.appends_eos else np.concatenate([tgt, [self.eos]])
        labels = self._cut(full, decoder_seq_length)
        decoder = np.concatenate([[self.decoder_start], labels[:-1]])
        truncated = len(inp) > encoder_seq_length or len(full) > decoder_seq_length
        return T5Sample(self._cut(inp, encoder_seq_length), decoder.astype(np.int64),
                        labels.astype(np.int64), np.ones(len(labels), dtype=np.float32),
                        self.task_id(i), bool(truncated))

    def t5_truncation(self, encoder_seq_length: int, decoder_seq_length: int) -> dict:
        """How many samples (per task) the T5 view cuts, per side, and tokens dropped."""
        labels = self._label_lengths()
        enc_cut = self.input_lengths > encoder_seq_length
        dec_cut = labels > decoder_seq_length
        report = self._truncation_report(enc_cut | dec_cut, {
            "encoder_tokens": np.maximum(self.input_lengths - encoder_seq_length, 0),
            "decoder_tokens": np.maximum(labels - decoder_seq_length, 0)})
        report["inputs_truncated"] = int(enc_cut.sum())
        report["targets_truncated"] = int(dec_cut.sum())
        return report

    def _truncation_report(self, cut: np.ndarray, dropped: dict) -> dict:
        by_task = np.bincount(self.task_ids[cut], minlength=len(self.task_names))
        return {"samples": len(self), "truncated": int(cut.sum()),
                "dropped": {k: int(v.sum()) for k, v in dropped.items()},
                "truncated_by_task": {self.task_names[t]: int(n)
                                      for t, n in enumerate(by_task) if n}}
