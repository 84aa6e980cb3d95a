"""--hidden-dropout / --attention-dropout: dropout is on, seeded reproducibly, replayed exactly
by recompute, drawn from megatron-core's streams (the default generator outside TP regions,
equal on every TP rank; 'model-parallel-rng' inside them, one per TP rank; a seed per pipeline
stage), and survives a checkpoint round trip."""
import numpy as np
import pytest
import torch

from dynapipe_ext.costs.model_spec import ModelSpec
from megatron.model.batch_tensors import build_micro_batch, unsplit_micro_batch
from megatron.model.init_weights import initialize_stage_weights
from megatron.base.rng import CpuRNGStatesTracker, rank_seed, seed_model_parallel
from megatron.model.stages import build_rank_stages, build_transformer_config, run_stage_forward
from tests.multiproc import run_in_processes, single_process_world

SEED = 23
GPT = ModelSpec("gpt", 2, 32, 4, 128, max_position_embeddings=64)
T5 = ModelSpec("t5", 1, 32, 4, 128, num_decoder_layers=1, max_position_embeddings=64)
MODEL_RNG = "model-parallel-rng"


def samples_of(model, n=6, seed=3):
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        if model == "gpt":
            length = int(rng.integers(8, 33))
            out[i] = (rng.integers(1, 128, length), rng.integers(1, 128, length),
                      np.ones(length, np.float32))
        else:
            le, ld = int(rng.integers(8, 33)), int(rng.integers(4, 17))
            out[i] = (rng.integers(1, 128, le), rng.integers(1, 128, ld),
                      rng.integers(1, 128, ld), np.ones(ld, np.float32))
    return out


def run_model(spec, hidden=0.0, attention=0.0, recompute="none", tp=1, reseed=True):
    """One forward and backward of a fixed batch through the whole model (TP=`tp`, PP=1),
    the streams reseeded first (as setup_model_parallel does) unless `reseed` is False.
    Returns the loss, the stage module and the hidden state entering the final norm."""
    from megatron.base.distributed_setup import seed_everything
    if reseed:
        seed_everything(SEED, on_gpu=False)
    samples = samples_of(spec.model)
    config = build_transformer_config(spec, tp=tp, hidden_dropout=hidden,
                                      attention_dropout=attention)
    stage = build_rank_stages(spec, (0,), 0, config)[0]
    initialize_stage_weights({0: stage}, SEED)
    seen = []
    stage.head.final_norm.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    batch = build_micro_batch(unsplit_micro_batch(list(samples), samples, spec.model),
                              samples, spec.model, 0)
    losses = run_stage_forward(stage, (), batch, recompute)
    loss = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    return loss.item(), stage, seen[0].detach()


def loss_and_grads(spec, **options):
    loss, stage, _ = run_model(spec, **options)
    return loss, {n: p.grad.clone() for n, p in stage.named_global_parameters()}


@pytest.fixture(scope="module")
def world():
    torch.set_num_threads(1)
    with single_process_world(seed=SEED):
        yield


@pytest.mark.parametrize("spec", [GPT, T5], ids=["gpt", "t5"])
def test_dropout_changes_the_loss_and_a_seed_reproduces_it_bit_for_bit(world, spec):
    plain, _ = loss_and_grads(spec)
    hidden, grads = loss_and_grads(spec, hidden=0.3)
    attention, _ = loss_and_grads(spec, attention=0.3)
    assert len({plain, hidden, attention}) == 3
    again, grads_again = loss_and_grads(spec, hidden=0.3)
    assert again == hidden
    assert all(torch.equal(grads[n], grads_again[n]) for n in grads)
    # the streams advance: the next draw (no reseed) is a different mask
    next_one, _ = loss_and_grads(spec, hidden=0.3, reseed=False)
    assert next_one != hidden


