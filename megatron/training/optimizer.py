"""AdamW with warm-up/decay and global-norm gradient clipping done in our code, so it works on
CPU (megatron's clipping and distributed optimizer hard-code CUDA). Gradients are the fp32
`main_grad`s of grad_buffer.GradBuffer; model parameters may be bf16, the optimizer then keeps
fp32 main copies and steps those. Norm, clipping, AdamW and the write-back run as foreach / fused
kernels, with no per-parameter Python loop."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.model.full_state import local_part, shaped_like, shard_of, shard_view
from megatron.training.arguments import LR_WSD_DECAY_STYLES as WSD_DECAY_STYLES
from megatron.training.grad_buffer import GradBuffer


def learning_rate(iteration: int, lr: float, min_lr: float, warmup_iters: int,
                  decay_iters: int, decay_style: str, wsd_decay_iters: int = 0,
                  wsd_decay_style: str = "exponential") -> float:
    """LR for step `iteration` (0-based): linear warm-up to `lr`, then decay to `min_lr`
    (Megatron's styles; inverse-square-root falls as lr * sqrt(warm-up / steps done), never
    below min_lr and without an end; WSD holds `lr` until the last `wsd_decay_iters` steps
    before `decay_iters` and anneals to `min_lr` over those with `wsd_decay_style`, as
    megatron-core's OptimizerParamScheduler does)."""
    if warmup_iters and iteration < warmup_iters:
        return lr * (iteration + 1) / warmup_iters
    if decay_style == "inverse-square-root":
        return max(min_lr, lr * math.sqrt(max(warmup_iters, 1) / (iteration + 1)))
    if decay_style == "constant" or decay_iters <= warmup_iters:
        return lr
    if decay_style == "WSD":
        return min_lr + (lr - min_lr) * wsd_coefficient(iteration, decay_iters, wsd_decay_iters,
                                                        wsd_decay_style)
    progress = min(1.0, (iteration - warmup_iters) / (decay_iters - warmup_iters))
    if decay_style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    if decay_style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr decay style {decay_style!r}")


def wsd_coefficient(iteration: int, decay_iters: int, wsd_decay_iters: int,
                    style: str) -> float:
    """Share of (lr - min_lr) left at `iteration` in WSD's annealing phase, the last
    `wsd_decay_iters` steps before `decay_iters` (1 before it starts, 0 at and after its end)."""
    if wsd_decay_iters < 1:
        raise ValueError(f"WSD needs wsd_decay_iters >= 1, got {wsd_decay_iters}")
    anneal_start = decay_iters - wsd_decay_iters
    if iteration <= anneal_start:
        return 1.0
    ratio = min(1.0, (iteration - anneal_start) / wsd_decay_iters)
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * ratio))
    if style == "exponential":
        return 2.0 * 0.5 ** ratio - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"unknown WSD decay style {style!r}, expected one of {WSD_DECAY_STYLES}")


# The flags that shape the LR schedule (TrainConfig field names); a checkpoint records them.
SCHEDULE_SETTINGS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style",
                     "lr_wsd_decay_iters", "lr_wsd_decay_style")
# what a checkpoint written before a setting existed implies for it (the behaviour then)
SCHEDULE_DEFAULTS = {"lr_wsd_decay_iters": 0, "lr_wsd_decay_style": "exponential"}
SCHEDULER_POLICIES = ("check", "override", "use-checkpoint")


def schedule_settings(cfg) -> dict:
    return {name: getattr(cfg, name) for name in SCHEDULE_SETTINGS}


def resolve_schedule(saved: dict, current: dict, policy: str, where: str) -> dict:
    """The schedule a resumed run follows, with Megatron's rule: settings are compared after
    defaults are resolved (so a changed --train-iters changes a defaulted --lr-decay-iters);
    a difference is an error unless `policy` is "override" (this run's flags win) or
    "use-checkpoint" (the checkpoint's settings win)."""
    if policy not in SCHEDULER_POLICIES:
        raise ValueError(f"unknown scheduler policy {policy!r}, expected one of "
                         f"{SCHEDULER_POLICIES}")
    saved = {**SCHEDULE_DEFAULTS, **saved}
    missing = [name for name in SCHEDULE_SETTINGS if name not in saved]
    if missing:
        raise ValueError(f"{where}: the checkpoint's LR schedule lacks {', '.join(missing)}")
    if policy == "override":
        return dict(current)
    if policy == "use-checkpoint":
        return {name: saved[name] for name in SCHEDULE_SETTINGS}
    diffs = [f"--{name.replace('_', '-')}: checkpoint {saved[name]!r}, now {current[name]!r}"
             for name in SCHEDULE_SETTINGS if saved[name] != current[name]]
    if diffs:
        why = (" (--lr-decay-iters defaults to --train-iters, so a longer run changes it too)"
               if saved["lr_decay_iters"] != current["lr_decay_iters"] else "")
        raise ValueError(
            f"{where}: the LR schedule differs from the checkpoint's: " + "; ".join(diffs) +
            f"{why}. Repeat the checkpoint's settings, or pass "
            f"--use-checkpoint-opt-param-scheduler (keep the checkpoint's schedule) or "
            f"--override-opt-param-scheduler (use this run's flags from here on)")
    return dict(current)


