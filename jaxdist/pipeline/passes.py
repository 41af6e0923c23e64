"""What one device does in one pipeline tick, as the branches of a ``lax.switch``; the loop
over a schedule's ticks; and each stage's optimizer update.

Every device runs the same program, so every virtual stage's forward and backward pass is a
branch of it; the table picks the branch (0 idle, ``1 + v`` forward of virtual stage v,
``1 + V + v`` its backward). A branch reads and returns the tick's carry: the activation and
gradient stashes, the summed gradients, the model state, the loss and metric sums, and the two
messages the tick sends.

:func:`branches` is longer than 60 lines because the forward, backward and idle branches
share their closures (this device's parameters, micro-batches, rng and packings); apart, each
would need them all passed in again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxdist.comm import collectives
from jaxdist.pipeline.program import Program
from jaxdist.pipeline.stages import ActivationPacking
from jaxdist.training import global_norm
from jaxdist.training.step_options import Communication, Precision

__all__: list[str] = []  # building blocks of the package's own modules


class StageStep(Protocol):
    """What the passes read of the :class:`~jaxdist.pipeline.step.PipelineStep` they run: its
    schedule's program, its stages and their flat packings, and its options."""

    mesh: Mesh
    stage_axis: str
    data_axes: tuple[str, ...]
    reduce_axes: str | tuple[str, ...] | None
    num_stages: int
    chunks: int
    program: Program
    stages: list[Callable]
    inputs: Callable[[Any], jax.Array]
    loss_fn: Callable
    optimizer: optax.GradientTransformation
    communication: Communication
    precision: Precision
    sums_over_model: bool
    donate: bool
    packings: dict[str, Any] | None
    activations: ActivationPacking | None

    @property
    def averages_gradients(self) -> bool: ...
    def state_spec(self, name: str) -> PartitionSpec: ...


def branches(
    step: StageStep,
    params: jax.Array,
    micro: Any,
    rng: jax.Array,
    scale,
    weights: Callable | None = None,
) -> list[Callable]:
    """The switch's branches for a :class:`~jaxdist.pipeline.step.PipelineStep`'s tick:
    ``branch(carry, microbatch, input_slot, grad_slot, weight_slot) -> carry``. ``params`` is
    this device's ``(chunks, size)`` parameter block, ``micro`` its batch cut into
    micro-batches. ``weights(carry, kind, weight_slot)``, if given, is the block a forward
    (``kind`` ``"F"``) or backward (``"B"``) op uses instead (PipeDream's stashed versions)."""
    if weights is None:
        weights = lambda carry, kind, weight_slot: params  # noqa: E731
    S, V = step.num_stages, len(step.stages)
    acts = step.activations
    p_packing, s_packing = step.packings["gathered"], step.packings["model_state"]
    silent = jnp.zeros((acts.size,), acts.dtype)

    def stage_inputs(v: int, carry: dict, m: jax.Array, input_slot: jax.Array, block):
        """(params tree, model-state tree, input, micro-batch, rng) of virtual stage v."""
        chunk = v // S
        mb = jax.tree.map(lambda x: x[m], micro)
        x = step.inputs(mb) if v == 0 else acts.unflatten(v - 1, carry["stash"][input_slot])
        p = p_packing.unflatten(v, block[chunk])
        ms = s_packing.unflatten(v, carry["model_state"][chunk])
        # The same rng in the forward and in its recomputation: dropout masks agree.
        key = jax.random.fold_in(jax.random.fold_in(rng, m), v)
        return p, ms, x, mb, key

    def idle(carry, m, input_slot, grad_slot, weight_slot):
        return {**carry, "send_forward": silent, "send_backward": silent}

    def forward(v: int) -> Callable:
        def run(carry, m, input_slot, grad_slot, weight_slot):
            block = weights(carry, "F", weight_slot)
            p, ms, x, mb, key = stage_inputs(v, carry, m, input_slot, block)
            y, new_ms = step.stages[v](p, ms, x, key)
            chunk = v // S
            carry = {
                **carry,
                "model_state": carry["model_state"].at[chunk].set(s_packing.flatten(new_ms)),
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
        def run(carry, m, input_slot, grad_slot, weight_slot):
            block = weights(carry, "B", weight_slot)
            p, ms, x, mb, key = stage_inputs(v, carry, m, input_slot, block)

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
                "grads": carry["grads"].at[chunk].add(p_packing.flatten(pulled[0])),
                "send_forward": silent,
                "send_backward": silent if v == 0 else acts.flatten(pulled[1]),
            }

        return run

    return [idle, *(forward(v) for v in range(V)), *(backward(v) for v in range(V))]


