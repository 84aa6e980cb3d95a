#!/usr/bin/env python
"""How well the planner's cost models predict micro-batch times on this device: for a set of
micro-batch shapes, the measured forward + backward time of the whole model (one stage, real
megatron-core layers, full rows) against the prediction of the analytic model (as the trainer
builds it) and of the run's profile (`--cost-model profile`, made or read from the cache).

Takes pretrain_gpt.py / pretrain_t5.py's model flags, plus --shapes ROWSxSEQ[xDEC],...:

    python tools/check_cost_model.py t5 --num-layers 2 --hidden-size 256 \\
        --num-attention-heads 4 --encoder-seq-length 4096 --decoder-seq-length 1024 \\
        --vocab-size 2048 --shapes 1x4096x1024,4x1024x256,16x256x64 --output check.json

--streams T1,T2,... also times packed token streams of about T tokens (the layout of
dynamic micro-batches and of packing): FLAN-like samples (dynapipe_ext/batching/synthetic.py)
one after another, attention per sample, priced as the planners price them
(microbatch.packed_cost_shape). Their shape error is how well the model's size dependence
(half_rate_tokens) holds for the micro-batch sizes the planners choose between.

Absolute rates differ between models (the analytic one assumes a nominal CPU rate), and a
planner only compares shapes with each other, so besides the plain error the table gives the
error after one best scale factor per model ("shape error"): what misleads a planner.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def shape_list(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {item!r} is not ROWSxSEQ[xDEC]") from None
        if len(values) not in (2, 3) or min(values) < 1:
            raise argparse.ArgumentTypeError(f"shape {item!r} is not ROWSxSEQ[xDEC] of "
                                             f"positive integers")
        shapes.append((values[0], values[1], values[2] if len(values) == 3 else 0))
    return shapes


def stream_sizes(text: str) -> list[int]:
    """--streams 512,2048,...: stream sizes in tokens, each at least 8."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--streams {text!r}: expected comma-separated token "
                                         f"counts, e.g. 512,2048") from None
    if min(sizes) < 8:
        raise argparse.ArgumentTypeError(f"--streams {text!r}: every stream needs at least 8 "
                                         f"tokens")
    return sizes


def parse(argv=None):
    model = (argv if argv is not None else sys.argv[1:])[:1]
    if model not in (["gpt"], ["t5"]):
        raise SystemExit("usage: check_cost_model.py {gpt,t5} [model flags] --shapes ...")
    from megatron.training.arguments import ConfigError, build_parser, config_from_args
    parser = build_parser(model[0])
    parser.prog = "check_cost_model.py " + model[0]
    for action in parser._actions:            # data and iterations do not matter here
        if action.dest in ("data_path", "train_iters"):
            action.required = False
    g = parser.add_argument_group("check")
    g.add_argument("--shapes", type=shape_list, default=[],
                   help="full-row shapes ROWSxSEQ[xDEC], comma-separated")
    g.add_argument("--streams", type=stream_sizes, default=[],
                   help="packed streams of about this many (encoder) tokens, comma-separated")
    g.add_argument("--stream-draws", type=int, default=3,
                   help="streams per --streams size, each of other samples")
    g.add_argument("--vocab-size", type=int, default=2048)
    g.add_argument("--repeats", type=int, default=3, help="timed runs per shape (least)")
    g.add_argument("--analytic-only", action="store_true",
                   help="check the analytic model only (no profile is made or read)")
    g.add_argument("--output", type=Path, default=None, help="JSON file for the results")
    g.add_argument("--measured", type=Path, default=None,
                   help="take the measured times of these --shapes from an earlier --output "
                        "(to re-check a changed cost model without timing again; streams are "
                        "timed again)")
    args = parser.parse_args((argv if argv is not None else sys.argv[1:])[1:])
    if not args.shapes and not args.streams:
        parser.error("give --shapes and / or --streams")
    args.data_path = args.data_path or ["unused"]
    args.train_iters = 1 if args.train_iters is None else args.train_iters
    if args.cost_model in (None, "analytic"):     # the profile is what it checks
        args.cost_model = "profile"
    try:
        cfg = config_from_args(model[0], args, has_cuda=False)
    except ConfigError as err:
        parser.error(str(err))
    return cfg, args


def synthetic_micro_batch(model: str, rows: int, seq: int, dec: int, vocab: int, seed: int):
    """Tensors of a micro-batch of `rows` full rows (the trainer's own batch builder)."""
    import numpy as np

    from dynapipe_ext.batching.microbatch import MicroBatch
    from megatron.model.batch_tensors import build_micro_batch
    rng = np.random.default_rng(seed)
    ints = lambda n: rng.integers(1, vocab, n)   # noqa: E731
    if model == "gpt":
        samples = {i: (ints(seq), ints(seq), np.ones(seq, np.float32)) for i in range(rows)}
    else:
        samples = {i: (ints(seq), ints(dec), ints(dec), np.ones(dec, np.float32))
                   for i in range(rows)}
    mb = MicroBatch(tuple((i,) for i in range(rows)), seq, dec)
    return build_micro_batch(mb, samples, model, pad_id=0)


