"""The data-parallel step's state, and how a value every process holds is placed on a mesh."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import struct
from jax.sharding import NamedSharding

from jaxdist.training.loss_scale import DynamicLossScale

__all__ = ["TrainState", "place_per_process"]


class TrainState(struct.PyTreeNode):
    """Everything a step changes. A pytree: it is donated, sharded and checkpointed as one."""

    step: jax.Array
    params: Any
    model_state: Any
    opt_state: Any
    loss_scale: DynamicLossScale | None = None


def place_per_process(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` (the same on every process) placed with ``sharding``, each process filling
    only its own devices. ``jax.device_put`` would first check across processes that all hold
    the same value: a blocking collective (before every step, for a learning rate), and for a
    whole train state an all-gather that ran 8 processes of one machine out of memory."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, host.__getitem__)
