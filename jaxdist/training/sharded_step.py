"""The train step of a sharded state: ZeRO-1 and FSDP (:mod:`jaxdist.training.sharding`), and
of a model split over a tensor axis (:mod:`jaxdist.comm.tensor_parallel`), whose loss is
traced inside :func:`~jaxdist.comm.tensor_parallel.splitting`.

One ``jax.jit``-ed program in two parts:

1. inside ``jax.shard_map``, each device computes its gradients (FSDP: of its parameter
   blocks, each unit all-gathered as the loss reads it; ZeRO-1: of the whole parameters) and
   reduce-scatters them with the chosen schedule into the blocks it owns, averaging the
   parameters kept whole with the schedule's allreduce;
2. outside it, under XLA's SPMD partitioner, the optax update runs on the sharded gradients,
   parameters and optimizer state. Each device computes only its blocks, and whatever the
   transformation reads across elements (a global norm, a layer's trust ratio) XLA sums over
   the shards: every optimizer gives one device's update to float32 rounding. ZeRO-1 then
   all-gathers the updated blocks with the schedule's second half (a second shard_map).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.comm import collectives
from jaxdist.comm.compiler_options import compiler_options_for
from jaxdist.comm.scopes import GRADIENT_SCOPE, METRICS_SCOPE, MODEL_STATE_SCOPE
from jaxdist.comm.tensor_parallel import TensorParallel
from jaxdist.training import sharding as sharding_lib
from jaxdist.training.gradients import local_gradients
from jaxdist.training.loss_scale import all_finite, ended_step
from jaxdist.training.protocol import LossFn
from jaxdist.training.split_products import check_split_products
from jaxdist.training.step_options import Communication, Precision, StateSharding
from jaxdist.training.train_state import TrainState

__all__: list[str] = []  # building blocks of the package's own modules


class ShardedStep(Protocol):
    """What the program reads of the :class:`~jaxdist.training.train_step.TrainStep` it is
    built for: its parts and options, and where it places the state."""

    mesh: Mesh
    data_axes: str | tuple[str, ...]
    shard_axes: str | tuple[str, ...]
    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    communication: Communication
    sharding: StateSharding
    precision: Precision
    tensor: TensorParallel | None
    accumulation_steps: int
    num_replicas: int
    donate: bool

    def placement_of(self, params: Any) -> sharding_lib.Placement: ...
    def parameter_specs(self, params: Any) -> tuple[Any, Any]: ...
    def state_specs(self, state: TrainState) -> TrainState: ...
    def state_shardings(self, state: TrainState) -> TrainState: ...
    def record_paced_layers(self, count: int) -> None: ...
    def count_trace(self) -> None: ...


def build_sharded_step(step: ShardedStep, state: TrainState) -> Callable:
    """The jitted ``(state, batch, rng) -> (state, metrics)`` of a ZeRO-1, FSDP or
    tensor-parallel :class:`~jaxdist.training.train_step.TrainStep`."""
    mesh, fsdp = step.mesh, step.sharding.kind == "fsdp"
    communication, sharding = step.communication, step.sharding
    specs = step.state_specs(state)
    placement = step.placement_of(state.params)
    whole, blocks = step.parameter_specs(state.params)
    replicated_model_state = jax.tree.map(lambda _: P(), state.model_state)
    gradients = jax.shard_map(
        lambda *args: _gradients(step, placement, *args),
        mesh=mesh,
        in_specs=(specs.params, replicated_model_state, P(step.data_axes), P(), P()),
        out_specs=(blocks, replicated_model_state, P(), P()),
        check_vma=False,
    )
    gather_back = jax.shard_map(
        lambda b: sharding_lib.gather_parameters(
            b,
            placement,
            step.shard_axes,
            sharding.gather_schedule(communication),
            sharding.gather_options(communication),
        ),
        mesh=mesh,
        in_specs=(blocks,),
        out_specs=whole,
        check_vma=False,
    )
    block_shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), blocks, is_leaf=lambda x: isinstance(x, P)
    )

    def train_step(state, batch, rng):
        scale = None if state.loss_scale is None else state.loss_scale.scale
        grads, model_state, loss, metrics = gradients(
            state.params, state.model_state, batch, rng, scale
        )
        if state.loss_scale is not None:
            grads = state.loss_scale.unscale(grads)
        finite = all_finite(grads) if step.precision.checks_finite else None
        # ZeRO-1's whole parameters, seen in blocks: each device slices its own, no traffic.
        params = (
            state.params if fsdp else lax.with_sharding_constraint(state.params, block_shardings)
        )
        updates, opt_state = step.optimizer.update(grads, state.opt_state, params)
        params = optax.apply_updates(params, updates)
        if not fsdp:
            params = gather_back(params)
        skip = step.precision.skip_nonfinite
        return ended_step(state, params, model_state, opt_state, finite, loss, metrics, skip)

    state_shardings = step.state_shardings(state)
    return jax.jit(
        train_step,
        out_shardings=(state_shardings, NamedSharding(mesh, P())),
        donate_argnums=(0,) if step.donate else (),
        compiler_options=compiler_options_for(mesh.devices.flat, communication.allreduce),
    )


def _gradients(
    step: ShardedStep,
    placement: sharding_lib.Placement,
    params: Any,
    model_state: Any,
    batch: Any,
    rng: jax.Array,
    scale: jax.Array | None,
):
    """Inside shard_map: ``(gradient blocks, model state, loss, metrics)``, every gradient the
    mean over the data axes, each sharded one kept only in the blocks this device owns."""
    step.count_trace()
    axes, shard_axes = step.data_axes, step.shard_axes
    communication, sharding = step.communication, step.sharding
    rng = jax.random.fold_in(rng, lax.axis_index(axes))
    loss_fn = step.loss_fn
    if sharding.kind == "fsdp":
        loss_fn = sharding_lib.gathered_loss(
            loss_fn,
            placement,
            shard_axes,
            sharding.gather_schedule(communication),
            communication.allreduce,
            sharding.gather_options(communication),
            communication.options,
            sharding.keep_gathered,
            sharding.prefetch,
            step.record_paced_layers,
            scatter_behind=sharding.scatter_behind,
        )
    tensor = step.tensor
    if tensor is not None:
        _check_products(step, tensor, placement, params, model_state, batch, rng)
    with tensor.splitting() if tensor else contextlib.nullcontext():
        grads, model_state, loss, metrics, _ = local_gradients(
            loss_fn, params, model_state, batch, rng, scale, step.accumulation_steps
        )
    with jax.named_scope(MODEL_STATE_SCOPE):
        model_state = lax.pmean(model_state, axes)
    with jax.named_scope(METRICS_SCOPE):
        loss, metrics = lax.pmean((loss, metrics), axes)
    if sharding.kind == "zero1":
        grads = sharding_lib.scatter_gradients(
            grads, placement, shard_axes, communication.allreduce, communication.options
        )
    averaged = _averaged(grads, placement, communication, axes, shard_axes, step.num_replicas)
    return averaged, model_state, loss, metrics


def sharded_evaluation(
    step: ShardedStep, eval_fn: Callable, placement: sharding_lib.Placement
) -> Callable:
    """``eval_fn(params, model_state, batch) -> sums`` on one device's parameter blocks of
    ``step``'s layout, inside its shard_map: under FSDP each unit gathered just before the
    layer that reads it (forward only, by the step's gather schedule), under a tensor axis
    the products split over it."""
    communication, sharding, tensor = step.communication, step.sharding, step.tensor

    def as_loss(params, model_state, batch, rng):
        return jax.numpy.zeros(()), (model_state, eval_fn(params, model_state, batch))

    loss_fn = as_loss
    if sharding.kind == "fsdp":
        loss_fn = sharding_lib.gathered_loss(
            as_loss,
            placement,
            step.shard_axes,
            sharding.gather_schedule(communication),
            communication.allreduce,
            sharding.gather_options(communication),
            communication.options,
            keep_gathered=False,
            prefetch=sharding.prefetch,
        )

    def body(params, model_state, batch):
        with tensor.splitting() if tensor else contextlib.nullcontext():
            _, (_, sums) = loss_fn(params, model_state, batch, jax.random.key(0))
        return sums

    return body


def _check_products(
    step: ShardedStep,
    tensor: TensorParallel,
    placement: sharding_lib.Placement,
    params: Any,
    model_state: Any,
    batch: Any,
    rng: jax.Array,
) -> None:
    """Refuse, in one line, a loss that multiplies a parameter split over the tensor axis
    with a product that does not sum over it (:mod:`jaxdist.training.split_products`): traced
    on each device's tensor blocks and one micro-batch."""
    blocks = jax.tree.unflatten(
        jax.tree.structure(params),
        [
            jax.ShapeDtypeStruct(shape, leaf.dtype)
            for shape, leaf in zip(placement.shapes, jax.tree.leaves(params))
        ],
    )
    micro = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (x.shape[0] // step.accumulation_steps, *x.shape[1:]), x.dtype
        ),
        batch,
    )
    state_shapes, rng_shape = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (model_state, rng)
    )
    with tensor.splitting():
        check_split_products(
            step.loss_fn,
            blocks,
            tensor.dims,
            (state_shapes, micro, rng_shape),
            tensor.axis,
            dict(step.mesh.shape),
        )


