"""XLA's own FSDP of a sharded step, compiled beside ours: the yardstick for its memory.

The same model, loss, optimizer, batch and parameter layout as a ZeRO-1 or FSDP
:class:`~jaxdist.training.train_step.TrainStep`, written as a plain ``jax.jit`` of
``value_and_grad`` and the optax update, with the parameters and the optimizer state placed
by ``NamedSharding`` as the step keeps them and the batch split over the data axes: XLA's
SPMD partitioner then inserts the all-gathers and reduce-scatters itself (as MaxText and
big_vision shard a model). Its memory per chip, from the compiler's own analysis, is what a
user could have had without our schedules; a plan prints it beside ours.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.aot.compile import (
    DoesNotFitError,
    MemoryPerChip,
    abstract_batch,
    compile_or_refuse,
    memory_per_chip,
)
from jaxdist.training.train_step import TrainStep

__all__ = ["XlaFsdp", "compile_xla_fsdp"]


class XlaFsdp:
    """What compiling XLA's own FSDP of a step showed: its memory per chip (None where the
    compiler found it does not fit, with the compiler's line in ``refusal``) and the time
    the compile took."""

    def __init__(self, memory: MemoryPerChip | None, compile_seconds: float, refusal: str = ""):
        self.memory, self.compile_seconds, self.refusal = memory, compile_seconds, refusal


def compile_xla_fsdp(step: TrainStep, params: Any, model_state: Any, batch: dict) -> XlaFsdp:
    """Compile XLA's own FSDP of the sharded ``step`` (see the module docstring) from shapes
    alone; ``batch`` as :func:`jaxdist.aot.compile.compile_train_step` takes it."""
    state = step.abstract_init(params, model_state)
    if any(not isinstance(v, jax.ShapeDtypeStruct) for v in batch.values()):
        batch = abstract_batch(step.mesh, step.data_axes, batch)
    replicated = NamedSharding(step.mesh, P())
    key = jax.eval_shape(lambda: jax.random.key(0))
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
    state_shardings = step.state_shardings(state)

    def train_step(state, batch, rng):
        grad_fn = jax.value_and_grad(step.loss_fn, has_aux=True)
        (loss, (model_state, _)), grads = grad_fn(state.params, state.model_state, batch, rng)
        updates, opt_state = step.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = state.replace(
            step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state
        )
        return new, loss

    jitted = jax.jit(train_step, out_shardings=(state_shardings, replicated), donate_argnums=0)
    started = time.perf_counter()
    try:
        _, compiled, seconds = compile_or_refuse(
            lambda: jitted.lower(state, batch, rng), step.mesh.devices.flat[0]
        )
    except DoesNotFitError as err:
        return XlaFsdp(None, time.perf_counter() - started, str(err))
    return XlaFsdp(memory_per_chip(state, compiled), seconds)
