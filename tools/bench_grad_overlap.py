"""How much of the data-parallel gradient reduction hides behind backward.

Run under torchrun with a data-parallel layout and the usual pretrain flags, e.g.
  torchrun --nproc-per-node 2 tools/bench_grad_overlap.py --model gpt --iters 20 -- \
      --data-path data/quickstart/flan --tokenizer-type SentencePieceTokenizer ...
Iterations alternate between the GradBuffer reducing buckets during each stage's last backward
(overlap) and reducing everything after the plan (no overlap). Exposed reduction time of an
iteration = from the moment the LAST replica ends its plan (its last backward; GradBuffer.finish
is called) until every replica has every bucket reduced (wall clock, so replicas on one host
compare; waiting for a slower replica's backward is not counted). Without overlap that is the
whole reduction. Hidden share = 1 - median exposed (overlap) / median exposed (no overlap).
Rank 0 prints one JSON line.
"""
import argparse
import json
import statistics
import warnings


def main(argv=None) -> int:
    warnings.filterwarnings(
        "ignore", message=r".*(Apex|Transformer Engine)( and Apex)? (is|are) not installed")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("gpt", "t5"), default="gpt")
    parser.add_argument("--iters", type=int, default=20, help="iterations (half of each kind)")
    parser.add_argument("--warmup", type=int, default=2, help="iterations not counted")
    parser.add_argument("train_flags", nargs=argparse.REMAINDER,
                        help="after --: pretrain_gpt.py / pretrain_t5.py flags")
    args = parser.parse_args(argv)
    flags = [f for f in args.train_flags if f != "--"]

    import torch.distributed as dist

    from megatron.training.arguments import parse_args
    from megatron.training.training import build_run, train_step
    cfg = parse_args(args.model, flags + ["--train-iters", str(args.warmup + args.iters)])
    run = build_run(cfg, verbose=False)
    if run.layout.dp < 2:
        raise SystemExit("bench_grad_overlap needs data parallelism (world size > TP x PP)")
    buffer = run.optimizer.grad_buffer
    mine = []                                # (overlap, finish called, all reduced)
    try:
        for iteration in range(cfg.train_iters):
            buffer.overlap = iteration % 2 == 0
            train_step(run, iteration)
            if iteration >= args.warmup:
                stats = buffer.last_stats
                mine.append((buffer.overlap, stats["called_at"], stats["done_at"]))
    finally:
        run.close()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    waits = {True: [], False: []}
    for records in zip(*everyone):
        waits[records[0][0]].append(max(r[2] for r in records) - max(r[1] for r in records))
    exposed, total = statistics.median(waits[True]), statistics.median(waits[False])
    if run.layout.rank == 0:
        print(json.dumps({
            "model": args.model, "dp": run.layout.dp, "tp": run.layout.tp, "pp": run.layout.pp,
            "grad_numel": buffer.data.numel(), "buckets": len(buffer.buckets),
            "bf16": cfg.bf16, "median_wait_overlap_ms": round(1e3 * exposed, 2),
            "median_wait_after_backward_ms": round(1e3 * total, 2),
            "hidden_share": round(1.0 - exposed / total, 3) if total > 0 else None,
            "iterations_each": len(waits[True])}), flush=True)
    return 0


if __name__ == "__main__":
    status = main()
    from megatron.base.distributed_setup import end_process
    end_process(status)     # not sys.exit: see end_process
