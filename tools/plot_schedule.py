#!/usr/bin/env python
"""Draw a pipeline plan as a per-rank Gantt chart (PNG) and export a Chrome trace (JSON).

FLAN-like random micro-batches -> the chosen schedule -> lowered, checked plans. Times come from
the simulator, or with --emulate from running the plans through the Executor in threads whose
handlers sleep for the simulated compute time (times measured by the executor).

  python tools/plot_schedule.py --schedule adaptive --num-stages 4 --num-micro-batches 16 \
      --seed 0 --out-png schedule.png --out-trace schedule.json
"""
from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynapipe_ext.costs.cost_model import AnalyticCostModel  # noqa: E402
from dynapipe_ext.runtime.executor import Executor  # noqa: E402
from dynapipe_ext.plan.instructions import (Backward, Forward, FreeBuffer, LoadInput,  # noqa: E402
                                       RecvActivationFinish, RecvActivationStart, RecvGradFinish,
                                       RecvGradStart, SendActivationFinish, SendActivationStart,
                                       SendGradFinish, SendGradStart)
from dynapipe_ext.plan.lowering import action_ms_from_costs, lower  # noqa: E402
from dynapipe_ext.batching.microbatch import MicroBatch  # noqa: E402
from dynapipe_ext.costs.model_spec import ModelSpec  # noqa: E402
from dynapipe_ext.plan.plan_checker import check_plans  # noqa: E402
from dynapipe_ext.schedule.registry import SCHEDULE_NAMES  # noqa: E402
from dynapipe_ext.schedule.schedule_search import costs_for, micro_batch_costs, search_schedule  # noqa
from dynapipe_ext.schedule.simulator import CommModel, transfer_matrix  # noqa: E402
from dynapipe_ext.plan.trace import (draw_gantt, events_from_records,  # noqa: E402
                                events_from_simulation, write_chrome_trace)


