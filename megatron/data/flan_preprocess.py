"""FLAN dump -> tokenised multi-task indexed dataset: read, tokenise in worker processes, write,
and account for every line read (read = written + rejected by reason)."""
from __future__ import annotations

import os
import sys
import threading
import time
from array import array
from collections import Counter, deque
from contextlib import closing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from megatron.data.flan_indexed import TABLE_FORMAT, FlanDatasetWriter, dataset_files
from megatron.data.flan_records import (EMPTY_SAMPLE, EMPTY_TARGET, SKIPPED_BY_DEFAULT,
                                        TOKENIZER_ERROR, BadInputError, FlanRecord,
                                        ReadCounts, Rejection, read_records)
from megatron.data.tokenizers import TokenizerError, build_tokenizer

PERCENTILES = (50, 90, 99)
_worker_tokenizer = None
_worker_chat = False


def _exit_when_orphaned(parent_pid: int, poll_s: float = 1.0) -> None:
    """A worker whose parent died (killed, not shut down) would otherwise wait forever."""
    while True:
        time.sleep(poll_s)
        if os.getppid() != parent_pid:
            os._exit(1)


def _init_worker(tokenizer_spec: dict, parent_pid: Optional[int] = None,
                 chat: bool = False) -> None:
    global _worker_tokenizer, _worker_chat
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    if parent_pid is not None:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    _worker_tokenizer = build_tokenizer(**tokenizer_spec)
    _worker_chat = chat


def _tokenize_pairs(pairs: Sequence[tuple[str, str]]
                    ) -> list[Union[tuple[np.ndarray, np.ndarray], str]]:
    """(input ids, target ids) per pair, the input after the tokenizer's `input_prefix` (a
    decoder model's bos), or with the chat template the prompt and reply of
    HuggingFaceTokenizer.chat_ids; the tokenizer's error text for a pair it fails on (a batch
    is then encoded pair by pair to find which)."""
    tok = _worker_tokenizer
    prefix = list(tok.input_prefix)

    def ids(tokens, lead=()):
        return np.asarray([*lead, *tokens], dtype=np.int32)

    def one(pair):
        if _worker_chat:
            return tuple(ids(part) for part in tok.chat_ids(*pair))
        return ids(tok.encode(pair[0]), prefix), ids(tok.encode(pair[1]))

    if not _worker_chat:
        try:
            inputs = tok.encode_batch([p[0] for p in pairs])
            targets = tok.encode_batch([p[1] for p in pairs])
            return [(ids(i, prefix), ids(t)) for i, t in zip(inputs, targets)]
        except Exception:   # noqa: BLE001 - any tokenizer failure is a per-record rejection
            pass
    out: list = []
    for pair in pairs:
        try:
            out.append(one(pair))
        except Exception as exc:   # noqa: BLE001
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def _with_records(chunk: list[FlanRecord], results: list
                  ) -> Iterator[Union[tuple[FlanRecord, np.ndarray, np.ndarray], Rejection]]:
    for rec, result in zip(chunk, results):
        yield (Rejection(rec.path, rec.line, TOKENIZER_ERROR, result)
               if isinstance(result, str) else (rec, *result))


def _chunks(records: Iterable[FlanRecord], size: int) -> Iterator[list[FlanRecord]]:
    chunk: list[FlanRecord] = []
    for rec in records:
        chunk.append(rec)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def tokenize_records(records: Iterable[FlanRecord], tokenizer_spec: dict, workers: int = 1,
                     chunk_size: int = 256, chat: bool = False
                     ) -> Iterator[Union[tuple[FlanRecord, np.ndarray, np.ndarray], Rejection]]:
    """(record, input ids, target ids) in input order, or a Rejection (FILE:LINE) for a
    record the tokenizer fails on; workers > 1 tokenise in spawned processes with a bounded
    number of chunks in flight. `chat`: through the tokenizer's chat template."""
    if workers <= 1:
        _init_worker(tokenizer_spec, chat=chat)
        for chunk in _chunks(records, chunk_size):
            yield from _with_records(chunk, _tokenize_pairs([(r.inputs, r.targets)
                                                             for r in chunk]))
        return
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"),
                               initializer=_init_worker,
                               initargs=(tokenizer_spec, os.getpid(), chat))
    in_flight: deque = deque()
    try:
        def drain_one():
            chunk, future = in_flight.popleft()
            try:
                results = future.result()
            except BrokenProcessPool as exc:
                raise RuntimeError("a tokenizer worker process died (out of memory?) while "
                                   f"tokenising {chunk[0].path} lines {chunk[0].line}-"
                                   f"{chunk[-1].line}") from exc
            return _with_records(chunk, results)

        for chunk in _chunks(records, chunk_size):
            in_flight.append((chunk, pool.submit(_tokenize_pairs,
                                                 [(r.inputs, r.targets) for r in chunk])))
            if len(in_flight) > 2 * workers + 2:
                yield from drain_one()
        while in_flight:
            yield from drain_one()
    finally:
        for _, future in in_flight:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def length_stats(lengths: np.ndarray) -> dict:
    """Count, sum, mean, percentiles and max of a length array."""
    if lengths.size == 0:
        return {"count": 0, "tokens": 0}
    stats = {"count": int(lengths.size), "tokens": int(lengths.sum()),
             "mean": round(float(lengths.mean()), 2)}
    for p, v in zip(PERCENTILES, np.percentile(lengths, PERCENTILES)):
        stats[f"p{p}"] = float(v)
    stats["max"] = int(lengths.max())
    return stats


