"""Large-batch optimizer pieces: label smoothing, LR scaling and epoch schedules, masked LARS."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist.training import global_norm, optim

# --------------------------------------------------------------------------- label smoothing


def test_smoothed_cross_entropy_matches_hand_computation():
    # 3 classes, smoothing 0.3: targets are 0.1 everywhere plus 0.7 on the true class.
    logits = jnp.array([[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]])
    labels = jnp.array([0, 2])
    log_z = math.log(math.exp(2.0) + math.exp(0.0) + math.exp(-1.0))
    log_p = [2.0 - log_z, 0.0 - log_z, -1.0 - log_z]
    first = -(0.8 * log_p[0] + 0.1 * log_p[1] + 0.1 * log_p[2])
    second = math.log(3.0)  # uniform prediction: the loss is log 3 whatever the target
    found = optim.smoothed_cross_entropy(logits, labels, num_classes=3, smoothing=0.3)
    np.testing.assert_allclose(found, [first, second], rtol=1e-6)


def test_zero_smoothing_is_plain_cross_entropy_and_bf16_logits_give_f32_loss():
    logits = jax.random.normal(jax.random.key(0), (5, 4)).astype(jnp.bfloat16)
    labels = jnp.array([0, 1, 2, 3, 1])
    found = optim.smoothed_cross_entropy(logits, labels, num_classes=4)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    assert found.dtype == jnp.float32
    np.testing.assert_allclose(found, expected, rtol=1e-6)


@pytest.mark.parametrize(
    "logits_shape, labels, kwargs, error, message",
    [
        ((2, 3), [0, 1], {"num_classes": 4}, ValueError, "expected num_classes=4"),
        ((2, 3), [0, 1, 2], {"num_classes": 3}, ValueError, r"labels must have shape \(2,\)"),
        ((2, 3), [0.0, 1.0], {"num_classes": 3}, TypeError, "integer class indices"),
        ((2, 3), [0, 1], {"num_classes": 3, "smoothing": 1.0}, ValueError, r"\[0, 1\)"),
    ],
)
def test_smoothed_cross_entropy_rejects_bad_input(logits_shape, labels, kwargs, error, message):
    with pytest.raises(error, match=message):
        optim.smoothed_cross_entropy(jnp.zeros(logits_shape), jnp.array(labels), **kwargs)


# --------------------------------------------------------------------------- learning rate


@pytest.mark.parametrize(
    "base_lr, batch, base_batch, expected",
    [
        (0.1, 256, 256, 0.1),
        (0.1, 8192, 256, 3.2),  # Goyal et al.: 8K batch
        (0.1, 1024, 256, 0.4),  # flax imagenet TPU config
        (2.0, 512, 1024, 1.0),
    ],
)
def test_linear_scaling(base_lr, batch, base_batch, expected):
    assert optim.scaled_learning_rate(base_lr, batch, base_batch) == pytest.approx(expected)


# (kind, peak, warmup, total, end, power, init) -> [(epoch, expected lr)]
SCHEDULE_TABLE = [
    # MLPerf LARS, batch 32K: peak 29.0 (example), 5 warm-up epochs, poly power 2 to 1e-4.
    (
        ("poly", 29.0, 5, 45, 1e-4, 2.0, 0.0),
        [
            (0.0, 0.0),  # warm-up start
            (2.5, 14.5),  # warm-up middle
            (5.0, 29.0),  # peak at the end of warm-up
            (25.0, (29.0 - 1e-4) * 0.25 + 1e-4),  # halfway through decay: (1/2)^2
            (45.0, 1e-4),  # poly end
            (60.0, 1e-4),  # stays at the end value
        ],
    ),
    # flax imagenet: 5 warm-up epochs, cosine to 0 at epoch 100.
    (
        ("cosine", 0.4, 5, 100, 0.0, 2.0, 0.0),
        [(0.0, 0.0), (1.25, 0.1), (5.0, 0.4), (52.5, 0.2), (100.0, 0.0), (120.0, 0.0)],
    ),
    # cosine to a floor: midpoint is halfway between peak and end.
    (("cosine", 1.0, 2, 12, 0.2, 2.0, 0.0), [(7.0, 0.6), (12.0, 0.2)]),
    # warm-up from 0.1 to 3.2 over 5 epochs, then constant
    (
        ("constant", 3.2, 5, 90, 0.0, 2.0, 0.1),
        [(0.0, 0.1), (2.5, 1.65), (5.0, 3.2), (89.0, 3.2)],
    ),
    # Goyal's full schedule: warm-up from 0.1 to 3.2, then x0.1 at epochs 30, 60, 80.
    (
        ("step", 3.2, 5, 90, 0.0, 2.0, 0.1, (30, 60, 80)),
        [(2.5, 1.65), (29.9, 3.2), (30.0, 0.32), (59.0, 0.32), (60.0, 0.032), (85.0, 0.0032)],
    ),
    # no warm-up, fractional epochs
    (("poly", 1.0, 0, 4, 0.0, 1.0, 0.0), [(0.0, 1.0), (1.5, 0.625), (4.0, 0.0)]),
]


@pytest.mark.parametrize("args, points", SCHEDULE_TABLE)
def test_lr_schedule_values(args, points):
    kind, peak, warmup, total, end, power, init, *steps = args
    schedule = optim.lr_schedule(
        kind, peak, warmup, total, end, power, init_lr=init, step_epochs=steps[0] if steps else ()
    )
    for epoch, expected in points:
        found = float(schedule(epoch))
        assert found == pytest.approx(expected, rel=1e-5, abs=1e-6), (
            f"{kind} at epoch {epoch}: expected {expected}, found {found}"
        )


def test_lr_schedule_is_traceable_on_a_fractional_epoch():
    schedule = optim.lr_schedule("cosine", 1.0, 1.0, 3.0)
    epochs = jnp.array([0.5, 2.0], jnp.float32)
    np.testing.assert_allclose(jax.jit(jax.vmap(schedule))(epochs), [0.5, 0.5], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": "exponential"}, "kind must be one of"),
        ({"warmup_epochs": 10}, "warmup_epochs < total_epochs"),
        ({"peak_lr": -1.0}, "peak_lr must be a finite non-negative"),
        ({"kind": "poly", "power": 0.0}, "positive power"),
        ({"kind": "step"}, r"increasing step_epochs in \(warmup_epochs, total_epochs\]"),
        ({"kind": "step", "step_epochs": (5, 3)}, "increasing step_epochs"),
        ({"kind": "step", "step_epochs": (11,)}, "increasing step_epochs"),
        ({"step_epochs": (5,)}, "only applies to kind='step'"),
    ],
)
def test_lr_schedule_rejects_bad_config(kwargs, message):
    config = dict(kind="cosine", peak_lr=1.0, warmup_epochs=1, total_epochs=10) | kwargs
    with pytest.raises(ValueError, match=message):
        optim.lr_schedule(**config)


# --------------------------------------------------------------------------- optimizers


def _params():
    # float32 explicitly: jnp.full with a Python scalar would make weak-typed leaves, unlike
    # real parameters, and the optimizer state would change type after the first update.
    f32 = jnp.float32
    return {
        "conv": {"kernel": jnp.full((3, 3, 2, 4), 0.5, f32)},
        "norm": {"scale": jnp.ones((4,), f32), "bias": jnp.full((4,), 0.25, f32)},
        "head": {"kernel": jnp.full((4, 3), -0.2, f32), "bias": jnp.full((3,), 0.1, f32)},
    }


def _grads(seed):
    params = _params()
    keys = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params)))
    leaves = [jax.random.normal(k, p.shape) for k, p in zip(keys, jax.tree.leaves(params))]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def _run(tx, steps):
    params = _params()
    state = tx.init(params)
    for seed in range(steps):
        updates, state = tx.update(_grads(seed), state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_lars_masks_bn_and_biases_to_plain_momentum_sgd():
    lr, wd, momentum = 0.5, 1e-2, 0.9
    lars_params = _run(optim.lars(lr, weight_decay=wd, momentum=momentum), steps=3)
    sgd_params = _run(optax.sgd(lr, momentum=momentum), steps=3)
    unmasked = _run(
        optax.lars(lr, weight_decay=wd, momentum=momentum), steps=3
    )  # trust ratio and decay on everything
    for path in (("norm", "scale"), ("norm", "bias"), ("head", "bias")):
        a, b = lars_params[path[0]][path[1]], sgd_params[path[0]][path[1]]
        np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=f"{path} is not plain momentum SGD")
        # ...which is not what unmasked LARS does to it (the mask has an effect).
        assert not np.allclose(a, unmasked[path[0]][path[1]], rtol=1e-3)
    # Kernels are LARS-scaled: the same as unmasked optax.lars, unlike SGD.
    for path in (("conv", "kernel"), ("head", "kernel")):
        np.testing.assert_allclose(
            lars_params[path[0]][path[1]], unmasked[path[0]][path[1]], rtol=1e-6
        )
        assert not np.allclose(
            lars_params[path[0]][path[1]], sgd_params[path[0]][path[1]], rtol=1e-3
        )


def test_lars_kernel_update_is_trust_ratio_scaled():
    lr, wd, tc = 2.0, 1e-4, 1e-3
    params = _params()
    grads = _grads(0)
    tx = optim.lars(lr, weight_decay=wd, momentum=0.9, trust_coefficient=tc)
    updates, _ = tx.update(grads, tx.init(params), params)
    w, g = params["conv"]["kernel"], grads["conv"]["kernel"] + wd * params["conv"]["kernel"]
    trust = tc * jnp.linalg.norm(w) / jnp.linalg.norm(g)
    np.testing.assert_allclose(updates["conv"]["kernel"], -lr * trust * g, rtol=1e-5)


def test_sgd_momentum_decays_kernels_only():
    lr, wd = 0.1, 1e-2
    params, grads = _params(), _grads(0)
    tx = optim.sgd_momentum(lr, momentum=0.9, nesterov=False, weight_decay=wd)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(
        updates["head"]["kernel"],
        -lr * (grads["head"]["kernel"] + wd * params["head"]["kernel"]),
        rtol=1e-6,
    )
    np.testing.assert_allclose(updates["head"]["bias"], -lr * grads["head"]["bias"], rtol=1e-6)
    np.testing.assert_allclose(updates["norm"]["scale"], -lr * grads["norm"]["scale"], rtol=1e-6)


@pytest.mark.parametrize("name", sorted(optim.OPTIMIZERS))
def test_learning_rate_is_set_per_step_inside_jit(name):
    """The train-step pattern: LR from the epoch schedule, written into the state under jit,
    also through optax.MultiSteps (gradient accumulation)."""
    schedule = optim.lr_schedule("poly", 4.0, 1.0, 3.0, end_lr=0.0, power=1.0)
    kwargs = {"weight_decay": 0.0} | ({} if name == "adamw" else {"momentum": 0.0})
    tx = optax.MultiSteps(optim.make_optimizer(name, float(schedule(0.0)), **kwargs), 1)
    params = _params()
    state = tx.init(params)

    @jax.jit
    def step(params, state, epoch):
        state = optim.set_learning_rate(state, schedule(epoch))
        updates, state = tx.update(_grads(0), state, params)
        return updates, state

    for epoch, lr in [(0.5, 2.0), (2.0, 2.0), (1.0, 4.0)]:
        updates, state = step(params, state, jnp.float32(epoch))
        assert float(optim.get_learning_rate(state)) == pytest.approx(lr)
        if name == "sgd":  # no momentum, no decay: the update is -lr * grad
            np.testing.assert_allclose(
                updates["head"]["bias"], -lr * _grads(0)["head"]["bias"], rtol=1e-6
            )
    assert step._cache_size() == 1, "setting the learning rate retraced the step"


def test_make_optimizer_errors():
    with pytest.raises(ValueError, match="unknown optimizer 'adam'; expected one of"):
        optim.make_optimizer("adam", 0.1)
    with pytest.raises(ValueError, match=r"adamw needs eps > 0"):
        optim.make_optimizer("adamw", 0.1, eps=0.0)
    with pytest.raises(TypeError, match="learning_rate must be a number"):
        optim.make_optimizer("lars", lambda count: 0.1, weight_decay=0.0)
    with pytest.raises(KeyError, match="no 'learning_rate'"):
        optim.set_learning_rate(optax.sgd(0.1).init(_params()), 0.2)


def test_a_pipeline_refuses_updates_that_need_the_whole_model():
    """A pipeline gives each stage its own layers: an optimizer whose update would change is
    refused in one line, not run. (ZeRO-1 and FSDP run every optimizer exactly: the sharded
    step tests show it.)"""
    from jaxdist.training.step_checks import check_shardable

    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    summed = optax.chain(global_norm.clip_by_global_norm(1.0), optax.sgd(0.1))
    for per_layer in (optim.lars(0.1, 1e-4), optim.sgd_momentum(0.1), optax.adam(1e-3), summed):
        check_shardable(per_layer)
    with pytest.raises(
        ValueError, match=r"a pipeline updates each stage's layers on their own"
    ) as err:
        check_shardable(clipped)
    assert "\n" not in str(err.value)
    # A sum over the model inside a conditional transformation cannot leave it to be added
    # over the stages: one line, not a leaked tracer.
    guarded = optax.apply_if_finite(summed, max_consecutive_errors=5)
    with pytest.raises(ValueError, match=r"inside a conditional transformation") as err:
        check_shardable(guarded)
    assert "\n" not in str(err.value)


def test_clip_norm_clips_by_the_global_norm_as_optax_does():
    """``optimizer.clip_norm`` puts global-norm clipping before the optimizer: on a whole tree
    the update is optax's own, bit for bit; the learning rate is still set through the chain;
    0 leaves the optimizer alone and a negative norm is one line."""
    from jaxdist.run.config import apply_overrides, base_config
    from jaxdist.run.from_config import build_optimizer

    params = _params()
    grads = jax.tree.map(lambda p: 10 * jnp.ones_like(p), params)  # a norm the clip bites on
    opt = apply_overrides(base_config(), ["optimizer.name=adamw", "optimizer.clip_norm=0.5"])
    ours = build_optimizer(opt.optimizer, 0.1)
    want = optax.chain(
        optax.clip_by_global_norm(0.5), optim.adamw(0.1, weight_decay=opt.optimizer.weight_decay)
    )
    state = optim.set_learning_rate(ours.init(params), 0.3)
    got, _ = ours.update(grads, state, params)
    expected, _ = want.update(grads, optim.set_learning_rate(want.init(params), 0.3), params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    unclipped = build_optimizer(
        apply_overrides(base_config(), ["optimizer.name=adamw"]).optimizer, 0.1
    )
    assert jax.tree.structure(unclipped.init(params)) != jax.tree.structure(state)
    with pytest.raises(
        ValueError, match=r"optimizer.clip_norm must be >= 0 \(0: no clipping\), got -1.0"
    ):
        build_optimizer(apply_overrides(base_config(), ["optimizer.clip_norm=-1"]).optimizer, 0.1)


def test_an_unset_eps_is_the_chosen_optimizers_own_and_a_set_one_is_kept():
    """``--set optimizer.name=adamw`` on the base config trains with optax's eps (1e-8); LARS
    keeps 0 as before; an eps set in the config reaches the optimizer as it is."""
    from jaxdist.run.config import apply_overrides, base_config
    from jaxdist.run.from_config import build_optimizer

    def eps_of(*overrides):
        opt = apply_overrides(base_config(), overrides).optimizer
        state = build_optimizer(opt, 0.1).init(_params())
        return float(optax.tree_utils.tree_get(state, "eps"))

    assert eps_of("optimizer.name=adamw") == pytest.approx(1e-8)
    assert eps_of("optimizer.name=lars") == 0.0
    assert eps_of("optimizer.name=adamw", "optimizer.eps=1e-6") == pytest.approx(1e-6)
    assert eps_of("optimizer.name=lars", "optimizer.eps=1e-9") == pytest.approx(1e-9)
    with pytest.raises(ValueError, match=r"adamw needs eps > 0 .*got 0.0; leave it unset"):
        eps_of("optimizer.name=adamw", "optimizer.eps=0.0")
    with pytest.raises(ValueError, match=r"optimizer.eps: expected a float or None, got 'abc'"):
        eps_of("optimizer.eps=abc")
