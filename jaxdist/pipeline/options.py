"""What a pipeline step accepts: the data axes of its mesh, one stage function per virtual
stage, and one line for each data-parallel option it cannot honour, so that no option is
silently ignored."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from jaxdist.comm import collectives
from jaxdist.pipeline import schedules
from jaxdist.training.step_checks import check_gather, check_sharded
from jaxdist.training.step_options import NO_ALLREDUCE, Communication, StateSharding

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
    communication: Communication,
    accumulation_steps: int,
    sharding: StateSharding,
    schedule: str,
) -> None:
    """One line for each data-parallel option a pipeline cannot honour, rather than ignoring
    it: its gradients are one flat vector per stage, averaged by one schedule, and a stage's
    parameters are gathered once a step."""
    allreduce, sfb_layers, links = (
        communication.allreduce,
        communication.sfb_layers,
        communication.links,
    )
    if allreduce == "auto":
        raise ValueError(
            "allreduce='auto' chooses routes per gradient bucket and dense layer "
            "of a whole model; a pipeline averages one flat vector per stage: "
            f"name a schedule from {collectives.ALGORITHMS}"
        )
    if allreduce != NO_ALLREDUCE and allreduce not in collectives.ALGORITHMS:
        raise ValueError(
            f"unknown allreduce {allreduce!r}; expected one of {collectives.ALGORITHMS}"
        )
    if sfb_layers:
        raise ValueError(
            f"sfb_layers={sfb_layers!r}: a pipeline stage's gradients are one "
            "flat vector, not dense layers' factors; leave sfb_layers empty"
        )
    if links is not None:
        raise ValueError(
            f"links={links!r} price a data-parallel gradient plan, which a "
            "pipeline does not make; leave links empty"
        )
    if accumulation_steps != 1:
        raise ValueError(
            f"accumulation_steps={accumulation_steps}: a pipeline's micro-batches take the "
            "place of gradient accumulation; use more micro-batches instead"
        )
    if communication.wait_free:
        raise ValueError(
            "wait_free=True paces a data-parallel step's gradient buckets; a "
            "pipeline step's gradients already travel while the pipeline "
            "drains: set wait_free=False"
        )
    kind = sharding.kind
    if kind == "zero1":
        raise ValueError(
            "sharding='zero1' keeps parameters whole and shards the optimizer "
            "state; a pipeline shards a stage's parameters and optimizer state "
            "together: choose sharding='fsdp' (or 'replicated')"
        )
    if kind not in ("replicated", "fsdp"):
        raise ValueError(f"sharding must be one of replicated, fsdp in a pipeline; got {kind!r}")
    if kind == "fsdp" and schedule in schedules.ASYNCHRONOUS:
        raise ValueError(
            f"sharding='fsdp' gathers each stage's parameters once a step and "
            f"updates them after it; schedule={schedule!r} updates (or keeps "
            "versions of) them between micro-batches: choose gpipe, 1f1b or "
            "interleaved, or sharding='replicated'"
        )
    paced = {
        "prefetch": sharding.prefetch != 1,
        "keep_gathered": sharding.keep_gathered,
        "scatter_behind": sharding.scatter_behind,
    }
    name = next((name for name, given in paced.items() if given), None)
    if name is not None:
        raise ValueError(
            f"{name}={getattr(sharding, name)!r} paces a sharded step's parameter "
            "all-gathers (or gradient reduce-scatters) layer by layer; a pipeline stage "
            f"gathers its parameters once a step: leave {name} out"
        )
    if sharding.axes is not None:
        raise ValueError(
            f"sharding axes={sharding.axes!r}: a pipeline splits a stage's state over all "
            "of its data axes; leave axes out"
        )


def check_stage_sharding(
    mesh: Mesh,
    reduce_axes: Any,
    stage_axis: str,
    sharding: StateSharding,
    communication: Communication,
) -> None:
    """Refuse, in one line, FSDP inside stages that cannot run (no data axes to split over, an
    allreduce with no halves, a gather schedule without FSDP)."""
    kind, gather, options = sharding.kind, sharding.gather, communication.options
    if gather is not None and kind != "fsdp":
        raise ValueError(
            f"gather={gather!r} is the schedule of FSDP's parameter all-gathers; "
            f"sharding={kind!r} keeps each stage's parameters whole: "
            "choose sharding='fsdp' or leave gather out"
        )
    if kind != "fsdp":
        return
    if reduce_axes is None:
        raise ValueError(
            f"sharding='fsdp' splits each stage's state over the data axes; the "
            f"mesh has none beside {stage_axis!r}: use a mesh with data axes "
            "(e.g. the preset pipeline-2x4)"
        )
    check_sharded(mesh, reduce_axes, reduce_axes, kind, communication.allreduce, options, None)
    if gather is not None:
        check_gather(mesh, reduce_axes, reduce_axes, kind, gather, options)


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
