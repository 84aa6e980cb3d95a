"""A cost model fitted to profiles: per layer kind, recompute mode and field, a small law
(time = a x GEMM FLOPs + b x attention FLOPs + c x tokens x hidden + d; kept / shared / peak
bytes = per token x hidden + per head x s^2 + per s^2 + constant) fitted to the measured points
of profiles of one model type at two or more sizes by non-negative least squares in relative
error, and evaluated at any model size (FittedLawCostModel). tools/project_paper_scale.py
projects the paper's models with it."""
from __future__ import annotations

import numpy as np

from dynapipe_ext.costs.cost_model import (AnalyticCostModel, CostModel, StageCostArrays,
                                           shape_feasible)
from dynapipe_ext.costs.model_spec import (DEC_EMBEDDING, DEC_LAYER, EMBEDDING, ENC_LAYER,
                                           ENC_NORM, GPT_LAYER, HEAD, ModelSpec)

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
    p = spec.attention_width        # Q, K, V and the core (h unless --kv-channels says else)
    b, s, d = (np.asarray(x, dtype=np.float64) for x in (b, s, d))
    one = np.ones(np.broadcast(b, s, d).shape)
    if kind in (GPT_LAYER, ENC_LAYER):
        qkv = 2 + 2 * spec.kv_share    # Q + projection, K + V of the query groups
        time = {"gemm_flops": 2 * b * s * (qkv * h * p + 2 * h * f) / tp,
                "attn_flops": 4 * b * s * s * p / tp, "elem": b * s * h, "const": one}
        size = {"hidden": b * s * h, "scores": a * b * s * s / tp,
                "mask": b * s * s, "const": one}
    elif kind == DEC_LAYER:
        time = {"gemm_flops": (2 * b * d * (6 * h * p + 2 * h * f) + 4 * b * s * h * p) / tp,
                "attn_flops": 4 * b * (d * d + s * d) * p / tp, "elem": b * d * h,
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

    def activation_memory_limit(self, num_stages: int | None = None,
                                stage_to_rank: tuple[int, ...] | None = None) -> float:
        return self._states.activation_memory_limit(num_stages or self.num_stages, stage_to_rank)

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
