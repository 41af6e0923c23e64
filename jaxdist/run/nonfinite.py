"""Steps whose loss is not finite: stop at the first, or skip up to a limit in a row.

An absurd learning rate or a bad batch makes the loss inf or NaN, and every step after it
trains on garbage. By default (``skip_nonfinite_steps = 0``) the run stops at the first such
step and keeps the last checkpoint saved before it. With ``skip_nonfinite_steps = N`` the step
itself leaves the model unchanged when its loss or gradients are not finite (as loss scaling
does, see :func:`jaxdist.training.loss_scale.finish_scaled_step`) and the run stops only after
N such steps in a row.

The losses are looked at when the trainer fetches its metrics anyway (every
``log_every_steps``) and before each checkpoint, never per step, so the device queue stays
full. A step with a finite loss may still leave the parameters inf (a huge update): before
saving, the parameters themselves are checked, so a checkpoint never holds them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxdist.run.hooks import Hook
from jaxdist.training.loss_scale import all_finite

__all__ = ["NonFiniteError", "NonFiniteGuard"]


class NonFiniteError(RuntimeError):
    """The run met a non-finite loss or parameters and stopped."""

    exit_code = 1


_params_finite = jax.jit(all_finite)


def _check_skip_limit(skip_limit: int) -> None:
    if skip_limit < 0:
        raise ValueError(f"skip_nonfinite_steps must be >= 0, got {skip_limit}")


class NonFiniteGuard(Hook):
    """Checks the per-step metrics when the loop reports them and the state before a save.

    Args:
      skip_limit: 0 to stop at the first non-finite loss; N > 0 when the steps skip such
        updates themselves (their metrics carry ``skipped``), to stop after N in a row.
      kept: says which checkpoint survives a stop now (for the error's last words).
    """

    def __init__(self, skip_limit: int, kept: Callable[[], str] = lambda: "no checkpoint") -> None:
        _check_skip_limit(skip_limit)
        self.skip_limit = skip_limit
        self.kept = kept
        self.skipped_in_a_row = 0
        self.skipped = 0
        self._checked_to = 0  # steps up to this one were looked at

    @classmethod
    def check_settings(
        cls, config: Any, total_steps: int, profile_steps: tuple[int, int] | None
    ) -> None:
        _check_skip_limit(config.skip_nonfinite_steps)

    def check_steps(self, last_step: int, metrics: Sequence[dict[str, Any]], kept: str) -> None:
        """Look at the fetched ``metrics`` of the steps ending at ``last_step`` (counted from 1);
        steps already looked at are passed over. ``kept`` says which checkpoint survives."""
        first = last_step - len(metrics) + 1
        for step, record in enumerate(metrics, start=first):
            if step <= self._checked_to:
                continue
            self._checked_to = step
            loss = float(record["loss"])
            if not self.skip_limit:
                if not math.isfinite(loss):
                    raise NonFiniteError(
                        f"the loss is {loss} at step {step}; stopped without saving it ({kept}): "
                        "lower the learning rate, or set skip_nonfinite_steps=N to skip up to "
                        "N such steps in a row"
                    )
                continue
            if bool(record["skipped"]):
                self.skipped += 1
                self.skipped_in_a_row += 1
                if self.skipped_in_a_row >= self.skip_limit:
                    raise NonFiniteError(
                        f"{self.skipped_in_a_row} steps in a row up to step {step} had a "
                        f"non-finite loss or gradients and were skipped "
                        f"(skip_nonfinite_steps={self.skip_limit}); stopped ({kept})"
                    )
            else:
                self.skipped_in_a_row = 0

    def check_params(self, step: int, params: Any, kept: str) -> None:
        """Refuse to go on (and save) with parameters that hold inf or NaN after ``step``."""
        if not bool(_params_finite(params)):
            raise NonFiniteError(
                f"the parameters are not finite after step {step}; stopped without saving "
                f"them ({kept}): lower the learning rate"
            )

    # As a hook of the training loop.

    def reported(self, loop: Any, fetched: list[dict]) -> None:
        self.check_steps(loop.step, fetched, self.kept())

    def saving(self, loop: Any) -> None:
        self.check_steps(loop.step, jax.device_get(loop.pending), self.kept())
        self.check_params(loop.step, loop.state.params, self.kept())
