"""Profiled cost model: per-layer measurements on a grid of micro-batch shapes, saved as a JSON
profile keyed by (model config, tensor-parallel degree, device, dtype), interpolated for the
planners.

A profile holds, per layer kind (model_spec.EMBEDDING, GPT_LAYER, ...) and recompute mode, a
table over a grid of shapes; each grid axis is one of `rows`, `seq_len`, `dec_seq_len` (which
ones depends on the kind: a T5 decoder layer has all three, the T5 head only rows and
dec_seq_len). Per grid point: `fwd_ms`, `bwd_ms` (backward incl. any recomputation),
`activation_bytes` (kept from forward to backward, charged to this layer: its own saved tensors
and the input it saves, never its output, which its consumer saves), `shared_bytes` (saved
tensors that every layer of the kind on a stage shares: attention masks, the T5 encoder output
seen by the decoder's cross-attention; counted once per stage) and `peak_bytes` (transient peak
during forward + backward above what was allocated before, minus the kept activations). Kinds
other than transformer layers are profiled once (mode "none") and serve every mode, as
megatron-core's recompute only ever covers transformer layers.

Between grid points bytes are multi-linear in the axes and times power laws (see
LayerTable.interpolate); a shape above the grid (or below it,
unless `below_grid="bound"`) is infeasible (None), never an extrapolation -- except more rows
than the grid's largest under `rows_above_grid="scale"`: rows are independent samples, so kept
bytes grow exactly in proportion to them and time at most so (a device never gets slower per
row with more rows), which makes the scaled value exact for memory and an upper bound for time.

Profiles made on first use by the trainer (`--cost-model profile`) live in a cache directory
under their key's file name (`cached_profile`, `auto_grid`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import zlib
from pathlib import Path

import numpy as np

from dynapipe_ext.costs.cost_model import WHOLE_LAYER, CostModel, StageCostArrays, half_layer_shares
from dynapipe_ext.costs.model_spec import (DEC_EMBEDDING, DEC_LAYER, EMBEDDING, ENC_LAYER, ENC_NORM,
                         GPT_ATTENTION, GPT_LAYER, HEAD, MODEL_OPTIONS, ModelSpec)

PROFILE_VERSION = 1
RECOMPUTE_MODES = ("none", "selective", "full")
TRANSFORMER_KINDS = (GPT_LAYER, ENC_LAYER, DEC_LAYER)
AXES = ("rows", "seq_len", "dec_seq_len")
FIELDS = ("fwd_ms", "bwd_ms", "activation_bytes", "shared_bytes", "peak_bytes")
TIME_FIELDS = ("fwd_ms", "bwd_ms")
# Model-state bytes per parameter with Adam: fp32 training = param 4 + grad 4 + m 4 + v 4 = 16;
# bf16/fp16 mixed precision = half param 2 + fp32 main grad 4 + fp32 master param 4 + m 4 + v 4.
STATE_BYTES_PER_PARAM = {"float32": 16, "bfloat16": 18, "float16": 18}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ProfileError(ValueError):
    """A profile file that cannot be used: wrong version, wrong key, malformed tables."""


def layer_axes(kind: str, model: str) -> tuple[str, ...]:
    """Grid axes a layer kind's cost depends on."""
    if kind == DEC_LAYER:
        return ("rows", "seq_len", "dec_seq_len")
    if kind == DEC_EMBEDDING or (kind == HEAD and model == "t5"):
        return ("rows", "dec_seq_len")
    return ("rows", "seq_len")


def profile_kinds(spec: ModelSpec) -> tuple[str, ...]:
    """Layer kinds a model of this spec is made of."""
    if spec.model == "gpt":
        return (EMBEDDING, GPT_LAYER, HEAD)
    return (EMBEDDING, ENC_LAYER, ENC_NORM, DEC_EMBEDDING, DEC_LAYER, HEAD)


# the ModelSpec options that are not sizes (model_spec.MODEL_OPTIONS)
LAYER_OPTIONS = tuple(f.name for f in MODEL_OPTIONS if not f.metadata["shape"])


