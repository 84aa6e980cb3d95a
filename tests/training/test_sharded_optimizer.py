"""--use-distributed-optimizer (megatron/training/sharded_optimizer.py): the sharded optimizer
takes the same steps as the unsharded one, keeps 1 / DP of its state, and its checkpoints are
layout-free. The runs are the real trainer (build_run + train) over gloo; each launch trains
every case it is given with and without the flag and compares them."""
import math

import pytest
import torch

from megatron.training.arguments import parse_args
from tests.multiproc import free_port, run_in_processes
from tests.training.test_arguments import parse_or_exit_message
from tests.training.test_training import TINY_MODEL, sp_dataset  # noqa: F401 - the fixture

FP32_RTOL = 1e-6
BF16_LOSS_RTOL, BF16_WEIGHT_RTOL = 4e-3, 2e-2     # test_bf16's loss and whole-model bounds
STEPS = 5
BUCKET_CAP = 2 ** 12    # several buckets per stage: shards split parameters at bucket edges


def _train(argv):
    """Train `argv` to the end; returns (losses, grad norms, {global name: weight as fp32},
    this rank's optimizer state bytes, its gradient buckets). Tears the process groups down
    afterwards."""
    from megatron.base.distributed_setup import teardown_model_parallel
    from megatron.model.stages import stage_parameters
    from megatron.training.training import build_run, train
    run = build_run(parse_args("gpt", argv, has_cuda=False), verbose=False)
    history = train(run)
    weights = {n: p.detach().float().numpy().copy() for n, p in stage_parameters(run.stages)}
    next_port()
    teardown_model_parallel()
    return ([s.loss for s in history], [s.grad_norm for s in history], weights,
            optimizer_state_bytes(run.optimizer), len(run.optimizer.grad_buffer.buckets))


def next_port() -> None:
    """A fresh rendezvous port for the next world of these ranks (gloo does not meet again
    on the port of a destroyed one), chosen by rank 0 and shared while the world stands."""
    import os
    import torch.distributed as dist
    box = [free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    os.environ["MASTER_PORT"] = str(box[0])


def optimizer_state_bytes(optimizer) -> int:
    """fp32 bytes the optimizer keeps beside the weights and main gradients: the moments of
    every main weight and the main weights that are copies (not the fp32 parameters)."""
    total = 0
    for m in optimizer.main_params:
        state = optimizer.adam.state.get(m, {}) if optimizer.adam else {}
        total += sum(state[k].numel() * state[k].element_size()
                     for k in ("exp_avg", "exp_avg_sq") if k in state)
    total += sum(m.numel() * m.element_size() for _, m in optimizer._half)
    return total


def _compare_cases(rank, world_size, cases):
    """Each case (name, argv) with and without --use-distributed-optimizer: per case the
    two runs' losses, norms, weights and state bytes."""
    results = {}
    for name, argv in cases:
        plain = _train(argv)
        sharded = _train(argv + ["--use-distributed-optimizer", "--overlap-param-gather"])
        results[name] = (plain, sharded)
    return results


def _assert_equal_runs(results, rtol, weight_rtol=None):
    """Losses and norms within `rtol` relative; every weight within `weight_rtol` (default
    `rtol`) of its parameter's largest magnitude."""
    weight_rtol = rtol if weight_rtol is None else weight_rtol
    for name, ((losses, norms, weights, *_), (s_losses, s_norms, s_weights, *_)) in \
            results.items():
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), name
        assert s_losses == pytest.approx(losses, rel=rtol), name
        assert s_norms == pytest.approx(norms, rel=rtol), name
        assert weights.keys() == s_weights.keys()
        for key, w in weights.items():
            scale = float(abs(w).max()) or 1.0
            diff = float(abs(s_weights[key] - w).max())
            assert diff <= weight_rtol * scale, \
                f"{name}: {key} differs by {diff} (max |w| {scale})"


def _case_args(sp_dataset, *extra):  # noqa: F811
    """The tiny GPT without dropout and without linear biases: the key part of the QKV bias
    has a zero gradient up to rounding noise, which Adam scales up to steps of ~lr, so any
    other order of sums (another DP size, or clipping's norm summed per shard) moves those
    elements by ~1e-5 of the bias, with or without the flag (measured at DP=2 with clipping:
    6.6e-6 of the bias's largest entry, every other weight within 9e-7; without clipping
    both runs are equal bit for bit)."""
    return sp_dataset + TINY_MODEL + ["--train-iters", str(STEPS), "--seq-length", "128",
                                      "--hidden-dropout", "0", "--attention-dropout", "0",
                                      "--ddp-bucket-size", str(BUCKET_CAP),
                                      "--num-planner-workers", "0", "--disable-bias-linear",
                                      *extra]


