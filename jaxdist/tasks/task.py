"""What a recipe trains: a :class:`Task` gives the model's variables, the loss, the
evaluation and the data; the trainer does the rest (mesh, steps, batch ramp, learning rate,
resume, logs, checkpoints, faults) the same way for every task.

A recipe file that defines ``get_task(config, replicas)`` trains that task; one without it
trains :class:`~jaxdist.tasks.image_classification.ImageClassification` built from its
``model`` and ``data`` fields. A task in a few lines, fitting ``y`` (shape ``(n, 1)``) to
``x`` (shape ``(n, 8)``), with ``xv`` and ``yv`` held out::

    import jax.numpy as jnp

    from jaxdist.data.records import ArrayRecords, RecordData
    from jaxdist.tasks import Task

    class Regression(Task):
        headline = "mse"
        higher_is_better = False

        def __init__(self, config, replicas):
            self.data = RecordData(ArrayRecords({"x": x, "y": y}),
                                   ArrayRecords({"x": xv, "y": yv}), seed=config.seed)

        def init_variables(self, rng):
            return {"w": jnp.zeros((8, 1))}, {}

        def loss(self, params, model_state, batch, rng):
            error = batch["x"] @ params["w"] - batch["y"]
            return jnp.mean(error**2), (model_state, {})

        def eval_sums(self, params, model_state, batch):
            error = batch["x"] @ params["w"] - batch["y"]
            mask = batch["mask"][:, None]
            return {"mse": jnp.sum(error**2 * mask), "count": jnp.sum(mask)}

    def get_task(config, replicas):
        return Regression(config, replicas)

Batches are dicts of arrays. A train batch holds one process's share of the global batch;
an eval batch also holds ``mask`` (``False`` on the padding that fills the last batch), and
:meth:`Task.eval_sums` returns per-device *sums* weighted by it, so the totals over the
devices are exact. :meth:`Task.eval_metrics` turns the totals into the reported metrics
(by default: every sum divided by ``count``).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import jax

from jaxdist.training.logical_axes import LogicalAxes

__all__ = ["Data", "PipelineParts", "Replicas", "Task"]


@dataclasses.dataclass(frozen=True)
class Replicas:
    """What a task needs to know of the mesh it is trained on.

    Attributes:
      axis_names: the mesh axes that split the batch (one name or a tuple), for models whose
        layers reduce over the batch (cross-replica BatchNorm).
      count: devices along them: each sees a different part of the batch.
    """

    axis_names: str | tuple[str, ...]
    count: int


class Data(Protocol):
    """A task's data, as the trainer reads it.

    ``train_iterator`` continues the global sample stream at ``start_sample`` (a resume, or a
    new batch size); its iterator has ``next_sample`` (samples consumed), ``get_state()``,
    ``set_state(state)``, ``position_state()`` and ``close()``, as
    :class:`~jaxdist.data.BatchIterator` has. ``eval_iterator`` is a context manager over
    one pass of the held-out split, padded with ``mask=False`` records to whole batches.
    """

    num_train_examples: int
    num_eval_examples: int

    def train_iterator(self, global_batch_size: int, start_sample: int = 0) -> Any: ...

    def eval_iterator(
        self, global_batch_size: int
    ) -> AbstractContextManager[Iterator[dict[str, Any]]]: ...


@dataclasses.dataclass(frozen=True)
class PipelineParts:
    """A model cut into stages, as :class:`~jaxdist.pipeline.step.PipelineStep` takes it.

    Attributes:
      stages: one ``(params, model_state, x, rng) -> (y, model_state)`` per virtual stage.
      loss: ``(last stage's output, micro_batch) -> (loss, metrics)``.
      inputs: ``batch -> first stage's input``.
      split: ``(params, model_state) -> (per-stage params, per-stage model state)``.
    """

    stages: Sequence[Callable]
    loss: Callable
    inputs: Callable
    split: Callable


class Task(abc.ABC):
    """What a recipe trains. Subclasses set :attr:`data` and define the abstract methods.

    Attributes:
      name: what logs and the MLPerf event log call the task's model.
      headline: the evaluation metric the progress line shows first and ``target_accuracy``
        refers to.
      higher_is_better: whether a larger headline is better (accuracy) or worse (loss).
      unit: what one example is called, a plain word: throughput is shown as ``<unit>/s``
        and recorded in ``metrics.jsonl`` as ``<unit>_per_sec`` (``samples_per_sec``;
        ``images_per_sec`` for image classification).
      data: the task's :class:`Data`.
    """

    name: str = "model"
    headline: str = "loss"
    higher_is_better: bool = False
    unit: str = "samples"
    data: Data

    @abc.abstractmethod
    def init_variables(self, rng: jax.Array) -> tuple[Any, Any]:
        """``(params, model_state)`` of the whole model from ``rng``: pytrees of arrays
        (``model_state`` holds what is not trained, such as BatchNorm statistics; ``{}``
        when there is none)."""

    @abc.abstractmethod
    def loss(
        self, params: Any, model_state: Any, batch: dict, rng: jax.Array
    ) -> tuple[jax.Array, tuple[Any, dict]]:
        """``(loss, (new_model_state, metrics))`` on one device's part of a train batch;
        ``metrics`` is a dict of scalars."""

    @abc.abstractmethod
    def eval_sums(self, params: Any, model_state: Any, batch: dict) -> dict:
        """Per-device sums over one device's part of an eval batch, weighted by
        ``batch["mask"]`` (``count`` among them, for :meth:`eval_metrics`)."""

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """The reported metrics from the sums totalled over the held-out split: every sum
        but ``count`` divided by ``count``."""
        count = totals["count"]
        return {k: v / count for k, v in totals.items() if k != "count"}

    def batch_spec(self, global_batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes of a train batch of ``global_batch_size`` records, to compile a step for
        devices that are not here (``jaxdist plan``). Default: read from one batch of
        the data."""
        iterator = self.data.train_iterator(global_batch_size)
        try:
            batch = next(iterator)
        finally:
            iterator.close()
        return {
            k: jax.ShapeDtypeStruct((global_batch_size, *v.shape[1:]), v.dtype)
            for k, v in batch.items()
        }

    def model_flops_per_example(self) -> float | None:
        """Training FLOPs of one example as the model's literature counts them (a
        transformer: MaxText's 6 x parameters x tokens + attention), for a plan's model FLOPs
        utilization and its transformer efficiency; None (the default): the plan counts the
        compiled program's FLOPs alone."""
        return None

    def stacked_layers(self) -> Any:
        """A tree of booleans like the parameters, true where a leaf's first dimension counts
        layers a ``lax.scan`` runs over (``nnx.scan``, ``nn.scan``): FSDP splits such a leaf
        below that axis and gathers it one layer at a time inside the scan. Default: None,
        no such leaves."""
        return None

    def logical_axes(self) -> LogicalAxes | None:
        """The parameters' named dimensions and which names the model computes
        tensor-parallel (:class:`~jaxdist.training.logical_axes.LogicalAxes`), which the
        recipe's ``logical_axis_rules`` map to mesh axes. Default: None, a model that names
        no dimensions (it trains on any mesh without a ``tensor`` axis)."""
        return None

    def pipeline_parts(
        self, virtual_stages: int, boundaries: Sequence[int] | None
    ) -> PipelineParts:
        """The model cut into ``virtual_stages`` stages (equal, or starting at the layer
        indices ``boundaries``). A task that does not define it trains data-parallel only."""
        raise ValueError(
            f"the {self.name} task does not cut its model into pipeline stages (it defines no "
            "pipeline_parts); set pipeline.stages=0"
        )

    def describe(self) -> dict[str, Any]:
        """What a pipeline profile records of the model it was made for."""
        return {"name": self.name}
