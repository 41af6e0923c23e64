"""The allreduce family, written as collective-permute schedules.

Every schedule here is made of ``jax.lax.ppermute`` steps and runs *inside* ``jax.shard_map``
(research code calls :func:`allreduce` from its own shard_map body). Each one is a small
function that reads as its algorithm; :mod:`jaxdist.cost_model` holds the alpha-beta cost of
each beside it, and ``tests/test_collectives.py`` checks each against ``psum``.

Axis names: the one-dimensional schedules (``ring``, ``bidirectional_ring``,
``halving_doubling``, ``parameter_server``, ``native``) take one mesh axis or a tuple of axes,
which then act as one flattened axis. The two-level schedules (``torus2d``, ``hierarchical``)
take a tuple ``(outer, inner)`` ordered like the mesh: the *inner* axis carries the full-size
reduce-scatter and all-gather, so it should be the one with the fast links.

Any shape and size works: buffers are flattened; the ring-based schedules cut a size that the
axis does not divide into overlapping windows of equal length (:func:`_window_stride`) and
halving-doubling into overlapping halves, so nothing is padded; only exchanges sent in pieces
and buffers with fewer elements than windows are zero-padded, with the padding cut off again
before the result is returned. Pytrees are fused
into one contiguous buffer per dtype (a gradient bucket) so that one schedule runs per dtype,
not one per leaf.

Type note for ``check_vma=True`` shard_maps: a ppermute result is typed as *varying* along the
axis even when every device ends up with the same values, and JAX has no cast from varying
back to invariant. Return the result with an ``out_spec`` that names the axis, or build the
shard_map with ``check_vma=False`` when the result should be declared replicated (``P()``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist.checks import positive_int

AxisName = str | tuple[str, ...]

ALGORITHMS = (
    "native",
    "ring",
    "bidirectional_ring",
    "torus2d",
    "hierarchical",
    "halving_doubling",
    "parameter_server",
)
TWO_LEVEL = ("torus2d", "hierarchical")

# Schedules with more steps than this run their steps in a ``lax.fori_loop`` instead of
# unrolling them, so compile time stays flat as the axis grows.
UNROLL_LIMIT = 16


# --------------------------------------------------------------------------- helpers


def axis_size(axis_name: AxisName) -> int:
    """Size of a mesh axis (or the product over a tuple), with a clear error when unbound."""
    try:
        return lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"axis {axis_name!r} is not bound here: jaxdist collectives run inside jax.shard_map "
            f"over a mesh that has this axis ({err})"
        ) from err


class Wire(NamedTuple):
    """How a schedule's messages travel.

    ``dtype``: the dtype messages are sent in (``None``: the accumulation dtype).
    ``exchange_piece_bytes``: the largest message a *pairwise exchange* (a ppermute in which
    two devices send to each other) sends at once; a larger one goes as consecutive pieces.
    ``"auto"`` picks :func:`default_exchange_piece_bytes` for the runtime, ``None`` never
    splits.
    ``reverse_traffic``: the schedule's other steps send the other way over the same links
    (the bidirectional ring), so every message is cut like an exchange (:func:`permute`).
    """

    dtype: Any = None
    exchange_piece_bytes: int | str | None = "auto"
    reverse_traffic: bool = False


# Measured on emulated 1 Gbit/s hosts (docs/multihost_performance.md, section 4.1): a 16 MiB
# swap over gloo took 278 ms in one message and 145 ms in pieces of 256 KiB (512 KiB: 163 ms,
# 128 KiB: 186 ms).
GLOO_EXCHANGE_PIECE_BYTES = 256 << 10
# The bidirectional ring's steps (each a ring step, on links that carry the other ring's
# steps the other way): 512 KiB pieces were as fast as 256 KiB ones or faster in 8 of 9
# comparisons on 4 and 8 emulated hosts, 16 and 64 MiB (same section).
GLOO_REVERSE_TRAFFIC_PIECE_BYTES = 512 << 10
# More pieces than this go in a fori_loop: unrolled, 32 pieces of a torus2d compiled in 2 s.
_UNROLLED_PIECES = 4


def default_exchange_piece_bytes(reverse_traffic: bool = False) -> int | None:
    """The piece size ``exchange_piece_bytes="auto"`` means in this runtime: for a pairwise
    exchange, or with ``reverse_traffic`` for a step of a schedule whose other steps use the
    same links the other way (:func:`permute`).

    Over gloo (CPU devices in several processes), a pairwise exchange sent as one message runs
    one direction after the other: XLA posts a ppermute's send before its receive, and gloo's
    TCP pair queues the later device's "ready to receive" notice behind its own payload, so
    the earlier device starts sending only when that payload has gone. Pieces small enough to
    fit in the socket's send buffer let both directions flow at once. A step of the
    bidirectional ring, sent whole, can still be in its sender's socket buffer when the sender
    starts its next step towards its other neighbour, and the two then share the host's link;
    pieces keep each step's message from running that far ahead. NCCL, ICI and the in-process
    CPU runtime have no such queue: there one message is best (``None``).
    """
    multi_process_cpu = jax.process_count() > 1 and jax.default_backend() == "cpu"
    if multi_process_cpu and jax.config.jax_cpu_collectives_implementation == "gloo":
        return GLOO_REVERSE_TRAFFIC_PIECE_BYTES if reverse_traffic else GLOO_EXCHANGE_PIECE_BYTES
    return None


def _piece_bytes(piece: int | str | None, reverse_traffic: bool = False) -> int | None:
    """An ``exchange_piece_bytes`` value checked and resolved: a byte count, or ``None``."""
    if piece is None:
        return None
    if isinstance(piece, str) and piece == "auto":
        return default_exchange_piece_bytes(reverse_traffic)
    return positive_int(piece, "exchange_piece_bytes", "a positive number of bytes, None or 'auto'")


def _is_pairwise_exchange(perm: list[tuple[int, int]]) -> bool:
    """Whether every device in ``perm`` sends to the device it receives from."""
    pairs = set(perm)
    return all(a != b and (b, a) in pairs for a, b in pairs)


def permute(
    x: jax.Array,
    axis_name: AxisName,
    perm: Sequence[tuple[int, int]],
    *,
    exchange_piece_bytes: int | str | None = "auto",
    reverse_traffic: bool = False,
) -> jax.Array:
    """``lax.ppermute`` that sends a large *pairwise exchange* in pieces.

    When every device in ``perm`` sends to the device it receives from (a swap) and ``x`` is
    larger than ``exchange_piece_bytes``, the exchange runs as consecutive ppermutes of equal
    slices (see :func:`default_exchange_piece_bytes` for why); any other permutation is one
    ppermute, unless ``reverse_traffic`` says that the links it uses carry messages the other
    way in the neighbouring steps of the schedule (the bidirectional ring), which over gloo
    costs the same as an exchange. The result is the same either way.
    """
    perm = [tuple(pair) for pair in perm]
    pairwise = _is_pairwise_exchange(perm)
    piece = _piece_bytes(exchange_piece_bytes, reverse_traffic and not pairwise)
    if piece is None or x.nbytes <= piece or not (pairwise or reverse_traffic):
        return lax.ppermute(x, axis_name, perm)
    flat = x.reshape(-1)
    per_piece = max(1, piece // x.dtype.itemsize)  # in elements, so no piece exceeds the bytes
    count = -(-flat.size // per_piece)
    padded = _pad_to_chunks(flat, count)
    piece_len = padded.size // count
    if count <= _UNROLLED_PIECES:
        parts = [lax.ppermute(part, axis_name, perm) for part in jnp.split(padded, count)]
        received = jnp.concatenate(parts)
    else:

        def piece_at(k) -> jax.Array:
            part = lax.dynamic_slice_in_dim(padded, k * piece_len, piece_len)
            return lax.ppermute(part, axis_name, perm)

        def step(k, received):
            return lax.dynamic_update_slice_in_dim(received, piece_at(k), k * piece_len, 0)

        # Piece 0 goes in before the loop, so the carry starts with the ppermute's type
        # (varying along the axis) even when ``x`` itself is replicated.
        first = lax.dynamic_update_slice_in_dim(jnp.zeros_like(padded), piece_at(0), 0, 0)
        received = lax.fori_loop(1, count, step, first)
    return received[: flat.size].reshape(x.shape)


def _send(x: jax.Array, axis_name: AxisName, perm: list[tuple[int, int]], wire: Wire) -> jax.Array:
    """One message step (:func:`permute`: one ppermute, or consecutive pieces of an exchange),
    optionally sent in a narrower dtype and widened again on arrival."""
    narrow = wire.dtype is not None and jnp.dtype(wire.dtype) != x.dtype
    sent = x.astype(wire.dtype) if narrow else x
    received = permute(
        sent,
        axis_name,
        perm,
        exchange_piece_bytes=wire.exchange_piece_bytes,
        reverse_traffic=wire.reverse_traffic,
    )
    return received.astype(x.dtype) if narrow else received


def _as_sent(x: jax.Array, wire: Wire) -> jax.Array:
    """``x`` rounded as :func:`_send` would round it. A device keeps its own copy of a reduced
    chunk in this form so that every device ends with the same bits, whichever one reduced it."""
    if wire.dtype is None or jnp.dtype(wire.dtype) == x.dtype:
        return x
    return x.astype(wire.dtype).astype(x.dtype)


def _divided(x: jax.Array, divisor: int | None) -> jax.Array:
    """``x / divisor``, the mean's division, or ``x`` itself when ``divisor`` is None.

    Schedules divide where they write their result anyway (each chunk as the all-gather
    places it, or each shard before it is sent), so that a mean costs no extra pass over the
    buffer. A division after the schedule also stopped XLA:CPU from writing the result over
    a donated input: the ring's mean in place on 8 CPU devices, 16 MiB each, took 110 ms that
    way against 38 ms for its sum (docs/performance.md, "The mean's division").
    """
    if divisor is None:
        return x
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"a mean needs floating-point values to divide, got dtype {x.dtype}")
    return x / divisor


def _shift(x: jax.Array, axis_name: AxisName, direction: int, wire: Wire) -> jax.Array:
    """Every device sends ``x`` to its neighbour ``direction`` (+1 or -1) steps round the ring."""
    p = axis_size(axis_name)
    return _send(x, axis_name, [(j, (j + direction) % p) for j in range(p)], wire)


def _repeat(num_steps: int, step: Callable, carry: Any, unroll_limit: int) -> Any:
    """``carry = step(s, carry)`` for ``s`` in ``range(num_steps)``: unrolled when short (XLA
    can then schedule across steps), a ``fori_loop`` when long (bounded compile time)."""
    if num_steps <= unroll_limit:
        for s in range(num_steps):
            carry = step(s, carry)
        return carry
    return lax.fori_loop(0, num_steps, step, carry)


def _pad_to_chunks(flat: jax.Array, p: int) -> jax.Array:
    """Zero-pad a flat buffer to ``p`` equal chunks (a no-op when ``p`` divides its size)."""
    padded_size = p * -(-flat.size // p)
    return flat if padded_size == flat.size else jnp.pad(flat, (0, padded_size - flat.size))


# Windows start on multiples of this many elements (64 bytes of float32) when they are at least
# that long.
_WINDOW_ALIGNMENT = 16


def _window_stride(size: int, count: int) -> int:
    """Where the ``count`` windows of a buffer of ``size`` elements start: window ``k`` at
    ``k * stride``, except the last, which ends at ``size`` (their length:
    :func:`_window_length`).

    The ring schedules reduce windows instead of padded chunks. Windows are all as long, as
    ppermute needs, and the last one ends at ``size`` exactly, so no buffer is padded and
    no result is cut back: a pad and a cut each cost a pass over the data, and together they
    stopped XLA:CPU from writing the result over a donated input (the ring in place on 8 CPU
    devices, 16 MiB + 4 bytes each, took 111 ms padded against 42 ms at 16 MiB, and now as
    long as at 16 MiB; docs/performance.md, "Sizes that do not divide"). Consecutive windows
    overlap; the elements they share are summed twice, but the all-gather writes each
    window's first ``stride`` elements and, of the last window, everything from
    ``(count - 1) * stride`` on, so every element of the result comes from exactly one
    window and every device ends with the same bits. (A gather by concatenation uses
    :func:`_whole_window_stride` instead, where only the last window overlaps.)

    The stride is rounded down to a multiple of ``_WINDOW_ALIGNMENT`` (the overlap grows by
    less than ``count * _WINDOW_ALIGNMENT`` elements): windows that started at odd offsets
    cost XLA:CPU a quarter more processor time (ring in place, 16 MiB + 32 bytes: 50 ms
    against 39 ms aligned).
    """
    if 0 < size < count:
        raise ValueError(f"{size} elements cannot be cut into {count} windows; pad first")
    stride = size // count
    return stride - stride % _WINDOW_ALIGNMENT if stride >= _WINDOW_ALIGNMENT else stride


def _window_length(size: int, count: int, stride: int) -> int:
    """How long the ``count`` windows starting ``stride`` apart are: long enough for the last to
    reach ``size``, and, when the stride is aligned, rounded up to a multiple of
    ``_WINDOW_ALIGNMENT``; never shorter than the stride, which a stride from
    :func:`_whole_window_stride` needs (its last window is a stride long as well). The last
    window then starts ``shift`` elements early, at ``size - length``
    (:func:`_last_window_shift`). Windows of odd length cost XLA:CPU a fifth more processor
    time (ring in place, 16 MiB + 4 bytes: 60 ms against 50 ms rounded up)."""
    length = size - (count - 1) * stride
    aligned = stride >= _WINDOW_ALIGNMENT and stride % _WINDOW_ALIGNMENT == 0
    if aligned and length % _WINDOW_ALIGNMENT:
        # min: only one window (count 1) could pass the end; more start early instead.
        length = min(size, length - length % _WINDOW_ALIGNMENT + _WINDOW_ALIGNMENT)
    length = max(length, stride)
    if length > size or (count - 1) * stride > size:
        raise ValueError(f"{count} windows {stride} apart do not fit in {size} elements")
    return length


def _whole_window_stride(size: int, count: int) -> int | None:
    """A stride for windows that do not overlap but for the last: every window ``stride``
    elements long (the quotient rounded up, aligned when at least ``_WINDOW_ALIGNMENT``), the
    last one starting early to end at ``size``; None when the first ``count - 1`` windows
    would not fit.

    For a gather by concatenation (:func:`_gather_by_concatenation`): every block but the
    last then enters whole, where the default stride cut a slice off each one, and XLA:CPU
    turns a concatenation of slices into a slower loop (8 CPU devices, sixteen 4 MiB blocks
    concatenated: 299 ms sliced, 231 ms whole but the last, 223 ms all whole).
    """
    length = -(-size // count)
    if length >= _WINDOW_ALIGNMENT:
        length += -length % _WINDOW_ALIGNMENT
    return length if length <= size and (count - 1) * length <= size else None


def _last_window_shift(size: int, count: int, stride: int, length: int) -> int:
    """How far before ``(count - 1) * stride`` the last window starts (it ends at ``size``)."""
    return length - (size - (count - 1) * stride)


def _window_head(block: jax.Array, stride: int, shift: int, is_last) -> jax.Array:
    """The ``stride`` elements of a window's ``block`` that an all-gather writes at the
    window's start: from the ``shift``-th for the last window, which starts ``shift`` elements
    early (:func:`_window_length`). ``is_last``: whether the block is the last window (traced),
    or None where it cannot be."""
    if shift and is_last is not None:
        return lax.dynamic_slice_in_dim(block, jnp.where(is_last, shift, 0), stride)
    return block[:stride]


def _windowed(flat: jax.Array, count: int) -> jax.Array:
    """``flat`` itself when it has at least ``count`` elements (enough for :func:`_window_stride`),
    else zero-padded to ``count``: the ring schedules then cut the padding off their result."""
    return flat if flat.size >= count else _pad_to_chunks(flat, count)


# --------------------------------------------------------------------------- ring building blocks


def _ring_reduce_scatter(
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
    (default :func:`_window_stride`; the public :func:`reduce_scatter` passes equal chunks
    of a padded buffer, the unrolled bidirectional ring :func:`_whole_window_stride`); ring
    ``k`` (direction +1 or -1) works on windows
    ``[k p, (k + 1) p)``. On a ring a device's position is ``r = direction * i mod p``. At
    step ``s`` it passes its running sum to the next position and adds its own copy of
    window ``r - s - 2`` to what it received; after ``p - 1`` steps it holds the full sum of
    window ``r`` of its ring. Returns one shard per ring. ``offset`` (one value per device)
    moves every window but the last that many elements later; the last one still ends at
    the buffer's end (:func:`_torus_pair_allreduce` needs this).
    """
    p = axis_size(axis_name)
    i = lax.axis_index(axis_name)
    lanes = len(directions)
    if stride is None:
        stride = _window_stride(flat.size, lanes * p)
    window = _window_length(flat.size, lanes * p, stride)
    shift = _last_window_shift(flat.size, lanes * p, stride, window)
    positions = [(d * i) % p for d in directions]

    def own(lane: int, index) -> jax.Array:
        start = (lane * p + index % p) * stride
        if offset is not None:
            start = start + offset
        if shift or offset is not None:  # the last window ends at the buffer's end
            start = jnp.minimum(start, flat.size - window)
        return lax.dynamic_slice_in_dim(flat, start, window)

    def step(s, partial_sums):
        return tuple(
            _shift(acc, axis_name, d, wire) + own(lane, r - s - 2)
            for lane, (acc, d, r) in enumerate(zip(partial_sums, directions, positions))
        )

    first = tuple(own(lane, r - 1) for lane, r in enumerate(positions))
    return _repeat(p - 1, step, first, unroll_limit)


