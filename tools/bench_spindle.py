"""Simulate Spindle's wavefront plans against the global lower bound, the uniform layout (every
component over all devices, Megatron-LM style) and tasks one after another (each over all
devices), with the gradient all-reduce overlapped as the runtime overlaps it, for the
multi-task multi-modal configurations of dynapipe_ext/spindle/configs.py at 8-64 devices.
Every plan is checked by the wave-plan checker. Writes the "Spindle" section of
docs/BENCHMARKS.md and docs/bench_spindle.json.

    python tools/bench_spindle.py [--devices 8 16 32 64] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynapipe_ext.spindle.checker import check_wave_plan  # noqa: E402
from dynapipe_ext.spindle.configs import (CONFIGS, FULL_RECOMPUTE, Accelerator,  # noqa: E402
                                          simulated_estimator)
from dynapipe_ext.spindle.scheduler import (Cluster, compare, lower_bound_s,  # noqa: E402
                                            spindle_plan)
from dynapipe_ext.report.doc_sections import write_section  # noqa: E402
from tools.benchlib.provenance import provenance_end, provenance_start  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MEMORY_BYTES = 80 * 2**30


def rows(device_counts) -> list[dict]:
    out = []
    for name, make in CONFIGS.items():
        model = make()
        est = simulated_estimator(model, full_recompute=name in FULL_RECOMPUTE)
        for n in device_counts:
            start = time.process_time()
            spindle = spindle_plan(model, est, Cluster(n, MEMORY_BYTES))
            plan_ms = (time.process_time() - start) * 1e3
            plans = compare(model, est, Cluster(n, MEMORY_BYTES))
            assert plans["spindle"].iteration_s == spindle.iteration_s   # deterministic
            for p in plans.values():
                check_wave_plan(p)
            work, path = lower_bound_s(model, est, n)
            bound = max(work, path)
            sp, uni, seq = plans["spindle"], plans["uniform"], plans["sequential"]
            row = dict(config=name, plan_ms=plan_ms, tasks=len(model.tasks),
                       components=len(model.components), metaops=len(sp.metaops), devices=n,
                       waves=len(sp.waves), bound_ms=bound * 1e3, work_bound_ms=work * 1e3,
                       path_bound_ms=path * 1e3, c_star_ms=sp.relaxed_s * 1e3,
                       peak_gib=max(sp.device_memory) / 2**30,
                       uniform_peak_gib=max(uni.device_memory) / 2**30)
            for key, p in (("spindle", sp), ("uniform", uni), ("sequential", seq)):
                waves = sum(w.time_s for w in p.waves)
                row.update({f"{key}_ms": p.overlapped_s * 1e3,
                            f"{key}_to_bound": p.overlapped_s / bound,
                            f"{key}_compute_ms": p.compute_s * 1e3,
                            f"{key}_compute_to_bound": p.compute_s / bound,
                            f"{key}_handover_ms": (waves - p.compute_s) * 1e3,
                            f"{key}_exposed_sync_ms": (p.overlapped_s - waves) * 1e3,
                            f"{key}_unoverlapped_ms": p.iteration_s * 1e3})
            row.update(vs_uniform=uni.overlapped_s / sp.overlapped_s,
                       vs_sequential=seq.overlapped_s / sp.overlapped_s,
                       compute_vs_uniform=uni.compute_s / sp.compute_s,
                       to_c_star=sp.compute_s / sp.relaxed_s - 1)
            out.append(row)
    return out


def markdown(table: list[dict]) -> str:
    acc = Accelerator()
    lines = [
        "Command: `python tools/bench_spindle.py`  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        "SIMULATION, not measured. Model shapes: `dynapipe_ext/spindle/configs.py` "
        "(multitask-clip: six modality encoders, ten contrastive pair tasks; ofa-multitask: "
        "shared 12+12-layer encoder-decoder, five modality adapters, eight tasks; "
        "vision-audio-llm: 32-layer 4096 LLM shared by text, image and audio tasks, 48-layer "
        "ViT, 32-layer audio encoder, full activation recompute to fit). Estimator: per-layer "
        f"`overhead + per_token x tokens` fitted to points of an assumed accelerator "
        f"({acc.flops / 1e12:.0f} TFLOP/s dense, {acc.launch_s * 1e6:.0f} us launch per layer "
        f"fwd+bwd, half rate at {acc.half_tokens:.0f} tokens); alpha-beta links 20 us, 50 GB/s; "
        "fp32 gradients; 80 GiB devices (every plan passes the wave-plan checker, memory "
        "included).",
        "",
        "**Bound** = the global lower bound on an iteration's compute, whatever the plan: max of "
        "total single-device work / N (each component's tokens of all tasks at its one-device "
        "cost) and the critical path (the longest chain of one task's steps, each on 1/N of the "
        "task's tokens); communication is not in it (`lower_bound_s` in "
        "`dynapipe_ext/spindle/scheduler.py`). **Iteration** = waves (compute + activation "
        "hand-over, forward and backward) with each component's gradient all-reduce started "
        "when its last backward ends and overlapping the backward of the waves replayed after "
        "it, as the runtime does (`overlapped_iteration_s`; backward = 2/3 of a wave; "
        "reductions sharing a device's link queue up); the same rule for all three plans. "
        "'exposed all-reduce' = what of it sticks out past the waves. C* = sum over Spindle's "
        "waves of the relaxed common finish time (real-valued device shares: a bound on "
        "Spindle's own waves only). Uniform = each component once over all devices with all "
        "tasks' data (token sums, no padding: generous to it); sequential = each task's "
        "MetaOps over all devices.",
    ]
    for config in dict.fromkeys(r["config"] for r in table):
        lines += ["", f"**{config}**", "",
                  "| devices | waves | bound ms (work/N, path) | Spindle ms (x bound) | "
                  "uniform ms (x bound) | sequential ms (x bound) | Spindle compute ms "
                  "(x bound) | C* ms (compute/C*) | uniform compute (x bound) | exposed "
                  "all-reduce ms Spindle/uniform | Spindle vs uniform / sequential | peak GiB "
                  "Spindle/uniform | planning ms (CPU) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in table if r["config"] == config):
            lines.append(
                f"| {r['devices']} | {r['waves']} | {r['bound_ms']:.1f} ({r['work_bound_ms']:.1f}, "
                f"{r['path_bound_ms']:.1f}) | {r['spindle_ms']:.1f} ({r['spindle_to_bound']:.2f}x) | "
                f"{r['uniform_ms']:.1f} ({r['uniform_to_bound']:.2f}x) | "
                f"{r['sequential_ms']:.1f} ({r['sequential_to_bound']:.2f}x) | "
                f"{r['spindle_compute_ms']:.1f} ({r['spindle_compute_to_bound']:.2f}x) | "
                f"{r['c_star_ms']:.1f} ({1 + r['to_c_star']:.2f}x) | "
                f"{r['uniform_compute_ms']:.1f} ({r['uniform_compute_to_bound']:.2f}x) | "
                f"{r['spindle_exposed_sync_ms']:.1f}/{r['uniform_exposed_sync_ms']:.1f} | "
                f"{r['vs_uniform']:.2f}x / {r['vs_sequential']:.2f}x | "
                f"{r['peak_gib']:.1f}/{r['uniform_peak_gib']:.1f} | {r['plan_ms']:.0f} |")
    within = [r for r in table if r["spindle_to_bound"] <= 1.15]
    within_compute = [r for r in table if r["spindle_compute_to_bound"] <= 1.15]
    ratio = [r["spindle_to_bound"] for r in table]
    compute = [r["spindle_compute_to_bound"] for r in table]
    vs_uni = [r["vs_uniform"] for r in table]
    cvs_uni = [r["compute_vs_uniform"] for r in table]
    lines += ["", f"Target (within 15% of the bound): the whole iteration on {len(within)} of "
              f"{len(table)} rows (Spindle is {min(ratio):.2f}x-{max(ratio):.2f}x the bound); "
              f"wave compute alone on {len(within_compute)} of {len(table)} rows "
              f"({min(compute):.2f}x-{max(compute):.2f}x). Spindle vs uniform, whole iteration: "
              f"{min(vs_uni):.2f}x-{max(vs_uni):.2f}x; wave compute alone: "
              f"{min(cvs_uni):.2f}x-{max(cvs_uni):.2f}x."]
    exposed = [r["spindle_exposed_sync_ms"] / r["spindle_ms"] for r in table]
    sync_rows = [r for r in table if r["spindle_exposed_sync_ms"] > r["spindle_compute_ms"]]
    gap = [r["c_star_ms"] / r["bound_ms"] for r in table]
    lines += ["", "Why Spindle is not within 15% of the bound: (1) the exposed gradient "
              f"all-reduce is {100 * min(exposed):.0f}-{100 * max(exposed):.0f}% of Spindle's "
              f"iteration (larger than its wave compute on {len(sync_rows)} of {len(table)} rows): "
              "components are data-parallel only, so each component's full fp32 gradient is "
              "all-reduced over every device that ran it, and an encoder that runs in the first "
              "wave finishes its backward last, leaving nothing to overlap it with; the bound "
              "has no communication. (2) On compute alone, Spindle's waves are within "
              f"{100 * max(r['to_c_star'] for r in table):.0f}% of their own relaxed optimum "
              f"C*, but C* itself is {min(gap):.2f}x-{max(gap):.2f}x the bound: waves are "
              "synchronous (a MetaOp never spans waves, so a wave waits for its slowest "
              "MetaOp and a short wave of heads leaves devices idle), and a component split "
              "into several MetaOps pays its per-layer overhead once per MetaOp."]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    start = provenance_start("python tools/bench_spindle.py " + shlex.join(
        sys.argv[1:] if argv is None else argv))
    table = rows(args.devices)
    text = markdown(table)
    print(text)
    if not args.no_write:
        write_section(REPO / "docs/BENCHMARKS.md", "spindle", "Spindle: multi-task multi-modal "
                      "wavefront scheduling (SIMULATION)", text)
        result = {**provenance_end(start), "rows": table}
        (REPO / "docs/bench_spindle.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
