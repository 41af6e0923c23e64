"""Tensor parallelism's one collective: a matrix product summed over a mesh axis.

Megatron's tensor-parallel layers split a product's inner (contracting) dimension over the
``tensor`` axis: each device multiplies its rows by its slice of the weight, and the partial
products are summed over the axis, so every device holds the whole product
(:func:`summed_product`). Two schedules (:data:`TENSOR_SCHEDULES`):

``native``
    the product, then XLA's all-reduce (``lax.psum``): the sum waits for the whole
    product, and the product's compute and the all-reduce's transfer run one after the other.

``collective_matmul``
    the rows cut into ``p`` chunks, each cut into two halves; a half's partial sum travels
    once round the ring while each device adds its own product of that half as it passes
    (the reduce-scatter with the product inside it), one ring each way::

        step s:   device i computes chunk (i - 1 - s) of half 0, adds what its left
                  neighbour sent, passes the sum right;  chunk (i + 1 + s) of half 1
                  goes left alike
        after p - 1 steps device i holds chunk i summed; both halves go round once more
        (the all-gather) so every device holds every chunk.

    Each step's transfers run beside the step's products, so the reduce-scatter's
    transfers hide behind compute (the JAX scaling book measures this schedule's
    all-gather form at 244 us against XLA's 311 us on a v5e-8). The all-gather has no
    product to hide behind unless it feeds one (sequence parallelism's
    :func:`gathered_product`). In backward, a weight's gradient (the input's chunk times
    the cotangent's) rides the same ring as one more product per step
    (:func:`scattered_product_and_outer`, :func:`gathered_product_and_outer`). Each
    product waits for the one before it: the compiler would otherwise merge the products,
    which share the weight, into one before or after the whole ring (XLA's GPU compiler
    does), leaving the transfers nothing to run beside.

Both give the same sums up to the order of float additions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.comm.collectives.wire import Wire, shift
from jaxdist.comm.scopes import TENSOR_SCOPE

__all__ = [
    "TENSOR_SCHEDULES",
    "check_tensor_schedule",
    "gathered_product",
    "gathered_product_and_outer",
    "scattered_product",
    "scattered_product_and_outer",
    "summed_product",
]

TENSOR_SCHEDULES = ("native", "collective_matmul")


def check_tensor_schedule(schedule: str) -> str:
    """``schedule`` if it is one of :data:`TENSOR_SCHEDULES`; else one line naming them."""
    if schedule not in TENSOR_SCHEDULES:
        raise ValueError(
            f"tensor_schedule must be one of {', '.join(TENSOR_SCHEDULES)}; got {schedule!r}"
        )
    return schedule


def summed_product(rows: jax.Array, weight: jax.Array, axis: str, schedule: str) -> jax.Array:
    """``sum over axis of rows @ weight`` on every device: ``rows`` ``[m, k]`` and ``weight``
    ``[k, n]`` are this device's parts of a product whose inner dimension is split over
    ``axis``. Call inside ``shard_map``."""
    with jax.named_scope(TENSOR_SCOPE):
        if schedule == "native":
            return lax.psum(rows @ weight, axis)
        p, m = lax.axis_size(axis), rows.shape[0]
        if p == 1:
            return rows @ weight
        padded = jnp.pad(rows, ((0, -m % (2 * p)), (0, 0)))
        mine = _scatter_product(padded, weight, axis)[0]
        return _gather_halves(*jnp.split(mine, 2), axis)[0][:m]


def scattered_product(rows: jax.Array, weight: jax.Array, axis: str, schedule: str) -> jax.Array:
    """Device ``i``'s chunk ``i`` (of ``p``, by rows) of ``sum over axis of rows @ weight``:
    the summed product reduce-scattered, ``[m / p, n]``. ``m`` must divide by ``2 p``."""
    with jax.named_scope(TENSOR_SCOPE):
        if schedule == "native":
            return lax.psum_scatter(rows @ weight, axis, scatter_dimension=0, tiled=True)
        if lax.axis_size(axis) == 1:
            return rows @ weight
        return _scatter_product(rows, weight, axis)[0]


def scattered_product_and_outer(
    rows: jax.Array, weight: jax.Array, outer: jax.Array, axis: str, schedule: str
) -> tuple[jax.Array, jax.Array]:
    """:func:`scattered_product` and ``outer.T @ rows`` (``outer`` ``[m, j]``: a weight's
    gradient in backward), the second added up chunk by chunk beside the ring's transfers
    under ``collective_matmul``: one more product inside each step."""
    with jax.named_scope(TENSOR_SCOPE):
        if schedule == "native" or lax.axis_size(axis) == 1:
            return scattered_product(rows, weight, axis, schedule), outer.T @ rows
        return _scatter_product(rows, weight, axis, outer)


def gathered_product(
    rows: jax.Array, weight: jax.Array, axis: str, schedule: str
) -> tuple[jax.Array, jax.Array]:
    """Every device's ``rows`` ``[m, k]`` gathered in device order, times ``weight``:
    ``([p m, n] product, [p m, k] gathered rows)``. ``m`` must be even."""
    with jax.named_scope(TENSOR_SCOPE):
        if schedule == "native" or lax.axis_size(axis) == 1:
            gathered = lax.all_gather(rows, axis, tiled=True)
            return gathered @ weight, gathered
        gathered, products, _ = _gather_halves(*jnp.split(rows, 2), axis, weight)
        return products, gathered


def gathered_product_and_outer(
    rows: jax.Array, weight: jax.Array, outer: jax.Array, axis: str, schedule: str
) -> tuple[jax.Array, jax.Array]:
    """:func:`gathered_product`'s product and ``outer.T @ gathered`` (``outer`` ``[p m, j]``,
    rows in the gathered order: a weight's gradient in backward) instead of the gathered
    rows, the second added up as each device's rows arrive under ``collective_matmul``."""
    with jax.named_scope(TENSOR_SCOPE):
        if schedule == "native" or lax.axis_size(axis) == 1:
            product, gathered = gathered_product(rows, weight, axis, schedule)
            return product, outer.T @ gathered
        _, products, outer_sum = _gather_halves(*jnp.split(rows, 2), axis, weight, outer)
        return products, outer_sum


