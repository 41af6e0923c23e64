"""Dynamic loss scaling for float16 training.

float16 has 5 exponent bits: small gradients underflow to zero. Multiplying the loss by a large
scale keeps them representable; the gradients are divided by the same scale before the update.
When a step produces inf or NaN the scale was too large: the update is skipped and the scale
halved. After ``period`` finite steps in a row it is doubled again. (bfloat16 has float32's
exponent range and needs none of this.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

__all__ = [
    "DynamicLossScale",
]


class DynamicLossScale(struct.PyTreeNode):
    """Loss-scale state; a pytree, so it lives in the train state and in checkpoints."""

    scale: jax.Array
    good_steps: jax.Array
    period: int = struct.field(pytree_node=False, default=2000)
    factor: float = struct.field(pytree_node=False, default=2.0)
    min_scale: float = struct.field(pytree_node=False, default=1.0)

    @classmethod
    def create(cls, initial_scale: float = 2.0**15, period: int = 2000, factor: float = 2.0):
        if initial_scale <= 0 or period < 1 or factor <= 1:
            raise ValueError(
                f"loss scale needs initial_scale > 0, period >= 1, factor > 1; got "
                f"{initial_scale}, {period}, {factor}"
            )
        return cls(
            scale=jnp.asarray(initial_scale, jnp.float32),
            good_steps=jnp.asarray(0, jnp.int32),
            period=period,
            factor=factor,
        )

    def unscale(self, grads: Any) -> Any:
        return jax.tree.map(lambda g: (g.astype(jnp.float32) / self.scale).astype(g.dtype), grads)

    def update(self, grads_finite: jax.Array) -> DynamicLossScale:
        """The next state after a step whose gradients were (not) all finite."""
        grow = grads_finite & (self.good_steps + 1 >= self.period)
        scale = jnp.where(
            grads_finite,
            jnp.where(grow, self.scale * self.factor, self.scale),
            jnp.maximum(self.scale / self.factor, self.min_scale),
        )
        good_steps = jnp.where(grads_finite & ~grow, self.good_steps + 1, 0)
        return self.replace(scale=scale, good_steps=good_steps)


def all_finite(tree: Any) -> jax.Array:
    """True when every element of every leaf is finite."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``on_true`` where ``pred`` else ``on_false``, leaf by leaf (both trees alike)."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def ended_step(
    state: Any,
    params: Any,
    model_state: Any,
    opt_state: Any,
    finite: jax.Array | None,
    loss: jax.Array,
    metrics: dict,
    skip_nonfinite: bool,
) -> tuple[Any, dict]:
    """A data-parallel step's ``(new_state, metrics)`` from its updated parts and its verdict
    on the gradients (:func:`finish_scaled_step`); with ``skip_nonfinite`` a step whose loss or
    updated parameters are not finite is skipped too."""
    new_state = state.replace(
        step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state
    )
    if skip_nonfinite:  # nor may a finite step's update leave inf parameters
        finite = finite & jnp.isfinite(loss) & all_finite(params)
    return finish_scaled_step(
        state, new_state, finite, {**metrics, "loss": loss}, report_skipped=skip_nonfinite
    )


def finish_scaled_step(
    state: Any,
    new_state: Any,
    finite: jax.Array | None,
    metrics: dict,
    *,
    report_skipped: bool = False,
):
    """A train step's ``(new_state, metrics)`` given its verdict ``finite``: a step whose
    gradients (or loss) held inf/NaN changes nothing but the step count and, under a loss
    scale, the (lowered) scale. Under a loss scale the metrics gain the scale and the
    verdict (``grads_finite``); with ``report_skipped`` they gain ``skipped`` (the verdict's
    negation, for a trainer that counts skipped steps). ``finite=None`` (no verdict) passes
    both unchanged. ``state`` and ``new_state`` are train states with ``step`` and
    ``loss_scale`` fields."""
    if finite is None:
        return new_state, metrics
    new_state = select_tree(finite, new_state, state.replace(step=state.step + 1))
    if report_skipped:
        metrics = {**metrics, "skipped": jnp.logical_not(finite)}
    if state.loss_scale is None:
        return new_state, metrics
    new_state = new_state.replace(loss_scale=state.loss_scale.update(finite))
    return new_state, {**metrics, "loss_scale": state.loss_scale.scale, "grads_finite": finite}
