"""A FlexTP training loop: the FlexGPT on TP ranks (gloo), FlexAdamW, the `--tp-balance` Balancer,
per-iteration records (wall time, measured compute time, partition, skipped units, loss).

Data: FLAN-like samples of megatron.data.flan_synthetic (the generator behind the quickstart
data) as bytes (vocabulary 256, no tokenizer to train), packed into a stream of sequences; every
TP rank reads the same batches. Not integrated with pretrain_gpt.py (no PP / DP / dynamic
micro-batches here); see docs/BENCHMARKS.md "FlexTP".

    torchrun --nproc-per-node 2 -m megatron.flextp.train --tp-balance semi --train-iters 50
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from dynapipe_ext.flextp.partition import even_partition
from megatron.flextp.balance import KINDS, Balancer, rank_work
from megatron.flextp.layers import COMM, modelled_clock, modelled_seconds, slowdown_factor
from megatron.flextp.model import FlexGPT, FlexGPTConfig
from megatron.flextp.optim import FlexAdamW
from megatron.base.distributed_setup import end_process
from megatron.training.arguments import add_flag_group


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flag_group(p, "flextp", ["tp_balance", "flextp_interval", "flextp_max_drop_fraction",
                                 "flextp_accuracy_weight", "flextp_min_horizon"], title="")
    add_flag_group(p, "model", ["num_layers", "hidden_size", "num_attention_heads",
                                "ffn_hidden_size"], title="",
                   num_layers=dict(default=2, help=None),
                   hidden_size=dict(required=False, default=256),
                   num_attention_heads=dict(required=False, default=8),
                   ffn_hidden_size=dict(default=1024, help=None))
    add_flag_group(p, "flextp", ["flextp_ffn_unit"], title="", flextp_ffn_unit=dict(
        default=32, help="ffn columns per MLP unit (what FlexTP moves or skips)"))
    add_flag_group(p, "model", ["seq_length"], title="", seq_length=dict(default=128, help=None))
    add_flag_group(p, "planning", ["micro_batch_size"], title="",
                   micro_batch_size=dict(default=8, help=None))
    add_flag_group(p, "optimizer", ["train_iters", "lr", "lr_warmup_iters", "weight_decay",
                                    "seed"], title="",
                   train_iters=dict(required=False, default=200),
                   lr_warmup_iters=dict(default=10))
    p.add_argument("--pin-cores", action="store_true",
                   help="pin TP rank r to CPU core r (for the taskset contention runs)")
    add_flag_group(p, "checkpoint", ["eval_iters"], title="", eval_iters=dict(
        default=0, help="after training, the mean loss of this many held-out batches with "
                        "every unit computed (no skips): what the trained weights are worth"))
    p.add_argument("--log-json", default=None, help="rank 0 writes the per-iteration records")
    return p


def byte_batches(seq_length: int, batch: int, seed: int):
    """Endless [batch, seq] (tokens, labels) of FLAN-like text as bytes, same on every rank."""
    from megatron.data.flan_synthetic import synthetic_samples
    stream: list[int] = []
    n = 0
    while True:
        for sample in synthetic_samples(2000, seed=seed + n):
            stream += list((sample["inputs"] + "\n" + sample["targets"] + "\n\n").encode())
            while len(stream) >= batch * (seq_length + 1):
                chunk = torch.tensor(stream[:batch * (seq_length + 1)]).view(batch, -1)
                del stream[:batch * (seq_length + 1)]
                yield chunk[:, :-1], chunk[:, 1:]
        n += 1


EVAL_SEED = 10**6   # held-out data: the same batches for every run and seed


def evaluate(model, args) -> float:
    """Mean loss of `args.eval_iters` held-out batches, every unit computed (skips cleared)."""
    for kind in KINDS:
        for block in model.blocks(kind):
            block.set_drops(())
    data = byte_batches(args.seq_length, args.micro_batch_size, EVAL_SEED)
    with torch.no_grad():
        losses = [model(*next(data)).item() for _ in range(args.eval_iters)]
    return sum(losses) / len(losses)


def train(args, on_iteration=None) -> list[dict]:
    """Run args.train_iters iterations on the initialised world (all ranks = one TP group)."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    if args.pin_cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    group = dist.new_group(list(range(tp)))
    cfg = FlexGPTConfig(vocab_size=256, seq_length=args.seq_length, hidden=args.hidden_size,
                        num_layers=args.num_layers, num_heads=args.num_attention_heads,
                        ffn=args.ffn_hidden_size, ffn_unit=args.flextp_ffn_unit)
    cfg.check()
    parts = {"attn": even_partition(cfg.num_heads, tp), "mlp": even_partition(cfg.mlp_units, tp)}
    slowdown, modelled = slowdown_factor(rank), modelled_clock()
    model = FlexGPT(cfg, parts, rank, group, seed=args.seed, slowdown=1 if modelled else slowdown)
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or ".ln" in n
                or n.startswith("ln_f")]
    opt = FlexAdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                    no_decay=no_decay)
    balancer = Balancer(model, opt, args.tp_balance, group, rank, tp,
                        interval=args.flextp_interval,
                        max_fraction=args.flextp_max_drop_fraction,
                        accuracy_weight=args.flextp_accuracy_weight,
                        min_horizon=args.flextp_min_horizon)
    data = byte_batches(args.seq_length, args.micro_batch_size, args.seed)
    records = []
    dist.barrier(group=group)
    for it in range(args.train_iters):
        if on_iteration is not None:
            on_iteration(it)
        tokens, labels = next(data)
        start = time.perf_counter()
        COMM["seconds"] = 0.0
        loss = model(tokens, labels)
        loss.backward()
        lr = args.lr * min(1.0, (it + 1) / max(1, args.lr_warmup_iters))
        opt.step(lr)
        opt.zero_grad()
        compute = time.perf_counter() - start - COMM["seconds"]
        if modelled:   # forward + backward: 3 x the forward's multiply-adds per token
            compute = modelled_seconds(3 * rank_work(model) * tokens.numel(), slowdown)
        record = balancer.observe(max(compute, 1e-6))
        record.update(iteration=it, loss=loss.item(), seconds=time.perf_counter() - start,
                      counts_now={k: list(model.blocks(k)[0].partition.counts())
                                  for k in KINDS},
                      drops_now={k: list(v) for k, v in balancer.drop_counts.items()})
        records.append(record)
    if args.eval_iters:
        records[-1]["eval_loss"] = evaluate(model, args)
    return records


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        records = train(args)
        if dist.get_rank() == 0:
            last = records[-1]
            held_out = (f", held-out loss {last['eval_loss']:.4f}" if "eval_loss" in last
                        else "")
            print(f"[flextp] {args.tp_balance}: {len(records)} iterations, final loss "
                  f"{last['loss']:.4f}{held_out}, mlp units per rank {last['counts_now']['mlp']}")
            if args.log_json:
                with open(args.log_json, "w") as f:
                    json.dump(records, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process(0)
