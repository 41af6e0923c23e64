"""Tensor parallelism: the summed product's two schedules, Megatron's column- and
row-parallel products, the vocabulary split (embedding, logits and loss), the transformer
split over a ``tensor`` axis by logical axis rules (alone, beside data parallelism, FSDP and
HSDP, with scanned layers, its vocabulary split or whole) against its replicated run, the
memory a tensor axis saves, rules that place the state over ``fsdp``, and the
one-line refusals of meshes and rules that cannot hold."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist import meshes
from jaxdist.comm import tensor_parallel as tp
from jaxdist.comm import vocab_parallel
from jaxdist.comm.collective_matmul import TENSOR_SCHEDULES, summed_product
from jaxdist.run.from_config import StepParts
from jaxdist.run.step_kinds import DataParallel
from jaxdist.tasks import Replicas
from jaxdist.tasks.language_model import LanguageModel
from jaxdist.training import logical_axes
from jaxdist.training.sharding import Placement
from jaxdist.training.step_options import Communication, Precision, StateSharding
from jaxdist.training.train_step import TrainStep
from tests._step_options import records
from tests.test_tasks import corpus_root, lm_config  # noqa: F401  (the fixture)


def _grid(shape, names):
    return Mesh(np.array(jax.devices()[: math.prod(shape)]).reshape(shape), names)


@pytest.mark.parametrize("schedule", TENSOR_SCHEDULES)
def test_a_summed_product_and_its_column_row_pair_are_the_unsplit_products(schedule):
    """Over 4 tensor devices (and 2 data replicas): 10 rows (no multiple of the 8 half
    chunks) summed like the whole product, and an MLP's input and weight gradients through
    a column- then row-parallel pair like the unsplit MLP's."""
    mesh = _grid((2, 4), ("data", "tensor"))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((10, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 6)), jnp.float32)
    summed = jax.jit(
        jax.shard_map(
            lambda a, b: summed_product(a, b, "tensor", schedule),
            mesh=mesh,
            in_specs=(P(None, "tensor"), P("tensor")),
            out_specs=P(),
            check_vma=False,
        )
    )
    np.testing.assert_allclose(summed(x, w), x @ w, rtol=1e-6, atol=1e-5)

    w1 = jnp.asarray(rng.standard_normal((16, 32)) / 4, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((32, 16)) / 4, jnp.float32)

    def loss(x, w1, w2):
        (h,) = tp.column_product(x, [w1])
        return jnp.sum(jnp.sin(tp.row_product(jnp.tanh(h), w2)))

    def split(x, w1, w2):
        with tp.splitting("tensor", schedule):
            return jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)

    specs = (P(), P(None, "tensor"), P("tensor"))
    grads = jax.jit(
        jax.shard_map(split, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
    )(x, w1, w2)
    for got, want in zip(grads, jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the transformer

SHAPE = {
    "model.num_layers": 2,
    "model.d_model": 32,
    "model.num_heads": 8,
    "model.num_kv_heads": 4,
    "model.mlp": "swiglu",
    "model.mlp_dim": 64,
}
STEPS = 2


def _task(corpus_root, **overrides):  # noqa: F811
    return LanguageModel(lm_config(corpus_root, **SHAPE, **overrides), Replicas("data", 1))


def _adamw():
    return optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(3e-3, weight_decay=0.01))


VOCABULARY_RULES = (("vocab", "tensor"), *logical_axes.DEFAULT_RULES)


def _train(
    task,
    mesh,
    data_axes,
    schedule=None,
    sequence=False,
    vocabulary=False,
    optimizer=None,
    **options,
):
    tensor = None
    if schedule is not None:
        axes = task.logical_axes()
        shapes, _ = jax.eval_shape(task.init_variables, jax.random.key(0))
        rules = VOCABULARY_RULES if vocabulary else logical_axes.DEFAULT_RULES
        dims = logical_axes.split_dims(axes.names, rules, "tensor", shapes, mesh.shape["tensor"])
        tensor = tp.TensorParallel(
            dims, schedule=schedule, sequence=sequence, vocabulary=axes.splits_vocabulary(rules)
        )
    step = TrainStep(
        task.loss,
        optimizer or _adamw(),
        mesh,
        data_axes=data_axes,
        **records(allreduce="native", **options),
        stacked_layers=task.stacked_layers(),
        tensor=tensor,
    )
    state = step.init(*task.init_variables(jax.random.key(0)))
    it = task.data.train_iterator(16)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, step.shard_batch(next(it)), jax.random.key(1))
        losses.append(float(metrics["loss"]))
    it.close()
    return step, state, losses


