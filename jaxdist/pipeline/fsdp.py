"""FSDP inside a pipeline stage: each stage's parameters and optimizer state sharded over the
data axes, gathered once a step, their gradients reduce-scattered back.

A pipeline keeps one flat vector per virtual stage (:mod:`jaxdist.pipeline.state`). Under
``sharding="fsdp"`` that vector is laid out as a matrix of one row per data-parallel shard
(:class:`ShardedFlatPacking`): row ``d`` holds shard ``d``'s block of every parameter that
splits (the parameter cut along one of its dimensions, as
:class:`jaxdist.training.sharding.Placement` cuts it) and a copy of every parameter kept whole.
The state stores the matrix split by rows over the data axes, so each device keeps ``1/N``
of its stage's parameters and optimizer state.

The step then

1. all-gathers its rows (:func:`gather_rows`) with a schedule of the family, once, before
   the first micro-batch, and lays them out as the replicated pipeline's flat vector
   (:func:`rows_to_whole`, one pass): the stages compute on whole parameters exactly as they
   would replicated, and the gathered copy is kept for every micro-batch (one gather a step,
   not one per micro-batch);
2. lays the summed gradients out as rows (:func:`whole_to_rows`) and reduce-scatters them
   (:func:`scatter_rows`), bucket by bucket, after the last micro-batch: a split parameter's
   block reaches the shard that owns it, and a whole parameter's gradient, written into
   every row, arrives summed in every row;
3. updates each stage's shard with the optimizer under XLA's SPMD partitioner over the data
   axes (the stage axis stays manual). The matrix's rows are its shards, and every parameter
   is read out of it by slices, reshapes and transposes that keep them, so the optimizer sees
   each parameter in its own shape, sharded, and anything it reads across elements (a global
   norm, a layer's LARS trust ratio, a mask by shape) is what one device computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.comm import collectives
from jaxdist.comm.compiler_options import compiler_options_for
from jaxdist.pipeline.passes import StageStep, per_chunk, update
from jaxdist.pipeline.stages import FlatPacking
from jaxdist.pipeline.state import PipelineState
from jaxdist.training.loss_scale import all_finite, finish_scaled_step
from jaxdist.training.sharding import DEFAULT_MIN_SHARD_ELEMENTS, Placement

__all__ = ["ShardedFlatPacking"]


class ShardedFlatPacking:
    """Pytrees of different structures, one per virtual stage, as flat vectors of ``shards``
    equal rows: the drop-in for :class:`~jaxdist.pipeline.stages.FlatPacking` under FSDP.

    ``flatten(tree)`` gives ``shards * row_size`` elements, row ``d`` (of :attr:`row_size`,
    padded with zeros to the largest stage's) holding block ``d`` of every split leaf and a
    copy of every whole leaf; ``unflatten(v, flat)`` gives virtual stage ``v``'s tree back.
    Attributes as ``FlatPacking``'s: :attr:`size` (the whole vector), :attr:`dtype`; and
    :attr:`whole`, the ``FlatPacking`` of the same trees, which the stages compute on.
    """

    def __init__(
        self, trees: Sequence[Any], shards: int, min_elements: int = DEFAULT_MIN_SHARD_ELEMENTS
    ):
        self.shards = shards
        self.min_elements = min_elements
        self._placements: list[Placement] = []
        self._treedefs: list[Any] = []
        self._dtypes: list[list[Any]] = []
        self.row_sizes: list[int] = []
        dtypes = []
        for tree in trees:
            leaves, treedef = jax.tree.flatten(tree)
            placement = Placement.of(tree, shards, unit_bytes=None, min_elements=min_elements)
            self._placements.append(placement)
            self._treedefs.append(treedef)
            self._dtypes.append([jnp.dtype(leaf.dtype) for leaf in leaves])
            self.row_sizes.append(sum(self._row_width(placement, i) for i in range(len(leaves))))
            dtypes.extend(leaf.dtype for leaf in leaves)
        self.row_size = max([*self.row_sizes, 1])  # a zero-length row would be a special case
        self.whole = FlatPacking(trees)
        self.size = shards * self.row_size
        self.dtype = jnp.result_type(*dtypes) if dtypes else jnp.float32

    def _row_width(self, placement: Placement, index: int) -> int:
        count = math.prod(placement.shapes[index])
        return count if placement.dims[index] is None else count // self.shards

    def flatten(self, tree: Any) -> jax.Array:
        """``tree`` (of a stage this packing was built from) as its flat vector of rows."""
        leaves = jax.tree.leaves(tree)
        placement = Placement.of(tree, self.shards, unit_bytes=None, min_elements=self.min_elements)
        rows = jnp.zeros((self.shards, self.row_size), self.dtype)
        offset = 0
        for leaf, dim in zip(leaves, placement.dims):
            leaf = jnp.asarray(leaf, self.dtype)
            if dim is None:  # a copy in every row
                block = jnp.broadcast_to(leaf.reshape(1, -1), (self.shards, leaf.size))
            else:  # row d: the d-th slab along the split dimension
                block = jnp.moveaxis(leaf, dim, 0).reshape(self.shards, -1)
            rows = rows.at[:, offset : offset + block.shape[1]].set(block)
            offset += block.shape[1]
        return rows.reshape(-1)

    def unflatten(self, index: int, flat: jax.Array) -> Any:
        """Virtual stage ``index``'s tree from its flat vector of rows."""
        placement = self._placements[index]
        rows = flat.reshape(self.shards, self.row_size)
        leaves, offset = [], 0
        for i, (shape, dim) in enumerate(zip(placement.shapes, placement.dims)):
            width = self._row_width(placement, i)
            block = rows[:, offset : offset + width]
            if dim is None:
                leaf = block[0].reshape(shape)
            else:
                moved = (shape[dim], *shape[:dim], *shape[dim + 1 :])
                leaf = jnp.moveaxis(block.reshape(moved), 0, dim)
            leaves.append(leaf.astype(self._dtypes[index][i]))
            offset += width
        return jax.tree.unflatten(self._treedefs[index], leaves)

    def describe(self) -> str:
        """One line: how many of the stages' arrays are split, and how many stay whole."""
        split = sum(d is not None for placed in self._placements for d in placed.dims)
        total = sum(len(placed.dims) for placed in self._placements)
        whole = sum(
            math.prod(s)
            for placed in self._placements
            for s, d in zip(placed.shapes, placed.dims)
            if d is None
        )
        return (
            f"{split} of {total} parameter arrays split {self.shards} ways; "
            f"{total - split} kept whole in every shard ({whole:,} values)"
        )


def rows_to_whole(step: StageStep, rows: jax.Array, stage: jax.Array) -> jax.Array:
    """Inside shard_map: this device's ``(chunks, shards * row_size)`` gathered parameters as
    the ``(chunks, size)`` flat vectors the stages compute on (each leaf contiguous, so a
    stage reads its layers as the replicated pipeline does, without a strided copy each
    tick)."""
    packing = step.packings["params"]
    return _relaid(step, rows, stage, packing, packing.whole)


def whole_to_rows(step: StageStep, flats: jax.Array, stage: jax.Array) -> jax.Array:
    """Inside shard_map: :func:`rows_to_whole` undone, for the summed gradients."""
    packing = step.packings["params"]
    return _relaid(step, flats, stage, packing.whole, packing)


def _relaid(
    step: StageStep, flats: jax.Array, stage: jax.Array, source: Any, target: Any
) -> jax.Array:
    """Each chunk's flat vector, read by the ``source`` packing and written by ``target``."""

    def relaid(v):
        return lambda flat: target.flatten(source.unflatten(v, flat))

    return jnp.stack(per_chunk(step, stage, relaid, flats))


def _column_buckets(width: int, itemsize: int, shards: int, bucket_bytes: int | None) -> list:
    """Column ranges of a ``(shards, width)`` matrix, each about ``bucket_bytes`` in all."""
    per_bucket = max(1, (bucket_bytes or width * shards * itemsize) // (shards * itemsize))
    return [(start, min(start + per_bucket, width)) for start in range(0, width, per_bucket)]


def gather_rows(
    rows: jax.Array, axes: Any, algorithm: str, options: Mapping[str, Any], bucket_bytes: int | None
) -> jax.Array:
    """Inside shard_map: this device's ``(chunks, row_size)`` rows, all-gathered over ``axes``
    into ``(chunks, shards * row_size)`` flat vectors of rows, in buckets of columns."""
    shards = collectives.axis_size(axes)
    chunks, width = rows.shape
    out = []
    for chunk in range(chunks):
        pieces = [
            collectives.all_gather_rows(rows[chunk, a:b], axes, algorithm, **options)
            for a, b in _column_buckets(width, rows.dtype.itemsize, shards, bucket_bytes)
        ]
        out.append(jnp.concatenate(pieces, axis=1).reshape(-1))
    return jnp.stack(out)


def scatter_rows(
    flats: jax.Array,
    axes: Any,
    algorithm: str,
    options: Mapping[str, Any],
    bucket_bytes: int | None,
) -> jax.Array:
    """Inside shard_map: ``(chunks, shards * row_size)`` gradients averaged over ``axes``, each
    device keeping its ``(chunks, row_size)`` rows; the last chunk's buckets go first, as
    backward finishes them."""
    shards = collectives.axis_size(axes)
    chunks = flats.shape[0]
    matrices = flats.reshape(chunks, shards, -1)
    width = matrices.shape[2]
    buckets = _column_buckets(width, flats.dtype.itemsize, shards, bucket_bytes)
    out: list = [None] * chunks
    for chunk in reversed(range(chunks)):
        pieces = [
            collectives.reduce_scatter(
                matrices[chunk, :, a:b], axes, algorithm, op="mean", **options
            )
            for a, b in reversed(buckets)
        ]
        out[chunk] = jnp.concatenate(pieces[::-1])
    return jnp.stack(out)


def build_fsdp_step(step: StageStep, state: PipelineState, body: Callable) -> Callable:
    """The jitted ``(state, batch, rng) -> (state, metrics)`` of a
    :class:`~jaxdist.pipeline.step.PipelineStep` under FSDP: the gradients inside a shard_map
    over every axis (its body gathers each stage's rows first and reduce-scatters the
    gradients last), then the update inside one over the stage axis alone, the data axes left
    to XLA's SPMD partitioner. ``body`` is the step's shard_map body, which returns this
    device's gradient rows."""
    stage, rows = P(step.stage_axis), step.state_spec("params")
    specs = PipelineState(
        step=P(),
        params=rows,
        model_state=stage,
        opt_state=rows,
        loss_scale=jax.tree.map(lambda _: P(), state.loss_scale),
    )
    gradients = jax.shard_map(
        body,
        mesh=step.mesh,
        in_specs=(specs, P(step.data_axes), P()),
        out_specs=(rows, stage, P(), P(), P()),
        check_vma=False,
    )

    def update_shards(params, grads, opt_state):
        # This stage's parameters, gradients and optimizer state, each a flat vector of rows
        # split over the data axes, which the partitioner keeps split.
        index = lax.axis_index(step.stage_axis)
        params, opt_state = update(step, params[0], grads[0], opt_state[0], index)
        finite = lax.pmin(all_finite(params).astype(jnp.int32), step.stage_axis) > 0
        return params[None], opt_state[None], finite

    update_stages = jax.shard_map(
        update_shards,
        mesh=step.mesh,
        in_specs=(stage, stage, stage),
        out_specs=(stage, stage, P()),
        axis_names={step.stage_axis},
        check_vma=False,
    )
    kept = NamedSharding(step.mesh, rows)
    skip = step.precision.skip_nonfinite

    def train_step(state, batch, rng):
        grads, model_state, loss, metrics, grads_finite = gradients(state, batch, rng)
        params, opt_state, params_finite = update_stages(state.params, grads, state.opt_state)
        params, opt_state = lax.with_sharding_constraint((params, opt_state), kept)
        finite = grads_finite if state.loss_scale is not None else None
        if skip:  # also a finite step whose update leaves inf parameters
            ok = grads_finite & params_finite & jnp.isfinite(loss)
            finite = ok if finite is None else finite & ok
        new_state = state.replace(
            step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state
        )
        return finish_scaled_step(
            state, new_state, finite, {**metrics, "loss": loss}, report_skipped=skip
        )

    options = compiler_options_for(step.mesh.devices.flat, step.communication.allreduce)
    return jax.jit(train_step, donate_argnums=(0,) if step.donate else (), compiler_options=options)
