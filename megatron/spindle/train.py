"""Train the multi-task multi-modal model of mt_model.py with Spindle: text from a tokenised FLAN
dataset (tools/preprocess_flan.py, e.g. SentencePiece), image and audio encoders from
megatron-core blocks on synthetic inputs, LM / classification heads and a two-input contrastive
image-text head. Launched like the other trainers:

    torchrun --nproc-per-node 2 pretrain_spindle.py --data-path data/quickstart/flan \\
      --tokenizer-type SentencePieceTokenizer --tokenizer-model data/quickstart/sp.model \\
      --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
      --train-iters 20 --lr 1e-3 --save runs/spindle --save-interval 10

Rank 0 prints what Spindle decided (waves, allocation, placement) before training. Each rank
builds only its placed components, each with its own Adam optimizer. Checkpoints hold one file
per component (weights and its optimizer state, written by the lowest rank holding it), loaded
with torch.load(weights_only=True), plus a JSON record of the iteration; so a run can resume
under another plan or world size."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from dynapipe_ext.spindle.checker import check_wave_plan
from dynapipe_ext.spindle.estimator import CommModel, Estimator, LayerFit
from dynapipe_ext.spindle.scheduler import STRATEGIES, Cluster, plan, plan_summary
from megatron.data.multitask_dataset import MultiTaskDataset
from megatron.data.tokenizers import add_tokenizer_args, build_tokenizer, tokenizer_mismatch, \
    tokenizer_spec_from_args
from megatron.spindle.mt_model import (TinyMTConfig, build_component, describe,
                                       flan_task_data, loss_normaliser)
from megatron.spindle.runtime import WaveRuntime
from megatron.training.arguments import add_flag_group

CHECKPOINT_FORMAT = "megatron-dynapipe-spindle/1"
SHARDED_OPTIMIZER_REFUSED = (
    "--use-distributed-optimizer is not supported here: each Spindle component steps its "
    "own torch Adam on the ranks that hold it, with no data-parallel gradient buffer to "
    "shard")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_spindle.py",
                                     description=__doc__.splitlines()[0])
    add_flag_group(parser, "model", ["num_layers", "hidden_size", "num_attention_heads",
                                     "seq_length"],
                   num_layers=dict(default=2, help="layers of the shared backbone"),
                   seq_length=dict(default=64, help="text tokens per sample"))
    add_flag_group(parser, "optimizer", ["lr", "train_iters", "seed",
                                         "use_distributed_optimizer"],
                   lr=dict(default=1e-3), train_iters=dict(default=10, required=False))
    add_flag_group(parser, "data", ["data_path"])
    add_tokenizer_args(parser)
    add_flag_group(parser, "checkpoint", ["save", "save_interval", "load", "log_interval"])
    group = parser.add_argument_group("Spindle")
    group.add_argument("--spindle-plan", choices=STRATEGIES, default="spindle",
                       help="the plan to train under (uniform / sequential: the baselines)")
    group.add_argument("--spindle-encoder-layers", type=int, default=1,
                       help="layers of each modality encoder")
    return parser


def analytic_estimator(model) -> Estimator:
    """Costs Spindle plans with at start (stated, not profiled: planning is then the same on
    every run and rank): 2 ms per layer plus 6 x parameters per token at 10 GFLOP/s, links of
    100 us and 1 GB/s."""
    return Estimator({c.layer_kind: LayerFit(2e-3, 6 * c.params_per_layer / 1e10)
                      for c in model.components}, CommModel(1e-4, 1e-9), dtype_bytes=4)


def _iteration_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def save_checkpoint(root: str, iteration: int, runtime: WaveRuntime, optimizers: dict,
                    summary: list[str]) -> None:
    """One file per component, written by the lowest rank that holds it; then rank 0 writes
    the record and points `latest` at it."""
    out = _iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    for comp, module in runtime.modules.items():
        if min(runtime.users[comp]) == dist.get_rank():
            tmp = out / f".{comp}.pt.partial"
            torch.save({"model": module.state_dict(),
                        "optimizer": optimizers[comp].state_dict()}, tmp)
            os.replace(tmp, out / f"{comp}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        record = {"format": CHECKPOINT_FORMAT, "iteration": iteration,
                  "components": sorted(runtime.users), "plan": summary}
        (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
        tmp = Path(root) / ".latest.partial"
        tmp.write_text(f"{iteration}\n")
        os.replace(tmp, Path(root) / "latest")
    dist.barrier()


def load_checkpoint(root: str, runtime: WaveRuntime, optimizers: dict) -> int:
    """Load this rank's components from the latest checkpoint under `root`; returns its
    iteration. Only tensors and plain containers are read (weights_only)."""
    latest = Path(root) / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"--load {root}: no checkpoint (no 'latest' file)")
    iteration = int(latest.read_text().strip())
    folder = _iteration_dir(root, iteration)
    record = json.loads((folder / "record.json").read_text())
    if record.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{folder}: not a Spindle checkpoint (format {record.get('format')!r})")
    for comp, module in runtime.modules.items():
        path = folder / f"{comp}.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no state for component {comp!r}")
        state = torch.load(path, map_location="cpu", weights_only=True)
        module.load_state_dict(state["model"])
        optimizers[comp].load_state_dict(state["optimizer"])
    return iteration


def train(argv=None) -> list[float]:
    """Parse flags, plan, build, train; returns the loss of every iteration run here."""
    from megatron.base.distributed_setup import setup_model_parallel
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.use_distributed_optimizer:
        parser.error(SHARDED_OPTIMIZER_REFUSED)
    setup_model_parallel(1, 1, seed=args.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(args.data_path) != 1:
        raise ValueError(f"--data-path: one dataset prefix (no blends here), got {args.data_path}")
    dataset = MultiTaskDataset(args.data_path[0])
    tokenizer = build_tokenizer(**tokenizer_spec_from_args(args))
    mismatch = tokenizer_mismatch(dataset.tokenizer_info, tokenizer)
    if mismatch:
        raise ValueError(f"--data-path {args.data_path[0]}: {mismatch}")
    cfg = TinyMTConfig(hidden=args.hidden_size, heads=args.num_attention_heads,
                       backbone_layers=args.num_layers, text_len=args.seq_length,
                       encoder_layers=args.spindle_encoder_layers,
                       vocab_size=tokenizer.vocab_size)
    model = describe(cfg)
    wave_plan = plan(args.spindle_plan, model, analytic_estimator(model),
                     Cluster(world, 8 * 2**30))
    check_wave_plan(wave_plan)
    summary = plan_summary(wave_plan)
    if rank == 0:
        print("Spindle plan (waves, allocation, placement):\n" + "\n".join(summary), flush=True)
    runtime = WaveRuntime(wave_plan, model, lambda name: build_component(cfg, name, args.seed),
                          lambda t: loss_normaliser(cfg, t), rank)
    optimizers = {comp: torch.optim.Adam(module.parameters(), lr=args.lr)
                  for comp, module in runtime.modules.items()}
    start = load_checkpoint(args.load, runtime, optimizers) if args.load else 0
    if rank == 0 and args.load:
        print(f"resumed from {args.load} at iteration {start}", flush=True)
    losses = []
    for it in range(start, args.train_iters):
        for opt in optimizers.values():
            opt.zero_grad(set_to_none=True)
        loss = runtime.run(flan_task_data(cfg, dataset, args.seed, it))
        for opt in optimizers.values():
            opt.step()
        losses.append(loss.item())
        if rank == 0 and (it + 1) % (args.log_interval or 1) == 0:
            print(f"iteration {it + 1}/{args.train_iters} loss {loss.item():.6f}", flush=True)
        done = it + 1
        if args.save and (done == args.train_iters or
                          (args.save_interval and done % args.save_interval == 0)):
            save_checkpoint(args.save, done, runtime, optimizers, summary)
    return losses
