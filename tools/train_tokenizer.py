#!/usr/bin/env python
"""Train a tokenizer on the inputs and targets of FLAN dump files: the T5-style SentencePiece
model (pad=0, eos=1, unk=2, bos=3, 100 <extra_id_N> sentinels; writes PREFIX.model and
PREFIX.vocab for --tokenizer-type SentencePieceTokenizer --tokenizer-model PREFIX.model), or with
--tokenizer-type HuggingFaceTokenizer a Llama 3-style byte-level BPE (writes DIR/tokenizer.json
and DIR/tokenizer_config.json for --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.flan_records import BadInputError, ReadCounts, read_records  # noqa: E402
from megatron.data.tokenizers import (TokenizerError, build_tokenizer,  # noqa: E402
                                      train_hf_tokenizer, train_sentencepiece)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", nargs="+", required=True,
                        help="dump files: .jsonl, .jsonl.gz, or .parquet (needs pyarrow)")
    parser.add_argument("--tokenizer-type", default="SentencePieceTokenizer",
                        choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"))
    parser.add_argument("--model-prefix", required=True,
                        help="writes PREFIX.model/.vocab (HuggingFaceTokenizer: the directory "
                             "PREFIX/ with tokenizer.json and tokenizer_config.json)")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--max-pieces", type=int, default=2_000_000,
                        help="text pieces sampled for training (uniformly, seeded)")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip bad lines (counted) instead of stopping")
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.tokenizer_type == "HuggingFaceTokenizer" and args.vocab_size < 256 + 2 + 10:
        parser.error("--vocab-size must leave room for 256 byte tokens and bos / eos (>= 268)")
    if args.tokenizer_type == "SentencePieceTokenizer" and args.vocab_size < 256 + 104 + 10:
        parser.error("--vocab-size must leave room for 256 byte pieces, 4 specials and 100 "
                     "sentinels (>= 370)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    counts = ReadCounts()
    texts = (t for rec in read_records(args.input, counts, skip_bad=args.skip_bad)
             for t in (rec.inputs, rec.targets))
    try:
        if args.tokenizer_type == "HuggingFaceTokenizer":
            info = train_hf_tokenizer(texts, args.model_prefix, args.vocab_size)
            written = info["directory"]
        else:
            info = train_sentencepiece(texts, args.model_prefix, args.vocab_size, args.seed,
                                       args.max_pieces, args.num_threads)
            written = info["model"]
    except (BadInputError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tok = build_tokenizer(args.tokenizer_type, tokenizer_model=written)
    print(f"lines read {counts.read}, rejected {dict(counts.rejected)}, files rejected "
          f"{dict(counts.files_rejected)}")
    if "pieces_used" in info:
        print(f"trained on {info['pieces_used']} of {info['pieces_seen']} text pieces")
    print(f"vocab size {tok.vocab_size}; wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
