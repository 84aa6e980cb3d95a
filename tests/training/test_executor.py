"""Executor: a dispatch table; lowered plans run end to end on a numpy pipeline emulated in
threads with per-pair in-order channels, and give the gradients of a direct computation."""
import random
import threading

import numpy as np
import pytest

from dynapipe_ext.runtime.executor import INSTRUCTION_TYPES, Executor, InstructionError
from dynapipe_ext.plan.instructions import (Backward, Forward, FreeBuffer, LoadInput,
                                       RecvActivationFinish, RecvActivationStart, RecvGradFinish,
                                       RecvGradStart, SendActivationFinish, SendActivationStart,
                                       SendGradFinish, SendGradStart)
from dynapipe_ext.plan.lowering import lower
from dynapipe_ext.costs.model_spec import DEC_EMBEDDING, EMBEDDING, HEAD, stage_output_shapes
from dynapipe_ext.plan.plan_checker import check_plans
from dynapipe_ext.schedule.schedule_ir import interleaved_layout, wave_layout
from dynapipe_ext.plan.serialization import plan_from_bytes, plan_to_bytes
from tests.planning.test_lowering import gpt_spec, micro_batches, one_f_one_b, random_schedule, t5_spec

HIDDEN = 16
TIMEOUT_S = 20.0


# ---- the emulated model: stage s maps each tensor x_j to tanh(x_j @ W[s][j]) ----

def make_weights(num_stages, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.normal(0, 0.3, (HIDDEN, HIDDEN)) for _ in range(2)] for _ in range(num_stages)]


def make_inputs(mb_index, mb):
    """(encoder input, decoder input, labels) of one micro-batch, deterministic per index."""
    rng = np.random.default_rng(1000 + mb_index)
    enc = rng.normal(size=(mb.seq_len, mb.num_rows, HIDDEN))
    dec = rng.normal(size=(max(mb.dec_seq_len, 1), mb.num_rows, HIDDEN))
    labels = (rng.normal(size=enc.shape), rng.normal(size=dec.shape))
    return enc, dec, labels


def stage_forward(layers, weights, inputs, data):
    """Inputs of a stage -> (tensors it computes on, outputs)."""
    xs = list(inputs)
    if EMBEDDING in layers:
        xs = [data[0]]
    if DEC_EMBEDDING in layers:
        xs.append(data[1])
    ys = [np.tanh(x @ w) for x, w in zip(xs, weights)]
    return xs, ys


def stage_backward(layers, weights, xs, ys, grads_out, data):
    """-> (weight gradients per tensor, gradients of the inputs that came from stage s-1)."""
    if HEAD in layers:
        grads_out = data[2][:len(ys)]
        # loss = sum_j sum(y_j * label_j)
    dws, dxs = [], []
    for x, y, g, w in zip(xs, ys, grads_out, weights):
        dz = g * (1.0 - y * y)
        dws.append(x.reshape(-1, HIDDEN).T @ dz.reshape(-1, HIDDEN))
        dxs.append(dz @ w.T)
    if EMBEDDING in layers:
        dxs = []
    elif DEC_EMBEDDING in layers:
        dxs = dxs[:1]
    return dws, tuple(dxs)


def reference(spec, num_stages, mbs, weights):
    """Loss and weight gradients computed stage after stage, micro-batch after micro-batch."""
    layers = spec.stage_layers(num_stages)
    grads = [[np.zeros((HIDDEN, HIDDEN)) for _ in range(2)] for _ in range(num_stages)]
    loss = 0.0
    for m, mb in enumerate(mbs):
        data = make_inputs(m, mb)
        saved, inputs = [], ()
        for s in range(num_stages):
            xs, ys = stage_forward(layers[s], weights[s], inputs, data)
            saved.append((xs, ys))
            inputs = tuple(ys)
        loss += sum(float((y * lab).sum()) for y, lab in zip(ys, data[2]))
        g = None
        for s in reversed(range(num_stages)):
            xs, ys = saved[s]
            dws, g = stage_backward(layers[s], weights[s], xs, ys, g, data)
            for j, dw in enumerate(dws):
                grads[s][j] += dw
    return loss, grads


# ---- in-order point-to-point channels with rendezvous waits ----

