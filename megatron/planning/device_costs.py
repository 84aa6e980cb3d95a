"""The device a run plans for: memory, compute rate, pipeline link, and the bytes the model
states take, turned into the planner's cost-model source (one construction path for the
trainer, the tools and the tests).

Figures come from flags when given (`--device-memory-gb`, `--memory-headroom-gb`,
`--device-flops`, `--p2p-bandwidth-gbps`, `--p2p-latency-us`), else from the device:
* memory: `torch.cuda.get_device_properties(LOCAL_RANK).total_memory`; on CPU the physical
  memory divided by the ranks of this node (LOCAL_WORLD_SIZE, as torchrun sets it);
* headroom kept for the allocator, CUDA context and NCCL buffers: 10% of the memory, plus
  1 GiB on a GPU;
* compute rate: on a GPU a short matmul calibration in the run's precision (about 0.3 s),
  rounded to two significant digits; on CPU a fixed nominal rate, so CPU plans (and exact
  resumes, which need the same plans) do not depend on machine load -- pass --device-flops
  to plan with a measured one;
* pipeline link: --p2p-bandwidth-gbps / --p2p-latency-us; else, on GPU with PP > 1, timed
  between pipeline ranks 0 and 1 at start-up (measure_link); on CPU not modelled (as for the
  compute rate, so CPU plans do not depend on machine load).
The planning leader (global rank 0) is the only rank whose figures are used.

`--cost-model profile` plans with a profile of the run's own model, device, precision and TP
degree, made on first use and kept in a cache directory (`--cost-model-cache-dir`) under its
key; see `ensure_cost_profile`.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dynapipe_ext.costs.cost_profile import (RECOMPUTE_MODES, CostProfile, LayerTable, auto_grid,
                                       cached_profile, default_cache_dir, fill_rows_by_scaling,
                                       profile_file_name, profile_key, save_profile)
from dynapipe_ext.plan.iteration_planner import CostModelSource
from dynapipe_ext.schedule.simulator import CommModel
from megatron.base.distributed_setup import use_cuda

GIB = 2**30
CPU_NOMINAL_FLOPS = 5e10          # a few cores running fp32 matmuls
# AnalyticCostModel's half_rate_tokens (a micro-batch of that many tokens runs at half the
# peak rate) on CPU, fitted to packed token streams of 128-8,192 FLAN-like tokens through the
# whole GPT 4-layer / T5 2+2-layer model at hidden 256, one thread (`tools/check_cost_model.py
# --streams`, docs/cost_model_streams_{gpt,t5}.json): with 16, the error after one scale factor
# is at most 7% (GPT) and 6% (T5) on the 512-8,192-token streams planners choose between. The
# earlier 64, fitted to one layer on 64-512-token rows, priced 8,192-token streams 11-13% below
# 512-token ones against what they take (up to 18% off), so the planners cut too few, too
# large micro-batches. The model's default (512) is a GPU's, whose kernels need far larger
# micro-batches.
CPU_HALF_RATE_TOKENS = 16.0
# AnalyticCostModel's cache_tokens on CPU: a micro-batch of T tokens runs its flops 1 + T /
# 65,536 slower (its activations outgrow the caches), fitted to the same streams. Without it,
# 512-token streams ran 1-5% faster and 8,192-token ones 5-7% slower than priced (GPT, against
# the 2,048-token ones), so the planners took large micro-batches for as cheap per token as
# small ones; with it the shape error on the 512-8,192-token streams is at most 7% for both
# models, median 2-4% (docs/BENCHMARKS.md, "Cost model on packed token streams"). A GPU has no
# such term: larger micro-batches only fill it better.
CPU_CACHE_TOKENS = 65536.0
# AnalyticCostModel's host floor per transformer layer on a GPU (forward, backward ms): what
# launching megatron-core's layer costs the host whatever the micro-batch's size. The H100
# profile (docs/h100_profile_gpt_l16_h2048.json) times a layer at 1.6-2.2 ms forward and
# 1.8-2.4 ms backward up to about 1,000 tokens; the device's own time passes the floor only
# beyond a few thousand tokens per micro-batch. Without it the analytic model cut 15-22
# micro-batches per iteration on the H100, each host-bound.
GPU_HOST_MS_PER_LAYER = (1.9, 1.8)
GPU_BASE_HEADROOM = 1 * GIB       # CUDA context, NCCL buffers, cuBLAS workspaces
HEADROOM_FRACTION = 0.10          # allocator fragmentation and transient spikes
# first-use profiling: shapes up to this many tokens are measured (more rows are scaled),
# two timed runs each (their minimum: steadier on a shared machine)
PROFILE_MAX_TOKENS = {"cpu": 4096, "cuda": 16384}
PROFILE_REPEATS = 2
PROFILE_WAIT_S = 1800.0           # ranks wait this long at most for the profiling ranks


@dataclass(frozen=True)
class DeviceFigures:
    """What the planner assumes of one rank's device; `sources` says where each came from."""

    kind: str                  # "cuda" or "cpu"
    memory_bytes: float
    headroom_bytes: float
    flops: float
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.headroom_bytes

    def describe(self) -> str:
        src = dict(self.sources)
        return (f"{self.kind}: {self.memory_bytes / GIB:.1f} GiB ({src.get('memory', '?')}), "
                f"headroom {self.headroom_bytes / GIB:.1f} GiB, "
                f"{self.flops / 1e12:.3g} TFLOP/s ({src.get('flops', '?')})")


