#!/usr/bin/env python
"""Profile the real megatron-core layers of a GPT or T5 model on this device and write a cost
profile (dynapipe_ext.costs.cost_profile) that the planners interpolate.

Per layer kind (embedding, transformer layer(s), T5 encoder norm / decoder embedding, output
layer + loss) and recompute mode, over a grid of micro-batch rows x sequence lengths (x decoder
lengths for T5 decoder layers): forward ms, backward ms, kept activation bytes, shared bytes,
transient peak bytes; plus parameter bytes. Single process for TP=1; for TP>1 run under
`torchrun --nproc-per-node TP` (rank 0 writes the file).

    python tools/profile_cost_model.py --model gpt --num-layers 2 --hidden-size 256 \\
        --num-attention-heads 4 --vocab-size 1024 --output profiles/
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dynapipe_ext.costs.cost_profile import (  # noqa: E402
    RECOMPUTE_MODES, CostProfile, profile_file_name, profile_key, save_profile)
from dynapipe_ext.costs.model_spec import ModelSpec  # noqa: E402
from tools.benchlib.ports import free_port  # noqa: E402
from megatron.training.arguments import add_flag_group  # noqa: E402


def int_list(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def mode_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in RECOMPUTE_MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"recompute modes must be among {RECOMPUTE_MODES}, "
                                         f"got {text!r}")
    return modes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    title = "model (Megatron flag names)"
    g = p.add_argument_group(title)
    g.add_argument("--model", choices=("gpt", "t5"), default="gpt")
    add_flag_group(p, "model", ["num_layers", "decoder_num_layers", "hidden_size",
                                "num_attention_heads", "ffn_hidden_size"], title=title,
                   num_layers=dict(default=2, help="transformer layers (T5: encoder layers)"),
                   decoder_num_layers=dict(aliases=("--num-decoder-layers",),
                                           help="T5 decoder layers (default: --num-layers)"),
                   hidden_size=dict(required=False, default=256),
                   num_attention_heads=dict(required=False, default=4),
                   ffn_hidden_size=dict(default=0))
    g.add_argument("--vocab-size", type=int, default=1024)
    add_flag_group(p, "model", ["max_position_embeddings"], title=title,
                   max_position_embeddings=dict(default=4096, help=None))
    add_flag_group(p, "parallel", ["tensor_model_parallel_size"], title=title)
    add_flag_group(p, "optimizer", ["bf16"], title=title,
                   bf16=dict(help="bfloat16 parameters and activations"))
    g = p.add_argument_group("grid")
    g.add_argument("--micro-batch-sizes", type=int_list, default=int_list("1,2,4,8"),
                   help="rows per micro-batch (comma-separated)")
    g.add_argument("--seq-lengths", type=int_list, default=int_list("8,64,256,512"),
                   help="GPT / T5 encoder lengths")
    g.add_argument("--dec-seq-lengths", type=int_list, default=int_list("8,64,256"),
                   help="T5 decoder lengths")
    g.add_argument("--recompute-modes", type=mode_list, default=list(RECOMPUTE_MODES))
    g.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    g = p.add_argument_group("run")
    g.add_argument("--output", type=Path, default=Path("profiles"),
                   help="profile file, or a directory to put it in under its key's name")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--quiet", action="store_true", help="no per-point progress lines")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    for name in ("num_layers", "decoder_num_layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if max(args.seq_lengths + (args.dec_seq_lengths if args.model == "t5" else [])) > \
            args.max_position_embeddings:
        p.error(f"grid lengths exceed --max-position-embeddings {args.max_position_embeddings}")
    return args


def model_spec(args) -> ModelSpec:
    return ModelSpec(model=args.model, num_layers=args.num_layers,
                     hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                     vocab_size=args.vocab_size,
                     num_decoder_layers=(args.num_layers if args.decoder_num_layers is None
                                        else args.decoder_num_layers)
                     if args.model == "t5" else 0,
                     ffn_hidden_size=args.ffn_hidden_size,
                     max_position_embeddings=args.max_position_embeddings)


def log_point(log):
    """on_point callback of profile_model that logs each measurement."""
    def on_point(point, m, seconds):
        if m is None:
            log(f"  {point.kind:15s} {point.mode:9s} {point.shape}: out of memory, left "
                f"unmeasured")
            return
        log(f"  {point.kind:15s} {point.mode:9s} {point.shape}: fwd {m.fwd_ms:8.2f} ms  bwd "
            f"{m.bwd_ms:8.2f} ms  kept {m.activation_bytes / 2**20:8.2f} MiB "
            f"(+{m.shared_bytes / 2**20:.2f} shared)  peak {m.peak_bytes / 2**20:8.2f} MiB  "
            f"[allocator after fwd {m.forward_allocated_bytes / 2**20:.2f} MiB, {seconds:.1f} s]")
    return on_point


def main(argv=None) -> Path | None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = model_spec(args)
    tp = args.tensor_model_parallel_size
    if "WORLD_SIZE" not in os.environ:
        if tp != 1:
            raise SystemExit(f"--tensor-model-parallel-size {tp} needs {tp} processes: run under "
                             f"torchrun --nproc-per-node {tp}")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    from megatron.planning.profile_layers import device_name, profile_meta, profile_model
    from megatron.model.stages import build_transformer_config
    from megatron.base.distributed_setup import setup_model_parallel, teardown_model_parallel

    layout = setup_model_parallel(tp, 1, seed=args.seed, vocab_size=spec.vocab_size,
                                  num_attention_heads=spec.num_attention_heads)
    is_writer = layout.rank == 0
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if (
        is_writer and not args.quiet) else (lambda msg: None)
    dtype_name = "bfloat16" if args.bf16 else "float32"
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = build_transformer_config(spec, tp=tp, dtype=dtype_name)
    device = layout.device
    key = profile_key(spec, tp, device_name(device), dtype_name)
    log(f"profiling {key} on {device} ({torch.get_num_threads()} threads)")
    start = time.perf_counter()
    values = {"rows": args.micro_batch_sizes, "seq_len": args.seq_lengths,
              "dec_seq_len": args.dec_seq_lengths}
    tables, param_count, param_bytes = profile_model(
        spec, config, args.recompute_modes, lambda axes: [values[a] for a in axes],
        args.repeats, dtype, device, seed=args.seed, on_point=log_point(log))
    meta = profile_meta(device, args.repeats, time.perf_counter() - start)
    path = None
    if is_writer:
        path = args.output / profile_file_name(key) if (
            args.output.is_dir() or args.output.suffix != ".json") else args.output
        save_profile(path, CostProfile(key, param_count, param_bytes, tables, meta))
        print(f"wrote {path} ({meta['seconds']} s)", flush=True)
    teardown_model_parallel()
    return path


if __name__ == "__main__":
    main()
    from megatron.base.distributed_setup import end_process
    end_process(0)      # not a plain exit: see end_process (torchrun ranks)
