"""Step time and time-to-train from a compiled step, a chip's figures and the cost model.

A step takes its compute plus the gradient communication that backward cannot hide::

    compute  = FLOPs per chip / (peak FLOP/s x efficiency)
    comm     = sum over gradient buckets of the cost model's allreduce time on the links
    hidden   = min(comm - last bucket, backward x share of backward run while gradients move)
    step     = compute + comm - hidden

* ``efficiency`` is the share of peak a real step reaches. It is not derived: it is
  calibrated on a published run (:mod:`jaxdist.aot.published`) and printed with every
  prediction.
* backward is :data:`BACKWARD_SHARE` of the compute (two of the three matrix products per
  layer); the share of it that runs while a gradient collective is in flight is read from
  the compiled schedule, so a program whose collectives wait for the whole backward pass, or
  run inside a loop, hides nothing. The last bucket always waits for the end of backward.

Input reading, evaluation and start-up are outside the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxdist.aot.chips import Chip
from jaxdist.aot.compile import CompiledStep
from jaxdist.comm import cost_model
from jaxdist.training.batch_schedule import BatchSchedule

__all__ = ["BACKWARD_SHARE", "StepTime", "communication_seconds", "predict_step", "time_to_train"]

BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step and its parts."""

    compute: float
    communication: float
    hidden: float
    efficiency: float

    @property
    def exposed(self) -> float:
        return self.communication - self.hidden

    @property
    def total(self) -> float:
        return self.compute + self.exposed


def communication_seconds(
    bucket_bytes: Sequence[float],
    algorithm: str,
    axis_sizes: Sequence[int],
    network: cost_model.Network,
) -> list[float]:
    """The cost model's seconds for each gradient bucket (``native`` is priced as a ring, as
    XLA's own allreduce is on a torus)."""
    if algorithm == "none":
        return [0.0 for _ in bucket_bytes]
    return [cost_model.predict(algorithm, b, axis_sizes, network) for b in bucket_bytes]


def predict_step(
    compiled: CompiledStep,
    chip: Chip,
    *,
    efficiency: float,
    algorithm: str,
    axis_sizes: Sequence[int],
    network: cost_model.Network,
) -> StepTime:
    """The :class:`StepTime` of a compiled step on ``chip``."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    compute = compiled.flops / (chip.peak_flops * efficiency)
    per_bucket = communication_seconds(compiled.bucket_bytes, algorithm, axis_sizes, network)
    communication = sum(per_bucket)
    backward = compute * BACKWARD_SHARE * compiled.schedule.overlapped_backward_fraction
    hidden = max(0.0, min(communication - per_bucket[-1], backward)) if per_bucket else 0.0
    return StepTime(compute, communication, hidden, efficiency)


def time_to_train(
    schedule: BatchSchedule, epochs: float, step_seconds: Sequence[float]
) -> list[dict]:
    """Per batch-size stage: its steps, step time, images/s and seconds, over ``epochs``;
    ``step_seconds[i]`` is stage ``i``'s predicted step time."""
    end = schedule.steps_for_epochs(epochs)
    starts = [first for first, _ in schedule.stage_boundaries()] + [end]
    rows = []
    for i, (first, stage) in enumerate(schedule.stage_boundaries()):
        steps = max(0, min(starts[i + 1], end) - min(first, end))
        seconds = steps * step_seconds[i]
        rows.append({
            "stage": i,
            "global_batch": stage.global_batch_size,
            "steps": steps,
            "step_seconds": step_seconds[i],
            "images_per_second": stage.global_batch_size / step_seconds[i],
            "seconds": seconds,
        })  # fmt: skip
    return rows
