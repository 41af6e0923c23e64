"""What a pipeline step accepts: the data axes of its mesh, one stage function per virtual
stage, and one line for each data-parallel option it cannot honour, so that no option is
silently ignored."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from jaxdist.comm import collectives
from jaxdist.training.train_step import NO_ALLREDUCE

__all__: list[str] = []  # building blocks of the package's own modules


def stage_data_axes(mesh: Mesh, stage_axis: str) -> tuple[str, ...]:
    """The data axes of a pipeline mesh: every axis but the stage axis, in mesh order."""
    if stage_axis not in mesh.axis_names:
        raise ValueError(
            f"the mesh has axes {tuple(mesh.axis_names)} and no stage axis {stage_axis!r}; "
            f"build one with a stage axis (e.g. the mesh preset 'pipeline-2x4') or pass "
            f"stage_axis= naming one of its axes"
        )
    return tuple(a for a in mesh.axis_names if a != stage_axis)


def refuse_unsupported(
    allreduce: str, sfb_layers: Any, links: Any, accumulation_steps: int, sharding: str
) -> None:
    """One line for each data-parallel option a pipeline cannot honour, rather than ignoring
    it: its gradients are one flat vector per stage, averaged by one schedule."""
    if allreduce == "auto":
        raise ValueError("allreduce='auto' chooses routes per gradient bucket and dense layer "
                         "of a whole model; a pipeline averages one flat vector per stage: "
                         f"name a schedule from {collectives.ALGORITHMS}")  # fmt: skip
    if allreduce != NO_ALLREDUCE and allreduce not in collectives.ALGORITHMS:
        raise ValueError(
            f"unknown allreduce {allreduce!r}; expected one of {collectives.ALGORITHMS}"
        )
    if sfb_layers:
        raise ValueError(f"sfb_layers={sfb_layers!r}: a pipeline stage's gradients are one "
                         "flat vector, not dense layers' factors; leave sfb_layers empty")  # fmt: skip
    if links is not None:
        raise ValueError(f"links={links!r} price a data-parallel gradient plan, which a "
                         "pipeline does not make; leave links empty")  # fmt: skip
    if accumulation_steps != 1:
        raise ValueError(
            f"accumulation_steps={accumulation_steps}: a pipeline's micro-batches take the "
            "place of gradient accumulation; use more micro-batches instead"
        )
    if sharding != "replicated":
        raise ValueError(f"sharding={sharding!r} shards a data-parallel step's state; a "
                         "pipeline keeps each stage's state on that stage's devices and does "
                         "not shard it further: leave sharding='replicated'")  # fmt: skip


def check_stage_count(functions: int, stages: int, chunks: int, stage_axis: str) -> None:
    """Refuse a number of stage functions other than one per virtual stage."""
    if functions != stages * chunks:
        raise ValueError(
            f"{functions} stage functions for {stages} stages on axis {stage_axis!r} with "
            f"{chunks} chunk(s) each: expected {stages * chunks}"
        )


def check_micro_batches(batch: Any, microbatches: int, replicas: int) -> None:
    """Refuse, before compiling, a batch whose per-replica part does not split into the
    micro-batches."""
    size = jax.tree.leaves(batch)[0].shape[0]
    if size % (microbatches * replicas):
        raise ValueError(
            f"a batch of {size} over {replicas} data-parallel replica(s) does not split "
            f"into microbatches={microbatches} per replica; use a multiple of "
            f"{microbatches * replicas} or another micro-batch count"
        )
