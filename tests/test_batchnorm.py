"""Cross-replica BatchNorm: group statistics against flax's BatchNorm on each group's images,
and the bytes a group's exchange moves."""

import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.training.batchnorm import CrossReplicaBatchNorm, replica_mean

ROWS_PER_DEVICE = 3
FEATURES = 5

# (mesh shape, data axes, group size): recursive doubling (2, 4, over two axes), the ring
# (3 of 6), the whole axis, and each device alone.
CASES = [
    ((8,), "data", 2),
    ((8,), "data", 4),
    ((6,), "data", 3),
    ((4, 2), ("y", "x"), 4),
    ((8,), "data", None),
    ((8,), "data", 1),
]


def _mesh(shape, axes):
    names = (axes,) if isinstance(axes, str) else axes
    devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names)


def _inputs(num_devices):
    x = jax.random.normal(jax.random.key(0), (num_devices * ROWS_PER_DEVICE, FEATURES)) * 3 + 1
    weights = jax.random.normal(jax.random.key(1), x.shape)
    variables = nn.BatchNorm(use_running_average=False).init(jax.random.key(2), x)
    params = {
        "scale": jax.random.uniform(jax.random.key(3), (FEATURES,)) + 0.5,
        "bias": jax.random.normal(jax.random.key(4), (FEATURES,)),
    }
    return x, weights, {**variables, "params": params}


@pytest.mark.parametrize("check_vma", [True, False], ids=["permutes", "grouped-all-reduce"])
@pytest.mark.parametrize("shape, axes, group_size", CASES)
def test_group_statistics_equal_flax_batchnorm_on_each_group(shape, axes, group_size, check_vma):
    """Outputs, input and parameter gradients and running statistics equal flax's BatchNorm
    applied to each group's images on one device, by either route (permutes where shard_map
    checks varying axes, a grouped all-reduce where it does not); every device of a group
    holds the same running statistics (up to the rounding of a fused multiply-add)."""
    mesh = _mesh(shape, axes)
    devices = mesh.size
    x, weights, variables = _inputs(devices)
    norm = CrossReplicaBatchNorm(axis_name=axes, group_size=group_size)

    def device_loss(params, x, weights, batch_stats):
        y, updates = norm.apply(
            {"params": params, "batch_stats": batch_stats},
            x,
            use_running_average=False,
            mutable=["batch_stats"],
        )
        return jnp.sum(y * weights), (y, updates["batch_stats"])

    def body(params, x, weights, batch_stats):
        (_, (y, stats)), (d_params, d_x) = jax.value_and_grad(
            device_loss, argnums=(0, 1), has_aux=True
        )(params, x, weights, batch_stats)
        stats = jax.tree.map(lambda s: s[None], stats)  # one row per device
        if not check_vma:  # without varying-axis types, autodiff leaves each device's part
            d_params = jax.lax.psum(d_params, axes)
        # With them, the replicated parameters' gradient comes out summed over devices.
        return y, d_x, d_params, stats

    data = P(axes)
    run = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), data, data, P()),
            out_specs=(data, data, P(), data),
            check_vma=check_vma,
        )
    )
    put = lambda a: jax.device_put(a, NamedSharding(mesh, data))  # noqa: E731
    y, d_x, d_params, stats = run(
        variables["params"], put(x), put(weights), variables["batch_stats"]
    )

    k = group_size or devices
    groups = devices // k

    def reference_loss(params, x):
        def one_group(x_group, w_group):
            y, updates = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5).apply(
                {"params": params, "batch_stats": variables["batch_stats"]},
                x_group,
                mutable=["batch_stats"],
            )
            return jnp.sum(y * w_group), (y, updates["batch_stats"])

        rows = k * ROWS_PER_DEVICE
        losses, (ys, group_stats) = jax.vmap(one_group)(
            x.reshape(groups, rows, FEATURES), weights.reshape(groups, rows, FEATURES)
        )
        return losses.sum(), (ys.reshape(x.shape), group_stats)

    (_, (want_y, want_stats)), (want_d_params, want_d_x) = jax.value_and_grad(
        reference_loss, argnums=(0, 1), has_aux=True
    )(variables["params"], x)

    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_x, want_d_x, rtol=1e-4, atol=1e-5)
    for name in ("scale", "bias"):
        np.testing.assert_allclose(d_params[name], want_d_params[name], rtol=1e-4, atol=1e-5)
    for name in ("mean", "var"):
        per_device = np.asarray(stats[name]).reshape(groups, k, FEATURES)
        for group in per_device:
            for device_row in group[1:]:
                np.testing.assert_allclose(device_row, group[0], rtol=2e-7, atol=0)
        np.testing.assert_allclose(per_device[:, 0], want_stats[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("group_size", [None, 1, 2, 4])
def test_replica_mean_groups(group_size):
    mesh = _mesh((8,), "x")
    values = np.arange(8, dtype=np.float32)[:, None] * np.ones((8, 3), np.float32)
    sharded = jax.device_put(values, NamedSharding(mesh, P("x")))
    out = jax.jit(
        jax.shard_map(
            lambda v: replica_mean(v, "x", group_size),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
        )
    )(sharded)
    k = group_size or 8
    expected = np.repeat(values.reshape(8 // k, k, 3).mean(1), k, axis=0)
    np.testing.assert_allclose(np.asarray(out), expected)


@pytest.mark.parametrize("group_size, exchanges", [(2, 1), (4, 2), (8, None), (3, 2)])
def test_a_group_exchanges_its_own_statistics_only(group_size, exchanges):
    """A group's statistics travel inside the group, forward and backward, never as an
    all-gather over the whole axis: by permutes where shard_map checks varying axes (each
    device sends log2(k) messages for a power of two, k - 1 otherwise), else by an
    all-reduce over groups of k."""
    devices = 6 if group_size == 3 else 8
    mesh = _mesh((devices,), "data")
    stats = jax.ShapeDtypeStruct(
        (devices * 2, 64), jnp.float32, sharding=NamedSharding(mesh, P("data"))
    )

    def lowered(check_vma):
        def loss(s):
            return jnp.sum(jnp.sin(replica_mean(s, "data", group_size)))

        body = jax.shard_map(
            jax.grad(loss), mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=check_vma
        )
        return jax.jit(body).lower(stats).as_text()

    permuted, grouped = lowered(True), lowered(False)
    for text in (permuted, grouped):
        assert "all_gather" not in text and "all-gather" not in text
    permutes = permuted.count("collective_permute")
    if exchanges is None:  # the whole axis: an all-reduce of the statistics' size
        assert permutes == 0 and permuted.count("all_reduce") == 1, permuted.count("all_reduce")
        return
    assert permutes == 2 * exchanges, f"expected {2 * exchanges} permutes, found {permutes}"
    for pairs in _permute_pairs(permuted):
        assert all(a // group_size == b // group_size for a, b in pairs), pairs
    assert "collective_permute" not in grouped
    groups = re.findall(r"replica_groups = dense<(\[\[.*?\]\])>", grouped)
    assert groups, "no grouped all-reduce"
    want = [list(range(s, s + group_size)) for s in range(0, devices, group_size)]
    for found in groups:
        assert json.loads(found) == want, found


def _permute_pairs(text):
    for match in re.finditer(r"source_target_pairs = dense<\[(.*?)\]\>", text):
        yield [tuple(map(int, pair)) for pair in re.findall(r"\[(\d+), (\d+)\]", match.group(1))]
