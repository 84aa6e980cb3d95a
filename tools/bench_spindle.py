"""Simulate Spindle's wavefront plans against the uniform layout (every component over all
devices, Megatron-LM style) and tasks one after another (each over all devices), for the
multi-task multi-modal configurations of dynapipe_ext/spindle/configs.py at 8-64 devices.
Every plan is checked by the wave-plan checker. Writes the "Spindle" section of
docs/BENCHMARKS.md and docs/bench_spindle.json.

    python tools/bench_spindle.py [--devices 8 16 32 64] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynapipe_ext.spindle.checker import check_wave_plan  # noqa: E402
from dynapipe_ext.spindle.configs import (CONFIGS, FULL_RECOMPUTE, Accelerator,  # noqa: E402
                                          simulated_estimator)
from dynapipe_ext.spindle.scheduler import Cluster, compare, spindle_plan  # noqa: E402
from dynapipe_ext.report.doc_sections import write_section  # noqa: E402

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
            sp, uni, seq = plans["spindle"], plans["uniform"], plans["sequential"]
            handover = sum(w.time_s - w.compute_s for w in sp.waves)
            out.append(dict(
                config=name, plan_ms=plan_ms, tasks=len(model.tasks), components=len(model.components),
                metaops=len(plans['spindle'].metaops), devices=n, waves=len(sp.waves),
                spindle_ms=sp.iteration_s * 1e3, uniform_ms=uni.iteration_s * 1e3,
                sequential_ms=seq.iteration_s * 1e3,
                vs_uniform=uni.iteration_s / sp.iteration_s,
                vs_sequential=seq.iteration_s / sp.iteration_s,
                spindle_compute_ms=sp.compute_s * 1e3, c_star_ms=sp.relaxed_s * 1e3,
                to_c_star=sp.compute_s / sp.relaxed_s - 1,
                uniform_compute_ms=uni.compute_s * 1e3,
                handover_ms=handover * 1e3, spindle_sync_ms=sp.sync_s * 1e3,
                uniform_sync_ms=uni.sync_s * 1e3,
                peak_gib=max(sp.device_memory) / 2**30,
                uniform_peak_gib=max(uni.device_memory) / 2**30))
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
        "80 GiB devices (every plan passes the wave-plan checker, memory included).",
        "",
        "Iteration = waves (compute + activation hand-over, forward and backward) + gradient "
        "all-reduce of every component over the devices that ran it (not overlapped, the same "
        "rule for all three). C* = sum over Spindle's waves of the relaxed common finish time "
        "(real-valued device shares); 'to C*' compares Spindle's wave compute with it. "
        "MetaOps = after contraction and batching (Spindle plans both same-shape batching and "
        "ragged batching of a shared component's data across tasks and keeps the faster). "
        "Uniform = each component once over all devices with all tasks' data (token sums, no "
        "padding: generous to it); sequential = each task's MetaOps over all devices.",
        "",
        "| config | devices | MetaOps | waves | Spindle ms | uniform ms | sequential ms | "
        "vs uniform | vs sequential | Spindle compute ms | C* ms | to C* | uniform compute ms "
        "| hand-over ms | sync ms Spindle/uniform | peak GiB Spindle/uniform | planning ms (CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r['config']} | {r['devices']} | {r['metaops']} | {r['waves']} | "
            f"{r['spindle_ms']:.1f} | {r['uniform_ms']:.1f} | {r['sequential_ms']:.1f} | "
            f"{r['vs_uniform']:.2f}x | {r['vs_sequential']:.2f}x | "
            f"{r['spindle_compute_ms']:.1f} | {r['c_star_ms']:.1f} | "
            f"{100 * r['to_c_star']:.1f}% | {r['uniform_compute_ms']:.1f} | "
            f"{r['handover_ms']:.1f} | {r['spindle_sync_ms']:.1f}/{r['uniform_sync_ms']:.1f} | "
            f"{r['peak_gib']:.1f}/{r['uniform_peak_gib']:.1f} | {r['plan_ms']:.0f} |")
    within = sum(r["to_c_star"] <= 0.10 for r in table)
    ahead = sum(r["vs_uniform"] > 1 for r in table)
    compute_ahead = sum(r["uniform_compute_ms"] > r["spindle_compute_ms"] for r in table)
    lines += ["", f"Targets: within 10% of C* on {within} of {len(table)} rows; ahead of the "
              f"uniform layout on {ahead} of {len(table)} (on wave compute alone, without the "
              f"gradient all-reduce: {compute_ahead} of {len(table)})."]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    table = rows(args.devices)
    text = markdown(table)
    print(text)
    if not args.no_write:
        write_section(REPO / "docs/BENCHMARKS.md", "spindle", "Spindle: multi-task multi-modal "
                      "wavefront scheduling (SIMULATION)", text)
        (REPO / "docs/bench_spindle.json").write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
