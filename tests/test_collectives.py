"""Every allreduce schedule against psum, on 1-D and 2-D meshes, sizes, dtypes and pytrees."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import meshes
from jaxdist.comm import collectives
from jaxdist.comm.collectives import ring_steps, windows
from jaxdist.comm.collectives import wire as wire_module

ONE_D = ("native", "ring", "bidirectional_ring", "halving_doubling", "parameter_server")
# Every algorithm that runs over the two axes of a 2-D mesh (torus3d needs three).
ON_TWO_AXES = tuple(a for a in collectives.ALGORITHMS if a not in collectives.THREE_LEVEL)


def per_device(mesh, fn, *xs):
    """Run ``fn`` on each device's row of the ``(p, ...)`` inputs; return ``(p, ...)`` outputs."""
    names = tuple(mesh.axis_names)
    spec = P(names)
    args = jax.device_put(xs, NamedSharding(mesh, spec))
    body = jax.shard_map(
        lambda *vs: jax.tree.map(lambda o: o[None], fn(*jax.tree.map(lambda v: v[0], vs))),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
    )
    return jax.tree.map(np.asarray, jax.jit(body)(*args))


def per_device_each(mesh, fns, *xs):
    """Every function of ``fns`` (name -> fn) on each device's rows, all in one program (one
    compile per mesh instead of one per function); name -> ``(p, ...)`` outputs."""
    outputs = per_device(mesh, lambda *vs: [fn(*vs) for fn in fns.values()], *xs)
    return dict(zip(fns, outputs))


def axes_of(mesh):
    names = tuple(mesh.axis_names)
    return names[0] if len(names) == 1 else names


def random_rows(p, shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal((p, *shape)).astype(dtype)


def compiled_text(mesh, algorithm, count, op="sum", donate=True):
    """The optimized program of ``allreduce`` over both axes of a 2-D ``mesh`` on a
    ``(count,)`` buffer per device, its input donated unless ``donate`` is False."""
    spec = P(("y", "x"))
    body = jax.shard_map(
        lambda v: collectives.allreduce(v[0], ("y", "x"), algorithm, op=op)[None],
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
    )
    x = jax.device_put(random_rows(8, (count,)), NamedSharding(mesh, spec))
    return jax.jit(body, donate_argnums=0 if donate else ()).lower(x).compile().as_text()


def assert_allreduced(out, x, op="sum", rtol=1e-6, atol=1e-5, what=""):
    """Every device's output equals the float64 sum (or mean) over devices."""
    expected = x.astype(np.float64).sum(0)
    if op == "mean":
        expected = expected / x.shape[0]
    for device, row in enumerate(out):
        np.testing.assert_allclose(
            row.astype(np.float64),
            expected,
            rtol=rtol,
            atol=atol,
            err_msg=f"{what}: device {device} holds a wrong result",
        )


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_one_dimensional_against_psum(p):
    mesh = meshes.ring(p)
    x = random_rows(p, (10007,))  # a prime: never divides the axis, so padding is exercised
    runnable = [a for a in ONE_D if not (a == "halving_doubling" and p & (p - 1))]
    if len(runnable) < len(ONE_D):
        with pytest.raises(ValueError, match="power-of-two"):
            per_device(mesh, lambda v: collectives.allreduce(v, "x", "halving_doubling"), x)
    fns = {a: lambda v, a=a: collectives.allreduce(v, "x", a) for a in runnable}
    out = per_device_each(mesh, {**fns, "psum": lambda v: jax.lax.psum(v, "x")}, x)
    for algorithm in runnable:
        assert_allreduced(out[algorithm], x, what=algorithm)
        np.testing.assert_allclose(
            out[algorithm], out["psum"], rtol=1e-6, atol=1e-5, err_msg=algorithm
        )


@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (4, 2), (3, 2), (2, 3)])
def test_two_dimensional_meshes(shape):
    mesh = meshes.torus2d(*shape)
    p = mesh.size
    # halving_doubling needs a power-of-two device count
    runnable = [a for a in ON_TWO_AXES if not (a == "halving_doubling" and p & (p - 1))]
    x = random_rows(p, (3, 5, 7))  # a multi-dimensional leaf, 105 elements
    fns = {a: lambda v, a=a: collectives.allreduce(v, ("y", "x"), a) for a in runnable}
    out = per_device_each(mesh, fns, x)
    for algorithm in runnable:
        assert out[algorithm].shape == x.shape, algorithm
        assert_allreduced(out[algorithm], x, what=algorithm)


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 2, 4), (2, 4, 1), (2, 1, 4)])
def test_torus3d_against_psum(shape):
    # A plane of two runs the 2-D torus's pair form, a row of four a ring; an axis of one
    # (outer, middle or inner) has nothing to send. Sum and mean, a prime size, nothing and one element.
    mesh = meshes.torus3d(*shape)
    xs = {size: random_rows(mesh.size, (size,), seed=size) for size in (0, 1, 10007)}
    fns = {
        (op, size, transfer): lambda v, o=op, s=size, t=transfer: collectives.allreduce(
            v[s], ("z", "y", "x"), "torus3d", op=o, transfer_dtype=t
        )
        for op in ("sum", "mean")
        for size in xs
        for transfer in (None, jnp.bfloat16)
    }
    for (op, size, transfer), result in per_device_each(mesh, fns, xs).items():
        what = f"torus3d {op} on {shape}, {size} elements, sent as {transfer}"
        tolerance = {} if transfer is None else {"rtol": 2e-2, "atol": 5e-2}  # 8 mantissa bits
        assert_allreduced(result, xs[size], op, what=what, **tolerance)
        # Every device ends with the same bits, also when messages travel rounded.
        np.testing.assert_array_equal(result, np.broadcast_to(result[0], result.shape), what)


