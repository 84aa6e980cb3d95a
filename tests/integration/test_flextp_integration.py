"""FlexTP in the main trainer (pretrain_gpt.py --tp-balance): TP=2 x PP=2 on gloo with dynamic
micro-batches. Migration (a forced uneven start, then moves with Adam state) trains exactly like
even TP; resizing keeps every all-reduce at the layer's hidden shape."""
import math

import pytest

from megatron.training.arguments import ConfigError, parse_args
from tests.multiproc import run_in_processes
from tests.training.test_training import sp_dataset  # noqa: F401

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--ffn-hidden-size", "128", "--seq-length", "128", "--tokens-per-global-batch",
         "1024", "--lr", "5e-3", "--lr-decay-style", "constant", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--num-planner-workers", "0", "--micro-batching",
         "dynamic", "--distributed-timeout-minutes", "1", "--tensor-model-parallel-size", "2"]
LAYOUT = MODEL + ["--pipeline-model-parallel-size", "2"]


def _train(rank, world, argv):
    """Train; per rank: losses, the balancer's records, the all-reduce shapes (input rows,
    reduced tensor) of the slot linears, and the slot parameters' shapes."""
    from megatron.flextp.layers import COMM
    from megatron.training.training import build_run, train
    COMM["shapes"] = []
    run = build_run(parse_args("gpt", argv, has_cuda=False), verbose=False)
    stats = train(run)
    flex = run.flextp
    return {"losses": [s.loss for s in stats], "grad_norms": [s.grad_norm for s in stats],
            "history": flex.history if flex else None,
            "shapes": COMM["shapes"],
            "param_shapes": {n: tuple(p.shape) for m in run.modules
                             for n, p in m.named_parameters()}}


def _even_and_uneven_start(argv, world: int):
    """Per rank results of the even TP run and of migrate started from the partition for
    speeds 1 : 0.5 (TP rank 0: 3 of 4 heads, 22 of 32 MLP units), balancing every 3 steps."""
    even = run_in_processes(_train, world, (argv,), timeout_s=400)
    flex = run_in_processes(_train, world, (argv + ["--tp-balance", "migrate", "--flextp-interval",
                                                    "3", "--flextp-initial-speeds", "1,0.5"],),
                            timeout_s=400)
    return even, flex


