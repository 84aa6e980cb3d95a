"""The GPU suite: `pytest -m gpu -s` on a machine with one or more NVIDIA GPUs. Every `gpu` test
skips cleanly without CUDA; the single-GPU ones except the FlexTP timer and half-layer timing
tests ran once on an H100
(docs/USAGE.md, "GPU"), the multi-GPU ones never. Figures are printed and
written to runs/gpu_suite/<name>.json for docs/BENCHMARKS.md.

* bf16 training step against the fp32 reference, on one GPU and as a pipeline over 2 (or 4);
* short GPT and T5 training runs planned with the device cost model: tokens/s, plan wait, and
  rank 0's peak memory predicted by the planner vs torch.cuda.max_memory_allocated;
* the NCCL pipeline warm-up, the device probe and the matmul calibration;
* the half-layer unit timing of `--pipeline-split balanced` (never run on a GPU yet).

Also here, run on CPU: the GPU launchers refuse in one line when no CUDA device is visible."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.multiproc import run_in_processes
from tests.training.test_device_costs import _warm_up_rank, expected_warm_up
from tests.multiproc import free_port
from tests.training.test_training import REPO, env_with_repo, sp_dataset  # noqa: F401

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="no CUDA device is visible")
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason="fewer than 2 CUDA devices are visible")
SEED = 17
BF16_LOSS_RTOL = 2e-2       # bf16 keeps 8 mantissa bits: ~0.4% per rounding
BF16_GRAD_RTOL = 5e-2       # per parameter: ||g_bf16 - g_fp32|| / ||g_fp32||
FLOPS = "1e14"              # fixed, so this test can re-plan exactly what the run planned


REQUIRED_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--train-iters", "1"]


def parse_args_sized(model, argv, **kwargs):
    """parse_args with the flags Megatron requires; the test's own argv overrides them."""
    from megatron.training.arguments import parse_args
    return parse_args(model, REQUIRED_FLAGS + list(argv), **kwargs)


def report(name: str, figures: dict) -> None:
    """Print the figures and keep them in runs/gpu_suite/<name>.json."""
    print(f"[gpu suite] {name}: {json.dumps(figures)}")
    os.makedirs(os.path.join(REPO, "runs", "gpu_suite"), exist_ok=True)
    with open(os.path.join(REPO, "runs", "gpu_suite", f"{name}.json"), "w") as f:
        json.dump(figures, f, indent=1)


# ---------------------------------------------------------------------------- launchers (CPU)

@pytest.mark.skipif(GPUS > 0, reason="checks the message shown when no GPU is visible")
@pytest.mark.parametrize("script", ["train_gpt_gpu.sh", "train_t5_gpu.sh"])
def test_gpu_launcher_without_cuda_says_so_in_one_line_and_fails(script):
    done = subprocess.run(["bash", os.path.join("examples", script)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{script}: no CUDA device is visible")


# ---------------------------------------------------------------------------- bf16 equivalence

def loss_and_grads(spec, samples, dtype: str, device) -> tuple[float, dict]:
    """The whole batch as one unsplit micro-batch through the uncut model in `dtype` on
    `device` (reference_model.py's reference, placed on a GPU)."""
    from megatron.model.batch_tensors import (build_micro_batch, count_loss_tokens,
                                              unsplit_micro_batch)
    from megatron.model.init_weights import initialize_stage_weights
    from megatron.model.stages import (build_rank_stages, build_transformer_config,
                                       stage_parameters)
    ids = sorted(samples)
    stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec, dtype=dtype))
    initialize_stage_weights(stages, SEED)
    stages = {s: m.to(device) for s, m in stages.items()}
    batch = {k: v.to(device) for k, v in build_micro_batch(
        unsplit_micro_batch(ids, samples, spec.model), samples, spec.model, 0).items()}
    token_losses = stages[0]((), batch)
    loss = (token_losses.float() * batch["loss_mask"]).sum() / count_loss_tokens(samples, ids)
    loss.backward()
    return loss.item(), {name: p.grad.detach().float().cpu().numpy()
                         for name, p in stage_parameters(stages)}


