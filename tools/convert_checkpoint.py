"""Convert Hugging Face GPT-2, T5 v1.1 / FLAN-T5, Llama, Qwen2 and Mistral checkpoints to this
project's model state and back (megatron/checkpoint/hf_convert.py does the mapping).

    # import: a save_pretrained directory on disk -> a directory that training loads
    python tools/convert_checkpoint.py --from-hf /models/gpt2 --to /ckpt/gpt2-import \\
        [--target-tensor-parallel-size 2] [--untie-embeddings-and-output-weights]
    # export: a converted directory -> a save_pretrained directory
    python tools/convert_checkpoint.py --to-hf /ckpt/gpt2-import --to /models/gpt2-back
    # export a run fine-tuned from it (pretrain_*.py --load /ckpt/gpt2-import --save /runs/x)
    python tools/convert_checkpoint.py --to-hf /runs/x --model-args /ckpt/gpt2-import \
        --to /models/gpt2-tuned

The import pads the vocabulary to what a training run at --target-tensor-parallel-size and
--make-vocab-size-divisible-by builds (training.padded_vocab_size) and prints the model flags to
train with. Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# one line of output per outcome: no notices from megatron-core's imports or transformers
warnings.filterwarnings(
    "ignore", message=r".*(Apex|Transformer Engine)( and Apex)? (is|are) not installed")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from megatron.checkpoint.hf_convert import (ConversionError, fit_vocab, read_converted,  # noqa: E402
                                       read_hf, read_source_config,
                                       write_converted, write_hf)
from megatron.checkpoint.hf_convert import check_hf_source  # noqa: E402
from megatron.training.arguments import VOCAB_MULTIPLE, add_flag_group, training_flags  # noqa: E402
from megatron.checkpoint.checkpointing import CheckpointError, start_over  # noqa: E402
from megatron.training.training import padded_vocab_size  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="transformers checkpoint directory")
    src.add_argument("--to-hf", metavar="DIR",
                     help="a directory this tool converted into, or a training run's --save "
                          "directory (with --model-args)")
    p.add_argument("--to", metavar="DIR", required=True,
                   help="output directory: new or empty, unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a --to that is not empty: an import sets the checkpoints "
                        "there aside (iter_N.abandoned), an export replaces the files it writes")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1,
                   help="pad the vocabulary as a run at this TP does (default 1)")
    add_flag_group(p, "data", ["make_vocab_size_divisible_by"], title="",
                   make_vocab_size_divisible_by=dict(
                       help="pad the vocabulary as a run with this value does (default "
                            f"{VOCAB_MULTIPLE}, Megatron's); the run must be given the same"))
    p.add_argument("--model-args", metavar="DIR", default=None,
                   help="export: the converted directory whose model_args.json describes the "
                        "model (default: the --to-hf directory); give it to export a training "
                        "run fine-tuned from that import")
    add_flag_group(p, "model", ["untie_embeddings_and_output_weights", "seq_length"], title="",
                   untie_embeddings_and_output_weights=dict(
                       help="import: give the output layer its own copy of the embedding"),
                   seq_length=dict(help="import: the longest sequence the run will train on; "
                                        "a Mistral / Qwen2 sliding window must cover it "
                                        "(default: the config's max_position_embeddings)"))
    a = p.parse_args(argv)
    if a.make_vocab_size_divisible_by < 1 or a.target_tensor_parallel_size < 1:
        p.error("--make-vocab-size-divisible-by and --target-tensor-parallel-size must be >= 1")
    if a.model_args and not a.to_hf:
        p.error("--model-args is for --to-hf (export)")
    held = sorted(os.listdir(a.to)) if os.path.isdir(a.to) else []
    if held and not a.overwrite:
        p.error(f"--to {a.to} is not empty ({len(held)} entries: {', '.join(held[:4])}"
                f"{', ...' if len(held) > 4 else ''}); pick a new folder, or pass --overwrite "
                f"to replace what is there")
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()      # one line of output, not loading / writing bars
    try:
        if a.from_hf:
            check_hf_source(a.from_hf)
            full, args = read_hf(a.from_hf, untie=a.untie_embeddings_and_output_weights,
                                 seq_length=a.seq_length)
            rows = padded_vocab_size(args.vocab_size, a.target_tensor_parallel_size,
                                     a.make_vocab_size_divisible_by)
            with open(os.path.join(a.from_hf, "config.json")) as f:
                source = json.load(f)
            if held:
                for moved in start_over(a.to):
                    print(f"--overwrite: set aside {moved}")
            path = write_converted(fit_vocab(full, rows, a.from_hf), args, a.to, source)
            flags = training_flags(args)
            if a.make_vocab_size_divisible_by != VOCAB_MULTIPLE:
                flags += f" --make-vocab-size-divisible-by {a.make_vocab_size_divisible_by}"
            print(f"wrote {path} ({len(full)} tensors, vocabulary {args.vocab_size} padded to "
                  f"{rows}); train with: {flags}")
        else:
            full, args = read_converted(a.to_hf, a.model_args)
            write_hf(full, args, a.to, read_source_config(a.model_args or a.to_hf))
            print(f"wrote a transformers checkpoint to {a.to}")
    except (ConversionError, CheckpointError, OSError) as err:
        print(f"convert_checkpoint: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
