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

Under ``StateSharding("fsdp")`` each stage's parameters and optimizer state are also split over the
data axes (:mod:`jaxdist.pipeline.fsdp`): a device gathers its stage's parameters once, before
the first micro-batch, reduce-scatters the gradients after the last, and updates only its
shard.

Each device holds only its stage's parameters, model state and optimizer state, as flat vectors
padded to the largest stage's (:class:`~jaxdist.pipeline.stages.FlatPacking`). A stage keeps
only its input per micro-batch in flight and recomputes its forward pass during the backward
(GPipe's re-materialisation): the stash is what the schedule decides, M inputs per stage for
GPipe, about S for 1F1B. The recomputation sees the stage's model state as it is by then, so a
stage's training-mode output must not depend on its model state -- true of BatchNorm, which
normalises each micro-batch with that micro-batch's statistics, as in GPipe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.comm.compiler_options import compiler_options_for
from jaxdist.comm.scopes import GRADIENT_SCOPE, PARAMETER_SCOPE
from jaxdist.pipeline import asynchronous, schedules
from jaxdist.pipeline import state as pipeline_state
from jaxdist.pipeline.fsdp import (
    ShardedFlatPacking,
    build_fsdp_step,
    gather_rows,
    rows_to_whole,
    scatter_rows,
    whole_to_rows,
)
from jaxdist.pipeline.options import (
    check_micro_batches,
    check_stage_count,
    check_stage_sharding,
    refuse_unsupported,
    stage_data_axes,
)
from jaxdist.pipeline.passes import activation_packing, mean_over_data_axes, run_schedule, update
from jaxdist.pipeline.program import Program, compile_schedule
from jaxdist.pipeline.stages import ActivationPacking, FlatPacking, StageFn, full_stage
from jaxdist.pipeline.state import PipelineState
from jaxdist.runtime import dispatch
from jaxdist.training.batches import (
    data_axes_of,
    shard_batch,
    split_micro_batches,
)
from jaxdist.training.compiled_step import CompiledStep
from jaxdist.training.loss_scale import all_finite, finish_scaled_step
from jaxdist.training.step_checks import check_allreduce, check_shardable
from jaxdist.training.step_options import NO_ALLREDUCE, Communication, Precision, StateSharding
from jaxdist.training.train_state import place_per_process

__all__ = ["PipelineLossFn", "PipelineState", "PipelineStep"]


def _image_of(batch: Any) -> jax.Array:
    """The first stage's input when the step is given no ``inputs=``."""
    return batch["image"]


PipelineLossFn = Callable[[jax.Array, Any], tuple[jax.Array, dict]]


class PipelineStep(CompiledStep):
    """A jitted pipeline-parallel train step on ``mesh``; see the module docstring.

    Args:
      stages: one function per virtual stage, ``stages * chunks`` of them in pipeline order:
        ``(params, model_state, x, rng) -> (y, model_state)``, or ``(params, x) -> y`` for a
        stage without model state or randomness.
      loss_fn: ``(outputs, micro_batch) -> (loss, metrics)``, the mean loss of a micro-batch.
      optimizer: any optax transformation; it sees one stage's parameter tree at a time, so
        per-layer rules (LARS) work, global-norm clipping works as
        :func:`jaxdist.training.global_norm.clip_by_global_norm` (its norm summed over every
        stage), and other rules over all layers are refused in one line.
      mesh: a mesh with a ``stage_axis``; its other axes are data axes.
      microbatches: micro-batches per device per step; the per-device batch must divide by it.
      schedule: one of :data:`jaxdist.pipeline.schedules.SCHEDULES`.
      chunks: model chunks per device for the interleaved schedule (1 otherwise).
      inputs: picks the first stage's input out of a micro-batch (default ``batch["image"]``).
      communication: how each stage's gradients are averaged over the data axes (the
        schedule, its options, the bucket size), as for
        :class:`jaxdist.training.train_step.TrainStep`; ``auto``, sufficient factors, links
        and wait-free pacing are refused in one line.
      sharding: ``StateSharding("replicated")`` (each stage's state whole on every device of
        that stage) or ``StateSharding("fsdp")``: split over the data axes, gathered once a
        step by its ``gather`` schedule (default the gradients'), gradients reduce-scattered
        by the communication's schedule; parameters with fewer than ``min_shard_elements``
        values stay whole. ZeRO-1, shard axes, prefetch and keep_gathered are refused.
      precision: a float16 loss scale, or skipped non-finite steps.
      split: ``(params, model_state) -> (params per virtual stage, model state per virtual
        stage)``; with it :meth:`init` and :meth:`abstract_init` take the whole model's trees
        (:func:`~jaxdist.pipeline.stages.variable_splitter` makes one for flax stages),
        without it one tree per virtual stage.
      accumulation_steps: refused unless 1: the micro-batches take its place.
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
        inputs: Callable[[Any], jax.Array] | None = None,
        communication: Communication = Communication(),
        sharding: StateSharding = StateSharding(),
        precision: Precision = Precision(),
        split: Callable[[Any, Any], tuple[list, list]] | None = None,
        accumulation_steps: int = 1,
        donate: bool | None = None,
        max_in_flight: dispatch.Limit = "auto",
    ):
        allreduce = communication.allreduce
        refuse_unsupported(communication, accumulation_steps, sharding, schedule)
        super().__init__(loss_fn, optimizer, mesh, communication, precision, donate, max_in_flight)
        # Whether the update sums over the whole model (global-norm clipping): then each
        # update adds its parts over the stages first (jaxdist.pipeline.passes.update).
        self.sums_over_model = check_shardable(optimizer, updates_together=schedule != "pipedream")
        asynchronous.check_options(schedule, precision.loss_scale, precision.skip_nonfinite, chunks)
        self.data_axes = stage_data_axes(mesh, stage_axis)
        self.num_stages = mesh.shape[stage_axis]
        chunks = chunks if schedule == "interleaved" else 1
        self.program: Program = compile_schedule(
            schedules.build(schedule, self.num_stages, microbatches, chunks)
        )
        check_stage_count(len(stages), self.num_stages, chunks, stage_axis)
        # The data axes as the collectives take them: one name, or a tuple of two.
        self.reduce_axes = data_axes_of(mesh, self.data_axes) if self.data_axes else None
        if allreduce != NO_ALLREDUCE and self.data_axes:
            check_allreduce(mesh, self.reduce_axes, allreduce, communication.options)
        check_stage_sharding(mesh, self.reduce_axes, stage_axis, sharding, communication)
        self.sharding = sharding
        self.schedule = schedule
        self.stages = [full_stage(fn) for fn in stages]
        self.stage_axis = stage_axis
        self.microbatches = microbatches
        self.chunks = chunks
        self.inputs = _image_of if inputs is None else inputs
        self.split = split
        self.accumulation_steps = 1
        self.num_replicas = int(np.prod([mesh.shape[a] for a in self.data_axes]))
        self.packings: dict[str, FlatPacking] | None = None
        self.activations: ActivationPacking | None = None
        self._learning_rate_at: tuple | None = None

    # ------------------------------------------------------------------ state and batches

    def init(self, params: Any, model_state: Any = None) -> PipelineState:
        """The initial state, each stage's part on its devices: from the whole model's trees
        when the step was given ``split``, else from one tree per virtual stage."""
        params, model_state = self._per_stage(params, model_state)
        params = [jax.tree.map(jnp.asarray, p) for p in params]
        opt_states = [self.optimizer.init(p) for p in params]
        self._set_packings(params, model_state, opt_states)
        trees = {"params": params, "model_state": model_state, "opt_state": opt_states}
        replicated = NamedSharding(self.mesh, P())
        stacked = {
            name: pipeline_state.stack(
                self.packings[name], trees[name], self.num_stages, self.chunks
            )
            for name in trees
        }
        # Each process places only its own devices' stages (and, under FSDP, shards).
        placed = {
            name: place_per_process(array, NamedSharding(self.mesh, self.state_spec(name)))
            for name, array in stacked.items()
        }
        return PipelineState(
            step=place_per_process(np.zeros((), np.int32), replicated),
            **placed,
            loss_scale=jax.tree.map(
                lambda x: place_per_process(x, replicated), self.precision.loss_scale
            ),
            previous_params=jnp.copy(placed["params"]) if self._two_versions else None,
        )

    def abstract_init(self, params: Any, model_state: Any = None) -> PipelineState:
        """What :meth:`init` would return, as ``jax.ShapeDtypeStruct`` leaves with their
        shardings; the trees may be shapes. Nothing is placed on devices, so the step can be
        compiled for devices that are not here (:mod:`jaxdist.aot`)."""
        params, model_state = self._per_stage(params, model_state)
        opt_states = [jax.eval_shape(self.optimizer.init, p) for p in params]
        self._set_packings(params, model_state, opt_states)
        replicated = NamedSharding(self.mesh, P())

        def stacked(name):
            packing = self.packings[name]
            shape = (self.num_stages, self.chunks, packing.size)
            sharded = NamedSharding(self.mesh, self.state_spec(name))
            return jax.ShapeDtypeStruct(shape, packing.dtype, sharding=sharded)

        return PipelineState(
            step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
            params=stacked("params"),
            model_state=stacked("model_state"),
            opt_state=stacked("opt_state"),
            loss_scale=jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                self.precision.loss_scale,
            ),
            previous_params=stacked("params") if self._two_versions else None,
        )

    def init_sharded(
        self, init_variables: Callable[[jax.Array], tuple[Any, Any]], rng: jax.Array
    ) -> PipelineState:
        """The initial state made straight into its shards (FSDP): ``init_variables(rng) ->
        (params, model_state)`` of the whole model, the cut into stages, the optimizer's init
        and the flat packings all run under ``jax.jit`` with the state's shardings as output,
        so the host never holds the whole state. Needs ``split``."""
        if self.split is None:
            raise ValueError(
                "init_sharded starts from the whole model's variables and needs "
                "split= to cut them into stages; without it call init() with one "
                "tree per virtual stage"
            )
        abstract = self.abstract_init(*jax.eval_shape(init_variables, rng))
        shardings = jax.tree.map(lambda leaf: leaf.sharding, abstract)

        def fresh(key):
            params, model_state = self._per_stage(*init_variables(key))
            trees = {
                "params": params,
                "model_state": model_state,
                "opt_state": [self.optimizer.init(p) for p in params],
            }
            stacked = {
                name: pipeline_state.stack_traced(
                    self.packings[name], trees[name], self.num_stages, self.chunks
                )
                for name in trees
            }
            return PipelineState(
                step=jnp.zeros((), jnp.int32),
                **stacked,
                loss_scale=self.precision.loss_scale,
                previous_params=stacked["params"] if self._two_versions else None,
            )

        return jax.jit(fresh, out_shardings=shardings)(rng)

    def state_spec(self, name: str) -> P:
        """Where the state's array ``name`` lives: split by stage, and under FSDP the
        parameters and optimizer state by rows over the data axes too."""
        if self.sharding.kind == "fsdp" and name in ("params", "opt_state"):
            return P(self.stage_axis, None, self.reduce_axes)
        return P(self.stage_axis)

    def _per_stage(self, params: Any, model_state: Any) -> tuple[list, list]:
        """One parameter tree and one model-state tree per virtual stage."""
        if self.split is not None:
            return self.split(params, {} if model_state is None else model_state)
        virtual = len(self.stages)
        model_state = [{}] * virtual if model_state is None else list(model_state)
        return list(params), model_state

    def _set_packings(self, params: list, model_state: list, opt_states: list) -> None:
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
        if self.sharding.kind == "fsdp":
            sharded = lambda trees: ShardedFlatPacking(  # noqa: E731
                trees, self.num_replicas, self.sharding.min_shard_elements
            )
        else:
            sharded = FlatPacking
        self.packings = {
            "params": sharded(params),
            "model_state": FlatPacking(model_state),
            "opt_state": sharded(opt_states),
        }
        # The parameters as the stages compute on them (under FSDP, once gathered).
        self.packings["gathered"] = getattr(
            self.packings["params"], "whole", self.packings["params"]
        )

    def unstack(self, state: PipelineState) -> tuple[list[Any], list[Any]]:
        """``(params, model_state)`` per virtual stage, as trees on the host (one process)."""
        if self.packings is None:
            raise RuntimeError("unstack needs the packings that init() records; call init first")
        S, count = self.num_stages, len(self.stages)
        return (
            pipeline_state.unstack(self.packings["params"], state.params, S, count),
            pipeline_state.unstack(self.packings["model_state"], state.model_state, S, count),
        )

    def whole_variables(self, state: PipelineState) -> tuple[dict, dict]:
        """``(params, model_state)`` of the whole model on the host, the stages' parts joined
        by name (for evaluation and export)."""
        return pipeline_state.join_stages(*self.unstack(state))

    def evaluation(self, eval_fn: Callable, params: Any) -> tuple[Callable, Any]:
        """``eval_fn`` on the whole model every device holds (:meth:`whole_variables` joins
        the stages), and the replicated specs of ``params``."""
        return eval_fn, jax.tree.map(lambda _: P(), params)

    def set_learning_rate(self, state: PipelineState, learning_rate: float) -> PipelineState:
        """Write ``learning_rate`` into every stage's ``inject_hyperparams`` state (see
        :func:`jaxdist.training.optim.set_learning_rate`) inside the flat optimizer state."""
        if self._learning_rate_at is None:
            self._learning_rate_at = pipeline_state.hyperparameter_positions(
                self.packings["opt_state"], self._opt_shapes, self.num_stages, "learning_rate"
            )
        stage, chunk, offset = self._learning_rate_at
        value = jnp.asarray(learning_rate, state.opt_state.dtype)
        return state.replace(
            opt_state=pipeline_state.write_at(state.opt_state, stage, chunk, offset, value)
        )

    @property
    def _two_versions(self) -> bool:
        return self.schedule == "pipedream_2bw"

    @property
    def averages_gradients(self) -> bool:
        """Whether stage gradients are averaged over data axes (there are some, and an
        allreduce is chosen)."""
        return bool(self.data_axes) and self.communication.allreduce != NO_ALLREDUCE

    def bytes_per_step(self) -> dict[str, int]:
        """What each device sends per step, known once the step was traced: ``messages``
        between stages of ``message_bytes`` each (the largest boundary's activation for one
        micro-batch), ``gradient_bytes``, its stage gradients, which the data axes'
        allreduce averages (padded to the largest stage; under FSDP its reduce-scatter), and
        ``parameter_bytes``, the stage parameters FSDP all-gathers (0 replicated)."""
        if self.activations is None:
            raise RuntimeError(
                "bytes_per_step is known once the step was traced (call or lower it)"
            )
        packing = self.packings["params"]
        fsdp = self.sharding.kind == "fsdp"
        gathered = packing.size * np.dtype(packing.dtype).itemsize if fsdp else 0
        return {
            "messages": self.program.messages_per_step,
            "message_bytes": self.activations.size * np.dtype(self.activations.dtype).itemsize,
            "gradient_bytes": self.chunks * packing.size * 4,
            "parameter_bytes": self.chunks * gathered,
        }

    def shard_batch(self, batch: Any) -> Any:
        """Place a batch on the mesh: split over the data axes, the same on every stage."""
        if not self.data_axes:
            return jax.device_put(batch, NamedSharding(self.mesh, P()))
        return shard_batch(self.mesh, self.data_axes, batch)

    # ------------------------------------------------------------------ the step

    def _check_batch(self, batch: Any) -> None:
        if self.inputs is _image_of and "image" not in batch:
            raise ValueError(
                f"PipelineStep takes the first stage's input from batch['image'] "
                f"unless given inputs=; this batch has {sorted(batch)}: pass "
                "inputs=lambda batch: batch[...]"
            )
        check_micro_batches(batch, self.microbatches, self.num_replicas)

    def _build(self, state: PipelineState) -> Callable:
        if self.packings is None:
            raise RuntimeError("the step's packings come from init(); call init first")
        if self.sharding.kind == "fsdp":
            return build_fsdp_step(self, state, self._body)
        stage = P(self.stage_axis)
        specs = PipelineState(
            step=P(),
            params=stage,
            model_state=stage,
            opt_state=stage,
            loss_scale=jax.tree.map(lambda _: P(), state.loss_scale),
            previous_params=stage if self._two_versions else None,
        )
        batch_spec = P(self.data_axes) if self.data_axes else P()
        sharded = jax.shard_map(
            self._body,
            mesh=self.mesh,
            in_specs=(specs, batch_spec, P()),
            out_specs=(specs, P()),
            check_vma=False,
        )
        options = compiler_options_for(self.mesh.devices.flat, self.communication.allreduce)
        return jax.jit(
            sharded, donate_argnums=(0,) if self.donate else (), compiler_options=options
        )

    def _body(self, state: PipelineState, batch: Any, rng: jax.Array):
        self.count_trace()
        stage = lax.axis_index(self.stage_axis)
        if self.data_axes:
            rng = jax.random.fold_in(rng, lax.axis_index(self.data_axes))
        micro = split_micro_batches(batch, self.microbatches)
        self.activations, metric_shapes = activation_packing(self, micro)
        params, opt_state = state.params[0], state.opt_state[0]
        scale = None if state.loss_scale is None else state.loss_scale.scale
        # 2BW computes on the older version; PipeDream's versions live in the loop.
        used = state.previous_params[0] if self._two_versions else params
        communication, sharding = self.communication, self.sharding
        if sharding.kind == "fsdp":  # every stage's parameters, gathered once for the step
            with jax.named_scope(PARAMETER_SCOPE):
                used = gather_rows(
                    params,
                    self.reduce_axes,
                    sharding.gather_schedule(communication),
                    sharding.gather_options(communication),
                    communication.bucket_bytes,
                )
            used = rows_to_whole(self, used, stage)
        per_backward = None
        if self.schedule == "pipedream":
            per_backward = asynchronous.PerBackward(self, params, opt_state, stage)
        carry = run_schedule(
            self, state, used, micro, rng, scale, metric_shapes, stage, per_backward
        )
        if sharding.kind == "fsdp":
            grads, model_state, loss, metrics = self._averaged(state, carry)
            finite = jnp.ones((), bool)  # read only under a loss scale or skip_nonfinite
            if self.precision.checks_finite:
                finite = all_finite(grads).astype(jnp.int32)  # each device has its own shard
                finite = lax.pmin(finite, (self.stage_axis, *self.data_axes)) > 0
            return grads[None], model_state[None], loss, metrics, finite
        return self._finish(state, carry, params, opt_state, stage)

    def _averaged(self, state, carry):
        """``(grads, model_state, loss, metrics)`` of the step: gradients averaged over the
        data axes (under FSDP reduce-scattered into this device's rows) and unscaled, the
        last stage's loss and metrics on every device."""
        M = self.microbatches
        grads = carry["grads"] / M
        # Only the last stage computed the loss; every device reports it.
        loss, metrics = lax.psum((carry["loss"], carry["metrics"]), self.stage_axis)
        loss, metrics = loss / M, jax.tree.map(lambda x: x / M, metrics)
        model_state = carry["model_state"]
        if self.data_axes:
            model_state, loss, metrics = lax.pmean((model_state, loss, metrics), self.data_axes)
        if self.averages_gradients and self.schedule != "pipedream":  # it averaged per tick
            with jax.named_scope(GRADIENT_SCOPE):
                if self.sharding.kind == "fsdp":
                    rows = whole_to_rows(self, grads, lax.axis_index(self.stage_axis))
                    communication = self.communication
                    grads = scatter_rows(
                        rows,
                        self.reduce_axes,
                        communication.allreduce,
                        communication.options,
                        communication.bucket_bytes,
                    )
                else:
                    grads = mean_over_data_axes(grads, self.reduce_axes, self.communication)
        if state.loss_scale is not None:
            grads = state.loss_scale.unscale(grads)
        return grads, model_state, loss, metrics

    def _finish(self, state, carry, params, opt_state, stage):
        """Average gradients over the data axes, update this stage, gather loss and metrics."""
        grads, model_state, loss, metrics = self._averaged(state, carry)
        finite = None
        if state.loss_scale is not None:
            # A non-finite gradient on any stage skips the step on all of them.
            finite = lax.pmin(all_finite(grads).astype(jnp.int32), self.stage_axis) > 0
        if self.schedule == "pipedream":  # updated after every backward
            params, opt_state = carry["params"], carry["opt_state"]
        else:
            params, opt_state = update(self, params, grads, opt_state, stage)
        if self.precision.skip_nonfinite:  # also a finite step whose update leaves inf parameters
            ok = all_finite((grads, params)) & jnp.isfinite(loss)
            ok = lax.pmin(ok.astype(jnp.int32), self.stage_axis) > 0
            finite = ok if finite is None else finite & ok
        new_state = state.replace(
            step=state.step + 1,
            params=params[None],
            model_state=model_state[None],
            opt_state=opt_state[None],
            previous_params=state.params if self._two_versions else None,
        )
        return finish_scaled_step(
            state,
            new_state,
            finite,
            {**metrics, "loss": loss},
            report_skipped=self.precision.skip_nonfinite,
        )
