"""FlexTP speed in the main trainer: `torchrun --nproc-per-node 2 pretrain_gpt.py` at TP=2 (gloo,
CPU, fp32, rank r pinned to core r with taskset) on the quickstart data, under a steady 2x
straggler (FLEXTP_SLOWDOWN=1:2: TP rank 1 redoes its slot GEMMs), for each `--tp-balance` policy.

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
block share split by speed, the share taken from the even and no-straggler medians. Final
partition and skipped units per rank: the balancer's last change
line in the log. Writes docs/bench_flextp_trainer.json and, with --write-doc, the
"flextp-trainer" section of docs/BENCHMARKS.md.

    python tools/bench_flextp_trainer.py [--rounds 3] [--iters 50] [--skip 15] [--write-doc]
    python tools/bench_flextp_trainer.py --reuse-runs docs/bench_flextp_trainer.json \
        [--more-rounds 1] [--write-doc]
"""
from __future__ import annotations

import argparse
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
                                         final_partition, iteration_records,
                                         mean_seconds, render_table, summarize)
from tools.benchlib.ports import free_port  # noqa: E402

SLOWDOWN = f"1:{FACTOR}"
EVEN_SLOTS = ("--tp-balance", "resize", "--flextp-max-drop-fraction", "0")
CONFIGS = (("no straggler, megatron-core layers", ("--tp-balance", "off"), ""),
           ("no straggler", EVEN_SLOTS, ""),
           ("even", EVEN_SLOTS, SLOWDOWN),
           ("resize", ("--tp-balance", "resize"), SLOWDOWN),
           ("migrate", ("--tp-balance", "migrate"), SLOWDOWN),
           ("semi", ("--tp-balance", "semi"), SLOWDOWN))
MODEL = {"num_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256,
         "tokens_per_global_batch": 1024}


# ------------------------------------------------------------------------ running

