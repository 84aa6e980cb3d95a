"""Plan delivery over the run's own gloo process group: every rank gets exactly its plan (TP
ranks each their copy), planning errors reach every rank, a stalled or dead peer is a clear
error, a corrupted plan is refused, and nothing else on the machine can read, overwrite or
tamper with the plans (there is no plan port at all). The multi-rank tests run real gloo
worlds (tests/multiproc.py); their ranks are daemonic, so rank 0 plans inline."""
import dataclasses
import datetime
import functools
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch.distributed as dist

from dynapipe_ext.runtime.plan_ahead import PlanAhead, PlanningFailed
from megatron.planning.plan_delivery import (PlanDelivery, PlanDeliveryError,
                                             PlanDeliveryTimeout, start_plan_delivery)
from tests.multiproc import run_in_processes


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


def expected_bytes(iteration, d, p):
    return f"{iteration}/{d}/{p}/{sum(fake_lengths(iteration))}".encode()


def small_planner_config(model: str = "gpt"):
    """A real planner configuration: 4 layers on PP=2, dynamic micro-batches."""
    from dynapipe_ext.costs.model_spec import ModelSpec
    from megatron.training.arguments import parse_args
    from megatron.training.training import planner_config
    argv = ["--data-path", "data/flan", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--pipeline-model-parallel-size", "2",
            "--micro-batching", "dynamic"]
    argv += ["--seq-length", "128"] if model == "gpt" else [
        "--encoder-seq-length", "128", "--decoder-seq-length", "32", "--decoder-num-layers", "4"]
    cfg = parse_args(model, argv + ["--train-iters", "4"], has_cuda=False)
    spec = ModelSpec(model, 4, 64, 4, 256, num_decoder_layers=4 if model == "t5" else 0)
    return planner_config(cfg, spec, dp=1)


def gpt_lengths(iteration: int) -> np.ndarray:
    return np.random.default_rng(iteration).integers(4, 128, size=24)


def init_world(timeout_s: float = 60.0) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))


# ---------------------------------------------------------------------------- one process

def test_a_leader_needs_a_planner_and_several_ranks_need_a_plan_group():
    with pytest.raises(ValueError, match="rank 0 is the planning leader and needs a planner"):
        PlanDelivery(None, 0, 1, 0, 0, 1, 1)
    with pytest.raises(ValueError, match="2 ranks need a plan group"):
        PlanDelivery(None, 1, 2, 0, 1, 1, 2)


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_training_flags_become_a_planner_config_that_plans(model):
    from dynapipe_ext.plan.iteration_planner import pipeline_layout
    config = small_planner_config(model)
    assert (config.pp, config.dp) == (2, 1)
    assert pipeline_layout(config) == (0, 1)

    def lengths(iteration):
        enc = gpt_lengths(iteration)
        rng = np.random.default_rng(iteration + 100)
        return enc if model == "gpt" else np.stack([enc, rng.integers(2, 32, size=24)], 1)

    with start_plan_delivery(config, lengths, rank=0, world_size=1, dp_rank=0, pp_rank=0,
                             first_iteration=2, stop_iteration=4, num_workers=0) as delivery:
        got = [delivery.fetch(it) for it in (2, 3)]
    assert [g.plan.iteration for g in got] == [2, 3]
    assert all(g.plan.stage_to_rank == (0, 1) for g in got)
    assert all(g.planning_ms["total"] > 0 for g in got)


def corrupt(data: bytes) -> bytes:
    """One flipped bit in the middle of the compressed plan (a bit error on the way)."""
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x10
    return bytes(flipped)


def plan_corrupting(pair, at_iteration, plan_fn, iteration, lengths):
    """`plan_fn`'s plans, with the bytes of (dp, pp) `pair` corrupted at `at_iteration`."""
    planned = plan_fn(iteration, lengths)
    if iteration != at_iteration:
        return planned
    plan_bytes = dict(planned.plan_bytes)
    plan_bytes[pair] = corrupt(plan_bytes[pair])
    return dataclasses.replace(planned, plan_bytes=plan_bytes)


