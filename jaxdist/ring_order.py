"""Device orders whose rings take short hops on a TPU slice without wraparound links.

A ring along a mesh axis sends from each device to the next and from the last back to the
first. Laid over a line of chips in physical order, that closing edge crosses the whole line.
TPU v5e slices have no wraparound links, and their compiler makes every collective permute
with such a long edge synchronous: a ring of 8 or more chips in physical order then hides no
communication at all. Folding the line (0, 2, 4, …, 5, 3, 1) keeps every hop at most 2
chips long, and a ring over a 2-D block of chips can follow a Hamiltonian cycle with every
hop 1 chip long; the compiler keeps both asynchronous. TPU v4, v5p and v6e slices keep a
plain ring asynchronous, so their order is left as it is: folding would only make each hop
longer.

:func:`short_hop_grid` applies this to a device grid, one mesh axis at a time; the same
index order serves every line along the axis, so the grid stays a mesh.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "short_hop_grid",
]

# Device kinds whose compiler makes a permute synchronous when a hop crosses the slice
# (checked with the TPU compiler on v4, v5e, v5p and v6e slices of 16 to 256 chips).
NO_WRAPAROUND_KINDS = ("TPU v5 lite",)


def fold(n: int) -> list[int]:
    """A line of ``n`` positions folded into a ring: the even ones out, the odd ones back.
    Every hop is at most 2 positions long, the closing one included."""
    return list(range(0, n, 2)) + [i for i in range(n - 1, 0, -1) if i % 2]


def longest_hop(grid: np.ndarray, axis: int) -> int:
    """The longest hop (in chips, along the slice's links, no wraparound) between ring
    neighbours along ``axis`` of a TPU device grid, the closing edge included."""
    coords = _coords(grid)
    line = np.moveaxis(coords, axis, -2)  # [..., n, 3]
    step = np.abs(np.roll(line, -1, axis=-2) - line).sum(-1)
    return int(step.max()) if step.size else 0


def short_hop_grid(grid: np.ndarray) -> np.ndarray:
    """``grid`` with each axis reordered so that its rings take short hops, on devices whose
    slices have no wraparound links (:data:`NO_WRAPAROUND_KINDS`); any other grid as given."""
    first = grid.reshape(-1)[0]
    if getattr(first, "platform", "") != "tpu" or first.device_kind not in NO_WRAPAROUND_KINDS:
        return grid
    for axis in range(grid.ndim):
        if grid.shape[axis] < 4:  # a ring of 3 on a line already has hops of at most 2
            continue
        order = _ring_order(grid, axis)
        if order is None:
            continue
        candidate = np.take(grid, order, axis=axis)
        if longest_hop(candidate, axis) < longest_hop(grid, axis):
            grid = candidate
    return grid


def _coords(grid: np.ndarray) -> np.ndarray:
    """Physical chip coordinates of every device, shape ``grid.shape + (3,)``; devices of
    different slices are put far apart, as no ICI link joins them."""
    flat = grid.reshape(-1)
    coords = np.array([list(d.coords) + [0] * (3 - len(d.coords)) for d in flat], np.int64)
    slices = np.array([getattr(d, "slice_index", 0) or 0 for d in flat], np.int64)
    coords[:, 0] += slices * 1_000_000
    return coords.reshape(*grid.shape, 3)


def _ring_order(grid: np.ndarray, axis: int) -> list[int] | None:
    """An order of ``axis``'s indices whose ring takes short hops (a folded line, or a
    Hamiltonian cycle of a 2-D block), read from the first line along the axis; None where
    this module has no such order (a 3-D block, a block of odd sides, a partial block)."""
    line = _coords(_first_line(grid, axis))
    # Each chip's rank among the line's distinct coordinates in each dimension, so that a line
    # over columns 0 and 8 is still a block of 2 columns.
    ranks = np.stack([np.unique(line[:, d], return_inverse=True)[1] for d in range(3)], -1)
    extent = ranks.max(0) + 1
    varying = [d for d in range(3) if extent[d] > 1]
    if int(np.prod(extent)) != len(line):  # not a full block of chips
        return None
    position = {tuple(r): i for i, r in enumerate(ranks)}
    if len(varying) == 1:
        (d,) = varying
        by_rank = sorted(range(len(line)), key=lambda i: ranks[i, d])
        return [by_rank[i] for i in fold(len(line))]
    if len(varying) == 2:
        rows_dim, cols_dim = varying
        if extent[rows_dim] % 2:
            rows_dim, cols_dim = cols_dim, rows_dim
        if extent[rows_dim] % 2:
            return None
        cycle = _hamiltonian_cycle(int(extent[rows_dim]), int(extent[cols_dim]))
        order = []
        for r, c in cycle:
            key = [0, 0, 0]
            key[rows_dim], key[cols_dim] = r, c
            order.append(position[tuple(key)])
        return order
    return None


def _first_line(grid: np.ndarray, axis: int) -> np.ndarray:
    """The devices along ``axis`` at index 0 of every other axis."""
    index = [0] * grid.ndim
    index[axis] = slice(None)
    return grid[tuple(index)]


def _hamiltonian_cycle(rows: int, cols: int) -> list[tuple[int, int]]:
    """A cycle through every cell of a ``rows`` × ``cols`` grid (``rows`` even) moving one
    cell at a time: snake over columns 1… row by row, then back up column 0."""
    cycle = []
    for r in range(rows):
        columns = range(1, cols) if r % 2 == 0 else range(cols - 1, 0, -1)
        cycle.extend((r, c) for c in columns)
    cycle.extend((r, 0) for r in range(rows - 1, -1, -1))
    return cycle
