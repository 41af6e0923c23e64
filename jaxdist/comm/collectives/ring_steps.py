"""The ring building blocks every ring-based schedule is made of: a reduce-scatter and an
all-gather round one or two rings at once, over windows of a flat buffer
(:mod:`~jaxdist.comm.collectives.windows`). The public reduce-scatter and all-gather are built
on them in :mod:`~jaxdist.comm.collectives.sharded`.

:func:`ring_all_gather` runs past 60 lines on purpose: its helpers (where a window lands,
the last window's overhang) close over the ring's positions and window geometry, and the
all-gather reads as one algorithm only with them beside the loop that uses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.comm.collectives.windows import (
    last_window_shift,
    window_head,
    window_length,
    window_stride,
)
from jaxdist.comm.collectives.wire import (
    AxisName,
    Wire,
    as_sent,
    axis_size,
    divided,
    repeat,
    shift,
    swap,
)

__all__: list[str] = []  # building blocks of the package's own modules


def ring_reduce_scatter(
    flat: jax.Array,
    axis_name: AxisName,
    directions: Sequence[int],
    wire: Wire,
    unroll_limit: int,
    stride: int | None = None,
    offset: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """Reduce-scatter a flat buffer round one ring per entry of ``directions``, in lockstep.

    The buffer is cut into ``len(directions) * p`` windows starting ``stride`` elements apart
    (default :func:`window_stride`); ring ``k`` (direction +1 or -1) works on windows
    ``[k p, (k + 1) p)``. On a ring a device's position is ``r = direction * i mod p``. At
    step ``s`` it passes its running sum to the next position and adds its own copy of
    window ``r - s - 2`` to what it received; after ``p - 1`` steps it holds the full sum of
    window ``r`` of its ring. Returns one shard per ring. ``offset`` (one value per device)
    moves every window but the last that many elements later; the last one still ends at
    the buffer's end (the torus's inner pair needs this).
    """
    p = axis_size(axis_name)
    i = lax.axis_index(axis_name)
    lanes = len(directions)
    if stride is None:
        stride = window_stride(flat.size, lanes * p)
    window = window_length(flat.size, lanes * p, stride)
    early = last_window_shift(flat.size, lanes * p, stride, window)
    positions = [(d * i) % p for d in directions]

    def own(lane: int, index) -> jax.Array:
        start = (lane * p + index % p) * stride
        if offset is not None:
            start = start + offset
        if early or offset is not None:  # the last window ends at the buffer's end
            start = jnp.minimum(start, flat.size - window)
        return lax.dynamic_slice_in_dim(flat, start, window)

    def step(s, partial_sums):
        return tuple(
            shift(acc, axis_name, d, wire) + own(lane, r - s - 2)
            for lane, (acc, d, r) in enumerate(zip(partial_sums, directions, positions))
        )

    first = tuple(own(lane, r - 1) for lane, r in enumerate(positions))
    return repeat(p - 1, step, first, unroll_limit)


def ring_all_gather(
    shards: Sequence[jax.Array],
    axis_name: AxisName,
    directions: Sequence[int],
    wire: Wire,
    unroll_limit: int,
    size: int,
    stride: int | None = None,
    into: jax.Array | None = None,
    divisor: int | None = None,
) -> jax.Array:
    """All-gather one flat shard per ring (ring ``k`` in direction ``directions[k]``): the
    windows that :func:`ring_reduce_scatter` left, ring ``k``'s windows ``[k p, (k + 1) p)``
    of a flat buffer of ``size`` elements starting ``stride`` apart (default
    :func:`window_stride`), each divided by ``divisor`` when given.

    The device at ring position ``r`` owns window ``r`` of its ring. At step ``s`` every
    device forwards the window it received last and writes the arriving one, window
    ``r - s - 1``, in place: its ``stride`` elements from ``k * stride`` on (for the last
    window, which starts early, from its ``shift``-th element), and the rest of the last
    window (the elements past ``count * stride``) once all steps are done. Buffers stay flat on
    purpose: on a ``(p, m)`` view XLA:CPU fuses each update with a bitcast into a loop over
    the whole buffer instead of writing one chunk. The result is written over ``into`` when
    given (see :func:`all_gather`), except for several rings unrolled, which gather by
    :func:`gather_by_concatenation`; only that form takes windows that overlap at the end
    alone (a stride from :func:`~jaxdist.comm.collectives.windows.whole_window_stride`).
    """
    p = axis_size(axis_name)
    i = lax.axis_index(axis_name)
    lanes = len(directions)
    count = lanes * p
    if stride is None:
        stride = window_stride(size, count)
    length = window_length(size, count, stride)
    early = last_window_shift(size, count, stride, length)
    overhang = size - count * stride  # the last window's elements past count * stride
    concatenate = gathers_by_concatenation(lanes, p, unroll_limit)
    _check_gather(shards[0].size, length, count, stride, size, into, overhang, concatenate)
    positions = [(d * i) % p for d in directions]

    def place(gathered, lane: int, index, block):
        is_last = index % p == p - 1 if lane == lanes - 1 else None
        block = divided(window_head(block, stride, early, is_last), divisor)  # fused into the write
        return lax.dynamic_update_slice_in_dim(gathered, block, (lane * p + index % p) * stride, 0)

    def last_overhang(kept, index, block):
        """The overhang of the last ring's window ``p - 1`` once it has passed by (None when
        the windows do not overlap). A ``lax.cond``, not a select: XLA fused a chain of
        selects into the final write, which kept every block alive until then and mapped the
        larger scratch memory afresh on every call."""
        if not overhang:
            return None
        return lax.cond(index % p == p - 1, lambda: block[early + stride :], lambda: kept)

    def step(s, carry):
        gathered, in_flight, kept = carry
        in_flight = tuple(shift(b, axis_name, d, wire) for b, d in zip(in_flight, directions))
        for lane, (block, r) in enumerate(zip(in_flight, positions)):
            gathered = place(gathered, lane, r - s - 1, block)
        kept = last_overhang(kept, positions[-1] - s - 1, in_flight[-1])
        return gathered, in_flight, kept

    if concatenate:
        # Two rings writing over one buffer made XLA copy it; one ring writing over a donated
        # input is faster than concatenating, so it keeps the in-place updates. The shards are
        # divided before they are sent, not as they are concatenated: that kept the mean as
        # fast as the sum.
        shards = tuple(as_sent(divided(block, divisor), wire) for block in shards)
        return gather_by_concatenation(shards, axis_name, directions, wire, stride, early)
    shards = tuple(as_sent(block, wire) for block in shards)
    gathered = jnp.zeros((size,), shards[0].dtype) if into is None else into
    for lane, (block, r) in enumerate(zip(shards, positions)):
        gathered = place(gathered, lane, r, block)
    kept = last_overhang(jnp.zeros_like(shards[-1][early + stride :]), positions[-1], shards[-1])
    gathered, _, kept = repeat(p - 1, step, (gathered, tuple(shards), kept), unroll_limit)
    if overhang:
        gathered = lax.dynamic_update_slice_in_dim(
            gathered, divided(kept, divisor), count * stride, 0
        )
    return gathered


def _check_gather(
    shard_size: int,
    length: int,
    count: int,
    stride: int,
    size: int,
    into: jax.Array | None,
    overhang: int,
    concatenate: bool,
) -> None:
    """Refuse shards that are not the windows, an ``into`` of the wrong shape, and windows
    that overlap only at the end where the gather writes over its input."""
    if shard_size != length:
        raise ValueError(
            f"all_gather: {count} windows {stride} apart ending at {size} hold "
            f"{length} elements each, got {shard_size}"
        )
    if into is not None and into.shape != (size,):
        raise ValueError(f"all_gather: `into` must have shape ({size},), got {into.shape}")
    if overhang < 0 and not concatenate:
        raise ValueError(
            f"all_gather: windows {stride} apart overlap only at the end here, which only a "
            f"gather by concatenation handles (several rings, unrolled)"
        )


def gathers_by_concatenation(lanes: int, p: int, unroll_limit: int) -> bool:
    """Whether :func:`ring_all_gather` gathers ``lanes`` rings of ``p`` devices by one
    concatenation (several rings, unrolled) rather than by writing over its input."""
    return lanes > 1 and p - 1 <= unroll_limit


def gather_by_concatenation(
    shards: Sequence[jax.Array],
    axis_name: AxisName,
    directions: Sequence[int],
    wire: Wire,
    stride: int,
    early: int,
) -> jax.Array:
    """The unrolled all-gather: keep every block as it arrives, then write the result once.

    Block ``t`` of ring ``k`` (``t = 0`` the device's own, ``t = s + 1`` the one received at
    step ``s``) is window ``r_k - t`` of that ring, so window ``j`` is block ``(r_k - j) mod
    p``. Each window contributes its first ``stride`` elements, the last one (which starts
    ``early`` elements early) all of its elements from the ``early``-th on.
    The order depends on the device's position, so one ``lax.switch`` branch per position
    holds that position's static concatenation: the result is written in one pass, with no
    zero-fill and no copy of a still-live input to write over. The price is memory: all ``p``
    blocks of every ring stay live until the concatenation (one result's worth besides it),
    and an ``into`` buffer is not reused.
    """
    p = axis_size(axis_name)
    blocks = [tuple(shards)]
    for _ in range(p - 1):
        blocks.append(tuple(shift(b, axis_name, d, wire) for b, d in zip(blocks[-1], directions)))

    def concatenation(index: int) -> Callable[[], jax.Array]:
        def ordered() -> jax.Array:
            parts = []
            for lane, d in enumerate(directions):
                r = (d * index) % p
                parts += [blocks[(r - j) % p][lane][:stride] for j in range(p)]
            r_last = (directions[-1] * index) % p
            parts[-1] = blocks[(r_last - (p - 1)) % p][-1][early:]  # the last window, to the end
            return jnp.concatenate(parts)

        return ordered

    return lax.switch(lax.axis_index(axis_name), [concatenation(i) for i in range(p)])


def gather_windows(
    shard: jax.Array,
    axis_name: AxisName,
    size: int,
    wire: Wire,
    unroll_limit: int,
    stride: int | None = None,
    into: jax.Array | None = None,
    divisor: int | None = None,
) -> jax.Array:
    """All-gather the windows a one-ring reduce-scatter left (:func:`ring_reduce_scatter`)
    into a flat buffer of ``size`` elements: over two devices one exchange
    (:func:`pair_all_gather`), over more round the ring (:func:`ring_all_gather`)."""
    p = axis_size(axis_name)
    if p == 1:
        return divided(shard, divisor)
    if stride is None:
        stride = window_stride(size, p)
    if p == 2:
        return pair_all_gather(shard, axis_name, size, wire, stride, divisor)
    return ring_all_gather(
        [shard], axis_name, (1,), wire, unroll_limit, size, stride, into=into, divisor=divisor
    )


def pair_all_gather(
    shard: jax.Array,
    axis_name: AxisName,
    size: int,
    wire: Wire,
    stride: int,
    divisor: int | None = None,
) -> jax.Array:
    """All-gather over two devices: one exchange, then both windows written in one pass (the
    first one's ``stride`` elements, then the second one from its ``shift``-th element, where
    the first one ends). Writing them over ``into`` instead would first copy ``into`` when it
    is still live and then update it twice."""
    early = last_window_shift(size, 2, stride, shard.size)
    theirs = divided(swap(shard, axis_name, wire), divisor)
    mine = divided(as_sent(shard, wire), divisor)
    first = lax.axis_index(axis_name) == 0
    # One concatenation of two selects: XLA fuses it into a single loop over the result.
    lower = jnp.where(first, mine, theirs)[:stride]
    return jnp.concatenate([lower, jnp.where(first, theirs, mine)[early:]])
