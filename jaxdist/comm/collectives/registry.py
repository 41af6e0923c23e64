"""The registry of allreduce algorithms and :func:`allreduce`, the one entry point.

This is the one place algorithm names are looked up and checked: the cost model, the train
step, the benchmarks and the command line call :func:`get` (or read :data:`ALGORITHMS`)
and ask the :class:`~jaxdist.comm.collectives.algorithm.Algorithm` record what it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist.checks import is_integer
from jaxdist.comm.collectives.algorithm import COMMON_OPTIONS, Algorithm
from jaxdist.comm.collectives.bidirectional_ring import BIDIRECTIONAL_RING
from jaxdist.comm.collectives.halving_doubling import HALVING_DOUBLING
from jaxdist.comm.collectives.hierarchical import HIERARCHICAL
from jaxdist.comm.collectives.native import NATIVE
from jaxdist.comm.collectives.parameter_server import PARAMETER_SERVER
from jaxdist.comm.collectives.ring import RING
from jaxdist.comm.collectives.torus2d import TORUS2D
from jaxdist.comm.collectives.torus3d import TORUS3D
from jaxdist.comm.collectives.wire import AxisName, Run, Wire, axis_size, piece_bytes

__all__: list[str] = []  # building blocks of the package's own modules

_REGISTRY: dict[str, Algorithm] = {
    a.name: a
    for a in (
        NATIVE,
        RING,
        BIDIRECTIONAL_RING,
        TORUS2D,
        TORUS3D,
        HIERARCHICAL,
        HALVING_DOUBLING,
        PARAMETER_SERVER,
    )
}

#: Every algorithm's name, in the order tables and benchmarks list them.
ALGORITHMS: tuple[str, ...] = tuple(_REGISTRY)
#: The algorithms that run on two axes ``(outer, inner)``.
TWO_LEVEL: tuple[str, ...] = tuple(a.name for a in _REGISTRY.values() if a.levels == 2)
#: The algorithms that run on three axes ``(outer, middle, inner)``.
THREE_LEVEL: tuple[str, ...] = tuple(a.name for a in _REGISTRY.values() if a.levels == 3)


def get(name: str) -> Algorithm:
    """The :class:`Algorithm` called ``name``; a ValueError lists the names there are."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown allreduce algorithm {name!r}; expected one of {ALGORITHMS}"
        ) from None