def stream_micro_batch(model: str, tokens: int, max_len: int, max_dec: int, vocab: int,
                       seed: int):
    """(tensors, packed cost shape, samples) of one packed stream of about `tokens` (encoder)
    tokens: FLAN-like samples in draw order, each that still fits, to within 8 tokens of the
    target or the end of the draw; the length rounded up to 8 as the planners align streams.
    A draw in which no sample fits (a target below most FLAN lengths) is drawn again larger."""
    import numpy as np

    from dynapipe_ext.batching.microbatch import MicroBatch, packed_cost_shape
    from dynapipe_ext.batching.synthetic import global_batch
    from megatron.model.batch_tensors import build_micro_batch
    draw = 4 * tokens + 4 * max_len
    for _ in range(6):
        drawn = np.asarray(global_batch(model, draw, max_len, max_dec, seed))
        lengths = drawn.reshape(len(drawn), -1)
        ids, total = [], 0
        for i, n in enumerate(lengths[:, 0]):
            if total + n <= tokens:
                ids.append(i)
                total += int(n)
            if total > tokens - 8:
                break
        if ids:
            break
        draw *= 4
    else:
        raise ValueError(f"--streams {tokens}: no FLAN-like sample of {draw} drawn tokens is "
                         f"that short")
    enc = lengths[ids, 0]
    seq = -(-total // 8) * 8
    dec_total = int(lengths[ids, 1].sum()) if model == "t5" else 0
    dec = -(-dec_total // 8) * 8
    rng = np.random.default_rng(seed)
    ints = lambda n: rng.integers(1, vocab, int(n))   # noqa: E731
    if model == "gpt":
        samples = {i: (ints(n), ints(n), np.ones(int(n), np.float32))
                   for i, n in zip(ids, enc)}
    else:
        samples = {i: (ints(lengths[i, 0]), ints(lengths[i, 1]), ints(lengths[i, 1]),
                       np.ones(int(lengths[i, 1]), np.float32)) for i in ids}
    mb = MicroBatch((tuple(ids),), seq, dec)
    shape = packed_cost_shape(seq, float(np.sum(enc.astype(np.float64) ** 2)), dec)
    return build_micro_batch(mb, samples, model, pad_id=0), tuple(float(x) for x in shape), \
        len(ids)


def main(argv=None) -> dict:
    cfg, args = parse(argv)
    import torch

    from dynapipe_ext.plan.iteration_planner import build_cost_model
    from megatron.model.init_weights import initialize_stage_weights
    from megatron.planning.profile_layers import device_name, time_stage
    from megatron.model.stages import build_rank_stages, build_transformer_config
    from megatron.planning import device_costs
    from megatron.base.distributed_setup import setup_model_parallel, teardown_model_parallel
    from megatron.training.training import model_spec
    from tools.benchlib.ports import free_port

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    spec = model_spec(cfg, args.vocab_size)
    device = torch.device("cpu")
    if "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    setup_model_parallel(1, 1, seed=cfg.seed, vocab_size=spec.vocab_size,
                         num_attention_heads=spec.num_attention_heads)
    try:
        if not args.analytic_only:
            device_costs.ensure_cost_profile(cfg, spec, 0, device)
        config = build_transformer_config(spec, 1, 1, "bfloat16" if cfg.bf16 else "float32",
                                          fused=False)
        stages = build_rank_stages(spec, (0,), 0, config)
        initialize_stage_weights(stages, cfg.seed)
        stage = stages[0]
        rows = []
        earlier = ({(m["rows"], m["seq_len"], m["dec_seq_len"]): m for m in
                    json.loads(args.measured.read_text())["shapes"]} if args.measured else {})
        for r, s, d in args.shapes:
            if (r, s, d) in earlier:
                rows.append({k: v for k, v in earlier[(r, s, d)].items()
                             if k.startswith("measured") or k in ("rows", "seq_len",
                                                                  "dec_seq_len")})
                continue
            batch = synthetic_micro_batch(cfg.model, r, s, d, spec.vocab_size, cfg.seed)
            wall, cpu = time_stage(stage, batch, args.repeats, device)
            rows.append({"rows": r, "seq_len": s, "dec_seq_len": d, "measured_wall_ms": wall,
                         "measured_cpu_ms": cpu})
            print(f"{r}x{s}" + (f"x{d}" if d else "") + f": wall {wall:.1f} ms, "
                  f"CPU {cpu:.1f} ms", file=sys.stderr, flush=True)
        for target, draw in ((t, k) for t in args.streams for k in range(args.stream_draws)):
            batch, shape, count = stream_micro_batch(
                cfg.model, target, cfg.seq_length, cfg.decoder_seq_length or 0,
                spec.vocab_size, cfg.seed + draw)
            wall, cpu = time_stage(stage, batch, args.repeats, device)
            rows.append({"stream_tokens": target, "samples": count, "rows": shape[0],
                         "seq_len": shape[1], "dec_seq_len": shape[2],
                         "measured_wall_ms": wall, "measured_cpu_ms": cpu})
            print(f"stream of {target} tokens ({count} samples): wall {wall:.1f} ms, "
                  f"CPU {cpu:.1f} ms, {cpu / target * 1e3:.0f} us per token", file=sys.stderr,
                  flush=True)
    finally:
        teardown_model_parallel()
    analytic_cfg = _with(cfg, cost_model="analytic", cost_model_cache_dir=None)
    models = {"analytic": device_costs.cost_model_source(analytic_cfg, 1, spec=spec)}
    if not args.analytic_only:
        models["profile"] = device_costs.cost_model_source(cfg, 1, spec=spec)
    for name, source in models.items():
        model = build_cost_model(source, spec, 1, 1)
        for row in rows:
            cost = model.stage_costs(row["rows"], row["seq_len"], row["dec_seq_len"], 1)
            row[f"{name}_ms"] = None if cost is None else cost[0].fwd_ms + cost[0].bwd_ms
    summary = {name: errors(rows, f"{name}_ms") for name in models}
    result = {"model": cfg.model, "spec": spec.__dict__, "device": device_name(device),
              "repeats": args.repeats,
              "profile": str(models["profile"].path) if "profile" in models else None,
              "shapes": rows, "summary": summary}
    print(table(rows, summary, list(models)))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))
    return result


