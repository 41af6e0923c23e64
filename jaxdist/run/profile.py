"""A ``jax.profiler`` trace of chosen training steps, written into the run's workdir.

``jaxdist train RECIPE --profile-steps 10:12`` traces steps 10, 11 and 12 (numbered as the
progress lines number them) into ``WORKDIR/profile``: TensorBoard's profile plugin
(``tensorboard --logdir WORKDIR/profile``) or XProf open its ``*.xplane.pb``, and
https://ui.perfetto.dev opens its ``perfetto_trace.json.gz``. Every step carries a
``StepTraceAnnotation`` named ``train`` with its step number, so the viewers cut the timeline
into steps. The trace starts before the first step is dispatched and stops once the last one
has finished on the devices.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import jax

from jaxdist.run.config import ConfigError
from jaxdist.run.hooks import Hook

__all__ = ["StepProfiler", "parse_profile_steps"]

TRACE_DIR = "profile"


def parse_profile_steps(text: str) -> tuple[int, int]:
    """``"10:12"`` -> ``(10, 12)``: the first and last step to trace, both included."""
    found = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not found or not 1 <= int(found.group(1)) <= int(found.group(2)):
        raise ConfigError(
            f"--profile-steps: expected FIRST:LAST with 1 <= FIRST <= LAST (steps as the "
            f"progress lines number them, e.g. 10:12), got {text!r}"
        )
    return int(found.group(1)), int(found.group(2))


def _check_steps(steps: tuple[int, int] | None, first_step: int, total_steps: int) -> None:
    """Refuse steps a run will not run: it runs steps ``first_step..total_steps``."""
    if steps is None:
        return
    first, last = steps
    if first < first_step or last > total_steps:
        raise ConfigError(
            f"--profile-steps {first}:{last} is outside the steps this run takes, "
            f"{first_step} to {total_steps}"
        )


class StepProfiler(Hook):
    """Starts and stops the trace around the steps ``first..last``; without steps it only
    annotates them (an annotation costs nothing while no trace is running)."""

    def __init__(self, steps: tuple[int, int] | None, workdir: str | Path) -> None:
        self.steps = steps
        self.directory = Path(workdir) / TRACE_DIR
        self.tracing = False

    @classmethod
    def check_settings(
        cls, config: Any, total_steps: int, profile_steps: tuple[int, int] | None
    ) -> None:
        _check_steps(profile_steps, 1, total_steps)

    @contextlib.contextmanager
    def step(self, number: int, state_after: Any = None):
        """Around the call of step ``number``; the trace starts before the first traced step
        and stops after the last, once ``state_after()`` (the new state) is computed."""
        if self.steps is not None and number == self.steps[0]:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.tracing = True
        with jax.profiler.StepTraceAnnotation("train", step_num=number):
            yield
        if self.tracing and number == self.steps[1]:
            jax.block_until_ready(state_after())
            self.stop()

    def stop(self) -> None:
        """End a trace still running (a run stopped inside the traced steps)."""
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False

    # As a hook of the training loop.

    def resumed(self, loop: Any, meta: dict) -> None:
        _check_steps(self.steps, loop.step + 1, loop.total_steps)

    def around_step(self, loop: Any) -> contextlib.AbstractContextManager:
        return self.step(loop.step + 1, lambda: loop.state)

    def run_ended(self, loop: Any, failure: str | None) -> None:
        self.stop()
