"""The two kinds of step a recipe trains, side by side: :class:`DataParallel` (the whole model
on every device, every mesh axis splitting the batch) and
:class:`~jaxdist.run.pipeline_config.Pipeline` (the model cut into stages over the mesh's
``stage`` axis); :func:`step_kind_for` makes the one choice between them."""

from __future__ import annotations

from typing import Any

import ml_collections
from jax.sharding import Mesh

from jaxdist.run.from_config import StepParts, refuse_unused
from jaxdist.run.pipeline_config import Pipeline, enabled
from jaxdist.training.sharding import FSDP_AXIS
from jaxdist.training.train_step import TrainStep

__all__ = ["DataParallel", "Pipeline", "step_kind_for"]


def step_kind_for(
    config: ml_collections.ConfigDict, mesh: Mesh, recorded: dict[str, Any]
) -> DataParallel | Pipeline:
    """The recipe's kind of step: a pipeline when it has stages (``recorded``: what an
    earlier run of the workdir resolved, e.g. an "auto" cut), else data parallel."""
    if enabled(config):
        return Pipeline(config, mesh, recorded)
    return DataParallel(config, mesh)


class DataParallel:
    """The kind of step a recipe without pipeline stages trains: the whole model on every
    device, every mesh axis splitting the batch."""

    def __init__(self, config: ml_collections.ConfigDict, mesh: Mesh) -> None:
        refuse_unused("pipeline", config.pipeline, ("stages",), "pipeline.stages=0")
        self.mesh = mesh
        self.data_axes: tuple[str, ...] = tuple(mesh.axis_names)
        self.resolved: dict = {}  # nothing left to the machine beyond the mesh

    def check_batches(self, batches: list[int], replicas: int) -> None:
        """Any global batch works: the batch plan splits it into accumulation steps."""

    def build(self, parts: StepParts, accumulation_steps: int) -> TrainStep:
        """The recipe's :class:`TrainStep`: the task's loss on the whole model, its state
        sharded over the mesh's ``fsdp`` axis where it has one (HSDP), else over every axis."""
        hsdp = FSDP_AXIS in self.data_axes and len(self.data_axes) > 1
        shard_axes = FSDP_AXIS if hsdp and parts.options.get("sharding") != "replicated" else None
        return TrainStep(
            parts.task.loss,
            parts.optimizer,
            self.mesh,
            data_axes=self.data_axes,
            accumulation_steps=accumulation_steps,
            shard_axes=shard_axes,
            stacked_layers=parts.task.stacked_layers(),
            **parts.options,
        )
