"""Host time per training step at DP = 1, 2, 4: a tiny GPT under torchrun on CPU, so the
step's host work (reading the batch's samples, building micro-batch tensors, checks) and its
synchronisation stand out; `--before DIR` runs a second checkout the same way, each round
taking the two in turns (alternating which goes first) so the machine's load hits both alike.

  python tools/bench_host_step.py --before /tmp/before --before-commit abc1234 \
      --out docs/bench_host_step.json

Per (checkout, DP): rank 0's step_timing parts "host" and "sync_wait" of every iteration after
the first, their medians over all rounds and the spread of the per-run medians, and the load
average around each run; the JSON records commit, date, command and machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.benchlib.launch import run_group  # noqa: E402
from tools.benchlib.ports import free_port  # noqa: E402
from tools.benchlib.provenance import provenance_end, provenance_start  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "64", "--lr", "1e-3", "--lr-decay-style", "constant",
         "--micro-batching", "packing", "--num-planner-workers", "1",
         "--distributed-timeout-minutes", "5"]


def make_dataset(folder: Path, samples: int) -> list[str]:
    """A FLAN-like dump, a SentencePiece tokenizer trained on it and its dataset."""
    def tool(*args):
        subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True)
    tool("tools/make_flan_sample.py", "--output", str(folder / "flan.jsonl"),
         "--num-samples", str(samples), "--seed", "7")
    tool("tools/train_tokenizer.py", "--input", str(folder / "flan.jsonl"), "--model-prefix",
         str(folder / "sp"), "--vocab-size", "1000")
    tool("tools/preprocess_flan.py", "--input", str(folder / "flan.jsonl"), "--output-prefix",
         str(folder / "flan"), "--tokenizer-type", "SentencePieceTokenizer",
         "--tokenizer-model", str(folder / "sp.model"), "--no-progress")
    return ["--data-path", str(folder / "flan"), "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", str(folder / "sp.model")]


def one_run(repo: Path, dp: int, argv: list[str], stats: Path, timeout_s: float) -> dict:
    """pretrain_gpt.py of `repo` at DP=`dp` (dp ranks, TP = PP = 1); rank 0's per-iteration
    host and sync_wait milliseconds after the first iteration, and the load around it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(dp),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(repo / "pretrain_gpt.py"), *argv, "--stats-file", str(stats)]
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1", DYNAPIPE_DEVICE="cpu")
    stats.unlink(missing_ok=True)     # the trainer appends to a stats file
    load_before = os.getloadavg()[0]
    output, status = run_group(cmd, timeout_s, cwd=repo, env=env)
    if status != 0:
        raise RuntimeError(f"{repo} at DP={dp} exited with {status}:\n{output[-3000:]}")
    rows = [json.loads(line) for line in stats.read_text().splitlines()][1:]
    return {"host_ms": [1e3 * r["time_parts"]["host"] for r in rows],
            "sync_wait_ms": [1e3 * r["time_parts"]["sync_wait"] for r in rows],
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def summary(runs: list[dict]) -> dict:
    """Medians over every iteration of `runs`, and the range of the per-run medians."""
    out = {}
    for part in ("host_ms", "sync_wait_ms"):
        per_run = [statistics.median(r[part]) for r in runs]
        out[part] = {"median": statistics.median(v for r in runs for v in r[part]),
                     "run_medians_min": min(per_run), "run_medians_max": max(per_run)}
    out["load_average"] = [min(r["load_before"] for r in runs),
                           max(r["load_after"] for r in runs)]
    return out


def markdown(result: dict) -> str:
    lines = ["| DP | checkout | host ms / step (median; run medians) | sync wait ms / step | "
             "load average |", "|---|---|---|---|---|"]
    for dp in result["dp"]:
        for name in result["checkouts"]:
            s = result["summary"][name][str(dp)]
            h, w = s["host_ms"], s["sync_wait_ms"]
            lines.append(f"| {dp} | {name} | {h['median']:.1f} ({h['run_medians_min']:.1f}-"
                         f"{h['run_medians_max']:.1f}) | {w['median']:.1f} "
                         f"({w['run_medians_min']:.1f}-{w['run_medians_max']:.1f}) | "
                         f"{s['load_average'][0]:.0f}-{s['load_average'][1]:.0f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--after", type=Path, default=ROOT,
                   help="the checkout measured as 'after' (default: this one)")
    p.add_argument("--before", type=Path, help="a second checkout to measure in turns")
    p.add_argument("--before-commit", default="", help="the commit that checkout holds")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--global-batch-size", type=int, default=512)
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--out", type=Path, help="the JSON to write (else print only)")
    args = p.parse_args()
    start = provenance_start(" ".join(["python"] + sys.argv))
    checkouts = {"after": args.after.resolve()} | ({"before": args.before.resolve()} if args.before else {})
    runs = {name: {dp: [] for dp in args.dp} for name in checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        argv = make_dataset(Path(tmp), 1200) + MODEL + [
            "--train-iters", str(args.iters), "--global-batch-size", str(args.global_batch_size)]
        for r in range(args.rounds):
            for dp in args.dp:
                order = list(checkouts) if r % 2 else list(checkouts)[::-1]
                for name in order:
                    got = one_run(checkouts[name], dp, argv, Path(tmp) / f"{name}{dp}.jsonl",
                                  args.timeout_s)
                    runs[name][dp].append(got)
                    print(f"round {r} DP={dp} {name}: host "
                          f"{statistics.median(got['host_ms']):.1f} ms, sync wait "
                          f"{statistics.median(got['sync_wait_ms']):.1f} ms", flush=True)
    result = {"provenance": provenance_end(start), "before_commit": args.before_commit,
              "checkouts": list(checkouts), "dp": args.dp, "iterations": args.iters,
              "global_batch_size": args.global_batch_size, "model_flags": MODEL,
              "summary": {n: {str(dp): summary(rs) for dp, rs in by.items()}
                          for n, by in runs.items()},
              "runs": {n: {str(dp): rs for dp, rs in by.items()} for n, by in runs.items()}}
    print(markdown(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
