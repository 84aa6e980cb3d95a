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
import os
import sys
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynapipe_ext.report.doc_sections import write_section  # noqa: E402
from megatron.bench.tensor_bench import bench_tensors, time_ms  # noqa: E402
from tools.benchlib.ports import free_port  # noqa: E402
from tools.benchlib.workloads import machine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM = 16, 64
# the last builder with dense masks, for --baseline-builder
OLD_BUILDER = "git show 5844704:megatron/model/batch_tensors.py > /tmp/old_batch_tensors.py"


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
        write_section(REPO / "docs" / "BENCHMARKS.md", "attention",
                      "Attention and micro-batch tensors", body)
    return 0


if __name__ == "__main__":
    status = main()
    from megatron.base.distributed_setup import end_process
    end_process(status)     # not sys.exit: see end_process