class _TaskRegistry:
    """Task ids in order of first appearance, with per-task source/template counts."""

    def __init__(self):
        self.ids: dict[str, int] = {}
        self.sources: list[Counter] = []
        self.templates: list[Counter] = []

    def add(self, rec: FlanRecord) -> int:
        tid = self.ids.setdefault(rec.task, len(self.ids))
        if tid == len(self.sources):
            self.sources.append(Counter())
            self.templates.append(Counter())
        self.sources[tid][rec.source] += 1
        self.templates[tid][rec.template_type] += 1
        return tid

    def table(self, counts: np.ndarray) -> list[dict]:
        return [{"id": tid, "name": name, "count": int(counts[tid]),
                 "sources": dict(self.sources[tid]), "template_types": dict(self.templates[tid])}
                for name, tid in self.ids.items()]


def build_summary(counts: ReadCounts, written: int, input_lengths: np.ndarray,
                  target_lengths: np.ndarray, task_ids: np.ndarray, task_names: list[str]) -> dict:
    """Counts by reason, tokens and length percentiles, overall and per task."""
    per_task = {}
    for tid, name in enumerate(task_names):
        sel = task_ids == tid
        per_task[name] = {"inputs": length_stats(input_lengths[sel]),
                          "targets": length_stats(target_lengths[sel])}
    rejected = sum(counts.rejected.values())
    return {
        "samples": {"read": counts.read, "written": written, "rejected": rejected,
                    "rejected_by_reason": dict(counts.rejected)},
        "files": {"read": counts.files_read, "partly_read": list(counts.files_partly_read),
                  "rejected_by_reason": dict(counts.files_rejected)},
        "tokens": {"inputs": int(input_lengths.sum()), "targets": int(target_lengths.sum())},
        "lengths": {"inputs": length_stats(input_lengths), "targets": length_stats(target_lengths)},
        "per_task": per_task,
    }


def format_summary(summary: dict, max_tasks: int = 20) -> str:
    """A human-readable summary table (the largest `max_tasks` tasks)."""
    s, f = summary["samples"], summary["files"]
    lines = [f"samples read {s['read']}, written {s['written']}, rejected {s['rejected']}"]
    lines += [f"  rejected ({reason}): {n}"
              for reason, n in sorted(s["rejected_by_reason"].items())]
    lines.append(f"files read {f['read']}, broke off after some lines (kept) "
                 f"{len(f['partly_read'])}, rejected {sum(f['rejected_by_reason'].values())}")
    lines += [f"  file broke off: {where}" for where in f["partly_read"]]
    lines += [f"  file rejected ({reason}): {n}"
              for reason, n in sorted(f["rejected_by_reason"].items())]
    lines.append(f"tokens: inputs {summary['tokens']['inputs']}, "
                 f"targets {summary['tokens']['targets']}")
    head = f"{'':34s}{'count':>8s}" + "".join(f"{k:>8s}" for k in ("mean", "p50", "p90", "p99",
                                                                   "max"))
    lines.append("lengths (tokens)")
    lines.append(head)

    def row(label, st):
        vals = "".join(f"{st.get(k, 0):8.0f}" for k in ("mean", "p50", "p90", "p99", "max"))
        return f"{label[:34]:34s}{st['count']:8d}{vals}"

    for side in ("inputs", "targets"):
        lines.append(row(f"all {side}", summary["lengths"][side]))
    tasks = sorted(summary["per_task"].items(), key=lambda kv: -kv[1]["inputs"]["count"])
    for name, st in tasks[:max_tasks]:
        short = name if len(name) <= 29 else name[:28] + "~"
        lines.append(row(f"{short} in", st["inputs"]))
        lines.append(row(f"{short} tgt", st["targets"]))
    if len(tasks) > max_tasks:
        lines.append(f"... {len(tasks) - max_tasks} more tasks in the summary JSON")
    return "\n".join(lines)


