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
are the same on every device of the axis.

A model calls the two products unconditionally: outside :func:`splitting` they are plain
matrix products on whole weights, so the same model runs on one device, under data
parallelism and FSDP, and tensor-parallel inside a step that splits its weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxdist.comm.collective_matmul import check_tensor_schedule, summed_product

__all__ = ["TENSOR_AXIS", "TensorParallel", "column_product", "row_product", "splitting"]

# The mesh axis whose role is tensor parallelism.
TENSOR_AXIS = "tensor"

_ACTIVE: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
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
    """

    dims: Any
    axis: str = TENSOR_AXIS
    schedule: str = "native"

    def __post_init__(self) -> None:
        check_tensor_schedule(self.schedule)


@contextlib.contextmanager
def splitting(axis: str, schedule: str) -> Iterator[None]:
    """Inside: the model's column- and row-parallel products see weights split over
    ``axis`` and sum over it with ``schedule``. A step traces its loss inside this."""
    token = _ACTIVE.set((axis, check_tensor_schedule(schedule)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def column_product(x: jax.Array, kernels: Sequence[jax.Array]) -> list[jax.Array]:
    """``x`` ``[..., d]`` times each kernel ``[d, *features]``, giving ``[..., *features]``:
    column-parallel under :func:`splitting` (each kernel this device's output features)."""
    rows = x.reshape(-1, x.shape[-1])
    flat = tuple(k.reshape(k.shape[0], -1) for k in kernels)
    active = _ACTIVE.get()
    outs = _column(rows, flat, *active) if active else [rows @ k for k in flat]
    return [o.reshape(*x.shape[:-1], *k.shape[1:]) for o, k in zip(outs, kernels)]


def row_product(h: jax.Array, kernel: jax.Array, contracted: int = 1) -> jax.Array:
    """``h`` ``[..., *features]`` times ``kernel`` ``[*features, n]`` over the last
    ``contracted`` dimensions of ``h``: row-parallel under :func:`splitting` (the features
    this device's, the sum over the axis)."""
    batch = h.shape[: h.ndim - contracted]
    rows = h.reshape(math.prod(batch), -1)
    flat = kernel.reshape(-1, kernel.shape[-1])
    active = _ACTIVE.get()
    out = _row(rows, flat, *active) if active else rows @ flat
    return out.reshape(*batch, kernel.shape[-1])


# ---------------------------------------------------------------------- the two products


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
