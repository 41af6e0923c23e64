"""Data-parallel train steps against plain single-device training."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist import meshes
from jaxdist.comm import buckets, collectives
from jaxdist.training import eval_step, step_checks
from jaxdist.training import train_step as ts
from jaxdist.training.batchnorm import CrossReplicaBatchNorm
from jaxdist.training.classifier_loss import classifier_loss
from jaxdist.training.loss_scale import DynamicLossScale
from jaxdist.training.step_options import Communication, Precision, StateSharding
from tests._procs import REPO
from tests._step_options import records

NUM_CLASSES = 4
STEPS = 3


class Net(nn.Module):
    """Dense -> (cross-replica) BatchNorm -> relu -> Dense -> relu -> Dense."""

    norm_axis: object = None
    group_size: int | None = None
    use_norm: bool = True

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(16)(x)
        if self.use_norm:
            x = CrossReplicaBatchNorm(
                use_running_average=not train, axis_name=self.norm_axis, group_size=self.group_size
            )(x)
        x = nn.relu(x)
        x = nn.relu(nn.Dense(12)(x))
        return nn.Dense(NUM_CLASSES)(x)


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "image": rng.standard_normal((n, 10)).astype(np.float32),
        "label": rng.integers(0, NUM_CLASSES, n).astype(np.int32),
    }


def init_variables(use_norm=True):
    variables = Net(use_norm=use_norm).init(
        jax.random.key(0), np.zeros((2, 10), np.float32), train=False
    )
    return variables["params"], {k: v for k, v in variables.items() if k != "params"}


def reference_training(optimizer, batches, use_norm=True):
    """Plain single-device training on the full batch: the result every variant must match."""
    params, model_state = init_variables(use_norm)
    model = Net(use_norm=use_norm)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, model_state, opt_state, batch):
        def loss(params):
            logits, new_state = model.apply(
                {"params": params, **model_state},
                batch["image"],
                train=True,
                mutable=list(model_state),
            )
            targets = jax.nn.one_hot(batch["label"], NUM_CLASSES)
            return optax.softmax_cross_entropy(logits, targets).mean(), new_state

        grads, new_state = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state, opt_state

    for batch in batches:
        params, model_state, opt_state = step(params, model_state, opt_state, batch)
    return params, model_state


def distributed_training(mesh, axes, optimizer, batches, use_norm=True, group_size=None, **options):
    params, model_state = init_variables(use_norm)
    model = Net(norm_axis=axes, group_size=group_size, use_norm=use_norm)
    loss = classifier_loss(model, num_classes=NUM_CLASSES)
    step = ts.TrainStep(loss, optimizer, mesh, **records(**options))
    state = step.init(params, model_state)
    for batch in batches:
        state, metrics = step(state, step.shard_batch(batch), jax.random.key(1))
    return state, metrics, step


def poisoned_loss(value):
    """The classifier loss of the net without BatchNorm, times ``value`` (NaN, inf) on a batch
    whose ``poison`` flag is set."""
    inner = classifier_loss(Net(use_norm=False), num_classes=NUM_CLASSES)

    def loss_fn(params, model_state, batch, rng):
        loss, aux = inner(params, model_state, batch, rng)
        return loss * jnp.where(batch["poison"][0], value, 1.0), aux

    return loss_fn


def assert_trees_close(actual, expected, atol):
    for path, a, e in zip(
        jax.tree_util.tree_flatten_with_path(actual)[0],
        jax.tree.leaves(actual),
        jax.tree.leaves(expected),
    ):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(e), rtol=0, atol=atol, err_msg=str(path[0])
        )


MESHES = {
    "ring-8": (lambda: meshes.ring(8), "x"),
    "torus-4x2": (lambda: meshes.torus2d(4, 2), ("y", "x")),
    "hierarchical-2x4": (lambda: meshes.hierarchical(2, 4), ("host", "local")),
    "torus-2x2x2": (lambda: meshes.torus3d(2, 2, 2), ("z", "y", "x")),
}


@pytest.fixture(scope="module")
def reference():
    batches = [data(seed=s) for s in range(STEPS)]
    return batches, reference_training(optax.sgd(0.1, momentum=0.9), batches)


@pytest.mark.parametrize("algorithm", collectives.ALGORITHMS)
@pytest.mark.parametrize("bucket_bytes", [None, 512])
def test_every_allreduce_matches_single_device_training(reference, algorithm, bucket_bytes):
    batches, (params, model_state) = reference
    mesh_name = "torus-4x2" if algorithm in collectives.TWO_LEVEL else "ring-8"
    if algorithm in collectives.THREE_LEVEL:
        mesh_name = "torus-2x2x2"
    make_mesh, axes = MESHES[mesh_name]
    state, metrics, step = distributed_training(
        make_mesh(),
        axes,
        optax.sgd(0.1, momentum=0.9),
        batches,
        allreduce=algorithm,
        bucket_bytes=bucket_bytes,
    )
    assert_trees_close(state.params, params, atol=2e-6)
    assert_trees_close(state.model_state, model_state, atol=2e-6)
    assert int(state.step) == STEPS and np.isfinite(float(metrics["loss"]))
    expected_buckets = 1 if bucket_bytes is None else 2
    assert len(step.buckets) >= expected_buckets


@pytest.mark.parametrize(
    ("algorithm", "mesh_name", "accumulation_steps"),
    [
        ("ring", "ring-8", 1),
        pytest.param("bidirectional_ring", "ring-8", 1, marks=pytest.mark.slow),
        ("torus2d", "torus-4x2", 1),
        ("hierarchical", "hierarchical-2x4", 1),
        pytest.param("torus2d", "torus-4x2", 2, marks=pytest.mark.slow),
        pytest.param("torus3d", "torus-2x2x2", 1, marks=pytest.mark.slow),
    ],
)
def test_wait_free_steps_are_the_serial_steps_bit_for_bit(
    reference, algorithm, mesh_name, accumulation_steps
):
    # The same schedules on the same gradients, only their order tied to backward's: the
    # model (cross-replica BatchNorm, whose statistics travel during backward too) trains to
    # the very same bits; with accumulation, beside the last micro-batch's backward.
    batches, (params, model_state) = reference
    make_mesh, axes = MESHES[mesh_name]
    trained = {}
    for wait_free in (False, True):
        state, metrics, step = distributed_training(
            make_mesh(),
            axes,
            optax.sgd(0.1, momentum=0.9),
            batches,
            allreduce=algorithm,
            bucket_bytes=512,
            wait_free=wait_free,
            accumulation_steps=accumulation_steps,
        )
        trained[wait_free] = (state, metrics)
    assert len(step.buckets) >= 2
    (paced, paced_metrics), (serial, serial_metrics) = trained[True], trained[False]
    assert_trees_close(paced.params, serial.params, atol=0)
    assert_trees_close(paced.model_state, serial.model_state, atol=0)
    assert_trees_close(paced_metrics, serial_metrics, atol=0)
    if accumulation_steps == 1:  # micro-batches change BatchNorm's statistics
        assert_trees_close(paced.params, params, atol=2e-6)
        assert_trees_close(paced.model_state, model_state, atol=2e-6)
    assert float(paced_metrics["loss"]) > 0


def test_wait_free_refuses_what_it_cannot_pace():
    mesh = meshes.ring(8)
    loss = classifier_loss(Net(), num_classes=NUM_CLASSES)
    with pytest.raises(ValueError, match="allreduce='native' has none"):
        ts.TrainStep(loss, optax.sgd(0.1), mesh, communication=Communication(wait_free=True))
    for options, what in [
        ({"sharding": "zero1"}, "sharding='zero1'"),
        ({"sfb_layers": "all"}, "sfb_layers"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"does not combine with {what}")):
            ts.TrainStep(
                loss, optax.sgd(0.1), mesh, **records(allreduce="ring", wait_free=True, **options)
            )


@pytest.mark.parametrize("mesh_name", ["hierarchical-2x4"])
def test_hierarchical_mesh(reference, mesh_name):
    batches, (params, _) = reference
    make_mesh, axes = MESHES[mesh_name]
    state, _, _ = distributed_training(
        make_mesh(), axes, optax.sgd(0.1, momentum=0.9), batches, allreduce="hierarchical"
    )
    assert_trees_close(state.params, params, atol=2e-6)


@pytest.mark.parametrize("algorithm", ["native", "ring", "torus2d"])
def test_gradient_accumulation_matches_the_full_batch(algorithm):
    # Without BatchNorm, micro-batches do not change the maths, only the memory.
    batches = [data(seed=s) for s in range(STEPS)]
    params, _ = reference_training(optax.sgd(0.1, momentum=0.9), batches, use_norm=False)
    make_mesh, axes = MESHES["torus-4x2"]
    state, _, _ = distributed_training(
        make_mesh(),
        axes,
        optax.sgd(0.1, momentum=0.9),
        batches,
        use_norm=False,
        allreduce=algorithm,
        accumulation_steps=4,
        bucket_bytes=512,
    )
    assert_trees_close(state.params, params, atol=2e-6)


# Adam runs without BatchNorm: a bias feeding a BatchNorm has an exactly-zero gradient, which
# Adam's g / sqrt(v) turns into rounding noise of size lr, on one device as on eight.
SGD_WITH_NORM = (optax.sgd(0.1, momentum=0.9), True)
ADAM_WITHOUT_NORM = (optax.adam(1e-2), False)


# Each sharding on both meshes, each optimizer under each sharding: four programs, not eight.
@pytest.mark.parametrize(
    ("sharding", "mesh_name", "optimizer", "use_norm"),
    [
        ("zero1", "ring-8", *SGD_WITH_NORM),
        ("zero1", "torus-4x2", *ADAM_WITHOUT_NORM),
        ("fsdp", "ring-8", *ADAM_WITHOUT_NORM),
        ("fsdp", "torus-4x2", *SGD_WITH_NORM),
    ],
)
def test_sharded_steps_match_single_device_training(sharding, mesh_name, optimizer, use_norm):
    batches = [data(seed=s) for s in range(STEPS)]
    params, model_state = reference_training(optimizer, batches, use_norm=use_norm)
    make_mesh, axes = MESHES[mesh_name]
    algorithm = "torus2d" if mesh_name.startswith("torus") else "ring"
    state, _, step = distributed_training(
        make_mesh(),
        axes,
        optimizer,
        batches,
        use_norm=use_norm,
        sharding=sharding,
        allreduce=algorithm,
        min_shard_elements=0,
        bucket_bytes=512,
    )
    assert_trees_close(state.params, params, atol=3e-6)
    assert_trees_close(state.model_state, model_state, atol=2e-6)
    # Split where a dimension divides by 8, whole where none does; in units of <= 512 bytes.
    placement = step.placement
    expected_whole = ["Dense_1.bias", "Dense_2.bias", "Dense_2.kernel"]  # 12, 4 and 12x4
    assert placement.replicated() == expected_whole
    assert len(placement.units) > 1
    # The optimizer state is really sharded (and FSDP's parameters): 1/8 of a kernel each.
    kernel = state.params["Dense_0"]["kernel"]
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.shape == kernel.shape]
    assert moments and all(m.addressable_shards[0].data.shape == (10, 2) for m in moments)
    own = kernel.addressable_shards[0].data.shape
    assert own == ((10, 2) if sharding == "fsdp" else (10, 16))


def test_compiles_once_per_batch_shape():
    make_mesh, axes = MESHES["ring-8"]
    params, model_state = init_variables()
    model = Net(norm_axis=axes)
    step = ts.TrainStep(
        classifier_loss(model, num_classes=NUM_CLASSES), optax.sgd(0.1), make_mesh()
    )
    state = step.init(params, model_state)
    for seed in range(4):
        state, _ = step(state, step.shard_batch(data(seed=seed)), jax.random.key(seed))
    assert step.trace_count == 1
    state, _ = step(state, step.shard_batch(data(n=128)), jax.random.key(0))
    assert step.trace_count == 2


def test_donation_default_and_explicit_donation():
    make_mesh, axes = MESHES["ring-8"]
    params, model_state = init_variables()
    loss_fn = classifier_loss(Net(norm_axis=axes), num_classes=NUM_CLASSES)
    mesh = make_mesh()
    assert not step_checks.donation_default(mesh), (
        "CPU devices: donation costs time and saves nothing"
    )
    results = {}
    for donate in (None, True):
        step = ts.TrainStep(loss_fn, optax.sgd(0.1, momentum=0.9), mesh, donate=donate)
        state = step.init(params, model_state)
        new_state, _ = step(state, step.shard_batch(data()), jax.random.key(0))
        donated = all(leaf.is_deleted() for leaf in jax.tree.leaves(state.params))
        assert donated == bool(donate), f"donate={donate}: input deleted={donated}"
        results[donate] = jax.device_get(new_state.params)
    assert_trees_close(results[True], results[None], atol=0)


def test_float16_loss_scaling_skips_inf_steps_and_converges():
    make_mesh, _axes = MESHES["ring-8"]
    mesh = make_mesh()
    params, model_state = init_variables(use_norm=False)
    model = Net(use_norm=False)
    inner = classifier_loss(model, num_classes=NUM_CLASSES)

    def loss_fn(params, model_state, batch, rng):
        half = jax.tree.map(lambda p: p.astype(jnp.float16), params)  # float16 compute
        loss, aux = inner(
            half, model_state, {**batch, "image": batch["image"].astype(jnp.float16)}, rng
        )
        # An injected overflow: a batch flagged "poison" makes every gradient inf.
        return loss.astype(jnp.float32) * jnp.where(batch["poison"][0], jnp.inf, 1.0), aux

    scale = DynamicLossScale.create(initial_scale=2.0**10, period=3)
    step = ts.TrainStep(
        loss_fn,
        optax.sgd(0.3, momentum=0.9),
        mesh,
        communication=Communication("ring"),
        precision=Precision(loss_scale=scale),
    )
    state = step.init(params, model_state)
    batch = data()

    def run(state, poison):
        flagged = {**batch, "poison": np.full((64,), poison)}
        return step(state, step.shard_batch(flagged), jax.random.key(0))

    state, metrics = run(state, poison=False)
    before = jax.device_get(state.params)  # a copy: on accelerators the step donates its input
    state, metrics = run(state, poison=True)
    assert not bool(metrics["grads_finite"])
    assert float(state.loss_scale.scale) == 2.0**9, "an overflow halves the scale"
    assert_trees_close(state.params, before, atol=0)
    assert int(state.step) == 2
    losses = []
    for _ in range(12):
        state, metrics = run(state, poison=False)
        losses.append(float(metrics["loss"]))
    assert float(state.loss_scale.scale) == 2.0**10 * 2**3, "3 good periods of 3 steps regrow it"
    assert losses[-1] < 0.8 * losses[0], f"float16 training did not converge: {losses}"


@pytest.mark.parametrize("zero1", [False, True])
def test_skip_nonfinite_leaves_the_state_and_reports_the_step(zero1):
    """A poisoned batch (NaN loss and gradients) changes nothing but the step count and is
    reported as skipped; the next good batch trains as if it had never come."""
    mesh = MESHES["ring-8"][0]()
    params, model_state = init_variables(use_norm=False)
    step = ts.TrainStep(
        poisoned_loss(jnp.nan),
        optax.sgd(0.3, momentum=0.9),
        mesh,
        communication=Communication("ring"),
        sharding=StateSharding("zero1" if zero1 else "replicated"),
        precision=Precision(skip_nonfinite=True),
    )
    batch = data()

    def run(state, poison):
        flagged = {**batch, "poison": np.full((64,), poison)}
        return step(state, step.shard_batch(flagged), jax.random.key(0))

    state = step.init(params, model_state)
    before = jax.device_get((state.params, state.opt_state))
    state, metrics = run(state, poison=True)
    assert bool(metrics["skipped"]) and int(state.step) == 1
    assert_trees_close(jax.device_get((state.params, state.opt_state)), before, atol=0)
    state, metrics = run(state, poison=False)
    assert not bool(metrics["skipped"])
    unpoisoned = step.init(params, model_state)
    unpoisoned, _ = run(unpoisoned, poison=False)
    assert_trees_close(state.params, unpoisoned.params, atol=0)


def test_bf16_transfer_stays_close_to_float32(reference):
    batches, (params, _) = reference
    make_mesh, axes = MESHES["torus-4x2"]
    state, _, _ = distributed_training(
        make_mesh(),
        axes,
        optax.sgd(0.1, momentum=0.9),
        batches,
        allreduce="torus2d",
        allreduce_options={"transfer_dtype": jnp.bfloat16},
    )
    # bf16 messages round gradients to 8 bits; three steps move weights by ~1e-3 at most.
    assert_trees_close(state.params, params, atol=2e-3)


def test_zero1_with_bf16_transfer_keeps_float32_parameters(reference):
    batches, (params, _) = reference
    make_mesh, axes = MESHES["ring-8"]
    state, _, _ = distributed_training(
        make_mesh(),
        axes,
        optax.sgd(0.1, momentum=0.9),
        batches,
        sharding="zero1",
        allreduce_options={"transfer_dtype": jnp.bfloat16},
    )
    assert_trees_close(state.params, params, atol=2e-3)
    # Gradients travel in bf16, parameters do not: the master copy keeps its float32 bits.
    flat = np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(state.params)])
    as_bf16 = np.asarray(jnp.asarray(flat).astype(jnp.bfloat16).astype(jnp.float32))
    assert np.mean(flat != as_bf16) > 0.5, "parameters were rounded to bf16"


def test_batchnorm_groups_and_consistent_running_statistics():
    make_mesh, axes = MESHES["ring-8"]
    batches = [data()]  # one step: both runs start from the same weights
    state, _, _ = distributed_training(make_mesh(), axes, optax.sgd(0.1), batches, group_size=2)
    whole, _, _ = distributed_training(make_mesh(), axes, optax.sgd(0.1), batches)
    stats = state.model_state["batch_stats"]["CrossReplicaBatchNorm_0"]["mean"]
    whole_stats = whole.model_state["batch_stats"]["CrossReplicaBatchNorm_0"]["mean"]
    shards = [np.asarray(s.data) for s in stats.addressable_shards]
    for shard in shards[1:]:
        np.testing.assert_array_equal(shard, shards[0])  # every device holds the same statistics
    # Running means are linear in the batch means, so groups average to the whole-axis value.
    np.testing.assert_allclose(np.asarray(stats), np.asarray(whole_stats), atol=1e-6)
    assert not np.allclose(
        np.asarray(state.params["Dense_0"]["kernel"]), np.asarray(whole.params["Dense_0"]["kernel"])
    ), "group statistics normalise differently, so the weights must differ"


def test_eval_step_counts_like_a_single_device():
    make_mesh, axes = MESHES["torus-4x2"]
    mesh = make_mesh()
    params, model_state = init_variables()
    step = ts.TrainStep(
        classifier_loss(Net(norm_axis=axes), num_classes=NUM_CLASSES), optax.sgd(0.1), mesh
    )
    state = step.init(params, model_state)
    state, _ = step(state, step.shard_batch(data()), jax.random.key(0))
    batch = data(seed=7)
    batch["mask"] = np.arange(64) < 60  # the last 4 examples are padding
    totals = eval_step.EvalStep(eval_step.classifier_eval(Net(norm_axis=axes)), mesh)(
        state, step.shard_batch(batch)
    )
    logits = Net().apply(
        {"params": jax.device_get(state.params), **jax.device_get(state.model_state)},
        batch["image"],
        train=False,
    )
    hits = (np.argmax(logits, -1) == batch["label"])[:60]
    assert float(totals["count"]) == 60
    assert float(totals["top1"]) == hits.sum()
    assert float(totals["top5"]) == 60  # 4 classes: the true one is always in the top 5


def test_bucket_planning_follows_backward_order():
    params, _model_state = init_variables(use_norm=False)
    model = Net(use_norm=False)

    def loss(p, x):
        return model.apply({"params": p}, x).sum()

    order = buckets.backward_order(loss, params, np.zeros((2, 10), np.float32))
    names = [
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    ordered = [names[k] for k in order]
    assert [n.split("'")[1] for n in ordered[::2]] == ["Dense_2", "Dense_1", "Dense_0"]
    sizes = buckets.leaf_bytes(params)
    plan = buckets.plan_buckets(sizes, order, bucket_bytes=1)
    assert plan == [[k] for k in order]
    assert buckets.plan_buckets(sizes, order, None) == [order]
    with pytest.raises(ValueError, match="permutation"):
        buckets.plan_buckets(sizes, [0, 0], 10)


def test_clear_errors():
    mesh = meshes.ring(8)
    loss = classifier_loss(Net(), num_classes=NUM_CLASSES)
    with pytest.raises(ValueError, match="unknown allreduce 'rign'"):
        ts.TrainStep(loss, optax.sgd(0.1), mesh, communication=Communication("rign"))
    with pytest.raises(ValueError, match=r"data axes \['data'\] are not axes of the mesh"):
        ts.TrainStep(loss, optax.sgd(0.1), mesh, data_axes="data")
    with pytest.raises(ValueError, match="needs two data axes"):
        ts.TrainStep(loss, optax.sgd(0.1), mesh, communication=Communication("torus2d"))
    step = ts.TrainStep(loss, optax.sgd(0.1), mesh)
    with pytest.raises(ValueError, match="must divide evenly over the 8 local"):
        step.shard_batch(data(n=12))


@pytest.mark.slow  # two ResNet-18 compiles read instruction by instruction: about 40 s
def test_buckets_let_xla_schedule_gradient_collectives_inside_backward():
    from jaxdist.bench import train_step as bench_train

    mesh = meshes.torus2d(4, 2)
    small = dict(width=4, per_device_batch=2, image_size=8)
    one, n_one = bench_train.compiled_step_hlo(mesh, "ring", bucket_bytes=0, **small)
    many, n_many = bench_train.compiled_step_hlo(mesh, "ring", bucket_bytes=2048, **small)
    one, many = bench_train.schedule_summary(one), bench_train.schedule_summary(many)
    assert n_one == 1 and n_many > 3
    assert one["collective_permutes"] == 14 and many["collective_permutes"] == 14 * n_many
    # One bucket needs every gradient: it can only start after the last backward convolution.
    assert one["convolutions_after_first_permute"] == 0
    # With buckets in backward order the first one is scheduled while backward still runs.
    assert many["convolutions_after_first_permute"] > 0
    # docs/train_step.md states these figures; they must be what the code compiles to.
    documented = _schedule_table((REPO / "docs" / "train_step.md").read_text())
    keys = (
        "instructions",
        "convolutions",
        "collective_permutes",
        "convolutions_after_first_permute",
    )
    found = [[n_one, *(one[k] for k in keys)], [n_many, *(many[k] for k in keys)]]
    assert documented == found, (
        f"docs/train_step.md's schedule table says {documented}, the compiled steps give {found}: "
        "rerun the command above the table and update it"
    )


def _schedule_table(text: str) -> list[list[int]]:
    """The rows of the doc's "buckets | instructions | ..." table, as integers."""
    rows = re.findall(r"^\| (\d+) \(`--bucket-mb[^|]*\|" + r" (\d+) \|" * 4 + "$", text, re.M)
    return [[int(cell) for cell in row] for row in rows]


