"""Planning at cluster scale: samples dealt to replicas once, each replica planned alone with
the same bytes whichever process plans it, nodes of ranks each with their own planning leader
and plan group, and a killed planner worker on one node is an error naming the iteration and
the node on that node's ranks (the other node trains on)."""
import dataclasses
import datetime
import os
import signal
import time

import numpy as np
import pytest
import torch.distributed as dist

from dynapipe_ext.plan.cluster import (all_nodes, auto_num_workers, block_replicas, free_cores,
                                  node_ranks, node_replicas, predicted_wait_share,
                                  ranks_per_node_from_env)
from dynapipe_ext.plan.iteration_planner import (CostModelSource, IterationPlannerConfig,
                                            plan_iteration)
from dynapipe_ext.costs.model_spec import ModelSpec
from dynapipe_ext.batching.planners import PlannerConfig
from dynapipe_ext.batching.replica_split import deal_samples
from dynapipe_ext.plan.serialization import plan_from_bytes
from tests.multiproc import run_in_processes

GPT = ModelSpec("gpt", 4, 64, 4, 256, max_position_embeddings=256)
T5 = ModelSpec("t5", 4, 64, 4, 256, num_decoder_layers=4, max_position_embeddings=256)


def config(model: str = "gpt", dp: int = 4, pp: int = 2, split: str = "samples",
           check: bool = False) -> IterationPlannerConfig:
    spec = GPT if model == "gpt" else T5
    planner = PlannerConfig(model=model, max_seq_len=256, max_dec_seq_len=64 if model == "t5"
                            else 0, pipeline_stages=pp, data_parallel=dp)
    return IterationPlannerConfig(spec, planner, pp=pp, dp=dp, replica_split=split,
                                  check_plans=check,
                                  cost_model=CostModelSource.analytic(device_flops=1e12,
                                                                      device_mem_bytes=2**30))


def lengths_of(iteration: int, model: str = "gpt", n: int = 48) -> np.ndarray:
    rng = np.random.default_rng(1000 + iteration)
    enc = rng.integers(4, 256, size=n)
    return enc if model == "gpt" else np.stack([enc, rng.integers(2, 64, size=n)], 1)


# ---------------------------------------------------------------------------- the split

def test_samples_are_dealt_once_each_evenly_and_deterministically():
    lengths = lengths_of(0, n=103)
    parts = deal_samples(lengths, 8)
    assert sorted(np.concatenate(parts).tolist()) == list(range(103))
    assert {len(p) for p in parts} <= {12, 13}
    assert all(list(p) == sorted(p) for p in parts)
    tokens = [int(lengths[p].sum()) for p in parts]
    assert max(tokens) / min(tokens) < 1.15          # the same length mix on every replica
    assert all(np.array_equal(a, b) for a, b in zip(parts, deal_samples(lengths, 8)))
    t5 = lengths_of(0, "t5", 20)
    assert sorted(np.concatenate(deal_samples(t5, 3)).tolist()) == list(range(20))
    with pytest.raises(ValueError, match="5 samples cannot be dealt to 8 data-parallel"):
        deal_samples(lengths[:5], 8)


@pytest.mark.parametrize("model,split", [("gpt", "samples"), ("t5", "samples"),
                                         ("gpt", "micro-batches")])
def test_a_replica_planned_alone_has_the_bytes_of_the_single_process_plan(model, split):
    cfg = config(model, dp=4, split=split, check=True)
    lengths = lengths_of(3, model)
    whole = plan_iteration(3, lengths, cfg)
    assert whole.replicas == (0, 1, 2, 3)
    assert set(whole.plan_bytes) == {(d, p) for d in range(4) for p in range(2)}
    pieces = {}
    for node in ((0, 1), (2,), (3,)):
        part = plan_iteration(3, lengths, cfg, replicas=node)
        assert part.replicas == node
        assert {d for d, _ in part.plan_bytes} == set(node)
        assert part.schedules == tuple(whole.schedules[r] for r in node)
        pieces.update(part.plan_bytes)
    assert pieces == whole.plan_bytes                # byte for byte
    ids = sorted(s for mb in whole.batch_plan.micro_batches for s in mb.sample_ids)
    assert ids == list(range(len(lengths)))          # every sample planned exactly once
    for d in range(4):                               # each replica runs its own samples
        plan = plan_from_bytes(whole.plan_bytes[(d, 0)])
        assert plan.dp_rank == d