# ModelSpec fields a profile does not depend on (tying, the pipeline cut, which vocabulary
# rows are padding), at the value a profile's spec takes for them
UNKEYED = {"tied_embeddings": False, "pipeline_cut": (), "unpadded_vocab_size": 0}


def profile_key(spec: ModelSpec, tp: int, device: str, dtype: str) -> dict:
    """What a profile is valid for: every ModelSpec field, the TP degree, device and dtype."""
    if dtype not in STATE_BYTES_PER_PARAM:
        raise ValueError(f"dtype must be one of {sorted(STATE_BYTES_PER_PARAM)}, got {dtype!r}")
    # per-kind tables do not depend on the UNKEYED fields; layer options (gated MLP, norms,
    # ...) enter the key only when not at their defaults, so profiles made before they existed
    # still match
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    shape = {k: v for k, v in dataclasses.asdict(spec).items()
             if k not in UNKEYED
             and not (k in LAYER_OPTIONS and v == defaults[k])}
    return {**shape, "tensor_model_parallel_size": int(tp), "device": str(device),
            "dtype": dtype}


def profile_file_name(key: dict) -> str:
    """A readable file name that differs whenever the key differs in a field that matters."""
    device = re.sub(r"[^A-Za-z0-9]+", "-", key["device"]).strip("-").lower() or "device"
    layers = f"L{key['num_layers']}" + (f"-D{key['num_decoder_layers']}"
                                         if key["model"] == "t5" else "")
    ffn = key["ffn_hidden_size"] or 4 * key["hidden_size"]
    return (f"{key['model']}-{layers}-h{key['hidden_size']}-a{key['num_attention_heads']}"
            f"-f{ffn}-v{key['vocab_size']}-p{key['max_position_embeddings']}"
            f"-tp{key['tensor_model_parallel_size']}{_options_tag(key)}-{device}-{key['dtype']}"
            ".json")


def _options_tag(key: dict) -> str:
    """'-o<crc32>' of the non-default layer options in a key ('' when there are none)."""
    options = {k: key[k] for k in LAYER_OPTIONS if k in key}
    if not options:
        return ""
    return f"-o{zlib.crc32(json.dumps(options, sort_keys=True).encode()):08x}"


# ------------------------------------------------------------------ tables and interpolation

