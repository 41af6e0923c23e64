"""What MLPerf expects of a planned ResNet-50 recipe: the reference convergence point at its
global batch (:mod:`jaxdist.aot.rcp`), the time to train at it, and what the time model fitted
on the MLPerf record predicts for the slice (:mod:`jaxdist.aot.record`)."""

from __future__ import annotations

import ml_collections

from jaxdist.aot import rcp, record
from jaxdist.aot.predict import time_to_train
from jaxdist.aot.topology import Topology
from jaxdist.run.build import RunParts

__all__ = ["reference_for"]


def reference_for(
    config: ml_collections.ConfigDict,
    parts: RunParts,
    step_seconds: list,
    topology: Topology,
    flops_per_image: float,
) -> dict | None:
    """For a ResNet-50 recipe (MLPerf's benchmark), the reference convergence point at its
    global batch (:mod:`jaxdist.aot.rcp`): the epochs MLPerf expects, how they were found,
    the time to train at them, the hyperparameters the recipe sets otherwise than the
    reference runs at the nearest reference batch, and what the time model fitted on the
    MLPerf record predicts for ``topology`` (:func:`jaxdist.aot.record.record_time`; its
    images/s per chip as a share of the chip's peak at ``flops_per_image``). ``None`` for any
    other model."""
    if parts.task.name != "resnet50":
        return None
    found = rcp.epochs_to_converge(config.batch_size)
    final = parts.plans[-1]
    bn_span = final.per_device_batch * (config.model.get("bn_group_size") or parts.num_replicas)
    rows = [] if found.epochs is None else time_to_train(parts.schedule, found.epochs, step_seconds)
    differences = rcp.hyperparameter_differences(config, found.nearest, bn_span)
    return {
        "source": f"{rcp.RULESET} reference convergence points",
        "target": rcp.TARGET,
        "batch": config.batch_size,
        "epochs": found.epochs,
        "how": found.how,
        "recipe_epochs": config.num_epochs,
        "compared_with_batch": found.nearest.batch,
        "differences": [list(d) for d in differences],
        "time_rows": rows,
        "total_seconds": sum(row["seconds"] for row in rows),
        "record": _record_for(config.batch_size, topology, flops_per_image),
    }


def _record_for(global_batch: int, topology: Topology, flops_per_image: float) -> dict:
    answer = record.record_time(topology.generation, topology.num_chips, global_batch)
    fitted = answer.get("fitted")
    if fitted is not None:
        answer["share_of_peak"] = (
            fitted["images_per_second"] * flops_per_image / topology.chip.peak_flops
        )
    return answer
