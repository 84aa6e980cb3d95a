"""T5 v1.1 / FLAN-T5 checkpoints in and out (issue 15): a random-initialised
T5ForConditionalGeneration (gated GeLU, RMSNorm, no biases, relative position buckets, untied
head) imported with tools/convert_checkpoint.py gives the same logits in our stage modules as
in transformers (fp32, within 1e-4 of the logit scale), at TP=1 and TP=2 x PP=2; exporting the
import gives back the same tensors; fine-tuned on data tokenised with T5SentencePieceTokenizer,
its first loss is transformers' loss on the same texts."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron.checkpoint.hf_convert import (ConversionError, pack_per_head, padded_spec,
                                            read_converted, read_hf, unpack_per_head)
from tests.multiproc import run_in_processes, single_process_world
from tests.integration.test_hf_convert import TOLERANCE, assert_close_logits, convert
from tests.training.test_training import sp_dataset  # noqa: F401  (fixture)

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (enc layers, dec layers, d_model, heads, d_kv, d_ff, vocab, buckets, max distance):
# 3 heads; d_kv * heads != d_model as in FLAN-T5-small; distances beyond max_distance
T5_CONFIGS = [(2, 2, 24, 3, 8, 40, 256, 8, 12), (1, 3, 32, 3, 12, 64, 200, 32, 128),
              (2, 2, 48, 4, 12, 96, 256, 16, 6)]


def random_t5(directory, enc, dec, d_model, heads, d_kv, d_ff, vocab, buckets, distance,
              seed=0):
    """A T5 v1.1 style model with every weight random (norms too, and an lm_head of its own),
    saved with save_pretrained. transformers >= 5 ties lm_head to `shared` whatever
    T5Config(tie_word_embeddings=False) says, so the untied head is set up by hand (as
    hf_convert.t5_model does; flan_t5_dir writes one without transformers)."""
    torch.manual_seed(seed)
    config = transformers.T5Config(
        vocab_size=vocab, d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=enc,
        num_decoder_layers=dec, num_heads=heads, relative_attention_num_buckets=buckets,
        relative_attention_max_distance=distance, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)    # FLAN-T5's config.json
    config.tie_word_embeddings = False
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.set_input_embeddings(model.shared)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert model.lm_head.weight is not model.shared.weight
    assert not torch.equal(model.lm_head.weight, model.shared.weight)
    model.save_pretrained(directory)
    return model


def t5_inputs(vocab, rows=3, enc_seq=17, dec_seq=9, seed=1):
    rng = np.random.default_rng(seed)
    return (torch.from_numpy(rng.integers(0, vocab, (rows, enc_seq))),
            torch.from_numpy(rng.integers(0, vocab, (rows, dec_seq))))


def t5_batch(enc, dec):
    """Micro-batch tensors of whole samples, one per row (no labels: logits)."""
    from megatron.model.batch_tensors import build_micro_batch, unsplit_micro_batch
    samples = {i: (e.numpy(), d.numpy(), d.numpy(), np.ones(len(d), np.float32))
               for i, (e, d) in enumerate(zip(enc, dec))}
    batch = build_micro_batch(unsplit_micro_batch(sorted(samples), samples, "t5"), samples,
                              "t5", 0)
    batch.pop("labels")
    return batch


def hf_logits(model, enc, dec):
    with torch.no_grad():
        return model(input_ids=enc, decoder_input_ids=dec).logits


def test_per_head_packing_is_invertible():
    heads, d = 3, 2
    q, k, v = (torch.arange(heads * d) + 100 * i for i in range(3))
    packed = pack_per_head([q, k, v], heads)
    assert packed[6:12].tolist() == [2, 3, 102, 103, 202, 203]    # head 1: q, k, v
    assert all(torch.equal(a, b) for a, b in zip(unpack_per_head(packed, 3, heads), (q, k, v)))


@pytest.mark.parametrize("shape", T5_CONFIGS)
def test_t5_logits_match_transformers_tp1(tmp_path, shape):
    from megatron.model.full_state import load_full_state
    from megatron.model.stages import build_rank_stages, build_transformer_config, \
        stage_parameters
    model = random_t5(tmp_path / "hf", *shape)
    enc, dec = t5_inputs(shape[6])
    theirs = hf_logits(model, enc, dec)
    full, args = read_hf(str(tmp_path / "hf"))
    torch.set_num_threads(1)
    with single_process_world(seed=3):
        spec = padded_spec(args)
        stages = build_rank_stages(spec, (0,), 0, build_transformer_config(spec),
                                   tie_embeddings=False)
        assert load_full_state(stage_parameters(stages), full, 0, 1, "import") == len(full)
        with torch.no_grad():
            ours = stages[0]((), t5_batch(enc, dec)).transpose(0, 1)
        # without the relative position bias the logits differ: the bias is used
        for name in ("encoder_relative_pos", "decoder_relative_pos"):
            getattr(stages[0], name).relative_attention_bias.weight.data.zero_()
        with torch.no_grad():
            wrong = stages[0]((), t5_batch(enc, dec)).transpose(0, 1)
    assert_close_logits(ours, theirs)
    assert float((wrong - theirs).abs().max()) > 100 * TOLERANCE * float(theirs.abs().max())


def test_unsupported_t5_variant_is_a_clear_error(tmp_path):
    config = transformers.T5Config(vocab_size=64, d_model=8, d_kv=4, d_ff=16, num_layers=1,
                                   num_heads=2, feed_forward_proj="relu")
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    with pytest.raises(ConversionError, match="feed_forward_proj .relu.*rescaled tied output"):
        read_hf(str(tmp_path / "t5"))


def parallel_t5_logits_worker(rank, world_size, converted_dir, enc, dec):
    """TP=2 x PP=2: every rank loads its slices of the converted full state (gated fc1 halves
    and relative-bias heads split by TP); the first stage sends its outputs on; the last
    stage's TP ranks gather the vocabulary slices. Returns [rows, seq, vocab] there."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dynapipe_ext.costs.model_spec import stage_output_shapes
    from megatron.model.full_state import load_full_state
    from megatron.model.stages import build_rank_stages, build_transformer_config, \
        stage_parameters
    from megatron.base.distributed_setup import setup_model_parallel
    full, args = read_converted(converted_dir)
    layout = setup_model_parallel(2, 2, seed=3, timeout_s=120)
    spec = padded_spec(args, full["embedding.word_embeddings.weight"].shape[0])
    stages = build_rank_stages(spec, (0, 1), layout.pp_rank,
                               build_transformer_config(spec, tp=2, pp=2), tie_embeddings=False)
    load_full_state(stage_parameters(stages), full, layout.tp_rank, 2, converted_dir)
    batch = t5_batch(enc, dec)
    pipe = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    with torch.no_grad():
        if layout.pp_rank == 0:
            for t in stages[0]((), batch):
                dist.send(t.contiguous(), pipe[1])
            return None
        shapes = stage_output_shapes(spec.stage_layers(2)[0], enc.shape[0], enc.shape[1],
                                     dec.shape[1], spec.hidden_size)
        inputs = tuple(torch.empty(shape) for shape in shapes)
        for t in inputs:
            dist.recv(t, pipe[0])
        part = stages[1](inputs, batch)
        parts = [torch.empty_like(part) for _ in range(2)]
        dist.all_gather(parts, part.contiguous(),
                        group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1).transpose(0, 1).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("shape", [T5_CONFIGS[2], (1, 3, 32, 6, 12, 64, 200, 32, 128)])