def _ring_all_gather(
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
    windows that :func:`_ring_reduce_scatter` left, ring ``k``'s windows ``[k p, (k + 1) p)``
    of a flat buffer of ``size`` elements starting ``stride`` apart (default
    :func:`_window_stride`), each divided by ``divisor`` when given.

    The device at ring position ``r`` owns window ``r`` of its ring. At step ``s`` every
    device forwards the window it received last and writes the arriving one, window
    ``r - s - 1``, in place: its ``stride`` elements from ``k * stride`` on (for the last
    window, which starts early, from its ``shift``-th element), and the rest of the last
    window (the elements past ``count * stride``) once all steps are done. Buffers stay flat on
    purpose: on a ``(p, m)`` view XLA:CPU fuses each update with a bitcast into a loop over
    the whole buffer instead of writing one chunk. The result is written over ``into`` when
    given (see :func:`all_gather`), except for several rings unrolled, which gather by
    :func:`_gather_by_concatenation`; only that form takes windows that overlap at the end
    alone (a stride from :func:`_whole_window_stride`).
    """
    p = axis_size(axis_name)
    i = lax.axis_index(axis_name)
    lanes = len(directions)
    count = lanes * p
    if stride is None:
        stride = _window_stride(size, count)
    length = _window_length(size, count, stride)
    if shards[0].size != length:
        raise ValueError(
            f"all_gather: {count} windows {stride} apart ending at {size} hold "
            f"{length} elements each, got {shards[0].size}"
        )
    shift = _last_window_shift(size, count, stride, length)
    overhang = size - count * stride  # the last window's elements past count * stride
    positions = [(d * i) % p for d in directions]

    def place(gathered, lane: int, index, block):
        is_last = index % p == p - 1 if lane == lanes - 1 else None
        block = _divided(
            _window_head(block, stride, shift, is_last), divisor
        )  # fused into the write
        return lax.dynamic_update_slice_in_dim(gathered, block, (lane * p + index % p) * stride, 0)

    def last_overhang(kept, index, block):
        """The overhang of the last ring's window ``p - 1`` once it has passed by (None when
        the windows do not overlap). A ``lax.cond``, not a select: XLA fused a chain of
        selects into the final write, which kept every block alive until then, and the larger
        scratch memory was mapped afresh on every call (ring in place, 8 CPU devices,
        16 MiB + 8 bytes: 50 ms that way, 40 ms with the cond, 38 ms at 16 MiB)."""
        if not overhang:
            return None
        return lax.cond(index % p == p - 1, lambda: block[shift + stride :], lambda: kept)

    def step(s, carry):
        gathered, in_flight, kept = carry
        in_flight = tuple(_shift(b, axis_name, d, wire) for b, d in zip(in_flight, directions))
        for lane, (block, r) in enumerate(zip(in_flight, positions)):
            gathered = place(gathered, lane, r - s - 1, block)
        kept = last_overhang(kept, positions[-1] - s - 1, in_flight[-1])
        return gathered, in_flight, kept

    if into is not None and into.shape != (size,):
        raise ValueError(f"all_gather: `into` must have shape ({size},), got {into.shape}")
    concatenate = _gathers_by_concatenation(lanes, p, unroll_limit)
    if overhang < 0 and not concatenate:
        raise ValueError(
            f"all_gather: windows {stride} apart overlap only at the end here, which only a "
            f"gather by concatenation handles (several rings, at most {unroll_limit} steps)"
        )
    if concatenate:
        # Two rings writing over one buffer made XLA copy it (bidirectional ring in place on
        # 8 CPU devices: 2.3-2.5x psum this way against 1.2-1.8x concatenated). One ring
        # writing over a donated input is faster than concatenating (0.8-1.5x against
        # 1.2-1.7x), so it keeps the in-place updates. Dividing the shards before they are
        # sent, not the blocks as they are concatenated, kept the mean as fast as the sum
        # (49-54 ms against 84 ms, 16 MiB per device).
        shards = tuple(_as_sent(_divided(block, divisor), wire) for block in shards)
        return _gather_by_concatenation(shards, axis_name, directions, wire, stride, shift)
    shards = tuple(_as_sent(block, wire) for block in shards)
    gathered = jnp.zeros((size,), shards[0].dtype) if into is None else into
    for lane, (block, r) in enumerate(zip(shards, positions)):
        gathered = place(gathered, lane, r, block)
    kept = last_overhang(jnp.zeros_like(shards[-1][shift + stride :]), positions[-1], shards[-1])
    gathered, _, kept = _repeat(p - 1, step, (gathered, tuple(shards), kept), unroll_limit)
    if overhang:
        gathered = lax.dynamic_update_slice_in_dim(
            gathered, _divided(kept, divisor), count * stride, 0
        )
    return gathered


def _gathers_by_concatenation(lanes: int, p: int, unroll_limit: int) -> bool:
    """Whether :func:`_ring_all_gather` gathers ``lanes`` rings of ``p`` devices by one
    concatenation (several rings, unrolled) rather than by writing over its input."""
    return lanes > 1 and p - 1 <= unroll_limit


def _gather_by_concatenation(
    shards: Sequence[jax.Array],
    axis_name: AxisName,
    directions: Sequence[int],
    wire: Wire,
    stride: int,
    shift: int,
) -> jax.Array:
    """The unrolled all-gather: keep every block as it arrives, then write the result once.

    Block ``t`` of ring ``k`` (``t = 0`` the device's own, ``t = s + 1`` the one received at
    step ``s``) is window ``r_k - t`` of that ring, so window ``j`` is block ``(r_k - j) mod
    p``. Each window contributes its first ``stride`` elements, the last one (which starts
    ``shift`` elements early) all of its elements from the ``shift``-th on.
    The order depends on the device's position, so one ``lax.switch`` branch per position
    holds that position's static concatenation: the result is written in one pass, with no
    zero-fill and no copy of a still-live input to write over. The price is memory: all ``p``
    blocks of every ring stay live until the concatenation (one result's worth besides it),
    and an ``into`` buffer is not reused.
    """
    p = axis_size(axis_name)
    blocks = [tuple(shards)]
    for _ in range(p - 1):
        blocks.append(tuple(_shift(b, axis_name, d, wire) for b, d in zip(blocks[-1], directions)))

    def concatenation(index: int) -> Callable[[], jax.Array]:
        def ordered() -> jax.Array:
            parts = []
            for lane, d in enumerate(directions):
                r = (d * index) % p
                parts += [blocks[(r - j) % p][lane][:stride] for j in range(p)]
            r_last = (directions[-1] * index) % p
            parts[-1] = blocks[(r_last - (p - 1)) % p][-1][shift:]  # the last window, to the end
            return jnp.concatenate(parts)

        return ordered

    return lax.switch(lax.axis_index(axis_name), [concatenation(i) for i in range(p)])


def reduce_scatter(
    x: jax.Array,
    axis_name: AxisName,
    *,
    transfer_dtype=None,
    exchange_piece_bytes: int | str | None = "auto",
    unroll_limit: int = UNROLL_LIMIT,
) -> jax.Array:
    """Ring reduce-scatter, ``p - 1`` steps.

    ``x`` is flattened and zero-padded to ``p`` equal chunks; device ``i`` returns the sum over
    all devices of chunk ``i`` (shape ``(ceil(x.size / p),)``). ``transfer_dtype``,
    ``exchange_piece_bytes`` and ``unroll_limit`` as for :func:`allreduce`.
    """
    p = axis_size(axis_name)
    padded = _pad_to_chunks(x.reshape(-1), p)
    if p == 1:
        return padded
    wire = Wire(transfer_dtype, exchange_piece_bytes)
    (shard,) = _ring_reduce_scatter(
        padded, axis_name, (1,), wire, unroll_limit, stride=padded.size // p
    )
    return shard


def all_gather(
    shard: jax.Array,
    axis_name: AxisName,
    *,
    into: jax.Array | None = None,
    divisor: int | None = None,
    transfer_dtype=None,
    exchange_piece_bytes: int | str | None = "auto",
    unroll_limit: int = UNROLL_LIMIT,
) -> jax.Array:
    """Ring all-gather, ``p - 1`` steps: device ``i`` contributes chunk ``i``; every device
    returns the ``p`` chunks concatenated in order (flattened, padding included).

    ``into``: an optional flat buffer of ``p * shard.size`` elements whose contents may be
    overwritten by the result. Passing the (padded) input of the preceding reduce-scatter lets
    XLA write the gathered chunks into that memory when nothing else still reads it, instead
    of allocating and zero-filling a new buffer. On two devices the all-gather is one
    exchange and a concatenation, and ``into`` is not used (:func:`_pair_all_gather`).
    ``divisor``: divide every chunk by this as it is written (the division of a mean, at no
    extra pass over the result). ``transfer_dtype``, ``exchange_piece_bytes`` and
    ``unroll_limit`` as for :func:`allreduce`.
    """
    shard = shard.reshape(-1)
    size = axis_size(axis_name) * shard.size
    wire = Wire(transfer_dtype, exchange_piece_bytes)
    return _gather_windows(
        shard, axis_name, size, wire, unroll_limit, stride=shard.size, into=into, divisor=divisor
    )


def _gather_windows(
    shard: jax.Array,
    axis_name: AxisName,
    size: int,
    wire: Wire,
    unroll_limit: int,
    stride: int | None = None,
    into: jax.Array | None = None,
    divisor: int | None = None,
) -> jax.Array:
    """All-gather the windows a one-ring reduce-scatter left (:func:`_ring_reduce_scatter`)
    into a flat buffer of ``size`` elements: over two devices one exchange
    (:func:`_pair_all_gather`), over more round the ring (:func:`_ring_all_gather`)."""
    p = axis_size(axis_name)
    if p == 1:
        return _divided(shard, divisor)
    if stride is None:
        stride = _window_stride(size, p)
    if p == 2:
        return _pair_all_gather(shard, axis_name, size, wire, stride, divisor)
    return _ring_all_gather(
        [shard], axis_name, (1,), wire, unroll_limit, size, stride, into=into, divisor=divisor
    )


def _pair_all_gather(
    shard: jax.Array,
    axis_name: AxisName,
    size: int,
    wire: Wire,
    stride: int,
    divisor: int | None = None,
) -> jax.Array:
    """All-gather over two devices: one exchange, then both windows written in one pass (the
    first one's ``stride`` elements, then the second one from its ``shift``-th element, where
    the first one ends).

    Writing them over ``into`` would first copy ``into`` when it is still live (out of place)
    and then update it twice: on 8 CPU devices, 16 MiB per device, an all-gather over a
    2-device axis into its own input took 44 ms that way and 20-24 ms as this concatenation.
    """
    shift = _last_window_shift(size, 2, stride, shard.size)
    theirs = _divided(_send(shard, axis_name, [(0, 1), (1, 0)], wire), divisor)
    mine = _divided(_as_sent(shard, wire), divisor)
    first = lax.axis_index(axis_name) == 0
    # One concatenation of two selects: XLA fuses it into a single loop over the result.
    lower = jnp.where(first, mine, theirs)[:stride]
    return jnp.concatenate([lower, jnp.where(first, theirs, mine)[shift:]])


def _cut(gathered: jax.Array, size: int) -> jax.Array:
    """The first ``size`` elements of ``gathered``: the padding of a buffer too small for
    windows (:func:`_windowed`) cut off again, and no slice at all otherwise."""
    return gathered if gathered.size == size else gathered[:size]


# --------------------------------------------------------------------------- the schedules
# Each takes a flat buffer (already in the accumulation dtype) and returns its sum over the axis.


def native_allreduce(
    flat: jax.Array,
    axis_name: AxisName,
    *,
    divisor: int | None = None,
    transfer_dtype=None,
    exchange_piece_bytes: int | str | None = "auto",
    unroll_limit: int = UNROLL_LIMIT,
) -> jax.Array:
    """``lax.psum``: XLA's own all-reduce, the reference every schedule is checked against.
    With ``transfer_dtype`` the psum itself runs in that dtype."""
    del exchange_piece_bytes, unroll_limit  # XLA chooses its own schedule and messages
    if transfer_dtype is None or jnp.dtype(transfer_dtype) == flat.dtype:
        return _divided(lax.psum(flat, axis_name), divisor)
    summed = lax.psum(flat.astype(transfer_dtype), axis_name).astype(flat.dtype)
    return _divided(summed, divisor)


def ring_allreduce(
    flat: jax.Array,
    axis_name: AxisName,
    *,
    divisor: int | None = None,
    transfer_dtype=None,
    exchange_piece_bytes: int | str | None = "auto",
    unroll_limit: int = UNROLL_LIMIT,
) -> jax.Array:
    """Ring allreduce: reduce-scatter then all-gather, ``p - 1`` steps each, every link busy."""
    wire = Wire(transfer_dtype, exchange_piece_bytes)
    buffer = _windowed(flat, axis_size(axis_name))
    (shard,) = _ring_reduce_scatter(buffer, axis_name, (1,), wire, unroll_limit)
    gathered = _gather_windows(
        shard, axis_name, buffer.size, wire, unroll_limit, into=buffer, divisor=divisor
    )
    return _cut(gathered, flat.size)


def bidirectional_ring_allreduce(
    flat: jax.Array,
    axis_name: AxisName,
    *,
    divisor: int | None = None,
    transfer_dtype=None,
    exchange_piece_bytes: int | str | None = "auto",
    unroll_limit: int = UNROLL_LIMIT,
) -> jax.Array:
    """Two rings at once: the first half of the data goes clockwise, the second half
    counter-clockwise, so both directions of every link carry traffic in each step.

    Every link then carries messages both ways, as in an exchange, so where exchanges go in
    pieces (``exchange_piece_bytes``; over gloo by default, 512 KiB for these steps) so do
    this schedule's steps: sent whole, a step's message sat in the socket's buffer while its
    sender went on to the next step, towards its other neighbour, and two messages shared one
    host's link (4 emulated hosts, 16 MiB: median 342 ms whole, 253 ms in pieces;
    docs/multihost_performance.md, section 4.1).
    """
    p = axis_size(axis_name)
    if p <= 2:  # both directions reach the same neighbour: a plain ring is the same schedule
        return ring_allreduce(
            flat,
            axis_name,
            divisor=divisor,
            transfer_dtype=transfer_dtype,
            exchange_piece_bytes=exchange_piece_bytes,
            unroll_limit=unroll_limit,
        )
    directions = (1, -1)  # windows [0, p) go clockwise, windows [p, 2p) counter-clockwise
    buffer = _windowed(flat, 2 * p)
    wire = Wire(transfer_dtype, exchange_piece_bytes, reverse_traffic=True)
    # Unrolled, the all-gather concatenates whole blocks (see _whole_window_stride).
    concatenate = _gathers_by_concatenation(len(directions), p, unroll_limit)
    stride = _whole_window_stride(buffer.size, 2 * p) if concatenate else None
    shards = _ring_reduce_scatter(buffer, axis_name, directions, wire, unroll_limit, stride)
    gathered = _ring_all_gather(
        shards,
        axis_name,
        directions,
        wire,
        unroll_limit,
        buffer.size,
        stride,
        into=buffer,
        divisor=divisor,
    )
    return _cut(gathered, flat.size)


def _crossed_pair_sum(shard: jax.Array, axis_name: tuple[str, str], wire: Wire) -> jax.Array:
    """Sum ``shard`` over an outer axis of two (two hosts), with no device pair sending both
    ways.

    On two hosts the outer allreduce is one pairwise swap, ``(0, k) <-> (1, k)``. Over gloo a
    swap sent as one message runs one direction after the other
    (:func:`default_exchange_piece_bytes`); this sends the two directions over different
    device pairs instead:

    1. ``(0, k) -> (1, k)`` and ``(1, k) -> (0, k + 1)``, one ppermute over both axes: host 1
       now holds both halves of each sum; host 0 holds host 1's shard ``k`` one device over;
    2. on host 0, ``(0, k + 1) -> (0, k)``: one hop inside the host, over the fast links.

    Each host's link carries its ``n`` shards once per direction, as the ring would, in one
    step instead of two, at the price of one extra hop of ``n`` shards along the inner axis.
    Since swaps over gloo go in pieces that run both directions at once, it is off by
    default: the pieced swap measured as fast on 2 hosts x 4 devices
    (docs/multihost_performance.md, section 3) and faster on one-device hosts, where the
    extra hop crosses the network (section 1).
    """
    outer, inner = axis_name
    n = axis_size(inner)
    # Device (h, k) is number h * n + k on the two axes taken together.
    to_host1 = [(k, n + k) for k in range(n)]
    to_host0 = [(n + k, (k + 1) % n) for k in range(n)]
    arrived = _send(shard, axis_name, to_host1 + to_host0, wire)
    back_one = [((k + 1) % n, k) for k in range(n)]
    forwarded = _send(arrived, axis_name, back_one, wire)
    other = jnp.where(lax.axis_index(outer) == 0, forwarded, arrived)
    # Both hosts add the same two rounded values, so every device ends with the same bits.
    return _as_sent(shard, wire) + other


# One-dimensional schedules that, on an axis of two devices, are a single pairwise swap.
_SWAP_ON_TWO = ("ring", "bidirectional_ring", "halving_doubling")


def uses_crossed_exchange(
    outer_size: int, inner_size: int, inter_algorithm: str = "ring", crossed_exchange: bool = False
) -> bool:
    """Whether a two-level schedule runs its outer step as :func:`_crossed_pair_sum`: on an
    outer axis of two with at least two devices inside, when the outer schedule would swap."""
    return (
        crossed_exchange and outer_size == 2 and inner_size >= 2 and inter_algorithm in _SWAP_ON_TWO
    )


def gathers_across_pair(
    outer_size: int, inner_size: int, inter_algorithm: str = "ring", crossed_exchange: bool = False
) -> bool:
    """Whether a two-level schedule runs as :func:`_torus_pair_allreduce`: on an inner axis of
    two with a ring across the outer axis (and not as the crossed exchange)."""
    return (
        inner_size == 2
        and inter_algorithm == "ring"
        and not uses_crossed_exchange(outer_size, inner_size, inter_algorithm, crossed_exchange)
    )


def _torus_pair_allreduce(
    flat: jax.Array,
    axis_name: tuple[str, str],
    wire: Wire,
    unroll_limit: int,
    divisor: int | None = None,
) -> jax.Array:
    """The two-level schedule on an inner axis of two with a ring of Y devices across the outer
    axis, its last two phases interleaved:

    1. reduce-scatter across the pair: each device sends the region of the buffer its partner
       keeps and adds what arrives to its own region (one exchange of half the buffer);
    2. ring reduce-scatter of that region along the outer axis (Y - 1 steps);
    3. ring all-gather along the outer axis (Y - 1 steps), in which every block, the device's
       own first, crosses the pair as soon as it is there (Y exchanges of 1/(2Y) of the
       buffer) and both copies are written straight into the result.

    Each axis carries the bytes of :func:`hierarchical_allreduce`'s three phases; only the
    last exchange across the pair goes as Y blocks instead of one half. Every message is then
    a buffer as it arrived and the result is written once, where the three phases gathered
    the outer ring's blocks into a half-size buffer, sent that and concatenated it with the
    other half: two more passes over the data (8 CPU devices, ``torus-4x2``, 16 MiB in place:
    docs/performance.md, "torus2d on an inner axis of two").

    Windows: the result is laid out as a flat ring's ``2 Y`` windows (:func:`_window_stride`),
    window ``k Y + j`` being block ``j`` of region ``k``. Region 0 is windows ``[0, Y)``;
    region 1 ends at the buffer's end, so it starts where window ``Y`` does less the last
    window's ``shift``, and its windows but the last sit ``shift`` further into it.
    """
    outer, inner = axis_name
    q = axis_size(outer)
    size = flat.size
    stride = _window_stride(size, 2 * q)
    length = _window_length(size, 2 * q, stride)
    region = (q - 1) * stride + length
    second = size - region  # where region 1 starts: q * stride - shift
    k = lax.axis_index(inner)
    partners_region = lax.dynamic_slice_in_dim(flat, (1 - k) * second, region)
    own_region = lax.dynamic_slice_in_dim(flat, k * second, region)
    pair_sum = _send(partners_region, inner, [(0, 1), (1, 0)], wire) + own_region
    shift = _last_window_shift(size, 2 * q, stride, length)
    (shard,) = _ring_reduce_scatter(
        pair_sum, outer, (1,), wire, unroll_limit, stride, offset=k * shift
    )
    return _ring_all_gather_across_pair(
        shard, axis_name, wire, unroll_limit, size, stride, into=flat, divisor=divisor
    )


def _ring_all_gather_across_pair(
    shard: jax.Array,
    axis_name: tuple[str, str],
    wire: Wire,
    unroll_limit: int,
    size: int,
    stride: int,
    into: jax.Array,
    divisor: int | None = None,
) -> jax.Array:
    """Phase 3 of :func:`_torus_pair_allreduce`: the ring all-gather along the outer axis, in
    which every block is exchanged across the inner pair as it arrives and both copies are
    written over ``into``.

    What goes on round the ring is the block that just came across the pair, so each swap
    waits for the ring step before it and each ring step for the swap before it: no two
    messages of this phase can be in flight at once. Forwarding the block that arrived round
    the ring instead left consecutive swaps independent of each other and of the ring steps,
    and over gloo (8 processes, 16 MiB, swaps in a loop of 256 KiB pieces) the sums came out
    wrong in 3 of 4 calls; with the chain, 10 of 10 were right. Which messages met the wrong
    receive was not pinned down; independent schedules side by side (gradient buckets) gave
    right sums in the same setting.

    The device at ring position ``y`` starts with block ``y`` of its own region ``k``; the
    block arriving at step ``t`` is block ``y - t`` of region ``k + t`` (mod 2), and its
    partner's is the same block of the other region. Each window contributes its first
    ``stride`` elements (the last window, which starts ``shift`` early, from its
    ``shift``-th), and the last window's overhang past ``2 Y stride`` is written once all
    steps are done, so every element of the result comes from exactly one window and every
    device ends with the same bits.
    """
    outer, inner = axis_name
    q = axis_size(outer)
    count = 2 * q
    shift = _last_window_shift(size, count, stride, shard.size)
    overhang = size - count * stride
    y, k = lax.axis_index(outer), lax.axis_index(inner)

    def place(gathered, window, block):
        head = _window_head(block, stride, shift, window == count - 1)
        return lax.dynamic_update_slice_in_dim(
            gathered, _divided(head, divisor), window * stride, 0
        )

    def cross(t, gathered, kept, block):
        """Exchange the block of step ``t`` across the pair and write both copies."""
        region, j = (k + t) % 2, (y - t) % q
        partner = _send(block, inner, [(0, 1), (1, 0)], wire)
        gathered = place(gathered, region * q + j, block)
        gathered = place(gathered, (1 - region) * q + j, partner)
        if overhang:  # a cond, not a select: see _ring_all_gather's last_overhang
            kept = lax.cond(
                j == q - 1,
                lambda: jnp.where(region == 1, block, partner)[shift + stride :],
                lambda: kept,
            )
        return gathered, kept, partner

    def step(s, carry):
        gathered, kept, crossed = carry
        arrived = _shift(crossed, outer, 1, wire)
        return cross(s + 1, gathered, kept, arrived)

    block = _as_sent(shard, wire)
    kept = jnp.zeros_like(block[shift + stride :]) if overhang else None
    carry = cross(0, into, kept, block)
    gathered, kept, _ = _repeat(q - 1, step, carry, unroll_limit)
    if overhang:
        gathered = lax.dynamic_update_slice_in_dim(
            gathered, _divided(kept, divisor), count * stride, 0
        )
    return gathered


def torus2d_allreduce(
    flat: jax.Array,
    axis_name: tuple[str, str],
    *,
    crossed_exchange: bool = False,
    divisor: int | None = None,
    transfer_dtype=None,
    exchange_piece_bytes: int | str | None = "auto",
    unroll_limit: int = UNROLL_LIMIT,
) -> jax.Array:
    """2-D torus allreduce (Mikami et al. 2018) on axes ``(outer, inner)``.

    1. reduce-scatter along the inner axis (each row of X devices): every device is left
       with 1/X of the data, summed over its row;
    2. ring allreduce of that 1/X along the outer axis (each column of Y devices);
    3. all-gather along the inner axis.
    Latency steps: 2(X-1) + 2(Y-1) instead of 2(XY-1) for one flat ring (on an inner axis
    of two, 1 + Y + 2(Y-1): :func:`_torus_pair_allreduce` interleaves steps 2 and 3). With
    an outer axis of two, ``crossed_exchange=True`` runs step 2 as :func:`_crossed_pair_sum`
    (off by default; on a torus both axes are network links, so its extra hop along the inner
    axis crosses the network too, and on a TPU torus it is not even a neighbour link).
    """
    return hierarchical_allreduce(
        flat,
        axis_name,
        inter_algorithm="ring",
        crossed_exchange=crossed_exchange,
        divisor=divisor,
        transfer_dtype=transfer_dtype,
        exchange_piece_bytes=exchange_piece_bytes,
        unroll_limit=unroll_limit,
    )


def hierarchical_allreduce(
    flat: jax.Array,
    axis_name: tuple[str, str],
    *,
    inter_algorithm: str = "ring",
    crossed_exchange: bool = False,
    divisor: int | None = None,
    transfer_dtype=None,
    exchange_piece_bytes: int | str | None = "auto",
    unroll_limit: int = UNROLL_LIMIT,
) -> jax.Array:
    """Hierarchical allreduce on axes ``(host, local)``.

    1. reduce-scatter inside each host over the fast links (axis ``local``, L devices);
    2. allreduce across hosts over the slow links, each device carrying only 1/L of the data
       (with ``inter_algorithm``: any one-dimensional schedule; on two hosts, where that
       schedule is one pairwise swap, :func:`_crossed_pair_sum` instead when
       ``crossed_exchange=True``);
    3. all-gather inside each host.
    With ``inter_algorithm="ring"`` this is the 2-D torus schedule; the point of the name is
    the link classes: the cost model prices steps 1 and 3 on intra-host links and step 2 on
    inter-host links. On two devices per host with a ring across hosts, step 3 is
    interleaved with the ring's all-gather (:func:`_torus_pair_allreduce`).
    """
    host, local = axis_name
    if inter_algorithm in TWO_LEVEL or inter_algorithm not in ALGORITHMS:
        raise ValueError(
            f"hierarchical: inter_algorithm must be a one-dimensional schedule "
            f"{tuple(a for a in ALGORITHMS if a not in TWO_LEVEL)}, got {inter_algorithm!r}"
        )
    opts = dict(
        transfer_dtype=transfer_dtype,
        exchange_piece_bytes=exchange_piece_bytes,
        unroll_limit=unroll_limit,
    )
    wire = Wire(transfer_dtype, exchange_piece_bytes)
    if gathers_across_pair(axis_size(host), axis_size(local), inter_algorithm, crossed_exchange):
        buffer = _windowed(flat, 2 * axis_size(host))
        summed = _torus_pair_allreduce(buffer, axis_name, wire, unroll_limit, divisor)
        return _cut(summed, flat.size)
    buffer = _windowed(flat, axis_size(local))
    (host_sum,) = _ring_reduce_scatter(buffer, local, (1,), wire, unroll_limit)
    if uses_crossed_exchange(axis_size(host), axis_size(local), inter_algorithm, crossed_exchange):
        full_sum = _crossed_pair_sum(host_sum, axis_name, wire)
    else:
        full_sum = _SCHEDULES[inter_algorithm](host_sum, host, **opts)
    gathered = _gather_windows(
        full_sum, local, buffer.size, wire, unroll_limit, into=buffer, divisor=divisor
    )
    return _cut(gathered, flat.size)


def halving_doubling_allreduce(
    flat: jax.Array,
    axis_name: AxisName,
    *,
    divisor: int | None = None,
    transfer_dtype=None,
    exchange_piece_bytes: int | str | None = "auto",
    unroll_limit: int = UNROLL_LIMIT,
) -> jax.Array:
    """Recursive halving-doubling (Rabenseifner), for a power-of-two number of devices.

    Reduce-scatter by recursive halving: at distances d = p/2, p/4, ..., 1 each device swaps
    half of its current segment with partner ``i XOR d`` (keeping the half its bit selects)
    and adds what it receives. Then all-gather by recursive doubling: at d = 1, 2, ..., p/2
    partners swap their segments and concatenate them in order. 2·log2(p) steps in all,
    always unrolled (segment shapes halve and double, so every step has its own shapes).

    A segment of odd length splits into two halves that share its middle element: both
    partners reduce it, and the doubling takes it from the upper half only, so every device
    ends with the same bits and nothing is ever padded (see :func:`_window_stride`).
    """
    del unroll_limit
    p = axis_size(axis_name)
    if p & (p - 1):
        raise ValueError(
            f"halving_doubling needs a power-of-two number of devices along {axis_name!r}, "
            f"got {p}; use 'ring' or 'bidirectional_ring' for this axis"
        )
    i = lax.axis_index(axis_name)
    wire = Wire(transfer_dtype, exchange_piece_bytes)
    segment, sizes = flat, []

    d = p // 2
    while d >= 1:  # recursive halving
        sizes.append(segment.size)
        half, length = segment.size // 2, segment.size - segment.size // 2
        upper = (i // d) % 2  # 1: keep the upper half, send the lower one
        keep = lax.dynamic_slice_in_dim(segment, upper * half, length)
        give = lax.dynamic_slice_in_dim(segment, (1 - upper) * half, length)
        segment = keep + _send(give, axis_name, [(j, j ^ d) for j in range(p)], wire)
        d //= 2

    segment = _as_sent(segment, wire)
    if p == 1:
        segment = _divided(segment, divisor)
    d = 1
    while d < p:  # recursive doubling
        upper = (i // d) % 2  # 1: my segment is the upper half of the doubled one
        theirs = _send(segment, axis_name, [(j, j ^ d) for j in range(p)], wire)
        if 2 * d == p:  # the last step writes the result: divide there, fused into the write
            segment, theirs = _divided(segment, divisor), _divided(theirs, divisor)
        # Written as one concatenation of two selects: XLA fuses it into a single pass.
        is_upper = upper == 1
        lower = jnp.where(is_upper, theirs, segment)[: sizes.pop() // 2]
        segment = jnp.concatenate([lower, jnp.where(is_upper, segment, theirs)])
        d *= 2
    return segment


def parameter_server_allreduce(
    flat: jax.Array,
    axis_name: AxisName,
    *,
    server: int = 0,
    divisor: int | None = None,
    transfer_dtype=None,
    exchange_piece_bytes: int | str | None = "auto",
    unroll_limit: int = UNROLL_LIMIT,
) -> jax.Array:
    """Parameter-server baseline: every worker sends its whole buffer to the server in turn,
    the server sums, then sends the sum back to each worker in turn. The server's link
    carries 2(p-1) full buffers, so time grows linearly with p. Always unrolled: each step
    is a different one-pair permutation."""
    del unroll_limit
    p = axis_size(axis_name)
    if not 0 <= server < p:
        raise ValueError(f"parameter_server: server must be in [0, {p}), got {server}")
    i = lax.axis_index(axis_name)
    wire = Wire(transfer_dtype, exchange_piece_bytes)  # its one-pair sends are never exchanges
    workers = [w for w in range(p) if w != server]
    total = flat
    for w in workers:  # gather: a one-pair ppermute delivers zeros everywhere but the server
        total = total + _send(flat, axis_name, [(w, server)], wire)
    total = _as_sent(total, wire)
    result = jnp.where(i == server, _divided(total, divisor), jnp.zeros_like(total))
    for w in workers:  # broadcast
        result = result + _divided(_send(total, axis_name, [(server, w)], wire), divisor)
    return result


_SCHEDULES: dict[str, Callable[..., jax.Array]] = {
    "native": native_allreduce,
    "ring": ring_allreduce,
    "bidirectional_ring": bidirectional_ring_allreduce,
    "torus2d": torus2d_allreduce,
    "hierarchical": hierarchical_allreduce,
    "halving_doubling": halving_doubling_allreduce,
    "parameter_server": parameter_server_allreduce,
}
assert tuple(_SCHEDULES) == ALGORITHMS


# --------------------------------------------------------------------------- public entry point


def schedule_options(algorithm: str) -> tuple[str, ...]:
    """The keyword options ``algorithm``'s schedule takes (read off its signature), except
    ``divisor``, which :func:`allreduce` sets from ``op``."""
    if algorithm not in _SCHEDULES:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    parameters = inspect.signature(_SCHEDULES[algorithm]).parameters.values()
    return tuple(
        p.name
        for p in parameters
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "divisor"
    )


def option_default(algorithm: str, option: str) -> Any:
    """The default value of ``algorithm``'s keyword ``option`` (read off its signature)."""
    if option not in schedule_options(algorithm):
        raise ValueError(f"allreduce algorithm {algorithm!r} has no option {option!r}")
    return inspect.signature(_SCHEDULES[algorithm]).parameters[option].default