@dataclasses.dataclass(frozen=True)
class LayerTable:
    """Measurements of one layer kind under one recompute mode over a rectilinear grid:
    `axes` names, `points[i]` the sorted grid values of axis i, `values[field]` arrays of shape
    (len(points[0]), len(points[1]), ...); NaN marks a point that could not be measured."""

    axes: tuple[str, ...]
    points: tuple[np.ndarray, ...]
    values: dict

    def __post_init__(self):
        if not self.axes or any(a not in AXES for a in self.axes):
            raise ProfileError(f"table axes must be a subset of {AXES}, got {self.axes}")
        if len(self.points) != len(self.axes):
            raise ProfileError(f"{len(self.axes)} axes but {len(self.points)} point lists")
        shape = tuple(len(p) for p in self.points)
        for axis, pts in zip(self.axes, self.points):
            if len(pts) == 0 or np.any(np.diff(pts) <= 0):
                raise ProfileError(f"grid points of axis {axis!r} must be strictly increasing "
                                   f"and non-empty, got {list(pts)}")
        for name in FIELDS:
            if name not in self.values:
                raise ProfileError(f"table is missing field {name!r}")
            if np.shape(self.values[name]) != shape:
                raise ProfileError(f"field {name!r} has shape {np.shape(self.values[name])}, "
                                   f"grid shape is {shape}")

    def to_json(self) -> dict:
        def with_nulls(arr: np.ndarray) -> list:
            obj = np.asarray(arr, dtype=np.float64).astype(object)
            obj[~np.isfinite(np.asarray(arr, dtype=np.float64))] = None
            return obj.tolist()

        return {"axes": list(self.axes), "points": [p.tolist() for p in self.points],
                **{name: with_nulls(self.values[name]) for name in FIELDS}}

    @classmethod
    def from_json(cls, data: dict) -> "LayerTable":
        try:
            values = {name: np.asarray([np.nan if v is None else v for v in
                                        np.ravel(np.asarray(data[name], dtype=object))],
                                       dtype=np.float64).reshape(np.shape(data[name]))
                      for name in FIELDS}
            return cls(tuple(data["axes"]),
                       tuple(np.asarray(p, dtype=np.float64) for p in data["points"]), values)
        except KeyError as err:
            raise ProfileError(f"layer table is missing {err}") from None

    def interpolate(self, query: dict, below_grid: str = "infeasible"):
        """Interpolation at `query` (axis name -> array of values, broadcast together).
        Returns ({field: array}, feasible bool array). Times are interpolated as power laws
        between grid points (multi-linear in log value over log axis), which is exact for a
        term in s^k and keeps the quadratic attention of a coarse (x4) length grid from being
        overestimated by up to a half; bytes (linear in every axis) multi-linearly. Above the
        grid is infeasible; below it is infeasible or, with below_grid="bound", takes the
        grid's smallest point (costs never decrease with shape, so that is an upper bound)."""
        qs = np.broadcast_arrays(*[np.asarray(query[a], dtype=np.float64) for a in self.axes])
        feasible = np.ones(qs[0].shape, dtype=bool)
        lows, fracs, log_fracs = [], [], []
        for q, pts in zip(qs, self.points):
            feasible &= q <= pts[-1]
            if below_grid == "bound":
                q = np.maximum(q, pts[0])
            else:
                feasible &= q >= pts[0]
            if len(pts) == 1:
                feasible &= (q == pts[0]) if below_grid != "bound" else (q <= pts[0])
                lows.append(np.zeros(q.shape, dtype=np.int64))
                fracs.append(np.zeros(q.shape))
                log_fracs.append(np.zeros(q.shape))
                continue
            lo = np.clip(np.searchsorted(pts, q, side="right") - 1, 0, len(pts) - 2)
            frac = np.clip((q - pts[lo]) / (pts[lo + 1] - pts[lo]), 0.0, 1.0)
            lows.append(lo)
            fracs.append(frac)
            if pts[0] > 0:
                with np.errstate(divide="ignore", invalid="ignore"):
                    log_frac = np.log(np.maximum(q, pts[lo]) / pts[lo]) / np.log(
                        pts[lo + 1] / pts[lo])
                log_fracs.append(np.clip(log_frac, 0.0, 1.0))
            else:
                log_fracs.append(frac)
        shape = qs[0].shape
        out = {name: np.zeros(shape) for name in FIELDS}
        logs = {name: np.zeros(shape) for name in TIME_FIELDS}
        positive = {name: np.ones(shape, dtype=bool) for name in TIME_FIELDS}
        for corner in np.ndindex(*(2 if len(p) > 1 else 1 for p in self.points)):
            weight, log_weight = np.ones(shape), np.ones(shape)
            index = []
            for bit, lo, frac, log_frac in zip(corner, lows, fracs, log_fracs):
                weight = weight * (frac if bit else 1.0 - frac)
                log_weight = log_weight * (log_frac if bit else 1.0 - log_frac)
                index.append(lo + bit)
            index = tuple(index)
            for name in FIELDS:
                vals = np.nan_to_num(self.values[name][index], nan=np.inf)
                # an unmeasured (NaN) corner makes the point infeasible only if it has weight
                with np.errstate(invalid="ignore"):
                    out[name] += np.where(weight > 0, weight * vals, 0.0)
                if name in TIME_FIELDS:
                    with np.errstate(divide="ignore", invalid="ignore"):
                        logs[name] += np.where(log_weight > 0,
                                               log_weight * np.log(np.maximum(vals, 1e-300)),
                                               0.0)
                    positive[name] &= (vals > 0) | (log_weight == 0)
        for name in TIME_FIELDS:     # a zero or negative corner: linear after all
            out[name] = np.where(positive[name] & np.isfinite(out[name]),
                                 np.exp(logs[name]), out[name])
        for name in FIELDS:
            feasible &= np.isfinite(out[name])
        return out, feasible


