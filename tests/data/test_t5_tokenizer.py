"""T5SentencePieceTokenizer (issue 15): a T5 / FLAN-T5 `spiece.model` gives the ids of Hugging
Face's T5 tokenizer (pieces, eos appended, 100 sentinels counting down from the top, pad as the
decoder start), and the T5 data path trains on exactly those ids. No hub access: the
SentencePiece model is trained here with T5's layout (pad=0, eos=1, unk=2, no bos, NFKC)."""
import json

import numpy as np
import pytest
import torch

from megatron.data.flan_preprocess import preprocess_flan
from megatron.data.flan_synthetic import synthetic_samples
from megatron.data.multitask_dataset import MultiTaskDataset
from megatron.data.tokenizers import TokenizerError, build_tokenizer, train_sentencepiece

transformers = pytest.importorskip("transformers")

T5_TYPE = "T5SentencePieceTokenizer"
FLAN_LIKE = [
    "Translate to German: The cat sat on the mat.",
    "Premise: A man plays.\nHypothesis: Someone plays.\n\nOPTIONS:\n- yes\n- no",
    "The <extra_id_0> walks in <extra_id_1> park.",
    "<extra_id_0> cute dog <extra_id_1> the <extra_id_2>",
    "a<extra_id_99>b  c <extra_id_5>",
    "<extra_id_100> and <extra_id_05> are plain text",
    "a </s> b <pad> <unk> end",
    "  leading,   inner\tand trailing spaces  ",
    "Café naïve ﬁve ＡＢＣ ① 中文 ☃",
    "",
    "Q: 2 + 2? A: Let's think step by step. 2 + 2 = 4.",
]


def train_t5_spiece(texts, prefix, vocab_size):
    """A SentencePiece model with T5's layout (unigram, nmt_nfkc, pad=0 eos=1 unk=2, no bos,
    no sentinel pieces): what a T5 checkpoint's spiece.model is."""
    import sentencepiece as spm
    spm.set_random_generator_seed(1)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=vocab_size,
        model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>",
        eos_piece="</s>", unk_piece="<unk>", hard_vocab_limit=False, num_threads=1,
        minloglevel=2)
    return f"{prefix}.model"


def proto_fields(buf: bytes):
    """(field number, bytes or None) of a serialized protobuf message (wire format)."""
    def varint(i):
        value = shift = 0
        while True:
            value |= (buf[i] & 0x7F) << shift
            shift += 7
            i += 1
            if buf[i - 1] < 0x80:
                return value, i
    i = 0
    while i < len(buf):
        key, i = varint(i)
        kind = key & 7
        if kind == 2:
            size, i = varint(i)
            yield key >> 3, buf[i:i + size]
            i += size
        else:
            i = varint(i)[1] if kind == 0 else i + {1: 8, 5: 4}[kind]
            yield key >> 3, None


def hf_t5_tokenizer(model_file, extra_ids=100):
    """transformers' T5Tokenizer for a spiece.model, built as T5Tokenizer.from_pretrained does
    (tokenization_utils_tokenizers._convert_from_sentencepiece: SentencePieceExtractor.extract,
    then T5Converter.convert_from_spm). The extractor parses the model with protobuf, which
    this environment lacks, so its three outputs are read here: pieces and scores with the
    sentencepiece library, control pieces as special tokens, and the normalizer's
    precompiled_charsmap (ModelProto field 3, NormalizerSpec field 2) from the file."""
    import sentencepiece as spm
    from transformers.convert_slow_tokenizer import T5Converter
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    with open(model_file, "rb") as f:
        normalizer = [v for n, v in proto_fields(f.read()) if n == 3][0]
    charsmap = [v for n, v in proto_fields(normalizer) if n == 2]
    specials = [transformers.AddedToken(sp.id_to_piece(i), normalized=False, special=True)
                for i in range(sp.get_piece_size()) if sp.is_control(i)]
    kwargs = {"vocab": [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())],
              "unk_id": sp.unk_id(), "additional_special_tokens": specials,
              "_spm_precompiled_charsmap": charsmap[0] if charsmap else None,
              "extra_ids": extra_ids}
    return transformers.T5Tokenizer(**T5Converter.convert_from_spm(**kwargs))


def flan_texts(n=300, seed=3):
    return [t for s in synthetic_samples(n, seed=seed) for t in (s["inputs"], s["targets"])]


@pytest.fixture(scope="module")
def spiece(tmp_path_factory):
    return train_t5_spiece(flan_texts(), tmp_path_factory.mktemp("t5sp") / "spiece", 500)


@pytest.fixture(scope="module")
def hf(spiece):
    return hf_t5_tokenizer(spiece)


def test_ids_equal_hugging_faces_t5_tokenizer(spiece, hf):
    tok = build_tokenizer(T5_TYPE, tokenizer_model=spiece)
    texts = FLAN_LIKE + flan_texts(40, seed=11)
    for text in texts:
        assert tok.encode(text) == hf(text).input_ids, text
    assert tok.encode_batch(texts) == hf(texts).input_ids
    # sentinels really occur in the strings above, and unknown characters too
    ids = {i for t in FLAN_LIKE for i in tok.encode(t)}
    assert {tok.sentinel_ids[k] for k in (0, 1, 2, 5, 99)} <= ids and tok.unk in ids


