"""Plan delivery through a TCPStore: every rank gets exactly its plan, keys are deleted once read
(bounded store), planning errors reach every rank, and a missing plan or reader is a clear
timeout. Readers run as threads against one in-process store; the gloo test uses processes."""
import datetime
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch.distributed as dist

from dynapipe_ext.plan_ahead import PlanAhead, PlanningFailed
from megatron.training.plan_delivery import (KEY_PREFIX, PlanDelivery, PlanDeliveryTimeout,
                                             ack_key, create_plan_store, plan_key)
from multiproc import run_in_processes


@dataclass(frozen=True)
class FakeIterationPlan:
    plan_bytes: dict
    timings_ms: dict = field(default_factory=dict)


def fake_lengths(iteration: int) -> list[int]:
    return [8 * (1 + (iteration * 7 + k) % 5) for k in range(6)]


def fake_plan(iteration: int, lengths, dp_size: int = 2, pp_size: int = 2, fail_at: int = -1):
    """Distinct bytes per (iteration, dp, pp) so a wrong delivery shows."""
    if iteration == fail_at:
        raise RuntimeError(f"memory limit exceeded by a micro-batch of iteration {iteration}")
    return FakeIterationPlan({(d, p): f"{iteration}/{d}/{p}/{sum(lengths)}".encode()
                              for d in range(dp_size) for p in range(pp_size)},
                             {"split": 1.0})


def fail_at_4(iteration, lengths):
    return fake_plan(iteration, lengths, fail_at=4)


def expected_bytes(iteration, d, p):
    return f"{iteration}/{d}/{p}/{sum(fake_lengths(iteration))}".encode()


def plan_keys_in(store) -> list[str]:
    return [k for k in store.list_keys() if k.startswith(KEY_PREFIX)]


def master_store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30),
                         wait_for_workers=False)


def client_store(port):
    return dist.TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=30))


def run_readers(port, coords, iterations, first=0, timeout_s=30.0):
    """Reader ranks 1.. as threads; returns {rank: [plan bytes or error text, ...]}."""
    got = {rank: [] for rank in range(1, len(coords) + 1)}

    def reader(rank, dp, pp):
        delivery = PlanDelivery(client_store(port), rank, len(coords) + 1, dp, pp, 2, 2,
                                decode=bytes, timeout_s=timeout_s).start(first)
        for it in range(first, first + iterations):
            try:
                got[rank].append(delivery.fetch(it).plan)
            except PlanningFailed as exc:
                got[rank].append(str(exc))
                return

    threads = [threading.Thread(target=reader, args=(r, d, p), daemon=True)
               for r, (d, p) in enumerate(coords, start=1)]
    for t in threads:
        t.start()
    return threads, got


# ranks 1..4 as (dp, pp); rank 4 is a second TP rank of (1, 1)
READERS = [(0, 1), (1, 0), (1, 1), (1, 1)]


def test_every_rank_gets_its_plan_and_store_keys_stay_bounded():
    store = master_store()
    iterations = 60
    threads, got = run_readers(store.port, READERS, iterations)
    planner = PlanAhead(fake_plan, fake_lengths, num_workers=0)
    leader = PlanDelivery(store, 0, 5, 0, 0, 2, 2, planner=planner, decode=bytes,
                          max_outstanding=3).start(0)
    most_keys = 0
    own = []
    with leader:
        for it in range(iterations):
            delivered = leader.fetch(it)
            own.append(delivered.plan)
            assert delivered.planning_ms["split"] == 1.0
            most_keys = max(most_keys, len(plan_keys_in(store)))
        for t in threads:
            t.join(30)
    # at most max_outstanding iterations of 4 plan keys + 1 ack key (+1 just being published)
    assert 0 < most_keys <= (3 + 1) * 5
    assert own == [expected_bytes(it, 0, 0) for it in range(iterations)]
    for rank, (d, p) in enumerate(READERS, start=1):
        assert got[rank] == [expected_bytes(it, d, p) for it in range(iterations)], rank
    assert plan_keys_in(store) == []  # close() deleted the last, fully acked iterations


def test_background_planner_publishes_ahead_and_resumes_at_k():
    store = master_store()
    threads, got = run_readers(store.port, READERS, 5, first=7)
    planner = PlanAhead(fake_plan, fake_lengths, num_workers=1, prefetch=2)
    with PlanDelivery(store, 0, 5, 0, 0, 2, 2, planner=planner, decode=bytes).start(7) as leader:
        own = []
        for it in range(7, 12):
            own.append(leader.fetch(it).plan)
            time.sleep(0.05)  # training
        for t in threads:
            t.join(30)
    assert own == [expected_bytes(it, 0, 0) for it in range(7, 12)]
    for rank, (d, p) in enumerate(READERS, start=1):
        assert got[rank] == [expected_bytes(it, d, p) for it in range(7, 12)]


def test_planning_error_reaches_every_rank():
    store = master_store()
    threads, got = run_readers(store.port, READERS, 6)
    planner = PlanAhead(fail_at_4, fake_lengths, num_workers=0)
    with PlanDelivery(store, 0, 5, 0, 0, 2, 2, planner=planner, decode=bytes).start(0) as leader:
        for it in range(4):
            leader.fetch(it)
        with pytest.raises(PlanningFailed, match="memory limit exceeded .* iteration 4"):
            leader.fetch(4)
        for t in threads:
            t.join(30)
    for rank in got:
        assert len(got[rank]) == 5
        assert "planning of iteration 4 failed on the planning leader" in got[rank][4]
        assert "memory limit exceeded by a micro-batch of iteration 4" in got[rank][4]