class Channel:
    """Messages src -> dst matched in posting order; a send finish waits for the receive to be
    posted, a receive finish for the message to be sent."""

    def __init__(self):
        self.cond = threading.Condition()
        self.messages = []
        self.recvs_posted = 0

    def send(self, tensors) -> int:
        with self.cond:
            self.messages.append(tensors)
            self.cond.notify_all()
            return len(self.messages) - 1

    def post_recv(self) -> int:
        with self.cond:
            self.recvs_posted += 1
            self.cond.notify_all()
            return self.recvs_posted - 1

    def wait_sent(self, k):
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.messages) > k, TIMEOUT_S):
                raise TimeoutError(f"message #{k} never sent")
            return self.messages[k]

    def wait_posted(self, k):
        with self.cond:
            if not self.cond.wait_for(lambda: self.recvs_posted > k, TIMEOUT_S):
                raise TimeoutError(f"receive #{k} never posted")


class RankEmulator:
    """Handlers of one pipeline rank: compute keyed by (mb, stage), tensors in flight in
    buffers, transfers through Channels."""

    def __init__(self, rank, spec, num_stages, mbs, weights, channels):
        self.rank, self.mbs, self.weights, self.channels = rank, mbs, weights, channels
        self.layers = spec.stage_layers(num_stages)
        self.hidden = spec.hidden_size
        self.stage_to_rank = None
        self.data, self.saved, self.outputs, self.input_grads = {}, {}, {}, {}
        self.buffers = {}            # id -> tensors
        self.pending = {}            # id -> ticket in its channel
        self.recv_act, self.recv_grad = {}, {}   # (mb, stage) -> buffer id
        self.grads = {}
        self.loss = 0.0

    def handlers(self):
        return {LoadInput: self.load, Forward: self.forward, Backward: self.backward,
                SendActivationStart: self.send_start, SendGradStart: self.send_start,
                SendActivationFinish: self.send_finish, SendGradFinish: self.send_finish,
                RecvActivationStart: self.recv_start, RecvGradStart: self.recv_start,
                RecvActivationFinish: self.recv_finish, RecvGradFinish: self.recv_finish,
                FreeBuffer: self.free}

    def load(self, ins):
        self.data[ins.mb] = make_inputs(ins.mb, self.mbs[ins.mb])

    def inputs_of(self, mb, s):
        if s == 0:
            return ()
        if self.stage_to_rank[s - 1] == self.rank:
            return tuple(self.outputs[(mb, s - 1)])
        return self.buffers[self.recv_act[(mb, s)]]     # KeyError if freed too early

    def forward(self, ins):
        mb, s = ins.mb, ins.stage
        needs_data = any(k in self.layers[s] for k in (EMBEDDING, DEC_EMBEDDING, HEAD))
        data = self.data[mb] if needs_data else None
        xs, ys = stage_forward(self.layers[s], self.weights[s], self.inputs_of(mb, s), data)
        self.saved[(mb, s)] = (xs, ys)
        self.outputs[(mb, s)] = ys
        if HEAD in self.layers[s]:
            self.loss += sum(float((y * lab).sum()) for y, lab in zip(ys, data[2]))

    def backward(self, ins):
        mb, s = ins.mb, ins.stage
        xs, ys = self.saved.pop((mb, s))
        self.inputs_of(mb, s)                            # the received input must still live
        if HEAD in self.layers[s]:
            g = None
        elif self.stage_to_rank[s + 1] == self.rank:
            g = self.input_grads.pop((mb, s + 1))
        else:
            g = self.buffers[self.recv_grad[(mb, s)]]
        dws, dxs = stage_backward(self.layers[s], self.weights[s], xs, ys, g, self.data.get(mb))
        for j, dw in enumerate(dws):
            self.grads[(s, j)] = self.grads.get((s, j), 0.0) + dw
        self.input_grads[(mb, s)] = dxs

    def expected_shapes(self, ins, sending_activation):
        mb = self.mbs[ins.mb]
        stage = ins.stage if sending_activation else ins.stage - 1
        return stage_output_shapes(self.layers[stage], mb.num_rows, mb.seq_len,
                                   mb.dec_seq_len, self.hidden)

    def send_start(self, ins):
        is_act = type(ins) is SendActivationStart
        tensors = tuple(self.outputs[(ins.mb, ins.stage)] if is_act
                        else self.input_grads[(ins.mb, ins.stage)])
        assert tuple(t.shape for t in tensors) == tuple(ins.shapes), (tensors, ins)
        assert ins.buffer not in self.buffers, f"buffer {ins.buffer} overwritten while live"
        self.buffers[ins.buffer] = tensors
        self.pending[ins.buffer] = self.channels[(self.rank, ins.peer)].send(tensors)

    def send_finish(self, ins):
        self.channels[(self.rank, ins.peer)].wait_posted(self.pending.pop(ins.buffer))

    def recv_start(self, ins):
        assert ins.buffer not in self.buffers, f"buffer {ins.buffer} overwritten while live"
        self.buffers[ins.buffer] = None
        self.pending[ins.buffer] = self.channels[(ins.peer, self.rank)].post_recv()

    def recv_finish(self, ins):
        tensors = self.channels[(ins.peer, self.rank)].wait_sent(self.pending.pop(ins.buffer))
        if tuple(t.shape for t in tensors) != tuple(ins.shapes):
            raise ValueError(f"received shapes {[t.shape for t in tensors]}, plan says "
                             f"{ins.shapes}")
        self.buffers[ins.buffer] = tensors
        table = self.recv_act if type(ins) is RecvActivationFinish else self.recv_grad
        table[(ins.mb, ins.stage)] = ins.buffer

    def free(self, ins):
        del self.buffers[ins.buffer]


