"""Device-aware planning: the run's device, precision and optimizer layout reach the planner's
cost model through one construction path (training.planner_config)."""
import dataclasses
import inspect

import numpy as np
import pytest

from dynapipe_ext.costs.cost_model import memory_needed
from dynapipe_ext.plan.iteration_planner import build_cost_model, plan_iteration
from megatron.planning import device_costs
from megatron.base import distributed_setup
from megatron.training.arguments import parse_args
from megatron.training.training import model_spec, planner_config

GIB = 2**30
# the model of examples/train_gpt_gpu.sh (PP=2 as on two or more GPUs)
GPU_GPT = ["--data-path", "x", "--num-layers", "24", "--hidden-size", "1024",
           "--num-attention-heads", "16", "--seq-length", "2048",
           "--pipeline-model-parallel-size", "2", "--bf16", "--micro-batching", "dynamic",
           "--pipeline-schedule", "auto", "--tokens-per-global-batch", "65536",
           "--device-flops", "4e14", "--memory-headroom-gb", "2",
           # the limits below were chosen for the model without dropout masks (7 GiB: a 2048
           # token sample needs 1611 MiB of 1608 with --hidden-dropout 0.1 under recompute)
           "--hidden-dropout", "0", "--attention-dropout", "0"]


REQUIRED_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--train-iters", "1"]


def parse_args_sized(model, argv, **kwargs):
    """parse_args with the flags Megatron requires; the test's own argv overrides them."""
    return parse_args(model, REQUIRED_FLAGS + list(argv), **kwargs)


def flan_like_batch(seed: int = 0, budget: int = 65536, max_len: int = 2048) -> np.ndarray:
    """Long-tailed sample lengths (FLAN-like), as many as fit the token budget."""
    lengths = np.minimum(np.random.default_rng(seed).lognormal(6.0, 1.0, 4000).astype(int) + 8,
                         max_len)
    return lengths[np.cumsum(lengths) <= budget]


def gpu_gpt_plan(memory_gb: float, seed: int = 0):
    """The plan of a GPU run of that model, made here: the cost model of a GPU's figures (as
    the flags give them), whatever device plans it."""
    cfg = parse_args_sized("gpt", GPU_GPT + ["--device-memory-gb", str(memory_gb)], has_cuda=True)
    spec = model_spec(cfg, 50257)
    gpu = device_costs.DeviceFigures("cuda", memory_gb * GIB, cfg.memory_headroom_gb * GIB,
                                     cfg.device_flops)
    config = dataclasses.replace(planner_config(cfg, spec, dp=1),
                                 cost_model=device_costs.cost_model_source(cfg, 1, gpu, spec))
    return config, plan_iteration(0, flan_like_batch(seed), config)


def micro_batch_needs(config, plan):
    model = build_cost_model(config.cost_model, config.spec, config.tp, config.pp)
    mbs = plan.batch_plan.micro_batches
    return memory_needed(model.stage_cost_arrays([mb.num_rows for mb in mbs],
                                                 [mb.seq_len for mb in mbs],
                                                 [0] * len(mbs), config.pp, "none"))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_device_memory_given_by_flags_shapes_the_plan(seed):
    """80 GiB: every micro-batch of the train_gpt_gpu.sh model fits as is (no recompute). 7 GiB:
    a lower limit, met by more, smaller micro-batches. The issue expected recompute on a 16 GiB
    device; with the fused attention (no s^2 activations) that model fits 16 GiB without it,
    and a whole-stage recompute (the runtime's 'full') barely lowers the backward peak, so the
    planner cuts finer instead (docs/USAGE.md, "GPU"). With a GPU's host floor per layer the
    80 GiB plan is a few large micro-batches, over the 7 GiB limit."""
    config, big = gpu_gpt_plan(80, seed)
    limit = big.batch_plan.info["memory_limit_bytes"]
    assert (micro_batch_needs(config, big) <= limit).all()
    assert {mb.recompute for mb in big.batch_plan.micro_batches} == {"none"}
    small_config, small = gpu_gpt_plan(7, seed)
    small_limit = small.batch_plan.info["memory_limit_bytes"]
    assert small_limit < limit
    assert len(small.batch_plan.micro_batches) > len(big.batch_plan.micro_batches)
    assert (micro_batch_needs(small_config, small) <= small_limit).all()
    assert (micro_batch_needs(config, big) > small_limit).any()   # the big plan would not fit


