"""What pretrain_gpt.py and pretrain_t5.py run: parse the flags, build the run, train.

A failure prints one line `pretrain_<model>.py: error: ...` (and the traceback only with
--debug) and exits with status 1. A set-up error that every rank finds alike (a bad flag, bad
--data-path, tokenizer mismatch, world size) is printed by rank 0 only; any other error by the
rank it happened on, naming it, in one write so that lines of two ranks never run together.
The other ranks then leave after rank 0 (at most REPORT_GRACE_S later): a launcher such as
torchrun stops every rank when the first one exits, which could be before rank 0 printed."""
import contextlib
import io
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
    from megatron.base.distributed_setup import use_cuda
    if not use_cuda():
        # megatron-core asks every TP rank for CUDA_DEVICE_MAX_CONNECTIONS=1 (it orders the CUDA
        # streams of its async gradient all-reduce; the GPU launchers set it): on CPU there
        # are no streams to order, and nothing for the user to do
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")

    rank = int(os.environ.get("RANK", "0"))
    cfg = parse_flags_once(model, argv, rank, parse_args)
    try:
        train(build_run(cfg))
    except Exception as exc:   # noqa: BLE001 -- reported as one line, see the docstring
        same_everywhere = isinstance(exc, (RunSetupError, ConfigError))
        if rank == 0 or not same_everywhere:
            report_failure(f"pretrain_{model}.py", exc, cfg.debug, same_everywhere,
                           rank if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
        else:
            time.sleep(REPORT_GRACE_S)    # rank 0 reports it; see the module docstring
        return 1
    return 0


def parse_flags_once(model: str, argv, rank: int, parse_args):
    """parse_args on every rank (all get the same flags), a flag error printed by rank 0 only;
    the other ranks exit with the same status after the grace period."""
    if rank == 0:
        return parse_args(model, argv)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return parse_args(model, argv)
    except SystemExit as exc:
        if exc.code:
            time.sleep(REPORT_GRACE_S)
        raise


def report_failure(prog: str, exc: BaseException, debug: bool, setup: bool,
                   rank: int | None = None) -> None:
    """One line on stderr, written at once (unless it is a set-up error, which every rank
    finds alike: the exception type, and the rank of a multi-rank run where the message does
    not name it); with debug the traceback first."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
        cause = exc
        while cause is not None:     # e.g. a planner worker's traceback (PlanningFailed)
            if getattr(cause, "detail", None):
                print(cause.detail, file=sys.stderr)
            cause = cause.__cause__ or cause.__context__
    what = str(exc) if setup else f"{type(exc).__name__}: {exc}"
    if rank is not None and not setup and not what.startswith(f"{type(exc).__name__}: rank "):
        what = f"rank {rank}: {what}"
    hint = "" if debug else " (--debug shows the traceback)"
    line = f"{prog}: error: {what}".replace("\n", " ") + hint + "\n"
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), line.encode("utf-8", "backslashreplace"))
    except (AttributeError, OSError, io.UnsupportedOperation):   # stderr is not a file
        print(line, end="", file=sys.stderr, flush=True)
