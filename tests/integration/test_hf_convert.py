"""Hugging Face checkpoints in and out (issue 15): a random-initialised transformers model saved
with save_pretrained, imported with tools/convert_checkpoint.py, gives the same logits in our
stage modules (TP=1 in this process; TP=2 x PP=2 over gloo, each rank loading its slices with
load_full_state) as in transformers, fp32, within 1e-4 of the logit scale; exporting the import
gives back the same tensors."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron.checkpoint.hf_convert import (ConversionError, fit_vocab, padded_spec,
                                            qkv_from_hf, qkv_to_hf, read_converted, read_hf)
from dynapipe_ext.costs.model_spec import ModelSpec
from tests.multiproc import run_in_processes, single_process_world
from tests.training.test_training import sp_dataset  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 1e-4      # max abs logit difference / max abs logit
# (layers, hidden, heads, vocab, positions): 3 and 12 heads, not powers of two
GPT_CONFIGS = [(2, 24, 3, 256, 32), (3, 48, 12, 512, 40), (1, 64, 4, 256, 16)]


def random_gpt2(directory, layers, hidden, heads, vocab, positions, seed=0):
    """A GPT2LMHeadModel with every weight random (norms and biases too, so a wrong mapping
    of any of them shows), saved with save_pretrained."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden,
                                     n_layer=layers, n_head=heads)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    return model


def token_rows(vocab, rows=3, seq=11, seed=1):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, vocab, (rows, seq)))


def gpt_batch(tokens):
    """Micro-batch tensors of rows of whole samples (no labels: the head returns logits)."""
    from megatron.model.batch_tensors import build_micro_batch, unsplit_micro_batch
    samples = {i: (row.numpy(), row.numpy(), np.ones(len(row), np.float32))
               for i, row in enumerate(tokens)}
    batch = build_micro_batch(unsplit_micro_batch(sorted(samples), samples, "gpt"), samples,
                              "gpt", 0)
    batch.pop("labels")
    return batch


def convert(hf_dir, out_dir, *extra):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                           "--from-hf", str(hf_dir), "--to", str(out_dir), *extra],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def assert_close_logits(ours, theirs):
    scale = float(theirs.abs().max())
    worst = float((ours - theirs).abs().max())
    assert worst <= TOLERANCE * scale, f"max abs diff {worst:.3g}, logit scale {scale:.3g}"


def test_qkv_regrouping_is_per_head_and_invertible():
    heads, d = 3, 2
    hf = torch.arange(3 * heads * d)           # [q0 q0 q1 q1 q2 q2 k0 k0 ... v2 v2]
    ours = qkv_from_hf(hf, heads)
    # head 1 of megatron-core: its q, k, v rows, in that order
    assert ours[6:12].tolist() == [2, 3, 8, 9, 14, 15]
    assert torch.equal(qkv_to_hf(ours, heads), hf)
    w = torch.randn(3 * heads * d, 5)
    assert torch.equal(qkv_to_hf(qkv_from_hf(w, heads), heads), w)


@pytest.mark.parametrize("shape", GPT_CONFIGS)
@pytest.mark.parametrize("untie", [False, True])
def test_gpt2_logits_match_transformers_tp1(tmp_path, shape, untie):
    from megatron.model.full_state import load_full_state
    from megatron.model.stages import build_rank_stages, build_transformer_config, \
        stage_parameters
    hf_model = random_gpt2(tmp_path / "hf", *shape)
    tokens = token_rows(shape[3])
    with torch.no_grad():
        theirs = hf_model(tokens).logits
    full, args = read_hf(str(tmp_path / "hf"), untie=untie)
    assert ("output_layer.weight" in full) == untie
    torch.set_num_threads(1)
    with single_process_world(seed=3):
        spec = padded_spec(args)
        stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec),
                                   tie_embeddings=not untie)
        assert load_full_state(stage_parameters(stages), full, 0, 1, "import") == len(
            dict(stage_parameters(stages)))
        with torch.no_grad():
            ours = stages[0]((), gpt_batch(tokens)).transpose(0, 1)
    assert_close_logits(ours, theirs)
    # a deliberately wrong QKV layout is caught by the same comparison
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    with single_process_world(seed=3):
        stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec),
                                   tie_embeddings=not untie)
        broken = dict(full, **{name: qkv_to_hf(full[name], args.num_attention_heads)})
        load_full_state(stage_parameters(stages), broken, 0, 1, "import")
        with torch.no_grad():
            wrong = stages[0]((), gpt_batch(tokens)).transpose(0, 1)
    assert float((wrong - theirs).abs().max()) > 100 * TOLERANCE * float(theirs.abs().max())


