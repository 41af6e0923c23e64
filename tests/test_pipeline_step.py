"""The pipeline step equals plain training with gradient accumulation over the same
micro-batches, for every schedule, stage count and micro-batch count; its state is split by
stage; bad input gets one clear line."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh

from jaxdist import meshes
from jaxdist.models import init_variables
from jaxdist.models.resnet import resnet10, resnet18
from jaxdist.pipeline import stages as pipeline_stages
from jaxdist.pipeline.program import compile_schedule
from jaxdist.pipeline.schedules import build
from jaxdist.pipeline.step import PipelineStep
from jaxdist.training import global_norm
from jaxdist.training.gradients import local_gradients
from jaxdist.training.loss_scale import DynamicLossScale
from jaxdist.training.step_options import Communication, Precision

WIDTHS = (7, 13, 5, 11, 9, 6, 8, 3)  # uneven layers: stages differ in every shape


class Dense(nn.Module):
    """A dense layer, then (unless last) BatchNorm over the data axis too if ``norm``, tanh."""

    features: int
    last: bool = False
    norm: bool = False

    @nn.compact
    def __call__(self, x, *, train):
        x = nn.Dense(self.features)(x)
        if self.last:
            return x
        if self.norm:
            x = nn.BatchNorm(use_running_average=not train, axis_name="data", momentum=0.9)(x)
        return jnp.tanh(x)


def cross_entropy(outputs, micro_batch):
    log_p = jax.nn.log_softmax(outputs.astype(jnp.float32))
    labels = micro_batch["label"]
    loss = -jnp.take_along_axis(log_p, labels[:, None], 1).mean()
    return loss, {"accuracy": (outputs.argmax(-1) == labels).mean()}


def mlp_stages(virtual: int):
    layers = [Dense(w, last=i == len(WIDTHS) - 1) for i, w in enumerate(WIDTHS)]
    bounds = [int(b) for b in np.linspace(0, len(layers), virtual + 1)[:-1]]
    return [
        pipeline_stages.Chain(group) for group in pipeline_stages.cut(layers, boundaries=bounds)
    ]


def data(n=72, features=6):
    x = jax.random.normal(jax.random.key(1), (n, features))
    y = jax.random.randint(jax.random.key(2), (n,), 0, WIDTHS[-1])
    return {"x": x, "label": y}


def whole_model_loss(stage_fns):
    """The stages one after the other as one ``TrainStep`` loss function."""

    def loss_fn(params, model_state, batch, rng):
        h, new_states = batch["x"], []
        for fn, p, s in zip(stage_fns, params, model_state):
            h, s = fn(p, s, h, rng)
            new_states.append(s)
        loss, metrics = cross_entropy(h, batch)
        return loss, (new_states, metrics)

    return loss_fn


def reference(stage_fns, params, states, batch, optimizer, micro_batches, steps, loss_scale=None):
    """Whole-model training on one device, gradients summed over the same micro-batches."""
    loss_fn = whole_model_loss(stage_fns)

    @jax.jit
    def train_step(params, opt_state, states):
        grads, states, loss, _, _ = local_gradients(
            loss_fn, params, states, batch, jax.random.key(3), None, micro_batches
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, states, loss

    opt_state = optimizer.init(params)
    for _ in range(steps):
        params, opt_state, states, loss = train_step(params, opt_state, states)
    return params, states, loss


def run_pipeline(step, params, states, batch, steps):
    state = step.init(params, states)
    for _ in range(steps):
        state, metrics = step(state, step.shard_batch(batch), jax.random.key(3))
    return state, metrics


def assert_trees_close(a, b, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-5)


def stage_mesh(stages: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:stages]), ("stage",))


# Every schedule on S = 2, 3 (uneven stages) and 4 stages, and with M = 1 (gpipe, 1f1b), S and
# 3S micro-batches (interleaved: 2 chunks per device, and one case of 3), each stage count
# and each of these M once per schedule. The engine runs any table the same way; each
# schedule's table for every S and M is checked without compiling in
# test_pipeline_schedules.py. The default run keeps one to two cases of each schedule (2, 3
# and 4 stages among them); the rest are slow.
SLOW = pytest.mark.slow
EQUIVALENCE_CASES = [
    pytest.param("gpipe", 2, 6, 1, marks=SLOW),
    ("gpipe", 3, 3, 1),
    pytest.param("gpipe", 4, 1, 1, marks=SLOW),
    pytest.param("1f1b", 2, 2, 1, marks=SLOW),
    ("1f1b", 3, 1, 1),
    ("1f1b", 4, 12, 1),
    ("interleaved", 2, 2, 2),
    pytest.param("interleaved", 3, 9, 2, marks=SLOW),
    pytest.param("interleaved", 2, 2, 3, marks=SLOW),
]


@pytest.mark.parametrize("schedule, stages, micro_batches, chunks", EQUIVALENCE_CASES)
def test_pipeline_equals_accumulation(schedule, stages, micro_batches, chunks):
    batch = data()
    modules = mlp_stages(stages * chunks)
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:2])
    fns = pipeline_stages.flax_stages(modules)
    optimizer = optax.sgd(0.1, momentum=0.9)
    step = PipelineStep(
        fns,
        cross_entropy,
        optimizer,
        stage_mesh(stages),
        microbatches=micro_batches,
        schedule=schedule,
        chunks=chunks,
        inputs=lambda b: b["x"],
    )
    state, metrics = run_pipeline(step, params, states, batch, steps=3)
    want_params, _, want_loss = reference(fns, params, states, batch, optimizer, micro_batches, 3)
    got_params, _ = step.unstack(state)
    assert_trees_close(got_params, want_params)
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-5)
    assert step.trace_count == 1


@pytest.mark.parametrize(
    "schedule, stages, micro_batches, chunks",
    [("1f1b", 3, 3, 1), pytest.param("interleaved", 2, 2, 2, marks=pytest.mark.slow)],
)
def test_global_norm_clipping_takes_the_norm_over_every_stage(
    schedule, stages, micro_batches, chunks
):
    """Each stage updates its own layers, yet the clip scales them by the whole model's
    gradient norm: the pipeline equals one device clipping with optax's own transformation,
    and the clip bites (a stage-by-stage norm would land elsewhere)."""
    batch = data()
    modules = mlp_stages(stages * chunks)
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:2])
    fns = pipeline_stages.flax_stages(modules)
    max_norm = 0.05

    def optimizer(clip):
        return optax.chain(clip(max_norm), optax.adam(1e-2))

    step = PipelineStep(
        fns,
        cross_entropy,
        optimizer(global_norm.clip_by_global_norm),
        stage_mesh(stages),
        microbatches=micro_batches,
        schedule=schedule,
        chunks=chunks,
        inputs=lambda b: b["x"],
    )
    state, _ = run_pipeline(step, params, states, batch, steps=3)
    want, _, _ = reference(
        fns, params, states, batch, optimizer(optax.clip_by_global_norm), micro_batches, 3
    )
    got, _ = step.unstack(state)
    assert_trees_close(got, want)
    unclipped, _, _ = reference(fns, params, states, batch, optax.adam(1e-2), micro_batches, 3)
    assert not np.allclose(ravel_pytree(got)[0], ravel_pytree(unclipped)[0], atol=1e-4)


def test_pipedream_refuses_a_norm_over_the_whole_model():
    """PipeDream updates each stage at its own tick: no step holds every stage's gradient."""
    modules = mlp_stages(2)
    clipped = optax.chain(global_norm.clip_by_global_norm(1.0), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"updates each stage at its own time") as err:
        PipelineStep(
            pipeline_stages.flax_stages(modules),
            cross_entropy,
            clipped,
            stage_mesh(2),
            microbatches=2,
            schedule="pipedream",
        )
    assert "\n" not in str(err.value)


