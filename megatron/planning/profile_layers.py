"""Measure one megatron-core layer kind on the current device: forward and backward time, bytes
kept for backward, transient peak bytes, parameter bytes. Used by tools/profile_cost_model.py
to build the profiles that dynapipe_ext.costs.cost_profile reads.

Every layer module follows the stage contract of megatron/model/stages.py (`module(inputs,
batch)`, `.config`), so it runs through the same `run_stage_forward` as training and gets the
same layer specs (SDPAttention core attention, fusions) and the same recomputation
(torch.utils.checkpoint over the layer ('full') or over each core attention ('selective')).

Kept bytes are counted exactly with torch.autograd.graph.saved_tensors_hooks: the unique
storages of saved tensors, parameters excluded. Peak bytes: on GPU torch.cuda's peak allocated
counter; on CPU (glibc) the C allocator's bytes in use (mallinfo2: arena + mmapped) read after
every aten op through a TorchDispatchMode, whose maximum over forward + backward minus the
bytes in use before is the peak (allocations inside a single op's workspace are not seen).
"""
from __future__ import annotations

import ctypes
import dataclasses
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils._python_dispatch import TorchDispatchMode

from dynapipe_ext.costs.cost_profile import (FIELDS, TRANSFORMER_KINDS, LayerTable, layer_axes,
                                       profile_kinds)
from dynapipe_ext.costs.model_spec import (
    DEC_EMBEDDING,
    DEC_LAYER,
    EMBEDDING,
    ENC_LAYER,
    ENC_NORM,
    GPT_LAYER,
    HEAD,
    ModelSpec,
)
from megatron.model.attention import AttentionMask, Segments
from megatron.model.stages import (OutputHead, RotaryPositions, layer_spec, norm,
                                   run_stage_forward)


# ------------------------------------------------------------------ layer modules

def _one_layer_block(config: TransformerConfig, one_layer) -> TransformerBlock:
    """A block of one transformer layer without final norm: megatron-core's full recompute lives
    in the block, so a bare TransformerLayer would ignore it."""
    spec = TransformerBlockSubmodules(layer_specs=[one_layer], layer_norm=None)
    return TransformerBlock(config, spec, post_layer_norm=False, pre_process=True,
                            post_process=False)


class ProfiledLayer(torch.nn.Module):
    """One layer kind with the stage forward contract: `forward(inputs, batch)` returns the
    tuple handed to the next layer (or the per-token losses for HEAD)."""

    def __init__(self, kind: str, spec: ModelSpec, config: TransformerConfig):
        super().__init__()
        self.kind, self.spec, self.config = kind, spec, config
        # as StageModule builds them: a learned position table only for learned positions,
        # rotary positions turned in every GPT layer, the final norm of --normalization
        self.rotary = RotaryPositions(spec) if spec.rotary and kind == GPT_LAYER else None
        if kind in (EMBEDDING, DEC_EMBEDDING):
            learned = spec.position_embedding_type == "learned_absolute"
            self.body = LanguageModelEmbedding(config, spec.vocab_size,
                                               spec.max_position_embeddings,
                                               "learned_absolute" if learned else "none")
        elif kind in (GPT_LAYER, ENC_LAYER, DEC_LAYER):
            self.body = _one_layer_block(config, layer_spec(kind))
        elif kind == ENC_NORM:
            self.body = norm(config)
        elif kind == HEAD:
            self.body = OutputHead(config, spec.vocab_size)
        else:
            raise ValueError(f"unknown layer kind {kind!r}")
        # the model dtype throughout, as the stages have it (megatron-core leaves position
        # embeddings and local-spec norms fp32, which CUDA's bf16 kernels refuse)
        self.to(dtype=config.params_dtype)
        with torch.no_grad():   # megatron's own init is off (perform_initialization=False)
            for param in self.body.parameters():
                if param.dim() > 1:
                    param.normal_(0.0, 0.02)

    def forward(self, inputs: tuple, batch: dict):
        kind = self.kind
        if kind == EMBEDDING:
            return (self.body(batch["tokens"], batch["position_ids"]),)
        if kind == DEC_EMBEDDING:
            return inputs + (self.body(batch["dec_tokens"], batch["dec_position_ids"]),)
        if kind in (GPT_LAYER, ENC_LAYER):
            rotary = None if self.rotary is None else self.rotary(batch["position_ids"])
            return (self.body(inputs[0], AttentionMask.of(batch["segments"]),
                              rotary_pos_emb=rotary),)
        if kind == DEC_LAYER:
            enc, dec = inputs
            return (enc, self.body(dec, AttentionMask.of(batch["dec_segments"]), context=enc,
                                   context_mask=AttentionMask.of(batch["dec_segments"],
                                                                 batch["enc_segments"])))
        if kind == ENC_NORM:
            return (self.body(inputs[0]),)
        return self.body(inputs[-1], batch["labels"])


