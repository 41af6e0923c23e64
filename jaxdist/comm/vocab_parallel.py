"""The vocabulary split over a tensor axis: the token embedding, the logits and the
cross-entropy (Megatron's vocabulary-parallel embedding and loss).

With the vocabulary split over the ``tensor`` axis (the rule ``vocab=tensor``), each device
holds ``vocab / p`` rows of the token embedding and columns of the output head, and the
logits, a language model's largest activation (``tokens x vocab``, in float32), are never
whole on any device:

* :func:`embed`: each device looks the tokens up in its own rows (zeros for the others'),
  and the lookups are summed over the axis;
* the logits are a column-parallel product
  (:func:`~jaxdist.comm.tensor_parallel.column_product`): each device its vocabulary's
  columns, from the whole input (under sequence parallelism, its positions gathered);
* :func:`cross_entropy`: each device's largest logit (a maximum over the axis), its sum of
  exponentials and the target's logit where it holds the target (one sum over the axis):
  two numbers per token cross the axis instead of the logits.

Outside :func:`~jaxdist.comm.tensor_parallel.splitting`, or with the vocabulary whole,
each is the plain computation on whole arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxdist.comm.collective_matmul import TENSOR_SCOPE
from jaxdist.comm.scopes import SPLIT_SCOPE
from jaxdist.comm.tensor_parallel import vocabulary_axis

__all__ = ["cross_entropy", "embed"]


def embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """The rows of ``table`` ``[vocab, d]`` at ``tokens`` (integers), ``[*tokens.shape, d]``;
    with the vocabulary split, ``table`` is this device's rows and the result is the same
    on every device of the axis. A token outside the vocabulary reads as NaN whole
    (``jnp.take``'s fill) but as zeros split, where no device holds it: keep tokens in
    range."""
    axis = vocabulary_axis()
    if axis is None:
        return jnp.take(table, tokens, axis=0)
    with jax.named_scope(SPLIT_SCOPE), jax.named_scope(TENSOR_SCOPE):
        mine, local = _own_rows(tokens, table.shape[0], axis)
        found = jnp.take(table, local, axis=0)
        return _summed(jnp.where(mine[..., None], found, jnp.zeros((), table.dtype)), axis)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per token, ``-log softmax(logits)[target]`` (nats): ``logits`` ``[..., vocab]``,
    ``targets`` ``[...]`` integers; with the vocabulary split, ``logits`` are this device's
    columns and the result is the same on every device of the axis."""
    axis = vocabulary_axis()
    if axis is None:
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    with jax.named_scope(SPLIT_SCOPE), jax.named_scope(TENSOR_SCOPE):
        # The largest logit only keeps exp() in range: its value cancels, so no gradient.
        peak = lax.pmax(lax.stop_gradient(jnp.max(logits, axis=-1)), axis)
        shifted = logits - peak[..., None]
        mine, local = _own_rows(targets, logits.shape[-1], axis)
        target = jnp.take_along_axis(shifted, local[..., None], axis=-1)[..., 0]
        # Both sums in one transfer: the softmax's normaliser and the target's logit.
        parts = jnp.stack([jnp.sum(jnp.exp(shifted), axis=-1), jnp.where(mine, target, 0)])
        exponentials, target = _summed(parts, axis)
        return jnp.log(exponentials) - target


def _own_rows(indices: jax.Array, rows: int, axis: str) -> tuple[jax.Array, jax.Array]:
    """Which of ``indices`` fall in this device's ``rows`` of the vocabulary (device ``i``
    holds ``[i rows, (i + 1) rows)``), and each as a row of this device's (0 where not)."""
    local = indices - lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    return mine, jnp.where(mine, local, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _summed(value: jax.Array, axis: str) -> jax.Array:
    return lax.psum(value, axis)


def _summed_forward(value, axis):
    return _summed(value, axis), None


def _summed_backward(axis, _, cotangent):
    # What follows the sum runs alike on every device: each part's gradient is the sum's.
    return (cotangent,)


_summed.defvjp(_summed_forward, _summed_backward)