def preprocess_flan(paths: Sequence[str], output_prefix: str, tokenizer_spec: dict,
                    workers: int = 1, skip_bad: bool = False, task_field: Optional[str] = None,
                    chunk_size: int = 256, progress: bool = True,
                    chat_template: bool = False) -> dict:
    """Tokenise FLAN dump files into the dataset at `output_prefix`; returns the summary.
    Raises BadInputError (file, line, reason) on bad input unless skip_bad. `chat_template`:
    each input becomes a user turn and its target the assistant's reply, rendered by the
    HuggingFaceTokenizer's chat template (the loss stays on the target: the reply)."""
    from tqdm import tqdm

    tokenizer = build_tokenizer(**tokenizer_spec)
    if chat_template:
        if not hasattr(tokenizer, "chat_template"):
            raise TokenizerError(f"--chat-template needs --tokenizer-type HuggingFaceTokenizer "
                                 f"(a checkpoint's tokenizer), not {tokenizer.name}")
        tokenizer.chat_template()         # none: one error now, not one per sample
    counts = ReadCounts()
    registry = _TaskRegistry()
    in_lens, tgt_lens, tids = array("i"), array("i"), array("i")
    records = read_records(paths, counts, skip_bad=skip_bad, task_field=task_field)

    def reject(rejection: Rejection) -> None:
        if not skip_bad and rejection.reason not in SKIPPED_BY_DEFAULT:
            raise rejection.error()
        counts.reject(rejection.reason, f"{rejection.path}:{rejection.line}")

    tokenized = tokenize_records(records, tokenizer_spec, workers, chunk_size, chat_template)
    with FlanDatasetWriter(output_prefix, tokenizer.vocab_size) as writer, closing(tokenized):
        bar = tqdm(unit=" samples", disable=not progress, file=sys.stderr, mininterval=0.5,
                   desc="tokenising")
        for item in tokenized:
            bar.update(1)
            if isinstance(item, Rejection):
                reject(item)
                continue
            rec, in_ids, tgt_ids = item
            if tgt_ids.size == 0:   # an input of no tokens is fine (the view adds what it needs)
                empty_input = (not rec.inputs if chat_template
                               else in_ids.size == len(tokenizer.input_prefix))
                reject(Rejection(rec.path, rec.line, EMPTY_SAMPLE if empty_input else EMPTY_TARGET,
                                 "it tokenises to no tokens"))
                continue
            tid = registry.add(rec)
            writer.add(in_ids, tgt_ids, tid)
            in_lens.append(in_ids.size)
            tgt_lens.append(tgt_ids.size)
            tids.append(tid)
        bar.close()
        if len(writer) == 0:
            raise BadInputError(", ".join(paths), None, "no samples",
                                f"nothing valid to write; {counts.read} line(s) read, "
                                f"rejected: {counts.reasons()}")
        task_ids = np.frombuffer(tids, dtype=np.int32)
        summary = build_summary(counts, len(writer), np.frombuffer(in_lens, dtype=np.int32),
                                np.frombuffer(tgt_lens, dtype=np.int32), task_ids,
                                list(registry.ids))
        if summary["samples"]["read"] != summary["samples"]["written"] + summary["samples"][
                "rejected"]:
            raise RuntimeError(f"sample accounting broken: {summary['samples']}")
        summary["output_prefix"] = output_prefix
        summary["inputs_files"] = list(paths)
        summary["tokenizer"] = tokenizer_info = tokenizer.describe()
        table = {"format": TABLE_FORMAT, "tokenizer": tokenizer_info,
                 "vocab_size": tokenizer.vocab_size, "num_samples": len(writer),
                 "tokens": summary["tokens"], "chat_template": chat_template,
                 "tasks": registry.table(np.bincount(task_ids, minlength=len(registry.ids)))}
        writer.finalize(table, summary)
    summary["files_written"] = dataset_files(output_prefix)
    summary["cleanup"] = writer.cleanup
    return summary