# Each step sends one half each way round, over links the other half uses the other way:
# the bidirectional ring's messages (cut into pieces where the runtime needs it).
_WIRE = Wire(reverse_traffic=True)


def _after(rows: jax.Array, earlier: jax.Array | None) -> jax.Array:
    """``rows``, once ``earlier`` exists: a product of them starts after ``earlier``'s.

    The compiler merges products that share a weight and do not depend on each other into
    one (XLA's GPU compiler does): a ring's products would then run all before or all after
    its transfers, and the transfers would have nothing to run beside. Chaining each
    product to the one before keeps one product per step."""
    if earlier is None:
        return rows
    return lax.optimization_barrier((rows, earlier))[0]


class _OuterSum:
    """``outer.T @ rows``, added up one part of ``rows`` at a time as a ring passes them:
    ``outer``'s rows cut like the ring's (``p`` chunks of two halves), each piece summed in
    float32."""

    def __init__(self, outer: jax.Array, p: int):
        self._parts = outer.reshape(p, 2, -1, outer.shape[1])  # [chunk, half, rows, j]
        self._dtype = outer.dtype
        self._total = None

    def add(self, chunk: jax.Array, half: int, rows: jax.Array, after: jax.Array) -> jax.Array:
        """Adds part ``(chunk, half)`` of ``outer``, transposed, times ``rows`` (started after
        ``after``); returns the piece, for the next product to wait for."""
        part = lax.dynamic_index_in_dim(self._parts, chunk, 0, keepdims=False)[half]
        piece = jnp.matmul(_after(part, after).T, rows, preferred_element_type=jnp.float32)
        self._total = piece if self._total is None else self._total + piece
        return piece

    def total(self, rows_dtype: Any) -> jax.Array:
        return self._total.astype(jnp.result_type(self._dtype, rows_dtype))


