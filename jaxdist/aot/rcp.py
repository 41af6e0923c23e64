"""The MLPerf reference convergence points (RCPs) of ResNet-50: epochs to 75.9% top-1 by global
batch, and the hyperparameters the reference runs used.

MLPerf's RCP checker (``mlperf-logging``, ruleset 4.0.0, the last with ResNet) judges a
submission's epochs against these points: per reference batch, the mean epochs of its runs
with the fastest and the slowest dropped; points slower than the line between their
neighbours are pruned, and a batch between two points gets the linear interpolation of
their means. :func:`epochs_to_converge` follows the checker, so ``jaxdist plan`` can price a
recipe at the epochs MLPerf expects at its batch, beside the recipe's own ``num_epochs``.
The table (``data/rcps_resnet.json``, Apache 2.0) ships with jaxdist.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
from typing import Any

import numpy as np

__all__ = [
    "RcpEpochs",
    "ReferencePoint",
    "epochs_to_converge",
    "hyperparameter_differences",
    "reference_points",
]

RULESET = "MLPerf Training 4.0.0"
TARGET = "75.9% top-1"
IMAGENET_TRAIN_IMAGES = 1_281_167  # what an epoch of the benchmark is


@dataclasses.dataclass(frozen=True)
class ReferencePoint:
    """One reference global batch: its runs' epochs to the target and their hyperparameters."""

    batch: int
    epochs: tuple[int, ...]
    hyperparameters: dict[str, Any]

    @property
    def mean_epochs(self) -> float:
        """The olympic mean, as the checker takes it: fastest and slowest run dropped."""
        runs = sorted(self.epochs)
        return float(np.mean(runs[1:-1]))


@dataclasses.dataclass(frozen=True)
class RcpEpochs:
    """The reference epochs for a global batch, and how they were found."""

    batch: int
    epochs: float | None  # None beyond the table's largest batch
    how: str  # "at the reference point", "interpolated between ...", "beyond ..."
    nearest: ReferencePoint  # whose hyperparameters the recipe's are compared with


@functools.cache
def reference_points() -> tuple[ReferencePoint, ...]:
    """Every reference batch of the table, smallest first."""
    text = importlib.resources.files("jaxdist.aot").joinpath("data/rcps_resnet.json").read_text()
    points = [
        ReferencePoint(int(r["BS"]), tuple(r["Epochs to converge"]), dict(r["Hyperparams"]))
        for r in json.loads(text).values()
    ]
    return tuple(sorted(points, key=lambda p: p.batch))


def pruned_points() -> list[ReferencePoint]:
    """The points the checker interpolates between: none below the fastest-converging batch,
    and none slower than the line between its neighbours."""
    points = list(reference_points())
    fastest = min(points, key=lambda p: p.mean_epochs)
    points = [p for p in points if p.batch >= fastest.batch]
    i = 1
    while i < len(points) - 1:
        low, high = points[i - 1], points[i + 1]
        line = np.interp(
            points[i].batch, [low.batch, high.batch], [low.mean_epochs, high.mean_epochs]
        )
        if points[i].mean_epochs > line:
            del points[i]
            i -= 1
        i += 1
    return points


def epochs_to_converge(batch: int) -> RcpEpochs:
    """The reference epochs at global ``batch``: a reference point's mean, the interpolation
    of the two points around it, the smallest point's below the table; none above it (the
    checker does not extrapolate)."""
    points = pruned_points()
    every = reference_points()
    nearest = min(every, key=lambda p: abs(np.log(p.batch / batch)))
    exact = [p for p in points if p.batch == batch]  # a pruned point is interpolated over
    if exact:
        return RcpEpochs(batch, exact[0].mean_epochs, "at the reference point", exact[0])
    if batch < points[0].batch:
        how = f"below the table: its smallest pruned batch, {points[0].batch:,}"
        return RcpEpochs(batch, points[0].mean_epochs, how, nearest)
    if batch > points[-1].batch:
        return RcpEpochs(
            batch, None, f"beyond the table's largest batch, {points[-1].batch:,}", nearest
        )
    low = max((p for p in points if p.batch < batch), key=lambda p: p.batch)
    high = min((p for p in points if p.batch > batch), key=lambda p: p.batch)
    epochs = float(np.interp(batch, [low.batch, high.batch], [low.mean_epochs, high.mean_epochs]))
    how = (
        f"interpolated between {low.batch:,} ({low.mean_epochs:.1f}) and "
        f"{high.batch:,} ({high.mean_epochs:.1f})"
    )
    return RcpEpochs(batch, epochs, how, nearest)


def hyperparameter_differences(config: Any, point: ReferencePoint, bn_span: int | None) -> list:
    """``(field, recipe's value, reference's value)`` for each hyperparameter of ``point``
    that the recipe sets otherwise (``bn_span``: images per BatchNorm group, if known)."""
    h, opt, lr = point.hyperparameters, config.optimizer, config.lr
    pairs = [
        ("optimizer.name", opt.name, h.get("optimizer")),
        ("lr.peak", lr.peak, h.get("opt_base_learning_rate")),
        ("lr.warmup_epochs", lr.warmup_epochs, h.get("opt_learning_rate_warmup_epochs")),
        ("optimizer.momentum", opt.get("momentum"), h.get("opt_momentum")),
        ("optimizer.weight_decay", opt.get("weight_decay"), h.get("opt_weight_decay")),
        ("lr.end_lr", lr.get("end_lr"), h.get("opt_end_learning_rate")),
        ("lr.power", lr.get("power"), h.get("opt_learning_rate_decay_poly_power")),
        ("BatchNorm span (images)", bn_span, h.get("model_bn_span")),
    ]
    return [
        (name, mine, ref)
        for name, mine, ref in pairs
        if ref is not None and mine is not None and not _same(mine, ref)
    ]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return str(a) == str(b)
    return bool(np.isclose(float(a), float(b), rtol=1e-6, atol=0.0))
