"""One process of a multi-process test run, started by ``jaxdist launch`` / ``jaxdist cluster``.

Usage: ``python tests/multiprocess_worker.py CHECK [CHECK ...]`` with CHECK one of

* ``mesh``: host-aware meshes put each process's devices on one row of the inner axis;
* ``allreduce``: every algorithm in ``jaxdist.collectives.ALGORITHMS`` against ``psum``;
* ``host``: inside ``jaxdist cluster``: this process's hostname is its emulated host's and
  resolves to that host's bridge address (what gloo advertises to its peers);
* ``hang``: write this process's pid to ``$JAXDIST_TEST_PID_DIR/<id>.pid``, then wait
  forever (the launcher-failure test kills one of these).

Each passing check prints ``CHECK <name> OK ...``; a failure raises (non-zero exit) with what
was expected and what was found. The process group comes from the ``JAXDIST_*`` variables.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import collectives, distributed, meshes

GROUP = distributed.initialize()


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
    if jax.process_index() == 0:
        print(meshes.describe(spec))
    print(f"CHECK mesh OK rows={rows}")


def _global_input(mesh, axes, n: int) -> tuple[jax.Array, np.ndarray]:
    """A (devices, n) array, row i on device i of the flattened mesh; and its row sum."""
    count = mesh.devices.size
    rng = np.random.default_rng(0)  # the same data in every process
    host = rng.standard_normal((count, n)).astype(np.float32)
    sharding = NamedSharding(mesh, P(axes))
    x = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return x, host.sum(axis=0)


def _run(mesh, axes, algorithm: str, axis_name, x: jax.Array) -> jax.Array:
    def body(block):
        return collectives.allreduce(block, axis_name, algorithm)

    f = jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes))
    return jax.jit(f)(x)


def _local_rows(y: jax.Array) -> list[np.ndarray]:
    return [np.asarray(shard.data).reshape(-1) for shard in y.addressable_shards]


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
        reference = _local_rows(_run(mesh, axes, "native", axes, x))
        for row in reference:
            np.testing.assert_allclose(
                row,
                expected,
                rtol=1e-5,
                atol=1e-5,
                err_msg=(f"psum on {outer}x{inner}: expected the numpy row sum"),
            )
        for algorithm in collectives.ALGORITHMS:
            axis_name = axes  # two-level schedules read it as (outer, inner), the rest as one axis
            found = _local_rows(_run(mesh, axes, algorithm, axis_name, x))
            err = max(float(np.abs(f - r).max()) for f, r in zip(found, reference, strict=True))
            assert err <= 1e-5, (
                f"{algorithm} on {outer}x{inner} ({nproc} processes x {local} devices): expected "
                f"psum's result on every device, found max abs difference {err:.3g}"
            )
            print(f"CHECK allreduce {algorithm} {outer}x{inner} OK max_err={err:.2g}")


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
    print(f"CHECK host OK {found} {address}")


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


CHECKS = {"mesh": check_mesh, "allreduce": check_allreduce, "host": check_host, "hang": hang}

if __name__ == "__main__":
    unknown = [c for c in sys.argv[1:] if c not in CHECKS]
    if unknown or len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(CHECKS)}}} ...; got {sys.argv[1:]}")
    print(
        f"process {jax.process_index()} of {jax.process_count()}: "
        f"{jax.local_device_count()} local / {jax.device_count()} devices ({GROUP.source})"
    )
    for name in sys.argv[1:]:
        CHECKS[name]()
