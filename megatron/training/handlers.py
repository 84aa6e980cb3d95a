"""Instruction handlers: what each execution-plan instruction does on this rank's stage modules.

State is keyed by (mb, stage) as dynapipe_ext/plan/lowering.py describes:
* Micro-batch tensors: a background thread builds them in the order this rank needs them
  (`reset(..., order)`), only the keys its stages read (stages.batch_keys), pinned when the
  device is CUDA so that the copies to the device do not block the host.
* Forward(mb, s) takes its input from the micro-batch tensors (EMBEDDING stage), the activation
  received for (mb, s), or the local output of (mb, s-1) on this rank; it keeps inputs and
  outputs for the backward. On the HEAD stage the output is the micro-batch's share of the
  token-weighted loss: sum(token loss * loss_mask) / loss tokens of the whole global batch.
  The loss sum and loss tokens stay device tensors, read once per iteration (global_mean_loss):
  no device-to-host sync per micro-batch.
* Backward(mb, s) takes the output gradient from that loss (HEAD), the gradient received for
  (mb, s), or the local input gradient of (mb, s+1); it leaves the input gradient of (mb, s)
  for a SendGradStart or for the local Backward(mb, s-1).
* Send/Recv Start post torch.distributed isend/irecv with the shapes and dtype in the
  instruction, on one pipeline group per direction of traffic (distributed_setup.
  pipeline_p2p_groups); Finish is a plain `wait()`: the process group's own timeout and
  watchdog catch a dead peer (a timed wait would block the host on NCCL), and the failure
  becomes a TransferError naming the peer. A send's tensors are released as
  soon as its Finish returns; a receive buffer is released by FreeBuffer.
Forward-only plans (evaluation, `reset(..., forward_only=True)`): every Forward runs under
torch.no_grad and keeps nothing for a backward (an output lives until it is sent or the next
local stage takes it); the HEAD stage keeps each micro-batch's masked per-token losses in
`token_losses[mb]` (with the mask) for per-sample and per-task sums
(megatron/training/evaluation.py).
Parameter gradients accumulate in fp32 `main_grad`s (grad_buffer.GradBuffer) over micro-batches;
Backward tells the buffer when a stage's last backward runs, so buckets are summed over the
data-parallel group while it runs; all_reduce_data_parallel_grads waits for the rest, giving the
gradient of the global token mean.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dynapipe_ext.plan.instructions import (
    Backward,
    Forward,
    FreeBuffer,
    LoadInput,
    RecvActivationFinish,
    RecvActivationStart,
    RecvGradFinish,
    RecvGradStart,
    SendActivationFinish,
    SendActivationStart,
    SendGradFinish,
    SendGradStart,
)
from megatron.model.batch_tensors import batch_to
from megatron.model.stages import DTYPES, StageModule, batch_keys, run_stage_forward

BatchProvider = Callable[[int], Mapping[str, torch.Tensor]]


def micro_batch_order(plan) -> list[int]:
    """The micro-batches of a rank's plan in the order it first needs their tensors."""
    order: dict[int, None] = {}
    for instr in plan.instructions:
        if isinstance(instr, (LoadInput, Forward)):
            order.setdefault(instr.mb, None)
    return list(order)


class PlanMismatchError(RuntimeError):
    """An instruction does not fit this rank's state (wrong stage, shape, missing input)."""


class TransferError(RuntimeError):
    """A point-to-point transfer failed or timed out (e.g. the peer rank died)."""


