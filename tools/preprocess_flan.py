#!/usr/bin/env python
"""Tokenise FLANv2-style dumps (.jsonl, .jsonl.gz, .parquet) into a multi-task dataset at an
output prefix P: the manifest P_tasks.json and the folder it names, P.data-<id>/ (Megatron
indexed datasets inputs.bin/.idx and targets.bin/.idx, task_ids.npy, summary.json).
The new dataset replaces an old one at P in one atomic step. See docs/DATA.md."""
import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.flan_indexed import DatasetWriteError  # noqa: E402
from megatron.data.flan_preprocess import format_summary, preprocess_flan  # noqa: E402
from megatron.data.flan_records import TASK_FIELDS, BadInputError  # noqa: E402
from megatron.data.tokenizers import (TokenizerError, add_tokenizer_args,  # noqa: E402
                                      tokenizer_spec_from_args)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True,
                       help="dump files: .jsonl, .jsonl.gz, or .parquet (needs pyarrow)")
    group.add_argument("--task-field", choices=TASK_FIELDS, default=None,
                       help="field holding the task name (default: the first present of "
                            + ", ".join(TASK_FIELDS) + ")")
    group.add_argument("--skip-bad", action="store_true",
                       help="count bad lines and unreadable/empty files under their reason and "
                            "go on, instead of stopping at the first one")
    add_tokenizer_args(parser)
    parser.add_argument("--chat-template", action="store_true",
                        help="HuggingFaceTokenizer: each input a user turn and its target the "
                             "assistant's reply, in the checkpoint's chat template "
                             "(chat_template.jinja or tokenizer_config.json); the loss stays on "
                             "the reply")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="path prefix of the dataset (P_tasks.json and the folder P.data-<id>/)")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="tokenizer worker processes (1 = tokenise in this process)")
    group.add_argument("--chunk-size", type=int, default=256,
                       help="samples per unit of work sent to a worker")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.chunk_size < 1:
        parser.error("--workers and --chunk-size must be >= 1")
    return args


def exit_on_sigterm(signum, frame):
    """Turn SIGTERM into SystemExit so the temporary output folder is removed on the way out."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        summary = preprocess_flan(args.input, args.output_prefix, tokenizer_spec_from_args(args),
                                  workers=args.workers, skip_bad=args.skip_bad,
                                  task_field=args.task_field, chunk_size=args.chunk_size,
                                  progress=not args.no_progress,
                                  chat_template=args.chat_template)
    except BadInputError as exc:
        print(f"error: {exc}" + ("" if args.skip_bad else
                                 "\n(use --skip-bad to count and skip bad lines)"),
              file=sys.stderr)
        return 2
    except (TokenizerError, DatasetWriteError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    manifest, *data = summary["files_written"]
    print(f"wrote {manifest} naming {os.path.dirname(data[0])}/ "
          f"({', '.join(os.path.basename(p) for p in data)})")
    cleanup = summary["cleanup"]
    if cleanup["removed"]:
        print(f"removed {len(cleanup['removed'])} file(s)/folder(s) of the previous dataset or "
              f"of killed runs: {', '.join(cleanup['removed'])}")
    for what in cleanup["not_removed"]:
        print(f"warning: could not remove {what}; delete it by hand", file=sys.stderr)
    print("summary JSON: " + json.dumps(summary["samples"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
