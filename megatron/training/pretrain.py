"""What pretrain_gpt.py and pretrain_t5.py run: parse the flags, build the run, train.

A failure prints one line `pretrain_<model>.py: error: ...` (and the traceback only with
--debug) and exits with status 1. A set-up error that every rank finds alike (bad --data-path,
tokenizer mismatch, world size) is printed by rank 0 only; any other error by the rank it
happened on. The other ranks then leave after rank 0 (at most REPORT_GRACE_S later): a launcher
such as torchrun stops every rank when the first one exits, which could be before rank 0 printed."""
import os
import sys
import time
import traceback
import warnings

REPORT_GRACE_S = 10.0


def pretrain(model: str, argv=None) -> int:
    # megatron-core announces at import that it falls back to torch norms / optimizers without
    # Apex or Transformer Engine; that is the expected set-up here, not news on every rank.
    warnings.filterwarnings(
        "ignore", message=r".*(Apex|Transformer Engine)( and Apex)? (is|are) not installed")
    from megatron.training.arguments import ConfigError, parse_args
    from megatron.training.training import RunSetupError, build_run, train

    cfg = parse_args(model, argv)
    try:
        train(build_run(cfg))
    except Exception as exc:   # noqa: BLE001 -- reported as one line, see the docstring
        same_everywhere = isinstance(exc, (RunSetupError, ConfigError))
        if int(os.environ.get("RANK", "0")) == 0 or not same_everywhere:
            report_failure(f"pretrain_{model}.py", exc, cfg.debug, same_everywhere)
        else:
            time.sleep(REPORT_GRACE_S)    # rank 0 reports it; see the module docstring
        return 1
    return 0


def report_failure(prog: str, exc: BaseException, debug: bool, setup: bool) -> None:
    """One line on stderr (the exception type too, unless it is a set-up error); with debug
    the traceback first."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    what = str(exc).replace("\n", " ") if setup else f"{type(exc).__name__}: {exc}".replace(
        "\n", " ")
    hint = "" if debug else " (--debug shows the traceback)"
    print(f"{prog}: error: {what}{hint}", file=sys.stderr, flush=True)
