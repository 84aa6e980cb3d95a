"""Llama, Qwen2 and Mistral checkpoints in and out: random-initialised transformers models (built
from configs, never downloaded) imported with tools/convert_checkpoint.py give, in our stage
modules, the logits transformers gives each sample alone (fp32, within 1e-5 of the logit scale,
every position of every sample), fed as one packed stream of several samples and as padded
rows, at TP=1 and at TP=2 with a padded vocabulary; import then export gives back every tensor
bit for bit and a config transformers loads with the same fields."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dynapipe_ext.batching.microbatch import MicroBatch
from megatron.checkpoint.hf_convert import (ConversionError, decoder_spec, padded_spec,
                                            read_converted, read_hf, unpack_per_head,
                                            write_converted, write_hf)
from tests.multiproc import run_in_processes, single_process_world
from tests.integration.test_hf_convert import convert

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 1e-5      # max abs logit difference / max abs logit
LENGTHS = (9, 3, 14, 6)   # the samples of a stream / the padded rows


def llama_config():
    """GQA (6 heads, 2 groups), untied head, Llama 3.1 rope scaling, rope_theta not 10000."""
    return transformers.LlamaConfig(
        vocab_size=250, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8})


def qwen2_config():
    """q/k/v biases, tied head, GQA (4 heads, 2 groups)."""
    return transformers.Qwen2Config(
        vocab_size=301, hidden_size=32, intermediate_size=56, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
        tie_word_embeddings=True, rope_theta=1000.0)


def mistral_config():
    """A window covering the sequence, heads with a head_dim of their own (12, not hidden /
    heads = 10), one key / value head per query head, untied."""
    return transformers.MistralConfig(
        vocab_size=200, hidden_size=40, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, head_dim=12, max_position_embeddings=32,
        sliding_window=32, tie_word_embeddings=False)


CONFIGS = {"llama": llama_config, "qwen2": qwen2_config, "mistral": mistral_config}


def random_model(directory, config, seed=0):
    """A ...ForCausalLM with every weight random (norms and biases too, so that a wrong mapping
    of any of them shows), saved with save_pretrained."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    return model


def sample_tokens(vocab, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n) for n in LENGTHS]


def hf_logits(model, samples):
    """transformers' logits of each sample alone."""
    with torch.no_grad():
        return [model(torch.from_numpy(s)[None]).logits[0] for s in samples]


def batches(samples):
    """The samples as one packed stream, and as one padded row each."""
    from megatron.model.batch_tensors import build_micro_batch
    parts = {i: (s, s, np.ones(len(s), np.float32)) for i, s in enumerate(samples)}
    ids = tuple(range(len(samples)))
    packed = MicroBatch(rows=(ids,), seq_len=sum(LENGTHS))
    padded = MicroBatch(rows=tuple((i,) for i in ids), seq_len=max(LENGTHS))
    out = {}
    for name, mb in (("packed", packed), ("padded", padded)):
        batch = build_micro_batch(mb, parts, "gpt", 0)
        batch.pop("labels")
        out[name] = batch
    return out


def per_sample(logits, layout):
    """[rows, seq, vocab] logits -> each sample's positions, in sample order."""
    if layout == "packed":
        return list(torch.split(logits[0, :sum(LENGTHS)], LENGTHS))
    return [logits[i, :n] for i, n in enumerate(LENGTHS)]


def assert_logits_equal(ours, theirs, what):
    for k, (a, b) in enumerate(zip(ours, theirs)):
        a = a[..., :b.shape[-1]]
        scale = float(b.abs().max())
        worst = float((a - b).abs().max())
        assert worst <= TOLERANCE * scale, \
            f"{what} sample {k}: max abs diff {worst:.3g}, logit scale {scale:.3g}"