def counts_toward_norm(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """Count every parameter once over the model-parallel group: TP-replicated parameters
    (norms, row-parallel biases) only on TP rank 0, and the last stage's copy of tied word
    embeddings (megatron-core marks it `shared`) not at all."""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def total_grad_norm(grads, group=None, device=None) -> float:
    """L2 norm over `grads` (one foreach kernel), all-reduced as a sum of squares over `group`
    (or over each of a list of groups in turn); `device` places the zero of a rank without
    gradients. Squares are summed in fp64, so the norm does not depend on how the gradients
    are split into tensors, shards or ranks (--use-distributed-optimizer clips by the same
    factor as the whole-parameter optimizer)."""
    if grads:
        total = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64)).pow(2).sum()
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
    for each in (group if isinstance(group, (list, tuple)) else [group]):
        if each is not None and dist.is_initialized():
            dist.all_reduce(total, group=each)
    return float(total.sqrt())


def global_grad_norm(params, grads, tp_rank: int = 0, group=None) -> float:
    """L2 norm of the whole model's gradient: local squares summed, then all-reduced over the
    model-parallel (TP x PP) `group`. DP replicas hold equal, already reduced gradients."""
    return total_grad_norm([g for p, g in zip(params, grads)
                            if g is not None and counts_toward_norm(p, tp_rank)], group)


