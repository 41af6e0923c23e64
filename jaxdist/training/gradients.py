"""A device's gradients inside the train step: of its shard of the batch, optionally summed
over micro-batches (gradient accumulation) and of a scaled loss (float16 training), and the
sufficient factors of the dense layers a :class:`~jaxdist.training.dense_factors.FactorTap`
taps."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.training.batches import split_micro_batches
from jaxdist.training.dense_factors import FactorTap

__all__: list[str] = []  # building blocks of the package's own modules


def scaled_objective(
    loss_fn: Callable, model_state: Any, batch: Any, rng: jax.Array, scale: jax.Array | None
) -> Callable:
    """``objective(params) -> (loss x scale, (loss, new model state, metrics))``: what a step
    differentiates on one device's batch (the loss itself without a ``scale``)."""

    def objective(params):
        loss, (new_model_state, metrics) = loss_fn(params, model_state, batch, rng)
        scaled = loss if scale is None else loss * scale.astype(loss.dtype)
        return scaled, (loss, new_model_state, metrics)

    return objective


def reduced_while_computing(
    loss_fn: Callable,
    plan: Any,
    state: Any,
    batch: Any,
    rng: jax.Array,
    scale: jax.Array | None,
    accumulation_steps: int,
    axes: Any,
    options: dict,
) -> tuple[Any, Any, jax.Array, dict]:
    """``(mean gradients over axes, new model state, loss, metrics)`` of a wait-free step: the
    gradient ``plan``'s buckets reduced beside the backward pass of the (last) micro-batch
    (:meth:`~jaxdist.training.gradient_plan.GradientPlan.reduce_while_computing`); with
    accumulation, the earlier micro-batches' sums are added to each gradient before it
    travels."""
    k = accumulation_steps
    model_state, before_reduce = state.model_state, None
    if k > 1:
        head, batch, rng = accumulated_head(
            loss_fn, state.params, state.model_state, batch, rng, scale, k
        )
        grad_sums, model_state, loss_sum, metrics_sum = head
        sums = jax.tree.leaves(grad_sums)
        before_reduce = lambda i, g: (sums[i] + g) / k  # noqa: E731
    objective = scaled_objective(loss_fn, model_state, batch, rng, scale)
    grads, (loss, model_state, metrics) = plan.reduce_while_computing(
        objective, state.params, axes, options, before_reduce
    )
    if k > 1:
        loss = (loss_sum + loss) / k
        metrics = jax.tree.map(lambda a, b: (a + b) / k, metrics_sum, metrics)
    return grads, model_state, loss, metrics


def local_gradients(
    loss_fn: Callable,
    params: Any,
    model_state: Any,
    batch: Any,
    rng: jax.Array,
    scale: jax.Array | None,
    accumulation_steps: int = 1,
    tap: FactorTap | None = None,
) -> tuple[Any, Any, jax.Array, dict, dict]:
    """``(grads, new model state, loss, metrics, factors)`` of ``loss_fn`` on this device's
    ``batch``.

    With ``accumulation_steps = k > 1`` the batch is cut into ``k`` micro-batches run one
    after the other (the model state threads through them, each gets its own rng), all but
    the last in a ``lax.scan``, and gradients, loss and metrics are their means. With a loss
    ``scale`` (float16 training) the gradients are of the scaled loss; the loss reported is
    unscaled.

    With a ``tap``, its layers' kernel gradients are left at zero and ``factors`` maps each
    layer's path to its ``(inputs, output gradients)`` over every row of the batch (all
    micro-batches, the output gradients divided by ``k`` like the mean gradient); without
    one, ``factors`` is empty.
    """

    grad_of = functools.partial(_gradients_of_one, loss_fn, params, scale, tap)
    k = accumulation_steps
    if k == 1:
        return grad_of(batch, model_state, rng)
    local = jax.tree.leaves(batch)[0].shape[0]
    if local % k:
        raise ValueError(
            f"per-device batch of {local} does not split into accumulation_steps={k} micro-batches"
        )
    return _accumulated(grad_of, split_micro_batches(batch, k), model_state, rng, k)


