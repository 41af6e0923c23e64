"""Where a batch lives: the data axes of a mesh, and a host batch placed on them."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "data_share",
    "shard_batch",
    "split_micro_batches",
]


def data_axes_of(mesh: Mesh, data_axes: str | tuple[str, ...] | None) -> str | tuple[str, ...]:
    """The data axes as a step names them: all of the mesh's axes for ``None``, one name for
    one axis, a tuple for several; refuses names that are not axes of ``mesh``."""
    axes = tuple(mesh.axis_names) if data_axes is None else data_axes
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    missing = [a for a in names if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"data axes {missing} are not axes of the mesh {tuple(mesh.axis_names)}")
    return names[0] if len(names) == 1 else names


def check_batch_sizes(batch: Any) -> None:
    """Refuse a batch whose leaves differ in leading (batch) size: images of 8 with labels of 4
    would broadcast inside the loss into a wrong value instead of failing."""
    sizes = {
        jax.tree_util.keystr(path): (np.shape(leaf)[0] if np.ndim(leaf) else None)
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch)
    }
    if len(set(sizes.values())) > 1:
        found = ", ".join(f"{name or 'batch'}: {size}" for name, size in sizes.items())
        raise ValueError(f"batch leaves must share one leading (batch) size, got {found}")


def split_micro_batches(batch: Any, k: int) -> Any:
    """``batch`` with a new leading axis of ``k`` micro-batches, consecutive slices of it (the
    leading size must divide by ``k``)."""
    return jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)


def replicas_by_process(mesh: Mesh, data_axes: str | tuple[str, ...]) -> dict[int, list[int]]:
    """Per process, which data-parallel replicas (positions along the data axes, flattened
    in mesh order) its devices hold. Devices along other axes (a pipeline's stages, a tensor
    axis) hold the same replica's data, so a process holding stages 0-3 of replica 1 holds
    one replica: [1]."""
    axes = [mesh.axis_names.index(a) for a in np.atleast_1d(data_axes)]
    sizes = [mesh.devices.shape[a] for a in axes]
    held: dict[int, set[int]] = {}
    for index in np.ndindex(mesh.devices.shape):
        replica = int(np.ravel_multi_index([index[a] for a in axes], sizes))
        held.setdefault(mesh.devices[index].process_index, set()).add(replica)
    return {process: sorted(replicas) for process, replicas in sorted(held.items())}


def local_replica_indices(mesh: Mesh, data_axes: str | tuple[str, ...]) -> list[int]:
    """Which data-parallel replicas this process's devices hold
    (:func:`replicas_by_process`)."""
    return replicas_by_process(mesh, data_axes).get(jax.process_index(), [])


def data_share(
    mesh: Mesh, data_axes: str | tuple[str, ...], process: int | None = None
) -> tuple[int, int]:
    """``(share, shares)``: which part of every global batch ``process`` (default: this one)
    reads, of how many parts. Each process reads its own part, but processes holding the
    same replicas (a tensor axis or pipeline stages across processes, whose devices must see
    the same rows) read the same one. One line where the processes' replicas overlap
    without being the same, or differ in number."""
    held = replicas_by_process(mesh, data_axes)
    process = jax.process_index() if process is None else process
    if process not in held:
        raise ValueError(
            f"process {process} holds no device of the mesh (its devices: processes "
            f"{sorted(held)}), so it has no rows to feed"
        )
    parts = list(_processes_by_replicas(held))
    every = {r for part in parts for r in part}
    if sum(map(len, parts)) != len(every) or len({len(part) for part in parts}) > 1:
        found = "; ".join(f"process {p}: {r}" for p, r in held.items())
        raise ValueError(
            "processes feed the same rows to the replicas they share, so each must hold "
            f"the same replicas as the others it shares with, as many as every other; "
            f"the mesh gives {found}"
        )
    return parts.index(tuple(held[process])), len(parts)


def _processes_by_replicas(held: dict[int, list[int]]) -> dict[tuple[int, ...], list[int]]:
    """:func:`replicas_by_process` turned round: per set of replicas, in the order of the
    first process holding it, the processes that hold it."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for process, replicas in held.items():
        groups.setdefault(tuple(replicas), []).append(process)
    return groups


def check_shared_rows(mesh: Mesh, data_axes: str | tuple[str, ...], batch: Any) -> None:
    """Where processes hold the same replicas (:func:`data_share`), one line unless they
    were given the same rows of ``batch``: otherwise the devices of a tensor group would
    each see other rows, and nothing else would tell. A collective among the processes (a
    digest of each one's rows) where replicas are shared; nothing otherwise."""
    groups = _processes_by_replicas(replicas_by_process(mesh, data_axes))
    if jax.process_count() == 1 or all(len(same) == 1 for same in groups.values()):
        return
    from jax.experimental import multihost_utils

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(batch):
        if not isinstance(leaf, jax.Array):  # placed already: a loader's own placement
            digest.update(np.ascontiguousarray(leaf).tobytes())
    mine = np.frombuffer(digest.digest()[:8], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
    for replicas, same in groups.items():
        if any((every[p] != every[same[0]]).any() for p in same):
            raise ValueError(
                f"processes {same} hold the same replicas {list(replicas)} but were given "
                "different rows: feed each process batches.local_rows(batch, mesh, "
                "data_axes), or build its iterators inside "
                "jaxdist.data.pipeline.reading_share(*batches.data_share(mesh, data_axes))"
            )


def local_rows(batch: Any, mesh: Mesh, data_axes: str | tuple[str, ...]) -> Any:
    """The rows of a global host ``batch`` that this process's replicas train on, in order:
    what each process passes to :func:`shard_batch` when every process holds the whole batch."""
    held = local_replica_indices(mesh, data_axes)
    replicas = int(np.prod([mesh.shape[a] for a in np.atleast_1d(data_axes)]))
    per = len(jax.tree.leaves(batch)[0]) // replicas
    rows = np.concatenate([np.arange(r * per, (r + 1) * per) for r in held])
    return jax.tree.map(lambda x: np.asarray(x)[rows], batch)


def shard_batch(mesh: Mesh, data_axes: str | tuple[str, ...], batch: Any) -> Any:
    """Place a batch on ``mesh``, split along its leading axis over ``data_axes``.

    Each process passes its part of the global batch (all of it on one process): the rows
    of the replicas it holds (:func:`local_rows`), so processes holding the same replicas (a
    tensor axis across processes) pass the same rows. A leaf that is already a global array
    with this placement is kept as it is."""
    check_batch_sizes(batch)
    sharding = NamedSharding(mesh, P(data_axes))
    local_replicas = len(local_replica_indices(mesh, data_axes))

    def place(x):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x  # placed already (a loader that decodes on the devices)
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] % local_replicas:
            raise ValueError(
                f"batch leading axis {x.shape[:1]} must divide evenly over the "
                f"{local_replicas} local data-parallel device(s) of this process"
            )
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(place, batch)
