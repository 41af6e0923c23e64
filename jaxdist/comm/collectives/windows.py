"""Window arithmetic: how the ring schedules cut a buffer of any size into equal pieces.

A ppermute needs every device's message to have the same shape, but an axis of ``p``
devices rarely divides a gradient bucket. Instead of padding, the ring schedules reduce
``count`` *windows* of equal length: window ``k`` starts at ``k * stride`` and the last one
ends at the buffer's end, so consecutive windows may overlap::

    |<- stride ->|<- stride ->|<- stride ->|
    [ window 0         ]
                 [ window 1         ]
                          [ window 2 (starts shift early) ]
                                                          ^ size

Elements two windows share are summed twice, but the all-gather writes each window's first
``stride`` elements (the last window's from its ``shift``-th on), so every element of the
result comes from exactly one window and every device ends with the same bits. Nothing is
padded and nothing is cut back: a pad and a cut would each cost a pass over the data, and
together they kept XLA:CPU from writing the result over a donated input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.comm.collectives.wire import pad_to_chunks

__all__: list[str] = []  # building blocks of the package's own modules

# Windows start on multiples of this many elements (64 bytes of float32) when they are at least
# that long: XLA:CPU reads and writes windows that start and end aligned measurably faster.
WINDOW_ALIGNMENT = 16


def window_stride(size: int, count: int) -> int:
    """Where the ``count`` windows of a buffer of ``size`` elements start: window ``k`` at
    ``k * stride``, except the last, which ends at ``size`` (their length:
    :func:`window_length`).

    The stride is rounded down to a multiple of ``WINDOW_ALIGNMENT`` (the overlap grows by
    less than ``count * WINDOW_ALIGNMENT`` elements). A gather by concatenation uses
    :func:`whole_window_stride` instead, where only the last window overlaps.
    """
    if 0 < size < count:
        raise ValueError(f"{size} elements cannot be cut into {count} windows; pad first")
    stride = size // count
    return stride - stride % WINDOW_ALIGNMENT if stride >= WINDOW_ALIGNMENT else stride


def window_length(size: int, count: int, stride: int) -> int:
    """How long the ``count`` windows starting ``stride`` apart are: long enough for the last to
    reach ``size``, and, when the stride is aligned, rounded up to a multiple of
    ``WINDOW_ALIGNMENT``; never shorter than the stride, which a stride from
    :func:`whole_window_stride` needs (its last window is a stride long as well). The last
    window then starts ``shift`` elements early, at ``size - length``
    (:func:`last_window_shift`)."""
    length = size - (count - 1) * stride
    aligned = stride >= WINDOW_ALIGNMENT and stride % WINDOW_ALIGNMENT == 0
    if aligned and length % WINDOW_ALIGNMENT:
        # min: only one window (count 1) could pass the end; more start early instead.
        length = min(size, length - length % WINDOW_ALIGNMENT + WINDOW_ALIGNMENT)
    length = max(length, stride)
    if length > size or (count - 1) * stride > size:
        raise ValueError(f"{count} windows {stride} apart do not fit in {size} elements")
    return length


def whole_window_stride(size: int, count: int) -> int | None:
    """A stride for windows that do not overlap but for the last: every window ``stride``
    elements long (the quotient rounded up, aligned when at least ``WINDOW_ALIGNMENT``), the
    last one starting early to end at ``size``; None when the first ``count - 1`` windows
    would not fit.

    For a gather by concatenation: every block but the last then enters whole, where the
    default stride cut a slice off each one, and XLA:CPU turns a concatenation of slices into
    a slower loop.
    """
    length = -(-size // count)
    if length >= WINDOW_ALIGNMENT:
        length += -length % WINDOW_ALIGNMENT
    return length if length <= size and (count - 1) * length <= size else None


def last_window_shift(size: int, count: int, stride: int, length: int) -> int:
    """How far before ``(count - 1) * stride`` the last window starts (it ends at ``size``)."""
    return length - (size - (count - 1) * stride)


def window_head(block: jax.Array, stride: int, shift: int, is_last) -> jax.Array:
    """The ``stride`` elements of a window's ``block`` that an all-gather writes at the
    window's start: from the ``shift``-th for the last window, which starts ``shift`` elements
    early (:func:`window_length`). ``is_last``: whether the block is the last window (traced),
    or None where it cannot be."""
    if shift and is_last is not None:
        return lax.dynamic_slice_in_dim(block, jnp.where(is_last, shift, 0), stride)
    return block[:stride]


def windowed(flat: jax.Array, count: int) -> jax.Array:
    """``flat`` itself when it has at least ``count`` elements (enough for :func:`window_stride`),
    else zero-padded to ``count``: the ring schedules then cut the padding off their result."""
    return flat if flat.size >= count else pad_to_chunks(flat, count)


def cut(gathered: jax.Array, size: int) -> jax.Array:
    """The first ``size`` elements of ``gathered``: the padding of a buffer too small for
    windows (:func:`windowed`) cut off again, and no slice at all otherwise."""
    return gathered if gathered.size == size else gathered[:size]
