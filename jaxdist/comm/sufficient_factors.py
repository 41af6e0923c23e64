"""Sufficient-factor broadcasting: a dense layer's mean gradient from every device's factors.

Device ``r`` holds ``X_r`` (its rows of the layer's input) and ``G_r`` (the loss gradient at
the layer's output for the same rows); its own kernel gradient is ``X_r^T G_r``. Stacking all
devices' rows, ``sum_r X_r^T G_r = X^T G``, so one ring all-gather of ``[X_r | G_r]`` (each
device sends ``rows (m + n)`` numbers ``R - 1`` times) and one matrix product on every device
give the mean that an allreduce of the ``m x n`` gradients would: the same sums, in another
order, so equal to float32 rounding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxdist.comm import collectives

__all__ = ["mean_gradient_from_factors"]


def mean_gradient_from_factors(
    inputs: jax.Array,
    output_grads: jax.Array,
    axis_name: collectives.AxisName,
    *,
    transfer_dtype: Any = None,
    **ring_options: Any,
) -> jax.Array:
    """The mean over ``axis_name`` of ``inputs^T @ output_grads`` (``rows x m`` and
    ``rows x n`` on each device), from one ring all-gather of the factors; call inside
    shard_map. Factors travel in ``transfer_dtype`` (default float32) and the product is
    formed in float32. ``ring_options``: ``exchange_piece_bytes``, ``unroll_limit``."""
    rows, m = inputs.shape
    if output_grads.shape[0] != rows:
        raise ValueError(
            f"factors need the same rows: inputs {inputs.shape}, output "
            f"gradients {output_grads.shape}"
        )
    packed = jnp.concatenate([inputs.astype(jnp.float32), output_grads.astype(jnp.float32)], axis=1)
    devices = collectives.axis_size(axis_name)
    gathered = collectives.all_gather(
        packed, axis_name, transfer_dtype=transfer_dtype, **ring_options
    ).reshape(devices * rows, -1)
    every_input, every_grad = gathered[:, :m], gathered[:, m:]
    return (every_input.T @ every_grad) / devices