RESNET_CASES = [
    # (model, schedule, stages, chunks, micro-batches, boundaries): ResNet-10 has 6 layers (stem,
    # one block per stage, head), ResNet-18 10.
    (resnet10, "1f1b", 3, 1, 4, [0, 3, 5]),  # uneven: 3, 2, 1 layers
    pytest.param(resnet18, "gpipe", 2, 1, 2, [0, 6], marks=pytest.mark.slow),
    pytest.param(resnet18, "interleaved", 2, 2, 2, [0, 3, 5, 8], marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    "resnet, schedule, stages, chunks, micro_batches, boundaries", RESNET_CASES
)
@pytest.mark.slow  # a ResNet cut into stages against accumulation: about 40 s
def test_resnet_stages_with_batchnorm_equal_accumulation(
    resnet, schedule, stages, chunks, micro_batches, boundaries
):
    """BatchNorm inside a pipeline normalises each micro-batch with its own statistics and
    threads its running statistics through the micro-batches in order, as accumulation does."""
    model = resnet(num_classes=5, width=4, stem="small")
    images = jax.random.normal(jax.random.key(1), (16, 8, 8, 3))
    batch = {"x": images, "label": jax.random.randint(jax.random.key(2), (16,), 0, 5)}
    variables = init_variables(model, jax.random.key(0), images[:2])
    modules = pipeline_stages.split_module(model, boundaries=boundaries)
    params, states = pipeline_stages.split_variables(variables, modules, images[:2])
    fns = pipeline_stages.flax_stages(modules)
    optimizer = optax.sgd(0.05, momentum=0.9)
    step = PipelineStep(
        fns,
        cross_entropy,
        optimizer,
        stage_mesh(stages),
        microbatches=micro_batches,
        schedule=schedule,
        chunks=chunks,
        inputs=lambda b: b["x"],
    )
    state, _ = run_pipeline(step, params, states, batch, steps=2)
    want_params, want_states, _ = reference(fns, params, states, batch, optimizer, micro_batches, 2)
    got_params, got_states = step.unstack(state)
    assert_trees_close(got_params, want_params, atol=1e-5)
    assert_trees_close(got_states, want_states, atol=1e-5)


@pytest.mark.parametrize(
    "preset, allreduce, options",
    [
        pytest.param("pipeline-2x4", "ring", {}, marks=pytest.mark.slow),
        ("pipeline-2x4", "bidirectional_ring", {}),
        ("pipeline-2x2x2", "torus2d", {}),
        ("pipeline-2x4", "halving_doubling", {"transfer_dtype": jnp.bfloat16}),
    ],
)
def test_pipeline_with_data_parallelism(preset, allreduce, options):
    mesh = meshes.build(preset)
    stages = mesh.shape["stage"]
    replicas = mesh.size // stages
    batch = data()
    modules = mlp_stages(stages)
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:2])
    fns = pipeline_stages.flax_stages(modules)
    optimizer = optax.adam(1e-2)
    step = PipelineStep(
        fns,
        cross_entropy,
        optimizer,
        mesh,
        microbatches=3,
        communication=Communication(allreduce, options=options, bucket_bytes=64),
        inputs=lambda b: b["x"],
    )
    state, metrics = run_pipeline(step, params, states, batch, steps=2)
    # Every replica's micro-batches are consecutive slices of the batch, all of one size: the
    # mean over replicas of their accumulated gradients is accumulation over all of them.
    want, _, want_loss = reference(fns, params, states, batch, optimizer, 3 * replicas, 2)
    got, _ = step.unstack(state)
    atol = 2e-3 if options else 2e-6  # bf16 messages round the gradients to 8 bits
    assert_trees_close(got, want, atol=atol)
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-3 if options else 1e-5)