class PipelineRuntime:
    """Per-rank state of the handlers across one iteration (reset() between iterations)."""

    def __init__(self, rank_stages: Mapping[int, StageModule], batch_provider: BatchProvider,
                 pp_group=None, global_loss_tokens: int = 1, device: torch.device | None = None,
                 timeout_s: float | None = None, grad_buffer=None):
        self.stages = dict(rank_stages)
        self.batch_keys = batch_keys(self.stages)
        self.grad_buffer = grad_buffer     # GradBuffer told of each backward, or None
        # (towards higher pipeline ranks, towards lower ones); one group serves both if given
        self.p2p_groups = pp_group if isinstance(pp_group, tuple) else (pp_group, pp_group)
        self.pp_rank = dist.get_rank(self.p2p_groups[0]) if pp_group is not None else 0
        self.device = torch.device(device or "cpu")
        self.timeout_s = timeout_s      # the process groups' timeout, for error messages only
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="micro-batch-tensors")
        self.prefetched: dict[int, Future] = {}
        self.reset(batch_provider, global_loss_tokens)

    def reset(self, batch_provider: BatchProvider, global_loss_tokens: int,
              order: Sequence[int] = (), forward_only: bool = False) -> None:
        """Start a new iteration: forget all state, set the data and the loss denominator, and
        start building the tensors of micro-batches `order` (micro_batch_order of the plan).
        `forward_only`: the plan is an evaluation plan (see the module docstring)."""
        if global_loss_tokens <= 0:
            raise ValueError(f"the global batch has {global_loss_tokens} loss tokens; "
                             "the token-weighted loss needs at least one")
        for future in self.prefetched.values():
            future.cancel()
        self.batch_provider = batch_provider
        self.global_loss_tokens = int(global_loss_tokens)
        self.batches: dict[int, Mapping[str, torch.Tensor]] = {}
        self.prefetched = {mb: self._builder.submit(self._host_batch, mb, batch_provider)
                           for mb in order}
        self.inputs: dict[tuple[int, int], tuple] = {}
        self.outputs: dict[tuple[int, int], tuple] = {}
        self.input_grads: dict[tuple[int, int], tuple] = {}
        self.received_activations: dict[tuple[int, int], tuple] = {}
        self.received_grads: dict[tuple[int, int], tuple] = {}
        self.pending: dict[int, tuple] = {}          # buffer -> (instr, works, tensors)
        self.live_buffers: set[int] = set()
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.loss_tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self.micro_batches_done = 0
        self.batch_wait_s = 0.0      # time Forward waited for its tensors (step_timing)
        self.forward_only = forward_only
        self.token_losses: dict[int, tuple] = {}   # forward-only HEAD: mb -> (loss*mask, mask)

    # ---- helpers ----
    def _fail(self, instr, why: str, error=PlanMismatchError):
        where = f"mb={instr.mb}" + (f", stage={instr.stage}" if hasattr(instr, "stage") else "")
        raise error(f"rank {self.rank}: {type(instr).__name__}({where}): {why}")

    def _stage(self, instr) -> StageModule:
        if instr.stage not in self.stages:
            self._fail(instr, f"this rank holds stages {sorted(self.stages)}, not {instr.stage}")
        return self.stages[instr.stage]

    def _host_batch(self, mb: int, provider: BatchProvider) -> dict:
        """Micro-batch mb's tensors on the host, only this rank's keys (pinned for CUDA)."""
        batch = provider(mb)
        missing = [k for k in self.batch_keys if k not in batch]
        if missing:
            raise KeyError(f"rank {self.rank}: micro-batch {mb} lacks {missing}")
        batch = {k: batch[k] for k in self.batch_keys}
        return batch_to(batch, "cpu", pin=True) if self.device.type == "cuda" else batch

    def _batch(self, mb: int) -> Mapping[str, torch.Tensor]:
        if mb not in self.batches:
            future = self.prefetched.pop(mb, None)
            host = future.result() if future is not None \
                else self._host_batch(mb, self.batch_provider)
            self.batches[mb] = {k: v.to(self.device, non_blocking=True)
                                for k, v in host.items()}
        return self.batches[mb]

    def _route(self, peer: int, send: bool):
        """(global rank of pipeline rank `peer`, the group of this transfer's direction)."""
        upwards = (self.pp_rank < peer) if send else (peer < self.pp_rank)
        group = self.p2p_groups[0 if upwards else 1]
        return (dist.get_global_rank(group, peer) if group is not None else peer), group

    def _wait(self, instr, works) -> None:
        for work in works:
            try:
                work.wait()
            except RuntimeError as err:
                limit = f" (process group timeout {self.timeout_s:.0f} s)" \
                    if self.timeout_s else ""
                self._fail(instr, f"transfer with pipeline rank {instr.peer} failed or timed "
                                  f"out{limit}: {err}", TransferError)

    # ---- handlers ----
    def load_input(self, instr: LoadInput) -> None:
        self._batch(instr.mb)

    def forward(self, instr: Forward) -> None:
        if self.forward_only:
            with torch.no_grad():
                self._forward(instr)
        else:
            self._forward(instr)

    def _forward(self, instr: Forward) -> None:
        key = (instr.mb, instr.stage)
        stage = self._stage(instr)
        if self.grad_buffer is not None:     # --overlap-param-gather: this stage's weights
            self.grad_buffer.before_forward(instr.stage)
        started = time.perf_counter()
        batch = self._batch(instr.mb)
        self.batch_wait_s += time.perf_counter() - started
        grad = not self.forward_only
        previous = (instr.mb, instr.stage - 1)
        if stage.has_embedding:
            inputs = ()
        elif key in self.received_activations:
            inputs = tuple(t.requires_grad_(grad) for t in self.received_activations.pop(key))
        elif previous in self.outputs and instr.stage - 1 in self.stages:
            local = self.outputs.pop(previous) if self.forward_only else self.outputs[previous]
            inputs = tuple(t.detach().requires_grad_(grad) for t in local)
        else:
            self._fail(instr, "no input: nothing received and no local output of stage "
                              f"{instr.stage - 1}")
        out = run_stage_forward(stage, inputs, batch, instr.recompute if grad else "none")
        if stage.has_head:
            mask = batch["loss_mask"]
            token_losses = out.float() * mask
            weighted = token_losses.sum()
            self.loss_sum += weighted.detach().double()
            self.loss_tokens += mask.sum().double()
            if self.forward_only:
                self.token_losses[instr.mb] = (token_losses, mask)
                return
            out = (weighted / self.global_loss_tokens,)
        if self.forward_only:
            self.outputs[key] = out     # until it is sent or the next local stage takes it
            return
        self.inputs[key], self.outputs[key] = inputs, out

    def backward(self, instr: Backward) -> None:
        key = (instr.mb, instr.stage)
        stage = self._stage(instr)
        if key not in self.outputs:
            self._fail(instr, "backward before its forward")
        outputs, inputs = self.outputs.pop(key), self.inputs.pop(key)
        if stage.has_head:
            grads = (None,)
        elif key in self.received_grads:
            grads = self.received_grads.pop(key)
        elif (instr.mb, instr.stage + 1) in self.input_grads and instr.stage + 1 in self.stages:
            grads = self.input_grads.pop((instr.mb, instr.stage + 1))
        else:
            self._fail(instr, f"no output gradient: nothing received and no local backward of "
                              f"stage {instr.stage + 1}")
        if self.grad_buffer is not None:
            self.grad_buffer.before_backward(instr.stage)
        torch.autograd.backward(outputs, grads)
        if self.grad_buffer is not None:
            self.grad_buffer.after_backward(instr.stage)
        if inputs:
            self.input_grads[key] = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs)
        if stage.has_head:
            self.micro_batches_done += 1

    def _post(self, instr, tensors, send: bool) -> None:
        if instr.buffer in self.live_buffers:
            self._fail(instr, f"buffer {instr.buffer} is still in use")
        shapes = tuple(tuple(t.shape) for t in tensors)
        if shapes != tuple(tuple(s) for s in instr.shapes):
            self._fail(instr, f"plan says shapes {instr.shapes}, tensors have {shapes}")
        op = dist.isend if send else dist.irecv
        peer, group = self._route(instr.peer, send)
        try:
            works = [op(t, peer, group=group) for t in tensors]
        except RuntimeError as err:     # gloo fails at once when the peer is already gone
            self._fail(instr, f"transfer with pipeline rank {instr.peer} could not start: {err}",
                       TransferError)
        self.live_buffers.add(instr.buffer)
        self.pending[instr.buffer] = (instr, works, tensors)

    def send_start(self, instr) -> None:
        key = (instr.mb, instr.stage)
        if isinstance(instr, SendActivationStart):
            if key not in self.outputs:
                self._fail(instr, "no forward output to send")
            tensors = self.outputs.pop(key) if self.forward_only else self.outputs[key]
        else:
            if key not in self.input_grads:
                self._fail(instr, "no input gradient to send")
            tensors = self.input_grads.pop(key)
        dtype = DTYPES[instr.dtype]
        tensors = tuple(t.detach().to(dtype).contiguous() for t in tensors)
        self._post(instr, tensors, send=True)

    def recv_start(self, instr) -> None:
        dtype = DTYPES[instr.dtype]
        tensors = tuple(torch.empty(shape, dtype=dtype, device=self.device)
                        for shape in instr.shapes)
        self._post(instr, tensors, send=False)

    def finish(self, instr) -> None:
        if instr.buffer not in self.pending:
            self._fail(instr, f"buffer {instr.buffer} has no transfer in flight")
        started, works, tensors = self.pending.pop(instr.buffer)
        if (started.mb, started.stage, started.peer) != (instr.mb, instr.stage, instr.peer):
            self._fail(instr, f"buffer {instr.buffer} holds the transfer of {started}")
        self._wait(instr, works)
        key = (instr.mb, instr.stage)
        if isinstance(instr, RecvActivationFinish):
            self.received_activations[key] = tensors
        elif isinstance(instr, RecvGradFinish):
            self.received_grads[key] = tensors
        # a finished send drops its tensors here: they are released right away

    def free_buffer(self, instr: FreeBuffer) -> None:
        if instr.buffer not in self.live_buffers:
            self._fail(instr, f"buffer {instr.buffer} is not live")
        if instr.buffer in self.pending:
            self._fail(instr, f"buffer {instr.buffer} is freed before its transfer finished")
        self.live_buffers.discard(instr.buffer)

    def handlers(self) -> dict[type, Callable]:
        """Instruction type -> handler, for dynapipe_ext.runtime.executor.Executor."""
        return {LoadInput: self.load_input, Forward: self.forward, Backward: self.backward,
                SendActivationStart: self.send_start, SendGradStart: self.send_start,
                RecvActivationStart: self.recv_start, RecvGradStart: self.recv_start,
                SendActivationFinish: self.finish, SendGradFinish: self.finish,
                RecvActivationFinish: self.finish, RecvGradFinish: self.finish,
                FreeBuffer: self.free_buffer}

    def check_drained(self) -> None:
        """After a plan: every forward had its backward and every transfer finished."""
        left = {"forward outputs": sorted(self.outputs), "transfers": sorted(self.pending),
                "received activations": sorted(self.received_activations),
                "received gradients": sorted(self.received_grads),
                "unused input gradients": sorted(self.input_grads)}
        left = {k: v for k, v in left.items() if v}
        if left:
            raise PlanMismatchError(f"rank {self.rank}: plan ended with unfinished work {left}")
        self.batches.clear()

    def close(self) -> None:
        """Stop the tensor-building thread (pending micro-batches are dropped)."""
        for future in self.prefetched.values():
            future.cancel()
        self._builder.shutdown(wait=False)