def flan_like_micro_batches(num_mbs: int, seed: int, model: str) -> list[MicroBatch]:
    """Lognormal FLAN-like lengths, sorted, cut into `num_mbs` micro-batches of about equal
    real tokens (so short samples make wide micro-batches, long ones narrow), padded to a
    multiple of 8, in random order."""
    rng = np.random.default_rng(seed)
    n = 12 * num_mbs
    lengths = np.sort(np.minimum(np.exp(rng.normal(np.log(180), 0.9, n)), 2048).astype(int) + 4)
    dec = np.minimum(np.exp(rng.normal(np.log(20), 1.0, n)).astype(int) + 2, 256)
    cuts = np.searchsorted(np.cumsum(lengths), np.linspace(0, lengths.sum(), num_mbs + 1)[1:-1])
    groups = [g for g in np.split(np.arange(n), cuts) if len(g)]
    while len(groups) < num_mbs:        # split the widest group until there are enough
        widest = max(range(len(groups)), key=lambda i: len(groups[i]))
        g = groups.pop(widest)
        groups[widest:widest] = [g[:len(g) // 2], g[len(g) // 2:]]
    mbs = []
    for g in groups:
        seq = int(math.ceil(lengths[g].max() / 8) * 8)
        dec_seq = int(math.ceil(dec[g].max() / 8) * 8) if model == "t5" else 0
        mbs.append(MicroBatch(rows=tuple((int(i),) for i in g), seq_len=seq,
                              dec_seq_len=dec_seq))
    order = rng.permutation(len(mbs))
    return [mbs[i] for i in order]


def model_spec(model: str, num_ranks: int) -> ModelSpec:
    """A ~1B-parameter shape whose layers split over P, 2P and 4P stages."""
    if model == "gpt":
        return ModelSpec("gpt", num_layers=8 * num_ranks, hidden_size=2048,
                         num_attention_heads=16, vocab_size=32000)
    return ModelSpec("t5", num_layers=4 * num_ranks, num_decoder_layers=4 * num_ranks,
                     hidden_size=1024, num_attention_heads=16, vocab_size=32128)


class _Channel:
    """In-order messages src -> dst with rendezvous waits (emulates non-blocking p2p)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.sent, self.posted = 0, 0

    def bump(self, attr: str) -> int:
        with self.cond:
            setattr(self, attr, getattr(self, attr) + 1)
            self.cond.notify_all()
            return getattr(self, attr) - 1

    def wait(self, attr: str, k: int, timeout_s: float = 60.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: getattr(self, attr) > k, timeout_s):
                raise TimeoutError(f"peer never reached message #{k}")


def emulate(plans, costs, scale: float) -> list:
    """Run all plans through Executors in threads; compute sleeps its simulated ms * scale.
    Returns per-rank executor records."""
    num_ranks = len(plans)
    chans = {(a, b): _Channel() for a in range(num_ranks) for b in range(num_ranks)}
    records, errors = [None] * num_ranks, []

    def rank_handlers(r):
        ticket = {}

        def compute(ins):
            table = costs.fwd_ms if type(ins) is Forward else costs.bwd_ms
            time.sleep(float(table[ins.mb, ins.stage]) * scale / 1e3)

        def send_start(ins):
            ticket[ins.buffer] = chans[(r, ins.peer)].bump("sent")

        def send_finish(ins):
            chans[(r, ins.peer)].wait("posted", ticket.pop(ins.buffer))

        def recv_start(ins):
            ticket[ins.buffer] = chans[(ins.peer, r)].bump("posted")

        def recv_finish(ins):
            chans[(ins.peer, r)].wait("sent", ticket.pop(ins.buffer))

        def nothing(ins):
            pass

        return {Forward: compute, Backward: compute, LoadInput: nothing, FreeBuffer: nothing,
                SendActivationStart: send_start, SendGradStart: send_start,
                SendActivationFinish: send_finish, SendGradFinish: send_finish,
                RecvActivationStart: recv_start, RecvGradStart: recv_start,
                RecvActivationFinish: recv_finish, RecvGradFinish: recv_finish}

    def work(r):
        try:
            records[r] = Executor(rank_handlers(r)).run(plans[r], record_times=True)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return records


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, default="adaptive")
    p.add_argument("--num-stages", type=int, default=4, help="pipeline ranks P")
    p.add_argument("--num-micro-batches", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=("gpt", "t5"), default="gpt")
    p.add_argument("--out-png", type=Path)
    p.add_argument("--out-trace", type=Path)
    p.add_argument("--emulate", action="store_true",
                   help="times measured by the executor on sleeping handlers, not simulated")
    p.add_argument("--time-scale", type=float, default=0.02,
                   help="with --emulate: wall seconds per simulated second")
    args = p.parse_args(argv)
    if args.num_stages < 1 or args.num_micro_batches < 1:
        p.error("--num-stages and --num-micro-batches must be >= 1")
    if not (args.out_png or args.out_trace):
        p.error("give --out-png and/or --out-trace")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    P, M = args.num_stages, args.num_micro_batches
    spec = model_spec(args.model, P)
    mbs = flan_like_micro_batches(M, args.seed, args.model)
    cost_model = AnalyticCostModel(spec, device_flops=100e12, dtype_bytes=2)
    source = micro_batch_costs(mbs, cost_model, spec)
    comm = CommModel(latency_ms=0.02, bandwidth_bytes_per_ms=12e6)    # ~12 GB/s links
    schedule, result = search_schedule(source, math.inf, P, candidates=(args.schedule,),
                                       comm=comm)
    costs = costs_for(source, schedule.num_stages)
    plans = lower(schedule, mbs, spec, dtype="bfloat16", action_ms=action_ms_from_costs(costs))
    check_plans(plans, spec)
    if args.emulate:
        records = emulate(plans, costs, args.time_scale)
        t0 = min(rec[0][1] for rec in records if rec)
        events = [e for plan, rec in zip(plans, records)
                  for e in events_from_records(plan, rec, t0)]
        source_text = f"measured by the executor (sleep-emulated, x{args.time_scale})"
    else:
        events = events_from_simulation(result, transfer_matrix(schedule.stage_to_rank, costs,
                                                                comm))
        source_text = "simulated"
    title = (f"{schedule.name}: {args.model.upper()}, P={P}, {M} FLAN-like micro-batches "
             f"(seed {args.seed}); simulated makespan {result.makespan_ms:.1f} ms, "
             f"bubble {result.mean_bubble_fraction:.1%}; times {source_text}")
    if args.out_png:
        draw_gantt(events, args.out_png, title, num_ranks=P)
    if args.out_trace:
        write_chrome_trace(events, args.out_trace, name=schedule.name)
    n_ins = sum(len(p.instructions) for p in plans)
    print(f"{schedule.name}: {n_ins} instructions over {P} ranks, makespan "
          f"{result.makespan_ms:.2f} ms, mean bubble {result.mean_bubble_fraction:.3f}"
          + (f", png {args.out_png}" if args.out_png else "")
          + (f", trace {args.out_trace}" if args.out_trace else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