def grad_errors(reference: dict, got: dict) -> dict:
    """Per parameter ||got - reference|| / ||reference||."""
    assert sorted(got) == sorted(reference)
    return {name: float(np.linalg.norm(got[name] - ref) / max(np.linalg.norm(ref), 1e-30))
            for name, ref in reference.items()}


def check_bf16(name: str, reference, result) -> None:
    (ref_loss, ref_grads), (loss, grads) = reference, result
    errors = grad_errors(ref_grads, grads)
    worst = max(errors, key=errors.get)
    report(name, {"fp32_loss": ref_loss, "bf16_loss": loss,
                  "worst_grad_rel_error": errors[worst], "worst_param": worst})
    assert abs(loss - ref_loss) <= BF16_LOSS_RTOL * abs(ref_loss)
    assert errors[worst] <= BF16_GRAD_RTOL, (worst, errors[worst])


def one_gpu_worker(rank, world_size, model, dtype="bfloat16"):
    """(fp32 reference, one `dtype` step) of the whole batch on this process's device."""
    from tests.integration.test_equivalence import SPECS, global_batch

    from megatron.base.distributed_setup import setup_model_parallel
    layout = setup_model_parallel(1, 1, seed=SEED)
    return tuple(loss_and_grads(SPECS[model], global_batch(model), d, layout.device)
                 for d in ("float32", dtype))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_bf16_step_matches_the_fp32_reference_on_one_gpu(model):
    reference, result = run_in_processes(one_gpu_worker, 1, args=(model,), device="cuda",
                                         timeout_s=300)[0]
    check_bf16(f"bf16_vs_fp32_1gpu_{model}", reference, result)


def pipeline_gpu_worker(rank, world_size, model, dtype="bfloat16"):
    """fp32 reference (TP=PP=1 on this GPU), then one `dtype` step of the dynamic planner's
    micro-batches as a 1F1B pipeline over 2 GPUs with NCCL transfers."""
    from tests.integration.test_equivalence import SPECS, global_batch, plan_replica

    from dynapipe_ext.runtime.executor import Executor
    from dynapipe_ext.plan.lowering import lower
    from dynapipe_ext.schedule.schedules import one_f_one_b
    from megatron.model.batch_tensors import build_micro_batch, count_loss_tokens
    from megatron.model.init_weights import initialize_stage_weights
    from megatron.model.stages import build_rank_stages, build_transformer_config
    from megatron.base.distributed_setup import pipeline_p2p_groups, setup_model_parallel
    from megatron.training.handlers import global_mean_loss, make_handlers
    from tests.reference_model import gather_full_grads
    spec = SPECS[model]
    layout = setup_model_parallel(1, 1, seed=SEED)
    reference = loss_and_grads(spec, global_batch(model), "float32", layout.device)
    layout = setup_model_parallel(1, 2, seed=SEED)
    samples, mbs, _ = plan_replica(model, "dynamic", 2, 1, layout.dp, layout.dp_rank)
    schedule = one_f_one_b(len(mbs), 2)
    plan = lower(schedule, mbs, spec, dtype)[layout.pp_rank]
    stages = build_rank_stages(spec, schedule.stage_to_rank, layout.pp_rank,
                               build_transformer_config(spec, pp=2, dtype=dtype))
    initialize_stage_weights(stages, SEED)
    stages = {s: m.to(layout.device) for s, m in stages.items()}
    table = make_handlers(stages, lambda m: build_micro_batch(mbs[m], samples, model, 0),
                          pipeline_p2p_groups(), device=layout.device, timeout_s=120,
                          global_loss_tokens=count_loss_tokens(samples, list(samples)))
    Executor(table).run(plan)
    table.runtime.check_drained()
    loss, _ = global_mean_loss(table.runtime)
    grads = gather_full_grads(stages)
    return (reference, (loss, grads)) if rank == 0 else None


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_bf16_pipeline_over_two_gpus_matches_the_fp32_reference(model):
    reference, result = run_in_processes(pipeline_gpu_worker, 2, args=(model,),
                                         device="cuda", timeout_s=400)[0]
    check_bf16(f"bf16_vs_fp32_pp2_{model}", reference, result)


