"""``halving_doubling``: recursive halving then recursive doubling (Rabenseifner), for a
power-of-two number of devices.

Eight devices; at each step a device swaps with partner ``i XOR d``::

    halving   d = 4: 0<->4 1<->5 2<->6 3<->7   each keeps half of its segment, adds the other's
              d = 2: 0<->2 1<->3 4<->6 5<->7   segments of 1/2, 1/4, 1/8 of the buffer
              d = 1: 0<->1 2<->3 4<->5 6<->7   device i now holds its eighth, summed
    doubling  d = 1, 2, 4: the same pairs in reverse order swap and concatenate segments

``2 log2 p`` steps (a ring takes ``2 (p - 1)``) and the ring's ``2 (p - 1) / p`` of the
buffer per device; every step is a pairwise swap, always unrolled (segment shapes halve and
double, so every step has its own shapes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.comm.collectives.algorithm import Algorithm, Term
from jaxdist.comm.collectives.wire import AxisName, Run, as_sent, axis_size, divided, send

__all__ = ["HALVING_DOUBLING", "halving_doubling_allreduce"]


def halving_doubling_allreduce(flat: jax.Array, axis_name: AxisName, run: Run) -> jax.Array:
    """Reduce-scatter by recursive halving: at distances d = p/2, p/4, ..., 1 each device swaps
    half of its current segment with partner ``i XOR d`` (keeping the half its bit selects)
    and adds what it receives. Then all-gather by recursive doubling: at d = 1, 2, ..., p/2
    partners swap their segments and concatenate them in order.

    A segment of odd length splits into two halves that share its middle element: both
    partners reduce it, and the doubling takes it from the upper half only, so every device
    ends with the same bits and nothing is ever padded.
    """
    p = axis_size(axis_name)
    if p & (p - 1):
        raise ValueError(
            f"halving_doubling needs a power-of-two number of devices along {axis_name!r}, "
            f"got {p}; use 'ring' or 'bidirectional_ring' for this axis"
        )
    i = lax.axis_index(axis_name)
    wire, divisor = run.wire, run.divisor
    segment, sizes = flat, []

    d = p // 2
    while d >= 1:  # recursive halving
        sizes.append(segment.size)
        half, length = segment.size // 2, segment.size - segment.size // 2
        upper = (i // d) % 2  # 1: keep the upper half, send the lower one
        keep = lax.dynamic_slice_in_dim(segment, upper * half, length)
        give = lax.dynamic_slice_in_dim(segment, (1 - upper) * half, length)
        segment = keep + send(give, axis_name, [(j, j ^ d) for j in range(p)], wire)
        d //= 2

    segment = as_sent(segment, wire)
    if p == 1:
        segment = divided(segment, divisor)
    d = 1
    while d < p:  # recursive doubling
        upper = (i // d) % 2  # 1: my segment is the upper half of the doubled one
        theirs = send(segment, axis_name, [(j, j ^ d) for j in range(p)], wire)
        if 2 * d == p:  # the last step writes the result: divide there, fused into the write
            segment, theirs = divided(segment, divisor), divided(theirs, divisor)
        # Written as one concatenation of two selects: XLA fuses it into a single pass.
        is_upper = upper == 1
        lower = jnp.where(is_upper, theirs, segment)[: sizes.pop() // 2]
        segment = jnp.concatenate([lower, jnp.where(is_upper, segment, theirs)])
        d *= 2
    return segment


def halving_doubling_terms(p: int, link_class: str) -> list[Term]:
    """``2 log2 p`` steps, each device sending ``2 (p - 1) / p`` of the buffer."""
    return [Term(link_class, 2 * math.log2(p), 2 * (p - 1) / p)] if p > 1 else []


HALVING_DOUBLING = Algorithm(
    name="halving_doubling",
    summary="recursive halving then doubling (Rabenseifner); a power-of-two device count",
    schedule=halving_doubling_allreduce,
    cost=halving_doubling_terms,
    power_of_two=True,
    swaps_on_two=True,
)
