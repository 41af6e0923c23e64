"""ResNet v1.5: parameter counts (abstractly), options, and real compute on tiny widths."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import models
from jaxdist.models import PointwiseConv, ResNet

# torchvision's counts for the same architectures (conv kernels without bias, BN scale and
# offset, classifier kernel and bias; running statistics are not parameters).
TORCHVISION_PARAM_COUNTS = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
}


def count_by_hand(block: str, stage_sizes, num_classes=1000, width=64, in_channels=3) -> int:
    """Parameter count of a ResNet from its architecture alone, independent of flax.

    Every conv has no bias and is followed by a norm with 2 parameters per channel.
    ResNet-50 worked through: stem 7·7·3·64 + 2·64 = 9,536; stage blocks sum to 23,498,496
    (the first block of each stage carries a 1x1 projection shortcut); head 2048·1000 + 1000 =
    2,049,000; total 25,557,032, torchvision's count for v1.5 (v1 and v1.5 differ only in
    where the stride sits, not in shapes).
    """

    def conv_norm(k, cin, cout):
        return k * k * cin * cout + 2 * cout

    total = conv_norm(7, in_channels, width)
    channels = width
    expansion = 4 if block == "bottleneck" else 1
    for stage, num_blocks in enumerate(stage_sizes):
        filters = width * 2**stage
        for index in range(num_blocks):
            if block == "bottleneck":
                total += conv_norm(1, channels, filters)
                total += conv_norm(3, filters, filters)
                total += conv_norm(1, filters, filters * 4)
            else:
                total += conv_norm(3, channels, filters) + conv_norm(3, filters, filters)
            needs_projection = (stage > 0 and index == 0) or channels != filters * expansion
            if needs_projection:
                total += conv_norm(1, channels, filters * expansion)
            channels = filters * expansion
    return total + channels * num_classes + num_classes


@pytest.mark.parametrize("name", sorted(TORCHVISION_PARAM_COUNTS))
def test_param_count_matches_torchvision_and_hand_count(name):
    block, stage_sizes = models.ARCHITECTURES[name]
    expected = TORCHVISION_PARAM_COUNTS[name]
    assert count_by_hand(block, stage_sizes) == expected, "hand count disagrees with torchvision"
    found = models.param_count(models.create(name, num_classes=1000), (1, 224, 224, 3))
    assert found == expected, f"{name}: expected {expected:,} parameters, found {found:,}"


def test_resnet10_is_one_basic_block_per_stage():
    """ResNet-10 is not torchvision's; its count is the architecture's, by hand."""
    assert models.ARCHITECTURES["resnet10"] == ("basic", (1, 1, 1, 1))
    found = models.param_count(models.create("resnet10", num_classes=1000), (1, 224, 224, 3))
    assert found == count_by_hand("basic", (1, 1, 1, 1)) == 5_418_792


def test_resnet50_is_25_6m_and_gives_imagenet_logits():
    model = models.resnet50()
    variables = models.param_shapes(model, (2, 224, 224, 3))
    logits = jax.eval_shape(
        lambda v, x: model.apply(v, x, train=False),
        variables,
        jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32),
    )
    assert logits.shape == (2, 1000)
    assert models.param_count(model) == 25_557_032


def test_bottleneck_downsamples_in_the_3x3_conv():
    """v1.5: the first block of stage 2 keeps the resolution through conv1 (1x1) and halves
    it in conv2 (3x3)."""
    model = models.resnet50(width=8, num_classes=10)
    variables = models.param_shapes(model, (1, 64, 64, 3))
    _, state = jax.eval_shape(
        lambda v, x: model.apply(v, x, train=False, capture_intermediates=True),
        variables,
        jax.ShapeDtypeStruct((1, 64, 64, 3), jnp.float32),
    )
    block = state["intermediates"]["stage2_block1"]
    stage_input = state["intermediates"]["stage1_block3"]["__call__"][0].shape
    assert stage_input[1:3] == (16, 16)  # 64 -> stem conv /2 -> max-pool /2
    assert block["conv1"]["__call__"][0].shape[1:3] == (16, 16)
    assert block["conv2"]["__call__"][0].shape[1:3] == (8, 8)
    assert block["shortcut_conv"]["__call__"][0].shape[1:3] == (8, 8)


@pytest.mark.parametrize("strides, size", [(1, 6), (2, 6), (2, 7), (3, 7)])
@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_pointwise_conv_is_a_1x1_conv(strides, size, dtype, rtol):
    """Same parameter (name, shape, initial value) and the same function as a bias-free
    ``VALID`` 1x1 ``nn.Conv``, also strided over odd sizes and in bf16."""
    x = jax.random.normal(jax.random.key(1), (2, size, size, 5))
    conv = nn.Conv(3, (1, 1), strides, "VALID", use_bias=False, dtype=dtype)
    pointwise = PointwiseConv(3, strides, dtype=dtype, kernel_init=nn.initializers.lecun_normal())
    conv_vars = conv.init(jax.random.key(0), x)
    point_vars = pointwise.init(jax.random.key(0), x)
    assert jax.tree.map(np.shape, point_vars) == jax.tree.map(np.shape, conv_vars)
    np.testing.assert_array_equal(point_vars["params"]["kernel"], conv_vars["params"]["kernel"])
    expected = conv.apply(conv_vars, x)
    found = pointwise.apply(conv_vars, x)
    assert found.shape == expected.shape and found.dtype == expected.dtype
    np.testing.assert_allclose(
        np.asarray(found, np.float32), np.asarray(expected, np.float32), rtol=rtol, atol=rtol
    )


@pytest.mark.parametrize("strides", [(2, 2), 0])
def test_pointwise_conv_rejects_strides_that_are_not_one_positive_int(strides):
    x = jnp.ones((1, 4, 4, 3))
    with pytest.raises(ValueError, match=r"strides must be a positive int.*got"):
        PointwiseConv(2, strides).init(jax.random.key(0), x)


@pytest.mark.parametrize("block", ["basic", pytest.param("bottleneck", marks=pytest.mark.slow)])
def test_pointwise_matmul_keeps_the_parameters_and_the_function(block):
    """``pointwise_matmul`` changes how 1x1 convolutions are computed, nothing else: the
    same variables from the same key, the same logits and gradients (two stages, so the
    strided projection shortcut is in it too)."""
    x = jax.random.normal(jax.random.key(1), (2, 12, 12, 3))
    fields = dict(stage_sizes=(1, 1), block=block, width=4, num_classes=5, stem="small")
    as_matmul = ResNet(**fields)
    as_conv = ResNet(**fields, pointwise_matmul=False)
    variables = as_matmul.init(jax.random.key(0), x, train=False)
    conv_variables = as_conv.init(jax.random.key(0), x, train=False)
    jax.tree.map(np.testing.assert_array_equal, variables, conv_variables)

    @functools.partial(jax.jit, static_argnums=0)
    def loss_and_grads(model, params):
        def loss(params):
            return jnp.sum(model.apply({**variables, "params": params}, x, train=False) ** 2)

        return jax.value_and_grad(loss)(params)

    value, grads = loss_and_grads(as_matmul, variables["params"])
    conv_value, conv_grads = loss_and_grads(as_conv, variables["params"])
    np.testing.assert_allclose(value, conv_value, rtol=1e-5)
    conv_by_path = dict(jax.tree_util.tree_leaves_with_path(conv_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        conv_g = np.asarray(conv_by_path[path])
        scale = float(np.abs(conv_g).max()) or 1.0
        np.testing.assert_allclose(g, conv_g, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def _norm_scales(params):
    return {
        "/".join(str(k.key) for k in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if path[-1].key == "scale"
    }


@pytest.mark.parametrize("block, last_norm", [("basic", "norm2"), ("bottleneck", "norm3")])
@pytest.mark.parametrize("zero_init", [True, False])
def test_zero_init_last_bn_scale(block, last_norm, zero_init):
    model = ResNet(
        stage_sizes=(2, 1),
        block=block,
        width=4,
        num_classes=3,
        stem="small",
        zero_init_last_bn_scale=zero_init,
    )
    params = model.init(jax.random.key(0), jnp.ones((1, 8, 8, 3)), train=False)["params"]
    scales = _norm_scales(params)
    last = {k: v for k, v in scales.items() if k.endswith(f"{last_norm}/scale")}
    others = {k: v for k, v in scales.items() if k not in last}
    assert len(last) == 3, f"expected one last norm per block (3), found {sorted(last)}"
    expected = 0.0 if zero_init else 1.0
    for path, scale in last.items():
        assert np.all(np.asarray(scale) == expected), (
            f"{path}: expected all {expected}, found {scale}"
        )
    assert others, "expected the other norms' scales too"
    for path, scale in others.items():
        assert np.all(np.asarray(scale) == 1.0), f"{path}: expected ones, found {scale}"


def test_bf16_compute_keeps_float32_params():
    model = models.resnet50(dtype=jnp.bfloat16)
    variables = models.param_shapes(model, (2, 224, 224, 3))
    logits = jax.eval_shape(
        lambda v, x: model.apply(v, x, train=False),
        variables,
        jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32),
    )
    assert logits.dtype == jnp.bfloat16, f"expected bf16 logits, found {logits.dtype}"
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(variables)}
    assert dtypes == {jnp.dtype(jnp.float32)}, f"expected only float32 variables, found {dtypes}"


@pytest.mark.slow  # a ResNet trained to a loss: about 15 s
def test_small_stem_trains_on_28x28():
    model = models.resnet18(width=4, num_classes=10, stem="small")
    images = jax.random.normal(jax.random.key(1), (4, 28, 28, 1))
    labels = jnp.array([0, 3, 7, 9])
    variables = model.init(jax.random.key(0), images, train=False)

    def loss_fn(params):
        logits, updates = model.apply(
            {"params": params, "batch_stats": variables["batch_stats"]},
            images,
            train=True,
            mutable=["batch_stats"],
        )
        one_hot = jax.nn.one_hot(labels, 10)
        return -jnp.mean(jnp.sum(one_hot * jax.nn.log_softmax(logits), -1)), (logits, updates)

    (loss, (logits, updates)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        variables["params"]
    )
    assert logits.shape == (4, 10)
    assert np.isfinite(float(loss))
    grad_leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grad_leaves)
    assert any(float(jnp.abs(g).max()) > 0 for g in grad_leaves), "all gradients are zero"
    # Training mode updates the running statistics (they start at mean 0 / var 1).
    old = jax.tree.leaves(variables["batch_stats"])
    new = jax.tree.leaves(updates["batch_stats"])
    assert any(not np.allclose(a, b) for a, b in zip(old, new, strict=True))


def _tiny(norm=models.default_norm):
    return ResNet(
        stage_sizes=(1, 1), block="basic", width=4, num_classes=3, stem="small", norm=norm
    )


def test_cross_replica_batchnorm_under_shard_map_matches_full_batch():
    """Built with ``axis_name``, BatchNorm inside shard_map normalises over the global batch:
    logits and running statistics equal those of one device seeing the whole batch."""
    mesh = jax.make_mesh((8,), ("data",))
    images = jax.random.normal(jax.random.key(2), (16, 6, 6, 3))
    variables = _tiny().init(jax.random.key(0), images, train=False)
    reference_logits, reference_stats = _tiny().apply(
        variables, images, train=True, mutable=["batch_stats"]
    )

    def sharded_forward(norm, check_vma):
        def body(variables, images):
            return _tiny(norm).apply(variables, images, train=True, mutable=["batch_stats"])

        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(), P("data")),
                out_specs=(P("data"), P()),
                check_vma=check_vma,
            )
        )(variables, jax.device_put(images, NamedSharding(mesh, P("data"))))

    synced = functools.partial(nn.BatchNorm, momentum=0.9, epsilon=1e-5, axis_name="data")
    logits, stats = sharded_forward(synced, check_vma=True)
    np.testing.assert_allclose(logits, reference_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(reference_stats), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # Control: per-device BatchNorm (2 images each) gives different logits.
    local_logits, _ = sharded_forward(models.default_norm, check_vma=False)
    assert not np.allclose(local_logits, reference_logits, atol=1e-3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stem": "cifar"}, "stem must be one of"),
        ({"block": "wide"}, "block must be one of"),
        ({"width": 0}, "width must be a positive integer"),
        ({"stage_sizes": ()}, "stage_sizes must be a non-empty"),
    ],
)
def test_bad_config_is_rejected(kwargs, message):
    config = {"stage_sizes": (1, 1), **kwargs}
    with pytest.raises(ValueError, match=message):
        ResNet(**config)


def test_unknown_model_and_bad_input_rank():
    with pytest.raises(ValueError, match="unknown model 'resnet51'"):
        models.create("resnet51")
    with pytest.raises(ValueError, match=r"got shape \(8, 8, 3\)"):
        _tiny().init(jax.random.key(0), jnp.ones((8, 8, 3)), train=False)
