"""What both train steps share: the loss, optimizer and mesh they are built on, their options
(:mod:`jaxdist.training.step_options`), and one jitted program compiled at the first call and
run with a bounded queue of calls in flight.

:class:`~jaxdist.training.train_step.TrainStep` and :class:`~jaxdist.pipeline.step.PipelineStep`
subclass it and say only how their program is built (``_build``) and what a batch must be
(``_check_batch``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from jaxdist.runtime import dispatch
from jaxdist.training.batches import check_batch_sizes
from jaxdist.training.step_checks import check_optimizer, donation_default
from jaxdist.training.step_options import Communication, Precision

__all__ = ["CompiledStep"]


class CompiledStep:
    """The parts and the call of a jitted train step on a mesh.

    Attributes:
      loss_fn, optimizer, mesh: what the step was built on.
      communication: how gradients travel (:class:`~jaxdist.training.step_options.Communication`).
      precision: loss scaling and skipped steps (:class:`~jaxdist.training.step_options.Precision`).
      donate: whether the state's buffers are donated to the step.
      trace_count: how many times the step was traced (compiled); tests guard on it.
    """

    def __init__(
        self,
        loss_fn: Callable,
        optimizer: Any,
        mesh: Mesh,
        communication: Communication,
        precision: Precision,
        donate: bool | None,
        max_in_flight: dispatch.Limit,
    ) -> None:
        check_optimizer(optimizer)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.mesh = mesh
        self.communication = communication
        self.precision = precision
        self.donate = donation_default(mesh) if donate is None else donate
        self.trace_count = 0
        self._compiled: Callable | None = None
        self._in_flight = dispatch.shared_window(mesh, max_in_flight)

    def __call__(self, state: Any, batch: Any, rng: jax.Array) -> tuple[Any, dict]:
        """One step: the new state and the step's metrics."""
        check_batch_sizes(batch)
        self._check_batch(batch)
        compiled = self._compiled_for(state)
        self._in_flight.make_room()
        new_state, metrics = compiled(state, batch, rng)
        self._in_flight.add(metrics)  # metrics, never donated: safe to wait on later
        return new_state, metrics

    def lower(self, state: Any, batch: Any, rng: jax.Array) -> Any:
        """The lowered step (``.compile().as_text()`` shows XLA's scheduled program,
        ``.compile().memory_analysis()`` its per-device memory)."""
        self._check_batch(batch)
        return self._compiled_for(state).lower(state, batch, rng)

    def count_trace(self) -> None:
        """Called by the step's program each time it is traced."""
        self.trace_count += 1

    def _compiled_for(self, state: Any) -> Callable:
        if self._compiled is None:
            self._compiled = self._build(state)
        return self._compiled

    def _check_batch(self, batch: Any) -> None:
        """Refuse, before compiling, a batch this kind of step cannot take."""

    def _build(self, state: Any) -> Callable:
        raise NotImplementedError