def test_bfloat16_compute_with_float32_master_weights_trains():
    class HalfNet(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            x = nn.relu(nn.Dense(16, dtype=jnp.bfloat16)(x))
            return nn.Dense(NUM_CLASSES, dtype=jnp.bfloat16)(x)

    mesh = meshes.ring(8)
    params = HalfNet().init(jax.random.key(0), np.zeros((2, 10), np.float32))["params"]
    step = ts.TrainStep(
        classifier_loss(HalfNet(), num_classes=NUM_CLASSES),
        optax.sgd(0.3, 0.9),
        mesh,
        communication=Communication("ring", options={"transfer_dtype": jnp.bfloat16}),
    )
    state = step.init(params)
    batch = step.shard_batch(data())
    losses = []
    for _ in range(10):
        state, metrics = step(state, batch, jax.random.key(0))
        losses.append(float(metrics["loss"]))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state.params))
    assert losses[-1] < 0.8 * losses[0], f"bf16 training did not converge: {losses}"


def test_zero1_passes_the_exchange_piece_option_to_its_building_blocks(reference):
    # A bad value must reach ZeRO-1's reduce-scatter and all-gather and be refused there.
    batches, _ = reference
    make_mesh, axes = MESHES["ring-8"]
    with pytest.raises(ValueError, match="exchange_piece_bytes must be a positive"):
        distributed_training(
            make_mesh(),
            axes,
            optax.sgd(0.1),
            batches[:1],
            sharding="zero1",
            allreduce_options={"exchange_piece_bytes": -1},
        )


def test_option_records_are_frozen_so_one_serves_several_steps():
    mesh = meshes.ring(8)
    loss = classifier_loss(Net(), num_classes=NUM_CLASSES)
    shared = Communication("ring", options={"unroll_limit": 4})
    with pytest.raises(TypeError):
        shared.options["unroll_limit"] = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        shared.allreduce = "native"
    one = ts.TrainStep(loss, optax.sgd(0.1), mesh, communication=shared)
    other = ts.TrainStep(
        loss, optax.sgd(0.1), mesh, communication=dataclasses.replace(shared, bucket_bytes=0)
    )
    assert one.communication.bucket_bytes == buckets.DEFAULT_BUCKET_BYTES
    assert other.communication.bucket_bytes == 0
    assert dict(other.communication.options) == {"unroll_limit": 4}
    # Defaults are instances too, shared by every step that takes them.
    assert ts.TrainStep(loss, optax.sgd(0.1), mesh).communication.allreduce == "native"
