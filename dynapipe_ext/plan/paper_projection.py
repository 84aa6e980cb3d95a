"""Paper-scale projection (a SIMULATION, no training): packing vs dynamic micro-batching for the
DynaPipe paper's models (GPT hidden 4096 / 32 layers, T5 hidden 1024 / 24 + 24 layers, 4
pipeline stages), predicted with the planners and the pipeline schedule search, costed by the
AnalyticCostModel with A100-like figures or by laws fitted to CPU profiles
(dynapipe_ext.costs.fitted_cost_model). tools/project_paper_scale.py is its command line."""
from __future__ import annotations

import subprocess
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from dynapipe_ext.batching.planners import (PlannerConfig, PlanningError, effective_lengths,
                                            plan_micro_batches)
from dynapipe_ext.batching.synthetic import DEVICE, global_batch
from dynapipe_ext.costs.cost_model import AnalyticCostModel, CostModel, analytic_balanced_cut
from dynapipe_ext.costs.cost_profile import load_profile
from dynapipe_ext.costs.fitted_cost_model import FittedLawCostModel, fit_cost_laws, fit_summary
from dynapipe_ext.costs.model_spec import ModelSpec, token_weighted_length
from dynapipe_ext.schedule.schedule_search import micro_batch_costs, search_schedule

ROOT = Path(__file__).resolve().parents[2]

PAPER_GPT = ModelSpec("gpt", num_layers=32, hidden_size=4096, num_attention_heads=32,
                      vocab_size=50257, max_position_embeddings=8192)
PAPER_T5 = ModelSpec("t5", num_layers=24, hidden_size=1024, num_attention_heads=16,
                     vocab_size=32128, num_decoder_layers=24, max_position_embeddings=8192)
STAGES = 4
TENSOR_PARALLEL = {"gpt": 2, "t5": 1}   # GPT 6.7B needs TP=2 to fit 8k rows in 40 GiB (8 GPUs)
TOKENS = 65536
MAX_LENGTHS = (512, 1024, 2048, 4096, 8192)
TARGETS_8192 = {"gpt": 3.25, "t5": 4.39}     # the paper's best speed-ups over packing