class HandlerTable(dict):
    """The handler dict, with the runtime (loss sum, loss tokens, reset) attached."""

    def __init__(self, runtime: PipelineRuntime):
        super().__init__(runtime.handlers())
        self.runtime = runtime


def make_handlers(rank_stages: Mapping[int, StageModule], batch_provider: BatchProvider,
                  pp_group=None, global_loss_tokens: int = 1,
                  device: torch.device | None = None,
                  timeout_s: float | None = None, grad_buffer=None) -> HandlerTable:
    """Handlers for every instruction type. `batch_provider(mb)` returns micro-batch mb's
    tensors (build_micro_batch; at least `table.runtime.batch_keys`, the keys this rank's
    stages read). `global_loss_tokens`: loss tokens of the whole global batch over all DP
    replicas. `timeout_s`: the process groups' timeout, named in transfer errors.
    Read results with global_mean_loss; call `table.runtime.reset(provider, tokens, order)`
    before the next iteration. `grad_buffer`: the rank's GradBuffer, to reduce gradients
    during each stage's last backward."""
    return HandlerTable(PipelineRuntime(rank_stages, batch_provider, pp_group,
                                        global_loss_tokens, device, timeout_s, grad_buffer))


# ---- reductions after the plan ----

def all_reduce_data_parallel_grads(grad_buffer) -> dict:
    """Finish summing the fp32 main gradients over the data-parallel group: buckets not yet
    launched during backward are launched, then all are waited for (GradBuffer.finish; no
    extra flat copy). Each replica's grads already carry the 1 / global-loss-tokens factor, so
    the sum is the global token-mean gradient. With sequence parallelism off (our setting),
    TP-replicated parameters (norms, biases of row-parallel layers, position embeddings) get
    identical gradients on every TP rank from megatron-core's own TP collectives, so no extra
    TP reduction is needed. Returns GradBuffer.finish's stats."""
    return grad_buffer.finish()


