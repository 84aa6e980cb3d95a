"""Megatron's fp32 `main_grad`: one contiguous fp32 gradient buffer per rank, reduced over data
parallel in buckets while the last micro-batch's backward still runs.

Every trainable parameter gets `param.main_grad`, an fp32 view into the buffer. A
post-accumulate-grad hook adds each new `param.grad` (bf16 or fp32) into `main_grad` and frees
`param.grad`, so gradients accumulate over micro-batches in fp32 whatever the model dtype (fp32
runs use the same path: 0 + g1 + g2 ... in fp32 is exactly what `.grad` accumulation does).

Overlap: the plan says how many backwards each stage runs this iteration (`expect_backwards`);
the handlers call `before_backward` / `after_backward` around each. During a stage's last
backward a parameter's gradient is final once its hook fires; a bucket whose parameters are all
final is all-reduced asynchronously on the data-parallel group. Buckets never span two stages and
are launched in one fixed order (stages from last to first, parameters in reverse registration
order, i.e. roughly the order backward produces them), so every replica issues the same
collectives in the same order even if its autograd engine fires hooks in another order.
`finish` launches whatever is left and waits for all of it, then sums the gradients of each
replicated parameter's copies (parameters marked `replicated` with their global name by
stages.StageModule: the tied word embedding, T5's relative-bias tables): over the copies this rank
holds, then over that name's group (`tied_group`: stages.replica_groups), Megatron's
embedding-group all-reduce, so every copy takes the same optimizer step.

Sharded (`shard=True`, --use-distributed-optimizer; ZeRO stage 1, as Megatron's distributed
optimizer): each bucket is padded to a multiple of the data-parallel size and data-parallel rank r
owns the r-th equal slice of every bucket (`owned`). Buckets are reduce-scattered instead of
all-reduced, so only the owned slices hold the sum; the optimizer
(sharded_optimizer.ShardedOptimizer) keeps fp32 state for those alone. The parameters then live
in one contiguous buffer of the model's dtype laid out like the gradients (`param_data`), and
after the step every bucket's owned slice is all-gathered into it (`start_param_gather`). With
`overlap_param_gather` the gathers are left in flight, launched stage 0 first, and a stage's
first forward waits only for its own buckets (`before_forward`). Replicated parameters sit in
buckets of their own, so every copy's owned slice covers the same elements on every pipeline
rank of a data-parallel rank; `finish` sums the copies over those slices alone, in the order the
unsharded buffer sums them (data parallel first, then the copies).

Why not megatron.core.distributed.DistributedDataParallel: in megatron-core 0.16.1 its
_ParamAndGradBuffer allocates the grad buffer with `device=torch.cuda.current_device()`, so it
cannot run on CPU / gloo, where this project's tests run; it also wraps one module per model
chunk, where a rank here holds a dict of stage modules.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

MIN_BUCKET_NUMEL, MAX_BUCKET_NUMEL = 2 ** 18, 40_000_000


def default_bucket_numel(total_numel: int) -> int:
    """About 16 buckets per rank, so the reduction starts early in the last backward, but no
    bucket under 1 MiB of fp32 (per-collective overhead) nor over Megatron's 40M elements."""
    return min(MAX_BUCKET_NUMEL, max(MIN_BUCKET_NUMEL, total_numel // 16))


@dataclass
class Bucket:
    """A contiguous slice [start, end) of the buffer holding the gradients of `params`
    (all of one stage)."""

    stage: int
    start: int
    end: int
    params: list = field(default_factory=list)
    arrived: set = field(default_factory=set)     # ids of params whose final grad is in
    forced: bool = False                          # stage done: ready whatever arrived
    work: object = None               # the async all-reduce / reduce-scatter once launched
    gather: object = None             # sharded: the async all-gather of updated parameters

    @property
    def ready(self) -> bool:
        return self.forced or len(self.arrived) == len(self.params)


def is_replicated(param) -> bool:
    """A parameter with copies whose gradients are summed (stages.StageModule marks them)."""
    return getattr(param, "replicated", None) is not None


def backwards_per_stage(instructions: Iterable) -> dict[int, int]:
    """How many Backward instructions each stage has in one rank's plan."""
    from dynapipe_ext.plan.instructions import Backward
    return dict(Counter(i.stage for i in instructions if isinstance(i, Backward)))


class GradBuffer:
    """fp32 main gradients of one rank's parameters, with bucketed, overlapped DP reduction
    (see the module docstring). `stage_params`: stage index -> that stage's parameters."""

    def __init__(self, stage_params: Mapping[int, Sequence[torch.nn.Parameter]], dp_group=None,
                 bucket_numel: int | None = None, overlap: bool = True, tied_group=None,
                 shard: bool = False, overlap_param_gather: bool = False):
        order = [(s, p) for s in sorted(stage_params, reverse=True)
                 for p in reversed([p for p in stage_params[s] if p.requires_grad])]
        if not order:
            raise ValueError("the gradient buffer got no trainable parameters")
        total = sum(p.numel() for _, p in order)
        bucket_numel = default_bucket_numel(total) if bucket_numel is None else bucket_numel
        if bucket_numel <= 0:
            raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
        if len({id(p) for _, p in order}) != len(order):
            raise ValueError("a parameter is listed twice (in two stages or twice in one)")
        taken = [p for _, p in order if hasattr(p, "main_grad")]
        if taken:
            raise ValueError(f"{len(taken)} parameters already have a main_grad buffer (a "
                             "second optimizer or GradBuffer on the same model?)")
        self.dp_group = dp_group
        self.overlap = overlap
        self.shard = shard
        self.overlap_param_gather = overlap_param_gather
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        # copies of each replicated parameter; `tied_group` is {name: group} (a single group
        # is taken for every name: GPT's tied embedding alone)
        self.tied: dict[str, list] = {}
        for _, p in order:
            name = getattr(p, "replicated", None)
            if name is not None:
                self.tied.setdefault(name, []).append(p)
        self.tied_groups = (dict(tied_group) if isinstance(tied_group, dict) else
                            {name: tied_group for name in self.tied if tied_group is not None})
        for name, params in self.tied.items():
            spread = sorted({r for p in params for r in getattr(p, "tied_ranks", ())})
            if len(spread) > 1 and self.tied_groups.get(name) is None:
                what = ("the tied word embedding" if getattr(params[0], "tied_embedding", False)
                        else name)
                raise ValueError(f"{what} has copies on pipeline ranks {spread}; pass "
                                 "tied_group=stages.replica_groups(...) so their gradients "
                                 "are summed")
        self.buckets, self.offsets = self._lay_out(order, bucket_numel)
        size = self.buckets[-1].end
        device = order[0][1].device
        self.data = torch.zeros(size, dtype=torch.float32, device=device)
        self.param_data = self._param_buffer(order, size) if shard else None
        self._bucket_of: dict[int, Bucket] = {}
        for bucket in self.buckets:
            for param in bucket.params:
                offset = self.offsets[id(param)]
                param.main_grad = self.data[offset:offset + param.numel()].view_as(param)
                param.grad_buffer = self          # for accumulate_part
                self._bucket_of[id(param)] = bucket
                param.register_post_accumulate_grad_hook(self._accumulate)
        self._reset_iteration()
        self._reduced = False                # finish done and no gradient arrived since
        self.last_stats: dict = {}           # what the last `finish` returned

    def _lay_out(self, order, bucket_numel: int) -> tuple[list[Bucket], dict[int, int]]:
        """Buckets over `order` and each parameter's offset in the buffer. Sharded, a bucket
        ends padded to a multiple of the data-parallel size, and a replicated parameter gets
        a bucket of its own."""
        buckets: list[Bucket] = []
        offsets: dict[int, int] = {}
        offset = 0
        for stage, param in order:
            last = buckets[-1] if buckets else None
            alone = self.shard and (is_replicated(param) or
                                    (last is not None and is_replicated(last.params[0])))
            if last is None or last.stage != stage or last.end - last.start >= bucket_numel \
                    or alone:
                offset = self._padded(last)
                last = Bucket(stage, offset, offset)
                buckets.append(last)
            offsets[id(param)] = offset
            offset += param.numel()
            last.end = offset
            last.params.append(param)
        buckets[-1].end = self._padded(buckets[-1])
        for previous, bucket in zip(buckets, buckets[1:]):
            previous.end = bucket.start
        return buckets, offsets

    def _padded(self, bucket: Bucket | None) -> int:
        """Where the next bucket starts: `bucket`'s end, sharded rounded up to a multiple of
        the data-parallel size so that every rank owns an equal slice."""
        if bucket is None:
            return 0
        if not self.shard:
            return bucket.end
        length = bucket.end - bucket.start
        return bucket.start + -(-length // self.dp_size) * self.dp_size

    def _param_buffer(self, order, size: int) -> torch.Tensor:
        """Sharded: one buffer of the model's dtype holding every parameter, laid out like the
        gradients (the target of the all-gathers); each parameter becomes a view into it."""
        dtypes = {p.dtype for _, p in order}
        if len(dtypes) > 1:
            raise ValueError(f"the distributed optimizer needs one parameter dtype per rank, "
                             f"got {sorted(str(d) for d in dtypes)}")
        data = torch.zeros(size, dtype=order[0][1].dtype, device=order[0][1].device)
        for _, param in order:
            offset = self.offsets[id(param)]
            view = data[offset:offset + param.numel()].view_as(param)
            view.copy_(param.data)
            param.data = view
        return data

    def owned(self, bucket: Bucket) -> tuple[int, int]:
        """[lo, hi) in the buffer: this data-parallel rank's slice of `bucket` (sharded; all of
        it otherwise)."""
        if not self.shard:
            return bucket.start, bucket.end
        share = (bucket.end - bucket.start) // self.dp_size
        lo = bucket.start + self.dp_rank * share
        return lo, lo + share

    # ---- per iteration ----
    def _reset_iteration(self) -> None:
        self._remaining: dict[int, int] = {}
        self._final: set[int] = set()
        self._next = 0
        for bucket in self.buckets:
            bucket.arrived.clear()
            bucket.forced = False
            bucket.work = None

    def expect_backwards(self, counts: Mapping[int, int]) -> None:
        """This iteration runs `counts[s]` backwards of stage s on this rank (from the plan:
        backwards_per_stage). Without this call every bucket is reduced in `finish`."""
        self._remaining = {s: int(n) for s, n in counts.items() if n > 0}

    def before_backward(self, stage: int) -> None:
        """Called just before a Backward of `stage`: is it the stage's last this iteration?"""
        self._reduced = False
        if stage not in self._remaining:
            if stage in self._final:
                raise RuntimeError(f"stage {stage} runs more backwards than the plan's "
                                   "count; its gradients were already being reduced")
            return
        self._remaining[stage] -= 1
        if self._remaining[stage] == 0:
            del self._remaining[stage]
            self._final.add(stage)

    def after_backward(self, stage: int) -> None:
        """Called when a Backward of `stage` returned: after its last one, parameters that got
        no gradient are final too, so every bucket of the stage may go."""
        if stage in self._final:
            for bucket in self.buckets:
                if bucket.stage == stage:
                    bucket.forced = True
            self._launch_ready()

    def _accumulate(self, param: torch.Tensor) -> None:
        if param.grad is None:      # autograd got none: the layer used accumulate_part
            return
        param.main_grad.add_(param.grad)
        param.grad = None
        self._arrived(param)

    def accumulate_part(self, param: torch.Tensor, grad: torch.Tensor, axis: int,
                        rows: int | torch.Tensor) -> None:
        """For a layer that uses only part of `param` (FlexTP's slots): add `grad`, the
        gradient of `param`'s entries `rows` along `axis` (the first `rows` when an int, else
        an index tensor), into main_grad and count the gradient as arrived. That is what the
        post-accumulate hook does with a whole `.grad`, without the zero-padded full-size
        gradient autograd would build for a slice (and the full-size add), per micro-batch."""
        if isinstance(rows, int):
            param.main_grad.narrow(axis, 0, rows).add_(grad)
        else:
            param.main_grad.index_add_(axis, rows, grad.to(param.main_grad.dtype))
        self._arrived(param)

    def _arrived(self, param: torch.Tensor) -> None:
        self._reduced = False
        bucket = self._bucket_of[id(param)]
        if bucket.stage in self._final:
            bucket.arrived.add(id(param))
            if bucket.ready:
                self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch ready buckets in the fixed order, stopping at the first that is not ready."""
        if not self.overlap:
            return
        self._launch_until(lambda b: b.ready)

    def _launch_until(self, can_go) -> None:
        while self._next < len(self.buckets) and can_go(self.buckets[self._next]):
            bucket = self.buckets[self._next]
            if self.dp_size > 1:
                whole = self.data[bucket.start:bucket.end]
                if self.shard:
                    lo, hi = self.owned(bucket)
                    bucket.work = dist.reduce_scatter_single(
                        self.data[lo:hi], whole, group=self.dp_group, async_op=True)
                else:
                    bucket.work = dist.all_reduce(whole, group=self.dp_group, async_op=True)
            self._next += 1

    def finish(self) -> dict:
        """Reduce what is not yet reduced, wait for every bucket; main grads then hold the
        data-parallel sum (sharded: in the owned slices only). Returns
        {'launched_early': buckets launched before this call, 'buckets': all, 'wait_s':
        seconds spent here, 'called_at' / 'done_at': wall-clock times of the call and of the
        end}. A second call with no new gradient in between
        reduces nothing again (it would double the sum) and returns the same stats."""
        if self._reduced:
            return self.last_stats
        called_at, start = time.time(), time.perf_counter()
        early = self._next
        self._launch_until(lambda b: True)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
        self._sum_tied()
        self.last_stats = {"launched_early": early, "buckets": len(self.buckets),
                           "wait_s": time.perf_counter() - start, "called_at": called_at,
                           "done_at": time.time()}
        self._reset_iteration()
        self._reduced = True
        return self.last_stats

    def _sum_tied(self) -> None:
        """Every copy of a replicated parameter gets the sum of all its copies' gradients
        (names in sorted order: every rank of a group issues its all-reduces alike); sharded,
        over the owned slice alone, the same elements on every copy."""
        for name in sorted(self.tied):
            params, group = self.tied[name], self.tied_groups.get(name)
            if len(params) < 2 and group is None:
                continue
            grads = [self._reduced_part(param) for param in params]
            total = grads[0].clone()
            for grad in grads[1:]:
                total += grad
            if group is not None:
                dist.all_reduce(total, group=group)
            for grad in grads:
                grad.copy_(total)

    def _reduced_part(self, param) -> torch.Tensor:
        """The part of `param`'s main gradient that holds the data-parallel sum: all of it, or
        sharded its owned slice (flattened)."""
        if not self.shard:
            return param.main_grad
        lo, hi = self.owned(self._bucket_of[id(param)])
        offset = self.offsets[id(param)]
        return param.main_grad.view(-1)[max(0, lo - offset):max(0, min(hi - offset,
                                                                    param.numel()))]

    def zero(self) -> None:
        """Clear every main gradient for the next iteration (one fill of the buffer)."""
        self.data.zero_()

    # ---- sharded: the updated parameters back to every data-parallel rank ----
    def start_param_gather(self) -> None:
        """All-gather every bucket's owned slice of `param_data` (the optimizer has just
        written it), stage 0's buckets first: the order the next forwards need them. Without
        `overlap_param_gather` this waits for them all."""
        if self.dp_size > 1:
            for bucket in reversed(self.buckets):
                lo, hi = self.owned(bucket)
                bucket.gather = dist.all_gather_single(
                    self.param_data[bucket.start:bucket.end], self.param_data[lo:hi],
                    group=self.dp_group, async_op=True)
        if not self.overlap_param_gather:
            self.wait_param_gather()

    def wait_param_gather(self, stage: int | None = None) -> None:
        """Wait for the all-gathers of `stage`'s buckets (every bucket when None)."""
        for bucket in self.buckets:
            if bucket.gather is not None and stage in (None, bucket.stage):
                bucket.gather.wait()
                bucket.gather = None

    def before_forward(self, stage: int) -> None:
        """Called just before a Forward of `stage`: its parameters must be the updated ones."""
        if self.shard:
            self.wait_param_gather(stage)
