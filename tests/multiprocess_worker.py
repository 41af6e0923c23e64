"""One process of a multi-process test run, started by ``jaxdist launch`` / ``jaxdist cluster``.

Usage: ``python tests/multiprocess_worker.py CHECK [CHECK ...]`` with CHECK one of

* ``mesh``: host-aware meshes put each process's devices on one row of the inner axis;
* ``allreduce``: every algorithm in ``jaxdist.comm.collectives.ALGORITHMS`` against ``psum``;
* ``host``: inside ``jaxdist cluster``: this process's hostname is its emulated host's and
  resolves to that host's bridge address (what gloo advertises to its peers);
* ``train``: a data-parallel :class:`jaxdist.training.train_step.TrainStep` (MLP with cross-replica
  BatchNorm) for every case in :data:`TRAIN_CASES`, each process feeding its own slice of the
  global batch; the final parameters and BatchNorm statistics go to
  ``$JAXDIST_TEST_OUT_DIR/train-<case>-p<id>.npz`` for the test to compare with one process;
* ``dali``: the DALI loader on a 2 x 2 mesh, reading ``$JAXDIST_TEST_DALI_ROOT`` (a folder
  with one image per class, so a label names its sample): an epoch's batches placed on the
  mesh, the same samples in the same order as the grain loader, and a resume from the state
  after the first batch; the labels each process saw go to
  ``$JAXDIST_TEST_OUT_DIR/dali-p<id>.npz`` for the test to check that the processes cover the
  epoch exactly once between them;
* ``hang``: write this process's pid to ``$JAXDIST_TEST_PID_DIR/<id>.pid``, then wait
  forever (the launcher-failure test kills one of these).

Each passing check prints ``CHECK <name> OK ...``; a failure raises (non-zero exit) with what
was expected and what was found. The process group comes from the ``JAXDIST_*`` variables.

Importing this module joins no process group (only running it does), so the test process can
import :func:`train_case` and compute the one-process reference with the very same code.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import meshes
from jaxdist.comm import collectives, tensor_parallel
from jaxdist.runtime import distributed
from jaxdist.training import batches
from jaxdist.training import train_step as ts
from jaxdist.training.batchnorm import CrossReplicaBatchNorm
from jaxdist.training.classifier_loss import classifier_loss
from tests._step_options import records


def check_mesh() -> None:
    """Each process's devices must form exactly one row (the inner, fast axis)."""
    nproc, local = jax.process_count(), jax.local_device_count()
    for name, mesh in (
        ("hierarchical", meshes.hierarchical(nproc, local)),
        ("torus2d", meshes.torus2d(nproc, local)),
    ):
        rows = [[d.process_index for d in row] for row in mesh.devices]
        expected = [[r] * local for r in range(nproc)]
        assert rows == expected, (
            f"{name} mesh {nproc}x{local}: expected process index per grid cell {expected}, "
            f"found {rows}"
        )
    spec = meshes.MeshSpec(
        "hier", "hierarchical", (("host", nproc), ("local", local)), devices_per_host=local
    )
    assert meshes.host_mismatch(spec, meshes.device_grid(spec)) is None
    # A spec whose hosts are not the real processes is built, with a warning saying so.
    wrong = meshes.MeshSpec(
        "wrong",
        "hierarchical",
        (("host", 1), ("local", nproc * local)),
        devices_per_host=nproc * local,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meshes.build(wrong)
    expected = (
        f"mesh 'wrong' expects {nproc * local} devices per host, but its devices come from "
        f"{nproc} processes with {local} each"
    )
    assert [str(w.message)[: len(expected)] for w in caught] == [expected], caught
    assert f"jaxdist.meshes.hierarchical({nproc}, {local})" in str(caught[0].message)
    assert f"  warning: {expected}" in meshes.describe(wrong)
    if jax.process_index() == 0:
        print(meshes.describe(spec))
    # A tensor axis across processes: every process holds every replica, so all read the
    # same part of each batch.
    across = meshes.build(f"tensor={nproc},fsdp={local}")
    assert batches.data_share(across, "fsdp") == (0, 1), batches.data_share(across, "fsdp")
    # Fed each its own rows instead, the first batch is refused on every process.
    step = ts.TrainStep(
        lambda *a: None,
        optax.sgd(0.1),
        across,
        data_axes="fsdp",
        tensor=tensor_parallel.TensorParallel({"w": 0}),
    )
    own = {"x": np.full((2 * local, 3), jax.process_index(), np.float32)}
    try:
        step.shard_batch(own)
    except ValueError as err:
        assert f"hold the same replicas {list(range(local))} but were given different rows" in str(
            err
        ), err
    else:
        raise AssertionError("processes sharing replicas were fed different rows unnoticed")
    same = step.shard_batch({"x": np.zeros((2 * local, 3), np.float32)})  # alike: placed
    assert same["x"].shape == (2 * local, 3), same["x"].shape
    print(f"CHECK mesh OK rows={rows}")


def _global_input(mesh, axes, n: int) -> tuple[jax.Array, np.ndarray]:
    """A (devices, n) array, row i on device i of the flattened mesh; and its row sum."""
    count = mesh.devices.size
    rng = np.random.default_rng(0)  # the same data in every process
    host = rng.standard_normal((count, n)).astype(np.float32)
    sharding = NamedSharding(mesh, P(axes))
    x = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return x, host.sum(axis=0)


def _run_each(mesh, axes, runs: dict, axis_name, x: jax.Array) -> dict:
    """``{name: (algorithm, options)}`` all run on ``x`` in one program (one compile instead
    of one per run); each run's local rows."""

    def body(block):
        return {
            name: collectives.allreduce(block, axis_name, algorithm, **options)
            for name, (algorithm, options) in runs.items()
        }

    f = jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes))
    return {a: _local_rows(y) for a, y in jax.jit(f)(x).items()}