def parallel_logits_worker(rank, world_size, converted_dir, tokens):
    """TP=2 x PP=2: every rank builds its stage, loads its slices from the converted full
    state; the first pipeline stage sends its hidden state on; the last one's TP ranks gather
    the vocabulary slices of the logits. Returns [rows, seq, vocab] on the last stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.model.full_state import load_full_state
    from megatron.model.stages import build_rank_stages, build_transformer_config, \
        stage_parameters
    from megatron.base.distributed_setup import setup_model_parallel
    full, args = read_converted(converted_dir)
    layout = setup_model_parallel(2, 2, seed=3, timeout_s=120)
    spec = padded_spec(args, full["embedding.word_embeddings.weight"].shape[0])
    stages = build_rank_stages(spec, (0, 1), layout.pp_rank,
                               build_transformer_config(spec, tp=2, pp=2),
                               tie_embeddings=args.tied_embeddings)
    load_full_state(stage_parameters(stages), full, layout.tp_rank, 2, converted_dir)
    batch = gpt_batch(tokens)
    pipe = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    with torch.no_grad():
        if layout.pp_rank == 0:
            (hidden,) = stages[0]((), batch)
            dist.send(hidden.contiguous(), pipe[1])
            return None
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], spec.hidden_size)
        dist.recv(hidden, pipe[0])
        part = stages[1]((hidden,), batch)
        parts = [torch.empty_like(part) for _ in range(2)]
        dist.all_gather(parts, part.contiguous(),
                        group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1).transpose(0, 1).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("shape,untie", [(GPT_CONFIGS[1], False), ((2, 36, 6, 256, 24), True)])
def test_gpt2_logits_match_transformers_tp2_pp2(tmp_path, shape, untie):
    layers, hidden, heads, vocab, positions = shape
    shape = (layers + layers % 2, hidden, heads, vocab, positions)   # two pipeline stages
    hf_model = random_gpt2(tmp_path / "hf", *shape)
    tokens = token_rows(vocab)
    with torch.no_grad():
        theirs = hf_model(tokens).logits
    convert(tmp_path / "hf", tmp_path / "ours", "--target-tensor-parallel-size", "2",
            *(["--untie-embeddings-and-output-weights"] if untie else []))
    results = run_in_processes(parallel_logits_worker, 4, (str(tmp_path / "ours"), tokens),
                               timeout_s=300)
    last = [r for r in results if r is not None]
    assert len(last) == 2 and np.array_equal(last[0], last[1])
    ours = torch.from_numpy(last[0])
    assert ours.shape[-1] >= vocab           # padded for TP=2; padded rows belong to no token
    assert_close_logits(ours[..., :vocab], theirs)


def test_export_then_import_is_identity(tmp_path):
    random_gpt2(tmp_path / "hf", *GPT_CONFIGS[1])
    out = convert(tmp_path / "hf", tmp_path / "ours", "--target-tensor-parallel-size", "2")
    assert "--num-layers 3 --hidden-size 48 --num-attention-heads 12" in out
    full, args = read_converted(str(tmp_path / "ours"))
    assert full["embedding.word_embeddings.weight"].shape[0] == 512   # 512 is a multiple of 256
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                           "--to-hf", str(tmp_path / "ours"), "--to", str(tmp_path / "back")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    a = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").state_dict()
    b = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").state_dict()
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    again, _ = read_hf(str(tmp_path / "back"))
    assert sorted(again) == sorted(full)
    assert all(torch.equal(again[k], full[k]) for k in full)


def test_vocab_padding_copies_the_last_row_and_never_truncates():
    full = {"embedding.word_embeddings.weight": torch.arange(6.0).reshape(3, 2)}
    padded = fit_vocab(full, 5)["embedding.word_embeddings.weight"]
    assert padded.tolist() == [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]]
    with pytest.raises(ConversionError, match="3 vocabulary rows, more than the model's 2"):
        fit_vocab(full, 2)


def test_unsupported_gpt2_variant_is_a_clear_error(tmp_path):
    config = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=8, n_layer=1,
                                     n_head=2, activation_function="relu")
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "relu")
    with pytest.raises(ConversionError, match="activation_function 'relu'"):
        read_hf(str(tmp_path / "relu"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                           "--from-hf", str(tmp_path / "relu"), "--to", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "activation_function 'relu'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_padded_spec_pads_the_vocabulary_only():
    args = ModelSpec("gpt", 2, 24, 3, 250, ffn_hidden_size=96, max_position_embeddings=32)
    padded = padded_spec(args, 256)
    assert (padded.vocab_size, padded.unpadded_vocab_size) == (256, 250)
    assert padded_spec(args) == args and padded.ffn_size == 96


@pytest.mark.slow
def test_converted_gpt2_finetunes_at_pp2_from_its_weights(tmp_path, sp_dataset):  # noqa: F811
    """The converted directory is a checkpoint: `pretrain_gpt.py --load DIR --finetune` at
    PP=2 starts from iteration 0 with the imported weights (after one step at a negligible LR
    they still equal the import), and the saved run exports back to transformers."""
    import json

    from megatron.checkpoint.checkpointing import read_full_model_state
    from tests.training.test_training import REPO, env_with_repo
    from tests.multiproc import free_port
    random_gpt2(tmp_path / "hf", 2, 32, 2, 1000, 128)
    printed = convert(tmp_path / "hf", tmp_path / "ours")
    flags = printed.split("train with: ")[1].split()
    imported = read_full_model_state(str(tmp_path / "ours"))
    stats = tmp_path / "stats.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "pretrain_gpt.py",
           *sp_dataset, *flags, "--seq-length", "128", "--pipeline-model-parallel-size", "2",
           "--tokens-per-global-batch", "1024", "--train-iters", "1", "--lr", "1e-12",
           "--min-lr", "0", "--num-planner-workers", "0", "--load", str(tmp_path / "ours"),
           "--finetune", "--save", str(tmp_path / "run"), "--save-interval", "1",
           "--stats-file", str(stats)]
    done = subprocess.run(cmd, cwd=REPO, env=env_with_repo(), capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert [json.loads(line)["iteration"] for line in open(stats)] == [1]
    trained = read_full_model_state(str(tmp_path / "run"))
    assert trained.keys() == imported.keys()
    for name, value in imported.items():
        assert torch.allclose(trained[name], value, atol=1e-6), name
    convert_back = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--to-hf",
         str(tmp_path / "ours"), "--to", str(tmp_path / "back")],
        capture_output=True, text=True, timeout=300)
    assert convert_back.returncode == 0, convert_back.stderr
    assert transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back") is not None


def test_untied_gpt2_round_trips_with_its_own_head_and_config_fields(tmp_path):
    """A GPT-2 with its own lm_head (tie_word_embeddings false) imports untied and exports
    with lm_head.weight and the untied config; a tied import keeps its tie; the source's
    dropout (0.0, not GPT-2's default 0.1) survives the export."""
    import json
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=250, n_positions=16, n_embd=24, n_layer=2,
                                     n_head=3, tie_word_embeddings=False, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert model.lm_head.weight is not model.transformer.wte.weight
    model.save_pretrained(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "ours")
    assert "--untie-embeddings-and-output-weights" in out
    full, args = read_converted(str(tmp_path / "ours"))
    assert torch.equal(full["output_layer.weight"][:250], model.lm_head.weight)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                           "--to-hf", str(tmp_path / "ours"), "--to", str(tmp_path / "back")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["tie_word_embeddings"] is False and saved["resid_pdrop"] == 0.0
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    a, b = model.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    tokens = token_rows(250)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, model(tokens).logits)


