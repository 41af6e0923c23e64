"""Batch-size control (Mikami et al. 2018): the global batch size as a schedule in epochs.

A :class:`BatchSchedule` is a list of stages ``(start_epoch, global_batch_size)``: a small
batch while the network is fragile (the first warm-up epochs), a larger one afterwards. Stages
are given in epochs because that is what the papers give, but a run advances in steps, so the
schedule fixes where each stage begins in steps:

    stage ``k`` begins at the first step whose samples seen (the samples of all steps before
    it) reach ``start_epoch_k * dataset_size``.

Stage boundaries therefore fall on whole steps; the last step of a stage may overshoot the
boundary by less than one batch, and the overshoot is counted, never dropped: samples seen
and the fractional epoch are exact sums over the steps actually taken. Everything is integer
arithmetic (epochs are read as exact decimals), so the same schedule gives the same steps on
every host and after every restart, and a resumed run can rebuild its position from the step
number alone.

:func:`per_device_plan` turns a stage's global batch into what each device runs: a per-device
batch and a number of gradient-accumulation micro-steps, preferring the largest per-device
batch that fits in memory.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from jaxdist.checks import positive_int

__all__ = [
    "BatchSchedule",
    "DevicePlan",
    "per_device_plan",
]


@dataclass(frozen=True)
class Stage:
    """From ``start_epoch`` on, every step consumes ``global_batch_size`` samples."""

    start_epoch: float
    global_batch_size: int


@dataclass(frozen=True)
class DevicePlan:
    """How one global batch is realised on ``num_devices`` devices.

    Each step every device runs ``accumulation_steps`` micro-steps of ``per_device_batch``
    samples and the gradients are averaged, so
    ``global_batch_size == num_devices * per_device_batch * accumulation_steps``.
    """

    global_batch_size: int
    num_devices: int
    per_device_batch: int
    accumulation_steps: int

    @property
    def micro_batch_size(self) -> int:
        """Samples in one micro-step over all devices."""
        return self.num_devices * self.per_device_batch


def _epochs(value: object, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return value


def _exact_samples(epochs: float, dataset_size: int) -> int:
    """``ceil(epochs * dataset_size)`` without float rounding: repr() of a float is its
    shortest exact decimal ("0.1", not 0.1000000000000000055...), so 0.1 epochs of 50,000
    samples is exactly 5,000 samples."""
    exact = epochs if isinstance(epochs, numbers.Rational) else Fraction(repr(float(epochs)))
    return math.ceil(Fraction(exact) * dataset_size)


def per_device_plan(global_batch: int, num_devices: int, max_per_device_batch: int) -> DevicePlan:
    """Per-device batch and accumulation steps for ``global_batch`` on ``num_devices``.

    Picks the fewest accumulation steps ``a`` such that ``global_batch / num_devices`` splits
    into ``a`` equal micro-batches of at most ``max_per_device_batch`` samples.
    """
    positive_int(global_batch, "global_batch")
    positive_int(num_devices, "num_devices")
    positive_int(max_per_device_batch, "max_per_device_batch")
    if global_batch % num_devices:
        raise ValueError(
            f"global batch {global_batch} does not divide over {num_devices} devices "
            f"(remainder {global_batch % num_devices}); use a multiple of {num_devices}"
        )
    per_device = global_batch // num_devices
    # a == per_device (micro-batches of 1) always qualifies, so the search ends.
    accumulation = next(
        a
        for a in range(-(-per_device // max_per_device_batch), per_device + 1)
        if per_device % a == 0
    )
    return DevicePlan(global_batch, num_devices, per_device // accumulation, accumulation)


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch size by epoch, resolved into steps for a dataset of ``dataset_size``.

    ``BatchSchedule(((0, 256), (5, 1024)), dataset_size=50_000)``: 256 samples per step for
    the first 5 epochs, then 1024. Stages may be given as ``(epoch, batch)`` pairs or
    :class:`Stage` objects.
    """

    stages: tuple[Stage, ...]
    dataset_size: int
    # Derived in __post_init__: first step and samples seen at that step, per stage.
    stage_start_steps: tuple[int, ...] = field(init=False, repr=False)
    stage_start_samples: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        stages = tuple(self._as_stage(i, s) for i, s in enumerate(self.stages))
        object.__setattr__(self, "stages", stages)
        object.__setattr__(
            self, "dataset_size", positive_int(self.dataset_size, "BatchSchedule dataset_size")
        )
        if not stages:
            raise ValueError(
                "BatchSchedule needs at least one stage (start_epoch, global_batch_size), got none"
            )
        if stages[0].start_epoch != 0:
            raise ValueError(
                f"the first stage must start at epoch 0, got start_epoch={stages[0].start_epoch}"
            )
        for i in range(1, len(stages)):
            if stages[i].start_epoch <= stages[i - 1].start_epoch:
                raise ValueError(
                    f"stage start epochs must strictly increase: stage {i} starts at epoch "
                    f"{stages[i].start_epoch}, after stage {i - 1} at epoch "
                    f"{stages[i - 1].start_epoch}"
                )

        steps, samples = [0], [0]
        for i in range(1, len(stages)):
            target = _exact_samples(stages[i].start_epoch, self.dataset_size)
            batch = stages[i - 1].global_batch_size
            steps_in_previous = -(-(target - samples[-1]) // batch)
            if steps_in_previous < 1:
                raise ValueError(
                    f"stage {i - 1} (epoch {stages[i - 1].start_epoch}, batch {batch}) gets no "
                    f"steps: the stage before it already reaches {samples[-1]} samples, at or "
                    f"past stage {i}'s start (epoch {stages[i].start_epoch} = {target} samples); "
                    f"space the stages further apart"
                )
            steps.append(steps[-1] + steps_in_previous)
            samples.append(samples[-1] + steps_in_previous * batch)
        object.__setattr__(self, "stage_start_steps", tuple(steps))
        object.__setattr__(self, "stage_start_samples", tuple(samples))

    @staticmethod
    def _as_stage(index: int, stage: Stage | Sequence) -> Stage:
        if not isinstance(stage, Stage):
            if isinstance(stage, str) or not isinstance(stage, Sequence) or len(stage) != 2:
                raise ValueError(
                    f"stage {index} must be a pair (start_epoch, global_batch_size), got {stage!r}"
                )
            stage = Stage(*stage)
        return Stage(
            _epochs(stage.start_epoch, f"stage {index}: start_epoch"),
            positive_int(stage.global_batch_size, f"stage {index}: global_batch_size"),
        )

    @classmethod
    def constant(cls, global_batch_size: int, dataset_size: int) -> BatchSchedule:
        """One stage: the same batch size throughout."""
        return cls(((0, global_batch_size),), dataset_size)

    # ----------------------------------------------------------------- queries by step

    @staticmethod
    def _check_step(step: object, what: str) -> int:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"{what} must be a non-negative integer, got {step!r}")
        return int(step)

    def stage_index_at(self, step: int) -> int:
        """Index of the stage that step ``step`` (0-based) belongs to."""
        step = self._check_step(step, "step")
        return bisect.bisect_right(self.stage_start_steps, step) - 1

    def batch_size_at(self, step: int) -> int:
        """Global batch size of step ``step``."""
        return self.stages[self.stage_index_at(step)].global_batch_size

    def samples_seen(self, num_steps: int) -> int:
        """Samples consumed by the first ``num_steps`` steps (steps ``0 .. num_steps-1``)."""
        num_steps = self._check_step(num_steps, "num_steps")
        k = bisect.bisect_right(self.stage_start_steps, num_steps) - 1
        return (
            self.stage_start_samples[k]
            + (num_steps - self.stage_start_steps[k]) * self.stages[k].global_batch_size
        )

    def open_iterator(self, data: Any, step: int, data_state: dict | None = None) -> Any:
        """``data``'s train iterator for the stage ``step`` is in, at the stream position the
        schedule reaches there (``samples_seen(step)``), restored from a checkpoint's
        ``data_state`` if given; a state at another position is refused."""
        start = self.samples_seen(step)
        iterator = data.train_iterator(self.batch_size_at(step), start_sample=start)
        if data_state is not None:
            iterator.set_state(data_state)
        if iterator.next_sample != start:
            raise RuntimeError(
                f"data position {iterator.next_sample} does not match the batch schedule's "
                f"{start} samples at step {step}; the checkpoint belongs to another schedule"
            )
        return iterator

    def epoch_at(self, step: int) -> float:
        """Fractional epoch at the start of step ``step``: ``samples_seen(step) / dataset_size``.
        This is the value to evaluate an epoch-based learning-rate schedule at."""
        return self.samples_seen(step) / self.dataset_size

    def steps_for_epochs(self, epochs: float) -> int:
        """Fewest steps whose samples seen reach ``epochs * dataset_size``."""
        target = _exact_samples(_epochs(epochs, "epochs"), self.dataset_size)
        k = bisect.bisect_right(self.stage_start_samples, target) - 1
        remaining = target - self.stage_start_samples[k]
        return self.stage_start_steps[k] + -(-remaining // self.stages[k].global_batch_size)

    def stage_boundaries(self) -> list[tuple[int, Stage]]:
        """``(first step, stage)`` for every stage; a jitted step recompiles at each."""
        return list(zip(self.stage_start_steps, self.stages, strict=True))

    def device_plans(self, num_devices: int, max_per_device_batch: int) -> list[DevicePlan]:
        """:func:`per_device_plan` for every stage, so a bad batch size fails before training."""
        return [
            per_device_plan(s.global_batch_size, num_devices, max_per_device_batch)
            for s in self.stages
        ]

    def table(self, epochs: float) -> list[dict]:
        """Rows ``{step, batch_size, samples_seen, epoch}`` at each stage start and at the step
        that completes ``epochs`` (for logs and the worked table in the docs)."""
        end = self.steps_for_epochs(epochs)
        steps = sorted({s for s in self.stage_start_steps if s <= end} | {end})
        return [
            {
                "step": s,
                "batch_size": self.batch_size_at(s),
                "samples_seen": self.samples_seen(s),
                "epoch": self.epoch_at(s),
            }
            for s in steps
        ]