def _local_rows(y: jax.Array) -> list[np.ndarray]:
    return [np.asarray(shard.data).reshape(-1) for shard in y.addressable_shards]


def _max_difference(found: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """Largest absolute difference between this process's rows of two results."""
    return max(float(np.abs(f - r).max()) for f, r in zip(found, reference, strict=True))


def _check_exchanges_in_pieces(mesh, outer: int, inner: int) -> None:
    """Schedules whose steps are pairwise exchanges, or bidirectional ring steps, sent over
    gloo in pieces, against psum: small pieces (a few, then a fori_loop of them) and, on a
    larger buffer, the "auto" size."""
    axes = ("outer", "inner")
    pair_axis = "outer" if outer == 2 else "inner" if inner == 2 else None
    sizes = ((1003, 1024), (1003, 128), (200_000, "auto"))
    cases = [("halving_doubling", axes, sizes)]  # every step exchanges (i XOR d)
    if outer * inner >= 3:  # two rings, each link used both ways: every step goes in pieces
        # Steps of n / 2p elements: 3 pieces, 8 (a fori_loop), and 4 of the 512 KiB "auto".
        bidirectional_sizes = ((1003, 200), (1003, 64), (2 * outer * inner * 2**19, "auto"))
        cases.append(("bidirectional_ring", axes, bidirectional_sizes))
    if pair_axis is not None:  # a ring of two, and torus2d's 2-device axis, are exchanges
        cases += [("ring", pair_axis, sizes), ("torus2d", axes, sizes)]
    for algorithm, axis_name, sizes in cases:
        for n in dict.fromkeys(n for n, _ in sizes):  # one program per buffer size
            x, _ = _global_input(mesh, axes, n)
            pieces = [piece for size, piece in sizes if size == n]
            runs = {"psum": ("native", {})}
            for piece in pieces:
                runs[f"pieces of {piece}"] = (algorithm, {"exchange_piece_bytes": piece})
            results = _run_each(mesh, axes, runs, axis_name, x)
            for piece in pieces:
                err = _max_difference(results[f"pieces of {piece}"], results["psum"])
                assert err <= 1e-5, (
                    f"{algorithm} over {axis_name} with exchanges in pieces of {piece} on "
                    f"{outer}x{inner}: expected psum's result, found max abs difference "
                    f"{err:.3g}"
                )
        print(f"CHECK pieces {algorithm} {outer}x{inner} OK")


def _check_halves(mesh, axes, x: jax.Array, expected: np.ndarray, outer: int, inner: int):
    """Every schedule's reduce-scatter followed by its all-gather (the allreduce in its two
    halves, as ZeRO-1 and FSDP run them) against the numpy row sum, on every device."""
    names = [a for a in collectives.SHARDED_ALGORITHMS if a != "torus3d"]

    def body(block):
        v = block.reshape(-1)
        return {
            a: collectives.all_gather(collectives.reduce_scatter(v, axes, a), axes, a)[None]
            for a in names
        }

    f = jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes))
    for name, y in jax.jit(f)(x).items():
        for row in _local_rows(y):
            np.testing.assert_allclose(
                row[: expected.size],
                expected,
                rtol=1e-5,
                atol=1e-5,
                err_msg=f"{name} halves on {outer}x{inner}",
            )
        print(f"CHECK halves {name} {outer}x{inner} OK")
    # Over gloo XLA's reduce-scatter is sent as its all-reduce (gloo's own reduce-scatter leaves
    # the process's later collectives on large buffers hundreds of times slower).
    scatter = jax.shard_map(
        lambda b: collectives.reduce_scatter(b.reshape(-1), axes, "native"),
        mesh=mesh,
        in_specs=P(axes),
        out_specs=P(axes),
    )
    program = jax.jit(scatter).lower(x).as_text()
    assert "all_reduce" in program and "reduce_scatter" not in program, program
    print(f"CHECK native reduce-scatter over gloo is an all-reduce {outer}x{inner} OK")