@pytest.mark.slow
def test_migrate_from_a_forced_uneven_partition_trains_like_even_tp(sp_dataset):  # noqa: F811
    even, flex = _even_and_uneven_start(sp_dataset + LAYOUT + ["--train-iters", "6"], 4)
    losses = even[0]["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    for r in flex:
        assert r["losses"] == pytest.approx(losses, rel=2e-5, abs=2e-5)
    # TP rank 0 of each stage (ranks 0 and 2) started with 3 of 4 heads and 22 of 32 MLP units,
    # then, with no straggler measured, migrated back to even after 3 optimizer steps (Adam
    # moments on the move); TP rank 1 agrees on every decision
    for r in flex:
        first, third = r["history"][0], r["history"][2]
        assert first["counts"] == {"attn": [3, 1], "mlp": [22, 10]}
        assert third["action"] == {"attn": "migrate", "mlp": "migrate"}
        assert third["counts"] == {"attn": [2, 2], "mlp": [16, 16]}
        assert r["history"][-1]["counts"] == third["counts"]
    # the output head's forward is timed on the last stage's ranks (2 and 3) only, each TP
    # rank's own figure shared with the stage
    for rank, r in enumerate(flex):
        heads = [h["heads"] for h in r["history"]]
        assert all(all(x > 0 for x in h) if rank >= 2 else h == [0.0, 0.0] for h in heads), heads
    # slot parameters at the default --tp-balance-max-share 1.5: capacity 3 heads (3 x 3 x 8
    # qkv rows) and 24 MLP units (24 x 4 columns)
    shapes = flex[0]["param_shapes"]
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == (72, 32)
    assert shapes["decoder.layers.0.mlp.linear_fc2.weight"] == (32, 96)


@pytest.mark.slow
def test_resize_skips_straggler_units_and_keeps_collective_shapes(sp_dataset,  # noqa: F811
                                                                  monkeypatch):
    monkeypatch.setenv("FLEXTP_SLOWDOWN", "1:20")
    monkeypatch.setenv("FLEXTP_CLOCK", "modelled")   # the same figures on a loaded machine
    argv = sp_dataset + LAYOUT + ["--train-iters", "9", "--tp-balance", "resize",
                                  "--flextp-interval", "1", "--flextp-patience", "2"]
    ranks = run_in_processes(_train, 4, (argv,), timeout_s=400)
    for rank, r in enumerate(ranks):
        assert all(math.isfinite(x) for x in r["losses"])
        history = r["history"]
        # TP rank 1 (ranks 1 and 3) computes 20x slower: after the 3 warm-up iterations, 2 in
        # a row (the patience) make it a straggler at the 5th, and it stays one
        assert [h["stragglers"] for h in history] == [[]] * 4 + [[1]] * 5, history
        assert history[-1]["counts"] == {"attn": [2, 2], "mlp": [16, 16]}      # nothing moved
        resized = [i for i, h in enumerate(history)
                   if h["action"] and h["action"]["mlp"] == "resize"]
        assert resized and resized[0] == 4, history
        # the straggler skips 6 of its 16 MLP units (the bound, 0.375, rounded down) and none
        # of its 2 heads (0.375 of 2 rounds down to 0); the fast rank skips nothing
        assert history[resized[0]]["drops"] == ({"attn": [0], "mlp": [6]} if rank % 2 == 1
                                                else {"attn": [0], "mlp": [0]})
        # from the next iteration on, rank 1 computes less: of its 16 MLP units of 4 x 2
        # columns x hidden 32 (256 MACs per token) and 2 heads of (3 x 8 + 8) x 32 MACs, it
        # skips 6 units: 4608 against the fast rank's 6144 MACs per token, which both TP ranks
        # see (the work figure of the deciding iteration itself is the one before the skips)
        before, after = history[resized[0]]["work"], history[resized[0] + 1]["work"]
        assert before[1] == before[0]
        assert after[1] / after[0] == pytest.approx(4608 / 6144, rel=1e-12)
        # every all-reduce of a slot linear has the layer's [s, b] rows and the hidden size
        assert r["shapes"] and all(red == rows + (32,) for rows, red in r["shapes"])
    # the collectives agree: both TP ranks of a stage reduced the same shapes in the same order
    assert ranks[0]["shapes"] == ranks[1]["shapes"] and ranks[2]["shapes"] == ranks[3]["shapes"]


@pytest.mark.parametrize("extra, message", [
    (["--tp-balance", "migrate"], "needs --tensor-model-parallel-size >= 2"),
    (["--tp-balance", "resize", "--tensor-model-parallel-size", "2",
      "--flextp-initial-speeds", "1,0.5"], "needs --tp-balance migrate or semi"),
    (["--tp-balance", "migrate", "--tensor-model-parallel-size", "2",
      "--flextp-initial-speeds", "1,0,2"], "need 2 positive numbers"),
])
def test_bad_flextp_flags_are_clear_errors(extra, message):
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--train-iters", "1", "--data-path", "x", *extra]
    with pytest.raises(ConfigError, match=message):
        from megatron.training.arguments import build_parser, config_from_args
        config_from_args("gpt", build_parser("gpt").parse_args(argv), has_cuda=False)


@pytest.mark.slow
def test_straggler_migration_with_data_parallel_trains_like_even_tp(sp_dataset,  # noqa: F811
                                                                    monkeypatch):
    """TP=2 x DP=2: the switch slows TP rank 1 of both replicas; migrate moves units (and
    their Adam moments) to TP rank 0 mid-run, both replicas alike, and the losses stay those
    of even TP. semi takes its decisions alike on every rank too."""
    argv = sp_dataset + MODEL + ["--train-iters", "8"]
    even = run_in_processes(_train, 4, (argv,), timeout_s=400)
    monkeypatch.setenv("FLEXTP_SLOWDOWN", "1:20")
    monkeypatch.setenv("FLEXTP_CLOCK", "modelled")   # the same figures on a loaded machine
    balance = ["--flextp-interval", "2", "--flextp-patience", "2"]
    flex = run_in_processes(_train, 4, (argv + ["--tp-balance", "migrate", *balance],),
                            timeout_s=400)
    for r in flex:
        assert r["losses"] == pytest.approx(even[0]["losses"], rel=2e-5, abs=2e-5)
        moved = [h for h in r["history"] if h["action"] and h["action"]["mlp"] == "migrate"]
        assert moved and moved[0]["iteration"] >= 3, r["history"]    # after optimizer steps
        counts = r["history"][-1]["counts"]
        assert counts["mlp"][0] > counts["mlp"][1] and counts["attn"][0] >= counts["attn"][1]
    assert all(r["history"] and [h["counts"] for h in r["history"]]
               == [h["counts"] for h in flex[0]["history"]] for r in flex)
    semi = run_in_processes(_train, 4, (argv + ["--tp-balance", "semi", *balance],),
                            timeout_s=400)
    assert all(math.isfinite(x) for x in semi[0]["losses"])
    decisions = [[(h["action"], h["counts"]) for h in r["history"]] for r in semi]
    assert all(d == decisions[0] for d in decisions)
    # at 20x the slot capacity (24 of 32 MLP units) clamps the migration, so semi migrates
    # and the straggler skips on top: 3 of its 8 units (the bound 0.375, rounded down)
    for rank, r in enumerate(semi):
        both = [h for h in r["history"]
                if h["action"] and h["action"]["mlp"] == "migrate+resize"]
        assert both, r["history"]
        assert both[0]["counts"]["mlp"] == [24, 8] and both[0]["skips"]["mlp"] == [0, 3]
        skipped = both[0]["drops"]["mlp"]       # per layer of this rank
        assert skipped and all(d == (3 if rank % 2 else 0) for d in skipped), skipped


def test_slot_capacity_ffn_units_and_stage_figures():
    import torch
    from megatron.flextp.stage_balance import default_ffn_unit, stage_figures
    from megatron.flextp.stage_layers import capacity
    # 1.5 x the even share by default, at most all units but one per other rank
    assert capacity(32, 2) == 24 and capacity(32, 4) == 12 and capacity(4, 2) == 3
    assert capacity(32, 2, 2.0) == 31 and capacity(32, 4, 2.0) == 16
    assert capacity(32, 2, 1.0) == 16 and capacity(6, 2, 1.2) == 3     # never below even
    assert default_ffn_unit(128, 2) == 4 and default_ffn_unit(96, 2) == 3
    assert default_ffn_unit(40, 2) == 2          # 10 units per rank where 16 do not divide
    # rows: (pp rank, tp rank, seconds, work, tokens, all-reduce seconds, head seconds);
    # pipeline rank 0 has two replicas
    table = torch.tensor([[0, 0, 1.0, 10.0, 5, 0.5, 0.0], [0, 1, 1.0, 10.0, 5, 0.1, 0.0],
                          [0, 0, 1.0, 10.0, 5, 0.6, 0.0], [0, 1, 4.0, 10.0, 5, 0.2, 0.0],
                          [1, 0, 9.0, 1.0, 5, 0.0, 0.3], [1, 1, 1.0, 1.0, 5, 3.0, 0.7]],
                         dtype=torch.float64)
    # per TP rank the slowest replica of this stage (its all-reduce and head seconds with
    # it); the other stage's figures stay out
    assert stage_figures(table, 0, 2) == ([1.0, 4.0], [10.0, 10.0], [0.5, 0.2], [0.0, 0.0])
    assert stage_figures(table, 1, 2) == ([9.0, 1.0], [1.0, 1.0], [0.0, 3.0], [0.3, 0.7])


def test_outside_seconds_only_for_stragglers_slowed_outside_the_pairs():
    from megatron.flextp.stage_balance import outside_seconds
    # a rank slowed only in its pairs: the healthy rank waits exactly the difference
    assert outside_seconds([1.0, 2.0], [1.5, 0.5], {1}) == (0.0, 0.0)
    # slowed as a whole: it also arrives 0.3 s later than its pair time says
    assert outside_seconds([1.0, 2.0], [1.8, 0.5], {1}) == pytest.approx((0.0, 0.3))
    # no straggler, or a straggler that looks faster outside: nothing
    assert outside_seconds([1.0, 2.0], [1.8, 0.5], set()) == (0.0, 0.0)
    assert outside_seconds([1.0, 2.0], [1.0, 0.5], {1}) == (0.0, 0.0)
    # the output head, timed on each rank: its difference counts on top of the spans
    assert outside_seconds([1.0, 2.0], [1.8, 0.5], {1}, [0.2, 0.5]) == pytest.approx((0.0, 0.6))
    assert outside_seconds([1.0, 2.0], [1.5, 0.5], {1}, [0.2, 0.2]) == (0.0, 0.0)


def test_validation_computes_every_unit_then_resizing_resumes():
    from types import SimpleNamespace
    from dynapipe_ext.flextp.partition import even_partition
    from megatron.flextp.stage_balance import StageBalancer
    from megatron.flextp.stage_layers import FlexPair
    pairs = {"mlp": [FlexPair("mlp", even_partition(8, 2), 1, 7, 4, 4, 16) for _ in range(2)],
             "attn": []}
    pairs["mlp"][0].set_drops((6,))
    layout = SimpleNamespace(tp=2, tp_rank=1, pp_rank=0, rank=1, world_size=2)
    balancer = StageBalancer(pairs, "resize", layout, group=None)
    with balancer.all_units():
        assert [p.drops for p in pairs["mlp"]] == [(), ()]
        assert pairs["mlp"][0].computed_slots() == [0, 1, 2, 3]
    assert [p.drops for p in pairs["mlp"]] == [(6,), ()]
    assert pairs["mlp"][0].computed_slots() == [0, 1, 3]


HIDDEN, UNIT, CAP = 8, 5, 3          # 3 slots of 5 columns; this rank uses 2 of 4 units


def _slot_pair(seed: int, imputes: bool = True, **timing):
    """An MLP FlexPair (rank 0 of 2, 4 units) with its slot linears on fresh parameters; the
    spare slot is empty, as convert_stages leaves it."""
    import torch
    from dynapipe_ext.flextp.partition import even_partition
    from megatron.flextp.stage_layers import FlexPair, SlotColumn, SlotRow
    torch.manual_seed(seed)
    pair = FlexPair("mlp", even_partition(4, 2), 0, CAP, UNIT, UNIT, HIDDEN, imputes=imputes,
                    **timing)
    col_w = torch.nn.Parameter(torch.randn(CAP * UNIT, HIDDEN))
    col_b = torch.nn.Parameter(torch.randn(CAP * UNIT))
    row_w = torch.nn.Parameter(torch.randn(HIDDEN, CAP * UNIT))
    with torch.no_grad():
        for t, axis in ((col_w, 0), (col_b, 0), (row_w, 1)):
            t.narrow(axis, 2 * UNIT, UNIT).zero_()
    pair.column = SlotColumn(pair, col_w, col_b, skip_bias_add=False)
    pair.row = SlotRow(pair, row_w, None, skip_bias_add=True)
    return pair, [col_w, col_b, row_w]


def _slot_forward(pair, x):
    import torch.nn.functional as F
    return pair.row(F.gelu(pair.column(x)[0]))[0]


def test_slot_gradients_go_straight_into_main_grad():
    """With a GradBuffer, a slot linear's weight gradient is added into the used slots of
    main_grad (no zero-padded full-size .grad): the sums equal plain autograd's over two
    micro-batches, one with a skipped unit (an index, not a slice), and the parameters count
    as arrived for the DP overlap."""
    import torch
    from megatron.training.grad_buffer import GradBuffer
    from tests.multiproc import single_process_world

    with single_process_world(7):
        plain, plain_params = _slot_pair(1)
        flex, flex_params = _slot_pair(1)
        buffer = GradBuffer({0: flex_params}, overlap=False)
        buffer.expect_backwards({0: 2})
        parts = []                             # which parameters took the direct path
        direct = buffer.accumulate_part
        buffer.accumulate_part = lambda param, *rest: (parts.append(param), direct(param, *rest))
        inputs = [torch.randn(4, 1, HIDDEN), torch.randn(3, 1, HIDDEN)]
        for k, x in enumerate(inputs):
            if k == 1:                         # skip unit 1: the computed slot is slot 0 only
                plain.set_drops((1,))
                flex.set_drops((1,))
            _slot_forward(plain, x).square().sum().backward()
            buffer.before_backward(0)
            _slot_forward(flex, x).square().sum().backward()
        for p, q in zip(plain_params, flex_params):
            assert q.grad is None
            assert torch.equal(q.main_grad, p.grad)
        assert torch.count_nonzero(flex_params[0].main_grad[2 * UNIT:]) == 0   # spare slot
        assert buffer.buckets[0].ready        # every parameter arrived in the last backward
        assert sorted(map(id, parts)) == sorted(map(id, flex_params * 2))


def test_imputation_is_recorded_by_training_forwards_where_units_may_be_skipped():
    """The row linear records each computed unit's token-mean contribution in training forwards
    (not in no-grad ones, e.g. validation, nor with imputes=False, migrate's setting) and adds
    a skipped unit's recorded value in its place."""
    import torch
    from tests.multiproc import single_process_world

    with single_process_world(7):
        x, other = torch.randn(4, 1, HIDDEN), torch.randn(4, 1, HIDDEN)
        pair, _ = _slot_pair(1)
        full = _slot_forward(pair, x)
        recorded = pair.contrib.clone()
        assert recorded[:2].abs().sum() > 0 and not recorded[2:].any()
        with torch.no_grad():
            _slot_forward(pair, other)
        assert torch.equal(pair.contrib, recorded)
        pair.set_drops((1,))                   # unit 1 (slot 1): its recorded value stands in
        with torch.no_grad():
            skipping = _slot_forward(pair, x)
        # the skipped unit's true contribution, per token, against its token mean
        assert torch.allclose(full.mean((0, 1)), skipping.mean((0, 1)), atol=1e-5)
        quiet, _ = _slot_pair(1, imputes=False)
        _slot_forward(quiet, x)
        assert not quiet.contrib.any()
        assert quiet.seconds > 0 and quiet.tokens == 4      # the timer saw the forward
        quiet.reset_timer()
        assert quiet.seconds == quiet.work == quiet.tokens == 0


def test_the_modelled_clock_reports_work_over_speed_and_redoes_no_gemm(monkeypatch):
    """FLEXTP_CLOCK=modelled: a pair's seconds are its work at 1 GMAC/s times the slow-down
    factor, exactly, whatever the machine's load; the switch then costs no compute (no GEMM
    is redone: the backward hook that would redo them is not there) and semi's link figure is
    the modelled one, with no collective."""
    import torch
    from megatron.flextp.stage_balance import measure_bandwidth
    from megatron.flextp.layers import MODELLED_BANDWIDTH, modelled_clock
    from tests.multiproc import single_process_world

    with single_process_world(3):
        x = torch.randn(5, 2, HIDDEN, requires_grad=True)
        slow, _ = _slot_pair(1, slowdown=3, modelled=True)
        out = slow.column(x)[0]
        assert not out._backward_hooks
        slow.row(torch.nn.functional.gelu(out))
        # 10 tokens x 2 computed units x (UNIT + UNIT) x HIDDEN MACs per unit and token
        assert slow.work == 10 * 2 * 2 * UNIT * HIDDEN
        assert slow.seconds == pytest.approx(slow.work * 3 * 1e-9, rel=1e-12)
        measured, _ = _slot_pair(1, slowdown=3)
        assert measured.column(x)[0]._backward_hooks    # the switch redoes GEMMs backward
    monkeypatch.setenv("FLEXTP_CLOCK", "modelled")
    assert modelled_clock() and measure_bandwidth(group=None) == MODELLED_BANDWIDTH
    assert not modelled_clock("") and not modelled_clock("measured")
    with pytest.raises(ValueError, match="FLEXTP_CLOCK='fast'"):
        modelled_clock("fast")


@pytest.mark.slow
def test_bf16_migration_from_an_uneven_start_trains_like_even_tp(sp_dataset):  # noqa: F811
    """--bf16 with FlexTP (TP=2): bf16 slot weights whose gradients reach fp32 main_grad
    through UsedSlots, a forced uneven start, then a migration back to even after 3 steps that
    carries fp32 main copies and Adam moments. The losses follow the even bf16 run's within
    1e-3 relative (measured: at most 8e-5 over the 6 iterations): the uneven split rounds
    different partial sums to bf16 before the all-reduce (2^-9 relative each), so the runs
    differ by roundings, not by a term."""
    even, flex = _even_and_uneven_start(sp_dataset + MODEL + ["--train-iters", "6", "--bf16"],
                                        2)
    losses = even[0]["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    for r in flex:
        assert r["losses"] == pytest.approx(losses, rel=1e-3)
        assert r["history"][0]["counts"] == {"attn": [3, 1], "mlp": [22, 10]}
        assert r["history"][-1]["counts"] == {"attn": [2, 2], "mlp": [16, 16]}


def test_a_pair_times_its_forward_all_reduce_apart_from_its_compute():
    import time

    import torch
    from dynapipe_ext.flextp.partition import even_partition
    from megatron.flextp.stage_layers import FlexPair

    def slow_reduce(t):
        time.sleep(0.02)
        return t * 2

    pair = FlexPair("mlp", even_partition(8, 2), 0, 6, 4, 4, 16)
    x = torch.ones(3, 16)
    pair.start(x)
    out = pair.synced(x, slow_reduce)
    assert torch.equal(out, 2 * x) and pair.sync_seconds >= 0.02
    assert pair.seconds == 0.0            # the all-reduce is not TP compute
    pair.reset_timer()
    assert pair.sync_seconds == 0.0
    modelled = FlexPair("mlp", even_partition(8, 2), 0, 6, 4, 4, 16, modelled=True)
    modelled.synced(x, slow_reduce)
    assert modelled.sync_seconds == 0.0   # modelled compute: no measured waits beside it