def test_the_cost_model_gets_the_device_precision_and_optimizer_layout():
    cfg = parse_args_sized("gpt", GPU_GPT + ["--device-memory-gb", "80"], has_cuda=True)
    config = planner_config(cfg, model_spec(cfg, 50257), dp=4)
    model = build_cost_model(config.cost_model, config.spec, config.tp, config.pp)
    assert model.dtype_bytes == 2 and model.device_flops == 4e14
    assert not model.sigmoid_gelu       # bf16: torch's GeLU kernel on any device
    assert model.bytes_per_param_state == 18               # bf16 layout; DP reduces in place
    assert model.device_memory_bytes == (80 - 2) * GIB        # headroom kept
    assert model.activation_memory_limit(2) == pytest.approx(
        78 * GIB - 18 * max(sum(model.layer_params(k) for k in kinds)
                            for kinds in config.spec.stage_layers(2)))
    fp32 = parse_args_sized("gpt", ["--data-path", "x", "--device-memory-gb", "8",
                              "--device-flops", "1e11"], has_cuda=False)
    fp32_model = build_cost_model(planner_config(fp32, model_spec(fp32, 500), dp=1).cost_model,
                                  model_spec(fp32, 500), 1, 1)
    assert fp32_model.dtype_bytes == 4
    assert fp32_model.sigmoid_gelu      # fp32 on this CPU: stages.gelu_tanh's sigmoid path
    # small micro-batches lose little on a CPU (half rate 16 tokens, fitted to packed streams),
    # much on a GPU
    assert fp32_model.half_rate_tokens == device_costs.CPU_HALF_RATE_TOKENS
    default = inspect.signature(type(fp32_model)).parameters["half_rate_tokens"].default
    gpu = device_costs.analytic_device_options("cuda").get("half_rate_tokens", default)
    assert gpu > 4 * device_costs.CPU_HALF_RATE_TOKENS
    # a CPU's rate falls for micro-batches that outgrow its caches; a GPU's does not
    assert fp32_model.cache_tokens == device_costs.CPU_CACHE_TOKENS
    assert device_costs.analytic_device_options("cuda").get("cache_tokens") is None


def test_state_bytes_per_param_count_what_the_optimizer_holds():
    # bf16: weights 2 + fp32 master 4 + fp32 main grads 4 + Adam 8; fp32: 4 + 4 + 8
    assert device_costs.state_bytes_per_param(bf16=True) == 18
    assert device_costs.state_bytes_per_param(bf16=False) == 16
    # --use-distributed-optimizer: master weights and moments split over DP
    assert device_costs.state_bytes_per_param(bf16=True, optimizer_shards=8) == 2 + 4 + 12 / 8
    assert device_costs.state_bytes_per_param(bf16=False, optimizer_shards=4) == 4 + 4 + 2


def test_the_distributed_optimizer_frees_memory_the_plan_uses():
    """A 2.4B-parameter GPT (48 layers, hidden 2048) at PP=2 x DP=8 on 30 GiB devices: 18
    bytes per parameter of model state leave the planner 6 GiB for activations, so it cuts
    the batch finer and recomputes; with --use-distributed-optimizer it counts 2 + 4 + 12 / 8
    bytes per parameter and spends the memory freed on fewer micro-batches without
    recompute."""
    plans = {}
    for flag in ([], ["--use-distributed-optimizer"]):
        cfg = parse_args_sized("gpt", GPU_GPT + ["--device-memory-gb", "30", "--cost-model",
                                                 "analytic", "--num-layers", "48",
                                                 "--hidden-size", "2048"] + flag,
                               has_cuda=True)
        spec = model_spec(cfg, 50257)
        config = planner_config(cfg, spec, dp=8)
        model = build_cost_model(config.cost_model, spec, config.tp, config.pp)
        # one replica's share of a global batch: the batch below planned for a single replica
        one = dataclasses.replace(config, dp=1, planner=dataclasses.replace(
            config.planner, data_parallel=1))
        plans[bool(flag)] = (model, plan_iteration(0, flan_like_batch(0), one), one)
    (plain, plain_plan, _), (sharded, sharded_plan, config) = plans[False], plans[True]
    assert plain.bytes_per_param_state == 18 and sharded.bytes_per_param_state == 7.5
    freed = (18 - 7.5) * max(sum(plain.layer_params(k) for k in kinds)
                             for kinds in config.spec.stage_layers(2))
    assert sharded.activation_memory_limit(2) - plain.activation_memory_limit(2) == \
        pytest.approx(freed)
    plain_mbs = plain_plan.batch_plan.micro_batches
    sharded_mbs = sharded_plan.batch_plan.micro_batches
    assert len(sharded_mbs) < len(plain_mbs)
    assert "full" in {mb.recompute for mb in plain_mbs}
    assert {mb.recompute for mb in sharded_mbs} == {"none"}
    # the sharded plan needs more than the unsharded limit: it uses the memory freed
    assert (micro_batch_needs(config, sharded_plan)
            > plain_plan.batch_plan.info["memory_limit_bytes"]).any()