def test_loss_scaling_changes_nothing_but_the_scale():
    batch = data()
    modules = mlp_stages(2)
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:2])
    fns = pipeline_stages.flax_stages(modules)
    optimizer = optax.sgd(0.1)
    step = PipelineStep(
        fns,
        cross_entropy,
        optimizer,
        stage_mesh(2),
        microbatches=2,
        precision=Precision(loss_scale=DynamicLossScale.create(2.0**10)),
        inputs=lambda b: b["x"],
    )
    state, metrics = run_pipeline(step, params, states, batch, steps=2)
    want, _, _ = reference(fns, params, states, batch, optimizer, 2, 2)
    assert_trees_close(step.unstack(state)[0], want)
    assert bool(metrics["grads_finite"]) and float(metrics["loss_scale"]) == 2.0**10


def test_skip_nonfinite_leaves_every_stage_as_it_was():
    """A NaN input poisons the loss and every stage's gradients: the step is skipped on all
    stages and reported; the good batch after it trains as the unpoisoned reference does."""
    batch = data()
    modules = mlp_stages(2)
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:2])
    fns = pipeline_stages.flax_stages(modules)
    optimizer = optax.sgd(0.1)
    step = PipelineStep(
        fns,
        cross_entropy,
        optimizer,
        stage_mesh(2),
        microbatches=2,
        precision=Precision(skip_nonfinite=True),
        inputs=lambda b: b["x"],
    )
    skips_poison_then_trains(step, fns, params, states, batch, optimizer, row=0)