def test_t5_logits_match_transformers_tp2_pp2(tmp_path, shape):
    vocab = shape[6]
    model = random_t5(tmp_path / "hf", *shape)
    enc, dec = t5_inputs(vocab)
    theirs = hf_logits(model, enc, dec)
    out = convert(tmp_path / "hf", tmp_path / "ours", "--target-tensor-parallel-size", "2")
    assert "--normalization RMSNorm --norm-epsilon 1e-06 --disable-bias-linear --gated-gelu" \
        in out and "--position-embedding-type relative" in out
    results = run_in_processes(parallel_t5_logits_worker, 4,
                               (str(tmp_path / "ours"), enc, dec), timeout_s=300)
    last = [r for r in results if r is not None]
    assert len(last) == 2 and np.array_equal(last[0], last[1])
    ours = torch.from_numpy(last[0])
    assert ours.shape[-1] == 256                   # padded to a multiple of 128 x TP
    assert_close_logits(ours[..., :vocab], theirs)


def test_t5_export_then_import_is_identity(tmp_path):
    random_t5(tmp_path / "hf", *T5_CONFIGS[1])
    convert(tmp_path / "hf", tmp_path / "ours", "--target-tensor-parallel-size", "2")
    full, _ = read_converted(str(tmp_path / "ours"))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                           "--to-hf", str(tmp_path / "ours"), "--to", str(tmp_path / "back")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    load = transformers.T5ForConditionalGeneration.from_pretrained
    a, b = load(tmp_path / "hf").state_dict(), load(tmp_path / "back").state_dict()
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    again, _ = read_hf(str(tmp_path / "back"))
    assert sorted(again) == sorted(full)
    assert all(torch.equal(again[k], full[k][:len(again[k])]) for k in full)