@pytest.mark.parametrize("spec", [GPT, T5], ids=["gpt", "t5"])
def test_recompute_replays_the_same_dropout_masks(world, spec):
    base, grads = loss_and_grads(spec, hidden=0.2, attention=0.2)
    for mode in ("selective", "full"):
        loss, got = loss_and_grads(spec, hidden=0.2, attention=0.2, recompute=mode)
        assert loss == base, mode
        for name in grads:
            torch.testing.assert_close(got[name], grads[name], rtol=0, atol=0,
                                       msg=f"{mode}: {name}")


def test_the_trainer_builds_its_layers_with_the_flags(world):
    from megatron.training.arguments import parse_args
    from megatron.base.distributed_setup import current_layout
    from megatron.training.training import build_stages, model_spec
    cfg = parse_args("gpt", ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                             "4", "--train-iters", "1", "--data-path", "x", "--hidden-dropout",
                             "0.2", "--attention-dropout", "0.3"], has_cuda=False)
    stage = build_stages(cfg, model_spec(cfg, 100), current_layout(), (0,))[0]
    assert (stage.config.hidden_dropout, stage.config.attention_dropout) == (0.2, 0.3)
    assert stage.embedding.embedding_dropout.p == 0.2
    assert {m.attention_dropout.p for n, m in stage.named_modules()
            if n.endswith("core_attention")} == {0.3}


def test_streams_follow_megatron_seeding():
    """Default generator: seed + 100 x pipeline rank (equal across TP ranks);
    'model-parallel-rng': that + 2718 + TP rank, as megatron-core seeds its CUDA tracker."""
    def states(tp_rank, pp_rank):
        seed_model_parallel(SEED, tp_rank, pp_rank, on_cuda=False)
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        tracker = get_cuda_rng_tracker()
        assert isinstance(tracker, CpuRNGStatesTracker)
        return torch.get_rng_state(), tracker.get_states()[MODEL_RNG]

    base, model_rng = states(0, 0)
    other_tp, other_tp_model = states(1, 0)
    other_pp, other_pp_model = states(0, 1)
    assert torch.equal(base, other_tp) and not torch.equal(model_rng, other_tp_model)
    assert not torch.equal(base, other_pp) and not torch.equal(model_rng, other_pp_model)
    assert torch.equal(base, torch.Generator().manual_seed(rank_seed(SEED, 0)).get_state())
    assert torch.equal(other_tp_model,
                       torch.Generator().manual_seed(SEED + 2718 + 1).get_state())
    assert rank_seed(SEED, 3) == SEED + 300


def test_tracker_fork_draws_from_its_stream_and_leaves_the_default_one():
    seed_model_parallel(SEED, 0, 0, on_cuda=False)
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    tracker = get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    with tracker.fork():
        second = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)
    expected = torch.rand(8, generator=torch.Generator().manual_seed(SEED + 2718))
    assert torch.equal(torch.cat([first, second]), expected)


def test_checkpoint_round_trip_restores_the_dropout_streams():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron.checkpoint.checkpointing import capture_rng_state, restore_rng_state
    seed_model_parallel(SEED, 0, 0, on_cuda=False)
    saved = capture_rng_state()
    assert sorted(saved["tracker"]) == sorted(get_cuda_rng_tracker().get_states())
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(5)
    outside = torch.rand(5)
    seed_model_parallel(SEED + 1, 0, 0, on_cuda=False)   # a fresh run, other streams
    restore_rng_state(saved)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(5), inside)
    assert torch.equal(torch.rand(5), outside)


# ------------------------------------------------------------------ tensor parallel (slow)