@pytest.fixture(scope="module")
def replicated(corpus_root):  # noqa: F811
    """The unrolled and the scanned model, each trained on one data axis of 4."""
    runs = {}
    for scan in (False, True):
        task = _task(corpus_root, **{"model.scan_layers": scan})
        runs[scan] = _train(task, _grid((4,), ("data",)), "data")
    return runs


CASES = [
    # mesh, data axes, schedule, scanned, options
    ((("data", 2), ("tensor", 4)), "data", "native", False, {}),
    pytest.param(
        (("data", 2), ("tensor", 4)),
        "data",
        "collective_matmul",
        False,
        {"accumulation_steps": 2},
        marks=pytest.mark.slow,
    ),
    (
        (("data", 2), ("fsdp", 2), ("tensor", 2)),
        ("data", "fsdp"),
        "collective_matmul",
        False,
        {"sharding": "fsdp", "shard_axes": "fsdp"},
    ),
    ((("fsdp", 4), ("tensor", 2)), "fsdp", "native", True, {"sharding": "fsdp"}),
    pytest.param(
        (("fsdp", 4), ("tensor", 2)),
        "fsdp",
        "collective_matmul",
        True,
        {"sharding": "zero1"},
        marks=pytest.mark.slow,
    ),
    pytest.param(
        (("data", 2), ("fsdp", 2), ("tensor", 2)),
        ("data", "fsdp"),
        "native",
        False,
        {"sharding": "fsdp", "shard_axes": "fsdp"},
        marks=pytest.mark.slow,
    ),
    # Sequence parallelism: norms and residual stream split along the positions.
    ((("data", 2), ("tensor", 4)), "data", "collective_matmul", False, {"sequence": True}),
    # The vocabulary split too: the embedding's rows, the head's columns and the loss.
    pytest.param(
        (("data", 2), ("tensor", 4)),
        "data",
        "native",
        False,
        {"vocabulary": True},
        marks=pytest.mark.slow,
    ),
    (
        (("fsdp", 4), ("tensor", 2)),
        "fsdp",
        "collective_matmul",
        True,
        {"vocabulary": True, "sequence": True, "sharding": "fsdp"},
    ),
    pytest.param(
        (("fsdp", 4), ("tensor", 2)),
        "fsdp",
        "native",
        True,
        {"sequence": True, "sharding": "fsdp"},
        marks=pytest.mark.slow,
    ),
]


def _assert_params_close(params, expected):
    """Every parameter but the keys' bias, whose gradient is zero in exact arithmetic (it
    adds the same amount to each of a query's scores, which the softmax ignores), so that
    Adam's update of it is rounding noise scaled to the learning rate."""
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), want in zip(got, jax.tree.leaves(expected), strict=True):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        if not name.endswith("key.bias"):
            np.testing.assert_allclose(
                np.asarray(leaf), np.asarray(want), rtol=1e-4, atol=1e-5, err_msg=name
            )


