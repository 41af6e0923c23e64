"""PipeDream's asynchronous schedules against an explicit one-device simulation of the same
update rule: weight stashing with an update after every backward, and 2BW's one-step-stale
gradients; the versions each keeps; what they refuse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_pipeline_step import (
    assert_trees_close,
    cross_entropy,
    data,
    mlp_stages,
    stage_mesh,
    whole_model_loss,
)

from jaxdist import meshes
from jaxdist.pipeline import stages as pipeline_stages
from jaxdist.pipeline.program import compile_schedule
from jaxdist.pipeline.schedules import build
from jaxdist.pipeline.step import PipelineStep
from jaxdist.training.loss_scale import DynamicLossScale
from tests._step_options import records

KEY = jax.random.key(3)


def micro_batches(batch, replicas, M):
    """Micro-batch m of the step: every replica's m-th slice of its block, together (the
    mean of the replicas' mean-loss gradients is the gradient of the mean over all)."""
    blocks = jax.tree.map(lambda x: x.reshape(replicas, M, -1, *x.shape[1:]), batch)
    return [
        jax.tree.map(lambda x, m=m: x[:, m].reshape(-1, *x.shape[3:]), blocks) for m in range(M)
    ]


def jitted_update(optimizer):
    """``(grads, opt_state, params) -> (params, opt_state)``: one optimizer step, jitted."""

    @jax.jit
    def apply(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return apply


def simulate_pipedream(fns, params, states, batch, optimizer, stages, M, replicas, steps):
    """PipeDream on one device, tick by tick through 1F1B's table: a forward uses the stage's
    newest weights and stashes them; a backward takes the gradient at the stashed weights and
    applies it to the newest at once. (Each stage's forward, backward and update are jitted:
    the same arithmetic, compiled once instead of dispatched op by op.)"""
    table = build("pipedream", stages, M).table
    params, states = list(params), list(states)
    opt_states = [optimizer.init(p) for p in params]
    last = stages - 1
    forward = [jax.jit(lambda p, state, x, s=s: fns[s](p, state, x, KEY)) for s in range(stages)]

    def backward_of(s):
        def backward(p, state, x, given):
            """The gradient at ``p`` and the cotangent of ``x``; ``given`` is the last stage's
            micro-batch (its loss is differentiated), else the cotangent of the output."""

            def run(p, x):
                y, _ = fns[s](p, state, x, KEY)
                return cross_entropy(y, given)[0] if s == last else y

            out, pull = jax.vjp(run, p, x)
            return pull(jnp.ones_like(out) if s == last else given)

        return jax.jit(backward)

    backward = [backward_of(s) for s in range(stages)]
    apply = jitted_update(optimizer)
    for _ in range(steps):
        micro = micro_batches(batch, replicas, M)
        outputs, stashed, cotangents = {}, {}, {}
        for row in table:
            for s, op in enumerate(row):
                if op is None:
                    continue
                m = op.microbatch
                x = micro[m]["x"] if s == 0 else outputs[(m, s - 1)]
                if op.kind == "F":
                    stashed[(m, s)] = params[s]
                    outputs[(m, s)], states[s] = forward[s](params[s], states[s], x)
                    continue
                given = micro[m] if s == last else cotangents.pop((m, s))
                grads, back = backward[s](stashed.pop((m, s)), states[s], x, given)
                if s > 0:
                    cotangents[(m, s - 1)] = back
                params[s], opt_states[s] = apply(grads, opt_states[s], params[s])
    return params


def simulate_2bw(fns, params, states, batch, optimizer, M, steps):
    """PipeDream-2BW on one device: each step's gradient, accumulated over its micro-batches,
    is taken at the weights one step older and applied to the newest (jitted, as above)."""
    loss_fn = whole_model_loss(fns)

    @jax.jit
    def step_grads(p, states):
        total = None
        for m in range(M):
            mb = jax.tree.map(lambda x, m=m: x.reshape(M, -1, *x.shape[1:])[m], batch)
            g = jax.grad(lambda p, mb=mb: loss_fn(p, states, mb, KEY)[0])(p)
            total = g if total is None else jax.tree.map(jnp.add, total, g)
        return jax.tree.map(lambda g: g / M, total)

    apply = jitted_update(optimizer)
    opt_state = optimizer.init(params)
    older = params
    for _ in range(steps):
        grads = step_grads(older, states)
        older, (params, opt_state) = params, apply(grads, opt_state, params)
    return params


def pipeline(schedule, mesh, M, optimizer, **options):
    stages = mesh.shape["stage"]
    batch = data()
    modules = mlp_stages(stages)
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:2])
    fns = pipeline_stages.flax_stages(modules)
    step = PipelineStep(
        fns,
        cross_entropy,
        optimizer,
        mesh,
        microbatches=M,
        schedule=schedule,
        inputs=lambda b: b["x"],
        **records(**options),
    )
    return step, fns, params, states, batch


