"""Where a sharded step keeps each parameter, and how it gathers and scatters them.

Three ways to keep a model on a mesh (:data:`SHARDINGS`):

* ``replicated``: every device holds every parameter and the whole optimizer state;
* ``zero1``: parameters replicated, optimizer state and the update sharded (ZeRO stage 1);
* ``fsdp``: parameters, gradients and optimizer state all sharded (ZeRO stage 3); each
  layer's parameters are all-gathered just before use, in forward and again in backward
  (:mod:`jaxdist.training.fsdp_pacing`), and their gradients reduce-scattered into the
  shards that own them.

Every array keeps its own shape: a sharded parameter is split along one of its dimensions
(:class:`Placement`), so its optimizer state, its checkpoint and its global shape are the same
whatever the sharding, and any optax transformation -- global-norm clipping, LARS and LAMB
trust ratios, masks by name or by shape -- sees the arrays it would see on one device; XLA
computes a norm over a sharded array as a sum over its shards. A parameter too small to be
worth splitting, or with no dimension that the shard count divides, stays replicated
(:meth:`Placement.replicated`), and says so.

Units: ZeRO-1 (and FSDP with ``keep_gathered``) gathers and scatters the sharded parameters in
units of about ``unit_bytes`` (whole parameters, in the order of the parameter tree; paced
FSDP gathers a layer's parameters together instead), one collective per unit: each
device's blocks are concatenated into one flat buffer, all-gathered with a schedule of the
family (:func:`jaxdist.comm.collectives.all_gather`) and cut back into whole parameters; the
gradients travel the same way backwards (:func:`jaxdist.comm.collectives.reduce_scatter`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdist.comm import collectives
from jaxdist.comm.scopes import GRADIENT_SCOPE, PARAMETER_SCOPE
from jaxdist.training.fsdp_pacing import paced_loss

__all__ = [
    "DEFAULT_MIN_SHARD_ELEMENTS",
    "FSDP_AXIS",
    "SHARDINGS",
    "Placement",
    "check_sharding",
    "default_shard_axes",
]

SHARDINGS = ("replicated", "zero1", "fsdp")

# The mesh axis a recipe's state is sharded over when its mesh names one (HSDP: the other axes
# are data-parallel replicas of the sharded group).
FSDP_AXIS = "fsdp"

# Parameters with fewer elements stay replicated: a bias or a norm's scale would cost a
# collective's latency to save a few hundred bytes.
DEFAULT_MIN_SHARD_ELEMENTS = 1024


def default_shard_axes(data_axes: str | tuple[str, ...]) -> str | tuple[str, ...]:
    """The axes a sharded state is split over when a step is not told: the mesh's
    :data:`FSDP_AXIS` where it is one data axis of several (HSDP: the others hold replicas
    of the sharded group), else every data axis. A recipe and a Python step on the same
    mesh get the same layout."""
    names = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    return FSDP_AXIS if FSDP_AXIS in names and len(names) > 1 else data_axes


def check_sharding(sharding: str) -> str:
    """``sharding`` if it is one of :data:`SHARDINGS`; else one line saying what it takes."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}; got {sharding!r}")
    return sharding


def _split_dimension(
    shape: tuple[int, ...], shards: int, min_elements: int, stacked: bool = False
) -> int | None:
    """The dimension a parameter of ``shape`` is split along over ``shards`` devices: the first
    that ``shards`` divides (the outermost, which needs no transpose to gather), or None. A
    ``stacked`` parameter's first dimension counts layers and is never split: each device
    keeps a slice of every layer, so a scan can gather one layer at a time."""
    per_layer = math.prod(shape[1:]) if stacked else math.prod(shape)
    if shards == 1 or per_layer < max(min_elements, shards):
        return None
    for dim in range(1 if stacked else 0, len(shape)):
        if shape[dim] % shards == 0:
            return dim
    return None


