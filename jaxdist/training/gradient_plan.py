"""How a train step averages each gradient: buckets, a schedule per bucket, and the dense
layers whose gradients travel as sufficient factors.

The plan is made once, from an abstract trace of the loss on one device's (micro-)batch:

* with a fixed ``allreduce``, every bucket uses it, and the layers named in ``sfb_layers``
  travel as factors (:mod:`jaxdist.comm.sufficient_factors`);
* with ``allreduce="auto"``, each bucket takes the schedule the cost model prices cheapest, and
  each candidate dense layer (every ``nn.Dense`` that runs once, or those in ``sfb_layers``)
  travels as factors only where that is cheaper than its dense gradient
  (:mod:`jaxdist.comm.hybrid`). Layers that stay dense join the buckets.

:meth:`GradientPlan.table` prints the choice for every bucket and layer with its predicted
time and the runner-up's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxdist.comm import buckets as bucketing
from jaxdist.comm import collectives, hybrid
from jaxdist.comm.scopes import GRADIENT_SCOPE
from jaxdist.comm.sufficient_factors import mean_gradient_from_factors
from jaxdist.training.dense_factors import (
    DenseLayer,
    FactorTap,
    find_dense_layers,
    key_names,
    select_dense_layers,
)
from jaxdist.training.step_options import Communication
from jaxdist.training.wait_free import wait_free_gradients

__all__ = [
    "GradientPlan",
]


@dataclass
class GradientPlan:
    """Buckets of gradient leaves (backward order) with one schedule each, and the dense
    layers averaged from their factors (``factored``, by leaf index of their kernel)."""

    buckets: list[list[int]]
    algorithms: list[str]
    factored: dict[int, DenseLayer] = field(default_factory=dict)
    routes: list[hybrid.Route] = field(default_factory=list)
    links: hybrid.Links | None = None

    @property
    def tap(self) -> FactorTap | None:
        """What the backward pass must tap, or None when no layer travels as factors."""
        return FactorTap(list(self.factored.values())) if self.factored else None

    def table(self) -> str:
        """One row per bucket and candidate layer: bytes, route, predicted time, runner-up."""
        return hybrid.format_routes(self.routes, self.links)

    def reduce(
        self,
        grads: Any,
        factors: Mapping[str, tuple[jax.Array, jax.Array]],
        axes: Any,
        options: Mapping[str, Any],
    ) -> Any:
        """The mean gradients over ``axes``: buckets through their schedules, factored layers
        rebuilt from the gathered factors; call inside shard_map."""
        ring_options = {k: v for k, v in options.items() if k != "accumulate_dtype"}
        leaves, treedef = jax.tree.flatten(grads)
        with jax.named_scope(GRADIENT_SCOPE):  # how jaxdist.aot finds them
            for index, layer in self.factored.items():
                inputs, output_grads = factors[layer.path]
                mean = mean_gradient_from_factors(inputs, output_grads, axes, **ring_options)
                leaves[index] = mean.astype(leaves[index].dtype)
            reduced = bucketing.bucketed_allreduce(
                jax.tree.unflatten(treedef, leaves),
                axes,
                self.buckets,
                self.algorithms,
                op="mean",
                passthrough=tuple(self.factored),
                **options,
            )
        return reduced

    def reduce_while_computing(
        self,
        objective: Callable,
        params: Any,
        axes: Any,
        options: Mapping[str, Any],
        before_reduce: Callable[[int, jax.Array], jax.Array] | None = None,
    ) -> tuple[Any, Any]:
        """``(mean gradients over axes, aux)`` of ``objective(params) -> (value, aux)``, each
        bucket's schedule advancing beside the rest of backward
        (:mod:`jaxdist.training.wait_free`); ``before_reduce(leaf index, gradient)``, when
        given, is what is averaged of each gradient (with accumulation: the sum over
        micro-batches, divided). Call inside shard_map."""
        if self.factored:
            raise ValueError(
                "wait-free backprop reduces buckets only; its step sends no "
                "layer as sufficient factors"
            )

        def reduce_bucket(b: int, leaves: list) -> list:
            if before_reduce is not None:
                leaves = [before_reduce(k, g) for k, g in zip(self.buckets[b], leaves)]
            return collectives.allreduce(leaves, axes, self.algorithms[b], op="mean", **options)

        return wait_free_gradients(objective, params, self.buckets, reduce_bucket, GRADIENT_SCOPE)


def make_gradient_plan(
    loss_fn: Callable,
    params: Any,
    model_state: Any,
    micro_batch: Any,
    rng: Any,
    *,
    axis_env: Sequence[tuple[str, int]],
    axis_sizes: Sequence[int],
    allreduce: str,
    bucket_bytes: int | None,
    sfb_layers: str | Sequence[str] | None,
    links: hybrid.Links | None,
    accumulation_steps: int,
    transfer_itemsize: int | None,
) -> GradientPlan:
    """The plan for a step; arguments are abstract shapes of one device's micro-batch.

    ``axis_sizes``: the data axes' sizes (as the schedules see them); ``links``: what the
    choices are priced on (required for ``"auto"``, optional otherwise: predictions are then
    left out); ``transfer_itemsize``: bytes per number on the wire (``None``: each leaf's own).
    """
    auto = allreduce == hybrid.AUTO
    layers: list[DenseLayer] = []
    seen = None
    if (auto and sfb_layers is None) or sfb_layers:
        seen = find_dense_layers(loss_fn, params, model_state, micro_batch, rng, axis_env)
        layers = select_dense_layers(seen, sfb_layers)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    index_of = {key_names(path): i for i, (path, _) in enumerate(leaves)}
    # Buckets fill by the leaves' own bytes; routes are priced by the bytes on the wire.
    own_bytes = bucketing.leaf_bytes(params)
    wire_bytes = [
        int(np.prod(leaf.shape)) * (transfer_itemsize or np.dtype(leaf.dtype).itemsize)
        for _, leaf in leaves
    ]
    layer_routes = [
        _route_layer(
            layer,
            wire_bytes[index_of[layer.kernel_path]],
            accumulation_steps,
            transfer_itemsize,
            axis_sizes,
            links,
            auto,
        )
        for layer in layers
    ]
    factored = {
        index_of[layer.kernel_path]: layer
        for layer, route in zip(layers, layer_routes)
        if route.choice == hybrid.FACTORS
    }
    if seen is not None:  # the loss is traced already: its order is read off that trace
        order = bucketing.backward_order_of_jaxpr(seen.jaxpr, len(leaves))
    else:
        objective = lambda *args: loss_fn(*args)[0]  # noqa: E731
        order = bucketing.backward_order(
            objective, params, model_state, micro_batch, rng, axis_env=axis_env
        )
    buckets = _plan_in_order(own_bytes, [k for k in order if k not in factored], bucket_bytes)
    layer_routes = _name_buckets(layers, layer_routes, buckets, index_of)
    bucket_routes = [
        _route_bucket(
            f"bucket {number}",
            f"{len(bucket)} arrays",
            sum(wire_bytes[k] for k in bucket),
            allreduce,
            axis_sizes,
            links,
        )
        for number, bucket in enumerate(buckets)
    ]
    algorithms = [route.choice for route in bucket_routes]
    return GradientPlan(buckets, algorithms, factored, layer_routes + bucket_routes, links)


def plan_for_step(
    loss_fn: Callable,
    communication: Communication,
    links: hybrid.Links | None,
    mesh: Mesh,
    data_axes: str | tuple[str, ...],
    accumulation_steps: int,
    state: Any,
    batch: Any,
    rng: Any,
) -> GradientPlan:
    """The plan of a data-parallel step, from an abstract trace of its ``loss_fn`` on one
    micro-batch of ``batch`` (one device's shard): ``communication``'s schedule and buckets,
    priced on ``links`` (resolved) where given."""
    axes = (data_axes,) if isinstance(data_axes, str) else data_axes
    k = accumulation_steps
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    micro_batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // k, *x.shape[1:]), x.dtype), batch
    )
    transfer = communication.options.get("transfer_dtype")
    return make_gradient_plan(
        loss_fn,
        abstract(state.params),
        abstract(state.model_state),
        micro_batch,
        abstract(rng),
        axis_env=[(a, mesh.shape[a]) for a in axes],
        axis_sizes=tuple(mesh.shape[a] for a in axes),
        allreduce=communication.allreduce,
        bucket_bytes=communication.bucket_bytes,
        sfb_layers=communication.sfb_layers,
        links=links,
        accumulation_steps=k,
        transfer_itemsize=None if transfer is None else np.dtype(transfer).itemsize,
    )


def _name_buckets(
    layers: Sequence[DenseLayer],
    routes: Sequence[hybrid.Route],
    buckets: Sequence[Sequence[int]],
    index_of: dict,
) -> list[hybrid.Route]:
    """``routes`` with the bucket each layer that stays dense joins named in its detail."""
    bucket_of = {k: number for number, bucket in enumerate(buckets) for k in bucket}
    named = list(routes)
    for position, (layer, route) in enumerate(zip(layers, routes)):
        if route.choice == hybrid.DENSE:
            detail = f"{route.detail}, in bucket {bucket_of[index_of[layer.kernel_path]]}"
            named[position] = dataclasses.replace(route, detail=detail)
    return named


def _route_layer(
    layer: DenseLayer,
    kernel_bytes: int,
    accumulation_steps: int,
    transfer_itemsize: int | None,
    axis_sizes: Sequence[int],
    links: hybrid.Links | None,
    auto: bool,
) -> hybrid.Route:
    """Factors or the dense gradient for ``layer`` (always factors unless ``auto``); its
    rows are every micro-batch's."""
    rows = layer.rows * accumulation_steps
    name, detail = f"layer {layer.path}", f"{layer.shape_text}, {rows} rows"
    factor_bytes = layer.factor_bytes(rows, transfer_itemsize or 4)
    if links is None:
        return hybrid.Route(name, detail, factor_bytes, hybrid.FACTORS)
    rebuild = hybrid.rebuild_seconds(rows, layer.in_features, layer.out_features, axis_sizes, links)
    return hybrid.route_dense_layer(
        name,
        detail,
        kernel_bytes,
        factor_bytes,
        axis_sizes,
        links,
        allow_dense=auto,
        rebuild=rebuild,
    )


def _route_bucket(
    name: str,
    detail: str,
    nbytes: int,
    allreduce: str,
    axis_sizes: Sequence[int],
    links: hybrid.Links | None,
) -> hybrid.Route:
    """The cheapest schedule for a bucket (``auto``), or the step's own with its price and the
    best other one's when links are known."""
    if allreduce == hybrid.AUTO:
        return hybrid.route_bucket(name, detail, nbytes, axis_sizes, links)
    if links is None or allreduce not in hybrid.runnable_schedules(axis_sizes):
        return hybrid.Route(name, detail, nbytes, allreduce)
    ranked = hybrid.rank_schedules(nbytes, axis_sizes, links)
    mine = next(row for row in ranked if row[0] == allreduce)
    other = next((row for row in ranked if row[0] != allreduce), (None, None))
    return hybrid.Route(name, detail, nbytes, allreduce, mine[1], mine[2], other[0], other[1])


def _plan_in_order(sizes: list[int], order: list[int], bucket_bytes: int | None) -> list[list[int]]:
    """:func:`jaxdist.comm.buckets.plan_buckets` over the leaves in ``order`` only (the
    factored kernels are left out of every bucket)."""
    local = bucketing.plan_buckets([sizes[k] for k in order], range(len(order)), bucket_bytes)
    return [[order[i] for i in bucket] for bucket in local]
