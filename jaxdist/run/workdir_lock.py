"""One run per workdir: an exclusive lock held for as long as a run uses the directory.

Two runs in one workdir would interleave their metrics, overwrite each other's checkpoints and
resume from steps the other wrote. The first run holds ``WORKDIR/run.lock`` (an ``flock``, which
the kernel releases when the process dies, however it dies), and a second run is refused in one
line naming the holder. With several processes only process 0 takes the lock, and every process
learns the outcome, so none of them goes on alone.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

import jax

from jaxdist.run.agreement import text_from_process_0
from jaxdist.run.hooks import Hook

__all__ = ["WorkdirInUseError", "WorkdirLock"]

LOCK_FILE = "run.lock"


class WorkdirInUseError(RuntimeError):
    """Another run holds the workdir."""

    exit_code = 1


class WorkdirLock(Hook):
    """``with WorkdirLock(workdir):`` -- the run's claim on ``workdir``; the training loop's
    first hook, held for the whole run.

    Raises :class:`WorkdirInUseError` on entry if another live run holds it. The lock file stays
    behind (it names the last holder); only the lock on it is released.
    """

    def __init__(self, workdir: str | Path) -> None:
        self.path = Path(workdir) / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> WorkdirLock:
        holder = self._acquire() if jax.process_index() == 0 else None
        if jax.process_count() > 1:
            holder = text_from_process_0(holder or "") or None  # process 0's verdict
        if holder is not None:
            raise WorkdirInUseError(
                f"{self.path.parent} is in use by another run ({holder}); wait for it to end, "
                "or train in another --workdir"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def _acquire(self) -> str | None:
        """Take the lock; ``None`` on success, else who holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(os.read(fd, 4096))
            os.close(fd)
            return holder
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return None


def _describe_holder(raw: bytes) -> str:
    """``pid 123 on host h since 2026-...`` from the lock file's record."""
    try:
        record = json.loads(raw)
        return f"pid {record['pid']} on host {record['host']}, started {record['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no record"
