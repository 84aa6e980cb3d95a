"""FlexTP speed and loss in the main trainer: `torchrun pretrain_gpt.py` at TP=2 (gloo, CPU,
fp32, TP rank r pinned to core r with taskset; PP=1 or 2) on the quickstart data, under a steady
straggler on TP rank 1, for each `--tp-balance` policy. The straggler is synthetic
(`--straggler synthetic`: FLEXTP_SLOWDOWN=1:2, TP rank 1 redoes its slot GEMMs, exactly 2x) or
real (`--straggler taskset`: a busy process pinned to TP rank 1's core for the run).

Configurations (same seed, so every run sees the same batches):
- no straggler, megatron-core layers: `--tp-balance off` (FLEXTP_SLOWDOWN has no effect there:
  only FlexTP's slot layers have the slow-down switch);
- no straggler / even: FlexTP slot layers with an even partition that never changes
  (`--tp-balance resize --flextp-max-drop-fraction 0`), without / with the straggler;
- resize, migrate, semi under the straggler.
Time per configuration: the mean `iteration_s` of the run's --stats-file records after `--skip`
warm-up iterations (rebalancing included), the median over `--rounds` interleaved rounds (each
round runs every configuration once, starting one further along the list, so a drifting machine
load hits them alike). The ideal: the no-straggler time (slot layers) with the straggler's TP
block share split by speed, the share taken from the even and no-straggler medians. Under `--straggler taskset` the
busy process slows everything rank 1 runs: f = even / no straggler, the ideal is the
no-straggler time with all work split by speed, and the rounds also run "even" under the
synthetic 2x straggler, which measures the TP block share (the part FlexTP can move). Final partition and skipped units per rank: the
balancer's last change line in the log. Writes docs/bench_flextp_trainer[_pp2][_taskset].json
and, with --write-doc, the matching section of docs/BENCHMARKS.md.

`--loss-seeds N`: the loss study instead of timing. For each of N seeds (model initialisation
and data order), no straggler and every policy under the synthetic straggler (resize with
rotating and with sticky skips), --iters iterations each, then the held-out loss of the
trained weights (`--split`'s validation share, every unit computed). Writes
docs/bench_flextp_loss.json and the "flextp-loss" section.

    python tools/bench_flextp_trainer.py [--rounds 7] [--iters 25] [--skip 10] \
        [--pipeline-model-parallel-size 2] [--straggler taskset] [--write-doc]
    python tools/bench_flextp_trainer.py --reuse-runs docs/bench_flextp_trainer.json \
        [--more-rounds 1] [--write-doc]
    python tools/bench_flextp_trainer.py --loss-seeds 8 --iters 200 [--write-doc]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron.flextp.run_summary import (FACTOR, balance_changes, final_loss,  # noqa: E402
                                         final_partition, held_out_loss, iteration_records,
                                         mean_seconds, render_loss_table, render_table,
                                         summarize, summarize_losses)
from megatron.training.arguments import add_flag_group  # noqa: E402
from tools.benchlib.launch import run_group  # noqa: E402
from tools.benchlib.ports import free_port  # noqa: E402

SLOWDOWN = f"1:{FACTOR}"
EVEN_SLOTS = ("--tp-balance", "resize", "--flextp-max-drop-fraction", "0")
SYNTHETIC_EVEN = "even, synthetic 2x straggler"
# (name, trainer flags, straggler: "" none, "synthetic" FLEXTP_SLOWDOWN, "busy" the run's one)
POLICIES = (("resize", ("--tp-balance", "resize")),
            ("migrate", ("--tp-balance", "migrate")),
            ("semi", ("--tp-balance", "semi")))
MODEL = {"num_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256,
         "tokens_per_global_batch": 1024}
LOSS_MODEL = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 256,
              "tokens_per_global_batch": 1024}
LOSS_CONFIGS = (("no straggler", EVEN_SLOTS, ""),
                ("resize, rotating skips", ("--tp-balance", "resize", "--flextp-skip-order",
                                            "rotate"), "synthetic"),
                ("resize, sticky skips", ("--tp-balance", "resize", "--flextp-skip-order",
                                          "sticky"), "synthetic"),
                ("migrate", ("--tp-balance", "migrate"), "synthetic"),
                ("semi", ("--tp-balance", "semi"), "synthetic"))
VALIDATION = ("--split", "95,5,0", "--eval-iters", "20")


def configs(straggler: str) -> tuple:
    """The timed configurations for a straggler kind (see the module docstring)."""
    kind = "synthetic" if straggler == "synthetic" else "busy"
    head = (("no straggler, megatron-core layers", ("--tp-balance", "off"), ""),
            ("no straggler", EVEN_SLOTS, ""))
    if kind == "busy":   # the megatron-core row is the synthetic bench's; the block share here
        head = head[1:] + ((SYNTHETIC_EVEN, EVEN_SLOTS, "synthetic"),)
    return head + (("even", EVEN_SLOTS, kind),) + tuple((n, f, kind) for n, f in POLICIES)


def variant(args) -> str:
    """The file and section suffix of a timing variant: '', '_pp2', '_taskset', '_pp2_taskset'."""
    return (f"_pp{args.pipeline_model_parallel_size}" if args.pipeline_model_parallel_size > 1
            else "") + ("_taskset" if args.straggler == "taskset" else "")


# ------------------------------------------------------------------------ running

def even_units(model: dict, tp: int = 2) -> dict:
    from megatron.flextp.stage_balance import default_ffn_unit
    ffn = 4 * model["hidden_size"]
    per = {"attn": model["num_attention_heads"] // tp,
           "mlp": ffn // default_ffn_unit(ffn, tp) // tp}
    return {k: [v] * tp for k, v in per.items()}


def train_argv(model: dict, iters: int, stats: str, seed: int, pp: int = 1) -> list[str]:
    return ["--data-path", "data/quickstart/flan", "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", "data/quickstart/sp.model",
            "--num-layers", str(model["num_layers"]), "--hidden-size", str(model["hidden_size"]),
            "--num-attention-heads", str(model["num_attention_heads"]),
            "--seq-length", str(model["seq_length"]), "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", str(pp),
            "--micro-batching", "dynamic",
            "--tokens-per-global-batch", str(model["tokens_per_global_batch"]),
            "--train-iters", str(iters), "--lr", "3e-3", "--lr-warmup-iters", "2",
            "--min-lr", "3e-4", "--seed", str(seed), "--log-interval", str(iters),
            "--stats-file", stats]


def launch_command(port: int, pp: int = 1) -> list[str]:
    """torchrun with 2 x pp local ranks; TP rank r (local rank mod 2) pinned to core r."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(2 * pp),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--no-python",
            "bash", "-c", 'exec taskset -c "$((LOCAL_RANK % 2))" "$0" pretrain_gpt.py "$@"',
            sys.executable]


