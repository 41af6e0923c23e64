"""Preemption: SIGTERM becomes a flag that the training loop checks after each step, so that
the checkpoint is written from a consistent state and not from inside a signal handler."""

from __future__ import annotations

import logging
import signal
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["PreemptionGuard"]

log = logging.getLogger(__name__)


class PreemptionGuard:
    """Turns SIGTERM into ``preempted`` being true at the next step boundary.

    With several processes a signal reaches them at different steps, so they would stop at
    different steps and the save would hang; there orbax's ``reached_preemption`` (JAX's
    preemption sync point, agreed through the coordination service) decides instead.
    Use as a context manager; the previous handler is restored on exit.
    """

    def __init__(self, manager: ocp.CheckpointManager | None = None) -> None:
        self._manager = manager
        self._signalled = False
        self._previous = None

    def __enter__(self) -> PreemptionGuard:
        if jax.process_count() == 1:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM received: saving a checkpoint after this step, then stopping")
        self._signalled = True

    def preempted(self, step: int) -> bool:
        """Whether to save and stop after ``step``."""
        if jax.process_count() > 1 and self._manager is not None:
            return bool(self._manager.reached_preemption(step))
        return self._signalled