def _block_shape(shape: tuple[int, ...], tensor_dim: int | None, size: int) -> tuple[int, ...]:
    """A parameter's shape on one device of a tensor axis of ``size``."""
    if tensor_dim is None:
        return shape
    return (*shape[:tensor_dim], shape[tensor_dim] // size, *shape[tensor_dim + 1 :])


def _check_shard_dims(dims, shapes, stacked, paths, shards) -> None:
    """One line for a given split FSDP cannot keep: the stacked layers' dimension, or one
    the shard count does not divide."""
    for dim, shape, flag, path in zip(dims, shapes, stacked, paths):
        if dim is None:
            continue
        if flag and dim == 0:
            raise ValueError(
                f"{path}: dimension 0 counts scanned layers, which are gathered one at a "
                "time: FSDP splits a dimension inside the layer"
            )
        if shape[dim] % shards:
            raise ValueError(
                f"{path}: dimension {dim} ({shape[dim]} on each device) does not divide "
                f"over {shards} shards"
            )


@dataclass(frozen=True)
class Placement:
    """Where a sharded step keeps each parameter.

    Attributes:
      dims: per parameter leaf (in tree order), the dimension split over the shard axes, or
        None (replicated).
      shapes: the parameters' global shapes, in tree order.
      paths: their dotted names, for messages and plans.
      units: the gather units, lists of indices of sharded leaves.
      shards: the device count over the shard axes.
      stacked: per leaf, whether its first dimension counts scanned layers (never split).
      tensor_dims: per leaf, the dimension split over ``tensor_axis`` (tensor parallelism,
        :mod:`jaxdist.comm.tensor_parallel`), or None; ``shapes`` are then each
        device's tensor-parallel block, which FSDP splits further and gathers back.
      tensor_axis: the mesh axis of ``tensor_dims``, or None.
    """

    dims: tuple[int | None, ...]
    shapes: tuple[tuple[int, ...], ...]
    paths: tuple[str, ...]
    units: tuple[tuple[int, ...], ...]
    shards: int
    stacked: tuple[bool, ...] = ()
    tensor_dims: tuple[int | None, ...] = ()
    tensor_axis: str | None = None

    @classmethod
    def of(
        cls,
        params: Any,
        shards: int,
        *,
        unit_bytes: int | None,
        min_elements: int = DEFAULT_MIN_SHARD_ELEMENTS,
        stacked: Any = None,
        tensor: tuple[str, int, Any] | None = None,
        shard_dims: Any = None,
    ) -> Placement:
        """The placement of ``params`` (arrays or shapes) over ``shards`` devices; ``stacked``: a
        tree of booleans like ``params`` (or None), true where a leaf's first dimension
        counts scanned layers; ``tensor``: ``(axis, size, dims)``, ``dims`` a tree like
        ``params`` of the dimension each leaf splits over ``axis`` (or None);
        ``shard_dims``: a tree like ``params`` of the dimension each leaf splits over the
        shard axes, or None to keep it whole (logical axis rules,
        :func:`jaxdist.training.logical_axes.split_dims`); None for the whole tree: each
        leaf's first dimension ``shards`` divides."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        per_leaf = lambda tree, default: (  # noqa: E731
            (default,) * len(flat) if tree is None else tuple(treedef.flatten_up_to(tree))
        )
        axis, tensor_size, tensor_dims = (None, 1, None) if tensor is None else tensor
        tensor_dims = per_leaf(tensor_dims, None)
        shapes = tuple(
            _block_shape(tuple(leaf.shape), dim, tensor_size)
            for (_, leaf), dim in zip(flat, tensor_dims)
        )
        paths = tuple(jax.tree_util.keystr(path, simple=True, separator=".") for path, _ in flat)
        flags = tuple(bool(b) for b in per_leaf(stacked, False))
        if shard_dims is None:
            dims = tuple(
                _split_dimension(s, shards, min_elements, f) for s, f in zip(shapes, flags)
            )
        else:
            dims = tuple(None if shards == 1 else d for d in per_leaf(shard_dims, None))
            _check_shard_dims(dims, shapes, flags, paths, shards)
        units: list[list[int]] = []
        size = 0
        for index, (_leaf_path, leaf) in enumerate(flat):
            if dims[index] is None:
                continue
            nbytes = math.prod(shapes[index]) * jnp.dtype(leaf.dtype).itemsize
            same_dtype = units and flat[units[-1][0]][1].dtype == leaf.dtype
            if not units or not same_dtype or (unit_bytes and size + nbytes > unit_bytes):
                units.append([])
                size = 0
            units[-1].append(index)
            size += nbytes
        units_by_leaf = tuple(tuple(u) for u in units)
        return cls(dims, shapes, paths, units_by_leaf, shards, flags, tensor_dims, axis)

    def specs(self, treedef: Any, axes: Sequence[str] | str | None) -> Any:
        """PartitionSpecs of the parameter tree ``treedef`` laid out this way over ``axes``
        (None: the tensor-parallel split alone, each leaf whole over the shard axes)."""
        return jax.tree.unflatten(treedef, [self.spec(i, axes) for i in range(len(self.dims))])

    def spec(self, index: int, axes: Sequence[str] | str | None) -> P:
        """One leaf's PartitionSpec: its tensor-parallel dimension over the tensor axis, its
        sharded dimension over ``axes`` (both on one dimension: tensor outer, so that a
        gather over ``axes`` rebuilds the device's tensor block)."""
        entries: list[Any] = [None] * len(self.shapes[index])
        tensor_dim = self.tensor_dims[index] if self.tensor_dims else None
        if tensor_dim is not None:
            entries[tensor_dim] = self.tensor_axis
        dim = self.dims[index]
        if dim is not None and axes is not None:
            shard = (axes,) if isinstance(axes, str) else tuple(axes)
            entries[dim] = (entries[dim], *shard) if entries[dim] else axes
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def replicated(self) -> list[str]:
        """The names of the parameters kept whole on every device."""
        return [path for path, dim in zip(self.paths, self.dims) if dim is None]

    def describe(self) -> str:
        """One line: how many parameters are split, and which stay whole."""
        whole = self.replicated()
        count = sum(math.prod(self.shapes[i]) for i, d in enumerate(self.dims) if d is None)
        line = (
            f"{len(self.dims) - len(whole)} of {len(self.dims)} parameter arrays split "
            f"{self.shards} ways"
        )
        if whole:
            shown = ", ".join(whole[:4]) + (", ..." if len(whole) > 4 else "")
            line += f"; {len(whole)} kept whole ({count:,} values: {shown})"
        return line


# --------------------------------------------------------------------------- inside shard_map


def _front(block: jax.Array, dim: int) -> jax.Array:
    """A block with its split dimension first, flattened: how it travels."""
    return jnp.moveaxis(block, dim, 0).reshape(-1)


def gather_unit(
    blocks: Sequence[jax.Array],
    dims: Sequence[int],
    axes: Any,
    algorithm: str,
    options: Mapping[str, Any],
    reversed_: bool = False,
) -> list[jax.Array]:
    """Every device's blocks of one unit's parameters, gathered into whole parameters.

    ``reversed_``: each device sends its buffer back to front and the rows are turned round
    as they arrive: the same result from other messages, which the compiler cannot merge
    with the same unit's gather in forward (merged, the forward's gathered copy would be
    kept alive until backward)."""
    shards = collectives.axis_size(axes)
    local = jnp.concatenate([_front(b, d) for b, d in zip(blocks, dims)])
    gathered = collectives.all_gather_rows(
        local[::-1] if reversed_ else local, axes, algorithm, **options
    )
    if reversed_:
        gathered = gathered[:, ::-1]
    whole, offset = [], 0
    for block, dim in zip(blocks, dims):
        moved = jnp.moveaxis(block, dim, 0).shape
        part = gathered[:, offset : offset + block.size].reshape(shards * moved[0], *moved[1:])
        whole.append(jnp.moveaxis(part, 0, dim))
        offset += block.size
    return whole


def scatter_unit(
    whole: Sequence[jax.Array],
    dims: Sequence[int],
    axes: Any,
    algorithm: str,
    options: Mapping[str, Any],
) -> list[jax.Array]:
    """One unit's whole gradients summed over ``axes``, each device keeping its blocks.

    The permute schedules send the unit as one buffer, in few large messages. The
    compiler's own reduce-scatter (``native``) takes each gradient on its own, as XLA's FSDP
    does: no unit-sized concatenation of float32 gradients is built, and a TPU compiler
    that turns a reduce-scatter over many chips into an all-reduce (and a slice) keeps one
    gradient's buffer for it, not the unit's. (Gathers stay one buffer: on the TPU, one
    all-gather per parameter left more of them waiting.)"""
    if algorithm == "native" and len(whole) > 1:
        return [scatter_unit([g], [d], axes, algorithm, options)[0] for g, d in zip(whole, dims)]
    shards = collectives.axis_size(axes)
    rows = [jnp.moveaxis(g, d, 0).reshape(shards, -1) for g, d in zip(whole, dims)]
    mine = collectives.reduce_scatter(jnp.concatenate(rows, axis=1), axes, algorithm, **options)
    blocks, offset = [], 0
    for grad, dim, row in zip(whole, dims, rows):
        moved = jnp.moveaxis(grad, dim, 0).shape
        block = mine[offset : offset + row.shape[1]].reshape(moved[0] // shards, *moved[1:])
        blocks.append(jnp.moveaxis(block, 0, dim))
        offset += row.shape[1]
    return blocks


def gatherer(
    dims: Sequence[int],
    axes: Any,
    gather: str,
    scatter: str,
    options: Mapping[str, Any],
    gradient_options: Mapping[str, Any],
) -> Any:
    """``gather(blocks) -> whole parameters`` for one unit (by the ``gather`` schedule), whose
    gradient is the reduce-scatter (summing, by the ``scatter`` schedule) of the whole
    parameters' gradients: FSDP's forward and backward collectives as one differentiable
    function. Parameters travel in their own dtype; ``gradient_options`` (a
    ``transfer_dtype``, say) apply to the gradients."""
    dims = tuple(dims)

    @jax.custom_vjp
    def gather_blocks(blocks):
        with jax.named_scope(PARAMETER_SCOPE):
            return gather_unit(blocks, dims, axes, gather, options)

    def forward(blocks):
        return gather_blocks(blocks), None

    def backward(_, cotangents):
        with jax.named_scope(GRADIENT_SCOPE):
            return (scatter_unit(cotangents, dims, axes, scatter, gradient_options),)

    gather_blocks.defvjp(forward, backward)
    return gather_blocks


def gathered_loss(
    loss_fn: Any,
    placement: Placement,
    axes: Any,
    gather: str,
    scatter: str,
    options: Mapping[str, Any],
    gradient_options: Mapping[str, Any],
    keep_gathered: bool,
    prefetch: int = 1,
    on_segments: Callable[[int], None] | None = None,
    *,
    scatter_behind: bool = False,
) -> Any:
    """``loss_fn`` on a device's parameter blocks, gathered by the ``gather`` schedule and
    their gradients reduce-scattered by the ``scatter`` schedule. By default each layer's
    parameters are gathered just before it runs, one layer ahead, and again in backward
    (:mod:`jaxdist.training.fsdp_pacing`), or ``prefetch`` layers ahead (``on_segments`` is
    told how many layers the loss was cut into; ``scatter_behind``: a scanned layer's
    gradient reduce-scattered during the layer before it); with
    ``keep_gathered`` every unit is gathered at the top of the loss and kept for backward
    (more memory, half the parameter traffic)."""
    if not keep_gathered:
        return paced_loss(
            loss_fn,
            placement,
            lambda blocks, dims, again: gather_unit(
                blocks, dims, axes, gather, options, reversed_=again
            ),
            lambda whole, dims: scatter_unit(whole, dims, axes, scatter, gradient_options),
            prefetch,
            on_segments,
            scatter_behind=scatter_behind,
        )

    def gather_leaves(leaves, dims):  # scoped inside: forward's gather, backward's scatter
        return gatherer(dims, axes, gather, scatter, options, gradient_options)(leaves)

    def sharded_loss(params, model_state, batch, rng):
        return loss_fn(_unit_by_unit(params, placement, gather_leaves), model_state, batch, rng)

    return sharded_loss


def _unit_by_unit(
    tree: Any, placement: Placement, collective: Any, scope: str | None = None
) -> Any:
    """``tree`` with each gather unit's leaves replaced by ``collective(leaves, dims)``, under
    the named ``scope`` if one is given; the leaves kept whole are left as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    out = list(leaves)
    with jax.named_scope(scope) if scope else contextlib.nullcontext():
        for unit in placement.units:
            dims = [placement.dims[i] for i in unit]
            for i, leaf in zip(unit, collective([leaves[i] for i in unit], dims)):
                out[i] = leaf
    return jax.tree.unflatten(treedef, out)


def scatter_gradients(
    grads: Any, placement: Placement, axes: Any, algorithm: str, options: Mapping[str, Any]
) -> Any:
    """Whole gradients (ZeRO-1) summed over ``axes`` into the blocks each device owns."""
    scatter = lambda ls, dims: scatter_unit(ls, dims, axes, algorithm, options)  # noqa: E731
    return _unit_by_unit(grads, placement, scatter, GRADIENT_SCOPE)


def gather_parameters(
    blocks: Any, placement: Placement, axes: Any, algorithm: str, options: Mapping[str, Any]
) -> Any:
    """Every sharded leaf of ``blocks`` gathered whole (ZeRO-1's parameters after the
    update)."""
    gather = lambda ls, dims: gather_unit(ls, dims, axes, algorithm, options)  # noqa: E731
    return _unit_by_unit(blocks, placement, gather, PARAMETER_SCOPE)