def test_reader_without_a_leader_times_out_naming_iteration_and_rank():
    store = master_store()
    reader = PlanDelivery(client_store(store.port), 3, 4, 1, 0, 2, 2, decode=bytes,
                          timeout_s=0.5).start(12)
    start = time.monotonic()
    with pytest.raises(PlanDeliveryTimeout, match=r"rank 3 \(dp 1, pp 0\) got no plan for "
                                                  r"iteration 12"):
        reader.fetch(12)
    assert time.monotonic() - start < 10


def test_leader_stops_when_a_reader_never_reads():
    store = master_store()
    planner = PlanAhead(fake_plan, fake_lengths, num_workers=0)
    leader = PlanDelivery(store, 0, 2, 0, 0, 2, 2, planner=planner, decode=bytes,
                          timeout_s=0.5, max_outstanding=1).start(0)
    with leader:
        leader.fetch(0)
        with pytest.raises(PlanDeliveryTimeout, match="only 0 of 1 ranks read the plan of "
                                                      "iteration 0"):
            leader.fetch(1)


def test_incomplete_plan_is_an_error_on_every_rank():
    store = master_store()

    def one_replica_only(iteration, lengths):
        return fake_plan(iteration, lengths, dp_size=1)

    threads, got = run_readers(store.port, READERS[:1], 1)
    planner = PlanAhead(one_replica_only, fake_lengths, num_workers=0)
    with PlanDelivery(store, 0, 2, 0, 0, 2, 2, planner=planner, decode=bytes).start(0) as leader:
        with pytest.raises(PlanningFailed, match=r"expected all of"):
            leader.fetch(0)
        for t in threads:
            t.join(30)
    assert "covers (dp, pp) pairs" in got[1][0]


def test_acks_are_counted_per_iteration():
    store = master_store()
    planner = PlanAhead(fake_plan, fake_lengths, num_workers=0)
    with PlanDelivery(store, 0, 2, 0, 0, 2, 2, planner=planner, decode=bytes).start(0) as leader:
        leader.fetch(0)
        assert store.check([plan_key(0, 1, 1)])
        reader = PlanDelivery(client_store(store.port), 1, 2, 1, 1, 2, 2, decode=bytes).start(0)
        assert reader.fetch(0).plan == expected_bytes(0, 1, 1)
        assert store.add(ack_key(0), 0) == 1
        leader._reap()
        assert not store.check([plan_key(0, 1, 1)])


def _gloo_rank(rank, world_size, fail_at):
    """tp=2 x pp=2 on 4 ranks (Megatron order: tp fastest). The test's ranks are daemonic
    processes, which may not have children: rank 0 plans inline."""
    import functools
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    tp_rank, pp_rank = rank % 2, rank // 2
    store = create_plan_store(rank, world_size, timeout_s=60)
    planner = None
    if rank == 0:
        planner = PlanAhead(functools.partial(fake_plan, dp_size=1, fail_at=fail_at),
                            fake_lengths, num_workers=0)
    received = []
    with PlanDelivery(store, rank, world_size, 0, pp_rank, 1, 2, planner=planner,
                      decode=bytes, timeout_s=60).start(0) as delivery:
        for it in range(6):
            try:
                received.append(delivery.fetch(it).plan)
            except PlanningFailed as exc:
                received.append(str(exc))
                break
            dist.barrier()  # one "training step"
        dist.barrier()
    return tp_rank, pp_rank, received


@pytest.mark.slow
def test_gloo_ranks_receive_their_plans_and_the_planning_error():
    results = run_in_processes(_gloo_rank, 4, args=(4,), timeout_s=180)
    for tp_rank, pp_rank, received in results:
        assert received[:4] == [expected_bytes(it, 0, pp_rank) for it in range(4)]
        assert len(received) == 5
        assert "memory limit exceeded by a micro-batch of iteration 4" in received[4]


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_training_flags_become_a_planner_config_that_plans(model):
    import numpy as np
    from dynapipe_ext.iteration_planner import pipeline_layout
    from dynapipe_ext.model_spec import ModelSpec
    from megatron.training.arguments import parse_args
    from megatron.training.plan_delivery import start_plan_delivery
    from megatron.training.training import planner_config

    argv = ["--data-path", "data/flan", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--pipeline-model-parallel-size", "2",
            "--pipeline-schedule", "wave", "--micro-batching", "dynamic", "--check-plans"]
    argv += ["--seq-length", "128"] if model == "gpt" else [
        "--encoder-seq-length", "128", "--decoder-seq-length", "32", "--decoder-num-layers", "4"]
    cfg = parse_args(model, argv, has_cuda=False)
    spec = ModelSpec(model, 4, 64, 4, 256, num_decoder_layers=4 if model == "t5" else 0)
    config = planner_config(cfg, spec, dp=1)
    assert (config.pp, config.dp, config.pipeline_schedule, config.check_plans) == \
        (2, 1, "wave", True)
    assert pipeline_layout(config) == (0, 1, 1, 0)

    def lengths(iteration):
        rng = np.random.default_rng(iteration)
        enc = rng.integers(4, 128, size=24)
        return enc if model == "gpt" else np.stack([enc, rng.integers(2, 32, size=24)], 1)

    with start_plan_delivery(config, lengths, rank=0, world_size=1, dp_rank=0, pp_rank=0,
                             first_iteration=2, stop_iteration=4, num_workers=0) as delivery:
        got = [delivery.fetch(it) for it in (2, 3)]
    assert [g.plan.iteration for g in got] == [2, 3]
    assert all(g.plan.stage_to_rank == (0, 1, 1, 0) for g in got)
    assert all(g.planning_ms["total"] > 0 for g in got)
