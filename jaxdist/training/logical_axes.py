"""Logical axis rules: parameters name their dimensions, a recipe's rules map names to axes.

A model names each parameter's dimensions where it creates them (flax's
``nnx.with_partitioning`` metadata: ``("embed", "heads", "head_dim")`` for a query kernel,
``"layers"`` in front when the blocks are stacked). An ordered rule list maps names to mesh
axes with MaxText's semantics (``logical_axis_rules``): for each dimension, the first rule
for its name whose axis the same array does not already use wins; a name no rule matches,
or whose rules' axes are all taken, stays whole. Written on the command line::

    --set logical_axis_rules=heads=tensor,kv_heads=tensor,mlp=tensor

A name given no axis (``vocab=``) stays whole even where a later rule would split it.

The rules place parameters over the ``tensor`` axis (the model computes those dimensions
tensor-parallel, :mod:`jaxdist.comm.tensor_parallel`). FSDP and ZeRO-1 then split each
device's tensor block over the ``fsdp`` axis (or the data axes) by the shape rule of
:mod:`jaxdist.training.sharding`: the first dimension the shard count divides. The default
rules (:data:`DEFAULT_RULES`, used where the recipe gives none) are Megatron's split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

__all__ = [
    "DEFAULT_RULES",
    "RULE_AXES",
    "LogicalAxes",
    "Rules",
    "mesh_axes",
    "parse_rules",
    "split_dims",
]

Rules = tuple[tuple[str, str | None], ...]

# Roles a rule may split a parameter's dimension over.
RULE_AXES = ("tensor",)

# Megatron's split: attention heads and the MLP's hidden units over the tensor axis.
DEFAULT_RULES: Rules = (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"))


@dataclass(frozen=True)
class LogicalAxes:
    """A model's named dimensions.

    Attributes:
      names: a tree like the parameters: per leaf, a tuple with one name (or None) per
        dimension.
      tensor_parallel: the names whose dimensions the model computes tensor-parallel; a rule
        may map only these to ``tensor``.
    """

    names: Any
    tensor_parallel: tuple[str, ...]


def parse_rules(text: str) -> Rules:
    """``"heads=tensor,mlp=tensor,vocab="`` as ordered ``(name, axis or None)`` pairs; ``""``
    is no rules. One line naming the malformed entry otherwise."""
    rules = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, sep, axis = (s.strip() for s in entry.partition("="))
        if not sep or not name.isidentifier() or (axis and not axis.isidentifier()):
            raise ValueError(
                f"logical_axis_rules entries are name=axis (or name= to keep a "
                f"name whole), comma-separated; got {entry!r}"
            )
        rules.append((name, axis or None))
    return tuple(rules)


def check_rules(rules: Rules, mesh_axes_present: Sequence[str], axes: LogicalAxes) -> None:
    """One line for a rule that cannot hold on this mesh and model: an axis parameters are
    not split over, an axis the mesh lacks, or ``tensor`` for a name the model does not
    compute tensor-parallel."""
    for name, axis in rules:
        if axis is None:
            continue
        if axis not in RULE_AXES:
            raise ValueError(
                f"logical_axis_rules: {name}={axis}: the rules split parameters "
                f"over {' or '.join(RULE_AXES)} only (FSDP splits each block by "
                "its shape)"
            )
        if axis not in mesh_axes_present:
            raise ValueError(
                f"logical_axis_rules: {name}={axis} names an axis the mesh lacks "
                f"(its axes: {', '.join(mesh_axes_present)})"
            )
        if axis == "tensor" and name not in axes.tensor_parallel:
            raise ValueError(
                f"logical_axis_rules: {name}=tensor, but the model computes only "
                f"{', '.join(axes.tensor_parallel)} tensor-parallel"
            )


def mesh_axes(names: Sequence[str | None], rules: Rules) -> tuple[str | None, ...]:
    """Per dimension named ``names``, the mesh axis ``rules`` give it (None: whole)."""
    used: set[str] = set()
    out = []
    for name in names:
        axis = None
        for rule_name, rule_axis in rules:
            if rule_name == name and (rule_axis is None or rule_axis not in used):
                axis = rule_axis
                break
        if axis is not None:
            used.add(axis)
        out.append(axis)
    return tuple(out)


def split_dims(names: Any, rules: Rules, axis: str, shapes: Any, size: int) -> Any:
    """A tree like ``names`` (one tuple per parameter): the dimension ``rules`` split over
    ``axis`` (of ``size`` devices), or None. One line for a dimension that ``size`` does not
    divide."""

    def dim_of(path, leaf_names, shape):
        dims = [d for d, a in enumerate(mesh_axes(leaf_names, rules)) if a == axis]
        if not dims:
            return None
        dim = dims[0]
        if shape.shape[dim] % size:
            where = jax.tree_util.keystr(path, simple=True, separator=".")
            raise ValueError(
                f"{where}: dimension {dim} ({leaf_names[dim]}, "
                f"{shape.shape[dim]}) does not divide over {axis}={size}"
            )
        return dim

    return jax.tree_util.tree_map_with_path(dim_of, names, shapes, is_leaf=_is_names)


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)