@pytest.mark.parametrize(("axes", "data_axes", "schedule", "scanned", "options"), CASES)
def test_a_tensor_split_transformer_trains_as_its_replicated_run(
    corpus_root,  # noqa: F811
    replicated,
    axes,
    data_axes,
    schedule,
    scanned,
    options,
):
    """Adam with global-norm clipping, two steps: the losses and parameters of the model
    split over the tensor axis (heads, key-value heads and MLP units, and the vocabulary
    where asked) are those of the replicated run, whatever the data, FSDP or HSDP axes
    beside it."""
    names, sizes = zip(*axes)
    task = _task(corpus_root, **{"model.scan_layers": scanned})
    _, state, losses = _train(task, _grid(sizes, names), data_axes, schedule, **options)
    _, expected, expected_losses = replicated[scanned]
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-4)
    _assert_params_close(state.params, expected.params)
    blocks = state.params["blocks"]
    mlp = blocks["up"]["kernel"] if scanned else blocks[0]["up"]["kernel"]
    split_dim = mlp.ndim - 1  # the MLP's units
    assert mlp.sharding.spec[split_dim] in ("tensor", ("tensor", "fsdp"))
    table = state.params["token_embed"]["embedding"]  # [vocab, embed]
    split = bool(table.sharding.spec) and table.sharding.spec[0] in ("tensor", ("tensor", "fsdp"))
    assert split == options.get("vocabulary", False)


@pytest.mark.slow  # the default run trains a tied split through the trainer on 2 processes
def test_a_tied_vocabulary_split_over_tensor_trains_as_its_replicated_run(
    corpus_root,  # noqa: F811
):
    """The head tied to the token embedding, the vocabulary split over 4 tensor devices
    with the positions and the collective matmul: the table's rows looked up and scored
    on the device that holds them, its two gradients added there. Momentum SGD with
    global-norm clipping, whose update follows the gradient's rounding linearly (Adam's
    divides it by its own size, which a gradient near zero turns into noise)."""
    task = _task(corpus_root, **{"model.tie_embeddings": True})
    optimizer = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5, momentum=0.9))
    _, expected, expected_losses = _train(task, _grid((4,), ("data",)), "data", optimizer=optimizer)
    _, state, losses = _train(
        task,
        _grid((2, 4), ("data", "tensor")),
        "data",
        "collective_matmul",
        sequence=True,
        vocabulary=True,
        optimizer=optimizer,
    )
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-4)
    _assert_params_close(state.params, expected.params)
    assert "head" not in state.params
    assert state.params["token_embed"]["embedding"].sharding.spec == P("tensor")


@pytest.mark.parametrize("rules", [logical_axes.DEFAULT_RULES, VOCABULARY_RULES])
def test_a_tensor_axis_divides_the_state_a_device_holds(corpus_root, rules):  # noqa: F811
    """Parameters and Adam's moments per device, under FSDP over 2 and tensor over 2 (every
    leaf split where its shape allows): what the rules split over tensor held a quarter on
    each device, the rest (norms, the output biases, and the embeddings unless the
    vocabulary is split) a half."""
    task = _task(corpus_root)
    params, model_state = task.init_variables(jax.random.key(0))
    names = task.logical_axes().names
    dims = logical_axes.split_dims(names, rules, "tensor", params, 2)
    mesh = _grid((2, 2), ("fsdp", "tensor"))
    step = TrainStep(
        task.loss,
        optax.adamw(1e-3),
        mesh,
        data_axes="fsdp",
        sharding=StateSharding("fsdp", min_shard_elements=1),
        tensor=tp.TensorParallel(dims, vocabulary=task.logical_axes().splits_vocabulary(rules)),
    )
    state = step.init(params, model_state)

    def per_device(tree):
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))

    over_tensor = {name for name, axis in rules if axis == "tensor"}

    def tensor_parallel(leaf_names):
        return bool(set(leaf_names) & over_tensor)

    split = jax.tree.leaves(
        jax.tree.map(
            lambda n, leaf: leaf.nbytes if tensor_parallel(n) else 0,
            names,
            params,
            is_leaf=lambda x: isinstance(x, tuple),
        )
    )
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    assert sum(split) > total / 3  # the blocks' products, beside the embeddings
    expected = sum(split) / 4 + (total - sum(split)) / 2
    held = per_device(state.params)
    assert held == pytest.approx(expected, rel=0.05)
    moments = per_device(state.opt_state)
    assert moments == pytest.approx(2 * held, rel=0.05)  # Adam's mu and nu
    # Both axes on the MLP's kernel: the model width over fsdp, the units over tensor.
    assert state.params["blocks"][0]["up"]["kernel"].sharding.spec == P("fsdp", "tensor")


