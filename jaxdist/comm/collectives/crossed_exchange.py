"""The crossed exchange: the outer step of a two-level schedule on two hosts, with no device
pair sending both ways.

On two hosts the outer allreduce is one pairwise swap, ``(0, k) <-> (1, k)``. Over gloo a
swap sent as one message runs one direction after the other
(:func:`~jaxdist.comm.collectives.wire.default_exchange_piece_bytes`); this sends the two
directions over different device pairs instead::

    1. (0, k) -> (1, k) and (1, k) -> (0, k + 1)    one ppermute over both axes
    2. (0, k + 1) -> (0, k)                          one hop inside host 0

Each host's link carries its ``n`` shards once per direction, as the ring would, in one step
instead of two, at the price of one extra hop of ``n`` shards along the inner axis. Swaps
over gloo go in pieces that run both directions at once, so it is off by default
(``crossed_exchange=True`` on ``torus2d`` and ``hierarchical`` turns it on).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.comm.collectives.wire import Wire, as_sent, axis_size, send

__all__: list[str] = []  # building blocks of the package's own modules


def uses_crossed_exchange(
    outer_size: int, inner_size: int, outer_swaps: bool, crossed_exchange: bool
) -> bool:
    """Whether a two-level schedule runs its outer step as :func:`crossed_pair_sum`: asked for,
    on an outer axis of two with at least two devices inside, where the outer schedule would
    be one swap (``outer_swaps``)."""
    return crossed_exchange and outer_size == 2 and inner_size >= 2 and outer_swaps


def crossed_pair_sum(shard: jax.Array, axis_name: tuple[str, str], wire: Wire) -> jax.Array:
    """Sum ``shard`` over an outer axis of two (two hosts) by the crossed exchange."""
    outer, inner = axis_name
    n = axis_size(inner)
    # Device (h, k) is number h * n + k on the two axes taken together.
    to_host1 = [(k, n + k) for k in range(n)]
    to_host0 = [(n + k, (k + 1) % n) for k in range(n)]
    arrived = send(shard, axis_name, to_host1 + to_host0, wire)
    back_one = [((k + 1) % n, k) for k in range(n)]
    forwarded = send(arrived, axis_name, back_one, wire)
    other = jnp.where(lax.axis_index(outer) == 0, forwarded, arrived)
    # Both hosts add the same two rounded values, so every device ends with the same bits.
    return as_sent(shard, wire) + other
