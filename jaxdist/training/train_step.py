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
3. applies the optax update -- or, with ``zero1=True``, reduce-scatters the gradients, updates
   only its own 1/p slice of the parameters and optimizer state, and all-gathers the parameters.

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
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.comm import buckets as bucketing
from jaxdist.comm import collectives, hybrid
from jaxdist.comm.compiler_options import compiler_options_for
from jaxdist.comm.scopes import METRICS_SCOPE, MODEL_STATE_SCOPE
from jaxdist.runtime import dispatch
from jaxdist.training import optim
from jaxdist.training.batches import check_batch_sizes, data_axes_of, shard_batch
from jaxdist.training.gradient_plan import GradientPlan, plan_for_step
from jaxdist.training.gradients import local_gradients, reduced_while_computing
from jaxdist.training.loss_scale import DynamicLossScale, all_finite, finish_scaled_step
from jaxdist.training.step_options import (
    WAIT_FREE_UNROLL_LIMIT,
    check_allreduce,
    check_optimizer,
    check_shardable,
    check_wait_free,
    donation_default,
)
from jaxdist.training.zero1 import zero1_update

__all__ = [
    "NO_ALLREDUCE",
    "LossFn",
    "TrainState",
    "TrainStep",
    "classifier_loss",
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


class TrainStep:
    """A jitted data-parallel train step on ``mesh``; see the module docstring.

    Args:
      loss_fn: ``(params, model_state, batch, rng) -> (loss, (model_state, metrics))`` on one
        device's shard; ``metrics`` is a dict of scalars.
      optimizer: any optax transformation (with ``zero1``: an element-wise one, see below).
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
      zero1: shard optimizer state and the update across the data axes (ZeRO stage 1). The
        optimizer then sees one flat float32 vector per device, so it must be element-wise
        (SGD, momentum, Adam, ...): per-layer rules (LARS trust ratios, masks by ndim) and
        global-norm clipping need more than a slice, and are refused in one line (the
        update is probed on the host when the step is built).
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
        zero1: bool = False,
        wait_free: bool = False,
        loss_scale: DynamicLossScale | None = None,
        skip_nonfinite: bool = False,
        donate: bool | None = None,
        max_in_flight: dispatch.Limit = "auto",
    ):
        if allreduce not in (NO_ALLREDUCE, hybrid.AUTO, *collectives.ALGORITHMS):
            raise ValueError(f"unknown allreduce {allreduce!r}; expected one of "
                             f"{(*collectives.ALGORITHMS, hybrid.AUTO)}")  # fmt: skip
        if zero1 and (allreduce == hybrid.AUTO or sfb_layers):
            raise ValueError("zero1=True reduce-scatters one flat gradient vector with the ring; "
                             "it takes neither allreduce='auto' nor sfb_layers")  # fmt: skip
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        check_wait_free(wait_free, allreduce, zero1, sfb_layers)
        check_optimizer(optimizer)
        if zero1:
            check_shardable(optimizer, by="elements")
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
        # Auto cannot choose without links: refuse now, not at the first step.
        self.links = (
            hybrid.resolve_links(links, self.axis_sizes)
            if links is not None or allreduce == hybrid.AUTO
            else None
        )
        self.accumulation_steps = accumulation_steps
        self.zero1 = zero1
        self.wait_free = wait_free
        self.loss_scale = loss_scale
        self.skip_nonfinite = skip_nonfinite
        self.donate = donation_default(mesh) if donate is None else donate
        self.num_replicas = math.prod(self.axis_sizes)
        self.trace_count = 0  # how many times the step was traced (compiled); tests guard on it
        self.gradient_plan: GradientPlan | None = None
        self._compiled: Callable | None = None
        self._zero_size: int | None = None
        self._in_flight = dispatch.shared_window(mesh, max_in_flight)

    # ------------------------------------------------------------------ state and batches

    def init(self, params: Any, model_state: Any = None) -> TrainState:
        """The initial state, placed on the mesh (replicated; ZeRO-1 state sharded)."""
        state = self._fresh_state(jax.tree.map(jnp.asarray, params), model_state)

        def place(leaf, spec):
            # Each process places its own devices' part. device_put would also check that
            # every process holds the same values by all-gathering the whole state, which
            # for a 0.5 GB model on 8 processes of one machine ran it out of memory.
            host = np.asarray(leaf)
            sharding = NamedSharding(self.mesh, spec)
            return jax.make_array_from_callback(host.shape, sharding, host.__getitem__)

        state = jax.tree.map(place, state, self.state_specs(state))
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

    def _fresh_state(self, params: Any, model_state: Any) -> TrainState:
        model_state = {} if model_state is None else model_state
        if self.zero1:
            flat, _ = ravel_pytree(params)
            if flat.dtype != jnp.float32:
                raise TypeError(f"zero1 keeps a float32 master copy; parameters are {flat.dtype}")
            self._zero_size = self.num_replicas * -(-flat.size // self.num_replicas)
            opt_state = self.optimizer.init(jnp.zeros((self._zero_size,), jnp.float32))
        else:
            opt_state = self.optimizer.init(params)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            model_state=model_state,
            opt_state=opt_state,
            loss_scale=self.loss_scale,
        )

    def state_specs(self, state: TrainState) -> TrainState:
        """PartitionSpecs of the state: replicated, except ZeRO-1's optimizer-state slices."""

        def opt_spec(leaf):
            if self.zero1 and leaf.shape == (self._zero_size,):
                return P(self.data_axes)
            return P()

        return TrainState(
            step=P(),
            params=jax.tree.map(lambda _: P(), state.params),
            model_state=jax.tree.map(lambda _: P(), state.model_state),
            opt_state=jax.tree.map(opt_spec, state.opt_state),
            loss_scale=jax.tree.map(lambda _: P(), state.loss_scale),
        )

    def shard_batch(self, batch: Any) -> Any:
        """Place a batch on this step's mesh; see :func:`shard_batch`."""
        return shard_batch(self.mesh, self.data_axes, batch)

    def set_learning_rate(self, state: TrainState, learning_rate: float) -> TrainState:
        """The state with ``learning_rate`` in its ``inject_hyperparams`` optimizer state (see
        :func:`jaxdist.training.optim.set_learning_rate`)."""
        # Placed like the rest of the state, so the jitted step sees the same shardings.
        value = jax.device_put(np.float32(learning_rate), NamedSharding(self.mesh, P()))
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

    def lower(self, state: TrainState, batch: Any, rng: jax.Array):
        """The lowered step (``.compile().as_text()`` shows XLA's scheduled program)."""
        if self._compiled is None:
            self._compiled = self._build(state)
        return self._compiled.lower(state, batch, rng)

    def _build(self, state: TrainState) -> Callable:
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
            compiler_options=compiler_options_for(self.mesh.devices.flat, self.allreduce),
        )

    def _body(self, state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, dict]:
        self.trace_count += 1
        axes = self.data_axes
        rng = jax.random.fold_in(rng, lax.axis_index(axes))
        scale = None if state.loss_scale is None else state.loss_scale.scale
        plan = None if self.zero1 else self._plan_for(state, batch, rng)
        if self.wait_free:
            options = {**self.allreduce_options, "unroll_limit": WAIT_FREE_UNROLL_LIMIT}
            grads, model_state, loss, metrics = reduced_while_computing(
                self.loss_fn, plan, state, batch, rng, scale, self.accumulation_steps, axes,
                options,
            )  # fmt: skip
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

        if self.zero1:
            params, opt_state, finite = zero1_update(
                self.optimizer,
                state,
                grads,
                self.data_axes,
                self._zero_size,
                self.allreduce_options,
                check_finite=self.skip_nonfinite,
            )
        else:
            if self.allreduce != NO_ALLREDUCE and not self.wait_free:
                grads = plan.reduce(grads, factors, axes, self.allreduce_options)
            if state.loss_scale is not None:
                grads = state.loss_scale.unscale(grads)
            # Same on every device: they all hold the same reduced gradients.
            checked = state.loss_scale is not None or self.skip_nonfinite
            finite = all_finite(grads) if checked else None
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)

        new_state = state.replace(
            step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state
        )
        if self.skip_nonfinite:  # nor may a finite step's update leave inf parameters
            finite = finite & jnp.isfinite(loss) & all_finite(params)
        return finish_scaled_step(state, new_state, finite, {**metrics, "loss": loss},
                                  report_skipped=self.skip_nonfinite)  # fmt: skip

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
            raise ValueError("the plan is made at the first step; before it, pass the state "
                             "and a batch: step.plan(state, batch)")  # fmt: skip
        if self.zero1:
            raise ValueError("zero1=True has no gradient plan: one ring reduce-scatter of "
                             "every gradient")  # fmt: skip
        local = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // self.num_replicas, *x.shape[1:]),
                                           x.dtype), batch)  # fmt: skip
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