def global_mean_loss(runtime: PipelineRuntime) -> tuple[float, int]:
    """(token-weighted mean loss of the global batch, its loss tokens), the same on every rank:
    sums over the data-parallel group and the pipeline group (only HEAD ranks hold losses)."""
    loss, tokens, _ = global_step_totals(runtime, ())
    return loss, tokens


def global_step_totals(runtime: PipelineRuntime, replica_counts: Sequence[int]
                       ) -> tuple[float, int, tuple[int, ...]]:
    """global_mean_loss, and `replica_counts` (e.g. this replica's token slots and
    micro-batches) summed over the data-parallel replicas, in the same two reductions (the
    first pipeline rank adds each replica's counts once)."""
    counts = [float(c) for c in replica_counts]
    if parallel_state.get_pipeline_model_parallel_rank() != 0:
        counts = [0.0] * len(counts)
    stats = torch.cat([torch.stack([runtime.loss_sum, runtime.loss_tokens]),
                       torch.tensor(counts, dtype=torch.float64, device=runtime.device)])
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(stats, group=parallel_state.get_pipeline_model_parallel_group())
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(stats, group=parallel_state.get_data_parallel_group())
    values = stats.tolist()
    tokens = int(round(values[1]))
    return values[0] / max(tokens, 1), tokens, tuple(int(round(v)) for v in values[2:])