# ---------------------------------------------------------------- padded vocabulary

PADDED = (2, 32, 2, 4000, 24)     # GPT-2 shape with 4000 tokens: 4096 rows at TP 1 and 2


def hf_reference_loss(model, samples):
    """transformers' mean next-token loss over the loss-masked labels of `samples`
    ({i: (tokens, labels, loss_mask)}), in float64."""
    total = count = 0.0
    with torch.no_grad():
        for tokens, labels, mask in samples.values():
            logits = model(torch.from_numpy(tokens)[None]).logits[0].double()
            nll = -torch.log_softmax(logits, -1).gather(1, torch.from_numpy(labels)[:, None])
            total += float((nll[:, 0] * torch.from_numpy(mask).double()).sum())
            count += float(mask.sum())
    return total / count


def padded_samples(vocab, rows=4, seq=17, seed=2):
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(rows):
        seq_ids = rng.integers(0, vocab, seq + 1)
        mask = np.ones(seq, np.float32)
        mask[:3] = 0.0                            # an instruction the loss leaves out
        out[i] = (seq_ids[:-1], seq_ids[1:], mask)
    return out


def head_loss(full, args, samples, tp):
    """Our loss of `samples` (mean over loss-masked labels) and this TP rank's logits slice,
    with the vocabulary padded as a run at `tp` pads it."""
    from megatron.model.batch_tensors import build_micro_batch, unsplit_micro_batch
    from megatron.model.full_state import load_full_state
    from megatron.model.stages import build_rank_stages, build_transformer_config, \
        stage_parameters
    from megatron.core import parallel_state
    from megatron.training.training import padded_vocab_size
    rows = padded_vocab_size(args.vocab_size, tp)
    spec = padded_spec(args, rows)
    stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec, tp=tp))
    load_full_state(stage_parameters(stages), fit_vocab(full, rows),
                    parallel_state.get_tensor_model_parallel_rank(), tp, "import")
    batch = build_micro_batch(unsplit_micro_batch(sorted(samples), samples, "gpt"), samples,
                              "gpt", 0)
    with torch.no_grad():
        losses = stages[0]((), batch).double()
        logits = stages[0]((), {k: v for k, v in batch.items() if k != "labels"})
    mask = batch["loss_mask"].double()
    return float((losses * mask).sum() / mask.sum()), rows, logits


