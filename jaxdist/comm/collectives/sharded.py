"""The allreduce's two halves as collectives of their own: reduce-scatter and all-gather with a
schedule of the family.

Every permute allreduce here is a reduce-scatter followed by an all-gather. Sharded training
(ZeRO-1, FSDP) needs the halves apart: gradients are reduce-scattered into the shard that owns
them, parameters all-gathered before use. Both functions run inside ``jax.shard_map`` on a
flat buffer cut into ``p`` equal chunks, one per device; device ``i`` -- its index over
``axis_name`` in mesh order, as ``lax.axis_index`` counts it -- owns chunk ``i``, exactly as
``lax.psum_scatter(..., tiled=True)`` and ``lax.all_gather(..., tiled=True)`` lay them out:

======================  =====================================================================
algorithm               reduce-scatter (the all-gather runs the same steps backwards)
======================  =====================================================================
``native``              XLA's own ``psum_scatter`` / ``all_gather`` (over gloo, ``psum`` and
                        this device's chunk of the sum)
``ring``                ``p - 1`` steps round one ring
``bidirectional_ring``  two rings at once, one each way round, each on half of every chunk
``torus2d``             inner ring on the whole buffer, then outer ring on ``1/X`` of it
``torus3d``             inner, then middle, then outer ring, each on what the last left
``hierarchical``        inner ring inside hosts, then ``inter_algorithm`` across hosts (a
                        ring, one way or both)
======================  =====================================================================

On several axes the reduce-scatter goes inner axis first: the inner ring hands each inner
position the chunks it will own (every outer position's), summed over the inner axis, and the
outer axes scatter what is left -- ``(X - 1) + (Y - 1)`` steps, each device sending
``(XY - 1) / XY`` of the buffer, the flat ring's bandwidth at far fewer latencies. The
all-gather is the same in reverse, outer axis first.

The other schedules of the family (halving-doubling, the parameter server, the crossed
exchange) have no half that leaves chunks in this layout, and are refused in one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist.comm.collectives.algorithm import Term, flat_link_class
from jaxdist.comm.collectives.registry import _axis_sizes, common_options, get
from jaxdist.comm.collectives.ring_steps import (
    gather_windows,
    ring_all_gather,
    ring_reduce_scatter,
)
from jaxdist.comm.collectives.wire import (
    AxisName,
    Wire,
    axis_size,
    divided,
    over_gloo,
    pad_to_chunks,
)

__all__ = [
    "SHARDED_ALGORITHMS",
    "all_gather",
    "reduce_scatter",
    "sharded_terms",
    "sharded_unsupported",
]

SHARDED_ALGORITHMS: tuple[str, ...] = (
    "native",
    "ring",
    "bidirectional_ring",
    "torus2d",
    "torus3d",
    "hierarchical",
)

# The rings hierarchical may run across hosts for its halves.
_ACROSS_HOSTS = ("ring", "bidirectional_ring")

OneAxis = Callable[[jax.Array, AxisName], jax.Array]


# --------------------------------------------------------------------------- one axis


def _ring_scatter(wire: Wire, unroll_limit: int) -> OneAxis:
    def scatter(buffer: jax.Array, axis: AxisName) -> jax.Array:
        p = axis_size(axis)
        if p == 1:
            return buffer
        (shard,) = ring_reduce_scatter(
            buffer, axis, (1,), wire, unroll_limit, stride=buffer.size // p
        )
        return shard

    return scatter


def _ring_gather(wire: Wire, unroll_limit: int) -> OneAxis:
    def gather(shard: jax.Array, axis: AxisName) -> jax.Array:
        size = axis_size(axis) * shard.size
        return gather_windows(shard, axis, size, wire, unroll_limit, stride=shard.size)

    return gather


def _second_half_order(p: int) -> np.ndarray:
    """Which chunk's second half window ``w`` of the counter-clockwise ring holds: that ring's
    device at position ``w`` is device ``-w mod p``, and it must end with its own chunk."""
    return (-np.arange(p)) % p


def _bidirectional_scatter(wire: Wire, unroll_limit: int) -> OneAxis:
    """Clockwise on the first half of every chunk, counter-clockwise on the second half."""
    ring = _ring_scatter(wire, unroll_limit)
    wire = wire._replace(reverse_traffic=True)

    def scatter(buffer: jax.Array, axis: AxisName) -> jax.Array:
        p = axis_size(axis)
        chunk = buffer.size // p
        if p <= 2 or chunk % 2:  # one neighbour either way, or no halves: the plain ring
            return ring(buffer, axis)
        halves = buffer.reshape(p, 2, chunk // 2)
        lanes = jnp.concatenate(
            [halves[:, 0].reshape(-1), halves[_second_half_order(p), 1].reshape(-1)]
        )
        first, second = ring_reduce_scatter(
            lanes, axis, (1, -1), wire, unroll_limit, stride=chunk // 2
        )
        return jnp.concatenate([first, second])

    return scatter


def _bidirectional_gather(wire: Wire, unroll_limit: int) -> OneAxis:
    ring = _ring_gather(wire, unroll_limit)
    wire = wire._replace(reverse_traffic=True)

    def gather(shard: jax.Array, axis: AxisName) -> jax.Array:
        p = axis_size(axis)
        if p <= 2 or shard.size % 2:
            return ring(shard, axis)
        half = shard.size // 2
        lanes = ring_all_gather(
            [shard[:half], shard[half:]],
            axis,
            (1, -1),
            wire,
            unroll_limit,
            size=2 * p * half,
            stride=half,
        )
        lanes = lanes.reshape(2, p, half)
        # Chunk c's second half sits in window w with -w = c (mod p): the same map, inverted.
        second = lanes[1][_second_half_order(p)]
        return jnp.stack([lanes[0], second], axis=1).reshape(-1)

    return gather


# --------------------------------------------------------------------------- levels


def _scatter_levels(buffer: jax.Array, axes: tuple[str, ...], scatter_one: list[OneAxis]):
    """Reduce-scatter over ``axes`` (outer to inner), the inner axis first: chunks are laid out
    ``(outer..., inner, c)``, so the inner axis first groups each inner position's chunks."""
    if len(axes) == 1:
        return scatter_one[0](buffer, axes[0])
    *rest, inner = axes
    x, outer = axis_size(inner), math.prod(axis_size(a) for a in rest)
    grouped = buffer.reshape(outer, x, -1).transpose(1, 0, 2).reshape(-1)
    mine = scatter_one[-1](grouped, inner)  # every outer chunk with my inner index
    return _scatter_levels(mine, tuple(rest), scatter_one[:-1])


