"""Throughput of the input pipeline alone (train transforms), in images per second.

The number to put next to the train step's images/s: whichever is lower limits training.
:func:`feeds` puts it next to a plan's step: how many of a host's accelerators one host's
input pipeline keeps busy at the step time ``jaxdist plan`` predicts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from jaxdist.aot.chips import CHIPS
from jaxdist.data.config import DataConfig, make_pipeline

__all__ = ["Demand", "PipelineRate", "demand_of_plan", "measure"]


@dataclass(frozen=True)
class PipelineRate:
    images_per_s: float
    batches: int
    batch_size: int
    seconds: float
    first_batch_s: float  # start-up: listing, worker start, first decode


def measure(config: DataConfig, batch_size: int, steps: int, warmup: int = 2) -> PipelineRate:
    """Time ``steps`` batches of the training iterator after ``warmup`` batches (one process,
    all of the global batch)."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got {steps}, {warmup}")
    start = time.perf_counter()
    pipeline = make_pipeline(config)
    with pipeline.train_iterator(batch_size, process_index=0, process_count=1) as it:
        next(it)
        first = time.perf_counter() - start
        for _ in range(max(0, warmup - 1)):
            next(it)
        begin = time.perf_counter()
        for _ in range(steps):
            next(it)
        seconds = time.perf_counter() - begin
    return PipelineRate(batch_size * steps / seconds, steps, batch_size, seconds, first)


@dataclass(frozen=True)
class Demand:
    """What a plan's training step asks of one host's input pipeline."""

    chip: str
    chips_per_host: int
    per_chip_batch: int
    step_seconds: float

    @property
    def images_per_s_per_chip(self) -> float:
        return self.per_chip_batch / self.step_seconds

    def chips_fed(self, images_per_s: float) -> float:
        """How many chips ``images_per_s`` keeps busy (at most the host's)."""
        return min(self.chips_per_host, images_per_s / self.images_per_s_per_chip)


def demand_of_plan(path: str | Path) -> Demand:
    """The last batch stage of a ``jaxdist plan --json`` output (the one most steps run)."""
    try:
        plan = json.loads(Path(path).read_text())
        stage = plan["stages"][-1]
        chip_name = plan["chip"]
        per_chip, step = int(stage["per_chip_batch"]), float(stage["step_seconds"]["total"])
    except FileNotFoundError as err:
        raise ValueError(f"plan file {path} not found") from err
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
        raise ValueError(
            f"{path} is not the output of `jaxdist plan --json` (expected chip, stages[-1] "
            f"with per_chip_batch and step_seconds.total; {type(err).__name__}: {err})"
        ) from err
    chips = [chip for chip in CHIPS.values() if chip.name == chip_name]
    if not chips:
        raise ValueError(f"{path}: chip {chip_name!r} is not in jaxdist's chip table")
    return Demand(chip_name, chips[0].chips_per_host, per_chip, step)
