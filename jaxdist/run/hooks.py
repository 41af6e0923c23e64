"""Hooks: the parts of a run that are not training, called by the loop at fixed moments.

The loop in :mod:`jaxdist.run.trainer` resumes, reads batches, calls the train step,
evaluates, reports progress and saves checkpoints. Everything else a run does is a
:class:`Hook` of its own module, which the loop calls at the moments below; each method is
optional (the base class does nothing):

=====================  ==================================================================
``with hook:``         around the whole run: held resources (the workdir lock, the watchdog
                       thread, signal handlers)
``resumed``            the state is loaded (from a checkpoint, or fresh)
``run_started``        before the first step of this process's run
``step_starting``      before step ``loop.step + 1`` reads its batch
``step_calling``       the batch is ready; the step is called next (``compiled``: it ran
                       before, so the call does not compile)
``around_step``        a context manager around the call
``step_done``          the step's state and metrics are in ``loop``
``reported``           a progress report fetched the metrics of the steps since the last
``recorded``           a record was written to ``metrics.jsonl``
``evaluating`` /       around an evaluation; ``loop.last_eval`` holds its metrics after
``evaluated``
``saving``             a checkpoint of ``loop.state`` is written next
``stop_requested``     after each step: a reason to stop early, or ``""``
``run_ended``          after the last step, or when the run failed (``failure`` says why)
=====================  ==================================================================

The trainer's own hooks: the MLPerf event log (:mod:`~jaxdist.run.mlperf`), TensorBoard
(:mod:`~jaxdist.run.tensorboard`), the profiler (:mod:`~jaxdist.run.profile`), the watchdog
(:mod:`~jaxdist.run.watchdog`), the workdir lock (:mod:`~jaxdist.run.workdir_lock`), the rerun
comparison (:mod:`~jaxdist.run.rerun`), preemption (:mod:`~jaxdist.run.preemption`) and the
non-finite guard (:mod:`~jaxdist.run.nonfinite`). ``Trainer(..., hooks=[...])`` adds a user's
own after them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

__all__ = ["Hook", "OnStep"]


class Hook:
    """A part of a run the training loop calls; override the moments you need. ``loop`` is the
    loop's :class:`~jaxdist.run.trainer.Loop` (step, state, epoch, last metrics)."""

    def __enter__(self) -> Hook:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def resumed(self, loop: Any, meta: dict) -> None:
        """The state is loaded: ``meta`` is the checkpoint's (empty for a fresh start)."""

    def run_started(self, loop: Any) -> None:
        """Before the first step this process trains (not called for a finished run)."""

    def step_starting(self, loop: Any) -> None:
        """Before step ``loop.step + 1`` reads its batch."""

    def step_calling(self, loop: Any, compiled: bool) -> None:
        """The step is called next; ``compiled`` is false when this call compiles it."""

    def around_step(self, loop: Any) -> contextlib.AbstractContextManager:
        """A context manager around the step's call."""
        return contextlib.nullcontext()

    def step_done(self, loop: Any) -> None:
        """Step ``loop.step`` is done: its new state is ``loop.state``."""

    def reported(self, loop: Any, fetched: list[dict]) -> None:
        """A progress report fetched the metrics of the steps ending at ``loop.step``."""

    def recorded(self, loop: Any, record: dict) -> None:
        """``record`` (``kind`` ``train`` or ``eval``) was written to ``metrics.jsonl``."""

    def evaluating(self, loop: Any) -> None:
        """An evaluation of ``loop.state`` starts."""

    def evaluated(self, loop: Any) -> None:
        """The evaluation ended; its metrics are ``loop.last_eval``."""

    def saving(self, loop: Any) -> None:
        """A checkpoint of ``loop.state`` is written next."""

    def stop_requested(self, loop: Any) -> str:
        """Why the run should stop after this step (e.g. ``"SIGTERM"``), or ``""``."""
        return ""

    def run_ended(self, loop: Any, failure: str | None) -> None:
        """The run stopped: normally (``failure`` None) or by ``failure``."""


class OnStep(Hook):
    """``fn(step, state)`` after every step (steps counted from 1)."""

    def __init__(self, fn: Callable[[int, Any], None]) -> None:
        self.fn = fn

    def step_done(self, loop: Any) -> None:
        self.fn(loop.step, loop.state)
