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
import difflib
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Hook", "Hooks", "OnStep"]


class Hook:
    """A part of a run the training loop calls; override the moments you need. ``loop`` is the
    loop's :class:`~jaxdist.run.trainer.Loop` (step, state, epoch, last metrics).

    A subclass's method named like a moment but not one (``step_don``) is refused when the
    class is defined: the loop would never call it. A hook's settings are checked before the
    run is built, by :meth:`check_settings`.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in vars(cls):
            if name.startswith("_") or name in MOMENTS:
                continue
            near = difflib.get_close_matches(name, MOMENTS, n=1, cutoff=0.8)
            if near:
                raise TypeError(
                    f"{cls.__name__}.{name} is not a moment the loop calls; "
                    f"did you mean {near[0]}? (jaxdist.run.hooks)"
                )

    @classmethod
    def check_settings(
        cls, config: Any, total_steps: int, profile_steps: tuple[int, int] | None
    ) -> None:
        """Refuse settings of ``config`` (the recipe's) this hook cannot run with, in one line,
        before anything is built. ``total_steps``: the steps the run takes."""

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


MOMENTS = tuple(
    name for name in vars(Hook) if not name.startswith("_") and name != "check_settings"
)


class Hooks(Hook):
    """A run's hooks as one, each moment called on every hook in order (a typed call: a
    misspelt moment fails where it is called, not silently)."""

    def __init__(self, hooks: Sequence[Hook]) -> None:
        self.hooks = list(hooks)

    def resumed(self, loop: Any, meta: dict) -> None:
        for hook in self.hooks:
            hook.resumed(loop, meta)

    def run_started(self, loop: Any) -> None:
        for hook in self.hooks:
            hook.run_started(loop)

    def step_starting(self, loop: Any) -> None:
        for hook in self.hooks:
            hook.step_starting(loop)

    def step_calling(self, loop: Any, compiled: bool) -> None:
        for hook in self.hooks:
            hook.step_calling(loop, compiled)

    def around_step(self, loop: Any) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for hook in self.hooks:
            stack.enter_context(hook.around_step(loop))
        return stack

    def step_done(self, loop: Any) -> None:
        for hook in self.hooks:
            hook.step_done(loop)

    def reported(self, loop: Any, fetched: list[dict]) -> None:
        for hook in self.hooks:
            hook.reported(loop, fetched)

    def recorded(self, loop: Any, record: dict) -> None:
        for hook in self.hooks:
            hook.recorded(loop, record)

    def evaluating(self, loop: Any) -> None:
        for hook in self.hooks:
            hook.evaluating(loop)

    def evaluated(self, loop: Any) -> None:
        for hook in self.hooks:
            hook.evaluated(loop)

    def saving(self, loop: Any) -> None:
        for hook in self.hooks:
            hook.saving(loop)

    def stop_requested(self, loop: Any) -> str:
        """The first hook's reason to stop, or ``""``."""
        return next(filter(None, (hook.stop_requested(loop) for hook in self.hooks)), "")

    def run_ended(self, loop: Any, failure: str | None) -> None:
        for hook in self.hooks:
            hook.run_ended(loop, failure)


class OnStep(Hook):
    """``fn(step, state)`` after every step (steps counted from 1)."""

    def __init__(self, fn: Callable[[int, Any], None]) -> None:
        self.fn = fn

    def step_done(self, loop: Any) -> None:
        self.fn(loop.step, loop.state)
