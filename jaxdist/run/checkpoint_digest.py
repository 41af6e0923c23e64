"""What makes a checkpoint trustworthy at restore: a digest of every array, saved in the
checkpoint's meta and compared when it is read back, and finite values.

A checkpoint whose bytes changed after it was written (a bad disk, a copy gone wrong, a
hand-edited file) may still decode; its digest then differs, and the restore treats it as
unreadable (:class:`~jaxdist.run.checkpoint.Checkpointer` moves it aside and resumes from the
newest checkpoint that verifies). The digest is computed on the devices, where the arrays
are, so a save pays one pass over the state and the transfer of one word per array.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["CorruptCheckpointError", "array_digests", "check_digests", "dotted_name"]


def dotted_name(path: Any) -> str:
    """A tree path as checkpoints and their messages name arrays: ``params.head.kernel``."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _as_words(x: jax.Array) -> jax.Array:
    """``x``'s bits as uint32 words (narrower types widened, 64-bit ones split in two)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = np.dtype(x.dtype).itemsize
    if width < 4:
        return lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[width]).astype(jnp.uint32)
    return lax.bitcast_convert_type(x, jnp.uint32)


def _digest(x: jax.Array) -> jax.Array:
    """A position-weighted sum of ``x``'s bits modulo 2**32. Every weight is odd, so changing
    any one word always changes it; it runs on the devices, where the array is."""
    words = _as_words(jnp.asarray(x)).ravel()
    weights = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(2 * 2654435761 % 2**32)
    return jnp.sum(words * (weights + jnp.uint32(1)), dtype=jnp.uint32)


@jax.jit
def checkpoint_digests(tree: Any) -> Any:
    """One program per state structure (compiled at a run's first save), not one per array."""
    return jax.tree.map(_digest, tree)


@jax.jit
def checkpoint_finite(tree: Any) -> Any:
    """Whether each floating-point array holds only finite values."""
    return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)), tree)


def array_digests(state: Any) -> dict[str, int]:
    """Dotted path -> digest of every array of ``state``: saved in a checkpoint's meta and
    checked at restore, so bytes changed after the save are found before they are trained
    on. A replicated array is digested once, from its first local copy, not on every device
    that holds one; the others in one program over the mesh."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    paths, leaves = [path for path, _ in flat], [leaf for _, leaf in flat]
    one_copy = [_replicated_copy(leaf) for leaf in leaves]
    local = {i: copy for i, copy in enumerate(one_copy) if copy is not None}
    spread = {i: leaf for i, leaf in enumerate(leaves) if one_copy[i] is None}
    digests = {}
    for group in (local, spread):
        if group:  # an empty group would still compile a program of its own
            digests.update(checkpoint_digests(group))
    values = jax.device_get([digests[i] for i in range(len(leaves))])
    return {dotted_name(path): int(value) for path, value in zip(paths, values, strict=True)}


def _replicated_copy(leaf: Any) -> jax.Array | None:
    """The first local copy of an array replicated over several devices, else ``None``."""
    if (
        isinstance(leaf, jax.Array)
        and leaf.is_fully_replicated
        and len(leaf.sharding.device_set) > 1
    ):
        return leaf.addressable_shards[0].data
    return None


class CorruptCheckpointError(ValueError):
    """A restored checkpoint's arrays are not what was saved, or are not finite."""


def check_digests(state: Any, saved: Mapping[str, int] | None) -> None:
    """Raise :class:`CorruptCheckpointError` naming the first array whose digest differs from
    the one saved with it, or that holds a non-finite value. Checkpoints saved before digests
    were recorded (``saved`` is ``None``) are checked for finite values only."""
    if saved is not None:
        found = array_digests(state)
        for name, digest in found.items():
            if saved.get(name) != digest:
                raise CorruptCheckpointError(
                    f"array {name} does not match the digest saved with it (its bytes changed "
                    "after the save)"
                )
    finite = jax.tree_util.tree_flatten_with_path(checkpoint_finite(_floating(state)))[0]
    for path, ok in finite:
        if not bool(ok):
            raise CorruptCheckpointError(f"array {dotted_name(path)} holds non-finite values")


def _floating(state: Any) -> Any:
    """The floating-point arrays of ``state`` (others are ``None``, which trees skip)."""
    return jax.tree.map(
        lambda x: x if jnp.issubdtype(getattr(x, "dtype", np.int32), jnp.floating) else None,
        state,
    )
