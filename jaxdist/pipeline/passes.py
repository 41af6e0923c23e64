"""What one device does in one pipeline tick, as the branches of a ``lax.switch``, and its
stage's optimizer update.

Every device runs the same program, so every virtual stage's forward and backward pass is a
branch of it; the table picks the branch (0 idle, ``1 + v`` forward of virtual stage v,
``1 + V + v`` its backward). A branch reads and returns the tick's carry: the activation and
gradient stashes, the summed gradients, the model state, the loss and metric sums, and the two
messages the tick sends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

__all__ = ["branches", "update"]


def branches(step: Any, params: jax.Array, micro: Any, rng: jax.Array, scale) -> list[Callable]:
    """The switch's branches for a :class:`~jaxdist.pipeline.step.PipelineStep`'s tick:
    ``branch(carry, microbatch, input_slot, grad_slot) -> carry``. ``params`` is this device's
    ``(chunks, size)`` parameter block, ``micro`` its batch cut into micro-batches."""
    S, V = step.num_stages, len(step.stages)
    acts = step.activations
    p_layout, s_layout = step.layouts["params"], step.layouts["model_state"]
    silent = jnp.zeros((acts.size,), acts.dtype)

    def stage_inputs(v: int, carry: dict, m: jax.Array, input_slot: jax.Array):
        """(params tree, model-state tree, input, micro-batch, rng) of virtual stage v."""
        chunk = v // S
        mb = jax.tree.map(lambda x: x[m], micro)
        x = step.inputs(mb) if v == 0 else acts.unflatten(v - 1, carry["stash"][input_slot])
        p = p_layout.unflatten(v, params[chunk])
        ms = s_layout.unflatten(v, carry["model_state"][chunk])
        # The same rng in the forward and in its recomputation: dropout masks agree.
        key = jax.random.fold_in(jax.random.fold_in(rng, m), v)
        return p, ms, x, mb, key

    def idle(carry, m, input_slot, grad_slot):
        return {**carry, "send_forward": silent, "send_backward": silent}

    def forward(v: int) -> Callable:
        def run(carry, m, input_slot, grad_slot):
            p, ms, x, mb, key = stage_inputs(v, carry, m, input_slot)
            y, new_ms = step.stages[v](p, ms, x, key)
            chunk = v // S
            carry = {
                **carry,
                "model_state": carry["model_state"].at[chunk].set(s_layout.flatten(new_ms)),
                "send_forward": silent if v == V - 1 else acts.flatten(y),
                "send_backward": silent,
            }
            if v == V - 1:
                loss, metrics = step.loss_fn(y, mb)
                carry["loss"] = carry["loss"] + loss.astype(jnp.float32)
                carry["metrics"] = jax.tree.map(jnp.add, carry["metrics"], metrics)
            return carry

        return run

    def backward(v: int) -> Callable:
        def run(carry, m, input_slot, grad_slot):
            p, ms, x, mb, key = stage_inputs(v, carry, m, input_slot)

            def recompute(p, x):
                y, _ = step.stages[v](p, ms, x, key)
                if v < V - 1:
                    return y
                loss, _ = step.loss_fn(y, mb)
                return loss if scale is None else loss * scale.astype(loss.dtype)

            if v == 0:  # the batch's own input: no gradient to send back
                out, pull = jax.vjp(lambda p: recompute(p, x), p)
            else:
                out, pull = jax.vjp(recompute, p, x)
            if v == V - 1:
                cotangent = jnp.ones_like(out)
            else:
                cotangent = acts.unflatten(v, carry["grad_stash"][grad_slot]).astype(out.dtype)
            pulled = pull(cotangent)
            chunk = v // S
            return {
                **carry,
                "grads": carry["grads"].at[chunk].add(p_layout.flatten(pulled[0])),
                "send_forward": silent,
                "send_backward": silent if v == 0 else acts.flatten(pulled[1]),
            }

        return run

    return [idle, *(forward(v) for v in range(V)), *(backward(v) for v in range(V))]


def update(
    step: Any, params: jax.Array, grads: jax.Array, opt_state: jax.Array, stage: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Apply the optimizer to each of this device's chunks, as the trees of its virtual stage."""
    S = step.num_stages
    p_layout, o_layout = step.layouts["params"], step.layouts["opt_state"]

    def update_of(v: int) -> Callable:
        def run(p_flat, g_flat, o_flat):
            p = p_layout.unflatten(v, p_flat)
            g = p_layout.unflatten(v, g_flat.astype(p_flat.dtype))
            o = o_layout.unflatten(v, o_flat)
            updates, o = step.optimizer.update(g, o, p)
            return p_layout.flatten(optax.apply_updates(p, updates)), o_layout.flatten(o)

        return run

    new_params, new_opt = [], []
    for chunk in range(step.chunks):
        p, o = lax.switch(
            stage, [update_of(chunk * S + s) for s in range(S)],
            params[chunk], grads[chunk], opt_state[chunk],
        )  # fmt: skip
        new_params.append(p)
        new_opt.append(o)
    return jnp.stack(new_params), jnp.stack(new_opt)