def run_pipeline(plans, spec, mbs, weights, record_times=False):
    """Run every rank's plan in its own thread; return emulators and per-rank records."""
    num_ranks = len(plans)
    channels = {(a, b): Channel() for a in range(num_ranks) for b in range(num_ranks) if a != b}
    emus = [RankEmulator(r, spec, len(plans[0].stage_to_rank), mbs, weights, channels)
            for r in range(num_ranks)]
    records, errors = [None] * num_ranks, []

    def work(r):
        emus[r].stage_to_rank = plans[r].stage_to_rank
        try:
            records[r] = Executor(emus[r].handlers()).run(plans[r], record_times)
        except Exception as exc:     # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return emus, records


def assert_matches_reference(emus, spec, num_stages, mbs, weights):
    loss, grads = reference(spec, num_stages, mbs, weights)
    assert sum(e.loss for e in emus) == pytest.approx(loss, rel=1e-12)
    got = {}
    for e in emus:
        assert not e.buffers, f"rank {e.rank} leaked buffers {sorted(e.buffers)}"
        assert not e.saved, f"rank {e.rank} kept activations {sorted(e.saved)}"
        got.update(e.grads)
    layers = spec.stage_layers(num_stages)
    for s in range(num_stages):
        tensors = 2 if DEC_EMBEDDING in layers[s] or any(
            DEC_EMBEDDING in layers[t] for t in range(s)) else 1
        for j in range(tensors):
            np.testing.assert_allclose(got[(s, j)], grads[s][j], rtol=1e-10, atol=1e-12)


# ---- tests ----

@pytest.mark.parametrize("model, layout_name, num_ranks, num_mbs", [
    ("gpt", "linear", 4, 6),
    ("t5", "linear", 4, 5),
    ("gpt", "interleaved", 3, 5),
    ("t5", "wave", 2, 4),
    ("gpt", "wave", 3, 7),
])
def test_lowered_plans_reproduce_direct_gradients(model, layout_name, num_ranks, num_mbs):
    rng = random.Random(num_ranks * 100 + num_mbs)
    layout = {"linear": tuple(range(num_ranks)), "interleaved": interleaved_layout(num_ranks, 2),
              "wave": wave_layout(num_ranks, 1)}[layout_name]
    num_stages = len(layout)
    spec = (gpt_spec if model == "gpt" else t5_spec)(num_stages)
    mbs = micro_batches(num_mbs, rng, t5=model == "t5")
    sched = (one_f_one_b(num_ranks, num_mbs) if layout_name == "linear"
             else random_schedule(layout, num_mbs, rng))
    plans = lower(sched, mbs, spec)
    check_plans(plans, spec)
    plans = [plan_from_bytes(plan_to_bytes(p)) for p in plans]   # as the ranks receive them
    weights = make_weights(num_stages)
    emus, _ = run_pipeline(plans, spec, mbs, weights)
    assert_matches_reference(emus, spec, num_stages, mbs, weights)


@pytest.mark.parametrize("kind", ["1f1b", "adaptive", "wave", "interleaved", "hanayo"])
def test_planner_schedules_run_end_to_end(kind):
    from dynapipe_ext.plan.lowering import action_ms_from_costs
    from tests.planning.test_lowering import real_schedule
    rng = random.Random(7)
    mbs = micro_batches(6, rng)
    sched, costs = real_schedule(kind, 3, mbs, rng)
    spec = gpt_spec(sched.num_stages)
    plans = lower(sched, mbs, spec, action_ms=action_ms_from_costs(costs))
    weights = make_weights(sched.num_stages)
    emus, _ = run_pipeline(plans, spec, mbs, weights)
    assert_matches_reference(emus, spec, sched.num_stages, mbs, weights)


