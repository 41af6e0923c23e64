"""The two kinds of step a recipe trains, side by side: :class:`DataParallel` (the whole model
on every device or split over a ``tensor`` axis, the other mesh axes splitting the batch) and
:class:`~jaxdist.run.pipeline_config.Pipeline` (the model cut into stages over the mesh's
``stage`` axis); :func:`step_kind_for` makes the one choice between them."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
from jax.sharding import Mesh

from jaxdist import meshes
from jaxdist.comm.tensor_parallel import TENSOR_AXIS, TensorParallel
from jaxdist.run.from_config import StepParts
from jaxdist.run.pipeline_config import Pipeline, enabled
from jaxdist.tasks.task import Task
from jaxdist.training import logical_axes
from jaxdist.training.sharding import FSDP_AXIS
from jaxdist.training.train_step import TrainStep

__all__ = ["DataParallel", "Pipeline", "step_kind_for"]


def step_kind_for(
    config: ml_collections.ConfigDict, mesh: Mesh, recorded: dict[str, Any]
) -> DataParallel | Pipeline:
    """The recipe's kind of step: a pipeline when it has stages (``recorded``: what an
    earlier run of the workdir resolved, e.g. an "auto" cut), else data parallel."""
    if not enabled(config):
        return DataParallel(config, mesh)
    if TENSOR_AXIS in mesh.axis_names:
        raise ValueError(
            f"the mesh's {TENSOR_AXIS!r} axis splits weights inside a stage, "
            "which pipeline steps do not do: use a mesh without it, or "
            "pipeline.stages=0"
        )
    if config.logical_axis_rules:
        raise ValueError(
            f"logical_axis_rules={config.logical_axis_rules!r} place the parameters of a "
            "model trained whole; a pipeline's stages split theirs by shape: leave the "
            "rules empty, or pipeline.stages=0"
        )
    return Pipeline(config, mesh, recorded)


class DataParallel:
    """The kind of step a recipe without pipeline stages trains: the whole model on every
    device, or split over the mesh's ``tensor`` axis by the recipe's logical axis rules; the
    other axes split the batch."""

    def __init__(self, config: ml_collections.ConfigDict, mesh: Mesh) -> None:
        if meshes.STAGE_AXIS in mesh.axis_names:
            raise ValueError(
                f"the mesh's {meshes.STAGE_AXIS!r} axis cuts the model into "
                f"pipeline stages: set pipeline.stages={mesh.shape['stage']}, or "
                "use a mesh without it"
            )
        self.mesh = mesh
        self.tensor_axis = TENSOR_AXIS if TENSOR_AXIS in mesh.axis_names else None
        self.data_axes: tuple[str, ...] = tuple(
            a for a in mesh.axis_names if meshes.role_of(a) in ("data", "fsdp")
        )
        if not self.data_axes:
            raise ValueError(
                f"the mesh {dict(mesh.shape)} has no axis to split the batch: "
                "add one (data=1 keeps the batch whole)"
            )
        self.rules = logical_axes.parse_rules(config.logical_axis_rules)
        self.tensor_schedule = config.tensor_schedule
        self.tensor_sequence = config.tensor_sequence
        if not self.tensor_axis and config.tensor_sequence:
            raise ValueError(
                f"tensor_sequence=True splits the sequence over the "
                f"{TENSOR_AXIS!r} axis, and the mesh has none"
            )
        if not self.tensor_axis and config.tensor_schedule != "native":
            raise ValueError(
                f"tensor_schedule={config.tensor_schedule!r} schedules a "
                f"{TENSOR_AXIS!r} axis's products, and the mesh has none"
            )
        self.resolved: dict = {}  # nothing left to the machine beyond the mesh
        # The task's split, worked out (its shapes traced) once for every step built.
        self._splits: dict[Task, tuple[TensorParallel | None, Any]] = {}
        self._shapes: dict[Task, Any] = {}  # each task's parameter shapes, traced once

    def check_batches(self, batches: list[int], replicas: int) -> None:
        """Any global batch works: the batch plan splits it into accumulation steps."""

    def build(self, parts: StepParts, accumulation_steps: int) -> TrainStep:
        """The recipe's :class:`TrainStep`: the task's loss on the whole model, its state
        sharded over the mesh's ``fsdp`` axis where it has one beside others (HSDP), else
        over every axis (the step's own default, the same from Python)."""
        sharding = parts.sharding
        tensor, shard_dims = self._split_of(parts.task)
        if shard_dims is not None:
            if not sharding.sharded:
                raise ValueError(
                    f"logical_axis_rules place the state over {FSDP_AXIS!r}, and "
                    "sharding=replicated keeps it whole: set sharding=fsdp or zero1"
                )
            sharding = dataclasses.replace(sharding, dims=shard_dims)
        return TrainStep(
            parts.task.loss,
            parts.optimizer,
            self.mesh,
            data_axes=self.data_axes,
            communication=parts.communication,
            sharding=sharding,
            precision=parts.precision,
            accumulation_steps=accumulation_steps,
            stacked_layers=parts.task.stacked_layers(),
            tensor=tensor,
        )

    def _split_of(self, task: Task) -> tuple[TensorParallel | None, Any]:
        if task not in self._splits:
            self._splits[task] = (self.tensor_parallel(task), self.shard_dims(task))
        return self._splits[task]

    def shard_dims(self, task: Task) -> Any:
        """Per parameter of the task, the dimension the recipe's rules split over the mesh's
        ``fsdp`` axis (None: whole), where a rule names ``fsdp``; None otherwise (FSDP and
        ZeRO-1 split each parameter by its shape)."""
        if not logical_axes.names_axis(self.rules, FSDP_AXIS):
            return None
        axes = task.logical_axes()
        self._check_rules(task, axes)
        size = self.mesh.shape[FSDP_AXIS]
        shapes = self._parameter_shapes(task)
        return logical_axes.split_dims(axes.names, self._rules(), FSDP_AXIS, shapes, size)

    def _parameter_shapes(self, task: Task) -> Any:
        """The task's parameters as shapes (its init traced once for both axes' splits)."""
        if task not in self._shapes:
            self._shapes[task] = jax.eval_shape(task.init_variables, jax.random.key(0))[0]
        return self._shapes[task]

    def _rules(self) -> logical_axes.Rules:
        """The recipe's rules, then on a mesh with a tensor axis the default (Megatron's
        split) for the names they leave."""
        return self.rules + (logical_axes.DEFAULT_RULES if self.tensor_axis else ())

    def _check_rules(self, task: Task, axes: logical_axes.LogicalAxes | None) -> None:
        """One line for rules that cannot hold on this mesh and model."""
        if axes is not None and self.rules:
            logical_axes.check_rules(self.rules, self.mesh.axis_names, axes)
        elif self.rules:  # rules for a model that names nothing
            raise ValueError(
                f"logical_axis_rules are given, but the {task.name} task's model "
                "names no parameter dimensions"
            )

    def tensor_parallel(self, task: Task) -> TensorParallel | None:
        """How the task's parameters split over the mesh's tensor axis, by the recipe's rules
        and the default rules after them; None without a tensor axis. One line for rules
        that cannot hold on this mesh and model."""
        axes = task.logical_axes()
        self._check_rules(task, axes)
        if self.tensor_axis is None:
            return None
        if axes is None:
            raise ValueError(
                f"the mesh's {TENSOR_AXIS!r} axis splits weights, but the "
                f"{task.name} task's model names no parameter dimensions to split "
                "(Task.logical_axes)"
            )
        shapes = self._parameter_shapes(task)
        rules = self._rules()
        logical_axes.check_tensor_split(axes.names, rules, axes.tensor_parallel)
        size = self.mesh.shape[TENSOR_AXIS]
        dims = logical_axes.split_dims(axes.names, rules, TENSOR_AXIS, shapes, size)
        return TensorParallel(
            dims,
            TENSOR_AXIS,
            self.tensor_schedule,
            self.tensor_sequence,
            vocabulary=axes.splits_vocabulary(rules),
        )