def check_names(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple if every one is an algorithm; else a ValueError naming the unknown
    ones and the names there are."""
    unknown = [name for name in names if name not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; expected names from {ALGORITHMS}")
    return tuple(names)


def one_dimensional() -> tuple[str, ...]:
    """The algorithms that run on one axis (or a tuple of axes acting as one)."""
    return tuple(a.name for a in _REGISTRY.values() if a.levels == 1)


def common_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options every schedule takes (:data:`COMMON_OPTIONS`) among ``options``, defaults
    filled in and checked: ``exchange_piece_bytes`` (checked even for ``native``, which sends
    no pieces) and ``unroll_limit``, an integer >= 0."""
    common = {**COMMON_OPTIONS, **{k: v for k, v in options.items() if k in COMMON_OPTIONS}}
    piece_bytes(common["exchange_piece_bytes"])
    limit = common["unroll_limit"]
    if not is_integer(limit) or limit < 0:
        raise ValueError(f"unroll_limit must be an integer >= 0, got {limit!r}")
    return common


def _axis_sizes(axis_name: AxisName, algorithm: Algorithm) -> tuple[int, ...]:
    """The sizes of the axes ``algorithm`` runs on: one per level (``(outer, inner)`` for a
    two-level one), ``(p,)`` for the one-dimensional ones."""
    if algorithm.levels > 1:
        if not (isinstance(axis_name, tuple) and len(axis_name) == algorithm.levels):
            example = ("z", "y", "x")[-algorithm.levels :]
            raise ValueError(
                f"{algorithm.name} needs a tuple of {algorithm.axes_needed('axis names')}, "
                f"e.g. {example}; got {axis_name!r}"
            )
        return tuple(axis_size(axis) for axis in axis_name)
    if not isinstance(axis_name, str | tuple):
        raise TypeError(f"axis_name must be a str or a tuple of str, got {axis_name!r}")
    return (axis_size(axis_name),)


def _check_leaves(leaves: list[jax.Array], op: str, accumulate_dtype: Any) -> None:
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


def _native(leaves, axis_name, op, count, transfer_dtype, accumulate_dtype) -> list[jax.Array]:
    """psum takes the whole list in one call and XLA's all-reduce combiner fuses the leaves
    itself: copying them into one buffer first would only add two passes over the data."""
    acc = [leaf.astype(accumulate_dtype or leaf.dtype) for leaf in leaves]
    sent = acc if transfer_dtype is None else [a.astype(transfer_dtype) for a in acc]
    summed = [s.astype(a.dtype) for s, a in zip(lax.psum(sent, axis_name), acc)]
    if op == "mean":
        summed = [s / count for s in summed]
    return [s.astype(x.dtype) for s, x in zip(summed, leaves)]


def pack(leaves: Sequence[jax.Array], dtype: Any = None, size: int | None = None) -> jax.Array:
    """``leaves`` flattened into one contiguous buffer of ``size`` elements (default: just
    theirs; the rest stays zero) in ``dtype`` (default: the first leaf's), each written in
    place into a zero buffer.

    A ``jnp.concatenate`` of the flattened leaves would do the same, but XLA fuses the
    reshapes into the concatenation, and XLA:CPU then copies multi-dimensional operands element
    by element: a VGG head's six gradients (124M floats) took 7.1 s to concatenate on one CPU
    device, the same leaves flat 0.28 s, and written into a zero buffer 0.18 s
    (benchmarks/results/NOTES_hybrid.md)."""
    dtype = jnp.dtype(dtype or (leaves[0].dtype if leaves else jnp.float32))
    needed = sum(int(np.prod(leaf.shape)) for leaf in leaves)
    if size is not None and size < needed:
        raise ValueError(f"pack: {needed} elements do not fit in a buffer of {size}")
    buffer = jnp.zeros((needed if size is None else size,), dtype)
    offset = 0
    for leaf in leaves:
        buffer = lax.dynamic_update_slice(buffer, leaf.reshape(-1).astype(dtype), (offset,))
        offset += int(np.prod(leaf.shape))
    return buffer


def _by_dtype(leaves, algorithm, axis_name, run, accumulate_dtype, options) -> list[jax.Array]:
    """Fuse the leaves of each dtype into one flat buffer, run the schedule once per buffer,
    and cut the result back into leaves."""
    results: list[jax.Array | None] = [None] * len(leaves)
    by_dtype: dict[np.dtype, list[int]] = {}
    for index, leaf in enumerate(leaves):
        by_dtype.setdefault(leaf.dtype, []).append(index)
    for dtype, indices in by_dtype.items():
        acc_dtype = jnp.dtype(accumulate_dtype) if accumulate_dtype is not None else dtype
        bucket = pack([leaves[k] for k in indices], acc_dtype)
        reduced = algorithm.schedule(bucket, axis_name, run, **options)
        offset = 0
        for k in indices:
            size = leaves[k].size
            results[k] = reduced[offset : offset + size].reshape(leaves[k].shape).astype(dtype)
            offset += size
    return results


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
      axis_name: one mesh axis, a tuple acting as one flattened axis, for ``torus2d`` and
        ``hierarchical`` a tuple ``(outer, inner)``, for ``torus3d`` ``(outer, middle,
        inner)``.
      algorithm: one of :data:`ALGORITHMS`.
      op: ``"sum"`` or ``"mean"``.
      transfer_dtype: dtype the messages travel in (e.g. ``jnp.bfloat16``); default: the
        accumulation dtype.
      accumulate_dtype: dtype partial sums are kept in (e.g. ``jnp.float32`` for bf16 leaves);
        default: each leaf's own dtype.
      **options: ``exchange_piece_bytes`` (every schedule; the largest message a pairwise
        exchange, or a step of the bidirectional ring, sends at once, default ``"auto"``: see
        :func:`~jaxdist.comm.collectives.default_exchange_piece_bytes`), ``unroll_limit``
        (steps unrolled before a schedule loops), and each algorithm's own
        (:attr:`Algorithm.options`): ``inter_algorithm`` (hierarchical),
        ``crossed_exchange`` (torus2d and hierarchical), ``server`` (parameter_server).
    """
    chosen = get(algorithm)
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if "divisor" in options:
        raise TypeError("allreduce: pass op='mean' instead of a divisor")
    own_options = chosen.resolve(options)
    common = common_options(options)
    sizes = _axis_sizes(axis_name, chosen)
    reason = chosen.unsupported(sizes, **own_options)
    if reason:
        raise ValueError(f"allreduce {algorithm!r} over {axis_name!r}: {reason}")
    count = int(np.prod(sizes))

    leaves, treedef = jax.tree.flatten(x)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    _check_leaves(leaves, op, accumulate_dtype)
    if chosen.name == NATIVE.name:
        results = _native(leaves, axis_name, op, count, transfer_dtype, accumulate_dtype)
        return jax.tree.unflatten(treedef, results)
    # The schedule divides as it writes its result, not in a pass after it.
    run = Run(
        wire=Wire(transfer_dtype, common["exchange_piece_bytes"]),
        unroll_limit=common["unroll_limit"],
        divisor=count if op == "mean" and count > 1 else None,
    )
    results = _by_dtype(leaves, chosen, axis_name, run, accumulate_dtype, own_options)
    return jax.tree.unflatten(treedef, results)
