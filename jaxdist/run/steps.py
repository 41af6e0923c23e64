"""The train step a recipe describes: data parallel, or a pipeline when the recipe has
pipeline stages.

The trainer asks :func:`for_recipe` once; from then on it sees only the
:class:`~jaxdist.training.protocol.Step` interface. Every recipe field that shapes the step
(``allreduce``, ``bucket_bytes``, ``unroll_limit``, ``links``, ``sfb_layers``) reaches either
kind of step, which honours it or refuses it in one line; so does every ``pipeline`` field
given to a recipe without pipeline stages.
"""

from __future__ import annotations

import ml_collections
from jax.sharding import Mesh

from jaxdist.run import pipeline_config
from jaxdist.run.from_config import StepParts, refuse_unused
from jaxdist.training.train_step import TrainStep

__all__ = ["DataParallel", "for_recipe"]


class DataParallel:
    """The whole model on every device; every mesh axis splits the batch."""

    def __init__(self, config: ml_collections.ConfigDict, mesh: Mesh) -> None:
        refuse_unused("pipeline", config.pipeline, ("stages",), "pipeline.stages=0")
        self.mesh = mesh
        self.data_axes: tuple[str, ...] = tuple(mesh.axis_names)
        self.resolved: dict = {}  # nothing left to the machine beyond the mesh

    def check_batches(self, batches: list[int], replicas: int) -> None:
        """Any global batch works: the batch plan splits it into accumulation steps."""

    def build(self, parts: StepParts, accumulation_steps: int) -> TrainStep:
        """The recipe's :class:`TrainStep`: the task's loss on the whole model."""
        return TrainStep(
            parts.task.loss,
            parts.optimizer,
            self.mesh,
            data_axes=self.data_axes,
            accumulation_steps=accumulation_steps,
            **parts.options,
        )


def for_recipe(
    config: ml_collections.ConfigDict, mesh: Mesh, recorded: dict | None = None
) -> DataParallel | pipeline_config.Pipeline:
    """The kind of step ``config`` trains with: a pipeline when ``pipeline.stages > 0``.
    ``recorded`` is what a run in the workdir resolved before (a pipeline's "auto" cut)."""
    if pipeline_config.enabled(config):
        return pipeline_config.Pipeline(config, mesh, recorded)
    return DataParallel(config, mesh)
