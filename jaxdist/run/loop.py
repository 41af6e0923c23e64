"""What the training loop carries from one step to the next, its data iterator at a stage
boundary, and its progress report."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from jaxdist.run.log import RunLog, format_duration
from jaxdist.training.train_step import TrainState

__all__: list[str] = []


@dataclasses.dataclass
class Loop:
    """What the training loop carries from one step to the next."""

    state: TrainState
    step: int
    base_rng: jax.Array
    data_state: dict | None = None
    stage: int = -1
    iterator: Any = None
    epoch: float = 0.0
    lr: float = 0.0
    batch_size: int = 0
    pending: list = dataclasses.field(default_factory=list)  # metrics since the last report
    started: float = dataclasses.field(default_factory=time.perf_counter)
    window_start: float = dataclasses.field(default_factory=time.perf_counter)
    window_samples: int = 0
    window_steps: int = 0
    last_eval: dict = dataclasses.field(default_factory=dict)
    reached_target: bool = False
    preempted: bool = False
    stopped_by: str = ""  # the signal that preempted the run: SIGTERM or SIGINT (Ctrl-C)


def report(loop: Loop, log: RunLog, total_steps: int) -> list[dict]:
    """The mean metrics since the last report to ``metrics.jsonl`` and a progress line with
    the elapsed time and an ETA from the recent step rate; returns the steps' fetched metrics,
    oldest first."""
    fetched = jax.device_get(loop.pending)
    means = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}
    now = time.perf_counter()
    window = now - loop.window_start
    record = {"kind": "train", "step": loop.step, "epoch": loop.epoch, "lr": loop.lr,
              "batch_size": loop.batch_size,
              "images_per_sec": loop.window_samples / window, **means}  # fmt: skip
    log.metrics(record)
    eta = (total_steps - loop.step) * window / loop.window_steps
    log.progress(
        f"step {loop.step}/{total_steps} | epoch {loop.epoch:.2f} | "
        f"{record['images_per_sec']:.0f} samples/s | loss {means['loss']:.4f} | "
        f"lr {loop.lr:.4g} | batch {loop.batch_size} | "
        f"{format_duration(now - loop.started)} elapsed, eta {format_duration(eta)}"
    )
    loop.pending, loop.window_start = [], now
    loop.window_samples = loop.window_steps = 0
    return fetched


def open_iterator(pipeline: Any, schedule: Any, step: int, loop: Loop) -> Any:
    """The data iterator for the batch-size stage ``step`` is in, continuing the global stream
    where ``loop`` left it (its checkpointed ``data_state``, if any); the previous stage's
    iterator is closed."""
    if loop.iterator is not None:
        loop.iterator.close()
    start = schedule.samples_seen(step)
    iterator = pipeline.train_iterator(schedule.batch_size_at(step), start_sample=start)
    if loop.data_state is not None:
        iterator.set_state(loop.data_state)
    if iterator.next_sample != start:
        raise RuntimeError(
            f"data position {iterator.next_sample} does not match the batch schedule's "
            f"{start} samples at step {step}; the checkpoint belongs to another schedule"
        )
    return iterator
