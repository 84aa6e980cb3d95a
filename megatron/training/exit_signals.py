"""SIGTERM / SIGINT during training, as Megatron-LM's --exit-signal-handler (on by default here).

What a cluster scheduler sends before it kills a job, and what torchrun forwards to every rank
when it gets one (Ctrl-C at the terminal reaches torchrun alone: it runs each rank in a session
of its own). The first signal is only remembered; at the end of the current iteration the ranks
agree that one of them got it (one integer all-reduce per iteration), save a checkpoint when
--save is set, rank 0 says so in one line, and the run returns as a finished one (exit 0). A
second signal to a rank exits it at once, status 128 + the signal number, without a checkpoint.
torchrun waits --shutdown-timeout seconds (default 30) for its ranks before it kills them, and
then, as after any signal, exits with status 1 and prints its own SignalException traceback
(torchrun's, not a rank's: every rank exited 0)."""
from __future__ import annotations

import os
import signal
import threading

import torch.distributed as dist

from megatron.base.collectives import reduce_over_ranks

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ExitSignals:
    """Context manager that catches EXIT_SIGNALS while it is entered (in the main thread; a
    no-op when `enabled` is false or elsewhere), restoring the previous handlers on exit."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "ExitSignals":
        if self.enabled:
            self._previous = {s: signal.signal(s, self._on_signal) for s in EXIT_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None:
            os.write(2, f"[train] a second {signal.Signals(signum).name}: exiting at once, "
                        f"without a checkpoint\n".encode())
            os._exit(128 + signum)
        self.received = signum

    def agreed(self) -> str | None:
        """The name of the signal some rank received (None if none did): the same on every
        rank. A collective over the default group when enabled."""
        if not self.enabled:
            return None
        signum = reduce_over_ranks([self.received or 0], dist.ReduceOp.MAX)[0]
        return signal.Signals(signum).name if signum else None