def _check_axis_name(axis_name: AxisName, algorithm: str) -> int:
    if algorithm in TWO_LEVEL:
        if not (isinstance(axis_name, tuple) and len(axis_name) == 2):
            raise ValueError(
                f"{algorithm} needs a tuple of two axis names (outer, inner), e.g. ('y', 'x'); "
                f"got {axis_name!r}"
            )
        for axis in axis_name:
            axis_size(axis)
    elif not isinstance(axis_name, str | tuple):
        raise TypeError(f"axis_name must be a str or a tuple of str, got {axis_name!r}")
    return axis_size(axis_name)


def allreduce(
    x: Any,
    axis_name: AxisName,
    algorithm: str = "ring",
    *,
    op: str = "sum",
    transfer_dtype: Any = None,
    accumulate_dtype: Any = None,
    **options: Any,
) -> Any:
    """Sum (or mean) ``x`` over ``axis_name`` with the chosen schedule; call inside shard_map.

    Args:
      x: an array or a pytree of arrays; every leaf keeps its shape and dtype. Leaves of one
        dtype are fused into one contiguous buffer and reduced with one schedule (``native``
        passes all leaves to one psum instead: XLA's all-reduce combiner fuses them itself).
      axis_name: one mesh axis, a tuple acting as one flattened axis, or for ``torus2d`` and
        ``hierarchical`` a tuple ``(outer, inner)``.
      algorithm: one of :data:`ALGORITHMS`.
      op: ``"sum"`` or ``"mean"``.
      transfer_dtype: dtype the messages travel in (e.g. ``jnp.bfloat16``); default: the
        accumulation dtype.
      accumulate_dtype: dtype partial sums are kept in (e.g. ``jnp.float32`` for bf16 leaves);
        default: each leaf's own dtype.
      **options: schedule options: ``exchange_piece_bytes`` (every schedule; the largest
        message a pairwise exchange, or a step of the bidirectional ring, sends at once,
        default ``"auto"``: see :func:`default_exchange_piece_bytes`), ``unroll_limit`` (all
        ring-based schedules),
        ``inter_algorithm`` (hierarchical), ``crossed_exchange`` (torus2d and hierarchical,
        default off; see :func:`_crossed_pair_sum`), ``server``
        (parameter_server).
    """
    if algorithm not in _SCHEDULES:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if "divisor" in options:
        raise TypeError("allreduce: pass op='mean' instead of a divisor")
    if "exchange_piece_bytes" in options:  # checked here too: native and 1-device axes never send
        _piece_bytes(options["exchange_piece_bytes"])
    count = _check_axis_name(axis_name, algorithm)

    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    for leaf in leaves:
        if not (
            jnp.issubdtype(leaf.dtype, jnp.floating) or jnp.issubdtype(leaf.dtype, jnp.integer)
        ):
            raise TypeError(f"allreduce works on float and integer arrays, got dtype {leaf.dtype}")
        if op == "mean" and not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(f"op='mean' needs floating-point leaves, got dtype {leaf.dtype}")
    if (
        op == "mean"
        and accumulate_dtype is not None
        and not jnp.issubdtype(jnp.dtype(accumulate_dtype), jnp.floating)
    ):
        raise TypeError(
            f"op='mean' needs a floating-point accumulate_dtype, got {accumulate_dtype}"
        )

    if algorithm == "native":
        # psum takes the whole list in one call and XLA's all-reduce combiner fuses the leaves
        # itself: copying them into one buffer first would only add two passes over the data.
        if set(options) - {"unroll_limit", "exchange_piece_bytes"}:
            raise TypeError(f"allreduce algorithm 'native': bad options {options}")
        acc = [leaf.astype(accumulate_dtype or leaf.dtype) for leaf in leaves]
        sent = acc if transfer_dtype is None else [a.astype(transfer_dtype) for a in acc]
        summed = [s.astype(a.dtype) for s, a in zip(lax.psum(sent, axis_name), acc)]
        if op == "mean":
            summed = [s / count for s in summed]
        return jax.tree.unflatten(treedef, [s.astype(x.dtype) for s, x in zip(summed, leaves)])

    schedule = _SCHEDULES[algorithm]
    # The schedule divides as it writes its result (see _divided), not in a pass after it.
    divisor = count if op == "mean" and count > 1 else None
    results: list[jax.Array | None] = [None] * len(leaves)
    by_dtype: dict[np.dtype, list[int]] = {}
    for index, leaf in enumerate(leaves):
        by_dtype.setdefault(leaf.dtype, []).append(index)
    for dtype, indices in by_dtype.items():
        acc_dtype = jnp.dtype(accumulate_dtype) if accumulate_dtype is not None else dtype
        bucket = jnp.concatenate([leaves[k].reshape(-1).astype(acc_dtype) for k in indices])
        try:
            reduced = schedule(
                bucket, axis_name, divisor=divisor, transfer_dtype=transfer_dtype, **options
            )
        except TypeError as err:
            raise TypeError(
                f"allreduce algorithm {algorithm!r}: bad options {options}: {err}"
            ) from err
        offset = 0
        for k in indices:
            size = leaves[k].size
            results[k] = reduced[offset : offset + size].reshape(leaves[k].shape).astype(dtype)
            offset += size
    return jax.tree.unflatten(treedef, results)
