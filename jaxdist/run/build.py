"""A recipe's config resolved once, top to bottom, into what a run is made of: the mesh, the
kind of step, the task and its data, the batch plan, the learning rate, the optimizer, every
train step, the evaluation step and the few settings the loop reads while it runs.

::

    parts = build_run(config, "runs/mnist", task_factory=ImageClassification)
    parts.train_step_for(0), parts.total_steps, parts.settings.log_every_steps

:func:`build_run` checks every value as it builds, in the order the pieces need each other,
so that a bad config fails before anything trains, in one line (each ``ValueError`` or
``TypeError`` becomes a :class:`~jaxdist.run.config.ConfigError`,
:func:`~jaxdist.run.config.config_problems`). The :class:`~jaxdist.run.trainer.Trainer` runs
the loop on what it returns.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections
from jax.sharding import Mesh

from jaxdist.meshes import check_roles, for_run
from jaxdist.run.config import config_problems
from jaxdist.run.from_config import StepParts, read_recipe
from jaxdist.run.hooks import Hook
from jaxdist.run.mlperf import now_ms
from jaxdist.run.standard_hooks import check_hook_settings
from jaxdist.run.step_kinds import DataParallel, Pipeline, step_kind_for
from jaxdist.tasks import Data, Replicas, Task
from jaxdist.training.batch_schedule import BatchSchedule, DevicePlan
from jaxdist.training.batches import data_axes_of
from jaxdist.training.eval_step import EvalStep
from jaxdist.training.protocol import Step

__all__ = [
    "CheckpointSettings",
    "HookSettings",
    "LoopSettings",
    "RunParts",
    "TaskFactory",
    "build_run",
]

# A recipe's ``get_task``: the task of a config, on the replicas the mesh gives it.
TaskFactory = Callable[[ml_collections.ConfigDict, Replicas], Task]


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """The config's fields the training loop reads while it runs.

    Attributes:
      seed: the initial variables' and every step's RNG (folded with the step number).
      log_every_steps: steps between progress lines and ``metrics.jsonl`` records.
      eval_every_epochs: epochs between evaluations (0: only at the end).
      eval_batch_size: the global batch of an evaluation.
      target_accuracy: the headline metric that marks the target reached.
    """

    seed: int
    log_every_steps: int
    eval_every_epochs: float
    eval_batch_size: int
    target_accuracy: float


@dataclasses.dataclass(frozen=True)
class HookSettings:
    """The config's fields the standard hooks read.

    Attributes:
      watchdog_s: how long a process may finish no step before the watchdog reports it.
      nonfinite_steps: how many non-finite steps in a row are skipped before the run stops
        (0: stop at the first).
      tensorboard: ``"auto"``, ``"on"`` or ``"off"`` (:mod:`jaxdist.run.tensorboard`).
    """

    watchdog_s: float
    nonfinite_steps: int
    tensorboard: str


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """``config.checkpoint``: how often a checkpoint is written (0: only at the end), how many
    are kept, and whether they are written in the background."""

    every_steps: int
    keep: int
    async_save: bool


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What :func:`build_run` resolved from a recipe's config: everything a run uses.

    ``config`` is kept only as the run's record: it is written to ``config.json`` and into each
    checkpoint's meta, compared across processes and on a rerun, and given to the hooks that
    record it (the rerun check, TensorBoard's flattened config, the MLPerf event log's header).
    The loop and the hooks read the resolved values here instead, so a field is read in one
    place.

    Attributes:
      config: the recipe's config, as recorded.
      workdir: where the run writes its logs and checkpoints (``None``: a plan's parts).
      init_ms: when building began (MLPerf's ``init_start``: building the run is
        initialisation).
      mesh: the devices and their axes.
      step_kind: the one choice of step (:mod:`jaxdist.run.step_kinds`).
      data_axes: the mesh axes that split the batch: one name, or a tuple of several.
      num_replicas: the data-parallel replicas (the product of the data axes' sizes).
      task: what is trained (:mod:`jaxdist.tasks`).
      schedule: the batch-size schedule over epochs.
      plans: each schedule stage's batch plan on the devices.
      total_steps: the steps the run takes (``num_epochs``, cut at ``max_steps``).
      lr_fn: ``epoch -> learning rate`` (jitted: a new value never recompiles).
      step_parts: what the train steps were built from.
      train_steps: the train step of each accumulation setting the plans use.
      eval_step: the evaluation step on the mesh.
      settings: the loop's own settings.
      checkpoint: the checkpoints' settings.
      hooks: the standard hooks' settings.
      shows_plans: whether a train step prints its gradient plan after its first call (it
        chooses routes, ``allreduce="auto"``, or sends sufficient factors).
      profile_steps: the steps traced into ``WORKDIR/profile``, if any.
    """

    config: ml_collections.ConfigDict
    workdir: Path | None
    init_ms: int
    mesh: Mesh
    step_kind: DataParallel | Pipeline
    data_axes: str | tuple[str, ...]
    num_replicas: int
    task: Task
    schedule: BatchSchedule
    plans: tuple[DevicePlan, ...]
    total_steps: int
    lr_fn: Callable[[float], jax.Array]
    step_parts: StepParts
    train_steps: Mapping[int, Step]
    eval_step: EvalStep
    settings: LoopSettings
    checkpoint: CheckpointSettings
    hooks: HookSettings
    shows_plans: bool
    profile_steps: tuple[int, int] | None = None

    @property
    def data(self) -> Data:
        """The task's data: the train stream and the held-out split."""
        return self.task.data

    def train_step_for(self, stage: int) -> Step:
        """The train step of a batch-schedule stage (one per accumulation setting)."""
        return self.train_steps[self.plans[stage].accumulation_steps]

    def resolved_devices(self) -> dict[str, Any]:
        """What the run resolved on this machine: the mesh, and a pipeline's "auto" cut."""
        mesh = ",".join(f"{axis}={size}" for axis, size in self.mesh.shape.items())
        return {"mesh": mesh, **self.step_kind.resolved}