def stage_logits(stages, batch):
    with torch.no_grad():
        return stages[0]((), batch).transpose(0, 1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers_packed_and_padded_tp1(tmp_path, name):
    from megatron.model.full_state import load_full_state
    from megatron.model.stages import build_rank_stages, build_transformer_config, \
        stage_parameters
    config = CONFIGS[name]()
    model = random_model(tmp_path / "hf", config)
    samples = sample_tokens(config.vocab_size)
    theirs = hf_logits(model, samples)
    full, args = read_hf(str(tmp_path / "hf"))
    assert ("output_layer.weight" in full) == (not config.tie_word_embeddings)
    torch.set_num_threads(1)
    with single_process_world(seed=3):
        spec = padded_spec(args)
        stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec),
                                   tie_embeddings=spec.tied_embeddings)
        assert load_full_state(stage_parameters(stages), full, 0, 1, "import") == len(
            dict(stage_parameters(stages)))
        for layout, batch in batches(samples).items():
            assert_logits_equal(per_sample(stage_logits(stages, batch), layout), theirs,
                                f"{name} {layout}")
        # q, k, v stacked whole instead of per query group: caught by the same comparison
        name = "decoder.layers.0.self_attention.linear_qkv.weight"
        rows = [args.num_attention_heads // args.query_groups * args.head_dim, args.head_dim,
                args.head_dim]
        stacked = torch.cat(unpack_per_head(full[name], 3, args.query_groups, rows))
        load_full_state(stage_parameters(stages), {**full, name: stacked}, 0, 1, "import")
        with pytest.raises(AssertionError, match="max abs diff"):
            assert_logits_equal(per_sample(stage_logits(stages, batches(samples)["packed"]),
                                           "packed"), theirs, "q, k, v not per group")


