"""A recipe's ``pipeline`` fields, built: the pipeline step the trainer runs in place of the
data-parallel one, its initial state from the whole model's initialisation, and the whole
model's variables back for evaluation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from jaxdist.meshes import STAGE_AXIS
from jaxdist.pipeline import stages as pipeline_stages
from jaxdist.pipeline.step import PipelineState, PipelineStep, stage_data_axes
from jaxdist.training.optim import smoothed_cross_entropy

__all__ = [
    "build_pipeline_step",
    "check_batches",
    "data_axes",
    "enabled",
    "initial_state",
    "stage_modules",
    "whole_variables",
]


def enabled(config: ml_collections.ConfigDict) -> bool:
    """Whether the recipe trains a pipeline (``pipeline.stages > 0``)."""
    return "pipeline" in config and config.pipeline.stages > 0


def data_axes(config: ml_collections.ConfigDict, mesh: Mesh) -> tuple[str, ...]:
    """The mesh's data axes; refuses a mesh whose stage axis is missing or of another size."""
    stages = config.pipeline.stages
    if STAGE_AXIS not in mesh.axis_names:
        raise ValueError(
            f"pipeline.stages={stages} needs a mesh with a {STAGE_AXIS!r} axis; the mesh has "
            f"axes {tuple(mesh.axis_names)} (use a pipeline preset, e.g. --set mesh=pipeline-2x4)"
        )
    if mesh.shape[STAGE_AXIS] != stages:
        raise ValueError(
            f"pipeline.stages={stages} but the mesh's {STAGE_AXIS!r} axis has "
            f"{mesh.shape[STAGE_AXIS]} devices; make them equal"
        )
    return stage_data_axes(mesh, STAGE_AXIS)


def check_batches(config: ml_collections.ConfigDict, batches: list[int], replicas: int) -> None:
    """Refuse a global batch (``batch_size`` or a ``batch_ramp`` entry) that does not split
    into the micro-batches on every data-parallel replica."""
    M = config.pipeline.microbatches
    for batch in batches:
        if batch % (M * replicas):
            raise ValueError(
                f"a global batch of {batch} does not split into pipeline.microbatches={M} on "
                f"each of {replicas} data-parallel replica(s); use batches that are multiples "
                f"of {M * replicas} or another micro-batch count"
            )


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


def build_pipeline_step(
    config: ml_collections.ConfigDict,
    model: Any,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    num_classes: int,
    inputs: Any,
    accumulation_steps: int,
) -> PipelineStep:
    """The recipe's :class:`PipelineStep`: the model cut into stages, the classifier loss on
    the last one, gradients averaged over the data axes as the recipe says."""
    if accumulation_steps > 1:
        raise ValueError(
            f"a pipeline's micro-batches take the place of gradient accumulation, but the batch "
            f"plan asks for {accumulation_steps} accumulation steps; raise max_per_device_batch "
            f"and set pipeline.microbatches instead"
        )
    p = config.pipeline
    smoothing = config.label_smoothing

    def loss_fn(logits, micro_batch):
        labels = micro_batch["label"]
        loss = smoothed_cross_entropy(logits, labels, num_classes, smoothing).mean()
        return loss, {"accuracy": (jnp.argmax(logits, -1) == labels).mean()}

    modules = stage_modules(config, model)
    return PipelineStep(
        pipeline_stages.flax_stages(modules), loss_fn, optimizer, mesh,
        microbatches=p.microbatches, schedule=p.schedule, chunks=p.chunks,
        stage_axis=STAGE_AXIS, inputs=inputs, allreduce=config.allreduce,
        allreduce_options={"unroll_limit": config.unroll_limit},
        bucket_bytes=config.bucket_bytes,
    )  # fmt: skip


def initial_state(
    config: ml_collections.ConfigDict, step: PipelineStep, model: Any, example: jax.Array
) -> PipelineState:
    """The whole model initialised from the seed, each stage given its part."""
    variables = model.init(jax.random.key(config.seed), example, train=False)
    modules = stage_modules(config, model)
    params, states = pipeline_stages.split_variables(variables, modules, example)
    return step.init(params, states)


def whole_variables(step: PipelineStep, state: PipelineState) -> tuple[dict, dict]:
    """``(params, model_state)`` of the whole model, the stages' parts joined by name."""
    params, states = step.unstack(state)
    whole_params: dict = {}
    whole_state: dict = {}
    for p in params:
        whole_params.update(p)
    for s in states:
        for collection, tree in s.items():
            whole_state.setdefault(collection, {}).update(tree)
    return whole_params, whole_state