def test_recorded_times_cover_every_instruction_in_order():
    mbs = micro_batches(3, random.Random(1))
    spec = gpt_spec(2)
    plans = lower(one_f_one_b(2, 3), mbs, spec)
    _, records = run_pipeline(plans, spec, mbs, make_weights(2), record_times=True)
    for plan, rec in zip(plans, records):
        assert [r[0] for r in rec] == list(plan.instructions)
        assert all(start <= end for _, start, end in rec)
        assert all(a[2] <= b[1] for a, b in zip(rec, rec[1:]))


def all_handlers(calls):
    return {t: (lambda ins, t=t: calls.append(ins)) for t in INSTRUCTION_TYPES}


def test_constructor_names_missing_handlers():
    handlers = all_handlers([])
    del handlers[RecvGradFinish], handlers[FreeBuffer]
    with pytest.raises(ValueError, match="RecvGradFinish, FreeBuffer"):
        Executor(handlers)
    with pytest.raises(ValueError, match="not callable"):
        Executor({**all_handlers([]), Forward: "forward"})


def test_instructions_are_dispatched_in_plan_order_without_records():
    calls = []
    plan = lower(one_f_one_b(1, 2), micro_batches(2, random.Random(0)), gpt_spec(1))[0]
    assert Executor(all_handlers(calls)).run(plan) == []
    assert calls == list(plan.instructions)


def test_handler_failure_names_rank_index_and_instruction():
    plans = lower(one_f_one_b(2, 2), micro_batches(2, random.Random(0)), gpt_spec(2))
    calls = []

    def broken_backward(ins):
        raise RuntimeError("out of memory")

    executor = Executor({**all_handlers(calls), Backward: broken_backward})
    with pytest.raises(InstructionError) as info:
        executor.run(plans[1])
    err = info.value
    index = next(i for i, ins in enumerate(plans[1].instructions) if type(ins) is Backward)
    assert (err.rank, err.index, err.instruction) == (1, index, plans[1].instructions[index])
    assert f"rank 1, instruction {index} (Backward(mb=0, stage=1))" in str(err)
    assert "RuntimeError: out of memory" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    assert len(calls) == index


def test_a_rank_waiting_for_a_dead_peer_times_out_with_a_clear_error():
    mbs = micro_batches(2, random.Random(0))
    spec = gpt_spec(2)
    plans = lower(one_f_one_b(2, 2), mbs, spec)
    channels = {(0, 1): Channel(), (1, 0): Channel()}
    emu = RankEmulator(1, spec, 2, mbs, make_weights(2), channels)
    emu.stage_to_rank = plans[1].stage_to_rank
    global TIMEOUT_S
    saved, TIMEOUT_S = TIMEOUT_S, 0.05
    try:
        with pytest.raises(InstructionError, match=r"rank 1, instruction \d+ "
                                                   r"\(RecvActivationFinish.*TimeoutError"):
            Executor(emu.handlers()).run(plans[1])      # rank 0 never runs
    finally:
        TIMEOUT_S = saved


# ---- timelines of recorded and simulated runs ----

def test_recorded_times_become_a_chrome_trace_with_every_compute():
    import json
    from dynapipe_ext.plan.trace import chrome_trace, events_from_records
    mbs = micro_batches(3, random.Random(2))
    spec = gpt_spec(2)
    plans = lower(one_f_one_b(2, 3), mbs, spec)
    _, records = run_pipeline(plans, spec, mbs, make_weights(2), record_times=True)
    t0 = min(rec[0][1] for rec in records)
    events = [e for p, rec in zip(plans, records) for e in events_from_records(p, rec, t0)]
    trace = json.loads(json.dumps(chrome_trace(events)))
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    computes = {(e["tid"], e["name"]) for e in boxes if e["cat"] == "compute"}
    assert computes == {(p.pp_rank, f"{i.stage}{'F' if type(i) is Forward else 'B'}{i.mb}")
                        for p in plans for i in p.instructions if type(i) in (Forward, Backward)}
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in boxes)
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"} == \
        {"rank 0", "rank 1"}


