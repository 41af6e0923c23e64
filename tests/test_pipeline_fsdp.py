"""FSDP inside pipeline stages: each stage's parameters and optimizer state split over the data
axes train exactly as one device does, with optimizers that read whole layers and the whole
model; each device keeps its share of the state; what cannot compose is refused in one line."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_pipeline_step import (
    Dense,
    assert_trees_close,
    cross_entropy,
    data,
    mlp_stages,
    reference,
    run_pipeline,
    skips_poison_then_trains,
    stage_mesh,
)

from jaxdist import meshes
from jaxdist.pipeline import stages as pipeline_stages
from jaxdist.pipeline.fsdp import ShardedFlatPacking
from jaxdist.pipeline.step import PipelineStep
from jaxdist.training import global_norm
from jaxdist.training.loss_scale import DynamicLossScale
from jaxdist.training.step_options import Communication, Precision, StateSharding
from tests._step_options import records


def lars():
    """LARS with weight decay and trust ratios masked by shape (kernels only): a layer's norm
    and a mask by ``ndim`` both need each parameter in its own shape."""
    kernels = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    return optax.lars(
        0.1, weight_decay=1e-3, weight_decay_mask=kernels, trust_ratio_mask=kernels, momentum=0.9
    )


def stages_of(virtual: int, batch):
    modules = mlp_stages(virtual)
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:2])
    return pipeline_stages.flax_stages(modules), params, states


# Two data axes and one; 1F1B, interleaved and GPipe; permute schedules and XLA's own;
# optimizers reading a layer's norm, the model's norm, masks by shape, and elementwise ones.
CASES = [
    ("pipeline-2x2x2", "torus2d", None, "1f1b", 1, lars),
    pytest.param(
        "4x2",
        "ring",
        "native",
        "interleaved",
        2,
        lambda: optax.adamw(1e-2, weight_decay=0.1),
        marks=pytest.mark.slow,
    ),
    (
        "4x2",
        "native",
        None,
        "gpipe",
        1,
        lambda: optax.chain(global_norm.clip_by_global_norm(0.3), lars()),
    ),
]


@pytest.mark.parametrize("preset, allreduce, gather, schedule, chunks, optimizer", CASES)
def test_fsdp_inside_stages_equals_one_device(
    preset, allreduce, gather, schedule, chunks, optimizer
):
    mesh = meshes.build(preset) if preset.startswith("pipeline") else meshes.pipeline(4, 2)
    stages = mesh.shape["stage"]
    replicas = mesh.size // stages
    batch = data(n=96)
    fns, params, states = stages_of(stages * chunks, batch)
    # Few elements suffice to split: the small layers' kernels are split, biases kept whole.
    step = PipelineStep(
        fns,
        cross_entropy,
        optimizer(),
        mesh,
        microbatches=4,
        schedule=schedule,
        chunks=chunks,
        communication=Communication(allreduce, bucket_bytes=4096),
        sharding=StateSharding("fsdp", gather=gather, min_shard_elements=8),
        inputs=lambda b: b["x"],
    )
    state, metrics = run_pipeline(step, params, states, batch, steps=3)
    packing = step.packings["params"]
    assert "kept whole" in packing.describe() and not packing.describe().startswith("0 of")
    assert state.params.sharding.spec[2] is not None  # split by rows over the data axes
    want, _, want_loss = reference(fns, params, states, batch, optimizer(), 4 * replicas, 3)
    assert_trees_close(step.unstack(state)[0], want)
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-5)


def test_sharded_flat_packing_round_trips_every_stage_and_keeps_rows_apart():
    trees = [
        {"k": jnp.arange(24.0).reshape(2, 12), "b": jnp.arange(3.0)},
        {"k": jnp.arange(40.0).reshape(10, 4), "n": jnp.ones((), jnp.int32)},
    ]
    packing = ShardedFlatPacking(trees, shards=4, min_elements=4)
    for v, tree in enumerate(trees):
        flat = packing.flatten(tree)
        assert flat.shape == (packing.size,) and packing.size == 4 * packing.row_size
        back = packing.unflatten(v, flat)
        for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    # Row d holds a copy of the bias ("b" comes first in the tree) and the d-th slab of the
    # split kernel, along its columns (its 2 rows do not split 4 ways).
    rows = np.asarray(packing.flatten(trees[0])).reshape(4, -1)
    np.testing.assert_array_equal(rows[:, :3], np.tile(np.arange(3.0), (4, 1)))
    slab = np.moveaxis(np.asarray(trees[0]["k"])[:, 3:6], 1, 0).reshape(-1)
    np.testing.assert_array_equal(rows[1, 3:9], slab)


def test_each_device_keeps_its_share_of_its_stage_and_the_update_gathers_nothing():
    """Under FSDP a device's parameters and Adam moments are a quarter of its stage's, and the
    update runs on the shards: the compiled program gathers nothing but by the ring's permutes,
    and reduces no split parameter."""
    widths = (256,) * 7 + (10,)
    layers = [Dense(w, last=i == len(widths) - 1) for i, w in enumerate(widths)]
    modules = [pipeline_stages.Chain(g) for g in pipeline_stages.cut(layers, stages=2)]
    batch = {"x": jnp.ones((16, 256)), "label": jnp.zeros((16,), jnp.int32)}
    params, states = pipeline_stages.init_flax_stages(modules, jax.random.key(0), batch["x"][:1])
    arguments = {}
    for sharding in ("replicated", "fsdp"):
        step = PipelineStep(
            pipeline_stages.flax_stages(modules),
            cross_entropy,
            optax.adam(1e-3),
            meshes.pipeline(4, 2),
            microbatches=2,
            communication=Communication("ring"),
            sharding=StateSharding(sharding),
            inputs=lambda b: b["x"],
        )
        state = step.init(params, states)
        compiled = step.lower(state, step.shard_batch(batch), jax.random.key(0)).compile()
        arguments[sharding] = compiled.memory_analysis().argument_size_in_bytes
    largest = 3 * max(sum(x.size * 4 for x in jax.tree.leaves(p)) for p in params)
    assert largest <= arguments["replicated"] < largest + 16 * 1024
    # A quarter of the largest stage's, plus what stays whole (biases, the batch, the rng).
    assert largest / 4 <= arguments["fsdp"] < largest / 4 + 32 * 1024
    text = compiled.as_text()
    assert not re.search(r" (all-gather|reduce-scatter)(-start)?\(", text)
    # The all-reduces carry the loss, the metrics and the parameters kept whole (read from
    # one shard), never a split one.
    reduced = [
        line.split("=", 1)[1]
        for line in text.splitlines()
        if re.search(r" all-reduce(-start)?\(", line)
    ]
    assert reduced
    for line in reduced:
        types = line.split("all-reduce")[0]
        for dims in re.findall(r"\[([\d,]*)\]", types):
            assert np.prod([int(d) for d in dims.split(",") if d]) < 1024, line[:200]


def test_loss_scale_and_skipped_steps_see_every_shard():
    """A NaN in the last replica's batch reaches only its own gradients before the
    reduce-scatter; every shard skips the step (the loss scale drops), and the next one
    trains as the unpoisoned reference does."""
    batch = data(n=48)
    fns, params, states = stages_of(2, batch)
    optimizer = optax.sgd(0.1)
    step = PipelineStep(
        fns,
        cross_entropy,
        optimizer,
        meshes.pipeline(4, 2),
        microbatches=2,
        communication=Communication("ring"),
        sharding=StateSharding("fsdp", min_shard_elements=8),
        precision=Precision(loss_scale=DynamicLossScale.create(2.0**10), skip_nonfinite=True),
        inputs=lambda b: b["x"],
    )
    skipped = skips_poison_then_trains(step, fns, params, states, batch, optimizer, row=40)
    assert not bool(skipped["grads_finite"]) and float(skipped["loss_scale"]) == 2.0**10


def test_what_fsdp_inside_stages_cannot_honour_is_one_line():
    batch = data()
    fns, _, _ = stages_of(2, batch)
    sgd = optax.sgd(0.1)
    mesh = meshes.pipeline(4, 2)
    cases = [
        ({"sharding": "zero1"}, mesh, "choose sharding='fsdp'"),
        (
            {"sharding": "fsdp", "schedule": "pipedream"},
            mesh,
            "schedule='pipedream' updates .* between micro-batches",
        ),
        ({"sharding": "fsdp", "schedule": "pipedream_2bw"}, mesh, "choose gpipe, 1f1b or"),
        ({"gather": "native"}, mesh, "sharding='replicated' keeps each stage's parameters whole"),
        ({"sharding": "fsdp"}, stage_mesh(2), "the mesh has none beside 'stage'"),
        ({"sharding": "fsdp", "allreduce": "none"}, mesh, "allreduce='none' names none"),
        ({"sharding": "fsdp", "prefetch": 2}, mesh, "a pipeline stage gathers its parameters"),
        ({"sharding": "fsdp", "keep_gathered": True}, mesh, "leave keep_gathered out"),
        ({"sharding": "fsdp", "shard_axes": "x"}, mesh, "over all of its data axes; leave"),
        ({"allreduce": "ring", "wait_free": True}, mesh, "gradients already travel while"),
    ]
    for options, on, message in cases:
        with pytest.raises(ValueError, match=message) as caught:
            PipelineStep(fns, cross_entropy, sgd, on, microbatches=2, **records(**options))
        assert "\n" not in str(caught.value)
