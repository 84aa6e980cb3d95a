"""FlexTP across the main trainer's models and layouts (pretrain_gpt.py --tp-balance): a SwiGLU
MLP, or grouped-query attention with rotary positions and q/k/v biases, at an uneven partition
computes the loss and every gradient of even TP and of TP=1; --pipeline-split (half layers)
trains; T5 is refused in one line; the slot capacity follows --tp-balance-max-share
(allocation, clamping, the planner's memory model); resizing rotates the skipped units so every
unit keeps getting gradients."""
import math

import pytest

from megatron.training.arguments import ConfigError, build_parser, config_from_args
from tests.multiproc import run_in_processes
from tests.integration.test_flextp_checkpoint import UNEVEN, UNEVEN_COUNTS, full_state
from tests.integration.test_flextp_integration import LAYOUT, MODEL, _train
from tests.training.test_training import sp_dataset  # noqa: F401


def _gradients_close(got: dict, want: dict) -> None:
    """Every tensor within 1e-4 of the other's norm (fp32 sums in another order), or within
    1e-7 absolute where the gradient is rounding noise (a key bias: softmax ignores it)."""
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert (got[name] - t).norm() <= 1e-4 * t.norm() + 1e-7, name


# Layer options whose FlexTP units are more than one head / one ffn column group: flags, and
# the full (TP=1) shape of the tensor that shows them; together the options of Llama / Qwen2.
# gated MLP (--swiglu; --gated-gelu slots alike): fc1 = [gate; up], each half slotted.
# grouped-query attention: 8 heads in 4 query groups (head size 4), a unit is one group: its
# 2 heads' Q rows and its one K and V row block; linear_qkv has (8 + 2 x 4) x 4 rows, not 3 x 32;
# with rotary positions (each rank turns the heads it holds) and q/k/v biases (slotted alike).
LAYER_OPTIONS = {
    "gated-mlp": (["--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm"],
                  "decoder.layers.0.mlp.linear_fc1.weight", (2 * 128, 32)),
    "gqa": (["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups",
             "4", "--position-embedding-type", "rope", "--disable-bias-linear",
             "--add-qkv-bias"],
            "decoder.layers.0.self_attention.linear_qkv.weight", ((8 + 2 * 4) * 4, 32)),
}


@pytest.mark.slow
@pytest.mark.parametrize("option", sorted(LAYER_OPTIONS))
def test_uneven_equals_even_and_tp1_in_loss_and_every_gradient(sp_dataset, tmp_path,
                                                               option):  # noqa: F811
    """A gated MLP, or grouped-query attention: with --adam-beta1 0 the first step's first
    Adam moment is the gradient itself, which the layout-free checkpoint holds as full
    tensors; TP=1, even TP=2 and TP=2 at the uneven partition (3 of 4 attention units - heads,
    or query groups -, 22 of 32 MLP units on TP rank 0) agree in it for every parameter, and
    in the losses."""
    flags, name, full_shape = LAYER_OPTIONS[option]
    argv = sp_dataset + MODEL + flags + ["--train-iters", "2", "--adam-beta1", "0",
                                         "--clip-grad", "0", "--save-interval", "1"]
    runs = {"tp1": (1, ["--tensor-model-parallel-size", "1"]), "even": (2, []),
            "uneven": (2, UNEVEN)}
    out = {}
    for run, (world, extra) in runs.items():
        out[run] = run_in_processes(_train, world, (argv + extra + [
            "--save", str(tmp_path / run)],), timeout_s=400)
    for r in out["uneven"]:
        assert all(h["counts"] == UNEVEN_COUNTS for h in r["history"]), r["history"]
    losses = out["tp1"][0]["losses"]
    assert all(math.isfinite(x) for x in losses)
    for run in ("even", "uneven"):
        assert out[run][0]["losses"] == pytest.approx(losses, rel=1e-6)
    grads = {run: {k.removesuffix(" exp_avg"): v
                   for k, v in full_state(tmp_path / run, 1).items() if k.endswith("exp_avg")}
             for run in runs}
    assert any("linear_fc1" in k for k in grads["tp1"])
    assert grads["tp1"][name].shape == full_shape
    _gradients_close(grads["even"], grads["tp1"])
    _gradients_close(grads["uneven"], grads["tp1"])


