"""A recipe's ``pipeline`` fields, built: the mesh's stage and data axes, the model cut into
stages, and the pipeline step the trainer runs in place of the data-parallel one."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxdist.comm import hybrid
from jaxdist.comm.cost_model import Link
from jaxdist.meshes import STAGE_AXIS
from jaxdist.pipeline.options import refuse_unsupported, stage_data_axes
from jaxdist.pipeline.partition import Partition, partition
from jaxdist.pipeline.profile import Profile, layer_sizes, measure_profile, read_profile
from jaxdist.pipeline.step import PipelineStep
from jaxdist.run.from_config import StepParts

__all__ = ["Pipeline", "auto_partition", "enabled", "stage_parts", "virtual_stages"]

RESOLVED_KEY = "pipeline_boundaries"  # config.json's devices entry of an "auto" cut


def enabled(config: ml_collections.ConfigDict) -> bool:
    """Whether the recipe trains a pipeline (``pipeline.stages > 0``)."""
    return "pipeline" in config and config.pipeline.stages > 0


def virtual_stages(config: ml_collections.ConfigDict) -> int:
    """Stages times model chunks per device (interleaved)."""
    p = config.pipeline
    return p.stages * (p.chunks if p.schedule == "interleaved" else 1)


def stage_parts(config: ml_collections.ConfigDict, task: Any, boundaries: Any = None) -> Any:
    """The task's model cut into ``stages x chunks`` virtual stages: equal, or at
    ``boundaries`` (default: the recipe's, which must then be a tuple)."""
    boundaries = config.pipeline.boundaries if boundaries is None else boundaries
    virtual = virtual_stages(config)
    if boundaries and len(boundaries) != virtual:
        raise ValueError(
            f"pipeline.boundaries has {len(boundaries)} entries; it needs one per "
            f"virtual stage ({virtual}): the first layer of each"
        )
    return task.pipeline_parts(virtual, tuple(boundaries) if boundaries else None)


class Pipeline:
    """The model cut into stages over the mesh's ``stage`` axis; the other axes split the
    batch. Refuses a mesh whose stage axis is missing or of another size."""

    def __init__(
        self, config: ml_collections.ConfigDict, mesh: Mesh, recorded: dict | None = None
    ) -> None:
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
        if p.profile and p.boundaries != "auto":
            raise ValueError(
                f"pipeline.profile={p.profile!r} is read only to choose boundaries: set "
                "pipeline.boundaries=auto, or leave profile out"
            )
        if p.boundaries == "auto" and p.schedule == "interleaved":
            raise ValueError(
                "pipeline.boundaries='auto' cuts one model chunk per device; the interleaved "
                "schedule's chunks are cut evenly or at boundaries you give"
            )
        self.config = config
        self.mesh = mesh
        self.data_axes: tuple[str, ...] = stage_data_axes(mesh, STAGE_AXIS)
        # What "auto" resolved to, recorded with the run; a rerun reuses the recorded cut.
        self.resolved: dict[str, Any] = {}
        self._recorded = (recorded or {}).get(RESOLVED_KEY)

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
        """The recipe's :class:`PipelineStep`: the task's model cut into stages, its loss on
        the last one, initialised from the whole model's variables."""
        p = self.config.pipeline
        communication = parts.communication
        if p.boundaries == "auto":  # the links price the sends between stages, no gradient plan
            communication = dataclasses.replace(communication, links=None)
        # Refused before a cut is profiled: what a pipeline cannot honour.
        refuse_unsupported(communication, accumulation_steps, parts.sharding, p.schedule)
        boundaries = self._auto_boundaries(parts) if p.boundaries == "auto" else None
        cut = stage_parts(self.config, parts.task, boundaries)
        return PipelineStep(
            cut.stages,
            cut.loss,
            parts.optimizer,
            self.mesh,
            microbatches=p.microbatches,
            schedule=p.schedule,
            chunks=p.chunks,
            stage_axis=STAGE_AXIS,
            inputs=cut.inputs,
            split=cut.split,
            accumulation_steps=accumulation_steps,
            communication=communication,
            sharding=parts.sharding,
            precision=parts.precision,
        )

    def _auto_boundaries(self, parts: StepParts) -> tuple[int, ...]:
        """The recorded cut of this workdir's run, or the partitioner's, from the recipe's
        profile or one measured now; process 0 decides and every process takes its cut."""
        if self._recorded is None:
            replicas = math.prod(self.mesh.shape[a] for a in self.data_axes)
            micro = self.config.batch_size // (replicas * self.config.pipeline.microbatches)
            cut = auto_partition(self.config, parts, micro)
            boundaries = multihost_utils.broadcast_one_to_all(np.asarray(cut.boundaries))
            self._recorded = [int(b) for b in boundaries]
        self.resolved = {RESOLVED_KEY: list(self._recorded)}
        return tuple(self._recorded)


def stage_link(config: ml_collections.ConfigDict) -> tuple[Link, str]:
    """The link between neighbouring stages the partitioner prices sends on, and where it
    came from: the recipe's ``links``, else the emulated cluster's, else none (sends free)."""
    try:
        links = hybrid.resolve_links(config.links or None, (config.pipeline.stages,))
    except ValueError:
        return Link(0.0, 0.0), "no link given (sends not priced)"
    return links.flat, links.source


def profile_for(config: ml_collections.ConfigDict, parts: StepParts, micro: int) -> Profile:
    """The recipe's ``pipeline.profile`` checked against its model, or one measured now on
    this machine at ``micro`` images per micro-batch."""
    task = parts.task
    if not hasattr(task, "model") or not hasattr(task, "example"):
        raise ValueError(
            f"pipeline.boundaries='auto' profiles a flax model's layers, and the "
            f"{task.name} task has none to profile: give pipeline.boundaries"
        )
    example = jax.ShapeDtypeStruct((micro, *task.example.shape[1:]), task.example.dtype)
    description = task.describe()
    if config.pipeline.profile:
        profile = read_profile(config.pipeline.profile)
        profile.check_matches(description, micro, layer_sizes(task.model, example))
        return profile
    return measure_profile(
        local_statistics(task.model),
        jnp.zeros(example.shape, example.dtype),
        parts.optimizer,
        description=description,
    )


def local_statistics(model: Any) -> Any:
    """``model`` with BatchNorm statistics of each device's own micro-batch: a profile runs
    one device, outside the mesh the data axes name (their averaging is communication, not a
    layer's compute)."""
    norm = getattr(model, "norm", None)
    if isinstance(norm, functools.partial) and "axis_name" in norm.keywords:
        return model.clone(norm=functools.partial(norm, axis_name=None))
    return model


def auto_partition(config: ml_collections.ConfigDict, parts: StepParts, micro: int) -> Partition:
    """The partitioner's cut of the recipe's model over its stages, printed with its costs."""
    profile = profile_for(config, parts, micro)
    link, source = stage_link(config)
    p = config.pipeline
    cut = partition(profile, p.stages, link, schedule=p.schedule, microbatches=p.microbatches)
    if jax.process_index() == 0:
        print(
            f"pipeline: boundaries auto -> {list(cut.boundaries)} from a profile "
            f"{profile.source} on {profile.device} ({source}); slowest stage "
            f"{cut.slowest_s * 1e3:.2f} ms per micro-batch, bubble {cut.bubble():.3f}",
            flush=True,
        )
    return cut