def even_units(model: dict, tp: int = 2) -> dict:
    from megatron.flextp.stage_balance import default_ffn_unit
    ffn = 4 * model["hidden_size"]
    per = {"attn": model["num_attention_heads"] // tp,
           "mlp": ffn // default_ffn_unit(ffn, tp) // tp}
    return {k: [v] * tp for k, v in per.items()}


def train_argv(model: dict, iters: int, stats: str, seed: int) -> list[str]:
    return ["--data-path", "data/quickstart/flan", "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", "data/quickstart/sp.model",
            "--num-layers", str(model["num_layers"]), "--hidden-size", str(model["hidden_size"]),
            "--num-attention-heads", str(model["num_attention_heads"]),
            "--seq-length", str(model["seq_length"]), "--tensor-model-parallel-size", "2",
            "--micro-batching", "dynamic",
            "--tokens-per-global-batch", str(model["tokens_per_global_batch"]),
            "--train-iters", str(iters), "--lr", "3e-3", "--lr-warmup-iters", "2",
            "--min-lr", "3e-4", "--seed", str(seed), "--log-interval", str(iters),
            "--stats-file", stats]


def launch_command(port: int) -> list[str]:
    """torchrun with 2 local ranks, each pinned to the core of its local rank."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--no-python",
            "bash", "-c", 'exec taskset -c "$LOCAL_RANK" "$0" pretrain_gpt.py "$@"',
            sys.executable]


def run_one(name: str, flags, slowdown: str, args, workdir: Path, tag: str) -> dict:
    stats = workdir / f"{tag}.jsonl"
    env = dict(os.environ, FLEXTP_SLOWDOWN=slowdown)
    cmd = launch_command(free_port()) + train_argv(MODEL, args.iters, str(stats), args.seed)
    cmd += list(flags)
    load = os.getloadavg()[0]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"bench_flextp_trainer: {name!r} ran past {args.run_timeout} s")
    if proc.returncode != 0:
        raise RuntimeError(f"bench_flextp_trainer: {name!r} exited with {proc.returncode}:\n"
                           + "\n".join(log.splitlines()[-30:]))
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
    runs = runs or {name: [] for name, _, _ in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="bench_flextp_trainer_") as tmp:
        for k in range(first, first + rounds):
            order = CONFIGS[k % len(CONFIGS):] + CONFIGS[:k % len(CONFIGS)]
            for i, (name, flags, slowdown) in enumerate(order):
                runs[name].append(run_one(name, flags, slowdown, args, Path(tmp), f"r{k}c{i}"))
                save(runs)
    return runs


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "megatron", "pretrain_gpt.py"],
                           cwd=REPO).returncode != 0
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def command_line(args) -> str:
    return (f"python tools/bench_flextp_trainer.py --rounds {args.rounds} --iters {args.iters} "
            f"--skip {args.skip}" + (" --write-doc" if args.write_doc else ""))


def doc_text(meta: dict, table: str, summary: dict) -> str:
    m = meta["model"]
    again = (" (this text re-rendered from its saved runs with `--reuse-runs "
             "docs/bench_flextp_trainer.json`)" if meta.get("reused") else "")
    later = meta["load"].get("after more rounds")
    more = "" if later is None else f", {later:.1f} after the further rounds"
    return f"""Run on {meta['date']} (commit {meta['commit']}) with `{meta['command']}`{again}: \
`torchrun --nproc-per-node 2 pretrain_gpt.py`, TP=2 on gloo, CPU, fp32, rank r pinned to core r \
(`taskset`), 2 cores shared with other jobs (1-minute load average {meta['load']['before']:.1f} \
before, {meta['load']['after']:.1f} after{more}; per run in the JSON). Model: GPT {m['num_layers']} \
layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads, ffn {4 * m['hidden_size']} \
(32 MLP units of {4 * m['hidden_size'] // 32} columns), sequence {m['seq_length']}, \
{m['tokens_per_global_batch']} tokens per global batch, dynamic micro-batches, quickstart data \
(`examples/prepare_data.sh`: FLAN-like samples, SentencePiece 4000), lr 3e-3, seed {meta['seed']} \
(every run sees the same batches). Straggler: `FLEXTP_SLOWDOWN=1:2`. Times: the trainer's own \
`iteration_s` (`--stats-file`), mean over iterations {meta['skip'] + 1}..{meta['iters']} of each \
run (rebalancing included), median of {meta['rounds']} interleaved rounds. `--tp-balance off` has \
no slow-down switch (megatron-core's own layers), so "even" is FlexTP's slot layers with a \
partition that never changes (`--tp-balance resize --flextp-max-drop-fraction 0`), and "no \
straggler" the same without the straggler; the first row shows what the slot layers cost against \
megatron-core's. The ideal: the no-straggler time (slot layers) with the straggler's block share \
({summary['block_share_s']:.3f} s, even minus no straggler) split by speed (x 2f/(f+1), f = 2). \
Final partition: the balancer's last change line of the last round. Raw records: \
`docs/bench_flextp_trainer.json`.

{table}"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--iters", type=int, default=50, help="training iterations per run")
    p.add_argument("--skip", type=int, default=15, help="warm-up iterations left out of times")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--run-timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--reuse-runs", default=None,
                   help="re-render from this bench_flextp_trainer.json instead of running")
    p.add_argument("--more-rounds", type=int, default=0,
                   help="with --reuse-runs: run this many further rounds (the saved --iters, "
                        "--skip, --seed) and add them")
    p.add_argument("--write-doc", action="store_true")
    args = p.parse_args()
    if args.skip >= args.iters:
        p.error(f"--skip {args.skip} must be below --iters {args.iters}")
    docs = REPO / "docs"
    if args.reuse_runs:
        saved = json.loads(Path(args.reuse_runs).read_text())
        runs, meta = saved["runs"], saved["meta"]
        runs = {name: r for name, r in runs.items() if r}   # an interrupted bench
        meta["load"].setdefault("after", float("nan"))
        meta["reused"] = True
        if args.more_rounds:
            done = min(len(r) for r in runs.values())
            args.iters, args.skip, args.seed = meta["iters"], meta["skip"], meta["seed"]
            meta["command"] += ("`, then `python tools/bench_flextp_trainer.py --reuse-runs "
                                f"docs/bench_flextp_trainer.json --more-rounds {args.more_rounds}")
            out = docs / "bench_flextp_trainer.json"
            runs = interleaved_runs(args, lambda r: out.write_text(json.dumps(
                {"meta": meta, "runs": r, "partial": True})), runs, done, args.more_rounds)
            meta["rounds"] = done + args.more_rounds
            meta["load"]["after more rounds"] = os.getloadavg()[0]
    else:
        subprocess.run(["bash", "examples/prepare_data.sh"], cwd=REPO, check=True,
                       env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:"
                                                 f"{os.environ['PATH']}"))
        meta = {"date": str(datetime.datetime.now(datetime.timezone.utc).date()),
                "commit": git_commit(), "command": command_line(args), "model": MODEL,
                "rounds": args.rounds, "iters": args.iters, "skip": args.skip,
                "seed": args.seed, "load": {"before": os.getloadavg()[0]}}
        out = docs / "bench_flextp_trainer.json"
        runs = interleaved_runs(args, lambda r: out.write_text(json.dumps(
            {"meta": meta, "runs": r, "partial": True})), rounds=args.rounds)
        meta["load"]["after"] = os.getloadavg()[0]
    summary = summarize(runs, meta["skip"])
    table = render_table(summary)
    (docs / "bench_flextp_trainer.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "runs": runs}))
    print(table)
    if args.write_doc:
        from dynapipe_ext.report.doc_sections import write_section
        write_section(docs / "BENCHMARKS.md", "flextp-trainer",
                      "FlexTP in the main trainer (pretrain_gpt.py)",
                      doc_text(meta, table, summary))


if __name__ == "__main__":
    main()