def _chained_product(
    rows: jax.Array,
    weight: jax.Array,
    last: jax.Array | None,
    outer_sum: _OuterSum | None,
    chunk: jax.Array,
    half: int,
) -> tuple[jax.Array, jax.Array]:
    """``(rows @ weight, what the next product waits for)``, started after ``last``; with
    ``outer_sum``, its piece for ``rows`` (part ``(chunk, half)``) follows the product."""
    product = _after(rows, last) @ weight
    if outer_sum is None:
        return product, product
    return product, outer_sum.add(chunk, half, rows, product)


def _scatter_product(
    rows: jax.Array, weight: jax.Array, axis: str, outer: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """The reduce-scatter with the product inside it: ``(chunk i's halves summed, outer.T @
    rows or None)``."""
    p, i = lax.axis_size(axis), lax.axis_index(axis)
    chunks = rows.reshape(p, 2, -1, rows.shape[1])  # [chunk, half, rows, k]
    outer_sum = None if outer is None else _OuterSum(outer, p)

    def product(chunk, half, last):
        part = lax.dynamic_index_in_dim(chunks, chunk % p, 0, keepdims=False)[half]
        return _chained_product(part, weight, last, outer_sum, chunk % p, half)

    # Each step's products run beside the step's transfers.
    going_right, last = product(i - 1, 0, None)
    going_left, last = product(i + 1, 1, last)
    for s in range(1, p):
        right, last = product(i - 1 - s, 0, last)
        left, last = product(i + 1 + s, 1, last)
        going_right = shift(going_right, axis, 1, _WIRE) + right
        going_left = shift(going_left, axis, -1, _WIRE) + left
    summed = jnp.concatenate([going_right, going_left])
    return summed, None if outer_sum is None else outer_sum.total(rows.dtype)


def _gather_halves(
    first: jax.Array,
    second: jax.Array,
    axis: str,
    weight: jax.Array | None = None,
    outer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Every device's two halves gathered in device order (each device's ``first`` then its
    ``second``), one half round each ring: ``(gathered rows, None, None)``; with ``weight``,
    each arriving half's product computed beside the next transfer, and with ``outer`` (rows
    in the gathered order) ``outer.T @ gathered`` added up as they arrive: ``(gathered rows,
    their products, outer.T @ gathered or None)``."""
    p, i = lax.axis_size(axis), lax.axis_index(axis)
    rows = jnp.zeros((p, 2, *first.shape), first.dtype)
    products = None
    if weight is not None:
        dtype = jnp.result_type(first, weight)
        products = jnp.zeros((p, 2, first.shape[0], weight.shape[1]), dtype)
    outer_sum = None if outer is None else _OuterSum(outer, p)
    going_right, going_left = first, second
    last = None
    for s in range(p):
        if s:
            going_right = shift(going_right, axis, 1, _WIRE)  # chunk i - s, half 0
            going_left = shift(going_left, axis, -1, _WIRE)  # chunk i + s, half 1
        at_right, at_left = (i - s) % p, (i + s) % p
        rows = rows.at[at_right, 0].set(going_right).at[at_left, 1].set(going_left)
        if products is not None:
            right, last = _chained_product(going_right, weight, last, outer_sum, at_right, 0)
            left, last = _chained_product(going_left, weight, last, outer_sum, at_left, 1)
            products = products.at[at_right, 0].set(right).at[at_left, 1].set(left)
    gathered = rows.reshape(-1, first.shape[1])
    if products is not None:
        products = products.reshape(-1, weight.shape[1])
    return gathered, products, None if outer_sum is None else outer_sum.total(first.dtype)