def _gather_levels(shard: jax.Array, axes: tuple[str, ...], gather_one: list[OneAxis]):
    """All-gather over ``axes`` (outer to inner): the reverse of :func:`_scatter_levels`."""
    if len(axes) == 1:
        return gather_one[0](shard, axes[0])
    *rest, inner = axes
    x, outer = axis_size(inner), math.prod(axis_size(a) for a in rest)
    mine = _gather_levels(shard, tuple(rest), gather_one[:-1])
    gathered = gather_one[-1](mine, inner)
    return gathered.reshape(x, outer, -1).transpose(1, 0, 2).reshape(-1)


def _level_schedules(
    algorithm: str, axis_name: AxisName, options: dict, wire: Wire, unroll_limit: int, scatter: bool
) -> tuple[tuple, list[OneAxis]]:
    """The axes the halves run over level by level, and the one-axis schedule of each."""
    ring = (_ring_scatter if scatter else _ring_gather)(wire, unroll_limit)
    both_ways = (_bidirectional_scatter if scatter else _bidirectional_gather)(wire, unroll_limit)
    if algorithm == "ring":
        return (axis_name,), [ring]
    if algorithm == "bidirectional_ring":
        return (axis_name,), [both_ways]
    if algorithm == "hierarchical":
        across = both_ways if options.get("inter_algorithm") == "bidirectional_ring" else ring
        return tuple(axis_name), [across, ring]
    return tuple(axis_name), [ring] * len(axis_name)  # torus2d, torus3d


# --------------------------------------------------------------------------- the collectives