def test_special_ids_and_vocab_size_are_hugging_faces(spiece, hf):
    tok = build_tokenizer(T5_TYPE, tokenizer_model=spiece)
    assert tok.vocab_size == len(hf) == 500 + 100
    assert (tok.pad, tok.eos, tok.unk, tok.bos) == (hf.pad_token_id, hf.eos_token_id,
                                                    hf.unk_token_id, None) == (0, 1, 2, None)
    assert tok.sentinel_ids == hf.convert_tokens_to_ids([f"<extra_id_{k}>" for k in range(100)])
    assert tok.additional_special_tokens_ids == tok.sentinel_ids
    assert tok.sentinel_ids[0] == tok.vocab_size - 1 and tok.sentinel_ids[99] == 500
    # FLAN-T5's config.json: decoder_start_token_id 0 = pad_token_id
    assert tok.decoder_start == transformers.T5Config().pad_token_id == tok.pad == 0
    assert tok.encode("x")[-1] == tok.eos and tok.encode("") == [tok.eos]
    assert tok.decode(tok.encode("The <extra_id_0> walks")[:-1]) == "The <extra_id_0> walks"


@pytest.mark.parametrize("extra_ids", [0, 7])
def test_vocab_extra_ids_sets_the_sentinel_count(spiece, extra_ids):
    tok = build_tokenizer(T5_TYPE, tokenizer_model=spiece, vocab_extra_ids=extra_ids)
    theirs = hf_t5_tokenizer(spiece, extra_ids)
    assert tok.vocab_size == len(theirs) == 500 + extra_ids
    text = "a <extra_id_0> b <extra_id_6> c <extra_id_7>"
    assert tok.encode(text) == theirs(text).input_ids


def test_bad_models_and_flags_are_clear_errors(spiece, tmp_path):
    with pytest.raises(TokenizerError, match="needs --tokenizer-model"):
        build_tokenizer(T5_TYPE)
    with pytest.raises(TokenizerError, match="not found"):
        build_tokenizer(T5_TYPE, tokenizer_model=str(tmp_path / "none.model"))
    with pytest.raises(TokenizerError, match="applies to --tokenizer-type T5Sentence"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=spiece, vocab_extra_ids=100)
    with pytest.raises(TokenizerError, match="must be >= 0"):
        build_tokenizer(T5_TYPE, tokenizer_model=spiece, vocab_extra_ids=-1)
    ours = train_sentencepiece(flan_texts(), str(tmp_path / "own"), vocab_size=600)["model"]
    with pytest.raises(TokenizerError, match="already holds <extra_id_0>"):
        build_tokenizer(T5_TYPE, tokenizer_model=ours)


def test_gpt_refuses_the_t5_tokenizer(spiece, capsys):
    from megatron.training.arguments import parse_args
    argv = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
            "--train-iters", "1", "--data-path", "x", "--tokenizer-model", spiece,
            "--tokenizer-type", T5_TYPE]
    with pytest.raises(SystemExit):
        parse_args("gpt", argv, has_cuda=False)
    assert "T5SentencePieceTokenizer is for pretrain_t5.py" in capsys.readouterr().err
    cfg = parse_args("t5", argv + ["--vocab-extra-ids", "100"], has_cuda=False)
    assert cfg.vocab_extra_ids == 100 and cfg.make_vocab_size_divisible_by == 128


def write_flan(path, records):
    with open(path, "w") as f:
        for inputs, targets in records:
            f.write(json.dumps({"inputs": inputs, "targets": targets, "task_name": "t"}) + "\n")


def test_t5_view_of_preprocessed_data_is_hugging_faces(spiece, hf, tmp_path):
    """Encoder ids = HF's input_ids; labels = HF's labels (target ids ending in eos); decoder
    input = [pad] + labels[:-1], what HF's T5 feeds its decoder (shift_right); a cut keeps the
    eos last as HF's truncation does."""
    samples = synthetic_samples(30, seed=5)
    records = [(s["inputs"], s["targets"]) for s in samples]
    write_flan(tmp_path / "flan.jsonl", records)
    spec = {"tokenizer_type": T5_TYPE, "tokenizer_model": spiece}
    preprocess_flan([str(tmp_path / "flan.jsonl")], str(tmp_path / "flan"), spec,
                    progress=False)
    ds = MultiTaskDataset(str(tmp_path / "flan"))
    assert ds.appends_eos and ds.decoder_start == 0 and ds.vocab_size == len(hf)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(   # FLAN-T5's ids
        vocab_size=len(hf), d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    cut = 0
    for enc_len, dec_len in ((512, 128), (24, 6)):
        lengths = ds.t5_lengths(enc_len, dec_len)
        for i, (inputs, targets) in enumerate(records):
            s = ds.t5_sample(i, enc_len, dec_len)
            enc = hf(inputs, truncation=True, max_length=enc_len).input_ids
            labels = hf(targets, truncation=True, max_length=dec_len).input_ids
            assert s.encoder_ids.tolist() == enc and s.labels.tolist() == labels
            shifted = model.prepare_decoder_input_ids_from_labels(torch.tensor([labels]))
            assert s.decoder_ids.tolist() == shifted[0].tolist()
            assert [len(s.encoder_ids), len(s.decoder_ids)] == lengths[i].tolist()
            cut += s.truncated
        report = ds.t5_truncation(enc_len, dec_len)
        assert report["truncated"] == sum(ds.t5_sample(i, enc_len, dec_len).truncated
                                          for i in range(len(ds)))
    assert cut > 0      # the short lengths did cut samples


def test_padded_vocab_size_follows_make_vocab_size_divisible_by():
    from megatron.training.training import padded_vocab_size
    # FLAN-T5: 32000 pieces + 100 sentinels; HF's checkpoint has 32128 rows
    assert padded_vocab_size(32100, 1) == 32128 and padded_vocab_size(32100, 2) == 32256
    assert padded_vocab_size(32100, 1, 64) == padded_vocab_size(32100, 2, 64) == 32128
    assert np.all([padded_vocab_size(v, tp, d) % (d * tp) == 0
                   for v in (1, 350, 32100) for tp in (1, 2, 4) for d in (1, 64, 128)])
