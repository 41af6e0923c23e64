"""Where a planned step keeps each parameter, and what its mesh axes save in memory.

A plan prints one row per kind of parameter (a block's leaves once, its layer index as
``*``) with the ``PartitionSpec`` the step places it by, and, for a step with a ``tensor``
axis, its parameters and optimizer state per chip beside what they would be were that axis
to split nothing.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxdist.training.protocol import Step

__all__ = ["placement_rows", "state_bytes_per_chip"]


def _axes_of(spec: P) -> list[str]:
    """The mesh axes a PartitionSpec splits over, in order."""
    names: list[str] = []
    for entry in spec:
        if entry is None:
            continue
        names.extend(entry if isinstance(entry, tuple) else (entry,))
    return names


def placement_rows(step: Step, params: Any, model_state: Any) -> list[tuple[str, str, str]]:
    """``(name, global shape, PartitionSpec)`` per distinct parameter of ``step``'s state,
    layer indices written ``*`` so a block's leaves appear once."""
    state = step.abstract_init(params, model_state)
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    rows: dict[str, tuple[str, str, str]] = {}
    for path, leaf in flat:
        name = re.sub(
            r"\.\d+(?=\.|$)", ".*", jax.tree_util.keystr(path, simple=True, separator=".")
        )
        shape = "x".join(map(str, leaf.shape)) or "scalar"
        rows.setdefault(name, (name, shape, str(leaf.sharding.spec)))
    return list(rows.values())


def state_bytes_per_chip(state: Any, *, ignoring: str | None = None) -> int:
    """Bytes of parameters and optimizer state one chip holds of ``state`` (a step's
    ``abstract_init``, its leaves carrying their shardings); ``ignoring``: as if the mesh
    axis of that name split nothing."""
    total = 0
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        axes = [a for a in _axes_of(leaf.sharding.spec) if a != ignoring]
        parts = math.prod(leaf.sharding.mesh.shape[a] for a in axes)
        total += math.prod(leaf.shape) * leaf.dtype.itemsize // parts
    return total
