"""``torus2d``: the 2-D torus allreduce (Mikami et al. 2018) on axes ``(outer, inner)``.

Devices in a grid of Y rows (outer axis) by X columns (inner axis)::

    1. reduce-scatter along the inner axis     x0 -> x1 -> x2 -> x3   (in every row)
       every device holds 1/X of the data, summed over its row
    2. ring allreduce of that 1/X along the outer axis               (in every column)
    3. all-gather along the inner axis                               (in every row)

``2 (X - 1) + 2 (Y - 1)`` latency steps instead of ``2 (XY - 1)`` for one flat ring, with
the flat ring's bandwidth term. The inner axis carries the full-size reduce-scatter and
all-gather, so it should be the one with the fast links.

On an inner axis of two (a pair) steps 2 and 3 are interleaved
(:func:`torus_pair_allreduce`): every block of the outer ring's all-gather crosses the pair
as soon as it arrives and both copies are written straight into the result, where the three
phases would gather the outer ring's blocks into a half-size buffer, exchange it and
concatenate: two passes over the data fewer.

With an outer axis of two, ``crossed_exchange=True`` runs step 2 as the crossed exchange
(:mod:`~jaxdist.comm.collectives.crossed_exchange`). It is off by default: on a torus both
axes are network links, so its extra hop along the inner axis crosses the network too.

The pair's interleaved all-gather (``_ring_all_gather_across_pair``) is kept as one function
of more than 60 lines: each step's receive, pair exchange and two writes only read as the
algorithm together.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.comm.collectives.algorithm import Algorithm, Term
from jaxdist.comm.collectives.crossed_exchange import crossed_pair_sum, uses_crossed_exchange
from jaxdist.comm.collectives.ring import ring_allreduce, ring_terms
from jaxdist.comm.collectives.ring_steps import gather_windows, ring_reduce_scatter
from jaxdist.comm.collectives.windows import (
    cut,
    last_window_shift,
    window_head,
    window_length,
    window_stride,
    windowed,
)
from jaxdist.comm.collectives.wire import (
    Run,
    as_sent,
    axis_size,
    divided,
    repeat,
    shift,
    swap,
)

__all__ = ["TORUS2D", "torus2d_allreduce"]


def torus2d_allreduce(
    flat: jax.Array, axis_name: tuple[str, str], run: Run, *, crossed_exchange: bool = False
) -> jax.Array:
    """Reduce-scatter along the inner axis, ring allreduce along the outer, all-gather along
    the inner (on an inner axis of two, the last two interleaved)."""
    outer, inner = axis_name
    q, x = axis_size(outer), axis_size(inner)
    if gathers_across_pair(q, x, crossed_exchange):
        summed = torus_pair_allreduce(windowed(flat, 2 * q), axis_name, run)
        return cut(summed, flat.size)
    if uses_crossed_exchange(q, x, True, crossed_exchange):
        return three_phase_allreduce(
            flat, axis_name, run, lambda shard: crossed_pair_sum(shard, axis_name, run.wire)
        )
    across = run._replace(divisor=None)
    return three_phase_allreduce(
        flat, axis_name, run, lambda shard: ring_allreduce(shard, outer, across)
    )


def three_phase_allreduce(
    flat: jax.Array,
    axis_name: tuple[str, str],
    run: Run,
    outer_sum: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """Ring reduce-scatter along the inner axis, ``outer_sum`` of each device's window across
    the outer axis, all-gather along the inner axis (dividing as it writes, for a mean)."""
    local = axis_name[1]
    buffer = windowed(flat, axis_size(local))
    (local_sum,) = ring_reduce_scatter(buffer, local, (1,), run.wire, run.unroll_limit)
    full_sum = outer_sum(local_sum)
    gathered = gather_windows(
        full_sum,
        local,
        buffer.size,
        run.wire,
        run.unroll_limit,
        into=buffer,
        divisor=run.divisor,
    )
    return cut(gathered, flat.size)


def gathers_across_pair(outer_size: int, inner_size: int, crossed_exchange: bool) -> bool:
    """Whether the torus runs as :func:`torus_pair_allreduce`: on an inner axis of two, unless
    the crossed exchange replaces the outer ring."""
    return inner_size == 2 and not uses_crossed_exchange(
        outer_size, inner_size, True, crossed_exchange
    )


def torus_pair_allreduce(flat: jax.Array, axis_name: tuple[str, str], run: Run) -> jax.Array:
    """The torus on an inner axis of two with a ring of Y devices across the outer axis, its
    last two phases interleaved:

    1. reduce-scatter across the pair: each device sends the region of the buffer its partner
       keeps and adds what arrives to its own region (one exchange of half the buffer);
    2. ring reduce-scatter of that region along the outer axis (Y - 1 steps);
    3. ring all-gather along the outer axis (Y - 1 steps), in which every block, the device's
       own first, crosses the pair as soon as it is there (Y exchanges of 1/(2Y) of the
       buffer) and both copies are written straight into the result.

    Windows: the result is laid out as a flat ring's ``2 Y`` windows, window ``k Y + j``
    being block ``j`` of region ``k``. Region 0 is windows ``[0, Y)``; region 1 ends at the
    buffer's end, so it starts where window ``Y`` does less the last window's ``shift``, and
    its windows but the last sit ``shift`` further into it.
    """
    outer, inner = axis_name
    q = axis_size(outer)
    size = flat.size
    stride = window_stride(size, 2 * q)
    length = window_length(size, 2 * q, stride)
    region = (q - 1) * stride + length
    second = size - region  # where region 1 starts: q * stride - shift
    k = lax.axis_index(inner)
    partners_region = lax.dynamic_slice_in_dim(flat, (1 - k) * second, region)
    own_region = lax.dynamic_slice_in_dim(flat, k * second, region)
    pair_sum = swap(partners_region, inner, run.wire) + own_region
    early = last_window_shift(size, 2 * q, stride, length)
    (shard,) = ring_reduce_scatter(
        pair_sum, outer, (1,), run.wire, run.unroll_limit, stride, offset=k * early
    )
    return _ring_all_gather_across_pair(shard, axis_name, run, size, stride, into=flat)


def _ring_all_gather_across_pair(
    shard: jax.Array,
    axis_name: tuple[str, str],
    run: Run,
    size: int,
    stride: int,
    into: jax.Array,
) -> jax.Array:
    """Phase 3 of :func:`torus_pair_allreduce`: the ring all-gather along the outer axis, in
    which every block is exchanged across the inner pair as it arrives and both copies are
    written over ``into``.

    What goes on round the ring is the block that just came across the pair, so each swap
    waits for the ring step before it and each ring step for the swap before it: no two
    messages of this phase are in flight at once. (Forwarding the block that arrived round
    the ring instead left consecutive swaps independent, and over gloo in pieces they could
    receive each other's pieces.)

    The device at ring position ``y`` starts with block ``y`` of its own region ``k``; the
    block arriving at step ``t`` is block ``y - t`` of region ``k + t`` (mod 2), and its
    partner's is the same block of the other region. Each window contributes its first
    ``stride`` elements (the last window, which starts ``shift`` early, from its
    ``shift``-th), and the last window's overhang past ``2 Y stride`` is written once all
    steps are done, so every element of the result comes from exactly one window and every
    device ends with the same bits.
    """
    outer, inner = axis_name
    wire, divisor = run.wire, run.divisor
    q = axis_size(outer)
    count = 2 * q
    early = last_window_shift(size, count, stride, shard.size)
    overhang = size - count * stride
    y, k = lax.axis_index(outer), lax.axis_index(inner)

    def place(gathered, window, block):
        head = window_head(block, stride, early, window == count - 1)
        return lax.dynamic_update_slice_in_dim(gathered, divided(head, divisor), window * stride, 0)

    def cross(t, gathered, kept, block):
        """Exchange the block of step ``t`` across the pair and write both copies."""
        region, j = (k + t) % 2, (y - t) % q
        partner = swap(block, inner, wire)
        gathered = place(gathered, region * q + j, block)
        gathered = place(gathered, (1 - region) * q + j, partner)
        if overhang:  # a cond, not a select: see ring_steps.ring_all_gather's last_overhang
            kept = lax.cond(
                j == q - 1,
                lambda: jnp.where(region == 1, block, partner)[early + stride :],
                lambda: kept,
            )
        return gathered, kept, partner

    def step(s, carry):
        gathered, kept, crossed = carry
        arrived = shift(crossed, outer, 1, wire)
        return cross(s + 1, gathered, kept, arrived)

    block = as_sent(shard, wire)
    kept = jnp.zeros_like(block[early + stride :]) if overhang else None
    carry = cross(0, into, kept, block)
    gathered, kept, _ = repeat(q - 1, step, carry, run.unroll_limit)
    if overhang:
        gathered = lax.dynamic_update_slice_in_dim(
            gathered, divided(kept, divisor), count * stride, 0
        )
    return gathered


def two_level_terms(
    outer: int, inner: int, outer_terms: list[Term], *, crossed: bool, pair: bool
) -> list[Term]:
    """The cost of a two-level schedule: the inner reduce-scatter and all-gather (on a pair
    whose all-gather crosses per block: one exchange per block of the outer ring), then the
    outer step on ``1 / inner`` of the data (``outer_terms`` priced on the full buffer), or
    the crossed exchange."""
    if pair:
        intra = [Term("intra", 1 + outer, 1)]
    else:
        intra = [Term("intra", 2 * (inner - 1), 2 * (inner - 1) / inner)] if inner > 1 else []
    if crossed:
        return [*intra, Term("intra", 1, 1 / inner), Term("inter", 1, 1 / inner)]
    return intra + [Term(t.link_class, t.steps, t.volume / inner, t.lanes) for t in outer_terms]


def torus2d_terms(axis_sizes: tuple[int, int], *, crossed_exchange: bool) -> list[Term]:
    """Inner ``2 (X - 1)`` steps and ``2 (X - 1) / X`` of the data, outer a ring on ``1 / X``
    of it (``1 + Y`` inner steps on a pair)."""
    outer, inner = axis_sizes
    return two_level_terms(
        outer,
        inner,
        ring_terms(outer, "inter"),
        crossed=uses_crossed_exchange(outer, inner, True, crossed_exchange),
        pair=gathers_across_pair(outer, inner, crossed_exchange),
    )


TORUS2D = Algorithm(
    name="torus2d",
    summary="2-D torus: reduce-scatter inner, ring allreduce outer, all-gather inner",
    schedule=torus2d_allreduce,
    cost=torus2d_terms,
    levels=2,
    options={"crossed_exchange": False},
)
