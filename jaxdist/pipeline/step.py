"""A pipeline-parallel train step: a model cut into stages over a mesh axis, micro-batches
streamed through them by a schedule, each stage's gradients averaged over the data axes.

The five-line use::

    step = PipelineStep(stage_fns, loss_fn, optax.sgd(0.1), mesh, microbatches=8, schedule="1f1b")
    state = step.init(params_per_stage, model_state_per_stage)
    for batch in batches:
        state, metrics = step(state, step.shard_batch(batch), rng)

``stage_fns[v](params, model_state, x, rng) -> (y, model_state)`` is virtual stage v (stage
v mod S, chunk v div S); ``loss_fn(outputs, micro_batch) -> (loss, metrics)`` runs on the last
one's output. Inside one jitted shard_map program each device

1. steps through the schedule's table (:mod:`jaxdist.pipeline.program`), one tick per loop
   turn: the forward or backward pass of one micro-batch on its stage, or nothing; then sends
   its output activation to the next stage and its input gradient to the previous one, by
   collective permutes along the stage axis;
2. averages its stage's gradients (summed over micro-batches) over the data axes with any
   :mod:`jaxdist.comm.collectives` schedule, in buckets;
3. updates its own stage's parameters and optimizer state with the optax optimizer.

Each device holds only its stage's parameters, model state and optimizer state, as flat vectors
padded to the largest stage's (:class:`~jaxdist.pipeline.stages.FlatLayout`). A stage keeps
only its input per micro-batch in flight and recomputes its forward pass during the backward
(GPipe's re-materialisation): the stash is what the schedule decides, M inputs per stage for
GPipe, about S for 1F1B. The recomputation sees the stage's model state as it is by then, so a
stage's training-mode output must not depend on its model state -- true of BatchNorm, which
normalises each micro-batch with that micro-batch's statistics, as in GPipe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
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
from jaxdist.comm import collectives
from jaxdist.comm.compiler_options import compiler_options_for
from jaxdist.comm.scopes import GRADIENT_SCOPE
from jaxdist.pipeline import schedules
from jaxdist.pipeline.passes import branches, update
from jaxdist.pipeline.program import Program, compile_schedule
from jaxdist.pipeline.stages import ActivationLayout, FlatLayout, StageFn
from jaxdist.runtime import dispatch
from jaxdist.training.batches import (
    check_batch_sizes,
    data_axes_of,
    shard_batch,
    split_micro_batches,
)
from jaxdist.training.loss_scale import DynamicLossScale, all_finite, finish_scaled_step
from jaxdist.training.train_step import NO_ALLREDUCE, check_allreduce, donation_default

__all__ = ["PipelineLossFn", "PipelineState", "PipelineStep", "stage_data_axes"]

PipelineLossFn = Callable[[jax.Array, Any], tuple[jax.Array, dict]]


class PipelineState(struct.PyTreeNode):
    """A pipeline's state. ``params``, ``model_state`` and ``opt_state`` are arrays of shape
    ``(stages, chunks, size)``, split over the stage axis: one flat padded vector per virtual
    stage (:meth:`PipelineStep.unstack` gives the trees back)."""

    step: jax.Array
    params: jax.Array
    model_state: jax.Array
    opt_state: jax.Array
    loss_scale: DynamicLossScale | None = None


def stage_data_axes(mesh: Mesh, stage_axis: str) -> tuple[str, ...]:
    """The data axes of a pipeline mesh: every axis but the stage axis, in mesh order."""
    if stage_axis not in mesh.axis_names:
        raise ValueError(
            f"the mesh has axes {tuple(mesh.axis_names)} and no stage axis {stage_axis!r}; "
            f"build one with a stage axis (e.g. the mesh preset 'pipeline-2x4') or pass "
            f"stage_axis= naming one of its axes"
        )
    return tuple(a for a in mesh.axis_names if a != stage_axis)


class PipelineStep:
    """A jitted pipeline-parallel train step on ``mesh``; see the module docstring.

    Args:
      stages: one function per virtual stage, ``stages * chunks`` of them in pipeline order.
      loss_fn: ``(outputs, micro_batch) -> (loss, metrics)``, the mean loss of a micro-batch.
      optimizer: any optax transformation; it sees one stage's parameter tree at a time, so
        per-layer rules (LARS) work.
      mesh: a mesh with a ``stage_axis``; its other axes are data axes.
      microbatches: micro-batches per device per step; the per-device batch must divide by it.
      schedule: one of :data:`jaxdist.pipeline.schedules.SCHEDULES`.
      chunks: model chunks per device for the interleaved schedule (1 otherwise).
      inputs: picks the first stage's input out of a micro-batch (default ``batch["image"]``).
      allreduce, allreduce_options, bucket_bytes: how each stage's gradients are averaged over
        the data axes, as for :class:`jaxdist.training.train_step.TrainStep`.
      loss_scale: a :class:`DynamicLossScale` for float16 training, or ``None``.
      donate, max_in_flight: as for :class:`~jaxdist.training.train_step.TrainStep`.
    """

    def __init__(
        self,
        stages: Sequence[StageFn],
        loss_fn: PipelineLossFn,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        *,
        microbatches: int,
        schedule: str = "1f1b",
        chunks: int = 1,
        stage_axis: str = "stage",
        inputs: Callable[[Any], jax.Array] = lambda batch: batch["image"],
        allreduce: str = "native",
        allreduce_options: Mapping[str, Any] | None = None,
        bucket_bytes: int | None = bucketing.DEFAULT_BUCKET_BYTES,
        loss_scale: DynamicLossScale | None = None,
        donate: bool | None = None,
        max_in_flight: dispatch.Limit = "auto",
    ):
        self.data_axes = stage_data_axes(mesh, stage_axis)
        self.num_stages = mesh.shape[stage_axis]
        chunks = chunks if schedule == "interleaved" else 1
        self.program: Program = compile_schedule(
            schedules.build(schedule, self.num_stages, microbatches, chunks)
        )
        virtual = self.num_stages * chunks
        if len(stages) != virtual:
            raise ValueError(
                f"{len(stages)} stage functions for {self.num_stages} stages on axis "
                f"{stage_axis!r} with {chunks} chunk(s) each: expected {virtual}"
            )
        if allreduce != NO_ALLREDUCE and allreduce not in collectives.ALGORITHMS:
            raise ValueError(
                f"unknown allreduce {allreduce!r}; expected one of {collectives.ALGORITHMS}"
            )
        # The data axes as the collectives take them: one name, or a tuple of two.
        self._reduce_axes = data_axes_of(mesh, self.data_axes) if self.data_axes else None
        if allreduce != NO_ALLREDUCE and self.data_axes:
            check_allreduce(mesh, self._reduce_axes, allreduce, dict(allreduce_options or {}))
        self.stages = list(stages)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.mesh = mesh
        self.stage_axis = stage_axis
        self.microbatches = microbatches
        self.chunks = chunks
        self.inputs = inputs
        self.allreduce = allreduce
        self.allreduce_options = dict(allreduce_options or {})
        self.bucket_bytes = bucket_bytes
        self.loss_scale = loss_scale
        self.donate = donation_default(mesh) if donate is None else donate
        self.num_replicas = int(np.prod([mesh.shape[a] for a in self.data_axes]))
        self.trace_count = 0  # how many times the step was traced (compiled)
        self.layouts: dict[str, FlatLayout] | None = None
        self.activations: ActivationLayout | None = None
        self._compiled: Callable | None = None
        self._learning_rate_at: tuple | None = None
        self._in_flight = dispatch.shared_window(mesh, max_in_flight)

    # ------------------------------------------------------------------ state and batches

    def init(
        self, params: Sequence[Any], model_state: Sequence[Any] | None = None
    ) -> PipelineState:
        """The initial state from per-virtual-stage trees, each stage's part on its devices."""
        model_state = [{}] * len(self.stages) if model_state is None else list(model_state)
        params = [jax.tree.map(jnp.asarray, p) for p in params]
        opt_states = [self.optimizer.init(p) for p in params]
        self._set_layouts(params, model_state, opt_states)
        trees = {"params": params, "model_state": model_state, "opt_state": opt_states}
        stacked = {name: self._stack(name, trees[name]) for name in trees}
        sharding = NamedSharding(self.mesh, P(self.stage_axis))
        replicated = NamedSharding(self.mesh, P())
        return PipelineState(
            step=jax.device_put(jnp.zeros((), jnp.int32), replicated),
            # Each process places only its own devices' stages (no cross-process check).
            **{
                name: jax.make_array_from_callback(array.shape, sharding, array.__getitem__)
                for name, array in stacked.items()
            },
            loss_scale=jax.device_put(self.loss_scale, replicated),
        )

    def abstract_init(
        self, params: Sequence[Any], model_state: Sequence[Any] | None = None
    ) -> PipelineState:
        """What :meth:`init` would return, as ``jax.ShapeDtypeStruct`` leaves with their
        shardings; the trees may be shapes. Nothing is placed on devices, so the step can be
        compiled for devices that are not here (:mod:`jaxdist.aot`)."""
        model_state = [{}] * len(self.stages) if model_state is None else list(model_state)
        opt_states = [jax.eval_shape(self.optimizer.init, p) for p in params]
        self._set_layouts(params, model_state, opt_states)
        sharded = NamedSharding(self.mesh, P(self.stage_axis))
        replicated = NamedSharding(self.mesh, P())

        def stacked(name):
            layout = self.layouts[name]
            shape = (self.num_stages, self.chunks, layout.size)
            return jax.ShapeDtypeStruct(shape, layout.dtype, sharding=sharded)

        return PipelineState(
            step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
            params=stacked("params"),
            model_state=stacked("model_state"),
            opt_state=stacked("opt_state"),
            loss_scale=jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                self.loss_scale,
            ),
        )

    def _set_layouts(self, params: list, model_state: list, opt_states: list) -> None:
        virtual = len(self.stages)
        if len(params) != virtual or len(model_state) != virtual:
            raise ValueError(
                f"init needs one parameter tree and one model-state tree per virtual stage "
                f"({virtual}); got {len(params)} and {len(model_state)}"
            )
        # Shapes only: where a hyperparameter lands in the flat state (set_learning_rate).
        self._opt_shapes = [
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), o) for o in opt_states
        ]
        self.layouts = {
            "params": FlatLayout(params),
            "model_state": FlatLayout(model_state),
            "opt_state": FlatLayout(opt_states),
        }

    def _stack(self, name: str, trees: list[Any]) -> np.ndarray:
        layout = self.layouts[name]
        S = self.num_stages
        out = np.zeros((S, self.chunks, layout.size), layout.dtype)
        for v, tree in enumerate(trees):
            out[v % S, v // S] = np.asarray(layout.flatten(tree))
        return out

    def unstack(self, state: PipelineState) -> tuple[list[Any], list[Any]]:
        """``(params, model_state)`` per virtual stage, as trees on the host (one process)."""
        if self.layouts is None:
            raise RuntimeError("unstack needs the layouts that init() records; call init first")
        S = self.num_stages
        params, model_state = np.asarray(state.params), np.asarray(state.model_state)
        return (
            [self.layouts["params"].unflatten(v, params[v % S, v // S]) for v in range(len(self.stages))],
            [self.layouts["model_state"].unflatten(v, model_state[v % S, v // S]) for v in range(len(self.stages))],
        )  # fmt: skip

    def set_learning_rate(self, state: PipelineState, learning_rate: float) -> PipelineState:
        """Write ``learning_rate`` into every stage's ``inject_hyperparams`` state (see
        :func:`jaxdist.training.optim.set_learning_rate`) inside the flat optimizer state."""
        if self._learning_rate_at is None:
            self._learning_rate_at = self._hyperparameter_positions("learning_rate")
        stage, chunk, offset = self._learning_rate_at
        value = jnp.asarray(learning_rate, state.opt_state.dtype)
        return state.replace(opt_state=_write_at(state.opt_state, stage, chunk, offset, value))

    def _hyperparameter_positions(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(stage, chunk, offset) of hyperparameter ``name`` in every virtual stage's flat
        optimizer state, found by raveling each state with only that leaf set."""
        layout = self.layouts["opt_state"]
        S, positions = self.num_stages, []
        for v, opt_state in enumerate(self._opt_shapes):
            marked = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), opt_state)
            if optax.tree_utils.tree_get(marked, name) is None:
                raise KeyError(
                    f"optimizer state has no {name!r} hyperparameter; build the optimizer with "
                    f"jaxdist.training.optim.make_optimizer (or optax.inject_hyperparams)"
                )
            marked = optax.tree_utils.tree_set(marked, **{name: jnp.ones(())})
            for offset in np.flatnonzero(np.asarray(layout.flatten(marked))):
                positions.append((v % S, v // S, offset))
        return tuple(np.array(column) for column in zip(*positions))

    def bytes_per_step(self) -> dict[str, int]:
        """What each device sends per step, known once the step was traced: ``messages``
        between stages of ``message_bytes`` each (the largest boundary's activation for one
        micro-batch) and ``gradient_bytes``, its stage gradients, which the data axes'
        allreduce averages (padded to the largest stage)."""
        if self.activations is None:
            raise RuntimeError(
                "bytes_per_step is known once the step was traced (call or lower it)"
            )
        return {
            "messages": self.program.messages_per_step,
            "message_bytes": self.activations.size * np.dtype(self.activations.dtype).itemsize,
            "gradient_bytes": self.chunks * self.layouts["params"].size * 4,
        }

    def shard_batch(self, batch: Any) -> Any:
        """Place a batch on the mesh: split over the data axes, the same on every stage."""
        if not self.data_axes:
            return jax.device_put(batch, NamedSharding(self.mesh, P()))
        return shard_batch(self.mesh, self.data_axes, batch)

    # ------------------------------------------------------------------ the step

    def __call__(
        self, state: PipelineState, batch: Any, rng: jax.Array
    ) -> tuple[PipelineState, dict]:
        check_batch_sizes(batch)
        self._check_batch(batch)
        if self._compiled is None:
            self._compiled = self._build(state)
        self._in_flight.make_room()
        new_state, metrics = self._compiled(state, batch, rng)
        self._in_flight.add(metrics)
        return new_state, metrics

    def lower(self, state: PipelineState, batch: Any, rng: jax.Array):
        """The lowered step (``.compile().memory_analysis()`` gives its per-device memory)."""
        self._check_batch(batch)
        if self._compiled is None:
            self._compiled = self._build(state)
        return self._compiled.lower(state, batch, rng)

    def _build(self, state: PipelineState) -> Callable:
        if self.layouts is None:
            raise RuntimeError("the step's layouts come from init(); call init first")
        stage = P(self.stage_axis)
        specs = PipelineState(step=P(), params=stage, model_state=stage, opt_state=stage,
                              loss_scale=jax.tree.map(lambda _: P(), state.loss_scale))  # fmt: skip
        batch_spec = P(self.data_axes) if self.data_axes else P()
        sharded = jax.shard_map(
            self._body,
            mesh=self.mesh,
            in_specs=(specs, batch_spec, P()),
            out_specs=(specs, P()),
            check_vma=False,
        )
        options = compiler_options_for(self.mesh.devices.flat, self.allreduce)
        return jax.jit(
            sharded, donate_argnums=(0,) if self.donate else (), compiler_options=options
        )

    def _check_batch(self, batch: Any) -> None:
        """Refuse, before compiling, a batch whose per-device part does not split into the
        micro-batches."""
        size = jax.tree.leaves(batch)[0].shape[0]
        M, replicas = self.microbatches, self.num_replicas
        if size % (M * replicas):
            raise ValueError(
                f"a batch of {size} over {replicas} data-parallel replica(s) does not split "
                f"into microbatches={M} per replica; use a multiple of {M * replicas} or "
                f"another micro-batch count"
            )

    def _activation_layout(self, micro: Any) -> tuple[ActivationLayout, Any]:
        """Shapes sent between stages for one micro-batch, and the loss's metrics' shapes."""
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micro)
        x = jax.eval_shape(self.inputs, one)
        shapes = []
        for v, apply in enumerate(self.stages):
            p = jax.eval_shape(
                functools.partial(self.layouts["params"].unflatten, v), self._flat("params")
            )
            ms = jax.eval_shape(
                functools.partial(self.layouts["model_state"].unflatten, v),
                self._flat("model_state"),
            )
            x, _ = jax.eval_shape(apply, p, ms, x, jax.random.key(0))
            shapes.append(x)
        _, metrics = jax.eval_shape(self.loss_fn, shapes[-1], one)
        return ActivationLayout(tuple(shapes[:-1])), metrics

    def _flat(self, name: str) -> jax.ShapeDtypeStruct:
        layout = self.layouts[name]
        return jax.ShapeDtypeStruct((layout.size,), layout.dtype)

    def _body(self, state: PipelineState, batch: Any, rng: jax.Array):
        self.trace_count += 1
        S = self.num_stages
        stage = lax.axis_index(self.stage_axis)
        if self.data_axes:
            rng = jax.random.fold_in(rng, lax.axis_index(self.data_axes))
        micro = split_micro_batches(batch, self.microbatches)
        self.activations, metric_shapes = self._activation_layout(micro)
        params, opt_state = state.params[0], state.opt_state[0]
        scale = None if state.loss_scale is None else state.loss_scale.scale
        acts = self.activations
        zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
        carry = {
            "stash": jnp.zeros((self.program.input_slots + 1, acts.size), acts.dtype),
            "grad_stash": jnp.zeros((self.program.grad_slots + 1, acts.size), acts.dtype),
            "grads": jnp.zeros(params.shape, jnp.float32),
            "model_state": state.model_state[0],
            "loss": jnp.zeros((), jnp.float32),
            "metrics": zeros(metric_shapes),
            "send_forward": jnp.zeros((acts.size,), acts.dtype),
            "send_backward": jnp.zeros((acts.size,), acts.dtype),
        }
        ops = branches(self, params, micro, rng, scale)
        tables = {
            name: jnp.asarray(getattr(self.program, name))
            for name in ("branch", "microbatch", "input_slot", "grad_slot",
                         "receive_input", "receive_grad")
        }  # fmt: skip
        forward_perm = [(i, i + 1) for i in range(S - 1)] + (
            [(S - 1, 0)] if self.chunks > 1 else []
        )
        backward_perm = [(i + 1, i) for i in range(S - 1)] + (
            [(0, S - 1)] if self.chunks > 1 else []
        )

        sends_forward = jnp.asarray(self.program.sends_forward)
        sends_backward = jnp.asarray(self.program.sends_backward)

        def send(active, message, perm):
            # Every device takes the same branch (the flag depends on the tick alone), so a
            # tick in which no stage sends that way sends nothing at all.
            return lax.cond(
                active,
                lambda m: lax.ppermute(m, self.stage_axis, perm),
                jnp.zeros_like,
                message,
            )

        def tick(t, carry):
            at = {name: table[t, stage] for name, table in tables.items()}
            carry = lax.switch(at["branch"], ops, carry, at["microbatch"], at["input_slot"],
                               at["grad_slot"])  # fmt: skip
            if S > 1:
                arrived = send(sends_forward[t], carry["send_forward"], forward_perm)
                returned = send(sends_backward[t], carry["send_backward"], backward_perm)
                carry = {
                    **carry,
                    "stash": carry["stash"].at[at["receive_input"]].set(arrived),
                    "grad_stash": carry["grad_stash"].at[at["receive_grad"]].set(returned),
                }
            return carry

        carry = lax.fori_loop(0, self.program.schedule.ticks, tick, carry)
        return self._finish(state, carry, params, opt_state, stage)

    def _finish(self, state, carry, params, opt_state, stage):
        """Average gradients over the data axes, update this stage, gather loss and metrics."""
        M = self.microbatches
        grads = carry["grads"] / M
        # Only the last stage computed the loss; every device reports it.
        loss, metrics = lax.psum((carry["loss"], carry["metrics"]), self.stage_axis)
        loss, metrics = loss / M, jax.tree.map(lambda x: x / M, metrics)
        model_state = carry["model_state"]
        if self.data_axes:
            model_state, loss, metrics = lax.pmean((model_state, loss, metrics), self.data_axes)
        if self.data_axes and self.allreduce != NO_ALLREDUCE:
            with jax.named_scope(GRADIENT_SCOPE):
                grads = self._allreduce(grads)
        finite = None
        if state.loss_scale is not None:
            grads = state.loss_scale.unscale(grads)
            # A non-finite gradient on any stage skips the step on all of them.
            finite = lax.pmin(all_finite(grads).astype(jnp.int32), self.stage_axis) > 0
        params, opt_state = update(self, params, grads, opt_state, stage)
        new_state = state.replace(
            step=state.step + 1,
            params=params[None],
            model_state=model_state[None],
            opt_state=opt_state[None],
        )
        return finish_scaled_step(state, new_state, finite, {**metrics, "loss": loss})

    def _allreduce(self, grads: jax.Array) -> jax.Array:
        """Mean over the data axes, in buckets of ``bucket_bytes``, the last chunk first."""
        flat = grads.reshape(-1)
        per_bucket = max(1, (self.bucket_bytes or flat.nbytes) // flat.dtype.itemsize)
        starts = list(range(0, flat.size, per_bucket))[::-1]
        pieces = {}
        for start in starts:
            (pieces[start],) = collectives.allreduce(
                [flat[start : start + per_bucket]], self._reduce_axes, self.allreduce, op="mean",
                **self.allreduce_options,
            )  # fmt: skip
        return jnp.concatenate([pieces[s] for s in sorted(pieces)]).reshape(grads.shape)


@jax.jit
def _write_at(array: jax.Array, stage, chunk, offset, value) -> jax.Array:
    return array.at[stage, chunk, offset].set(value)