@contextlib.contextmanager
def busy_core(core: int, on: bool):
    """A busy process pinned to `core` for the block (the real straggler), when `on`."""
    if not on:
        yield
        return
    proc = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c",
                             "while True: pass"], start_new_session=True)
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def train(name: str, cmd: list[str], env: dict, busy: bool, timeout: float) -> str:
    """Run one training command (under a busy process on core 1 when `busy`); its log."""
    with busy_core(1, busy):
        log, status = run_group(cmd, timeout, cwd=REPO, env=env)
    if status is None:
        raise RuntimeError(f"bench_flextp_trainer: {name!r} ran past {timeout} s")
    if status != 0:
        raise RuntimeError(f"bench_flextp_trainer: {name!r} exited with {status}:\n"
                           + "\n".join(log.splitlines()[-30:]))
    return log


def run_one(name: str, flags, straggler: str, args, workdir: Path, tag: str) -> dict:
    stats = workdir / f"{tag}.jsonl"
    pp = args.pipeline_model_parallel_size
    env = dict(os.environ, FLEXTP_SLOWDOWN=SLOWDOWN if straggler == "synthetic" else "")
    cmd = launch_command(free_port(), pp) + train_argv(MODEL, args.iters, str(stats), args.seed,
                                                       pp)
    cmd += list(flags)
    load = os.getloadavg()[0]
    log = train(name, cmd, env, straggler == "busy", args.run_timeout)
    records = iteration_records(stats.read_text().splitlines(), str(stats))
    changes = balance_changes(log)
    run = {"records": records, "changes": changes, "load_before": load,
           "partition": final_partition(changes, even_units(MODEL))}
    print(f"[bench_flextp_trainer] {tag} {name}: {mean_seconds(records, args.skip):.3f} s/iter,"
          f" final loss {final_loss(records):.4f}, {len(changes)} balancer changes, load "
          f"{load:.1f}", flush=True)
    return run


