"""``ring``: reduce-scatter then all-gather round one ring, ``p - 1`` steps each.

Four devices, the buffer cut into four windows; ``+`` marks a running sum::

    reduce-scatter: step s, device i sends its running sum of window i - s - 1 to i + 1
      0 --> 1 --> 2 --> 3 --+
      ^---------------------+        after 3 steps device i holds window i summed
    all-gather: step s, device i forwards the window it received last to i + 1
                                     after 3 more steps every device holds every window

Every link carries one message per step, so each device sends ``2 (p - 1) / p`` of the
buffer in all, whatever ``p`` is: the bandwidth-optimal allreduce, at ``2 (p - 1)``
latencies. On an axis of two both halves are one swap each way.
"""

from __future__ import annotations

import jax

from jaxdist.comm.collectives.algorithm import Algorithm, Term
from jaxdist.comm.collectives.ring_steps import gather_windows, ring_reduce_scatter
from jaxdist.comm.collectives.windows import cut, windowed
from jaxdist.comm.collectives.wire import AxisName, Run, axis_size

__all__ = [
    "RING",
    "ring_allreduce",
]


def ring_allreduce(flat: jax.Array, axis_name: AxisName, run: Run) -> jax.Array:
    """Ring allreduce: reduce-scatter then all-gather, ``p - 1`` steps each, every link busy."""
    buffer = windowed(flat, axis_size(axis_name))
    (shard,) = ring_reduce_scatter(buffer, axis_name, (1,), run.wire, run.unroll_limit)
    gathered = gather_windows(
        shard, axis_name, buffer.size, run.wire, run.unroll_limit, into=buffer, divisor=run.divisor
    )
    return cut(gathered, flat.size)


def ring_terms(p: int, link_class: str) -> list[Term]:
    """``2 (p - 1)`` steps, each device sending ``2 (p - 1) / p`` of the buffer."""
    return [Term(link_class, 2 * (p - 1), 2 * (p - 1) / p)] if p > 1 else []


RING = Algorithm(
    name="ring",
    summary="reduce-scatter then all-gather round one ring",
    schedule=ring_allreduce,
    cost=ring_terms,
    swaps_on_two=True,
)