def skips_poison_then_trains(step, fns, params, states, batch, optimizer, row):
    """Poison ``batch`` at ``row``: the step is skipped and changes nothing but its count;
    then the clean batch trains as the reference does. The skipped step's metrics."""
    state = step.init(params, states)
    poisoned = {**batch, "x": batch["x"].at[row, 0].set(jnp.nan)}
    state, skipped = step(state, step.shard_batch(poisoned), jax.random.key(3))
    assert bool(skipped["skipped"]) and int(state.step) == 1
    assert_trees_close(step.unstack(state)[0], params, atol=0)
    state, metrics = step(state, step.shard_batch(batch), jax.random.key(3))
    assert not bool(metrics["skipped"])
    micro_batches = step.microbatches * step.num_replicas
    want, _, _ = reference(fns, params, states, batch, optimizer, micro_batches, 1)
    assert_trees_close(step.unstack(state)[0], want)
    return skipped


def test_each_device_holds_only_its_stage():
    """Parameters and optimizer state are split by stage: the compiled program's arguments
    per device are about the largest stage's, not the whole model's."""
    widths = (256,) * 7 + (10,)
    layers = [Dense(w, last=i == len(widths) - 1) for i, w in enumerate(widths)]
    modules = [pipeline_stages.Chain(g) for g in pipeline_stages.cut(layers, stages=4)]
    batch = {"x": jnp.ones((8, 256)), "label": jnp.zeros((8,), jnp.int32)}
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:1])
    step = PipelineStep(
        pipeline_stages.flax_stages(modules),
        cross_entropy,
        optax.adam(1e-3),
        stage_mesh(4),
        microbatches=2,
        inputs=lambda b: b["x"],
    )
    state = step.init(params, states)
    compiled = step.lower(state, step.shard_batch(batch), jax.random.key(0)).compile()
    arguments = compiled.memory_analysis().argument_size_in_bytes
    sizes = [sum(x.size * 4 for x in jax.tree.leaves(p)) for p in params]
    # params + Adam's two moments, of the largest stage, plus the batch (replicated) and rng.
    largest = 3 * max(sizes)
    assert largest <= arguments < largest + 16 * 1024
    assert arguments < 0.3 * 3 * sum(sizes)  # the whole model's would be 3 * sum(sizes)


def test_gpipe_stashes_every_micro_batch_and_1f1b_at_most_the_stage_count():
    for micro_batches in (4, 8, 16):
        gpipe = compile_schedule(build("gpipe", 4, micro_batches))
        one_f_one_b = compile_schedule(build("1f1b", 4, micro_batches))
        assert gpipe.input_slots == micro_batches
        assert one_f_one_b.input_slots == 4