def interleaved_runs(args, save, runs=None, first: int = 0, rounds: int = 0) -> dict:
    """Every configuration once per round, rounds first..first+rounds-1 added to `runs`;
    `save(runs)` after each run, so an interrupted bench leaves what it measured (re-render it
    with --reuse-runs)."""
    todo = configs(args.straggler)
    runs = runs or {name: [] for name, _, _ in todo}
    with tempfile.TemporaryDirectory(prefix="bench_flextp_trainer_") as tmp:
        for k in range(first, first + rounds):
            order = todo[k % len(todo):] + todo[:k % len(todo)]
            for i, (name, flags, straggler) in enumerate(order):
                runs[name].append(run_one(name, flags, straggler, args, Path(tmp), f"r{k}c{i}"))
                save(runs)
    return runs


def loss_runs(args, seeds: list[int], save) -> dict:
    """The loss study: every LOSS_CONFIGS entry for every seed (seed by seed, so an interrupted
    study leaves whole seeds); name -> seed -> held-out loss."""
    runs = {name: {} for name, _, _ in LOSS_CONFIGS}
    with tempfile.TemporaryDirectory(prefix="bench_flextp_loss_") as tmp:
        for seed in seeds:
            for name, flags, straggler in LOSS_CONFIGS:
                stats = Path(tmp) / f"s{seed}_{len(runs[name])}.jsonl"
                env = dict(os.environ, FLEXTP_SLOWDOWN=SLOWDOWN if straggler else "")
                cmd = (launch_command(free_port()) + train_argv(LOSS_MODEL, args.iters,
                                                                str(stats), seed)
                       + ["--eval-interval", str(args.iters), *VALIDATION, *flags])
                log = train(name, cmd, env, False, args.run_timeout)
                runs[name][str(seed)] = held_out_loss(stats.read_text().splitlines(),
                                                      str(stats))
                changes = balance_changes(log)
                print(f"[bench_flextp_trainer] seed {seed} {name}: held-out loss "
                      f"{runs[name][str(seed)]:.4f}, {len(changes)} balancer changes",
                      flush=True)
                save(runs)
    return runs


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "megatron", "pretrain_gpt.py"],
                           cwd=REPO).returncode != 0
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def command_line(args) -> str:
    if args.loss_seeds:
        return (f"python tools/bench_flextp_trainer.py --loss-seeds {args.loss_seeds} --seed "
                f"{args.seed} --iters {args.iters}" + (" --write-doc" if args.write_doc else ""))
    extra = "".join([f" --pipeline-model-parallel-size {args.pipeline_model_parallel_size}"
                     if args.pipeline_model_parallel_size > 1 else "",
                     " --straggler taskset" if args.straggler == "taskset" else "",
                     " --write-doc" if args.write_doc else ""])
    return (f"python tools/bench_flextp_trainer.py --rounds {args.rounds} --iters {args.iters} "
            f"--skip {args.skip}{extra}")


def straggler_text(meta: dict, summary: dict) -> str:
    if meta.get("straggler", "synthetic") == "synthetic":
        return ("Straggler: `FLEXTP_SLOWDOWN=1:2` on TP rank 1. The ideal: the no-straggler time "
                "(slot layers) with the straggler's block share "
                f"({summary['block_share_s']:.3f} s, even minus no straggler) split by speed "
                "(x 2f/(f+1), f = 2).")
    return ("Straggler: a busy process (`taskset -c 1 python -c 'while True: pass'`) on TP rank "
            "1's core for the whole run; the kernel shares that core between it and the rank(s) "
            "pinned there, so it slows everything rank 1 runs, not only its TP units. Its "
            "strength is measured, not set: f = even / no straggler = "
            f"{summary['factor']:.2f}. The ideal: the no-straggler time with all the iteration's "
            "work split by the ranks' speeds (x 2f/(f+1)). Of the no-straggler time, the TP "
            f"block FlexTP can move is {summary['block_share_s']:.3f} s per rank (from "
            f"\"{SYNTHETIC_EVEN}\", same invocation: even minus no straggler under the exact 2x "
            "slow-down of the slot GEMMs).")