def test_plot_schedule_tool_writes_a_png_and_a_trace_of_the_simulated_plan(tmp_path):
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "tools"))
    import plot_schedule
    png, trace = tmp_path / "plan.png", tmp_path / "plan.json"
    assert plot_schedule.main(["--schedule", "wave", "--num-stages", "2", "--num-micro-batches",
                               "4", "--seed", "3", "--out-png", str(png),
                               "--out-trace", str(trace)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    computes = [e for e in events if e.get("cat") == "compute"]
    assert len(computes) == 2 * 4 * 4          # F and B of 4 micro-batches on 2*W*P stages
    assert any(e.get("cat") == "comm" for e in events)
    png2 = tmp_path / "measured.png"
    assert plot_schedule.main(["--schedule", "1f1b", "--num-stages", "2", "--num-micro-batches",
                               "3", "--emulate", "--time-scale", "0.001",
                               "--out-png", str(png2)]) == 0
    assert png2.stat().st_size > 1000


# ---- the Megatron runtime behind the handlers: no host stalls, only the tensors it needs ----

def _runtime_case(model, num_stages, pp_rank=0):
    """Stages of `pp_rank` for a 2-micro-batch plan in one process, and the plan's pieces."""
    import torch

    from dynapipe_ext.batching.microbatch import MicroBatch
    from dynapipe_ext.costs.model_spec import ModelSpec
    from dynapipe_ext.schedule.schedules import one_f_one_b as schedule_1f1b
    from megatron.model.init_weights import initialize_stage_weights
    from megatron.model.stages import build_rank_stages, build_transformer_config
    torch.set_num_threads(1)
    spec = ModelSpec(model, 2, 32, 4, 64, num_decoder_layers=2 if model == "t5" else 0,
                     max_position_embeddings=64)
    rng = np.random.default_rng(3)
    samples = {}
    for i in range(5):
        n = int(rng.integers(3, 12))
        samples[i] = ((rng.integers(1, 60, n), rng.integers(1, 60, n), np.ones(n, np.float32))
                      if model == "gpt" else
                      (rng.integers(1, 60, n), rng.integers(1, 60, 4), rng.integers(1, 60, 4),
                       np.ones(4, np.float32)))
    mbs = [MicroBatch(rows=((0,), (1,)), seq_len=12, dec_seq_len=4 if model == "t5" else 0),
           MicroBatch(rows=((2, 3), (4,)), seq_len=24, dec_seq_len=8 if model == "t5" else 0)]
    schedule = schedule_1f1b(len(mbs), 1)
    stages = build_rank_stages(spec, tuple(range(num_stages)) if num_stages > 1 else (0,),
                               pp_rank, build_transformer_config(spec))
    initialize_stage_weights(stages, 4)
    return spec, samples, mbs, schedule, stages


@pytest.fixture(scope="module")
def megatron_world():
    from tests.multiproc import single_process_world
    with single_process_world(seed=9):
        yield


def test_head_stage_runs_without_device_syncs_and_builds_batches_ahead(megatron_world,
                                                                       monkeypatch):
    import torch

    from megatron.model.batch_tensors import build_micro_batch, count_loss_tokens
    from megatron.training.handlers import global_mean_loss, make_handlers, micro_batch_order
    spec, samples, mbs, schedule, stages = _runtime_case("gpt", 1)
    plan = lower(schedule, mbs, spec)[0]
    built = []

    def provider(mb):
        built.append((mb, threading.current_thread() is threading.main_thread()))
        return build_micro_batch(mbs[mb], samples, "gpt", 0)

    tokens = count_loss_tokens(samples, list(samples))
    table = make_handlers(stages, provider, global_loss_tokens=tokens)
    syncs = []
    for name in ("item", "cpu", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            syncs.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    table.runtime.reset(provider, tokens, micro_batch_order(plan))
    Executor(table).run(plan)
    table.runtime.check_drained()
    assert syncs == [], syncs                # the head stage never waits for the device
    monkeypatch.undo()
    assert isinstance(table.runtime.loss_sum, torch.Tensor)
    # built once each, in plan order, on the background thread
    assert built == [(0, False), (1, False)]
    loss, counted_tokens = global_mean_loss(table.runtime)
    assert counted_tokens == tokens and np.isfinite(loss)
    table.runtime.close()


@pytest.mark.parametrize("model,pp_rank,expected", [
    ("gpt", 0, ("tokens", "position_ids", "segments")),
    ("gpt", 1, ("segments", "labels", "loss_mask")),
    ("t5", 0, ("enc_tokens", "enc_position_ids", "enc_segments")),
    ("t5", 1, ("dec_tokens", "dec_position_ids", "enc_segments", "dec_segments", "labels",
               "loss_mask")),
])
def test_each_rank_gets_only_the_tensors_its_stages_read(megatron_world, model, pp_rank,
                                                         expected):
    from megatron.model.batch_tensors import build_micro_batch
    from megatron.training.handlers import PipelineRuntime
    _, samples, mbs, _, stages = _runtime_case(model, 2, pp_rank)
    runtime = PipelineRuntime(stages, lambda mb: build_micro_batch(mbs[mb], samples, model, 0))
    assert runtime.batch_keys == expected
    runtime.reset(runtime.batch_provider, 1, [0])
    assert tuple(runtime._batch(0)) == expected
    runtime.close()