def tp_worker(rank, world_size):
    """TP=2: (1) hidden dropout only: loss and full (gathered) grads; (2) both dropouts: the
    hidden state entering the final norm and this rank's model-parallel stream."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron.base.distributed_setup import setup_model_parallel
    from tests.reference_model import gather_full_grads
    setup_model_parallel(2, 1, seed=SEED, timeout_s=60)
    loss, stage, _ = run_model(GPT, hidden=0.3, tp=2)
    grads = gather_full_grads({0: stage})
    model_rng = get_cuda_rng_tracker().get_states()[MODEL_RNG].clone()
    _, _, hidden = run_model(GPT, hidden=0.3, attention=0.3, tp=2)
    return loss, grads, hidden.numpy(), model_rng.numpy()   # numpy: tensors would be shared


def tp1_reference(rank, world_size):
    from megatron.base.distributed_setup import setup_model_parallel
    setup_model_parallel(1, 1, seed=SEED, timeout_s=60)
    loss, grads = loss_and_grads(GPT, hidden=0.3)
    return loss, {n: g.numpy() for n, g in grads.items()}


@pytest.mark.slow
def test_tensor_parallel_dropout_streams():
    (ref_loss, ref_grads), = run_in_processes(tp1_reference, 1, timeout_s=120)
    (loss0, grads0, hidden0, model0), (loss1, _, hidden1, model1) = run_in_processes(
        tp_worker, 2, timeout_s=200)
    # hidden dropout draws the same masks on every TP rank as the TP=1 run: equal numbers
    assert loss0 == loss1
    assert abs(loss0 - ref_loss) <= 1e-6 * abs(ref_loss)
    assert sorted(grads0) == sorted(ref_grads)
    for name, ref in ref_grads.items():
        np.testing.assert_allclose(grads0[name], ref, rtol=1e-5,
                                   atol=1e-6 * float(np.abs(ref).max()), err_msg=name)
    # with attention dropout too, the replicated hidden state stays equal across TP ranks,
    # while attention dropout draws from a different stream on each TP rank
    assert np.array_equal(hidden0, hidden1)
    assert not np.array_equal(model0, model1)


def test_the_planner_counts_dropout_memory():
    """Dropout masks are kept activations; attention dropout on CPU runs unfused (s^2 kept)."""
    from megatron.training.arguments import parse_args
    from megatron.planning.device_costs import dropout_options
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--train-iters", "1", "--data-path", "x"]
    default = parse_args("gpt", base, has_cuda=False)
    assert (default.hidden_dropout, default.attention_dropout) == (0.1, 0.1)
    assert dropout_options(default, "cpu") == {"dropout": True, "fused_attention": False}
    assert dropout_options(default, "cuda") == {"dropout": True, "fused_attention": True}
    hidden_only = parse_args("gpt", base + ["--attention-dropout", "0"], has_cuda=False)
    assert dropout_options(hidden_only, "cpu") == {"dropout": True, "fused_attention": True}
    off = parse_args("gpt", base + ["--hidden-dropout", "0", "--attention-dropout", "0"],
                     has_cuda=False)
    assert dropout_options(off, "cpu") == {"dropout": False, "fused_attention": True}


def seeds_worker(rank, world_size):
    """PP=2 x DP=2: this rank's (pp rank, dp rank, default generator, model-parallel stream)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron.base.distributed_setup import setup_model_parallel
    layout = setup_model_parallel(1, 2, seed=SEED, timeout_s=60)
    return (layout.pp_rank, layout.dp_rank, torch.get_rng_state().numpy(),
            get_cuda_rng_tracker().get_states()[MODEL_RNG].numpy())


@pytest.mark.slow
def test_pipeline_stages_draw_other_masks_data_parallel_replicas_the_same():
    """As Megatron-LM seeds ranks (without --data-parallel-random-init)."""
    results = run_in_processes(seeds_worker, 4, timeout_s=200)
    by_rank = {(pp, dp): (default, model) for pp, dp, default, model in results}
    assert sorted(by_rank) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for pp in (0, 1):
        default, model = by_rank[(pp, 0)]
        assert np.array_equal(default, by_rank[(pp, 1)][0])
        assert np.array_equal(model, by_rank[(pp, 1)][1])
        assert np.array_equal(default, torch.Generator().manual_seed(
            rank_seed(SEED, pp)).get_state().numpy())
    assert not np.array_equal(by_rank[(0, 0)][0], by_rank[(1, 0)][0])
    assert not np.array_equal(by_rank[(0, 0)][1], by_rank[(1, 0)][1])
