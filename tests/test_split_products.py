"""A parameter split over the tensor axis reaches only products that sum over it: an NNX
MLP-Mixer multiplying its split MLP kernels with plain ``nnx.Linear`` is refused in one line
naming the kernel and the product; the same model through ``column_product`` and
``row_product`` trains as one device; and the reader of the traced loss follows a split
parameter through scans, reshapes and elementwise arithmetic to the sum that drops the
axis."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from jaxdist.comm import tensor_parallel as tp
from jaxdist.models.nnx_model import NnxModel
from jaxdist.training import logical_axes
from jaxdist.training.split_products import SplitProductError, check_split_products
from jaxdist.training.train_step import TrainStep

TOKENS, WIDTH, HIDDEN, CLASSES = 8, 16, 32, 4


class _Mlp(nnx.Module):
    """Two dense layers; ``split``: through the products that sum over the tensor axis."""

    def __init__(self, width: int, split: bool, rngs: nnx.Rngs):
        self.up = nnx.Linear(width, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, width, rngs=rngs)
        self.split = split

    def __call__(self, x):
        if not self.split:
            return self.down(jax.nn.gelu(self.up(x)))
        (h,) = tp.column_product(x, [self.up.kernel[...]])
        h = jax.nn.gelu(h + self.up.bias[...])
        return tp.row_product(h, self.down.kernel[...]) + self.down.bias[...]


class _Mixer(nnx.Module):
    """An MLP-Mixer block and a classifier head (Tolstikhin et al.)."""

    def __init__(self, split: bool, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.token_mlp = _Mlp(TOKENS, split, rngs)
        self.channel_mlp = _Mlp(WIDTH, split, rngs)
        self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

    def __call__(self, x):  # x: [batch, tokens, width]
        x = x + jnp.swapaxes(self.token_mlp(jnp.swapaxes(self.norm(x), 1, 2)), 1, 2)
        x = x + self.channel_mlp(self.norm(x))
        return self.head(x.mean(1))


def _names(params):
    """The MLP's hidden units named ``mlp`` (split over tensor by the default rules)."""
    mlp = {"up": {"kernel": (None, "mlp"), "bias": ("mlp",)}}
    mlp["down"] = {"kernel": ("mlp", None), "bias": (None,)}
    names = jax.tree.map(lambda p: (None,) * p.ndim, params)
    return {**names, "token_mlp": mlp, "channel_mlp": mlp}


def _train(split: bool, mesh: Mesh, tensor: bool):
    model = NnxModel(_Mixer(split, nnx.Rngs(0)))
    params, model_state = model.variables()

    def loss_fn(params, model_state, batch, rng):
        logits, model_state = model.apply(params, model_state, batch["x"], rng=rng)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, (model_state, {})

    split_over = None
    if tensor:
        size = mesh.shape["tensor"]
        rules = logical_axes.DEFAULT_RULES
        split_over = tp.TensorParallel(
            logical_axes.split_dims(_names(params), rules, "tensor", params, size)
        )
    step = TrainStep(loss_fn, optax.adam(1e-2), mesh, data_axes="data", tensor=split_over)
    state = step.init(params, model_state)
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.standard_normal((16, TOKENS, WIDTH)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, CLASSES, 16)),
    }
    losses = []
    for _ in range(3):
        state, metrics = step(state, step.shard_batch(batch), jax.random.key(1))
        losses.append(float(metrics["loss"]))
    return losses, state.params


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: math.prod(shape)]).reshape(shape), names)


def test_a_mixer_of_plain_dense_layers_split_over_tensor_is_refused_at_its_first_trace():
    with pytest.raises(SplitProductError) as refused:
        _train(split=False, mesh=_mesh((2, 4), ("data", "tensor")), tensor=True)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("token_mlp.up.kernel is split over 'tensor'")
    assert "dot_general" in message and "Linear.__call__" in message
    assert "test_split_products.py" in message  # the model's own line that called it


def test_the_same_mixer_through_the_summing_products_trains_as_one_device():
    """Adam, three steps, on data=2 x tensor=4 against one device."""
    one, expected = _train(split=True, mesh=_mesh((1,), ("data",)), tensor=False)
    split, params = _train(split=True, mesh=_mesh((2, 4), ("data", "tensor")), tensor=True)
    np.testing.assert_allclose(split, one, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- the reader

SIZES = {"tensor": 2}
W = jax.ShapeDtypeStruct((4, 8), jnp.float32)  # a block split on dimension 1
X = jax.ShapeDtypeStruct((3, 4), jnp.float32)


def _check(loss, params, dims):
    with tp.splitting("tensor", "native"):
        check_split_products(loss, params, dims, (X,), "tensor", SIZES)


def test_a_split_kernel_in_a_scan_reaches_a_plain_product_through_a_cast_and_reshape():
    stacked = jax.ShapeDtypeStruct((2, 4, 8), jnp.float32)

    def loss(params, x):
        def layer(h, kernel):
            flat = kernel.astype(jnp.bfloat16).reshape(4, 8)
            return jnp.tanh(h @ flat[:, :4].astype(jnp.float32)), None

        return jax.lax.scan(layer, x, params["w"])[0].sum()

    with pytest.raises(SplitProductError, match=r"^w is split over 'tensor', but a plain dot"):
        _check(loss, {"w": stacked}, {"w": 2})


def test_a_penalty_summed_over_the_split_dimension_is_refused():
    def loss(params, x):
        (h,) = tp.column_product(x, [params["w"]])
        return h.sum() + 1e-3 * jnp.sum(jnp.square(params["w"]))

    with pytest.raises(SplitProductError, match="a reduce_sum along its split dimension"):
        _check(loss, {"w": W}, {"w": 1})


def test_a_split_bias_contracted_along_its_split_dimension_is_refused():
    def loss(params, x):
        (h,) = tp.column_product(x, [params["w"]])
        shifted = h + params["b"]  # this device's units, still split
        return jnp.sum(shifted @ jnp.ones((8, 2)))

    params = {"w": W, "b": jax.ShapeDtypeStruct((8,), jnp.float32)}
    with pytest.raises(SplitProductError, match=r"^b is split .* contracting its split dim"):
        _check(loss, params, {"w": 1, "b": 0})


def test_the_summing_products_and_work_on_a_devices_own_units_pass():
    """A split bias on the column output, a softmax over the units' positions, then the
    row-parallel sum; a whole parameter used anywhere."""

    def loss(params, x):
        (h,) = tp.column_product(x, [params["w"]])
        h = jax.nn.softmax(h + params["b"], axis=0)  # along the rows, not the split units
        return jnp.sum(tp.row_product(h, params["v"]) @ params["whole"])

    params = {
        "w": W,
        "b": jax.ShapeDtypeStruct((8,), jnp.float32),
        "v": jax.ShapeDtypeStruct((8, 4), jnp.float32),
        "whole": jax.ShapeDtypeStruct((4, 2), jnp.float32),
    }
    _check(loss, params, {"w": 1, "b": 0, "v": 0, "whole": None})