# ------------------------------------------------------------------ profile files

@dataclasses.dataclass
class CostProfile:
    """A loaded profile: key, per-kind parameter counts/bytes (one TP rank), tables
    `tables[kind][mode]`, and free-form `meta` (device memory, tool settings)."""

    key: dict
    param_count: dict
    param_bytes: dict
    tables: dict
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def spec(self) -> ModelSpec:
        fields = {f.name for f in dataclasses.fields(ModelSpec)}
        return ModelSpec(**{k: v for k, v in self.key.items() if k in fields})

    def table(self, kind: str, mode: str) -> LayerTable:
        """The table of `kind` under `mode`; kinds without recompute use their "none" table."""
        modes = self.tables.get(kind)
        if not modes:
            raise ProfileError(f"profile has no measurements for layer kind {kind!r}")
        if kind not in TRANSFORMER_KINDS:
            mode = "none" if "none" in modes else next(iter(modes))
        if mode not in modes:
            raise ProfileError(f"profile has no {mode!r} recompute measurements for {kind!r} "
                               f"(it has {sorted(modes)})")
        return modes[mode]

    def modes(self) -> tuple[str, ...]:
        """Recompute modes every transformer kind of the profile was measured in."""
        kinds = [k for k in self.tables if k in TRANSFORMER_KINDS]
        return tuple(m for m in RECOMPUTE_MODES if all(m in self.tables[k] for k in kinds))


def save_profile(path, profile: CostProfile) -> Path:
    """Write `profile` as JSON (atomically: a temp file renamed into place)."""
    path = Path(path)
    data = {"version": PROFILE_VERSION, "key": profile.key, "meta": profile.meta,
            "param_count": profile.param_count, "param_bytes": profile.param_bytes,
            "layers": {kind: {mode: table.to_json() for mode, table in modes.items()}
                       for kind, modes in profile.tables.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False))
    os.replace(tmp, path)
    return path


def load_profile(path, expect_key: dict | None = None) -> CostProfile:
    """Read a profile; a wrong version, or a key differing from `expect_key`, is a
    ProfileError naming the file and the differing fields."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ProfileError(f"{path}: cannot read cost profile: {err}") from None
    version = data.get("version") if isinstance(data, dict) else None
    if version != PROFILE_VERSION:
        raise ProfileError(f"{path}: cost profile version {version!r}, this code reads version "
                           f"{PROFILE_VERSION}; re-run tools/profile_cost_model.py")
    key = data.get("key", {})
    if expect_key is not None:
        diff = {k: (key.get(k), v) for k, v in expect_key.items() if key.get(k) != v}
        if diff:
            shown = ", ".join(f"{k}: file has {a!r}, expected {b!r}" for k, (a, b) in diff.items())
            raise ProfileError(f"{path}: cost profile is for another configuration ({shown})")
    try:
        tables = {kind: {mode: LayerTable.from_json(t) for mode, t in modes.items()}
                  for kind, modes in data["layers"].items()}
        return CostProfile(key=key, param_count=data["param_count"],
                           param_bytes=data["param_bytes"], tables=tables,
                           meta=data.get("meta", {}))
    except (KeyError, ProfileError, ValueError) as err:
        raise ProfileError(f"{path}: malformed cost profile: {err}") from None


def find_profile(directory, spec: ModelSpec, tp: int, device: str, dtype: str) -> CostProfile:
    """Load the profile for this configuration from `directory` (by its key's file name)."""
    key = profile_key(spec, tp, device, dtype)
    path = Path(directory) / profile_file_name(key)
    if not path.exists():
        raise ProfileError(f"no cost profile {path.name} in {directory}; create it with "
                           f"tools/profile_cost_model.py")
    return load_profile(path, expect_key=key)


# ------------------------------------------------------------------ profiles made on first use

def default_cache_dir() -> Path:
    """Where profiles made on first use are kept: $XDG_CACHE_HOME (or ~/.cache) /
    megatron-dynapipe/profiles."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron-dynapipe" / "profiles"


def profile_covers(profile: CostProfile, max_seq_len: int, max_dec_seq_len: int) -> bool:
    """Whether every table reaches the run's longest encoder / decoder sequence (rows are
    scaled, so they need no coverage)."""
    longest = {"seq_len": max_seq_len, "dec_seq_len": max_dec_seq_len}
    return all(table.points[i][-1] >= longest[axis]
               for modes in profile.tables.values() for table in modes.values()
               for i, axis in enumerate(table.axes) if axis in longest)


def cached_profile(directory, key: dict, max_seq_len: int, max_dec_seq_len: int
                   ) -> tuple[Path, CostProfile | None, str | None]:
    """(cache file of `key` in `directory`, its profile if usable, why not). The profile is
    None when the file is absent (reason None) or when it is unreadable, for another key or
    too short for the run's lengths (reason says which, so the caller can profile again)."""
    path = Path(directory) / profile_file_name(key)
    if not path.exists():
        return path, None, None
    try:
        profile = load_profile(path, expect_key=key)
    except ProfileError as err:
        return path, None, f"cached cost profile unusable: {err}"
    if not profile_covers(profile, max_seq_len, max_dec_seq_len):
        return path, None, (f"cached cost profile {path} stops short of this run's sequence "
                            f"lengths ({max_seq_len}, decoder {max_dec_seq_len})")
    return path, profile, None