@pytest.mark.slow
def test_tp_balance_trains_with_half_layer_pipeline_splits(sp_dataset):  # noqa: F811
    """TP=2 x PP=2, --pipeline-split 3,1 (stage 0: layer 0 and layer 1's attention; stage 1:
    layer 1's MLP): from the uneven partition, migrate trains like even TP with that split;
    --pipeline-split balanced with --tp-balance semi trains."""
    argv = sp_dataset + LAYOUT + ["--train-iters", "4"]
    even = run_in_processes(_train, 4, (argv + ["--pipeline-split", "3,1"],), timeout_s=400)
    flex = run_in_processes(_train, 4, (argv + ["--pipeline-split", "3,1"] + UNEVEN,),
                            timeout_s=400)
    losses = even[0]["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    for r in flex:
        assert r["losses"] == pytest.approx(losses, rel=2e-5, abs=2e-5)
    # stage 1 (ranks 2, 3) holds layer 1's MLP only: no attention pairs, MLP at the uneven split
    assert flex[2]["history"][0]["counts"] == {"mlp": UNEVEN_COUNTS["mlp"]}
    assert flex[0]["history"][0]["counts"] == UNEVEN_COUNTS
    balanced = run_in_processes(_train, 4, (argv + ["--pipeline-split", "balanced",
                                                    "--tp-balance", "semi"],), timeout_s=400)
    assert balanced[0]["losses"] == pytest.approx(losses, rel=2e-5, abs=2e-5)


def _config(model, extra):
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--train-iters", "1", "--data-path", "x", "--tensor-model-parallel-size", "2",
            *extra]
    return config_from_args(model, build_parser(model).parse_args(argv), has_cuda=False)


def test_t5_is_refused_in_one_line_naming_why_and_gpt_options_are_accepted():
    with pytest.raises(ConfigError, match="supports GPT models only: T5's encoder and decoder"):
        _config("t5", ["--tp-balance", "resize"])
    with pytest.raises(ConfigError, match="--tp-balance-max-share >= 1"):
        _config("gpt", ["--tp-balance", "resize", "--tp-balance-max-share", "0.9"])
    cfg = _config("gpt", ["--tp-balance", "migrate", "--gated-gelu", "--pipeline-split",
                          "balanced", "--pipeline-model-parallel-size", "2"])
    assert cfg.tp_balance_max_share == 1.5 and cfg.flextp_skip_order == "rotate"


def test_the_memory_model_counts_the_slot_capacity():
    """The planner's model states: with --tp-balance, every transformer layer's TP-split
    weights (and their gradients and Adam moments) at --tp-balance-max-share times the even
    share; the embedding and the output layer as before; without FlexTP the flag counts
    nothing."""
    from dynapipe_ext.costs.cost_model import AnalyticCostModel
    from dynapipe_ext.costs.model_spec import ModelSpec
    from megatron.planning.device_costs import slot_share
    spec = ModelSpec(model="gpt", num_layers=4, hidden_size=64, num_attention_heads=4,
                     ffn_hidden_size=256, vocab_size=1000)
    plain = AnalyticCostModel(spec, tp=2)
    slots = AnalyticCostModel(spec, tp=2, tp_slot_share=1.5)
    for kind in ("gpt_layer", "gpt_attention", "gpt_mlp"):
        assert slots.layer_params(kind) == 1.5 * plain.layer_params(kind)
    for kind in ("embedding", "head"):
        assert slots.layer_params(kind) == plain.layer_params(kind)
    assert sum(slots.model_state_bytes(1)) > sum(plain.model_state_bytes(1))
    assert slot_share(_config("gpt", ["--tp-balance", "resize", "--tp-balance-max-share",
                                      "1.25"])) == 1.25
    assert slot_share(_config("gpt", ["--tp-balance-max-share", "1.25"])) == 1.0