def doc_text(meta: dict, table: str, summary: dict, out_name: str) -> str:
    m = meta["model"]
    pp = meta.get("pipeline_model_parallel_size", 1)
    again = (f" (this text re-rendered from its saved runs with `--reuse-runs docs/{out_name}`)"
             if meta.get("reused") else "")
    later = meta["load"].get("after more rounds")
    more = "" if later is None else f", {later:.1f} after the further rounds"
    layout = ("TP=2" if pp == 1 else
              f"TP=2 x PP={pp} ({2 * pp} processes, TP rank r of every stage pinned to core r)")
    return f"""Run on {meta['date']} (commit {meta['commit']}) with `{meta['command']}`{again}: \
`torchrun --nproc-per-node {2 * pp} pretrain_gpt.py`, {layout} on gloo, CPU, fp32, TP rank r \
pinned to core r (`taskset`) (1-minute load average {meta['load']['before']:.1f} \
before, {meta['load']['after']:.1f} after{more}; per run in the JSON). Model: GPT {m['num_layers']} \
layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads, ffn {4 * m['hidden_size']} \
(32 MLP units of {4 * m['hidden_size'] // 32} columns), sequence {m['seq_length']}, \
{m['tokens_per_global_batch']} tokens per global batch, dynamic micro-batches, quickstart data \
(`examples/prepare_data.sh`: FLAN-like samples, SentencePiece 4000), lr 3e-3, seed {meta['seed']} \
(every run sees the same batches). Times: the trainer's own \
`iteration_s` (`--stats-file`), mean over iterations {meta['skip'] + 1}..{meta['iters']} of each \
run (rebalancing included), median of {meta['rounds']} interleaved rounds, every round's figure \
listed (the spread). `--tp-balance off` has \
no slow-down switch (megatron-core's own layers), so "even" is FlexTP's slot layers with a \
partition that never changes (`--tp-balance resize --flextp-max-drop-fraction 0`), and "no \
straggler" the same without the straggler. {straggler_text(meta, summary)} \
Final partition: the balancer's last change line (pipeline rank 0) of the last round. Raw \
records: `docs/{out_name}`.

{table}"""


