"""How a schedule's messages travel: one ppermute step, sent whole or in pieces, optionally in
a narrower dtype, and the few helpers every schedule shares (the mean's division, a step
round the ring, unrolled or looped steps)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.checks import positive_int

__all__: list[str] = []  # building blocks of the package's own modules

AxisName = str | tuple[str, ...]

# Schedules with more steps than this run their steps in a ``lax.fori_loop`` instead of
# unrolling them, so compile time stays flat as the axis grows.
UNROLL_LIMIT = 16

# Over gloo a pairwise exchange goes in pieces of this many bytes, and a step of the
# bidirectional ring in pieces of the second size (see default_exchange_piece_bytes; the
# sizes were chosen by measurement on emulated hosts:
# benchmarks/results/NOTES_emulated_hosts.md, section 4.1).
GLOO_EXCHANGE_PIECE_BYTES = 256 << 10
GLOO_REVERSE_TRAFFIC_PIECE_BYTES = 512 << 10
# More pieces than this go in a fori_loop, which keeps compile time flat.
_UNROLLED_PIECES = 4


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


class Run(NamedTuple):
    """What every schedule takes besides its buffer and axes: how its messages travel, how
    many steps it unrolls before it loops, and the divisor of a mean (``None`` for a sum)."""

    wire: Wire = Wire()
    unroll_limit: int = UNROLL_LIMIT
    divisor: int | None = None


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
    if over_gloo():
        return GLOO_REVERSE_TRAFFIC_PIECE_BYTES if reverse_traffic else GLOO_EXCHANGE_PIECE_BYTES
    return None


def over_gloo() -> bool:
    """Whether collectives run over gloo: CPU devices in several processes."""
    multi_process_cpu = jax.process_count() > 1 and jax.default_backend() == "cpu"
    return multi_process_cpu and jax.config.jax_cpu_collectives_implementation == "gloo"


def piece_bytes(piece: int | str | None, reverse_traffic: bool = False) -> int | None:
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
    piece = piece_bytes(exchange_piece_bytes, reverse_traffic and not pairwise)
    if piece is None or x.nbytes <= piece or not (pairwise or reverse_traffic):
        return lax.ppermute(x, axis_name, perm)
    flat = x.reshape(-1)
    per_piece = max(1, piece // x.dtype.itemsize)  # in elements, so no piece exceeds the bytes
    count = -(-flat.size // per_piece)
    padded = pad_to_chunks(flat, count)
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


SendHook = Callable[[Callable[[], jax.Array]], jax.Array]
_send_hooks: list[SendHook] = []


@contextlib.contextmanager
def paced_sends(hook: SendHook) -> Iterator[None]:
    """Inside this context every message step is made by ``hook(send_step)``, which calls
    ``send_step()`` and returns its result, or a value equal to it: the wait-free train step
    (:mod:`jaxdist.training.wait_free`) pauses a schedule there and ties the step to the
    backward compute it runs beside."""
    _send_hooks.append(hook)
    try:
        yield
    finally:
        _send_hooks.pop()


def send(x: jax.Array, axis_name: AxisName, perm: list[tuple[int, int]], wire: Wire) -> jax.Array:
    """One message step (:func:`permute`: one ppermute, or consecutive pieces of an exchange),
    optionally sent in a narrower dtype and widened again on arrival."""
    narrow = wire.dtype is not None and jnp.dtype(wire.dtype) != x.dtype
    sent = x.astype(wire.dtype) if narrow else x

    def send_step() -> jax.Array:
        return permute(
            sent,
            axis_name,
            perm,
            exchange_piece_bytes=wire.exchange_piece_bytes,
            reverse_traffic=wire.reverse_traffic,
        )

    received = _send_hooks[-1](send_step) if _send_hooks else send_step()
    return received.astype(x.dtype) if narrow else received


def as_sent(x: jax.Array, wire: Wire) -> jax.Array:
    """``x`` rounded as :func:`send` would round it. A device keeps its own copy of a reduced
    chunk in this form so that every device ends with the same bits, whichever one reduced it."""
    if wire.dtype is None or jnp.dtype(wire.dtype) == x.dtype:
        return x
    return x.astype(wire.dtype).astype(x.dtype)


def divided(x: jax.Array, divisor: int | None) -> jax.Array:
    """``x / divisor``, the mean's division, or ``x`` itself when ``divisor`` is None.

    Schedules divide where they write their result anyway (each chunk as the all-gather
    places it, or each shard before it is sent), so that a mean costs no extra pass over the
    buffer. A division in a pass of its own after the schedule also kept XLA:CPU from writing
    the result over a donated input.
    """
    if divisor is None:
        return x
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"a mean needs floating-point values to divide, got dtype {x.dtype}")
    return x / divisor


def shift(x: jax.Array, axis_name: AxisName, direction: int, wire: Wire) -> jax.Array:
    """Every device sends ``x`` to its neighbour ``direction`` (+1 or -1) steps round the ring."""
    p = axis_size(axis_name)
    return send(x, axis_name, [(j, (j + direction) % p) for j in range(p)], wire)


def swap(x: jax.Array, axis_name: AxisName, wire: Wire) -> jax.Array:
    """The two devices of an axis of two exchange ``x``."""
    return send(x, axis_name, [(0, 1), (1, 0)], wire)


def repeat(num_steps: int, step: Callable, carry: Any, unroll_limit: int) -> Any:
    """``carry = step(s, carry)`` for ``s`` in ``range(num_steps)``: unrolled when short (XLA
    can then schedule across steps), a ``fori_loop`` when long (bounded compile time)."""
    if num_steps <= unroll_limit:
        for s in range(num_steps):
            carry = step(s, carry)
        return carry
    return lax.fori_loop(0, num_steps, step, carry)


def pad_to_chunks(flat: jax.Array, p: int) -> jax.Array:
    """Zero-pad a flat buffer to ``p`` equal chunks (a no-op when ``p`` divides its size)."""
    padded_size = p * -(-flat.size // p)
    return flat if padded_size == flat.size else jnp.pad(flat, (0, padded_size - flat.size))