@dataclasses.dataclass(frozen=True)
class ProfileGrid:
    """Shapes to measure: every combination of `rows`, `seq_lens`, `dec_seq_lens` (per layer
    kind, its axes only) whose rows x longest length is at most `max_tokens` (one row is
    always measured); the rest is filled by scaling in rows (fill_rows_by_scaling)."""

    rows: tuple[int, ...]
    seq_lens: tuple[int, ...]
    dec_seq_lens: tuple[int, ...]
    max_tokens: int

    def axis_points(self, axes: tuple[str, ...]) -> list[list[int]]:
        values = {"rows": self.rows, "seq_len": self.seq_lens, "dec_seq_len": self.dec_seq_lens}
        return [list(values[a]) for a in axes]

    def measured(self, shape: dict) -> bool:
        longest = max(shape.get("seq_len", 0), shape.get("dec_seq_len", 0))
        return shape["rows"] == 1 or shape["rows"] * longest <= self.max_tokens


def geometric_points(shortest: int, longest: int, step: int) -> tuple[int, ...]:
    """shortest, shortest*step, ... below `longest`, then `longest` itself."""
    points, value = [], max(1, shortest)
    while value < longest:
        points.append(value)
        value *= step
    return tuple(points + [longest])


def auto_grid(max_seq_len: int, max_dec_seq_len: int, max_tokens: int, step: int = 4,
              shortest: int = 16) -> ProfileGrid:
    """A grid that covers a run: lengths `shortest` * step^k up to the run's max lengths
    (shorter shapes are bounded by the first point), rows step^k while one row of the
    shortest length fits `max_tokens`. Step 4 keeps first-use profiling to a minute or two
    on a CPU for small models; the interpolation error this costs is in docs/BENCHMARKS.md."""
    if min(max_seq_len, max_tokens) < 1:
        raise ValueError(f"need max_seq_len and max_tokens >= 1, got {max_seq_len}, "
                         f"{max_tokens}")
    seqs = geometric_points(min(shortest, max_seq_len), max_seq_len, step)
    decs = (geometric_points(min(shortest, max_dec_seq_len), max_dec_seq_len, step)
            if max_dec_seq_len > 0 else (1,))
    shortest_len = min(seqs[0], decs[0]) if max_dec_seq_len > 0 else seqs[0]
    top = max(1, max_tokens // shortest_len)
    rows = tuple(step ** k for k in range(int(math.log(top, step) + 1e-9) + 1))
    return ProfileGrid(rows, seqs, decs, int(max_tokens))


def fill_rows_by_scaling(values: dict, rows: np.ndarray) -> dict:
    """Unmeasured (NaN) points of tables whose axis 0 is `rows` filled from the nearest
    measured point with fewer rows, scaled by the rows ratio (see the module docstring)."""
    out = {}
    for name, arr in values.items():
        arr = np.array(arr, dtype=np.float64)
        for i in range(1, len(rows)):
            missing = np.isnan(arr[i])
            for j in range(i - 1, -1, -1):
                take = missing & np.isfinite(arr[j])
                arr[i][take] = arr[j][take] * rows[i] / rows[j]
                missing &= ~take
        out[name] = arr
    return out


# ------------------------------------------------------------------ the cost model

class ProfiledCostModel(CostModel):
    """Stage costs from a profile: a stage's time and kept activations are the sums over its
    layers (ModelSpec.stage_layers), shared tensors (masks, encoder output) counted once per
    stage, its transient peak the largest of its layers'. The memory left for activations is
    `device_memory_bytes` minus the model states (parameters x `bytes_per_param_state`, see
    STATE_BYTES_PER_PARAM) of the heaviest rank. `spec` is the run's model (default the
    profile's): it may differ from the profile's only in what the key ignores (tied
    embeddings, the pipeline cut).

    GPT half layers (ModelSpec.pipeline_cut) are not profiled: the profiler runs whole
    megatron-core TransformerLayers, and the profile's key ignores the cut. A half is its
    whole GPT_LAYER's measured cost times its analytic share (cost_model.half_layer_shares)
    in time, kept bytes and parameters; its transient peak is taken as the whole layer's (a
    peak is a maximum, not a sum: a half runs a part of the layer's operations at the same
    shapes, so the whole layer's peak bounds it, where an analytic share could understate it:
    the analytic model counts no transient for a fused attention without recompute); the
    shared tensors (segment ids: attention masks) go with the attention half and count once
    per stage with the whole layers'."""

    def __init__(self, profile: CostProfile, device_memory_bytes: float | None = None,
                 bytes_per_param_state: float | None = None, num_stages: int = 1,
                 below_grid: str = "infeasible", rows_above_grid: str = "infeasible",
                 spec: ModelSpec | None = None, tp_slot_share: float = 1.0):
        if below_grid not in ("infeasible", "bound"):
            raise ValueError(f"below_grid must be 'infeasible' or 'bound', got {below_grid!r}")
        if rows_above_grid not in ("infeasible", "scale"):
            raise ValueError(f"rows_above_grid must be 'infeasible' or 'scale', got "
                             f"{rows_above_grid!r}")
        self.rows_above_grid = rows_above_grid
        self.tp_slot_share = float(tp_slot_share)
        self.profile = profile
        self.spec = spec or profile.spec
        if dataclasses.replace(self.spec, **UNKEYED) != dataclasses.replace(profile.spec,
                                                                            **UNKEYED):
            raise ValueError(f"cost profile is for {profile.spec}, this run trains {self.spec}")
        memory = device_memory_bytes or profile.meta.get("device_memory_bytes")
        if not memory or memory <= 0:
            raise ValueError("device_memory_bytes is needed: the profile does not record the "
                             "device's memory")
        self.device_memory_bytes = float(memory)
        self.bytes_per_param_state = float(bytes_per_param_state or
                                           STATE_BYTES_PER_PARAM[profile.key["dtype"]])
        self.num_stages = num_stages
        self.below_grid = below_grid

    # ---- model states
    def model_state_bytes(self, num_stages: int) -> list[float]:
        """Parameter + gradient + optimizer bytes of each stage (one TP rank)."""
        return [sum(self._param_count(kind) for kind in kinds) * self.bytes_per_param_state
                for kinds in self.spec.stage_layers(num_stages)]

    def _param_count(self, kind: str) -> float:
        """Parameters of one layer kind (a half layer: its share of the whole layer's); a
        transformer layer's times tp_slot_share (FlexTP's slots; its norms counted with it)."""
        if kind in WHOLE_LAYER:
            share = half_layer_shares(self.spec, self._tp)[kind]["param_count"]
            return self.profile.param_count[WHOLE_LAYER[kind]] * share * self.tp_slot_share
        if kind in TRANSFORMER_KINDS:
            return self.profile.param_count[kind] * self.tp_slot_share
        return self.profile.param_count[kind]

    @property
    def _tp(self) -> int:
        return int(self.profile.key.get("tensor_model_parallel_size", 1))

    # ---- stage costs
    def stage_cost_arrays(self, rows, seq_len, dec_seq_len, num_stages: int,
                          recompute: str = "none") -> StageCostArrays:
        """Vectorised stage costs over arrays of shapes (shape (num_stages, n) per field)."""
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        b = np.atleast_1d(np.asarray(rows, dtype=np.float64))
        query = {"rows": b, "seq_len": np.broadcast_to(np.asarray(seq_len, np.float64), b.shape),
                 "dec_seq_len": np.broadcast_to(np.asarray(dec_seq_len, np.float64), b.shape)}
        stages = self.spec.stage_layers(num_stages)
        used = {k for kinds in stages for k in kinds}
        measured = {kind: self._interpolate(self.profile.table(kind, recompute), query)
                    for kind in {WHOLE_LAYER.get(k, k) for k in used}}
        per_kind = {kind: (self._half_layer(kind, measured[WHOLE_LAYER[kind]][0], query,
                                            recompute), measured[WHOLE_LAYER[kind]][1])
                    if kind in WHOLE_LAYER else measured[kind] for kind in used}
        out = np.zeros((4, num_stages) + b.shape)
        feasible = np.ones(b.shape, dtype=bool)
        for s, kinds in enumerate(stages):
            shared = {}   # per measured kind: a half layer shares its whole layer's tensors
            for kind in dict.fromkeys(kinds):
                vals, ok = per_kind[kind]
                count = kinds.count(kind)
                feasible &= ok
                out[0, s] += count * vals["fwd_ms"]
                out[1, s] += count * vals["bwd_ms"]
                out[2, s] += count * vals["activation_bytes"]
                whole = WHOLE_LAYER.get(kind, kind)
                shared[whole] = np.maximum(shared.get(whole, 0.0), vals["shared_bytes"])
                np.maximum(out[3, s], vals["peak_bytes"], out=out[3, s])
            out[2, s] += sum(shared.values())
        out[:, :, ~feasible] = 0.0
        return StageCostArrays(out[0], out[1], out[2], out[3], feasible)

    def _half_layer(self, kind: str, whole: dict, query: dict, recompute: str) -> dict:
        """Fields of a half layer from its whole layer's interpolated fields (see the class
        docstring)."""
        shares = half_layer_shares(self.spec, self._tp, query["rows"], query["seq_len"],
                                   recompute, DTYPE_BYTES[self.profile.key["dtype"]])[kind]
        return {"fwd_ms": whole["fwd_ms"] * shares["fwd_ms"],
                "bwd_ms": whole["bwd_ms"] * shares["bwd_ms"],
                "activation_bytes": whole["activation_bytes"] * shares["activation_bytes"],
                "shared_bytes": whole["shared_bytes"] if kind == GPT_ATTENTION
                else np.zeros_like(whole["shared_bytes"]),
                "peak_bytes": whole["peak_bytes"]}

    def _interpolate(self, table: LayerTable, query: dict):
        """table.interpolate, with rows above the grid scaled from its largest rows when
        rows_above_grid is "scale" (rows is every table's first axis)."""
        if self.rows_above_grid != "scale":
            return table.interpolate(query, self.below_grid)
        top = table.points[0][-1]
        factor = np.maximum(query["rows"] / top, 1.0)
        vals, ok = table.interpolate(dict(query, rows=np.minimum(query["rows"], top)),
                                     self.below_grid)
        return {name: v * factor for name, v in vals.items()}, ok