def check_allreduce(n: int = 1003) -> None:
    """All algorithms on every two-level arrangement of the devices, compared with psum.

    ``n`` is not a multiple of the device count, so the padding paths run too.
    """
    nproc, local = jax.process_count(), jax.local_device_count()
    layouts = [(nproc, local)]
    if local == 1 and nproc == 4:  # also a 2x2 grid whose inner axis crosses processes
        layouts.append((2, 2))
    for outer, inner in layouts:
        mesh = meshes.hierarchical(outer, inner, axis_names=("outer", "inner"))
        axes = ("outer", "inner")
        x, expected = _global_input(mesh, axes, n)
        # Every algorithm in one program (one compile per layout); two-level schedules read
        # the axes as (outer, inner), the rest as one axis.
        on_two_axes = [a for a in collectives.ALGORITHMS if a not in collectives.THREE_LEVEL]
        runs = {a: (a, {}) for a in on_two_axes}
        results = _run_each(mesh, axes, runs, axes, x)
        reference = results["native"]
        for row in reference:
            np.testing.assert_allclose(
                row,
                expected,
                rtol=1e-5,
                atol=1e-5,
                err_msg=(f"psum on {outer}x{inner}: expected the numpy row sum"),
            )
        for algorithm in on_two_axes:
            found = results[algorithm]
            err = _max_difference(found, reference)
            assert err <= 1e-5, (
                f"{algorithm} on {outer}x{inner} ({nproc} processes x {local} devices): expected "
                f"psum's result on every device, found max abs difference {err:.3g}"
            )
            print(f"CHECK allreduce {algorithm} {outer}x{inner} OK max_err={err:.2g}")
        # The three-level schedule on the same devices as a torus of (outer, 1, inner).
        cube = meshes.torus3d(outer, 1, inner)
        cube_axes = ("z", "y", "x")
        x, _ = _global_input(cube, cube_axes, n)
        found = _run_each(cube, cube_axes, {"torus3d": ("torus3d", {})}, cube_axes, x)["torus3d"]
        err = _max_difference(found, reference)
        assert err <= 1e-5, (
            f"torus3d on {outer}x1x{inner} ({nproc} processes x {local} devices): expected "
            f"psum's result on every device, found max abs difference {err:.3g}"
        )
        print(f"CHECK allreduce torus3d {outer}x{inner} OK max_err={err:.2g}")
        _check_halves(mesh, axes, x, expected, outer, inner)
        _check_exchanges_in_pieces(mesh, outer, inner)
    auto = collectives.default_exchange_piece_bytes()
    assert auto == collectives.wire.GLOO_EXCHANGE_PIECE_BYTES, (
        f"expected exchanges over gloo in pieces of {collectives.wire.GLOO_EXCHANGE_PIECE_BYTES} "
        f"bytes, found {auto}"
    )
    auto = collectives.default_exchange_piece_bytes(reverse_traffic=True)
    assert auto == collectives.wire.GLOO_REVERSE_TRAFFIC_PIECE_BYTES, (
        f"expected bidirectional ring steps over gloo in pieces of "
        f"{collectives.wire.GLOO_REVERSE_TRAFFIC_PIECE_BYTES} bytes, found {auto}"
    )


