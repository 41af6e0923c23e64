"""How many calls of a multi-device program may be queued at once on CPU devices.

JAX dispatches a jitted call and returns before it has run, so a Python loop can queue many
calls ahead of the one executing. On CPU devices XLA runs each device's part of a call as its
own task, and the tasks of one call meet in an in-process rendezvous at every collective. With
dozens of calls queued (a loop of small steps that never reads a result), a rendezvous can wait
for a device task that never starts: "Expected 8 threads to join the rendezvous, but only 7 of
them arrived", and XLA aborts the process after its collective timeout.
``benchmarks/queue_depth.py`` measures it (benchmarks/results/NOTES_train_step_resnet.md, "How many steps may be queued
on CPU devices"): on 8 forced CPU devices (jax 0.10.2, 2 cores) every unbounded loop of 2,000
calls hung, and every loop of at most 1-32 queued calls finished, at the same speed per call.

:class:`InFlightWindow` keeps such a loop shallow: before each call :meth:`~InFlightWindow.
make_room` waits until fewer than ``limit`` earlier calls are pending, and after it
:meth:`~InFlightWindow.add` records the call's outputs. :class:`~jaxdist.training.train_step.TrainStep`
and :class:`~jaxdist.training.eval_step.EvalStep` share one window per set of devices
(:func:`shared_window`); research code that jits its own collectives can use one too.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Literal

import jax
from jax.sharding import Mesh

from jaxdist.checks import positive_int

__all__ = [
    "InFlightWindow",
    "Limit",
    "shared_window",
]

# Calls queued at once on CPU devices: far below the depth that hung, and deep enough that the
# Python loop still prepares the next batch while a step runs.
CPU_IN_FLIGHT_LIMIT = 4

Limit = int | Literal["auto"] | None


def default_limit(mesh: Mesh) -> int | None:
    """:data:`CPU_IN_FLIGHT_LIMIT` for a mesh of several CPU devices, else ``None`` (no limit:
    GPU and TPU runtimes pace their own queues). A CPU mesh spread over several processes is
    limited too: the hang was seen with several devices in one process, and the limit costs
    nothing where it is not needed."""
    devices = list(mesh.devices.flat)
    if len(devices) > 1 and all(d.platform == "cpu" for d in devices):
        return CPU_IN_FLIGHT_LIMIT
    return None


def resolve_limit(limit: Limit, mesh: Mesh) -> int | None:
    """``"auto"`` -> :func:`default_limit`; ``None`` -> no limit; else a positive int."""
    if isinstance(limit, str) and limit == "auto":
        return default_limit(mesh)
    if limit is None:
        return None
    return positive_int(limit, "max_in_flight", "a positive int, None (no limit) or 'auto'")


class InFlightWindow:
    """At most ``limit`` calls queued: call :meth:`make_room` before dispatching a call and
    :meth:`add` with its outputs after; ``limit=None`` never waits.

    Add outputs that later calls do not donate (a step's metrics, not its state): waiting on a
    donated buffer fails once it has been handed over. An error raised by a queued call
    surfaces when the window waits for it, up to ``limit`` calls later.
    """

    def __init__(self, limit: int | None):
        if limit is not None:
            limit = positive_int(limit, "limit", "a positive int or None (no limit)")
        self.limit = limit
        self._pending: deque[Any] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def make_room(self) -> None:
        """Wait for the oldest pending calls until fewer than ``limit`` remain."""
        while self.limit is not None and len(self._pending) >= self.limit:
            jax.block_until_ready(self._pending.popleft())

    def add(self, outputs: Any) -> None:
        """Record a dispatched call by its outputs (a pytree of arrays to wait on)."""
        if self.limit is not None:
            self._pending.append(outputs)


_SHARED: dict[tuple[tuple[int, ...], int | None], InFlightWindow] = {}


def shared_window(mesh: Mesh, limit: Limit = "auto") -> InFlightWindow:
    """The window of this process's devices of ``mesh`` at ``limit`` (resolved as in
    :func:`resolve_limit`): every step object on the same devices with the same limit counts
    against one queue, so a trainer's train and eval steps together stay within it."""
    resolved = resolve_limit(limit, mesh)
    if resolved is None:
        return InFlightWindow(None)
    key = (tuple(sorted(d.id for d in mesh.local_devices)), resolved)
    if key not in _SHARED:
        _SHARED[key] = InFlightWindow(resolved)
    return _SHARED[key]
