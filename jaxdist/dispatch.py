"""How many calls of a multi-device program may be queued at once on CPU devices.

JAX dispatches a jitted call and returns before it has run, so a Python loop can queue many
calls ahead of the one executing. On CPU devices XLA runs each device's part of a call as its
own task, and the tasks of one call meet in an in-process rendezvous at every collective. With
dozens of calls queued (a loop of small steps that never reads a result), a rendezvous can wait
for a device task that never starts: "Expected 8 threads to join the rendezvous, but only 7 of
them arrived", and XLA aborts the process after its collective timeout. On 8 forced CPU devices
(jax 0.10.2, 2 cores) a shard_map'ed ``ppermute`` of 4 KiB hung within 200 unblocked calls and
a ``TrainStep`` with the ring allreduce within 500 steps, while the same loops holding at most
16 calls in flight ran 2,000 calls each without a hang and at the same speed.

:class:`InFlightWindow` keeps such a loop below that depth: it holds the outputs of the last
``limit`` calls and waits for the oldest before admitting another. :class:`~jaxdist.train_step.
TrainStep` and :class:`~jaxdist.train_step.EvalStep` use one on CPU meshes; research code that
jits its own collectives can do the same.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import jax
from jax.sharding import Mesh

# Calls in flight on CPU devices: far below the depth that hung, and deep enough that the
# Python loop still prepares the next batch while a step runs.
CPU_IN_FLIGHT_LIMIT = 4


def default_limit(mesh: Mesh) -> int | None:
    """:data:`CPU_IN_FLIGHT_LIMIT` for a mesh of several CPU devices, else ``None`` (no limit:
    GPU and TPU runtimes pace their own queues)."""
    devices = list(mesh.devices.flat)
    if len(devices) > 1 and all(d.platform == "cpu" for d in devices):
        return CPU_IN_FLIGHT_LIMIT
    return None


def resolve_limit(limit: int | str | None, mesh: Mesh) -> int | None:
    """``"auto"`` -> :func:`default_limit`; ``None`` -> no limit; else a positive int."""
    return default_limit(mesh) if limit == "auto" else _checked(limit)


def _checked(limit: Any) -> int | None:
    if limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1):
        return limit
    raise ValueError(
        f"max_in_flight must be a positive int, None (no limit) or 'auto', got {limit!r}"
    )


class InFlightWindow:
    """At most ``limit`` calls in flight: :meth:`admit` each call's outputs after dispatching
    it; when more than ``limit`` are held it waits for the oldest. ``limit=None`` never waits.

    Pass outputs that the next calls do not donate (a step's metrics, not its state): waiting
    on a donated buffer fails once it has been handed over.
    """

    def __init__(self, limit: int | None):
        self.limit = _checked(limit)
        self._pending: deque[Any] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def admit(self, outputs: Any) -> None:
        if self.limit is None:
            return
        self._pending.append(outputs)
        while len(self._pending) > self.limit:
            jax.block_until_ready(self._pending.popleft())