def check_host() -> None:
    name = os.environ["JAXDIST_HOST"]
    found = socket.gethostname()
    assert found == name, f"expected hostname {name!r} (the emulated host), found {found!r}"
    address = socket.gethostbyname(found)
    expected = f"10.213.0.{jax.process_index() + 1}"
    assert address == expected, f"expected {found} to resolve to {expected}, found {address}"
    coordinator = os.environ["JAXDIST_COORDINATOR"]
    assert coordinator.startswith("10.213.0.1:"), (
        f"expected host 0 coordinating, found {coordinator}"
    )
    # The link rate the bench reports busbw against: the cluster's --bandwidth.
    from jaxdist.comm import emulated_link

    bits = os.environ["JAXDIST_LINK_BITS_PER_S"]  # empty for an uncapped cluster
    expected = int(bits) / 8 if bits else None
    assert emulated_link.link_rate_from_environment() == expected, (
        f"JAXDIST_LINK_BITS_PER_S={bits!r}"
    )
    print(f"CHECK host OK {found} {address}")


# --------------------------------------------------------------------------- train step

NUM_CLASSES = 4
TRAIN_STEPS = 3
GLOBAL_BATCH = 32  # divides over 1, 2, 4 and 8 devices


class MLP(nn.Module):
    """Dense -> cross-replica BatchNorm -> relu -> Dense -> relu -> Dense.

    BatchNorm's statistics are averaged over every data-parallel device, so they are the global
    batch's whatever the process count: the model couples the shards, not only the gradients.
    """

    norm_axis: collectives.AxisName | None = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Dense(16)(x)
        x = CrossReplicaBatchNorm(use_running_average=not train, axis_name=self.norm_axis)(x)
        x = nn.relu(x)
        x = nn.relu(nn.Dense(12)(x))
        return nn.Dense(NUM_CLASSES)(x)


class TensorMLP(nn.Module):
    """Dense -> relu -> column-parallel product -> relu -> row-parallel product: split over
    a ``tensor`` axis inside a tensor-parallel step (its hidden units), whole elsewhere."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.relu(nn.Dense(16)(x))
        w_in, w_out = (
            self._weight(name, shape)
            for name, shape in (("w_in", (16, 32)), ("w_out", (32, NUM_CLASSES)))
        )
        (hidden,) = tensor_parallel.column_product(x, [w_in])
        return tensor_parallel.row_product(nn.relu(hidden), w_out)

    def _weight(self, name: str, shape: tuple[int, ...]) -> jax.Array:
        # Read as it is: inside the step it is this device's block, whose shape linen's
        # self.param would refuse.
        if self.has_variable("params", name):
            return self.get_variable("params", name)
        return self.param(name, nn.initializers.lecun_normal(), shape)


# TensorMLP's split: the hidden units of both products.
TENSOR_DIMS = {"Dense_0": {"bias": None, "kernel": None}, "w_in": 1, "w_out": 0}


def global_batch(seed: int) -> dict[str, np.ndarray]:
    """Step ``seed``'s global batch: the same numbers in every process."""
    rng = np.random.default_rng(seed)
    return {
        "image": rng.standard_normal((GLOBAL_BATCH, 10)).astype(np.float32),
        "label": rng.integers(0, NUM_CLASSES, GLOBAL_BATCH).astype(np.int32),
    }