def build_run(
    config: ml_collections.ConfigDict,
    workdir: str | Path | None = None,
    *,
    task_factory: TaskFactory,
    mesh: Mesh | None = None,
    recorded: Mapping[str, Any] | None = None,
    profile_steps: tuple[int, int] | None = None,
    hooks: Sequence[Hook] = (),
) -> RunParts:
    """Everything ``config`` describes, built and checked before any training: a bad value
    raises here, as one :class:`~jaxdist.run.config.ConfigError` line.

    Reads no run directory: ``workdir`` is only where the parts will write (``None`` for a
    plan, which writes nothing), and ``recorded`` is what a run there resolved before
    (:func:`~jaxdist.run.rerun.recorded_devices`, e.g. a pipeline's "auto" cut), which a
    rerun keeps. ``task_factory`` builds the task from the config and its replicas (a
    recipe's ``get_task``); ``mesh`` replaces the recipe's; ``profile_steps`` and ``hooks``
    (a user's) have their settings checked with the standard hooks'.
    """
    init_ms = now_ms()
    workdir = None if workdir is None else Path(workdir)
    with config_problems():
        # In the order the pieces need each other, each built whole before the next.
        recipe = read_recipe(config)
        if mesh is not None:
            check_roles(mesh.axis_names)
        else:
            mesh = for_run(recipe.mesh, recipe.stages)
        # The one choice of step; from here on the loop sees only the Step interface.
        step_kind = step_kind_for(config, mesh, dict(recorded or {}))
        data_axes = data_axes_of(mesh, step_kind.data_axes)  # one name, or a tuple of several
        num_replicas = math.prod(mesh.shape[a] for a in step_kind.data_axes)
        task = task_factory(config, Replicas(data_axes, num_replicas))

        schedule = BatchSchedule(recipe.batch_stages, dataset_size=task.data.num_train_examples)
        total_steps = schedule.steps_for_epochs(config.num_epochs)
        if config.max_steps:
            total_steps = min(total_steps, config.max_steps)
        plans = tuple(schedule.device_plans(num_replicas, config.max_per_device_batch))
        step_kind.check_batches([b for _, b in recipe.batch_stages], num_replicas)
        # The hooks' settings, checked now; the hooks themselves are new for every run.
        check_hook_settings(config, total_steps, profile_steps, hooks)
        if config.eval_batch_size % num_replicas:
            raise ValueError(
                f"eval_batch_size={config.eval_batch_size} must be a multiple of the "
                f"{num_replicas} data-parallel devices"
            )

        step_parts = StepParts(
            task, recipe.optimizer, recipe.communication, recipe.sharding, recipe.precision
        )
        # One train step per accumulation setting, in stage order: a step a later stage
        # needs refuses the recipe now, not at that stage's first batch.
        train_steps: dict[int, Step] = {}
        for plan in plans:
            if plan.accumulation_steps not in train_steps:
                train_steps[plan.accumulation_steps] = step_kind.build(
                    step_parts, plan.accumulation_steps
                )
        # Evaluation on the first step's layout: each device reads its own shards.
        first = train_steps[plans[0].accumulation_steps]
        eval_step = EvalStep(task.eval_sums, mesh, data_axes=data_axes, layout=first)

    return RunParts(
        config=config,
        workdir=workdir,
        init_ms=init_ms,
        mesh=mesh,
        step_kind=step_kind,
        data_axes=data_axes,
        num_replicas=num_replicas,
        task=task,
        schedule=schedule,
        plans=plans,
        total_steps=total_steps,
        lr_fn=recipe.lr_fn,
        step_parts=step_parts,
        train_steps=train_steps,
        eval_step=eval_step,
        settings=LoopSettings(
            seed=config.seed,
            log_every_steps=config.log_every_steps,
            eval_every_epochs=config.eval_every_epochs,
            eval_batch_size=config.eval_batch_size,
            target_accuracy=config.target_accuracy,
        ),
        checkpoint=CheckpointSettings(
            every_steps=config.checkpoint.every_steps,
            keep=config.checkpoint.keep,
            async_save=config.checkpoint.async_save,
        ),
        hooks=HookSettings(
            watchdog_s=config.watchdog_s,
            nonfinite_steps=config.skip_nonfinite_steps,
            tensorboard=config.tensorboard,
        ),
        # Steps that choose routes (auto) or send factors print their plan after a first step.
        shows_plans=step_parts.communication.allreduce == "auto"
        or bool(step_parts.communication.sfb_layers),
        profile_steps=profile_steps,
    )
