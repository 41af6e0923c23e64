"""A recipe's ``pipeline`` fields, built: the mesh's stage and data axes, the model cut into
stages, and the pipeline step the trainer runs in place of the data-parallel one."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from jaxdist.meshes import STAGE_AXIS
from jaxdist.pipeline import stages as pipeline_stages
from jaxdist.pipeline.options import stage_data_axes
from jaxdist.pipeline.step import PipelineStep
from jaxdist.run.from_config import StepParts
from jaxdist.training.optim import smoothed_cross_entropy

__all__ = ["Pipeline", "enabled", "stage_modules"]


def enabled(config: ml_collections.ConfigDict) -> bool:
    """Whether the recipe trains a pipeline (``pipeline.stages > 0``)."""
    return "pipeline" in config and config.pipeline.stages > 0


def stage_modules(config: ml_collections.ConfigDict, model: Any) -> list[Any]:
    """The model cut into ``stages x chunks`` virtual stages, equal or at ``boundaries``."""
    p = config.pipeline
    virtual = p.stages * (p.chunks if p.schedule == "interleaved" else 1)
    if p.boundaries:
        if len(p.boundaries) != virtual:
            raise ValueError(
                f"pipeline.boundaries has {len(p.boundaries)} entries; it needs one per "
                f"virtual stage ({virtual}): the first layer of each"
            )
        return pipeline_stages.split_module(model, boundaries=p.boundaries)
    return pipeline_stages.split_module(model, stages=virtual)


class Pipeline:
    """The model cut into stages over the mesh's ``stage`` axis; the other axes split the
    batch. Refuses a mesh whose stage axis is missing or of another size."""

    def __init__(self, config: ml_collections.ConfigDict, mesh: Mesh) -> None:
        stages = config.pipeline.stages
        if STAGE_AXIS not in mesh.axis_names:
            raise ValueError(
                f"pipeline.stages={stages} needs a mesh with a {STAGE_AXIS!r} axis; the mesh "
                f"has axes {tuple(mesh.axis_names)} (use a pipeline preset, e.g. "
                f"--set mesh=pipeline-2x4)"
            )
        if mesh.shape[STAGE_AXIS] != stages:
            raise ValueError(
                f"pipeline.stages={stages} but the mesh's {STAGE_AXIS!r} axis has "
                f"{mesh.shape[STAGE_AXIS]} devices; make them equal"
            )
        p = config.pipeline
        if p.chunks != 1 and p.schedule != "interleaved":
            raise ValueError(
                f"pipeline.chunks={p.chunks} is for the interleaved schedule, and "
                f"pipeline.schedule={p.schedule!r} keeps one chunk per device: set "
                "pipeline.schedule=interleaved, or leave chunks out"
            )
        self.config = config
        self.mesh = mesh
        self.data_axes: tuple[str, ...] = stage_data_axes(mesh, STAGE_AXIS)

    def check_batches(self, batches: list[int], replicas: int) -> None:
        """Refuse a global batch (``batch_size`` or a ``batch_ramp`` entry) that does not
        split into the micro-batches on every data-parallel replica."""
        M = self.config.pipeline.microbatches
        for batch in batches:
            if batch % (M * replicas):
                raise ValueError(
                    f"a global batch of {batch} does not split into pipeline.microbatches={M} "
                    f"on each of {replicas} data-parallel replica(s); use batches that are "
                    f"multiples of {M * replicas} or another micro-batch count"
                )

    def build(self, parts: StepParts, accumulation_steps: int) -> PipelineStep:
        """The recipe's :class:`PipelineStep`: the model cut into stages, the classifier loss
        on the last one, initialised from the whole model's variables."""
        p = self.config.pipeline
        num_classes, smoothing = parts.num_classes, parts.label_smoothing

        def loss_fn(logits, micro_batch):
            labels = micro_batch["label"]
            loss = smoothed_cross_entropy(logits, labels, num_classes, smoothing).mean()
            return loss, {"accuracy": (jnp.argmax(logits, -1) == labels).mean()}

        modules = stage_modules(self.config, parts.model)
        return PipelineStep(
            pipeline_stages.flax_stages(modules), loss_fn, parts.optimizer, self.mesh,
            microbatches=p.microbatches, schedule=p.schedule, chunks=p.chunks,
            stage_axis=STAGE_AXIS, inputs=parts.model_inputs,
            split=pipeline_stages.variable_splitter(modules, parts.example),
            accumulation_steps=accumulation_steps, **parts.options,
        )  # fmt: skip
