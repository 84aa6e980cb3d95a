"""Build time and size of one micro-batch's tensors (build_micro_batch, every key) for a few
long micro-batches: this tree's builder against another loaded from a file
(tools/bench_attention.py compares it with the builder that made dense masks)."""
from __future__ import annotations

import importlib.util
import statistics
import time

import numpy as np


def load_builder(path: str | None):
    """build_micro_batch of this tree, or of the module file at `path`."""
    if path is None:
        from megatron.model.batch_tensors import build_micro_batch
        return build_micro_batch
    spec = importlib.util.spec_from_file_location("baseline_batch_tensors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_micro_batch


def tensor_cases(seed: int = 0):
    """(name, model, MicroBatch, samples) of the measured micro-batches."""
    from dynapipe_ext.batching.microbatch import MicroBatch
    rng = np.random.default_rng(seed)

    def gpt(n):
        return rng.integers(1, 30000, n), rng.integers(1, 30000, n), np.ones(n, np.float32)

    def t5(ne, nd):
        return (rng.integers(1, 30000, ne), rng.integers(1, 30000, nd),
                rng.integers(1, 30000, nd), np.ones(nd, np.float32))

    return [
        ("GPT 4x2048", "gpt", MicroBatch(rows=tuple((i,) for i in range(4)), seq_len=2048),
         {i: gpt(2048 - 100 * i) for i in range(4)}),
        ("GPT 1x8192", "gpt", MicroBatch(rows=((0,),), seq_len=8192), {0: gpt(8000)}),
        ("GPT 1x8192 packed (16 samples)", "gpt",
         MicroBatch(rows=(tuple(range(16)),), seq_len=8192), {i: gpt(500) for i in range(16)}),
        ("T5 4x(2048, 512)", "t5",
         MicroBatch(rows=tuple((i,) for i in range(4)), seq_len=2048, dec_seq_len=512),
         {i: t5(2048 - 100 * i, 512 - 20 * i) for i in range(4)}),
    ]


def time_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def batch_bytes(batch) -> int:
    total = 0
    for value in batch.values():
        tensor = getattr(value, "ids", value)
        total += tensor.numel() * tensor.element_size()
    return total


def bench_tensors(builder_path: str | None, repeats: int) -> list[dict]:
    new, old = load_builder(None), load_builder(builder_path) if builder_path else None
    rows = []
    for name, model, mb, samples in tensor_cases():
        row = {"case": name}
        for label, build in (("after", new), ("before", old)):
            if build is None:
                continue
            row[f"{label}_ms"] = time_ms(lambda: build(mb, samples, model, 0), repeats)
            row[f"{label}_bytes"] = batch_bytes(build(mb, samples, model, 0))
        rows.append(row)
    return rows
