"""PipeDream's asynchronous schedules: weight stashing, and PipeDream-2BW's two versions.

Both run 1F1B's table (:mod:`jaxdist.pipeline.schedules`) in the same single program as the
synchronous schedules, and compose with any allreduce over the data axes. What differs is
when a stage's weights change and which weights a micro-batch's passes see.

* ``pipedream`` (PipeDream's weight stashing): a stage updates its weights after every
  backward, with that micro-batch's gradient (first averaged over the data axes), applying
  the optimizer to its newest weights. A micro-batch's forward runs on the newest weights,
  which are stashed; its backward runs on the stashed copy, so its gradient is that of the
  weights its forward saw. Under 1F1B stage s has at most S − s micro-batches in flight, so
  it keeps at most S − s versions (:attr:`~jaxdist.pipeline.program.Program.weight_slots`).
  Stages do not agree on one version per micro-batch (no vertical sync), as in PipeDream.
  A step of M micro-batches makes M updates, each at the step's learning rate; the pipeline
  fills and drains once per step, with no flush between its micro-batches.
* ``pipedream_2bw`` (PipeDream-2BW): every micro-batch of a step runs on the version one step
  older than the newest, and the step's accumulated gradient updates the newest:
  ``W(t+1) = W(t) − lr · ∇f(W(t−1))``. Two versions are kept: the state's
  ``previous_params`` beside ``params``.

Staleness: PipeDream's gradients at stage s are S − s − 1 updates old, 2BW's one step old.
Loss scaling and skipping non-finite steps are refused with either: a skipped update would
leave the stashed versions of the micro-batches in flight out of step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.pipeline.passes import StageStep, mean_over_data_axes, update
from jaxdist.pipeline.schedules import ASYNCHRONOUS

__all__ = ["PerBackward", "check_options"]


def check_options(schedule: str, loss_scale: Any, skip_nonfinite: bool, chunks: int) -> None:
    """One line for each option an asynchronous schedule cannot honour."""
    if schedule not in ASYNCHRONOUS:
        return
    if loss_scale is not None:
        raise ValueError(
            f"schedule={schedule!r} updates on weights older than the newest; loss scaling "
            "would skip some updates and not the versions stashed for them: train in "
            "bfloat16 or float32, or use a synchronous schedule (gpipe, 1f1b)"
        )
    if skip_nonfinite:
        raise ValueError(
            f"schedule={schedule!r} cannot skip a non-finite step: the versions stashed for "
            "its micro-batches would go out of step; leave skip_nonfinite off"
        )
    if chunks != 1:
        raise ValueError(
            f"schedule={schedule!r} keeps one model chunk per device; chunks={chunks} is for "
            "the interleaved schedule"
        )


class PerBackward:
    """PipeDream's updates inside :func:`~jaxdist.pipeline.passes.run_schedule`: the newest
    weights and optimizer state travel in the loop's carry, a forward stashes the weights it
    uses, a backward uses its stash, and every backward's gradient updates the newest."""

    def __init__(self, step: StageStep, params: jax.Array, opt_state: jax.Array, stage) -> None:
        self.step, self.params, self.opt_state, self.stage = step, params, opt_state, stage
        self.slots = step.program.weight_slots
        self.virtual = len(step.stages)
        self.runs_backward = jnp.asarray(step.program.runs_backward)

    def init_carry(self, carry: dict) -> dict:
        stash = jnp.zeros((self.slots + 1, self.params.shape[-1]), self.params.dtype)
        return {**carry, "params": self.params, "opt_state": self.opt_state, "weights": stash}

    def weights(self, carry: dict, kind: str, weight_slot: jax.Array) -> jax.Array:
        """The ``(chunks, size)`` block an op uses: the newest for a forward, the stashed
        version of its micro-batch for a backward."""
        return carry["params"] if kind == "F" else carry["weights"][weight_slot][None]

    def before_tick(self, carry: dict, at: dict) -> dict:
        """Stash the newest weights where this tick's forward will need them back (the spare
        slot otherwise) and start the tick's gradient at zero."""
        forward = (at["branch"] >= 1) & (at["branch"] <= self.virtual)
        slot = jnp.where(forward, at["weight_slot"], self.slots)
        return {
            **carry,
            "weights": carry["weights"].at[slot].set(carry["params"][0]),
            "grads": jnp.zeros_like(carry["grads"]),
        }

    def after_tick(self, carry: dict, at: dict, t: jax.Array) -> dict:
        """After a backward, the micro-batch's gradient, averaged over the data axes, updates
        the newest weights. Every device of a tick that has a backward anywhere joins the
        average (zeros from those without), so the collective runs on all of them alike."""
        step, grads = self.step, carry["grads"]
        if step.data_axes and step.averages_gradients:
            grads = lax.cond(
                self.runs_backward[t],
                lambda g: mean_over_data_axes(g, step.reduce_axes, step.communication),
                lambda g: g,
                grads,
            )

        def apply(operands):
            params, grads, opt_state = operands
            return update(step, params, grads, opt_state, self.stage)

        backward = at["branch"] > self.virtual
        params, opt_state = lax.cond(
            backward,
            apply,
            lambda operands: (operands[0], operands[2]),
            (carry["params"], grads, carry["opt_state"]),
        )
        return {**carry, "params": params, "opt_state": opt_state}
