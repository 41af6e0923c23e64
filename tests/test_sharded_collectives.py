"""Every reduce-scatter and all-gather schedule against lax.psum_scatter and lax.all_gather."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdist import meshes
from jaxdist.comm import collectives
from jaxdist.comm.collectives import sharded
from jaxdist.training import sharding
from tests.test_collectives import axes_of, per_device_each, random_rows

# Every mesh shape the allreduce tests use, with the algorithms that run over its axes.
MESHES = {
    "ring-8": (lambda: meshes.ring(8), ("native", "ring", "bidirectional_ring")),
    "ring-3": (lambda: meshes.ring(3), ("ring", "bidirectional_ring")),
    "ring-2": (lambda: meshes.ring(2), ("ring", "bidirectional_ring")),
    "torus-4x2": (
        lambda: meshes.torus2d(4, 2),
        ("ring", "bidirectional_ring", "torus2d", "hierarchical"),
    ),
    "torus-2x4": (lambda: meshes.torus2d(2, 4), ("torus2d", "hierarchical")),
    "torus-1x4": (lambda: meshes.torus2d(1, 4), ("torus2d",)),
    "torus-3x2": (lambda: meshes.torus2d(3, 2), ("torus2d", "bidirectional_ring")),
    "torus-2x2x2": (lambda: meshes.torus3d(2, 2, 2), ("torus3d",)),
    "torus-1x2x4": (lambda: meshes.torus3d(1, 2, 4), ("torus3d",)),
    "torus-2x4x1": (lambda: meshes.torus3d(2, 4, 1), ("torus3d",)),
}


@pytest.mark.parametrize("chunk", [7, 42])  # odd and short; even and past the window alignment
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_halves_equal_xlas_on_every_mesh(mesh_name, chunk):
    make_mesh, algorithms = MESHES[mesh_name]
    mesh = make_mesh()
    axes = axes_of(mesh)
    p = mesh.devices.size
    size = p * chunk - 1  # not a multiple of p: padded to p chunks
    x = random_rows(p, (size,))
    pad = 1
    options = {"hierarchical": {"inter_algorithm": "bidirectional_ring"}}

    def scatter(name):
        return lambda v: collectives.reduce_scatter(v, axes, name, **options.get(name, {}))

    def gather(name):
        return lambda v: collectives.all_gather(
            lax.psum_scatter(jnp.pad(v, (0, pad)), axes, tiled=True),
            axes,
            name,
            **options.get(name, {}),
        )

    fns = {f"rs-{n}": scatter(n) for n in algorithms} | {f"ag-{n}": gather(n) for n in algorithms}
    fns["rs-xla"] = lambda v: lax.psum_scatter(jnp.pad(v, (0, pad)), axes, tiled=True)
    fns["ag-xla"] = lambda v: lax.all_gather(fns["rs-xla"](v), axes, tiled=True)
    out = per_device_each(mesh, fns, x)
    padded = np.pad(x.astype(np.float64).sum(0), (0, pad))
    np.testing.assert_allclose(out["rs-xla"].reshape(-1), padded, rtol=1e-5, atol=1e-5)
    for name in algorithms:
        # The chunk each device keeps is XLA's, to float32 rounding of a different sum order.
        np.testing.assert_allclose(
            out[f"rs-{name}"], out["rs-xla"], rtol=1e-5, atol=1e-5, err_msg=name
        )
        # A gather moves values, it adds nothing: the same bits as XLA's.
        np.testing.assert_array_equal(out[f"ag-{name}"], out["ag-xla"], err_msg=name)


def test_mean_and_bfloat16_transfer():
    mesh = meshes.torus2d(2, 4)
    axes = ("y", "x")
    x = random_rows(8, (64,))
    out = per_device_each(
        mesh,
        {
            "mean": lambda v: collectives.reduce_scatter(v, axes, "torus2d", op="mean"),
            "bf16": lambda v: collectives.reduce_scatter(
                v, axes, "torus2d", transfer_dtype=jnp.bfloat16
            ),
            "bf16-native": lambda v: collectives.reduce_scatter(
                v, axes, "native", transfer_dtype=jnp.bfloat16
            ),
            "gather-divided": lambda v: collectives.all_gather(v[:8], "x", "ring", divisor=4),
        },
        x,
    )
    total = x.astype(np.float64).sum(0)
    np.testing.assert_allclose(out["mean"].reshape(-1), total / 8, rtol=1e-5, atol=1e-6)
    assert out["bf16"].dtype == np.float32  # sent in bf16, summed in float32
    np.testing.assert_allclose(out["bf16"].reshape(-1), total, rtol=0, atol=0.1)
    # XLA's own reduce-scatter sums in the dtype it is handed: every value of the sum is a
    # bfloat16 one, given back in the gradient's float32.
    native = out["bf16-native"].reshape(-1)
    assert native.dtype == np.float32
    np.testing.assert_array_equal(native, native.astype(jnp.bfloat16).astype(np.float32))
    assert np.any(total.astype(np.float32) != total.astype(np.float32).astype(jnp.bfloat16))
    np.testing.assert_allclose(native, total, rtol=0, atol=0.1)
    for i in range(8):
        row = i // 4  # x-ring of this device's row
        np.testing.assert_array_equal(
            out["gather-divided"][i], x[4 * row : 4 * row + 4, :8].reshape(-1) / 4
        )


def test_schedules_without_halves_are_refused_in_one_line():
    mesh = meshes.ring(4)
    with pytest.raises(
        ValueError,
        match=r"halving_doubling has no reduce-scatter and all-gather "
        r"of its own; those that do: native, ring",
    ):
        per_device_each(
            mesh,
            {"x": lambda v: collectives.reduce_scatter(v, "x", "halving_doubling")},
            random_rows(4, (8,)),
        )
    with pytest.raises(ValueError, match=r"torus2d needs a tuple of two axis names"):
        per_device_each(
            mesh, {"x": lambda v: collectives.all_gather(v, "x", "torus2d")}, random_rows(4, (8,))
        )
    reason = collectives.sharded_unsupported(
        "hierarchical", (2, 4), inter_algorithm="parameter_server"
    )
    assert "hierarchical's halves run ring or bidirectional_ring across hosts" in reason


def test_sharded_cost_is_half_the_rings_and_levels_shrink():
    ring = collectives.get("ring").terms((8,))
    (half,) = collectives.sharded_terms("ring", (8,))
    assert half.steps * 2 == ring[0].steps and half.volume * 2 == ring[0].volume
    inner, outer = collectives.sharded_terms("torus2d", (4, 2))
    assert (inner.link_class, inner.steps, inner.volume) == ("intra", 1, 0.5)
    assert (outer.link_class, outer.steps, outer.volume) == ("inter", 3, 0.75 / 2)
    # Bandwidth of the flat ring, latency of the levels: (XY - 1) / XY of the buffer sent.
    terms = collectives.sharded_terms("torus3d", (4, 2, 2))
    assert sum(t.volume for t in terms) == pytest.approx(15 / 16)
    assert sum(t.steps for t in terms) == 3 + 1 + 1
    assert collectives.sharded_terms("bidirectional_ring", (8,))[0].lanes == 2
    assert collectives.sharded_terms("ring", (1,)) == []


def test_bidirectional_halves_send_both_ways():
    mesh = meshes.ring(4)
    spec = jax.sharding.PartitionSpec("x")
    body = jax.shard_map(
        lambda v: collectives.reduce_scatter(v[0], "x", "bidirectional_ring")[None],
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
    )
    text = jax.jit(body).lower(np.zeros((4, 64), np.float32)).as_text()
    pairs = set()
    for line in text.splitlines():
        if "collective_permute" in line and "source_target_pairs" in line:
            pairs.add(line.split("source_target_pairs = ")[1].split(">")[0][:40])
    assert len(pairs) == 2, pairs  # clockwise and counter-clockwise
    assert sharded._second_half_order(4).tolist() == [0, 3, 2, 1]


def test_native_reduce_scatters_each_gradient_of_a_unit_with_the_flat_rings_values():
    """FSDP's unit of two parameters (split on different dimensions): XLA's own
    reduce-scatter takes each gradient on its own (no unit-sized concatenation), the gather
    one buffer, and both give the values the ring's one flat buffer gives."""
    mesh = meshes.ring(8)
    axes = axes_of(mesh)
    rng = np.random.default_rng(0)
    whole = [jnp.asarray(rng.normal(size=(16, 3)), jnp.float32)]
    whole.append(jnp.asarray(rng.normal(size=(5, 24)), jnp.float32))
    dims = [0, 1]
    specs = (P(axes), P(None, axes))

    def round_trip(algorithm):
        def body(a, b):
            gathered = sharding.gather_unit([a, b], dims, axes, algorithm, {})
            doubled = [2.0 * g for g in gathered]
            return tuple(sharding.scatter_unit(doubled, dims, axes, algorithm, {}))

        run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))
        return run, run(*whole)

    native, native_out = round_trip("native")
    _, ring_out = round_trip("ring")
    for got, ring, w in zip(native_out, ring_out, whole):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ring))
        np.testing.assert_allclose(np.asarray(got), 16.0 * np.asarray(w), rtol=1e-6)
    lowered = native.lower(*whole).as_text()
    assert lowered.count('"stablehlo.all_gather"') == 1
    assert lowered.count('"stablehlo.reduce_scatter"') == 2
