#!/usr/bin/env bash
# The quickstart with validation (docs/USAGE.md "Validation"): 3% of the samples are held out with
# Megatron's --split 969,30,1, and every 5 iterations (and after the last) 2 validation batches run
# through forward-only plans, printing the validation loss overall, for the top tasks and per
# task family. Extra arguments go to pretrain_gpt.py.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec bash "$repo/examples/quickstart.sh" --eval-interval 5 --eval-iters 2 --split 969,30,1 "$@"
