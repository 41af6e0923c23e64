"""Global-norm clipping that stays exact when the optimizer sees the model in parts.

A pipeline updates each stage's layers on the devices that hold them, so the optimizer sees
one stage's parameter tree at a time; ``optax.clip_by_global_norm`` would then clip each stage
by that stage's own norm. :func:`clip_by_global_norm` here is the same transformation, but it
takes the sum of squares through :func:`model_sum`: on a whole tree (a data-parallel, ZeRO-1 or
FSDP step) that is the sum itself, and inside a pipeline's update it is the sum over every
stage, which the pipeline computes in two passes over its update:

1. :func:`partial_sums` runs the update and records each :func:`model_sum` call's part (this
   stage's sum of squares); the update's results are discarded;
2. the pipeline adds the parts over its stages (and a device's model chunks), and
   :func:`with_sums` runs the update again with those totals in place of the parts.

The first pass adds to the compiled program only what the parts need (with the clip first
in the chain, the sums of squares): the rest of it is dead code. ::

    optimizer = optax.chain(clip_by_global_norm(1.0), optax.adamw(1e-3))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["clip_by_global_norm", "model_sum"]

# How model_sum turns this part's value into the whole model's: innermost last.
_summing: list[Callable[[jax.Array], jax.Array]] = []


def model_sum(part: jax.Array) -> jax.Array:
    """``part``, a quantity that adds over parameters (a sum of squares), summed over the whole
    model: ``part`` itself when the optimizer sees the whole model, the sum over every
    pipeline stage inside a pipeline's update."""
    return _summing[-1](part) if _summing else part


@contextlib.contextmanager
def _summing_with(combine: Callable[[jax.Array], jax.Array]) -> Iterator[None]:
    _summing.append(combine)
    try:
        yield
    finally:
        _summing.pop()


def partial_sums(fn: Callable[[], Any]) -> tuple[Any, list[jax.Array]]:
    """``fn()`` and the part each :func:`model_sum` call inside it was given, in call order."""
    parts: list[jax.Array] = []

    def record(part: jax.Array) -> jax.Array:
        # float32 whatever the part: a stage with no parameters sums to an int32 zero, and
        # every stage's parts must agree in type (the pipeline switches between them).
        parts.append(jnp.asarray(part, jnp.float32))
        return part

    with _summing_with(record):
        result = fn()
    return result, parts


def with_sums(fn: Callable[[], Any], totals: Sequence[jax.Array]) -> Any:
    """``fn()`` with its :func:`model_sum` calls answered by ``totals``, in call order: one
    each, as :func:`partial_sums` recorded them."""
    answers = iter(totals)

    def answer(part: jax.Array) -> jax.Array:
        total = next(answers, None)
        if total is None:
            raise ValueError(
                "the update summed more quantities over the model than when "
                f"its parts were recorded ({len(totals)})"
            )
        return jnp.asarray(total, part.dtype)

    with _summing_with(answer):
        result = fn()
    if next(answers, None) is not None:
        raise ValueError(
            f"the update summed fewer quantities over the model than the {len(totals)} recorded"
        )
    return result


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm(max_norm)``, with the norm taken over the whole model even
    where the optimizer sees it in parts (a pipeline's stages): updates whose global L2 norm
    exceeds ``max_norm`` are scaled down to it."""
    if not max_norm > 0:
        raise ValueError(f"clip_by_global_norm needs max_norm > 0, got {max_norm}")

    def update_fn(updates, state, params=None):
        del params
        norm = jnp.sqrt(model_sum(optax.tree.norm(updates, squared=True)))
        keep = norm < max_norm

        def clip(t):
            return jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
