"""ZeRO-1 and FSDP train steps against one-device training: every optimizer, every schedule with
halves, HSDP, accumulation, loss scaling; memory per device; refusals."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist import meshes
from jaxdist.training import optim
from jaxdist.training import train_step as ts
from jaxdist.training.classifier_loss import classifier_loss
from jaxdist.training.loss_scale import DynamicLossScale
from jaxdist.training.step_options import Communication, StateSharding
from tests._step_options import records
from tests.test_train_step import (
    MESHES,
    NUM_CLASSES,
    STEPS,
    Net,
    assert_trees_close,
    data,
    distributed_training,
    init_variables,
    poisoned_loss,
    reference_training,
)

SHARDED = {"min_shard_elements": 0, "bucket_bytes": 512}

# Optimizers that read more than one element: a global norm, per-layer trust ratios, weight
# decay masked by name and by shape.
CLIPPED_ADAMW = optax.chain(
    optax.clip_by_global_norm(0.05),
    optax.adamw(
        1e-2,
        weight_decay=0.1,
        mask=lambda p: jax.tree_util.tree_map_with_path(
            lambda path, _: "bias" not in jax.tree_util.keystr(path), p
        ),
    ),
)
OPTIMIZERS = {
    "clip_by_global_norm+adamw(mask by name)": CLIPPED_ADAMW,
    "lars": optim.lars(0.5, weight_decay=1e-3),
    "lamb": optax.lamb(1e-2, weight_decay=1e-3),
}


# Every optimizer under FSDP; ZeRO-1 runs the same update on the same blocks, so the default
# run keeps one of them there.
@pytest.mark.parametrize(
    "sharding, name",
    [
        *(("fsdp", name) for name in OPTIMIZERS),
        ("zero1", "lars"),
        *(
            pytest.param("zero1", name, marks=pytest.mark.slow)
            for name in OPTIMIZERS
            if name != "lars"
        ),
    ],
)
def test_every_optimizer_is_exact_when_sharded(sharding, name):
    optimizer = OPTIMIZERS[name]
    batches = [data(seed=s) for s in range(STEPS)]
    params, _ = reference_training(optimizer, batches, use_norm=False)
    make_mesh, axes = MESHES["ring-8"]
    state, _, step = distributed_training(
        make_mesh(),
        axes,
        optimizer,
        batches,
        use_norm=False,
        sharding=sharding,
        allreduce="ring",
        **SHARDED,
    )
    assert step.placement.units, "nothing was sharded"
    assert_trees_close(state.params, params, atol=3e-6)
    # The clipping bites: an unclipped run lands elsewhere (the test can fail).
    if name.startswith("clip"):
        free, _ = reference_training(optax.adamw(1e-2, weight_decay=0.1), batches, use_norm=False)
        gap = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(jax.tree.leaves(free), jax.tree.leaves(params))
        )
        assert gap > 1e-3


@pytest.mark.parametrize(
    ("mesh_name", "algorithm", "options"),
    [
        ("ring-8", "native", {}),
        ("ring-8", "bidirectional_ring", {}),
        ("hierarchical-2x4", "hierarchical", {"inter_algorithm": "bidirectional_ring"}),
        ("torus-2x2x2", "torus3d", {}),
    ],
)
def test_fsdp_with_every_schedule_matches_single_device(
    reference_sgd, mesh_name, algorithm, options
):
    batches, (params, model_state) = reference_sgd
    make_mesh, axes = MESHES[mesh_name]
    state, _, _ = distributed_training(
        make_mesh(),
        axes,
        optax.sgd(0.1, momentum=0.9),
        batches,
        sharding="fsdp",
        allreduce=algorithm,
        allreduce_options=options,
        **SHARDED,
    )
    assert_trees_close(state.params, params, atol=3e-6)
    assert_trees_close(state.model_state, model_state, atol=2e-6)


@pytest.mark.parametrize(
    ("sharding", "mesh_name", "algorithm", "gather"),
    [("fsdp", "ring-8", "ring", "native"), ("zero1", "torus-4x2", "torus2d", "bidirectional_ring")],
)
def test_parameters_gathered_by_a_schedule_of_their_own_match_single_device(
    reference_sgd, sharding, mesh_name, algorithm, gather
):
    """The gradients' reduce-scatters by ``allreduce``, the parameters' all-gathers by
    ``gather``: the same training."""
    batches, (params, model_state) = reference_sgd
    make_mesh, axes = MESHES[mesh_name]
    state, _, step = distributed_training(
        make_mesh(),
        axes,
        optax.sgd(0.1, momentum=0.9),
        batches,
        sharding=sharding,
        allreduce=algorithm,
        gather=gather,
        **SHARDED,
    )
    lowered = step.lower(state, step.shard_batch(batches[0]), jax.random.key(1)).as_text()
    # XLA's all-gather runs the parameters' gathers under "native" only; the permute schedules
    # run both halves otherwise.
    assert ("all_gather" in lowered) == (gather == "native")
    assert "collective_permute" in lowered
    assert_trees_close(state.params, params, atol=3e-6)
    assert_trees_close(state.model_state, model_state, atol=2e-6)


def test_fsdp_gathering_layers_further_ahead_matches_single_device(reference_sgd):
    """Each layer's gather free to start two layers ahead, in forward and backward (the third
    layer's gather waits for the first's inputs, the first's backward gather for the third's
    backward): the same training. Sharded 4 ways (HSDP), every kernel splits."""
    prefetch = 2
    batches, (params, model_state) = reference_sgd
    make_mesh, axes = MESHES["torus-4x2"]
    mesh = make_mesh()
    four = next(a for a in axes if mesh.shape[a] == 4)
    state, _, step = distributed_training(
        mesh,
        axes,
        optax.sgd(0.1, momentum=0.9),
        batches,
        sharding="fsdp",
        allreduce="ring",
        shard_axes=four,
        prefetch=prefetch,
        **SHARDED,
    )
    assert step.sharding.prefetch == prefetch
    assert step.paced_layers == 3  # each Dense, the BatchNorm with the first
    assert_trees_close(state.params, params, atol=3e-6)
    assert_trees_close(state.model_state, model_state, atol=2e-6)


@pytest.mark.slow  # two FSDP runs and a lowering: about 20 s
def test_bfloat16_layers_gather_their_parameters_as_bfloat16_for_the_same_training(monkeypatch):
    """A layer that computes in bfloat16 casts its float32 kernel first: FSDP gathers the
    cast, half the bytes, and training is the same as gathering float32."""
    import flax.linen as nn

    from jaxdist.training import fsdp_pacing

    class HalfNet(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            # Recomputed in backward: its kernel's cast is read inside the checkpoint.
            x = nn.relu(nn.remat(nn.Dense)(64, dtype=jnp.bfloat16)(x))
            x = nn.LayerNorm()(x)  # reads its scale in float32: that gather stays float32
            return nn.Dense(NUM_CLASSES, dtype=jnp.bfloat16)(x).astype(jnp.float32)

    model = HalfNet()
    params = model.init(jax.random.key(0), np.zeros((2, 10), np.float32))["params"]
    batches = [data(seed=s) for s in range(STEPS)]

    def train():
        step = ts.TrainStep(
            classifier_loss(model, num_classes=NUM_CLASSES),
            optax.adam(1e-2),
            meshes.ring(8),
            **records(sharding="fsdp", allreduce="ring", **SHARDED),
        )
        state = step.init(params)
        for batch in batches:
            state, metrics = step(state, step.shard_batch(batch), jax.random.key(1))
        text = step.lower(state, step.shard_batch(batches[0]), jax.random.key(1)).as_text()
        assert step.paced_layers == 2  # each Dense; the norm joins the first
        return state, metrics, text

    narrow, narrow_metrics, narrow_text = train()
    own_dtypes = lambda params, eqns: [jnp.dtype(p.aval.dtype) for p in params]  # noqa: E731
    monkeypatch.setattr(fsdp_pacing, "gather_dtypes", own_dtypes)
    wide, wide_metrics, wide_text = train()

    def sent_dtypes(text):  # as the program is written: XLA:CPU then sends bf16 as f32
        return set(re.findall(r"collective_permute.*: \(tensor<\w+x(\w+)>\)", text))

    # The gradients travel as float32 either way; only the kernels' gathers can be bf16.
    assert sent_dtypes(narrow_text) == {"bf16", "f32"}
    assert sent_dtypes(wide_text) == {"f32"}
    assert float(narrow_metrics["loss"]) == float(wide_metrics["loss"])
    assert_trees_close(narrow.params, wide.params, atol=0)


@pytest.fixture(scope="module")
def reference_sgd():
    batches = [data(seed=s) for s in range(STEPS)]
    return batches, reference_training(optax.sgd(0.1, momentum=0.9), batches)


def test_hsdp_shards_inside_groups_and_averages_across(reference_sgd):
    """FSDP over the inner axis of a 2x4 mesh, data parallel across its outer axis."""
    batches, (params, model_state) = reference_sgd
    make_mesh, axes = MESHES["hierarchical-2x4"]
    state, _, step = distributed_training(
        make_mesh(),
        axes,
        optax.sgd(0.1, momentum=0.9),
        batches,
        sharding="fsdp",
        allreduce="ring",
        shard_axes="local",
        **SHARDED,
    )
    assert_trees_close(state.params, params, atol=3e-6)
    assert_trees_close(state.model_state, model_state, atol=2e-6)
    kernel = state.params["Dense_1"]["kernel"]  # 16 x 12, split 4 ways along its rows
    assert kernel.addressable_shards[0].data.shape == (4, 12)
    assert step.placement.shards == 4


def _trained_with_bf16_gradients(mesh_name, allreduce, batches):
    """``(state, step)`` after FSDP training over ``mesh_name`` with the gradients sent in
    bfloat16 by ``allreduce``."""
    make_mesh, axes = MESHES[mesh_name]
    state, _, step = distributed_training(
        make_mesh(),
        axes,
        optax.sgd(0.1, momentum=0.9),
        batches,
        use_norm=False,
        sharding="fsdp",
        allreduce=allreduce,
        allreduce_options={"transfer_dtype": jnp.bfloat16},
        **SHARDED,
    )
    return state, step


@pytest.mark.parametrize("keep_gathered", [pytest.param(False, marks=pytest.mark.slow), True])
def test_fsdp_with_accumulation_and_bf16_gradients(keep_gathered):
    batches = [data(seed=s) for s in range(STEPS)]
    params, _ = reference_training(optax.sgd(0.1, momentum=0.9), batches, use_norm=False)
    make_mesh, axes = MESHES["torus-4x2"]
    state, _, _ = distributed_training(
        make_mesh(),
        axes,
        optax.sgd(0.1, momentum=0.9),
        batches,
        use_norm=False,
        sharding="fsdp",
        allreduce="torus2d",
        accumulation_steps=4,
        keep_gathered=keep_gathered,
        **SHARDED,
    )
    assert_trees_close(state.params, params, atol=3e-6)
    rounded, _ = _trained_with_bf16_gradients("torus-4x2", "torus2d", batches)
    assert_trees_close(rounded.params, params, atol=2e-3)
    # Parameters travel whole: the float32 master copy is not rounded to bf16.
    flat = np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(rounded.params)])
    assert (
        np.mean(flat != np.asarray(jnp.asarray(flat).astype(jnp.bfloat16).astype(jnp.float32)))
        > 0.5
    )


def test_fsdp_native_reduce_scatters_bf16_gradients_when_asked():
    """XLA's own reduce-scatter takes the gradients in the wire's dtype (as XLA's FSDP of a
    bfloat16 layer does): the program's reduce-scatters are bfloat16, and the step trains as
    the single device does to bfloat16 rounding."""
    batches = [data(seed=s) for s in range(STEPS)]
    params, _ = reference_training(optax.sgd(0.1, momentum=0.9), batches, use_norm=False)
    rounded, step = _trained_with_bf16_gradients("ring-8", "native", batches)
    assert_trees_close(rounded.params, params, atol=2e-3)
    text = step.lower(rounded, step.shard_batch(batches[0]), jax.random.key(1)).as_text()
    scattered = re.findall(r"reduce_scatter.*?\}\) : \(tensor<\d+x(\w+)>\)", text, re.DOTALL)
    assert scattered and set(scattered) == {"bf16"}, scattered


def test_fsdp_under_a_float16_loss_scale_skips_overflowing_steps():
    mesh = MESHES["ring-8"][0]()
    params, model_state = init_variables(use_norm=False)
    step = ts.TrainStep(
        poisoned_loss(jnp.inf),
        optax.sgd(0.1),
        mesh,
        **records(
            allreduce="ring",
            sharding="fsdp",
            loss_scale=DynamicLossScale.create(2.0**10),
            **SHARDED,
        ),
    )
    state = step.init(params, model_state)
    before = jax.device_get(state.params)
    poisoned = {**data(), "poison": np.ones((64,), bool)}
    state, metrics = step(state, step.shard_batch(poisoned), jax.random.key(0))
    assert not bool(metrics["grads_finite"])
    assert_trees_close(jax.device_get(state.params), before, atol=0)
    assert float(state.loss_scale.scale) < 2.0**10


def test_state_is_made_straight_into_its_shards():
    mesh = MESHES["ring-8"][0]()
    loss = classifier_loss(Net(), num_classes=NUM_CLASSES)
    step = ts.TrainStep(
        loss,
        optax.adam(1e-3),
        mesh,
        **records(sharding="fsdp", **SHARDED),
    )

    def init(rng):
        variables = Net().init(rng, jnp.zeros((2, 10)), train=False)
        return variables["params"], {"batch_stats": variables["batch_stats"]}

    state = step.init_sharded(init, jax.random.key(0))
    placed = step.init(*jax.device_get(init(jax.random.key(0))))
    assert_trees_close(state, placed, atol=0)
    for made, want in zip(jax.tree.leaves(state), jax.tree.leaves(placed)):
        assert made.sharding.is_equivalent_to(want.sharding, made.ndim)


def test_per_device_state_falls_as_one_over_n():
    """XLA's own memory analysis of the compiled step: parameters and optimizer state per
    device, replicated against FSDP on 8 devices, for a model whose every kernel splits."""
    import flax.linen as nn

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            for _ in range(3):
                x = nn.relu(nn.Dense(256)(x))
            return nn.Dense(8)(x)

    params = Wide().init(jax.random.key(0), jnp.zeros((2, 256)))["params"]
    batch = {"image": np.zeros((64, 256), np.float32), "label": np.zeros((64,), np.int32)}
    mesh = meshes.ring(8)
    loss = classifier_loss(Wide(), num_classes=8)
    sizes, placements = {}, {}
    for sharding in ("replicated", "zero1", "fsdp"):
        step = ts.TrainStep(
            loss,
            optax.adam(1e-3),
            mesh,
            communication=Communication("ring"),
            sharding=StateSharding(sharding),
        )
        state = step.init(params)
        compiled = step.lower(state, step.shard_batch(batch), jax.random.key(0)).compile()
        sizes[sharding] = compiled.memory_analysis().argument_size_in_bytes
        placements[sharding] = step.placement_of(state.params)
    # What a device holds of the parameters, whole or split 8 ways as the placement says.
    placement = placements["fsdp"]
    whole = sum(np.prod(s) for s in placement.shapes) * 4
    split = sum(np.prod(s) for s, d in zip(placement.shapes, placement.dims) if d is not None) * 4
    own = whole - split + split / 8
    assert placement.replicated() == [
        "Dense_0.bias",
        "Dense_1.bias",
        "Dense_2.bias",
        "Dense_3.bias",
    ]
    batch_bytes = (64 * 256 + 64) * 4 / 8
    # Adam: parameters + two moments. Replicated: 3x the model per device; ZeRO-1: whole
    # parameters and split moments; FSDP: everything split (the biases stay whole).
    assert sizes["replicated"] == pytest.approx(3 * whole + batch_bytes, rel=1e-3)
    assert sizes["zero1"] == pytest.approx(whole + 2 * own + batch_bytes, rel=1e-3)
    assert sizes["fsdp"] == pytest.approx(3 * own + batch_bytes, rel=1e-3)
    assert sizes["fsdp"] < 1.05 * 3 * whole / 8 + batch_bytes


def test_sharded_steps_refuse_what_they_cannot_run_in_one_line():
    mesh = meshes.torus2d(4, 2)
    loss = classifier_loss(Net(), num_classes=NUM_CLASSES)
    cases = [
        ({"allreduce": "halving_doubling"}, "halving_doubling has no reduce-scatter"),
        ({"allreduce": "auto"}, "allreduce='auto' names none"),
        ({"allreduce": "ring", "sfb_layers": "all"}, "it sends no sufficient factors"),
        ({"allreduce": "ring", "shard_axes": "z"}, "data axes ['z'] are not axes of the mesh"),
        ({"allreduce": "ring", "wait_free": True}, "does not combine with sharding='fsdp'"),
        ({"allreduce": "ring", "gather": "halving_doubling"}, "gather must be one of native, "),
        ({"allreduce": "ring", "gather": "torus3d"}, "gather='torus3d': allreduce 'torus3d' needs"),
        ({"allreduce": "ring", "prefetch": 0}, "prefetch must be a whole number of layers >= 1"),
        (
            {"allreduce": "ring", "prefetch": 2, "keep_gathered": True},
            "a step that keeps every unit gathered none layer by layer",
        ),
    ]
    for options, message in cases:
        with pytest.raises(ValueError) as err:
            ts.TrainStep(
                loss,
                optax.sgd(0.1),
                mesh,
                **records(sharding="fsdp", **options),
            )
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(
        ValueError, match="sharding must be one of replicated, zero1, fsdp; got 'zero3'"
    ):
        ts.TrainStep(loss, optax.sgd(0.1), mesh, sharding=StateSharding("zero3"))
    with pytest.raises(ValueError, match="a step that sharding='zero1' gathers none layer by"):
        ts.TrainStep(
            loss,
            optax.sgd(0.1),
            mesh,
            communication=Communication("ring"),
            sharding=StateSharding("zero1", prefetch=2),
        )
    for gather in ("native", "ring"):  # named, even as the allreduce's own, it is refused
        with pytest.raises(ValueError, match="sharding='replicated' gathers none"):
            ts.TrainStep(
                loss,
                optax.sgd(0.1),
                mesh,
                communication=Communication("ring"),
                sharding=StateSharding(gather=gather),
            )


def test_fsdp_paces_each_layers_gather_and_keeps_tied_weights_in_one_segment():
    """The loss is cut at each layer that reads new parameters; a matrix read twice (tied
    input and output embeddings) keeps everything between its reads in one segment; the
    step still equals one device's."""
    from jaxdist.training import fsdp_pacing

    def mlp(params, x):
        for name in ("a", "b", "c"):
            x = jnp.tanh(x @ params[name]["kernel"] + params[name]["bias"])
        return x

    params = {n: {"kernel": jnp.ones((8, 8)) * 0.1, "bias": jnp.zeros(8)} for n in "abc"}
    leaves = jax.tree.leaves(params)
    closed = jax.make_jaxpr(
        lambda *ls: mlp(jax.tree.unflatten(jax.tree.structure(params), ls), jnp.ones((2, 8)))
    )(*leaves)
    param_vars = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    segments = fsdp_pacing.segments_of(closed.jaxpr, param_vars)
    # Leaves in tree order: a.bias, a.kernel, b.bias, ...: one segment per layer.
    assert [sorted(s.leaves) for s in segments] == [[0, 1], [2, 3], [4, 5]]

    def half_mlp(params, x):  # each layer casts its parameters to bfloat16 just before use
        for name in ("a", "b", "c"):
            kernel, bias = (params[name][k].astype(jnp.bfloat16) for k in ("kernel", "bias"))
            x = jnp.tanh(x.astype(jnp.bfloat16) @ kernel + bias)
        return x

    closed = jax.make_jaxpr(
        lambda *ls: half_mlp(jax.tree.unflatten(jax.tree.structure(params), ls), jnp.ones((2, 8)))
    )(*leaves)
    param_vars = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    segments = fsdp_pacing.segments_of(closed.jaxpr, param_vars)
    assert [sorted(s.leaves) for s in segments] == [[0, 1], [2, 3], [4, 5]]
    assert all(fsdp_pacing.gather_dtypes(s.params, s.eqns) == [jnp.bfloat16] * 2 for s in segments)
    # Inside a recomputed block or a nested jit, the reads are looked at where they happen.
    recomputed = jax.make_jaxpr(
        lambda *ls: jax.checkpoint(half_mlp)(
            jax.tree.unflatten(jax.tree.structure(params), ls), jnp.ones((2, 8))
        )
    )(*leaves)
    assert (
        fsdp_pacing.gather_dtypes(recomputed.jaxpr.invars, recomputed.jaxpr.eqns)
        == [jnp.bfloat16] * 6
    )
    # A value a call gives back unchanged is read where its result is: cast there, or not.
    call = jax.jit(lambda w: (w.astype(jnp.bfloat16), w))

    def dtypes_of(f):
        closed = jax.make_jaxpr(f)(jnp.ones(3))
        return fsdp_pacing.gather_dtypes(closed.jaxpr.invars, closed.jaxpr.eqns)

    assert dtypes_of(lambda w: call(w)[0] * call(w)[1].astype(jnp.bfloat16)) == [jnp.bfloat16]
    assert dtypes_of(lambda w: call(w)[0] * call(w)[1].sum()) == [jnp.float32]

    def tied(params, x):
        h = x @ params["embed"]
        h = jnp.tanh(h @ params["mid"])
        return h @ params["embed"].T

    tied_params = {"embed": jnp.ones((8, 8)), "mid": jnp.ones((8, 8))}
    leaves = jax.tree.leaves(tied_params)
    closed = jax.make_jaxpr(lambda e, m: tied({"embed": e, "mid": m}, jnp.ones((2, 8))))(*leaves)
    segments = fsdp_pacing.segments_of(
        closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars)}
    )
    assert [sorted(s.leaves) for s in segments] == [[0, 1]]


def test_a_tied_embedding_trains_exactly_under_fsdp():
    import flax.linen as nn

    class TiedLM(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            embed = nn.Embed(16, 32)
            h = embed(x).mean(1)
            h = nn.relu(nn.Dense(32)(h))
            return embed.attend(h)

    tokens = np.random.default_rng(0).integers(0, 16, (64, 5)).astype(np.int32)
    batches = [{"image": tokens, "label": tokens[:, 0]}]
    model = TiedLM()
    params = model.init(jax.random.key(0), tokens[:2])["params"]
    optimizer = optax.adam(1e-2)

    @jax.jit
    def one_device(params, opt_state, batch):
        def loss(p):
            logits = model.apply({"params": p}, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    expected, opt_state = params, optimizer.init(params)
    for batch in batches * 2:
        expected, opt_state = one_device(expected, opt_state, batch)
    step = ts.TrainStep(
        classifier_loss(model, num_classes=16),
        optimizer,
        meshes.ring(8),
        **records(sharding="fsdp", allreduce="ring", **SHARDED),
    )
    state = step.init(params)
    for batch in batches * 2:
        state, _ = step(state, step.shard_batch(batch), jax.random.key(0))
    assert_trees_close(state.params, expected, atol=3e-6)
