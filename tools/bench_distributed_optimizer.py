"""What --use-distributed-optimizer saves and costs: per-rank optimizer state and peak memory at
DP = 1, 2, 4 with and without the flag, iteration time off, on, and on with
--overlap-param-gather (DP > 1), and the parameter all-gather timed alone (its cost where
nothing hides it: a stage whose first forward comes at once).

    python tools/bench_distributed_optimizer.py --output docs/bench_distributed_optimizer.json \\
        -- --data-path PREFIX --tokenizer-type SentencePieceTokenizer --tokenizer-model SP ...

Each (DP, mode) is one torchrun launch of this file's `worker` mode (pretrain_gpt.py's trainer,
--train-iters warm-up + timed iterations); rank 0 of each writes one JSON record. Peak memory on
CPU is the process's peak resident set (torch, data and planner included), so differences
between runs are what the flag frees; optimizer state is counted from the optimizer's tensors.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20


def optimizer_bytes(optimizer) -> int:
    """Bytes of fp32 state the optimizer keeps beside weights and main gradients: Adam's
    moments and the main weights that are copies (bf16 runs)."""
    moments = sum(t.numel() * t.element_size() for state in
                  (optimizer.adam.state.values() if optimizer.adam else [])
                  for key, t in state.items() if key in ("exp_avg", "exp_avg_sq"))
    return moments + sum(m.numel() * m.element_size() for _, m in optimizer._half)


def worker(job: dict) -> None:
    """One launch: train, then time the parameter all-gather alone; rank 0 writes the record."""
    import torch.distributed as dist

    from megatron.training.arguments import parse_args
    from megatron.training.training import build_run, train
    from megatron.training.train_logging import peak_memory_bytes
    cfg = parse_args("gpt", job["flags"])
    run = build_run(cfg, verbose=False)
    layout, buffer = run.layout, run.optimizer.grad_buffer
    history = train(run)
    times = [s.iteration_s for s in history[job["warmup"]:]]
    gather = []
    if buffer.shard:
        buffer.overlap_param_gather = False
        for _ in range(job["gather_repeats"]):
            dist.barrier()
            start = time.perf_counter()
            buffer.start_param_gather()
            gather.append(time.perf_counter() - start)
    mine = {"rank": layout.rank, "optimizer_state_mib": optimizer_bytes(run.optimizer) / MIB,
            "grad_buffer_mib": buffer.data.numel() * 4 / MIB,
            "peak_memory_mib": peak_memory_bytes(layout.device) / MIB,
            "iteration_s_median": statistics.median(times),
            "param_gather_s_median": statistics.median(gather) if gather else None}
    everyone = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    if layout.rank == 0:
        params = sum(p.numel() for m in run.modules for p in m.parameters())
        record = {"dp": layout.dp, "distributed_optimizer": buffer.shard,
                  "parameters": params, "buckets": len(buffer.buckets),
                  "losses": [s.loss for s in history], "ranks": everyone}
        Path(job["output"]).write_text(json.dumps(record))


MODES = {"off": [], "on": ["--use-distributed-optimizer"],
         "on+overlap": ["--use-distributed-optimizer", "--overlap-param-gather"]}


def launch(dp: int, mode: str, flags: list[str], args, work: Path) -> dict:
    out = work / f"dp{dp}_{mode}.json"
    job = {"flags": flags + ["--train-iters", str(args.warmup + args.iters)] + MODES[mode],
           "warmup": args.warmup, "gather_repeats": args.gather_repeats, "output": str(out)}
    job_file = work / f"job_dp{dp}_{mode}.json"
    job_file.write_text(json.dumps(job))
    port = args.port + 10 * dp + list(MODES).index(mode)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(dp),
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           __file__, "worker", str(job_file)]
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.timeout_minutes * 60)
    if done.returncode != 0:
        raise SystemExit(f"DP={dp} {mode} failed:\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def cpu_model() -> str:
    """The CPU's model name (Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "worker":
        worker(json.loads(Path(sys.argv[2]).read_text()))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--warmup", type=int, default=2, help="iterations not timed")
    parser.add_argument("--iters", type=int, default=6, help="timed iterations")
    parser.add_argument("--gather-repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=29650)
    parser.add_argument("--timeout-minutes", type=float, default=30)
    parser.add_argument("--output", default=None, help="JSON file (default: print)")
    parser.add_argument("train_flags", nargs=argparse.REMAINDER,
                        help="after --: pretrain_gpt.py flags (model, data, tokenizer)")
    args = parser.parse_args(argv)
    flags = [f for f in args.train_flags if f != "--"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "commit": commit, "command": " ".join(["python", "tools/bench_distributed_optimizer.py",
                                                   *(argv or sys.argv[1:])]),
            "machine": f"{cpu_model()}, {os.cpu_count()} logical CPUs, {platform.platform()}",
            "load": {"before": os.getloadavg()[0]}}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for dp in args.dp:
            for mode in MODES if dp > 1 else ("off", "on"):
                runs.append({"mode": mode, **launch(dp, mode, flags, args, Path(tmp))})
                r = runs[-1]
                print(f"DP={dp} {mode}: optimizer state "
                      f"{max(x['optimizer_state_mib'] for x in r['ranks']):.1f} MiB/rank, peak "
                      f"{max(x['peak_memory_mib'] for x in r['ranks']):.0f} MiB, iteration "
                      f"{statistics.median(x['iteration_s_median'] for x in r['ranks']):.3f} s",
                      flush=True)
    meta["load"]["after"] = os.getloadavg()[0]
    text = json.dumps({**meta, "runs": runs}, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