def parameter_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(parameter count, parameter bytes) of a module on this tensor-parallel rank."""
    params = list(module.parameters())
    return (sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params))


@dataclass(frozen=True)
class LayerInputs:
    """Inputs of one measurement: `inputs` from the previous layer, the micro-batch tensors,
    and the storages counted as shared (segment ids, encoder output) rather than per layer."""

    inputs: tuple
    batch: dict
    shared: tuple


def make_inputs(kind: str, spec: ModelSpec, rows: int, seq_len: int, dec_seq_len: int,
                dtype: torch.dtype, device: torch.device, seed: int = 0) -> LayerInputs:
    """Random inputs of the given shape ([seq, rows, hidden] hidden states that need grad, full
    rows: Segments of one sample per row, so GPT and the T5 decoder attend causally)."""
    gen = torch.Generator().manual_seed(seed)
    h, vocab = spec.hidden_size, spec.vocab_size

    def hidden(length: int) -> torch.Tensor:
        return (torch.randn(length, rows, h, generator=gen) * 0.5).to(device, dtype) \
            .requires_grad_(True)

    def tokens(length: int) -> torch.Tensor:
        return torch.randint(0, vocab, (rows, length), generator=gen).to(device)

    def positions(length: int) -> torch.Tensor:
        return torch.arange(length).expand(rows, length).contiguous().to(device)

    t5 = spec.model == "t5"
    out_len = dec_seq_len if t5 else seq_len
    batch = {"labels": tokens(out_len)}
    if kind == EMBEDDING:
        batch.update(tokens=tokens(seq_len), position_ids=positions(seq_len))
        return LayerInputs((), batch, ())
    if kind in (GPT_LAYER, ENC_LAYER):
        batch["segments"] = Segments.full(rows, seq_len, device)
        if spec.rotary:
            batch["position_ids"] = positions(seq_len)
        return LayerInputs((hidden(seq_len),), batch, (batch["segments"].ids,))
    if kind == ENC_NORM:
        return LayerInputs((hidden(seq_len),), batch, ())
    if kind == DEC_EMBEDDING:
        batch.update(dec_tokens=tokens(dec_seq_len), dec_position_ids=positions(dec_seq_len))
        return LayerInputs((hidden(seq_len),), batch, ())
    if kind == DEC_LAYER:
        enc = hidden(seq_len)
        batch["dec_segments"] = Segments.full(rows, dec_seq_len, device)
        batch["enc_segments"] = Segments.full(rows, seq_len, device)
        return LayerInputs((enc, hidden(dec_seq_len)), batch,
                           (enc, batch["dec_segments"].ids, batch["enc_segments"].ids))
    if kind == HEAD:
        return LayerInputs((hidden(out_len),), batch, ())
    raise ValueError(f"unknown layer kind {kind!r}")


# ------------------------------------------------------------------ device facts

def device_name(device: torch.device) -> str:
    """Name of the device the profile is valid for: the GPU model, or 'cpu' + the CPU model +
    torch's thread count (which sets a CPU's speed as much as its model does)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = "cpu " + line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    threads = torch.get_num_threads()
    return f"{name}, {threads} thread{'s' if threads != 1 else ''}"


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of the device (GPU memory, or the machine's RAM for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import os
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def profile_meta(device: torch.device, repeats: int, seconds: float, **extra) -> dict:
    """What a profile records about how it was made (free-form `meta` of CostProfile)."""
    return {"device_memory_bytes": device_memory_bytes(device),
            "threads": torch.get_num_threads(), "repeats": repeats,
            "peak_method": peak_method(device), "timer": timer_name(device),
            "recompute_backend": "torch.utils.checkpoint (run_stage_forward)",
            "seconds": round(seconds, 1), "torch": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **extra}


# ------------------------------------------------------------------ memory measurement

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _load_mallinfo2():
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _load_mallinfo2()


def cpu_bytes_in_use() -> int | None:
    """Bytes the C allocator has handed out (heap in use + mmapped chunks); None off glibc."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class _PeakAfterEachOp(TorchDispatchMode):
    """Reads the allocator's bytes in use after every aten op and keeps the maximum."""

    def __init__(self, read):
        super().__init__()
        self.read = read
        self.peak = read()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.read())
        return out