def loss_doc_text(meta: dict, table: str) -> str:
    m = meta["model"]
    return f"""Run on {meta['date']} (commit {meta['commit']}) with `{meta['command']}` \
(1-minute load average {meta['load']['before']:.1f} before, {meta['load']['after']:.1f} after): \
`torchrun --nproc-per-node 2 pretrain_gpt.py`, TP=2 on gloo, CPU, fp32; GPT {m['num_layers']} \
layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads, sequence \
{m['seq_length']}, {m['tokens_per_global_batch']} tokens per global batch, dynamic \
micro-batches, quickstart data, lr 3e-3 (cosine to 3e-4), {meta['iters']} iterations per run, \
seeds {meta['seeds']} (model initialisation and data order; the runs of one seed see the same \
batches). Straggler: `FLEXTP_SLOWDOWN=1:2` on TP rank 1 for every policy row. "No straggler" \
is the slot layers with an even partition. Held-out loss: the trainer's validation after the \
last iteration (`--split 95,5,0 --eval-iters 20`: the same held-out samples for every run), with \
every unit computed. Resize with rotating skips (`--flextp-skip-order rotate`, the default) \
skips, at each decision, units other than the ones it skipped before; sticky skips keep the \
smallest-norm units skipped for as long as the straggler lasts. Raw losses: \
`docs/bench_flextp_loss.json`.

{table}"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--iters", type=int, default=50, help="training iterations per run")
    p.add_argument("--skip", type=int, default=15, help="warm-up iterations left out of times")
    p.add_argument("--seed", type=int, default=1234)
    add_flag_group(p, "parallel", ["pipeline_model_parallel_size"], title="",
                   pipeline_model_parallel_size=dict(default=1, choices=(1, 2)))
    p.add_argument("--straggler", choices=("synthetic", "taskset"), default="synthetic")
    p.add_argument("--loss-seeds", type=int, default=0,
                   help="the loss study over this many seeds (from --seed) instead of timing")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--reuse-runs", default=None,
                   help="re-render from this bench_flextp_trainer*.json instead of running")
    p.add_argument("--more-rounds", type=int, default=0,
                   help="with --reuse-runs: run this many further rounds (the saved --iters, "
                        "--skip, --seed) and add them")
    p.add_argument("--write-doc", action="store_true")
    args = p.parse_args()
    if args.skip >= args.iters and not args.loss_seeds:
        p.error(f"--skip {args.skip} must be below --iters {args.iters}")
    if args.loss_seeds and (args.reuse_runs or args.pipeline_model_parallel_size > 1
                            or args.straggler != "synthetic"):
        p.error("--loss-seeds runs TP=2, PP=1 under the synthetic straggler, from scratch")
    if args.loss_seeds:
        return loss_study(args)
    docs = REPO / "docs"
    if args.reuse_runs:
        saved = json.loads(Path(args.reuse_runs).read_text())
        runs, meta = saved["runs"], saved["meta"]
        runs = {name: r for name, r in runs.items() if r}   # an interrupted bench
        meta["load"].setdefault("after", float("nan"))
        meta["reused"] = True
        args.pipeline_model_parallel_size = meta.get("pipeline_model_parallel_size", 1)
        args.straggler = meta.get("straggler", "synthetic")
        out = docs / f"bench_flextp_trainer{variant(args)}.json"
        if args.more_rounds:
            done = min(len(r) for r in runs.values())
            args.iters, args.skip, args.seed = meta["iters"], meta["skip"], meta["seed"]
            meta["command"] += ("`, then `python tools/bench_flextp_trainer.py --reuse-runs "
                                f"docs/{out.name} --more-rounds {args.more_rounds}")
            runs = interleaved_runs(args, lambda r: out.write_text(json.dumps(
                {"meta": meta, "runs": r, "partial": True})), runs, done, args.more_rounds)
            meta["rounds"] = done + args.more_rounds
            meta["load"]["after more rounds"] = os.getloadavg()[0]
    else:
        prepare_data()
        meta = {"date": str(datetime.datetime.now(datetime.timezone.utc).date()),
                "commit": git_commit(), "command": command_line(args), "model": MODEL,
                "rounds": args.rounds, "iters": args.iters, "skip": args.skip,
                "seed": args.seed, "pipeline_model_parallel_size":
                args.pipeline_model_parallel_size, "straggler": args.straggler,
                "load": {"before": os.getloadavg()[0]}}
        out = docs / f"bench_flextp_trainer{variant(args)}.json"
        runs = interleaved_runs(args, lambda r: out.write_text(json.dumps(
            {"meta": meta, "runs": r, "partial": True})), rounds=args.rounds)
        meta["load"]["after"] = os.getloadavg()[0]
    summary = summarize(runs, meta["skip"],
                        SYNTHETIC_EVEN if meta.get("straggler") == "taskset" else None)
    table = render_table(summary)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}))
    print(table)
    if args.write_doc:
        from dynapipe_ext.report.doc_sections import write_section
        pp = meta.get("pipeline_model_parallel_size", 1)
        kind = "a busy process on its core" if args.straggler == "taskset" else "a 2x straggler"
        write_section(docs / "BENCHMARKS.md", f"flextp-trainer{variant(args).replace('_', '-')}",
                      f"FlexTP in the main trainer (pretrain_gpt.py), TP=2 x PP={pp}, {kind}",
                      doc_text(meta, table, summary, out.name))


def prepare_data() -> None:
    subprocess.run(["bash", "examples/prepare_data.sh"], cwd=REPO, check=True,
                   env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:"
                                             f"{os.environ['PATH']}"))


def loss_study(args) -> None:
    prepare_data()
    seeds = list(range(args.seed, args.seed + args.loss_seeds))
    meta = {"date": str(datetime.datetime.now(datetime.timezone.utc).date()),
            "commit": git_commit(), "command": command_line(args), "model": LOSS_MODEL,
            "iters": args.iters, "seeds": seeds, "load": {"before": os.getloadavg()[0]}}
    out = REPO / "docs" / "bench_flextp_loss.json"
    runs = loss_runs(args, seeds, lambda r: out.write_text(json.dumps(
        {"meta": meta, "runs": r, "partial": True})))
    meta["load"]["after"] = os.getloadavg()[0]
    summary = summarize_losses(runs)
    table = render_loss_table(summary)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}))
    print(table)
    if args.write_doc:
        from dynapipe_ext.report.doc_sections import write_section
        write_section(REPO / "docs" / "BENCHMARKS.md", "flextp-loss",
                      "FlexTP: held-out loss over seeds (pretrain_gpt.py)",
                      loss_doc_text(meta, table))


if __name__ == "__main__":
    main()