@pytest.mark.slow
def test_sharded_steps_equal_unsharded_at_dp2(sp_dataset):  # noqa: F811
    """DP=2: fp32 dynamic micro-batches with clipping active (--clip-grad below the norms);
    bf16 with packing."""
    cases = [("dp2 fp32 clipped", _case_args(sp_dataset, "--micro-batching", "dynamic",
                                             "--clip-grad", "0.05")),
             ("dp2 bf16 packing", _case_args(sp_dataset, "--micro-batching", "packing",
                                             "--bf16"))]
    results = run_in_processes(_compare_cases, 2, (cases,), timeout_s=900)
    clipped = results[0]["dp2 fp32 clipped"][0][1]
    assert min(clipped) > 0.05         # every step was clipped
    _assert_equal_runs({k: v for k, v in results[0].items() if "fp32" in k}, FP32_RTOL)
    _assert_equal_runs({k: v for k, v in results[0].items() if "bf16" in k}, BF16_LOSS_RTOL,
                       BF16_WEIGHT_RTOL)


@pytest.mark.slow
def test_sharded_steps_equal_unsharded_on_four_ranks(sp_dataset):  # noqa: F811
    """DP=2 x PP=2 (interleaved layout, tied embeddings on both pipeline ends), DP=2 x TP=2
    (padding) and DP=4; at DP=4 each rank keeps a quarter of the state, within a bucket's
    rounding."""
    cases = [("dp2 pp2 interleaved", _case_args(sp_dataset, "--pipeline-model-parallel-size", "2",
                                                "--num-layers", "4",
                                                "--pipeline-schedule", "interleaved",
                                                "--micro-batching", "dynamic")),
             ("dp2 tp2", _case_args(sp_dataset, "--tensor-model-parallel-size", "2",
                                    "--micro-batching", "padding")),
             ("dp4", _case_args(sp_dataset, "--micro-batching", "dynamic"))]
    results = run_in_processes(_compare_cases, 4, (cases,), timeout_s=1500)
    for per_rank in results:
        _assert_equal_runs(per_rank, FP32_RTOL)
    unsharded = results[0]["dp4"][0][3]
    shares = [r["dp4"][1][3] for r in results]
    # a bucket is padded by < 4 elements, which some ranks own instead of a weight
    slack = results[0]["dp4"][1][4] * 3 * 2 * 4      # elements x 2 moments x 4 bytes
    assert sum(shares) == pytest.approx(unsharded, abs=slack)
    for share in shares:
        assert abs(share - unsharded / 4) <= slack, (share, unsharded)


def test_overlap_param_gather_needs_the_distributed_optimizer(capsys):
    message = parse_or_exit_message(capsys, "gpt", ["--overlap-param-gather"])
    assert "--overlap-param-gather needs --use-distributed-optimizer" in message


def test_flextp_refuses_the_distributed_optimizer_naming_why(capsys):
    message = parse_or_exit_message(capsys, "gpt", [
        "--tensor-model-parallel-size", "2", "--tp-balance", "migrate",
        "--use-distributed-optimizer"])
    assert ("--tp-balance migrate cannot run with --use-distributed-optimizer: moving TP "
            "rows") in message


def test_pieces_cover_each_bucket_once_per_rank():
    """The owned pieces of all data-parallel ranks tile every parameter exactly once (a
    one-rank world owns all of it; the layout of DP ranks is checked by the slow runs)."""
    from megatron.training.grad_buffer import GradBuffer
    from megatron.training.sharded_optimizer import owned_pieces
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 17, 3, 40)]
    params[1].replicated = "tied"      # a replicated parameter gets a bucket of its own
    values = [p.detach().clone() for p in params]
    buf = GradBuffer({0: params[:2], 1: params[2:]}, bucket_numel=16, shard=True)
    assert [[p.numel() for p in b.params] for b in buf.buckets] == [[40], [3], [17], [5]]
    pieces = owned_pieces(buf, params)
    covered = {i: 0 for i in range(len(params))}
    for piece in pieces:
        covered[piece.index] += piece.hi - piece.lo
    assert covered == {i: p.numel() for i, p in enumerate(params)}
    for p, value in zip(params, values):     # the weights now live in the parameter buffer
        offset = buf.offsets[id(p)]
        assert p.data_ptr() == buf.param_data[offset:].data_ptr()
        assert torch.equal(p.detach(), value)


@pytest.mark.slow
def test_checkpoint_of_a_sharded_run_resumes_at_other_dp_sizes(sp_dataset, tmp_path):  # noqa: F811
    """Saved at DP=2 with --use-distributed-optimizer after 3 of 6 iterations; resumed at DP=1
    without the flag and at DP=4 with it, the next losses are the uninterrupted run's."""
    from tests.training.test_training import torchrun
    args = _case_args(sp_dataset, "--micro-batching", "dynamic", "--train-iters", "6")
    ckpt = tmp_path / "ckpt"
    sharded = ["--use-distributed-optimizer", "--overlap-param-gather"]
    straight = torchrun("pretrain_gpt.py", args + sharded + ["--save", str(ckpt),
                                                              "--save-interval", "3"],
                        tmp_path / "straight.jsonl", nproc=2, timeout=600)
    losses = [s["loss"] for s in straight]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3\n")
    for nproc, flags in ((1, []), (4, sharded)):
        resumed = torchrun("pretrain_gpt.py", args + flags + ["--load", str(ckpt)],
                           tmp_path / f"dp{nproc}.jsonl", nproc=nproc, timeout=600)
        assert [s["iteration"] for s in resumed] == [4, 5, 6]
        assert [s["loss"] for s in resumed] == pytest.approx(losses[3:], rel=FP32_RTOL), nproc