def test_samples_split_plans_only_the_asked_replicas_and_checks_them():
    cfg = config(dp=4)
    dealt = deal_samples(lengths_of(1), 4)
    part = plan_iteration(1, lengths_of(1), cfg, replicas=[2])
    assert sorted(part.batch_plan.sample_ids()) == dealt[2].tolist()
    with pytest.raises(ValueError, match=r"subset of 0\.\.3, got \[4\]"):
        plan_iteration(1, lengths_of(1), cfg, replicas=[4])
    with pytest.raises(ValueError, match="replica_split must be one of"):
        config(split="tokens")


# ---------------------------------------------------------------------------- nodes, workers

def test_nodes_follow_torchrun_numbering(monkeypatch):
    assert node_ranks(5, 8, 4) == [4, 5, 6, 7]
    assert all_nodes(6, 2) == [[0, 1], [2, 3], [4, 5]]
    assert node_replicas([3, 1, 3, 1]) == (1, 3)
    assert block_replicas(2, 4, 64) == tuple(range(32, 48))
    with pytest.raises(ValueError, match="6 ranks cannot form nodes of 4 ranks"):
        node_ranks(0, 6, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_per_node_from_env(8) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_per_node_from_env(8) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be an integer, got 'two'"):
        ranks_per_node_from_env(8)


def test_auto_worker_count_keeps_up_with_iterations_within_the_free_cores():
    assert free_cores(8, cores=64) == 56 and free_cores(8, cores=4) == 0
    # 3 s of planning per iteration, 1 s iterations: 1.5 x 3 / 1 -> 5 workers
    workers, why = auto_num_workers(56, plan_s=3.0, iteration_s=1.0)
    assert workers == 5 and "56 free core(s)" in why
    assert predicted_wait_share(3.0, 1.0, workers) == 0.0
    assert auto_num_workers(56, plan_s=0.1, iteration_s=2.0)[0] == 1
    assert auto_num_workers(2, plan_s=30.0, iteration_s=1.0)[0] == 2     # as many as free
    assert auto_num_workers(0, plan_s=30.0, iteration_s=1.0)[0] == 1     # never none
    assert auto_num_workers(8, plan_s=1.0, iteration_s=None)[0] == 2
    # too few workers: iterations come every plan_s / workers, the rest is waiting
    assert predicted_wait_share(3.0, 1.0, 2) == pytest.approx(1 / 3)


# ---------------------------------------------------------------------------- gloo world

def _two_nodes(rank, world_size, iterations, kill_after):
    """2 nodes x 2 ranks on a dp 2 x pp 2 grid: node n holds replica n. Real planner
    workers (one per node, no prefetch); node 1's worker is killed after iteration
    `kill_after`."""
    from megatron.planning.plan_delivery import start_plan_delivery
    from dynapipe_ext.runtime.plan_ahead import PlanningFailed
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    cfg = config(dp=2)
    dp_rank, pp_rank = divmod(rank, 2)
    delivery = start_plan_delivery(cfg, lengths_of, rank, world_size, dp_rank, pp_rank, 0,
                                   iterations, num_workers=1, prefetch=0, timeout_s=60)
    got, failure = [], None
    with delivery:
        assert delivery.replicas == (dp_rank,) and delivery.leader == 2 * dp_rank
        for it in range(iterations):
            if it == kill_after + 1 and rank == 2:
                worker = delivery.planner._workers[0]
                os.kill(worker.pid, signal.SIGKILL)
                worker.join(10)
            start = time.monotonic()
            try:
                got.append(delivery.fetch(it).plan)
            except PlanningFailed as exc:
                failure = (it, str(exc), time.monotonic() - start)
                break
    dist.barrier()
    return got, failure


@pytest.mark.slow
def test_nodes_plan_their_own_replicas_and_a_killed_planner_is_an_error_on_its_node():
    iterations, kill_after = 3, 0
    results = run_in_processes(_two_nodes, 4, args=(iterations, kill_after), timeout_s=240,
                               daemon=False)
    cfg = config(dp=2)
    single = [plan_iteration(it, lengths_of(it), cfg).plan_bytes for it in range(iterations)]
    for rank, (got, failure) in enumerate(results):
        coords = divmod(rank, 2)
        done = iterations if rank < 2 else kill_after + 1
        assert got == [plan_from_bytes(single[it][coords]) for it in range(done)], rank
        if rank < 2:
            assert failure is None                  # node 0 is not touched
            continue
        it, message, took = failure
        assert it == kill_after + 1
        assert f"node 1 (ranks 2, 3): cannot plan iteration {it}: planner worker pid" \
               in message and "died with exit code -9" in message
        if rank == 3:
            assert f"planning of iteration {it} failed on the planning leader (rank 2) of " \
                   f"node 1" in message
        assert took < 20                            # at once, not after the 60 s timeout


def test_auto_workers_time_one_plan_and_report_the_choice_at_start():
    from megatron.planning.plan_delivery import start_plan_delivery
    lines = []
    with start_plan_delivery(config(dp=2), lengths_of, rank=0, world_size=1, dp_rank=0,
                             pp_rank=0, first_iteration=0, stop_iteration=2,
                             num_workers="auto", report=lines.append) as delivery:
        assert delivery.planner.num_workers >= 1
        got = [delivery.fetch(it).plan for it in range(2)]
    assert [p.iteration for p in got] == [0, 1]
    assert len(lines) == 1 and lines[0].startswith("[plan] node 0: --num-planner-workers "
                                                   f"auto: {delivery.planner.num_workers} (")
    assert "s per iteration on one core, iterations" in lines[0]
    assert lines[0].endswith("plans replicas 0")         # the replica of its one rank


def test_training_flags_for_cluster_planning(capsys):
    from megatron.training.arguments import parse_args
    base = ["--data-path", "data/flan", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "128", "--train-iters", "2"]
    cfg = parse_args("gpt", base + ["--num-planner-workers", "auto", "--replica-split",
                                    "samples"], has_cuda=False)
    assert (cfg.num_planner_workers, cfg.replica_split) == ("auto", "samples")
    assert parse_args("gpt", base, has_cuda=False).replica_split == "auto"
    with pytest.raises(SystemExit):
        parse_args("gpt", base + ["--num-planner-workers", "many"], has_cuda=False)
    assert "--num-planner-workers: expected a number or 'auto', got 'many'" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args("gpt", base + ["--num-planner-workers", "-1"], has_cuda=False)
    assert "--num-planner-workers must be >= 0 or 'auto', got -1" in capsys.readouterr().err


@pytest.mark.slow
def test_the_scale_simulation_plans_and_delivers_with_the_real_code():
    from dynapipe_ext.plan.cluster_projection import markdown
    from megatron.planning.cluster_sim import simulate
    # 2 "nodes" of 1 rank each plan 2 replicas apiece of a 4-replica paper-GPT layout
    sims = [simulate(2, 1, 65536, 4, iterations=2, timeout_s=300)]
    sim = sims[0]
    assert (sim["nodes"], sim["ranks"], sim["replicas_per_node"]) == (2, 2, 2)
    assert sim["node_cpu_s_max"] >= sim["node_cpu_s"] > 0
    text = markdown(sims, [], "cmd", "now", "here")
    assert "| 2 | 2 | 2 |" in text and "(1/nodes = 0.50)" in text


def test_auto_replica_split_keeps_the_whole_batch_split_on_one_node_only(monkeypatch):
    from dynapipe_ext.plan.cluster import default_replica_split
    from megatron.training.arguments import parse_args
    from megatron.training.training import replica_split
    assert default_replica_split(8, 8) == "micro-batches"
    assert default_replica_split(16, 8) == "samples"
    cfg = parse_args("gpt", ["--data-path", "data/flan", "--num-layers", "2", "--hidden-size",
                             "64", "--num-attention-heads", "4", "--seq-length", "128",
                             "--train-iters", "2"], has_cuda=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert replica_split(cfg) == "micro-batches"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert replica_split(cfg) == "samples"
    assert replica_split(dataclasses.replace(cfg, replica_split="micro-batches")) \
        == "micro-batches"