def test_bad_input_gets_one_line():
    modules = mlp_stages(4)
    fns = pipeline_stages.flax_stages(modules)
    sgd = optax.sgd(0.1)
    with pytest.raises(ValueError, match="no stage axis 'stage'"):
        PipelineStep(fns, cross_entropy, sgd, meshes.ring(4), microbatches=2)
    with pytest.raises(ValueError, match="schedule must be one of gpipe, 1f1b, interleaved"):
        PipelineStep(fns, cross_entropy, sgd, stage_mesh(4), microbatches=2, schedule="zb")
    with pytest.raises(ValueError, match="allreduce 'torus2d' needs two data axes"):
        PipelineStep(
            fns,
            cross_entropy,
            sgd,
            meshes.build("pipeline-2x4"),
            microbatches=2,
            communication=Communication("torus2d"),
        )
    with pytest.raises(ValueError, match="3 stage functions for 4 stages"):
        PipelineStep(fns[:3], cross_entropy, sgd, stage_mesh(4), microbatches=2)
    with pytest.raises(ValueError, match="7 layers do not divide into 2 equal stages"):
        pipeline_stages.cut(list(range(7)), stages=2)
    with pytest.raises(ValueError, match="boundaries must start at 0"):
        pipeline_stages.cut(list(range(7)), boundaries=[1, 4])
    with pytest.raises(ValueError, match="stay below the 7 layers"):
        pipeline_stages.cut(list(range(7)), boundaries=[0, 4, 7])
    batch = data(n=10)
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:2])
    step = PipelineStep(
        fns, cross_entropy, sgd, stage_mesh(4), microbatches=4, inputs=lambda b: b["x"]
    )
    state = step.init(params, states)
    with pytest.raises(ValueError, match=r"batch of 10 .* does not split into microbatches=4"):
        step(state, step.shard_batch(batch), jax.random.key(0))
    assert step.trace_count == 0


def test_cross_replica_batchnorm_over_the_data_axis_equals_data_parallel_training():
    from jaxdist.training.train_step import TrainStep

    widths = (8, 6, 7, 3)
    modules = [
        pipeline_stages.Chain([Dense(w, last=i == 3, norm=True)]) for i, w in enumerate(widths)
    ]
    batch = data(n=24)
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:2])
    fns = pipeline_stages.flax_stages(modules)
    optimizer = optax.sgd(0.1)
    step = PipelineStep(
        fns,
        cross_entropy,
        optimizer,
        meshes.build("pipeline-2x4"),
        microbatches=2,
        communication=Communication("ring"),
        inputs=lambda b: b["x"],
    )
    state, metrics = run_pipeline(step, params, states, batch, steps=2)

    data_mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    plain = TrainStep(
        whole_model_loss(fns),
        optimizer,
        data_mesh,
        communication=Communication("ring"),
        accumulation_steps=2,
    )
    want = plain.init(params, states)
    for _ in range(2):
        want, want_metrics = plain(want, plain.shard_batch(batch), jax.random.key(3))
    got_params, got_states = step.unstack(state)
    assert_trees_close((got_params, got_states), (want.params, want.model_state))
    np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-5)


def test_a_stateless_stage_may_be_a_function_of_params_and_input():
    """``(params, x) -> y`` stages with no model state or randomness: two dense layers as
    plain functions train as the one-device model does."""
    rng = np.random.default_rng(0)
    params = [
        {"w": jnp.asarray(rng.standard_normal((6, 8)) * 0.3, jnp.float32)},
        {"w": jnp.asarray(rng.standard_normal((8, WIDTHS[-1])) * 0.3, jnp.float32)},
    ]
    stages = [lambda p, x: jnp.tanh(x @ p["w"]), lambda p, x: x @ p["w"]]
    batch = data(n=8)
    step = PipelineStep(
        stages,
        cross_entropy,
        optax.sgd(0.5),
        stage_mesh(2),
        microbatches=2,
        inputs=lambda b: b["x"],
    )
    state = step.init(params, [{}, {}])
    state, _ = step(state, step.shard_batch(batch), jax.random.key(0))

    def whole(params):
        return cross_entropy(stages[1](params[1], stages[0](params[0], batch["x"])), batch)[0]

    want = jax.tree.map(lambda p, g: p - 0.5 * g, params, jax.grad(whole)(params))
    for got, expected in zip(step.unstack(state)[0], want, strict=True):
        np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(expected["w"]), atol=2e-6)