def test_torus3d_needs_three_axes():
    mesh = meshes.torus2d(2, 4)
    with pytest.raises(
        ValueError, match=r"torus3d needs a tuple of three axis names \(outer, middle, inner\)"
    ):
        per_device(
            mesh, lambda v: collectives.allreduce(v, ("y", "x"), "torus3d"), random_rows(8, (3,))
        )
    assert (
        collectives.get("torus3d").unsupported((2, 4))
        == "needs a 3-axis mesh, got axis sizes (2, 4)"
    )


def test_tiny_sizes():
    mesh = meshes.ring(8)
    xs = {size: random_rows(8, (size,)) for size in (0, 1, 7)}
    fns = {
        (algorithm, size): lambda v, a=algorithm, s=size: collectives.allreduce(v[s], "x", a)
        for algorithm in ONE_D
        for size in xs
    }
    for (algorithm, size), result in per_device_each(mesh, fns, xs).items():
        assert_allreduced(result, xs[size], what=f"{algorithm} on {size} elements")


@pytest.mark.parametrize("shape", [(2, 4), (3, 2)])
def test_sizes_two_level(shape):
    mesh = meshes.hierarchical(*shape)
    xs = {size: random_rows(mesh.size, (size,)) for size in (0, 1, 7, 10007)}  # 10007: a prime
    fns = {
        (algorithm, size): lambda v, a=algorithm, s=size: collectives.allreduce(
            v[s], ("host", "local"), a
        )
        for algorithm in ("torus2d", "hierarchical")
        for size in xs
    }
    for (algorithm, size), result in per_device_each(mesh, fns, xs).items():
        assert_allreduced(result, xs[size], what=f"{algorithm} on {size} elements")


def test_pytree_mixed_dtypes_and_mean():
    mesh = meshes.torus2d(4, 2)
    tree = {
        "w": random_rows(8, (4, 3), seed=1),
        "b": random_rows(8, (3,), seed=2),
        "scalar": random_rows(8, (), seed=3),
        "half": random_rows(8, (17,), jnp.bfloat16, seed=4),
    }
    fns = {
        a: lambda t, a=a: collectives.allreduce(t, ("y", "x"), a, op="mean") for a in ON_TWO_AXES
    }
    for algorithm, out in per_device_each(mesh, fns, tree).items():
        assert jax.tree.structure(out) == jax.tree.structure(tree), algorithm
        for key in ("w", "b", "scalar"):
            assert out[key].dtype == np.float32 and out[key].shape == tree[key].shape, algorithm
            assert_allreduced(out[key], tree[key], op="mean", what=f"{algorithm} {key}")
        assert out["half"].dtype == jnp.bfloat16, algorithm
        # bf16 carries 8 mantissa bits: each of the 7 additions may round once (2^-8 relative).
        assert_allreduced(
            out["half"],
            tree["half"].astype(np.float32),
            op="mean",
            rtol=2e-2,
            atol=2e-2,
            what=f"{algorithm} half",
        )


def test_bfloat16_transfer_with_float32_accumulation():
    mesh = meshes.torus2d(2, 4)
    x = random_rows(8, (1000,))
    fns = {}
    for algorithm in ("ring", "bidirectional_ring", "torus2d", "halving_doubling"):
        fns[algorithm, "bf16"] = lambda v, a=algorithm: collectives.allreduce(
            v, ("y", "x"), a, transfer_dtype=jnp.bfloat16, accumulate_dtype=jnp.float32
        )
        fns[algorithm, "exact"] = lambda v, a=algorithm: collectives.allreduce(v, ("y", "x"), a)
    out = per_device_each(mesh, fns, x)
    for (algorithm, form), narrowed in out.items():
        if form != "bf16":
            continue
        assert narrowed.dtype == np.float32, algorithm
        # Every partial sum is rounded to bf16 once per hop: error ~ hops * 2^-9 * |partial sum|.
        assert_allreduced(narrowed, x, rtol=0, atol=0.2, what=algorithm)
        exact = out[algorithm, "exact"]
        assert np.abs(narrowed - exact).max() > 0, (
            f"{algorithm}: bf16 transfer left no trace: messages were not narrowed"
        )