def run(step, params, states, batch, steps):
    state = step.init(params, states)
    for _ in range(steps):
        state, metrics = step(state, step.shard_batch(batch), KEY)
    return state, metrics


@pytest.mark.parametrize(
    "stages, M",
    [
        (3, 6),
        pytest.param(2, 2, marks=pytest.mark.slow),
        pytest.param(4, 4, marks=pytest.mark.slow),
    ],
)
def test_pipedream_equals_its_simulation(stages, M):
    optimizer = optax.sgd(0.05, momentum=0.9)
    step, fns, params, states, batch = pipeline("pipedream", stage_mesh(stages), M, optimizer)
    state, _ = run(step, params, states, batch, steps=2)
    want = simulate_pipedream(fns, params, states, batch, optimizer, stages, M, 1, steps=2)
    got, _ = step.unstack(state)
    assert_trees_close(got, want)
    # Stashing, not the newest weights: training on the newest gives other parameters.
    plain = PipelineStep(
        fns,
        cross_entropy,
        optimizer,
        stage_mesh(stages),
        microbatches=M,
        schedule="1f1b",
        inputs=lambda b: b["x"],
    )
    other, _ = plain.unstack(run(plain, params, states, batch, steps=2)[0])
    assert (
        max(
            float(jnp.abs(a - b).max())
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(other), strict=True)
        )
        > 1e-3
    )


@pytest.mark.slow  # a PipeDream run beside its simulation: about 20 s
def test_pipedream_with_data_parallelism_averages_each_micro_batch():
    mesh = meshes.build("pipeline-2x4")
    optimizer = optax.adam(1e-2)
    step, fns, params, states, batch = pipeline(
        "pipedream", mesh, 3, optimizer, allreduce="ring", bucket_bytes=64
    )
    state, _ = run(step, params, states, batch, steps=2)
    want = simulate_pipedream(fns, params, states, batch, optimizer, 4, 3, replicas=2, steps=2)
    assert_trees_close(step.unstack(state)[0], want, atol=5e-6)


@pytest.mark.parametrize(
    "preset, M", [("pipeline-2x2x2", 2), pytest.param("pipeline-1x8", 8, marks=pytest.mark.slow)]
)
def test_2bw_equals_its_simulation(preset, M):
    mesh = meshes.build(preset)
    optimizer = optax.sgd(0.05, momentum=0.9)
    options = {"allreduce": "torus2d"} if preset == "pipeline-2x2x2" else {}
    step, fns, params, states, batch = pipeline("pipedream_2bw", mesh, M, optimizer, **options)
    state, _ = run(step, params, states, batch, steps=3)
    replicas = mesh.size // mesh.shape["stage"]
    want = simulate_2bw(fns, params, states, batch, optimizer, M * replicas, steps=3)
    got, _ = step.unstack(state)
    assert_trees_close(got, want, atol=5e-6)
    # The older version is the newest of the step before.
    previous, _ = step.unstack(state.replace(params=state.previous_params))
    want_previous = simulate_2bw(fns, params, states, batch, optimizer, M * replicas, steps=2)
    assert_trees_close(previous, want_previous, atol=5e-6)


def test_versions_kept_are_bounded_by_the_micro_batches_in_flight():
    for stages, M in ((2, 8), (4, 4), (4, 16), (8, 8)):
        program = compile_schedule(build("pipedream", stages, M))
        assert (
            program.weight_slots
            == min(stages, M)
            == max(build("1f1b", stages, M).live_activations())
        )


def test_what_asynchronous_schedules_refuse():
    mesh = stage_mesh(2)
    fns = pipeline_stages.flax_stages(mlp_stages(2))
    for options, message in [
        ({"loss_scale": DynamicLossScale.create()}, "loss scaling would skip some updates"),
        ({"skip_nonfinite": True}, "cannot skip a non-finite step"),
    ]:
        with pytest.raises(ValueError, match=message) as caught:
            PipelineStep(
                fns,
                cross_entropy,
                optax.sgd(0.1),
                mesh,
                microbatches=2,
                schedule="pipedream",
                **records(**options),
            )
        assert "\n" not in str(caught.value)
    np.testing.assert_equal(build("pipedream_2bw", 3, 6).table, build("1f1b", 3, 6).table)
