"""Tensor parallelism inside a step: Megatron's column- and row-parallel products.

A tensor-parallel block splits its weights over the mesh's ``tensor`` axis where a product's
work divides without communication (Shoeybi et al., Megatron-LM):

* a **column-parallel** product (attention's query, key and value; the MLP's first layer)
  splits the weight's output features: each device computes its heads or hidden units from
  the whole input, no transfer forward; backward, the input's gradient is the sum over the
  axis of each device's part (:func:`column_product`);
* a **row-parallel** product (attention's output; the MLP's second layer) splits the
  weight's input features, which are the column-parallel outputs each device already holds:
  forward, the partial products are summed over the axis; backward, no transfer
  (:func:`row_product`).

So a block costs one summed product forward and one backward per column/row pair, each run
by the step's tensor schedule (:mod:`jaxdist.comm.collective_matmul`). Everything between
(attention's softmax, the MLP's activation) works on the device's own heads or units, and
everything outside (norms, residual stream, embeddings, the head) on whole activations that
are the same on every device of the axis. The vocabulary may be split too: the embedding,
the head and the loss then work on each device's share of it
(:mod:`jaxdist.comm.vocab_parallel`).

**Sequence parallelism** (Korthikanti et al.) splits that outside too, along the sequence:
between the products each device keeps its own ``1/p`` of the positions
(:func:`to_sequence_shard` after the embeddings, :func:`from_sequence_shard` before the
head). A column-parallel product then all-gathers its input's positions (forward) and
reduce-scatters its input's gradient (backward); a row-parallel one reduce-scatters its sum
(forward) and all-gathers its output's gradient (backward): the all-reduce's two halves,
each with a product inside it under ``collective_matmul``, so both halves have compute to
hide behind. A norm's scale or a bias applied to a device's own positions has a gradient
from those positions only: the model marks such parameters :func:`shared`, whose gradients
are summed over the axis.

A model calls these unconditionally: outside :func:`splitting` they are plain matrix
products on whole weights (and the rest identities), so the same model runs on one device,
under data parallelism and FSDP, and tensor-parallel inside a step that splits its weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.comm.collective_matmul import (
    check_tensor_schedule,
    gathered_product,
    gathered_product_and_outer,
    scattered_product,
    scattered_product_and_outer,
    summed_product,
)
from jaxdist.comm.scopes import SPLIT_SCOPE

__all__ = [
    "TENSOR_AXIS",
    "TensorParallel",
    "column_product",
    "from_sequence_shard",
    "row_product",
    "sequence_parallel",
    "shared",
    "splitting",
    "to_sequence_shard",
    "vocabulary_axis",
]

P = ParamSpec("P")
R = TypeVar("R")

# The mesh axis whose role is tensor parallelism.
TENSOR_AXIS = "tensor"


class _Split(NamedTuple):
    axis: str
    schedule: str
    sequence: bool
    vocabulary: bool


_ACTIVE: contextvars.ContextVar[_Split | None] = contextvars.ContextVar(
    "jaxdist_tensor_parallel", default=None
)


@dataclass(frozen=True)
class TensorParallel:
    """How a step splits its model over a ``tensor`` axis.

    Attributes:
      dims: a tree like the parameters: per leaf, the dimension split over ``axis``, or
        None (whole on every device of the axis); from the model's logical dimension names
        and the recipe's rules (:mod:`jaxdist.training.logical_axes`).
      axis: the mesh axis the weights are split over.
      schedule: the summed products' schedule, one of
        :data:`jaxdist.comm.collective_matmul.TENSOR_SCHEDULES`.
      sequence: sequence parallelism between the products (see the module docstring).
      vocabulary: the vocabulary split over ``axis`` too: the token embedding's rows and the
        head's columns, with the logits and the loss computed by
        :mod:`jaxdist.comm.vocab_parallel`.
    """

    dims: Any
    axis: str = TENSOR_AXIS
    schedule: str = "native"
    sequence: bool = False
    vocabulary: bool = False

    def __post_init__(self) -> None:
        check_tensor_schedule(self.schedule)

    def splitting(self) -> contextlib.AbstractContextManager[None]:
        """:func:`splitting` with this split's axis, schedule, sequence parallelism and
        vocabulary."""
        return splitting(self.axis, self.schedule, self.sequence, self.vocabulary)


@contextlib.contextmanager
def splitting(
    axis: str, schedule: str, sequence: bool = False, vocabulary: bool = False
) -> Iterator[None]:
    """Inside: the model's column- and row-parallel products see weights split over
    ``axis`` and sum over it with ``schedule``; with ``sequence``, activations between them
    split along the sequence; with ``vocabulary``, the embedding, head and loss see the
    vocabulary split over it. A step traces its loss inside this."""
    token = _ACTIVE.set(_Split(axis, check_tensor_schedule(schedule), sequence, vocabulary))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _summing(product: Callable[P, R]) -> Callable[P, R]:
    """``product`` traced, under :func:`splitting`, inside the scope of the products that
    sum a split parameter over its axis (:data:`jaxdist.comm.scopes.SPLIT_SCOPE`)."""

    @functools.wraps(product)
    def scoped(*args: P.args, **kwargs: P.kwargs) -> R:
        if _ACTIVE.get() is None:
            return product(*args, **kwargs)
        with jax.named_scope(SPLIT_SCOPE):
            return product(*args, **kwargs)

    return scoped


@_summing
def column_product(x: jax.Array, kernels: Sequence[jax.Array]) -> list[jax.Array]:
    """``x`` ``[..., d]`` times each kernel ``[d, *features]``, giving ``[..., *features]``:
    column-parallel under :func:`splitting` (each kernel this device's output features).
    With sequence parallelism ``x`` is ``[batch, positions / p, d]`` and the outputs hold
    every position."""
    flat = tuple(k.reshape(k.shape[0], -1) for k in kernels)
    active = _ACTIVE.get()
    if active and active.sequence:
        outs = _column_gathered(_chunk_rows(x), flat, active.axis, active.schedule)
        p = lax.axis_size(active.axis)
        return [_unchunk_rows(o, x.shape[0], p, k.shape[1:]) for o, k in zip(outs, kernels)]
    rows = x.reshape(-1, x.shape[-1])
    outs = _column(rows, flat, *active[:2]) if active else [rows @ k for k in flat]
    return [o.reshape(*x.shape[:-1], *k.shape[1:]) for o, k in zip(outs, kernels)]


@_summing
def row_product(h: jax.Array, kernel: jax.Array, contracted: int = 1) -> jax.Array:
    """``h`` ``[..., *features]`` times ``kernel`` ``[*features, n]`` over the last
    ``contracted`` dimensions of ``h``: row-parallel under :func:`splitting` (the features
    this device's, the sum over the axis). With sequence parallelism ``h`` is ``[batch,
    positions, ...]`` and the sum keeps this device's ``positions / p``."""
    batch = h.shape[: h.ndim - contracted]
    flat = kernel.reshape(-1, kernel.shape[-1])
    active = _ACTIVE.get()
    if active and active.sequence:
        p = lax.axis_size(active.axis)
        chunked = _chunk_rows(h.reshape(*batch, -1), p)
        out = _row_scattered(chunked, flat, active.axis, active.schedule)
        return out.reshape(batch[0], batch[1] // p, kernel.shape[-1])
    rows = h.reshape(math.prod(batch), -1)
    out = _row(rows, flat, *active[:2]) if active else rows @ flat
    return out.reshape(*batch, kernel.shape[-1])


def to_sequence_shard(x: jax.Array) -> jax.Array:
    """``x`` ``[batch, positions, ...]`` (the same on every device of the axis) as this
    device's ``positions / p`` under sequence parallelism; ``x`` itself otherwise."""
    active = _ACTIVE.get()
    if not (active and active.sequence):
        return x
    p = lax.axis_size(active.axis)
    if x.shape[1] % p:
        raise ValueError(
            f"sequence parallelism splits the {x.shape[1]} positions over "
            f"{active.axis}={p}, which does not divide them"
        )
    if active.schedule == "collective_matmul" and x.shape[0] * x.shape[1] // p % 2:
        raise ValueError(
            f"the collective matmul sends half of each device's rows each way "
            f"round: {x.shape[0]} sequences x {x.shape[1] // p} positions per "
            f"device must be even"
        )
    return _shard_positions(x, active.axis)


def from_sequence_shard(x: jax.Array) -> jax.Array:
    """The inverse of :func:`to_sequence_shard`: every device's positions, gathered."""
    active = _ACTIVE.get()
    if not (active and active.sequence):
        return x
    return _gather_positions(x, active.axis)


def sequence_parallel() -> bool:
    """Whether the products run under :func:`splitting` with sequence parallelism."""
    active = _ACTIVE.get()
    return bool(active and active.sequence)


def vocabulary_axis() -> str | None:
    """The axis the vocabulary is split over inside :func:`splitting`, or None (whole)."""
    active = _ACTIVE.get()
    return active.axis if active and active.vocabulary else None


def shared(value: jax.Array) -> jax.Array:
    """``value``, a parameter applied to this device's own positions under sequence
    parallelism (a norm's scale, a bias added after a row-parallel sum): its gradient is
    summed over the axis. ``value`` itself otherwise."""
    active = _ACTIVE.get()
    if not (active and active.sequence):
        return value
    return _summed_gradient(value, active.axis)


# ---------------------------------------------------------------------- rows by position


def _chunk_rows(x: jax.Array, p: int = 1) -> jax.Array:
    """``[batch, positions, f]`` as rows ordered position chunk first (``p`` chunks): the
    order in which a gather over the axis lays out every device's positions."""
    b, t, f = x.shape[0], x.shape[1], math.prod(x.shape[2:])
    return jnp.swapaxes(x.reshape(b, p, t // p, f), 0, 1).reshape(-1, f)


def _unchunk_rows(rows: jax.Array, batch: int, p: int, features: tuple) -> jax.Array:
    """:func:`_chunk_rows`' rows of ``p`` chunks back as ``[batch, positions, *features]``."""
    chunks = rows.reshape(p, batch, -1, rows.shape[-1])
    return jnp.swapaxes(chunks, 0, 1).reshape(batch, -1, *features)


# ---------------------------------------------------------------------- the products


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _column(rows, kernels, axis, schedule):
    return [rows @ k for k in kernels]


def _column_forward(rows, kernels, axis, schedule):
    return _column(rows, kernels, axis, schedule), (rows, kernels)


def _column_backward(axis, schedule, saved, cotangents):
    rows, kernels = saved
    grads = tuple(rows.T @ ct for ct in cotangents)
    # Each device's kernels reach part of every input: their gradients sum over the axis.
    back = summed_product(
        jnp.concatenate(cotangents, axis=1), jnp.concatenate(kernels, axis=1).T, axis, schedule
    )
    return back, grads


_column.defvjp(_column_forward, _column_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _row(rows, kernel, axis, schedule):
    return summed_product(rows, kernel, axis, schedule)


def _row_forward(rows, kernel, axis, schedule):
    return _row(rows, kernel, axis, schedule), (rows, kernel)


def _row_backward(axis, schedule, saved, cotangent):
    rows, kernel = saved
    # The summed output's gradient is the same on every device: no transfer back.
    return cotangent @ kernel.T, rows.T @ cotangent


_row.defvjp(_row_forward, _row_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _column_gathered(rows, kernels, axis, schedule):
    return _column_gathered_forward(rows, kernels, axis, schedule)[0]


def _column_gathered_forward(rows, kernels, axis, schedule):
    widths = [k.shape[1] for k in kernels]
    out, gathered = gathered_product(rows, jnp.concatenate(kernels, axis=1), axis, schedule)
    outs = jnp.split(out, list(itertools.accumulate(widths))[:-1], axis=1)
    return list(outs), (gathered, kernels)


def _column_gathered_backward(axis, schedule, saved, cotangents):
    gathered, kernels = saved
    # The kernels' gradients, gathered.T @ cotangent, computed chunk by chunk inside the ring.
    back, grads = scattered_product_and_outer(
        jnp.concatenate(cotangents, axis=1),
        jnp.concatenate(kernels, axis=1).T,
        gathered,
        axis,
        schedule,
    )
    widths = list(itertools.accumulate(ct.shape[1] for ct in cotangents))[:-1]
    return back, tuple(jnp.split(grads, widths, axis=1))


_column_gathered.defvjp(_column_gathered_forward, _column_gathered_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _row_scattered(rows, kernel, axis, schedule):
    return scattered_product(rows, kernel, axis, schedule)


def _row_scattered_forward(rows, kernel, axis, schedule):
    return _row_scattered(rows, kernel, axis, schedule), (rows, kernel)


def _row_scattered_backward(axis, schedule, saved, cotangent):
    rows, kernel = saved
    # The kernel's gradient, rows.T @ gathered cotangents, added up as the cotangents arrive.
    return gathered_product_and_outer(cotangent, kernel.T, rows, axis, schedule)


_row_scattered.defvjp(_row_scattered_forward, _row_scattered_backward)


# ---------------------------------------------------------------------- positions


def _own_positions(x: jax.Array, axis: str) -> jax.Array:
    """This device's ``1/p`` of the positions (axis 1) of ``x``."""
    size = x.shape[1] // lax.axis_size(axis)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis) * size, size, axis=1)


def _all_positions(x: jax.Array, axis: str) -> jax.Array:
    """Every device's positions of ``x``, gathered in device order."""
    return lax.all_gather(x, axis, axis=1, tiled=True)


# Each is the other's transpose where what follows runs alike on every device: a device's
# own positions' gradient comes back gathered, and a gathered value's gradient is taken back
# at the device's own positions.
_shard_positions = jax.custom_vjp(_own_positions, nondiff_argnums=(1,))
_shard_positions.defvjp(
    lambda x, axis: (_own_positions(x, axis), None),
    lambda axis, _, cotangent: (_all_positions(cotangent, axis),),
)
_gather_positions = jax.custom_vjp(_all_positions, nondiff_argnums=(1,))
_gather_positions.defvjp(
    lambda x, axis: (_all_positions(x, axis), None),
    lambda axis, _, cotangent: (_own_positions(cotangent, axis),),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _summed_gradient(value, axis):
    return value


def _summed_gradient_forward(value, axis):
    return value, None


def _summed_gradient_backward(axis, _, cotangent):
    return (lax.psum(cotangent, axis),)


_summed_gradient.defvjp(_summed_gradient_forward, _summed_gradient_backward)