T5_V11_FLAGS = ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--disable-bias-linear",
                "--gated-gelu", "--softmax-scale", "1.0", "--kv-channels", "8",
                "--position-embedding-type", "relative", "--relative-attention-num-buckets",
                "8", "--relative-attention-max-distance", "32",
                "--untie-embeddings-and-output-weights"]


@pytest.mark.slow
def test_t5_v11_options_train_at_pp2_and_keep_replicated_copies_equal(sp_dataset, tmp_path):
    """pretrain_t5.py with every T5 v1.1 option at PP=2: 3 encoder layers + 1 decoder layer
    put encoder layers on both stages, so both hold a copy of the encoder's relative-bias
    table (and of the input embedding, used by the decoder on stage 1); the loss falls and
    the saved copies are still equal (their gradients were summed over the pipeline; without
    that sum this test fails: the copies drift apart)."""
    from megatron.checkpoint import checkpointing as ckpt
    from tests.training.test_training import TINY_MODEL, torchrun
    args = sp_dataset + TINY_MODEL + T5_V11_FLAGS + [
        "--pipeline-model-parallel-size", "2", "--num-layers", "3", "--decoder-num-layers", "1",
        "--encoder-seq-length", "128", "--decoder-seq-length", "32", "--train-iters", "6",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "6"]
    stats = torchrun("pretrain_t5.py", args, tmp_path / "t5.jsonl")
    losses = [s["loss"] for s in stats]
    assert max(losses[-2:]) < losses[0], f"loss did not decrease: {losses}"
    common = ckpt.read_common(str(tmp_path / "ckpt"))
    # the untied model's input embedding is shared by the encoder (stage 0) and the decoder
    # (stage 1), like the encoder's relative-bias table: two copies each, still equal
    names = {"encoder_relative_pos.relative_attention_bias.weight",
             "embedding.word_embeddings.weight"}
    model, _ = ckpt.read_shards(str(tmp_path / "ckpt"), 6, common, names, False)
    for name in names:
        copies = [s["tensor"] for s in model[name]]
        assert len(copies) == 2 and torch.equal(copies[0], copies[1]), name
    assert "decoder_relative_pos.relative_attention_bias.weight" in ckpt.read_full_model_state(
        str(tmp_path / "ckpt"))


@pytest.mark.slow
def test_converted_t5_v11_finetunes_at_pp2_from_its_weights(sp_dataset, tmp_path):  # noqa: F811
    """An imported T5 v1.1 is a layout-free checkpoint: pretrain_t5.py with the flags the
    converter prints, `--load DIR --finetune` at PP=2, starts from the imported weights (after
    one step at a negligible LR every saved tensor still equals the import)."""
    from megatron.checkpoint.checkpointing import read_full_model_state
    from tests.training.test_training import torchrun
    random_t5(tmp_path / "hf", 2, 2, 32, 2, 16, 64, 1000, 8, 32)
    printed = convert(tmp_path / "hf", tmp_path / "ours")
    flags = printed.split("train with: ")[1].split()
    imported = read_full_model_state(str(tmp_path / "ours"))
    args = sp_dataset + flags + [
        "--pipeline-model-parallel-size", "2", "--encoder-seq-length", "128",
        "--decoder-seq-length", "32", "--tokens-per-global-batch", "1024", "--train-iters", "1",
        "--lr", "1e-12", "--min-lr", "0", "--num-planner-workers", "0",
        "--load", str(tmp_path / "ours"), "--finetune",
        "--save", str(tmp_path / "run"), "--save-interval", "1"]
    stats = torchrun("pretrain_t5.py", args, tmp_path / "t5.jsonl", timeout=400)
    assert [s["iteration"] for s in stats] == [1]
    trained = read_full_model_state(str(tmp_path / "run"))
    assert trained.keys() == imported.keys()
    for name, value in imported.items():
        assert torch.allclose(trained[name], value, atol=1e-6), name


