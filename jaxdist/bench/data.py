"""Throughput of the input pipeline alone (train transforms), in images per second.

The number to put next to the train step's images/s: whichever is lower limits training
(:mod:`jaxdist.aot.input_demand` reads what a plan's step asks for).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jaxdist.data.config import DataConfig, make_pipeline

__all__ = ["PipelineRate", "measure"]


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
