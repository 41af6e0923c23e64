"""What the runtime under a multi-process run prints on its own, kept off the terminal, so that
each process prints only what is its own (process 0: progress and results; every process:
its errors and how it stopped).

Three kinds of line come from below jaxdist, once per process (64 times on 64 hosts):

* gloo's ``[Gloo] Rank N is connected to M peer ranks ...``, written by its C++ code to file
  descriptor 1 at each communicator's first collective, with no setting to turn it off;
* XLA's C++ warnings (``W... preemption_notifier.cc] SIGTERM caught``), through absl;
* orbax's ``Reached preemption sync point, step=N`` through Python's ``absl`` logger, which
  only repeats the trainer's own "stopped by SIGTERM at step N" line.

:func:`quiet_peers` drops them: native writes to standard output go to ``/dev/null`` while
Python's ``sys.stdout`` keeps writing to the real one (everything jaxdist prints, and
``jax.debug.print``, is Python's); on processes other than 0, C++ warnings and Python
warnings of the ``absl`` logger are dropped too. Errors are never dropped: they go to
standard error, which is left alone. Processes started afterwards inherit the ``/dev/null``
standard output (input-pipeline workers, a subprocess of the user's task): what they print
to standard error still shows.
"""

from __future__ import annotations

import io
import logging
import os
import sys

__all__ = ["quiet_peers"]

# orbax's line at a preemption, which the trainer's own "stopped by SIGTERM" line says already
PREEMPTION_SYNC = "Reached preemption sync point"
ABSL_ERROR = 2  # absl's log levels: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL


class _PreemptionSyncDropped(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return PREEMPTION_SYNC not in str(record.msg)


def _drop_native_stdout() -> None:
    """Point file descriptor 1 at ``/dev/null`` and ``sys.stdout`` at a copy of the real one,
    so that only Python's writes reach the terminal. The encoding, ``isatty()`` (progress
    lines rewritten in place) and the buffering are kept: line buffering on a terminal, and
    under ``PYTHONUNBUFFERED`` (as ``jaxdist launch`` runs its processes) none, so that a
    line printed just before ``os._exit`` is not lost."""
    sys.stdout.flush()
    real = os.dup(1)
    old = sys.stdout
    binary = os.fdopen(real, "wb", buffering=0 if old.write_through else -1)
    sys.stdout = io.TextIOWrapper(
        binary,
        encoding=old.encoding,
        errors=old.errors,
        line_buffering=old.line_buffering,
        write_through=old.write_through,
    )
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)


def _drop_native_warnings() -> None:
    """XLA's C++ log lines below ERROR, from now on. ``TF_CPP_MIN_LOG_LEVEL`` is read only
    when jaxlib loads, which happened before the process knew its rank; jaxlib's own setter
    changes it afterwards (it is what ``jax_logging_level`` calls)."""
    try:
        from jaxlib import utils

        utils.absl_set_min_log_level(ABSL_ERROR)
    except (ImportError, AttributeError):  # another jaxlib: its warnings stay
        pass


def quiet_peers(process_id: int, num_processes: int) -> None:
    """Keep the runtime's own lines of a multi-process run off the terminal (see the module
    docstring), on every process, 0 included; nothing for a single process."""
    if num_processes <= 1:
        return
    absl_log = logging.getLogger("absl")
    if not any(isinstance(f, _PreemptionSyncDropped) for f in absl_log.filters):
        absl_log.addFilter(_PreemptionSyncDropped())
    if sys.stdout is not None and sys.stdout is sys.__stdout__ and sys.stdout.fileno() == 1:
        _drop_native_stdout()
    if process_id != 0:
        _drop_native_warnings()
        absl_log.setLevel(logging.ERROR)