@pytest.fixture(scope="module")
def t5_flan(tmp_path_factory):
    """FLAN-like data preprocessed with --tokenizer-type T5SentencePieceTokenizer and a T5
    spiece.model of 250 pieces: 350 tokens, which a T5 checkpoint pads to 384 rows (3 x 128,
    as FLAN-T5's 32100 tokens are 32128 = 251 x 128 rows)."""
    from megatron.data.flan_records import ReadCounts, read_records
    from tests.data.test_t5_tokenizer import train_t5_spiece
    from tests.training.test_training import run_tool
    d = tmp_path_factory.mktemp("t5flan")
    run_tool("tools/make_flan_sample.py", "--output", str(d / "flan.jsonl"),
             "--num-samples", "300", "--seed", "7")
    records = list(read_records([str(d / "flan.jsonl")], ReadCounts()))
    spiece = train_t5_spiece([t for r in records for t in (r.inputs, r.targets)],
                             d / "spiece", 250)
    tokenizer = ["--tokenizer-type", "T5SentencePieceTokenizer", "--tokenizer-model", spiece]
    run_tool("tools/preprocess_flan.py", "--input", str(d / "flan.jsonl"), "--output-prefix",
             str(d / "flan"), *tokenizer, "--no-progress")
    return {"records": records, "spiece": spiece,
            "args": ["--data-path", str(d / "flan"), *tokenizer]}


@pytest.mark.slow
def test_imported_t5_v11_finetunes_at_tp2_on_t5_tokenized_data_with_hf_loss(t5_flan,
                                                                             tmp_path):
    """The README's FLAN-T5 recipe end to end: data preprocessed with T5SentencePieceTokenizer,
    a T5 v1.1 imported at TP=1 (384 vocabulary rows, the checkpoint's own), fine-tuned at TP=2
    with --make-vocab-size-divisible-by 64 (which pads 350 tokens to the same 384 rows; the
    default 128 would pad to 512 at TP=2). The first iteration's loss equals what transformers
    computes for the same samples from their raw text with its own T5 tokenizer (eos-ended
    labels, decoder input shifted right from pad): tokenizer, data path and model agree."""
    from megatron.training.arguments import parse_args
    from megatron.training.training import open_training_data
    from tests.data.test_t5_tokenizer import hf_t5_tokenizer
    from tests.training.test_training import torchrun
    model = random_t5(tmp_path / "hf", 2, 2, 32, 2, 16, 64, 384, 8, 32)
    printed = convert(tmp_path / "hf", tmp_path / "ours")
    assert "vocabulary 384 padded to 384" in printed
    flags = printed.split("train with: ")[1].split()
    enc_len, dec_len = 128, 32
    args = t5_flan["args"] + flags + [
        "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64",
        "--encoder-seq-length", str(enc_len), "--decoder-seq-length", str(dec_len),
        "--tokens-per-global-batch", "1024", "--train-iters", "2", "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-planner-workers", "0",
        "--load", str(tmp_path / "ours"), "--finetune", "--save", str(tmp_path / "run")]
    stats = torchrun("pretrain_t5.py", args, tmp_path / "t5.jsonl", timeout=400)
    assert [s["iteration"] for s in stats] == [1, 2]
    assert all(np.isfinite(s["loss"]) for s in stats)
    # the run exports with the import's model flags; transformers reads the tuned weights
    export_run(tmp_path / "run", tmp_path / "ours", tmp_path / "back")
    back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "back")
    tuned = read_converted(str(tmp_path / "run"), str(tmp_path / "ours"))[0]
    assert torch.equal(back.lm_head.weight, tuned["output_layer.weight"][:384])
    assert not torch.equal(back.lm_head.weight, model.lm_head.weight)
    assert back.config.decoder_start_token_id == back.config.pad_token_id == 0

    data = open_training_data(parse_args("t5", args, has_cuda=False))
    assert len(data.dataset) == len(t5_flan["records"])     # sample i is line i
    hf = hf_t5_tokenizer(t5_flan["spiece"])
    total = count = 0.0
    with torch.no_grad():
        for i in data.sample_ids(0):
            rec = t5_flan["records"][int(i)]
            enc = hf(rec.inputs, truncation=True, max_length=enc_len, return_tensors="pt")
            labels = hf(rec.targets, truncation=True, max_length=dec_len,
                        return_tensors="pt").input_ids
            loss = model(input_ids=enc.input_ids, labels=labels).loss
            total += float(loss) * labels.shape[1]
            count += labels.shape[1]
    reference = total / count
    assert abs(stats[0]["loss"] - reference) <= 1e-5 * reference, (stats[0]["loss"], reference)