def test_bfloat16_accumulated_in_float32_is_exact_to_bf16_rounding():
    mesh = meshes.ring(8)
    x = random_rows(8, (513,), jnp.bfloat16)
    out = per_device(
        mesh, lambda v: collectives.allreduce(v, "x", "ring", accumulate_dtype=jnp.float32), x
    )
    assert out.dtype == jnp.bfloat16
    expected = x.astype(np.float32).sum(0).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(out[0].astype(np.float32), expected)


def test_integers_sum_exactly():
    mesh = meshes.ring(5)
    x = np.arange(5 * 11, dtype=np.int32).reshape(5, 11)
    out = per_device(mesh, lambda v: collectives.allreduce(v, "x", "ring"), x)
    np.testing.assert_array_equal(out, np.broadcast_to(x.sum(0), x.shape))


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_loop_form_matches_unrolled_form(op):
    mesh = meshes.torus2d(2, 4)
    x = random_rows(8, (999,))
    fns = {}
    for algorithm in ("ring", "bidirectional_ring", "torus2d"):
        fns[algorithm, "looped"] = lambda v, a=algorithm: collectives.allreduce(
            v, ("y", "x"), a, op=op, unroll_limit=0
        )
        fns[algorithm, "unrolled"] = lambda v, a=algorithm: collectives.allreduce(
            v, ("y", "x"), a, op=op
        )
    out = per_device_each(mesh, fns, x)
    for algorithm in ("ring", "bidirectional_ring", "torus2d"):
        looped, unrolled = out[algorithm, "looped"], out[algorithm, "unrolled"]
        np.testing.assert_allclose(looped, unrolled, rtol=1e-6, atol=1e-6, err_msg=algorithm)
        assert_allreduced(looped, x, op=op, what=algorithm)


def count_permutes(p, unroll_limit):
    mesh = meshes.ring(p)
    x = jax.device_put(np.zeros((p, 64), np.float32), NamedSharding(mesh, P("x")))
    fn = jax.jit(
        jax.shard_map(
            lambda v: collectives.allreduce(v[0], "x", "ring", unroll_limit=unroll_limit)[None],
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
        )
    )
    return fn.lower(x).as_text().count("collective_permute")


def test_loop_form_keeps_program_size_flat():
    # Unrolled, the program grows with the axis; as a loop it does not.
    assert count_permutes(8, unroll_limit=16) > count_permutes(4, unroll_limit=16)
    assert count_permutes(8, unroll_limit=0) == count_permutes(4, unroll_limit=0) == 2


def test_building_blocks_reduce_scatter_and_all_gather():
    mesh = meshes.ring(4)
    x = random_rows(4, (10,))
    shards = per_device(mesh, lambda v: collectives.reduce_scatter(v, "x"), x)
    padded = np.pad(x.sum(0), (0, 2))  # 10 elements -> 4 chunks of 3
    for i in range(4):
        np.testing.assert_allclose(shards[i], padded[3 * i : 3 * i + 3], rtol=1e-6, atol=1e-6)
    gathered = per_device(mesh, lambda s: collectives.all_gather(s, "x"), shards)
    for i in range(4):
        np.testing.assert_allclose(gathered[i], padded, rtol=1e-6, atol=1e-6)
    # Chunks long enough that the allreduce schedules would align their windows: the building
    # blocks still cut equal chunks of the padded buffer (ZeRO-1 keeps optimizer state in them).
    x = random_rows(4, (1001,))
    shards = per_device(mesh, lambda v: collectives.reduce_scatter(v, "x"), x)
    assert shards.shape == (4, 251)
    padded = np.pad(x.sum(0), (0, 3))
    np.testing.assert_allclose(shards.reshape(-1), padded, rtol=1e-5, atol=1e-5)
    gathered = per_device(mesh, lambda s: collectives.all_gather(s, "x"), shards)
    np.testing.assert_allclose(gathered, np.tile(padded, (4, 1)), rtol=1e-5, atol=1e-5)
    for p in (2, 4):  # a pair exchanges; four go round the ring
        shards = random_rows(p, (3,))
        gathered = per_device(
            meshes.ring(p), lambda s: collectives.all_gather(s, "x", divisor=3), shards
        )
        for i in range(p):
            np.testing.assert_allclose(gathered[i], shards.reshape(-1) / 3, rtol=1e-6)
    with pytest.raises(TypeError, match=r"a mean needs floating-point values.*int32"):
        per_device(
            meshes.ring(4),
            lambda s: collectives.all_gather(s, "x", divisor=3),
            shards.astype(np.int32),
        )