def test_a_plan_that_does_not_fit_names_the_rule_that_splits_a_whole_vocabulary(
    corpus_root,  # noqa: F811
):
    """The hint of a plan whose tensor-parallel step does not fit: with the vocabulary whole
    on the tensor axis, the rule that splits it, before what FSDP would hold; none once
    the vocabulary is split."""
    from types import SimpleNamespace

    from jaxdist.aot.plan import sharding_hint

    task = _task(corpus_root)
    shapes = jax.eval_shape(task.init_variables, jax.random.key(0))
    mesh = _grid((2, 2), ("data", "tensor"))

    def parts(rules):
        axes = task.logical_axes()
        dims = logical_axes.split_dims(axes.names, rules, "tensor", shapes[0], 2)
        tensor = tp.TensorParallel(dims, vocabulary=axes.splits_vocabulary(rules))
        step = TrainStep(task.loss, _adamw(), mesh, data_axes="data", tensor=tensor)
        config = ml_collections.ConfigDict({"model": {"dtype": "float32"}})
        return SimpleNamespace(train_step_for=lambda stage: step, task=task, config=config)

    hint = sharding_hint(parts(logical_axes.DEFAULT_RULES), 0, shapes)
    assert hint.startswith(
        "its vocabulary is whole on every device of the tensor axis (the rule vocab=tensor "
        "in --set logical_axis_rules splits the embedding, the head and the logits); or its "
        "parameters and optimizer state alone take"
    ), hint
    hint = sharding_hint(parts(VOCABULARY_RULES), 0, shapes)
    assert hint.startswith("its parameters and optimizer state alone take"), hint
    # A vocabulary the axis does not divide: the rule would be refused, so no hint of it.
    odd = jax.tree.map(
        lambda leaf, n: jax.ShapeDtypeStruct(
            tuple(d + 1 if name == "vocab" else d for d, name in zip(leaf.shape, n)), leaf.dtype
        ),
        shapes[0],
        task.logical_axes().names,
    )
    hint = sharding_hint(parts(logical_axes.DEFAULT_RULES), 0, (odd, shapes[1]))
    assert hint.startswith("its parameters and optimizer state alone take"), hint


def test_a_step_that_hides_its_vocabulary_split_from_the_model_is_one_line(
    corpus_root,  # noqa: F811
):
    """Rules that split the vocabulary, given to a step that says it keeps it whole (or the
    other way round), stop at the first trace with one line, not a wrong loss."""
    task = _task(corpus_root)
    params, model_state = task.init_variables(jax.random.key(0))
    mesh = _grid((2, 2), ("data", "tensor"))
    batch = next(iter(task.data.train_iterator(8)))
    for rules, said, found in (
        (VOCABULARY_RULES, False, "reads 128 of its 256 vocabulary rows, but the step keeps"),
        (
            logical_axes.DEFAULT_RULES,
            True,
            "reads 256 of its 256 vocabulary rows, but the step splits",
        ),
    ):
        dims = logical_axes.split_dims(task.logical_axes().names, rules, "tensor", params, 2)
        step = TrainStep(
            task.loss,
            _adamw(),
            mesh,
            data_axes="data",
            tensor=tp.TensorParallel(dims, vocabulary=said),
        )
        state = step.init(params, model_state)
        with pytest.raises(ValueError, match=found):
            step(state, step.shard_batch(batch), jax.random.key(1))


