"""The tests' torch.distributed worlds: N fresh processes with a hard timeout
(megatron/base/process_world.py, so a hung or crashed rank fails the test with a message
instead of hanging CI), a free port, and this process as a world of one."""
from __future__ import annotations

import os
from contextlib import contextmanager

from megatron.base.process_world import free_local_port as free_port
from megatron.base.process_world import run_in_processes  # noqa: F401 - the tests' entry point


@contextmanager
def single_process_world(seed: int):
    """This process as a world of one (TP=PP=1) for the duration of the block; the
    environment variables it sets are restored afterwards, so later subprocesses (which
    read MASTER_PORT / WORLD_SIZE) do not inherit a port this process still holds."""
    from megatron.base.distributed_setup import setup_model_parallel, teardown_model_parallel
    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")
    try:
        setup_model_parallel(1, 1, seed=seed)
        yield
    finally:
        teardown_model_parallel()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
