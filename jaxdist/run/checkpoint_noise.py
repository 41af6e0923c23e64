"""What orbax, TensorStore and asyncio print when a checkpoint read or write fails, kept off
the terminal: the checkpointer reports each failure in one line of its own.

A failed read or write leaves TensorStore threads calling back into orbax's closed event loop
(each prints an "Event loop is closed" traceback), asyncio futures whose exceptions nobody
retrieved, and orbax's background threads log every failure with its stack before the main
thread re-raises it. :func:`failures_reported` drops them for one checkpoint directory, for
good, and :func:`unawaited_coroutine_warnings_hidden` the coroutines a failure leaves behind:
the checkpointer raises (or warns of) every failed read and write itself.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

__all__: list[str] = []


class _UnretrievedFutures(logging.Filter):
    """Drops asyncio's "exception was never retrieved" reports about reads or writes under one
    checkpoint directory: a failed restore or save leaves such futures behind, and they report
    when collected, possibly at exit, long after the one line said what failed."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = str(directory)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        return not ("never retrieved" in text and self.directory in text)


def _unretrieved_futures_dropped(directory: Path) -> None:
    """From now on, for good (they report at exit too): :class:`_UnretrievedFutures`."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(
        isinstance(f, _UnretrievedFutures) and f.directory == str(directory)
        for f in asyncio_log.filters
    ):
        asyncio_log.addFilter(_UnretrievedFutures(directory))


class _FailedWriteLogs(logging.Filter):
    """Drops orbax's error logs about a save into one directory (re-raised by the save)."""

    # orbax's own line when waiting on a failed save; it names no directory
    WAIT_FAILED = "Save Finalize thread (save_finalize) failed"

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = str(directory)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        text = record.getMessage()
        return not (self.directory in text or self.WAIT_FAILED in text)


# Checkpoint directories whose failed reads and writes the checkpointer has reported itself.
_REPORTED: set[str] = set()


def _closed_loop_callbacks_dropped(previous):
    """An unraisable-exception hook that drops TensorStore's callbacks into orbax's closed
    event loop and the failures of orbax's abandoned array reads under a reported directory
    (``Exception ignored in: <coroutine object _read_array_index_and_device_put>``, each with
    the whole TensorStore spec), and passes everything else to ``previous``."""

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        if error is not None and any(directory in str(error) for directory in _REPORTED):
            return
        previous(unraisable)

    hook.jaxdist_drops_closed_loop_callbacks = True
    return hook


def failures_reported(directory: Path) -> None:
    """From now on, for good: orbax's logs of failed writes under ``directory``, TensorStore's
    callbacks into closed loops and unretrieved futures of reads and writes there stay
    unprinted (they keep coming after the failure was raised, up to the process's exit)."""
    _REPORTED.add(str(directory))
    _unretrieved_futures_dropped(directory)
    absl_log = logging.getLogger("absl")
    if not any(
        isinstance(f, _FailedWriteLogs) and f.directory == str(directory) for f in absl_log.filters
    ):
        absl_log.addFilter(_FailedWriteLogs(directory))
    if not getattr(sys.unraisablehook, "jaxdist_drops_closed_loop_callbacks", False):
        sys.unraisablehook = _closed_loop_callbacks_dropped(sys.unraisablehook)


def unawaited_coroutine_warnings_hidden() -> None:
    """A failed read or an aborted save leaves orbax's coroutines never awaited; Python warns
    about each when it is collected, possibly at exit, after the one line said what failed."""
    warnings.filterwarnings(
        "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
    )
