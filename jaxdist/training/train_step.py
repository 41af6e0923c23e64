"""The mesh-aware data-parallel train step that research code imports.

The five-line use::

    step = TrainStep(loss_fn, optax.sgd(0.1, 0.9), mesh, communication=Communication("torus2d"))
    state = step.init(params, model_state)
    for batch in batches:
        state, metrics = step(state, step.shard_batch(batch), rng)

``loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, metrics))`` sees one
device's shard of the batch. Inside one ``jax.jit``-ed ``jax.shard_map`` program each device

1. computes gradients on its shard (optionally summed over ``accumulation_steps`` micro-batches,
   and of a scaled loss for float16),
2. averages them across the data axes with the chosen :mod:`jaxdist.comm.collectives` schedule
   (:class:`~jaxdist.training.step_options.Communication`), one call per gradient bucket
   (:mod:`jaxdist.comm.buckets`), buckets in backward order -- or with ``allreduce="auto"``
   the schedule the cost model prices cheapest for each bucket, and dense
   layers' gradients as sufficient factors where that is cheaper
   (:mod:`jaxdist.training.gradient_plan`),
3. applies the optax update.

With a ZeRO-1 or FSDP :class:`~jaxdist.training.step_options.StateSharding`
(:mod:`jaxdist.training.sharding`) the gradients are
instead reduce-scattered with the chosen schedule's first half into the shards that own them,
the optimizer updates sharded arrays (under ``jax.jit`` outside the shard_map, so any optax
transformation sees whole arrays: a global norm is a sum over shards), and ZeRO-1 all-gathers
the updated parameters with the schedule's second half; FSDP keeps them sharded and gathers
each unit just before the loss reads it.

Model state (BatchNorm running statistics) and metrics are averaged over the data axes, so every
device holds the same state after each step. The state argument is donated on accelerators
(see :func:`~jaxdist.training.step_checks.donation_default`).

The shard_map runs with ``check_vma=False``: the parameters are replicated (``P()``) on the way
in and out, and in between each device must see *its own* gradient so that the chosen schedule,
not autodiff's implicit psum, does the averaging.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.comm import collectives, hybrid
from jaxdist.comm.compiler_options import compiler_options_for
from jaxdist.comm.scopes import METRICS_SCOPE, MODEL_STATE_SCOPE
from jaxdist.comm.tensor_parallel import TensorParallel
from jaxdist.runtime import dispatch
from jaxdist.training import optim
from jaxdist.training import sharding as sharding_lib
from jaxdist.training.batches import check_shared_rows, data_axes_of, shard_batch
from jaxdist.training.compiled_step import CompiledStep
from jaxdist.training.eval_step import EvalFn
from jaxdist.training.gradient_plan import GradientPlan, plan_for_step
from jaxdist.training.gradients import local_gradients, reduced_while_computing
from jaxdist.training.loss_scale import all_finite, ended_step
from jaxdist.training.protocol import LossFn
from jaxdist.training.sharded_step import build_sharded_step, sharded_evaluation
from jaxdist.training.step_checks import (
    WAIT_FREE_UNROLL_LIMIT,
    check_allreduce,
    check_gather,
    check_pacing,
    check_sharded,
    check_tensor,
    check_wait_free,
)
from jaxdist.training.step_options import NO_ALLREDUCE, Communication, Precision, StateSharding
from jaxdist.training.train_state import TrainState, place_per_process

__all__ = ["TrainStep"]


class TrainStep(CompiledStep):
    """A jitted data-parallel train step on ``mesh``; see the module docstring.

    Args:
      loss_fn: ``(params, model_state, batch, rng) -> (loss, (model_state, metrics))`` on one
        device's shard; ``metrics`` is a dict of scalars.
      optimizer: any optax transformation.
      mesh: the device mesh; ``data_axes`` (default: all its axes) split the batch.
      communication: how gradients are averaged over the data axes: the schedule, its
        options, buckets, sufficient factors, links, wait-free pacing
        (:class:`~jaxdist.training.step_options.Communication`; default XLA's all-reduce).
      sharding: where the parameters and optimizer state live: replicated, ZeRO-1 or FSDP,
        over which axes, gathered how (:class:`~jaxdist.training.step_options.StateSharding`).
      precision: loss scaling and skipped non-finite steps
        (:class:`~jaxdist.training.step_options.Precision`).
      accumulation_steps: micro-batches per device whose gradients are summed before one
        allreduce; the per-device batch must divide by it.
      stacked_layers: a tree of booleans like the parameters, true where a leaf's first
        dimension counts layers the loss scans over (:meth:`jaxdist.tasks.task.Task.stacked_layers`):
        ZeRO-1 and FSDP split such a leaf below that axis, and FSDP gathers it one layer at
        a time inside the scan (:mod:`jaxdist.training.fsdp_scan`).
      tensor: a :class:`~jaxdist.comm.tensor_parallel.TensorParallel`: the parameters
        split over a mesh axis that is not a data axis, the loss traced inside
        :func:`~jaxdist.comm.tensor_parallel.splitting` so the model's column- and
        row-parallel products sum over it. Each device of the axis sees the same batch; the
        optimizer runs outside the shard_map as for a sharded state, so every optax
        transformation stays exact.
      donate: donate the state buffers to the step; ``None`` (default): on accelerators only,
        see :func:`~jaxdist.training.step_checks.donation_default`.
      max_in_flight: how many calls may be queued at once; a call waits for the oldest to
        finish first. ``"auto"`` (default): 4 on CPU meshes, where deeper queues of collective
        programs can hang XLA:CPU, no limit elsewhere; ``None``: no limit. Steps on the same
        devices with the same limit share one queue (:func:`jaxdist.runtime.dispatch.shared_window`).
    """

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        *,
        data_axes: str | tuple[str, ...] | None = None,
        communication: Communication = Communication(),
        sharding: StateSharding = StateSharding(),
        precision: Precision = Precision(),
        accumulation_steps: int = 1,
        stacked_layers: Any = None,
        tensor: TensorParallel | None = None,
        donate: bool | None = None,
        max_in_flight: dispatch.Limit = "auto",
    ):
        allreduce, sfb_layers = communication.allreduce, communication.sfb_layers
        if allreduce not in (NO_ALLREDUCE, hybrid.AUTO, *collectives.ALGORITHMS):
            raise ValueError(
                f"unknown allreduce {allreduce!r}; expected one of "
                f"{(*collectives.ALGORITHMS, hybrid.AUTO)}"
            )
        sharding_lib.check_sharding(sharding.kind)
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        check_wait_free(communication.wait_free, allreduce, sharding.kind, sfb_layers)
        super().__init__(loss_fn, optimizer, mesh, communication, precision, donate, max_in_flight)
        self.data_axes = data_axes_of(mesh, data_axes)
        if communication.named:
            check_allreduce(mesh, self.data_axes, allreduce, communication.options)
        else:
            collectives.common_options(communication.options)
        self.axis_sizes = tuple(mesh.shape[a] for a in np.atleast_1d(self.data_axes))
        self.shard_axes = (
            sharding_lib.default_shard_axes(self.data_axes)
            if sharding.axes is None
            else data_axes_of(mesh, sharding.axes)
        )
        if sharding.sharded:
            check_sharded(
                mesh,
                self.data_axes,
                self.shard_axes,
                sharding.kind,
                allreduce,
                communication.options,
                sfb_layers,
            )
        if sharding.gather is not None:
            check_gather(
                mesh,
                self.data_axes,
                self.shard_axes,
                sharding.kind,
                sharding.gather,
                sharding.gather_options(communication),
            )
        check_pacing(
            sharding.prefetch, sharding.kind, sharding.keep_gathered, sharding.scatter_behind
        )
        self.sharding = sharding
        self.stacked_layers = stacked_layers
        self.tensor = tensor
        if tensor is not None:
            check_tensor(
                mesh, self.data_axes, tensor, allreduce, sfb_layers, communication.wait_free
            )
        self.placement: sharding_lib.Placement | None = None
        # How many layers FSDP's paced gathers cut the loss into, once the step is traced.
        self.paced_layers: int | None = None
        self._rows_checked = False  # processes sharing replicas fed alike (first batch)
        # Auto cannot choose without links: refuse now, not at the first step.
        self.links = (
            hybrid.resolve_links(communication.links, self.axis_sizes)
            if communication.links is not None or allreduce == hybrid.AUTO
            else None
        )
        self.accumulation_steps = accumulation_steps
        self.num_replicas = math.prod(self.axis_sizes)
        self.gradient_plan: GradientPlan | None = None

    # ------------------------------------------------------------------ state and batches

    def init(self, params: Any, model_state: Any = None) -> TrainState:
        """The initial state, placed on the mesh (replicated; ZeRO-1 state sharded)."""
        # One compiled program: op by op, the optimizer's init compiles each op on its own at
        # every start (a zeros per parameter shape), and no compilation cache keeps them.
        state = jax.jit(self._fresh_state)(jax.tree.map(jnp.asarray, params), model_state)
        state = jax.tree.map(
            lambda leaf, spec: place_per_process(leaf, NamedSharding(self.mesh, spec)),
            state,
            self.state_specs(state),
        )
        # device_put may alias the caller's buffers on devices they already live on; a step
        # that donates its state gets buffers of its own, so the caller's stay valid.
        return jax.tree.map(jnp.copy, state) if self.donate else state

    def abstract_init(self, params: Any, model_state: Any = None) -> TrainState:
        """What :meth:`init` would return, as ``jax.ShapeDtypeStruct`` leaves carrying their
        shardings; ``params`` and ``model_state`` may be shapes too. Nothing is allocated, so
        the step can be lowered and compiled for devices that are not here
        (:mod:`jaxdist.aot`)."""
        state = jax.eval_shape(self._fresh_state, params, model_state)
        return jax.tree.map(
            lambda leaf, spec: jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=NamedSharding(self.mesh, spec)
            ),
            state,
            self.state_specs(state),
        )

    def init_sharded(
        self, init_variables: Callable[[jax.Array], tuple[Any, Any]], rng: jax.Array
    ) -> TrainState:
        """The initial state made straight into its shards: ``init_variables(rng) -> (params,
        model_state)`` and the optimizer's init run under ``jax.jit`` with the state's placement
        as output, so no device (nor the host) ever holds the whole sharded state."""
        params, model_state = jax.eval_shape(init_variables, rng)
        shardings = self.state_shardings(jax.eval_shape(self._fresh_state, params, model_state))
        made = jax.jit(lambda key: self._fresh_state(*init_variables(key)), out_shardings=shardings)
        return made(rng)

    def _fresh_state(self, params: Any, model_state: Any) -> TrainState:
        model_state = {} if model_state is None else model_state
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            model_state=model_state,
            opt_state=self.optimizer.init(params),
            loss_scale=self.precision.loss_scale,
        )

    def placement_of(self, params: Any) -> sharding_lib.Placement:
        """Where each parameter lives (:class:`~jaxdist.training.sharding.Placement`): split over
        the shard axes, or whole; replicated steps keep every parameter whole."""
        if self.placement is None:
            shards = math.prod(self.mesh.shape[a] for a in np.atleast_1d(self.shard_axes))
            if not self.sharding.sharded:
                shards = 1
            tensor = self.tensor
            self.placement = sharding_lib.Placement.of(
                params,
                shards,
                unit_bytes=self.communication.bucket_bytes,
                min_elements=self.sharding.min_shard_elements,
                stacked=self.stacked_layers,
                tensor=None
                if tensor is None
                else (tensor.axis, self.mesh.shape[tensor.axis], tensor.dims),
                shard_dims=self.sharding.dims,
            )
        return self.placement

    def parameter_specs(self, params: Any) -> tuple[Any, Any]:
        """``(whole, blocks)``: PartitionSpecs of the parameters kept whole over the shard
        axes (split over a tensor axis alone, if any), and of the blocks each device owns
        (ZeRO-1's gradients and optimizer state, FSDP's parameters too; the same as
        ``whole`` for a replicated step)."""
        placement = self.placement_of(params)
        treedef = jax.tree.structure(params)
        whole = placement.specs(treedef, None)
        if not self.sharding.sharded:
            return whole, whole
        return whole, placement.specs(treedef, self.shard_axes)

    def state_specs(self, state: TrainState) -> TrainState:
        """PartitionSpecs of the state: replicated, but for the sharded state of ZeRO-1
        (optimizer state) and FSDP (parameters and optimizer state), and the parameters a
        tensor axis splits (with their optimizer state)."""
        replicated = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
        whole, blocks = self.parameter_specs(state.params)
        params = blocks if self.sharding.kind == "fsdp" else whole
        opt_state = optax.tree_map_params(
            self.optimizer,
            lambda _, spec: spec,
            state.opt_state,
            blocks,
            transform_non_params=lambda _: P(),
            is_leaf=lambda x: isinstance(x, P),
        )
        return TrainState(
            step=P(),
            params=params,
            model_state=replicated(state.model_state),
            opt_state=opt_state,
            loss_scale=replicated(state.loss_scale),
        )

    def state_shardings(self, state: TrainState) -> TrainState:
        """The state's :class:`NamedSharding` s (:meth:`state_specs` on this mesh)."""
        return jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            self.state_specs(state),
            is_leaf=lambda x: isinstance(x, P),
        )

    def shard_batch(self, batch: Any) -> Any:
        """Place a batch on this step's mesh; see :func:`shard_batch`. The first batch is
        checked to be the same on processes holding the same replicas
        (:func:`~jaxdist.training.batches.check_shared_rows`)."""
        if not self._rows_checked:
            check_shared_rows(self.mesh, self.data_axes, batch)
            self._rows_checked = True
        return shard_batch(self.mesh, self.data_axes, batch)

    def set_learning_rate(self, state: TrainState, learning_rate: float) -> TrainState:
        """The state with ``learning_rate`` in its ``inject_hyperparams`` optimizer state (see
        :func:`jaxdist.training.optim.set_learning_rate`)."""
        # Placed like the rest of the state, so the jitted step sees the same shardings.
        value = place_per_process(np.float32(learning_rate), NamedSharding(self.mesh, P()))
        return state.replace(opt_state=optim.set_learning_rate(state.opt_state, value))

    def whole_variables(self, state: TrainState) -> tuple[Any, Any]:
        """``(params, model_state)`` as the state holds them: global arrays, split over the
        mesh as the step keeps them (:meth:`evaluation` runs on them where they are)."""
        return state.params, state.model_state

    def evaluation(self, eval_fn: EvalFn, params: Any) -> tuple[EvalFn, Any]:
        """``eval_fn`` on one device's shards of the parameters as this step keeps them, and
        their PartitionSpecs (see :class:`~jaxdist.training.eval_step.EvalStep`): FSDP's
        units gathered layer by layer as the forward does, a tensor axis's products split."""
        whole, blocks = self.parameter_specs(params)
        if not self.sharding.sharded and self.tensor is None:
            return eval_fn, whole
        specs = blocks if self.sharding.kind == "fsdp" else whole
        return sharded_evaluation(self, eval_fn, self.placement_of(params)), specs

    # ------------------------------------------------------------------ the step

    def record_paced_layers(self, count: int) -> None:
        """Called as FSDP's paced loss is traced: how many layers it gathers one by one."""
        self.paced_layers = count

    def _build(self, state: TrainState) -> Callable:
        if self.sharding.sharded or self.tensor is not None:
            return build_sharded_step(self, state)
        specs = self.state_specs(state)
        sharded = jax.shard_map(
            self._body,
            mesh=self.mesh,
            in_specs=(specs, P(self.data_axes), P()),
            out_specs=(specs, P()),
            check_vma=False,
        )
        communication = self.communication
        return jax.jit(
            sharded,
            donate_argnums=(0,) if self.donate else (),
            compiler_options=compiler_options_for(
                self.mesh.devices.flat, communication.allreduce, communication.wait_free
            ),
        )

    def _body(self, state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, dict]:
        self.count_trace()
        axes, communication = self.data_axes, self.communication
        rng = jax.random.fold_in(rng, lax.axis_index(axes))
        scale = None if state.loss_scale is None else state.loss_scale.scale
        plan = self._plan_for(state, batch, rng)
        averaged = communication.allreduce != NO_ALLREDUCE
        if communication.wait_free:
            options = {**communication.options, "unroll_limit": WAIT_FREE_UNROLL_LIMIT}
            grads, model_state, loss, metrics = reduced_while_computing(
                self.loss_fn,
                plan,
                state,
                batch,
                rng,
                scale,
                self.accumulation_steps,
                axes,
                options,
            )
        else:
            grads, model_state, loss, metrics, factors = local_gradients(
                self.loss_fn,
                state.params,
                state.model_state,
                batch,
                rng,
                scale,
                self.accumulation_steps,
                tap=plan.tap if averaged else None,
            )
        # Every device leaves the step with the same model state and metrics.
        with jax.named_scope(MODEL_STATE_SCOPE):
            model_state = lax.pmean(model_state, axes)
        with jax.named_scope(METRICS_SCOPE):
            loss, metrics = lax.pmean((loss, metrics), axes)

        if averaged and not communication.wait_free:
            grads = plan.reduce(grads, factors, axes, communication.options)
        if state.loss_scale is not None:
            grads = state.loss_scale.unscale(grads)
        # Same on every device: they all hold the same reduced gradients.
        finite = all_finite(grads) if self.precision.checks_finite else None
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        skip = self.precision.skip_nonfinite
        return ended_step(state, params, model_state, opt_state, finite, loss, metrics, skip)

    # ------------------------------------------------------------------ the gradient plan

    @property
    def buckets(self) -> list[list[int]] | None:
        """Gradient buckets (leaf indices in backward order); None before the first trace."""
        return None if self.gradient_plan is None else self.gradient_plan.buckets

    def plan(self, state: TrainState | None = None, batch: Any = None) -> GradientPlan:
        """How each gradient is averaged: buckets with their schedules, and the dense layers
        sent as sufficient factors; ``.table()`` prints it with the cost model's predictions.
        Made at the first step; before it, give the state and a (global) batch, as shapes or
        arrays."""
        if self.gradient_plan is not None:
            return self.gradient_plan
        if state is None or batch is None:
            raise ValueError(
                "the plan is made at the first step; before it, pass the state "
                "and a batch: step.plan(state, batch)"
            )
        if self.sharding.sharded:
            raise ValueError(
                f"sharding={self.sharding.kind!r} has no gradient plan: its gradients "
                f"are reduce-scattered unit by unit"
            )
        if self.tensor is not None:
            raise ValueError(
                "a tensor-parallel step has no gradient plan: its gradients are "
                "averaged by one schedule, leaf by leaf"
            )
        local = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (x.shape[0] // self.num_replicas, *x.shape[1:]), x.dtype
            ),
            batch,
        )
        return self._plan_for(state, local, jax.random.key(0))

    def _plan_for(self, state: TrainState, batch: Any, rng: jax.Array) -> GradientPlan:
        """The plan, made once from an abstract trace of the loss on one device's
        micro-batch (``batch`` is one device's shard)."""
        if self.gradient_plan is None:
            self.gradient_plan = plan_for_step(
                self.loss_fn,
                self.communication,
                self.links,
                self.mesh,
                self.data_axes,
                self.accumulation_steps,
                state,
                batch,
                rng,
            )
        return self.gradient_plan