def _averaged(
    grads: Any,
    placement: sharding_lib.Placement,
    communication: Communication,
    data_axes: str | tuple[str, ...],
    shard_axes: str | tuple[str, ...],
    num_replicas: int,
) -> Any:
    """Gradients summed over the shard axes (blocks) or not at all (whole leaves), made the
    mean over every data axis: whole leaves by the schedule's allreduce, and under HSDP the
    blocks across the replica groups too."""
    leaves, treedef = jax.tree.flatten(grads)
    whole = [i for i, d in enumerate(placement.dims) if d is None]
    split = [i for i, d in enumerate(placement.dims) if d is not None]
    shard_names = np.atleast_1d(shard_axes)
    across = tuple(a for a in np.atleast_1d(data_axes) if a not in shard_names)
    allreduce = communication.allreduce
    hsdp = bool(across)
    with jax.named_scope(GRADIENT_SCOPE):
        if whole:
            algorithm = _replica_algorithm(allreduce) if hsdp else allreduce
            options = {} if hsdp else communication.options
            summed = collectives.allreduce(
                [leaves[i] for i in whole], data_axes, algorithm, **options
            )
            for i, g in zip(whole, summed):
                leaves[i] = g
        if hsdp and split:
            group_axes = across[0] if len(across) == 1 else across
            summed = collectives.allreduce(
                [leaves[i] for i in split], group_axes, _replica_algorithm(allreduce)
            )
            for i, g in zip(split, summed):
                leaves[i] = g
    return jax.tree.unflatten(treedef, [g / num_replicas for g in leaves])


def _replica_algorithm(algorithm: str) -> str:
    """The schedule HSDP's replica groups average with: XLA's all-reduce under ``native``,
    else the ring (one axis or several acting as one)."""
    return "native" if algorithm == "native" else "ring"
