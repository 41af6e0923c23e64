"""What every train step offers: the one interface the trainer, the planner and checkpoints use.

:class:`~jaxdist.training.train_step.TrainStep` (data parallel) and
:class:`~jaxdist.pipeline.step.PipelineStep` (a model cut into stages) both implement it, so
code that runs a step never asks which one it holds::

    state = step.init(params, model_state)          # the whole model's trees
    for batch in batches:
        state = step.set_learning_rate(state, lr)
        state, metrics = step(state, step.shard_batch(batch), rng)
    params, model_state = step.whole_variables(state)   # to evaluate or export

A step refuses, in one line when it is built, any option it cannot honour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
from jax.sharding import Mesh

__all__ = ["LossFn", "Step"]

# ``loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, metrics))`` on one
# device's shard of the batch; ``metrics`` is a dict of scalars.
LossFn = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, tuple[Any, dict]]]


@runtime_checkable
class Step(Protocol):
    """A jitted train step on a mesh; its state is one pytree (donated and checkpointed whole).

    Attributes:
      mesh: the devices the step runs on.
      data_axes: the mesh axes that split the batch.
      num_replicas: devices along the data axes: each sees a different part of the batch.
      accumulation_steps: micro-batches whose gradients each device sums before averaging.
      trace_count: how many times the step was traced (compiled).
    """

    mesh: Mesh
    data_axes: Any
    num_replicas: int
    accumulation_steps: int
    trace_count: int

    def init(self, params: Any, model_state: Any = None) -> Any:
        """The initial state from the whole model's parameters and model state, placed on
        the mesh."""

    def init_sharded(
        self, init_variables: Callable[[jax.Array], tuple[Any, Any]], rng: jax.Array
    ) -> Any:
        """The initial state made by ``init_variables(rng) -> (params, model_state)`` under
        ``jax.jit`` straight into its placement on the mesh."""

    def abstract_init(self, params: Any, model_state: Any = None) -> Any:
        """What :meth:`init` would return, as ``jax.ShapeDtypeStruct`` leaves with their
        shardings (the trees may be shapes): compiles for devices that are not here."""

    def evaluation(self, eval_fn: Callable, params: Any) -> tuple[Callable, Any]:
        """``eval_fn(params, model_state, batch)`` as it runs on one device's share of
        :meth:`whole_variables`' parameters, and their PartitionSpecs
        (:class:`~jaxdist.training.eval_step.EvalStep`)."""

    def shard_batch(self, batch: Any) -> Any:
        """A global batch placed on the mesh, split over the data axes."""

    def __call__(self, state: Any, batch: Any, rng: jax.Array) -> tuple[Any, dict]:
        """One step: the new state and the step's metrics (``loss`` among them)."""

    def lower(self, state: Any, batch: Any, rng: jax.Array) -> Any:
        """The lowered step, for its compiled program and memory analysis."""

    def set_learning_rate(self, state: Any, learning_rate: float) -> Any:
        """The state with ``learning_rate`` for the next step (no recompilation)."""

    def whole_variables(self, state: Any) -> tuple[Any, Any]:
        """``(params, model_state)`` of the whole model, as :meth:`init` takes them."""