def _with(cfg, **changes):
    import dataclasses
    return dataclasses.replace(cfg, **changes)


def errors(rows: list[dict], key: str, measured: str = "measured_cpu_ms") -> dict:
    """Plain error and shape error (after the least-squares scale in log space) of one
    model's predictions, in percent: median and max of |predicted / measured - 1|."""
    pairs = [(r[key], r[measured]) for r in rows if r.get(key)]
    if not pairs:
        return {}
    scale = math.exp(sum(math.log(m / p) for p, m in pairs) / len(pairs))
    plain = sorted(abs(p / m - 1) * 100 for p, m in pairs)
    shaped = sorted(abs(p * scale / m - 1) * 100 for p, m in pairs)
    for r in rows:
        if r.get(key):
            r[key.replace("_ms", "_shape_error_pct")] = (r[key] * scale / r[measured] - 1) * 100
    return {"scale": scale, "median_error_pct": plain[len(plain) // 2],
            "max_error_pct": plain[-1], "median_shape_error_pct": shaped[len(shaped) // 2],
            "max_shape_error_pct": shaped[-1]}


def table(rows: list[dict], summary: dict, names=("analytic", "profile")) -> str:
    """Markdown table of the shapes and the summary lines."""
    lines = ["| shape (rows x enc [x dec]) | measured CPU ms | measured wall ms | "
             + " | ".join(f"{n} ms | {n} shape err" for n in names) + " |",
             "|---|---:|---:|" + "---:|---:|" * len(names)]
    for r in rows:
        shape = (f"stream of {r['stream_tokens']} ({r['samples']} samples)"
                 if "stream_tokens" in r else
                 f"{r['rows']} x {r['seq_len']}" + (f" x {r['dec_seq_len']}"
                                                    if r["dec_seq_len"] else ""))
        cells = [shape, f"{r['measured_cpu_ms']:,.0f}", f"{r['measured_wall_ms']:,.0f}"]
        for name in names:
            value = r.get(f"{name}_ms")
            cells += ([f"{value:,.0f}", f"{r[name + '_shape_error_pct']:+.0f}%"] if value
                      else ["infeasible", ""])
        lines.append("| " + " | ".join(cells) + " |")
    for name, s in summary.items():
        if s:
            lines.append(f"\n{name}: error median {s['median_error_pct']:.0f}%, max "
                         f"{s['max_error_pct']:.0f}%; after one scale factor ({s['scale']:.2f}x)"
                         f" median {s['median_shape_error_pct']:.0f}%, max "
                         f"{s['max_shape_error_pct']:.0f}%")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
    from megatron.base.distributed_setup import end_process
    end_process(0)     # not a plain exit: see end_process