# --------------------------------------------------------------------------- refusals


def test_meshes_and_rules_that_cannot_hold_are_one_line(corpus_root):  # noqa: F811
    spec = meshes.load("data=2,fsdp=2,tensor=2")
    assert (spec.layout, spec.axis_names, spec.shape) == (
        "torus3d",
        ("data", "fsdp", "tensor"),
        (2, 2, 2),
    )
    assert meshes.load("data=2,stage=4").layout == "pipeline"
    assert [meshes.role_of(a) for a in ("x", "fsdp", "tensor", "host")] == [
        "data",
        "fsdp",
        "tensor",
        "data",
    ]
    with pytest.raises(meshes.MeshSpecError, match=r"axis=size pairs.*got 'tensor'"):
        meshes.load("data=2,tensor")
    with pytest.raises(meshes.MeshSpecError, match=r"'expert' has the role expert, which no step"):
        meshes.check_roles(("data", "expert"))
    task = _task(corpus_root)
    axes = task.logical_axes()
    with pytest.raises(ValueError, match=r"mlp=tensor names an axis the mesh lacks"):
        logical_axes.check_rules(logical_axes.parse_rules("mlp=tensor"), ("data",), axes)
    with pytest.raises(
        ValueError, match=r"embed=tensor, but the model computes only heads, kv_heads, mlp, vocab"
    ):
        logical_axes.check_rules((("embed", "tensor"),), ("data", "tensor"), axes)
    with pytest.raises(
        ValueError, match=r"embed=data: the rules split parameters over tensor or fsdp"
    ):
        logical_axes.check_rules((("embed", "data"),), ("data", "tensor"), axes)
    with pytest.raises(ValueError, match=r"layers=fsdp: scanned layers are gathered one layer"):
        logical_axes.check_rules((("layers", "fsdp"),), ("fsdp",), axes)
    with pytest.raises(ValueError, match=r"entries are name=axis.*got 'heads:tensor'"):
        logical_axes.parse_rules("heads:tensor")
    shapes, _ = jax.eval_shape(task.init_variables, jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"key.bias: dimension 0 \(kv_heads, 4\) does not "
        r"divide over tensor=8",
    ):
        logical_axes.split_dims(axes.names, logical_axes.DEFAULT_RULES, "tensor", shapes, 8)
    with pytest.raises(
        ValueError, match=r"head.bias: dimension 0 \(vocab, 256\) does not divide over tensor=3"
    ):
        logical_axes.split_dims(axes.names, (("vocab", "tensor"),), "tensor", shapes, 3)
    # MaxText's semantics: the first rule whose axis the array does not use yet.
    rules = (("embed", "tensor"), ("mlp", "tensor"), ("mlp", None))
    assert logical_axes.mesh_axes(("embed", "mlp"), rules) == ("tensor", None)
    assert logical_axes.mesh_axes(("mlp", "embed"), rules) == ("tensor", None)