def test_a_corrupted_plan_is_refused_not_run():
    from dynapipe_ext.plan.iteration_planner import iteration_plan_fn
    plan_fn = functools.partial(plan_corrupting, (0, 0), 1,
                                iteration_plan_fn(small_planner_config()))
    planner = PlanAhead(plan_fn, gpt_lengths, num_workers=0)
    with PlanDelivery(None, 0, 1, 0, 0, 1, 2, planner=planner).start(0) as leader:
        assert leader.fetch(0).plan.iteration == 0
        with pytest.raises(PlanDeliveryError, match=r"rank 0 \(dp 0, pp 0\): the plan of "
                                                    r"iteration 1 is corrupt \(checksum "
                                                    r"mismatch.*refusing to run it"):
            leader.fetch(1)


# ---------------------------------------------------------------------------- gloo worlds

def _plans_and_planning_error(rank, world_size, coords, max_outstanding):
    """Fake plans on a dp 2 x pp 2 grid; planning fails at iteration 4."""
    init_world()
    dp_rank, pp_rank = coords[rank]
    planner = None
    if rank == 0:
        planner = PlanAhead(functools.partial(fake_plan, fail_at=4), fake_lengths,
                            num_workers=0)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    received, timings = [], []
    with PlanDelivery(group, rank, world_size, dp_rank, pp_rank, 2, 2, planner=planner,
                      decode=bytes, timeout_s=60,
                      max_outstanding=max_outstanding).start(0) as delivery:
        for it in range(6):
            try:
                delivered = delivery.fetch(it)
            except PlanningFailed as exc:
                received.append(str(exc))
                break
            received.append(delivered.plan)
            timings.append(delivered.planning_ms)
            dist.barrier()  # one "training step"
    dist.barrier()
    return received, timings


@pytest.mark.slow
def test_every_rank_gets_its_own_plan_and_the_planning_error():
    # ranks 2 and 3 are two TP ranks of the same (dp 1, pp 1): each gets its own copy
    coords = [(0, 0), (0, 1), (1, 1), (1, 1)]
    results = run_in_processes(_plans_and_planning_error, 4, args=(coords, 2), timeout_s=180)
    for rank, (received, timings) in enumerate(results):
        d, p = coords[rank]
        assert received[:4] == [expected_bytes(it, d, p) for it in range(4)], rank
        assert len(received) == 5
        assert "memory limit exceeded by a micro-batch of iteration 4" in received[4]
        if rank == 0:
            assert all(t["split"] == 1.0 and t["worker_total"] >= 0 for t in timings)
        else:
            assert "planning of iteration 4 failed on the planning leader" in received[4]
            assert timings == [None] * 4


def _a_reader_stalls(rank, world_size):
    """Rank 2 never reads. The leader, allowed one iteration in flight, stops at iteration 1
    naming rank 2 (after 3 s); rank 1, which reads, gets no plan for iteration 1 and says so
    (after 1 s: a gloo timeout closes all the group's connections of the rank it fires on,
    so the reader's must come first for both messages to show)."""
    init_world()
    planner = PlanAhead(functools.partial(fake_plan, dp_size=1), fake_lengths,
                        num_workers=0) if rank == 0 else None
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    delivery = PlanDelivery(group, rank, world_size, 0, min(rank, 1), 1, 2, planner=planner,
                            decode=bytes, timeout_s=3.0 if rank == 0 else 1.0,
                            max_outstanding=1).start(0)
    outcome = []
    if rank < 2:
        outcome.append(delivery.fetch(0).plan)
        start = time.monotonic()
        try:
            delivery.fetch(1)
        except PlanDeliveryTimeout as exc:
            outcome += [str(exc), time.monotonic() - start]
    delivery.close()
    dist.barrier()   # rank 0 stays up until rank 1 has timed out
    return outcome


