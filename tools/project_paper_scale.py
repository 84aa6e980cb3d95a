#!/usr/bin/env python
"""Paper-scale projection (a SIMULATION, no training): packing vs dynamic micro-batching for the
DynaPipe paper's models, predicted with the project's planners and pipeline schedule search.

Models: GPT with hidden 4096, 32 layers, 32 heads (GPT-2 vocabulary) and T5 with hidden 1024,
24 + 24 layers, 16 heads (T5 vocabulary), each on 4 pipeline stages (GPT TP=2 - one row of
8,192 tokens does not fit a 40 GiB device at TP=1 even with full recompute - T5 TP=1; DP=1); 65,536 tokens
per global batch; max length 512-8192 (T5 decoder max(128, L/4)). Costs: the AnalyticCostModel
(FLOP and byte counts per layer, A100-like figures of tools/bench_planner.py: 120 TFLOP/s
achieved, 40 GiB, bf16, 16 bytes of model state per parameter) - not a profile of this CPU:
a CPU profile of a small model says nothing reliable about A100 kernels at hidden 4096, so
the analytic model is the honest choice. Sample lengths: bench_planner's seeded FLAN-like
generator. Per global batch: plan the micro-batches (packing: next-fit rows of the max length,
its rows per micro-batch tuned by predicted time over powers of two; dynamic: the DynaPipe
planner), search the schedule (1F1B / adaptive, fastest that fits memory), and take the
simulated makespan; tokens/s = real tokens / makespan, averaged over `--batches` batches.

With --gpt-profiles / --t5-profiles, a second projection (key "cpu_fit") whose costs come from
profiles of this device: tools/profile_cost_model.py measures the real megatron-core layers
at sizes this CPU can run (hidden 256 and 512 here; a hidden-4096 layer at 8k tokens is ~1e13
FLOPs), and per layer kind, recompute mode and field a small law is fitted to all profiles of
a model by non-negative least squares in relative error (fit_cost_laws): time = a x GEMM
FLOPs + b x attention FLOPs + c x tokens x hidden + d; kept / shared / peak bytes = per
token x hidden + per head x s^2 + per s^2 + constant. Two hidden sizes separate the hidden^2
from the hidden terms. The laws are evaluated at the paper's sizes (FittedLawCostModel;
GEMM, attention and score terms divided by TP, no TP communication cost, float32 bytes read as
bf16 = x0.5, memory and model states as above). The fit's relative errors on the profiled
points are stored with its coefficients. Everything else (data, planning, schedules) is the
same as for the analytic rows.

    python tools/project_paper_scale.py --output runs/projection.json

The committed profiles (docs/cpu_profile_*.json, ~7 min of one core in all) came from

    P="python tools/profile_cost_model.py --num-layers 1 --vocab-size 2048 --repeats 3 \
       --threads 1 --recompute-modes none,selective,full --max-position-embeddings 2048"
    $P --model gpt --hidden-size 256 --num-attention-heads 4 --micro-batch-sizes 1,4 \
       --seq-lengths 64,256,1024,2048 --output docs/cpu_profile_gpt_h256.json
    $P --model gpt --hidden-size 512 --num-attention-heads 8 --micro-batch-sizes 1,4 \
       --seq-lengths 64,256,1024 --output docs/cpu_profile_gpt_h512.json
    $P --model t5 --hidden-size 256 --num-attention-heads 4 --micro-batch-sizes 1,4 \
       --seq-lengths 64,256,1024,2048 --dec-seq-lengths 32,128,512 \
       --output docs/cpu_profile_t5_h256.json
    $P --model t5 --hidden-size 512 --num-attention-heads 8 --micro-batch-sizes 1,4 \
       --seq-lengths 64,256,1024 --dec-seq-lengths 32,128,512 \
       --output docs/cpu_profile_t5_h512.json
    python tools/project_paper_scale.py --output runs/projection_cpu_fit.json \
        --gpt-profiles docs/cpu_profile_gpt_h256.json docs/cpu_profile_gpt_h512.json \
        --t5-profiles docs/cpu_profile_t5_h256.json docs/cpu_profile_t5_h512.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dynapipe_ext.costs.cost_model import (AnalyticCostModel, CostModel, StageCostArrays,  # noqa: E402
                                     analytic_balanced_cut, shape_feasible)
from dynapipe_ext.costs.cost_profile import load_profile  # noqa: E402
from dynapipe_ext.costs.model_spec import (DEC_EMBEDDING, DEC_LAYER, EMBEDDING, ENC_LAYER,  # noqa: E402
                                     ENC_NORM, GPT_LAYER, HEAD, ModelSpec,
                                     token_weighted_length)
from dynapipe_ext.batching.planners import (PlannerConfig, PlanningError,  # noqa: E402
                                   effective_lengths, plan_micro_batches)
from dynapipe_ext.schedule.schedule_search import micro_batch_costs, search_schedule  # noqa: E402
from megatron.training.arguments import add_flag_group  # noqa: E402
from tools.bench_planner import DEVICE, global_batch  # noqa: E402

PAPER_GPT = ModelSpec("gpt", num_layers=32, hidden_size=4096, num_attention_heads=32,
                      vocab_size=50257, max_position_embeddings=8192)
PAPER_T5 = ModelSpec("t5", num_layers=24, hidden_size=1024, num_attention_heads=16,
                     vocab_size=32128, num_decoder_layers=24, max_position_embeddings=8192)
STAGES = 4
TENSOR_PARALLEL = {"gpt": 2, "t5": 1}   # GPT 6.7B needs TP=2 to fit 8k rows in 40 GiB (8 GPUs)
TOKENS = 65536
MAX_LENGTHS = (512, 1024, 2048, 4096, 8192)
TARGETS_8192 = {"gpt": 3.25, "t5": 4.39}     # the paper's best speed-ups over packing


# ------------------------------------------------------------------ cost law fitted to a profile

TIME_FIELDS = ("fwd_ms", "bwd_ms")
BYTE_FIELDS = ("activation_bytes", "shared_bytes", "peak_bytes")
FIT_FIELDS = TIME_FIELDS + BYTE_FIELDS


def law_features(kind: str, spec: ModelSpec, b, s, d, tp: int = 1) -> tuple[dict, dict]:
    """(time terms, byte terms) of one layer kind at shapes (b rows, s enc/GPT len, d T5 dec
    len), as named arrays; a fitted law is a non-negative combination of them. Time: GEMM
    FLOPs, attention FLOPs (score + context), elementwise work (~ tokens x hidden) and a
    constant per call. Bytes: activation tensors per token (~ hidden; FFN tensors are 4x
    hidden in every profile and paper model, so they are part of that term), per-head score
    tensors, mask-like (per-row s^2) tensors and a constant. TP splits GEMMs, attention and
    score tensors; per-token tensors count in full on every rank (an upper bound)."""
    h, f, a, v = spec.hidden_size, spec.ffn_size, spec.num_attention_heads, spec.vocab_size
    b, s, d = (np.asarray(x, dtype=np.float64) for x in (b, s, d))
    one = np.ones(np.broadcast(b, s, d).shape)
    if kind in (GPT_LAYER, ENC_LAYER):
        time = {"gemm_flops": 2 * b * s * (4 * h * h + 2 * h * f) / tp,
                "attn_flops": 4 * b * s * s * h / tp, "elem": b * s * h, "const": one}
        size = {"hidden": b * s * h, "scores": a * b * s * s / tp,
                "mask": b * s * s, "const": one}
    elif kind == DEC_LAYER:
        time = {"gemm_flops": (2 * b * d * (6 * h * h + 2 * h * f) + 4 * b * s * h * h) / tp,
                "attn_flops": 4 * b * (d * d + s * d) * h / tp, "elem": b * d * h,
                "const": one}
        size = {"hidden": b * d * h, "enc_hidden": b * s * h,
                "scores": a * b * (d * d + s * d) / tp, "mask": b * (d * d + s * d),
                "const": one}
    elif kind == HEAD:
        tokens = b * (d if spec.model == "t5" else s)
        time = {"gemm_flops": 2 * tokens * h * v / tp, "elem": tokens * v / tp, "const": one}
        size = {"hidden": tokens * h, "logits": tokens * v / tp, "const": one}
    elif kind in (EMBEDDING, ENC_NORM, DEC_EMBEDDING):
        tokens = b * (d if kind == DEC_EMBEDDING else s)
        time = {"elem": tokens * h, "const": one}
        size = {"hidden": tokens * h, "const": one}
    else:
        raise ValueError(f"unknown layer kind {kind!r}")
    return time, size


def fit_nonnegative(features: dict, target: np.ndarray) -> tuple[dict, np.ndarray]:
    """Non-negative least squares of `target` on the named feature columns, in relative error
    (each point weighted by 1 / its value, so small shapes count as much as large ones).
    Returns (coefficient per name, the fitted values)."""
    from scipy.optimize import nnls
    y = np.asarray(target, dtype=np.float64).ravel()
    names = list(features)
    x = np.stack([np.asarray(features[n], dtype=np.float64).ravel() for n in names], axis=1)
    if not np.any(y > 0):
        return {n: 0.0 for n in names}, np.zeros_like(y)
    weight = 1.0 / np.maximum(np.abs(y), 1e-3 * np.abs(y).max())
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls((x / scale) * weight[:, None], y * weight)
    coef = coef / scale
    return dict(zip(names, coef.tolist())), x @ coef


def profile_points(profile, kind: str, mode: str) -> tuple[dict, dict]:
    """Measured points of one kind and mode: ({'rows','seq_len','dec_seq_len'}: arrays,
    {field: arrays}), unmeasured (NaN) points dropped."""
    table = profile.table(kind, mode)
    grid = np.meshgrid(*table.points, indexing="ij")
    shape = {axis: g.ravel() for axis, g in zip(table.axes, grid)}
    values = {f: np.asarray(table.values[f], dtype=np.float64).ravel() for f in FIT_FIELDS}
    ok = np.all([np.isfinite(v) for v in values.values()], axis=0)
    n = int(ok.sum())
    axes = {a: shape[a][ok] if a in shape else np.ones(n) for a in ("rows", "seq_len",
                                                                   "dec_seq_len")}
    return axes, {f: v[ok] for f, v in values.items()}


def fit_cost_laws(profiles: list) -> dict:
    """Fit one law per (layer kind, recompute mode, field) to the points of all `profiles`
    (one model type, e.g. the same GPT at two hidden sizes, so that hidden and hidden^2 terms
    separate). Returns {kind: {mode: {field: {"coef": {...}, "median_rel_err", "max_rel_err",
    "max_rel_err_large", "points"}}}}; relative errors are of the fitted law on the profiled
    points ("large": on the points of at least 10% of the largest value)."""
    from dynapipe_ext.costs.cost_profile import profile_kinds
    models = {p.spec.model for p in profiles}
    if len(models) != 1:
        raise ValueError(f"fit_cost_laws needs profiles of one model type, got {sorted(models)}")
    laws: dict = {}
    for kind in profile_kinds(profiles[0].spec):
        modes = profiles[0].tables[kind].keys()
        for mode in modes:
            feats = {"time": {}, "size": {}}
            targets = {f: [] for f in FIT_FIELDS}
            for prof in profiles:
                axes, vals = profile_points(prof, kind, mode)
                time, size = law_features(kind, prof.spec, axes["rows"], axes["seq_len"],
                                          axes["dec_seq_len"],
                                          prof.key.get("tensor_model_parallel_size", 1))
                for group, named in (("time", time), ("size", size)):
                    for name, col in named.items():
                        feats[group].setdefault(name, []).append(col)
                for f in FIT_FIELDS:
                    targets[f].append(vals[f])
            out = {}
            for f in FIT_FIELDS:
                group = feats["time" if f in TIME_FIELDS else "size"]
                y = np.concatenate(targets[f])
                coef, fitted = fit_nonnegative({n: np.concatenate(c) for n, c in group.items()},
                                               y)
                big = y > 1e-2 * max(y.max(), 1e-30)
                rel = np.abs(fitted[big] - y[big]) / y[big] if big.any() else np.zeros(1)
                large = y >= 0.1 * y.max()
                rel_large = np.abs(fitted[large] - y[large]) / y[large] if y.max() > 0 else [0]
                out[f] = {"coef": coef, "median_rel_err": float(np.median(rel)),
                          "max_rel_err": float(rel.max()),
                          "max_rel_err_large": float(np.max(rel_large)),
                          "points": int(y.size)}
            laws.setdefault(kind, {})[mode] = out
    return laws


def evaluate_law(law: dict, kind: str, spec: ModelSpec, b, s, d, tp: int) -> dict:
    """Every field of a fitted law (one kind and mode) at shapes (b, s, d) of model `spec`."""
    time, size = law_features(kind, spec, b, s, d, tp)
    out = {}
    for field, fit in law.items():
        named = time if field in TIME_FIELDS else size
        out[field] = sum(c * named[n] for n, c in fit["coef"].items())
    return out


class FittedLawCostModel(CostModel):
    """Stage costs from per-kind laws fitted to a profile (fit_cost_laws), evaluated at any
    model size: a stage's times and kept bytes are sums over its layers, shared bytes once per
    kind and stage, its peak the largest of its layers' (as ProfiledCostModel). Kept/peak bytes
    are scaled by `byte_scale` (0.5: a float32 profile read as bf16). Model states and device
    memory as the AnalyticCostModel's (`device_mem_bytes`, `bytes_per_param_state`)."""

    def __init__(self, spec: ModelSpec, laws: dict, tp: int = 1, byte_scale: float = 1.0,
                 device_mem_bytes: float = 40 * 2**30, bytes_per_param_state: float = 16,
                 max_seq_len: int | None = None, max_dec_seq_len: int | None = None,
                 num_stages: int = 1):
        self.spec, self.laws, self.tp, self.byte_scale = spec, laws, tp, float(byte_scale)
        self.max_seq_len, self.max_dec_seq_len = max_seq_len, max_dec_seq_len
        self.num_stages = num_stages
        self._states = AnalyticCostModel(spec, tp=tp, device_mem_bytes=device_mem_bytes,
                                         bytes_per_param_state=bytes_per_param_state,
                                         num_stages=num_stages)

    def activation_memory_limit(self, num_stages: int | None = None) -> float:
        return self._states.activation_memory_limit(num_stages or self.num_stages)

    def stage_cost_arrays(self, rows, seq_len, dec_seq_len, num_stages: int,
                          recompute: str = "none") -> StageCostArrays:
        b = np.atleast_1d(np.asarray(rows, dtype=np.float64))
        s = np.broadcast_to(np.asarray(seq_len, dtype=np.float64), b.shape)
        d = np.broadcast_to(np.asarray(dec_seq_len, dtype=np.float64), b.shape)
        feasible = shape_feasible(self.spec.model, b, s, d, self.max_seq_len,
                                  self.max_dec_seq_len)
        stages = self.spec.stage_layers(num_stages)
        per_kind = {}
        for kind in {k for kinds in stages for k in kinds}:
            modes = self.laws[kind]
            mode = recompute if recompute in modes else "none"
            per_kind[kind] = evaluate_law(modes[mode], kind, self.spec, b, s, d, self.tp)
        out = np.zeros((4, num_stages) + b.shape)
        for k, kinds in enumerate(stages):
            for kind in dict.fromkeys(kinds):
                vals, count = per_kind[kind], kinds.count(kind)
                out[0, k] += count * vals["fwd_ms"]
                out[1, k] += count * vals["bwd_ms"]
                out[2, k] += self.byte_scale * (count * vals["activation_bytes"]
                                                + vals["shared_bytes"])
                np.maximum(out[3, k], self.byte_scale * vals["peak_bytes"], out=out[3, k])
        return StageCostArrays(out[0], out[1], out[2], out[3], feasible)


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
                           overlong="truncate", packing_algorithm="nextfit")
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


