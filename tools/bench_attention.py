"""Micro-batch tensors and core attention, before vs after dropping dense masks.

1. Build time of one micro-batch's tensors (build_micro_batch, every key) for GPT 4x2048,
   1x8192 and a packed 1x8192 row, and T5 4x(2048, 512): this tree's builder against another
   one loaded from a file (`--baseline-builder`, e.g. the version that built [rows, 1, S, S]
   masks in numpy: `git show 5844704:megatron/model/batch_tensors.py > /tmp/old_bt.py`).
2. One core attention forward + backward (16 heads of 64, fp32, one row, causal): megatron-core's
   local DotProductAttention with a dense mask against SDPAttention fed by Segments, time and
   bytes saved for backward (saved_tensors_hooks, unique storages).

Writes the "attention" section of docs/BENCHMARKS.md with `--write-doc`.

    python tools/bench_attention.py [--baseline-builder FILE] [--lengths 1024 2048 4096]
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM = 16, 64
# the last builder with dense masks, for --baseline-builder
OLD_BUILDER = "git show 5844704:megatron/model/batch_tensors.py > /tmp/old_batch_tensors.py"


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


def saved_bytes(fn) -> int:
    """Bytes of the unique storages autograd keeps for backward while `fn` runs."""
    import torch
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def bench_attention(lengths, repeats: int) -> list[dict]:
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from dynapipe_ext.costs.model_spec import ModelSpec
    from megatron.model.attention import AttentionMask, SDPAttention, Segments
    from megatron.model.stages import build_transformer_config
    from megatron.base.distributed_setup import setup_model_parallel, teardown_model_parallel
    from tools.profile_cost_model import free_port
    torch.set_num_threads(1)
    spec = ModelSpec("gpt", 1, HEADS * HEAD_DIM, HEADS, 1024, max_position_embeddings=8192)
    rows = []
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())),
                        ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    setup_model_parallel(1, 1, seed=1)
    try:
        config = build_transformer_config(spec)
        modules = {name: cls(config, 1, AttnMaskType.causal, "self")
                   for name, cls in (("local + dense mask", DotProductAttention),
                                     ("SDPAttention", SDPAttention))}
        for s in lengths:
            q, k, v = (torch.randn(s, 1, HEADS, HEAD_DIM, requires_grad=True) for _ in range(3))
            masks = {"local + dense mask": torch.ones(s, s, dtype=torch.bool).triu(1)[None, None],
                     "SDPAttention": AttentionMask.of(Segments.full(1, s))}
            for name, module in modules.items():
                def step():
                    out, kept = saved_bytes(lambda: module(q, k, v, masks[name]))
                    out.sum().backward()
                    return kept
                kept = step()
                rows.append({"seq_len": s, "attention": name, "kept_mib": kept / 2**20,
                             "fwd_bwd_ms": time_ms(step, repeats)})
    finally:
        teardown_model_parallel()
    return rows


def markdown(tensor_rows, attention_rows, command: str) -> str:
    from tools.bench_planner import machine
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Command: `{command}`  ", f"Date: {when}  ", f"Machine: {machine()}", "",
             "Micro-batch tensors (build_micro_batch, every key, median ms; before = the "
             "builder that made [rows, 1, S, S] numpy masks, after = tokens, positions, "
             f"labels, loss mask and Segments, all O(rows x S); the old builder: "
             f"`{OLD_BUILDER}`):", "",
             "| micro-batch | before ms | after ms | before MiB | after MiB |",
             "|---|---:|---:|---:|---:|"]
    for r in tensor_rows:
        before = (f"{r['before_ms']:.1f} | ", f"{r['before_bytes'] / 2**20:.1f} | ") \
            if "before_ms" in r else ("- | ", "- | ")
        lines.append(f"| {r['case']} | {before[0]}{r['after_ms']:.2f} | {before[1]}"
                     f"{r['after_bytes'] / 2**20:.2f} |")
    lines += ["", f"Core attention, one layer, {HEADS} heads x {HEAD_DIM}, fp32, one causal row "
              "(forward + backward median ms; MiB autograd keeps for backward):", "",
              "| seq len | attention | fwd+bwd ms | kept MiB |", "|---:|---|---:|---:|"]
    for r in attention_rows:
        lines.append(f"| {r['seq_len']} | {r['attention']} | {r['fwd_bwd_ms']:.0f} | "
                     f"{r['kept_mib']:.1f} |")
    lines += ["", "Before/after rows come from one invocation, so their ratio holds even when the "
              "machine is shared (its load average is in the machine line). Kept MiB: the local "
              "path keeps the [heads, S, S] softmax output, SDPAttention only q, k, v, the output "
              "and a logsumexp, so its memory grows with S, not S^2."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-builder", help="a batch_tensors.py to compare against")
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write-doc", action="store_true",
                        help="write the 'attention' section of docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    tensor_rows = bench_tensors(args.baseline_builder, args.repeats)
    attention_rows = bench_attention(args.lengths, max(1, args.repeats // 2))
    given = argv if argv is not None else sys.argv[1:]
    command = "python tools/bench_attention.py " + " ".join(a for a in given
                                                           if a != "--write-doc")
    body = markdown(tensor_rows, attention_rows, command.strip())
    print(body)
    if args.write_doc:
        from tools.doc_sections import write_section
        write_section(REPO / "docs" / "BENCHMARKS.md", "attention",
                      "Attention and micro-batch tensors", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