@pytest.mark.slow
def test_a_stalled_reader_or_leader_is_a_timeout_naming_rank_and_iteration():
    leader, reader, idle = run_in_processes(_a_reader_stalls, 3, timeout_s=120)
    assert leader[0] == expected_bytes(0, 0, 0) and reader[0] == expected_bytes(0, 0, 1)
    assert "planning leader: rank 2 did not take its plan of iteration 0 within 3 s" in leader[1]
    assert "rank 1 (dp 0, pp 1) got no plan for iteration 1 from the planning leader " \
           "(rank 0) within 1 s" in reader[1]
    assert leader[2] < 10 and reader[2] < 10
    assert idle == []


def _corrupt_then_dead_leader(rank, world_size):
    """Iteration 1's plan of rank 1 is corrupted on the way; then the leader dies."""
    from dynapipe_ext.plan.iteration_planner import iteration_plan_fn
    init_world()
    planner = None
    if rank == 0:
        plan_fn = functools.partial(plan_corrupting, (0, 1), 1,
                                    iteration_plan_fn(small_planner_config()))
        planner = PlanAhead(plan_fn, gpt_lengths, num_workers=0)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    delivery = PlanDelivery(group, rank, world_size, 0, rank, 1, 2, planner=planner,
                            timeout_s=60).start(0)
    outcome = [delivery.fetch(0).plan.pp_rank]
    try:
        outcome.append(delivery.fetch(1).plan.pp_rank)
    except PlanDeliveryError as exc:
        outcome.append(str(exc))
    dist.barrier()
    if rank == 0:
        os._exit(0)   # the leader dies without a word
    start = time.monotonic()
    try:
        delivery.fetch(2)
    except PlanDeliveryError as exc:
        outcome += [str(exc), time.monotonic() - start]
    return outcome


@pytest.mark.slow
def test_a_corrupted_plan_is_refused_and_a_dead_leader_is_an_error():
    _, reader = run_in_processes(_corrupt_then_dead_leader, 2, timeout_s=120, may_die=(0,))
    assert reader[0] == 1
    assert "rank 1 (dp 0, pp 1): the plan of iteration 1 is corrupt (checksum mismatch" \
           in reader[1] and "refusing to run it" in reader[1]
    assert "rank 1 (dp 0, pp 1) lost the planning leader (rank 0) while waiting for the plan " \
           "of iteration 2" in reader[2]
    assert reader[3] < 20   # at once, not after the 60 s timeout


# ---------------------------------------------------------------------------- another process

