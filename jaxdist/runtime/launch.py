"""Start a group of processes, label their output, and bring them all down together.

:func:`supervise` is the one piece of process supervision in jaxdist: ``jaxdist launch`` (N
processes on this machine) and ``jaxdist cluster`` (N processes in emulated hosts) both hand it
a list of :class:`Worker` and get back an exit code. Its promises:

* every output line of worker ``i`` is written as ``[p<i>] line``;
* when a worker fails (non-zero exit or killed by a signal), the others are stopped: SIGTERM
  to each worker's whole process group, SIGKILL after ``grace_s``; the run's exit code is the
  first failure's;
* Ctrl-C / SIGTERM / SIGHUP to the supervisor, or ``timeout_s`` running out, stops all the
  same way (exit 130 / 143 / 129 / 124);
* nothing is left behind: each worker runs in its own session (process group), which is
  SIGKILLed at the end whatever happened.

:func:`local_workers` builds the workers for ``jaxdist launch``: a coordinator on a free port
of 127.0.0.1 and the ``JAXDIST_*`` variables :mod:`jaxdist.runtime.distributed` reads.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from jaxdist.runtime import distributed

__all__ = [
    "Stop",
    "launch",
    "supervise",
]

DEFAULT_GRACE_S = 5.0
EXIT_TIMEOUT = 124
_POLL_S = 0.05


@dataclass(frozen=True)
class Worker:
    """One process to run: its argv and environment (the full environment, not a diff)."""

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


class Stop(Exception):
    """A termination signal, raised in the main thread so that a supervisor unwinds through
    its cleanup (:func:`signals_raise_stop`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_raise_stop(signums: Sequence[int]):
    """While inside, each of ``signums`` raises :class:`Stop` in the main thread; the previous
    handlers come back on the way out."""

    def on_signal(signum, _frame):
        raise Stop(signum)

    previous = {s: signal.signal(s, on_signal) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_env(
    coordinator: str,
    num_processes: int,
    process_id: int,
    devices_per_process: int | None = None,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one worker: ``base`` plus the ``JAXDIST_*`` process-group variables."""
    env = dict(os.environ if base is None else base)
    env[distributed.ENV_COORDINATOR] = coordinator
    env[distributed.ENV_NUM_PROCESSES] = str(num_processes)
    env[distributed.ENV_PROCESS_ID] = str(process_id)
    if devices_per_process is not None:
        env[distributed.ENV_LOCAL_DEVICES] = str(devices_per_process)
    else:
        env.pop(distributed.ENV_LOCAL_DEVICES, None)
    # Workers print through a pipe; unbuffered output keeps the labelled lines in real time.
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def local_workers(
    command: Sequence[str], processes: int, devices_per_process: int | None = None
) -> list[Worker]:
    """``processes`` copies of ``command`` on this machine, process 0 coordinating on 127.0.0.1."""
    if processes < 1:
        raise ValueError(f"--processes must be >= 1, got {processes}")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"--devices-per-process must be >= 1, got {devices_per_process}")
    coordinator = f"127.0.0.1:{free_port()}"
    named = {distributed.ENV_LAUNCHER: "jaxdist launch"}
    return [
        Worker(
            list(command), worker_env(coordinator, processes, i, devices_per_process, None, named)
        )
        for i in range(processes)
    ]


def _pump(index: int, stream, out: TextIO, lock: threading.Lock) -> None:
    """Copy one worker's output to ``out`` line by line, each line labelled with the worker."""
    prefix = f"[p{index}] "
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(prefix + line + "\n")
            out.flush()
    stream.close()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    # start_new_session: the group id is the worker's pid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def _stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every worker's group, wait up to ``grace_s``, then SIGKILL the groups."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(_POLL_S)
    for proc in procs:
        # Also for workers that exited: children they left in their group die with it.
        _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)


def _exit_code(returncode: int) -> int:
    """Shell convention: a worker killed by signal N makes the run exit 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def supervise(
    workers: Sequence[Worker],
    *,
    timeout_s: float | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    out: TextIO | None = None,
    log: TextIO | None = None,
) -> int:
    """Run ``workers`` to completion or first failure; return the run's exit code.

    0 when every worker exits 0; else the first failing worker's code (128 + N for signal N),
    124 when ``timeout_s`` runs out, 128 + N when the supervisor receives signal N.
    Call from the main thread (it installs SIGINT/SIGTERM/SIGHUP handlers while running).
    """
    out = sys.stdout if out is None else out
    log = sys.stderr if log is None else log
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    with signals_raise_stop(handled):
        try:
            code = _start(workers, procs, pumps, out, log, lock)
            if code == 0:
                code = _wait(procs, timeout_s, log, lock)
        except Stop as stop:
            code = 128 + stop.signum
            with lock:
                log.write(f"jaxdist: received {stop}; stopping all processes\n")
        except KeyboardInterrupt:  # a SIGINT that arrived before our handler was installed
            code = 128 + signal.SIGINT
        finally:
            # Further signals must not interrupt the shutdown itself.
            for s in handled:
                signal.signal(s, signal.SIG_IGN)
            _stop_all(procs, grace_s)
            for pump in pumps:
                pump.join(timeout=grace_s)
    return code


def _start(
    workers: Sequence[Worker],
    procs: list[subprocess.Popen],
    pumps: list[threading.Thread],
    out: TextIO,
    log: TextIO,
    lock: threading.Lock,
) -> int:
    """Start every worker with a thread copying its output (appended to ``procs`` and
    ``pumps`` as they start, so that a failure stops those already running); 0, or 127 / 126
    with one line on ``log`` when a worker's program is not found / cannot be run."""
    for i, worker in enumerate(workers):
        try:
            proc = subprocess.Popen(
                _resolve_program(worker),
                env=dict(worker.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # Own session = own process group: we can signal the worker and every child it
                # starts at once, and the terminal's Ctrl-C reaches only the supervisor.
                start_new_session=True,
            )
        except OSError as err:
            not_found = isinstance(err, FileNotFoundError)
            with lock:
                log.write(
                    f"jaxdist: cannot run {worker.argv[0]!r}: "
                    f"{'not found' if not_found else err.strerror}\n"
                )
            return 127 if not_found else 126
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(i, proc.stdout, out, lock), daemon=True)
        pump.start()
        pumps.append(pump)
    return 0


def _resolve_program(worker: Worker) -> list[str]:
    """The worker's argv with its program looked up as a shell would, on the worker's PATH,
    and then beside this Python: ``.venv/bin/jaxdist launch -- jaxdist ...`` finds the
    virtual environment's ``jaxdist`` even when that environment is not on PATH."""
    argv = list(worker.argv)
    if not argv:
        raise FileNotFoundError("no program given")
    if os.sep in argv[0]:
        return argv
    here = os.path.dirname(sys.executable)
    found = shutil.which(argv[0], path=worker.env.get("PATH", os.defpath)) or shutil.which(
        argv[0], path=here
    )
    if found is None:
        raise FileNotFoundError(argv[0])
    return [found, *argv[1:]]


def _wait(
    procs: list[subprocess.Popen], timeout_s: float | None, log: TextIO, lock: threading.Lock
) -> int:
    """Poll until every worker exited 0 (0), one failed (its exit code) or ``timeout_s`` ran
    out (:data:`EXIT_TIMEOUT`)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, c = failed[0]
            code = _exit_code(c)
            with lock:
                log.write(f"jaxdist: process {i} exited with code {code}; stopping the others\n")
            return code
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            with lock:
                log.write(f"jaxdist: timed out after {timeout_s:g} s; stopping all processes\n")
            return EXIT_TIMEOUT
        time.sleep(_POLL_S)


def launch(
    command: Sequence[str],
    processes: int,
    *,
    devices_per_process: int | None = None,
    timeout_s: float | None = None,
    grace_s: float = DEFAULT_GRACE_S,
) -> int:
    """Run ``command`` as ``processes`` processes of one JAX run on this machine."""
    if not command:
        raise ValueError("no command given to launch")
    return supervise(
        local_workers(command, processes, devices_per_process), timeout_s=timeout_s, grace_s=grace_s
    )