@pytest.mark.slow
def test_slot_allocation_follows_the_max_share_and_clamps_a_larger_imbalance(
        sp_dataset):  # noqa: F811
    """--tp-balance-max-share 1.25 at TP=2: slots for 2 heads (5/2 rounds down) and 20 of 32
    MLP units per rank; a start for speeds 1 : 0.25 (26 : 6 MLP units) is clamped to 20 : 12
    and 2 : 2 heads."""
    argv = sp_dataset + MODEL + ["--train-iters", "1", "--tp-balance", "migrate",
                                 "--flextp-interval", "100", "--tp-balance-max-share", "1.25",
                                 "--flextp-initial-speeds", "1,0.25"]
    for r in run_in_processes(_train, 2, (argv,), timeout_s=400):
        shapes = r["param_shapes"]
        assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == (48, 32)
        assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (80, 32)
        assert shapes["decoder.layers.0.mlp.linear_fc2.weight"] == (32, 80)
        assert r["history"][0]["counts"] == {"attn": [2, 2], "mlp": [20, 12]}


def _train_recording_skips(rank, world, argv):
    """Train; per iteration, for each MLP pair of this rank: the units it skipped and the
    units whose slots got a nonzero gradient (main_grad before the optimizer step)."""
    from megatron.training.arguments import parse_args
    from megatron.training.training import build_run, train
    run = build_run(parse_args("gpt", argv, has_cuda=False), verbose=False)
    pairs = run.flextp.pairs["mlp"]
    seen = []
    step = run.optimizer.step

    def recording_step(iteration):
        row = []
        for p in pairs:
            grad = p.row.weight.main_grad
            per = p.row_cols
            got = [u for i, u in enumerate(p.units())
                   if grad[:, i * per:(i + 1) * per].abs().sum() > 0]
            row.append({"drops": list(p.drops), "units": list(p.units()), "graded": got})
        seen.append(row)
        return step(iteration)
    run.optimizer.step = recording_step
    stats = train(run)
    return {"losses": [s.loss for s in stats], "seen": seen}


@pytest.mark.slow
@pytest.mark.parametrize("order", ["rotate", "sticky"])
def test_resize_rotates_skips_so_every_straggler_unit_keeps_getting_gradients(
        sp_dataset, monkeypatch, order):  # noqa: F811
    """TP rank 1 is a 20x straggler (modelled clock) from the start; deciding every
    iteration, resize skips 6 of its 16 MLP units per layer (the bound, 0.375). Rotating, no
    unit is skipped twice in a row, so over any 2 iterations every unit of the straggler gets a
    gradient; sticky (--flextp-skip-order sticky) leaves some units without one for the whole
    episode."""
    monkeypatch.setenv("FLEXTP_SLOWDOWN", "1:20")
    monkeypatch.setenv("FLEXTP_CLOCK", "modelled")
    argv = sp_dataset + MODEL + ["--train-iters", "11", "--tp-balance", "resize",
                                 "--flextp-interval", "1", "--flextp-patience", "2",
                                 "--flextp-skip-order", order]
    straggler = run_in_processes(_train_recording_skips, 2, (argv,), timeout_s=400)[1]
    episode = [row for row in straggler["seen"] if any(p["drops"] for p in row)]
    assert len(episode) >= 5, straggler["seen"]
    for row in episode:
        for p in row:           # a skipped unit gets no gradient, every computed one does
            assert len(p["drops"]) == 6
            assert sorted(p["graded"]) == sorted(set(p["units"]) - set(p["drops"]))
    for layer in range(len(episode[0])):
        skips = [set(row[layer]["drops"]) for row in episode]
        if order == "rotate":
            assert all(not (a & b) for a, b in zip(skips, skips[1:])), skips
            units = set(episode[0][layer]["units"])
            for a, b in zip(episode, episode[1:]):
                assert set(a[layer]["graded"]) | set(b[layer]["graded"]) == units
        else:   # a skipped unit gets no gradient and stays among the smallest
            assert set.intersection(*skips), skips