# ---------------------------------------------------------------------------- training runs

RUNS = {
    "gpt": ("pretrain_gpt.py", ["--num-layers", "8", "--hidden-size", "512",
                                "--num-attention-heads", "8", "--seq-length", "1024"]),
    "t5": ("pretrain_t5.py", ["--encoder-num-layers", "4", "--decoder-num-layers", "4",
                              "--hidden-size", "512", "--num-attention-heads", "8",
                              "--encoder-seq-length", "1024", "--decoder-seq-length", "256"]),
}


def predicted_rank0_peak(model: str, argv: list, world: int, iterations: int) -> float:
    """Model states of pipeline rank 0 plus the largest activation peak the chosen schedule's
    simulation gives rank 0 over the run's iterations, re-planned as the run planned them."""
    from dynapipe_ext.plan.iteration_planner import (build_cost_model, search_memory_limit,
                                                split_that_runs)
    from megatron.training.arguments import parse_args
    from megatron.training.training import model_spec, open_training_data, planner_config
    cfg = parse_args_sized(model, argv, has_cuda=True)
    data = open_training_data(cfg)
    config = planner_config(cfg, model_spec(cfg, data.vocab_size),
                            cfg.data_parallel_size(world))
    costs = build_cost_model(config.cost_model, config.spec, config.tp, config.pp)
    limit = search_memory_limit(costs, config)
    activations = max(split_that_runs(data.batch_lengths(i), config, costs, limit)[1][0]
                      .result.peak_memory_bytes[0] for i in range(iterations))
    return costs.model_state_bytes(config.pp)[0] + activations


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_short_training_run_with_the_device_cost_model(model, sp_dataset, tmp_path,
                                                       monkeypatch):
    from megatron.planning.device_costs import device_figures
    from megatron.training.arguments import parse_args
    monkeypatch.setenv("DYNAPIPE_DEVICE", "cuda")
    world = 2 if GPUS >= 2 else 1
    script, shape = RUNS[model]
    iterations = 8
    argv = sp_dataset + shape + [
        "--bf16", "--pipeline-model-parallel-size", str(world), "--device-flops", FLOPS,
        "--cost-model", "analytic",
        "--tokens-per-global-batch", "8192", "--train-iters", str(iterations),
        "--num-planner-workers", "1", "--lr", "1e-3"]
    stats_file = tmp_path / "stats.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script,
           *argv, "--stats-file", str(stats_file)]
    done = subprocess.run(cmd, cwd=REPO, env=dict(env_with_repo(), DYNAPIPE_DEVICE="cuda"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert "tokens/s" in done.stdout and "plan wait" in done.stdout
    stats = [json.loads(line) for line in open(stats_file)]
    measured = max(s["peak_memory_bytes"] for s in stats)
    predicted = predicted_rank0_peak(model, argv, world, iterations)
    usable = device_figures(parse_args_sized(model, argv, has_cuda=True)).usable_bytes
    steady = stats[1:]
    report(f"training_{model}_{world}gpu", {
        "device": torch.cuda.get_device_name(0), "gpus": world,
        "tokens_per_s": sum(s["real_tokens"] for s in steady)
        / sum(s["iteration_s"] for s in steady),
        "plan_wait_s": sum(s["plan_wait_s"] for s in steady),
        "losses": [s["loss"] for s in stats],
        "rank0_peak_predicted_mib": predicted / 2**20,
        "rank0_peak_measured_mib": measured / 2**20,
        "predicted_over_measured": predicted / measured})
    assert max(s["loss"] for s in stats[-2:]) < stats[0]["loss"]
    assert measured <= usable                       # the planner's promise: the plan fits
    assert 0.5 <= predicted / measured <= 2.0       # the memory model is not grossly off


# ---------------------------------------------------------------------------- device plumbing

@pytest.mark.gpu
@needs_2_gpus
def test_nccl_warm_up_exchanges_with_every_neighbouring_pipeline_rank():
    world = min(GPUS, 4)
    results = run_in_processes(_warm_up_rank, world, args=(1, world), device="cuda",
                               timeout_s=300)
    for pp_rank, device, received in results:
        assert device == "cuda"
        assert received == expected_warm_up(pp_rank, world)


@pytest.mark.gpu
@needs_gpu
def test_device_probe_and_calibration_on_the_gpu(monkeypatch):
    from megatron.planning import device_costs
    from megatron.training.arguments import parse_args
    monkeypatch.setenv("DYNAPIPE_DEVICE", "cuda")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    figures = device_costs.device_figures(parse_args_sized("gpt", ["--data-path", "x", "--bf16"],
                                                     has_cuda=True))
    total = torch.cuda.get_device_properties(0).total_memory
    assert figures.kind == "cuda" and figures.memory_bytes == total
    assert figures.headroom_bytes == pytest.approx(0.1 * total + 2**30)
    report("device_figures", {"device": torch.cuda.get_device_name(0),
                              "figures": figures.describe()})
    assert figures.flops > 1e12 and dict(figures.sources)["flops"] == "matmul calibration"


@pytest.mark.gpu
@needs_gpu
def test_flextp_slot_timer_uses_cuda_events_without_synchronising(monkeypatch):
    """On CUDA a FlexTP slot pair times its compute and its forward all-reduce with events: no
    torch.cuda.synchronize during the forwards; the seconds read afterwards are positive (the
    all-reduce's at least 0) and within the wall time."""
    import time

    from tests.multiproc import single_process_world
    from tests.integration.test_flextp_integration import HIDDEN, _slot_forward, _slot_pair
    with single_process_world(SEED):
        pair, _ = _slot_pair(1)
        pair.column.cuda()
        pair.row.cuda()
        pair.contrib = pair.contrib.cuda()
        x = torch.randn(64, 1, HIDDEN, device="cuda")
        _slot_forward(pair, x)                      # warm-up: kernels loaded
        pair.reset_timer()
        syncs = []
        real = torch.cuda.synchronize
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (syncs.append(a), real(*a)))
        start = time.perf_counter()
        for _ in range(3):
            _slot_forward(pair, x)
        assert syncs == []
        seconds = pair.seconds                      # waits for the last span here
        synced = pair.sync_seconds
        wall = time.perf_counter() - start
        assert 0 < seconds <= wall and pair.tokens == 3 * 64
        assert 0 <= synced <= wall and seconds + synced <= wall


def unit_times_worker(rank, world_size):
    """--pipeline-split balanced's measurement on this GPU, bf16 with the fusions on."""
    from dynapipe_ext.costs.model_spec import ModelSpec
    from megatron.planning.profile_layers import half_layer_unit_times
    from megatron.model.stages import build_transformer_config
    from megatron.base.distributed_setup import setup_model_parallel
    layout = setup_model_parallel(1, 1, seed=SEED)
    spec = ModelSpec("gpt", 2, 512, 8, 32000, max_position_embeddings=1024)
    config = build_transformer_config(spec, dtype="bfloat16", fused=True)
    return half_layer_unit_times(spec, config, 4, 512, layout.device)


@pytest.mark.gpu
@needs_gpu
def test_half_layer_units_are_timed_on_the_gpu():
    times = run_in_processes(unit_times_worker, 1, device="cuda", timeout_s=300)[0]
    print(f"half-layer unit ms (embedding + attention, MLP, attention, MLP + head): {times}")
    assert len(times) == 4 and all(0 < t < 1e4 for t in times)
    # the last unit is an MLP half plus a 32,000-word output layer and loss (8x its FLOPs)
    assert times[3] > times[1]
