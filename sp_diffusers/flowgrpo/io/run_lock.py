"""One run per output folder: two trainers writing one ``train.out_dir`` would interleave ``metrics.jsonl`` and
trip over each other's temporary checkpoint folders.

Rank 0 holds an exclusive ``flock`` on ``<out_dir>/.run.lock`` while ``FlowGRPOTrainer.run`` trains (the OS
releases it when the process ends, however it ends, so a crashed or killed run never leaves a stale lock) and
tells every rank whether it got it, so all ranks raise the same error together (also when the folder cannot be
written at all: rank 0 alone failing would leave the others waiting).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import IO

import torch.distributed as dist

from ...parallel.devices import collective_device
from ..config import ConfigError

__all__ = ["LOCK_NAME", "RunDirInUse", "lock_run_dir"]

LOCK_NAME = ".run.lock"


class RunDirInUse(ConfigError):
    """Another live run holds the output folder."""


def _try_lock(out_dir: Path) -> tuple[IO[str] | None, tuple[type[ConfigError], str] | None]:
    import fcntl

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        handle = open(out_dir / LOCK_NAME, "a+")  # noqa: SIM115  (kept open: the lock lives with the handle)
    except OSError as err:
        message = f"train.out_dir={str(out_dir)!r} cannot be written ({err}); fix: pass a writable --out-dir"
        return None, (ConfigError, message)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        return None, (
            RunDirInUse,
            f"train.out_dir={str(out_dir)!r} is in use by a run that is still going ({holder}); fix: wait for "
            "it to finish, or pass another --out-dir",
        )
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
    handle.flush()
    return handle, None


def lock_run_dir(out_dir: str | os.PathLike, rank: int) -> IO[str] | None:
    """Rank 0 locks ``out_dir``; every rank raises ``RunDirInUse`` when another run holds it (``ConfigError``
    when it cannot be written). Keep the returned handle (rank 0; None elsewhere) while the run writes there."""
    handle, error = _try_lock(Path(out_dir)) if rank == 0 else (None, None)
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [error]
        dist.broadcast_object_list(shared, src=0, device=collective_device())
        error = shared[0]
    if error is not None:
        kind, message = error
        raise kind(message)
    return handle