def test_inside_a_users_jit_and_shard_map():
    """A user's own shard_map body: loss gradient, then allreduce, inside an outer jit.

    Under check_vma the gradient of a replicated (invariant) input is psum-ed by autodiff
    itself, so the body marks ``w`` as varying first (``pcast(..., to="varying")``) to get per-device gradients.
    """
    mesh = meshes.ring(8)
    w = np.ones((3,), np.float32)
    data = random_rows(8, (4, 3))

    @jax.jit
    def step(w, data):
        def body(w, d):
            grad = jax.grad(lambda w: jnp.sum((d[0] @ w) ** 2))(jax.lax.pcast(w, "x", to="varying"))
            return collectives.allreduce(grad, "x", "ring", op="mean")[None]

        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x"))(w, data)

    data_sharded = jax.device_put(data, NamedSharding(mesh, P("x")))
    out = np.asarray(step(w, data_sharded))
    expected = np.mean([2 * d.T @ (d @ w) for d in data], axis=0)
    for row in out:
        np.testing.assert_allclose(row, expected, rtol=1e-5)


def test_in_a_shard_map_without_vma_checks_returning_replicated():
    mesh = meshes.ring(4)
    x = random_rows(4, (6,))
    fn = jax.jit(
        jax.shard_map(
            lambda v: collectives.allreduce(v[0], "x", "bidirectional_ring"),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P(),
            check_vma=False,
        )
    )
    out = np.asarray(fn(jax.device_put(x, NamedSharding(mesh, P("x")))))
    np.testing.assert_allclose(out, x.sum(0), rtol=1e-6, atol=1e-6)


def test_hierarchical_inter_algorithm_option():
    mesh = meshes.hierarchical(4, 2)
    x = random_rows(8, (301,))
    for inter in ("ring", "halving_doubling", "parameter_server", "native"):
        out = per_device(
            mesh,
            lambda v, inter=inter: collectives.allreduce(
                v, ("host", "local"), "hierarchical", inter_algorithm=inter
            ),
            x,
        )
        assert_allreduced(out, x)


@pytest.mark.parametrize("local", [2, 3, 4])
def test_two_hosts_crossed_exchange_and_swap_agree(local):
    mesh = meshes.hierarchical(2, local)
    x = random_rows(2 * local, (1001,))
    fns = {
        (inter, crossed): lambda v, i=inter, c=crossed: collectives.allreduce(
            v, ("host", "local"), "hierarchical", inter_algorithm=i, crossed_exchange=c
        )
        for inter in ("ring", "bidirectional_ring", "halving_doubling")
        for crossed in (True, False)
    }
    for (inter, crossed), result in per_device_each(mesh, fns, x).items():
        assert_allreduced(result, x, what=f"across hosts by {inter}, crossed={crossed}")


def _permute_pairs(fn, mesh, x):
    """source_target_pairs of every collective-permute in the lowered program."""
    spec = P(tuple(mesh.axis_names))
    lowered = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)).lower(x)
    found = re.findall(r"source_target_pairs = dense<(\[\[.*?\]\])>", lowered.as_text())
    return [[tuple(pair) for pair in json.loads(text)] for text in found]