def planner_setup(model: str, max_len: int, laws: dict | None = None,
                  spec: ModelSpec | None = None,
                  tokens: int = TOKENS) -> tuple[PlannerConfig, CostModel]:
    """Planner config and cost model of one (model, max length): the AnalyticCostModel with
    DEVICE's figures, or with `laws` a FittedLawCostModel (same memory and model-state
    assumptions, float32-profiled bytes read as bf16)."""
    spec = spec or (PAPER_GPT if model == "gpt" else PAPER_T5)
    max_dec = max(128, max_len // 4) if model == "t5" else 0
    tp = TENSOR_PARALLEL[model]
    if laws is None:
        cost = AnalyticCostModel(spec, tp=tp, max_seq_len=max_len,
                                 max_dec_seq_len=max_dec or None, num_stages=STAGES, **DEVICE)
    else:
        cost = FittedLawCostModel(spec, laws, tp=tp, byte_scale=DEVICE["dtype_bytes"] / 4,
                                  device_mem_bytes=DEVICE["device_mem_bytes"],
                                  bytes_per_param_state=DEVICE["bytes_per_param_state"],
                                  max_seq_len=max_len, max_dec_seq_len=max_dec or None,
                                  num_stages=STAGES)
    config = PlannerConfig(model=model, max_seq_len=max_len, max_dec_seq_len=max_dec,
                           pipeline_stages=STAGES, tokens_per_global_batch=tokens,
                           overlong="truncate", packing_algorithm="nextfit",
                           dynamic_layout="padded")
    return config, cost


def simulate(lengths, config: PlannerConfig, cost, strategy: str, spec: ModelSpec) -> dict:
    """Plan + schedule search for one global batch: predicted makespan and plan facts."""
    plan = plan_micro_batches(lengths, config, cost, strategy)
    mbs = plan.micro_batches
    memory = cost.activation_memory_limit(num_stages=STAGES)
    schedule, result = search_schedule(micro_batch_costs(mbs, cost, spec, 2), memory, STAGES,
                                       ("1f1b", "adaptive"))
    return {"makespan_ms": float(result.makespan_ms), "schedule": schedule.name,
            "micro_batches": len(mbs),
            "recompute": sorted({mb.recompute for mb in mbs})}


def best_packing(lengths, config: PlannerConfig, cost, spec: ModelSpec) -> tuple[int, dict]:
    """Packing with its best rows per micro-batch (powers of two that fit) by makespan."""
    best = None
    size = 1
    while size <= 256:
        try:
            sim = simulate(lengths, replace(config, micro_batch_size=size), cost, "packing",
                           spec)
        except (PlanningError, ValueError):
            break
        if best is None or sim["makespan_ms"] < best[1]["makespan_ms"]:
            best = (size, sim)
        size *= 2
    if best is None:
        raise RuntimeError(f"packing: not one row of {config.max_seq_len} tokens fits memory")
    return best


def project(model: str, max_len: int, batches: int, seed: int, laws: dict | None = None,
            spec: ModelSpec | None = None, tokens: int = TOKENS) -> list[dict]:
    """Simulated tokens/s of packing and dynamic at one max length (mean over batches);
    analytic costs, or the fitted `laws`; `spec` / `tokens` default to the paper's."""
    config, cost = planner_setup(model, max_len, laws, spec, tokens)
    spec = cost.spec
    totals = {"packing": [0.0, 0, []], "dynamic": [0.0, 0, []]}
    for b in range(batches):
        lengths = global_batch(model, tokens, max_len, config.max_dec_seq_len, seed + b)
        lengths, _ = effective_lengths(lengths, config)
        real = int(np.asarray(lengths).sum())
        size, pack = best_packing(lengths, config, cost, spec)
        dyn = simulate(lengths, config, cost, "dynamic", spec)
        for name, sim in (("packing", dict(pack, micro_batch_size=size)), ("dynamic", dyn)):
            totals[name][0] += sim["makespan_ms"]
            totals[name][1] += real
            totals[name][2].append(sim)
    rows = []
    for name, (ms, real, sims) in totals.items():
        rows.append({"model": model, "max_len": max_len, "strategy": name,
                     "tokens_per_s": real / (ms / 1e3), "predicted_iteration_ms": ms / batches,
                     "micro_batches": [s["micro_batches"] for s in sims],
                     "schedules": [s["schedule"] for s in sims],
                     "recompute": sorted({m for s in sims for m in s["recompute"]}),
                     "micro_batch_size": [s.get("micro_batch_size") for s in sims]})
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup_vs_packing"] = row["tokens_per_s"] / base
    return rows


def profile_facts(path: str, profile) -> dict:
    """What a profile was measured on and with (for the report)."""
    meta = profile.meta
    return {"file": str(path), "device": profile.key["device"], "dtype": profile.key["dtype"],
            "hidden_size": profile.key["hidden_size"],
            "num_attention_heads": profile.key["num_attention_heads"],
            "vocab_size": profile.key["vocab_size"],
            "grid": {kind: {axis: pts for axis, pts in
                            zip(t["none"].axes, (p.tolist() for p in t["none"].points))}
                     for kind, t in profile.tables.items()},
            "modes": sorted(profile.modes()), "threads": meta.get("threads"),
            "repeats": meta.get("repeats"), "seconds": meta.get("seconds"),
            "created": meta.get("created")}


def git_commit() -> str:
    """Short commit of this checkout, or 'unknown' outside git."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def project_fitted(profile_paths: dict, max_lengths=MAX_LENGTHS, batches: int = 3,
                   seed: int = 7) -> dict:
    """The projection with costs from laws fitted to CPU profiles ({model: [paths]})."""
    started = time.perf_counter()
    rows, laws_out, sources = [], {}, {}
    for model, paths in profile_paths.items():
        profiles = [load_profile(p) for p in paths]
        bad = [str(p) for p, prof in zip(paths, profiles) if prof.spec.model != model]
        if bad:
            raise ValueError(f"--{model}-profiles: {bad} are not {model} profiles")
        laws = fit_cost_laws(profiles)
        laws_out[model] = {"laws": laws, "summary": fit_summary(laws)}
        sources[model] = [profile_facts(p, prof) for p, prof in zip(paths, profiles)]
        rows += [r for L in max_lengths for r in project(model, L, batches, seed, laws)]
    return {"kind": "simulation", "cost_model": "FittedLawCostModel (laws fitted to CPU "
            "profiles of real megatron-core layers)", "commit": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "profiles": sources, "fits": laws_out,
            "byte_scale": DEVICE["dtype_bytes"] / 4, "rows": rows,
            "wall_s": time.perf_counter() - started}


def balanced_gpt(max_len: int, seed: int, tokens: int = TOKENS) -> ModelSpec:
    """PAPER_GPT cut in half layers over STAGES stages as `--pipeline-split balanced` would cut
    it, with the analytic model (DEVICE's figures, TP) at the token-weighted mean length of
    the first global batch."""
    seq = token_weighted_length(global_batch("gpt", tokens, max_len, 0, seed), max_len)
    cut = analytic_balanced_cut(PAPER_GPT, STAGES, seq, tp=TENSOR_PARALLEL["gpt"], **DEVICE)
    return replace(PAPER_GPT, pipeline_cut=cut)


def project_all(max_lengths=MAX_LENGTHS, batches: int = 3, seed: int = 7,
                profile_paths: dict | None = None, pipeline_split: str = "even") -> dict:
    """Every model and max length; `pipeline_split` "balanced" cuts GPT in half layers."""
    started = time.perf_counter()
    specs = {("gpt", L): balanced_gpt(L, seed) for L in max_lengths} \
        if pipeline_split == "balanced" else {}
    rows = [r for model in ("gpt", "t5") for L in max_lengths
            for r in project(model, L, batches, seed, spec=specs.get((model, L)))]
    for r in rows:
        cut = specs.get((r["model"], r["max_len"]))
        r["pipeline_cut"] = list(cut.pipeline_cut) if cut else None
    result = {"kind": "simulation", "cost_model": "AnalyticCostModel",
              "tensor_parallel": TENSOR_PARALLEL,
              "device": {k: v for k, v in DEVICE.items()}, "stages": STAGES, "tokens": TOKENS,
              "batches": batches, "seed": seed,
              "models": {"gpt": vars(PAPER_GPT), "t5": vars(PAPER_T5)},
              "targets_8192": TARGETS_8192, "rows": rows, "pipeline_split": pipeline_split,
              "wall_s": time.perf_counter() - started}
    if profile_paths:
        result["cpu_fit"] = project_fitted(profile_paths, max_lengths, batches, seed)
    return result