def export_run(run_dir, converted_dir, out_dir):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                           "--to-hf", str(run_dir), "--model-args", str(converted_dir),
                           "--to", str(out_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_exporting_a_run_needs_the_model_args_of_its_model(tmp_path):
    """A training run's --save directory has no model_args.json: exporting it without
    --model-args, or with the flags of another model, is a one-line error saying so."""
    import shutil
    random_t5(tmp_path / "hf", *T5_CONFIGS[0])
    random_t5(tmp_path / "hf2", *T5_CONFIGS[1])
    convert(tmp_path / "hf", tmp_path / "ours")
    convert(tmp_path / "hf2", tmp_path / "other")
    shutil.copytree(tmp_path / "ours", tmp_path / "run")
    os.remove(tmp_path / "run" / "model_args.json")     # what a --save directory looks like
    tool = [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
            "--to-hf", str(tmp_path / "run"), "--to", str(tmp_path / "back")]
    done = subprocess.run(tool, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "give --model-args DIR" in done.stderr, done.stderr
    done = subprocess.run(tool + ["--model-args", str(tmp_path / "other")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1 and "holds another model" in done.stderr \
        and "--num-layers: saved 2, now 1" in done.stderr, done.stderr
    export_run(tmp_path / "run", tmp_path / "ours", tmp_path / "back")
    a = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").state_dict()
    b = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "back").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def flan_t5_dir(directory, enc=2, dec=3, d_model=32, heads=4, d_kv=12, d_ff=48, vocab=300,
                buckets=16, distance=20, seed=5):
    """A directory shaped like google/flan-t5-*'s, written without transformers' save path: its
    config.json (the fields FLAN-T5's has, dropout 0.1, tie_word_embeddings false) and a
    model.safetensors with every tensor random, lm_head.weight its own and the encoder's and
    decoder's embed_tokens copies of shared.weight (as FLAN-T5's files hold them)."""
    import json

    from safetensors.torch import save_file
    config = {"architectures": ["T5ForConditionalGeneration"], "d_ff": d_ff, "d_kv": d_kv,
              "d_model": d_model, "decoder_start_token_id": 0, "dense_act_fn": "gelu_new",
              "dropout_rate": 0.1, "eos_token_id": 1, "feed_forward_proj": "gated-gelu",
              "initializer_factor": 1.0, "is_encoder_decoder": True, "is_gated_act": True,
              "layer_norm_epsilon": 1e-06, "model_type": "t5", "n_positions": 512,
              "num_decoder_layers": dec, "num_heads": heads, "num_layers": enc,
              "output_past": True, "pad_token_id": 0,
              "relative_attention_max_distance": distance,
              "relative_attention_num_buckets": buckets, "tie_word_embeddings": False,
              "torch_dtype": "float32", "transformers_version": "4.23.1", "use_cache": True,
              "vocab_size": vocab}
    g = torch.Generator().manual_seed(seed)
    inner, tensors = heads * d_kv, {}

    def add(name, *shape, scale=0.1, base=0.0):
        tensors[name] = base + scale * torch.randn(*shape, generator=g)

    add("shared.weight", vocab, d_model, scale=1.0)
    add("lm_head.weight", vocab, d_model)
    for stack, layers in (("encoder", enc), ("decoder", dec)):
        tensors[f"{stack}.embed_tokens.weight"] = tensors["shared.weight"].clone()
        add(f"{stack}.final_layer_norm.weight", d_model, base=1.0)
        add(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            buckets, heads)
        for i in range(layers):
            b = f"{stack}.block.{i}.layer."
            attentions = ["SelfAttention"] + (["EncDecAttention"] if stack == "decoder" else [])
            for j, attention in enumerate(attentions):
                add(f"{b}{j}.layer_norm.weight", d_model, base=1.0)
                for x in "qkv":
                    add(f"{b}{j}.{attention}.{x}.weight", inner, d_model)
                add(f"{b}{j}.{attention}.o.weight", d_model, inner)
            mlp = len(attentions)
            add(f"{b}{mlp}.layer_norm.weight", d_model, base=1.0)
            add(f"{b}{mlp}.DenseReluDense.wi_0.weight", d_ff, d_model)
            add(f"{b}{mlp}.DenseReluDense.wi_1.weight", d_ff, d_model)
            add(f"{b}{mlp}.DenseReluDense.wo.weight", d_model, d_ff)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return config, tensors


def test_flan_t5_shaped_round_trip_keeps_every_tensor_and_the_untied_head(tmp_path):
    """HF -> ours (TP=2 padding) -> HF: the exported files hold every tensor of the source bit
    for bit (lm_head.weight its own, not the embedding), config.json says the head is untied
    and keeps the source's other fields (dropout 0.1, n_positions), transformers loads it
    untied, and its logits are the source's."""
    import json

    from safetensors.torch import load_file
    config, source = flan_t5_dir(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "ours", "--target-tensor-parallel-size", "2")
    assert "vocabulary 300 padded to 512" in out
    export_run(tmp_path / "ours", tmp_path / "ours", tmp_path / "back")
    written = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert "lm_head.weight" in written and "shared.weight" in written
    for name, tensor in source.items():
        # transformers writes a tied tensor once: embed_tokens are shared.weight
        stored = written.get(name, written["shared.weight"] if "embed_tokens" in name else None)
        assert stored is not None, f"{name} not exported"
        assert stored.dtype == tensor.dtype and torch.equal(stored, tensor), name
    assert set(written) <= set(source)
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["tie_word_embeddings"] is False
    for field in ("dropout_rate", "n_positions", "output_past", "decoder_start_token_id",
                  "relative_attention_num_buckets", "relative_attention_max_distance"):
        assert saved[field] == config[field], field

    load = transformers.T5ForConditionalGeneration.from_pretrained
    original, back = load(tmp_path / "hf").eval(), load(tmp_path / "back").eval()
    assert back.lm_head.weight is not back.shared.weight
    assert back.encoder.embed_tokens.weight is back.shared.weight
    assert torch.equal(back.lm_head.weight, source["lm_head.weight"])
    assert not back.config.scale_decoder_outputs and back.config.dropout_rate == 0.1
    enc, dec = t5_inputs(config["vocab_size"])
    assert torch.equal(hf_logits(back, enc, dec), hf_logits(original, enc, dec))


def test_a_t5_import_loaded_with_other_layer_flags_is_refused(tmp_path):
    """The converted checkpoint records the flags it must be trained with (issue 26: without
    --softmax-scale 1.0, or with another --relative-attention-max-distance, a T5 import
    trained silently at another loss): a run that differs is told the flag and both values;
    one with the printed flags matches."""
    from megatron.checkpoint import checkpointing as ckpt
    from megatron.training.arguments import parse_args
    random_t5(tmp_path / "hf", *T5_CONFIGS[0])
    printed = convert(tmp_path / "hf", tmp_path / "ours")
    flags = printed.split("train with: ")[1].split()
    common = ckpt.read_common(str(tmp_path / "ours"))
    run = ["--train-iters", "1", "--data-path", "unused"]

    def differences(model_flags):
        signature = ckpt.model_signature(parse_args("t5", run + model_flags, has_cuda=False))
        return ckpt.signature_differences(common["config"], dict(signature, vocab_size=256))

    assert differences(flags) == []
    at = flags.index("--softmax-scale")
    assert differences(flags[:at] + flags[at + 2:]) == ["--softmax-scale: saved 1.0, now None"]
    at = flags.index("--relative-attention-max-distance")
    other = flags[:at + 1] + ["128"] + flags[at + 2:]
    assert differences(other) == ["--relative-attention-max-distance: saved 12, now 128"]
    assert "the vocabulary (tokens of the tokenizer, before padding): saved 256, now 250" in \
        ckpt.signature_differences(common["config"], dict(common["config"], vocab_size=250))