def _ip(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (/proc, Linux)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:   # state LISTEN
                addr, port = fields[1].split(":")
                found.add((_ip(addr), int(port, 16)))
    return found


def _attacked_rank(rank, world_size, sync_dir, iterations):
    """Real plans on PP=2 (ranks 1 and 2: two TP ranks of pp 1). Half-way, with the leader's
    plan of that iteration sent and not yet received, every rank waits while another process
    attacks; then each rank checks every plan it got against the planner's own."""
    from dynapipe_ext.plan.iteration_planner import iteration_plan_fn
    from dynapipe_ext.plan.serialization import plan_from_bytes
    init_world()
    before = listening_sockets(os.getpid())
    config = small_planner_config()
    pp_rank = min(rank, 1)
    delivery = start_plan_delivery(config, gpt_lengths, rank, world_size, 0, pp_rank, 0,
                                   iterations, num_workers=0, timeout_s=60)
    after = listening_sockets(os.getpid())
    plan_fn = iteration_plan_fn(config)
    halfway = iterations // 2
    same = []
    with delivery:
        for it in range(iterations):
            if rank == 0 or it != halfway:
                delivered = delivery.fetch(it)
            if it == halfway:
                with open(os.path.join(sync_dir, f"rank{rank}.json"), "w") as f:
                    json.dump({"pid": os.getpid(), "master_port": os.environ["MASTER_PORT"]}, f)
                deadline = time.monotonic() + 60
                while not os.path.exists(os.path.join(sync_dir, "attacked")):
                    assert time.monotonic() < deadline, "the attacker never finished"
                    time.sleep(0.05)
                if rank > 0:
                    delivered = delivery.fetch(it)
            expected = plan_from_bytes(plan_fn(it, gpt_lengths(it)).plan_bytes[(0, pp_rank)])
            same.append(delivered.plan == expected)
            dist.barrier()
    return sorted(before), sorted(after), same


def attack(sync_dir, world_size, found: dict) -> None:
    """Another process on the machine goes for the plans of a running world."""
    from dynapipe_ext.plan.serialization import MAGIC
    deadline = time.monotonic() + 120
    while len([n for n in os.listdir(sync_dir) if n.startswith("rank")]) < world_size:
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    time.sleep(0.2)   # the last rank file is complete
    ranks = [json.load(open(os.path.join(sync_dir, f"rank{r}.json"))) for r in range(world_size)]
    port = int(ranks[0]["master_port"])
    try:
        # 1. the old plan store port
        try:
            socket.create_connection(("127.0.0.1", port + 1), timeout=5).close()
            found["old_plan_port"] = "connected"
        except ConnectionRefusedError:
            found["old_plan_port"] = "refused"
        # 2. what the ranks listen on, while they run
        found["listening"] = [sorted(listening_sockets(r["pid"])) for r in ranks]
        # 3. the rendezvous store (torch's own, MASTER_PORT): read everything, then write
        #    forged plans under every key the old plan store used
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        values = {key: store.get(key) for key in store.list_keys()}
        found["store_keys"] = sorted(values)
        found["plan_bytes_in_store"] = [k for k, v in values.items() if MAGIC in v]
        forged = corrupt(b"P" + MAGIC + bytes(64))
        for it in range(64):
            for pp in range(2):
                store.set(f"dynapipe/plan/{it}/0/{pp}", forged)
        # 4. garbage into every socket the ranks listen on
        for address, listen_port in {s for r in found["listening"] for s in map(tuple, r)}:
            host = "127.0.0.1" if address in ("0.0.0.0", "::") else address
            with socket.create_connection((host, listen_port), timeout=5) as conn:
                conn.sendall(os.urandom(256))
        found["done"] = True
    finally:
        open(os.path.join(sync_dir, "attacked"), "w").close()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")
def test_no_other_process_can_read_overwrite_or_tamper_with_the_plans(tmp_path):
    world_size, iterations = 3, 6
    found: dict = {}
    attacker = threading.Thread(target=attack, args=(str(tmp_path), world_size, found),
                                daemon=True)
    attacker.start()
    results = run_in_processes(_attacked_rank, world_size, args=(str(tmp_path), iterations),
                               timeout_s=240)
    attacker.join(30)
    assert found.get("done"), found
    port = int(json.load(open(tmp_path / "rank0.json"))["master_port"])
    # there is no plan port: nothing listens where the plan store was
    assert found["old_plan_port"] == "refused"
    wildcard = {"0.0.0.0", "::"}
    for rank, ((before, after, same), listening) in enumerate(zip(results, found["listening"])):
        # every plan a rank ran is the planner's own, the forged store values notwithstanding
        assert same == [True] * iterations, rank
        before, after = set(map(tuple, before)), set(map(tuple, after))
        listening = set(map(tuple, listening))
        # plan delivery adds only gloo's own listener of its group, bound like the listeners
        # of torch's other gloo groups, never on every interface
        added = after - before
        assert len(added) == 1, (rank, before, after)
        gloo_hosts = {a for a, p in before if a not in wildcard}
        assert {a for a, _ in added} <= gloo_hosts and not {a for a, _ in added} & wildcard
        # on every interface only torch's rendezvous store (rank 0 hosts it here)
        assert {(a, p) for a, p in listening if a in wildcard} <= {(a, port) for a in wildcard}
        assert all(p != port + 1 for _, p in listening)
    # the store never held a plan; plans travel over the group's connections only
    assert found["plan_bytes_in_store"] == []