def _ring_mesh(devices: int) -> tuple[Mesh, collectives.AxisName]:
    return meshes.ring(devices), "x"


def _tensor_mesh(devices: int) -> tuple[Mesh, collectives.AxisName]:
    # The tensor axis inside a process (its devices see the same batch), fsdp across them.
    return meshes.build(f"fsdp={devices // 2},tensor=2"), "fsdp"


def _tensor_across_mesh(devices: int) -> tuple[Mesh, collectives.AxisName]:
    # The tensor axis outer: across the processes, when two run (each then holds every
    # replica of fsdp, and both feed the whole batch).
    return meshes.build(f"tensor=2,fsdp={devices // 2}"), "fsdp"


def _host_mesh(devices: int) -> tuple[Mesh, collectives.AxisName]:
    # Two rows (hosts when two processes run), the inner axis inside a process.
    return meshes.hierarchical(2, devices // 2), ("host", "local")


# name -> (mesh builder taking the total device count, TrainStep options). The two-level
# schedules run on the host-aware mesh, so their inner axis stays inside a process and their
# outer ring crosses processes; bucket_bytes=512 splits the gradients into several buckets.
TRAIN_CASES: dict[str, tuple[Callable[[int], tuple[Mesh, collectives.AxisName]], dict]] = {
    "native": (_ring_mesh, {"allreduce": "native"}),
    "ring": (_ring_mesh, {"allreduce": "ring", "bucket_bytes": 512}),
    "hierarchical": (_host_mesh, {"allreduce": "hierarchical"}),
    "torus2d": (_host_mesh, {"allreduce": "torus2d", "bucket_bytes": 512}),
    "ring_zero1": (_ring_mesh, {"allreduce": "ring", "sharding": "zero1"}),
    "torus2d_fsdp": (
        _host_mesh,
        {"allreduce": "torus2d", "sharding": "fsdp", "min_shard_elements": 0},
    ),
    "tensor_fsdp": (
        _tensor_mesh,
        {
            "allreduce": "ring",
            "sharding": "fsdp",
            "min_shard_elements": 0,
            "data_axes": "fsdp",
            "tensor": tensor_parallel.TensorParallel(TENSOR_DIMS, schedule="collective_matmul"),
        },
    ),
    "tensor_across_processes": (
        _tensor_across_mesh,
        {
            "allreduce": "native",
            "sharding": "fsdp",
            "min_shard_elements": 0,
            "data_axes": "fsdp",
            "tensor": tensor_parallel.TensorParallel(TENSOR_DIMS, schedule="collective_matmul"),
        },
    ),
}


def train_case(name: str, devices: int) -> tuple[dict[str, np.ndarray], float]:
    """Run ``TRAIN_STEPS`` steps of case ``name`` on the first ``devices`` devices.

    Each process passes the rows of the replicas it holds of every global batch to
    ``shard_batch`` (:func:`~jaxdist.training.batches.local_rows`: its own contiguous
    slice, the whole batch on one process, and the same rows as the other process where
    a tensor axis spans both). Returns the final parameters and BatchNorm statistics as
    ``{"params/...": array}`` (fetched from this process's replica) and the last loss.
    """
    make_mesh, options = TRAIN_CASES[name]
    mesh, axes = make_mesh(devices)
    model = TensorMLP() if "tensor" in options else MLP(norm_axis=axes)
    variables = (TensorMLP() if "tensor" in options else MLP()).init(
        jax.random.key(0), np.zeros((2, 10), np.float32), train=False
    )
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    step = ts.TrainStep(
        classifier_loss(model, num_classes=NUM_CLASSES),
        optax.sgd(0.1, momentum=0.9),
        mesh,
        **records(**options),
    )
    state = step.init(params, model_state)
    metrics: dict = {}
    for seed in range(TRAIN_STEPS):
        local = batches.local_rows(global_batch(seed), mesh, step.data_axes)
        state, metrics = step(state, step.shard_batch(local), jax.random.key(1))
    found = {}
    whole = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))  # FSDP's, gathered
    for prefix, tree in (("params", state.params), ("batch_stats", state.model_state)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(whole(tree))[0]:
            key = prefix + jax.tree_util.keystr(path)
            # Replicated: this process's first shard is the whole array.
            found[key] = np.asarray(leaf.addressable_shards[0].data)
    return found, float(np.asarray(metrics["loss"].addressable_shards[0].data))


def check_train() -> None:
    """Every train case on all devices of all processes; results saved for the test."""
    folder = os.environ.get("JAXDIST_TEST_OUT_DIR")
    for name in TRAIN_CASES:
        found, loss = train_case(name, jax.device_count())
        assert np.isfinite(loss), f"train {name}: expected a finite loss, found {loss}"
        if folder:
            path = os.path.join(folder, f"train-{name}-p{jax.process_index()}.npz")
            np.savez(path, loss=np.float32(loss), **found)
        print(f"CHECK train {name} OK loss={loss:.6f}")


def check_dali() -> None:
    from jaxdist.data.config import DataConfig, Pipeline
    from jaxdist.training.batches import shard_batch

    root = os.environ["JAXDIST_TEST_DALI_ROOT"]
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
    config = DataConfig(source="folder", root=root, image_size=16, dtype="uint8", seed=5)
    dali = Pipeline(dataclasses.replace(config, loader="dali"))
    dali.batch_sharding = NamedSharding(mesh, P(("x", "y")))
    batch_size, count = 8, len(dali.train_source)
    seen, images = [], []
    with dali.train_iterator(batch_size, num_epochs=1) as batches:
        for batch in batches:
            placed = shard_batch(mesh, ("x", "y"), batch)
            assert placed["image"].shape == (batch_size, 16, 16, 3), placed["image"].shape
            seen.append(batch["label"])
            images.append(batch["image"])
    with Pipeline(config).train_iterator(batch_size, num_epochs=1) as grain_batches:
        expected = [b["label"] for b in grain_batches]
    assert len(seen) == count // batch_size and all(
        (a == b).all() for a, b in zip(seen, expected, strict=True)
    ), f"DALI labels {seen} vs grain's {expected}"
    with dali.train_iterator(batch_size, num_epochs=1) as batches:
        next(batches)
        state = batches.get_state()
    with dali.train_iterator(batch_size, num_epochs=1) as resumed:
        resumed.set_state(state)
        rest = list(resumed)
    assert all(
        (a["label"] == b).all() and (a["image"] == c).all()
        for a, b, c in zip(rest, seen[1:], images[1:], strict=True)
    ), "a resumed DALI iterator differs from the first pass"
    folder = os.environ.get("JAXDIST_TEST_OUT_DIR")
    if folder:
        path = os.path.join(folder, f"dali-p{jax.process_index()}.npz")
        np.savez(path, labels=np.concatenate(seen))
    print(f"CHECK dali OK batches={len(seen)} resumed={len(rest)}")


def hang() -> None:
    folder = os.environ["JAXDIST_TEST_PID_DIR"]
    # Make every process reach the collective runtime first, so a kill hits a live run.
    x = jnp.ones(jax.local_device_count())
    jax.block_until_ready(x)
    path = os.path.join(folder, f"{jax.process_index()}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    print("CHECK hang waiting", flush=True)
    while True:
        time.sleep(1)


CHECKS = {
    "mesh": check_mesh,
    "allreduce": check_allreduce,
    "host": check_host,
    "train": check_train,
    "dali": check_dali,
    "hang": hang,
}

if __name__ == "__main__":
    unknown = [c for c in sys.argv[1:] if c not in CHECKS]
    if unknown or len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(CHECKS)}}} ...; got {sys.argv[1:]}")
    group = distributed.initialize()
    print(
        f"process {jax.process_index()} of {jax.process_count()}: "
        f"{jax.local_device_count()} local / {jax.device_count()} devices ({group.source})"
    )
    for name in sys.argv[1:]:
        CHECKS[name]()
