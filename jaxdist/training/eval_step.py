"""A jitted evaluation step on the train step's mesh and layout, and the classifier
evaluation the trainer runs with it.

Given the train step (``layout=``), the evaluation reads each device's own shards of the
parameters as the step keeps them: an FSDP model is gathered layer by layer just before each
layer runs, as the step's forward does, and a model split over a ``tensor`` axis computes
its products split, so evaluating never holds more of the model on a device than training
does. Without it, every device receives the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.runtime import dispatch
from jaxdist.training.batches import check_batch_sizes, data_axes_of
from jaxdist.training.train_state import TrainState

__all__ = ["EvalFn", "EvalLayout", "EvalStep", "classifier_eval"]

EvalFn = Callable[[Any, Any, Any], dict]


class EvalLayout(Protocol):
    """What a train step tells an evaluation about where its parameters live."""

    def evaluation(self, eval_fn: EvalFn, params: Any) -> tuple[EvalFn, Any]:
        """``(body, specs)``: ``eval_fn`` as it runs on one device's parameter shards
        (gathering or summing what the step's layout asks), and the PartitionSpecs of the
        parameter tree ``params`` as the step keeps it."""
        ...


class EvalStep:
    """A jitted eval step on a train step's mesh: ``eval_fn(params, model_state, batch)``
    returns a dict of per-device *sums* (e.g. correct predictions, example count); the step
    returns their totals over the data axes. ``layout``: the train step whose parameter
    layout the evaluation runs on (each device its own shards, see the module docstring);
    None: the whole model on every device. ``max_in_flight`` as for
    :class:`~jaxdist.training.train_step.TrainStep`."""

    def __init__(
        self,
        eval_fn: EvalFn,
        mesh: Mesh,
        *,
        data_axes: str | tuple[str, ...] | None = None,
        layout: EvalLayout | None = None,
        max_in_flight: dispatch.Limit = "auto",
    ):
        self.mesh = mesh
        self.data_axes = data_axes_of(mesh, data_axes)
        self.eval_fn = eval_fn
        self.layout = layout
        self._in_flight = dispatch.shared_window(mesh, max_in_flight)
        self._step: Callable | None = None

    def _build(self, params: Any) -> Callable:
        body, specs = (
            (self.eval_fn, jax.tree.map(lambda _: P(), params))
            if self.layout is None
            else self.layout.evaluation(self.eval_fn, params)
        )

        def summed(params, model_state, batch):
            return lax.psum(body(params, model_state, batch), self.data_axes)

        return jax.jit(
            jax.shard_map(
                summed,
                mesh=self.mesh,
                in_specs=(specs, P(), P(self.data_axes)),
                out_specs=P(),
                check_vma=False,
            )
        )

    def __call__(self, state: TrainState, batch: Any) -> dict:
        check_batch_sizes(batch)
        if self._step is None:
            self._step = self._build(state.params)
        self._in_flight.make_room()
        sums = self._step(state.params, state.model_state, batch)
        self._in_flight.add(sums)  # an eval_fn with no outputs leaves nothing to wait on
        return sums


def classifier_eval(model) -> EvalFn:
    """``eval_fn`` counting top-1 and top-5 hits; a ``mask`` in the batch drops padding."""

    def eval_fn(params, model_state, batch):
        logits = model.apply({"params": params, **model_state}, batch["image"], train=False)
        labels = batch["label"]
        mask = batch.get("mask", jnp.ones(labels.shape, bool)).astype(jnp.float32)
        top5 = jnp.argsort(logits, -1)[..., -5:]
        return {
            "top1": jnp.sum((top5[..., -1] == labels) * mask),
            "top5": jnp.sum(jnp.any(top5 == labels[..., None], -1) * mask),
            "count": jnp.sum(mask),
        }

    return eval_fn