def update(
    step: StageStep, params: jax.Array, grads: jax.Array, opt_state: jax.Array, stage: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Apply the optimizer to each of this device's chunks, as the trees of its virtual stage.

    Quantities the optimizer sums over the whole model (:func:`~jaxdist.training.global_norm.
    model_sum`: global-norm clipping's sum of squares) are summed over every stage and chunk
    first, when the optimizer calls ``model_sum`` at all (``step.sums_over_model``): the
    update runs once to record this device's parts, which are added over its chunks and the
    stage axis, and again with the totals."""
    p_packing, o_packing = step.packings["params"], step.packings["opt_state"]

    def update_of(v: int, totals: list | None) -> Callable:
        def run(p_flat, g_flat, o_flat):
            p = p_packing.unflatten(v, p_flat)
            g = p_packing.unflatten(v, g_flat.astype(p_flat.dtype))
            o = o_packing.unflatten(v, o_flat)
            updates, o = step.optimizer.update(g, o, p)
            return p_packing.flatten(optax.apply_updates(p, updates)), o_packing.flatten(o)

        if not step.sums_over_model:
            return run
        if totals is None:  # the first pass: only the parts
            return lambda *flats: global_norm.partial_sums(lambda: run(*flats))[1]
        return lambda *flats: global_norm.with_sums(lambda: run(*flats), totals)

    def each_chunk(totals: list | None) -> list:
        return per_chunk(step, stage, lambda v: update_of(v, totals), params, grads, opt_state)

    totals = None
    if step.sums_over_model:
        totals = [sum(parts) for parts in zip(*each_chunk(None), strict=True)]
        totals = lax.psum(totals, step.stage_axis)
    new_params, new_opt = zip(*each_chunk(totals), strict=True)
    return jnp.stack(new_params), jnp.stack(new_opt)


def per_chunk(
    step: StageStep, stage: jax.Array, branch: Callable[[int], Callable], *arrays: jax.Array
) -> list:
    """For each of this device's chunks, ``branch(v)(*(a[chunk] for a in arrays))`` with
    ``v`` the virtual stage this device runs in that chunk (``stage`` is its place on the
    stage axis, known only inside the program: a ``lax.switch`` picks the branch)."""
    S = step.num_stages
    return [
        lax.switch(stage, [branch(chunk * S + s) for s in range(S)], *(a[chunk] for a in arrays))
        for chunk in range(step.chunks)
    ]


def run_schedule(
    step: StageStep,
    state: Any,
    params,
    micro: Any,
    rng: jax.Array,
    scale,
    metric_shapes,
    stage,
    updates: Any = None,
) -> dict:
    """Every tick of the step's schedule table on this device, one loop turn each: the tick's
    branch, then the activation sent to the next stage and the gradient to the previous one
    by collective permutes along the stage axis. ``state`` is this device's block of the
    :class:`~jaxdist.pipeline.state.PipelineState`, ``params`` its ``(chunks, size)``
    parameters. ``updates`` (PipeDream's :class:`~jaxdist.pipeline.asynchronous.PerBackward`)
    adds its state to the carry, chooses each op's weights and updates after every backward.
    Returns the final carry."""
    S = step.num_stages
    acts = step.activations
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
    carry = {
        "stash": jnp.zeros((step.program.input_slots + 1, acts.size), acts.dtype),
        "grad_stash": jnp.zeros((step.program.grad_slots + 1, acts.size), acts.dtype),
        "grads": jnp.zeros(params.shape, jnp.float32),
        "model_state": state.model_state[0],
        "loss": jnp.zeros((), jnp.float32),
        "metrics": zeros(metric_shapes),
        "send_forward": jnp.zeros((acts.size,), acts.dtype),
        "send_backward": jnp.zeros((acts.size,), acts.dtype),
    }
    if updates is not None:
        carry = updates.init_carry(carry)
    weights = None if updates is None else updates.weights
    ops = branches(step, params, micro, rng, scale, weights)
    tables = {
        name: jnp.asarray(getattr(step.program, name))
        for name in (
            "branch",
            "microbatch",
            "input_slot",
            "grad_slot",
            "receive_input",
            "receive_grad",
            "weight_slot",
        )
    }
    forward_perm = [(i, i + 1) for i in range(S - 1)] + ([(S - 1, 0)] if step.chunks > 1 else [])
    backward_perm = [(i + 1, i) for i in range(S - 1)] + ([(0, S - 1)] if step.chunks > 1 else [])

    sends_forward = jnp.asarray(step.program.sends_forward)
    sends_backward = jnp.asarray(step.program.sends_backward)

    def send(active, message, perm):
        # Every device takes the same branch (the flag depends on the tick alone), so a
        # tick in which no stage sends that way sends nothing at all.
        return lax.cond(
            active,
            lambda m: lax.ppermute(m, step.stage_axis, perm),
            jnp.zeros_like,
            message,
        )

    def tick(t, carry):
        at = {name: table[t, stage] for name, table in tables.items()}
        if updates is not None:
            carry = updates.before_tick(carry, at)
        carry = lax.switch(
            at["branch"],
            ops,
            carry,
            at["microbatch"],
            at["input_slot"],
            at["grad_slot"],
            at["weight_slot"],
        )
        if updates is not None:
            carry = updates.after_tick(carry, at, t)
        if S > 1:
            arrived = send(sends_forward[t], carry["send_forward"], forward_perm)
            returned = send(sends_backward[t], carry["send_backward"], backward_perm)
            carry = {
                **carry,
                "stash": carry["stash"].at[at["receive_input"]].set(arrived),
                "grad_stash": carry["grad_stash"].at[at["receive_grad"]].set(returned),
            }
        return carry

    return lax.fori_loop(0, step.program.schedule.ticks, tick, carry)


def activation_packing(step: StageStep, micro: Any) -> tuple[ActivationPacking, Any]:
    """Shapes sent between stages for one micro-batch, and the loss's metrics' shapes."""
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micro)
    x = jax.eval_shape(step.inputs, one)
    shapes = []
    for v, apply in enumerate(step.stages):
        p = jax.eval_shape(
            functools.partial(step.packings["gathered"].unflatten, v), _flat(step, "gathered")
        )
        ms = jax.eval_shape(
            functools.partial(step.packings["model_state"].unflatten, v),
            _flat(step, "model_state"),
        )
        x, _ = jax.eval_shape(apply, p, ms, x, jax.random.key(0))
        shapes.append(x)
    _, metrics = jax.eval_shape(step.loss_fn, shapes[-1], one)
    return ActivationPacking(tuple(shapes[:-1])), metrics


def _flat(step: StageStep, name: str) -> jax.ShapeDtypeStruct:
    packing = step.packings[name]
    return jax.ShapeDtypeStruct((packing.size,), packing.dtype)


def mean_over_data_axes(
    grads: jax.Array, axes: str | tuple[str, ...], communication: Communication
) -> jax.Array:
    """Mean of this device's stage gradients over the data ``axes`` with the communication's
    allreduce, in buckets of its ``bucket_bytes``, the last chunk first."""
    flat = grads.reshape(-1)
    per_bucket = max(1, (communication.bucket_bytes or flat.nbytes) // flat.dtype.itemsize)
    starts = list(range(0, flat.size, per_bucket))[::-1]
    pieces = {}
    for start in starts:
        (pieces[start],) = collectives.allreduce(
            [flat[start : start + per_bucket]],
            axes,
            communication.allreduce,
            op="mean",
            **communication.options,
        )
    return jnp.concatenate([pieces[s] for s in sorted(pieces)]).reshape(grads.shape)
