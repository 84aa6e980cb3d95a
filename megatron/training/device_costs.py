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
"""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass

from dynapipe_ext.iteration_planner import CostModelSource
from dynapipe_ext.simulator import CommModel
from megatron.training.distributed_setup import use_cuda

GIB = 2**30
CPU_NOMINAL_FLOPS = 5e10          # a few cores running fp32 matmuls
GPU_BASE_HEADROOM = 1 * GIB       # CUDA context, NCCL buffers, cuBLAS workspaces
HEADROOM_FRACTION = 0.10          # allocator fragmentation and transient spikes


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


def state_bytes_per_param(bf16: bool) -> float:
    """Model-state bytes per parameter of the optimizer and precision layout we train with
    (megatron/training/optimizer.py): bf16 weights 2 + fp32 master weights 4 + fp32 main
    gradients 4 + Adam moments 8 = 18; fp32 runs: weights 4 + gradients 4 + Adam 8 = 16.
    Data parallelism adds none: it reduces the main-gradient buffer in place, bucket by bucket
    (grad_buffer.py)."""
    return float((2 + 4 + 4 + 8) if bf16 else (4 + 4 + 8))


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


def cost_model_source(cfg, dp: int, figures: DeviceFigures | None = None) -> CostModelSource:
    """The planner's cost model for this run: analytic (FLOPs and activation bytes at the
    run's precision) or the profile at --cost-model, either with the device's usable memory
    and the model-state bytes of our optimizer layout."""
    figures = figures or device_figures(cfg)
    states = state_bytes_per_param(cfg.bf16)
    if cfg.cost_model == "analytic":
        return CostModelSource.analytic(
            device_flops=figures.flops, device_mem_bytes=figures.usable_bytes,
            bytes_per_param_state=states, dtype_bytes=2 if cfg.bf16 else 4,
            max_seq_len=cfg.seq_length, max_dec_seq_len=cfg.decoder_seq_length or None,
            full_recompute="stage",   # run_stage_forward: one checkpoint per stage, any device
            **dropout_options(cfg, figures.kind))
    return CostModelSource.profile(cfg.cost_model, device_memory_bytes=figures.usable_bytes,
                                   bytes_per_param_state=states)
