#!/usr/bin/env python
"""Loss and perplexity of a checkpoint (trained, or converted with tools/convert_checkpoint.py)
on a dataset, at any TP / PP / DP, and the logits it gives some samples.

Takes the flags of pretrain_gpt.py / pretrain_t5.py (--model picks which; model shape,
parallelism, tokenizer, --data-path, --eval-iters, ...) and --load DIR. The checkpoint's weights
are loaded as --finetune loads them (any layout, no optimizer state needed), then --eval-iters
global batches of the validation data (--valid-data-path, the held-out share of --split, else
--data-path itself) run through the trainer's forward-only plans, as validation does in
training. Rank 0 prints one line (loss, perplexity, tokens, per-task losses) and, with
--stats-file, appends it as a JSON record.

--print-logits N prints, for the first N samples of the first validation batch, one JSON line
each: the token ids the model read and, per position, the --logits-top-k highest logits (over
the real vocabulary, padded rows left out) with their token ids; the first id of each position
is the greedy next token. It needs --pipeline-model-parallel-size 1 (any TP).

  torchrun --nproc-per-node 2 tools/evaluate.py --model gpt --load ckpt --data-path data/flan \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --tensor-model-parallel-size 2
"""
import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def split_args(argv):
    """(this tool's own flags, the trainer's flags)."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--model", choices=("gpt", "t5"), default="gpt")
    own.add_argument("--print-logits", type=int, default=0, metavar="N")
    own.add_argument("--logits-top-k", type=int, default=5, metavar="K")
    own.add_argument("-h", "--help", action="store_true")
    return own.parse_known_args(argv)


def print_logits(run, count: int, top_k: int) -> list[dict]:
    """Top-k logits per position of the first `count` samples of validation batch 0 (one
    micro-batch, each sample its own row); the same list on every rank of a TP group."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.model.batch_tensors import build_micro_batch, unsplit_micro_batch
    data = run.evaluator.data
    ids = data.sample_ids(0)[:count]
    samples = {k: v for k, v in data.batch_samples(0).items() if k < len(ids)}
    batch = build_micro_batch(unsplit_micro_batch(sorted(samples), samples, run.cfg.model),
                              samples, run.cfg.model, data.pad_id)
    batch.pop("labels")
    batch = {k: (v.to(run.layout.device) if torch.is_tensor(v) else v) for k, v in batch.items()}
    (stage,) = run.modules
    stage.eval()
    with torch.no_grad():
        part = stage((), batch)                     # [seq, rows, vocab / tp]
        if run.layout.tp > 1:
            parts = [torch.empty_like(part) for _ in range(run.layout.tp)]
            dist.all_gather(parts, part.contiguous(),
                            group=parallel_state.get_tensor_model_parallel_group())
            part = torch.cat(parts, dim=-1)
    logits = part.transpose(0, 1)[..., :data.vocab_size].float().cpu()
    out = []
    for k, sample_id in enumerate(ids):
        read = samples[k][0] if run.cfg.model == "gpt" else samples[k][1]
        values, top = logits[k, :len(read)].topk(min(top_k, data.vocab_size), dim=-1)
        record = {"sample": int(sample_id), "tokens": [int(t) for t in read],
                  "top_ids": top.tolist(), "top_logits": values.tolist()}
        if run.cfg.model == "t5":
            record["encoder_tokens"] = [int(t) for t in samples[k][0]]
        out.append(record)
    return out


def main(argv=None) -> int:
    own, rest = split_args(sys.argv[1:] if argv is None else argv)
    if own.help:
        print(__doc__)
        print("trainer flags: see pretrain_gpt.py --help / pretrain_t5.py --help")
        return 0
    prog = "tools/evaluate.py"
    warnings.filterwarnings(     # as pretrain_*.py: megatron-core's notes on optional packages
        "ignore", message=r".*(Apex|Transformer Engine)( and Apex)? (is|are) not installed")
    from megatron.training.arguments import ConfigError
    from megatron.training.evaluation import evaluation_config
    from megatron.training.pretrain import REPORT_GRACE_S, parse_flags_once, report_failure
    from megatron.training.training import (RunSetupError, TrainingFailed, build_run,
                                            evaluate_or_fail)
    from megatron.training.train_logging import validation_line
    rank = int(os.environ.get("RANK", "0"))
    try:
        if own.print_logits < 0 or own.logits_top_k < 1:
            raise ConfigError("--print-logits must be >= 0 and --logits-top-k >= 1")
        cfg = parse_flags_once(own.model, rest, rank,
                               lambda model, args: evaluation_config(model, args))
        if own.print_logits and cfg.pipeline_model_parallel_size != 1:
            raise ConfigError("--print-logits needs --pipeline-model-parallel-size 1 (loss "
                              "and perplexity work at any PP)")
        run = build_run(cfg, verbose=False)
    except (ConfigError, RunSetupError) as exc:   # alike on every rank: rank 0 says it
        if rank == 0:
            report_failure(prog, exc, debug=False, setup=True)
        else:
            time.sleep(REPORT_GRACE_S)
        return 2
    except Exception as exc:   # noqa: BLE001 - e.g. a checkpoint that does not fit: one line
        world = int(os.environ.get("WORLD_SIZE", "1"))
        report_failure(prog, exc, "--debug" in rest, setup=False,
                       rank=rank if world > 1 else None)
        return 1
    try:
        stats = evaluate_or_fail(run, 0)
        logits = print_logits(run, own.print_logits, own.logits_top_k) if own.print_logits \
            else []
    except TrainingFailed as exc:
        report_failure(prog, exc, cfg.debug, setup=False)
        return 1
    finally:
        run.close()
    if rank == 0:
        print(validation_line(stats, label=f"[eval] --load {cfg.load}"), flush=True)
        for record in logits:
            print(json.dumps(record), flush=True)
        if cfg.stats_file:
            with open(cfg.stats_file, "a") as f:
                f.write(json.dumps(stats.record()["validation"]) + "\n")
    return 0


if __name__ == "__main__":
    status = main()
    from megatron.base.distributed_setup import end_process
    end_process(status)     # not sys.exit: see end_process (a set-up error after the groups)