def tp2_logits_worker(rank, world_size, converted_dirs, samples_of):
    """TP=2: every rank builds the whole model, loads its slices of each converted state; the
    vocabulary slices of the logits are gathered. Returns {name: {layout: [rows, seq, vocab]}}."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.base.distributed_setup import setup_model_parallel
    from megatron.model.full_state import load_full_state
    from megatron.model.stages import build_rank_stages, build_transformer_config, \
        stage_parameters
    torch.set_num_threads(1)
    layout = setup_model_parallel(2, 1, seed=3, timeout_s=120)
    out = {}
    for name, directory in converted_dirs.items():
        full, args = read_converted(directory)
        spec = padded_spec(args, full["embedding.word_embeddings.weight"].shape[0])
        stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec, tp=2),
                                   tie_embeddings=spec.tied_embeddings)
        load_full_state(stage_parameters(stages), full, layout.tp_rank, 2, directory)
        out[name] = {}
        for kind, batch in batches(samples_of[name]).items():
            with torch.no_grad():
                part = stages[0]((), batch)
            parts = [torch.empty_like(part) for _ in range(2)]
            dist.all_gather(parts, part.contiguous(),
                            group=parallel_state.get_tensor_model_parallel_group())
            out[name][kind] = torch.cat(parts, dim=-1).transpose(0, 1).numpy()
    return out


@pytest.mark.slow
def test_logits_match_transformers_packed_and_padded_tp2_padded_vocab(tmp_path):
    theirs, dirs, samples_of = {}, {}, {}
    for name, make in CONFIGS.items():
        config = make()
        model = random_model(tmp_path / name, config)
        samples_of[name] = sample_tokens(config.vocab_size)
        theirs[name] = hf_logits(model, samples_of[name])
        printed = convert(tmp_path / name, tmp_path / f"{name}_ours",
                          "--target-tensor-parallel-size", "2")
        assert f"vocabulary {config.vocab_size} padded to 256" in printed \
            or config.vocab_size > 256
        dirs[name] = str(tmp_path / f"{name}_ours")
    results = run_in_processes(tp2_logits_worker, 2, (dirs, samples_of), timeout_s=600)
    for name in CONFIGS:
        first, second = (r[name] for r in results)
        for layout in ("packed", "padded"):
            assert np.array_equal(first[layout], second[layout])
            ours = torch.from_numpy(first[layout])
            assert ours.shape[-1] > samples_of[name][0].max()    # padded rows present
            assert_logits_equal(per_sample(ours, layout), theirs[name], f"{name} {layout} TP=2")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_import_then_export_is_bit_for_bit_with_the_same_config(tmp_path, name):
    config = CONFIGS[name]()
    model = random_model(tmp_path / "hf", config)
    full, spec = read_hf(str(tmp_path / "hf"))
    with open(tmp_path / "hf" / "config.json") as f:
        source = json.load(f)
    write_converted(full, spec, str(tmp_path / "ours"), source)
    back_full, back_spec = read_converted(str(tmp_path / "ours"))
    assert back_spec == spec
    write_hf(back_full, back_spec, str(tmp_path / "back"), source)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(back) is type(model)
    theirs, ours = model.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys()
    for key in theirs:
        assert torch.equal(theirs[key], ours[key]), key
    with open(tmp_path / "back" / "config.json") as f:
        exported = json.load(f)
    differ = {k for k in set(source) | set(exported) if source.get(k) != exported.get(k)}
    assert differ <= {"transformers_version"}, differ
    # export without the imported config (a run's own flags only) still loads the same weights
    write_hf(back_full, back_spec, str(tmp_path / "bare"))
    bare = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bare")
    assert all(torch.equal(theirs[k], bare.state_dict()[k]) for k in theirs)


def test_import_prints_flags_that_build_the_imported_model(tmp_path):
    """The printed flags, given to pretrain_gpt.py, build the model the import describes."""
    from megatron.training.arguments import parse_args
    from megatron.training.training import model_spec
    random_model(tmp_path / "hf", llama_config())
    printed = convert(tmp_path / "hf", tmp_path / "ours")
    flags = printed.split("train with: ")[1].split()
    for flag in ("--swiglu", "--position-embedding-type", "--use-rope-scaling",
                 "--untie-embeddings-and-output-weights", "--group-query-attention"):
        assert flag in flags
    cfg = parse_args("gpt", flags + ["--data-path", "d", "--train-iters", "1",
                                     "--seq-length", "32"], has_cuda=False)
    _, spec = read_converted(str(tmp_path / "ours"))
    assert model_spec(cfg, spec.vocab_size) == padded_spec(spec, 256)


def unsupported(config, tmp_path, *extra):
    random_model(tmp_path / "hf", config)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                           "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "ours"),
                           *extra], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not os.path.exists(tmp_path / "ours")
    return done.stderr


def test_mistral_sliding_window_shorter_than_the_sequence_is_refused(tmp_path):
    config = mistral_config()
    config.sliding_window = 16
    err = unsupported(config, tmp_path)
    assert "sliding_window 16 is shorter than max_position_embeddings 32" in err
    assert "--seq-length 16" in err
    assert "sliding_window 16 is shorter than --seq-length 24" in unsupported(
        config, tmp_path / "again", "--seq-length", "24")
    convert(tmp_path / "hf", tmp_path / "fits", "--seq-length", "16")
    # a run loading the import is held to the window as well
    from megatron.training.arguments import parse_args
    from megatron.training.training import RunSetupError, check_imported_window

    def run_flags(seq_length):
        return parse_args("gpt", ["--num-layers", "1", "--hidden-size", "40",
                                  "--num-attention-heads", "4", "--train-iters", "1",
                                  "--data-path", str(tmp_path / "unread"),
                                  "--load", str(tmp_path / "fits"), "--finetune",
                                  "--seq-length", str(seq_length)], has_cuda=False)
    check_imported_window(run_flags(16))
    with pytest.raises(RunSetupError, match=r"reaches back 16 tokens .*--seq-length 24 would "
                                            r"compute another function"):
        check_imported_window(run_flags(24))


def test_variants_the_layers_do_not_compute_are_named(tmp_path):
    config = llama_config()
    config.hidden_act = "gelu"
    config.mlp_bias = True
    err = unsupported(config, tmp_path)
    assert "hidden_act 'gelu'" in err and "mlp_bias true" in err
    with pytest.raises(ConversionError, match="rope_type 'yarn'"):
        decoder_spec(transformers.LlamaConfig(
            num_attention_heads=4, hidden_size=32, rope_scaling={
                "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}))