def state_bytes_per_param(bf16: bool, optimizer_shards: int = 1) -> float:
    """Model-state bytes per parameter of one rank in the optimizer and precision layout we
    train with (megatron/training/optimizer.py): bf16 weights 2 + fp32 main gradients 4 +
    fp32 master weights 4 + Adam moments 8 = 18; fp32 runs: weights 4 + gradients 4 + Adam
    8 = 16 (the master weight is the parameter). Data parallelism adds none: it reduces the
    main-gradient buffer in place, bucket by bucket (grad_buffer.py). With
    --use-distributed-optimizer the master weights and moments are split into
    `optimizer_shards` (the DP size) equal parts (sharded_optimizer.py; bucket padding, under
    DP elements per bucket, is left out)."""
    weights, optimizer = (2, 4 + 8) if bf16 else (4, 8)
    return float(weights + 4 + optimizer / optimizer_shards)


def optimizer_shards(cfg, dp: int) -> int:
    """Into how many parts the run splits its optimizer state: DP with
    --use-distributed-optimizer, else 1."""
    return dp if cfg.use_distributed_optimizer else 1


def local_ranks() -> int:
    """Training processes on this node (torchrun's LOCAL_WORLD_SIZE, else 1)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def probe_memory_bytes(kind: str) -> float:
    """Memory of this rank's device: the GPU's total, or this node's physical memory shared
    by its ranks."""
    if kind == "cuda":
        import torch
        return float(torch.cuda.get_device_properties(
            int(os.environ.get("LOCAL_RANK", "0"))).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / local_ranks()


def default_headroom_bytes(kind: str, memory_bytes: float) -> float:
    return HEADROOM_FRACTION * memory_bytes + (GPU_BASE_HEADROOM if kind == "cuda" else 0.0)


@functools.lru_cache(maxsize=4)
def calibrate_flops(device: str, dtype_name: str, size: int = 4096,
                    seconds: float = 0.3) -> float:
    """Achieved matmul rate (FLOP/s) of `device` in `dtype_name`, timed for about `seconds`
    after a warm-up, rounded to two significant digits (once per process)."""
    import torch
    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.matmul(a, b)
    sync()
    reps, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        reps += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    return two_digits(2.0 * size**3 * reps / elapsed)


def device_figures(cfg) -> DeviceFigures:
    """This rank's figures: flags first, the device otherwise (see the module docstring)."""
    kind = "cuda" if use_cuda() else "cpu"
    sources = {}
    if cfg.device_memory_gb is not None:
        memory, sources["memory"] = cfg.device_memory_gb * GIB, "--device-memory-gb"
    else:
        memory = probe_memory_bytes(kind)
        sources["memory"] = ("device properties" if kind == "cuda"
                             else f"physical memory / {local_ranks()} local rank(s)")
    if cfg.memory_headroom_gb is not None:
        headroom, sources["headroom"] = cfg.memory_headroom_gb * GIB, "--memory-headroom-gb"
    else:
        headroom, sources["headroom"] = default_headroom_bytes(kind, memory), "default"
    if cfg.device_flops is not None:
        flops, sources["flops"] = cfg.device_flops, "--device-flops"
    elif kind == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        flops = calibrate_flops(device, "bfloat16" if cfg.bf16 else "float32")
        sources["flops"] = "matmul calibration"
    else:
        flops, sources["flops"] = CPU_NOMINAL_FLOPS, "CPU nominal"
    if headroom >= memory:
        raise ValueError(f"--memory-headroom-gb {headroom / GIB:.3g} leaves nothing of the "
                         f"device's {memory / GIB:.3g} GiB")
    return DeviceFigures(kind, float(memory), float(headroom), float(flops),
                         tuple(sorted(sources.items())))


