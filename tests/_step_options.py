"""Test grids name a step's options flat (``allreduce="ring", sharding="fsdp", prefetch=2``);
:func:`records` groups them into the option records the steps take."""

from __future__ import annotations

from typing import Any

from jaxdist.training.step_options import Communication, Precision, StateSharding

COMMUNICATION = {
    "allreduce": "allreduce",
    "allreduce_options": "options",
    "bucket_bytes": "bucket_bytes",
    "sfb_layers": "sfb_layers",
    "links": "links",
    "wait_free": "wait_free",
}
SHARDING = {
    "sharding": "kind",
    "shard_axes": "axes",
    "gather": "gather",
    "keep_gathered": "keep_gathered",
    "prefetch": "prefetch",
    "min_shard_elements": "min_shard_elements",
    "shard_dims": "dims",
}
PRECISION = {"loss_scale": "loss_scale", "skip_nonfinite": "skip_nonfinite"}


def records(**flat: Any) -> dict[str, Any]:
    """``flat``'s options as a step's keyword arguments: ``communication``, ``sharding`` and
    ``precision`` records for the names they hold, every other name as given."""
    groups: dict[str, dict[str, Any]] = {"communication": {}, "sharding": {}, "precision": {}}
    kwargs: dict[str, Any] = {}
    for name, value in flat.items():
        if name in COMMUNICATION:
            groups["communication"][COMMUNICATION[name]] = value
        elif name in SHARDING:
            groups["sharding"][SHARDING[name]] = value
        elif name in PRECISION:
            groups["precision"][PRECISION[name]] = value
        else:
            kwargs[name] = value
    made = {"communication": Communication, "sharding": StateSharding, "precision": Precision}
    for group, fields in groups.items():
        if fields:
            kwargs[group] = made[group](**fields)
    return kwargs
