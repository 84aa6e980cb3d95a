"""`--profile`: torch.profiler over iterations [--profile-step-start, --profile-step-end) on the
ranks in --profile-ranks (Megatron's flags; its nsys mode is not offered: torch.profiler runs on
CPU and GPU alike). When the window closes, the profiled ranks print the ops that cost most
(self time on the device, then on the host) and, with --profile-dir, write a
Chrome trace `profile_rank<R>_iters<A>-<B>.json` there (open it in Perfetto or chrome://tracing)."""
from __future__ import annotations

import gc
import os

import torch

TOP_OPS = 25


class IterationProfiler:
    """Starts before iteration `start` and stops after iteration `end - 1` (0-based indices)."""

    def __init__(self, cfg, rank: int, device: torch.device):
        self.enabled = cfg.profile and rank in cfg.profile_ranks
        self.start, self.end = cfg.profile_step_start, cfg.profile_step_end
        self.rank, self.device, self.trace_dir = rank, device, cfg.profile_dir
        self.profiler = None

    def before(self, iteration: int) -> None:
        if self.enabled and iteration == self.start and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def after(self, iteration: int) -> None:
        if self.profiler is not None and iteration + 1 >= self.end:
            self.stop(iteration + 1)

    def stop(self, end: int) -> None:
        """Close the window (also when training ends inside it) and report."""
        if self.profiler is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        keys = ["self_cpu_time_total"]
        if self.device.type == "cuda":
            keys.insert(0, "self_device_time_total")
        averages = profiler.key_averages()
        for key in keys:
            print(f"[profile] rank {self.rank}, iterations {self.start + 1}..{end} (1-based), "
                  f"costliest ops by {key}:\n"
                  + averages.table(sort_by=key, row_limit=TOP_OPS), flush=True)
        if self.trace_dir:
            os.makedirs(self.trace_dir, exist_ok=True)
            path = os.path.join(self.trace_dir,
                                f"profile_rank{self.rank}_iters{self.start + 1}-{end}.json")
            profiler.export_chrome_trace(path)
            print(f"[profile] rank {self.rank}: Chrome trace in {path}", flush=True)
        # free the profiler's events now: left to the interpreter's exit, a CPU run with gloo
        # point-to-point transfers in the window died in that collection (heap corruption,
        # torch 2.13), after training had finished
        del profiler, averages
        gc.collect()
