"""A pipeline's state: each virtual stage's trees as one flat padded vector, stacked over the
stage axis, and the way back to trees.

Stages differ in every shape, but one SPMD program runs them all, so the parameters, model
state and optimizer state of virtual stage ``v`` are raveled into row ``(v mod S, v div S)``
of an array of shape ``(stages, chunks, size)`` (:class:`~jaxdist.pipeline.stages.FlatLayout`
pads them to the largest stage's size). The functions here move between the two forms on the
host; :class:`~jaxdist.pipeline.step.PipelineStep` uses them for init, checkpoints' whole
variables and the learning rate written each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxdist.pipeline.stages import FlatLayout
from jaxdist.training.loss_scale import DynamicLossScale

__all__ = [
    "PipelineState",
]


class PipelineState(struct.PyTreeNode):
    """A pipeline's state. ``params``, ``model_state`` and ``opt_state`` are arrays of shape
    ``(stages, chunks, size)``, split over the stage axis: one flat padded vector per virtual
    stage (:meth:`PipelineStep.unstack` gives the trees back)."""

    step: jax.Array
    params: jax.Array
    model_state: jax.Array
    opt_state: jax.Array
    loss_scale: DynamicLossScale | None = None
    previous_params: jax.Array | None = None  # PipeDream-2BW's older version


def stack(layout: FlatLayout, trees: Sequence[Any], stages: int, chunks: int) -> np.ndarray:
    """Virtual stage v's tree, flattened, at row ``(v mod stages, v div stages)``."""
    out = np.zeros((stages, chunks, layout.size), layout.dtype)
    for v, tree in enumerate(trees):
        out[v % stages, v // stages] = np.asarray(layout.flatten(tree))
    return out


def unstack(layout: FlatLayout, array: Any, stages: int, count: int) -> list[Any]:
    """The ``count`` virtual stages' trees back from a stacked array, on the host."""
    array = np.asarray(array)
    return [layout.unflatten(v, array[v % stages, v // stages]) for v in range(count)]


def join_stages(params: Sequence[dict], model_states: Sequence[dict]) -> tuple[dict, dict]:
    """The whole model's ``(params, model_state)`` from its stages' parts, joined by name:
    each stage owns the top-level names of its layers, under each model-state collection."""
    whole_params: dict = {}
    whole_state: dict = {}
    for part in params:
        whole_params.update(part)
    for part in model_states:
        for collection, tree in part.items():
            whole_state.setdefault(collection, {}).update(tree)
    return whole_params, whole_state


def hyperparameter_positions(
    layout: FlatLayout, opt_shapes: Sequence[Any], stages: int, name: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stage, chunk, offset) of hyperparameter ``name`` in every virtual stage's flat
    optimizer state, found by raveling each state with only that leaf set."""
    positions = []
    for v, opt_state in enumerate(opt_shapes):
        marked = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), opt_state)
        if optax.tree_utils.tree_get(marked, name) is None:
            raise KeyError(
                f"optimizer state has no {name!r} hyperparameter; build the optimizer with "
                f"jaxdist.training.optim.make_optimizer (or optax.inject_hyperparams)"
            )
        marked = optax.tree_utils.tree_set(marked, **{name: jnp.ones(())})
        for offset in np.flatnonzero(np.asarray(layout.flatten(marked))):
            positions.append((v % stages, v // stages, offset))
    return tuple(np.array(column) for column in zip(*positions))


@jax.jit
def write_at(array: jax.Array, stage, chunk, offset, value) -> jax.Array:
    """``array`` with ``value`` at every ``(stage, chunk, offset)``."""
    return array.at[stage, chunk, offset].set(value)