def test_crossed_exchange_sends_no_pair_both_ways():
    mesh = meshes.hierarchical(2, 4)
    x = jnp.zeros((8, 64))

    def sends_both_ways(pairs):
        return any((b, a) in pairs for a, b in pairs if a != b)

    for crossed, expect_swap in ((True, False), (False, True)):
        permutes = _permute_pairs(
            lambda v, c=crossed: collectives.allreduce(
                v, ("host", "local"), "torus2d", crossed_exchange=c
            ),
            mesh,
            x,
        )
        # Pairs on the two axes together are numbered host * 4 + local: 0-3 host 0, 4-7 host 1.
        crossing = [ps for ps in permutes if any(a // 4 != b // 4 for a, b in ps)]
        assert crossing, "the outer step must cross hosts"
        assert any(sends_both_ways(ps) for ps in crossing) == expect_swap, crossing


@pytest.mark.parametrize("op", [pytest.param("sum", marks=pytest.mark.slow), "mean"])
def test_low_precision_transfer_leaves_every_device_the_same_bits(op):
    # A device that reduced a chunk must keep it rounded as it sent it, or replicas drift apart;
    # the mean's division, done where each schedule writes its result, must not break that.
    for shape in ((2, 4), (4, 2), (3, 2)):  # 3 x 2 divides by 6: not exact in binary
        mesh = meshes.torus2d(*shape)
        runnable = [a for a in ON_TWO_AXES if shape != (3, 2) or a != "halving_doubling"]
        x = random_rows(mesh.size, (999,))
        fns = {
            a: lambda v, a=a: collectives.allreduce(
                v, ("y", "x"), a, op=op, transfer_dtype=jnp.bfloat16
            )
            for a in runnable
        }
        for algorithm, out in per_device_each(mesh, fns, x).items():
            for device, row in enumerate(out[1:], start=1):
                np.testing.assert_array_equal(
                    row, out[0], err_msg=f"{algorithm} on {shape}: device {device} differs"
                )
            # As in the bf16 transfer test above: about hops * 2^-9 of each partial sum.
            assert_allreduced(
                out,
                x,
                op=op,
                rtol=0,
                atol=0.2 / (mesh.size if op == "mean" else 1),
                what=f"{algorithm} on {shape}",
            )


@pytest.mark.parametrize(
    "algorithm", ["ring", "bidirectional_ring", "torus2d", "hierarchical", "halving_doubling"]
)
def test_sizes_that_do_not_divide_are_not_padded(algorithm):
    # Padding to a multiple of the chunk count and cutting the result back each cost a pass
    # over the data and kept XLA:CPU from writing over a donated input (the ring took 2.6x
    # its time at 16 MiB + 4 bytes); the schedules cut such buffers into overlapping windows
    # (halving-doubling: halves) instead, so no buffer larger than the data is ever made.
    count = 8 * 4096 + 3
    for mesh in (meshes.torus2d(4, 2), meshes.torus2d(2, 4)):
        text = compiled_text(mesh, algorithm, count)
        sizes = [int(n) for n in re.findall(r"= f32\[(?:1,)?(\d+)\]", text)]
        assert max(sizes) == count, sorted(set(sizes))[-3:]
        assert " copy(" not in text


# The pairs along `x` of torus2d(4, 2), as source_target_pairs in a compiled program.
TORUS_4X2_PAIRS = "{{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}"


@pytest.mark.parametrize("algorithm", ["torus2d", "hierarchical"])
def test_an_inner_pair_exchanges_each_block_of_the_outer_ring_as_it_arrives(algorithm):
    # On an inner axis of two, gathering the outer ring's blocks into a half-size buffer and
    # then swapping that half and concatenating it with the other cost two more passes over
    # the data (torus2d in place on torus-4x2, 16 MiB: benchmarks/results/NOTES_collectives_cpu.md, "torus2d on an
    # inner axis of two"). The pair now exchanges half the buffer once (the reduce-scatter),
    # then every block of the outer ring's all-gather as it arrives, written straight into
    # the donated input: no concatenation, no copy.
    mesh = meshes.torus2d(4, 2)
    for count in (8 * 4096, 8 * 4096 + 3):
        text = compiled_text(mesh, algorithm, count, op="mean")
        sent = re.findall(
            r"= f32\[(\d+)\]\S* collective-permute\(.*source_target_pairs=(\S+),", text
        )
        across_pair = sorted(int(n) for n, pairs in sent if pairs == TORUS_4X2_PAIRS)
        block = min(int(n) for n, _ in sent)  # one of the outer ring's 8 windows
        assert across_pair[:-1] == [block] * 4 and across_pair[-1] >= count // 2, across_pair
        assert " concatenate(" not in text and " copy(" not in text


def test_an_inner_pairs_swaps_wait_for_each_other():
    # When the ring forwarded the block that had arrived round it, consecutive swaps across
    # the pair were independent of each other and of the ring steps, and over gloo (8
    # processes, swaps in a loop of 256 KiB pieces) most sums came out wrong. The ring now
    # forwards the block that came across the pair, so every ring step of the all-gather sends
    # a swap's result and every swap but the first sends a ring step's: one chain.
    mesh = meshes.torus2d(4, 2)
    text = compiled_text(mesh, "torus2d", 8 * 4096, donate=False)
    sends = {
        name: (operand, pairs == TORUS_4X2_PAIRS)
        for name, operand, pairs in re.findall(
            r"%(\S+) = f32\[4096\]\S* collective-permute\(%(\S+)\).*source_target_pairs=(\S+),",
            text,
        )
    }
    # The all-gather's messages: those that send another message's result.
    chained = {name: sends[operand] for name, (operand, _) in sends.items() if operand in sends}
    across = [name for name, (_, is_pair) in sends.items() if is_pair]
    assert len(across) == 4 and sum(name in chained for name in across) == 3, sends
    assert len(chained) == 6, f"expected 3 swaps and 3 ring steps chained, found {chained}"
    for name, (_, sent_is_pair) in chained.items():
        assert sent_is_pair != sends[name][1], f"{name} sends a message of its own kind: {sends}"


@pytest.mark.parametrize("rows", [pytest.param(3, marks=pytest.mark.slow), 4])
def test_an_inner_pair_lays_its_windows_out_as_a_flat_ring(rows):
    # The pair's two regions hold the outer ring's windows; region 1 ends at the buffer's end,
    # so at sizes whose last window starts early its windows sit that far into it. Sizes
    # around those boundaries, a mean and bf16 messages: every device with the same bits.
    mesh = meshes.torus2d(rows, 2)
    count = 2 * rows
    for size in (count - 1, count, 16 * count - 1, 16 * count + 5, 16 * 7 * count + 17, 1000):
        x = random_rows(mesh.size, (size,), seed=size)
        out = per_device(
            mesh,
            lambda v: collectives.allreduce(
                v, ("y", "x"), "torus2d", op="mean", transfer_dtype=jnp.bfloat16
            ),
            x,
        )
        for device, row in enumerate(out[1:], start=1):
            np.testing.assert_array_equal(row, out[0], err_msg=f"size {size}: device {device}")
        assert_allreduced(out, x, op="mean", rtol=0, atol=0.2 / mesh.size)
        exact = per_device(mesh, lambda v: collectives.allreduce(v, ("y", "x"), "torus2d"), x)
        assert_allreduced(exact, x)


def test_bidirectional_ring_concatenates_whole_blocks_at_sizes_that_do_not_divide():
    # Its unrolled all-gather concatenates the blocks. XLA:CPU turns a concatenation of
    # slices into a slower loop (in place on 8 devices, 64 MiB + 4 bytes each: 376 ms
    # against 243 ms at 64 MiB; benchmarks/results/NOTES_collectives_cpu.md, "Sizes that do not divide"), so the
    # windows do not overlap but for the last, which is the one block that enters sliced:
    # one slice per concatenation (one per ring position).
    mesh = meshes.torus2d(4, 2)
    for count in (8 * 4096 + 3, 10007):
        text = compiled_text(mesh, "bidirectional_ring", count)
        concatenations = text.count(" concatenate(")
        assert concatenations == 8, concatenations
        assert text.count(" slice(") <= concatenations, (count, text.count(" slice("))


def test_whole_windows_fit_and_cover_the_buffer_once():
    # One window must be the whole buffer: rounded up it would not fit, so no stride.
    assert windows.whole_window_stride(17, 1) is None
    assert windows.whole_window_stride(32, 1) == 32
    for count in range(2, 35):  # two rings of at least one device each
        for size in [*range(0, 700), 16 * count * (count - 1), 16 * count * (count - 1) - 1]:
            stride = windows.whole_window_stride(size, count)
            if stride is None:
                assert size < 16 * count * count, (size, count)  # only small buffers
                continue
            length = windows.window_length(size, count, stride)
            shift = windows.last_window_shift(size, count, stride, length)
            assert length == stride and (stride < 16 or stride % 16 == 0), (size, count)
            # Where the reduce-scatter reads each window (the last one clamped to the end).
            starts = [min(w * stride, size - length) for w in range(count)]
            assert all(a >= 0 and a + length <= size for a in starts), (size, count, starts)
            assert starts[:-1] == [w * stride for w in range(count - 1)], (size, count)
            # What the concatenation takes: blocks 0 .. count - 2 whole, the last from `shift`.
            covered = [a + k for a in starts[:-1] for k in range(length)]
            covered += [starts[-1] + k for k in range(shift, length)]
            assert covered == list(range(size)), (size, count)


def test_a_ring_gather_refuses_windows_that_only_a_concatenation_takes():
    # Windows that overlap only at the end leave the last one nothing past count * stride;
    # the gather that writes over its input would slice past the block, so it refuses them.
    mesh = meshes.ring(4)
    size = 16 * 4 * 3 + 16 * 5  # 272 elements in 4 windows of 80, the last starting at 192
    stride = windows.whole_window_stride(size, 4)
    assert stride == 80 and 4 * stride > size
    wire = wire_module.Wire()

    def gather(v):
        return ring_steps.ring_all_gather(
            [v[:stride]], "x", (1,), wire, collectives.UNROLL_LIMIT, size, stride
        )

    with pytest.raises(ValueError, match="overlap only at the end"):
        per_device(mesh, gather, random_rows(4, (size,)))


def _full_size_instructions(mesh, algorithm, op, count):
    """The instructions (fused bodies included) that produce a whole (count,) buffer in the
    compiled in-place allreduce on ``mesh``: each one is a pass over all of the data."""
    text = compiled_text(mesh, algorithm, count, op=op)
    return re.findall(rf"= f32\[(?:1,)?{count}\]\S* (\S+?)\(", text)


@pytest.mark.parametrize(
    "algorithm", ["ring", "bidirectional_ring", "torus2d", "hierarchical", "halving_doubling"]
)
def test_mean_costs_no_pass_over_the_data_that_the_sum_does_not(algorithm):
    # Dividing after the schedule made XLA:CPU copy the donated input and write the result
    # once more (the ring's mean took 3x its sum at 16 MiB); the schedules divide as they
    # write their result instead.
    count = 8 * 4096
    for mesh in (meshes.torus2d(4, 2), meshes.torus2d(2, 4)):  # inner axes of 2 and of 4
        mean = _full_size_instructions(mesh, algorithm, "mean", count)
        assert "copy" not in mean, mean
        assert sorted(mean) == sorted(_full_size_instructions(mesh, algorithm, "sum", count))


# --------------------------------------------------------------------------- errors


def test_unknown_algorithm_names_the_choices():
    mesh = meshes.ring(2)
    with pytest.raises(ValueError, match=r"unknown allreduce algorithm 'rign'.*'ring'"):
        per_device(mesh, lambda v: collectives.allreduce(v, "x", "rign"), random_rows(2, (3,)))


def test_unbound_axis_is_a_clear_error():
    mesh = meshes.ring(2)
    with pytest.raises(ValueError, match=r"axis 'data' is not bound"):
        per_device(mesh, lambda v: collectives.allreduce(v, "data", "ring"), random_rows(2, (3,)))


def test_two_level_needs_two_axes():
    mesh = meshes.ring(4)
    with pytest.raises(ValueError, match=r"torus2d needs a tuple of two axis names"):
        per_device(mesh, lambda v: collectives.allreduce(v, "x", "torus2d"), random_rows(4, (3,)))


def test_bad_op_and_options():
    mesh = meshes.ring(2)
    x = random_rows(2, (3,))
    with pytest.raises(ValueError, match=r"op must be 'sum' or 'mean', got 'max'"):
        per_device(mesh, lambda v: collectives.allreduce(v, "x", "ring", op="max"), x)
    with pytest.raises(TypeError, match=r"'ring': bad options"):
        per_device(mesh, lambda v: collectives.allreduce(v, "x", "ring", server=1), x)
    with pytest.raises(ValueError, match=r"server must be in \[0, 2\)"):
        per_device(mesh, lambda v: collectives.allreduce(v, "x", "parameter_server", server=5), x)
    with pytest.raises(TypeError, match=r"needs floating-point leaves"):
        per_device(
            mesh, lambda v: collectives.allreduce(v, "x", "ring", op="mean"), x.astype(np.int32)
        )
    with pytest.raises(TypeError, match=r"needs a floating-point accumulate_dtype"):
        per_device(
            mesh,
            lambda v: collectives.allreduce(v, "x", "ring", op="mean", accumulate_dtype=jnp.int32),
            x,
        )
    with pytest.raises(TypeError, match=r"pass op='mean' instead of a divisor"):
        per_device(mesh, lambda v: collectives.allreduce(v, "x", "ring", divisor=2), x)
    for algorithm in collectives.ALGORITHMS:  # set by allreduce from op, not a user option
        assert "divisor" not in collectives.get(algorithm).option_names


def test_float16_with_float32_accumulation():
    mesh = meshes.torus2d(2, 4)
    x = random_rows(8, (257,), np.float16)
    fns = {
        a: lambda v, a=a: collectives.allreduce(v, ("y", "x"), a, accumulate_dtype=jnp.float32)
        for a in ("ring", "torus2d", "halving_doubling", "parameter_server")
    }
    expected = x.astype(np.float32).sum(0).astype(np.float16)
    for algorithm, out in per_device_each(mesh, fns, x).items():
        assert out.dtype == np.float16, algorithm
        for row in out:  # float32 partial sums, one rounding to float16 at the end
            np.testing.assert_array_equal(row, expected, err_msg=algorithm)


def test_all_gather_into_a_buffer_of_the_wrong_size_is_an_error():
    mesh = meshes.ring(4)
    shards = random_rows(4, (3,))
    with pytest.raises(ValueError, match=r"`into` must have shape \(12,\), got \(10,\)"):
        per_device(mesh, lambda s: collectives.all_gather(s, "x", into=jnp.zeros(10)), shards)
    out = per_device(mesh, lambda s: collectives.all_gather(s, "x", into=jnp.ones(12)), shards)
    np.testing.assert_array_equal(out[0], shards.reshape(-1))  # every element overwritten


# A few pieces (unrolled), more (the bidirectional ring's 2,560-byte steps in 3), many (fori_loop).
@pytest.mark.parametrize("piece", [8000, pytest.param(1024, marks=pytest.mark.slow), 256])
def test_exchanges_in_pieces_against_psum(piece):
    # 2-device axes make every ring step, and every halving-doubling step, a pairwise exchange;
    # the bidirectional ring cuts every step.
    algorithms = ("ring", "bidirectional_ring", "halving_doubling", "torus2d", "hierarchical")
    for mesh in (meshes.ring(2), meshes.torus2d(2, 2), meshes.torus2d(4, 2)):
        fns = {}
        for algorithm in algorithms:
            if algorithm in collectives.TWO_LEVEL and len(mesh.axis_names) == 1:
                continue
            axes = axes_of(mesh) if algorithm in collectives.TWO_LEVEL else tuple(mesh.axis_names)
            fns[algorithm] = lambda v, a=algorithm, ax=axes: collectives.allreduce(
                v, ax, a, exchange_piece_bytes=piece
            )
        x = random_rows(mesh.size, (10007,))
        for algorithm, out in per_device_each(mesh, fns, x).items():
            assert_allreduced(out, x, what=f"{algorithm} on {mesh.devices.shape}")


def test_exchanges_and_bidirectional_steps_are_cut_into_pieces_and_ring_steps_are_not():
    def count(mesh, axes, algorithm, piece, **options):
        def fn(v):
            return collectives.allreduce(v, axes, algorithm, exchange_piece_bytes=piece, **options)

        return len(_permute_pairs(fn, mesh, jnp.zeros((mesh.size, 1024))))  # 4,096 bytes

    ring4 = meshes.ring(4)
    # halving_doubling on 4 devices: 2 halving steps (2,048 then 1,024 bytes) and 2 doubling
    # steps (1,024 then 2,048 bytes), all exchanges: 2 + 1 + 1 + 2 pieces of at most 1,024.
    assert count(ring4, "x", "halving_doubling", None) == 4
    assert count(ring4, "x", "halving_doubling", 1024) == 6
    # The ring's steps send to one neighbour and receive from the other: never split.
    assert count(ring4, "x", "ring", 1024) == count(ring4, "x", "ring", None) == 6
    assert count(ring4, "x", "ring", 256) == 6
    # The bidirectional ring's two rings use every link both ways, so its steps are cut like
    # exchanges: 12 messages of 512 bytes, 2 pieces each.
    assert count(ring4, "x", "bidirectional_ring", None) == 12
    assert count(ring4, "x", "bidirectional_ring", 256) == 24
    # On one process (no gloo) "auto" keeps whole messages.
    assert collectives.default_exchange_piece_bytes() is None
    assert count(ring4, "x", "halving_doubling", "auto") == 4
    # Every exchange of the other schedules is cut too: a ring (and a bidirectional ring) of
    # two is two exchanges of 2,048 bytes; torus2d on 2x2: 2,048 + 1,024 + 1,024 + 2,048.
    assert count(meshes.ring(2), "x", "ring", 1024) == 4
    assert count(meshes.ring(2), "x", "bidirectional_ring", 1024) == 4
    assert count(meshes.torus2d(2, 2), ("y", "x"), "torus2d", 1024) == 6
    # The crossed exchange with an inner axis of two: its hop inside host 0 is an exchange.
    two_hosts = meshes.hierarchical(2, 2)
    crossed = dict(crossed_exchange=True)
    whole = count(two_hosts, ("host", "local"), "hierarchical", None, **crossed)
    assert count(two_hosts, ("host", "local"), "hierarchical", 500, **crossed) > whole


@pytest.mark.parametrize("dtype", [np.float32, np.int32, jnp.bfloat16])
def test_permute_matches_ppermute(dtype):
    mesh = meshes.ring(4)
    x = (np.arange(4 * 3 * 37) % 251).reshape(4, 3, 37).astype(dtype)  # a multi-dim block
    perms = {
        "exchange": [(0, 1), (1, 0), (2, 3), (3, 2)],
        "partial exchange": [(0, 1), (1, 0)],
        "shift": [(j, (j + 1) % 4) for j in range(4)],
    }
    fns = {}
    for name, perm in perms.items():
        fns[name] = lambda v, p=perm: jax.lax.ppermute(v, "x", p)
        for piece in (10, 64, 1 << 20):  # not a multiple of 4; loop; one piece
            for reverse_traffic in (False, True):  # True: a shift goes in pieces as well
                fns[name, piece, reverse_traffic] = lambda v, p=perm, b=piece, r=reverse_traffic: (
                    collectives.permute(v, "x", p, exchange_piece_bytes=b, reverse_traffic=r)
                )
    found = per_device_each(mesh, fns, x)
    for key, result in found.items():
        if isinstance(key, tuple):
            name, piece, reverse_traffic = key
            message = f"{name}, pieces of {piece}, reverse_traffic={reverse_traffic}"
            np.testing.assert_array_equal(result, found[name], err_msg=message)


def test_permute_in_pieces_of_a_replicated_input_under_vma_checks():
    # A fori_loop of pieces must type-check when the input is not varying along the axis.
    mesh = meshes.ring(2)
    exchange = [(0, 1), (1, 0)]

    def body(v):
        return collectives.permute(v, "x", exchange, exchange_piece_bytes=16)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("x")))
    np.testing.assert_array_equal(np.asarray(f(jnp.arange(40.0))), np.tile(np.arange(40.0), (2, 1)))