def fit_summary(laws: dict) -> dict:
    """Worst median / max relative error of the fitted laws per field, over kinds and modes
    (transformer layers and the head: the kinds that carry the cost)."""
    out = {}
    for field in FIT_FIELDS:
        fits = [modes[m][field] for k, modes in laws.items()
                if k in (GPT_LAYER, ENC_LAYER, DEC_LAYER, HEAD) for m in modes]
        fits = [f for f in fits if any(c > 0 for c in f["coef"].values())]
        if fits:
            out[field] = {"median_rel_err_worst": max(f["median_rel_err"] for f in fits),
                          "max_rel_err_worst": max(f["max_rel_err"] for f in fits),
                          "max_rel_err_large_worst": max(f["max_rel_err_large"] for f in fits)}
    return out


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
    import subprocess
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="JSON file to write")
    p.add_argument("--max-lengths", nargs="+", type=int, default=list(MAX_LENGTHS))
    p.add_argument("--batches", type=int, default=3, help="global batches per point")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--gpt-profiles", nargs="+", default=[],
                   help="tools/profile_cost_model.py GPT profiles (two hidden sizes) to fit")
    p.add_argument("--t5-profiles", nargs="+", default=[],
                   help="tools/profile_cost_model.py T5 profiles (two hidden sizes) to fit")
    add_flag_group(p, "parallel", ["pipeline_split"], title="", pipeline_split=dict(
        choices=("even", "balanced"),
        help="GPT stages: whole layers, or half layers as the trainer's --pipeline-split "
             "balanced cuts them (costed analytically here)"))
    args = p.parse_args(argv)
    paths = {m: ps for m, ps in (("gpt", args.gpt_profiles), ("t5", args.t5_profiles)) if ps}
    result = project_all(tuple(args.max_lengths), args.batches, args.seed, paths or None,
                         args.pipeline_split)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1))
    for r in result["rows"]:
        cut = f"  cut {r['pipeline_cut']}" if r.get("pipeline_cut") else ""
        print(f"{r['model']} {r['max_len']:>5} {r['strategy']:<8} "
              f"{r['tokens_per_s']:>12,.0f} tokens/s  {r['speedup_vs_packing']:.2f}x{cut}")
    for r in result.get("cpu_fit", {}).get("rows", []):
        print(f"cpu-fit {r['model']} {r['max_len']:>5} {r['strategy']:<8} "
              f"{r['tokens_per_s']:>12,.2f} tokens/s  {r['speedup_vs_packing']:.2f}x")
    for model, fit in result.get("cpu_fit", {}).get("fits", {}).items():
        print(f"cpu-fit {model} law error (worst over kinds/modes): {fit['summary']}")
    print(f"wrote {args.output} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