def _gradients_of_one(loss_fn, params, scale, tap, micro_batch, model_state, rng):
    """``(grads, new model state, loss, metrics, factors)`` of one micro-batch."""

    def objective(params, probes):
        if tap is None:
            loss, (new_model_state, metrics) = loss_fn(params, model_state, micro_batch, rng)
            inputs = {}
        else:
            with tap.tapped(probes) as inputs:
                loss, (new_model_state, metrics) = loss_fn(
                    tap.stop_kernel_gradients(params), model_state, micro_batch, rng
                )
        scaled = loss if scale is None else loss * scale.astype(loss.dtype)
        return scaled, (loss, new_model_state, metrics, dict(inputs))

    probes = {} if tap is None else tap.zero_probes()
    (grads, output_grads), (loss, new_model_state, metrics, inputs) = jax.grad(
        objective, argnums=(0, 1), has_aux=True
    )(params, probes)
    factors = {} if tap is None else tap.factors(inputs, output_grads)
    return grads, new_model_state, loss, metrics, factors


def _accumulated(grad_of: Callable, micro_batches: Any, model_state: Any, rng, k: int):
    """:func:`local_gradients` over ``k`` micro-batches: their means, the model state threaded
    through them, the factors of every row."""
    carry, head_factors, last = _head_then_last(grad_of, micro_batches, model_state, rng, k)
    (grads, model_state, loss, metrics), last_factors = _accumulator(grad_of, rng)(
        carry, (last, k - 1)
    )
    mean = lambda tree: jax.tree.map(lambda x: x / k, tree)  # noqa: E731
    # Factors of every micro-batch, stacked: the rows of the whole per-device batch.
    factors = {
        path: (
            jnp.concatenate([head_factors[path][0].reshape(-1, x.shape[1]), x]),
            jnp.concatenate([head_factors[path][1].reshape(-1, g.shape[1]), g]) / k,
        )
        for path, (x, g) in last_factors.items()
    }
    return mean(grads), model_state, loss / k, mean(metrics), factors


def accumulated_head(
    loss_fn: Callable,
    params: Any,
    model_state: Any,
    batch: Any,
    rng: jax.Array,
    scale: jax.Array | None,
    k: int,
) -> tuple[tuple[Any, Any, jax.Array, dict], Any, jax.Array]:
    """The first ``k - 1`` of ``k`` micro-batches of ``batch``, run as :func:`local_gradients`
    runs them: ``((gradient sums, model state after them, loss sum, metrics sums), the last
    micro-batch, its rng)``. A step that differentiates the last one itself (the wait-free
    step) adds its gradients to these sums and divides by ``k``: the same additions in the
    same order."""
    local = jax.tree.leaves(batch)[0].shape[0]
    if local % k:
        raise ValueError(
            f"per-device batch of {local} does not split into accumulation_steps={k} micro-batches"
        )
    grad_of = functools.partial(_gradients_of_one, loss_fn, params, scale, None)
    carry, _, last = _head_then_last(grad_of, split_micro_batches(batch, k), model_state, rng, k)
    return carry, last, jax.random.fold_in(rng, k - 1)


def _accumulator(grad_of: Callable, rng: jax.Array) -> Callable:
    """One turn of accumulation: a micro-batch's gradients, loss and metrics added to the
    sums, the model state threaded through."""

    def accumulate(carry, xs):
        grads_sum, model_state, loss_sum, metrics_sum = carry
        micro_batch, index = xs
        grads, model_state, loss, metrics, factors = grad_of(
            micro_batch, model_state, jax.random.fold_in(rng, index)
        )
        add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
        return (
            add(grads_sum, grads),
            model_state,
            loss_sum + loss,
            add(metrics_sum, metrics),
        ), factors

    return accumulate


def _head_then_last(grad_of: Callable, micro_batches: Any, model_state: Any, rng, k: int):
    """The sums over the first ``k - 1`` micro-batches (a ``lax.scan``), their factors, and
    the last micro-batch.

    The last micro-batch runs after the loop, not as its last turn. Collectives that wait for
    a loop's end cannot overlap anything inside it; after the loop, each gradient bucket's
    allreduce can start as soon as the last backward pass has produced that bucket, and run
    while the rest of that backward pass does (wait-free backprop)."""
    first = jax.tree.map(lambda x: x[0], micro_batches)
    shapes = jax.eval_shape(grad_of, first, model_state, rng)
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
    carry = (zeros(shapes[0]), model_state, zeros(shapes[2]), zeros(shapes[3]))
    head = jax.tree.map(lambda x: x[:-1], micro_batches)
    carry, head_factors = lax.scan(_accumulator(grad_of, rng), carry, (head, jnp.arange(k - 1)))
    return carry, head_factors, jax.tree.map(lambda x: x[-1], micro_batches)