def test_padded_vocabulary_rows_leave_the_loss_and_logits_tp1(tmp_path):
    """An imported GPT-2 of 4000 tokens in a model of 4096 rows: its loss is transformers'
    within 1e-6 relative (the 96 padded rows, copies of the last, would add to the softmax's
    sum) and the logits of the padded columns are -inf."""
    model = random_gpt2(tmp_path / "hf", *PADDED).eval()
    samples = padded_samples(PADDED[3])
    reference = hf_reference_loss(model, samples)
    full, args = read_hf(str(tmp_path / "hf"))
    torch.set_num_threads(1)
    with single_process_world(seed=3):
        ours, rows, logits = head_loss(full, args, samples, tp=1)
    assert rows == 4096
    assert abs(ours - reference) <= 1e-6 * reference, (ours, reference)
    assert torch.isneginf(logits[..., 4000:]).all() and torch.isfinite(logits[..., :4000]).all()


def padded_loss_worker(rank, world_size, hf_dir, samples):
    from megatron.base.distributed_setup import setup_model_parallel
    torch.set_num_threads(1)
    full, args = read_hf(hf_dir)
    setup_model_parallel(2, 1, seed=3, timeout_s=120)
    ours, rows, logits = head_loss(full, args, samples, tp=2)
    # rank 0 holds rows 0..2047 (all tokens), rank 1 rows 2048..4095 (the last 96 padded)
    padded = logits[..., 4000 - 2048:] if rank == 1 else logits[..., :0]
    return ours, rows, bool(torch.isneginf(padded).all()), int(torch.isinf(logits).sum())


@pytest.mark.slow
def test_padded_vocabulary_rows_leave_the_loss_tp2(tmp_path):
    """The same at TP=2, where each rank holds half of the 4096 rows and only the second
    half's tail is padding: both ranks' loss is transformers' within 1e-6 relative."""
    model = random_gpt2(tmp_path / "hf", *PADDED).eval()
    samples = padded_samples(PADDED[3])
    reference = hf_reference_loss(model, samples)
    results = run_in_processes(padded_loss_worker, 2, (str(tmp_path / "hf"), samples),
                               timeout_s=300)
    for ours, rows, masked, infinite in results:
        assert rows == 4096 and masked
        assert abs(ours - reference) <= 1e-6 * reference, (ours, reference)
    assert [r[3] for r in results] == [0, 96 * 4 * 17]


@pytest.mark.slow
def test_imported_gpt2_with_padded_vocabulary_starts_at_transformers_loss_tp2(
        tmp_path, sp_dataset):  # noqa: F811
    """pretrain_gpt.py at TP=2 on an imported GPT-2 of the run's 1000 tokens (1024 rows):
    the first iteration's loss is transformers' loss of the same samples within 1e-6
    relative."""
    from megatron.training.arguments import parse_args
    from megatron.training.training import open_training_data
    from tests.training.test_training import torchrun
    model = random_gpt2(tmp_path / "hf", 2, 32, 2, 1000, 128).eval()
    printed = convert(tmp_path / "hf", tmp_path / "ours", "--target-tensor-parallel-size", "2")
    assert "vocabulary 1000 padded to 1024" in printed
    args = sp_dataset + printed.split("train with: ")[1].split() + [
        "--seq-length", "128", "--tensor-model-parallel-size", "2",
        "--tokens-per-global-batch", "1024", "--train-iters", "1", "--lr", "1e-12",
        "--min-lr", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--num-planner-workers", "0", "--load", str(tmp_path / "ours"), "--finetune"]
    stats = torchrun("pretrain_gpt.py", args, tmp_path / "gpt.jsonl", timeout=400)
    data = open_training_data(parse_args("gpt", args, has_cuda=False))
    reference = hf_reference_loss(model, data.batch_samples(0))
    assert abs(stats[0]["loss"] - reference) <= 1e-6 * reference, (stats[0]["loss"], reference)