def peak_method(device: torch.device) -> str:
    """How peak bytes are measured on `device` (recorded in the profile)."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated"
    return "glibc mallinfo2 after every aten op" if _MALLINFO2 else "unavailable"


class _SavedTensorCounter:
    """saved_tensors_hooks pack hook that records (storage pointer, bytes) of saved tensors."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor


def _storage_ptrs(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def _outputs_and_grads(out, gen: torch.Generator):
    """Tensors to call backward on and their gradients (sum for losses)."""
    if isinstance(out, torch.Tensor):
        return [out.sum()], [None]
    outs = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, [torch.randn(t.shape, generator=gen).to(t.device, t.dtype) for t in outs]


# ------------------------------------------------------------------ one measurement

@dataclass(frozen=True)
class LayerMeasurement:
    fwd_ms: float
    bwd_ms: float
    activation_bytes: int
    shared_bytes: int
    peak_bytes: int
    forward_allocated_bytes: int   # allocator's view of bytes left after forward (cross-check)


def timer(device: torch.device):
    """The clock layer times are read with: on a CPU computing with one torch thread the
    process's CPU time (its compute time, which other processes on a shared machine do not
    inflate), else wall time."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter


def timer_name(device: torch.device) -> str:
    return "process CPU time" if timer(device) is time.process_time else "wall time"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(layer: ProfiledLayer, data: LayerInputs, recompute: str, gen, device,
             after_forward=None) -> tuple[float, float]:
    """One forward and backward; (forward ms, backward ms). `after_forward(out)` runs between
    them, outside both timings."""
    clock = timer(device)
    start = clock()
    out = run_stage_forward(layer, data.inputs, data.batch, recompute)
    _sync(device)
    fwd_ms = (clock() - start) * 1e3
    if after_forward is not None:
        after_forward(out)
    outs, grads = _outputs_and_grads(out, gen)
    _sync(device)
    start = clock()
    torch.autograd.backward(outs, grads)
    _sync(device)
    return fwd_ms, (clock() - start) * 1e3


def _clear_input_grads(data: LayerInputs) -> None:
    for t in data.inputs:
        t.grad = None


def measure_layer(layer: ProfiledLayer, data: LayerInputs, recompute: str, repeats: int,
                  device: torch.device, seed: int = 0,
                  statistic: str = "median") -> LayerMeasurement:
    """Warm up once, measure memory in one instrumented forward + backward, then time
    `repeats` plain ones (their median, or their minimum: steadier on a loaded machine)."""
    reduce = {"median": statistics.median, "min": min}[statistic]
    gen = torch.Generator().manual_seed(seed)
    _fwd_bwd(layer, data, recompute, gen, device)      # warm-up; creates parameter grads
    _clear_input_grads(data)

    # memory pass
    params = _storage_ptrs(layer.parameters())
    shared = _storage_ptrs(data.shared)
    counter = _SavedTensorCounter()
    kept: dict = {}

    def after_forward(out):
        # the layer's new outputs are charged to their consumer; inputs passed through stay
        outputs = (_storage_ptrs([out] if isinstance(out, torch.Tensor) else out)
                   - _storage_ptrs(data.inputs))
        own = {p: n for p, n in counter.storages.items() if p not in params and p not in outputs}
        kept["private"] = sum(n for p, n in own.items() if p not in shared)
        kept["shared"] = sum(n for p, n in own.items() if p in shared)
        kept["allocated"] = read() - base

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

        def read():
            return torch.cuda.memory_allocated(device)
    else:
        read = cpu_bytes_in_use if _MALLINFO2 is not None else (lambda: 0)
    base = read()
    tracker = _PeakAfterEachOp(read) if device.type != "cuda" else None
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        if tracker is not None:
            with tracker:
                _fwd_bwd(layer, data, recompute, gen, device, after_forward)
            peak = tracker.peak - base
        else:
            _fwd_bwd(layer, data, recompute, gen, device, after_forward)
            peak = torch.cuda.max_memory_allocated(device) - base
    _clear_input_grads(data)
    kept_total = kept["private"] + kept["shared"]
    transient = max(0, peak - kept_total) if peak_method(device) != "unavailable" else 0

    fwd, bwd = [], []
    for _ in range(repeats):
        f, b = _fwd_bwd(layer, data, recompute, gen, device)
        _clear_input_grads(data)
        fwd.append(f)
        bwd.append(b)
    return LayerMeasurement(reduce(fwd), reduce(bwd), kept["private"],
                            kept["shared"], transient, kept["allocated"])


# ------------------------------------------------------------------ a whole model

@dataclass(frozen=True)
class Point:
    """One measurement to make: layer kind, recompute mode, grid index and shape."""

    kind: str
    mode: str
    index: tuple
    shape: dict


def grid_points(spec: ModelSpec, modes, axis_points, measured=None) -> list[Point]:
    """Every point to measure, in order: per layer kind of `spec`, per recompute mode
    (transformer kinds; 'none' for the others), per grid index of `axis_points(axes)`, unless
    `measured(shape)` says to leave it out."""
    points = []
    for kind in profile_kinds(spec):
        axes = layer_axes(kind, spec.model)
        values = axis_points(axes)
        for mode in (modes if kind in TRANSFORMER_KINDS else ["none"]):
            for index in np.ndindex(*[len(v) for v in values]):
                shape = {a: values[i][j] for i, (a, j) in enumerate(zip(axes, index))}
                if measured is None or measured(shape):
                    points.append(Point(kind, mode, index, shape))
    return points


def profile_model(spec: ModelSpec, config: TransformerConfig, modes, axis_points, repeats: int,
                  dtype: torch.dtype, device: torch.device, seed: int = 0, measured=None,
                  statistic: str = "median", on_point=None):
    """Measure every layer kind of a model: returns (tables[kind][mode] LayerTable,
    parameter counts, parameter bytes) of one TP rank. Points left out by `measured` or out of
    memory are NaN. `on_point(point, measurement or None (out of memory), seconds)` is called
    after each point (progress, logs). Every TP rank must call it alike (the layers' TP
    collectives)."""
    todo = grid_points(spec, modes, axis_points, measured)
    tables, param_count, param_bytes = {}, {}, {}
    for kind in profile_kinds(spec):
        layer = ProfiledLayer(kind, spec, config).to(device)
        param_count[kind], param_bytes[kind] = parameter_bytes(layer)
        axes = layer_axes(kind, spec.model)
        values = axis_points(axes)
        shape_of = tuple(len(v) for v in values)
        tables[kind] = {}
        for mode in (modes if kind in TRANSFORMER_KINDS else ["none"]):
            arrays = {name: np.full(shape_of, np.nan) for name in FIELDS}
            for point in (p for p in todo if p.kind == kind and p.mode == mode):
                # a length the kind does not depend on only shapes inputs it passes through
                seq, dec = point.shape.get("seq_len", 1), point.shape.get("dec_seq_len", 1)
                start = time.perf_counter()
                try:
                    data = make_inputs(kind, spec, point.shape["rows"], seq, dec, dtype, device,
                                       seed=seed)
                    m = measure_layer(layer, data, mode, repeats, device, seed=seed,
                                      statistic=statistic)
                except torch.OutOfMemoryError:
                    m = None
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                if m is not None:
                    for name in FIELDS:
                        arrays[name][point.index] = getattr(m, name)
                if on_point is not None:
                    on_point(point, m, time.perf_counter() - start)
            tables[kind][mode] = LayerTable(axes, tuple(np.asarray(v, dtype=np.float64)
                                                        for v in values), arrays)
    return tables, param_count, param_bytes


# ------------------------------------------------------------------ a whole micro-batch

def time_stage(stage: torch.nn.Module, batch: dict, repeats: int, device: torch.device,
               recompute: str = "none") -> tuple[float, float]:
    """Forward + backward of one micro-batch through a stage that holds the whole model
    (embedding to loss), after a warm-up: (least wall ms, least process CPU ms) over `repeats`.
    CPU time is steadier than wall time on a shared machine (with one torch thread it is the
    compute time); on GPU only the wall time means anything."""
    walls, cpus = [], []
    for i in range(repeats + 1):
        _sync(device)
        wall, cpu = time.perf_counter(), time.process_time()
        losses = run_stage_forward(stage, (), batch, recompute)
        losses.sum().backward()
        _sync(device)
        if i:                              # the first run warms up
            walls.append((time.perf_counter() - wall) * 1e3)
            cpus.append((time.process_time() - cpu) * 1e3)
        stage.zero_grad(set_to_none=True)
    return min(walls), min(cpus)


# ------------------------------------------------------------------ half-layer pipeline units

def half_layer_unit_times(spec: ModelSpec, config: TransformerConfig, rows: int, seq_len: int,
                          device: torch.device, repeats: int = 3,
                          tie_embeddings: bool = True) -> list[float]:
    """Forward + backward ms (least of `repeats` after a warm-up, on `timer(device)`'s clock)
    of the four kinds of pipeline unit of a GPT model cut in half layers
    (ModelSpec.pipeline_cut): embedding + attention half, MLP half, attention half, MLP half
    + output layer and loss. Measured on a two-layer copy of `spec` cut into exactly these
    four stages, run as training runs them (run_stage_forward), on full rows of `seq_len`."""
    from megatron.model.init_weights import initialize_stage_weights
    from megatron.model.stages import build_rank_stages
    two = dataclasses.replace(spec, num_layers=2, pipeline_cut=(1, 1, 1, 1))
    stages = build_rank_stages(two, (0, 0, 0, 0), 0, config, device=device,
                               tie_embeddings=tie_embeddings)
    initialize_stage_weights(stages, seed=0)
    batch = dict(make_inputs(EMBEDDING, two, rows, seq_len, 0, config.params_dtype,
                             device).batch, segments=Segments.full(rows, seq_len, device))
    gen = torch.Generator().manual_seed(0)
    clock = timer(device)
    times = []
    for s in sorted(stages):
        best = float("inf")
        for i in range(repeats + 1):
            inputs = () if s == 0 else (
                (torch.randn(seq_len, rows, spec.hidden_size, generator=gen) * 0.5)
                .to(device, config.params_dtype).requires_grad_(True),)
            _sync(device)
            start = clock()
            out = run_stage_forward(stages[s], inputs, batch)
            _sync(device)
            elapsed = clock() - start
            outs, grads = _outputs_and_grads(out, gen)      # drawn outside the timing
            start = clock()
            torch.autograd.backward(outs, grads)
            _sync(device)
            if i:                          # the first run warms up
                best = min(best, (elapsed + clock() - start) * 1e3)
            stages[s].zero_grad(set_to_none=True)
        times.append(best)
    return times