def test_bad_unroll_limit_is_a_clear_error_before_anything_is_traced():
    for bad in (-1, 2.5, "16", True):
        with pytest.raises(ValueError, match=f"unroll_limit must be an integer >= 0, got {bad!r}"):
            collectives.common_options({"unroll_limit": bad})
    assert collectives.common_options({"unroll_limit": np.int64(0)})["unroll_limit"] == 0
    assert collectives.common_options({})["unroll_limit"] == collectives.UNROLL_LIMIT


def test_bad_exchange_piece_bytes_is_a_clear_error():
    mesh = meshes.ring(2)
    for bad in (0, -5, 2.5, "big", True):
        for algorithm in ("ring", "native"):  # native never sends pieces but checks the value
            with pytest.raises(ValueError, match="exchange_piece_bytes must be a positive"):
                per_device(
                    mesh,
                    lambda v, a=algorithm, b=bad: collectives.allreduce(
                        v, "x", a, exchange_piece_bytes=b
                    ),
                    random_rows(2, (100,)),
                )
    # numpy integers are byte counts too.
    out = per_device(
        mesh,
        lambda v: collectives.allreduce(v, "x", "ring", exchange_piece_bytes=np.int64(64)),
        random_rows(2, (100,)),
    )
    assert_allreduced(out, random_rows(2, (100,)))