def test_a_checkpoint_written_under_tensor_2_resumes_without_a_tensor_axis(
    corpus_root,  # noqa: F811
    tmp_path,
):
    """Six steps under ``fsdp=4,tensor=2`` (FSDP), saved; restored under ``fsdp=2`` (no
    tensor axis, half the shard count) the state is the saved one, value for value, and two
    more steps there end where two more steps under the first mesh do."""
    from jaxdist.run.trainer import Trainer

    def config(mesh, max_steps):
        return lm_config(
            corpus_root,
            **SHAPE,
            mesh=mesh,
            sharding="fsdp",
            max_steps=max_steps,
            **{"optimizer.clip_norm": 0.5},
        )

    def task(config, replicas):
        return LanguageModel(config, replicas)

    first = Trainer(config("fsdp=4,tensor=2", 6), tmp_path / "run", task=task)
    assert first.run()["step"] == 6
    assert first.train_step_for(0).tensor is not None
    resumed = Trainer(config("fsdp=2", 6), tmp_path / "run", task=task, allow_config_change=True)
    assert resumed.run()["step"] == 6  # restored, nothing left to train
    assert resumed.train_step_for(0).tensor is None
    for got, want in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(first.state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    kernel = resumed.state.params["blocks"][0]["up"]["kernel"]
    assert kernel.sharding.spec == P("fsdp") and len(kernel.sharding.device_set) == 2

    moved = Trainer(config("fsdp=2", 8), tmp_path / "run", task=task, allow_config_change=True)
    stayed = Trainer(config("fsdp=4,tensor=2", 8), tmp_path / "stayed", task=task)
    assert moved.run()["step"] == stayed.run()["step"] == 8
    _assert_params_close(moved.state.params, stayed.state.params)


@pytest.mark.parametrize("schedule", TENSOR_SCHEDULES)
def test_sequence_parallel_products_are_the_unsplit_block(schedule):
    """A norm, a column- then row-parallel pair and a bias on positions split over 4 tensor
    devices (sequence parallelism): the output gathered back, and the gradients of the
    input, the kernels, the shared scale and bias, are the unsplit block's."""
    mesh = _grid((2, 4), ("data", "tensor"))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((16, 32)) / 4, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((32, 16)) / 4, jnp.float32)
    scale = jnp.asarray(rng.standard_normal(16), jnp.float32)

    def loss(x, w1, w2, scale):
        h = tp.to_sequence_shard(x)
        h = h * tp.shared(scale)
        (u,) = tp.column_product(h, [w1])
        y = h + tp.row_product(jnp.tanh(u), w2) + tp.shared(scale)
        return jnp.sum(jnp.sin(tp.from_sequence_shard(y)))

    def split(*args):
        with tp.splitting("tensor", schedule, sequence=True):
            return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(*args)

    specs = (P(), P(None, "tensor"), P("tensor"), P())
    value, grads = jax.jit(
        jax.shard_map(split, mesh=mesh, in_specs=specs, out_specs=(P(), specs), check_vma=False)
    )(x, w1, w2, scale)
    want_value, want = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, w1, w2, scale)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", TENSOR_SCHEDULES)
def test_a_vocabulary_split_embeds_scores_and_losses_as_the_whole_table(schedule):
    """A 32-token table split over 4 tensor devices, with the positions split too: the
    lookup summed over the axis, the head's column-parallel logits and the cross-entropy
    from each device's columns give the whole table's loss and gradients."""
    mesh = _grid((2, 4), ("data", "tensor"))
    rng = np.random.default_rng(2)
    table = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    tokens, targets = (jnp.asarray(rng.integers(0, 32, (2, 8)), jnp.int32) for _ in range(2))

    def loss(table, head):
        x = tp.to_sequence_shard(jnp.tanh(vocab_parallel.embed(table, tokens)))
        (logits,) = tp.column_product(x, [head])
        return vocab_parallel.cross_entropy(logits, targets).mean()

    def split(table, head):
        with tp.splitting("tensor", schedule, sequence=True, vocabulary=True):
            return jax.value_and_grad(loss, argnums=(0, 1))(table, head)

    specs = (P("tensor"), P(None, "tensor"))
    value, grads = jax.jit(
        jax.shard_map(split, mesh=mesh, in_specs=specs, out_specs=(P(), specs), check_vma=False)
    )(table, head)
    want_value, want = jax.value_and_grad(loss, argnums=(0, 1))(table, head)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- rules for fsdp

FSDP_RULES = "mlp=fsdp,heads=fsdp,kv_heads=fsdp,vocab=fsdp"


