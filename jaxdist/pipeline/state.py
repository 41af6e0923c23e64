"""A pipeline's state: each virtual stage's trees as one flat padded vector, stacked over the
stage axis, and the way back to trees.

Stages differ in every shape, but one SPMD program runs them all, so the parameters, model
state and optimizer state of virtual stage ``v`` are raveled into row ``(v mod S, v div S)``
of an array of shape ``(stages, chunks, size)`` (:class:`~jaxdist.pipeline.stages.FlatPacking`
pads them to the largest stage's size). The functions here move between the two forms on the
host; :class:`~jaxdist.pipeline.step.PipelineStep` uses them for init, checkpoints' whole
variables and the learning rate written each step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxdist.pipeline.stages import FlatPacking
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


def stack(packing: FlatPacking, trees: Sequence[Any], stages: int, chunks: int) -> np.ndarray:
    """Virtual stage v's tree, flattened, at row ``(v mod stages, v div stages)``."""
    out = np.zeros((stages, chunks, packing.size), packing.dtype)
    for v, tree in enumerate(trees):
        out[v % stages, v // stages] = np.asarray(packing.flatten(tree))
    return out


def stack_traced(packing: Any, trees: Sequence[Any], stages: int, chunks: int) -> jax.Array:
    """:func:`stack` as a traced computation, for a state made under ``jax.jit`` straight
    into its shardings."""
    out = jnp.zeros((stages, chunks, packing.size), packing.dtype)
    for v, tree in enumerate(trees):
        out = out.at[v % stages, v // stages].set(packing.flatten(tree))
    return out


def unstack(packing: FlatPacking, array: Any, stages: int, count: int) -> list[Any]:
    """The ``count`` virtual stages' trees back from a stacked array, on the host."""
    array = np.asarray(array)
    return [packing.unflatten(v, array[v % stages, v // stages]) for v in range(count)]


def join_stages(params: Sequence[dict], model_states: Sequence[dict]) -> tuple[dict, dict]:
    """The whole model's ``(params, model_state)`` from its stages' parts, joined by name at
    every depth (stage 0's ``{"blocks": {0: ...}}`` and stage 1's ``{"blocks": {1: ...}}``
    make ``{"blocks": {0: ..., 1: ...}}``). Two stages holding the same name, or a stage whose
    part is not a dict, is an error: joined, one would silently replace the other."""
    return _joined(params, "parameters"), _joined(model_states, "model state")


def _joined(parts: Sequence[Any], what: str) -> dict:
    whole: dict = {}
    owner: dict[tuple, int] = {}

    def merge(into: dict, part: Any, path: tuple, stage: int) -> None:
        for key, value in part.items():
            here = (*path, key)
            if isinstance(value, Mapping) and isinstance(into.get(key), dict):
                merge(into[key], value, here, stage)
            elif key in into:
                name = "/".join(map(str, here))
                first = next(owner[here[:i]] for i in range(len(here), 0, -1) if here[:i] in owner)
                raise ValueError(
                    f"pipeline stages {first} and {stage} both "
                    f"hold {what} named {name!r}: name each stage's layers apart (for example "
                    "by their index in the whole model) so the stages join into one model"
                )
            else:
                into[key] = _copied(value)
                owner[here] = stage

    for stage, part in enumerate(parts):
        if not isinstance(part, Mapping):
            raise ValueError(
                f"pipeline stage {stage}'s {what} are a {type(part).__name__}; the stages' "
                "parts join into the whole model by name, so each must be a dict"
            )
        merge(whole, part, (), stage)
    return whole


def _copied(value: Any) -> Any:
    """Dicts copied (later stages merge into them), leaves as they are."""
    if isinstance(value, Mapping):
        return {k: _copied(v) for k, v in value.items()}
    return value


def hyperparameter_positions(
    packing: FlatPacking, opt_shapes: Sequence[Any], stages: int, name: str
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
        for offset in np.flatnonzero(np.asarray(packing.flatten(marked))):
            positions.append((v % stages, v // stages, offset))
    return tuple(np.array(column) for column in zip(*positions))


@jax.jit
def write_at(array: jax.Array, stage, chunk, offset, value) -> jax.Array:
    """``array`` with ``value`` at every ``(stage, chunk, offset)``."""
    return array.at[stage, chunk, offset].set(value)