def sharded_unsupported(algorithm: str, axis_sizes: tuple[int, ...], **options: Any) -> str | None:
    """Why ``algorithm`` has no reduce-scatter and all-gather over ``axis_sizes``, or None."""
    if algorithm not in SHARDED_ALGORITHMS:
        return (
            f"{algorithm} has no reduce-scatter and all-gather of its own; those that do: "
            f"{', '.join(SHARDED_ALGORITHMS)}"
        )
    chosen = get(algorithm)
    own = chosen.resolve({k: v for k, v in options.items() if k in chosen.options})
    if algorithm == "hierarchical" and own["inter_algorithm"] not in _ACROSS_HOSTS:
        return (
            f"hierarchical's halves run {' or '.join(_ACROSS_HOSTS)} across hosts, got "
            f"inter_algorithm={own['inter_algorithm']!r}"
        )
    return chosen.unsupported(axis_sizes, **own)


def _prepared(algorithm: str, axis_name: AxisName, options: dict) -> tuple[Wire, int, dict]:
    """The wire, unroll limit and own options of ``algorithm`` over ``axis_name``; a
    ValueError says why it cannot run there."""
    transfer_dtype = options.pop("transfer_dtype", None)
    chosen = get(algorithm)
    own = chosen.resolve(options)
    common = common_options(options)
    sizes = _axis_sizes(axis_name, chosen)
    reason = sharded_unsupported(algorithm, sizes, **own)
    if reason:
        raise ValueError(f"{algorithm} over {axis_name!r}: {reason}")
    return Wire(transfer_dtype, common["exchange_piece_bytes"]), common["unroll_limit"], own