def test_rules_naming_fsdp_place_the_state_and_train_as_the_replicated_run(
    corpus_root,  # noqa: F811
    replicated,
):
    """Scanned layers under FSDP over 4 with rules that split the MLP's units, the heads and
    the vocabulary over ``fsdp``: each parameter split where the rules say (not where its
    shape would), what no rule names kept whole, and two Adam steps those of one device."""
    task = _task(corpus_root, **{"model.scan_layers": True})
    shapes, _ = jax.eval_shape(task.init_variables, jax.random.key(0))
    rules = logical_axes.parse_rules(FSDP_RULES)
    dims = logical_axes.split_dims(task.logical_axes().names, rules, "fsdp", shapes, 4)
    mesh = _grid((4,), ("fsdp",))
    _, state, losses = _train(task, mesh, "fsdp", sharding="fsdp", shard_dims=dims)
    _, expected, expected_losses = replicated[True]
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-4)
    _assert_params_close(state.params, expected.params)
    blocks = state.params["blocks"]
    # [layers, embed, mlp]: the units (the shape rule would split the model width).
    assert blocks["up"]["kernel"].sharding.spec == P(None, None, "fsdp")
    assert blocks["attention"]["out"]["kernel"].sharding.spec == P(None, "fsdp")
    assert blocks["norm1"]["scale"].sharding.spec == P()  # embed: no rule, whole
    assert state.params["token_embed"]["embedding"].sharding.spec == P("fsdp")
    # Given from Python, a split FSDP cannot keep is one line.
    layers_first = jax.tree.map(lambda _: 0, shapes)
    with pytest.raises(ValueError, match=r"attention.key.bias: dimension 0 counts scanned"):
        Placement.of(
            shapes, 4, unit_bytes=None, stacked=task.stacked_layers(), shard_dims=layers_first
        )


def test_a_recipes_rules_for_fsdp_and_tensor_compose_and_refuse_in_one_line(
    corpus_root,  # noqa: F811
):
    """The run's placement: the recipe's rules first, Megatron's after them on a tensor
    axis. ``embed=fsdp`` alone puts the width over fsdp and the units over tensor; a rule
    that takes a tensor-parallel name off the tensor axis, or one for fsdp while the state
    is replicated, is one line."""
    task = _task(corpus_root)
    mesh = _grid((2, 2), ("fsdp", "tensor"))
    config = ml_collections.ConfigDict(
        {
            "logical_axis_rules": "embed=fsdp",
            "tensor_schedule": "native",
            "tensor_sequence": False,
        }
    )
    kind = DataParallel(config, mesh)
    tensor, shard_dims = kind.tensor_parallel(task), kind.shard_dims(task)
    up = (tensor.dims["blocks"][0]["up"]["kernel"], shard_dims["blocks"][0]["up"]["kernel"])
    assert up == (1, 0)  # [embed, mlp]: mlp over tensor, embed over fsdp
    assert shard_dims["blocks"][0]["attention"]["out"]["kernel"] == 2  # [heads, head_dim, embed]
    parts = StepParts(
        task, optax.adamw(1e-3), Communication("native"), StateSharding(), Precision()
    )
    with pytest.raises(ValueError, match=r"sharding=replicated keeps it whole"):
        kind.build(parts, 1)
    assert not tensor.vocabulary
    config.logical_axis_rules = "embed=fsdp,vocab=tensor"
    tensor = DataParallel(config, mesh).tensor_parallel(task)
    assert tensor.vocabulary and tensor.dims["token_embed"]["embedding"] == 0
    assert tensor.dims["head"]["kernel"] == 1  # [embed, vocab]
    config.logical_axis_rules = "mlp=fsdp"
    with pytest.raises(ValueError, match=r"place mlp over fsdp \(blocks.0.down.kernel\)"):
        DataParallel(config, mesh).tensor_parallel(task)
    # On a tensor axis a name the model splits, left whole, would sum whole products.
    config.logical_axis_rules = "heads=tensor,kv_heads=tensor,mlp="
    with pytest.raises(ValueError, match=r"place mlp over no axis"):
        DataParallel(config, mesh).tensor_parallel(task)
