"""A watchdog for a process that stops making progress.

A stuck input reader (a hung network filesystem, a FIFO nobody writes), or a peer process that
died without the runtime noticing, leaves a process waiting forever, and with it every process
in the run. The trainer tells the :class:`Watchdog` what it is doing before each wait (reading
step 57's batch, running step 57, saving its checkpoint); if one activity lasts longer than the
timeout, the watchdog prints one line naming the process, the step and the activity, writes
every thread's stack to ``WORKDIR/stuck-p<process>.txt`` and ends the process with
:data:`STUCK_EXIT_CODE`, so that ``jaxdist launch`` (or the cluster's scheduler) stops the
others. Compiling and evaluating are exempt: their time grows with the model, not with a hang.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax

from jaxdist.run.hooks import Hook

__all__ = ["STUCK_EXIT_CODE", "Watchdog"]

# The shell's "timed out" status, as `timeout(1)` and `jaxdist launch --timeout` use.
STUCK_EXIT_CODE = 124


def _check_timeout(timeout_s: float) -> None:
    if timeout_s < 0:
        raise ValueError(f"watchdog_s must be >= 0 (0 disables it), got {timeout_s}")


class Watchdog(Hook):
    """``with Watchdog(timeout_s, workdir) as dog:`` then ``dog.watch(step, activity)`` before
    each wait and ``dog.pause()`` around what is exempt. ``timeout_s = 0`` disables it."""

    def __init__(self, timeout_s: float, workdir: str | Path) -> None:
        _check_timeout(timeout_s)
        self.timeout_s = float(timeout_s)
        self.workdir = Path(workdir)
        self._current: tuple[int, str, float] | None = None  # (step, activity, since)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def check_settings(
        cls, config: Any, total_steps: int, profile_steps: tuple[int, int] | None
    ) -> None:
        _check_timeout(config.watchdog_s)

    def watch(self, step: int, activity: str) -> None:
        """From now on the process is ``activity`` (e.g. "reading the input batch of") ``step``."""
        self._current = (step, activity, time.monotonic())

    def pause(self) -> None:
        """Nothing is watched until the next :meth:`watch`."""
        self._current = None

    # As a hook of the training loop: what the loop waits for next.

    def step_starting(self, loop: Any) -> None:
        self.watch(loop.step + 1, "reading the input batch of")

    def step_calling(self, loop: Any, compiled: bool) -> None:
        if compiled:
            self.watch(loop.step + 1, "running")
        else:  # the first call compiles: its time grows with the model, not with a hang
            self.pause()

    def evaluating(self, loop: Any) -> None:
        self.pause()

    def saving(self, loop: Any) -> None:
        self.watch(loop.step, "saving the checkpoint of")

    def run_ended(self, loop: Any, failure: str | None) -> None:
        self.pause()

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._run, name="jaxdist-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        poll = min(5.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            current = self._current
            if current is not None and time.monotonic() - current[2] > self.timeout_s:
                self._report_and_exit(*current)

    def _report_and_exit(self, step: int, activity: str, since: float) -> None:
        index, count = jax.process_index(), jax.process_count()
        stacks = self.workdir / f"stuck-p{index}.txt"
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            with open(stacks, "w") as f:
                f.write(f"process {index} of {count}, {activity} step {step}\n")
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = f"the stack of every thread is in {stacks}"
        except OSError as err:
            where = f"its stacks could not be written to {stacks} ({err})"
        print(
            f"jaxdist train: process {index} of {count} has been {activity} step {step} for "
            f"{time.monotonic() - since:.0f} s (watchdog_s={self.timeout_s:g}); {where}; "
            f"stopping it",
            file=sys.stderr,
            flush=True,
        )
        # The main thread may sit in a read or a collective that no signal interrupts.
        os._exit(STUCK_EXIT_CODE)