def clip_by_norm(grads, norm: float, max_norm: float) -> float:
    """Scale gradients in place so their global norm is at most `max_norm` (one foreach kernel,
    as torch.nn.utils.clip_grads_with_norm_, skipped when nothing is clipped); returns the
    factor."""
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return 1.0
    factor = max_norm / (norm + 1e-6)
    torch._foreach_mul_([g for g in grads if g is not None], factor)
    return factor


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Biases and norm weights (1-D) are not decayed, as in Megatron."""
    return param.ndim <= 1 or name.endswith(".bias")


class TrainOptimizer:
    """AdamW over one rank's parameters, with the LR schedule and clipping in `step`.

    Gradients come from each parameter's fp32 `main_grad` (grad_buffer.GradBuffer; one is built
    here over `named_params` when none is given). The optimizer steps fp32 main weights: for an
    fp32 parameter a tensor sharing its storage, for a bf16 one an fp32 copy that is written back
    to the model after each step. Every main weight's `.grad` is its parameter's `main_grad`, so
    clipping and AdamW run as foreach / fused kernels over the buffer without copies."""

    def __init__(self, named_params, cfg, tp_rank: int = 0, norm_group=None,
                 grad_buffer: GradBuffer | None = None):
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.norm_group = norm_group
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("the optimizer got no trainable parameters for this rank")
        self.names = [n for n, _ in named]     # global names: the checkpoint's keys
        self.model_params = [p for _, p in named]
        self.grad_buffer = grad_buffer or GradBuffer({0: self.model_params})
        missing = [n for n, p in named if getattr(p, "main_grad", None) is None]
        if missing:
            raise ValueError(f"parameters without a main_grad in the gradient buffer: "
                             f"{missing[:5]}")
        self.main_params, grads, decayed = self._main_weights(named)
        for m, g in zip(self.main_params, grads):
            m.grad = g
        self._grads = grads
        self._norm_grads = [g for (_, p), g in zip(self._owners(named), grads)
                            if counts_toward_norm(p, tp_rank)]
        decay = [m for m, d in zip(self.main_params, decayed) if d]
        plain = [m for m, d in zip(self.main_params, decayed) if not d]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": plain, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        # a data-parallel rank may own nothing but bucket padding (sharded): no AdamW then
        self.adam = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                      eps=cfg.adam_eps,
                                      **adam_kernel(self.model_params[0].device)) \
            if groups else None
        self.schedule = schedule_settings(cfg)
        self.num_steps = 0      # the scheduler's position: optimizer steps taken so far

    def _main_weights(self, named):
        """(fp32 main weights, their gradients, whether each is weight-decayed): one per
        parameter, sharing its storage when it is fp32, else an fp32 copy; and the bf16
        parameters with their copies (`_half`) for the write-back after each step."""
        main = [(p.detach() if p.dtype == torch.float32
                 else p.detach().float().clone()).requires_grad_(True)
                for p in self.model_params]
        self._half = [(p, m) for p, m in zip(self.model_params, main)
                      if p.dtype != torch.float32]
        return main, [p.main_grad for p in self.model_params], \
            [not no_weight_decay(n, p) for n, p in named]

    def _owners(self, named):
        """The (name, parameter) each main weight belongs to, in order."""
        return named

    def lr_at(self, iteration: int) -> float:
        c = self.schedule
        return learning_rate(iteration, c["lr"], c["min_lr"], c["lr_warmup_iters"],
                             c["lr_decay_iters"], c["lr_decay_style"], c["lr_wsd_decay_iters"],
                             c["lr_wsd_decay_style"])

    def scheduler_state_dict(self) -> dict:
        """The LR schedule's settings and position, for the checkpoint."""
        return {"settings": dict(self.schedule), "num_steps": self.num_steps}

    def load_scheduler_state_dict(self, state: dict, policy: str = "check",
                                  where: str = "checkpoint") -> None:
        """Resume the schedule from `state` under `policy` (see `resolve_schedule`)."""
        self.schedule = resolve_schedule(state["settings"], schedule_settings(self.cfg),
                                         policy, where)
        self.num_steps = int(state["num_steps"])

    def step(self, iteration: int) -> dict:
        """Wait for the DP reduction, clip, set the LR of `iteration`, step, zero the main
        gradients. Returns grad norm and LR."""
        self.grad_buffer.finish()
        norm = total_grad_norm(self._norm_grads, self.norm_groups, self.grad_buffer.data.device)
        if not math.isfinite(norm):
            raise FloatingPointError(f"gradient norm is {norm} at iteration {iteration}")
        clip_by_norm(self._grads, norm, self.cfg.clip_grad)
        lr = self.lr_at(iteration)
        if self.adam is not None:
            for group in self.adam.param_groups:
                group["lr"] = lr
            self.adam.step()
        self.num_steps = iteration + 1
        self._copy_main_to_model()
        self.zero_grad()
        return {"grad_norm": norm, "lr": lr}

    @property
    def norm_groups(self) -> list:
        """The groups the squared gradient norm is summed over."""
        return [self.norm_group]

    def zero_grad(self):
        self.grad_buffer.zero()

    @torch.no_grad()
    def _copy_main_to_model(self):
        if self._half:
            torch._foreach_copy_([p for p, _ in self._half], [m for _, m in self._half])

    @torch.no_grad()
    def main_from_model(self) -> None:
        """Set the fp32 main copies of bf16 parameters from the model (after its weights were
        loaded from a checkpoint)."""
        for p, m in self._half:
            m.copy_(p.float())

    def sharded_state_dict(self, tp_rank: int, tp_size: int) -> dict[str, dict]:
        """Per parameter, by global name: Adam's moments as shards split like the parameter
        (full_state), its step count, and the fp32 main weight ("main") when the model is not
        fp32; layout-free, so a checkpoint reshards. Parameters without state yet are left out."""
        state = {}
        for name, p, m in zip(self.names, self.model_params, self.main_params):
            saved = self.adam.state.get(m)
            if not saved:
                continue
            entry = {k: shard_of(saved[k], p, tp_rank, tp_size) for k in ADAM_MOMENTS}
            entry["step"] = saved["step"].detach().cpu()
            if m.data_ptr() != p.data_ptr():
                entry["main"] = shard_of(m, p, tp_rank, tp_size)
            state[name] = entry
        return state

    def saved_state_found(self, shards: dict[str, list[dict]], where: str) -> bool:
        """Whether `shards` holds state for every parameter (False: for none, a checkpoint
        saved before any step). ValueError naming `where` when only some have state."""
        missing = [n for n in self.names if not shards.get(n)]
        if missing and len(missing) < len(self.names):
            raise ValueError(f"{where}: no optimizer state for {len(missing)} parameters "
                             f"({', '.join(missing[:5])}); pass --no-load-optim to start "
                             f"with a fresh optimizer")
        return not missing

    @torch.no_grad()
    def load_sharded_state_dict(self, shards: dict[str, list[dict]], tp_rank: int,
                                tp_size: int, where: str) -> None:
        """Restore the state of `sharded_state_dict`, saved at any TP: `shards[name]` lists the
        saved entries of parameter `name` (one per TP shard). Main weights come from "main"
        when saved (a bf16 run), else stay those of the model weights just loaded.
        ValueError naming `where` and the parameters that have no saved state."""
        if not self.saved_state_found(shards, where):
            return
        for name, p, m in zip(self.names, self.model_params, self.main_params):
            entries = shards[name]

            def part(key):
                return local_part(f"{name} ({key})", [e[key] for e in entries], p, tp_rank,
                                  tp_size).to(device=m.device, dtype=torch.float32)
            self.adam.state[m] = {k: shaped_like(part(k), p) for k in ADAM_MOMENTS}
            self.adam.state[m]["step"] = entries[0]["step"].clone().to(m.device)
            if all("main" in e for e in entries):
                shard_view(m, p).copy_(part("main"))
        self._copy_main_to_model()


ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def adam_kernel(device: torch.device) -> dict:
    """AdamW's implementation: the fused kernel where torch has one for the device (CUDA, CPU),
    else the foreach one; never the per-parameter Python loop."""
    if device.type in ("cuda", "cpu"):
        return {"fused": True}
    return {"foreach": True}