def reduce_scatter(
    x: jax.Array,
    axis_name: AxisName,
    algorithm: str = "ring",
    *,
    op: str = "sum",
    **options: Any,
) -> jax.Array:
    """Sum (or mean, ``op="mean"``) ``x`` over ``axis_name`` and keep this device's chunk; call
    inside shard_map.

    ``x`` is flattened and zero-padded to ``p`` equal chunks; device ``i`` returns chunk ``i``
    of the sum, shape ``(ceil(x.size / p),)``: ``lax.psum_scatter(x, axis_name, tiled=True)``
    on the padded buffer. ``algorithm``: one of :data:`SHARDED_ALGORITHMS`; ``options``:
    ``transfer_dtype`` (the dtype messages travel in), ``exchange_piece_bytes``,
    ``unroll_limit`` and the algorithm's own, as for
    :func:`~jaxdist.comm.collectives.allreduce`.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    p = axis_size(axis_name)
    x = jnp.asarray(x)
    if algorithm == "native":
        # XLA's reduce-scatter sums in the dtype it is handed: the wire's, if one is named.
        travel = (p > 1 and options.get("transfer_dtype")) or x.dtype
        padded = pad_to_chunks(x.astype(travel).reshape(-1), p)
        shard = padded if p == 1 else _native_reduce_scatter(padded, axis_name, p)
        shard = shard.astype(x.dtype)
    else:
        padded = pad_to_chunks(x.reshape(-1), p)
        wire, unroll_limit, own = _prepared(algorithm, axis_name, options)
        axes, schedules = _level_schedules(algorithm, axis_name, own, wire, unroll_limit, True)
        shard = _scatter_levels(padded, axes, schedules)
    return divided(shard, p if op == "mean" and p > 1 else None)


def _native_reduce_scatter(padded: jax.Array, axis_name: AxisName, p: int) -> jax.Array:
    """XLA's reduce-scatter of a buffer of ``p`` chunks. Over gloo it is XLA's all-reduce and
    this device's chunk of the sum instead: once gloo's own reduce-scatter has run in a
    process, that process's later collectives on large buffers run hundreds of times slower
    (docs/collectives.md, "XLA's reduce-scatter over gloo")."""
    if not over_gloo():
        return lax.psum_scatter(padded, axis_name, tiled=True)
    chunk = padded.size // p
    total = lax.psum(padded, axis_name)
    return lax.dynamic_slice_in_dim(total, lax.axis_index(axis_name) * chunk, chunk)


# Each device's piece of XLA's own all-gather is padded to a whole number of these elements
# (the TPU's tile of a flat array): the TPU compiler turns an all-gather of pieces that end
# mid-tile into an all-reduce of a zero-filled whole-sized buffer, which holds three
# whole-sized buffers where the all-gather holds one (a 32B layer on 256 v5e chips: 5.6
# GiB against 1.9) and moves twice the bytes.
GATHER_ALIGNMENT = 1024


def all_gather_rows(
    piece: jax.Array, axis_name: AxisName, algorithm: str = "ring", **options: Any
) -> jax.Array:
    """Every device's ``piece`` (flattened), one row each in device order: ``(p,
    piece.size)``; call inside shard_map. ``algorithm`` and ``options`` as for
    :func:`all_gather`; under ``native`` each piece travels padded to whole
    :data:`GATHER_ALIGNMENT`-element tiles (the rows are the same)."""
    flat = jnp.asarray(piece).reshape(-1)
    size = flat.size
    if algorithm == "native" and size % GATHER_ALIGNMENT:
        flat = jnp.pad(flat, (0, GATHER_ALIGNMENT - size % GATHER_ALIGNMENT))
    gathered = all_gather(flat, axis_name, algorithm, **options)
    return gathered.reshape(axis_size(axis_name), -1)[:, :size]


def all_gather(
    shard: jax.Array,
    axis_name: AxisName,
    algorithm: str = "ring",
    *,
    into: jax.Array | None = None,
    divisor: int | None = None,
    **options: Any,
) -> jax.Array:
    """Every device's ``shard`` (flattened), concatenated in device order; call inside
    shard_map: ``lax.all_gather(shard, axis_name, tiled=True)`` on the flat shard.

    ``algorithm`` and ``options`` as for :func:`reduce_scatter`. Ring only: ``into``, a flat
    buffer of ``p * shard.size`` elements the result may be written over (the padded input of
    the preceding reduce-scatter, say), which spares XLA a fresh zero-filled buffer, and
    ``divisor``, divide every chunk by it as it is written (a mean at no extra pass).
    """
    flat = jnp.asarray(shard).reshape(-1)
    p = axis_size(axis_name)
    if algorithm == "native":
        gathered = flat if p == 1 else lax.all_gather(flat, axis_name, tiled=True)
        return divided(gathered, divisor)
    wire, unroll_limit, own = _prepared(algorithm, axis_name, options)
    if algorithm == "ring":
        if p == 1:
            return divided(flat, divisor)
        return gather_windows(
            flat,
            axis_name,
            p * flat.size,
            wire,
            unroll_limit,
            stride=flat.size,
            into=into,
            divisor=divisor,
        )
    axes, schedules = _level_schedules(algorithm, axis_name, own, wire, unroll_limit, False)
    return divided(_gather_levels(flat, axes, schedules), divisor)


# --------------------------------------------------------------------------- cost


def sharded_terms(algorithm: str, axis_sizes: tuple[int, ...], **options: Any) -> list[Term]:
    """The cost of one reduce-scatter (or all-gather: the same steps) of a buffer of ``S``
    bytes over ``axis_sizes`` (outer to inner): level by level from the inner axis, ``n - 1``
    steps sending ``(n - 1) / n`` of what reaches that level, which is ``1 / (the inner
    sizes)`` of the buffer. ``native`` is priced as the ring (XLA's collectives on these
    links run one)."""
    sizes = tuple(int(s) for s in axis_sizes)
    reason = None if algorithm == "native" else sharded_unsupported(algorithm, sizes, **options)
    if reason:
        raise ValueError(f"{algorithm}: {reason}")
    if algorithm in ("native", "ring", "bidirectional_ring"):
        p = math.prod(sizes)
        if p == 1:
            return []
        lanes = 2 if algorithm == "bidirectional_ring" and p > 2 else 1
        return [Term(flat_link_class(sizes), p - 1, (p - 1) / p, lanes)]
    classes = ["inter"] + ["intra"] * (len(sizes) - 1)  # the outer axis crosses hosts
    terms, reached = [], 1.0
    for size, link_class in reversed(list(zip(sizes, classes))):
        if size > 1:
            lanes = (
                2
                if (
                    algorithm == "hierarchical"
                    and link_class == "inter"
                    and size > 2
                    and options.get("inter_algorithm") == "bidirectional_ring"
                )
                else 1
            )
            terms.append(Term(link_class, size - 1, (size - 1) / size * reached, lanes))
        reached /= size
    return terms
