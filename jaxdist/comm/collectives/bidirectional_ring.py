"""``bidirectional_ring``: two rings at once, one each way round, each on half of the data.

    windows [0, p)  go clockwise:         0 --> 1 --> 2 --> 3 --> 0
    windows [p, 2p) go counter-clockwise: 0 <-- 1 <-- 2 <-- 3 <-- 0

Both directions of every link carry traffic in each step. Where a device can send to both
neighbours at full rate at once (two ports: a TPU torus's ICI links, point-to-point NVLink)
this halves the ring's bandwidth term; where both directions share one NIC or one memory bus
the two rings take turns and it costs a ring's time with twice the messages.

Every link carries messages both ways, as in an exchange, so where exchanges go in pieces
(over gloo, by default) so do this schedule's steps: sent whole, a step's message can sit in
the socket's buffer while its sender goes on to its next step, towards its other neighbour,
and two messages then share one host's link.
"""

from __future__ import annotations

import jax

from jaxdist.comm.collectives.algorithm import Algorithm, Term
from jaxdist.comm.collectives.ring import ring_allreduce, ring_terms
from jaxdist.comm.collectives.ring_steps import (
    gathers_by_concatenation,
    ring_all_gather,
    ring_reduce_scatter,
)
from jaxdist.comm.collectives.windows import cut, whole_window_stride, windowed
from jaxdist.comm.collectives.wire import AxisName, Run, axis_size

__all__ = ["BIDIRECTIONAL_RING", "bidirectional_ring_allreduce"]


def bidirectional_ring_allreduce(flat: jax.Array, axis_name: AxisName, run: Run) -> jax.Array:
    """The first half of the data goes clockwise, the second half counter-clockwise."""
    p = axis_size(axis_name)
    if p <= 2:  # both directions reach the same neighbour: a plain ring is the same schedule
        return ring_allreduce(flat, axis_name, run)
    directions = (1, -1)  # windows [0, p) go clockwise, windows [p, 2p) counter-clockwise
    buffer = windowed(flat, 2 * p)
    wire = run.wire._replace(reverse_traffic=True)
    # Unrolled, the all-gather concatenates whole blocks (see whole_window_stride).
    concatenate = gathers_by_concatenation(len(directions), p, run.unroll_limit)
    stride = whole_window_stride(buffer.size, 2 * p) if concatenate else None
    shards = ring_reduce_scatter(buffer, axis_name, directions, wire, run.unroll_limit, stride)
    gathered = ring_all_gather(
        shards,
        axis_name,
        directions,
        wire,
        run.unroll_limit,
        buffer.size,
        stride,
        into=buffer,
        divisor=run.divisor,
    )
    return cut(gathered, flat.size)


def bidirectional_ring_terms(p: int, link_class: str) -> list[Term]:
    """A ring's steps and bytes, in two lanes (one per direction) from three devices on."""
    if p <= 2:
        return ring_terms(p, link_class)
    return [Term(link_class, 2 * (p - 1), 2 * (p - 1) / p, lanes=2)]


BIDIRECTIONAL_RING = Algorithm(
    name="bidirectional_ring",
    summary="two rings at once, one each way round, each on half of the data",
    schedule=bidirectional_ring_allreduce,
    cost=bidirectional_ring_terms,
    swaps_on_two=True,
)
