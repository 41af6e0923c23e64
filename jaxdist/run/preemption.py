"""Preemption and Ctrl-C: SIGTERM, or a first Ctrl-C (SIGINT), becomes a flag that the training
loop checks after each step, so that the checkpoint is written from a consistent state and
not from inside a signal handler. A second Ctrl-C stops at once (``KeyboardInterrupt``); the
checkpoints written before it are kept."""

from __future__ import annotations

import logging
import signal
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxdist.run.hooks import Hook

__all__ = ["PreemptionGuard"]

log = logging.getLogger(__name__)


class PreemptionGuard(Hook):
    """Turns SIGTERM, or a first Ctrl-C, into ``preempted`` being true at the next step
    boundary; ``signal_name`` says which.

    With several processes a signal reaches them at different steps, so they would stop at
    different steps and the save would hang; there orbax's ``reached_preemption`` (JAX's
    preemption sync point, agreed through the coordination service) decides instead.
    Use as a context manager (or a hook of the training loop, whose ``stop_requested`` names
    the signal); the previous handler is restored on exit.
    """

    def __init__(self, manager: ocp.CheckpointManager | None = None) -> None:
        self._manager = manager
        self._signalled = False
        self._previous: dict[int, Any] = {}
        self.signal_name = "SIGTERM"

    def __enter__(self) -> PreemptionGuard:
        if jax.process_count() == 1:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            # The next Ctrl-C is Python's own: it stops at once, older checkpoints kept.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print(
                "\nCtrl-C: finishing this step and saving a checkpoint, then stopping "
                "(Ctrl-C again to stop at once)",
                flush=True,
            )
        else:
            log.warning("SIGTERM received: saving a checkpoint after this step, then stopping")
        self._signalled = True

    def preempted(self, step: int) -> bool:
        """Whether to save and stop after ``step``."""
        if jax.process_count() > 1 and self._manager is not None:
            return bool(self._manager.reached_preemption(step))
        return self._signalled

    def stop_requested(self, loop: Any) -> str:
        return self.signal_name if self.preempted(loop.step) else ""
