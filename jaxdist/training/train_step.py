"""Mesh-aware data-parallel train and eval steps that research code imports.

The five-line use::

    step = jaxdist.training.train_step.TrainStep(loss_fn, optax.sgd(0.1, 0.9), mesh, allreduce="torus2d")
    state = step.init(params, model_state)
    for batch in batches:
        state, metrics = step(state, step.shard_batch(batch), rng)

``loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, metrics))`` sees one
device's shard of the batch. Inside one ``jax.jit``-ed ``jax.shard_map`` program each device

1. computes gradients on its shard (optionally summed over ``accumulation_steps`` micro-batches,
   and of a scaled loss for float16),
2. averages them across the data axes with the chosen :mod:`jaxdist.comm.collectives` schedule, one
   call per gradient bucket (:mod:`jaxdist.comm.buckets`), buckets in backward order -- or with
   ``allreduce="auto"`` the schedule the cost model prices cheapest for each bucket, and dense
   layers' gradients as sufficient factors where that is cheaper
   (:mod:`jaxdist.training.gradient_plan`),
3. applies the optax update.

With ``sharding="zero1"`` or ``"fsdp"`` (:mod:`jaxdist.training.sharding`) the gradients are
instead reduce-scattered with the chosen schedule's first half into the shards that own them,
the optimizer updates sharded arrays (under ``jax.jit`` outside the shard_map, so any optax
transformation sees whole arrays: a global norm is a sum over shards), and ZeRO-1 all-gathers
the updated parameters with the schedule's second half; FSDP keeps them sharded and gathers
each unit just before the loss reads it.

Model state (BatchNorm running statistics) and metrics are averaged over the data axes, so every
device holds the same state after each step. The state argument is donated on accelerators
(see :func:`~jaxdist.training.step_options.donation_default`).

The shard_map runs with ``check_vma=False``: the parameters are replicated (``P()``) on the way
in and out, and in between each device must see *its own* gradient so that the chosen schedule,
not autodiff's implicit psum, does the averaging.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.comm import buckets as bucketing
from jaxdist.comm import collectives, hybrid
from jaxdist.comm.compiler_options import compiler_options_for
from jaxdist.comm.scopes import METRICS_SCOPE, MODEL_STATE_SCOPE
from jaxdist.comm.tensor_parallel import TensorParallel
from jaxdist.runtime import dispatch
from jaxdist.training import optim
from jaxdist.training import sharding as sharding_lib
from jaxdist.training.batches import check_batch_sizes, data_axes_of, shard_batch
from jaxdist.training.gradient_plan import GradientPlan, plan_for_step
from jaxdist.training.gradients import local_gradients, reduced_while_computing
from jaxdist.training.loss_scale import DynamicLossScale, all_finite, ended_step
from jaxdist.training.sharded_step import build_sharded_step
from jaxdist.training.step_options import (
    WAIT_FREE_UNROLL_LIMIT,
    check_allreduce,
    check_gather,
    check_optimizer,
    check_prefetch,
    check_sharded,
    check_tensor,
    check_wait_free,
    donation_default,
    gather_options,
)

__all__ = [
    "NO_ALLREDUCE",
    "LossFn",
    "TrainState",
    "TrainStep",
    "classifier_loss",
    "place_per_process",
]

# Measurement only: skip the gradient allreduce, so each device trains on its own shard. The
# train-step benchmark times this to split a step into compute and communication.
NO_ALLREDUCE = "none"

LossFn = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, tuple[Any, dict]]]


class TrainState(struct.PyTreeNode):
    """Everything a step changes. A pytree: it is donated, sharded and checkpointed as one."""

    step: jax.Array
    params: Any
    model_state: Any
    opt_state: Any
    loss_scale: DynamicLossScale | None = None


def place_per_process(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` (the same on every process) placed with ``sharding``, each process filling
    only its own devices. ``jax.device_put`` would first check across processes that all hold
    the same value: a blocking collective (before every step, for a learning rate), and for a
    whole train state an all-gather that ran 8 processes of one machine out of memory."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, host.__getitem__)


class TrainStep:
    """A jitted data-parallel train step on ``mesh``; see the module docstring.

    Args:
      loss_fn: ``(params, model_state, batch, rng) -> (loss, (model_state, metrics))`` on one
        device's shard; ``metrics`` is a dict of scalars.
      optimizer: any optax transformation.
      mesh: the device mesh; ``data_axes`` (default: all its axes) split the batch.
      allreduce: a name from :data:`jaxdist.comm.collectives.ALGORITHMS`, ``"auto"`` (a schedule
        per bucket and factors or not per dense layer, by the cost model on ``links``), or
        :data:`NO_ALLREDUCE` (for measurements only); ``allreduce_options`` go to it
        (``transfer_dtype=jnp.bfloat16`` sends gradients in bf16, accumulating in float32).
      bucket_bytes: gradient fusion threshold; ``None`` or 0: one bucket for all gradients.
      sfb_layers: dense layers (flax module paths such as ``"head"``, or ``"all"``) whose
        gradient travels as sufficient factors (:mod:`jaxdist.training.dense_factors`). With
        ``"auto"`` these are the candidates (default: every dense layer; ``()``: none), each
        sent as factors only where the cost model says that is cheaper.
      links: the links the cost model prices on: ``"LATENCY:BANDWIDTH"``, a
        ``jaxdist bench allreduce --json`` file of this mesh, or a
        :class:`~jaxdist.comm.cost_model.Link`/``Network`` (see
        :func:`jaxdist.comm.hybrid.resolve_links`). Needed by ``"auto"`` (default: the link
        ``jaxdist cluster`` emulates); otherwise it only adds predictions to :meth:`plan`.
      accumulation_steps: micro-batches per device whose gradients are summed before one
        allreduce; the per-device batch must divide by it.
      sharding: ``"replicated"`` (default), ``"zero1"`` (optimizer state and update sharded)
        or ``"fsdp"`` (parameters too), over ``shard_axes``; see
        :mod:`jaxdist.training.sharding`. Every optax transformation is exact under each.
        The reduce-scatters and all-gathers run ``allreduce``'s two halves
        (:data:`jaxdist.comm.collectives.SHARDED_ALGORITHMS`).
      gather: the schedule of a sharded step's parameter all-gathers, when it is not
        ``allreduce``'s (``"native"`` beside a permute ``allreduce``: XLA's all-gather for the
        parameters, the schedule's reduce-scatter for the gradients). Default: ``allreduce``.
      zero1: the same as ``sharding="zero1"``.
      shard_axes: the data axes the state is sharded over (default: all of them). Fewer is
        HSDP: sharded inside each group, the groups averaging their gradients as data
        parallel replicas (with the ring, or XLA's all-reduce under ``native``).
      keep_gathered: FSDP keeps each unit's gathered parameters from forward for backward
        instead of gathering them again (more memory, half the parameter traffic).
      prefetch: how many layers ahead of its use FSDP may start a layer's gather, in forward
        and in backward (default 1: beside the layer before). More gives a gather more
        compute to hide behind and holds that many more layers gathered at once.
      min_shard_elements: parameters with fewer elements stay whole on every device.
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
      wait_free: run each gradient bucket's schedule beside the rest of the backward pass,
        one message step per matrix product, in the compiled program's own order
        (:mod:`jaxdist.training.wait_free`); the same arithmetic. With accumulation, beside
        the last micro-batch's backward. Needs a permute schedule, and no sufficient factors
        or ZeRO-1.
      loss_scale: a :class:`DynamicLossScale` for float16 training, or ``None``.
      skip_nonfinite: a step whose loss, gradients or updated parameters hold inf/NaN leaves
        the state as it was (but for the step count), as loss scaling does, and reports
        ``skipped`` in its metrics; without it such a step is applied and the trainer stops
        at it.
      donate: donate the state buffers to the step; ``None`` (default): on accelerators only,
        see :func:`~jaxdist.training.step_options.donation_default`.
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
        allreduce: str = "native",
        allreduce_options: Mapping[str, Any] | None = None,
        bucket_bytes: int | None = bucketing.DEFAULT_BUCKET_BYTES,
        sfb_layers: str | tuple[str, ...] | list[str] | None = None,
        links: Any = None,
        accumulation_steps: int = 1,
        sharding: str | None = None,
        gather: str | None = None,
        zero1: bool = False,
        shard_axes: str | tuple[str, ...] | None = None,
        keep_gathered: bool = False,
        prefetch: int = 1,
        min_shard_elements: int = sharding_lib.DEFAULT_MIN_SHARD_ELEMENTS,
        stacked_layers: Any = None,
        tensor: TensorParallel | None = None,
        wait_free: bool = False,
        loss_scale: DynamicLossScale | None = None,
        skip_nonfinite: bool = False,
        donate: bool | None = None,
        max_in_flight: dispatch.Limit = "auto",
    ):
        if allreduce not in (NO_ALLREDUCE, hybrid.AUTO, *collectives.ALGORITHMS):
            raise ValueError(
                f"unknown allreduce {allreduce!r}; expected one of "
                f"{(*collectives.ALGORITHMS, hybrid.AUTO)}"
            )
        if zero1 and sharding not in (None, "zero1"):
            raise ValueError(f"zero1=True is sharding='zero1'; got sharding={sharding!r} too")
        sharding = sharding_lib.check_sharding(sharding or ("zero1" if zero1 else "replicated"))
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        check_wait_free(wait_free, allreduce, sharding, sfb_layers)
        check_optimizer(optimizer)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.mesh = mesh
        self.data_axes = data_axes_of(mesh, data_axes)
        self.allreduce = allreduce
        self.allreduce_options = dict(allreduce_options or {})
        if allreduce in (NO_ALLREDUCE, hybrid.AUTO):
            collectives.common_options(self.allreduce_options)
        else:
            check_allreduce(mesh, self.data_axes, allreduce, self.allreduce_options)
        self.bucket_bytes = bucket_bytes
        self.sfb_layers = sfb_layers
        self.axis_sizes = tuple(mesh.shape[a] for a in np.atleast_1d(self.data_axes))
        self.sharding = sharding
        self.shard_axes = self.data_axes if shard_axes is None else data_axes_of(mesh, shard_axes)
        if sharding != "replicated":
            check_sharded(
                mesh,
                self.data_axes,
                self.shard_axes,
                sharding,
                allreduce,
                self.allreduce_options,
                sfb_layers,
            )
        self.gather = allreduce if gather is None else gather
        if gather is not None:
            check_gather(
                mesh, self.data_axes, self.shard_axes, sharding, gather, self.gather_options
            )
        self.keep_gathered = keep_gathered
        self.prefetch = check_prefetch(prefetch, sharding, keep_gathered)
        self.min_shard_elements = min_shard_elements
        self.stacked_layers = stacked_layers
        self.tensor = tensor
        if tensor is not None:
            check_tensor(mesh, self.data_axes, tensor, allreduce, sfb_layers, wait_free)
        self.layout: sharding_lib.Layout | None = None
        # How many layers FSDP's paced gathers cut the loss into, once the step is traced.
        self.paced_layers: int | None = None
        # Auto cannot choose without links: refuse now, not at the first step.
        self.links = (
            hybrid.resolve_links(links, self.axis_sizes)
            if links is not None or allreduce == hybrid.AUTO
            else None
        )
        self.accumulation_steps = accumulation_steps
        self.wait_free = wait_free
        self.loss_scale = loss_scale
        self.skip_nonfinite = skip_nonfinite
        self.donate = donation_default(mesh) if donate is None else donate
        self.num_replicas = math.prod(self.axis_sizes)
        self.trace_count = 0  # how many times the step was traced (compiled); tests guard on it
        self.gradient_plan: GradientPlan | None = None
        self._compiled: Callable | None = None
        self._in_flight = dispatch.shared_window(mesh, max_in_flight)

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
        model_state)`` and the optimizer's init run under ``jax.jit`` with the state's layout
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
            loss_scale=self.loss_scale,
        )

    def layout_of(self, params: Any) -> sharding_lib.Layout:
        """Where each parameter lives (:class:`~jaxdist.training.sharding.Layout`): split over
        the shard axes, or whole; replicated steps keep every parameter whole."""
        if self.layout is None:
            shards = math.prod(self.mesh.shape[a] for a in np.atleast_1d(self.shard_axes))
            if self.sharding == "replicated":
                shards = 1
            tensor = self.tensor
            self.layout = sharding_lib.Layout.of(
                params,
                shards,
                unit_bytes=self.bucket_bytes,
                min_elements=self.min_shard_elements,
                stacked=self.stacked_layers,
                tensor=None
                if tensor is None
                else (tensor.axis, self.mesh.shape[tensor.axis], tensor.dims),
            )
        return self.layout

    def parameter_specs(self, params: Any) -> tuple[Any, Any]:
        """``(whole, blocks)``: PartitionSpecs of the parameters kept whole over the shard
        axes (split over a tensor axis alone, if any), and of the blocks each device owns
        (ZeRO-1's gradients and optimizer state, FSDP's parameters too; the same as
        ``whole`` for a replicated step)."""
        layout = self.layout_of(params)
        treedef = jax.tree.structure(params)
        whole = layout.specs(treedef, None)
        if self.sharding == "replicated":
            return whole, whole
        return whole, layout.specs(treedef, self.shard_axes)

    def state_specs(self, state: TrainState) -> TrainState:
        """PartitionSpecs of the state: replicated, but for the sharded state of ZeRO-1
        (optimizer state) and FSDP (parameters and optimizer state), and the parameters a
        tensor axis splits (with their optimizer state)."""
        replicated = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
        whole, blocks = self.parameter_specs(state.params)
        params = blocks if self.sharding == "fsdp" else whole
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
        """Place a batch on this step's mesh; see :func:`shard_batch`."""
        return shard_batch(self.mesh, self.data_axes, batch)

    def set_learning_rate(self, state: TrainState, learning_rate: float) -> TrainState:
        """The state with ``learning_rate`` in its ``inject_hyperparams`` optimizer state (see
        :func:`jaxdist.training.optim.set_learning_rate`)."""
        # Placed like the rest of the state, so the jitted step sees the same shardings.
        value = place_per_process(np.float32(learning_rate), NamedSharding(self.mesh, P()))
        return state.replace(opt_state=optim.set_learning_rate(state.opt_state, value))

    def whole_variables(self, state: TrainState) -> tuple[Any, Any]:
        """``(params, model_state)``: every device holds the whole model."""
        return state.params, state.model_state

    # ------------------------------------------------------------------ the step

    def __call__(self, state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, dict]:
        check_batch_sizes(batch)
        if self._compiled is None:
            self._compiled = self._build(state)
        self._in_flight.make_room()
        new_state, metrics = self._compiled(state, batch, rng)
        self._in_flight.add(metrics)  # metrics, never donated: safe to wait on later
        return new_state, metrics

    def record_paced_layers(self, count: int) -> None:
        """Called as FSDP's paced loss is traced: how many layers it gathers one by one."""
        self.paced_layers = count

    def lower(self, state: TrainState, batch: Any, rng: jax.Array):
        """The lowered step (``.compile().as_text()`` shows XLA's scheduled program)."""
        if self._compiled is None:
            self._compiled = self._build(state)
        return self._compiled.lower(state, batch, rng)

    def _build(self, state: TrainState) -> Callable:
        if self.sharding != "replicated" or self.tensor is not None:
            return build_sharded_step(self, state)
        specs = self.state_specs(state)
        sharded = jax.shard_map(
            self._body,
            mesh=self.mesh,
            in_specs=(specs, P(self.data_axes), P()),
            out_specs=(specs, P()),
            check_vma=False,
        )
        return jax.jit(
            sharded,
            donate_argnums=(0,) if self.donate else (),
            compiler_options=compiler_options_for(
                self.mesh.devices.flat, self.allreduce, self.wait_free
            ),
        )

    def _body(self, state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, dict]:
        self.trace_count += 1
        axes = self.data_axes
        rng = jax.random.fold_in(rng, lax.axis_index(axes))
        scale = None if state.loss_scale is None else state.loss_scale.scale
        plan = self._plan_for(state, batch, rng)
        if self.wait_free:
            options = {**self.allreduce_options, "unroll_limit": WAIT_FREE_UNROLL_LIMIT}
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
                tap=None if plan is None or self.allreduce == NO_ALLREDUCE else plan.tap,
            )
        # Every device leaves the step with the same model state and metrics.
        with jax.named_scope(MODEL_STATE_SCOPE):
            model_state = lax.pmean(model_state, axes)
        with jax.named_scope(METRICS_SCOPE):
            loss, metrics = lax.pmean((loss, metrics), axes)

        if self.allreduce != NO_ALLREDUCE and not self.wait_free:
            grads = plan.reduce(grads, factors, axes, self.allreduce_options)
        if state.loss_scale is not None:
            grads = state.loss_scale.unscale(grads)
        # Same on every device: they all hold the same reduced gradients.
        checked = state.loss_scale is not None or self.skip_nonfinite
        finite = all_finite(grads) if checked else None
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)

        return ended_step(
            state, params, model_state, opt_state, finite, loss, metrics, self.skip_nonfinite
        )

    @property
    def gather_options(self) -> dict[str, Any]:
        """The options of the parameters' all-gathers (:func:`~jaxdist.training.step_options.
        gather_options`)."""
        return gather_options(self.gather, self.allreduce_options)

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
        if self.sharding != "replicated":
            raise ValueError(
                f"sharding={self.sharding!r} has no gradient plan: its gradients "
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
            self.gradient_plan = plan_for_step(self, state, batch, rng)
        return self.gradient_plan


# --------------------------------------------------------------------------- flax classifiers


def classifier_loss(model, *, num_classes: int, label_smoothing: float = 0.0) -> LossFn:
    """``loss_fn`` for a flax linen classifier taking ``(images, train=...)`` with BatchNorm
    state in the ``batch_stats`` collection; batches are ``{"image", "label"}`` dicts."""

    def loss_fn(params, model_state, batch, rng):
        variables = {"params": params, **model_state}
        logits, new_state = model.apply(
            variables, batch["image"], train=True, mutable=list(model_state), rngs={"dropout": rng}
        )
        loss = optim.smoothed_cross_entropy(
            logits, batch["label"], num_classes, label_smoothing
        ).mean()
        accuracy = (jnp.argmax(logits, -1) == batch["label"]).mean()
        return loss, (new_state, {"accuracy": accuracy})

    return loss_fn