def comm_model(cfg) -> CommModel | None:
    """Pipeline transfer time from --p2p-bandwidth-gbps (GB/s) and --p2p-latency-us; None
    (transfers cost nothing in the schedule search, or measure_link times them at start-up
    on GPU) unless the bandwidth is given."""
    if cfg.p2p_bandwidth_gbps is None:
        return None
    return CommModel(latency_ms=(cfg.p2p_latency_us or 0.0) / 1e3,
                     bandwidth_bytes_per_ms=cfg.p2p_bandwidth_gbps * 1e9 / 1e3)


def two_digits(value: float) -> float:
    """`value` rounded to two significant digits (calibrations vary by a few percent)."""
    return float(round(value, 1 - int(math.floor(math.log10(value))))) if value > 0 else 0.0


def measure_link(groups: tuple, device, rounds: int = 10,
                 large_bytes: int = 8 * 2**20) -> CommModel | None:
    """Pipeline link between pipeline ranks 0 and 1 of this rank's pipeline, timed with the
    transfer groups (0 -> 1 on the upwards group, replies on the downwards one): latency =
    half the round trip of a one-element message, bandwidth from one-way `large_bytes`
    transfers. Every rank of the pipeline calls it; pipeline rank 0 (where the planning
    leader sits) gets the CommModel, the others None. Rounded to two significant digits."""
    import torch
    import torch.distributed as dist
    up, down = groups
    me = dist.get_rank(up)
    if dist.get_world_size(up) < 2 or me > 1:
        return None
    peer_up, peer_down = dist.get_global_rank(up, 1), dist.get_global_rank(down, 0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tiny = torch.zeros(1, device=device)
    big = torch.zeros(large_bytes // 4, device=device)

    def round_trip(payload) -> float:
        sync()
        start = time.perf_counter()
        if me == 0:
            dist.send(payload, peer_up, group=up)
            dist.recv(tiny, peer_up, group=down)
        else:
            dist.recv(payload, peer_down, group=up)
            dist.send(tiny, peer_down, group=down)
        sync()
        return time.perf_counter() - start

    round_trip(tiny)                                    # warm
    latency_s = min(round_trip(tiny) for _ in range(rounds)) / 2
    transfer_s = min(round_trip(big) for _ in range(max(2, rounds // 3))) - 2 * latency_s
    if me != 0:
        return None
    return CommModel(latency_ms=two_digits(latency_s * 1e3),
                     bandwidth_bytes_per_ms=two_digits(large_bytes / max(transfer_s, 1e-9) / 1e3))


def dropout_options(cfg, kind: str) -> dict:
    """The analytic model's dropout terms: its masks when any dropout is on, and, for
    attention dropout on CPU, the unfused attention's s^2 activations (torch's fused CPU
    attention has no dropout; on GPU the fused kernels draw it in place)."""
    attention = cfg.attention_dropout > 0
    return {"dropout": cfg.hidden_dropout > 0 or attention,
            "fused_attention": not (attention and kind == "cpu")}


def analytic_device_options(kind: str) -> dict:
    """AnalyticCostModel settings that depend on the device kind alone ('cpu' / 'cuda')."""
    if kind == "cpu":
        return {"half_rate_tokens": CPU_HALF_RATE_TOKENS, "cache_tokens": CPU_CACHE_TOKENS}
    return {"host_fwd_ms_per_layer": GPU_HOST_MS_PER_LAYER[0],
            "host_bwd_ms_per_layer": GPU_HOST_MS_PER_LAYER[1]}


def cost_model_source(cfg, dp: int, figures: DeviceFigures | None = None,
                      spec=None) -> CostModelSource:
    """The planner's cost model for this run: analytic (FLOPs and activation bytes at the
    run's precision), the profile at --cost-model PATH, or with `--cost-model profile` this
    run's cached profile (needs the ModelSpec `spec`; ensure_cost_profile makes it), each with
    the device's usable memory and the model-state bytes of our optimizer layout."""
    figures = figures or device_figures(cfg)
    states = state_bytes_per_param(cfg.bf16, optimizer_shards(cfg, dp))
    share = slot_share(cfg)
    slots = {"tp_slot_share": share} if share != 1 else {}    # FlexTP's slot capacity
    if cfg.cost_model == "profile" and spec is None:
        raise ValueError("--cost-model profile: the cost model source needs the model spec")
    if cfg.cost_model == "analytic":
        return CostModelSource.analytic(
            device_flops=figures.flops, device_mem_bytes=figures.usable_bytes,
            bytes_per_param_state=states, dtype_bytes=2 if cfg.bf16 else 4,
            max_seq_len=cfg.seq_length, max_dec_seq_len=cfg.decoder_seq_length or None,
            full_recompute="stage",   # run_stage_forward: one checkpoint per stage, any device
            sigmoid_gelu=figures.kind == "cpu" and not cfg.bf16,   # stages.gelu_tanh's path
            **slots, **dropout_options(cfg, figures.kind), **analytic_device_options(figures.kind))
    path = profile_cache_path(cfg, spec) if cfg.cost_model == "profile" else cfg.cost_model
    # shapes shorter than the grid are bounded by its first point, more rows scaled (the
    # trainer must be able to plan any sample)
    return CostModelSource.profile(str(path), device_memory_bytes=figures.usable_bytes,
                                   bytes_per_param_state=states, below_grid="bound",
                                   rows_above_grid="scale", **slots)


def slot_share(cfg) -> float:
    """The share of the even TP split of a transformer layer's weights and their states one
    rank holds: --tp-balance-max-share with FlexTP (its slot layers, stage_layers.capacity,
    allocate at most that), else 1."""
    return cfg.tp_balance_max_share if cfg.tp_balance != "off" else 1.0


# ---------------------------------------------------------------------------- --cost-model profile

class CostProfileError(RuntimeError):
    """First-use profiling failed; raised on every rank alike."""


def run_device():
    """The device this rank computes on (as setup_model_parallel picks it), known before
    set-up."""
    import torch
    return (torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}") if use_cuda()
            else torch.device("cpu"))


def run_profile_key(cfg, spec) -> dict:
    """What this run's profile must have been made for: model, TP, device and precision."""
    from megatron.planning.profile_layers import device_name
    return profile_key(spec, cfg.tensor_model_parallel_size, device_name(run_device()),
                       "bfloat16" if cfg.bf16 else "float32")


def profile_cache_path(cfg, spec) -> Path:
    """This run's profile file in the cache directory (--cost-model-cache-dir)."""
    directory = Path(cfg.cost_model_cache_dir) if cfg.cost_model_cache_dir else \
        default_cache_dir()
    return directory / profile_file_name(run_profile_key(cfg, spec))


def build_cost_profile(cfg, spec, device, progress: bool = False) -> CostProfile:
    """Profile the run's own layers on `device` over auto_grid (every recompute mode), with a
    progress bar when `progress`. Every rank of the tensor-parallel group calls it alike. The
    global RNG state is left as it was, so a run that profiles trains like one that does not."""
    import torch
    from tqdm import tqdm

    from megatron.planning.profile_layers import grid_points, profile_meta, profile_model
    from megatron.model.stages import build_transformer_config
    dtype_name = "bfloat16" if cfg.bf16 else "float32"
    longest = max(cfg.seq_length, cfg.decoder_seq_length)
    tokens = min(cfg.tokens_per_global_batch, PROFILE_MAX_TOKENS[device.type])
    grid = auto_grid(cfg.seq_length, cfg.decoder_seq_length, max(longest, tokens))
    config = build_transformer_config(spec, cfg.tensor_model_parallel_size, 1, dtype_name,
                                      fused=device.type == "cuda")
    total = len(grid_points(spec, RECOMPUTE_MODES, grid.axis_points, grid.measured))
    bar = tqdm(total=total, desc="profiling the cost model", unit="shape", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        tables, counts, nbytes = profile_model(
            spec, config, RECOMPUTE_MODES, grid.axis_points, PROFILE_REPEATS,
            getattr(torch, dtype_name), device, seed=cfg.seed, measured=grid.measured,
            statistic="min", on_point=lambda point, m, seconds: bar.update())
    bar.close()
    tables = {kind: {mode: LayerTable(t.axes, t.points, fill_rows_by_scaling(t.values,
                                                                             t.points[0]))
                     for mode, t in modes.items()} for kind, modes in tables.items()}
    meta = profile_meta(device, PROFILE_REPEATS, time.perf_counter() - start,
                        statistic="min", made_by="--cost-model profile",
                        cpu_seconds=round(time.process_time() - cpu_start, 1),
                        grid=dataclasses.asdict(grid), measured_points=total)
    return CostProfile(run_profile_key(cfg, spec), counts, nbytes, tables, meta)


def ensure_cost_profile(cfg, spec, rank: int, device, say=print) -> Path:
    """Make sure the planning leader (global rank 0, the only rank that reads a cost model)
    finds this run's profile in the cache, profiling it on first use. Every rank calls it at
    the same point of set-up, after setup_model_parallel. Rank 0 looks in the cache (a file
    it cannot read, made for another key or too short for this run's lengths is profiled
    again, with a message); on a miss the ranks of rank 0's tensor-parallel group profile
    together (TP collectives) and rank 0 writes the file atomically. The other ranks wait on a
    gloo group whose timeout is PROFILE_WAIT_S (or the distributed timeout if longer), so a
    dead profiling rank is an error on every rank, never a hang."""
    import torch
    import torch.distributed as dist
    path = profile_cache_path(cfg, spec)
    need = False
    if rank == 0:
        key = run_profile_key(cfg, spec)
        path, profile, problem = cached_profile(path.parent, key, cfg.seq_length,
                                                cfg.decoder_seq_length)
        if profile is not None:
            say(f"[train] cost model: reusing the profile {path} (made "
                f"{profile.meta.get('created', '?')} in {profile.meta.get('seconds', '?')} s)")
        else:
            say(f"[train] cost model: {problem + '; ' if problem else ''}profiling "
                f"{spec.model.upper()} on {key['device']} ({key['dtype']}, TP="
                f"{key['tensor_model_parallel_size']}) once; it will be cached as {path}")
        need = profile is None
    world = dist.get_world_size() if dist.is_initialized() else 1
    group = None
    if world > 1:
        wait_s = max(PROFILE_WAIT_S, cfg.distributed_timeout_minutes * 60)
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_s))
        flag = torch.tensor([int(need)])
        dist.broadcast(flag, 0, group=group)
        need = bool(flag.item())
    error = None
    if need and profiles_here(world):
        try:
            profile = build_cost_profile(cfg, spec, device, progress=rank == 0)
            if rank == 0:
                save_profile(path, profile)
                say(f"[train] cost model: profiled in {profile.meta['seconds']} s, wrote {path}")
        except Exception as err:  # noqa: BLE001 -- every rank reports the same error below
            error = f"rank {rank}: {type(err).__name__}: {err}"
    if group is not None:
        if need:
            failed = torch.tensor([int(error is not None)])
            dist.all_reduce(failed, group=group)
            if failed.item():
                errors: list = [None] * world
                dist.all_gather_object(errors, error, group=group)
                error = "; ".join(e for e in errors if e)
        dist.destroy_process_group(group)
    if error:
        raise CostProfileError(f"--cost-model profile: profiling the cost model failed "
                               f"({error})")
    return path


def profiles_here(world: int) -> bool:
    """Whether this rank profiles: it is in global rank 0's tensor-parallel group."""
    if world == 1:
        return True
    import torch.distributed as dist
    from megatron.core import parallel_state
    return 0 in dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