def test_figures_come_from_flags_else_from_the_device(monkeypatch):
    monkeypatch.setenv(distributed_setup.DEVICE_ENV, "cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = parse_args_sized("gpt", ["--data-path", "x"], has_cuda=False)
    probed = device_costs.device_figures(cfg)
    import os
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert probed.kind == "cpu" and probed.memory_bytes == pytest.approx(physical / 4)
    assert probed.headroom_bytes == pytest.approx(0.1 * physical / 4)
    assert probed.flops == device_costs.CPU_NOMINAL_FLOPS
    flagged = device_costs.device_figures(parse_args_sized(
        "gpt", ["--data-path", "x", "--device-memory-gb", "12", "--memory-headroom-gb", "1.5",
                "--device-flops", "3e12"], has_cuda=False))
    assert (flagged.memory_bytes, flagged.headroom_bytes, flagged.flops) == \
        (12 * GIB, 1.5 * GIB, 3e12)
    assert dict(flagged.sources)["memory"] == "--device-memory-gb"
    with pytest.raises(ValueError, match="leaves nothing"):
        device_costs.device_figures(parse_args_sized(
            "gpt", ["--data-path", "x", "--device-memory-gb", "2", "--memory-headroom-gb", "3"],
            has_cuda=False))


def test_device_choice_env_forces_cpu_and_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(distributed_setup.DEVICE_ENV, "cpu")
    assert not distributed_setup.use_cuda()
    monkeypatch.setenv(distributed_setup.DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match="DYNAPIPE_DEVICE='tpu'"):
        distributed_setup.use_cuda()


def test_calibration_times_a_matmul_and_keeps_two_significant_digits():
    rate = device_costs.calibrate_flops("cpu", "float32", size=128, seconds=0.05)
    assert rate > 1e6
    mantissa = rate / 10 ** np.floor(np.log10(rate))
    assert mantissa == pytest.approx(round(mantissa, 1))


def test_p2p_flags_become_the_schedule_search_comm_model(capsys):
    cfg = parse_args_sized("gpt", ["--data-path", "x", "--p2p-bandwidth-gbps", "25",
                             "--p2p-latency-us", "10", "--device-flops", "1e11"], has_cuda=False)
    comm = planner_config(cfg, model_spec(cfg, 500), dp=1).comm
    assert comm.latency_ms == pytest.approx(0.01)
    assert comm.transfer_ms(25e6) == pytest.approx(0.01 + 1.0)     # 25 MB at 25 GB/s
    plain = parse_args_sized("gpt", ["--data-path", "x", "--device-flops", "1e11"], has_cuda=False)
    assert planner_config(plain, model_spec(plain, 500), dp=1).comm is None
    with pytest.raises(SystemExit):
        parse_args_sized("gpt", ["--data-path", "x", "--p2p-latency-us", "10"], has_cuda=False)
    assert "--p2p-latency-us needs --p2p-bandwidth-gbps" in capsys.readouterr().err


def test_a_profile_cost_model_gets_the_usable_memory_and_state_bytes(tmp_path):
    profile = tmp_path / "gpt.json"
    profile.write_text("{}")
    cfg = parse_args_sized("gpt", ["--data-path", "x", "--cost-model", str(profile),
                             "--device-memory-gb", "10", "--memory-headroom-gb", "1"],
                     has_cuda=False)
    source = planner_config(cfg, model_spec(cfg, 500), dp=1).cost_model
    assert source.kind == "profile"
    assert dict(source.options) == {"device_memory_bytes": 9 * GIB,
                                    "bytes_per_param_state": 16.0, "below_grid": "bound",
                                    "rows_above_grid": "scale"}


def _warm_up_rank(rank, world_size, tp, pp):
    """Set-up (which warms up) and one more warm-up exchange; also the GPU suite's NCCL check."""
    from megatron.base.distributed_setup import (pipeline_p2p_groups, setup_model_parallel,
                                                     warm_up_pipeline_transfers)
    layout = setup_model_parallel(tp, pp)           # runs the warm-up once
    again = warm_up_pipeline_transfers(pipeline_p2p_groups(), layout.device)
    return layout.pp_rank, layout.device.type, again


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 4), (2, 2)])
def test_every_neighbouring_pipeline_pair_exchanges_at_set_up_on_gloo(tp, pp):
    from tests.multiproc import run_in_processes
    results = run_in_processes(_warm_up_rank, 4, args=(tp, pp), timeout_s=180)
    for pp_rank, device, received in results:
        assert device == "cpu"
        assert received == expected_warm_up(pp_rank, pp)


def expected_warm_up(pp_rank: int, pp: int) -> dict:
    """What pipeline rank `pp_rank` of `pp` receives in the warm-up, by (direction, peer)."""
    want = {}
    if pp_rank > 0:
        want[(0, pp_rank - 1)] = pp_rank - 1     # towards higher ranks: from below
    if pp_rank < pp - 1:
        want[(1, pp_rank + 1)] = pp_rank + 1     # towards lower ranks: from above
    return want


def _link_rank(rank, world_size):
    from megatron.planning.device_costs import measure_link
    from megatron.base.distributed_setup import pipeline_p2p_groups, setup_model_parallel
    layout = setup_model_parallel(1, world_size)
    return layout.pp_rank, measure_link(pipeline_p2p_groups(), layout.device, rounds=4,
                                        large_bytes=2**20)


@pytest.mark.slow
def test_link_calibration_times_the_pipeline_pair_for_the_planning_rank():
    from tests.multiproc import run_in_processes
    results = dict(run_in_processes(_link_rank, 3, timeout_s=180))
    assert results[1] is None and results[2] is None        # only pipeline rank 0 plans
    link = results[0]
    assert link.latency_ms > 0 and link.bandwidth_bytes_per_ms > 0
    assert link.transfer_ms(2**20) > link.latency_ms
    assert device_costs.two_digits(link.latency_ms) == link.latency_ms
