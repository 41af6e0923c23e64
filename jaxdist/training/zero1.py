"""ZeRO stage 1 inside the train step: optimizer state and the update sharded over the data
axes.

Each device reduce-scatters the gradients (flattened into one float32 vector), updates only
its own ``1/p`` slice of the parameters with its own slice of the optimizer state, and
all-gathers the parameters. The optimizer therefore sees one flat vector per device and must
be element-wise (SGD, momentum, Adam, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.flatten_util import ravel_pytree

from jaxdist.comm import collectives
from jaxdist.comm.scopes import GRADIENT_SCOPE, LOSS_SCALE_SCOPE, PARAMETER_SCOPE
from jaxdist.training.loss_scale import all_finite

__all__: list[str] = []  # building blocks of the package's own modules


def zero1_update(
    optimizer: optax.GradientTransformation,
    state: Any,
    grads: Any,
    axes: str | tuple[str, ...],
    zero_size: int,
    options: Mapping[str, Any],
    check_finite: bool = False,
) -> tuple[Any, Any, jax.Array | None]:
    """``(new params, new optimizer state, gradients finite or None)`` for a train state whose
    optimizer state holds this device's slice of a ``zero_size`` vector (the parameters
    flattened and padded to a multiple of the device count). ``options``: the train step's
    allreduce options; those every schedule takes, and ``transfer_dtype`` for the gradients,
    go to the ring reduce-scatter and all-gather. The verdict is computed under a loss scale
    or when ``check_finite``."""
    num_replicas = collectives.axis_size(axes)
    flat_grads = collectives.pack(jax.tree.leaves(grads), jnp.float32)
    flat_params = collectives.pack(jax.tree.leaves(state.params), jnp.float32)
    _, unravel = ravel_pytree(state.params)  # its concatenation goes unused: XLA drops it
    # The options every schedule takes go to the ring building blocks; the rest belong to
    # the full schedules.
    ring_options = {k: v for k, v in options.items() if k in collectives.COMMON_OPTIONS}
    transfer = {k: v for k, v in options.items() if k == "transfer_dtype"}
    with jax.named_scope(GRADIENT_SCOPE):  # how jaxdist.aot tells gradients from the rest
        grad_slice = collectives.reduce_scatter(flat_grads, axes, **ring_options, **transfer)
    grad_slice = grad_slice / num_replicas
    finite = None
    if state.loss_scale is not None:
        grad_slice = grad_slice / state.loss_scale.scale
    if state.loss_scale is not None or check_finite:
        # Each device checks only its slice; the step is skipped everywhere if one is bad.
        with jax.named_scope(LOSS_SCALE_SCOPE):
            finite = lax.pmin(all_finite(grad_slice).astype(jnp.int32), axes) > 0
    slice_size = zero_size // num_replicas
    padded = jnp.pad(flat_params, (0, zero_size - flat_params.size))
    param_slice = lax.dynamic_slice_in_dim(padded, lax.axis_index(axes) * slice_size, slice_size)
    updates, opt_state = optimizer.update(grad_slice, state.opt_state, param_slice)
    new_slice = optax.apply_updates(param_slice, updates)
    # Parameters travel in full precision: ``transfer_dtype`` is for gradients, and a
    # rounded all-gather would cut every device's float32 master copy to that dtype.
    with jax.named_scope(PARAMETER_SCOPE):
        new_flat = collectives.all_gather(new_slice, axes, **ring_options)[: flat_params.size]
    return unravel(new_flat), opt_state, finite
